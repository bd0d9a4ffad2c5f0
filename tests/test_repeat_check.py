"""The repeat check: the kernel run a second time on the same batch with the same worker count.

Every other rerun of a case changes something (the plan, the data, the layout), and is allowed other bits. Only
an identical second run tells a kernel whose results vary from run to run (split outputs merged by atomics in the
order splits finish, work stealing) from one that does not; serving engines that promise reproducible or
batch-invariant decoding need the latter. A kernel declares which it is (`Kernel.deterministic`, True by default).
"""

import dataclasses

import pytest
import torch

from mla_fast.backends import BACKENDS, Unsupported
from verify import mutants
from verify.checks import run_case
from verify.kernels import NONDETERMINISTIC, from_backend, from_callable
from verify.strategies import smoke_cases


class _SecondCall:
    """A plug-in that runs mutants.correct and applies ``change(out, lse)`` on its second call (the repeat check's:
    it comes right after the first run) only."""

    def __init__(self, change, deterministic=None):
        self.calls, self.change = 0, change
        if deterministic is not None:
            self.deterministic = deterministic

    def __call__(self, batch):
        self.calls += 1
        out, lse = mutants.correct(batch)
        return self.change(out, lse) if self.calls == 2 else (out, lse)


def _checks(result):
    return {c.name: c for c in result.checks}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("kernel", ["emulated", "verify.mutants:correct"])
def test_deterministic_kernels_give_the_first_runs_bits(dtype, kernel):
    k = from_backend(kernel) if ":" not in kernel else from_callable(mutants.correct)
    result = run_case(smoke_cases(dtype)[0], k, "cpu")
    assert result.ok and _checks(result)["repeat"].detail.endswith("the bits of the first run"), result.describe()


def test_a_merge_order_that_varies_fails_the_repeat_check_alone():
    """The mutant's results are right (every bounded check passes), but its second run differs in the last bits:
    repeat fails, says where the bits first differ and how a kernel that varies by design declares it."""
    result = run_case(smoke_cases("bf16")[0], from_callable(mutants.merge_order_varies), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"repeat"}, result.describe()
    assert "differ from the first run" in failed["repeat"] and "first at " in failed["repeat"]
    assert ".deterministic = False" in failed["repeat"]


def test_a_declared_nondeterministic_kernel_passes_within_the_tier1_bound():
    def varies(batch):
        return mutants.merge_order_varies(batch)

    varies.deterministic = False
    kernel = from_callable(varies)
    assert not kernel.deterministic and NONDETERMINISTIC in kernel.reason
    result = run_case(smoke_cases("bf16")[0], kernel, "cpu")
    checks = _checks(result)
    assert result.ok and {"repeat.out", "repeat.lse"} <= set(checks), result.describe()
    assert "differ from the first run" in checks["repeat.lse"].detail
    assert checks["repeat.lse"].err_over_bound < 1


def test_a_declared_nondeterministic_kernel_whose_second_run_is_wrong_fails():
    """The declaration relaxes bits to the tier-1 bound, not further: a second run whose out carries a relative
    error of 2^-6 (two to four bf16 ulps, by where a value sits in its binade) fails repeat.out."""
    kernel = from_callable(_SecondCall(lambda out, lse: ((out.float() * (1 + 2**-6)).to(out.dtype), lse),
                                       deterministic=False))
    result = run_case(smoke_cases("bf16")[0], kernel, "cpu")
    failed = {c.name: c for c in result.checks if not c.ok}
    assert set(failed) == {"repeat.out"}, result.describe()
    assert failed["repeat.out"].err_over_bound > 1


def test_the_first_difference_is_located():
    """One out element negated on the second call (its sign bit: one byte): the detail names that element with
    this run's value first, and counts one out byte; the lse bits agree."""
    def negate(out, lse):
        out = out.clone()
        out[2, 0, 0] = -out[2, 0, 0]  # row 2: a request of one token, whose output is that token's c_kv
        return out, lse

    case = smoke_cases("bf16")[0]
    result = run_case(case, from_callable(_SecondCall(negate)), "cpu")
    detail = _checks(result)["repeat"].detail
    v = mutants.correct(case.materialize("cpu")[0])[0][2, 0, 0].item()
    assert v != 0 and not result.ok
    first = f"first at out[2, 0, 0]: {-v!r} vs {v!r}"
    assert f"1 out elements differ from the first run, 0 lse elements ({first})" in detail


def _raise(e):
    raise e


@pytest.mark.parametrize(("change", "says"), [
    (lambda out, lse: _raise(RuntimeError("workspace exhausted")), "raised RuntimeError: workspace"),
    (lambda out, lse: _raise(Unsupported("no kernel")), "raised Unsupported: no kernel"),  # it took the batch once
    (lambda out, lse: (out.float(), lse), "this run returned torch.float32, torch.float32 where the first run "
                                          "returned torch.bfloat16, torch.float32"),
    (lambda out, lse: (out, lse.double()), "returned torch.bfloat16, torch.float64 where"),
    (lambda out, lse: (out[:1], lse), "expected shape"),
    (lambda out, lse: out, "lse returned by only one of this run and the first run"),
])
def test_a_second_run_that_breaks_the_contract_fails(change, says):
    result = run_case(smoke_cases("bf16")[0], from_callable(_SecondCall(change)), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert "repeat" in failed and says in failed["repeat"], result.describe()


def test_values_that_print_alike_are_shown_in_hex():
    """Two NaNs of other payloads print alike: the detail adds their bits (this run's first). -0.0 and 0.0 print
    apart, and need none."""
    class Payloads:  # lse[0, 0] NaN in both runs, its payload 0x7fc00000 then 0x7fc00001 (both quiet NaNs)
        calls = 0

        def __call__(self, batch):
            self.calls += 1
            out, lse = mutants.correct(batch)
            lse.view(torch.int32)[0, 0] = 0x7FC00000 + (self.calls == 2)
            return out, lse

    case = smoke_cases("bf16")[0]
    detail = _checks(run_case(case, from_callable(Payloads()), "cpu"))["repeat"].detail
    assert "first at lse[0, 0]: nan (0x7fc00001) vs nan (0x7fc00000)" in detail, detail
    negated = _SecondCall(lambda out, lse: (out.where(out != 0, -0.0), lse))  # every 0 of out as -0.0
    detail = _checks(run_case(case, from_callable(negated), "cpu"))["repeat"].detail
    assert "first at out[0, 0, 0]: -0.0 vs 0.0)" in detail, detail  # row 0 sees no token: out 0


def test_the_declaration_is_a_bool_and_backends_carry_theirs(monkeypatch):
    def plug(batch):
        return mutants.correct(batch)

    plug.deterministic = "no"
    with pytest.raises(ValueError, match=r"\.deterministic must be True or False, got 'no'"):
        from_callable(plug)
    assert all(BACKENDS[n].deterministic for n in ("ref", "emulated", "triton", "seesaw", "gluon_fp8"))
    monkeypatch.setitem(BACKENDS, "emulated", dataclasses.replace(BACKENDS["emulated"], deterministic=False))
    kernel = from_backend("emulated")
    assert not kernel.deterministic and NONDETERMINISTIC in kernel.reason


def test_the_difference_counts_elements_not_bytes():
    """Two bf16 elements moved, one in both of its bytes: 2 elements differ (3 bytes do); NaNs of other payloads
    differ too."""
    from verify.checks import _elements_differ

    a = torch.tensor([1.0, 2.0, 3.0, float("nan")], dtype=torch.bfloat16)
    b = a.clone()
    b[0] = -1.0  # the sign: one byte
    b[1] = 2.0 ** -20  # exponent and mantissa: both bytes
    assert _elements_differ(a, b) == 2
    c = a.clone()
    c.view(torch.int16)[3] ^= 1  # another NaN payload
    assert _elements_differ(a, c) == 1 and _elements_differ(a, a.clone()) == 0
