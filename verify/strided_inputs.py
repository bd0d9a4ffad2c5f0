"""A batch's inputs as strided views into larger NaN-filled buffers (the ``layout`` check,
`verify.checks.check_layout`).

The decode contract (mla_ref/decode.py) takes q, the cache and the block table as tensors with strides, and serving
engines pass views: vLLM's block table is the first rows of a persistent [max_reqs, max_blocks] buffer, its cache
a view of one allocation, q a slice of a larger activation. Every batch a campaign draws is contiguous, so a kernel
that computes addresses from shapes instead of strides (a flat [pages x page_size, D] view of the cache, a block
table row of ceil(max_seq / page_size) entries) passes every other check. `strided_batch` keeps every value and
changes every stride but the channels':

    q            [T, H, D]        view of [T + 1, H + 1, D + 64] from its row 1: padded head and row strides
    kv_cache     [P + 1, ps, D]   view of [P + 2, ps + 1, D + 64] from its page 1: padded row and page strides;
                                  page P of the view (unowned) holds NaN
    block_table  [B, W]           view of [B + 1, W + 3] from its row 1: the row stride padded, the padding naming
                                  page P

Each view starts one row or page into its buffer (a kernel that drops the storage offset reads the padding), and
every byte outside the views, and unused cache slots as before, hold NaN (fp8: the format's NaN code), so a kernel
that reads through a wrong stride or offset reads NaN or another request's tokens. The oracle is the same (the same
values); TMA and vector loads keep their alignment (D + 64 channels: 1280 bytes of bf16, 640 of fp8).

Every batch a campaign builds has its pages in a random order (`make_decode_batch`), while an allocator mostly gives
a request consecutive pages: `pages_in_use_order` renumbers them so that each request's pages are consecutive and in
order, which the layout check applies first (a kernel's fast path for consecutive pages runs there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_ref.decode import DecodeBatch

CHANNEL_PAD = 64  # channels of NaN after each q and cache row (keeps rows a multiple of 16 bytes)
TABLE_PAD = 3  # block-table entries after each row, holding the NaN page


@dataclass(frozen=True)
class StridedBatch:
    """A strided copy of a batch and the buffers behind its views.

    Attributes:
        batch: the `DecodeBatch` (the input's values, lengths, scales; q, kv_cache and block_table strided).
        buffers: name -> the whole buffer each of those three views lies in (their padding included), so that a
            write into the padding can be seen.
    """

    batch: DecodeBatch
    buffers: dict[str, torch.Tensor]

    def describe(self) -> str:
        b = self.batch
        return (f"q, kv_cache and block_table as views into NaN-padded buffers (strides q {tuple(b.q.stride())}, "
                f"kv_cache {tuple(b.kv_cache.stride())}, block_table {tuple(b.block_table.stride())})")


def pages_in_use_order(batch: DecodeBatch) -> DecodeBatch:
    """``batch`` with its cache pages renumbered in the order the requests first use them (request by request, page
    by page: the block table's used entries row-major), the pages no request uses after them in their order: each
    request's pages are consecutive and ascending unless it shares a page with an earlier request. Every token keeps
    its value, its logical page and slot, so the oracle's answer is the same; unused block-table entries are kept."""
    P = batch.kv_cache.shape[0]
    used = batch.block_table[batch.used_entries].long()  # [U] row-major
    first = torch.full((P,), used.numel(), dtype=torch.long, device=used.device)  # [P] first use (U: none)
    first.scatter_reduce_(0, used, torch.arange(used.numel(), device=used.device), reduce="amin")
    order = torch.sort(first, stable=True).indices  # [P] new page i holds old page order[i]
    new_id = torch.empty_like(order)
    new_id[order] = torch.arange(P, device=order.device)  # [P] old page -> new page
    table = batch.block_table.long().clamp(0, P - 1)  # [B, W] (unused entries may hold anything)
    table = torch.where(batch.used_entries, new_id[table].to(batch.block_table.dtype), batch.block_table)  # [B, W]
    return batch.replace(kv_cache=batch.kv_cache[order], block_table=table)


def _nan_filled(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(shape, dtype=like.dtype, device=like.device)
    return buf.fill_(float("nan"))  # the format's NaN code (e4m3fnuz: 0x80)


def strided_batch(batch: DecodeBatch) -> StridedBatch:
    """``batch`` with q, kv_cache and block_table copied into strided views (module docstring); seq_lens and
    q_lens stay as they are. The kernel-visible values are those of ``batch``: the oracle's answer is the same."""
    T, H, D = batch.q.shape
    P, ps, _ = batch.kv_cache.shape
    B, W = batch.block_table.shape
    q_buf = _nan_filled((T + 1, H + 1, D + CHANNEL_PAD), batch.q)  # [T + 1, H + 1, D + 64]
    q = q_buf[1:, :H, :D]  # [T, H, D] strides ((H + 1)(D + 64), D + 64, 1), from row 1
    q.copy_(batch.q)
    kv_buf = _nan_filled((P + 2, ps + 1, D + CHANNEL_PAD), batch.kv_cache)  # [P + 2, ps + 1, D + 64]
    kv = kv_buf[1:, :ps, :D]  # [P + 1, ps, D] from the buffer's page 1; its page P stays NaN
    kv[:P].copy_(batch.kv_cache)  # unused slots keep their NaN
    table_buf = torch.full((B + 1, W + TABLE_PAD), P, dtype=batch.block_table.dtype, device=batch.block_table.device)
    table = table_buf[1:, :W]  # [B, W] row stride W + 3, from row 1; the padding names the NaN page P
    table.copy_(batch.block_table)
    strided = batch.replace(q=q, kv_cache=kv, block_table=table)
    return StridedBatch(strided, {"q": q_buf, "kv_cache": kv_buf, "block_table": table_buf})
