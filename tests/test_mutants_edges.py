"""Edges of verify.mutants found by a mutation review: each planted bug is the one its docstring names (not another
that the default campaign happens to catch too), the registry lists every mutant, and the graph-capturable step
refuses what its contract refuses. Each test runs the mutants' decode on one small batch (no campaign)."""

import inspect

import pytest
import torch
from triton_cases import same_bits

from verify import mutants
from verify.cases import Case
from verify.checks import nan_probe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(**kw):
    return Case(**{"heads": 2, "num_workers": 4, **kw}).materialize("cpu")[0]


def test_the_registry_lists_every_mutant_and_its_groups_lie_in_it():
    """Every public function of verify.mutants that takes a batch, but ``correct``, is in MUTANTS (the campaign
    test parametrizes over it: one left out is never tested), and the FP8 / FAR / LONG / CUDA groups are in it."""
    fns = {n for n, f in vars(mutants).items() if inspect.isfunction(f) and f.__module__ == mutants.__name__
           and not n.startswith("_") and list(inspect.signature(f).parameters) == ["batch"]}
    assert fns - {"correct"} == set(mutants.MUTANTS) and len(mutants.MUTANTS) == len(set(mutants.MUTANTS))
    assert set(mutants.FP8_ONLY + mutants.FAR_ONLY + mutants.LONG_ONLY + mutants.CUDA_ONLY) <= set(mutants.MUTANTS)


def test_the_correct_kernel_and_the_invariance_mutants_declare_batch_invariance():
    """correct declares itself batch-invariant, so the batch check asks it for its bits (the false-alarm side of
    the bit comparison the three invariance mutants fail); an undeclared correct kernel passes that check within
    the tier-1 bound instead, with a detail that also reads "bits of the case's run"."""
    from verify.kernels import from_callable

    for name in ("correct", "splits_follow_batch", "splits_follow_longest", "tiles_follow_q_len"):
        assert from_callable(getattr(mutants, name)).batch_invariant, name


def test_each_scale_mutant_drops_its_own_scale_only():
    """q_scale_ignored drops q's scale: right with bf16 q beside a scaled fp8 cache, wrong with fp8 q beside a unit
    cache scale; kv_scale_ignored the other way round."""
    bf16_q = _batch(seq_lens=(70,), q_lens=(1,), kv_dtype="fp8", scale_mode="static", seed=3)
    fp8_q = _batch(seq_lens=(70,), q_lens=(1,), kv_dtype="fp8", q_dtype="fp8", scale_mode="kv_unit", seed=3)
    assert float(bf16_q.kv_scale) != 1 and float(fp8_q.kv_scale) == 1 and float(fp8_q.q_scale) != 1
    for batch, q_wrong in ((bf16_q, False), (fp8_q, True)):
        right = mutants.correct(batch)
        assert same_bits(mutants.q_scale_ignored(batch), right) != q_wrong
        assert same_bits(mutants.kv_scale_ignored(batch), right) == q_wrong


def test_full_tile_fast_path_drops_the_mask_on_every_whole_number_of_tiles():
    """Lengths of 1, 2 and 3 whole 64-token tiles all take the unmasked path: each request's first MTP row differs
    from the correct kernel's (it sees the newer token), its last row does not."""
    batch = _batch(seq_lens=(64, 128, 192, 100), q_lens=(2, 2, 2, 2), seed=4)
    (bad, _), (right, _) = mutants.full_tile_fast_path(batch), mutants.correct(batch)
    for b in range(3):
        first, last = 2 * b, 2 * b + 1
        assert not torch.equal(bad[first], right[first]) and torch.equal(bad[last], right[last]), b
    assert torch.equal(bad[6:], right[6:])  # 100 tokens: no whole number of tiles, masked


def test_head0_max_takes_head_0s_max_for_every_head():
    """Head 0 keeps its own max, so its bits are the correct kernel's; a head shifted 120 nats against it is not."""
    batch = _batch(seq_lens=(100,), q_lens=(1,), heads=8, dist="heads", seed=20)
    (bad, bad_lse), (right, right_lse) = mutants.head0_max(batch), mutants.correct(batch)
    assert torch.equal(bad[:, 0], right[:, 0]) and torch.equal(bad_lse[:, 0], right_lse[:, 0])
    assert not same_bits((bad, bad_lse), (right, right_lse))


@pytest.mark.parametrize(("kv", "fmt", "q"), [("fp16", "e4m3fn", "fp16"), ("fp8", "e4m3fnuz", "fp8"),
                                              ("fp8", "e5m2", "bf16")])
def test_dtype_unchecked_misreads_each_format_it_was_not_built_for(kv, fmt, q):
    """fp16, e4m3fnuz and e5m2 inputs are each read as another format's bits (the smoke prefix's other-input cases;
    the property test passes them to it together, so one of them alone kept its failure)."""
    batch = _batch(seq_lens=(65,), q_lens=(1,), kv_dtype=kv, fp8_format=fmt, q_dtype=q, seed=22)
    assert not same_bits(mutants.dtype_unchecked(batch), mutants.correct(batch))


def test_reduce_pad_weight0_reads_the_first_requests_first_split_partial():
    """The padding slots read the first request's first split partial (of tokens 0-63): a NaN in its first token
    spreads to the request of one split, also where the first request has several splits (the smoke case's first
    request with tokens has one, whose first partial is also its last)."""
    batch = _batch(seq_lens=(300, 5), q_lens=(1, 1), seed=5)
    nan_batch, expected, _ = nan_probe(batch, "first")
    assert expected[0].all() and not expected[1].any()  # request 0's row reads the NaN, request 1's does not
    out, lse = mutants.reduce_pad_weight0(nan_batch)
    assert torch.isnan(out[1]).all() and not torch.isnan(lse[1]).any()  # 0 x NaN on out only
    assert not torch.isnan(mutants.correct(nan_batch)[0][1]).any()


def test_the_step_refuses_another_batch_and_q_lens_past_its_max():
    """plan() takes the step's own batch only (refilled in place), and q_lens up to the step's max_q_len."""
    batch = _batch(seq_lens=(5, 9), q_lens=(1, 2), seed=6)
    step = mutants.correct.step(batch, 2)
    step.plan(batch)  # q_len 2 == max_q_len: planned
    with pytest.raises(ValueError, match="batch must be the step's own"):
        step.plan(batch.replace(seq_lens=batch.seq_lens.clone()))
    with pytest.raises(ValueError, match="q_lens must be <= the step's max_q_len 1"):
        mutants.correct.step(batch, 1).plan(batch)


def test_eager_fast_path_keeps_the_lengths_it_planned_not_the_last_ones():
    """Its fast path keys on the lengths it planned: one decode step later it reads the planned lengths (the new
    token unread), two steps later the request has grown past its q_len from them, so it replans and is right."""
    batch = _batch(seq_lens=(100,), q_lens=(1,), seed=7)
    page = int(batch.block_table[0, 1])  # tokens 64-127: 100 and 101 unused (NaN), made finite copies of 64-65
    batch.kv_cache[page, 36:38] = batch.kv_cache[page, 0:2]
    mutants._FAST_PLANS.clear()
    try:
        assert same_bits(mutants.eager_fast_path(batch), mutants.correct(batch))  # planned at 100 tokens
        before = mutants.correct(batch)
        batch.seq_lens.add_(1)  # one decode step, in place (the same addresses)
        assert same_bits(mutants.eager_fast_path(batch), before) and not same_bits(before, mutants.correct(batch))
        batch.seq_lens.add_(1)  # grown by 2 > q_len from the planned 100: replanned
        assert same_bits(mutants.eager_fast_path(batch), mutants.correct(batch))
    finally:
        mutants._FAST_PLANS.clear()


def test_p_rounded_bf16_rounds_p_for_p_v_only():
    """P rounded to bf16 for P.V while the row sum takes the unrounded P: on a request whose 64 tokens all carry one
    value vector v (any consistent weighting gives v), token 0's score above the 63 others' by d gives them the
    weight exp(-d), rounded by about 2^-9: out = v (1 + 63 r) / (1 + 63 p), one bf16 ulp off v. A kernel that rounds
    the row sum's P too (consistent) gives v, as the correct kernel does."""
    from mla_ref.fp8 import round_p

    batch = _batch(seq_lens=(64,), q_lens=(1,), heads=1, seed=8)
    L, page = batch.kv_lora_rank, int(batch.block_table[0, 0])
    batch.q.zero_()
    batch.q[..., L] = 1.0  # scores from the first rope channel alone
    batch.kv_cache[page] = 0.0
    batch.kv_cache[page, :, :L] = 0.75  # v, exact in bf16
    x = 5.09375  # exact in bf16: token 0's score sigma x, the others' 0
    batch.kv_cache[page, 0, L] = x
    p = torch.exp(torch.tensor(-batch.sm_scale * x, dtype=torch.float32))  # the 63 others' weight
    assert abs(float(round_p(p, "bf16") - p)) > 2**-10  # rounded by more than a quarter bf16 ulp of [0.5, 1)
    (bad, _), (right, _) = mutants.p_rounded_bf16(batch), mutants.correct(batch)
    assert torch.equal(right, torch.full_like(right, 0.75)) and not torch.equal(bad, right)


def test_out_gain_is_a_gain_of_two_bf16_ulps_that_a_cosine_check_misses():
    """out_gain scales out by 1 + 2^-7 (one to two bf16 ulps, relative): the least-squares gain of its out over the
    correct kernel's is that, within the bf16 roundings (which average out), while the cosine distance stays under
    vLLM's fp8 threshold of 1e-4. A smaller gain (half an ulp, say) is no longer the bias the docstring plants."""
    batch = _batch(seq_lens=(300, 65), q_lens=(1, 2), heads=4, seed=9)
    bad, right = mutants.out_gain(batch)[0].double().flatten(), mutants.correct(batch)[0].double().flatten()
    gain = float(bad @ right / (right @ right))
    assert abs(gain - (1 + 2**-7)) < 2**-10  # an eighth of the planted 2^-7: the roundings average far below it
    assert 1 - float(torch.nn.functional.cosine_similarity(bad, right, dim=0)) < 1e-4  # vLLM's fp8 cos-diff bound


def _on_one_first_page(seq_lens, rows):
    """A batch of requests of ``seq_lens`` on pages of 64 whose block-table rows are rewritten: ``rows[b]`` lists,
    for each of request b's pages, the request whose built page it takes (same index), so rows can share pages."""
    batch = _batch(seq_lens=seq_lens, q_lens=(1,) * len(seq_lens), page_size=64, seed=30)
    table = batch.block_table.clone()  # [B, W]
    for b, row in enumerate(rows):
        for j, src in enumerate(row):
            batch.block_table[b, j] = table[src, j]
    return batch


def test_prefix_by_first_page_takes_every_full_page_up_to_the_shorters():
    """Two requests of two full pages that share only their first: the later one reads the first one's second page
    too (every full page up to the shorter's length taken as shared), where the correct kernel reads its own."""
    batch = _on_one_first_page((128, 128), [(0, 0), (0, 1)])
    (bad, _), (right, _) = mutants.prefix_by_first_page(batch), mutants.correct(batch)
    assert torch.equal(bad[0], right[0]) and not torch.equal(bad[1], right[1])


def test_prefix_first_pair_applies_the_first_pairs_run_to_a_group_of_three():
    """Three requests on one first page, the first two sharing both full pages, the third only the first: the third
    reads the first one's second page (the group's prefix sized by its first pair)."""
    batch = _on_one_first_page((128, 128, 128), [(0, 0), (0, 0), (0, 2)])
    (bad, _), (right, _) = mutants.prefix_first_pair(batch), mutants.correct(batch)
    assert torch.equal(bad[:2], right[:2]) and not torch.equal(bad[2], right[2])


def test_bf16_accumulation_keeps_fp32s_exponent_range():
    """Its accumulators are bf16 (8 significant bits, fp32's exponent range), not fp16: value channels scaled by
    2^17, past fp16's largest finite 65504, scale its out by 2^17 exactly (every rounding moves with a power of
    two); an fp16 accumulator overflows there."""
    batch = _batch(seq_lens=(128,), q_lens=(1,), heads=2, seed=31)
    L = batch.kv_lora_rank
    batch.q[..., :L] = 0  # scores from the rope channels alone: unchanged by scaling the latent ones
    out = mutants.bf16_accumulation(batch)[0]
    batch.kv_cache[..., :L] *= 2**17
    assert torch.equal(mutants.bf16_accumulation(batch)[0], out * 2**17)
