"""The CPU-side conversions of the FlashInfer and FlashMLA adapters, held against values derived here: the DeepSeek
dimension refusals (both sizes), `split_q_scale`'s power-of-two split and its fp16 fallback, e4m3fnuz caches and q
re-expressed as e4m3fn with half the scale, fp8 q folded into the softmax scale, the CSR page layout, the causal
flag, the fp8 block-table clamp, FlashMLA's lse gather from [B, H, s_q], and the arguments each adapter hands its
peer (through tests/test_backends.py's recording fakes of `flashinfer` and `flash_mla`, injected with monkeypatch).
The peers are not needed.

Every comparison is exact: the conversions move values by powers of two, slice, copy or reorder them, so any
difference is a wrong conversion, not rounding.
"""

import math
import sys
import types

import pytest
import torch
from test_backends import _FakeFlashMLA, _FakeMLAWrapper

from mla_fast import flashinfer_backend as fi
from mla_fast import flashmla_backend as fm
from mla_fast.backends import Unsupported
from mla_ref.decode import INVALID_PAGE, make_decode_batch
from verify.cases import Case
from verify.next_step import with_room

SM_SCALE = 0.1352338


def _exact(x: torch.Tensor, y: torch.Tensor) -> None:
    """x == y element by element, NaN (the caches' unused slots) where y is NaN: no tolerance, the conversions
    compared with it are exact."""
    torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def _batch(seed, seq_lens, q_lens, heads=4, page_size=16, q_fmt=None, kv_fmt=None, q_scale=None, kv_scale=None,
           L=512, R=64):
    """A DecodeBatch from a local generator: bf16 q / cache, or fp8 codes of format q_fmt / kv_fmt (e.g.
    torch.float8_e4m3fnuz) with the given per-tensor scales. fp8 values are drawn within +-200, below every e4m3
    format's largest finite value (240 for e4m3fnuz), so that fnuz -> fn conversion never meets +-240."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, L + R, generator=g) * 50
    kv = torch.randn(sum(seq_lens), L + R, generator=g) * 50
    q = q.clamp(-200, 200).to(q_fmt) if q_fmt else q.bfloat16()
    kv = kv.clamp(-200, 200).to(kv_fmt) if kv_fmt else kv.bfloat16()
    scales = {k: v for k, v in (("q_scale", q_scale), ("kv_scale", kv_scale)) if v is not None}
    return make_decode_batch(q, list(torch.split(kv, list(seq_lens))), sm_scale=SM_SCALE, kv_lora_rank=L,
                             page_size=page_size, generator=g, q_lens=list(q_lens), **scales)


# ---- both adapters ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L, R", [(512, 32), (256, 64)])
def test_each_adapter_refuses_a_batch_off_deepseek_dims_in_either_size(L, R):
    """FlashInfer's and FlashMLA's MLA kernels are built for a latent of 512 *and* a rope of 64: a batch with one of
    the two sizes right and the other wrong is refused by name too (a check on the latent alone would send a rope of
    32 to a kernel that reads 64 channels of it)."""
    batch = _batch(0, (5, 70), (1, 1), L=L, R=R)
    with pytest.raises(Unsupported, match="kv_lora_rank 512 and rope_dim 64 only"):
        fi.flashinfer_inputs(batch)
    with pytest.raises(Unsupported, match="kv_lora_rank 512 and rope_dim 64 only"):
        fm.flashmla_inputs(batch)


# ---- FlashInfer ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("log2_scale", [-6.4, -5.6, -4.49, 0.3, 3.51])
def test_split_q_scale_takes_the_nearest_power_of_two(log2_scale):
    """q_scale = 2^k x rest with 2^k the power of two nearest q_scale, so rest lies in [2^-1/2, 2^1/2] (the raw
    logits keep a bf16 deployment's scale), and q8 x 2^k is returned exactly."""
    g = torch.Generator().manual_seed(1)
    q8 = (torch.randn(3, 2, 576, generator=g) * 40).clamp(-440, 440).to(torch.float8_e4m3fn)
    q_scale = 2.0**log2_scale
    q, rest = fi.split_q_scale(q8, q_scale, torch.bfloat16)
    k = round(log2_scale)  # nearest integer: the expected power of two, from the test's own exponent
    assert rest == q_scale / 2.0**k and 2**-0.5 <= rest <= 2**0.5
    assert q.dtype == torch.bfloat16 and torch.equal(q.double(), q8.double() * 2.0**k)


def test_split_q_scale_keeps_q8_and_the_whole_scale_where_fp16_would_underflow():
    """fp16 holds no value below 2^-24: q8 x 2^-20 would lose e4m3's small values (2^-9 x 2^-20), so the split
    falls back to q8 itself (exact in fp16) with the whole q_scale left over; the product q x rest stays q8 x
    q_scale either way."""
    q8 = torch.tensor([2.0**-9, -2.0**-6, 1.0, 448.0]).to(torch.float8_e4m3fn).view(1, 1, 4)
    q_scale = 2.0**-20
    q, rest = fi.split_q_scale(q8, q_scale, torch.float16)
    assert q.dtype == torch.float16 and torch.equal(q.double(), q8.double()) and rest == q_scale
    bf, rest_bf = fi.split_q_scale(q8, q_scale, torch.bfloat16)  # bf16's range holds 2^-29: the split applies
    assert rest_bf == 1.0 and torch.equal(bf.double(), q8.double() * q_scale)


def test_flashinfer_converts_an_e4m3fnuz_cache_to_e4m3fn_at_half_the_scale():
    """An e4m3fnuz cache goes to FlashInfer as e4m3fn codes worth twice as much with half the scale: the
    dequantized channels (code x scale) are the batch's, exactly (a power-of-two rescaling), and the scale handed to
    the kernel is the converted one."""
    kv_scale = 0.0371
    batch = _batch(2, (5, 70), (1, 1), kv_fmt=torch.float8_e4m3fnuz, kv_scale=kv_scale)
    a = fi.flashinfer_inputs(batch)
    assert a["kv_dtype"] == torch.float8_e4m3fn and a["ckv_cache"].dtype == torch.float8_e4m3fn
    assert a["kv_scale"] == kv_scale / 2
    full = torch.cat([a["ckv_cache"], a["kpe_cache"]], -1).double() * a["kv_scale"]  # [P, ps, D]
    _exact(full, batch.kv_cache.double() * kv_scale)


def test_flashinfer_takes_fp8_q_beside_a_bf16_cache_as_bf16_with_the_scale_folded():
    """fp8 q with a bf16 cache: q goes in as bf16 q8 x 2^k and the rest of q_scale multiplies sm_scale, so that
    q x sm_scale is the batch's dequantized q x sm_scale (exact: a power of two moved between them)."""
    q_scale = 0.0213
    batch = _batch(3, (5, 70), (1, 2), q_fmt=torch.float8_e4m3fn, q_scale=q_scale)
    a = fi.flashinfer_inputs(batch)
    assert a["q_dtype"] == torch.bfloat16 and a["q_nope"].dtype == torch.bfloat16
    k = round(math.log2(q_scale))
    assert a["sm_scale"] == SM_SCALE * (q_scale / 2.0**k)
    q = torch.cat([a["q_nope"], a["q_pe"]], -1)
    assert torch.equal(q.double(), batch.q.double() * 2.0**k)


def test_flashinfer_inputs_are_the_batch_split_at_the_latent_with_its_pages_in_csr_form():
    """q and the cache split at L (q_nope | q_pe, ckv | kpe give back the batch's tensors), kv_indptr the running
    count of each request's ceil(seq_len / page_size) pages and kv_indices those pages of its block-table row, in
    order; qo_indptr the running count of q_lens, kv_len_arr the seq_lens; causal only when some request has more
    than one query row (FlashInfer's causal diagonal then aligns each row to the end of its KV)."""
    seq_lens, q_lens, ps = (0, 70, 5, 33), (1, 1, 1, 1), 16
    batch = _batch(4, seq_lens, q_lens, page_size=ps)
    a = fi.flashinfer_inputs(batch)
    assert torch.equal(torch.cat([a["q_nope"], a["q_pe"]], -1), batch.q)
    assert a["q_nope"].shape[-1] == 512 and a["ckv_cache"].shape[-1] == 512
    _exact(torch.cat([a["ckv_cache"], a["kpe_cache"]], -1), batch.kv_cache)
    pages = [-(-s // ps) for s in seq_lens]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    assert a["kv_indptr"].tolist() == indptr
    expected = [p for b, n in enumerate(pages) for p in batch.block_table[b, :n].tolist()]
    assert a["kv_indices"].tolist() == expected
    assert a["qo_indptr"].tolist() == [0, 1, 2, 3, 4] and a["kv_len_arr"].tolist() == list(seq_lens)
    assert a["causal"] is False and a["sm_scale"] == SM_SCALE and a["kv_scale"] is None
    mtp = _batch(4, seq_lens, (1, 2, 1, 1), page_size=ps)
    assert fi.flashinfer_inputs(mtp)["causal"] is True


@pytest.fixture
def fake_flashinfer(monkeypatch):
    monkeypatch.setattr(_FakeMLAWrapper, "made", [])
    module = types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_FakeMLAWrapper))
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return _FakeMLAWrapper.made


def test_flashinfer_decode_plans_and_runs_with_the_batch_geometry_scales_and_natural_lse(fake_flashinfer):
    """flashinfer_decode hands plan() (qo_indptr, kv_indptr, kv_indices, kv_len_arr, heads, L, R, page_size, causal,
    sm_scale, q dtype, kv dtype) in FlashInfer's order, with fp8 q's folded sm_scale, and asks run() for a natural-log
    lse with the cache scale on both the ckv and kpe halves; the wrapper takes the backend asked for (FA3 by
    default)."""
    q_scale, kv_scale = 0.0213, 0.0371
    batch = _batch(5, (5, 70), (1, 1), heads=4, page_size=16, q_fmt=torch.float8_e4m3fn,
                   kv_fmt=torch.float8_e4m3fn, q_scale=q_scale, kv_scale=kv_scale)
    fi.flashinfer_decode(batch)
    w = fake_flashinfer[-1]
    assert w.backend == "fa3"
    k = round(math.log2(q_scale))
    expected_tail = (4, 512, 64, 16, False, SM_SCALE * (q_scale / 2.0**k), torch.bfloat16, torch.float8_e4m3fn)
    assert w.plan_args[4:] == expected_tail
    assert w.plan_args[3].tolist() == [5, 70]  # kv_len_arr
    assert w.run_kw["return_lse"] is True and w.run_kw["return_lse_base_on_e"] is True
    assert w.run_kw["ckv_scale"] == kv_scale and w.run_kw["kpe_scale"] == kv_scale
    fi.flashinfer_decode(batch, backend="fa2")
    assert fake_flashinfer[-1].backend == "fa2"


def test_flashinfers_step_runs_into_q_dtype_outputs_with_natural_lse_and_refuses_e4m3fnuz(fake_flashinfer):
    """FlashInferStep's preallocated out is in q's 16-bit dtype ([T, H, L]) and lse fp32 [T, H]; its run() asks for
    a natural-log lse and passes the fp8 cache scale for both halves. An e4m3fnuz cache has no step (converted into
    a new copy per call, which a captured graph would keep reading): Unsupported, named."""
    kv_scale = 0.0371
    batch = _batch(6, (5, 70), (1, 1), kv_fmt=torch.float8_e4m3fn, kv_scale=kv_scale)
    step = fi.FlashInferStep(batch, 1)
    assert step.out.dtype == torch.bfloat16 and tuple(step.out.shape) == (2, 4, 512)
    assert step.lse.dtype == torch.float32 and tuple(step.lse.shape) == (2, 4)
    step.plan(batch)
    out, lse = step.run()
    kw = step.wrapper.run_kw
    assert out is step.out and lse is step.lse and kw["return_lse_base_on_e"] is True
    assert kw["ckv_scale"] == kv_scale and kw["kpe_scale"] == kv_scale
    assert step.wrapper.plan_args[4:8] == (4, 512, 64, 16)
    fnuz = _batch(6, (5, 70), (1, 1), kv_fmt=torch.float8_e4m3fnuz, kv_scale=kv_scale)
    with pytest.raises(Unsupported, match="e4m3fnuz"):
        fi.FlashInferStep(fnuz, 1)


# ---- FlashMLA -----------------------------------------------------------------------------------------------------


def test_repage_keeps_every_token_in_pages_of_64_and_an_empty_batch_one_page():
    """repage moves each request's tokens, in order, into ceil(seq_len / 64) fresh pages of its own (request by
    request) and leaves the block table's other entries INVALID_PAGE; a batch with no tokens still gets one (NaN)
    page, so the cache it hands FlashMLA is never empty."""
    seq_lens = (0, 70, 5, 129)
    batch = _batch(7, seq_lens, (1,) * 4, page_size=16)
    re = fm.repage(batch)
    assert re.page_size == 64 and re.kv_cache.shape[0] == sum(-(-s // 64) for s in seq_lens)
    first = 0
    for b, s in enumerate(seq_lens):
        n = -(-s // 64)
        assert re.block_table[b, :n].tolist() == list(range(first, first + n))
        assert bool((re.block_table[b, n:] == INVALID_PAGE).all())
        first += n
        pages, slots = batch.token_slots(b)
        new_pages, new_slots = re.token_slots(b)
        assert torch.equal(re.kv_cache[new_pages, new_slots].view(torch.uint8),
                           batch.kv_cache[pages, slots].view(torch.uint8))
    empty = fm.repage(_batch(7, (0, 0), (1, 1), page_size=16))
    assert empty.kv_cache.shape[0] == 1 and bool(empty.kv_cache.float().isnan().all())


@pytest.fixture
def fake_flashmla(monkeypatch):
    module = _FakeFlashMLA(positional_lse=True)
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    return module


def _expected_lse(q_lens, s_q, heads):
    """lse [T, H] the fake's values at each real row's grid position: row r of request b (q_len n) sits at grid row
    s_q - n + r of b's slot (FlashMLA's causal rule then gives it the contract's visibility)."""
    rows = [(b, s_q - n + r) for b, n in enumerate(q_lens) for r in range(n)]
    return torch.tensor([[1000.0 * b + 10 * h + s for h in range(heads)] for b, s in rows])


def test_flashmla_decode_gathers_each_rows_lse_from_the_b_h_sq_layout(fake_flashmla):
    """FlashMLA's lse is [B, H, s_q]: each real row's lse is read at (its request, head, its grid row), which a
    reshape without the transpose to [B, s_q, H] would mix up across heads and rows."""
    q_lens = (2, 1, 3)
    batch = _batch(8, (70, 9, 5), q_lens, page_size=64)
    out, lse = fm.flashmla_decode(batch)
    assert torch.equal(out, batch.q[..., :512])
    assert torch.equal(lse, _expected_lse(q_lens, 3, 4))


def test_flashmla_fp8_sends_both_descales_its_schedule_and_clamps_unused_block_table_entries(fake_flashmla):
    """The dense fp8 kernel: descale_q = q_scale and descale_k = kv_scale, scheduled by get_mla_decoding_metadata
    for s_q x H query rows per request with is_fp8_kvcache; its block table keeps every used entry and points the
    others (which that kernel may read) at page 0. The same through FlashMLAStep, planned and run."""
    q_scale, kv_scale = 0.0213, 0.0371
    static = _batch(9, (70, 9, 5), (2, 1, 2), page_size=64, q_fmt=torch.float8_e4m3fn, kv_fmt=torch.float8_e4m3fn,
                    q_scale=q_scale, kv_scale=kv_scale)
    batch, _ = with_room(static)  # INVALID_PAGE entries past each request's pages
    used = batch.used_entries
    assert not bool(used.all())
    expected_table = torch.where(used, batch.block_table, torch.zeros_like(batch.block_table))
    fm.flashmla_decode(batch)
    for run in ("decode", "step"):
        kw = fake_flashmla.kw
        assert kw["is_fp8_kvcache"] is True, run
        fp32 = torch.tensor([q_scale, kv_scale], dtype=torch.float32)  # the kernel's descales are fp32 tensors
        assert torch.equal(torch.cat([kw["descale_q"], kw["descale_k"]]), fp32), run
        seqlens, tokens_per_head, h_k, is_fp8, legacy = fake_flashmla.metadata_call
        assert seqlens.tolist() == [70, 9, 5] and (tokens_per_head, h_k, is_fp8, legacy) == (2 * 4, 1, True, True)
        assert torch.equal(fake_flashmla.block_table, expected_table), run
        step = fm.FlashMLAStep(batch, 2)
        step.plan(batch)
        step.run()


def test_flashmla_converts_e4m3fnuz_q_and_cache_at_half_their_scales():
    """e4m3fnuz q and cache go to the dense fp8 kernel as e4m3fn codes worth twice as much, with descales of half
    the batch's scales: code x descale is the batch's dequantized value, exactly."""
    q_scale, kv_scale = 0.0213, 0.0371
    batch = _batch(10, (70, 9), (1, 1), page_size=64, q_fmt=torch.float8_e4m3fnuz, kv_fmt=torch.float8_e4m3fnuz,
                   q_scale=q_scale, kv_scale=kv_scale)
    a = fm.flashmla_inputs(batch)
    assert a["q"].dtype == torch.float8_e4m3fn and a["k_cache"].dtype == torch.float8_e4m3fn
    assert a["descale"] == (q_scale / 2, kv_scale / 2)
    B, s_q, H, D = a["q"].shape
    assert torch.equal(a["q"].reshape(B * s_q, H, D)[a["rows"]].double() * (q_scale / 2), batch.q.double() * q_scale)
    _exact(a["k_cache"][:, :, 0].double() * (kv_scale / 2), batch.kv_cache.double() * kv_scale)


def test_flashmla_sends_fp8_q_on_a_bf16_cache_as_bf16_with_q_scale_in_the_softmax_scale():
    """fp8 q on a 16-bit cache goes to the dense bf16 kernel as bf16 (exact: every e4m3 value fits) with
    softmax_scale = sm_scale x q_scale: scores identical to the dequantized q's."""
    q_scale = 0.0213
    batch = _batch(11, (70, 9), (1, 1), page_size=64, q_fmt=torch.float8_e4m3fn, q_scale=q_scale)
    a = fm.flashmla_inputs(batch)
    assert a["q"].dtype == torch.bfloat16 and a["descale"] is None
    assert a["softmax_scale"] == SM_SCALE * q_scale
    B, s_q, H, D = a["q"].shape
    assert torch.equal(a["q"].reshape(B * s_q, H, D)[a["rows"]].double(), batch.q.double())


def test_flashmla_refuses_an_fp8_cache_of_another_format_than_e4m3():
    """FlashMLA's fp8 cache is e4m3fn: an e5m2 cache beside e4m3fn q (both fp8, so the fp8 x fp8 check passes) is
    refused by name."""
    batch = _batch(12, (70, 9), (1, 1), page_size=64, q_fmt=torch.float8_e4m3fn, kv_fmt=torch.float8_e5m2,
                   q_scale=0.02, kv_scale=0.03)
    with pytest.raises(Unsupported, match="FlashMLA's fp8 cache is e4m3fn"):
        fm.flashmla_inputs(batch)


def test_flashmla_refuses_e5m2_on_its_fp8_kernel_eagerly_and_in_its_step(fake_flashmla):
    """FlashMLA's dense fp8 kernel reads e4m3fn q and cache bytes. An e5m2 q beside an e4m3fn cache (flashmla_inputs
    checked the cache's format only) and an e5m2 cache with e5m2 q (FlashMLAStep checked neither) are refused by
    name, as the eager adapter refuses an e5m2 cache, instead of handing the kernel e5m2 bytes to read as e4m3fn.
    Found by this review; the fix adds FP8_FORMATS to both."""
    e5m2_q = _batch(14, (70, 9), (1, 1), page_size=64, q_fmt=torch.float8_e5m2, kv_fmt=torch.float8_e4m3fn,
                    q_scale=0.02, kv_scale=0.03)
    with pytest.raises(Unsupported, match="takes e4m3fn q and an e4m3fn cache"):
        fm.flashmla_inputs(e5m2_q)
    with pytest.raises(Unsupported, match="takes e4m3fn q and an e4m3fn cache"):
        fm.FlashMLAStep(e5m2_q, 1)
    e5m2 = Case(seq_lens=(70, 5), q_lens=(1, 1), heads=4, page_size=64, q_dtype="fp8", kv_dtype="fp8",
                fp8_format="e5m2").materialize()[0]
    assert e5m2.kv_cache.dtype == torch.float8_e5m2
    with pytest.raises(Unsupported, match="e4m3fn"):
        fm.flashmla_inputs(e5m2)
    with pytest.raises(Unsupported, match="takes e4m3fn q and an e4m3fn cache"):
        fm.FlashMLAStep(e5m2, 1)


def test_flashmlas_step_refuses_what_it_cannot_replay_and_sets_causal_from_its_grid(fake_flashmla):
    """FlashMLAStep: plan() refuses q_lens above the step's grid (ValueError) and, on an fp8 cache, a request with
    seq_len 0 (the dense fp8 kernel reads block_table[b][-1]: Unsupported); an e4m3fnuz cache has no step; a grid of
    one row per request runs non-causal (FlashMLA's rule with s_q = 1), a grid of two causal."""
    batch = _batch(13, (70, 9), (1, 1), page_size=64)
    step = fm.FlashMLAStep(batch, 1)
    step.plan(batch)
    step.run()
    assert fake_flashmla.kw["causal"] is False
    step2 = fm.FlashMLAStep(batch, 2)
    step2.plan(batch)
    out, lse = step2.run()
    assert fake_flashmla.kw["causal"] is True and torch.equal(lse, _expected_lse((1, 1), 2, 4))
    mtp = _batch(13, (70, 9), (2, 1), page_size=64)
    with pytest.raises(ValueError, match="max_q_len 1"):
        fm.FlashMLAStep(mtp, 1).plan(mtp)
    fp8 = _batch(13, (70, 0), (1, 1), page_size=64, q_fmt=torch.float8_e4m3fn, kv_fmt=torch.float8_e4m3fn,
                 q_scale=0.02, kv_scale=0.03)
    with pytest.raises(Unsupported, match="seq_len 0"):
        fm.FlashMLAStep(fp8, 1).plan(fp8)
    fnuz = _batch(13, (70, 9), (1, 1), page_size=64, q_fmt=torch.float8_e4m3fnuz, kv_fmt=torch.float8_e4m3fnuz,
                  q_scale=0.02, kv_scale=0.03)
    with pytest.raises(Unsupported, match="e4m3fnuz"):
        fm.FlashMLAStep(fnuz, 1)


def test_case_materialize_builds_the_off_deepseek_batches_used_here():
    """The refusal tests above build batches of a latent of 512 with a rope of 32 and the reverse with `_batch`;
    verify's Case builds the same shapes, so the refusal holds for the campaigns' batches too."""
    for L, R in ((512, 32), (256, 64)):
        batch = Case(seq_lens=(5, 70), q_lens=(1, 1), kv_lora_rank=L, rope_dim=R, heads=4).materialize()[0]
        assert (batch.kv_lora_rank, batch.rope_dim) == (L, R)
        with pytest.raises(Unsupported, match="rope_dim 64 only"):
            fi.flashinfer_inputs(batch)
