"""The aiter adapter's decisions that tests/test_aiter_contract.py left free (a sixty-fifth-session mutation review of
mla_fast/aiter_backend.py: 36 edits slipped its tests; each fails one here).

Each test pins one decision the adapter makes without ROCm (version parsing and fallback boundaries, scope, the
metadata call's options, refusals, o/lse handling, our plan's tails and buffer dtypes, coverage and diff reports)
and fails on a plausible one-line edit of it. Tolerances are those of test_aiter_contract (`_check_against_ref`:
one bf16 rounding of out, one fp32 rounding of lse); everything else is compared exactly.
"""

import dataclasses
import importlib.metadata
import inspect
import math
import sys
import types

import pytest
import torch
from fake_aiter import make_fake_aiter
from test_aiter_contract import _batch, _check_against_ref

from mla_fast import aiter_backend as ab
from mla_ref.decode import make_decode_batch


@pytest.fixture
def head_fake(monkeypatch):
    module = make_fake_aiter("head")
    monkeypatch.setitem(sys.modules, "aiter", module)
    monkeypatch.setitem(sys.modules, "aiter.mla", module.mla)
    return module


def _a16w8(seed, seq_lens, q_len=1):
    """bf16 q (the fp8 q dequantized, rounded to bf16 once; the oracle reads the same bf16 q) beside an e4m3fn
    cache: aiter's a16w8 case, the one where q's and KV's dtypes differ."""
    b = _batch(seed, seq_lens, q_len=q_len, dtype="fp8")
    return b.replace(q=(b.q.double() * b.q_scale).bfloat16(), q_scale=None)


def _calls(fake, name):
    return [a for n, a in fake.calls if n == name]


# ---- version and API detection ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("0.1.7", (0, 1, 7)),
    ("0.1.10+rocm6.4.1", (0, 1, 10)),  # a local tag: its digits are no release part
    ("0.1.12.dev5+g1a2b3c4", (0, 1, 12)),  # a dev tag: stops at the first non-numeric part
    ("0.1.9rc1", (0, 1, 9)),  # a pre-release: the release it leads to (its digits had read as (0, 1, 91))
    ("0.1.10rc2+g12ab", (0, 1, 10)),
    ("1.0.0a1", (1, 0, 0)),
    ("unknown", None),
])  # fmt: skip
def test_aiter_version_reads_the_release_parts_only(monkeypatch, text, want):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: text)
    assert ab.aiter_version() == want


def _opaque_aiter():
    """aiter with every op behind a (*args, **kwargs) wrapper: detect_api must go by the version."""

    def opaque(*args, **kwargs):
        return None

    ns = types.SimpleNamespace(mla_decode_fwd=opaque, get_mla_metadata_v1=opaque, get_mla_metadata_info_v1=opaque,
                               mla_reduce_v1=opaque)  # fmt: skip
    return ns


@pytest.mark.parametrize("version", [(0, 1, 7), (0, 1, 8), (0, 1, 9), (0, 1, 10), (0, 1, 11), (0, 1, 13), (0, 1, 14)])
def test_version_fallback_at_each_boundary(version):
    """The module docstring's release boundaries, each on both sides: page_size/nhead_kv and kv_last_page_lens from
    v0.1.11, dtype_q and mla_reduce_v1's max_seqlen_q from v0.1.8, return_lse from v0.1.10, num_kv_splits after
    v0.1.13; q_scale/kv_scale at every release (v0.1.7 has them)."""
    ns = _opaque_aiter()
    api = ab.detect_api(ns, ns, version=version)
    assert set(api.source.values()) == {"version " + ".".join(map(str, version))}
    assert ("page_size" in api.decode_params) == ("nhead_kv" in api.decode_params) == (version >= (0, 1, 11))
    assert ("return_lse" in api.decode_params) == (version >= (0, 1, 10))
    assert {"sm_scale", "work_meta_data", "q_scale", "kv_scale"} <= set(api.decode_params)
    assert api.metadata_last_page_lens == ("page_size" in api.metadata_options) == (version >= (0, 1, 11))
    assert ("dtype_q" in api.metadata_options) == ("dtype_kv" in api.metadata_options) == (version >= (0, 1, 8))
    assert api.reduce_max_seqlen_q == (version >= (0, 1, 8))
    assert api.reduce_num_kv_splits == (version >= (0, 1, 14))
    assert "fast_mode" in api.info_options


def test_unknown_version_assumes_the_newest_api(monkeypatch):
    monkeypatch.setattr(ab, "aiter_version", lambda: None)
    ns = _opaque_aiter()
    api = ab.detect_api(ns, ns)
    assert all(s.startswith("default") for s in api.source.values()), api.source
    assert {"page_size", "nhead_kv", "return_lse", "kv_scale"} <= set(api.decode_params)
    assert api.metadata_last_page_lens and {"page_size", "dtype_q", "dtype_kv"} <= set(api.metadata_options)
    assert api.reduce_max_seqlen_q and api.reduce_num_kv_splits


# ---- scope -----------------------------------------------------------------------------------------------------
def test_scope_takes_q_len_4_and_128_heads(fake):
    """The edges of what aiter runs: q_len 4 (AITER_Q_LENS' largest) and 128 heads (AITER_MAX_HEADS, folded by
    aiter into 16-head groups, passed through unpadded)."""
    assert ab.aiter_refusal(_batch(11, [3, 9], q_len=4)) is None
    wide = _batch(11, [5], heads=128)
    assert ab.aiter_refusal(wide) is None
    assert ab.aiter_inputs(wide).q.shape[1] == 128
    batch = _batch(11, [6, 9], q_len=4)
    out, lse = ab.aiter_decode(batch, gfx="gfx942")
    _check_against_ref(batch, out, lse)


def test_fp16_is_refused_by_name():
    """aiter's MLA kernels take bf16 or e4m3 only: an fp16 batch is out of scope, named by its field."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 16, 576, generator=g).half()  # [T, H, 576]
    kv = [torch.randn(7, 576, generator=g).half()]  # [s, 576]
    batch = make_decode_batch(q, kv, sm_scale=0.1352338, kv_lora_rank=512, page_size=16, generator=g)
    assert ab.aiter_refusal(batch) == "aiter.q: expected bf16 or fp8 e4m3 (aiter's MLA kernels take no other)"
    with pytest.raises(ValueError, match="got torch.float16"):
        ab.aiter_inputs(batch)


def test_a_strided_q_reaches_aiter_contiguous():
    """aiter checks q.is_contiguous(); a strided q of 16 heads (no repeat, which would copy) must be copied."""
    from verify.strided_inputs import strided_batch

    strided = strided_batch(_batch(13, [3, 20])).batch
    strided = strided.replace(kv_cache=strided.kv_cache.contiguous())
    assert not strided.q.is_contiguous()  # else this test could not fail
    inputs = ab.aiter_inputs(strided)
    assert inputs.q.is_contiguous() and torch.equal(inputs.q, strided.q)


@pytest.mark.parametrize("native_pages", [False, True])
def test_index_tensors_reach_aiter_as_int32(native_pages):
    """aiter's kernels read qo_indptr, kv_indptr, kv_indices and kv_last_page_lens as int32, in vLLM's block-size-1
    layout (token slots) and in native pages alike (test_vllm_layout's torch.equal does not tell int32 from int64)."""
    inputs = ab.aiter_inputs(_batch(24, [0, 5, 70], page_size=16), native_pages=native_pages)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens"):
        t = getattr(inputs, name)
        assert t.dtype == torch.int32 and t.is_contiguous(), (name, t.dtype)


# ---- the metadata call -----------------------------------------------------------------------------------------
def test_a16w8_mtp_metadata_gets_query_length_dtypes_and_scales(fake):
    """bf16 q beside an fp8 cache (a16w8), two query rows: the metadata is told max/uniform q_len 2, and (HEAD) q's
    and KV's own dtypes, NoPE and RoPE alike; info and metadata agree on fast_mode; the kv_scale alone reaches the
    kernel (q has none) and the answer matches the oracle."""
    batch = _a16w8(14, [0, 5, 70], q_len=2)
    out, lse = ab.aiter_decode(batch, gfx="gfx942")
    _check_against_ref(batch, out, lse)
    (info,), (meta,), (dec,) = _calls(fake, "get_mla_metadata_info_v1"), _calls(fake, "get_mla_metadata_v1"), \
        _calls(fake, "mla_decode_fwd")  # fmt: skip
    assert dec["q"].dtype == torch.bfloat16 and dec["kv_buffer"].dtype == torch.float8_e4m3fnuz
    assert dec["q_scale"] is None and dec["kv_scale"].item() == 2 * batch.kv_scale  # fn read as fnuz: x2, exact
    assert (info["q_dtype"], info["kv_dtype"], info["is_sparse"]) == (torch.bfloat16, torch.float8_e4m3fnuz, False)
    assert info["fast_mode"] is True and meta["fast_mode"] is True  # buffers sized and filled for one mode
    assert meta["max_seqlen_qo"] == meta["uni_seqlen_qo"] == 2
    if "dtype_q_nope" in meta:  # HEAD
        assert meta["dtype_q_nope"] == meta["dtype_q_rope"] == torch.bfloat16
        assert meta["dtype_kv_nope"] == meta["dtype_kv_rope"] == torch.float8_e4m3fnuz


def test_metadata_without_nope_rope_dtypes_gets_dtype_q_and_dtype_kv(monkeypatch):
    """Between v0.1.8 and HEAD get_mla_metadata_v1 takes `dtype_q, dtype_kv` only (opaque op: the version says so):
    they must be passed, or the C++ side assumes bf16 (vllm-project/vllm #46997)."""
    fake = make_fake_aiter("head", opaque_metadata=True)
    monkeypatch.setitem(sys.modules, "aiter", fake)
    monkeypatch.setitem(sys.modules, "aiter.mla", fake.mla)
    api = ab.detect_api(fake, fake.mla, version=(0, 1, 12))
    assert "dtype_q" in api.metadata_options and "dtype_q_nope" not in api.metadata_options
    batch = _a16w8(15, [3, 40])
    out, lse = ab.aiter_decode(batch, gfx="gfx942", api=api)
    _check_against_ref(batch, out, lse)
    (meta,) = _calls(fake, "get_mla_metadata_v1")
    assert (meta["dtype_q"], meta["dtype_kv"]) == (torch.bfloat16, torch.float8_e4m3fnuz)


def test_native_pages_refused_where_aiter_knows_block_size_1(monkeypatch):
    """v0.1.7 has no page_size: native pages are refused by the metadata call and by the decode call (metadata
    "ours" reaches only the latter), rather than run at a block size the kernel does not know."""
    fake = make_fake_aiter("0.1.7")
    monkeypatch.setitem(sys.modules, "aiter", fake)
    monkeypatch.setitem(sys.modules, "aiter.mla", fake.mla)
    api = ab.detect_api(fake, fake.mla)
    batch = _batch(16, [9, 40], page_size=4)
    inputs = ab.aiter_inputs(batch, native_pages=True)
    with pytest.raises(ValueError, match="metadata knows block size 1 only"):
        ab.aiter_metadata(inputs, api, fake)
    with pytest.raises(ValueError, match="mla_decode_fwd knows block size 1 only"):
        ab.aiter_decode(batch, metadata="ours", native_pages=True, num_workers=4, gfx="gfx942", api=api)


def test_scales_refused_where_mla_decode_fwd_takes_none(head_fake):
    """An fp8 batch on an mla_decode_fwd without q_scale/kv_scale: refused, never run unscaled (vllm #30005)."""
    api = ab.detect_api(head_fake, head_fake.mla)
    unscaled = tuple(p for p in api.decode_params if p not in ("q_scale", "kv_scale"))
    api = dataclasses.replace(api, decode_params=unscaled)
    batch = _batch(17, [20], dtype="fp8")
    inputs = ab.aiter_inputs(batch, fp8_dtype=torch.float8_e4m3fnuz)
    buffers = ab.plan_metadata(batch, inputs, num_workers=4)
    with pytest.raises(ValueError, match="no q_scale/kv_scale"):
        ab.decode_kwargs(inputs, buffers, api)


# ---- o and lse around the call ---------------------------------------------------------------------------------
def _spy_decode(fake, edit=None):
    """Wrap fake.mla.mla_decode_fwd: record o as aiter receives it; edit(result) may change what aiter returns."""
    inner, seen = fake.mla.mla_decode_fwd, []

    def spy(*args, **kwargs):
        seen.append(args[2].clone())  # o before the kernel writes it
        result = inner(*args, **kwargs)
        return edit(result) if edit else result

    spy.__signature__ = inspect.signature(inner)
    fake.mla.mla_decode_fwd = spy
    return seen


def test_o_reaches_aiter_zeroed(fake):
    """o is handed to aiter zeroed (module docstring, Layout): rows aiter's reduce leaves unwritten read 0."""
    seen = _spy_decode(fake)
    ab.aiter_decode(_batch(18, [0, 7]), gfx="gfx942")
    assert len(seen) == 1 and seen[0].dtype == torch.bfloat16 and not bool(seen[0].any())


def test_plus_inf_lse_is_converted_only_where_a_row_sees_nothing(fake):
    """aiter's +inf means "no token" only on a row that sees none: on a row that sees tokens it is the kernel's
    error, and must reach the checks as +inf, not be disguised as an empty row's -inf."""
    batch = _batch(19, [0, 7])  # row 0 sees nothing, row 1 sees 7 tokens

    def poison(result):
        logits, lse = result
        lse = lse.clone()
        lse[1, :] = math.inf  # [T, H] a wrong +inf on the row that sees tokens
        return logits, lse

    _spy_decode(fake, poison)
    out, lse = ab.aiter_decode(batch, gfx="gfx942")
    assert bool(torch.isneginf(lse[0]).all()) and bool(torch.isposinf(lse[1]).all())


# ---- our plan for aiter ----------------------------------------------------------------------------------------
def test_our_plan_refuses_head_counts_aiter_folds():
    batch = _batch(20, [40, 90], heads=32)
    inputs = ab.aiter_inputs(batch)
    with pytest.raises(ValueError, match="expected 16 heads"):
        ab.plan_metadata(batch, inputs, num_workers=4)


def test_our_plan_keeps_tails_of_two_and_three_tokens_at_four():
    """Tails of 2 and 3 tokens past a 64-token block (test_aiter_contract's 1-token tails cannot tell a minimum
    tail of 2 from one of 4): every split's last piece holds at least AITER_MIN_TAIL = 4 tokens (aiter #2106)."""
    from mla_fast.planner import plan_decode

    lengths = [130, 195]
    batch = _batch(21, lengths)
    inputs = ab.aiter_inputs(batch)

    def last_pieces(buffers):  # tokens of each split request's last piece (block size 1: pages are tokens)
        works = buffers["work_info_set"][: int(buffers["work_indptr"][-1])]
        last = works[(works[:, 1] >= 0) & (works[:, 6] == 0)]  # split, nothing after it
        return sorted(int(e) - int(s) for s, e in zip(last[:, 4], last[:, 5]))

    plain = last_pieces(ab.plan_metadata(batch, inputs, plan=plan_decode(batch.seq_lens, batch.q_lens, 16, 8)))
    assert plain == [2, 3]  # else this test could not fail
    ours = last_pieces(ab.plan_metadata(batch, inputs, num_workers=8))
    assert len(ours) == 2 and min(ours) >= 4, ours


def test_our_plan_buffers_have_aiters_dtypes(head_fake):
    """The six buffers in the dtypes get_mla_metadata_info_v1 specifies (uint64 addresses, int32 maps)."""
    batch = _batch(22, [0, 50, 300])
    inputs = ab.aiter_inputs(batch)
    ours = ab.plan_metadata(batch, inputs, num_workers=4)
    specs = head_fake.get_mla_metadata_info_v1(3, 1, 16, torch.bfloat16, torch.bfloat16, False)
    assert [ours[n].dtype for n in ab.BUFFER_NAMES] == [dtype for _, dtype in specs]
    addresses = [ours["work_indptr"].data_ptr(), ours["work_info_set"].data_ptr()]
    assert ours["work_meta_data"].view(torch.int64).tolist() == addresses


def test_reduce_gives_fp32_lse_for_a_bf16_out(fake):
    batch = _batch(23, [300])
    inputs = ab.aiter_inputs(batch)
    buffers = ab.aiter_metadata(inputs, ab.detect_api(fake, fake.mla), fake)
    out = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    lse = ab.aiter_reduce(torch.zeros(8, 1, 16, 512), torch.zeros(8, 1, 16, 1), buffers, out)
    assert lse.dtype == torch.float32 and lse.shape == (1, 16)


# ---- coverage and diff on hand-made partitions ----------------------------------------------------------------
QO = torch.tensor([0, 1, 2], dtype=torch.int32)  # two requests of one query row
KV = torch.tensor([0, 10, 30], dtype=torch.int32)  # of 10 and 20 tokens (block size 1)
A0 = [0, -1, 0, 1, 0, 10]  # request 0 whole, straight to o
B1, B2 = [1, 0, 1, 2, 10, 20], [1, 1, 1, 2, 20, 30]  # request 1 in two pieces, partial rows 0 and 1


def _buffers(*workers):
    """work_indptr / work_info_set from per-worker lists of (batch, partial, qo_start, qo_end, kv_start, kv_end)."""
    rows = [list(w) + [0, 0] for ws in workers for w in ws]
    indptr = [0]
    for ws in workers:
        indptr.append(indptr[-1] + len(ws))
    return {"work_indptr": torch.tensor(indptr, dtype=torch.int32),
            "work_info_set": torch.tensor(rows, dtype=torch.int32).reshape(-1, 8)}  # fmt: skip


def _errors(*workers):
    return ab.coverage_errors(ab.parse_metadata(_buffers(*workers)), QO, KV)


def test_coverage_accepts_a_valid_partition_and_names_each_fault():
    assert _errors([A0, B1], [B2]) == []
    short = [1, 1, 1, 2, 20, 29]  # the last piece stops a token short of the request's end
    assert any("do not tile" in e for e in _errors([A0, B1], [short]))
    assert any("query rows covered" in e for e in _errors([B1], [B2]))  # request 0 never run
    assert any("out of range" in e for e in _errors([A0, B1], [B2, [2, -1, 2, 3, 30, 31]]))  # batch_idx == B
    direct = [1, -1, 1, 2, 20, 30]  # two pieces, one writing o directly
    assert any("writes to o directly" in e for e in _errors([A0, B1], [direct]))


def test_diff_tells_worker_assignment_from_piece_set_and_counts_load():
    ours = _buffers([A0, B1], [B2])
    moved = _buffers([A0], [B1, B2])  # same pieces in the same order, other workers
    reordered = _buffers([B2], [A0, B1])  # same pieces, another order
    d = ab.diff_metadata(ours, moved, QO, KV)
    assert (d.identical, d.same_pieces, d.ours_errors, d.theirs_errors) == (False, True, (), ())
    d = ab.diff_metadata(ours, reordered, QO, KV)
    assert (d.identical, d.same_pieces) == (False, True)
    assert ab.diff_metadata(ours, _buffers([A0, B1], [B2]), QO, KV).identical
    assert d.stats == {"works": (3, 3), "workers_used": (2, 2), "max_worker_kv": (20, 20), "split_tiles": (1, 1),
                       "max_splits": (2, 2)}  # fmt: skip
