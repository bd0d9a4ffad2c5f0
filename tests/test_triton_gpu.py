"""mla_fast.triton_decode on a CUDA GPU (skipped without one): bound agreement, determinism, graphs, memcheck.

Tolerance everywhere: the kernel bound of numerics.md §5(f) with the kernel's declared KernelNumerics
(tests/triton_cases.py), err / bound <= 1; determinism and graph replay are bitwise.
"""

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from triton_cases import TritonCase, check, nan_masks_match, same_bits, smoke_prefix_our_kernels_take, with_nan_token

from mla_fast.backends import BACKENDS
from mla_fast.bench import FP8_32_ROWS  # the fp8 32-row layout (h >= 64 before 64-row tiles)
from verify.testing import mla_property_test

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent

BENCH_SHAPES = [(1, 8192, 16), (32, 4096, 16), (64, 4096, 16), (128, 4096, 16), (128, 8192, 16), (32, 16384, 16),
                (1, 8192, 128), (32, 4096, 128), (128, 4096, 128)]
VARLEN = [  # DeepSeek-V3 widths (L = 512, R = 64); ragged lengths with zeros, every page size, MTP, heads
    TritonCase((0, 1, 63, 64, 65, 1000, 4097), (1,) * 7, heads=16, page_size=64, combo="bf16", L=512, R=64),
    TritonCase((0, 3, 700, 2000), (2, 2, 2, 2), heads=32, page_size=16, combo="bf16", L=512, R=64, seed=1),
    TritonCase((5, 1500, 0), (4, 3, 1), heads=128, page_size=1, combo="bf16", L=512, R=64, seed=2),
    TritonCase((17, 333, 2500), (1, 2, 1), heads=64, page_size=3, combo="bf16", L=512, R=64, seed=3),
    TritonCase((0, 1, 63, 64, 65, 1000, 4097), (1,) * 7, heads=16, page_size=64, combo="fp8kv", L=512, R=64, seed=4),
    TritonCase((5, 1500, 0), (4, 3, 1), heads=128, page_size=16, combo="fp8kv", L=512, R=64, seed=5),
    TritonCase((0, 1, 63, 64, 65, 1000, 4097), (1,) * 7, heads=16, page_size=64, combo="fp8", L=512, R=64, seed=6),
    TritonCase((17, 333, 2500), (2, 2, 2), heads=64, page_size=3, combo="fp8", L=512, R=64, seed=7),
    # the block-table chunks at the smallest pages each cache dtype takes them (default_config): bf16 at 8 (the
    # two-step select), an fp8 cache at 4
    TritonCase((0, 7, 8, 9, 1000, 4097), (1,) * 6, heads=16, page_size=8, combo="bf16", L=512, R=64, seed=8),
    TritonCase((0, 3, 5, 2000, 333), (1, 2, 2, 1, 2), heads=16, page_size=4, combo="fp8", L=512, R=64, seed=9),
]


def _h128(combo: str, seed: int) -> TritonCase:
    """The h = 128 config case: DeepSeek-V3 widths, page 64, q_len 1, a zero-length request."""
    return TritonCase((5, 1500, 0, 4097), (1,) * 4, heads=128, page_size=64, combo=combo, L=512, R=64, seed=seed)


_STAGED = dict(fp8_stage=True, split_l=8, page_chunk=32, lazy_l=True, v_reload=False)  # the staged fp8 path
CONFIG_CASES = [  # (case, KernelConfig overrides): non-default configs, mla-bench candidates now or in earlier sessions
    (VARLEN[0], dict(block_n=32, num_stages=5)),
    (VARLEN[4], dict(page_chunk=32, num_stages=3)),
    (_h128("bf16", 12), dict(head_group=32, head_split=4, page_chunk=32, num_stages=3, block_n=32)),
    (_h128("fp8kv", 13),
     dict(head_group=16, head_split=8, page_chunk=32, num_stages=3, fp8_stage=True, v_reload=False)),
    (VARLEN[0], dict(split_l=1, num_warps=8)),
    (VARLEN[0], dict(lazy_l=True)),
    (VARLEN[4], dict(lazy_l=True)),
    (VARLEN[4], dict(split_l=4, v_reload=False)),
    (_h128("bf16", 14), dict(split_l=4)),
    (_h128("fp8kv", 15), dict(split_l=4, v_reload=False)),
    (VARLEN[2], dict(unchain=True)),
    (VARLEN[3], dict(unchain=True, block_n=32)),
    (_h128("bf16", 16), dict(unchain=True, num_warps=16, block_n=32, num_stages=3, page_chunk=32)),
    (VARLEN[0], dict(split_l=8)),
    (VARLEN[4], dict(split_l=8)),
    (VARLEN[6], dict(split_l=8, v_reload=False)),
    (VARLEN[6], dict(_STAGED, num_warps=4, num_stages=4)),
    (VARLEN[4], dict(num_stages=4)),
    (_h128("fp8kv", 19), dict(_STAGED, num_stages=4, num_warps=4, head_group=16, head_split=8)),
    (_h128("fp8", 20), dict(_STAGED, num_stages=3, num_warps=8, head_group=32, head_split=4)),
    (_h128("bf16", 18), dict(split_l=8)),
    (_h128("bf16", 22), dict(split_l=1)),
    (_h128("fp8kv", 23), FP8_32_ROWS),
    (_h128("fp8", 26), FP8_32_ROWS),
    (_h128("bf16", 24), dict(page_chunk=0)),
    (_h128("bf16", 28), dict(interleave=False)),
    (_h128("fp8kv", 29), dict(interleave=True)),
    (TritonCase((5, 1500, 0, 333), (1,) * 4, heads=128, page_size=16, combo="fp8kv", L=512, R=64, seed=27),
     dict(num_stages=2, page_chunk=0)),  # page 16: per-token gather, one tile buffered
    (VARLEN[0], dict(block_n=32, workers_per_sm=2)),
    # the page select that is not the dtype's default (BF16_PAGE_GATHER / FP8_PAGE_GATHER) on block-table chunks:
    # bf16 in one step at page 16, an fp8 cache in two at page 8 with MTP; zero-length requests
    (TritonCase((0, 15, 16, 17, 1000, 4097), (1,) * 6, heads=16, page_size=16, L=512, R=64, seed=30),
     dict(page_select=1)),
    (TritonCase((0, 7, 9, 2000, 333), (2, 2, 1, 2, 1), heads=16, page_size=8, combo="fp8kv", L=512, R=64, seed=31),
     dict(page_select=2)),
    (VARLEN[4], dict(block_n=32, num_stages=4, workers_per_sm=2)),
]


def _decode_and_check(batch, config=None, **overrides):
    """Decode of `batch` with `config` (default: default_config without a device's Gluon kernels) and `overrides`,
    checked against the fp64 oracle within the kernel + merge bound."""
    from mla_fast import triton_decode as td

    combo = td.dtype_combo(batch.q.dtype, batch.kv_cache.dtype)
    if config is None:
        config = td.default_config(combo, batch.num_heads, int(batch.q_lens.max()))
    config = replace(config, **overrides)
    plan = td.make_plan(batch, config)
    out, lse = td.decode(batch, plan=plan, config=config)
    return check(out, lse, batch, td.kernel_numerics(config, combo), plan.stats()["pieces_per_tile"]["max"])


@pytest.mark.parametrize("combo", ["bf16", "fp8kv", "fp8"])
@pytest.mark.parametrize("shape", BENCH_SHAPES, ids=lambda s: "b{}_s{}_h{}".format(*s))
def test_bench_grid_within_kernel_bound(shape, combo):
    from mla_fast.bench import build_batch

    b, s, h = shape
    r = _decode_and_check(build_batch(b, s, h, combo, seed=hash(shape) % 1000))
    assert r["finite"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


@pytest.mark.parametrize("shape", [(2, 16384, 128), (4, 16384, 64)], ids=lambda s: "b{}_s{}_h{}".format(*s))
def test_small_fp8_batches_of_long_sequences_take_the_seesaw(shape):
    """batch_config sends a small fp8-cache batch past the Gluon fp8 kernel's token rule (programs x cache tokens >
    GLUON_FP8_MAX_PROGRAM_TOKENS) to the seesaw's 64-row tiles, not the Triton 32-row path, within the kernel
    bound."""
    from mla_fast import gluon_decode
    from mla_fast import triton_decode as td
    from mla_fast.bench import build_batch

    b, s, h = shape
    batch = build_batch(b, s, h, "fp8kv", seed=b + h)
    if not gluon_decode.supported(batch):
        pytest.skip("the seesaw kernel needs sm_90")
    config = td.batch_config(batch, 1)
    assert (h // 16) * b * s > td.GLUON_FP8_MAX_PROGRAM_TOKENS
    assert (config.kernel, config.head_group) == ("gluon", 64), config
    r = _decode_and_check(batch, config)
    assert r["finite"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


PINNED = [  # (backend, case): varlen batches with zeros and MTP on pages of 64; bf16 (where the seesaw is also the
    # default's kernel), then fp8 ones that the default dispatch gives the other Gluon kernel
    ("seesaw", TritonCase((0, 63, 300, 2000), (2, 1, 3, 1), heads=128, page_size=64, L=512, R=64, seed=40)),
    ("seesaw", TritonCase((5, 129, 0, 2000), (1,) * 4, heads=64, page_size=64, combo="fp8kv", L=512, R=64,
                          seed=41)),  # default: the Gluon fp8 kernel (few cache tokens)
    ("gluon_fp8", TritonCase((3, 0, 17000), (2, 4, 2), heads=32, page_size=64, combo="fp8", L=512, R=64,
                             seed=42)),  # default: the seesaw (programs x tokens past the token rule)
]


@pytest.mark.parametrize("name,case", PINNED, ids=lambda x: x if isinstance(x, str) else f"{x.combo}_h{x.heads}")
def test_pinned_gluon_backends_run_their_kernel_within_kernel_bound(name, case):
    """The verifier's seesaw / gluon_fp8 backends run their kernel in forced_config's geometry (bitwise the output of
    decode with that config), also on fp8 batches the default dispatch gives the other Gluon kernel, within the
    kernel bound."""
    from mla_fast import backends
    from mla_fast import triton_decode as td

    batch = case.batch("cuda")
    if not backends.BACKENDS[name].probe()[0]:
        pytest.skip(backends.BACKENDS[name].probe()[1])
    q_len = max(case.q_lens)
    config = td.forced_config(case.combo, case.heads, q_len, name)
    out, lse = backends.get_backend(name)(batch)
    ref_out, ref_lse = td.decode(batch, config=config)
    assert same_bits((out, lse), (ref_out, ref_lse))
    r = _decode_and_check(batch, config)
    assert r["finite"] and r["empty_ok"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


FAR = [  # (backend, case): the default dispatch per combo and the pinned Gluon backends, at DeepSeek-V3 widths
    ("triton", TritonCase((0, 63, 300, 2000), (1, 2, 1, 1), heads=16, page_size=64, L=512, R=64, seed=70)),
    ("triton", TritonCase((5, 1500, 17), (1, 1, 2), heads=32, page_size=3, combo="fp8kv", L=512, R=64, seed=71)),
    ("triton", TritonCase((700, 33, 0), (2, 1, 1), heads=16, page_size=16, combo="fp8", L=512, R=64, seed=72)),
    ("triton", TritonCase((9, 2000), (1, 1), heads=16, page_size=8, L=512, R=64, seed=73)),  # block-table chunks
    ("seesaw", TritonCase((0, 63, 300, 2000), (2, 1, 3, 1), heads=128, page_size=64, L=512, R=64, seed=74)),
    ("seesaw", TritonCase((5, 129, 0, 2000), (1,) * 4, heads=64, page_size=64, combo="fp8kv", L=512, R=64, seed=75)),
    ("gluon_fp8", TritonCase((3, 0, 1700), (2, 4, 2), heads=32, page_size=64, combo="fp8", L=512, R=64, seed=76)),
    ("gluon_fp8", TritonCase((3, 900), (1, 1), heads=16, page_size=16, combo="fp8kv", L=512, R=64, seed=77)),
]


@pytest.mark.parametrize("name,case", FAR, ids=lambda x: x if isinstance(x, str) else f"{x.combo}_p{x.page_size}")
def test_pages_past_2_31_elements_give_the_bits_of_the_compact_cache(name, case):
    """verify.checks.far_pages moves the used pages past element 2^31 and page id 2^16 of a 4.3-4.8 GB (bf16) or
    2.1-2.4 GB (fp8) cache, NaN in front: page offsets computed in int32, and 16-bit page ids, wrap there. Same
    lengths, same plan: the same bits, no NaN."""
    from mla_fast import backends
    from verify.checks import far_pages

    if not backends.BACKENDS[name].probe()[0]:
        pytest.skip(backends.BACKENDS[name].probe()[1])
    backend = backends.get_backend(name)
    batch = case.batch("cuda")
    near = backend(batch)
    far = far_pages(batch)
    assert far.kv_cache.numel() > 2**31  # its layout: tests/test_far_pages.py
    got = backend(far)
    torch.cuda.synchronize()
    assert same_bits(near, got) and not bool(torch.isnan(got[0].float()).any())


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"{c.combo}_h{c.heads}_p{c.page_size}_s{c.seed}")
def test_strided_inputs_give_the_triton_kernels_bits_and_gluon_refuses_them_by_name(case):
    """verify.strided_inputs.strided_batch: q, cache and block table as views into NaN-padded buffers. The Triton
    kernel takes their strides: the bits of the contiguous batch on one plan and config, no NaN. The default
    dispatch (the triton backend) takes the Triton kernel for them, within the kernel bound of what it declares for
    them; the pinned Gluon backends, whose TMA descriptors need contiguous q and cache, refuse them by name."""
    from mla_fast import backends
    from mla_fast import triton_decode as td
    from verify.strided_inputs import strided_batch

    batch = case.batch("cuda")
    strided = strided_batch(batch).batch
    config = td.default_config(case.combo, case.heads, max(case.q_lens))  # the Triton kernel's (no Gluon here)
    plan = td.make_plan(batch, config)
    dense, got = td.decode(batch, plan=plan, config=config), td.decode(strided, plan=plan, config=config)
    torch.cuda.synchronize()
    assert same_bits(dense, got) and not bool(torch.isnan(got[0].float()).any())
    assert td.batch_config(strided, max(case.q_lens)).kernel == "triton"
    out, lse = backends.get_backend("triton")(strided)
    numerics = backends.BACKENDS["triton"].numerics(strided)
    pieces = td.make_plan(strided, td.batch_config(strided, max(case.q_lens))).stats()["pieces_per_tile"]["max"]
    r = check(out, lse, strided, numerics, pieces)
    assert r["finite"] and r["empty_ok"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r
    for name in ("seesaw", "gluon_fp8"):
        try:
            backends.BACKENDS[name].run(batch)  # a pinned kernel that takes the contiguous batch ...
        except backends.Unsupported:
            continue
        with pytest.raises(backends.Unsupported, match="contiguous"):  # ... refuses its strided copy by name
            backends.BACKENDS[name].run(strided)


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"{c.combo}_h{c.heads}_p{c.page_size}_s{c.seed}")
def test_outputs_passed_as_strided_views_get_the_bits_of_fresh_ones(case):
    """decode(out=, lse=) takes outputs with any row and head stride (`check_outputs`): views into NaN-filled
    buffers (`triton_cases.strided_outputs`) get the bits of freshly allocated outputs on one plan, with the
    dispatched kernel (Gluon where it applies) and with the Triton kernel, and every element around them stays NaN
    (a store with another tensor's head stride, or past the view, shows). The interpreter runs the Triton kernel's
    half on small cases (tests/test_triton_decode.py)."""
    from triton_cases import outside_is_nan, strided_outputs

    from mla_fast import triton_decode as td

    batch = case.batch("cuda")
    for config in {td.batch_config(batch, max(case.q_lens)), td.default_config(case.combo, case.heads,
                                                                               max(case.q_lens))}:
        plan = td.make_plan(batch, config)
        dense = td.decode(batch, plan=plan, config=config)
        out, lse, out_buffer, lse_buffer = strided_outputs(*dense[0].shape, device="cuda")
        got = td.decode(batch, plan=plan, config=config, out=out, lse=lse)
        torch.cuda.synchronize()
        assert same_bits(dense, got), config.kernel
        assert outside_is_nan(out, out_buffer) and outside_is_nan(lse, lse_buffer), config.kernel


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"{c.combo}_h{c.heads}_p{c.page_size}_s{c.seed}")
def test_varlen_within_kernel_bound(case):
    r = _decode_and_check(case.batch("cuda"))
    assert r["finite"] and r["empty_ok"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


@pytest.mark.parametrize("combo", ["bf16", "fp8kv"])
def test_long_tail_reduce_in_several_steps_within_kernel_bound(combo):
    """One long request among 63 short ones that the plan splits too: plan_reduce_pieces merges the long tile's
    pieces in several steps (fewer per step than it has) over the split tiles' grid; out and lse within the kernel +
    merge bound."""
    from mla_fast import triton_decode as td

    case = TritonCase((8192,) + (700,) * 63, (1,) * 64, heads=16, page_size=64, combo=combo, L=512, R=64, seed=11)
    batch = case.batch("cuda")
    config = td.default_config(combo, 16, 1)
    plan = td.make_plan(batch, config)
    pieces = td.plan_reduce_pieces(plan, td.reduce_rows(config, config.head_group), 512,
                                   td.num_sms(batch.q.device))
    assert plan.split_tiles == 64 and pieces < plan.max_pieces, (plan.split_tiles, pieces, plan.max_pieces)
    r = _decode_and_check(batch, config)
    assert r["finite"] and r["empty_ok"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


@pytest.mark.parametrize("case,overrides", CONFIG_CASES, ids=lambda x: str(x)[:60] if isinstance(x, dict) else None)
def test_bench_candidate_configs_within_kernel_bound(case, overrides):
    r = _decode_and_check(case.batch("cuda"), **overrides)
    assert r["finite"] and r["empty_ok"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


@pytest.mark.parametrize("case", [VARLEN[0], VARLEN[5]], ids=["bf16", "fp8kv"])
def test_bitwise_deterministic_over_10_runs(case):
    from mla_fast.triton_decode import decode, default_config, dtype_combo, make_plan

    batch = case.batch("cuda")
    config = default_config(dtype_combo(batch.q.dtype, batch.kv_cache.dtype), case.heads, max(case.q_lens))
    plan = make_plan(batch, config)
    out0, lse0 = decode(batch, plan=plan, config=config)
    for _ in range(10):  # into NaN-poisoned buffers: a run that left some output unwritten cannot look repeatable
        out, lse = torch.full_like(out0, float("nan")), torch.full_like(lse0, float("nan"))
        decode(batch, plan=plan, config=config, out=out, lse=lse)
        assert same_bits((out, lse), (out0, lse0))


@pytest.mark.parametrize("combo", ["bf16", "fp8kv"])
def test_interleave_gives_the_same_bits(combo, monkeypatch):
    """interleave only reorders the program (each slice's score dot after its load): the same bits on the device,
    on the 64-row wgmma layout (bf16: the default) and with the staged fp8 tile; the launches' INTERLEAVE
    constexprs show that both values reached the kernel."""
    from dataclasses import replace

    from triton_cases import LaunchRecorder

    from mla_fast import triton_decode as td

    case = _h128(combo, 30)
    batch = case.batch("cuda")
    config = td.default_config(combo, case.heads, 1)
    plan = td.make_plan(batch, config)
    monkeypatch.setattr(td, "_mla_decode_kernel", LaunchRecorder(td._mla_decode_kernel))
    (out0, lse0), (out1, lse1) = (td.decode(batch, plan=plan, config=replace(config, interleave=f))
                                  for f in (False, True))
    assert [launch["INTERLEAVE"] for launch in td._mla_decode_kernel.launches] == [False, True]
    assert same_bits((out0, lse0), (out1, lse1))


@pytest.mark.parametrize("case, kernel", [
    (TritonCase((65536,), (1,), heads=16, page_size=64, L=512, R=64, seed=12), "triton"),
    (VARLEN[3], "triton"),  # varlen, MTP, pages of 3 (VARLEN[1]'s pages of 16 go to the seesaw on an H200: skipped)
    (TritonCase((65536,), (1,), heads=128, page_size=64, L=512, R=64, seed=13), "gluon"),  # calls launch_dependents
    (TritonCase((65536,), (1,), heads=16, page_size=64, combo="fp8kv", L=512, R=64, seed=14), "gluon_fp8"),
], ids=["b1_128_pieces", "varlen_mtp", "seesaw_h128", "gluon_fp8"])
def test_programmatic_dependent_reduce_gives_the_serial_bits(case, kernel):
    """The reduce kernel launched with programmatic dependent launch (it may start while decode runs and waits in
    gdc_wait) gives the bits of the serialised launch, after each decode kernel (the default dispatch here: the
    Triton kernel, the seesaw kernel, which calls gdc_launch_dependents too, and the Gluon fp8 kernel, which does
    not). The launches replay from a CUDA graph (no host gap between the two kernels) and the workspace is
    NaN-poisoned before every replay, so a reduce that read a partial before decode wrote it would show as NaN or
    other bits."""
    from mla_fast.triton_decode import batch_config, launch, make_plan, pdl_supported

    batch = case.batch("cuda")
    if not pdl_supported(batch.q.device):
        pytest.skip("programmatic dependent launch needs sm_90+")
    config = batch_config(batch, max(case.q_lens))
    if config.kernel != kernel:
        pytest.skip(f"the default dispatch here takes kernel={config.kernel!r}, not {kernel!r} (Gluon: sm_90 only)")
    plan = make_plan(batch, config)
    assert plan.num_partial_rows > 0  # the reduce runs
    T, H, L = batch.q.shape[0], case.heads, batch.kv_lora_rank
    workspace = (torch.empty(plan.num_partial_rows, H, L, device="cuda"),
                 torch.empty(plan.num_partial_rows, H, device="cuda"))
    out, lse = torch.empty(T, H, L, dtype=torch.bfloat16, device="cuda"), torch.empty(T, H, device="cuda")

    def run(pdl: bool):
        launch(batch, plan, out, lse, config, workspace=workspace, max_rows=max(case.q_lens) * config.head_group,
               pdl=pdl)

    run(False)
    out0, lse0 = out.clone(), lse.clone()
    assert not out0.isnan().any()
    run(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(True)
    for _ in range(5):
        for t in (out, lse, *workspace):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits((out, lse), (out0, lse0))


@pytest.mark.parametrize("case, kernel", [
    (TritonCase((4096,) * 32, (1,) * 32, heads=16, page_size=64, L=512, R=64, seed=20), "triton"),
    (TritonCase((4096,) * 32, (1,) * 32, heads=16, page_size=64, combo="fp8kv", L=512, R=64, seed=21), "gluon_fp8"),
    (TritonCase((1000, 3000, 0, 700) * 8, (1,) * 32, heads=128, page_size=64, L=512, R=64, seed=22), "gluon"),
], ids=["triton", "gluon_fp8", "seesaw"])
def test_one_item_per_worker_gives_the_worker_range_bits(case, kernel):
    """Plans with one item per worker (WorkPlan.one_item_per_worker, the even plan) let each kernel take item w
    without reading worker_indptr; same bits as reading it. The out buffer is NaN-poisoned before each run."""
    from mla_fast.triton_decode import batch_config, decode, dtype_combo, kernel_numerics, make_plan

    batch = case.batch("cuda")
    config = batch_config(batch, 1)
    if config.kernel != kernel:
        pytest.skip(f"the default dispatch here takes kernel={config.kernel!r}, not {kernel!r} (Gluon: sm_90 only)")
    plan = make_plan(batch, config)
    assert plan.one_item_per_worker
    T, H, L = batch.q.shape[0], case.heads, batch.kv_lora_rank
    runs = []
    for flag in (True, False):
        out = torch.full((T, H, L), float("nan"), dtype=torch.bfloat16, device="cuda")
        runs.append(decode(batch, plan=replace(plan, one_item_per_worker=flag), config=config, out=out))
    assert not runs[0][0].isnan().any()
    assert same_bits(runs[0], runs[1])
    numerics = kernel_numerics(config, dtype_combo(batch.q.dtype, batch.kv_cache.dtype))
    result = check(*runs[0], batch, numerics, plan.stats()["pieces_per_tile"]["max"])
    assert result["out_ratio"] <= 1.0 and result["lse_ratio"] <= 1.0, result


PAIR_CASES = [  # (case, num_workers): plans whose tiles all split in two (WorkPlan.paired_splits), default configs
    (TritonCase((4096,) * 64, (1,) * 64, heads=16, page_size=64, L=512, R=64, seed=40), None),  # mla-bench's shape
    (TritonCase((777,) * 6, (1,) * 6, heads=16, page_size=16, L=512, R=64, seed=41), 12),  # ragged last tile, page 16
    (TritonCase((4096,) * 3, (2,) * 3, heads=16, page_size=3, L=512, R=64, seed=42), 6),  # MTP: 32 rows, 8 warps
    (TritonCase((1000,) * 8, (1,) * 8, heads=32, page_size=64, L=512, R=64, seed=43), 16),  # 32 heads in one group
    (TritonCase((1000,) * 8, (1,) * 8, heads=16, page_size=64, combo="fp8kv", L=512, R=64, seed=44), 16),  # staged
    (TritonCase((1000,) * 8, (1,) * 8, heads=16, page_size=64, combo="fp8", L=512, R=64, seed=45), 16),  # fp8: lazy_l
]


def _pair_id(x) -> str:
    return f"{x.combo}_h{x.heads}_q{max(x.q_lens)}_p{x.page_size}" if isinstance(x, TritonCase) else f"w{x}"


@pytest.mark.parametrize("case, num_workers", PAIR_CASES, ids=_pair_id)
def test_pair_merge_gives_the_reduce_bits(case, num_workers):
    """Plans whose tiles all split in two merge each pair in the kernel, on 2-CTA clusters (mla_fast.dsmem): the bits
    of decode + reduce (pair_merge=False), every output row written (out, lse and the workspace NaN-poisoned: the
    pair path writes no partials), 10 runs and a CUDA graph replay bitwise equal, within the kernel bound."""
    from mla_fast import dsmem
    from mla_fast.triton_decode import (
        decode,
        default_config,
        dtype_combo,
        kernel_numerics,
        launch,
        make_plan,
        pair_merge_applies,
    )

    batch = case.batch("cuda")
    if not dsmem.supported(batch.q.device, False):
        pytest.skip("the pair merge needs CUDA sm_90+ and Triton 3.6")
    q_len = max(case.q_lens)
    config = default_config(dtype_combo(batch.q.dtype, batch.kv_cache.dtype), case.heads, q_len, len(case.seq_lens))
    plan = make_plan(batch, config, num_workers)
    assert plan.paired_splits and pair_merge_applies(plan, config, batch.q.device, batch.kv_lora_rank)
    T, H, L = batch.q.shape[0], case.heads, batch.kv_lora_rank
    out, lse = torch.empty(T, H, L, dtype=torch.bfloat16, device="cuda"), torch.empty(T, H, device="cuda")
    workspace = (torch.empty(plan.num_partial_rows, H, L, device="cuda"),
                 torch.empty(plan.num_partial_rows, H, device="cuda"))

    def run(pair: bool):
        for t in (out, lse, *workspace):
            t.fill_(float("nan"))
        compiled = launch(batch, plan, out, lse, replace(config, pair_merge=pair), workspace=workspace,
                          max_rows=q_len * config.head_group)
        torch.cuda.synchronize()
        return compiled, out.clone(), lse.clone()

    _, out0, lse0 = run(False)
    compiled, out1, lse1 = run(True)
    assert compiled.packed_metadata[1] == 2  # launched as 2-CTA clusters
    assert workspace[0].isnan().all() and workspace[1].isnan().all()  # no partials written
    assert not out1.isnan().any() and not lse1.isnan().any()
    assert same_bits((out1, lse1), (out0, lse0))
    for _ in range(10):
        _, out2, lse2 = run(True)
        assert same_bits((out2, lse2), (out1, lse1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(batch, plan, out, lse, config, workspace=workspace, max_rows=q_len * config.head_group)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits((out, lse), (out1, lse1))
    out3, lse3 = decode(batch, plan=plan, config=config)  # no workspace given: launch allocates a one-row stand-in
    assert same_bits((out3, lse3), (out1, lse1))
    result = check(out1, lse1, batch, kernel_numerics(config, dtype_combo(batch.q.dtype, batch.kv_cache.dtype)), 2)
    assert result["finite"] and result["out_ratio"] <= 1.0 and result["lse_ratio"] <= 1.0, result


def _check_graph_replays_equal_eager(step, lens_list):
    """Capture `step.run()` (already compiled) in a CUDA graph; for each seq_lens in lens_list (shrinking in place,
    so every page stays valid) re-plan (every other time from host copies of the lengths), replay with `out`
    NaN-poisoned, and compare the bits with an eager decode at the step's reduce_pieces (its fixed reduce shape sets
    the merge's summation order)."""
    from mla_fast.triton_decode import decode, make_plan

    batch = step.batch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    q_lens = batch.q_lens.cpu()
    for i, new_lens in enumerate(lens_list):
        lens = torch.tensor(new_lens, dtype=torch.int32)
        batch.seq_lens.copy_(lens)
        if i % 2:  # from host copies of the lengths: no sync, the plan's copy to the device is asynchronous
            step.plan(seq_lens=lens, q_lens=q_lens)
        else:
            step.plan()
        step.out.fill_(float("nan"))
        graph.replay()
        plan = make_plan(batch, step.config, step.num_workers)
        out, lse = decode(batch, plan=plan, config=step.config, reduce_pieces=step.reduce_pieces)
        torch.cuda.synchronize()
        assert same_bits((step.out, step.lse), (out, lse)), new_lens


def test_cuda_graph_replay_equals_eager():
    """Replays after re-planning equal eager decodes bit for bit (the eager decode takes the step's reduce_pieces, its
    fixed reduce shape, which sets the merge's summation order)."""
    from mla_fast.triton_decode import TritonMLADecode

    case = TritonCase((100, 0, 3000, 700), (1, 1, 1, 1), heads=16, page_size=64, L=512, R=64, seed=11)
    step = TritonMLADecode(case.batch("cuda"))
    step.plan()
    step.run()  # compile outside the capture
    _check_graph_replays_equal_eager(step, ([100, 0, 3000, 700], [50, 0, 2000, 64]))


INVARIANT_CASES = [  # (combo, heads, max_q_len, page_size): the kernels invariant_config takes on an H200 (bf16:
    # the Triton kernel at 16 rows, the seesaw at 64; fp8 caches: the Gluon fp8 kernel at 16 heads (q_len 1-2), the
    # fp8 seesaw at 128 heads, the staged Triton path on pages of 3), on pages of 64, 16 and 3
    ("bf16", 16, 1, 64), ("bf16", 16, 4, 16), ("bf16", 128, 1, 64), ("bf16", 64, 2, 3),
    ("fp8kv", 16, 1, 64), ("fp8kv", 128, 1, 16), ("fp8", 16, 2, 64), ("fp8", 128, 1, 64), ("fp8kv", 16, 1, 3),
]


@pytest.mark.parametrize("combo, heads, max_q_len, page_size", INVARIANT_CASES, ids=str)
def test_decode_invariant_keeps_each_requests_bits_in_any_batch(combo, heads, max_q_len, page_size):
    """decode_invariant: every request's rows have the same bits in its batch, in the batch regrouped (reversed,
    one dropped, the longest again and a longer request; and beside a 2-row request, declared max_q_len 2:
    verify.regrouped) and alone, while the default decode's
    move (its plan cuts a request where the batch puts the cuts); the rows within the kernel bound (err / bound <= 1)
    with the merge of the invariant plan's pieces; the graph-capturable invariant_step replayed gives the eager
    bits."""
    from mla_fast.triton_decode import (
        INVARIANT_SPLIT_TOKENS,
        decode,
        decode_invariant,
        invariant_config,
        invariant_step,
        kernel_numerics,
    )
    from verify.regrouped import regrouped_batches

    q_lens = tuple((1 + i % max_q_len) for i in range(6))
    case = TritonCase((4097, 0, 1500, 64, 9000, 700), q_lens, heads=heads, page_size=page_size, combo=combo,
                      L=512, R=64, seed=heads + max_q_len)
    batch = case.batch("cuda")
    out, lse = decode_invariant(batch, max_q_len=max_q_len)
    numerics = kernel_numerics(invariant_config(batch, max_q_len), combo)
    r = check(out, lse, batch, numerics, num_splits=-(-9000 // INVARIANT_SPLIT_TOKENS))
    assert r["out_ratio"] <= 1 and r["lse_ratio"] <= 1 and r["empty_ok"], r
    regroupings = regrouped_batches(batch)  # grown, shrunk, mtp
    for g in regroupings:
        if g.batch.batch_size > g.compared.batch_size and g.how == "mtp":  # its added 2-row request is past the
            # declared max_q_len 1: refused by name; declared 2, the plain requests keep their bits beside it
            with pytest.raises(ValueError, match="max_q_len must be >="):
                decode_invariant(g.batch, max_q_len=max_q_len)
            wide = decode_invariant(batch, max_q_len=2)
            got = tuple(map(g.case_rows, decode_invariant(g.batch, max_q_len=2)))
            assert same_bits(got, (wide[0][g.rows], wide[1][g.rows])), g.how
            continue
        got = tuple(map(g.case_rows, decode_invariant(g.batch, max_q_len=max_q_len)))  # the case's requests' rows
        assert same_bits(got, (out[g.rows], lse[g.rows])), g.how
    regrouped = regroupings[0]
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    for b in range(len(q_lens)):
        rows = slice(starts[b], starts[b + 1])
        alone = batch.replace(q=batch.q[rows], block_table=batch.block_table[b:b + 1],
                              seq_lens=batch.seq_lens[b:b + 1], q_lens=batch.q_lens[b:b + 1])
        assert same_bits(decode_invariant(alone, max_q_len=max_q_len), (out[rows], lse[rows])), b
    default, default_again = decode(batch), decode(regrouped.batch)  # the property is not vacuous: these move
    default_again = tuple(map(regrouped.case_rows, default_again))
    assert not same_bits(default_again, (default[0][regrouped.rows], default[1][regrouped.rows]))
    step = invariant_step(batch, max_q_len)
    step.plan()
    step.run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    step.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits((step.out, step.lse), (out, lse))


_MEMCHECK_SCRIPT = """
import torch
from triton_cases import TritonCase
from mla_fast.triton_decode import decode, forced_config
cases = [  # page 16 with MTP (bf16: 64-row tiles at q_len 3, per-token gather; fp8 KV: the Gluon fp8 kernel's TMA
    # copies of one page each, pages past seq_len not read); page 64 at 128 heads (block-table chunks; five requests:
    # bf16 takes the Gluon seesaw kernel on an H200, TMA copies of whole tiles past seq_len)
    dict(seq_lens=(0, 1, 65, 700, 1500), q_lens=(1, 2, 1, 3, 1), heads=16, page_size=16),
    dict(seq_lens=(0, 1, 65, 700, 4097), q_lens=(1,) * 5, heads=128, page_size=64),
    # page 64 at 16 heads: fp8 KV takes the Gluon fp8 kernel on an H200 (whole TMA tiles past seq_len)
    dict(seq_lens=(0, 1, 65, 700, 4097), q_lens=(1,) * 5, heads=16, page_size=64),
    # six requests split in two on 12 workers: bf16 merges each pair in the kernel on sm_90 (mla_fast.dsmem); fp8
    # KV: the Gluon fp8 kernel on pages of 16
    dict(seq_lens=(777,) * 6, q_lens=(1,) * 6, heads=16, page_size=16, num_workers=12),
    # page 16 at 128 heads: the seesaw's grouped layout (bf16: 4-D copies of c_kv halves); fp8 KV: the Gluon fp8
    # kernel (few cache tokens)
    dict(seq_lens=(0, 1, 17, 700, 2049), q_lens=(1,) * 5, heads=128, page_size=16),
    # pages of 3 (no TMA kernel takes them): the Triton kernel, fp8 KV through its staged path, MTP
    dict(seq_lens=(0, 1, 65, 700), q_lens=(1, 2, 1, 1), heads=16, page_size=3),
    # the fp8 seesaw forced (default_config gives it larger batches than these): its loader partition's plain loads
    # (after each pair's L2 prefetch) on pages of 64, 16 and 32, the runtime head split of 2 (128 heads) and 1
    # (64 heads, fp8 q), and MTP at 32 heads x 2 query rows on pages of 32
    dict(seq_lens=(0, 1, 65, 700, 4097), q_lens=(1,) * 5, heads=128, page_size=64, kernel="seesaw",
         combos=("fp8kv",)),
    dict(seq_lens=(0, 1, 65, 700, 4097), q_lens=(1,) * 5, heads=64, page_size=64, kernel="seesaw", combos=("fp8",)),
    dict(seq_lens=(0, 1, 17, 700, 2049), q_lens=(1,) * 5, heads=128, page_size=16, kernel="seesaw",
         combos=("fp8kv",)),
    dict(seq_lens=(0, 3, 100, 1000), q_lens=(1, 2, 2, 1), heads=32, page_size=32, kernel="seesaw",
         combos=("fp8kv",)),
]
for kw in cases:
    for combo in kw.get("combos", ("bf16", "fp8kv")):
        case = TritonCase(kw["seq_lens"], kw["q_lens"], heads=kw["heads"], page_size=kw["page_size"], combo=combo,
                          L=512, R=64)
        config = forced_config(combo, kw["heads"], max(kw["q_lens"]), kw["kernel"]) if "kernel" in kw else None
        out, lse = decode(case.batch("cuda"), config=config, num_workers=kw.get("num_workers"))
        torch.cuda.synchronize()
        assert not out.isnan().any()
print("memcheck-done")
"""


NAN_INPUT_CASES = [  # (kernel or None for the default dispatch, combo, heads, page_size, q_lens)
    (None, "bf16", 16, 64, (2, 1)),  # the Triton kernel
    (None, "fp8kv", 16, 16, (2, 1)),
    ("seesaw", "bf16", 128, 64, (2, 1)),
    ("seesaw", "fp8kv", 128, 16, (1, 1)),  # its fp8 loader partition
    ("seesaw", "fp8", 64, 64, (2, 1)),
    ("gluon_fp8", "fp8kv", 16, 64, (2, 1)),
    ("gluon_fp8", "fp8", 16, 16, (1, 1)),  # fp8 score MMAs
]


@pytest.mark.parametrize("kernel, combo, heads, page_size, q_lens", NAN_INPUT_CASES,
                         ids=lambda v: str(v) if not isinstance(v, tuple) else f"q{max(v)}")
def test_a_nan_input_gives_nan_out_and_lse_split_or_not(kernel, combo, heads, page_size, q_lens):
    """A NaN in a valid cache token (token 2000 of request 0, seen by all its query rows) gives NaN out and lse in
    exactly the oracle's rows, on one worker (unsplit) and on the device's workers (split: the reduce, or the pair
    merge where the plan pairs its pieces); request 1 stays finite. Before, the epilogues took the NaN row sum for
    an empty row (lse -inf) and the reduce merged that partial as empty: finite, wrong output."""
    from mla_fast import triton_decode as td
    from mla_ref.decode import mla_decode_ref

    if kernel is not None and not _sm90():
        pytest.skip("the Gluon kernels need sm_90")
    batch = with_nan_token(TritonCase((2048, 40), q_lens, heads=heads, page_size=page_size, combo=combo, L=512, R=64,
                                      seed=80).batch("cuda"), 0, 2000)
    ref_out, ref_lse = mla_decode_ref(batch)
    if kernel:
        config = td.forced_config(combo, heads, max(q_lens), kernel)
    else:  # the Triton kernel (default_config without the device's Gluon kernels)
        config = td.default_config(combo, heads, max(q_lens))
    assert (config.kernel == "triton") == (kernel is None), config
    splits = []
    for workers in (1, None):
        plan = td.make_plan(batch, config, workers)
        out, lse = td.decode(batch, plan=plan, config=config)
        splits.append(plan.num_partial_rows > 0)
        assert nan_masks_match(out, lse, ref_out, ref_lse), (workers, lse)
    assert splits == [False, True] and bool(torch.isnan(ref_lse[: q_lens[0]]).all())


def test_a_nan_input_gives_nan_through_the_pair_merge():
    """The pair merge (mla_fast.dsmem) propagates a NaN piece as the reduce does: NaN out and lse in request 0's
    rows, the oracle's mask, the other requests finite."""
    from mla_fast import dsmem
    from mla_fast import triton_decode as td
    from mla_ref.decode import mla_decode_ref

    case, num_workers = PAIR_CASES[1]
    batch = case.batch("cuda")
    if not dsmem.supported(batch.q.device, False):
        pytest.skip("the pair merge needs CUDA sm_90+ and Triton 3.6")
    batch = with_nan_token(batch, 0, 700)
    config = td.default_config(case.combo, case.heads, 1, len(case.seq_lens))
    plan = td.make_plan(batch, config, num_workers)
    assert td.pair_merge_applies(plan, config, batch.q.device, batch.kv_lora_rank)
    out, lse = td.decode(batch, plan=plan, config=config)
    ref_out, ref_lse = mla_decode_ref(batch)
    assert nan_masks_match(out, lse, ref_out, ref_lse)
    assert bool(torch.isnan(lse[0]).all()) and bool(torch.isfinite(lse[1:]).all())


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_compute_sanitizer_memcheck_clean_on_nan_padded_varlen():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    proc = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "17", sys.executable, "-c", _MEMCHECK_SCRIPT],
        capture_output=True, text=True, env=env, timeout=500,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and "memcheck-done" in proc.stdout, tail
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr, tail


def _gluon(heads: int, q_len: int = 1, combo: str = "bf16") -> dict:
    """KernelConfig overrides of the warp-specialized seesaw kernel (mla_fast.gluon_decode): default_config's
    geometry for bf16 with seesaw (q_len x head_group <= 64 packed rows per program), fp16 MMAs for fp8 caches."""
    from mla_fast.numerics import DEFAULT_MMA
    from mla_fast.triton_decode import default_config

    config = default_config("bf16", heads, q_len, 32, seesaw=True)
    assert config.kernel == "gluon", config
    return dict(kernel="gluon", head_group=config.head_group, head_split=config.head_split, mma=DEFAULT_MMA[combo])


GLUON_CASES = [  # bf16, pages of 64 or 128: zero-length requests, odd tile counts, partial last tiles, MTP
    TritonCase((5, 1500, 0, 4097), (1,) * 4, heads=128, page_size=64, L=512, R=64, seed=40),
    TritonCase((64, 65, 127, 129, 3000, 1), (1,) * 6, heads=128, page_size=128, L=512, R=64, seed=41),
    TritonCase((1, 200, 0, 4096), (1,) * 4, heads=64, page_size=64, L=512, R=64, seed=42),
    TritonCase((65536,), (1,), heads=128, page_size=64, L=512, R=64, seed=43),  # one request split over all SMs
    # MTP: 2 x 32 heads per program at 128 heads; 4 x 16 at 16 heads; 3 x 16 (48 of 64 rows) at 64 heads; the
    # requests' q_lens differ (rows past an item's q_len unused), long requests are split (causal limits per row)
    TritonCase((5, 1500, 0, 4097), (2, 1, 2, 2), heads=128, page_size=64, L=512, R=64, seed=44),
    TritonCase((700, 3, 20000), (4, 4, 1), heads=16, page_size=64, L=512, R=64, seed=45),
    TritonCase((1000, 70, 9000), (3, 2, 3), heads=64, page_size=128, L=512, R=64, seed=46),
    # 32 rows (half the tile): 32 heads at q_len 1, 16 heads at q_len 2
    TritonCase((5, 1500, 0, 4097), (1,) * 4, heads=32, page_size=64, L=512, R=64, seed=47),
    TritonCase((700, 3, 20000, 0), (2, 2, 1, 2), heads=16, page_size=128, L=512, R=64, seed=48),
    # 600 requests of 1-3 tiles: most workers run several items, one of an odd tile count before a longer one, where
    # the two tile slots' use counts (their barrier phases) part; no case above gives a worker such a pair
    # (tests/test_kernel_mutants.py; the sixty-eighth session's mutant S28 passed all of them)
    TritonCase(tuple(64 * (1 + i % 3) - (i * 7) % 13 for i in range(600)), (1,) * 600, heads=128, page_size=64, L=512,
               R=64, seed=49),
]


# the same batches with e4m3fn caches, bf16 and e4m3fn q in turn: the seesaw kernel's loader partition converts each
# fp8 tile to fp16 (one dtype per batch: each geometry and dtype is another Gluon compile on the device)
SEESAW_FP8_CASES = [replace(case, combo=("fp8kv", "fp8")[i % 2], seed=case.seed + 100)
                    for i, case in enumerate(GLUON_CASES)]


def _sm90():
    return torch.cuda.get_device_capability() == (9, 0)


# pages of 16 and 32 (c_kv in the grouped layouts, bf16 or its fp8 staging, one 4-D copy per page; k_pe one box per
# page): partial last pages and tiles, pages past an item's last token, zero-length requests, splits, MTP
SEESAW_SMALL_PAGE_CASES = [
    TritonCase((0, 1, 15, 16, 17, 63, 64, 65, 1000, 4097), (1,) * 10, heads=128, page_size=16, L=512, R=64, seed=70),
    TritonCase((5, 1500, 0, 4097, 33), (1,) * 5, heads=128, page_size=32, combo="fp8kv", L=512, R=64, seed=71),
    TritonCase((700, 3, 20000, 0), (2, 2, 1, 2), heads=64, page_size=16, combo="fp8", L=512, R=64, seed=72),
    TritonCase((0, 31, 32, 33, 2000, 4097), (1,) * 6, heads=128, page_size=32, L=512, R=64, seed=73),  # bf16, 2 boxes
    # bf16 MTP on pages of 16 (the grouped layout, gluon_decode.GROUPED_PAGES), 32 heads: 2 x 32 packed rows
    TritonCase((700, 3, 2000, 0, 129), (2, 2, 1, 2, 2), heads=32, page_size=16, L=512, R=64, seed=75),
]


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon' needs sm_90")
@pytest.mark.parametrize("case", GLUON_CASES + SEESAW_FP8_CASES + SEESAW_SMALL_PAGE_CASES,
                         ids=lambda c: f"{c.combo}_h{c.heads}_p{c.page_size}_q{max(c.q_lens)}_s{c.seed}")
def test_gluon_seesaw_within_kernel_bound(case):
    r = _decode_and_check(case.batch("cuda"), **_gluon(case.heads, max(case.q_lens), case.combo))
    assert r["finite"] and r["empty_ok"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon' needs sm_90")
@pytest.mark.parametrize("case", SEESAW_SMALL_PAGE_CASES, ids=lambda c: f"{c.combo}_p{c.page_size}_s{c.seed}")
def test_gluon_seesaw_small_pages_give_the_bits_of_pages_of_64(case):
    """As the Gluon fp8 kernel's (`_check_small_pages_give_the_bits_of_pages_of_64`)."""
    _check_small_pages_give_the_bits_of_pages_of_64(case, _gluon(case.heads, max(case.q_lens), case.combo))


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon' needs sm_90")
@pytest.mark.parametrize("combo", ["bf16", "fp8kv", "fp8"])
@pytest.mark.parametrize("shape", [s for s in BENCH_SHAPES if s[2] == 128], ids=lambda s: "b{}_s{}_h{}".format(*s))
def test_gluon_seesaw_bench_grid_within_kernel_bound(shape, combo):
    from mla_fast.bench import build_batch

    b, s, h = shape
    r = _decode_and_check(build_batch(b, s, h, combo, seed=hash(shape) % 1000), **_gluon(h, 1, combo))
    assert r["finite"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


def _check_page_rule_gives_the_same_bits(case, overrides: dict, module, constant: str, monkeypatch,
                                         rule: str = "grouped_layout"):
    """The batch decoded with KernelConfig(**overrides) with a per-page-size path on (module.<constant> at its value:
    module.<rule>, e.g. the grouped layout, is taken for the case's page size) and off (the constant emptied, as
    config_ab's A/B does): the same values reach the same MMA steps in the same order, so out and lse are bitwise
    the same."""
    from mla_fast import triton_decode as td

    config = td.KernelConfig(**overrides)
    batch = case.batch("cuda")
    results = []
    for value in (getattr(module, constant), ()):
        monkeypatch.setattr(module, constant, value)
        assert getattr(module, rule)(batch.kv_cache) == bool(value)
        results.append(td.decode(batch, plan=td.make_plan(batch, config), config=config))
    assert same_bits(*results)  # on, off


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon' needs sm_90")
@pytest.mark.parametrize("case", [GLUON_CASES[0], GLUON_CASES[6]], ids=lambda c: f"h{c.heads}_p{c.page_size}")
def test_gluon_seesaw_grouped_layout_gives_the_bits_of_the_standard_one(case, monkeypatch):
    """bf16 on pages of 64 and 128 (MTP in the second), gluon_decode.GROUPED_PAGES."""
    from mla_fast import gluon_decode as gd

    _check_page_rule_gives_the_same_bits(case, _gluon(case.heads, max(case.q_lens)), gd, "GROUPED_PAGES", monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon' needs sm_90")
@pytest.mark.parametrize("case", SEESAW_SMALL_PAGE_CASES[1:3] + SEESAW_FP8_CASES[1:3],
                         ids=lambda c: f"{c.combo}_h{c.heads}_p{c.page_size}")
def test_gluon_seesaw_fp8_grouped_staging_gives_the_bits_of_per_page_boxes(case, monkeypatch):
    """e4m3fn caches on pages of 32 (bf16 q), 16 (fp8 q, MTP), 128 (fp8 q, 128 heads) and 64 (bf16 q, 64 heads),
    gluon_decode.SEESAW_FP8_GROUPED_PAGES: against the chunk boxes (per page, or per tile on pages of 64k). The
    in-place expansion's staging: without the loader partition (SEESAW_FP8_LOADER_PAGES emptied), which takes every
    page by default."""
    from mla_fast import gluon_decode as gd

    monkeypatch.setattr(gd, "SEESAW_FP8_LOADER_PAGES", ())
    _check_page_rule_gives_the_same_bits(
        case, _gluon(case.heads, max(case.q_lens), case.combo), gd, "SEESAW_FP8_GROUPED_PAGES", monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon' needs sm_90")
@pytest.mark.parametrize("case", SEESAW_SMALL_PAGE_CASES[1:3] + SEESAW_FP8_CASES[1:6:2],
                         ids=lambda c: f"{c.combo}_h{c.heads}_p{c.page_size}_q{max(c.q_lens)}")
def test_gluon_seesaw_fp8_loader_gives_the_bits_of_the_in_place_expansion(case, monkeypatch):
    """e4m3fn caches through the loader partition (gluon_decode.fp8_loader: plain loads, fp16 in registers) and
    expanded in place from TMA-staged fp8: both convert exactly and feed the same MMAs in the same order, so out and
    lse are bitwise the same. Pages of 32, 16 (MTP), 128 and 64 (odd tile counts, zero-length requests, splits, MTP
    at 16 heads)."""
    from mla_fast import gluon_decode as gd

    _check_page_rule_gives_the_same_bits(case, _gluon(case.heads, max(case.q_lens), case.combo), gd,
                                         "SEESAW_FP8_LOADER_PAGES", monkeypatch, rule="fp8_loader")


def _check_small_pages_give_the_bits_of_pages_of_64(case, overrides: dict):
    """The same requests in pages of case.page_size (16 / 32: one TMA box per page, or the seesaw's grouped
    layout) and in pages of 64 (other physical pages, in another random order), decoded with
    KernelConfig(**overrides): the same tile values reach the same MMA steps in the same order, so out and lse are
    bitwise the same (NaN-poisoned unused slots in both)."""
    from mla_fast import triton_decode as td

    config = td.KernelConfig(**overrides)
    results = []
    for page_size in (case.page_size, 64):
        batch = replace(case, page_size=page_size).batch("cuda")
        assert batch.kv_cache.shape[1] == page_size
        results.append(td.decode(batch, plan=td.make_plan(batch, config), config=config))
    assert same_bits(*results)  # small pages, pages of 64


def _check_10_runs_and_graph_replays(case, overrides: dict, lens_list):
    """10 eager runs of a TritonMLADecode step with KernelConfig(**overrides) give the same bits, and so do graph
    replays after re-planning with each seq_lens of lens_list (NaN-poisoned outputs)."""
    from mla_fast.triton_decode import KernelConfig, TritonMLADecode

    step = TritonMLADecode(case.batch("cuda"), max_q_len=max(case.q_lens), config=KernelConfig(**overrides))
    step.plan()
    out0, lse0 = (t.clone() for t in step.run())
    for _ in range(10):
        step.out.fill_(float("nan"))  # poisoned between runs: every run must write every output
        step.lse.fill_(float("nan"))
        out, lse = step.run()
        assert same_bits((out, lse), (out0, lse0))
    _check_graph_replays_equal_eager(step, lens_list)


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon' needs sm_90")
@pytest.mark.parametrize("case", [GLUON_CASES[0], SEESAW_FP8_CASES[4]], ids=lambda c: f"{c.combo}_q{max(c.q_lens)}")
def test_gluon_seesaw_deterministic_and_graph_replay_equals_eager(case):
    _check_10_runs_and_graph_replays(case, _gluon(case.heads, max(case.q_lens), case.combo),
                                     ([5, 1500, 0, 4097], [3, 700, 0, 2000]))  # shrinking: every page valid


def _gluon_fp8(heads: int, q_len: int = 1, combo: str = "fp8kv", qk_fp8: bool | None = None) -> dict:
    """KernelConfig overrides of the Gluon fp8 kernel (mla_fast.gluon_fp8) in default_config's geometry at q_len
    (triton_decode.forced_config: 16 packed rows of q_len x head_group, two programs per SM with two tile slots
    each), on heads / head_group programs per worker whatever the batch size (default_config takes more than two
    programs per worker only within its token rule, GLUON_FP8_MAX_PROGRAM_TOKENS). qk_fp8: fp8 score MMAs (None:
    default_config's choice for combo, on for "fp8")."""
    from mla_fast.triton_decode import forced_config

    config = forced_config(combo, heads, q_len, "gluon_fp8")
    assert config is not None, (heads, q_len)
    return dict(kernel="gluon_fp8", head_group=config.head_group, head_split=config.head_split, mma=config.mma,
                num_stages=config.num_stages, workers_per_sm=config.workers_per_sm,
                qk_fp8=config.qk_fp8 if qk_fp8 is None else qk_fp8)


GLUON_FP8_CASES = [  # e4m3fn caches, q_len 1-4, pages of 64 or 128: zero-length requests, partial last tiles, splits
    TritonCase((0, 1, 63, 64, 65, 1000, 4097), (1,) * 7, heads=16, page_size=64, combo="fp8kv", L=512, R=64, seed=50),
    TritonCase((0, 1, 63, 64, 65, 1000, 4097), (1,) * 7, heads=16, page_size=64, combo="fp8", L=512, R=64, seed=51),
    TritonCase((3, 129, 0, 20000), (1,) * 4, heads=16, page_size=128, combo="fp8", L=512, R=64, seed=52),
    TritonCase((65536,), (1,), heads=16, page_size=64, combo="fp8kv", L=512, R=64, seed=53),  # split over all SMs
    TritonCase((5, 1500, 0, 4097), (1,) * 4, heads=32, page_size=64, combo="fp8kv", L=512, R=64, seed=54),  # 2 x 16
    TritonCase((7, 3000, 0, 129), (1,) * 4, heads=128, page_size=64, combo="fp8", L=512, R=64, seed=55),  # 8 x 16
    TritonCase((2500, 64), (1, 1), heads=64, page_size=128, combo="fp8kv", L=512, R=64, seed=56),  # 4 x 16
    # 1000 short requests: several items per program (each item's first tiles issued after the last one's tiles),
    # items shorter than the two tile slots, empty requests
    TritonCase(tuple((i * 97) % 400 for i in range(1000)), (1,) * 1000, heads=16, page_size=64, combo="fp8kv", L=512,
               R=64, seed=57),
    # MTP (causal rows; seq_len < q_len: rows that see no token; mixed q_lens: rows past an item's query rows)
    TritonCase((0, 1, 2, 63, 64, 65, 1000, 4097), (2,) * 8, heads=16, page_size=64, combo="fp8kv", L=512, R=64,
               seed=58),  # 2 x (2 rows x 8 heads)
    TritonCase((5, 1500, 0, 129, 4097), (1, 2, 2, 1, 2), heads=16, page_size=128, combo="fp8", L=512, R=64, seed=59),
    TritonCase((3, 700, 64, 2000), (3, 3, 3, 3), heads=16, page_size=64, combo="fp8kv", L=512, R=64, seed=60),
    TritonCase((2, 65, 3000, 0), (4, 1, 4, 2), heads=32, page_size=64, combo="fp8", L=512, R=64, seed=61),  # 8 x 4
    TritonCase((40000,), (2,), heads=16, page_size=64, combo="fp8kv", L=512, R=64, seed=62),  # split over all SMs
    # 700 requests of 1 or 2 tiles: most programs run an item of two tiles (the tile slots) or more and then another
    # item, whose first tiles reuse the slots the last one's loads and barrier phases left (the sixty-eighth
    # session's mutant F17, one tile issued past an item's end, was seen only by s57 and s68 below, each 1000
    # requests: 17.6 s on an H100 for s68, 8.5 s for this one; tests/test_kernel_mutants.py checks this plan)
    TritonCase(tuple(65 + (i * 7) % 60 if i % 2 == 0 else 1 + (i * 5) % 60 for i in range(700)), (1,) * 700, heads=16,
               page_size=64, combo="fp8kv", L=512, R=64, seed=81),
]


GLUON_FP8_SMALL_PAGE_CASES = [  # pages of 16 and 32 (the grouped layout): partial last pages and last tiles,
    # boxes past an item's last token, zero-length requests, splits, MTP
    TritonCase((0, 1, 15, 16, 17, 63, 64, 65, 1000, 4097), (1,) * 10, heads=16, page_size=16, combo="fp8kv", L=512,
               R=64, seed=63),
    TritonCase((0, 1, 31, 32, 33, 65, 1000, 4097), (1,) * 8, heads=16, page_size=32, combo="fp8", L=512, R=64,
               seed=64),
    TritonCase((3, 700, 17, 2000), (2, 2, 2, 2), heads=16, page_size=16, combo="fp8", L=512, R=64, seed=66),
    TritonCase((65536,), (1,), heads=16, page_size=16, combo="fp8kv", L=512, R=64, seed=67),  # split over all SMs
    TritonCase(tuple((i * 97) % 400 for i in range(1000)), (1,) * 1000, heads=16, page_size=16, combo="fp8kv", L=512,
               R=64, seed=68),  # several items per program
    TritonCase((5, 1500, 0, 4097), (1,) * 4, heads=32, page_size=16, combo="fp8", L=512, R=64, seed=69),  # 2 x 16
]
GLUON_FP8_CASES += GLUON_FP8_SMALL_PAGE_CASES


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon_fp8' needs sm_90")
@pytest.mark.parametrize("case", GLUON_FP8_SMALL_PAGE_CASES, ids=lambda c: f"{c.combo}_p{c.page_size}_s{c.seed}")
def test_gluon_fp8_small_pages_give_the_bits_of_pages_of_64(case):
    _check_small_pages_give_the_bits_of_pages_of_64(case, _gluon_fp8(case.heads, max(case.q_lens), case.combo))


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon_fp8' needs sm_90")
@pytest.mark.parametrize("case", GLUON_FP8_SMALL_PAGE_CASES[:2] + [c for c in GLUON_FP8_CASES if c.seed in (58, 59)],
                         ids=lambda c: f"{c.combo}_p{c.page_size}_q{max(c.q_lens)}")
def test_gluon_fp8_grouped_layout_gives_the_bits_of_per_page_boxes(case, monkeypatch):
    """Pages of 16 (fp8kv), 32 (fp8 q, fp8 score MMAs), 64 (fp8kv, MTP) and 128 (fp8 q, MTP),
    gluon_fp8.FP8_GROUPED_PAGES: against the standard layout's quarter boxes."""
    from mla_fast import gluon_fp8 as g8

    _check_page_rule_gives_the_same_bits(
        case, _gluon_fp8(case.heads, max(case.q_lens), case.combo), g8, "FP8_GROUPED_PAGES", monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon_fp8' needs sm_90")
@pytest.mark.parametrize("case", GLUON_FP8_CASES, ids=lambda c: f"{c.combo}_h{c.heads}_p{c.page_size}_s{c.seed}")
def test_gluon_fp8_within_kernel_bound(case):
    r = _decode_and_check(case.batch("cuda"), **_gluon_fp8(case.heads, max(case.q_lens), case.combo))
    assert r["finite"] and r["empty_ok"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon_fp8' needs sm_90")
@pytest.mark.parametrize("case", [c for c in GLUON_FP8_CASES if c.combo == "fp8"],
                         ids=lambda c: f"h{c.heads}_q{max(c.q_lens)}_s{c.seed}")
def test_gluon_fp8_with_fp16_scores_for_fp8_q_within_kernel_bound(case):
    """qk_fp8=False keeps the fp16 score path for e4m3fn q (exact products, fp32 chain), within its own bound."""
    r = _decode_and_check(case.batch("cuda"), **_gluon_fp8(case.heads, max(case.q_lens), case.combo, qk_fp8=False))
    assert r["finite"] and r["empty_ok"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


def _fp8_truncation_batch(n: int = 512, heads: int = 16):
    """Length-1 requests whose every score is Σ of one product 448 x 448 and 575 products t_q t_k of e4m3fn values
    t <= 14 (per head and per request), the big product at a random channel: the small products under the truncation
    unit 2^(17 - 13) = 16 that the big one sets in its group are what fp8 MMA accumulation loses
    (mla_fast/numerics.py). Head 0 of the first 64 requests has t_q = t_k = 3.75 (t^2 = 14.06, just under the unit):
    the most a 64-product group loses under the model, 63 x 14.06 / (448^2 + 575 x 14.06) = 4.2e-3 of σ Σ|q||k|.
    Scales 1 (amax 448): the codes are the values. -> (batch on cuda, fp64 scores σ q·k [n, H], σ Σ|q||k| [n, H])."""
    from mla_ref.decode import make_decode_batch
    from mla_ref.fp8 import quantize

    g = torch.Generator().manual_seed(7)
    t = torch.tensor([3.75, 3.5, 3.25, 3.0, 2.75, 2.5, 2.25, 2.0, 1.875, 1.75, 1.625, 1.5, 14.0, 7.0, 5.0, 4.0])
    t_k = t[torch.randint(0, 16, (n,), generator=g)]  # [n]
    t_k[:64] = 3.75
    q = t[torch.arange(heads) % 16][None, :, None].expand(n, heads, 576).clone()  # [n, H, 576]
    kv = t_k[:, None].expand(n, 576).clone()  # [n, 576]
    big = torch.randint(0, 576, (n,), generator=g)  # [n]
    q[torch.arange(n), :, big] = 448.0
    kv[torch.arange(n), big] = 448.0
    q8, q_scale = quantize(q, "e4m3fn")
    kv8, kv_scale = quantize(kv, "e4m3fn")
    assert float(q_scale) == 1.0 and float(kv_scale) == 1.0
    assert torch.equal(q8.float(), q) and torch.equal(kv8.float(), kv)  # every value on e4m3fn's grid
    sigma = 0.1352338
    batch = make_decode_batch(q8, list(kv8.split(1)), sm_scale=sigma, kv_lora_rank=512, page_size=64,
                              q_lens=[1] * n, q_scale=1.0, kv_scale=1.0, generator=g).to("cuda")
    qd, kd = q8.double(), kv8.double()
    return (batch, sigma * torch.einsum("nhd,nd->nh", qd, kd),
            sigma * torch.einsum("nhd,nd->nh", qd.abs(), kd.abs()))


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon_fp8' needs sm_90")
def test_gluon_fp8_score_mma_error_on_adversarial_data_within_declared_gamma():
    """The score error of the fp8 score MMAs (qk_fp8), read off the lse of length-1 requests (lse = the one score),
    stays within the declared gamma_qk (numerics.gluon_fp8_qk_numerics, 65 x 2^-13 of σ Σ|q||k|) on the data that
    fp8 accumulation rounds worst, and is far above the fp16 path's (which shows the fp8 MMAs ran: on one H200 3.6e-3,
    3.1e-3 on the t = 3.75 rows, against 1.0e-7)."""
    from mla_fast import triton_decode as td
    from mla_fast.numerics import gluon_fp8_qk_numerics, triton_numerics

    batch, s_ref, den = _fp8_truncation_batch()
    gamma = gluon_fp8_qk_numerics().gamma_qk
    ratios = {}
    for qk_fp8 in (True, False):
        config = td.KernelConfig(**_gluon_fp8(16, 1, "fp8", qk_fp8=qk_fp8))
        _, lse = td.decode(batch, config=config)
        ratios[qk_fp8] = float(((lse.double().cpu() - s_ref).abs() / den).max())
    assert ratios[True] <= gamma, (ratios, gamma)
    # fp8 accumulation (above one truncation unit, 2^-13) vs the fp16 path's declared fp32 chain
    assert ratios[True] > 2**-13 and ratios[False] <= triton_numerics("fp16").gamma_qk, ratios


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon_fp8' needs sm_90")
@pytest.mark.parametrize("combo", ["fp8kv", "fp8"])
@pytest.mark.parametrize("shape", [s for s in BENCH_SHAPES if s[2] == 16], ids=lambda s: "b{}_s{}_h{}".format(*s))
def test_gluon_fp8_bench_grid_within_kernel_bound(shape, combo):
    from mla_fast.bench import build_batch

    b, s, h = shape
    r = _decode_and_check(build_batch(b, s, h, combo, seed=hash(shape) % 1000), **_gluon_fp8(h, 1, combo))
    assert r["finite"] and r["out_ratio"] <= 1.0 and r["lse_ratio"] <= 1.0, r


@pytest.mark.skipif(not torch.cuda.is_available() or not _sm90(), reason="kernel='gluon_fp8' needs sm_90")
@pytest.mark.parametrize("index, lens_list", [
    (0, ([0, 1, 63, 64, 65, 1000, 4097], [0, 1, 2, 64, 0, 900, 130])),
    (1, ([0, 1, 63, 64, 65, 1000, 4097], [0, 1, 2, 64, 0, 900, 130])),  # fp8 q: fp8 score MMAs
    (8, ([0, 1, 2, 63, 64, 65, 1000, 4097], [0, 1, 1, 60, 2, 0, 900, 130])),  # MTP, q_len 2
    (9, ([5, 1500, 0, 129, 4097], [0, 1, 0, 128, 2000])),  # MTP, fp8 q (until the fortieth session [0, 1, 64,
    # 2000, 3]: requests 2 and 3 grew past their pages, read as zeros by TMA; decode now validates and refuses it)
])
def test_gluon_fp8_deterministic_and_graph_replay_equals_eager(index, lens_list):
    case = GLUON_FP8_CASES[index]
    _check_10_runs_and_graph_replays(case, _gluon_fp8(case.heads, max(case.q_lens), case.combo), lens_list)


def test_mma_accumulating_into_its_output_truncates_small_products():
    """The hardware fact behind numerics.HOPPER_PV_PER_TOKEN (mla_fast/numerics.py, point 5): an MMA whose
    accumulator operand C is the running sum truncates each product below 2^-25 of the largest magnitude among the
    products and C, so 16 products of 1.5 x 2^-25 added onto 1.0 give 4 x 2^-23, not 6 x 2^-23 (round to nearest
    would give 6), and the loss per product stays below 2^-24 of the sum (the declared charge per token)."""
    import triton
    import triton.language as tl

    from mla_fast.numerics import HOPPER_PV_PER_TOKEN

    @triton.jit
    def mma_onto(A, B, C, O, M: tl.constexpr):
        m, n = tl.arange(0, M), tl.arange(0, 16)  # rows; columns (also the 16 products of each sum)
        c = tl.load(C + m[:, None] * 16 + n[None, :])
        c = tl.dot(tl.load(A + m[:, None] * 16 + n[None, :]), tl.load(B + n[:, None] * 16 + n[None, :]), c)
        tl.store(O + m[:, None] * 16 + n[None, :], c)

    M, x = 64, 1.5 * 2**-25  # x is exact in bf16
    a = torch.full((M, 16), x, dtype=torch.bfloat16, device="cuda")  # [M, 16] 16 products per output
    b = torch.zeros(16, 16, dtype=torch.bfloat16, device="cuda")
    b[:, 0] = 1  # [16, 16] column 0 sums the row of a
    c = torch.ones(M, 16, dtype=torch.float32, device="cuda")
    o = torch.empty_like(c)
    mma_onto[(1,)](a, b, c, o, M=M, num_warps=4)
    gained = (o[:, 0].double() - 1) / 2**-23  # [M] in fp32 units at 1.0
    assert torch.all(gained == 4), gained.unique()  # each product truncated to 2^-25 (16 x 2^-25 = 4 x 2^-23)
    lost_per_product = (16 * x - gained[0].item() * 2**-23) / 16  # of a running sum of 1.0
    assert 0 < lost_per_product <= HOPPER_PV_PER_TOKEN


@pytest.mark.parametrize("combo", ["bf16", "fp8kv"])
def test_long_same_sign_accumulation_within_kernel_bound(combo):
    """A 2^18-token request whose output cancels (V = +1 on 16/17 of the tokens, -16 on the rest, equal scores), so
    the P.V accumulation error, which grows with the length (every product truncated against the running output),
    is most of the error: within the kernel bound, unsplit (one worker) and as decode plans it. Measured on one H200
    (forty-first session, fp8kv): err / Σp|v| 1.03e-3, 2.07x the charge of the old fixed gamma_pv, which counted one
    64-token MMA from zero per tile."""
    from mla_fast import triton_decode as td
    from mla_ref.decode import make_decode_batch, mla_decode_ref
    from verify.bounds import kernel_bound, merge_bound

    N, L, D = 2**18, 512, 576
    n_neg = (N - 4) // 17
    kv = torch.zeros(N, D)
    kv[: N - n_neg, :L], kv[N - n_neg:, :L] = 1.0, -16.0  # [N, D] V: exact in bf16 and e4m3fn
    kv[:, L] = 1.0  # k_pe channel 0: every score equal but the first token's
    kv[0, L] = 1.125
    q = torch.zeros(1, 16, D)
    q[:, :, L] = 7.0e-4 / (0.1352338 * 1.4426950408889634 * 0.125)  # [1, 16, D] scores ~1e-3 apart at most
    cache = kv.bfloat16() if combo == "bf16" else kv.to(torch.float8_e4m3fn)
    batch = make_decode_batch(q.bfloat16(), [cache], sm_scale=0.1352338, kv_lora_rank=L, page_size=64,
                              generator=torch.Generator().manual_seed(0),
                              kv_scale=None if combo == "bf16" else 1.0).to("cuda")
    ref = mla_decode_ref(batch)
    for num_workers in (1, None):
        config = td.batch_config(batch, 1)
        out, lse = td.decode(batch, config=config, num_workers=num_workers)
        numerics = td.kernel_numerics(config, td.dtype_combo(batch.q.dtype, batch.kv_cache.dtype))
        bound = kernel_bound(batch, numerics, ref=ref) + merge_bound(batch, -(-N // 64))
        ratio = float(((out.double() - ref[0]).abs() / bound.out).max())
        lse_ratio = float(((lse.double() - ref[1]).abs() / bound.lse).max())
        assert ratio <= 1.0 and lse_ratio <= 1.0, (num_workers, config.kernel, ratio, lse_ratio)


@pytest.mark.parametrize("combo", ["bf16", "fp8kv", "fp8"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_p_is_rounded_as_the_dispatched_kernel_declares(combo, heads):
    """On the device, through mla_fast.decode's default dispatch (the Triton kernel, the seesaw or the Gluon fp8
    kernel by dtypes and heads): the two-token decode of triton_cases.p_rounding_batch shows the P rounding that
    kernel_numerics declares for the config (bf16 P on bf16 caches, fp16 on fp8 caches)."""
    from triton_cases import observed_p_fmt, p_rounding_batch

    import mla_fast
    from mla_fast import triton_decode as td

    batch, predicted = p_rounding_batch(combo, L=512, R=64, heads=heads, device="cuda")
    out, _ = mla_fast.decode(batch)
    config = td.batch_config(batch, 1)
    declared = td.kernel_numerics(config, combo).p_fmt
    assert observed_p_fmt(out, predicted) == declared, (config.kernel, declared, out[0, :4, 0].tolist(), predicted)


@pytest.mark.parametrize("combo", ["bf16", "fp8kv", "fp8"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_the_rounding_check_holds_as_declared_and_fails_declared_fp32(combo, heads):
    """verify.checks.check_rounding through the default dispatch (the Triton kernel, the seesaw or the Gluon fp8
    kernel by dtypes and heads) on 132 workers, lengths 0 / 37 / 130 / 1000 with MTP: within the bound of the P
    rounding it declares; declared as fp32 P and P.V operands instead (what it does not do), it fails."""
    import dataclasses

    from verify.cases import Case
    from verify.checks import check_rounding
    from verify.kernels import from_backend

    dtypes = {"bf16": {}, "fp8kv": dict(kv_dtype="fp8"), "fp8": dict(kv_dtype="fp8", q_dtype="fp8")}[combo]
    case = Case(seq_lens=(0, 37, 130, 1000), q_lens=(1, 2, 1, 1), heads=heads, page_size=64, **dtypes)
    batch = case.materialize("cuda")[0]
    kernel = from_backend("triton")
    results = check_rounding(batch, kernel, 132)
    assert all(r.ok for r in results), [r.detail for r in results]
    fp32 = dataclasses.replace(kernel.numerics(batch), p_fmt=None, pv_operand=torch.float32)
    results = check_rounding(batch, dataclasses.replace(kernel, numerics=lambda b: fp32), 132)
    assert not results[0].ok and results[0].err_over_bound > 1, results[0].detail


@pytest.mark.parametrize("combo", ["bf16", "fp8kv", "fp8"])
@pytest.mark.parametrize("heads,seq_lens", [(16, (0, 37, 130, 1000, 4096)), (128, (0, 37, 130, 1000, 4096)),
                                            (16, (4096,) * 64)])  # the last: the pair merge's shape for bf16
def test_the_partials_check_holds_on_split_rows(combo, heads, seq_lens):
    """verify.checks.check_partials through the default dispatch on 132 workers, on rows the plan splits: outputs
    that cancel to a tiny offset while each split's partial does not, within the bound for the fp32 partials the
    kernels declare (bf16 partials would fail it: tests/test_partials_probe.py)."""
    from verify.cases import Case
    from verify.checks import check_partials
    from verify.kernels import from_backend

    dtypes = {"bf16": {}, "fp8kv": dict(kv_dtype="fp8"), "fp8": dict(kv_dtype="fp8", q_dtype="fp8")}[combo]
    case = Case(seq_lens=seq_lens, q_lens=(1,) * len(seq_lens), heads=heads, page_size=64, **dtypes)
    batch = case.materialize("cuda")[0]
    kernel = from_backend("triton")
    assert kernel.max_splits(batch) >= 2
    results = check_partials(batch, kernel, 132)
    # err/bound 0 where the output is exact: with fp8 caches at 64 x 4096, ô = 86 · 2^-16 is a bf16 value
    assert all(r.ok for r in results) and results[0].err_over_bound is not None, [r.detail for r in results]


# random varlen batches on the device: the verifier's drawn cases (lengths 0..4096 with a long tail, MTP q_len 1-4,
# pages 1..128 and non-powers of two, 1-128 heads, adversarial data, split counts) through our default dispatch,
# every check of mla-verify (tier 1 within the §5(f) kernel bound, tier 2 for fp8, empty rows, finiteness, split
# invariance, inputs untouched), under the active Hypothesis profile (ci: 25 drawn cases after the smoke prefix, here
# less its 72-row case, which the kernels refuse by name: smoke_prefix_our_kernels_take)
test_triton_random_varlen_bf16 = mla_property_test(BACKENDS["triton"], "bf16", device="cuda", smoke=False,
                                                   examples=smoke_prefix_our_kernels_take("bf16"))
test_triton_random_varlen_fp8 = mla_property_test(BACKENDS["triton"], "fp8", device="cuda", smoke=False,
                                                  examples=smoke_prefix_our_kernels_take("fp8"))


def test_mla_bench_writes_its_json(tmp_path):
    """mla-bench on one small row (no peers, one round): the JSON holds the copy rate measured in the run and, per
    row and combo, ours with µs, GB/s and % of that copy rate, and the read floor."""
    import json

    from mla_fast import bench

    path = tmp_path / "bench.json"
    bench.main(["--shapes", "2,512,16", "--dtypes", "bf16,fp8kv", "--no-peers", "--rounds", "1", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["copy_gbs"] > 0 and [r["combo"] for r in result["rows"]] == ["bf16", "fp8kv"]
    for row in result["rows"]:
        ours = row["ours"]
        assert ours["status"] == "ok" and ours["us"] > 0 and ours["gbs"] > 0, row
        # GB/s from the row's bytes and µs, % from the run's copy rate: the same float operations on the values as
        # written (JSON keeps a float's repr, exact), so the same bits
        assert ours["gbs"] == row["bytes"] / (ours["us"] * 1e-6) / 1e9, row
        assert ours["pct_copy"] == 100 * ours["gbs"] / result["copy_gbs"], row
        assert row["read_floor"]["status"] == "ok", row
