"""SM clock and board power sampled during a benchmark (nvidia-smi): a time read with the clock it ran at.

At 128 heads the H200 runs at its power cap (700 W) and lowers its SM clock within a call, by 10-20 % (README,
"128 heads run at the H200's power cap"); a time measured then is not the kernel's alone. `ClockSampler` runs
`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms PERIOD` on the benchmark's GPU in the background;
`window(t0, t1)` summarizes the samples whose nvidia-smi timestamps (local wall time, ms) fall in a `time.time()`
range, so a pipe's buffering does not move them; read windows after the sampler has stopped. Units: MHz and W
(`power.draw`, which nvidia-smi averages over its own window: in mla-bench's first run it read at most 377 W at
(128, 4096, 128), with the L2 flushes and the host's gaps between calls, while the clock was down at 1635-1680 MHz;
the clock is the reading that tells).
Where nvidia-smi is missing (ROCm, CPU) or fails, `available` is False with the reason, and windows say so.
"""

import datetime
import shutil
import statistics
import subprocess
import threading

PERIOD_MS = 50  # nvidia-smi's loop period


def parse_line(line: str) -> tuple[float, float, float] | None:
    """(epoch s, SM MHz, W) from one line of `--format=csv,noheader,nounits` ("2026/12/01 00:12:26.998, 1965,
    669.63"; the timestamp in local time), None for anything else."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return t, float(parts[1]), float(parts[2])
    except ValueError:  # "[N/A]" and the like
        return None


def summarize(samples) -> dict:
    """{sm_mhz_median, sm_mhz_min, power_w_max, samples} of [(t, MHz, W), ...]; {"samples": 0} when empty."""
    if not samples:
        return {"samples": 0}
    mhz = [s[1] for s in samples]
    return {"sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w_max": max(s[2] for s in samples), "samples": len(samples)}


class ClockSampler:
    """Background nvidia-smi sampling of one GPU (a context manager). gpu: what `nvidia-smi -i` takes (an index, or
    "GPU-<uuid>": the right board whatever CUDA_VISIBLE_DEVICES says). command: the sampler's argv (tests)."""

    def __init__(self, gpu: str = "0", period_ms: int = PERIOD_MS, command: list[str] | None = None):
        self.samples = []  # [(epoch s, SM MHz, W)]
        self.reason = None
        if command is None:
            exe = shutil.which("nvidia-smi")
            if exe is None:
                self.reason = "nvidia-smi not found"
            command = [exe or "nvidia-smi", "-i", str(gpu), "--query-gpu=timestamp,clocks.sm,power.draw",
                       "--format=csv,noheader,nounits", f"-lms={int(period_ms)}"]
        self.command = command
        self._proc = None
        self._thread = None
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self.reason is None

    def __enter__(self):
        if self.available:
            try:
                self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                              text=True, bufsize=1)
            except OSError as e:
                self.reason = f"nvidia-smi failed to start: {e}"
            else:
                self._thread = threading.Thread(target=self._read, daemon=True)
                self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            sample = parse_line(line)
            if sample is not None:
                with self._lock:
                    self.samples.append(sample)

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._thread.join(timeout=5)
            if not self.samples and self.reason is None:
                self.reason = "nvidia-smi gave no samples"
        return False

    def window(self, t0: float, t1: float) -> dict:
        """Summary of the samples stamped in [t0, t1] (time.time() seconds), or {"status": reason}."""
        if not self.available:
            return {"status": self.reason}
        with self._lock:
            inside = [s for s in self.samples if t0 <= s[0] <= t1]
        return summarize(inside)


def smi_id(device_index: int, uuid) -> str:
    """What `nvidia-smi -i` takes for a torch CUDA device: "GPU-<uuid>" (the same board whatever
    CUDA_VISIBLE_DEVICES says) when torch reports its UUID, else the index."""
    if uuid is None:
        return str(device_index)
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"
