"""Hardware profiles: built-in defaults by GPU name, JSON load/save, and the cached profile that
`dataflow-probe` (dataflow/probe/) measures on the current GPU (it overrides the default of the
same name).
Pure data: never imports array libraries, never touches a GPU.

Efficiencies are fractions of the dense bf16 peak. Attention efficiencies count *hardware*
FLOPs, as fused-attention benchmarks do: the backward counts the score recompute too (2.5x the
forward's matmuls, where dataflow.models.flops counts 2x for model FLOPs)."""

from __future__ import annotations

import os
from pathlib import Path

from dataflow.memplan.plan.plan import GIB, HardwareProfile
from dataflow.models.errors import ConfigError
from dataflow.models.serial import from_json, to_json

GB = 1e9
DEFAULT_PROFILE_NAME = "h100"


def _p(name: str, peak: float, gemm: float, attn_f: float, attn_b: float, pcie_alone: float,
       pcie_duplex: float, host_mem: float, dev_mem: float, gen: int,
       dev_gib: int, fp8_gemm: float | None = None,
       host_copy: float | None = None) -> HardwareProfile:
    return HardwareProfile(
        name=name, peak_bf16_flop_per_s=peak, gemm_efficiency=gemm, attn_fwd_efficiency=attn_f,
        attn_bwd_efficiency=attn_b, h2d_bytes_per_s=pcie_alone, d2h_bytes_per_s=pcie_alone,
        h2d_duplex_bytes_per_s=pcie_duplex, d2h_duplex_bytes_per_s=pcie_duplex,
        host_mem_bytes_per_s=host_mem, device_mem_bytes_per_s=dev_mem, pcie_gen=gen,
        device_mem_bytes=dev_gib * GIB,
        library_reserve_bytes=0 if name == "cpu" else LIBRARY_RESERVE_BYTES,
        host_overhead_bytes=HOST_OVERHEAD_BYTES, fp8_gemm_flop_per_s=fp8_gemm,
        host_copy_bytes_per_s=host_copy)


LIBRARY_RESERVE_BYTES = 3 * GIB // 4
"""What the CUDA libraries hold on the device beyond the arena once the engine runs (cuDNN 9
graphs and handle, cuBLAS, CuPy's kernel modules). With an arena of the whole budget, device
used minus the context minus the budget read +0.15 (1b@8k) to +0.31 GiB (8b@128k) on the H100;
at 1b@512k with a 23.5 GiB arena, NVML's per-process peak was 24.09 GiB, of which 0.05 is the
context (the device-wide rise when it was created): 0.54 GiB beside the arena, 0.32 of it seen
device-wide (bench/records/budget-truth-h100/). The NumPy backend has none."""
HOST_OVERHEAD_BYTES = 5 * GIB // 2
"""Process RSS beyond the host arena (CPython, NumPy, CuPy, numba's compiled kernels, the
schedule's event objects, the token data), peak sampled every 0.2 s on the H100 host: +0.83 to
+1.22 GiB with cudaHostAlloc (8b@8k, 1b@8k, 8b@64k, 8b@128k), +1.05 at 1b@512k and +2.12 at
8b@128k with the registered slab (bench/records/budget-truth-h100/); where 8b@128k's extra
gigabyte goes is not yet known."""


SUSTAINED_POWER_FACTOR = 680 / 780
"""Sustained / burst matmul rate on the lent H100: 8192^3 bf16 GEMMs (and 8b FFN GEMMs at 16k
tokens) ran at 780 TFLOP/s in a short burst but 672-682 TFLOP/s over 50 s, the SM clock held
at 1305-1455 MHz by the 700 W power cap (throttle reason 'SW power cap'). Training runs for
minutes, so the H100/H200 efficiencies below are the burst measurements times this factor."""

HOST_ADAMW_BYTES_PER_S = 4.2e9
"""What the host optimizer really achieves on the lent H100 host (16 cores, numba AdamW over
pinned memory, 14 bytes moved per parameter): 8b's 8.0e9 parameters took 27 s (instrumented
run, 2026-11-22). The machines' DRAM is far faster, but this is the rate the planner must use
to weigh a host optimizer against one streamed through the GPU. Measured with the kernel's array
conversions; its scalar unpack and pack since (kernels.host.adamw, bit-identical) ran 2x on this
machine's two cores (77 -> 152 M parameters/s) and is not measured on the GPU machine's host yet,
so this rate likely charges a host update too much."""

H200_FP8_GEMM_FLOP_PER_S = 989e12 * 780 / 989 * SUSTAINED_POWER_FACTOR * 15.03 / 8.14
"""The bf16 GEMM rate times FP8's speedup over bf16 on the GEMMs of Llama3-8B's block at 8,192
tokens on the lent H200 (bench.fp8_gemm: 15.03 ms bf16, 8.14 ms FP8 for the three GEMMs of every
projection, bench/records/s26-fp8/call1/fp8_gemm.json): ~1,256 TFLOP/s sustained."""

H100_FP8_GEMM_FLOP_PER_S = 989e12 * 780 / 989 * SUSTAINED_POWER_FACTOR * 14.54 / 7.90
"""The same on the lent H100 (bench.fp8_gemm: 14.54 ms bf16, 7.90 ms FP8,
bench/records/s34/call2/fp8_gemm-h100.json): ~1,251 TFLOP/s sustained. Before it the H100 profile
had no FP8 rate and planned fp8 as if its GEMMs ran at the bf16 rate: 8b at 8k in 80/24 was
predicted at 8,315 tok/s and ran 11,106 on that plan; planned with this rate, 12,097
(bench/records/s34/call1, call2)."""

HOST_GATHER_BYTES_PER_S = 11e9
"""The embedding-row gather as the executor runs it (np.take(table, ids, axis=0, out=rows,
mode="clip") into pinned memory, bf16 rows), read + write counted, on the lent H200's host
(16 cores, one thread gathers): 12.3 GB/s for 8b's 8,192 rows, 10.3 for 16,384, 11.2 for 32b's
16,384 (median of 9, bench/records/s28-host-gather/host-gather-h200.json). The H200 profile
charged these gathers at HOST_ADAMW_BYTES_PER_S before, 2.7x too slow: 8b LoRA at one round a
step waited 32 ms a step on a gather that takes 11. The H100's host, traced in the fortieth
session (bench/records/s40/call3/, 8b's 8,192 rows): 11.9 ms a gather, 11.3 GB/s, so its profile
takes the same rate."""

_BUILTIN = (
    # H100 SXM: measured on the lent machine (DESIGN.md section 6): GEMM 780, cuDNN attention
    # 620 fwd / 444 bwd (deterministic; the atomic-dQ backward 520, cost.ATTN_ATOMIC_BWD_SPEEDUP)
    # TFLOP/s at 8k in bursts (x SUSTAINED_POWER_FACTOR: 680, 540, 453;
    # torch SDPA forward held 534 over 15 s), PCIe 55 GB/s each way alone, 47 each way
    # together, HBM copy 3.0 TB/s (read + write counted).
    _p("h100", 989e12, 780 / 989 * SUSTAINED_POWER_FACTOR, 620 / 989 * SUSTAINED_POWER_FACTOR,
       444 / 989 * SUSTAINED_POWER_FACTOR, 55 * GB, 47 * GB, HOST_ADAMW_BYTES_PER_S, 3.0e12, 5,
       80, fp8_gemm=H100_FP8_GEMM_FLOP_PER_S, host_copy=HOST_GATHER_BYTES_PER_S),
    # H200: same compute die and 700 W cap as the H100; faster HBM (4.8 TB/s datasheet);
    # PCIe 5 as measured on the H100 host.
    _p("h200", 989e12, 780 / 989 * SUSTAINED_POWER_FACTOR, 620 / 989 * SUSTAINED_POWER_FACTOR,
       444 / 989 * SUSTAINED_POWER_FACTOR, 55 * GB, 47 * GB, HOST_ADAMW_BYTES_PER_S, 4.3e12, 5,
       141, fp8_gemm=H200_FP8_GEMM_FLOP_PER_S, host_copy=HOST_GATHER_BYTES_PER_S),
    # A100 80GB SXM: 312 TFLOP/s datasheet; typical cuBLAS ~250, FlashAttention-2 ~60%/50%;
    # PCIe 4 x16 ~25 GB/s alone, ~21 together; HBM2e 2.0 TB/s datasheet.
    _p("a100", 312e12, 0.80, 0.60, 0.50, 25 * GB, 21 * GB, 100 * GB, 1.8e12, 4, 80),
    # RTX 4090: 165 TFLOP/s dense bf16 with fp32 accumulation; PCIe 4; GDDR6X 1.0 TB/s.
    _p("rtx4090", 165e12, 0.85, 0.70, 0.55, 25 * GB, 21 * GB, 60 * GB, 0.9e12, 4, 24),
    # RTX 5090: 209.5 TFLOP/s dense bf16 (ml_dataflow's peak); PCIe 5; GDDR7 1.79 TB/s.
    _p("rtx5090", 209.5e12, 0.85, 0.70, 0.55, 50 * GB, 43 * GB, 60 * GB, 1.6e12, 5, 32),
    # RTX 3090: 71 TFLOP/s dense bf16; PCIe 4; GDDR6X 0.94 TB/s.
    _p("rtx3090", 71e12, 0.85, 0.70, 0.55, 25 * GB, 21 * GB, 60 * GB, 0.85e12, 4, 24),
    # The NumPy backend: the "device" is a host slab, copies are memcpy. Only for planning CPU
    # runs (tests, CI); its predictions mean little.
    _p("cpu", 2e11, 0.5, 0.3, 0.3, 10 * GB, 8 * GB, 20 * GB, 20 * GB, 0, 16),
)
BUILTIN_PROFILES: dict[str, HardwareProfile] = {p.name: p for p in _BUILTIN}

_ALIASES = {
    "h100sxm": "h100", "h100sxm5": "h100", "h10080gb": "h100", "h200sxm": "h200",
    "a10080gb": "a100", "a100sxm": "a100", "a10080gbsxm": "a100",
    "4090": "rtx4090", "5090": "rtx5090", "3090": "rtx3090",
    "geforcertx4090": "rtx4090", "geforcertx5090": "rtx5090", "geforcertx3090": "rtx3090",
}


def known_profiles() -> list[str]:
    """Names `get_profile` accepts without a file (aliases such as 'H100 SXM' also work)."""
    return list(BUILTIN_PROFILES)


def _canonical(name: str) -> str | None:
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    key = key.removeprefix("nvidia")
    if key in BUILTIN_PROFILES:
        return key
    return _ALIASES.get(key)


def default_cache_path(environ: dict | None = None) -> Path:
    """Where `dataflow-probe` writes the profile it measured:
    $XDG_CACHE_HOME/dataflow/profile.json, else ~/.cache/dataflow/profile.json."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dataflow" / "profile.json"


def load_profile(path: str | Path) -> HardwareProfile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read hardware profile {path}: {exc.strerror}; "
                          f"write one with save_profile or pick --gpu from "
                          f"{', '.join(known_profiles())}") from None
    profile = from_json(HardwareProfile, text)
    validate_profile(profile)
    return profile


def save_profile(profile: HardwareProfile, path: str | Path) -> Path:
    validate_profile(profile)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(profile) + "\n")
    return path


def profile_for_device(name: str) -> HardwareProfile:
    """The profile of a device by the name its driver reports ("NVIDIA H100 80GB HBM3"): the
    built-in (or cached, measured) profile whose name the device name contains, else H100's."""
    try:
        return get_profile(name)
    except ConfigError:
        key = "".join(ch for ch in name.lower() if ch.isalnum())
        for known in known_profiles():
            if known != "cpu" and known in key:
                return get_profile(known)
        return get_profile("h100")


def get_profile(name: str = DEFAULT_PROFILE_NAME, *,
                cache_path: str | Path | None = None) -> HardwareProfile:
    """The built-in profile for GPU `name`, replaced by the cached measured profile when one
    exists at `cache_path` (default: `default_cache_path()`) and carries the same name."""
    canonical = _canonical(name)
    if canonical is None:
        raise ConfigError(f"unknown GPU '{name}'; known: {', '.join(known_profiles())} "
                          "(or pass a measured profile JSON with --profile FILE)")
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    if path.is_file():
        try:
            cached = load_profile(path)
        except ConfigError:
            cached = None  # a stale or broken cache must not stop planning; defaults apply
        if cached is not None and _canonical(cached.name) == canonical:
            return cached
    return BUILTIN_PROFILES[canonical]


def validate_profile(p: HardwareProfile) -> None:
    rates = ("peak_bf16_flop_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s",
             "h2d_duplex_bytes_per_s", "d2h_duplex_bytes_per_s", "host_mem_bytes_per_s",
             "device_mem_bytes_per_s")
    for field in rates:
        if not getattr(p, field) > 0:
            raise ConfigError(f"profile '{p.name}': {field} must be positive, got "
                              f"{getattr(p, field)!r}")
    if p.host_copy_bytes_per_s is not None and not p.host_copy_bytes_per_s > 0:
        raise ConfigError(f"profile '{p.name}': host_copy_bytes_per_s must be positive or "
                          f"absent, got {p.host_copy_bytes_per_s!r}")
    for field in ("gemm_efficiency", "attn_fwd_efficiency", "attn_bwd_efficiency"):
        value = getattr(p, field)
        if not 0 < value <= 1:
            raise ConfigError(f"profile '{p.name}': {field} must be in (0, 1], got {value!r}")
