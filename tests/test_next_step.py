"""Untested before a mutation review (sixty-fifth session):
verify/next_step.py (source mutants that tests/test_step_check.py, test_rerun_check.py and
the rest missed).

- next_layout rotates the q_lens with the block-table rows and lengths (mutant: q_lens left in place passed: no test
  looked at them, and a step that keeps the q_lens it was planned with went unchallenged).
- with_room's first spare page is the first page after the case's own, and the steps take the spare pages in order
  from it (mutant: first_spare one page late passed).
- with_room leaves room for the next step and the decode step after it also where every request's growth needs
  a new page (mutant: one request's worth of decode-step pages fewer passed; decode_layout then raised on a lone
  empty request on pages of 1).
- next_values writes standard-normal draws of its seeded generator, fp8 quantized with the batch's kv_scale (mutant:
  quantized with scale 1, i.e. new tokens kv_scale times too small, passed).
- used_slots marks exactly the slots of every request's tokens.
"""

import pytest
import torch

from mla_ref.decode import mla_decode_ref
from mla_ref.fp8 import fp8_format
from verify.cases import Case
from verify.next_step import (
    decode_layout,
    decode_values,
    next_layout,
    next_lengths,
    next_values,
    used_slots,
    with_room,
)


def _slot_set(batch) -> set[tuple[int, int]]:
    """The (page, slot) pairs holding some request's tokens, from DecodeBatch.token_slots."""
    return {(int(p), int(s)) for b in range(batch.batch_size) for p, s in zip(*batch.token_slots(b))}


def test_next_layout_rotates_q_lens_with_the_rows_and_lengths():
    """Request i of the next step is request i-1 of the old one: its q_len, its block-table row (but for the grown
    request's new pages past its old ones) and the length next_lengths gives; q's rows are not moved."""
    batch, _ = Case(seq_lens=(40, 70, 9, 33), q_lens=(1, 2, 3, 4), heads=2, page_size=16, kv_lora_rank=64,
                    rope_dim=32, seed=7).materialize()
    static, first_spare = with_room(batch)
    q_lens, table, seq = static.q_lens.clone(), static.block_table.clone(), static.seq_lens.clone()
    next_layout(static, first_spare)
    lens, grown = next_lengths(seq, static.page_size)
    assert static.q_lens.tolist() == q_lens.roll(1).tolist() == [4, 1, 2, 3]
    assert torch.equal(static.seq_lens, lens) and static.validate() is static
    rotated = table.roll(1, dims=0)  # [B, W']
    for b in range(static.batch_size):
        kept = -(-int(seq.roll(1)[b]) // static.page_size) if b == grown else int(static.pages_per_request[b])
        assert torch.equal(static.block_table[b, :kept], rotated[b, :kept]), b


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_steps_take_the_spare_pages_in_order_from_the_first_after_the_cases(dtype):
    """with_room's first spare page is the case's page count; next_layout gives the grown request the spare pages
    from it on, and decode_layout the ones after those, each request's in request order."""
    # next step: lengths [2 x 126 + 17, 126 // 2] with q_lens [2, 3]: the decode step takes a page for 63 + 3
    batch, _ = Case(seq_lens=(126, 40), q_lens=(3, 2), heads=2, page_size=16, kv_lora_rank=64, rope_dim=32,
                    kv_dtype=dtype, q_dtype=dtype, seed=4).materialize()
    static, first_spare = with_room(batch)
    assert first_spare == batch.num_pages and static.num_pages > first_spare
    old = static.seq_lens.clone()
    next_layout(static, first_spare)
    _, grown = next_lengths(old, static.page_size)
    have = -(-int(old.roll(1)[grown]) // static.page_size)
    need = int(static.pages_per_request[grown])
    assert static.block_table[grown, have:need].tolist() == list(range(first_spare, first_spare + need - have))
    before = static.pages_per_request.tolist()
    decode_layout(static, first_spare)
    taken = [p for b in range(static.batch_size)
             for p in static.block_table[b, before[b]:int(static.pages_per_request[b])].tolist()]
    start = first_spare + need - have
    assert taken == list(range(start, start + len(taken))) and taken  # in order, right after the grown request's


@pytest.mark.parametrize("seq_lens, q_lens, page_size", [((0,), (1,), 1), ((1,), (1,), 1), ((0,), (3,), 2),
                                                         ((4, 0, 2), (2, 1, 2), 2), ((1, 1), (1, 1), 1)])
def test_with_room_holds_the_next_step_and_the_decode_step_where_every_growth_needs_a_page(seq_lens, q_lens,
                                                                                          page_size):
    """Small pages and lengths where the decode step's growth of each non-empty request takes new pages, the grown
    request's included (a lone empty request on pages of 1 leaves no slack: its old row has no page): both steps
    fit in with_room's spare pages, the batches are valid and the oracle reads no NaN."""
    batch, _ = Case(seq_lens=seq_lens, q_lens=q_lens, heads=2, page_size=page_size, kv_lora_rank=64, rope_dim=32,
                    seed=2).materialize()
    static, first_spare = with_room(batch)
    next_values(static, next_layout(static, first_spare)[1])
    assert static.validate() is static
    _, old = decode_layout(static, first_spare)  # ValueError when the room is short
    assert static.validate() is static and bool((static.seq_lens > old).any())
    decode_values(static, old)
    out, lse = mla_decode_ref(static)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_next_values_writes_seeded_standard_normal_tokens_quantized_with_the_kv_scale(fmt):
    """The grown request's new slots hold the draws of torch.randn(n, D) from a generator seeded with the seed (0),
    in the slots' row-major order, quantized with the batch's kv_scale: each dequantized within the format's
    element error model, u |x| + eta kv_scale (fp8_format: half an ulp relative, half the least subnormal), where
    not saturated."""
    batch, _ = Case(seq_lens=(70, 5), q_lens=(2, 1), heads=2, page_size=16, kv_lora_rank=64, rope_dim=32,
                    kv_dtype="fp8", q_dtype="fp8", fp8_format=fmt, seed=3).materialize()
    static, first_spare = with_room(batch)
    new_slots = next_layout(static, first_spare)[1]
    next_values(static, new_slots)
    n, f, scale = int(new_slots.sum()), fp8_format(fmt), static.kv_scale
    assert n > 0 and abs(scale - 1.0) > 0.5  # a scale far from 1: the test can tell it was applied
    x = torch.randn(n, static.head_dim, generator=torch.Generator().manual_seed(0)).double()  # [n, D]
    real = static.kv_cache[new_slots].double() * scale  # [n, D]
    inside = x.abs() <= f.max * scale  # not saturated
    assert inside.float().mean() > 0.99
    err = (real - x).abs()[inside]
    assert (err <= f.u * x.abs()[inside] + f.eta * scale).all(), float(err.max())


@pytest.mark.parametrize("page_size", [1, 16])
def test_used_slots_are_the_slots_of_every_requests_tokens(page_size):
    batch, _ = Case(seq_lens=(0, 37, 5, 1), q_lens=(1, 2, 1, 1), heads=2, page_size=page_size, kv_lora_rank=64,
                    rope_dim=32, seed=6).materialize()
    mask = used_slots(batch)  # [P, ps]
    assert mask.shape == batch.kv_cache.shape[:2]
    assert set(map(tuple, torch.nonzero(mask).tolist())) == _slot_set(batch)
