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
- Masking: FlashInfer's "-inf" is the finite `math::inf = 5e4` (include/flashinfer/math.cuh), written into the raw
  q.k logits before sm_scale (mla_hopper.cuh `logits_mask_`, MaskFillValue = -math::inf). A masked slot of a KV tile
  (causally hidden token, or the zero-filled tail past kv_len) keeps weight exp(sm_scale (-5e4 - max raw logit))
  instead of 0: 0 in fp32 at sm_scale ~ 0.1 (e^-6760), but ~1e-23 at sm_scale = 0.135 * 2^-7, and visible in
  rows that see one token where v = 0 exactly (the exact output is 0 there).
- fp8 q (FlashInfer has no fp8-q MLA path): sent as bf16 q8 * 2^k (exact: e4m3 values times a power of two) with
  the rest of q_scale, q_scale / 2^k in [2^-1/2, 2^1/2], folded into sm_scale (`split_q_scale`). The scores are
  unchanged and the raw logits keep the scale of a bf16 deployment, so the sentinel above stays e^-thousands.
- e4m3fnuz inputs are re-expressed as e4m3fn bit-exactly (`aiter_backend.e4m3fnuz_to_fn`).
- DeepSeek's latent of 512 and rope of 64 only (`DEEPSEEK_DIMS`, Unsupported otherwise). Measured on an H200 with
  MiniCPM3's 256 and 32 (the smoke prefix's case, fifty-seventh session): the fp8 path raises ("FP8 kv_data_type for
  MLA currently only supports head_dim_ckv=512 and head_dim_kpe=64"), the bf16 FA3 path takes them without a word
  and returns wrong rows (tier1, layout and partials 10-450x their bounds, an lse of 1.5e9), then faults with an
  illegal memory access, which under MPS took another worker's context with it.
"""

from __future__ import annotations

import math

import torch

from mla_fast.backends import Unsupported, flashinfer_refusal
from mla_ref.decode import DecodeBatch, is_fp8

WORKSPACE_BYTES = 256 * 1024 * 1024  # float workspace of the wrapper (peers.md measured with 256 MB)
DEEPSEEK_DIMS = ("flashinfer: kv_lora_rank 512 and rope_dim 64 only (its fp8 MLA raises for others; its bf16 FA3 MLA "
                 "returned wrong rows and faulted at 256 / 32, measured: mla_fast/flashinfer_backend.py)")


def dims_refusal(batch: DecodeBatch) -> None:
    """Unsupported (DEEPSEEK_DIMS) unless the batch has DeepSeek's latent of 512 and rope of 64."""
    if (batch.kv_lora_rank, batch.rope_dim) != (512, 64):
        raise Unsupported(DEEPSEEK_DIMS)


_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        _WORKSPACES[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.int8, device=device)
    return _WORKSPACES[device]


def split_q_scale(q8: torch.Tensor, q_scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """fp8 q as 16-bit: (q8 * 2^k in ``dtype`` [T, H, D], q_scale / 2^k) with 2^k the power of two nearest q_scale.

    Multiplying by a power of two is exact while the values stay in ``dtype``'s range; where they would not (fp16
    subnormals), k = 0: q8 itself (exact, every e4m3 value fits bf16 and fp16) and the whole q_scale left over.
    """
    k = round(math.log2(q_scale))
    wide = q8.float()  # [T, H, D] exact
    q = (wide * 2.0**k).to(dtype)  # [T, H, D]
    if not torch.equal(q.float(), wide * 2.0**k):
        return wide.to(dtype), q_scale
    return q, q_scale / 2.0**k


def flashinfer_inputs(batch: DecodeBatch) -> dict:
    """The wrapper's plan()/run() arguments for `batch` (see module docstring). Unsupported (named) for inputs
    FlashInfer has no kernel for: other latent or rope sizes than DeepSeek's, a cache that is not bf16, fp16 or
    e4m3fn (e5m2; e4m3fnuz is converted), q of another dtype than the cache's (bf16 with an fp8 cache)."""
    batch.validate()
    dims_refusal(batch)
    layout = batch.to_flashinfer()
    q, kv, sm_scale = batch.q, batch.kv_cache, float(batch.sm_scale)
    kv_scale = batch.kv_scale
    if kv.dtype == torch.float8_e4m3fnuz:
        from mla_fast.aiter_backend import e4m3fnuz_to_fn

        kv, kv_scale = e4m3fnuz_to_fn(kv, kv_scale)
    if kv.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise Unsupported(f"flashinfer.kv_cache: expected bf16, fp16 or fp8 e4m3fn, got {kv.dtype}")
    q_dtype = torch.bfloat16 if is_fp8(kv.dtype) else kv.dtype  # fp8 KV takes bf16 q only
    if is_fp8(q.dtype):
        q, rest = split_q_scale(q, batch.q_scale, q_dtype)  # [T, H, D] q8 * 2^k, exact
        sm_scale = sm_scale * rest
    if q.dtype != q_dtype:
        raise Unsupported(f"flashinfer.q: expected {q_dtype} with a {kv.dtype} cache, got {q.dtype}")
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


def _plan(wrapper, batch: DecodeBatch, a: dict) -> None:
    """wrapper.plan() for `batch` with its `flashinfer_inputs` ``a``."""
    wrapper.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_len_arr"], batch.num_heads,
                 batch.kv_lora_rank, batch.rope_dim, batch.page_size, a["causal"], a["sm_scale"], a["q_dtype"],
                 a["kv_dtype"])


def _scales(a: dict) -> dict:
    return {} if a["kv_scale"] is None else {"ckv_scale": a["kv_scale"], "kpe_scale": a["kv_scale"]}


class FlashInferStep:
    """The wrapper in CUDA-graph mode, as a serving loop runs it (the plug-in contract's step, verify's step check):
    built once for the batch's shapes (`use_cuda_graph=True` with its own indptr / indices / length buffers sized for
    the batch size and the block table's capacity, preallocated out and lse), `plan(batch)` eagerly on the batch's
    current lengths (FlashInfer's host scheduler, which copies the CSR arrays into those buffers), `run()` launches
    only, on views of the batch's q and cache. FlashInfer passes the causal flag and sm_scale to the kernel as launch
    arguments, which a captured graph keeps; both stay the step's: sm_scale is the batch's, and causal (some q_len
    above 1) is q's rows outnumbering the requests, fixed by the shapes. fp8 q and e4m3fnuz caches have no step:
    `flashinfer_inputs` converts them per call (fp8 q with a host-side check, the cache into a new copy, which a
    captured graph would go on reading after the next plan made another)."""

    def __init__(self, batch: DecodeBatch, max_q_len: int, backend: str = "fa3"):
        import flashinfer

        dims_refusal(batch)
        if is_fp8(batch.q.dtype):
            raise Unsupported("flashinfer step: fp8 q (converted to bf16 per call, with a host-side check)")
        if batch.kv_cache.dtype == torch.float8_e4m3fnuz:  # a captured graph would read the first call's copy
            raise Unsupported("flashinfer step: an e4m3fnuz cache (converted to e4m3fn per call, into a new copy)")
        self.batch, self.max_q_len = batch, max_q_len
        B, dev = batch.batch_size, batch.device
        self.buffers = {name: torch.zeros(n, dtype=torch.int32, device=dev) for name, n in (
            ("qo_indptr", B + 1), ("kv_indptr", B + 1), ("kv_indices", max(batch.block_table.numel(), 1)),
            ("kv_len_arr", B))}
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(dev), use_cuda_graph=True,
                                                                    backend=backend, **self.buffers)
        self.out = torch.empty(batch.num_tokens, batch.num_heads, batch.kv_lora_rank, dtype=batch.q.dtype, device=dev)
        self.lse = torch.empty(batch.num_tokens, batch.num_heads, dtype=torch.float32, device=dev)
        self.args = None  # the planned step's flashinfer_inputs

    def plan(self, batch: DecodeBatch) -> None:
        if batch is not self.batch:
            raise ValueError("plan: batch must be the step's own (refill its tensors in place)")
        if reason := flashinfer_refusal(batch):
            raise Unsupported(reason)
        self.args = flashinfer_inputs(batch)
        _plan(self.wrapper, batch, self.args)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.args is None:
            raise RuntimeError("run() before plan()")
        a = self.args
        return self.wrapper.run(a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"], out=self.out, lse=self.lse,
                                return_lse=True, return_lse_base_on_e=True, **_scales(a))


def flashinfer_decode(batch: DecodeBatch, backend: str = "fa3") -> tuple[torch.Tensor, torch.Tensor]:
    """Run FlashInfer MLA decode on `batch` -> (out [T, H, L] in q's 16-bit dtype, lse [T, H] fp32 natural log)."""
    import flashinfer

    a = flashinfer_inputs(batch)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(batch.device), backend=backend)
    _plan(wrapper, batch, a)
    return wrapper.run(a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"], return_lse=True,
                       return_lse_base_on_e=True, **_scales(a))
