"""verify.testing.mla_property_test on the emulated backend: the smoke prefix plus Hypothesis-drawn cases must all
pass every check (no false alarms), under the active profile (ci: 25 drawn cases per dtype)."""

from mla_fast.backends import BACKENDS
from verify.cases import Case
from verify.testing import mla_property_test

emulated = BACKENDS["emulated"]  # callable (batch) -> (out bf16, lse fp32), with per-batch .numerics

# the worst cases of `mla-verify --backend emulated --dtype fp8 --profile search` (forty-fifth session, 1745 cases on
# the CPU, 0 failed), pinned: tier1.out 0.979, split.out 0.954, rounding.out 0.838, partials.out 0.612
FP8_SEARCH_WORST = (
    Case(seq_lens=(12, 5, 7, 3, 5, 5, 3, 12), q_lens=(4, 3, 4, 1, 4, 1, 1, 1), heads=128, page_size=3, kv_dtype="fp8",
         scale_mode="dynamic", dist="gauss1", num_workers=4, seed=1995),
    Case(seq_lens=(1, 253, 3, 374, 401, 31, 31, 150), q_lens=(2, 1, 4, 2, 4, 1, 2, 4), heads=5, page_size=16,
         q_dtype="fp8", kv_dtype="fp8", scale_mode="static", dist="near_max", num_workers=132, seed=154967),
    Case(seq_lens=(9,), q_lens=(1,), heads=20, page_size=16, kv_dtype="fp8", scale_mode="dynamic", dist="wide",
         num_workers=32, seed=277),
    Case(seq_lens=(3, 68, 47), q_lens=(3, 1, 3), heads=5, page_size=3, kv_dtype="fp8", scale_mode="static",
         dist="wide", num_workers=32, seed=0),
    # fifty-second session's search (327 cases, 0 failed): the worst rerun.out, 0.935
    Case(seq_lens=(443, 4, 4, 1), q_lens=(3, 4, 4, 1), heads=16, page_size=3, kv_dtype="fp8", scale_mode="unit",
         dist="outlier", num_workers=32, seed=179),
)

# the fifty-second session's bf16 search (1209 cases, 2 jobs, 0 failed): the worst rerun.out, 0.976
BF16_SEARCH_WORST = (
    Case(seq_lens=(103, 298, 64, 41, 18, 28, 4, 65), q_lens=(1, 3, 4, 4, 1, 1, 3, 1), heads=20, page_size=64,
         dist="gauss1", num_workers=8, seed=530559),
)

test_emulated_bf16 = mla_property_test(emulated, dtype="bf16", max_seq_len=1024, examples=BF16_SEARCH_WORST)
test_emulated_fp8 = mla_property_test(emulated, dtype="fp8", max_seq_len=1024, examples=FP8_SEARCH_WORST)
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

    # the smoke prefix only, asked for by name: with no explicit example Hypothesis would skip the test, and the
    # skip would escape pytest.raises below
    first = dict(smoke=True, hypothesis_settings=dict(max_examples=1, phases=[Phase.explicit]))
    test = mla_property_test(int32_offsets, dtype="fp8", device="cpu", far=True, **first)
    with pytest.raises(AssertionError, match=r"far\.out[\s\S]*repro: mla-verify .* --device cpu --far on"):
        test()
    mla_property_test(int32_offsets, dtype="fp8", device="cpu", **first)()  # far off on a CPU: passes
    seen, caches = [], []

    def record_sizes(batch):  # the batch check's regroupings share the case's cache and hold other requests
        if not any(batch.kv_cache is kv for kv in caches):
            caches.append(batch.kv_cache)
            seen.append(batch.batch_size)
        return emulated(batch)

    record = mla_property_test(record_sizes, max_seq_len=64,
                               device="cpu", max_batch=1, smoke=False,
                               hypothesis_settings=dict(max_examples=8, derandomize=True, database=None))
    record()
    assert seen and set(seen) == {1}


def test_property_tests_have_no_deadline_and_the_profiles_register(monkeypatch):
    """Outside this project no conftest sets a profile: Hypothesis' 200 ms default deadline failed every case (the
    checks run the fp64 oracle; found by a review), and HYPOTHESIS_PROFILE=search did nothing. mla_property_test sets
    no deadline itself; register_profiles() registers ci / dev / search / triage and loads $HYPOTHESIS_PROFILE. A
    second call after loading search gave ci search's phases (no shrinking) until each profile took Hypothesis'
    defaults as its parent (sixty-sixth session)."""
    from hypothesis import Phase, settings

    from verify.testing import register_profiles

    test = mla_property_test(emulated, dtype="bf16")
    assert test._hypothesis_internal_use_settings.deadline is None
    try:
        monkeypatch.setenv("HYPOTHESIS_PROFILE", "search")
        assert register_profiles() == "search"
        assert Phase.target in settings.default.phases and Phase.shrink not in settings.default.phases
        assert mla_property_test(emulated, dtype="fp8")._hypothesis_internal_use_settings.max_examples == 5_000
        monkeypatch.setenv("HYPOTHESIS_PROFILE", "triage")  # ci's examples, unshrunk
        assert register_profiles() == "triage" and settings.default.derandomize
        assert Phase.shrink not in settings.default.phases and Phase.generate in settings.default.phases
        assert settings.default.max_examples == settings.get_profile("ci").max_examples
        monkeypatch.delenv("HYPOTHESIS_PROFILE")
        assert register_profiles() == "ci" and settings.default.derandomize
        assert Phase.shrink in settings.default.phases
    finally:
        monkeypatch.undo()  # the run's own $HYPOTHESIS_PROFILE (e.g. search) back for the tests after this one
        register_profiles()


def test_long_reaches_the_property_test():
    """long=True runs the long cases after the smoke prefix, where the default (a CPU: off) does not: the 16-bit
    position mutant fails there, on the first long case (the request of 2^16 + 65 tokens beside ones of 3 and 1),
    and passes without them. The explicit examples stop at the first failure (report_multiple_bugs off: else each
    long case runs, the 128-head MTP batch alone for 9 minutes, and Hypothesis reports the simplest failing
    one)."""
    import pytest
    from hypothesis import Phase

    from verify.mutants import uint16_positions

    first = dict(smoke=False, hypothesis_settings=dict(max_examples=1, phases=[Phase.explicit],
                                                      report_multiple_bugs=False))  # explicit only, to a failure
    with pytest.raises(AssertionError, match=r"seq\[65601,3,1\][\s\S]*tier1\.out"):
        mla_property_test(uint16_positions, dtype="bf16", device="cpu", long=True, **first)()
    mla_property_test(uint16_positions, dtype="bf16", device="cpu", max_seq_len=64, smoke=False,
                      hypothesis_settings=dict(max_examples=2, derandomize=True, database=None))()  # long off: passes
    import torch  # a torch.device resolves the long default too (a string was assumed: found by a review)

    mla_property_test(uint16_positions, dtype="bf16", device=torch.device("cpu"), max_seq_len=64, smoke=False,
                      hypothesis_settings=dict(max_examples=1, derandomize=True, database=None))()


def test_examples_must_be_cases():
    """A pinned example that is no Case is refused when the test is built, naming the argument (it failed only when
    the test ran, with an AttributeError on .repro; found by a review)."""
    import pytest

    from verify.cases import Case
    from verify.mutants import correct

    for examples in ([1], [Case(), "{}"]):
        with pytest.raises(ValueError, match=r"mla_property_test\.examples: expected Case instances"):
            mla_property_test(correct, examples=examples)
    assert callable(mla_property_test(correct, examples=[Case()]))


def test_a_kernel_may_refuse_the_inputs_the_campaign_does_not_draw():
    """The smoke prefix's other inputs (fp16 q and cache for bf16; e4m3fnuz and e5m2 caches for e4m3fn fp8) may be
    refused (`Unsupported`) in a property test, as the CLI counts them: the Triton backend refuses them, and its GPU
    property tests failed on the first of them (sixty-sixth session). A kernel that reads their bits as its own
    format's still fails there, and a refusal of an input the campaign draws still fails."""
    import pytest
    import torch
    from hypothesis import Phase

    from mla_fast.backends import Unsupported
    from verify.mutants import correct, dtype_unchecked
    from verify.strategies import drawn_inputs, smoke_cases

    def bf16_e4m3fn_only(batch):
        if batch.q.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or \
                batch.kv_cache.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise Unsupported("bf16 and e4m3fn only")
        return correct(batch)

    def refuse_all(batch):
        raise Unsupported("nothing")

    explicit = dict(smoke=False, device="cpu", hypothesis_settings=dict(phases=[Phase.explicit]))
    for dtype in ("bf16", "fp8"):
        others = [c for c in smoke_cases(dtype) if not drawn_inputs(c, dtype)]
        assert len(others) == (1 if dtype == "bf16" else 2), others  # fp16; e4m3fnuz and e5m2
        mla_property_test(bf16_e4m3fn_only, dtype, examples=others, **explicit)()
        with pytest.raises(AssertionError, match=r"NOT OK"):  # a check failed (not a refusal)
            mla_property_test(dtype_unchecked, dtype, examples=others, **explicit)()
        drawn = [c for c in smoke_cases(dtype) if drawn_inputs(c, dtype)][:1]
        with pytest.raises(AssertionError, match="UNSUPPORTED"):
            mla_property_test(refuse_all, dtype, examples=drawn, **explicit)()


def test_drawn_inputs_holds_for_every_drawn_case():
    """`drawn_inputs` is the campaign's own dtype rule: every case `cases` draws satisfies it (for each fp8 format
    a campaign takes), so the Unsupported allowance above never reaches a drawn case."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from verify.strategies import cases, drawn_inputs

    @settings(max_examples=60, database=None)
    @given(data=st.data())
    def check(data):
        dtype, fmt = data.draw(st.sampled_from([("bf16", "e4m3fn"), ("fp8", "e4m3fn"), ("fp8", "e4m3fnuz")]))
        case = data.draw(cases(dtype, fp8_format=fmt, max_seq_len=256))
        assert drawn_inputs(case, dtype, fmt), case
        assert not drawn_inputs(case, "fp8" if dtype == "bf16" else "bf16", fmt), case

    check()
