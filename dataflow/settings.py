"""Every DATAFLOW_* environment variable the library, the ring and the benchmarks read, as one
frozen Settings built by one function (settings_from_env) from an environ mapping; docs/settings.md
lists them. Never validates a value against a machine, never caches: each reader calls
settings_from_env() where it read the variable before, so a variable set between two engines (as
the tests do) is seen by the second.

Values a consumer checks and refuses with its own error (DATAFLOW_PIN, DATAFLOW_RUN_AHEAD_OPS...)
are kept as the text given, with the default filled in; the consumer names a bad value.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """The DATAFLOW_* variables; each field's docstring names its variable and its default."""

    alloc_guard: str = "error"
    """DATAFLOW_ALLOC_GUARD: what the CuPy backend does with a device allocation after setup:
    'error' (raise BackendError), 'warn' (log it and let it through) or 'off'
    (dataflow.backends.alloc_guard; any case)."""
    commit: str | None = None
    """DATAFLOW_COMMIT: the commit a benchmark record names (bench/kernels_bench.py); unset: the
    commit git reports."""
    cudnn_cache_dir: str | None = None
    """DATAFLOW_CUDNN_CACHE_DIR: the directory of serialised cuDNN graphs
    (dataflow.kernels.cuda.graph_cache); unset or empty: ~/.cache/dataflow/cudnn; 'off' (any
    case): no disk cache, every graph is built."""
    fp8_scales: str = "current"
    """DATAFLOW_FP8_SCALES: how the CuPy backend's FP8 linear ops scale an operand: 'current'
    (an amax pass, then the cast) or 'guessed' (the cast with the scale the operand's site had
    last time, the amax taken in the same pass, a second cast where the guess missed: the same
    bytes, one pass fewer where it holds; dataflow.ops_cuda_fp8; any case). 'guessed' gives
    current's bits and measured level with it within the steps' noise (H100, 8b at 8k: -1.8 %
    in s34, +2.2 % in s37; 112M -7 %, -1.3 %; docs/fp8.md), so 'current' stays the default."""
    host_check: bool = True
    """DATAFLOW_HOST_CHECK: 'off' (any case) skips the dataflow-demo's refusal of a host budget
    above the machine's available memory (bench/demo_checks.py), for machines whose memory grows
    as it is used."""
    moe_experts: str = "auto"
    """DATAFLOW_MOE_EXPERTS: how the CuPy backend runs the routed experts' GEMMs: 'auto' (the
    plan's choice, memplan.search.expert_cost.expert_path), or forced: 'loop' (a cuBLASLt call per
    expert, after the host waits for the offsets) or 'grouped' (one launch per GEMM kind over all
    experts, offsets read on the device, no host wait; where the shapes allow, else the loop);
    dataflow.ops_cuda_moe; any case."""
    pin: str = "register"
    """DATAFLOW_PIN: how the CuPy backend pins the host slab: 'register' (mmap, parallel first
    touch, cudaHostRegister) or 'alloc' (cudaHostAlloc); read at each host alloc."""
    pin_pieces: str = "1"
    """DATAFLOW_PIN_PIECES: in how many ranges 'register' pins the slab; must be 1 (the CuPy
    backend says why)."""
    prebuild: bool = True
    """DATAFLOW_PREBUILD: '0' turns off the setup thread that compiles kernels and builds cuDNN
    graphs while the host slab is pinned (dataflow.warmup); everything is then built in warm_up."""
    ring_debug: bool = False
    """DATAFLOW_RING_DEBUG: any non-empty value makes a failing ring rank re-raise (a full
    traceback) instead of printing one line (ring/worker.py; dataflow-ring --debug sets it for the
    ranks it spawns)."""
    ring_id: str | None = None
    """DATAFLOW_RING_ID: names the ring's shared-memory segments (ring/env.py); unset:
    TORCHELASTIC_RUN_ID, SLURM_JOB_ID, or the rendezvous port."""
    ring_port: str | None = None
    """DATAFLOW_RING_PORT: the ring's rendezvous port (ring/env.py); unset: MASTER_PORT + 1."""
    run_ahead_ops: str = ""
    """DATAFLOW_RUN_AHEAD_OPS: how many compute ops the CuPy backend lets the host enqueue ahead
    of the device (a multiple of 4, at least 4); empty: its RUN_AHEAD_OPS."""


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """The Settings of `environ` (default os.environ, read now). Unset and empty variables take
    the defaults the readers always used."""
    env = os.environ if environ is None else environ
    return Settings(
        alloc_guard=env.get("DATAFLOW_ALLOC_GUARD") or "error",
        commit=env.get("DATAFLOW_COMMIT") or None,
        cudnn_cache_dir=env.get("DATAFLOW_CUDNN_CACHE_DIR") or None,
        fp8_scales=(env.get("DATAFLOW_FP8_SCALES") or "current").strip().lower(),
        host_check=env.get("DATAFLOW_HOST_CHECK", "").strip().lower() != "off",
        moe_experts=(env.get("DATAFLOW_MOE_EXPERTS") or "auto").strip().lower(),
        pin=env.get("DATAFLOW_PIN") or "register",
        pin_pieces=env.get("DATAFLOW_PIN_PIECES") or "1",
        prebuild=env.get("DATAFLOW_PREBUILD", "1") != "0",
        ring_debug=bool(env.get("DATAFLOW_RING_DEBUG")),
        ring_id=env.get("DATAFLOW_RING_ID") or None,
        ring_port=env.get("DATAFLOW_RING_PORT") or None,
        run_ahead_ops=(env.get("DATAFLOW_RUN_AHEAD_OPS") or "").strip(),
    )
