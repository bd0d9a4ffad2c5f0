"""Mutation testing of the verifier: every planted bug of verify.mutants, plugged in through --impl, makes the default
campaign exit 1; the same kernel without the bug exits 0.

The default campaign starts with the fixed smoke prefix (verify.strategies.smoke_cases), so running just that prefix
(--cases = its length) under the ci profile is deterministic and exposes each bug by itself; -x stops at the first
failed case.
"""

import pytest

from verify.cli import main
from verify.mutants import CUDA_ONLY, FAR_ONLY, FP8_ONLY, LONG_ONLY, MUTANTS
from verify.strategies import long_cases, smoke_cases


def _campaign(impl: str, dtype: str, *extra: str) -> int:
    return main(["--impl", f"verify.mutants:{impl}", "--dtype", dtype, "--cases", str(len(smoke_cases(dtype))),
                 "--jobs", "1", *extra])


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_correct_kernel_passes(dtype):
    assert _campaign("correct", dtype) == 0


# a review's bugs of the fifty-ninth session, each shown by one smoke case (the predicate picks it) that no earlier
# case reaches: tested on that case alone (a campaign to it runs most of the prefix, minutes each on a CPU)
ONE_CASE = {
    "head_tiles_floor": ("bf16", lambda c: c.heads == 96),
    "page_div_magic16": ("bf16", lambda c: c.page_size == 528),
    "slot_8bit": ("bf16", lambda c: c.page_size == 528),
    "mtp_row_3bit": ("bf16", lambda c: max(c.q_lens) == 12),
    "unit_kv_fastpath": ("fp8", lambda c: c.scale_mode == "kv_unit"),
    # the sixty-ninth session's review: an index one bit wider than the case that showed its narrower twin
    "active_index_8bit": ("bf16", lambda c: len(c.seq_lens) == 520),
    "packed_rows_10bit": ("bf16", lambda c: c.heads == 128 and max(c.q_lens) == 9),
    "mtp_row_5bit": ("bf16", lambda c: max(c.q_lens) == 40),
    # the seventieth session's review: a large-batch path at serving's heads and q dtype; an empty row, split
    "big_batch_heads16": ("bf16", lambda c: c.heads == 20),
    "big_batch_q_scale": ("fp8", lambda c: c.heads == 20),
    "split_empty_nan": ("bf16", lambda c: max(c.q_lens) == 72),
    # the seventy-first session's review: a request index of 9 bits
    "request_index_9bit": ("bf16", lambda c: len(c.seq_lens) == 520),
}
ONE_CASE_FAILS = {"split_empty_nan": {"tier1.out", "empty"}}  # NaN out where lse is right (-inf); others: tier1's two
# shown by a long case whose full checks take minutes on a CPU: its tier-1 check alone (test_long_tier1_mutant_...):
# name -> (the count that wraps, as a function of a case, and where; the long case; the case's overrides)
LONG_TIER1 = {
    # (row, head) pairs; the 128-head MTP batch, its latent narrowed to 64 channels (9 minutes -> 8 s)
    "out_index_16bit": (lambda c: sum(c.q_lens) * c.heads, 2**16, lambda c: c.heads == 128, dict(kv_lora_rank=64)),
    # pages in a request; the request of 2^16 + 65 tokens on pages of 1 (85 s)
    "block_column_12bit": (lambda c: max(-(-s // c.page_size) for s in c.seq_lens), 2**12,
                           lambda c: c.page_size == 1, {}),
}


# the LONG_ONLY mutants are tested below, each right on the smoke prefix and failing tier1 on its long case alone,
# which says more than a campaign with --long on and -x: that one ran the same prefix and case again (159 s of CI)
@pytest.mark.parametrize("name", [m for m in MUTANTS if m not in CUDA_ONLY and m not in ONE_CASE
                                  and m not in LONG_ONLY])
def test_mutant_is_caught(name):
    dtype = "fp8" if name in FP8_ONLY else "bf16"
    extra = ("--far", "on") if name in FAR_ONLY else ()
    assert _campaign(name, dtype, "-x", *extra) == 1


@pytest.mark.parametrize("name", [m for m in LONG_ONLY if m not in LONG_TIER1])
def test_long_mutant_fails_the_long_case_alone(name):
    """A 16-bit token position wraps past 65536 tokens: right on the whole smoke prefix (the long cases are off by
    default on a CPU), wrong on the long case's request of 2^16 + 65 tokens, whose newest token dominates its last
    row; the correct kernel passes the long case."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    assert _campaign(name, "bf16") == 0
    case = long_cases("bf16")[0]  # the request of 2^16 + 65 tokens (then the big split batch)
    result = run_case(case, from_callable(getattr(mutants, name)), "cpu")
    assert "tier1.out" in {c.name for c in result.checks if not c.ok}, result.describe()
    assert run_case(case, from_callable(mutants.correct), "cpu").ok


@pytest.mark.parametrize("name", LONG_TIER1)
def test_long_tier1_mutant_gives_the_correct_bits_on_the_smoke_prefix_and_fails_its_long_case(name):
    """An index that wraps past a count no smoke case reaches: the mutant gives the correct kernel's bits on the smoke
    case of the largest count (under the wrap), and fails tier1 on its long case; the correct kernel passes there.
    Only the tier-1 check runs on the long case, whose full checks take minutes on a CPU (a narrower latent where
    the count does not depend on it)."""
    import torch

    from mla_ref.decode import mla_decode_ref
    from verify import mutants
    from verify.checks import _tier1_bound, check_tier1
    from verify.kernels import from_callable

    count, wrap, is_long, overrides = LONG_TIER1[name]
    mutant = getattr(mutants, name)
    most = max(smoke_cases("bf16"), key=count)
    assert count(most) <= wrap
    batch, _ = most.materialize("cpu")
    for got, want in zip(mutant(batch), mutants.correct(batch), strict=True):
        assert torch.equal(got, want)

    (case,) = [c for c in long_cases("bf16", **overrides) if is_long(c)]
    assert count(case) > wrap
    batch, _ = case.materialize("cpu")
    ref = mla_decode_ref(batch)  # ([T, H, L], [T, H]) fp64
    kernel = from_callable(mutant)
    bound = _tier1_bound(batch, kernel, kernel.numerics(batch), ref)
    failed = {r.name for r in check_tier1(*mutant(batch), ref, bound, torch.bfloat16) if not r.ok}
    assert "tier1.out" in failed
    assert all(r.ok for r in check_tier1(*mutants.correct(batch), ref, bound, torch.bfloat16))


@pytest.mark.parametrize("name", ["rope_width_64", "full_tile_fast_path"])
def test_minicpm3_smoke_case_catches_a_fixed_rope_width_and_a_full_tile_fast_path(name):
    """Found by a review: every case had DeepSeek's latent of 512 and rope of 64, and no smoke case MTP rows on a
    length of whole 64-token tiles. The MiniCPM3-shaped smoke case (latent 256, rope 32, 40 heads; lengths 128 and
    64 with 3 and 2 rows) fails both on tier1; the first smoke case (DeepSeek's shape, MTP on other lengths) passes
    rope_width_64, and fails full_tile_fast_path only through the shared batch's partial sibling (judged since the
    fifty-eighth session: 4 whole 64-token pages with the longest's 3 MTP rows); the correct kernel passes the new
    case."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    first, *others = smoke_cases("bf16")
    (minicpm3,) = [case for case in others if case.kv_lora_rank != 512]
    assert (minicpm3.kv_lora_rank, minicpm3.rope_dim, minicpm3.heads) == (256, 32, 40)
    assert "L256R32" in minicpm3.describe()
    result = run_case(minicpm3, from_callable(getattr(mutants, name)), "cpu")
    assert "tier1.out" in {c.name for c in result.checks if not c.ok}, result.describe()
    first_failed = {c.name for c in run_case(first, from_callable(getattr(mutants, name)), "cpu").checks if not c.ok}
    assert first_failed == (set() if name == "rope_width_64" else {"batch.shared.added.out", "batch.shared.added.lse"})
    assert run_case(minicpm3, from_callable(mutants.correct), "cpu").ok


def test_request_index_mutant_fails_the_two_smoke_cases_past_256_requests_alone():
    """Found by a review: a request index kept in 8 bits passed every check while the largest batch built had 65
    requests. The smoke prefix's batch of 260 (64 non-empty, every fourth, request 256 among them) fails it, on
    tier1, and so does its batch of 300 non-empty requests (sixty-ninth session); every other smoke case passes it,
    and the correct kernel passes both."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable
    from verify.strategies import BIG_BATCH

    *others, big = smoke_cases("bf16")
    (many,) = [case for case in others if len(case.seq_lens) > 256]
    assert len(big.seq_lens) == BIG_BATCH > 256 and big.seq_lens[256] > 0 and many.seq_lens[256] > 0
    for case in (big, many):
        result = run_case(case, from_callable(mutants.request_index_8bit), "cpu")
        assert "tier1.out" in {c.name for c in result.checks if not c.ok}, result.describe()
        assert run_case(case, from_callable(mutants.correct), "cpu").ok
    assert all(run_case(case, from_callable(mutants.request_index_8bit), "cpu").ok for case in others
               if case is not many)


@pytest.mark.parametrize("name", FAR_ONLY)
def test_far_mutant_fails_the_far_check_alone(name):
    """int32 element offsets and 16-bit page ids are right on every small cache: only the far check (its pages past
    element 2^31 and page id 2^16; on this case's pages of 64 the ids reach 2^16 only since the fifty-sixth session)
    tells, and it is off by default on a CPU; the correct kernel passes it bit for bit."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    case = smoke_cases("fp8")[0]  # fp8: a 2.4 GB far cache (bf16 would take 4.8 GB)
    result = run_case(case, from_callable(getattr(mutants, name)), "cpu", far=True)
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) <= {"far.out", "far.lse"} and failed, result.describe()
    assert "out elements differ from the run on the compact cache" in failed["far.out"]
    assert run_case(case, from_callable(getattr(mutants, name)), "cpu").ok  # far off by default on a CPU
    right = run_case(case, from_callable(mutants.correct), "cpu", far=True)
    far = {c.name: c.detail for c in right.checks}["far"]
    assert right.ok and far.endswith("the bits of the run on the compact cache")


@pytest.mark.parametrize("name", sorted(ONE_CASE))
def test_a_review_mutant_fails_its_smoke_case_on_tier1(name):
    """Each of these passed the whole default campaign of its review (fifty-ninth session): no case had more than 64
    heads but 128, pages of more than 128 tokens, a non-power-of-two page but 3 (where a 16-bit magic division is
    exact below 32768 tokens; on pages of 528 it first misses at token 527), more than 8 MTP rows, or a kv scale
    of 1 beside fp8 q's dynamic one (later reviews' bugs likewise). The smoke prefix now has one case for each: the
    mutant fails it on tier1 (so the default campaign exits 1), and the correct kernel passes it."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    dtype, picks = ONE_CASE[name]
    (case,) = [c for c in smoke_cases(dtype) if picks(c)]
    result = run_case(case, from_callable(getattr(mutants, name)), "cpu")
    expected = ONE_CASE_FAILS.get(name, {"tier1.out", "tier1.lse"})
    assert expected <= {c.name for c in result.checks if not c.ok}, result.describe()
    assert run_case(case, from_callable(mutants.correct), "cpu").ok


@pytest.mark.parametrize("name", [m for m in FP8_ONLY if m not in ONE_CASE])
def test_fp8_mutant_is_harmless_without_fp8(name):
    """Scale bugs cannot show on bf16 inputs (no scales): the campaign must pass, not flag something else."""
    assert _campaign(name, "bf16") == 0


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_cuda_mutant_is_harmless_on_a_cpu(name):
    """A step that replaces its workspace at each plan is right wherever run() is called again (a CPU run): the
    campaign must pass there, not flag something else; tests/test_step_check.py catches it on CUDA."""
    assert _campaign(name, "bf16") == 0


def test_enough_mutants():
    assert len(MUTANTS) >= 10


@pytest.mark.parametrize(("name", "tensor"), [("seq_lens_cleared", "seq_lens"), ("cache_padding_written", "kv_cache")])
def test_a_kernel_that_writes_its_inputs_fails_the_inputs_check(name, tensor):
    """The oracle runs before the kernel and the inputs are compared byte for byte after it: a kernel that zeroed
    seq_lens and returned empty rows passed every check when the oracle ran after it (found by a review). Writing
    only the unused (NaN) cache slots changes no output: the inputs check catches it, and the layout and rerun
    checks, whose strided and roomy copies it writes into too."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    case = smoke_cases("bf16")[0]
    result = run_case(case, from_callable(getattr(mutants, name)), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert "inputs" in failed and tensor in failed["inputs"], result.describe()
    if name == "cache_padding_written":
        assert set(failed) == {"inputs", "layout", "rerun.room"}, result.describe()
        assert "the kernel wrote into its input buffers: kv_cache" in failed["layout"]
        assert "the kernel wrote into its inputs: kv_cache" in failed["rerun.room"]


def test_a_nan_partial_merged_as_empty_fails_the_nan_check_alone():
    """A NaN in a token a row reads must give NaN out and lse, split or not (docs/architecture.md); a kernel that
    merges a NaN split partial as an empty one (aiter's reduce) gives a finite answer there, and every other check
    passes: its inputs are finite (found by a review; the mutants' own correct kernel had done the same)."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    case = smoke_cases("bf16")[0]  # its longest request (300 tokens) is cut in splits
    result = run_case(case, from_callable(mutants.nan_dropped), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"nan", "nan.first"}, result.describe()  # nan.first: a request of one split, left empty
    assert "out not NaN on 8 of the 8 (row, head)s that read it" in failed["nan"]
    assert run_case(case, from_callable(mutants.correct), "cpu").ok


def test_a_reduce_that_weighs_a_nan_partial_by_0_fails_the_first_token_nan_check_alone():
    """A reduce whose padding slots re-read the first split tile's first partial with weight 0 is right on finite
    data and on the newest token's NaN (the last piece, which no padding slot reads), and spreads a NaN in the first
    request's first token to every request of fewer splits (0 NaN = NaN; found by a review that mutated the
    emulated path's reduce): only ``nan.first`` sees it, on the first smoke case (request 1, one token and one split,
    beside the 300-token request's splits); the correct kernel passes it."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    case = smoke_cases("bf16")[0]
    result = run_case(case, from_callable(mutants.reduce_pad_weight0), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"nan.first"}, result.describe()
    assert "first token of request 1" in failed["nan.first"] and "that do not read it" in failed["nan.first"]
    passed = {c.name for c in run_case(case, from_callable(mutants.correct), "cpu").checks if c.ok}
    assert {"nan", "nan.first"} <= passed


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("token", ["newest", "first"])
def test_the_nan_probe_marks_what_the_oracle_makes_nan(dtype, token):
    """nan_probe's expected mask is the oracle's: NaN out (every channel) and lse on the longest request's last
    query row only (newest: its earlier MTP rows do not see the newest token), or on every row of the first
    request with as many tokens as rows (first: its first token), finite elsewhere; also on drawn cases with MTP
    rows past their lengths (a first request of fewer tokens than rows is passed over: its leading rows read
    nothing, where a kernel's tile may carry the NaN as 0 x NaN; the oracle gives them out 0, lse -inf)."""
    import torch

    from mla_ref.decode import mla_decode_ref
    from verify.checks import nan_probe
    from verify.cli import _draw
    from verify.strategies import cases

    drawn = [c for c in _draw(cases(dtype, max_seq_len=64), 40, seed=5) if any(n > s for n, s in zip(c.q_lens,
                                                                                              c.seq_lens))][:8]
    for case in smoke_cases(dtype) + drawn:
        batch, _ = case.materialize("cpu")
        probe = nan_probe(batch, token)
        if probe is None:
            continue
        nan_batch, expected, row = probe
        b = int(batch.row_request()[row])
        rows = int((batch.visible_tokens()[batch.row_request() == b] > 0).sum()) if token == "first" else 1
        assert bool(expected[row].all()) and int(expected.sum()) == rows * batch.num_heads, case
        out, lse = mla_decode_ref(nan_batch)
        assert torch.equal(torch.isnan(out).all(dim=-1), expected) and torch.equal(torch.isnan(lse), expected), case
        assert torch.equal(torch.isnan(out).any(dim=-1), expected), case
    with pytest.raises(ValueError, match="nan_probe.token: expected one of"):
        nan_probe(batch, "last")


def test_a_declared_nan_deviation_skips_the_nan_check_and_says_so(monkeypatch):
    """FlashInfer and FlashMLA keep NaN out of lse (measured on an H200; aiter's reduce drops NaN partials): their
    backends declare it (Backend.nan_deviation), the campaign's reason names it and the nan check does not run for
    them; the same kernel without the declaration fails the nan check."""
    import dataclasses

    from mla_fast.backends import BACKENDS
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_backend

    for name in ("flashinfer", "flashmla", "aiter"):
        assert BACKENDS[name].nan_deviation
    assert not any(BACKENDS[name].nan_deviation for name in ("ref", "emulated", "triton", "seesaw", "gluon_fp8"))
    case = smoke_cases("bf16")[0]
    declared = dataclasses.replace(BACKENDS["emulated"], run=mutants.nan_dropped, run_workers=None,
                                   nan_deviation="drops NaN partials")
    monkeypatch.setitem(BACKENDS, "emulated", declared)
    kernel = from_backend("emulated")
    assert "nan check not run, declared: drops NaN partials" in kernel.reason
    result = run_case(case, kernel, "cpu")
    assert result.ok and not {"nan", "nan.first"} & {c.name for c in result.checks}, result.describe()
    result = run_case(case, dataclasses.replace(kernel, nan_deviation=""), "cpu")
    assert [c.name for c in result.checks if not c.ok] == ["nan", "nan.first"], result.describe()


def hardcoded_scale_for_fp8_q(batch):
    """hardcoded_scale on the fp8-q path only, where kernels fold q_scale into σ (FlashInfer's split_q_scale)."""
    from mla_ref.decode import is_fp8
    from verify import mutants
    from verify.cases import SM_SCALE

    return mutants._decode(batch, sm_scale=SM_SCALE if is_fp8(batch.q.dtype) else None)


def test_a_scale_ignored_on_the_fp8_q_path_alone_fails_the_fp8_smoke_prefix():
    """The fp8 smoke prefix holds a case of another σ with fp8 q: a kernel that ignores σ only there fails it (the
    two σ cases had bf16 q; found by a review)."""
    assert main(["--impl", "tests.test_mutants:hardcoded_scale_for_fp8_q", "--dtype", "fp8", "--cases",
                 str(len(smoke_cases("fp8"))), "--jobs", "1"]) == 1


def test_a_failed_tier1_check_names_its_worst_row_in_the_batchs_terms():
    """The MTP off-by-one's worst rows are named as request, query row and the tokens it sees (flat row indices
    alone left the request to be worked out from q_lens), and so is the first row whose NaN / inf positions differ
    from the oracle's; a check failed by those positions alone names no passing row as its worst."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    case = smoke_cases("bf16")[0]  # request 5: 2 tokens, 4 query rows (rows 8-11)
    result = run_case(case, from_callable(mutants.mtp_causal_off_by_one), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert failed["tier1.out"].endswith("worst row 10: request 5, its query row 1 of 4, which sees 0 of its 2 tokens")
    assert failed["tier1.lse"].endswith("worst row 11: request 5, its query row 2 of 4, which sees 1 of its 2 tokens")
    # lse finite where the oracle's is -inf (a row that sees nothing): that row named first
    assert ("first NaN/inf mismatch on row 10: request 5, its query row 1 of 4, which sees 0 of its 2 tokens\n"
            in failed["tier1.lse"])
    # failed by its NaN alone (no finite element over the bound): the mismatched row named, not a passing worst one
    result = run_case(case, from_callable(mutants.nan_empty), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert "elements over the bound: 0 /" in failed["tier1.out"] and "worst row" not in failed["tier1.out"]
    assert failed["tier1.out"].endswith(
        "first NaN/inf mismatch on row 0: request 0, its query row 0 of 2, which sees 0 of its 0 tokens")


def test_a_fast_path_for_consecutive_pages_fails_the_layout_check_and_nothing_else_on_the_first_case():
    """Every batch a campaign builds has its pages in a random order, so a kernel whose fast path for a request on
    consecutive pages reads past its last token was caught only by the rerun check, whose grown requests happen to
    take consecutive pages (a review's bug, sixty-ninth session). The layout check lays each request's pages out in
    order (`pages_in_use_order`): on the first smoke case it fails there; every other check but rerun passes."""
    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable

    result = run_case(smoke_cases("bf16")[0], from_callable(mutants.consecutive_pages_flat), "cpu")
    failed = {c.name.split(".")[0] for c in result.checks if not c.ok}
    assert "layout" in failed and failed <= {"layout", "rerun"}, result.describe()
