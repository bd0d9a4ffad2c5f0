"""mla_fast.triton_decode on the CPU: the real kernels under Triton's interpreter, against the fp64 oracle.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in one worker subprocess (this file
run as a script); the tests read its JSON report. Cases are tiny (L = 64, R = 32, 16 heads, tens of tokens) and
the planner's block is 16 tokens, so small requests still split into several items and exercise the reduce.

Tolerance: verify.bounds.kernel_bound (numerics.md §5(f)) with the kernel's declared KernelNumerics, plus
merge_bound (§5(g)) for the plan's split count (tests/triton_cases.py); every case must have err / bound <= 1.
"""

import csv
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from benchmark_scripts import benchmark_module
from triton_cases import INTERPRETER_TILES, TritonCase, nan_masks_match, same_bits, with_nan_token

HERE = Path(__file__).resolve().parent
NEEDS_TRITON = "needs triton (pip install triton==3.6.0, as .ci/run does)"

CASES = {
    # bf16: page sizes 16 / 1 / 3, q_len 1-2, empty sequences, 1 / 3 / 8 workers
    "bf16_p16_w3_empty": TritonCase((40, 0, 70), (1, 1, 1), page_size=16, num_workers=3),
    "bf16_p1_w8": TritonCase((33, 5), (1, 1), page_size=1, num_workers=8, seed=1),
    "bf16_p3_mtp2_w3": TritonCase((50, 1, 0), (2, 2, 1), page_size=3, num_workers=3, seed=2),
    "bf16_p16_w1": TritonCase((64, 17), (1, 2), page_size=16, num_workers=1, seed=3),
    "bf16_all_empty": TritonCase((0, 0), (1, 2), page_size=16, num_workers=3, seed=4),
    "bf16_h32_mtp2_w8": TritonCase((45,), (2,), heads=32, page_size=16, num_workers=8, seed=5),
    # bf16 q, fp8 (e4m3fn) KV
    "fp8kv_p16_w3": TritonCase((40, 0, 70), (1, 1, 1), page_size=16, combo="fp8kv", num_workers=3, seed=6),
    "fp8kv_p3_mtp2_w8": TritonCase((50, 9), (2, 1), page_size=3, combo="fp8kv", num_workers=8, seed=7),
    # fp8 q and KV
    "fp8_p1_w5": TritonCase((133, 5, 0), (1, 1, 1), page_size=1, combo="fp8", num_workers=5, seed=8),
    "fp8_p16_mtp2_w1": TritonCase((50, 20), (2, 2), page_size=16, combo="fp8", num_workers=1, seed=9),
    # block-table chunks of 2 pages (chunk ends mid-request and mid-page), head groups split over programs
    "bf16_p32_chunk2_w2": TritonCase((300, 17, 129), (1, 2, 1), page_size=32, num_workers=2, seed=21),
    "fp8kv_p32_chunk2_split2_w2": TritonCase((300, 17), (1, 1), page_size=32, combo="fp8kv", num_workers=2, seed=22),
    "bf16_h32_mtp2_split4_w3": TritonCase((45, 3), (2, 1), heads=32, page_size=16, num_workers=3, seed=23),
    # 64 heads x q_len 2: 64-row tiles, default head_split 2, per-token gather (page 3)
    "bf16_h64_mtp2_p3_w3": TritonCase((40, 7), (2, 1), heads=64, page_size=3, num_workers=3, seed=24),
    # latent split in 4 column slices (split_l): bf16 with chunks and splits, fp8 KV, fp8 q + KV with MTP
    "bf16_splitl4_p16_w3_empty": TritonCase((40, 0, 70), (1, 1, 1), page_size=16, num_workers=3, seed=25),
    "fp8kv_splitl4_p3_mtp2_w8": TritonCase((50, 9), (2, 1), page_size=3, combo="fp8kv", num_workers=8, seed=26),
    "fp8_splitl4_p16_mtp2_w3": TritonCase((50, 20), (2, 2), page_size=16, combo="fp8", num_workers=3, seed=27),
    # softmax denominators kept per tile column (lazy_l), reduced once per item; with and without latent slices
    "bf16_lazyl_p3_mtp2_w3": TritonCase((50, 1, 0), (2, 2, 1), page_size=3, num_workers=3, seed=28),
    # one request, 64 heads: the small-batch default (16-row tiles, 4 head groups per worker)
    "bf16_h64_b1_smallbatch_w3": TritonCase((90,), (1,), heads=64, page_size=16, num_workers=3, seed=33),
    "fp8kv_lazyl_splitl1_p16_w3": TritonCase((40, 0, 70), (1, 1, 1), page_size=16, combo="fp8kv", seed=29),
    # eight latent slices (L = 128: slices of 16) on fp8 KV (its fp16 staging, FP8_STAGE, is device-only: the
    # interpreter launches it off, test_default_config_takes_the_new_paths; GPU tests run it), and bf16 with MTP
    "fp8kv_splitl8_p16_w3": TritonCase((40, 0, 70), (1, 1, 1), page_size=16, combo="fp8kv", L=128, R=32,
                                       num_workers=3, seed=35),
    "bf16_splitl8_p3_mtp2_w3": TritonCase((50, 9), (2, 1), page_size=3, L=128, R=32, num_workers=3, seed=36),
    # V loaded a second time for P.V (v_reload, no latent slices): fp8 q + KV with MTP
    "fp8_vreload_p16_mtp2_w3": TritonCase((50, 20), (2, 2), page_size=16, combo="fp8", num_workers=3, seed=37),
    # 64-row tiles (score dots behind _unchain, an scf.if per slice) with four latent slices (the default before
    # two), page 16 with splits and MTP
    "bf16_h64_unchain_p16_w3": TritonCase((70, 0, 33), (1, 1, 2), heads=64, page_size=16, num_workers=3, seed=34),
    # two latent slices on 64-row tiles, unchained: the default
    "bf16_h64_splitl2_p16_w3": TritonCase((70, 0, 33), (1, 1, 2), heads=64, page_size=16, num_workers=3, seed=39),
    # one latent slice on 64-row tiles, unchained: the q_nope and q_pe score dots as two chains
    "bf16_h64_splitl1_unchain_p16_w3": TritonCase((70, 0, 33), (1, 1, 2), heads=64, page_size=16, num_workers=3,
                                                  seed=40),
    # fp8 caches on 64-row tiles (unchained, two slices): 64 heads, and 32 heads x q_len 2 on page 3
    "fp8kv_h64_rows64_p16_w3": TritonCase((70, 0, 33), (1, 1, 1), heads=64, page_size=16, combo="fp8kv",
                                          num_workers=3, seed=41),
    "fp8_h32_mtp2_rows64_p3_w3": TritonCase((50, 9), (2, 1), heads=32, page_size=3, combo="fp8", num_workers=3,
                                            seed=42),
    # 38 pieces of one request: the reduce merges 64 partial slots per step on 32 of the 64 channels per program
    "bf16_p16_manysplits_w40": TritonCase((600, 3), (1, 1), page_size=16, num_workers=40, seed=38),
    # one long request among short split ones, decoded with reduce_pieces=4 (REDUCE_PIECES): its tile's 15 pieces
    # are merged in four steps, the short ones' in one
    "bf16_p16_longtail_w32": TritonCase((700,) + (64,) * 6, (1,) * 7, page_size=16, num_workers=32, seed=43),
    # pages of a quarter / half of a tile: each token's page picked from a chunk of block-table entries in registers
    # (launch_page_chunk): pages of 4 in 32-page chunks (128 tokens), pages of 8 in 4-page chunks (32 tokens); bf16
    # in two steps (each tile's row of the chunk, then each token's entry of the row: its default_config), fp8 in one
    "bf16_p4_chunks_w3": TritonCase((300, 7, 0), (1, 1, 1), page_size=4, num_workers=3, seed=44),
    "fp8kv_p8_chunk4_mtp2_w3": TritonCase((90, 33), (2, 1), page_size=8, combo="fp8kv", num_workers=3, seed=45),
    # the other select of each: bf16 in one step, fp8 in two
    "bf16_p4_select1_w3": TritonCase((300, 7, 0), (1, 1, 1), page_size=4, num_workers=3, seed=46),
    "fp8_p8_chunk4_select2_mtp2_w3": TritonCase((90, 33, 1), (2, 1, 2), page_size=8, combo="fp8", num_workers=3,
                                                seed=47),
}
REDUCE_PIECES = {"bf16_p16_longtail_w32": 4}  # decode's reduce_pieces (else plan_reduce_pieces)
CONFIG_OVERRIDES = {  # KernelConfig fields beside the default_config of the case
    "bf16_p32_chunk2_w2": dict(page_chunk=2),
    "fp8kv_p32_chunk2_split2_w2": dict(page_chunk=2, head_group=8, head_split=2),
    "bf16_h32_mtp2_split4_w3": dict(head_group=4, head_split=4),
    "bf16_splitl4_p16_w3_empty": dict(split_l=4, page_chunk=2),
    "fp8kv_splitl4_p3_mtp2_w8": dict(split_l=4, v_reload=False),
    "fp8_splitl4_p16_mtp2_w3": dict(split_l=4, v_reload=False),
    "bf16_lazyl_p3_mtp2_w3": dict(lazy_l=True),
    "fp8kv_lazyl_splitl1_p16_w3": dict(lazy_l=True, split_l=1),
    "fp8kv_splitl8_p16_w3": dict(split_l=8),
    "fp8_vreload_p16_mtp2_w3": dict(v_reload=True, split_l=1, fp8_stage=False, lazy_l=False, page_chunk=0),
    "bf16_splitl8_p3_mtp2_w3": dict(split_l=8),
    "bf16_h64_unchain_p16_w3": dict(split_l=4),
    "bf16_h64_splitl2_p16_w3": dict(split_l=2),
    "bf16_h64_splitl1_unchain_p16_w3": dict(split_l=1),
    "fp8kv_p8_chunk4_mtp2_w3": dict(page_chunk=4),
    "bf16_p4_select1_w3": dict(page_select=1),
    "fp8_p8_chunk4_select2_mtp2_w3": dict(page_chunk=4, page_select=2),
}
SPLIT_CASES = {  # the plan must cut at least one (request, head group)
    "bf16_p16_w3_empty", "bf16_p1_w8", "bf16_p3_mtp2_w3", "bf16_h32_mtp2_w8", "fp8kv_p16_w3", "fp8kv_p3_mtp2_w8",
    "fp8_p1_w5", "bf16_p32_chunk2_w2", "fp8kv_p32_chunk2_split2_w2", "bf16_splitl4_p16_w3_empty",
    "fp8kv_splitl4_p3_mtp2_w8", "fp8_splitl4_p16_mtp2_w3", "bf16_lazyl_p3_mtp2_w3", "fp8kv_lazyl_splitl1_p16_w3",
    "bf16_h64_unchain_p16_w3", "fp8kv_splitl8_p16_w3", "bf16_splitl8_p3_mtp2_w3", "fp8_vreload_p16_mtp2_w3",
    "bf16_p16_manysplits_w40", "bf16_p16_longtail_w32", "bf16_h64_splitl2_p16_w3", "bf16_h64_splitl1_unchain_p16_w3",
    "fp8kv_h64_rows64_p16_w3", "fp8_h32_mtp2_rows64_p3_w3", "bf16_p4_chunks_w3", "fp8kv_p8_chunk4_mtp2_w3",
    "bf16_p4_select1_w3", "fp8_p8_chunk4_select2_mtp2_w3",
}
BLOCK_N, PLAN_BLOCK_N = INTERPRETER_TILES["block_n"], INTERPRETER_TILES["plan_block_n"]  # tokens per tile / block


def _decode_with_each(name: str, field: str, values: tuple) -> tuple:
    """CASES[name] decoded with KernelConfig.<field> at each of `values`, on one plan (its default_config at the
    interpreter's tiles, with its CONFIG_OVERRIDES) -> (case, batch, config, [(out, lse), ...], [the launched
    constexpr of `field`, upper-cased, per run])."""
    from mla_fast import triton_decode as td

    case = CASES[name]
    batch = case.batch()
    config = replace(td.default_config(case.combo, case.heads, max(case.q_lens)), **INTERPRETER_TILES,
                     **CONFIG_OVERRIDES.get(name, {}))
    plan = td.make_plan(batch, config, case.num_workers)
    runs, launched = [], []
    for value in values:
        runs.append(td.decode(batch, plan=plan, config=replace(config, **{field: value})))
        launched.append(td._mla_decode_kernel.launches[-1][field.upper()])
    return case, batch, config, runs, launched


def _worker() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    import mla_fast

    report = {"triton_imported_by_mla_fast": "triton" in sys.modules and bool(mla_fast.decode)}
    from triton_cases import LaunchRecorder, check, split_pair

    from mla_fast import triton_decode as td
    from mla_fast.numerics import triton_numerics

    td._mla_decode_kernel = LaunchRecorder(td._mla_decode_kernel)  # launch() reads the module global at each call

    report["interpret"] = td.INTERPRET and td.UPCAST_BF16
    report["pdl"] = td.pdl_supported(torch.device("cuda"))  # the interpreter runs no griddepcontrol PTX
    report["one_item_bitwise"] = {}
    for name, case in CASES.items():
        batch = case.batch()
        batch_size = len(case.seq_lens) if "smallbatch" in name else None  # else the large-batch choice
        config = td.default_config(case.combo, case.heads, max(case.q_lens), batch_size)  # GPU choice, smaller tiles
        config = replace(config, **INTERPRETER_TILES, **CONFIG_OVERRIDES.get(name, {}))
        plan = td.make_plan(batch, config, case.num_workers)
        launches = len(td._mla_decode_kernel.launches)
        out, lse = td.decode(batch, plan=plan, config=config, reduce_pieces=REDUCE_PIECES.get(name))
        assert len(td._mla_decode_kernel.launches) == launches + 1, name  # launched[...] below is this decode's
        launched = td._mla_decode_kernel.launches[-1]  # the constexprs that decode's launch passed
        stats = plan.stats()
        result = check(out, lse, batch, triton_numerics(config.mma, config.block_n), stats["pieces_per_tile"]["max"])
        result["split_tiles"] = stats["split_tiles"]
        result["num_workers"] = plan.num_workers
        result["plan_head_group"] = plan.head_group
        result["page_chunk"] = launched["PAGE_CHUNK"]
        result["split_l"] = launched["SPLIT_L"]
        result["lazy_l"] = launched["LAZY_L"]
        result["unchain"] = launched["UNCHAIN"]
        result["fp8_stage"] = launched["FP8_STAGE"]
        result["head_group"] = config.head_group
        result["head_split"] = config.head_split
        result["rows"] = config.head_group * max(case.q_lens)
        rows = td.reduce_rows(config, config.head_group * max(case.q_lens))  # as launch
        pieces = REDUCE_PIECES.get(name) or td.plan_reduce_pieces(plan, rows, case.L, td.num_sms(batch.q.device))
        result["reduce_blocks"] = td.reduce_blocks(pieces, case.L)  # (BLOCK_S, BLOCK_L) of the reduce
        result["max_pieces"] = plan.max_pieces
        report[name] = result
        if plan.one_item_per_worker:  # ONE_ITEM ran (item w without reading worker_indptr): the general path's bits?
            out_w, lse_w = td.decode(batch, plan=replace(plan, one_item_per_worker=False), config=config)
            report["one_item_bitwise"][name] = bool(torch.equal(out, out_w) and torch.equal(lse, lse_w))
    # and the flag reaches the kernel: forced on a plan whose one worker runs two items, the second is skipped
    case = CASES["bf16_p16_w1"]
    batch = case.batch()
    config = replace(td.default_config(case.combo, case.heads, 1), **INTERPRETER_TILES)
    plan = td.make_plan(batch, config, 1)
    T, H, L = batch.num_tokens, batch.num_heads, batch.kv_lora_rank
    forced, _ = td.decode(batch, plan=replace(plan, one_item_per_worker=True), config=config,
                          out=torch.full((T, H, L), float("nan"), dtype=torch.bfloat16))
    report["one_item_forced"] = {"items": plan.num_items, "flag": plan.one_item_per_worker,
                                 "nan_rows": int(torch.isnan(forced.float()).any(-1).any(-1).sum())}
    # the interpreter workaround is what makes bf16 right: without it, bf16 tl.dot in the interpreter is wrong
    case = CASES["bf16_p16_w1"]
    batch = case.batch()
    config = td.KernelConfig(block_n=BLOCK_N, head_group=16, plan_block_n=PLAN_BLOCK_N)
    td.UPCAST_BF16 = False  # launch() passes the module flag as the kernel's UPCAST_BF16 constexpr
    out, lse = td.decode(batch, config=config, num_workers=1)
    td.UPCAST_BF16 = True
    report["no_workaround"] = check(out, lse, batch, triton_numerics("bf16", BLOCK_N))
    # bf16 outputs are the fp32 results rounded to nearest even, as on the device (the interpreter alone truncates),
    # from the decode kernel (1 worker) and from the reduce kernel (3 workers: splits)
    case = CASES["fp8kv_p16_w3"]
    batch = case.batch()
    config = replace(td.default_config(case.combo, case.heads, 1), **INTERPRETER_TILES)
    T, H, L = batch.num_tokens, batch.num_heads, batch.kv_lora_rank
    runs = {}
    for workers in (1, 3):
        plan = td.make_plan(batch, config, workers)
        out32, _ = td.decode(batch, plan=plan, config=config, out=torch.empty(T, H, L))
        out16, _ = td.decode(batch, plan=plan, config=config)
        report[f"out_rne_w{workers}"] = bool(torch.equal(out16, out32.bfloat16()))
        runs[workers] = (out32, plan.stats()["pieces_per_tile"]["max"])
    report["split_pair"] = split_pair(runs[1][0], runs[3][0], batch, triton_numerics(config.mma, config.block_n),
                                      runs[3][1])
    # the two-step page select (KernelConfig.page_select = 2) picks the same pages: bitwise the one-step output, on
    # pages of a quarter of a tile (4 per 16-token tile, 32-page chunks) and of half a tile (2-page chunks) with MTP
    report["page_select_bitwise"] = {}
    for name in ("bf16_p4_chunks_w3", "fp8kv_p8_chunk4_mtp2_w3"):
        case, batch, config, runs, launched = _decode_with_each(name, "page_select", (1, 2))
        report["page_select_bitwise"][name] = (same_bits(*runs) and not bool(torch.isnan(runs[1][0].float()).any())
                                               and launched == [1, 2])
    # interleave (each slice's score dot written after its load) is program order only: bitwise the same output,
    # on 64-row tiles (the bf16 default there) and 16-row tiles with eight slices (fp8 KV, L = 128)
    report["interleave_bitwise"] = []
    for name in ("bf16_h64_splitl2_p16_w3", "fp8kv_splitl8_p16_w3"):
        case, batch, config, runs, launched = _decode_with_each(name, "interleave", (False, True))
        report["interleave_bitwise"].append(same_bits(*runs) and launched == [False, True])
    # the graph-capturable step: plan() into its static buffers, run() launches; equal to decode() at the step's
    # reduce_pieces (its fixed reduce shape), also after seq_lens shrink in place and a re-plan (other pieces per tile)
    step = td.TritonMLADecode(batch, num_workers=3, config=config)
    report["step_equals_decode"] = []
    for new_lens in (case.seq_lens, (3, 0, 70)):
        batch.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        step.plan()
        out, lse = step.run()
        plan = td.make_plan(batch, config, 3)
        ref_out, ref_lse = td.decode(batch, plan=plan, config=config, reduce_pieces=step.reduce_pieces)
        report["step_equals_decode"].append(bool(torch.equal(out, ref_out) and torch.equal(lse, ref_lse))
                                            and plan.num_partial_rows > 0)
    report["layout_bitwise"] = _layout_bitwise(td)
    report["step_check"] = _step_check(td)
    report["step_worst"] = _step_worst()
    report["nan_input"] = _nan_input_masks(td)
    report["interpreter_e4m3_nan"] = _interpreter_e4m3_nan()
    report["p_rounding"] = _p_rounding(td)
    report["rounding_check"] = _rounding_check(td)
    return report


STEP_CASES = ("bf16_p3_mtp2_w3", "fp8kv_p16_w3", "fp8_p16_mtp2_w1")


def _step_check(td) -> dict:
    """verify's step check (`checks.check_step`) on the triton backend's graph-capturable step, run again where a
    GPU would replay its graph: {case: {check name: ok}}. (The same step planned only once reads outside its
    buffers on the refilled step, a segfault under the interpreter: the mutant `stale_plan` shows that the check
    fails such a step, tests/test_step_check.py.)"""
    from mla_ref.decode import mla_decode_ref
    from verify import checks
    from verify.kernels import from_backend

    kernel = from_backend("triton")
    report = {}
    for name in STEP_CASES:
        batch = CASES[name].batch()
        ref = mla_decode_ref(batch)  # [T, H, L], [T, H] fp64
        numerics = kernel.numerics(batch)
        bound = checks._tier1_bound(batch, kernel, numerics, ref)
        first = checks._moved(*kernel.run(batch), ref[0].device)
        report[name] = {r.name: r.ok for r in checks.check_step(batch, kernel, first, ref, bound, numerics.out_dtype)}
    return report


# The step check's worst case on the H200 (mla-verify --backend triton --dtype fp8 --cases 300, seeds 0 and 2, one
# H200, 2026-12-03, 0 failed): step.replan.out 0.984. The next step grows the empty request to 2 tokens (kv_scale
# 1.0, the dynamic scale of an empty cache) whose scores differ by 25.3, so the first token's p = 1.0e-11 is below
# fp16's subnormal range and the kernel's fp16 P flushes it to 0; in channel 396 the other token's value is -0.0, so
# the output there is that flushed term alone (-7.14e-12 vs 0), and the bound is that term times the score error's
# growth e^ω (1 + c_pv) (7.26e-12; bounds.kernel_bound's P underflow).
STEP_WORST = dict(seq_lens=(0,), q_lens=(1,), heads=1, page_size=1, q_dtype="bf16", kv_dtype="fp8", seed=0)


def _step_worst() -> dict:
    """verify.checks.run_case on STEP_WORST with the triton backend: {check name: (ok, err / bound or None)}."""
    from verify.cases import Case
    from verify.checks import run_case
    from verify.kernels import from_backend

    result = run_case(Case(**STEP_WORST), from_backend("triton"))
    assert result.unsupported is None, result.unsupported
    return {c.name: (c.ok, c.err_over_bound) for c in result.checks}


LAYOUT_CASES = ("bf16_p3_mtp2_w3", "fp8kv_p16_w3", "fp8_p1_w5", "bf16_p4_chunks_w3", "fp8kv_p8_chunk4_mtp2_w3")


def _layout_bitwise(td) -> dict:
    """Each LAYOUT_CASES batch decoded as built and as `verify.strided_inputs.strided_batch` (q, cache and block
    table as views into NaN-padded buffers), then into out and lse views of NaN-filled buffers (`strided_outputs`:
    a wrong row or head stride in a store, e.g. the reduce's out store taking the workspace's head stride, was seen
    by no check: a review's source mutant), one plan and config: {name: (same bits, no NaN, a split plan, the
    strided outputs' bits with every element around them still NaN)}."""
    from triton_cases import outside_is_nan, same_bits, strided_outputs

    from verify.strided_inputs import strided_batch

    seen = {}
    for name in LAYOUT_CASES:
        case = CASES[name]
        batch = case.batch()
        config = replace(td.default_config(case.combo, case.heads, max(case.q_lens)), **INTERPRETER_TILES,
                         **CONFIG_OVERRIDES.get(name, {}))
        plan = td.make_plan(batch, config, case.num_workers)
        dense = td.decode(batch, plan=plan, config=config)
        strided = td.decode(strided_batch(batch).batch, plan=plan, config=config)
        out, lse, out_buffer, lse_buffer = strided_outputs(*dense[0].shape)
        into_views = td.decode(batch, plan=plan, config=config, out=out, lse=lse)
        seen[name] = (same_bits(dense, strided), not bool(torch.isnan(strided[0].float()).any()),
                      plan.num_partial_rows > 0, same_bits(dense, into_views) and outside_is_nan(out, out_buffer)
                      and outside_is_nan(lse, lse_buffer))
    return seen


def _rounding_check(td) -> dict:
    """verify.checks.check_rounding on the Triton kernel, per combo, split over 3 workers on the interpreter's
    16-token blocks: with the numerics it declares (bf16 P on bf16 caches, fp16 P on fp8 caches), and declared as
    fp32 P and P.V operands (a P.V operand format rounds P too), which it is not. {combo_label: (ok, err/bound of
    rounding.out)}; and verify.checks.check_partials with the declared numerics (fp32 split outputs), on the same
    split plan: {combo_partials: (ok, err/bound of partials.out, the plan's partial rows)}."""
    from mla_fast.backends import most_pieces
    from mla_fast.numerics import triton_numerics
    from verify.checks import check_partials, check_rounding
    from verify.kernels import Kernel

    seen = {}
    for combo in ("bf16", "fp8kv", "fp8"):
        case = TritonCase((40, 0, 70), (1, 1, 2), page_size=16, combo=combo, seed=50)
        config = replace(td.default_config(combo, case.heads, 2), **INTERPRETER_TILES)
        declared = triton_numerics(config.mma, config.block_n)

        def run(batch, config=config):
            return td.decode(batch, plan=td.make_plan(batch, config, 3), config=config)

        fp32 = replace(declared, p_fmt=None, pv_operand=torch.float32)
        for label, numerics in (("declared", declared), ("fp32", fp32)):
            kernel = Kernel("triton", run, lambda batch, n=numerics: n,
                            max_splits=lambda batch: most_pieces(batch, PLAN_BLOCK_N))
            results = check_rounding(case.batch(), kernel, 3)
            seen[f"{combo}_{label}"] = (all(r.ok for r in results), results[0].err_over_bound)
            if label == "declared":
                results = check_partials(case.batch(), kernel, 3)
                partial_rows = td.make_plan(case.batch(), config, 3).num_partial_rows
                seen[f"{combo}_partials"] = (all(r.ok for r in results), results[0].err_over_bound, partial_rows)
    return seen


def _p_rounding(td) -> dict:
    """For each combo, through the public decode (mla_fast.decode, default config): the P rounding its output
    shows (triton_cases.p_rounding_batch) and the one the kernel declares (kernel_numerics of that config)."""
    from triton_cases import observed_p_fmt, p_rounding_batch

    import mla_fast

    seen = {}
    for combo in ("bf16", "fp8kv", "fp8"):
        batch, predicted = p_rounding_batch(combo)
        out, _ = mla_fast.decode(batch)
        declared = td.kernel_numerics(td.batch_config(batch, 1), combo).p_fmt
        seen[combo] = {"observed": observed_p_fmt(out, predicted), "declared": declared}
    return seen


def nan_input_batch(combo: str, device="cpu"):
    """A batch whose request 0 (256 tokens, q_len 2) holds a NaN in channel 5 of token 210, which both of its query
    rows see; request 1 (40 tokens) is clean. mla_decode_ref gives NaN out and lse in request 0's rows only."""
    return with_nan_token(TritonCase((256, 40), (2, 1), heads=4, page_size=16, combo=combo).batch(device), 0, 210)


def _nan_input_masks(td) -> dict:
    """For each combo, unsplit (1 worker) and split (4 workers): do out's and lse's NaN masks equal the oracle's?"""
    from mla_ref.decode import mla_decode_ref

    masks = {}
    for combo in ("bf16", "fp8kv", "fp8"):
        batch = nan_input_batch(combo)
        ref_out, ref_lse = mla_decode_ref(batch)
        config = td.KernelConfig(head_group=4, head_split=1, mma=td.DEFAULT_MMA[combo], **INTERPRETER_TILES)
        for workers in (1, 4):
            plan = td.make_plan(batch, config, workers)
            out, lse = td.decode(batch, plan=plan, config=config)
            masks[f"{combo}_w{workers}"] = {
                "split": plan.num_partial_rows > 0,
                "masks": nan_masks_match(out, lse, ref_out, ref_lse),
                "nan_rows": int(torch.isnan(lse).all(-1).sum()),
            }
    return masks


def _interpreter_e4m3_nan() -> float:
    """What Triton 3.6's interpreter makes of e4m3fn's NaN code with a plain cast (the device's cvt gives NaN)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y):
        tl.store(Y, tl.load(X).to(tl.float16))

    y = torch.empty(1, dtype=torch.float16)
    cast[(1,)](torch.tensor([float("nan")]).to(torch.float8_e4m3fn), y)
    return float(y)


def _interpreted(flag: str) -> dict:
    """This file run as a script with ``flag`` ("--worker", "--invariant-worker") under TRITON_INTERPRET=1: the
    worker's JSON report."""
    pytest.importorskip("triton", reason=NEEDS_TRITON)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), flag], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report():
    return _interpreted("--worker")


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_oracle_within_kernel_bound(report, name):
    r = report[name]
    assert r["finite"], f"{name}: non-finite output on a row that sees tokens (NaN padding read?) {r}"
    assert r["empty_ok"], f"{name}: empty rows must give out = 0, lse = -inf {r}"
    assert r["out_ratio"] <= 1.0, f"{name}: out error above the §5(f) kernel bound {r} case={asdict(CASES[name])}"
    assert r["lse_ratio"] <= 1.0, f"{name}: lse error above its bound {r} case={asdict(CASES[name])}"
    assert r["num_workers"] == CASES[name].num_workers
    assert r["plan_head_group"] == r["head_group"] * r["head_split"]  # a worker's programs plan as one head group
    over = CONFIG_OVERRIDES.get(name, {})
    assert (r["head_group"], r["head_split"]) == (over.get("head_group", r["head_group"]),
                                                  over.get("head_split", r["head_split"]))  # overrides reach it


def test_a_nan_input_gives_nan_out_and_lse_split_or_not(report):
    """A NaN in a valid cache token gives NaN out and lse in the rows that read it, as the oracle does, on every
    dtype combination, in one piece and split (the reduce). Before, the epilogues took a NaN row sum for an empty
    row (lse -inf) and the reduce then merged that partial as empty: a split request came out finite and wrong.
    fp8 caches need the interpreter's e4m3fn NaN fix (`_mma_operand`): its plain cast reads the NaN code as 480."""
    for key, r in report["nan_input"].items():
        assert r["masks"] and r["nan_rows"] == 2, (key, r)  # request 0's two query rows, all heads
        assert r["split"] == key.endswith("_w4"), (key, r)
    assert report["interpreter_e4m3_nan"] == 480.0  # the bug the fix works around; NaN here: drop the fix


def test_p_is_rounded_as_the_kernel_declares(report):
    """The output of a two-token decode whose bf16 result differs by 2 ulps between P rounded to bf16 and to fp16
    shows the rounding KERNEL_NUMERICS declares: bf16 for bf16 caches, fp16 for fp8 caches (the bound's u_P; a
    kernel that rounded P to bf16 while declaring fp16 passed every bound test, found by a review). In the
    interpreter P is rounded to bf16 as on the device before the fp32 upcast (it was not rounded at all)."""
    for combo, r in report["p_rounding"].items():
        assert r["observed"] is not None and r["observed"] == r["declared"], (combo, r)
    assert {r["declared"] for r in report["p_rounding"].values()} == {"bf16", "fp16"}


def test_rounding_check_passes_the_declared_p_and_fails_fp32_declared(report):
    """The rounding probe on the real kernel (interpreter, split): within the bound of the P rounding it declares,
    and over the bound of the same kernel declared as fp32 P (verify/rounding_probe.py)."""
    for combo in ("bf16", "fp8kv", "fp8"):
        ok, ratio = report["rounding_check"][f"{combo}_declared"]
        assert ok and ratio <= 1, (combo, ratio)
        ok, ratio = report["rounding_check"][f"{combo}_fp32"]
        assert not ok and ratio > 1, (combo, ratio)


def test_partials_check_passes_the_declared_fp32_partials_on_a_split_plan(report):
    """The partials probe on the real kernel (interpreter, split over 3 workers): its fp32 split outputs and reduce
    within the bound of the fp32 partials it declares, on a plan that does split (verify/partials_probe.py; bf16
    partials under that declaration fail it: tests/test_partials_probe.py)."""
    for combo in ("bf16", "fp8kv", "fp8"):
        ok, ratio, partial_rows = report["rounding_check"][f"{combo}_partials"]
        assert ok and 0 < ratio <= 1 and partial_rows > 0, (combo, ratio, partial_rows)


def test_default_config_takes_the_new_paths(report):
    assert report["bf16_p16_w1"]["page_chunk"] > 0  # block-table chunks
    assert report["bf16_h64_mtp2_p3_w3"]["plan_head_group"] == 64  # 2 programs x 32 heads
    assert [report[n]["split_l"] for n in CASES if "splitl4" in n] == [4, 4, 4]  # L = 64: four slices of 16
    assert [report[n]["split_l"] for n in CASES if "splitl8" in n] == [8, 8]  # L = 128: eight slices of 16
    assert report["bf16_h64_splitl2_p16_w3"]["split_l"] == 2 and report["bf16_h64_splitl2_p16_w3"]["unchain"]
    for name in ("fp8kv_h64_rows64_p16_w3", "fp8_h32_mtp2_rows64_p3_w3"):  # fp8 caches on 64-row tiles
        assert report[name]["rows"] == 64 and report[name]["unchain"] and report[name]["split_l"] == 2, name
    one = report["bf16_h64_splitl1_unchain_p16_w3"]
    assert one["split_l"] == 1 and one["unchain"]  # unchained with one slice: two score chains
    assert report["bf16_p16_w1"]["split_l"] == 4  # the default at 16 rows
    small, large = report["bf16_h64_b1_smallbatch_w3"], report["bf16_h64_mtp2_p3_w3"]
    assert (small["plan_head_group"], small["head_group"]) == (64, 16)  # 4 programs x 16 heads
    assert (large["plan_head_group"], large["head_group"]) == (64, 32)  # large-batch rule: 2 programs x 32 heads
    assert [report[n]["lazy_l"] for n in CASES if "lazyl" in n] == [True, True]
    assert not any(report[n]["fp8_stage"] for n in CASES)  # device-only: the interpreter never stages fp8 tiles
    unchained = {n for n in CASES if report[n]["unchain"]}  # the 64-row bf16 default; never 16-row tiles
    assert {"bf16_h64_mtp2_p3_w3", "bf16_h64_unchain_p16_w3"} <= unchained and "bf16_p16_w1" not in unchained


def test_strided_inputs_give_the_bits_of_contiguous_ones(report):
    """The kernels take q's, the cache's and the block table's strides (the layout check's views into NaN-padded
    buffers, verify/strided_inputs.py): the same bits as on the contiguous batch and no NaN, split plans on pages
    of 1, 3, 4, 8 and 16 (block-table chunks in registers on the last two), MTP and all three dtype combos; and
    out and lse passed as views into NaN-filled buffers get the same bits, every element around them left NaN."""
    assert report["layout_bitwise"] == {name: [True, True, True, True] for name in LAYOUT_CASES}


def test_interleave_gives_the_same_bits(report):
    assert report["interleave_bitwise"] == [True, True]


def test_two_step_page_select_gives_the_same_bits(report):
    """KernelConfig.page_select = 2 (the tile's entries, then each token's) picks each token's page as the one-step
    select does: the same bits, no NaN (a wrong page would read the NaN page or other requests' tokens)."""
    assert report["page_select_bitwise"] == {"bf16_p4_chunks_w3": True, "fp8kv_p8_chunk4_mtp2_w3": True}


def test_cases_cover_splits_and_empty_rows(report):
    for name in SPLIT_CASES:
        assert report[name]["split_tiles"] >= 1, f"{name} did not split: the reduce kernel went untested"
    assert report["bf16_p16_w3_empty"]["empty_rows"] > 0
    assert report["bf16_p3_mtp2_w3"]["empty_rows"] > 0  # seq 1, q_len 2: row 0 sees no token
    assert report["bf16_all_empty"]["empty_rows"] == 3 * 16
    assert report["bf16_p16_manysplits_w40"]["reduce_blocks"] == [64, 32]  # two channel programs per row
    assert report["bf16_p16_w3_empty"]["reduce_blocks"][1] == 64  # few pieces: one program per row
    long_tail = report["bf16_p16_longtail_w32"]  # the long tile merged in four steps, the others in one
    assert long_tail["reduce_blocks"] == [4, 64] and 12 < long_tail["max_pieces"] <= 16, long_tail


def test_one_item_per_worker_path_gives_the_general_bits(report):
    taken = report["one_item_bitwise"]
    assert len(taken) >= 5, f"too few cases with one item per worker: {sorted(taken)}"
    assert all(taken.values()), taken
    forced = report["one_item_forced"]  # a plan with two items on its one worker, run as if it had one each
    assert forced["items"] == 2 and not forced["flag"] and forced["nan_rows"] > 0, forced


def test_graph_step_equals_decode(report):
    assert report["step_equals_decode"] == [True, True]


@pytest.mark.parametrize("name", STEP_CASES)
def test_the_step_check_passes_our_step(report, name):
    """The graph-capturable step gives the case's bits, and refilled with the next step in place and planned again
    (verify.next_step), then with one plain decode step, the oracle's answer for the new contents."""
    assert report["step_check"][name] == {"step": True, "step.replan.out": True, "step.replan.lse": True,
                                          "step.decode.out": True, "step.decode.lse": True}


def test_the_step_checks_worst_case_passes_at_its_sharp_bound(report):
    """STEP_WORST passes every check, and its replayed next step still reaches the flushed-P element it was pinned
    for: err / bound above 0.9 there (0.984 when found), where the bound is the flushed term times its growth factor."""
    checks = report["step_worst"]
    assert all(ok for ok, _ in checks.values()), {name: c for name, c in checks.items() if not c[0]}
    assert 0.9 < checks["step.replan.out"][1] <= 1.0, checks["step.replan.out"]


def test_interpreter_bf16_workaround_is_taken_and_needed(report):
    assert report["interpret"] is True
    r = report["no_workaround"]
    assert not (r["out_ratio"] <= 1.0), f"bf16 tl.dot in the interpreter was right without the upcast: {r}"


def test_interpreter_takes_no_programmatic_dependent_launch(report):
    assert report["pdl"] is False


def test_interpreter_rounds_bf16_output_to_nearest(report):
    """Triton 3.6's interpreter truncates fp32 -> bf16; the kernel rounds its output bits first (INTERPRET only), so
    out is within the declared 2^-8 |o| (numerics.md §5(f)); with truncation an fp8-KV case exceeded the bound 1.2x."""
    assert report["out_rne_w1"], "decode kernel: bf16 out is not the round-to-nearest-even of the fp32 out"
    assert report["out_rne_w3"], "reduce kernel: bf16 out is not the round-to-nearest-even of the fp32 out"


def test_split_runs_agree_within_split_bound(report):
    """1 vs 3 workers, fp32 outputs: within verify.bounds.split_bound; 2 merge_bound alone is too small (fp16 P is
    rounded under each split's own running max), which is what made split.out fail on fp8 cases."""
    r = report["split_pair"]
    assert r["split_ratio"] <= 1.0, r
    assert r["merge_only_ratio"] > 1.0, r


def test_block_table_chunks_cover_whole_tiles():
    """launch_page_chunk: the configured chunk where tiles lie inside pages; with pages of a quarter or half of a
    tile on tiles of at most 32 rows, at least one tile's pages (so a chunk of pages ends on a tile boundary); 0
    (the block table read in the loop) for smaller pages, pages that do not divide a tile, 64-row tiles, item starts
    off tile boundaries, or page_chunk=0."""
    pytest.importorskip("triton", reason=NEEDS_TRITON)
    from mla_fast.triton_decode import KernelConfig, launch_page_chunk

    config = KernelConfig(block_n=64, page_chunk=32)
    chunks = {ps: launch_page_chunk(config, ps, 64, 16) for ps in (1, 3, 8, 16, 32, 48, 64, 96, 128)}
    assert chunks == {1: 0, 3: 0, 8: 0, 16: 32, 32: 32, 48: 0, 64: 32, 96: 0, 128: 32}
    assert launch_page_chunk(config, 16, 64, 32) == 32
    assert launch_page_chunk(config, 16, 64, 64) == 0 and launch_page_chunk(config, 64, 64, 64) == 32
    assert launch_page_chunk(KernelConfig(block_n=64, page_chunk=2), 16, 64, 16) == 4  # one whole tile per chunk
    assert launch_page_chunk(KernelConfig(block_n=16, page_chunk=2), 4, 16, 16) == 4  # the interpreter's tiles
    assert launch_page_chunk(config, 16, 32, 16) == 0  # items may start mid-tile
    assert launch_page_chunk(KernelConfig(block_n=64, page_chunk=0), 16, 64, 16) == 0
    assert launch_page_chunk(replace(config, gather_chunk_pages=16), 4, 64, 16) == 32  # 16 pages per tile
    assert launch_page_chunk(replace(config, gather_chunk_pages=8), 4, 64, 16) == 0


def test_default_configs_take_block_table_chunks_per_cache_dtype():
    """default_config at 16 heads (16 rows, 64-token tiles): bf16 picks each token's page in two steps and takes
    chunks down to pages of 8; fp8 caches pick in one step and take them down to pages of 4 (the H200 A/B in its
    docstring). Neither takes them at 32 or more pages per tile."""
    pytest.importorskip("triton", reason=NEEDS_TRITON)
    from mla_fast.triton_decode import default_config, launch_page_chunk

    chunks = {}
    for combo in ("bf16", "fp8kv", "fp8"):
        config = default_config(combo, 16, 1)
        chunks[combo] = (config.page_select, [launch_page_chunk(config, ps, 64, 16) for ps in (1, 2, 4, 8, 16)])
    assert chunks == {"bf16": (2, [0, 0, 0, 32, 32]), "fp8kv": (1, [0, 0, 32, 32, 32]),
                      "fp8": (1, [0, 0, 32, 32, 32])}


def test_importing_mla_fast_does_not_import_triton(report):
    assert report["triton_imported_by_mla_fast"] is False


def test_launch_without_max_rows_takes_the_batch_rows(monkeypatch):
    """launch() without max_rows sizes the M tile from the batch (max q_len x head_group), not the 64-row maximum: a
    16-row config launched with 64 rows needed 288 KB of shared memory on the H200 (OutOfResources)."""
    td = pytest.importorskip("mla_fast.triton_decode")
    seen = []

    def record(*args):
        seen.append(args[10])  # _launch_triton's max_rows
        return None

    monkeypatch.setattr(td, "_launch_triton", record)
    for q_lens, head_group in [((1, 1), 16), ((2, 1), 8), ((3, 4), 16)]:
        batch = TritonCase((70, 5), q_lens, heads=16).batch()
        config = td.KernelConfig(head_group=head_group, head_split=16 // head_group)
        plan = td.make_plan(batch, config, num_workers=2)
        T, H, L = batch.q.shape[0], batch.num_heads, batch.kv_lora_rank
        td.launch(batch, plan, torch.empty(T, H, L, dtype=torch.bfloat16), torch.empty(T, H), config)
        assert seen[-1] == max(q_lens) * head_group, (q_lens, head_group, seen)


def test_graph_step_sizes_its_reduce_from_the_batch_size():
    """The step's default reduce shape follows the batch size (step_reduce_pieces: 64 pieces per step for one
    request, whose long plans cut each tile in up to num_workers pieces; 8 from 15 requests on 132 workers); an
    explicit reduce_pieces is kept."""
    td = pytest.importorskip("mla_fast.triton_decode")
    assert [td.step_reduce_pieces(132, t) for t in (1, 4, 5, 8, 14, 15, 128)] == [64, 64, 32, 16, 16, 8, 8]
    assert td.step_reduce_pieces(66, 32) == td.STEP_REDUCE_PIECES  # 128 heads, b = 32: two workers per request
    config = td.KernelConfig(head_group=16, head_split=1)
    one = TritonCase((300,), (1,), heads=16).batch()
    many = TritonCase((300,) * 20, (1,) * 20, heads=16).batch()
    assert td.TritonMLADecode(one, num_workers=132, config=config).reduce_pieces == 64
    assert td.TritonMLADecode(many, num_workers=132, config=config).reduce_pieces == 8
    assert td.TritonMLADecode(one, num_workers=132, config=config, reduce_pieces=16).reduce_pieces == 16


def test_reduce_steps_fit_one_wave_of_programs():
    """plan_reduce_pieces on H200-sized plans (132 SMs and workers, 64-token blocks, 16 heads: 16 rows per tile,
    L = 512): every piece in one step while the grid over the split tiles fits REDUCE_WAVE programs per SM
    (uniform batches, one request, a few long ones), else narrower steps, so that one long request among many short
    split ones takes several steps instead of multiplying every split tile's programs."""
    td = pytest.importorskip("mla_fast.triton_decode")
    from mla_fast.planner import plan_decode

    def pieces(seq_lens, rows=16, workers=132):
        plan = plan_decode(torch.tensor(seq_lens), torch.ones(len(seq_lens), dtype=torch.int32), rows, workers,
                           block_n=64, head_group=rows)
        return plan, td.plan_reduce_pieces(plan, rows, 512, 132)

    uniform, p = pieces([4096] * 32)
    assert (uniform.max_pieces, p) == (4, 4)  # (32, 4096): 4 pieces per tile, [4, 512] steps
    one, p = pieces([8192])
    assert one.max_pieces > td.REDUCE_MAX_S and p == td.REDUCE_MAX_S  # one split tile: 256 programs of [64, 32]
    tail, p = pieces([32768] + [1024] * 63)
    assert tail.split_tiles == 64 and tail.max_pieces > 32 and p == 8  # 2048 programs of [8, 256]; 16: 4096
    few, p = pieces([65536] + [1024] * 15)
    assert few.split_tiles == 16 and few.max_pieces > 64 and p == 32  # 2048 programs of [32, 64]
    wide, p = pieces([4096] * 32, rows=128, workers=66)  # 128 rows per tile: [2, 512] steps, 4096 programs
    assert (wide.max_pieces, p) == (2, 2)  # halving would not narrow the grid
    short, p = pieces([64] * 8)
    assert (short.split_tiles, p) == (0, 0)


def test_graph_step_plans_from_host_lengths():
    """plan(seq_lens=, q_lens=) with host copies fills the static buffers as plan() reading the batch does, in both
    staging buffers (used in turn), after the lengths change too; the buffers are 16-byte aligned views of one
    allocation (4 workers: worker_indptr has 5 words, so the next view needs padding); bad host lengths raise
    ValueError."""
    td = pytest.importorskip("mla_fast.triton_decode")
    batch = TritonCase((300, 129, 7), (1, 2, 1), heads=16).batch()  # pages for every length set below
    config = td.KernelConfig(head_group=16, head_split=1)
    steps = [td.TritonMLADecode(batch, max_q_len=2, num_workers=4, config=config) for _ in range(2)]
    for lens in ((300, 5, 0), (64, 129, 7), (0, 0, 0)):
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        steps[0].plan()
        steps[1].plan(seq_lens=batch.seq_lens.clone(), q_lens=batch.q_lens.clone())
        plan = td.make_plan(batch, config, 4)
        for step in steps:
            n, t = plan.num_items, plan.num_tiles
            assert torch.equal(step.work_items[:n], plan.work_items) and not step.work_items[n:].any()
            assert torch.equal(step.worker_indptr, plan.worker_indptr)
            assert torch.equal(step.reduce_final[:t], plan.reduce_final) and not step.reduce_final[t:].any()
            assert torch.equal(step.qo_indptr, batch.qo_indptr)
    for view in (steps[0].work_items, steps[0].worker_indptr, steps[0].reduce_final, steps[0].qo_indptr):
        assert view.data_ptr() % 16 == 0 and view.untyped_storage().data_ptr() == steps[0]._meta.data_ptr()
    with pytest.raises(ValueError, match="both seq_lens and q_lens"):
        steps[1].plan(seq_lens=batch.seq_lens.clone())
    with pytest.raises(ValueError, match="q_lens must be a CPU tensor of shape"):
        steps[1].plan(seq_lens=batch.seq_lens.clone(), q_lens=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"batch.sm_scale must be the step's 0.1352338 \(fixed when it was built\)"):
        steps[0].plan(batch.replace(sm_scale=0.5))  # a review's: run() kept launching with the old one


def test_graph_step_checks_the_scales_it_copies_from_host_planned_batches():
    """A new per-tensor kv_scale reaches the step's buffer when it plans; from host copies of the lengths too, where
    validate() does not run: a NaN, zero or missing scale raises ValueError naming it (a review's: NaN gave an
    all-NaN output, None kept the previous step's scale)."""
    td = pytest.importorskip("mla_fast.triton_decode")
    batch = TritonCase((40, 7), (1, 1), heads=16, combo="fp8kv").batch()
    step = td.TritonMLADecode(batch, num_workers=4, config=td.KernelConfig(head_group=16, head_split=1))
    lens = dict(seq_lens=batch.seq_lens.clone(), q_lens=batch.q_lens.clone())
    step.plan(batch.replace(kv_scale=0.25), **lens)
    assert step.kv_scale.tolist() == [0.25]
    for bad in (float("nan"), 0.0, None):
        with pytest.raises(ValueError, match="kv_scale"):
            step.plan(batch.replace(kv_scale=bad), **lens)
    assert step.kv_scale.tolist() == [0.25]


def test_only_the_graph_steps_reduce_lets_idle_programs_exit(monkeypatch):
    """The reduce's programs without work (unsplit tiles, rows past a tile's) skip the wait for the decode only in
    TritonMLADecode's launch, whose reduce grid spans the step's capacity: -2.5 to -20 us per replay on unsplit plans
    (twentieth session, one H200). A plan's own reduce keeps the wait beside the metadata loads: its programs mostly
    have work, and there the early exit cost up to 0.5 us."""
    td = pytest.importorskip("mla_fast.triton_decode")
    seen = []

    class Reduce:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, kwargs["IDLE_EXIT"]))

    monkeypatch.setattr(td, "_launch_triton", lambda *args, **kwargs: None)  # the decode: not run here
    monkeypatch.setattr(td, "_mla_reduce_kernel", Reduce())
    batch = TritonCase((300, 5), (1, 1), heads=16).batch()
    config = td.KernelConfig(head_group=16, head_split=1)
    plan = td.make_plan(batch, config, num_workers=4)
    assert plan.num_partial_rows > 0  # the 300-token request is split: a reduce follows the decode
    T, H, L = batch.q.shape[0], batch.num_heads, batch.kv_lora_rank
    td.launch(batch, plan, torch.empty(T, H, L, dtype=torch.bfloat16), torch.empty(T, H), config)
    step = td.TritonMLADecode(batch, num_workers=4, config=config)
    step.plan()
    step.run()
    assert [flag for _, flag in seen] == [False, True]
    assert seen[1][0][0] == step.reduce_final.shape[0]  # the step's grid: every tile of its capacity


@pytest.mark.parametrize("heads", [40, 48, 64, 128])
def test_small_batch_default_covers_every_head(heads):
    """head_group x head_split programs of a worker must cover the heads exactly (the planner's head group divides
    num_heads): 40 heads in groups of 16 would leave 8 uncovered."""
    td = pytest.importorskip("mla_fast.triton_decode")
    config = td.default_config("bf16", heads, 1, batch_size=1)
    assert config.head_group <= 16 and config.head_group * config.head_split == heads, config


def test_bad_batches_raise_value_error():
    td = pytest.importorskip("mla_fast.triton_decode")
    batch = TritonCase((5,), (1,), L=48, R=16).batch()  # kv_lora_rank not a power of two
    with pytest.raises(ValueError, match="kv_lora_rank"):
        td.check_batch(batch)
    batch = TritonCase((5,), (1,)).batch()
    with pytest.raises(ValueError, match="dtypes"):
        td.check_batch(batch.replace(q=batch.q.to(torch.float32)))
    with pytest.raises(ValueError, match="page_chunk"):
        td.KernelConfig(page_chunk=24)
    with pytest.raises(ValueError, match="split_l"):
        td.KernelConfig(split_l=3)
    with pytest.raises(ValueError, match="v_reload"):
        td.KernelConfig(split_l=4, v_reload=True)
    config = td.KernelConfig(head_group=8, head_split=2, plan_block_n=16)
    plan = td.make_plan(batch, replace(config, head_split=1), num_workers=2)  # planned for head_group 8, not 16
    with pytest.raises(ValueError, match="head_split"):
        td.launch(batch, plan, None, None, config)
    plan = td.make_plan(batch, config, num_workers=2)
    with pytest.raises(ValueError, match="pdl=True needs CUDA sm_90"):  # griddepcontrol: not on the CPU
        td.launch(batch, plan, None, None, config, pdl=True)
    with pytest.raises(ValueError, match="reduce_pieces"):
        td.TritonMLADecode(batch, reduce_pieces=0)


def test_decode_validates_values_and_a_given_plan():
    """decode checks what the kernel would otherwise read wrongly or fault on, before any launch (found by a review:
    a block-table entry of 10^6 segfaulted, q_lens not adding up to T corrupted the heap, a plan for other lengths
    dropped tokens): ValueError naming the field. A batch of no requests gives empty outputs."""
    td = pytest.importorskip("mla_fast.triton_decode")
    batch = TritonCase((40, 5), (1, 1), page_size=16).batch()  # block table capacity: 3 pages x 16
    used = batch.block_table.clone()
    used[0, 0] = 10**6
    bad = {
        r"DecodeBatch\.seq_lens:": batch.replace(seq_lens=torch.tensor([49, 5], dtype=torch.int32)),
        r"DecodeBatch\.q_lens:": batch.replace(q_lens=torch.tensor([1, 2], dtype=torch.int32)),
        r"DecodeBatch\.block_table:": batch.replace(block_table=used),
        r"DecodeBatch\.sm_scale:": batch.replace(sm_scale=float("nan")),
    }
    for match, b in bad.items():
        with pytest.raises(ValueError, match=match):
            td.decode(b)
        with pytest.raises(ValueError, match=match):
            td.TritonMLADecode(b)
    config = td.KernelConfig(head_group=16, head_split=1)
    other = batch.replace(seq_lens=torch.tensor([16, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"plan\.seq_lens must equal the batch's seq_lens \[40, 5\], got \[16, 5\]"):
        td.decode(batch, plan=td.make_plan(other, config, 2), config=config)
    step = td.TritonMLADecode(batch, num_workers=2, config=config)
    with pytest.raises(ValueError, match="capacity 48"):
        step.plan(seq_lens=torch.tensor([49, 5], dtype=torch.int32), q_lens=batch.q_lens.clone())
    with pytest.raises(ValueError, match="add up to q's rows 2"):
        step.plan(seq_lens=batch.seq_lens.clone(), q_lens=torch.tensor([1, 2], dtype=torch.int32))
    none = batch.replace(q=batch.q[:0], seq_lens=batch.seq_lens[:0], q_lens=batch.q_lens[:0],
                         block_table=batch.block_table[:0])
    out, lse = td.decode(none)
    assert out.shape == (0, 16, 64) and lse.shape == (0, 16)


def test_decode_refuses_strided_inputs_and_bad_output_buffers():
    """The kernels take the row strides only: a block table or seq_lens viewed with a stride gave wrong outputs (a
    transposed block table segfaulted), and out / lse buffers of the wrong shape, dtype or layout were written out of
    bounds (heap corruption) or truncated (found by a review): ValueError naming the tensor, before any launch."""
    td = pytest.importorskip("mla_fast.triton_decode")
    batch = TritonCase((40, 5), (1, 1), page_size=16).batch()
    T, H, L = batch.q.shape[0], batch.num_heads, batch.kv_lora_rank
    wide = torch.stack([batch.block_table, batch.block_table], dim=-1)  # [B, pages, 2]
    lens = torch.stack([batch.seq_lens, batch.seq_lens], dim=-1)  # [B, 2]
    assert torch.equal(wide[..., 0], batch.block_table) and torch.equal(lens[:, 0], batch.seq_lens)  # same values
    for match, b in {"block_table must be contiguous": batch.replace(block_table=wide[..., 0]),
                     "seq_lens must be contiguous": batch.replace(seq_lens=lens[:, 0])}.items():
        with pytest.raises(ValueError, match=match):
            td.decode(b)
    good_out = torch.empty(T, H, L, dtype=torch.bfloat16)
    good_lse = torch.empty(T, H, dtype=torch.float32)
    bad = {
        "out must be a torch.bfloat16 or torch.float32 tensor of shape": dict(out=torch.empty(1, H, L,
                                                                                           dtype=torch.bfloat16)),
        "out must be a torch.bfloat16 or torch.float32": dict(out=torch.empty(T, H, L, dtype=torch.int32)),
        "out must be contiguous in its last dim": dict(out=torch.empty(T, H, 2 * L, dtype=torch.bfloat16)[..., ::2]),
        "lse must be a torch.float32 tensor of shape": dict(lse=torch.empty(T * H, dtype=torch.float32)),
        "lse must be contiguous in its last dim": dict(lse=torch.empty(H, T, dtype=torch.float32).t()),
    }
    for match, kw in bad.items():
        with pytest.raises(ValueError, match=match):
            td.decode(batch, **{"out": good_out, "lse": good_lse, **kw})


def test_e4m3fnuz_is_refused_off_rocm(monkeypatch):
    """Triton compiles e4m3fnuz for AMD CDNA3 only: on CUDA and in the interpreter decode says so (ValueError naming
    the tensor) and the triton backends make the case unsupported, through run and through run_workers, the path
    the verifier takes (a verifier campaign reported it as a contract failure; found by a review; then again through
    run_workers, which had called decode directly)."""
    td = pytest.importorskip("mla_fast.triton_decode")
    from mla_fast.backends import BACKENDS, Unsupported
    from verify.cases import Case
    from verify.checks import run_case
    from verify.kernels import from_backend

    batch = TritonCase((40, 5), (1, 1), page_size=16, combo="fp8kv").batch()
    fnuz = batch.replace(kv_cache=batch.kv_cache.view(torch.uint8).clamp(max=0x77).view(torch.float8_e4m3fn)
                         .float().to(torch.float8_e4m3fnuz))  # finite codes, exact in e4m3fnuz
    with pytest.raises(ValueError, match="kv_cache: e4m3fnuz runs on ROCm only"):
        td.decode(fnuz)
    case = Case(seq_lens=(40, 5), q_lens=(1, 1), heads=2, q_dtype="fp8", kv_dtype="fp8", fp8_format="e4m3fnuz")
    for name in ("triton", "seesaw", "gluon_fp8"):
        with pytest.raises(Unsupported, match="e4m3fnuz runs on ROCm only"):
            BACKENDS[name].run(fnuz)  # refused before any launch (this process does not interpret)
        with pytest.raises(Unsupported, match="e4m3fnuz runs on ROCm only"):
            BACKENDS[name].run_workers(fnuz, 4)
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], probe=lambda: (True, "test")))
        result = run_case(case, from_backend(name), "cpu")  # the verifier's path, as on a GPU
        assert "e4m3fnuz runs on ROCm only" in (result.unsupported or ""), result.describe()


@pytest.mark.parametrize("q_dtype, kv_dtype, fmt", [("fp16", "fp16", "e4m3fn"), ("bf16", "fp8", "e5m2")])
def test_fp16_and_e5m2_inputs_are_refused_as_unsupported(monkeypatch, q_dtype, kv_dtype, fmt):
    """Our kernels take bf16 / bf16, bf16 / fp8 and fp8 / fp8 in e4m3: fp16 q and cache, and e5m2 caches, which
    DecodeBatch takes and the smoke prefix's dtype cases bring, are refused by name (Unsupported, through run,
    run_workers and the numerics), so that such a case is reported unsupported, not failed by a ValueError in the
    numerics (found with the dtype smoke cases) nor run on bits read as another format."""
    pytest.importorskip("mla_fast.triton_decode")
    from mla_fast.backends import BACKENDS, Unsupported
    from verify.cases import Case
    from verify.checks import run_case
    from verify.kernels import from_backend

    case = Case(seq_lens=(40, 5), q_lens=(1, 1), heads=2, q_dtype=q_dtype, kv_dtype=kv_dtype, fp8_format=fmt)
    batch = case.materialize()[0]
    for name in ("triton", "triton_invariant"):
        backend = BACKENDS[name]
        for call, args in ((backend.run, (batch,)), (backend.run_workers, (batch, 4)), (backend.numerics, (batch,))):
            with pytest.raises(Unsupported, match="q/kv_cache dtypes must be bf16/bf16, bf16/fp8 or fp8/fp8"):
                call(*args)
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(backend, probe=lambda: (True, "test")))
        result = run_case(case, from_backend(name), "cpu")  # the verifier's path, as on a GPU
        assert result.status == "unsupported" and "dtypes must be" in result.unsupported, result.describe()


@pytest.mark.parametrize("combo, heads", [("bf16", 16), ("bf16", 128), ("fp8kv", 16), ("fp8", 64)])
def test_persistent_grid_is_workers_per_sm_programs_per_sm(monkeypatch, combo, heads):
    """The decode launch is persistent: workers_per_sm x SMs programs (one per SM for the Triton kernel's default
    configs; the Gluon fp8 kernel's take 2) rounded down to whole workers of head_split programs (132 SMs, head_split
    8: 128 programs; at least one worker), whatever the batch, each looping over its plan items. The kernels are
    replaced by recorders (no launch), so this runs without the interpreter; the CPU counts 4 SMs."""
    td = pytest.importorskip("mla_fast.triton_decode")
    launched = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            launched[self.name] = grid
            return lambda *args, **kwargs: None

    monkeypatch.setattr(td, "_mla_decode_kernel", Recorder("decode"))
    monkeypatch.setattr(td, "_mla_reduce_kernel", Recorder("reduce"))
    for lens in [(5,), (3000, 0, 17, 700, 64, 1, 2, 9)]:
        batch = TritonCase(lens, (1,) * len(lens), heads=heads, page_size=16, combo=combo).batch()
        config = td.batch_config(batch, 1)
        td.decode(batch, config=config)
        slots, split = config.workers_per_sm * td.num_sms(batch.device), config.head_split
        assert launched["decode"] == (max(1, slots // split) * split,), (lens, config)
        assert config.workers_per_sm == (2 if config.kernel == "gluon_fp8" else 1)


def test_graph_step_refuses_misuse():
    """TritonMLADecode: run() before plan() read uninitialised plan buffers, plan() with another batch planned it
    while run() read the step's own, and q_lens above max_q_len left rows unwritten (found by a review)."""
    td = pytest.importorskip("mla_fast.triton_decode")
    config = td.KernelConfig(head_group=16, head_split=1)
    batch = TritonCase((40, 5), (1, 2), page_size=16).batch()
    with pytest.raises(ValueError, match="max_q_len must be >= the batch's largest q_len 2"):
        td.TritonMLADecode(batch, num_workers=2, config=config)
    step = td.TritonMLADecode(batch, max_q_len=2, num_workers=2, config=config)
    with pytest.raises(RuntimeError, match="before plan"):
        step.run()
    with pytest.raises(ValueError, match="max_q_len 2"):
        step.plan(seq_lens=batch.seq_lens.clone(), q_lens=torch.tensor([3, 0], dtype=torch.int32))
    other = TritonCase((40, 5), (1, 2), page_size=16).batch()  # the same values in other tensors
    with pytest.raises(ValueError, match="the step's own tensors"):
        step.plan(other)
    step.plan(batch.replace(sm_scale=batch.sm_scale))  # another DecodeBatch over the same tensors is the same step
    step.plan(batch.replace(q_lens=batch.q_lens.clone()))  # q_lens reach run() through plan()'s host copy only
    wide = batch.block_table[:, :1].t().contiguous().t()  # [B, 1]: stride (1, B), contiguous for torch
    assert wide.stride(-1) != 1 and wide.is_contiguous()
    td.check_batch(batch.replace(block_table=wide, seq_lens=torch.tensor([16, 5], dtype=torch.int32)))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        td.KernelConfig(block_n=7)
    with pytest.raises(ValueError, match="mma must be"):
        td.KernelConfig(mma="fp32")


def test_gluon_kernel_is_chosen_only_where_it_runs():
    """default_config takes the Gluon seesaw kernel for bf16 with more than 16 packed rows (q_len x head_group; one
    request too), and only with seesaw=True, which batch_config sets from gluon_decode.supported (never on this
    CPU)."""
    td = pytest.importorskip("mla_fast.triton_decode")
    gd = pytest.importorskip("mla_fast.gluon_decode")
    for args, geometry in [(("bf16", 128, 1, 32), (64, 2)), (("bf16", 64, 1, 32), (64, 1)),
                           (("bf16", 128, 1, 1), (64, 2)), (("bf16", 128, 2, 32), (32, 4)),
                           (("bf16", 16, 4, 32), (16, 1)), (("bf16", 16, 3, 32), (16, 1)),
                           (("bf16", 32, 1, 32), (32, 1)), (("bf16", 32, 1, 1), (32, 1)),
                           (("bf16", 16, 2, 32), (16, 1)), (("bf16", 8, 4, 32), (8, 1))]:
        config = td.default_config(*args, seesaw=True)
        assert (config.kernel, config.head_group, config.head_split, config.mma) == ("gluon", *geometry, "bf16"), args
    # fp8 caches: 64 packed rows on fp16 operands, where the Gluon fp8 kernel's rule does not take the batch (s_k 4096)
    for args, geometry in [(("fp8kv", 128, 1, 32), (64, 2)), (("fp8", 128, 1, 9), (64, 2)),
                           (("fp8kv", 64, 1, 9), (64, 1)), (("fp8kv", 128, 2, 32), (32, 4)),
                           (("fp8", 16, 4, 32), (16, 1)), (("fp8kv", 32, 2, 128), (32, 1))]:
        config = td.default_config(*args, seesaw=True, fp8_gluon=True, kv_tokens=args[3] * 4096)
        assert (config.kernel, config.head_group, config.head_split, config.mma) == ("gluon", *geometry, "fp16"), args
    for args, kernel in [(("fp8kv", 128, 1, 3), "gluon_fp8"), (("fp8kv", 64, 1, 6), "gluon_fp8"),
                         (("fp8kv", 32, 1, 128), "gluon_fp8"), (("fp8kv", 128, 1, 1), "gluon_fp8"),
                         (("fp8kv", 8, 1, 128), "triton"),  # 8 rows: neither Gluon kernel
                         (("fp8kv", 128, 1, 2), "gluon_fp8")]:
        assert td.default_config(*args, seesaw=True, fp8_gluon=True, kv_tokens=args[3] * 4096).kernel == kernel, args
    assert td.default_config("fp8kv", 128, 1, 32, seesaw=True).kernel == "gluon"  # without fp8_gluon too
    # small batches of long sequences past the Gluon fp8 kernel's rule: the seesaw's 64 rows, not 32-row tiles
    for b, s, h, geometry in [(4, 8192, 128, (64, 2)), (1, 32768, 128, (64, 2)), (4, 16384, 64, (64, 1))]:
        config = td.default_config("fp8kv", h, 1, b, seesaw=True, fp8_gluon=True, kv_tokens=b * s)
        assert (config.kernel, config.head_group, config.head_split) == ("gluon", *geometry), (b, s, h)
        for kwargs in ({}, dict(seesaw=True)):  # no Gluon fp8 kernel offered: the Triton kernel's 32-row tiles
            config = td.default_config("fp8kv", h, 1, b, kv_tokens=b * s, **kwargs)
            assert (config.kernel, config.head_group) == ("triton", td.MAX_ROWS_SMALL_FP8), (b, s, h, kwargs)
    for args in [("bf16", 128, 1, 32, False), ("fp8kv", 128, 1, 32, False), ("bf16", 16, 1, 32, True),
                 ("bf16", 8, 2, 32, True), ("bf16", 32, 1, 32, False), ("bf16", 128, 1, 1, False)]:
        assert td.default_config(*args).kernel == "triton", args
    batch = TritonCase((70,), (1,), heads=64, page_size=64, L=512, R=64).batch()
    assert not gd.supported(batch)
    assert td.batch_config(batch, 1).kernel == "triton"


def _boundary_bench():
    """benchmarks/boundary_bench.py as a module."""
    pytest.importorskip("triton", reason=NEEDS_TRITON)
    return benchmark_module("boundary_bench")


def test_boundary_bench_times_both_kernels_on_both_sides_of_the_rule():
    """benchmarks/boundary_bench.py (the tenth-session boundary table in docs/perf_history.md) forces the Gluon fp8
    kernel and the fp8 seesaw in default_config's geometry (mla_fast.bench.forced_fp8_kernels), and its grid has shapes
    on both sides of the rule at every head count, where default_config picks one of the two forced configs."""
    td = pytest.importorskip("mla_fast.triton_decode")
    from mla_fast.bench import forced_fp8_kernels

    bb = _boundary_bench()
    forced = forced_fp8_kernels("fp8kv", 128, 1)
    assert [(c.kernel, c.head_group, c.head_split, c.mma) for c in forced.values()] == [
        ("gluon_fp8", 16, 8, "fp16"), ("gluon", 64, 2, "fp16")]
    assert set(forced_fp8_kernels("fp8", 16, 1)) == {"gluon_fp8"}  # 16 rows: the seesaw takes fp8 caches at > 32
    picks = {}
    for b, s, h, q_len in bb.SHAPES:
        forced = forced_fp8_kernels("fp8kv", h, q_len)
        default = td.default_config("fp8kv", h, q_len, b, seesaw=True, fp8_gluon=True, kv_tokens=b * s)
        chosen = [name for name, config in forced.items() if config == default]
        assert len(chosen) == 1, (b, h, q_len, default)
        picks.setdefault((h, q_len > 1), set()).add(chosen[0])
    assert all(p == {"gluon_fp8", "seesaw"} for p in picks.values()), picks


def test_boundary_bench_writes_its_table_and_takes_the_mtp_shapes(tmp_path):
    """boundary_bench.write_table gives the committed tables' form (comment lines, TABLE_COLUMNS, one line per shape
    in the order measured, us rounded to 0.1) and leaves a kernel's cell empty where it was not timed (a failed
    measurement, or no seesaw at 32 rows or fewer); --shapes takes "mtp" for MTP_SHAPES."""
    bb = _boundary_bench()
    rows = [  # (2, 8192, 128): all timed; (4, 8192, 32): the seesaw left out, the bf16 measurement failed
        dict(b=2, s=8192, h=128, q_len=1, combo="fp8kv", config="default", us=30.94),
        dict(b=2, s=8192, h=128, q_len=1, combo="fp8kv", config="gluon_fp8", us=35.75),
        dict(b=2, s=8192, h=128, q_len=1, combo="fp8kv", config="seesaw", us=31.04),
        dict(b=2, s=8192, h=128, q_len=1, combo="bf16", config="default", us=28.96),
        dict(b=4, s=8192, h=32, q_len=1, combo="fp8kv", config="gluon_fp8", us=39.41),
        dict(b=4, s=8192, h=32, q_len=1, combo="bf16", config="default", status="error: out of memory"),
    ]
    path = tmp_path / "table.csv"
    bb.write_table(str(path), rows, "first line\nsecond line")
    assert path.read_text().splitlines() == [
        "# first line", "# second line", ",".join(bb.TABLE_COLUMNS),
        "2,8192,128,1,35.8,31.0,29.0", "4,8192,32,1,39.4,,"]
    assert bb.shapes_arg("mtp") == bb.MTP_SHAPES
    assert bb.shapes_arg("1,8192,128,2;4,4096,64,1") == [(1, 8192, 128, 2), (4, 4096, 64, 1)]


# where default_config's rule picks the slower of the two kernels in each boundary_bench table of the thirty-seventh
# session (benchmarks/boundary_h200_{combo}_p{page}[_mtp].csv), (b, s_k, heads, q_len) -> (chosen, other) us:
# (32, 512, 128), whose short sequences the Gluon fp8 kernel runs faster at any programs x tokens, and shapes next to
# a threshold (on pages of 16 with fp8kv, 24 x 4096 would lose less among SHAPES and more among MTP_SHAPES)
BOUNDARY_LOSSES = {
    ("fp8kv", 16, "SHAPES"): {(6, 4096, 64, 1): (33.6, 30.7)},
    ("fp8kv", 16, "MTP_SHAPES"): {(1, 4096, 128, 2): (26.1, 25.7), (2, 4096, 64, 2): (26.7, 26.1),
                                  (1, 4096, 64, 4): (27.0, 25.9), (2, 4096, 32, 4): (26.8, 26.2)},
    ("fp8kv", 32, "SHAPES"): {(32, 512, 128, 1): (31.0, 29.8)},
    ("fp8kv", 64, "SHAPES"): {(8, 4096, 64, 1): (33.3, 32.5), (32, 512, 128, 1): (31.1, 29.1)},
    ("fp8kv", 64, "MTP_SHAPES"): {(1, 6144, 128, 2): (29.2, 29.1)},
    ("fp8", 16, "SHAPES"): {(8, 4096, 64, 1): (32.4, 31.6), (32, 512, 128, 1): (30.1, 27.4)},
    ("fp8", 16, "MTP_SHAPES"): {(4, 4096, 64, 2): (31.9, 31.7)},
    ("fp8", 32, "SHAPES"): {(2, 8192, 128, 1): (30.9, 30.6), (4, 8192, 16, 3): (30.8, 30.1),
                            (16, 1024, 128, 1): (29.8, 29.4), (8, 2048, 128, 1): (29.5, 29.4)},
    ("fp8", 64, "SHAPES"): {},
    ("fp8", 64, "MTP_SHAPES"): {},
}


@pytest.mark.parametrize("combo, page_size, shapes", sorted(BOUNDARY_LOSSES))
def test_boundary_rule_picks_the_faster_kernel_on_every_measured_shape(combo, page_size, shapes):
    """default_config's choice between the Gluon fp8 kernel and the fp8 seesaw (batch_config on an H200: both
    offered, the batch's page size passed) is the faster of the two at every shape of the thirty-seventh session's
    boundary_bench call of `shapes` (boundary_bench.SHAPES or MTP_SHAPES) on pages of `page_size`
    (benchmarks/boundary_h200_{combo}_p{page_size}[_mtp].csv), except at the shapes BOUNDARY_LOSSES names with their
    times, so that a change to the rule or a new table shows which measured shapes it gets wrong. At the tables'
    0.1 us, a tie is not a loss."""
    td = pytest.importorskip("mla_fast.triton_decode")
    suffix = "_mtp" if shapes == "MTP_SHAPES" else ""
    table = HERE.parent / "benchmarks" / f"boundary_h200_{combo}_p{page_size}{suffix}.csv"
    rows = list(csv.DictReader(ln for ln in table.read_text().splitlines() if not ln.startswith("#")))
    assert [tuple(int(r[k]) for k in ("b", "s_k", "heads", "q_len")) for r in rows] == getattr(_boundary_bench(),
                                                                                                shapes)
    us = {"gluon_fp8": "gluon_fp8_us", "gluon": "seesaw_us"}  # kernel -> its column
    losses = {}
    for row in rows:
        b, s, h, q_len = shape = tuple(int(row[k]) for k in ("b", "s_k", "heads", "q_len"))
        config = td.default_config(combo, h, q_len, b, seesaw=True, fp8_gluon=True, kv_tokens=b * s,
                                   page_size=page_size)
        assert config.kernel in us, (row, config)
        other = "gluon" if config.kernel == "gluon_fp8" else "gluon_fp8"
        chosen, alternative = float(row[us[config.kernel]]), float(row[us[other]])
        if chosen > alternative:
            losses[shape] = (chosen, alternative)
    assert losses == BOUNDARY_LOSSES[combo, page_size, shapes]


def test_seesaw_fp8_boxes_land_where_the_in_place_expansion_is_safe():
    """With an fp8 cache each chunk group's fp8 boxes land in the upper half of the group's fp16 bytes
    (`_staged_box`, in 4 KB halves: fp16 chunk c = halves 2c, 2c + 1), so that `_score_group` can expand in place:
    the first two chunks of a 4-chunk group are stored before the barrier and must not cover any box; chunk
    first + j covers boxes 2j - n, 2j - n + 1 (all loaded before the barrier); the k_pe box lies in chunk 8's second
    half. Boxes of different groups never share bytes."""
    gd = pytest.importorskip("mla_fast.gluon_decode")
    taken = set()
    for g in range(3):
        first, end = gd._group_first(g), gd._group_end(g)
        n = end - first
        halves = [gd._staged_box(g, j) for j in range(n)]
        assert halves == list(range(2 * first + n, 2 * end)), (g, halves)  # the group's upper half, in order
        assert not taken & set(halves)
        taken |= set(halves)
        for j in range(n):  # fp16 chunk first + j covers these boxes
            covered = [k for k, h in enumerate(halves) if h in (2 * (first + j), 2 * (first + j) + 1)]
            assert covered == [k for k in (2 * j - n, 2 * j - n + 1) if 0 <= k < n], (g, j, covered)
            if n == 4 and j < 2:
                assert covered == []  # stored before the barrier
    assert max(taken) < 2 * gd.N_CHUNKS


def test_gluon_kernel_rejects_what_it_cannot_take():
    td = pytest.importorskip("mla_fast.triton_decode")
    gd = pytest.importorskip("mla_fast.gluon_decode")
    ok = TritonCase((70,), (1,), heads=64, page_size=64, L=512, R=64).batch()  # all it takes, but on a CPU
    fp8kv = TritonCase((70,), (1,), heads=64, page_size=64, L=512, R=64, combo="fp8kv").batch()
    q_wide = torch.zeros(ok.q.shape[0], 64, 2 * 576, dtype=ok.q.dtype)[..., :576]  # [T, H, 576], row stride 1152
    reasons = {  # expected words -> (batch, head_group, head_split, rows per program)
        "sm_90": (ok, 64, 1, 64),
        "at most 64 rows": (ok, 64, 1, 128),
        "num_heads = head_group x head_split": (ok, 64, 2, 64),
        "head_group in": (ok, 12, 1, 12),
        "page_size % 64 == 0 or page_size in (16, 32)": (
            TritonCase((70,), (1,), heads=64, page_size=8, L=512, R=64).batch(), 64, 1, 64),
        "kv_lora_rank 512": (TritonCase((70,), (1,), heads=64, page_size=64).batch(), 64, 1, 64),
        "e4m3fn cache with bf16 or e4m3fn q": (fp8kv.replace(kv_cache=fp8kv.kv_cache.to(torch.float8_e4m3fnuz)),
                                               64, 1, 64),
        "contiguous": (ok.replace(q=q_wide.copy_(ok.q)), 64, 1, 64),
    }
    for words, (batch, head_group, head_split, rows) in reasons.items():
        assert words in (gd.unsupported(batch, head_group, head_split, rows) or ""), words
    for page_size in (16, 32, 128):  # one TMA box per page (gd.SMALL_PAGES), or whole tiles: only the CPU stops it
        batch = TritonCase((70,), (1,), heads=64, page_size=page_size, L=512, R=64).batch()
        assert "sm_90" in gd.unsupported(batch, 64, 1, 64)
    assert [gd.tile_boxes(p) for p in (8, 16, 32, 64, 128, 48)] == [1, 4, 2, 1, 1, 1]
    # the grouped layout (8-token boxes of c_kv halves): bf16 caches on every page the seesaw takes (gd.GROUPED_PAGES,
    # pages of 64k as 64) and e4m3fn caches' staging (gd.SEESAW_FP8_GROUPED_PAGES), not pages of 8 (the seesaw does
    # not take them); each constant emptied (config_ab's A/B), none of its dtype
    caches = {(dtype, p): torch.empty(2, p, 576, dtype=dtype) for dtype in (torch.bfloat16, torch.float8_e4m3fn)
              for p in (8, 16, 32, 64, 128)}
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert [k for k, kv in caches.items() if gd.grouped_layout(kv)] == [(d, p) for d in (bf16, fp8)
                                                                          for p in (16, 32, 64, 128)]
    for constant, dtype in (("GROUPED_PAGES", bf16), ("SEESAW_FP8_GROUPED_PAGES", fp8)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gd, constant, ())
            assert not any(gd.grouped_layout(kv) for (d, _), kv in caches.items() if d == dtype)
    # the fp8 loader partition (gd.fp8_loader): e4m3fn caches on every page the seesaw takes (pages of 64k as 64),
    # never bf16; with pages of 16 and 32 only, not 64k; emptied, none
    assert [k for k, kv in caches.items() if gd.fp8_loader(kv)] == [(fp8, p) for p in (16, 32, 64, 128)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gd, "SEESAW_FP8_LOADER_PAGES", (16, 32))
        assert [k for k, kv in caches.items() if gd.fp8_loader(kv)] == [(fp8, 16), (fp8, 32)]
        mp.setattr(gd, "SEESAW_FP8_LOADER_PAGES", ())
        assert not any(gd.fp8_loader(kv) for kv in caches.values())
    # the config's operand dtype must be the cache's: bf16 for bf16, fp16 for e4m3fn
    assert "mma='fp16', got mma='bf16'" in gd.unsupported(fp8kv, 64, 1, 64, "bf16")
    assert "mma='bf16', got mma='fp16'" in gd.unsupported(ok, 64, 1, 64, "fp16")
    assert "sm_90" in gd.unsupported(fp8kv, 64, 1, 64, "fp16")  # an e4m3fn cache is taken (on sm_90)
    with pytest.raises(ValueError, match="sm_90"):
        td.decode(ok, config=td.KernelConfig(kernel="gluon", head_group=64, head_split=1))
    with pytest.raises(ValueError, match="kernel must be"):
        td.KernelConfig(kernel="cuda")
    with pytest.raises(ValueError, match="mma must be 'bf16' or 'fp16'"):
        td.KernelConfig(kernel="gluon", mma="fp32")
    with pytest.raises(ValueError, match="block_n=64"):
        td.KernelConfig(kernel="gluon", block_n=32)


def test_gluon_fp8_kernel_is_chosen_only_where_it_runs():
    """default_config takes the Gluon fp8 kernel (16 packed rows per program: head_group 16 / 8 / 4 at q_len 1 / 2 /
    3-4) for fp8 caches when at most two programs per worker cover the heads, or programs x the batch's cache tokens
    <= GLUON_FP8_MAX_PROGRAM_TOKENS (_FP8_Q with e4m3fn q; both GLUON_FP8_PAGE_16_LESS_TOKENS lower on pages of 16),
    and only with fp8_gluon=True, which batch_config sets from gluon_fp8.supported (never on this CPU)."""
    td = pytest.importorskip("mla_fast.triton_decode")
    g8 = pytest.importorskip("mla_fast.gluon_fp8")
    limit, limit_fp8_q = td.GLUON_FP8_MAX_PROGRAM_TOKENS, td.GLUON_FP8_MAX_PROGRAM_TOKENS_FP8_Q
    less = td.GLUON_FP8_PAGE_16_LESS_TOKENS
    assert (limit, limit_fp8_q, less) == (24 * 4096, 32 * 4096, 8 * 4096)  # the rule's thresholds (default_config)
    for page_size in (None, 16, 32, 64, 128):  # both thresholds lower on pages of 16 only
        page_less = less if page_size == 16 else 0
        assert td.gluon_fp8_max_program_tokens("fp8", page_size) == limit_fp8_q - page_less
        assert td.gluon_fp8_max_program_tokens("fp8kv", page_size) == limit - page_less
        for combo, max_tokens in (("fp8", limit_fp8_q - page_less), ("fp8kv", limit - page_less)):  # 8 programs
            at = td.default_config(combo, 128, 1, 4, fp8_gluon=True, kv_tokens=max_tokens // 8, page_size=page_size)
            past = td.default_config(combo, 128, 1, 4, fp8_gluon=True, kv_tokens=max_tokens // 8 + 1,
                                     page_size=page_size)
            assert at.kernel == "gluon_fp8" and past.kernel != "gluon_fp8", (combo, page_size)
    s = 4096
    for (combo, heads, q_len, kv_tokens), head_group in [  # kv_tokens None: the rule needs none (<= 2 programs)
            (("fp8kv", 16, 1, None), 16), (("fp8", 16, 1, 1), 16), (("fp8kv", 32, 1, 10**9), 16),
            (("fp8", 32, 1, None), 16), (("fp8kv", 48, 1, 8 * s), 16), (("fp8kv", 64, 1, 6 * s), 16),
            (("fp8", 128, 1, 4 * s), 16), (("fp8kv", 128, 1, limit // 8), 16), (("fp8kv", 128, 1, 1), 16),
            (("fp8kv", 16, 2, None), 8), (("fp8", 16, 2, 10**9), 8), (("fp8kv", 8, 2, None), 8),  # MTP
            (("fp8kv", 16, 3, 6 * s), 4), (("fp8", 16, 4, limit_fp8_q // 4), 4), (("fp8kv", 8, 4, None), 4),
            (("fp8kv", 32, 2, 6 * s), 8)]:
        config = td.default_config(combo, heads, q_len, 1, fp8_gluon=True, kv_tokens=kv_tokens)
        assert (config.kernel, config.head_group, config.head_split, config.mma) == (
            "gluon_fp8", head_group, heads // head_group, "fp16"), (combo, heads, q_len, kv_tokens)
        assert q_len * config.head_group <= g8.ROWS
        g8.check_stages(config.num_stages, config.workers_per_sm)  # its shared memory fits
    for heads, q_len, b in itertools.product((16, 32, 48, 64, 96, 128), (1, 2, 3, 4), (1, 2, 4, 8, 16, 32)):
        # at s_k = 4096: batch x programs <= 24
        programs = heads // {1: 16, 2: 8}.get(q_len, 4)
        config = td.default_config("fp8kv", heads, q_len, b, fp8_gluon=True, kv_tokens=b * 4096)
        assert (config.kernel == "gluon_fp8") == (programs <= 2 or b * programs <= 24), (heads, q_len, b)
    for combo, heads, q_len, kv_tokens, fp8_gluon in [
            ("fp8kv", 16, 1, 1, False), ("fp8kv", 16, 2, 1, False),  # not offered
            ("fp8kv", 128, 1, limit // 8 + 1, True), ("fp8kv", 128, 1, None, True),  # past the rule / no tokens
            ("fp8kv", 64, 1, 7 * s, True), ("fp8kv", 64, 1, None, True), ("fp8", 16, 4, limit_fp8_q // 4 + 1, True),
            ("fp8kv", 16, 3, None, True), ("fp8kv", 48, 1, limit // 3 + 1, True),
            ("fp8kv", 8, 1, 1, True), ("fp8kv", 40, 1, 1, True), ("fp8kv", 16, 5, 1, True),  # no head group
            ("fp8kv", 6, 2, 1, True), ("bf16", 16, 1, 1, True)]:
        config = td.default_config(combo, heads, q_len, 1, fp8_gluon=fp8_gluon, kv_tokens=kv_tokens)
        assert config.kernel == "triton", (combo, heads, q_len, kv_tokens, fp8_gluon)
    batch = TritonCase((70,), (1,), heads=16, page_size=64, L=512, R=64, combo="fp8kv").batch()
    assert not g8.supported(batch)
    assert td.batch_config(batch, 1).kernel == "triton"


def test_batch_config_passes_the_page_size_to_the_rule(monkeypatch):
    """batch_config gives default_config the batch's page size: with both Gluon kernels offered (their `supported`
    patched, as on an H200), 16 programs per worker x 6144 tokens = 24 x 4096 take the Gluon fp8 kernel on pages of
    64 and the seesaw on pages of 16, whose threshold is GLUON_FP8_PAGE_16_LESS_TOKENS lower."""
    td = pytest.importorskip("mla_fast.triton_decode")
    g8 = pytest.importorskip("mla_fast.gluon_fp8")
    gd = pytest.importorskip("mla_fast.gluon_decode")
    monkeypatch.setattr(g8, "supported", lambda batch: True)
    monkeypatch.setattr(gd, "supported", lambda batch: True)
    kernels = {}
    for page_size in (16, 64):
        batch = TritonCase((6144,), (2,), heads=128, page_size=page_size, L=512, R=64, combo="fp8kv").batch()
        kernels[page_size] = td.batch_config(batch, 2).kernel
    assert 16 * 6144 == td.GLUON_FP8_MAX_PROGRAM_TOKENS  # head_group 8 at q_len 2: 16 programs
    assert kernels == {16: "gluon", 64: "gluon_fp8"}


def test_gluon_fp8_kernel_rejects_what_it_cannot_take():
    td = pytest.importorskip("mla_fast.triton_decode")
    g8 = pytest.importorskip("mla_fast.gluon_fp8")

    def case(**kw):
        return TritonCase((70,), (1,), **dict(dict(heads=16, page_size=64, L=512, R=64, combo="fp8kv"), **kw)).batch()

    ok = case()  # all it takes, but on a CPU
    kv_wide = torch.zeros(*ok.kv_cache.shape[:2], 2 * 576, dtype=ok.kv_cache.dtype)[..., :576]  # row stride 1152
    reasons = {  # expected words -> (batch, head_group, head_split, rows per program)
        "sm_90": (ok, 16, 1, 16),
        "q_len x head_group <= 16 rows": (ok, 16, 1, 32),
        "head_group in (16, 8, 4)": (ok, 2, 8, 2),
        "num_heads = head_group x head_split": (ok, 16, 2, 16),
        "page_size % 64 == 0 or page_size in (16, 32)": (case(page_size=8), 16, 1, 16),
        "kv_lora_rank 512": (case(L=64, R=32), 16, 1, 16),
        "e4m3fn cache": (case(combo="bf16"), 16, 1, 16),
        "contiguous kv_cache": (ok.replace(kv_cache=kv_wide.copy_(ok.kv_cache)), 16, 1, 16),
    }
    for words, (batch, head_group, head_split, rows) in reasons.items():
        assert words in (g8.unsupported(batch, head_group, head_split, rows) or ""), words
    for page_size in (16, 32, 128):  # pages it copies one TMA box each (g8.SMALL_PAGES), or whole tiles of
        assert "sm_90" in g8.unsupported(case(page_size=page_size), 16, 1, 16)  # only the CPU stops it
    config = td.KernelConfig(kernel="gluon_fp8", mma="fp16", head_group=16, num_stages=2, workers_per_sm=2)
    with pytest.raises(ValueError, match="sm_90"):
        td.decode(ok, config=config)
    with pytest.raises(ValueError, match=r"plan.block_n % 64 == 0 \(items start on its 64-token tiles\), got 32"):
        td.decode(ok, config=replace(config, plan_block_n=32))
    for stages, workers in [(1, 1), (3, 2), (6, 1)]:  # no tile in flight; more than 227 KB of shared memory
        with pytest.raises(ValueError, match="num_stages"):
            td.decode(ok, config=replace(config, num_stages=stages, workers_per_sm=workers))
    with pytest.raises(ValueError, match="mma='fp16'"):
        td.KernelConfig(kernel="gluon_fp8", mma="bf16")


def test_bench_candidates_are_launchable_configs_over_each_default():
    """Every `mla-bench --candidates` override, applied to the default an H200 takes (Gluon kernels on) and the one
    elsewhere, at one request and at 32, gives a KernelConfig the launcher accepts (head geometry, shared memory of
    the Gluon fp8 kernel); the Triton staged candidate at 16 heads is exactly the default off sm_90, and the fp8
    64-row candidate with interleave off is the b >= 32 default there."""
    td = pytest.importorskip("mla_fast.triton_decode")
    g8 = pytest.importorskip("mla_fast.gluon_fp8")
    bench = pytest.importorskip("mla_fast.bench")
    for (combo, heads), overrides in bench.CANDIDATES.items():
        for gluon in (True, False):
            for batch_size in (1, 32):
                base = td.default_config(combo, heads, 1, batch_size, seesaw=gluon, fp8_gluon=gluon,
                                         kv_tokens=batch_size * 8192)
                for o in overrides:
                    config = replace(base, **o)  # KernelConfig validates its fields
                    assert heads % (config.head_group * config.head_split) == 0, (combo, heads, o)
                    if config.kernel == "gluon_fp8":
                        g8.check_stages(config.num_stages, config.workers_per_sm)
    for combo in ("fp8kv", "fp8"):
        h200 = td.default_config(combo, 16, 1, 32, fp8_gluon=True)
        assert replace(h200, **bench.TRITON_FP8_16_ROWS) == td.default_config(combo, 16, 1, 32)
        for heads in (64, 128):
            small = td.default_config(combo, heads, 1, 1, fp8_gluon=True, kv_tokens=8192)  # the Gluon fp8 kernel
            assert small.kernel == "gluon_fp8"
            assert replace(small, **bench.triton_fp8_64_rows(heads)) == td.default_config(combo, heads, 1, 32)


def test_gluon_fp8_grouped_layout_is_taken_on_every_page_it_supports():
    """gluon_fp8.grouped_layout: one 4-D TMA copy per page of c_kv (per tile on pages of 64k, counted as 64) on
    every page the kernel takes (FP8_GROUPED_PAGES: 16, 32, 64k; pages of 8 are not gluon_fp8.SMALL_PAGES);
    emptied (config_ab's A/B), the quarter boxes everywhere."""
    g8 = pytest.importorskip("mla_fast.gluon_fp8")
    caches = {p: torch.empty(2, p, 576, dtype=torch.float8_e4m3fn) for p in (8, 16, 32, 64, 128, 192)}
    assert [p for p, kv in caches.items() if g8.grouped_layout(kv)] == [16, 32, 64, 128, 192]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(g8, "FP8_GROUPED_PAGES", ())
        assert not any(g8.grouped_layout(kv) for kv in caches.values())


def test_gluon_fp8_channel_permutations_agree_with_their_layouts():
    """The Gluon fp8 kernel's channel permutations (mla_fast.gluon_fp8: K_BLOCK / K_BLOCK_ORDER for the score operand
    and q, V_SPLIT / V_ORDER for the P.V accumulator rows), replayed with torch on channel indices: the score operand
    and q agree column by column and keep each k16 step on the same 16 channels; accumulator row m holds the
    documented channel and the store's reordering undoes it; the register layouts that load and store them have
    the matching channel bits (so the kernel's layout conversions move no data)."""
    g8 = pytest.importorskip("mla_fast.gluon_fp8")

    def replay(idx, shape, order):  # the kernel's reshape-then-permute on a tensor of channel indices
        return idx.reshape(shape).permute(order).reshape(-1)

    k_cols = replay(torch.arange(64), g8._k_split(1, 4), g8._k_order())  # column -> channel, one 64-channel chunk
    q_cols = replay(torch.arange(512), g8._k_split(1, 32), g8._k_order())  # the same for q_nope
    assert torch.equal(q_cols, torch.cat([k_cols + 64 * c for c in range(8)]))
    col = torch.arange(64)  # documented: column 16 b + 8 h + 2 t + j holds channel 16 b + 4 t + 2 h + j
    assert torch.equal(k_cols, (col & ~15) + 4 * ((col >> 1) & 3) + 2 * ((col >> 3) & 1) + (col & 1))
    assert torch.equal(k_cols.reshape(4, 16).sort(1).values, torch.arange(64).reshape(4, 16))  # k16 steps

    v_rows = replay(torch.arange(128), g8._v_split(1), g8._v_order())  # accumulator row -> channel, one quarter
    m = torch.arange(128)  # documented: row 64 a1 + 16 w + 8 a0 + g holds channel 32 w + 4 g + 2 a1 + a0
    a1, w, a0, g = m >> 6, (m >> 4) & 3, (m >> 3) & 1, m & 7
    assert torch.equal(v_rows, 32 * w + 4 * g + 2 * a1 + a0)
    assert torch.equal(replay(v_rows, g8._acc_split(1), g8._acc_order()), torch.arange(128))  # store order

    def channel_bits(layout, dim):  # the channel offset each register / lane / warp bit of a layout selects
        layout = layout.value
        return [[b[dim] for b in bases] for bases in (layout.reg_bases, layout.lane_bases, layout.warp_bases)]

    # K chunk [tokens, channels]: registers j, h first (4 adjacent channels), lanes t (4 t), the rest tokens
    assert channel_bits(g8._K_LOAD, 1) == [[1, 2, 0, 16, 32], [4, 8, 0, 0, 0], [0, 0]]
    # V quarter [tokens, channels] and output quarter [rows, channels]: a0, a1 in registers first, g in lanes
    # 2-4, w in the warps, as V_SPLIT = (w, g, a1, a0)
    assert channel_bits(g8._V_LOAD, 1) == [[1, 2, 0, 0, 0, 0], [0, 0, 4, 8, 16], [32, 64]]
    assert channel_bits(g8._O_STORE, 1) == [[1, 2, 0, 0], [0, 0, 4, 8, 16], [32, 64]]


INVARIANT_CASES = {  # decode_invariant under the interpreter: MTP up to 2, empty and split requests
    "bf16": TritonCase((130, 0, 70, 5), (1, 2, 1, 2), page_size=16, seed=50),
    "fp8kv": TritonCase((130, 0, 70, 5), (1, 2, 1, 2), page_size=3, combo="fp8kv", seed=51),
    "bf16_single_rows": TritonCase((130, 0, 70), (1, 1, 1), page_size=16, seed=52),  # regrouped beside 2 rows too
}
INVARIANT_SPLIT = 64  # tokens per fixed piece (a multiple of the planner's 64-token block): 130 tokens, 3 pieces


def _invariant_worker() -> dict:
    """Runs in a subprocess with TRITON_INTERPRET=1: for each INVARIANT_CASES batch, decode_invariant's rows against
    the oracle (err / bound), against its rows in the regrouped batch (verify.regrouped) and decoded alone (bits),
    and invariant_step's run (bits); the default decode (on the interpreter's 16-token blocks, as in _worker) in the
    regrouped batch (bits, expected to move)."""
    from triton_cases import check

    from mla_fast import triton_decode as td
    from verify.regrouped import regrouped_batches

    report = {}
    for name, case in INVARIANT_CASES.items():
        batch = case.batch()
        run = dict(max_q_len=2, split_tokens=INVARIANT_SPLIT, num_workers=case.num_workers)
        out, lse = td.decode_invariant(batch, **run)
        config = td.invariant_config(batch, 2)
        plan = td.make_plan(batch, config, case.num_workers, split_tokens=INVARIANT_SPLIT)
        r = check(out, lse, batch, td.kernel_numerics(config, case.combo), plan.max_pieces)
        regroupings = regrouped_batches(batch)  # grown, shrunk, mtp
        r["regrouped"] = [same_bits(tuple(map(g.case_rows, td.decode_invariant(g.batch, **run))),
                                    (out[g.rows], lse[g.rows])) for g in regroupings]
        regrouped = regroupings[0]
        starts = [0, *itertools.accumulate(case.q_lens)]
        r["alone"] = [same_bits(td.decode_invariant(batch.replace(
            q=batch.q[starts[b]:starts[b + 1]], block_table=batch.block_table[b:b + 1],
            seq_lens=batch.seq_lens[b:b + 1], q_lens=batch.q_lens[b:b + 1]), **run),
            (out[starts[b]:starts[b + 1]], lse[starts[b]:starts[b + 1]])) for b in range(len(case.q_lens))]
        step = td.invariant_step(batch, 2, split_tokens=INVARIANT_SPLIT, num_workers=case.num_workers)
        step.plan()
        r["step"] = same_bits(step.run(), (out, lse))
        fine = replace(td.batch_config(batch, 2), **INTERPRETER_TILES)
        default, moved = (td.decode(b, config=fine, num_workers=case.num_workers) for b in (batch, regrouped.batch))
        r["default_regrouped"] = same_bits(tuple(map(regrouped.case_rows, moved)),
                                           (default[0][regrouped.rows], default[1][regrouped.rows]))
        r["max_pieces"] = plan.max_pieces
        report[name] = r
    return report


@pytest.fixture(scope="module")
def invariant_report():
    return _interpreted("--invariant-worker")


@pytest.mark.parametrize("name", sorted(INVARIANT_CASES))
def test_decode_invariant_keeps_each_requests_bits_in_any_batch(invariant_report, name):
    """decode_invariant (fixed 64-token pieces, the geometry of invariant_config at q_len 2): its rows within the
    kernel bound (err / bound <= 1, the merge of its pieces charged), the same bits in the regrouped batch, alone,
    and from invariant_step; the default decode's rows do move when regrouped (the property is not vacuous)."""
    r = invariant_report[name]
    assert r["out_ratio"] <= 1 and r["lse_ratio"] <= 1 and r["finite"] and r["empty_ok"], r
    assert r["max_pieces"] == 3  # the 130-token request is split, so the reduce runs
    assert r["regrouped"] == [True] * 3, r  # grown, shrunk, mtp (the 2-row requests dropped, or one added)
    assert all(r["alone"]) and r["step"], r
    assert not r["default_regrouped"], r


def test_invariant_config_ignores_the_batch_size_and_lengths():
    """invariant_config depends on the dtypes, heads, page size and max_q_len only: one request of 9000 tokens and
    64 short ones get the same config (the default's batch_config does not), and a bad max_q_len is refused."""
    td = pytest.importorskip("mla_fast.triton_decode")
    one = TritonCase((9000,), (1,), heads=64, L=512, R=64).batch()
    many = TritonCase((5,) * 64, (1,) * 64, heads=64, L=512, R=64).batch()
    assert td.invariant_config(one) == td.invariant_config(many)
    assert td.batch_config(one, 1) != td.batch_config(many, 1)
    assert not td.invariant_config(one).pair_merge
    with pytest.raises(ValueError, match="max_q_len"):
        td.invariant_config(one, 0)
    with pytest.raises(ValueError, match="max_q_len must be >= the batch's largest q_len 2"):
        td.decode_invariant(TritonCase((5,), (2,)).batch(), max_q_len=1)


def test_invariant_config_takes_q_as_contiguous(monkeypatch):
    """A q that is a view of a wider buffer is contiguous at one row and not at two (found by a review): with a
    Gluon kernel that needs contiguous q, a request alone would take it and the same request in a batch would not.
    invariant_config takes q as contiguous (decode_invariant copies a strided one), invariant_step refuses one."""
    td = pytest.importorskip("mla_fast.triton_decode")
    from mla_fast import gluon_decode

    monkeypatch.setattr(gluon_decode, "supported", lambda batch: batch.q.is_contiguous())  # as on an H200
    batch = TritonCase((100, 70), (1, 1), heads=16, L=512, R=64).batch()
    wide = torch.zeros(2, 32, 576, dtype=batch.q.dtype)
    wide[:, :16] = batch.q
    strided = batch.replace(q=wide[:, :16])  # [2, 16, 576] of a 32-head buffer
    alone = batch.replace(q=wide[:1, :16], block_table=batch.block_table[:1], seq_lens=batch.seq_lens[:1],
                          q_lens=batch.q_lens[:1])
    assert alone.q.is_contiguous() and not strided.q.is_contiguous()
    assert td.invariant_config(alone, 4) == td.invariant_config(strided, 4) == td.invariant_config(batch, 4)
    assert td.invariant_config(batch, 4).kernel == "gluon"  # 64 rows: the seesaw this stand-in offers
    with pytest.raises(ValueError, match="invariant_step: q must be contiguous"):
        td.invariant_step(strided)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
if __name__ == "__main__" and sys.argv[1:] == ["--invariant-worker"]:
    print(json.dumps(_invariant_worker()))


def test_reduce_varlen_bench_cases_take_the_documented_steps():
    """benchmarks/reduce_varlen.py's cases, planned as on an H200 (132 SMs; the Gluon kernels where batch_config
    takes them there), get the pieces per reduce step that docs/kernels.md's varlen table lists (after / before: the
    plan's max_pieces), and its variants hand launch those steps."""
    td = pytest.importorskip("mla_fast.triton_decode")
    reduce_varlen = benchmark_module("reduce_varlen")
    from mla_fast.planner import plan_decode

    after, before = [], []
    for case in reduce_varlen.CASES:
        lens = case.lengths()
        config = td.default_config(case.combo, case.heads, 1, case.batch, seesaw=True, fp8_gluon=case.combo != "bf16",
                                   kv_tokens=int(lens.sum()))
        plan = plan_decode(lens, torch.ones_like(lens), case.heads, config.workers_per_sm * 132 // config.head_split,
                           block_n=config.plan_block_n, fixed_overhead=config.fixed_overhead,
                           head_group=config.head_group * config.head_split)
        pieces = td.plan_reduce_pieces(plan, td.reduce_rows(config, config.head_group), 512, 132)
        after.append(td.reduce_blocks(pieces, 512)[0])
        before.append(td.reduce_blocks(plan.max_pieces, 512)[0])
        assert reduce_varlen.variant_plan(plan, "default") == (plan, None)
        assert reduce_varlen.variant_plan(plan, "max_pieces") == (plan, plan.max_pieces)
        full, p = reduce_varlen.variant_plan(plan, "all_tiles")
        assert full.split_final is plan.reduce_final and p == plan.max_pieces
    assert after == [8, 8, 32, 4, 32, 4, 8, 4] and before == [64, 64, 32, 16, 64, 8, 8, 4]
