"""A device fault in any of a case's runs fails the case as a device fault (`CaseResult.device_fault`), whichever
check made the run: a faulting kernel leaves the CUDA context unusable, so the campaign stops at that case and
names it (tests/test_cli.py) rather than charging later checks, or later cases, with its aftermath."""

import pytest
import torch

from verify import checks, mutants
from verify.kernels import from_callable
from verify.strategies import smoke_cases

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


class _FaultsOnCall:
    """mutants.correct, with persistent workers (so the split check runs too), raising a device fault on call
    ``n`` (0: never); records the checks' calls."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, batch):
        self.calls += 1
        if self.calls == self.n:
            raise torch.AcceleratorError(ILLEGAL_ADDRESS)
        return mutants.correct(batch)

    def run_workers(self, batch, workers):
        return self(batch)


def _small_far(batch, *args, **kwargs):  # a copy stands in for the 2-4 GB far cache
    return batch.replace(kv_cache=batch.kv_cache.clone())


def _calls_of_a_clean_case(monkeypatch) -> int:
    monkeypatch.setattr(checks, "far_pages", _small_far)
    kernel = _FaultsOnCall(0)
    result = checks.run_case(smoke_cases("bf16")[0], from_callable(kernel), "cpu", far=True)
    assert result.ok and not result.device_fault, result.describe()
    return kernel.calls


def test_a_clean_case_runs_every_rerunning_check(monkeypatch):
    """first run, repeat, split, nan (two: the newest token, the first), rounding, rescale, partials, layout,
    padding, batch (four: grown, shrunk, mtp, shared), rerun (three: the roomy copy, the next step, the decode step
    after it), far: eighteen runs on this smoke case."""
    assert _calls_of_a_clean_case(monkeypatch) == 18


@pytest.mark.parametrize("n", range(1, 19))
def test_a_device_fault_in_any_run_fails_the_case_as_a_device_fault(monkeypatch, n):
    monkeypatch.setattr(checks, "far_pages", _small_far)
    result = checks.run_case(smoke_cases("bf16")[0], from_callable(_FaultsOnCall(n)), "cpu", far=True)
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert result.device_fault and len(failed) == 1, result.describe()
    assert ILLEGAL_ADDRESS in next(iter(failed.values())) and set(failed) <= {"contract", "device"}, failed
    assert all(c.ok for c in result.checks if c.name not in failed)


class _StepFaultsAt(mutants._Step):
    """mutants.correct's step, raising a device fault at one stage: "build", "plan" (the first), "run" (the eager
    run) or "replan" (the next step's plan)."""

    stage = ""

    def __init__(self, batch, max_q_len):
        if self.stage == "build":
            raise torch.AcceleratorError(ILLEGAL_ADDRESS)
        super().__init__(batch, max_q_len)

    def plan(self, batch):
        if self.stage == "plan" or (self.stage == "replan" and self.planned):
            raise torch.AcceleratorError(ILLEGAL_ADDRESS)
        super().plan(batch)

    def run(self):
        if self.stage == "run":
            raise torch.AcceleratorError(ILLEGAL_ADDRESS)
        return super().run()


@pytest.mark.parametrize("stage", ["build", "plan", "run", "replan"])
def test_a_device_fault_in_the_step_check_fails_the_case_as_a_device_fault(stage):
    """The step check's own runs (build, plan, eager run, the next step's plan) propagate a device fault as the
    other checks do: the case is a device fault, failed by name, and nothing after it runs."""
    step = type("Step", (_StepFaultsAt,), {"stage": stage})

    def decode(batch):
        return mutants.correct(batch)

    decode.step = step
    result = checks.run_case(smoke_cases("bf16")[0], from_callable(decode), "cpu", far=False)
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert result.device_fault and set(failed) == {"device"} and ILLEGAL_ADDRESS in failed["device"], failed
    assert not any(c.name.startswith("step.replan") or c.name == "inputs" for c in result.checks)
