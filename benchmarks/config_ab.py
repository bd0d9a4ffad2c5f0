"""A/B of our decode's launch variants on one GPU, in alternating rounds: each variant is `KernelConfig` fields set
on the batch's default config (`batch_config`) and, in upper case, module constants of `mla_fast.triton_decode`,
`mla_fast.gluon_decode` or `mla_fast.gluon_fp8` (host-side launch choices such as `GROUPED_PAGES`) held for that
variant's launches (its first call and its graph capture, which launches again). CUDA-graph replays timed as in
`mla-bench` (`time_us`, three rounds, each starting at the next variant; the best round's median is reported), and
whether each variant gives the first one's bits.

    python benchmarks/config_ab.py --pages 4,8 --dtypes bf16,fp8kv \\
        --variant one:page_select=1,gather_chunk_pages=16 --variant two:page_select=2,gather_chunk_pages=16
    python benchmarks/config_ab.py --shapes "32,4096,128;128,4096,128;64,4096,16,2" --pages 64 --dtypes bf16 \\
        --variant std:GROUPED_PAGES=16/32 --variant grouped:GROUPED_PAGES=16/32/64

A variant may also run another version of a Gluon kernel module: `gluon_decode=PATH` or `gluon_fp8=PATH` (a copy of
that module's source, e.g. from a branch) launches that variant's kernel through PATH's `launch_decode` (its kernel,
with PATH's own module constants, so such a variant may not also set that module's constants); everything else
(planning, config, dispatch, reduce) stays this checkout's:

    git show lead/x:mla_fast/gluon_decode.py > /tmp/gd_x.py
    python benchmarks/config_ab.py --shapes "128,4096,128" --pages 64 --dtypes bf16 \\
        --variant main:gluon_decode=mla_fast/gluon_decode.py --variant x:gluon_decode=/tmp/gd_x.py

Values: integers, true / false, tuples of integers written with slashes (`16/32`, `64/` for one, `()` for none),
else strings.

Prints one line per (shape, page, dtype) with each variant's µs, registers and spills; --json writes them.
"""

import argparse
import contextlib
import hashlib
import importlib.util
import json
from dataclasses import fields, replace
from pathlib import Path

import torch

from mla_fast import gluon_decode as gd
from mla_fast import gluon_fp8 as g8
from mla_fast import triton_decode as td
from mla_fast.bench import build_batch, graphed, parse_shapes, time_us
from mla_fast.bench import ours as ours_fn

SHAPES = "32,4096,16;128,8192,16;32,4096,128"
CONFIG_FIELDS = {f.name: f.type for f in fields(td.KernelConfig)}
CONSTANT_MODULES = (td, gd, g8)  # where an upper-case variant key is looked up
SOURCE_MODULES = {"gluon_decode": gd, "gluon_fp8": g8}  # `NAME=PATH`: that module's launch_decode from PATH


def _owners(key: str) -> list:
    """The modules of CONSTANT_MODULES that bind constant `key`, when they all bind the same object (one module, or
    a constant re-exported by `from ... import`, as gluon_fp8 takes SMALL_PAGES from gluon_decode: a variant must
    set it in each); [] when none does or when they bind different objects (e.g. HEAD_GROUPS, one per kernel)."""
    owners = [m for m in CONSTANT_MODULES if hasattr(m, key)]
    if any(getattr(m, key) is not getattr(owners[0], key) for m in owners):
        return []
    return owners


def _value(raw: str):
    """A variant value: int, bool, tuple of ints ('16/32', '64/', '()') or the string itself."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if raw == "()" or "/" in raw:
        parts = [p for p in raw.strip("()").split("/") if p]
        if all(p.lstrip("-").isdigit() for p in parts):
            return tuple(int(p) for p in parts)
    if raw.lstrip("-").isdigit():
        return int(raw)
    return raw


def load_source(module: str, path: str):
    """The `launch_decode` of PATH, a version of mla_fast.<module> (gluon_decode or gluon_fp8), loaded as a module of
    its own (named after the file's contents, so that one file is loaded once)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{module}={path}: no such file")
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"mla_fast._ab_{module}_{digest}", file)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    if not callable(getattr(loaded, "launch_decode", None)):
        raise ValueError(f"{module}={path}: the file defines no launch_decode")
    return loaded.launch_decode


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """'name:field=value,CONSTANT=value,gluon_decode=path' -> (name, KernelConfig fields, module constants); values
    as `_value`; a source key becomes the constant '<module>.launch_decode' (`load_source`)."""
    name, _, body = text.partition(":")
    if not name or not body:
        raise ValueError(f"--variant must be NAME:FIELD=VALUE[,...], got {text!r}")
    config, constants = {}, {}
    for item in body.split(","):
        key, _, raw = item.partition("=")
        value = _value(raw)
        if key.isupper():
            if not _owners(key):
                names = ", ".join(m.__name__ for m in CONSTANT_MODULES)
                raise ValueError(f"--variant {name}: no constant {key!r} in {names}, or different ones of that name")
            constants[key] = value
        elif key in SOURCE_MODULES:
            constants[f"{key}.launch_decode"] = load_source(key, raw)
        elif key in CONFIG_FIELDS:
            config[key] = value
        else:
            raise ValueError(f"--variant {name}: {key!r} is neither a KernelConfig field, a module constant nor "
                             f"one of {sorted(SOURCE_MODULES)}")
    for key in [k for k in constants if "." in k]:  # a source's kernel reads its own file's constants, not these
        module = SOURCE_MODULES[key.partition(".")[0]]
        unread = [k for k in constants if "." not in k and module in _owners(k)]
        if unread:
            raise ValueError(f"--variant {name}: {', '.join(unread)} would not reach the kernel of "
                             f"{key.partition('.')[0]}=PATH (it reads PATH's own constants): edit PATH instead")
    return name, config, constants


@contextlib.contextmanager
def held(constants: dict):
    """The module constants `constants` (each in all its `_owners`; '<module>.launch_decode' in that module of
    SOURCE_MODULES) set inside the block, restored after."""
    targets = {k: ([SOURCE_MODULES[k.partition(".")[0]]], "launch_decode") if "." in k else (_owners(k), k)
               for k in constants}
    old = {k: getattr(modules[0], attr) for k, (modules, attr) in targets.items()}
    for k, v in constants.items():
        modules, attr = targets[k]
        for module in modules:
            setattr(module, attr, v)
    try:
        yield
    finally:
        for k, v in old.items():
            modules, attr = targets[k]
            for module in modules:
                setattr(module, attr, v)


def run_row(batch, variants, rounds: int) -> dict:
    """Time each variant on `batch` in `rounds` alternating rounds -> {name: {us, regs, spills, same_bits}}."""
    base = td.batch_config(batch, int(batch.q_lens.max()))
    replays, infos, first = {}, {}, None
    for name, fields_set, constants in variants:
        config = replace(base, **fields_set)
        with held(constants):
            fn, info = ours_fn(batch, config)
            torch.cuda.synchronize()
            outputs = [t.clone() for t in fn.outputs]
            replays[name] = graphed(fn)
        first = first or outputs
        infos[name] = {"regs": info["n_regs"], "spills": info["n_spills"], "kernel": config.kernel,
                       "same_bits": all(torch.equal(a, b) for a, b in zip(first, outputs))}
    names = list(replays)
    times = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(time_us(replays[n])[0])
    return {n: {"us": round(min(times[n]), 1), **infos[n]} for n in names}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(SHAPES),
                        help=f'"b,s,h[,q_len];..." ({SHAPES}; q_len 1 unless given)')
    parser.add_argument("--pages", default="16", help="comma list of page sizes (default 16)")
    parser.add_argument("--dtypes", default="bf16,fp8kv", help="comma list of bf16, fp8kv, fp8")
    parser.add_argument("--variant", action="append", required=True, help="NAME:FIELD=VALUE[,...] (at least two)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        parser.error(str(e))
    if len(variants) < 2 or args.rounds < 1:
        parser.error(f"need at least two --variant and --rounds >= 1, got {len(variants)} and {args.rounds}")
    bad = [shape for shape in args.shapes if len(shape) not in (3, 4)]
    if bad:
        parser.error(f"--shapes entries must be b,s,h or b,s,h,q_len, got {bad}")
    if not torch.cuda.is_available():
        raise SystemExit("config_ab needs a CUDA GPU")
    rows = []
    for b, s, h, *rest in args.shapes:
        q_len = rest[0] if rest else 1
        for page in (int(p) for p in args.pages.split(",")):
            for combo in args.dtypes.split(","):
                batch = build_batch(b, s, h, combo, page_size=page, q_len=q_len)
                row = {"b": b, "s": s, "h": h, "q_len": q_len, "page": page, "combo": combo,
                       "variants": run_row(batch, variants, args.rounds)}
                rows.append(row)
                print(row, flush=True)
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
