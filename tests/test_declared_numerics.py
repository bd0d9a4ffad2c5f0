"""Each declared KernelNumerics pinned to the derivation its docstring gives (mla_fast/numerics.py points 1-7,
mla_fast/backends.py's `_hopper_16bit` "charged as mla_fast.numerics charges its own kernel", docs/notes/numerics.md
§4.2's measured fp8 MMA constants). A declaration looser than its derivation widens every tier-1 bound the verifier
derives from it, and none of the bound tests fails on that (a review's source mutants: gamma x10, a per-tile term
dropped, P declared bf16 for an fp16 MMA kernel, the Hopper P.V charge x8 all passed tests/test_bounds.py,
test_backends.py, test_fp8_qk_numerics.py and test_emulate.py)."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from mla_fast import backends
from mla_fast.numerics import (
    BLOCK_N,
    DEFAULT_MMA,
    FP8_ACC_FRACTION_BITS,
    HOPPER_PV_PER_TOKEN,
    KERNEL_NUMERICS,
    PV_PER_TILE,
    gluon_fp8_qk_numerics,
    triton_numerics,
)
from verify.kernels import DEFAULT_NUMERICS, from_callable

U32_CHOPPED = 2**-23  # one chopped fp32 addition (numerics.py point 2)
EX2_APPROX = 2**-22  # the hardware ex2 approximation (numerics.py point 3, numerics.md §5(f))
L, R = 512, 64  # DeepSeek-V3 latent and rope channels
OPERAND = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("mma", ["bf16", "fp16"])
@pytest.mark.parametrize("block_n", [16, BLOCK_N])
def test_triton_numerics_is_its_docstrings_derivation(mma, block_n):
    """Points 1-7: operands and P in the MMA dtype, unscaled; (L + R + 1) chopped fp32 steps on the scores; per token
    the Hopper MMA into C plus, per tile, one chopped rescale and alpha's ex2 charged twice; 4 fp32 epilogue steps;
    bf16 out, fp32 partials."""
    n = triton_numerics(mma, block_n)
    assert (n.p_fmt, n.p_scale, n.qk_operand, n.pv_operand) == (mma, 1.0, OPERAND[mma], OPERAND[mma])
    assert (n.out_dtype, n.partial_dtype, n.scale_then_round) == (torch.bfloat16, torch.float32, False)
    assert n.gamma_qk == (L + R + 1) * U32_CHOPPED
    assert n.gamma_pv == 4 * U32_CHOPPED
    assert PV_PER_TILE == U32_CHOPPED + 2 * EX2_APPROX
    assert n.gamma_pv_per_token == HOPPER_PV_PER_TOKEN + PV_PER_TILE / block_n


def test_hopper_pv_charge_is_within_twice_its_truncation_model():
    """HOPPER_PV_PER_TOKEN covers the model of point 5 (2^-25 + 2^-23 / 16 per token: tests/test_bounds.py) and is
    not more than twice it (its docstring rounds the model up to the next power of two, 1.6x)."""
    model = 2**-25 + 2**-23 / 16
    assert model <= HOPPER_PV_PER_TOKEN <= 2 * model


def test_kernel_numerics_take_the_launchers_mma_per_combination():
    """KERNEL_NUMERICS["fp8kv"] / ["fp8"] declare fp16 P (the launcher's fp16 MMAs), ["bf16"] bf16 P."""
    assert DEFAULT_MMA == {"bf16": "bf16", "fp8kv": "fp16", "fp8": "fp16"}
    assert KERNEL_NUMERICS == {combo: triton_numerics(mma) for combo, mma in DEFAULT_MMA.items()}


def test_gluon_fp8_scores_are_nine_64_channel_groups_of_truncated_fp8_accumulation():
    """65 terms per group truncated below 2^-13 of the largest (module docstring), plus 9 + 1 fp32 steps."""
    assert FP8_ACC_FRACTION_BITS == 13  # DeepSeek-V3 §3.3.2: about 14 bits; measured 3.6e-3 worst-case vs 7.9e-3
    n = gluon_fp8_qk_numerics()
    assert n.gamma_qk == 65 * 2**-13 + ((L + R) // 64 + 1) * U32_CHOPPED
    assert n.qk_operand == torch.float8_e4m3fn
    assert dataclasses.replace(n, qk_operand=torch.float16, gamma_qk=triton_numerics("fp16").gamma_qk) == \
        triton_numerics("fp16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hopper_16bit_peers_are_charged_as_our_kernel(dtype):
    """`_hopper_16bit` (FA3, FlashMLA bf16): our kernel's declaration at 64-token tiles, output in the input dtype."""
    mma = "bf16" if dtype == torch.bfloat16 else "fp16"
    assert backends._hopper_16bit(dtype) == dataclasses.replace(triton_numerics(mma, 64), out_dtype=dtype)


def test_fp8_mma_constants_are_the_measured_ones():
    """`_fp8_mma`'s gamma_qk and per-token P.V charge are numerics.md §4.2's fast-accumulation same-sign maxima at
    K = 576 and K = 4096 (per term), as measured; the rest as our kernel's fp16 path with P in the fp8 format."""
    doc = (Path(__file__).parents[1] / "docs" / "notes" / "numerics.md").read_text()
    rows = {int(k): float(v) for k, v in re.findall(r"^\| (\d+) \| all positive \| [^|]+ \| \**([0-9.e-]+)\** \|$",
                                                    doc, re.M)}
    assert set(rows) == {576, 4096}
    n = backends._fp8_mma("e4m3fn", torch.float8_e4m3fn)
    assert n.gamma_qk == rows[576]
    assert n.gamma_pv_per_token == pytest.approx(rows[4096] / 4096 + PV_PER_TILE / 64, rel=1e-12)
    assert (n.p_fmt, n.p_scale, n.qk_operand, n.pv_operand) == ("e4m3fn", 1.0, torch.float8_e4m3fn,
                                                                torch.float8_e4m3fn)
    assert (n.gamma_pv, n.out_dtype) == (4 * U32_CHOPPED, torch.bfloat16)


def test_emulated_is_charged_as_a_chopped_fp32_kernel_with_fp32_p():
    """The emulated backend: torch fp32 matmuls and fp32 P, bf16 out; (L + R + 1) fp32 steps on the scores, 4 in the
    epilogue, an add and a rescale per token."""
    from triton_cases import TritonCase

    batch = TritonCase((3,), (1,), heads=16, page_size=16, combo="bf16", L=L, R=R).batch()
    n = backends.BACKENDS["emulated"].numerics(batch)
    assert (n.p_fmt, n.qk_operand, n.pv_operand, n.out_dtype) == (None, torch.float32, torch.float32, torch.bfloat16)
    assert (n.gamma_qk, n.gamma_pv, n.gamma_pv_per_token) == ((L + R + 1) * U32_CHOPPED, 4 * U32_CHOPPED,
                                                              2 * U32_CHOPPED)


def test_aiter_a16w8_declares_bf16_p():
    """aiter with bf16 q and an fp8 cache (a16w8: KV converted to bf16, exact) rounds P to bf16, not to fp8
    (`_aiter_numerics`'s comment; aiter-contract.md §7-§8): only fp8 q selects the a8w8 declaration."""
    from triton_cases import TritonCase

    batch = TritonCase((70, 3), (1, 1), heads=16, page_size=64, combo="fp8kv", L=512, R=64).batch()
    assert backends.BACKENDS["aiter"].numerics(batch) == backends._hopper_16bit(torch.bfloat16)


def test_the_triton_backend_declares_the_config_it_dispatches(monkeypatch):
    """`_triton_numerics` follows `batch_config`: where that picks the Gluon fp8 kernel's fp8 score MMAs (an
    H100/H200 with e4m3fn q) the backend declares their gamma_qk, not the fp16 path's 9x smaller one. On this CPU
    batch_config never picks it, so it is forced here."""
    from triton_cases import TritonCase

    from mla_fast import triton_decode as td

    batch = TritonCase((70, 3), (1, 1), heads=16, page_size=64, combo="fp8", L=512, R=64).batch()
    monkeypatch.setattr(td, "batch_config", lambda b, q_len: td.forced_config("fp8", 16, 1, "gluon_fp8"))
    assert backends.BACKENDS["triton"].numerics(batch) == gluon_fp8_qk_numerics()


def _chopped_fp32_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a + b truncated toward zero (the accumulation mla_fast.numerics point 2 charges; the fp64 sum of two
    fp32 values of one sign is exact)."""
    exact = a.double() + b.double()
    r = exact.float()
    return torch.where(r.double().abs() > exact.abs(), torch.nextafter(r, torch.zeros_like(r)), r)


def test_declared_gamma_qk_is_attained_by_its_chopped_accumulation_model():
    """Point 2's model reaches the declared gamma_qk: a score of one product 1.0 and L + R - 1 products just under
    one fp32 ulp of 1.0, summed with chopped fp32 adds, loses each small product, an error of
    (L + R - 1) ulps of Σ|q||k|: 0.997 of (L + R + 1) 2^-23, and never more than the charge. A gamma_qk 10x looser
    or tighter than the model fails."""
    small = torch.tensor(2**-23 * (1 - 2**-10), dtype=torch.float32)
    terms = [torch.tensor(1.0)] + [small] * (L + R - 1)
    acc = terms[0]
    for t in terms[1:]:
        acc = _chopped_fp32_add(acc, t)
    exact = sum(float(t) for t in terms)  # fp64: exact here
    ratio = (exact - float(acc)) / (triton_numerics("bf16").gamma_qk * exact)
    assert 0.99 <= ratio <= 1.0, ratio


@pytest.mark.parametrize("L_, R_", [(1024, 64), (512, 128), (256, 32)])
def test_the_score_charge_counts_the_batchs_channels(L_, R_):
    """Our kernels and the emulated path run other latent and rope widths: their declared score error is (L + R + 1)
    chopped fp32 steps of the batch's own L + R (a review found 577 declared at L = 1024, half the model's 1089), and
    the chopped-accumulation model above attains it at that width too."""
    from triton_cases import TritonCase

    batch = TritonCase((3,), (1,), heads=16, page_size=16, combo="bf16", L=L_, R=R_).batch()
    for name in ("triton", "triton_invariant", "emulated"):
        assert backends.BACKENDS[name].numerics(batch).gamma_qk == (L_ + R_ + 1) * U32_CHOPPED, name
    plug_in = from_callable(lambda batch: None, "plug_in_without_numerics").numerics(batch)  # DEFAULT_NUMERICS' rest
    assert plug_in == dataclasses.replace(DEFAULT_NUMERICS, gamma_qk=(L_ + R_ + 1) * U32_CHOPPED)
    small = torch.tensor(2**-23 * (1 - 2**-10), dtype=torch.float32)
    acc = torch.tensor(1.0)
    for _ in range(L_ + R_ - 1):
        acc = _chopped_fp32_add(acc, small)
    exact = 1.0 + (L_ + R_ - 1) * float(small)  # fp64: exact here
    ratio = (exact - float(acc)) / (backends.BACKENDS["triton"].numerics(batch).gamma_qk * exact)
    assert 0.99 <= ratio <= 1.0, ratio  # (L + R - 1) of (L + R + 1) steps, small's 1 - 2^-10 and the sum's 1 + 2^-13


@pytest.mark.parametrize("kernel, combo, heads", [("gluon_fp8", "fp8", 16), ("gluon_fp8", "fp8kv", 16),
                                                  ("seesaw", "bf16", 128)])
def test_a_pinned_gluon_backends_numerics_refuse_the_batches_its_runner_refuses(monkeypatch, kernel, combo, heads):
    """The "gluon_fp8" and "seesaw" backends declare the numerics of the config their runner launches (`_pinned`)
    and refuse, with the runner's Unsupported, a batch that kernel does not take: the Gluon fp8 kernel's fp8 score
    MMAs took any L + R and raised ValueError at 288 (an H100's step test; run_case lets a ValueError out of
    numerics). The device check is opened here so that the CPU batches reach the width check."""
    from triton_cases import TritonCase

    from mla_fast import gluon_decode
    from mla_fast import triton_decode as td

    monkeypatch.setattr(gluon_decode, "device_reason", lambda batch, kernel: None)
    numerics = backends.BACKENDS[kernel].numerics
    wide = TritonCase((70, 3), (1, 1), heads=heads, page_size=64, combo=combo, L=512, R=64).batch()
    config = td.forced_config(combo, heads, 1, kernel)
    assert numerics(wide) == td.kernel_numerics(config, combo), kernel
    assert config.qk_fp8 == (combo == "fp8") and (numerics(wide) == gluon_fp8_qk_numerics()) == config.qk_fp8
    narrow = TritonCase((70, 3), (1, 1), heads=heads, page_size=64, combo=combo, L=256, R=32).batch()
    with pytest.raises(backends.Unsupported, match="kv_lora_rank 512 and rope_dim 64") as refused:
        numerics(narrow)
    with pytest.raises(backends.Unsupported) as ran:
        backends.BACKENDS[kernel].run(narrow)
    assert str(refused.value) == str(ran.value)
