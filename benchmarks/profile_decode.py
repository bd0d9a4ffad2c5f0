"""Launch our Triton decode a few times on one mla-bench shape, for a profiler (`ncu`) to attach to.

    ncu --kernel-name regex:_mla_decode_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/profile_decode.py --shape 128,8192,16 --dtype fp8kv

Default config (`batch_config`; `--config '{"kernel": "gluon", "head_group": 64, "head_split": 2}'` for
KernelConfig overrides), q_len 1, page 64 unless --page-size, the same batch as `mla-bench` (`build_batch`).
"""

import argparse
import json
from dataclasses import replace

import torch

from mla_fast import triton_decode as td
from mla_fast.bench import build_batch, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="128,8192,16", help="b,s_k,h")
    parser.add_argument("--dtype", default="bf16", help="bf16, fp8kv or fp8")
    parser.add_argument("--page-size", type=int, default=64, help="cache page size (default 64)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--config", default="{}", help="KernelConfig overrides of default_config, as JSON")
    args = parser.parse_args()
    b, s, h = (int(x) for x in args.shape.split(","))
    batch = build_batch(b, s, h, args.dtype, page_size=args.page_size)
    config = replace(td.batch_config(batch, 1), **json.loads(args.config))
    fn, info = ours(batch, config)
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()
    print({"shape": (b, s, h), "dtype": args.dtype, "page_size": args.page_size, **info})


if __name__ == "__main__":
    main()
