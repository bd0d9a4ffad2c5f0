"""Tests for mla_ref.fp8: exact formats, saturating round-to-nearest-even, granularities, round_p.

The independent reference is `_ref_rne_bits`: it enumerates the representable values of a format (decoded by
ml_dtypes, never by torch) and picks the nearest one in numpy, ties to the even code, saturating at +-max.
"""

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_ref.fp8 import (
    FORMATS,
    GRANULARITIES,
    TILE,
    FP8Format,
    dequantize,
    fp8_format,
    quantize,
    round_p,
    widen,
)

ML_DTYPES = {
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2": ml_dtypes.float8_e5m2,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}
NAMES = sorted(FORMATS)
ALL_BITS = np.arange(256, dtype=np.uint8)  # every fp8 byte


def _decode(name: str) -> np.ndarray:
    """All 256 bytes of a format decoded to float64 by ml_dtypes."""
    return ALL_BITS.view(ML_DTYPES[name]).astype(np.float64)


def _bits(x_fp8: torch.Tensor) -> np.ndarray:
    return x_fp8.view(torch.uint8).numpy()


def _u8(x_fp8: torch.Tensor) -> torch.Tensor:
    return x_fp8.view(torch.uint8)


def _ref_rne_bits(v: np.ndarray, name: str) -> np.ndarray:
    """Saturating round-to-nearest-even of float64 v, as fp8 bytes, from the enumerated grid (NaN -> a NaN byte)."""
    f = FORMATS[name]
    grid = _decode(name)[:128]  # codes 0x00..0x7F: +0 and the positive values, increasing with the code
    codes = np.flatnonzero(np.isfinite(grid))  # finite positive codes, grid[codes] increasing
    vals = grid[codes]
    a = np.minimum(np.abs(v), f.max)  # saturate: |v| > max and inf -> max
    a = np.where(np.isnan(a), 0.0, a)
    hi = np.clip(np.searchsorted(vals, a, side="left"), 0, len(vals) - 1)  # vals[hi] >= a
    lo = np.where(vals[hi] == a, hi, np.maximum(hi - 1, 0))  # vals[lo] <= a
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0) & (lo != hi))
    code = np.where(pick_hi, codes[hi], codes[lo]).astype(np.uint8)
    negative = np.signbit(v)
    if f.has_negative_zero:
        code = np.where(negative, code | 0x80, code)
    else:
        code = np.where(negative & (code != 0), code | 0x80, code)  # fnuz: -0 -> 0x00
    return np.where(np.isnan(v), f.nan_bits[0], code).astype(np.uint8)


def _assert_bits_equal(actual: np.ndarray, expected: np.ndarray, v: np.ndarray, name: str):
    """Bytes equal, except that any NaN byte of the format matches any other."""
    nan = set(FORMATS[name].nan_bits)
    both_nan = np.isin(actual, list(nan)) & np.isin(expected, list(nan))
    bad = np.flatnonzero((actual != expected) & ~both_nan)
    assert bad.size == 0, (
        f"{name}: {bad.size} mismatches, first x={v[bad[0]]!r} got 0x{actual[bad[0]]:02X} "
        f"expected 0x{expected[bad[0]]:02X}"
    )


def _dense_grid(name: str) -> np.ndarray:
    """Every representable value, every midpoint (tie), their fp64 neighbours, overflow and subnormal ties, +-inf."""
    f = FORMATS[name]
    vals = np.unique(np.abs(_decode(name)[np.isfinite(_decode(name))]))  # 0 and positive values
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties, including subnormal ties (2k+1) * min_subnormal / 2
    top_tie = f.max + (vals[-1] - vals[-2]) / 2  # 464 (e4m3fn), 248 (fnuz), 61440 (e5m2)
    special = np.array([f.max * (1 + 2.0**-20), top_tie, 465.0, 480.0, 1e6, 1e300, np.inf, f.min_subnormal / 4])
    base = np.concatenate([vals, mids, special, [top_tie]])
    near = np.concatenate([np.nextafter(base, np.inf), np.nextafter(base, 0.0)])  # just above / below
    pos = np.concatenate([base, near, [1.0625 + 2.0**-40]])  # the last one double-rounds through fp32 to 1.0
    return np.concatenate([pos, -pos])


# ---------------------------------------------------------------- format table


@pytest.mark.parametrize("name", NAMES)
def test_format_table_matches_ml_dtypes(name):
    f = FORMATS[name]
    fi = ml_dtypes.finfo(ML_DTYPES[name])
    decoded = _decode(name)
    assert f.torch_dtype == getattr(torch, f"float8_{name}")
    assert (f.max, f.min_normal, f.min_subnormal) == (float(fi.max), float(fi.tiny), float(fi.smallest_subnormal))
    assert f.max == torch.finfo(f.torch_dtype).max
    assert f.min_normal == 2.0**f.emin
    assert f.u == 2.0 ** -(f.mantissa_bits + 1)
    assert f.eta == f.min_subnormal / 2
    assert f.min_subnormal == 2.0 ** (f.emin - f.mantissa_bits)
    assert tuple(np.flatnonzero(np.isnan(decoded))) == f.nan_bits
    assert f.has_inf == bool(np.isinf(decoded).any())
    assert f.has_negative_zero == bool(decoded[0x80] == 0 and np.signbit(decoded[0x80]))


def test_fp8_format_lookup():
    for f in FORMATS.values():
        assert fp8_format(f.name) is f
        assert fp8_format(f.torch_dtype) is f
        assert fp8_format(f) is f
    assert isinstance(fp8_format("e4m3fn"), FP8Format)
    for bad in ("e4m3", "fp8", torch.bfloat16, 3):
        with pytest.raises(ValueError, match="e4m3fnuz"):  # the message lists the valid names
            fp8_format(bad)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_all_bit_patterns_match_ml_dtypes(name):
    x_fp8 = torch.arange(256, dtype=torch.uint8).view(FORMATS[name].torch_dtype)  # [256]
    got = dequantize(x_fp8, 1.0).numpy()
    expected = _decode(name)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(got[finite], expected[finite])
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(expected[finite]))  # -0 included


_SAME_WIDTH_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", list(_SAME_WIDTH_INT))
def test_widen_gives_the_bits_of_torchs_conversion(name, dtype):
    x = torch.arange(256, dtype=torch.uint8).view(FORMATS[name].torch_dtype).reshape(16, 16).t()  # every byte, strided
    got, expected = widen(x, dtype), x.to(dtype)  # [16, 16]
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.view(_SAME_WIDTH_INT[dtype]), expected.view(_SAME_WIDTH_INT[dtype]))  # NaN and -0 bits too
    assert widen(x[:0], dtype).shape == (0, 16)


def test_widen_converts_other_dtypes_as_to_does():
    x = torch.tensor([[1.0, -2.5e-8], [math.inf, math.nan]], dtype=torch.bfloat16)
    assert torch.equal(widen(x).view(torch.int64), x.to(torch.float64).view(torch.int64))


# ---------------------------------------------------------------- round-to-nearest-even with saturation


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale", [1.0, 2.0**-5])  # power-of-two static scale: x / s is exact
def test_quantize_dense_grid_is_saturating_rne(name, scale):
    v = _dense_grid(name)
    q, s = quantize(torch.from_numpy(v * scale), name, scale=scale)
    assert s.dtype == torch.float32 and s.shape == () and s.item() == scale
    _assert_bits_equal(_bits(q), _ref_rne_bits(v, name), v, name)
    assert not torch.isnan(q.double()).any()  # the grid holds no NaN, only finite values and +-inf


@pytest.mark.parametrize("name", NAMES)
def test_quantize_special_values(name):
    f = FORMATS[name]
    v = torch.tensor([math.inf, -math.inf, math.nan, f.max * 1.5, -1e30, f.eta, -f.eta, 3 * f.eta], dtype=torch.float64)
    got = quantize(v, name, scale=1.0)[0].double()
    assert got[:2].tolist() == [f.max, -f.max]  # +-inf saturates
    assert math.isnan(got[2].item())  # NaN stays NaN
    assert got[3:5].tolist() == [f.max, -f.max]
    assert got[5].item() == 0.0 and got[6].item() == 0.0  # half the min subnormal ties to 0 (even)
    assert got[7].item() == 2 * f.min_subnormal  # 1.5 min subnormals ties to the even code 2


def test_quantize_overflow_boundaries():
    # numerics.md §4: a plain torch cast gives NaN above 464 (e4m3fn, torch 2.11) and 248 (fnuz); quantize saturates
    v = torch.tensor([448.0, 449.0, 464.0, 465.0, 1000.0, -465.0], dtype=torch.float32)
    assert quantize(v, "e4m3fn", scale=1.0)[0].float().tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0]
    assert quantize(torch.tensor([247.0, 248.0, 1e4]), "e4m3fnuz", scale=1.0)[0].float().tolist() == [240.0] * 3


@pytest.mark.parametrize("name", ["e4m3fn", "e5m2"])
def test_quantize_fp32_input_has_no_double_rounding(name):
    """fp32 x and fp32 s whose fp32 quotient lands on an fp8 tie although the real quotient does not."""
    g = torch.Generator().manual_seed(0)
    vals = np.unique(np.abs(_decode(name)[np.isfinite(_decode(name))]))
    mids = torch.from_numpy((vals[1:] + vals[:-1]) / 2)  # [M] fp64 ties
    m = mids[torch.randint(len(mids), (20000,), generator=g)]  # [N]
    s = (torch.rand(20000, generator=g, dtype=torch.float64) + 1).float() * 2.0**-3  # [N] fp32 scales
    x = (m * s.double()).float()  # [N] fp32, x / s close to the tie m
    hit = ((x / s).double() == m) & ((x.double() / s.double()) != m)  # fp32 division rounds onto the tie
    x, s = x[hit][:, None], s[hit][:, None]  # [n, 1]
    assert x.shape[0] > 100, "too few double-rounding candidates to test"
    expected = _ref_rne_bits((x.double() / s.double()).numpy().ravel(), name)  # fp64 quotient: not a tie
    q, _ = quantize(x, name, granularity="token", scale=s)
    _assert_bits_equal(_bits(q).ravel(), expected, x.numpy().ravel(), name)
    naive = _bits((x / s).to(FORMATS[name].torch_dtype)).ravel()
    assert (naive != expected).sum() > 10, "the fp32-division path should double-round on these inputs"


# ---------------------------------------------------------------- element error model (numerics.md §4)


@dataclass(frozen=True)
class QuantCase:
    """One quantize input: a [rows, d] tensor of ``dtype`` with magnitudes around 2^log2_mag (down 24 binades per
    element), drawn from ``seed``."""

    name: str
    granularity: str
    log2_mag: int
    dtype: torch.dtype
    rows: int
    d: int
    seed: int


QUANT_CASES = st.builds(QuantCase, name=st.sampled_from(NAMES), granularity=st.sampled_from(GRANULARITIES),
                        log2_mag=st.integers(-140, 100), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
                        rows=st.integers(1, 3), d=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))


@given(QUANT_CASES)
def test_quantize_error_model(case):
    name, granularity, log2_mag, dtype, rows, d = (case.name, case.granularity, case.log2_mag, case.dtype, case.rows,
                                                   case.d)
    f = FORMATS[name]
    g = torch.Generator().manual_seed(case.seed)
    spread = torch.randint(-24, 1, (rows, d), generator=g).double()  # per-element magnitudes into the subnormals
    x = (torch.randn(rows, d, generator=g, dtype=torch.float64) * torch.exp2(spread + log2_mag)).to(dtype)  # [r, d]
    q, s = quantize(x, name, granularity)
    assert not np.isin(_bits(q), f.nan_bits).any()  # finite input never gives NaN
    x_hat = dequantize(q, s, granularity)  # [r, d] fp64
    s_full = dequantize(torch.ones_like(q), s, granularity)  # [r, d] fp64: each element's scale
    # element error model, numerics.md §4: one RNE to the fp8 grid of x / s, relative u in the normal range,
    # absolute half a min subnormal (eta) in units of s below it; the dynamic scale never saturates
    # (|x / s| <= max up to one fp32 rounding of s, whose clamp error 2^-24 |x| stays inside u |x|).
    bound = f.u * x.double().abs() + f.eta * s_full
    err = (x.double() - x_hat).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item()}"


# ---------------------------------------------------------------- granularities and scales


@pytest.mark.parametrize("name", NAMES)
def test_tile128_with_ragged_last_tile(name):
    f = FORMATS[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 300, generator=g) * torch.tensor([1.0] * 128 + [1e3] * 128 + [1e-3] * 44)  # [2, 3, 300]
    x[1, 2, 128:256] = 0.0  # an all-zero tile
    q, s = quantize(x, name, "tile128")
    assert q.shape == x.shape and q.dtype == f.torch_dtype
    assert s.shape == (2, 3, 3) and s.dtype == torch.float32
    assert s[1, 2, 1].item() == 1.0  # all-zero group: scale 1
    for t in range(3):
        tile = x[..., t * TILE : (t + 1) * TILE].double()  # [2, 3, <=128]
        expected_s = (tile.abs().amax(-1) / f.max).float()  # [2, 3]
        expected_s[1, 2] = 1.0 if t == 1 else expected_s[1, 2]
        assert torch.equal(s[..., t], expected_s)
        q_tile = q[..., t * TILE : (t + 1) * TILE]
        expected_q = quantize(tile, name, "token", scale=s[..., t : t + 1])[0]  # same tile, its own static scale
        assert torch.equal(_u8(q_tile), _u8(expected_q))
        deq = dequantize(q, s, "tile128")[..., t * TILE : (t + 1) * TILE]
        assert torch.equal(deq, q_tile.double() * s[..., t : t + 1].double())


def test_token_granularity_scales_each_row():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 5, 64, generator=g) * torch.logspace(-3, 3, 5).view(1, 5, 1)  # [4, 5, 64]
    q, s = quantize(x, "e4m3fn", "token")
    assert s.shape == (4, 5, 1) and s.dtype == torch.float32
    assert torch.equal(s, (x.double().abs().amax(-1, keepdim=True) / 448.0).float())
    assert (q.float().abs().amax(-1) == 448.0).all()  # each row's amax maps to max
    assert torch.equal(dequantize(q, s, "token"), q.double() * s.double())


def test_an_fp64_inputs_scale_is_its_amax_over_max_rounded_once():
    """The oracle quantizes fp64 tensors too: the scale is amax / max computed in fp64, then rounded to fp32 once.
    Rounding amax to fp32 first (a source-mutation review's slip: only fp32 inputs were tested) rounds twice."""
    g = torch.Generator().manual_seed(5)
    x = 448 * (1 + torch.rand(64, 16, generator=g, dtype=torch.float64))  # [64, 16] fp64, not fp32 values
    _, s = quantize(x, "e4m3fn", "token")  # [64, 1]
    assert torch.equal(s, (x.abs().amax(-1, keepdim=True) / 448.0).float())  # fp64 quotient, one rounding
    assert not torch.equal(s, x.abs().amax(-1, keepdim=True).float() / 448.0)  # the draw tells the two apart


def test_tensor_granularity_and_all_zero():
    x = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    q, s = quantize(x, "e4m3fnuz")
    assert s.shape == () and s.item() == pytest.approx(2.0 / 240.0, rel=2**-24)  # one fp32 rounding
    assert q.float().abs().max().item() == 240.0
    qz, sz = quantize(torch.zeros(3, 7), "e4m3fn", "tile128")
    assert torch.equal(sz, torch.ones(3, 1)) and not qz.float().any()


def test_dynamic_scale_ignores_inf_and_nan():
    x = torch.tensor([1.0, -3.0, math.inf, -math.inf, math.nan, 0.5])
    q, s = quantize(x, "e4m3fn")
    assert s.item() == pytest.approx(3.0 / 448.0, rel=2**-24)  # amax over the finite elements
    got = q.double()
    assert got[2].item() == 448.0 and got[3].item() == -448.0 and math.isnan(got[4].item())
    q_finite, _ = quantize(x[[0, 1, 5]], "e4m3fn", scale=s)
    assert torch.equal(_u8(q[[0, 1, 5]]), _u8(q_finite))


def test_dynamic_scale_floor_for_tiny_inputs():
    x = torch.tensor([1e-40, -3e-41, 0.0])  # fp32 subnormals: amax / 448 would underflow fp32
    q, s = quantize(x, "e4m3fn")
    assert s.item() == torch.finfo(torch.float32).tiny  # floored at 2^-126
    err = (x.double() - dequantize(q, s)).abs()
    f = FORMATS["e4m3fn"]  # u = 2^-4, eta = 2^-10
    assert (err <= f.u * x.double().abs() + f.eta * s.double()).all()  # element error model, numerics.md §4
    with pytest.raises(ValueError, match="overflows"):
        quantize(torch.tensor([1e300], dtype=torch.float64), "e4m3fn")  # amax / 448 is not an fp32


def test_static_scale_saturates_and_is_returned_as_fp32():
    x = torch.tensor([[1.0, 1000.0, -1e6], [0.1, -0.2, math.inf]])  # [2, 3]
    q, s = quantize(x, "e4m3fn", "token", scale=torch.tensor([[0.5], [2.0]], dtype=torch.float64))
    assert s.dtype == torch.float32 and torch.equal(s, torch.tensor([[0.5], [2.0]]))
    assert q.float().tolist() == [[2.0, 448.0, -448.0], [0.05078125, -0.1015625, 448.0]]  # RNE of x / s, saturated
    q1, s1 = quantize(x, "e4m3fn", "tile128", scale=0.25)  # a python number broadcasts to the group shape
    assert s1.shape == (2, 1) and (s1 == 0.25).all()
    assert q1.float()[0, 0].item() == 4.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fmt": "e4m3"}, "fmt"),
        ({"granularity": "block"}, "granularity"),
        ({"granularity": "token", "scale": torch.ones(4)}, "scale"),  # needs [4, 1]
        ({"granularity": "tile128", "scale": torch.ones(4, 1)}, "scale"),  # needs [4, 3]
        ({"scale": torch.ones(1)}, "scale"),  # needs []
        ({"scale": 0.0}, "scale"),
        ({"scale": -1.0}, "scale"),
        ({"scale": math.nan}, "scale"),
        ({"scale": 1e39}, "scale"),  # inf once rounded to fp32
        ({"granularity": "token", "scale": torch.ones(4, 1, dtype=torch.int32)}, "scale"),
    ],
)
def test_quantize_bad_arguments(kwargs, match):
    x = torch.ones(4, 300)
    with pytest.raises(ValueError, match=match):
        quantize(x, **kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="x must"):
        quantize(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must"):
        quantize(torch.ones(3).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="last dim"):
        quantize(torch.ones(3, 0), granularity="token")
    q, s = quantize(torch.ones(4, 300), granularity="tile128")
    with pytest.raises(ValueError, match="scale"):
        dequantize(q, s[:, :2], "tile128")
    with pytest.raises(ValueError, match="granularity"):
        dequantize(q, s, "block")
    for scale in (math.nan, math.inf, -0.25, 0.0):  # what quantize refuses, dequantize refuses: no NaN comes back
        with pytest.raises(ValueError, match="scale"):
            dequantize(q, scale, "tile128")
    with pytest.raises(ValueError, match="x_fp8"):
        dequantize(torch.tensor([1.3, 2.7]), 2.0)  # not fp8 codes


# ---------------------------------------------------------------- round_p


def test_round_p_e4m3fn_flush_thresholds():
    t = 2.0**-10  # half the e4m3fn min subnormal 2^-9
    p = torch.tensor([t / 2, t, t * (1 + 2**-20), 3 * t, 2.0**-9], dtype=torch.float64)
    assert round_p(p, "e4m3fn").tolist() == [0.0, 0.0, 2.0**-9, 2.0**-8, 2.0**-9]  # t ties to 0; 3t ties to even 2^-8
    scaled = round_p(p * 2**-8, "e4m3fn", p_scale=256.0)  # x256 moves the threshold to 2^-18
    assert scaled.tolist() == [0.0, 0.0, 2.0**-17, 2.0**-16, 2.0**-17]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p_scale", [1.0, 256.0])
def test_round_p_fp8_matches_reference(name, p_scale):
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(4 * torch.randn(8, 2048, generator=g), dim=-1)  # [8, 2048] fp32, score std 4
    got = round_p(p, name, p_scale)
    assert got.dtype == torch.float32
    v = (p.double() * p_scale).numpy().ravel()
    expected = _ref_rne_bits(v, name).view(ML_DTYPES[name]).astype(np.float64) / p_scale
    np.testing.assert_array_equal(got.double().numpy().ravel(), expected)
    assert (got == 0).sum() > 0  # the unscaled and scaled flushes both occur on this data


@pytest.mark.parametrize("fmt, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_round_p_wide_formats_match_torch_casts(fmt, dtype):
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(8 * torch.randn(4, 4096, generator=g, dtype=torch.float64), dim=-1)  # [4, 4096]
    p32 = p.float()  # fp32 P, as a kernel holds it; torch's fp32 -> bf16/fp16 casts are single RNE roundings
    assert torch.equal(round_p(p32, fmt), p32.to(dtype).float())
    assert torch.equal(round_p(p, None), p.float().double())  # None = fp32 rounding; fp64 -> fp32 is one RNE
    assert round_p(p.to(torch.bfloat16), "e4m3fn").dtype == torch.bfloat16


def test_round_p_bad_arguments():
    p = torch.tensor([0.1, 0.5, 0.9, 1.0])
    with pytest.raises(ValueError, match="fmt"):
        round_p(p, "fp8")
    with pytest.raises(ValueError, match="p_scale"):
        round_p(p, "e4m3fn", p_scale=0.0)
    with pytest.raises(ValueError, match="p_scale"):
        round_p(p, "e4m3fn", p_scale=math.inf)
