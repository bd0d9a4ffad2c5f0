"""Scratch plug-ins for a review (delete when done)."""

from __future__ import annotations

import math

import torch

from mla_ref.decode import is_fp8
from verify.mutants import _decode, _merge


def _pages_of(batch) -> int:
    ps = batch.page_size
    return max([1] + [-(-int(s) // ps) for s in batch.seq_lens.tolist()])


def _paged(batch, mode: str = "own", visible_fn=None, sigma=None):
    """Split-KV decode with one split per page, merged by LSE. ``mode``: where the page partials live between the
    two passes: "own" (per request and page index: no bug), "first" (a workspace indexed by physical page id and
    row-in-request, written by the first request that reads the page, reused by later ones: a shared-prefix
    dedup), "last" (the same workspace, every request writes it: the last writer wins). ``visible_fn(s, n, r)`` ->
    [n] tokens each row sees (default causal MTP)."""
    L, H, ps, dev = batch.kv_lora_rank, batch.num_heads, batch.page_size, batch.device
    sigma = batch.sm_scale if sigma is None else sigma
    q = batch.q.float() * (batch.q_scale if is_fp8(batch.q.dtype) else 1.0)  # [T, H, D]
    kv_scale = batch.kv_scale if is_fp8(batch.kv_cache.dtype) else 1.0
    T = batch.num_tokens
    out = torch.zeros(T, H, L, dtype=torch.float32, device=dev)
    lse = torch.full((T, H), -math.inf, dtype=torch.float32, device=dev)
    qo = batch.qo_indptr.tolist()
    seq_lens, q_lens = batch.seq_lens.tolist(), batch.q_lens.tolist()
    R = max(q_lens, default=1)
    P = batch.num_pages
    ws_o = torch.zeros(P, R, H, L, device=dev)
    ws_l = torch.full((P, R, H), -math.inf, device=dev)
    written = torch.zeros(P, R, dtype=torch.bool, device=dev)
    own = {}
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        n_pages = -(-s // ps)
        if n_pages == 0:
            continue
        pages = batch.block_table[b, :n_pages].long()  # [np]
        K = batch.kv_cache[pages].float() * kv_scale  # [np, ps, D]
        pos = torch.arange(n_pages * ps, device=dev).view(n_pages, ps)  # [np, ps]
        K = torch.where((pos < s)[..., None], K, 0.0)
        rows = q[qo[b]: qo[b + 1]]  # [n, H, D]
        r = torch.arange(n, device=dev)
        visible = (s - n + r + 1).clamp(0, s) if visible_fn is None else visible_fn(s, n, r)  # [n]
        sc = sigma * torch.einsum("nhd,pkd->nhpk", rows, K)  # [n, H, np, ps]
        mask = pos[None] < visible[:, None, None]  # [n, np, ps]
        sc = sc.masked_fill(~mask[:, None], -math.inf)
        m = sc.amax(-1)  # [n, H, np]
        m_safe = torch.where(torch.isinf(m), 0.0, m)
        p = torch.exp(sc - m_safe[..., None])
        l = p.sum(-1)  # [n, H, np]
        acc = torch.einsum("nhpk,pkc->nhpc", p, K[..., :L])  # [n, H, np, L]
        seen = l != 0
        o = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
        ls = torch.where(seen, m_safe + torch.log(torch.where(seen, l, 1.0)), -math.inf)
        o, ls = o.permute(2, 0, 1, 3), ls.permute(2, 0, 1)  # [np, n, H, L], [np, n, H]
        if mode == "own":
            own[b] = (o, ls)
            continue
        # one write per distinct page of the request: its first occurrence ("first") or its last ("last")
        uniq, inv = torch.unique(pages, return_inverse=True)
        idx = torch.arange(n_pages, device=dev)
        if mode == "first":
            pick = torch.full((uniq.numel(),), n_pages, device=dev).scatter_reduce(0, inv, idx, "amin")
            new = ~written[uniq, :n]  # [u, n]
            ws_o[uniq, :n] = torch.where(new[..., None, None], o[pick], ws_o[uniq, :n])
            ws_l[uniq, :n] = torch.where(new[..., None], ls[pick], ws_l[uniq, :n])
        else:
            pick = torch.full((uniq.numel(),), -1, device=dev).scatter_reduce(0, inv, idx, "amax")
            ws_o[uniq, :n] = o[pick]
            ws_l[uniq, :n] = ls[pick]
        written[uniq, :n] = True
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        n_pages = -(-s // ps)
        if n_pages == 0:
            continue
        if mode == "own":
            o, ls = own[b]
        else:
            pages = batch.block_table[b, :n_pages].long()
            o, ls = ws_o[pages, :n], ws_l[pages, :n]
        out[qo[b]: qo[b + 1]], lse[qo[b]: qo[b + 1]] = _merge(o, ls, "lse", False)
    return out.to(torch.bfloat16), lse


def paged_own(batch):
    """No bug: page partials kept per request."""
    return _paged(batch, "own")


def shared_page_first(batch):
    """Page partials in a workspace indexed by physical page id: the first request that reads a page computes it,
    later requests on the same page (a shared prefix) reuse it, with their own q never applied."""
    return _paged(batch, "first")


def shared_page_last(batch):
    """Page partials in a workspace indexed by physical page id, written by every request that reads the page:
    on a shared page the last writer wins."""
    return _paged(batch, "last")


for _f in (paged_own, shared_page_first, shared_page_last):
    _f.max_splits = _pages_of
    _f.batch_invariant = True


def causal_last_tile(batch):
    """The causal mask applied only in a request's last 64-token tile: earlier tiles read to the length."""
    def vis(s, n, r):
        v = (s - n + r + 1).clamp(0, s)
        last = 64 * ((s - 1) // 64)
        return torch.maximum(v, torch.full_like(v, min(last, s)))
    return _paged(batch, "own", visible_fn=vis)


causal_last_tile.max_splits = _pages_of


def empty_split_nan(batch):
    """A split that a row sees nothing of computes 0 / 0 (NaN partial, merged as w * o with w = 0); rows that see
    nothing at all are special-cased to out 0."""
    out, lse = _decode(batch, empty_nan=True)
    return torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(out), out), lse


def kv_scale_split_only(batch):
    """kv_scale (folded into sigma and the epilogue) forgotten on the split path: requests of more than one
    64-token block are computed without it."""
    good = _decode(batch)
    bad = _decode(batch, use_kv_scale=False)
    split = (batch.seq_lens > 64)[batch.row_request()]  # [T]
    return torch.where(split[:, None, None], bad[0], good[0]), torch.where(split[:, None], bad[1], good[1])


def sigma_bf16(batch):
    """sm_scale rounded to bf16 before the score multiply."""
    return _decode(batch, sm_scale=float(torch.tensor(batch.sm_scale).to(torch.bfloat16)))


def sigma_fp16(batch):
    """sm_scale rounded to fp16 before the score multiply."""
    return _decode(batch, sm_scale=float(torch.tensor(batch.sm_scale).to(torch.float16)))
