"""Derived elementwise error bounds for MLA decode (numerics.md §5), computed in fp64 from the batch.

Every bound is a tensor of the shape of what it bounds: ``out`` [T, H, L] (absolute, same units as out) and
``lse`` [T, H] (absolute, natural log). Rows that see no token get bound 0 (out 0 and lse -inf on both sides).

| function              | bounds                                                                 | numerics.md |
|-----------------------|------------------------------------------------------------------------|-------------|
| ``kernel_bound``      | kernel vs the fp64 oracle on the *same* dequantized inputs (tier 1)     | §5(f)       |
| ``quantization_bounds``| fp64 oracle on fp8 inputs vs on unquantized inputs: B_det, B_post (tier 2)| §5(a)–(d)  |
| ``merge_bound``       | extra error of an fp32 split-KV LSE merge                               | §5(g)       |
| ``prob_bound``, ``rms_estimate`` | probabilistic / first-order RMS estimates — statistics only    | §5(e)       |

Notation (per query row t and head h; j runs over the tokens the row sees, i over the D = L + R channels):
    A_j = σ Σ_i |q_i||k_ji|            score magnitude, the unit of accumulation errors in s_j = σ <q, k_j>
    p_j = softmax(s)_j,  l = Σ_j exp(s_j - max s),  R_c = max_j v_jc - min_j v_jc   (v_j = k_j[:L])
A hat (q̂, k̂, ŝ, p̂, ô) marks values computed from the dequantized inputs.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from mla_fast.numerics import KernelNumerics
from mla_ref.decode import Bucket, DecodeBatch, RequestGrid, by_bucket, is_fp8
from mla_ref.fp8 import WIDE_DTYPES, fp8_format, round_p, round_to, widen

F64 = torch.float64
U32 = 2.0**-24  # fp32 unit roundoff
U64 = 2.0**-53  # fp64 unit roundoff
EXP32_REL = 2.0**-22  # relative error of a kernel's fp32 exp / exp2 (hardware ex2.approx, ~2 ulp; §5(f))
EXP64_REL = 2.0**-52  # relative error of fp64 exp (libm, <= 1 ulp)
FTZ_P = 2.0**-126  # fp32 arithmetic may flush a subnormal P to zero: absolute error < min normal fp32


@dataclass
class Bound:
    """Elementwise bounds on |actual - expected|: out [T, H, L], lse [T, H], fp64. Bounds add (``a + b``)."""

    out: torch.Tensor
    lse: torch.Tensor

    def __add__(self, other: Bound) -> Bound:
        return Bound(self.out + other.out, self.lse + other.lse)


@dataclass
class QuantBounds:
    """Bounds on the quantization error |oracle(fp8 inputs) - oracle(exact inputs)| (numerics.md §5(a)–(d)).

    Attributes:
        det_out [T, H, L], det_lse [T, H]: a-priori B_det from the element error model (§5(a)–(c)).
        post_out [T, H, L], post_lse [T, H]: a-posteriori B_post from the actual score changes (§5(d)).
        omega_det [T, H]: a-priori bound on the spread of score errors, 2 max_j δ_j (§5(b)).
        omega_act [T, H]: actual spread max_j Δs_j - min_j Δs_j (§5(d)).
        saturated: exact input elements beyond the format's range (max · scale); their clipping error is included
            in B_det, but a quantizer that saturates is usually a bug worth flagging.
    """

    det_out: torch.Tensor
    det_lse: torch.Tensor
    post_out: torch.Tensor
    post_lse: torch.Tensor
    omega_det: torch.Tensor
    omega_act: torch.Tensor
    saturated: int

    @property
    def det(self) -> Bound:
        return Bound(self.det_out, self.det_lse)

    @property
    def post(self) -> Bound:
        return Bound(self.post_out, self.post_lse)


# ---- fp64 statistics shared by every bound, a bucket of requests at once on its padded grid ----------------------
# Requests go in length buckets (DecodeBatch.buckets; by_bucket reassembles the rows), each bucket on its own grid.
# Shapes: B requests of the bucket, N = max q_len grid rows per request (RequestGrid), H heads, S = max seq_len
# tokens, D, L. A padding row or token is masked out everywhere: a padding row sees nothing, exactly like an empty
# row, and its bounds are dropped by ``grid.unpad``. Per row, every statistic is the one of its own request's tokens;
# quantities that are batch-wide (the q operand's rounding, prob_bound's union bound) are computed on the whole batch
# and passed into every bucket.


@dataclass
class _Softmax:
    """fp64 softmax statistics of every grid row (B requests, N rows, H heads, S tokens)."""

    s: torch.Tensor  # [B, N, H, S] scores σ<q, k_j>, -inf where not visible
    p: torch.Tensor  # [B, N, H, S] softmax weights, 0 where not visible
    m: torch.Tensor  # [B, N, H] max_j s_j (0 for an empty row)
    l: torch.Tensor  # [B, N, H] Σ_j exp(s_j - m) (1 for an empty row)
    seen: torch.Tensor  # [B, N] rows that see at least one token
    n_vis: torch.Tensor  # [B, N] visible tokens per row (a prefix of the request's tokens)


def _softmax(q: torch.Tensor, K: torch.Tensor, mask: torch.Tensor, sm_scale: float) -> _Softmax:
    """q [B, N, H, D], K [B, S, D] fp64, mask [B, N, S] -> softmax statistics."""
    s = sm_scale * torch.einsum("bnhd,bsd->bnhs", q, K)  # [B, N, H, S]
    s = s.masked_fill(~mask[:, :, None, :], -math.inf)  # [B, N, H, S]
    seen = mask.any(dim=-1)  # [B, N]
    m = s.amax(dim=-1) if K.shape[1] else s.new_zeros(s.shape[:3])  # [B, N, H]
    m = torch.where(seen[..., None], m, 0.0)  # [B, N, H]
    e = torch.exp(s - m[..., None])  # [B, N, H, S] exp(-inf) = 0
    l = torch.where(seen[..., None], e.sum(dim=-1), 1.0)  # [B, N, H]
    return _Softmax(s, e / l[..., None], m, l, seen, mask.sum(dim=-1))


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max over the last dim of x [B, N, H, S] where mask [B, N, S]; 0 for a row with nothing visible."""
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    m = x.masked_fill(~mask[:, :, None, :], -math.inf).amax(dim=-1)  # [B, N, H]
    return torch.where(mask.any(dim=-1)[..., None], m, 0.0)


def _spread(x: torch.Tensor, n_vis: torch.Tensor) -> torch.Tensor:
    """max_j x_bjc - min_j x_bjc over the first n_vis[b, r] tokens: x [B, S, C], n_vis [B, N] -> [B, N, C]
    (0 if n_vis = 0).

    Visible sets are prefixes (causal diagonal) and the seeing rows of a request differ by at most N - 1 tokens
    (row r of request b sees s_b - q_len_b + r + 1): one max / min over the prefix every seeing row of the request
    shares, then running max / min over the N - 1 tokens after it, answer every row (max and min are exact: the same
    values as a max / min over each row's tokens). A wider spread of n_vis within a request is out of range for the
    gather and raises.
    """
    B, S, C = x.shape
    N = n_vis.shape[1]
    if S == 0:
        return x.new_zeros(B, N, C)
    seen = n_vis > 0  # [B, N]
    first = torch.where(seen, n_vis, S).amin(dim=1)  # [B] tokens every seeing row of the request sees
    head = (torch.arange(S, device=x.device) < first[:, None])[..., None]  # [B, S, 1]
    head_hi = torch.where(head, x, -math.inf).amax(dim=1, keepdim=True)  # [B, 1, C]
    head_lo = torch.where(head, x, math.inf).amin(dim=1, keepdim=True)  # [B, 1, C]
    after = (first[:, None] + torch.arange(N - 1, device=x.device)).clamp(max=S - 1)  # [B, N - 1] next tokens
    tail = x.gather(1, after[..., None].expand(-1, -1, C))  # [B, N - 1, C]
    hi = torch.cat([head_hi, tail], dim=1).cummax(dim=1).values  # [B, N, C] max over the first `first + k` tokens
    lo = torch.cat([head_lo, tail], dim=1).cummin(dim=1).values  # [B, N, C]
    k = (n_vis - first[:, None]).clamp(min=0)[..., None].expand(-1, -1, C)  # [B, N, C] tokens beyond the prefix
    return torch.where(seen[..., None], hi.gather(1, k) - lo.gather(1, k), 0.0)


def _hull_term(omega: torch.Tensor, R: torch.Tensor, pv: torch.Tensor, dev: torch.Tensor | None = None,
               weight: torch.Tensor | float = 1.0) -> torch.Tensor:
    """§5(c) term 1: |Σ_j (p'_j - p_j) v_jc| <= min{tanh(ω/4) R_c, (e^ω - 1) Σ_j p_j |v_jc - c|} for any c when the
    score perturbation has spread <= ω (TV(p, p') <= tanh(ω/4), §5(b); p'_j / p_j in [e^-ω, e^ω], and Σ_j (p'_j -
    p_j) c = 0). c = 0 gives Σ_j p_j |v_jc| = ``pv``; c = the weighted mean gives at most ``dev`` (``_deviation``):
    against tanh(ω/4) R_c ~ ω R_c / 4 about 0.6x on long rows of Gaussian values (R_c grows with the tokens), far
    less on peaky rows (dev ~ sqrt(p (1 - p)) |Δv|), and against pv far less on values with a common offset.

    omega [B, N, H], R [B, N, L], pv and dev [B, N, H, L] -> [B, N, H, L]. ``weight`` [B, N, H] or a float: p_j
    is only known to be <= weight x the p of pv and dev (``_rounding_bound``'s shared scores: e^ω_qk).
    """
    spread = pv if dev is None else torch.minimum(pv, dev)  # [B, N, H, L] >= Σ_j p_j |v_jc - c| for one c
    return torch.minimum(torch.tanh(omega / 4)[..., None] * R[:, :, None, :],
                         (torch.expm1(omega) * weight)[..., None] * spread)


def _value_term(p: torch.Tensor, e_v: torch.Tensor, omega: torch.Tensor, n_vis: torch.Tensor) -> torch.Tensor:
    """§5(c) term 2: |Σ_j p'_j (v̂_jc - v_jc)| <= Σ_j p_j e^v_jc + tanh(ω/4)(max_j e^v_jc - min_j e^v_jc) for value
    errors |v̂_jc - v_jc| <= e^v_jc and weights p' whose scores moved with spread <= ω: Σ_j (p'_j - p_j) = 0, so
    Σ_j (p'_j - p_j) e_j moves by at most TV(p, p') (max e - min e), and TV(p, p') <= tanh(ω/4) (§5(b)).

    p [B, N, H, S] (0 where not visible), e_v [B, S, L], omega [B, N, H], n_vis [B, N] -> [B, N, H, L]."""
    e_v_spread = _spread(e_v, n_vis)[:, :, None, :]  # [B, N, 1, L] over each row's visible tokens
    return torch.einsum("bnhs,bsc->bnhc", p, e_v) + torch.tanh(omega / 4)[..., None] * e_v_spread  # [B, N, H, L]


def _deviation(st: _Softmax, V: torch.Tensor) -> torch.Tensor:
    """[B, N, H, L] upper bound on sqrt(Σ_j p_j (v_jc - m_c)²) with m_c = Σ_j p_j v_jc, p = st.p [B, N, H, S] (rows
    summing to 1, or 0 for a row that sees nothing) and V [B, S, L] fp64: the weighted standard deviation of each
    channel, which bounds Σ_j p_j |v_jc - m_c| (Cauchy-Schwarz). Two matmuls (Σ p v, Σ p v²); the variance
    Σ p v² - m² is evaluated in fp64 with error <= (3n + 7) u64 Σ p v² over a row's n visible tokens (zero padding
    adds exactly), and Σ p = 1 ± n u64: the 4 (n + 4) u64 Σ p v² added and the (1 + that) factor cover both; the
    products p v² and m² may also underflow, each by less than the least subnormal 2^-1074: (n + 4) 2^-1074 more
    (0 for a row that sees nothing: its p and statistics are exact zeros).
    Unlike the other statistics it cancels, so another grid (bucketing) may move it by up to sqrt(that slack)."""
    m = torch.einsum("bnhs,bsc->bnhc", st.p, V)  # [B, N, H, L]
    m2 = torch.einsum("bnhs,bsc->bnhc", st.p, V * V)  # [B, N, H, L]
    n = st.n_vis.to(F64)[..., None, None]  # [B, N, 1, 1]
    slack = 4 * (n + 4) * U64  # [B, N, 1, 1] relative
    underflow = torch.where(n > 0, (n + 4) * 2.0**-1074, 0.0)  # [B, N, 1, 1] absolute (an empty row: exact 0)
    return ((m2 - m * m).clamp(min=0) + slack * m2 + underflow).sqrt() * (1 + slack)


def _per_request(x):
    """A per-request coefficient [B] as [B, 1, 1] (broadcasts against [B, N, H]); python floats unchanged."""
    return x[:, None, None] if isinstance(x, torch.Tensor) else x


def _col(x):
    """[B, N, H] or [B, 1, 1] -> [..., 1] to broadcast against [B, N, H, L]; python floats unchanged."""
    return x[..., None] if isinstance(x, torch.Tensor) else x


def _unit_roundoff(fmt) -> float:
    """u of a torch float dtype or a round_p format name (None = fp32)."""
    if fmt is None or fmt in WIDE_DTYPES:
        fmt = WIDE_DTYPES[fmt or "fp32"]
    if isinstance(fmt, torch.dtype):
        if fmt == F64:
            return U64
        if is_fp8(fmt):
            return fp8_format(fmt).u
        return torch.finfo(fmt).eps / 2
    return fp8_format(fmt).u


def _half_min_subnormal(fmt) -> float:
    """η of a torch float dtype or a round_p format name (None = fp32): half the min subnormal, the absolute error
    bound of round-to-nearest below the normal range (values under it flush to 0; numerics.md §4, §5(f))."""
    if fmt is None or fmt in WIDE_DTYPES:
        fmt = WIDE_DTYPES[fmt or "fp32"]
    if isinstance(fmt, torch.dtype) and not is_fp8(fmt):
        fi = torch.finfo(fmt)
        return fi.tiny * fi.eps / 2  # min subnormal = min normal · eps
    return fp8_format(fmt).eta


def _operand_error(fed: torch.Tensor, operand: torch.dtype, via_fp32: bool = False, *, per_request: bool = False):
    """(u, η, finite) of the rounding an MMA applies to its operand: |round(x) - x| <= u|x| + η for every value x of
    ``fed`` (fp64, the values the kernel converts to ``operand``), η in the units of ``fed``.

    (0, 0) when every value is exact in ``operand``. Otherwise u = u(operand) and η = half its min subnormal: below
    the normal range the error is absolute (fp16: values under 2^-14 keep a 2^-24 grid, under 2^-25 they flush to 0),
    so u alone does not bound it (numerics.md §4, §5(f)). ``via_fp32``: the kernel forms the value in fp32 first
    (x = code · scale) and then rounds it to ``operand``: u = (1 + u(operand))(1 + u32) - 1, η = η(operand) + η(fp32).
    ``per_request``: fed is [B, ...] (zero padding is exact) and u, η are [B] fp64, one per request; else [] fp64.
    finite: [] bool, False if a value overflows ``operand`` (the kernel would compute with ±inf: no bound exists;
    ``_require_finite`` raises). No host sync.
    """
    inexact = (widen(fed.to(operand), F64) != fed).flatten(1 if per_request else 0).any(dim=-1).to(F64)  # [B] or []
    u, eta = _unit_roundoff(operand), _half_min_subnormal(operand)
    if via_fp32:
        u, eta = (1 + u) * (1 + U32) - 1, eta + _half_min_subnormal(None)
    lo, hi = torch.aminmax(fed) if fed.numel() else (fed.new_zeros(()), fed.new_zeros(()))  # [], []
    top = torch.maximum(hi, -lo)  # [] rounding is monotone: max |x| overflows first
    if is_fp8(operand):  # torch's fp8 casts saturate on some devices and give NaN on others (CUDA has no fp8 isfinite)
        finite = top <= fp8_format(operand).max
    else:
        finite = torch.isfinite(top.to(operand))
    return inexact * u, inexact * eta, finite


def _require_finite(operands: list[tuple[str, torch.Tensor, torch.Tensor, torch.dtype]]) -> None:
    """operands: (name, fed, finite flag of ``_operand_error``, operand dtype); one host sync for all flags.
    Raises ValueError naming the first operand whose values overflow the kernel's operand dtype."""
    for (name, fed, _, operand), ok in zip(operands, torch.stack([f for _, _, f, _ in operands]).tolist()):
        if not ok:
            top = fed.abs().max().item()
            raise ValueError(f"{name}: values up to {top:.4g} overflow the kernel's {operand} operand")


def _rounding_bound(
    st: _Softmax,
    A_max: torch.Tensor,
    V: torch.Tensor,
    o: torch.Tensor,
    *,
    u_out: float,
    eta_out: float = 0.0,
    u_p: float,
    eta_p: float,
    gamma_qk: float,
    gamma_pv: float,
    exp_rel: float,
    u_arith: float,
    score_abs: torch.Tensor | float = 0.0,
    eta_v: float = 0.0,
    shared_scores: bool = False,
    l_rounded: bool = False,
    R: torch.Tensor | None = None,
    pv: torch.Tensor | None = None,
    dev: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """§5(f): bound on |o^ker - ô| [B, N, H, L] and |lse^ker - lse^| [B, N, H] for every grid row. gamma_qk,
    gamma_pv, eta_v: floats or per-request [B] tensors; score_abs: a float or [B, N, H]. R [B, N, L], pv and dev
    [B, N, H, L]: ``_spread(V, st.n_vis)``, Σ_j p̂_j |v̂_jc| and ``_deviation(st, V)`` if already computed for
    the same st and V.

    A kernel that computes, in arithmetic of unit roundoff u_arith (fp32 for GPU kernels),
        s̃_j = fl(σ <q̃, k̃_j>)             error <= gamma_qk · A_j + score_abs  (operands q̃, k̃ as the MMA sees them:
                                          their relative rounding folded into gamma_qk, absolute η into score_abs)
        p̃_j = exp(s̃_j - m̃) (1 + ε_j)      |ε_j| <= exp_rel, same p̃ in the numerator and in l (l from unrounded P;
                                          l_rounded: from the rounded P_j, below)
        P_j = round(p̃_j)                  |P_j - p̃_j| <= u_p p̃_j + min(eta_p, p̃_j)   (underflow flushes to 0)
        o = fl(Σ_j P_j ṽ_j) / fl(Σ_j p̃_j) |ṽ_jc - v̂_jc| <= (relative part, in gamma_pv) + eta_v; accumulation
                                          errors gamma_pv Σ P|v| and gamma_pv · l
        out = round_out(o)                 |out - o| <= u_out |o| + eta_out   (eta_out: below the out dtype's normal
                                          range, half its min subnormal; fp8 and fp16 outputs)
    Score errors, including exp's ε_j (a factor (1+ε_j) on p_j is a shift ln(1+ε_j) of s_j), perturb the
    softmax with spread <= ω = ω_qk + ω_own, bounded by the hull term (§5(b), (c)):
        ω_qk  = 2 (gamma_qk max_j A_j + score_abs)                   the dot products and their operands
        ω_own = 2 [6 u_arith max_j A_j + exp_rel / (1 - exp_rel)]    scale, running-max subtraction, exp
    where 6 u_arith covers rounding σ (with the folded scales and log2 e) to fp32, and the fp32 subtraction of the
    running max (|s_j - m| <= 2 max A). The weights the kernel uses differ from p̂ by at most a factor e^ω, so
    with l̃ >= e^-ω l̂ and the kernel's unnormalised P >= its block-local value (online softmax only rounds
    larger values, §5(f)):
        |o^ker_c - ô_c| <= (1 + u_out) / (1 - gamma_pv) [ u_out |ô_c| + e^ω c_pv Σ_j p̂_j |v̂_jc|
                             + e^ω (1 + c_pv) (Σ_j min(eta_p / l̂, p̂_j) |v̂_jc| + eta_v) + gamma_pv |ô_c|
                             + min{tanh(ω/4) R̂_c, (e^ω - 1) min(Σ_j p̂_j |v̂_jc|, dev_c)} ]
        c_pv = (1 + u_p)(1 + gamma_pv) - 1
    (numerics.md §5(f) with the η_P term tightened by min(·, p̂_j), gamma_pv |ô| for the fp32 row sum l, and the
    score term by §5(c)'s second form about the mean (``_hull_term``; dev_c: ``_deviation``); the leading factors
    absorb the second-order products: the division by the row sum, l̃ >= (1 - gamma_pv) l̂, costs 1 / (1 - gamma_pv),
    attained with the numerator gamma_pv high and l gamma_pv low (1 + gamma_pv fell short by gamma_pv^2); no finite
    bound for gamma_pv >= 1.)
    LSE: lse = m̃ + ln l̃; the score errors move it by at most max_j |Δs_j| <= ω / 2 (§5(a)), the row sum by
    |ln(1 ± gamma_pv)| <= gamma_pv / (1 - gamma_pv), and evaluating log2, adding m and converting base 2 -> e in fp32
    costs <= 16 u_arith (|m̂| + ln l̂):
        |lse^ker - lse^| <= ω / 2 + gamma_pv / (1 - gamma_pv) + 16 u_arith (|m̂| + ln l̂)
    l_rounded: the kernel sums the rounded P_j into l (no declared kernel of ours or the peers' does). Each P_j is
    within u_p p̃_j + min(eta_p, p̃_j) of p̃_j, so its row sum L_P = l̃ (1 + θ), |θ| <= r = u_p + e^ω f, where
    f = Σ_j min(eta_p / l̂, p̂_j) is the flushed part in units of l̂ (the kernel's normalised weights are within e^ω
    of p̂). The kernel's o = o_u l̃ / L_P, with o_u the same numerator over l̃ (what the bound above covers:
    |o_u - ô| <= B, so |o_u| <= o_mag + B), and |l̃ / L_P - 1| <= r / (1 - r): out's bound becomes
    (B + r o_mag) / (1 - r), and lse gains r / (1 - r) >= |ln(1 + θ)|. (A fifty-second-session review: charging r
    o_mag alone missed the flushed mass on rows whose ô cancels, 1.6x on crafted e4m3fn-P rows.)
    shared_scores: bound the distance to o* = Σ_j softmax(s̃)_j v̂_j (and lse* = ln Σ_j e^s̃_j) instead, the error of
    everything after the scores (``split_bound``): the hull term and the LSE take ω_own only; |ô| becomes
    |o*| <= |ô| + min{tanh(ω_qk/4) R̂, (e^ω_qk - 1) min(Σ_j p̂_j |v̂_j|, dev)} (§5(c)); e^ω keeps ω_qk
    (softmax(s̃) <= e^ω_qk p̂, also in the hull term's second form, whose weights are softmax(s̃)).
    """
    seen = st.seen[..., None]  # [B, N, 1]
    gamma_qk, gamma_pv, eta_v = _per_request(gamma_qk), _per_request(gamma_pv), _per_request(eta_v)  # [B, 1, 1]
    omega_qk = torch.where(seen, 2 * (gamma_qk * A_max + score_abs), 0.0)  # [B, N, H] empty rows: nothing to perturb
    omega_own = torch.where(seen, 2 * (6 * u_arith * A_max + exp_rel / (1 - exp_rel)), 0.0)  # [B, N, H]
    omega = omega_qk + omega_own  # [B, N, H]
    R = _spread(V, st.n_vis) if R is None else R  # [B, N, L]
    pv = torch.einsum("bnhs,bsc->bnhc", st.p, V.abs()) if pv is None else pv  # [B, N, H, L] Σ_j p̂_j |v̂_jc|
    dev = _deviation(st, V) if dev is None else dev  # [B, N, H, L] >= Σ_j p̂_j |v̂_jc - mean_c|
    flush_v = 0.0  # [B, N, H, L] underflow error per unit l̂: min(η_P / l̂, p̂_j) summed against |v̂_j| (0 if η_P = 0)
    flush_l = 0.0  # [B, N, H] the same summed over the tokens: the flushed part of a row sum of rounded P
    if eta_p:
        flushed = torch.minimum(eta_p / st.l[..., None], st.p)  # [B, N, H, S]
        flush_v = torch.einsum("bnhs,bsc->bnhc", flushed, V.abs())
        flush_l = flushed.sum(dim=-1)
    c_pv = _col((1 + u_p) * (1 + gamma_pv) - 1)  # [B, 1, 1, 1] or float
    growth = torch.exp(omega)[..., None]  # [B, N, H, 1] kernel weights <= e^ω p̂
    hull_omega = omega_own if shared_scores else omega  # [B, N, H] score errors not common to the compared results
    o_mag = o.abs() + (_hull_term(omega_qk, R, pv, dev) if shared_scores else 0.0)  # [B, N, H, L] |ô|, or |o*|
    inner = (
        u_out * o_mag  # output rounding: relative, and absolute below the normal range on rows that see a token
        + seen[..., None].to(F64) * eta_out  # (an empty row's 0 is exact; torch.where of two floats gives fp32: 0)
        + growth * c_pv * pv  # P rounding and P·V accumulation
        + growth * (1 + c_pv) * (flush_v + _col(eta_v))  # P underflow (η_P), absolute V operand rounding (η_v)
        + _col(gamma_pv) * o_mag  # fp32 row sum l
        + _hull_term(hull_omega, R, pv, dev, torch.exp(omega - hull_omega))  # score errors (§5(b), (c))
    )  # [B, N, H, L]
    r_l = torch.where(seen, u_p + torch.exp(omega) * flush_l, 0.0) if l_rounded else None  # [B, N, H]
    if r_l is not None:  # a row sum of the rounded P: o = o_u l̃ / L_P, |l̃ / L_P - 1| <= r / (1 - r)
        r = r_l[..., None]  # [B, N, H, 1]
        inner = torch.where(r < 1, (inner + r * o_mag) / (1 - r).clamp(min=1e-300), math.inf)
    g = torch.as_tensor(gamma_pv, dtype=F64, device=hull_omega.device)  # [] or [B, 1, 1]
    out = torch.where(_col(g) < 1, (1 + u_out) * inner / (1 - _col(g)), math.inf)  # [B, N, H, L] o = numerator / l̃
    ln_l = torch.where(g < 1, g / (1 - g), math.inf)  # >= |ln(1 ± g)|; g >= 1 (a long request's per-token charge): no
    # finite bound on l's log, so none on lse (g / (1 - g) was negative, and compare() refused it)
    lse = hull_omega / 2 + ln_l + 16 * u_arith * (st.m.abs() + torch.log(st.l))  # [B, N, H]
    if r_l is not None:
        lse = lse + torch.where(r_l < 1, r_l / (1 - r_l), math.inf)  # >= |ln(1 ± r)|
    return out, torch.where(seen, lse, 0.0)


def _fp64_slack(st: _Softmax, A_max: torch.Tensor, V: torch.Tensor, o: torch.Tensor, D: int, seq_lens: torch.Tensor,
                **stats):
    """Evaluation error of one fp64 oracle run (mla_ref.decode.mla_decode_ref): §5(f) with fp64 constants,
    gamma = (terms) · u64 for the D-term dot products and the s-term sums (any summation order), per request with
    s = its seq_len (seq_lens [B]). stats: R, pv, dev of ``_rounding_bound`` if already computed."""
    g = (seq_lens.to(F64).clamp(min=D) + 2) * U64  # [B] (max(D, s) + 2) u64
    return _rounding_bound(
        st, A_max, V, o, u_out=U64, u_p=0.0, eta_p=0.0, gamma_qk=g, gamma_pv=g, exp_rel=EXP64_REL, u_arith=U64, **stats
    )


def oracle_bound(batch: DecodeBatch) -> Bound:
    """|computed - exact| elementwise for one fp64 evaluation of the decode formula of numerics.md §2 on ``batch``'s
    dequantized inputs: ``mla_decode_ref``, or any other fp64 code that computes the max-shifted softmax in any
    summation order (§5(f) with fp64 constants, ``_fp64_slack``). Two such evaluations differ by at most twice it;
    ``kernel_bound`` charges it once for the oracle it compares with.

    Returns:
        Bound(out [T, H, L], lse [T, H]) in fp64 (0 on rows that see no token).
    """
    batch.validate()
    L, D = batch.kv_lora_rank, batch.head_dim

    def bucket_bound(bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        b, grid = bucket.batch, bucket.grid
        K = b.padded_kv(grid.S, F64)  # [B, S, D] dequantized, zero padding
        q = grid.pad(b.dequantized_q(F64))  # [B, N, H, D]
        st = _softmax(q, K, grid.mask, b.sm_scale)  # [B, N, H, S]
        A = b.sm_scale * torch.einsum("bnhd,bsd->bnhs", q.abs(), K.abs())  # [B, N, H, S] σ Σ_i |q_i k_ji|
        o = torch.einsum("bnhs,bsc->bnhc", st.p, K[..., :L])  # [B, N, H, L] ô
        out, lse = _fp64_slack(st, _masked_max(A, grid.mask), K[..., :L], o, D, b.seq_lens)  # [B, N, H, L], [B, N, H]
        return grid.unpad(out), grid.unpad(lse)  # [t, H, L], [t, H]

    return Bound(*by_bucket(batch.buckets(), bucket_bound))

# ---- §5(f): kernel vs fp64 on the same dequantized inputs ------------------------------------------------------


def _check_numerics(batch: DecodeBatch, numerics) -> None:
    batch.validate()
    if not isinstance(numerics, KernelNumerics):  # KernelNumerics checks its own values
        raise ValueError(f"numerics: expected a mla_fast.numerics.KernelNumerics, got {type(numerics).__name__}")


def _q_operand(batch: DecodeBatch, numerics):
    """The q operand as the Q.K MMA gets it, over the whole batch: (u_q [], η_q [] in real units, the
    ``_require_finite`` entry of q). Batch-wide, as a kernel sees one q tensor: every bucket gets the same u_q, η_q."""
    scaled, q_fp8 = bool(numerics.scale_then_round), is_fp8(batch.q.dtype)
    if scaled and q_fp8:
        q_fed, f_q = batch.dequantized_q(F64), 1.0  # [T, H, D] code · scale, rounded to qk_operand
    else:
        q_fed, f_q = batch.q.to(F64), (float(batch.q_scale) if q_fp8 else 1.0)  # [T, H, D] as stored
    u_q, eta_q, ok_q = _operand_error(q_fed, numerics.qk_operand, scaled and q_fp8)  # [], [], []
    return u_q, eta_q * f_q, ("q", q_fed, ok_q, numerics.qk_operand)


def _p_rounding(numerics) -> tuple[float, float]:
    """(u_P, η_P) of P as the P.V MMA gets it: p_fmt after × p_scale, rounded once more, with u and η of
    pv_operand, when pv_operand is coarser than p_fmt; η_P in units of p (<= 1), + 2^-126 for a flushed fp32 P."""
    u_p, eta_p = _unit_roundoff(numerics.p_fmt), _half_min_subnormal(numerics.p_fmt)
    if _unit_roundoff(numerics.pv_operand) > u_p:
        u_p = (1 + u_p) * (1 + _unit_roundoff(numerics.pv_operand)) - 1
        eta_p += _half_min_subnormal(numerics.pv_operand)
    return u_p, eta_p / numerics.p_scale + FTZ_P


def _uniform_p_factor(numerics) -> float:
    """δ with |P / p̃ - 1| <= δ for a P computed from a score equal to the running max (kernel_bound's uniform_p):
    p̃ = exp(0)(1 + ε), |ε| <= EXP32_REL, rounded (× p_scale) to p_fmt, then to pv_operand where that is coarser.
    When p_scale is a value of both formats, 1 · p_scale is a value near p̃ p_scale, so round-to-nearest moves P by
    at most |ε| the first time and 2|ε| the second (P is then within 2|ε| of 1): δ <= 3|ε| / (1 - |ε|). Otherwise
    the declared u_P (``_p_rounding``)."""
    scale = torch.tensor(float(numerics.p_scale), dtype=F64)
    in_p = bool(round_p(scale, numerics.p_fmt) == scale)
    in_pv = bool(round_to(scale, numerics.pv_operand) == scale)
    return 3 * EXP32_REL / (1 - EXP32_REL) if in_p and in_pv else _p_rounding(numerics)[0]


def _kernel_grid(bucket: Bucket, numerics, ref: tuple[torch.Tensor, torch.Tensor] | None, q_operand,
                 uniform_p: bool = False):
    """(st, A_max [B, N, H], V [B, S, L], o [B, N, H, L], kwargs of ``_rounding_bound``) for a kernel that
    rounds as ``numerics`` says (numerics.md §5(f); mla_fast/numerics.py), the bucket's requests on its padded grid.
    ref: the bucket's rows of the oracle's (out, lse), or None; q_operand: ``_q_operand`` of the whole batch;
    uniform_p: no P rounding charged per token (``kernel_bound``'s uniform_p charges it as a common factor).

    Operands: the MMAs see the stored values (fp8 codes: scales folded into the fp32 scores and output) or, with
    ``numerics.scale_then_round``, the fp32 products code · scale. Their rounding to qk_operand / pv_operand
    (``_operand_error``) is u|x̂| (relative) + η (absolute; in real units η · scale for codes, η for scaled values):
        |s̃_j - ŝ_j| <= [(1 + u_q)(1 + u_k)(1 + γ_qk) - 1] A_j                                (gamma_qk)
                       + (1 + γ_qk) σ [η_q Σ_i |k̂_ji| (1 + u_k) + η_k Σ_i |q̂_i| (1 + u_q) + D η_q η_k]   (score_abs)
    from |q̃_i k̃_ji - q̂_i k̂_ji| <= e^q_i |k̂_ji| + |q̂_i| e^k_ji + e^q_i e^k_ji, e^x = u_x |x̂| + η_x (§5(a)),
    and the accumulation error γ_qk Σ_i |q̃_i||k̃_ji|. V: (1 + u_v)(1 + γ_pv) - 1 per unit of Σ p̂|v̂| (gamma_pv) and
    η_v on each value (eta_v).
    P: p_fmt after × p_scale: u_P, η_P = η(p_fmt) / p_scale (+ 2^-126 for a flushed fp32 P); rounded once more,
    with u and η of pv_operand, when pv_operand is coarser than p_fmt.
    The operand errors of K and V are per request (exact requests get 0), as a per-request loop would give them;
    the q operand's are the whole batch's.
    """
    batch, grid = bucket.batch, bucket.grid
    L, D, sigma = batch.kv_lora_rank, batch.head_dim, batch.sm_scale
    u_p, eta_p = (0.0, 0.0) if uniform_p else _p_rounding(numerics)
    common = dict(u_out=_unit_roundoff(numerics.out_dtype), eta_out=_half_min_subnormal(numerics.out_dtype), u_p=u_p,
                  eta_p=eta_p, exp_rel=EXP32_REL, u_arith=U32, l_rounded=numerics.l_from_rounded_p)
    mask = grid.mask  # [B, N, S]

    # operand values as the MMA gets them (fed) and the factor from their units to real units
    scaled, kv_fp8 = bool(numerics.scale_then_round), is_fp8(batch.kv_cache.dtype)
    K = batch.padded_kv(grid.S, F64)  # [B, S, D] dequantized, zero padding
    V = K[..., :L]  # [B, S, L]
    if scaled or not kv_fp8:
        k_fed, f_k = K, 1.0  # the MMAs see the dequantized values (code · scale, or a bf16 / fp16 cache as it is)
    else:
        k_fed, f_k = batch.padded_kv(grid.S, F64, scaled=False), (float(batch.kv_scale) if kv_fp8 else 1.0)
    u_q, eta_q, q_check = q_operand  # [], [], the whole batch's q
    via = scaled and kv_fp8
    u_k, eta_k, ok_k = _operand_error(k_fed, numerics.qk_operand, via, per_request=True)  # [B], [B], []
    u_v, eta_v, ok_v = _operand_error(k_fed[..., :L], numerics.pv_operand, via, per_request=True)  # [B], [B], []
    _require_finite([q_check, ("kv_cache", k_fed, ok_k, numerics.qk_operand),
                     ("kv_cache[..., :L] (V)", k_fed[..., :L], ok_v, numerics.pv_operand)])
    eta_k, eta_v = eta_k * f_k, eta_v * f_k  # [B], [B]

    q_grid, K_abs = grid.pad(batch.dequantized_q(F64)), K.abs()  # [B, N, H, D], [B, S, D]
    st = _softmax(q_grid, K, mask, sigma)  # [B, N, H, S]
    A = sigma * torch.einsum("bnhd,bsd->bnhs", q_grid.abs(), K_abs)  # [B, N, H, S] A_j
    per_token = (
        (eta_q * (1 + u_k)[:, None] * K_abs.sum(dim=-1))[:, None, None, :]  # [B, 1, 1, S]
        + _col(_per_request(eta_k)) * (1 + u_q) * q_grid.abs().sum(dim=-1)[..., None]  # [B, N, H, 1]
        + D * eta_q * _col(_per_request(eta_k))  # [B, 1, 1, 1]
    ).expand_as(A)  # [B, N, H, S] 0 when every operand value is exact or normal (η_q = η_k = 0)
    score_abs = (1 + numerics.gamma_qk) * sigma * _masked_max(per_token, mask)  # [B, N, H]
    o = grid.pad(ref[0].to(F64)) if ref is not None else torch.einsum("bnhs,bsc->bnhc", st.p, V)  # [B, N, H, L] ô
    seq = batch.seq_lens.to(device=u_v.device, dtype=F64)  # [B] tokens each request's accumulation runs over
    kw = dict(
        common,
        gamma_qk=(1 + u_q) * (1 + u_k) * (1 + numerics.gamma_qk) - 1,  # [B] rounded operands, then accumulation
        gamma_pv=(1 + u_v) * (1 + numerics.gamma_pv + numerics.gamma_pv_per_token * seq) - 1,  # [B] V operand
        # rounding, then accumulation, part of it growing with the request's length
        score_abs=score_abs,
        eta_v=eta_v,  # [B]
    )
    return st, _masked_max(A, mask), V, o, kw


def _check_ref(batch: DecodeBatch, ref, name: str) -> None:
    """ValueError naming `name` unless ref is None or (out [T, H, L], lse [T, H]) of the batch."""
    T, H, L = batch.num_tokens, batch.num_heads, batch.kv_lora_rank
    if ref is None:
        return
    if (not isinstance(ref, (tuple, list)) or len(ref) != 2 or not all(isinstance(r, torch.Tensor) for r in ref)
            or tuple(ref[0].shape) != (T, H, L) or tuple(ref[1].shape) != (T, H)):
        got = [tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__ for r in ref] \
            if isinstance(ref, (tuple, list)) else type(ref).__name__
        raise ValueError(f"{name}: expected (out [{T}, {H}, {L}], lse [{T}, {H}]) of mla_decode_ref, got {got}")


def kernel_bound(batch: DecodeBatch, numerics, *, ref: tuple[torch.Tensor, torch.Tensor] | None = None,
                 uniform_p: bool = False) -> Bound:
    """Tier-1 bound (numerics.md §5(f)): |kernel(batch) - mla_decode_ref(batch)| elementwise, both on the same
    (dequantized) inputs, for a kernel that rounds as ``numerics`` (an ``mla_fast.numerics.KernelNumerics``) says.

    Read from ``numerics``: p_fmt / p_scale (u_P, η_P = η(p_fmt) / p_scale + 2^-126 for flushed fp32 P);
    qk_operand and pv_operand (operand rounding u|x| + η, η = half the format's min subnormal: 0 when the values the
    MMAs see are exact in them; P rounds once more when pv_operand is coarser than p_fmt); scale_then_round (the
    MMAs see code · scale rounded to the operand dtype, not the codes); gamma_qk, gamma_pv + gamma_pv_per_token x
    seq_len (per request); out_dtype (u_out).
    Derivation in ``_kernel_grid`` and ``_rounding_bound``. The row sum l is taken as accumulated from unrounded P
    (vLLM, FlashMLA, mla_fast); a kernel that sums the rounded P declares l_from_rounded_p: with r = u_P + the
    flushed part of l, out's bound B becomes (B + r |ô|) / (1 - r) and lse gains r / (1 - r) (``_rounding_bound``'s
    l_rounded); under uniform_p its lse also gains δ / (1 - δ), P's common factor, since l = n P.
    The fp32 split-KV merge is not included: add ``merge_bound`` for split kernels.

    Args:
        ref: (out, lse) of ``mla_decode_ref(batch)`` if already computed; the bound then uses its |ô| and
            validates its shape. Otherwise ô is recomputed here (same fp64 computation).
        uniform_p: the batch's q is 0 (ValueError otherwise), so every score the kernel computes is exactly 0 and
            P is one value in every row, whatever its exp, p_fmt and pv_operand do to it: its rounding is a common
            factor (1 + δ) of every split's output and cancels in the LSE merge weights (numerics.md §5(i)).
            Charged as δ (|ô| + B) on the bound B computed with exact P, instead of u_P Σ p̂|v̂| + η_P
            (``_uniform_p_factor``: δ <= 3 EXP32_REL when p_scale is a value of P's formats, else u_P).
    Returns:
        Bound(out [T, H, L], lse [T, H]) in fp64.
    """
    _check_numerics(batch, numerics)
    _check_ref(batch, ref, "ref")
    if uniform_p and bool(batch.q.to(F64).any()):
        raise ValueError("kernel_bound.uniform_p: expected q = 0 (every score exactly 0), got a nonzero q")
    D = batch.head_dim
    q_operand = _q_operand(batch, numerics)  # batch-wide
    u_common = _uniform_p_factor(numerics) if uniform_p else 0.0  # P's rounding as one factor on the output

    def bucket_bound(bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        ref_b = (bucket.rows_of(ref[0]), bucket.rows_of(ref[1])) if ref is not None else None  # [t, H, L], [t, H]
        st, A_max, V, o, kw = _kernel_grid(bucket, numerics, ref_b, q_operand, uniform_p)
        stats = dict(R=_spread(V, st.n_vis), pv=torch.einsum("bnhs,bsc->bnhc", st.p, V.abs()),
                     dev=_deviation(st, V))  # shared by both terms
        b_out, b_lse = _rounding_bound(st, A_max, V, o, **kw, **stats)  # [B, N, H, L], [B, N, H]
        b_out = (1 + u_common) * b_out + u_common * o.abs()  # [B, N, H, L] (unchanged unless uniform_p)
        if uniform_p and numerics.l_from_rounded_p:  # l = n P: P's common factor reaches the lse, ln(1 + δ)
            b_lse = b_lse + torch.where(st.seen[..., None], u_common / (1 - u_common), 0.0)  # [B, N, H]
        s_out, s_lse = _fp64_slack(st, A_max, V, o, D, bucket.batch.seq_lens, **stats)  # the oracle's fp64 rounding
        return bucket.grid.unpad(b_out + s_out), bucket.grid.unpad(b_lse + s_lse)  # [t, H, L], [t, H]

    return Bound(*by_bucket(batch.buckets(), bucket_bound))


def split_bound(batch: DecodeBatch, numerics, num_splits: int) -> Bound:
    """Bound on |a - b| between two runs of one kernel on ``batch`` whose plans cut the rows' tokens differently
    (each row in at most ``num_splits`` pieces), before output rounding: the split-invariance check.

    Both runs compute the same scores s̃_j: a token's score is its own dot product over the channels, whatever tile
    or split holds it (MMA-based kernels accumulate over channels only; mla_fast's tiles also keep their positions,
    splits starting on the planner's 64-token blocks). What differs is the running max each piece rescales by, so P
    is rounded from other values, exp2 sees other arguments and the P·V sums run over other pieces, and the merge.
    Each run is within the §5(f) bound with the score errors shared (``_rounding_bound(shared_scores=True)``, no
    output rounding) plus ``merge_bound(num_splits)`` of the same o* = Σ_j softmax(s̃)_j v̂_j, lse* = ln Σ_j e^s̃_j:
        |a - b| <= 2 [shared-score §5(f) bound + merge_bound]        (out [T, H, L] and lse [T, H])
    For outputs rounded to out_dtype add u_out (|round a| + |round b|)(1 + u_out) + 2 eta_out. Without the shared
    scores the runs could differ by the score term tanh(ω_acc/4) R̂, most of kernel_bound on peaky rows; with them P
    rounding (u_P Σ p̂|v̂|, η_P), exp and accumulation remain, which a bound of 2 merge_bound alone misses: fp16 or
    bf16 P rounded under different maxima already differs by ~u_P p̂_j per token. A kernel that declares its scores
    plan-dependent (``numerics.plan_invariant_scores`` False) is charged each run's own score errors instead
    (``shared_scores=False``: twice the §5(f) distance to the oracle's o, that score term included).
    """
    _check_numerics(batch, numerics)
    q_operand = _q_operand(batch, numerics)  # batch-wide

    def bucket_bound(bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        st, A_max, V, o, kw = _kernel_grid(bucket, numerics, None, q_operand)
        kw["u_out"] = kw["eta_out"] = 0.0  # before output rounding
        out, lse = _rounding_bound(st, A_max, V, o, **kw, shared_scores=numerics.plan_invariant_scores)
        return bucket.grid.unpad(out), bucket.grid.unpad(lse)  # [t, H, L], [t, H]

    out, lse = by_bucket(batch.buckets(), bucket_bound)  # [T, H, L], [T, H]
    merge = merge_bound(batch, num_splits, partial_dtype=numerics.partial_dtype)
    return Bound(2 * (out + merge.out), 2 * (lse + merge.lse))


# ---- §5(a)–(d): quantization error of the fp64 oracle ------------------------------------------------------------


def _element_error(exact: torch.Tensor, stored_dtype: torch.dtype, exact_dtype: torch.dtype, scale):
    """Element error model (numerics.md §4, §5 notation): |x̂ - x| <= e = u|x| + η s, plus the clipping error of
    a saturating quantizer. Returns (e [same shape as exact], number of saturated elements as a [] int64 tensor).

    fp8 storage: (u, η) of the format, s = its scale. Round-to-nearest already maps |x| up to
    top = (max + h) s to ±max (h = u 2^⌊log2 max⌋, half the spacing at max: 464 for e4m3fn) with error <= u|x|;
    beyond top the clipped error |x| - max s = (|x| - top) + h s <= (|x| - top) + u|x|, so e gets
    max(|x| - top, 0) and such elements count as saturated. Other storage dtypes: a plain cast (s = 1, η = half
    the min subnormal; overflow to ±inf counted as saturated). Storage in the exact input's dtype: e = 0.
    """
    x = exact.abs()  # [...]
    if is_fp8(stored_dtype):
        f = fp8_format(stored_dtype)
        top = (f.max + f.u * 2.0 ** math.floor(math.log2(f.max))) * scale  # largest |x| that rounds to max
        clip = (x - top).clamp(min=0)  # [...]
        return f.u * x + f.eta * scale + clip, (x > top).sum()
    if stored_dtype == exact_dtype or stored_dtype == F64:
        return torch.zeros_like(x), (x > math.inf).sum()  # 0
    fi = torch.finfo(stored_dtype)
    return (fi.eps / 2) * x + fi.tiny * fi.eps / 2, (x > fi.max).sum()


def _check_pair(batch_q: DecodeBatch, batch_exact: DecodeBatch) -> None:
    """The two batches must describe the same problem."""
    batch_q.validate()
    batch_exact.validate()
    if tuple(batch_q.q.shape) != tuple(batch_exact.q.shape):
        raise ValueError(f"batch_exact.q: expected shape {tuple(batch_q.q.shape)}, got {tuple(batch_exact.q.shape)}")
    if batch_q.batch_size != batch_exact.batch_size:
        raise ValueError(f"batch_exact.seq_lens: expected {batch_q.batch_size} requests as batch_q")
    same = [bool(x) for x in torch.stack([(batch_q.seq_lens == batch_exact.seq_lens).all(),
                                           (batch_q.q_lens == batch_exact.q_lens).all()]).tolist()]  # one sync
    for name, ok in zip(("seq_lens", "q_lens"), same):
        if not ok:
            raise ValueError(f"batch_exact.{name}: expected {getattr(batch_q, name).tolist()} as batch_q")
    for name in ("sm_scale", "kv_lora_rank"):
        if getattr(batch_q, name) != getattr(batch_exact, name):
            raise ValueError(f"batch_exact.{name}: expected {getattr(batch_q, name)} as batch_q")


@dataclass
class _QuantGrid:
    """Every request's rows on the padded grid for the quantization bounds: exact and dequantized inputs and their
    error model (B requests, N grid rows, H heads, S tokens, D channels)."""

    grid: RequestGrid
    mask: torch.Tensor  # [B, N, S]
    q: torch.Tensor  # [B, N, H, D] exact
    q_hat: torch.Tensor  # [B, N, H, D] dequantized
    e_q: torch.Tensor  # [B, N, H, D] element error bound of q
    K: torch.Tensor  # [B, S, D] exact
    K_hat: torch.Tensor  # [B, S, D] dequantized
    e_k: torch.Tensor  # [B, S, D] element error bound of K
    st: _Softmax  # exact scores and weights p
    st_hat: _Softmax  # dequantized scores and weights p̂
    saturated: torch.Tensor  # [] saturated elements of q and K


def _quant_grid(bucket: Bucket, batch_exact: DecodeBatch, lse_exact: torch.Tensor | None = None) -> _QuantGrid:
    """``_QuantGrid`` of the bucket's requests (``bucket.batch`` quantized, their rows of the whole ``batch_exact``).
    ``lse_exact`` [T, H]: the whole exact oracle's LSE, reused for p = exp(s - lse)."""
    batch_q, batch_exact, grid = bucket.batch, bucket.take(batch_exact), bucket.grid
    sigma = batch_q.sm_scale
    mask = grid.mask  # [B, N, S]
    q = batch_exact.dequantized_q(F64)  # [T, H, D]
    e_q, sat_q = _element_error(q, batch_q.q.dtype, batch_exact.q.dtype, batch_q.q_scale)  # [T, H, D]
    q, q_hat, e_q = grid.pad(q), grid.pad(batch_q.dequantized_q(F64)), grid.pad(e_q)  # [B, N, H, D]
    K = batch_exact.padded_kv(grid.S, F64)  # [B, S, D] zero padding: no error, never saturated
    K_hat = batch_q.padded_kv(grid.S, F64)  # [B, S, D]
    e_k, sat_k = _element_error(K, batch_q.kv_cache.dtype, batch_exact.kv_cache.dtype, batch_q.kv_scale)
    st = _softmax(q, K, mask, sigma)
    if lse_exact is not None:
        shift = torch.where(st.seen[..., None], grid.pad(bucket.rows_of(lse_exact).to(F64)), 0.0)  # [B, N, H]
        st.p = torch.exp(st.s - shift[..., None])  # [B, N, H, S] exp(-inf) = 0 where not visible
    st_hat = _softmax(q_hat, K_hat, mask, sigma)
    return _QuantGrid(grid, mask, q, q_hat, e_q, K, K_hat, e_k, st, st_hat, sat_q + sat_k)


def _score_error_bound(r: _QuantGrid, sigma: float) -> torch.Tensor:
    """§5(a): δ_j = σ Σ_i (e^q_i |k_ji| + |q_i| e^k_ji + e^q_i e^k_ji) >= |ŝ_j - s_j|; [B, N, H, S]."""
    return sigma * (
        torch.einsum("bnhd,bsd->bnhs", r.e_q, r.K.abs())
        + torch.einsum("bnhd,bsd->bnhs", r.q.abs(), r.e_k)
        + torch.einsum("bnhd,bsd->bnhs", r.e_q, r.e_k)
    )


def _oracle_slack(r: _QuantGrid, sigma: float, L: int, D: int, seq_lens: torch.Tensor, R: torch.Tensor,
                  pv: torch.Tensor, dev: torch.Tensor):
    """fp64 evaluation error of both oracle runs (exact and dequantized inputs): ([B, N, H, L], [B, N, H]).
    R, pv, dev: ``_spread``, Σ_j p_j |v_jc| and ``_deviation`` of the exact inputs (already computed by the
    caller)."""
    total_out, total_lse = 0.0, 0.0
    for st, q, K, stats in ((r.st, r.q, r.K, dict(R=R, pv=pv, dev=dev)), (r.st_hat, r.q_hat, r.K_hat, {})):
        A_max = _masked_max(sigma * torch.einsum("bnhd,bsd->bnhs", q.abs(), K.abs()), r.mask)  # [B, N, H]
        o = torch.einsum("bnhs,bsc->bnhc", st.p, K[..., :L])  # [B, N, H, L]
        s_out, s_lse = _fp64_slack(st, A_max, K[..., :L], o, D, seq_lens, **stats)
        total_out, total_lse = total_out + s_out, total_lse + s_lse
    return total_out, total_lse


def quantization_bounds(
    batch_q: DecodeBatch, batch_exact: DecodeBatch, *, ref_exact: tuple[torch.Tensor, torch.Tensor] | None = None
) -> QuantBounds:
    """Tier-2 bounds on |mla_decode_ref(batch_q) - mla_decode_ref(batch_exact)| (numerics.md §5(a)–(d)).

    ``batch_q`` holds the quantized inputs (fp8 with q_scale / kv_scale, or a narrower float), ``batch_exact``
    the same problem unquantized (same seq_lens / q_lens; its own block table). Both bounds include the fp64
    evaluation error of the two oracle runs (``_fp64_slack``), so they hold for the computed references.

    B_det (a-priori, from the element error model e = u|x| + η s on every quantized channel, §5(a)–(c)):
        δ_j = σ Σ_i (e^q_i |k_ji| + |q_i| e^k_ji + e^q_i e^k_ji)      |Δs_j| <= δ_j            (a)
        ω_det = 2 max_j δ_j                                         spread of Δs             (b)
        B_det,c = min{tanh(ω_det/4) R_c, (e^ω_det - 1) min(Σ_j p_j|v_jc|, dev_c)}            (c) term 1
                + Σ_j p_j e^v_jc + tanh(ω_det/4)(max_j e^v_jc - min_j e^v_jc)                (c) term 2
        |Δlse| <= max_j δ_j                                                                  (a)
    B_post (a-posteriori, always valid and tight, §5(d)), with Δs = ŝ - s from both fp64 score sets:
        ω_act = max_j Δs_j - min_j Δs_j
        B_post,c = min{tanh(ω_act/4) R_c, (e^ω_act - 1) min(Σ_j p_j|v_jc|, dev_c)} + Σ_j p̂_j |v̂_jc - v_jc|
        |Δlse| <= max_j |Δs_j|
    Unhatted p, v, R come from the exact inputs; e^v = e^k[:, :L] (one rounding moves both score and value);
    dev_c >= sqrt(Σ_j p_j (v_jc - Σ_k p_k v_kc)²) (``_deviation``: term 1 about the mean, §5(c)).

    Args:
        ref_exact: (out, lse) of ``mla_decode_ref(batch_exact)`` if already computed: p is then exp(s - lse).
    """
    _check_pair(batch_q, batch_exact)
    _check_ref(batch_exact, ref_exact, "ref_exact")
    saturated = []  # [] int64 per bucket
    parts = by_bucket(batch_q.buckets(), lambda bucket: _quant_bucket(bucket, batch_exact, ref_exact, saturated))
    return QuantBounds(*parts, saturated=int(sum(saturated)))


def _quant_bucket(bucket: Bucket, batch_exact: DecodeBatch, ref_exact, saturated: list) -> tuple[torch.Tensor, ...]:
    """``quantization_bounds`` of the bucket's rows: (det_out, det_lse, post_out, post_lse, omega_det, omega_act),
    [t, H, L] and [t, H]; appends the bucket's saturated count to ``saturated``."""
    batch_q = bucket.batch
    L, D, sigma = batch_q.kv_lora_rank, batch_q.head_dim, batch_q.sm_scale
    r = _quant_grid(bucket, batch_exact, ref_exact[1] if ref_exact is not None else None)
    V, V_hat, e_v = r.K[..., :L], r.K_hat[..., :L], r.e_k[..., :L]  # [B, S, L]
    pv = torch.einsum("bnhs,bsc->bnhc", r.st.p, V.abs())  # [B, N, H, L] Σ_j p_j |v_jc|
    R = _spread(V, r.st.n_vis)  # [B, N, L]
    dev = _deviation(r.st, V)  # [B, N, H, L]
    seen = r.st.seen[..., None]  # [B, N, 1]

    # B_det: (a) score errors, (b) their spread, (c) output
    delta_max = _masked_max(_score_error_bound(r, sigma), r.mask)  # [B, N, H] max_j δ_j
    w_det = 2 * delta_max  # [B, N, H]
    term1 = _hull_term(w_det, R, pv, dev)  # [B, N, H, L]
    term2 = _value_term(r.st.p, e_v, w_det, r.st.n_vis)  # [B, N, H, L]

    # B_post: (d) from the actual score changes
    ds = torch.where(r.mask[:, :, None, :], r.st_hat.s - r.st.s, 0.0)  # [B, N, H, S] Δs_j (0 where not visible)
    w_act = _masked_max(ds, r.mask) + _masked_max(-ds, r.mask)  # [B, N, H] max Δs - min Δs
    moved = torch.einsum("bnhs,bsc->bnhc", r.st_hat.p, (V_hat - V).abs())  # [B, N, H, L] Σ_j p̂_j |v̂_jc - v_jc|

    slack_out, slack_lse = _oracle_slack(r, sigma, L, D, batch_q.seq_lens, R, pv, dev)  # [B, N, H, L], [B, N, H]
    saturated.append(r.saturated)
    unpad = r.grid.unpad
    return (
        unpad(term1 + term2 + slack_out),  # det_out [t, H, L]
        unpad(torch.where(seen, delta_max + slack_lse, 0.0)),  # det_lse [t, H]
        unpad(_hull_term(w_act, R, pv, dev) + moved + slack_out),  # post_out [t, H, L]
        unpad(torch.where(seen, _masked_max(ds.abs(), r.mask) + slack_lse, 0.0)),  # post_lse [t, H]
        unpad(w_det),  # omega_det [t, H]
        unpad(w_act),  # omega_act [t, H]
    )


# ---- §5(g): split-KV merge --------------------------------------------------------------------------------------


def merge_bound(batch: DecodeBatch, num_splits: int, *, accum: torch.dtype = torch.float32,
                partial_dtype: torch.dtype | None = None) -> Bound:
    """Extra error of merging ``num_splits`` split-KV partials with the exact LSE formula of numerics.md §3,
    evaluated in ``accum`` (numerics.md §5(g)); add it to ``kernel_bound`` for a split kernel.

    The partial outputs O_S are stored in ``partial_dtype`` (None: ``accum``; `KernelNumerics.partial_dtype`), their
    LSEs L_S in ``accum``; the merge computes M = max L_S, L = M + ln Σ exp(L_S - M), out = Σ_S exp(L_S - L) O_S.
    With Λ = max_j |ŝ_j| + ln n_vis >= |L_S|, |L| (m_S in [min ŝ, max ŝ], ln l_S in [0, ln n]), u = u(accum),
    u_o = u(partial_dtype) and η_o its half min subnormal:
        each partial and merged LSE carries <= 16 u Λ of log / base-conversion rounding (as in §5(f)), and
        L_S - L rounds with <= 2 u Λ, so every weight exp(L_S - L) has relative error
            ξ = ε_exp + 34 u Λ,     ε_exp = 4u (fp32 ex2.approx: 2^-22)
        the sum Σ exp(L_S - M) carries <= (S - 1) u relative, which moves L and so scales every weight by one
        common factor (a review's fp32 kernel of 4096 one-token splits measured 1.56 S u on out, over the S u that
        was charged without it); the sum over S weighted partials adds S u and their storage u_o |O_S| + η_o (below
        the normal range the rounding is absolute: fp16 partials under 2^-14 keep a 2^-24 grid); since
        Σ_S w_S |O_S,c| <= Σ_j p̂_j |v̂_jc| and Σ_S w_S = 1:
            |Δout_c| <= [(ξ + 2 S u + u_o) Σ_j p̂_j |v̂_jc| + η_o](1 + ξ)      (rows that see a token)
            |Δlse|   <= ξ + (S + 1) u + 16 u Λ
    A split output is a convex combination of values, so |O_S| <= max |v̂|: ValueError when that overflows fp16
    partials (past 65504), where the stored partial would be ±inf and no bound exists.
    Split positions do not enter the bound: ``num_splits`` is the largest number of splits of any row.
    One split (no merge) gives zeros. Measured (numerics.md §5(g)): <= 1.1e-5 Σp|v|, 1.3e-5 on LSE at N = 32768.
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1, got {num_splits!r}")
    batch.validate()
    L, H, T = batch.kv_lora_rank, batch.num_heads, batch.num_tokens
    if num_splits == 1:
        out = torch.zeros(T, H, L, dtype=F64, device=batch.device)  # [T, H, L]
        return Bound(out, torch.zeros(T, H, dtype=F64, device=batch.device))  # no merge: no error
    u = _unit_roundoff(accum)
    stored = accum if partial_dtype is None else partial_dtype
    u_o, eta_o = _unit_roundoff(stored), _half_min_subnormal(stored)
    if stored == torch.float16:  # the one partial dtype with a range below fp32's
        V_max = batch.kv_cache.float().abs().nan_to_num(0.0).amax().double() * (batch.kv_scale or 1.0)  # [] host sync
        if not bool(torch.isfinite(V_max.to(stored))):
            raise ValueError(f"merge_bound.partial_dtype: split outputs up to max |v| = {float(V_max):g} overflow "
                             f"{stored} (its max {torch.finfo(stored).max:g}): the stored partials would be inf")
    S = int(num_splits)

    def bucket_bound(bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        b, grid = bucket.batch, bucket.grid
        mask = grid.mask  # [B, N, S_max]
        K = b.padded_kv(grid.S, F64)  # [B, S_max, D]
        st = _softmax(grid.pad(b.dequantized_q(F64)), K, mask, b.sm_scale)  # [B, N, H, S_max]
        lam = _masked_max(st.s.abs(), mask) + torch.log(st.n_vis.clamp(min=1).to(F64))[..., None]  # [B, N, H] Λ
        xi = 4 * u + 34 * u * lam  # [B, N, H] relative error of a merge weight
        pv = torch.einsum("bnhs,bsc->bnhc", st.p, K[..., :L].abs())  # [B, N, H, L] Σ_j p̂_j |v̂_jc|
        seen = st.seen[..., None, None]  # [B, N, 1, 1]
        out = ((xi + 2 * S * u + u_o)[..., None] * pv + seen.to(F64) * eta_o) * (1 + xi)[..., None]  # [B, N, H, L]
        lse = torch.where(st.seen[..., None], xi + (S + 1) * u + 16 * u * lam, 0.0)  # [B, N, H]
        return grid.unpad(out), grid.unpad(lse)  # [t, H, L], [t, H]

    return Bound(*by_bucket(batch.buckets(), bucket_bound))


# ---- §5(e): probabilistic estimates (statistics only) ----------------------------------------------------------


def prob_bound(batch_q: DecodeBatch, batch_exact: DecodeBatch, *, alpha: float = 1e-3) -> Bound:
    """Probabilistic bound on the quantization error (numerics.md §5(e); Higham & Mary 2019).

    **Statistics only — never a pass/fail oracle.** It assumes independent, mean-zero rounding errors; coherent
    rounding (constant or repeated values, exactly what Hypothesis shrinks towards) violates it (§5.1: err/B_prob
    up to 0.48 with ω_prob below ω_act). Use it to summarise random draws.

    Hoeffding per (row, head, token), each rounding bounded by the element error e = u|x| + η s:
        |Δs_j| <= δ^p_j = σ λ sqrt(Σ_i (e^q_i k_ji)² + (q_i e^k_ji)²),   λ = sqrt(2 ln(2 N / α))
    with N the number of visible (row, head, token) triples (union bound at failure probability α), and
        |Δo_c| <= min{tanh(ω_p/4) R_c, (e^ω_p - 1) Σ_j p_j|v_jc|} + λ' sqrt(Σ_j p_j² (e^v_jc)²),  ω_p = 2 max_j δ^p_j
    with λ' = sqrt(2 ln(2 T H L / α)); |Δlse| <= max_j δ^p_j.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha: expected a failure probability in (0, 1), got {alpha!r}")
    L, H, T = batch_q.kv_lora_rank, batch_q.num_heads, batch_q.num_tokens
    sigma = batch_q.sm_scale
    n_pairs = max(int(batch_q.visible_tokens().sum()) * H, 1)
    lam = math.sqrt(2 * math.log(2 * n_pairs / alpha))
    lam_out = math.sqrt(2 * math.log(2 * max(T * H * L, 1) / alpha))
    _check_pair(batch_q, batch_exact)

    def bucket_bound(bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:  # lam, lam_out: the whole batch's
        r = _quant_grid(bucket, batch_exact)
        V, e_v = r.K[..., :L], r.e_k[..., :L]  # [B, S, L]
        var_s = torch.einsum("bnhd,bsd->bnhs", r.e_q**2, r.K**2) + torch.einsum("bnhd,bsd->bnhs", r.q**2, r.e_k**2)
        delta_p = sigma * lam * var_s.sqrt()  # [B, N, H, S]
        dmax = _masked_max(delta_p, r.mask)  # [B, N, H]
        pv = torch.einsum("bnhs,bsc->bnhc", r.st.p, V.abs())  # [B, N, H, L]
        v_term = lam_out * torch.einsum("bnhs,bsc->bnhc", r.st.p**2, e_v**2).sqrt()  # [B, N, H, L]
        out = _hull_term(2 * dmax, _spread(V, r.st.n_vis), pv) + v_term  # [B, N, H, L]
        return r.grid.unpad(out), r.grid.unpad(dmax)  # [t, H, L], [t, H]

    return Bound(*by_bucket(batch_q.buckets(), bucket_bound))


def _centered_cross(p: torch.Tensor, V: torch.Tensor, K: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Cov_p(v_c, k_i) = Σ_j p_j (v_jc - o_c) k_ji: p [n, H, s], V [s, L], K [s, D], o [n, H, L] -> [n, H, L, D].

    Heads go in chunks so the [chunk, L, s] weighted values stay near 2^24 elements.
    """
    n, H, s = p.shape
    cov = p.new_empty(n, H, V.shape[1], K.shape[1])  # [n, H, L, D]
    chunk = max(1, 2**24 // max(V.shape[1] * s, 1))
    for t in range(n):
        for h in range(0, H, chunk):
            pv_t = V.T[None] * p[t, h : h + chunk, None, :]  # [c, L, s] p_j v_jc
            cov[t, h : h + chunk] = pv_t @ K  # [c, L, D] Σ_j p_j v_jc k_ji
    return cov - o[..., None] * torch.einsum("nhs,si->nhi", p, K)[:, :, None, :]  # subtract o_c Σ_j p_j k_ji


def rms_estimate(batch_q: DecodeBatch, batch_exact: DecodeBatch) -> torch.Tensor:
    """First-order RMS prediction of the quantization error of out, [T, H, L] (numerics.md §5(e)).

    **Statistics only — never a pass/fail oracle** (§5.1: 3–65x too small for coherent rounding, 1.3–1.4x too
    large on random data). Each element error is modelled as uniform on [-e, e], variance e²/3, e = u|x| + η s,
    independent across elements. To first order Δo_c = Σ_j p_j (v_jc - o_c) Δs_j + Σ_j p_j Δv_jc with
    Δs_j = σ Σ_i (Δq_i k_ji + q_i Δk_ji), so (k-rounding of a score and of the same value treated as independent):
        Var(Δo_c) = (1/3) [ σ² Σ_j p_j² (v_jc - o_c)² Σ_i q_i² (e^k_ji)²          K rounding through the scores
                          + Σ_j p_j² (e^v_jc)²                                     V rounding
                          + σ² Σ_i (e^q_i)² (Σ_j p_j (v_jc - o_c) k_ji)² ]          q rounding (shared by all j)
    """
    _check_pair(batch_q, batch_exact)
    return by_bucket(batch_q.buckets(), lambda bucket: (_rms_bucket(bucket, batch_exact),))[0]


def _rms_bucket(bucket: Bucket, batch_exact: DecodeBatch) -> torch.Tensor:
    """``rms_estimate`` of the bucket's rows: [t, H, L]."""
    L, sigma = bucket.batch.kv_lora_rank, bucket.batch.sm_scale
    r = _quant_grid(bucket, batch_exact)
    var = torch.zeros_like(r.q[..., :L])  # [B, N, H, L]
    for b in range(r.K.shape[0]):  # one request at a time: the [N, H, L, D] covariance is large
        V, e_v, p = r.K[b, :, :L], r.e_k[b, :, :L], r.st.p[b]  # [S, L], [S, L], [N, H, S]
        o = torch.einsum("nhs,sc->nhc", p, V)  # [N, H, L]
        g = torch.einsum("nhd,sd->nhs", r.q[b] ** 2, r.e_k[b] ** 2)  # [N, H, S] Σ_i q_i² (e^k_ji)²
        w = p**2 * g  # [N, H, S]
        k_term = (
            torch.einsum("nhs,sc->nhc", w, V**2)
            - 2 * o * torch.einsum("nhs,sc->nhc", w, V)
            + o**2 * w.sum(dim=-1, keepdim=True)
        )  # [N, H, L] Σ_j p_j² g_j (v_jc - o_c)²
        v_term = torch.einsum("nhs,sc->nhc", p**2, e_v**2)  # [N, H, L]
        cov = _centered_cross(p, V, r.K[b], o)  # [N, H, L, D]
        q_term = torch.einsum("nhi,nhci->nhc", r.e_q[b] ** 2, cov**2)  # [N, H, L]
        var[b] = (sigma**2 * k_term.clamp(min=0) + v_term + sigma**2 * q_term) / 3
    return r.grid.unpad(var).sqrt()
