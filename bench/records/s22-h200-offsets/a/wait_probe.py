"""Runs dataflow.bench.demo with the MoE offsets store timed per caller: usage
wait_probe.py {copy|mapped} <demo args>. copy = cudaMemcpyAsync (the engine before s22), mapped =
the kernel storing through the region's device mapping. Per step and kind (fwd, recompute, bwd):
the store's GPU time on the compute stream (timing events around it: queueing behind a copy
engine shows here) and the host's wait for it."""
import collections
import sys
import time

import cupy as cp

import dataflow.kernels.cuda as K
from dataflow import executor as X
from dataflow import ops_cuda_moe as M
from dataflow.bench import demo

MODE = sys.argv[1]
assert MODE in ("copy", "mapped"), MODE
STEP = [0]
STATS = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # n, gpu ms, max gpu ms, host wait s
EV = {}

_step = X.Executor.step


def step(self, *a, **k):
    STEP[0] += 1
    return _step(self, *a, **k)


def kind() -> str:
    f = sys._getframe(2)
    if f.f_code.co_name == "moe_experts_bwd":
        return "bwd"
    while f is not None:
        if f.f_code.co_name == "_refwd":
            return "recompute"
        f = f.f_back
    return "fwd"


def offsets_on_host(self, offsets):
    host = self._lent.get("moe_offsets_host")
    assert host is not None and host.shape == offsets.shape, "no lent offsets region"
    if not EV:
        EV["a"], EV["b"] = cp.cuda.Event(block=False), cp.cuda.Event(block=False)
    mapped = K.mapped_address(host) if MODE == "mapped" else None
    if MODE == "mapped" and mapped is None:
        raise SystemExit("the lent region has no device mapping")
    EV["a"].record()
    K.offsets_to_host(offsets, host, EV["b"], mapped=mapped)
    t = time.perf_counter()
    self._wait(EV["b"])
    dt = time.perf_counter() - t
    ms = cp.cuda.get_elapsed_time(EV["a"], EV["b"])
    s = STATS[(STEP[0], kind())]
    s[0] += 1; s[1] += ms; s[2] = max(s[2], ms); s[3] += dt
    return host


X.Executor.step = step
M.MoeOps._offsets_on_host = offsets_on_host
rc = 1
try:
    rc = demo.main(sys.argv[2:])
finally:
    print(f"\nwait_probe mode={MODE}: step kind n store_gpu_total_ms store_gpu_mean_us "
          "store_gpu_max_ms host_wait_total_s")
    for (st, kd), (n, ms, mx, w) in sorted(STATS.items()):
        print(f"wait_probe {st} {kd:9s} {n:5d} {ms:10.1f} {1e3 * ms / max(n, 1):9.1f} "
              f"{mx:8.2f} {w:8.2f}")
sys.exit(rc)
