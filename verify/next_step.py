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
"""

from __future__ import annotations

import torch

from mla_ref.decode import INVALID_PAGE, DecodeBatch, is_fp8
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
    """(copies of the batch's tensors with room for `next_layout`'s grown request, the first spare page): the
    cache with enough NaN pages after its own for `grown_length` tokens, the block table widened to them with
    INVALID_PAGE entries. The same attention as ``batch``: nothing reads the room yet."""
    ps, kv, table = batch.page_size, batch.kv_cache, batch.block_table
    pages = -(-grown_length(batch.seq_lens, ps) // ps)  # spare pages, and the grown request's block-table width
    spare = nan_fill_(kv.new_empty((pages,) + tuple(kv.shape[1:])))  # [pages, ps, D]
    wide = table.new_full((table.shape[0], max(pages, table.shape[1])), INVALID_PAGE)  # [B, W']
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


def next_values(batch: DecodeBatch, new_slots: torch.Tensor, seed: int = 0) -> str:
    """Write the next step's contents after its plan: q negated (zeros kept +0, exact in every format) and, in the
    ``new_slots`` [P, ps], token values drawn from a standard normal (seeded; fp8 caches quantized with the batch's
    kv_scale, saturating). -> a description."""
    q = batch.q.float() if is_fp8(batch.q.dtype) else batch.q  # [T, H, D] fp8 widened (exact): it has no neg
    batch.q.copy_(torch.where(q == 0, q, -q).to(batch.q.dtype))  # zeros kept +0: e4m3fnuz has no -0
    n = int(new_slots.sum())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, batch.head_dim, generator=g)  # [n, D] fp32
    kv = batch.kv_cache
    codes = quantize(x, kv.dtype, scale=batch.kv_scale)[0] if is_fp8(kv.dtype) else x.to(kv.dtype)  # [n, D]
    bits = _BITS[kv.element_size()]
    kv.view(bits)[new_slots] = codes.view(bits).to(batch.device)
    return f"q negated and {n} new tokens written"
