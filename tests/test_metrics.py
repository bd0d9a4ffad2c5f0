"""verify.metrics: ULP distance against an independent enumeration, cos-diff values, compare() reports."""

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from verify.metrics import NAN_ULP, compare, cos_diff, ulp_distance

# torch dtype -> the ml_dtypes / numpy type used for the independent enumeration
_NP_TYPES = {
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float16: np.float16,
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e5m2fnuz: ml_dtypes.float8_e5m2fnuz,
}


def _sorted_grid(dtype: torch.dtype) -> np.ndarray:
    """Every non-NaN value of the format (±inf included), sorted, ±0 merged: rank difference = ULP distance.

    Independent of verify.metrics: decodes all bit patterns with ml_dtypes/numpy and sorts by value.
    """
    bits = np.arange(2 ** torch.finfo(dtype).bits, dtype=np.uint64)
    uint = {8: np.uint8, 16: np.uint16}[torch.finfo(dtype).bits]
    with np.errstate(invalid="ignore"):  # NaN patterns
        values = bits.astype(uint).view(_NP_TYPES[dtype]).astype(np.float64)
    return np.unique(values[~np.isnan(values)])  # np.unique treats -0.0 == 0.0


def _rank(grid: np.ndarray, x: np.ndarray) -> np.ndarray:
    r = np.searchsorted(grid, x)
    assert np.all(grid[r] == x), "test values must lie on the grid"
    return r


def test_ulp_distance_matches_enumeration_bf16_neighbourhoods():
    grid = _sorted_grid(torch.bfloat16)
    tiny_sub = 2.0**-133  # smallest bf16 subnormal
    centres = [0.0, 1.0, -1.0, 3.140625, tiny_sub, -tiny_sub, 2.0**-126, 1e-39, 3.3895e38, -3.3895e38, 65504.0]
    for c in centres:
        r0 = np.searchsorted(grid, np.float64(ml_dtypes.bfloat16(c)))
        lo, hi = max(r0 - 5, 0), min(r0 + 6, len(grid))
        vals = grid[lo:hi]  # up to 11 consecutive bf16 values around c (across zero for the small ones)
        a, b = np.meshgrid(vals, vals, indexing="ij")
        want = np.abs(_rank(grid, a) - _rank(grid, b))
        got = ulp_distance(torch.from_numpy(a), torch.from_numpy(b), torch.bfloat16).numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"around {c}")


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz]
)
def test_ulp_distance_matches_enumeration_fp8_all_pairs(dtype):
    grid = _sorted_grid(dtype)  # ≤ 256 values: every pair
    a, b = np.meshgrid(grid, grid, indexing="ij")
    want = np.abs(_rank(grid, a) - _rank(grid, b))
    got = ulp_distance(torch.from_numpy(a), torch.from_numpy(b), dtype).numpy()
    np.testing.assert_array_equal(got, want)


def test_ulp_distance_signed_zero_rounding_and_nan():
    z = torch.tensor([0.0, -0.0, 1.0, 1.0 + 2**-8, float("nan"), float("nan"), 448.0])
    w = torch.tensor([-0.0, 2.0**-133, 1.0 + 2**-7, 1.0, float("nan"), 1.0, 1e6])
    d = ulp_distance(z, w, torch.bfloat16)
    # ±0 are one point; the min subnormal is 1 ulp from 0; 1 + 2^-7 is the next bf16 after 1;
    # 1 + 2^-8 is the tie between them and rounds to even (1.0), so it is 0 ulp from 1
    assert d.tolist()[:4] == [0, 1, 1, 0]
    assert d[4] == 0 and d[5] == NAN_ULP
    nans = torch.tensor([0x7FC0, 0xFFC1, 0x7F81], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # payloads
    assert ulp_distance(nans, nans.roll(1), torch.bfloat16).tolist() == [0, 0, 0]  # any NaN is the same point
    # fp8 saturates: 1e6 -> 448 (0 ulp from 448) instead of torch's NaN
    assert ulp_distance(torch.tensor(448.0), torch.tensor(1e6), torch.float8_e4m3fn) == 0
    saturating = ((torch.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz), (torch.float8_e5m2, ml_dtypes.float8_e5m2),
                  (torch.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz))
    for dtype, np_type in saturating:  # every fp8 format saturates
        top = float(ml_dtypes.finfo(np_type).max)
        assert ulp_distance(torch.tensor(top), torch.tensor(1e6), dtype) == 0, dtype
    with pytest.raises(ValueError, match="dtype"):
        ulp_distance(z, w, torch.int32)


@pytest.mark.parametrize("dtype", list(_NP_TYPES))
def test_ulp_distance_rounds_fp64_once(dtype):
    """An fp64 value just past a tie of the target format rounds away from the tie's even neighbour; torch's cast
    (through fp32, which lands on the tie) rounded it to the even one, so a correctly rounded kernel output read 1
    ulp from its fp64 reference (found by a review). ml_dtypes casts fp64 with one rounding: the oracle here."""
    grid = _sorted_grid(dtype)
    grid = grid[np.isfinite(grid)]
    lo, hi = grid[:-1], grid[1:]
    tie = (lo + hi) / 2  # exact in fp64: every format here has at most 11 significant bits
    past = tie + np.abs(tie) * 2.0**-40 * np.sign(hi - lo)  # toward hi, below fp32's resolution
    want = past.astype(_NP_TYPES[dtype]).astype(np.float64)  # one rounding: hi
    assert np.array_equal(want, hi)
    d = ulp_distance(torch.from_numpy(want), torch.from_numpy(past), dtype)
    assert int(d.max()) == 0
    codes = torch.from_numpy(want).to(dtype)  # fp8 / bf16 inputs themselves (fp8 has no isfinite in torch)
    assert int(ulp_distance(codes, codes, dtype).max()) == 0


@pytest.mark.parametrize("np_type, dtype", [(np.float32, torch.float32), (np.float64, torch.float64)])
def test_ulp_distance_counts_nextafter_steps(np_type, dtype):
    """fp32 / fp64: walk k steps with np.nextafter (independent of the bit mapping), across zero too."""
    for start in (
        np_type(1.0),
        np_type(-3e-38),
        np_type(0.0),
        np_type(-1e300) if np_type is np.float64 else np_type(-1e30),
    ):
        x = start
        for k in range(1, 40):
            x = np.nextafter(x, np_type(np.inf))
            d = ulp_distance(torch.tensor(start, dtype=dtype), torch.tensor(x, dtype=dtype), dtype)
            assert int(d) == k, (start, k)
    top = torch.tensor(1.7e308, dtype=torch.float64)
    assert int(ulp_distance(top, -top, torch.float64)) == NAN_ULP - 1  # saturates instead of overflowing


def test_cos_diff_known_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g, dtype=torch.float64)
    y = torch.randn(1000, generator=g, dtype=torch.float64)
    y_perp = y - (x @ y) / (x @ x) * x  # orthogonal to x
    y_perp = y_perp * x.norm() / y_perp.norm()  # equal norm
    assert cos_diff(x, x) == 0.0
    assert cos_diff(x, -x) == 2.0
    n_u = 1000 * 2**-53  # Higham's gamma_n for an n = 1000-term fp64 sum: relative error of each sum below
    assert abs(cos_diff(x, y_perp) - 1.0) <= 4 * n_u  # x·y_perp (its construction and its sum) and the norms' sums
    assert abs(cos_diff(x, 2 * x) - 0.2) <= 4 * n_u  # 1 - 2·2/(1+4): two sums of the same terms, one division
    assert cos_diff(torch.zeros(3), torch.zeros(3)) == 0.0


def test_compare_finds_index_values_and_bound_violations():
    g = torch.Generator().manual_seed(1)
    expected = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    actual = expected.clone()
    actual[1, 2, 5] += 0.5  # the largest error
    actual[2, 0, 1] += 0.1
    rep = compare(actual, expected, bound=torch.full_like(expected, 0.2), name="out")
    assert rep.max_abs_index == (1, 2, 5)
    assert rep.max_abs == pytest.approx(0.5, abs=2**-50)  # one fp64 ulp of |expected + 0.5| < 4
    assert rep.max_abs_actual == float(actual[1, 2, 5]) and rep.max_abs_expected == float(expected[1, 2, 5])
    assert rep.violations == 1 and not rep.ok
    assert rep.worst_index == (1, 2, 5) and rep.err_over_bound_max == pytest.approx(2.5, rel=2**-48)  # that ulp / 0.2
    assert rep.err_over_bound_median == 0.0
    assert "1 / 96" in rep.describe() and "(1, 2, 5)" in rep.describe()
    # bound 0 where err = 0 is fine, bound 0 where err > 0 is an infinite ratio
    b = torch.full_like(expected, 1.0)
    b[2, 0, 1] = 0.0
    rep = compare(actual, expected, bound=b)
    assert rep.err_over_bound_max == math.inf and rep.worst_index == (2, 0, 1) and rep.violations == 1
    assert compare(actual, expected, bound=1.0).ok


def test_compare_ulps_in_out_dtype():
    expected = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64)
    actual = torch.tensor([1.0 + 2 * 2**-7, 2.0, -3.0], dtype=torch.bfloat16)  # 2 bf16 ulps at 1.0
    assert compare(actual, expected).max_ulp == 2


def test_compare_nonfinite_masks():
    expected = torch.tensor([[0.5, -math.inf], [1.0, 2.0]], dtype=torch.float64)
    agree = torch.tensor([[0.5, -math.inf], [1.0, 2.0]])
    rep = compare(agree, expected, bound=0.0, name="lse")
    assert rep.ok and rep.nonfinite_mask_ok and rep.max_abs == 0.0 and rep.nonfinite_count == 1
    assert rep.cos_diff == 0.0  # over the finite positions: matching -inf rows (empty rows' lse) are no difference
    nan_out = torch.tensor([[0.5, -math.inf], [float("nan"), 2.0]])
    rep = compare(nan_out, expected, bound=1.0)
    assert not rep.nonfinite_mask_ok and not rep.ok and "NaN" in rep.nonfinite_detail
    plus_inf = torch.tensor([[0.5, math.inf], [1.0, 2.0]])  # FlashMLA's +inf for an empty row
    rep = compare(plus_inf, expected)
    assert not rep.ok and "+inf" in rep.nonfinite_detail and "-inf" in rep.nonfinite_detail


def test_compare_statistics_cover_positions_finite_on_both_sides():
    """The Report's statistics (max error, violations, err/bound median, cosine difference) are over the positions
    where both sides are finite; the masks judge the others, and nonfinite_count counts positions where either side
    is not finite. Expected values recomputed here with torch.median (its lower median) and plain differences."""
    actual = torch.tensor([1.0, math.nan, math.inf])
    rep = compare(actual, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), bound=0.1)
    assert not rep.ok and not rep.nonfinite_mask_ok  # a NaN and an inf where the oracle is finite
    assert rep.max_abs == 0.0 and rep.violations == 0 and rep.cos_diff == 0.0 and rep.nonfinite_count == 2
    rep = compare(torch.tensor([math.nan, 1.0]), torch.tensor([1.0, 1.0], dtype=torch.float64), bound=1.0)
    assert rep.nonfinite_count == 1  # one side's NaN is a non-finite position
    actual = torch.tensor([1.1, 1.2, 1.3, 1.4, math.nan], dtype=torch.float64)
    expected = torch.tensor([1.0, 1.0, 1.0, 1.0, math.nan], dtype=torch.float64)
    rep = compare(actual, expected, bound=1.0)
    assert rep.ok and rep.err_over_bound_median == float(torch.median((actual - expected)[:4].abs()))  # the lower: 0.2
    assert rep.err_over_bound_max == float((actual - expected)[:4].abs().max())


def test_the_lower_median_by_selection_and_by_sort_is_torch_median():
    """compare()'s err/bound median: torch.kthvalue on a CPU, a sort off it (no host sync); both give torch.median of
    the kept values (its lower median) for odd and even counts, ties, inf, and 0 when nothing is kept."""
    from verify.metrics import _lower_median, _lower_median_by_sort

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 10, 1000):
        x = torch.rand(n, generator=g, dtype=torch.float64).round(decimals=1)  # [n] with ties
        x[0] = math.inf
        for keep in (torch.rand(n, generator=g) > 0.3, torch.ones(n, dtype=torch.bool)):
            want = torch.median(x[keep]) if keep.any() else torch.tensor(0.0, dtype=torch.float64)
            assert _lower_median(x, keep) == want == _lower_median_by_sort(x, keep)
    nothing = torch.zeros(3, dtype=torch.bool)
    assert _lower_median(torch.ones(3), nothing) == 0.0 == _lower_median_by_sort(torch.ones(3), nothing)


def test_to_json_round_trips_without_nan():
    expected = torch.tensor([0.0, 1.0, -math.inf], dtype=torch.float64)
    actual = torch.tensor([1e-3, 1.0, -math.inf])
    for bound in (None, torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)):
        rep = compare(actual, expected, bound=bound)
        text = json.dumps(rep.to_json(), allow_nan=False)
        back = json.loads(text)
        assert back["max_rel"] == "inf" and back["shape"] == [3]
        assert back["err_over_bound_max"] == ("nan" if bound is None else "inf")


def test_compare_rejects_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        compare(x, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="bound"):
        compare(x, x.double(), bound=-1.0)
    with pytest.raises(ValueError, match="bound"):  # a NaN bound judges nothing: err > NaN is never true
        compare(x + 0.5, x.double(), bound=torch.full((2, 3), math.nan, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bound: expected a float or a tensor broadcastable to \(2, 3\)"):
        compare(x, x.double(), bound=torch.ones(3, 2))  # was a RuntimeError from expand (found by a review)
