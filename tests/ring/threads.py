"""Ring ranks as threads of the test process: the shared-memory transport works between threads
as between processes, without the processes' start-up cost."""

from __future__ import annotations


def in_threads(fn, n: int) -> list:
    """fn(i, run_id) for i < n, each in a thread of this process (ring processes without the
    start-up cost; the shared-memory transport works between threads alike): their results,
    or the first failure's traceback as an AssertionError."""
    import threading
    import traceback
    import uuid

    from dataflow.ring.shm import cleanup

    run_id, out = uuid.uuid4().hex[:12], {}

    def run(i):
        try:
            out[i] = fn(i, run_id)
        except Exception:  # noqa: BLE001 - reported below
            out[i] = AssertionError(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        cleanup(run_id)
    for i in range(n):
        assert i in out, f"thread {i} did not finish"
        if isinstance(out[i], AssertionError):
            raise out[i]
    return [out[i] for i in range(n)]
