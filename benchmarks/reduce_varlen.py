"""Time the split-KV reduce's shape on varlen batches on one GPU: `mla_fast.decode`'s own plan with the default
reduce (`plan_reduce_pieces`, a grid over the split tiles) against the plan's `max_pieces` in one step and against
the grid before the twenty-first session (every tile, max_pieces per step), CUDA-graph replays as in `mla-bench`.

    python benchmarks/reduce_varlen.py [--json PATH] [--rounds N]

A batch is "tail": request 0 holds `long` tokens and the others `short` (one long request among short ones, whose
tile a plan cuts in many more pieces than the rest), or "rand": lengths uniform in [256, long] (seeded). Prints one
line per (batch, variant): µs (median of the rounds, each `triton.testing.do_bench`'s median with its zeroing L2
flush), the pieces per reduce step, and max |out - default out| (another fp32 order of the same merge; each
variant's merge is checked against the fp64 oracle by the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from dataclasses import dataclass

import torch

from mla_fast import triton_decode as td
from mla_fast.bench import build_batch, graphed, ours, time_us


@dataclass(frozen=True)
class VarlenCase:
    kind: str  # "tail" | "rand"
    batch: int
    long: int  # tokens of request 0 ("tail") or the largest length ("rand")
    heads: int
    combo: str = "bf16"
    short: int = 1024  # "tail": tokens of the other requests

    def lengths(self) -> torch.Tensor:
        """int32 [batch] sequence lengths."""
        if self.kind == "tail":
            return torch.tensor([self.long] + [self.short] * (self.batch - 1), dtype=torch.int32)
        if self.kind == "rand":
            g = torch.Generator().manual_seed(self.batch * 7 + self.heads)
            return torch.randint(256, self.long + 1, (self.batch,), generator=g).to(torch.int32)
        raise ValueError(f"kind must be 'tail' or 'rand', got {self.kind!r}")


CASES = [  # docs/kernels.md's table ("The reduce on varlen batches")
    VarlenCase("tail", 64, 32768, 16), VarlenCase("tail", 64, 32768, 16, "fp8kv"), VarlenCase("tail", 32, 32768, 128),
    VarlenCase("tail", 128, 16384, 16), VarlenCase("tail", 16, 65536, 16), VarlenCase("rand", 32, 8192, 128),
    VarlenCase("rand", 64, 8192, 16), VarlenCase("rand", 128, 8192, 16),
]
VARIANTS = ("default", "max_pieces", "all_tiles")


def variant_plan(plan, variant: str):
    """(plan, reduce_pieces) that `launch` takes for a variant: "default" (the plan and plan_reduce_pieces),
    "max_pieces" (its largest tile's pieces in one step), "all_tiles" (also a grid over every tile: the plan's
    reduce_final as its split_final, whose unsplit rows the reduce kernel skips, as before the twenty-first session)."""
    if variant == "default":
        return plan, None
    if variant == "max_pieces":
        return plan, plan.max_pieces
    if variant == "all_tiles":
        return dataclasses.replace(plan, split_final=plan.reduce_final), plan.max_pieces
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def run_case(case: VarlenCase, rounds: int) -> list[dict]:
    batch = build_batch(case.batch, case.long, case.heads, case.combo)  # pages for `long` tokens per request
    batch.seq_lens.copy_(case.lengths().to(batch.seq_lens.device))
    config = td.batch_config(batch, 1)
    plan = td.make_plan(batch, config)
    rows_per_tile = td.reduce_rows(config, config.head_group)  # q_len 1
    default_pieces = td.plan_reduce_pieces(plan, rows_per_tile, batch.kv_lora_rank, td.num_sms(batch.q.device))
    fns, pieces = {}, {}
    for variant in VARIANTS:
        p, rp = variant_plan(plan, variant)
        fns[variant], _ = ours(batch, config, plan=p, reduce_pieces=rp)
        pieces[variant] = td.reduce_blocks(default_pieces if rp is None else rp, batch.kv_lora_rank)[0]
    replays = {v: graphed(fn) for v, fn in fns.items()}
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):  # alternating
        for v, replay in replays.items():
            times[v].append(time_us(replay)[0])
    ref = fns["default"].outputs[0].float()
    diff = {v: float((fn.outputs[0].float() - ref).abs().max()) for v, fn in fns.items()}
    return [{**dataclasses.asdict(case), "variant": v, "us": statistics.median(times[v]), "us_rounds": times[v],
             "block_s": pieces[v], "max_pieces": plan.max_pieces, "split_tiles": plan.split_tiles,
             "num_tiles": plan.num_tiles, "max_abs_diff_vs_default": diff[v]} for v in VARIANTS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("reduce_varlen: needs a CUDA GPU (graph replays); nothing timed")
        return 1
    rows = []
    for case in CASES:
        for r in run_case(case, args.rounds):
            rows.append(r)
            print(f"{case.kind} b={case.batch} long={case.long} h={case.heads} {case.combo:5s} {r['variant']:10s} "
                  f"{r['us']:7.1f} us  BLOCK_S {r['block_s']:2d}  split tiles {r['split_tiles']}/{r['num_tiles']}  "
                  f"max pieces {r['max_pieces']}  diff {r['max_abs_diff_vs_default']:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
