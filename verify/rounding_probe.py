"""The rounding probe: a decode built so that its output shows how a kernel rounds P before P.V (the ``rounding``
check, `verify.checks.check_rounding`; numerics.md §5(h)).

On drawn data a kernel that rounds P to bf16 while it declares fp32 P hides under the tier-1 bound: its error is a
random walk of 2^-9-relative terms, the bound charges bf16 output rounding (2^-8 |ô|) and score errors over 576
channels, and the two are of one size (13 of 60 campaign cases caught). The probe makes the output small while P's
rounding error is not. It keeps the batch's lengths, query rows, pages, block table and NaN padding, and writes
    q[t, h]        = -x_h on the first rope channel (index L), 0 on every other channel (fp8 q: q_scale = 1)
    token 0        c_kv = a, k_pe = 0                         score 0
    token 1        c_kv = b, k_pe[0] = 1                      score -t_h,  t_h = σ x_h
    tokens 2, 3    tokens 0 and 1 again, where every query row of the request sees them (s0 = s - q_len + 1 >= 4)
    the others     c_kv = 0, k_pe[0] = 1                      score -t_h (they add to the row sum only)
(fp8 cache: kv_scale = 1), where channel c of c_kv belongs to head h(c) = c mod H, b_c = ±1 (the sign alternates
every H channels) and a_c = -b_c Q(p_h(c)): p_h = e^-t_h, Q rounding to the cache's format, so a is exact there. Each
score is one exact product (q and k_pe hold x_h and 1, exact in every format; the other channels add exact zeros), so
a kernel's score error is its fp32 scale multiply and exp, a few 2^-23 of t_h. On head h's own channels, with n = 1
or 2 pairs (a, b) that the row sees,
    ô_c = n b_c (p_h - Q(p_h)) / l_h,   l_h = n + (s - n) p_h,
a small difference; a kernel that rounds P = p_h to a format F before P.V moves it by b_c (F(p_h) - p_h) / l_h per
pair: all of ô_c when F is the cache's format, and about F's unit roundoff of p_h otherwise, both far above the tier-1
bound of an fp32-P kernel, which is then a few 2^-23 of Σ p|v| plus 2^-8 |ô_c|. A kernel that declares its P
rounding (``KernelNumerics.p_fmt``) gets u_P Σ p|v| for it, so the probe tells a P rounded more coarsely than
declared (bf16 under fp32, fp8 under bf16 or fp16) from one rounded as declared (tests/test_rounding_probe.py).

t_h lies in [2^-8, 2^-4]: small scores keep ω (§5(b)) small against that error. x_h = m 2^e with m in
{1, 1.25, 1.5, 1.75} (exact in bf16, fp16, e4m3fn, e4m3fnuz and e5m2), chosen so that p_h lies far from bf16 and
fp16 values, and from e4m3fn ones (the heads take the candidates in that order, cyclically).

Why two pairs: a kernel whose split or tile boundary falls between a pair's tokens weighs its second token against
itself (token 1 is then the maximum of its own piece, P = 1 exactly): one that tiles from the row's end cuts there on
rows of s ≡ 1 modulo its tile. Such a boundary cannot cut both pairs unless tiles are of one or two tokens.

What it cannot see (numerics.md §5(h)): P on rows of one token (P = 1); a boundary between tokens 0 and 1 in a
request with a query row that sees fewer than 4 tokens (s0 = s - q_len + 1 < 4: no second pair there); and less on
long rows, where
the declared per-token P.V charge grows while the signal falls as 1/l (bf16 P under an fp32 declaration fails up to
about 8192 tokens, fp16 under fp32 up to about 1000). A case fails through its shortest probed request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_ref.decode import DecodeBatch, is_fp8
from mla_ref.fp8 import round_p, round_to

T_RANGE = (2.0**-8, 2.0**-4)  # the probe's score gaps t_h = σ x_h
_MANTISSAS = (1.0, 1.25, 1.5, 1.75)  # two significant bits: exact in every q format
# the largest rounding error in [0.5, 1) (half the spacing there) of the P formats the candidates keep away from
_HALF_SPACING = {"bf16": 2.0**-9, "fp16": 2.0**-12, "e4m3fn": 2.0**-5}


@dataclass(frozen=True)
class RoundingProbe:
    """The probe batch and what it was built from.

    Attributes:
        batch: the probe `DecodeBatch` (the input's lengths, pages and padding, the probe's values).
        x: [H] fp64, the magnitude of q's rope channel per head (q holds -x).
        p: [H] fp64, e^-(σ x): token 1's softmax weight relative to token 0's.
    """

    batch: DecodeBatch
    x: torch.Tensor
    p: torch.Tensor

    def describe(self) -> str:
        t = self.batch.sm_scale * self.x  # [H]
        return (f"rounding probe: tokens 0 (and 2) against {self.batch.num_heads} score gaps t in "
                f"[{float(t.min()):.4g}, {float(t.max()):.4g}], outputs that cancel to the cache format's rounding "
                "of e^-t")


def probe_x(sm_scale: float, heads: int, q_dtype: torch.dtype) -> torch.Tensor | None:
    """[heads] fp64 x_h of the probe: candidates m 2^e with σ m 2^e in T_RANGE and exact in q_dtype, ordered by how
    far p = e^-(σ x) lies from bf16, fp16 and e4m3fn values (the smallest of its three rounding errors, each in units
    of that format's largest one in [0.5, 1), largest first), assigned to the heads cyclically. None when no
    candidate exists for this σ (fp8 q: σ above about 2^-4 / 2^-9 = 32 for e4m3fn)."""
    lo, hi = T_RANGE
    exponents = range(math.floor(math.log2(lo / sm_scale)) - 1, math.ceil(math.log2(hi / sm_scale)) + 1)
    x = torch.tensor([m * 2.0**e for e in exponents for m in _MANTISSAS], dtype=torch.float64)  # [n]
    x = x[(sm_scale * x >= lo) & (sm_scale * x <= hi) & (round_to(x, q_dtype) == x)]  # [n'] values of q_dtype
    if not len(x):
        return None
    p = torch.exp(-sm_scale * x)  # [n']
    far = torch.stack([(round_p(p, f) - p).abs() / h for f, h in _HALF_SPACING.items()]).amin(dim=0)  # [n'] [0, 1]
    x = x[torch.argsort(far, descending=True, stable=True)]  # [n'] best first
    return x[torch.arange(heads) % len(x)]  # [heads]


def rounding_probe(batch: DecodeBatch) -> RoundingProbe | str:
    """The probe of ``batch`` (module docstring), or why it has none: no request has two tokens, no rope channel,
    or no x_h for this σ and q dtype. Two host syncs (the lengths, then the token addresses)."""
    if batch.batch_size == 0 or int(batch.seq_lens.max()) < 2:
        return "no request has two tokens (a row that sees one token has P = 1)"
    if batch.rope_dim == 0:
        return "no rope channel (kv_lora_rank = head_dim) to carry the scores"
    T, H, D = batch.q.shape
    L, dev = batch.kv_lora_rank, batch.device
    x = probe_x(batch.sm_scale, H, batch.q.dtype)  # [H]
    if x is None:
        return f"no x exact in q's {batch.q.dtype} puts sm_scale {batch.sm_scale:g} x in [2^-8, 2^-4] (fp8 q: scale 1)"
    p = torch.exp(-batch.sm_scale * x)  # [H] e^-t_h
    q = torch.zeros(T, H, D, dtype=torch.float64)  # [T, H, D]
    q[:, :, L] = -x  # every row of head h: score -t_h against k_pe[0] = 1

    c = torch.arange(L)  # [L] c_kv channels
    b = torch.where((c // H) % 2 == 0, 1.0, -1.0).double()  # [L] ±1
    a = -b * round_to(p[c % H], batch.kv_cache.dtype)  # [L] exact in the cache's format
    rows = torch.zeros(3, D, dtype=torch.float64)  # [3, D] token 0, token 1, the others
    rows[0, :L] = a
    rows[1, :L], rows[1, L] = b, 1.0
    rows[2, L] = 1.0

    pages, slots, positions = batch.token_addresses()  # [N] each
    seq = batch.seq_lens.long()  # [B]
    s0 = batch.visible_tokens()[batch.qo_indptr[:-1].long()]  # [B] what each request's first (so every) row sees
    s0_tok = torch.repeat_interleave(s0, seq, output_size=len(positions))  # [N] s0 of each token's request
    second = (s0_tok >= 4) & (positions >= 2) & (positions <= 3)  # [N] tokens 2 and 3: the second pair
    token_rows = rows.to(dev)[torch.where(second, positions - 2, positions.clamp(max=2))]  # [N, D]
    return RoundingProbe(probe_batch(batch, q, pages, slots, token_rows), x, p)  # q exact: x_h is in q's format


def probe_batch(batch: DecodeBatch, q: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor,
                token_rows: torch.Tensor, kv_scale: float = 1.0) -> DecodeBatch:
    """``batch`` (its lengths, query rows, pages, block table) with a probe's values: q [T, H, D] fp64 and, at
    (pages, slots) of `DecodeBatch.token_addresses`, token_rows [N, D] fp64, both exact in the batch's dtypes.
    Unused cache slots keep their NaN; fp8 q gets q_scale 1, an fp8 cache ``kv_scale``."""
    kv = batch.kv_cache.clone()  # [P, ps, D] unused slots keep their NaN
    kv[pages, slots] = token_rows.to(kv.dtype)  # [N, D] exact
    scales = {}
    if is_fp8(batch.q.dtype):
        scales["q_scale"] = 1.0
    if is_fp8(batch.kv_cache.dtype):
        scales["kv_scale"] = kv_scale
    return batch.replace(q=q.to(batch.device, batch.q.dtype), kv_cache=kv, **scales)
