"""What dataflow-probe measured (`Measurements`), the HardwareProfile made from it, and the table
that puts it beside the built-in profile. Pure Python over plain numbers: never touches a
device, never reads the clock, so the tests drive it with made-up measurements.

Efficiencies are stored the way dataflow.memplan.search.cost reads them: the measured rate divided by the peak
times the cost model's own shape factors (`gemm_flop_per_s` / `attn_flop_per_s` at efficiency
1), so the planner reproduces the measured rate at the measured shape."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from dataflow.memplan.search.cost import ATTN_ATOMIC_BWD_SPEEDUP, attn_flop_per_s, gemm_flop_per_s
from dataflow.memplan.plan.plan import GIB, HardwareProfile
from dataflow.memplan.plan.profiles import get_profile, known_profiles
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.flops import attn_bwd_flops, attn_fwd_flops, flash_recompute_flops, layer_matmul_flops

_NO_CACHE = Path(os.devnull)
"""A cache path that is never a regular file, so get_profile answers with the built-in."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    """Rates measured on one GPU and its host. Bytes per second count each byte once per
    direction it crosses (device and host memory: read + write)."""

    device_name: str
    device_mem_bytes: int
    """Total device memory (cudaMemGetInfo)."""
    pcie_gen: int | None
    """The link's PCIe generation from NVML; None when NVML could not say."""
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_duplex_bytes_per_s: float
    """Host->device while device->host copies of the same size run at once."""
    d2h_duplex_bytes_per_s: float
    host_copy_bytes_per_s: float
    """Parallel host memcpy (dataflow.kernels.host.memory.copy_into), read + write: shown, not stored."""
    host_adamw_bytes_per_s: float
    """dataflow.kernels.host.adamw over bf16 state and grads, 14 bytes per parameter (as cost.py counts)."""
    device_mem_bytes_per_s: float
    """Device-to-device copy, read + write."""
    chunk_tokens: int
    """Tokens of the layer GEMMs and of the packed attention chunk (self-attention only)."""
    split_context_tokens: int
    """Keys before the split-sequence attention chunk (its q_offset)."""
    gemm_burst_flop_per_s: float
    """One layer's forward and backward GEMMs, the first window (a cool GPU)."""
    gemm_flop_per_s: float
    """The same, sustained: median of the later windows (power capped clocks)."""
    attn_fwd_flop_per_s: float
    """Hardware FLOPs/s of the packed chunk's fused attention (sustained)."""
    attn_bwd_flop_per_s: float
    """Backward, score recompute counted (hardware FLOPs)."""
    split_attn_fwd_flop_per_s: float
    split_attn_bwd_flop_per_s: float
    attn_path: str
    """'cudnn', or the reason the simple kernels ran instead."""
    wall_s: float
    fp8_gemm_flop_per_s: float | None = None
    """The same layer GEMMs in FP8 (dataflow.kernels.cuda.fp8_gemm on operands quantised
    beforehand: the cost model counts the quantise passes apart), sustained; None on a GPU
    without FP8 tensor cores (before sm_89)."""


def gemm_flops(cfg: ModelConfig, tokens: int) -> float:
    """One layer's forward + backward GEMM FLOPs over `tokens` (backward = 2x forward)."""
    return 3.0 * layer_matmul_flops(cfg, tokens)


def attn_flops(cfg: ModelConfig, tokens: int, context: int) -> tuple[float, float]:
    """(forward, backward) hardware FLOPs of one fused attention call, as cost.py counts them."""
    return (attn_fwd_flops(cfg, tokens, context),
            attn_bwd_flops(cfg, tokens, context) + flash_recompute_flops(cfg, tokens, context))


def builtin_profile(device_name: str, base: str | None = None) -> HardwareProfile:
    """The built-in profile for `base` if given, else for the device (matched as
    dataflow.engine.default_profile matches it); never the cached measured one."""
    if base is not None:
        return get_profile(base, cache_path=_NO_CACHE)
    try:
        return get_profile(device_name, cache_path=_NO_CACHE)
    except ConfigError:
        key = "".join(ch for ch in device_name.lower() if ch.isalnum())
        for known in known_profiles():
            if known != "cpu" and known in key:
                return get_profile(known, cache_path=_NO_CACHE)
    raise ConfigError(f"no built-in profile matches GPU '{device_name}' (known: "
                      f"{', '.join(known_profiles())}); pass --base NAME to carry the fields the "
                      "probe does not measure from one, and --peak-tflops for this GPU's dense "
                      "bf16 peak")


def _efficiency(rate: float, unit_rate: float) -> float:
    """rate / (the cost model's rate at efficiency 1), kept inside validate_profile's (0, 1]."""
    return min(1.0, rate / unit_rate)


def build_profile(base: HardwareProfile, m: Measurements, cfg: ModelConfig,
                  peak_flop_per_s: float | None = None) -> HardwareProfile:
    """`base` with every field the probe measured replaced (dataclasses.replace, so fields it
    does not measure carry over). The name stays base.name: get_profile matches on it."""
    p = base if peak_flop_per_s is None else dataclasses.replace(
        base, peak_bf16_flop_per_s=peak_flop_per_s)
    unit = dataclasses.replace(p, gemm_efficiency=1.0)
    t = m.chunk_tokens
    gemm_eff = _efficiency(m.gemm_flop_per_s, gemm_flop_per_s(cfg, unit, t))
    fp8 = p.fp8_gemm_flop_per_s
    if m.fp8_gemm_flop_per_s is not None:
        # The profile holds the large-size rate, scaled by size as the bf16 rate is
        # (cost.fp8_gemm_flop_per_s), so the cost model gives back the rate measured at t.
        at_t = gemm_flop_per_s(cfg, dataclasses.replace(p, gemm_efficiency=gemm_eff), t)
        fp8 = m.fp8_gemm_flop_per_s * p.peak_bf16_flop_per_s * gemm_eff / at_t
    return dataclasses.replace(
        p,
        gemm_efficiency=gemm_eff, fp8_gemm_flop_per_s=fp8,
        attn_fwd_efficiency=_efficiency(m.attn_fwd_flop_per_s, attn_flop_per_s(cfg, p, 1.0, t)),
        attn_bwd_efficiency=_efficiency(m.attn_bwd_flop_per_s, attn_flop_per_s(cfg, p, 1.0, t)),
        h2d_bytes_per_s=m.h2d_bytes_per_s, d2h_bytes_per_s=m.d2h_bytes_per_s,
        h2d_duplex_bytes_per_s=m.h2d_duplex_bytes_per_s,
        d2h_duplex_bytes_per_s=m.d2h_duplex_bytes_per_s,
        host_mem_bytes_per_s=m.host_adamw_bytes_per_s,
        device_mem_bytes_per_s=m.device_mem_bytes_per_s,
        pcie_gen=base.pcie_gen if m.pcie_gen is None else m.pcie_gen,
        device_mem_bytes=m.device_mem_bytes)


def _row(what: str, unit: str, scale: float, old: float | None, new: float | None,
         note: str = ""):
    o = "-" if old is None else f"{old / scale:,.1f}"
    n = "-" if new is None else f"{new / scale:,.1f}"
    ratio = "" if not old or new is None else f"{new / old:.0%}"
    return f"{what:<34}{unit:>8}{o:>10}{n:>10}{ratio:>7}  {note}".rstrip()


def format_table(base: HardwareProfile, prof: HardwareProfile, m: Measurements,
                 cfg: ModelConfig) -> str:
    """Measured beside built-in, one line per quantity; efficiencies in % of the peak; then the
    split-sequence attention measured beside what the cost model makes of the new profile."""
    t, ctx = m.chunk_tokens, m.split_context_tokens
    keys = t + ctx
    pct, gb = 0.01, 1e9
    lines = [
        (f"dataflow-probe: {m.device_name} beside the built-in profile '{base.name}' "
         f"({cfg.name} shapes, {t}-token chunks; {m.wall_s:.0f} s)"),
        f"{'':<34}{'unit':>8}{'built-in':>10}{'measured':>10}{'ratio':>7}",
        _row("h2d alone", "GB/s", gb, base.h2d_bytes_per_s, prof.h2d_bytes_per_s,
             "pinned host -> device"),
        _row("d2h alone", "GB/s", gb, base.d2h_bytes_per_s, prof.d2h_bytes_per_s),
        _row("h2d duplex", "GB/s", gb, base.h2d_duplex_bytes_per_s, prof.h2d_duplex_bytes_per_s,
             "while d2h runs"),
        _row("d2h duplex", "GB/s", gb, base.d2h_duplex_bytes_per_s, prof.d2h_duplex_bytes_per_s),
        _row("host memory (AdamW rate)", "GB/s", gb, base.host_mem_bytes_per_s,
             prof.host_mem_bytes_per_s, "numba AdamW, 14 B/param"),
        _row("host memcpy", "GB/s", gb, None, m.host_copy_bytes_per_s,
             "read + write; shown, not stored"),
        _row("device memory", "GB/s", gb, base.device_mem_bytes_per_s,
             prof.device_mem_bytes_per_s, "d2d copy, read + write"),
        _row("peak bf16", "TFLOP/s", 1e12, base.peak_bf16_flop_per_s,
             prof.peak_bf16_flop_per_s, "datasheet, not measured"),
        _row("GEMM efficiency", "%", pct, base.gemm_efficiency, prof.gemm_efficiency,
             f"sustained {m.gemm_flop_per_s / 1e12:.0f} TFLOP/s "
             f"(first window {m.gemm_burst_flop_per_s / 1e12:.0f})"),
        _row("FP8 GEMM (large sizes)", "TFLOP/s", 1e12, base.fp8_gemm_flop_per_s,
             prof.fp8_gemm_flop_per_s,
             "not measured: no FP8 tensor cores" if m.fp8_gemm_flop_per_s is None else
             f"{m.fp8_gemm_flop_per_s / 1e12:.0f} TFLOP/s at the layer's shapes, "
             f"{m.fp8_gemm_flop_per_s / m.gemm_flop_per_s:.2f}x bf16"),
        _row("attention fwd efficiency", "%", pct, base.attn_fwd_efficiency,
             prof.attn_fwd_efficiency, f"{m.attn_fwd_flop_per_s / 1e12:.0f} TFLOP/s"),
        _row("attention bwd efficiency", "%", pct, base.attn_bwd_efficiency,
             prof.attn_bwd_efficiency, f"{m.attn_bwd_flop_per_s / 1e12:.0f} TFLOP/s "
             "(score recompute counted)"),
        _row("device memory size", "GiB", GIB, base.device_mem_bytes, prof.device_mem_bytes),
        f"{'PCIe generation':<34}{'':>8}{base.pcie_gen:>10}{prof.pcie_gen:>10}"
        + ("" if m.pcie_gen is not None else "         NVML did not say; kept"),
    ]
    for kind, rate, eff in (("fwd", m.split_attn_fwd_flop_per_s, prof.attn_fwd_efficiency),
                            ("bwd", m.split_attn_bwd_flop_per_s,
                             prof.attn_bwd_efficiency * ATTN_ATOMIC_BWD_SPEEDUP)):
        model = attn_flop_per_s(cfg, prof, eff, keys)
        lines.append(f"split-sequence attention {kind} ({t} queries after {ctx} keys): measured "
                     f"{rate / 1e12:.0f} TFLOP/s, the cost model with this profile says "
                     f"{model / 1e12:.0f} ({model / rate - 1:+.0%})")
    if m.attn_path != "cudnn":
        lines.append(f"warning: attention ran on the simple kernels, not cuDNN ({m.attn_path})")
    if prof.gemm_efficiency >= 1.0 or prof.attn_fwd_efficiency >= 1.0 \
            or prof.attn_bwd_efficiency >= 1.0:
        lines.append("warning: a measured rate reached the peak; efficiency capped at 100 % "
                     "(is --peak-tflops right for this GPU?)")
    return "\n".join(lines)
