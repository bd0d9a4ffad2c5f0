"""vLLM ROCM_AITER_MLA decode inputs <-> DecodeBatch: the round trip is bitwise exact both ways and the oracle gives
bitwise-identical outputs from either layout (same valid rows, same order, same fp64 arithmetic: no tolerance)."""

import pytest
import torch

from mla_fast.aiter_backend import aiter_inputs
from mla_ref.decode import make_decode_batch, mla_decode_ref
from verify.vllm_layout import from_decode_batch, same_inputs, to_decode_batch, vllm_fp8_decode

SIGMA = 0.1352338  # DeepSeek-V3 softmax scale (mscale^2 included)


def _vllm_step(seed: int, seq_lens: list[int], fp8_dtype: torch.dtype, heads: int = 16):
    g = torch.Generator().manual_seed(seed)
    ql_nope = torch.randn(len(seq_lens), heads, 512, generator=g).bfloat16()  # [B, N, 512]
    q_pe = torch.randn(len(seq_lens), heads, 64, generator=g).bfloat16()  # [B, N, 64]
    rows = [torch.randn(s, 576, generator=g).bfloat16() for s in seq_lens]  # [s_b, 576] each
    return vllm_fp8_decode(
        ql_nope, q_pe, rows, q_scale=4.5 / 448, k_scale=5.0 / 448, sm_scale=SIGMA, fp8_dtype=fp8_dtype, generator=g
    )


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fnuz, torch.float8_e4m3fn])
def test_vllm_to_batch_and_back_is_bitwise(fp8_dtype):
    v = _vllm_step(0, [0, 1, 7, 33], fp8_dtype)
    batch = to_decode_batch(v)
    assert batch.page_size == 1 and batch.q.dtype == fp8_dtype
    assert same_inputs(from_decode_batch(batch), v) == []
    assert torch.equal(batch.visible_tokens(), torch.tensor([0, 1, 7, 33]))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_batch_to_vllm_and_back_sees_the_same_rows(page_size):
    g = torch.Generator().manual_seed(1)
    seq_lens = [5, 0, 64, 130]
    q = torch.randn(4, 16, 576, generator=g).bfloat16()
    kvs = [torch.randn(s, 576, generator=g).bfloat16() for s in seq_lens]
    batch = make_decode_batch(q, kvs, sm_scale=SIGMA, kv_lora_rank=512, page_size=page_size, generator=g)
    again = to_decode_batch(from_decode_batch(batch))
    assert torch.equal(again.seq_lens, batch.seq_lens) and torch.equal(again.q_lens, batch.q_lens)
    assert torch.equal(again.q.view(torch.int16), batch.q.view(torch.int16))
    for b in range(batch.batch_size):
        assert torch.equal(again.request_kv(b, torch.bfloat16).view(torch.int16), kvs[b].view(torch.int16))
    out_a, lse_a = mla_decode_ref(batch)
    out_b, lse_b = mla_decode_ref(again)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


def test_ref_identical_from_both_layouts_fp8():
    v = _vllm_step(2, [3, 0, 40], torch.float8_e4m3fnuz)
    batch = to_decode_batch(v)
    again = to_decode_batch(from_decode_batch(batch))
    out_a, lse_a = mla_decode_ref(batch)
    out_b, lse_b = mla_decode_ref(again)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    assert bool(torch.isfinite(out_a).all()), "NaN padding must never reach the oracle's output"


def test_graph_padded_buffers_round_trip():
    v = _vllm_step(3, [2, 9], torch.float8_e4m3fn)
    padded = from_decode_batch(to_decode_batch(v), graph_size=(8, 64))
    assert padded.paged_kv_indptr.shape == (9,) and int(padded.paged_kv_indptr[-1]) == 11  # tail = last value
    assert int(padded.paged_kv_indices[-1]) == -1 and padded.paged_kv_indices.shape == (64,)
    assert same_inputs(padded, v) == []
    assert same_inputs(from_decode_batch(to_decode_batch(padded)), v) == []


def test_aiter_adapter_passes_vllms_layout():
    """Block size 1, token-slot indices, last_page_len 1: the adapter's default is vLLM's layout, bit for bit."""
    v = _vllm_step(4, [4, 0, 19], torch.float8_e4m3fnuz)
    inputs = aiter_inputs(to_decode_batch(v), fp8_dtype=torch.float8_e4m3fnuz)
    assert torch.equal(inputs.kv_indptr, v.paged_kv_indptr) and torch.equal(inputs.kv_indices, v.paged_kv_indices)
    assert torch.equal(inputs.kv_last_page_lens, v.paged_kv_last_page_len)
    assert torch.equal(inputs.kv_buffer.view(torch.uint8), v.kv_buffer.view(torch.uint8))
    assert torch.equal(inputs.q.view(torch.uint8), v.q.view(torch.uint8))
    assert torch.equal(inputs.q_scale, v.q_scale) and torch.equal(inputs.kv_scale, v.k_scale)


def test_same_inputs_detects_a_changed_slot():
    v = _vllm_step(5, [6, 6], torch.float8_e4m3fn)
    w = from_decode_batch(to_decode_batch(v))
    w.paged_kv_indices = w.paged_kv_indices.clone()
    w.paged_kv_indices[0] += 1
    assert same_inputs(w, v) == ["paged_kv_indices"]
