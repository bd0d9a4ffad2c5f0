"""The padding probe (verify/padding_probe.py) and the ``padding`` check (verify.checks.check_padding): what the
probe writes and where, the scores its tokens reach, its linear program against a closed-form optimum, and that a
max taken over the loaded slots before the length mask fails it alone while a kernel that masks first gives the
bits of its run on the NaN padding."""

import math

import pytest
import torch

from mla_ref.decode import is_fp8, mla_decode_ref
from mla_ref.fp8 import fp8_format
from verify import mutants
from verify.cases import Case
from verify.checks import run_case
from verify.kernels import from_callable
from verify.padding_probe import LP_ROWS, MARGIN, bounded_token, hostile_tokens, padding_probe

COMBOS = {"bf16": dict(), "fp8kv": dict(kv_dtype="fp8"), "fp8": dict(kv_dtype="fp8", q_dtype="fp8"),
          "fp8kv_fnuz": dict(kv_dtype="fp8", fp8_format="e4m3fnuz")}


def _case(combo: str, **kw) -> Case:
    """By default an empty request, MTP rows, a full last page (64 tokens on pages of 16) and partial ones."""
    fields = dict(seq_lens=(0, 37, 64, 130, 3), q_lens=(1, 2, 1, 3, 4), heads=4, page_size=16) | kw
    return Case(**fields, **COMBOS[combo])


def _free_slots(batch) -> list[tuple[int, int, torch.Tensor]]:
    """(request, its last page, [ps] bool: that page's slots past its length) of every request with some."""
    ps, found = batch.page_size, []
    for b, s in enumerate(batch.seq_lens.tolist()):
        if s % ps:
            free = torch.arange(ps) >= s % ps  # [ps]
            found.append((b, int(batch.block_table[b, (s - 1) // ps]), free))
    return found


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_probe_writes_only_the_unused_slots_and_two_added_pages(combo):
    """The probe's page p + 1 is the case's page p, but for the free slots of each request's last page; pages 0 and
    P + 1 are new and finite (where a tile past the last page may read); the block table's used entries move up by
    one, its unused ones stay as built; q, the lengths and the scales are the case's."""
    batch = _case(combo).materialize()[0]
    probe = padding_probe(batch, mla_decode_ref(batch)[1])
    pb, P = probe.batch, batch.num_pages
    for name in ("q", "seq_lens", "q_lens"):
        assert getattr(pb, name) is getattr(batch, name), name
    assert (pb.q_scale, pb.kv_scale, pb.sm_scale) == (batch.q_scale, batch.kv_scale, batch.sm_scale)
    used = batch.used_entries  # [B, W]
    assert torch.equal(pb.block_table[used], batch.block_table[used] + 1)
    assert torch.equal(pb.block_table[~used], batch.block_table[~used])
    assert pb.kv_cache.shape[0] == P + 2 and torch.isfinite(pb.kv_cache[[0, P + 1]].float()).all()
    written = torch.zeros(batch.kv_cache.shape[:2], dtype=torch.bool)  # [P, ps] in the case's page ids
    for _, page, free in _free_slots(batch):
        written[page] |= free
    assert probe.slots == int(written.sum()) == 11 + 14 + 13  # the requests of 37, 130 and 3 tokens
    moved = pb.kv_cache[1 : P + 1]  # [P, ps, D] the case's pages in the probe
    same = moved.view(torch.uint8).view(*written.shape, -1) == batch.kv_cache.view(torch.uint8).view(
        *written.shape, -1)  # [P, ps, D * bytes]
    assert same[~written].all()  # every other byte as built: the tokens and the NaN of the spare pages
    assert torch.isfinite(moved[written].float()).all()
    assert torch.isnan(batch.kv_cache[written].float()).all()  # where the case had its NaN


def test_bf16_tokens_reach_the_margin_up_to_their_rounding():
    """In bf16 each row's group token (one or two rows per group here) is the minimum-norm solution, exact before
    rounding: the row's score of it is lse + MARGIN within the rounding of the token to bf16,
    at most 2^-8 |σ q_d k_d| per channel (one bf16 unit roundoff of each k_d, products and sums in fp64)."""
    batch = _case("bf16").materialize()[0]
    lse = mla_decode_ref(batch)[1]  # [T, H]
    probe = padding_probe(batch, lse)
    q, qo = batch.dequantized_q(), batch.qo_indptr.tolist()  # [T, H, D]
    slack = 0.0  # the largest rounding allowance of a row
    for b, page, free in _free_slots(batch):
        slots = free.nonzero()[:, 0]  # [f]
        rows = batch.sm_scale * q[qo[b] : qo[b + 1]].reshape(-1, q.shape[-1])  # [m, D]
        lse_rows = lse[qo[b] : qo[b + 1]].reshape(-1)  # [m]
        G = min(len(slots), rows.shape[0])  # groups: rows r = g mod G share slot g's token
        for r in range(rows.shape[0]):
            k = probe.batch.kv_cache[page + 1, slots[r % G]].double()  # [D] row r's group token
            target = (lse_rows[r] if torch.isfinite(lse_rows[r]) else 0.0) + MARGIN
            rounding = 2**-8 * float(rows[r].abs() @ k.abs())  # 2 x bf16's unit roundoff 2^-9 on each k_d
            assert abs(float(rows[r] @ k) - target) <= rounding
            slack = max(slack, rounding)
    assert probe.margin >= MARGIN - slack and probe.unprobed == 0  # the reported smallest margin, rounded tokens


def test_one_row_in_closed_form_and_the_linear_program_reach_the_same_optimum():
    """One row a, |k_d| <= c: the largest score is c |a|_1 (k = c sign(a)). The closed form (one row) returns it
    while it is below lse + MARGIN and stops at lse + MARGIN beyond; the linear program, given the row twice,
    reaches the same optimum below MARGIN and at least MARGIN beyond."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 576, generator=g, dtype=torch.float64) * 0.1  # [1, D]
    lse = torch.tensor([3.0], dtype=torch.float64)
    fp64_sum = 576 * 2**-53  # relative rounding of a 576-term fp64 dot product
    solver = 1e-7  # HiGHS's default primal feasibility tolerance
    for c in (0.5, 100.0):  # |a|_1 is about 46: c |a|_1 - 3 about 20, then past MARGIN
        one = bounded_token(a, lse, c)  # [D] closed form
        two = bounded_token(a.repeat(2, 1), lse.repeat(2), c)  # [D] linear program
        assert float(one.abs().max()) <= c and float(two.abs().max()) <= c + solver
        best = c * float(a.abs().sum())
        if best - 3.0 < MARGIN:
            assert float(a[0] @ one) - 3.0 == pytest.approx(best - 3.0, rel=fp64_sum)
            assert float(a[0] @ two) - 3.0 == pytest.approx(best - 3.0, abs=solver * float(a.abs().sum()))
        else:
            assert float(a[0] @ one) - 3.0 == pytest.approx(MARGIN, rel=fp64_sum)
            assert float(a[0] @ two) - 3.0 >= MARGIN - solver * float(a.abs().sum())


@pytest.mark.parametrize("combo", ["fp8kv", "fp8", "fp8kv_fnuz"])
def test_fp8_tokens_stay_in_the_format_and_deal_the_rows_into_groups(combo):
    """fp8: every written code is finite, within the format's max, and with more rows than free slots (128 heads)
    each slot holds its group's token: as many distinct tokens as slots, and the reported margin is what they
    reach."""
    batch = _case(combo, seq_lens=(37,), q_lens=(2,), heads=128).materialize()[0]
    lse = mla_decode_ref(batch)[1]  # [T, H]
    probe = padding_probe(batch, lse)
    ((_, page, free),) = _free_slots(batch)
    codes = probe.batch.kv_cache[page + 1, free].float()  # [f, D]
    assert torch.isfinite(codes).all() and float(codes.abs().max()) <= fp8_format(batch.kv_cache.dtype).max
    assert len({tuple(row.tolist()) for row in codes}) == 11  # 256 (row, head)s in 11 groups, one per free slot
    k = codes.double() * batch.kv_scale  # [f, D]
    scores = batch.sm_scale * batch.dequantized_q().reshape(-1, 576) @ k.T  # [256, f]
    size = batch.sm_scale * batch.dequantized_q().reshape(-1, 576).abs() @ k.abs().T  # [256, f] σ Σ|q||k|
    fp64_dots = 2 * 576 * 2**-53 * float(size.max())  # two fp64 evaluations of one 576-term dot product
    assert probe.margin == pytest.approx(float((scores.amax(dim=1) - lse.reshape(-1)).min()), abs=fp64_dots)


def test_an_fp8_group_of_more_rows_solves_its_program_over_its_first_lp_rows():
    """fp8: a group of more than LP_ROWS (row, head)s (one free slot, 3 x 128 of them) takes the token of the linear
    program over its first LP_ROWS rows, bit for bit (one over all 384 rows gives another token; over the 512 rows
    of each of the long cases' 132 MTP requests such programs took 178 s)."""
    batch = _case("fp8kv", seq_lens=(63,), q_lens=(3,), heads=128).materialize()[0]
    lse = mla_decode_ref(batch)[1].reshape(-1)  # [384]
    scores = batch.sm_scale * batch.dequantized_q().reshape(-1, 576)  # [384, D]
    assert scores.shape[0] > LP_ROWS
    bound = fp8_format(batch.kv_cache.dtype).max * batch.kv_scale
    token = hostile_tokens(scores, lse, 1, batch)  # [1, D] codes
    first = hostile_tokens(scores[:LP_ROWS], lse[:LP_ROWS], 1, batch)  # [1, D] codes
    assert torch.equal(token.view(torch.uint8), first.view(torch.uint8))
    assert not torch.equal(bounded_token(scores[:LP_ROWS], lse[:LP_ROWS], bound), bounded_token(scores, lse, bound))


def test_no_fp8_smoke_case_has_a_group_past_lp_rows(monkeypatch):
    """The cap changes no program of the smoke prefix: every group of every fp8 smoke case, on its requests' last
    pages and on the added edge pages, has at most LP_ROWS rows (the largest, 144, is the 128-head case of 9 MTP
    rows; a cap of 64 cut it, and 121 of its 1792 rows lost their hostile token: found by a review)."""
    from verify import padding_probe as probe_module
    from verify.strategies import smoke_cases

    sizes = []

    def record(scores, lse, bound):  # the group's rows, without solving its program
        sizes.append(scores.shape[0])
        return torch.zeros(scores.shape[1], dtype=torch.float64)

    monkeypatch.setattr(probe_module, "LP_ROWS", 10**9)
    monkeypatch.setattr(probe_module, "bounded_token", record)
    for case in smoke_cases("fp8"):
        batch = case.materialize()[0]
        if is_fp8(batch.kv_cache.dtype):
            padding_probe(batch, torch.zeros(batch.num_tokens, batch.num_heads, dtype=torch.float64))
    assert 64 < max(sizes) <= LP_ROWS, max(sizes)


def test_full_last_pages_are_probed_through_the_added_pages_and_no_tokens_skips_it():
    """Every last page full (pages of 16, lengths 16 and 64): no slot to write, but the added pages 0 and last hold
    a token for each request's first row, for a tile that reads past its last page; a batch whose requests have no
    tokens has nothing to probe (padding.skipped)."""
    batch = _case("bf16", seq_lens=(0, 16, 64), q_lens=(1, 1, 2)).materialize()[0]
    probe = padding_probe(batch, mla_decode_ref(batch)[1])
    assert probe.slots == 0 and probe.rows == 0 and "no unused last-page slot" in probe.describe()
    assert torch.isfinite(probe.batch.kv_cache[[0, -1]].float()).all()
    result = run_case(_case("bf16", seq_lens=(0, 16, 64), q_lens=(1, 1, 2)), from_callable(mutants.correct))
    assert result.ok and "padding" in {c.name for c in result.checks}
    empty = _case("bf16", seq_lens=(0, 0), q_lens=(1, 2)).materialize()[0]
    assert padding_probe(empty, mla_decode_ref(empty)[1]) == "no request with tokens and query rows"
    result = run_case(_case("bf16", seq_lens=(0, 0), q_lens=(1, 2)), from_callable(mutants.correct))
    assert result.ok and "padding.skipped" in {c.name for c in result.checks}


@pytest.mark.parametrize("combo", ["bf16", "fp8"])
def test_a_max_over_the_padding_fails_the_padding_check_alone(combo):
    """The NaN padding hides a tile max taken over the last page's unused slots (NaN-blind, as GPU max
    instructions are): with one query row per request nothing else is masked, so only the padding check sees it;
    a kernel that masks first gives the bits of its run on the NaN padding."""
    case = _case(combo, q_lens=(1,) * 5)
    result = run_case(case, from_callable(mutants.max_before_mask))
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"padding"}, result.describe()
    assert "the slots past each request's length changed the result" in failed["padding"]
    right = run_case(case, from_callable(mutants.correct))
    detail = {c.name: c.detail for c in right.checks}["padding"]
    assert right.ok and detail.endswith("the bits of the run on the NaN-padded cache"), right.describe()
    assert math.isfinite(float(detail.split("at least ")[1].split(" ")[0]))


def test_a_tile_past_the_last_page_reads_the_added_page_0():
    """Pages of 16 under 64-token tiles: the request of 32 tokens fills its last page (no free slot), but its tile
    spans two more block-table entries, which a kernel with masked loads reads as page 0. The probe's page 0 holds
    hostile tokens, so a tile max over those slots moves that request's rows too; a kernel that masks first keeps
    its bits there."""
    case = _case("bf16", seq_lens=(32, 37), q_lens=(1, 1))
    batch = case.materialize()[0]
    probe = padding_probe(batch, mla_decode_ref(batch)[1]).batch
    for kernel, moves in ((mutants.max_before_mask, True), (mutants.correct, False)):
        before, after = kernel(batch)[0][0], kernel(probe)[0][0]  # [H, L] request 0's row
        assert torch.equal(before.view(torch.int16), after.view(torch.int16)) != moves, kernel.__name__


@pytest.mark.parametrize("seq_lens, page_size, read", [((32, 37), 16, "block-table entries past a request's last page"),
                                                       ((40, 37), 64, "the unused slots of a request's last page")])
def test_a_failed_padding_check_names_which_read_moved_the_kernel(seq_lens, page_size, read):
    """A failed padding check runs the kernel once more on the probe's edge pages alone (the last pages' unused
    slots left NaN) and says which read it saw: max_before_mask's 64-token tile spans the block-table entries past
    a full last page of 16 tokens (read as page 0: the edge pages alone move it), while on pages of 64 its tile ends
    with the request's one page (the edge pages alone keep its bits: the last page's unused slots)."""
    case = _case("bf16", seq_lens=seq_lens, q_lens=(1, 1), page_size=page_size)
    batch = case.materialize()[0]
    edges = padding_probe(batch, mla_decode_ref(batch)[1], last_pages=False)
    assert edges.slots == 0 and torch.isnan(edges.batch.kv_cache[1:-1].float()).sum() == torch.isnan(
        batch.kv_cache.float()).sum()  # only the two edge pages added: the case's NaN slots all kept
    result = run_case(case, from_callable(mutants.max_before_mask))
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert "padding" in failed and f"the kernel reads {read}" in failed["padding"], result.describe()


@pytest.mark.parametrize("seq_lens, q_lens", [((0, 37, 64, 130, 3), (1, 2, 1, 3, 4)), ((32, 37), (1, 1)),
                                               ((37, 32), (1, 1))])
def test_the_added_pages_probe_every_row_of_every_request(seq_lens, q_lens):
    """Pages 0 and last: the k requests share the slots in turn, ceil(16 / k) each, their rows dealt over their
    share as on a last page. With 4 heads and at most 4 rows a request here, every (row, head) that sees a token
    has a group token of its own there, scoring lse + MARGIN up to its bf16 rounding (2^-8 |σ q_d k_d| per channel,
    as in test_bf16_tokens_reach_the_margin_up_to_their_rounding): the full last page's request (64 tokens) and the
    later of two requests too. Before, the edge pages took the requests' last-page tokens in turn, a full page's
    request one token for its first (row, head): that request's other heads reached 4-13 nats above their lse."""
    batch = _case("bf16", seq_lens=seq_lens, q_lens=q_lens).materialize()[0]
    lse = mla_decode_ref(batch)[1]  # [T, H]
    probe = padding_probe(batch, lse)
    scores = batch.sm_scale * batch.dequantized_q()  # [T, H, D]
    seen = torch.isfinite(lse)  # [T, H]
    for page in (0, batch.num_pages + 1):
        k = probe.batch.kv_cache[page].double()  # [ps, D]
        rounding = 2**-8 * (scores.abs() @ k.abs().T)  # [T, H, ps] 2 x bf16's unit roundoff 2^-9 on each k_d
        reached = (scores @ k.T - lse[..., None] >= MARGIN - rounding).any(dim=-1)  # [T, H]
        assert reached[seen].all(), (page, (~reached & seen).nonzero().tolist())
