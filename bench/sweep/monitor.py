"""Samples a running cell from the parent every 0.2 s: peak resident memory of the cell's process
tree (psutil) and peak device memory (NVML) when a GPU is present. Never touches CUDA itself, so
the sweeping process holds no context on the device it measures."""

from __future__ import annotations

import dataclasses
import os
import threading

import psutil

INTERVAL_S = 0.2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Peaks:
    rss_bytes: int | None
    device_used_bytes: int | None
    """None without a GPU."""
    device_method: str | None
    """'process' (NVML per-process) or 'device-delta' (device-wide used minus the idle level)."""
    device_idle_bytes: int | None
    """Device-wide used before the cell started (other processes, other contexts)."""


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
        return Peaks(rss_bytes=self._rss, device_used_bytes=used, device_method=method,
                     device_idle_bytes=self.nvml.idle)
