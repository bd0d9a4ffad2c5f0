"""verify.testing.mla_property_test on the emulated backend: the smoke prefix plus Hypothesis-drawn cases must all
pass every check (no false alarms), under the active profile (ci: 25 drawn cases per dtype)."""

from mla_fast.backends import BACKENDS
from verify.testing import mla_property_test

emulated = BACKENDS["emulated"]  # callable (batch) -> (out bf16, lse fp32), with per-batch .numerics

test_emulated_bf16 = mla_property_test(emulated, dtype="bf16", max_seq_len=1024)
test_emulated_fp8 = mla_property_test(emulated, dtype="fp8", max_seq_len=1024)
test_emulated_fp8_fnuz = mla_property_test(emulated, dtype="fp8", fp8_format="e4m3fnuz", max_seq_len=512, smoke=False)


def test_a_failing_property_test_prints_a_repro_for_its_device():
    """The repro line of a failed case replays it where it ran: without --device, mla-verify picks cuda where there
    is one, so a test pinned to the CPU replayed elsewhere (found by a review)."""
    import pytest

    from verify.mutants import wrong_scale

    test = mla_property_test(wrong_scale, dtype="bf16", max_seq_len=64, device="cpu")
    with pytest.raises(AssertionError, match=r"repro: mla-verify --case '.*' --impl \S+wrong_scale --device cpu"):
        test()


def test_far_and_max_batch_reach_the_property_test():
    """far=True runs the far check where the default (a CPU: off) would not, and its repro says --far on; the
    int32-offset mutant passes without it. max_batch bounds the drawn requests (here 1: one per case)."""
    import pytest
    from hypothesis import Phase

    from verify.mutants import int32_offsets

    first = dict(hypothesis_settings=dict(max_examples=1, phases=[Phase.explicit]))  # the smoke prefix only
    test = mla_property_test(int32_offsets, dtype="fp8", device="cpu", far=True, **first)
    with pytest.raises(AssertionError, match=r"far\.out[\s\S]*repro: mla-verify .* --device cpu --far on"):
        test()
    mla_property_test(int32_offsets, dtype="fp8", device="cpu", **first)()  # far off on a CPU: passes
    seen = []
    record = mla_property_test(lambda batch: seen.append(batch.batch_size) or emulated(batch), max_seq_len=64,
                               device="cpu", max_batch=1, smoke=False,
                               hypothesis_settings=dict(max_examples=8, derandomize=True, database=None))
    record()
    assert seen and set(seen) == {1}


def test_property_tests_have_no_deadline_and_the_profiles_register(monkeypatch):
    """Outside this project no conftest sets a profile: Hypothesis' 200 ms default deadline failed every case (the
    checks run the fp64 oracle; found by a review), and HYPOTHESIS_PROFILE=search did nothing. mla_property_test sets
    no deadline itself; register_profiles() registers ci / dev / search and loads $HYPOTHESIS_PROFILE."""
    from hypothesis import Phase, settings

    from verify.testing import register_profiles

    test = mla_property_test(emulated, dtype="bf16")
    assert test._hypothesis_internal_use_settings.deadline is None
    try:
        monkeypatch.setenv("HYPOTHESIS_PROFILE", "search")
        assert register_profiles() == "search"
        assert Phase.target in settings.default.phases and Phase.shrink not in settings.default.phases
        assert mla_property_test(emulated, dtype="fp8")._hypothesis_internal_use_settings.max_examples == 5_000
    finally:
        monkeypatch.delenv("HYPOTHESIS_PROFILE")
        assert register_profiles() == "ci" and settings.default.derandomize
