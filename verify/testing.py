"""Property tests for your own decode kernel, in your CI: the cases, bounds and checks of `mla-verify`.

    # tests/test_my_kernel.py
    from verify.testing import mla_property_test
    from mypkg.mla import decode          # decode(batch) -> out or (out, lse); optional decode.numerics

    test_my_kernel_fp8 = mla_property_test(decode, dtype="fp8")
    test_my_kernel_bf16 = mla_property_test(decode, dtype="bf16")

    # tests/conftest.py
    from verify.testing import register_profiles
    register_profiles()                   # ci (default) / dev / search, chosen by $HYPOTHESIS_PROFILE

Each is a Hypothesis test: the smoke prefix (`verify.strategies.smoke_cases`) runs first as explicit examples, then
cases drawn by `verify.strategies.cases`. Settings come from the active Hypothesis profile (`register_profiles`,
or ``--hypothesis-profile``), with no deadline whatever the profile (a case's checks run the fp64 oracle: far above
Hypothesis' 200 ms default, whatever the kernel's speed). Under a profile with the target phase (search) every
check's err/bound is a ``target()``, so generation climbs toward the worst cases. A failure shows every failed check
and a one-line ``mla-verify --case ...`` repro.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, example, given, note, settings, target

from verify.cases import Case
from verify.checks import run_case
from verify.kernels import from_callable, impl_path_flag
from verify.strategies import cases, drawn_inputs, long_cases, smoke_cases

PROFILES = {  # Hypothesis profiles for kernel property tests (this project's tests/conftest.py registers them too)
    "ci": dict(derandomize=True, deadline=None, database=None, print_blob=True, max_examples=25,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]),  # the same cases every run
    "dev": dict(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow]),  # random, database
    "search": dict(deadline=None, max_examples=5_000, phases=[Phase.explicit, Phase.reuse, Phase.generate,
                                                              Phase.target],
                   suppress_health_check=list(HealthCheck)),  # many examples, target(), no shrinking
}
# ci's examples without the shrink phase: the first failing case is reported as drawn. For a time-limited run (a GPU
# device call), where shrinking a failure, each try a full case with its compiles, would outlast the limit.
PROFILES["triage"] = dict(PROFILES["ci"], phases=[Phase.explicit, Phase.reuse, Phase.generate])


def register_profiles(default: str = "ci") -> str:
    """Register the ci / dev / search / triage profiles (`PROFILES`) with Hypothesis and load $HYPOTHESIS_PROFILE, else
    ``default``; returns the loaded name. Call it from your conftest.py (Hypothesis reads no environment variable
    itself). Each profile derives from Hypothesis' own defaults, not from the profile loaded now: a second call
    after loading search would otherwise give ci search's phases (no shrinking, a target phase)."""
    for name, kwargs in PROFILES.items():
        settings.register_profile(name, parent=settings.get_profile("default"), **kwargs)
    name = os.environ.get("HYPOTHESIS_PROFILE", default)
    settings.load_profile(name)
    return name


def mla_property_test(
    fn,
    dtype: str = "bf16",
    *,
    fp8_format: str = "e4m3fn",
    max_seq_len: int = 4096,
    heads: int | None = None,
    page_size: int | None = None,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    max_batch: int = 8,
    device: str | None = None,
    far: bool | None = None,
    long: bool | None = None,
    smoke: bool = True,
    examples: tuple[Case, ...] | list[Case] = (),
    hypothesis_settings: dict | None = None,
):
    """A pytest test function checking ``fn`` on Hypothesis-drawn `Case`s of ``dtype`` ("bf16" or "fp8").

    fn follows the plug-in contract of `verify.kernels` (``fn(batch) -> out | (out, lse)``, optional
    ``fn.numerics``). device: where cases are built (default cuda if available, else cpu). far: run the far check
    (pages past element 2^31 of a 2-5 GB cache, 9.7 GB on pages of 128; None: on CUDA devices, as `mla-verify --far
    auto`). long: run the long cases after the smoke prefix (`verify.strategies.long_cases`: a request of 2^16 + 65
    tokens in more than 64 pieces, about 20 s each on a 2-core CPU, a big split batch, about 5 minutes there, that
    request on pages of 1, 85 s, and 132 requests of 4 MTP rows with 128 heads, 9 minutes (12 with fp8; a slower
    CPU); None: on CUDA devices, as `mla-verify --long auto`). smoke: run the fixed smoke prefix first. examples: more
    `Case`s to run first as explicit examples (pinned regressions, e.g. the ``@example`` lines of ``mla-verify
    --profile search``). hypothesis_settings: more Hypothesis settings for this
    test, e.g. ``dict(phases=[Phase.explicit])`` to run the examples only (the test already carries one settings
    decoration, deadline=None, which Hypothesis allows once). The other arguments shape the drawn cases as the
    `mla-verify` flags of the same names.

    A case the kernel refuses (`mla_fast.backends.Unsupported`) fails the test, but for the smoke prefix's inputs the
    campaign does not draw (fp16 q and cache for bf16, the other fp8 formats for fp8: `strategies.drawn_inputs`),
    which a kernel may refuse, as the CLI counts them; one that computes them must compute them right.
    """
    bad = [c for c in examples if not isinstance(c, Case)]
    if isinstance(examples, (str, bytes)) or bad:
        raise ValueError(f"mla_property_test.examples: expected Case instances, got {bad[:1] or examples!r}")
    kernel = from_callable(fn)
    shape = dict(fp8_format=fp8_format, max_seq_len=max_seq_len, heads=heads, page_size=page_size,
                 kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    flags = f"--impl {kernel.name}" + impl_path_flag(kernel.name)  # the repro replays from any directory
    flags += f" --device {device}" if device else ""  # where it ran
    flags += "" if far is None else f" --far {'on' if far else 'off'}"  # and with the same checks

    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if long is None:
        long = torch.device(dev).type == "cuda"

    def test(case: Case) -> None:
        # and at this process's torch thread count on a CPU (a kernel's fp32 reductions there may depend on it)
        repro = case.repro(flags + (f" --threads {torch.get_num_threads()}" if torch.device(dev).type == "cpu" else ""))
        note(f"repro: {repro}")
        result = run_case(case, kernel, dev, far)
        if result.unsupported is not None and not drawn_inputs(case, dtype, fp8_format):  # as the CLI counts them
            note(f"unsupported, allowed for the inputs the campaign does not draw: {result.unsupported}")
            return
        for c in result.checks:  # used by profiles with the target phase (search), ignored otherwise
            if c.err_over_bound is not None and 0 <= c.err_over_bound < float("inf"):
                target(c.err_over_bound, label=c.name)
        if not result.ok:
            raise AssertionError(f"{result.describe()}\nrepro: {repro}")

    explicit = (smoke_cases(dtype, **shape) if smoke else []) + (long_cases(dtype, **shape) if long else [])
    explicit += list(examples)
    for c in reversed(explicit):
        test = example(case=c)(test)
    test = given(case=cases(dtype, **shape, max_batch=max_batch))(test)
    test = settings(deadline=None, **(hypothesis_settings or {}))(test)  # over the active profile (module docstring)
    name = getattr(fn, "__name__", None) or kernel.name.rsplit(":", 1)[-1].replace(".", "_")
    test.__name__ = test.__qualname__ = f"test_{name}_{dtype}"
    return test
