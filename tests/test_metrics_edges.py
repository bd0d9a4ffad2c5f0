"""verify.metrics edges that a source-mutation review (a read-only agent, CPU) found untested: each test fails on
single edits of verify/metrics.py that tests/test_metrics.py, test_checks.py, test_bounds.py,
test_model_check_edges.py and test_analysis_edges.py all let through (the review's mutant ids in the comments).
Expected values come from ml_dtypes / numpy bit views or from hand arithmetic on exact binary fractions."""

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from verify.metrics import NAN_ULP, compare, cos_diff, ulp_distance

F64 = torch.float64
NAN, INF = math.nan, math.inf


# ---- ulp_distance ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, np_type", [(torch.float16, np.float16), (torch.bfloat16, ml_dtypes.bfloat16)])
def test_bf16_fp16_overflow_to_inf_is_zero_ulp_from_a_reference_past_max(dtype, np_type):
    """bf16 and fp16 round a value past max + half an ulp to inf (IEEE overflow), so a kernel's inf there is correctly
    rounded: 0 ulp. Only the fp8 formats saturate (M07: saturating bf16 / fp16 too read it 1 ulp from inf)."""
    top = float(ml_dtypes.finfo(np_type).max)
    beyond = 2.0 * top  # far past the overflow threshold, finite in fp64
    with np.errstate(over="ignore"):
        assert np.isinf(np.float64(beyond).astype(np_type))  # the oracle's one rounding: inf
    got = ulp_distance(torch.tensor([INF, -INF], dtype=F64), torch.tensor([beyond, -beyond], dtype=F64), dtype)
    assert got.tolist() == [0, 0]
    assert int(ulp_distance(torch.tensor(top, dtype=F64), torch.tensor(beyond, dtype=F64), dtype)) == 1  # max, inf


@pytest.mark.parametrize("dtype, np_type", [(torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
                                            (torch.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz),
                                            (torch.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz)])
def test_inf_is_nan_in_fp8_formats_without_inf(dtype, np_type):
    """±inf becomes NaN in formats without inf (ulp_distance's docstring, as ml_dtypes casts): one side inf ->
    NAN_ULP, inf against NaN -> 0 (M11: testing the fp64 input for NaN, not its fp8 value, measured the NaN code's
    bits as a distance). e4m3fn: torch 2.13's CPU cast takes ±inf to ±448, so ulp_distance maps inf to NaN itself
    (the review found inf read as 448 there, 70 ulps from 1.0)."""
    assert np.isnan(np.float64(np.inf).astype(np_type)) and np.isnan(np.float64(-np.inf).astype(np_type))  # ml_dtypes
    got = ulp_distance(torch.tensor([INF, -INF, INF, -INF], dtype=F64), torch.tensor([1.0, 1.0, NAN, NAN], dtype=F64),
                       dtype)
    assert got.tolist() == [NAN_ULP, NAN_ULP, 0, 0]


def test_fp32_distances_across_zero_past_2_31_are_exact():
    """fp32 values of opposite signs can be 2^31 ulps apart or more: the distance of x and -x is twice x's bits read as
    an integer (numpy's bit view, independent of verify.metrics), and int64 holds it (M14: a NAN_ULP of int32's max
    saturated every such distance at 2^31 - 2)."""
    x = np.array([2.0, 3.0e38, np.inf], dtype=np.float32)
    want = [2 * int(bits) for bits in x.view(np.int32)]  # 2 * 0x40000000 = 2^31 for 2.0
    assert want[0] == 2**31
    got = ulp_distance(torch.from_numpy(x), torch.from_numpy(-x), torch.float32)
    assert got.tolist() == want


@pytest.mark.parametrize("dtype, np_type", [(torch.float16, np.float16), (torch.bfloat16, ml_dtypes.bfloat16)])
def test_values_just_below_the_overflow_threshold_round_to_max(dtype, np_type):
    """max + ulp(max) / 2 is the overflow threshold: below it round-to-nearest-even gives max, so a kernel's max is
    0 ulp from such a reference; at it (a tie, max's last bit odd) it gives inf. The review found values just below
    it double-rounded through fp32 onto the tie and read 1 ulp from max (fp16: 65520 - 2^-20)."""
    top = float(ml_dtypes.finfo(np_type).max)
    threshold = top + 2.0 ** math.floor(math.log2(top)) * float(ml_dtypes.finfo(np_type).eps) / 2  # 65520 for fp16
    below = np.nextafter(threshold, 0.0)  # the largest fp64 below the threshold
    assert float(np.float64(below).astype(np_type)) == top  # ml_dtypes / numpy round once
    with np.errstate(over="ignore"):
        assert np.isinf(np.float64(threshold).astype(np_type))
    got = ulp_distance(torch.tensor([top, top], dtype=F64), torch.tensor([below, threshold], dtype=F64), dtype)
    assert got.tolist() == [0, 1]  # max against max; max against inf, 1 ulp beyond


def test_an_fp64_distance_of_int64_max_is_not_the_nan_mark():
    """inf and minus the largest subnormal are 0x7FF0000000000000 + 0x000FFFFFFFFFFFFF = 2^63 - 1 steps apart
    (numpy's bit views): exactly NAN_ULP, the one-NaN mark, so it saturates at NAN_ULP - 1 as longer distances do
    (the review's M09: with > instead of >= it read as one NaN)."""
    a, b = np.array([np.inf]), -np.array([2.0**-1022 - 2.0**-1074])
    assert int(a.view(np.int64)[0]) + int((-b).view(np.int64)[0]) == NAN_ULP == 2**63 - 1
    assert ulp_distance(torch.from_numpy(a), torch.from_numpy(b), F64).tolist() == [NAN_ULP - 1]
    assert ulp_distance(torch.tensor([np.inf]), torch.tensor([-np.inf]), F64).tolist() == [NAN_ULP - 1]  # beyond


# ---- cos_diff --------------------------------------------------------------------------------------------------------

def test_cos_diff_of_exactly_orthogonal_tensors_is_one():
    """1 - 2·0 / (9 + 16) = 1 exactly, in cos_diff and in compare (M21: a zero test on the dot instead of the
    denominator gave 0; M40: compare's dot summed actual·actual, 1 - 2·9/25 = 0.28)."""
    assert cos_diff(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 1.0  # 1 - 2·0 / (1 + 1)
    assert compare(torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0], dtype=F64)).cos_diff == 1.0


# ---- compare: the largest errors, where, and the values there ------------------------------------------------------

def test_compare_max_abs_max_rel_and_ulp_locations():
    """Exact binary fractions, so every statistic is exact (arithmetic in the comments):
    err = [2, 0.75, 0, 0.5, 0 (both NaN)], rel = err / |expected| = [1/32, 0.75, 0 (0 = 0), 1/200, 0].
    Kills: M34 (rel over |actual|: 0.75 / 1.75), M35 (rel inf where expected = actual = 0), M36 (rel not masked to
    finite positions: 0 / NaN), M37 (max_abs located by argmax of actual: 99.5), M38 (max_rel located by err)."""
    expected = torch.tensor([64.0, 1.0, 0.0, 100.0, NAN], dtype=F64)
    actual = torch.tensor([66.0, 1.75, 0.0, 99.5, NAN], dtype=torch.bfloat16)  # every value exact in bf16
    rep = compare(actual, expected, name="out")
    assert (rep.max_abs, rep.max_abs_index, rep.max_abs_actual, rep.max_abs_expected) == (2.0, (0,), 66.0, 64.0)
    assert (rep.max_rel, rep.max_rel_index) == (0.75, (1,))
    assert rep.max_ulp == 96  # (1.75 - 1) / 2^-7: bf16's ulp on [1, 2); 66 vs 64 is 4 ulps of 0.5
    assert rep.ok and rep.nonfinite_mask_ok and rep.nonfinite_count == 1
    lines = rep.describe().splitlines()
    # M24 (describe swapped actual / expected), M25 (the relative line named max_abs's index)
    assert "  greatest absolute difference: 2 at index (0,) (actual 66, expected 64)" in lines
    assert "  greatest relative difference: 0.75 at index (1,)" in lines


def test_compare_measures_against_the_unrounded_oracle():
    """err is |actual - expected| with expected in fp64: a bf16 1.0 against 1 + 2^-9 is 2^-9 off (M49: rounding
    expected to actual's dtype first made it 0)."""
    rep = compare(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0 + 2**-9], dtype=F64))
    assert rep.max_abs == 2**-9 and rep.max_rel == 2**-9 / (1.0 + 2**-9)


def test_compare_single_element():
    """One element is compared like any other tensor (M47: numel <= 1 taken as empty reported ok)."""
    rep = compare(torch.tensor([1.5]), torch.tensor([1.0], dtype=F64), bound=0.25)
    assert not rep.ok and rep.violations == 1 and rep.max_abs == 0.5 and rep.err_over_bound_max == 2.0  # 0.5 / 0.25


def test_max_ulp_counts_finite_positions_only():
    """A NaN where the oracle is finite is the masks' failure, not an ulp count (Report: max_ulp over finite
    positions; M39: unmasked, max_ulp read NAN_ULP)."""
    rep = compare(torch.tensor([NAN, 1.0 + 2**-7]), torch.tensor([1.0, 1.0], dtype=F64))
    assert rep.max_ulp == 1 and not rep.nonfinite_mask_ok  # 1 + 2^-7 is bf16's next value after 1


def test_empty_report_indexes_have_one_entry_per_dimension():
    """Like a non-empty report's argmax indexes (M46: () for an empty [0, 3])."""
    rep = compare(torch.zeros(0, 3), torch.zeros(0, 3, dtype=F64), bound=1.0)
    assert rep.ok and rep.max_abs_index == rep.max_rel_index == (0, 0)


def test_to_json_keeps_the_sign_of_an_infinite_value():
    """Agreeing -inf rows (empty rows' lse) report -inf as the values at max_abs_index; JSON gets "-inf"
    (M22: "inf")."""
    lse = torch.full((2,), -INF)
    rep = compare(lse, lse.double(), name="lse")
    back = json.loads(json.dumps(rep.to_json(), allow_nan=False))
    assert back["max_abs_actual"] == back["max_abs_expected"] == "-inf"


# ---- compare: non-finite positions -------------------------------------------------------------------------------

def test_nonfinite_detail_names_counts_and_values_of_each_side():
    """actual has one NaN, the oracle two; they differ at position 1 only (M27: first located in actual's mask, (0,);
    M28: the counts swapped; M29: the values there swapped)."""
    rep = compare(torch.tensor([NAN, 1.0, 1.0]), torch.tensor([NAN, NAN, 1.0], dtype=F64))
    assert rep.nonfinite_first_index == (1,)
    assert rep.nonfinite_detail == ("NaN at 1 positions differ (actual 1, expected 2; first at (1,): actual 1.0, "
                                    "expected nan)")


def test_first_nonfinite_mismatch_is_the_first_position_over_all_classes():
    """+inf differs at 2, NaN at 3: the first is (2,), though NaN is the first class looked at (M31)."""
    rep = compare(torch.tensor([1.0, 1.0, INF, NAN]), torch.tensor([1.0, 1.0, 2.0, 3.0], dtype=F64))
    assert rep.nonfinite_first_index == (2,)


def test_err_over_bound_with_no_finite_position_is_zero():
    """All positions non-finite and agreeing: nothing is over the bound, max and median 0 (_lower_median: "0 when
    nothing is kept"; M32: the rank -1 unclamped, M33: the median of nothing read as +inf)."""
    lse = torch.tensor([-INF, -INF, NAN])
    rep = compare(lse, lse.double(), bound=1.0)
    assert rep.ok and rep.err_over_bound_max == 0.0 and rep.err_over_bound_median == 0.0


def test_err_over_bound_median_ignores_agreeing_nonfinite_positions():
    """err / bound = [0.5, 0.5] at the two finite positions: lower median 0.5 (M44: the two agreeing non-finite
    positions' zeros counted, [0, 0, 0.5, 0.5] -> 0)."""
    actual = torch.tensor([1.5, 1.5, NAN, -INF])
    expected = torch.tensor([1.0, 1.0, NAN, -INF], dtype=F64)
    rep = compare(actual, expected, bound=1.0)
    assert rep.ok and rep.err_over_bound_median == 0.5 and rep.err_over_bound_max == 0.5
