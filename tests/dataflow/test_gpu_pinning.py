"""Host pinning and warm-up on the GPU: memory pinned by mmap + cudaHostRegister (whole or in
pieces) is host memory CUDA knows as pinned and copies to and from the device exactly; the
backend's host slab is pinned the way DATAFLOW_PIN says, trains bit-identically either way, and
falls back to cudaHostAlloc when registration fails; after warm_up the steps build no attention
graph and compile no CUDA module."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.backend import Place, Stream  # noqa: E402
from dataflow.backends.cupy_backend import CupyBackend, MappedHostMemory  # noqa: E402
from dataflow.data import token_stream  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.optimizer import AdamWConfig  # noqa: E402
from dataflow.warmup import warm_up  # noqa: E402
from dataflow.models.config import load_config  # noqa: E402
from tests.dataflow.plans import forced_plan  # noqa: E402

_HOST_MEMORY_TYPE = 1  # cudaMemoryTypeHost: page-locked host memory


def _register(ptr, n):
    cp.cuda.runtime.hostRegister(ptr, n, 1)


@pytest.mark.parametrize("pieces", [1])  # 4 pieces: cudaErrorInvalidValue on the H100
def test_registered_memory_is_pinned_and_copies_exactly(rng, pieces):
    """Random bytes go host -> device -> host unchanged, including a copy that spans two
    registered pieces, and CUDA reports every piece as page-locked host memory."""
    n = 24 << 20
    mem = MappedHostMemory(n, _register, cp.cuda.runtime.hostUnregister, pieces=pieces)
    host = np.asarray(mem)
    host[...] = rng.integers(0, 256, n, dtype=np.uint8)
    attrs = cp.cuda.runtime.pointerGetAttributes(mem.ptr + n - 1)
    assert attrs.type == _HOST_MEMORY_TYPE
    dev = cp.empty(n, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    dev.data.copy_from_host_async(host.ctypes.data, n, s)
    back = np.zeros(n, np.uint8)
    s.synchronize()
    dev.data.copy_to_host(back.ctypes.data, n)
    assert np.array_equal(back, host)
    del host
    mem.free()


@pytest.mark.parametrize("method", ["register", "alloc"])
def test_backend_pins_the_host_slab_as_DATAFLOW_PIN_says(monkeypatch, rng, method):
    """last_pin names the method; a host view round-trips through the device exactly."""
    monkeypatch.setenv("DATAFLOW_PIN", method)
    be = CupyBackend()
    slab = be.alloc(8 << 20, Place.HOST)
    dslab = be.alloc(8 << 20, Place.DEVICE)
    assert be.last_pin["method"] == method and be.last_pin["nbytes"] == 8 << 20
    h = be.view(slab, 4096, (1000,), "f32")
    d = be.view(dslab, 0, (1000,), "f32")
    h[...] = rng.standard_normal(1000).astype(np.float32)
    be.copy(d, h, Stream.H2D)
    be.synchronize()
    assert np.array_equal(be.to_numpy(d), h)
    be.close()


def test_a_failed_registration_falls_back_to_cudaHostAlloc(monkeypatch):
    """When cudaHostRegister fails, the slab still comes (cudaHostAlloc) and says so."""
    monkeypatch.setenv("DATAFLOW_PIN", "register")

    def refuse(ptr, n, flags):
        raise cp.cuda.runtime.CUDARuntimeError(2)  # cudaErrorMemoryAllocation

    monkeypatch.setattr(cp.cuda.runtime, "hostRegister", refuse)
    be = CupyBackend()
    be.alloc(1 << 20, Place.HOST)
    assert be.last_pin["method"].startswith("alloc")
    be.close()


def _train(monkeypatch, method: str, chunks_per_seq: int, warm: bool):
    """Losses of two steps of a small model; (graphs, modules) counts after warm-up and after
    the steps; warm-up parts; setup phases."""
    def built():
        counts = eng.be.kernels.built_counts()  # the backend's CudaContext
        return counts["graphs"] + counts["refused"], counts["modules"]

    monkeypatch.setenv("DATAFLOW_PIN", method)
    cfg = load_config("small")
    plan = forced_plan(cfg, 256 * chunks_per_seq, chunk_tokens=256,
                       chunks_per_seq=chunks_per_seq, chunks_per_round=chunks_per_seq, rounds=2)
    ch = plan.chunking
    with Engine.from_plan(plan, backend="cupy", optimizer=AdamWConfig(lr=1e-3)) as eng:
        parts = warm_up(eng.plan, eng.be, eng.ex.schedule) if warm else {}
        after_warm = built()
        losses = [eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                              start=s * ch.seqs_per_step * ch.seqlen)).loss
                  for s in range(2)]
        return losses, (after_warm, built()), parts, eng.setup_seconds


def test_training_is_bit_identical_with_either_pinning(monkeypatch):
    """The pinning method changes no result (deterministic attention: no split sequence)."""
    losses_alloc, _, _, _ = _train(monkeypatch, "alloc", 1, warm=False)
    losses_reg, _, _, phases = _train(monkeypatch, "register", 1, warm=False)
    assert losses_reg == losses_alloc
    assert {"executor", "zero_state", "init_weights", "synchronize"} <= set(phases)


def test_after_warm_up_the_steps_build_no_graph_and_compile_no_module(monkeypatch):
    """A split sequence (4 contexts): warm_up reports its parts, and the two steps after it add
    no cuDNN graph (or refused shape) and no CUDA module."""
    _, (after_warm, after_steps), parts, _ = _train(monkeypatch, "register", 4, warm=True)
    assert {"host_kernels", "cuda_modules", "attention_graphs"} <= set(parts)
    assert after_steps == after_warm


def test_precompile_builds_every_kernel_source():
    """Every launcher's .cu compiles (or loads from CuPy's cache) with all its instantiations."""
    from dataflow.kernels.cuda import _build
    from tests.gpu import cuda_context

    ctx = cuda_context()
    seconds = _build.precompile(ctx)
    ctx.close()
    assert set(seconds) == {src for src, _ in _build.kernel_sources()}
    assert len(seconds) >= 8


def test_the_setup_thread_builds_the_graphs_and_changes_no_result(monkeypatch):
    """From a cleared graph cache, with a split sequence: the engine's prebuild (a thread while
    the executor pins) reports its parts and the steps build nothing after setup. Without a
    split (deterministic attention; a split's atomic dQ differs run to run in the last bits)
    the losses equal an engine's built with DATAFLOW_PREBUILD=0 (everything built in warm_up,
    after the arenas)."""
    monkeypatch.setenv("DATAFLOW_CUDNN_CACHE_DIR", "off")
    cfg = load_config("small")
    results = {}
    for flag, split in (("1", 4), ("1", 1), ("0", 1)):
        monkeypatch.setenv("DATAFLOW_PREBUILD", flag)  # each engine's backend: fresh graphs
        plan = forced_plan(cfg, 256 * split, chunk_tokens=256, chunks_per_seq=split,
                           chunks_per_round=split, rounds=2)
        ch = plan.chunking
        with Engine.from_plan(plan, backend="cupy", optimizer=AdamWConfig(lr=1e-3)) as eng:
            before = eng.be.kernels.built_counts()["graphs"]
            losses = [eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                                  start=s * ch.seqs_per_step * ch.seqlen)).loss
                      for s in range(2)]
            # the steps built nothing
            assert eng.be.kernels.built_counts()["graphs"] == before, (flag, split)
        results[flag, split] = losses, eng.prebuild_parts
    assert {"cuda_modules", "attention_graphs", "total"} <= set(results["1", 4][1])
    assert results["1", 1][0] == results["0", 1][0]
    assert results["0", 1][1] == {}
