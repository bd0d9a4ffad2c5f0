"""Mutation testing of the verifier: every planted bug of verify.mutants, plugged in through --impl, makes the default
campaign exit 1; the same kernel without the bug exits 0.

The default campaign starts with the fixed smoke prefix (verify.strategies.smoke_cases), so running just that prefix
(--cases = its length) under the ci profile is deterministic and exposes each bug by itself; -x stops at the first
failed case.
"""

import pytest

from verify.cli import main
from verify.mutants import FP8_ONLY, MUTANTS
from verify.strategies import smoke_cases


def _campaign(impl: str, dtype: str, *extra: str) -> int:
    n = len(smoke_cases(dtype))
    return main(["--impl", f"verify.mutants:{impl}", "--dtype", dtype, "--cases", str(n), "--jobs", "1", *extra])


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_correct_kernel_passes(dtype):
    assert _campaign("correct", dtype) == 0


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name):
    dtype = "fp8" if name in FP8_ONLY else "bf16"
    assert _campaign(name, dtype, "-x") == 1


@pytest.mark.parametrize("name", FP8_ONLY)
def test_fp8_mutant_is_harmless_without_fp8(name):
    """Scale bugs cannot show on bf16 inputs (no scales): the campaign must pass, not flag something else."""
    assert _campaign(name, "bf16") == 0


def test_enough_mutants():
    assert len(MUTANTS) >= 10
