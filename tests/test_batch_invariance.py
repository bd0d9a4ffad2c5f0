"""Batch invariance on the CPU: the planner's fixed splits, the regrouped batch of the ``batch`` check, and the check
itself on plug-ins (the Triton kernel's decode_invariant: tests/test_triton_decode.py under the interpreter,
tests/test_triton_gpu.py on a GPU).

Every comparison here is of bits, plan integers or the check's own verdicts; no tolerance is chosen here (the check's
tier-1 bound is verify.bounds').
"""

import dataclasses
import itertools

import pytest
import torch

from mla_fast.planner import BATCH, KV_END, KV_START, plan_decode
from mla_ref.decode import INVALID_PAGE, mla_decode_ref
from verify import mutants
from verify.cases import Case
from verify.checks import _moved, check_batch
from verify.kernels import from_callable
from verify.next_step import negated
from verify.regrouped import regrouped_batches, shared_batch


def _pieces(plan, request: int) -> list[tuple[int, int]]:
    """The (kv_start, kv_end) of a request's items, in KV order."""
    items = plan.work_items[plan.work_items[:, BATCH] == request]  # [n, 8]
    return sorted(zip(items[:, KV_START].tolist(), items[:, KV_END].tolist()))


def _least_contiguous_max(costs: list[int], workers: int) -> int:
    """The least busiest worker over every partition of the items, in order, into at most ``workers`` contiguous
    runs (brute force over the cut positions)."""
    n, best = len(costs), sum(costs)
    for cuts in itertools.combinations(range(1, n), min(workers, n) - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_fixed_splits_cut_each_request_by_itself_and_balance_the_workers(seed):
    """With split_tokens S every request is cut at the multiples of S and nowhere else, whatever else the batch
    holds (the same pieces alone, reversed, beside others); each worker runs a contiguous run of the items, the
    busiest as light as any such partition allows (brute force); partial rows only for requests longer than S."""
    g = torch.Generator().manual_seed(seed)
    B, S, W = 5, 128, int(torch.randint(1, 5, (1,), generator=g))
    seq = torch.randint(0, 600, (B,), generator=g)
    seq[0] = 0  # an empty request: one item of no tokens
    q = torch.randint(1, 4, (B,), generator=g)
    plan = plan_decode(seq, q, 16, W, split_tokens=S)
    for b in range(B):
        s = int(seq[b])
        want = [(k, min(k + S, s)) for k in range(0, max(s, 1), S)] if s else [(0, 0)]
        assert _pieces(plan, b) == want
        assert _pieces(plan_decode(seq[b:b + 1], q[b:b + 1], 16, 132, split_tokens=S), 0) == want
        flipped = plan_decode(seq.flip(0), q.flip(0), 16, W + 3, split_tokens=S)
        assert _pieces(flipped, B - 1 - b) == want
    costs = plan.item_costs().tolist()
    assert plan.worker_costs().max() == _least_contiguous_max(costs, W)
    assert plan.num_partial_rows == sum(int(q[b]) * len(_pieces(plan, b)) for b in range(B) if int(seq[b]) > S)


def test_fixed_splits_refuse_what_they_cannot_keep():
    seq, q = torch.tensor([100, 7]), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="split_tokens must be a multiple of block_n"):
        plan_decode(seq, q, 16, 4, split_tokens=100)
    with pytest.raises(ValueError, match="max_splits must be None with split_tokens"):
        plan_decode(seq, q, 16, 4, split_tokens=128, max_splits=2)
    with pytest.raises(ValueError, match="min_tail must be 1 with split_tokens"):
        plan_decode(seq, q, 16, 4, split_tokens=128, min_tail=4)
    with pytest.raises(ValueError, match="split_tokens must be an int >= 1"):
        plan_decode(seq, q, 16, 4, split_tokens=0)
    assert plan_decode(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 16, 4,
                       split_tokens=64).num_items == 0


def test_a_step_refuses_fixed_splits_off_its_blocks_when_built():
    """TritonMLADecode(split_tokens=S) with S not a multiple of its config's plan_block_n: ValueError at
    construction, naming the field, rather than at its first plan()."""
    from mla_fast.triton_decode import TritonMLADecode

    batch, _ = CASE.materialize()
    step = TritonMLADecode(batch, max_q_len=2, num_workers=4, split_tokens=128)
    block = step.config.plan_block_n
    with pytest.raises(ValueError, match=rf"split_tokens must be a multiple of the config's plan_block_n \({block}"):
        TritonMLADecode(batch, max_q_len=2, num_workers=4, split_tokens=block + block // 2)


FP64_ROWS = 2**-40  # relative: the oracle sums a request's tokens in another order when its length bucket changes
# (fp64, about 1e-16 relative), 2^12 fp64 ulps, far below any bound a check takes


@pytest.mark.parametrize("seq_lens, q_lens, grown, shrunk, mtp, added", [
    ((40, 0, 70), (1, 2, 1), [2, 1, 2], [1, 0], [0, 2], 134),  # reversed, request 0 dropped, the longest (2) and a
    # longer request; mtp: the 2-row request dropped
    ((300, 129, 300, 127), (1, 1, 1, 1), [3, 2, 1, 0], [3, 1], [0, 1, 2, 3], 588),  # a tie: shrunk drops both;
    # single rows: mtp adds a 2-row request
    ((9,), (3,), [0, 0], None, [0], 9),  # one request shorter than a page: the added one no longer; mtp: 4 rows
    ((3,), (3,), [0, 0], None, None, 3),  # no more tokens than rows: no mtp batch
    ((5, 5), (1, 1), [1, 0], [1], [0, 1], 5),  # equal lengths under a page: the first longest dropped
    ((50, 50, 50), (1, 1, 2), [2, 1, 0], [2, 1], [0, 1], 98),  # equal lengths: the added request is longer
    ((1, 0), (1, 1), [1, 0], [1], None, 1),  # one token: no mtp batch (no more rows than tokens)
    ((33, 7), (2, 2), [1, 0], [1], [0, 1], 65),  # one q_len above 1: mtp adds a 3-row request
])
@pytest.mark.parametrize("P", [1, 3, 16, 64])
def test_regrouped_batches_reindex_rows_and_keep_the_cache(seq_lens, q_lens, grown, shrunk, mtp, added, P):
    """Each regrouped batch names the same pages for each request (the cache itself shared), copies q's rows in the
    new order, and changes the batch size, its total tokens (the grown one up, the shrunk one down) and, where it
    can, its longest length (grown, shrunk) and largest q_len (mtp); the oracle's rows are the case's, reindexed
    (up to fp64 rounding). The grown batch's added request reads the longest's full pages, then all of its pages,
    with its q rows; the mtp batch's added one (cases of one q_len n) the longest's tokens with its n rows and the
    last one again; neither sees a NaN slot."""
    batch, _ = Case(seq_lens=seq_lens, q_lens=q_lens, heads=2, page_size=P, kv_lora_rank=64, rope_dim=32,
                    seed=1).materialize()
    regroupings = regrouped_batches(batch)
    s_max, longest = max(seq_lens), seq_lens.index(max(seq_lens))
    added = added if P == 16 else s_max // P * P + s_max  # the table's added tokens are for pages of 16
    assert [r.how for r in regroupings] == ["grown"] + (["shrunk"] if shrunk else []) + (["mtp"] if mtp else [])
    out, lse = mla_decode_ref(batch)
    starts = [0, *itertools.accumulate(q_lens)]
    longest_rows = batch.q[starts[longest]:starts[longest + 1]]  # [n, H, D]
    table = batch.block_table[longest]  # [W]
    full, pages = s_max // P, -(-s_max // P)
    for r in regroupings:
        requests = {"grown": grown, "shrunk": shrunk, "mtp": mtp}[r.how]
        assert r.requests.tolist() == requests
        assert r.batch.kv_cache is batch.kv_cache and r.compared.kv_cache is batch.kv_cache
        n, W = len(requests), batch.block_table.shape[1]
        assert torch.equal(r.batch.block_table[:n, :W], batch.block_table[requests])
        assert r.compared.seq_lens.tolist() == [seq_lens[b] for b in requests]
        rows = [t for b in requests for t in range(starts[b], starts[b + 1])]
        assert r.rows.tolist() == rows and torch.equal(r.compared.q, batch.q[rows])
        out_r, lse_r = mla_decode_ref(r.batch.validate())
        for got, want in ((r.case_rows(out_r), out[rows]), (r.case_rows(lse_r), lse[rows])):
            assert torch.equal(got.isfinite(), want.isfinite())
            assert (got - want).nan_to_num().abs().max() <= FP64_ROWS * want.nan_to_num(0, 0, 0).abs().max()
        assert torch.isfinite(out_r).all()
        added_rows = r.batch.q[len(rows):]  # [rows of the added request, H, D]
        if r.batch is r.compared:
            assert r.how == "shrunk" or (r.how == "mtp" and len(set(q_lens)) > 1)
        elif r.how == "grown":
            assert r.batch.batch_size == n + 1 and int(r.batch.seq_lens[-1]) == added
            assert r.batch.block_table[-1, :full + pages].tolist() == table[:full].tolist() + table[:pages].tolist()
            assert torch.equal(added_rows, longest_rows)
        else:
            assert r.batch.batch_size == n + 1 and r.batch.q_lens[-1] == max(q_lens) + 1
            assert r.batch.seq_lens[-1] == s_max
            assert r.batch.block_table[-1, :pages].tolist() == table[:pages].tolist()
            assert torch.equal(added_rows, torch.cat([longest_rows, longest_rows[-1:]]))
    by = {r.how: r.batch for r in regroupings}
    assert by["grown"].batch_size == (len(seq_lens) + 1 if len(seq_lens) > 1 else 3)
    assert int(by["grown"].seq_lens.sum()) > sum(seq_lens)
    if s_max >= P:
        assert int(by["grown"].seq_lens.max()) > s_max
    if shrunk:
        assert int(by["shrunk"].seq_lens.sum()) < sum(seq_lens)
        if len(set(seq_lens)) > 1:
            assert int(by["shrunk"].seq_lens.max()) < s_max
    if mtp:
        assert int(by["mtp"].q_lens.max()) != max(q_lens)


CASE = Case(seq_lens=(300, 129, 0, 127), q_lens=(1, 2, 1, 1), heads=4, page_size=16, seed=3)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("seq_lens, q_lens, full",
                         [((300, 129, 0, 127), (1, 2, 1, 1), 18), ((5,), (3,), 0), ((0, 70), (2, 2), 4),
                          ((20, 3), (3, 1), 1)])
def test_the_shared_batch_puts_the_case_among_siblings_on_the_longests_pages(dtype, seq_lens, q_lens, full):
    """The shared batch: a sibling on the longest request's block-table row and length; the case's requests as
    they are; where the longest has f >= 1 full pages, a sibling on its first ceil(f / 2) pages and then its first
    max(1, f // 2) again, max(f, 2) P tokens; the first sibling again. Each sibling has the longest's q_len and its
    q rows negated, exactly, and is an added request, whose batch of its own gets the oracle's answer of its rows
    there; the cache is the case's and the case's rows get the case's oracle answer (up to fp64 rounding). A case
    without a token has none."""
    batch = Case(seq_lens=seq_lens, q_lens=q_lens, heads=2, page_size=16, kv_lora_rank=64, rope_dim=32, seed=2,
                 kv_dtype=dtype, q_dtype=dtype).materialize()[0]
    shared = shared_batch(batch)
    longest, B = seq_lens.index(max(seq_lens)), len(seq_lens)
    starts = [0, *itertools.accumulate(q_lens)]
    n, siblings = q_lens[longest], 3 if full else 2  # the longest's q rows, its siblings
    assert shared.how == "shared" and shared.compared is batch and shared.offset == n
    assert shared.added == (0, *range(B + 1, B + siblings))
    assert shared.batch.kv_cache is batch.kv_cache and shared.batch.batch_size == B + siblings
    assert torch.equal(shared.batch.q_lens.cpu(), torch.tensor([n, *q_lens] + [n] * (siblings - 1),
                                                                dtype=torch.int32))
    table, W = shared.batch.block_table, batch.block_table.shape[1]  # [B + siblings, >= W]
    assert (table[:, W:] == INVALID_PAGE).all()
    for b in (0, B + siblings - 1):  # the siblings on the longest's very row
        assert torch.equal(table[b, :W], batch.block_table[longest])
        assert int(shared.batch.seq_lens[b]) == seq_lens[longest]
    assert torch.equal(table[1 : B + 1, :W], batch.block_table)
    if full:  # the partial sibling: the first half of the longest's full pages, then its first pages again
        own = batch.block_table[longest]
        pages = torch.cat([own[: (full + 1) // 2], own[: max(1, full // 2)]])
        assert torch.equal(table[B + 1, : pages.shape[0]], pages)
        assert (table[B + 1, pages.shape[0] :] == INVALID_PAGE).all()
        assert int(shared.batch.seq_lens[B + 1]) == max(full, 2) * 16 != seq_lens[longest]
    sibling = batch.q[starts[longest] : starts[longest + 1]]  # [n, H, D]
    q = shared.batch.q.float()  # [T + siblings n, H, D]
    for rows in (q[:n], *q[n + batch.num_tokens :].split(n)):  # each sibling's rows
        assert torch.equal(rows, -sibling.float())
    assert torch.equal(shared.case_rows(shared.batch.q).view(torch.uint8), batch.q.view(torch.uint8))
    out, lse = mla_decode_ref(batch)
    out_s, lse_s = mla_decode_ref(shared.batch.validate())
    added, rows = shared.added_batch()
    assert added.batch_size == siblings and rows.tolist() == list(range(n)) + list(
        range(n + batch.num_tokens, n + batch.num_tokens + (siblings - 1) * n))
    out_a, lse_a = mla_decode_ref(added.validate())
    for got, want in ((shared.case_rows(out_s), out), (shared.case_rows(lse_s), lse), (out_s[rows], out_a),
                      (lse_s[rows], lse_a)):
        assert torch.equal(got.isfinite(), want.isfinite())
        assert (got - want).nan_to_num().abs().max() <= FP64_ROWS * want.nan_to_num(0, 0, 0).abs().max()
    assert "its q rows negated" in shared.describe()
    assert ("the first half of its full pages" in shared.describe()) == bool(full)
    assert shared_batch(batch.replace(seq_lens=torch.zeros_like(batch.seq_lens))) is None


def test_negated_is_exact_and_keeps_zeros_positive():
    """The siblings' q: -x in every format, zeros +0 (e4m3fnuz has no -0: its 0x80 is NaN)."""
    x = torch.tensor([0.0, 1.5, -2.0, 224.0])  # 224: in e4m3fnuz's range (240) and e4m3fn's
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        y = negated(x.to(dtype))
        assert y.dtype == dtype and torch.equal(y.float(), torch.where(x == 0, x, -x).to(dtype).float())
        assert not torch.isnan(y.float()).any() and not torch.signbit(y.float()[0])


def test_a_kernel_that_reuses_a_pages_results_for_its_later_readers_fails_the_shared_batch_alone():
    """mutants.shared_page_reuse (a request on an earlier one's pages takes that request's results, as per-page
    results kept by page id for their first reader are): the shared batch's first sibling, negated q, reads the
    longest's pages first, so the longest takes its rows; no other batch has two requests with other q on one page
    (the grown one repeats the longest with its own q). The correct kernel keeps its bits there."""
    results = _check(mutants.shared_page_reuse)  # undeclared: the rows judged within the tier-1 bound
    assert {name for name, r in results.items() if not r.ok} == {"batch.shared.out", "batch.shared.lse"}, results
    correct = _check(mutants.correct)
    assert correct["batch.shared"].ok and "bits of the case's run" in correct["batch.shared"].detail


@pytest.mark.parametrize("mutant", ["prefix_by_first_page", "prefix_first_pair"])
def test_a_cascade_kernel_that_misjudges_a_shared_prefix_fails_on_the_shared_batchs_partial_sibling(mutant):
    """Two cascade kernels that detect shared prefixes wrongly (mutants.prefix_by_first_page: every page up to the
    shorter's length shared by requests starting on one page; prefix_first_pair: the pages the first two such
    requests share, shared by the later ones too) read the first sibling's pages for the partial sibling, which
    comes after the case's longest request and shares only the first half of its full pages: its rows, judged
    against the oracle as an added request, fail, and nothing else does. Without the partial sibling (every
    sibling on the longest's whole row) both give every row right."""
    results = _check(getattr(mutants, mutant))  # undeclared: the rows judged within the tier-1 bound
    failed = {name for name, r in results.items() if not r.ok}
    assert failed == {"batch.shared.added.out", "batch.shared.added.lse"}, results
    detail = results["batch.shared.added.out"].detail  # the partial sibling: the second added request, request 5
    assert "added requests [0, 5, 6] as a batch of their own" in detail and ": request 1, its query row" in detail
    batch, _ = CASE.materialize()
    shared = shared_batch(batch)
    keep = torch.tensor([0, 1, 2, 3, 4, 6])  # [B + 2] every request but the partial sibling (request 5)
    whole, _ = shared.batch.subset(keep, int(shared.batch.q_lens[keep].sum()))
    for fn in (getattr(mutants, mutant), mutants.correct):
        assert torch.equal(fn(whole)[0].view(torch.int16), mutants.correct(whole)[0].view(torch.int16))


def _check(fn, case: Case = CASE):
    batch, _ = case.materialize()
    ref = mla_decode_ref(batch)  # [T, H, L], [T, H] fp64
    kernel = from_callable(fn)
    first = _moved(*fn(batch), ref[0].device)
    return {r.name: r for r in check_batch(batch, kernel, case.num_workers, first, ref)}


def test_the_batch_check_asks_a_declared_invariant_kernel_for_its_bits():
    """mutants.correct (each request's splits its own) keeps its bits; splits_follow_batch, declared invariant but
    cut by the batch's tokens, fails by name; the same kernel undeclared passes within the tier-1 bound."""
    assert _check(mutants.correct)["batch"].ok
    assert "bits of the case's run" in _check(mutants.correct)["batch"].detail
    failed = _check(mutants.splits_follow_batch)["batch"]
    assert not failed.ok and "declares itself batch-invariant" in failed.detail
    assert "out elements differ" in failed.detail
    # the first moved row named in the case's terms: the grown batch's row 0 is the case's row 4 (request 3, last)
    assert "the first case row 4: request 3, its query row 0 of 1, which sees 127 of its 127 tokens" in failed.detail

    def undeclared(batch):
        return mutants.splits_follow_batch(batch)

    results = _check(undeclared)
    assert results["batch.out"].ok and results["batch.lse"].ok and "out elements differ" in results["batch.out"].detail
    assert results["batch.shrunk.out"].ok and results["batch.shrunk.lse"].ok


@pytest.mark.parametrize("seq_lens", [(300, 129, 0, 127), (300, 129, 300, 127)])
def test_both_regroupings_see_cuts_that_follow_the_longest_request(seq_lens):
    """mutants.splits_follow_longest (declared invariant, its pieces sized from the batch's longest request) fails
    both regroupings, also when two requests share the longest length (the grown batch's added request is longer,
    the shrunk batch has neither)."""
    case = dataclasses.replace(CASE, seq_lens=seq_lens)
    results = _check(mutants.splits_follow_longest, case)
    for name in ("batch", "batch.shrunk"):
        assert not results[name].ok and "declares itself batch-invariant" in results[name].detail, name


def test_the_mtp_batch_sees_tiles_that_follow_the_largest_q_len():
    """mutants.tiles_follow_q_len (declared invariant, its softmax steps 64 / the batch's largest q_len tokens):
    plain decode requests beside the mtp batch's added 2-row request change bits, MTP requests of 2 rows beside a
    3-row one too, and so do the rest of a mixed batch without its 2-row request, so batch.mtp fails it (and
    nothing else here); a kernel that takes one query row per request refuses the single-row case's mtp batch
    alone."""
    single = dataclasses.replace(CASE, q_lens=(1, 1, 1, 1))
    pairs = dataclasses.replace(CASE, q_lens=(2, 2, 2, 2))
    for case, how in ((single, "2 query rows"), (pairs, "3 query rows"),
                      (CASE, "every request of the largest q_len dropped")):
        results = _check(mutants.tiles_follow_q_len, case)
        assert {name for name, r in results.items() if not r.ok} == {"batch.mtp"}, results
        assert "declares itself batch-invariant" in results["batch.mtp"].detail and how in results["batch.mtp"].detail

    from mla_fast.backends import Unsupported

    def one_row(batch):
        if batch.batch_size and int(batch.q_lens.max()) > 1:
            raise Unsupported("one query row per request")
        return mutants.correct(batch)

    one_row.batch_invariant = True
    results = _check(one_row, single)
    assert results["batch.mtp.refused"].ok and results["batch"].ok and results["batch.shrunk"].ok


def test_the_bound_takes_the_splits_of_the_batch_the_kernel_ran_on():
    """An undeclared kernel's rows in a regrouped batch are judged with the most splits it declares for the batch
    it ran on, added request included (its rows are not judged, but the plan that cut the compared rows was made
    for the whole batch): max_splits is asked of that batch, not of the compared requests alone."""
    asked = []

    def decode(batch):  # undeclared: its pieces follow the batch's tokens, so the grown batch's bits move
        return mutants.splits_follow_batch(batch)

    def max_splits(batch):
        asked.append(batch.batch_size)
        return 16  # splits_follow_batch: pieces of ceil(tokens / 16), so at most 16 per request

    decode.max_splits = max_splits
    results = _check(decode)
    assert results["batch.out"].ok and "out elements differ" in results["batch.out"].detail, results
    grown = regrouped_batches(CASE.materialize()[0])[0]
    assert grown.batch.batch_size == grown.compared.batch_size + 1
    assert grown.batch.batch_size in asked and grown.compared.batch_size not in asked, asked


def test_a_regrouped_batch_the_kernel_or_its_numerics_refuse_passes_as_refused():
    """Unsupported from the run or from the numerics of a regrouped batch: batch.refused / batch.shrunk.refused."""
    from mla_fast.backends import Unsupported

    def few_requests(batch):
        if batch.batch_size > len(CASE.seq_lens):
            raise Unsupported("more requests than the case")
        return mutants.correct(batch)

    results = _check(few_requests)
    assert results["batch.refused"].ok and "more requests than the case" in results["batch.refused"].detail
    assert results["batch.shrunk"].ok  # its shrunk batch, with fewer requests, keeps the bits (declared invariant)

    from verify.kernels import DEFAULT_NUMERICS

    def numerics_refuse(batch):  # undeclared: its numerics are asked for on the regrouped batches
        return mutants.correct(batch)

    def numerics(batch):
        if batch.batch_size < len(CASE.seq_lens):
            raise Unsupported("fewer requests than the case")
        return DEFAULT_NUMERICS

    numerics_refuse.numerics = numerics
    results = _check(numerics_refuse)
    assert results["batch.shrunk.refused"].ok and "fewer requests" in results["batch.shrunk.refused"].detail


def test_the_batch_check_fails_rows_that_depend_on_their_neighbours():
    """A kernel (undeclared) that is right on the case's batch but scales its first request's out by 1.5 in any
    other batch: regrouped, those rows leave the tier-1 bound."""

    def first_request_special(batch):
        out, lse = mutants.correct(batch)
        if batch.batch_size != len(CASE.seq_lens):  # another batch: the kernel mis-scales its first request
            n = int(batch.q_lens[0])
            out[:n] = (out[:n].float() * 1.5).to(out.dtype)
        return out, lse

    results = _check(first_request_special)
    assert not results["batch.out"].ok and results["batch.lse"].ok, results["batch.out"].detail


@pytest.mark.parametrize("attr, meant", [("batch_invarient", "batch_invariant"), ("numeric", "numerics"),
                                         ("max_split", "max_splits"), ("determinstic", "deterministic")])
def test_a_misspelt_plug_in_attribute_is_refused_by_name(attr, meant):
    """The default would stay in force unseen (a kernel checked as undeclared): ValueError naming the one meant."""
    def decode(batch):
        return mutants.correct(batch)

    setattr(decode, attr, True)
    with pytest.raises(ValueError, match=rf"\.{attr} is not an attribute the verifier reads; did you mean \.{meant}\?"):
        from_callable(decode)
    decode.unrelated_note = "kept"  # a name far from every declaration is the plug-in's own business
    delattr(decode, attr)
    assert from_callable(decode).batch_invariant is False


def test_a_batch_invariant_plug_in_must_be_deterministic():
    def decode(batch):
        return mutants.correct(batch)

    decode.batch_invariant, decode.deterministic = True, False
    with pytest.raises(ValueError, match=r"\.batch_invariant = True needs \.deterministic = True"):
        from_callable(decode)


def test_a_plug_ins_batch_invariant_flag_must_be_a_bool():
    def decode(batch):
        return mutants.correct(batch)

    decode.batch_invariant = "yes"
    with pytest.raises(ValueError, match=r"\.batch_invariant must be True or False"):
        from_callable(decode)
    decode.batch_invariant = True
    kernel = from_callable(decode)
    assert kernel.batch_invariant and "declared batch-invariant" in kernel.reason
