"""mla_fast.read_floor on the CPU (the streaming-read kernel under Triton's interpreter, in a subprocess: the
interpreter is chosen when triton is imported) and mla-bench's floor, shared-pages and graph-replay plumbing."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mla_fast import bench, read_floor
from mla_fast.triton_decode import num_sms

ROOT = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import json, torch
    from mla_fast import read_floor as rf
    g = torch.Generator().manual_seed(0)
    n = 3 * 4 * rf.BLOCK - 17  # three blocks per program on 4 programs, the last one short
    x = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    out = torch.full((4,), -1, dtype=torch.int32)
    rf.stream_read(x, out)
    padded = torch.cat([x.long(), torch.zeros(3 * 4 * rf.BLOCK - n, dtype=torch.long)])
    expected = padded.view(3, 4, rf.BLOCK).sum(dim=(0, 2))  # program p sums blocks p, p + 4, p + 8
    fn = rf.read_floor_fn(10, "cpu")
    fn()
    words, programs = fn.buffers
    print(json.dumps({"out": out.tolist(), "expected": expected.tolist(), "words": words.numel(),
                      "programs": programs.numel(), "floor_out": programs.tolist()}))
""")


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_each_program_reads_its_blocks_once(interpreted):
    # exact integer sums: a skipped, repeated or out-of-range block changes some program's sum
    assert interpreted["out"] == interpreted["expected"]


def test_read_floor_fn_rounds_up_to_words_and_runs_a_program_grid(interpreted):
    assert interpreted["words"] == 3  # 10 bytes -> 3 int32 words
    assert interpreted["programs"] == read_floor.PROGRAMS_PER_SM * num_sms(torch.device("cpu"))  # the decode's grid
    assert interpreted["floor_out"] == [0] * interpreted["programs"]  # the buffer is zeros


@pytest.mark.parametrize("x, out, match", [
    (torch.zeros(8), torch.zeros(2, dtype=torch.int32), "x must be a contiguous int32 tensor"),
    (torch.zeros(8, 2, dtype=torch.int32).t(), torch.zeros(2, dtype=torch.int32), "x must be a contiguous int32"),
    (torch.zeros(8, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), "out must be a 1-d int32 tensor"),
    (torch.zeros(8, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), "out must be a 1-d int32 tensor"),
])
def test_stream_read_refuses_bad_buffers(x, out, match):
    with pytest.raises(ValueError, match=match):
        read_floor.stream_read(x, out)


def test_read_floor_fn_refuses_no_bytes():
    with pytest.raises(ValueError, match="nbytes must be >= 1, got 0"):
        read_floor.read_floor_fn(0, "cpu")


def test_cache_bytes_counts_the_cache_elements():
    assert bench.cache_bytes(2, 100, "bf16") == 2 * 100 * 576 * 2
    assert bench.cache_bytes(2, 100, "fp8kv") == bench.cache_bytes(2, 100, "fp8") == 2 * 100 * 576


def test_shared_pages_batch_gives_every_request_the_same_pages():
    b, s, page = 3, 100, 64  # two pages per request, the second one 28 slots short
    batch = bench.build_batch(b, s, 16, "bf16", page_size=page, device="cpu", shared_pages=True)
    assert batch.kv_cache.shape[0] == 2 + 1  # one request's pages and a spare
    assert (batch.block_table == batch.block_table[:1]).all()
    spare = sorted(set(range(3)) - set(batch.block_table[0].tolist()))
    assert torch.isnan(batch.kv_cache[spare].float()).all()
    assert torch.isnan(batch.kv_cache[batch.block_table[0, -1], s - page:].float()).all()  # unused slots poisoned
    out, lse = bench.reference(batch)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()  # no poisoned slot reaches the output
    plain = bench.build_batch(b, s, 16, "bf16", page_size=page, device="cpu")
    assert plain.kv_cache.shape[0] == b * 2 + 1 and plain.block_table.unique().numel() == b * 2


OK = {"status": "ok", "us": 10.0, "us_p20": 9.0, "us_p80": 11.0, "gbs": 1.0, "pct_copy": 1.0}  # a timed row cell


def _table_cells(capsys, rows) -> dict:
    """mla-bench's printed table of `rows` -> {dtype: the cells of its line}."""
    bench.print_table({"device": "test", "copy_gbs": 1.0, "shared_pages": False, "rows": rows})
    lines = capsys.readouterr().out.splitlines()
    return {r["combo"]: [c.strip() for c in next(t for t in lines if r["combo"] in t).split("│")] for r in rows}


def test_bench_table_shows_ours_over_the_read_floor(capsys):
    row = {"b": 1, "s": 64, "h": 16, "combo": "bf16", "ours": OK, "read_floor": {**OK, "us": 8.0},
           "flashinfer": {"status": "not installed"}, "flashmla": {"status": "not installed"},
           "vllm": {"status": "skipped"}}
    cells = _table_cells(capsys, [row])["bf16"]
    assert "8.0" in cells and "1.25" in cells  # read floor µs, ours / floor


def test_bench_table_ratios_take_the_faster_peer_and_dash_what_did_not_run(capsys):
    row = {"b": 1, "s": 64, "h": 16, "combo": "bf16", "ours": OK, "read_floor": {"status": "skipped"},
           "flashinfer": {**OK, "us": 40.0}, "flashmla": {**OK, "us": 25.0}, "vllm": {"status": "n/a"}}
    failed = {**row, "combo": "fp8kv", "ours": {"status": "error: boom"}}
    cells = _table_cells(capsys, [row, failed])
    assert "0.40" in cells["bf16"] and "0.25" not in cells["bf16"]  # ours / the faster peer (25 µs), not the slower
    assert cells["bf16"].count("—") == 2  # ours / floor and vLLM / ours: the floor and vLLM did not run
    assert cells["fp8kv"].count("—") == 5 and "error: boom" in cells["fp8kv"]  # no GB/s, % copy or ratio without
    # our time


def test_bench_diff_vs_ours_only_for_callables_that_hand_out_their_output():
    ours_out = torch.zeros(2, 3, 4, dtype=torch.bfloat16)

    def fn():
        return None

    assert bench.diff_vs_ours(fn, ours_out) == {}  # a peer without outputs
    fn.outputs = (torch.full((2, 3, 4), 0.5, dtype=torch.bfloat16),)
    assert bench.diff_vs_ours(fn, ours_out) == {"max_abs_diff_vs_ours": 0.5}
    assert bench.diff_vs_ours(fn, None) == {}  # ours timed as --candidates: no single output


def test_bench_table_shows_the_graph_step_when_timed(capsys):
    row = {"b": 1, "s": 64, "h": 16, "combo": "bf16", "ours": OK, "read_floor": {"status": "skipped"},
           "flashinfer": {"status": "skipped"}, "flashmla": {"status": "skipped"}, "vllm": {"status": "skipped"},
           "step": {**OK, "us": 17.5, "reduce_pieces": 64}}
    untimed = {**row, "combo": "fp8kv"}
    del untimed["step"]
    cells = _table_cells(capsys, [row, untimed])
    assert "17.5" in cells["bf16"] and "17.5" not in cells["fp8kv"]  # step µs; no column value without --step


@pytest.mark.gpu
def test_read_floor_kernel_on_the_gpu_reads_every_block_once():
    # the compiled kernel (pipelined loads, 2 programs per SM): exact per-program sums over a ragged buffer
    fn = read_floor.read_floor_fn(4 * (5 * read_floor.BLOCK * 7 + 123), "cuda")
    x, out = fn.buffers
    programs = out.numel()
    g = torch.Generator(device="cuda").manual_seed(0)
    x.copy_(torch.randint(0, 1000, x.shape, generator=g, device="cuda", dtype=torch.int32))
    fn()
    iters = -(-x.numel() // (programs * read_floor.BLOCK))
    padded = torch.zeros(iters * programs * read_floor.BLOCK, dtype=torch.long, device="cuda")
    padded[: x.numel()] = x.long()
    expected = padded.view(iters, programs, read_floor.BLOCK).sum(dim=(0, 2))  # program p: blocks p, p + P, ...
    assert torch.equal(out.long(), expected)


def test_shared_pages_refuses_a_request_cache_beyond_half_the_l2():
    l2 = 50 * 2**20  # an H200's L2
    bench.check_shared_pages([(32, 16384, 16)], ["bf16"], l2)  # 18.9 MB of one request: fits
    with pytest.raises(ValueError, match=r"--shared-pages needs one request's cache \(37.7 MB at s_k=32768, bf16\)"):
        bench.check_shared_pages([(1, 32768, 16)], ["fp8kv", "bf16"], l2)


@pytest.mark.gpu
def test_graphed_replay_keeps_the_captured_callable_alive():
    """bench.graphed: the replay holds the callable, so the buffers of its closure outlive the caller's reference
    (a replay on freed, reused buffers reads garbage plans: cudaErrorInvalidAddressSpace on an H200)."""
    import gc
    import weakref

    src = torch.arange(4096, dtype=torch.float32, device="cuda")  # [4096]

    def make():
        dst = torch.zeros_like(src)  # [4096], held only by the closure

        def fn():
            dst.copy_(src * 2)

        return fn, weakref.ref(dst)

    fn, dst_ref = make()
    fn_ref = weakref.ref(fn)
    replay = bench.graphed(fn)
    del fn
    gc.collect()
    assert fn_ref() is not None and dst_ref() is not None
    dst_ref().zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(dst_ref(), src * 2)


class _ZeroingDriver:
    """Stands in for Triton's active driver: its clear_cache zeroes the buffer, as the CUDA driver's does."""

    def clear_cache(self, cache):
        cache.zero_()


def test_read_flush_reads_the_buffer_and_restores_the_zeroing_flush(monkeypatch):
    import triton

    drv = _ZeroingDriver()
    monkeypatch.setattr(triton.runtime.driver, "_active", drv)
    cache = torch.full((64,), 7, dtype=torch.int32)  # [64]
    with bench.read_flush():
        assert int(drv.clear_cache(cache)) == 7 * 64  # the sum over every word: the buffer was read
        assert torch.equal(cache, torch.full_like(cache, 7))  # and not written
        with pytest.raises(RuntimeError, match="already replaced"), bench.read_flush():
            pass
    assert "clear_cache" not in vars(drv)  # the class's method again
    drv.clear_cache(cache)
    assert not cache.any()


def test_time_us_and_mla_bench_refuse_an_unknown_flush():
    with pytest.raises(ValueError, match=r"flush must be one of \('zero', 'read'\), got 'dirty'"):
        bench.time_us(lambda: None, flush="dirty")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--flush", "dirty"])
    assert exit_info.value.code == 2  # argparse's usage error, before any CUDA work


def test_bench_table_title_names_a_read_flush(capsys):
    row = {"b": 1, "s": 64, "h": 16, "combo": "bf16", "ours": OK, "read_floor": {"status": "skipped"},
           "flashinfer": {"status": "skipped"}, "flashmla": {"status": "skipped"}, "vllm": {"status": "skipped"}}
    for flush in bench.FLUSHES:
        bench.print_table({"device": "test", "copy_gbs": 1.0, "shared_pages": False, "flush": flush, "rows": [row]})
        assert ("L2 flushed by a read" in capsys.readouterr().out) == (flush == "read")


@pytest.mark.gpu
def test_read_flush_on_the_gpu_leaves_do_benchs_buffer_unwritten():
    import triton

    drv = triton.runtime.driver.active
    cache = drv.get_empty_cache_for_benchmark().fill_(3)  # do_bench's 256 MB buffer
    with bench.read_flush():
        drv.clear_cache(cache)
        torch.cuda.synchronize()
        assert int(cache.min()) == 3 and int(cache.max()) == 3
        us = bench.time_us(lambda: None, warmup_ms=1, rep_ms=2)  # do_bench's loop runs with the read flush
    assert all(t > 0 for t in us)
    drv.clear_cache(cache)
    assert not cache.any()  # do_bench's own flush again
