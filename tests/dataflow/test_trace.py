"""Instrumentation on the NumPy backend: a real two-round step with streamed weights, gradients,
optimizer, embedding and saved activations runs through TracingBackend; its Chrome trace is valid
JSON with the compute and copy tracks, spans never overlap on a track, every op the backend was
asked for appears, and the breakdown's parts add up to the wall time."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter

import pytest

from dataflow.backend import Stream
from dataflow.backends.numpy_backend import NumpyBackend
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.instrument import (Clock, Span, SpanKind, StepTrace, TracingBackend,
                                 compute_breakdown, op_totals, parse_name, pcie_counters,
                                 write_chrome_trace)
from dataflow.optimizer import AdamWConfig
from dataflow.memplan.plan.plan import OptimizerWhere, Where
from dataflow.models.config import load_config
from dataflow.models.flops import SavedLevel
from tests.dataflow.plans import forced_plan, streamed

STEPS = 2


def _plan():
    """tiny, 2 rounds of 2 chunks: every layer, the head and the embedding streamed with a
    streamed AdamW (the embedding gathered and scattered on the host stream), chunk 0's
    activations at home at INP_ONLY (so the backward recomputes) and chunk 1's on the device at
    FULL."""
    cfg = load_config("tiny")
    n = cfg.n_layers
    strm = streamed(OptimizerWhere.STREAMED)
    return forced_plan(cfg, 64, chunk_tokens=128, seqs_per_chunk=2, chunks_per_round=2,
                       rounds=2, layers=(strm,) * n, embed=strm, head=strm, weight_slots=2,
                       grad_slots=2, levels=[[SavedLevel.INP_ONLY, SavedLevel.FULL]] * n,
                       homes=[[Where.HOME, Where.DEVICE]] * n)


class RecordingNumpy(NumpyBackend):
    """The NumPy backend, noting the name of every launch, copy and host call it is asked for."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[str] = []

    def copy(self, dst, src, stream, name="copy"):
        self.seen.append(name)
        super().copy(dst, src, stream, name=name)

    def launch(self, stream, op, *args, name=""):
        self.seen.append(name or op)
        super().launch(stream, op, *args, name=name)

    def host_call(self, stream, fn, *, reads=(), writes=(), name="host"):
        self.seen.append(name)
        super().host_call(stream, fn, reads=reads, writes=writes, name=name)


def _run(plan, sanitize: bool):
    inner = RecordingNumpy(sanitize=sanitize, seed=1)
    be = TracingBackend(inner)
    eng = Engine.from_plan(plan, backend=be, optimizer=AdamWConfig(lr=1e-3))
    cfg, ch = plan.model, plan.chunking
    out = []
    with eng:
        for s in range(STEPS):
            batch = token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                 start=s * ch.seqs_per_step * ch.seqlen)
            inner.seen = []
            result, trace = _traced_step(eng, be, batch)
            out.append((result, trace, list(inner.seen)))
    return out


def _traced_step(eng, be, batch):
    """One step and its trace: from the engine where it drives the tracer itself (it then has
    `last_trace`), else by opening and closing the step around train_step here."""
    if hasattr(eng, "last_trace"):
        return eng.train_step(batch), eng.last_trace
    be.begin_step(eng.optimizer.step_count + 1)
    result = eng.train_step(batch)
    return result, be.end_step()


@pytest.fixture(scope="module")
def plan():
    return _plan()


@pytest.fixture(scope="module")
def plain_run(plan):
    return _run(plan, sanitize=False)


@pytest.fixture(scope="module")
def sanitized_run(plan):
    return _run(plan, sanitize=True)


def test_chrome_trace_is_valid_json_with_compute_and_both_copy_tracks(plain_run, tmp_path):
    """The exported file parses as JSON, names the compute/h2d/d2h/host tracks, and holds a
    complete event with step/layer/chunk args and bytes for copies."""
    path = tmp_path / "trace.json"
    n = write_chrome_trace([t for _, t, _ in plain_run], path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    assert len(events) == n
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    complete = [e for e in events if e["ph"] == "X"]
    used = {names[e["tid"]] for e in complete}
    assert {"compute", "h2d", "d2h", "host", "steps"} <= used
    for e in complete:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["pid"] == 1
    copies = [e for e in complete if e["cat"] == "copy"]
    assert copies and all(e["args"]["bytes"] > 0 for e in copies)
    fwd = next(e for e in complete if e["name"].startswith("f.L1.c1."))
    assert fwd["args"]["layer"] == 1 and fwd["args"]["chunk"] == 1
    assert fwd["args"]["step"] in (1, 2) and fwd["args"]["round"] in (0, 1)


@pytest.mark.parametrize("mode", ["plain_run", "sanitized_run"])
def test_spans_never_overlap_within_a_track(mode, request):
    """On each stream the spans follow one another in time (the sanitizer runs queued work
    later, at synchronize: the tracer times it then)."""
    for _, trace, _ in request.getfixturevalue(mode):
        for stream in Stream:
            spans = [s for s in trace.spans if s.stream is stream]
            for a, b in itertools.pairwise(spans):
                assert b.start_s >= a.end_s, (a, b)
            assert all(trace.start_s <= s.start_s <= s.end_s <= trace.end_s for s in spans)


@pytest.mark.parametrize("mode", ["plain_run", "sanitized_run"])
def test_every_op_the_backend_saw_appears_in_the_trace(mode, request, tmp_path):
    """The multiset of span names equals the names the backend was asked for in that step, the
    Chrome file holds them all, and each round holds every layer's forward and backward ops."""
    run = request.getfixturevalue(mode)
    path = tmp_path / "t.json"
    write_chrome_trace([t for _, t, _ in run], path)
    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e["ph"] == "X" and e["cat"] != "step"]
    plan_rounds = 2
    for step, (_, trace, seen) in enumerate(run, start=1):
        assert Counter(s.name for s in trace.spans) == Counter(seen)
        assert Counter(e["name"] for e in events if e["args"]["step"] == step) == Counter(seen)
        rounds = {}
        for s in trace.spans:
            rounds.setdefault(s.round, []).append(s.name)
        assert set(range(plan_rounds)) <= set(rounds)
        first = Counter(n for n in rounds[0] if n.startswith(("f.", "b.", "head.")))
        assert first == Counter(n for n in rounds[1] if n.startswith(("f.", "b.", "head.")))
        layers = {parse_name(n).get("layer") for n in first}
        assert layers >= {0, 1}
    assert any(s.kind is SpanKind.HOST for s in run[0][1].spans)


def test_breakdown_parts_add_up_to_wall_time_within_5_percent(plain_run):
    """compute busy + exposed copy + exposed host + idle = wall (and compute busy + compute idle
    = wall); the wall encloses the engine's own step time and exceeds it by little."""
    for result, trace, _ in plain_run:
        bd = trace.breakdown()
        total = sum(bd.parts().values())
        assert abs(total - bd.wall_s) <= 0.05 * bd.wall_s
        assert abs(bd.compute_busy_s + bd.compute_idle_s - bd.wall_s) <= 0.05 * bd.wall_s
        assert bd.compute_busy_s > 0 and bd.h2d_busy_s > 0 and bd.d2h_busy_s > 0
        assert result.step_time_s <= bd.wall_s <= 1.05 * result.step_time_s + 0.005
        assert 0 <= bd.copy_hidden_frac <= 1 and 0 <= bd.recompute_frac <= 1


def test_breakdown_bytes_equal_the_engines_count(plain_run):
    """The tracer's H2D/D2H byte totals are the executor's own byte counts."""
    for result, trace, _ in plain_run:
        bd = trace.breakdown()
        assert (bd.h2d_bytes, bd.d2h_bytes) == (result.h2d_bytes, result.d2h_bytes)
        assert bd.h2d_bytes > 0 and bd.d2h_bytes > 0


def test_recompute_and_optimizer_are_found_by_name(plain_run):
    """An INP_ONLY chunk makes the backward re-run forward ops (recompute > 0), and the
    optimizer's spans carry no round."""
    _, trace, _ = plain_run[0]
    bd = trace.breakdown()
    assert bd.recompute_s > 0 and bd.optimizer_s > 0
    assert any(s.name.endswith(".re") for s in trace.spans)
    assert all(s.round is None for s in trace.spans if s.name.startswith("adamw"))
    top = op_totals(trace.spans)
    assert top and top[0][1] >= top[-1][1]


def test_breakdown_of_known_spans_is_exact():
    """Hand-placed spans: compute [0,4], h2d [3,6], d2h [5,8], host [8.5,9] in a 10 s window."""
    def span(stream, a, b, name="x", nbytes=0):
        return Span(1, 0, stream, name, SpanKind.COPY if nbytes else SpanKind.OP, nbytes, a, b)

    spans = (span(Stream.COMPUTE, 0, 3, "b.L0.c0.linear_fwd"), span(Stream.COMPUTE, 3, 4),
             span(Stream.H2D, 3, 6, "w.h2d1", 600), span(Stream.D2H, 5, 8, "g.d2h1", 300),
             span(Stream.HOST, 8.5, 9, "adamw.host.embed"))
    bd = compute_breakdown(StepTrace(step=1, start_s=0.0, end_s=10.0, spans=spans,
                                     clock=Clock.HOST))
    assert bd.parts() == {"compute_busy_s": 4, "copy_exposed_s": 4, "host_exposed_s": 0.5,
                          "idle_s": 1.5}
    assert (bd.copy_busy_s, bd.copy_hidden_s, bd.h2d_exposed_s, bd.d2h_exposed_s) == (5, 1, 2, 3)
    assert (bd.h2d_bytes_per_s, bd.d2h_bytes_per_s) == (200, 100)
    assert bd.recompute_s == 3 and bd.recompute_frac == 0.75 and bd.optimizer_s == 0.5


def test_attention_time_leaves_out_its_recompute():
    """attention_s: the forward and backward attention spans, overlaps counted once, without
    the backward's re-run forward attention (recompute) or other ops."""
    def span(a, b, name):
        return Span(1, 0, Stream.COMPUTE, name, SpanKind.OP, 0, a, b)

    spans = (span(0, 2, "f.L0.c0.attention_fwd"), span(1, 3, "f.L0.c1.attention_fwd"),
             span(3, 4, "f.L0.c1.linear_fwd"), span(4, 5, "b.L0.c1.attention_fwd.re"),
             span(5, 7, "b.L0.c1.attention_bwd"), span(7, 8, "b.L0.c0.attention_bwd_own"),
             span(8, 9, "b.L0.c0.linear_bwd_x"))
    bd = compute_breakdown(StepTrace(step=1, start_s=0.0, end_s=10.0, spans=spans,
                                     clock=Clock.HOST))
    assert bd.attention_s == 6 and bd.recompute_s == 1 and bd.compute_busy_s == 9


def test_a_deferred_updates_opt_stream_counts_its_copies_as_d2h():
    """The opt stream (a deferred AdamW): its write-back [2,4] joins the D2H link's busy time and
    bytes; its kernel [1,2] is optimizer time, not a copy; compute [0,1] and [4,5]."""
    def span(stream, a, b, name="x", nbytes=0):
        return Span(1, 0, stream, name, SpanKind.COPY if nbytes else SpanKind.OP, nbytes, a, b)

    spans = (span(Stream.COMPUTE, 0, 1), span(Stream.COMPUTE, 4, 5),
             span(Stream.OPT, 1, 2, "adamw.layer0.0"),
             span(Stream.OPT, 2, 4, "opt.d2h.layer0", 400))
    bd = compute_breakdown(StepTrace(step=1, start_s=0.0, end_s=5.0, spans=spans,
                                     clock=Clock.HOST))
    assert (bd.d2h_busy_s, bd.d2h_bytes, bd.copy_exposed_s) == (2, 400, 2)
    assert bd.optimizer_s == 3 and bd.idle_s == 1


def test_names_parse_into_layer_chunk_and_category():
    """The executor's naming scheme maps to layer, chunk and category."""
    assert parse_name("f.L3.c1.linear_fwd") == {"category": "forward", "layer": 3, "chunk": 1}
    assert parse_name("b.L2.c0.attention_fwd.re")["category"] == "recompute"
    assert parse_name("b.L2.c0.linear_fwd")["category"] == "recompute"
    assert parse_name("b.L2.c0.linear_bwd_w")["category"] == "backward"
    assert parse_name("w.h2d3") == {"category": "weights", "layer": 3}
    assert parse_name("act.d2h(2, 0)") == {"category": "activations", "layer": 2, "chunk": 0}
    assert parse_name("headw.h2dhead") == {"category": "weights"}
    assert parse_name("adamw.layer4.2") == {"category": "optimizer", "layer": 4}
    assert parse_name("opt.h2d.layer5") == {"category": "optimizer", "layer": 5}
    assert parse_name("head.c0.loss") == {"category": "head", "chunk": 0}
    assert parse_name("ctx.k.L3.c1") == {"category": "context", "layer": 3, "chunk": 1}
    assert parse_name("tokens.stage") == {"category": "data"}


def test_tracer_passes_work_through_untimed_outside_a_step():
    """Setup work makes no spans; begin_step twice and end_step without a step are refused."""
    from dataflow.backend import BackendError, Place

    be = TracingBackend(NumpyBackend())
    slab = be.alloc(64, Place.DEVICE)
    a, b = be.view(slab, 0, (8,), "f32"), be.view(slab, 32, (8,), "f32")
    be.copy(a, b, Stream.H2D, name="setup")
    be.begin_step(1)
    with pytest.raises(BackendError, match="end_step"):
        be.begin_step(2)
    be.copy(a, b, Stream.H2D, name="in.step")
    trace = be.end_step()
    assert [s.name for s in trace.spans] == ["in.step"] and trace.spans[0].nbytes == 32
    with pytest.raises(BackendError, match="begin_step"):
        be.end_step()
    be.close()
    assert "_submit" not in vars(be.inner)  # the NumPy backend is left as it was


def test_instrumentation_imports_without_cupy_or_a_gpu():
    """Importing the package pulls in neither CuPy nor pynvml (both are lazy)."""
    code = ("import sys, dataflow.instrument, dataflow.metrics_log, dataflow.progress; "
            "print('cupy' in sys.modules, 'pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_pcie_counters_are_none_without_an_nvidia_gpu():
    """No NVML device here: the cross-check helper says None instead of raising."""
    if pcie_counters() is not None:
        pytest.skip("an NVIDIA GPU is present; covered by the gpu test")
    assert pcie_counters() is None


# -- GPU ----------------------------------------------------------------------------------------
def _cupy_backend(monkeypatch):
    """A CupyBackend with a two-op stub table (the tracer, not the kernels, is under test)."""
    cb = pytest.importorskip("dataflow.backends.cupy_backend")
    if not cb.gpu_available():
        pytest.skip("no usable GPU")
    import types

    import cupy

    stub = types.ModuleType("dataflow.ops_cuda")
    stub.WRITES = {"matmul": (2,), "fill_": (0,)}
    stub.matmul = lambda a, b, out: cupy.matmul(a, b, out=out)
    stub.fill_ = lambda x, value: x.fill(value)
    try:
        import dataflow.ops_cuda  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "dataflow.ops_cuda", stub)
    be = cb.CupyBackend()
    be.ops, be.writes = stub, stub.WRITES
    return be


ROUNDS_GPU = 20
"""5 GiB each way: past the 4 GiB wrap of NVML's counters."""


@pytest.mark.gpu
def test_gpu_spans_come_from_cuda_events_and_pcie_counters_agree(monkeypatch):
    """On the GPU: spans are CUDA-event times that never overlap on a stream, copies overlap
    compute (hidden > 0), the parts add up to the wall, the wall agrees with the host clock,
    and NVML's PCIe byte counters agree with the traced bytes within 10 % (RX against the H2D
    payload directly; both directions against the packet model of expected_link_bytes)."""
    import time

    from dataflow.backend import Place
    from dataflow.instrument import PcieCounter, PcieSampler, expected_link_bytes

    inner = _cupy_backend(monkeypatch)
    be = TracingBackend(inner)
    n, mib = 2048, 1 << 20
    dev = be.alloc(3 * n * n * 4 + 2 * 256 * mib, Place.DEVICE)
    host = be.alloc(2 * 256 * mib, Place.HOST)
    a, b, c = (be.view(dev, i * n * n * 4, (n, n), "f32") for i in range(3))
    slots = [be.view(dev, 3 * n * n * 4 + i * 256 * mib, (256 * mib,), "u8") for i in (0, 1)]
    homes = [be.view(host, i * 256 * mib, (256 * mib,), "u8") for i in (0, 1)]
    be.launch(Stream.COMPUTE, "fill_", a, 0.5, name="init")
    be.launch(Stream.COMPUTE, "fill_", b, 0.25, name="init")
    be.synchronize()
    counter = PcieCounter.open(pci_bus_id=inner.device.pci_bus_id)
    sampler = PcieSampler(counter) if counter else None
    if sampler:
        sampler.start()
    t0 = time.perf_counter()
    be.begin_step(1)
    for rnd in range(ROUNDS_GPU):
        be.host_call(Stream.HOST, lambda: None, name="tokens.ids")  # marks the round
        be.wait(Stream.H2D, be.record(Stream.HOST))
        be.copy(slots[rnd % 2], homes[rnd % 2], Stream.H2D, name=f"w.h2d{rnd}")
        for _ in range(20):                      # overlaps the next round's H2D
            be.launch(Stream.COMPUTE, "matmul", a, b, c, name=f"f.L{rnd}.c0.linear_fwd")
        be.wait(Stream.COMPUTE, be.record(Stream.H2D))
        be.wait(Stream.D2H, be.record(Stream.COMPUTE))
        be.copy(homes[(rnd + 1) % 2], slots[rnd % 2], Stream.D2H, name=f"g.d2h{rnd}")
    trace = be.end_step()
    host_wall = time.perf_counter() - t0
    moved = sampler.stop() if sampler else None
    assert trace.clock is Clock.CUDA_EVENTS
    for stream in Stream:
        spans = [s for s in trace.spans if s.stream is stream]
        assert all(y.start_s >= x.end_s - 1e-6 for x, y in itertools.pairwise(spans))
    bd = trace.breakdown()
    assert abs(sum(bd.parts().values()) - bd.wall_s) <= 0.05 * bd.wall_s
    assert bd.copy_hidden_s > 0 and bd.compute_busy_s > 0
    assert bd.h2d_bytes == bd.d2h_bytes == ROUNDS_GPU * 256 * mib
    assert bd.h2d_bytes_per_s > 1e9
    assert abs(bd.wall_s - host_wall) <= 0.1 * host_wall
    print(bd.table())
    if moved is not None:
        want = expected_link_bytes(bd.h2d_bytes, bd.d2h_bytes)
        print("pcie", moved, "expected", want, "payload", bd.h2d_bytes, bd.d2h_bytes)
        assert abs(moved.rx_bytes - bd.h2d_bytes) <= 0.1 * bd.h2d_bytes
        assert abs(moved.rx_bytes - want.rx_bytes) <= 0.1 * want.rx_bytes
        assert abs(moved.tx_bytes - want.tx_bytes) <= 0.1 * want.tx_bytes
        counter.close()
    be.close()


@pytest.mark.gpu
def test_gpu_engine_step_traces_and_adds_up(plan):
    """The real engine on the CuPy backend (once dataflow.ops_cuda exists): the same checks as
    on the CPU, with CUDA-event times."""
    cb = pytest.importorskip("dataflow.backends.cupy_backend")
    if not cb.gpu_available():
        pytest.skip("no usable GPU")
    pytest.importorskip("dataflow.ops_cuda")
    be = TracingBackend(cb.CupyBackend())
    eng = Engine.from_plan(plan, backend=be, optimizer=AdamWConfig(lr=1e-3))
    ch, cfg = plan.chunking, plan.model
    with eng:
        result, trace = _traced_step(
            eng, be, token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size))
    bd = trace.breakdown()
    assert trace.clock is Clock.CUDA_EVENTS
    assert abs(sum(bd.parts().values()) - bd.wall_s) <= 0.05 * bd.wall_s
    assert (bd.h2d_bytes, bd.d2h_bytes) == (result.h2d_bytes, result.d2h_bytes)


def test_tracing_passes_on_the_calls_the_backend_base_makes_no_ops():
    """set_moe_experts (the plan's expert path) and written (a ring transport's writes) reach
    the traced backend: the Backend base's no-ops would otherwise shadow them (__getattr__ only
    sees what the class lacks), and a traced run would silently take another MoE path or keep
    an FP8 copy of bytes a transport replaced."""
    calls = []

    class Noting(NumpyBackend):
        def set_moe_experts(self, path):
            calls.append(("set_moe_experts", path))

        def written(self, arrays):
            calls.append(("written", len(tuple(arrays))))

    tb = TracingBackend(Noting(), nvtx=False)
    tb.set_moe_experts("grouped")
    tb.written([object(), object()])
    assert calls == [("set_moe_experts", "grouped"), ("written", 2)]


def test_tracing_defines_every_public_method_of_the_backend_interface():
    """Every public method of Backend is TracingBackend's own (timed or passed on), so none
    falls back to the base's default behind the traced backend's back; its precision is the
    inner backend's."""
    import inspect

    from dataflow.backend import Backend

    missing = [name for name, _ in inspect.getmembers(Backend, inspect.isfunction)
               if not name.startswith("_") and name not in TracingBackend.__dict__]
    assert missing == []
    inner = NumpyBackend()
    tb = TracingBackend(inner, nvtx=False)
    tb.set_precision("fp8")
    assert inner.precision == tb.precision == "fp8"
