"""The next decode step, written into a captured step's own buffers (the verifier's ``step`` check).

A serving engine captures one CUDA graph per batch size and replays it at every decode step: between replays it
refills the same length, block-table and q buffers in place and plans again, outside the graph, and every request
grows. A kernel that bakes the captured step into its launch (a plan computed once, a grid or loop bound sized by
the lengths of that step, a copy of q or of the cache taken when it plans) replays the old step on the new data.

`with_room(batch)` copies the batch's tensors into the step's own, with room to grow: spare cache pages (NaN) and
block-table columns. `next_layout` then writes the next step's lengths and pages, in place (before the step plans):

- the requests rotated by one: request i takes request i-1's q_len, block-table row and length, so that each
  request's work lands elsewhere in a plan;
- one request grown past twice the old longest by a page and a token (its new tokens on the spare pages): past
  any bound the step may have rounded up from the captured lengths (a power of two, whole chunks of up to the
  longest); the longest halved, and with three requests or more the one after it emptied (CUDA-graph padding sends
  empty requests);
- every cache slot that the old step used and the new one does not, NaN (the format's NaN code for fp8): a kernel
  that still reads the old lengths reads NaN.

`next_values` writes the new contents after the step has planned, as a serving step's graph produces them: q
negated (exact in every format) and fresh token values in the grown request's new slots.

`decode_layout` then writes the step after that one: the same requests in the same order, each non-empty one grown
by its q_len tokens (one plain decode step; empty ones stay empty), the pages the growth newly needs taken from the
spare ones. A plan() that takes a fast path when the same requests come back a few tokens longer (keeping the old
pieces, or work sized by the old lengths) misses just those tokens, so `decode_values` builds each new token to carry
about half of its query row's weight: token i of a request, the newest that the request's row i sees, is the
least-norm solution of sm_scale · <q_h, k> = the row's log-sum-exp over its old tokens, for every head h at once.
Random new tokens would weigh e^-12 beside a sink token, e^-240 in the shifted data, and no bound would see them
missing.
"""

from __future__ import annotations

import torch

from mla_ref.decode import INVALID_PAGE, DecodeBatch, is_fp8, mla_decode_ref
from mla_ref.fp8 import quantize

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer view of each element size


def _nan_bits(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(``t`` viewed as integers of its element size, its format's NaN code as such an integer; e4m3fnuz: 0x80): fp8
    has no fill or index_put of NaN, its bytes do."""
    bits = _BITS[t.element_size()]
    return t.view(bits), int(torch.tensor(float("nan")).to(t.dtype).view(bits))


def nan_fill_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with its format's NaN code in place (fp8 too)."""
    raw, nan = _nan_bits(t)
    raw.fill_(nan)
    return t


def grown_length(seq_lens: torch.Tensor, page_size: int) -> int:
    """The grown request's new length: past twice the longest of ``seq_lens`` [B] by a page and a token, so past
    whatever the longest rounds up to (the next power of two is at most twice it; whole chunks of at most its length
    plus a page cover less)."""
    return 2 * (int(seq_lens.max()) if seq_lens.numel() else 0) + page_size + 1


def next_lengths(seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, int]:
    """(the next step's lengths [B], the grown request) for the current ``seq_lens`` [B]: rotated by one; the
    request before the longest (the longest itself when B = 1) grown to `grown_length`; with B >= 2 the longest
    (the first of them) halved, rounded down; with B >= 3 the request after it emptied. (-1 when B = 0.)"""
    lens = seq_lens.roll(1)  # [B] request i takes request i-1's length
    B = lens.numel()
    if not B:
        return lens, -1
    longest = int(lens.argmax())
    grown = (longest - 1) % B
    if B >= 2:
        lens[longest] = lens[longest] // 2
    if B >= 3:
        lens[(longest + 1) % B] = 0
    lens[grown] = grown_length(seq_lens, page_size)
    return lens, grown


def with_room(batch: DecodeBatch) -> tuple[DecodeBatch, int]:
    """(copies of the batch's tensors with room for `next_layout`'s grown request and `decode_layout`'s growth, the
    first spare page): the cache with enough NaN pages after its own for `grown_length` tokens plus the pages of
    q_len more tokens per request, the block table widened to them with INVALID_PAGE entries. The same attention
    as ``batch``: nothing reads the room yet."""
    ps, kv, table = batch.page_size, batch.kv_cache, batch.block_table
    B, q_max = batch.batch_size, int(batch.q_lens.max()) if batch.batch_size else 1
    grown = -(-grown_length(batch.seq_lens, ps) // ps)  # the grown request's pages
    step = -(-q_max // ps)  # at most this many more pages per request in one decode step
    pages = grown + B * step  # spare pages
    spare = nan_fill_(kv.new_empty((pages,) + tuple(kv.shape[1:])))  # [pages, ps, D]
    wide = table.new_full((table.shape[0], max(grown, table.shape[1]) + step), INVALID_PAGE)  # [B, W']
    wide[:, : table.shape[1]] = table
    static = batch.replace(q=batch.q.clone(), kv_cache=torch.cat([kv, spare]), block_table=wide,
                           seq_lens=batch.seq_lens.clone(), q_lens=batch.q_lens.clone())
    return static, kv.shape[0]


def used_slots(batch: DecodeBatch) -> torch.Tensor:
    """[P, page_size] bool: the cache slots holding a token of some request of ``batch``."""
    pages, slots, _ = batch.token_addresses()  # [N] each, every valid token
    mask = torch.zeros(batch.kv_cache.shape[:2], dtype=torch.bool, device=batch.device)  # [P, ps]
    mask[pages, slots] = True
    return mask


def next_layout(batch: DecodeBatch, first_spare: int) -> tuple[str, torch.Tensor]:
    """Write the next step's lengths, q_lens and block table into ``batch`` (a `with_room` copy whose spare pages
    start at ``first_spare``) in place, and NaN into the slots only the old step read; -> (a description, [P, ps]
    bool: the grown request's new slots, which `next_values` fills)."""
    B, ps = batch.batch_size, batch.page_size
    old_lens = batch.seq_lens.tolist()
    old_slots = used_slots(batch)  # [P, ps]
    order = torch.arange(B, device=batch.device).roll(1)  # [B] new request i = old request order[i]
    batch.q_lens.copy_(batch.q_lens[order])  # [B]
    batch.block_table.copy_(batch.block_table[order])  # [B, W']
    lens, grown = next_lengths(torch.tensor(old_lens, dtype=batch.seq_lens.dtype), ps)
    new_slots = torch.zeros_like(old_slots)  # [P, ps]
    batch.seq_lens.copy_(lens.to(batch.device))
    if grown >= 0:
        old_len = old_lens[(grown - 1) % B]  # the grown request's length before: its row came with it
        have, need = -(-old_len // ps), -(-int(lens[grown]) // ps)  # its pages, before / after
        batch.block_table[grown, have:need] = torch.arange(first_spare, first_spare + need - have,
                                                           dtype=batch.block_table.dtype, device=batch.device)
        pages, slots = batch.token_slots(grown)  # [new length] each
        new_slots[pages[old_len:], slots[old_len:]] = True  # read by the new step only
    stale = old_slots & ~used_slots(batch)  # [P, ps] read by the old step only
    raw, nan = _nan_bits(batch.kv_cache)
    raw[stale] = nan
    where = f"requests rotated by one, seq_lens {old_lens} -> {batch.seq_lens.tolist()}"
    if grown >= 0:
        where += f" (request {grown} grown past twice the old longest)"
    return where + f", {int(stale.sum())} slots the old step read set to NaN", new_slots


def negated(q: torch.Tensor) -> torch.Tensor:
    """-q in q's dtype, exact in every format (fp8 widened to negate it); zeros kept +0: e4m3fnuz has no -0."""
    wide = q.float() if is_fp8(q.dtype) else q  # fp8 has no neg
    return torch.where(wide == 0, wide, -wide).to(q.dtype)


def next_values(batch: DecodeBatch, new_slots: torch.Tensor, seed: int = 0) -> str:
    """Write the next step's contents after its plan: q negated (zeros kept +0, exact in every format) and, in the
    ``new_slots`` [P, ps], token values drawn from a standard normal (seeded; fp8 caches quantized with the batch's
    kv_scale, saturating). -> a description."""
    batch.q.copy_(negated(batch.q))
    n = int(new_slots.sum())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, batch.head_dim, generator=g)  # [n, D] fp32
    kv = batch.kv_cache
    codes = quantize(x, kv.dtype, scale=batch.kv_scale)[0] if is_fp8(kv.dtype) else x.to(kv.dtype)  # [n, D]
    bits = _BITS[kv.element_size()]
    kv.view(bits)[new_slots] = codes.view(bits).to(batch.device)
    return f"q negated and {n} new tokens written"


def decode_layout(batch: DecodeBatch, first_spare: int) -> tuple[str, torch.Tensor]:
    """Write the step after `next_layout`'s into ``batch`` (the same `with_room` copy) in place: the same requests
    in the same order and the same q_lens, each non-empty request grown by its q_len tokens (empty ones stay empty),
    the pages that growth newly needs taken from the spare ones not yet in the block table. Lengths only grow, so no
    slot turns stale. -> (a description, [B] the lengths before, which `decode_values` takes)."""
    B, ps = batch.batch_size, batch.page_size
    old = batch.seq_lens.clone()  # [B]
    new = torch.where(old > 0, old + batch.q_lens.to(old.dtype), old)  # [B]
    have, need = batch.pages_per_request.tolist(), (-(-new.long() // ps)).tolist()  # pages before / after
    used = batch.block_table[batch.used_entries]  # [pages in use]
    free = max(first_spare, int(used.max()) + 1 if used.numel() else 0)  # the first spare page not yet taken
    taken = sum(n - h for h, n in zip(have, need))
    if free + taken > batch.num_pages:
        raise ValueError(f"decode_layout: batch needs {taken} spare pages from page {free} on, it has "
                         f"{batch.num_pages - free} (a with_room copy has room for one decode step)")
    for b in range(B):
        batch.block_table[b, have[b]:need[b]] = torch.arange(free, free + need[b] - have[b],
                                                             dtype=batch.block_table.dtype, device=batch.device)
        free += need[b] - have[b]
    batch.seq_lens.copy_(new)
    return (f"the same requests one decode step later, each non-empty one grown by its q_len tokens: seq_lens "
            f"{old.tolist()} -> {new.tolist()}, {taken} spare pages taken"), old


def decode_values(batch: DecodeBatch, old_lens: torch.Tensor) -> str:
    """Write `decode_layout`'s new tokens after the plan: new token i of a request (position old length + i, the
    newest its query row i sees) is the least-norm k with sm_scale · <q_h, k> = the row's log-sum-exp over its old
    tokens for every head h (fp64 on the dequantized q, then rounded to the cache's format: fp8 quantized with
    kv_scale, saturating), so that beside those tokens it weighs about 1/2 on every head. q is kept. ``old_lens``
    [B]: the lengths before `decode_layout`. -> a description with the least weight a new token reached beside its
    row's old tokens (below 1/2 where rounding, saturation or q's rank kept it from its target)."""
    request = batch.row_request()  # [T]
    rows = torch.nonzero(batch.seq_lens.long()[request] > old_lens.long()[request]).flatten()  # [t] rows that grew
    if not rows.numel():
        return "no request to grow"
    owner = request[rows]  # [t]
    i = rows - batch.qo_indptr.long()[owner]  # [t] row in its request = its new token's index
    old = old_lens.to(batch.device)[owner]  # [t]
    alone = batch.replace(q=batch.q[rows], block_table=batch.block_table[owner], seq_lens=old,
                          q_lens=torch.ones_like(old))  # each grown row as a request of its old tokens
    lse = mla_decode_ref(alone)[1]  # [t, H] fp64 natural log
    q = batch.sm_scale * alone.dequantized_q()  # [t, H, D] fp64
    k = (torch.linalg.pinv(q) @ lse[..., None])[..., 0]  # [t, D] least norm: q_h · k = lse_h for each h
    kv = batch.kv_cache
    codes = quantize(k, kv.dtype, scale=batch.kv_scale)[0] if is_fp8(kv.dtype) else k.to(kv.dtype)  # [t, D]
    position = old + i  # [t]
    pages = batch.block_table.long()[owner, position // batch.page_size]  # [t]
    bits = _BITS[kv.element_size()]
    kv.view(bits)[pages, position % batch.page_size] = codes.view(bits)
    real = codes.to(torch.float64) * (batch.kv_scale if is_fp8(kv.dtype) else 1.0)  # [t, D]
    s = torch.einsum("thd,td->th", q, real)  # [t, H] the new tokens' scores
    weight = torch.sigmoid(s - lse)  # [t, H] e^s / (e^s + e^lse)
    return (f"{rows.numel()} new tokens written, each built to weigh about 1/2 beside its query row's old tokens "
            f"on every head (median {float(weight.median()):.3g}, least {float(weight.min()):.3g})")
