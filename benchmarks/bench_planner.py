"""Time mla_fast.plan_decode (batch 1, 64, 1024) and run_plan_reference (64 x 4k tokens, 16 heads) on the CPU.

    python benchmarks/bench_planner.py [--threads N] [--json PATH|-]

The table goes to stderr; ``--json -`` prints the JSON report to stdout. Times are the median and the minimum
of ``--reps`` runs after one warm-up, wall clock (time.perf_counter).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from mla_fast import plan_decode, run_plan_reference
from mla_ref.decode import DecodeBatch

L, R = 512, 64  # kv_lora_rank, rope dim (DeepSeek-V3)
SM_SCALE = 0.1352338  # DeepSeek-V3 softmax scale, YaRN mscale² included


def timed_ms(fn, reps: int) -> dict:
    """{"ms": median, "min_ms": minimum} wall milliseconds of fn() over reps runs, after one warm-up run.

    The minimum is the least disturbed run (on a shared 2-core machine OpenMP threads wait for each other).
    """
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return {"ms": statistics.median(times), "min_ms": min(times)}


def paged_batch(batch: int, seq_len: int, heads: int, page_size: int, seed: int) -> DecodeBatch:
    """Equal-length requests, bf16 inputs, random page order, one NaN page that nobody uses."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = -(-seq_len // page_size)
    num_pages = batch * pages_per_req + 1
    q = torch.randn(batch, heads, L + R, generator=g).bfloat16()  # [B, H, D], q_len 1
    kv_cache = torch.randn(num_pages, page_size, L + R, generator=g).bfloat16()  # [P, ps, D]
    perm = torch.randperm(num_pages, generator=g)
    kv_cache[perm[-1]] = float("nan")  # the unused page: poison
    block_table = perm[:-1].view(batch, pages_per_req).int()  # [B, pages]
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    return DecodeBatch(q, kv_cache, block_table, seq_lens, sm_scale=SM_SCALE, kv_lora_rank=L).validate()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--workers", type=int, default=132, help="persistent workers (132 = H200 SMs)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None, metavar="PATH|-", help="write the JSON report to PATH or stdout")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in (1, 64, 1024):
        seq_lens = torch.randint(1, 32_768, (batch,), generator=g, dtype=torch.int32)  # [B] mixed lengths
        q_lens = torch.ones(batch, dtype=torch.int32)
        for heads, group in ((16, 16), (128, 16)):
            def plan(seq_lens=seq_lens, q_lens=q_lens, heads=heads, group=group):
                return plan_decode(seq_lens, q_lens, heads, args.workers, head_group=group)

            p = plan()
            rows.append({
                "what": "plan_decode", "batch": batch, "heads": heads, "head_group": group, "workers": args.workers,
                "items": p.num_items, "imbalance": round(p.stats()["imbalance"], 4),
                **timed_ms(plan, args.reps),
            })

    batch = paged_batch(64, 4096, 16, 64, seed=1)
    p = plan_decode(batch.seq_lens, batch.q_lens, 16, args.workers)
    rows.append({
        "what": "run_plan_reference fp32", "batch": 64, "heads": 16, "head_group": 16, "workers": args.workers,
        "items": p.num_items, "imbalance": round(p.stats()["imbalance"], 4),
        **timed_ms(lambda: run_plan_reference(batch, p), args.reps),
    })

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, seq_lens ~ U[1, 32767] for plans, "
          f"64 x 4096 tokens for the emulation", file=sys.stderr)
    header = f"{'what':<26}{'batch':>6}{'heads':>6}{'group':>6}{'items':>7}{'imbal':>8}{'median ms':>11}{'min ms':>10}"
    print(header, file=sys.stderr)
    for r in rows:
        print(f"{r['what']:<26}{r['batch']:>6}{r['heads']:>6}{r['head_group']:>6}{r['items']:>7}"
              f"{r['imbalance']:>8.3f}{r['ms']:>11.3f}{r['min_ms']:>10.3f}", file=sys.stderr)
    if args.json is not None:
        report = {"schema_version": 1, "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
        text = json.dumps(report, indent=2, allow_nan=False)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
