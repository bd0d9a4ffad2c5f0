"""The exact decode inputs vLLM's ROCm AITER MLA backend hands aiter, and their round trip through DecodeBatch.

vLLM (aiter-contract.md §9, `ROCM_AITER_MLA`) runs decode with kernel block size 1:

    kv_c_and_k_pe_cache [num_blocks, 1, 576]    one token per block; fp8 caches hold quantize([c_kv | k_pe] / k_scale)
    paged_kv_indptr     [B+1] int32             cat([0], cumsum(seq_lens))
    paged_kv_indices    [Σ seq_lens] int32      token slots (block ids at block size 1)
    paged_kv_last_page_len [B] int32            all 1
    qo_indptr           [B+1] int32             arange(B+1) at one query row per request (uniform q_len)
    q                   [B, N, 576]             fp8 quantize([q_nope·W_UK | q_pe] / q_scale) when the cache is fp8
                                                (`_decode_concat_quant_fp8_op`), else the model dtype
    q_scale, k_scale    fp32 [1]                layer._q_scale, layer._k_scale (static, per tensor)

In CUDA-graph mode the indptr buffer is padded with its last value and the indices buffer with -1; `num_reqs` says
how much of it is real. `from_decode_batch` and `to_decode_batch` convert without touching a byte of q or the cache:
DecodeBatch -> vLLM views the cache at block size 1 (slot = page · page_size + offset); vLLM -> DecodeBatch reads the
slots as a block table of 1-token pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_ref import fp8
from mla_ref.decode import INVALID_PAGE, DecodeBatch


@dataclass
class VllmAiterDecode:
    """One decode step as vLLM's ROCM_AITER_MLA backend passes it to `mla_decode_fwd` (see module docstring)."""

    q: torch.Tensor  # [B, N, 576]
    kv_cache: torch.Tensor  # [num_blocks, 1, 576]
    qo_indptr: torch.Tensor  # [B+1] int32 (graph mode: longer, padded)
    paged_kv_indptr: torch.Tensor  # [B+1] int32 (graph mode: longer, padded with the last value)
    paged_kv_indices: torch.Tensor  # [Σ seq_lens] int32 (graph mode: longer, padded with -1)
    paged_kv_last_page_len: torch.Tensor  # [B] int32, all 1
    num_reqs: int
    max_qo_len: int
    sm_scale: float
    q_scale: torch.Tensor | None  # fp32 [1]
    k_scale: torch.Tensor | None  # fp32 [1]
    kv_lora_rank: int = 512

    @property
    def kv_buffer(self) -> torch.Tensor:
        """[num_blocks, 1, 1, 576]: the view vLLM passes to aiter (nhead_kv = 1)."""
        return self.kv_cache.view(-1, 1, 1, self.kv_cache.shape[-1])


def _scale(s: float | None, device: torch.device) -> torch.Tensor | None:
    return None if s is None else torch.tensor([s], dtype=torch.float32, device=device)  # [1] fp32


def from_decode_batch(batch: DecodeBatch, graph_size: tuple[int, int] | None = None) -> VllmAiterDecode:
    """vLLM's aiter decode inputs for `batch` (one query length for all requests, as vLLM's UNIFORM support).

    graph_size: (max_num_seqs, indices_capacity) to mimic vLLM's persistent CUDA-graph buffers.
    """
    batch.validate()
    if batch.batch_size and int(batch.q_lens.min()) != int(batch.q_lens.max()):
        raise ValueError(f"vllm_layout.q_lens: expected one query length (QueryLenSupport.UNIFORM), got {batch.q_lens}")
    seq = batch.seq_lens.long()  # [B]
    indptr = torch.nn.functional.pad(torch.cumsum(seq, 0), (1, 0)).to(torch.int32)  # [B+1] cat([0], cumsum)
    pages, slots, _ = batch.token_addresses()  # [Σ s_b] each, request by request
    indices = (pages * batch.page_size + slots).to(torch.int32)  # [Σ s_b]
    qo_indptr = batch.qo_indptr
    if graph_size is not None:
        max_num_seqs, capacity = graph_size
        if max_num_seqs < batch.batch_size or capacity < indices.numel():
            need = f"{batch.batch_size} requests and {indices.numel()} slots"
            raise ValueError(f"vllm_layout.graph_size: expected room for {need}, got {graph_size}")
        pad = max_num_seqs - batch.batch_size
        indptr = torch.cat([indptr, indptr[-1:].expand(pad)])  # tail padded with the last value
        qo_indptr = torch.cat([qo_indptr, qo_indptr[-1:].expand(pad)])
        indices = torch.cat([indices, indices.new_full((capacity - indices.numel(),), -1)])  # tail -1
    return VllmAiterDecode(
        q=batch.q,
        kv_cache=batch.kv_cache.view(-1, 1, batch.head_dim),  # [P * ps, 1, D] a view: block size 1
        qo_indptr=qo_indptr,
        paged_kv_indptr=indptr,
        paged_kv_indices=indices,
        paged_kv_last_page_len=torch.ones(batch.batch_size, dtype=torch.int32, device=batch.device),
        num_reqs=batch.batch_size,
        max_qo_len=int(batch.q_lens.max()) if batch.batch_size else 1,
        sm_scale=float(batch.sm_scale),
        q_scale=_scale(batch.q_scale, batch.device),
        k_scale=_scale(batch.kv_scale, batch.device),
        kv_lora_rank=batch.kv_lora_rank,
    )


def to_decode_batch(v: VllmAiterDecode) -> DecodeBatch:
    """The DecodeBatch that sees exactly vLLM's inputs: 1-token pages, block table = token slots (-1 -> invalid)."""
    B = v.num_reqs
    indptr = v.paged_kv_indptr[: B + 1].long()  # [B+1] real part
    seq_lens = (indptr[1:] - indptr[:-1]).to(torch.int32)  # [B]
    width = max(int(seq_lens.max()) if B else 0, 1)
    block_table = torch.full((B, width), INVALID_PAGE, dtype=torch.int32, device=v.q.device)  # [B, max s]
    for b in range(B):
        s0, s1 = int(indptr[b]), int(indptr[b + 1])
        block_table[b, : s1 - s0] = v.paged_kv_indices[s0:s1]
    q_lens = (v.qo_indptr[1 : B + 1] - v.qo_indptr[:B]).to(torch.int32)  # [B]
    return DecodeBatch(
        v.q,
        v.kv_cache,
        block_table,
        seq_lens,
        sm_scale=v.sm_scale,
        kv_lora_rank=v.kv_lora_rank,
        q_lens=q_lens,
        q_scale=None if v.q_scale is None else float(v.q_scale.item()),
        kv_scale=None if v.k_scale is None else float(v.k_scale.item()),
    ).validate()


def vllm_fp8_decode(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_rows: list[torch.Tensor],
    *,
    q_scale: float,
    k_scale: float,
    sm_scale: float,
    fp8_dtype: torch.dtype,
    generator: torch.Generator,
    extra_blocks: int = 8,
) -> VllmAiterDecode:
    """Build a decode step the way vLLM does with an fp8 cache, from model-dtype tensors.

    Args:
        ql_nope: [B, N, 512] q_nope · W_UK; q_pe: [B, N, 64] roped query.
        kv_rows: B tensors [s_b, 576] = [kv_c_normed | k_pe], model dtype.
        q_scale, k_scale: static per-tensor scales (layer._q_scale, layer._k_scale).
        fp8_dtype: current_platform.fp8_dtype() (e4m3fnuz on gfx942, e4m3fn on gfx950).
        generator: local RNG for the slot mapping; extra_blocks: unused NaN blocks in the cache.
    The cache write is `concat_and_cache_mla`: cache[slot] = quantize(row / k_scale), saturating; q is
    `_decode_concat_quant_fp8_op`: quantize(cat(ql_nope, q_pe) / q_scale).
    """
    device, D = ql_nope.device, ql_nope.shape[-1] + q_pe.shape[-1]
    seq_lens = [int(r.shape[0]) for r in kv_rows]
    num_blocks = sum(seq_lens) + extra_blocks
    slot_mapping = torch.randperm(num_blocks, generator=generator)[: sum(seq_lens)].to(device)  # token -> block
    cache = torch.full((num_blocks, 1, D), float("nan"), device=device).to(fp8_dtype)  # [num_blocks, 1, D] NaN
    rows = torch.cat(kv_rows) if kv_rows else torch.zeros(0, D, device=device)  # [Σ s_b, D]
    cache[slot_mapping.long(), 0] = fp8.quantize(rows, fp8_dtype, scale=k_scale)[0]
    q = fp8.quantize(torch.cat([ql_nope, q_pe], dim=-1), fp8_dtype, scale=q_scale)[0]  # [B, N, D]
    B = len(kv_rows)
    indptr = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return VllmAiterDecode(
        q=q,
        kv_cache=cache,
        qo_indptr=torch.arange(B + 1, dtype=torch.int32, device=device),
        paged_kv_indptr=indptr,
        paged_kv_indices=slot_mapping.to(torch.int32),
        paged_kv_last_page_len=torch.ones(B, dtype=torch.int32, device=device),
        num_reqs=B,
        max_qo_len=1,
        sm_scale=sm_scale,
        q_scale=_scale(q_scale, device),
        k_scale=_scale(k_scale, device),
        kv_lora_rank=ql_nope.shape[-1],
    )


def same_inputs(a: VllmAiterDecode, b: VllmAiterDecode) -> list[str]:
    """Fields where two vLLM decode inputs differ bitwise (real part only); [] when identical."""
    diffs = []
    n = a.num_reqs
    if n != b.num_reqs:
        return [f"num_reqs {a.num_reqs} != {b.num_reqs}"]
    used = int(a.paged_kv_indptr[n])

    def bits(t: torch.Tensor) -> torch.Tensor:  # floats as raw integers, so NaN padding compares equal
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return t.view(ints[t.element_size()]) if t.is_floating_point() else t

    pairs = {
        "q": (a.q, b.q),
        "kv_cache": (a.kv_cache, b.kv_cache),
        "qo_indptr": (a.qo_indptr[: n + 1], b.qo_indptr[: n + 1]),
        "paged_kv_indptr": (a.paged_kv_indptr[: n + 1], b.paged_kv_indptr[: n + 1]),
        "paged_kv_indices": (a.paged_kv_indices[:used], b.paged_kv_indices[:used]),
        "paged_kv_last_page_len": (a.paged_kv_last_page_len[:n], b.paged_kv_last_page_len[:n]),
    }
    for name, (x, y) in pairs.items():
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(bits(x), bits(y)):
            diffs.append(name)
    for name in ("q_scale", "k_scale"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            diffs.append(name)
    if a.sm_scale != b.sm_scale or a.max_qo_len != b.max_qo_len:
        diffs.append("sm_scale/max_qo_len")
    return diffs
