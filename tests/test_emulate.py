"""run_plan_reference against the fp64 oracle, within an a-priori rounding bound (numerics.md §5(g), derived below)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from planner_cases import PlanCase
from triton_cases import nan_masks_match, with_nan_token

from mla_fast import plan_decode, run_plan_reference
from mla_ref.decode import DecodeBatch, make_decode_batch, mla_decode_ref

U32 = 2.0**-24  # fp32 unit roundoff (round to nearest)
U64 = 2.0**-53  # fp64 unit roundoff
L, R = 512, 64  # kv_lora_rank, rope dim (DeepSeek-V3)
SM_SCALE = 0.1352338  # DeepSeek-V3 softmax scale, YaRN mscale² included


def gamma(n, u):
    """γ_n = n·u / (1 − n·u): relative error bound of an n-term sum or dot product, any order (Higham, Lemma 3.1)."""
    return n * u / (1 - n * u)


def split_merge_bound(A, smax, spread, vmax, N, S, D: int, u: float):
    """A-priori bound on |out − out_exact| and |lse − lse_exact| for one split-KV decode computed with unit roundoff u.

    Per (row, head), tensors: A = σ·max_j Σ_i |q_i||k_ji|, smax = max_j |s_j|, spread = max_j s_j − min_j s_j,
    vmax = max_{j,c} |v_jc| (visible tokens j), N = visible tokens, S = splits merged (1 = unsplit).
    Derivation (first order; each ε is a factor 1 + ε or e^{±ε}; numerics.md §3 and §5(b), (c), (g)):
      δ_s = γ_{D+1}·A       scores: a D-term dot product, then × σ. The emulation is then the exact split softmax of
                            the perturbed scores, whose output moves by ≤ tanh(ω/4)·R_c ≤ δ_s·vmax (ω ≤ 2δ_s,
                            R_c ≤ 2·vmax, §5(c)) and whose LSE moves by ≤ δ_s (§5(a)).
      η = u·spread + 2u     p_j = exp(fl(s_j − m)): the subtraction rounds |s_j − m| ≤ spread, exp is ≤ 1 ulp (2u);
                            weights perturbed by e^{±η} move the output by ≤ η·vmax (same tanh argument).
      e_O = η + 2γ_N + u    per-split output Σ p v / Σ p: numerator and denominator sums (γ_N each), the division (u).
      e_L = η + γ_N + 2u·ln N + u·Lmax
                            per-split lse = m + ln l: l to γ_N, log to 1 ulp of |ln l| ≤ ln N, the addition to u·|L_S|,
                            with Lmax = smax + ln N ≥ |L_S|, |L*|.
      merge (S ≥ 2), lse* = M + ln Σ_S exp(L_S − M), out = Σ_S exp(L_S − lse*)·O_S:
      ΔL* = e_L + 2u·Lmax + 2u + γ_S + 2u·ln S + u·(Lmax + ln S)
                            (LSE is 1-Lipschitz in the L_S; L_S − M rounds u·2Lmax; exp 2u; the sum γ_S; log 1 ulp of
                            ln S; M + log rounds u·|L*|)
      ζ = e_L + ΔL* + u·(2Lmax + ln S) + 2u
                            each weight exp(L_S − L*) is off by a factor e^{±ζ}: errors in L_S and L*, the subtraction,
                            the exp; output error (e^ζ − 1 + γ_S·e^ζ)·vmax ≤ (ζ + ζ² + γ_S·(1 + ζ + ζ²))·vmax.
      out: (δ_s + e_O + merge)·vmax;  lse: δ_s + e_L (S = 1) or δ_s + ΔL* (S ≥ 2)   [§5(g): ≈ (2γ + 4u|L|)·max|v|]
    Higher order: the first-order sum x stands for e^x − 1 ≤ x + x² (x ≤ 1), so both results are multiplied by (1 + x).
    """
    lnN, lnS = torch.log(N), torch.log(S)
    Lmax = smax + lnN
    delta_s = gamma(D + 1, u) * A
    eta = u * spread + 2 * u
    e_O = eta + 2 * gamma(N, u) + u
    e_L = eta + gamma(N, u) + 2 * u * lnN + u * Lmax
    dL = e_L + 2 * u * Lmax + 2 * u + gamma(S, u) + 2 * u * lnS + u * (Lmax + lnS)
    zeta = e_L + dL + u * (2 * Lmax + lnS) + 2 * u
    merge = zeta + zeta**2 + gamma(S, u) * (1 + zeta + zeta**2)
    split = S > 1
    out_rel = delta_s + e_O + torch.where(split, merge, 0.0)
    lse = delta_s + torch.where(split, dL, e_L)
    return vmax * out_rel * (1 + out_rel), lse * (1 + lse)


def row_statistics(batch: DecodeBatch):
    """fp64 per (row, head): A, smax, spread [T, H]; vmax, N [T, 1] over the visible tokens of each row."""
    T, H = batch.num_tokens, batch.num_heads
    q = batch.dequantized_q(torch.float64)  # [T, H, D]
    A, smax, spread = (torch.zeros(T, H, dtype=torch.float64) for _ in range(3))
    vmax = torch.zeros(T, 1, dtype=torch.float64)
    visible = batch.visible_tokens()  # [T]
    qo = batch.qo_indptr.tolist()
    for b in range(batch.batch_size):
        rows = slice(qo[b], qo[b + 1])
        K = batch.request_kv(b, torch.float64)  # [s, D]
        mask = torch.arange(K.shape[0])[None, :] < visible[rows, None]  # [n, s]
        if K.shape[0] == 0:
            continue
        s = SM_SCALE * torch.einsum("nhd,sd->nhs", q[rows], K)  # [n, H, s]
        a = SM_SCALE * torch.einsum("nhd,sd->nhs", q[rows].abs(), K.abs())  # [n, H, s]
        m = mask[:, None, :]  # [n, 1, s]
        A[rows] = a.masked_fill(~m, 0).amax(-1)
        smax[rows] = s.abs().masked_fill(~m, 0).amax(-1)
        spread[rows] = (s.masked_fill(~m, -math.inf).amax(-1) - s.masked_fill(~m, math.inf).amin(-1)).nan_to_num(0)
        vabs = K[:, :L].abs().amax(-1)  # [s]
        vmax[rows, 0] = torch.where(mask, vabs[None, :], 0).amax(-1)
    return A, smax, spread, vmax, visible.double()[:, None].clamp(min=1)


def splits_per_row_head(batch: DecodeBatch, plan) -> torch.Tensor:
    """[T, H] pieces merged for each (row, head): the reduce range of its tile, at least 1."""
    S = torch.ones(batch.num_tokens, batch.num_heads, dtype=torch.float64)
    n = torch.diff(plan.reduce_indptr.long())  # [tiles]
    for (qs, qe, hs, he), k in zip(plan.reduce_final[:, :4].long().tolist(), n.tolist()):
        S[qs:qe, hs:he] = max(1, k)
    return S


def check_against_oracle(batch: DecodeBatch, plan, dtypes=(torch.float32, torch.float64)) -> None:
    """Emulation in each dtype vs the fp64 oracle: |err| ≤ bound(u_dtype, S splits) + bound(u64, unsplit oracle).

    fp64 emulation makes the bound ~1e-12·vmax, so a dropped or doubled token cannot hide behind fp32's bound.
    """
    ref_out, ref_lse = mla_decode_ref(batch)
    empty = batch.visible_tokens() == 0  # [T] rows that see no token: exactly out 0, lse -inf
    seen = ~empty
    A, smax, spread, vmax, N = row_statistics(batch)
    S = splits_per_row_head(batch, plan)
    o_out, o_lse = split_merge_bound(A, smax, spread, vmax, N, torch.ones_like(S), batch.head_dim, U64)  # oracle's
    for dtype in dtypes:
        out, lse = run_plan_reference(batch, plan, dtype=dtype)
        assert out.dtype == dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
        assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())
        assert bool(torch.isfinite(out[seen]).all()) and bool(torch.isfinite(lse[seen]).all())  # no NaN slot read
        u = {torch.float32: U32, torch.float64: U64}[dtype]
        b_out, b_lse = split_merge_bound(A, smax, spread, vmax, N, S, batch.head_dim, u)
        err_out = (out.double() - ref_out).abs().amax(-1)  # [T, H]
        err_lse = (lse.double() - ref_lse).abs()  # [T, H]
        bound_out, bound_lse = b_out + o_out, b_lse + o_lse
        assert bool((err_out[seen] <= bound_out[seen]).all()), f"out {(err_out / bound_out).max():.3g}"
        assert bool((err_lse[seen] <= bound_lse[seen]).all()), f"lse {(err_lse / bound_lse).max():.3g}"


def build_batch(seq_lens, q_lens, num_heads, page_size, seed, scale=1.0, fp8_scale=None) -> DecodeBatch:
    """bf16 inputs (exact in fp32): q [T, H, L+R] and per-request rows [s, L+R], N(0, scale²) before rounding."""
    g = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(sum(q_lens), num_heads, L + R, generator=g)).bfloat16()  # [T, H, D]
    kv = [torch.randn(s, L + R, generator=g).bfloat16() for s in seq_lens]  # B x [s, D]
    extra = {}
    if fp8_scale is not None:  # power-of-two scales: dequantization is exact in fp32 as well
        q = (q.float() / fp8_scale).to(torch.float8_e4m3fn)
        kv = [(k.float() / fp8_scale).to(torch.float8_e4m3fn) for k in kv]
        extra = {"q_scale": fp8_scale, "kv_scale": fp8_scale}
    return make_decode_batch(
        q, kv, q_lens=list(q_lens), sm_scale=SM_SCALE, kv_lora_rank=L, page_size=page_size, generator=g, **extra
    )


@dataclass(frozen=True)
class EmuCase(PlanCase):  # the planner's arguments, then the batch's
    page_size: int
    scale: float
    seed: int


@st.composite
def emu_cases(draw) -> EmuCase:
    seqs = draw(st.lists(st.integers(0, 200), min_size=1, max_size=5))
    if draw(st.booleans()):
        seqs[draw(st.integers(0, len(seqs) - 1))] = draw(st.integers(400, 1000))  # one long request
    num_heads = draw(st.sampled_from([16, 128]))
    if num_heads == 128:
        seqs = seqs[:2]  # keep the fp64 oracle fast
    return EmuCase(
        seq_lens=tuple(seqs),
        q_lens=tuple(draw(st.lists(st.integers(1, 4), min_size=len(seqs), max_size=len(seqs)))),
        num_heads=num_heads,
        head_group=draw(st.sampled_from([h for h in (16, 32, 128) if num_heads % h == 0])),
        num_workers=draw(st.integers(1, 264)),
        block_n=draw(st.sampled_from([1, 16, 64])),
        fixed_overhead=draw(st.integers(0, 6)),
        max_splits=draw(st.one_of(st.none(), st.integers(1, 8))),
        page_size=draw(st.sampled_from([1, 16, 64])),
        scale=draw(st.sampled_from([0.1, 1.0, 4.0])),  # score std ≈ 0.3, 3, 13: flat to peaky softmax
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(emu_cases())
def test_emulation_matches_oracle(case: EmuCase):
    batch = build_batch(case.seq_lens, case.q_lens, case.num_heads, case.page_size, case.seed, case.scale)
    check_against_oracle(batch, case.plan())


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 64, 255, 256])
def test_one_request_split_across_every_worker(splits: int):
    batch = build_batch((16 * splits,), (2,), 16, 16, seed=splits)  # one block of 16 tokens per worker; MTP: 2 rows
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, splits, block_n=16, fixed_overhead=0)
    assert plan.num_items == splits and int(torch.diff(plan.worker_indptr).min()) == 1  # every worker has a piece
    check_against_oracle(batch, plan)


def test_empty_sequences_and_rows_that_see_nothing():
    # q_len 4 > seq_len 2: rows 0 and 1 see no token; split to one token per piece
    batch = build_batch((0, 2, 0, 5), (1, 4, 3, 2), 16, 1, seed=1)
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, 8, block_n=1, fixed_overhead=0)
    assert int(torch.diff(plan.reduce_indptr).max()) > 1
    check_against_oracle(batch, plan)


def test_fp8_inputs_with_power_of_two_scales():
    batch = build_batch((300, 17), (1, 3), 16, 16, seed=2, fp8_scale=2.0**-4)
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, 9, block_n=16, fixed_overhead=1, head_group=16)
    check_against_oracle(batch, plan)


@pytest.mark.parametrize("workers", [1, 4])
def test_a_nan_input_gives_nan_split_or_not(workers):
    """A NaN in one valid cache token makes out and lse NaN in the rows that read it, as mla_decode_ref gives them,
    whether the plan splits its request or not; the other request stays finite. (Until the thirty-ninth session the
    merge treated NaN partials as empty, as aiter's reduce does: a split request then came out finite and wrong.)"""
    batch = with_nan_token(build_batch((256, 40), (1, 1), 16, 16, seed=3), 0, 200, channel=7)
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, workers, block_n=16, fixed_overhead=0)
    assert (int(torch.diff(plan.reduce_indptr)[0]) > 1) == (workers > 1)  # request 0 split with 4 workers
    out, lse = run_plan_reference(batch, plan)
    ref_out, ref_lse = mla_decode_ref(batch)
    assert nan_masks_match(out, lse, ref_out, ref_lse)
    assert bool(torch.isnan(lse[0]).all()) and bool(torch.isfinite(out[1]).all())


def test_a_piece_no_worker_runs_shows_up_as_nan():
    """Items outside every worker's range are not run, and the merge does not take their unwritten (NaN) partials
    for empty ones: a plan that loses a piece gives NaN, not a finite answer short of its tokens."""
    batch = build_batch((256,), (1,), 16, 16, seed=5)
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, 4, block_n=16, fixed_overhead=0)
    assert plan.num_items == 4 and torch.equal(plan.worker_indptr, torch.arange(5, dtype=torch.int32))
    lost = replace(plan, worker_indptr=torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32))  # worker 3 runs nothing
    out, lse = run_plan_reference(batch, lost)
    assert bool(torch.isnan(out).all()) and bool(torch.isnan(lse).all())
    assert bool(torch.isfinite(run_plan_reference(batch, plan)[0]).all())


def test_plan_for_another_batch_is_rejected():
    batch = build_batch((10, 20), (1, 1), 16, 16, seed=4)
    plan = plan_decode(torch.tensor([10, 21]), batch.q_lens, 16, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        run_plan_reference(batch, plan)
    plan = plan_decode(batch.seq_lens, batch.q_lens, 32, 4)
    with pytest.raises(ValueError, match="num_heads"):
        run_plan_reference(batch, plan)
    # the same lengths and rows in all, another split of the rows: a stale plan gave finite outputs 0.86 off
    mtp = build_batch((10, 20), (1, 2), 16, 16, seed=4)
    with pytest.raises(ValueError, match=r"plan\.q_lens must equal the batch's q_lens \[1, 2\], got \[2, 1\]"):
        run_plan_reference(mtp, plan_decode(mtp.seq_lens, torch.tensor([2, 1]), 16, 4))


def test_bad_arguments_name_the_field():
    """Found by a review: an int or fp8 dtype failed inside torch, check_plan given lists raised TypeError, a
    non-plan AttributeError, round_p a string p_scale TypeError."""
    from mla_fast.planner import check_plan
    from mla_ref.fp8 import round_p

    batch = build_batch((10, 20), (1, 1), 16, 16, seed=4)
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, 4)
    for dtype in (torch.int32, torch.float8_e4m3fn, torch.bfloat16):
        with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.float64"):
            run_plan_reference(batch, plan, dtype)
    check_plan(plan, [10, 20], [1, 1], 16)  # lists are lengths too
    with pytest.raises(ValueError, match=r"plan\.seq_lens must equal"):
        check_plan(plan, [10, 21], [1, 1], 16)
    with pytest.raises(ValueError, match="plan must be a WorkPlan"):
        check_plan(None, batch.seq_lens, batch.q_lens, 16)
    with pytest.raises(ValueError, match="p_scale must be a float"):
        round_p(torch.ones(2), "bf16", p_scale="2")


def test_a_nan_partial_does_not_leak_into_another_requests_merge():
    """The merge pads each tile's pieces to the most pieces of any tile, and the padding reads some workspace row
    (request 0's first piece here): masked as empty, so a NaN in request 0's first piece leaves request 1, split in
    fewer pieces, finite (a review's mutant removed the mask and no test noticed)."""
    batch = with_nan_token(build_batch((256, 100), (1, 1), 16, 16, seed=3), 0, 5, channel=7)  # in piece 0
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, 6, block_n=16, fixed_overhead=0)
    assert torch.diff(plan.reduce_indptr).tolist() == [4, 2]  # both split, request 1 in fewer pieces
    out, lse = run_plan_reference(batch, plan)
    assert bool(torch.isnan(lse[0]).all()) and bool(torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all())


@pytest.mark.parametrize("workers", [1, 3])
def test_a_nan_first_token_of_the_longest_item_stays_in_its_rows(workers):
    """Items of a chunk are padded to its longest one by re-reading that item's first token with the padding zeroed
    (`run_plan_reference`); a NaN there stays in the rows that read it, as in the oracle, and does not reach the
    shorter items of other requests through 0 x NaN in P V. (A source-mutation review's unzeroed padding passed
    this file and failed only the 40 s emulated property test.)"""
    batch = with_nan_token(build_batch((256, 40, 7), (1, 2, 1), 16, 16, seed=3), 0, 0)
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, workers, block_n=16, fixed_overhead=0)
    out, lse = run_plan_reference(batch, plan)
    ref_out, ref_lse = mla_decode_ref(batch)
    assert nan_masks_match(out, lse, ref_out, ref_lse)
    assert bool(torch.isnan(lse[0]).all()) and bool(torch.isfinite(out[1:]).all())


def test_a_split_row_whose_lse_overflows_fp32_exp_is_merged_after_the_max_shift():
    """The reduce merges pieces by exp(lse_s - M) with M the row's largest piece lse: scores of about 200 give every
    (row, head) an lse past ln(fp32 max) = 88.7, so a merge of exp(lse_s) overflows to inf and its lse and weights
    turn inf / NaN (a review's edit that only the 40 s emulated property test failed)."""
    batch = build_batch((300, 70), (1, 2), 16, 16, seed=7, scale=20.0)  # score std about 0.135 x 20 x 24 = 65
    ref_lse = mla_decode_ref(batch)[1]  # [T, H]
    assert float(ref_lse.min()) > math.log(torch.finfo(torch.float32).max)
    plan = plan_decode(batch.seq_lens, batch.q_lens, 16, 8, block_n=16, fixed_overhead=0)
    assert int(torch.diff(plan.reduce_indptr).min()) > 1  # every row merges pieces
    check_against_oracle(batch, plan)
