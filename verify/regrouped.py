"""A batch's requests in another batch: reordered, one dropped, the longest added twice (the ``batch`` check,
`verify.checks.check_batch`).

A request's rows should not depend on what else is in its batch. A split-KV kernel plans over the whole batch, so
where a request is cut, and with that the rounding of its merged output, moves with the other requests: its rows
stay within the tier-1 bound but change bits. A kernel that declares itself batch-invariant (vLLM's
``VLLM_BATCH_INVARIANT`` serving: a request's tokens must not depend on its neighbours) must keep them.
`regrouped_batch` changes everything about the batch but the rows' own inputs:

    order      the requests reversed
    size       the case's first request dropped when there are two or more; two copies of its longest request
               (the first of equal length) appended, naming the same pages, each with its own copy of the q rows
    work       so the batch size (one more) and the total tokens (s_max - s_0 + s_max more: a plan over the whole
               batch cuts elsewhere) change, and every request's neighbours and position

The cache, the NaN in its unused slots and the scales are the case's own tensors; the block table's rows, q's rows
and the lengths are copied in the new order. Row ``i`` of the new batch is row ``rows[i]`` of the case, so the
oracle's answer is the case's, reindexed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_ref.decode import DecodeBatch


@dataclass(frozen=True)
class RegroupedBatch:
    """The regrouped batch and where its rows come from.

    Attributes:
        batch: the `DecodeBatch`.
        requests: [B'] int64 (CPU), the case's request behind each new request.
        rows: [T'] int64 (on the batch's device), the case's query row behind each new row.
    """

    batch: DecodeBatch
    requests: torch.Tensor
    rows: torch.Tensor

    def describe(self) -> str:
        return (f"the requests regrouped as {self.requests.tolist()} of the case's (reversed, the first dropped, the "
                "longest added twice)")


def regrouped_batch(batch: DecodeBatch) -> RegroupedBatch:
    """The module docstring's batch for ``batch`` (one host sync for the lengths)."""
    B = batch.batch_size
    seq = batch.seq_lens.long().cpu()  # [B]
    order = list(range(B - 1, 0 if B >= 2 else -1, -1))  # reversed, request 0 dropped when B >= 2
    if B:
        order += [int(torch.argmax(seq))] * 2  # the first longest request, twice again
    requests = torch.tensor(order, dtype=torch.long)  # [B']
    q_lens = batch.q_lens.long().cpu()  # [B]
    starts = torch.cumsum(q_lens, 0) - q_lens  # [B] first q row of each request
    rows = torch.cat([torch.arange(int(starts[b]), int(starts[b] + q_lens[b])) for b in order]
                     or [torch.zeros(0, dtype=torch.long)])  # [T']
    rows = rows.to(batch.device)
    on = requests.to(batch.device)
    regrouped = batch.replace(
        q=batch.q.index_select(0, rows),  # [T', H, D]
        block_table=batch.block_table.index_select(0, on),  # [B', W]
        seq_lens=batch.seq_lens.index_select(0, on),  # [B']
        q_lens=batch.q_lens.index_select(0, on),  # [B']
    )
    return RegroupedBatch(regrouped, requests, rows)
