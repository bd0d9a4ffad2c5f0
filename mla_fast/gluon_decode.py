"""
Seesaw MLA decode in Gluon (Hopper, bf16 or fp8 cache, 64 packed rows per program)
==================================================================================

The same absorbed-MLA decode contract and `WorkPlan` as `mla_fast.triton_decode._mla_decode_kernel` (whose partials
its reduce kernel merges), written in Gluon, Triton's lower-level language, for the compute-bound shapes: bf16 q and
cache (or an e4m3fn cache: see "fp8 caches" below), one 64-row M tile of packed (query row x head) rows per program
as in the Triton kernel (head_group 8, 16, 32 or 64 heads per query row, q_len x head_group <= 64; MTP rows see
their causal limits), 64-token tiles that lie inside one page (page_size % 64 == 0) or span whole pages of 16 or 32
tokens (SMALL_PAGES: k_pe copied one TMA row box per page, `tile_boxes`, and c_kv in the grouped layout, below; bf16
caches on every page size), L = 512 and R = 64. Triton 3.6
cannot warp-specialize on Hopper; Gluon can, and this kernel needs it. q arrives by TMA, one [head_group, 64] box
per query row and chunk; packed rows past an item's q_len hold the next tokens' q (or zeros past the tensor), their
scores are -inf and they are not written.

Each program runs two partitions of 4 warps on its worker's work items (grid = num_workers x head_split, like the
Triton kernel; at 128 heads the two programs of a worker take 64 heads each and read each tile at the same time,
once from HBM):

- warpgroup 0 (default partition): the scores of the even tiles of each pair and the left half of the output,
  o_L [64, 256] fp32;
- warpgroup 1 (a worker partition): the scores of the odd tiles and the right half o_R.

KV tiles arrive by TMA in two tile slots (even tiles of an item in slot 0, odd tiles in slot 1) of 9 [64, 64]
chunks, in three groups with one mbarrier each: "L" (c_kv channels 0-255), "R" (256-511) and "E" (k_pe). A group is
reloaded with the next tile of its slot by the warpgroup that uses it last, as soon as it is done with it: warpgroup
0 owns L and E, warpgroup 1 owns R (the other warpgroup's uses are ordered before by the exchange barriers). Each
tile's score MMAs take the groups in the order they are released (as FlashMLA does): L, E, R in slot 0 (warpgroup 1
frees R after its p0' V0_R) and R, E, L in slot 1 (warpgroup 1 frees R as soon as its p1 V1_R has retired; L and E,
which holds p1, are freed by warpgroup 0's p1 V1_L, the pair's last MMA). Against L, E, R in both slots with slot
1's R freed after p0' V0_R (eleventh session, one H200, alternating runs): fp8 caches 376.2 / 376.8 -> 367.2 / 367.4
us at (128, 4096, 128), 113.4 -> 110.1 at (32, 4096, 128), 208.1 -> 203.8 at (128, 4096, 64); bf16 unchanged at 128
heads (289.2 / 295.1 vs 290.0 / 295.5, 84.0 / 84.8 vs 84.5 / 84.4), 53.5 -> 52.8 at (8, 8192, 128), 99.4 -> 98.0 at
(64, 4096, 16) q_len 2. Where warpgroup 1 reloads slot 1's R differs by cache type, each measured both ways: with an
fp8 cache as soon as p1 V1_R retires, before it waits for p0' (371.8 -> 364.7 us at (128, 4096, 128), 111.2 -> 108.4
at (32, 4096, 128)); with bf16 after queueing p0' V0_R behind p1 V1_R (that reload point was 1-4 % slower for bf16:
283.2 / 285.1 vs 286.3 / 288.0, 84.2 / 84.9 vs 86.0 / 86.4, 53.0 vs 55.0 at (8, 8192, 128)). Measured and dropped,
also FlashMLA's: warpgroup 0 issuing the next even tile's L-group score MMAs behind its p1 V1_L (scores carried
across the loop; same bits) spilled 656 vs 168 bytes and took 340.7 / 348.6 vs 282.6 / 295.7 us at (128, 4096, 128),
102.6 vs 84.2 at (32, 4096, 128), 413 vs 368 fp8kv. A separate loader warp was slower: its register budget
(setmaxnreg) made ptxas serialize every wgmma ("insufficient register resources"): 366 vs 300 us at (128, 4096, 128)
on one H200. So was one barrier per chunk (each chunk's score MMA issued once that chunk has landed, FlashMLA's
fine-grained TMA-GEMM pipelining): 295.4 vs 276.7 us at (128, 4096, 128), 88.0 vs 84.2 at (32, 4096, 128) (tenth
session; every wait comes with a warpgroup BAR.SYNC in the SASS).

The grouped layout (GROUPED, `grouped_layout`: bf16 caches, every page size). Copied one box per page, a tile
costs 36 TMA copies at page 16 (each of the 9 [64, 64] chunks as 4 row boxes) and 18 at page 32, against 9 at page
64, and the copies sit on the warpgroups' critical path. Here each c_kv half of a slot is stored as 8 boxes of 8
tokens x 4 chunks ([4, 8, 64], 4 KB each), and the MMAs read the half through a shared linear layout (_HALF_LAYOUT)
whose wgmma descriptors step 4 KB between 8-token groups and 1 KB between chunks. A page's tokens of a half are
adjacent 8-token groups in that layout, so each is one 4-D TMA copy ([page / 8 groups, 4 chunks, 8 tokens, 64]) from
the cache viewed as [rows / 8 groups, 9 chunks, 8 tokens, 64] (strides 8 x 576, 64, 576, 1 elements: TMA takes
strides in any order); k_pe keeps its page boxes. That is 12 copies per tile at page 16, 6 at page 32 and 3 on
pages of 64k (one per half of a tile, and k_pe; 9 chunk boxes in the standard layout). The score
MMAs index both operands with a zero the compiler cannot prove (`_score_group`): otherwise ptxas spilled their
descriptors, and that, not the copies (a TMA-only stream took the same time with every box shape) nor the tensor
cores (a wgmma loop on either layout, the same time), made the layout 15-20 % slower than the standard one at equal
copy counts. Same values in the same MMA k-steps in the same order, so the bits of the per-page layout and of
pages of 64. On one H200 (twenty-eighth session, alternating rounds, same bits; us): page 16, per-page boxes 437.2
and 114.9 at (128 / 32, 4096, 128), one 3-D copy per 8-token group 383.2 and 106.4, 4-D page copies 341.1 and 95.5,
with the unprovable zero 305.9 and 88.2 (68.1 -> 62.4 at (32, 4096, 32)); page 32, per-page boxes 299.4 and 89.4,
grouped 285.5 and 81.0. Pages of 64 (twenty-ninth session, standard -> grouped, same bits): 83.0 -> 78.9 and
84.1 -> 79.4 at (32, 4096, 128), 290.6 -> 278.5 and 291.0 -> 280.2 at (128, 4096, 128), 25.2 -> 24.7 at
(1, 8192, 128), 53.3 -> 51.1 at (8, 8192, 128), 60.5 -> 59.1 at (32, 4096, 32), 165.9 -> 164.2 at (128, 4096, 64),
95.6 -> 92.6 at (64, 4096, 16) q_len 2, 166.8 -> 164.5 at (128, 4096, 16) q_len 4, 139.6 -> 134.2 at
(32, 4096, 128) q_len 2 (the twenty-eighth session had 280.8 vs 276.8 at (128, 4096, 128) in one call). cp.async copies
from the warpgroups' 128 threads instead of TMA were no faster at page 16 and 27-37 % slower at page 64 (twenty-seventh
session, docs/perf_history.md).

One 64 x 512 fp32 accumulator is all the registers an SM has, so the output is split by columns, and the two
warpgroups alternate on pairs of tiles (K0, K1) with one running max m shared through shared memory (FlashMLA's
"seesaw" schedule, deepseek-ai/FlashMLA docs/20250422-new-kernel-deep-dive.md), here with exact base-2 rescales:

    [0] s0 = q K0^T;  m0 = max(m, rowmax s0);  p0 = 2^(s0 - m0);  o_L = o_L 2^(m - m0) + bf16(p0) V0_L
    [1] s1 = q K1^T;  m1 = max(m0, rowmax s1); p1 = 2^(s1 - m1);  o_R = o_R 2^(m - m1) + bf16(p1) V1_R
    [0] p0' = bf16(p0 2^(m0 - m1)) to shared memory;  o_L = o_L 2^(m0 - m1) + p1 V1_L  (p1 from shared memory)
    [1] o_R = o_R + p0' V0_R;  m <- m1

so each warpgroup's tensor-core work overlaps the other's softmax. P is rounded to bf16 once (p0' rounds
p0 2^(m0 - m1), a value <= 1 like p0); row sums l are kept in fp32 from unrounded P, one per warpgroup (l_L over
even tiles, l_R over odd tiles, both in the frame of m) and added at the end. The rounding points are those of
`mla_fast.numerics.KERNEL_NUMERICS["bf16"]`: one fp32 chain of L + R products per score, P in bf16, two fp32
rescales of the accumulator per tile on average, fp32 row sums from unrounded P.

Safety: TMA copies whole 64-token tiles, so the last tile of an item may hold cache slots past the item's KV_END
(NaN-poisoned slots are allowed). Their scores are removed with `gl.where` before the max; their V rows are set to
0 in shared memory before any P.V MMA reads them (NaN x 0 would be NaN). Rows that see no token give out = 0,
lse = -inf.

Performance (one H200, mla-bench, CUDA-graph replays; docs/perf_history.md): 276-288 us at (128, 4096, 128) (FlashMLA
243-245, the Triton kernel 443), 86-87 us at (32, 4096, 128) (FlashMLA 75, FlashInfer 81), 27-27.5 us at (1, 8192, 128)
(FlashInfer 27.5); MTP (benchmarks/mtp_bench.py) 574 vs 900 us for the Triton kernel at (128, 4096, 128) q_len 2, 102 vs
135 us at (64, 4096, 16) q_len 4. ncu:
the largest stall is warpgroup 1 waiting for the c_kv-left group of its next tile, which warpgroup 0 reloads only
after its last P.V of the pair; warpgroup 0 spilled 34 registers (smem descriptors; none at 128 heads since
the grouped layout's unprovable zero).
With PDL (launch's default on sm_90) the kernel calls gdc_launch_dependents at its start, so the reduce programs
are scheduled on SMs whose decode programs have finished and wait there (gdc_wait) for the rest: same bits, 0.4-0.8
us faster in graph replays (eighth session, two pairs each: 86.5 vs 87.3 us at (32, 4096, 128), 61.1 vs 61.5 at
(32, 4096, 16) q_len 2, 97.7 vs 98.4 at (64, 4096, 16) q_len 2; 27.4 vs 27.45 at (1, 8192, 128)). The Gluon fp8
kernel does not call it: no gain there (42.4 vs 42.4 us at (32, 4096, 16), 16.7 vs 16.1 at (1, 8192, 16)).

fp8 caches (KV_FP8; e4m3fn cache with bf16 or e4m3fn q): the same schedule on fp16 operands, with the shared memory
of the bf16 kernel (q 72 KB + two 72 KB tile slots + 8 KB: no room for a separate fp8 staging area). Each chunk
group's fp8 bytes arrive by TMA ([64, 64] boxes, 64-byte swizzle) in the upper half of the group's fp16 bytes
(`_staged_box`), and the warpgroup that computes the tile's scores expands them to fp16 in place (`_score_group`),
two chunks at a time, each pair's score MMAs issued before the next pair is expanded; on an item's last tile the V
rows past KV_END become 0 in the same pass. On every page size (SEESAW_FP8_GROUPED_PAGES, `grouped_layout`) the 4
boxes of a c_kv half are staged in a grouped layout instead, 8 boxes of 8 tokens x 4 chunks ([4, 8, 64] fp8, 64-byte
swizzled), so a page is one 4-D TMA copy (12 copies per tile at page 16 instead of 36; pages of 64k: one per half
instead of 4 chunk boxes) and the expansion reads the boxes through a shared linear layout (_STAGE8); the fp16
chunks it writes are those of the standard layout, so the MMAs and the bits do not change. One H200 (twenty-ninth
session, three alternating rounds, same bits; per-page boxes -> grouped, us): page 16 fp8kv 145.6 -> 122.0 and fp8
143.2 -> 119.4 at (32, 4096, 128), 478.1 -> 408.5 and 475.2 -> 404.9 at (128, 4096, 128); page 32 fp8kv 119.9 ->
112.5 at (32, 4096, 128), 404.2 -> 381.2 at (128, 4096, 128). With an fp8 cache the head split is a runtime value
(HEAD_SPLIT=0, `head_split`), so 64 and 128 heads at q_len 1 run one compile: with a constexpr split, 64 heads (one
program per worker) had a kernel of its own that ptxas allocated worse, and grouped staging on pages of 64 was up to
6 % slower there (348.8 -> 370.5 fp8kv at (128, 8192, 64); thirtieth session) while 1.6-3.5 % faster at 128 heads.
Thirty-first session, pages of 64, fp8kv / fp8, constexpr split and chunk boxes -> runtime split and grouped staging
(two device calls with fresh compiles, 5 alternating rounds, same bits, us): 353.3 -> 343.5 and 350.6 -> 339.0 /
351.4 -> 346.0 and 349.3 -> 343.6 at (128, 8192, 64); 188.7 -> 184.1 and 189.0 -> 184.9 / 186.6 -> 184.5 and 186.7 ->
185.5 at (128, 4096, 64); 356.2 -> 344.4 and 356.5 -> 345.5 / 352.1 -> 342.0 and 353.7 -> 343.7 at (128, 4096, 128);
106.0 -> 104.5 and 107.4 -> 104.0 / 105.0 -> 102.7 and 104.4 -> 102.8 at (32, 4096, 128); 106.3 -> 104.5 and 107.1
-> 103.9 / 104.4 -> 102.4 and 104.7 -> 103.1 at (32, 4096, 64) q_len 2; level at (16, 8192, 64) (68.3 / 68.0) and on
pages of 16 and 32 (within 0.8 %). The runtime split alone, chunk boxes, was 0-3 % slower than the constexpr one
(358.3 vs 353.3 at (128, 8192, 64) fp8kv): the gain is the grouped staging once both head counts share its compile.
bf16 caches keep the constexpr split: a runtime one there was 276.4 and 276.8 us at (128, 4096, 128) in the two
calls against 281.7 and 267.7 (the constexpr kernel itself 5 % apart between the calls), no better. q (bf16 or fp8)
is loaded by warpgroup 0 with plain loads and stored as fp16. Numerics: those of `KERNEL_NUMERICS["fp8kv"]` /
`["fp8"]` (mma="fp16"): the MMAs see the fp8 codes (exact in fp16) and q cast to fp16, one fp32 chain of L + R
products per score, P rounded to fp16 once, fp32 row sums from unrounded P, one 64-token P.V MMA per tile and half,
scales folded into the scores and the output.
Performance (one H200, graph replays, ninth session, mla-bench, fp8kv; the Triton staged path in brackets): 377.3 us at
(128, 4096, 128) [557.3] (bf16: 279.1), 113.2 at (32, 4096, 128) [153.1] (bf16: 84.3), 210.3 at (128, 4096, 64) [274.9],
67.8 at (8, 8192, 128) [86.4]. The expansion is what costs: with it left out (wrong values, timing only) the kernel took
264.5 and 81.5 us, faster than bf16 (half the bytes). Its register layout mattered most: with 16 bytes per thread on 2
threads per token, ncu counted 10.1-way bank conflicts on the shared stores (38.5 % of their wavefronts) and 11.7-way on
the loads (30.6 %) at (32, 4096, 128); 8 bytes per thread on 8 threads per token (_E4M3_BOX now) took 368.1 vs 434.9 us
at (128, 4096, 128) and 111.0 vs 128.4 at (32, 4096, 128). Expanding two chunks at a time, each pair's MMAs issued
before the next pair is expanded, took 438.7 vs 454.6 and 128.8 vs 131.0 (whole groups first). Measured and dropped
(with the 16-byte layout): a third partition (4 warps, 40 registers; the warpgroups at 232) that expanded every group as
soon as it landed, so that the warpgroups only waited for a ready barrier: 464.3 vs 451.5 us for the expansion in the
warpgroups (whole groups); without the async-proxy fences (racy, timing only): 454.0 vs 454.6, and without the in-place
barrier 475.2 vs 475.5, so neither the fences nor the barriers are the cost; the conversion as inline PTX
(cvt.rn.f16x2.e4m3x2 on each half of a 32-bit register, fewer byte shuffles on masked tiles): 475.5 us in one call,
451.5-456.8 for the plain cast in three others. Per tile the expansion reads 36 KB and writes 72 KB of shared memory and
converts 36864 values beside the MMAs' own shared-memory reads. fp8 MMAs instead (FlashMLA's route; its fp8 kernel takes
225.0 us at (128, 4096, 128)) need V transposed in shared memory: a prototype (tenth session, docs/perf_history.md; not
landed) with fp8 score MMAs on the raw boxes, each warpgroup transposing its V half into separate buffers and P x 256
rounded to e4m3 took 193.4 us with the transposes left out, but 354 us at best with them (354-486 us over four register
layouts, 440 on the tensor cores), no faster than this path (372-378 us in the same calls) and with e4m3 P.

The fp8 loader partition (LOADER, `fp8_loader`: e4m3fn caches on pages of 16, 32 and 64k, SEESAW_FP8_LOADER_PAGES). The
expansion in place moves 144 KB of shared memory per tile (the copy's 36 KB, then 36 KB read and 72 KB written) against
bf16's 72 KB. A third partition (`_fp8_loader`, 4 warps at 112 registers; the warpgroups at 200) instead loads each tile
from the cache with plain loads, converts it to fp16 in registers and stores the chunks into the slots: 72 KB per tile,
as bf16. The warpgroups then run the bf16 path on fp16 chunks (score operands indexed at a runtime zero:
`_score_mmas_at`) and, where they would issue a freed group's next copy, release it to the loader (`_reissue`: kv_empty,
one barrier per slot and group); the loader writes each pair's groups in the order they are freed (slot 0's E and L,
slot 1's R, E and L, slot 0's R), up to three groups in flight (a group's loads are issued up to two stores before its
own, and before the wait for its release). Tokens past KV_END load as 0. The same conversions, MMAs and order: the same
bits as the in-place path. One H200 (thirty-third session, config_ab, in place / loader with two groups in flight,
fp8kv, us): 409.5 / 373.7 at (128, 4096, 128) and 123.1 / 111.2 at (32, 4096, 128) on pages of 16, 383.5 / 375.5 and
113.8 / 110.8 on pages of 32. With the loader reading one cached row for every tile (wrong values, timing only) the
kernel took 283.3 and 84.4 us on pages of 64, our bf16's time: the loader's latency, not the warpgroups, is what is left
(a serial loader, one group at a time, took 434.6; with an L2 prefetch of the next pair's tiles 373.9). Three groups in
flight (thirty-fourth session; two / three, us): 370.1 / 345.3 at (128, 4096, 128), 110.0 / 103.0 at (32, 4096, 128),
199.8 / 187.6 at (128, 4096, 64), 121.9 / 108.3 at MTP (64, 4096, 16) q_len 4 on pages of 16, 371.3 / 348.6 on pages of
32; the L2 prefetch of the next pair then cost 1-6 % (355.9 vs 346.7 on pages of 64; on pages of 16, each token's page
probed by the threads, 354.8 vs 348.1). What holds the loader (SASS, ncu): ptxas puts all of its loads on one
scoreboard, so each group's first conversion waits for every load issued before it; each change that issued loads
earlier was slower (the loop rotated across pairs, two pairs per iteration, the block table a pair ahead, loads in
blocks; thirty-fourth session, docs/perf_history.md), and so was one store per group instead of one per chunk. What
helped (thirty-fifth session): asking the L2 for the pages with bulk prefetches (cp.async.bulk.prefetch.L2: no
registers, nothing to wait for, no scoreboard), first each pair's own at its start (`_prefetch_pages`), so that the
groups loaded later in the pair found them there; without / with it (config_ab, fp8kv, us): 346.2 / 337.0 at (128, 4096,
128), 102.7 / 99.9 at (32, 4096, 128), 187.9 / 181.1 at (128, 4096, 64), 107.9 / 103.6 at (64, 4096, 16) q_len 4 on
pages of 16 (349.8 / 338.3 at 128 heads on pages of 32). Prefetching the next pair's pages at the pair's start instead
took 340.4, 102.2, 185.5 and 107.7, the pair after it 349.9, 102.8, 229.9 and 126.8. What landed last: the next pair's
pages asked for late in each pair, once its last loads are issued (`_next_pair_units`: 8 units of 16 tokens, one
block-table entry each, read earlier in the pair; an item's first pair at its start): against this pair's at its start,
339.6 / 335.9, 100.1 / 97.9, 182.3 / 179.2, 103.8 / 101.7 on pages of 16, 341.7 / 339.0 and 341.0 / 338.3 at (128, 4096,
128) on pages of 32 and 64. Whole pages as the units (2 or 4 per pair) made ptxas spill 620 bytes into the warpgroups'
MMA loops on pages of 32 and 64 (454.3 vs 339.7 us); 16-token units compile as pages of 16 do. With the prefetch the
loader also beats the in-place expansion on pages of 64, which now take the loader too: in place / loader 346.4 / 334.9,
104.1 / 99.6, 185.4 / 180.8, 110.0 / 103.7 (before it the two were within 1-2 % there). Also measured and dropped then:
16-byte loads of two chunks at a time (412.8 vs 348.0 us at (128, 4096, 128) on pages of 16, +18-19 % at every shape),
and an expander partition (the warpgroups, or the partition itself, copying each freed group's fp8 bytes into its
staging with TMA, the partition expanding them in place): 510.4 / 494.1 vs 346.1 us on pages of 16, 408.8 / 398.0 vs
346.2 on pages of 64, since a staged copy can start only once its group is free, where plain loads start before.
Thirty-sixth session: slot 0's R group, whose loads are issued last in the pair, right before slot 1's E store waits
for every load in flight, is asked of the L1 at the pair's start (`_l1_prefetch_group`: `prefetch.global.L1`,
CCTL.E.PF1, which writes no register and takes no scoreboard): same bits, 331.5-332.8 vs 335.4-336.3 us at
(128, 4096, 128) on pages of 16 and 64 in two calls, 97.0-97.3 vs 97.7-98.0 at (32, 4096, 128), 175.7-176.6 vs
176.6-177.7 at (128, 4096, 64), level at MTP (64, 4096, 16) q_len 4. Asking the L1 for slot 1's L or E as well
(spilled 64 bytes; 350.3-363.9 us), loads bypassing the L1 (`.cg`: 351.6) or evicted first from the L2
(`evict_first`: 347.7) were slower.

Device only: Gluon kernels need a CUDA driver (sm_90); the interpreter cannot run them, so this kernel has GPU
tests only (tests/test_triton_gpu.py). `mla_fast.triton_decode.launch` calls it for `KernelConfig(kernel="gluon")`,
which `triton_decode.batch_config` chooses where `supported(batch)` and the rows per program exceed 16 (bf16) or 32
(fp8 caches, where the Gluon fp8 kernel's rule does not take the batch).

Constexprs reach the warp_specialize partitions only when the argument tuples are written inside the call: a tuple
built first and reused turned PAGE_SIZE, HEAD_SPLIT and HEAD_GROUP into runtime values (triton 3.6).
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

from mla_fast import planner
from mla_fast.triton_decode import INTERPRET

ROWS = 64  # packed rows per program: 64 heads of one query row (one wgmma M tile per warpgroup)
TILE = 64  # KV tokens per tile
CHUNK = 64  # channels per TMA box and per shared-memory chunk (128-byte swizzle)
GROUPS = 8  # 8-token TMA boxes per c_kv half of a tile in the grouped layout (`grouped_layout`)
L_DIM, R_DIM = 512, 64
N_CHUNKS = (L_DIM + R_DIM) // CHUNK  # 9: chunks 0-3 = c_kv left half, 4-7 = right half, 8 = k_pe
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

_ROWS = gl.constexpr(ROWS)
_TILE = gl.constexpr(TILE)
_CHUNK = gl.constexpr(CHUNK)
_L_DIM = gl.constexpr(L_DIM)
_R_DIM = gl.constexpr(R_DIM)
_N_CHUNKS = gl.constexpr(N_CHUNKS)
_LN2 = gl.constexpr(LN2)
_BATCH = gl.constexpr(planner.BATCH)
_PARTIAL_ROW = gl.constexpr(planner.PARTIAL_ROW)
_QO_START = gl.constexpr(planner.QO_START)
_QO_END = gl.constexpr(planner.QO_END)
_KV_START = gl.constexpr(planner.KV_START)
_KV_END = gl.constexpr(planner.KV_END)
_HEAD_START = gl.constexpr(planner.HEAD_START)

# chunk groups of a tile slot, each with its own barrier (kv_full[slot x 3 + group])
_GROUP_L = gl.constexpr(0)  # chunks 0-3: V_L (warpgroup 0's P.V) and the first score channels
_GROUP_R = gl.constexpr(1)  # chunks 4-7: V_R (warpgroup 1's P.V)
_GROUP_E = gl.constexpr(2)  # chunk 8: k_pe; after the scores of an odd tile it holds p1 for warpgroup 0
# an fp8 box [64 tokens, 64 channels] in registers (fp8 caches): 8 adjacent bytes of a token per thread, 8 threads per
# token, so that the box's loads (64-byte swizzle) and its fp16 chunk's stores (128-byte swizzle) are free of bank
# conflicts; 16 bytes per thread on 2 threads per token ([1, 16], [16, 2]) had 10-way store and 12-way load conflicts
_E4M3_BOX = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
_Q_BLOCK = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # q rows as loaded (fp8 caches)
# The grouped layout of a c_kv half (GROUPED: bf16 caches, `grouped_layout`): 8 boxes of 8 tokens x
# 4 chunks, box j = tokens 8 j .. 8 j + 7 stored [4 chunks][8 tokens][64 channels] (4 KB, 128-byte swizzled in
# 1 KB atoms), filled one page (PAGE_SIZE / 8 adjacent boxes) per TMA copy (_PAGE_LAYOUT). As a [64 tokens,
# 256 channels] shared linear layout (offset bit -> [token, channel]): the MMAs read it through descriptors with
# 4 KB between 8-token groups and 1 KB between chunks
_HALF_LAYOUT = gl.constexpr(gl.SharedLinearLayout([
    [0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32],  # bits 0-5: channels of a 128-byte row
    [1, 8], [2, 16], [4, 32],  # bits 6-8: tokens of an atom (the 128-byte swizzle XORs them into channel bits 3-5)
    [0, 64], [0, 128],  # bits 9-10: the chunk (1 KB each)
    [8, 0], [16, 0], [32, 0],  # bits 11-13: the box (8-token group, 4 KB each)
]))
_BOX_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))  # [4, 8, 64]
# a page of a half in the grouped layout, as one TMA copy writes it: [page / 8 groups, 4 chunks, 8 tokens, 64]
_PAGE_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4))
_GROUPS = gl.constexpr(GROUPS)
# fp8 caches in the grouped layout (GROUPED with KV_FP8): the 4 fp8 boxes of a c_kv half staged in its group's upper
# half (`_staged_box`) as 8 boxes of 8 tokens x 4 chunks ([4, 8, 64] fp8, 2 KB each, 64-byte swizzled in 512-byte
# atoms), a page of them one 4-D TMA copy (_STAGED_PAGE); read as [64 tokens, 256 channels] through _STAGE8
_STAGED_PAGE = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=4))
_STAGE8 = gl.constexpr(gl.SharedLinearLayout([
    [0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32],  # bits 0-5: channels of a 64-byte row
    [1, 0], [2, 16], [4, 32],  # bits 6-8: tokens of an atom (the 64-byte swizzle XORs token bits 1-2 into
    # channel bits 4-5)
    [0, 64], [0, 128],  # bits 9-10: the chunk (512 bytes each)
    [8, 0], [16, 0], [32, 0],  # bits 11-13: the box (8-token group, 2 KB each)
]))


@gluon.jit
def _worker_items(WORKER_INDPTR, worker, num_items, ONE_ITEM: gl.constexpr):
    """[begin, end) of `worker`'s work items: from worker_indptr, or with ONE_ITEM (WorkPlan.one_item_per_worker)
    item `worker` if there is one, with no load (the first item's loads then wait for no worker range)."""
    if ONE_ITEM:
        begin = worker
        end = gl.minimum(worker + 1, gl.maximum(num_items, worker))  # worker + 1 if worker < num_items, else empty
    else:
        begin = gl.load(WORKER_INDPTR + worker)
        end = gl.load(WORKER_INDPTR + worker + 1)
    return begin, end


@gluon.jit
def _program(head_split, HEAD_SPLIT: gl.constexpr):
    """(worker, head part) of this program: head_split programs per worker (HEAD_SPLIT, or the runtime head_split
    where HEAD_SPLIT is 0), one head group each."""
    pid = gl.program_id(0)
    split = head_split if HEAD_SPLIT == 0 else HEAD_SPLIT  # programs per worker
    return pid // split, pid % split


@gluon.jit
def _item(WORK_ITEMS, SEQ_LENS, QO_INDPTR, it, head_part, HEAD_GROUP: gl.constexpr):
    """Work item `it` as this program sees it: request, workspace row (-1: unsplit), first query row, query rows,
    token range, first of its HEAD_GROUP heads, and the causal limit of its first query row (row r of a request
    with q_len n and seq_len s sees tokens < s - n + r + 1)."""
    item = WORK_ITEMS + it * 8
    b = gl.load(item + _BATCH)
    qo_start = gl.load(item + _QO_START)
    req_qo_start = gl.load(QO_INDPTR + b)
    limit_0 = gl.load(SEQ_LENS + b) - (gl.load(QO_INDPTR + b + 1) - req_qo_start) + (qo_start - req_qo_start) + 1
    return (b, gl.load(item + _PARTIAL_ROW), qo_start, gl.load(item + _QO_END) - qo_start,
            gl.load(item + _KV_START), gl.load(item + _KV_END), gl.load(item + _HEAD_START) + head_part * HEAD_GROUP,
            limit_0)


@gluon.jit
def _chunk(kv_smem, slot, c: gl.constexpr):
    """Chunk c [64 tokens, 64 channels] of tile slot `slot`: kv_smem = (c_kv [2, 64, 512], k_pe [2, 64, 64]),
    128-byte swizzled; chunks 0-7 are c_kv column blocks, chunk 8 is k_pe."""
    ckv, kpe = kv_smem
    if c < 8:
        return ckv.index(slot).slice(c * _CHUNK, _CHUNK, dim=1)
    else:
        return kpe.index(slot)


@gluon.jit
def _q_chunk(q_smem, c: gl.constexpr):
    """Chunk c [64 rows, 64 channels] of q: q_smem = (q_nope [64, 512], q_pe [64, 64])."""
    q_nope, q_pe = q_smem
    if c < 8:
        return q_nope.slice(c * _CHUNK, _CHUNK, dim=1)
    else:
        return q_pe


@gluon.jit
def _half_box(kv_smem, slot, half, j):
    """Box j [4 chunks, 8 tokens, 64] (tokens 8 j .. 8 j + 7) of c_kv half `half` of tile slot `slot` in the grouped
    layout: kv_smem[0] = [2 slots x 2 halves x 8 boxes, 4, 8, 64]."""
    return kv_smem[0].index((slot * 2 + half) * _GROUPS + j)


@gluon.jit
def _v_half(kv_smem, slot, half: gl.constexpr, HALVES: gl.constexpr, zero=0):
    """V half `half` [64 tokens, 256 channels] of tile slot `slot`: the B operand of a P.V MMA (N contiguous), and
    transposed a score operand. With HALVES (a bf16 cache in the grouped layout), the half's 8 boxes (`_half_box`,
    from box `zero`: 0, or the unprovable zero of `_score_group`) read through _HALF_LAYOUT."""
    if HALVES:
        return _half_box(kv_smem, slot, half, zero)._reinterpret(gl.bfloat16, [_TILE, _L_DIM // 2], _HALF_LAYOUT)
    else:
        return kv_smem[0].index(slot).slice(half * (_L_DIM // 2), _L_DIM // 2, dim=1)


@constexpr_function
def _halves(grouped, kv_fp8):
    """Whether the tile slots hold the c_kv halves in the grouped layout (GROUPED with a bf16 cache; with an fp8
    cache GROUPED groups only the TMA staging of its fp8 boxes, and the slots keep the standard fp16 chunks)."""
    return grouped and not kv_fp8


@constexpr_function
def _group_first(g):
    """First chunk of chunk group g (L: 0-3, R: 4-7, E: 8)."""
    return (0, 4, 8)[g]


@constexpr_function
def _group_end(g):
    """One past the last chunk of chunk group g."""
    return (4, 8, 9)[g]


@gluon.jit
def _fp8_box(kv8, slot, h: gl.constexpr):
    """The h-th 4 KB of tile slot `slot` (h = 2 c + half of fp16 chunk c, h < 18) as an fp8 box [64 tokens, 64
    channels] (64-byte swizzle): kv8 = the fp8 views (c_kv [2 x 16, 64, 64], k_pe [2 x 2, 64, 64]) of kv_smem."""
    ckv8, kpe8 = kv8
    if h < 16:
        return ckv8.index(slot * 16 + h)
    else:
        return kpe8.index(slot * 2 + h - 16)


@constexpr_function
def _staged_box(g, j):
    """Where fp8 box j of chunk group g lands: the upper half of the group's fp16 bytes (h of `_fp8_box`), so that
    the expansion to fp16 (`_score_group`) can run in place."""
    first, n = (0, 4, 8)[g], (4, 4, 1)[g]
    return 2 * first + n + j


@gluon.jit
def _staged(kv8, slot, g: gl.constexpr, j: gl.constexpr, GROUPED: gl.constexpr):
    """fp8 box j [64 tokens, 64 channels] of chunk group g as staged in tile slot `slot`: its own 4 KB
    (`_staged_box`), or with GROUPED (c_kv halves) chunk j of the half's grouped staging (_STAGE8)."""
    if GROUPED and g != _GROUP_E:
        stage = _fp8_box(kv8, slot, _staged_box(g, 0))._reinterpret(gl.float8e4nv, [_TILE, 4 * _CHUNK], _STAGE8)
        return stage.slice(j * _CHUNK, _CHUNK, dim=1)
    else:
        return _fp8_box(kv8, slot, _staged_box(g, j))


@gluon.jit
def _grouped_page(kv_smem, kv8, slot, g: gl.constexpr, first: gl.constexpr, PER: gl.constexpr, KV_FP8: gl.constexpr):
    """Boxes first .. first + PER - 1 (a page's 8-token groups) of c_kv half g of tile slot `slot` in the grouped
    layout, as one 4-D TMA copy writes them ([PER, 4 chunks, 8 tokens, 64]): the bf16 half (`_half_box`,
    _PAGE_LAYOUT), or with KV_FP8 the half's fp8 staging (`_staged`: 2 KB per group, _STAGED_PAGE)."""
    if KV_FP8:
        return _fp8_box(kv8, slot, _staged_box(g, 0) + first // 2)._reinterpret(
            gl.float8e4nv, [PER, 4, _TILE // _GROUPS, _CHUNK], _STAGED_PAGE)
    else:
        return _half_box(kv_smem, slot, g, first)._reinterpret(gl.bfloat16, [PER, 4, _TILE // _GROUPS, _CHUNK],
                                                              _PAGE_LAYOUT)


@gluon.jit
def _issue_group(kv_desc, kvg_desc, kv_smem, kv8, kv_full, slot, rows, g: gl.constexpr, KV_FP8: gl.constexpr,
                 BOXES: gl.constexpr, GROUPED: gl.constexpr):
    """TMA copies of chunk group g of a tile into tile slot `slot` (one barrier): the chunks themselves, or with
    KV_FP8 their fp8 boxes into the group's upper half (`_staged_box`). `rows` (`_tile_rows`): the first cache rows
    of the tile's BOXES row boxes; each chunk is copied as BOXES boxes of 64 / BOXES rows (one per page of pages
    smaller than a tile). With GROUPED the c_kv halves (L, R) are copied instead into the grouped layout, one 4-D
    copy per page (kvg_desc: the page's 8-token groups of the half's 4 chunks, boxes i x PER .. i x PER + PER - 1),
    and k_pe as its BOXES page boxes; with KV_FP8 too, the half's fp8 bytes into its grouped staging (`_staged`:
    a page's PER groups are PER x 2 KB there)."""
    n: gl.constexpr = _group_end(g) - _group_first(g)
    BOX: gl.constexpr = _TILE // BOXES
    GROUP: gl.constexpr = _TILE // _GROUPS
    PER: gl.constexpr = BOX // GROUP  # with GROUPED: the 8-token groups of a page (group rows[i] / 8 of the cache on)
    bar = kv_full.index(slot * 3 + g)
    if GROUPED and g != _GROUP_E:
        mbarrier.expect(bar, n * _TILE * _CHUNK * (1 if KV_FP8 else 2))
        for i in gl.static_range(BOXES):
            tma.async_copy_global_to_shared(kvg_desc, [rows[i] // GROUP, _group_first(g), 0, 0], bar,
                                            _grouped_page(kv_smem, kv8, slot, g, i * PER, PER, KV_FP8))
    elif KV_FP8:
        mbarrier.expect(bar, n * _TILE * _CHUNK)
        for j in gl.static_range(n):
            box = _fp8_box(kv8, slot, _staged_box(g, j))
            for i in gl.static_range(BOXES):
                tma.async_copy_global_to_shared(kv_desc, [rows[i], (_group_first(g) + j) * _CHUNK], bar,
                                                box.slice(i * BOX, BOX, dim=0))
    else:
        mbarrier.expect(bar, n * _TILE * _CHUNK * 2)
        for c in gl.static_range(_group_first(g), _group_end(g)):
            chunk = _chunk(kv_smem, slot, c)
            for i in gl.static_range(BOXES):
                tma.async_copy_global_to_shared(kv_desc, [rows[i], c * _CHUNK], bar, chunk.slice(i * BOX, BOX, dim=0))


@gluon.jit
def _issue_own(WG: gl.constexpr, kv_desc, kvg_desc, kv_smem, kv8, kv_full, slot, rows, KV_FP8: gl.constexpr,
               BOXES: gl.constexpr, GROUPED: gl.constexpr):
    """The chunk groups warpgroup WG loads (and releases): 0 -> L and E, 1 -> R."""
    if WG == 0:
        _issue_group(kv_desc, kvg_desc, kv_smem, kv8, kv_full, slot, rows, _GROUP_L, KV_FP8, BOXES, GROUPED)
        _issue_group(kv_desc, kvg_desc, kv_smem, kv8, kv_full, slot, rows, _GROUP_E, KV_FP8, BOXES, GROUPED)
    else:
        _issue_group(kv_desc, kvg_desc, kv_smem, kv8, kv_full, slot, rows, _GROUP_R, KV_FP8, BOXES, GROUPED)


@gluon.jit
def _reissue(io, slot: gl.constexpr, row, walk, g: gl.constexpr, more, KV_FP8: gl.constexpr, PAGE_SIZE: gl.constexpr,
             BOXES: gl.constexpr, GROUPED: gl.constexpr, LOADER: gl.constexpr):
    """Chunk group g of a tile slot is free (its last reader is done). With LOADER: released to the loader
    partition (kv_empty, on every tile the slot held: `_fp8_loader` counts them); else, if `more` (the slot's next
    tile exists), that tile's group copied into it (`row`: `_issue_rows`). io: (kv_desc, kvg_desc, kv_smem, kv8,
    kv_full, kv_empty)."""
    kv_desc, kvg_desc, kv_smem, kv8, kv_full, kv_empty = io
    if LOADER:
        mbarrier.arrive(kv_empty.index(slot * 3 + g))
    elif more:
        _issue_group(kv_desc, kvg_desc, kv_smem, kv8, kv_full, slot, _issue_rows(row, walk, PAGE_SIZE, BOXES), g,
                     KV_FP8, BOXES, GROUPED)


@gluon.jit
def _expanded(kv_smem, slot, c: gl.constexpr, box, n_valid=0, MASKED: gl.constexpr = False):
    """Store an fp8 box (registers, _E4M3_BOX) as fp16 chunk c of a slot; with MASKED tokens >= n_valid as 0."""
    x = box.to(gl.float16)
    if MASKED:
        x = gl.where((gl.arange(0, _TILE, gl.SliceLayout(1, _E4M3_BOX)) < n_valid)[:, None], x, 0.0)
    _chunk(kv_smem, slot, c).store(x)


@gluon.jit
def _tile_row(BLOCK_TABLE, b, stride_bt, kv_start, t, n_tiles, PAGE_SIZE: gl.constexpr):
    """First cache row (of the [pages x page_size, 576] view) of tile t of an item; 0 past the item's last tile."""
    tok = kv_start + t * _TILE
    page = gl.load(BLOCK_TABLE + b * stride_bt + tok // PAGE_SIZE, mask=t < n_tiles, other=0)
    return page * PAGE_SIZE + tok % PAGE_SIZE


@gluon.jit
def _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, t, n_tiles, PAGE_SIZE: gl.constexpr, BOXES: gl.constexpr):
    """First cache rows (of the [pages x page_size, 576] view) of the BOXES row boxes of tile t of an item: one box
    per tile (pages of a multiple of 64), or one per page (pages of 64 / BOXES tokens; items start on tile
    boundaries, so each box is one whole page). A box at or past KV_END takes the first box's row: no block-table
    entry past the item's tokens is read, and its slots are zeroed and masked as any slot past KV_END. All 0 past the
    item's last tile."""
    row0 = _tile_row(BLOCK_TABLE, b, stride_bt, kv_start, t, n_tiles, PAGE_SIZE)
    rows = (row0,)
    for j in gl.static_range(1, BOXES):
        tok = kv_start + t * _TILE + j * (_TILE // BOXES)  # first token of box j
        ok = (t < n_tiles) & (tok < kv_end)
        page = gl.load(BLOCK_TABLE + b * stride_bt + tok // PAGE_SIZE, mask=ok, other=0)
        rows = rows + (gl.where(ok, page * PAGE_SIZE + tok % PAGE_SIZE, row0),)
    return rows


@gluon.jit
def _issue_rows(rows_or_tile, walk, PAGE_SIZE: gl.constexpr, BOXES: gl.constexpr):
    """The cache rows of a tile about to be issued: `rows_or_tile` as loaded early (one box per tile), or with one
    box per page loaded now (`_tile_rows`) from the tile index `rows_or_tile` and the item's walk (block table,
    request, its stride, kv_start, kv_end, n_tiles)."""
    if BOXES == 1:
        rows = rows_or_tile
    else:
        BLOCK_TABLE, b, stride_bt, kv_start, kv_end, n_tiles = walk
        rows = _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, rows_or_tile, n_tiles, PAGE_SIZE, BOXES)
    return rows


@gluon.jit
def _score_mmas(s, q_smem, kv_smem, slot, c0: gl.constexpr, c1: gl.constexpr):
    """Issue the score MMAs of chunks c0 .. c1 - 1 of a tile slot onto s (asynchronous)."""
    for c in gl.static_range(c0, c1):
        s = warpgroup_mma(_q_chunk(q_smem, c), _chunk(kv_smem, slot, c).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _at_zero(buf, zero):
    """A 2-D shared buffer as index `zero` (a runtime 0: see `_score_group`) of itself viewed as [1, rows, cols]: the
    same bytes, but an MMA operand's wgmma descriptor is then computed where the MMA is issued."""
    return buf._reinterpret(buf.dtype, [1] + buf.shape, buf.layout).index(zero)


@gluon.jit
def _score_mmas_at(s, q_smem, kv_smem, slot, c0: gl.constexpr, c1: gl.constexpr, zero):
    """`_score_mmas` with both operands indexed with `zero`, so that their wgmma descriptors are computed where the
    MMAs are issued (LOADER: its warpgroups spilled the hoisted ones)."""
    return _score_mmas(s, (_at_zero(q_smem[0], zero), _at_zero(q_smem[1], zero)), kv_smem, slot + zero, c0, c1)


@gluon.jit
def _expanded_pair(kv_smem, slot, c: gl.constexpr, x0, x1, n_valid):
    """Store two fp8 boxes (registers) as fp16 chunks c and c + 1 of a slot, tokens >= n_valid as 0 on an item's last
    tile (cache slots past KV_END may hold NaN; only V rows need it, the scores are selected), then order the stores
    before the async proxy (this warpgroup's MMAs; a thread barrier must follow)."""
    if n_valid < _TILE:
        _expanded(kv_smem, slot, c, x0, n_valid, True)
        _expanded(kv_smem, slot, c + 1, x1, n_valid, True)
    else:
        _expanded(kv_smem, slot, c, x0, n_valid, False)
        _expanded(kv_smem, slot, c + 1, x1, n_valid, False)
    fence_async_shared()


@gluon.jit
def _score_group(s, q_smem, kv_smem, kv8, kv_full, slot, phase, n_valid, g: gl.constexpr, KV_FP8: gl.constexpr,
                 GROUPED: gl.constexpr, zero, AT_ZERO: gl.constexpr = False):
    """Wait for chunk group g of a tile slot, then issue its score MMAs onto s (asynchronous). With KV_FP8 the group
    is expanded from its fp8 boxes (upper half of its bytes, `_staged_box`) to fp16 chunks in place first, two
    chunks at a time, each pair's MMAs issued once it is stored: box j becomes chunk first + j, so chunks first and
    first + 1 lie below the boxes, and chunks first + 2 and first + 3 overwrite all four boxes (read by every thread
    before: the barrier). With GROUPED a c_kv half is one MMA call of K = 256 on its grouped layout (the same 16
    k-steps in the same order as four chunks), both operands indexed with `zero` (the pair index >> 30: always 0,
    but not provably so), so that their wgmma descriptors are computed where the MMAs are issued instead of once
    ahead of the loops and held, which made ptxas spill them (200 bytes at page 16) and reload them between the
    MMAs (timings: the module docstring). The standard layout's chunks do not need it (no gain measured,
    twenty-fourth session)."""
    mbarrier.wait(kv_full.index(slot * 3 + g), phase)
    f: gl.constexpr = _group_first(g)
    if _halves(GROUPED, KV_FP8) and g != _GROUP_E:
        q_nope = _at_zero(q_smem[0], zero)
        q_half = q_nope.slice(f * _CHUNK, _L_DIM // 2, dim=1)  # [64 rows, 256]
        k_half = _v_half(kv_smem, slot, g, GROUPED, zero).permute((1, 0))  # [256, 64 tokens]
        s = warpgroup_mma(q_half, k_half, s, is_async=True)  # [64 rows, 64 tokens]
    elif not KV_FP8 and AT_ZERO:
        s = _score_mmas_at(s, q_smem, kv_smem, slot, f, _group_end(g), zero)
    elif not KV_FP8:
        s = _score_mmas(s, q_smem, kv_smem, slot, f, _group_end(g))
    elif g == _GROUP_E:
        x = _fp8_box(kv8, slot, _staged_box(g, 0)).load(_E4M3_BOX)
        gl.thread_barrier()  # the box is read before chunk 8 overwrites it
        _expanded(kv_smem, slot, f, x, n_valid, False)
        fence_async_shared()
        gl.thread_barrier()
        s = _score_mmas(s, q_smem, kv_smem, slot, f, f + 1)
    else:
        x0 = _staged(kv8, slot, g, 0, GROUPED).load(_E4M3_BOX)
        x1 = _staged(kv8, slot, g, 1, GROUPED).load(_E4M3_BOX)
        _expanded_pair(kv_smem, slot, f, x0, x1, n_valid)
        x2 = _staged(kv8, slot, g, 2, GROUPED).load(_E4M3_BOX)
        x3 = _staged(kv8, slot, g, 3, GROUPED).load(_E4M3_BOX)
        gl.thread_barrier()
        s = _score_mmas(s, q_smem, kv_smem, slot, f, f + 2)
        _expanded_pair(kv_smem, slot, f + 2, x2, x3, n_valid)
        gl.thread_barrier()
        s = _score_mmas(s, q_smem, kv_smem, slot, f + 2, f + 4)
    return s


@constexpr_function
def _score_order(slot, i):
    """The chunk group whose scores a slot issues i-th: slot 0 L, E, R; slot 1 R, E, L (`_scores`)."""
    return (_GROUP_L, _GROUP_E, _GROUP_R)[i if slot == 0 else 2 - i]


@gluon.jit
def _scores(q_smem, kv_smem, kv8, kv_full, slot, phase, n_valid, s_layout: gl.constexpr, KV_FP8: gl.constexpr,
            GROUPED: gl.constexpr, zero, AT_ZERO: gl.constexpr = False):
    """s = q K^T over the 9 chunks of a tile slot [64, 64] fp32 (one accumulator chain), each chunk group's MMAs
    issued once its copies have landed (and with KV_FP8 been expanded), in the order the previous pair released the
    groups: slot 0 L, E, R (R last: warpgroup 1's p0' V0_R), slot 1 R, E, L (L and E last: warpgroup 0's p1 V1_L)."""
    s = gl.zeros([_ROWS, _TILE], gl.float32, s_layout)
    for i in gl.static_range(3):
        s = _score_group(s, q_smem, kv_smem, kv8, kv_full, slot, phase, n_valid, _score_order(slot, i), KV_FP8,
                         GROUPED, zero, AT_ZERO)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def _load_q(Q, q_smem, q_full, q_empty, n_items, qo, n_q, head_start, stride_qt, stride_qh, HEAD_GROUP: gl.constexpr):
    """Warpgroup 0 with an fp8 cache: an item's q [64 packed rows, 576] (bf16 or e4m3fn, rows past its n_q query
    rows as 0) from Q into q_smem as fp16, stored once warpgroup 1 is done with the previous item's (q_empty); then
    q_full. The loads are issued before that wait."""
    m = gl.arange(0, _ROWS, gl.SliceLayout(1, _Q_BLOCK))  # [M] packed rows
    q_row = m // HEAD_GROUP
    row_ptr = Q + (qo + q_row).to(gl.int64) * stride_qt + (head_start + m % HEAD_GROUP) * stride_qh  # [M]
    ok = (q_row < n_q)[:, None]  # [M, 1]
    q_nope = gl.load(row_ptr[:, None] + gl.arange(0, _L_DIM, gl.SliceLayout(0, _Q_BLOCK))[None, :], mask=ok,
                     other=0.0)  # [M, L]
    q_pe = gl.load(row_ptr[:, None] + _L_DIM + gl.arange(0, _R_DIM, gl.SliceLayout(0, _Q_BLOCK))[None, :], mask=ok,
                   other=0.0)  # [M, R]
    mbarrier.wait(q_empty, (n_items & 1) ^ 1)
    q_smem[0].store(q_nope.to(gl.float16))
    q_smem[1].store(q_pe.to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(q_full)


@gluon.jit
def _masked(s, t0, kv_end, limit, qk_scale, s_layout: gl.constexpr):
    """Scores in log2 units; tokens at or past kv_end or a row's causal limit (-1 for rows past the item's query
    rows) -> -inf (selected, never multiplied)."""
    tok = t0 + gl.arange(0, _TILE, gl.SliceLayout(0, s_layout))  # [N]
    return gl.where((tok < kv_end)[None, :] & (tok[None, :] < limit[:, None]), s * qk_scale, float("-inf"))


@gluon.jit
def _zero_tail(kv_smem, slot, first: gl.constexpr, n_valid, HALVES: gl.constexpr):
    """Set V rows >= n_valid of chunks first..first+3 of a slot to 0 (cache slots past KV_END may hold NaN), then
    make the stores visible to the MMAs (async proxy). Only the calling warpgroup reads that V half, and the tile's
    scores are done by then (its own, or the other warpgroup's, published before the exchange barrier it waited)."""
    if HALVES:  # the grouped layout (`_v_half`), box by box ([4 chunks, 8 tokens, 64 channels] each)
        blk3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [4, 1, 1], [2, 1, 0])
        tok = gl.arange(0, _TILE // _GROUPS, gl.SliceLayout(0, gl.SliceLayout(2, blk3)))  # [8] tokens of a box
        for j in gl.static_range(_GROUPS):
            box = _half_box(kv_smem, slot, first // 4, j)
            keep3 = (j * (_TILE // _GROUPS) + tok < n_valid)[None, :, None]  # [1, 8, 1]
            box.store(gl.where(keep3, box.load(blk3), 0.0).to(gl.bfloat16))
    else:
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        keep = (gl.arange(0, _TILE, gl.SliceLayout(1, blk)) < n_valid)[:, None]  # [N, 1]
        for c in gl.static_range(first, first + 4):
            chunk = _chunk(kv_smem, slot, c)
            chunk.store(gl.where(keep, chunk.load(blk), 0.0).to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _alpha(m_old, m_new):
    """2^(m_old - m_new): 0 when m_old = -inf (nothing accumulated yet); m_new = -inf counts as 0 (no NaN)."""
    return gl.exp2(m_old - gl.where(m_new == float("-inf"), 0.0, m_new))


@gluon.jit
def _store_half(acc, l_sum, m_i, kv_scale, partial_row, qo_start, n_q, head_start, col0: gl.constexpr,
                write_lse: gl.constexpr, OUT, LSE, O_PART, LSE_PART, stride_ot, stride_oh, stride_lt, stride_pt,
                stride_ph, stride_plt, HEAD_GROUP: gl.constexpr, o_layout: gl.constexpr):
    """Normalise one [64, 256] half, unscale, write out (bf16) or the fp32 workspace; lse (natural log) if asked.
    Packed row m is query row qo_start + m // HEAD_GROUP, head head_start + m % HEAD_GROUP (rows past the item's
    n_q query rows are not written)."""
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    has_tok = l_sum != 0.0  # l >= 0, or NaN from a NaN input: then lse is NaN too, not -inf
    o_scale = kv_scale / gl.where(has_tok, l_sum, 1.0)  # [M]
    o = acc * gl.convert_layout(o_scale, row_l)[:, None]
    m = gl.arange(0, _ROWS, row_l)  # [M]
    q_row = m // HEAD_GROUP  # [M] query row of the item
    h = head_start + m % HEAD_GROUP  # [M]
    ok = q_row < n_q
    cols = col0 + gl.arange(0, _L_DIM // 2, gl.SliceLayout(0, o_layout))  # [256]
    lse = gl.convert_layout(gl.where(has_tok, (m_i + gl.log2(gl.where(has_tok, l_sum, 1.0))) * _LN2,
                                     float("-inf")), row_l)
    if partial_row < 0:
        t = (qo_start + q_row).to(gl.int64)  # [M]
        gl.store(OUT + t[:, None] * stride_ot + h[:, None] * stride_oh + cols[None, :], o.to(gl.bfloat16),
                 mask=ok[:, None])
        if write_lse:
            gl.store(LSE + t * stride_lt + h, lse, mask=ok)
    else:
        r = (partial_row + q_row).to(gl.int64)  # [M] workspace rows
        gl.store(O_PART + r[:, None] * stride_pt + h[:, None] * stride_ph + cols[None, :], o, mask=ok[:, None])
        if write_lse:
            gl.store(LSE_PART + r * stride_plt + h, lse, mask=ok)


@gluon.jit
def _pv_p0(acc, kv_smem, p0_smem, kv_full, xbar, t0, kv_end, ph0, xph, KV_FP8: gl.constexpr, HALVES: gl.constexpr):
    """Warpgroup 1: o_R += p0' V0_R (asynchronous) once warpgroup 0 has published p0' (xbar 2)."""
    mbarrier.wait(xbar.index(2), xph)
    mbarrier.wait(kv_full.index(_GROUP_R), ph0)
    if not KV_FP8 and kv_end - t0 < _TILE:  # (fp8: zeroed by the expansion)
        _zero_tail(kv_smem, 0, 4, kv_end - t0, HALVES)
    return warpgroup_mma(p0_smem, _v_half(kv_smem, 0, 1, HALVES), acc, is_async=True)


@gluon.jit
def _warpgroup(WG: gl.constexpr, Q, q_desc, kv_desc, kvg_desc, q_smem, kv_smem, kv8, p0_smem, m_smem, l_smem, q_full,
               q_empty, kv_full, xbar, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS, WORKER_INDPTR, num_items, OUT, LSE,
               O_PART, LSE_PART, Q_SCALE, KV_SCALE, sm_scale_log2, num_heads, stride_qt, stride_qh, stride_bt,
               stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt, PAGE_SIZE: gl.constexpr,
               head_split, HEAD_SPLIT: gl.constexpr, HEAD_GROUP: gl.constexpr, KV_FP8: gl.constexpr,
               ONE_ITEM: gl.constexpr, GROUPED: gl.constexpr, kv_empty, LOADER: gl.constexpr):
    """Warpgroup WG (0: even tiles, o_L; 1: odd tiles, o_R) of the seesaw schedule (module docstring).

    Exchange barriers xbar: 0 = m0 ready (WG 0 -> 1), 1 = m1 ready (1 -> 0), 2 = p0' ready (0 -> 1), 3 = p1 ready
    (1 -> 0), 4 = l_L ready (0 -> 1), 5 = l_R ready (1 -> 0). m_smem holds m0 and m1 [2, 64], l_smem l_L and l_R.
    q_empty: warpgroup 1 is done with an item (warpgroup 0 then loads the next item's q). With KV_FP8 the operands
    are fp16 (P too), q is loaded from Q and converted by warpgroup 0, and each warpgroup expands the fp8 groups of
    the tile it scores (`_score_group`).
    """
    BOXES: gl.constexpr = tile_boxes(PAGE_SIZE)  # TMA row boxes per tile: 1, or one per page (pages of 16, 32)
    HALVES: gl.constexpr = _halves(GROUPED, KV_FP8)  # the P.V operands in the grouped layout
    EXPAND: gl.constexpr = KV_FP8 and not LOADER  # fp8 tiles expanded by the warpgroups (LOADER: fp16 tiles arrive)
    io = (kv_desc, kvg_desc, kv_smem, kv8, kv_full, kv_empty)  # what `_reissue` needs
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    HALF: gl.constexpr = _L_DIM // 2
    op: gl.constexpr = p0_smem.dtype  # MMA operand dtype: bf16, or fp16 for fp8 caches
    worker, head_part = _program(head_split, HEAD_SPLIT)
    kv_scale = gl.load(KV_SCALE)
    qk_scale = sm_scale_log2 * gl.load(Q_SCALE) * kv_scale  # scores in log2 units, as the Triton kernel
    uses0 = 0  # tiles consumed from slot 0 / slot 1 (barrier phases)
    uses1 = 0
    pairs = 0
    n_items = 0
    item_begin, item_end = _worker_items(WORKER_INDPTR, worker, num_items, ONE_ITEM)
    for it in range(item_begin, item_end):
        b, partial_row, qo, n_q, kv_start, kv_end, head_start, limit_0 = _item(
            WORK_ITEMS, SEQ_LENS, QO_INDPTR, it, head_part, HEAD_GROUP)
        n_tiles = gl.cdiv(kv_end - kv_start, _TILE)
        walk = (BLOCK_TABLE, b, stride_bt, kv_start, kv_end, n_tiles)  # the item's block-table walk (_issue_rows)
        if WG == 0 and not KV_FP8:  # q, once warpgroup 1 is done with the previous item: 64 // HEAD_GROUP query rows of
            # HEAD_GROUP heads (rows past the item's n_q are loaded from the next tokens or zero-filled, never used)
            mbarrier.wait(q_empty, (n_items & 1) ^ 1)
            mbarrier.expect(q_full, _N_CHUNKS * _ROWS * _CHUNK * 2)
            for j in gl.static_range(_ROWS // HEAD_GROUP):
                for c in gl.static_range(_N_CHUNKS):
                    tma.async_copy_global_to_shared(q_desc, [(qo + j) * num_heads + head_start, c * _CHUNK], q_full,
                                                    _q_chunk(q_smem, c).slice(j * HEAD_GROUP, HEAD_GROUP, dim=0))
        # this warpgroup's groups of the first two tiles (both slots are free: see the module docstring)
        if not LOADER and n_tiles > 0:
            _issue_own(WG, kv_desc, kvg_desc, kv_smem, kv8, kv_full, 0,
                       _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, 0, n_tiles, PAGE_SIZE, BOXES), KV_FP8,
                       BOXES, GROUPED)
        if not LOADER and n_tiles > 1:
            _issue_own(WG, kv_desc, kvg_desc, kv_smem, kv8, kv_full, 1,
                       _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, 1, n_tiles, PAGE_SIZE, BOXES), KV_FP8,
                       BOXES, GROUPED)
        if WG == 0 and KV_FP8:  # q (bf16 or fp8) as fp16, stored once warpgroup 1 is done with the previous item
            _load_q(Q, q_smem, q_full, q_empty, n_items, qo, n_q, head_start, stride_qt, stride_qh, HEAD_GROUP)
        q_row = gl.arange(0, _ROWS, row_l) // HEAD_GROUP  # [M] packed row -> query row of the item
        limit = gl.where(q_row < n_q, limit_0 + q_row, -1)  # [M] causal limit; -1: no such row
        mbarrier.wait(q_full, n_items & 1)
        m_i = gl.full([_ROWS], float("-inf"), gl.float32, row_l)  # running max (log2 units), same on both WGs
        l_i = gl.zeros([_ROWS], gl.float32, row_l)  # this WG's row sums in the frame of m_i
        acc = gl.zeros([_ROWS, HALF], gl.float32, o_layout)  # this WG's half of the output
        for k in range(gl.cdiv(n_tiles, 2)):
            t0 = kv_start + 2 * k * _TILE  # first token of the pair's even tile
            zero = k >> 30  # 0, but not to the compiler: the grouped score operands' descriptors (`_score_group`)
            has1 = 2 * k + 1 < n_tiles
            next0 = 2 * k + 2 < n_tiles  # the next pair's tiles exist
            next1 = 2 * k + 3 < n_tiles
            if BOXES == 1:  # the next pair's block-table entries, loaded early
                row0 = _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, 2 * k + 2, n_tiles, PAGE_SIZE, BOXES)
                row1 = _tile_rows(BLOCK_TABLE, b, stride_bt, kv_start, kv_end, 2 * k + 3, n_tiles, PAGE_SIZE, BOXES)
            else:  # one entry per page: loaded at each issue (`_issue_rows`), which keeps them out of the registers
                row0 = 2 * k + 2  # the next pair's tiles
                row1 = 2 * k + 3
            ph0 = uses0 & 1
            ph1 = uses1 & 1
            xph = pairs & 1
            if WG == 0:
                s = _masked(_scores(q_smem, kv_smem, kv8, kv_full, 0, ph0, kv_end - t0, s_layout, EXPAND, GROUPED,
                                    zero, LOADER), t0, kv_end, limit, qk_scale, s_layout)
                # slot 0's k_pe chunk is free
                _reissue(io, 0, row0, walk, _GROUP_E, next0, KV_FP8, PAGE_SIZE, BOXES, GROUPED, LOADER)
                m0 = gl.maximum(m_i, gl.max(s, 1))  # [M]
                alpha0 = _alpha(m_i, m0)
                p = gl.exp2(s - gl.where(m0 == float("-inf"), 0.0, m0)[:, None])  # [M, N] fp32
                l_i = l_i * alpha0 + gl.sum(p, 1)
                m_smem.index(0).store(m0)
                mbarrier.arrive(xbar.index(0))
                acc = acc * gl.convert_layout(alpha0, orow_l)[:, None]
                if not KV_FP8 and kv_end - t0 < _TILE:  # (fp8: zeroed by the expansion)
                    _zero_tail(kv_smem, 0, 0, kv_end - t0, HALVES)
                p_op = gl.convert_layout(p.to(op), p_layout)
                acc = warpgroup_mma(p_op, _v_half(kv_smem, 0, 0, HALVES), acc, is_async=True)
                mbarrier.wait(xbar.index(1), xph)
                m1 = m_smem.index(1).load(row_l)
                alpha1 = _alpha(m0, m1)
                p0_smem.store((p * alpha1[:, None]).to(op))
                fence_async_shared()
                mbarrier.arrive(xbar.index(2))
                acc = warpgroup_mma_wait(0, deps=(acc,))
                # slot 0's V_L is free
                _reissue(io, 0, row0, walk, _GROUP_L, next0, KV_FP8, PAGE_SIZE, BOXES, GROUPED, LOADER)
                acc = acc * gl.convert_layout(alpha1, orow_l)[:, None]
                l_i = l_i * alpha1
                m_i = m1
                if has1:
                    mbarrier.wait(kv_full.index(3 + _GROUP_L), ph1)
                    mbarrier.wait(xbar.index(3), ph1)
                    if not KV_FP8 and kv_end - t0 - _TILE < _TILE:
                        _zero_tail(kv_smem, 1, 0, kv_end - t0 - _TILE, HALVES)
                    acc = warpgroup_mma(_chunk(kv_smem, 1, 8), _v_half(kv_smem, 1, 0, HALVES), acc, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    # slot 1's V_L and p1 (over its k_pe chunk) are free
                    _reissue(io, 1, row1, walk, _GROUP_L, next1, KV_FP8, PAGE_SIZE, BOXES, GROUPED, LOADER)
                    _reissue(io, 1, row1, walk, _GROUP_E, next1, KV_FP8, PAGE_SIZE, BOXES, GROUPED, LOADER)
            else:
                if has1:
                    s = _masked(_scores(q_smem, kv_smem, kv8, kv_full, 1, ph1, kv_end - t0 - _TILE, s_layout,
                                        EXPAND, GROUPED, zero, LOADER), t0 + _TILE, kv_end, limit, qk_scale,
                                        s_layout)
                else:
                    s = gl.full([_ROWS, _TILE], float("-inf"), gl.float32, s_layout)
                mbarrier.wait(xbar.index(0), xph)
                m0 = m_smem.index(0).load(row_l)
                m1 = gl.maximum(m0, gl.max(s, 1))
                m_smem.index(1).store(m1)
                mbarrier.arrive(xbar.index(1))
                alpha = _alpha(m_i, m0) * _alpha(m0, m1)  # o_R and l_R: frame m -> m0 -> m1
                p = gl.exp2(s - gl.where(m1 == float("-inf"), 0.0, m1)[:, None])
                l_i = l_i * alpha + gl.sum(p, 1)
                acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
                if has1:
                    p1 = p.to(op)
                    _chunk(kv_smem, 1, 8).store(p1)  # p1 for warpgroup 0, over slot 1's k_pe chunk
                    fence_async_shared()
                    mbarrier.arrive(xbar.index(3))
                    if not KV_FP8 and kv_end - t0 - _TILE < _TILE:
                        _zero_tail(kv_smem, 1, 4, kv_end - t0 - _TILE, HALVES)
                    acc = warpgroup_mma(gl.convert_layout(p1, p_layout), _v_half(kv_smem, 1, 1, HALVES), acc,
                                        is_async=True)
                    if EXPAND:  # slot 1's V_R is free once p1 V1_R retires: reload it before waiting for p0'
                        acc = warpgroup_mma_wait(0, deps=(acc,))
                        _reissue(io, 1, row1, walk, _GROUP_R, next1, KV_FP8, PAGE_SIZE, BOXES, GROUPED, LOADER)
                        acc = warpgroup_mma_wait(0, deps=(_pv_p0(acc, kv_smem, p0_smem, kv_full, xbar, t0, kv_end,
                                                                 ph0, xph, KV_FP8, HALVES),))
                    else:  # bf16 (and LOADER): p0' V0_R queued behind p1 V1_R first, then the reload or release
                        acc = _pv_p0(acc, kv_smem, p0_smem, kv_full, xbar, t0, kv_end, ph0, xph, KV_FP8, HALVES)
                        acc = warpgroup_mma_wait(1, deps=(acc,))  # p1 V1_R has retired
                        _reissue(io, 1, row1, walk, _GROUP_R, next1, KV_FP8, PAGE_SIZE, BOXES, GROUPED, LOADER)
                        acc = warpgroup_mma_wait(0, deps=(acc,))
                else:
                    acc = warpgroup_mma_wait(0, deps=(_pv_p0(acc, kv_smem, p0_smem, kv_full, xbar, t0, kv_end, ph0,
                                                             xph, KV_FP8, HALVES),))
                # slot 0's V_R is free (warpgroup 0's scores of it are done: it published p0')
                _reissue(io, 0, row0, walk, _GROUP_R, next0, KV_FP8, PAGE_SIZE, BOXES, GROUPED, LOADER)
                m_i = m1
            uses0 += 1
            uses1 += has1.to(gl.int32)
            pairs += 1
        # total row sums: l_L + l_R, exchanged (WG 1 waits for l_L before it publishes l_R: neither runs ahead)
        iph = n_items & 1
        if WG == 0:
            l_smem.index(0).store(l_i)
            mbarrier.arrive(xbar.index(4))
            mbarrier.wait(xbar.index(5), iph)
            l_sum = l_i + l_smem.index(1).load(row_l)
        else:
            mbarrier.wait(xbar.index(4), iph)
            l_sum = l_i + l_smem.index(0).load(row_l)
            l_smem.index(1).store(l_i)
            mbarrier.arrive(xbar.index(5))
            mbarrier.arrive(q_empty)  # done with this item's q and tiles
        _store_half(acc, l_sum, m_i, kv_scale, partial_row, qo, n_q, head_start, WG * HALF, WG == 0,
                    OUT, LSE, O_PART, LSE_PART, stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt,
                    HEAD_GROUP, o_layout)
        n_items += 1


@gluon.jit
def _cache_rows(BLOCK_TABLE, b, stride_bt, tok, kv_end, PAGE_SIZE: gl.constexpr):
    """Element offsets (int64) of the cache rows of request b's tokens `tok`, and which are below kv_end (the others
    read no block-table entry and take page 0's offsets)."""
    ok = tok < kv_end
    page = gl.load(BLOCK_TABLE + b * stride_bt + tok // PAGE_SIZE, mask=ok, other=0)
    return (page.to(gl.int64) * PAGE_SIZE + tok % PAGE_SIZE) * (_L_DIM + _R_DIM), ok


@gluon.jit
def _loader_rows(BLOCK_TABLE, b, stride_bt, t0, kv_end, PAGE_SIZE: gl.constexpr):
    """`_cache_rows` of the 64 tokens from t0, in _E4M3_BOX's token slice (tokens past kv_end load as 0)."""
    tok = t0 + gl.arange(0, _TILE, gl.SliceLayout(1, _E4M3_BOX))  # [64]
    return _cache_rows(BLOCK_TABLE, b, stride_bt, tok, kv_end, PAGE_SIZE)


@constexpr_function
def _bulk_prefetch_ptx(rows, issuer):
    """PTX asking the L2 for min(rows, 64) cache rows of 576 fp8 bytes (a page, or a tile of a larger one) from
    address $1 where $2 is not 0: one bulk prefetch, which holds no register and has no completion to wait for ($0 is
    a dummy result). Issued once per element, by the threads `issuer` names: "token", lanes 0, 8, 16 and 24
    (_E4M3_BOX's token slice holds each token on 8 adjacent lanes); "unit", the partition's first 2 x 64 / UNIT
    threads (_UNIT_LAYOUT puts unit i on thread i, copies elsewhere)."""
    select = {"token": "mov.u32 l, %laneid; and.b32 l, l, 7; setp.eq.u32 p, l, 0;",
              "unit": f"mov.u32 l, %tid.x; and.b32 l, l, 127; setp.lt.u32 p, l, {2 * TILE // UNIT};"}[issuer]
    return ("{ .reg .pred p; .reg .b32 l; " + select + " setp.ne.and.u32 p, $2, 0, p; "
            f"@p cp.async.bulk.prefetch.L2.global [$1], {min(rows, TILE) * 576}; mov.u32 $0, 0; }}")


@gluon.jit
def _bulk_prefetch(addrs, ask, ROWS: gl.constexpr, ISSUER: gl.constexpr):
    """Ask the L2 for the ROWS cache rows from each of `addrs` where `ask` (int32) is not 0 (`_bulk_prefetch_ptx`)."""
    gl.inline_asm_elementwise(_bulk_prefetch_ptx(ROWS, ISSUER), "=r,l,r", [addrs, ask], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _prefetch_pages(KV, t0, rows, ok, PAGE_SIZE: gl.constexpr):
    """Ask the L2 for the pages of the tile from token t0 (`_loader_rows`: rows, ok): one bulk prefetch from each
    token below kv_end that starts a page (or a tile of a page of 64k)."""
    tok = t0 + gl.arange(0, _TILE, gl.SliceLayout(1, _E4M3_BOX))  # [64]
    first = (ok & (tok % PAGE_SIZE % _TILE == 0)).to(gl.int32)  # [64] 1 where a page (or tile) starts
    _bulk_prefetch(KV + rows, first, PAGE_SIZE, "token")


@constexpr_function
def _l1_prefetch_ptx(first, sectors):
    """PTX asking the L1 for `sectors` 32-byte sectors from byte `first` of the cache row at $1 where $2 is not 0:
    lane j of each token's 8 (_E4M3_BOX's token slice) asks for sector j (`prefetch.global.L1`, CCTL.E.PF1: no
    register written, no scoreboard); $0 is a dummy result."""
    return ("{ .reg .pred p; .reg .b32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, 7; "
            f"setp.lt.u32 p, l, {sectors}; setp.ne.and.u32 p, $2, 0, p; mul.wide.u32 a, l, 32; add.s64 a, a, $1; "
            f"@p prefetch.global.L1 [a + {first}]; mov.u32 $0, 0; }}")


@gluon.jit
def _l1_prefetch_group(KV, rows, ok, g: gl.constexpr):
    """Ask the L1 for chunk group g of a tile (`_loader_rows`: rows, ok): its bytes of each row below kv_end, at most
    8 sectors, one per lane of the token (L and R 256 bytes, E 64)."""
    gl.inline_asm_elementwise(_l1_prefetch_ptx(_group_first(g) * _CHUNK, (_group_end(g) - _group_first(g)) * 2),
                              "=r,l,r", [KV + rows, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


UNIT = 16  # tokens per bulk prefetch of the next pair (`_next_pair_units`): 9 KB, a page of 16
_UNIT = gl.constexpr(UNIT)
_UNIT_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # unit i on thread i of the partition (and copies)


@gluon.jit
def _next_pair_units(KV, BLOCK_TABLE, b, stride_bt, t0, kv_end, PAGE_SIZE: gl.constexpr):
    """The addresses of the 8 units of UNIT tokens of the pair from token t0 (one block-table entry each: a unit
    lies in one page, pages being 16, 32 or 64k tokens) and whether each is below kv_end (1) or not (0)."""
    tok = t0 + gl.arange(0, 2 * _TILE // _UNIT, _UNIT_LAYOUT) * _UNIT  # [8] first token of each unit
    rows, ok = _cache_rows(BLOCK_TABLE, b, stride_bt, tok, kv_end, PAGE_SIZE)
    return KV + rows, ok.to(gl.int32)


@gluon.jit
def _prefetch_units(addrs, ok):
    """Ask the L2 for the units of `_next_pair_units` (addrs, ok): one bulk prefetch each."""
    _bulk_prefetch(addrs, ok, _UNIT, "unit")


@gluon.jit
def _fetch_group(KV, rows, ok, g: gl.constexpr):
    """The fp8 bytes of chunk group g of a tile (`_loader_rows`: rows, ok) from the cache: one register tensor
    [64 tokens, 64 channels] (_E4M3_BOX) per chunk, tokens not ok as 0."""
    f: gl.constexpr = _group_first(g)
    cols = gl.arange(0, _CHUNK, gl.SliceLayout(0, _E4M3_BOX))  # [64]
    ptrs = KV + rows[:, None] + cols[None, :]  # [64 tokens, 64 channels]
    xs = ()
    for j in gl.static_range(_group_end(g) - f):
        xs = xs + (gl.load(ptrs + (f + j) * _CHUNK, mask=ok[:, None], other=0.0),)
    return xs


@gluon.jit
def _put_group(kv_smem, kv_full, kv_empty, slot: gl.constexpr, n, xs, g: gl.constexpr):
    """The loader's write number n into tile slot `slot`, chunk group g (`_fetch_group`'s xs): once the warpgroups
    have freed the group from write n - 1 (kv_empty), stored as fp16 chunks and published (kv_full)."""
    if n > 0:
        mbarrier.wait(kv_empty.index(slot * 3 + g), (n - 1) & 1)
    for j in gl.static_range(_group_end(g) - _group_first(g)):
        _expanded(kv_smem, slot, _group_first(g) + j, xs[j])
    fence_async_shared()
    mbarrier.arrive(kv_full.index(slot * 3 + g))


@gluon.jit
def _fp8_loader(KV, kv_smem, kv_full, kv_empty, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS, WORKER_INDPTR,
                num_items, stride_bt, head_split, PAGE_SIZE: gl.constexpr, HEAD_SPLIT: gl.constexpr,
                HEAD_GROUP: gl.constexpr, ONE_ITEM: gl.constexpr):
    """The loader partition (LOADER, e4m3fn caches): the program's tiles, pair by pair in the warpgroups' order,
    loaded from the cache with plain loads, converted to fp16 in registers and stored into the tile slots, so that
    the fp8 bytes never pass through shared memory (the expansion in place read 36 KB and wrote 72 KB of shared memory
    per tile on top of the copy's 36 KB). Each pair's groups are loaded and stored in the order the warpgroups free
    them: slot 0's E and L, slot 1's R, E and L, slot 0's R. The L2 is asked for an item's first pair at its start
    (`_prefetch_pages`) and for each next pair once the pair before has issued its last loads (`_next_pair_units`);
    the L1 for slot 0's R group at each pair's start (`_l1_prefetch_group`).
    """
    worker, head_part = _program(head_split, HEAD_SPLIT)
    n0 = 0  # tiles written into slot 0 / slot 1 so far
    n1 = 0
    item_begin, item_end = _worker_items(WORKER_INDPTR, worker, num_items, ONE_ITEM)
    for it in range(item_begin, item_end):
        b, partial_row, qo, n_q, kv_start, kv_end, head_start, limit_0 = _item(
            WORK_ITEMS, SEQ_LENS, QO_INDPTR, it, head_part, HEAD_GROUP)
        n_tiles = gl.cdiv(kv_end - kv_start, _TILE)
        for k in range(gl.cdiv(n_tiles, 2)):
            t0 = kv_start + 2 * k * _TILE
            has1 = 2 * k + 1 < n_tiles
            rows0, ok0 = _loader_rows(BLOCK_TABLE, b, stride_bt, t0, kv_end, PAGE_SIZE)
            rows1, ok1 = _loader_rows(BLOCK_TABLE, b, stride_bt, t0 + _TILE, kv_end, PAGE_SIZE)
            if k == 0:  # an item's first pair asked of the L2 at once (later pairs: below, one pair ahead)
                _prefetch_pages(KV, t0, rows0, ok0, PAGE_SIZE)
                _prefetch_pages(KV, t0 + _TILE, rows1, ok1, PAGE_SIZE)
            # up to three groups' loads in flight, each group's issued up to two stores before its own (ptxas puts
            # the loads on one scoreboard: a store's first conversion waits for all loads issued before it); without
            # a second tile (tokens past kv_end) slot 1's loads are masked off and its groups not written
            e0 = _fetch_group(KV, rows0, ok0, _GROUP_E)
            l0 = _fetch_group(KV, rows0, ok0, _GROUP_L)
            r1 = _fetch_group(KV, rows1, ok1, _GROUP_R)
            # slot 0's R, loaded last in the pair (just before slot 1's E store waits for every load in flight), asked
            # of the L1 now, so that its loads return from there (also asking for slot 1's L or E spilled: slower)
            _l1_prefetch_group(KV, rows0, ok0, _GROUP_R)
            _put_group(kv_smem, kv_full, kv_empty, 0, n0, e0, _GROUP_E)
            e1 = _fetch_group(KV, rows1, ok1, _GROUP_E)
            # the next pair's units: their block-table entries read now, and the units asked of the L2 once this
            # pair's last loads are issued (that wait is the one slot 1's E store would make: one scoreboard), so that
            # the next pair's loads find them there
            nxt, nxt_ok = _next_pair_units(KV, BLOCK_TABLE, b, stride_bt, t0 + 2 * _TILE, kv_end, PAGE_SIZE)
            _put_group(kv_smem, kv_full, kv_empty, 0, n0, l0, _GROUP_L)
            l1 = _fetch_group(KV, rows1, ok1, _GROUP_L)
            if has1:
                _put_group(kv_smem, kv_full, kv_empty, 1, n1, r1, _GROUP_R)
            r0 = _fetch_group(KV, rows0, ok0, _GROUP_R)
            _prefetch_units(nxt, nxt_ok)
            if has1:
                _put_group(kv_smem, kv_full, kv_empty, 1, n1, e1, _GROUP_E)
                _put_group(kv_smem, kv_full, kv_empty, 1, n1, l1, _GROUP_L)
            _put_group(kv_smem, kv_full, kv_empty, 0, n0, r0, _GROUP_R)
            n0 += 1
            n1 += has1.to(gl.int32)


# registers of warpgroup 1 and of the loader partition (LOADER; warpgroup 0 gets the rest, 200): three chunk groups
# in flight take the loader's 112 (at 96 they spill, 34 bytes: 41-49 % slower), and the warpgroups fit 200 with a few
# spill instructions in warpgroup 1's loop only with their score operands indexed at a runtime zero (`_score_mmas_at`;
# the hoisted descriptors spilled 35 instructions per loop); at 192 they spilled 700 bytes
LOADER_REGS = gl.constexpr((200, 112))


@gluon.jit(do_not_specialize=["num_items", "head_split"])  # no recompile per item count or head split
def _mla_decode_seesaw_kernel(
    Q, q_desc, kv_desc,  # q [T, H, 576]; TMA: q as [T x H, 576] (bf16 caches), the cache as [pages x page_size, 576]
    kvg_desc,  # GROUPED: TMA of the cache as [rows / 8, 9 chunks, 8 tokens, 64] (a page's groups of 4 chunks per box)
    BLOCK_TABLE, SEQ_LENS, QO_INDPTR,  # [B, pages] int32, [B] int32, [B+1] int32
    WORK_ITEMS, WORKER_INDPTR, num_items,  # [N, 8] int32, [W+1] int32, N
    OUT, LSE, O_PART, LSE_PART,  # [T, H, L] bf16, [T, H] fp32, [rows, H, L] fp32, [rows, H] fp32
    Q_SCALE, KV_SCALE,  # fp32 [1] each (1.0 for bf16 batches; launch's overrides apply as in the Triton kernel)
    sm_scale_log2,  # sm_scale x log2(e)
    num_heads, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt,
    head_split,  # programs per worker, read when HEAD_SPLIT is 0 (fp8 caches: the module docstring)
    PAGE_SIZE: gl.constexpr, HEAD_SPLIT: gl.constexpr, HEAD_GROUP: gl.constexpr, PDL: gl.constexpr,
    KV_FP8: gl.constexpr,  # e4m3fn cache, bf16 or e4m3fn q: fp16 operands (expanded in place without LOADER)
    ONE_ITEM: gl.constexpr,  # WorkPlan.one_item_per_worker
    GROUPED: gl.constexpr,  # `grouped_layout`: the c_kv halves (bf16), or their fp8 staging (KV_FP8), grouped
    KV,  # the cache [pages, page_size, 576] (LOADER: read by the loader partition)
    LOADER: gl.constexpr,  # e4m3fn cache: tiles converted by a loader partition (`_fp8_loader`), not in place
):
    if PDL:  # the reduce kernel may start now; its programs wait (gdc_wait) until this grid has finished
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    op: gl.constexpr = gl.float16 if KV_FP8 else gl.bfloat16  # MMA operands (and P)
    chunk_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_TILE, _CHUNK], op)
    box_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_TILE, _CHUNK], gl.float8e4nv)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_smem = (gl.allocate_shared_memory(op, [_ROWS, _L_DIM], chunk_layout),  # q_nope, q_pe: 72 KB
              gl.allocate_shared_memory(op, [_ROWS, _R_DIM], chunk_layout))
    if _halves(GROUPED, KV_FP8):  # c_kv as [slot x half x box, 4 chunks, 8 tokens, 64] (_HALF_LAYOUT), k_pe as chunks
        kv_smem = (gl.allocate_shared_memory(op, [2 * 2 * _GROUPS, 4, _TILE // _GROUPS, _CHUNK], _BOX_LAYOUT),
                   gl.allocate_shared_memory(op, [2, _TILE, _R_DIM], chunk_layout))
    else:  # two tile slots: 144 KB
        kv_smem = (gl.allocate_shared_memory(op, [2, _TILE, _L_DIM], chunk_layout),
                   gl.allocate_shared_memory(op, [2, _TILE, _R_DIM], chunk_layout))
    # the same bytes as fp8 boxes of 4 KB (fp8 caches: _fp8_box, _staged_box)
    kv8 = (kv_smem[0]._reinterpret(gl.float8e4nv, [2 * 16, _TILE, _CHUNK], box_layout),
           kv_smem[1]._reinterpret(gl.float8e4nv, [2 * 2, _TILE, _CHUNK], box_layout))
    p0_smem = gl.allocate_shared_memory(op, [_ROWS, _TILE], chunk_layout)  # 8 KB: p0' for warpgroup 1
    m_smem = gl.allocate_shared_memory(gl.float32, [2, _ROWS], flat)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, _ROWS], flat)
    q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_full = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())  # [slot x 3 + group]
    xbar = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    if LOADER:  # groups freed by the warpgroups for the loader ([slot x 3 + group])
        kv_empty = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    else:  # (not read)
        kv_empty = xbar
    mbarrier.init(q_full, count=1)
    mbarrier.init(q_empty, count=1)
    for i in gl.static_range(6):
        mbarrier.init(kv_full.index(i), count=1)
        mbarrier.init(xbar.index(i), count=1)
        if LOADER:
            mbarrier.init(kv_empty.index(i), count=1)
    fence_async_shared()
    # The warpgroups' arguments are written out in each call (twice): a tuple built once and reused, or with +,
    # turns their constexprs into runtime values (triton 3.6; the module docstring's last note)
    if LOADER:  # three partitions: the warpgroups and the loader (4 warps each)
        gl.warp_specialize([
            (_warpgroup, (0, Q, q_desc, kv_desc, kvg_desc, q_smem, kv_smem, kv8, p0_smem, m_smem, l_smem, q_full,
                          q_empty, kv_full, xbar, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS, WORKER_INDPTR,
                          num_items, OUT, LSE, O_PART, LSE_PART, Q_SCALE, KV_SCALE, sm_scale_log2, num_heads, stride_qt,
                          stride_qh, stride_bt, stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt,
                          PAGE_SIZE, head_split, HEAD_SPLIT, HEAD_GROUP, KV_FP8, ONE_ITEM, GROUPED, kv_empty, LOADER)),
            (_warpgroup, (1, Q, q_desc, kv_desc, kvg_desc, q_smem, kv_smem, kv8, p0_smem, m_smem, l_smem, q_full,
                          q_empty, kv_full, xbar, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS, WORKER_INDPTR,
                          num_items, OUT, LSE, O_PART, LSE_PART, Q_SCALE, KV_SCALE, sm_scale_log2, num_heads, stride_qt,
                          stride_qh, stride_bt, stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt,
                          PAGE_SIZE, head_split, HEAD_SPLIT, HEAD_GROUP, KV_FP8, ONE_ITEM, GROUPED, kv_empty, LOADER)),
            (_fp8_loader, (KV, kv_smem, kv_full, kv_empty, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS,
                           WORKER_INDPTR, num_items, stride_bt, head_split, PAGE_SIZE, HEAD_SPLIT, HEAD_GROUP,
                           ONE_ITEM)),
        ], [4, 4], [LOADER_REGS[0], LOADER_REGS[1]])
    else:
        gl.warp_specialize([
            (_warpgroup, (0, Q, q_desc, kv_desc, kvg_desc, q_smem, kv_smem, kv8, p0_smem, m_smem, l_smem, q_full,
                          q_empty, kv_full, xbar, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS, WORKER_INDPTR,
                          num_items, OUT, LSE, O_PART, LSE_PART, Q_SCALE, KV_SCALE, sm_scale_log2, num_heads, stride_qt,
                          stride_qh, stride_bt, stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt,
                          PAGE_SIZE, head_split, HEAD_SPLIT, HEAD_GROUP, KV_FP8, ONE_ITEM, GROUPED, kv_empty, LOADER)),
            (_warpgroup, (1, Q, q_desc, kv_desc, kvg_desc, q_smem, kv_smem, kv8, p0_smem, m_smem, l_smem, q_full,
                          q_empty, kv_full, xbar, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS, WORKER_INDPTR,
                          num_items, OUT, LSE, O_PART, LSE_PART, Q_SCALE, KV_SCALE, sm_scale_log2, num_heads, stride_qt,
                          stride_qh, stride_bt, stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt,
                          PAGE_SIZE, head_split, HEAD_SPLIT, HEAD_GROUP, KV_FP8, ONE_ITEM, GROUPED, kv_empty, LOADER)),
        ], [4], [256])


HEAD_GROUPS = (8, 16, 32, 64)  # heads per program: q_len x head_group packed rows <= 64, in TMA boxes of head_group
_DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
           (torch.float8_e4m3fn, torch.float8_e4m3fn))  # (q, cache)
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


def unsupported(batch, head_group: int | None = None, head_split: int | None = None,
                max_rows: int | None = None, mma: str | None = None) -> str | None:
    """Why the seesaw kernel cannot take `batch`, or None. With head_group (heads per program), head_split (programs
    per worker) and max_rows (max q_len x head_group) it also checks that launch geometry, with mma the operand
    dtype of the config (bf16 for a bf16 cache, fp16 for an fp8 one). No host sync (graph capture)."""
    if (batch.q.dtype, batch.kv_cache.dtype) not in _DTYPES:
        return (f"kernel='gluon' takes bf16 q and cache, or an e4m3fn cache with bf16 or e4m3fn q, got "
                f"{batch.q.dtype}/{batch.kv_cache.dtype}")
    operand = "bf16" if batch.kv_cache.dtype == torch.bfloat16 else "fp16"
    if mma is not None and mma != operand:
        return f"kernel='gluon' runs a {batch.kv_cache.dtype} cache with mma={operand!r}, got mma={mma!r}"
    reason = layout_reason(batch, "gluon", SMALL_PAGES)
    if reason:
        return reason
    if not batch.q.is_contiguous() or not batch.kv_cache.is_contiguous():
        return "kernel='gluon' needs contiguous q and kv_cache (TMA descriptors)"
    if head_group is not None:
        if head_group not in HEAD_GROUPS:
            return f"kernel='gluon' needs head_group in {HEAD_GROUPS}, got {head_group}"
        reason = heads_reason(batch, "gluon", head_group, head_split)
        if reason:
            return reason
        if max_rows > ROWS:
            return f"kernel='gluon' packs at most 64 rows (q_len x head_group), got {max_rows}"
    return device_reason(batch, "gluon")


# pages smaller than a tile that both Gluon kernels take, one TMA row box per page (pages of 8, 40 copies per tile in
# the Gluon fp8 kernel, were slower than the Triton kernel: 506 vs 412 us at (128, 8192, 16) fp8kv; perf_history)
SMALL_PAGES = (16, 32)
# bf16 cache pages the seesaw copies in the grouped layout (`grouped_layout`; pages of 64k count as 64): all it takes.
# Emptied (config_ab's `GROUPED_PAGES=()`), the standard layout for A/B runs. Pages of 8 so, with 24 copies per tile,
# against the Triton kernel (one H200, bf16): 147.2 vs 152.1 us at (32, 4096, 128) and 493.0 vs 527.0 at
# (128, 4096, 128), but 104.9 vs 82.8 at (32, 4096, 32), 107.0 vs 90.0 at (32, 4096, 64), 30.5 vs 27.1 at
# (8, 1000, 128): left on the Triton kernel
GROUPED_PAGES = (16, 32, 64)
# e4m3fn cache pages whose c_kv halves the seesaw stages in the grouped layout (`grouped_layout`, _STAGE8; pages of
# 64k count as 64): all it takes. Emptied (config_ab's `SEESAW_FP8_GROUPED_PAGES=()`), the chunk boxes for A/B runs
SEESAW_FP8_GROUPED_PAGES = (16, 32, 64)
# e4m3fn cache pages (64k as 64) whose tiles a loader partition converts on their way from global memory
# (`fp8_loader`, `_fp8_loader`): every page size the fp8 seesaw takes. Emptied (config_ab's
# `SEESAW_FP8_LOADER_PAGES=()`), the warpgroups expand TMA-staged fp8 in place instead, for A/B runs and as the
# loader's bits reference in the GPU tests
SEESAW_FP8_LOADER_PAGES = (16, 32, 64)


def page_in(kv: torch.Tensor, pages: tuple[int, ...]) -> bool:
    """Whether a cache's page size is one of `pages`, pages of a multiple of 64 tokens counted as 64 (the Gluon
    kernels' per-page-size launch choices: `grouped_layout`, `fp8_loader`, gluon_fp8.grouped_layout)."""
    return min(kv.shape[1], TILE) in pages


def grouped_layout(kv: torch.Tensor) -> bool:
    """Whether the seesaw keeps a cache's c_kv halves in the grouped layout (an e4m3fn cache: their fp8 staging). For
    bf16 (_HALF_LAYOUT: 8-token boxes of 4 chunks, one 4-D TMA copy per page and half, so 64 / page_size x 2 copies per
    tile for c_kv and 64 / page_size for k_pe): GROUPED_PAGES, with pages of 64k as 64. Otherwise each chunk is copied
    as one box per page (36 copies per tile at page 16, 18 at page 32) or per tile (9 at pages of 64k). On one H200
    (bf16, alternating rounds, same bits; per-page boxes / grouped, us): 114.9 / 88.2 at (32, 4096, 128) and 437.2 /
    305.9 at (128, 4096, 128) on pages of 16 (two calls), 89.4 / 81.0 and 299.4 / 285.5 on pages of 32 (twenty-eighth
    session); on pages of 64, standard / grouped, 83.0 / 78.9 and 290.6 / 278.5 (twenty-ninth session; the module
    docstring). An e4m3fn cache's c_kv halves are staged in that layout as fp8 (_STAGE8) on SEESAW_FP8_GROUPED_PAGES,
    and expanded into the standard layout's fp16 chunks: 478.1 / 408.5 us at (128, 4096, 128) fp8kv on pages of 16,
    356.5 / 345.5 on pages of 64 (with the fp8 seesaw's runtime head split, thirty-first session)."""
    return page_in(kv, GROUPED_PAGES if kv.dtype == torch.bfloat16 else SEESAW_FP8_GROUPED_PAGES)


def fp8_loader(kv: torch.Tensor) -> bool:
    """Whether the seesaw runs an e4m3fn cache's tiles through its loader partition (`_fp8_loader`: plain loads,
    fp16 conversion in registers, stores into the tile slots) instead of expanding TMA-staged fp8 in place:
    SEESAW_FP8_LOADER_PAGES, pages of 64k as 64. The same bits either way. On one H200 (config_ab, fresh compiles,
    fp8kv, us): in place on pages of 16 409.5 at (128, 4096, 128), 123.1 at (32, 4096, 128), 217.9 at
    (128, 4096, 64) (thirty-third session); through the loader (three groups in flight, thirty-fourth session) 345.3,
    103.0 and 187.6, on pages of 32 348.6 and 102.2 at the 128-head shapes. On pages of 64 the loader / in place took
    346.7 / 347.9, 102.6 / 103.7, 186.7 / 185.5, and 107.8 / 110.4 at (64, 4096, 16) q_len 4 in one call (within
    1-2 %), until the loader asked the L2 for each pair's pages first (thirty-fifth session): then in place / loader
    346.4 / 334.9, 104.1 / 99.6, 185.4 / 180.8 and 110.0 / 103.7 there, so pages of 64k take the loader too."""
    return kv.dtype == torch.float8_e4m3fn and page_in(kv, SEESAW_FP8_LOADER_PAGES)


def grouped_descriptor(kv: torch.Tensor, box_rows: int, width: int, layout) -> TensorDescriptor:
    """TMA descriptor of the grouped layouts' page copies (both Gluon kernels): the cache [pages, page, D] viewed as
    [rows / 8 groups, D / width chunks, 8 tokens, width] (strides 8 D, width, D, 1 elements: TMA takes strides in any
    order), one box the box_rows / 8 groups of a page (a tile of pages of 64k) x 4 chunks of `width` channels."""
    D = kv.shape[-1]
    group = TILE // GROUPS
    flat = kv.view(-1, D)
    return TensorDescriptor(flat, [flat.shape[0] // group, D // width, group, width], [group * D, width, D, 1],
                            [box_rows // group, 4, group, width], layout)


@constexpr_function
def tile_boxes(page_size: int) -> int:
    """TMA row boxes per 64-token tile: 64 / page_size for SMALL_PAGES (each box a whole page of 16 or 32 rows:
    whole periods of the slots' swizzles, 8 rows of 128 or 64 bytes), else 1 (pages of a multiple of 64; the
    kernels take no others: `layout_reason`). A constexpr_function: the kernels derive it from their PAGE_SIZE."""
    return TILE // page_size if page_size in SMALL_PAGES else 1


def layout_reason(batch, kernel: str, small_pages: tuple[int, ...] = ()) -> str | None:
    """The cache layout a Gluon kernel needs (L = 512, R = 64, 64-token TMA tiles inside a page, or pages in
    small_pages, which the kernel copies one page per TMA box), or why not."""
    if (batch.kv_lora_rank, batch.q.shape[-1] - batch.kv_lora_rank) != (L_DIM, R_DIM):
        return f"kernel={kernel!r} needs kv_lora_rank {L_DIM} and rope_dim {R_DIM}"
    page_size = batch.kv_cache.shape[1]
    if page_size % TILE and page_size not in small_pages:
        pages = f" or page_size in {small_pages}" if small_pages else ""
        return f"kernel={kernel!r} needs page_size % {TILE} == 0{pages}, got {page_size}"
    return None


def heads_reason(batch, kernel: str, head_group: int, head_split: int) -> str | None:
    """Why head_split programs of head_group heads do not cover the batch's heads, or None."""
    if batch.num_heads != head_group * head_split:
        return (f"kernel={kernel!r} needs num_heads = head_group x head_split, got {batch.num_heads} heads, "
                f"{head_group} x {head_split}")
    return None


def device_reason(batch, kernel: str) -> str | None:
    """Why a Gluon kernel cannot run on the batch's device (it needs CUDA sm_90 outside the interpreter), or None."""
    device = batch.q.device
    if INTERPRET or device.type != "cuda" or torch.version.hip or torch.cuda.get_device_capability(device) != (9, 0):
        return f"kernel={kernel!r} runs on CUDA sm_90 outside the interpreter (wgmma, TMA), got {device}"
    return None


def supported(batch) -> bool:
    """Whether the seesaw kernel can take `batch` here (dtypes, widths, pages, layout, device; default_config's
    `seesaw`, which then picks the head geometry)."""
    return unsupported(batch) is None


def launch_decode(batch, plan, out, lse, o_part, lse_part, q_scale, kv_scale, head_group: int, head_split: int,
                  qo_indptr, pdl: bool):
    """Launch the seesaw decode kernel (head_split programs per worker, head_group heads each); the caller launches
    the reduce."""
    T, H, D = batch.q.shape
    kv = batch.kv_cache
    # q's descriptor is read with a bf16 cache only (with an fp8 cache warpgroup 0 loads q from batch.q)
    q_desc = TensorDescriptor(batch.q.view(T * H, D), [T * H, D], [D, 1], [head_group, CHUNK],
                              gl.NVMMASharedLayout.get_default_for([TILE, CHUNK], _GL_DTYPE[batch.q.dtype]))
    boxes = tile_boxes(kv.shape[1])  # TMA boxes of a tile (pages of 16 or 32: one per page) into the slots' layout
    n_rows = kv.shape[0] * kv.shape[1]
    kv_desc = TensorDescriptor(kv.view(-1, D), [n_rows, D], [D, 1], [TILE // boxes, CHUNK],
                               gl.NVMMASharedLayout.get_default_for([TILE, CHUNK], _GL_DTYPE[kv.dtype]))
    grouped = grouped_layout(kv)
    fp8 = kv.dtype == torch.float8_e4m3fn
    loader = fp8_loader(kv)
    if grouped:  # a page's 8-token groups x 4 chunks of a c_kv half per copy (the cache as [rows / 8, 9, 8, 64])
        page_layout = _STAGED_PAGE if fp8 else _PAGE_LAYOUT
        kvg_desc = grouped_descriptor(kv, TILE // boxes, CHUNK, page_layout.value)
    else:
        kvg_desc = kv_desc
    num_workers = plan.worker_indptr.numel() - 1
    # ONE_ITEM (WorkPlan.one_item_per_worker: no worker-range load before the first item) for bf16 caches only: on
    # one H200, same bits, 83.5 vs 84.8 us at (32, 4096, 128) and 25.5 vs 26.4 at (1, 8192, 128), but with an fp8
    # cache 107.9 vs 106.5 at (32, 4096, 128) (the compiled fp8 schedule changes)
    return _mla_decode_seesaw_kernel[(num_workers * head_split,)](
        batch.q, q_desc, kv_desc, kvg_desc, batch.block_table, batch.seq_lens, qo_indptr, plan.work_items,
        plan.worker_indptr, plan.work_items.shape[0], out, lse, o_part, lse_part, q_scale, kv_scale,
        float(batch.sm_scale) * LOG2E, H, batch.q.stride(0), batch.q.stride(1), batch.block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), o_part.stride(0), o_part.stride(1), lse_part.stride(0),
        head_split, PAGE_SIZE=kv.shape[1], HEAD_SPLIT=0 if fp8 else head_split, HEAD_GROUP=head_group, PDL=pdl,
        KV_FP8=fp8, ONE_ITEM=plan.one_item_per_worker and not fp8,
        GROUPED=grouped and not loader, KV=kv, LOADER=loader, num_warps=4,
    )
