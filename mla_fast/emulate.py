"""CPU emulation of a persistent split-KV MLA decode: run a WorkPlan with torch ops, as the kernel would.

Every work item of the plan is executed on dequantized inputs in ``dtype`` (fp32 by default, as a kernel
accumulates): for its q rows r, heads h and KV tokens j in ``[kv_start, kv_end)``

    s_j  = sm_scale · <q[r, h], K_j>                        masked to the MTP diagonal: j < seq_len - q_len + r + 1
    m    = max_j s_j,   l = Σ_j exp(s_j - m)
    o    = Σ_j exp(s_j - m) · K_j[:L] / l                   normalised per split
    lse  = m + ln l                                         natural log; a row with no visible token: o 0, lse -inf

An unsplit item (PARTIAL_ROW = -1) writes (o, lse) to (out, lse) directly; a split item writes the partial
workspace rows ``PARTIAL_ROW + r`` (heads of its group). Then each tile with a non-empty reduce range merges its
partial rows in KV order (max-shifted, as aiter's ``mla_reduce_v1``)::

    M = max_S lse_S,   lse = M + ln Σ_S exp(lse_S - M),   out = Σ_S exp(lse_S - lse) · o_S

with -inf partial LSEs empty (weight 0) and an all-empty merge giving out 0, lse -inf. A NaN partial (a NaN in a
valid input, or a workspace row the plan never wrote: the workspace starts as NaN) is not empty: the merged row is
NaN, as the kernels' reduce gives it.

KV rows are gathered through the block table, token by token, only inside ``[kv_start, kv_end)``: unused cache
slots (NaN in built batches) are never read. Items are batched by gathering their KV into a zero-padded
``[items, max_len, L+R]`` tensor, a chunk of about ``CHUNK_TOKENS`` padded tokens at a time (items sorted by
length, so padding stays small). Only the items of the workers' ranges (``worker_indptr``) run, as on the device.
``out`` and ``lse`` start as NaN, so a (row, head) the plan never writes shows up.
"""

from __future__ import annotations

import math

import torch

from mla_fast.planner import (
    BATCH,
    HEAD_END,
    HEAD_START,
    KV_END,
    KV_START,
    PARTIAL_ROW,
    QO_END,
    QO_START,
    WorkPlan,
    check_plan,
)
from mla_ref.decode import DecodeBatch, is_fp8
from mla_ref.fp8 import widen

CHUNK_TOKENS = 8192  # padded KV tokens (or reduce rows x splits) per batched step


def run_plan_reference(
    batch: DecodeBatch, plan: WorkPlan, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute ``plan`` on ``batch`` with torch ops in ``dtype`` (fp32 or fp64), then reduce through the plan's
    reduce map.

    Returns:
        out [T, H, L] and lse [T, H] (natural log, sm_scale included), both in ``dtype``.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64 (the emulation's arithmetic), got {dtype}")
    batch.validate()
    check_plan(plan, batch.seq_lens, batch.q_lens, batch.num_heads)
    device, L, H = batch.device, batch.kv_lora_rank, batch.num_heads
    q = batch.dequantized_q(dtype)  # [T, H, L+R]
    out = torch.full((batch.num_tokens, H, L), math.nan, dtype=dtype, device=device)  # [T, H, L]
    lse = torch.full((batch.num_tokens, H), math.nan, dtype=dtype, device=device)  # [T, H]
    ws_o = torch.full((plan.num_partial_rows, H, L), math.nan, dtype=dtype, device=device)  # [rows, H, L]
    ws_lse = torch.full((plan.num_partial_rows, H), math.nan, dtype=dtype, device=device)  # [rows, H]

    items = plan.work_items.to(device).long()  # [N, 8]
    indptr = plan.worker_indptr.cpu().long()  # [W + 1] worker w runs items [indptr[w], indptr[w + 1])
    ran = torch.zeros(items.shape[0], dtype=torch.bool)  # [N]
    for w in range(plan.num_workers):
        ran[indptr[w] : indptr[w + 1]] = True
    items = items[ran.to(device)]  # [N'] items no worker runs are never executed
    kv_len = items[:, KV_END] - items[:, KV_START]  # [N]
    order = torch.sort(kv_len, descending=True, stable=True).indices  # longest first: chunks of similar length
    for chunk in _chunks(kv_len[order].tolist()):
        _run_items(batch, q, items[order[chunk]], out, lse, ws_o, ws_lse, dtype)
    _reduce(plan, out, lse, ws_o, ws_lse)
    return out, lse



def _chunks(lengths: list[int]) -> list[slice]:
    """Cut a descending list of lengths into runs of about CHUNK_TOKENS padded tokens (the first is the longest)."""
    runs, i = [], 0
    while i < len(lengths):
        n = max(1, CHUNK_TOKENS // max(1, lengths[i]))
        runs.append(slice(i, i + n))
        i += n
    return runs


def _gather_kv(batch: DecodeBatch, req: torch.Tensor, kv_start: torch.Tensor, kv_len: torch.Tensor, dtype):
    """[n, Tm, L+R] the dequantized cache rows of tokens kv_start + t (t < kv_len), zeros after; valid mask [n, Tm].

    Padding positions re-read the first token of the chunk's longest item (never an unused slot), then are zeroed.
    """
    n, Tm = kv_len.numel(), max(1, int(kv_len.max()))
    t = torch.arange(Tm, device=batch.device)  # [Tm]
    valid = t[None, :] < kv_len[:, None]  # [n, Tm]
    if not bool(valid.any()):
        return torch.zeros(n, Tm, batch.head_dim, dtype=dtype, device=batch.device), valid
    longest = int(torch.argmax(kv_len))
    pos = torch.where(valid, kv_start[:, None] + t, kv_start[longest])  # [n, Tm] token positions inside requests
    req = torch.where(valid, req[:, None], req[longest])  # [n, Tm]
    page = batch.block_table.long()[req, pos // batch.page_size].flatten()  # [n * Tm] pages of valid tokens only
    slot = (pos % batch.page_size).flatten()  # [n * Tm] their slots
    kv = widen(batch.kv_cache[page, slot], dtype)  # [n * Tm, L+R] gather (any strides), convert
    if is_fp8(batch.kv_cache.dtype):
        kv = kv * batch.kv_scale
    kv.index_fill_(0, torch.nonzero(~valid.flatten()).flatten(), 0.0)  # padding: zeros
    return kv.view(n, Tm, -1), valid


def _run_items(batch, q, items, out, lse, ws_o, ws_lse, dtype) -> None:
    """Run work items [n, 8] (one head-group size) and write their (o, lse) to out/lse or the workspace."""
    L = batch.kv_lora_rank
    req, kv_start, kv_end = items[:, BATCH], items[:, KV_START], items[:, KV_END]  # [n]
    qo_start, n_rows = items[:, QO_START], items[:, QO_END] - items[:, QO_START]  # [n]
    Hg = int(items[0, HEAD_END] - items[0, HEAD_START])
    heads = items[:, HEAD_START, None] + torch.arange(Hg, device=q.device)  # [n, Hg]

    # q rows of each item, padded to the longest: [n, Rm, Hg, L+R]
    r = torch.arange(int(n_rows.max()), device=q.device)  # [Rm]
    row_ok = r[None, :] < n_rows[:, None]  # [n, Rm]
    row = torch.where(row_ok, qo_start[:, None] + r, qo_start[:, None])  # [n, Rm] global q rows (pad: repeat)
    q_item = q[row[:, :, None], heads[:, None, :]]  # [n, Rm, Hg, L+R]

    kv, kv_ok = _gather_kv(batch, req, kv_start, kv_end - kv_start, dtype)  # [n, Tm, L+R], [n, Tm]
    pos = kv_start[:, None] + torch.arange(kv.shape[1], device=q.device)  # [n, Tm] token positions

    # MTP diagonal: row r_req of request b sees tokens < seq_len - q_len + r_req + 1
    qo_req = batch.qo_indptr.long()[req]  # [n] first q row of the request
    seq, q_len = batch.seq_lens.long()[req], batch.q_lens.long()[req]  # [n], [n]
    visible = seq[:, None] - q_len[:, None] + (row - qo_req[:, None]) + 1  # [n, Rm]
    mask = kv_ok[:, None, :] & (pos[:, None, :] < visible[:, :, None]) & row_ok[:, :, None]  # [n, Rm, Tm]

    s = batch.sm_scale * torch.einsum("nrhd,ntd->nrht", q_item, kv)  # [n, Rm, Hg, Tm]
    s = s.masked_fill(~mask[:, :, None, :], -math.inf)
    seen = mask.any(dim=-1)[:, :, None]  # [n, Rm, 1] rows that see at least one token of this item
    m = torch.where(seen, s.amax(dim=-1), 0.0)  # [n, Rm, Hg] block max (0 where nothing is seen)
    p = torch.exp(s - m[..., None])  # [n, Rm, Hg, Tm] unnormalised, exp(-inf) = 0
    l = p.sum(dim=-1)  # [n, Rm, Hg]
    o = torch.einsum("nrht,ntc->nrhc", p, kv[..., :L]) / torch.where(seen, l, 1.0)[..., None]  # [n, Rm, Hg, L]
    o_lse = torch.where(seen, m + torch.log(l), -math.inf)  # [n, Rm, Hg]

    # write: unsplit items to out/lse at their q rows, split items to workspace rows PARTIAL_ROW + r
    partial = items[:, PARTIAL_ROW]  # [n]
    for to_ws, dst_o, dst_lse in ((False, out, lse), (True, ws_o, ws_lse)):
        sel = row_ok & ((partial >= 0) == to_ws)[:, None]  # [n, Rm]
        dst_row = (partial[:, None] + r) if to_ws else row  # [n, Rm]
        idx = (dst_row[sel][:, None], heads[:, None, :].expand(-1, r.numel(), -1)[sel])  # [K, 1], [K, Hg]
        dst_o[idx] = o[sel]  # [K, Hg, L]
        dst_lse[idx] = o_lse[sel]  # [K, Hg]


def _reduce(plan: WorkPlan, out, lse, ws_o, ws_lse) -> None:
    """Merge the partial rows of every tile with a non-empty reduce range into out/lse (max-shifted LSE merge)."""
    device = out.device
    indptr = plan.reduce_indptr.to(device).long()  # [tiles + 1]
    pmap = plan.reduce_partial_map.to(device).long()  # [M]
    final = plan.reduce_final.to(device).long()  # [tiles, 8]: qo_start, qo_end, head_start, head_end, ...
    n_split = torch.diff(indptr)  # [tiles]
    tiles = torch.nonzero(n_split > 0).flatten()  # [t] tiles that need a reduce
    if tiles.numel() == 0:
        return
    n_rows = final[tiles, 1] - final[tiles, 0]  # [t]
    tile = tiles.repeat_interleave(n_rows)  # [K] one entry per (tile, q row)
    r = torch.arange(tile.numel(), device=device) - torch.repeat_interleave(torch.cumsum(n_rows, 0) - n_rows, n_rows)
    Sm, Hg = int(n_split.max()), plan.head_group
    step = max(1, CHUNK_TOKENS // Sm)
    for k in range(0, tile.numel(), step):
        tk, rk = tile[k : k + step], r[k : k + step]  # [K], [K]
        j = torch.arange(Sm, device=device)  # [Sm]
        ok = j[None, :] < n_split[tk, None]  # [K, Sm]
        src = pmap[torch.where(ok, indptr[tk, None] + j, 0)] + rk[:, None]  # [K, Sm] workspace rows
        heads = final[tk, 2, None] + torch.arange(Hg, device=device)  # [K, Hg]
        lse_s = ws_lse[src[:, :, None], heads[:, None, :]]  # [K, Sm, Hg]
        lse_s = torch.where(ok[:, :, None], lse_s, -math.inf)  # padding: empty; NaN stays NaN
        M = lse_s.amax(dim=1)  # [K, Hg] NaN if a piece is NaN (amax propagates it)
        empty = torch.isneginf(M)  # [K, Hg] no split saw a token
        M = torch.where(empty, 0.0, M)
        lse_k = torch.where(empty, -math.inf, M + torch.log(torch.exp(lse_s - M[:, None]).sum(dim=1)))  # [K, Hg]
        w = torch.exp(lse_s - torch.where(empty, 0.0, lse_k)[:, None])  # [K, Sm, Hg] weights, 0 for empty splits
        o_s = ws_o[src[:, :, None], heads[:, None, :]]  # [K, Sm, Hg, L]
        o_k = (w[..., None] * torch.where(w[..., None] > 0, o_s, 0.0)).sum(dim=1)  # [K, Hg, L] empty: 0
        dst = (final[tk, 0] + rk)[:, None]  # [K, 1] q rows
        out[dst, heads] = o_k
        lse[dst, heads] = lse_k
