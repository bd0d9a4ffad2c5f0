"""Time MTP decode (q_len > 1, causal rows) on one GPU: the default config (`batch_config`; bf16 takes the Gluon
seesaw kernel on an H200) against the Triton kernel's default, CUDA-graph replays as in `mla-bench`.

    python benchmarks/mtp_bench.py --json mtp.json

Prints one line per (shape, kernel) and the largest |out| difference between the two kernels (each is checked
against the fp64 oracle within its bound by tests/test_triton_gpu.py).
"""

import argparse
import json

import torch

from mla_fast import triton_decode as td
from mla_fast.bench import build_batch, bytes_moved, copy_bandwidth_gbs, measure, ours

SHAPES = [(64, 4096, 16, 4), (128, 4096, 16, 4), (32, 4096, 128, 2), (128, 4096, 128, 2), (64, 4096, 64, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for b, s, h, q_len in SHAPES:
        batch = build_batch(b, s, h, "bf16", q_len=q_len)
        configs = {"default": td.batch_config(batch, q_len),
                   "triton": td.default_config("bf16", h, q_len, b, seesaw=False)}
        outs = {}
        for name, config in configs.items():
            fn, info = ours(batch, config)
            m = measure(fn, bytes_moved(b, s, h, "bf16"), copy_gbs)
            outs[name] = fn.outputs[0].float().clone()
            rows.append({"b": b, "s": s, "h": h, "q_len": q_len, "config": name, "kernel": config.kernel,
                         "head_group": config.head_group, "head_split": config.head_split, **m, **info})
            print(f"({b}, {s}, {h}) q_len {q_len} {name:8s} {config.kernel:6s} {m.get('us', float('nan')):8.1f} us")
        print(f"  max |out default - out triton| = {float((outs['default'] - outs['triton']).abs().max()):.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
