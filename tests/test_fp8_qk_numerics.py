"""The Gluon fp8 kernel's fp8 score MMAs (KernelConfig.qk_fp8): the config option, the numerics it declares
(mla_fast.numerics.gluon_fp8_qk_numerics) and the accumulation model its gamma_qk is derived from. The kernel itself
runs on the device only: tests/test_triton_gpu.py checks it against the fp64 oracle and this gamma on adversarial
data."""

import math

import pytest
import torch

from mla_fast import triton_decode as td
from mla_fast.numerics import (
    FP8_ACC_FRACTION_BITS,
    FP8_QK_GROUP,
    KERNEL_NUMERICS,
    gluon_fp8_qk_numerics,
    triton_numerics,
)


def test_qk_fp8_is_an_option_of_the_gluon_fp8_kernel_for_fp8_q():
    with pytest.raises(ValueError, match="qk_fp8"):
        td.KernelConfig(qk_fp8=True)  # the Triton kernel has no fp8 score MMAs
    fp8 = td.default_config("fp8", 16, 1, 32, fp8_gluon=True, kv_tokens=32 * 4096)
    fp8kv = td.default_config("fp8kv", 16, 1, 32, fp8_gluon=True, kv_tokens=32 * 4096)
    assert (fp8.kernel, fp8.qk_fp8) == ("gluon_fp8", True)
    assert (fp8kv.kernel, fp8kv.qk_fp8) == ("gluon_fp8", False)  # bf16 q: fp16 score operands
    assert not td.default_config("fp8", 16, 1, 32).qk_fp8  # no Gluon kernel offered: the Triton kernel
    assert td.forced_config("fp8", 32, 4, "gluon_fp8").qk_fp8
    assert not td.forced_config("fp8kv", 32, 4, "gluon_fp8").qk_fp8


def test_kernel_numerics_follows_the_config():
    fp8 = td.forced_config("fp8", 16, 1, "gluon_fp8")
    assert td.kernel_numerics(fp8, "fp8") == gluon_fp8_qk_numerics()
    assert td.kernel_numerics(td.default_config("fp8", 16, 1), "fp8") == KERNEL_NUMERICS["fp8"]
    assert td.kernel_numerics(td.default_config("bf16", 128, 1, 32, seesaw=True), "bf16") == KERNEL_NUMERICS["bf16"]
    with pytest.raises(ValueError, match="qk_fp8"):
        td.kernel_numerics(fp8, "fp8kv")
    with pytest.raises(ValueError, match="combo"):
        td.kernel_numerics(fp8, "fp16")


def test_qk_fp8_with_bf16_q_is_refused_with_the_reason():
    from triton_cases import TritonCase

    batch = TritonCase((70, 3), (1, 1), heads=16, page_size=64, combo="fp8kv", L=512, R=64).batch()
    config = td.forced_config("fp8", 16, 1, "gluon_fp8")
    assert "qk_fp8" in td.gluon_unsupported(batch, config, 16) and "bfloat16" in td.gluon_unsupported(batch, config, 16)
    from mla_fast import gluon_fp8

    with pytest.raises(ValueError, match="qk_fp8"):  # the launcher's precondition, before anything is built
        gluon_fp8.launch_decode(batch, None, None, None, None, None, None, None, 16, 1, 2, None, qk_fp8=True)


def test_backends_declare_the_dispatched_kernels_numerics(monkeypatch):
    """On this CPU the triton backend runs the Triton kernel (fp16 scores for fp8 q); the pinned gluon_fp8 backend
    declares its config's fp8 score MMAs where its kernel takes the batch (the device check opened here: off an
    sm_90 GPU it declines the batch, as its runner does), and the seesaw, which has no geometry for 16 rows, declines
    it by name."""
    from triton_cases import TritonCase

    from mla_fast import gluon_decode
    from mla_fast.backends import BACKENDS, Unsupported

    batch = TritonCase((70, 3), (1, 1), heads=16, page_size=64, combo="fp8", L=512, R=64).batch()
    if not torch.cuda.is_available():
        assert BACKENDS["triton"].numerics(batch) == KERNEL_NUMERICS["fp8"]
    monkeypatch.setattr(gluon_decode, "device_reason", lambda batch, kernel: None)
    assert BACKENDS["gluon_fp8"].numerics(batch) == gluon_fp8_qk_numerics()
    with pytest.raises(Unsupported, match="no seesaw geometry"):
        BACKENDS["seesaw"].numerics(batch)


def _fp8_mma(acc: float, a: list[float], b: list[float], bits: int = FP8_ACC_FRACTION_BITS) -> float:
    """The accumulation model of one fp8 MMA instruction (mla_fast/numerics.py): the accumulator and the products
    aligned at the largest exponent among them, each truncated to 2^(e - bits), then added exactly."""
    terms = [acc] + [x * y for x, y in zip(a, b)]
    top = max(abs(t) for t in terms)
    if top == 0:
        return 0.0
    unit = 2.0 ** (math.floor(math.log2(top)) - bits)
    return sum(math.trunc(t / unit) * unit for t in terms)


def _model_score(q: list[float], k: list[float], group: int) -> float:
    """Σ q_i k_i as the kernel computes it under the model: accumulators of `group` channels (k32 instructions
    chained from 0), added exactly (the fp32 adds are charged separately)."""
    total = 0.0
    for g0 in range(0, len(q), group):
        acc = 0.0
        for i in range(g0, g0 + group, 32):
            acc = _fp8_mma(acc, q[i:i + 32], k[i:i + 32])
        total += acc
    return total


def test_declared_gamma_covers_the_fp8_accumulation_model_only_with_64_channel_groups():
    """Under the model, rows built to lose the most (one 448 x 448 product, the others just under the truncation unit
    it sets) stay within gamma_qk x Σ|q||k| with FP8_QK_GROUP = 64 channels per accumulator, and exceed it with 128:
    the gamma is tied to the kernel's grouping (the device test measures the hardware against it)."""
    gamma = gluon_fp8_qk_numerics().gamma_qk
    assert FP8_QK_GROUP == 64 and gamma > triton_numerics("fp16").gamma_qk
    worst = {64: 0.0, 128: 0.0}
    for t in (3.75, 3.5, 2.75, 1.875, 0.9375):  # e4m3fn values: t^2 just under 16 = 2^(17 - 13) and smaller
        for pos in (0, 31, 40, 511, 575):
            q, k = [t] * 576, [t] * 576
            q[pos], k[pos] = 448.0, 448.0
            exact, mag = sum(x * y for x, y in zip(q, k)), sum(abs(x * y) for x, y in zip(q, k))
            for group in worst:
                worst[group] = max(worst[group], abs(_model_score(q, k, group) - exact) / mag)
    assert 0 < worst[64] <= gamma < worst[128], (worst, gamma)
