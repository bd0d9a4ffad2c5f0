"""The ``rerun`` check (verify.checks.check_rerun): an eager kernel called on tensors that a serving loop rewrote in
place for the next decode step. A wrapper that memoises what it derived from its inputs by their addresses fails
it, and only it; a kernel that derives everything afresh gives the case's bits on the roomy copy and stays in the
tier-1 bound of the next step's contents."""

import pytest

from mla_fast.backends import Unsupported
from verify import cli, mutants
from verify.cases import Case
from verify.checks import run_case
from verify.kernels import DEFAULT_NUMERICS, from_callable

CASES = {"bf16": Case(seq_lens=(0, 37, 130, 3), q_lens=(1, 2, 3, 1), heads=4, page_size=16),
         "fp8": Case(seq_lens=(70, 5), q_lens=(2, 1), heads=8, kv_dtype="fp8", q_dtype="fp8", scale_mode="static")}


@pytest.mark.parametrize("dtype", sorted(CASES))
def test_a_plan_memoised_by_address_fails_the_rerun_check_alone(dtype):
    result = run_case(CASES[dtype], from_callable(mutants.plan_cached_by_ptr))
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"rerun.out", "rerun.lse", "rerun.decode.out", "rerun.decode.lse"}, result.describe()
    assert failed["rerun.out"].startswith("the same tensors rewritten in place as the next step: requests rotated")
    checks = {c.name: c.detail for c in result.checks}
    assert checks["rerun.room"].endswith("the bits of the case's run")  # the first call on the roomy copy is right


@pytest.mark.parametrize("dtype", sorted(CASES))
def test_a_plan_kept_for_one_decode_step_fails_the_rerun_decode_step_alone(dtype):
    """An eager wrapper that replans when the lengths change, except when the same requests come back grown by at
    most their q_len (mutants.eager_fast_path): the next step rotates the requests, so it replans and passes; the
    plain decode step after it (rerun.decode, added after a review) reads no new token, and fails."""
    mutants._FAST_PLANS.clear()
    result = run_case(CASES[dtype], from_callable(mutants.eager_fast_path))
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"rerun.decode.out", "rerun.decode.lse"}, result.describe()
    assert failed["rerun.decode.out"].startswith("the same tensors rewritten in place as the step after: the same "
                                                 "requests one decode step later")
    assert "new tokens written, each built to weigh about 1/2" in failed["rerun.decode.out"]


@pytest.mark.parametrize("dtype", sorted(CASES))
def test_a_kernel_that_derives_everything_afresh_passes(dtype):
    result = run_case(CASES[dtype], from_callable(mutants.correct))
    checks = {c.name: c for c in result.checks}
    assert result.ok, result.describe()
    assert checks["rerun.room"].detail.endswith("the bits of the case's run")
    assert 0 < checks["rerun.out"].err_over_bound <= 1  # compared with the next step's oracle, not skipped
    assert "q negated and" in checks["rerun.out"].detail and "new tokens written" in checks["rerun.out"].detail
    assert 0 < checks["rerun.decode.out"].err_over_bound <= 1  # and the decode step after it with its own


def refuses_empty(batch):
    """A kernel without empty requests in its scope, as FlashMLA's dense fp8 one: `Unsupported` for them."""
    if bool((batch.seq_lens == 0).any()):
        raise Unsupported("no kernel for a request of 0 tokens")
    return mutants.correct(batch)


def test_a_next_step_the_kernel_refuses_passes_as_refused_and_is_warned(capsys):
    """The next step empties a request (with three or more): a kernel that refuses empty requests refuses it, which
    passes as rerun.refused, with its reason, and the campaign's report warns."""
    case = Case(seq_lens=(40, 70, 9), q_lens=(1, 2, 1), heads=2)
    result = run_case(case, from_callable(refuses_empty))
    checks = {c.name: c.detail for c in result.checks}
    assert result.ok and "rerun.out" not in checks, result.describe()
    assert checks["rerun.refused"].startswith("the same tensors rewritten in place as the next step")
    assert "refused: Unsupported: no kernel for a request of 0 tokens" in checks["rerun.refused"]
    assert cli.main(["--impl", "tests.test_rerun_check:refuses_empty", "--case", case.to_json()]) == 0
    assert "rerun.refused: the kernel refused the rerun check's batches in 1 cases" in capsys.readouterr().err


def _capped_numerics(batch):
    if int(batch.seq_lens.max()) > 4096:
        raise Unsupported("no kernel past 4096 tokens")
    return DEFAULT_NUMERICS


def capped(batch):
    """A kernel with a length cap that its numerics enforce too: `Unsupported` past 4096 tokens."""
    _capped_numerics(batch)
    return mutants.correct(batch)


capped.numerics = _capped_numerics


def test_a_next_step_the_kernels_numerics_refuse_passes_as_refused():
    """The next step grows a request past twice the longest: numerics that refuse it (as the kernel does) make
    rerun.refused, not a failure (a review's kernel with a length cap)."""
    result = run_case(Case(seq_lens=(3000, 40), q_lens=(1, 1), heads=2), from_callable(capped))
    checks = {c.name: c.detail for c in result.checks}
    assert result.ok and "refused: Unsupported: no kernel past 4096 tokens" in checks["rerun.refused"], \
        result.describe()


_SCALES: dict = {}


def scale_memo_by_ptr(batch):
    """A wrapper that memoises the folded score scale σ q_scale by the address of q (a review's): a serving loop's
    dynamic fp8 q scale changes every step, and the next step decodes with the old one."""
    key = (batch.q.data_ptr(), tuple(batch.q.shape))
    q_scale = _SCALES.setdefault(key, batch.q_scale)
    return mutants.correct(batch.replace(q_scale=q_scale))


def test_the_next_step_of_an_fp8_q_takes_a_new_q_scale():
    """check_rerun alone, with the memo emptied just before it: the roomy copy's run fills the memo and passes, so
    the failures are the next steps', where the same q buffer comes with twice the scale. (Through run_case the memo
    also hit addresses the earlier checks' batches had freed, and rerun.room failed for that: a review found the
    test passing with the scale left undoubled; tests/test_checks.py records the scales.)"""
    from mla_ref.decode import mla_decode_ref
    from verify.checks import _tier1_bound, check_rerun

    batch = CASES["fp8"].materialize("cpu")[0]
    kernel = from_callable(scale_memo_by_ptr)
    ref, numerics = mla_decode_ref(batch), kernel.numerics(batch)
    _SCALES.clear()
    first = scale_memo_by_ptr(batch)
    results = check_rerun(batch, kernel, 4, first, ref, _tier1_bound(batch, kernel, numerics, ref), numerics.out_dtype)
    failed = {c.name: c.detail for c in results if not c.ok}
    assert set(failed) == {"rerun.out", "rerun.lse", "rerun.decode.out", "rerun.decode.lse"}, failed
    assert "q_scale doubled" in failed["rerun.lse"], failed
    assert run_case(CASES["fp8"], from_callable(mutants.correct)).ok
