"""mla_fast.dsmem on the CPU: when `launch` takes the pair merge (2-CTA clusters), and how `launch_in_pairs` sets
the cluster size and refuses what it cannot launch. The kernel itself runs only on sm_90+ (tests/test_triton_gpu.py)
and compiles here (tests/test_offline_compile.py)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from mla_fast import dsmem
from mla_fast import triton_decode as td
from mla_fast.bench import build_batch

CUDA = torch.device("cuda")  # pair_merge_applies only asks dsmem.supported about it (monkeypatched below)


def _plan(batch_size: int, seq_len: int = 4096, config=None):
    batch = build_batch(batch_size, seq_len, 16, "bf16", device="cpu")
    config = config or td.default_config("bf16", 16, 1, batch_size)
    return td.make_plan(batch, config, 132), config


def test_pair_merge_applies_to_the_two_piece_even_plan_only(monkeypatch):
    monkeypatch.setattr(dsmem, "supported", lambda device, interpret: True)
    paired, config = _plan(64)  # 64 requests x 2 pieces on 132 workers
    assert config.kernel == "triton" and config.split_l == 4 and config.pair_merge
    assert td.pair_merge_applies(paired, config, CUDA, 512)
    four, _ = _plan(32)  # 4 pieces per request: the reduce kernel merges them
    unsplit, _ = _plan(128)
    assert not td.pair_merge_applies(four, config, CUDA, 512) and not td.pair_merge_applies(unsplit, config, CUDA, 512)
    for changes in (dict(pair_merge=False), dict(split_l=1), dict(kernel="gluon"), dict(head_split=2)):
        assert not td.pair_merge_applies(paired, replace(config, **changes), CUDA, 512), changes
    assert not td.pair_merge_applies(replace(paired, one_item_per_worker=False), config, CUDA, 512)
    odd_workers = replace(paired, worker_indptr=paired.worker_indptr[:-1])  # 131 workers
    assert not td.pair_merge_applies(odd_workers, config, CUDA, 512)


def test_pair_merge_needs_a_device_that_takes_clusters():
    paired, config = _plan(64)
    assert not dsmem.supported(torch.device("cpu"), False)
    assert not td.pair_merge_applies(paired, config, torch.device("cpu"), 512)


class _Compiled(SimpleNamespace):
    """Stands in for a compiled Triton kernel: [grid](...) records the grid and the arguments of each launch."""

    def __getitem__(self, grid):
        return lambda *args: (self.grids.append(grid), self.calls.append(args))


class _Kernel:
    """Stands in for a Triton JITFunction whose warmup returns `compiled`."""

    arg_names = ["X", "N", "BLOCK_M", "L"]

    def __init__(self, compiled):
        self.compiled = compiled

    @property
    def grids(self):
        return self.compiled.grids

    def warmup(self, *args, grid, **kwargs):
        return self.compiled

    def __getitem__(self, grid):
        raise AssertionError("launch_in_pairs must launch the compiled kernel, not dispatch the JITFunction again")


def _compiled(num_warps=4, num_ctas=1, shared=167936, packed_ctas=1, packed=None):
    meta = SimpleNamespace(num_warps=num_warps, num_ctas=num_ctas, shared=shared)
    return _Compiled(metadata=meta, packed_metadata=packed or (num_warps, packed_ctas, shared), grids=[], calls=[])


def test_launch_in_pairs_sets_the_cluster_size_and_launches_half_the_grid():
    kernel = _Kernel(_compiled())
    kwargs = dict(BLOCK_M=16, L=512, num_warps=4)
    assert dsmem.launch_in_pairs(kernel, 132, ("x", 7), kwargs) is kernel.compiled
    assert kernel.compiled.packed_metadata == (4, 2, 167936) and kernel.grids == [(66, 1, 1)]
    assert kernel.compiled.calls == [("x", 7, 16, 512)]  # every parameter in signature order, no launch options
    dsmem.launch_in_pairs(kernel, 132, ("x", 7), kwargs)  # the cached kernel, already set
    assert kernel.compiled.packed_metadata == (4, 2, 167936) and kernel.grids == [(66, 1, 1)] * 2


def test_call_args_orders_every_parameter_and_names_a_missing_one():
    names = td._mla_decode_kernel.arg_names  # the pair-merge kernel's own signature
    positional = tuple(range(26))
    constexprs = {name: f"<{name}>" for name in names[26:]}
    ordered = dsmem.call_args(names, positional, {**constexprs, "num_warps": 4, "num_stages": 2})
    assert ordered == [*positional, *(f"<{name}>" for name in names[26:])] and len(ordered) == len(names)
    del constexprs["PAIR_MERGE"]
    with pytest.raises(ValueError, match=r"none for \['PAIR_MERGE'\]"):
        dsmem.call_args(names, positional, constexprs)
    too_many = len(names) + 1
    with pytest.raises(ValueError, match=f"got {too_many} positional"):
        dsmem.call_args(names, tuple(range(too_many)), {})


def test_launch_gives_the_pair_merge_a_one_row_workspace(monkeypatch):
    """Without a workspace, launch allocates the partial rows the plan needs, or one stand-in row when the pair merge
    writes none."""
    batch = build_batch(64, 4096, 16, "bf16", device="cpu")
    config = td.default_config("bf16", 16, 1, 64)
    plan = td.make_plan(batch, config, 132)
    shapes = []
    monkeypatch.setattr(td, "_launch_triton", lambda batch, plan, out, lse, o_part, lse_part, *rest: shapes.append(
        (tuple(o_part.shape), tuple(lse_part.shape), rest[-1])))
    monkeypatch.setattr(td, "_mla_reduce_kernel", {})  # the reduce's launch after decode: grid -> KeyError if reached
    out, lse = torch.empty(64, 16, 512, dtype=torch.bfloat16), torch.empty(64, 16)
    with pytest.raises(KeyError):  # decode + reduce: the plan's 128 partial rows, then the reduce
        td.launch(batch, plan, out, lse, config, max_rows=16)
    monkeypatch.setattr(dsmem, "supported", lambda device, interpret: True)
    td.launch(batch, plan, out, lse, config, max_rows=16)  # the pair merge: no reduce
    assert plan.num_partial_rows == 128
    assert shapes == [((128, 16, 512), (128, 16), False), ((1, 16, 512), (1, 16), True)]


@pytest.mark.parametrize("grid, compiled, match", [
    (131, _compiled(), "even number of programs, got 131"),
    (132, _compiled(num_ctas=2, packed_ctas=2), "num_ctas 2"),
    (132, _compiled(shared=1024, packed=(4, 1, 1024, 0)), "launch metadata"),
    (132, _compiled(shared=32768), "needs 33984 bytes of shared memory, the kernel has 32768"),
])
def test_launch_in_pairs_refuses_what_it_cannot_launch(grid, compiled, match):
    kernel = _Kernel(compiled)
    with pytest.raises((ValueError, RuntimeError), match=match):
        dsmem.launch_in_pairs(kernel, grid, (), dict(BLOCK_M=16, L=512))
    assert kernel.grids == []  # nothing launched


def test_stage_bytes_counts_both_halves_and_the_mbarrier():
    # received half [16, 256] fp32 in rows padded by 8 floats + 16 LSEs, the mbarrier padded to 64 bytes, the staged
    # half + LSEs
    assert dsmem.stage_bytes(16, 512) == 2 * (16 * 264 * 4 + 16 * 4) + 64
    assert dsmem.stage_bytes(32, 512) == 2 * (32 * 264 * 4 + 32 * 4) + 64
