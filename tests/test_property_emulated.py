"""verify.testing.mla_property_test on the emulated backend: the smoke prefix plus Hypothesis-drawn cases must all
pass every check (no false alarms), under the active profile (ci: 25 drawn cases per dtype)."""

from mla_fast.backends import BACKENDS
from verify.testing import mla_property_test

emulated = BACKENDS["emulated"]  # callable (batch) -> (out bf16, lse fp32), with per-batch .numerics

test_emulated_bf16 = mla_property_test(emulated, dtype="bf16", max_seq_len=1024)
test_emulated_fp8 = mla_property_test(emulated, dtype="fp8", max_seq_len=1024)
test_emulated_fp8_fnuz = mla_property_test(emulated, dtype="fp8", fp8_format="e4m3fnuz", max_seq_len=512, smoke=False)
