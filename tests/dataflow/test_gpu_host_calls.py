"""A Python host function pending on the HOST stream must never deadlock the thread that queues
GPU work. The cuDNN frontend keeps the GIL through its handle creation, a graph build and a
graph's first execute, which may synchronise the context: it then waits for the host function,
which waits for the GIL. On the H100 at 0617b02 that hung the GPU suite, and a probe of it hung
25 s of 25. The second case is the same cycle through a launch into a full CUDA queue. Each case runs in a fresh process (a first use must
really be first; a deadlock must fail the test, not hang the suite)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dataflow.backends.cupy_backend import gpu_available
from tests.gpu import random_bf16_preamble

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and CuPy")]

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = random_bf16_preamble(7) + textwrap.dedent("""
    import time
    from dataflow.backend import Stream
    from dataflow.backends.cupy_backend import CupyBackend, RUN_AHEAD_OPS

    be = CupyBackend()
    t, h, kh, e = 1024, 8, 2, 64
    q, k, v = bf((t, h, e)), bf((t, kh, e)), bf((t, kh, e))
    o, lse = cp.empty((t, h, e), BF16), cp.empty((h, t), cp.float32)
    for case, launches in (("first use", 1), ("full queue", 8 * RUN_AHEAD_OPS)):
        t0 = time.perf_counter()
        be.host_call(Stream.HOST, lambda: time.sleep(1.0), name="sleep")
        be.wait(Stream.COMPUTE, be.record(Stream.HOST))
        for _ in range(launches):
            be.launch(Stream.COMPUTE, "attention_fwd", q, k, v, 0, o, lse)
        be.synchronize()
        print(case, "ok", round(time.perf_counter() - t0, 2), flush=True)
    assert np.isfinite(cp.asnumpy(lse)).all()
    be.close()
""")


def test_pending_host_function_does_not_deadlock_cudnn_first_use_or_a_full_queue():
    try:
        done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"deadlocked: no return in 120 s; output so far: {exc.stdout!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "first use ok" in done.stdout and "full queue ok" in done.stdout, done.stdout

