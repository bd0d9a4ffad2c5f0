"""
fp8-cache MLA decode in Gluon (Hopper, 16 rows per program, no staged tile)
===========================================================================

The same absorbed-MLA decode contract and `WorkPlan` as `mla_fast.triton_decode._mla_decode_kernel` (whose partials
its reduce kernel merges), for e4m3fn caches with bf16 or e4m3fn q at 16 packed rows per program, pages of a
multiple of 64 tokens or of 16 or 32 (SMALL_PAGES), L = 512, R = 64: the memory-bound DeepSeek shapes at 16 heads.
The rows are q_len x head_group (query row m // head_group, head m % head_group, as in the other kernels): 16 heads
of one query row at q_len 1, 8 heads of 2 rows at q_len 2, 4 heads of 3-4 rows at q_len 3-4 (MTP: each row masked at
its causal limit, rows past an item's query rows are read as 0 and not written); more heads as several programs per
worker.

Why: the Triton kernel converts each fp8 tile to fp16 in shared memory and reads it back with ldmatrix, so fp8 KV moves
more shared-memory bytes per tile than bf16 (about 369 vs 295 KB per tile and SM) and ran at bf16's speed although it
reads half the HBM bytes (docs/perf_history.md, fourth session). This kernel reads each fp8 byte of a tile from shared
memory once per use (twice in all: scores, then P.V), converts it in registers and feeds register-A wgmmas:

- transposed products, so the 64 tokens of a tile are the wgmma M dimension and the 16 rows are N (no padded rows):
      s^T [64, 16]  = K [64, 576] . q^T [576, 16]       A = K from registers, B = q (fp16) in shared memory
      o^T [512, 16] += V^T [512, 64] . p^T [64, 16]      A = V^T from registers, B = p (fp16) in shared memory
- K: each thread loads 4 adjacent channels of a token per register (ldmatrix), which the A operand would hold in
  two registers 8 columns apart; within each 16-channel block the columns are permuted instead (column
  8 h + 2 t + j holds channel 4 t + 2 h + j), and q is stored in shared memory in the same column order, so each
  k16 step multiplies the same 16 channel pairs.
- V^T as the A operand needs two consecutive tokens of one channel in each register, and fp8 rows are
  channel-contiguous. The output channels are permuted instead: in each quarter of 128 channels, accumulator row
  m = 64 a1 + 16 w + 8 a0 + g holds channel 32 w + 4 g + 2 a1 + a0 (w warp, g = lane // 4), so a thread's 32-bit
  load of 4 adjacent channels feeds 4 of its accumulator rows (after the conversion one PRMT per register pairs
  the tokens); the permutation is undone when the output is stored (4 adjacent channels per vector store).
- e4m3fn q (`KernelConfig.qk_fp8`, default_config's choice for it): the scores need no conversion at all. q is
  stored as its fp8 codes in channel order, and s^T = K . q^T runs as e4m3 x e4m3 wgmmas with both operands read
  from shared memory as they are (the cache rows and q's rows are channel-contiguous: K-major, as fp8 wgmmas
  require), in nine accumulators of 64 channels (two k32 instructions each, from 0), issued at once and added in
  fp32 in a fixed order. Only V is converted (the P.V side is unchanged).
- KV tiles arrive by TMA into STAGES slots (a launch parameter). A slot's c_kv is stored in a grouped layout (on
  every page size the kernel takes: FP8_GROUPED_PAGES, `grouped_layout`): 8 boxes of 8 tokens x 4 quarters
  ([4, 8, 128], 4 KB each, 128-byte swizzled), so a page's tokens are adjacent boxes and one 4-D TMA copy fills
  them (the cache viewed as [rows / 8, 4 quarters, 8 tokens, 128] with strides 8 x 576, 128, 576, 1 bytes; a page
  of 64k takes one copy per tile); the operand loads, the zeroed tail and the fp8 score wgmmas read the tile
  through a shared linear layout (_TILE8: 4 KB between 8-token groups, 1 KB between quarters). k_pe takes one
  [min(page, 64), 64] box per page. That is 8 copies per tile at page 16 and 2 at pages of 64k, against 20 and 5
  in the standard layout (c_kv as four [min(page, 64), 128] quarter boxes per page, what the kernel runs with
  FP8_GROUPED_PAGES emptied, as config_ab's A/B does), with the same bits. An item's first STAGES tiles are issued
  at its start, and the slot of tile t is reissued with tile t + STAGES once every warp has loaded its operands
  from it, so STAGES - 1 tiles are in flight while one is computed.
  At most two score MMAs and two P.V MMAs are in flight (each register A operand stays live until its MMA is done).
- default_config runs two programs per SM (workers_per_sm=2) with two slots each (94 KB of shared memory, 255
  registers; 85 KB and 231-243 registers with qk_fp8): one program's softmax and loads overlap the other's MMAs.

Numerics (fp16 scores): those of `KERNEL_NUMERICS["fp8kv"]` / `["fp8"]` (mma="fp16"): the MMAs see the fp8 codes
(exact in fp16) and q cast to fp16; scores are one fp32 chain over L + R channels (9 chunks of 64); P is rounded to
fp16 once; the row sums are fp32 over unrounded P, kept per (token slot, row) and summed once per item (another
order of the same fp32 sum, as the Triton kernel's lazy_l); one 64-token P.V MMA per tile and quarter added into the
rescaled fp32 accumulator. q_scale x kv_scale x sm_scale x log2(e) multiplies the fp32 scores, kv_scale the
normalised output. With qk_fp8 the scores are those of `numerics.gluon_fp8_qk_numerics` instead: Hopper's fp8 MMAs
align and truncate their terms (about 14 bits, not fp32), which the 64-channel accumulators bound to 65 x 2^-13 of
Σ|q||k| (7.9e-3; 3.4e-3 measured on adversarial data, 4.3e-5 on Gaussian data, against at most 1.7e-6 for the fp16
path: still far below the quantization error of e4m3 q itself). 128-channel accumulators were as fast and measured
8.0e-3 there.

Safety: TMA copies whole 64-token tiles, so the last tile of an item may hold cache slots past KV_END (NaN-poisoned
slots are allowed): their scores are selected to -inf, and their c_kv rows are set to 0 in shared memory before the
P.V operands are loaded. With pages smaller than a tile, a page box that starts at or past KV_END copies the tile's
first page again instead (`_tile_rows`): no block-table entry past an item's tokens is read. Rows that see no token
give out = 0, lse = -inf.

The grouped layout (pages of 16 and 32: twenty-ninth session, one H200, graph replays, three alternating rounds,
same bits; per-page boxes -> grouped, us): page 16 fp8kv 220.9 -> 196.0 and fp8 205.5 -> 176.7 at (128, 8192, 16),
42.5 -> 40.2 and 41.1 -> 39.6 at (32, 4096, 16), 16.9 -> 16.1 and 16.0 -> 15.4 at (1, 8192, 16), 125.7 -> 113.5 and
108.3 -> 90.7 at (64, 4096, 16) q_len 2, 216.0 -> 178.1 and 191.8 -> 160.4 at (128, 4096, 32); page 32 fp8kv
193.8 -> 184.7 and fp8 172.1 -> 169.3 at (128, 8192, 16), 175.8 -> 165.8 and 161.8 -> 144.8 at (128, 4096, 32).
Under ncu the per-page boxes had cost 38 % more instructions than pages of 64 (89.3 M vs 64.9 M at (128, 8192, 16)
fp8kv), nearly all in issuing the copies (R2UR, VOTEU, UTMALDG in every warp). On pages of 64 (one c_kv copy per
tile instead of 4) that session's call was mixed (181.2 -> 184.1 fp8kv at (128, 8192, 16), 162.3 -> 156.6 at
(128, 4096, 32)); two calls of the thirtieth session (three and five alternating rounds, same bits) agreed instead,
and the grouped layout took pages of 64k too: fp8kv 179.2 -> 175.4 and 179.6 -> 175.1 at (128, 8192, 16), 101.5 ->
99.3 at (128, 4096, 16), 100.6 -> 98.7 at (32, 16384, 16), 60.5 -> 59.5 at (64, 4096, 16), 40.0 -> 39.4 at
(32, 4096, 16), 163.2 -> 157.4 at (128, 4096, 32), 93.3 -> 90.4 at (64, 4096, 16) q_len 2; fp8 140.3 -> 132.9 and
140.5 -> 133.4 at (128, 4096, 32), within 0.6 % elsewhere at 16 heads; slower only at (1, 8192, 128), by 0.2-0.3 us
(23.0 -> 23.2 fp8kv, 21.2 -> 21.5 fp8), and at (64, 4096, 16) q_len 2 fp8 by 0.2-0.5 us.
fp8 score MMAs for e4m3fn q (twenty-third session, one H200, graph replays, four alternating rounds, fp16 scores ->
qk_fp8, us): 184.5 -> 166.2 at (128, 8192, 16), 99.7 -> 93.8 at (128, 4096, 16), 99.6 -> 93.7 at (32, 16384, 16),
60.1 -> 58.5 at (64, 4096, 16), 39.4 -> 38.2 at (32, 4096, 16), 15.3 -> 15.0 at (1, 8192, 16), 22.7 -> 21.1 at
(1, 8192, 128), 161.3 -> 140.1 at (128, 4096, 32), and 91.9 -> 79.0 at (64, 4096, 16) q_len 2; no register spills
(231-243 registers, 85 KB of shared memory instead of 94). With Triton's own fp8 promotion (max_num_imprecise_acc 32,
partial sums added in fp32 after every instruction) the MMAs were serialized: 208.9 us at (128, 8192, 16).
Performance (one H200, mla-bench, CUDA-graph replays, seventh session; docs/perf_history.md): fp8 q 179.5 us and fp8kv
183.5 at (128, 8192, 16) (our bf16 293.9, FlashMLA's fp8 219.2, the Triton kernel's staged path 302), 101.6 / 103.4 at
(128, 4096, 16), 101.2 / 102.8 at (32, 16384, 16), 61.2 / 61.5 at (64, 4096, 16), 41.6 / 42.2 at (32, 4096, 16), 16.2 /
16.1 at (1, 8192, 16). More heads run as head_split programs of 16 (default_config: 32 heads, or up to programs x cache
tokens = 24 x 4096, GLUON_FP8_MAX_PROGRAM_TOKENS; 32 x 4096 with e4m3fn q; each 8 x 4096 less on pages of 16):
164.3 us at (128, 4096, 32), 24.4 at (1, 8192, 128) (seventh session).
History (fp8kv at (128, 8192, 16), each step against the one before in the same device call): first version (one
program, five slots) 260 us against the staged path's 302; two programs per SM with two slots 222; each score chunk's
operand loaded before the previous chunk's MMA is issued, V's first quarter before the softmax 211.8; every slot kept
busy (the end-of-tile issue had gone to the slot freed a tile earlier, so with two slots no tile was in flight while
one was computed) 180.3 vs 211.6 (116.2 -> 103.4 at (128, 4096), 45.2 -> 43.3 at (32, 4096)); V's second quarter
before the softmax too 179.0 vs 181.0 (8 instead of 48 bytes of spill stack).
Measured and dropped: one program per SM with 4 slots (227.9 vs 180.3 us, with every slot busy; 249 before);
skipping the accumulator rescale when no row max moved (226 vs 223 us: the extra reduction and branch cost more than
the 72 multiplies); three score MMAs in flight (no change); an L2 prefetch (cp.async.bulk.prefetch) of the tile 1, 2
or 4 tiles past the last one issued (219, 255, 283 vs 222 us, and slower at every other shape); pairing V's tokens at
the byte level before the conversion (Triton emitted byte extracts: 1320 vs 968 instructions per tile, offline); the
bf16 cache through the same loop with both MMA operands read from shared memory (one program per SM with two 72 KB
slots): 358 vs 289 us for the Triton kernel at (128, 8192, 16) with the idle slot, 291.6 vs 293.7 once every slot was
busy (58.2 vs 57.2 at (32, 4096, 16), 16.9 vs 18.1 at b = 1: no gain); the next item's first tiles issued before the
current item's store (182.0 vs 181.0 us, 62.9 vs 63.5 at (64, 4096)); a slot reissued right after its last operand
load instead of after the last P.V MMA (one more barrier; 0.2-0.5 us, within the noise); 32 heads per program (N = 32,
115 KB of shared memory, 52 spilled registers): 194.8 vs 163.6 us for two 16-head programs at (128, 4096, 32), 73.2
vs 54.5 at (32, 4096, 32); 64 heads per program on two warpgroups that both computed the scores and each multiplied
half the output channels (1352 bytes of spills): 1015 vs 552 us for the Triton staged path at (128, 4096, 128); the
head split as a runtime value, one compile for 16-128 heads as in the fp8 seesaw (thirty-second session: within
0.7 % everywhere, 173.8 vs 174.8 us fp8kv at (128, 8192, 16), 155.4 vs 156.3 at (128, 4096, 32)).
ncu at (128, 8192, 16), fp8kv (clocks locked: 218.7 us): 58 % of DRAM peak, L2 70 %, 44 % of issue slots busy with
1.86 active and 0.58 eligible warps per scheduler, occupancy 2 programs per SM (registers and shared memory both
limit it to 2): still latency-bound, not throughput-bound. Sixth session, with the idle slot: 48 % of DRAM peak, 36 %
of issue slots; the ALU pipe (conversions, byte permutes) 40 % busy; stalls 24 % wait, 21 % long scoreboard (18 % at
the tile's mbarrier wait), 15 % short scoreboard.

Device only (CUDA sm_90): the interpreter cannot run Gluon; tests/test_triton_gpu.py checks it against the fp64
oracle.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from mla_fast import gluon_decode
from mla_fast.gluon_decode import (  # the tile, widths, work-item columns and block-table walk of the seesaw kernel
    _GROUPS,
    _L_DIM,
    _LN2,
    _R_DIM,
    _TILE,
    L_DIM,
    LOG2E,
    R_DIM,
    SMALL_PAGES,
    TILE,
    _item,
    _tile_rows,
    _worker_items,
    tile_boxes,
)

ROWS = 16  # packed (query row x head) rows per program (wgmma N): q_len x head_group <= 16
HEAD_GROUPS = (16, 8, 4)  # heads per program: q_len 1, <= 2, <= 4 query rows of head_group heads
QUARTER = L_DIM // 4  # output channels per P.V accumulator (one [64, 128] c_kv box)

_ROWS = gl.constexpr(ROWS)
_QUARTER = gl.constexpr(QUARTER)

# Channel permutations of the MMA operands (reshape to the split, then permute), shared with the CPU tests:
K_BLOCK = (4, 2, 2)  # 16 channels of K (and q) as (t, h, j): channel 4 t + 2 h + j
K_BLOCK_ORDER = (1, 0, 2)  # the score operand's column order (h, t, j): column 8 h + 2 t + j
V_SPLIT = (4, 8, 2, 2)  # a 128-channel V quarter as (w, g, a1, a0): channel 32 w + 4 g + 2 a1 + a0
V_ORDER = (2, 0, 3, 1)  # the P.V accumulator's row order (a1, w, a0, g): row 64 a1 + 16 w + 8 a0 + g


@constexpr_function
def _k_split(lead0, lead1):
    """Shape [lead0, lead1, *K_BLOCK]: channel blocks of 16 split as (t, h, j)."""
    return [lead0, lead1, *K_BLOCK]


@constexpr_function
def _k_order():
    """(., ., t, h, j) -> (., ., h, t, j): K_BLOCK_ORDER after two leading dims."""
    return (0, 1, *(2 + i for i in K_BLOCK_ORDER))


@constexpr_function
def _v_split(trail):
    """Shape [*V_SPLIT, trail]: a 128-channel quarter split as (w, g, a1, a0)."""
    return [*V_SPLIT, trail]


@constexpr_function
def _v_order():
    """(w, g, a1, a0, .) -> (a1, w, a0, g, .)."""
    return (*V_ORDER, len(V_ORDER))


@constexpr_function
def _acc_split(trail):
    """Shape of an accumulator quarter's rows split as (a1, w, a0, g), then trail."""
    return [*(V_SPLIT[i] for i in V_ORDER), trail]


@constexpr_function
def _acc_order():
    """(a1, w, a0, g, .) -> (w, g, a1, a0, .): the inverse of _v_order."""
    return (*sorted(range(len(V_ORDER)), key=lambda i: V_ORDER[i]), len(V_ORDER))


@gluon.jit
def _permute5(x, order: gl.constexpr):
    """gl.permute of a 5-d tensor by a constexpr tuple (gl.permute takes a literal tuple)."""
    return gl.permute(x, (order[0], order[1], order[2], order[3], order[4]))


# register layouts (4 warps). MMA: wgmma accumulators, s^T [64, 16] and o^T quarters [128, 16]
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
# the fp8 score MMAs' accumulators (k32 instructions; the same registers as _MMA)
_MMA_FP8 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32]))
_A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
# a K chunk [64 tokens, 64 channels] as loaded: within each 16-channel block, channel 4 t + 2 h + j (t = lane % 4)
# of token g (+ 8 by a register), registers j, h (4 adjacent channels: one 32-bit load) first. Permuted to column
# 8 h + 2 t + j (_k_operand) it has the A operand's layout; q is stored in shared memory with the same column order
# (_q_columns), so each k16 step sums the products of the same 16 channels as in channel order.
_K_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
# a V quarter [64 tokens, 128 channels] as loaded: channel c = 32 w + 4 g + 2 a1 + a0 (w = warp, g = lane // 4) of
# token k, registers a0, a1 (4 adjacent channels: one 32-bit load) first. Permuted to V^T [128, 64] with row
# m = 64 a1 + 16 w + 8 a0 + g (_v_operand) it has the A operand's layout, up to the order of each thread's registers.
_V_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]], warp_bases=[[0, 32], [0, 64]], block_bases=[],
    shape=[64, 128]))
# an output quarter [16 rows, 128 channels] in channel order, 4 adjacent channels per thread first (vector stores)
_O_STORE = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0]], lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
    warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[16, 128]))
_Q_LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
# The grouped tile layout (GROUPED): a slot's c_kv as 8 boxes of 8 tokens x 4 quarters ([4, 8, 128] fp8, 4 KB each,
# 128-byte swizzled in 1 KB atoms), so that a page's tokens are adjacent boxes, filled by one 4-D TMA copy
# (_PAGE8); read as the tile [64 tokens, 512 channels] through _TILE8 (offset bit -> [token, channel])
_BOX8 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3))
_PAGE8 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=4))
_TILE8 = gl.constexpr(gl.SharedLinearLayout([
    [0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [0, 64],  # bits 0-6: channels of a 128-byte row
    [1, 16], [2, 32], [4, 64],  # bits 7-9: tokens of an atom (the 128-byte swizzle XORs them into channel bits 4-6)
    [0, 128], [0, 256],  # bits 10-11: the quarter (1 KB each)
    [8, 0], [16, 0], [32, 0],  # bits 12-14: the box (8-token group, 4 KB each)
]))


@gluon.jit
def _k_operand(chunk):
    """A operand [64 tokens, 64 columns] fp16 of a score MMA from an fp8 chunk in shared memory (column
    16 b + 8 h + 2 t + j holds channel 16 b + 4 t + 2 h + j, as in _q_columns)."""
    k = gl.reshape(chunk.load(_K_LOAD).to(gl.float16), _k_split(_TILE, 4))  # (token, b, t, h, j)
    k = gl.reshape(_permute5(k, _k_order()), [_TILE, 64])  # (token, b, h, t, j)
    return gl.convert_layout(k, _A_OP, assert_trivial=True)


@gluon.jit
def _q_columns(q):
    """q [16, n] (channel order) as fp16 in the K operand's column order (_k_operand): column 16 b + 8 h + 2 t + j
    holds channel 16 b + 4 t + 2 h + j."""
    n: gl.constexpr = q.shape[1]
    q = gl.reshape(q.to(gl.float16), _k_split(_ROWS, n // 16))  # (row, b, t, h, j)
    q = _permute5(q, _k_order())  # (row, b, h, t, j)
    return gl.reshape(q, [_ROWS, n])


@gluon.jit
def _v_operand(v_quarter):
    """A operand V^T [128, 64] fp16 (row m = 64 a1 + 16 w + 8 a0 + g holds channel 32 w + 4 g + 2 a1 + a0) of a V
    quarter [64 tokens, 128 channels] fp8 in shared memory."""
    vt = gl.permute(v_quarter.load(_V_LOAD).to(gl.float16), (1, 0))  # [128 channels, 64 tokens]
    vt = _permute5(gl.reshape(vt, _v_split(_TILE)), _v_order())  # (w, g, a1, a0) -> (a1, w, a0, g)
    return gl.convert_layout(gl.reshape(vt, [_QUARTER, _TILE]), _A_OP, assert_trivial=True)


@gluon.jit
def _channel_order(acc):
    """An accumulator quarter [128, 16] (row m = 64 a1 + 16 w + 8 a0 + g: channel 32 w + 4 g + 2 a1 + a0) as
    [16 rows, 128 channels] in _O_STORE."""
    x = gl.reshape(acc, _acc_split(_ROWS))  # (a1, w, a0, g, row)
    x = _permute5(x, _acc_order())  # (w, g, a1, a0, row)
    return gl.convert_layout(gl.permute(gl.reshape(x, [_QUARTER, _ROWS]), (1, 0)), _O_STORE, assert_trivial=True)


@gluon.jit
def _store_q(q_smem, q, QK_FP8: gl.constexpr):
    """Store q rows [16, n] into q_smem: the fp8 codes as they are with QK_FP8, else fp16 in the K operand's
    column order (_q_columns)."""
    if QK_FP8:
        q_smem.store(q)
    else:
        q_smem.store(_q_columns(q))


@gluon.jit
def _fp8_scores(ckv, kpe, q_nope, q_pe):
    """Issue the score MMAs s^T [64 tokens, 16 rows] of a tile on fp8 codes as stored (e4m3fn q and cache, both from
    shared memory, no conversion): one accumulator per FP8_QK_GROUP = 64 channels (two k32 instructions), each from
    0, so that the tensor core's fp8 accumulation (narrower than fp32: mla_fast/numerics.py) spans 64 products at
    most. -> nine asynchronous accumulators [64, 16] (`_fp8_sum` adds them once they are done)."""
    zero = gl.zeros([_TILE, _ROWS], gl.float32, _MMA_FP8)
    accs = ()
    for c in gl.static_range(8):  # c_kv channels 64 c .. 64 c + 63
        accs = accs + (warpgroup_mma(ckv.slice(c * 64, 64, dim=1), q_nope.slice(c * 64, 64, dim=1).permute((1, 0)),
                                     zero, is_async=True),)
    return accs + (warpgroup_mma(kpe, q_pe.permute((1, 0)), zero, is_async=True),)  # k_pe


@gluon.jit
def _fp8_sum(accs):
    """The score tile s^T [64, 16] fp32 (_MMA) from `_fp8_scores`' nine accumulators once they are done: a fixed
    pairwise order of fp32 adds."""
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = warpgroup_mma_wait(0, deps=accs)
    s = (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + s8
    return gl.convert_layout(s, _MMA, assert_trivial=True)  # the k32 accumulators' registers are _MMA's


@gluon.jit
def _zero_tail(ckv, n_valid):
    """Set c_kv rows >= n_valid of a tile slot to 0 (cache slots past KV_END may hold NaN; V x 0 must be 0), then order
    the stores before the slot's next TMA write (async proxy) and every warp's operand loads (as gluon_decode's)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    keep = (gl.arange(0, _TILE, gl.SliceLayout(1, blk)) < n_valid)[:, None]  # [64, 1]
    for c in gl.static_range(4):
        chunk = ckv.slice(c * _QUARTER, _QUARTER, dim=1)
        chunk.store(gl.where(keep, chunk.load(blk), gl.zeros([_TILE, _QUARTER], gl.float8e4nv, blk)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _ckv_tile(ckv_smem, slot, GROUPED: gl.constexpr):
    """c_kv [64 tokens, 512 channels] of tile slot `slot`: ckv_smem [STAGES, 64, 512] (four [64, 128] boxes), or
    with GROUPED [STAGES x 8 boxes, 4 quarters, 8 tokens, 128] read through _TILE8."""
    if GROUPED:
        return ckv_smem.index(slot * _GROUPS)._reinterpret(gl.float8e4nv, [_TILE, _L_DIM], _TILE8)
    else:
        return ckv_smem.index(slot)


@gluon.jit
def _issue_tile(ckv_desc, kpe_desc, ckv_smem, kpe_smem, ready, slot, rows, BOXES: gl.constexpr,
                GROUPED: gl.constexpr):
    """TMA copies of the tile whose BOXES row boxes start at cache rows `rows` (`_tile_rows`) into tile slot `slot`
    (one barrier; c_kv as four [64 / BOXES, 128] boxes per row box, or with GROUPED one 4-D box per row box, its
    8-token groups x 4 quarters (ckv_desc: the cache as [rows / 8, 4, 8, 128]); k_pe as one [64 / BOXES, 64])."""
    BOX: gl.constexpr = _TILE // BOXES
    GROUP: gl.constexpr = _TILE // _GROUPS
    PER: gl.constexpr = BOX // GROUP  # with GROUPED: the 8-token groups of a row box
    bar = ready.index(slot)
    mbarrier.expect(bar, _TILE * (_L_DIM + _R_DIM))
    for j in gl.static_range(BOXES):
        if GROUPED:
            page = ckv_smem.index(slot * _GROUPS + j * PER)._reinterpret(gl.float8e4nv, [PER, 4, GROUP, _QUARTER],
                                                                          _PAGE8)
            tma.async_copy_global_to_shared(ckv_desc, [rows[j] // GROUP, 0, 0, 0], bar, page)
        else:
            ckv = ckv_smem.index(slot).slice(j * BOX, BOX, dim=0)  # [BOX, 512]
            for c in gl.static_range(4):
                tma.async_copy_global_to_shared(ckv_desc, [rows[j], c * 128], bar, ckv.slice(c * 128, 128, dim=1))
        tma.async_copy_global_to_shared(kpe_desc, [rows[j], _L_DIM], bar, kpe_smem.index(slot).slice(j * BOX, BOX,
                                                                                                    dim=0))


@gluon.jit
def _store_quarter(acc, o_scale, row_ptr, ok, col0: gl.constexpr, MASKED: gl.constexpr):
    """Normalise and unscale an accumulator quarter; write it in channel order (channels col0..col0+127) from each
    row's pointer (row_ptr [16]: out, bf16, or the fp32 workspace), rows with ok only when MASKED."""
    o = _channel_order(acc) * gl.convert_layout(o_scale, gl.SliceLayout(1, _O_STORE))[:, None]  # [16, 128]
    cols = col0 + gl.arange(0, _QUARTER, gl.SliceLayout(0, _O_STORE))[None, :]
    ptr = gl.convert_layout(row_ptr, gl.SliceLayout(1, _O_STORE))[:, None] + cols
    o = o.to(row_ptr.dtype.element_ty)
    if MASKED:
        gl.store(ptr, o, mask=gl.convert_layout(ok, gl.SliceLayout(1, _O_STORE))[:, None])
    else:
        gl.store(ptr, o)


@gluon.jit
def _store_item(accs, o_scale, lse, row_ptr, lse_ptr, ok, MASKED: gl.constexpr):
    """Write an item's output (four accumulator quarters, from each row's pointer row_ptr [16]) and lse (lse_ptr
    [16]); rows with ok only when MASKED."""
    a0, a1, a2, a3 = accs
    _store_quarter(a0, o_scale, row_ptr, ok, 0, MASKED)
    _store_quarter(a1, o_scale, row_ptr, ok, _QUARTER, MASKED)
    _store_quarter(a2, o_scale, row_ptr, ok, 2 * _QUARTER, MASKED)
    _store_quarter(a3, o_scale, row_ptr, ok, 3 * _QUARTER, MASKED)
    if MASKED:
        gl.store(lse_ptr, lse, mask=ok)
    else:
        gl.store(lse_ptr, lse)


@gluon.jit(do_not_specialize=["num_items"])  # as the Triton kernel: no recompile per item count
def _mla_decode_fp8_kernel(
    Q, ckv_desc, kpe_desc,  # q [T, H, 576] (bf16 or e4m3fn); TMA: the cache as [pages x page_size, 576] e4m3fn
    BLOCK_TABLE, SEQ_LENS, QO_INDPTR,  # [B, pages] int32, [B] int32, [B+1] int32
    WORK_ITEMS, WORKER_INDPTR, num_items,  # [N, 8] int32, [W+1] int32, N
    OUT, LSE, O_PART, LSE_PART,  # [T, H, L] bf16, [T, H] fp32, [rows, H, L] fp32, [rows, H] fp32
    Q_SCALE, KV_SCALE,  # fp32 [1] each
    sm_scale_log2,  # sm_scale x log2(e)
    stride_qt, stride_qh, stride_bt, stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt,
    PAGE_SIZE: gl.constexpr, HEAD_GROUP: gl.constexpr, HEAD_SPLIT: gl.constexpr, STAGES: gl.constexpr,
    ONE_ITEM: gl.constexpr,  # WorkPlan.one_item_per_worker
    QK_FP8: gl.constexpr,  # e4m3fn q: fp8 score MMAs on q and the cache tile as stored (`_fp8_scores`)
    GROUPED: gl.constexpr,  # c_kv slots in the grouped layout (_TILE8), one 4-D TMA copy per row box
):
    BOXES: gl.constexpr = tile_boxes(PAGE_SIZE)  # TMA row boxes per tile: 1, or one per page (pages of 16, 32)
    Q_ROWS: gl.constexpr = _ROWS // HEAD_GROUP  # query rows per item: packed row m is query row m // HEAD_GROUP,
    # head m % HEAD_GROUP (MTP: causal limits per row; rows past the item's query rows are neither read nor written)
    ckv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_TILE, 128], gl.float8e4nv)
    kpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_TILE, _R_DIM], gl.float8e4nv)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, 64], gl.float16)
    if GROUPED:
        ckv_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * _GROUPS, 4, _TILE // _GROUPS, _QUARTER], _BOX8)
    else:
        ckv_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, _TILE, _L_DIM], ckv_layout)
    kpe_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, _TILE, _R_DIM], kpe_layout)
    if QK_FP8:  # q's fp8 codes in channel order: the B operands of the fp8 score MMAs
        q_nope = gl.allocate_shared_memory(gl.float8e4nv, [_ROWS, _L_DIM],
                                           gl.NVMMASharedLayout.get_default_for([_ROWS, 128], gl.float8e4nv))
        q_pe = gl.allocate_shared_memory(gl.float8e4nv, [_ROWS, _R_DIM],
                                         gl.NVMMASharedLayout.get_default_for([_ROWS, _R_DIM], gl.float8e4nv))
    else:  # q as fp16 in the K operand's column order (_q_columns)
        q_nope = gl.allocate_shared_memory(gl.float16, [_ROWS, _L_DIM], q_layout)
        q_pe = gl.allocate_shared_memory(gl.float16, [_ROWS, _R_DIM], q_layout)
    p_smem = gl.allocate_shared_memory(gl.float16, [_ROWS, _TILE], q_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    row_l: gl.constexpr = gl.SliceLayout(0, _MMA)  # [16] per packed row (wgmma N)
    tok_l: gl.constexpr = gl.SliceLayout(1, _MMA)  # [64] per token of a tile (wgmma M)
    pid = gl.program_id(0)
    head_part = pid % HEAD_SPLIT
    worker = pid // HEAD_SPLIT
    kv_scale = gl.load(KV_SCALE)
    qk_scale = sm_scale_log2 * gl.load(Q_SCALE) * kv_scale
    g = 0  # tiles of this program so far: slot g % STAGES, phase (g // STAGES) & 1
    m = gl.arange(0, _ROWS, row_l)  # packed rows
    item_begin, item_end = _worker_items(WORKER_INDPTR, worker, num_items, ONE_ITEM)
    for it in range(item_begin, item_end):
        b, partial_row, qo, n_q, kv_start, kv_end, head_start, limit_0 = _item(
            WORK_ITEMS, SEQ_LENS, QO_INDPTR, it, head_part, HEAD_GROUP)  # (n_q, limit_0: unused at q_len 1)
        n_tiles = gl.cdiv(kv_end - kv_start, _TILE)
        for i in gl.static_range(STAGES):  # the first tiles (every slot is free: see the end of the loop)
            if i < n_tiles:
                _issue_tile(ckv_desc, kpe_desc, ckv_smem, kpe_smem, ready, (g + i) % STAGES,
                            _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, i, n_tiles, PAGE_SIZE, BOXES),
                            BOXES, GROUPED)
        # q of the item's packed rows as fp16 (exact for e4m3fn; bf16 as declared in numerics.py), in the K
        # operand's column order; rows past the item's query rows as 0
        qr = gl.arange(0, _ROWS, gl.SliceLayout(1, _Q_LOAD))
        q_cols = gl.arange(0, _L_DIM, gl.SliceLayout(0, _Q_LOAD))[None, :]
        pe_cols = _L_DIM + gl.arange(0, _R_DIM, gl.SliceLayout(0, _Q_LOAD))[None, :]
        if Q_ROWS == 1:
            q_ptr = Q + qo.to(gl.int64) * stride_qt + (head_start + qr)[:, None] * stride_qh
            _store_q(q_nope, gl.load(q_ptr + q_cols), QK_FP8)
            _store_q(q_pe, gl.load(q_ptr + pe_cols), QK_FP8)
        else:
            q_ptr = Q + ((qo + qr // HEAD_GROUP).to(gl.int64) * stride_qt + (head_start + qr % HEAD_GROUP) *
                         stride_qh)[:, None]
            q_ok = (qr // HEAD_GROUP < n_q)[:, None]
            _store_q(q_nope, gl.load(q_ptr + q_cols, mask=q_ok, other=0.0), QK_FP8)
            _store_q(q_pe, gl.load(q_ptr + pe_cols, mask=q_ok, other=0.0), QK_FP8)
        q_row = m // HEAD_GROUP  # [16] query row of the item
        limit = gl.where(q_row < n_q, limit_0 + q_row, -1)  # [16] causal limit; -1: no such row (MTP only)
        fence_async_shared()
        gl.thread_barrier()

        m_i = gl.full([_ROWS], float("-inf"), gl.float32, row_l)  # running max, log2 units
        l_t = gl.zeros([_TILE, _ROWS], gl.float32, _MMA)  # row sums per token slot, in the frame of m_i
        # o^T in four quarters of 128 channels (rows permuted: _v_operand)
        acc0 = gl.zeros([_QUARTER, _ROWS], gl.float32, _MMA)
        acc1 = gl.zeros([_QUARTER, _ROWS], gl.float32, _MMA)
        acc2 = gl.zeros([_QUARTER, _ROWS], gl.float32, _MMA)
        acc3 = gl.zeros([_QUARTER, _ROWS], gl.float32, _MMA)
        if BOXES == 1:  # the block-table entry of each tile issued below, loaded a tile before its issue
            next_rows = _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, STAGES, n_tiles, PAGE_SIZE, BOXES)
        for t in range(n_tiles):
            slot = g % STAGES
            if BOXES == 1:
                rows = next_rows  # first cache row of tile t + STAGES, issued into this slot at the end of this tile
                next_rows = _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, t + STAGES + 1, n_tiles,
                                       PAGE_SIZE, BOXES)
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
            ckv = _ckv_tile(ckv_smem, slot, GROUPED)
            t0 = kv_start + t * _TILE
            if kv_end - t0 < _TILE:  # the last tile: rows past KV_END to 0 before anything reads them (their
                _zero_tail(ckv, kv_end - t0)  # scores are selected away below whatever they hold)
            if QK_FP8:  # nine fp8 accumulators of 64 channels on the tile as stored, issued at once, then added
                s = _fp8_sum(_fp8_scores(ckv, kpe_smem.index(slot), q_nope, q_pe))
            else:  # one chain over 9 chunks of 64 channels; each chunk's operand is loaded before the previous
                # chunk's MMA is issued, two MMAs in flight at most (each A operand holds 16 registers until its MMA
                # is done)
                s = gl.zeros([_TILE, _ROWS], gl.float32, _MMA)
                a = _k_operand(ckv.slice(0, 64, dim=1))
                for c in gl.static_range(8):
                    if c < 7:
                        a_next = _k_operand(ckv.slice((c + 1) * 64, 64, dim=1))
                    else:
                        a_next = _k_operand(kpe_smem.index(slot))
                    s = warpgroup_mma(a, q_nope.slice(c * 64, 64, dim=1).permute((1, 0)), s, is_async=True)
                    if c > 0:
                        s = warpgroup_mma_wait(1, deps=(s,))
                    a = a_next
                s = warpgroup_mma(a, q_pe.permute((1, 0)), s, is_async=True)
            # V's first two quarters are loaded while the scores finish (fp16 path) and the softmax runs
            v0 = _v_operand(ckv.slice(0, _QUARTER, dim=1))
            v1 = _v_operand(ckv.slice(_QUARTER, _QUARTER, dim=1))
            if not QK_FP8:
                s = warpgroup_mma_wait(0, deps=(s,))
            tok = t0 + gl.arange(0, _TILE, tok_l)
            keep = (tok < kv_end)[:, None]  # [64, 1]
            if Q_ROWS > 1:
                keep = keep & (tok[:, None] < limit[None, :])  # [64, 16]
            s = gl.where(keep, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0))  # [16]
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no token yet: no NaN
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[None, :])  # [64, 16] fp32
            l_t = l_t * alpha[None, :] + p
            acc0 = acc0 * alpha[None, :]
            acc1 = acc1 * alpha[None, :]
            acc2 = acc2 * alpha[None, :]
            acc3 = acc3 * alpha[None, :]
            m_i = m_new
            p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            p_op = p_smem.permute((1, 0))  # [64 tokens, 16 rows]
            # two quarters in flight at most (each A operand holds 32 registers until its MMA is done)
            acc0 = warpgroup_mma(v0, p_op, acc0, is_async=True)
            acc1 = warpgroup_mma(v1, p_op, acc1, is_async=True)
            acc0 = warpgroup_mma_wait(1, deps=(acc0,))
            acc2 = warpgroup_mma(_v_operand(ckv.slice(2 * _QUARTER, _QUARTER, dim=1)), p_op, acc2, is_async=True)
            acc1 = warpgroup_mma_wait(1, deps=(acc1,))
            acc3 = warpgroup_mma(_v_operand(ckv.slice(3 * _QUARTER, _QUARTER, dim=1)), p_op, acc3, is_async=True)
            acc2, acc3 = warpgroup_mma_wait(0, deps=(acc2, acc3))
            gl.thread_barrier()  # every warp is done with the slot and with p_smem
            if t + STAGES < n_tiles:
                if BOXES > 1:  # one entry per page: loaded here, where they hold no registers through the tile
                    rows = _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, t + STAGES, n_tiles, PAGE_SIZE,
                                      BOXES)
                _issue_tile(ckv_desc, kpe_desc, ckv_smem, kpe_smem, ready, slot, rows, BOXES, GROUPED)
            g += 1

        l_sum = gl.sum(l_t, 0)  # [16]
        has_tok = l_sum != 0.0  # l >= 0, or NaN from a NaN input: then lse is NaN too, not -inf
        o_scale = kv_scale / gl.where(has_tok, l_sum, 1.0)
        lse = gl.where(has_tok, (m_i + gl.log2(gl.where(has_tok, l_sum, 1.0))) * _LN2, float("-inf"))
        h = head_start + m % HEAD_GROUP  # [16]
        accs = (acc0, acc1, acc2, acc3)
        if partial_row < 0:
            o_row = (qo + q_row).to(gl.int64)  # [16] output rows
            _store_item(accs, o_scale, lse, OUT + o_row * stride_ot + h * stride_oh, LSE + o_row * stride_lt + h,
                        q_row < n_q, Q_ROWS > 1)
        else:
            p_row = (partial_row + q_row).to(gl.int64)  # [16] workspace rows
            _store_item(accs, o_scale, lse, O_PART + p_row * stride_pt + h * stride_ph,
                        LSE_PART + p_row * stride_plt + h, q_row < n_q, Q_ROWS > 1)
        gl.thread_barrier()  # q_nope / q_pe are rewritten by the next item


def _qk_fp8_reason(batch, qk_fp8: bool) -> str | None:
    """Why fp8 score MMAs cannot take `batch` (they need e4m3fn q), or None."""
    if qk_fp8 and batch.q.dtype != torch.float8_e4m3fn:
        return f"KernelConfig.qk_fp8 (fp8 score MMAs) needs e4m3fn q, got {batch.q.dtype}"
    return None


def unsupported(batch, head_group: int | None = None, head_split: int | None = None,
                max_rows: int | None = None, qk_fp8: bool = False) -> str | None:
    """Why this kernel cannot take `batch`, or None. With head_group (heads per program), head_split (programs per
    worker) and max_rows (max q_len x head_group) it also checks that launch geometry; qk_fp8 (fp8 score MMAs) needs
    e4m3fn q. No host sync."""
    if batch.kv_cache.dtype != torch.float8_e4m3fn or batch.q.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return (f"kernel='gluon_fp8' takes an e4m3fn cache with bf16 or e4m3fn q, got "
                f"{batch.q.dtype}/{batch.kv_cache.dtype}")
    reason = _qk_fp8_reason(batch, qk_fp8) or gluon_decode.layout_reason(batch, "gluon_fp8", SMALL_PAGES)
    if reason:
        return reason
    if not batch.kv_cache.is_contiguous() or batch.q.stride(-1) != 1:
        return "kernel='gluon_fp8' needs a contiguous kv_cache (TMA descriptor) and q with unit channel stride"
    if head_group is not None:
        if head_group not in HEAD_GROUPS or max_rows > ROWS:
            return (f"kernel='gluon_fp8' takes head_group in {HEAD_GROUPS} with q_len x head_group <= {ROWS} rows, "
                    f"got head_group {head_group}, {max_rows} rows")
        reason = gluon_decode.heads_reason(batch, "gluon_fp8", head_group, head_split)
        if reason:
            return reason
    return gluon_decode.device_reason(batch, "gluon_fp8")


SLOT_BYTES = TILE * (L_DIM + R_DIM)  # one tile slot (fp8): 36 KB
# pages (64k as 64) whose c_kv the kernel keeps in the grouped layout (`grouped_layout`): all it takes. Emptied
# (config_ab's `FP8_GROUPED_PAGES=()`), the standard layout for A/B runs (module docstring for the measurements).
FP8_GROUPED_PAGES = (16, 32, 64)
FIXED_BYTES = 21 * 1024  # q (fp16), p and the reduction scratch: 20.3 KB compiled
SMEM_PER_SM = 227 * 1024  # sm_90


def check_stages(num_stages: int, workers_per_sm: int) -> None:
    """Raise ValueError unless num_stages tile slots fit workers_per_sm programs' shared memory on one SM (and at
    least one tile is in flight beside the one computed)."""
    if num_stages < 2 or workers_per_sm * (num_stages * SLOT_BYTES + FIXED_BYTES) > SMEM_PER_SM:
        raise ValueError(f"kernel='gluon_fp8' needs num_stages >= 2 and workers_per_sm x (num_stages x 36 KB + 21 KB) "
                         f"<= 227 KB, got num_stages {num_stages}, workers_per_sm {workers_per_sm}")


def supported(batch) -> bool:
    """Whether this kernel can take `batch` here (dtypes, widths, pages, layout, device)."""
    return unsupported(batch) is None


def grouped_layout(kv: torch.Tensor) -> bool:
    """Whether the kernel keeps a cache's c_kv slots in the grouped layout (_TILE8: 8-token boxes of 4 quarters, one
    4-D TMA copy per page instead of 4 quarter boxes): FP8_GROUPED_PAGES, pages of 64k counted as 64."""
    return gluon_decode.page_in(kv, FP8_GROUPED_PAGES)


def launch_decode(batch, plan, out, lse, o_part, lse_part, q_scale, kv_scale, head_group: int, head_split: int,
                  num_stages: int, qo_indptr, qk_fp8: bool = False):
    """Launch the fp8 decode kernel (head_split programs per worker, head_group heads each); the caller launches the
    reduce."""
    reason = _qk_fp8_reason(batch, qk_fp8)
    if reason:
        raise ValueError(reason)
    kv = batch.kv_cache
    D = kv.shape[-1]
    flat = kv.view(-1, D)
    boxes = tile_boxes(kv.shape[1])
    box = TILE // boxes  # cache rows per TMA box: a tile, or a page smaller than one (into the tile slot's layout)
    grouped = grouped_layout(kv)
    if grouped:  # a page's 8-token groups x 4 quarters per copy (the cache as [rows / 8, 4, 8, 128])
        ckv_desc = gluon_decode.grouped_descriptor(kv, box, QUARTER, _PAGE8.value)
    else:
        ckv_desc = TensorDescriptor(flat, list(flat.shape), [D, 1], [box, 128],
                                    gl.NVMMASharedLayout.get_default_for([TILE, 128], gl.float8e4nv))
    kpe_desc = TensorDescriptor(flat, list(flat.shape), [D, 1], [box, R_DIM],
                                gl.NVMMASharedLayout.get_default_for([TILE, R_DIM], gl.float8e4nv))
    num_workers = plan.worker_indptr.numel() - 1
    return _mla_decode_fp8_kernel[(num_workers * head_split,)](
        batch.q, ckv_desc, kpe_desc, batch.block_table, batch.seq_lens, qo_indptr, plan.work_items,
        plan.worker_indptr, plan.work_items.shape[0],
        out, lse, o_part, lse_part, q_scale, kv_scale, float(batch.sm_scale) * LOG2E,
        batch.q.stride(0), batch.q.stride(1), batch.block_table.stride(0), out.stride(0), out.stride(1),
        lse.stride(0), o_part.stride(0), o_part.stride(1), lse_part.stride(0),
        PAGE_SIZE=kv.shape[1], HEAD_GROUP=head_group, HEAD_SPLIT=head_split, STAGES=num_stages,
        ONE_ITEM=plan.one_item_per_worker, QK_FP8=qk_fp8, GROUPED=grouped, num_warps=4,
    )
