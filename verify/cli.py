"""`mla-verify`: property-based verification of an MLA decode kernel against the fp64 oracle and derived bounds.

A campaign runs a fixed smoke prefix (`verify.strategies.smoke_cases`, then with ``--long`` the long cases,
`verify.strategies.long_cases`) and then Hypothesis-drawn cases (`verify.strategies.cases`) through
`verify.checks.run_case`. Human output (progress, summary) goes to stderr; the
JSON report goes to ``--json PATH`` (``-`` = stdout), written atomically.

Each case passes, fails, or is unsupported (the kernel raised `mla_fast.backends.Unsupported`: counted per reason,
neither passed nor failed). A device fault (CUDA/HIP error) stops the campaign at that case: the process's GPU context
is lost, so the remaining cases are reported as not run instead of as follow-on failures. ``--time-limit`` stops a
campaign the same way, without a failure. ``--profile search`` runs one Hypothesis search (`_search`), or with
``--jobs N`` N of them in worker processes (`_search_parallel`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from importlib import metadata

from mla_fast.backends import BACKENDS as REGISTRY
from mla_fast.report_path import unwritable
from verify.cases import FP8_FORMATS, Case
from verify.checks import CaseResult, CheckResult, is_device_fault, json_number
from verify.kernels import DeclarationError

SCHEMA_VERSION = 1
LOG_WIDTH = 140  # console columns when stderr is not a terminal (and $COLUMNS unset): the summary table whole
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOTHING_RAN = 0, 1, 2, 5
BACKENDS = ("auto", *REGISTRY)  # --backend choices: the registry's names, "auto" first
DEFAULT_CASES = {"ci": 200, "dev": 200, "search": 2000}

EPILOG = """\
profiles:
  ci      the same cases on every run (--seed, default 0); default 200 cases
  dev     a fresh random seed each run (printed; pass --seed to replay); default 200 cases
  search  hunts the worst err/bound: Hypothesis target() on every check, no shrinking; default 2000 cases;
          prints each check's worst case as a ready-to-paste @example(...) line; one search in this process,
          or with --jobs N, N searches side by side (seeds SEED..SEED+N-1, the cases split between them)

plug-in contract (--impl package.module:function):
  function(batch: mla_ref.decode.DecodeBatch) -> out  or  (out, lse)
    out [T, H, kv_lora_rank] any float dtype; lse [T, H] natural log, sm_scale included
    a row that sees no KV token: out 0, lse -inf
    batch.q, .kv_cache, .block_table may be strided views: honour their strides, or raise ValueError naming
    what it takes (the layout check then passes as layout.refused, and the report warns)
  optional: function.numerics = mla_fast.numerics.KernelNumerics(...) declares how it rounds; without it the
  bound assumes fp32 scores and P, fp32 accumulation, bf16 output (verify.kernels.DEFAULT_NUMERICS).
  Two runs on the same batch must give the same bits; function.deterministic = False declares run-to-run
  variation by design (atomics, work stealing), and the second run is then held to the tier-1 bound.
  function.max_splits = N or (batch) -> N: the most pieces any row is cut into (default: pieces of at least
  64 tokens), charged by the split-merge bound; a plug-in that cuts finer must declare it.
  function.run_workers = fn(batch, num_workers): the kernel over that many persistent workers; each case runs
  it with the case's worker count, and the split check with another.
  function.batch_invariant = True: a request's bits must not depend on its batch (the batch check regroups the
  requests and asks for them; else the tier-1 bound); needs deterministic.
  function.step = factory(batch, max_q_len) -> step with step.plan(batch) and step.run() -> out | (out, lse)
  (a CUDA-graph-capturable step): the step check builds, plans, runs, captures and replays it (on CUDA), then
  writes the next decode step into the same batch tensors, plans again and replays (verify.next_step);
  step.numerics (a KernelNumerics or a callable of the batch) for a step that fixes its kernel when built.
  A function attribute misspelling one of these is refused (verify.kernels: the whole contract).
  A plug-in that raises or returns the wrong shape or dtype fails its case with the message.
  For an input it has no kernel for, raise mla_fast.backends.Unsupported("reason"): the case is counted as
  unsupported under that reason (neither passed nor failed; keep case-specific values out of the reason).

outcomes:
  passed / failed / unsupported per case, counted in the summary and the JSON (unsupported: reason -> cases).
  A CUDA/HIP error (e.g. an illegal memory access) stops the campaign at the faulting case, printing its repro;
  the remaining cases are reported as not run. So does a worker process that dies (a kernel that crashes its
  process, exit 1), and --time-limit S once S seconds have passed, and -x at a failure, the exit code then that of
  the cases that ran. The JSON's "stopped" says why. --jobs 1 runs the cases in order in this process: with --json
  PATH the report there is rewritten before each case as if that case had ended the process, so a kernel that
  kills it leaves a report naming the case in flight, with its repro.

exit codes:
  0 every check held (unsupported cases aside)   1 a check failed or a device fault stopped the campaign
  2 bad usage or input   5 no case ran (backend or device unavailable, every case unsupported, or the
                          time limit passed before the first result)

examples:
  mla-verify --dtype fp8
  mla-verify --impl mypkg.mla:decode --dtype fp8 --json report.json --plot report.png
  mla-verify --case '{"seq_lens":[0,65],"q_lens":[1,2],"kv_dtype":"fp8","seed":3}' --backend emulated
  mla-verify model --help
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's code), no usage dump
        self.exit(EXIT_USAGE, f"mla-verify: error: {message} (see mla-verify --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


MAX_SEQ_LEN = 2**18  # longest --max-seq-len (DeepSeek-V3 serves 163840 tokens): the fp64 oracle and bounds of such a
# case hold a few GB; far longer ones fail to allocate, which a campaign would report as a failed case
MAX_CASE_HEADS = 1024  # most heads a --case may ask for (DeepSeek-V3 has 128): the oracle's grids grow with them
MAX_PAGE_SIZE = 4096  # largest page a case may fix (drawn: up to 64, smoke 128): every request holds whole pages
MAX_WIDTH = 4096  # widest latent or rope a campaign may fix (DeepSeek: 512 and 64; MiniCPM3: 256 and 32)


def _at_most(limit: int):
    """An argparse type: `_positive_int` up to ``limit``."""

    def parse(text: str) -> int:
        value = _positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected an integer <= {limit}, got {value}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected finite seconds > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="mla-verify",
        description="Verify an MLA decode kernel (bf16 or fp8) against the fp64 oracle within derived error bounds.\n"
        "Checks per case: tier 1 (kernel vs fp64 on the same dequantized inputs), tier 2 (fp8 quantization\n"
        "error within B_det and B_post), split invariance (our planned backends, plug-ins with .run_workers),\n"
        "empty rows (out 0, lse -inf), finiteness, NaN propagation (two runs, each with one NaN token: the\n"
        "newest token's rope channel, the first token's latent channel), the contract (shapes, dtypes), a second\n"
        "run on the same batch (the same bits, unless the kernel declares otherwise), inputs left unwritten, the\n"
        "rounding, rescale and partials probes (how P, the running output's rescale factor and split outputs are\n"
        "rounded), the layout check (q, cache and block table as strided views into NaN-padded buffers), the\n"
        "padding probe (finite tokens past each request's length that its rows would prefer, where the case has\n"
        "NaN: the same bits), the rerun check (the kernel called again on its tensors rewritten in place as the\n"
        "next decode step), the batch check (the requests regrouped: the same bits for a kernel declared\n"
        "batch-invariant, else the tier-1 bound), and on\n"
        "CUDA devices the far check (the pages moved past element 2^31 and page id 2^16 of a larger cache, where\n"
        "int32 offsets and 16-bit page ids wrap) and the long cases (a request of 2^16 + 65 tokens in more than\n"
        "64 pieces, a big split batch, that request on pages of 1, 128 heads x 528 MTP rows); for kernels with a\n"
        "graph-capturable step, the step check (planned, run, captured in a CUDA graph on CUDA, given the next\n"
        "decode step in place, planned again and replayed; on CUDA that replay must leave the allocator's free\n"
        "memory unwritten; then one plain decode step, each request grown by its q_len, the same way).\n"
        "Subcommand: 'mla-verify model ...' checks a whole MLA layer (verify.model_check).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                   help="kernel inputs: bf16 q and KV, or fp8 KV with bf16 or fp8 q (default bf16)")
    p.add_argument("--fp8-format", choices=FP8_FORMATS, default="e4m3fn", help="fp8 format (default e4m3fn)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="registry backend to verify; 'auto' = the first of triton, flashmla, flashinfer, aiter "
                   "that runs on this GPU, else emulated; unavailable ones are reported with their reason (exit 5)")
    p.add_argument("--impl", metavar="MODULE:FUNCTION",
                   help="verify your own kernel instead of --backend (see the plug-in contract below)")
    p.add_argument("--impl-path", metavar="DIR",
                   help="directory to import the --impl module from (put first on sys.path; default: the working "
                   "directory, as under python -m); repro lines name it when the module is found only there")
    p.add_argument("--cases", type=_positive_int, metavar="N",
                   help="cases to run, smoke prefix included (default: 200, or 2000 with --profile search)")
    p.add_argument("--seed", type=int, help="Hypothesis seed (default 0 for ci, random for dev/search)")
    p.add_argument("--max-seq-len", type=_at_most(MAX_SEQ_LEN), default=4096, metavar="N",
                   help=f"longest KV sequence drawn (default 4096, at most {MAX_SEQ_LEN})")
    p.add_argument("--heads", type=_at_most(MAX_CASE_HEADS), metavar="H",
                   help=f"fix the number of query heads (default drawn; at most {MAX_CASE_HEADS})")
    p.add_argument("--page-size", type=_at_most(MAX_PAGE_SIZE), metavar="P",
                   help=f"fix the page size (default drawn; at most {MAX_PAGE_SIZE})")
    p.add_argument("--kv-lora-rank", type=_at_most(MAX_WIDTH), metavar="L",
                   help="the latent width L of every case (default DeepSeek's 512, but in the smoke prefix's "
                        "MiniCPM3-shaped case: 256)")
    p.add_argument("--rope-dim", type=_at_most(MAX_WIDTH), metavar="R",
                   help="the rope width R of every case (default DeepSeek's 64; that smoke case: 32)")
    p.add_argument("--max-batch", type=_positive_int, default=8, metavar="B",
                   help="most requests per drawn case (default 8; the work budget then draws fewer heads)")
    p.add_argument("--profile", choices=tuple(DEFAULT_CASES), default="ci", help="case generation profile (below)")
    p.add_argument("--device", help="torch device for the cases (default cuda if available, else cpu)")
    p.add_argument("--time-limit", type=_positive_seconds, metavar="S",
                   help="stop the campaign once S seconds (wall clock) have passed: worker processes (--jobs N > 1) "
                        "are stopped in their cases in flight within a second of the limit; a case run in this "
                        "process (--jobs 1, search's smoke prefix) is cut short at the limit by a SIGALRM timer, once "
                        "a C call in flight (a long kernel, a CUDA sync) returns; the cases not run, a case cut short "
                        "among them, are reported (not_run, stopped), the exit code is that of the cases that ran")
    p.add_argument("--jobs", type=_positive_int, metavar="N",
                   help="worker processes (default: the usable cores on a CPU, min(14, cores) spawned processes "
                        "sharing one GPU; --case runs in one process; --profile search runs one search unless N > 1, "
                        "then N independent searches with seeds SEED..SEED+N-1)")
    p.add_argument("--threads", type=_positive_int, metavar="N",
                   help="torch CPU threads per case, in this process and in each worker (default: torch's count "
                        "with --jobs 1, else the usable cores split between the workers); on a CPU device repro lines "
                        "carry the count, since a kernel's fp32 reductions on the CPU may change in their last bits "
                        "with it")
    p.add_argument("--json", metavar="PATH", help="write the JSON report to PATH ('-' = stdout)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of err/bound per case and check (needs matplotlib)")
    p.add_argument("--case", metavar="JSON",
                   help="replay one case (the JSON of a repro line; fields left out take the Case defaults) and show "
                        "every check; the flags that shape or draw cases (--dtype, --seed, --heads, ...) are refused "
                        "with it")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failed case (not unsupported)")
    p.add_argument("--far", choices=("auto", "on", "off"), default="auto",
                   help="the far check: each case again with its pages past element 2^31 and page id 2^16 of a "
                        "2-5 GB cache (9.7 GB on pages of 128; int32 offsets and 16-bit page ids wrap there); "
                        "auto = on CUDA devices, where the fill takes milliseconds (default); "
                        "each worker process holds one such cache: fewer --jobs where memory is short")
    p.add_argument("--long", choices=("auto", "on", "off"), default="auto",
                   help="the long cases after the smoke prefix: one request of 2^16 + 65 tokens cut into more than "
                        "64 pieces, with MTP, a big split batch of 264 requests, the long request again on "
                        "pages of 1, and 132 requests of 4 MTP rows with 128 heads (past 2^16 (row, head) pairs; "
                        "verify.strategies.long_cases; --max-seq-len does not bound them); auto = on "
                        "CUDA devices (default); on a 2-core CPU about 20 s per long request (85 s on pages of 1), "
                        "5 minutes for the big batch, 8 for the 128-head batch")
    return p


# ---- campaign ---------------------------------------------------------------------------------------------------


GPU_JOBS = 14  # default processes feeding one GPU (each holds a CUDA context, ~0.5 GiB); 12 ran 1800 cases/min
_KERNEL = None  # the kernel of this process (inherited by forked workers)
_DEVICE = "cpu"
_FAR: bool | None = None  # run_case's far: None = on CUDA devices
_POLL_S = 1.0  # seconds between on_wait calls while a pool's next result is awaited (`_run_all`, `_search_parallel`)
_THREADS = 1  # torch CPU threads per case, in this process and each worker (main: --threads or `_default_threads`)
_INFLIGHT_DIR: str | None = None  # a worker process: where it writes the case it runs (<pid>.json), see _run_one
_BEFORE_CASE: Callable[[Case], None] | None = None  # this process, --json PATH: rewrites the report naming the case
# about to run (`main`), so that a kernel that kills the process running the cases (--jobs 1) leaves a report


class WorkerDied(RuntimeError):
    """A worker process ended without its results: the kernel crashed it (a segfault, os._exit) or, in a search, the
    verifier raised there. The campaign stops and reports the cases that ran (exit 1). ``cases``: the cases the dead
    worker may have been running (one when it is known: the one that crashed its worker again when run alone, or a
    search worker's case in flight); empty when unknown."""

    def __init__(self, message: str, cases: tuple[Case, ...] = ()):
        super().__init__(message)
        self.cases = cases


def _run_one(case: Case) -> CaseResult:
    """run_case that never raises: a plug-in's malformed per-batch declaration becomes a failed 'declaration' check,
    any other error a failed 'verifier' check with its traceback (a device fault there, e.g. from a GPU context
    already lost, also stops the campaign)."""
    from verify.checks import run_case

    t0 = time.perf_counter()
    if _BEFORE_CASE is not None:
        _BEFORE_CASE(case)
    inflight = None if _INFLIGHT_DIR is None else os.path.join(_INFLIGHT_DIR, f"{os.getpid()}.json")
    if inflight is not None:  # a file survives the process: if the kernel kills it, the parent reads the case here
        with open(inflight, "w") as f:
            f.write(case.to_json())
    try:
        return run_case(case, _KERNEL, _DEVICE, _FAR)
    except DeclarationError as e:  # the plug-in's per-batch declaration: its mistake, named, no traceback
        return CaseResult(case, [CheckResult("declaration", False, detail=str(e))], time.perf_counter() - t0)
    except (Exception, SystemExit) as e:  # SystemExit: a plug-in's sys.exit() outside a kernel call (plan, step)
        tb = traceback.format_exc(limit=-3).strip().replace("\n", " | ")
        check = CheckResult("verifier", False, detail=f"verifier error {type(e).__name__}: {e} [{tb}]")
        return CaseResult(case, [check], time.perf_counter() - t0, device_fault=is_device_fault(e))
    finally:
        if inflight is not None:
            with contextlib.suppress(FileNotFoundError):  # a case that ends after the campaign stopped, folder gone
                os.unlink(inflight)


def _worker_init(threads: int = 1, kernel_spec: tuple[str, str] | None = None, device: str | None = None,
                 far: bool | None = None, inflight_dir: str | None = None) -> None:
    """Pool worker setup: CPU threads per process, the folder where it names its case in flight (`_run_one`); a
    spawned worker (GPU campaigns) also resolves its own kernel (``("backend", name)`` or ``("impl",
    module:function)``), device and far setting, since it inherits no state."""
    global _KERNEL, _DEVICE, _FAR, _INFLIGHT_DIR, _BEFORE_CASE
    import torch

    torch.set_num_threads(threads)
    _INFLIGHT_DIR, _BEFORE_CASE = inflight_dir, None  # a forked worker does not write the parent's report
    if kernel_spec is not None:
        from verify import kernels

        kind, name = kernel_spec
        _KERNEL = kernels.from_backend(name) if kind == "backend" else kernels.from_impl(name)
        _DEVICE, _FAR = device, far


def _draw(strategy, n: int, seed: int) -> list[Case]:
    """n cases from a Hypothesis strategy, deterministic for a seed (generate phase only, no database)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed

    drawn: list[Case] = []
    if n <= 0:
        return drawn

    @hyp_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        drawn.append(case)

    collect()
    return drawn[:n]


def _search(strategy, n: int, seed: int, on_result) -> None:
    """Run up to n drawn cases in Hypothesis' generate + target phases (no shrinking), targeting each check's
    err/bound, so later cases climb toward the worst ones."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings, target
    from hypothesis import seed as hyp_seed

    done, stopped = [0], []
    if n <= 0:
        return

    @hyp_seed(seed)
    # quiet: _Stop is no "failure"; report_multiple_bugs off: after a stop in the target phase Hypothesis still
    # calls hunt, whose _Stop from another line would count as a second bug and come back as an ExceptionGroup
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate, Phase.target],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, report_multiple_bugs=False)
    @given(strategy)
    def hunt(case):
        if stopped:  # Hypothesis replays a "failing" example once more: do not run it again
            raise _Stop
        if done[0] >= n:
            return
        result = _run_one(case)
        done[0] += 1
        for c in result.checks:
            if c.err_over_bound is not None and 0 <= c.err_over_bound < float("inf"):
                target(c.err_over_bound, label=c.name)
        if not on_result(result):
            stopped.append(True)
            raise _Stop

    try:
        hunt()
    except _Stop:
        pass


class _Stop(Exception):
    """Raised inside the search to end it early (--exitfirst, --time-limit, a device fault)."""


def _search_worker(index: int, n: int, seed: int, dtype: str, shape: dict, init: tuple, messages) -> None:
    """Search number `index` of `--profile search --jobs N`, in a process of its own: n cases from Hypothesis seed
    `seed`, each result put on `messages` as ("result", index, CaseResult); then ("done", index, None), or ("error",
    index, traceback) if the search itself raised. The parent kills it when it stops the campaign."""
    try:
        _worker_init(*init)
        from verify.strategies import cases as case_strategy

        def on_result(r: CaseResult) -> bool:
            messages.put(("result", index, r))
            return True

        _search(case_strategy(dtype, **shape), n, seed, on_result)
    except BaseException:  # reported to the parent, which raises it: a search that dies must not look finished
        messages.put(("error", index, traceback.format_exc()))
    else:
        messages.put(("done", index, None))


def _search_parallel(dtype: str, shape: dict, n: int, seed: int, jobs: int, on_result,
                     kernel_spec: tuple[str, str] | None, on_wait: Callable[[], bool] | None = None) -> None:
    """--profile search --jobs N: N independent searches in worker processes (started as `_start_method` says, as in
    `_run_all`), search i with Hypothesis seed `seed + i` and its share of the n cases; each steers its own target
    phase. Results reach on_result as they arrive (their order varies from run to run; each case's own seed makes
    it replayable). on_result -> False stops them all: the workers still searching are killed, their cases in flight
    dropped; so does on_wait() -> False, called every `_POLL_S` seconds while no message comes. A worker whose
    search raises, or that dies without reporting, raises WorkerDied here."""
    import queue

    method = _start_method(_DEVICE)
    ctx = multiprocessing.get_context(method)
    inflight = tempfile.mkdtemp(prefix="mla-verify-inflight-")
    init = (_THREADS, kernel_spec if method == "spawn" else None, _DEVICE, _FAR, inflight)
    messages = ctx.Queue()
    shares = [n // jobs + (i < n % jobs) for i in range(jobs)]
    workers = {i: ctx.Process(target=_search_worker, args=(i, share, seed + i, dtype, shape, init, messages),
                              daemon=True) for i, share in enumerate(shares) if share > 0}
    for w in workers.values():
        w.start()
    running = set(workers)
    try:
        while running:
            try:
                kind, index, payload = messages.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [i for i in running if workers[i].exitcode is not None and messages.empty()]
                if dead:  # before on_wait: a time limit passing at the same poll must not hide a crash
                    w = workers[dead[0]]
                    case = _case_in_flight(inflight, f"{w.pid}.json")
                    raise WorkerDied(f"search worker {dead[0]} (seed {seed + dead[0]}) exited with code "
                                     f"{w.exitcode} without reporting its end" + (
                                         f", while running case {case.describe()}" if case else ""),
                                     (case,) if case else ()) from None
                if on_wait is not None and not on_wait():
                    return
                continue
            if kind == "error":
                raise WorkerDied(f"search worker {index} (seed {seed + index}) failed:\n{payload}")
            if kind == "done":
                running.discard(index)
            elif not on_result(payload):
                return
    finally:  # a stop, a WorkerDied or any exception: the searches still running are killed in their case in flight
        _terminate([workers[i] for i in running])
        for w in workers.values():
            w.join(timeout=60)  # the others reported their end and are exiting
        shutil.rmtree(inflight, ignore_errors=True)


class TimeLimitReached(BaseException):
    """--time-limit passed while a case ran in this process (`_deadline`). A BaseException, as KeyboardInterrupt is,
    so that neither `_run_one` nor Hypothesis takes it for the case's own error: it ends the campaign, and the case it
    cut short is reported as not run."""


@contextlib.contextmanager
def _deadline(seconds: float | None):
    """Raise TimeLimitReached in this thread once `seconds` (wall clock; <= 0: at once) have passed inside the block:
    a SIGALRM timer, so that a case run in this process (--jobs 1, a search's smoke prefix) is cut short at the limit
    instead of run to its end. Python runs the handler between bytecodes, so a C call in flight (one long kernel, a
    CUDA synchronize) ends first. No timer where seconds is None, off the main thread or without SIGALRM (Windows):
    then the limit is checked as each case ends. The previous handler is restored on the way out."""
    if seconds is None or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise TimeLimitReached

    previous = signal.signal(signal.SIGALRM, fire)
    try:
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-6))  # 0 would disarm it
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)  # a timer firing here raises, and the handler is still restored
        finally:
            signal.signal(signal.SIGALRM, previous)


def _terminate(processes: list) -> None:
    """Kill worker processes whose cases' results will not be read (SIGTERM; one already gone is left alone), rather
    than let each run its case in flight to the end before this process can report and exit."""
    for p in processes:
        p.terminate()


def mps_running() -> bool:
    """An NVIDIA MPS control daemon is listening: its control socket (`control` in $CUDA_MPS_PIPE_DIRECTORY, default
    /tmp/nvidia-mps; a Unix seqpacket socket) accepts a connection. Without one, CUDA contexts of different processes
    time-slice the GPU. The socket file outlives the daemon (`echo quit | nvidia-cuda-mps-control` leaves it), so its
    existence alone is no answer: a stale one refuses the connection (checked on an H200: accepted while the daemon
    ran, ECONNREFUSED after quit; the daemon served the next CUDA process after such connections)."""
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    try:
        control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except (AttributeError, OSError):  # no Unix seqpacket sockets on this OS (MPS is Linux-only)
        return False
    with control:
        control.settimeout(1.0)
        try:
            control.connect(os.path.join(pipe_dir, "control"))
        except OSError:  # no file, not a socket, or no daemon behind it
            return False
    return True


def _usable_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _default_threads(jobs: int) -> int:
    """torch CPU threads per case without --threads: torch's count when the cases run in this process (jobs 1),
    else the usable cores split between the worker processes (1 each with the CPU's default of one job a core)."""
    if jobs == 1:
        import torch

        return torch.get_num_threads()
    return max(1, _usable_cores() // jobs)


def _start_method(device: str) -> str:
    """How pool workers start: "fork" on a CPU where the platform has it (the workers inherit the kernel), else
    "spawn" (on a GPU, since CUDA cannot be used in a forked child; on a CPU-only platform without fork, e.g.
    Windows): spawned workers resolve the kernel from its spec themselves (`_worker_init`)."""
    return "fork" if device == "cpu" and "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _run_all(cases: list[Case], jobs: int, on_result, kernel_spec: tuple[str, str] | None = None,
             on_wait: Callable[[], bool] | None = None,
             in_process: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """Run cases in order; on_result(result) -> False stops. With worker processes, on_wait() is called every
    `_POLL_S` seconds while the next result is awaited; False stops too (the cases in flight are killed). Cases run
    in this process run inside ``in_process()`` (main: the time limit's timer, `_deadline`).

    jobs > 1: a pool of worker processes, results still in case order; a worker that dies raises WorkerDied. On a
    CPU the workers are forked (they inherit the kernel; spawned where the platform cannot fork). On a GPU they are
    spawned (a forked child cannot use its parent's CUDA context), each resolving ``kernel_spec`` itself and holding
    its own CUDA context: one GPU is then fed by several Python processes, which is what makes a GPU campaign fast,
    since a case is many small launches and host syncs, not FLOPs. Spawned workers need ``kernel_spec`` (ValueError
    without it).
    """
    if jobs > 1 and len(cases) > 1:
        method = _start_method(_DEVICE)
        if method == "spawn" and kernel_spec is None:
            raise ValueError("kernel_spec: spawned workers need the kernel's spec to resolve it; got None")
        ctx = multiprocessing.get_context(method)
        spawn = method == "spawn"  # forked workers inherit the kernel, device and far setting
        init = (_THREADS, kernel_spec if spawn else None, _DEVICE, _FAR)
        with tempfile.TemporaryDirectory(prefix="mla-verify-inflight-") as inflight:
            # an executor, not a Pool: a Pool replaces a worker the kernel crashed and waits for its result forever
            executor = ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init,
                                           initargs=init + (inflight,))
            every_result_in = False
            try:
                for future in [executor.submit(_run_one, case) for case in cases]:
                    while True:
                        try:
                            result = future.result(timeout=_POLL_S)
                            break
                        except FutureTimeout:
                            if on_wait is not None and not on_wait():
                                return
                    if not on_result(result):
                        return
                every_result_in = True
                return
            except BrokenProcessPool:
                suspects = sorted(_cases_in_flight(inflight), key=cases.index)
            finally:
                # unless every result came in (an early stop: --time-limit, -x, a device fault; or an exception, e.g.
                # Ctrl-C or one out of on_result) the workers' cases in flight are killed: their results would be
                # thrown away, and each worker would otherwise run its case and the one queued for it to the end
                # (minutes for a long case or an interpreted kernel) before this process could exit, its report
                # written (the executor's own table of its workers: shutdown drops it)
                workers = [] if every_result_in else list((executor._processes or {}).values())
                executor.shutdown(wait=False, cancel_futures=True)  # queued cases are dropped
                _terminate(workers)
        raise _crash_named(suspects, ctx, init)
    with in_process():
        for case in cases:
            if not on_result(_run_one(case)):
                return


def _case_in_flight(folder: str, name: str) -> Case | None:
    """The case a worker process was running when it died, from the file `_run_one` left in folder (None: none)."""
    try:
        with open(os.path.join(folder, name)) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return Case.from_json(text) if text else None  # empty: killed between opening the file and writing it


def _cases_in_flight(folder: str) -> list[Case]:
    """The cases that pool workers were running when the pool broke: the files `_run_one` left in folder."""
    return [case for name in os.listdir(folder) if (case := _case_in_flight(folder, name)) is not None]


def _crash_named(suspects: list[Case], ctx, init: tuple) -> WorkerDied:
    """The error for a pool that a kernel broke, naming the case that crashed it. When the pool breaks, the
    executor kills its other workers too, so every worker's case in flight is a suspect: each is run again alone,
    in a fresh worker process, in case order, until one kills that worker as well."""
    message = "a worker process died without returning its case's result (the kernel crashed it, e.g. a segfault)"
    for case in suspects if len(suspects) > 1 else ():
        with ProcessPoolExecutor(1, mp_context=ctx, initializer=_worker_init, initargs=init) as alone:
            try:
                alone.submit(_run_one, case).result()
            except BrokenProcessPool:
                return WorkerDied(f"{message}; run alone, case {case.describe()} crashed its worker again",
                                  (case,))
    if len(suspects) == 1:
        return WorkerDied(f"{message} while running case {suspects[0].describe()}", tuple(suspects))
    if suspects:
        return WorkerDied(f"{message} while running one of {len(suspects)} cases; none crashed when run alone",
                          tuple(suspects))
    return WorkerDied(f"{message}; its case is unknown (the worker died before naming it)")


# ---- reporting --------------------------------------------------------------------------------------------------


def _versions() -> dict:
    import torch

    def dist(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__, "triton": dist("triton"),
            "hypothesis": dist("hypothesis"), "mla-verify": dist("mla-verify"), "cuda": torch.version.cuda,
            "hip": torch.version.hip}


def _device_info(device: str) -> dict:
    import torch

    d = torch.device(device)
    if d.type == "cuda":
        major, minor = torch.cuda.get_device_capability(d)
        return {"type": "cuda", "name": torch.cuda.get_device_name(d), "capability": f"{major}.{minor}"}
    return {"type": d.type, "name": platform.processor() or platform.machine(), "capability": None}


def _summary(results: list[CaseResult], flags: str) -> dict:
    """Per check: cases, failed, median and max (over cases) of each case's max err/bound, worst case's repro."""
    by_name: dict[str, list[tuple[CaseResult, CheckResult]]] = {}  # in order of first appearance
    for r in results:
        for c in r.checks:
            by_name.setdefault(c.name, []).append((r, c))
    summary = {}
    for name, hits in by_name.items():
        ratios = [c.err_over_bound for _, c in hits if c.err_over_bound is not None]
        failed = [(r, c) for r, c in hits if not c.ok]
        if failed:
            worst_r, worst_c = max(failed, key=lambda rc: rc[1].err_over_bound or float("inf"))
        else:
            worst_r, worst_c = max(hits, key=lambda rc: rc[1].err_over_bound or 0.0)
        summary[name] = {
            "cases": len(hits),
            "failed": len(failed),
            "median_err_over_bound": json_number(statistics.median(ratios)) if ratios else None,
            "max_err_over_bound": json_number(max(ratios)) if ratios else None,
            "worst_repro": worst_r.case.repro(flags),
            "worst_detail": worst_c.detail,
        }
    return summary


def _failure(r: CaseResult, flags: str) -> dict:
    return {
        "case": json.loads(r.case.to_json()),
        "describe": r.case.describe(),
        "repro": r.case.repro(flags),
        "checks": [c.to_json() for c in r.failed],
    }


def _complete(report: dict, results: list[CaseResult], summary: dict, seconds: float, flags: str,
              deterministic: bool, not_run: int, stopped: dict, entries: dict[int, dict] | None = None) -> None:
    """Fill ``report`` with the campaign's outcome: the cases that ran (``results``), their per-check ``summary``
    (`_summary`), the failures with repro lines, the unsupported reasons, the cases not run and why it stopped.
    ``entries``: each result's entry in ``results`` by the result's id, kept between calls (the report rewritten
    before each case)."""
    entries = {} if entries is None else entries
    for r in results:
        if id(r) not in entries:
            entries[id(r)] = {"case": json.loads(r.case.to_json()), "ok": r.ok, "status": r.status,
                              "unsupported": r.unsupported, "seconds": round(r.seconds, 4), "numerics": r.numerics,
                              "err_over_bound": {c.name: json_number(c.err_over_bound) for c in r.checks
                                                 if c.err_over_bound is not None}}
    failed = [r for r in results if r.status == "failed"]
    numerics = _numerics(results)
    report["long"] = any(max(r.case.seq_lens) > 2**16 for r in results)  # a request past 2^16 tokens ran
    report.update(cases=len(results), failed=len(failed), seconds=round(seconds, 3), checks=summary,
                  numerics=numerics, warnings=_warnings(summary, deterministic, _out_dtypes(results)),
                  failures=[_failure(r, flags) for r in failed],
                  unsupported={reason: len(group) for reason, group in _unsupported(results).items()},
                  not_run=not_run, stopped=stopped or None, results=[entries[id(r)] for r in results])


def _write_json(path: str, report: dict, indent: int | None = 1) -> None:
    """Write atomically (temporary file + os.replace); '-' writes to stdout. ``indent`` None: one line (faster)."""
    text = json.dumps(report, indent=indent, allow_nan=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _plot(path: str, results: list[CaseResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = sorted({c.name for r in results for c in r.checks if c.err_over_bound is not None})
    for name in names:
        pts = [(i, c.err_over_bound) for i, r in enumerate(results) for c in r.checks
               if c.name == name and c.err_over_bound is not None]
        ax.scatter([p[0] for p in pts], [max(p[1], 1e-12) for p in pts], s=8, label=name)
    ax.axhline(1.0, color="red", lw=1, label="bound")
    ax.set_yscale("log")
    ax.set_xlabel("case")
    ax.set_ylabel("max err / bound")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _unsupported(results: list[CaseResult]) -> dict[str, list[CaseResult]]:
    """reason -> the unsupported cases with that reason, in campaign order."""
    groups: dict[str, list[CaseResult]] = {}
    for r in results:
        if r.unsupported is not None:
            groups.setdefault(r.unsupported, []).append(r)
    return groups


def _title(results: list[CaseResult], not_run: int) -> str:
    """"N cases: P passed, F failed, U unsupported[, K not run]"."""
    count = {status: sum(r.status == status for r in results) for status in ("passed", "failed", "unsupported")}
    text = f"{len(results)} cases: " + ", ".join(f"{v} {k}" for k, v in count.items())
    return text + (f", {not_run} not run" if not_run else "")


LOOSE_RATIO, LOOSE_CASES = 0.01, 20  # every backend we run reaches 0.56-0.98 of its tier-1 out bound in 200 cases
# the rounding check's out: a bf16, fp16 or fp8 P rounded as declared reaches a max err/bound of 0.23-0.30 on rows up
# to 130 tokens on the CPU, 0.23-0.34 over 200 cases of every H200 backend (an fp32 P 0.66 and more), one format
# finer than declared at most 0.12 (numerics.md §5(h); rows of 4096 tokens alone read less)
ROUNDING_MATCHED = 0.15
# the partials check's out: split outputs stored as declared reach a max err/bound of 0.29-0.73 on rows up to 300
# tokens on the CPU (the output's own rounding of the probe's tiny ô, fp32 partials; 0.50 over 85 emulated
# cases), one format finer than declared at most 0.10 (numerics.md §5(i))
PARTIALS_MATCHED = 0.15


def _numerics(results: list[CaseResult]) -> dict[str, int]:
    """The declared numerics the kernel bound assumed (`KernelNumerics.describe()`) -> number of cases."""
    return dict(Counter(r.numerics for r in results if r.numerics is not None))


def _out_dtypes(results: list[CaseResult]) -> set[str | None]:
    """The out dtypes the cases declared (None for a case whose declaration is not a KernelNumerics)."""
    return {r.out_dtype for r in results if r.numerics is not None}


def _warnings(summary: dict, deterministic: bool = True, out_dtypes: set[str | None] | None = None) -> list[str]:
    """Signs that the checks may be vacuous (never pass / fail): a tier-1 out bound far above every error seen,
    which a declaration looser than the kernel (a gamma too large, an operand dtype too narrow) gives; a rounding
    probe far inside its bound, which a declared P rounding coarser than the kernel's gives; a partials probe far
    inside its bound, which a declared partial dtype coarser than the kernel's gives (these two calibrated on a
    bf16 output, whose rounding dominates the probes' bounds: not given where every case declared an fp32 or fp64
    output (``out_dtypes``: `_out_dtypes`), which leaves the probes' worst-case fp32 charges in charge, so that a
    correct kernel declaring fp32 P and partials lands near 0.005; found by a review); no lse returned, so no
    lse check ran; strided inputs the kernel
    refused (the layout check did not run on them); and, for a kernel declared nondeterministic (``deterministic``
    False), second runs that all gave the first run's bits (the repeat check then holds it to a bound it need not
    have: it may be deterministic after all)."""
    def largest(name: str) -> float | None:
        """The check's max err/bound over at least LOOSE_CASES cases; None if fewer, or not a finite float (a
        non-finite ratio is kept as the string "inf" / "nan" in the summary: a failure, not a loose bound)."""
        s = summary.get(name)
        x = s["max_err_over_bound"] if s and s["cases"] >= LOOSE_CASES else None
        return x if isinstance(x, float) and math.isfinite(x) else None

    signs = (  # (check, below this, what its cases are, what it means)
        ("tier1.out", LOOSE_RATIO, "cases", f": the bound is over {1 / LOOSE_RATIO:.0f}x every error seen; check "
         "that the declared numerics (above) are not looser than the kernel rounds"),
        ("rounding.out", ROUNDING_MATCHED, "probed cases", " (a bf16, fp16 or fp8 P rounded as declared reaches "
         "0.23-0.34 where short rows are probed, an fp32 P 0.66 and more): the kernel rounds P more finely than the "
         "declared numerics (above) say, or they are looser elsewhere, and its bounds charge what it does not do "
         "(or its splits fall inside both of the probe's pairs of tokens: numerics.md §5(h))"),
        ("partials.out", PARTIALS_MATCHED, "probed cases", " (split outputs stored as declared reach 0.29-0.73, "
         "numerics.md §5(i)): the kernel stores its split outputs more finely than the declared partial_dtype "
         "(above) says, and its bounds charge what it does not do"),
    )
    wide_out = bool(out_dtypes) and out_dtypes <= {"float32", "float64"}
    warnings = []
    for name, limit, cases, meaning in signs[:1] if wide_out else signs:
        x = largest(name)
        if x is not None and x < limit:
            warnings.append(f"{name}: the largest err/bound in {summary[name]['cases']} {cases} is {x:.2g}, below "
                            f"{limit:g}{meaning}")
    if "tier1.out" in summary and "tier1.lse" not in summary:
        warnings.append(f"tier1.lse: the kernel returned no lse in all {summary['tier1.out']['cases']} cases, so no "
                        "lse check ran (a kernel whose lse feeds a merge, e.g. cascade or chunked prefill, should "
                        "return it)")
    if refused := summary.get("layout.refused"):
        warnings.append(f"layout.refused: the kernel refused strided inputs in {refused['cases']} cases, which the "
                        f"layout check then did not try (serving engines pass views); e.g. {refused['worst_detail']}")
    for name in ("batch.refused", "batch.shrunk.refused", "batch.mtp.refused", "batch.shared.refused"):
        if refused := summary.get(name):
            warnings.append(f"{name}: the kernel refused the batch check's regrouped batches in {refused['cases']} "
                            f"cases, which it then did not check; e.g. {refused['worst_detail']}")
    if refused := summary.get("rerun.refused"):
        warnings.append(f"rerun.refused: the kernel refused the rerun check's batches in {refused['cases']} cases, "
                        f"which it then did not check; e.g. {refused['worst_detail']}")
    if refused := summary.get("step.refused"):
        warnings.append(f"step.refused: the kernel's graph-capturable step refused {refused['cases']} cases, which "
                        f"the step check then did not drive; e.g. {refused['worst_detail']}")
    repeat = summary.get("repeat", {"cases": 0, "failed": 0})  # declared nondeterministic: the same bits, or a
    same = repeat["cases"] - repeat["failed"]  # failed second run (raised, broke the contract, other dtypes)
    if not deterministic and same >= LOOSE_CASES and not repeat["failed"] and "repeat.out" not in summary:
        warnings.append(f"repeat: the kernel declares run-to-run variation, but its second run gave the first run's "
                        f"bits in all {same} cases; if it is deterministic, drop the declaration and the repeat check "
                        "asks for the bits")
    return warnings


def _print_summary(console, summary: dict, results: list[CaseResult], seconds: float, flags: str,
                   not_run: int, deterministic: bool = True) -> None:
    """Table per check (cases, failed, median and max err/bound, worst case) and a row per unsupported reason, then
    the worst cases' repro lines."""
    from rich.table import Table

    table = Table(title=f"mla-verify: {_title(results, not_run)}, {seconds:.1f} s", title_justify="left")
    for col in ("check", "cases", "failed", "median err/bound", "max err/bound", "worst case"):
        table.add_column(col, no_wrap=True)
    repros: list[str] = []
    for name, s in summary.items():
        if s["worst_repro"] not in repros:
            repros.append(s["worst_repro"])
        ratios = [s["median_err_over_bound"], s["max_err_over_bound"]]
        ratios = ["—" if x is None else (x if isinstance(x, str) else f"{x:.3g}") for x in ratios]
        table.add_row(name, str(s["cases"]), str(s["failed"]), *ratios, f"[{repros.index(s['worst_repro']) + 1}]",
                      style="red" if s["failed"] else None)
    reasons = []
    for reason, group in _unsupported(results).items():  # not a check: the kernel declined these inputs
        repros.append(group[0].case.repro(flags))
        table.add_row("unsupported", str(len(group)), "—", "—", "—", f"[{len(repros)}]", style="yellow")
        reasons.append(f"unsupported, {len(group)} case(s) like [{len(repros)}]: {reason}")
    console.print(table)
    for line in reasons:  # in full: a table cell may be cut to the console width
        console.print(line, markup=False, highlight=False)
    for i, line in enumerate(repros, 1):
        console.print(f"[{i}] {line}", markup=False, highlight=False)
    for described, count in _numerics(results).items():
        console.print(f"declared numerics ({count} cases): {described}", markup=False, highlight=False)
    for line in _warnings(summary, deterministic, _out_dtypes(results)):
        console.print(f"mla-verify: warning: {line}", markup=False, highlight=False)


def _example_lines(results: list[CaseResult]) -> list[str]:
    """For each bounded check, its worst case (largest finite err/bound) as an @example(case=Case(...)) line."""
    lines: dict[str, str] = {}
    names = dict.fromkeys(c.name for r in results for c in r.checks if c.err_over_bound is not None)
    for name in names:
        scored = [(c.err_over_bound, r.case) for r in results for c in r.checks
                  if c.name == name and c.err_over_bound is not None and c.err_over_bound < float("inf")]
        if scored:
            ratio, case = max(scored, key=lambda rc: rc[0])
            line = f"@example(case={case!r})"
            lines[line] = lines.get(line, "") + f" {name} {ratio:.3g}"
    return [f"{line}  # max err/bound:{note}" for line, note in lines.items()]


# ---- main -------------------------------------------------------------------------------------------------------


def _model(argv: list[str]) -> int:
    try:
        model_check = importlib.import_module("verify.model_check")
    except ModuleNotFoundError as e:
        if e.name != "verify.model_check":
            raise
        print("mla-verify: error: 'model' needs verify/model_check.py, which this installation lacks", file=sys.stderr)
        return EXIT_USAGE
    return model_check.main(argv)


# flags that shape or draw the campaign's cases: a --case replay takes none of them
CASE_FIXES = {"dtype": "--dtype", "fp8_format": "--fp8-format", "heads": "--heads", "page_size": "--page-size",
              "kv_lora_rank": "--kv-lora-rank", "rope_dim": "--rope-dim",
              "max_seq_len": "--max-seq-len", "max_batch": "--max-batch", "seed": "--seed", "cases": "--cases",
              "profile": "--profile", "long": "--long", "time_limit": "--time-limit", "exitfirst": "--exitfirst"}
_UNSET = object()


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, set[str]]:
    """(the parsed arguments, the dests of the options on the command line, defaults or not), in one parse:
    argparse fills a default only where the namespace it is given lacks the attribute, so every option starts
    unset and those left unset take their defaults afterwards (none is a string that a type would convert)."""
    dests = [a.dest for a in parser._actions if a.option_strings and a.dest != "help"]
    args = parser.parse_args(argv, namespace=argparse.Namespace(**{d: _UNSET for d in dests}))
    given = {d for d in dests if getattr(args, d) is not _UNSET}
    for d in set(dests) - given:
        setattr(args, d, parser.get_default(d))
    return args, given


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mla-verify`` console script; returns the exit code."""
    global _KERNEL, _DEVICE, _FAR, _BEFORE_CASE, _THREADS
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "model":
        return _model(argv[1:])
    parser = build_parser()
    try:
        args, given = _parse(parser, argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)

    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)  # messages stay on one line; tables use the console width
    if not console.is_terminal and "COLUMNS" not in os.environ:  # a log or CI: rich's 80 columns would cut the table
        console.width = LOG_WIDTH

    def usage(msg: str) -> int:
        console.print(f"mla-verify: error: {msg}", markup=False, highlight=False)
        return EXIT_USAGE

    if args.impl and "backend" in given:
        return usage("--impl and --backend each name the kernel to verify: give one")
    if args.impl_path is not None and not args.impl:
        return usage("--impl-path is where the --impl module is imported from: give --impl too")
    if args.dtype == "bf16" and "fp8_format" in given:
        return usage("--fp8-format applies to --dtype fp8 (bf16 cases have no fp8 tensors)")
    if args.case is not None and (ignored := [flag for dest, flag in CASE_FIXES.items() if dest in given]):
        return usage(f"--case replays the case as its JSON gives it (seed, heads, page_size, q_dtype, kv_dtype, "
                     f"fp8_format, ...; left out: the Case defaults), so {', '.join(ignored)} would have no effect")
    if args.plot == "-":
        return usage("--plot: expected a file path for the PNG ('-', stdout, is for --json)")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):  # before the campaign, not after it
        if path is not None and path != "-" and (why := unwritable(path)):
            return usage(f"{flag}: cannot write {path}: {why}")
    if args.plot:  # before the campaign, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return usage("--plot needs matplotlib (pip install 'mla-verify[plot]')")
    replay = None
    if args.case is not None:
        try:
            replay = Case.from_json(args.case)
        except (ValueError, TypeError) as e:
            return usage(f"--case: {e}")
        if (max(replay.seq_lens) > MAX_SEQ_LEN or replay.heads > MAX_CASE_HEADS or replay.page_size > MAX_PAGE_SIZE
                or max(replay.kv_lora_rank, replay.rope_dim) > MAX_WIDTH):  # before it fails to allocate
            return usage(f"--case: expected seq_lens <= {MAX_SEQ_LEN}, heads <= {MAX_CASE_HEADS}, page_size <= "
                         f"{MAX_PAGE_SIZE} and kv_lora_rank, rope_dim <= {MAX_WIDTH} (--max-seq-len's, --heads', "
                         f"--page-size's and --kv-lora-rank's limits), got seq_lens {list(replay.seq_lens)}, heads "
                         f"{replay.heads}, page_size {replay.page_size}, kv_lora_rank {replay.kv_lora_rank}, rope_dim "
                         f"{replay.rope_dim}")

    import torch

    from verify import kernels

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        return usage(f"--device: {e}")
    report = {"schema_version": SCHEMA_VERSION, "argv": argv, "device": None, "versions": _versions(),
              "profile": args.profile, "dtype": args.dtype, "fp8_format": args.fp8_format, "cases": 0, "failed": 0,
              "failures": [], "unsupported": {}, "not_run": 0, "stopped": None, "checks": {}, "results": []}

    def nothing_ran(msg: str) -> int:
        console.print(f"mla-verify: nothing ran: {msg}", markup=False, highlight=False)
        report["nothing_ran"] = msg
        if args.json:
            _write_json(args.json, report)
        return EXIT_NOTHING_RAN

    if device.type == "cuda" and not torch.cuda.is_available():
        return nothing_ran(f"device {device} requested, but torch.cuda.is_available() is False")
    report["device"] = _device_info(str(device))

    if args.impl:
        try:
            kernel = kernels.from_impl(args.impl, args.impl_path)
        except ValueError as e:
            return usage(str(e))
        flags = f"--impl {args.impl}" + kernels.impl_path_flag(args.impl)
    else:
        report["backend"] = {"name": args.backend}
        try:
            kernel = kernels.from_backend(args.backend)
        except ValueError as e:
            return nothing_ran(str(e))
        flags = f"--backend {kernel.name}"
    report["backend"] = {"name": kernel.name, "reason": kernel.reason, "impl": args.impl}
    if args.device:
        flags += f" --device {args.device}"
    _KERNEL, _DEVICE = kernel, str(device)
    _FAR = {"auto": device.type == "cuda", "on": True, "off": False}[args.far]
    report["far"] = _FAR
    if args.far != "auto":
        flags += f" --far {args.far}"
    long = {"auto": device.type == "cuda", "on": True, "off": False}[args.long] and not replay

    seed = args.seed
    if seed is None:
        seed = 0 if args.profile == "ci" else int.from_bytes(os.urandom(4), "little")
    n = 1 if replay else (args.cases or DEFAULT_CASES[args.profile])
    cores = _usable_cores()
    if replay:
        jobs = 1
    elif args.profile == "search":  # default one search; --jobs N: N searches side by side (_search_parallel)
        jobs = args.jobs or 1
    else:
        jobs = args.jobs or (cores if device.type == "cpu" else min(GPU_JOBS, cores))
    kernel_spec = ("impl", args.impl) if args.impl else ("backend", kernel.name)
    # every case at one thread count, in this process (a search's smoke prefix, a lone case) as in the workers
    _THREADS = args.threads or _default_threads(jobs)
    if device.type == "cpu":
        flags += f" --threads {_THREADS}"
    report.update(seed=seed, jobs=jobs, threads=_THREADS)
    if replay:  # what ran: the case's own dtypes and format, no drawing
        report.update(profile=None, seed=None, dtype="fp8" if replay.kv_dtype == "fp8" else "bf16",
                      fp8_format=replay.fp8_format)
    what = f"replaying {replay.describe()}" if replay else f"profile {args.profile}, seed {seed}, {n} cases"
    if args.profile == "search" and jobs > 1 and not replay:
        what += f" ({jobs} searches, seeds {seed}..{seed + jobs - 1})"
    what += "" if replay else f", {args.dtype}"
    console.print(f"mla-verify: kernel {kernel.name} ({kernel.reason}); device {device}; {what}", markup=False,
                  highlight=False)
    if not _FAR:
        console.print("mla-verify: the far check is off (pages past element 2^31 and page id 2^16 of a 2-5 GB cache, "
                      "on CUDA devices by default; --far on runs it here)", markup=False, highlight=False)
    if device.type == "cuda":
        report["mps"] = mps_running()
    if device.type == "cuda" and jobs > 1 and n > 1 and not report["mps"]:
        console.print(f"mla-verify: {jobs} worker processes share the GPU without an MPS daemon, so their kernels "
                      "time-slice instead of running side by side; start one with `nvidia-cuda-mps-control -d` "
                      "(one H200: 1560 -> 4166 cases/min)", markup=False, highlight=False)

    from verify.strategies import cases as case_strategy
    from verify.strategies import long_cases, smoke_cases

    shape = dict(fp8_format=args.fp8_format, max_seq_len=args.max_seq_len, heads=args.heads, page_size=args.page_size,
                 kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim, max_batch=args.max_batch)
    fixed = {k: v for k, v in shape.items() if k != "max_batch"}  # the smoke prefix keeps its batches
    smoke, longs = smoke_cases(args.dtype, **fixed), (long_cases(args.dtype, **fixed) if long else [])
    if longs and n < len(smoke) + len(longs):
        console.print(f"mla-verify: --cases {n} leaves out {min(len(longs), len(smoke) + len(longs) - n)} of the "
                      f"{len(longs)} long cases (they follow the {len(smoke)}-case smoke prefix; --cases "
                      f"{len(smoke) + len(longs)} runs them)", markup=False, highlight=False)
    elif not long and not replay:
        console.print("mla-verify: the long cases are off (a request of 2^16 + 65 tokens in more than 64 pieces, "
                      "a big split batch, that request on pages of 1 and 128 heads x 528 MTP rows, on CUDA devices "
                      "by default; --long on runs them here)", markup=False, highlight=False)
    smoke = (smoke + longs)[:n]
    results: list[CaseResult] = []
    stopped: dict = {}  # why the campaign ended early (a device fault, --time-limit), for the report
    t0 = time.perf_counter()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(), console=console,
                        transient=True)

    def before_case(case: Case) -> None:
        """--json PATH, cases run in this process: the report as it would end if this case killed the process."""
        done = len(results) + 1
        crash = {"reason": f"the process ended while running case {done} of {n} (a kernel that crashed it, a "
                           "segfault or os._exit, or a kill): this report was written before that case ran",
                 "case": case.describe(), "repro": case.repro(flags), "fault": True}
        _complete(report, results, _summary(results, flags), time.perf_counter() - t0, flags, kernel.deterministic,
                  n - len(results), crash, entries)
        _write_json(args.json, report, indent=None)  # one line: the last report (indented) replaces it

    entries: dict[int, dict] = {}  # each result's report entry, built once (`_complete`)

    _BEFORE_CASE = before_case if args.json and args.json != "-" else None
    with progress:
        task = progress.add_task("cases", total=n, failed=0)

        def stop_at_time_limit() -> bool:
            """Record (`stopped`) and print the time limit's stop; False, nothing recorded, when no case is left."""
            if len(results) >= n:
                return False
            stopped.update(reason=f"time limit: --time-limit {args.time_limit:g} s passed after {len(results)} "
                                  f"of {n} cases")
            progress.console.print(f"mla-verify: STOPPED by the time limit ({args.time_limit:g} s) after "
                                   f"{len(results)} of {n} cases; the other {n - len(results)} cases are not run",
                                   markup=False, highlight=False)
            return True

        def past_time_limit() -> bool:
            """--time-limit has passed with cases left: the stop is recorded and printed (`stop_at_time_limit`)."""
            return args.time_limit is not None and time.perf_counter() - t0 > args.time_limit and stop_at_time_limit()

        def in_this_process() -> contextlib.AbstractContextManager:
            """Around cases run in this process: the time limit cuts the case in flight short (`_deadline`)."""
            return _deadline(None if args.time_limit is None else t0 + args.time_limit - time.perf_counter())

        def keep_waiting() -> bool:  # a pool's next result is late: stop at the time limit, not when it comes
            return not past_time_limit()

        def on_result(r: CaseResult) -> bool:
            results.append(r)
            failed = sum(x.status == "failed" for x in results)
            progress.update(task, advance=1, failed=failed)
            first_of_reason = r.unsupported is not None and len(_unsupported(results)[r.unsupported]) == 1
            if (r.status == "failed" and failed <= 3 and not r.device_fault) or first_of_reason:
                progress.console.print(r.describe() + f"\n  repro: {r.case.repro(flags)}", markup=False,
                                       highlight=False)
            if r.device_fault:
                stopped.update(case=r.case.describe(), repro=r.case.repro(flags), detail=r.failed[0].detail,
                               reason="device fault: the GPU context of this process is lost, every later case "
                                      "would fail")
                progress.console.print(f"mla-verify: STOPPED at case {len(results)} of {n} by a device fault; the "
                                       f"other {n - len(results)} cases are not run.\n  {r.failed[0].detail}\n"
                                       f"  repro: {r.case.repro(flags)}", markup=False, highlight=False)
                return False
            if past_time_limit():
                return False
            if r.status == "failed" and args.exitfirst:
                if len(results) < n:
                    stopped.update(reason=f"--exitfirst: case {len(results)} of {n} failed")
                return False
            return True

        threads_before = torch.get_num_threads()
        torch.set_num_threads(_THREADS)  # for the cases run here; given back at the end (main may run in a test)
        try:
            if replay:
                on_result(_run_one(replay))
            else:
                strategy = case_strategy(args.dtype, **shape)
                if args.profile == "search":
                    # a handful of cases: a pool's start-up would cost more
                    _run_all(smoke, 1, on_result, in_process=in_this_process)
                    if not stopped:
                        if jobs > 1:
                            _search_parallel(args.dtype, shape, n - len(smoke), seed, jobs, on_result, kernel_spec,
                                             keep_waiting)
                        else:
                            with in_this_process():
                                _search(strategy, n - len(smoke), seed, on_result)
                else:
                    _run_all(smoke + _draw(strategy, n - len(smoke), seed), jobs, on_result, kernel_spec,
                             keep_waiting, in_this_process)
        except TimeLimitReached:  # a case run in this process was cut short at the limit
            if not stopped:  # else the timer fired as the campaign ended for a stop already recorded
                stop_at_time_limit()
        except KeyboardInterrupt:
            console.print("mla-verify: interrupted; reporting the cases that ran")
        except WorkerDied as e:
            stopped.update(reason=f"worker died: {e}", fault=True)
            if e.cases:
                stopped.update(case=" | ".join(c.describe() for c in e.cases),
                               repro="\n  ".join(c.repro(flags) for c in e.cases))
            progress.console.print(f"mla-verify: STOPPED after case {len(results)} of {n}: {e}", markup=False,
                                   highlight=False)
        finally:
            _BEFORE_CASE = None
            torch.set_num_threads(threads_before)
    seconds = time.perf_counter() - t0

    if replay and results:
        for c in results[0].checks:
            console.print(f"[{c.name}] {'OK' if c.ok else 'FAILED'}\n{c.detail}", markup=False, highlight=False)
    summary = _summary(results, flags)
    not_run = n - len(results)
    if results:
        _print_summary(console, summary, results, seconds, flags, not_run, kernel.deterministic)
    if stopped:
        faulting = f"; faulting case:\n  {stopped['repro']}" if "repro" in stopped else ""
        console.print(f"mla-verify: stopped early, {not_run} cases not run: {stopped['reason']}{faulting}",
                      markup=False, highlight=False)
    if args.profile == "search" and results:
        console.print("worst cases (paste into a test as regressions):", markup=False)
        for line in _example_lines(results):
            console.print(line, markup=False, highlight=False)

    failed = [r for r in results if r.status == "failed"]
    unsupported = _unsupported(results)
    _complete(report, results, summary, seconds, flags, kernel.deterministic, not_run, stopped)
    if args.json:
        _write_json(args.json, report)
    if args.plot and results:
        _plot(args.plot, results, f"{kernel.name}, {report['dtype']}, {len(results)} cases")
    if failed or stopped.get("fault"):
        return EXIT_FAILED
    if not results:
        return EXIT_NOTHING_RAN
    if len(results) == sum(len(group) for group in unsupported.values()):
        console.print(f"mla-verify: nothing ran: the kernel declared all {len(results)} cases unsupported",
                      markup=False, highlight=False)
        return EXIT_NOTHING_RAN
    return EXIT_OK
