"""Untested before a mutation review (sixty-fifth session):
verify/vllm_layout.py (source mutants that tests/test_vllm_layout.py missed): every test
there had one query row per request, DeepSeek's latent of 512, no graph_size refusal, and compared vllm_fp8_decode
with itself only, so these edits passed it: max_qo_len fixed at 1, to_decode_batch's q_lens all 1, kv_lora_rank
dropped, the UNIFORM check gone, last_page_len = page_size, qo_indptr not padded in graph mode, graph_size one request
short accepted and an exact fit refused, same_inputs blind to the last slot / max_qo_len / a missing scale, and the
cache or q quantized with the other scale.

Comparisons are bitwise but for the fp8 values against the model-dtype rows they came from, held to the format's
element error model (mla_ref.fp8.FP8Format: u |x| + eta scale where not saturated).
"""

import pytest
import torch

from mla_ref.decode import make_decode_batch, mla_decode_ref
from mla_ref.fp8 import fp8_format
from verify.vllm_layout import from_decode_batch, same_inputs, to_decode_batch, vllm_fp8_decode

SIGMA = 0.1352338  # DeepSeek-V3 softmax scale (mscale^2 included)
Q_SCALE, K_SCALE = 4.5 / 448, 5.0 / 448  # as tests/test_vllm_layout.py: unequal, so a swap shows


def _mtp_batch(q_len: int = 2, L: int = 256, R: int = 32, page_size: int = 16, seq_lens=(5, 0, 40)):
    """bf16 requests of one q_len (vLLM's UNIFORM MTP) with a latent of L and a rope of R."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(len(seq_lens) * q_len, 4, L + R, generator=g).bfloat16()  # [B n, H, L + R]
    kvs = [torch.randn(s, L + R, generator=g).bfloat16() for s in seq_lens]
    return make_decode_batch(q, kvs, sm_scale=SIGMA, kv_lora_rank=L, page_size=page_size, generator=g,
                             q_lens=[q_len] * len(seq_lens))


def _vllm_step(seed: int, seq_lens: list[int], fp8_dtype: torch.dtype = torch.float8_e4m3fn, heads: int = 4):
    g = torch.Generator().manual_seed(seed)
    ql_nope = torch.randn(len(seq_lens), heads, 512, generator=g).bfloat16()  # [B, N, 512]
    q_pe = torch.randn(len(seq_lens), heads, 64, generator=g).bfloat16()  # [B, N, 64]
    rows = [torch.randn(s, 576, generator=g).bfloat16() for s in seq_lens]  # [s_b, 576] each
    v = vllm_fp8_decode(ql_nope, q_pe, rows, q_scale=Q_SCALE, k_scale=K_SCALE, sm_scale=SIGMA, fp8_dtype=fp8_dtype,
                        generator=g)
    return v, torch.cat([ql_nope, q_pe], dim=-1), rows


def test_an_mtp_batch_of_another_latent_round_trips_with_its_q_len_and_width():
    """q_len 2 for every request, L = 256: vLLM's qo_indptr steps by 2 and max_qo_len is 2; back to a DecodeBatch
    with the same q_lens, latent and bits, and the oracle's bits from either layout."""
    batch = _mtp_batch()
    v = from_decode_batch(batch)
    assert v.max_qo_len == 2 and v.qo_indptr.tolist() == [0, 2, 4, 6] and v.kv_lora_rank == 256
    assert torch.equal(v.paged_kv_last_page_len, torch.ones(3, dtype=torch.int32))  # block size 1: all 1
    again = to_decode_batch(v)
    assert again.q_lens.tolist() == [2, 2, 2] and again.kv_lora_rank == 256 and again.page_size == 1
    assert torch.equal(again.seq_lens, batch.seq_lens)
    assert same_inputs(from_decode_batch(again), v) == []
    for got, want in zip(mla_decode_ref(again), mla_decode_ref(batch)):
        assert torch.equal(got, want)


def test_requests_of_different_q_lens_are_refused():
    batch = _mtp_batch()
    mixed = batch.replace(q_lens=torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"QueryLenSupport\.UNIFORM"):
        from_decode_batch(mixed)


def test_graph_size_takes_an_exact_fit_and_refuses_one_request_or_slot_short():
    """graph_size (max_num_seqs, indices_capacity): exactly the batch's requests and slots is room enough (nothing
    padded); one fewer of either is refused; with room to spare both indptrs are padded with their last value."""
    batch = _mtp_batch(q_len=1, L=512, R=64, seq_lens=(3, 9))
    exact = from_decode_batch(batch, graph_size=(2, 12))
    assert exact.paged_kv_indices.shape == (12,) and (exact.paged_kv_indices >= 0).all()
    assert same_inputs(exact, from_decode_batch(batch)) == []
    for short in ((1, 12), (2, 11)):
        with pytest.raises(ValueError, match="expected room for 2 requests and 12 slots"):
            from_decode_batch(batch, graph_size=short)
    padded = from_decode_batch(batch, graph_size=(5, 20))
    assert padded.qo_indptr.tolist() == [0, 1, 2, 2, 2, 2] and padded.paged_kv_indptr.tolist() == [0, 3, 12, 12, 12,
                                                                                                  12]


def test_same_inputs_sees_the_last_slot_max_qo_len_and_a_missing_scale():
    v, _, _ = _vllm_step(5, [6, 6])
    w = from_decode_batch(to_decode_batch(v))
    w.paged_kv_indices = w.paged_kv_indices.clone()
    w.paged_kv_indices[11] += 1  # the last used slot
    assert same_inputs(w, v) == ["paged_kv_indices"]
    w = from_decode_batch(to_decode_batch(v))
    w.max_qo_len = 2
    assert same_inputs(w, v) == ["sm_scale/max_qo_len"]
    w = from_decode_batch(to_decode_batch(v))
    w.q_scale = None
    assert same_inputs(w, v) == ["q_scale"] and same_inputs(v, w) == ["q_scale"]


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fnuz, torch.float8_e4m3fn])
def test_vllm_fp8_decode_quantizes_the_cache_by_k_scale_and_q_by_q_scale(fp8_dtype):
    """The cache rows dequantized with k_scale, and q with q_scale, are the model-dtype rows they came from within
    the format's element error model (where |x| <= max · scale: not saturated)."""
    v, q, rows = _vllm_step(3, [7, 0, 40], fp8_dtype)
    batch, f = to_decode_batch(v), fp8_format(fp8_dtype)
    for got, want, scale in [(batch.dequantized_q(), q.double(), Q_SCALE)] + [
            (batch.request_kv(b), rows[b].double(), K_SCALE) for b in range(batch.batch_size)]:
        inside = want.abs() <= f.max * scale
        err = (got - want).abs()[inside]
        assert (err <= f.u * want.abs()[inside] + f.eta * scale).all(), float(err.max())
