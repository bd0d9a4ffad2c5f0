"""The checks run on every case, each returning a `CheckResult` with its worst err/bound.

| check          | compares                                                        | bound (verify.bounds)          |
|----------------|-----------------------------------------------------------------|--------------------------------|
| contract       | the kernel ran, returned out [T, H, L] (+ lse [T, H]) floats    | —                              |
| tier1.out/.lse | kernel vs fp64 oracle on the same dequantized inputs            | kernel_bound + merge_bound     |
| tier2.*        | fp64 oracle on fp8 inputs vs on exact inputs (fp8 only): a      | quantization_bounds: B_det,    |
|                | property of the data and the format, not of the kernel          | B_post                         |
| split.out/.lse | the kernel under several worker counts vs one worker (no split) | split_bound + output ulps      |
|                | (kernels with `run_workers`: emulated, triton, seesaw,          |                                |
|                | gluon_fp8, plug-ins that set it)                                |                                |
| split.tier1.*  | that second run vs the fp64 oracle: names a wrong one-worker    | kernel_bound + merge_bound     |
|                | path as such                                                    |                                |
| empty          | rows that see no token: out exactly 0, lse -inf                 | —                              |
| finite         | rows that see tokens: out and lse finite (inputs are finite)    | —                              |
| nan, nan.first | the kernel again with a NaN in one valid token (`nan_probe`:    | exact (masks)                  |
|                | the newest's rope channel; the first's latent channel): NaN out |                                |
|                | and lse on the (row, head)s that read it, only there            |                                |
| rounding       | the kernel again on `rounding_probe(batch)`: exact scores and   | kernel_bound + merge_bound     |
|                | outputs that cancel to the cache format's rounding of P, so a P | of the probe                   |
|                | rounded more coarsely than declared fails (numerics.md §5(h))   |                                |
| rescale        | the kernel again on `rescale_probe(batch)`: the running max     | kernel_bound + merge_bound of  |
|                | rises every 16 tokens and at a riser, outputs that cancel to    | the probe                      |
|                | the cache format's rounding: a rescale factor rounded more      |                                |
|                | coarsely than declared (bf16 under fp32 P) fails                |                                |
| partials       | the kernel again on `partials_probe(batch)`: all scores 0,      | kernel_bound (P rounding as a  |
|                | values whose mean over each row is a tiny offset while each     | common factor) + merge_bound   |
|                | split's mean is not: split outputs stored more coarsely than    | (declared partial dtype) of    |
|                | declared fail (numerics.md §5(i))                               | the probe                      |
| layout         | the kernel again with each request's pages consecutive          | the first run's bits, else     |
|                | (`pages_in_use_order`), q, cache and block table as views into  | kernel_bound + merge_bound     |
|                | NaN-padded buffers (`strided_batch`): shapes taken for strides  | (refused: passes, warned)      |
|                | read NaN; ``layout.refused``: a ValueError naming what it takes |                                |
| repeat         | the kernel again on the same batch and worker count: a kernel   | the first run's bits (declared |
|                | that declares itself deterministic (the default) gives the same | deterministic), else           |
|                | bits; one that declares run-to-run variation stays in the bound | kernel_bound + merge_bound     |
| padding        | the kernel again with finite tokens that the rows prefer by 200 | the first run's bits (declared |
|                | nats to their own in the unused slots of each request's last    | deterministic), else           |
|                | page (`padding_probe`): NaN hides a max taken over them         | kernel_bound + merge_bound     |
| rerun          | the kernel on copies of the batch with room to grow, then again | the case's run's bits, else    |
|                | after those tensors were rewritten in place as the next decode  | kernel_bound + merge_bound;    |
|                | step (`next_step`): an eager call that memoises by its inputs'  | the next step: kernel_bound +  |
|                | identity or address decodes the old step                        | merge_bound of its contents    |
| inputs         | q, cache, block table and lengths: after the kernel = before    | byte for byte                  |
| far            | the kernel again with the pages moved past element 2^31 and     | the first run's bits, else     |
|                | page id 2^16 of a larger cache, NaN in front (`far_pages`):     | kernel_bound + merge_bound     |
|                | int32 offsets and 16-bit page ids wrap there (on CUDA devices   |                                |
|                | by default: a 2-5 GB cache per case, 9.7 GB on pages of 128;    |                                |
|                | pages of over 227 DeepSeek tokens only past element 2^31)       |                                |

err/bound is the largest elementwise |actual - expected| / bound (> 1: violated); checks without a bound report
None. A kernel that raises or breaks the contract fails the case with its message; the other checks then do not run.

Two outcomes are not ordinary failures:
- unsupported: the kernel raised `mla_fast.backends.Unsupported` (an input it has no kernel for); no check runs and
  the case is neither passed nor failed (`CaseResult.unsupported` holds the reason).
- device fault: a CUDA/HIP error (illegal memory access, ...) leaves the process's GPU context unusable, so every
  later case would fail too; the case fails and `CaseResult.device_fault` tells the campaign to stop. The kernel's
  run is synchronized before it is judged, so an asynchronous fault is charged to the case that launched it.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mla_fast.backends import Unsupported
from mla_fast.numerics import KernelNumerics
from mla_ref.decode import DecodeBatch, is_fp8, mla_decode_ref
from verify import bounds, next_step
from verify.cases import Case
from verify.freed_memory import FreeBlocks, size_text
from verify.kernels import Kernel, outputs
from verify.metrics import compare
from verify.padding_probe import padding_probe
from verify.partials_probe import partials_probe
from verify.regrouped import regrouped_batches, shared_batch
from verify.rescale_probe import rescale_probe
from verify.rounding_probe import rounding_probe
from verify.strided_inputs import pages_in_use_order, strided_batch

ALT_WORKERS = 132  # second worker count when a case uses one worker (an H200's SMs: a split per block)
FAR_ELEMENTS = 2**31  # cache elements past which int32 element offsets wrap (far check)
FAR_PAGE_IDS = 2**16  # page ids past which 16-bit ones wrap (far check)
FAR_PAGE_ID_ELEMENTS = 2**33  # the far cache goes past page id 2^16 only on pages where that takes at most these
# elements (17 GB of bf16): pages of up to 227 tokens of 576 (128: 9.7 GB); on larger pages (528: 40 GB, which worker
# processes sharing a GPU do not hold side by side) past element 2^31 only


@dataclass
class CheckResult:
    """One check on one case.

    Attributes:
        name: check name ("tier1.out", ...).
        ok: the check holds.
        err_over_bound: max elementwise err / bound (None for checks without a bound).
        median: median elementwise err / bound (None without a bound).
        detail: human-readable description (a `Report.describe()` for bounded checks).
        report: `Report.to_json()` for bounded checks, else None.
    """

    name: str
    ok: bool
    err_over_bound: float | None = None
    median: float | None = None
    detail: str = ""
    report: dict | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "err_over_bound": json_number(self.err_over_bound),
                "median": json_number(self.median), "detail": self.detail, "report": self.report}


@dataclass
class CaseResult:
    """Every check of one case, and how long the case took.

    Attributes:
        unsupported: the kernel's reason when it raised `Unsupported` (then ``checks`` is empty), else None.
        device_fault: a CUDA/HIP error broke the process's GPU context during this case (the case has failed).
    """

    case: Case
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    unsupported: str | None = None
    device_fault: bool = False
    numerics: str | None = None  # `KernelNumerics.describe()` of what the kernel declared for this case
    out_dtype: str | None = None  # its declared out dtype ("bfloat16", "float32", ...); None if not a KernelNumerics

    @property
    def status(self) -> str:
        """"passed", "failed" or "unsupported"."""
        if self.unsupported is not None:
            return "unsupported"
        return "passed" if all(c.ok for c in self.checks) else "failed"

    @property
    def ok(self) -> bool:
        """Every check ran and held (an unsupported case is not ok, and not failed either: see ``status``)."""
        return self.status == "passed"

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.ok]

    def describe(self) -> str:
        if self.unsupported is not None:
            return f"case {self.case.describe()}: UNSUPPORTED by the kernel: {self.unsupported}"
        lines = [f"case {self.case.describe()}: {'OK' if self.ok else 'FAILED'} ({self.seconds:.2f} s)"]
        lines += [f"  [{c.name}] {c.detail}" for c in self.failed]
        return "\n".join(lines)


def json_number(x: float | None):
    """A value ``json.dumps(..., allow_nan=False)`` accepts: None and finite floats as they are, else a string."""
    if x is None or (x == x and abs(x) != float("inf")):
        return x
    return "nan" if x != x else ("inf" if x > 0 else "-inf")


def _bounded(name: str, actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, out_dtype) -> CheckResult:
    ulp_dtype = out_dtype if torch.finfo(out_dtype).bits <= 32 else torch.float32  # ULPs: 8-32 bit formats only
    rep = compare(actual, expected, bound, name=name, out_dtype=ulp_dtype)
    return CheckResult(name, rep.ok, rep.err_over_bound_max, rep.err_over_bound_median, rep.describe(), rep.to_json())


def _with_rows(rows: DecodeBatch | Callable[[int], str] | None, results: list[CheckResult]) -> list[CheckResult]:
    """``results`` with each failed one's rows named: the first whose NaN / inf positions differ from the oracle's,
    and the worst (its largest err / bound, else its largest difference) unless only those positions failed it; in a
    batch's terms (`_row_words`), or by a callable of the row index; None: as they are."""
    for r in results:
        report = r.report or {}
        if rows is None or r.ok:
            continue
        mismatch = report.get("nonfinite_first_index")  # out and lse both lead with the query row
        if mismatch:
            r.detail += f"\n  first NaN/inf mismatch on {_named_row(rows, int(mismatch[0]))}"
        index = report.get("worst_index") or report.get("max_abs_index")
        if index and (report.get("violations", 1) or not mismatch):
            r.detail += f"\n  worst {_named_row(rows, int(index[0]))}"
    return results


def _named_row(rows: DecodeBatch | Callable[[int], str], t: int) -> str:
    return _row_words(rows, t) if isinstance(rows, DecodeBatch) else rows(t)


def _row_words(batch: DecodeBatch, t: int) -> str:
    """Query row ``t`` of ``batch`` in its terms: the request, the row within it, the tokens it sees (an MTP row
    sees fewer)."""
    b = int(batch.row_request()[t])
    first, n, s = int(batch.qo_indptr[b]), int(batch.q_lens[b]), int(batch.seq_lens[b])
    return (f"row {t}: request {b}, its query row {t - first} of {n}, which sees {int(batch.visible_tokens()[t])} of "
            f"its {s} tokens")


def is_device_fault(e: BaseException) -> bool:
    """A sticky GPU error: after it every CUDA call of this process fails, whatever the kernel or case. That is
    torch.AcceleratorError (torch >= 2.8 raises it for CUDA and HIP errors), or, once this process holds a CUDA/HIP
    context, a RuntimeError naming a CUDA or HIP error (C++ extensions' own error checks raise those). Without a
    context no GPU error can be sticky: a plug-in's RuntimeError that only says "CUDA error" in a CPU run fails its
    case as any other error does, and the campaign goes on."""
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8; a RuntimeError subclass
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return (isinstance(e, RuntimeError) and torch.cuda.is_initialized()
            and ("CUDA error" in str(e) or "HIP error" in str(e)))


def error_message(e: BaseException) -> str:
    """One paragraph: type, message and the innermost frame."""
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    return f"{type(e).__name__}: {e}" + (f" (at {where.filename}:{where.lineno})" if where else "")


def _call(kernel_fn, *args, device: torch.device) -> tuple[object | None, BaseException | None]:
    """Run a kernel and wait for it on ``device``; (result, None) or (None, the exception). Never raises."""
    try:
        result = kernel_fn(*args)
        if device.type == "cuda":  # a faulting launch is reported here, charged to this case
            torch.cuda.synchronize(device)
        return result, None
    except (Exception, SystemExit) as e:  # a plug-in's failure (sys.exit() too) is a failed case, not a crash
        return None, e


def _run(kernel: Kernel, batch: DecodeBatch, workers: int) -> tuple[object | None, BaseException | None]:
    """`_call` of the kernel on ``batch``: with ``workers`` persistent workers when it takes a count (run_workers),
    else its plain run."""
    if kernel.run_workers is not None:
        return _call(kernel.run_workers, batch, workers, device=batch.device)
    return _call(kernel.run, batch, device=batch.device)


def _outputs_of(run: tuple[object | None, BaseException | None], batch: DecodeBatch) -> tuple[tuple | None, str | None]:
    """A later run's ``run`` (`_run`'s or `_call`'s result) as ((out, lse), None), or (None, why it has none): "the run
    raised ..." or the output contract's message. A device fault propagates (run_case charges it to the case)."""
    raw, exc = run
    if exc is not None:
        if is_device_fault(exc):
            raise exc
        return None, f"the run raised {error_message(exc)}"
    try:
        return outputs(raw, batch), None
    except ValueError as e:
        return None, str(e)


def _watched(batch: DecodeBatch, run: Callable[[], tuple[object | None, BaseException | None]],
             before: dict[str, torch.Tensor] | None = None) -> tuple[tuple | None, str | None]:
    """`_outputs_of(run(), batch)`, except that a run that wrote into the batch's inputs (`check_inputs`, against
    byte copies taken before it: ``before``, else taken here) has no outputs: why is then that."""
    before = input_snapshot(batch) if before is None else before
    result, why = _outputs_of(run(), batch)
    written = check_inputs(batch, before)
    return (result, why) if why is not None or written.ok else (None, written.detail)


def _planned(step, batch: DecodeBatch) -> str | None:
    """``step.plan(batch)``, then why it wrote into the batch's inputs (None: it did not; `check_inputs` against byte
    copies taken before it): a plan that rewrites the lengths, the block table, q or the cache would move the
    oracle's inputs with it. Raises what plan() raises."""
    before = input_snapshot(batch)
    step.plan(batch)
    written = check_inputs(batch, before)
    return None if written.ok else written.detail.replace("the kernel wrote", "plan() wrote")


def _moved(out: torch.Tensor, lse: torch.Tensor | None, device: torch.device, copy: bool = True):
    """(out, lse) detached on ``device`` (lse None stays None): a kernel's results beside the oracle's. ``copy``
    (for a first run, whose results later runs are compared with) keeps them from a kernel that writes the next
    call's results into the same buffers (a CUDA-graph style plug-in: a later run would overwrite them, and the
    checks would compare a run with itself); a later run's results, compared at once, need no copy."""
    return out.detach().to(device, copy=copy), (lse.detach().to(device, copy=copy) if lse is not None else None)


def _tier1_bound(batch: DecodeBatch, kernel: Kernel, numerics: KernelNumerics, ref,
                 uniform_p: bool = False, splits_of: DecodeBatch | None = None) -> bounds.Bound:
    """kernel_bound for the declared ``numerics`` (``uniform_p``: see there) + merge_bound (its partials in the
    declared partial_dtype) times (1 + u_out): the kernel may split rows up to max_splits times, and rounding the
    merged value to the output dtype moves it by u_out of the merge error too (kernel_bound charges u_out |ô|).
    ``splits_of``: the batch the kernel ran on when ``batch`` is some of its requests (both bounds are per row), for
    max_splits; None: ``batch``."""
    splits = kernel.max_splits(batch if splits_of is None else splits_of)
    merge = bounds.merge_bound(batch, splits, partial_dtype=numerics.partial_dtype)
    u_out = bounds._unit_roundoff(numerics.out_dtype)
    return bounds.kernel_bound(batch, numerics, ref=ref, uniform_p=uniform_p) + bounds.Bound(merge.out * (1 + u_out),
                                                                                              merge.lse)


# ---- individual checks --------------------------------------------------------------------------------------------


def check_tier1(out, lse, ref, bound: bounds.Bound, out_dtype: torch.dtype, name: str = "tier1") -> list[CheckResult]:
    """Kernel vs fp64 oracle on the same dequantized inputs, within ``bound`` (kernel_bound + merge_bound,
    numerics.md §5(f,g)); the checks are called ``name``.out and ``name``.lse."""
    results = [_bounded(f"{name}.out", out, ref[0], bound.out, out_dtype)]
    if lse is not None:
        results.append(_bounded(f"{name}.lse", lse, ref[1], bound.lse, torch.float32))
    return results


def check_tier2(batch_q: DecodeBatch, batch_exact: DecodeBatch, ref_q) -> list[CheckResult]:
    """Quantization error of the fp64 oracle: fp8 inputs vs exact inputs, within B_det and B_post (§5(a)–(d))."""
    ref_x = mla_decode_ref(batch_exact)  # [T, H, L], [T, H] on the unquantized inputs
    qb = bounds.quantization_bounds(batch_q, batch_exact, ref_exact=ref_x)
    return [
        _bounded("tier2.det.out", ref_q[0], ref_x[0], qb.det_out, torch.float64),
        _bounded("tier2.post.out", ref_q[0], ref_x[0], qb.post_out, torch.float64),
        _bounded("tier2.det.lse", ref_q[1], ref_x[1], qb.det_lse, torch.float64),
        _bounded("tier2.post.lse", ref_q[1], ref_x[1], qb.post_lse, torch.float64),
    ]


def check_split(batch: DecodeBatch, kernel: Kernel, numerics, first: tuple, workers: int, ref,
                bound: bounds.Bound) -> list[CheckResult]:
    """The kernel's result ``first`` (its run with ``workers`` persistent workers) agrees with a second run: one
    worker (no split), or ALT_WORKERS when ``workers`` is 1 (``split.out`` / ``.lse``); and that second run agrees
    with the oracle ``ref`` within the case's tier-1 ``bound`` (``split.tier1.out`` / ``.lse``), so that a wrong
    one-worker path is named as such, not as a split run that differs from it.

    Both runs compute the same scores; P rounding under each piece's running max, exp, accumulation and the merge
    differ: within bounds.split_bound before output rounding (numerics.md §5(f,g)). For out of dtype u_out,
    |round(x) - round(y)| <= |x - y| + u_out (|round(x)| + |round(y)|) (1 + u_out) + 2 eta_out (eta_out: half the
    out dtype's min subnormal, the error below its normal range); so the bound is
    split + u_out (|a| + |b|) (1 + u_out) + 2 eta_out for out and split for lse.
    """
    other = 1 if workers > 1 else ALT_WORKERS
    # a plug-in's run_workers follows the contract of its run
    second, why = _outputs_of(_call(kernel.run_workers, batch, other, device=batch.device), batch)
    if why is not None:
        return [CheckResult("split.out", False, detail=f"{other}-worker run: {why}")]
    if (first[1] is None) != (second[1] is None):
        return [CheckResult("split.lse", False, detail=f"lse returned by only one of the {workers}- and "
                                                       f"{other}-worker runs")]
    alone = _tier1_of(batch, second, ref, (bound, numerics.out_dtype), "split.tier1",
                      f"the {other}-worker run vs the oracle")
    u_out = bounds._unit_roundoff(numerics.out_dtype)  # unit roundoff of the output dtype, as the bounds take it
    eta_out = bounds._half_min_subnormal(numerics.out_dtype)  # its absolute error below the normal range
    split = bounds.split_bound(batch, numerics, kernel.max_splits(batch))  # [T, H, L], [T, H] before output rounding
    results = []
    checked = (("split.out", numerics.out_dtype),) + ((("split.lse", torch.float32),) if first[1] is not None else ())
    for i, (name, out_dtype) in enumerate(checked):
        a = first[i].detach().double()  # [T, H, L] or [T, H], on the bound's device
        b = second[i].detach().to(a.device).double()
        if i == 0:
            both = torch.isfinite(a) & torch.isfinite(b)
            limit = split.out.to(a.device) + torch.where(both, u_out * (a.abs() + b.abs()) * (1 + u_out) + 2 * eta_out,
                                                         0.0)
        else:
            limit = split.lse.to(a.device)
        r = _bounded(name, a, b, limit, out_dtype)
        r.detail = f"{workers} workers vs {other}: {r.detail}"
        results.append(r)
    return alone + results


def _floating(x: torch.Tensor) -> torch.Tensor:
    """x detached, fp8 widened to fp32 (exact; torch has no isfinite / isneginf for fp8 dtypes)."""
    x = x.detach()
    return x.float() if x.element_size() == 1 else x


def check_empty(batch: DecodeBatch, out: torch.Tensor, lse: torch.Tensor | None) -> CheckResult:
    """Rows that see no KV token: out exactly 0 and lse exactly -inf (docs/architecture.md)."""
    empty = (batch.visible_tokens() == 0).to(out.device)  # [T]
    bad_rows = (_floating(out) != 0).flatten(1).any(dim=1) & empty  # [T] NaN != 0 too
    bad_lse_rows = (~torch.isneginf(_floating(lse))).any(dim=1) & empty if lse is not None else torch.zeros_like(empty)
    n, bad_out, bad_lse = torch.stack([empty.sum(), bad_rows.sum(), bad_lse_rows.sum()]).tolist()  # one sync
    if not n:
        return CheckResult("empty", True, detail="no empty rows in this case")
    if bad_out or bad_lse:
        o = out.detach().cpu()[empty.cpu()].double()  # [E, H, L] (failure path: host copies are fine)
        sample = o.flatten()[(o.flatten() != 0)][:3].tolist()
        lse_note = ""
        if bad_lse:
            lse_note = f"; lse != -inf on {bad_lse} (first {lse.detach().cpu()[empty.cpu()][0, :3].tolist()})"
        return CheckResult("empty", False, detail=f"{n} empty rows: out != 0 on {bad_out} (e.g. {sample}){lse_note}")
    return CheckResult("empty", True, detail=f"{n} empty rows: out 0, lse -inf")


def check_finite(batch: DecodeBatch, out: torch.Tensor, lse: torch.Tensor | None) -> CheckResult:
    """Rows that see at least one token give finite out and lse (every generated input is finite)."""
    seen = (batch.visible_tokens() > 0).to(out.device)  # [T]
    bad_out = ~torch.isfinite(_floating(out)) & seen[:, None, None]  # [T, H, L]
    bad_lse = ~torch.isfinite(_floating(lse)) & seen[:, None] if lse is not None else torch.zeros_like(seen)  # [T, H]
    n_seen, n_out, n_lse = torch.stack([seen.sum(), bad_out.sum(), bad_lse.sum()]).tolist()  # one sync
    if n_out or n_lse:
        return CheckResult("finite", False, detail=f"non-finite values on rows that see tokens: {n_out} in out, "
                           f"{n_lse} in lse")
    return CheckResult("finite", True, detail=f"{n_seen} rows finite")


NAN_PROBES = ("newest", "first")  # nan_probe's two tokens, checks "nan" and "nan.first"


def nan_probe(batch: DecodeBatch, token: str = "newest") -> tuple[DecodeBatch, torch.Tensor, int] | None:
    """A copy of ``batch`` with one NaN token, the [T, H] mask of the (row, head)s that read it, and one such row.
    The oracle gives NaN out and lse there and nothing else changes (docs/architecture.md: a NaN input never gives a
    finite answer). None when no request has a token. Host syncs: the lengths, the page, the rows.

    token "newest": the last channel (a rope channel: scores only) of the longest request's newest token, read by
    that request's last query row, every head (its earlier MTP rows do not see it: a mask applied after a NaN
    score, or a max taken before it, spreads it there).
    token "first": the first latent channel (c_kv: the scores and P.V) of the first token of the first request with
    at least as many tokens as query rows (None if none), read by each of its rows, every head. A reduce or tile
    that multiplies a partial or a token by a weight of 0 (0 NaN = NaN), such as a reduce whose padding slots re-read
    the first split tile's first partial, spreads it to other requests' rows (found by a review that mutated the
    emulated split-KV path)."""
    if token not in NAN_PROBES:
        raise ValueError(f"nan_probe.token: expected one of {NAN_PROBES}, got {token!r}")
    seq = batch.seq_lens.tolist()  # [B]
    if not seq or max(seq) == 0:
        return None
    ps = batch.page_size
    expected = torch.zeros(batch.num_tokens, batch.num_heads, dtype=torch.bool, device=batch.device)  # [T, H]
    kv = batch.kv_cache.clone()  # [P, page_size, D]
    nan = torch.tensor(float("nan")).to(kv.dtype)  # the format's NaN code
    if token == "newest":
        b = max(range(len(seq)), key=seq.__getitem__)
        s = seq[b]
        kv[int(batch.block_table[b, (s - 1) // ps]), (s - 1) % ps, -1] = nan
        row = int(batch.qo_indptr[b + 1]) - 1
        expected[row] = True
    else:  # a request whose every row sees a token (a kernel's tile may give a row that sees none 0 x NaN)
        n_rows = batch.q_lens.tolist()  # [B]
        b = next((i for i, (s, n) in enumerate(zip(seq, n_rows)) if s >= n > 0), None)
        if b is None:
            return None
        kv[int(batch.block_table[b, 0]), 0, 0] = nan
        first, last = int(batch.qo_indptr[b]), int(batch.qo_indptr[b + 1])
        expected[first:last] = True  # [n, H] every row of it sees token 0 (s >= n)
        row = last - 1
    return batch.replace(kv_cache=kv), expected, row


def check_nan(batch: DecodeBatch, kernel: Kernel, workers: int) -> list[CheckResult]:
    """The kernel run again on each `nan_probe(batch, token)` (with the case's worker count when it takes one): out
    (some channel) and lse are NaN exactly on the (row, head)s that read the NaN token: checks ``nan`` (the newest
    token's rope channel) and ``nan.first`` (the first token's latent channel). A kernel that merges a NaN partial as
    an empty split (aiter's reduce), or takes a NaN row sum for an empty row, gives a finite answer there; one that
    weighs a NaN partial or token by 0 where a row does not read it gives NaN elsewhere."""
    return [_nan_run(batch, kernel, workers, token) for token in NAN_PROBES]


def _nan_run(batch: DecodeBatch, kernel: Kernel, workers: int, token: str) -> CheckResult:
    """check_nan on one probe."""
    name = "nan" if token == "newest" else f"nan.{token}"
    probe = nan_probe(batch, token)
    if probe is None:
        return CheckResult(f"{name}.skipped", True, detail="no request has a token to poison" + (
            "" if token == "newest" else " with as many tokens as query rows"))
    nan_batch, expected, row = probe
    result, why = _outputs_of(_run(kernel, nan_batch, workers), nan_batch)
    if why is not None:
        return CheckResult(name, False, detail=f"with a NaN token: {why}")
    out, lse = result
    expected = expected.to(out.device)
    masks = {"out": torch.isnan(_floating(out)).any(dim=-1)}  # [T, H]
    if lse is not None:
        masks["lse"] = torch.isnan(_floating(lse))  # [T, H]
    problems = []
    for what, got in masks.items():
        finite, extra = int((expected & ~got).sum()), int((got & ~expected).sum())
        if finite:
            problems.append(f"{what} not NaN on {finite} of the {int(expected.sum())} (row, head)s that read it")
        if extra:
            rows = torch.nonzero((got & ~expected).any(dim=-1)).flatten()[:3].tolist()
            problems.append(f"{what} NaN on {extra} (row, head)s that do not read it (rows {rows}...)")
    where = (f"NaN in the newest token of the longest request, read by row {row}" if token == "newest" else
             f"NaN in the first latent channel of the first token of request {int(batch.row_request()[row])}, read "
             f"by its {int(expected.any(dim=-1).sum())} rows that see a token")
    if problems:
        sample = f"; row {row} head 0: out[:3] {out[row, 0, :3].float().tolist()}" + (
            f", lse {float(lse[row, 0])}" if lse is not None else "")
        return CheckResult(name, False, detail=f"{where}: " + "; ".join(problems) + sample)
    return CheckResult(name, True, detail=f"{where}: NaN there only")


def check_rounding(batch: DecodeBatch, kernel: Kernel, workers: int) -> list[CheckResult]:
    """The kernel run again on `rounding_probe(batch)` (the case's worker count when it takes one), within the
    probe's tier-1 bound for the numerics the kernel declares for it (kernel_bound + merge_bound): exact scores and
    outputs that cancel to the cache format's rounding of P, so that a P rounded more coarsely than declared (bf16
    under fp32, fp8 under bf16 or fp16) fails, which on drawn data it seldom does: on rows up to a few thousand
    tokens, wherever its splits and tiles fall but inside both of the probe's pairs of tokens (verify/rounding_probe.py,
    numerics.md §5(h))."""
    probe = rounding_probe(batch)
    if isinstance(probe, str):
        return [CheckResult("rounding.skipped", True, detail=f"no rounding probe: {probe}")]
    return _probe_run("rounding", probe.describe(), probe.batch, kernel, workers,
                      on_fail=" (P rounded more coarsely than declared, or scores that are not exact products)")


def _probe_run(name: str, where: str, probe: DecodeBatch, kernel: Kernel, workers: int, uniform_p: bool = False,
               on_fail: str = "") -> list[CheckResult]:
    """The kernel on a probe batch (the case's worker count when it takes one) against the oracle within
    `_tier1_bound` for the numerics it declares for the probe, both computed on the probe as built, before the
    kernel runs: checks ``name``.out and ``name``.lse, their details led by ``where`` and the declaration (its
    `KernelNumerics.describe`), ``on_fail`` appended to a failed ``name``.out's, `_LSE_HINT` to a failed
    ``name``.lse's (P's rounding does not reach the lse). A raise, a contract break or a write into the probe's
    inputs fails the check with its message (a device fault propagates)."""
    try:
        numerics = kernel.numerics(probe)
    except ValueError as e:  # Unsupported too: the kernel took the case, so its probe (same shapes and dtypes)
        return [CheckResult(name, False, detail=f"{where}: {e}")]
    ref = mla_decode_ref(probe)  # [T, H, L], [T, H] fp64
    bound = _tier1_bound(probe, kernel, numerics, ref, uniform_p)
    result, why = _watched(probe, lambda: _run(kernel, probe, workers))
    if why is not None:
        return [CheckResult(name, False, detail=f"{where}: {why}")]
    out, lse = _moved(*result, ref[0].device, copy=False)
    results = _with_rows(probe, check_tier1(out, lse, ref, bound, numerics.out_dtype, name=name))
    for r in results:
        hint = on_fail if r.name.endswith(".out") else _LSE_HINT
        r.detail = f"{where}; declared {numerics.describe()}: {r.detail}" + ("" if r.ok else hint)
    return results


_LSE_HINT = " (an lse other than ln Σ exp(σ q·k): its base, its scale, the scores, or the merge of the pieces)"


def check_rescale(batch: DecodeBatch, kernel: Kernel, workers: int) -> list[CheckResult]:
    """The kernel run again on `rescale_probe(batch)` (the case's worker count when it takes one), within the
    probe's tier-1 bound for the numerics the kernel declares for it: the running max rises every 16 tokens (a
    staircase of levels) and then at a riser whose value cancels the tokens before it, so that the factor
    exp(m_old - m_new) rescaling the running output rounded more coarsely than the declared P (bf16 under fp32)
    fails, which on drawn data it does not, nor on the rounding probe, whose max never rises
    (verify/rescale_probe.py)."""
    probe = rescale_probe(batch)
    if isinstance(probe, str):
        return [CheckResult("rescale.skipped", True, detail=f"no rescale probe: {probe}")]
    return _probe_run("rescale", probe.describe(), probe.batch, kernel, workers,
                      on_fail=" (a running output rescaled by exp(m_old - m_new) rounded more coarsely than declared)")


def check_partials(batch: DecodeBatch, kernel: Kernel, workers: int) -> list[CheckResult]:
    """The kernel run again on `partials_probe(batch)` (the case's worker count when it takes one), within the
    probe's tier-1 bound for the numerics the kernel declares for it, P's rounding charged as a common factor (all
    scores are 0: kernel_bound's uniform_p) and the merge with the declared partial_dtype: an output of about
    2^-8 / 3 while each split's partial is hundreds of times larger, so that split outputs stored more coarsely than
    declared (bf16 under fp32) fail, which on drawn data they seldom do; so do merges that weigh pieces of different
    lengths wrongly. Rows the kernel does not split have nothing to show; a kernel that declares no split
    (max_splits 1) is not probed (verify/partials_probe.py, numerics.md §5(i))."""
    if kernel.max_splits(batch) < 2:
        return [CheckResult("partials.skipped", True, detail="no partials probe: the kernel declares no split of this "
                                                      "batch (max_splits 1)")]
    probe = partials_probe(batch)
    if isinstance(probe, str):
        return [CheckResult("partials.skipped", True, detail=f"no partials probe: {probe}")]
    return _probe_run("partials", probe.describe(), probe.batch, kernel, workers, uniform_p=True,
                      on_fail=" (split outputs stored more coarsely than declared, a merge that weighs pieces of "
                              "different lengths wrongly, or a P that is not one value per row)")


def far_pages(batch: DecodeBatch, beyond: int = FAR_ELEMENTS, below: int = 2, page_ids: int = FAR_PAGE_IDS
              ) -> DecodeBatch:
    """``batch`` with its cache moved to the end of a larger one: used page p becomes page p + shift, where shift
    leaves pages below min(``below``, the largest used page) starting under element ``beyond`` and with ids under
    ``page_ids``, and every later page past both, so at least one used page lies past them. The pages in front hold
    NaN (fp8: the format's NaN code) and nobody owns them, so a kernel that reads a wrapped offset, or a page id
    kept in 16 bits, reads NaN or faults. The lengths are the same, so a planned kernel makes the same plan; unused
    block-table entries keep their values. Allocates (shift + P) pages: past 2^31 elements, 4.3 GB of bf16, 2.1 GB
    of fp8; on pages of more than 56 DeepSeek-V3 tokens (576 elements) 2^16 pages are more: 4.8 GB of bf16 on pages
    of 64, 9.7 GB on pages of 128. One host sync."""
    for name, value, least in (("beyond", beyond, 1), ("below", below, 0), ("page_ids", page_ids, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"far_pages.{name}: expected an int >= {least}, got {value!r}")
    kv = batch.kv_cache  # [P, ps, D]
    per_page = kv.shape[1] * kv.shape[2]  # elements per page
    used = batch.used_entries  # [B, max_pages]
    last = int(torch.where(used, batch.block_table, 0).max()) if used.numel() else 0  # the largest used page
    first = max(-(-beyond // per_page), page_ids)  # the first page past both element `beyond` and id `page_ids`
    shift = max(0, first - min(below, last))  # page p lands there or past it iff p >= min(below, last)
    far = torch.empty((shift + kv.shape[0],) + tuple(kv.shape[1:]), dtype=kv.dtype, device=kv.device)  # [P', ps, D]
    far[:shift] = torch.tensor(float("nan")).to(kv.dtype)  # the format's NaN code (e4m3fnuz: 0x80)
    far[shift:] = kv
    table = torch.where(used, batch.block_table + shift, batch.block_table)  # [B, max_pages] int32
    return batch.replace(kv_cache=far, block_table=table)


def _out_of_memory(e: BaseException) -> bool:
    """An allocation that failed for want of memory: torch.OutOfMemoryError (CUDA), or the CPU allocator's
    RuntimeError."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def check_far(batch: DecodeBatch, kernel: Kernel, workers: int, first: tuple, ref, bound: bounds.Bound,
              out_dtype: torch.dtype) -> list[CheckResult]:
    """The kernel run again on ``far_pages(batch)`` (the case's worker count when it takes one): a production cache
    is many GB, and an element offset page x page_stride computed in int32 wraps past 2^31 (3.7 M bf16 tokens of
    576), a page id kept in 16 bits past 2^16 pages (the cache goes past both where 2^16 pages take at most
    FAR_PAGE_ID_ELEMENTS, else past element 2^31 alone, and the check's detail says which). Passes with the bits of
    the first run ``first`` (out, lse); a kernel whose bits vary from run to run passes within the tier-1 bound
    instead. A wrapped offset or page id reads the NaN in front (or outside the cache). The far cache goes back
    to the device when the check ends (`release_cached`): the campaign's other worker processes share the GPU. A
    far cache, or a run on it, that does not fit in memory fails the check and says so."""
    with _releasing(batch.device):  # after _far_run has returned: its frame, and so the far cache, is gone
        return _far_run(batch, kernel, workers, first, ref, bound, out_dtype)


def _far_run(batch: DecodeBatch, kernel: Kernel, workers: int, first: tuple, ref, bound: bounds.Bound,
             out_dtype: torch.dtype) -> list[CheckResult]:
    """check_far's run (its docstring)."""
    per_page = batch.kv_cache[0].numel()  # elements per page
    ids = FAR_PAGE_IDS if FAR_PAGE_IDS * per_page <= FAR_PAGE_ID_ELEMENTS else 0  # 0: past element 2^31 only
    past_what = "element 2^31" + (" and page id 2^16" if ids else
                                  f" (not page id 2^16: {FAR_PAGE_IDS} pages of {per_page} elements would be "
                                  f"{FAR_PAGE_IDS * per_page / 2**30:.0f} Gi-elements)")
    try:
        far = far_pages(batch, page_ids=ids)
    except RuntimeError as e:  # torch.OutOfMemoryError too; not a kernel failure, but the check needs its cache
        if not _out_of_memory(e):
            raise
        return [CheckResult("far", False, detail=f"the far cache (past {past_what}) {_no_room(batch, e)}")]
    raw, exc = _run(kernel, far, workers)
    if exc is not None and is_device_fault(exc):
        raise exc  # before anything here touches the device, which now fails every call
    offsets = far.block_table.long() * far.kv_cache.stride(0)  # [B, max_pages] first element of each page
    used = far.used_entries  # [B, max_pages]
    past, n_used = torch.stack([(used & (offsets >= FAR_ELEMENTS) & (far.block_table >= ids)).sum(),
                                used.sum()]).tolist()
    where = f"{past} of {n_used} used pages past {past_what} of a {far.kv_cache.numel() / 2**30:.2f} Gi-element cache"
    if exc is not None and _out_of_memory(exc):
        return [CheckResult("far", False, detail=f"{where}: the run {_no_room(batch, exc)}")]
    second, why = _outputs_of((raw, exc), far)
    if why is not None:
        return [CheckResult("far", False, detail=f"{where}: {why}")]
    return _as_first("far", where, second, "the run on the compact cache", first, ref, lambda: (bound, out_dtype),
                     rows_of=batch)


@contextlib.contextmanager
def _releasing(device: torch.device):
    """`release_cached` when the block ends; when it ends by an exception (a device fault among them), a failure of
    the release itself is not allowed to replace that exception."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            release_cached(device)
        raise
    release_cached(device)


def _no_room(batch: DecodeBatch, e: BaseException) -> str:
    return (f"does not fit on {batch.device} beside this process's other memory: {error_message(e)}; run fewer "
            "--jobs, or --far off")


def release_cached(device: torch.device) -> None:
    """Hand the memory a check freed (the far cache, the step's buffers and graph) back to the device. PyTorch's
    caching allocator keeps a freed block for its own process, and far caches differ in size from case to case, so
    each worker hoarded several 2-4 GB blocks: FlashMLA's bf16 campaign on 14 GPU jobs filled an H200's 139 GB for
    seconds at a time without this, and peaked at 19 GB with it, in the same time (one H200, forty-eighth session)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_repeat(batch: DecodeBatch, kernel: Kernel, workers: int, first: tuple, ref, bound: bounds.Bound,
                 out_dtype: torch.dtype) -> list[CheckResult]:
    """The kernel run a second time on the same batch with the same worker count. A kernel that declares itself
    deterministic (`Kernel.deterministic`, the default: our kernels and plans, and what vLLM's batch-invariant and
    reproducible modes need) must give the first run's bits, NaN included; one that declares run-to-run variation
    by design (split outputs merged by atomics, work stealing) passes within the tier-1 ``bound`` instead. Only a
    second run tells: every other rerun changes the inputs or the plan."""
    where = "a second run on the same batch"
    second, why = _outputs_of(_run(kernel, batch, workers), batch)
    if why is not None:
        return [CheckResult("repeat", False, detail=f"{where}: {why}")]
    return _as_first("repeat", where, second, "the first run", first, ref,
                     _same_bits_judge(kernel, bound, out_dtype, "the kernel declares itself deterministic"),
                     rows_of=batch)


def _same_bits_judge(kernel: Kernel, bound: bounds.Bound, out_dtype: torch.dtype, what: str):
    """The judge of a rerun on values a kernel must not see (`_as_first`'s ``judge``): a deterministic kernel must
    give the first run's bits (``what`` says why they may not change), one declared nondeterministic must stay in
    the tier-1 ``bound``."""
    if kernel.deterministic:
        return lambda: (f"{what} (a plug-in that varies by design sets .deterministic = False: the check then takes "
                        "the tier-1 bound)")
    return lambda: (bound, out_dtype)


def check_padding(batch: DecodeBatch, kernel: Kernel, workers: int, first: tuple, ref, bound: bounds.Bound,
                  out_dtype: torch.dtype) -> list[CheckResult]:
    """The kernel run again (the case's worker count when it takes one) on `padding_probe(batch, lse)`: the unused
    slots of each request's last page hold finite tokens that its rows score up to 200 nats above their lse, where
    the case has NaN. A kernel that reads no slot past a request's length gives the bits of its first run
    ``first``; one whose max runs over them before the mask (NaN-blind, so the NaN padding hid it) moves, and its
    rows' own tokens flush to 0 (verify/padding_probe.py). A kernel declared nondeterministic: the tier-1 ``bound``.
    No unused slot in the case: ``padding.skipped``."""
    probe = padding_probe(batch, ref[1])
    if isinstance(probe, str):
        return [CheckResult("padding.skipped", True, detail=f"no padding probe: {probe}")]
    where = probe.describe()
    second, why = _watched(probe.batch, lambda: _run(kernel, probe.batch, workers))
    if why is not None:
        return [CheckResult("padding", False, detail=f"{where}: {why}")]
    judge = _same_bits_judge(kernel, bound, out_dtype, "the slots past each request's length changed the result: the "
                                                   "kernel reads them (a max over loaded slots before the mask?)")
    results = _as_first("padding", where, second, "the run on the NaN-padded cache", first, ref, judge,
                        rows_of=probe.batch)
    if kernel.deterministic and not all(r.ok for r in results):
        which = _padding_read(batch, kernel, workers, first, ref[1])
        for r in results:
            r.detail += "" if r.ok else f"\n  {which}"
    return results


def _padding_read(batch: DecodeBatch, kernel: Kernel, workers: int, first: tuple, lse: torch.Tensor) -> str:
    """Which read a failed padding check saw, from one more run of a deterministic kernel on the probe's edge pages
    alone (its last pages' unused slots left NaN): the first run's bits there mean the unused slots of a request's
    last page; other bits, the block-table entries past a request's last page (page 0 or the page after)."""
    edges = padding_probe(batch, lse, last_pages=False)
    got, why = _watched(edges.batch, lambda: _run(kernel, edges.batch, workers))
    if why is not None:
        return f"(the run on the edge pages alone, to tell which read moved it: {why})"
    if _same_bits(_moved(*got, first[0].device, copy=False), first):
        return ("the edge pages alone (page 0 and the last, hostile; the last pages' unused slots NaN) keep the "
                "bits: the kernel reads the unused slots of a request's last page")
    return ("the edge pages alone (page 0 and the last, hostile; the last pages' unused slots NaN) move the bits "
            "too: the kernel reads block-table entries past a request's last page (as page 0, or the page after)")


def check_rerun(batch: DecodeBatch, kernel: Kernel, workers: int, first: tuple, ref, bound: bounds.Bound,
                out_dtype: torch.dtype) -> list[CheckResult]:
    """The kernel called as a serving loop without CUDA graphs calls it: on copies of the batch's tensors with
    room to grow (`next_step.with_room`), against the case's run ``first`` (``rerun.room``: the bits, else the tier-1
    ``bound``: a wider block table may take another path), then on the same tensors after the next decode step was
    written into them in place (`next_step.next_layout` and `next_values`: requests rotated, one grown onto the
    spare pages, the longest halved, one emptied, the slots only the old step read set to NaN, q negated, new
    tokens; an fp8 q's scale doubled, as a dynamic q scale changes from step to step): ``rerun.out`` / ``.lse``
    against the oracle on the new contents, within their tier-1 bound; then once more after a plain decode step
    (`next_step.decode_layout` and `decode_values`: the same requests, each non-empty one grown by its q_len tokens
    that each weigh about 1/2 in their query row): ``rerun.decode.out`` / ``.lse``. An eager call that memoises what
    it derived from its inputs by their identity or address (a plan keyed by data_ptr, a converted cache), or that
    keeps such a plan while the same requests grow by at most their q_len, decodes the old step there; every other
    check passes it new tensors or the same contents. A kernel that refuses a batch (`Unsupported` from its run or
    its numerics: the next step empties a request and grows one past twice the longest, which some kernels do not
    take) passes as ``rerun.refused``, and the report warns."""
    static, first_spare = next_step.with_room(batch)
    here = "the run on a copy with room to grow"
    got, why = _refusable(static, kernel, workers)
    if isinstance(why, Unsupported):
        return [CheckResult("rerun.refused", True, detail=f"{here}: refused: {error_message(why)}")]
    if why is not None:
        return [CheckResult("rerun.room", False, detail=f"{here}: {why}")]
    results = _as_first("rerun.room", here, got, "the case's run", first, ref, lambda: (bound, out_dtype),
                        rows_of=static)
    where, new_slots = next_step.next_layout(static, first_spare)
    where = f"the same tensors rewritten in place as the next step: {where}, {next_step.next_values(static, new_slots)}"
    if is_fp8(static.q.dtype) and static.q_scale is not None:  # a dynamic fp8 q's scale changes every step
        static = static.replace(q_scale=2 * static.q_scale)
        where += ", q_scale doubled"
    results += _rerun_step(static, kernel, workers, "rerun", where)
    if any(r.name == "rerun.refused" for r in results):
        return results
    where, old_lens = next_step.decode_layout(static, first_spare)
    where = f"the same tensors rewritten in place as the step after: {where}, "
    where += next_step.decode_values(static, old_lens)
    return results + _rerun_step(static, kernel, workers, "rerun.decode", where)


def _rerun_step(static: DecodeBatch, kernel: Kernel, workers: int, name: str, where: str) -> list[CheckResult]:
    """One eager call of check_rerun's on ``static`` rewritten in place (as ``where`` says): ``name``.out / .lse
    against the oracle on the new contents within their tier-1 bound, ``name`` failed when the call or its numerics
    gave nothing to judge, or ``rerun.refused``."""
    try:
        numerics = kernel.numerics(static)
    except Unsupported as e:  # a batch outside the kernel's scope (a length cap its numerics enforce, say)
        return [CheckResult("rerun.refused", True, detail=f"{where}: refused: {error_message(e)}")]
    except ValueError as e:
        return [CheckResult(f"{name}.out", False, detail=f"{where}: the kernel's numerics raised {e}")]
    ref_next = mla_decode_ref(static)  # [T, H, L], [T, H] fp64 on the new contents
    got, why = _refusable(static, kernel, workers)
    if isinstance(why, Unsupported):  # a batch outside the kernel's scope (an emptied request, say)
        return [CheckResult("rerun.refused", True, detail=f"{where}: refused: {error_message(why)}")]
    if why is not None:
        return [CheckResult(f"{name}.out", False, detail=f"{where}: {why}")]
    judge = (_tier1_bound(static, kernel, numerics, ref_next), numerics.out_dtype)
    return _tier1_of(static, got, ref_next, judge, name, where)


def _tier1_of(batch: DecodeBatch, got: tuple, ref, judge: tuple[bounds.Bound, torch.dtype], name: str,
              where: str) -> list[CheckResult]:
    """A later run's (out, lse) ``got`` on ``batch`` against the oracle ``ref`` within ``judge`` (its tier-1 bound
    and output dtype): ``name``.out / .lse, a failure's row named as request and query row, each detail led by
    ``where``."""
    out, lse = _moved(*got, ref[0].device, copy=False)
    results = _with_rows(batch, check_tier1(out, lse, ref, *judge, name=name))
    for r in results:
        r.detail = f"{where}: {r.detail}"
    return results


def check_batch(batch: DecodeBatch, kernel: Kernel, workers: int, first: tuple, ref) -> list[CheckResult]:
    """The kernel run again on `regrouped_batches(batch)` (the case's worker count when it takes one): the case's
    requests reversed, the first dropped, the longest added and a longer request on its pages (``batch``), with two or
    more requests reversed without every request of the longest length (``batch.shrunk``), and the requests without
    every request of the largest q_len, or where every request has the same q_len n beside a request of n + 1 rows
    (``batch.mtp``), so that the batch's size, tokens, longest length and largest q_len change and the requests move;
    then `shared_batch(batch)`: the requests as they are among siblings of the longest on its pages with its q
    rows negated (``batch.shared``: one prefix's pages read with other queries, prefix caching). Each row of a case's
    request against the row of the case's run ``first`` it comes from (an added request's rows, which no case row stands
    behind, against the oracle on the added requests, `_added_rows`: ``batch.added``, ``batch.mtp.added``,
    ``batch.shared.added``, within their tier-1 bound): a
    kernel that declares itself batch-invariant (`Kernel.batch_invariant`) must give its bits, NaN included; any
    other passes within the tier-1 bound of the numerics it declares for the regrouped batch, with the most splits
    the kernel may give a row of it (a split-KV plan cuts a request where the whole batch puts the cuts). A kernel
    that refuses a regrouped batch (`Unsupported` from its run or its numerics) passes as ``batch.refused`` /
    ``batch.shrunk.refused`` / ``batch.mtp.refused`` / ``batch.shared.refused``, and the report warns."""
    results = []
    shared = shared_batch(batch)
    for regrouped in regrouped_batches(batch) + ([shared] if shared is not None else []):
        name = {"grown": "batch", "shrunk": "batch.shrunk", "mtp": "batch.mtp", "shared": "batch.shared"}[regrouped.how]
        where = regrouped.describe()
        got, why = _refusable(regrouped.batch, kernel, workers)
        if isinstance(why, Unsupported):
            results.append(CheckResult(f"{name}.refused", True, detail=f"{where}: refused: {error_message(why)}"))
            continue
        if why is not None:
            results.append(CheckResult(name, False, detail=f"{where}: {why}"))
            continue
        whole, got = got, tuple(map(regrouped.case_rows, got))  # [T'', H, L], [T'', H]: the case's requests' rows
        first_rows = tuple(t if t is None else t.index_select(0, regrouped.rows.to(t.device)) for t in first)
        ref_rows = tuple(t.index_select(0, regrouped.rows.to(t.device)) for t in ref)  # the oracle's, reindexed
        numerics = None
        if not kernel.batch_invariant:
            try:
                numerics = kernel.numerics(regrouped.batch)
            except Unsupported as e:  # a batch outside the kernel's scope (a cap on requests its numerics enforce)
                results.append(CheckResult(f"{name}.refused", True, detail=f"{where}: refused: {error_message(e)}"))
                continue
            except ValueError as e:  # the kernel ran on the regrouped batch, so its numerics must take it
                results.append(CheckResult(name, False, detail=f"{where}: the kernel's numerics for the regrouped "
                                                               f"batch raised {error_message(e)}"))
                continue

        def judge(regrouped=regrouped, numerics=numerics, ref_rows=ref_rows):
            if numerics is None:
                return ("the kernel declares itself batch-invariant (a plug-in whose rows may vary with their batch "
                        "leaves .batch_invariant False, the default: the check then takes the tier-1 bound)")
            return (_tier1_bound(regrouped.compared, kernel, numerics, ref_rows, splits_of=regrouped.batch),
                    numerics.out_dtype)

        results += _as_first(name, where, got, "the case's run", first_rows, ref_rows, judge,
                             rows_of=lambda t, rows=regrouped.rows: "case " + _row_words(batch, int(rows[t])))
        if regrouped.added:
            results += _added_rows(regrouped, whole, kernel, numerics, f"{name}.added", where)
    return results


def _added_rows(regrouped, got: tuple, kernel: Kernel, numerics: KernelNumerics | None, name: str,
                where: str) -> list[CheckResult]:
    """The rows a regrouped batch's run ``got`` gives its added requests (`RegroupedBatch.added_batch`: no case row
    stands behind them) against the oracle on them, within the tier-1 bound of the numerics the kernel declares for
    the regrouped batch (``numerics``; None: asked here, a batch-invariant kernel's): ``name``.out / .lse."""
    added, rows = regrouped.added_batch()
    if numerics is None:
        try:
            numerics = kernel.numerics(regrouped.batch)
        except ValueError as e:  # Unsupported too: the kernel ran on the batch, so its numerics must take it
            return [CheckResult(f"{name}.out", False, detail=f"{where}: the kernel's numerics for the regrouped "
                                                              f"batch raised {error_message(e)}")]
    ref = mla_decode_ref(added)  # [t, H, L], [t, H] fp64
    got = tuple(t if t is None else t.index_select(0, rows.to(t.device)) for t in got)  # [t, H, L], [t, H]
    judge = (_tier1_bound(added, kernel, numerics, ref, splits_of=regrouped.batch), numerics.out_dtype)
    return _tier1_of(added, got, ref, judge, name, f"{where}; its added requests {list(regrouped.added)} as a batch "
                                                   "of their own (its request i: the i-th of them), against the oracle")


def _refusable(batch: DecodeBatch, kernel: Kernel, workers: int) -> tuple[tuple | None, str | Unsupported | None]:
    """`_watched` of the kernel's run on ``batch``, except that an `Unsupported` it raises is returned as it is (in
    the place of why there are no outputs), for the caller to pass as a refusal."""
    before = input_snapshot(batch)
    run = _run(kernel, batch, workers)
    if isinstance(run[1], Unsupported):
        return None, run[1]
    return _watched(batch, lambda: run, before)


def _as_first(name: str, where: str, second: tuple, earlier: str, first: tuple, ref,
              judge: Callable[[], tuple[bounds.Bound, torch.dtype] | str],
              rows_of: DecodeBatch | Callable[[int], str] | None = None) -> list[CheckResult]:
    """A second run (out, lse) on the values of the first run ``first`` (``earlier`` names it: "the run on the
    contiguous inputs"), in another memory layout or the same: passes with the first run's bits; otherwise within
    the tier-1 bound and output dtype ``judge()`` gives (computed only then; a kernel whose bits vary from run to
    run, or that takes another code path for this layout): checks ``name``.out and ``name``.lse. ``judge()`` may
    instead return why different bits are not allowed, which fails check ``name`` with where they first differ.
    ``rows_of``: the batch whose rows ``first`` holds (or a callable naming row t), to name a failure's row as
    request and query row."""
    out, lse = second
    if (lse is None) != (first[1] is None):
        return [CheckResult(name, False, detail=f"{where}: lse returned by only one of this run and {earlier}")]
    out, lse = _moved(out, lse, first[0].device, copy=False)
    dtypes = [t.dtype for t in (out, lse) if t is not None]
    if dtypes != [t.dtype for t in first if t is not None]:  # no bits to compare: only a bound can judge it
        differ = (f"this run returned {', '.join(map(str, dtypes))} where {earlier} returned "
                  f"{', '.join(str(t.dtype) for t in first if t is not None)}")
        moved_row = None
    elif _same_bits((out, lse), first):
        return [CheckResult(name, True, detail=f"{where}: the bits of {earlier}")]
    else:
        differ = f"{_elements_differ(out, first[0])} out elements differ from {earlier}"
        if lse is not None:
            differ += f", {_elements_differ(lse, first[1])} lse elements"
        located, moved_row = _first_difference(out, lse, first)
        differ += f" ({located})"
    judged = judge()
    if isinstance(judged, str):
        if rows_of is not None and moved_row is not None:
            differ += f", the first {_named_row(rows_of, moved_row)}"
        return [CheckResult(name, False, detail=f"{where}, {differ}: {judged}")]
    results = _with_rows(rows_of, check_tier1(out, lse, ref, *judged, name=name))
    for r in results:
        r.detail = f"{where}, {differ}: {r.detail}"
    return results


def _first_difference(out: torch.Tensor, lse: torch.Tensor | None, first: tuple) -> tuple[str, int | None]:
    """Where two runs' results (of one dtype each) first differ in their bits, out before lse: ("first at
    out[t, h, c]: a vs b" (this run's value first; their bits in hex too where the values print alike, as NaNs of
    other payloads do), its query row t), or ("", None) when they do not."""
    for name, a, b in (("out", out, first[0]), ("lse", lse, first[1])):
        if a is None:
            continue
        hits = _moved_elements(a, b).nonzero()  # [moved, 1] flat element indices
        if hits.numel():
            i = int(hits[0])
            index = [int(k) for k in torch.unravel_index(torch.tensor(i), a.shape)]
            x, y = repr(a.reshape(-1)[i].item()), repr(b.reshape(-1)[i].item())
            if x == y:  # little-endian bytes, printed most significant first
                x, y = (f"{x} (0x{bytes(_bytes(t).view(t.numel(), -1)[i].tolist()[::-1]).hex()})" for t in (a, b))
            return f"first at {name}[{', '.join(map(str, index))}]: {x} vs {y}", index[0]
    return "", None


def check_layout(batch: DecodeBatch, kernel: Kernel, workers: int, first: tuple, ref) -> list[CheckResult]:
    """The kernel run again on `strided_batch(pages_in_use_order(batch))` (the case's worker count when it takes
    one): the same values with each request's pages consecutive and in order, and q, the cache and the block table
    as views into NaN-padded buffers, their strides all but the channels' changed (verify/strided_inputs.py).
    Passes with the bits of the first run ``first``, else within the tier-1 bound of the numerics it declares for
    the strided batch (a backend may take another kernel for strided inputs or consecutive pages); a kernel that
    addresses its inputs by their shapes reads NaN or other requests' tokens, and one whose fast path for
    consecutive pages reads past a request's last token reads NaN. A kernel may refuse strides it does not take
    with a ValueError (`Unsupported` too): check ``layout.refused`` then passes and says why (mla-verify warns), for
    a kernel that honours some strides and refuses others is within the contract.
    Writing into the buffers (their padding included) fails."""
    strided = strided_batch(pages_in_use_order(batch))
    where = "pages in use order; " + strided.describe()
    before = {name: _bytes(buf).clone() for name, buf in strided.buffers.items()}
    raw, exc = _run(kernel, strided.batch, workers)
    if isinstance(exc, ValueError):
        return [CheckResult("layout.refused", True, detail=f"{where}: refused: {error_message(exc)}")]
    second, why = _outputs_of((raw, exc), strided.batch)
    written = _changed(strided.buffers, before)
    if why is None and written:
        why = "the kernel wrote into its input buffers: " + ", ".join(written)
    if why is not None:
        return [CheckResult("layout", False, detail=f"{where}: {why}")]

    def judge():
        try:
            numerics = kernel.numerics(strided.batch)
        except ValueError as e:  # Unsupported too: the kernel ran on the strided batch, so its numerics must take it
            return f"the kernel's numerics for the strided batch raised {error_message(e)}"
        return _tier1_bound(strided.batch, kernel, numerics, ref), numerics.out_dtype

    return _as_first("layout", where, second, "the run on the contiguous inputs", first, ref, judge, rows_of=batch)


def check_step(batch: DecodeBatch, kernel: Kernel, first: tuple, ref, bound: bounds.Bound,
               out_dtype: torch.dtype) -> list[CheckResult]:
    """The kernel's graph-capturable step (`Kernel.step`) driven as a serving engine drives it, on copies of the
    batch's tensors with room to grow (`verify.next_step.with_room`): built, planned and run: ``step``, against the
    case's first run ``first`` (the bits, else the tier-1 ``bound``: a step may take another path, e.g. always a
    reduce); on CUDA, run() captured in a CUDA graph and replayed into outputs poisoned with NaN: ``step.graph``,
    the eager run's bits for a deterministic kernel (a capture that fails fails it, and says why); then the next
    decode step: its lengths, q_lens and block table written in place (`next_step.next_layout`: requests rotated,
    one grown past twice the old longest, the longest halved, one emptied, the slots only the old step read set to
    NaN), planned again, its new q and new tokens written (`next_values`, after the plan, as a serving step's graph
    writes them), replayed (on a CPU run again) into poisoned outputs: ``step.replan.out`` / ``.lse`` against the
    oracle on the new contents, within their tier-1 bound. A step that bakes the captured step into its launch (a
    plan made once, a grid sized by the captured lengths, q or the cache copied when it plans) fails the last. Then
    the step after that one (`_decode_step`, ``step.decode.out`` / ``.lse``): the same requests, each non-empty one
    grown by its q_len tokens, planned, its new tokens (each built to weigh about 1/2 in its query row) written after
    the plan, replayed, against the oracle: a plan() that keeps its pieces for the same requests a few tokens longer
    fails it. On CUDA the replan's replay runs while tensors of ours hold every block the caching allocator has free
    (`verify.freed_memory`): ``step.freed`` fails if it wrote any, as a graph does whose buffer plan() replaced;
    one that reads such a buffer (a scale or metadata tensor made anew by each plan) reads NaN / -1 bytes there.
    Under an allocator other than torch's native one (cudaMallocAsync has no snapshot) step.freed does not run.
    Bounds take the step's own ``numerics`` (a KernelNumerics, or a callable of the batch) where it declares them
    (a step fixes its kernel when built, while the kernel's numerics(batch) follow each batch), else the kernel's.
    A plan() that writes into the step's inputs fails ``step`` (the first plan), ``step.replan`` or ``step.decode``,
    as a run() that does, or returns a view of them, fails its check. A step that refuses the batch, or a later step
    (`Unsupported`), passes as ``step.refused``."""
    with _releasing(batch.device):  # after _drive_step has returned: the step, its buffers and graph are gone
        return _drive_step(batch, kernel, first, ref, bound, out_dtype)


def _poisoned(result, inputs: dict[str, torch.Tensor]) -> str | None:
    """NaN into a run's returned out (and lse), so that the next run must write them or its stale values show; or,
    where a returned tensor shares storage with one of ``inputs`` (the step's batch tensors), why not."""
    tensors = [t for t in (result if isinstance(result, (tuple, list)) else (result,))
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    storages = {t.untyped_storage().data_ptr(): name for name, t in inputs.items()}
    for t in tensors:
        if t.untyped_storage().data_ptr() in storages:
            return f"run() returned a view of its batch's {storages[t.untyped_storage().data_ptr()]}"
    for t in tensors:
        next_step.nan_fill_(t)
    return None


def _capture(step, device: torch.device) -> tuple[tuple | None, Exception | None]:
    """((run()'s result captured in a CUDA graph, the graph), None), or (None, why the capture failed). On a stream
    of its own, restored however the capture ends (torch.cuda.graph leaves its stream current when capture_end
    raises); the reported error is run()'s own where it raised (a host sync, say), not capture_end's that follows
    it. An invalid capture may leave its private memory pool allocated. A device fault propagates: after a failed
    capture the device must still synchronize."""
    graph, failure, captured = torch.cuda.CUDAGraph(), None, None
    torch.cuda.synchronize(device)
    with torch.cuda.stream(torch.cuda.Stream(device)):
        graph.capture_begin()
        try:
            captured = step.run()
        except Exception as e:
            failure = e
        try:
            graph.capture_end()
        except Exception as e:
            failure = failure or e
    if failure is None:
        return (captured, graph), None
    try:
        torch.cuda.synchronize(device)
    except Exception:
        raise failure from None
    return None, failure


def _drive_step(batch: DecodeBatch, kernel: Kernel, first: tuple, ref, bound: bounds.Bound,
                out_dtype: torch.dtype) -> list[CheckResult]:
    """check_step's runs (its docstring)."""
    static, first_spare = next_step.with_room(batch)  # the step's own buffers, written below
    inputs = {name: getattr(static, name) for name in _INPUTS}
    device = static.device
    max_q_len = max(int(static.q_lens.max()), 1) if static.batch_size else 1
    try:
        step = kernel.step(static, max_q_len)
        why = _planned(step, static)
    except Exception as e:
        if is_device_fault(e):
            raise
        if isinstance(e, Unsupported):
            return [CheckResult("step.refused", True, detail=f"refused: {error_message(e)}")]
        return [CheckResult("step", False, detail=f"building or planning the step raised {error_message(e)}")]
    if why is not None:
        return [CheckResult("step", False, detail=f"the step's first plan: {why}")]
    result, why = _watched(static, lambda: _call(step.run, device=device))
    if why is None:
        eager = _moved(*result, first[0].device)  # a copy: run() may return its own buffers, which later runs write
        why = _poisoned(result, inputs)
    if why is not None:
        return [CheckResult("step", False, detail=f"the step's run(): {why}")]
    declared = getattr(step, "numerics", None)  # a step that fixes its kernel when built says how that one rounds

    def step_bound(b: DecodeBatch, ref_b) -> tuple[bounds.Bound, torch.dtype] | str:
        """The tier-1 bound and out dtype for batch ``b`` of the numerics the step rounds with, or why none."""
        try:
            numerics = declared(b) if callable(declared) else declared if declared is not None else kernel.numerics(b)
        except Exception as e:
            if is_device_fault(e):
                raise
            return f"the step's numerics raised {error_message(e)}"
        if not isinstance(numerics, KernelNumerics):
            return (f"step.numerics: expected a KernelNumerics or a callable (batch) -> KernelNumerics, got "
                    f"{type(numerics).__name__}")
        return _tier1_bound(b, kernel, numerics, ref_b), numerics.out_dtype

    step_judge = (bound, out_dtype) if declared is None else step_bound(static, ref)
    if isinstance(step_judge, str):
        return [CheckResult("step", False, detail=step_judge)]
    results = _as_first("step", "the step's eager run", eager, "the case's run", first, ref, lambda: step_judge,
                        rows_of=static)
    replay, how = step.run, "run again"
    if device.type == "cuda":
        capture, failure = _capture(step, device)
        if failure is not None:
            return results + [CheckResult("step.graph", False, detail=f"run() could not be captured in a CUDA graph: "
                                                                      f"{error_message(failure)}")]
        captured, graph = capture

        def replay():
            graph.replay()
            return captured

        how = "replayed"
        why = _poisoned(captured, inputs)
        second, why = _watched(static, lambda: _call(replay, device=device)) if why is None else (None, why)
        if why is not None:
            return results + [CheckResult("step.graph", False, detail=f"a CUDA graph replay of run(): {why}")]
        results += _as_first("step.graph", "a CUDA graph replay of run() into outputs poisoned with NaN", second,
                             "the step's eager run", eager, ref,
                             (lambda: "a deterministic kernel's replay must give its eager run's bits")
                             if kernel.deterministic else (lambda: step_judge))
        _poisoned(captured, inputs)
    where, new_slots = next_step.next_layout(static, first_spare)
    where = f"the next step in place: {where}"
    if (ended := _replanned(step, static, "step.replan", where)) is not None:
        return results + ended
    # every block the caching allocator holds free once plan() has run, taken by poisoned tensors of ours before
    # anything else allocates (the oracle's results, or the byte copies of the inputs, in a block plan() freed
    # would show the replay's writes as a wrong oracle or as writes into the inputs), and given back before those
    # copies are compared (the comparisons allocate as much again)
    held = FreeBlocks.take(device) if device.type == "cuda" and FreeBlocks.supported() else None
    where += ", then " + next_step.next_values(static, new_slots) + " after plan()"
    ref_next = mla_decode_ref(static)  # [T, H, L], [T, H] fp64 on the new contents
    before, freed = input_snapshot(static), []

    def replay_and_release():
        nonlocal held
        run = _call(replay, device=device)
        if held is not None and run[1] is None:  # after a device fault nothing more runs on the device
            freed.extend(_freed_check(held, where))
        held = None
        return run

    got, why = _watched(static, replay_and_release, before)
    replan = _judged(static, "step.replan", f"{where}, {how}", ref_next, (got, why), step_bound)
    if any(r.name == "step.replan" for r in replan):  # the replay could not be judged: no step after it
        return results + freed + replan
    _poisoned(got, inputs)  # judged: the step's next replay must write them anew
    return results + freed + replan + _decode_step(static, step, first_spare, replay, how, step_bound)


def _judged(static: DecodeBatch, name: str, where: str, ref, watched: tuple, step_bound) -> list[CheckResult]:
    """A later step's replay, ``watched`` (`_watched`'s (result, why)), against the oracle ``ref`` on the step's
    contents within the tier-1 bound of the numerics the step rounds with (``step_bound``): ``name``.out / .lse, or
    ``name`` failed with why when the replay (or the step's numerics) gave nothing to judge; each detail led by
    ``where``."""
    got, why = watched
    judge = step_bound(static, ref) if why is None else None
    if why is None and isinstance(judge, str):
        why = judge
    if why is not None:
        return [CheckResult(name, False, detail=f"{where}: {why}")]
    return _tier1_of(static, got, ref, judge, name, where)


def _replanned(step, batch: DecodeBatch, name: str, where: str) -> list[CheckResult] | None:
    """``step.plan(batch)`` for a later step (check ``name``, its layout described by ``where``): None when it
    planned without writing into its inputs, else the results that end the step check there: ``step.refused`` for
    an `Unsupported` (a batch outside the step's declared scope, as its first plan may refuse), else ``name``
    failed, with why."""
    try:
        why = _planned(step, batch)
    except Exception as e:
        if is_device_fault(e):
            raise
        if isinstance(e, Unsupported):
            return [CheckResult("step.refused", True, detail=f"{where}: refused: {error_message(e)}")]
        return [CheckResult(name, False, detail=f"{where}: planning it raised {error_message(e)}")]
    return None if why is None else [CheckResult(name, False, detail=f"{where}: {why}")]


def _decode_step(static: DecodeBatch, step, first_spare: int, replay, how: str, step_bound) -> list[CheckResult]:
    """``step.decode`` (check_step's last step): the step after the replan's written in place
    (`next_step.decode_layout`: the same requests, each non-empty one grown by its q_len tokens), planned, its new
    tokens written after the plan (`decode_values`: each built to weigh about 1/2 in its query row), replayed into
    poisoned outputs, against the oracle on the new contents within its tier-1 bound (``step_bound``)."""
    where, old_lens = next_step.decode_layout(static, first_spare)
    where = f"the step after: {where}"
    if (ended := _replanned(step, static, "step.decode", where)) is not None:
        return ended
    where += ", then " + next_step.decode_values(static, old_lens) + " after plan()"
    ref = mla_decode_ref(static)  # [T, H, L], [T, H] fp64 on the new contents
    watched = _watched(static, lambda: _call(replay, device=static.device))
    return _judged(static, "step.decode", f"{where}, {how}", ref, watched, step_bound)


def _freed_check(held: FreeBlocks, where: str) -> list[CheckResult]:
    """``step.freed``: the replay after the second plan left the memory the allocator held free as it was. A step
    whose plan() replaced a buffer the graph captured (a workspace sized to the new plan, say) writes into the
    freed block: right answers, and whatever tensor next takes the block overwritten."""
    written = held.written()
    if written is not None:
        return [CheckResult("step.freed", False, detail=(
            f"{where}, replayed: the replay wrote into memory the caching allocator held free after plan(): "
            f"{written}: the graph still writes a buffer that plan() replaced"))]
    return [CheckResult("step.freed", True, detail=(
        f"the replay after the second plan left the {len(held.tensors)} free blocks held ({size_text(held.nbytes)}; "
        f"{size_text(held.left)} free not taken) as they were"))]


# ---- one case -----------------------------------------------------------------------------------------------------


_INPUTS = ("q", "kv_cache", "block_table", "seq_lens", "q_lens")  # the DecodeBatch tensors a kernel reads


def input_snapshot(batch: DecodeBatch) -> dict[str, torch.Tensor]:
    """Byte copies of the batch's input tensors, to tell afterwards whether a kernel wrote into them."""
    return {name: _bytes(t).clone() for name in _INPUTS if (t := getattr(batch, name)) is not None}


def check_inputs(batch: DecodeBatch, before: dict[str, torch.Tensor]) -> CheckResult:
    """The kernel left its inputs as they were, byte for byte (NaN padding included): a kernel that writes into q,
    the cache, the block table or the lengths corrupts the next decode step, and would make any comparison with an
    oracle computed afterwards meaningless."""
    changed = _changed({name: getattr(batch, name) for name in before}, before)
    if changed:
        return CheckResult("inputs", False, detail="the kernel wrote into its inputs: " + ", ".join(changed))
    return CheckResult("inputs", True, detail=f"{', '.join(before)} unchanged")


def _changed(tensors: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> list[str]:
    """"name (n bytes)" for each of ``tensors`` whose bytes differ from its byte copy in ``before``."""
    return [f"{name} ({int((_bytes(tensors[name]) != b).sum())} bytes)" for name, b in before.items()
            if not torch.equal(_bytes(tensors[name]), b)]


def _moved_elements(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[numel] bool: the elements of two tensors of one dtype and shape whose bits differ (NaN payloads included)."""
    return (_bytes(a) != _bytes(b)).view(a.numel(), a.element_size()).any(dim=1)


def _same_bits(a: tuple, b: tuple) -> bool:
    """Two runs' (out, lse) hold the same bits, NaN payloads included (an lse None in both, or in neither)."""
    return all((x is None) == (y is None) and (x is None or (x.dtype == y.dtype and x.shape == y.shape
                                                             and torch.equal(_bytes(x), _bytes(y))))
               for x, y in zip(a, b))


def _elements_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two tensors of one dtype and shape differ in their bits."""
    return int(_moved_elements(a, b).sum())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as raw bytes (NaN == NaN), [numel * itemsize] uint8."""
    flat = t.detach().contiguous().view(-1)  # [numel]
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element is contiguous whatever its stride, which view keeps
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def run_case(case: Case, kernel: Kernel, device: str = "cpu", far: bool | None = None) -> CaseResult:
    """Materialize ``case`` on ``device``, run ``kernel`` on it and apply every check. Never raises for kernel
    failures (they are failed checks; `Unsupported` makes an unsupported case; a device fault fails the case and sets
    ``device_fault``); raises only if the verifier itself breaks. The oracle runs before the kernel, on the inputs as
    built, and the ``inputs`` check fails a kernel that wrote into them (split runs included). ``far``: run the far
    check (None: on CUDA devices, where filling its 2-5 GB cache (9.7 GB on pages of 128) takes milliseconds; on a
    CPU it takes seconds)."""
    t0 = time.perf_counter()
    result = CaseResult(case)
    batch, batch_exact = case.materialize(device)
    try:
        numerics = kernel.numerics(batch)
        if isinstance(numerics, KernelNumerics):
            result.numerics, result.out_dtype = numerics.describe(), str(numerics.out_dtype).removeprefix("torch.")
        else:
            result.numerics = repr(numerics)
    except Unsupported as e:  # a plug-in's numerics(batch) may refuse the batch as its kernel would
        result.unsupported = str(e)
        result.seconds = time.perf_counter() - t0
        return result
    ref = mla_decode_ref(batch)  # fp64 oracle on the kernel's (dequantized) inputs, before the kernel can touch them
    before = input_snapshot(batch)
    raw, exc = _run(kernel, batch, case.num_workers)
    if isinstance(exc, Unsupported):
        result.unsupported = str(exc)
        result.seconds = time.perf_counter() - t0
        return result
    err = None if exc is None else error_message(exc)
    if exc is None:
        try:
            out, lse = outputs(raw, batch)
        except ValueError as e:
            err = str(e)
        if err is None and bounds._unit_roundoff(out.dtype) > bounds._unit_roundoff(numerics.out_dtype):
            err = (f"kernel out: {out.dtype} is coarser than the declared out_dtype {numerics.out_dtype}, whose "
                   f"rounding the bounds charge: declare it (KernelNumerics.out_dtype)")
    if err is not None:
        result.checks.append(CheckResult("contract", False, detail=err))
        result.device_fault = exc is not None and is_device_fault(exc)
        result.seconds = time.perf_counter() - t0
        return result
    given = "lse given" if lse is not None else "no lse"
    result.checks.append(CheckResult("contract", True, detail=f"out {out.dtype}, {given}"))

    try:
        out_d, lse_d = _moved(out, lse, ref[0].device)
        bound = _tier1_bound(batch, kernel, numerics, ref)  # tier 1 (and far)
        result.checks += _with_rows(batch, check_tier1(out_d, lse_d, ref, bound, numerics.out_dtype))
        result.checks.append(check_empty(batch, out_d, lse_d))
        result.checks.append(check_finite(batch, out_d, lse_d))
        result.checks += check_repeat(batch, kernel, case.num_workers, (out_d, lse_d), ref, bound,
                                      numerics.out_dtype)
        if case.is_fp8:
            result.checks += check_tier2(batch, batch_exact, ref)
        if kernel.run_workers is not None:
            result.checks += check_split(batch, kernel, numerics, (out_d, lse_d), case.num_workers, ref, bound)
        if not kernel.nan_deviation:  # a backend's declared deviation is in the campaign's report instead
            result.checks += check_nan(batch, kernel, case.num_workers)
        result.checks += check_rounding(batch, kernel, case.num_workers)
        result.checks += check_rescale(batch, kernel, case.num_workers)
        result.checks += check_partials(batch, kernel, case.num_workers)
        result.checks += check_layout(batch, kernel, case.num_workers, (out_d, lse_d), ref)
        result.checks += check_padding(batch, kernel, case.num_workers, (out_d, lse_d), ref, bound,
                                       numerics.out_dtype)
        result.checks += check_batch(batch, kernel, case.num_workers, (out_d, lse_d), ref)
        result.checks += check_rerun(batch, kernel, case.num_workers, (out_d, lse_d), ref, bound,
                                     numerics.out_dtype)
        if kernel.step is not None:
            result.checks += check_step(batch, kernel, (out_d, lse_d), ref, bound, numerics.out_dtype)
        if far if far is not None else batch.device.type == "cuda":
            result.checks += check_far(batch, kernel, case.num_workers, (out_d, lse_d), ref, bound, numerics.out_dtype)
        result.checks.append(check_inputs(batch, before))
    except Exception as e:
        if not is_device_fault(e):
            raise
        result.checks.append(CheckResult("device", False, detail=f"device fault: {error_message(e)}"))
        result.device_fault = True
    result.seconds = time.perf_counter() - t0
    return result
