"""Adapter for FlashInfer's `BatchMLAPagedAttentionWrapper` (FA3 backend, SM90), flashinfer-python 0.6.14.

Layout (peers.md §5): split NoPE/RoPE tensors `q_nope [T, H, L]`, `q_pe [T, H, R]`, `ckv [P, ps, L]`, `kpe [P, ps, R]`
(strided views of the DecodeBatch; the kernel takes strides), pages in CSR form (`kv_indptr`, `kv_indices`), any page
size. `plan()` runs FlashInfer's host-side scheduler (one device->host copy of the indptrs); the FA3 module
JIT-compiles on first use (~20 s, cached in ~/.cache/flashinfer).

Conventions handled here:
- LSE: FlashInfer returns base 2 unless `return_lse_base_on_e=True` (0.6.14 has it): asked for natural log.
- MTP: `causal=True` when any request has more than one query row (FlashInfer aligns the causal diagonal to the end
  of the KV, the s_k - s_q diagonal of the contract).
- fp8 KV (e4m3fn only; fa3 on SM90; q must be bf16): `ckv_scale = kpe_scale = kv_scale`. The kernel dequantizes a
  tile as bf16(fp8 * bf16(scale)) (`__hmul2` in mla_hopper.cuh), so operands are exact only when the products are
  (e.g. a power-of-two scale); otherwise they carry one bf16 rounding each.
- fp8 q (FlashInfer has no fp8-q MLA path): sent as bf16 (every e4m3 value is exact in bf16) with q_scale folded
  into sm_scale, which leaves the scores unchanged.
- e4m3fnuz inputs are re-expressed as e4m3fn bit-exactly (`aiter_backend.e4m3fnuz_to_fn`).
"""

from __future__ import annotations

import torch

from mla_ref.decode import DecodeBatch, is_fp8

WORKSPACE_BYTES = 256 * 1024 * 1024  # float workspace of the wrapper (peers.md measured with 256 MB)
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        _WORKSPACES[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.int8, device=device)
    return _WORKSPACES[device]


def flashinfer_inputs(batch: DecodeBatch) -> dict:
    """The wrapper's plan()/run() arguments for `batch` (see module docstring); ValueError for unsupported dtypes."""
    batch.validate()
    layout = batch.to_flashinfer()
    q, kv, sm_scale = batch.q, batch.kv_cache, float(batch.sm_scale)
    kv_scale = batch.kv_scale
    if kv.dtype == torch.float8_e4m3fnuz:
        from mla_fast.aiter_backend import e4m3fnuz_to_fn

        kv, kv_scale = e4m3fnuz_to_fn(kv, kv_scale)
    if kv.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise ValueError(f"flashinfer.kv_cache: expected bf16, fp16 or fp8 e4m3fn, got {kv.dtype}")
    q_dtype = torch.bfloat16 if is_fp8(kv.dtype) else kv.dtype  # fp8 KV takes bf16 q only
    if is_fp8(q.dtype):
        q, sm_scale = q.float().to(q_dtype), sm_scale * batch.q_scale  # exact: e4m3 values fit bf16/fp16
    if q.dtype != q_dtype:
        raise ValueError(f"flashinfer.q: expected {q_dtype} with a {kv.dtype} cache, got {q.dtype}")
    L = batch.kv_lora_rank
    return {
        "qo_indptr": layout["qo_indptr"],  # [B+1]
        "kv_indptr": layout["kv_indptr"],  # [B+1] in pages
        "kv_indices": layout["kv_indices"],  # [Σ pages]
        "kv_len_arr": layout["kv_len_arr"],  # [B]
        "q_nope": q[..., :L],  # [T, H, L] strided view
        "q_pe": q[..., L:],  # [T, H, R]
        "ckv_cache": kv[..., :L],  # [P, ps, L]
        "kpe_cache": kv[..., L:],  # [P, ps, R]
        "sm_scale": sm_scale,
        "q_dtype": q_dtype,
        "kv_dtype": kv.dtype,
        "kv_scale": kv_scale if is_fp8(kv.dtype) else None,
        "causal": bool(batch.batch_size) and int(batch.q_lens.max()) > 1,
    }


def flashinfer_decode(batch: DecodeBatch, backend: str = "fa3") -> tuple[torch.Tensor, torch.Tensor]:
    """Run FlashInfer MLA decode on `batch` -> (out [T, H, L] in q's 16-bit dtype, lse [T, H] fp32 natural log)."""
    import flashinfer

    a = flashinfer_inputs(batch)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(batch.device), backend=backend)
    wrapper.plan(
        a["qo_indptr"],
        a["kv_indptr"],
        a["kv_indices"],
        a["kv_len_arr"],
        batch.num_heads,
        batch.kv_lora_rank,
        batch.rope_dim,
        batch.page_size,
        a["causal"],
        a["sm_scale"],
        a["q_dtype"],
        a["kv_dtype"],
    )
    scales = {} if a["kv_scale"] is None else {"ckv_scale": a["kv_scale"], "kpe_scale": a["kv_scale"]}
    out, lse = wrapper.run(
        a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"], return_lse=True, return_lse_base_on_e=True, **scales
    )
    return out, lse
