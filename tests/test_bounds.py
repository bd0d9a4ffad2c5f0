"""verify.bounds: the derived bounds of numerics.md §5 hold (soundness), are not vacuous, and can fail.

Data follow the calibration of numerics.md §5.1 at small size (L = 64, R = 32, H = 4) plus one run at
DeepSeek-V3 dims (L = 512, R = 64). Scores have a target standard deviation: with q, k entries ~ N(0, a²),
std(σ <q, k>) = σ a² sqrt(D), so a² = std / (σ sqrt(D)).
"""

import dataclasses
import math
import types

import pytest
import torch

from mla_fast.emulate import run_plan_reference
from mla_fast.numerics import KernelNumerics
from mla_fast.planner import PARTIAL_ROW, plan_decode
from mla_ref.decode import DecodeBatch, make_decode_batch, merge_partials, mla_decode_ref
from mla_ref.fp8 import fp8_format, quantize, round_p
from verify import bounds
from verify.bounds import (
    _deviation,
    _hull_term,
    _Softmax,
    _spread,
    kernel_bound,
    merge_bound,
    oracle_bound,
    prob_bound,
    quantization_bounds,
    rms_estimate,
    split_bound,
)
from verify.metrics import compare

SIGMA = 0.1352338  # DeepSeek-V3 softmax scale (YaRN mscale² included)
U32 = 2.0**-24
U64 = 2.0**-53  # fp64 unit roundoff
F64 = torch.float64
SCORE_STD = {"gauss1": 1.0, "gauss4": 4.0, "outlier": 1.0, "sink": 1.0, "coherent": 2.0}


def _coherent(x: torch.Tensor) -> torch.Tensor:
    """Put every value 0.45 spacings beyond an e4m3fn grid point (scale 1): all round back, all shrink."""
    f = fp8_format("e4m3fn")
    x0 = quantize(x, "e4m3fn", scale=1.0)[0].double()  # [...] on the grid
    e = torch.floor(torch.log2(x0.abs().clamp(min=f.min_normal)))  # binade exponent
    return (x0 + 0.45 * (2 * f.u * 2**e) * torch.sign(x0)).float()


def _inputs(case, seed, L, R, H, seq, q_lens):
    """fp32 q [T, H, D] and per-request KV [s_b, D] for one calibration case of numerics.md §5.1."""
    g = torch.Generator().manual_seed(seed)
    D, T = L + R, sum(q_lens)
    a = math.sqrt(SCORE_STD[case] / (SIGMA * math.sqrt(D)))
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64) * a  # [T, H, D]
    kv = torch.randn(sum(seq), D, generator=g, dtype=torch.float64) * a  # [Σ s, D]
    starts = [0, *torch.tensor(seq).cumsum(0).tolist()]
    if case == "sink":  # token 0 of every request gets about +12 logit in every head, through the rope channels
        c = math.sqrt(12 / (SIGMA * R))
        q[..., L:] += c
        kv[[s for s, e in zip(starts[:-1], starts[1:]) if e > s], L:] += c
    if case == "outlier":  # 2 latent channels x3000 (scores unchanged): per-tensor scale pushes the rest subnormal
        kv[:, :2] *= 3000
        q[..., :2] /= 3000
    q, kv = q.float(), kv.float()
    if case == "coherent":
        q, kv = _coherent(q), _coherent(kv)
    return q, [kv[s:e] for s, e in zip(starts[:-1], starts[1:])]


def _fp8_pair(case, seed=0, L=64, R=32, H=4, seq=(64, 100, 300), q_lens=(1, 1, 1)):
    """(batch_q, batch_exact): e4m3fn q and KV with per-tensor scales (dynamic amax/448; static 1 for coherent)."""
    q, kvs = _inputs(case, seed, L, R, H, seq, q_lens)
    scale = 1.0 if case == "coherent" else None
    q8, q_scale = quantize(q, "e4m3fn", scale=scale)
    _, kv_scale = quantize(torch.cat(kvs), "e4m3fn", scale=scale)
    kv8 = [quantize(kv, "e4m3fn", scale=kv_scale)[0] for kv in kvs]
    kw = dict(q_lens=list(q_lens), sm_scale=SIGMA, kv_lora_rank=L, page_size=16)
    batch_exact = make_decode_batch(q, kvs, generator=torch.Generator().manual_seed(seed), **kw)
    batch_q = make_decode_batch(
        q8, kv8, generator=torch.Generator().manual_seed(seed), q_scale=float(q_scale), kv_scale=float(kv_scale), **kw
    )
    return batch_q, batch_exact


def _bf16_batch(case, seed=0, L=64, R=32, H=4, seq=(0, 37, 100, 1), q_lens=(1, 3, 2, 3)):
    """bf16 batch; the defaults include an empty request and MTP rows that see 0 or 1 token."""
    q, kvs = _inputs(case, seed, L, R, H, seq, q_lens)
    return make_decode_batch(
        q.bfloat16(), [kv.bfloat16() for kv in kvs], q_lens=list(q_lens), sm_scale=SIGMA, kv_lora_rank=L,
        page_size=16, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def _emulate(batch, p_fmt, p_scale, *, sm_factor=1.0, extra_tokens=0):
    """A kernel in fp32 on the stored values: scales folded into the scores / output, P rounded by round_p,
    row sum l from unrounded P, bf16 output. sm_factor and extra_tokens plant bugs."""
    L, T, H = batch.kv_lora_rank, batch.num_tokens, batch.num_heads
    c = torch.tensor(batch.sm_scale * sm_factor * (batch.q_scale or 1.0) * (batch.kv_scale or 1.0))  # fp32
    q = batch.q.float()  # [T, H, D] stored values (fp8 codes are exact in fp32)
    visible = batch.visible_tokens() + extra_tokens  # [T]
    out, lse = torch.zeros(T, H, L), torch.full((T, H), -math.inf)
    qo = batch.qo_indptr.tolist()
    for b in range(batch.batch_size):
        rows = slice(qo[b], qo[b + 1])
        K = batch.kv_cache[batch.token_slots(b)].float()  # [s, D]
        mask = torch.arange(K.shape[0])[None, :] < visible[rows, None]  # [n, s]
        s = (torch.einsum("nhd,sd->nhs", q[rows], K) * c).masked_fill(~mask[:, None, :], -math.inf)  # [n, H, s]
        seen = mask.any(dim=1)[:, None]  # [n, 1]
        m = torch.where(seen, s.amax(dim=-1) if K.shape[0] else 0.0, 0.0)  # [n, H]
        p = torch.exp(s - m[..., None])  # [n, H, s]
        l = p.sum(dim=-1)  # [n, H]
        o = torch.einsum("nhs,sc->nhc", round_p(p, p_fmt, p_scale), K[:, :L])  # [n, H, L]
        out[rows] = o / torch.where(seen, l, 1.0)[..., None] * (batch.kv_scale or 1.0)
        lse[rows] = torch.where(seen, m + torch.log(l), -math.inf)
    return out.to(torch.bfloat16), lse


def _fp32_numerics(batch, p_fmt=None, p_scale=1.0, out_dtype=torch.bfloat16):
    """KernelNumerics of a CPU fp32 computation: any-order fp32 sums have error <= (n - 1) u Σ|terms|;
    QK: D - 1 additions + the scale multiply (D + 2 with margin for γ_n = nu / (1 - nu)); PV: s_max tokens, the
    division by l and the kv_scale multiply."""
    D, s_max = batch.head_dim, int(batch.seq_lens.max())
    return KernelNumerics(
        p_fmt=p_fmt, p_scale=p_scale, qk_operand=torch.float32, pv_operand=torch.float32,
        gamma_qk=(D + 2) * U32, gamma_pv=(s_max + 4) * U32, out_dtype=out_dtype,
    )  # fmt: skip


def _report(rep):
    return f"{rep.err_over_bound_max:.3g} (median {rep.err_over_bound_median:.3g})"


# ---- (1) soundness of the quantization bounds: the calibration table of numerics.md §5.1, small ------------------


@pytest.mark.parametrize("case", list(SCORE_STD))
def test_quantization_bounds_hold_calibration(case):
    batch_q, batch_exact = _fp8_pair(case)
    ref_q, ref_exact = mla_decode_ref(batch_q), mla_decode_ref(batch_exact)
    qb = quantization_bounds(batch_q, batch_exact, ref_exact=ref_exact)
    reps = {
        "det out": compare(ref_q[0], ref_exact[0], qb.det_out, out_dtype=torch.float64),
        "post out": compare(ref_q[0], ref_exact[0], qb.post_out, out_dtype=torch.float64),
        "det lse": compare(ref_q[1], ref_exact[1], qb.det_lse, name="lse", out_dtype=torch.float32),
        "post lse": compare(ref_q[1], ref_exact[1], qb.post_lse, name="lse", out_dtype=torch.float32),
    }
    print(
        f"\n{case}: ω_det {qb.omega_det.min():.2f}–{qb.omega_det.max():.2f}, ω_act {qb.omega_act.min():.2f}–"
        f"{qb.omega_act.max():.2f}, " + ", ".join(f"err/B {k} {_report(r)}" for k, r in reps.items())
    )
    for name, rep in reps.items():
        assert rep.ok, f"{name}\n{rep.describe()}"
    assert qb.saturated == 0
    # B_post <= B_det: ω_act <= ω_det and Σ p̂|v̂ - v| <= Σ p e^v + tanh(ω_det/4) spread(e^v) (§5(c), (d))
    assert bool((qb.omega_act <= qb.omega_det).all())
    assert bool((qb.post_out <= qb.det_out).all()) and bool((qb.post_lse <= qb.det_lse).all())


def test_quantization_bounds_real_dims_mtp_and_empty_rows():
    seq, q_lens = (0, 1, 300), (1, 3, 2)  # empty request; MTP rows seeing 0, 0, 1 tokens; 299 and 300
    batch_q, batch_exact = _fp8_pair("gauss4", seed=1, L=512, R=64, H=8, seq=seq, q_lens=q_lens)
    ref_q, ref_exact = mla_decode_ref(batch_q), mla_decode_ref(batch_exact)
    qb = quantization_bounds(batch_q, batch_exact)
    empty = batch_q.visible_tokens() == 0  # [T]
    many = batch_q.visible_tokens() > 1  # [T] rows where the bound is not exact by construction
    for label, bound_out, bound_lse in (("B_det", qb.det_out, qb.det_lse), ("B_post", qb.post_out, qb.post_lse)):
        rep = compare(ref_q[0], ref_exact[0], bound_out, out_dtype=torch.float64)
        rep_lse = compare(ref_q[1], ref_exact[1], bound_lse, name="lse", out_dtype=torch.float32)
        assert rep.ok and rep_lse.ok, rep.describe() + "\n" + rep_lse.describe()
        assert bool((bound_out[empty] == 0).all()) and bool((bound_lse[empty] == 0).all())
        assert rep_lse.nonfinite_count == int(empty.sum()) * batch_q.num_heads  # -inf == -inf on empty rows
        rows = compare(ref_q[0][many], ref_exact[0][many], bound_out[many], out_dtype=torch.float64)
        print(f"\nreal dims gauss4, rows with 299-300 tokens: err/{label} {_report(rows)}", end="")


def test_quantization_bounds_validate_the_pair():
    batch_q, batch_exact = _fp8_pair("gauss1", seq=(5, 9), q_lens=(1, 1))
    with pytest.raises(ValueError, match="seq_lens"):
        quantization_bounds(batch_q, _fp8_pair("gauss1", seq=(5, 8), q_lens=(1, 1))[1])
    with pytest.raises(ValueError, match="sm_scale"):
        quantization_bounds(batch_q, batch_exact.replace(sm_scale=0.5))
    out, lse = mla_decode_ref(batch_exact)
    for bad in [(out[:1], lse), (out, lse[:, :1]), (out,), "out"]:  # lse [T, 1] broadcast silently
        with pytest.raises(ValueError, match="ref_exact: expected"):
            quantization_bounds(batch_q, batch_exact, ref_exact=bad)
    with pytest.raises(ValueError, match="ref: expected"):
        kernel_bound(batch_exact, _fp32_numerics(batch_exact), ref=(out, lse[:, :1]))
    with pytest.raises(ValueError, match="numerics: expected a mla_fast.numerics.KernelNumerics"):
        kernel_bound(batch_exact, None)


# ---- (2) soundness of the kernel bound: fp32 emulation with P rounded as declared ---------------------------------


@pytest.mark.parametrize("case", ["gauss1", "gauss4", "sink"])
@pytest.mark.parametrize("p_fmt, p_scale", [(None, 1.0), ("bf16", 1.0), ("e4m3fn", 1.0), ("e4m3fn", 256.0)])
def test_kernel_bound_holds_for_emulation(case, p_fmt, p_scale):
    batch = _bf16_batch(case)
    ref = mla_decode_ref(batch)
    bound = kernel_bound(batch, _fp32_numerics(batch, p_fmt, p_scale), ref=ref)
    out, lse = _emulate(batch, p_fmt, p_scale)
    rep, rep_lse = compare(out, ref[0], bound.out), compare(lse, ref[1], bound.lse, name="lse", out_dtype=torch.float32)
    print(f"\n{case} P={p_fmt}x{p_scale:g}: err/B out {_report(rep)}, lse {_report(rep_lse)}")
    assert rep.ok, rep.describe()
    assert rep_lse.ok, rep_lse.describe()
    empty = batch.visible_tokens() == 0
    assert bool((bound.out[empty] == 0).all()) and bool((bound.lse[empty] == 0).all())


def test_kernel_bound_holds_for_fp8_inputs_with_folded_scales():
    batch_q, _ = _fp8_pair("gauss4", seq=(0, 50, 130), q_lens=(1, 2, 1))
    ref = mla_decode_ref(batch_q)
    for p_fmt in ("bf16", "e4m3fn"):
        bound = kernel_bound(batch_q, _fp32_numerics(batch_q, p_fmt))
        out, lse = _emulate(batch_q, p_fmt, 1.0)
        rep = compare(out, ref[0], bound.out)
        rep_lse = compare(lse, ref[1], bound.lse, name="lse", out_dtype=torch.float32)
        assert rep.ok and rep_lse.ok, rep.describe() + "\n" + rep_lse.describe()


def test_kernel_bound_real_dims_and_not_vacuous():
    """(4) Tightness at DeepSeek-V3 dims with bf16 P: the bound is ≈ (2⁻⁸ + 2⁻⁸)·Σp|v| + 2⁻⁸|o| plus a
    tanh(ω_acc/4)·R term with ω_acc ≈ 2·577·2⁻²⁴·max A ≈ 1e-3, so bound / max|o| stays near 3·2⁻⁸ ≈ 0.012 times
    Σp|v| / max|o|, which is O(1) for these rows (≤ 300 tokens, score std 1); 0.05 leaves room for that ratio
    and still rules out a vacuous bound (fp8-sized tolerances are ≥ 0.06 relative, numerics.md §6)."""
    batch = _bf16_batch("gauss1", seed=2, L=512, R=64, H=8, seq=(300, 1, 64), q_lens=(1, 2, 2))
    ref = mla_decode_ref(batch)
    bound = kernel_bound(batch, _fp32_numerics(batch, "bf16"), ref=ref)
    out, lse = _emulate(batch, "bf16", 1.0)
    rep, rep_lse = compare(out, ref[0], bound.out), compare(lse, ref[1], bound.lse, name="lse", out_dtype=torch.float32)
    assert rep.ok and rep_lse.ok, rep.describe() + "\n" + rep_lse.describe()
    tightness = float(bound.out.max() / ref[0].abs().max())
    print(f"\nreal dims bf16 P: err/B out {_report(rep)}, lse {_report(rep_lse)}, max B / max|o| {tightness:.4f}")
    assert tightness < 0.05


def _exact_numerics(operand=torch.float64, p_fmt=None, scale_then_round=False, pv_operand=None):
    """A kernel exact but for the rounding under test: no accumulation error, fp64 output."""
    return KernelNumerics(
        p_fmt=p_fmt, p_scale=1.0, qk_operand=operand, pv_operand=pv_operand or operand, gamma_qk=0.0, gamma_pv=0.0,
        out_dtype=torch.float64, scale_then_round=scale_then_round,
    )  # fmt: skip


def _fp64_kernel(batch, q_fed, k_fed, p_fmt=None):
    """fp64 decode of the fed operands (what the MMAs see, real units) with P rounded by round_p: out [T, H, L]."""
    L = batch.kv_lora_rank
    out = torch.zeros(batch.num_tokens, batch.num_heads, L, dtype=torch.float64)
    qo, visible = batch.qo_indptr.tolist(), batch.visible_tokens()
    for b in range(batch.batch_size):
        K = k_fed[b]  # [s, D]
        for t in range(qo[b], qo[b + 1]):
            n = int(visible[t])
            if n == 0:
                continue
            s = batch.sm_scale * q_fed[t] @ K[:n].T  # [H, n]
            p = torch.exp(s - s.amax(dim=-1, keepdim=True))  # [H, n]
            out[t] = round_p(p, p_fmt) @ K[:n, :L] / p.sum(dim=-1, keepdim=True)  # [H, L]
    return out


def test_kernel_bound_charges_fp16_p_underflow():
    """fp16 P flushes p < 2^-25 to 0 (half its min subnormal, numerics.md §4): an absolute error u_P cannot cover.
    One token with v = 0 takes the softmax; 2047 others sit 2^-25..2^-26.5 below it (scores set through one rope
    channel) with v = 64, so fp16 P loses (or doubles) them all. Within the fp16 bound (η_P = 2^-25); beyond the
    bound of a bf16 P (8x larger u, no flush): the underflow term is what holds it."""
    n, H, L, R = 2048, 2, 64, 32
    g = torch.Generator().manual_seed(0)
    kv = torch.zeros(n, L + R, dtype=torch.float64)  # [n, D]
    kv[1:, :L] = 64.0  # V of the small tokens; token 0: v = 0
    kv[1:, L] = -math.log(2) * (25 + 1.5 * torch.rand(n - 1, generator=g, dtype=torch.float64))  # s_j - s_0
    q = torch.zeros(1, H, L + R, dtype=torch.float64)  # [T, H, D]
    q[..., L] = 1 / SIGMA  # s_j = σ q_L k_jL ≈ k_jL (both rounded to bf16)
    batch = make_decode_batch(
        q.bfloat16(), [kv.bfloat16()], q_lens=[1], sm_scale=SIGMA, kv_lora_rank=L, page_size=16,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    ref = mla_decode_ref(batch)
    out = _fp64_kernel(batch, batch.dequantized_q(), [batch.request_kv(0)], p_fmt="fp16")
    rep = compare(out, ref[0], kernel_bound(batch, _exact_numerics(torch.float16, "fp16"), ref=ref).out)
    rep_bf16 = compare(out, ref[0], kernel_bound(batch, _exact_numerics(torch.bfloat16, "bf16"), ref=ref).out)
    print(f"\nfp16 P underflow: err/B fp16 {_report(rep)}, as if bf16 {_report(rep_bf16)}")
    assert rep.ok, rep.describe()
    assert not rep_bf16.ok


def test_kernel_bound_charges_flushed_q_operand():
    """bf16 q cast to an fp16 operand (mla_fast "fp8kv"): |q| < 2^-25 flushes to 0 and |q| < 2^-14 keeps a 2^-24
    grid, absolute errors a relative u cannot bound. Tiny q against large k (kv_scale ~ 90), V exact (fp64 P·V
    operands, so only the scores carry the rounding): within the bound that charges u|q| + 2^-25 per q element;
    beyond it with the relative u alone (the q operand declared fp32: exact but for u = 2^-24, no flush)."""
    L, R, H = 64, 32, 2
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(2, H, L + R, generator=g) * 2**-24).bfloat16()  # [T, H, D] mostly fp16-subnormal or flushed
    kv = torch.randn(300, L + R, generator=g) * 1e4  # [s, D]
    kv8, kv_scale = quantize(kv, "e4m3fn")
    batch = make_decode_batch(
        q, [kv8[:120], kv8[120:]], q_lens=[1, 1], sm_scale=SIGMA, kv_lora_rank=L, page_size=16,
        generator=torch.Generator().manual_seed(1), kv_scale=float(kv_scale),
    )  # fmt: skip
    ref = mla_decode_ref(batch)
    q_fed = batch.q.to(torch.float16).double()  # [T, H, D] what an fp16 MMA sees: subnormal grid, flushes
    out = _fp64_kernel(batch, q_fed, [batch.request_kv(b) for b in range(2)])
    rep = compare(out, ref[0], kernel_bound(batch, _exact_numerics(torch.float16, pv_operand=F64), ref=ref).out)
    rep_exact = compare(out, ref[0], kernel_bound(batch, _exact_numerics(torch.float32, pv_operand=F64), ref=ref).out)
    print(f"\nflushed fp16 q: err/B {_report(rep)}, relative u only {_report(rep_exact)}")
    assert rep.ok, rep.describe()
    assert not rep_exact.ok


def test_kernel_bound_scale_then_round():
    """A kernel that forms k = code · kv_scale in fp32 and rounds it to bf16 before the MMAs (FlashInfer's fp8 KV
    path): a non-power-of-two scale adds up to 2^-9 relative on every K and V element. Declared with
    scale_then_round the bound holds; declared without, the MMAs are assumed to see exact codes and it fails (score
    std 12: the K rounding moves the scores, and with them the softmax, by more than the 2^-8 P budget covers)."""
    L, R, H, seq = 64, 32, 4, (40, 200)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, H, L + R, generator=g) * (12 / (SIGMA * math.sqrt(L + R)))  # [T, H, D] score std 12
    kv8, kv_scale = quantize(torch.randn(sum(seq), L + R, generator=g), "e4m3fn")  # [Σs, D], dynamic scale
    batch = make_decode_batch(
        q.bfloat16(), [kv8[: seq[0]], kv8[seq[0] :]], q_lens=[1, 2], sm_scale=SIGMA, kv_lora_rank=L, page_size=16,
        generator=g, kv_scale=float(kv_scale),
    )  # fmt: skip
    assert math.log2(batch.kv_scale) % 1 != 0  # amax / 448: not a power of two
    ref = mla_decode_ref(batch)
    k_fed = []
    for b in range(batch.batch_size):
        codes = batch.kv_cache[batch.token_slots(b)].float()  # [s, D]
        k_fed.append((codes * torch.tensor(batch.kv_scale)).bfloat16().double())  # fp32 product, then bf16
    out = _fp64_kernel(batch, batch.dequantized_q(), k_fed)
    reps = {
        flag: compare(out, ref[0], kernel_bound(batch, _exact_numerics(torch.bfloat16, None, flag), ref=ref).out)
        for flag in (True, False)
    }
    print(f"\nscale then round: err/B with the flag {_report(reps[True])}, without {_report(reps[False])}")
    assert reps[True].ok, reps[True].describe()
    assert not reps[False].ok


def test_per_token_pv_charge_follows_each_requests_length():
    """gamma_pv_per_token is charged times each request's own seq_len (the P.V accumulation into the running output
    grows with the request, mla_fast/numerics.py point 5): the same as a fixed gamma_pv of that product, request by
    request, and a longer request gets the larger bound."""
    import dataclasses

    batch = _bf16_batch("gauss1", seq=(37, 300), q_lens=(1, 1))
    base = _fp32_numerics(batch)
    g = 2**-24
    per_token = kernel_bound(batch, dataclasses.replace(base, gamma_pv_per_token=g))
    for b, n in enumerate((37, 300)):
        fixed = kernel_bound(batch, dataclasses.replace(base, gamma_pv=base.gamma_pv + g * n))
        assert torch.equal(per_token.out[b], fixed.out[b]) and torch.equal(per_token.lse[b], fixed.lse[b]), b
    plain = kernel_bound(batch, base)
    grown = (per_token.out - plain.out).abs() / plain.out.abs().clamp_min(1e-300)  # [T, H, L] relative growth
    assert (per_token.out >= plain.out).all() and grown[1].max() > grown[0].max()


@pytest.mark.parametrize("field, value", [("gamma_pv", -1e-3), ("gamma_qk", float("nan")), ("p_scale", 0.0),
                                          ("gamma_pv_per_token", float("inf")), ("gamma_pv", True)])
def test_kernel_numerics_refuses_bad_values(field, value):
    import dataclasses

    with pytest.raises(ValueError, match=f"KernelNumerics.{field}"):
        dataclasses.replace(_fp32_numerics(_bf16_batch("gauss1")), **{field: value})


def test_a_per_token_charge_above_one_gives_an_infinite_lse_bound():
    """gamma_pv + gamma_pv_per_token x seq_len >= 1 (FlashMLA fp8's measured per-token charge past ~54k tokens)
    leaves no finite bound on ln l: the lse bound is +inf, not the negative gamma / (1 - gamma) that compare()
    refused, stopping a campaign (found by a review)."""
    import dataclasses

    batch = _bf16_batch("gauss1", seq=(37, 300), q_lens=(1, 1))
    numerics = dataclasses.replace(_fp32_numerics(batch), gamma_pv_per_token=1 / 100)  # >= 1 at 300 tokens only
    bound = kernel_bound(batch, numerics)
    assert torch.isfinite(bound.lse[0]).all() and torch.isposinf(bound.lse[1]).all()
    assert compare(batch.q.new_zeros(bound.lse.shape).double(), bound.lse.new_zeros(bound.lse.shape), bound.lse).ok


def test_declared_pv_charge_covers_the_hopper_truncation_model():
    """The Triton kernel's declared P.V charge per token covers the model its docstring derives: each product
    truncated below 2^-25 of the running sum, one fp32 rounding (2^-23) per k16 instruction; and the old fixed
    charge (one 64-token MMA from zero per tile, for requests up to 2^18 tokens) did not at 2^18 tokens."""
    from mla_fast.numerics import HOPPER_PV_PER_TOKEN, triton_numerics

    model = 2**-25 + 2**-23 / 16  # per token, relative to the running output (<= Σ p|v|)
    for mma in ("bf16", "fp16"):
        declared = triton_numerics(mma)
        assert declared.gamma_pv_per_token >= HOPPER_PV_PER_TOKEN > model
    old_fixed = (64 + 2**18 // 64 + 4) * 2**-23
    assert model * 2**18 > old_fixed  # what the review found: 2.07x on one H200


def test_unit_roundoffs_are_half_an_ulp():
    """u of each format the bounds read (pinned: eps instead of eps / 2 doubled every 16-bit term of tier 1 and no
    soundness test noticed; a review's mutant)."""
    from verify.bounds import _unit_roundoff

    want = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24, torch.float64: 2**-53,
            torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3, "bf16": 2**-8, "fp16": 2**-11, None: 2**-24}
    for fmt, u in want.items():
        assert _unit_roundoff(fmt) == u, fmt


def test_kernel_bound_holds_a_declared_p_scale_to_its_underflow_term():
    """A kernel that declares P x 256 before its e4m3fn cast (η_P = 2^-10 / 256 = 2^-18, numerics.md §5(f)) but
    casts P unscaled flushes every p below 2^-10 to 0: 2047 tokens with p in [2^-16, 2^-12] and v = 64 beside one
    dominant token with v = 0 then lose most of the output. Tier 1 must fail it and pass the kernel that scales
    (a review's mutant that dropped p_scale from η_P, 256x looser, survived every test)."""
    import dataclasses

    L, R, n = 64, 32, 2048
    q = torch.zeros(1, 1, L + R)
    q[0, 0, L] = 1.0  # [1, 1, D] the score is k_pe channel 0 (σ = 1)
    kv = torch.zeros(n, L + R)
    kv[1:, :L] = 64.0  # [n, D] V = 64 but for token 0
    kv[1:, L] = torch.linspace(-16, -12, n - 1) * math.log(2)  # scores: p = 2^-16 .. 2^-12 (rounded to bf16)
    batch = make_decode_batch(q.bfloat16(), [kv.bfloat16()], sm_scale=1.0, kv_lora_rank=L, page_size=16,
                              generator=torch.Generator().manual_seed(0))
    ref = mla_decode_ref(batch)
    declared = dataclasses.replace(_fp32_numerics(batch), p_fmt="e4m3fn", p_scale=256.0)
    bound = kernel_bound(batch, declared, ref=ref)
    ratio = {}
    for p_scale in (1.0, 256.0):
        out, _ = _emulate(batch, "e4m3fn", p_scale)
        ratio[p_scale] = float(((out.double() - ref[0]).abs() / bound.out).max())
    assert ratio[256.0] <= 1.0 < ratio[1.0], ratio


def test_spread_equals_max_minus_min_over_each_rows_tokens():
    """_spread (a max over the shared prefix, running max after it) = max - min over each row's own prefix, for
    requests of different lengths and query lengths (MTP diagonal, q_len > seq_len) on one zero-padded grid."""
    g = torch.Generator().manual_seed(3)
    requests = ((0, 2), (1, 4), (7, 1), (300, 4), (64, 3), (9, 2), (2, 4))  # (seq_len, q_len)
    S, N = max(s for s, _ in requests), max(n for _, n in requests)
    x = torch.zeros(len(requests), S, 40, dtype=torch.float64)  # [B, S, C] zero padding beyond each length
    n_vis = torch.zeros(len(requests), N, dtype=torch.int64)  # [B, N] padding rows see nothing
    for b, (s, n) in enumerate(requests):
        x[b, :s] = torch.randn(s, 40, generator=g, dtype=torch.float64)
        n_vis[b, :n] = torch.tensor([max(0, s - n + r + 1) for r in range(n)])  # the causal diagonal
    got = _spread(x, n_vis)  # [B, N, C]
    for b in range(len(requests)):
        for r, k in enumerate(n_vis[b].tolist()):
            want = x[b, :k].amax(dim=0) - x[b, :k].amin(dim=0) if k else torch.zeros(40, dtype=torch.float64)
            assert torch.equal(got[b, r], want), (b, r, k)


# ---- (3) the bounds can fail ---------------------------------------------------------------------------------------


def test_kernel_bound_catches_planted_bugs():
    batch = _bf16_batch("gauss4")
    ref = mla_decode_ref(batch)
    bound = kernel_bound(batch, _fp32_numerics(batch, "bf16"), ref=ref)
    # a 5% softmax-scale error (cf. the missing mscale², 87%): scores move by 0.05·|s| >> ω_acc
    out, lse = _emulate(batch, "bf16", 1.0, sm_factor=1.05)
    rep, rep_lse = compare(out, ref[0], bound.out), compare(lse, ref[1], bound.lse, name="lse", out_dtype=torch.float32)
    print(f"\nplanted 5% sm_scale: err/B out {_report(rep)}, lse {_report(rep_lse)}")
    assert not rep.ok and not rep_lse.ok
    # MTP off-by-one: every row sees one token too many (rows that should be empty are not)
    out, lse = _emulate(batch, "bf16", 1.0, extra_tokens=1)
    assert compare(out, ref[0], bound.out).violations > 0
    assert not compare(lse, ref[1], bound.lse, out_dtype=torch.float32).nonfinite_mask_ok
    # P rounded to e4m3 while the numerics declare bf16: error ~ 2⁻⁴ Σp|v| vs a 2⁻⁷ budget
    out, _ = _emulate(batch, "e4m3fn", 1.0)
    assert compare(out, ref[0], bound.out).violations > 0


def test_kernel_bound_catches_a_newest_token_dropped_from_a_long_row():
    """A kernel that skips the newest token of a 2048-token request (a loop bound off by one past some length)
    errs by about p_last |v_last - o| ~ |v| / 2048: below the score term tanh(ω/4) R_c that the kernel bound had
    alone before (err/bound 0.94 there: passing), above the bound with §5(c)'s other form, (e^ω - 1) times
    min(Σ p|v|, the weighted deviation) (1.8; R_c of 2048 Gaussian tokens is ~7 sd)."""
    from verify.cases import Case
    from verify.kernels import DEFAULT_NUMERICS

    batch, _ = Case(seq_lens=(2048,), q_lens=(1,), heads=8, page_size=16, dist="gauss1", seed=3).materialize("cpu")
    ref = mla_decode_ref(batch)
    dropped = mla_decode_ref(batch.replace(seq_lens=batch.seq_lens - 1))[0].bfloat16()  # [1, 8, 512] as a kernel
    right = ref[0].float().bfloat16()  # [1, 8, 512] the oracle rounded once to the bf16 output
    bound = kernel_bound(batch, DEFAULT_NUMERICS, ref=ref).out
    assert compare(dropped, ref[0], bound).violations > 0
    assert compare(right, ref[0], bound).ok


def test_quantization_bounds_catch_a_wrong_scale():
    batch_q, batch_exact = _fp8_pair("gauss1")
    ref_exact = mla_decode_ref(batch_exact)
    qb = quantization_bounds(batch_q, batch_exact)
    # e4m3fn bytes read as e4m3fnuz halve every value (numerics.md §4): here the KV scale doubled instead
    out, lse = mla_decode_ref(batch_q.replace(kv_scale=batch_q.kv_scale * 2))
    post, post_lse = compare(out, ref_exact[0], qb.post_out), compare(lse, ref_exact[1], qb.post_lse)
    print(f"\nkv scale x2: err/B_post out {_report(post)}, lse {_report(post_lse)}")
    assert not post.ok and not post_lse.ok
    assert not compare(lse, ref_exact[1], qb.det_lse).ok
    # B_det is loose on out (§5.1: median 5–11x Σp|v|); a scale off by 4x still exceeds it
    out, _ = mla_decode_ref(batch_q.replace(kv_scale=batch_q.kv_scale * 4))
    det = compare(out, ref_exact[0], qb.det_out)
    print(f"kv scale x4: err/B_det out {_report(det)}")
    assert not det.ok


# ---- §5(g) split merge ---------------------------------------------------------------------------------------------


def _split_partials(batch, cuts):
    """fp64 partials (O_S [S, T, H, L], L_S [S, T, H]) of the token ranges between cuts, per row's visible prefix."""
    L, T, H = batch.kv_lora_rank, batch.num_tokens, batch.num_heads
    S = len(cuts) - 1
    outs = torch.zeros(S, T, H, L, dtype=torch.float64)
    lses = torch.full((S, T, H), -math.inf, dtype=torch.float64)
    q, visible, qo = batch.dequantized_q(), batch.visible_tokens(), batch.qo_indptr.tolist()
    for b in range(batch.batch_size):
        K = batch.request_kv(b)  # [s, D]
        for t in range(qo[b], qo[b + 1]):
            for i in range(S):
                lo, hi = cuts[i], min(cuts[i + 1], int(visible[t]))
                if hi <= lo:
                    continue
                s = batch.sm_scale * q[t] @ K[lo:hi].T  # [H, n]
                lses[i, t] = torch.logsumexp(s, dim=-1)
                outs[i, t] = torch.softmax(s, dim=-1) @ K[lo:hi, :L]
    return outs, lses


@pytest.mark.parametrize("num_splits", [2, 7, 33])
def test_merge_bound_holds_for_fp32_merge(num_splits):
    batch = _bf16_batch("gauss4", seq=(0, 150, 400), q_lens=(1, 2, 1))
    ref = mla_decode_ref(batch)
    g = torch.Generator().manual_seed(num_splits)
    inner = torch.randperm(399, generator=g)[: num_splits - 1].add(1).sort().values.tolist()
    outs, lses = _split_partials(batch, [0, *inner, 400])
    out, lse = merge_partials(outs.float(), lses.float())  # partials stored and merged in fp32
    bound = merge_bound(batch, num_splits)
    rep, rep_lse = compare(out, ref[0], bound.out, out_dtype=torch.float32), compare(lse, ref[1], bound.lse)
    print(f"\nmerge {num_splits} splits: err/B out {_report(rep)}, lse {_report(rep_lse)}")
    assert rep.ok and rep_lse.ok, rep.describe() + "\n" + rep_lse.describe()
    assert bool((merge_bound(batch, 1).out == 0).all())
    with pytest.raises(ValueError, match="num_splits"):
        merge_bound(batch, 0)


def test_the_merge_bound_covers_its_weights_stated_errors_all_moving_one_way():
    """§5(g)'s derivation, step by step: each partial LSE may be 16 u Λ high and the merged L 16 u Λ low (log and base
    conversion), L_S - L rounds 2 u Λ high and exp adds ε_exp = 4u, so every weight may be exp(34 u Λ)(1 + 4u) times
    its exact value, and out (values of one sign) moves by that factor - 1. The out bound must cover that move; with
    its weight error summed as 17 u Λ (a review's mutant) it covers about half."""
    g = torch.Generator().manual_seed(8)
    L, D, n = 512, 576, 40
    q = torch.rand(1, 1, D, generator=g, dtype=torch.float64)  # [T, H, D] positive: scores near 20, Λ near 24
    kv = torch.rand(n, D, generator=g, dtype=torch.float64)  # [n, D] positive values: Σ p |v| = |out|
    batch = make_decode_batch(q, [kv], q_lens=[1], sm_scale=SIGMA, kv_lora_rank=L, page_size=16, generator=g)
    q64, K = batch.dequantized_q(F64)[0, 0], batch.request_kv(0, F64)  # [D], [n, D]
    s = SIGMA * K @ q64  # [n] scores
    lam = s.abs().max() + math.log(n)  # Λ >= |L_S|, |L|
    u = U32  # fp32 merge
    halves = [slice(0, n // 2), slice(n // 2, n)]
    lse_s = torch.stack([torch.logsumexp(s[h], 0) for h in halves])  # [2] exact partial LSEs
    o_s = torch.stack([torch.softmax(s[h], 0) @ K[h, :L] for h in halves])  # [2, L] exact partial outputs
    lse = torch.logsumexp(s, 0)  # [] exact merged LSE
    out = torch.exp(lse_s - lse) @ o_s  # [L]
    weights = torch.exp(lse_s + 16 * u * lam - (lse - 16 * u * lam) + 2 * u * lam) * (1 + 4 * u)  # [2] all high
    moved = weights @ o_s  # [L]
    bound = merge_bound(batch, 2).out[0, 0]  # [L]
    assert bool(((moved - out).abs() <= bound).all()), float(((moved - out).abs() / bound).max())


def test_split_emulation_within_kernel_plus_merge_bound():
    batch = _bf16_batch("gauss1", seq=(0, 700, 90, 1), q_lens=(1, 2, 1, 3))
    plan = plan_decode(batch.seq_lens, batch.q_lens, batch.num_heads, num_workers=8, block_n=64)
    splits = int((plan.work_items[:, PARTIAL_ROW] >= 0).sum())
    assert splits > 1  # the plan does split
    ref = mla_decode_ref(batch)
    out, lse = run_plan_reference(batch, plan, torch.float32)
    bound = kernel_bound(batch, _fp32_numerics(batch, out_dtype=torch.float32), ref=ref) + merge_bound(batch, splits)
    rep, rep_lse = compare(out, ref[0], bound.out, out_dtype=torch.float32), compare(lse, ref[1], bound.lse)
    print(f"\nplanned split fp32: err/B out {_report(rep)}, lse {_report(rep_lse)}")
    assert rep.ok and rep_lse.ok, rep.describe() + "\n" + rep_lse.describe()


def test_split_bound_holds_across_plans_and_catches_a_wrong_scale():
    """Two plans (1 and 8 workers) of the fp32 emulation differ within split_bound; a run with σ off by 1% does not
    (split_bound keeps no score term: both runs must compute the same scores)."""
    batch = _bf16_batch("gauss4", seq=(0, 700, 90, 1), q_lens=(1, 2, 1, 3))
    numerics = _fp32_numerics(batch, out_dtype=torch.float32)
    runs = {}
    for workers in (1, 8):
        plan = plan_decode(batch.seq_lens, batch.q_lens, batch.num_heads, num_workers=workers, block_n=64)
        runs[workers] = run_plan_reference(batch, plan, torch.float32)
    splits = int(plan.stats()["pieces_per_tile"]["max"])
    assert splits > 1
    bound = split_bound(batch, numerics, splits)
    rep = compare(runs[8][0], runs[1][0], bound.out, out_dtype=torch.float32)
    rep_lse = compare(runs[8][1], runs[1][1], bound.lse)
    print(f"\nsplit 1 vs 8 workers: err/B out {_report(rep)}, lse {_report(rep_lse)}")
    assert rep.ok and rep_lse.ok, rep.describe() + "\n" + rep_lse.describe()
    wrong = run_plan_reference(batch.replace(sm_scale=batch.sm_scale * 1.01), plan, torch.float32)
    assert not compare(wrong[0], runs[1][0], bound.out, out_dtype=torch.float32).ok
    with pytest.raises(ValueError, match="p_scale"):
        split_bound(batch, _fp32_numerics(batch, p_scale=0.0), splits)


def _skewed_scores(batch, direction: float, gamma: float):
    """The decode in fp64 with every score moved by direction x gamma x σ Σ|q||k| (the most a kernel declaring
    gamma_qk = gamma may err by), its sign alternating over the tokens: a kernel whose score error depends on the
    plan (``direction`` +1 under one, -1 under another). -> (out [T, H, L], lse [T, H]) fp64."""
    L, T, H = batch.kv_lora_rank, batch.num_tokens, batch.num_heads
    q = batch.dequantized_q()  # [T, H, D]
    visible = batch.visible_tokens()  # [T]
    out, lse = torch.zeros(T, H, L, dtype=torch.float64), torch.full((T, H), -math.inf, dtype=torch.float64)
    qo = batch.qo_indptr.tolist()
    for b in range(batch.batch_size):
        rows = slice(qo[b], qo[b + 1])
        K = batch.request_kv(b)  # [s, D] fp64
        sign = 1.0 - 2.0 * (torch.arange(K.shape[0]) % 2)  # [s] +1, -1, ...
        skew = direction * gamma * batch.sm_scale * torch.einsum("nhd,sd->nhs", q[rows].abs(), K.abs()) * sign
        mask = torch.arange(K.shape[0])[None, :] < visible[rows, None]  # [n, s]
        s = (batch.sm_scale * torch.einsum("nhd,sd->nhs", q[rows], K) + skew).masked_fill(~mask[:, None, :], -math.inf)
        lse[rows] = torch.logsumexp(s, dim=-1)  # [n, H]
        p = torch.exp(s - torch.where(torch.isfinite(lse[rows]), lse[rows], 0.0)[..., None])  # [n, H, s]
        out[rows] = torch.einsum("nhs,sc->nhc", p, K[:, :L])
    return out, lse


def test_scores_that_vary_with_the_plan_are_declared_not_charged_by_default():
    """A kernel whose scores err by its declared gamma_qk one way under one plan and the other way under another
    passes tier 1 under both, fails split_bound as declared by default (plan-invariant scores: their errors
    shared by the two runs), and passes it once it declares plan_invariant_scores=False (each run charged its
    own score errors)."""
    batch = _bf16_batch("gauss1", seq=(0, 700, 90, 1), q_lens=(1, 2, 1, 3))
    gamma = 2.0**-10
    numerics = dataclasses.replace(_fp32_numerics(batch, out_dtype=torch.float32), gamma_qk=gamma)
    ref = mla_decode_ref(batch)
    a, b = _skewed_scores(batch, 1.0, gamma), _skewed_scores(batch, -1.0, gamma)
    tier1 = kernel_bound(batch, numerics, ref=ref)
    for run in (a, b):
        assert compare(run[0], ref[0], tier1.out, out_dtype=torch.float32).ok
        assert compare(run[1], ref[1], tier1.lse).ok
    shared = split_bound(batch, numerics, 4)
    worst = compare(a[0], b[0], shared.out, out_dtype=torch.float32).err_over_bound_max
    own = split_bound(batch, dataclasses.replace(numerics, plan_invariant_scores=False), 4)
    rep = compare(a[0], b[0], own.out, out_dtype=torch.float32)
    print(f"\nscores skewed by ±gamma_qk: split.out err/bound {worst:.3g} (shared scores), {_report(rep)} (own)")
    assert worst > 1, worst
    assert rep.ok and compare(a[1], b[1], own.lse).ok
    with pytest.raises(ValueError, match="plan_invariant_scores must be a bool"):
        dataclasses.replace(numerics, plan_invariant_scores=0)


# ---- §5(e) statistics -----------------------------------------------------------------------------------------------


def test_rms_estimate_is_a_statistic_not_an_oracle():
    """Random data: each rounding error is uniform on ±spacing/2 with spacing/2 in (u|x|/2, u|x|], i.e. variance
    in [u²x²/12, u²x²/3]; the model charges e²/3 with e = u|x| (+η s), so predicted / measured RMS lies in
    [1, 2] up to sampling noise. Coherent rounding breaks independence and the estimate falls below the error."""
    ratios = {}
    for case in ("gauss1", "coherent"):
        batch_q, batch_exact = _fp8_pair(case)
        err = mla_decode_ref(batch_q)[0] - mla_decode_ref(batch_exact)[0]  # [T, H, L]
        rms = rms_estimate(batch_q, batch_exact)  # [T, H, L]
        assert rms.shape == err.shape
        ratios[case] = float(rms.square().mean().sqrt() / err.square().mean().sqrt())
        pb = prob_bound(batch_q, batch_exact)
        assert pb.out.shape == err.shape and pb.lse.shape == batch_q.q.shape[:2]
    print(f"\nRMS predicted / measured: {ratios}")
    assert 1.0 <= ratios["gauss1"] <= 2.0
    assert ratios["coherent"] < 1.0


@pytest.mark.parametrize("alpha", [0.0, 1.0, float("nan"), "0.001", None, True])
def test_prob_bound_names_a_bad_failure_probability(alpha):
    """alpha must be a number in (0, 1): a string or None raised TypeError from the comparison (found by a review),
    and True passed as 1 would have meant a certain failure."""
    batch_q, batch_exact = _fp8_pair("gauss1")
    with pytest.raises(ValueError, match="alpha: expected a failure probability in"):
        prob_bound(batch_q, batch_exact, alpha=alpha)


def test_bucketed_bounds_equal_one_grid(monkeypatch):
    """Requests of very different lengths go in length buckets (DecodeBatch.buckets); every bound equals its
    one-grid evaluation (waste = inf: the whole batch on one padded grid) up to fp64 summation order. The long
    request's q is tiny (inexact in an fp16 operand), the others' are exact in fp16: the q operand's rounding is
    batch-wide, so the buckets without the long request must still be charged for it."""
    seq, q_lens = (300, 5, 0, 40, 1), (1, 2, 1, 3, 2)
    batch_q, batch_exact = _fp8_pair("gauss1", seq=seq, q_lens=q_lens, H=2)
    q = batch_exact.q.clone()  # [T, H, D] fp32
    q[0] *= 2.0**-20  # request 0's single row: fp16-subnormal, inexact in an fp16 operand
    batch_b = batch_exact.replace(q=q.bfloat16(), kv_cache=batch_exact.kv_cache.bfloat16())  # bf16 inputs
    assert len(batch_q.buckets()) >= 3
    numerics = _fp32_numerics(batch_b)
    fp16 = KernelNumerics(**{**numerics.__dict__, "qk_operand": torch.float16, "pv_operand": torch.float16})

    def everything():
        ref = mla_decode_ref(batch_b)
        qb = quantization_bounds(batch_q, batch_exact)
        return dict(
            kernel=kernel_bound(batch_b, fp16, ref=ref), split=split_bound(batch_b, fp16, 4),
            merge=merge_bound(batch_q, 3), det_out=qb.det_out, det_lse=qb.det_lse, sat=torch.tensor(qb.saturated),
            prob=prob_bound(batch_q, batch_exact), rms=rms_estimate(batch_q, batch_exact),
        )

    # _deviation cancels (Σ p v² - m²): its fp64 value moves with the grid by up to the root of its slack, not by
    # summation order alone; its soundness on every grid is test_deviation_bounds_the_mean_absolute_deviation's
    monkeypatch.setattr(bounds, "_deviation", lambda st, V: torch.full(st.p.shape[:3] + V.shape[-1:], math.inf,
                                                                       dtype=F64))
    bucketed = everything()
    one_grid = DecodeBatch.buckets
    monkeypatch.setattr(DecodeBatch, "buckets", lambda self, waste=math.inf: one_grid(self, waste))
    assert len(batch_q.buckets()) == 1
    whole = everything()
    # the bounds are sums of non-negative fp64 terms, here only summed in another order (other grid shapes, other
    # matmul blocking): n such terms move by at most (n - 1) fp64 units relative; the longest sums run over the
    # D = 576 channels and the 300 tokens of the long request, chained with a few more operations
    rel = (576 + 300 + 16) * 2**-53
    for name, x in bucketed.items():
        pairs = [(x.out, whole[name].out), (x.lse, whole[name].lse)] if hasattr(x, "out") else [(x, whole[name])]
        for a, b in pairs:
            assert (a - b).abs().max() <= rel * b.abs().max(), name
            assert (a >= b * (1 - rel)).all(), name  # never smaller than the one-grid bound


def _rows(n_tokens: int, H: int, L: int, g: torch.Generator, pad: int = 0):
    """Softmax statistics of one request whose rows see n_tokens, 1 and 0 tokens (peaky, uniform and wide score
    rows across H heads), on a grid of n_tokens + pad tokens; and V [1, S, L] whose channels are centred Gaussian,
    constant (1), a large offset (1000) with spread 1e-6 (2: where Σ p v² - m² cancels) and Gaussian about 5 (3)."""
    S = n_tokens + pad
    n_vis = torch.tensor([[n_tokens, 1, 0]])  # [1, 3]
    scores = torch.randn(1, 3, H, S, generator=g, dtype=F64) * torch.tensor([0.1, 3.0, 30.0, 300.0])[:H, None]
    mask = torch.arange(S)[None, None, :] < n_vis[..., None]  # [1, 3, S]
    e = torch.exp(scores - scores.amax(-1, keepdim=True)).masked_fill(~mask[:, :, None, :], 0.0)  # [1, 3, H, S]
    l = e.sum(-1, keepdim=True)
    p = torch.where(l > 0, e / l.clamp(min=1e-300), 0.0)  # [1, 3, H, S]
    st = _Softmax(scores, p, scores.new_zeros(1, 3, H), l[..., 0], mask.any(-1), n_vis)
    V = torch.randn(1, S, L, generator=g, dtype=F64)  # [1, S, L]
    V[..., 1] = 0.75
    V[..., 2] = 1000 + 1e-6 * V[..., 2]
    V[..., 3] += 5
    V[:, n_tokens:] = 0.0  # zero padding, as DecodeBatch.padded_kv
    return st, V, mask


def _range(V: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R [1, 3, L]: max - min of each channel over each row's visible tokens (0 for an empty row), directly."""
    hi = torch.where(mask[..., None], V[:, None], -math.inf).amax(-2)  # [1, 3, L]
    lo = torch.where(mask[..., None], V[:, None], math.inf).amin(-2)
    return torch.where(mask.any(-1)[..., None], hi - lo, 0.0)


@pytest.mark.parametrize("n_tokens", [2, 7, 1024])
def test_deviation_bounds_the_mean_absolute_deviation(n_tokens):
    """_deviation >= Σ_j p_j |v_jc - m_c| evaluated directly (a sum of non-negative fp64 terms) on every channel and
    row, including the cancelling offset channel, and on a zero-padded grid too."""
    g = torch.Generator().manual_seed(n_tokens)
    for pad in (0, 37):
        st, V, _ = _rows(n_tokens, 4, 8, g, pad)
        m = torch.einsum("bnhs,bsc->bnhc", st.p, V)  # [1, 3, H, L]
        mad = (st.p[..., None] * (V[:, None, None] - m[..., None, :]).abs()).sum(-2)  # [1, 3, H, L] direct
        dev = _deviation(st, V)  # [1, 3, H, L]
        assert (dev >= mad).all(), (pad, (mad - dev).max())
        assert (dev[:, 2] == 0).all()  # a row that sees nothing
        slack = 4 * (1 + 4) * 2**-53  # one token: no spread, the root of its fp64 slack only
        fp64_roundings = (1 + 2**-53) ** 4  # the product slack·v², the sum, the sqrt and the (1 + slack) factor
        assert (dev[0, 1] <= math.sqrt(slack) * V[0, 0].abs() * (1 + slack) * fp64_roundings).all()


def test_hull_term_holds_for_the_worst_score_perturbations_and_tightens_long_rows():
    """|Σ_j (softmax(s + δ)_j - p_j) v_jc| <= _hull_term(ω, R, Σ p|v|, dev) for perturbations of spread ω: δ_j = ±ω/2
    split at every threshold of v_jc (the extremes of the linear-fractional objective). On a row of 1024 Gaussian
    tokens the mean-centred form is below the tanh(ω/4) R_c form (numerics.md §5(c)), and on a peaky row far below."""
    g = torch.Generator().manual_seed(5)
    L = 6
    for n_tokens in (2, 7, 1024):
        st, V, mask = _rows(n_tokens, 4, L, g)
        R = _range(V, mask)  # [1, 3, L]
        pv = torch.einsum("bnhs,bsc->bnhc", st.p, V.abs())
        dev = _deviation(st, V)
        for omega in (1e-4, 0.3, 3.0):
            w = torch.full(st.p.shape[:3], omega, dtype=F64)  # [1, 3, H]
            bound = _hull_term(w, R, pv, dev)  # [1, 3, H, L]
            centred = V - V[:, :1]  # [1, S, L] Σ_j (p'_j - p_j) v_j = Σ_j (p'_j - p_j)(v_j - v_0), exact (Sterbenz)
            o = torch.einsum("bnhs,bsc->bnhc", st.p, centred)
            worst = torch.zeros_like(o)
            for c in range(L):
                for t in torch.unique(V[0, :n_tokens, c]).tolist()[:: max(1, n_tokens // 64)]:
                    for sign in (1.0, -1.0):
                        delta = torch.where(V[0, :, c] >= t, sign * omega / 2, -sign * omega / 2)  # [S]
                        s = st.s + delta
                        e = torch.exp(s - s.amax(-1, keepdim=True)).masked_fill(~mask[:, :, None, :], 0.0)
                        p2 = e / e.sum(-1, keepdim=True).clamp(min=1e-300)
                        worst[..., c] = torch.maximum(worst[..., c], (torch.einsum("bnhs,bs->bnh", p2,
                                                                                   centred[..., c]) - o[..., c]).abs())
            # fp64 on both sides: sums over <= 1024 tokens err by < 1024 u64 = 2^-43 relative, so 2^-30 of the bound
            # and 2^-40 of each channel's largest centred value cover the evaluation (and the exp of the scores)
            noise = 2.0**-40 * centred.abs().amax(dim=1)[:, None, None, :]  # [1, 1, 1, L]
            assert (worst <= bound * (1 + 2.0**-30) + noise).all(), (n_tokens, omega)
    st, V, mask = _rows(1024, 4, 8, g)
    R, pv, dev = _range(V, mask), torch.einsum("bnhs,bsc->bnhc", st.p, V.abs()), _deviation(st, V)
    w = torch.full(st.p.shape[:3], 1e-3, dtype=F64)
    old = torch.tanh(w / 4)[..., None] * R[:, :, None, :]  # [1, 3, H, L] the R_c form alone
    ratio = (_hull_term(w, R, pv, dev) / old)[0, 0, :, 0]  # the Gaussian channel of the 1024-token row, per head
    assert ratio[0] < 0.7 and ratio[3] < 0.01, ratio  # near-uniform row: ~0.6 (sd / (R/4)); peaky row: ~0
    uncentred = _hull_term(w, R, pv)[0, 0, 0, 3]  # the channel about 5, near-uniform row: Σ p|v| ~ 5
    assert _hull_term(w, R, pv, dev)[0, 0, 0, 3] < 0.7 * min(uncentred, old[0, 0, 0, 3])


def _two_tokens(p1: float, v1: float):
    """One row seeing two tokens with weights (1 - p1, p1), values (0, v1) on one channel: (st, V, mask)."""
    s = torch.tensor([0.0, math.log(p1 / (1 - p1))], dtype=F64).view(1, 1, 1, 2)  # [1, 1, 1, 2]
    p = torch.tensor([1 - p1, p1], dtype=F64).view(1, 1, 1, 2)
    n_vis, mask = torch.tensor([[2]]), torch.ones(1, 1, 2, dtype=torch.bool)
    st = _Softmax(s, p, torch.zeros(1, 1, 1, dtype=F64), torch.ones(1, 1, 1, dtype=F64), mask.any(-1), n_vis)
    return st, torch.tensor([0.0, v1], dtype=F64).view(1, 2, 1), mask


def test_hull_term_is_tight_on_a_peaky_row_and_needs_its_weight():
    """p = (1 - 1e-6, 1e-6), v = (0, 1): raising the rare token's score by ω moves the output by p1 (e^ω - 1) to
    first order, which the (e^ω - 1) Σ p|v| form meets (ω = 3: 1.9e-5; a term of ω alone, 3e-6, would not hold).
    Shared scores (split_bound): weights p* = softmax(s + δ1) with spread ω_qk = 3, then an own perturbation
    ω_own = 0.1: the move is p*_1 (e^0.1 - 1) ~ 2.1e-6, held only with the weight e^ω_qk on the p of pv and dev."""
    st, V, mask = _two_tokens(1e-6, 1.0)
    R = _range(V, mask)
    pv, dev = torch.einsum("bnhs,bsc->bnhc", st.p, V.abs()), _deviation(st, V)

    def moved(p, delta):  # |Σ_j (softmax(log p + δ)_j - p_j) v_j| on the row
        e = p * torch.exp(torch.tensor([0.0, delta], dtype=F64))
        return float(((e / e.sum() - p) * V[0, :, 0]).sum().abs())

    p = st.p[0, 0, 0]
    actual = moved(p, 3.0)
    bound = float(_hull_term(torch.full((1, 1, 1), 3.0, dtype=F64), R, pv, dev))
    assert actual <= bound < 1.01 * actual and actual > 6 * 1e-6 * 3  # tight, and above ω p1
    e = p * torch.exp(torch.tensor([0.0, 3.0], dtype=F64))
    p_star = e / e.sum()  # [2] the shared scores' weights
    actual = moved(p_star, 0.1)
    w_own = torch.full((1, 1, 1), 0.1, dtype=F64)
    weighted = float(_hull_term(w_own, R, pv, dev, torch.exp(torch.tensor(3.0, dtype=F64))))
    assert actual <= weighted < 1.01 * actual
    assert float(_hull_term(w_own, R, pv, dev)) < actual / 10  # without the weight: far below the move


def test_deviation_covers_products_that_underflow():
    """p = (1, 1e-250), v = (0, 1e-40): p v² (1e-330) underflows to 0 in fp64 and the computed variance is 0, while
    the true deviation is ~1e-165; the absolute (n + 4) 2^-1074 under the root keeps dev above it (a review's
    counterexample to a purely relative slack)."""
    st, V, _ = _two_tokens(1e-250, 1e-40)
    true_sd = math.sqrt(1e-250 * (1 - 1e-250)) * 1e-40
    assert float(_deviation(st, V)) >= true_sd


def test_operand_overflow_flag_for_fp8_operands(monkeypatch):
    """The finite flag of an fp8 operand (FlashMLA's fp8 MMAs): 448 fits e4m3fn, 449 and 1000 do not. Not from a
    torch cast (this CPU build saturates 1000 to 448, CUDA gives NaN) nor from torch.isfinite on an fp8 tensor, which
    CUDA torch (2.11) does not implement: emulated here by an isfinite that refuses fp8 as it does."""
    from verify.bounds import _operand_error

    real_isfinite = torch.isfinite

    def cuda_like_isfinite(x):
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2):
            raise NotImplementedError(f'"isfinite" not implemented for {x.dtype}')
        return real_isfinite(x)

    monkeypatch.setattr(torch, "isfinite", cuda_like_isfinite)
    for top, ok in ((448.0, True), (449.0, False), (1000.0, False)):
        fed = torch.tensor([[0.5, -top], [1.0, 2.0]], dtype=torch.float64)  # [2, 2]
        assert bool(_operand_error(fed, torch.float8_e4m3fn)[2]) is ok, top


@pytest.mark.parametrize("where", ["kv_cache", "q"])
def test_kernel_bound_refuses_values_that_overflow_the_kernels_operand(where):
    """A cache (or q) value beyond the operand dtype's range is no rounding the bound can charge: kernel_bound names
    the input and the operand (fp16's max is 65504) instead of returning an inf bound that any output would meet."""
    from verify.cases import Case
    from verify.kernels import DEFAULT_NUMERICS

    batch = Case(seq_lens=(5, 3), q_lens=(1, 2), heads=2).materialize()[0]
    big = getattr(batch, where).clone()
    big.view(-1)[7] = 2.0**20  # beyond fp16's 65504, exact in bf16
    numerics = dataclasses.replace(DEFAULT_NUMERICS, qk_operand=torch.float16, pv_operand=torch.float16)
    message = rf"{where}: values up to 1.049e\+06 overflow the kernel's torch.float16 operand"
    with pytest.raises(ValueError, match=message):
        kernel_bound(batch.replace(**{where: big}), numerics)
    kernel_bound(batch, numerics)  # in range: no error


def test_an_fp32_output_below_the_normal_range_is_charged_its_absolute_rounding():
    """An fp32 `out` correctly rounded from the exact answer passes when that answer is an fp32 subnormal: the bound
    adds half fp32's least subnormal, 2^-150, on rows that see a token. It had been added through torch.where of two
    Python floats, which gives an fp32 tensor, where 2^-150 is 0: a correct kernel failed at 2.4x its bound (found by
    a review). Values: multiples of 2^-133 (bf16 subnormals), every score 0, so out is their mean."""
    from verify.checks import _tier1_bound, check_tier1
    from verify.kernels import DEFAULT_NUMERICS, from_callable

    g = torch.Generator().manual_seed(0)
    kv = torch.zeros(3, 576)  # [3, D]
    kv[:, :512] = torch.randint(1, 5, (3, 512), generator=g).float() * 2.0**-133  # [3, L]
    batch = make_decode_batch(torch.zeros(1, 1, 576, dtype=torch.bfloat16), [kv.to(torch.bfloat16)],
                              sm_scale=0.1352338, kv_lora_rank=512, page_size=64, generator=g)
    ref = mla_decode_ref(batch)  # [1, 1, L], [1, 1] fp64
    numerics = dataclasses.replace(DEFAULT_NUMERICS, out_dtype=torch.float32)

    def decode(b):
        return ref[0].float(), ref[1].float()  # the exact answer, correctly rounded: a perfect fp32 kernel

    decode.numerics = numerics
    kernel = from_callable(decode, "exact_fp32")
    assert ref[0].abs().max() < torch.finfo(torch.float32).tiny  # the answer is subnormal in fp32
    assert (ref[0].float().double() != ref[0]).any()  # and its rounding moved it
    out_check = check_tier1(ref[0].float().double(), ref[1].float().double(), ref,
                            _tier1_bound(batch, kernel, numerics, ref), numerics.out_dtype)[0]
    assert out_check.name == "tier1.out" and out_check.ok, out_check.detail


def test_the_merge_bound_charges_the_normaliser_sum_of_many_splits():
    """An fp32 kernel that cuts a 4096-token row into one-token splits (each exact: p = 1, O = v) and merges them in
    order in fp32 (M = max, l = Σ exp(L_S - M) added one by one, out = Σ exp(L_S - L) O_S) passes tier 1 under its
    honest declaration. The normaliser sum's (S - 1) u scales every weight alike; merge_bound had charged S u for
    the weighted sum alone, and this kernel measured 1.35x its bound there (found by a review)."""
    from verify.checks import _tier1_bound, check_tier1
    from verify.kernels import from_callable

    S = 4096
    g = torch.Generator().manual_seed(1)
    kv = torch.zeros(S, 576)  # [S, D]
    kv[:, :512] = 0.5 + 0.5 * torch.rand(512, generator=g)  # one value row for every token
    kv[:, 512], kv[0, 512] = -10.6875, 0.85546875  # the scores (σ = 1, q = e_512): one token dominates
    q = torch.zeros(1, 1, 576)  # [T, H, D]
    q[0, 0, 512] = 1.0
    batch = make_decode_batch(q.to(torch.bfloat16), [kv.to(torch.bfloat16)], sm_scale=1.0, kv_lora_rank=512,
                              page_size=64, generator=g)

    def decode(b):
        k = b.request_kv(0).float()  # [S, D]
        lse_s = (b.q[0, 0].float() @ k.T) * b.sm_scale  # [S] fp32 scores: each split's lse (one token, exact)
        m = lse_s.max()
        total = torch.zeros((), dtype=torch.float32)
        for x in torch.exp(lse_s - m):  # in order, one fp32 rounding per add
            total = total + x
        lse = m + torch.log(total)  # []
        out = torch.zeros(512, dtype=torch.float32)
        for w, v in zip(torch.exp(lse_s - lse), k[:, :512]):
            out = out + w * v
        return out[None, None], lse[None, None]  # [1, 1, L], [1, 1]

    decode.numerics = KernelNumerics(p_fmt=None, p_scale=1.0, qk_operand=torch.float32, pv_operand=torch.float32,
                                     gamma_qk=577 * 2**-23, gamma_pv=4 * 2**-23, out_dtype=torch.float32)
    decode.max_splits = S
    kernel = from_callable(decode, "one_token_splits")
    out, lse = decode(batch)
    ref = mla_decode_ref(batch)  # [1, 1, L], [1, 1] fp64
    results = check_tier1(out.double(), lse.double(), ref, _tier1_bound(batch, kernel, decode.numerics, ref),
                          torch.float32)
    assert all(r.ok for r in results), [r.detail for r in results]
    assert results[0].err_over_bound > 0.3  # not a vacuous bound: the merge's error is most of it


def test_unit_roundoffs_and_half_min_subnormals_match_numpy_and_ml_dtypes():
    """The constants every bound is built from, against numpy's and ml_dtypes' format tables (a source-mutation review
    found a doubled fp32 unit roundoff and a doubled η slipping every other test)."""
    import ml_dtypes
    import numpy as np

    assert bounds.U32 == np.finfo(np.float32).eps / 2 and bounds.U64 == np.finfo(np.float64).eps / 2
    for dtype, table in ((torch.float16, np.finfo(np.float16)), (torch.bfloat16, ml_dtypes.finfo(ml_dtypes.bfloat16)),
                         (torch.float32, np.finfo(np.float32)), (None, np.finfo(np.float32))):
        assert bounds._half_min_subnormal(dtype) == float(table.smallest_subnormal) / 2, dtype


def test_masked_max_takes_the_visible_maximum_and_zero_for_rows_that_see_nothing():
    """`_masked_max` of scores that are all negative is their maximum, not the 0 a wrong fill value gives (the
    activation spread ω of the quantization bound rests on it; a review's mutant filling 0 widened it 1.24x)."""
    x = torch.tensor([-3.0, -1.0, -7.0], dtype=torch.float64).view(1, 1, 1, 3).expand(1, 2, 1, 3)  # [B, N, H, S]
    mask = torch.tensor([[[True, True, False], [False, False, False]]])  # [B, N, S]
    assert bounds._masked_max(x, mask).tolist() == [[[-1.0], [0.0]]]


@pytest.mark.parametrize("name", ["e4m3fn", "e4m3fnuz", "e5m2"])
def test_element_error_covers_saturation_and_counts_exactly_what_overflows(name):
    """`_element_error` on fp8 storage, on values up to twice the format's max at two static scales: its e covers
    the saturating quantizer's actual error, and its saturated count is the number of elements that ml_dtypes'
    non-saturating cast sends to NaN or inf (everything past max plus half the spacing at max: 464 for e4m3fn).
    A review's mutant that put that threshold a whole spacing past max counted too few and gave e below the error."""
    import ml_dtypes
    import numpy as np

    f = fp8_format(name)
    np_type = getattr(ml_dtypes, f"float8_{name}")
    g = torch.Generator().manual_seed(9)
    x = f.max * 2 * torch.rand(4096, generator=g, dtype=torch.float64)  # [4096] in [0, 2 max), no exact ties drawn
    x = torch.cat([x, -x])  # [8192]
    for scale in (1.0, 0.5):
        q, s = quantize(x, name, scale=scale)  # saturating
        actual = (q.double() * s.double() - x).abs()  # [8192]
        e, saturated = bounds._element_error(x, f.torch_dtype, torch.float64, float(s))
        assert (actual <= e).all(), float((actual - e).max())
        overflows = ~np.isfinite((x / float(s)).numpy().astype(np_type).astype(np.float64))  # torch's casts differ
        assert int(saturated) == int(overflows.sum()) > 0, (int(saturated), int(overflows.sum()))


@pytest.mark.parametrize("omega", [0.5, 2.0])
def test_the_hull_term_is_attained_by_two_groups_of_tokens(omega):
    """§5(b): the total variation between softmaxes whose scores differ by a spread of at most ω is at most tanh(ω/4),
    attained by two groups with masses 1 / (1 + e^(ω/2)) and the rest, the first group's scores raised by ω. With
    values 1 and 0 (R = 1) the output moves by exactly tanh(ω/4), so `_hull_term` must equal that move: a looser
    term (a review's tanh(ω/2) slipped every test) shows as a ratio below 1."""
    p1 = 1 / (1 + math.exp(omega / 2))
    p = torch.tensor([p1, 1 - p1], dtype=torch.float64)  # [S] the exact weights
    moved = torch.softmax(p.log() + torch.tensor([omega, 0.0], dtype=torch.float64), 0)  # [S] spread ω
    v = torch.tensor([[1.0], [0.0]], dtype=torch.float64)  # [S, L] R = 1
    move = float((moved - p) @ v[:, 0])
    assert move == pytest.approx(math.tanh(omega / 4), rel=1e-12)  # the construction attains §5(b)'s bound
    st = _Softmax(s=None, p=p.view(1, 1, 1, 2), m=None, l=None, seen=torch.tensor([[True]]), n_vis=torch.tensor([[2]]))
    pv = (p.view(1, 1, 1, 2) @ v.abs()[None, None]).view(1, 1, 1, 1)  # [B, N, H, L]
    term = float(_hull_term(torch.tensor([[[omega]]], dtype=torch.float64), torch.ones(1, 1, 1, dtype=torch.float64),
                            pv, _deviation(st, v[None])))
    assert move / term == pytest.approx(1, rel=1e-12), (move, term)  # equal up to fp64 rounding of both sides


@pytest.mark.parametrize("delta", [1e-3, 0.25])
def test_the_lse_score_term_is_attained_by_a_uniform_shift(delta):
    """§5(f)'s lse: score errors of at most δ = ω / 2 each move lse by at most δ, attained when every score of the
    row moves by +δ (lse(s + δ) = lse(s) + δ). With score_abs = δ the only error source (every other unit 0), the
    lse bound must equal that move: ω (a review's mutant) slipped every test as a bound twice the attainable."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64)  # [B, N, H, D]
    K = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)  # [B, S, D]
    st = bounds._softmax(q, K, torch.ones(1, 1, 5, dtype=torch.bool), 0.3)
    V = K[..., :4]  # [B, S, L]
    o = torch.einsum("bnhs,bsc->bnhc", st.p, V)  # [B, N, H, L]
    s = st.s[0, 0, 0]  # [S]
    move = float(torch.logsumexp(s + delta, 0) - torch.logsumexp(s, 0))
    assert move == pytest.approx(delta, rel=1e-12)  # the construction attains it
    _, lse_bound = bounds._rounding_bound(st, st.s.abs().amax(-1), V, o, u_out=0.0, u_p=0.0, eta_p=0.0,
                                          gamma_qk=0.0, gamma_pv=0.0, exp_rel=0.0, u_arith=0.0, score_abs=delta)
    assert float(lse_bound) / move == pytest.approx(1, rel=1e-12)  # equal up to fp64 rounding of both sides


def _one_signed_row(seed):
    """One row of 5 tokens whose values are all positive (Σ_j p_j |v_j| = |ô|): (softmax stats, V [B, S, L], ô
    [B, N, H, L], the kernel's unnormalised numerator Σ_j p̃_j v_j [B, N, H, L] and row sum l [B, N, H])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64)  # [B, N, H, D]
    K = torch.rand(1, 5, 8, generator=g, dtype=torch.float64) + 0.5  # [B, S, D] positive: Σ p |v| = |ô|
    st = bounds._softmax(q, K, torch.ones(1, 1, 5, dtype=torch.bool), 0.3)
    V = K[..., :4]  # [B, S, L]
    o = torch.einsum("bnhs,bsc->bnhc", st.p, V)  # [B, N, H, L]
    numerator, l = (st.p * st.l[..., None]) @ V[:, None], st.l  # [B, N, H, L], [B, N, H] the kernel's, unnormalised
    return st, V, o, numerator, l


@pytest.mark.parametrize("gamma", [0.1, 2.0**-7])  # a move of 2 gamma |ô| >= 0.015 |ô|: fp64's roundings stay < 1e-14
def test_the_out_bound_is_attained_by_a_high_numerator_over_a_low_row_sum(gamma):
    """§5(f) with gamma_pv the only error source: a kernel may sum P.V gamma_pv high (|ΔN| <= gamma_pv Σ P |v|) and
    the row sum l gamma_pv low, so with values of one sign o = ô (1 + gamma_pv) / (1 - gamma_pv), a move of
    2 gamma_pv / (1 - gamma_pv) |ô|: the out bound must equal it. A leading 1 + gamma_pv fell short by gamma_pv^2 (1 %
    at gamma_pv 0.1); without the row sum's gamma_pv |ô| (a review's mutant) the bound is half the move. The lse
    bound covers the low row sum's |ln(1 - gamma_pv)|."""
    st, V, o, numerator, l = _one_signed_row(4)
    moved = numerator * (1 + gamma) / (l * (1 - gamma))[..., None]  # [B, N, H, L]
    out_bound, lse_bound = bounds._rounding_bound(st, st.s.abs().amax(-1), V, o, u_out=0.0, u_p=0.0, eta_p=0.0,
                                                  gamma_qk=0.0, gamma_pv=gamma, exp_rel=0.0, u_arith=0.0)
    ratio = (moved - o).abs() / out_bound  # [B, N, H, L]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=1e-12, atol=0)  # fp64 roundings of both sides
    assert float(lse_bound) >= -math.log(1 - gamma)


@pytest.mark.parametrize("delta", [0.1, 2.0**-8])  # a move of 2 delta |ô| >= 0.0078 |ô|: fp64's roundings stay < 1e-13
def test_the_out_bound_of_a_row_sum_of_rounded_p_is_attained_by_a_high_numerator_over_a_low_sum(delta):
    """§5(f)'s l_rounded with u_P = delta the only error source: the numerator's P may round delta high (the P.V
    charge, delta Σ p |v| = delta |ô| for values of one sign) while the rounded row sum L_P is delta low (|θ| <= r =
    u_P), so o = ô (1 + delta) / (1 - delta), a move of 2 delta / (1 - delta) |ô|: the out bound (B + r |ô|) / (1 - r)
    must equal it. Without the r |ô| term (a review's mutant) it is half the move. The lse bound covers ln(1 - r)."""
    st, V, o, numerator, l = _one_signed_row(5)
    moved = numerator * (1 + delta) / (l * (1 - delta))[..., None]  # [B, N, H, L]
    out_bound, lse_bound = bounds._rounding_bound(st, st.s.abs().amax(-1), V, o, u_out=0.0, u_p=delta, eta_p=0.0,
                                                  gamma_qk=0.0, gamma_pv=0.0, exp_rel=0.0, u_arith=0.0,
                                                  l_rounded=True)
    ratio = (moved - o).abs() / out_bound  # [B, N, H, L]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=1e-12, atol=0)  # fp64 roundings of both sides
    assert float(lse_bound) >= -math.log(1 - delta)


def test_the_score_error_bound_is_attained_by_element_errors_of_one_sign():
    """§5(a): δ_j = σ Σ_i (e^q_i |k_ji| + |q_i| e^k_ji + e^q_i e^k_ji) is the move of s_j when every q and k element
    moves by its full error bound away from 0: (q + e^q)(k + e^k) - q k has exactly those three terms. Without the
    second-order e^q e^k (a review's mutant) the bound is 11 % short at errors of a quarter of each element."""
    g = torch.Generator().manual_seed(6)
    q = torch.rand(1, 1, 2, 8, generator=g, dtype=torch.float64) + 0.5  # [B, N, H, D] positive
    K = torch.rand(1, 3, 8, generator=g, dtype=torch.float64) + 0.5  # [B, S, D] positive
    e_q, e_k = q / 4, K / 4  # element error bounds, attained: q̂ = q + e^q, k̂ = k + e^k
    sigma = 0.3
    moved = sigma * (torch.einsum("bnhd,bsd->bnhs", q + e_q, K + e_k) - torch.einsum("bnhd,bsd->bnhs", q, K))
    r = types.SimpleNamespace(q=q, e_q=e_q, K=K, e_k=e_k)  # the _QuantGrid fields the bound reads
    torch.testing.assert_close(bounds._score_error_bound(r, sigma), moved, rtol=1e-13, atol=0)  # fp64 roundings


@pytest.mark.parametrize("omega", [0.8, 2.0**-6])
def test_the_value_error_term_is_attained_by_weights_moving_onto_the_larger_error(omega):
    """§5(c) term 2: with value errors e_j and scores moved with spread ω, Σ_j p'_j e_j reaches Σ_j p_j e_j +
    tanh(ω/4) (max e - min e) on two tokens whose score gap -ω/2 becomes +ω/2 (p'_1 - p_1 = σ(ω/2) - σ(-ω/2) =
    tanh(ω/4)), the larger error on token 1. `_value_term` must equal that move; without its tanh term (a review's
    mutant) it is short by the weight moved."""
    s = torch.tensor([-omega / 4, omega / 4], dtype=torch.float64)  # [S] exact scores, gap -ω/2
    s_moved = torch.tensor([omega / 4, -omega / 4], dtype=torch.float64)  # [S] each moved by ω/2: spread ω
    assert float((s_moved - s).max() - (s_moved - s).min()) == omega
    p, p_moved = torch.softmax(s, 0), torch.softmax(s_moved, 0)  # [S]
    e_v = torch.tensor([[[0.3, 1.0, 2.0], [0.1, 0.0, 0.5]]], dtype=torch.float64)  # [B, S, L] token 1's larger
    term = bounds._value_term(p[None, None, None], e_v, torch.tensor([[[omega]]], dtype=torch.float64),
                              torch.tensor([[2]]))  # [B, N, H, L]
    moved = torch.einsum("s,sc->c", p_moved, e_v[0])  # [L] Σ_j p'_j e_j
    torch.testing.assert_close(term[0, 0, 0], moved, rtol=1e-13, atol=0)  # fp64 roundings of both sides


def test_the_kernels_own_score_charge_covers_its_folded_scale_and_multiply():
    """§5(f)'s ω_own: a kernel folds q_scale · kv_scale · sm_scale · log2 e into one fp32 scale (3 products) and
    multiplies the score by it, so a score may move by (1 ± u)^4 - 1 of |s| <= A before the running max's
    subtraction (u |s - m| <= 2 u A, 0 here: both scores sit at the max). Two scores at A ∓ 2 u A moved 4 u A apart
    each way swap their gap -4 u A for +4 u A: p_1 moves by σ(4 u A) - σ(-4 u A) = tanh(2 u A), out by that times
    v_1 - v_2. The out bound with u_arith the only error source must cover it; at 3 u_arith A (a review's mutant,
    tanh(1.5 u A)) it does not."""
    u, A = U32, 50.0  # fp32 arithmetic; scores of 50
    s = torch.tensor([A * (1 - 2 * u), A * (1 + 2 * u)], dtype=torch.float64)  # [S] gap -4 u A
    moved_s = s * torch.tensor([(1 + u) ** 4, (1 - u) ** 4], dtype=torch.float64)  # [S] scale steps, opposite ways
    q, K = torch.ones(1, 1, 1, 1, dtype=torch.float64), s[None, :, None]  # [B, N, H, D], [B, S, D]: D = 1
    st = bounds._softmax(q, K, torch.ones(1, 1, 2, dtype=torch.bool), 1.0)  # σ = 1: the scores themselves
    V = torch.tensor([[[1.0], [0.0]]], dtype=torch.float64)  # [B, S, L] v_1 - v_2 = 1
    o = torch.einsum("bnhs,bsc->bnhc", st.p, V)  # [B, N, H, L]
    moved_o = torch.softmax(moved_s, 0) @ V[0]  # [L]
    out_bound, _ = bounds._rounding_bound(st, st.s.abs().amax(-1), V, o, u_out=0.0, u_p=0.0, eta_p=0.0,
                                          gamma_qk=0.0, gamma_pv=0.0, exp_rel=0.0, u_arith=u)
    assert float((moved_o - o[0, 0, 0]).abs()) == pytest.approx(math.tanh(2 * u * A), rel=1e-6)  # the construction
    assert float((moved_o - o[0, 0, 0]).abs()) <= float(out_bound)


def test_the_oracle_charges_a_score_its_d_products_on_requests_shorter_than_d():
    """An fp64 D-term dot product in any summation order errs by up to γ_D = D u64 / (1 - D u64) of σ Σ_i |q_i k_i|
    (Higham, Theorem 3.1), whatever the request's length: a 1-token row's lse is its score, so the oracle's lse bound
    must reach γ_D A. Charging max(s, D) + 2 terms does; s + 2 (a review's mutant: 3 terms at s = 1) falls 20x
    short."""
    g = torch.Generator().manual_seed(7)
    L, D = 512, 576
    q = torch.rand(1, 2, D, generator=g, dtype=torch.float64) * 4  # [T, H, D] scores of order 100: A >> exp's 2^-52
    kv = torch.rand(1, D, generator=g, dtype=torch.float64)  # [1 token, D]
    batch = make_decode_batch(q, [kv], q_lens=[1], sm_scale=SIGMA, kv_lora_rank=L, page_size=16, generator=g)
    A = SIGMA * torch.einsum("thd,sd->th", batch.dequantized_q(torch.float64).abs(),
                             batch.request_kv(0, torch.float64).abs())  # [T, H] σ Σ_i |q_i k_i|
    gamma_d = D * U64 / (1 - D * U64)
    assert (oracle_bound(batch).lse >= gamma_d * A).all()


def test_p_rounding_charges_the_coarser_of_p_fmt_and_the_pv_operand_and_uniform_p_three_exp_errors():
    """`_p_rounding`'s u_P composes P's own rounding with the P.V operand's where that one is coarser: fp32 P fed
    to a bf16 MMA is rounded to bf16, u_P = (1 + 2^-24)(1 + 2^-8) - 1; bf16 P fed to a bf16 MMA is rounded once,
    u_P = 2^-8. `_uniform_p_factor` (P from a score equal to the running max, p_scale 1) is 3 ε / (1 - ε) with ε the
    kernel exp's 2^-22. A review's mutants (the comparison reversed: half the bf16 charge; one ε for three) slipped."""
    def numerics(p_fmt, pv_operand):
        return KernelNumerics(p_fmt=p_fmt, p_scale=1.0, qk_operand=torch.bfloat16, pv_operand=pv_operand,
                              gamma_qk=0.0, gamma_pv=0.0)

    assert bounds._p_rounding(numerics(None, torch.bfloat16))[0] == (1 + 2.0**-24) * (1 + 2.0**-8) - 1  # fp32 units
    assert bounds._p_rounding(numerics("bf16", torch.bfloat16))[0] == 2.0**-8  # one bf16 rounding: half a bf16 ulp
    assert bounds._p_rounding(numerics(None, torch.float32))[0] == 2.0**-24  # half an fp32 ulp
    eps = 2.0**-22  # the kernel exp's relative error, numerics.md §5(f)
    assert bounds._uniform_p_factor(numerics("bf16", torch.bfloat16)) == 3 * eps / (1 - eps)
