"""Samples a running cell from the parent every 0.2 s: peak resident memory of the cell's process
tree (psutil) and peak device memory (NVML) when a GPU is present, and, while the GPU is busy,
its SM clock, board power and whether the power cap throttles it (an H100 training step runs
power-capped, and its GEMM rate follows the clock: bench/records/fusions-h100-3ad5e21). Never
touches CUDA itself, so the sweeping process holds no context on the device it measures."""

from __future__ import annotations

import dataclasses
import os
import threading

import psutil

INTERVAL_S = 0.2
BUSY_UTILIZATION = 50
"""NVML utilization (% of the interval a kernel ran) from which a sample counts as busy."""
_POWER_CAPS = 0x4 | 0x80
"""NVML clock-throttle reasons SW power cap and HW power brake."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Peaks:
    rss_bytes: int | None
    device_used_bytes: int | None
    """None without a GPU."""
    device_method: str | None
    """'process' (NVML per-process) or 'device-delta' (device-wide used minus the idle level)."""
    device_idle_bytes: int | None
    """Device-wide used before the cell started (other processes, other contexts)."""
    busy_samples: int | None = None
    """Samples with the GPU busy (BUSY_UTILIZATION); the three means below are over these.
    None without NVML or when it cannot report clocks, power and throttle reasons."""
    sm_clock_mhz_mean: float | None = None
    power_w_mean: float | None = None
    power_capped_frac: float | None = None
    """Share of busy samples in which the power cap (or power brake) held the clock down."""


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _rss(procs) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # exited between listing and reading
            pass
    return total


class _Nvml:
    """The one device the cell uses (first of CUDA_VISIBLE_DEVICES when it is an index, else 0)."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        index = int(visible) if visible.isdigit() else 0
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.idle = self.used()
        self.no_clocks = False
        """Set once NVML failed to report clocks, power or throttle reasons."""

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_used(self, pids: set[int]) -> int | None:
        """Sum over `pids` of NVML's per-process used memory; None when NVML lists none of them
        (a container's PID namespace hides them)."""
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            return None
        found = [int(p.usedGpuMemory or 0) for p in procs if p.pid in pids]
        return sum(found) if found else None

    def clocks(self) -> tuple[int, float, bool] | None:
        """(SM clock MHz, board power W, power-capped now) when the GPU is busy; None when it
        is idle or NVML cannot say."""
        nv = self.nvml
        if getattr(self, "no_clocks", False):
            return None
        try:
            reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nv.nvmlDeviceGetCurrentClocksThrottleReasons
            if nv.nvmlDeviceGetUtilizationRates(self.handle).gpu < BUSY_UTILIZATION:
                return None
            return (int(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM)),
                    nv.nvmlDeviceGetPowerUsage(self.handle) / 1e3,
                    bool(reasons(self.handle) & _POWER_CAPS))
        except Exception:  # noqa: BLE001 - an NVML without these: stop asking, keep the memory
            self.no_clocks = True
            return None

    def close(self):
        self.nvml.nvmlShutdown()


def open_nvml() -> _Nvml | None:
    try:
        return _Nvml()
    except Exception:  # noqa: BLE001 - no driver, no library, no device: record null
        return None


class PeakSampler:
    """Use as `with PeakSampler(nvml) as s: s.watch(pid); ...; peaks = s.peaks()`. Open NVML
    (and so read the idle level) before starting the cell's process."""

    def __init__(self, nvml: _Nvml | None, interval_s: float = INTERVAL_S):
        self.nvml, self.interval_s = nvml, interval_s
        self._pid = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sweep-sampler", daemon=True)
        self._rss = self._proc_dev = self._dev = None
        self._clocks: list[tuple[int, float, bool]] = []

    def watch(self, pid: int) -> None:
        self._pid = pid
        self._thread.start()

    def _sample(self) -> None:
        procs = _tree(self._pid)
        if procs:
            self._rss = max(self._rss or 0, _rss(procs))
        if self.nvml is not None:
            used = self.nvml.used()
            self._dev = max(self._dev or 0, used - self.nvml.idle)
            per_proc = self.nvml.process_used({p.pid for p in procs})
            if per_proc is not None:
                self._proc_dev = max(self._proc_dev or 0, per_proc)
            busy = self.nvml.clocks()
            if busy is not None:
                self._clocks.append(busy)

    def _loop(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peaks(self) -> Peaks:
        if self.nvml is None:
            return Peaks(rss_bytes=self._rss, device_used_bytes=None, device_method=None,
                         device_idle_bytes=None)
        method, used = ("process", self._proc_dev) if self._proc_dev is not None \
            else ("device-delta", self._dev)
        n = len(self._clocks)
        busy = {} if not n else dict(
            busy_samples=n, sm_clock_mhz_mean=sum(c[0] for c in self._clocks) / n,
            power_w_mean=sum(c[1] for c in self._clocks) / n,
            power_capped_frac=sum(c[2] for c in self._clocks) / n)
        return Peaks(rss_bytes=self._rss, device_used_bytes=used, device_method=method,
                     device_idle_bytes=self.nvml.idle, **busy)
