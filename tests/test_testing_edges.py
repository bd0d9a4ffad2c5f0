"""Edges of verify.testing found by a mutation review: the profiles' documented settings, the deadline whatever the
profile, target() on each check's finite err/bound, the order and shape of the explicit examples, the CUDA
defaults (device, long cases), the repro's thread count, the fp8 format of the refusal rule, and the test's name.

Most tests replace `verify.testing.run_case` by a recorder (no kernel, no oracle): they run in milliseconds."""

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

import verify.testing as vt
from verify.cases import Case
from verify.checks import CaseResult, CheckResult
from verify.mutants import correct
from verify.strategies import long_cases, smoke_cases

EXPLICIT = dict(phases=[Phase.explicit])  # the explicit examples only: no drawn case


def _recorder(monkeypatch, checks=()):
    """verify.testing.run_case replaced: records (case, device, far) and returns ``checks`` as the case's result."""
    seen = []

    def run_case(case, kernel, device="cpu", far=None):
        seen.append((case, device, far))
        return CaseResult(case, list(checks))

    monkeypatch.setattr(vt, "run_case", run_case)
    return seen


def test_the_profiles_hold_their_documented_settings():
    """ci: derandomized, no database, no deadline, failure blobs printed, 25 examples (the emulated property tests'
    "25 drawn cases per dtype"), too_slow and data_too_large suppressed; dev: random, with the example database,
    more examples than ci; search: its explicit examples too (the smoke prefix, pinned regressions), every health
    check suppressed; triage: ci's examples, explicit, reused and generated, with no shrink or target phase."""
    ci, dev, search, triage = (vt.PROFILES[p] for p in ("ci", "dev", "search", "triage"))
    assert ci["derandomize"] is True and ci["database"] is None and ci["deadline"] is None
    assert ci["print_blob"] is True and ci["max_examples"] == 25
    assert {HealthCheck.too_slow, HealthCheck.data_too_large} <= set(ci["suppress_health_check"])
    assert not dev.get("derandomize", False) and "database" not in dev and dev["max_examples"] > ci["max_examples"]
    assert Phase.explicit in search["phases"] and set(search["suppress_health_check"]) == set(HealthCheck)
    assert list(triage["phases"]) == [Phase.explicit, Phase.reuse, Phase.generate]
    assert {k: v for k, v in triage.items() if k != "phases"} == ci


def test_the_registered_profiles_take_those_settings(monkeypatch):
    """register_profiles() registers each profile as PROFILES says (dev keeps Hypothesis' example database)."""
    try:
        monkeypatch.setenv("HYPOTHESIS_PROFILE", "dev")
        assert vt.register_profiles() == "dev"
        assert settings.default.database is not None and not settings.default.derandomize
        assert settings.default.max_examples == vt.PROFILES["dev"]["max_examples"]
        ci = settings.get_profile("ci")
        assert ci.database is None and ci.print_blob and ci.max_examples == vt.PROFILES["ci"]["max_examples"]
        assert Phase.explicit in settings.get_profile("search").phases
        assert Phase.explicit in settings.get_profile("triage").phases
    finally:
        monkeypatch.undo()
        vt.register_profiles()


def test_no_deadline_under_a_profile_that_has_one(monkeypatch):
    """mla_property_test sets deadline=None itself: under Hypothesis' own default profile (200 ms) its test still
    has none (the ci profile has none either, so a test built under it could not tell)."""
    try:
        settings.load_profile("default")
        assert settings.default.deadline is not None
        assert vt.mla_property_test(correct)._hypothesis_internal_use_settings.deadline is None
    finally:
        vt.register_profiles()


def test_target_takes_each_checks_finite_ratio(monkeypatch):
    """Each check's err/bound in [0, inf) is a target() observation labelled with the check's name; a check without
    a ratio (None) or with an infinite one (a NaN where the oracle is finite) gives none."""
    checks = [CheckResult("tier1.out", True, 0.5), CheckResult("tier1.lse", True, 0.0), CheckResult("empty", True),
              CheckResult("split.out", True, float("inf"))]
    _recorder(monkeypatch, checks)
    observed = []
    monkeypatch.setattr(vt, "target", lambda value, label: observed.append((label, value)))
    vt.mla_property_test(correct, smoke=False, examples=[Case()], device="cpu", hypothesis_settings=EXPLICIT)()
    assert observed == [("tier1.out", 0.5), ("tier1.lse", 0.0)]


def test_the_smoke_prefix_then_the_long_cases_then_the_examples_run_in_order_with_the_shape(monkeypatch):
    """The explicit examples run as the docstring says: the smoke prefix first, then the long cases, then
    ``examples`` in their order, each shaped by heads / page_size (here 4 heads on pages of 16)."""
    seen = _recorder(monkeypatch)
    pinned = [Case(seq_lens=(5,), q_lens=(1,), seed=1), Case(seq_lens=(7,), q_lens=(2,), seed=2)]
    shape = dict(heads=4, page_size=16)
    vt.mla_property_test(correct, "bf16", device="cpu", long=True, examples=pinned, hypothesis_settings=EXPLICIT,
                         **shape)()
    expected = smoke_cases("bf16", **shape) + long_cases("bf16", **shape) + pinned
    assert [case for case, _, _ in seen] == expected


def test_on_cuda_the_defaults_are_the_cuda_device_and_the_long_cases(monkeypatch):
    """device=None and long=None: with CUDA available, cases run on "cuda" and the long cases follow the smoke
    prefix (as `mla-verify --long auto`); far stays None (run_case decides it by the device)."""
    seen = _recorder(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    vt.mla_property_test(correct, "bf16", hypothesis_settings=EXPLICIT)()
    assert {(device, far) for _, device, far in seen} == {("cuda", None)}
    assert [case for case, _, _ in seen] == smoke_cases("bf16") + long_cases("bf16")


def test_a_cpu_repro_names_the_thread_count(monkeypatch):
    """A failure on the CPU replays at this process's torch thread count (a kernel's fp32 sums may depend on it)."""
    _recorder(monkeypatch, [CheckResult("tier1.out", False, 2.0, detail="over")])
    test = vt.mla_property_test(correct, smoke=False, examples=[Case()], device="cpu", hypothesis_settings=EXPLICIT)
    with pytest.raises(AssertionError, match=rf"repro: mla-verify .*--device cpu --threads {torch.get_num_threads()}"):
        test()


def test_a_refusal_of_the_campaigns_own_fp8_format_fails(monkeypatch):
    """With fp8_format="e4m3fnuz" the campaign draws e4m3fnuz caches: a kernel that refuses one fails the test (the
    allowance covers the formats the campaign does not draw, judged for the test's own format)."""
    fnuz = Case(seq_lens=(3,), q_lens=(1,), kv_dtype="fp8", fp8_format="e4m3fnuz")
    monkeypatch.setattr(vt, "run_case", lambda case, kernel, device="cpu", far=None: CaseResult(case, unsupported="no"))
    test = vt.mla_property_test(correct, "fp8", fp8_format="e4m3fnuz", smoke=False, examples=[fnuz], device="cpu",
                                hypothesis_settings=EXPLICIT)
    with pytest.raises(AssertionError, match="UNSUPPORTED"):
        test()


def test_the_test_is_named_after_the_kernel_and_dtype():
    """pytest reports the returned function under its module variable, tracebacks and Hypothesis under its name."""
    for dtype in ("bf16", "fp8"):
        test = vt.mla_property_test(correct, dtype)
        assert test.__name__ == test.__qualname__ == f"test_correct_{dtype}"


@pytest.mark.parametrize("examples", ["", b""])
def test_examples_of_a_str_or_bytes_are_refused_even_empty(examples):
    """A string is no sequence of Cases, even an empty one (which names no bad element)."""
    with pytest.raises(ValueError, match=r"mla_property_test\.examples: expected Case instances"):
        vt.mla_property_test(correct, examples=examples)
