"""verify.checks: each check's verdict on made-up or planted outputs, pinned where a source-mutation review of
verify/checks.py (sixty-fourth session) found an edit no other test failed (each test names the edit, C..)."""

import pytest
import torch

from verify.cases import Case


def _judge(batch, kernel) -> tuple:
    """(fp64 oracle, tier-1 bound, declared out dtype) of ``kernel`` on ``batch``: the judge run_case hands the
    checks that compare a later run with the oracle (rerun, far, step)."""
    from mla_ref.decode import mla_decode_ref
    from verify.checks import _tier1_bound

    ref, numerics = mla_decode_ref(batch), kernel.numerics(batch)
    return ref, _tier1_bound(batch, kernel, numerics, ref), numerics.out_dtype


class _SecondCall:
    """mutants.correct, with ``change(out, lse)`` applied on the second call only (run_case's repeat check)."""

    def __init__(self, change):
        self.calls, self.change = 0, change

    def __call__(self, batch):
        from verify import mutants

        self.calls += 1
        out, lse = mutants.correct(batch)
        return self.change(out, lse) if self.calls == 2 else (out, lse)


def test_a_second_run_of_other_dtypes_names_no_row():
    """Mutant C35 (`_as_first` giving a row to a second run of other dtypes): with no bits to compare there is no
    first differing element, so a deterministic kernel's failed repeat names the dtypes and no row."""
    from verify.checks import run_case
    from verify.kernels import from_callable
    from verify.strategies import smoke_cases

    result = run_case(smoke_cases("bf16")[0], from_callable(_SecondCall(lambda out, lse: (out.float(), lse))), "cpu")
    detail = next(c.detail for c in result.checks if c.name == "repeat")
    assert "this run returned torch.float32, torch.float32 where the first run returned" in detail, detail
    assert "the first row" not in detail and "first at" not in detail, detail


def test_tier1_lse_ulps_are_counted_in_fp32_whatever_the_out_dtype():
    """Mutant C12 (check_tier1 counting the lse's ULPs in the out dtype): the lse is fp32 (the contract), so its
    report's max_ulp and out_dtype are fp32's, while out's are the declared out dtype's. An lse one fp32 ulp off
    the oracle (far inside any bound, so both checks hold) reports 1 (bf16 would round both to one value: 0)."""
    from verify import bounds
    from verify.checks import check_tier1

    g = torch.Generator().manual_seed(0)
    ref_out = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)  # [T, H, L]
    ref_lse = torch.rand(3, 2, generator=g, dtype=torch.float64) + 1.0  # [T, H] in [1, 2): one fp32 binade
    out = ref_out.to(torch.bfloat16)
    lse = ref_lse.to(torch.float32)
    lse[0, 0] = torch.nextafter(lse[0, 0], torch.tensor(3.0))  # one fp32 ulp further from the oracle
    bound = bounds.Bound(torch.ones_like(ref_out), torch.ones_like(ref_lse))  # loose: only the ulp count is tested
    res = {r.name: r.report for r in check_tier1(out, lse, (ref_out, ref_lse), bound, torch.bfloat16)}
    assert res["tier1.out"]["out_dtype"] == "bfloat16" and res["tier1.lse"]["out_dtype"] == "float32"
    assert res["tier1.lse"]["max_ulp"] == 1  # the oracle is first rounded to fp32's grid: lse's own value


def test_the_tier1_bound_charges_the_output_rounding_of_the_merge_error():
    """Mutant C10 (`_tier1_bound` without the merge term's (1 + u_out)): the merged value is rounded to the output
    dtype after the merge, which moves it by u_out of the merge error too (kernel_bound charges u_out |ô| only),
    so the tier-1 out bound is kernel_bound + merge_bound (1 + u_out); the lse takes merge_bound's lse as it is.
    On a case the kernel splits (one request of 300 tokens: 5 pieces of 64), the merge term is not 0."""
    from mla_ref.decode import mla_decode_ref
    from verify import bounds
    from verify.checks import _tier1_bound
    from verify.kernels import from_callable
    from verify.mutants import correct

    batch = Case(seq_lens=(300, 7), q_lens=(2, 1), heads=2, seed=5).materialize("cpu")[0]
    kernel = from_callable(correct)
    numerics = kernel.numerics(batch)
    ref = mla_decode_ref(batch)
    merge = bounds.merge_bound(batch, kernel.max_splits(batch), partial_dtype=numerics.partial_dtype)
    assert kernel.max_splits(batch) > 1 and bool((merge.out > 0).any())
    u_out = bounds._unit_roundoff(numerics.out_dtype)  # bf16: 2^-8
    got = _tier1_bound(batch, kernel, numerics, ref)
    kernel_only = bounds.kernel_bound(batch, numerics, ref=ref)
    torch.testing.assert_close(got.out, kernel_only.out + merge.out * (1 + u_out), rtol=0, atol=0)
    torch.testing.assert_close(got.lse, kernel_only.lse + merge.lse, rtol=0, atol=0)


def test_each_tier2_check_takes_its_own_bound():
    """Mutant C13 (tier2.det.out judged against B_post): each of the four tier-2 checks compares the fp64 oracle
    on fp8 inputs with the one on exact inputs within its own bound of `quantization_bounds` (det: B_det, post:
    B_post), so each reports that bound's err/bound; the two bounds differ on this case, so a swap shows."""
    from mla_ref.decode import mla_decode_ref
    from verify import bounds
    from verify.checks import check_tier2
    from verify.metrics import compare

    batch, exact = Case(seq_lens=(70, 5), q_lens=(2, 1), heads=4, kv_dtype="fp8", q_dtype="fp8",
                        seed=2).materialize("cpu")
    ref_q, ref_x = mla_decode_ref(batch), mla_decode_ref(exact)
    qb = bounds.quantization_bounds(batch, exact, ref_exact=ref_x)
    got = {r.name: r.err_over_bound for r in check_tier2(batch, exact, ref_q)}
    want = {f"tier2.{kind}.{what}": compare(ref_q[i], ref_x[i], getattr(qb, f"{kind}_{what}"), name="",
                                            out_dtype=torch.float32).err_over_bound_max
            for kind in ("det", "post") for i, what in enumerate(("out", "lse"))}
    assert want["tier2.det.out"] != want["tier2.post.out"] and want["tier2.det.lse"] != want["tier2.post.lse"]
    assert got == want


def test_a_one_worker_case_is_split_checked_against_alt_workers():
    """Mutant C14 (check_split's other count 1 whatever the case's): after a 1-worker run the split check reruns
    the kernel with ALT_WORKERS, not with 1 again (which compares the run with itself). The emulated backend with
    σ 1 % off whenever it runs with more than one worker fails it, and the detail names both counts."""
    import dataclasses

    from mla_ref.decode import mla_decode_ref
    from verify.checks import ALT_WORKERS, _tier1_bound, check_split
    from verify.kernels import from_backend

    emulated = from_backend("emulated")
    batch, _ = Case(seq_lens=(300, 5, 129), q_lens=(1, 2, 1), heads=8, num_workers=1, seed=4).materialize("cpu")

    def drifting(b, workers):
        return emulated.run_workers(b.replace(sm_scale=b.sm_scale * (1.01 if workers != 1 else 1.0)), workers)

    kernel = dataclasses.replace(emulated, run_workers=drifting)
    first = emulated.run_workers(batch, 1)
    ref = mla_decode_ref(batch)  # [T, H, L], [T, H] fp64
    bound = _tier1_bound(batch, emulated, emulated.numerics(batch), ref)
    results = {r.name: r for r in check_split(batch, kernel, emulated.numerics(batch), first, 1, ref, bound)}
    assert not results["split.out"].ok and f"1 workers vs {ALT_WORKERS}" in results["split.out"].detail, results


def _empty_case_outputs():
    """A batch with an empty request (rows 0-1 see no token) and the correct kernel's (out, lse) on it."""
    from verify.mutants import correct

    batch = Case(seq_lens=(0, 9), q_lens=(2, 1), heads=2, seed=3).materialize("cpu")[0]
    out, lse = correct(batch)
    assert bool((batch.visible_tokens() == 0).any()) and bool((batch.visible_tokens() > 0).any())
    return batch, out.clone(), lse.clone()


def test_an_empty_row_with_one_nonzero_element_fails_empty():
    """Mutant C16 (check_empty flagging an empty row only when all its elements are nonzero): out of a row that
    sees no token is exactly 0 everywhere; one stray element (garbage left in an unwritten tile) fails it."""
    from verify.checks import check_empty

    batch, out, lse = _empty_case_outputs()
    assert check_empty(batch, out, lse).ok
    out[0, 1, 5] = 0.5
    r = check_empty(batch, out, lse)
    assert not r.ok and "out != 0 on 1" in r.detail, r.detail


@pytest.mark.parametrize("value", [0.0, float("nan"), float("inf")])
def test_an_empty_row_whose_lse_is_not_minus_inf_fails_empty(value):
    """Mutant C17 (check_empty failing on out alone): a row that sees no token has lse exactly -inf (a merge
    weighs it by exp(lse)); out 0 with lse 0, NaN or +inf fails."""
    from verify.checks import check_empty

    batch, out, lse = _empty_case_outputs()
    lse[1, 0] = value
    r = check_empty(batch, out, lse)
    assert not r.ok and "lse != -inf on 1" in r.detail, r.detail


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_lse_on_a_row_that_sees_tokens_fails_finite(value):
    """Mutant C18 (check_finite counting out alone): a row that sees tokens has a finite lse too."""
    from verify.checks import check_finite

    batch, out, lse = _empty_case_outputs()
    assert check_finite(batch, out, lse).ok
    lse[2, 1] = value  # row 2: the request of 9 tokens
    r = check_finite(batch, out, lse)
    assert not r.ok and "0 in out, 1 in lse" in r.detail, r.detail


def _lse_nan_to_zero(batch):
    """mutants.correct with every NaN of lse replaced by 0 (out keeps its NaN): a kernel whose lse path drops NaN."""
    from verify.mutants import correct

    out, lse = correct(batch)
    return out, torch.where(torch.isnan(lse), 0.0, lse)


def _lse_nan_everywhere_once_poisoned(batch):
    """mutants.correct, except that when any lse is NaN every lse is (out stays right): NaN spread by the lse only."""
    from verify.mutants import correct

    out, lse = correct(batch)
    return out, torch.full_like(lse, float("nan")) if bool(torch.isnan(lse).any()) else lse


@pytest.mark.parametrize("kernel, says", [(_lse_nan_to_zero, "lse not NaN on"),
                                          (_lse_nan_everywhere_once_poisoned, "lse NaN on")])
def test_the_nan_check_judges_the_lse_mask_too(kernel, says):
    """Mutants C20 and C21 (_nan_run judging a NaN missing from, or a NaN spread in, the out mask alone): an lse
    that is finite where the NaN token is read, or NaN where it is not, fails ``nan`` and ``nan.first`` though out
    is right."""
    from verify.checks import check_nan
    from verify.kernels import from_callable

    batch = Case(seq_lens=(40, 9, 70), q_lens=(1, 2, 1), heads=2, seed=1).materialize("cpu")[0]
    results = {r.name: r for r in check_nan(batch, from_callable(kernel), 4)}
    assert set(results) == {"nan", "nan.first"}
    for r in results.values():
        assert not r.ok and says in r.detail and "out not NaN" not in r.detail, r.detail


def test_the_rerun_steps_of_an_fp8_q_run_with_a_doubled_q_scale():
    """Mutant C30 (check_rerun no longer doubling a dynamic fp8 q's scale, while its detail still says so): the
    kernel is called on the roomy copy with the case's q_scale, then on the next step and the step after with
    twice it (a serving loop's dynamic q scale changes every step). Recorded by a kernel that notes each call's
    q_scale and otherwise is mutants.correct."""
    from verify.checks import check_rerun
    from verify.kernels import from_callable
    from verify.mutants import correct

    scales = []

    def recording(batch):
        scales.append(float(batch.q_scale))
        return correct(batch)

    batch = Case(seq_lens=(70, 5), q_lens=(2, 1), heads=8, kv_dtype="fp8", q_dtype="fp8",
                 scale_mode="static").materialize("cpu")[0]
    kernel = from_callable(recording)
    results = check_rerun(batch, kernel, 4, correct(batch), *_judge(batch, kernel))
    named = {r.name: r for r in results}
    assert all(r.ok for r in results) and "q_scale doubled" in named["rerun.out"].detail, results
    q_scale = float(batch.q_scale)
    assert scales == [q_scale, 2 * q_scale, 2 * q_scale]


@pytest.mark.parametrize("name", ["q", "kv_cache", "block_table", "seq_lens", "q_lens"])
def test_the_inputs_check_covers_every_batch_input(name):
    """Mutant C41 (q_lens left out of the snapshot): a kernel that writes into any tensor of the batch it reads,
    q_lens included (which the next step's plan reads), fails ``inputs`` naming it."""
    from verify.checks import check_inputs, input_snapshot

    batch = Case(seq_lens=(5, 70), q_lens=(2, 1), heads=2, seed=2).materialize("cpu")[0]
    before = input_snapshot(batch)
    assert check_inputs(batch, before).ok
    t = getattr(batch, name)
    t.view(-1)[0] = t.view(-1)[0] + 1 if not t.is_floating_point() else -t.view(-1)[0] - 1
    r = check_inputs(batch, before)
    assert not r.ok and r.detail.startswith(f"the kernel wrote into its inputs: {name} ("), r.detail


def test_an_fp8_case_runs_the_tier2_checks_and_a_bf16_case_does_not():
    """Mutant C46 (run_case without check_tier2): every fp8 case carries the four tier-2 checks (the oracle's
    quantization error within B_det and B_post), each with an err/bound in (0, 1]; a bf16 case has none."""
    from verify.checks import run_case
    from verify.kernels import from_callable
    from verify.mutants import correct

    tier2 = {"tier2.det.out", "tier2.post.out", "tier2.det.lse", "tier2.post.lse"}
    fp8 = run_case(Case(seq_lens=(70, 5), q_lens=(2, 1), heads=2, kv_dtype="fp8", seed=2), from_callable(correct))
    got = {c.name: c for c in fp8.checks if c.name.startswith("tier2.")}
    assert fp8.ok and set(got) == tier2, fp8.describe()
    assert all(0 < c.err_over_bound <= 1 for c in got.values()), got
    bf16 = run_case(Case(seq_lens=(70, 5), q_lens=(2, 1), heads=2, seed=2), from_callable(correct))
    assert bf16.ok and not any(c.name.startswith("tier2.") for c in bf16.checks)


def test_an_output_one_format_coarser_than_declared_fails_the_contract():
    """Mutant C43 (the contract's dtype test loosened to twice the declared unit roundoff): e5m2 (u = 2^-3) is
    coarser than a declared e4m3fn output (u = 2^-4), though only by 2x: the contract fails, naming both."""
    import dataclasses

    from verify.checks import run_case
    from verify.kernels import DEFAULT_NUMERICS, from_callable
    from verify.mutants import correct

    def decode(batch):
        out, lse = correct(batch)
        return out.to(torch.float8_e5m2), lse

    decode.numerics = dataclasses.replace(DEFAULT_NUMERICS, out_dtype=torch.float8_e4m3fn)
    [check] = run_case(Case(seq_lens=(0, 63), q_lens=(1, 2), heads=2, seed=2), from_callable(decode), "cpu").failed
    assert check.name == "contract"
    assert "torch.float8_e5m2 is coarser than the declared out_dtype torch.float8_e4m3fn" in check.detail


def test_the_far_checks_count_of_pages_past_the_threshold_counts_used_pages_only(monkeypatch):
    """Mutant C52 (the far check's "N of M used pages past ..." counting `used & past_element | past_id`): N counts
    the used block-table entries past both thresholds, so N <= M, and here (pages of 256 DeepSeek tokens: past
    element 2^31 only, page_ids 0) every used page but the first `below` ones. Small caches: far_pages with a small
    ``beyond`` and FAR_ELEMENTS to match (as test_far_pages does), so the count is the only thing changed."""
    import re

    from verify import checks
    from verify.checks import far_pages
    from verify.kernels import from_callable
    from verify.mutants import correct

    beyond = 2**20
    monkeypatch.setattr(checks, "far_pages", lambda batch, page_ids: far_pages(batch, beyond=beyond, page_ids=page_ids))
    monkeypatch.setattr(checks, "FAR_ELEMENTS", beyond)
    batch = Case(seq_lens=(700, 5, 0), q_lens=(1, 2, 1), heads=2, page_size=256, seed=1).materialize("cpu")[0]
    assert checks.FAR_PAGE_IDS * batch.kv_cache[0].numel() > checks.FAR_PAGE_ID_ELEMENTS  # page_ids 0 here
    kernel = from_callable(correct)
    (r,) = checks.check_far(batch, kernel, 4, correct(batch), *_judge(batch, kernel))
    past, used = map(int, re.match(r"(\d+) of (\d+) used pages past element 2\^31", r.detail).groups())
    n_used = int(batch.used_entries.sum())  # 3 + 1 pages
    assert r.ok and used == n_used and past == n_used - 2, r.detail  # far_pages' below=2 pages stay in front


class _ClearsOnlyNewlyEmptyRowsStep:
    """A step (mutants' `_Step`) whose run() returns persistent out / lse buffers and writes a row that sees no token
    (0, -inf) only when it saw one at its previous run: it takes its buffers to hold what it wrote last (a graph's
    outputs a serving loop may reuse, or clear, between steps)."""

    def __init__(self, batch, max_q_len):
        from verify.mutants import _Step

        self.inner, self.batch, self.seen = _Step(batch, max_q_len), batch, None
        self.out = torch.empty(batch.num_tokens, batch.num_heads, batch.kv_lora_rank, dtype=torch.bfloat16)
        self.lse = torch.empty(batch.num_tokens, batch.num_heads)

    def plan(self, batch):
        self.inner.plan(batch)

    def run(self):
        out, lse = self.inner.run()
        seen = self.batch.visible_tokens() > 0  # [T]
        write = seen | (~seen if self.seen is None else self.seen)  # seen now, or seen at the previous run
        self.out[write], self.lse[write] = out[write], lse[write]
        self.seen = seen
        return self.out, self.lse


def test_a_step_that_relies_on_its_last_outputs_fails_on_poisoned_outputs():
    """Mutant C39 (`_poisoned` no longer filling the returned outputs with NaN): a step whose run() leaves rows that
    stayed empty as its buffers held them passes while they hold its last run's 0 / -inf; the step check poisons
    the returned buffers after each judged run, so a row empty at two runs in a row reads NaN and the later run
    fails. Two empty requests of one row each: after the next step's rotation a row stays empty."""
    from verify.checks import check_step
    from verify.kernels import from_callable
    from verify.mutants import correct

    def decode(batch):
        return correct(batch)

    decode.step = _ClearsOnlyNewlyEmptyRowsStep
    batch = Case(seq_lens=(0, 0, 40, 70, 9), q_lens=(1, 1, 1, 2, 1), heads=2, seed=4).materialize("cpu")[0]
    kernel = from_callable(decode)
    results = {r.name: r for r in check_step(batch, kernel, correct(batch), *_judge(batch, kernel))}
    assert results["step.out"].ok and {"step.replan.out", "step.decode.out"} <= set(results), results
    failed = [r for r in results.values() if not r.ok]
    assert failed and all(r.name.startswith(("step.replan", "step.decode")) for r in failed), results
    assert any("NaN" in r.detail for r in failed), [r.detail for r in failed]
