"""Warm-up at setup: everything the first training step would otherwise build on first use —
CUDA modules (NVRTC, or CuPy's disk cache), cuDNN's SDPA graphs for every attention shape the
plan's chunks produce, the numba host kernels the step calls (loaded from numba's disk cache) —
built before the first step, so step 1 costs what step 2 does. Writes nothing the engine reads:
host kernels run on small temporary arrays. Never decides placement, never calls CuPy itself
(the backend's warm_up does)."""

from __future__ import annotations

import dataclasses
import time

import ml_dtypes
import numpy as np

from dataflow.batch import default_chunks
from dataflow.kernels.host import adamw as host_adamw
from dataflow.kernels.host import embedding as host_embedding
from dataflow.kernels.host import norms as host_norms
from dataflow.memplan.plan.buffers import attention_key_block
from dataflow.memplan.plan.plan import GradAccum, OptimizerWhere, Plan, Where
from dataflow.memplan.step.compile import HostTask, Update
from dataflow.settings import settings_from_env

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class AttentionShape:
    """One attention call of a round: n_q queries at absolute offset q_offset attending to
    q_offset + n_q keys of their document (the graph depends on these, not on the buffer)."""

    n_q: int
    q_offset: int
    key_block: int = 0
    """Keys per backward call (dataflow.memplan.plan.buffers.key_block_spans); 0: the whole context."""

    @property
    def self_only(self) -> bool:
        """The chunk attends to itself only: the backward may take cuDNN's deterministic path."""
        return self.q_offset == 0


def attention_shapes(plan: Plan) -> tuple[AttentionShape, ...]:
    """Distinct attention shapes of a round with one document per row (what
    dataflow.layer_ops calls): per chunk segment, n_q = its rows and q_offset = the context
    before them. Packed documents (doc_ids) make data-dependent shapes that no warm-up knows."""
    ch = plan.chunking
    block = attention_key_block(plan.model, ch.chunk_tokens, ch.seqlen)
    shapes = set()
    for chunk in default_chunks(ch):
        for a, b, ks in chunk.segments:
            offset = chunk.context + a - ks if chunk.split else 0
            shapes.add(AttentionShape(b - a, offset, block if chunk.split else 0))
    return tuple(sorted(shapes))


HOST_KERNELS = ("adamw", "embedding_bwd", "sumsq")
_WARM: set[tuple[str, str]] = set()
"""(kernel, gradient dtype name) pairs warm_host_kernels has loaded in this process: numba keeps
them for the process's life, so a later engine need not compile them in the background again."""


def host_kernels_of_plan(plan: Plan) -> frozenset[str]:
    """The host kernels `plan`'s schedule will run, from the plan alone (before the schedule is
    compiled): AdamW for any block updated on the host, the embedding scatter and sum of squares
    for a HOME embedding gradient it holds. The same set as host_kernels_used(its schedule)."""
    blocks = [*plan.layers] + [plan.embed] * plan.holds_embed + [plan.head] * plan.holds_head
    used = set()
    if any(b.optimizer is OptimizerWhere.HOST for b in blocks):
        used.add("adamw")
    if plan.holds_embed and plan.embed.grads is Where.HOME:
        used |= {"embedding_bwd", "sumsq"}
    return frozenset(used)


def start_host_compile(plan: Plan):
    """Compile (into numba's disk cache) the host kernels `plan` runs that this process has not
    loaded yet, in a background process, so the compile overlaps the rest of setup (pinning,
    initialisation: seconds each on a large model) instead of following it; warm_up waits for it
    and then loads from the cache. None when there is nothing to compile. A failed or killed
    background compile only means warm_up compiles in this process, as it would without it."""
    import os
    import subprocess
    import sys

    gdt = "float32" if plan.grad_accum is GradAccum.FP32 else "bfloat16"
    todo = sorted(k for k in host_kernels_of_plan(plan) if (k, gdt) not in _WARM)
    if not todo:
        return None
    code = f"from dataflow.warmup import warm_host_kernels; warm_host_kernels({todo!r}, ({gdt!r},))"
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=os.environ.copy())
    except OSError:
        return None


def _join(background, timeout_s: float = 600.0) -> None:
    """Wait for start_host_compile's process (killed after timeout_s: warm_up then compiles)."""
    if background is None:
        return
    try:
        background.wait(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a stuck compile must not stop the engine
        background.kill()
        background.wait()


class Prebuild:
    """The backend's prebuild of `plan`'s CUDA modules and cuDNN graphs, running in a thread
    while setup pins host memory and allocates the arenas (seconds each on a large budget; the
    builds are host work too, NVRTC and cuDNN's planner). warm_up afterwards finds them built.
    join() waits for it and returns its seconds per part; a failure only means warm_up builds
    the rest itself (logged)."""

    def __init__(self, plan: Plan, be):
        import threading

        cfg = plan.model
        self.seconds: dict[str, float] = {}
        self._args = (attention_shapes(plan), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self._fn = be.prebuild
        self._thread = threading.Thread(target=self._run, name="dataflow-prebuild", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import logging

        t0 = time.perf_counter()
        try:
            self.seconds = dict(self._fn(*self._args))
        except Exception as exc:  # noqa: BLE001 - warm_up builds whatever is missing
            logging.getLogger(__name__).warning("building CUDA modules and cuDNN graphs during "
                                                "setup failed (%s); warm_up builds them", exc)
        self.seconds["total"] = time.perf_counter() - t0

    def join(self) -> dict[str, float]:
        self._thread.join()
        return self.seconds


def start_prebuild(plan: Plan, be) -> Prebuild | None:
    """Start the backend's prebuild (the CuPy backend's) in a thread; None for a backend that
    builds nothing (NumPy) or when DATAFLOW_PREBUILD=0 (everything is then built in warm_up,
    after the arenas, as before)."""
    if getattr(be, "prebuild", None) is None or not settings_from_env().prebuild:
        return None
    return Prebuild(plan, be)


def host_kernels_used(schedule) -> frozenset[str]:
    """Which numba host kernels a compiled schedule runs: AdamW for updates on the host stream,
    the embedding scatter and sum of squares for a HOME embedding's host tasks."""
    used = set()
    for ev in schedule.events:
        if isinstance(ev, Update) and ev.stream == "host":
            used.add("adamw")
        elif isinstance(ev, HostTask) and ev.op == "embed_scatter":
            used.add("embedding_bwd")
        elif isinstance(ev, HostTask) and ev.op == "grad_sumsq":
            used.add("sumsq")
    return frozenset(used)


def warm_host_kernels(kernels=HOST_KERNELS, grad_dtypes=(BF16, F32)) -> dict[str, float]:
    """Call each numba host kernel of `kernels` once on small arrays of the dtypes and layouts
    the executor passes (bf16 params, m, v and embedding rows, int32 ids, gradients of each of
    `grad_dtypes`), so its compiled code is loaded (from numba's cache, or compiled) now.
    Seconds per kernel and gradient dtype."""
    seconds = {}
    n, d, vocab = 64, 8, 16
    rng = np.random.default_rng(0)
    for gdt in (np.dtype(g) for g in grad_dtypes):
        if "adamw" in kernels:
            t0 = time.perf_counter()
            p, m = (rng.standard_normal(n).astype(BF16) for _ in range(2))
            v = np.abs(rng.standard_normal(n)).astype(BF16)
            host_adamw.adamw_step(p, rng.standard_normal(n).astype(gdt), m, v, 1, 1e-3, 0.9,
                                  0.95, 1e-8, 0.0, 1.0)
            seconds[f"adamw_{gdt.name}"] = time.perf_counter() - t0
        if "embedding_bwd" in kernels:
            t0 = time.perf_counter()
            ids = rng.integers(0, vocab, n).astype(np.int32)
            dx = rng.standard_normal((n, d)).astype(BF16)
            host_embedding.embedding_bwd(ids, dx, np.zeros((vocab, d), gdt))
            seconds[f"embedding_bwd_{gdt.name}"] = time.perf_counter() - t0
        if "sumsq" in kernels:
            t0 = time.perf_counter()
            host_norms.sumsq(rng.standard_normal(n).astype(gdt))
            seconds[f"sumsq_{gdt.name}"] = time.perf_counter() - t0
        _WARM.update((k, gdt.name) for k in kernels)
    return seconds


def warm_up(plan: Plan, be, schedule=None, background=None) -> dict[str, float]:
    """Warm everything step 1 would build; seconds per part ('host_kernels', and from a backend
    with warm_up — the CuPy one — 'cuda_modules', 'attention_graphs'). With the executor's
    compiled `schedule`, only the host kernels it runs, at the plan's gradient dtype (numba
    compiles are seconds each); without, all of them at both dtypes. Call after the arenas
    exist (the backend sizes cuDNN's choice of backward from its lent workspace), before the
    first step. `background`: start_host_compile's process, waited for first (its wait is
    part of 'host_kernels')."""
    t0 = time.perf_counter()
    _join(background)
    if schedule is None:
        warm_host_kernels()
    else:
        gdt = F32 if plan.grad_accum is GradAccum.FP32 else BF16
        warm_host_kernels(host_kernels_used(schedule), (gdt,))
    seconds = {"host_kernels": time.perf_counter() - t0}
    backend_warm = getattr(be, "warm_up", None)  # the CuPy backend's; NumPy builds nothing
    if backend_warm is not None:
        cfg = plan.model
        seconds.update(backend_warm(attention_shapes(plan), cfg.n_heads, cfg.n_kv_heads,
                                    cfg.head_dim))
    return seconds
