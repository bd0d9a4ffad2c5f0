"""A batch's requests in other batches (the ``batch`` check, `verify.checks.check_batch`).

A request's rows should not depend on what else is in its batch. A split-KV kernel plans over the whole batch, so
where a request is cut, and with that the rounding of its merged output, moves with the other requests: its rows
stay within the tier-1 bound but change bits. A kernel that declares itself batch-invariant (vLLM's
``VLLM_BATCH_INVARIANT`` serving: a request's tokens must not depend on its neighbours) must keep them.
`regrouped_batches` gives up to three batches of the case's own requests:

    grown      the requests reversed, the first dropped when there are two or more, the longest (the first of
               equal length) appended, then one request more: the longest's f full pages
               of P tokens followed by all of its pages again, f P + s_max tokens (every one a valid slot; longer
               than any request of the case when f >= 1), with the longest's q rows
    shrunk     (two or more requests) the requests reversed without every request of the longest length, or,
               when all have that length, without the first of them
    mtp        (requests of different q_lens) the requests as they are without every request of the largest
               q_len; (every request has the same q_len n, the longest n + 1 tokens or more) the requests as they
               are, then one request more: the longest's tokens with n + 1 query rows (its rows, the
               last one twice): with n = 1 a speculative-decoding request beside plain decode ones

and, apart from these (`shared_batch`),

    shared     the requests as they are among siblings of the longest request, each with its q rows negated, its
               q_len and a row of its pages: one on its very block-table row and length first; after the case's
               requests (where the longest has f >= 1 full pages) one that shares only a part of its prefix, its
               first ceil(f / 2) pages, then its first max(1, f // 2) pages once more, where the longest goes on to
               its later pages (full pages: every slot valid; its length their max(f, 2) P tokens); then one more on
               its very row and length. Requests on one prefix's pages with other queries, as vLLM's prefix caching
               and parallel sampling make them, so a kernel that keeps per-page results and lets the first or the
               last reader of a page write them shows (found by a review: no other batch had two requests with
               different q on one page), and so does a cascade kernel that detects shared prefixes by the first
               page id alone and takes every page up to the shorter's length, or the first two requests' common
               pages, as shared by every request starting there (found by reviews: every sibling shared all its
               pages, and the siblings' rows were not judged)

so the batch size, its total tokens, its longest length (the grown one's longer unless s_max < P; the shrunk one's
shorter unless all requests have one length) and its largest q_len (mtp; the grown one's too where the first request
held it alone) change, and the requests move (in the grown batch all but the middle one of an odd count; a lone
request cannot). A kernel whose cuts follow the batch's longest request is caught even when two requests share that
length, and one whose tiles follow the batch's largest q_len wherever the longest request has more tokens than
query rows or the q_lens differ; a kernel that takes one row per request, or at most n, refuses only the mtp batch
of requests of one q_len (1, or n).

Each request names pages of the case, with its own copy of the q rows. The cache, the NaN in its unused slots and
the scales are the case's own tensors; the block table's rows (widened with ``INVALID_PAGE`` for the added request),
q's rows and the lengths are copied in the new order. Row ``offset + i`` of a new batch, for ``i < len(rows)``, is
row ``rows[i]`` of the case, so the oracle's answer is the case's, reindexed; the added requests' rows come after
(before too, in the shared batch: ``offset`` rows), and `RegroupedBatch.added_batch` gives them as a batch of their
own, for the oracle to judge them too (added requests had gone unjudged, and a kernel that got only theirs wrong
passed: a review's cascade kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mla_ref.decode import INVALID_PAGE, DecodeBatch
from verify.next_step import negated


@dataclass(frozen=True)
class RegroupedBatch:
    """A regrouped batch and where its rows come from.

    Attributes:
        batch: the `DecodeBatch` the kernel runs on: the case's requests, then (grown, mtp) the added request;
            (shared) among the siblings.
        compared: the same without the added requests (``batch`` itself when there is none): the requests whose
            rows are the case's, for the bound of those rows.
        requests: [B''] int64 (CPU), the case's request behind each request of ``compared``.
        rows: [T''] int64 (on the batch's device), the case's query row behind each row of ``compared``, which are
            the T'' rows of ``batch`` from ``offset`` on.
        how: "grown", "shrunk", "mtp" or "shared" (module docstring).
        offset: rows of ``batch`` before the case's (the shared batch's first sibling's), else 0.
        added: the requests of ``batch`` that are not the case's (grown, mtp: the last; shared: the siblings).
    """

    batch: DecodeBatch
    compared: DecodeBatch
    requests: torch.Tensor
    rows: torch.Tensor
    how: str
    offset: int = 0
    added: tuple[int, ...] = ()

    def added_batch(self) -> tuple[DecodeBatch, torch.Tensor]:
        """The added requests as a batch of their own (the cache and scales ``batch``'s), and their query rows of
        ``batch``, [t] int64 on its device."""
        on = torch.tensor(self.added, dtype=torch.long, device=self.batch.device)  # [a]
        return self.batch.subset(on, int(self.batch.q_lens[on].sum()))

    def case_rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of a run's out [T', H, L] or lse [T', H] on ``batch`` that come from the case (None stays None)."""
        return None if t is None else t[self.offset : self.offset + self.rows.shape[0]]

    def describe(self) -> str:
        if self.how == "shared":
            partial = ("then one on the first half of its full pages and its first pages again, " if
                       len(self.added) == 3 else "")
            return ("the case's requests as they are among requests on the longest's pages with its q_len and its q "
                    f"rows negated: one on its very block-table row and length before them, {partial}one on its "
                    "very row after them (one prefix's pages read with other queries)")
        what = {"grown": "reversed, the first dropped, the longest added",
                "shrunk": "reversed, every request of the longest length dropped",
                "mtp": "as they are" if self.batch.batch_size > self.compared.batch_size
                else "as they are, every request of the largest q_len dropped"}[self.how]
        if self.batch.batch_size > self.compared.batch_size:
            tokens, rows = int(self.batch.seq_lens[-1]), int(self.batch.q_lens[-1])
            what += (f", then a request of {tokens} token{'s' if tokens != 1 else ''} on the longest's pages with "
                     f"{rows} query row{'s' if rows != 1 else ''}")
        return f"the requests regrouped as {self.requests.tolist()} of the case's ({what})"


def regrouped_batches(batch: DecodeBatch) -> list[RegroupedBatch]:
    """The module docstring's grown batch, with two or more requests its shrunk one, and its mtp one where the q_lens
    differ or the longest request has more tokens than query rows (the lengths read once to the host)."""
    B = batch.batch_size
    seq, n = batch.seq_lens.long().cpu(), batch.q_lens.long().cpu()  # [B], [B]
    if not B:
        return [_regroup(batch, [], "grown", n)]
    longest = int(torch.argmax(seq))  # the first longest request
    s_max, first = int(seq[longest]), int(n[:longest].sum())  # its tokens, its first q row
    longest_rows = list(range(first, first + int(n[longest])))  # its q rows
    full = s_max // batch.page_size  # its full pages
    grown = _regroup(batch, list(range(B - 1, 0 if B >= 2 else -1, -1)) + [longest], "grown", n)
    batches = [_with_added(grown, batch, longest, full, s_max, longest_rows)]
    if B >= 2:
        rest = [b for b in range(B - 1, -1, -1) if int(seq[b]) < s_max]
        batches.append(_regroup(batch, rest or [b for b in range(B - 1, -1, -1) if b != longest], "shrunk", n))
    q_max = int(n.max())
    if int(n.min()) < q_max:  # the largest q_len dropped: the rest keep their order
        batches.append(_regroup(batch, [b for b in range(B) if int(n[b]) < q_max], "mtp", n))
    elif s_max > q_max:  # a request of q_max + 1 rows beside the case's (no more rows than tokens)
        mtp = _regroup(batch, list(range(B)), "mtp", n)
        batches.append(_with_added(mtp, batch, longest, 0, s_max, longest_rows + longest_rows[-1:]))
    return batches


def _regroup(batch: DecodeBatch, order: list[int], how: str, q_lens: torch.Tensor) -> RegroupedBatch:
    """The requests ``order`` of ``batch`` (repeats allowed) as a batch of their own (``q_lens`` [B]: the batch's, on
    the CPU)."""
    starts = torch.cumsum(q_lens, 0) - q_lens  # [B] first q row of each request
    rows = torch.cat([torch.arange(int(starts[b]), int(starts[b] + q_lens[b])) for b in order]
                     or [torch.zeros(0, dtype=torch.long)]).to(batch.device)  # [T'']
    on = torch.tensor(order, dtype=torch.long, device=batch.device)  # [B'']
    regrouped = batch.replace(
        q=batch.q.index_select(0, rows),  # [T'', H, D]
        block_table=batch.block_table.index_select(0, on),  # [B'', W]
        seq_lens=batch.seq_lens.index_select(0, on),  # [B'']
        q_lens=batch.q_lens.index_select(0, on),  # [B'']
    )
    return RegroupedBatch(regrouped, regrouped, torch.tensor(order, dtype=torch.long), rows, how)


def _with_added(regrouped: RegroupedBatch, batch: DecodeBatch, longest: int, full: int, s_max: int,
                q_rows: list[int]) -> RegroupedBatch:
    """``regrouped`` with one request more on the pages of ``batch``'s request ``longest`` (``s_max`` tokens):
    ``full`` of its pages, then all of them (full P + s_max tokens, every one a valid slot of the case), its q rows
    the case's rows ``q_rows``."""
    compared = regrouped.compared
    pages = -(-s_max // batch.page_size)  # the longest's pages
    table = batch.block_table[longest]  # [W]
    added = torch.cat([table[:full], table[:pages]])  # [full + pages]
    B, W = compared.block_table.shape
    block_table = torch.full((B + 1, max(W, added.shape[0])), INVALID_PAGE, dtype=batch.block_table.dtype,
                             device=batch.device)  # [B'' + 1, max(W, full + pages)]
    block_table[:B, :W] = compared.block_table  # [B'', W]
    block_table[B, : added.shape[0]] = added  # [full + pages]
    as_field = dict(dtype=batch.seq_lens.dtype, device=batch.device)  # seq_lens and q_lens: int32 on q's device
    return replace(regrouped, added=(B,), batch=compared.replace(
        q=torch.cat([compared.q, batch.q[torch.tensor(q_rows, device=batch.device)]]),  # [T'' + rows, H, D]
        block_table=block_table,  # [B'' + 1, max(W, full + pages)]
        seq_lens=torch.cat([compared.seq_lens, torch.tensor([full * batch.page_size + s_max], **as_field)]),
        q_lens=torch.cat([compared.q_lens, torch.tensor([len(q_rows)], **as_field)]),  # [B'' + 1]
    ))


def shared_batch(batch: DecodeBatch) -> RegroupedBatch | None:
    """The module docstring's shared batch, or None when the case has no token to share (every request empty)."""
    seq, n = batch.seq_lens.long().cpu(), batch.q_lens.long().cpu()  # [B], [B]
    B, P = batch.batch_size, batch.page_size
    if not B or not int(seq.max()):
        return None
    longest = int(torch.argmax(seq))
    s_max, rows, first = int(seq[longest]), int(n[longest]), int(n[:longest].sum())  # its tokens, q rows, first row
    sibling = negated(batch.q[first : first + rows])  # [n, H, D] the longest's q rows negated
    own = batch.block_table[longest]  # [W] its block-table row
    full = s_max // P  # its full pages
    # the partial sibling (where it has a full page): its first ceil(f / 2) pages, then its first max(1, f // 2)
    # again, max(f, 2) P tokens (>= q_len: a request of f = 1 full page has P + r >= q_len tokens, r < P)
    prefix = torch.cat([own[: (full + 1) // 2], own[: full // 2 or 1]]) if full else own[:0]  # [max(f, 2) or 0]
    siblings = [(own, s_max)] + ([(prefix, prefix.shape[0] * P)] if full else []) + [(own, s_max)]
    width = max(batch.block_table.shape[1], prefix.shape[0])
    table = torch.full((B + len(siblings), width), INVALID_PAGE, dtype=own.dtype, device=batch.device)
    table[1 : B + 1, : own.shape[0]] = batch.block_table  # [B, W] the case's requests, after the first sibling
    for i, (pages, _) in zip((0, *range(B + 1, B + len(siblings))), siblings):
        table[i, : pages.shape[0]] = pages
    as_field = dict(dtype=batch.seq_lens.dtype, device=batch.device)  # seq_lens and q_lens: int32 on q's device
    lengths = [length for _, length in siblings]
    sib_rows = torch.tensor([rows] * (len(siblings) - 1), **as_field)  # [siblings - 1] the later siblings' q_lens
    shared = batch.replace(
        q=torch.cat([sibling, batch.q, *[sibling] * (len(siblings) - 1)]),  # [T + (2 or 3) n, H, D]
        block_table=table,  # [B + 2 or 3, W or wider]
        seq_lens=torch.cat([torch.tensor(lengths[:1], **as_field), batch.seq_lens,
                            torch.tensor(lengths[1:], **as_field)]),  # [B + 2 or 3]
        q_lens=torch.cat([sib_rows[:1], batch.q_lens, sib_rows]),  # [B + 2 or 3]
    )
    added = (0, *range(B + 1, B + len(siblings)))
    return RegroupedBatch(shared, batch, torch.arange(B), torch.arange(batch.num_tokens, device=batch.device),
                          "shared", offset=rows, added=added)
