"""Untested before a mutation review (sixty-fifth session): mla-bench's CPU-testable logic (mla_fast/vllm_peer.py,
gpu_clocks.py, read_floor.py, bench.py). Each test pins a behaviour that a single source edit changed without any
other test failing (the review's mutants)."""

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from test_vllm_peer import NEW, OLD, _fake_vllm, _vllm_from

from mla_fast import bench, gpu_clocks, vllm_peer
from mla_ref.decode import make_decode_batch

ROOT = Path(__file__).resolve().parent.parent

# ---- vllm_peer -----------------------------------------------------------------------------------------------------

BASE = OLD  # vLLM 0.15; NEW: vLLM 0.33
SCALED = BASE + ", k_scale=None, v_scale=None"  # a vLLM whose function takes the cache scales but not is_mla


def _batch(seq_lens=(5, 9), q_dtype=torch.bfloat16, cache="bf16", page_size=4):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(seq_lens), 16, 576, generator=g).to(q_dtype)  # [T, H, 576], q_len 1
    kv_dtype = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
    kvs = [torch.randn(s, 576, generator=g).to(kv_dtype) for s in seq_lens]  # [s, 576] each
    scales = {"kv_scale": 0.5} if cache == "fp8" else {}
    return make_decode_batch(q, kvs, sm_scale=0.1, kv_lora_rank=512, page_size=page_size, generator=g,
                             q_lens=[1] * len(seq_lens), **scales)


@pytest.mark.parametrize("seq_len, splits", [
    (1023, 1),  # 1023 // 512 = 1
    (1024, 2),
    (4097, 8),  # 4097 // 512 = 8: vLLM floors the tokens per split (a ceiling would give 9 -> 16)
    (8191, 16),  # 15 rounded up to a power of two
])
def test_split_rule_floors_the_tokens_over_512(seq_len, splits):
    assert vllm_peer.num_kv_splits(seq_len, 132) == splits


def test_split_count_follows_the_longest_request(tmp_path, monkeypatch):
    """vLLM's rule reads max_seq_len: requests of 100 and 5000 tokens get 16 splits (5000 // 512 = 9 -> 16), not the
    shortest request's 1."""
    calls = _fake_vllm(tmp_path, monkeypatch, NEW)
    monkeypatch.setattr(vllm_peer, "num_sms", lambda device: 132)  # an H200's SMs: the cap (264) out of the way
    fn = vllm_peer.vllm_fn(_batch(seq_lens=(100, 5000), page_size=64))
    assert calls[0]["num_kv_splits"] == fn.num_kv_splits == 16 and calls[0]["attn_logits"].shape[2] == 16


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_outputs_are_in_q_dtype_and_fp16_q_is_called(tmp_path, monkeypatch, q_dtype):
    """o [B, H, 512] and lse [B, H] preallocated in q's dtype, as vLLM's forward_mqa does (module docstring); an fp16 q
    is a vLLM input (only fp8 q is refused)."""
    calls = _fake_vllm(tmp_path, monkeypatch, NEW)
    fn = vllm_peer.vllm_fn(_batch(q_dtype=q_dtype))
    assert not isinstance(fn, str), fn
    (a,) = calls
    assert a["o"].dtype == a["lse"].dtype == q_dtype
    assert a["o"].shape == (2, 16, 512) and a["lse"].shape == (2, 16)
    assert a["attn_logits"].dtype == torch.float32


def test_an_fp8_cache_goes_to_a_vllm_that_takes_k_scale_without_is_mla(tmp_path, monkeypatch):
    """"an fp8 cache only where the function takes `k_scale`" (module docstring): a function with k_scale / v_scale
    but no is_mla gets the cache scale and the legacy 4 splits, and no is_mla argument."""
    calls = _fake_vllm(tmp_path, monkeypatch, SCALED)
    fn = vllm_peer.vllm_fn(_batch(cache="fp8"))
    assert not isinstance(fn, str), fn
    (a,) = calls
    assert float(a["k_scale"]) == float(a["v_scale"]) == 0.5
    assert a["num_kv_splits"] == 4 and "is_mla" not in a


def test_an_empty_src_variable_reads_as_unset(monkeypatch):
    """MLA_BENCH_VLLM_SRC="" is no file named: the peer is "not installed", not a ValueError (as an empty
    MLA_BENCH_VLLM_SPLITS is unset)."""
    _vllm_from(monkeypatch, "")
    reason = vllm_peer.load_decode_attention_fwd()
    assert isinstance(reason, str) and reason.startswith("not installed")


def test_a_vllm_that_fails_to_import_is_not_installed(tmp_path, monkeypatch):
    """An installed vLLM that raises something else than ImportError on import (no CUDA on this machine, e.g.) is
    reported like an absent one, with the error's type, not raised."""
    pkg = tmp_path / "mla_review_broken_vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text("raise RuntimeError('no CUDA here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(vllm_peer, "MODULE", "mla_review_broken_vllm.ops")
    monkeypatch.delenv(vllm_peer.ENV_SRC, raising=False)
    reason = vllm_peer.load_decode_attention_fwd()
    assert isinstance(reason, str) and reason.startswith("not installed") and "RuntimeError" in reason


@pytest.mark.parametrize("value", ["RULE", "Rule", " rule"])
def test_split_override_is_the_exact_word_rule(tmp_path, monkeypatch, value):
    _fake_vllm(tmp_path, monkeypatch, NEW)
    monkeypatch.setenv(vllm_peer.ENV_SPLITS, value)
    with pytest.raises(ValueError, match="MLA_BENCH_VLLM_SPLITS must be 'rule' or a positive integer"):
        vllm_peer.vllm_fn(_batch())


# ---- gpu_clocks ----------------------------------------------------------------------------------------------------

def test_reason_shares_count_only_the_samples_with_bits():
    """A reason's share is over the samples whose reasons field was read (summarize's docstring), not all samples."""
    samples = [(0.0, 1800.0, 600.0, 0x4), (0.05, 1700.0, 650.0, None), (0.1, 1750.0, 640.0, 0x0)]
    assert gpu_clocks.summarize(samples)["reasons"] == {"sw_power_cap": 0.5}


def test_sampler_command_names_the_board_and_the_period(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    sampler = gpu_clocks.ClockSampler(gpu="GPU-5f0c", period_ms=20)
    assert sampler.available
    assert sampler.command == ["/usr/bin/nvidia-smi", "-i", "GPU-5f0c", f"--query-gpu={gpu_clocks.QUERY}",
                               "--format=csv,noheader,nounits", "-lms=20"]


def test_reason_bits_are_nvmls():
    """NVML's nvmlClocksEventReason* constants (nvml.h): GpuIdle 0x1, ApplicationsClocksSetting 0x2, SwPowerCap 0x4,
    HwSlowdown 0x8, SyncBoost 0x10, SwThermalSlowdown 0x20, HwThermalSlowdown 0x40, HwPowerBrakeSlowdown 0x80,
    DisplayClockSetting 0x100."""
    assert [gpu_clocks.reason_names(1 << i) for i in range(9)] == [
        ["gpu_idle"], ["applications_clocks"], ["sw_power_cap"], ["hw_slowdown"], ["sync_boost"], ["sw_thermal"],
        ["hw_thermal"], ["hw_power_brake"], ["display_clocks"]]


# ---- read_floor ----------------------------------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import json, torch
    from mla_fast import read_floor as rf
    rf.BLOCK = 16  # small blocks: the same indexing, a fast interpreter run
    g = torch.Generator().manual_seed(0)
    n = 3 * 4 * rf.BLOCK - 5  # the last block 5 words short
    big = torch.randint(0, 1000, (n + 8,), generator=g, dtype=torch.int32)
    big[n:] = 10**6  # words just past x: a read beyond x's end adds 10**6 to some program's sum
    x = big[:n]  # contiguous, followed in memory by the words above
    out = torch.full((4,), -1, dtype=torch.int32)
    rf.stream_read(x, out)
    print(json.dumps({"total": int(out.long().sum()), "expected": int(x.long().sum())}))
""")


def test_stream_read_stops_at_the_last_word():
    """x a prefix of a larger buffer: the kernel's mask keeps its loads inside x (Triton's interpreter, in a
    subprocess as tests/test_read_floor.py runs it); exact integer sums."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["total"] == got["expected"]


# ---- bench ---------------------------------------------------------------------------------------------------------

def test_copy_bandwidth_counts_bytes_read_and_written(monkeypatch):
    """peers.md §3: the copy rate is (read + written) bytes / time, in GB of 1e9 bytes."""
    fake_torch = types.SimpleNamespace(uint8=torch.uint8, empty=lambda n, dtype, device: torch.empty(1, dtype=dtype),
                                       empty_like=torch.empty_like)
    monkeypatch.setattr(bench, "torch", fake_torch)  # no 2 GB CUDA buffers
    monkeypatch.setattr(bench, "time_us", lambda fn: (500.0, 490.0, 510.0))  # 500 µs median
    # 2 * 1e9 B / 500e-6 s = 4000 GB/s; 3 fp64 operations: a few ulps
    assert bench.copy_bandwidth_gbs(10**9) == pytest.approx(4000.0, rel=4 * 2**-52)


class FakeTimer:
    def __init__(self):
        self.calls = []

    def __call__(self, fn, rep_ms):
        self.calls.append(fn())
        return [1.0]


def test_rounds_keep_rotating_past_the_number_of_callables(monkeypatch):
    """Round r starts at callable r % n: with 2 callables and 4 rounds, a b / b a / a b / b a."""
    monkeypatch.setattr(bench, "GRAPHS", False)
    timer = FakeTimer()
    bench.measure_in_rounds({"a": lambda: "a", "b": lambda: "b"}, nbytes=1, copy_gbs=1.0, rounds=4, timer=timer)
    assert timer.calls == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_a_row_of_reasons_only_reports_them():
    """Every callable a reason string (nothing to time): their statuses, no rounds run."""
    got = bench.measure_in_rounds({"ours": "error: boom", "vllm": "not installed"}, nbytes=1, copy_gbs=1.0, rounds=3,
                                  timer=FakeTimer())
    assert got == {"ours": {"status": "error: boom"}, "vllm": {"status": "not installed"}}


def test_shared_pages_accept_a_cache_of_exactly_half_the_l2():
    need = bench.cache_bytes(1, 4096, "bf16")
    bench.check_shared_pages([(8, 4096, 16)], ["bf16"], 2 * need)  # fits: half the L2 exactly
    with pytest.raises(ValueError, match="--shared-pages needs"):
        bench.check_shared_pages([(8, 4096, 16)], ["bf16"], 2 * need - 1)


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "0,8192,16"], "--shapes must be"),
    (["--shapes", "1,0,16"], "--shapes must be"),
    (["--peers", "flashinfer,bogus"], "--peers must be a comma list"),
    (["--peers", ""], "--peers must be a comma list"),  # had meant every peer
    (["--peers", "flashmla,flashmla"], "--peers must be a comma list"),
    (["--dtypes", "bf16,bf16"], "--dtypes must be a comma list"),  # had timed every row twice
])
def test_bench_usage_errors(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_bench_flags_set_the_flush_and_graph_mode(monkeypatch):
    """--flush and --eager reach the module's FLUSH and GRAPHS (read by time_samples_us and prepare); checked on a
    machine without CUDA, where main stops after setting them."""
    monkeypatch.setattr(bench, "FLUSH", "zero")
    monkeypatch.setattr(bench, "GRAPHS", True)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--flush", "read", "--eager"])
    assert bench.FLUSH == "read" and bench.GRAPHS is False


def test_clock_cell_of_a_window_without_samples():
    assert bench.clock_cell({"samples": 0}) == "no samples"


def test_add_clocks_says_when_nothing_was_sampled(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.ClockSampler() as sampler:
        pass
    result = {"rows": [{"timed_window": [0.0, 1.0]}]}
    bench.add_clocks(result, sampler)
    assert result["clocks"] == {"sampled": False, "reason": "nvidia-smi not found"}
    assert result["rows"][0]["clocks"] == {"status": "nvidia-smi not found"}


def test_bench_table_ours_cells_in_order(capsys):
    ours = {"status": "ok", "us": 10.0, "us_p20": 9.0, "us_p80": 11.5, "gbs": 1234.0, "pct_copy": 29.0}
    row = {"b": 1, "s": 64, "h": 16, "combo": "bf16", "ours": ours, "read_floor": {"status": "skipped"},
           "flashinfer": {"status": "skipped"}, "flashmla": {"status": "skipped"}, "vllm": {"status": "skipped"}}
    bench.print_table({"device": "test", "copy_gbs": 1.0, "rows": [row]})
    line = next(t for t in capsys.readouterr().out.splitlines() if "bf16" in t)
    cells = [c.strip() for c in line.split("│")]
    assert cells[5:8] == ["10.0 (9.0–11.5)", "1234", "29"], cells  # µs (20–80 %), GB/s, % copy


def test_diff_vs_ours_is_the_largest_absolute_difference_of_out():
    """max |out - our out| over the first output (out [T, H, L]), whatever its sign; lse (the second) is not out."""
    ours_out = torch.zeros(2, 3, 4, dtype=torch.bfloat16)  # [T, H, L]
    out = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    out[1, 2, 3] = -0.75
    out[0, 0, 0] = 0.25

    def fn():
        return None

    fn.outputs = (out, torch.full((2, 3), 9.0))  # (out [T, H, L], lse [T, H])
    assert bench.diff_vs_ours(fn, ours_out) == {"max_abs_diff_vs_ours": 0.75}


class _ZeroingDriver:
    def clear_cache(self, cache):
        cache.zero_()


def test_time_samples_are_microseconds_and_follow_the_module_flush(monkeypatch):
    """do_bench's milliseconds -> µs; flush=None takes the module's FLUSH (mla-bench --flush)."""
    import triton

    drv = _ZeroingDriver()
    monkeypatch.setattr(triton.runtime.driver, "_active", drv)
    seen = []

    def do_bench(fn, warmup, rep, return_mode):
        seen.append("clear_cache" in vars(drv))  # read_flush swaps the driver's clear_cache while do_bench runs
        return [0.25, 0.5]  # ms, exact in binary

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(bench, "FLUSH", "read")
    assert bench.time_samples_us(lambda: None) == [250.0, 500.0]
    monkeypatch.setattr(bench, "FLUSH", "zero")
    bench.time_samples_us(lambda: None)
    assert seen == [True, False]
