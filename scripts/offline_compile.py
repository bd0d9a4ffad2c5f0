"""Compile one of mla_fast's Gluon decode kernels, or the Triton kernel with its pair merge, for an H100/H200
(sm_90a) on a machine without a GPU, and report what ptxas says: registers, spill bytes, shared memory and the SASS
instruction counts.

    python scripts/offline_compile.py seesaw --combo fp8kv --heads 128
    python scripts/offline_compile.py gluon_fp8 --combo fp8 --heads 16 --q-len 2 --sass /tmp/gluon_fp8.sass
    python scripts/offline_compile.py triton_pair --combo bf16 --heads 16
    python scripts/offline_compile.py seesaw --combo fp8kv --page-size 16 --fp8-in-place  # no loader partition
    python scripts/offline_compile.py seesaw --combo fp8kv --page-size 16 --shared  # where each buffer lies

A stand-in CUDA driver (sm_90, never asked to launch) lets Triton compile, and the launch is made a warm-up, so
nothing runs. Gluon kernels cannot run in the interpreter, and neither can the Triton kernel's pair merge (2-CTA
clusters, mla_fast.dsmem), so this is where CI sees their compile errors (tests/test_offline_compile.py) before a
device call does. The pointer arguments are CPU tensors: Triton's
alignment specialisation can differ from a GPU run's, so instruction counts may differ a little between compiles of
the same source. Exit status 1 with the traceback when the kernel does not compile.

To check that a change leaves a kernel as it was, compare its PTX (--ptx: the code without its debug records, which
name source lines and files), not its SASS: the PTX is the same from run to run, but ptxas 12.8 (the triton 3.6
wheel's) may number registers differently between runs on the same PTX (seen on the Gluon fp8 kernel at page 16; the
SASS then differs only in register names).

--shared adds where the kernel's shared-memory buffers lie (`shared_allocations`): Gluon (triton 3.6) gives a buffer
no address, so inline PTX that addresses one through the `global_smem` symbol (a bulk copy or `st.async` into a
cluster partner's shared memory, say) needs these byte offsets. The thirty-ninth session's 2-CTA experiments in the
seesaw took them from here (docs/perf_history.md).
"""

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before mla_fast reads it: compile for the device, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from sass_loops import instructions, mma_loops  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime import driver as triton_driver  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # ptxas and cuobjdump of the triton wheel
NUM_WORKERS = 132  # an H200's SM count (the plan's workers; it does not change the compiled code)


class Sm90Driver(CudaDriver):
    """Triton's CUDA driver answering for one sm_90 device without touching CUDA (compile only)."""

    def __init__(self):
        self.launcher_cls = None

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=0):
        return (9, 0)

    @staticmethod
    def is_active():
        return True


def compile_kernel(kernel: str, combo: str, heads: int, q_len: int, page_size: int = 64):
    """The CompiledKernel of `kernel` ("seesaw", "gluon_fp8" or "triton_pair") for a small CPU batch of `combo` with
    `heads` heads at q_len on pages of page_size tokens, in the geometry default_config gives it (the seesaw's bf16
    rule, the Gluon fp8 kernel's head group, the Triton kernel's rule without Gluon kernels, compiled with
    PAIR_MERGE), whatever the batch size."""
    from mla_fast import gluon_decode, gluon_fp8
    from mla_fast import triton_decode as td
    from mla_fast.bench import build_batch
    from mla_fast.numerics import DEFAULT_MMA

    triton_driver.set_active(Sm90Driver())
    batch = build_batch(2, 300, heads, combo, page_size=page_size, device="cpu", q_len=q_len)
    if kernel == "triton_pair":
        module, jit = td, td._mla_decode_kernel
        config = td.default_config(combo, heads, q_len, 32)
    elif kernel == "seesaw":
        module, jit = gluon_decode, gluon_decode._mla_decode_seesaw_kernel
        config = replace(td.default_config("bf16", heads, q_len, 32, seesaw=True), mma=DEFAULT_MMA[combo])
        if config.kernel != "gluon":
            raise ValueError(f"default_config takes no seesaw geometry for {heads} heads at q_len {q_len} (16 rows "
                             f"or fewer)")
    else:
        module, jit = gluon_fp8, gluon_fp8._mla_decode_fp8_kernel
        config = td.forced_config(combo, heads, q_len, "gluon_fp8")
        if config is None:
            raise ValueError(f"default_config takes no Gluon fp8 geometry for {combo} at {heads} heads, q_len {q_len}")
    plan = td.make_plan(batch, config, NUM_WORKERS)
    T, H, L = batch.q.shape[0], heads, batch.kv_lora_rank
    out, lse = torch.empty(T, H, L, dtype=torch.bfloat16), torch.empty(T, H)
    o_part, lse_part = torch.empty(64, H, L), torch.empty(64, H)
    one = torch.ones(1)
    compiled = []
    run = type(jit).run

    def warm_up(*args, grid, warmup, **kwargs):  # compile, never launch
        compiled.append(run(jit, *args, grid=grid, warmup=True, **kwargs))
        return compiled[-1]

    jit.run = warm_up
    if kernel == "triton_pair":  # the plan's pairing is not checked: compiled, never run
        launch = CompiledKernel.__getitem__
        CompiledKernel.__getitem__ = lambda self, grid: lambda *args: None  # launch_in_pairs launches it: not here
        try:
            module._launch_triton(batch, plan, out, lse, o_part, lse_part, one, one, config, batch.qo_indptr,
                                  q_len * config.head_group, False, NUM_WORKERS, pair_merge=True)
        finally:
            CompiledKernel.__getitem__ = launch
    elif kernel == "seesaw":
        module.launch_decode(batch, plan, out, lse, o_part, lse_part, one, one, config.head_group, config.head_split,
                             batch.qo_indptr, pdl=True)
    else:
        module.launch_decode(batch, plan, out, lse, o_part, lse_part, one, one, config.head_group, config.head_split,
                             config.num_stages, batch.qo_indptr, qk_fp8=config.qk_fp8)
    return compiled[0]


_ELEMENT_BITS = {"f16": 16, "bf16": 16, "f32": 32, "i64": 64, "i32": 32, "i8": 8, "f8E4M3FN": 8, "f8E5M2": 8}


def shared_allocations(compiled) -> list[dict]:
    """The compiled kernel's shared-memory buffers where the NVIDIA backend places them, by offset: each
    {"offset": bytes from `global_smem`, "bytes": its size, "type": its memdesc}. Triton's own allocation pass
    (`allocate_shared_memory_nv`, after the passes make_llir runs before it) is run here on the kernel's TTGIR, whose
    buffers it places deterministically (the same source and constexprs, the same offsets)."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import CUDABackend, get_ptx_version_from_options

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ttgir"
        path.write_text(compiled.asm["ttgir"])
        module = ir.parse_mlir_module(str(path), context)
    module.context = context  # held by the module, as triton's compile does
    manager = ir.pass_manager(context)
    passes.ttgpuir.add_combine_tensor_select_and_if(manager)
    passes.ttgpuir.add_allocate_warp_groups(manager)
    passes.convert.add_scf_to_cf(manager)
    passes.gluon.add_inliner(manager)
    ptx_version = get_ptx_version_from_options(backend.parse_options({}), 90)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(manager, 90, ptx_version)
    manager.run(module, "shared_allocations")
    buffers = []
    for line in str(module).splitlines():
        found = re.search(r"allocation\.offset = (\d+).*!ttg\.memdesc<([^>]*)>", line)
        if "ttg.local_alloc" in line and found:
            shape = found.group(2).split(",")[0]  # e.g. 2x64x512xf16
            *dims, element = shape.split("x")
            if element not in _ELEMENT_BITS:
                raise ValueError(f"shared_allocations: no size known for element type {element!r} of {shape}")
            size = math.prod(int(d) for d in dims) * _ELEMENT_BITS[element] // 8
            buffers.append({"offset": int(found.group(1)), "bytes": size, "type": shape})
    return sorted(buffers, key=lambda b: b["offset"])


def code_ptx(ptx: str) -> str:
    """The PTX without its debug records: no `.loc` / `.file` lines and nothing from the first `.debug` section on
    (source lines and paths move with edits that do not change the code)."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    return "".join(line for line in code.splitlines(keepends=True)
                   if not re.match(r"\s*\.(loc|file)\s", line))


def ptxas_report(ptx: str, sass_path: str | None) -> dict:
    """ptxas -v on the kernel's PTX (sm_90a): registers, spill bytes and warnings; the SASS opcode counts and its
    MMA loops (`sass_loops.mma_loops`: static instruction, wgmma, BAR, SYNCS and spill counts of each innermost one)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx_file, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx_file.write_text(ptx)
        proc = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(ptx_file), "-o", str(cubin)],
                              capture_output=True, text=True, check=True)
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    if sass_path:
        Path(sass_path).write_text(sass)
    info = proc.stderr
    opcodes = Counter(op for _, _, op, _ in instructions(sass))
    return {
        "registers": int(re.search(r"Used (\d+) registers", info).group(1)),
        "spill_stores": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
        "spill_loads": int(re.search(r"(\d+) bytes spill loads", info).group(1)),
        "warnings": [line.strip() for line in info.splitlines() if "warning" in line.lower()],
        "instructions": sum(opcodes.values()),
        "opcodes": dict(opcodes.most_common(12)),
        "mma_loops": mma_loops(sass),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["seesaw", "gluon_fp8", "triton_pair"])
    parser.add_argument("--combo", default="bf16", choices=["bf16", "fp8kv", "fp8"])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--sass", help="write the SASS here")
    parser.add_argument("--ptx", help="write the PTX here, without its debug records (`code_ptx`)")
    parser.add_argument("--shared", action="store_true",
                        help="also report the shared-memory buffers' offsets and sizes (`shared_allocations`)")
    parser.add_argument("--fp8-in-place", action="store_true",
                        help="the seesaw expands e4m3fn tiles in place on every page size (gluon_decode."
                             "SEESAW_FP8_LOADER_PAGES emptied: no loader partition)")
    args = parser.parse_args(argv)
    if args.fp8_in_place:
        from mla_fast import gluon_decode

        gluon_decode.SEESAW_FP8_LOADER_PAGES = ()
    compiled = compile_kernel(args.kernel, args.combo, args.heads, args.q_len, args.page_size)
    if args.ptx:
        Path(args.ptx).write_text(code_ptx(compiled.asm["ptx"]))
    report = ptxas_report(compiled.asm["ptx"], args.sass)
    shared = {"shared_allocations": shared_allocations(compiled)} if args.shared else {}
    print({"kernel": args.kernel, "combo": args.combo, "heads": args.heads, "q_len": args.q_len,
           "page_size": args.page_size,
           "shared_bytes": compiled.metadata.shared, **report, **shared})


if __name__ == "__main__":
    main()
