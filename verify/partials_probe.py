"""The partials probe: a decode whose output is tiny while each split's partial output is not, so that the output
shows how a kernel stores and merges its split-KV partials (the ``partials`` check,
`verify.checks.check_partials`; numerics.md §5(i)).

On drawn data a kernel that stores its split outputs in bf16 (FlashInfer's MLA does: ``partial_o`` is its output
dtype) while it declares fp32 ones hides under the tier-1 bound: each partial carries 2^-9 |o_S|, the merged output
2^-8 |ô| of its own rounding, and the two are of one size (45 and 47 of 100 campaign cases caught the
``bf16_partials`` mutant). The probe keeps the batch's lengths, query rows, pages, block table and NaN padding, and
writes
    q            = 0 on every channel (fp8 q: q_scale = 1)     every score is exactly 0, so P is one value for every
                                                              token whatever the kernel's exp and P format do
    c_kv[j, c]   = y_jc + g b_j,   k_pe = 0                    (fp8 cache: kv_scale = 13/16, below)
where g is the cache format's spacing in [1/2, 1) (bf16 2^-8, e4m3fn 2^-4), b_j = 1 on the tokens j ≡ 0 mod P,
P = 3 max(1, 256 g) (every 3rd token for bf16, every 48th for e4m3fn: the offsets average to about 2^-8 / 3 in
formats with g >= 2^-8), and y_jc = g round(α_c w_j / g), α_c = 1/2 + c / (4L), with w antisymmetric over the
s0 = s - q_len + 1 tokens every query row of the request sees: w_j = cos(π (j + 1/2) / s0) in the first half,
w_{s0-1-j} = -w_j, 0 at the middle of an odd s0 and on the later tokens (seen by the later MTP rows). A request with
s0 < 2 has no antisymmetric part: its tokens hold 0 and no offset (with the offsets alone, an output and its
pieces' means are of one size, and a kernel that stores partials more finely than declared reached 0.25 of the bound
there from its output rounding alone, against 0.29-0.73 for partials stored as declared). Every value is
a multiple of g below 1 in magnitude, so exact in the cache format, and the oracle's sums are exact. Then
    ô_c = κ g (number of b_j = 1 that the row sees) / n_vis ≈ κ 2^-8 / 3,    lse = ln n_vis,
(κ = kv_scale, 1 for a 16-bit cache) while a piece of a split row holds κ times the mean of y over its tokens:
about α_c 2/π for a half, up to about 3/4 for shorter pieces. Stored in bf16 it carries up to 2^-9 of that, which the
merge leaves in the output, against a bound that (P being one value, `verify.bounds.kernel_bound`'s uniform_p) is
only accumulation and merge rounding, a few 2^-24 per token of Σ p|v|, and u_out |ô| of output rounding.

Why κ = 13/16 on fp8 caches: codes of 4 significant bits on a grid of 2^-4 sum to few bits, so over pieces of up to
a few hundred tokens (power-of-two lengths) fp16 holds a piece's mean exactly and fp16 partials showed nothing (a
review: err/bound 0.0 on rows of 128-512 tokens). 13/16 is a value of bf16, fp16 and the fp8 formats, and code x
13/16 has at most 8 significant bits (exact in bf16 and fp16: kernels that scale before the MMA are charged nothing
more), so a kernel that applies the scale before it stores its partials needs four more bits for them (the same
rows: 5.2-9.3). One that applies it after its merge stores the unscaled means: there fp16 partials can still pass.

Why the offsets g b_j: with ô = 0 exactly, a row cut into two pieces of equal length would have o_2 = -o_1, whose
roundings cancel exactly, and so would mirrored pieces of w in any even cut. The offsets make o_1 + o_2 = 2ô, a
fraction of g that is no multiple of the partials' spacing, so their rounding errors are independent.

What it cannot see: rows the kernel does not split (no partials to store); pieces of one token, or whose mean is a
value of the partials' format; a merge that weighs pieces of equal length wrongly, or a split lse that drops the
piece's running max (0 here: each piece's lse is ln of its length), both of which tier 1 catches on drawn data; and
less on long rows, where the declared
per-token accumulation charge grows (numerics.md §5(i) has the measured reach).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_ref.decode import DecodeBatch
from verify.rounding_probe import probe_batch

KV_SCALE = 13 / 16  # the probe's kv_scale on fp8 caches (module docstring)


@dataclass(frozen=True)
class PartialsProbe:
    """The probe batch and what it was built from.

    Attributes:
        batch: the probe `DecodeBatch` (the input's lengths, pages and padding, the probe's values).
        g: the grid step of the values (the cache format's spacing in [1/2, 1)).
        period: P, the offset g sits on the tokens j ≡ 0 mod P.
        alpha: [L] fp64, the per-channel amplitude α_c.
    """

    batch: DecodeBatch
    g: float
    period: int
    alpha: torch.Tensor

    def describe(self) -> str:
        kappa = self.batch.kv_scale or 1.0
        return (f"partials probe: all scores 0, values antisymmetric over the tokens every row sees plus "
                f"{self.g:g} on tokens j = 0 mod {self.period}" + (f", kv_scale {kappa:g}" if kappa != 1 else "")
                + f" (out about {kappa * self.g / self.period:.3g}, a half row's mean about "
                f"{kappa * 2 / math.pi * float(self.alpha.mean()):.2f}, shorter pieces' up to {kappa * 0.75:.2f})")


def antisymmetric_weights(j: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """w [N] fp64 of positions j [N] in rows of s0 [N] >= 1 tokens (j < s0): cos(π (j + 1/2) / s0) for j in the
    first half, its exact negative at the mirrored position s0 - 1 - j, 0 at the middle of an odd s0."""
    mirror = s0 - 1 - j  # [N]
    k = torch.minimum(j, mirror).double()  # [N] position in the first half
    sign = torch.sign((mirror - j).double())  # [N] +1 first half, -1 second, 0 middle
    return sign * torch.cos(math.pi * (k + 0.5) / s0.double())  # [N]


def grid_step(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s values in [1/2, 1) (half its machine epsilon): every multiple of it below 1 in
    magnitude is a value of the format (bf16 2^-8, fp16 2^-11, e4m3fn and e4m3fnuz 2^-4, e5m2 2^-3; fp32 and fp64
    2^-24 and 2^-53)."""
    return torch.finfo(dtype).eps / 2


def offset_period(g: float) -> int:
    """P = 3 max(1, 256 g): the offsets g on every P-th token average to about 2^-8 / 3 for the formats with
    g >= 2^-8 (bf16, the fp8 formats), g / 3 for finer ones (fp16, fp32)."""
    return 3 * max(1, round(256 * g))


def partials_probe(batch: DecodeBatch) -> PartialsProbe | str:
    """The probe of ``batch`` (module docstring), or why it has none: no request whose every query row sees two
    tokens. Two host syncs (the lengths, then the token addresses); the cache's values are written by
    `verify.rounding_probe.probe_batch`."""
    seq = batch.seq_lens.long()  # [B]
    s0 = batch.visible_tokens()[batch.qo_indptr[:-1].long()]  # [B] what each request's first (so every) row sees
    if batch.batch_size == 0 or int(s0.max()) < 2:
        return "no request whose every query row sees two tokens (one token has nothing to split)"
    T, H, D = batch.q.shape
    L, dev = batch.kv_lora_rank, batch.device
    g = grid_step(batch.kv_cache.dtype)
    alpha = 0.5 + torch.arange(L, dtype=torch.float64) / (4 * L)  # [L] in [1/2, 3/4)

    pages, slots, positions = batch.token_addresses()  # [N] each
    s0_tok = torch.repeat_interleave(s0, seq, output_size=len(positions))  # [N] s0 of each token's request
    w = torch.where(positions < s0_tok, antisymmetric_weights(positions, s0_tok.clamp(min=1)), 0.0)  # [N]
    y = g * torch.round(w[:, None] * alpha.to(dev) / g)  # [N, L] multiples of g, |y| <= 3/4; round is symmetric
    period = offset_period(g)
    offset = g * ((positions % period == 0) & (s0_tok >= 2)).double()  # [N] none where w has no antisymmetric part
    rows = torch.zeros(len(w), D, dtype=torch.float64, device=dev)  # [N, D] k_pe = 0
    rows[:, :L] = y + offset[:, None]  # [N, L] multiples of g below 1: exact in the cache format
    q = torch.zeros(T, H, D, dtype=torch.float64)  # [T, H, D] every score 0
    return PartialsProbe(probe_batch(batch, q, pages, slots, rows, kv_scale=KV_SCALE), g, period, alpha)
