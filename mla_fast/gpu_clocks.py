"""SM clock, board power and the driver's clock-event reasons sampled during a benchmark (nvidia-smi): a time read
with the clock it ran at, and why the clock was where it was.

At 128 heads the H200 runs at its power cap (700 W) and lowers its SM clock within a call, by 10-20 % (docs/kernels.md,
"128 heads run at the H200's power cap"); a time measured then is not the kernel's alone. `ClockSampler` runs
`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active -lms PERIOD` on the benchmark's
GPU in the background; `window(t0, t1)` summarizes the samples whose nvidia-smi timestamps (local wall time, ms) fall
in a `time.time()` range, so a pipe's buffering does not move them; read windows after the sampler has stopped.
Units: MHz and W (`power.draw`, which nvidia-smi averages over its own window: in mla-bench's first run it read at
most 377 W at (128, 4096, 128), with the L2 flushes and the host's gaps between calls, while the clock was down at
1635-1680 MHz; the clock is the reading that tells). The reasons are NVML's clock-event bits (`REASONS`: e.g.
sw_power_cap, the board's power limit; hw_slowdown; the thermal ones), each summarized as the share of the window's
samples in which it was active, so a row says whether its clock was held down by power, heat or nothing.
Where nvidia-smi is missing (ROCm, CPU) or fails, `available` is False with the reason, and windows say so; a driver
that knows the reasons field only by its older name (clocks_throttle_reasons.active) gives no samples, and the
sampler says that.
"""

import datetime
import shutil
import statistics
import subprocess
import threading

PERIOD_MS = 50  # nvidia-smi's loop period
QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
REASONS = {  # NVML's nvmlClocksEventReason bits, as clocks_event_reasons.active reports them
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
    0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks",
}


def parse_line(line: str) -> tuple[float, float, float, int | None] | None:
    """(epoch s, SM MHz, W, clock-event bits) from one line of `--format=csv,noheader,nounits` ("2026/12/01
    00:12:26.998, 1965, 669.63, 0x0000000000000004"; the timestamp in local time); the bits are None on a line of
    the first three fields only or where nvidia-smi could not read them. None for anything else."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) not in (3, 4):
        return None
    try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        sample = (t, float(parts[1]), float(parts[2]))
    except ValueError:  # "[N/A]" and the like
        return None
    try:
        bits = int(parts[3], 16) if len(parts) == 4 else None
    except ValueError:
        bits = None
    return (*sample, bits)


def reason_names(bits: int) -> list[str]:
    """The REASONS names of a clock-event bit mask (bits outside REASONS as "0x..." each)."""
    names = [name for bit, name in REASONS.items() if bits & bit]
    rest = bits & ~sum(REASONS)  # REASONS' bits are distinct: their sum is their union
    return names + ([f"{rest:#x}"] if rest else [])


def summarize(samples) -> dict:
    """{sm_mhz_median, sm_mhz_min, power_w_max, samples, reasons} of [(t, MHz, W, bits), ...]: reasons maps each
    clock-event reason active in any sample to the share of the samples (with bits) in which it was, largest
    first ({} when none was, None when no sample had bits); {"samples": 0} when empty."""
    if not samples:
        return {"samples": 0}
    mhz = [s[1] for s in samples]
    masks = [s[3] for s in samples if s[3] is not None]
    reasons = None
    if masks:
        counts = {}
        for bits in masks:
            for name in reason_names(bits):
                counts[name] = counts.get(name, 0) + 1
        reasons = {name: n / len(masks) for name, n in sorted(counts.items(), key=lambda kv: -kv[1])}
    return {"sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w_max": max(s[2] for s in samples), "samples": len(samples), "reasons": reasons}


class ClockSampler:
    """Background nvidia-smi sampling of one GPU (a context manager). gpu: what `nvidia-smi -i` takes (an index, or
    "GPU-<uuid>": the right board whatever CUDA_VISIBLE_DEVICES says). command: the sampler's argv (tests)."""

    def __init__(self, gpu: str = "0", period_ms: int = PERIOD_MS, command: list[str] | None = None):
        self.samples = []  # [(epoch s, SM MHz, W, clock-event bits or None)]
        self.reason = None
        if command is None:
            exe = shutil.which("nvidia-smi")
            if exe is None:
                self.reason = "nvidia-smi not found"
            command = [exe or "nvidia-smi", "-i", str(gpu), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                       f"-lms={int(period_ms)}"]
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
                self.reason = f"nvidia-smi gave no samples of {QUERY}"
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
