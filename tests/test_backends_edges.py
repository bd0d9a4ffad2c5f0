"""Edges of mla_fast.backends that tests/test_backends.py leaves open (found by a source-mutation review): auto's
order among peers, probes on other hardware, declared numerics per dtype, refusals' exception types and messages.

No GPU: hardware is faked with monkeypatch; numerics are compared exactly (they are declared constants).
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_backends import _batch

from mla_fast import backends
from mla_fast.numerics import FP32_CHOPPED, KERNEL_NUMERICS


def _probe(ok):
    return lambda: (ok, "faked")


def test_auto_prefers_flashmla_over_flashinfer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, ok in (("triton", False), ("flashmla", True), ("flashinfer", True), ("aiter", False)):
        monkeypatch.setitem(backends.BACKENDS, name, replace(backends.BACKENDS[name], probe=_probe(ok)))
    assert backends.get_backend("auto").name == "flashmla"


def test_unknown_backend_message_lists_auto():
    with pytest.raises(ValueError, match=r"'auto'\], got 'nope'"):
        backends.get_backend("nope")


def test_probes_refuse_a_newer_gpu_than_sm90(monkeypatch):
    monkeypatch.setattr(backends, "_has_module", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))  # Blackwell: not sm_90
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "B200")
    for name in ("flashmla", "flashinfer", "seesaw", "gluon_fp8"):
        ok, reason = backends.BACKENDS[name].probe()
        assert not ok and "sm_100" in reason, name


def test_triton_probe_needs_interpret_exactly_1(monkeypatch):
    monkeypatch.setattr(backends, "_has_module", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # set but off: Triton itself runs compiled, which needs a GPU
    ok, reason = backends.BACKENDS["triton"].probe()
    assert not ok and "TRITON_INTERPRET=1" in reason


def test_aiter_probe_accepts_gfx950(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(gcnArchName="gfx950:sramecc+"))
    assert backends.BACKENDS["aiter"].probe() == (True, "gfx950")


def test_peer_16bit_numerics_charge_like_our_kernel_and_round_p_to_the_operand_dtype():
    bf16 = backends.BACKENDS["flashmla"].numerics(_batch())
    # "charged as mla_fast.numerics charges its own kernel": the same per-token PV term as our bf16 kernel
    assert bf16.gamma_pv_per_token == KERNEL_NUMERICS["bf16"].gamma_pv_per_token
    assert bf16.p_fmt == "bf16"
    fp16 = backends.BACKENDS["flashmla"].numerics(_batch("fp16"))
    assert fp16.p_fmt == "fp16" and fp16.pv_operand == torch.float16  # P rounded to the operand dtype


def test_flashinfer_declares_scale_then_round_for_an_fp8_cache_under_bf16_q():
    assert backends.BACKENDS["flashinfer"].numerics(_batch("fp8kv")).scale_then_round is True
    assert backends.BACKENDS["flashinfer"].numerics(_batch()).scale_then_round is False


def test_emulated_declares_two_fp32_roundings_per_token_and_returns_bf16():
    b = _batch()
    assert backends.BACKENDS["emulated"].numerics(b).gamma_pv_per_token == 2 * FP32_CHOPPED  # an add and a rescale
    out, lse = backends.BACKENDS["emulated"](b)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("name", ["triton", "triton_invariant"])
def test_our_kernels_refuse_fp16_as_unsupported_not_a_plain_value_error(name):
    with pytest.raises(ValueError) as e:
        backends.BACKENDS[name].numerics(_batch("fp16"))
    assert e.type is backends.Unsupported


def test_triton_invariant_takes_q_len_4_and_refuses_5():
    backends._invariant_unsupported(_batch(seq_lens=(3, 70), q_lens=(4, 1)), 4)  # the geometry's own limit: no raise
    with pytest.raises(backends.Unsupported, match="q_len <= 4"):
        backends._invariant_unsupported(_batch(seq_lens=(3, 70), q_lens=(5, 1)), 5)


def test_the_measured_nan_deviations_are_declared():
    """The peers whose NaN behaviour was measured (FlashInfer, FlashMLA: one H200) or documented (aiter's reduce,
    aiter-contract.md) to break the convention declare it, with those texts; our kernels declare none."""
    declared = {name: b.nan_deviation for name, b in backends.BACKENDS.items() if b.nan_deviation}
    assert declared == {"aiter": backends.AITER_NAN, "flashinfer": backends.FLASHINFER_NAN,
                        "flashmla": backends.FLASHMLA_NAN}


def test_flashmla_declares_e4m3fn_operands_for_an_e4m3fnuz_cache_it_converts():
    # FlashMLA's fp8 cache is e4m3fn: e4m3fnuz q and cache are converted (flashmla_backend), so the MMAs it declares
    # take e4m3fn operands whatever the batch's fp8 format
    b = _batch("fp8", fp8_format="e4m3fnuz")
    assert b.q.dtype == b.kv_cache.dtype == torch.float8_e4m3fnuz
    n = backends.BACKENDS["flashmla"].numerics(b)
    assert n.qk_operand == torch.float8_e4m3fn and n.pv_operand == torch.float8_e4m3fn and n.p_fmt == "e4m3fn"
