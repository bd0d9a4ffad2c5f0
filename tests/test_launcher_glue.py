"""The host-side glue of the Triton decode launcher and of the pair merge (mla_fast.dsmem), held against values
derived here from their docstrings: when clusters are supported, the pair merge's shared-memory floor at its exact
boundary and for its own BLOCK_M, KernelConfig's refusals, the reduce's step shapes at their boundaries, the dtype
combinations and batch checks, the workspace sizes, and what TritonMLADecode's plan() refuses and leaves in its
static buffers. Nothing here launches a kernel: launches are intercepted (monkeypatch) or not reached.
"""

import re
from types import SimpleNamespace

import pytest
import torch

from mla_fast import dsmem
from mla_fast import triton_decode as td
from mla_ref.decode import make_decode_batch

SM_SCALE = 0.1352338


def _batch(seed, seq_lens, q_lens, heads=16, page_size=64, L=512, R=64, q_dtype=torch.bfloat16,
           kv_dtype=torch.bfloat16):
    """A DecodeBatch from a local generator (values within +-200 so that every fp8 format holds them)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(sum(q_lens), heads, L + R, generator=g) * 4).clamp(-200, 200).to(q_dtype)
    kv = (torch.randn(sum(seq_lens), L + R, generator=g) * 4).clamp(-200, 200).to(kv_dtype)
    scales = {}
    if q_dtype not in (torch.bfloat16, torch.float16):
        scales["q_scale"] = 0.5
    if kv_dtype not in (torch.bfloat16, torch.float16):
        scales["kv_scale"] = 0.25
    return make_decode_batch(q, list(torch.split(kv, list(seq_lens))), sm_scale=SM_SCALE, kv_lora_rank=L,
                             page_size=page_size, generator=g, q_lens=list(q_lens), **scales)


# ---- dsmem --------------------------------------------------------------------------------------------------------


@pytest.fixture
def hopper(monkeypatch):
    """dsmem.supported's view of a CUDA sm_90 device with Triton 3.6 (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(dsmem.triton, "__version__", "3.6.0")
    return monkeypatch


def test_clusters_need_cuda_sm90_triton_36_and_no_interpreter(hopper):
    """The pair merge's clusters, distributed shared memory and bulk copies: sm_90 and newer (not sm_80), CUDA not
    ROCm, not under the interpreter, and Triton 3.6's launcher (whose packed launch metadata launch_in_pairs sets)."""
    cuda = torch.device("cuda")
    assert dsmem.supported(cuda, False) and not dsmem.supported(cuda, True)
    assert not dsmem.supported(torch.device("cpu"), False)
    hopper.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not dsmem.supported(cuda, False)
    hopper.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert dsmem.supported(cuda, False)
    hopper.setattr(torch.version, "hip", "6.2")
    assert not dsmem.supported(cuda, False)
    hopper.setattr(torch.version, "hip", None)
    hopper.setattr(dsmem.triton, "__version__", "3.5.1")
    assert not dsmem.supported(cuda, False)


class _Compiled(SimpleNamespace):
    """A compiled Triton kernel's stand-in: [grid](*args) records each launch."""

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Kernel:
    """A JITFunction's stand-in whose warmup returns `compiled`."""

    arg_names = ["X", "BLOCK_M", "L"]

    def __init__(self, shared):
        meta = SimpleNamespace(num_warps=4, num_ctas=1, shared=shared)
        self.compiled = _Compiled(metadata=meta, packed_metadata=(4, 1, shared), launches=[])

    def warmup(self, *args, grid, **kwargs):
        return self.compiled


@pytest.mark.parametrize("block_m", [16, 32])
def test_launch_in_pairs_needs_the_stage_bytes_of_its_own_tile_and_no_more(block_m):
    """The pair merge stages [BLOCK_M, L / 2 + ROW_PAD] fp32 plus an LSE [BLOCK_M] each way and a 64-byte mbarrier
    from offset 0: a kernel with exactly that much shared memory launches, one byte less is refused. The need is the
    launch's BLOCK_M's (32 rows stage twice what 16 do)."""
    need = 2 * (block_m * (512 // 2 + 8) * 4 + block_m * 4) + 64  # stage_bytes' docstring, written out
    kernel = _Kernel(need)
    dsmem.launch_in_pairs(kernel, 4, ("x",), dict(BLOCK_M=block_m, L=512))
    assert kernel.compiled.launches == [((2, 1, 1), ("x", block_m, 512))]
    with pytest.raises(RuntimeError, match=f"needs {need} bytes of shared memory, the kernel has {need - 1}"):
        dsmem.launch_in_pairs(_Kernel(need - 1), 4, ("x",), dict(BLOCK_M=block_m, L=512))


# ---- KernelConfig, reduce shapes, dtypes, batch checks --------------------------------------------------------------


@pytest.mark.parametrize("fields, match", [
    (dict(block_n=8), "block_n must be a power of two >= 16"),  # tl.dot takes no tile narrower than 16
    (dict(gather_chunk_pages=0), "gather_chunk_pages must be >= 1"),
    (dict(qk_fp8=True), "qk_fp8 .* is a kernel='gluon_fp8' option"),
])
def test_kernel_config_refuses_what_no_kernel_launches(fields, match):
    """KernelConfig refuses, by field, values no kernel takes: tiles below 16 tokens, a block-table chunk of no
    pages, fp8 score MMAs on a kernel that has none."""
    with pytest.raises(ValueError, match=match):
        td.KernelConfig(**fields)


def test_reduce_step_shapes_at_their_bounds():
    """reduce_blocks: BLOCK_S the pieces rounded up to a power of two (at most 64) and BLOCK_L = 2048 / BLOCK_S
    channels, at most kv_lora_rank (else the reduce's grid of L / BLOCK_L channel blocks would be empty).
    plan_reduce_pieces keeps a step while the grid, split_tiles x rows x L / BLOCK_L programs, is at most 16 per SM
    (equal stays), and halves it past that. reduce_rows: max_rows for each of head_split programs."""
    assert td.reduce_blocks(2, 512) == (2, 512) and td.reduce_blocks(1, 64) == (1, 64)
    assert td.reduce_blocks(16, 512) == (16, 128) and td.reduce_blocks(100, 512) == (64, 32)
    # 8 pieces: BLOCK_L 256, two channel blocks; one row per tile on one SM: 16 programs allowed
    assert td.plan_reduce_pieces(SimpleNamespace(split_tiles=8, max_pieces=8), 1, 512, 1) == 8  # 8 x 2 = 16
    assert td.plan_reduce_pieces(SimpleNamespace(split_tiles=9, max_pieces=8), 1, 512, 1) == 4  # 18 > 16: halved
    assert td.reduce_rows(td.KernelConfig(head_split=2), 16) == 32


def test_latent_slices_and_tiles_in_pages():
    """effective_split_l halves split_l only while a slice would be narrower than 16 channels (16 is allowed);
    tiles_in_pages needs both the page size and the planner's block (where items start) to be multiples of
    block_n."""
    assert td.effective_split_l(td.KernelConfig(split_l=4), 64) == 4  # 4 slices of 16
    assert td.effective_split_l(td.KernelConfig(split_l=8), 64) == 4  # 8 slices of 8 -> 4 of 16
    config = td.KernelConfig(block_n=64)
    assert td.tiles_in_pages(config, 64, 64) and td.tiles_in_pages(config, 128, 128)
    assert not td.tiles_in_pages(config, 64, 32) and not td.tiles_in_pages(config, 32, 64)


def test_dtype_combinations_and_their_numerics_refuse_by_name(monkeypatch):
    """dtype_combo: fp8 q needs a cache of its own fp8 format (e4m3fn q on an e4m3fnuz cache is no combination).
    kernel_numerics refuses an unknown combo, and the Gluon fp8 kernel's fp8 score MMAs (qk_fp8) outside e4m3fn q or
    off DeepSeek's 576 channels. e4m3fnuz is refused under the interpreter even on ROCm (Triton's interpreter has
    no fp8e4b8), and taken on ROCm outside it."""
    fn, fnuz = torch.float8_e4m3fn, torch.float8_e4m3fnuz
    assert td.dtype_combo(fn, fn) == "fp8" and td.dtype_combo(fnuz, fnuz) == "fp8"
    with pytest.raises(ValueError, match="bf16/bf16, bf16/fp8 or fp8/fp8"):
        td.dtype_combo(fn, fnuz)
    with pytest.raises(ValueError, match="combo must be one of"):
        td.kernel_numerics(td.KernelConfig(), "fp16")
    qk = td.KernelConfig(kernel="gluon_fp8", mma="fp16", block_n=64, qk_fp8=True)
    with pytest.raises(ValueError, match="needs e4m3fn q"):
        td.kernel_numerics(qk, "fp8kv")
    with pytest.raises(ValueError, match="takes L \\+ R = 576"):
        td.kernel_numerics(qk, "fp8", 288)
    batch = _batch(1, (70,), (1,), q_dtype=fnuz, kv_dtype=fnuz)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(td, "INTERPRET", True)
    assert "e4m3fnuz runs on ROCm only" in td.dtypes_unsupported(batch)
    monkeypatch.setattr(td, "INTERPRET", False)
    assert td.dtypes_unsupported(batch) is None


def test_check_batch_refuses_a_small_rope_and_a_cache_of_another_width():
    """check_batch: the rope (like the latent) is a power of two of at least 16 channels (a tl.dot operand), and the
    cache rows are as wide as q's head dim."""
    with pytest.raises(ValueError, match="rope_dim must be a power of two >= 16"):
        td.check_batch(_batch(2, (70, 5), (1, 1), R=8))
    batch = _batch(2, (70, 5), (1, 1))
    with pytest.raises(ValueError, match="kv_cache last dim must equal q's head_dim 576, got 512"):
        td.check_batch(batch.replace(kv_cache=batch.kv_cache[..., :512].contiguous()))


def test_check_batch_refuses_a_cache_on_another_device_than_q():
    """The device check, on the meta device (no second GPU here; check_batch reads no values): a launcher called
    without DecodeBatch.validate (which checks devices first) still refuses it by name."""
    batch = _batch(2, (70, 5), (1, 1))
    with pytest.raises(ValueError, match="q and kv_cache must be on one device, got cpu and meta"):
        td.check_batch(batch.replace(kv_cache=batch.kv_cache.to("meta")))


def test_scales_and_workspaces_have_their_documented_sizes():
    """_scale_tensor: a per-tensor fp32 [1], 1.0 for None, a one-element tensor reshaped, more elements refused.
    alloc_workspace: the plan's partial rows, one stand-in row where it has none or the pair merge writes none."""
    assert td._scale_tensor(None, torch.device("cpu")).tolist() == [1.0]
    assert td._scale_tensor(torch.tensor(0.25), torch.device("cpu")).tolist() == [0.25]
    with pytest.raises(ValueError, match="per-tensor"):
        td._scale_tensor(torch.ones(2), torch.device("cpu"))
    cpu = torch.device("cpu")
    for rows, pair, expect in ((0, False, 1), (5, False, 5), (5, True, 1)):
        o, lse = td.alloc_workspace(SimpleNamespace(num_partial_rows=rows), 16, 512, cpu, pair)
        assert tuple(o.shape) == (expect, 16, 512) and tuple(lse.shape) == (expect, 16)
        assert o.dtype == lse.dtype == torch.float32
    assert td.num_sms(cpu) == 4  # the interpreter's persistent grid (num_sms' docstring)


# ---- launches, intercepted ------------------------------------------------------------------------------------------


class _Launches:
    """A Triton kernel's stand-in: kernel[grid](*args, **kwargs) records (grid, kwargs)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, kwargs))


@pytest.fixture
def launches(monkeypatch):
    decode, reduce = _Launches(), _Launches()
    monkeypatch.setattr(td, "_mla_decode_kernel", decode)
    monkeypatch.setattr(td, "_mla_reduce_kernel", reduce)
    return decode, reduce


def _outputs(batch):
    return (torch.empty(batch.q.shape[0], batch.num_heads, 512, dtype=torch.bfloat16),
            torch.empty(batch.q.shape[0], batch.num_heads))


def test_launch_sizes_the_decode_tile_and_the_reduce_grid_from_its_rows(launches):
    """A split plan on head_split 2 and 4 packed rows: the decode's M tile is 16 rows (tl.dot's smallest, never
    8), its grid workers x head_split programs; the reduce runs over the split tiles x max_rows x head_split rows x
    L / BLOCK_L channel blocks, with the pieces per step given (16: BLOCK_S 16, BLOCK_L 2048 / 16 = 128)."""
    decode, reduce = launches
    batch = _batch(3, (4096,), (1,))
    config = td.KernelConfig(head_group=8, head_split=2)
    plan = td.make_plan(batch, config, 8)
    assert plan.split_tiles == 1 and plan.num_partial_rows > 0
    td.launch(batch, plan, *_outputs(batch), config, max_rows=4, reduce_pieces=16)
    (grid, kw), = decode.calls
    assert grid == (16,) and kw["BLOCK_M"] == 16 and kw["HEAD_SPLIT"] == 2 and kw["PDL"] is False
    (rgrid, rkw), = reduce.calls
    assert rgrid == (1, 4 * 2, 512 // 128) and (rkw["BLOCK_S"], rkw["BLOCK_L"]) == (16, 128)
    assert rkw["IDLE_EXIT"] is False


def test_a_graph_steps_launch_reads_worker_ranges_and_reduces_in_its_own_step_shape(launches):
    """TritonMLADecode.run(): the decode reads worker_indptr (ONE_ITEM False: a captured graph must take any later
    plan) and the reduce spans the step's capacity of tiles in steps of the step's reduce_pieces (32 here: BLOCK_S
    32, BLOCK_L 64), its idle programs exiting at once."""
    decode, reduce = launches
    batch = _batch(4, (4096, 70), (1, 1))
    step = td.TritonMLADecode(batch, config=td.KernelConfig(), num_workers=8, reduce_pieces=32)
    step.plan()
    step.run()
    (grid, kw), = decode.calls
    assert grid == (8,) and kw["ONE_ITEM"] is False and kw["PAIR_MERGE"] is False
    (rgrid, rkw), = reduce.calls
    assert rgrid == (step.reduce_final.shape[0], 16, 512 // 64)
    assert (rkw["BLOCK_S"], rkw["BLOCK_L"], rkw["IDLE_EXIT"]) == (32, 64, True)


def test_the_pair_merge_launch_takes_no_programmatic_dependent_launch(monkeypatch, launches):
    """With the pair merge no reduce follows, so the decode is launched without griddepcontrol (PDL False) even
    where PDL is on; without it the decode takes the PDL asked for."""
    decode, _ = launches
    seen = []
    monkeypatch.setattr(dsmem, "launch_in_pairs", lambda kernel, ctas, args, kwargs: seen.append((ctas, kwargs)))
    batch = _batch(5, (4096,), (1,))
    config = td.KernelConfig()
    plan = td.make_plan(batch, config, 8)
    out, lse = _outputs(batch)
    o_part, lse_part = td.alloc_workspace(plan, 16, 512, batch.device, False)
    ones = torch.ones(1)
    common = (batch, plan, out, lse, o_part, lse_part, ones, ones, config, batch.qo_indptr, 16)
    td._launch_triton(*common, True, 8, pair_merge=True)
    (ctas, kw), = seen
    assert ctas == 8 and kw["PAIR_MERGE"] is True and kw["PDL"] is False
    td._launch_triton(*common, True, 8, pair_merge=False)
    assert decode.calls[0][1]["PDL"] is True


def test_decode_refuses_an_fp32_out_for_a_gluon_kernel():
    """The Gluon kernels write bf16 only: a preallocated fp32 out (which the Triton kernel takes) is refused by name
    before anything launches."""
    batch = _batch(6, (70,), (1,))
    out = torch.empty(1, 16, 512)
    with pytest.raises(ValueError, match="out must be torch.bfloat16 for kernel 'gluon'"):
        td.decode(batch, out=out, config=td.KernelConfig(kernel="gluon"))


def test_decode_invariant_hands_decode_a_contiguous_q(monkeypatch):
    """decode_invariant copies a strided q (one whose last dim is strided too, which the kernels cannot take) before
    decoding: the q decode receives is contiguous and holds the same values."""
    seen = []
    monkeypatch.setattr(td, "decode", lambda batch, **kw: seen.append(batch))
    batch = _batch(7, (70, 5), (1, 1))
    wide = torch.stack([batch.q, batch.q], -1)  # [T, H, D, 2]
    strided = batch.replace(q=wide[..., 0])  # stride(-1) == 2
    assert strided.q.stride(-1) == 2
    td.decode_invariant(strided)
    assert seen[0].q.is_contiguous() and torch.equal(seen[0].q, batch.q)


# ---- TritonMLADecode: plan() refusals and static buffers ------------------------------------------------------------


def test_graph_step_refuses_splits_off_its_blocks_and_plans_above_its_capacities():
    """TritonMLADecode refuses split_tokens that are not a multiple of the planner's block, and plan() refuses a
    plan needing more work items or more partial rows than the step's buffers hold."""
    batch = _batch(8, (4096, 70), (1, 1))
    config = td.KernelConfig()
    with pytest.raises(ValueError, match="split_tokens must be a multiple of the config's plan_block_n"):
        td.TritonMLADecode(batch, config=config, num_workers=8, split_tokens=100)
    with pytest.raises(ValueError, match="above this step's capacities"):
        td.TritonMLADecode(batch, config=config, num_workers=8, max_items=1).plan()
    with pytest.raises(ValueError, match="partial rows, capacity 1"):
        td.TritonMLADecode(batch, config=config, num_workers=8, max_partial_rows=1).plan()


def test_graph_steps_default_partial_rows_hold_q_len_rows_per_piece():
    """Each split piece writes one partial row per query row: the default capacity (max_q_len x (items + workers))
    takes a q_len-4 request cut into a piece per worker (4 x 8 = 32 rows), which items + workers (25) would not."""
    batch = _batch(9, (8192,), (4,))
    step = td.TritonMLADecode(batch, max_q_len=4, config=td.KernelConfig(), num_workers=8)
    step.plan()
    need = td.make_plan(batch, step.config, 8).num_partial_rows
    assert need == 4 * 8 and step.workspace[0].shape[0] >= need


def test_graph_step_plan_copies_a_new_q_scale_and_validates_the_batch():
    """plan(batch) with new per-tensor scales copies them into the step's scale buffers (q's and the cache's), and
    a plan() that reads the lengths from the device validates the batch first (a block-table entry outside the
    cache refused, not handed to the kernel)."""
    fn = torch.float8_e4m3fn
    batch = _batch(11, (70, 5), (1, 1), q_dtype=fn, kv_dtype=fn)
    step = td.TritonMLADecode(batch, config=td.KernelConfig(mma="fp16"), num_workers=4)
    step.plan(batch.replace(q_scale=0.125, kv_scale=0.0625))
    assert step.q_scale.tolist() == [0.125] and step.kv_scale.tolist() == [0.0625]
    batch.block_table[0, 0] = batch.kv_cache.shape[0] + 5
    with pytest.raises(ValueError, match="block_table"):
        step.plan()


def test_graph_step_numerics_count_the_batch_channels():
    """A step's declared rounding points are the Triton kernel's for its own L + R (288 at MiniCPM3's 256 / 32), not
    DeepSeek's 576."""
    batch = _batch(12, (70,), (1,), L=256, R=32)
    config = td.KernelConfig()
    step = td.TritonMLADecode(batch, config=config, num_workers=4)
    assert step.numerics == td.triton_numerics(config.mma, config.block_n, 288)
    assert step.numerics != td.triton_numerics(config.mma, config.block_n, 576)


def test_more_query_rows_than_a_program_packs_are_refused_by_name():
    """A program packs q_len x heads <= 64 rows with one head at least: q_len 65 is a named ValueError in decode,
    the graph step and default_config (it was `max() arg is an empty sequence` from the head-group search), and
    Unsupported, before any launch, in the backends that run our kernels (run, numerics and step)."""
    from mla_fast.backends import BACKENDS, Unsupported

    g = torch.Generator().manual_seed(0)
    q = torch.randn(66, 2, 96, generator=g).to(torch.bfloat16)  # [T, H, L + R]
    kv = [torch.randn(s, 96, generator=g).to(torch.bfloat16) for s in (70, 3)]  # 2 x [s_b, L + R]
    batch = make_decode_batch(q, kv, sm_scale=0.1, kv_lora_rank=64, page_size=16, generator=g, q_lens=[65, 1])
    message = "q_len must be <= 64 (a program packs q_len x heads rows, at most 64), got 65"
    for call in (lambda: td.decode(batch), lambda: td.TritonMLADecode(batch, max_q_len=65),
                 lambda: td.default_config("bf16", 2, 65)):
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    assert td.q_len_unsupported(64) is None and td.default_config("bf16", 1, 64).head_group == 1
    for backend in (BACKENDS[name] for name in ("triton", "seesaw", "gluon_fp8")):
        for call, args in ((backend.run, (batch,)), (backend.numerics, (batch,)), (backend.step, (batch, 65))):
            with pytest.raises(Unsupported, match=r"^q_len must be <= 64 \(a program packs"):
                call(*args)
