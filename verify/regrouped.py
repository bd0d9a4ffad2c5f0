"""A batch's requests in other batches (the ``batch`` check, `verify.checks.check_batch`).

A request's rows should not depend on what else is in its batch. A split-KV kernel plans over the whole batch, so
where a request is cut, and with that the rounding of its merged output, moves with the other requests: its rows
stay within the tier-1 bound but change bits. A kernel that declares itself batch-invariant (vLLM's
``VLLM_BATCH_INVARIANT`` serving: a request's tokens must not depend on its neighbours) must keep them.
`regrouped_batches` gives two batches of the case's own requests:

    grown      the requests reversed, the first dropped when there are two or more, two copies of the longest
               (the first of equal length) appended: one request more, s_max - s_0 + s_max more tokens
    shrunk     (two or more requests) the requests reversed without the first longest one: one request fewer,
               a shorter longest request unless another one ties it

so the batch size, its total tokens and (where the longest request is unique) its longest length change, and the
requests move (in the grown batch all but the middle one of an odd count; a lone request cannot). What both
batches keep, and a kernel's cuts could follow unseen: a longest length that two requests share.

Each copy names the same pages, with its own copy of the q rows. The cache, the NaN in its unused slots and the
scales are the case's own tensors; the block table's rows, q's rows and the lengths are copied in the new order. Row
``i`` of a new batch is row ``rows[i]`` of the case, so the oracle's answer is the case's, reindexed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_ref.decode import DecodeBatch


@dataclass(frozen=True)
class RegroupedBatch:
    """A regrouped batch and where its rows come from.

    Attributes:
        batch: the `DecodeBatch`.
        requests: [B'] int64 (CPU), the case's request behind each new request.
        rows: [T'] int64 (on the batch's device), the case's query row behind each new row.
        how: "grown" or "shrunk" (module docstring).
    """

    batch: DecodeBatch
    requests: torch.Tensor
    rows: torch.Tensor
    how: str

    def describe(self) -> str:
        what = ("reversed, the first dropped, the longest added twice" if self.how == "grown"
                else "reversed, the longest dropped")
        return f"the requests regrouped as {self.requests.tolist()} of the case's ({what})"


def regrouped_batches(batch: DecodeBatch) -> list[RegroupedBatch]:
    """The module docstring's grown batch, and with two or more requests its shrunk one (one host sync)."""
    B = batch.batch_size
    longest = int(torch.argmax(batch.seq_lens.long().cpu())) if B else 0  # the first longest request
    grown = list(range(B - 1, 0 if B >= 2 else -1, -1)) + ([longest] * 2 if B else [])
    batches = [_regroup(batch, grown, "grown")]
    if B >= 2:
        batches.append(_regroup(batch, [b for b in range(B - 1, -1, -1) if b != longest], "shrunk"))
    return batches


def _regroup(batch: DecodeBatch, order: list[int], how: str) -> RegroupedBatch:
    """The requests ``order`` of ``batch`` (repeats allowed) as a batch of their own."""
    q_lens = batch.q_lens.long().cpu()  # [B]
    starts = torch.cumsum(q_lens, 0) - q_lens  # [B] first q row of each request
    rows = torch.cat([torch.arange(int(starts[b]), int(starts[b] + q_lens[b])) for b in order]
                     or [torch.zeros(0, dtype=torch.long)]).to(batch.device)  # [T']
    on = torch.tensor(order, dtype=torch.long, device=batch.device)  # [B']
    regrouped = batch.replace(
        q=batch.q.index_select(0, rows),  # [T', H, D]
        block_table=batch.block_table.index_select(0, on),  # [B', W]
        seq_lens=batch.seq_lens.index_select(0, on),  # [B']
        q_lens=batch.q_lens.index_select(0, on),  # [B']
    )
    return RegroupedBatch(regrouped, torch.tensor(order, dtype=torch.long), rows, how)
