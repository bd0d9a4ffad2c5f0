"""Time the two Gluon kernels that take e4m3fn caches at more than 16 packed rows per worker against each other: the
Gluon fp8 kernel (16 rows per program, head_split programs per worker) and the seesaw kernel on fp16 operands (64
rows), each forced whatever the batch size, beside the default config (`batch_config`) and our bf16 default, CUDA-graph
replays as in `mla-bench`. This is the measurement behind `default_config`'s boundary between the two
(programs per worker x the batch's cache tokens <= GLUON_FP8_MAX_PROGRAM_TOKENS, or _FP8_Q for e4m3fn q;
docs/perf_history.md, eleventh and twenty-third sessions).

    python benchmarks/boundary_bench.py --json boundary.json
    python benchmarks/boundary_bench.py --page-size 16 --combo fp8 --json boundary16.json

Prints one line per shape with µs per kernel and the largest |out| difference of each forced kernel to the default
(each is checked against the fp64 oracle within its bound by tests/test_triton_gpu.py). The eleventh session's run
of SHAPES is benchmarks/boundary_h200.csv, the twenty-third session's with --combo fp8 (the Gluon fp8 kernel's fp8
score MMAs; default_config's fp8-q threshold) benchmarks/boundary_h200_fp8.csv, both on pages of 64; the thirtieth
session's with --page-size 16 benchmarks/boundary_h200_p16.csv and boundary_h200_fp8_p16.csv; the thirty-first
session's fp8kv run on pages of 64 (the fp8 seesaw's staging grouped there) benchmarks/boundary_h200_p64.csv, and
the thirty-second session's fp8 q run with those kernels benchmarks/boundary_h200_fp8_p64.csv;
tests/test_triton_decode.py checks default_config's rule against all six.
"""

import argparse
import json

import torch

from mla_fast import triton_decode as td
from mla_fast.bench import build_batch, bytes_moved, copy_bandwidth_gbs, forced_fp8_kernels, measure, ours, parse_shapes

SHAPES = [  # (b, s_k, heads, q_len): both sides of the rule at 128, 64, 32 (q_len 2) and 16 heads (q_len 3-4)
    (1, 8192, 128, 1), (2, 8192, 128, 1), (4, 4096, 128, 1), (4, 8192, 128, 1), (8, 4096, 128, 1), (8, 8192, 128, 1),
    (16, 4096, 128, 1), (1, 8192, 64, 1), (2, 8192, 64, 1), (4, 8192, 64, 1), (8, 4096, 64, 1), (8, 8192, 64, 1),
    (16, 4096, 64, 1), (16, 8192, 64, 1), (32, 4096, 64, 1), (4, 8192, 16, 3), (8, 8192, 16, 3), (4, 8192, 16, 4),
    (8, 8192, 16, 4), (16, 4096, 16, 4), (8, 8192, 32, 2), (16, 4096, 32, 2), (32, 4096, 32, 2), (64, 4096, 32, 2),
    # eleventh session: where the batch-size rule and the token rule disagree, and (4, 8192, 32, 2) for 32 heads
    (2, 16384, 128, 1), (1, 32768, 128, 1), (16, 1024, 128, 1), (32, 512, 128, 1), (8, 2048, 128, 1),
    (4, 16384, 64, 1), (32, 1024, 64, 1), (1, 16384, 128, 1), (16, 2048, 16, 4), (4, 8192, 32, 2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--combo", default="fp8kv", choices=["fp8kv", "fp8"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--page-size", type=int, default=64, help="cache page size in tokens (default 64)")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help='"b,s,h,q_len;..." (default: SHAPES)')
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for b, s, h, q_len in args.shapes:
        batch = build_batch(b, s, h, args.combo, page_size=args.page_size, q_len=q_len)
        default = td.batch_config(batch, q_len)
        line, outs = f"({b}, {s}, {h}) q_len {q_len} page {args.page_size}:", {}
        for name, config in {"default": default, **forced_fp8_kernels(args.combo, h, q_len)}.items():
            fn, info = ours(batch, config)
            m = measure(fn, bytes_moved(b, s, h, args.combo), copy_gbs)
            outs[name] = fn.outputs[0].float().clone()
            rows.append({"b": b, "s": s, "h": h, "q_len": q_len, "page_size": args.page_size, "combo": args.combo,
                         "config": name,
                         "kernel": config.kernel, "head_group": config.head_group, "head_split": config.head_split,
                         **m, **info})
            line += f" {name} ({config.kernel}) {m.get('us', float('nan')):.1f}"
        fn, _ = ours(build_batch(b, s, h, "bf16", page_size=args.page_size, q_len=q_len))
        m = measure(fn, bytes_moved(b, s, h, "bf16"), copy_gbs)
        rows.append({"b": b, "s": s, "h": h, "q_len": q_len, "page_size": args.page_size, "combo": "bf16",
                     "config": "default", **m})
        diffs = {k: float((o - outs["default"]).abs().max()) for k, o in outs.items() if k != "default"}
        print(f"{line} | bf16 {m.get('us', float('nan')):.1f} | max |out - out default|: {diffs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
