"""Registry of MLA decode backends: name -> `Backend`, a callable `(batch) -> (out [T, H, L], lse [T, H])`.

Every backend follows the contract of `mla_ref.decode`: natural-log LSE including sm_scale, a row that sees no token
gives out 0 / lse -inf, fp8 inputs carry per-tensor scales. Each one also declares how it rounds (`numerics(batch)`,
a `KernelNumerics` read by verify's kernel bound, numerics.md §5(f)).

| name       | what runs                                               | needs                                    |
|------------|---------------------------------------------------------|------------------------------------------|
| ref        | `mla_decode_ref`, fp64 oracle                           | nothing                                  |
| emulated   | `plan_decode` + `run_plan_reference` in fp32, bf16 out  | nothing                                  |
| triton     | mla_fast's persistent split-KV Triton kernel (Gluon     | a GPU, or TRITON_INTERPRET=1 (CPU, slow) |
|            | seesaw kernel for bf16 above 16 rows on sm_90, Gluon    |                                          |
|            | fp8 kernel for fp8 caches at <= 2 programs of 16 rows,  |                                          |
|            | or more under its programs x cache tokens rule,         |                                          |
|            | seesaw kernel for other fp8 caches at 64 rows)          |                                          |
| seesaw     | `triton` with the Gluon seesaw kernel pinned (bf16 >16  | CUDA sm_90 (no interpreter)              |
|            | rows, fp8 caches >32 rows; else Unsupported)            |                                          |
| gluon_fp8  | `triton` with the Gluon fp8 kernel pinned (fp8 caches,  | CUDA sm_90 (no interpreter)              |
|            | q_len <= 4; else Unsupported)                           |                                          |
| triton_invariant | `triton_decode.decode_invariant`: batch-invariant | a GPU, or TRITON_INTERPRET=1 (CPU, slow) |
|            | (fixed splits and geometry, q_len <= 4), declared so    |                                          |
| aiter      | ROCm/aiter persistent MLA (`mla_fast.aiter_backend`)    | ROCm, amd-aiter, gfx942/gfx950           |
| flashinfer | FlashInfer `BatchMLAPagedAttentionWrapper`, FA3         | CUDA sm_90, flashinfer-python            |
| flashmla   | FlashMLA dense decode (sgl-flash-mla legacy SM90)       | CUDA sm_90, sgl-flash-mla                |

`triton` dispatches by `default_config`, so the verifier's small batches mostly run the Triton kernel (or the Gluon
fp8 kernel); `seesaw` and `gluon_fp8` pin one Gluon kernel in `default_config`'s geometry for it
(`triton_decode.forced_config`), so that campaigns reach it on every batch it can take.

`available()` says for each whether it can run here and, if not, why; `get_backend("auto")` picks the first runnable
of `AUTO_ORDER`. Peer packages are imported only when a backend runs, never when this module is imported.

A backend that runs here may still lack a kernel for some inputs (FlashMLA: bf16 q with an fp8 cache): it then raises
`Unsupported` with the reason, which the verifier counts as "unsupported", neither passed nor failed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mla_fast.numerics import (
    FP32_CHOPPED,
    FP32_EPILOGUE,
    HOPPER_PV_PER_TOKEN,
    PV_PER_TILE,
    KernelNumerics,
    fp32_score_gamma,
)
from mla_ref.decode import DecodeBatch, is_fp8

AUTO_ORDER = ("triton", "flashmla", "flashinfer", "aiter", "emulated")  # "auto": our kernel first, ref never


class Unsupported(ValueError):
    """Raised by a backend or a plug-in for an input its kernel cannot run (an input outside the kernel's contract,
    not a wrong result). The message is the reason, without case-specific values: mla-verify groups cases by it."""


def most_pieces(batch: DecodeBatch, piece_tokens: int) -> int:
    """ceil(max seq_len / piece_tokens), at least 1: the most pieces a kernel whose pieces hold at least
    piece_tokens tokens (but a row's last) can cut a row of this batch into. One host sync."""
    longest = int(batch.seq_lens.max()) if batch.batch_size else 0
    return max(1, -(-longest // piece_tokens))


def blocks_of_64(batch: DecodeBatch) -> int:
    """`most_pieces` of 64 tokens: our planner's blocks, FlashMLA's, and what a plug-in is assumed to cut at."""
    return most_pieces(batch, 64)


@dataclass(frozen=True)
class Backend:
    """One decode implementation.

    Attributes:
        name: registry key.
        summary: one line for tables and error messages.
        run: (batch) -> (out [T, H, L], lse [T, H] fp32 natural log).
        probe: () -> (ok, reason): whether it can run in this process, and why not.
        numerics: (batch) -> KernelNumerics declared for that batch's dtypes.
        run_workers: (batch, num_workers) -> (out, lse) with the KV split over that many persistent workers, for the
            backends that run our planner's plans (emulated, triton, seesaw, gluon_fp8; the same checks and
            Unsupported reasons as run); None for the others. The verifier's split-invariance check calls it.
        nan_deviation: how the backend breaks the NaN convention (a NaN input gives NaN out and lse in the rows
            that read it), as measured; "" when it keeps it. The verifier then reports the deviation and skips its
            nan check for this backend instead of failing every case on a known peer behaviour.
        max_splits: (batch) -> the most pieces it cuts any row into (verify's merge bound charges that many); by
            default `blocks_of_64`.
        deterministic: two runs on the same batch (and worker count) give the same bits, as measured (aiter:
            assumed, never run here); verify's repeat check asks for them when True, else for its tier-1 bound.
        step: (batch, max_q_len) -> a CUDA-graph-capturable step (plan(batch) eagerly, run() launches only; verify's
            plug-in contract), for our kernels (`TritonMLADecode`), FlashInfer (its wrapper in CUDA-graph mode) and
            FlashMLA (its scheduler's metadata replanned into the step's tensors); None for the others. verify's
            step check drives it as a serving loop does.
        batch_invariant: a request's rows keep their bits whatever else its batch holds (`triton_invariant`);
            verify's batch check then asks for them, else for its tier-1 bound.
    """

    name: str
    summary: str
    run: Callable[[DecodeBatch], tuple[torch.Tensor, torch.Tensor]]
    probe: Callable[[], tuple[bool, str]]
    numerics: Callable[[DecodeBatch], KernelNumerics]
    run_workers: Callable[[DecodeBatch, int], tuple[torch.Tensor, torch.Tensor]] | None = None
    nan_deviation: str = ""
    max_splits: Callable[[DecodeBatch], int] = blocks_of_64
    deterministic: bool = True
    step: Callable[[DecodeBatch, int], object] | None = None
    batch_invariant: bool = False

    def __call__(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run(batch)


# ---- declared numerics -------------------------------------------------------------------------------------------
_FP8_MMA = 1.0e-2  # Hopper fp8 MMA chain, max |err| / Σ|ab| at K = 576, same sign, no fp32 promotion (numerics.md §4.2)
_FP8_PV_PER_TOKEN = 7.6e-2 / 4096  # the same at K = 4096 (7.6e-2), per term: an fp8 P.V chain over the tokens


def _hopper_16bit(dtype: torch.dtype) -> KernelNumerics:
    """16-bit MMAs with fp32 accumulation into the running output, P rounded to the operand dtype, 64-token KV tiles
    (FA3, FlashMLA): charged as mla_fast.numerics charges its own kernel (point 5 there)."""
    return KernelNumerics(
        p_fmt="bf16" if dtype == torch.bfloat16 else "fp16",
        p_scale=1.0,
        qk_operand=dtype,
        pv_operand=dtype,
        gamma_qk=fp32_score_gamma(),  # DeepSeek's L + R: the peers refuse other widths
        gamma_pv=FP32_EPILOGUE,
        gamma_pv_per_token=HOPPER_PV_PER_TOKEN + PV_PER_TILE / 64,  # MMA into C, then per 64-token tile
        out_dtype=dtype,
    )


def _fp8_mma(p_fmt: str, operand: torch.dtype) -> KernelNumerics:
    """fp8 QK and PV MMAs with P rounded to fp8 without a scale (FlashMLA PR #54 dense fp8, aiter a8w8)."""
    return KernelNumerics(
        p_fmt=p_fmt,
        p_scale=1.0,
        qk_operand=operand,
        pv_operand=operand,
        gamma_qk=_FP8_MMA,
        gamma_pv=FP32_EPILOGUE,
        gamma_pv_per_token=_FP8_PV_PER_TOKEN + PV_PER_TILE / 64,
        out_dtype=torch.bfloat16,
    )


def _ref_numerics(batch: DecodeBatch) -> KernelNumerics:
    return KernelNumerics(None, 1.0, torch.float64, torch.float64, 0.0, 0.0, out_dtype=torch.float64)


def _emulated_numerics(batch: DecodeBatch) -> KernelNumerics:
    # torch fp32 matmuls (round-to-nearest, pairwise or blocked): charged like a chopped fp32 sum, fp32 P; per token
    # a chopped fp32 add and rescale
    return KernelNumerics(None, 1.0, torch.float32, torch.float32, fp32_score_gamma(batch.head_dim),
                          FP32_EPILOGUE, gamma_pv_per_token=2 * FP32_CHOPPED)


def _combo(batch: DecodeBatch) -> str:
    """Our kernels' dtype combination for the batch (`dtype_combo`), Unsupported where they take none here (fp16,
    an e5m2 cache; e4m3fnuz off ROCm: `dtypes_unsupported`)."""
    from mla_fast import triton_decode as td

    if reason := td.dtypes_unsupported(batch):
        raise Unsupported(reason)
    return td.dtype_combo(batch.q.dtype, batch.kv_cache.dtype)


def _q_len(batch: DecodeBatch, max_q_len: int | None = None) -> int:
    """max_q_len, else the batch's largest q_len (one host sync); Unsupported past the rows our kernels pack
    (`q_len_unsupported`: more than 64)."""
    from mla_fast import triton_decode as td

    q_len = td._max_q_len(batch) if max_q_len is None else max_q_len
    if reason := td.q_len_unsupported(q_len):
        raise Unsupported(reason.split(", got")[0])
    return q_len


def _triton_numerics(batch: DecodeBatch) -> KernelNumerics:
    """The rounding points of the kernel `decode` dispatches the batch to (`batch_config` on its device; one host
    sync for its q_len): on an H100/H200 the Gluon fp8 kernel's fp8 score MMAs for e4m3fn q where it takes the batch,
    else the Triton kernel's (`KERNEL_NUMERICS`, which the other Gluon paths share)."""
    from mla_fast import triton_decode as td

    combo = _combo(batch)
    return td.kernel_numerics(td.batch_config(batch, _q_len(batch)), combo, batch.head_dim)


def _forced_numerics(kernel: str) -> Callable[[DecodeBatch], KernelNumerics]:
    """The numerics of `_run_forced(kernel)`'s config (`_pinned`): Unsupported where that runner refuses the batch,
    as the run would (a plug-in's numerics may refuse, verify.checks.run_case), so that no declaration is asked of a
    kernel that does not take the batch (the Gluon fp8 kernel's fp8 score MMAs at L + R other than 576 raised)."""

    def numerics(batch: DecodeBatch) -> KernelNumerics:
        from mla_fast.triton_decode import kernel_numerics

        return kernel_numerics(_pinned(batch, kernel, _q_len(batch)), _combo(batch), batch.head_dim)

    return numerics


def _flashinfer_numerics(batch: DecodeBatch) -> KernelNumerics:
    # fp8 KV is staged to bf16 in shared memory as bf16(code * bf16(kv_scale)) before bf16 MMAs (q is bf16): the
    # 16-bit rounding points, plus one bf16 rounding of every K and V element whose product is inexact. Split
    # outputs are stored in the output dtype (mla_hopper.cuh write_o: `DTypeO* partial_o`, o_frag cast to DTypeO;
    # their lse in fp32) before its merge kernel
    numerics = _hopper_16bit(torch.float16 if batch.kv_cache.dtype == torch.float16 else torch.bfloat16)
    return dataclasses.replace(numerics, scale_then_round=is_fp8(batch.kv_cache.dtype),
                               partial_dtype=numerics.out_dtype)


def _flashmla_numerics(batch: DecodeBatch) -> KernelNumerics:
    if is_fp8(batch.kv_cache.dtype):
        return _fp8_mma("e4m3fn", torch.float8_e4m3fn)
    return _hopper_16bit(torch.float16 if batch.kv_cache.dtype == torch.float16 else torch.bfloat16)


def _aiter_numerics(batch: DecodeBatch) -> KernelNumerics:
    # declared from aiter's reference (aiter-contract.md §7-§8), not measured: a8w8 rounds exp(s - m) to the arch's
    # fp8 before the PV MFMA; bf16 and a16w8 (fp8 KV converted to bf16, exact) use bf16 P
    if is_fp8(batch.q.dtype):
        fmt = "e4m3fnuz" if batch.q.dtype == torch.float8_e4m3fnuz else "e4m3fn"
        return _fp8_mma(fmt, batch.q.dtype)
    return _hopper_16bit(torch.bfloat16)


# ---- runners -----------------------------------------------------------------------------------------------------
def _run_ref(batch: DecodeBatch):
    from mla_ref.decode import mla_decode_ref

    return mla_decode_ref(batch)


def _run_emulated(batch: DecodeBatch, num_workers: int = 4):  # 4 by default: small batches still split
    from mla_fast.emulate import run_plan_reference
    from mla_fast.planner import plan_decode

    plan = plan_decode(batch.seq_lens, batch.q_lens, batch.num_heads, num_workers=num_workers)
    out, lse = run_plan_reference(batch, plan, torch.float32)
    return out.to(torch.bfloat16), lse


def _run_triton(batch: DecodeBatch, num_workers: int | None = None):
    from mla_fast.triton_decode import decode, dtypes_unsupported

    if reason := dtypes_unsupported(batch):  # a format this platform's Triton cannot compile: no case to check
        raise Unsupported(reason)
    _q_len(batch)
    return decode(batch, num_workers=num_workers)


def _step_triton(batch: DecodeBatch, max_q_len: int):
    """Our graph-capturable step (`TritonMLADecode`, its default config for the batch) up to max_q_len."""
    from mla_fast.triton_decode import TritonMLADecode, dtypes_unsupported

    if reason := dtypes_unsupported(batch):
        raise Unsupported(reason)
    return TritonMLADecode(batch, max_q_len=_q_len(batch, max_q_len))


def _pinned(batch: DecodeBatch, kernel: str, q_len: int):
    """`forced_config` of the Gluon kernel ``kernel`` for the batch at q_len; Unsupported where that kernel takes no
    such rows or cannot run the batch (reasons without the case's values)."""
    from mla_fast import triton_decode as td

    config = td.forced_config(_combo(batch), batch.num_heads, q_len, kernel)  # _combo: Unsupported dtypes
    if config is None:
        raise Unsupported(f"default_config has no {kernel} geometry for these dtypes, heads and q_len")
    reason = td.gluon_unsupported(batch, config, q_len * config.head_group)  # launch's check, as Unsupported
    if reason:
        raise Unsupported(reason.split(", got")[0])
    return config


def _run_forced(kernel: str) -> Callable[[DecodeBatch], tuple[torch.Tensor, torch.Tensor]]:
    """Runner of our decode with one Gluon kernel pinned (`_pinned`)."""

    def run(batch: DecodeBatch, num_workers: int | None = None):
        from mla_fast import triton_decode as td

        return td.decode(batch, config=_pinned(batch, kernel, _q_len(batch)), num_workers=num_workers)

    return run


def _step_forced(kernel: str):
    """Step factory of our graph-capturable step with one Gluon kernel pinned (`_pinned` at the step's max_q_len)."""

    def step(batch: DecodeBatch, max_q_len: int):
        from mla_fast.triton_decode import TritonMLADecode

        return TritonMLADecode(batch, max_q_len=max_q_len, config=_pinned(batch, kernel, _q_len(batch, max_q_len)))

    return step


INVARIANT_MAX_Q_LEN = 4  # the triton_invariant backend's kernel geometry: MTP rows up to 4, the range


def _invariant_unsupported(batch: DecodeBatch, q_len: int) -> None:
    """Unsupported where triton_invariant takes no such rows (q_len) or this platform's Triton no such format."""
    if q_len > INVARIANT_MAX_Q_LEN:
        raise Unsupported(f"triton_invariant fixes its kernel geometry for q_len <= {INVARIANT_MAX_Q_LEN}")
    from mla_fast.triton_decode import dtypes_unsupported

    if reason := dtypes_unsupported(batch):
        raise Unsupported(reason)


def _run_invariant(batch: DecodeBatch, num_workers: int | None = None):
    from mla_fast import triton_decode as td

    _invariant_unsupported(batch, td._max_q_len(batch))
    return td.decode_invariant(batch, max_q_len=INVARIANT_MAX_Q_LEN, num_workers=num_workers)


def _invariant_numerics(batch: DecodeBatch) -> KernelNumerics:
    from mla_fast import triton_decode as td

    combo = _combo(batch)  # before the config, which needs a combination
    return td.kernel_numerics(td.invariant_config(batch, INVARIANT_MAX_Q_LEN), combo, batch.head_dim)


def _step_invariant(batch: DecodeBatch, max_q_len: int):
    from mla_fast import triton_decode as td

    _invariant_unsupported(batch, max_q_len)
    return td.invariant_step(batch, INVARIANT_MAX_Q_LEN)


def _invariant_max_splits(batch: DecodeBatch) -> int:
    from mla_fast.triton_decode import INVARIANT_SPLIT_TOKENS

    return most_pieces(batch, INVARIANT_SPLIT_TOKENS)


def _run_aiter(batch: DecodeBatch):
    from mla_fast.aiter_backend import aiter_decode, aiter_refusal

    if reason := aiter_refusal(batch):  # outside aiter's scope: unsupported, not a failed case
        raise Unsupported(reason)
    return aiter_decode(batch)


# FlashInfer 0.6.14 (FA3) returns wrong rows when a request has more query rows than tokens (its leading rows see
# nothing) at some head counts above 32: one device call (scripts/probe_flashinfer_rows.py, a request of 1 token and
# 2 query rows beside one of 401) had the row that sees its token off by 2.5-3.9 with a wrong lse at 33-43 and 65-127
# heads, right at 1-32, 44-64 and 128; the verifier's campaigns failed 9 of 400 cases at 40 heads. Serving engines
# never send such a request (the draft tokens are in the KV). Empty requests (CUDA-graph padding) were right at every
# head count from 1 to 128 (768 batches, bf16 and fp8, on an H100), so only non-empty ones are declined, above 32
# heads, which every campaign and probe passed at or below.
FLASHINFER_MAX_HEADS_SHORT = 32
FLASHINFER_SHORT = ("flashinfer: a non-empty request with more query rows than KV tokens at more than 32 heads "
                    "(FlashInfer 0.6.14 returns wrong rows there, measured: mla_fast/backends.py)")


def flashinfer_refusal(batch: DecodeBatch) -> str | None:
    """FLASHINFER_SHORT where the batch holds what FlashInfer 0.6.14 gets wrong (above), else None (a host sync)."""
    short = (batch.q_lens > batch.seq_lens) & (batch.seq_lens > 0)  # [B]
    return FLASHINFER_SHORT if batch.num_heads > FLASHINFER_MAX_HEADS_SHORT and bool(short.any()) else None


def _run_flashinfer(batch: DecodeBatch):
    from mla_fast import flashinfer_backend

    if reason := flashinfer_refusal(batch):
        raise Unsupported(reason)
    return flashinfer_backend.flashinfer_decode(batch)


def _step_flashmla(batch: DecodeBatch, max_q_len: int):
    from mla_fast.flashmla_backend import FlashMLAStep

    return FlashMLAStep(batch, max_q_len)


def _step_flashinfer(batch: DecodeBatch, max_q_len: int):
    from mla_fast.flashinfer_backend import FlashInferStep

    return FlashInferStep(batch, max_q_len)


def _run_flashmla(batch: DecodeBatch):
    from mla_fast.flashmla_backend import flashmla_decode

    return flashmla_decode(batch)


# ---- probes ------------------------------------------------------------------------------------------------------
def _always() -> tuple[bool, str]:
    return True, "pure torch, runs anywhere"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cuda_sm90(what: str) -> tuple[bool, str] | None:
    """None when a CUDA sm_90 GPU is present, else (False, reason)."""
    if torch.version.hip is not None:
        return False, f"{what} is CUDA-only; this torch is a ROCm build ({torch.version.hip})"
    if not torch.cuda.is_available():
        return False, f"{what} needs a CUDA GPU; torch.cuda.is_available() is False"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"{what} needs sm_90 (Hopper); this GPU is sm_{major}{minor}"
    return None


def _probe_triton() -> tuple[bool, str]:
    if not _has_module("triton"):
        return False, "triton is not installed (pip install 'mla-verify[triton]')"
    if torch.cuda.is_available():
        return True, f"GPU: {torch.cuda.get_device_name()}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "Triton CPU interpreter only (TRITON_INTERPRET=1): correct but slow"
    return False, "no GPU; the Triton kernel runs on CPU only under TRITON_INTERPRET=1 (interpreter, slow)"


def _probe_gluon(what: str) -> tuple[bool, str]:
    if not _has_module("triton"):
        return False, "triton is not installed (pip install 'mla-verify[triton]')"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False, f"{what} is Gluon (wgmma, TMA): Triton's interpreter cannot run it (TRITON_INTERPRET=1)"
    return _cuda_sm90(what) or (True, f"GPU: {torch.cuda.get_device_name()}")


def _probe_flashinfer() -> tuple[bool, str]:
    if not _has_module("flashinfer"):
        return False, "flashinfer-python is not installed (pip install 'mla-verify[cuda-peers]')"
    return _cuda_sm90("FlashInfer FA3 MLA") or (True, f"FA3 on {torch.cuda.get_device_name()}")


def _probe_flashmla() -> tuple[bool, str]:
    if not _has_module("flash_mla"):
        return False, "sgl-flash-mla is not installed (pip install 'mla-verify[cuda-peers]')"
    return _cuda_sm90("FlashMLA dense decode") or (True, f"legacy SM90 kernels on {torch.cuda.get_device_name()}")


def _probe_aiter() -> tuple[bool, str]:
    if torch.version.hip is None:
        return False, "aiter needs ROCm; this torch is not a ROCm build (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return False, "aiter needs an AMD GPU; torch.cuda.is_available() is False"
    try:
        from importlib.metadata import version

        version("amd-aiter")
    except Exception:
        return False, "amd-aiter is not installed (pip install 'mla-verify[rocm]'; the PyPI 'aiter' is unrelated)"
    arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    if arch not in ("gfx942", "gfx950"):
        return False, f"aiter's persistent MLA kernels exist for gfx942/gfx950; this GPU is {arch}"
    return True, f"{arch}"


# ---- NaN inputs, measured (verify.checks.check_nan, one H200, forty-second session, 150 cases each) ----------------
FLASHINFER_NAN = ("a NaN token gives NaN out but a finite lse on some rows (7 of 150 bf16 cases), and with an fp8 "
                  "cache finite out and lse (144 of 150: its fp8 conversion reads the NaN code as a number)")
FLASHMLA_NAN = "a NaN token gives NaN out but a finite lse (144 of 150 bf16 cases; the 6 others had no token)"
AITER_NAN = "its reduce merges a NaN split partial as an empty one (aiter-contract.md; not run: needs ROCm)"


# ---- registry ----------------------------------------------------------------------------------------------------
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("ref", "fp64 oracle (mla_decode_ref)", _run_ref, _always, _ref_numerics),
        Backend("emulated", "WorkPlan emulated with torch fp32, bf16 out", _run_emulated, _always, _emulated_numerics,
                _run_emulated),
        Backend("triton", "mla_fast persistent split-KV Triton kernel", _run_triton, _probe_triton, _triton_numerics,
                _run_triton, step=_step_triton),
        Backend("triton_invariant", "mla_fast Triton kernel, batch-invariant (fixed splits and geometry)",
                _run_invariant, _probe_triton, _invariant_numerics, _run_invariant,
                max_splits=_invariant_max_splits, step=_step_invariant,
                batch_invariant=True),
        Backend("seesaw", "mla_fast with the Gluon seesaw kernel pinned", _run_forced("seesaw"),
                lambda: _probe_gluon("the seesaw kernel"), _forced_numerics("seesaw"), _run_forced("seesaw"),
                step=_step_forced("seesaw")),
        Backend("gluon_fp8", "mla_fast with the Gluon fp8 kernel pinned", _run_forced("gluon_fp8"),
                lambda: _probe_gluon("the Gluon fp8 kernel"), _forced_numerics("gluon_fp8"), _run_forced("gluon_fp8"),
                step=_step_forced("gluon_fp8")),
        Backend("aiter", "ROCm/aiter persistent MLA decode", _run_aiter, _probe_aiter, _aiter_numerics,
                nan_deviation=AITER_NAN,  # split work holds whole kv_granularity blocks, max(page_size, 16) tokens
                max_splits=lambda batch: most_pieces(batch, max(batch.page_size, 16))),
        Backend("flashinfer", "FlashInfer MLA paged, FA3", _run_flashinfer, _probe_flashinfer, _flashinfer_numerics,
                nan_deviation=FLASHINFER_NAN,  # its MLA plan's kv_len_limit is at least 32 tokens (scheduler.cuh)
                max_splits=lambda batch: most_pieces(batch, 32), step=_step_flashinfer),
        Backend("flashmla", "FlashMLA dense decode (legacy SM90)", _run_flashmla, _probe_flashmla, _flashmla_numerics,
                nan_deviation=FLASHMLA_NAN, step=_step_flashmla),
    )
}


def available() -> dict[str, tuple[bool, str]]:
    """name -> (can run here, reason) for every registered backend."""
    return {name: b.probe() for name, b in BACKENDS.items()}


def get_backend(name: str) -> Backend:
    """The backend called `name` ("auto": first runnable of AUTO_ORDER); ValueError saying why it cannot run."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            interpreter_only = candidate == "triton" and not torch.cuda.is_available()  # correct but slow: skip
            if BACKENDS[candidate].probe()[0] and not interpreter_only:
                return BACKENDS[candidate]
        raise ValueError("backend 'auto': none of " + ", ".join(AUTO_ORDER) + " can run here")
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS) + ['auto']}, got {name!r}")
    ok, reason = BACKENDS[name].probe()
    if not ok:
        raise ValueError(f"backend {name!r} cannot run here: {reason}")
    return BACKENDS[name]
