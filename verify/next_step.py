"""The next decode step, written into a captured step's own buffers (the verifier's ``step`` check).

A serving engine captures one CUDA graph per batch size and replays it at every decode step: between replays it
refills the same q, block-table and length buffers in place and plans again, outside the graph. A kernel that bakes
the captured step into its launch (a plan computed once, a grid or loop bound sized by the lengths of that step, a
host-side copy of them) replays the old step on the new data. `refill(batch)` writes such a next step into
``batch``'s own tensors, in place and with the same shapes:

- the requests rotated by one: request i takes request i-1's q rows, q_len, block-table row and length, so that
  each request's work lands elsewhere in a plan;
- the longest request (the first of them) halved, and with three requests or more, the request after it emptied
  (CUDA-graph padding sends empty requests): the lengths change even where a rotation moves nothing;
- every cache slot that the old step used and the new one does not, NaN (the format's NaN code for fp8): a kernel
  that still reads the old lengths reads NaN.

Only ``q``, ``q_lens``, ``block_table``, ``seq_lens`` and ``kv_cache`` change; the pages stay where they are.
"""

from __future__ import annotations

import torch

from mla_ref.decode import DecodeBatch


def next_lengths(seq_lens: torch.Tensor) -> torch.Tensor:
    """The refilled step's lengths [B] int32 for the current ``seq_lens`` [B]: rotated by one, the longest (first)
    halved (rounded down), and with B >= 3 the request after it emptied."""
    lens = seq_lens.roll(1)  # [B] request i takes request i-1's length
    if lens.numel():
        longest = int(lens.argmax())
        lens[longest] = lens[longest] // 2
        if lens.numel() >= 3:
            lens[(longest + 1) % lens.numel()] = 0
    return lens


def _slots(batch: DecodeBatch) -> torch.Tensor:
    """[P, page_size] bool: the cache slots holding a token of some request of ``batch``."""
    ps = batch.page_size
    mask = torch.zeros(batch.kv_cache.shape[:2], dtype=torch.bool, device=batch.device)  # [P, ps]
    pos = torch.arange(batch.block_table.shape[1] * ps, device=batch.device)  # [max_pages * ps] token positions
    valid = pos[None, :] < batch.seq_lens[:, None].long()  # [B, max_pages * ps]
    pages = batch.block_table.long().repeat_interleave(ps, dim=1)  # [B, max_pages * ps] page of each position
    mask[pages[valid], (pos % ps).expand_as(valid)[valid]] = True
    return mask


def refill(batch: DecodeBatch) -> str:
    """Write the next step (module docstring) into ``batch``'s tensors in place; returns a description with the old
    and new lengths. The tensors must be the step's own (contiguous copies: this writes NaN into the cache)."""
    old_lens = batch.seq_lens.tolist()
    old_slots = _slots(batch)  # [P, ps]
    order = torch.arange(batch.batch_size, device=batch.device).roll(1)  # [B] new request i = old request order[i]
    qo = batch.qo_indptr.tolist()  # [B+1] old row offsets
    rows = [torch.arange(qo[j], qo[j + 1], device=batch.device) for j in order.tolist()]
    if rows:
        batch.q.copy_(batch.q[torch.cat(rows)])  # [T, H, D] rows of the rotated requests, in their new order
    batch.q_lens.copy_(batch.q_lens[order])  # [B]
    batch.block_table.copy_(batch.block_table[order])  # [B, max_pages]
    batch.seq_lens.copy_(next_lengths(torch.tensor(old_lens, dtype=batch.seq_lens.dtype)).to(batch.device))
    stale = old_slots & ~_slots(batch)  # [P, ps] read by the old step only
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[batch.kv_cache.element_size()]
    nan = torch.tensor(float("nan")).to(batch.kv_cache.dtype).view(bits)  # the format's NaN code (e4m3fnuz: 0x80)
    batch.kv_cache.view(bits)[stale] = nan.to(batch.device)  # fp8 has no index_put: write its bytes
    return (f"refilled in place: requests rotated by one, seq_lens {old_lens} -> {batch.seq_lens.tolist()}, "
            f"{int(stale.sum())} slots the old step read set to NaN")
