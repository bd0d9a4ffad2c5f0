"""mla_decode_ref against an independently written dense softmax, merge_partials, and DecodeBatch validation."""

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from mla_ref.decode import (
    INVALID_PAGE,
    DecodeBatch,
    _decode_grid,
    by_bucket,
    make_decode_batch,
    merge_partials,
    mla_decode_ref,
)
from verify.bounds import merge_bound, oracle_bound


def assert_fp64_agree(batch, got, want, rows=slice(None), extra=None) -> None:
    """Two fp64 evaluations of the decode formula on ``batch`` (out, lse) agree elementwise within twice
    ``verify.bounds.oracle_bound`` (each is within it of the exact value; numerics.md §5(f) with fp64 constants),
    plus ``extra`` (a merge's own bound): on ``rows`` of the batch's query rows, -inf lse at the same places."""
    bound = oracle_bound(batch)
    out_b, lse_b = 2 * bound.out[rows], 2 * bound.lse[rows]  # [t, H, L], [t, H]
    if extra is not None:
        out_b, lse_b = out_b + extra.out[rows], lse_b + extra.lse[rows]
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    seen = torch.isfinite(want[1])  # [t, H] rows that see a token
    err_out, err_lse = (got[0] - want[0]).abs(), (got[1][seen] - want[1][seen]).abs()  # [t, H, L], [n]
    assert (err_out <= out_b).all(), f"out: err / bound {(err_out / out_b).nan_to_num(posinf=math.inf).max():.3g}"
    assert (err_lse <= lse_b[seen]).all(), f"lse: err / bound {(err_lse / lse_b[seen]).max():.3g}"


@dataclass(frozen=True)
class DenseCase:
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    heads: int
    page_size: int
    L: int
    R: int
    seed: int


def dense_inputs(case: DenseCase, dtype=torch.float64):
    g = torch.Generator().manual_seed(case.seed)
    D = case.L + case.R
    q = torch.randn(sum(case.q_lens), case.heads, D, generator=g, dtype=dtype)  # [T, H, D]
    kvs = [torch.randn(s, D, generator=g, dtype=dtype) for s in case.seq_lens]  # B x [s_b, D]
    return q, kvs, g


def dense_softmax_reference(q, kvs, q_lens, sm_scale, L):
    """Row by row with torch.softmax/logsumexp on the dense per-request rows: written independently of the oracle."""
    out = torch.zeros(q.shape[0], q.shape[1], L, dtype=q.dtype)  # [T, H, L]
    lse = torch.full(q.shape[:2], -math.inf, dtype=q.dtype)  # [T, H]
    row = 0
    for kv, n in zip(kvs, q_lens):
        s_len = kv.shape[0]
        for r in range(n):
            visible = max(0, s_len - n + r + 1)
            if visible:
                logits = sm_scale * q[row] @ kv[:visible].T  # [H, visible]
                lse[row] = torch.logsumexp(logits, dim=-1)
                out[row] = torch.softmax(logits, dim=-1) @ kv[:visible, :L]  # [H, L]
            row += 1
    return out, lse


@st.composite
def dense_cases(draw):
    B = draw(st.integers(1, 4))
    seq_lens = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 15, 16, 17, 63, 64, 65, 130]), min_size=B, max_size=B)))
    q_lens = tuple(draw(st.lists(st.integers(1, 4), min_size=B, max_size=B)))
    return DenseCase(
        seq_lens, q_lens, draw(st.sampled_from([1, 3, 16])), draw(st.sampled_from([1, 3, 16, 64])),
        L=32, R=16, seed=draw(st.integers(0, 2**31 - 1)),
    )


def build(case: DenseCase):
    q, kvs, g = dense_inputs(case)
    batch = make_decode_batch(q, kvs, q_lens=list(case.q_lens), sm_scale=0.3, kv_lora_rank=case.L,
                              page_size=case.page_size, generator=g)
    return batch, q, kvs


@given(dense_cases())
def test_ref_matches_dense_softmax(case):
    batch, q, kvs = build(case)
    assert torch.isnan(batch.kv_cache).any(), "unused slots must be NaN-poisoned"
    out, lse = mla_decode_ref(batch)
    out_d, lse_d = dense_softmax_reference(q, kvs, case.q_lens, 0.3, case.L)
    assert torch.isfinite(out).all(), "NaN padding leaked into the output"
    assert_fp64_agree(batch, (out, lse), (out_d, lse_d))


@given(dense_cases(), st.data())
def test_a_nan_latent_value_reaches_only_the_rows_that_see_its_token(case, data):
    """One NaN latent value of a drawn token: NaN out and lse on the rows that see that token (the dense reference
    reads only those), every other row as without it, and rows that see no token out 0, lse -inf. A P.V matmul over
    the request's tokens gave 0 x NaN = NaN to the rows that the causal mask hides the token from."""
    assume(sum(case.seq_lens))
    q, kvs, g = dense_inputs(case)
    clean_batch = make_decode_batch(q, kvs, q_lens=list(case.q_lens), sm_scale=0.3, kv_lora_rank=case.L,
                                    page_size=case.page_size, generator=torch.Generator().set_state(g.get_state()))
    kvs = [kv.clone() for kv in kvs]
    b = data.draw(st.sampled_from([i for i, s in enumerate(case.seq_lens) if s]), label="request")
    s, n = case.seq_lens[b], case.q_lens[b]
    # any token, or one of the newest n, which the causal mask hides from the request's earlier rows (a review's
    # mutants that gave those rows the NaN passed 25 uniform draws)
    token = data.draw(st.integers(0, s - 1) | st.integers(max(0, s - n), s - 1), label="token")
    kvs[b][token, data.draw(st.integers(0, case.L - 1), label="channel")] = math.nan
    batch = make_decode_batch(q, kvs, q_lens=list(case.q_lens), sm_scale=0.3, kv_lora_rank=case.L,
                              page_size=case.page_size, generator=g)
    out, lse = mla_decode_ref(batch)
    out_d, lse_d = dense_softmax_reference(q, kvs, case.q_lens, 0.3, case.L)
    reads = torch.isnan(lse_d)  # [T, H] the rows that see the token (every head)
    assert reads.any(), "the request's last row sees every token"
    assert torch.equal(torch.isnan(lse), reads) and torch.equal(torch.isnan(out).all(dim=-1), reads)
    clean = ~reads.any(dim=-1)  # [T]
    assert not torch.isnan(out[clean]).any()
    # the bound of the batch without the NaN (the poisoned one's is NaN): these rows never read it
    assert_fp64_agree(clean_batch, (out[clean], lse[clean]), (out_d[clean], lse_d[clean]), rows=clean)


def test_real_dims_and_empty_rows():
    case = DenseCase(seq_lens=(0, 1, 200, 3), q_lens=(1, 2, 4, 4), heads=16, page_size=64, L=512, R=64, seed=7)
    batch, q, kvs = build(case)
    out, lse = mla_decode_ref(batch)
    out_d, lse_d = dense_softmax_reference(q, kvs, case.q_lens, 0.3, case.L)
    assert_fp64_agree(batch, (out, lse), (out_d, lse_d))
    # empty sequence, and the first row of the length-1 request with q_len 2 (sees 1 - 2 + 0 + 1 = 0 tokens)
    for row in (0, 1):
        assert torch.isneginf(lse[row]).all() and (out[row] == 0).all()
    # q_len 4 over 3 tokens: rows see 0, 1, 2, 3 tokens
    assert torch.isneginf(lse[-4]).all() and torch.isfinite(lse[-3:]).all()


def test_visible_tokens_is_what_each_row_sees():
    """max(0, s - n + r + 1) for row r of a request of n rows over s tokens: a row past the tokens sees 0, never a
    negative count (the verifier tells empty rows by visible_tokens() == 0)."""
    batch, _, _ = build(DenseCase(seq_lens=(1, 0, 5), q_lens=(3, 2, 3), heads=1, page_size=4, L=32, R=16, seed=0))
    assert batch.visible_tokens().tolist() == [0, 0, 1, 0, 0, 3, 4, 5]  # s - n + r + 1 = -1 on two rows


def test_rows_whose_scores_all_lie_near_minus_1000_are_finite():
    """Scores of -1000 + O(1e-3): exp underflows in fp64 unless shifted by the row max (a max clamped at 0 gives
    0 / 0); the dense reference (torch.softmax / logsumexp shift internally) is finite with lse near -1000."""
    case = DenseCase(seq_lens=(7, 20), q_lens=(1, 1), heads=2, page_size=4, L=32, R=16, seed=5)
    q, kvs, g = dense_inputs(case)
    kvs = [kv * 0.01 for kv in kvs]  # [s, D] each
    for kv in kvs:
        kv[:, 0] = 1.0  # channel 0 of every key is 1 ...
    q[..., 0] = -1000.0 / 0.3  # ... so sm_scale q_0 k_0 = -1000 in every score
    batch = make_decode_batch(q, kvs, sm_scale=0.3, kv_lora_rank=32, page_size=4, generator=g)
    out, lse = mla_decode_ref(batch)
    assert torch.isfinite(out).all() and (lse < -900).all()
    assert_fp64_agree(batch, (out, lse), dense_softmax_reference(q, kvs, case.q_lens, 0.3, case.L))


def test_an_inf_value_with_weight_0_gives_nan_where_the_dense_reference_does():
    """kv[1, 5] = +inf with q[..., 5] = -1 on request 0's rows: that token's score is -inf, its weight 0, and
    0 x inf = NaN in channel 5 of every row that sees it, as in the dense softmax @ V (a NaN out means a NaN or inf
    in a valid input), and nowhere else."""
    case = DenseCase(seq_lens=(4, 1), q_lens=(3, 2), heads=2, page_size=2, L=32, R=16, seed=9)
    q, kvs, g = dense_inputs(case)
    q[:3, :, 5] = -1.0  # [3, H] request 0's rows
    kvs[0][1, 5] = math.inf
    batch = make_decode_batch(q, kvs, q_lens=list(case.q_lens), sm_scale=0.3, kv_lora_rank=32, page_size=2,
                              generator=g)
    out, lse = mla_decode_ref(batch)
    out_d, lse_d = dense_softmax_reference(q, kvs, case.q_lens, 0.3, case.L)
    assert torch.isnan(out_d[:3, :, 5]).all() and not torch.isnan(lse_d).any()  # the fact the test rests on
    assert torch.equal(torch.isnan(out), torch.isnan(out_d)) and torch.equal(torch.isnan(lse), torch.isnan(lse_d))


def test_the_fp64_agreement_bound_is_tight_enough_to_see_a_small_relative_bug():
    """assert_fp64_agree's bound (2 x oracle_bound) at the real dims is ~1e-11 absolute: a relative error of 1e-12 on
    every output (a gain of 1 + 1e-12) already fails it; the dense reference itself sits far inside."""
    case = DenseCase(seq_lens=(0, 1, 200, 3), q_lens=(1, 2, 4, 4), heads=16, page_size=64, L=512, R=64, seed=7)
    batch, q, kvs = build(case)
    out, lse = mla_decode_ref(batch)
    dense = dense_softmax_reference(q, kvs, case.q_lens, 0.3, case.L)
    assert_fp64_agree(batch, (out, lse), dense)
    with pytest.raises(AssertionError, match="out: err / bound"):
        assert_fp64_agree(batch, (out * (1 + 1e-12), lse), dense)


def test_length_buckets_partition_the_batch_and_equal_one_grid():
    """Very different lengths go in several buckets (DecodeBatch.buckets): every request and query row in exactly
    one, each bucket's padded work <= 1.25 x its true work, and the bucketed oracle equals one padded grid (waste =
    inf: a single bucket, the whole batch) and the dense reference."""
    case = DenseCase(seq_lens=(600, 17, 0, 3, 600, 1, 40), q_lens=(1, 2, 1, 4, 3, 2, 1), heads=2, page_size=16,
                     L=32, R=16, seed=3)
    batch, q, kvs = build(case)
    buckets = batch.buckets()
    assert len(buckets) >= 3 and not any(b.whole for b in buckets)
    assert sorted(torch.cat([b.requests for b in buckets]).tolist()) == list(range(batch.batch_size))
    assert sorted(torch.cat([b.rows for b in buckets]).tolist()) == list(range(batch.num_tokens))
    for b in buckets:
        s, n = b.batch.seq_lens.tolist(), b.batch.q_lens.tolist()
        assert s == batch.seq_lens[b.requests].tolist() and torch.equal(b.batch.q, batch.q[b.rows])
        assert len(s) * max(s) * max(n) <= 1.25 * sum(max(si * ni, 1) for si, ni in zip(s, n))
    one = batch.buckets(waste=math.inf)
    assert len(one) == 1 and one[0].whole and one[0].batch is batch
    out, lse = mla_decode_ref(batch)  # bucketed
    out_1, lse_1 = by_bucket(one, lambda b: _decode_grid(b.batch, b.grid, torch.float64))  # one grid
    assert_fp64_agree(batch, (out, lse), (out_1, lse_1))
    assert_fp64_agree(batch, (out, lse), dense_softmax_reference(q, kvs, case.q_lens, 0.3, case.L))


@dataclass(frozen=True)
class SplitCase:
    """A dense case cut into num_splits pieces per request (cut points drawn from the case's seed + 1)."""

    dense: DenseCase
    num_splits: int


@given(st.builds(SplitCase, dense_cases(), st.integers(1, 8)))
def test_merge_partials_of_random_partition_equals_whole(split):
    case, num_splits = split.dense, split.num_splits
    batch, q, kvs = build(case)
    out, lse = mla_decode_ref(batch)
    merge = merge_bound(batch, num_splits, accum=torch.float64)  # the fp64 merge's own rounding (§5(g))
    g = torch.Generator().manual_seed(case.seed + 1)
    row = 0
    for kv, n in zip(kvs, case.q_lens):
        cuts = sorted(torch.randint(0, kv.shape[0] + 1, (num_splits - 1,), generator=g).tolist())
        bounds = [0, *cuts, kv.shape[0]]
        parts_o, parts_l = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):  # each split as its own request over tokens [a, b)
            for r in range(n):
                visible = max(0, kv.shape[0] - n + r + 1)
                lo, hi = a, min(b, visible)
                o_r = torch.zeros(q.shape[1], case.L, dtype=q.dtype)
                l_r = torch.full((q.shape[1],), -math.inf, dtype=q.dtype)
                if hi > lo:
                    logits = 0.3 * q[row + r] @ kv[lo:hi].T  # [H, hi-lo]
                    l_r = torch.logsumexp(logits, -1)
                    o_r = torch.softmax(logits, -1) @ kv[lo:hi, : case.L]
                parts_o.append(o_r)
                parts_l.append(l_r)
        o_s = torch.stack(parts_o).view(len(bounds) - 1, n, q.shape[1], case.L)  # [S, n, H, L]
        l_s = torch.stack(parts_l).view(len(bounds) - 1, n, q.shape[1])  # [S, n, H]
        o_m, l_m = merge_partials(o_s, l_s)
        rows = slice(row, row + n)
        assert_fp64_agree(batch, (o_m, l_m), (out[rows], lse[rows]), rows, merge)
        row += n


def test_merge_of_all_empty_is_zero_and_neg_inf():
    o, l = merge_partials(torch.full((3, 2, 4), float("nan")), torch.full((3, 2), -math.inf))
    assert (o == 0).all() and torch.isneginf(l).all()


def test_merge_propagates_a_nan_split_whose_weight_underflows():
    """A split that saw tokens but holds NaN makes the merge NaN even where its weight exp(lse - L) underflows to 0
    (it was dropped: out finite, as if the NaN input were never read; found by a review). An empty split (lse -inf)
    is still ignored, NaN out or not."""
    outs = torch.tensor([[[1.0, 2.0]], [[float("nan"), 0.0]], [[float("nan"), float("nan")]]])  # [S=3, 1, L=2]
    lses = torch.tensor([[0.0], [-1000.0], [-math.inf]])  # [3, 1]: split 1's weight e^-1000 underflows
    o, l = merge_partials(outs, lses)
    assert torch.isnan(o[0, 0]) and o[0, 1] == 2.0 and l[0] == 0.0


@pytest.mark.parametrize("outs, lses, match", [
    (torch.zeros(2, 3, 4), torch.zeros(2, 1), "outs must be"),  # lses would broadcast
    (torch.zeros(0, 3, 4), torch.zeros(0, 3), "outs must be"),  # no split
    (torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3), "outs must be a floating tensor"),
    (torch.zeros(2, 3, 4), [0.0, 0.0], "lses must be a floating tensor"),
    (torch.zeros(2, 3, 4), torch.tensor([[0.0] * 3, [math.inf] * 3]), "lses must be finite or -inf"),  # a review:
    # it gave NaN
])
def test_merge_partials_refuses_bad_shapes(outs, lses, match):
    with pytest.raises(ValueError, match=match):
        merge_partials(outs, lses)


@pytest.mark.parametrize("change, match", [
    (dict(generator=None), "generator: expected a torch.Generator"),  # the global RNG: an irreproducible page order
    (dict(page_size=2.5), "page_size: expected an int >= 1"), (dict(page_size=True), "page_size: expected an int"),
    (dict(extra_pages=-1), "extra_pages: expected an int >= 0"),
    (dict(q=[[1.0]]), "q: expected a tensor"), (dict(kv=[torch.zeros(3, 2, 8)]), r"kv_per_request\[0\]: expected"),
])  # a review's: each raised TypeError, RuntimeError or AttributeError, or (generator None) passed
def test_make_decode_batch_names_the_bad_argument(change, match):
    g = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(1, 1, 8, generator=g), kv=[torch.randn(3, 8, generator=g)], page_size=2, generator=g,
                extra_pages=1)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        make_decode_batch(args.pop("q"), args.pop("kv"), sm_scale=0.1, kv_lora_rank=4, **args)


@pytest.mark.parametrize("q_lens", [[1.9, 1.9], torch.tensor([2**32 + 1, -(2**32) + 1]), [True, 1], [0, 2]])
def test_make_decode_batch_refuses_q_lens_that_int32_would_change(q_lens):
    """Floats were truncated and int64 values wrapped by the int32 cast, and the result then validated (a review's:
    [1.9, 1.9] and [2^32 + 1, -2^32 + 1] both became [1, 1])."""
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 1, 8, generator=g), [torch.randn(3, 8, generator=g)] * 2
    with pytest.raises(ValueError, match=r"q_lens: expected ints in \[1, 2\^31\)"):
        make_decode_batch(q, kv, sm_scale=0.1, kv_lora_rank=4, page_size=2, q_lens=q_lens, generator=g)


def test_fp8_inputs_are_dequantized_with_their_scales():
    case = DenseCase(seq_lens=(5, 9), q_lens=(1, 2), heads=2, page_size=4, L=32, R=16, seed=3)
    q, kvs, g = dense_inputs(case)
    q8, kv8 = q.to(torch.float8_e4m3fn), [kv.to(torch.float8_e4m3fn) for kv in kvs]
    batch = make_decode_batch(q8, kv8, q_lens=list(case.q_lens), sm_scale=0.3, kv_lora_rank=32, page_size=4,
                              generator=g, q_scale=0.5, kv_scale=0.25)
    out, lse = mla_decode_ref(batch)
    out_d, lse_d = dense_softmax_reference(q8.double() * 0.5, [kv.double() * 0.25 for kv in kv8], case.q_lens, 0.3, 32)
    assert_fp64_agree(batch, (out, lse), (out_d, lse_d))
    # the views the verifier reads: an fp8 code times a power of two is exact in fp64, so equal
    q_deq, cache = batch.dequantized()  # [T, H, D], [P, ps, D]
    pages, slots, _ = batch.token_addresses()  # [N] each
    assert torch.equal(q_deq, q8.double() * 0.5)
    assert torch.equal(cache[pages, slots], torch.cat(kv8).double() * 0.25)
    assert all(torch.equal(batch.request_kv(b), kv.double() * 0.25) for b, kv in enumerate(kv8))


def test_make_decode_batch_scatters_the_pages():
    """The random page order makes a kernel that ignores the block table (reads pages in logical order) fail; 12
    pages in logical order would hide it."""
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(s, 8, generator=g) for s in (20, 28)]  # 5 + 7 pages of 4
    batch = make_decode_batch(torch.randn(2, 1, 8, generator=g), kv, sm_scale=0.1, kv_lora_rank=4, page_size=4,
                              generator=g)
    used = batch.block_table[batch.used_entries]  # [12] the physical page of each logical page, in logical order
    assert len(set(used.tolist())) == 12 and used.tolist() != sorted(used.tolist())  # 12 distinct, not ascending


def test_converters_describe_the_same_pages():
    case = DenseCase(seq_lens=(0, 5, 17), q_lens=(1, 1, 1), heads=2, page_size=4, L=32, R=16, seed=5)
    batch, _, _ = build(case)
    a = batch.to_aiter()
    assert a["kv_indptr"].tolist() == [0, 0, 2, 7]
    assert a["kv_last_page_lens"].tolist() == [4, 1, 1]  # empty: a page, as aiter reads (0 pages - 1) x 4 + 4 = 0
    assert a["kv_indices"].tolist() == batch.block_table[1, :2].tolist() + batch.block_table[2, :5].tolist()
    fi = batch.to_flashinfer()
    assert torch.equal(torch.cat([fi["q_nope"], fi["q_pe"]], -1), batch.q)
    fm = batch.to_flashmla()
    assert fm["q"].shape == (3, 1, 2, 48) and fm["k_cache"].shape[2] == 1


# ---- validation: each error names its field -------------------------------------------------------------------
def good_batch():
    batch, _, _ = build(DenseCase(seq_lens=(3, 5), q_lens=(1, 2), heads=2, page_size=4, L=32, R=16, seed=1))
    return batch


@pytest.mark.parametrize(
    "field, change",
    [
        ("q", lambda b: {"q": b.q[0]}),  # wrong rank
        ("q", lambda b: {"q": b.q.to(torch.int32)}),  # wrong dtype
        ("kv_cache", lambda b: {"kv_cache": b.kv_cache[..., :-1]}),  # q/kv width mismatch
        ("kv_cache", lambda b: {"kv_cache": b.kv_cache[0]}),  # wrong rank
        ("kv_lora_rank", lambda b: {"kv_lora_rank": 0}),
        ("kv_lora_rank", lambda b: {"kv_lora_rank": 49}),
        ("block_table", lambda b: {"block_table": b.block_table.long()}),  # non-int32 indices
        ("seq_lens", lambda b: {"seq_lens": b.seq_lens.long()}),
        ("seq_lens", lambda b: {"seq_lens": b.seq_lens[0]}),  # 0-d
        ("q_lens", lambda b: {"q_lens": b.q_lens.long()}),
        ("block_table", lambda b: {"block_table": torch.full_like(b.block_table, b.kv_cache.shape[0])}),  # outside
        ("block_table", lambda b: {"block_table": b.block_table[:1]}),  # wrong row count
        ("seq_lens", lambda b: {"seq_lens": torch.tensor([3, 9], dtype=torch.int32)}),  # beyond capacity 2 x 4
        ("seq_lens", lambda b: {"seq_lens": torch.tensor([-1, 5], dtype=torch.int32)}),
        ("q_lens", lambda b: {"q_lens": torch.tensor([1, 1], dtype=torch.int32)}),  # do not add up to T = 3
        ("q_lens", lambda b: {"q_lens": torch.tensor([0, 3], dtype=torch.int32)}),
        ("q_lens", lambda b: {"q_lens": torch.tensor([3], dtype=torch.int32)}),  # wrong shape
        ("q_lens", lambda b: {"q_lens": b.q_lens[:, None]}),  # [B, 1]: B elements, not [B] (a review's)
        ("sm_scale", lambda b: {"sm_scale": float("nan")}),  # non-finite
        ("sm_scale", lambda b: {"sm_scale": float("inf")}),
        ("sm_scale", lambda b: {"sm_scale": -1.0}),
        ("q_scale", lambda b: {"q": b.q.to(torch.float8_e4m3fn),  # fp8 input without its scale
                               "kv_cache": b.kv_cache.to(torch.float8_e4m3fn), "kv_scale": 1.0}),
        ("sm_scale", lambda b: {"sm_scale": "0.1"}),  # a string, named as one ("got '0.1'", not "got 0.1")
        ("kv_scale", lambda b: {"kv_cache": b.kv_cache.to(torch.float8_e4m3fn)}),
        ("kv_scale", lambda b: {"kv_cache": b.kv_cache.to(torch.float8_e4m3fn), "kv_scale": float("nan")}),
        ("q_scale", lambda b: {"q_scale": 2.0}),  # a scale on a non-fp8 input is ambiguous
        # found by a review: values fine as python floats that the kernels' fp32 scale overflows or flushes
        ("sm_scale", lambda b: {"sm_scale": 1e39}),
        ("sm_scale", lambda b: {"sm_scale": True}),
        ("sm_scale", lambda b: {"sm_scale": 3e38}),  # fits fp32 (max 3.4e38), x log2(e) = 4.3e38 does not
        ("kv_scale", lambda b: {"kv_cache": b.kv_cache.to(torch.float8_e4m3fn), "kv_scale": 1e39}),
        ("kv_scale", lambda b: {"kv_cache": b.kv_cache.to(torch.float8_e4m3fn), "kv_scale": 1e-46}),
        ("sm_scale", lambda b: {"q": b.q.to(torch.float8_e4m3fn), "q_scale": 1e20,  # product above fp32's max
                                "kv_cache": b.kv_cache.to(torch.float8_e4m3fn), "kv_scale": 1e20}),
        ("q", lambda b: {"q": b.q[:, :0]}),  # no heads
        ("kv_lora_rank", lambda b: {"kv_lora_rank": True}),
        ("kv_cache", lambda b: {"kv_cache": b.kv_cache.to(torch.int32)}),  # wrong dtype
        ("kv_cache", lambda b: {"kv_cache": b.kv_cache[:, :0]}),  # pages of 0 tokens
        ("seq_lens", lambda b: {"seq_lens": b.seq_lens.to("meta")}),  # another device than q's
        ("kv_cache", lambda b: {"kv_cache": b.kv_cache.to("meta")}),
    ],
)
def test_validation_names_the_field(field, change):
    bad = good_batch().replace(**change(good_batch()))
    with pytest.raises(ValueError, match=rf"DecodeBatch\.{field}:"):
        bad.validate()
    with pytest.raises(ValueError, match=rf"DecodeBatch\.{field}:"):
        mla_decode_ref(bad)


def test_flashmla_layout_needs_uniform_q_lens():
    batch = good_batch()
    assert len(set(batch.q_lens.tolist())) > 1
    with pytest.raises(ValueError, match=r"DecodeBatch\.q_lens: expected uniform"):
        batch.to_flashmla()


@pytest.mark.parametrize("dtype", [torch.int32, "float64", torch.float8_e4m3fn, None])
def test_the_oracle_names_a_bad_dtype(dtype):
    """mla_decode_ref's dtype must be a torch floating dtype wide enough to compute in: an int dtype raised
    "expected scalar type Float", a string "Invalid device string" (found by a review)."""
    with pytest.raises(ValueError, match=r"mla_decode_ref\.dtype: expected"):
        mla_decode_ref(good_batch(), dtype)


def test_pages_per_request_does_not_wrap_int32():
    """ceil(seq_len / page_size) in int64: seq_len 2^31 - 1 on pages of 64 gave -33554432 pages in int32, and
    validate() then passed a block table of out-of-range ids (found by a review)."""
    batch = good_batch().replace(seq_lens=torch.tensor([2**31 - 1, 5], dtype=torch.int32))
    assert batch.pages_per_request.tolist() == [-(-(2**31 - 1) // 4), 2]
    with pytest.raises(ValueError, match=r"DecodeBatch\.seq_lens:"):
        batch.validate()


def test_unused_block_table_entries_may_hold_garbage():
    batch = good_batch()
    assert (batch.block_table == INVALID_PAGE).any()  # request 0 uses 1 of 2 pages
    batch.validate()


def test_good_batch_validates_and_defaults_q_lens():
    batch = good_batch()
    b2 = DecodeBatch(batch.q[:2], batch.kv_cache, batch.block_table, batch.seq_lens, sm_scale=1.0, kv_lora_rank=32)
    assert b2.q_lens.tolist() == [1, 1] and b2.validate() is b2


def test_a_batch_is_frozen_so_a_kernel_cannot_rebind_its_fields():
    """A kernel handed the verifier's DecodeBatch cannot rebind a field (its tensors' bytes are the inputs check's
    business): a plug-in that tries fails its case by name, where a rebound seq_lens used to surface later as a
    verifier error inside the bound. replace() makes another batch."""
    import dataclasses

    from verify import mutants
    from verify.checks import run_case
    from verify.kernels import from_callable
    from verify.strategies import smoke_cases

    batch = good_batch()
    with pytest.raises(dataclasses.FrozenInstanceError, match="seq_lens"):
        batch.seq_lens = batch.seq_lens.long()
    assert batch.replace(sm_scale=0.5).sm_scale == 0.5 and batch.sm_scale != 0.5

    def rebinds(batch):
        batch.seq_lens = batch.seq_lens.long()
        return mutants.correct(batch)

    result = run_case(smoke_cases("bf16")[1], from_callable(rebinds), "cpu")
    failed = {c.name: c.detail for c in result.checks if not c.ok}
    assert set(failed) == {"contract"} and "cannot assign to field 'seq_lens'" in failed["contract"], failed


@pytest.mark.parametrize("seq_lens", [(40, 0, 70, 1), (0, 0), (5,)])
def test_token_addresses_are_every_requests_token_slots_in_order(seq_lens):
    """DecodeBatch.token_addresses (flat, every request at once) gives request b's token_slots, in request order,
    with each token's position; the rows it addresses are the valid cache rows (no NaN padding among them)."""
    from mla_ref.decode import make_decode_batch

    g = torch.Generator().manual_seed(3)
    kv = [torch.randn(s, 24, generator=g).bfloat16() for s in seq_lens]  # B x [s_b, D]
    batch = make_decode_batch(torch.randn(len(seq_lens), 2, 24, generator=g).bfloat16(), kv, sm_scale=0.1,
                              kv_lora_rank=16, page_size=16, generator=g)
    pages, slots, positions = batch.token_addresses()  # [N] each
    per_request = [batch.token_slots(b) for b in range(batch.batch_size)]
    assert torch.equal(pages, torch.cat([p for p, _ in per_request]))
    assert torch.equal(slots, torch.cat([s for _, s in per_request]))
    assert torch.equal(positions, torch.cat([torch.arange(s) for s in seq_lens]))
    assert torch.equal(batch.kv_cache[pages, slots], torch.cat(kv))  # the rows make_decode_batch wrote


def test_a_scale_given_as_a_string_is_named_as_one():
    """sm_scale="0.1" is refused as "got '0.1'": the message had read "got 0.1", a number (found by a review)."""
    with pytest.raises(ValueError, match=r"DecodeBatch\.sm_scale: .*, got '0\.1'$"):
        good_batch().replace(sm_scale="0.1").validate()


def test_the_demo_takes_help_without_running():
    """`python -m mla_ref --help` prints its usage and exits 0 before any computation (it had run the demo), an
    unknown argument is a usage error (2), and no argument runs the demo: both tables."""
    import contextlib
    import io

    from mla_ref.__main__ import main

    for argv, code in ((["--help"], 0), (["--bogus"], 2)):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == code and "usage: python -m mla_ref" in out.getvalue() + err.getvalue()
        assert "MLA oracle" not in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([])
    assert "MLA oracle" in out.getvalue() and "fp8 round trip" in out.getvalue()
