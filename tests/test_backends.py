"""mla_fast.backends: registry contents, honest availability reasons, auto, lazy peer imports, declared numerics.

Numerical tolerance (emulated backend): verify.bounds.kernel_bound with its declared KernelNumerics plus merge_bound
for the number of 64-token blocks of the longest request (the most splits its plan can make); ref is exact.
"""

import ast
from pathlib import Path

import pytest
import torch

from mla_fast import backends
from mla_ref import fp8
from mla_ref.decode import make_decode_batch, mla_decode_ref

NAMES = {"ref", "emulated", "triton", "aiter", "flashinfer", "flashmla"}


def _batch(dtype="bf16", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 16, 576, generator=g)
    kv = torch.randn(200, 576, generator=g)
    scales = {}
    if dtype == "fp8":
        (q, qs), (kv, ks) = fp8.quantize(q), fp8.quantize(kv)
        scales = {"q_scale": float(qs), "kv_scale": float(ks)}
    else:
        q, kv = q.bfloat16(), kv.bfloat16()
    kvs = list(torch.split(kv, [0, 70, 130]))
    return make_decode_batch(q, kvs, sm_scale=0.1352338, kv_lora_rank=512, page_size=16, generator=g, **scales)


def test_every_backend_reports_a_reason():
    status = backends.available()
    assert set(status) == NAMES
    for name, (ok, reason) in status.items():
        assert isinstance(ok, bool) and isinstance(reason, str) and len(reason) > 10, name
    assert status["ref"][0] and status["emulated"][0]


@pytest.fixture
def gpu_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_reasons_without_gpu(gpu_free, monkeypatch):
    monkeypatch.setattr(backends, "_has_module", lambda name: True)  # packages present, hardware missing
    status = backends.available()
    assert "TRITON_INTERPRET=1" in status["triton"][1] and not status["triton"][0]
    assert "needs a CUDA GPU" in status["flashinfer"][1] and "needs a CUDA GPU" in status["flashmla"][1]
    assert "needs ROCm" in status["aiter"][1]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.available()["triton"] == (True, backends._probe_triton()[1])
    assert "interpreter" in backends.available()["triton"][1]
    assert backends.get_backend("auto").name == "emulated"  # interpreter-only triton is not "best"


def test_reasons_for_missing_packages(gpu_free, monkeypatch):
    monkeypatch.setattr(backends, "_has_module", lambda name: False)
    status = backends.available()
    assert "flashinfer-python is not installed" in status["flashinfer"][1]
    assert "sgl-flash-mla is not installed" in status["flashmla"][1]
    assert "triton is not installed" in status["triton"][1]


def test_reasons_for_wrong_gpu(monkeypatch):
    monkeypatch.setattr(backends, "_has_module", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "A100")
    assert "needs sm_90 (Hopper); this GPU is sm_80" in backends.available()["flashinfer"][1]
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "CUDA-only" in backends.available()["flashmla"][1]
    assert "amd-aiter is not installed" in backends.available()["aiter"][1]


def test_get_backend_raises_with_the_reason():
    with pytest.raises(ValueError, match="expected one of"):
        backends.get_backend("flashattention")
    for name, (ok, reason) in backends.available().items():
        if not ok:
            with pytest.raises(ValueError) as info:
                backends.get_backend(name)
            assert reason in str(info.value)


@pytest.mark.parametrize("module", ["backends", "aiter_backend", "flashinfer_backend", "flashmla_backend"])
def test_peers_are_imported_only_inside_functions(module):
    """`import aiter` raises without ROCm and peers are slow to import: no module-level import of them."""
    path = Path(backends.__file__).with_name(f"{module}.py")
    peers = {"aiter", "flashinfer", "flash_mla"}
    for node in ast.parse(path.read_text()).body:  # module-level statements only
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not {n.split(".")[0] for n in names} & peers, f"{module}: module-level import of {names}"


def test_ref_backend_is_the_oracle():
    batch = _batch()
    out, lse = backends.get_backend("ref")(batch)
    ref_out, ref_lse = mla_decode_ref(batch)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_emulated_within_its_declared_bound(dtype):
    from verify.bounds import kernel_bound, merge_bound

    batch = _batch(dtype, seed=1)
    backend = backends.get_backend("emulated")
    out, lse = backend(batch)
    ref = mla_decode_ref(batch)
    splits = -(-int(batch.seq_lens.max()) // 64)
    bound = kernel_bound(batch, backend.numerics(batch), ref=ref) + merge_bound(batch, splits)
    seen = ~torch.isneginf(ref[1])
    assert bool(((out.double() - ref[0]).abs() <= bound.out).all())
    assert bool(((lse.double() - ref[1]).abs()[seen] <= bound.lse[seen]).all())
    assert torch.equal(torch.isneginf(lse), ~seen)


def test_declared_numerics_per_backend_and_dtype():
    bf16, fp8_batch = _batch("bf16"), _batch("fp8")
    fnuz = fp8_batch.replace(q=fp8_batch.q.float().to(torch.float8_e4m3fnuz))  # values <= 240 here: exact
    get = {name: b.numerics for name, b in backends.BACKENDS.items()}
    assert get["ref"](bf16).qk_operand == torch.float64 and get["emulated"](bf16).p_fmt is None
    assert get["flashinfer"](bf16).p_fmt == "bf16" and get["flashinfer"](fp8_batch).p_fmt == "bf16"
    assert get["flashmla"](bf16).p_fmt == "bf16" and get["flashmla"](fp8_batch).p_fmt == "e4m3fn"
    assert get["aiter"](bf16).p_fmt == "bf16" and get["aiter"](fnuz).p_fmt == "e4m3fnuz"
    assert get["triton"](fp8_batch).qk_operand == torch.float16  # the Triton kernel's fp8 MMAs run in fp16
