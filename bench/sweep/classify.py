"""Classifies a finished cell process from its exit code and stderr: ok, device OOM, host OOM,
timeout or crash, with the error's last line. Pure text inspection: never runs anything."""

from __future__ import annotations

import re
import signal

from dataflow.bench.sweep.record import Status

HOST_OOM_MARKERS = (
    "cannot allocate the host arena",  # CuPy backend: pinned host slab refused
    "of host memory for the",  # NumPy backend: host slab refused
    "(?<!OutOf)MemoryError", "Cannot allocate memory", "std::bad_alloc", "cudaHostAlloc",
)
"""Regular expressions, checked before the device markers: a refused pinned allocation also says
cudaErrorMemoryAllocation, but it is host memory that ran out. CuPy's device OutOfMemoryError
must not read as Python's (host) MemoryError."""
DEVICE_OOM_MARKERS = (  # plain substrings
    "cannot allocate the device arena", "OutOfMemoryError", "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
    "out of memory",
)
MAX_ERROR_CHARS = 500


def last_line(text: str) -> str | None:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:MAX_ERROR_CHARS] if lines else None


def classify(returncode: int | None, stderr: str, *, timed_out: bool,
             timeout_s: float | None = None) -> tuple[Status, str | None]:
    """(status, error line). `returncode` is Popen's: negative for a signal. A process the OOM
    killer ends dies by SIGKILL without a word, so an unexplained SIGKILL counts as host OOM."""
    line = last_line(stderr)
    if timed_out:
        return Status.TIMEOUT, f"no result within {timeout_s:g} s" + (f"; last: {line}" if line
                                                                      else "")
    if returncode == 0:
        return Status.OK, None
    if any(re.search(m, stderr) for m in HOST_OOM_MARKERS):
        return Status.HOST_OOM, line
    if any(m in stderr for m in DEVICE_OOM_MARKERS):
        return Status.DEVICE_OOM, line
    if returncode is not None and returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return Status.HOST_OOM, "killed by SIGKILL (likely the kernel's OOM killer)" + (
            f"; last: {line}" if line else "")
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() \
            else str(-returncode)
        return Status.CRASH, f"killed by {name}" + (f"; last: {line}" if line else "")
    return Status.CRASH, line or f"exit code {returncode} with nothing on stderr"
