"""Each kernel of a row timed alone for a few seconds of back-to-back CUDA-graph replays, with the SM clock, board
power and clock-event reasons sampled while it ran: the clock each kernel settles at under the H200's 700 W cap
(`mla-bench`'s alternating rounds mix the kernels of a row within a sample period; here each gets its own window).

    python benchmarks/sustained_clocks.py --json sustained.json
    python benchmarks/sustained_clocks.py --shapes "128,4096,128" --dtypes bf16 --seconds 3 --repeats 3

Per row and callable (ours, and FlashMLA / FlashInfer where they take the dtypes), `repeats` runs of `seconds` each
(do_bench with its zeroing flush, every call timed), a `gap` of idle seconds before each run: µs median, mean of the
first and of the last FIRST_LAST calls (before and after the cap sets in), the SM clock (median, lowest), the
highest power and each clock-event reason's share of the samples (`mla_fast.gpu_clocks`, every 20 ms).
Thirty-second session, one H200 (docs/kernels.md, "The H200's clocks at 128 heads"): at (128, 4096, 128) bf16
ours 288.1 µs at 1695 MHz, FlashMLA 255.1 at 1620, both at the cap; 262.2 vs 235.4 in the first calls.
"""

import argparse
import json
import statistics
import time

SHAPES = "128,4096,128;128,8192,16"
FIRST_LAST = 20  # calls averaged at each end of a run
PERIOD_MS = 20  # nvidia-smi's sampling period here


def summarize_run(samples_us: list[float]) -> dict:
    """µs median, and the means of the first and last FIRST_LAST calls, of one run's timed calls."""
    n = min(FIRST_LAST, len(samples_us))
    return {"us_median": statistics.median(samples_us), "us_first": statistics.fmean(samples_us[:n]),
            "us_last": statistics.fmean(samples_us[-n:]), "calls": len(samples_us)}


def run_alone(fns: dict, seconds: float, repeats: int, gap_s: float, timer, sleep=time.sleep, clock=time.time) -> dict:
    """{name: [run, ...]}: each callable of `fns` timed alone, in turn, `repeats` times (name order, repeated), each
    run `seconds` long after `gap_s` idle seconds; timer(fn, rep_ms) -> [µs per call]. Each run keeps its
    `window` [t0, t1] (clock() seconds) for the clock sampler."""
    if seconds <= 0 or repeats < 1 or gap_s < 0:
        raise ValueError(f"need seconds > 0, repeats >= 1, gap >= 0; got {seconds}, {repeats}, {gap_s}")
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sleep(gap_s)
            t0 = clock()
            samples = timer(fn, int(seconds * 1000))
            runs[name].append({**summarize_run(samples), "window": [t0, clock()]})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help='"b,s,h;..." (q_len 1, pages of 64)')
    parser.add_argument("--dtypes", default="bf16,fp8", help="comma list of bf16, fp8kv, fp8")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per callable")
    parser.add_argument("--gap", type=float, default=1.0, help="idle seconds before each run")
    parser.add_argument("--json", help="write the runs to this file")
    args = parser.parse_args()

    import torch

    from mla_fast.bench import build_batch, flashinfer_fn, flashmla_fn, ours, parse_shapes, prepare, time_samples_us
    from mla_fast.gpu_clocks import ClockSampler, smi_id

    if not torch.cuda.is_available():
        raise SystemExit("sustained_clocks needs a CUDA GPU")
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    rows = []
    with ClockSampler(smi_id(0, uuid), period_ms=PERIOD_MS) as clocks:
        for shape in parse_shapes(args.shapes):
            for combo in args.dtypes.split(","):
                batch = build_batch(*shape, combo)
                candidates = {"ours": ours(batch)[0], "flashmla": flashmla_fn(batch),
                              "flashinfer": flashinfer_fn(batch)}
                fns = {name: prepare(fn)[0] for name, fn in candidates.items() if not isinstance(fn, str)}
                skipped = {name: fn for name, fn in candidates.items() if isinstance(fn, str)}
                runs = run_alone(fns, args.seconds, args.repeats, args.gap,
                                 lambda fn, rep: time_samples_us(fn, rep_ms=rep, flush="zero"))
                rows.append({"shape": list(shape), "combo": combo, "runs": runs, "skipped": skipped})
                del fns, candidates, batch
                torch.cuda.empty_cache()
    for row in rows:
        for name, runs in row["runs"].items():
            for run in runs:
                run["clocks"] = c = clocks.window(*run.pop("window"))
                print(f"{tuple(row['shape'])} {row['combo']:5s} {name:10s} median {run['us_median']:7.1f} us (first "
                      f"{run['us_first']:7.1f}, last {run['us_last']:7.1f}) | SM {c.get('sm_mhz_median', '-')} MHz "
                      f"(min {c.get('sm_mhz_min', '-')}), power max {c.get('power_w_max', '-')} W, "
                      f"reasons {c.get('reasons', c.get('status'))}", flush=True)
        for name, reason in row["skipped"].items():
            print(f"{tuple(row['shape'])} {row['combo']:5s} {name:10s} {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "clocks": {"sampled": clocks.available,
                                                                          "reason": clocks.reason}, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
