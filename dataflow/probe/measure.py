"""The measurements behind dataflow-probe, on the current GPU, through the engine's own paths:
copies through CupyBackend (its pinned slabs and H2D/D2H streams), GEMMs through
dataflow.kernels.cuda.linear (cuBLAS gemmEx) at one layer's shapes, attention through
dataflow.kernels.cuda.attention (cuDNN SDPA, deterministic backward for a packed chunk and the atomic one
for a split sequence, as dataflow.ops_cuda picks), host work through dataflow.kernels.host (numba).

Every device rate is timed with CUDA events around repeated calls after a warm-up; the median
of the repeats is kept. Compute runs for seconds (`Settings`) so the rates are the sustained,
power-capped ones a training run sees, not a cool GPU's burst. Never used by the engine."""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time

import cupy as cp
import ml_dtypes
import numpy as np

from dataflow.backend import Place, Stream
from dataflow.backends.cupy_backend import CupyBackend
from dataflow.kernels.cuda import (CudaContext, attention, attention_bwd, attention_fwd, cast,
                                   fp8_gemm, fp8_quantise, linear_bwd_w, linear_bwd_x,
                                   linear_fwd)
from dataflow.kernels.host import adamw as host_adamw
from dataflow.kernels.host.memory import copy_into
from dataflow.probe.profile import Measurements, attn_flops, gemm_flops
from dataflow.memplan.search.cost import ADAMW_STATE_BYTES_PER_ELEM
from dataflow.models.config import ModelConfig
from dataflow.settings import settings_from_env

log = logging.getLogger(__name__)
BF16 = np.dtype(ml_dtypes.bfloat16)
MIB = 1 << 20
WINDOW_S = 0.25
"""Length of one timed window of back-to-back compute calls."""
GRAD_BYTES = 2
"""bf16 gradients, the planner's default (GradAccum.BF16)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    copy_bytes: int
    """Bytes per copy (each direction; at least 256 MiB to reach the link's steady rate)."""
    copy_repeats: int
    host_bytes: int
    """Bytes per host memcpy."""
    adamw_elems: int
    """Parameters per host AdamW call."""
    gemm_s: float
    """Seconds of back-to-back layer GEMMs; the later half of the windows is kept."""
    attn_s: float
    """Seconds per attention measurement (4 of them)."""
    chunk_tokens: int = 8192
    split_context_tokens: int = 57344
    """Keys before the split chunk: the last 8k chunk of a 64k sequence (the 8b@64k cell)."""


QUICK = Settings(copy_bytes=256 * MIB, copy_repeats=5, host_bytes=512 * MIB,
                 adamw_elems=32 << 20, gemm_s=8.0, attn_s=1.5)
FULL = Settings(copy_bytes=1024 * MIB, copy_repeats=9, host_bytes=2048 * MIB,
                adamw_elems=128 << 20, gemm_s=30.0, attn_s=5.0)


def device_info() -> tuple[str, int, int | None]:
    """(name, total device bytes, PCIe generation from NVML or None) of the current device."""
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    total = int(cp.cuda.runtime.memGetInfo()[1])
    gen = None
    try:
        import pynvml

        pynvml.nvmlInit()
        # By PCI bus id: CUDA and NVML may number the devices differently.
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(cp.cuda.Device().pci_bus_id)
        gen = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
    except Exception:  # noqa: BLE001 - NVML is optional; the base profile's value is kept
        gen = None
    return name, total, gen


def _events_s(start, end) -> float:
    return cp.cuda.get_elapsed_time(start, end) / 1e3


def _repeat(fn, stream, repeats: int, inner: int) -> float:
    """Median seconds per call of fn() (work enqueued on `stream`) over `repeats` timed runs of
    `inner` calls each, after one warm-up call."""
    with stream:
        fn()
        stream.synchronize()
        times = []
        for _ in range(repeats):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            for _ in range(inner):
                fn()
            end.record(stream)
            end.synchronize()
            times.append(_events_s(start, end) / inner)
    return statistics.median(times)


def _sustained(fn, stream, seconds: float) -> tuple[float, float]:
    """(first window, median of the later half of the windows): seconds per call of fn() run
    back to back on `stream` for about `seconds`, in windows of about WINDOW_S. The windows are
    all enqueued before the one synchronisation, so the device never idles between them."""
    with stream:
        fn()  # warm-up: cuDNN graphs, cuBLAS heuristics, workspaces
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        per_call = max(_events_s(start, end), 1e-6)
        calls = max(1, round(WINDOW_S / per_call))
        windows = max(4, math.ceil(seconds / (calls * per_call)))
        marks = []
        for _ in range(windows):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            for _ in range(calls):
                fn()
            b.record(stream)
            marks.append((a, b))
        marks[-1][1].synchronize()
    times = [_events_s(a, b) / calls for a, b in marks]
    return times[0], statistics.median(times[len(times) // 2:])


def _randn_bf16(ctx, shape, std: float = 1.0):
    """A bf16 device array of N(0, std^2) values (random data: a zero GEMM draws less power),
    rounded by the kernels' cast in the CudaContext `ctx`."""
    out = cp.empty(shape, dtype=BF16)
    f32 = cp.random.standard_normal(out.size, dtype=cp.float32)
    f32 *= std
    cast(ctx, f32, out.reshape(-1))
    return out


def measure_copies(be: CupyBackend, s: Settings) -> dict[str, float]:
    """Pinned host <-> device through the backend's copy on its H2D and D2H streams: each
    direction alone, then both at once (each stream timed from a common start event)."""
    n = s.copy_bytes
    host = be.view(be.alloc(2 * n, Place.HOST), 0, (2 * n,), "u8")
    dev = be.view(be.alloc(2 * n, Place.DEVICE), 0, (2 * n,), "u8")
    host[:] = 1  # touch every page once, outside the timing
    h_src, h_dst, d_dst, d_src = host[:n], host[n:], dev[:n], dev[n:]
    h2d_s, d2h_s = be.streams[Stream.H2D], be.streams[Stream.D2H]

    def h2d():
        be.copy(d_dst, h_src, Stream.H2D)

    def d2h():
        be.copy(h_dst, d_src, Stream.D2H)

    out = {"h2d": n / _repeat(h2d, h2d_s, s.copy_repeats, 4),
           "d2h": n / _repeat(d2h, d2h_s, s.copy_repeats, 4)}
    inner, both = 4, []
    for _ in range(s.copy_repeats):
        start, end_h, end_d = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
        start.record(h2d_s)
        d2h_s.wait_event(start)
        for _ in range(inner):  # interleaved, so both links are busy from the first copy
            h2d()
            d2h()
        end_h.record(h2d_s)
        end_d.record(d2h_s)
        end_h.synchronize()
        end_d.synchronize()
        both.append((_events_s(start, end_h) / inner, _events_s(start, end_d) / inner))
    out["h2d_duplex"] = n / statistics.median(t for t, _ in both)
    out["d2h_duplex"] = n / statistics.median(t for _, t in both)

    def d2d():
        be.copy(d_src, d_dst, Stream.COMPUTE)

    out["device"] = 2 * n / _repeat(d2d, be.streams[Stream.COMPUTE], s.copy_repeats, 10)
    return out


def _host_median_s(fn, repeats: int) -> float:
    fn()  # warm-up: numba compile (or cache load), first-touch page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _host_copy_s(nbytes: int) -> float:
    """Median seconds of dataflow.kernels.host.memory.copy_into (numba, parallel) over `nbytes`."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return _host_median_s(lambda: copy_into(dst, src), 5)


def measure_host(s: Settings) -> dict[str, float]:
    """Parallel host memcpy (read + write) and the engine's host AdamW, bytes as cost.py counts."""
    copy_s = _host_copy_s(s.host_bytes)
    n = s.adamw_elems
    param, grad = np.full(n, 0.02, dtype=BF16), np.full(n, 1e-3, dtype=BF16)
    m, v = np.zeros(n, dtype=BF16), np.zeros(n, dtype=BF16)
    step = iter(range(1, 1000))
    adamw_s = _host_median_s(lambda: host_adamw.adamw_step(
        param, grad, m, v, next(step), 1e-4, 0.9, 0.95, 1e-8, 0.1, 1.0), 3)
    return {"copy": 2 * s.host_bytes / copy_s,
            "adamw": n * (ADAMW_STATE_BYTES_PER_ELEM + GRAD_BYTES) / adamw_s}


def _layer_operands(cfg: ModelConfig, s: Settings, ctx) -> list:
    """(input, weight (out, in), output, dw, dx) per projection of one layer at chunk_tokens:
    q, k, v, gate and up read x; o reads the attention output; down the SwiGLU output."""
    t, d, q, kv, f = s.chunk_tokens, cfg.model_dim, cfg.q_dim, cfg.kv_dim, cfg.ffn_dim
    x, xo, act = _randn_bf16(ctx, (t, d)), _randn_bf16(ctx, (t, q)), _randn_bf16(ctx, (t, f))
    layer = []
    for inp, out_dim in ((x, q), (x, kv), (x, kv), (xo, d), (x, f), (x, f), (act, d)):
        w = _randn_bf16(ctx, (out_dim, inp.shape[1]), 0.02)
        layer.append((inp, w, cp.empty((t, out_dim), dtype=BF16), cp.zeros_like(w),
                      cp.empty_like(inp)))
    return layer


def measure_gemm(cfg: ModelConfig, s: Settings, stream, ctx) -> tuple[float, float]:
    """(first window, sustained) FLOP/s of one layer's forward and backward GEMMs at
    chunk_tokens, shaped and accumulated as dataflow.layer_ops calls them (ctx: the kernels'
    CudaContext)."""
    t = s.chunk_tokens
    layer = _layer_operands(cfg, s, ctx)

    def fwd_bwd():
        for inp, w, y, dw, dx in layer:
            linear_fwd(ctx, inp, w, y)
        for inp, w, y, dw, dx in layer:  # y stands in for dy: random, of the right shape
            linear_bwd_w(ctx, y, inp, dw, True)
            linear_bwd_x(ctx, y, w, dx, False)

    first, sustained = _sustained(fwd_bwd, stream, s.gemm_s)
    flops = gemm_flops(cfg, t)
    return flops / first, flops / sustained


def measure_fp8_gemm(cfg: ModelConfig, s: Settings, stream, ctx) -> float | None:
    """Sustained FLOP/s of the same layer GEMMs in FP8 as dataflow.ops_cuda_fp8 runs them (E4M3
    x and w, E5M2 dy, K-contiguous operands, fp32 accumulation), the operands quantised once
    before the timing: the cost model counts the quantise passes on their own. None on a GPU
    before sm_89 (no FP8 tensor cores)."""
    if int(cp.cuda.Device().compute_capability) < 89:
        return None
    u8 = np.uint8
    layer = []
    for inp, w, y, dw, dx in _layer_operands(cfg, s, ctx):
        (t, i), o = inp.shape, w.shape[0]
        q = {name: (cp.empty(shape, u8), cp.empty(shape[::-1], u8), cp.ones(3, cp.float32))
             for name, shape in (("x", (t, i)), ("w", (o, i)), ("dy", (t, o)))}
        for name, src, fmt in (("x", inp, "e4m3"), ("w", w, "e4m3"), ("dy", y, "e5m2")):
            if name == "dy":  # random, never the empty buffer's leftovers (maybe NaN)
                src = _randn_bf16(ctx, y.shape)
            a, a_t, sc = q[name]
            fp8_quantise(ctx, src, fmt, sc, a, a_t)
        layer.append((q, y, dw, dx))

    def fwd_bwd():
        for q, y, dw, dx in layer:
            fp8_gemm(ctx, q["x"][0], "e4m3", q["x"][2], q["w"][0], "e4m3", q["w"][2], y)
        for q, y, dw, dx in layer:
            fp8_gemm(ctx, q["dy"][1], "e5m2", q["dy"][2], q["x"][1], "e4m3", q["x"][2], dw,
                     accumulate=True)
            fp8_gemm(ctx, q["dy"][0], "e5m2", q["dy"][2], q["w"][1], "e4m3", q["w"][2], dx)

    # Half the bf16 window: the GPU is at its power-capped clocks already, just after those.
    _, sustained = _sustained(fwd_bwd, stream, s.gemm_s / 2)
    return gemm_flops(cfg, s.chunk_tokens) / sustained


def measure_attention(cfg: ModelConfig, s: Settings, stream, ctx, context: int,
                      deterministic: bool) -> tuple[float, float]:
    """Sustained hardware FLOP/s of the fused attention forward and backward for chunk_tokens
    queries after `context` keys of the same sequence (0: a packed, self-attending chunk)."""
    t, h, kh, e = s.chunk_tokens, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    keys = context + t
    q, k = _randn_bf16(ctx, (t, h, e)), _randn_bf16(ctx, (keys, kh, e))
    v = _randn_bf16(ctx, (keys, kh, e))
    o, lse = cp.empty((t, h, e), dtype=BF16), cp.empty((h, t), dtype=cp.float32)
    do, dq = _randn_bf16(ctx, (t, h, e)), cp.empty((t, h, e), dtype=BF16)
    dk, dv = cp.empty((keys, kh, e), dtype=BF16), cp.empty((keys, kh, e), dtype=BF16)

    def fwd():
        attention_fwd(ctx, q, k, v, context, o, lse)

    def bwd():
        attention_bwd(ctx, q, k, v, o, lse, do, context, dq, dk, dv,
                      deterministic=deterministic)

    fwd_flops, bwd_flops = attn_flops(cfg, t, context)
    _, fwd_s = _sustained(fwd, stream, s.attn_s)
    _, bwd_s = _sustained(bwd, stream, s.attn_s)
    return fwd_flops / fwd_s, bwd_flops / bwd_s


def measure_all(cfg: ModelConfig, s: Settings) -> Measurements:
    """Every measurement the profile needs, on device 0, logged as it goes."""
    t0 = time.perf_counter()
    name, total, gen = device_info()
    be = CupyBackend()
    log.info("%s: copies of %d MiB", name, s.copy_bytes // MIB)
    copies = measure_copies(be, s)
    log.info("h2d %.1f, d2h %.1f, duplex %.1f / %.1f GB/s; device memory %.0f GB/s",
             copies["h2d"] / 1e9, copies["d2h"] / 1e9, copies["h2d_duplex"] / 1e9,
             copies["d2h_duplex"] / 1e9, copies["device"] / 1e9)
    host = measure_host(s)
    log.info("host memcpy %.1f GB/s, host AdamW %.2f GB/s", host["copy"] / 1e9,
             host["adamw"] / 1e9)
    be.close()
    del be  # its pinned and device slabs go before the compute buffers arrive
    cp.get_default_memory_pool().free_all_blocks()
    stream = cp.cuda.Stream(non_blocking=True)
    ctx = CudaContext(cudnn_cache_dir=settings_from_env().cudnn_cache_dir)
    # Build the four cuDNN graphs now, so the attention windows follow the GEMMs on a GPU that
    # is already at its power-capped clocks instead of after seconds of idle graph building.
    for context, det in ((0, True), (s.split_context_tokens, False)):
        for kind in ("fwd", "bwd"):
            attention.attention_workspace_bytes(  # the forward's graph key is always det.
                ctx, kind, s.chunk_tokens, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, context,
                det or kind == "fwd")
    log.info("layer GEMMs of %s at %d tokens for %.0f s", cfg.name, s.chunk_tokens, s.gemm_s)
    gemm_first, gemm = measure_gemm(cfg, s, stream, ctx)
    cp.get_default_memory_pool().free_all_blocks()
    log.info("GEMM %.0f TFLOP/s sustained (first window %.0f)", gemm / 1e12, gemm_first / 1e12)
    fp8 = measure_fp8_gemm(cfg, s, stream, ctx)
    cp.get_default_memory_pool().free_all_blocks()
    log.info("FP8 GEMM %s", "not measured: no FP8 tensor cores (before sm_89)" if fp8 is None
             else f"{fp8 / 1e12:.0f} TFLOP/s sustained ({fp8 / gemm:.2f}x bf16)")
    # The engine's choice (dataflow.ops_cuda): deterministic backward for a chunk that attends
    # to itself, cuDNN's atomic-dQ backward for the later chunks of a split sequence.
    attn = measure_attention(cfg, s, stream, ctx, 0, deterministic=True)
    cp.get_default_memory_pool().free_all_blocks()
    split = measure_attention(cfg, s, stream, ctx, s.split_context_tokens, deterministic=False)
    cp.get_default_memory_pool().free_all_blocks()
    log.info("attention fwd / bwd %.0f / %.0f TFLOP/s; split %.0f / %.0f", attn[0] / 1e12,
             attn[1] / 1e12, split[0] / 1e12, split[1] / 1e12)
    refused = "; ".join(ctx.fallbacks().values())
    ctx.close()
    return Measurements(
        device_name=name, device_mem_bytes=total, pcie_gen=gen,
        h2d_bytes_per_s=copies["h2d"], d2h_bytes_per_s=copies["d2h"],
        h2d_duplex_bytes_per_s=copies["h2d_duplex"], d2h_duplex_bytes_per_s=copies["d2h_duplex"],
        host_copy_bytes_per_s=host["copy"], host_adamw_bytes_per_s=host["adamw"],
        device_mem_bytes_per_s=copies["device"], chunk_tokens=s.chunk_tokens,
        split_context_tokens=s.split_context_tokens, gemm_burst_flop_per_s=gemm_first,
        gemm_flop_per_s=gemm, attn_fwd_flop_per_s=attn[0], attn_bwd_flop_per_s=attn[1],
        split_attn_fwd_flop_per_s=split[0], split_attn_bwd_flop_per_s=split[1],
        attn_path="cudnn" if not refused else f"cuDNN refused: {refused}",
        fp8_gemm_flop_per_s=fp8, wall_s=time.perf_counter() - t0)
