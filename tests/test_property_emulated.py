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
