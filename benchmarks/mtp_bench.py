"""Time MTP decode (q_len > 1, causal rows) on one GPU: the default config (`batch_config`; on an H200 bf16 takes the
Gluon seesaw kernel and fp8 caches the Gluon fp8 kernel where default_config says so) against the Triton kernel's
default and, for fp8 caches, the Gluon fp8 kernel forced (16 packed rows per program, whatever the batch size),
CUDA-graph replays as in `mla-bench`.

    python benchmarks/mtp_bench.py --json mtp.json

Prints one line per (shape, kernel) and the largest |out| difference of each kernel to the default (each is checked
against the fp64 oracle within its bound by tests/test_triton_gpu.py).
"""

import argparse
import json

import torch

from mla_fast import triton_decode as td
from mla_fast.bench import build_batch, bytes_moved, copy_bandwidth_gbs, measure, ours

SHAPES = [  # (b, s_k, heads, q_len, combo)
    (64, 4096, 16, 4, "bf16"), (128, 4096, 16, 4, "bf16"), (32, 4096, 128, 2, "bf16"), (128, 4096, 128, 2, "bf16"),
    (64, 4096, 64, 3, "bf16"), (64, 4096, 16, 2, "bf16"), (128, 4096, 16, 2, "bf16"),
    (1, 8192, 16, 2, "fp8kv"), (32, 4096, 16, 2, "fp8kv"), (64, 4096, 16, 2, "fp8kv"), (128, 4096, 16, 2, "fp8kv"),
    (128, 8192, 16, 2, "fp8kv"), (128, 4096, 16, 2, "fp8"), (4, 8192, 16, 3, "fp8kv"), (8, 8192, 16, 4, "fp8kv"),
    (16, 4096, 16, 4, "fp8kv"), (64, 4096, 16, 4, "fp8kv"),
]


def configs(batch, b: int, h: int, q_len: int, combo: str) -> dict:
    """The default config, the Triton kernel's default and (fp8 caches) the Gluon fp8 kernel forced."""
    out = {"default": td.batch_config(batch, q_len),
           "triton": td.default_config(combo, h, q_len, b, seesaw=False, fp8_gluon=False)}
    gluon_fp8 = td.forced_config(combo, h, q_len, "gluon_fp8")  # None for bf16 and where it takes no such rows
    if gluon_fp8 is not None:
        out["gluon_fp8"] = gluon_fp8
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for b, s, h, q_len, combo in SHAPES:
        batch = build_batch(b, s, h, combo, q_len=q_len)
        outs = {}
        for name, config in configs(batch, b, h, q_len, combo).items():
            if name != "default" and config == outs.get("default", (None,))[0]:
                continue  # the default already
            fn, info = ours(batch, config)
            m = measure(fn, bytes_moved(b, s, h, combo, q_len), copy_gbs)
            outs[name] = (config, fn.outputs[0].float().clone())
            rows.append({"b": b, "s": s, "h": h, "q_len": q_len, "combo": combo, "config": name,
                         "kernel": config.kernel, "head_group": config.head_group, "head_split": config.head_split,
                         **m, **info})
            print(f"({b}, {s}, {h}) q_len {q_len} {combo:5s} {name:9s} {config.kernel:9s} "
                  f"{m.get('us', float('nan')):8.1f} us", flush=True)
        ref = outs["default"][1]
        diffs = {k: float((o - ref).abs().max()) for k, (_, o) in outs.items() if k != "default"}
        print(f"  max |out - out default|: {diffs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
