"""Time the two Gluon kernels that take e4m3fn caches at more than 16 packed rows per worker against each other: the
Gluon fp8 kernel (16 rows per program, head_split programs per worker) and the seesaw kernel on fp16 operands (64
rows), each forced whatever the batch size, beside the default config (`batch_config`) and our bf16 default, CUDA-graph
replays as in `mla-bench`. This is the measurement behind `default_config`'s boundary between the two
(programs per worker x the batch's cache tokens <= `triton_decode.gluon_fp8_max_program_tokens`:
GLUON_FP8_MAX_PROGRAM_TOKENS, or _FP8_Q for e4m3fn q, both GLUON_FP8_PAGE_16_LESS_TOKENS lower on pages of 16;
docs/perf_history.md, eleventh, twenty-third and thirty-seventh sessions).

    python benchmarks/boundary_bench.py --json boundary.json --csv boundary.csv
    python benchmarks/boundary_bench.py --page-size 16 --combo fp8 --json boundary16.json

Prints one line per shape with µs per kernel and the largest |out| difference of each forced kernel to the default
(each is checked against the fp64 oracle within its bound by tests/test_triton_gpu.py). The thirty-seventh session's
runs of SHAPES on pages of 16, 32 and 64, fp8kv and fp8 q, are benchmarks/boundary_h200_{fp8kv,fp8}_p{16,32,64}.csv
and of MTP_SHAPES (--shapes mtp) on pages of 16 and 64 boundary_h200_{fp8kv,fp8}_p{16,64}_mtp.csv (the kernels of
the thirty-sixth session: the fp8 seesaw's loader partition); tests/test_triton_decode.py checks default_config's
rule against all ten. The tables of earlier sessions, measured before that loader, are in git
(docs/perf_history.md names them).
"""

import argparse
import csv
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
    # thirty-seventh session: programs x tokens = 16 x 4096 at every head count and q_len, 24 x 4096 at 16 and 64
    # heads, and 8 and 48 x 4096
    (2, 8192, 16, 4), (1, 8192, 16, 4), (2, 8192, 16, 3), (3, 8192, 16, 4), (2, 8192, 32, 2), (1, 16384, 32, 2),
    (2, 4096, 128, 1), (3, 8192, 128, 1), (4, 4096, 64, 1), (1, 16384, 64, 1), (6, 4096, 64, 1),
]
MTP_SHAPES = [  # thirty-seventh session: MTP at 32-128 heads (8-32 Gluon fp8 programs per worker), 16-32 x 4096
    (1, 4096, 128, 2), (1, 6144, 128, 2), (1, 8192, 128, 2), (2, 4096, 64, 2), (3, 4096, 64, 2), (4, 4096, 64, 2),
    (1, 4096, 64, 4), (2, 4096, 32, 4), (4, 4096, 32, 3), (1, 2048, 128, 4), (1, 3072, 128, 4), (1, 4096, 128, 4),
]
TABLE_COLUMNS = ["b", "s_k", "heads", "q_len", "gluon_fp8_us", "seesaw_us", "bf16_us"]


def write_table(path: str, rows: list[dict], comment: str) -> None:
    """The rows of one call as a table (TABLE_COLUMNS, one line per shape in the order measured, us to 0.1) under
    `comment`'s lines prefixed with "# ": the form of benchmarks/boundary_h200_*.csv. A kernel not timed (its
    measurement failed, or the shape has too few rows for it) leaves its cell empty."""
    shapes = {}
    for r in rows:
        column = "bf16_us" if r["combo"] == "bf16" else {"gluon_fp8": "gluon_fp8_us", "seesaw": "seesaw_us"}.get(
            r["config"])
        cells = shapes.setdefault((r["b"], r["s"], r["h"], r["q_len"]), {})
        if column and r.get("us") is not None:
            cells[column] = round(r["us"], 1)
    with open(path, "w", newline="") as f:
        f.writelines(f"# {line}\n" for line in comment.splitlines())
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(TABLE_COLUMNS)
        for (b, s, h, q_len), us in shapes.items():
            writer.writerow([b, s, h, q_len, *(us.get(column, "") for column in TABLE_COLUMNS[4:])])


def shapes_arg(text: str) -> list[tuple]:
    """--shapes: "mtp" for MTP_SHAPES, else "b,s,h,q_len;..." (`mla_fast.bench.parse_shapes`)."""
    return MTP_SHAPES if text == "mtp" else parse_shapes(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--combo", default="fp8kv", choices=["fp8kv", "fp8"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--csv", default=None, help="also write the table of benchmarks/boundary_h200_*.csv here")
    parser.add_argument("--page-size", type=int, default=64, help="cache page size in tokens (default 64)")
    parser.add_argument("--shapes", type=shapes_arg, default=SHAPES,
                        help='"b,s,h,q_len;..." or "mtp" (MTP_SHAPES; default: SHAPES)')
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for b, s, h, q_len in args.shapes:
        batch = build_batch(b, s, h, args.combo, page_size=args.page_size, q_len=q_len)
        default = td.batch_config(batch, q_len)
        line, outs = f"({b}, {s}, {h}) q_len {q_len} page {args.page_size}:", {}
        for name, config in {"default": default, **forced_fp8_kernels(args.combo, h, q_len)}.items():
            fn, info = ours(batch, config)
            m = measure(fn, bytes_moved(b, s, h, args.combo, q_len), copy_gbs)
            outs[name] = fn.outputs[0].float().clone()
            rows.append({"b": b, "s": s, "h": h, "q_len": q_len, "page_size": args.page_size, "combo": args.combo,
                         "config": name,
                         "kernel": config.kernel, "head_group": config.head_group, "head_split": config.head_split,
                         **m, **info})
            line += f" {name} ({config.kernel}) {m.get('us', float('nan')):.1f}"
        fn, _ = ours(build_batch(b, s, h, "bf16", page_size=args.page_size, q_len=q_len))
        m = measure(fn, bytes_moved(b, s, h, "bf16", q_len), copy_gbs)
        rows.append({"b": b, "s": s, "h": h, "q_len": q_len, "page_size": args.page_size, "combo": "bf16",
                     "config": "default", **m})
        diffs = {k: float((o - outs["default"]).abs().max()) for k, o in outs.items() if k != "default"}
        print(f"{line} | bf16 {m.get('us', float('nan')):.1f} | max |out - out default|: {diffs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows}, f, indent=1)
    if args.csv:
        shapes = "" if args.shapes == SHAPES else " --shapes " + (
            "mtp" if args.shapes == MTP_SHAPES else ";".join(",".join(map(str, shape)) for shape in args.shapes))
        write_table(args.csv, rows, f"benchmarks/boundary_bench.py --page-size {args.page_size} --combo {args.combo}"
                    f"{shapes} on one {torch.cuda.get_device_name()} (copy {copy_gbs:.0f} GB/s)")


if __name__ == "__main__":
    main()
