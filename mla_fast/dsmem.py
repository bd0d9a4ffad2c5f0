"""
Pair merge: two split pieces of a tile merged inside the decode kernel, through a 2-CTA cluster (NVIDIA sm_90+)
=============================================================================================================

When a plan splits every tile into exactly two pieces and runs tile t's pieces on workers 2t and 2t + 1
(`WorkPlan.paired_splits` with `one_item_per_worker`, as the even plan does at (64, 4096, 16) on 132 SMs), the
Triton decode kernel can merge each pair itself instead of writing fp32 partials for `_mla_reduce_kernel`. The two
programs of a pair run as one thread-block cluster of 2 CTAs, so each can write into the other's shared memory
(distributed shared memory). After its last KV tile, each program (rank r = worker % 2), once all its warps have
read that tile (a CTA barrier: the steps below write over the pipeline's buffers with PTX that Triton's barrier
analysis does not see):

1. initialises an mbarrier in its own shared memory, expecting the partner's bytes;
2. stages, in its own shared memory, the normalised fp32 output columns that the partner merges (half of the L
   latent channels, [M, L / 2], rows padded by ROW_PAD floats and written two adjacent columns per 8-byte store,
   so that a warp's stores do not pile onto 4 banks) and its LSE [M];
3. waits at a cluster barrier (both loops are over, so both pipeline buffers are free, and both mbarriers exist);
4. copies the staged bytes into the partner's shared memory with one bulk copy (`cp.async.bulk`, completing on the
   partner's mbarrier), and waits until its own mbarrier has received the partner's copy;
5. invalidates its mbarrier once all its threads have seen it complete, then merges its half of the channels
   exactly as the reduce kernel merges two pieces (fp32, base 2, piece 0 = rank 0 first) and writes them to `out`;
   rank 0 also writes the LSE.

Same bits as decode + reduce (GPU tests), without the reduce kernel's launch and its round trip through the L2:
on one H200 at (64, 4096, 16), bf16, graph replays, 87.39-87.65 vs 89.50-89.66 us (docs/kernels.md, "The pair
merge"; the padded 8-byte staging took 0.7-0.9 us off the unpadded scalar one, 88.24-88.45 in the same call).

Triton 3.6 has no cluster launch for a kernel compiled with num_ctas = 1 (num_ctas = 2 turns on its multi-CTA
layouts, and this kernel does not compile that way). Its CUDA launcher does launch clusters: it reads
(num_warps, num_ctas, shared memory) from the compiled kernel's `packed_metadata` and, for num_ctas > 1, launches
grid[0] x num_ctas CTAs in clusters of num_ctas. `launch_in_pairs` compiles the kernel (warm-up), sets num_ctas to 2
there, and launches that compiled kernel on half the grid: the code is the num_ctas = 1 code, with `%ctaid.x` still
numbering all CTAs.

The helpers below are inline PTX on scalars or elementwise on tiles (`tl.inline_asm_elementwise`, impure so they keep
their order). They address shared memory as byte offsets from Triton's `global_smem` symbol, which is free once the
KV loop has drained its copies; each returns a dummy 0 that callers add into the next address to keep the order.
Under TRITON_INTERPRET=1 and on ROCm the kernel never takes this path (`supported`).
"""

import torch
import triton
import triton.language as tl

CLUSTER_CTAS = 2  # CTAs per cluster: the two pieces of a tile
# fp32 of padding after each staged row [L / 2]: a warp's 8-byte accesses to its accumulator fragment (rows r..r+7,
# column pairs 2c, c < 4, of an 8-column MMA tile) then fill all 32 banks with rows r..r+3 and again with r+4..r+7,
# two wavefronts per 256 bytes; unpadded rows (a multiple of 32 banks apart) put those 8 rows on the same 4 banks
ROW_PAD = tl.constexpr(8)


def supported(device: torch.device, interpret: bool) -> bool:
    """Clusters, distributed shared memory and bulk copies: CUDA sm_90+ outside the interpreter, with Triton 3.6's
    launcher (whose launch metadata `launch_in_pairs` sets)."""
    return (not interpret and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9 and triton.__version__.startswith("3.6"))


def stage_bytes(block_m: int, kv_lora_rank: int) -> int:
    """Shared memory the pair merge uses from offset 0: the partner's half [M, L / 2 + ROW_PAD] fp32 + its LSE [M]
    (received), the mbarrier (padded to 64 bytes), and this program's half + LSE (staged)."""
    recv = block_m * (kv_lora_rank // 2 + ROW_PAD.value) * 4 + block_m * 4
    return 2 * recv + 64


def launch_in_pairs(kernel, grid_ctas: int, args, kwargs):
    """Launch `kernel` (a Triton JITFunction) on grid_ctas CTAs in clusters of 2; returns the compiled kernel.

    One dispatch: `warmup` specializes the arguments and compiles (or finds the cached kernel), and the compiled kernel
    is launched directly with every parameter in signature order (`call_args`), as Triton's own launch passes them.
    The cluster size stays set on the cached compiled kernel, so a specialization launched here (the decode kernel's
    PAIR_MERGE=True) must never be launched through the JITFunction: Triton's launcher would then run grid x 2 CTAs.
    Raises ValueError when grid_ctas is odd, RuntimeError when the compiled kernel's launch metadata is not Triton
    3.6's (num_warps, num_ctas, shared) or the kernel was compiled for more than one CTA."""
    if grid_ctas % CLUSTER_CTAS:
        raise ValueError(f"a paired launch needs an even number of programs, got {grid_ctas}")
    grid = (grid_ctas // CLUSTER_CTAS,)
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    meta, md = compiled.packed_metadata, compiled.metadata
    if md.num_ctas != 1 or tuple(meta) not in ((md.num_warps, 1, md.shared), (md.num_warps, CLUSTER_CTAS, md.shared)):
        raise RuntimeError(f"a paired launch needs Triton 3.6's launch metadata (num_warps, num_ctas = 1, shared), "
                           f"got {meta!r} for num_ctas {md.num_ctas}")
    need = stage_bytes(kwargs["BLOCK_M"], kwargs["L"])
    if md.shared < need:
        raise RuntimeError(f"the pair merge needs {need} bytes of shared memory, the kernel has {md.shared}")
    compiled.packed_metadata = (md.num_warps, CLUSTER_CTAS, md.shared)  # the launcher's cluster size
    compiled[(grid[0], 1, 1)](*call_args(kernel.arg_names, args, kwargs))
    return compiled


def call_args(arg_names, args, kwargs) -> list:
    """Every kernel parameter's value in signature order: the positional `args`, then each later parameter from
    `kwargs` (constexprs included; the launcher skips them). Launch options in kwargs (num_warps, ...) are not
    parameters and are left out. Raises ValueError naming a parameter given neither way."""
    missing = [name for name in arg_names[len(args):] if name not in kwargs]
    if len(args) > len(arg_names) or missing:
        raise ValueError(f"a paired launch needs every one of the {len(arg_names)} kernel parameters, got "
                         f"{len(args)} positional and none for {missing}")
    return [*args, *(kwargs[name] for name in arg_names[len(args):])]


@triton.jit
def cluster_barrier(dep):
    """All threads of both CTAs: arrive (release) and wait (acquire) at the cluster barrier."""
    return tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
        "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mbarrier_init(offset, tx_bytes):
    """Thread 0: an mbarrier at byte `offset` of this CTA's shared memory, its one arrival made now with tx_bytes
    expected; the init fenced for the cluster (the cluster barrier that follows publishes it)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a, t; .reg .b64 st; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "mov.u32 a, global_smem; add.u32 a, a, $1; "
        "@p mbarrier.init.shared::cta.b64 [a], 1; "
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 st, [a], $2; "
        "fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }",
        "=r,r,r", [offset, tx_bytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_shared(offset, value):
    """Each element of fp32 `value` to byte `offset` (same shape) of this CTA's shared memory."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; st.shared.f32 [a], $2; mov.u32 $0, 0; }",
        "=r,r,f", [offset, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_shared_v2(offset, value):
    """Each two adjacent fp32 elements of `value` (a column pair of the MMA accumulator layout) to byte `offset` of
    the first (8-byte aligned) of this CTA's shared memory, one 8-byte store per pair. pack=2 hands each call two
    consecutive elements of a thread, which in Triton 3.6's MMA (v2) accumulator layout are adjacent columns, so the
    second address is the first + 4; the pair-merge GPU tests check the bits against the reduce kernel for every
    geometry the pair merge takes (16 and 32 rows, bf16 and fp8 caches)."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $2; st.shared.v2.f32 [a], {$4, $5}; "
        "mov.u32 $0, 0; mov.u32 $1, 0; }",
        "=r,=r,r,r,f,f", [offset, value], dtype=tl.int32, is_pure=False, pack=2)


@triton.jit
def load_shared_v2(offset):
    """fp32 elements at byte `offset` of this CTA's shared memory, two adjacent ones per 8-byte load (the layout
    that `store_shared_v2` writes)."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $2; ld.shared.v2.f32 {$0, $1}, [a]; }",
        "=f,=f,r,r", [offset], dtype=tl.float32, is_pure=False, pack=2)


@triton.jit
def load_shared(offset):
    """fp32 elements at byte `offset` of this CTA's shared memory."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; ld.shared.f32 $0, [a]; }",
        "=f,r", [offset], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def fence_proxy_async(dep):
    """Make this thread's shared-memory stores visible to the bulk-copy (async) proxy."""
    return tl.inline_asm_elementwise("fence.proxy.async.shared::cta;\n\tmov.u32 $0, 0;", "=r,r", [dep],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_copy_to_rank(src, dst, mbarrier, nbytes, rank):
    """Thread 0: copy nbytes (a multiple of 16, 16-byte aligned offsets) from byte `src` of this CTA's shared memory
    to byte `dst` of cluster CTA `rank`'s, completing on that CTA's mbarrier at byte `mbarrier`; returns once the
    source has been read (so this CTA may reuse or release it)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t, b, s, d, m; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "mov.u32 b, global_smem; add.u32 s, b, $1; add.u32 d, b, $2; add.u32 m, b, $3; "
        "mapa.shared::cluster.u32 d, d, $5; mapa.shared::cluster.u32 m, m, $5; "
        "@p cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [d], [s], $4, [m]; "
        "@p cp.async.bulk.commit_group; @p cp.async.bulk.wait_group.read 0; mov.u32 $0, 0; }",
        "=r,r,r,r,r,r", [src, dst, mbarrier, nbytes, rank], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mbarrier_inval(offset):
    """Thread 0: invalidate the mbarrier at byte `offset` (PTX requires it before the memory is used otherwise); call
    it once every thread has passed its wait, and put a CTA barrier between it and any reuse of that memory."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a, t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 a, global_smem; "
        "add.u32 a, a, $1; @p mbarrier.inval.shared::cta.b64 [a]; mov.u32 $0, 0; }",
        "=r,r", [offset], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mbarrier_wait(offset):
    """All threads: wait until the mbarrier at byte `offset` of this CTA's shared memory completes phase 0."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; "
        "WAIT${:uid}: mbarrier.try_wait.parity.shared::cta.b64 p, [a], 0; @!p bra WAIT${:uid}; mov.u32 $0, 0; }",
        "=r,r", [offset], dtype=tl.int32, is_pure=False, pack=1)
