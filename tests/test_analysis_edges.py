"""verify.analysis edges found by a mutation review: the error measures and statistics helpers by hand, the case
factory's defaults, and the sweeps' labels (each sweep row says which format / q dtype / granularity it measured)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from mla_ref.decode import DecodeBatch, mla_decode_ref
from verify import analysis as A

# A sweep size small enough for a unit test: one head, one seed, 64-token cases.
TINY = A.Size(heads=1, seq_lens=(64, 128), seeds=1, dist_seq_len=64, split_seq_len=128, workers=(1, 4),
              rms_seq_len=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tiny ops, one thread


def test_size_from_env(monkeypatch):
    """MLA_NB_SIZE picks a Size; an unknown name is a ValueError naming the variable (not a KeyError)."""
    monkeypatch.setenv("MLA_NB_SIZE", "full")
    assert A.size_from_env() == ("full", A.SIZES["full"])
    monkeypatch.setenv("MLA_NB_SIZE", "huge")
    with pytest.raises(ValueError, match="MLA_NB_SIZE"):
        A.size_from_env()


def test_fp8_case_defaults():
    """fp8 q and KV by default; coherent data get the unit scale unless the caller chose a scale mode."""
    c = A.fp8_case("gauss1", 64, seed=0, heads=2)
    assert (c.q_dtype, c.kv_dtype, c.scale_mode, c.fp8_format) == ("fp8", "fp8", "dynamic", "e4m3fn")
    assert A.fp8_case("coherent", 64, seed=0, heads=2).scale_mode == "unit"
    assert A.fp8_case("coherent", 64, seed=0, heads=2, scale_mode="static").scale_mode == "static"


def _batch(q, kv, seq_lens, q_lens=None, sm_scale=0.5, L=2, **kw):
    """One page per request, block table = request index."""
    B = len(seq_lens)
    return DecodeBatch(q, kv, torch.arange(B, dtype=torch.int32).view(B, 1), torch.tensor(seq_lens, dtype=torch.int32),
                       q_lens=None if q_lens is None else torch.tensor(q_lens, dtype=torch.int32),
                       sm_scale=sm_scale, kv_lora_rank=L, **kw)


def test_softmax_pv_by_hand_with_an_mtp_mask():
    """One request, 2 KV tokens, 2 query rows (MTP): row 0 sees token 0 only, row 1 both. K = [[0, 0, 2 ln 3],
    [1, -2, 0]] (L = 2, R = 1), σ = 0.5, q = [0, 0, 1] for both rows: scores (ln 3, 0), so row 1's softmax is
    (3/4, 1/4); Σ p |v|: row 0 = |v_0| = (0, 0) and row 1 = 3/4 (0, 0) + 1/4 (1, 2) = (1/4, 1/2)."""
    kv = torch.full((1, 4, 3), float("nan"), dtype=torch.float64)  # [P, ps, L+R]
    kv[0, :2] = torch.tensor([[0.0, 0.0, 2 * math.log(3.0)], [1.0, -2.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[[0.0, 0.0, 1.0]], [[0.0, 0.0, 1.0]]], dtype=torch.float64)  # [T=2, H=1, 3]
    pv = A.softmax_pv(_batch(q, kv, [2], q_lens=[2]))  # [2, 1, 2]
    expected = torch.tensor([[[0.0, 0.0]], [[0.25, 0.5]]], dtype=torch.float64)
    assert torch.allclose(pv, expected, rtol=4 * 2**-52, atol=0)  # a 2-term softmax in fp64


def test_error_stats_by_hand():
    """err_rel = max |Δo| / Σp|v| (not |Δo|), dlse = max |Δlse| (a negative Δ counts), cos_diff of out vs ref:
    1 - 2 Σ ab / Σ (a² + b²)."""
    out_ref = torch.tensor([[[1.0, 2.0]]], dtype=torch.float64)  # [T, H, L]
    out = torch.tensor([[[1.5, 2.0]]], dtype=torch.float64)
    pv = torch.tensor([[[10.0, 0.1]]], dtype=torch.float64)
    lse_ref, lse = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.25, 1.0]])
    s = A.error_stats(out, lse, out_ref, lse_ref, pv)
    assert s["err_rel"] == 0.05  # 0.5 / 10 (channel 1's Δ is 0)
    assert s["dlse"] == 1.0  # |1.0 - 2.0|
    assert s["cos_diff"] == pytest.approx(1 - 2 * 5.5 / (1 + 4 + 2.25 + 4), rel=2**-50)  # a few fp64 roundings


def test_quantization_error_row_names_its_format():
    """The fmt field of a row is the case's fp8 format (the format sweep groups by it)."""
    row = A.quantization_error(A.fp8_case("gauss1", 64, 0, 1, fp8_format="e4m3fnuz"))
    assert row["fmt"] == "e4m3fnuz" and row["q_dtype"] == "fp8"


def test_sweeps_cover_their_labels():
    """Each sweep measures every label it names: both fp8 formats, bf16 and fp8 q, the three KV granularities."""
    assert {r["fmt"] for r in A.sweep_formats(TINY)} == {"e4m3fn", "e4m3fnuz"}
    assert {r["q_dtype"] for r in A.sweep_fp8_q(TINY)} == {"bf16", "fp8"}
    gran = A.sweep_granularity(TINY, dists=("outlier",))
    assert [r["granularity"] for r in gran] == ["tensor", "token", "tile128"]
    assert len({r["err_rel"] for r in gran}) == 3  # three different quantizations, three different errors


def test_granularity_tensor_equals_kv_only_quantization():
    """granularity_error keeps q exact: per-tensor KV scales are the Case's own dynamic fp8 KV with bf16 q, so the
    two errors are the same oracle runs on the same inputs (equal up to fp64 summation order: 2**-40 relative)."""
    case = A.fp8_case("gauss1", 64, 0, 2)
    g = A.granularity_error(case, "tensor")
    q = A.quantization_error(dataclasses.replace(case, q_dtype="bf16"))
    assert g["err_rel"] == pytest.approx(q["err_rel"], rel=2**-40)


def test_decode_p_rounded_by_hand():
    """fp8 q (q_scale 2) and K: scores σ·q_scale·<q, k> = (2·2·5, 0) = (20, 0), so P = (1, e^-20) before rounding.
    e4m3 flushes e^-20 (< 2**-10) to 0 while l keeps it: out = v_0 / (1 + e^-20); lse = 20 + ln(1 + e^-20).
    fp32 P keeps e^-20 (within one fp32 rounding, 2**-24 relative): out = (v_0 + e^-20 v_1) / (1 + e^-20)."""
    f8 = torch.float8_e4m3fn
    kv = torch.zeros(1, 4, 3).to(f8)  # [P, ps, L+R]
    kv[0, :2] = torch.tensor([[0.0, 1.0, 5.0], [2.0, -3.0, 0.0]]).to(f8)
    q = torch.tensor([[[0.0, 0.0, 1.0]]]).to(f8)  # [1, 1, 3]
    batch = _batch(q, kv, [2], sm_scale=2.0, q_scale=2.0, kv_scale=1.0)
    e = math.exp(-20.0)
    out, lse = A.decode_p_rounded(batch, "e4m3fn")
    ulp = 4 * 2**-52  # a few fp64 roundings
    assert torch.allclose(out[0, 0], torch.tensor([0.0, 1 / (1 + e)], dtype=torch.float64), rtol=ulp, atol=0)
    assert float(lse[0, 0]) == pytest.approx(20 + math.log1p(e), rel=ulp)
    out32, lse32 = A.decode_p_rounded(batch, "fp32")
    want = torch.tensor([2 * e, 1 - 3 * e], dtype=torch.float64) / (1 + e)
    assert torch.allclose(out32[0, 0], want, rtol=2**-24, atol=0)
    assert torch.equal(lse32, lse)  # lse never sees the rounding


def test_p_roundings_match_their_labels():
    """Each label names its P format and scale: 'bf16 P' is bf16, 'e4m3 P x256' is e4m3fn scaled by 256."""
    assert A.P_ROUNDINGS["fp32 P"] == ("fp32", 1.0) and A.P_ROUNDINGS["bf16 P"] == ("bf16", 1.0)
    assert A.P_ROUNDINGS["e4m3 P"] == ("e4m3fn", 1.0) and A.P_ROUNDINGS["e4m3 P x256"] == ("e4m3fn", 256.0)


def test_relative_norm_change_by_hand():
    """<ô - o, o> / |o|²: ô = 1.1 o gives +0.1, ô = 0.5 o gives -0.5 (the output shrinks: negative)."""
    o = torch.tensor([[[3.0, 4.0]], [[3.0, 4.0]]], dtype=torch.float64)  # [T=2, H=1, 2]
    r = A.relative_norm_change(o * torch.tensor([1.1, 0.5], dtype=torch.float64).view(2, 1, 1), o)
    assert np.allclose(r, [0.1, -0.5], rtol=4 * 2**-52, atol=0)  # a few fp64 roundings of 2-term sums


def test_bias_test_by_hand():
    """samples (1, 2, 3, 4): mean 2.5, sample std √(5/3) (ddof 1); exact Wilcoxon signed-rank p-value of four
    positive samples: the most extreme of 2**4 sign patterns, two-sided 2 / 16; t = 2.5 / (√(5/3) / 2) = √15 on
    3 degrees of freedom, p = 2·(1 - F_t3(√15)) with F_t3 from its closed form."""
    r = A.bias_test(np.array([1.0, 2.0, 3.0, 4.0]))
    assert r["n"] == 4 and r["mean"] == 2.5
    assert r["std"] == pytest.approx(math.sqrt(5 / 3), rel=4 * 2**-52)
    assert r["wilcoxon_pvalue"] == pytest.approx(2 / 16, rel=4 * 2**-52)
    t = math.sqrt(15.0)
    x = t / math.sqrt(3.0)
    cdf = 0.5 + (math.atan(x) + x / (1 + x * x)) / math.pi  # Student t with 3 dof
    assert r["t_pvalue"] == pytest.approx(2 * (1 - cdf), rel=1e-9)  # scipy's incomplete-beta vs closed form


def test_log_fit_interval_uses_the_two_sided_t_quantile_on_n_minus_2_dof():
    """half-width / stderr = t_{0.975, n-2}; n = 6 points: t_{0.975, 4} = 2.776 (t table, 3 decimals: ±5e-4).
    Decreasing noise-free data: r2 = 1 (a square, not r = -1)."""
    n = np.array([64, 128, 256, 512, 1024, 2048])
    y = 0.05 + 0.01 * np.log(n) + np.array([1, -1, 2, -2, 1, -1]) * 1e-3  # fixed perturbations: stderr > 0
    fit = A.log_fit(n, y)
    from scipy import stats

    se = stats.linregress(np.log(n), y).stderr
    assert (fit["ci"][1] - fit["ci"][0]) / (2 * se) == pytest.approx(2.776, abs=5e-4)
    assert A.log_fit(n, 1.0 - 0.01 * np.log(n))["r2"] == pytest.approx(1.0, abs=2**-40)  # fp64 fit of exact data


def test_column_and_whiskers():
    """column keeps rows matching every condition; _whiskers is (mean, mean - min, max - mean)."""
    rows = [{"d": "a", "n": 1, "v": 10}, {"d": "a", "n": 2, "v": 20}, {"d": "b", "n": 1, "v": 30}]
    assert A.column(rows, "v", d="a", n=1).tolist() == [10]
    assert A.column(rows, "v", d="a").tolist() == [10, 20]
    assert A._whiskers(np.array([1.0, 2.0, 6.0])) == (3.0, 2.0, 3.0)


def test_bound_ratios_reduce_channels_by_max():
    """Per (row, head) the ratio is the max over channels of err / B_det (recomputed from the oracle and
    verify.bounds on the same case); omega_det is the max over rows and heads."""
    from verify.bounds import quantization_bounds

    case = A.fp8_case("gauss1", 64, 0, 2)
    r = A.bound_ratios(case)
    kernel, exact = case.materialize()
    ref = mla_decode_ref(exact)
    err = (mla_decode_ref(kernel)[0] - ref[0]).abs()  # [T, H, L]
    det = quantization_bounds(kernel, exact, ref_exact=ref).det_out  # [T, H, L]
    assert (det > 0).all()
    want = (err / det).amax(-1).flatten().numpy()  # [T·H] max over channels
    assert np.allclose(r["det"], want, rtol=2**-50, atol=0)  # the same fp64 values
    assert (r["det"] > (err / det).mean(-1).flatten().numpy()).all()  # the max is not a mean
    assert r["omega_det"] == pytest.approx(float(quantization_bounds(kernel, exact, ref_exact=ref).omega_det.max()),
                                           rel=2**-50)


def test_rms_ratio_is_a_ratio_of_root_mean_squares():
    """rms_ratio = sqrt(mean err²) / sqrt(mean predicted²) (its docstring), recomputed from the oracle and
    verify.bounds.rms_estimate on the same case (same fp64 values: a few roundings)."""
    from verify.bounds import rms_estimate

    case = A.fp8_case("gauss4", 64, 0, 2)
    kernel, exact = case.materialize()
    err = (mla_decode_ref(kernel)[0] - mla_decode_ref(exact)[0]).double()
    pred = rms_estimate(kernel, exact).double()
    want = math.sqrt(float((err**2).mean())) / math.sqrt(float((pred**2).mean()))
    assert A.rms_ratio(case) == pytest.approx(want, rel=2**-40)


def test_rounding_bias_samples():
    """rounding_bias on two 64-token cases. The fp8 KV element errors x̂ - x are signed (RNE on data symmetric
    about 0): their mean is within 6 standard errors of 0, where |x̂ - x| would sit near 0.8 standard deviations
    above it. The two output entries are the relative norm changes of the oracle on the fp8 inputs and of unscaled
    e4m3 P rounding (p_scale 1, the flush the docstring describes), recomputed per case (same fp64 values)."""
    size = A.Size(heads=1, seq_lens=(64,), seeds=2, dist_seq_len=64, split_seq_len=64, workers=(1,), rms_seq_len=64)
    r = A.rounding_bias(size)
    kv = r["fp8 KV elements"]
    assert abs(kv["mean"]) <= 6 * kv["std"] / math.sqrt(kv["n"])
    quant, p_fp8 = [], []
    for s in range(size.seeds):
        kernel, exact = A.fp8_case("gauss1", 64, s, 1).materialize()
        out_e = mla_decode_ref(exact)[0]  # [T, H, L]
        quant.append(A.relative_norm_change(mla_decode_ref(kernel)[0], out_e))
        p_fp8.append(A.relative_norm_change(A.decode_p_rounded(exact, "e4m3fn", 1.0)[0], out_e))
    for key, samples in (("fp8 q+KV output", quant), ("e4m3 P (unscaled)", p_fp8)):
        samples = np.concatenate(samples)
        assert r[key]["n"] == samples.size
        assert r[key]["mean"] == pytest.approx(float(samples.mean()), rel=2**-50, abs=2**-60)  # same values


def test_bound_ratios_flag_a_zero_bound_with_an_error_as_infinite(monkeypatch):
    """A bound of 0 where the error is not 0 is a violated bound: its ratio reads inf, never 0 (stubbed bounds)."""
    import types

    import verify.bounds as bounds

    def zero_bounds(kernel, exact, ref_exact=None):
        out, _ = ref_exact
        z = torch.zeros_like(out, dtype=torch.float64)  # [T, H, L]
        return types.SimpleNamespace(det_out=z, post_out=z, omega_det=z[..., 0], omega_act=z[..., 0])

    monkeypatch.setattr(bounds, "quantization_bounds", zero_bounds)
    monkeypatch.setattr(bounds, "prob_bound",
                        lambda k, e: types.SimpleNamespace(out=zero_bounds(k, e, mla_decode_ref(e)).det_out))
    r = A.bound_ratios(A.fp8_case("gauss1", 64, 0, 1))
    assert np.isinf(r["det"]).all() and np.isinf(r["post"]).all() and np.isinf(r["prob"]).all()


def test_sweep_splits_ratios_against_fp32_output_bounds():
    """sweep_splits rows, per its docstring: bound_ratio = max |Δo| / (kernel bound + merge bound) with the
    emulation's numerics at fp32 output, merge_rel = max merge bound / Σp|v|, splits = pieces of the request's KV
    range; recomputed here from the plan, the emulation and verify.bounds (the same fp64 values: a few roundings).
    Two heads, so the merge bound is not one multiple of Σp|v| everywhere (a mean would differ from the max)."""
    from mla_fast.backends import BACKENDS
    from mla_fast.emulate import run_plan_reference
    from mla_fast.planner import plan_decode
    from verify.bounds import kernel_bound, merge_bound

    size = dataclasses.replace(TINY, heads=2, split_seq_len=256, workers=(1, 4))
    rows = A.sweep_splits(size)
    kernel, _ = A.fp8_case("sink", 256, 0, 2).materialize()
    out_k, lse_k = mla_decode_ref(kernel)
    pv = A.softmax_pv(kernel)
    numerics = dataclasses.replace(BACKENDS["emulated"].numerics(kernel), out_dtype=torch.float32)
    kb = kernel_bound(kernel, numerics, ref=(out_k, lse_k)).out  # [T, H, L]
    assert [r["workers"] for r in rows] == [1, 4]
    for row in rows:
        plan = plan_decode(kernel.seq_lens, kernel.q_lens, kernel.num_heads, row["workers"])
        pieces = torch.diff(plan.reduce_indptr.cpu())  # one entry: the single request
        assert row["splits"] == max(int(pieces[0]), 1)
        merge = merge_bound(kernel, row["splits"]).out  # [T, H, L]
        out, _ = run_plan_reference(kernel, plan, torch.float32)
        ratio = float(((out.double() - out_k).abs() / (kb + merge)).max())
        assert row["bound_ratio"] == pytest.approx(ratio, rel=2**-50)
        assert row["merge_rel"] == pytest.approx(float((merge / pv).max()), rel=2**-50)
    assert rows[1]["splits"] > 1  # four workers split the 256 tokens: the merge bound is exercised


def test_log_fit_of_constant_values_contains_zero():
    """Found by a mutation review: constant values (no growth at all) are an exact fit, slope 0 and zero residuals,
    so the slope's interval is [0, 0] and contains 0. scipy's stderr is 0/0 = NaN there, which had given the
    interval (nan, nan) and contains_zero False (and would fail the notebook's `ci[0] < 0.01` growth check)."""
    fit = A.log_fit(np.array([64, 128, 256, 512]), np.full(4, 0.25))
    assert fit["slope"] == 0.0 and fit["ci"] == (0.0, 0.0) and fit["contains_zero"]
