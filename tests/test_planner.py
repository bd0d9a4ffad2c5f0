"""Planner properties: exact coverage, balance bound, split cap, partial/reduce maps, aiter export, determinism."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from planner_cases import PlanCase

from mla_fast.planner import (
    BATCH,
    DEFAULT_OVERHEAD_TOKENS,
    FINAL,
    HEAD_END,
    HEAD_START,
    KV_END,
    KV_START,
    PARTIAL_ROW,
    QO_END,
    QO_START,
    WorkPlan,
    _build,
    _cut,
    _even_cuts,
    _line,
    _line_cuts,
    _unsplit_cuts,
    check_plan,
    plan_decode,
)

seq_len = st.integers(0, 100_000)
short = st.integers(0, 300)
seq_lists = st.one_of(
    st.lists(seq_len, min_size=1, max_size=64),
    st.tuples(seq_len, st.lists(short, min_size=1, max_size=200)).map(lambda t: [t[0], *t[1]]),  # one long, many short
    st.lists(st.sampled_from([0, 1, 63, 64, 65, 4096]), min_size=1, max_size=32),  # edges and empties
)


@st.composite
def plan_cases(draw, max_workers: int = 264) -> PlanCase:
    case = draw(_plan_cases(max_workers))
    return dataclasses.replace(case, min_tail=min(case.min_tail, case.block_n))


@st.composite
def _plan_cases(draw, max_workers: int) -> PlanCase:
    seqs = draw(seq_lists)
    if draw(st.booleans()):
        seqs = seqs[::-1]  # the long request last as often as first
    q_lens = draw(st.lists(st.integers(1, 4), min_size=len(seqs), max_size=len(seqs)))
    num_heads = draw(st.sampled_from([16, 128]))
    head_group = draw(st.sampled_from([h for h in (16, 32, 64, 128) if num_heads % h == 0]))
    return PlanCase(
        seq_lens=tuple(seqs),
        q_lens=tuple(q_lens),
        num_heads=num_heads,
        head_group=head_group,
        num_workers=draw(st.integers(1, max_workers)),
        block_n=draw(st.sampled_from([1, 16, 64, 128])),
        fixed_overhead=draw(st.integers(0, 16)),
        max_splits=draw(st.one_of(st.none(), st.integers(1, 8), st.integers(9, 300))),
        min_tail=draw(st.sampled_from([1, 1, 4, 64])),  # clamped to block_n below
    )


def ceil_div(a, b):
    return -(-a // b)


def tile_ids(case: PlanCase, items: torch.Tensor) -> torch.Tensor:
    """[N] tile index b * G + g of each item (request-major, as the planner numbers tiles)."""
    G = case.num_heads // case.head_group
    return items[:, BATCH] * G + items[:, HEAD_START] // case.head_group


def check_structure(case: PlanCase, plan: WorkPlan) -> None:
    """Layout of every tensor, q rows and heads of every item, indptr monotone."""
    B, G, W = len(case.seq_lens), case.num_heads // case.head_group, case.num_workers
    items = plan.work_items.long()  # [N, 8]
    N = items.shape[0]
    assert plan.work_items.dtype == torch.int32 and items.shape[1] == 8
    assert plan.worker_indptr.shape == (W + 1,) and plan.reduce_indptr.shape == (B * G + 1,)
    for indptr, end in ((plan.worker_indptr, N), (plan.reduce_indptr, plan.reduce_partial_map.numel())):
        assert int(indptr[0]) == 0 and int(indptr[-1]) == end and bool((torch.diff(indptr) >= 0).all())
    qo = torch.cumsum(torch.tensor((0, *case.q_lens)), 0)  # [B + 1]
    b = items[:, BATCH]
    assert bool(((b >= 0) & (b < B)).all())
    assert torch.equal(items[:, QO_START], qo[b]) and torch.equal(items[:, QO_END], qo[b + 1])
    assert bool((items[:, HEAD_START] % case.head_group == 0).all())
    assert bool((items[:, HEAD_END] - items[:, HEAD_START] == case.head_group).all())
    assert bool((items[:, HEAD_END] <= case.num_heads).all())


def check_coverage(case: PlanCase, plan: WorkPlan) -> None:
    """Every KV token of every (request, q rows, head group) lies in exactly one item; splits on block_n."""
    items = plan.work_items.long()  # [N, 8]
    B, G = len(case.seq_lens), case.num_heads // case.head_group
    seq = torch.tensor(case.seq_lens).repeat_interleave(G)  # [T] tokens per tile
    tile = tile_ids(case, items)  # [N]
    start, end = items[:, KV_START], items[:, KV_END]  # [N]
    # coverage count: tokens assigned per tile equals the tile's length ...
    covered = torch.zeros(B * G, dtype=torch.long).index_add_(0, tile, end - start)  # [T]
    assert torch.equal(covered, seq)
    # ... and the items of a tile, in KV order, abut: no token twice, none missing
    order = torch.argsort(tile * (max(case.seq_lens) + 1) + start, stable=True)  # [N] by (tile, kv_start)
    tile, start, end = tile[order], start[order], end[order]
    same = tile[1:] == tile[:-1]  # [N - 1]
    assert torch.equal(end[:-1][same], start[1:][same])
    first = torch.cat([torch.tensor([True]), ~same])  # [N] first item of each tile
    assert torch.equal(tile[first], torch.arange(B * G))  # every tile has an item
    assert bool((start[first] == 0).all())
    nonempty = seq[tile] > 0
    assert bool((end[nonempty] > start[nonempty]).all())  # no empty piece of a non-empty sequence
    assert int((~nonempty).sum()) == int((seq == 0).sum())  # an empty sequence gets exactly one (empty) item
    assert bool((start % case.block_n == 0).all())
    assert bool(((end % case.block_n == 0) | (end == seq[tile])).all())


def worker_costs(case: PlanCase, plan: WorkPlan) -> torch.Tensor:
    """[W] summed item costs: ceil(kv tokens / block_n) + fixed_overhead per item (the documented cost model)."""
    items = plan.work_items.long()
    cost = ceil_div(items[:, KV_END] - items[:, KV_START], case.block_n) + case.fixed_overhead  # [N]
    worker = torch.arange(case.num_workers).repeat_interleave(torch.diff(plan.worker_indptr.long()))  # [N]
    return torch.zeros(case.num_workers, dtype=torch.long).index_add_(0, worker, cost)


def check_balance_and_cap(case: PlanCase, plan: WorkPlan) -> None:
    """The balance inequality of the planner's docstring, and at most max_splits pieces per tile."""
    G = case.num_heads // case.head_group
    blocks = [ceil_div(s, case.block_n) for s in case.seq_lens for _ in range(G)]  # per tile
    C = sum(blocks) + case.fixed_overhead * len(blocks)  # total cost without splits
    W, ovh, m = case.num_workers, case.fixed_overhead, case.max_splits
    cost = worker_costs(case, plan)
    assert torch.equal(cost, plan.worker_costs())
    Q = max(1, ceil_div(C, W)) + (case.min_tail > 1)  # a split moved one block earlier (min_tail): one more block
    if m is None:
        # max <= ceil(C/W) + OVH, hence < mean + 1 + OVH (mean >= C/W): one block plus one overhead above the mean
        assert int(cost.max()) <= Q + ovh
        assert float(cost.max()) < float(cost.double().mean()) + 1 + ovh + (case.min_tail > 1)
    elif m >= 2:
        # the stride grows to ceil((b_max - 1) / (m - 1)) so that no tile needs more than m pieces
        assert int(cost.max()) <= max(Q, ceil_div(max(blocks) - 1, m - 1)) + ovh
    else:
        # no splits: a cut moves back to its tile's start, by at most the tile's length - 1
        assert int(cost.max()) <= Q + max(blocks) + ovh - 1
    pieces = torch.bincount(tile_ids(case, plan.work_items.long()), minlength=len(blocks))
    if m is not None:
        assert int(pieces.max()) <= m


def check_tails(case: PlanCase, plan: WorkPlan) -> None:
    """Every piece of a split tile holds at least min_tail tokens (the last may be short only of a whole block)."""
    items = plan.work_items.long()
    tile = tile_ids(case, items)  # [N]
    split = torch.bincount(tile, minlength=int(tile.max()) + 1 if tile.numel() else 0)[tile] > 1  # [N]
    tokens = items[:, KV_END] - items[:, KV_START]  # [N]
    assert bool((tokens[split] >= case.min_tail).all()), tokens[split].min()


def check_partials(case: PlanCase, plan: WorkPlan) -> None:
    """Split tiles use partial rows, each (row, head) written by one item and read by one reduce, in KV order."""
    items = plan.work_items.long()
    B, G, H, hg = len(case.seq_lens), case.num_heads // case.head_group, case.num_heads, case.head_group
    tile = tile_ids(case, items)  # [N]
    pieces = torch.bincount(tile, minlength=B * G)  # [T]
    split = pieces[tile] > 1  # [N]
    assert bool((items[~split, PARTIAL_ROW] == FINAL).all()) and bool((items[split, PARTIAL_ROW] >= 0).all())
    n_red = torch.diff(plan.reduce_indptr.long())  # [T]
    assert torch.equal(n_red, torch.where(pieces > 1, pieces, 0))

    def counts(first_row, n_rows, head_start) -> torch.Tensor:
        """[rows, H] how often each (workspace row, head) appears in the given row blocks."""
        r = torch.arange(4)  # q_len <= 4
        rows = first_row[:, None] + r  # [K, 4]
        ok = r[None, :] < n_rows[:, None]  # [K, 4]
        heads = head_start[:, None] + torch.arange(hg)  # [K, hg]
        idx = (rows[ok][:, None], heads[:, None, :].expand(-1, 4, -1)[ok])  # [M, 1], [M, hg]
        c = torch.zeros(plan.num_partial_rows, H, dtype=torch.long)
        return c.index_put_(idx, torch.ones(1, dtype=torch.long), accumulate=True)

    n_rows = items[:, QO_END] - items[:, QO_START]  # [N]
    written = counts(items[split, PARTIAL_ROW], n_rows[split], items[split, HEAD_START])
    final = plan.reduce_final.long()  # [T, 8]
    red_tile = torch.arange(B * G).repeat_interleave(n_red)  # [M] tile of each reduce_partial_map entry
    read = counts(plan.reduce_partial_map.long(), (final[:, 1] - final[:, 0])[red_tile], final[red_tile, 2])
    assert bool((written <= 1).all()) and torch.equal(written, read)
    # the reduce map lists each split tile's items in KV order
    order = torch.argsort(tile * (max(case.seq_lens) + 1) + items[:, KV_START], stable=True)
    assert torch.equal(items[order][split[order], PARTIAL_ROW], plan.reduce_partial_map.long())


def check_final_map(case: PlanCase, plan: WorkPlan) -> None:
    """reduce_final lists every (request, head group) once: its q rows and heads, its reduce range, and the base row
    from which its pieces' partial rows follow at q_len apart (the rule the Triton reduce computes rows by)."""
    B, G, hg = len(case.seq_lens), case.num_heads // case.head_group, case.head_group
    qo = torch.cumsum(torch.tensor((0, *case.q_lens)), 0)
    b, g = torch.arange(B).repeat_interleave(G), torch.arange(G).repeat(B)
    final = plan.reduce_final.long()  # [T, 8]
    assert final.shape == (B * G, 8) and bool((final[:, 7] == 0).all())
    assert torch.equal(final[:, :4], torch.stack([qo[b], qo[b + 1], g * hg, (g + 1) * hg], dim=1))
    indptr, pmap = plan.reduce_indptr.long(), plan.reduce_partial_map.long()
    assert torch.equal(final[:, 4], indptr[:-1]) and torch.equal(final[:, 5], indptr[1:])
    n = indptr[1:] - indptr[:-1]  # [T] pieces of split tiles, 0 unsplit
    assert bool((final[n == 0, 6] == FINAL).all())
    tile = torch.arange(B * G).repeat_interleave(n)  # [M] tile of each map entry
    i = torch.arange(pmap.numel()) - indptr[tile]  # [M] piece index inside its tile
    assert torch.equal(pmap, final[tile, 6] + i * (qo[b + 1] - qo[b])[tile])
    # the Triton reduce's grid: the split tiles' rows, in tile order
    assert torch.equal(plan.split_final.long(), final[n > 1]) and plan.split_tiles == int((n > 1).sum())
    assert plan.max_pieces == (int(n.max()) if n.numel() else 0)  # the most pieces of a split tile; 0: none split


def check_aiter(case: PlanCase, plan: WorkPlan, page_size: int) -> None:
    """aiter buffers (aiter-contract.md §4): indptrs, page-unit KV ranges, kv_offset, maps."""
    a = plan.to_aiter(page_size=page_size)
    items = plan.work_items.long()
    info = a["work_info_set"].long()  # [N, 8]
    assert a["work_info_set"].dtype == torch.int32 and info.shape == (plan.num_items, 8)
    assert a["work_meta_data"].shape == (2,)
    for key, end in (("work_indptr", plan.num_items), ("reduce_indptr", a["reduce_partial_map"].numel())):
        indptr = a[key].long()
        assert int(indptr[0]) == 0 and int(indptr[-1]) == end and bool((torch.diff(indptr) >= 0).all())
    assert a["work_indptr"].numel() == case.num_workers + 1
    assert torch.equal(info[:, :4], items[:, [BATCH, PARTIAL_ROW, QO_START, QO_END]])
    seq = torch.tensor(case.seq_lens)
    pages = ceil_div(seq, page_size)
    kv_indptr = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), pages]), 0)  # [B + 1]
    b = items[:, BATCH]
    assert torch.equal(info[:, 4], kv_indptr[b] + items[:, KV_START] // page_size)
    assert bool((items[:, KV_START] % page_size == 0).all())  # split points are page aligned
    assert torch.equal(info[:, 5], kv_indptr[b] + ceil_div(items[:, KV_END], page_size))
    assert bool((info[:, 4] <= info[:, 5]).all()) and bool((info[:, 5] <= kv_indptr[b + 1]).all())
    assert torch.equal(info[:, 6], seq[b] - items[:, KV_END]) and bool((info[:, 6] >= 0).all())
    assert bool((info[:, 7] == 0).all())
    # the final map covers every request's q rows exactly once
    fm = a["reduce_final_map"].long()  # [B, 2]
    assert fm.shape == (len(seq), 2) and int(fm[0, 0]) == 0 and int(fm[-1, 1]) == sum(case.q_lens)
    assert torch.equal(fm[1:, 0], fm[:-1, 1]) and bool((fm[:, 1] > fm[:, 0]).all())
    # every partial row written by exactly one work and read by exactly one reduce
    loc = info[:, 1][info[:, 1] >= 0]
    assert torch.equal(torch.sort(loc).values, torch.sort(a["reduce_partial_map"].long()).values)
    assert loc.unique().numel() == loc.numel()


def check_all(case: PlanCase, plan: WorkPlan) -> None:
    check_structure(case, plan)
    check_coverage(case, plan)
    check_balance_and_cap(case, plan)
    check_tails(case, plan)
    check_partials(case, plan)
    check_final_map(case, plan)


@given(plan_cases())
def test_plan_invariants(case: PlanCase):
    plan = case.plan()
    check_all(case, plan)
    again = case.plan()  # determinism: the same input gives the same plan
    for name in ("work_items", "worker_indptr", "reduce_indptr", "reduce_final", "reduce_partial_map", "split_final"):
        assert torch.equal(getattr(plan, name), getattr(again, name))
    assert plan.num_partial_rows == again.num_partial_rows
    # the flag the kernels trust instead of reading worker_indptr: worker w runs exactly item w
    one_each = torch.arange(plan.num_workers + 1).clamp(max=plan.num_items).to(torch.int32)
    assert plan.one_item_per_worker == torch.equal(plan.worker_indptr.cpu(), one_each)
    check_paired_splits(plan)


def check_paired_splits(plan: WorkPlan) -> None:
    """The flag a 2-CTA cluster merge trusts (mla_fast.dsmem): items 2t and 2t + 1 are the two pieces of tile t,
    in KV order, and no tile is unsplit or split in more pieces."""
    pieces = torch.diff(plan.reduce_indptr.cpu())  # [T], 0 = unsplit
    items = plan.work_items.cpu()  # [N, 8]
    pairs = plan.num_tiles > 0 and bool((pieces == 2).all()) and plan.num_items == 2 * plan.num_tiles
    if pairs:  # then the items must pair up by tile: same request and heads, adjacent token ranges
        first, second = items[0::2], items[1::2]
        pairs = (torch.equal(first[:, BATCH], second[:, BATCH])
                 and torch.equal(first[:, HEAD_START], second[:, HEAD_START])
                 and torch.equal(first[:, KV_END], second[:, KV_START])
                 and torch.equal(plan.reduce_partial_map.cpu()[0::2], first[:, PARTIAL_ROW]))
    assert plan.paired_splits == pairs


@pytest.mark.parametrize("batch, paired", [(64, True), (32, False), (128, False), (1, False)])
def test_paired_splits_marks_the_two_piece_even_plan(batch: int, paired: bool):
    """4096-token requests on 132 workers: 64 requests split in two (paired; the even plan), 32 in four (the even
    plan), 128 unsplit (one per worker), 1 in many pieces (the line plan)."""
    plan = plan_decode(torch.full((batch,), 4096), torch.ones(batch, dtype=torch.long), 16, 132)
    check_paired_splits(plan)
    assert plan.paired_splits == paired and plan.one_item_per_worker == (batch in (32, 64, 128))


@given(plan_cases(), st.sampled_from([1, 2, 16, 64]))
def test_aiter_export(case: PlanCase, page_size: int):
    case = PlanCase(**{**case.__dict__, "head_group": case.num_heads, "block_n": 64})  # aiter: no head groups
    plan = case.plan()
    check_aiter(case, plan, page_size)


@pytest.mark.parametrize("num_workers", [1, 2, 131, 132, 264, 1000, 1024])
def test_many_workers_one_long_many_short(num_workers: int):
    seqs = (100_000, *([0, 1, 17, 64, 300] * 40))
    case = PlanCase(seqs, (2,) * len(seqs), 128, 16, num_workers, 64, 5, None)
    check_all(case, case.plan())


def test_request_split_across_every_worker():
    case = PlanCase((64 * 1024,), (1,), 16, 16, 1024, 64, 0, None)  # 1024 blocks, 1024 workers, no overhead
    plan = case.plan()
    check_all(case, plan)
    assert plan.num_items == 1024 and torch.equal(torch.diff(plan.worker_indptr), torch.ones(1024, dtype=torch.int32))


def candidates(case: PlanCase) -> dict[str, WorkPlan]:
    """The planner's candidate plans of a case (module docstring): line, unsplit, and even when tiles <= workers."""
    line = _line(torch.tensor(case.seq_lens), torch.tensor(case.q_lens), case.num_heads, case.num_workers,
                 case.block_n, case.fixed_overhead, case.max_splits, case.head_group, case.min_tail)
    cuts = {"line": _cut(line, _line_cuts(line, case.max_splits), split=case.max_splits != 1),
            "unsplit": _cut(line, _unsplit_cuts(line, (line.total + 1, 0)), split=False)}  # beats any plan
    even = _even_cuts(line, case.max_splits)
    if even is not None:
        cuts["even"] = _cut(line, even[0], split=True)
        assert even[1:] == cuts["even"].key or case.min_tail > 1  # the even plan's closed forms (before min_tail
        # moves a cut, which adds a block or drops a split: plan_decode then compares the cut plan's own key)
    plans = {name: _build(line, cut) for name, cut in cuts.items()}
    for name, plan in plans.items():  # the key plan_decode compares candidates by, before building them
        assert cuts[name].key == (int(plan.worker_costs().max()), plan.num_partial_rows), name
    return plans


@given(plan_cases())
def test_returns_the_cheapest_candidate(case: PlanCase):
    """plan_decode's busiest worker costs no more than any candidate's. The even plan, valid on its own (it is held
    to the line's balance bound only when returned), runs at most one item of nonzero cost per worker, each tile in
    k_t = clamp(ceil(blocks_t / P), 1, max_splits) pieces for the least feasible piece length P."""
    plan, plans = case.plan(), candidates(case)
    assert int(plan.worker_costs().max()) == min(int(p.worker_costs().max()) for p in plans.values())
    G = case.num_heads // case.head_group
    if "even" not in plans:
        assert len(case.seq_lens) * G > case.num_workers
        return
    even = plans["even"]
    for check in (check_structure, check_coverage, check_tails, check_partials, check_final_map):
        check(case, even)
    if case.min_tail > 1:  # the closed forms below are the even plan's before min_tail moves a cut
        return
    items = even.work_items.long()
    costly = ((items[:, KV_END] > items[:, KV_START]) | (case.fixed_overhead > 0)).long()  # [N]
    worker = torch.arange(case.num_workers).repeat_interleave(torch.diff(even.worker_indptr.long()))  # [N]
    assert int(torch.zeros(case.num_workers, dtype=torch.long).index_add_(0, worker, costly).max()) <= 1
    blocks = torch.tensor([ceil_div(s, case.block_n) for s in case.seq_lens for _ in range(G)])  # [T]
    cap = case.max_splits or max(int(blocks.max()), 1)
    P = next(P for P in range(1, max(int(blocks.max()), 1) + 1)  # brute force, not the planner's bisection
             if int(ceil_div(blocks, P).clamp(1, cap).sum()) <= case.num_workers)
    k = ceil_div(blocks, P).clamp(1, cap)  # [T]
    assert torch.equal(torch.bincount(tile_ids(case, items), minlength=blocks.numel()), k)
    assert int(even.worker_costs().max()) == int(ceil_div(blocks, k).max()) + case.fixed_overhead


def least_busiest_partition(lengths: list[int], workers: int) -> int:
    """The least busiest-worker cost over every split of ``lengths`` into at most ``workers`` contiguous runs, by
    dynamic programming over (workers, tiles): the brute force the planner's greedy search must match."""
    prefix = [0]
    for n in lengths:
        prefix.append(prefix[-1] + n)
    best = [0] + [float("inf")] * len(lengths)  # best[t]: the first t tiles on the workers so far
    for _ in range(workers):
        best = [min(max(best[s], prefix[t] - prefix[s]) for s in range(t + 1)) for t in range(len(lengths) + 1)]
    return best[-1]


def unsplit_case(blocks, workers: int, overhead: int) -> PlanCase:
    """Requests of whole 64-token blocks, one q row and one head group each, split at most once (i.e. never)."""
    return PlanCase(tuple(n * 64 for n in blocks), (1,) * len(blocks), 16, 16, workers, 64, overhead, 1)


@given(st.builds(unsplit_case, st.lists(st.integers(0, 40), min_size=1, max_size=24), st.integers(1, 10),
                 st.integers(0, 6)))
@example(unsplit_case([1] * 6, 3, 0))  # greedy fills of 2 per worker: a fill of 3 would leave a worker idle
@example(unsplit_case([1, 4, 6, 4, 8, 8], 3, 0))  # the stride cut's 16 against 12
@example(unsplit_case([0, 0, 5, 0], 2, 0))  # tiles of no cost
@example(unsplit_case([40] * 24, 10, 6))
def test_the_unsplit_plan_is_the_best_contiguous_partition_of_whole_tiles(case: PlanCase):
    """Whole tiles of blocks + OVH each: the unsplit candidate's busiest worker costs the least that any contiguous
    partition onto the workers does; the plan splits no tile."""
    blocks, workers, overhead = [s // 64 for s in case.seq_lens], case.num_workers, case.fixed_overhead
    plan = candidates(case)["unsplit"]
    check_all(case, plan)
    assert plan.num_partial_rows == 0
    assert int(plan.worker_costs().max()) == least_busiest_partition([n + overhead for n in blocks], workers)


def test_unsplit_beats_the_fixed_stride_cut_moved_back_to_tile_starts():
    """Tiles of 1, 4, 6, 4, 8, 8 blocks (no overhead) on 3 workers, no split allowed: cuts at the stride
    ceil(31 / 3) = 11, moved back to tile starts (0 / 11 / 15), leave the last worker both 8s (16); the best
    partition is 1+4+6 / 4+8 / 8 (12), which plan_decode returns."""
    blocks = (1, 4, 6, 4, 8, 8)
    case = PlanCase(tuple(n * 64 for n in blocks), (1,) * len(blocks), 16, 16, 3, 64, 0, 1)
    line = _line(torch.tensor(case.seq_lens), torch.ones(len(blocks), dtype=torch.long), 16, 3, 64, 0, 1, 16)
    stride = _build(line, _cut(line, _line_cuts(line, 1), split=False))
    plan = case.plan()
    assert stride.worker_costs().tolist() == [11, 4, 16]
    assert plan.worker_costs().tolist() == [11, 12, 8]


def test_the_unsplit_search_stops_where_it_cannot_win():
    """Four tiles of 8 blocks on 2 workers cost 16 unsplit at best: against a plan of 16 with partial rows it is
    built (same cost, no reduce), against 16 without partial rows, or 15, it is not (None)."""
    line = _line(torch.full((4,), 8 * 64), torch.ones(4, dtype=torch.long), 16, 2, 64, 0, None, 16)
    assert _unsplit_cuts(line, (16, 1)).tolist() == [16]
    assert _unsplit_cuts(line, (16, 0)) is None and _unsplit_cuts(line, (15, 3)) is None


def test_worked_example_from_docstring():
    case = PlanCase((1000, 100, 0), (1, 1, 1), 16, 16, 4, 64, 5, None)
    line = candidates(case)["line"]
    kv = line.work_items[:, [BATCH, KV_START, KV_END]].tolist()
    assert kv == [[0, 0, 256], [0, 256, 832], [0, 832, 1000], [1, 0, 64], [1, 64, 100], [2, 0, 0]]
    assert line.worker_indptr.tolist() == [0, 1, 2, 4, 6]
    assert line.work_items[:, PARTIAL_ROW].tolist() == [0, 1, 2, 3, 4, -1]
    assert line.worker_costs().tolist() == [9, 14, 14, 11]
    assert line.num_partial_rows == 5
    plan = case.plan()  # the even plan: request 0 in two pieces, one item per worker
    kv = plan.work_items[:, [BATCH, KV_START, KV_END]].tolist()
    assert kv == [[0, 0, 512], [0, 512, 1000], [1, 0, 100], [2, 0, 0]]
    assert plan.worker_indptr.tolist() == [0, 1, 2, 3, 4]
    assert plan.work_items[:, PARTIAL_ROW].tolist() == [0, 1, -1, -1]
    assert plan.worker_costs().tolist() == [13, 13, 7, 5]
    assert plan.one_item_per_worker and not line.one_item_per_worker


@pytest.mark.parametrize("batch, seq_len, split", [(128, 4096, False), (128, 8192, False), (64, 4096, True),
                                                   (32, 16384, True), (1, 8192, True)])
def test_splits_only_when_the_busiest_worker_gains(batch: int, seq_len: int, split: bool):
    """About as many requests as workers: the line would cut nearly every tile near its end (max cost Q + OVH = 72
    blocks at b=128, s=4096) where keeping tiles whole costs 69 and needs no reduce; fewer requests must split."""
    seqs = torch.full((batch,), seq_len)
    plan = plan_decode(seqs, torch.ones(batch, dtype=torch.long), 16, 132)
    cut = candidates(PlanCase((seq_len,) * batch, (1,) * batch, 16, 16, 132, 64, 5, None))["line"]  # always cuts
    assert (plan.num_partial_rows > 0) == split
    assert int(plan.worker_costs().max()) <= int(cut.worker_costs().max())
    if not split:
        assert int(plan.worker_costs().max()) == -(-seq_len // 64) + 5 < int(cut.worker_costs().max())
        assert cut.num_partial_rows > 0  # the line alone would have split
    # the split shapes get the even plan, the others one tile per worker: one item per worker either way
    assert plan.one_item_per_worker


def test_summary_reports_balance():
    line = candidates(PlanCase((1000, 100, 0), (1, 1, 1), 16, 16, 4, 64, 5, None))["line"]  # the worked example
    s = line.stats()
    assert s["imbalance"] == 14 / 12 and s["split_tiles"] == 2 and s["pieces_per_tile"]["max"] == 3
    assert "imbalance max/mean 1.167" in line.summary()


@pytest.mark.parametrize("batch, pieces, line_max", [(32, 4, 22), (64, 2, 39)])
def test_even_plan_for_uniform_batches(batch: int, pieces: int, line_max: int):
    """Uniform requests of 4096 tokens (64 blocks) on 132 workers: every request in `pieces` equal pieces, one per
    worker (max 64 / pieces + 5 blocks), where the line's cuts fall at uneven offsets (max line_max, up to two items
    per worker) and make more partial rows."""
    case = PlanCase((4096,) * batch, (1,) * batch, 16, 16, 132, 64, 5, None)
    plan, line = case.plan(), candidates(case)["line"]
    assert int(line.worker_costs().max()) == line_max
    assert int(plan.worker_costs().max()) == 64 // pieces + 5 < line_max
    assert plan.num_items == batch * pieces == plan.num_partial_rows < line.num_partial_rows
    assert torch.equal(plan.work_items[:, KV_END] - plan.work_items[:, KV_START],
                       torch.full((batch * pieces,), 4096 // pieces, dtype=torch.int32))


def test_min_tail_keeps_every_split_piece_at_least_that_long():
    """A review's: 400 requests of 8193 tokens (one past 128 blocks) at q_len 4 on 304 workers split off pieces of
    1 token, which aiter's fp8 kernels read as NaN and whose first three causal rows see nothing; with min_tail = 4
    (the aiter adapter's) those splits move a block earlier, and the plan still covers every token."""
    seq, q = torch.full((400,), 8193), torch.full((400,), 4)
    tokens = lambda plan: plan.work_items[:, KV_END].long() - plan.work_items[:, KV_START].long()  # noqa: E731
    assert int(tokens(plan_decode(seq, q, 16, 304)).min()) == 1
    plan = plan_decode(seq, q, 16, 304, min_tail=4)
    assert int(tokens(plan).min()) >= 4 and plan.num_partial_rows > 0
    check_plan(plan, seq, q, 16)
    with pytest.raises(ValueError, match="min_tail must be <= block_n"):
        plan_decode(seq, q, 16, 304, block_n=16, min_tail=17)


def test_to_aiter_rejects_head_groups_and_unaligned_pages():
    plan = plan_decode(torch.tensor([100]), torch.tensor([1]), 128, 4, head_group=16)
    with pytest.raises(ValueError, match="head_group"):
        plan.to_aiter()
    plan = plan_decode(torch.tensor([100]), torch.tensor([1]), 16, 4, block_n=48)
    with pytest.raises(ValueError, match="page_size"):
        plan.to_aiter(page_size=32)
    # a review's: kv_indices positions past int32 wrapped to negative ones; 2^31 pages of 1 token are refused and
    # the same tokens in pages of 64 fit
    plan = plan_decode(torch.tensor([2**30] * 3), torch.tensor([1] * 3), 16, 6)
    with pytest.raises(ValueError, match=r"3221225472 pages of 1 tokens do not fit aiter's int32"):
        plan.to_aiter(page_size=1)
    assert int(plan.to_aiter(page_size=64)["work_info_set"][:, 4:6].min()) >= 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seq_lens": torch.tensor([-1])}, "seq_lens"),
        ({"seq_lens": torch.tensor([1.0])}, "seq_lens"),
        ({"seq_lens": torch.tensor([[1]]), "q_lens": torch.tensor([[1]])}, "seq_lens"),  # not 1-D
        ({"q_lens": torch.tensor([0])}, "q_lens"),
        ({"q_lens": torch.tensor([1, 1])}, "q_lens"),
        ({"num_heads": 0}, "num_heads"),
        ({"num_workers": 0}, "num_workers"),
        ({"block_n": 0}, "block_n"),
        ({"fixed_overhead": -1}, "fixed_overhead"),
        ({"max_splits": 0}, "max_splits"),
        ({"head_group": 3}, "head_group"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    args = {"seq_lens": torch.tensor([10]), "q_lens": torch.tensor([1]), "num_heads": 16, "num_workers": 4}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        plan_decode(args.pop("seq_lens"), args.pop("q_lens"), args.pop("num_heads"), args.pop("num_workers"), **args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@given(plan_cases())
def test_gpu_plan_equals_cpu_plan(case: PlanCase):
    cpu, gpu = case.plan("cpu"), case.plan("cuda")
    for name in ("work_items", "worker_indptr", "reduce_indptr", "reduce_final", "reduce_partial_map", "split_final"):
        assert getattr(gpu, name).is_cuda
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu())


@pytest.mark.parametrize("max_splits", [None, 1, 4])
def test_no_requests_give_a_plan_of_no_items(max_splits):
    """B = 0 (a serving step with no decode requests): every worker idle, no tiles, nothing to reduce, in every
    candidate's path; the emulator runs it to empty outputs, and it exports to aiter's layout."""
    none = torch.tensor([], dtype=torch.int32)
    plan = plan_decode(none, none, 16, 4, max_splits=max_splits)
    assert plan.num_items == 0 and plan.num_tiles == 0 and plan.split_tiles == 0 and plan.num_partial_rows == 0
    assert plan.worker_indptr.tolist() == [0] * 5 and plan.reduce_indptr.tolist() == [0]
    assert plan.work_items.shape == (0, 8) and plan.reduce_final.shape == (0, 8) and plan.max_pieces == 0
    assert plan.stats()["pieces_per_tile"] == {"mean": 0.0, "max": 0} and "0 requests" in plan.summary()
    assert plan.to_aiter()["work_info_set"].shape == (0, 8)
    assert plan_decode([], [], 16, 4).num_items == 0  # plain lists too


def test_lengths_beyond_int32_raise_instead_of_wrapping():
    """The plan is int32: a length of 2^31 wrapped to a negative one (found by a review)."""
    with pytest.raises(ValueError, match="< 2\\*\\*31"):
        plan_decode(torch.tensor([2**31 + 100]), torch.tensor([1]), 16, num_workers=4)
    with pytest.raises(ValueError, match="< 2\\*\\*31"):
        plan_decode(torch.tensor([5, 5]), torch.tensor([2**30, 2**30]), 16, num_workers=4)


# the source-mutation review of the planner (sixty-fourth session): each test fails on the edit it names (P..)


def items_per_tile(plan) -> torch.Tensor:
    """[T] items of each (request, head group) tile, counted from the work items themselves."""
    items = plan.work_items.long()
    G = plan.num_heads // plan.head_group
    tile = items[:, BATCH] * G + items[:, HEAD_START] // plan.head_group
    return torch.bincount(tile, minlength=plan.seq_lens.numel() * G)


def test_stats_counts_an_unsplit_tile_as_one_piece():
    """P02: stats()' pieces_per_tile mean counts an unsplit tile as one piece (reduce_indptr holds 0 for it); the
    worked example's line plan has tiles of 3, 2 and 1 pieces."""
    line = _line(torch.tensor([1000, 100, 0]), torch.ones(3, dtype=torch.long), 16, 4, 64, 5, None, 16)
    plan = _build(line, _cut(line, _line_cuts(line, None), split=True))
    pieces = items_per_tile(plan).double()
    s = plan.stats()
    assert s["pieces_per_tile"]["mean"] == float(pieces.mean())
    assert s["pieces_per_tile"]["max"] == int(pieces.max())


def test_to_aiter_refuses_exactly_2_to_the_31_pages():
    """P03: kv_indices positions run up to the batch's page count; 2^31 pages (two requests of 2^30 one-token pages)
    put a position at 2^31, which int32 wraps, so to_aiter must refuse it as it refuses 3 x 2^30."""
    plan = plan_decode(torch.tensor([2**30, 2**30]), torch.tensor([1, 1]), 16, 4)
    with pytest.raises(ValueError, match=r"2147483648 pages of 1 tokens do not fit aiter's int32"):
        plan.to_aiter(page_size=1)
    assert int(plan.to_aiter(page_size=2)["work_info_set"][:, 4:6].min()) >= 0  # 2^30 pages fit


def test_a_length_of_2_to_the_31_is_refused_by_the_length_check():
    """P35: seq_lens must be < 2^31; a length of exactly 2^31 is refused by the argument check (naming the limit),
    not only later by the int32 conversion of the plan."""
    with pytest.raises(ValueError, match=r"< 2\*\*31"):
        plan_decode(torch.tensor([2**31]), torch.tensor([1]), 16, num_workers=4)


@pytest.mark.parametrize("block_n", [16, 64, 128, 96])
def test_default_overhead_is_the_ceiling_of_320_tokens(block_n):
    """P36: fixed_overhead defaults to ceil(DEFAULT_OVERHEAD_TOKENS / block_n) blocks (plan_decode's docstring):
    128- and 96-token blocks get 3, not the floor 2."""
    plan = plan_decode(torch.tensor([1000]), torch.tensor([1]), 16, 4, block_n=block_n)
    assert plan.fixed_overhead == math.ceil(DEFAULT_OVERHEAD_TOKENS / block_n)


def test_an_empty_plan_is_not_paired():
    """P34: paired_splits promises every tile in exactly two pieces; a plan of no tiles has none (a 2-CTA cluster
    launch must not be chosen for it)."""
    none = torch.tensor([], dtype=torch.int32)
    assert not plan_decode(none, none, 16, 4).paired_splits


def test_an_even_plan_that_only_ties_the_line_plan_is_not_returned():
    """P10: of candidates with equal keys (busiest worker, partial rows) plan_decode returns the first of line,
    unsplit, even (its docstring). One tile of 3 blocks on 2 workers: the line cuts at block 2, the even plan at
    floor(3 / 2) = 1, both cost 2 with 2 partial rows. min_tail = 4 (the 64-token tail keeps every cut) makes
    plan_decode build the even candidate and compare its key, where the tie must go to the line."""
    seqs, workers = [192], 2
    line = _line(torch.tensor(seqs), torch.ones(1, dtype=torch.long), 16, workers, 64, 0, None, 16, 4)
    line_cut = _cut(line, _line_cuts(line, None), split=True)
    even_cut = _cut(line, _even_cuts(line, None)[0], split=True)
    assert line_cut.key == even_cut.key and not torch.equal(torch.from_numpy(line_cut.blk_start),
                                                            torch.from_numpy(even_cut.blk_start))  # a real tie
    plan = plan_decode(torch.tensor(seqs), torch.ones(1, dtype=torch.long), 16, workers, block_n=64,
                       fixed_overhead=0, min_tail=4)
    want = _build(line, line_cut)
    assert torch.equal(plan.work_items, want.work_items) and torch.equal(plan.worker_indptr, want.worker_indptr)


@pytest.mark.parametrize("blocks, max_splits, workers", [(9, 2, 8), (100, 3, 64), (17, 5, 132)])
def test_the_line_candidate_keeps_the_split_cap_bound(blocks, max_splits, workers):
    """P12: the line plan's stride is max(ceil(C / W), ceil((b_max - 1) / (m - 1))), so its busiest worker costs at
    most that plus OVH (module docstring), also when the returned plan is another candidate."""
    ovh = 0
    line = _line(torch.tensor([blocks * 64]), torch.tensor([1]), 16, workers, 64, ovh, max_splits, 16)
    plan = _build(line, _cut(line, _line_cuts(line, max_splits), split=True))
    C = blocks + ovh
    Q = max(ceil_div(C, workers), ceil_div(blocks - 1, max_splits - 1))
    assert int(plan.worker_costs().max()) <= Q + ovh
    assert int(items_per_tile(plan).max()) <= max_splits


@pytest.mark.parametrize("blocks, workers", [(11, 3), (29, 4), (100, 7), (5, 3)])
def test_the_even_candidate_cuts_near_equal_pieces(blocks, workers):
    """P21: the even plan cuts tile t into k_t pieces at block floor(j * blocks_t / k_t): piece lengths differ by at
    most one block, and the busiest costs ceil(blocks_t / k_t) + OVH, the closed form _even_cuts returns."""
    line = _line(torch.tensor([blocks * 64]), torch.tensor([1]), 16, workers, 64, 0, None, 16)
    cuts, cost, rows = _even_cuts(line, None)
    plan = _build(line, _cut(line, cuts, split=True))
    n = ((plan.work_items[:, KV_END] - plan.work_items[:, KV_START]).long() // 64)  # [N] blocks per piece
    assert int(n.max() - n.min()) <= 1 and int(n.sum()) == blocks
    assert int(plan.worker_costs().max()) == cost == ceil_div(blocks, plan.num_items)


@pytest.mark.parametrize("seq_len, workers", [(8 * 16 + 1, 5), (3 * 16 + 4, 4), (20 * 16 + 2, 7)])
def test_min_tail_moves_only_a_split_in_the_last_block(seq_len, workers):
    """P25 / P26: min_tail moves a split one block earlier only where it would leave the tile's last block alone with
    fewer than min_tail tokens; every other split point is the min_tail = 1 plan's. (Lengths: a tail of 1 with the
    last cut in the last block; a tail of exactly min_tail, which moves nothing; a tail of 2.)"""
    block_n, min_tail = 16, 4
    args = (torch.tensor([seq_len]), torch.tensor([1]), 16, workers)
    free = plan_decode(*args, block_n=block_n, fixed_overhead=0)
    held = plan_decode(*args, block_n=block_n, fixed_overhead=0, min_tail=min_tail)
    last_block = (ceil_div(seq_len, block_n) - 1) * block_n  # first token of the tile's last block
    tail = seq_len - last_block
    free_starts = set(free.work_items[:, KV_START].tolist())
    held_starts = set(held.work_items[:, KV_START].tolist())
    if tail >= min_tail:
        assert held_starts == free_starts
    else:
        assert held_starts - {last_block - block_n} == free_starts - {last_block}
    tokens = held.work_items[:, KV_END] - held.work_items[:, KV_START]
    assert int(tokens.min()) >= min_tail
