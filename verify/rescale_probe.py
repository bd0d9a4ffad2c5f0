"""The rescale probe: a decode built so that its output shows how a kernel rounds the factor exp(m_old - m_new)
by which an online softmax rescales its running output when the running max rises (the ``rescale`` check,
`verify.checks.check_rescale`).

A kernel that hands that factor from its softmax warps to its correction warps in bf16 (shared memory kept small)
while its row sum takes the fp32 one adds an undeclared rounding of up to 2^-9 per rise. On drawn data it hides under
the tier-1 bound's output rounding, and the rounding probe cannot see it: there token 0 holds the highest score, so
the running max never rises (found by a review: 60 cases passed, err/bound as the correct kernel's). The probe keeps
the batch's lengths, query rows, pages, block table and NaN padding, and writes, per request whose first query row
sees s0 >= 2 tokens, with the riser at r = s0 - 1 (s0 - 2 where s0 - 1 is a multiple of 16 and s0 >= 3: a tile or
split that starts at the riser rescales nothing before it)
    q[t, h]        = +16 x_h on the first rope channel (index L), 0 elsewhere (fp8 q: q_scale = 1)
    tokens j < r   c_kv = a (every channel of magnitude α = 2^-floor(log2 r)), k_pe[0] = k_j / K   score 16 t_h k_j / K
    token r        c_kv = b, k_pe[0] = 1                                                   score 16 t_h
    tokens j > r   0                                                                        score 0, value 0
a staircase under the riser: token j's level k_j = floor(j / 16) mod K (K = LEVELS[cache format]: 256 for 16-bit
caches, 16 for e4m3, 8 for e5m2) rises by one every 16 tokens and falls back to 0 every 16 K, so a tile or split
piece of two or more tiles of 16 to 16 K tokens (aligned to 16) sees its running max rise at each tile boundary
until it holds level K - 1 (the first probe had one rise, at the riser: a kernel whose riser's piece starts in the
riser's tile passed whatever it rounded; `mutants.alpha_bf16` failed 23 of 60 default bf16 CPU cases then, 39 with
16 levels; with 16 only the first 256 tokens of a long piece rose, and the per-token charge of a 4096-token row
covered a bf16 factor: 256 levels, 4096 tokens, keep a 16-bit cache's long rows rising). Channel c of c_kv
belongs to head h(c) = c mod H, a_c = ±α (the sign alternating every H channels) and b_c = -sign_c Q(α S_h),
S_h = Σ_{j<r} e^(16 (k_j / K - 1) t_h), Q rounding to the cache's format (fp8 caches: with kv_scale KV_SCALE), so that
every value is exact there and each score is one exact product (x_h from `rounding_probe.probe_x`: exact in q's
format, p_h = e^-t_h far from bf16, fp16 and e4m3fn values; the levels k / K exact in every cache format). Every
row of the request sees all r tokens before the riser and the riser, so on head h's own channels
    ô_c = sign_c (α S_h - Q(α S_h)) e^(16 t_h) / l_h,   l_h = e^(16 t_h) (S_h + 1) + (tokens after the riser),
the format's rounding of α S_h in [e^-1 r α, r α), small; a kernel that rescales the running output of its earlier
tiles by factors e^-(n t_h) rounded to a format F moves it by about F's unit roundoff (2^-9 for bf16) of α S_h / l_h
at each rise, far above the tier-1 bound of a kernel that declares fp32 P (a few 2^-23 of Σ p|v| plus the output
rounding of the small ô). A kernel that declares a coarser P (bf16: u_P Σ p|v|, 2^-8 of 2 α S_h / l) is charged
more than a bf16 factor moves: the probe then tells nothing, and passes it.

What it cannot see: a kernel that never holds two tiles of one request's tokens in one running softmax (every piece
one tile: its pieces are merged by their lse, which the partials probe holds), or whose only such pieces start at
level K - 1; requests whose first row sees fewer than 2 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_ref.decode import DecodeBatch, is_fp8
from mla_ref.fp8 import round_to
from verify.rounding_probe import probe_batch, probe_x

KV_SCALE = {torch.float8_e4m3fn: 2.0**-7, torch.float8_e4m3fnuz: 2.0**-6, torch.float8_e5m2: 2.0**-7}  # fp8 caches:
# a's codes α / scale >= 2^-16 / scale (a request of 2^16 + 65 tokens) down to the format's smallest subnormal, b's
# below 2 / scale, within its max (e4m3fn 448, e4m3fnuz 240)
LEVELS = {torch.float8_e5m2: 8, torch.float8_e4m3fn: 16, torch.float8_e4m3fnuz: 16}  # the staircase's levels K:
LEVELS_DEFAULT = 256  # the codes k / (K scale) of k < K exact (e5m2: 3 significant bits, e4m3: 4; bf16: 8)
STEP = 16  # tokens per level
RISE = 16  # the riser's score in units of t_h (levels below it): 16 t_h <= 1, so S_h >= e^-1 r


@dataclass(frozen=True)
class RescaleProbe:
    """The probe batch and what it was built from.

    Attributes:
        batch: the probe `DecodeBatch` (the input's lengths, pages and padding, the probe's values).
        risers: [B] int64 (CPU), each request's riser position r, -1 where it has none (its first row sees < 2).
        t: [H] fp64, σ x_h: the riser's score is 16 t, level k's 16 t k / K.
        levels: K, the staircase's levels.
    """

    batch: DecodeBatch
    risers: torch.Tensor
    t: torch.Tensor
    levels: int

    def describe(self) -> str:
        probed = int((self.risers > 0).sum())
        rise = RISE / self.levels  # [H] per level, in units of t
        return (f"rescale probe: {probed} request{'s' if probed != 1 else ''} whose running max rises by "
                f"[{rise * float(self.t.min()):.4g}, {rise * float(self.t.max()):.4g}] every {STEP} tokens "
                f"({self.levels} levels, then back to 0) and then to a riser, outputs that cancel to the cache "
                "format's rounding of the tokens before the riser")


def rescale_probe(batch: DecodeBatch) -> RescaleProbe | str:
    """The probe of ``batch`` (module docstring), or why it has none: no request whose first row sees two tokens,
    no rope channel, no x_h for this σ and q dtype, or an fp8 cache format without a KV_SCALE. Two host syncs."""
    if batch.rope_dim == 0:
        return "no rope channel (kv_lora_rank = head_dim) to carry the scores"
    if is_fp8(batch.kv_cache.dtype) and batch.kv_cache.dtype not in KV_SCALE:
        return f"no probe scale for a {batch.kv_cache.dtype} cache"
    T, H, D = batch.q.shape
    L, dev, B = batch.kv_lora_rank, batch.device, batch.batch_size
    s0 = batch.visible_tokens()[batch.qo_indptr[:-1].long()].cpu() if B else torch.zeros(0, dtype=torch.long)  # [B]
    r = torch.where((s0 >= 3) & ((s0 - 1) % 16 == 0), s0 - 2, s0 - 1)  # [B] the riser's position
    r = torch.where(s0 >= 2, r, -1)  # [B] none where the first row sees < 2 tokens
    if not bool((r > 0).any()):
        return "no request whose first query row sees two tokens (nothing before a riser to rescale)"
    x = probe_x(batch.sm_scale, H, batch.q.dtype)  # [H]
    if x is None:
        return f"no x exact in q's {batch.q.dtype} puts sm_scale {batch.sm_scale:g} x in [2^-8, 2^-4] (fp8 q: scale 1)"
    t = batch.sm_scale * x  # [H]
    K = LEVELS.get(batch.kv_cache.dtype, LEVELS_DEFAULT)
    q = torch.zeros(T, H, D, dtype=torch.float64)  # [T, H, D]
    q[:, :, L] = RISE * x  # every row of head h: score 16 t_h k / K against k_pe[0] = k / K, 16 t_h against 1

    scale = KV_SCALE.get(batch.kv_cache.dtype, 1.0)
    c = torch.arange(L)  # [L] c_kv channels
    sign = torch.where((c // H) % 2 == 0, 1.0, -1.0).double()  # [L] ±1
    n_old = r.clamp(min=1).double()  # [B]
    alpha = 2.0 ** -torch.floor(torch.log2(n_old))  # [B] α: r α in [1, 2)
    level = torch.arange(K, dtype=torch.float64)  # [K]
    span = torch.arange(int(r.max())) // STEP  # [r_max] the step each old token lies in
    seen = torch.nn.functional.one_hot(span % K, K).cumsum(0)  # [r_max, K] tokens of each level among the first j+1
    per_level = torch.where((r > 0)[:, None], seen[(r - 1).clamp(min=0)], 0).double()  # [B, K] among the first r_b
    S = per_level @ torch.exp(RISE * (level[:, None] / K - 1) * t[None, :])  # [B, H] Σ_{j<r} e^(16 (k_j / K - 1) t_h)
    b = -sign * round_to((alpha[:, None] * S[:, c % H]) / scale, batch.kv_cache.dtype) * scale  # [B, L]

    pages, slots, positions = batch.token_addresses()  # [N] each
    seq = batch.seq_lens.long().cpu()  # [B]
    request = torch.repeat_interleave(torch.arange(B), seq, output_size=len(positions))  # [N] owner of each token
    positions = positions.cpu()  # [N]
    rows = torch.zeros(len(positions), D, dtype=torch.float64)  # [N, D] tokens after the riser: 0
    old = positions < r[request]  # [N] tokens before the riser (none where r = -1)
    riser = positions == r[request]  # [N]
    rows[old, :L] = sign * alpha[request[old], None]  # a
    rows[old, L] = (positions[old] // STEP % K).double() / K  # k_j / K: the staircase
    rows[riser, :L] = b[request[riser]]
    rows[riser, L] = 1.0
    probe = probe_batch(batch, q, pages, slots, (rows / scale).to(dev), kv_scale=scale)  # codes: values / scale
    return RescaleProbe(probe, r, t, K)

