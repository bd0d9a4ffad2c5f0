"""The padding probe: the case's batch with every unused slot of a request's last page holding a finite token that
the rows of that request prefer by far to their own (the ``padding`` check, `verify.checks.check_padding`).

Built batches poison the slots past each request's length with NaN, and a kernel that reads them into its output
fails. But NaN hides one kind of read: a max. GPU max instructions (``fmaxf``, Triton's ``tl.max``, which lowers to
``maxnumf``) drop NaN, so a kernel whose tile max runs over every slot it loaded, before the length mask, passes on
NaN padding; in serving those slots hold stale finite tokens of an earlier request, and one that scores 90 above a
row's own tokens flushes them all to 0 in fp32 (the row comes out 0 or NaN, its lse wrong). The probe writes, into
the unused slots of each request's last page, tokens that every query row of that request scores MARGIN (200)
nats above its own lse, as far as the cache format allows, so that a max over padded slots shifts the row's own
tokens past fp32's smallest subnormal (e^-103.3):

- 16-bit and wider caches: one token, the minimum-norm solution of σ q_r · k = lse_r + MARGIN over every (row,
  head) r of the request (`torch.linalg.pinv`; exact while the request has at most 576 of them, independent);
- fp8 caches, whose range binds (|k| <= the format's max x kv_scale): the m (row, head)s dealt round-robin into
  G = min(free slots, ceil(m / GROUP_ROWS)) groups, and the token of group g, written into the free slots i with
  i = g mod G, maximizes the group's smallest σ q_r · k - lse_r up to MARGIN within that range (a linear program,
  `scipy.optimize.linprog`), then is rounded to the format (its optimum mostly sits at ±max, exact there).

lse_r is the oracle's (a row that sees no token takes 0). `PaddingProbe.margin` is the smallest best hostile score
minus lse over the probed rows as written (after rounding): the fp8 range and rows past 576 reach less, and a
row with margin < 0 is not probed; the check reports it.

Nothing else changes: the lengths, pages, q, the block table, the scales and the tokens, so a kernel must give the
bits of its run on the NaN-padded batch (a kernel that declares run-to-run variation: the tier-1 bound). Pages no
request names keep their NaN: reading one is an addressing bug, which NaN already shows. A request whose last page
is full (or that has no tokens) has no unused slot: with none in the batch the probe is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linprog

from mla_ref.decode import DecodeBatch, is_fp8
from mla_ref.fp8 import fp8_format, quantize

MARGIN = 200.0  # nats above each row's lse: e^-200 is far below fp32's smallest subnormal, e^-103.3
GROUP_ROWS = 32  # (row, head)s per fp8 token's linear program: its time grows fast with them (128: 0.1 s, 512: 1.4 s)


@dataclass(frozen=True)
class PaddingProbe:
    """The probe batch and what it reached.

    Attributes:
        batch: the case's batch with hostile tokens in its requests' unused last-page slots (its own tensors
            elsewhere: only the cache is a copy).
        slots: how many slots were written.
        margin: min over the probed requests' (row, head)s of σ q · k - lse (nats), after rounding to the cache
            format; inf where every probed row sees no token.
    """

    batch: DecodeBatch
    slots: int
    margin: float

    def describe(self) -> str:
        return (f"padding probe: {self.slots} unused last-page slots hold a finite token that every row of its "
                f"request scores at least {self.margin:.1f} above its lse (NaN elsewhere as built)")


def min_norm_token(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[D] fp64: the minimum-norm k with scores k = lse + MARGIN in the least-squares sense, for the score matrix
    scores [m, D] (σ times the dequantized q rows, fp64) and lse [m] (-inf, a row that sees nothing: 0)."""
    target = torch.where(torch.isfinite(lse), lse, 0.0) + MARGIN  # [m]
    return torch.linalg.pinv(scores) @ target  # [D]


def bounded_token(scores: torch.Tensor, lse: torch.Tensor, bound: float) -> torch.Tensor:
    """[D] fp64: a k with |k| <= bound in every channel that maximizes min_r (scores k - lse)_r up to MARGIN, for
    scores [m, D] and lse [m] as in `min_norm_token` (a linear program in (k, t): maximize t subject to
    scores k - t >= lse, t <= MARGIN)."""
    m, D = scores.shape
    lse = torch.where(torch.isfinite(lse), lse, 0.0).numpy()  # [m]
    cost = np.zeros(D + 1)
    cost[-1] = -1.0  # maximize t
    a_ub = np.hstack([-scores.numpy(), np.ones((m, 1))])  # [m, D + 1]: t - scores k <= -lse
    res = linprog(cost, A_ub=a_ub, b_ub=-lse, bounds=[(-bound, bound)] * D + [(None, MARGIN)], method="highs")
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
    scores [m, D] and its rows' lse [m] (module docstring)."""
    if not is_fp8(batch.kv_cache.dtype):
        return _codes(min_norm_token(scores, lse), batch).expand(free, -1)  # [free, D]
    bound = fp8_format(batch.kv_cache.dtype).max * batch.kv_scale  # the largest value the cache holds
    G = min(free, -(-scores.shape[0] // GROUP_ROWS))  # groups of rows: one token each
    tokens = torch.stack([bounded_token(scores[g::G], lse[g::G], bound) for g in range(G)])  # [G, D]
    return _codes(tokens, batch)[torch.arange(free) % G]  # [free, D] slot i holds group i mod G's token


def padding_probe(batch: DecodeBatch, lse: torch.Tensor) -> PaddingProbe | str:
    """The probe of ``batch`` (module docstring) for its oracle's ``lse`` [T, H], or why it has none: no request
    with an unused slot on its last page. The hostile tokens are solved for in fp64 on the CPU."""
    ps, dev = batch.page_size, batch.device
    lse = lse.detach().double().cpu()  # [T, H]
    q = batch.dequantized_q().cpu()  # [T, H, D] fp64
    D = q.shape[-1]
    qo, table = batch.qo_indptr.tolist(), batch.block_table.cpu()
    used = torch.zeros(batch.kv_cache.shape[:2], dtype=torch.bool)  # [P, ps] slots holding some request's token
    pages, slots, _ = batch.token_addresses()  # [N] each
    used[pages.cpu(), slots.cpu()] = True
    cache = batch.kv_cache.clone()  # [P, ps, D] the probe's: the case's stays as built
    probed = []  # (request, its last page, that page's free slots [ps] bool)
    for b, s in enumerate(batch.seq_lens.tolist()):
        if s % ps == 0 or qo[b] == qo[b + 1]:  # no tokens, a full last page, or no query row
            continue
        last = int(table[b, (s - 1) // ps])
        free = ~used[last]  # [ps] the last page's slots no request uses
        if not bool(free.any()):
            continue
        scores = batch.sm_scale * q[qo[b] : qo[b + 1]].reshape(-1, D)  # [n_b H, D]
        tokens = hostile_tokens(scores, lse[qo[b] : qo[b + 1]].reshape(-1), int(free.sum()), batch)  # [free, D]
        cache[last, free.to(dev)] = tokens.to(dev)
        probed.append((b, last, free))
    if not probed:
        return "no request has an unused slot on its last page (every length a multiple of the page size)"
    probe = batch.replace(kv_cache=cache)
    scale = batch.kv_scale if is_fp8(cache.dtype) else 1.0
    margin = float("inf")
    for b, last, free in probed:  # what was written, read back (a page two requests end on holds the later's)
        q_rows = q[qo[b] : qo[b + 1]].reshape(-1, D)  # [n_b H, D]
        lse_rows = lse[qo[b] : qo[b + 1]].reshape(-1)  # [n_b H]
        seen = torch.isfinite(lse_rows)  # [n_b H] rows that see a token
        if bool(seen.any()):
            k = cache[last].cpu()[free].double() * scale  # [free, D] dequantized
            best = (batch.sm_scale * q_rows[seen] @ k.T).amax(dim=1)  # [rows] each row's best hostile score
            margin = min(margin, float((best - lse_rows[seen]).min()))
    return PaddingProbe(probe, int(sum(int(f.sum()) for _, _, f in probed)), margin)
