"""Adapter for FlashMLA's dense decode on SM90, as kept by `sgl-flash-mla==1.0.0` (`use_legacy=True`).

Layout (peers.md §4): q [B, s_q, H, 576] (one query length for all requests), k_cache [blocks, 64, 1, 576] (page size
64 only), block_table [B, max_blocks] int32, cache_seqlens [B] int32; out [B, s_q, H, 512], lse [B, H, s_q] fp32
natural log. The schedule is computed on the GPU on first use (bf16) or by `get_mla_decoding_metadata` (dense fp8).

Conventions handled here:
- A batch with another page size is repaged into 64-token pages (a copy; `repage`).
- Varlen MTP: q is padded to [B, s_q_max, H, D] with each request's rows at the *end* of its slot and zero rows in
  front (`padded_rows`). FlashMLA's causal rule (row r of s_q sees s_k - s_q + r + 1 tokens, causal=True when
  s_q > 1) then gives every real row exactly the contract's visibility; the dummy rows are computed and dropped.
- lse [B, H, s_q] -> [T, H]; a row that sees no token comes back as lse = +inf (FlashMLA's "lonely q"), converted to
  this package's -inf.
- bf16 (or fp16) q with a cache of the same dtype -> dense kernel. fp8 q with an fp8 e4m3fn cache -> the dense fp8
  kernel (FlashMLA PR #54 in the fork: fp8 QK and PV MMAs, P cast to e4m3 without a scale) with per-tensor
  descale_q / descale_k. fp8 q with a bf16 cache is sent as bf16 (exact) with q_scale folded into softmax_scale.
  e4m3fnuz is re-expressed as e4m3fn bit-exactly.

Inputs FlashMLA has no kernel for raise `mla_fast.backends.Unsupported`:
- a latent other than 512 or a rope other than 64 (MiniCPM3's 256 and 32, say);
- bf16 q with an fp8 cache (the dense fp8 kernel is fp8 x fp8);
- fp8 q or an fp8 cache of another format than e4m3fn on the dense fp8 kernel (e5m2 bytes would be read as e4m3fn;
  e4m3fnuz is converted per call and has no step);
- a request with seq_len 0 on the dense fp8 kernel: for seqlen_k = 0 its `compute_attn_1rowblock_splitkv_mla`
  starts at n_block = ceil(0 / 64) - 1 = -1 and loads the page `block_table[b][-1]`, outside request b's row (before
  the tensor for b = 0: an illegal memory access; sgl-project/FlashMLA csrc/extension/sm90/dense_fp8/
  flash_fwd_mla_kernel.h). vLLM avoids it by clamping seq_lens to >= 1 (vllm-project/vllm#35969, issue #33664),
  which changes the result, so such batches are not sent.
"""

from __future__ import annotations

import math

import torch

from mla_fast.backends import Unsupported
from mla_ref.decode import INVALID_PAGE, DecodeBatch, is_fp8

PAGE_SIZE = 64  # the only page_block_size of FlashMLA's dense decode
# what FlashMLA has no kernel for (module docstring), as `flashmla_inputs` and `FlashMLAStep` refuse it
BF16_Q_FP8_CACHE = "flashmla: bf16 q with an fp8 cache (FlashMLA's dense fp8 kernel is fp8 x fp8)"
FP8_EMPTY_REQUEST = "flashmla fp8: a request with seq_len 0 (the dense fp8 kernel reads block_table[b][-1])"
DENSE_DTYPES = "flashmla.q/kv_cache: FlashMLA's dense kernel takes both bf16 or both fp16"
FP8_FORMATS = "flashmla fp8: the dense fp8 kernel takes e4m3fn q and an e4m3fn cache (e4m3fnuz is converted per call)"
DEEPSEEK_DIMS = "flashmla: kv_lora_rank 512 and rope_dim 64 only (its kernels are built for heads of 576 / 512)"


def dims_refusal(batch: DecodeBatch) -> None:
    """Unsupported (DEEPSEEK_DIMS) unless the batch has DeepSeek's latent of 512 and rope of 64."""
    if (batch.kv_lora_rank, batch.rope_dim) != (512, 64):
        raise Unsupported(DEEPSEEK_DIMS)


def repage(batch: DecodeBatch, page_size: int = PAGE_SIZE) -> DecodeBatch:
    """A copy of `batch` with its KV in pages of `page_size` (request by request, in order; NaN in unused slots)."""
    npages = [-(-int(s) // page_size) for s in batch.seq_lens.tolist()]  # ceil per request
    total = max(sum(npages), 1)
    nan = torch.full((total, page_size, batch.head_dim), math.nan, device=batch.device)  # [P', ps', D] fp32 NaN
    cache = nan.to(batch.kv_cache.dtype)  # fp8 NaN bit pattern for fp8 dtypes
    flat = cache.view(total * page_size, batch.head_dim)  # [P' * ps', D]
    block_table = torch.full((batch.batch_size, max(npages, default=0) or 1), INVALID_PAGE, dtype=torch.int32)
    first = 0
    for b in range(batch.batch_size):
        pages, slots = batch.token_slots(b)  # [s_b], [s_b]
        flat[first * page_size : first * page_size + pages.shape[0]] = batch.kv_cache[pages, slots]
        block_table[b, : npages[b]] = torch.arange(first, first + npages[b], dtype=torch.int32)
        first += npages[b]
    return batch.replace(kv_cache=cache, block_table=block_table.to(batch.device)).validate()


def padded_rows(q_lens: torch.Tensor, s_q: int | None = None) -> tuple[torch.Tensor, int]:
    """Where the T real query rows go in FlashMLA's [B, s_q] grid of query rows (s_q: the largest q_len, or a given
    s_q at least that large, as a graph step's fixed grid).

    Returns (index [T] int64 into the flattened B * s_q grid, s_q): row r of request b (q_len n_b) goes to
    b * s_q + (s_q - n_b) + r, the end of b's slot, so its row position in the grid sees
    s_k - s_q + (s_q - n_b + r) + 1 = s_k - n_b + r + 1 tokens under FlashMLA's causal rule: the contract's.
    """
    q_lens = q_lens.long()  # [B]
    s_q = s_q or (int(q_lens.max()) if q_lens.numel() else 1)
    request = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens)  # [T]
    first = torch.cumsum(q_lens, 0) - q_lens  # [B] first row of each request in q
    r = torch.arange(request.shape[0], device=q_lens.device) - first[request]  # [T] row inside its request
    return request * s_q + (s_q - q_lens[request]) + r, s_q


def _fp8_args(q_scale: float, kv_scale: float, device: torch.device) -> dict:
    """flash_mla_with_kvcache's keyword arguments of the dense fp8 kernel: its per-tensor descales."""
    return {"is_fp8_kvcache": True,
            "descale_q": torch.tensor([q_scale], dtype=torch.float32, device=device),
            "descale_k": torch.tensor([kv_scale], dtype=torch.float32, device=device)}


def _real_rows(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, empty: torch.Tensor):
    """FlashMLA's (out [B, s_q, H, 512], lse [B, H, s_q]) at the real query rows ``rows`` [T] of the grid -> (out
    [T, H, 512], lse [T, H]), lse -inf where ``empty`` [T, 1] (the row sees no token: FlashMLA's lonely q is +inf)."""
    B, s_q, H, _ = out.shape
    out = out.reshape(B * s_q, H, -1)[rows]  # [B * s_q, H, 512] -> [T, H, 512]
    lse = lse.permute(0, 2, 1).reshape(B * s_q, H)[rows]  # [B, H, s_q] -> [B * s_q, H] -> [T, H]
    return out, torch.where(empty & torch.isposinf(lse), -math.inf, lse)


def flashmla_inputs(batch: DecodeBatch) -> dict:
    """flash_mla_with_kvcache arguments for `batch` (see module docstring), plus "rows" ([T] positions of the real
    rows in the flattened [B * s_q] outputs). Unsupported for inputs FlashMLA has no kernel for."""
    batch.validate()
    dims_refusal(batch)
    if batch.page_size != PAGE_SIZE:
        batch = repage(batch, PAGE_SIZE)
    rows, s_q = padded_rows(batch.q_lens)  # [T], s_q_max
    q_bytes = batch.q.contiguous().view(torch.uint8)  # [T, H, D * itemsize]: index_put for every dtype, fp8 too
    grid = q_bytes.new_zeros(batch.batch_size * s_q, *q_bytes.shape[1:])  # [B * s_q, H, D * itemsize]
    grid[rows] = q_bytes  # real rows at the end of each request's slot, zero rows in front
    q_grid = grid.view(batch.q.dtype)  # [B * s_q, H, D]
    uniform = torch.full_like(batch.q_lens, s_q)  # [B]
    layout = batch.replace(q=q_grid, q_lens=uniform).to_flashmla()
    q, kv = layout["q"], layout["k_cache"]  # [B, s_q, H, D], [P, 64, 1, D]
    q_scale, kv_scale, sm_scale = batch.q_scale, batch.kv_scale, float(batch.sm_scale)
    if q.dtype == torch.float8_e4m3fnuz or kv.dtype == torch.float8_e4m3fnuz:
        from mla_fast.aiter_backend import e4m3fnuz_to_fn

        if q.dtype == torch.float8_e4m3fnuz:
            q, q_scale = e4m3fnuz_to_fn(q, q_scale)
        if kv.dtype == torch.float8_e4m3fnuz:
            kv, kv_scale = e4m3fnuz_to_fn(kv, kv_scale)
    fp8_kv = is_fp8(kv.dtype)
    if fp8_kv and kv.dtype != torch.float8_e4m3fn:
        raise Unsupported("flashmla.kv_cache: FlashMLA's fp8 cache is e4m3fn (or e4m3fnuz, converted)")
    if fp8_kv and not is_fp8(q.dtype):
        raise Unsupported(BF16_Q_FP8_CACHE)
    if fp8_kv and q.dtype != torch.float8_e4m3fn:  # an e5m2 q would be read as e4m3fn bytes
        raise Unsupported(FP8_FORMATS)
    if fp8_kv and batch.batch_size and int(batch.seq_lens.min()) == 0:
        raise Unsupported(FP8_EMPTY_REQUEST)
    if is_fp8(q.dtype) and not fp8_kv:
        q, sm_scale = q.float().to(kv.dtype), sm_scale * q_scale  # exact: e4m3 values fit bf16/fp16
    if not fp8_kv and (kv.dtype not in (torch.bfloat16, torch.float16) or q.dtype != kv.dtype):
        raise Unsupported(DENSE_DTYPES)
    block_table = layout["block_table"]  # [B, max_blocks]
    if fp8_kv:  # the dense fp8 kernel (FlashMLA PR #54) may read entries past seq_len: point them at page 0
        block_table = torch.where(batch.used_entries, block_table, 0)
    return {
        "q": q.contiguous(),
        "k_cache": kv,
        "block_table": block_table,
        "cache_seqlens": layout["cache_seqlens"],
        "head_dim_v": layout["head_dim_v"],
        "softmax_scale": sm_scale,
        "causal": layout["causal"],
        "descale": (q_scale, kv_scale) if fp8_kv else None,
        "rows": rows,
    }


def flashmla_decode(batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Run FlashMLA dense decode on `batch` -> (out [T, H, 512] bf16, lse [T, H] fp32 natural log, empty rows -inf)."""
    import flash_mla

    a = flashmla_inputs(batch)
    B, s_q, H, _ = a["q"].shape
    meta, _ = flash_mla.get_mla_metadata()  # empty schedule, filled on first use
    extra = {}
    if a["descale"] is not None:
        tile_md, num_splits = flash_mla.get_mla_decoding_metadata(
            a["cache_seqlens"], s_q * H, 1, is_fp8_kvcache=True, use_legacy=True
        )
        meta.tile_scheduler_metadata, meta.num_splits = tile_md, num_splits
        extra = _fp8_args(*a["descale"], batch.device)
    out, lse = flash_mla.flash_mla_with_kvcache(
        a["q"],
        a["k_cache"],
        a["block_table"],
        a["cache_seqlens"],
        a["head_dim_v"],
        meta,
        None,
        softmax_scale=a["softmax_scale"],
        causal=a["causal"],
        use_legacy=True,
        **extra,
    )
    return _real_rows(out, lse, a["rows"], (batch.visible_tokens() == 0)[:, None])


class FlashMLAStep:
    """FlashMLA's dense decode as a serving loop runs it in a CUDA graph (the plug-in contract's step, verify's step
    check): built once for the batch's shapes (a [B * s_q, H, D] query grid with s_q = max_q_len, its row index,
    the scheduler's metadata and, for fp8, the block table it reads), `plan(batch)` eagerly on the batch's current
    lengths (FlashMLA's scheduler, `get_mla_decoding_metadata`, whose result is copied into the step's metadata
    tensors, as vLLM's FlashMLA backend does between replays), `run()` launches only: the query rows scattered into
    the grid, the decode on the batch's cache, block table and seq_lens in place, the real rows gathered. A
    `FlashMLASchedMeta` filled by a first call and reused keeps that call's schedule: the stale-plan bug the step
    check catches. Pages of 64 and the dtypes FlashMLA takes as they are: the conversions `flashmla_inputs` makes
    per call (repaging, e4m3fnuz, fp8 q on a bf16 cache) have no step (Unsupported, named)."""

    def __init__(self, batch: DecodeBatch, max_q_len: int):
        import flash_mla

        q, kv = batch.q.dtype, batch.kv_cache.dtype
        dims_refusal(batch)
        if batch.page_size != PAGE_SIZE:
            raise Unsupported(f"flashmla step: pages of {PAGE_SIZE} only (others are repaged per call)")
        if torch.float8_e4m3fnuz in (q, kv) or (is_fp8(q) and not is_fp8(kv)):
            raise Unsupported("flashmla step: e4m3fnuz, or fp8 q on a 16-bit cache (converted per call)")
        self.fp8 = is_fp8(kv)
        if self.fp8 and not is_fp8(q):
            raise Unsupported(BF16_Q_FP8_CACHE)
        if self.fp8 and (q, kv) != (torch.float8_e4m3fn, torch.float8_e4m3fn):  # e5m2 bytes read as e4m3fn
            raise Unsupported(FP8_FORMATS)
        if not self.fp8 and (kv not in (torch.bfloat16, torch.float16) or q != kv):
            raise Unsupported(DENSE_DTYPES)
        B, H, D, dev = batch.batch_size, batch.num_heads, batch.head_dim, batch.device
        self.batch, self.s_q = batch, max_q_len
        self.grid = torch.zeros(B * max_q_len, H, D * batch.q.element_size(), dtype=torch.uint8, device=dev)
        self.rows = torch.zeros(batch.num_tokens, dtype=torch.int64, device=dev)  # [T] grid row of each q row
        self.empty = torch.zeros(batch.num_tokens, 1, dtype=torch.bool, device=dev)  # [T, 1] rows that see nothing
        self.block_table = batch.block_table.clone() if self.fp8 else batch.block_table  # fp8: entries past seq_len
        self.meta = flash_mla.get_mla_metadata()[0]  # its tensors: the step's, filled by plan()
        self.extra = _fp8_args(batch.q_scale, batch.kv_scale, dev) if self.fp8 else {}
        self.planned = False

    def plan(self, batch: DecodeBatch) -> None:
        import flash_mla

        if batch is not self.batch:
            raise ValueError("plan: batch must be the step's own (refill its tensors in place)")
        batch.validate()
        if self.fp8 and batch.batch_size and int(batch.seq_lens.min()) == 0:
            raise Unsupported(FP8_EMPTY_REQUEST)
        if batch.batch_size and int(batch.q_lens.max()) > self.s_q:
            raise ValueError(f"plan: q_lens must be <= the step's max_q_len {self.s_q}, got {batch.q_lens.tolist()}")
        rows, s_q = padded_rows(batch.q_lens, self.s_q)  # [T] in the step's fixed grid
        self.rows.copy_(rows)
        self.empty.copy_((batch.visible_tokens() == 0)[:, None])
        if self.fp8:  # the dense fp8 kernel may read entries past seq_len: point them at page 0
            self.block_table.copy_(torch.where(batch.used_entries, batch.block_table, 0))
        tile_md, num_splits = flash_mla.get_mla_decoding_metadata(
            batch.seq_lens, s_q * batch.num_heads, 1, is_fp8_kvcache=self.fp8, use_legacy=True)
        if self.meta.tile_scheduler_metadata is None:
            self.meta.tile_scheduler_metadata, self.meta.num_splits = tile_md.clone(), num_splits.clone()
        else:  # in place: a captured graph reads these tensors
            self.meta.tile_scheduler_metadata.copy_(tile_md)
            self.meta.num_splits.copy_(num_splits)
        self.planned = True

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        import flash_mla

        if not self.planned:
            raise RuntimeError("run() before plan()")
        b = self.batch
        B, H = b.batch_size, b.num_heads
        self.grid.zero_()
        self.grid[self.rows] = b.q.view(torch.uint8).view(b.num_tokens, H, -1)  # real rows at each slot's end
        q = self.grid.view(b.q.dtype).view(B, self.s_q, H, b.head_dim)  # [B, s_q, H, D]
        out, lse = flash_mla.flash_mla_with_kvcache(
            q, b.kv_cache.unsqueeze(2), self.block_table, b.seq_lens, b.kv_lora_rank, self.meta, None,
            softmax_scale=float(b.sm_scale), causal=self.s_q > 1, use_legacy=True, **self.extra)
        return _real_rows(out, lse, self.rows, self.empty)
