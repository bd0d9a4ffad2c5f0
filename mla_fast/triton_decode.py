"""
Persistent split-KV MLA decode in Triton (bf16 and fp8)
=======================================================

Absorbed MLA decode over a paged latent cache (docs/architecture.md conventions):

    s[t, h, j] = sm_scale * <q[t, h, :L+R], kv[j, :L+R]>            # scores, kv row = [c_kv | k_pe]
    out[t, h]  = sum_j softmax_j(s) * kv[j, :L]                      # V is the latent itself
    lse[t, h]  = ln sum_j exp(s[t, h, j])                            # natural log, sm_scale included

Two kernels, beside their launcher (like Triton's fused-attention tutorial):

- `_mla_decode_kernel`: persistent, `head_split` programs per worker of a `WorkPlan` (grid = `num_workers x
  head_split`, normally the SM count). A program walks its work items `work_items[worker_indptr[w]:worker_indptr[w+1]]`;
  an item is one request, a range of query rows x a head group (packed along M: MTP rows times heads; with head_split
  > 1 each program takes its share of the item's heads) and a token range. Each KV tile of BLOCK_N tokens is loaded
  once, row-major, as [BLOCK_N, L] (c_kv) and [BLOCK_N, R] (k_pe), and reused for both dot(q, trans(k)) and
  dot(p, c_kv). When a tile lies inside one page, or (tiles of at most 32 rows) up to `gather_chunk_pages` pages
  divide it (bf16: pages of 8 or more at 64-token tiles; fp8 caches: 4 or more), the block-table entries come in
  chunks of `page_chunk` pages (one vector load, the tile's or each token's page picked in registers: for bf16 in
  two steps, `page_select`), so no load in the tile loop feeds an address and Triton pipelines the KV loads
  (num_stages - 1 tiles buffered). Online softmax in base 2. Unsplit items (PARTIAL_ROW == -1) write `out` (bf16)
  and `lse` straight; split items write fp32 partials (out already normalised, lse natural log)
  to a workspace. Pair merge (`KernelConfig.pair_merge`, `mla_fast.dsmem`): where the plan splits every tile into
  two pieces on workers 2t and 2t + 1 (`WorkPlan.paired_splits`, the even plan at (64, 4096, 16)), on CUDA sm_90+
  the kernel runs as 2-CTA clusters and the two programs of a tile exchange halves of their normalised output
  through distributed shared memory, merge them as the reduce kernel does and write `out` / `lse`: no partials and
  no reduce kernel, same bits, 1.4-1.5 us less at (64, 4096, 16) on one H200 (89.0 vs 90.4-90.5 us).
- `_mla_reduce_kernel`: merges the partials of each split (request, head group) tile, in KV order (numerics.md §3).
  On sm_90+ CUDA it is launched with programmatic dependent launch: the decode kernel lets it start at once
  (gdc_launch_dependents), and its programs load their tile metadata, then wait (gdc_wait) until decode has
  finished and its partials are visible. Same bits; on one H200 0.3-0.9 us less per call at most split shapes,
  0.4 us more at (1, 8192, 16) fp8 KV (docs/perf_history.md).

Safety: cache slots at or past a request's `seq_len` may hold NaN. Loads are masked by the item's KV_END (never read)
and scores past a row's causal limit are removed with `tl.where` (never multiplied by 0). A row that sees no token
gives out = 0, lse = -inf.

Numerics (declared in mla_fast/numerics.py, read by verify.bounds; keep the two in step):
- `mma="bf16"` (bf16 q and cache): q, c_kv, k_pe enter the MMAs as bf16; P is rounded to bf16 before the P.V MMA;
  accumulation in fp32.
- `mma="fp16"` (fp8 caches, with bf16 or fp8 q): fp8 values are exact in fp16; q is cast to fp16 (exact for fp8 q,
  and for bf16 q with 2^-17 <= |q| <= 65504); P rounded to fp16. 1.3-1.4x faster than bf16 MMAs on an H200,
  because fp8 -> fp16 is one conversion instruction per pair and fp8 -> bf16 is not.
- fp8 per-tensor scales: q_scale * kv_scale is folded into the score scale, kv_scale multiplies the output once
  after normalisation (fp32). The MMAs see the raw fp8 values. `v_reload` (V loaded a second time for P.V, so that
  Triton pipelines both fp8 loads) and `fp8_stage` (the e4m3fn tile, and an e4m3fn q once per item, converted to
  fp16 and read by both MMAs from shared memory) give the MMAs the same values: no numerical effect.

On CUDA sm_90, bf16 batches with more than 16 packed rows per program take the Gluon seesaw kernel instead
(`mla_fast.gluon_decode`, KernelConfig(kernel="gluon"), chosen by `batch_config`): 276-288 us at (128, 4096, 128) on
one H200 against this kernel's 443 us below (FlashMLA 243-251 us), 86 vs 131 us at (32, 4096, 128), 574 vs 900 us at
(128, 4096, 128) with q_len 2. It executes the same WorkPlan and writes the same partials, merged by
`_mla_reduce_kernel`. Likewise e4m3fn caches at q_len <= 4 with 16 heads (32 at q_len 1), or more heads at small
batches (default_config), take the Gluon fp8 kernel at 16 packed rows per program (`mla_fast.gluon_fp8`,
KernelConfig(kernel="gluon_fp8")): 180-184 vs 302 us (fp8kv) at (128, 8192, 16), 163 vs 249 us at (128, 4096, 32).
Other e4m3fn caches with 64 packed rows per program take the seesaw kernel on fp16 operands (KernelConfig(
kernel="gluon", mma="fp16"), each fp8 tile converted by its loader partition; expanded in place until the thirty-third
session): 341.0 vs 557.3 us (fp8kv) at (128, 4096, 128) (377.3 in place, ninth session).

Performance of this kernel (one H200, mla-bench, CUDA-graph replays, copy rate 4244-4269 GB/s; peers.md §2 conditions;
docs/perf_history.md tables): bf16 h=16 takes 288-294 us at (b=128, s=8192), 97-99 % of copy (FlashInfer FA3 291-301 us), 154-157 us
at (128, 4096), 91-92 us at (64, 4096) (89.0 with the pair merge), 57-58 us at (32, 4096), 158-161 us at (32, 16384), 17.2-17.7 us at (1, 8192);
fp8 KV (bf16 or fp8 q) 0.87-1.06x our bf16 time at h=16; h=128 bf16 443 us at (128, 4096) (FlashMLA 239-251 us), fp8
KV 552-563 us (FlashInfer's fp8 666-675 us). The tile loop is latency-bound, not bandwidth-bound: one score MMA chain
over L + R = 576 channels per warp was the critical path (~3.3k cycles per tile), which split_l (independent chains)
and 4 warps at 16 rows (twice the columns per warp) cut by 10-15 %. fp8: staging 128-channel slices as fp16 had
8.3-way shared-store bank conflicts (ncu); 64-channel slices (split_l = 8) store conflict-free, 10 % faster. At h=128
(64-row wgmma tiles) Triton puts all warps along M for a dot that feeds another dot, so both warpgroups computed the
same scores (587 us); `_unchain` hides the chain (491 us), two latent slices and block-table chunks 466 us, each
slice's score dot written after its load (`interleave`) 441 us; the same layout took fp8 caches from 975 to 556 us.
The 64 x 512 fp32 accumulator (128 registers per thread on two warpgroups) still leaves 4-8 registers spilled, and
each warpgroup's score wgmma is N = 32 wide. ncu there: a third of the warp stalls wait on the score wgmmas (Triton
waits right after each) and the CTA barrier before the next tile's copies; at 16 rows fp8 KV keeps the shared-memory
pipe 72 % busy (the staged tile's round trip), bf16 keeps HBM 71 % busy.

CPU: under TRITON_INTERPRET=1 the same kernels run in Triton's interpreter. Triton 3.6's interpreter computes a
bf16 `tl.dot` wrongly (fp16/fp32/fp8 are right), so when interpreting, bf16 MMA operands are upcast to fp32
(`UPCAST_BF16` constexpr = `INTERPRET`, set from the environment when this module is imported). It also converts
fp32 -> bf16 by truncation, so there `_to_out` rounds the output bits to nearest even first (the device's cvt.rn). The
interpreter cannot take loaded bounds in `range()`, so loops over loaded bounds are `while` loops there (`INTERPRET`).
"""

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from mla_fast import dsmem, planner
from mla_fast.numerics import (
    DEEPSEEK_CHANNELS,
    DEFAULT_MMA,
    KernelNumerics,
    gluon_fp8_qk_numerics,
    triton_numerics,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once at import, like triton itself
UPCAST_BF16 = INTERPRET  # Triton 3.6's interpreter computes bf16 tl.dot wrongly: feed it fp32 (exact for bf16)
_INTERPRET = tl.constexpr(INTERPRET)  # `_mma_operand`'s e4m3fn NaN fix, taken only by the interpreter
LOG2E = tl.constexpr(1.4426950408889634)  # = 1 / ln(2): natural-log units -> log2 units
LN2 = tl.constexpr(0.6931471805599453)  # log2 units -> natural log

# work-item and reduce-tile columns (docs/architecture.md, WorkPlan)
_BATCH = tl.constexpr(planner.BATCH)
_PARTIAL_ROW = tl.constexpr(planner.PARTIAL_ROW)
_QO_START = tl.constexpr(planner.QO_START)
_QO_END = tl.constexpr(planner.QO_END)
_KV_START = tl.constexpr(planner.KV_START)
_KV_END = tl.constexpr(planner.KV_END)
_HEAD_START = tl.constexpr(planner.HEAD_START)
_HEAD_END = tl.constexpr(planner.HEAD_END)
_TILE_QO_START = tl.constexpr(planner.TILE_QO_START)
_TILE_QO_END = tl.constexpr(planner.TILE_QO_END)
_TILE_HEAD_START = tl.constexpr(planner.TILE_HEAD_START)
_TILE_HEAD_END = tl.constexpr(planner.TILE_HEAD_END)
_SPLIT_BEGIN = tl.constexpr(planner.SPLIT_BEGIN)
_SPLIT_END = tl.constexpr(planner.SPLIT_END)
_PARTIAL_BASE = tl.constexpr(planner.PARTIAL_BASE)


@triton.jit
def _mma_operand(x, MMA: tl.constexpr, UPCAST_BF16: tl.constexpr):
    """Cast a tile to the dtype the MMA sees; fp32 instead of bf16 in the interpreter (its bf16 dot is wrong), and
    there e4m3fn NaN codes made NaN explicitly (its cast reads 0x7F / 0xFF as +-480)."""
    if MMA == "bf16":
        if UPCAST_BF16:  # bf16 values are exact in fp32: same products, fp32 sums
            if x.dtype == tl.float32:  # P: rounded to bf16 as on the device (the interpreter's cast truncates)
                x = _round_to_bf16(x)
            x = x.to(tl.float32)
        else:
            x = x.to(tl.bfloat16)
    elif MMA == "fp16":
        if _INTERPRET and x.dtype == tl.float8e4nv:  # Triton 3.6's interpreter reads e4m3fn's NaN (0x7F) as 480
            nan = (x.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
            x = tl.where(nan, float("nan"), x.to(tl.float32)).to(tl.float16)  # the device's cvt gives NaN
        else:
            x = x.to(tl.float16)
    return x


@triton.jit
def _to_out(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 tile -> the output dtype, rounded to nearest even as on the device (cvt.rn.bf16x2.f32).

    Triton 3.6's interpreter converts fp32 -> bf16 by truncation (round toward zero: errors up to one bf16 ulp, twice
    the 2^-8 |o| that numerics.md §5(f) declares), so there the fp32 bits are rounded first: adding 0x7FFF plus the
    lowest kept bit, then clearing the 16 dropped bits, is round-to-nearest-even for finite x; the cast is then exact.
    """
    if INTERPRET and DTYPE == tl.bfloat16:
        x = _round_to_bf16(x)
    return x.to(DTYPE)


@triton.jit
def _round_to_bf16(x):
    """fp32 x rounded to the nearest bf16, ties to even, kept in fp32 (finite x; the interpreter's paths, whose
    fp32 -> bf16 cast truncates): add 0x7FFF plus the lowest kept bit, then clear the 16 dropped bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_to_fp16_staged(x):
    """e4m3fn -> fp16 (exact, the same cvt instruction as `.to(tl.float16)`), as an opaque op.

    Triton moves a plain cast below the shared-memory load that feeds an MMA, so the MMA operand is gathered as
    bytes (the P.V operand needs 4 tokens per register: byte loads) and converted after; it cannot move an op with
    side effects, so this tile is converted once from a coalesced load and the fp16 tile is staged in shared
    memory, from where both MMAs read it with ldmatrix. Device only (the interpreter runs no PTX).
    """
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _unchain(s, always):
    """s unchanged (always is true at run time), passed through an scf.if so that the score dot does not count as
    chained to the P.V dot in Triton's layout choice.

    Triton 3.6 gives a wgmma dot whose result reaches another dot all warps along M (AccelerateMatmul,
    warpsPerTileV3): with 64 rows and 8 warps both warpgroups then compute the same 64 x BLOCK_N scores. Its forward
    slice stops at the scf.yield of an if, so behind one the score dot gets the plain choice [4, 2] (each warpgroup
    half of the tile's tokens). The else branch (never taken) adds 0.0, which MLIR does not fold (-0.0 + 0.0 = +0.0),
    so the if is not turned back into a select.
    """
    if always:
        out = s
    else:
        out = s + 0.0
    return out


@triton.jit
def _score(q, k, live, UNCHAIN: tl.constexpr):
    """[M, D] x [N, D]^T -> [M, N] fp32 scores of one channel slice; UNCHAIN: behind `_unchain` (live is true)."""
    s = tl.dot(q, tl.trans(k))
    if UNCHAIN:
        s = _unchain(s, live)
    return s


@triton.jit
def _load_operand(ptrs, mask, MMA: tl.constexpr, UPCAST_BF16: tl.constexpr, FP8_STAGE: tl.constexpr):
    """Load a 2-D tile (q rows or cache rows; masked rows read as 0) and give it the MMA dtype."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if FP8_STAGE:  # e4m3fn tile, fp16 MMAs: convert once, the MMAs read the staged fp16 tile
        return _e4m3_to_fp16_staged(x)
    return _mma_operand(x, MMA, UPCAST_BF16)


@triton.jit
def _attend_tile(
    q, q_pe, m_i, l_i, acc, start, kv_end, limit, page, b, KV, BLOCK_TABLE, qk_scale, stride_kvp, stride_kvs,
    stride_bt,
    PAGE_SIZE: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
    MMA: tl.constexpr, UPCAST_BF16: tl.constexpr, TILE_IN_PAGE: tl.constexpr, PAGE_CHUNK: tl.constexpr,
    V_RELOAD: tl.constexpr, FP8_STAGE: tl.constexpr, SPLIT_L: tl.constexpr, LAZY_L: tl.constexpr,
    UNCHAIN: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    """One KV tile of BLOCK_N tokens from `start`: online-softmax update of (m_i, l_i, acc) for all rows.

    The latent channels come in SPLIT_L column slices of L / SPLIT_L (1, 2, 4 or 8): q / acc are tuples of SPLIT_L
    slices [M, L / SPLIT_L] of q_nope / of the output accumulator. More slices give the score MMA SPLIT_L + 1
    independent accumulation chains (SPLIT_L x L/SPLIT_L + R channels, summed pairwise at the end) instead of one
    chain over L + R, and each P.V MMA L / SPLIT_L columns.
    LAZY_L: l_i is [M, N], one running sum per column, reduced over N once after the last tile (one cross-warp
    reduction per tile fewer; another fp32 summation order of the same terms).
    TILE_IN_PAGE: the tile lies inside physical page `page` (contiguous rows); else each token's page is gathered:
    with PAGE_CHUNK > 0 `page` holds them ([BLOCK_N], picked from registers by `_tile_page`), else from the block
    table here.
    INTERLEAVE: each slice's score dot is written right after the slice's load, not after all loads; the same dots
    and the same pairwise sum (bitwise the same scores), in another program order (see KernelConfig.interleave).
    """
    LS: tl.constexpr = L // SPLIT_L
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, LS)
    offs_r = tl.arange(0, R)
    # -- gather one tile of cache rows through the block table; never touch slots >= kv_end
    tok = start + offs_n  # [N] positions inside the request
    tok_ok = tok < kv_end
    if TILE_IN_PAGE:  # the tile lies inside one page: contiguous rows
        kv_row = KV + page.to(tl.int64) * stride_kvp + ((start % PAGE_SIZE) + offs_n)[:, None] * stride_kvs  # [N, 1]
    else:
        if PAGE_CHUNK == 0:
            page = tl.load(BLOCK_TABLE + b * stride_bt + tok // PAGE_SIZE, mask=tok_ok, other=0)  # [N]
        kv_row = KV + page.to(tl.int64)[:, None] * stride_kvp + (tok % PAGE_SIZE)[:, None] * stride_kvs  # [N, 1]
    live = start < kv_end  # true: the tile loop runs below kv_end (for _unchain)
    c = ()  # SPLIT_L slices [N, LS] of c_kv, each loaded once for both MMAs
    s_parts = ()  # each slice's score [M, N] (INTERLEAVE: right after its load and, with FP8_STAGE, its staging)
    for i in tl.static_range(SPLIT_L):
        c = c + (_load_operand(kv_row + i * LS + offs_s[None, :], tok_ok[:, None], MMA, UPCAST_BF16, FP8_STAGE),)
        if INTERLEAVE:
            s_parts = s_parts + (_score(q[i], c[i], live, UNCHAIN),)
    k_pe = _load_operand(kv_row + L + offs_r[None, :], tok_ok[:, None], MMA, UPCAST_BF16, FP8_STAGE)  # [N, R]
    if V_RELOAD:  # V loaded again for P.V (hits L1/L2): each load then has one use, which Triton can pipeline
        v = tl.load(kv_row + offs_s[None, :], mask=tok_ok[:, None], other=0.0, eviction_policy="evict_first")
        v = _mma_operand(v, MMA, UPCAST_BF16)  # [N, LS]
    else:
        v = c[0]

    # -- scores: sum over slices of [M, LS] x [LS, N], + [M, R] x [R, N] -> [M, N], fp32 accumulation
    if SPLIT_L > 1 or UNCHAIN or INTERLEAVE:  # independent chains (one per slice, then k_pe), summed at the end
        if not INTERLEAVE:  # every slice's score dot after all loads
            for i in tl.static_range(SPLIT_L):
                s_parts = s_parts + (_score(q[i], c[i], live, UNCHAIN),)
        s = _pairwise_sum(s_parts, SPLIT_L) + _score(q_pe, k_pe, live, UNCHAIN)
    else:
        s = tl.dot(q[0], tl.trans(c[0]))
        s = tl.dot(q_pe, tl.trans(k_pe), s)
    s = s * qk_scale
    visible = (tok[None, :] < limit[:, None]) & tok_ok[None, :]  # [M, N]
    s = tl.where(visible, s, float("-inf"))

    # -- online softmax update (base 2); a row with no visible token so far keeps m_i = -inf
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)  # [M], 0 while m_i = -inf
    p = tl.exp2(s - m_use[:, None])  # [M, N], exactly 0 where not visible
    if LAZY_L:
        l_i = l_i * alpha[:, None] + p  # [M, N]
    else:
        l_i = l_i * alpha + tl.sum(p, 1)  # [M]
    p = _mma_operand(p, MMA, UPCAST_BF16)  # P rounded to the MMA dtype (bf16/fp16)
    out = (tl.dot(p, v, acc[0] * alpha[:, None]),)  # [M, N] x [N, LS] -> [M, LS], slice by slice
    for i in tl.static_range(1, SPLIT_L):
        out = out + (tl.dot(p, c[i], acc[i] * alpha[:, None]),)
    return m_new, l_i, out


@triton.jit
def _pairwise_sum(s, SPLIT_L: tl.constexpr):
    """Sum of the SPLIT_L (1, 2, 4 or 8) [M, N] tiles of tuple s, pairwise: 0, (0 + 1), ((0 + 1) + (2 + 3)),
    (((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)))."""
    if SPLIT_L == 1:
        total = s[0]
    elif SPLIT_L == 2:
        total = s[0] + s[1]
    elif SPLIT_L == 4:
        total = (s[0] + s[1]) + (s[2] + s[3])
    else:
        total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))
    return total


@triton.jit
def _attend_span(
    q, q_pe, m_i, l_i, acc, lo, hi, kv_end, limit, pages, first_page, b, KV, BLOCK_TABLE, qk_scale, stride_kvp,
    stride_kvs, stride_bt,
    PAGE_SIZE: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
    MMA: tl.constexpr, INTERPRET: tl.constexpr, UPCAST_BF16: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
    PAGE_CHUNK: tl.constexpr, E: tl.constexpr, V_RELOAD: tl.constexpr, FP8_STAGE: tl.constexpr,
    SPLIT_L: tl.constexpr, LAZY_L: tl.constexpr, UNCHAIN: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    """The tiles starting at lo, lo + BLOCK_N, ... < hi. Page of a tile (TILE_IN_PAGE), or of each of its tokens
    (pages smaller than a tile): with PAGE_CHUNK > 0, picked out of `pages` ([PAGE_CHUNK] block-table entries from
    page `first_page`, in registers: no load in the loop, so Triton pipelines the KV loads num_stages - 1 deep); else
    block-table loads in the tile (which Triton's pipeliner treats as indirect loads: one tile in flight below
    num_stages = 5)."""
    if INTERPRET:  # Triton 3.6's interpreter cannot take loaded bounds in range(): same body in a while loop
        start = lo
        while start < hi:
            page = _tile_page(pages, first_page, start, b, BLOCK_TABLE, stride_bt, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE,
                              PAGE_CHUNK, E)
            m_i, l_i, acc = _attend_tile(
                q, q_pe, m_i, l_i, acc, start, kv_end, limit, page, b, KV, BLOCK_TABLE, qk_scale, stride_kvp,
                stride_kvs, stride_bt, PAGE_SIZE, L, R, BLOCK_N, MMA, UPCAST_BF16, TILE_IN_PAGE, PAGE_CHUNK, V_RELOAD,
                FP8_STAGE, SPLIT_L, LAZY_L, UNCHAIN, INTERLEAVE)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            page = _tile_page(pages, first_page, start, b, BLOCK_TABLE, stride_bt, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE,
                              PAGE_CHUNK, E)
            m_i, l_i, acc = _attend_tile(
                q, q_pe, m_i, l_i, acc, start, kv_end, limit, page, b, KV, BLOCK_TABLE, qk_scale, stride_kvp,
                stride_kvs, stride_bt, PAGE_SIZE, L, R, BLOCK_N, MMA, UPCAST_BF16, TILE_IN_PAGE, PAGE_CHUNK, V_RELOAD,
                FP8_STAGE, SPLIT_L, LAZY_L, UNCHAIN, INTERLEAVE)
    return m_i, l_i, acc


@triton.jit
def _tile_page(pages, first_page, start, b, BLOCK_TABLE, stride_bt,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TILE_IN_PAGE: tl.constexpr, PAGE_CHUNK: tl.constexpr,
               E: tl.constexpr):
    """Physical page holding the tile at token `start` (TILE_IN_PAGE), or [BLOCK_N] the page of each of its tokens
    (pages smaller than a tile, with PAGE_CHUNK > 0: from `pages`, [PAGE_CHUNK] with E = 1, else [PAGE_CHUNK / E, E]
    with E = BLOCK_N / PAGE_SIZE entries per tile, KernelConfig.page_select); 0 (unused) when `_attend_tile` gathers
    them itself."""
    if TILE_IN_PAGE:
        if PAGE_CHUNK > 0:  # select from the registers: sum of one nonzero-masked entry
            offs_c = tl.arange(0, PAGE_CHUNK)
            page = tl.sum(tl.where(offs_c == start // PAGE_SIZE - first_page, pages, 0), 0)
        else:
            page = tl.load(BLOCK_TABLE + b * stride_bt + start // PAGE_SIZE)
    elif PAGE_CHUNK > 0 and E == 1:  # each token's entry selected from the registers ([N, C], one nonzero per row)
        offs_c = tl.arange(0, PAGE_CHUNK)
        idx = (start + tl.arange(0, BLOCK_N)) // PAGE_SIZE - first_page  # [N]
        page = tl.sum(tl.where(offs_c[None, :] == idx[:, None], pages[None, :], 0), 1)  # [N]
    elif PAGE_CHUNK > 0:  # the tile's E entries ([T, E] -> [E]), then each token's ([N, E] -> [N])
        tile = (start // PAGE_SIZE - first_page) // E  # the tile's row of the chunk (tiles start on its rows)
        row = tl.sum(tl.where(tl.arange(0, PAGE_CHUNK // E)[:, None] == tile, pages, 0), 0)  # [E]
        e = tl.arange(0, BLOCK_N) // PAGE_SIZE  # [N] each token's entry in the tile
        page = tl.sum(tl.where(tl.arange(0, E)[None, :] == e[:, None], row[None, :], 0), 1)  # [N]
    else:
        page = 0
    return page


@triton.jit
def _store_rows(ptrs, acc, o_scale, row_ok, LS: tl.constexpr, SPLIT_L: tl.constexpr, INTERPRET: tl.constexpr):
    """Store the normalised output rows acc[i] * o_scale, slice by slice ([M, LS] each), in the dtype of `ptrs`
    (bf16 `out`: rounded to nearest even; fp32 workspace: as is)."""
    for i in tl.static_range(SPLIT_L):
        tl.store(ptrs + i * LS, _to_out(acc[i] * o_scale, ptrs.dtype.element_ty, INTERPRET), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_items"])
def _mla_decode_kernel(
    Q, KV, BLOCK_TABLE, SEQ_LENS, QO_INDPTR,  # q [T, H, L+R], kv [P, page, L+R], bt [B, pages], [B], [B+1]
    WORK_ITEMS, WORKER_INDPTR, num_items,  # [N, 8] int32, [W+1] int32, N
    OUT, LSE, O_PART, LSE_PART,  # [T, H, L] bf16, [T, H] fp32, [rows, H, L] fp32, [rows, H] fp32
    Q_SCALE, KV_SCALE,  # fp32 [1] each (1.0 when unquantized)
    sm_scale,
    stride_qt, stride_qh,
    stride_kvp, stride_kvs,
    stride_bt,
    stride_ot, stride_oh,
    stride_lt,
    stride_pt, stride_ph,
    stride_plt,
    PAGE_SIZE: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MMA: tl.constexpr, INTERPRET: tl.constexpr, UPCAST_BF16: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, PAGE_CHUNK: tl.constexpr, PAGE_SELECT: tl.constexpr, V_RELOAD: tl.constexpr,
    FP8_STAGE: tl.constexpr, HEAD_SPLIT: tl.constexpr, SPLIT_L: tl.constexpr, LAZY_L: tl.constexpr,
    UNCHAIN: tl.constexpr, INTERLEAVE: tl.constexpr, PDL: tl.constexpr, ONE_ITEM: tl.constexpr,
    PAIR_MERGE: tl.constexpr,
):
    if PDL:  # the reduce kernel may start now; its programs wait (gdc_wait) until this grid has finished
        tl.extra.cuda.gdc_launch_dependents()
    # HEAD_SPLIT consecutive programs run one worker's items, each on its share of the item's heads: they stream
    # the same KV tiles at the same time, so all but the first read of a tile hit the L2
    pid = tl.program_id(0)
    worker = pid // HEAD_SPLIT
    head_part = pid % HEAD_SPLIT
    if ONE_ITEM:  # WorkPlan.one_item_per_worker: item `worker`, if any; its loads wait for no worker range
        item_begin = worker
        item_end = tl.where(worker < num_items, worker + 1, worker)
    else:
        item_begin = tl.load(WORKER_INDPTR + worker)
        item_end = tl.load(WORKER_INDPTR + worker + 1)
    # fp8 per-tensor scales: real = fp8 * scale; folded into the base-2 score scale and the output
    kv_scale = tl.load(KV_SCALE)
    qk_scale = sm_scale * tl.load(Q_SCALE) * kv_scale * LOG2E  # scores in log2 units

    it = item_begin
    while it < item_end:  # while, not range(): the interpreter cannot take loaded bounds
        _attend_item(
            it, Q, KV, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS, head_part, OUT, LSE, O_PART, LSE_PART,
            kv_scale, qk_scale, stride_qt, stride_qh, stride_kvp, stride_kvs, stride_bt, stride_ot, stride_oh,
            stride_lt, stride_pt, stride_ph, stride_plt, PAGE_SIZE, L, R, BLOCK_M, BLOCK_N, MMA, INTERPRET,
            UPCAST_BF16, TILE_IN_PAGE, PAGE_CHUNK, PAGE_SELECT, V_RELOAD, FP8_STAGE, HEAD_SPLIT, SPLIT_L, LAZY_L,
            UNCHAIN, INTERLEAVE, PAIR_MERGE)
        it += 1


@triton.jit
def _attend_item(
    it, Q, KV, BLOCK_TABLE, SEQ_LENS, QO_INDPTR, WORK_ITEMS, head_part, OUT, LSE, O_PART, LSE_PART,
    kv_scale, qk_scale, stride_qt, stride_qh, stride_kvp, stride_kvs, stride_bt, stride_ot, stride_oh, stride_lt,
    stride_pt, stride_ph, stride_plt,
    PAGE_SIZE: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MMA: tl.constexpr, INTERPRET: tl.constexpr, UPCAST_BF16: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
    PAGE_CHUNK: tl.constexpr, PAGE_SELECT: tl.constexpr, V_RELOAD: tl.constexpr, FP8_STAGE: tl.constexpr,
    HEAD_SPLIT: tl.constexpr,
    SPLIT_L: tl.constexpr, LAZY_L: tl.constexpr, UNCHAIN: tl.constexpr,
    INTERLEAVE: tl.constexpr, PAIR_MERGE: tl.constexpr,
):
    """Work item `it`: its rows over its token range, then its output (or workspace) rows; with PAIR_MERGE (item
    `it` is piece it % 2 of a two-piece tile, on CTA it % 2 of a 2-CTA cluster) the merged output of the pair."""
    LS: tl.constexpr = L // SPLIT_L
    if PAGE_SELECT == 2 and not TILE_IN_PAGE:  # block-table chunks as [tiles, pages per tile] (`_tile_page`)
        E: tl.constexpr = BLOCK_N // PAGE_SIZE
    else:
        E: tl.constexpr = 1
    b, partial_row, qo_start, n_rows, kv_start, kv_end, head_start, num_h, limit_0 = _item_scalars(
        WORK_ITEMS, SEQ_LENS, QO_INDPTR, it, head_part, HEAD_SPLIT)
    if PAGE_CHUNK > 0:  # the first chunk's block-table entries, loaded before q (whose layout
        # conversion waits for it): the two round trips overlap
        pages = _load_pages(BLOCK_TABLE, b, stride_bt, kv_start // PAGE_SIZE, kv_end, PAGE_SIZE, PAGE_CHUNK,
                            E)  # [C] (E = 1) or [C / E, E]
    qo, h, row_ok, limit, q, q_pe = _item_rows(
        Q, qo_start, n_rows, head_start, num_h, limit_0, stride_qt, stride_qh, L, R, BLOCK_M, MMA, UPCAST_BF16,
        SPLIT_L, FP8_STAGE)
    m_i, l_i, acc = _fresh_state(BLOCK_M, BLOCK_N, LS, LAZY_L, SPLIT_L)
    if PAGE_CHUNK > 0:
        # chunks of PAGE_CHUNK pages: their block-table entries in one vector load, then the chunk's tiles; each
        # chunk's entries are loaded while the chunk before runs (a chunk ends on a page boundary: with pages smaller
        # than a tile, PAGE_CHUNK x PAGE_SIZE is a multiple of BLOCK_N and kv_start of both, so no tile straddles)
        chunk = kv_start
        while chunk < kv_end:
            first_page = chunk // PAGE_SIZE
            chunk_end = tl.minimum((first_page + PAGE_CHUNK) * PAGE_SIZE, kv_end)  # page-aligned unless kv_end
            next_pages = _load_pages(BLOCK_TABLE, b, stride_bt, first_page + PAGE_CHUNK, kv_end, PAGE_SIZE,
                                     PAGE_CHUNK, E)  # all masked past kv_end
            m_i, l_i, acc = _attend_span(
                q, q_pe, m_i, l_i, acc, chunk, chunk_end, kv_end, limit, pages, first_page, b, KV, BLOCK_TABLE,
                qk_scale, stride_kvp, stride_kvs, stride_bt, PAGE_SIZE, L, R, BLOCK_N, MMA, INTERPRET, UPCAST_BF16,
                TILE_IN_PAGE, PAGE_CHUNK, E, V_RELOAD, FP8_STAGE, SPLIT_L, LAZY_L, UNCHAIN, INTERLEAVE)
            pages = next_pages
            chunk = chunk_end
    else:
        m_i, l_i, acc = _attend_span(
            q, q_pe, m_i, l_i, acc, kv_start, kv_end, kv_end, limit, kv_start, 0, b, KV, BLOCK_TABLE, qk_scale,
            stride_kvp, stride_kvs, stride_bt, PAGE_SIZE, L, R, BLOCK_N, MMA, INTERPRET, UPCAST_BF16, TILE_IN_PAGE, 0,
            1, V_RELOAD, FP8_STAGE, SPLIT_L, LAZY_L, UNCHAIN, INTERLEAVE)
    if PAIR_MERGE:
        _store_pair(m_i, l_i, acc, kv_scale, it % 2, qo, h, row_ok, OUT, LSE, stride_ot, stride_oh, stride_lt,
                    BLOCK_M, L, LS, SPLIT_L, LAZY_L, INTERPRET)
    else:
        _store_item(m_i, l_i, acc, kv_scale, partial_row, qo, qo_start, h, row_ok, OUT, LSE,
                    O_PART, LSE_PART, stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt, LS, SPLIT_L,
                    LAZY_L, INTERPRET)


@triton.jit
def _item_scalars(WORK_ITEMS, SEQ_LENS, QO_INDPTR, it, head_part, HEAD_SPLIT: tl.constexpr):
    """Work item `it` as seen by this program (its head_part share of the item's heads): request b, first workspace
    row (-1: unsplit), first query row, packed rows, token range, first head, heads, and the causal limit of the
    first query row (row r of a request with q_len n and seq_len s sees tokens < s - n + r + 1)."""
    item = WORK_ITEMS + it * 8
    b = tl.load(item + _BATCH)
    qo_start = tl.load(item + _QO_START)
    item_head_start = tl.load(item + _HEAD_START)
    num_h = (tl.load(item + _HEAD_END) - item_head_start) // HEAD_SPLIT  # heads of this program
    req_qo_start = tl.load(QO_INDPTR + b)
    q_len = tl.load(QO_INDPTR + b + 1) - req_qo_start
    limit_0 = tl.load(SEQ_LENS + b) - q_len + (qo_start - req_qo_start) + 1
    return (b, tl.load(item + _PARTIAL_ROW), qo_start, (tl.load(item + _QO_END) - qo_start) * num_h,
            tl.load(item + _KV_START), tl.load(item + _KV_END), item_head_start + head_part * num_h, num_h, limit_0)


@triton.jit
def _item_rows(Q, qo_start, n_rows, head_start, num_h, limit_0, stride_qt, stride_qh,
               L: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, MMA: tl.constexpr,
               UPCAST_BF16: tl.constexpr, SPLIT_L: tl.constexpr, FP8_STAGE: tl.constexpr):
    """The packed rows m -> (query row qo, head h) of an item, query-major: qo, h, row_ok, causal limits [M] and the
    q slices (q_nope in SPLIT_L slices [M, L / SPLIT_L], q_pe [M, R]; masked rows read as 0). With FP8_STAGE an
    e4m3fn q is converted to fp16 here, once per item (else Triton converts the bytes at every tile's MMA)."""
    LS: tl.constexpr = L // SPLIT_L
    Q_STAGE: tl.constexpr = FP8_STAGE and Q.dtype.element_ty == tl.float8e4nv
    offs_m = tl.arange(0, BLOCK_M)  # packed (query row, head) rows of one item
    offs_s = tl.arange(0, LS)  # c_kv channels of one slice
    offs_r = tl.arange(0, R)  # k_pe channels
    qo = qo_start + offs_m // num_h  # [M]
    h = head_start + offs_m % num_h  # [M]
    row_ok = offs_m < n_rows  # [M]
    limit = limit_0 + offs_m // num_h  # [M]
    q_row = Q + qo.to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh  # [M, 1]
    q = ()  # SPLIT_L slices [M, LS] of q_nope
    for i in tl.static_range(SPLIT_L):
        q = q + (_load_operand(q_row + i * LS + offs_s[None, :], row_ok[:, None], MMA, UPCAST_BF16, Q_STAGE),)
    q_pe = _load_operand(q_row + L + offs_r[None, :], row_ok[:, None], MMA, UPCAST_BF16, Q_STAGE)  # [M, R]
    return qo, h, row_ok, limit, q, q_pe


@triton.jit
def _fresh_state(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LS: tl.constexpr, LAZY_L: tl.constexpr,
                 SPLIT_L: tl.constexpr):
    """Online-softmax state before the first tile: m_i = -inf, l_i = 0, acc = SPLIT_L zero slices [M, LS]."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scores (log2 units)
    if LAZY_L:
        l_i = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # running sums of exp2(s - m_i), one per tile column
    else:
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    acc = ()  # running sums of exp2(s - m_i) * c_kv, slice by slice
    for _ in tl.static_range(SPLIT_L):
        acc = acc + (tl.zeros([BLOCK_M, LS], tl.float32),)
    return m_i, l_i, acc


@triton.jit
def _load_pages(BLOCK_TABLE, b, stride_bt, first_page, kv_end, PAGE_SIZE: tl.constexpr, PAGE_CHUNK: tl.constexpr,
                E: tl.constexpr):
    """PAGE_CHUNK block-table entries of request b from page `first_page`, in one vector load (pages at or past
    kv_end read as 0, never used): [PAGE_CHUNK] with E = 1, else [PAGE_CHUNK / E, E] (E entries per row)."""
    if E == 1:
        offs_c = tl.arange(0, PAGE_CHUNK)
    else:
        offs_c = tl.arange(0, PAGE_CHUNK // E)[:, None] * E + tl.arange(0, E)[None, :]
    return tl.load(BLOCK_TABLE + b * stride_bt + first_page + offs_c,
                   mask=(first_page + offs_c) * PAGE_SIZE < kv_end, other=0)  # [C]


@triton.jit
def _normaliser(m_i, l_i, kv_scale, LAZY_L: tl.constexpr):
    """(o_scale [M, 1], lse [M]) of an item's online-softmax state: acc x o_scale is the normalised output with V
    unscaled, lse the natural-log LSE; a row that saw no token gets lse = -inf (and acc = 0)."""
    if LAZY_L:
        l_i = tl.sum(l_i, 1)  # [M]
    has_tok = l_i != 0.0  # l >= 0, or NaN from a NaN input: then lse is NaN too, not -inf
    o_scale = (kv_scale / tl.where(has_tok, l_i, 1.0))[:, None]  # [M, 1]
    lse = tl.where(has_tok, (m_i + tl.log2(tl.where(has_tok, l_i, 1.0))) * LN2, float("-inf"))  # [M]
    return o_scale, lse


@triton.jit
def _store_item(m_i, l_i, acc, kv_scale, partial_row, qo, qo_start, h, row_ok, OUT, LSE, O_PART, LSE_PART,
                stride_ot, stride_oh, stride_lt, stride_pt, stride_ph, stride_plt,
                LS: tl.constexpr, SPLIT_L: tl.constexpr, LAZY_L: tl.constexpr, INTERPRET: tl.constexpr):
    """Epilogue of a work item: normalise, unscale V, natural-log LSE; empty rows give out = 0, lse = -inf. Unsplit
    items (partial_row < 0) write out (bf16) and lse; split items their fp32 workspace rows."""
    offs_s = tl.arange(0, LS)
    o_scale, lse = _normaliser(m_i, l_i, kv_scale, LAZY_L)
    if partial_row < 0:
        out_ptr = OUT + qo.to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh + offs_s[None, :]  # [M, LS]
        _store_rows(out_ptr, acc, o_scale, row_ok, LS, SPLIT_L, INTERPRET)
        tl.store(LSE + qo.to(tl.int64) * stride_lt + h, lse, mask=row_ok)
    else:
        prow = (partial_row + qo - qo_start).to(tl.int64)  # [M] workspace rows of this item
        part_ptr = O_PART + prow[:, None] * stride_pt + h[:, None] * stride_ph + offs_s[None, :]  # [M, LS]
        _store_rows(part_ptr, acc, o_scale, row_ok, LS, SPLIT_L, INTERPRET)
        tl.store(LSE_PART + prow * stride_plt + h, lse, mask=row_ok)


@triton.jit
def _store_pair(m_i, l_i, acc, kv_scale, rank, qo, h, row_ok, OUT, LSE, stride_ot, stride_oh, stride_lt,
                BLOCK_M: tl.constexpr, L: tl.constexpr, LS: tl.constexpr, SPLIT_L: tl.constexpr,
                LAZY_L: tl.constexpr, INTERPRET: tl.constexpr):
    """Epilogue of piece `rank` (0: the tile's first tokens) of a two-piece tile, on CTA `rank` of a 2-CTA cluster
    (mla_fast.dsmem): exchange halves with the partner, merge the latent slices [rank x HALF, (rank + 1) x HALF)
    as `_mla_reduce_kernel` merges two pieces (base 2, piece 0 first, same fp32 operations), write them; rank 0
    writes the LSE. Shared memory from byte 0 (free once the KV loop has drained): the partner's half and LSE,
    the mbarrier, this piece's outgoing half and LSE (dsmem.stage_bytes)."""
    HALF: tl.constexpr = SPLIT_L // 2  # latent slices each piece merges
    ROW: tl.constexpr = HALF * LS + dsmem.ROW_PAD  # fp32 per staged row (padded: no bank conflicts)
    RECV: tl.constexpr = BLOCK_M * ROW * 4 + BLOCK_M * 4  # bytes: the partner's half [M, L / 2] + its LSE
    MBAR: tl.constexpr = RECV  # 16-byte aligned
    STAGE: tl.constexpr = RECV + 64
    offs_m = tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, LS)
    o_scale, lse = _normaliser(m_i, l_i, kv_scale, LAZY_L)
    first = rank == 0
    tl.debug_barrier()  # every warp has read its last KV tile: the PTX below writes over the pipeline's buffers, and
    # Triton's barrier analysis does not see it
    dep = dsmem.mbarrier_init(MBAR, RECV)
    for j in tl.static_range(HALF):  # the partner's slices, [M, LS] each, row-major in [M, L / 2] (rows padded)
        o_out = tl.where(first, acc[HALF + j], acc[j]) * o_scale  # [M, LS]
        dsmem.store_shared_v2(STAGE + (offs_m[:, None] * ROW + j * LS + offs_s[None, :]) * 4 + dep, o_out)
    dsmem.store_shared(STAGE + BLOCK_M * ROW * 4 + offs_m * 4 + dep, lse)
    dep = dsmem.fence_proxy_async(dep)
    dep = dsmem.cluster_barrier(dep)  # both KV loops are over and both mbarriers exist
    dsmem.bulk_copy_to_rank(STAGE + dep, 0, MBAR, RECV, 1 - rank)
    dep = dsmem.mbarrier_wait(MBAR + dep)  # the partner's half has landed here
    tl.debug_barrier()  # every thread has seen the mbarrier complete: thread 0 may invalidate it (the memory is
    dep = dsmem.mbarrier_inval(MBAR + dep)  # Triton's again after the barrier below)
    lse_p = dsmem.load_shared(BLOCK_M * ROW * 4 + offs_m * 4 + dep)  # [M]
    lse_0 = tl.where(first, lse, lse_p) * LOG2E  # [M] piece 0, log2 units
    lse_1 = tl.where(first, lse_p, lse) * LOG2E
    m = tl.maximum(lse_0, lse_1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w_0 = tl.exp2(lse_0 - m_use)  # [M], 0 for an empty piece
    w_1 = tl.exp2(lse_1 - m_use)
    w_sum = w_0 + w_1
    has = w_sum != 0.0  # NaN (a NaN piece) propagates to lse_out, as an empty piece (0) does not
    lse_out = tl.where(has, (m_use + tl.log2(tl.where(has, w_sum, 1.0))) * LN2, float("-inf"))
    merged = ()
    for j in tl.static_range(HALF):  # this piece's slices rank x HALF + j
        own = tl.where(first, acc[j], acc[HALF + j]) * o_scale  # [M, LS]
        recv = dsmem.load_shared_v2((offs_m[:, None] * ROW + j * LS + offs_s[None, :]) * 4 + dep)  # [M, LS]
        o_0 = tl.where(first, own, recv)
        o_1 = tl.where(first, recv, own)
        merged = merged + (tl.where((w_0 > 0.0)[:, None], o_0, 0.0) * w_0[:, None]
                           + tl.where((w_1 > 0.0)[:, None], o_1, 0.0) * w_1[:, None],)
    tl.debug_barrier()  # every warp has read the partner's half before Triton reuses the shared memory
    den = tl.where(has, w_sum, 1.0)[:, None]
    out_ptr = OUT + qo.to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh + offs_s[None, :]  # [M, LS]
    for j in tl.static_range(HALF):
        tl.store(out_ptr + (rank * HALF + j) * LS, _to_out(merged[j] / den, OUT.dtype.element_ty, INTERPRET),
                 mask=row_ok[:, None])
    if first:
        tl.store(LSE + qo.to(tl.int64) * stride_lt + h, lse_out, mask=row_ok)


@triton.jit
def _mla_reduce_kernel(
    O_PART, LSE_PART,  # [rows, H, L] fp32, [rows, H] fp32
    REDUCE_FINAL,  # [tiles, 8] int32 (WorkPlan.reduce_final)
    OUT, LSE,  # [T, H, L] bf16, [T, H] fp32
    stride_pt, stride_ph, stride_plt,
    stride_ot, stride_oh, stride_lt,
    BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    IDLE_EXIT: tl.constexpr,
):
    """One program per (reduce tile, packed row, BLOCK_L output channels): merges that row's split partials, BLOCK_S
    splits at a time ([BLOCK_S, BLOCK_L] fp32 per step; the launcher sizes both, `plan_reduce_pieces`). The
    program of the first channels also writes the row's LSE. A tile's row of REDUCE_FINAL holds all its metadata
    (one load), and piece i of a split tile has workspace rows PARTIAL_BASE + i x q_len (the planner's layout), so
    the partials are loaded one round trip after the kernel starts.

    Online form of numerics.md §3 in base 2: M = max_S L_S, O = Σ_S 2^(L_S - M) O_S / Σ_S 2^(L_S - M),
    L = M + log2 Σ_S 2^(L_S - M); empty partials (L_S = -inf) weigh 0: their O_S is selected away, not multiplied by 0.
    A NaN partial (from a NaN in a valid input) is not empty: its weight is NaN, and so are O and L.
    """
    tile = tl.program_id(0)
    r = tl.program_id(1)
    cols = tl.program_id(2)
    final = REDUCE_FINAL + tile * 8
    qo_start = tl.load(final + _TILE_QO_START)
    q_len = tl.load(final + _TILE_QO_END) - qo_start
    head_start = tl.load(final + _TILE_HEAD_START)
    num_h = tl.load(final + _TILE_HEAD_END) - head_start
    split_begin = tl.load(final + _SPLIT_BEGIN)
    split_end = tl.load(final + _SPLIT_END)
    base = tl.load(final + _PARTIAL_BASE)
    # a split tile's row has work; REDUCE_FINAL is the plan's (written before the launch), not the decode's output
    work = (split_end > split_begin) & (r < q_len * num_h)
    if PDL:  # launched while the decode ran: wait for it to finish (its partials are then visible)
        if IDLE_EXIT:  # only programs with work wait, and program (0, 0, 0), so that this grid never completes
            # before the decode does; the others exit at once. The wait then needs the metadata loads' results
            # (it comes after them instead of beside them): for grids with many idle programs (TritonMLADecode's)
            if work | ((tile == 0) & (r == 0) & (cols == 0)):
                tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
    if work:
        dq = r // num_h  # query row inside the tile
        h = head_start + r % num_h
        offs_s = tl.arange(0, BLOCK_S)
        offs_l = cols * BLOCK_L + tl.arange(0, BLOCK_L)
        m = float("-inf")  # running max of the partial LSEs (log2 units)
        w_sum = 0.0  # running Σ 2^(L_S - m)
        acc = tl.zeros([BLOCK_L], tl.float32)  # running Σ 2^(L_S - m) O_S
        i = split_begin
        while i < split_end:  # while, not range(): the interpreter cannot take loaded bounds
            idx = i + offs_s  # [S]
            ok = idx < split_end
            prow = (base + (idx - split_begin) * q_len + dq).to(tl.int64)  # [S] workspace rows
            lse_s = tl.load(LSE_PART + prow * stride_plt + h, mask=ok, other=float("-inf")) * LOG2E
            o_s = tl.load(O_PART + prow[:, None] * stride_pt + h * stride_ph + offs_l[None, :],
                          mask=ok[:, None], other=0.0)  # [S, BLOCK_L], loaded beside lse_s (no w in the mask)
            m_new = tl.maximum(m, tl.max(lse_s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            rescale = tl.exp2(m - m_use)  # 0 while m = -inf
            w = tl.exp2(lse_s - m_use)  # [S], 0 for empty partials
            o_s = tl.where((w > 0.0)[:, None], o_s, 0.0)  # an empty partial weighs 0, whatever its O_S holds
            acc = acc * rescale + tl.sum(w[:, None] * o_s, 0)
            w_sum = w_sum * rescale + tl.sum(w, 0)
            m = m_new
            i += BLOCK_S
        has_tok = w_sum != 0.0  # a NaN partial (a NaN input) makes w_sum NaN: out and lse NaN, not -inf
        o = acc / tl.where(has_tok, w_sum, 1.0)
        m_out = tl.where(m == float("-inf"), 0.0, m)
        lse = tl.where(has_tok, (m_out + tl.log2(tl.where(has_tok, w_sum, 1.0))) * LN2, float("-inf"))
        qo = (qo_start + dq).to(tl.int64)
        tl.store(OUT + qo * stride_ot + h * stride_oh + offs_l, _to_out(o, OUT.dtype.element_ty, INTERPRET))
        if cols == 0:
            tl.store(LSE + qo * stride_lt + h, lse)


# ----------------------------------------------------------------------------------------------------------------
# launcher


@dataclass(frozen=True)
class KernelConfig:
    """Launch choices of `_mla_decode_kernel`.

    Attributes:
        block_n: tokens per KV tile (power of two >= 16).
        num_warps, num_stages: Triton launch options (num_stages pipelines the KV-tile loop: with page_chunk,
            num_stages - 1 tiles buffered; with a block-table load per tile, Triton treats the KV load as indirect
            and buffers num_stages - 3 tiles, at least one).
        mma: dtype the MMAs see, "bf16" or "fp16" (numerics: mla_fast/numerics.py).
        head_group: heads per work item (the planner's head_group); rows per item = q_len x head_group <= 64.
        plan_block_n: token granularity of the planner's splits (a page of 64 by default).
        fixed_overhead: planner cost of one work item in plan_block_n blocks (None: the planner's default, 320
            tokens as in FlashMLA's scheduler).
        v_reload: load V a second time for P.V instead of reusing the K tile (fp8: lets Triton pipeline both loads).
        workers_per_sm: persistent programs per SM (programs = workers_per_sm x SMs).
        head_split: programs per worker; the planner's head group is head_group x head_split and the plan has
            workers_per_sm x SMs / head_split workers; program w * head_split + g runs worker w's items on the g-th
            head_group heads of each item. The head_split programs of a worker read the same KV tiles at the same
            time (one HBM read, the rest from L2), so smaller row tiles cost no extra HBM traffic.
        page_chunk: block-table entries loaded at once (a power of two), when each tile lies inside one page (page
            size and plan_block_n multiples of block_n) or, on tiles of at most 32 rows, pages divide a tile in at
            most gather_chunk_pages (`launch_page_chunk`); 0: the block table read in the tile loop.
        gather_chunk_pages: with pages smaller than a tile, the most pages per tile for which the block-table
            chunks are taken (`launch_page_chunk`); at more pages per tile each token's entry is read in the tile
            loop.
        page_select: with pages smaller than a tile and a block-table chunk, how each token's page is picked out
            of the chunk's entries in registers: 1, one [block_n, chunk] select; 2, the tile's block_n / page_size
            entries first (the chunk loaded as [tiles, entries per tile]), then each token's out of those (fewer
            registers, offline, bf16 at 16 heads: 198 instead of 255 and 28 bytes of spills at page 16, 205 at
            page 8). Same pages, so the same bits.
        split_l: latent column slices (1, 2, 4 or 8; halved while kv_lora_rank < 16 x split_l): the score MMA runs
            as split_l + 1 independent accumulation chains (slices of L/split_l, then R) summed pairwise at the end,
            instead of one chain over L + R; each slice is loaded once and reused for its P.V MMA. Same products,
            another fp32 summation order (within the kernel bound's accumulation term).
        lazy_l: keep the softmax denominator as [rows, block_n] running sums, reduced once per work item (one
            cross-warp reduction per tile fewer); another fp32 summation order of the same terms.
        fp8_stage: e4m3fn caches with mma="fp16": convert each tile to fp16 once, through an op Triton cannot move,
            so the MMAs read an fp16 tile from shared memory (ldmatrix) instead of gathering fp8 bytes. Same values
            (the conversion is exact); on the device only (the interpreter takes the plain cast).
        unchain: each score dot passes through `_unchain` (an scf.if), so that Triton lays out a 64-row score dot
            on both warpgroups (half of the tile's tokens each) instead of computing it twice. No numerical effect
            with split_l > 1 (the same dots and sums); with split_l = 1 the q_nope and q_pe dots become two chains
            summed at the end, as with slices (another fp32 summation order).
        kernel: "triton" (`_mla_decode_kernel`, every input), "gluon" (`mla_fast.gluon_decode`, the warp-specialized
            seesaw kernel: CUDA sm_90, bf16 with mma="bf16" or an e4m3fn cache with bf16 or e4m3fn q and
            mma="fp16", head_group 8/16/32/64 with q_len x head_group <= 64 packed rows,
            page_size % 64 == 0 or 16 or 32, L = 512, R = 64; of the fields above it reads head_group and
            head_split only) or
            "gluon_fp8" (`mla_fast.gluon_fp8`: CUDA sm_90, e4m3fn cache with bf16 or e4m3fn q, head_group 16, 8 or 4
            with q_len x head_group <= 16 packed rows, page_size % 64 == 0 or 16 or 32 (`gluon_decode.SMALL_PAGES`),
            L = 512, R = 64, mma="fp16"; it reads
            head_group, head_split, num_stages (tile slots of 36 KB) and workers_per_sm). All write the same
            partials, merged by the same reduce.
        interleave: each latent slice's score dot directly after that slice's load (and its fp16 staging with
            fp8_stage) instead of all loads first. Same dots, same pairwise sum: bitwise the same output. On the
            64-row wgmma layout the compiler then starts the score MMAs earlier (bf16 6-10 % faster); at 16 rows
            with fp8 staging it spills (5-7 % slower).
        qk_fp8: kernel="gluon_fp8" with e4m3fn q: the score MMAs take the fp8 codes of q and of the cache tile from
            shared memory (fp8 wgmmas, nine 64-channel accumulators added in fp32) instead of fp16 operands converted
            in registers; P.V is unchanged. Its accumulation is narrower than fp32: declared by
            `numerics.gluon_fp8_qk_numerics` (`kernel_numerics` gives each config's). default_config sets it for
            the "fp8" combination: 2-16 % faster on one H200 (mla_fast/gluon_fp8.py).
        pair_merge: where the plan pairs its splits (`WorkPlan.paired_splits` with `one_item_per_worker`: every tile
            in two pieces, on workers 2t and 2t + 1), the Triton kernel on CUDA sm_90+ with head_split 1 launches as
            2-CTA clusters and merges each pair in the kernel (`mla_fast.dsmem`), with no partials and no reduce
            kernel. Same bits. False: such plans too write partials for the reduce kernel.
    """

    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    mma: str = "bf16"
    head_group: int = 16
    plan_block_n: int = 64
    fixed_overhead: int | None = None
    v_reload: bool = False
    workers_per_sm: int = 1
    page_chunk: int = 0
    gather_chunk_pages: int = 4
    page_select: int = 1
    fp8_stage: bool = False
    head_split: int = 1
    split_l: int = 1
    lazy_l: bool = False
    unchain: bool = False
    interleave: bool = False
    kernel: str = "triton"
    pair_merge: bool = True
    qk_fp8: bool = False

    def __post_init__(self):
        if self.kernel not in ("triton", "gluon", "gluon_fp8"):
            raise ValueError(f"kernel must be 'triton', 'gluon' or 'gluon_fp8', got {self.kernel!r}")
        if self.mma not in ("bf16", "fp16"):
            raise ValueError(f"mma must be 'bf16' or 'fp16', got {self.mma!r}")
        if not isinstance(self.block_n, int) or self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n!r}")
        for name in ("num_warps", "head_group", "head_split", "workers_per_sm", "plan_block_n"):
            planner._check_int(getattr(self, name), name, 1)
        if self.kernel == "gluon" and self.block_n != 64:  # (mma 'bf16' for bf16 caches, 'fp16' for fp8: above)
            raise ValueError(f"kernel='gluon' (mla_fast.gluon_decode) takes block_n=64, got {self.block_n}")
        if self.kernel == "gluon_fp8" and (self.mma, self.block_n) != ("fp16", 64):
            raise ValueError("kernel='gluon_fp8' (mla_fast.gluon_fp8) takes mma='fp16' and block_n=64, got "
                             f"{self.mma!r}, {self.block_n}")
        if self.qk_fp8 and self.kernel != "gluon_fp8":
            raise ValueError(f"qk_fp8 (fp8 score MMAs) is a kernel='gluon_fp8' option, got kernel={self.kernel!r}")
        if self.page_chunk < 0 or self.page_chunk & (self.page_chunk - 1):
            raise ValueError(f"page_chunk must be 0 or a power of two, got {self.page_chunk}")
        if self.gather_chunk_pages < 1:
            raise ValueError(f"gather_chunk_pages must be >= 1, got {self.gather_chunk_pages}")
        if self.page_select not in (1, 2):
            raise ValueError(f"page_select must be 1 (one select) or 2 (tile, then token), got {self.page_select}")
        if self.split_l not in (1, 2, 4, 8):
            raise ValueError(f"split_l must be 1, 2, 4 or 8, got {self.split_l}")
        if self.split_l > 1 and self.v_reload:
            raise ValueError("split_l > 1 reuses each loaded slice for P.V: it excludes v_reload")


MAX_ROWS = 64  # packed (query row x head) rows per work item: one M tile
MAX_ROWS_SMALL_FP8 = 32  # fp8 caches, batch <= SMALL_BATCH: 32-row mma.sync tiles (as fast as 64 rows at b = 1)
REDUCE_TILE = 2048  # fp32 partial values per reduce step and program (32 per thread of REDUCE_WARPS)
REDUCE_WARPS = 2  # per reduce program; same bits as 4, graph replays on one H200 (eighth session, bf16, h = 16):
# 17.4 vs 18.1 us at (1, 8192), 57.0 vs 57.1 at (32, 4096), within 0.2 us elsewhere (1 warp: the same as 2)
REDUCE_MAX_S = 64  # most split partials merged per step of the reduce kernel
REDUCE_WAVE = 16  # reduce programs per SM that plan_reduce_pieces sizes a WorkPlan's grid for (about one wave of
# 2-warp programs): one H200, graph replays, bf16 h = 16, 64 requests of 1024 tokens but one of 32768 (37 pieces,
# the others 2, 2048 programs at 8 pieces per step): 54.6 us at 8 pieces per step, 57.7 at 16, 69.7 at 64; 16
# requests, one of 65536 tokens (94 pieces): 54.3 us at 8, 48.5 at 64 (the wave rule takes 32); fp8kv, 64
# requests, one of 32768 (74 pieces): 44.4 at 8, 55.0 at 64 (twenty-first session)
STEP_REDUCE_PIECES = 8  # TritonMLADecode's smallest reduce shape: [8, 256] steps (step_reduce_pieces)


def reduce_blocks(pieces: int, kv_lora_rank: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_L) of the reduce kernel merging `pieces` split pieces per step (`plan_reduce_pieces`): BLOCK_S
    = pieces rounded up to a power of two, at most REDUCE_MAX_S, on BLOCK_L = REDUCE_TILE / BLOCK_S output channels
    (at least 32, at most kv_lora_rank). Small steps keep the programs small (b = 64, 2 pieces: 1024 programs of [2,
    512] in one wave on an H200), many pieces take few serial steps over more programs (b = 1, 128 pieces: 256
    programs of [64, 32])."""
    block_s = min(triton.next_power_of_2(max(pieces, 1)), REDUCE_MAX_S)
    return block_s, min(kv_lora_rank, max(32, REDUCE_TILE // block_s))


def reduce_rows(config: KernelConfig, max_rows: int) -> int:
    """Reduce programs per split tile along the packed rows: max_rows (max q_len x head_group) for each of a
    worker's head_split programs (`launch`'s grid; `plan_reduce_pieces`' rows)."""
    return max_rows * config.head_split


def plan_reduce_pieces(plan, rows: int, kv_lora_rank: int, sms: int) -> int:
    """Split pieces merged per step of the reduce kernel for a WorkPlan (host ints only: no device read): as many as
    the largest split tile has (max_pieces, rounded up to a power of two, at most REDUCE_MAX_S), halved while the
    grid over the plan's split tiles (split_tiles x rows x kv_lora_rank / BLOCK_L programs) exceeds REDUCE_WAVE
    programs per SM and halving still narrows it. A wider step narrows the channel blocks, so every split tile runs
    more programs, while a narrower one adds a serial step (a round trip) to each tile with more pieces: where one
    long request's tile has many more pieces than the other split tiles, it takes several steps. rows: reduce
    programs per tile along the packed rows (`reduce_rows`); sms: the device's SM count."""
    if plan.split_tiles == 0:
        return plan.max_pieces
    pieces = min(triton.next_power_of_2(plan.max_pieces), REDUCE_MAX_S)
    while pieces > 1:
        blocks = kv_lora_rank // reduce_blocks(pieces, kv_lora_rank)[1]  # channel blocks per row
        if plan.split_tiles * rows * blocks <= REDUCE_WAVE * sms or blocks == 1:
            break
        pieces //= 2
    return pieces


def step_reduce_pieces(num_workers: int, tiles: int) -> int:
    """TritonMLADecode's default reduce_pieces: the pieces per tile of an even plan over long sequences, workers //
    tiles, rounded up to a power of two within [STEP_REDUCE_PIECES, REDUCE_MAX_S]. The step's reduce grid spans
    all its tiles, and a larger step shape has narrower channel blocks, so more programs: one H200, graph replays
    (us), reduce_pieces 8 / 16 / 32 / 64: (1, 8192, 16) bf16 31.1 / 28.4 / 23.3 / 17.5 (128 pieces per tile),
    (4, 8192, 16) 29.0 / 28.4 / 27.0 / 26.3, (1, 8192, 128) 37.1 / 35.4 / 28.6 / 26.6; (32, 4096, 16) 58.1 / 59.7 /
    61.3 / 66.3, (64, 4096, 16) 92.4 / 95.8 / 100.4 / 110.4, (32, 4096, 128) 90.9 / 102.7 / 122.4 / 160.2, fp8kv
    (32, 4096, 16) 41.7 / 43.2 / 45.2 / 50.0 (twentieth session). Fewer than 8 pieces per step would suit uniform
    batches of long sequences but not one long request among short ones, which a step cannot rule out: reduce_pieces
    2 / 4 / 8 at (32, 4096, 128) bf16 84.2 / 84.8 / 90.6 us (66 workers: 2 pieces per tile; at 8 the [8, 256] steps
    double the reduce's programs) and 106.8 / 107.3 / 113.2 with fp8kv, at (32, 4096, 16) 57.4 / 56.9 / 57.7, but 4 / 8
    with one request of 32768 tokens among short ones (64 of 1024, h = 16) 56.4 / 55.1 and (32, h = 128) 65.6 / 61.7
    (twenty-first session, two calls); pass reduce_pieces for a batch known to be uniform."""
    return min(max(triton.next_power_of_2(max(num_workers // max(tiles, 1), 1)), STEP_REDUCE_PIECES), REDUCE_MAX_S)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def dtype_combo(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """Key of KERNEL_NUMERICS / DEFAULT_MMA: "bf16" (q, kv bf16), "fp8kv" (bf16 q, fp8 kv), "fp8" (both fp8)."""
    if q_dtype == torch.bfloat16 and kv_dtype == torch.bfloat16:
        return "bf16"
    if q_dtype == torch.bfloat16 and _is_fp8(kv_dtype):
        return "fp8kv"
    if _is_fp8(q_dtype) and kv_dtype == q_dtype:
        return "fp8"
    raise ValueError(
        f"q/kv_cache dtypes must be bf16/bf16, bf16/fp8 or fp8/fp8 (e4m3fn, e4m3fnuz), got {q_dtype}/{kv_dtype}"
    )


SMALL_BATCH = 4  # batches up to this size (q_len 1) take no 64-row tiles (default_config)
GLUON_FP8_MAX_PROGRAM_TOKENS = 24 * 4096  # fp8 caches with more than two Gluon fp8 programs per worker take that
# kernel up to this many programs per worker x cache tokens of the batch (KV tile reads by 16-row programs); the
# fp8 seesaw beyond (benchmarks/boundary_h200_fp8kv_p*.csv, thirty-seventh session)
GLUON_FP8_MAX_PROGRAM_TOKENS_FP8_Q = 32 * 4096  # the same with e4m3fn q, whose fp8 score MMAs (qk_fp8) keep the
# Gluon fp8 kernel ahead longer (benchmarks/boundary_h200_fp8_p*.csv)
GLUON_FP8_PAGE_16_LESS_TOKENS = 8 * 4096  # on pages of 16 both thresholds are this much lower (measured: the
# *_p16*.csv tables; the Gluon fp8 kernel copies four TMA boxes per tile and program there, one on pages of 64)


# pages smaller than a tile, rows <= 32: how each token's page is picked and up to how many pages per tile the
# block-table chunks are taken, per cache dtype (default_config's docstring has the measurements)
BF16_PAGE_GATHER = dict(page_select=2, gather_chunk_pages=8)
FP8_PAGE_GATHER = dict(page_select=1, gather_chunk_pages=16)


def gluon_fp8_max_program_tokens(combo: str, page_size: int | None) -> int:
    """default_config's threshold on programs per worker x the batch's cache tokens for the Gluon fp8 kernel:
    GLUON_FP8_MAX_PROGRAM_TOKENS_FP8_Q for e4m3fn q ("fp8"), GLUON_FP8_MAX_PROGRAM_TOKENS for bf16 q, each
    GLUON_FP8_PAGE_16_LESS_TOKENS lower on pages of 16 (page_size None: pages of 64)."""
    tokens = GLUON_FP8_MAX_PROGRAM_TOKENS_FP8_Q if combo == "fp8" else GLUON_FP8_MAX_PROGRAM_TOKENS
    return tokens - GLUON_FP8_PAGE_16_LESS_TOKENS if page_size == 16 else tokens


def default_config(combo: str, num_heads: int, max_q_len: int, batch_size: int | None = None,
                   seesaw: bool = False, fp8_gluon: bool = False, kv_tokens: int | None = None,
                   page_size: int | None = None) -> KernelConfig:
    """Launch choice, the fastest correct candidate of mla-bench --candidates on one H200 (the h=16 shapes with b >= 32
    and the h = 128 shapes; see the module docstring).

    seesaw: the Gluon seesaw kernel can run the batch (`gluon_decode.supported`: CUDA sm_90, bf16, or an e4m3fn
    cache with bf16 or e4m3fn q, L = 512, R = 64, pages of a multiple of 64 tokens or of 16 or 32, contiguous q
    and cache);
    `batch_config` passes it.
    fp8_gluon: the Gluon fp8 kernel can run the batch (`gluon_fp8.supported`: CUDA sm_90, e4m3fn cache with bf16
    or e4m3fn q, L = 512, R = 64, pages of a multiple of 64 tokens or of 16 or 32, contiguous cache);
    `batch_config` passes it.
    kv_tokens: the batch's cache tokens (sum of seq_lens), for the Gluon fp8 kernel's rule; `batch_config` passes it.
    page_size: the cache's tokens per page, for the same rule (None: pages of 64); `batch_config` passes it.
    - fp8 caches with fp8_gluon at q_len <= 4: the Gluon fp8 kernel (kernel="gluon_fp8"), 16 packed rows per
      program: head_group 16 at q_len 1, 8 at q_len 2, 4 at q_len 3-4 (MTP), head_split = num_heads / head_group
      programs per worker (each KV tile read once from HBM, the rest from L2), two programs per SM with two tile
      slots each; taken when head_split <= 2 (16 or 32 heads at q_len 1, 16 at q_len 2) or head_split x kv_tokens
      <= gluon_fp8_max_program_tokens(combo, page_size): 24 x 4096 for fp8kv, 32 x 4096 for e4m3fn q, whose fp8
      score MMAs (qk_fp8; numerics: `numerics.gluon_fp8_qk_numerics`) keep the Gluon fp8 kernel ahead longer; on
      pages of 16 each 8 x 4096 lower. Beyond, the fp8 seesaw. Measured in the thirty-seventh session
      (benchmarks/boundary_bench.py, one H200, graph replays): SHAPES, 45 shapes at 16-128 heads and q_len 1-4 with
      up to 8 programs per worker, on pages of 16, 32 and 64 (benchmarks/boundary_h200_{fp8kv,fp8}_p{16,32,64}.csv),
      and MTP_SHAPES, 12 shapes at 32-128 heads and q_len 2-4 with 8-32 programs, on pages of 16 and 64 (*_mtp.csv).
      At 16 x 4096 and below the Gluon fp8 kernel wins at every SHAPES shape (23.7 vs 27.0 us at (1, 8192, 128)
      fp8kv on pages of 16); at 24 x 4096 too except (3, 8192, 16) q_len 4 fp8kv on pages of 16, but among
      MTP_SHAPES on pages of 16 the seesaw wins at 24 x 4096 with fp8kv (29.2 vs 32.9 us at (1, 6144, 128) q_len 2,
      29.0 vs 31.7 at (1, 3072, 128) q_len 4; the lower page-16 threshold); at 32 x 4096 the fp8 seesaw wins 11-12
      of 13 SHAPES shapes with fp8kv (by up to 26 %: 30.6 vs 38.7 us at (4, 8192, 16) q_len 3 on pages of 16) and
      10 with e4m3fn q on pages of 16, the Gluon fp8 kernel 8-12 of 13 with e4m3fn q on pages of 32 and 64 (25.2 vs
      29.9 at (32, 512, 128); a tie at 0.1 us counted for neither); from 48 x 4096 on the seesaw wins or ties (38.0 vs 38.0 us at (3, 8192, 128) with
      e4m3fn q on pages of 64; 58.9 vs 97.5 at (8, 8192, 128) fp8kv on pages of 16). The rule loses at 0-4 shapes
      per table, by at most 9.9 % ((32, 512, 128) with e4m3fn q on pages of 16: short sequences favour the Gluon fp8
      kernel at any programs x tokens); the rule test names each loss. Before the seesaw's fp8 loader partition
      (thirty-third to thirty-sixth sessions: 410 -> 331.5 us at (128, 4096, 128) on pages of 16) the thresholds
      were 32 x 4096 and 64 x 4096 for every page (eleventh and twenty-third sessions; docs/perf_history.md).
    - fp8 caches with 64 packed rows (33-64) and seesaw, where the Gluon fp8 kernel is not taken: the Gluon seesaw
      kernel on fp16 operands (kernel="gluon", mma="fp16"; each fp8 tile expanded in place then, converted by its
      loader partition since the thirty-third session: gluon_decode.fp8_loader). One H200, graph replays (ninth
      session), fp8kv, the final kernel (mla-bench) against the Triton staged path (the default before):
      377.3 vs 557.3 us at (128, 4096, 128), 113.2 vs 153.1 at (32, 4096, 128), 67.8 vs 86.4 at (8, 8192, 128),
      210.3 vs 274.9 at (128, 4096, 64); MTP 121.3 vs 149.7 at (64, 4096, 16) q_len 4 and 49.9 vs 53.2 at
      (16, 4096, 16) q_len 4. The boundary with the Gluon fp8 kernel was measured on the first version (16-byte
      expansion layout, whole groups; 456.8 vs 557.3 us at (128, 4096, 128)): the Gluon fp8 kernel was faster where
      its rule takes the batch (51.8 vs 52.4 us at (4, 8192, 128), 34.5 vs 41.4 at (4, 8192, 64), 52.8 vs 56.2 at
      (8, 8192, 64)), and at (16, 4096, 64), which the rule gives the seesaw, the staged path was too (53.2 vs
      55.5). Re-measured with the final kernel (tenth session, one call, Gluon fp8 vs seesaw): the rule errs by
      0.6-5.2 % only on its boundary (batch x programs x 16 = 512) at s = 8192 (51.9 vs 49.5 us at (4, 8192, 128),
      52.9 vs 51.7 at (8, 8192, 64), 52.4 vs 50.1 at (8, 8192, 16) q_len 3), where at s = 4096 the Gluon fp8
      kernel is 15-18 % faster (33.1 vs 39.1 at (4, 4096, 128), 33.6 vs 39.6 at (8, 4096, 64)): kept then, and
      replaced by the token rule in the eleventh session (above; docs/perf_history.md; benchmarks/boundary_bench.py).
    - bf16 with more than 16 packed rows (q_len x head_group, head_group 8-64) and seesaw: the Gluon kernel
      (kernel="gluon"; MTP rows packed as in the Triton kernel). At q_len 1 (64 heads per program), one H200, graph
      replays: 299 vs 447 us at (128, 4096, 128) and 86 vs 130 us at (32, 4096, 128) against the Triton 64-row
      layout, 27.0 vs 29.8 us at (1, 8192, 128) against the small-batch rule below (seventh session: 32.6 vs 44.9,
      43.7 vs 76.1, 57.0 vs 141.0 us at b = 2 / 4 / 8, s = 8192, and 55.3 vs 138.5 at (16, 4096, 128)); MTP
      (benchmarks/mtp_bench.py) 574 vs 900 us at (128, 4096, 128) q_len 2 (32 heads x 2 rows), 142 vs 228 at
      (32, 4096, 128) q_len 2, 102 vs 135 and 168 vs 236 at (64 / 128, 4096, 16) q_len 4, 270 vs 443 at
      (64, 4096, 64) q_len 3 (48 of 64 rows). At 32 rows (half of its 64-row tile used; seventh session) against the
      Triton 32-row path: 32 heads at q_len 1 167.6 vs 221.2 us at (128, 4096), 320.0 vs 429.8 at (128, 8192), 98.7
      vs 122.0 at (64, 4096), 61.2 vs 69.7 at (32, 4096), 21.9 vs 23.5 at (1, 8192); 16 heads at q_len 2 167.5 vs
      221.0, 98.7 vs 122.5, 61.8 vs 71.5, 22.0 vs 23.3 at (128 / 64 / 32, 4096) and (1, 8192). At 16 rows the
      Triton kernel stays (bandwidth-bound there: 293.8 us at (128, 8192, 16), the seesaw's 64-row tile takes
      about 320).

    head_group: the largest divisor of num_heads with max_q_len x head_group <= 64 rows (MAX_ROWS; 32 for fp8 caches
    at batch_size <= SMALL_BATCH).
    - every path with up to 32 rows takes latent slices (split_l 4 or 8: independent score MMA chains), 4-10 %
      faster at every shape measured, and no register spills at 16 rows (128 regs + 40 bytes of stack before).
    - rows <= 16 (bf16 or bf16 q + e4m3fn cache): 4 warps (each warp's share of the 64-column score tile is twice
      as wide: more independent MMAs per warp), another 2-10 %; at 32 rows 4 warps spill, so 8 warps there.
    - bf16, rows <= 32 (mma.sync tiles): block-table chunks of 32 pages, two 64-token tiles buffered, one program
      per SM (vs per-tile block-table loads: 3-6 % faster at b >= 32 and s = 4096).
    - pages smaller than a tile, rows <= 32 (`launch_page_chunk`; twenty-sixth session, one H200, graph replays,
      16 heads, benchmarks/config_ab.py, the same bits): bf16 picks each token's page in two steps (page_select
      2: fewer registers, no spills) and takes chunks up to pages of 8 (gather_chunk_pages 8): against the
      one-step select 60.1 vs 68.2 us at (32, 4096) page 16, 98.1 vs 122.1 at (64, 4096), 320.1 vs 336.0 at
      (128, 8192), 176.6 vs 225.7 at (32, 16384), 16.8 vs 18.0 at (1, 8192); page 32 5-25 % faster likewise; page
      8 against the in-loop gather 64.2 vs 68.4 at (32, 4096), 355.6 vs 437.5 at (128, 8192), 190.8 vs 224.5 at
      (32, 16384). Pages of 4 stay in the loop (76.4 vs 68.4 at (32, 4096)). fp8 caches keep the one-step
      select (the two-step one was 5-8 % slower: 357.7 vs 337.9 at (128, 8192) page 8) and take chunks up to pages
      of 4 (gather_chunk_pages 16): page 8 58.6 vs 68.4 at (32, 4096), 337.5 vs 401.7 at (128, 8192), 182.8 vs
      219.4 at (32, 16384); page 4 63.1 vs 68.2, 379.0 vs 406.6, 203.3 vs 221.8; at (1, 8192) 16.3 vs 15.7 and
      16.2 vs 15.6 (slower by 0.6 us).
    - 64 rows (wgmma tiles, bf16 or fp8 caches): two programs per worker on halves of the head group when num_heads
      allows (head_split 2: both read each KV tile at the same time, once from HBM; 4 % faster at (128, 4096, 128)),
      and the score dots behind `_unchain` (each warpgroup half of the scores): bf16 491 vs 586 us at
      (128, 4096, 128), 164 vs 188 us at (32, 4096, 128). Two latent slices: bf16 484 vs 491 us (four slices; 497
      with one) at (128, 4096, 128), 142 vs 145 us at (32, 4096, 128); 4 vs 18 spilled registers. bf16 with
      block-table chunks (one tile buffered either way): 468 vs 481 us at (128, 4096, 128), 140 vs 144 at
      (32, 4096, 128). bf16 with each slice's score dot written after its load (interleave): 441 vs 470 us at
      (128, 4096, 128), 132 vs 139 at (32, 4096, 128), 235 vs 262 and 81 vs 85 at (128 / 32, 4096, 64). For fp8
      caches interleave measured -2.5 to +1.3 % (153 vs 157, 543 vs 546 us at h = 128; 87 vs 86, 276 vs 273 at
      h = 64): left off.
    - fp8 caches with 64 rows without seesaw: the staged fp16 tile (fp8_stage) on the same layout, three stages with
      block-table chunks (two tiles buffered, 216 KB of shared memory): 552 vs 975 us at (128, 4096, 128) and 155 vs 247 us at
      (32, 4096, 128) against 32-row mma.sync tiles (602 / 172 us with two stages and per-tile block-table loads);
      at 64 heads (one program per worker) 272 vs 489 us at (128, 4096, 64), 87 vs 135 us at (32, 4096, 64).
    - bf16 or fp8 q + e4m3fn cache, rows <= 16: each tile converted to fp16 once (fp8_stage; 6-9 % faster than the
      V-reload path), block-table chunks with two tiles buffered and per-column softmax sums (lazy_l): with 4 warps
      and latent slices 4-9 % faster than per-tile block-table loads and 5 stages. Eight slices of 64 channels:
      staging a 128-channel slice had 8.3-way shared-store bank conflicts (ncu; each 8-lane phase of the
      [4, 8]-thread layout stores 4 distinct 16-byte bank groups twice); 64-channel slices take a [8, 4]-thread
      layout whose phases cover all 8. 4-10 % faster than four slices (309 vs 342 us at (128, 8192, 16)); three
      tiles buffered (num_stages 4, 198 KB of shared memory) 1-3 % faster again at b >= 32 (304 us), 3 % slower
      at b = 1. The same path for fp8 q (q staged as fp16 once per item): 304 vs 407 us for the V-reload path.
    - fp8 caches with 17-32 rows (8 warps): the same staged path with two tiles buffered: 989 vs 1204 us at
      (128, 4096, 128), 250 vs 308 us at (32, 4096, 128) against fp16 MMAs on the fp8 tile gathered from shared
      memory with V loaded again (v_reload). At (1, 8192, 128) (batch <= SMALL_BATCH) 31.3 us, as fast as 64 rows
      (31.1), so fp8 caches at batch <= SMALL_BATCH keep 32-row tiles, except with seesaw and fp8_gluon: where the
      Gluon fp8 kernel's rule does not take such a batch (long sequences), the seesaw's 64-row tiles do (eleventh session:
      48.2 vs 51.7 us for the Gluon fp8 kernel at (4, 8192, 128), 46.8 vs 52.0 at (2, 16384, 128), 47.7 vs 52.2 at
      (1, 32768, 128), 50.6 vs 53.4 at (4, 16384, 64); the Triton 32-row path was not timed there).
    - bf16 with 64-row tiles, q_len 1 and batch_size <= SMALL_BATCH: 16-row tiles as at h = 16, all num_heads / 16 head
      groups of a worker reading each KV tile together (head_split; each KV tile read once from HBM, the rest from
      L2): 31.5 vs 35.1 µs at (1, 8192, 128) (FlashInfer 27.4); 29.4 vs 31.4 µs against the unchained 64-row layout
      with two slices. At b = 32 the same config took 263 vs 189 µs (8 x the L2 reads), hence the batch rule; sizes
      between were not measured, the threshold 4 is a guess.
    - MTP: q_len 4 at 16 heads packs 64 rows (one program per worker): 157 vs 229 us (bf16) and 163 vs 259 us
      (fp8 KV) at (64, 4096, 16), 272 vs 445 and 285 vs 502 us at (128, 4096, 16), against 32-row tiles of 8 heads
      x 4 rows (each KV tile then read by two items).
    Measured at q_len 1 with 16, 64 (fp8 caches) or 128 heads, and q_len 4 with 16 heads; other head counts and
    q_lens take the rule of their row count.
    """
    if reason := q_len_unsupported(max_q_len):
        raise ValueError(reason)
    fp8_kv = combo in ("fp8kv", "fp8")
    small_batch = max_q_len == 1 and batch_size is not None and batch_size <= SMALL_BATCH
    max_rows = MAX_ROWS_SMALL_FP8 if fp8_kv and small_batch else MAX_ROWS
    head_group = _largest_head_group(num_heads, max_q_len, max_rows)
    rows = head_group * max_q_len
    mma = DEFAULT_MMA[combo]
    warps = 4 if rows <= 16 else 8
    fp8_group = _gluon_fp8_head_group(max_q_len) if fp8_kv and fp8_gluon else None
    if fp8_group and num_heads % fp8_group == 0:
        programs = num_heads // fp8_group  # per worker
        max_tokens = gluon_fp8_max_program_tokens(combo, page_size)
        if programs <= 2 or (kv_tokens is not None and programs * kv_tokens <= max_tokens):
            return KernelConfig(block_n=64, mma=mma, head_group=fp8_group, head_split=programs, num_stages=2,
                                workers_per_sm=2, kernel="gluon_fp8", qk_fp8=combo == "fp8")
    # the seesaw on its 64-row tiles (fp8 caches: more than 32 rows; where the Gluon fp8 kernel's rule did not take
    # the batch, small batches too, whose 32-row tiles are otherwise the Triton kernel's)
    seesaw_group = _largest_head_group(num_heads, max_q_len, MAX_ROWS) if fp8_kv and fp8_gluon else head_group
    if seesaw and seesaw_group in _gluon_head_groups() and seesaw_group * max_q_len > (32 if fp8_kv else 16):
        return KernelConfig(block_n=64, mma=mma, head_group=seesaw_group, head_split=num_heads // seesaw_group,
                            kernel="gluon")
    if rows > 32 and small_batch:  # bf16, few requests
        group = _largest_head_group(num_heads, max_q_len, 16)  # <= 16 rows (q_len 1); the programs cover every head
        return KernelConfig(block_n=64, num_warps=4, num_stages=3, mma=mma, head_group=group,
                            head_split=num_heads // group, page_chunk=32, split_l=4, **BF16_PAGE_GATHER)
    if rows > 32:  # 64-row wgmma tiles
        head_split = 2 if num_heads % (2 * head_group) == 0 else 1
        if fp8_kv:
            return KernelConfig(block_n=64, num_warps=8, num_stages=3, mma=mma, head_group=head_group,
                                head_split=head_split, split_l=2, unchain=True, fp8_stage=True, page_chunk=32)
        return KernelConfig(block_n=64, num_warps=8, num_stages=2, mma=mma, head_group=head_group,
                            head_split=head_split, split_l=2, unchain=True, page_chunk=32, interleave=True)
    if fp8_kv:  # bf16 or fp8 q with an fp8 cache: <= 32 rows
        return KernelConfig(block_n=64, num_warps=warps, num_stages=4 if rows <= 16 else 3, mma=mma,
                            head_group=head_group, fp8_stage=True, split_l=8, page_chunk=32, lazy_l=True,
                            **FP8_PAGE_GATHER)
    return KernelConfig(block_n=64, num_warps=warps, num_stages=3, mma=mma, head_group=head_group, page_chunk=32,
                        split_l=4, **BF16_PAGE_GATHER)


FORCED_KERNELS = ("seesaw", "gluon_fp8")  # the Gluon kernels `forced_config` can pin


def forced_config(combo: str, num_heads: int, max_q_len: int, kernel: str) -> KernelConfig | None:
    """default_config's geometry for one Gluon kernel, whatever the batch's size and cache tokens, or None where that
    kernel takes no such rows:

    - "seesaw": the Gluon seesaw kernel (kernel="gluon") as default_config lays it out when the Gluon fp8 kernel is
      not offered: bf16 above 16 packed rows, fp8 caches above 32 (64-row tiles, head_split programs per worker);
    - "gluon_fp8": the Gluon fp8 kernel on num_heads / head_group programs of 16 packed rows per worker (fp8 caches,
      q_len <= 4, head_group dividing num_heads).

    For tests, benchmarks and the verifier's "seesaw" and "gluon_fp8" backends, which pin a kernel that
    default_config gives only some batches (the verifier's small batches mostly take the Triton kernel or the
    Gluon fp8 kernel). Whether the kernel runs on a given batch (dtypes, pages, device) is `gluon_unsupported`."""
    if kernel == "seesaw":
        config = default_config(combo, num_heads, max_q_len, None, seesaw=True)
        return config if config.kernel == "gluon" else None
    if kernel == "gluon_fp8":
        # one request of one token passes the Gluon fp8 kernel's rule: that kernel wherever it can take the heads
        config = default_config(combo, num_heads, max_q_len, 1, fp8_gluon=True, kv_tokens=1)
        if config.kernel != "gluon_fp8":
            return None
        return replace(config, head_split=num_heads // config.head_group)
    raise ValueError(f"kernel must be one of {FORCED_KERNELS}, got {kernel!r}")


def _largest_head_group(num_heads: int, max_q_len: int, max_rows: int) -> int:
    """The largest divisor of num_heads with max_q_len x it <= max_rows packed rows."""
    return max(d for d in range(1, num_heads + 1) if num_heads % d == 0 and d * max_q_len <= max_rows)


def _gluon_fp8_head_group(max_q_len: int) -> int | None:
    """Heads per program of the Gluon fp8 kernel at q_len max_q_len (q_len x head_group <= its 16 packed rows), or
    None past q_len 4 (imported only when asked for)."""
    from mla_fast.gluon_fp8 import HEAD_GROUPS, ROWS

    return max((g for g in HEAD_GROUPS if g * max_q_len <= ROWS), default=None)


def _gluon_head_groups() -> tuple[int, ...]:
    """Heads per program the Gluon kernel takes (gluon_decode.HEAD_GROUPS, imported only when asked for)."""
    from mla_fast.gluon_decode import HEAD_GROUPS

    return HEAD_GROUPS


def batch_config(batch, max_q_len: int) -> KernelConfig:
    """default_config for `batch` (its dtypes, heads, size and cache tokens: one host sync) on its device, up to
    q_len max_q_len."""
    from mla_fast import gluon_decode, gluon_fp8

    combo = dtype_combo(batch.q.dtype, batch.kv_cache.dtype)
    return default_config(combo, batch.num_heads, max_q_len, batch.batch_size, seesaw=gluon_decode.supported(batch),
                          fp8_gluon=gluon_fp8.supported(batch), kv_tokens=int(batch.seq_lens.sum()),
                          page_size=batch.page_size)


def effective_split_l(config: KernelConfig, kv_lora_rank: int) -> int:
    """The kernel's latent slices: config.split_l, halved while a slice would be narrower than 16 channels (tl.dot)."""
    split_l = config.split_l
    while split_l > 1 and kv_lora_rank < 16 * split_l:
        split_l //= 2
    return split_l


def _max_q_len(batch) -> int:
    """The batch's largest q_len, at least 1 (one host sync)."""
    return max(int(batch.q_lens.max()) if batch.q_lens.numel() else 1, 1)


def q_len_unsupported(max_q_len: int) -> str | None:
    """Why the kernels cannot take query rows up to q_len max_q_len, or None: a program packs q_len x head_group
    (query row, head) rows, at most MAX_ROWS, with one head at least."""
    if max_q_len > MAX_ROWS:
        return (f"q_len must be <= {MAX_ROWS} (a program packs q_len x heads rows, at most {MAX_ROWS}), "
                f"got {max_q_len}")
    return None


def gluon_unsupported(batch, config: KernelConfig, max_rows: int) -> str | None:
    """Why config's Gluon kernel (kernel "gluon" or "gluon_fp8") cannot take `batch` in config's geometry at max_rows
    packed rows per program (the reason names the field and expectation), or None; None for the Triton kernel, whose
    checks are check_batch's. No host sync."""
    if config.kernel == "gluon":
        from mla_fast import gluon_decode

        return gluon_decode.unsupported(batch, config.head_group, config.head_split, max_rows, config.mma)
    if config.kernel == "gluon_fp8":
        from mla_fast import gluon_fp8

        return gluon_fp8.unsupported(batch, config.head_group, config.head_split, max_rows, config.qk_fp8)
    return None


def kernel_numerics(config: KernelConfig, combo: str, channels: int = DEEPSEEK_CHANNELS) -> KernelNumerics:
    """The declared rounding points (mla_fast/numerics.py) of the kernel that `config` launches on a batch of dtype
    combination `combo` (`dtype_combo`) whose scores sum `channels` = L + R: the Gluon fp8 kernel's fp8 score MMAs
    with qk_fp8 (DeepSeek's 576 channels only), else `triton_numerics(config.mma, config.block_n, channels)` (the
    Triton kernel; the Gluon kernels round as it does)."""
    if combo not in DEFAULT_MMA:
        raise ValueError(f"combo must be one of {tuple(DEFAULT_MMA)}, got {combo!r}")
    if config.qk_fp8:
        if combo != "fp8":
            raise ValueError(f"KernelConfig.qk_fp8 needs e4m3fn q (combo 'fp8'), got combo {combo!r}")
        if channels != DEEPSEEK_CHANNELS:
            raise ValueError(f"KernelConfig.qk_fp8: the Gluon fp8 kernel takes L + R = {DEEPSEEK_CHANNELS}, got "
                             f"{channels}")
        return gluon_fp8_qk_numerics(config.block_n)
    return triton_numerics(config.mma, config.block_n, channels)


def pair_merge_applies(plan, config: KernelConfig, device: torch.device, kv_lora_rank: int) -> bool:
    """Whether `launch` merges the plan's split tiles inside the Triton kernel, in pairs on 2-CTA clusters
    (KernelConfig.pair_merge, mla_fast.dsmem), instead of launching the reduce kernel: the plan runs one item per
    worker with every tile in two pieces (an even number of workers), the config has head_split 1 and an even
    number of latent slices, and the device takes clusters (CUDA sm_90+, not the interpreter)."""
    return (config.pair_merge and config.kernel == "triton" and config.head_split == 1
            and plan.one_item_per_worker and plan.paired_splits and (plan.worker_indptr.numel() - 1) % 2 == 0
            and effective_split_l(config, kv_lora_rank) % 2 == 0 and dsmem.supported(device, INTERPRET))


def alloc_workspace(plan, num_heads: int, kv_lora_rank: int, device: torch.device, pair_merge: bool):
    """(o_part [rows, H, L], lse_part [rows, H]) fp32 for the plan's partial rows; the pair merge writes no partials,
    so one row then stands in for the kernel's pointers (as it does for a plan that splits nothing)."""
    rows = 1 if pair_merge else max(int(plan.num_partial_rows), 1)
    return (torch.empty(rows, num_heads, kv_lora_rank, dtype=torch.float32, device=device),
            torch.empty(rows, num_heads, dtype=torch.float32, device=device))


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): CUDA sm_90 and newer, not ROCm, not the interpreter."""
    return (not INTERPRET and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent grid); 4 on CPU (interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _scale_tensor(scale, device: torch.device) -> torch.Tensor:
    """A per-tensor fp32 scale as a device tensor [1] (None -> 1.0); no host sync."""
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"q_scale/kv_scale must be per-tensor (one element), got shape {tuple(scale.shape)}")
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def dtypes_unsupported(batch) -> str | None:
    """Why the kernels cannot take the batch's q and cache dtypes here, or None: they take bf16 / bf16, bf16 / fp8
    and fp8 / fp8 (`dtype_combo`: not fp16, nor e5m2 caches), and Triton compiles e4m3fnuz (fp8e4b8) for AMD CDNA3
    only; CUDA devices and Triton 3.6's interpreter refuse the type."""
    try:
        dtype_combo(batch.q.dtype, batch.kv_cache.dtype)
    except ValueError as e:
        return str(e)
    if torch.version.hip is None or INTERPRET:
        for name in ("q", "kv_cache"):
            if getattr(batch, name).dtype == torch.float8_e4m3fnuz:
                return f"{name}: e4m3fnuz runs on ROCm only (Triton's fp8e4b8), not on CUDA or the interpreter"
    return None


def check_batch(batch) -> None:
    """Raise ValueError naming the field when the kernel cannot take `batch`."""
    if reason := dtypes_unsupported(batch):
        raise ValueError(reason)
    L, D = batch.kv_lora_rank, batch.q.shape[-1]
    R = D - L
    for name, n in (("kv_lora_rank", L), ("rope_dim", R)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernel, got {n}")
    if batch.kv_cache.shape[-1] != D:
        raise ValueError(f"kv_cache last dim must equal q's head_dim {D}, got {batch.kv_cache.shape[-1]}")
    if batch.q.stride(-1) != 1 or batch.kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache must be contiguous in the last dim")
    if batch.block_table.shape[-1] > 1 and batch.block_table.stride(-1) != 1:  # the kernels take the row stride
        raise ValueError(f"block_table must be contiguous in its last dim (stride 1), got strides "
                         f"{batch.block_table.stride()}")
    for name in ("seq_lens", "q_lens"):  # read as dense arrays
        t = getattr(batch, name)
        if t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}")
    if batch.q.device != batch.kv_cache.device:
        raise ValueError(f"q and kv_cache must be on one device, got {batch.q.device} and {batch.kv_cache.device}")


def check_outputs(batch, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Raise ValueError naming `out` or `lse` when a preallocated output cannot take the batch's result: out must be
    bf16 [T, H, L] (or fp32: the Triton kernel then rounds once to fp32; `decode` refuses it for the Gluon kernels)
    and lse fp32 [T, H], on q's device, each contiguous in its last dim (the kernels take the other strides)."""
    T, H, L = batch.q.shape[0], batch.num_heads, batch.kv_lora_rank
    for name, t, shape, dtypes in (("out", out, (T, H, L), (torch.bfloat16, torch.float32)),
                                   ("lse", lse, (T, H), (torch.float32,))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != batch.q.device:
            raise ValueError(f"{name} must be a {' or '.join(map(str, dtypes))} tensor of shape {shape} on "
                             f"{batch.q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")


def make_plan(batch, config: KernelConfig, num_workers: int | None = None, seq_lens=None, q_lens=None,
              split_tokens: int | None = None):
    """WorkPlan for `batch` with this kernel's granularity (host sync: the planner reads seq_lens). seq_lens, q_lens:
    the batch's lengths already on the host (CPU int tensors [B]), read instead (no sync; the plan is then on the
    CPU). split_tokens: the planner's fixed splits (`planner.plan_decode`), None: its least busiest worker."""
    device = batch.q.device
    return planner.plan_decode(
        batch.seq_lens if seq_lens is None else seq_lens,
        batch.q_lens if q_lens is None else q_lens,
        batch.num_heads,
        num_workers or max(1, config.workers_per_sm * num_sms(device) // config.head_split),
        block_n=config.plan_block_n,
        fixed_overhead=config.fixed_overhead,
        head_group=config.head_group * config.head_split,
        split_tokens=split_tokens,
    )


GATHER_CHUNK_MAX_ROWS = 32  # packed rows per program up to which it does (64-row tiles were slower with them)


def tiles_in_pages(config: KernelConfig, page_size: int, plan_block_n: int) -> bool:
    """Whether every KV tile of an item lies inside one page (the Triton kernel's TILE_IN_PAGE: contiguous rows):
    page_size and plan_block_n (where items start) multiples of block_n."""
    return page_size % config.block_n == 0 and plan_block_n % config.block_n == 0


def launch_page_chunk(config: KernelConfig, page_size: int, plan_block_n: int, block_m: int) -> int:
    """Block-table entries the Triton kernel loads at once (its PAGE_CHUNK; 0: it reads them in the tile loop).

    config.page_chunk where each tile lies inside one page (`tiles_in_pages`). With pages smaller than a tile, each
    token's page is picked from a chunk in registers where the pages divide the tile in at most
    config.gather_chunk_pages, item starts lie on tile boundaries (plan_block_n a multiple of block_n) and programs
    have at most GATHER_CHUNK_MAX_ROWS rows (block_m); the chunk covers at least one tile, so that chunks end on tile
    boundaries. Measured on one H200 (twenty-fourth session, docs/kernels.md, "Pages smaller than 64"):
    page_chunk 32 at pages of 16 and 32, 16 and 32 rows, 0.7-26 % faster than the in-loop gather at eight shapes
    (the same bits); at 64 rows (h = 128) and at page 1 (64 pages per tile) slower. How many pages per tile
    (gather_chunk_pages) pay is set by `default_config` per cache dtype (twenty-sixth session: pages of 8 for bf16
    with the two-step select, 4 and 8 for fp8 caches). Elsewhere (pages of 1-2 at block_n 64, 3, 48, ...): 0."""
    if not config.page_chunk:
        return 0
    if tiles_in_pages(config, page_size, plan_block_n):
        return config.page_chunk
    if (plan_block_n % config.block_n == 0 and config.block_n % page_size == 0
            and config.block_n // page_size <= config.gather_chunk_pages and block_m <= GATHER_CHUNK_MAX_ROWS):
        return max(config.page_chunk, config.block_n // page_size)
    return 0


def _launch_triton(batch, plan, out, lse, o_part, lse_part, q_scale, kv_scale, config, qo_indptr, max_rows, pdl,
                   num_workers, pair_merge=False):
    """Launch `_mla_decode_kernel` (config.kernel == "triton") on preallocated buffers; returns the compiled kernel.
    pair_merge: as 2-CTA clusters that merge each two-piece tile (`pair_merge_applies`; no reduce follows)."""
    L = batch.kv_lora_rank
    R = batch.q.shape[-1] - L
    kv = batch.kv_cache
    tile_in_page = tiles_in_pages(config, kv.shape[1], plan.block_n)
    split_l = effective_split_l(config, L)
    block_m = max(16, triton.next_power_of_2(max_rows))  # the M tile over max_rows = q_len x head_group rows
    page_chunk = launch_page_chunk(config, kv.shape[1], plan.block_n, block_m)
    args = (
        batch.q, kv, batch.block_table, batch.seq_lens, qo_indptr,
        plan.work_items, plan.worker_indptr, plan.work_items.shape[0],
        out, lse, o_part, lse_part,
        q_scale, kv_scale,
        float(batch.sm_scale),
        batch.q.stride(0), batch.q.stride(1),
        kv.stride(0), kv.stride(1),
        batch.block_table.stride(0),
        out.stride(0), out.stride(1),
        lse.stride(0),
        o_part.stride(0), o_part.stride(1),
        lse_part.stride(0),
    )
    kwargs = dict(
        PAGE_SIZE=kv.shape[1], L=L, R=R, BLOCK_M=block_m, BLOCK_N=config.block_n,
        MMA=config.mma, INTERPRET=INTERPRET, UPCAST_BF16=UPCAST_BF16,
        TILE_IN_PAGE=tile_in_page,
        PAGE_CHUNK=page_chunk, PAGE_SELECT=config.page_select, V_RELOAD=config.v_reload,
        FP8_STAGE=config.fp8_stage and not INTERPRET and config.mma == "fp16" and kv.dtype == torch.float8_e4m3fn,
        HEAD_SPLIT=config.head_split, SPLIT_L=split_l, LAZY_L=config.lazy_l, UNCHAIN=config.unchain,
        INTERLEAVE=config.interleave, PDL=pdl and not pair_merge, ONE_ITEM=plan.one_item_per_worker,
        PAIR_MERGE=pair_merge, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    grid_ctas = num_workers * config.head_split
    if pair_merge:
        return dsmem.launch_in_pairs(_mla_decode_kernel, grid_ctas, args, kwargs)
    return _mla_decode_kernel[(grid_ctas,)](*args, **kwargs)


def launch(batch, plan, out, lse, config: KernelConfig, workspace=None, q_scale=None, kv_scale=None,
           max_rows: int | None = None, qo_indptr: torch.Tensor | None = None, pdl: bool | None = None,
           reduce_pieces: int | None = None):
    """Launch decode (+ reduce when the plan splits) into preallocated `out`/`lse`; no host sync, graph-safe, when
    max_rows is given.

    max_rows: packed rows per program, max q_len x config.head_group (the kernels' M tile); None: read from
        batch.q_lens (one host sync, so not inside a graph capture).
    pdl: launch the reduce as a programmatic dependent of decode (None: where `pdl_supported`; True elsewhere raises).
    reduce_pieces: split pieces the reduce merges per step (`reduce_blocks`; it sets the merge's summation order);
        None: `plan_reduce_pieces` for a WorkPlan, the step's own for a `TritonMLADecode` step's plan.

    Returns the compiled decode kernel (its n_regs / n_spills are reported by mla-bench).
    """
    L = batch.kv_lora_rank
    H = batch.num_heads
    device = batch.q.device
    if reduce_pieces is not None:
        planner._check_int(reduce_pieces, "reduce_pieces", 1)
    pair_merge = pair_merge_applies(plan, config, device, L)
    o_part, lse_part = workspace if workspace is not None else alloc_workspace(plan, H, L, device, pair_merge)
    q_scale = _scale_tensor(batch.q_scale if q_scale is None else q_scale, device)
    kv_scale = _scale_tensor(batch.kv_scale if kv_scale is None else kv_scale, device)
    if max_rows is None:  # rows per program (q_len x head_group)
        max_rows = _max_q_len(batch) * config.head_group
    qo_indptr = batch.qo_indptr if qo_indptr is None else qo_indptr
    if plan.head_group != config.head_group * config.head_split:
        raise ValueError(f"plan.head_group must be config.head_group x head_split = "
                         f"{config.head_group * config.head_split}, got {plan.head_group}")
    supported = pdl_supported(device)
    if pdl and not supported:
        raise ValueError(f"pdl=True needs CUDA sm_90+ outside the interpreter (griddepcontrol), got {device}")
    pdl = supported if pdl is None else pdl
    num_workers = plan.worker_indptr.numel() - 1
    if config.kernel == "gluon_fp8":
        from mla_fast import gluon_fp8

        gluon_fp8.check_stages(config.num_stages, config.workers_per_sm)
    if config.kernel != "triton":
        from mla_fast.gluon_decode import TILE

        if plan.block_n % TILE:
            raise ValueError(f"kernel={config.kernel!r} needs plan.block_n % {TILE} == 0 (items start on its "
                             f"{TILE}-token tiles), got {plan.block_n}")
    reason = gluon_unsupported(batch, config, max_rows)
    if reason:
        raise ValueError(reason)
    if config.kernel == "gluon":
        from mla_fast import gluon_decode

        compiled = gluon_decode.launch_decode(batch, plan, out, lse, o_part, lse_part, q_scale, kv_scale,
                                              config.head_group, config.head_split, qo_indptr, pdl)
    elif config.kernel == "gluon_fp8":
        from mla_fast import gluon_fp8

        compiled = gluon_fp8.launch_decode(batch, plan, out, lse, o_part, lse_part, q_scale, kv_scale,
                                           config.head_group, config.head_split, config.num_stages, qo_indptr,
                                           qk_fp8=config.qk_fp8)
    else:
        compiled = _launch_triton(batch, plan, out, lse, o_part, lse_part, q_scale, kv_scale, config, qo_indptr,
                                  max_rows, pdl, num_workers, pair_merge)
        if pair_merge:  # every split tile merged in the kernel
            return compiled
    step = isinstance(plan, _StaticPlan)  # a step's reduce spans its capacity of tiles, mostly idle programs
    final = plan.reduce_final if step else plan.split_final  # [tiles, 8]: a WorkPlan's split tiles only
    rows = reduce_rows(config, max_rows)
    if final.shape[0] > 0 and plan.num_partial_rows > 0:  # some tile is split
        if reduce_pieces is None:  # a step's shape is fixed with the step (its bits whatever the plan)
            reduce_pieces = plan.reduce_pieces if step else plan_reduce_pieces(plan, rows, L, num_sms(device))
        block_s, block_l = reduce_blocks(reduce_pieces, L)
        _mla_reduce_kernel[(final.shape[0], rows, L // block_l)](
            o_part, lse_part, final, out, lse,
            o_part.stride(0), o_part.stride(1), lse_part.stride(0),
            out.stride(0), out.stride(1), lse.stride(0),
            BLOCK_L=block_l, BLOCK_S=block_s, INTERPRET=INTERPRET, PDL=pdl,
            IDLE_EXIT=step,
            num_warps=REDUCE_WARPS,
            **({"launch_pdl": True} if pdl else {}),
        )
    return compiled


def decode(batch, *, plan=None, out=None, lse=None, config: KernelConfig | None = None, num_workers: int | None = None,
           reduce_pieces: int | None = None, max_q_len: int | None = None):
    """Triton MLA decode of a `DecodeBatch` -> (out [T, H, L], lse [T, H] fp32 natural log).

    plan: a `WorkPlan` from `make_plan` (computed here when None: one host sync). out / lse: optional preallocated
    outputs (`check_outputs`: out bf16 [T, H, L], or fp32 for the Triton kernel only, the Gluon kernels writing
    bf16; lse fp32 [T, H]; last dim contiguous), returned as given; by default out is bf16. config: launch choices (default
    `batch_config`: `default_config` for the batch's dtypes, heads, size and q_len on its device; on CUDA sm_90
    (H100, H200) bf16 batches with more than 16 packed rows per program take the Gluon seesaw kernel, and e4m3fn
    caches the Gluon kernels where default_config's rule says).
    reduce_pieces: split pieces merged per step of the reduce (None: `plan_reduce_pieces`; a `TritonMLADecode`'s
    reduce_pieces gives its bits).
    max_q_len: the q_len the launch's rows per program are sized for (max_q_len x config.head_group), at least the
    batch's largest (ValueError); None: the batch's largest. The default config is chosen for it too.

    Eager entry point: it validates every field of the batch, values included (`DecodeBatch.validate`, one host
    sync; a block-table entry outside the cache would otherwise fault the kernel), and a given plan against the
    batch's lengths and heads (`planner.check_plan`): ValueError naming the field. A batch of no requests gives
    empty out and lse. The graph-capturable path (`TritonMLADecode.run`, `launch`) checks nothing on the device.
    """
    batch.validate()
    check_batch(batch)
    T, H, L = batch.q.shape[0], batch.num_heads, batch.kv_lora_rank
    device = batch.q.device
    out = out if out is not None else torch.empty(T, H, L, dtype=torch.bfloat16, device=device)
    lse = lse if lse is not None else torch.empty(T, H, dtype=torch.float32, device=device)
    check_outputs(batch, out, lse)
    if batch.batch_size == 0:
        return out, lse
    if max_q_len is None:
        max_q_len = _max_q_len(batch)
    else:
        planner._check_int(max_q_len, "max_q_len", 1)
        if max_q_len < _max_q_len(batch):
            raise ValueError(f"max_q_len must be >= the batch's largest q_len {_max_q_len(batch)}, got {max_q_len}")
    config = config or batch_config(batch, max_q_len)
    if max_q_len * config.head_group > MAX_ROWS:
        raise ValueError(f"q_len x head_group must be <= {MAX_ROWS}, got {max_q_len} x {config.head_group}")
    if out.dtype != torch.bfloat16 and config.kernel != "triton":
        raise ValueError(f"out must be torch.bfloat16 for kernel {config.kernel!r} (it writes bf16), got {out.dtype}")
    if plan is None:
        plan = make_plan(batch, config, num_workers)
    else:
        planner.check_plan(plan, batch.seq_lens, batch.q_lens, H)
    launch(batch, plan, out, lse, config, max_rows=max_q_len * config.head_group, reduce_pieces=reduce_pieces)
    return out, lse


# ---- batch-invariant decoding ------------------------------------------------------------------------------------
INVARIANT_SPLIT_TOKENS = 1024  # decode_invariant's fixed split: pieces of this many tokens (planner.plan_decode)
INVARIANT_MAX_Q_LEN = 1  # decode_invariant's default rows per request the kernel geometry is fixed for


def invariant_config(batch, max_q_len: int = INVARIANT_MAX_Q_LEN) -> KernelConfig:
    """The launch choices of batch-invariant decoding: `default_config` for what a deployment fixes (the dtypes,
    heads and page size, the device's Gluon kernels for them, the q_len rows are sized for) and nothing a batch
    changes (its size; its cache tokens, which the Gluon fp8 kernel's rule counts: that kernel is taken only where
    the rule takes it whatever the tokens, at most two programs per worker), and no pair merge (the even plan's
    in-kernel merge of two-piece tiles, which only some batches take). q is taken as contiguous: whether a view is
    depends on its row count (a [1, H, D] view of a wider buffer is contiguous, [2, H, D] is not), which would give
    a request alone another kernel; `decode_invariant` copies a strided q, `invariant_step` refuses one. No host
    sync."""
    from mla_fast import gluon_decode, gluon_fp8

    planner._check_int(max_q_len, "max_q_len", 1)
    combo = dtype_combo(batch.q.dtype, batch.kv_cache.dtype)
    dense = batch if batch.q.is_contiguous() else batch.replace(  # a stand-in of q's shape, dense
        q=torch.empty_like(batch.q, memory_format=torch.contiguous_format))
    config = default_config(combo, batch.num_heads, max_q_len, None, seesaw=gluon_decode.supported(dense),
                            fp8_gluon=gluon_fp8.supported(dense), page_size=batch.page_size)
    return replace(config, pair_merge=False)


def decode_invariant(batch, *, max_q_len: int = INVARIANT_MAX_Q_LEN, split_tokens: int = INVARIANT_SPLIT_TOKENS,
                     out=None, lse=None, num_workers: int | None = None):
    """Batch-invariant `decode` -> (out [T, H, L], lse [T, H] fp32 natural log): the bits of a request's rows depend
    on its own q rows, tokens, scales and sm_scale only, not on the other requests, their order or their number
    (vLLM's batch-invariant serving). The default `decode` plans over the whole batch, so a request's split points,
    and with them the rounding of its merged output, move with its neighbours (within the kernel bound). Here:

    - the kernel geometry is `invariant_config(batch, max_q_len)` (ValueError for a batch with longer q_lens);
    - every request is cut at each multiple of ``split_tokens`` tokens and nowhere else (`planner.plan_decode`'s
      fixed splits; a request of at most split_tokens tokens runs whole on one worker and writes out directly);
    - the reduce merges STEP_REDUCE_PIECES pieces per step (its summation order), whatever the plan's largest tile.

    Which worker runs a piece changes with the batch; the arithmetic of a piece does not. Same rounding points as
    `decode` (`kernel_numerics(invariant_config(...))`). A strided q is copied first (`invariant_config`). The
    graph-capturable form: `invariant_step`."""
    if isinstance(batch.q, torch.Tensor) and not batch.q.is_contiguous():
        batch = batch.replace(q=batch.q.contiguous())
    config = invariant_config(batch, max_q_len)
    plan = make_plan(batch, config, num_workers, split_tokens=split_tokens) if batch.batch_size else None
    return decode(batch, plan=plan, out=out, lse=lse, config=config, reduce_pieces=STEP_REDUCE_PIECES,
                  max_q_len=max_q_len)


def invariant_step(batch, max_q_len: int = INVARIANT_MAX_Q_LEN, split_tokens: int = INVARIANT_SPLIT_TOKENS,
                   num_workers: int | None = None) -> "TritonMLADecode":
    """The graph-capturable form of `decode_invariant` (the same config, splits and reduce steps: its bits). Its q
    must be contiguous (ValueError: `invariant_config`)."""
    if not batch.q.is_contiguous():
        raise ValueError(f"invariant_step: q must be contiguous (the kernel chosen must not depend on how many rows a "
                         f"view of a wider buffer has), got strides {tuple(batch.q.stride())}")
    return TritonMLADecode(batch, max_q_len=max_q_len, num_workers=num_workers,
                           config=invariant_config(batch, max_q_len), reduce_pieces=STEP_REDUCE_PIECES,
                           split_tokens=split_tokens)


_STEP_TENSORS = ("q", "kv_cache", "block_table", "seq_lens")  # the batch tensors a TritonMLADecode's run() reads
# (q_lens reaches it through plan()'s host copy, into its own qo_indptr)


class TritonMLADecode:
    """CUDA-graph-capturable decode step: `plan(batch)` eagerly (a host sync, unless given host copies of the lengths),
    then `run()` only launches.

    A captured step must take any later plan, so it reads worker_indptr and always merges splits with the reduce
    kernel (no ONE_ITEM, no pair merge), whose grid spans the step's capacity of tiles: its programs without work
    (unsplit tiles) exit at once instead of waiting for the decode (`_mla_reduce_kernel`'s IDLE_EXIT). Graph replays
    on one H200 against mla-bench's launch of the same batch's own plan: docs/kernels.md, "The graph-capturable step".

    All buffers (plan, workspace, scales) are allocated once for the maximum sizes given here; `plan()` copies a new
    WorkPlan into them in place, so a graph captured around `run()` stays valid when seq_lens change.

    Args:
        batch: a DecodeBatch whose tensors (q, kv_cache, block_table, seq_lens, q_lens) are the static buffers the
            graph reads; refill them in place between replays, then call `plan(batch)` again.
        max_q_len: largest q_len any later step uses (plan() refuses larger ones: ValueError).
        config: launch choices, fixed for every step; default `batch_config` of the batch given here (its size and
            cache tokens then: the Gluon fp8 kernel's rule counts tokens, so build it with representative lengths
            or pass a config).
        max_items, max_partial_rows: capacities of the plan buffers (defaults sized for one item per (request, head
            group) per worker plus splits). The kernels read the plan's work items, worker ranges and reduce_final
            rows only, so only those are kept.
        split_tokens: the planner's fixed splits for every plan() (`planner.plan_decode`; `invariant_step`), None: its
            least busiest worker. The default capacities then hold every request cut at the block table's capacity.
        reduce_pieces: split pieces per tile that the reduce kernel's steps are sized for (`reduce_blocks`), fixed
            for the step so that eager runs and graph replays give the same bits whatever the plan (the step shape
            sets the merge's summation order). Tiles with more pieces are merged in more steps. Default
            `step_reduce_pieces(num_workers, tiles)`, from the batch size, not its lengths (on 132 workers with
            one tile per request: 64 for 1-4 requests, 32 for 5-7, 16 for 8-14, 8 from 15).
    """

    def __init__(self, batch, *, max_q_len: int = 1, num_workers: int | None = None, config: KernelConfig | None = None,
                 max_items: int | None = None, max_partial_rows: int | None = None,
                 reduce_pieces: int | None = None, split_tokens: int | None = None):
        batch.validate()
        check_batch(batch)
        if split_tokens is not None:
            planner._check_int(split_tokens, "split_tokens", 1)
        self.split_tokens = split_tokens
        if reduce_pieces is not None:
            planner._check_int(reduce_pieces, "reduce_pieces", 1)
        planner._check_int(max_q_len, "max_q_len", 1)
        if batch.batch_size and _max_q_len(batch) > max_q_len:
            raise ValueError(f"max_q_len must be >= the batch's largest q_len {_max_q_len(batch)}, got {max_q_len}")
        self.batch = batch
        self.max_q_len = max_q_len
        self._planned = False  # run() needs a plan in the static buffers
        device = batch.q.device
        H, L, B = batch.num_heads, batch.kv_lora_rank, batch.batch_size
        self.config = config or batch_config(batch, max_q_len)
        if split_tokens is not None and split_tokens % self.config.plan_block_n:
            raise ValueError(f"split_tokens must be a multiple of the config's plan_block_n "
                             f"({self.config.plan_block_n}: every plan() cuts on those blocks), got {split_tokens}")
        self.max_rows = max_q_len * self.config.head_group
        self.num_workers = num_workers or max(1, self.config.workers_per_sm * num_sms(device) // self.config.head_split)
        groups = B * triton.cdiv(H, self.config.head_group * self.config.head_split)
        if split_tokens is None:
            max_items = max_items or groups + 2 * self.num_workers
        else:  # every request as long as the block table holds, in pieces of split_tokens
            max_items = max_items or groups * max(1, -(-batch.block_table.shape[1] * batch.page_size // split_tokens))
        max_partial_rows = max_partial_rows or max_q_len * (max_items + self.num_workers)
        # the plan's buffers: views of one int32 buffer, filled by one copy from a host staging buffer of the same
        # layout (pinned, two of them used in turn, each reused once its last copy has completed); each view starts
        # 16-byte aligned (its part padded to 4 words), as separate allocations would, so the kernels are
        # specialised for aligned pointers
        self._sizes = (max_items * 8, self.num_workers + 1, groups * 8, B + 1)
        self._padded = tuple(-(-n // 4) * 4 for n in self._sizes)  # [words] per part
        self._meta = torch.zeros(sum(self._padded), dtype=torch.int32, device=device)
        self.work_items, self.worker_indptr, self.reduce_final, self.qo_indptr = self._views(self._meta)
        pinned = device.type == "cuda"
        self._staging = [torch.zeros(sum(self._padded), dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._turn = 0
        self.workspace = (torch.empty(max_partial_rows, H, L, dtype=torch.float32, device=device),
                          torch.empty(max_partial_rows, H, dtype=torch.float32, device=device))
        self.q_scale = _scale_tensor(batch.q_scale, device)
        self.kv_scale = _scale_tensor(batch.kv_scale, device)
        self.qo_indptr.copy_(batch.qo_indptr)  # [B+1]
        self.out = torch.empty(batch.q.shape[0], H, L, dtype=torch.bfloat16, device=device)
        self.lse = torch.empty(batch.q.shape[0], H, dtype=torch.float32, device=device)
        self.reduce_pieces = reduce_pieces or step_reduce_pieces(self.num_workers, groups)

    def _views(self, buf: torch.Tensor):
        """(work_items [max_items, 8], worker_indptr [W + 1], reduce_final [tiles, 8], qo_indptr [B + 1]) of a
        buffer laid out as the step's plan buffers (each part padded to whole 16-byte words)."""
        parts = [part[:n] for part, n in zip(torch.split(buf, self._padded), self._sizes)]
        return parts[0].view(-1, 8), parts[1], parts[2].view(-1, 8), parts[3]

    def plan(self, batch=None, *, seq_lens=None, q_lens=None) -> None:
        """Plan on the current lengths and copy the plan into the static buffers (eager; never inside a capture).

        seq_lens, q_lens: host copies (CPU int tensors [B]) of the lengths that the kernels will read from the
        batch. Given, plan() reads nothing from the device and does not wait for queued work: the plan goes to the
        static buffers by one asynchronous copy, ordered on the current stream before the next run(). None: they
        are read from the batch (a host sync, which waits for the work queued before), after `DecodeBatch.validate`
        has checked every field. With host copies only the lengths are checked (against the block table's capacity
        and q's rows), not the block table's entries: those would have to be read from the device; the scales are
        checked either way (`DecodeBatch.validate_scales`). ``batch`` may be another DecodeBatch over the step's
        tensors, with new per-tensor q / kv scales; its sm_scale and kv_lora_rank must be the step's (ValueError).
        """
        batch = batch or self.batch
        if batch is not self.batch and any(
                getattr(batch, n).data_ptr() != getattr(self.batch, n).data_ptr()
                or getattr(batch, n).shape != getattr(self.batch, n).shape for n in _STEP_TENSORS):
            raise ValueError(f"plan: batch must hold the step's own tensors ({', '.join(_STEP_TENSORS)}: the buffers "
                             "run() reads); refill them in place instead of passing another batch")
        for name in ("sm_scale", "kv_lora_rank"):  # launch constants of the step: a new value would go unread
            if getattr(batch, name) != getattr(self.batch, name):
                raise ValueError(f"plan: batch.{name} must be the step's {getattr(self.batch, name)!r} (fixed when "
                                 f"it was built), got {getattr(batch, name)!r}; build another step for it")
        if (seq_lens is None) != (q_lens is None):
            raise ValueError("plan: give both seq_lens and q_lens (host copies), or neither")
        if seq_lens is None:
            batch.validate()  # every field: the lengths against the block table's capacity and q's rows too
            seq_lens, q_lens = torch.stack([batch.seq_lens, batch.q_lens]).cpu()  # [2, B]: one sync
        else:  # host copies: what validate would check of them and of the scales, without reading the device
            batch.validate_scales()  # the q / kv scales go to the step's buffers below
            for name, x in (("seq_lens", seq_lens), ("q_lens", q_lens)):
                if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or tuple(x.shape) != (batch.batch_size,):
                    got = (f"a {x.device} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
                           else type(x).__name__)
                    raise ValueError(f"plan: {name} must be a CPU tensor of shape ({batch.batch_size},) (the host "
                                     f"copy of batch.{name}), got {got}")
            capacity = batch.block_table.shape[1] * batch.page_size
            if seq_lens.numel() and int(seq_lens.max()) > capacity:
                raise ValueError(f"plan: seq_lens must be <= the block table's capacity {capacity} (max_pages x "
                                 f"page_size), got {seq_lens.tolist()}")
            if int(q_lens.sum()) != batch.q.shape[0]:
                raise ValueError(f"plan: q_lens must add up to q's rows {batch.q.shape[0]}, got {q_lens.tolist()}")
        if q_lens.numel() and int(q_lens.max()) > self.max_q_len:
            raise ValueError(f"plan: q_lens must be <= this step's max_q_len {self.max_q_len}, got {q_lens.tolist()}")
        p = make_plan(batch, self.config, self.num_workers, seq_lens=seq_lens, q_lens=q_lens,
                      split_tokens=self.split_tokens)  # on the CPU
        n, t = p.work_items.shape[0], p.reduce_final.shape[0]
        if n > self.work_items.shape[0] or t > self.reduce_final.shape[0]:
            raise ValueError(f"plan needs {n} items / {t} tiles, above this step's capacities")
        if p.num_partial_rows > self.workspace[0].shape[0]:
            raise ValueError(f"plan needs {p.num_partial_rows} partial rows, capacity {self.workspace[0].shape[0]}")
        staging, copied = self._staging[self._turn], self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # this staging buffer's last copy has completed: it may be refilled
        work_items, worker_indptr, reduce_final, qo_indptr = self._views(staging)
        work_items[:n] = p.work_items
        work_items[n:] = 0
        worker_indptr.copy_(p.worker_indptr)
        reduce_final[:t] = p.reduce_final
        reduce_final[t:] = 0  # padded tiles: empty split ranges
        qo_indptr[0] = 0
        qo_indptr[1:] = torch.cumsum(p.q_lens, 0)
        self._meta.copy_(staging, non_blocking=copied is not None)
        if copied is not None:
            copied.record()
        self._turn ^= 1
        if batch.q_scale is not None:
            self.q_scale.copy_(_scale_tensor(batch.q_scale, self.q_scale.device))
        if batch.kv_scale is not None:
            self.kv_scale.copy_(_scale_tensor(batch.kv_scale, self.kv_scale.device))
        self._planned = True

    @property
    def numerics(self) -> KernelNumerics:
        """The rounding points of the kernel this step launches (its config, fixed at construction, whatever later
        lengths would make `batch_config` choose): what verify's step check bounds it with."""
        return kernel_numerics(self.config, dtype_combo(self.batch.q.dtype, self.batch.kv_cache.dtype),
                               self.batch.head_dim)

    def run(self):
        """Launch decode + reduce on the static buffers -> (out, lse) (the same tensors every call). RuntimeError
        before the first plan()."""
        if not self._planned:
            raise RuntimeError("TritonMLADecode.run() before plan(): the static plan buffers hold no plan yet")
        launch(self.batch, _StaticPlan(self), self.out, self.lse, self.config, workspace=self.workspace,
               q_scale=self.q_scale, kv_scale=self.kv_scale, max_rows=self.max_rows, qo_indptr=self.qo_indptr)
        return self.out, self.lse


@dataclass
class _StaticPlan:
    """The plan-shaped view of TritonMLADecode's static buffers (padded tiles have empty split ranges)."""

    work_items: torch.Tensor
    worker_indptr: torch.Tensor
    reduce_final: torch.Tensor
    num_partial_rows: int
    block_n: int
    head_group: int
    one_item_per_worker: bool
    paired_splits: bool
    reduce_pieces: int

    def __init__(self, step: "TritonMLADecode"):
        self.work_items, self.worker_indptr, self.reduce_final = step.work_items, step.worker_indptr, step.reduce_final
        self.num_partial_rows = step.workspace[0].shape[0]  # capacity: the step always launches the reduce
        self.block_n = step.config.plan_block_n
        self.head_group = step.config.head_group * step.config.head_split
        self.one_item_per_worker = False  # a captured graph must take any later plan: read worker_indptr
        self.paired_splits = False  # and merge any later plan's splits with the reduce kernel
        self.reduce_pieces = step.reduce_pieces  # in steps of the step's fixed shape


__all__ = ["decode", "make_plan", "launch", "KernelConfig", "default_config", "TritonMLADecode", "INTERPRET"]
