"""The read floor: a kernel that reads N bytes once and does nothing else, timed the way `mla-bench` times a decode.

Any decode must read its whole KV cache, so the time of a plain streaming read of the cache's bytes, in the same
harness (CUDA-graph replay, `triton.testing.do_bench` with its 256 MB zeroing L2 flush before every call, events
around the call), is a lower bound on what a decode of that shape can take there. It counts what the device copy rate
leaves out: the replay's fixed cost (one tiny kernel: ~4.5 µs on an H200) and the write-back of the dirty lines
that the zeroing flush leaves in the L2.

`_stream_read`: a persistent grid of `PROGRAMS_PER_SM` programs per SM; program p sums the int32 words of blocks
p, p + P, p + 2P, ... (P programs, `BLOCK` words = 16 KB per block, loads pipelined `STAGES` deep) into one int32
(wrapping), stored to `out[p]`, so that the loads cannot be optimised away. Of 8 configurations (1, 2, 4, 8
programs per SM; 8 KB or 16 KB loads; a scratch variant summing bf16 in fp32) timed on one H200 at the cache sizes
of mla-bench's h = 16 grid, 2 programs per SM with 16 KB loads was the fastest or within 0.1 µs of it at each size
(46.7 µs for 151 MB, 79.7 for 302 MB, 143.9 for 604 MB, 272.5 for 1208 MB); one program per SM with 8 KB loads
(too few bytes in flight) took 16-19 % longer. This kernel, in mla-bench on the same day: 46.9, 80.3, 146.0,
277.2 µs (copy 4269 GB/s).
"""

import torch
import triton
import triton.language as tl

from mla_fast.triton_decode import num_sms

PROGRAMS_PER_SM = 2
BLOCK = 4096  # int32 words per load: 16 KB
STAGES = 4
WARPS = 8


@triton.jit
def _stream_read(X, OUT, n_words, ITERS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.range(0, ITERS, num_stages=STAGES):  # a constexpr count: the interpreter takes no runtime bound
        offs = (i * programs + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # block i * P + pid; int64: > 8 GB
        acc += tl.load(X + offs, mask=offs < n_words, other=0)
    tl.store(OUT + pid, tl.sum(acc, axis=0))


def stream_read(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch `_stream_read` over the int32 words of `x` (contiguous, any shape) with `out.numel()` programs; returns
    `out` ([programs] int32, the wrapping sum of each program's words)."""
    if x.dtype != torch.int32 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous int32 tensor, got {x.dtype}, contiguous={x.is_contiguous()}")
    if out.dtype != torch.int32 or out.dim() != 1 or out.numel() < 1:
        raise ValueError(f"out must be a 1-d int32 tensor with >= 1 element, got {out.dtype} {tuple(out.shape)}")
    n_words, programs = x.numel(), out.numel()
    iters = triton.cdiv(n_words, programs * BLOCK)
    _stream_read[(programs,)](x, out, n_words, ITERS=iters, BLOCK=BLOCK, STAGES=STAGES, num_warps=WARPS)
    return out


def read_floor_fn(nbytes: int, device: torch.device | str = "cuda"):
    """() -> None reading `nbytes` (rounded up to whole int32 words) of a buffer of its own, on a grid of
    PROGRAMS_PER_SM programs per SM (`num_sms`: the decode's persistent grid; its CPU count for the interpreter)."""
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    device = torch.device(device)
    x = torch.zeros(triton.cdiv(nbytes, 4), dtype=torch.int32, device=device)  # [words]
    out = torch.empty(PROGRAMS_PER_SM * num_sms(device), dtype=torch.int32, device=device)  # [programs]

    def fn():
        stream_read(x, out)

    fn.buffers = (x, out)
    return fn
