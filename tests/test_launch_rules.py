"""default_config's launch-choice rules held field by field against its docstring (and the module constants' comments),
at both sides of each threshold: which kernel and tile config a batch gets for each cache dtype, row count, batch
size and q_len, forced_config's geometry, batch_config's arguments, and plan_reduce_pieces' wave bound. No kernel is
launched; `seesaw` / `fp8_gluon` say what an H200 would support, so they are passed directly.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from mla_fast import gluon_decode, gluon_fp8
from mla_fast import triton_decode as td
from mla_ref.decode import make_decode_batch

# the bf16 and fp8 gathers of pages smaller than a tile (default_config's docstring: bf16 picks each token's page in
# two steps and takes chunks up to pages of 8, fp8 caches in one step up to pages of 4)
BF16_GATHER = dict(page_select=2, gather_chunk_pages=8)
FP8_GATHER = dict(page_select=1, gather_chunk_pages=16)


def bf16_rows(rows, heads):
    """The bf16 Triton path at <= 32 rows (docstring): 4 warps at <= 16 rows, 8 at 32 (4 spill), two 64-token tiles
    buffered (num_stages 3), block-table chunks of 32 pages, four latent slices (test_triton_decode's "default at 16
    rows"), one program per SM planned on 64-token blocks (KernelConfig: "a page of 64 by default")."""
    return td.KernelConfig(block_n=64, num_warps=4 if rows <= 16 else 8, num_stages=3, mma="bf16", head_group=heads,
                           page_chunk=32, split_l=4, head_split=1, workers_per_sm=1, plan_block_n=64, **BF16_GATHER)


def fp8_rows(rows, heads):
    """The staged fp8-cache Triton path at <= 32 rows (docstring): fp8_stage, chunks, lazy_l, eight 64-channel
    slices; <= 16 rows: 4 warps and three tiles buffered (num_stages 4); 17-32 rows: 8 warps, two tiles (3); no
    interleave (KernelConfig: with fp8 staging at 16 rows it spills)."""
    return td.KernelConfig(block_n=64, num_warps=4 if rows <= 16 else 8, num_stages=4 if rows <= 16 else 3,
                           mma="fp16", head_group=heads, fp8_stage=True, split_l=8, page_chunk=32, lazy_l=True,
                           interleave=False, **FP8_GATHER)


def test_small_batch_is_q_len_1_and_at_most_four_requests():
    """SMALL_BATCH = 4: batches of up to 4 requests at q_len 1 take no 64-row tiles (the constant's comment):
    bf16 128 heads at b = 4 take "16-row tiles as at h = 16" on all 8 head groups of a worker (head_split 8); at
    b = 5 the 64-row wgmma layout (64 heads, head_split 2); q_len 2 is never a small batch (64 heads x 2 rows -> 32
    heads, two programs); fp8 caches keep 32-row tiles (MAX_ROWS_SMALL_FP8) at b <= 4 without the Gluon kernels."""
    assert td.SMALL_BATCH == 4 and td.MAX_ROWS_SMALL_FP8 == 32
    sixteen = td.default_config("bf16", 16, 1, 1)
    assert td.default_config("bf16", 128, 1, 4) == replace(sixteen, head_split=8)
    big = td.default_config("bf16", 128, 1, 5)
    assert (big.head_group, big.head_split, big.unchain, big.interleave) == (64, 2, True, True)
    mtp = td.default_config("bf16", 64, 2, 1)  # q_len 2: 64-row tiles of 32 heads x 2 rows
    assert (mtp.head_group, mtp.head_split, mtp.num_warps, mtp.unchain) == (32, 2, 8, True)
    mtp = td.default_config("fp8kv", 64, 2, 1)
    assert (mtp.head_group, mtp.head_split, mtp.fp8_stage, mtp.unchain) == (32, 2, True, True)
    for combo in ("fp8kv", "fp8"):
        assert td.default_config(combo, 128, 1, 4) == fp8_rows(32, 32)  # 32-row mma.sync tiles, 8 warps
        assert td.default_config(combo, 128, 1, 5).head_group == 64


def test_each_triton_path_takes_its_documented_fields():
    """The Triton kernel's configs per path (default_config's docstring), at b = 32 with no Gluon kernel offered:
    <= 32 rows per dtype (bf16_rows / fp8_rows above; 32 rows: 8 warps), and 64 rows: two programs on halves of the
    head group where num_heads allows, unchained score dots, two latent slices, chunks; bf16 with one tile buffered
    (num_stages 2) and interleave; fp8 caches staged with three stages (two tiles) and interleave left off."""
    assert td.default_config("bf16", 16, 1, 32) == bf16_rows(16, 16)
    assert td.default_config("bf16", 32, 1, 32) == bf16_rows(32, 32)
    assert td.default_config("bf16", 8, 4, 32) == bf16_rows(32, 8)  # MTP rows count as rows
    for combo in ("fp8kv", "fp8"):
        assert td.default_config(combo, 16, 1, 32) == fp8_rows(16, 16)
        assert td.default_config(combo, 32, 1, 32) == fp8_rows(32, 32)
        assert td.default_config(combo, 16, 2, 32) == fp8_rows(32, 16)
    wgmma = dict(block_n=64, num_warps=8, split_l=2, unchain=True, page_chunk=32)
    assert td.default_config("bf16", 128, 1, 32) == td.KernelConfig(
        num_stages=2, mma="bf16", head_group=64, head_split=2, interleave=True, **wgmma)
    assert td.default_config("bf16", 64, 1, 32) == td.KernelConfig(
        num_stages=2, mma="bf16", head_group=64, head_split=1, interleave=True, **wgmma)  # one program: 64 heads
    for combo in ("fp8kv", "fp8"):
        assert td.default_config(combo, 128, 1, 32) == td.KernelConfig(
            num_stages=3, mma="fp16", head_group=64, head_split=2, fp8_stage=True, interleave=False, **wgmma)
        assert td.default_config(combo, 16, 4, 32) == td.KernelConfig(  # MTP: 16 heads x 4 rows, one program
            num_stages=3, mma="fp16", head_group=16, head_split=1, fp8_stage=True, interleave=False, **wgmma)


def test_bf16_small_batches_split_only_past_32_rows():
    """The small-batch rule is for "bf16 with 64-row tiles": 32 heads at q_len 1 and b = 1 (32 rows) keep the
    32-row path, 48 heads (48 rows) take 16-row groups on every head (head_split 3)."""
    assert td.default_config("bf16", 32, 1, 1) == bf16_rows(32, 32)
    assert td.default_config("bf16", 48, 1, 1) == replace(bf16_rows(16, 16), head_split=3)


def test_gluon_fp8_config_is_two_programs_per_sm_with_two_tile_slots():
    """The Gluon fp8 kernel's config (default_config's docstring): 16 packed rows per program (head_group 16 / 8 /
    4 at q_len 1 / 2 / 3-4), head_split = num_heads / head_group programs per worker, two programs per SM with two
    tile slots each, fp16 MMAs, fp8 score MMAs (qk_fp8) for e4m3fn q only; forced_config gives the same geometry
    whatever the batch (at 8 programs x 1 token too)."""
    for combo in ("fp8kv", "fp8"):
        for heads, q_len, group in ((128, 1, 16), (32, 2, 8), (16, 3, 4), (16, 4, 4)):
            expected = td.KernelConfig(block_n=64, mma="fp16", head_group=group, head_split=heads // group,
                                       num_stages=2, workers_per_sm=2, kernel="gluon_fp8", qk_fp8=combo == "fp8")
            assert td.default_config(combo, heads, q_len, 1, fp8_gluon=True, kv_tokens=4096) == expected
            assert td.forced_config(combo, heads, q_len, "gluon_fp8") == expected
    assert td.forced_config("fp8kv", 16, 5, "gluon_fp8") is None  # past q_len 4: no head group of 16 rows
    assert td.forced_config("bf16", 16, 1, "gluon_fp8") is None
    assert td.forced_config("fp8kv", 40, 1, "gluon_fp8") is None  # 16 does not divide 40


def test_the_seesaw_takes_only_its_head_groups():
    """The seesaw (kernel "gluon") takes head groups of gluon_decode.HEAD_GROUPS (8, 16, 32, 64) only: 48 heads at
    q_len 1 (48 rows, no such group) keep the Triton 64-row layout; its config has head_split programs covering every
    head and no other field set; forced_config("seesaw") lays it out as default_config, or None where the kernel
    takes no such rows (bf16 at 16 rows, fp8 caches at 32)."""
    assert 48 not in gluon_decode.HEAD_GROUPS
    assert td.default_config("bf16", 48, 1, 32, seesaw=True).kernel == "triton"
    assert td.forced_config("bf16", 48, 1, "seesaw") is None
    for combo, mma in (("bf16", "bf16"), ("fp8kv", "fp16")):
        expected = td.KernelConfig(block_n=64, mma=mma, head_group=64, head_split=2, kernel="gluon")
        assert td.default_config(combo, 128, 1, 32, seesaw=True) == expected
        assert td.forced_config(combo, 128, 1, "seesaw") == expected
    assert td.forced_config("bf16", 16, 1, "seesaw") is None and td.forced_config("fp8", 32, 1, "seesaw") is None
    assert td.forced_config("bf16", 32, 1, "seesaw") == td.KernelConfig(block_n=64, mma="bf16", head_group=32,
                                                                         kernel="gluon")
    with pytest.raises(ValueError, match="kernel must be one of"):
        td.forced_config("bf16", 128, 1, "triton")


def test_reduce_wave_is_sixteen_programs_per_sm():
    """plan_reduce_pieces halves a step while the grid exceeds REDUCE_WAVE = 16 programs per SM: on 2 SMs, 17 split
    tiles of 8 pieces (two 256-channel blocks each: 34 programs > 32) take 4 pieces, 16 tiles (32) keep 8; a plan
    with no split tiles keeps its max_pieces; a step is a power of two (5 pieces: 8); halving goes down to one piece
    where that still narrows the grid ("halving still narrows it")."""
    assert td.plan_reduce_pieces(SimpleNamespace(split_tiles=17, max_pieces=8), 1, 512, 2) == 4
    assert td.plan_reduce_pieces(SimpleNamespace(split_tiles=16, max_pieces=8), 1, 512, 2) == 8
    assert td.plan_reduce_pieces(SimpleNamespace(split_tiles=16, max_pieces=5), 1, 512, 2) == 8
    assert td.plan_reduce_pieces(SimpleNamespace(split_tiles=0, max_pieces=0), 16, 512, 132) == 0
    # L = 2048: two pieces span two 1024-channel blocks, so halving to one piece (one 2048-channel block) narrows it
    assert td.plan_reduce_pieces(SimpleNamespace(split_tiles=17, max_pieces=2), 1, 2048, 1) == 1


def _batch(seq_lens, q_lens, heads, page_size):
    """An fp8kv DecodeBatch of zeros (only its shapes, dtypes and lengths matter to batch_config)."""
    q = torch.zeros(sum(q_lens), heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(sum(seq_lens), 576).to(torch.float8_e4m3fn)
    return make_decode_batch(q, list(torch.split(kv, list(seq_lens))), sm_scale=0.1, kv_lora_rank=512,
                             page_size=page_size, generator=torch.Generator().manual_seed(0), q_lens=list(q_lens),
                             kv_scale=0.5)


def test_batch_config_passes_the_sum_of_tokens_and_each_support(monkeypatch):
    """batch_config gives default_config the batch's cache tokens (the sum of seq_lens), its size, and
    gluon_decode.supported as `seesaw`, gluon_fp8.supported as `fp8_gluon`: 8 programs (128 heads) x (3 x 4096)
    tokens = 24 x 4096 take the Gluon fp8 kernel on pages of 64 (fp8kv), 8 x (3 x 4096 + 1) the seesaw; with only
    the seesaw offered 128 heads at b = 3 (a small batch) keep 32-row Triton tiles, with only the Gluon fp8 kernel
    the 3 x 4096 tokens take it."""
    seen = {"gd": True, "g8": True}
    monkeypatch.setattr(gluon_decode, "supported", lambda batch: seen["gd"])
    monkeypatch.setattr(gluon_fp8, "supported", lambda batch: seen["g8"])
    at = _batch((4096, 4096, 4096), (1, 1, 1), 128, 64)
    past = _batch((4096, 4096, 4097), (1, 1, 1), 128, 64)
    assert td.batch_config(at, 1).kernel == "gluon_fp8" and td.batch_config(past, 1).kernel == "gluon"
    seen["g8"] = False
    assert td.batch_config(at, 1) == fp8_rows(32, 32)
    seen.update(gd=False, g8=True)
    assert td.batch_config(at, 1).kernel == "gluon_fp8"
