"""A batch's requests in other batches (the ``batch`` check, `verify.checks.check_batch`).

A request's rows should not depend on what else is in its batch. A split-KV kernel plans over the whole batch, so
where a request is cut, and with that the rounding of its merged output, moves with the other requests: its rows
stay within the tier-1 bound but change bits. A kernel that declares itself batch-invariant (vLLM's
``VLLM_BATCH_INVARIANT`` serving: a request's tokens must not depend on its neighbours) must keep them.
`regrouped_batches` gives two batches of the case's own requests:

    grown      the requests reversed, the first dropped when there are two or more, the longest (the first of
               equal length) appended, then a *longer* request: the longest's full pages followed by all of its
               pages again, f P + s_max tokens (f full pages of P tokens), q rows copied from the longest's. Its
               rows are not compared (no request of the case is that long; they are computed, never judged). When
               the longest has no full page (s_max < P) there is no longer request to build without reading its
               unused, NaN-poisoned slots: the longest is appended twice instead.
    shrunk     (two or more requests) the requests reversed without every request of the longest length, or,
               when all have that length, without the first of them

so the batch size, its total tokens and its longest length change (the grown batch's longest is longer unless
s_max < P; the shrunk one's is shorter unless all requests have one length), and the requests move (in the grown
batch all but the middle one of an odd count; a lone request cannot). A kernel whose cuts follow the batch's longest
request is caught even when two requests share that length, and in a batch of equal lengths through the grown one.

Each request names pages of the case, with its own copy of the q rows. The cache, the NaN in its unused slots and
the scales are the case's own tensors; the block table's rows (widened with ``INVALID_PAGE`` for the longer request),
q's rows and the lengths are copied in the new order. Row ``i`` of a new batch, for ``i < len(rows)``, is row
``rows[i]`` of the case, so the oracle's answer is the case's, reindexed; the longer request's rows come after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_ref.decode import INVALID_PAGE, DecodeBatch


@dataclass(frozen=True)
class RegroupedBatch:
    """A regrouped batch and where its rows come from.

    Attributes:
        batch: the `DecodeBatch` the kernel runs on: the case's requests, then (grown, s_max >= P) the longer one.
        compared: the same without the longer request (``batch`` itself when there is none): the requests whose rows
            are the case's, for the bound of those rows.
        requests: [B''] int64 (CPU), the case's request behind each request of ``compared``.
        rows: [T''] int64 (on the batch's device), the case's query row behind each row of ``compared``, which are
            the first T'' rows of ``batch``.
        how: "grown" or "shrunk" (module docstring).
    """

    batch: DecodeBatch
    compared: DecodeBatch
    requests: torch.Tensor
    rows: torch.Tensor
    how: str

    def case_rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of a run's out [T', H, L] or lse [T', H] on ``batch`` that come from the case (None stays None)."""
        return None if t is None else t[: self.rows.shape[0]]

    def describe(self) -> str:
        longer = self.batch.batch_size > self.compared.batch_size
        what = {("grown", True): "reversed, the first dropped, the longest added, then a longer request on its pages",
                ("grown", False): "reversed, the first dropped, the longest added twice",
                ("shrunk", False): "reversed, the longest dropped"}[self.how, longer]
        return f"the requests regrouped as {self.requests.tolist()} of the case's ({what})"


def regrouped_batches(batch: DecodeBatch) -> list[RegroupedBatch]:
    """The module docstring's grown batch, and with two or more requests its shrunk one (one host sync)."""
    B, P = batch.batch_size, batch.page_size
    seq = batch.seq_lens.long().cpu()  # [B]
    longest = int(torch.argmax(seq)) if B else 0  # the first longest request
    s_max = int(seq[longest]) if B else 0
    full = s_max // P  # the longest's full pages
    grown = list(range(B - 1, 0 if B >= 2 else -1, -1)) + ([longest] * (1 if full else 2) if B else [])
    batches = [_regroup(batch, grown, "grown", longer=(longest, full) if full else None)]
    if B >= 2:
        rest = [b for b in range(B - 1, -1, -1) if int(seq[b]) < s_max]
        batches.append(_regroup(batch, rest or [b for b in range(B - 1, -1, -1) if b != longest], "shrunk"))
    return batches


def _regroup(batch: DecodeBatch, order: list[int], how: str, longer: tuple[int, int] | None = None) -> RegroupedBatch:
    """The requests ``order`` of ``batch`` (repeats allowed) as a batch of their own, then, with ``longer`` = (the
    longest request, its full pages), the longer request."""
    q_lens = batch.q_lens.long().cpu()  # [B]
    starts = torch.cumsum(q_lens, 0) - q_lens  # [B] first q row of each request
    rows = torch.cat([torch.arange(int(starts[b]), int(starts[b] + q_lens[b])) for b in order]
                     or [torch.zeros(0, dtype=torch.long)]).to(batch.device)  # [T'']
    on = torch.tensor(order, dtype=torch.long, device=batch.device)  # [B'']
    compared = batch.replace(
        q=batch.q.index_select(0, rows),  # [T'', H, D]
        block_table=batch.block_table.index_select(0, on),  # [B'', W]
        seq_lens=batch.seq_lens.index_select(0, on),  # [B'']
        q_lens=batch.q_lens.index_select(0, on),  # [B'']
    )
    regrouped = compared if longer is None else _with_longer(compared, batch, *longer, starts=starts, q_lens=q_lens)
    return RegroupedBatch(regrouped, compared, torch.tensor(order, dtype=torch.long), rows, how)


def _with_longer(compared: DecodeBatch, batch: DecodeBatch, longest: int, full: int, *, starts: torch.Tensor,
                 q_lens: torch.Tensor) -> DecodeBatch:
    """``compared`` with one more request: the longest's ``full`` full pages, then all its pages (f P + s_max
    tokens, every one a valid slot of the case), its q rows a copy of the longest's (``starts`` [B], ``q_lens`` [B]:
    the case's first q row and q_len of each request, on the CPU)."""
    s_max, P = int(batch.seq_lens[longest]), batch.page_size
    pages = -(-s_max // P)  # the longest's pages
    table = batch.block_table[longest]  # [W]
    extra = torch.cat([table[:full], table[:pages]])  # [full + pages]
    B, W = compared.block_table.shape
    width = max(W, extra.shape[0])
    block_table = torch.full((B + 1, width), INVALID_PAGE, dtype=batch.block_table.dtype, device=batch.device)
    block_table[:B, :W] = compared.block_table  # [B'', W]
    block_table[B, : extra.shape[0]] = extra  # [full + pages]
    first, n = int(starts[longest]), int(q_lens[longest])
    length = torch.tensor([full * P + s_max], dtype=batch.seq_lens.dtype, device=batch.device)  # [1]
    q_len = torch.tensor([n], dtype=batch.q_lens.dtype, device=batch.device)  # [1]
    return compared.replace(
        q=torch.cat([compared.q, batch.q[first : first + n]]),  # [T'' + n, H, D]
        block_table=block_table,  # [B'' + 1, width]
        seq_lens=torch.cat([compared.seq_lens, length]),  # [B'' + 1]
        q_lens=torch.cat([compared.q_lens, q_len]),  # [B'' + 1]
    )
