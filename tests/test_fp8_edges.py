"""Edges of mla_ref.fp8 that tests/test_fp8.py leaves open (found by a source-mutation review).

Expected values come from ml_dtypes (fp8 / bf16 rounding and limits) or from hand arithmetic on exact binary
fractions, written in the comments; every comparison is exact (the functions round once, to a known grid).
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from mla_ref import fp8


def test_tensor_granularity_quantizes_an_empty_tensor_with_unit_scale():
    x = torch.empty(0, 576, dtype=torch.bfloat16)
    x_fp8, s = fp8.quantize(x)  # no element: amax is 0, so the all-zero rule gives s = 1.0
    assert x_fp8.shape == (0, 576) and x_fp8.dtype == torch.float8_e4m3fn
    assert s.shape == () and s.dtype == torch.float32 and float(s) == 1.0


def test_round_p_divides_by_a_non_power_of_two_scale_in_one_rounding():
    # p = v / 3 for every positive e4m3fn value v in [2^-6, 448]: p * 3 is within an fp64 ulp of v, far from an
    # e4m3fn tie, so rne(p * 3) = v and round_p returns fp64(v / 3), numpy's correctly rounded fp64 division
    codes = np.arange(0x08, 0x7F, dtype=np.uint8)  # 0x08 = 2^-6 (min normal) ... 0x7E = 448; 0x7F is NaN
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    p = torch.from_numpy(v) / 3
    got = fp8.round_p(p, "e4m3fn", p_scale=3.0)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.from_numpy(v / 3.0))


def test_round_p_bf16_subnormal_ties_go_to_even():
    # bf16 subnormals are k * 2^-133 (emin -126, 7 mantissa bits). Ties: 1.5 * 2^-133 -> 2 * 2^-133 (even),
    # 2.5 * 2^-133 -> 2 * 2^-133, 0.5 * 2^-133 -> 0; all of them exact in fp32 (min subnormal 2^-149)
    p = torch.tensor([0.5, 1.5, 2.5, 3.5], dtype=torch.float64) * 2.0**-133
    expected = p.numpy().astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert list(expected * 2.0**133) == [0.0, 2.0, 2.0, 4.0]  # the hand values above
    assert torch.equal(fp8.round_p(p, "bf16"), torch.from_numpy(expected))


@pytest.mark.parametrize("fmt, np_dtype", [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)])
def test_round_p_wide_formats_saturate_at_their_own_max(fmt, np_dtype):
    fmax = float(ml_dtypes.finfo(np_dtype).max)  # bf16: (2 - 2^-7) * 2^127; fp16: 65504
    assert fp8.p_format_max(fmt) == fmax
    p = torch.tensor([1e300, -1e300, float("inf")], dtype=torch.float64)  # 1e300 is above both maxima
    assert fp8.round_p(p, fmt).tolist() == [fmax, -fmax, fmax]


def test_round_to_fp64_is_the_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, dtype=torch.float64, generator=g) * 1e-3
    assert fp8.round_to(x, torch.float64) is x


def test_round_p_rejects_a_bool_scale():
    with pytest.raises(ValueError, match="p_scale must be a float"):
        fp8.round_p(torch.ones(3), "e4m3fn", p_scale=True)


def test_dequantize_names_the_granularity_of_a_wrong_scale_shape():
    x = fp8.quantize(torch.ones(2, 4), granularity="token")[0]
    with pytest.raises(ValueError, match=r"shape \(2, 1\) for granularity='token', got \(2,\)"):
        fp8.dequantize(x, torch.ones(2), granularity="token")
