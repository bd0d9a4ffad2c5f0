"""What batch invariance costs: `decode_invariant` (fixed splits of S tokens, the geometry of `invariant_config`,
fixed reduce steps) against our default decode (`mla-bench`'s launch of the batch's own plan), CUDA-graph replays
timed as in `mla-bench` (`time_us`, L2 zeroed before each call, rounds alternating between the variants, the best
round's median), on uniform batches at q_len 1. Per row it also checks the property: request 0's rows from the full
batch and from a batch of request 0 alone, bits equal ("inv"), for the default decode too.

    python benchmarks/invariant_bench.py --splits 512,1024,2048 --dtypes bf16,fp8kv --json invariant.json
"""

import argparse
import json

import torch

from mla_fast import triton_decode as td
from mla_fast.bench import SHAPES, build_batch, graphed, parse_shapes, time_us
from mla_fast.bench import ours as ours_fn


def _alone(batch):
    """Request 0 of a q_len-1 batch as a batch of its own (the same cache)."""
    return batch.replace(q=batch.q[:1], block_table=batch.block_table[:1], seq_lens=batch.seq_lens[:1],
                         q_lens=batch.q_lens[:1])


def _launcher(batch, split: int | None):
    """() -> None on preallocated outputs (fn.outputs): the default decode (split None) or decode_invariant's."""
    if split is None:
        return ours_fn(batch)[0]
    config = td.invariant_config(batch)
    plan = td.make_plan(batch, config, split_tokens=split)
    return ours_fn(batch, config=config, plan=plan, reduce_pieces=td.STEP_REDUCE_PIECES)[0]


def _invariant(batch, split: int | None) -> bool:
    """Whether request 0's out and lse keep their bits when it is decoded alone."""
    full, alone = _launcher(batch, split), _launcher(_alone(batch), split)
    full()
    alone()
    torch.cuda.synchronize()
    return all(torch.equal(a[:1].view(torch.uint8), b.view(torch.uint8)) for a, b in zip(full.outputs, alone.outputs))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help='"b,s,h;..." (default: the issue grid)')
    parser.add_argument("--dtypes", default="bf16,fp8kv", help="comma list of bf16, fp8kv, fp8")
    parser.add_argument("--splits", default=str(td.INVARIANT_SPLIT_TOKENS), help="comma list of split_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    splits = [int(x) for x in args.splits.split(",")]
    rows = []
    print("b, s, h, dtype | default us (inv) | " + " | ".join(f"split {s} us (inv, x default)" for s in splits))
    for b, s, h in args.shapes:
        for combo in args.dtypes.split(","):
            batch = build_batch(b, s, h, combo)
            variants = [None, *splits]
            replays = [graphed(_launcher(batch, v)) for v in variants]
            best = [float("inf")] * len(variants)
            for r in range(args.rounds):
                for i in [(r + j) % len(variants) for j in range(len(variants))]:
                    best[i] = min(best[i], time_us(replays[i])[0])
            inv = [_invariant(batch, v) for v in variants]
            row = {"b": b, "s": s, "h": h, "dtype": combo, "default_us": best[0], "default_invariant": inv[0],
                   "splits": {str(v): {"us": t, "invariant": ok} for v, t, ok in zip(splits, best[1:], inv[1:])}}
            rows.append(row)
            cells = [f"{t:.1f} ({'yes' if ok else 'no'}, {t / best[0]:.2f}x)" for t, ok in zip(best[1:], inv[1:])]
            print(f"{b}, {s}, {h}, {combo} | {best[0]:.1f} ({'yes' if inv[0] else 'no'}) | " + " | ".join(cells),
                  flush=True)
            del replays
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
