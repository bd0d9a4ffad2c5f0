"""mla_fast.gpu_clocks on the CPU: nvidia-smi's lines parsed, a sampler fed by a stand-in process, the windows that
mla-bench's rows read, and the reasons given when there is nothing to sample."""

import datetime
import sys
import time

import pytest

from mla_fast import bench, gpu_clocks


def epoch(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()


LINES = ["2026/12/01 00:00:00.000, 1980, 120.50, 0x0000000000000001",  # idle
         "2026/12/01 00:00:00.050, 1725, 699.00, 0x0000000000000004",  # at the power cap
         "2026/12/01 00:00:00.100, 1590, 686.25, 0x000000000000000C",  # power cap and hardware slowdown
         "[N/A], [N/A], [N/A], [N/A]",
         "2026/12/01 00:00:00.150, 1965, 300.00, 0x0000000000000000"]


def test_parse_line():
    assert gpu_clocks.parse_line(LINES[1]) == (epoch("2026/12/01 00:00:00.050"), 1725.0, 699.0, 4)
    assert gpu_clocks.parse_line(LINES[3]) is None  # a field nvidia-smi could not read
    assert gpu_clocks.parse_line("2026/12/01 00:00:00.050, 1725, 699.00")[3] is None  # no reasons field
    assert gpu_clocks.parse_line("2026/12/01 00:00:00.050, 1725, 699.00, [N/A]")[3] is None
    assert gpu_clocks.parse_line("1965, 669.63") is None  # no timestamp
    assert gpu_clocks.parse_line("") is None


def test_reason_names():
    assert gpu_clocks.reason_names(0) == []
    assert gpu_clocks.reason_names(0x4) == ["sw_power_cap"]
    assert gpu_clocks.reason_names(0xC) == ["sw_power_cap", "hw_slowdown"]
    assert gpu_clocks.reason_names(0x80 | 0x1000) == ["hw_power_brake", "0x1000"]  # an unnamed bit kept as hex
    assert all(bit & (bit - 1) == 0 for bit in gpu_clocks.REASONS)  # one bit each


def test_sampler_windows_from_a_stand_in_process():
    script = "import sys\n" + "".join(f"print({line!r}, flush=True)\n" for line in LINES)
    with gpu_clocks.ClockSampler(command=[sys.executable, "-c", script]) as sampler:
        deadline = time.time() + 20
        while len(sampler.samples) < 4 and time.time() < deadline:
            time.sleep(0.05)
    assert sampler.available and len(sampler.samples) == 4  # the [N/A] line dropped
    w = sampler.window(epoch("2026/12/01 00:00:00.040"), epoch("2026/12/01 00:00:00.110"))
    assert w == {"sm_mhz_median": 1657.5, "sm_mhz_min": 1590.0, "power_w_max": 699.0, "samples": 2,
                 "reasons": {"sw_power_cap": 1.0, "hw_slowdown": 0.5}}
    assert sampler.window(0.0, 1.0) == {"samples": 0}

    result = {"rows": [{"timed_window": [epoch("2026/12/01 00:00:00.000"), epoch("2026/12/01 00:00:00.150")]},
                       {"combo": "a row timed as candidates has no window"}]}
    bench.add_clocks(result, sampler)
    assert result["clocks"] == {"sampled": True, "reason": None}
    clocks = result["rows"][0]["clocks"]
    assert clocks["sm_mhz_min"] == 1590.0 and clocks["samples"] == 4
    assert clocks["reasons"] == {"sw_power_cap": 0.5, "gpu_idle": 0.25, "hw_slowdown": 0.25}
    assert "clocks" not in result["rows"][1]
    # median of 1590, 1725, 1965, 1980; an idle GPU is not shown
    assert bench.clock_cell(clocks) == "1845 (1590) sw_power_cap 50% hw_slowdown 25%"


def test_samples_without_reasons_summarize_to_none():
    samples = [(0.0, 1980.0, 100.0, None), (0.05, 1725.0, 699.0, None)]
    assert gpu_clocks.summarize(samples)["reasons"] is None
    assert bench.clock_cell(gpu_clocks.summarize(samples)) == "1852 (1725)"
    assert gpu_clocks.summarize([(0.0, 1980.0, 100.0, 0)])["reasons"] == {}


def test_without_nvidia_smi_the_windows_say_why(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.ClockSampler() as sampler:
        pass
    assert not sampler.available
    assert sampler.window(0.0, 1.0) == {"status": "nvidia-smi not found"}
    assert bench.clock_cell(sampler.window(0.0, 1.0)) == "nvidia-smi not found"

    with gpu_clocks.ClockSampler(command=["/nonexistent/nvidia-smi"]) as broken:
        pass
    assert broken.window(0.0, 1.0)["status"].startswith("nvidia-smi failed to start")

    with gpu_clocks.ClockSampler(command=[sys.executable, "-c", "pass"]) as silent:
        pass
    assert silent.window(0.0, 1.0) == {"status": f"nvidia-smi gave no samples of {gpu_clocks.QUERY}"}


@pytest.mark.parametrize("uuid,expected", [(None, "3"), ("5f0c-11", "GPU-5f0c-11"), ("GPU-5f0c-11", "GPU-5f0c-11")])
def test_smi_id(uuid, expected):
    assert gpu_clocks.smi_id(3, uuid) == expected
