"""GPU time per kernel of one decode call (ours and mla-bench's peers) on mla-bench shapes, from torch.profiler.

    python benchmarks/kernel_breakdown.py --shapes "32,4096,16;64,4096,16" --dtype bf16 --json out.json

Each callable runs `--calls` times with an L2 flush (a 256 MB write) before each call, as in mla-bench; the table
lists the median device time of every kernel it launches (µs), so a split call's decode and merge/reduce kernels
are seen apart. Kernel time only: the launch gaps between a call's kernels are not in it (mla-bench times those).
"""

import argparse
import json
import statistics
from collections import defaultdict

import torch

from mla_fast.bench import PEERS, build_batch, ours, parse_shapes


def kernel_times(fn, calls: int) -> dict[str, float]:
    """{kernel name: median µs per call} of fn() over `calls` profiled calls, each after an L2 flush."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    per_kernel = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "FillFunctor" not in e.name:  # not the flush
            per_kernel[e.name[:60]].append(e.time_range.elapsed_us())
    return {name: statistics.median(ts) for name, ts in per_kernel.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=[(32, 4096, 16), (64, 4096, 16)])
    parser.add_argument("--dtype", default="bf16", help="bf16, fp8kv or fp8")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for b, s, h in args.shapes:
        batch = build_batch(b, s, h, args.dtype)
        fns = {"ours": ours(batch)[0]}
        for name, make in PEERS.items():
            fn = make(batch)
            if not isinstance(fn, str):
                fns[name] = fn
        for name, fn in fns.items():
            times = kernel_times(fn, args.calls)
            rows.append({"b": b, "s": s, "h": h, "dtype": args.dtype, "backend": name, "kernels_us": times,
                         "sum_us": sum(times.values())})
            print(f"({b}, {s}, {h}) {args.dtype} {name}: sum {sum(times.values()):.1f} us  "
                  + "  ".join(f"{k}: {v:.1f}" for k, v in times.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
