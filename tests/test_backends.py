"""mla_fast.backends: registry contents, honest availability reasons, auto, lazy peer imports, declared numerics;
the CPU-side parts of the peer adapters (FlashMLA's varlen padding, Unsupported inputs, FlashInfer's fp8 q).

Numerical tolerance (emulated backend): verify.bounds.kernel_bound with its declared KernelNumerics plus merge_bound
for the number of 64-token blocks of the longest request (the most splits its plan can make); ref is exact.
The adapter tests compare exactly: padding and power-of-two scalings move values without rounding them.
"""

import ast
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_fast import backends
from mla_fast.flashinfer_backend import flashinfer_inputs, split_q_scale
from mla_fast.flashmla_backend import flashmla_inputs, padded_rows
from mla_fast.numerics import KERNEL_NUMERICS
from mla_ref import fp8
from mla_ref.decode import make_decode_batch, mla_decode_ref
from verify.cases import Case

NAMES = {"ref", "emulated", "triton", "triton_invariant", "seesaw", "gluon_fp8", "aiter", "flashinfer", "flashmla"}


def _batch(dtype="bf16", seed=0, seq_lens=(0, 70, 130), q_lens=(1, 1, 1), kv_dtype=None, heads=16, page_size=16,
           fp8_format="e4m3fn"):
    """bf16, fp16, or fp8 q and KV of fp8_format (kv_dtype="bf16": fp8 q with a bf16 cache; dtype="fp8kv": bf16 q
    with an fp8 cache)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, 576, generator=g)
    kv = torch.randn(sum(seq_lens), 576, generator=g)
    wide = torch.float16 if dtype == "fp16" else torch.bfloat16
    scales = {}
    if dtype in ("fp8", "fp8kv") and kv_dtype != "bf16":
        kv, ks = fp8.quantize(kv, fp8_format)
        scales["kv_scale"] = float(ks)
    else:
        kv = kv.to(wide)
    if dtype == "fp8":
        q, qs = fp8.quantize(q, fp8_format)
        scales["q_scale"] = float(qs)
    else:
        q = q.to(wide)
    kvs = list(torch.split(kv, list(seq_lens)))
    return make_decode_batch(q, kvs, sm_scale=0.1352338, kv_lora_rank=512, page_size=page_size, generator=g,
                             q_lens=list(q_lens), **scales)


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
    assert "needs a CUDA GPU" in status["seesaw"][1] and "needs a CUDA GPU" in status["gluon_fp8"][1]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.available()["triton"] == (True, backends._probe_triton()[1])
    assert "interpreter" in backends.available()["triton"][1]
    for name in ("seesaw", "gluon_fp8"):  # Gluon kernels never run in the interpreter
        ok, reason = backends.available()[name]
        assert not ok and "interpreter cannot run it" in reason, (name, reason)
    assert backends.get_backend("auto").name == "emulated"  # interpreter-only triton is not "best"


def test_reasons_for_missing_packages(gpu_free, monkeypatch):
    monkeypatch.setattr(backends, "_has_module", lambda name: False)
    status = backends.available()
    assert "flashinfer-python is not installed" in status["flashinfer"][1]
    assert "sgl-flash-mla is not installed" in status["flashmla"][1]
    assert "triton is not installed" in status["triton"][1]
    assert "triton is not installed" in status["seesaw"][1] and "triton is not installed" in status["gluon_fp8"][1]


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


def test_emulated_takes_a_batch_of_no_requests():
    """As the oracle: empty outputs (the planner needs a request; found by a review)."""
    batch = _batch()
    none = batch.replace(q=batch.q[:0], seq_lens=batch.seq_lens[:0], q_lens=batch.q_lens[:0],
                         block_table=batch.block_table[:0])
    out, lse = backends.get_backend("emulated")(none)
    ref_out, ref_lse = mla_decode_ref(none)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and out.numel() == 0
    rows = none.replace(q=batch.q)  # no requests but q rows: a bad batch (it returned uninitialised rows)
    with pytest.raises(ValueError, match=r"DecodeBatch\.q_lens:"):
        backends.get_backend("emulated")(rows)


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
    assert get["flashinfer"](fp8_batch).scale_then_round and not get["flashinfer"](bf16).scale_then_round
    assert get["flashinfer"](bf16).partial_dtype == torch.bfloat16  # partial_o in its output dtype
    assert all(get[name](bf16).partial_dtype == torch.float32 for name in ("emulated", "flashmla", "aiter"))
    assert not get["flashmla"](fp8_batch).scale_then_round  # descale_q/_k multiply the fp32 scores
    assert get["flashmla"](bf16).p_fmt == "bf16" and get["flashmla"](fp8_batch).p_fmt == "e4m3fn"
    assert get["aiter"](bf16).p_fmt == "bf16" and get["aiter"](fnuz).p_fmt == "e4m3fnuz"


def test_declared_numerics_of_our_kernels(monkeypatch):
    """The seesaw rounds as the Triton kernel; the pinned Gluon fp8 kernel multiplies fp8 q's scores in fp8 MMAs;
    all keep fp32 partials. The Gluon kernels' device check is opened so that CPU batches they take get their
    declarations (on batches they do not take, their numerics refuse as their runners do: test_declared_numerics)."""
    pytest.importorskip("triton", reason="our kernels' dispatch needs triton (pip install triton==3.6.0)")
    from mla_fast import gluon_decode

    get = {name: b.numerics for name, b in backends.BACKENDS.items()}
    fp8_batch = _batch("fp8")
    triton_fp8 = get["triton"](fp8_batch)  # on this CPU: the Triton kernel, fp16 MMAs
    assert triton_fp8.qk_operand == torch.float16
    monkeypatch.setattr(gluon_decode, "device_reason", lambda batch, kernel: None)
    assert get["gluon_fp8"](fp8_batch).qk_operand == torch.float8_e4m3fn
    assert get["gluon_fp8"](fp8_batch).gamma_qk > triton_fp8.gamma_qk
    wide = {combo: _batch(combo, heads=128, page_size=64) for combo in ("bf16", "fp8kv")}  # the seesaw's rows
    for combo, batch in wide.items():
        assert get["seesaw"](batch) == KERNEL_NUMERICS[combo], combo  # the Triton kernel's declaration
    taken = [("triton", b) for b in (fp8_batch, *wide.values())] + [("gluon_fp8", fp8_batch)]
    taken += [("seesaw", b) for b in wide.values()]
    assert all(get[name](b).partial_dtype == torch.float32 for name, b in taken)


def test_only_the_invariant_backend_declares_batch_invariance_and_it_fixes_its_q_len():
    """triton_invariant declares batch invariance (the batch check then asks it for bits), the kernel geometry of
    invariant_config at q_len 4 and the merge of pieces of 1024 tokens; longer MTP rows are Unsupported, by name,
    from its run and from its graph-capturable step."""
    pytest.importorskip("triton", reason="our kernels' dispatch needs triton (pip install triton==3.6.0)")
    from mla_fast import triton_decode as td

    assert [n for n, b in backends.BACKENDS.items() if b.batch_invariant] == ["triton_invariant"]
    invariant = backends.BACKENDS["triton_invariant"]
    batch = _batch("fp8kv", seq_lens=(0, 70, 2049))
    assert invariant.numerics(batch) == td.kernel_numerics(td.invariant_config(batch, 4), "fp8kv")
    assert invariant.max_splits(batch) == 3  # 2049 tokens in pieces of 1024
    long_rows = _batch("bf16", q_lens=(5, 1, 1))
    for call in (lambda: invariant(long_rows), lambda: invariant.step(long_rows, 5)):
        with pytest.raises(backends.Unsupported, match="fixes its kernel geometry for q_len <= 4"):
            call()


def test_the_gpu_property_tests_leave_out_only_the_smoke_case_our_kernel_refuses():
    """tests/test_triton_gpu.py's property tests take the smoke prefix as examples less the cases our Triton backend
    refuses by name (triton_cases.smoke_prefix_our_kernels_take): the 72-row case alone, in order, and the backend
    does refuse it (its q_len check precedes any launch, so on a CPU too)."""
    pytest.importorskip("triton", reason="our kernels' dispatch needs triton (pip install triton==3.6.0)")
    from triton_cases import smoke_prefix_our_kernels_take

    from verify.strategies import smoke_cases

    for dtype in ("bf16", "fp8"):
        full, kept = smoke_cases(dtype), smoke_prefix_our_kernels_take(dtype)
        left_out = [c for c in full if c not in kept]
        assert [c for c in full if c in kept] == kept and [c.q_lens for c in left_out] == [(72, 1)], dtype
        with pytest.raises(backends.Unsupported, match="q_len must be <= 64"):
            backends.BACKENDS["triton"](left_out[0].materialize("cpu")[0])


@pytest.mark.parametrize("name,dtype,heads,page_size,reason", [
    ("seesaw", "bf16", 16, 64, "no seesaw geometry"),  # 16 rows: the Triton kernel's
    ("seesaw", "fp8kv", 32, 64, "no seesaw geometry"),  # fp8 caches: above 32 rows only
    ("gluon_fp8", "bf16", 16, 64, "no gluon_fp8 geometry"),  # bf16 caches: never
    ("seesaw", "bf16", 128, 8, "needs page_size % 64 == 0 or page_size in (16, 32)"),  # one TMA box a page
    ("gluon_fp8", "fp8", 16, 8, "needs page_size % 64 == 0 or page_size in (16, 32)"),  # one TMA box a page
    ("seesaw", "fp8kv", 128, 64, "runs on CUDA sm_90 outside the interpreter"),  # right geometry, CPU tensors
    ("gluon_fp8", "fp8kv", 64, 64, "runs on CUDA sm_90 outside the interpreter"),
])
def test_pinned_gluon_backends_say_why_they_cannot_take_a_batch(name, dtype, heads, page_size, reason):
    """The seesaw / gluon_fp8 backends raise Unsupported (counted by mla-verify, neither passed nor failed) where
    their kernel takes no such rows or cannot run the batch, with a reason free of the case's values (mla-verify
    groups cases by it)."""
    pytest.importorskip("triton")
    batch = _batch(dtype, heads=heads, page_size=page_size)
    with pytest.raises(backends.Unsupported) as info:
        backends.BACKENDS[name](batch)
    assert reason in str(info.value) and ", got" not in str(info.value), str(info.value)


# ---- FlashMLA adapter (CPU parts) ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaddingCase:
    """(q_len, s_k) per request: FlashMLA's padded grid of query rows (no tensors to draw, so no seed)."""

    requests: tuple[tuple[int, int], ...]


PADDING_CASES = st.builds(PaddingCase, st.lists(st.tuples(st.integers(1, 5), st.integers(0, 70)), min_size=1,
                                                max_size=6).map(tuple))


@given(PADDING_CASES)
def test_flashmla_padding_gives_each_row_the_contract_visibility(case):
    """Real rows at the end of each request's slot of the [B, s_q_max] grid: FlashMLA's causal rule (grid row p sees
    s_k - s_q_max + p + 1 tokens) gives row r of a request with q_len n the contract's s_k - n + r + 1."""
    requests = case.requests
    q_lens = torch.tensor([n for n, _ in requests], dtype=torch.int32)
    index, s_q = padded_rows(q_lens)
    assert s_q == max(n for n, _ in requests) and index.dtype == torch.int64
    assert len(set(index.tolist())) == index.numel() == int(q_lens.sum())  # one grid row per real row
    t = 0
    for b, (n, s_k) in enumerate(requests):
        for r in range(n):
            slot, p = divmod(int(index[t]), s_q)
            assert slot == b and max(0, s_k - s_q + p + 1) == max(0, s_k - n + r + 1)
            t += 1


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_flashmla_varlen_grid_matches_the_oracle(dtype):
    """The padded q grid, run through FlashMLA's rule (the oracle with uniform q_len = s_q_max on the repaged cache),
    gives the oracle's result on the real rows: the padding changes nothing for them. Bit for bit, because the
    fp64 scores are exact sums in any order: bf16 and fp8 elements have at most 8 significant bits, and the fp8
    scales are set to powers of two here (with the quantizer's float32 scales a product has up to 56 bits, so the
    oracle's scores hung on its BLAS summation order, which differs between 4 padded rows and the real ones at 2
    torch threads: the fp8 case failed in CI, sixty-sixth session)."""
    batch = _batch(dtype, seq_lens=(1, 70, 130, 3), q_lens=(2, 1, 3, 4))
    if dtype == "fp8":  # the nearest powers of two: dequantized elements keep the codes' 4 significant bits
        batch = batch.replace(q_scale=2.0 ** round(math.log2(batch.q_scale)),
                              kv_scale=2.0 ** round(math.log2(batch.kv_scale)))
    a = flashmla_inputs(batch)
    B, s_q, H, D = a["q"].shape
    assert (B, s_q, H, D) == (4, 4, 16, 576) and a["causal"] and a["k_cache"].shape[1:] == (64, 1, 576)
    grid = a["q"].reshape(B * s_q, H, D).view(torch.uint8)  # [B * s_q, H, D * itemsize]
    assert torch.equal(grid[a["rows"]], batch.q.view(torch.uint8))
    dummy = torch.ones(B * s_q, dtype=torch.bool)
    dummy[a["rows"]] = False
    assert not bool(grid[dummy].any())  # zero rows in front
    padded = batch.replace(q=a["q"].reshape(B * s_q, H, D), kv_cache=a["k_cache"][:, :, 0],
                           block_table=a["block_table"], q_lens=torch.full_like(batch.q_lens, s_q))
    out, lse = mla_decode_ref(padded)  # [B * s_q, H, L], [B * s_q, H]
    ref_out, ref_lse = mla_decode_ref(batch)
    assert torch.equal(out[a["rows"]], ref_out) and torch.equal(lse[a["rows"]], ref_lse)


def test_flashmla_unsupported_inputs_say_why():
    assert issubclass(backends.Unsupported, ValueError)
    with pytest.raises(backends.Unsupported, match="fp8 x fp8"):
        flashmla_inputs(_batch("fp8kv", seq_lens=(5, 70, 130)))  # bf16 q, fp8 cache
    with pytest.raises(backends.Unsupported, match="seq_len 0"):
        flashmla_inputs(_batch("fp8"))  # request 0 is empty: the fp8 kernel would read block_table[0][-1]
    assert flashmla_inputs(_batch("fp8", kv_dtype="bf16"))["descale"] is None  # fp8 q, bf16 cache: the bf16 kernel
    minicpm3 = Case(seq_lens=(5, 70), q_lens=(1, 1), kv_lora_rank=256, rope_dim=32, heads=4).materialize()[0]
    with pytest.raises(backends.Unsupported, match="kv_lora_rank 512 and rope_dim 64 only"):
        flashmla_inputs(minicpm3)  # its kernels are built for heads of 576 / 512


def test_flashinfer_refuses_other_latent_and_rope_sizes():
    """Measured on an H200 (fifty-seventh session): FlashInfer 0.6.14's bf16 FA3 MLA at a latent of 256 and a rope
    of 32 returned wrong rows, then faulted; its fp8 path raised. The adapter refuses them by name."""
    for dtype in ("bf16", "fp8"):
        minicpm3 = Case(seq_lens=(5, 70), q_lens=(1, 1), kv_lora_rank=256, rope_dim=32, heads=4, kv_dtype=dtype,
                        q_dtype=dtype).materialize()[0]
        with pytest.raises(backends.Unsupported, match="kv_lora_rank 512 and rope_dim 64 only"):
            flashinfer_inputs(minicpm3)


def test_every_smoke_case_gets_each_peer_adapters_arguments_or_a_named_refusal():
    """A peer adapter meets every input the campaigns start with (the smoke prefix: fp16, the other e4m3 format, an
    e5m2 cache, MiniCPM3's shape, 260 requests) with its kernel's arguments, or with `Unsupported`, which the
    verifier counts as an input the kernel lacks. Any other error counts as a failed contract: on an H200 FlashInfer's
    adapter met the e5m2 case with a plain ValueError (sixty-second session). aiter as `_run_aiter` does: its
    refusal, then its inputs in either arch's fp8 format."""
    from mla_fast.aiter_backend import aiter_inputs, aiter_refusal
    from verify.strategies import smoke_cases

    def aiter_arguments(batch, fp8_dtype):
        if reason := aiter_refusal(batch):
            raise backends.Unsupported(reason)
        return aiter_inputs(batch, fp8_dtype=fp8_dtype)

    adapters = {"flashinfer": flashinfer_inputs, "flashmla": flashmla_inputs,
                "aiter gfx942": lambda b: aiter_arguments(b, torch.float8_e4m3fnuz),
                "aiter gfx950": lambda b: aiter_arguments(b, torch.float8_e4m3fn)}
    refused = {name: set() for name in adapters}
    for dtype in ("bf16", "fp8"):
        for case in smoke_cases(dtype):
            batch = case.materialize()[0]
            for name, adapter in adapters.items():
                try:
                    adapter(batch)
                except backends.Unsupported:
                    refused[name].add(str(batch.kv_cache.dtype))
                except ValueError as e:
                    pytest.fail(f"{name} on {case.describe()}: {type(e).__name__}: {e}")
    assert all("torch.float8_e5m2" in r for r in refused.values()), refused  # the case this test was written for


def test_aiter_refuses_an_e5m2_cache_by_name():
    """aiter's MLA kernels read e4m3 only (e4m3fnuz on gfx942, e4m3fn on gfx950; the adapter converts between the
    two). An e5m2 cache (vLLM's fp8_e5m2) with one query length for all requests, which aiter's scope otherwise
    takes, is refused by `aiter_refusal`, naming the field; before, the conversion raised a plain ValueError."""
    from mla_fast.aiter_backend import aiter_refusal

    e5m2 = Case(seq_lens=(300, 65, 0), q_lens=(1, 1, 1), heads=16, page_size=16, fp8_format="e5m2", q_dtype="bf16",
                kv_dtype="fp8").materialize()[0]
    assert e5m2.kv_cache.dtype == torch.float8_e5m2
    assert aiter_refusal(e5m2) == "aiter.kv_cache: expected bf16 or fp8 e4m3 (aiter's MLA kernels take no other)"
    assert aiter_refusal(_batch("fp8kv", q_lens=(1, 1, 1))) is None  # an e4m3fn cache with bf16 q is in scope


# ---- FlashInfer adapter (CPU parts) -------------------------------------------------------------------------------


def test_flashinfer_refuses_an_e5m2_cache_and_a_q_of_another_dtype_by_name():
    """Found on an H200 (sixty-second session): the smoke prefix's e5m2 case (vLLM's fp8_e5m2 cache, bf16 q) made
    FlashInfer's adapter raise a plain ValueError, which the verifier counts as a failed contract, not an input the
    kernel lacks. FlashInfer has kernels for bf16, fp16 and e4m3fn caches only, with q in bf16 beside an fp8 cache:
    the adapter now refuses the others with Unsupported, naming the field."""
    e5m2 = Case(seq_lens=(300, 65, 0), q_lens=(2, 1, 1), heads=8, page_size=16, fp8_format="e5m2", q_dtype="bf16",
                kv_dtype="fp8").materialize()[0]
    assert e5m2.kv_cache.dtype == torch.float8_e5m2
    with pytest.raises(backends.Unsupported, match="flashinfer.kv_cache: expected bf16, fp16 or fp8 e4m3fn"):
        flashinfer_inputs(e5m2)
    fp16_q = _batch("bf16")
    fp16_q = replace(fp16_q, q=fp16_q.q.half())
    with pytest.raises(backends.Unsupported, match="flashinfer.q: expected torch.bfloat16"):
        flashinfer_inputs(fp16_q)


def test_flashinfer_fp8_q_keeps_raw_logits_at_scale():
    """fp8 q goes in as q8 * 2^k (exact) with q_scale / 2^k in sm_scale: same scores, and sm_scale stays near σ, so
    FlashInfer's mask value -5e4 (a finite "-inf" in raw logits) keeps a weight exp(-5e4 σ') below fp32's smallest
    subnormal 2^-149 = e^-103.3 instead of leaking into masked slots."""
    batch = _batch("fp8", seq_lens=(5, 70, 130))
    q, rest = split_q_scale(batch.q, batch.q_scale, torch.bfloat16)
    assert q.dtype == torch.bfloat16 and 2**-0.5 <= rest <= 2**0.5
    k = round(math.log2(batch.q_scale / rest))
    assert batch.q_scale / rest == 2.0**k and torch.equal(q.double(), batch.q.double() * 2.0**k)  # exact
    a = flashinfer_inputs(batch)
    assert a["sm_scale"] == batch.sm_scale * rest and torch.equal(a["q_nope"], q[..., :512])
    assert a["sm_scale"] * 5e4 > 149 * math.log(2)


def test_each_backend_declares_the_most_pieces_it_cuts_a_row_into():
    """verify's merge bound charges Kernel.max_splits pieces: FlashInfer's MLA plan cuts rows into pieces of at least
    32 tokens (kv_len_limit), aiter into kv_granularity blocks of max(page_size, 16), our planner and FlashMLA into
    64-token blocks (the default)."""
    from verify.kernels import Kernel, from_backend

    for page_size, longest in ((16, 130), (64, 130), (1, 4097)):
        batch = _batch(seq_lens=(0, 70, longest), page_size=page_size)
        assert backends.BACKENDS["flashinfer"].max_splits(batch) == -(-longest // 32)
        assert backends.BACKENDS["aiter"].max_splits(batch) == -(-longest // max(page_size, 16))
        assert from_backend("emulated").max_splits(batch) == Kernel.max_splits(batch) == -(-longest // 64)
    assert backends.most_pieces(_batch(seq_lens=(0,), q_lens=(1,)), 64) == 1  # nothing to cut: one piece


def test_flashinfer_declines_requests_shorter_than_their_query_rows_above_32_heads(monkeypatch):
    """FlashInfer 0.6.14 returns wrong rows for a non-empty request with more query rows than tokens at some head
    counts above 32 (measured on an H200; tests/test_peers_gpu.py keeps showing it), and right ones for empty
    requests at every head count: its backend raises Unsupported for a batch with such a non-empty request above 32
    heads, and hands every other batch to the adapter. The check precedes the adapter, so it runs here without
    FlashInfer."""
    from mla_fast import flashinfer_backend
    from mla_fast.backends import BACKENDS, FLASHINFER_SHORT, Unsupported
    from verify.cases import Case

    monkeypatch.setattr(flashinfer_backend, "flashinfer_decode", lambda batch: "adapter")
    run = BACKENDS["flashinfer"].run
    for heads, seq_lens, q_lens, declined in ((33, (1, 5), (2, 1), True), (128, (0, 2, 5), (1, 3, 1), True),
                                              (40, (0, 5), (1, 1), False), (64, (0, 5), (2, 1), False),
                                              (32, (1, 5), (2, 1), False), (40, (2, 5), (2, 1), False),
                                              (128, (4, 5), (4, 1), False), (128, (0,), (1,), False)):
        batch, _ = Case(seq_lens=seq_lens, q_lens=q_lens, heads=heads).materialize()
        if declined:
            with pytest.raises(Unsupported, match="non-empty request with more query rows than KV tokens at more"):
                run(batch)
        else:
            assert run(batch) == "adapter", (heads, seq_lens, q_lens)
    assert "FlashInfer 0.6.14 returns wrong rows" in FLASHINFER_SHORT


class _FakeMLAWrapper:
    """Stands in for flashinfer.mla.BatchMLAPagedAttentionWrapper: records its construction (every instance in
    `made`, its backend, graph mode and buffers), plan() calls (`plans`, the last one `plan_args`) and run() calls
    (`runs`, the last one's tensors and keywords)."""

    made = []

    def __init__(self, workspace, use_cuda_graph=False, backend="auto", **buffers):
        self.backend, self.use_cuda_graph, self.buffers, self.plans, self.runs = backend, use_cuda_graph, buffers, [], 0
        self.run_tensors = self.run_kw = None
        _FakeMLAWrapper.made.append(self)

    @property
    def plan_args(self):
        return self.plans[-1] if self.plans else None

    def plan(self, *args):
        self.plans.append(args)

    def run(self, q_nope, q_pe, ckv, kpe, out=None, lse=None, **kw):
        self.runs += 1
        self.run_tensors, self.run_kw = (q_nope, q_pe, ckv, kpe), kw
        return out, lse


def test_flashinfers_graph_step_sizes_its_buffers_once_and_refuses_what_it_cannot_replay(monkeypatch):
    """FlashInferStep (the flashinfer backend's step): the wrapper in CUDA-graph mode with buffers sized for the
    batch size and the block table's capacity, preallocated out / lse returned by every run(); plan() on the step's
    own batch only, again for each step; refused by name: fp8 q (converted per call) and FLASHINFER_SHORT batches.
    The GPU run: tests/test_peers_gpu.py."""
    import sys
    import types

    from mla_fast.backends import BACKENDS, FLASHINFER_SHORT, Unsupported
    from verify.cases import Case
    from verify.next_step import next_layout, with_room

    fake = types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_FakeMLAWrapper))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    batch, first_spare = with_room(Case(seq_lens=(70, 0, 5), q_lens=(1, 1, 1), heads=4, page_size=16).materialize()[0])
    step = BACKENDS["flashinfer"].step(batch, 1)
    sizes = {name: tuple(buf.shape) for name, buf in step.wrapper.buffers.items()}
    assert step.wrapper.use_cuda_graph and sizes == {"qo_indptr": (4,), "kv_indptr": (4,), "kv_len_arr": (3,),
                                                     "kv_indices": (batch.block_table.numel(),)}
    with pytest.raises(RuntimeError, match="before plan"):
        step.run()
    step.plan(batch)
    assert step.run()[0] is step.out and step.run()[1] is step.lse and step.wrapper.runs == 2
    with pytest.raises(ValueError, match="the step's own"):
        step.plan(batch.replace(seq_lens=batch.seq_lens.clone()))
    next_layout(batch, first_spare)  # the next step, in the same tensors: planned again
    step.plan(batch)
    assert len(step.wrapper.plans) == 2 and step.wrapper.plans[1][3].tolist() == [157, 35, 0]  # kv_len_arr: 2 x 70 + 17
    fp8, _ = Case(seq_lens=(70,), q_lens=(1,), heads=4, q_dtype="fp8", kv_dtype="fp8").materialize()
    with pytest.raises(Unsupported, match="fp8 q"):
        BACKENDS["flashinfer"].step(fp8, 1)
    short, _ = Case(seq_lens=(1, 5), q_lens=(2, 1), heads=40).materialize()
    with pytest.raises(Unsupported, match=FLASHINFER_SHORT[:40]):
        BACKENDS["flashinfer"].step(short, 2).plan(short)


class _FakeFlashMLA:
    """Stands in for flash_mla: a scheduler whose metadata is the lengths (its call recorded as `metadata_call`), and
    a decode (its tile-scheduler metadata, block table and keywords recorded as `meta`, `block_table` and `kw`) whose
    out is q's first L channels and whose lse is +inf (FlashMLA's lonely-q value) on every row, or with
    positional_lse a value naming its position, lse[b, h, s] = 1000 b + 10 h + s."""

    class Meta:
        tile_scheduler_metadata = num_splits = None

    def __init__(self, positional_lse=False):
        self.positional_lse = positional_lse

    def get_mla_metadata(self):
        return self.Meta(), None

    def get_mla_decoding_metadata(self, seqlens, tokens_per_head, h_k, is_fp8_kvcache=False, use_legacy=False):
        self.metadata_call = (seqlens.clone(), tokens_per_head, h_k, is_fp8_kvcache, use_legacy)
        return seqlens.clone().view(-1, 1), torch.cat([seqlens.new_zeros(1), seqlens.cumsum(0).int()])

    def flash_mla_with_kvcache(self, q, k_cache, block_table, seqlens, head_dim_v, meta, num_splits, **kw):
        self.meta, self.block_table, self.kw = meta.tile_scheduler_metadata, block_table.clone(), kw
        B, s_q, H, _ = q.shape
        if not self.positional_lse:
            return q[..., :head_dim_v].clone(), torch.full((B, H, s_q), math.inf)
        b, h, s = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(s_q), indexing="ij")
        return q[..., :head_dim_v].clone(), (1000 * b + 10 * h + s).float()


def test_flashmla_decode_gathers_the_real_rows_in_order_and_empty_rows_as_neg_inf(monkeypatch):
    """flashmla_decode through the fake (its decode echoes q, lse +inf everywhere): every q row comes back from its
    slot of the padded [B * s_q] grid, on pages of 64 and repaged from 16, and only rows that see no token get -inf
    (the others keep the fake's +inf). The GPU run: tests/test_peers_gpu.py."""
    import sys

    from mla_fast.flashmla_backend import flashmla_decode
    from verify.cases import Case

    monkeypatch.setitem(sys.modules, "flash_mla", _FakeFlashMLA())
    for page_size in (64, 16):
        batch = Case(seq_lens=(70, 0, 5), q_lens=(2, 1, 3), heads=4, page_size=page_size).materialize()[0]
        out, lse = flashmla_decode(batch)
        empty = (batch.visible_tokens() == 0)[:, None].expand_as(lse)  # [T, H]
        assert torch.equal(out, batch.q[..., :512]) and empty.any() and not empty.all()
        assert torch.equal(torch.isneginf(lse), empty) and bool(torch.isposinf(lse[~empty]).all())


def test_flashmlas_graph_step_replans_into_its_own_metadata_and_keeps_the_row_layout(monkeypatch):
    """FlashMLAStep (the flashmla backend's step): the query rows go to the end of their request's slot of the
    [B * s_q] grid and come back in order (the fake decode echoes q), empty rows' +inf lse becomes -inf, and each
    plan() copies the scheduler's metadata into the same tensors (a captured graph reads them); refused by name: other
    page sizes, fp8 q on a bf16 cache, bf16 q on an fp8 cache. The GPU run: tests/test_peers_gpu.py."""
    import sys

    from mla_fast.backends import BACKENDS, Unsupported
    from verify.cases import Case
    from verify.next_step import next_layout, next_values, with_room

    fake = _FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    batch, first_spare = with_room(Case(seq_lens=(70, 0, 5), q_lens=(2, 1, 3), heads=4, page_size=64).materialize()[0])
    step = BACKENDS["flashmla"].step(batch, 4)  # a grid of 4 rows per request, one more than any q_len
    step.plan(batch)
    first_meta = step.meta.tile_scheduler_metadata
    out, lse = step.run()
    assert torch.equal(out, batch.q[..., :512]) and fake.kw["causal"] and fake.kw["use_legacy"]
    assert torch.equal(torch.isneginf(lse), (batch.visible_tokens() == 0)[:, None].expand_as(lse))
    next_layout(batch, first_spare)
    step.plan(batch)
    # the grown request: 2 x 70 + 65 tokens
    assert step.meta.tile_scheduler_metadata is first_meta and first_meta.view(-1).tolist() == [205, 35, 0]
    next_values(batch, torch.zeros(batch.kv_cache.shape[:2], dtype=torch.bool))  # q negated after the plan
    out, lse = step.run()
    assert torch.equal(out, batch.q[..., :512]) and fake.meta is first_meta
    assert torch.equal(torch.isneginf(lse), (batch.visible_tokens() == 0)[:, None].expand_as(lse))
    bf16, _ = Case(seq_lens=(70,), q_lens=(1,), heads=4, page_size=64).materialize()
    fp8_q = bf16.replace(q=bf16.q.float().to(torch.float8_e4m3fn), q_scale=1.0)
    for other, words in ((Case(seq_lens=(70,), q_lens=(1,), heads=4, page_size=16).materialize()[0],
                          "pages of 64 only"), (fp8_q, "fp8 q on a 16-bit cache"),
                         (Case(seq_lens=(70,), q_lens=(1,), heads=4, page_size=64, kv_dtype="fp8").materialize()[0],
                          "bf16 q with an fp8 cache")):
        with pytest.raises(Unsupported, match=words):
            BACKENDS["flashmla"].step(other, 1)
