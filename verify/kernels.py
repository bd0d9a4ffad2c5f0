"""The kernel under test: a registry backend (``--backend``) or a user plug-in (``--impl package.module:function``).

Plug-in contract::

    def my_decode(batch: mla_ref.decode.DecodeBatch) -> out | (out, lse)
        out [T, H, kv_lora_rank], any float dtype; lse [T, H], natural log, sm_scale included
        a row that sees no KV token: out 0, lse -inf
        batch.q, .kv_cache and .block_table may be strided views: honour their strides, or raise ValueError
        naming what it takes (the ``layout`` check then passes as ``layout.refused``, and the report warns)
    my_decode.numerics = mla_fast.numerics.KernelNumerics(...)   # optional: how it rounds (numerics.md §5(f))

Without ``numerics`` a plug-in is assumed to round like ``DEFAULT_NUMERICS`` (``default_numerics``: its score charge
at the batch's L + R): fp32 scores and P, fp32 accumulation (the P.V part charged per token of the request, as Hopper
MMAs into a running output), bf16 output. ``numerics`` may also be a callable ``(batch) -> KernelNumerics``.
For an input it has no kernel for (a dtype pair, a shape), a plug-in raises ``mla_fast.backends.Unsupported(reason)``
(a ValueError): the case is then reported as unsupported under that reason, neither passed nor failed. Any other
exception fails the case; a CUDA/HIP error stops the campaign (verify.checks).
Plug-ins may split the KV range however they like, within what they declare: ``my_decode.max_splits`` (an int, or
a callable ``(batch) -> int``) is the most pieces any row is cut into, charged by the split-merge bound (numerics.md
§5(g)); the default, ceil(max seq_len / 64), assumes pieces of at least 64 tokens. A plug-in that cuts finer must
declare it: the merge of more pieces is charged nothing, and a declared 1 means the partials check is not run.
A plug-in that takes a worker count may say so with ``my_decode.run_workers = fn``, ``fn(batch, num_workers) -> out |
(out, lse)`` with the KV split over that many persistent workers: each case then runs it with the case's drawn
worker count (instead of ``my_decode``), and the split-invariance check runs it again with another count
(``split.out`` / ``split.lse``, the latter when both runs return lse). Without it the split check does not run.
Two runs on the same batch must give the same bits (the ``repeat`` check); a plug-in whose results vary from run
to run by design (split outputs merged by atomics, work stealing) declares ``my_decode.deterministic = False``, and
the second run is then held to the tier-1 bound instead.
A request's rows may change bits when its batch changes (the ``batch`` check regroups the requests: a split-KV
plan cuts a request where the whole batch puts the cuts) within the tier-1 bound; a plug-in for batch-invariant
serving declares ``my_decode.batch_invariant = True``, and the check then asks for the bits (so it must also be
deterministic: ValueError otherwise).
On a plug-in function (or a callable object, on the instance), an attribute whose name is close to one of these
(``batch_invarient``, ``numeric``) is refused with a ValueError that names the one meant, since a misspelt
declaration would leave the default in force.
A plug-in with a CUDA-graph-capturable step says so with ``my_decode.step = factory``, ``factory(batch, max_q_len)
-> step`` (built once for that batch's shapes, up to max_q_len query rows per request) with ``step.plan(batch)``
(eager: reads the batch's current lengths, may sync) and ``step.run() -> out | (out, lse)`` (launches only, on the
batch's tensors and its own buffers). The ``step`` check then runs it as a serving engine does: built and planned,
run, captured in a CUDA graph and replayed (on CUDA), then the next step's lengths and pages written into the same
batch tensors in place, planned again, its q and new tokens written, and replayed, against the oracle on the new
contents (`verify.next_step`); plan() fills the buffers run() reads in place: one it replaces leaves the captured
graph on the freed block (``step.freed``, on CUDA). ``step.numerics`` (a KernelNumerics, or a callable of the
batch) says how a step that fixes its kernel when built rounds; else the plug-in's numerics apply. A step that
refuses a batch raises ``Unsupported`` (``step.refused`` then passes, and the report warns).
"""

from __future__ import annotations

import difflib
import os
import pkgutil
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from mla_fast.backends import blocks_of_64
from mla_fast.numerics import FP32_EPILOGUE, HOPPER_PV_PER_TOKEN, PV_PER_TILE, KernelNumerics, fp32_score_gamma
from mla_ref.config import is_int
from mla_ref.decode import DecodeBatch

DEFAULT_NUMERICS = KernelNumerics(
    p_fmt=None,  # fp32 P
    p_scale=1.0,
    qk_operand=torch.float32,
    pv_operand=torch.float32,
    gamma_qk=fp32_score_gamma(),  # DeepSeek's L + R; default_numerics(batch) counts the batch's
    gamma_pv=FP32_EPILOGUE,
    gamma_pv_per_token=HOPPER_PV_PER_TOKEN + PV_PER_TILE / 64,  # MMA into the running output, then per 64-token tile
    out_dtype=torch.bfloat16,
)


def default_numerics(batch: DecodeBatch) -> KernelNumerics:
    """DEFAULT_NUMERICS with the score charge of the batch's L + R: (L + R + 1) chopped fp32 steps."""
    return replace(DEFAULT_NUMERICS, gamma_qk=fp32_score_gamma(batch.head_dim))


BATCH_INVARIANT = "declared batch-invariant: the batch check asks for each request's bits in a regrouped batch"
NONDETERMINISTIC = "declared nondeterministic: the repeat check takes the tier-1 bound, not the first run's bits"
PLUG_IN_ATTRIBUTES = ("numerics", "max_splits", "run_workers", "deterministic", "batch_invariant", "step")  # read


@dataclass(frozen=True)
class Kernel:
    """What the checks call.

    Attributes:
        name: "emulated", "triton", ... or the plug-in's ``module:function``.
        run: (batch) -> out or (out, lse).
        numerics: (batch) -> KernelNumerics, the rounding the tier-1 bound assumes.
        run_workers: (batch, num_workers) -> (out, lse) with the KV split over that many persistent workers, for
            backends that take a plan (`Backend.run_workers`) and plug-ins that set ``.run_workers``; None otherwise.
        max_splits: (batch) -> the largest number of KV splits of any row (the merge bound's S).
        reason: why this kernel was chosen (shown in the report).
        nan_deviation: a backend's declared break of the NaN convention (`Backend.nan_deviation`): the nan check
            is then not run, and the reason says why; "" for our kernels and plug-ins, which must keep it.
        deterministic: whether two runs on the same batch (and worker count) give the same bits (`Backend.
            deterministic`, a plug-in's ``.deterministic``; True unless declared otherwise): the repeat check then
            asks for them, else for the tier-1 bound.
        batch_invariant: whether a request's rows keep their bits in any batch (`Backend.batch_invariant`, a
            plug-in's ``.batch_invariant``; False unless declared): the batch check then asks for them, else for
            the tier-1 bound.
        step: (batch, max_q_len) -> a graph-capturable step with plan(batch) and run() (`Backend.step`, a plug-in's
            ``.step``; module docstring), run by the step check; None: no such check.
    """

    name: str
    run: Callable[[DecodeBatch], object]
    numerics: Callable[[DecodeBatch], KernelNumerics]
    run_workers: Callable[[DecodeBatch, int], tuple[torch.Tensor, torch.Tensor]] | None = None
    max_splits: Callable[[DecodeBatch], int] = blocks_of_64
    reason: str = ""
    nan_deviation: str = ""
    deterministic: bool = True
    step: Callable[[DecodeBatch, int], object] | None = None
    batch_invariant: bool = False


def from_backend(name: str) -> Kernel:
    """A registry backend ("auto" resolved); ValueError with the backend's reason when it cannot run here."""
    from mla_fast import backends

    backend = backends.get_backend(name)
    reason = backend.probe()[1]
    if name == "auto":
        status = backends.available()
        skipped = [f"{n}: {status[n][1]}" for n in backends.AUTO_ORDER if not status[n][0]]
        reason = f"auto picked {backend.name} ({reason})" + (f"; unavailable: {'; '.join(skipped)}" if skipped else "")
    if backend.nan_deviation:
        reason += f"; nan check not run, declared: {backend.nan_deviation}"
    if not backend.deterministic:
        reason += f"; {NONDETERMINISTIC}"
    if backend.batch_invariant:
        reason += f"; {BATCH_INVARIANT}"
    return Kernel(backend.name, backend.run, backend.numerics, backend.run_workers, backend.max_splits,
                  reason=reason, nan_deviation=backend.nan_deviation, deterministic=backend.deterministic,
                  step=backend.step, batch_invariant=backend.batch_invariant)


def from_impl(spec: str, path: str | None = None) -> Kernel:
    """Resolve ``package.module:function`` (pkgutil.resolve_name), importable from ``path`` (``--impl-path``: put
    first on sys.path) or else from the working directory, as under ``python -m`` (the ``mla-verify`` console script
    does not put it on sys.path, so the repro line it prints for a plug-in in the working directory would not have
    run; `impl_path_flag` names the directory in it); ValueError with a one-line reason otherwise."""
    if ":" not in spec:
        raise ValueError(f"--impl: expected 'package.module:function', got {spec!r}")
    if path is not None:
        if not os.path.isdir(path):
            raise ValueError(f"--impl-path {path}: expected a directory to import the --impl module from")
        sys.path.insert(0, os.path.abspath(path))
    elif os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = pkgutil.resolve_name(spec)
    except Exception as e:  # ImportError, AttributeError, and whatever importing the module raised (SyntaxError...)
        raise ValueError(f"--impl {spec}: cannot resolve it ({type(e).__name__}: {e})") from None
    return from_callable(fn, spec)


def impl_path_flag(name: str) -> str:
    """`` --impl-path DIR`` for a repro line of the plug-in ``name`` (``module:function``) whose top-level module
    was imported from a directory that only the working directory or ``--impl-path`` put on sys.path (DIR: that
    directory, absolute), so that the line replays from any directory; "" for a module found without them (an
    installed package) or not imported."""
    top = name.split(":")[0].split(".")[0]
    module = sys.modules.get(top)
    file = getattr(module, "__file__", None)
    if file is None:
        return ""
    where = os.path.dirname(os.path.dirname(file) if hasattr(module, "__path__") else file)  # the sys.path entry
    local = {"", os.getcwd(), where}
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if p not in local and os.path.abspath(p) != where]
    try:  # the finders sys.meta_path holds (an editable install's too), sys.path without the local entries
        elsewhere = any(f.find_spec(top, None) is not None for f in sys.meta_path if hasattr(f, "find_spec"))
    finally:
        sys.path[:] = saved
    return "" if elsewhere else f" --impl-path {shlex.quote(os.path.abspath(where))}"


def from_callable(fn, name: str | None = None) -> Kernel:
    """A plug-in kernel from a callable following the contract (module docstring); numerics from ``fn.numerics``."""
    name = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
    if not callable(fn):
        raise ValueError(f"--impl {name}: expected a callable, got {type(fn).__name__}")
    # a misspelt declaration would be ignored, the defaults taken silently: a function's attributes, or a callable
    # object's own (set on the instance; its class's attributes and methods are not read here)
    for attr in getattr(fn, "__dict__", {}):
        if attr not in PLUG_IN_ATTRIBUTES and (near := difflib.get_close_matches(attr, PLUG_IN_ATTRIBUTES, 1, 0.8)):
            raise ValueError(f"--impl {name}: .{attr} is not an attribute the verifier reads; did you mean "
                             f".{near[0]}? (it reads {', '.join('.' + a for a in PLUG_IN_ATTRIBUTES)})")
    declared = getattr(fn, "numerics", None)
    if declared is None:
        numerics, reason = default_numerics, "plug-in, default numerics (fp32 P, bf16 out)"
    elif isinstance(declared, KernelNumerics):
        numerics, reason = (lambda batch: declared), "plug-in, declared numerics"
    elif callable(declared):
        numerics, reason = _checked(declared, name, ".numerics", _is_numerics), "plug-in, declared numerics (per batch)"
    else:
        raise ValueError(f"--impl {name}: .numerics must be a KernelNumerics or a callable, got {type(declared)}")
    splits = getattr(fn, "max_splits", None)
    if splits is None:
        max_splits = blocks_of_64
    elif _is_splits(splits) is None:
        max_splits, reason = (lambda batch: splits), f"{reason}; at most {splits} splits per row"
    elif callable(splits):
        max_splits = _checked(splits, name, ".max_splits", _is_splits)
        reason += "; declared max_splits (per batch)"
    else:
        raise ValueError(f"--impl {name}: .max_splits must be an int >= 1 or a callable (batch) -> int, got "
                         f"{splits!r}")
    workers = getattr(fn, "run_workers", None)
    if workers is not None and not callable(workers):
        raise ValueError(f"--impl {name}: .run_workers must be a callable (batch, num_workers), got {type(workers)}")
    if workers is not None:
        reason += "; split invariance through .run_workers"
    deterministic = getattr(fn, "deterministic", True)
    if not isinstance(deterministic, bool):
        raise ValueError(f"--impl {name}: .deterministic must be True or False, got {deterministic!r}")
    if not deterministic:
        reason += f"; {NONDETERMINISTIC}"
    batch_invariant = getattr(fn, "batch_invariant", False)
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"--impl {name}: .batch_invariant must be True or False, got {batch_invariant!r}")
    if batch_invariant and not deterministic:
        raise ValueError(f"--impl {name}: .batch_invariant = True needs .deterministic = True (the batch check asks "
                         f"for the bits of the case's run, which a kernel whose bits vary from run to run cannot keep)")
    if batch_invariant:
        reason += f"; {BATCH_INVARIANT}"
    step = getattr(fn, "step", None)
    if step is not None and not callable(step):
        raise ValueError(f"--impl {name}: .step must be a callable (batch, max_q_len) -> step, got {type(step)}")
    if step is not None:
        reason += "; graph-capturable step through .step"
    return Kernel(name, fn, numerics, workers, max_splits=max_splits, reason=reason, deterministic=deterministic,
                  step=step, batch_invariant=batch_invariant)


def _is_numerics(value: object) -> str | None:
    return None if isinstance(value, KernelNumerics) else "a KernelNumerics"


def _is_splits(value: object) -> str | None:
    return None if is_int(value) and value >= 1 else "an int >= 1"


class DeclarationError(ValueError):
    """A plug-in's per-batch declaration (``.numerics`` or ``.max_splits`` as a callable) returned something outside
    the contract: the plug-in's mistake, reported as a failed ``declaration`` check, not as a verifier error."""


def _checked(declared: Callable[[DecodeBatch], object], name: str, attr: str,
             expect: Callable[[object], str | None]) -> Callable[[DecodeBatch], object]:
    """A plug-in's per-batch declaration whose return value is checked: a DeclarationError naming the plug-in and
    the attribute (the case then fails with it) instead of an error deep in the bounds."""
    def call(batch: DecodeBatch):
        value = declared(batch)
        if (wanted := expect(value)) is not None:
            raise DeclarationError(f"--impl {name}: {attr}(batch) must return {wanted}, got {value!r}")
        return value
    return call


def outputs(result: object, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check a kernel's return value against the contract; (out, lse or None). ValueError saying what is wrong."""
    T, H, L = batch.num_tokens, batch.num_heads, batch.kv_lora_rank
    if isinstance(result, torch.Tensor):
        out, lse = result, None
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        out, lse = result
    else:
        raise ValueError(f"kernel returned {type(result).__name__}; expected out or (out, lse) tensors")
    for name, t, shape in (("out", out, (T, H, L)), ("lse", lse, (T, H))):
        if t is None and name == "lse":
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"kernel {name}: expected a tensor of shape {list(shape)}, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"kernel {name}: expected a float dtype, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"kernel {name}: expected shape {list(shape)}, got {list(t.shape)}")
    return out, lse
