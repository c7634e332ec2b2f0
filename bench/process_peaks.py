"""Sampled runs of the ring benchmarks (bench/ring_gpu.py): a command in a fresh process group,
every process of its tree sampled every 0.5 s for its RSS (psutil) and its device memory (NVML,
per process, CUDA context included), and the CUDA context's own bytes. Never trains and never
creates a CUDA context in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
INTERVAL_S = 0.5


class ProcessPeaks:
    """Peak RSS and NVML device memory of every process in the tree under a pid, per pid."""

    def __init__(self):
        import psutil

        self.psutil = psutil
        self.rss: dict[int, int] = {}
        self.dev: dict[int, int] = {}
        self.gpu_of: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                            for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no NVML: RSS only
            self.nvml, self.handles = None, []

    def device_names(self) -> list[str]:
        out = []
        for h in self.handles:
            name = self.nvml.nvmlDeviceGetName(h)
            out.append(name.decode() if isinstance(name, bytes) else str(name))
        return out

    def watch(self, pid: int) -> "ProcessPeaks":
        self._thread = threading.Thread(target=self._loop, args=(pid,), daemon=True)
        self._thread.start()
        return self

    def _loop(self, pid: int) -> None:
        while not self._stop.is_set():
            self._sample(pid)
            self._stop.wait(INTERVAL_S)

    def _sample(self, pid: int) -> None:
        try:
            root = self.psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except self.psutil.Error:
            return
        for proc in procs:
            try:
                rss = proc.memory_info().rss
                if proc.pid not in self.names:
                    self.names[proc.pid] = " ".join(proc.cmdline()[:6])[:120]
            except self.psutil.Error:
                continue
            self.rss[proc.pid] = max(self.rss.get(proc.pid, 0), rss)
        for gpu, h in enumerate(self.handles):
            try:
                listed = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:  # noqa: BLE001
                continue
            for p in listed:
                used = int(p.usedGpuMemory or 0)
                if p.pid in self.rss and used > self.dev.get(p.pid, -1):
                    self.dev[p.pid], self.gpu_of[p.pid] = used, gpu

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self) -> list[dict]:
        """One row per process that held GPU memory (the ranks), then the largest other RSS."""
        rows = [{"pid": pid, "gpu": self.gpu_of[pid], "device_used_bytes": self.dev[pid],
                 "rss_bytes": self.rss.get(pid), "cmd": self.names.get(pid, "")}
                for pid in sorted(self.dev, key=lambda q: self.gpu_of[q])]
        return rows


def run_sampled(cmd: list[str], log_path: Path, timeout_s: float,
                env: dict) -> tuple[int, float, list]:
    """(exit code or 'timeout' as -9, wall seconds, per-process peaks) of one sampled run."""
    peaks = ProcessPeaks()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=env, start_new_session=True)
        peaks.watch(proc.pid)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
        finally:
            peaks.stop()
    return rc, time.monotonic() - t0, peaks.report()


def child_env() -> dict:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "NCCL_NVLS_ENABLE": "0"}


def context_bytes(out: Path) -> int | None:
    """NVML's per-process device memory of a process that only made a CuPy context on GPU 0."""
    code = ("import cupy, time, sys; cupy.zeros(1); cupy.cuda.Device().synchronize(); "
            "print('ready', flush=True); time.sleep(3)")
    rc, _, rows = run_sampled([sys.executable, "-c", code], out / "context.log", 60,
                              child_env())
    return max((r["device_used_bytes"] for r in rows), default=None) if rc == 0 else None
