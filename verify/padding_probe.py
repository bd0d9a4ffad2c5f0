"""The padding probe: the case's batch with every unused slot of a request's last page holding a finite token that
the rows of that request prefer by far to their own (the ``padding`` check, `verify.checks.check_padding`).

Built batches poison the slots past each request's length with NaN, and a kernel that reads them into its output
fails. But NaN hides one kind of read: a max. GPU max instructions (``fmaxf``, Triton's ``tl.max``, which lowers to
``maxnumf``) drop NaN, so a kernel whose tile max runs over every slot it loaded, before the length mask, passes on
NaN padding; in serving those slots hold stale finite tokens of an earlier request, and one that scores 90 above a
row's own tokens flushes them all to 0 in fp32 (the row comes out 0 or NaN, its lse wrong). The probe writes, into
the unused slots of each request's last page, tokens that its query rows score MARGIN (200) nats above their lse
or more, as far as the cache format allows, so that a max over padded slots shifts the rows' own tokens past fp32's
smallest subnormal (e^-103.3). A request's m (row, head)s are dealt round-robin into G = min(free slots, m) groups
(one row each wherever the slots suffice), and group g's token fills the free slots i with i = g mod G:

- 16-bit and wider caches: the minimum-norm solution of σ q_r · k = lse_r + MARGIN over the group's rows r
  (`torch.linalg.pinv`; exact while a group has at most 576 independent rows);
- fp8 caches, whose range binds (|k| <= the format's max x kv_scale): for one row, k = sign(σ q_r) times the
  smaller of that bound and (lse_r + MARGIN) / |σ q_r|_1 (the most any token in range can score, capped at the
  target); for several, the k in range that maximizes the group's smallest σ q_r · k - lse_r up to MARGIN (a linear
  program, `scipy.optimize.linprog`, whose optimum may overshoot it) over the group's first LP_ROWS rows (the others
  take that token as it falls); then rounded to the format.

lse_r is the oracle's (a row that sees no token takes 0). `PaddingProbe.margin` is the smallest best hostile score
minus lse over the probed rows, as written: fp8's range, and groups of more rows than channels, reach less (a row
whose margin is below 0 is not probed; `PaddingProbe.unprobed` counts them).

A kernel whose tile spans several pages (pages smaller than its tile) may also load the block-table entries past a
request's last page, masked to page 0 (``other=0``) or clamped to the last page: the probe therefore moves every
page up by one (the block table's used entries + 1, its unused ones as built) and adds a page in front (page 0)
and one at the end, whose slots the k requests share in turn: slot i holds request i mod k's token i // k, each
request's tokens dealt from its rows as above for its ceil(page_size / k) slots (every request gets a slot where
the page has k or more; a request with a full last page too).

Nothing else changes: the lengths, q, the scales and every token, so a kernel must give the bits of its run on the
NaN-padded batch (a kernel that declares run-to-run variation: the tier-1 bound). Pages no request names keep their
NaN: reading one is an addressing bug, which NaN already shows. Only a batch without a request that has both tokens
and query rows is not probed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linprog

from mla_ref.decode import DecodeBatch, is_fp8
from mla_ref.fp8 import fp8_format, quantize
from verify.next_step import used_slots

MARGIN = 200.0  # nats above each row's lse: e^-200 is far below fp32's smallest subnormal, e^-103.3
# rows of a group that fp8's linear program takes, above the smoke prefix's largest group (144: 9 MTP rows x 128
# heads over 8 free slots): the edge pages' group of a request's 4 x 128 (row, head)s took 1.3 s a program on one
# CPU thread, 178 s for the long cases' 132 such requests (seventy-second session); 256 rows take about 0.3 s
LP_ROWS = 256


@dataclass(frozen=True)
class PaddingProbe:
    """The probe batch and what it reached.

    Attributes:
        batch: the case's values with hostile tokens in its requests' unused last-page slots and on two added pages
            (page 0 and the last; the case's pages moved up by one, its block table's used entries with them).
        slots: how many last-page slots were written.
        margin: min over the probed requests' (row, head)s that see a token of their best hostile score σ q · k
            minus lse (nats), as written; inf where no such row.
        unprobed: how many of those rows have a margin below 0 (no hostile token above their lse).
        rows: how many rows were probed (seeing a token, in a request with an unused last-page slot).
    """

    batch: DecodeBatch
    slots: int
    margin: float
    unprobed: int
    rows: int

    def describe(self) -> str:
        below = f", {self.unprobed} of {self.rows} rows below their lse (not probed)" if self.unprobed else ""
        slots = (f"{self.slots} unused last-page slots hold finite tokens that the rows of their request score at "
                 f"least {self.margin:.1f} above their lse{below}" if self.slots else "no unused last-page slot")
        return (f"padding probe: {slots}; pages 0 and last added with such tokens (where a tile past a request's "
                "last page reads), the case's pages moved up by one (NaN elsewhere as built)")


def min_norm_token(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[D] fp64: the minimum-norm k with scores k = lse + MARGIN in the least-squares sense, for the score matrix
    scores [m, D] (σ times the dequantized q rows, fp64) and lse [m] (-inf, a row that sees nothing: 0)."""
    target = torch.where(torch.isfinite(lse), lse, 0.0) + MARGIN  # [m]
    return torch.linalg.pinv(scores) @ target  # [D]


def bounded_token(scores: torch.Tensor, lse: torch.Tensor, bound: float) -> torch.Tensor:
    """[D] fp64: a k with |k| <= bound in every channel that maximizes min_r (scores k - lse)_r up to MARGIN, for
    scores [m, D] and lse [m] as in `min_norm_token`. One row: sign(scores) times the smaller of the bound and
    (lse + MARGIN) / |scores|_1, in closed form; several: a linear program in (k, t), maximize t subject to
    scores k - t >= lse, t <= MARGIN."""
    m, D = scores.shape
    lse = torch.where(torch.isfinite(lse), lse, 0.0)  # [m]
    if m == 1:
        size = float(scores.abs().sum())
        level = bound if size == 0 else min(bound, float(lse[0] + MARGIN) / size)
        return torch.sign(scores[0]) * max(level, 0.0)  # [D]
    cost = np.zeros(D + 1)
    cost[-1] = -1.0  # maximize t
    a_ub = np.hstack([-scores.numpy(), np.ones((m, 1))])  # [m, D + 1]: t - scores k <= -lse
    res = linprog(cost, A_ub=a_ub, b_ub=-lse.numpy(), bounds=[(-bound, bound)] * D + [(None, MARGIN)],
                  method="highs")
    if res.status != 0:  # always feasible (k = 0, t = min(-lse)) and bounded: a solver failure is ours
        raise RuntimeError(f"padding probe: linprog failed: {res.message}")
    return torch.from_numpy(res.x[:D])  # [D]


def _codes(k: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
    """k [..., D] fp64 as codes of the cache's format, saturating (fp8: with the batch's kv_scale)."""
    dtype = batch.kv_cache.dtype
    if is_fp8(dtype):
        return quantize(k, dtype, scale=batch.kv_scale)[0]
    big = torch.finfo(dtype).max
    return k.clamp(-big, big).to(dtype)


def hostile_tokens(scores: torch.Tensor, lse: torch.Tensor, free: int, batch: DecodeBatch) -> torch.Tensor:
    """[free, D] codes of the cache's format for a request's ``free`` unused slots, from its score matrix
    scores [m, D] and its rows' lse [m] (module docstring): slot i holds group i mod G's token."""
    G = min(free, scores.shape[0])  # groups of rows: one token each
    if is_fp8(batch.kv_cache.dtype):
        bound = fp8_format(batch.kv_cache.dtype).max * batch.kv_scale  # the largest value the cache holds
        tokens = [bounded_token(scores[g::G][:LP_ROWS], lse[g::G][:LP_ROWS], bound) for g in range(G)]
    else:
        tokens = [min_norm_token(scores[g::G], lse[g::G]) for g in range(G)]
    return _codes(torch.stack(tokens), batch)[torch.arange(free) % G]  # [free, D]


def padding_probe(batch: DecodeBatch, lse: torch.Tensor, last_pages: bool = True) -> PaddingProbe | str:
    """The probe of ``batch`` (module docstring) for its oracle's ``lse`` [T, H], or why it has none: no request
    with tokens and query rows. The hostile tokens are solved for in fp64 on the CPU. ``last_pages`` False: the
    edge pages alone, the last pages' unused slots left NaN (``slots`` 0), to tell which of the two reads moved a
    kernel (`verify.checks.check_padding`)."""
    ps, dev, P = batch.page_size, batch.device, batch.num_pages
    lse = lse.detach().double().cpu()  # [T, H]
    q = batch.dequantized_q().cpu()  # [T, H, D] fp64
    D = q.shape[-1]
    qo, table = batch.qo_indptr.tolist(), batch.block_table.cpu()
    used = used_slots(batch).cpu()  # [P, ps] slots holding some request's token
    cache = batch.kv_cache.new_empty((P + 2,) + tuple(batch.kv_cache.shape[1:]))  # [P + 2, ps, D]
    cache[1 : P + 1] = batch.kv_cache  # the case's pages, moved up by one
    probed, rows = [], []  # (scores, lse, last page in the probe, free slots [ps] bool) of each; (scores, lse) of all
    for b, s in enumerate(batch.seq_lens.tolist()):
        if s == 0 or qo[b] == qo[b + 1]:  # no tokens or no query row
            continue
        last = int(table[b, (s - 1) // ps])
        free = ~used[last]  # [ps] the last page's slots no request uses
        scores = batch.sm_scale * q[qo[b] : qo[b + 1]].reshape(-1, D)  # [n_b H, D]
        lse_b = lse[qo[b] : qo[b + 1]].reshape(-1)  # [n_b H]
        rows.append((scores, lse_b))
        if last_pages and bool(free.any()):
            cache[last + 1, free.to(dev)] = hostile_tokens(scores, lse_b, int(free.sum()), batch).to(dev)  # [free, D]
            probed.append((scores, lse_b, last + 1, free))
    if not rows:
        return "no request with tokens and query rows"
    share = -(-ps // len(rows))  # each request's edge slots, ceil
    edge = torch.stack([hostile_tokens(scores, lse_b, share, batch) for scores, lse_b in rows], dim=1)  # [share, k, D]
    edge = edge.reshape(-1, D)[:ps]  # [ps, D] slot i: request i mod k's token i // k
    cache[0], cache[P + 1] = edge.to(dev), edge.to(dev)
    moved = torch.where(batch.used_entries, batch.block_table + 1, batch.block_table)  # [B, W] unused as built
    probe = batch.replace(kv_cache=cache, block_table=moved)
    scale = batch.kv_scale if is_fp8(cache.dtype) else 1.0
    margins = []
    for scores, lse_b, last, free in probed:  # what was written, read back (a page two requests end on: the later's)
        seen = torch.isfinite(lse_b)  # [n_b H] rows that see a token
        k = cache[last].cpu()[free].double() * scale  # [free, D] dequantized
        best = (scores[seen] @ k.T).amax(dim=1)  # [rows] each row's best hostile score
        margins.append(best - lse_b[seen])
    margin = torch.cat(margins) if margins else torch.zeros(0, dtype=torch.float64)  # [probed rows]
    return PaddingProbe(probe, int(sum(int(f.sum()) for *_, f in probed)),
                        float(margin.min()) if margin.numel() else float("inf"), int((margin < 0).sum()),
                        margin.numel())
