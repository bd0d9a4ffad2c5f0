"""aiter adapter: argument marshalling against fakes of aiter v0.1.7 and HEAD (tests/fake_aiter.py), fp8 conversion.

The fakes bind arguments with the real parameter lists (v0.1.7 metadata: stub names, binding order), check shapes,
dtypes and scalars, and replay work_info_set in fp64. An argument sent positionally where the order changed lands
in the wrong parameter and trips a check or the numbers.

Tolerances: the fake computes in fp64 and rounds `o` to bf16 once, so out may differ from the fp64 oracle by one
bf16 rounding, 2^-8 |ref| (u of bf16); lse goes through fp32 once, 2^-24 |ref| (u of fp32).
"""

import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from fake_aiter import make_fake_aiter

from mla_fast import aiter_backend as ab
from mla_ref import fp8
from mla_ref.decode import make_decode_batch, mla_decode_ref
from verify.strided_inputs import strided_batch

BF16_U = 2**-8  # unit roundoff of bf16
FP32_U = 2**-24  # unit roundoff of fp32


def _batch(seed, seq_lens, heads=16, page_size=16, q_len=1, dtype="bf16"):
    g = torch.Generator().manual_seed(seed)
    T = len(seq_lens) * q_len
    q = torch.randn(T, heads, 576, generator=g)  # [T, H, 576]
    kvs = [torch.randn(s, 576, generator=g) for s in seq_lens]  # [s_b, 576] each
    scales = {}
    if dtype == "fp8":
        q, qs = fp8.quantize(q, "e4m3fn")
        kv_all, ks = fp8.quantize(torch.cat(kvs), "e4m3fn")
        kvs = list(torch.split(kv_all, seq_lens))
        scales = {"q_scale": float(qs), "kv_scale": float(ks)}
    else:
        q, kvs = q.bfloat16(), [kv.bfloat16() for kv in kvs]
    return make_decode_batch(
        q, kvs, sm_scale=0.1352338, kv_lora_rank=512, page_size=page_size, generator=g,
        q_lens=[q_len] * len(seq_lens), **scales,
    )  # fmt: skip


def _check_against_ref(batch, out, lse):
    ref_out, ref_lse = mla_decode_ref(batch)
    assert out.shape == ref_out.shape and out.dtype == torch.bfloat16
    err = (out.double() - ref_out).abs()
    assert bool((err <= BF16_U * ref_out.abs()).all()), f"max out err {err.max():.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows that see no token must give lse = -inf"
    lerr = (lse.double() - ref_lse)[~empty].abs()
    assert bool((lerr <= FP32_U * ref_lse[~empty].abs()).all()), f"max lse err {lerr.max():.3e}"


# ---- fp8 format conversion ------------------------------------------------------------------------------------
def test_fn_to_fnuz_is_exact_for_every_byte():
    fn_bytes = torch.arange(256, dtype=torch.uint8)
    fnuz, scale = ab.e4m3fn_to_fnuz(fn_bytes.view(torch.float8_e4m3fn), 0.75)
    fn_vals = fn_bytes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 0.75
    fnuz_vals = fnuz.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fnuz).astype(np.float64) * scale
    assert scale == 1.5
    np.testing.assert_array_equal(fnuz_vals, fn_vals)  # equal values; NaN exactly where fn had NaN


def test_fnuz_to_fn_round_trip_and_refusal():
    fn = torch.arange(256, dtype=torch.uint8)
    fnuz, s = ab.e4m3fn_to_fnuz(fn.view(torch.float8_e4m3fn), 1.0)
    back, s2 = ab.e4m3fnuz_to_fn(fnuz, s)
    a = fn.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    b = back.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * s2
    np.testing.assert_array_equal(a, b)  # -0 comes back as +0: equal as values
    from mla_fast.backends import Unsupported

    with pytest.raises(Unsupported, match="240"):  # a converting backend declines such data (its kernel takes fn)
        ab.e4m3fnuz_to_fn(torch.tensor([0x7F], dtype=torch.uint8).view(torch.float8_e4m3fnuz), 1.0)


def test_fp8_dtype_follows_arch():
    assert ab.fp8_dtype_for_arch("gfx942:sramecc+:xnack-") == torch.float8_e4m3fnuz
    assert ab.fp8_dtype_for_arch("gfx950") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="gfx942 or gfx950"):
        ab.fp8_dtype_for_arch("gfx90a")


# ---- API detection --------------------------------------------------------------------------------------------
def test_detect_api_reads_signatures(fake):
    api = ab.detect_api(fake, fake.mla)
    head = "page_size" in api.decode_params
    assert api.metadata_last_page_lens == head
    assert ("dtype_q_nope" in api.metadata_options) == head
    assert api.reduce_max_seqlen_q == head and api.reduce_num_kv_splits == head
    assert set(api.source.values()) == {"signature"}


@pytest.mark.parametrize("version", [(0, 1, 7), (0, 1, 12), (0, 1, 13), (0, 1, 14)])
def test_detect_api_falls_back_to_version_for_opaque_ops(version):
    """Signatures hidden: the version decides. page_size / kv_last_page_lens from v0.1.11, mla_reduce_v1's
    num_kv_splits after v0.1.13 (aiter's tags read in its source; a review's: every tagged version newer than the
    code's list was taken for one without it)."""
    fake = make_fake_aiter("0.1.7" if version < (0, 1, 11) else "head", opaque_metadata=True)
    fake.mla_reduce_v1 = lambda *args, **kwargs: None  # a compiled op's wrapper: its parameters hidden too
    api = ab.detect_api(fake, fake.mla, version=version)
    assert api.source["get_mla_metadata_v1"].startswith("version") and api.source["mla_reduce_v1"].startswith("version")
    assert api.metadata_last_page_lens == (version >= (0, 1, 11))
    assert ("dtype_q" in api.metadata_options) == (version >= (0, 1, 8))
    assert api.reduce_num_kv_splits == (version >= (0, 1, 14))


# ---- the decode call ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("metadata", ["aiter", "ours"])
def test_decode_marshalling_matches_ref(fake, dtype, metadata):
    batch = _batch(1, [0, 3, 70, 129], dtype=dtype)
    out, lse = ab.aiter_decode(batch, metadata=metadata, gfx="gfx942", num_workers=4)
    _check_against_ref(batch, out, lse)
    name, args = fake.calls[-1]
    assert name == "mla_decode_fwd"
    if dtype == "fp8":  # gfx942: fn bytes re-read as fnuz with doubled scales
        assert args["q"].dtype == torch.float8_e4m3fnuz
        assert args["kv_scale"].item() == pytest.approx(2 * batch.kv_scale, rel=FP32_U)
    if metadata == "aiter":
        meta = [a for n, a in fake.calls if n == "get_mla_metadata_v1"][-1]
        assert torch.equal(meta["seqlens_kv_indptr"], args["kv_indptr"])
        if "dtype_q_nope" in meta:  # HEAD: the dtypes reach the metadata (vllm-project/vllm #46997)
            assert meta["dtype_q_nope"] == args["q"].dtype and meta["dtype_kv_rope"] == args["kv_buffer"].dtype


def test_opaque_v017_metadata_uses_binding_order():
    fake = make_fake_aiter("0.1.7", opaque_metadata=True)
    api = ab.detect_api(fake, fake.mla, version=(0, 1, 7))
    batch = _batch(2, [40, 17])
    sys.modules["aiter"], sys.modules["aiter.mla"] = fake, fake.mla
    try:
        out, lse = ab.aiter_decode(batch, gfx="gfx942", api=api)
    finally:
        del sys.modules["aiter"], sys.modules["aiter.mla"]
    _check_against_ref(batch, out, lse)


@pytest.mark.parametrize("heads", [4, 32])
def test_heads_padded_or_passed(fake, heads):
    batch = _batch(3, [5, 33], heads=heads)
    out, lse = ab.aiter_decode(batch, gfx="gfx950")
    _check_against_ref(batch, out, lse)
    assert fake.calls[-1][1]["q"].shape[1] == max(heads, 16)


def test_mtp_and_native_pages(fake):
    """An empty request among them: aiter reads its length as (0 - 1) x page_size + last (a review's: last = 0 read
    as -page_size; the fake replays as aiter's kernels read it)."""
    batch = _batch(4, [1, 0, 9, 40], q_len=2, page_size=4)
    native = "page_size" in ab.detect_api(fake, fake.mla).decode_params
    out, lse = ab.aiter_decode(batch, gfx="gfx942", native_pages=native)
    _check_against_ref(batch, out, lse)
    assert fake.calls[-1][1]["kv_buffer"].shape[1] == (4 if native else 1)


def test_the_backend_names_what_aiter_cannot_run_as_unsupported(fake):
    """What aiter_inputs refuses, the registry's aiter backend raises as Unsupported with a reason that names no case
    value (a campaign on ROCm counted drawn cases of mixed q_lens as failed); a batch in scope runs."""
    from mla_fast.backends import BACKENDS, Unsupported

    mixed = _batch(5, [3, 4], q_len=1)
    mixed = mixed.replace(q=torch.cat([mixed.q, mixed.q[:1]]), q_lens=torch.tensor([2, 1], dtype=torch.int32))
    for batch, reason in ((mixed, "one query length"), (_batch(5, [3, 4], q_len=3), r"a query length in \(1, 2, 4\)"),
                          (_batch(5, [3], heads=144), "at most 128"), (_batch(5, [3], heads=12), "divisor of 16")):
        with pytest.raises(Unsupported, match=reason) as refused:
            BACKENDS["aiter"].run(batch)
        assert ", got" not in str(refused.value), refused.value  # no case value in the reason
        with pytest.raises(ValueError):
            ab.aiter_inputs(batch)
    assert ab.aiter_refusal(_batch(5, [3, 70], q_len=2)) is None


def test_inputs_refused_with_reasons():
    with pytest.raises(ValueError, match="multiple or a divisor of 16"):
        ab.aiter_inputs(_batch(5, [3], heads=12))
    with pytest.raises(ValueError, match="at most 128"):  # a review's: folded past aiter's range (#1450)
        ab.aiter_inputs(_batch(5, [3], heads=144))
    with pytest.raises(ValueError, match=r"a query length in \(1, 2, 4\)"):  # #2720: q_len 3 gave identical rows
        ab.aiter_inputs(_batch(5, [3, 4], q_len=3))
    with pytest.raises(ValueError, match="one query length"):
        b = _batch(5, [3, 4], q_len=1)
        ab.aiter_inputs(b.replace(q=torch.cat([b.q, b.q[:1]]), q_lens=torch.tensor([2, 1], dtype=torch.int32)))
    fp8_batch = _batch(5, [3], dtype="fp8")
    bf16_kv = fp8_batch.kv_cache.float().bfloat16()
    with pytest.raises(ValueError, match="fp8 q needs an fp8 KV"):
        ab.aiter_inputs(fp8_batch.replace(kv_cache=bf16_kv, kv_scale=None))
    strided = strided_batch(_batch(5, [3])).batch  # a padded cache: reshape to one token per page would copy it all
    with pytest.raises(ValueError, match=r"aiter\.kv_cache: expected a contiguous cache .* got strides"):
        ab.aiter_inputs(strided)
    ab.aiter_inputs(strided.replace(kv_cache=strided.kv_cache.contiguous()))  # strided q and block table: taken


# ---- the fakes can fail (a wrong call is caught) --------------------------------------------------------------
def test_fake_v017_catches_stub_keyword_order():
    fake = make_fake_aiter("0.1.7")
    batch = _batch(6, [20])
    inputs = ab.aiter_inputs(batch)
    specs = fake.get_mla_metadata_info_v1(1, 1, 16, torch.bfloat16, torch.bfloat16, False)
    bufs = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    with pytest.raises(AssertionError, match="work_info_set"):  # keywords by the stub's names swap the two
        fake.get_mla_metadata_v1(
            inputs.qo_indptr, inputs.kv_indptr, 16, 1, True, bufs[0],
            work_indptr=bufs[1], work_info=bufs[2], reduce_indptr=bufs[3], reduce_final_map=bufs[4],
            reduce_partial_map=bufs[5],
        )  # fmt: skip


def test_fake_head_catches_positional_sm_scale(fake):
    if "page_size" not in ab.detect_api(fake, fake.mla).decode_params:
        pytest.skip("v0.1.7 has sm_scale right after max_seqlen_q")
    batch = _batch(7, [20])
    inputs = ab.aiter_inputs(batch)
    aiter_api = ab.detect_api(fake, fake.mla)
    buffers = ab.aiter_metadata(inputs, aiter_api, fake)
    kw = ab.decode_kwargs(inputs, buffers, aiter_api)
    sm_scale = kw.pop("sm_scale")
    o = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    positional = (inputs.q, inputs.kv_buffer, o, inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices)
    with pytest.raises(AssertionError):  # lands in page_size
        kw.pop("page_size"), kw.pop("nhead_kv")
        fake.mla.mla_decode_fwd(*positional, inputs.kv_last_page_lens, 1, sm_scale, **kw)


# ---- our partition vs aiter's ---------------------------------------------------------------------------------
def test_our_partition_for_aiter_keeps_split_tails_of_four_tokens_or_q_len():
    """Requests one token past a 64-token block, on more workers than blocks: the plain plan leaves that token alone
    in a split's last piece, which aiter's fp8 kernels read as NaN (a review's); our plan for aiter moves the split a
    block earlier, so every last piece holds at least max(4, q_len) tokens."""
    from mla_fast.planner import plan_decode

    def last_pieces(buffers, inputs, lengths):  # tokens of each split request's last piece
        works = buffers["work_info_set"][: int(buffers["work_indptr"][-1])]
        last = works[(works[:, 1] >= 0) & (works[:, 6] == 0)]  # split (partial_qo_loc >= 0), nothing after it
        first_page = inputs.kv_indptr[last[:, 0].long()]  # [n] the request's first kv_indices position
        return [lengths[int(b)] - (int(k) - int(f)) * inputs.page_size for b, k, f in zip(last[:, 0], last[:, 4],
                                                                                          first_page)]

    lengths = [129, 193]
    for q_len in (1, 2):
        batch = _batch(9, lengths, q_len=q_len)
        inputs = ab.aiter_inputs(batch)
        plain = plan_decode(batch.seq_lens, batch.q_lens, 16, 8, block_n=64)
        assert 1 in last_pieces(ab.plan_metadata(batch, inputs, plan=plain), inputs, lengths)
        ours = last_pieces(ab.plan_metadata(batch, inputs, num_workers=8), inputs, lengths)
        assert ours and min(ours) >= max(4, q_len), ours


def test_diff_metadata_reports_pieces_and_errors(fake):
    batch = _batch(8, [0, 50, 300])
    inputs = ab.aiter_inputs(batch)
    api = ab.detect_api(fake, fake.mla)
    theirs = ab.aiter_metadata(inputs, api, fake)
    ours = ab.plan_metadata(batch, inputs, num_workers=4)
    diff = ab.diff_metadata(ours, theirs, inputs.qo_indptr, inputs.kv_indptr)
    assert diff.ours_errors == () and diff.theirs_errors == ()
    assert diff.stats["works"][1] == sum(-(-s // 32) or 1 for s in (0, 50, 300))  # fake: 32-page chunks
    assert "identical=" in diff.summary()
    broken = dict(theirs)
    broken["work_info_set"] = theirs["work_info_set"].clone()
    works = theirs["work_info_set"][: int(theirs["work_indptr"][-1])]  # valid rows only
    last_piece = int((works[:, 0] == 2).nonzero()[-1])  # a piece of the 300-token request
    broken["work_info_set"][last_piece, 5] -= 1  # now stops one page short of the next piece or the end
    errors = ab.diff_metadata(ours, broken, inputs.qo_indptr, inputs.kv_indptr).theirs_errors
    assert any("do not tile" in e for e in errors)


@pytest.mark.rocm
def test_real_aiter_against_ref():
    """On ROCm with amd-aiter: both metadata modes against the fp64 oracle on the same (dequantized) inputs, bf16 and
    fp8, out and lse within the adapter's declared kernel bound plus the merge of at most one piece per CU (aiter's
    planner makes no more splits than CUs: aiter-contract.md), empty rows 0 / -inf. (Until the fortieth session:
    aiter's own cos-diff bars, 3e-2 for fp8, which passed an output 20 % too large.)"""
    from mla_fast import backends
    from verify.bounds import kernel_bound, merge_bound

    numerics = backends.get_backend("aiter").numerics
    pieces = torch.cuda.get_device_properties(0).multi_processor_count  # CUs: the most splits of a request
    for dtype in ("bf16", "fp8"):
        batch = _batch(9, [0, 1, 21, 300, 1200], dtype=dtype)
        ref_out, ref_lse = mla_decode_ref(batch)
        bound = kernel_bound(batch, numerics(batch), ref=(ref_out, ref_lse)) + merge_bound(batch, pieces)
        empty = torch.isneginf(ref_lse)  # [T, H] rows that see no token
        for metadata in ("aiter", "ours"):
            out, lse = ab.aiter_decode(batch.to("cuda"), metadata=metadata)
            out, lse = out.double().cpu(), lse.double().cpu()
            assert bool(((out - ref_out).abs() <= bound.out).all()), (dtype, metadata)
            assert bool(((lse - ref_lse).abs()[~empty] <= bound.lse[~empty]).all()), (dtype, metadata)
            assert bool((out[empty] == 0).all() and torch.isneginf(lse[empty]).all()), (dtype, metadata)


def test_reduce_passes_version_specific_scalars(fake):
    """mla_reduce_v1 gained max_seqlen_q (v0.1.8) and num_kv_splits (HEAD) before final_output."""
    batch = _batch(10, [300])
    inputs = ab.aiter_inputs(batch)
    buffers = ab.aiter_metadata(inputs, ab.detect_api(fake, fake.mla), fake)
    out = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    partial_o, partial_lse = torch.zeros(8, 1, 16, 512), torch.zeros(8, 1, 16, 1)
    lse = ab.aiter_reduce(partial_o, partial_lse, buffers, out, max_seqlen_q=1)
    name, args = fake.calls[-1]
    assert name == "mla_reduce_v1" and args["final_output"] is out and args["final_lse"] is lse
    assert args.get("max_seqlen_q", 1) == 1 and args.get("num_kv_splits", 0) == 0
    assert ("max_seqlen_q" in args) == ("num_kv_splits" in args)  # the two fakes: v0.1.7 has neither, HEAD both
