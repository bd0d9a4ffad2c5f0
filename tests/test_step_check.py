"""The step check: a kernel's graph-capturable step driven as a serving loop drives it (verify.checks.check_step).

Build on copies of the batch's tensors with room to grow, plan, run; on CUDA capture run() in a graph and replay
it; then write the next step's layout into the same tensors (verify.next_step.next_layout: requests rotated, one
grown past twice the old longest, the longest halved, one emptied, what only the old step read set to NaN), plan again,
write its new q and tokens (next_values), replay, against the oracle on the new contents; then one plain decode
step (decode_layout: each request grown by its q_len; decode_values: new tokens of weight about 1/2), plan, write,
replay, against the oracle (step.decode). Every other check calls
a kernel afresh on each batch, so a step that keeps the lengths it was first planned with passes all of them. CUDA
graph capture runs in the CUDA tests below and tests/test_peers_gpu.py; here run() is called again where a GPU
would replay it.
"""

import pytest
import torch
from test_checks import _judge

from mla_fast.backends import Unsupported
from mla_ref.decode import mla_decode_ref
from verify import mutants
from verify.checks import check_step, run_case
from verify.kernels import from_callable
from verify.next_step import decode_layout, decode_values, next_layout, next_lengths, next_values, with_room
from verify.strategies import smoke_cases


def with_step(step):
    """A plug-in: mutants.correct, with ``step`` as its graph-capturable step factory."""
    def decode(batch):
        return mutants.correct(batch)

    decode.step = step
    return decode


def _failed(result) -> dict:
    return {c.name: c.detail for c in result.checks if not c.ok}


def _step_failed(case, plug_in) -> dict:
    """{name: detail} of the step checks (`check_step`, judged as run_case judges them) that ``plug_in`` fails on
    ``case``. For plug-ins whose decode is mutants.correct's (`mutants._decode`): their other checks are the correct
    kernel's, which the smoke prefix passes (tests/test_mutants.py::test_correct_kernel_passes), so over the whole
    prefix only the step checks run (run_case's others took three quarters of the time); the first test below drives
    the step check through run_case."""
    batch, _ = case.materialize("cpu")
    kernel = from_callable(plug_in)
    results = check_step(batch, kernel, plug_in(batch), *_judge(batch, kernel))
    return {r.name: r.detail for r in results if not r.ok}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_correct_step_passes_and_a_step_that_plans_once_fails_the_replan_and_the_decode_step(dtype):
    case = smoke_cases(dtype)[0]
    right = run_case(case, from_callable(mutants.correct), "cpu")
    names = {c.name: c.detail for c in right.checks}
    # the step decodes unsplit (`mutants._dense_decode`), the plain run in splits: other bits, within the bound
    steps = {"step.out", "step.lse", "step.replan.out", "step.replan.lse", "step.decode.out", "step.decode.lse"}
    assert right.ok and steps <= set(names), right.describe()
    assert "differ from the case's run" in names["step.out"] and "run again" in names["step.replan.out"]
    failed = _failed(run_case(case, from_callable(mutants.stale_plan), "cpu"))
    assert set(failed) == {"step.replan.out", "step.replan.lse", "step.decode.out", "step.decode.lse"}, failed
    assert "seq_lens [0, 1, 63, 65, 300, 2] -> [0, 0, 1, 63, 665, 150] (request 4 grown" in failed["step.replan.out"]
    assert "seq_lens [0, 0, 1, 63, 665, 150] -> [0, 0, 2, 65, 666, 153]" in failed["step.decode.out"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_plan_that_keeps_its_pieces_for_one_decode_step_fails_the_decode_step_alone(dtype):
    """Found by a review: a plan() fast path for the same requests a few tokens longer (its pieces kept) passed the
    step check, whose one next step rotated the requests. The decode step grows each by its q_len, with new tokens
    of weight about 1/2 in their rows: every smoke case fails it, and no other step check (the shifted case too)."""
    failed = [_step_failed(case, mutants.fast_path_plan) for case in smoke_cases(dtype)]
    assert all(set(f) == {"step.decode.out", "step.decode.lse"} for f in failed), failed


def test_a_one_element_output_with_any_stride_is_compared_not_a_verifier_error():
    """The correct step returns lse as a view of its fp32 workspace's last channel (stride L + 1): on a case of one
    row and one head that is a single element whose stride `contiguous()` keeps, and the byte comparison of its
    eager run with the case's raised inside the verifier (a `verifier` check) until `_bytes` gave it stride 1."""
    from verify.cases import Case

    result = run_case(Case(seq_lens=(0,), q_lens=(1,), heads=1), from_callable(mutants.correct), "cpu")
    names = {c.name: c.detail for c in result.checks}
    assert result.ok and "verifier" not in names and "step" in names, result.describe()


def test_next_lengths_rotate_grow_one_past_twice_the_longest_halve_it_and_empty_the_one_after_it():
    def nxt(lens, page_size=16):
        new, grown = next_lengths(torch.tensor(lens, dtype=torch.int32), page_size)
        return new.tolist(), grown

    assert nxt([5, 9, 0, 2]) == ([2, 35, 4, 0], 1)  # rotated [2, 5, 9, 0]: 9 halved, 5 grown to 2 x 9 + 17, 0 emptied
    assert nxt([7, 3]) == ([31, 3], 0)  # rotated [3, 7]: 7 halved, 3 grown to 2 x 7 + 17; none emptied
    assert nxt([1], page_size=1) == ([4], 0)  # one request: grown only, to 2 x 1 + 2
    assert nxt([0, 0, 0]) == ([0, 0, 17], 2)  # all empty: the one before the first grows
    assert nxt([]) == ([], -1)


def _slot_set(batch) -> set[tuple[int, int]]:
    """The (page, slot) pairs holding some request's tokens, from DecodeBatch.token_slots."""
    return {(int(p), int(s)) for b in range(batch.batch_size) for p, s in zip(*batch.token_slots(b))}


def _case_batch(dtype: str, index: int):
    return smoke_cases(dtype)[index].materialize("cpu")[0]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("index", range(4))
def test_the_next_step_is_a_valid_batch_whose_oracle_reads_no_nan(dtype, index):
    """with_room copies (the case's tensors untouched) and leaves the attention as it was; next_layout writes the
    lengths, q_lens and block table in place (the same tensors), the grown request's new slots still NaN until
    next_values writes them after the plan; the oracle on the result is finite (the NaN went only where no new
    token reads), q is negated, and every slot the old step read and the new one does not holds NaN."""
    batch = _case_batch(dtype, index)
    before = {n: getattr(batch, n).clone() for n in ("q", "kv_cache", "block_table", "seq_lens", "q_lens")}
    static, first_spare = with_room(batch)
    assert all(torch.equal(mla_decode_ref(static)[i], mla_decode_ref(batch)[i]) for i in range(2))
    tensors = {n: getattr(static, n) for n in before}
    q0 = static.q.float().clone()
    old = _slot_set(static)  # the slots the old step reads
    where, new_slots = next_layout(static, first_spare)
    lens, grown = next_lengths(before["seq_lens"], static.page_size)
    assert torch.equal(static.seq_lens, lens) and static.validate() is static
    old_len = int(before["seq_lens"].roll(1)[grown])  # the grown request's length before: its row came with it
    pages, slots = static.token_slots(grown)  # [new length] each
    assert set(map(tuple, torch.nonzero(new_slots).tolist())) == {
        (int(p), int(s)) for p, s in zip(pages[old_len:], slots[old_len:])}  # exactly its new positions
    assert torch.isnan(static.kv_cache[new_slots].float()).all()  # nothing written before the plan
    stale = old - _slot_set(static)  # read by the old step only
    assert all(torch.isnan(static.kv_cache[p, s].float()).all() for p, s in stale) and f"{len(stale)} slots" in where
    where += ", then " + next_values(static, new_slots) + " after plan()"
    assert all(getattr(static, n) is t for n, t in tensors.items())
    assert torch.equal(static.q.float(), torch.where(q0 == 0, q0, -q0)) and "q negated" in where
    assert not torch.isnan(static.kv_cache[new_slots].float()).any()
    out, lse = mla_decode_ref(static)  # [T, H, L], [T, H]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), where
    assert all(torch.equal(getattr(batch, n), t) for n, t in before.items() if n != "kv_cache")
    assert torch.equal(batch.kv_cache.view(torch.uint8), before["kv_cache"].view(torch.uint8))


class CapsItsGrid(mutants._Step):
    """Live lengths, but never past the longest of the first plan: a grid or loop bound sized at capture."""

    def plan(self, batch):
        super().plan(batch)
        if not hasattr(self, "cap"):
            self.cap = int(batch.seq_lens.max()) if batch.batch_size else 0

    def run(self):
        return mutants._dense_decode(self.batch, self.seq_lens.clamp(max=self.cap), self.q_lens)


class RoundsItsGridUp(CapsItsGrid):
    """A grid or loop bound rounded up from the captured longest request to a power of two (found by a review: a
    request grown past the old longest by only a page and a token stayed under it in most cases)."""

    def plan(self, batch):
        first = not hasattr(self, "cap")
        super().plan(batch)
        if first:
            self.cap = 1 << max(self.cap - 1, 0).bit_length()  # the next power of two >= the longest (1 for 0 or 1)


class CopiesQWhenPlanning(mutants._Step):
    """Copies q into its own buffer in plan(), not in run(): in a serving loop q is written after the plan."""

    def plan(self, batch):
        super().plan(batch)
        self.q = batch.q.clone()

    def run(self):
        return mutants._dense_decode(self.batch.replace(q=self.q), self.seq_lens, self.q_lens)


@pytest.mark.parametrize("plug_in", [with_step(CapsItsGrid), with_step(RoundsItsGridUp),
                                     with_step(CopiesQWhenPlanning)],
                         ids=["caps_its_grid", "rounds_its_grid_up", "copies_q_when_planning"])
def test_a_step_sized_at_capture_or_reading_q_when_it_plans_fails_the_replan(plug_in):
    """Found by reviews: a next step that only shrank and reordered the requests, its q written before the plan,
    passed the first and the last (0 of 6 smoke cases failed); one that grew a request by only a page and a token
    past the longest passed a grid rounded up to a power of two in 16 of 24. Now every smoke case fails them on the
    replan, and a capped grid the decode step after it too (only the steps past the first plan). (Not the shifted
    smoke case: there the tokens a capped grid misses score -120 against a newest token's +120, a weight of e^-240,
    nothing in fp32: a capped grid gives the right answer.)"""
    cases = [c for c in smoke_cases("bf16") + smoke_cases("fp8") if c.dist != "shifted"]
    failed = [_step_failed(case, plug_in) for case in cases]
    later = {"step.replan.out", "step.replan.lse", "step.decode.out", "step.decode.lse"}
    assert all(set(f) <= later for f in failed), failed
    assert sum("step.replan.out" in f for f in failed) == len(cases), failed


class ClampsLengthsWhenPlanning(CapsItsGrid):
    """Its grid sized at capture, and plan() clamps the engine's lengths to it: the oracle, reading the lengths
    after the plan, would follow (found by a review: only run()'s writes were checked)."""

    def plan(self, batch):
        super().plan(batch)
        batch.seq_lens.clamp_(max=self.cap)


class ZeroesASparePageWhenPlanning(mutants._Step):
    def plan(self, batch):
        super().plan(batch)
        batch.kv_cache[-1].zero_()  # a spare page: NaN, read by no request yet


def test_a_plan_that_writes_into_the_steps_inputs_fails_by_name():
    """plan()'s writes are checked as run()'s are: at the first plan (`step`) and at the replan (`step.replan`),
    where a plan that rewrites the lengths would otherwise move the oracle's inputs with it."""
    for case in smoke_cases("bf16"):
        failed = _step_failed(case, with_step(ClampsLengthsWhenPlanning))
        assert set(failed) == {"step.replan"}, (case, failed)
        assert "plan() wrote into its inputs: seq_lens" in failed["step.replan"], failed
    failed = _failed(run_case(smoke_cases("bf16")[0], from_callable(with_step(ZeroesASparePageWhenPlanning)), "cpu"))
    assert failed == {"step": "the step's first plan: plan() wrote into its inputs: kv_cache (73728 bytes)"}, failed
    # 73728 bytes: the page of 64 slots x 576 channels x 2 bytes


class _RefusingStep:
    def __init__(self, batch, max_q_len):
        raise Unsupported("no step for a cache this small")


refuses_steps = with_step(_RefusingStep)  # a module attribute: tests.test_step_check:refuses_steps, below


class _FailingPlan(mutants._Step):
    def plan(self, batch):
        raise RuntimeError("plan exploded")


class _SecondPlanRaises(mutants._Step):
    def plan(self, batch):
        if self.planned:
            raise RuntimeError("workspace too small for the next step")
        super().plan(batch)


class _ThirdPlanRefusesOrRaises(mutants._Step):
    """Its third plan (the decode step) refuses the batch (``refuse``) or raises."""

    refuse = False

    def plan(self, batch):
        self.plans = getattr(self, "plans", 0) + 1
        if self.plans == 3:
            raise Unsupported("no room for one more step") if self.refuse else RuntimeError("decode step exploded")
        super().plan(batch)


class _ThirdPlanRefuses(_ThirdPlanRefusesOrRaises):
    refuse = True


def test_a_refused_step_passes_as_refused_and_a_raising_plan_fails_by_name():
    case = smoke_cases("bf16")[0]
    refused = run_case(case, from_callable(refuses_steps), "cpu")
    checks = {c.name: c for c in refused.checks}
    assert refused.ok and "refused: Unsupported: no step for a cache this small" in checks["step.refused"].detail
    assert _failed(run_case(case, from_callable(with_step(_FailingPlan)), "cpu")) == {
        "step": "building or planning the step raised RuntimeError: plan exploded "
                f"(at {__file__}:{_FailingPlan.plan.__code__.co_firstlineno + 1})"}
    failed = _failed(run_case(case, from_callable(with_step(_SecondPlanRaises)), "cpu"))
    assert set(failed) == {"step.replan"} and "planning it raised RuntimeError: workspace too small" in failed[
        "step.replan"]
    failed = _failed(run_case(case, from_callable(with_step(_ThirdPlanRefusesOrRaises)), "cpu"))
    assert set(failed) == {"step.decode"} and "planning it raised RuntimeError: decode step exploded" in failed[
        "step.decode"] and failed["step.decode"].startswith("the step after: the same requests one decode step")
    refused = {c.name: c for c in run_case(case, from_callable(with_step(_ThirdPlanRefuses)), "cpu").checks}
    assert refused["step.refused"].ok and "refused: Unsupported: no room for one more step" in refused[
        "step.refused"].detail and refused["step.replan.out"].ok


def test_a_step_that_is_not_callable_is_refused_by_name():
    def decode(batch):
        return mutants.correct(batch)

    decode.step = "TritonMLADecode"
    with pytest.raises(ValueError, match=r"\.step must be a callable \(batch, max_q_len\) -> step"):
        from_callable(decode)


def test_a_step_whose_declared_numerics_are_tighter_than_its_rounding_fails():
    """A step that fixes its kernel when built declares how that kernel rounds (`step.numerics`); its runs are
    bounded by that declaration, not by the plug-in's numerics(batch): a step declaring fp64 output while it
    returns bf16 fails, where the plug-in's own declaration (bf16 out) passes it (the correct step, above)."""
    import dataclasses

    from verify.kernels import DEFAULT_NUMERICS

    class _DeclaresFp64(mutants._Step):
        numerics = dataclasses.replace(DEFAULT_NUMERICS, out_dtype=torch.float64, gamma_qk=0.0, gamma_pv=0.0,
                                       gamma_pv_per_token=0.0)

    failed = _failed(run_case(smoke_cases("bf16")[0], from_callable(with_step(_DeclaresFp64)), "cpu"))
    # bf16 out under an fp64 declaration: the step's eager run (step.out), its replan and decode step fail, nothing
    # else
    assert set(failed) == {"step.out", "step.replan.out", "step.decode.out"}, failed


needs_cuda = pytest.mark.gpu  # CUDA graph capture: conftest.py skips these without a CUDA GPU (ROCm's HIP too)


class _SyncingStep(mutants._Step):
    def run(self):
        return mutants._decode(self.batch)  # reads the lengths on the host: a sync, which a capture refuses


@needs_cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_on_cuda_the_step_is_captured_and_replayed(dtype):
    """The correct step's graph replays its eager run's bits and replays the refilled steps right; the step that
    plans once fails the replays after the refills, the one that keeps its plan for one decode step the last alone;
    a run() that reads the device on the host cannot be captured."""
    case = smoke_cases(dtype)[0]
    right = run_case(case, from_callable(mutants.correct), "cuda", far=False)
    names = {c.name: c.detail for c in right.checks}
    assert right.ok and names["step.graph"].endswith("the bits of the step's eager run"), right.describe()
    assert "replayed" in names["step.replan.out"] and "replayed" in names["step.decode.out"]
    failed = _failed(run_case(case, from_callable(mutants.stale_plan), "cuda", far=False))
    assert set(failed) == {"step.replan.out", "step.replan.lse", "step.decode.out", "step.decode.lse"}, failed
    failed = _failed(run_case(case, from_callable(mutants.fast_path_plan), "cuda", far=False))
    assert set(failed) == {"step.decode.out", "step.decode.lse"}, failed
    failed = _failed(run_case(case, from_callable(with_step(_SyncingStep)), "cuda", far=False))
    assert set(failed) == {"step.graph"} and "could not be captured in a CUDA graph" in failed["step.graph"], failed


@needs_cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_on_cuda_a_step_that_replaces_its_workspace_fails_step_freed(dtype):
    """The step that allocates a new workspace at each plan: its replays are right (the graph writes and reads the
    freed block), and only step.freed fails it, naming the free blocks the replay changed; the correct step, whose
    workspace stays, passes step.freed."""
    case = smoke_cases(dtype)[0]
    right = {c.name: c for c in run_case(case, from_callable(mutants.correct), "cuda", far=False).checks}
    assert right["step.freed"].ok and right["step.freed"].detail.endswith("as they were"), right["step.freed"]
    failed = _failed(run_case(case, from_callable(mutants.realloc_workspace), "cuda", far=False))
    assert set(failed) == {"step.freed"}, failed
    assert "wrote into memory the caching allocator held free after plan(): 1 of the" in failed["step.freed"]


@needs_cuda
def test_on_cuda_free_blocks_show_a_replay_that_writes_a_freed_tensor():
    """A graph that writes tensor x, replayed after x was dropped: the held free blocks show the write; the same
    graph while x lives leaves them as they were."""
    from verify.freed_memory import FreeBlocks

    x = torch.zeros(3 << 20, device="cuda")  # 12 MB: a block of its own in the large pool
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        graph.capture_begin()
        x.fill_(2.0)
        graph.capture_end()
    held = FreeBlocks.take("cuda")
    graph.replay()
    assert held.written() is None
    del held, x  # x's block is free now, and the graph still writes it
    held = FreeBlocks.take("cuda")
    assert held.nbytes >= 12 << 20 and held.left == 0, (held.nbytes, held.left)  # every free block taken
    graph.replay()
    written = held.written()
    assert written is not None and written.startswith("1 of the"), written


@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "seesaw", "gluon_fp8"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_our_steps_pass_the_step_check_on_cuda(backend, dtype):
    """Our graph-capturable step (TritonMLADecode, each kernel pinned in turn) on the smoke cases: captured,
    replayed with its eager bits, refilled and replayed right, twice (the replan, the decode step); where a pinned
    kernel takes no such batch the step refuses it (step.refused) as the backend's run does (the case is then
    unsupported)."""
    from verify.kernels import from_backend

    kernel = from_backend(backend)
    ran = 0
    for case in smoke_cases(dtype):
        result = run_case(case, kernel, "cuda", far=False)
        if result.unsupported:
            continue
        names = {c.name for c in result.checks}  # step, or step.out / .lse where the step's bits differ (bound)
        later = {"step.graph", "step.replan.out", "step.decode.out"}
        assert result.ok and later <= names and names & {"step", "step.out"}, result.describe()
        ran += 1
    if not ran and backend != "triton":  # the Gluon kernels take sm_90 batches only; the Triton kernel takes all
        pytest.skip(f"{backend} took none of the {dtype} smoke cases on this GPU")
    assert ran


def test_a_campaign_warns_when_the_step_was_refused(tmp_path, capsys):
    """step.refused passes, but the step check did not run there: the report says so, with the step's reason."""
    import json

    from verify.cli import main

    path = tmp_path / "r.json"
    assert main(["--impl", "tests.test_step_check:refuses_steps", "--cases", "2", "--jobs", "1", "--json",
                 str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["checks"]["step.refused"]["cases"] == 2 and "step.replan.out" not in report["checks"]
    (warning,) = [w for w in report["warnings"] if w.startswith("step.refused")]
    assert "refused 2 cases" in warning and "no step for a cache this small" in warning


def test_a_steps_numerics_may_be_a_callable_and_anything_else_fails_by_name():
    from verify.kernels import DEFAULT_NUMERICS

    class _Callable(mutants._Step):
        def numerics(self, batch):
            return DEFAULT_NUMERICS  # the plug-in default: passes as `correct` does

    class _Wrong(mutants._Step):
        numerics = "fp32"

    class _WrongArity(mutants._Step):
        def numerics(self):  # found by a review: its TypeError stopped the campaign
            return DEFAULT_NUMERICS

    case = smoke_cases("bf16")[0]
    assert run_case(case, from_callable(with_step(_Callable)), "cpu").ok
    failed = _failed(run_case(case, from_callable(with_step(_Wrong)), "cpu"))
    assert set(failed) == {"step"} and "step.numerics: expected a KernelNumerics or a callable" in failed["step"]
    failed = _failed(run_case(case, from_callable(with_step(_WrongArity)), "cpu"))
    assert set(failed) == {"step"} and "the step's numerics raised TypeError" in failed["step"]


class _ReturnsAViewOfQ(mutants._Step):
    def run(self):
        out, lse = super().run()
        return self.batch.q[..., : out.shape[-1]], lse  # a view of its input: poisoning it would poison q


class _WritesItsCache(mutants._Step):
    def run(self):
        result = super().run()
        self.batch.kv_cache.view(torch.uint8)[0].fill_(0)  # after a right result: the next step reads 0s
        return result


@pytest.mark.parametrize("plug_in,words", [(with_step(_ReturnsAViewOfQ), "run() returned a view of its batch's q"),
                                           (with_step(_WritesItsCache), "kv_cache")], ids=["view_of_q", "writes_cache"])
def test_a_step_that_returns_or_writes_its_inputs_fails_by_name(plug_in, words):
    failed = _failed(run_case(smoke_cases("bf16")[0], from_callable(plug_in), "cpu"))
    assert set(failed) == {"step"} and words in failed["step"], failed


_UNIT_ROUNDOFF = {torch.bfloat16: 2**-8, torch.float8_e4m3fn: 2**-4, torch.float8_e4m3fnuz: 2**-4}  # half an ulp, rel.
# half the least subnormal, absolute: bf16's is 2^-133, e4m3fn's 2^-9, e4m3fnuz's 2^-10
_HALF_SUBNORMAL = {torch.bfloat16: 2**-134, torch.float8_e4m3fn: 2**-10, torch.float8_e4m3fnuz: 2**-11}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("index", range(4))
def test_the_decode_step_grows_each_request_by_its_q_len_with_new_tokens_that_weigh_one_half(dtype, index):
    """decode_layout grows each non-empty request of the step after next_layout by its q_len, in place: old tokens
    keep their slots, new ones go into the request's partly used last page or spare pages no request used, NaN
    until decode_values writes them after the plan. Each new token 0 then scores its row 0's log-sum-exp over the
    old tokens on every head (weight 1/2 beside them), up to rounding k to the cache's format: |Δs| <= σ Σ_d |q_d|
    |k_d| u / (1 - u) + σ Σ_d |q_d| (half the smallest subnormal) kv_scale, u half an ulp (relative)."""
    batch = _case_batch(dtype, index)
    static, first_spare = with_room(batch)
    next_values(static, next_layout(static, first_spare)[1])
    before = static.seq_lens.clone()
    old_slots, old_table, old_kv = _slot_set(static), static.block_table.clone(), static.kv_cache.clone()
    where, old = decode_layout(static, first_spare)
    grows = before > 0
    assert torch.equal(old, before) and static.validate() is static and "each non-empty one grown" in where
    assert torch.equal(static.seq_lens, torch.where(grows, before + static.q_lens, before))
    for b in range(static.batch_size):
        kept = int(static.pages_per_request[b]) if not grows[b] else -(-int(before[b]) // static.page_size)
        assert torch.equal(static.block_table[b, :kept], old_table[b, :kept])  # old tokens where they were
        assert (static.block_table[b, kept:int(static.pages_per_request[b])] >= first_spare).all()
    new = _slot_set(static) - old_slots
    assert len(new) == int((static.seq_lens - before).sum()) and not new & old_slots
    assert all(torch.isnan(static.kv_cache[p, s].float()).all() for p, s in new)  # nothing before the plan
    assert all(int(p) >= first_spare or any(int(p) == int(q) for q, _ in old_slots) for p, _ in new)
    assert "new tokens written" in decode_values(static, old)
    changed = {(int(p), int(s)) for p, s in torch.nonzero((static.kv_cache.view(torch.uint8) !=
                                                           old_kv.view(torch.uint8)).any(-1)).tolist()}
    assert changed == new and not any(torch.isnan(static.kv_cache[p, s].float()).any() for p, s in new)
    q = static.dequantized_q()  # [T, H, D] fp64
    kv_dtype, scale = static.kv_cache.dtype, static.kv_scale if static.kv_cache.dtype != torch.bfloat16 else 1.0
    u, tiny = _UNIT_ROUNDOFF[kv_dtype], _HALF_SUBNORMAL[kv_dtype] * scale
    first_rows = static.qo_indptr.long()[:-1]  # [B] row 0 of each request
    checked = 0
    for b in torch.nonzero(grows).flatten().tolist():
        K = static.request_kv(b)  # [s_b, D] fp64 dequantized
        k, old_k = K[int(before[b])], K[: int(before[b])]  # [D] new token 0, [old, D]
        code = static.kv_cache[tuple(static.token_slots(b)[i][int(before[b])] for i in range(2))]
        if kv_dtype != torch.bfloat16 and code.float().abs().max() >= torch.finfo(kv_dtype).max:
            continue  # saturated: its score may fall short of the target
        row = q[first_rows[b]]  # [H, D]
        lse_old = torch.logsumexp(static.sm_scale * row @ old_k.T, dim=-1)  # [H]
        s = static.sm_scale * row @ k  # [H]
        slack = static.sm_scale * (row.abs() @ (k.abs() * u / (1 - u) + tiny))  # [H]
        assert ((s - lse_old).abs() <= slack).all(), (b, (s - lse_old).tolist(), slack.tolist())
        checked += 1
    assert checked >= 1
