"""Ring ranks as threads of the test process: the shared-memory transport works between threads
as between processes, without the processes' start-up cost."""

from __future__ import annotations


def in_threads(fn, n: int) -> list:
    """fn(i, run_id) for i < n, each in a thread of this process (ring processes without the
    start-up cost; the shared-memory transport works between threads alike): their results,
    or the earliest failure's traceback as an AssertionError (a thread that fails first makes
    its peers time out waiting for it: their tracebacks say only that), naming the others."""
    import threading
    import time
    import traceback
    import uuid

    from dataflow.ring.shm import cleanup

    run_id, out, failed_at = uuid.uuid4().hex[:12], {}, {}

    def run(i):
        try:
            out[i] = fn(i, run_id)
        except Exception:  # noqa: BLE001 - reported below
            failed_at[i] = time.monotonic()
            out[i] = AssertionError(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)  # past the transports' 120 s: their own timeout reports first
    finally:
        cleanup(run_id)
    for i in range(n):
        assert i in out, f"thread {i} did not finish"
    if failed_at:
        first = min(failed_at, key=failed_at.get)
        others = ", ".join(f"thread {i}: {str(out[i]).strip().splitlines()[-1]}"
                           for i in sorted(failed_at) if i != first)
        raise AssertionError(f"thread {first} failed first"
                             + (f" (then {others})" if others else "") + f":\n{out[first]}")
    return [out[i] for i in range(n)]


def sanitized_pair_trains_as_one_device(cfg, plans, rng, chunking: dict) -> None:
    """Ranks 0 and 1 of `plans` (a ring of 2), as threads on the sanitizing NumPy backend (ops in
    a random order that respects the events; any two unordered accesses to the same bytes are
    reported), train two steps; each rank's losses must equal one device's under `chunking`
    bit for bit."""
    import numpy as np

    # the engine and the ring's pieces: loaded by the ring tests that use them, not on import
    from dataflow.backends import make_backend
    from dataflow.engine import Engine
    from dataflow.optimizer import AdamWConfig
    from dataflow.ring.rank import RingRank
    from dataflow.ring.shm import SharedMemoryTransport

    seed, lr = int(rng.integers(0, 2**31)), 1e-2
    with Engine(cfg, host_gb=0.25, dev_gb=0.25, seqlen=64, backend="numpy", seed=seed, lr=lr,
                max_grad_norm=None, plan_options=dict(chunking)) as eng:
        data = [rng.integers(0, cfg.vocab_size, (eng.seqs_per_step, 65), dtype=np.int32)
                for _ in range(2)]
        want = [eng.train_step(b).loss for b in data]

    def rank(r, run_id):
        tr = SharedMemoryTransport(r, 2, run_id, timeout_s=120)
        be = make_backend("numpy", sanitize=True, seed=int(rng.integers(0, 2**31)) + r)
        rk = RingRank(plans[r], be, tr, seed=seed,
                      optimizer=AdamWConfig(lr=lr, max_grad_norm=None))
        try:
            return [rk.train_step(b).loss for b in data]
        finally:
            rk.close()

    for losses in in_threads(rank, 2):
        assert losses == want


def assert_same_blocks(got: dict, want: dict) -> None:
    """The ranks' weights (gathered by block key) are exactly the reference's, bit for bit."""
    import numpy as np

    assert sorted(got) == sorted(want)
    for key in want:
        assert np.array_equal(got[key].view(np.uint16), want[key].view(np.uint16)), key
