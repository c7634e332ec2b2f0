"""Setup speed on one GPU (issue 13: model init in <= 15 s; issue 16: a second run's step 1 within
3 s of its step 2). Measures, and writes one JSON record with the device, commit and config:

  pinning  for each variant, pin --gib GiB of host memory and time it: 'alloc' (cudaHostAlloc),
           'register' (mmap, parallel first touch, cudaHostRegister in one call),
           'register-pieces' (the same registered as --pieces ranges from as many threads),
           'register-untouched' (no first touch: registration faults the pages),
           'register-populate' (MAP_POPULATE instead of the parallel touch); then the H2D and
           D2H bandwidth from the buffer (pinned memory either way, so equal), for the pieces
           variant also across a piece boundary, and the time to free it.
  engine   each --runs entry in a fresh process ('PIN:warm' or 'PIN:cold', PIN = register |
           alloc): Engine setup phases (backend, plan, executor = schedule + arenas + pinning,
           zero_state, init_weights, synchronize, warm_up; the pinning's own map/touch/register
           split; warm_up's parts and how many cuDNN graphs it built or read from disk), then
           --steps steps: step 1 minus step 2 is what first-use builds still cost (--steps 0:
           setup only). Runs share one set of disk caches (CuPy kernels, numba, cuDNN graphs),
           fresh unless --keep-caches, so the first run shows a cold start and later runs a warm
           one; a 'cold' run has the cuDNN graph cache off (every graph built). Default:
           register:warm (first run ever), register:warm (the second run issue 16 asks about),
           alloc:cold.

    python -m dataflow.bench.setup_speed --out bench/records/setup-speed-h100.json      # 40 GiB, 1b@8k 40/16
    python -m dataflow.bench.setup_speed --gib 100 --model 8b --host-gb 80 --dev-gb 24 --out runs/s8b.json

The short table comes last on stdout. Never changes the engine's code paths: it sets
DATAFLOW_PIN (and for a cold run DATAFLOW_CUDNN_CACHE_DIR=off) for each engine process."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dataflow.bench.sweep.sweep import git_commit as commit_of
from dataflow.cli.args import positive

REPO_ROOT = Path(__file__).resolve().parents[1]
PIN_VARIANTS = ("alloc", "register", "register-pieces", "register-untouched",
                "register-populate")
RUN_PINS = ("register", "alloc")
GIB = 1 << 30
_COPY_BYTES = 1 << 30
"""Bytes per bandwidth copy (1 GiB, repeated), within every pinned buffer of >= 1 GiB."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One engine process: how its host slab is pinned and whether it may read cuDNN graphs
    from the disk cache (warm) or must build them (cold)."""

    pin: str
    warm: bool

    @property
    def label(self) -> str:
        return f"{self.pin}:{'warm' if self.warm else 'cold'}"


def parse_runs(text: str) -> tuple[RunSpec, ...]:
    """'register:warm,alloc:cold' -> RunSpecs; ValueError names a bad entry and the choices."""
    specs = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        pin, _, mode = item.partition(":")
        mode = mode or "warm"
        if pin not in RUN_PINS or mode not in ("warm", "cold"):
            raise ValueError(f"run {item!r}: write PIN:warm or PIN:cold with PIN one of "
                             f"{', '.join(RUN_PINS)}")
        specs.append(RunSpec(pin=pin, warm=mode == "warm"))
    return tuple(specs)


def parse_variants(text: str) -> tuple[str, ...]:
    out = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in out if v not in PIN_VARIANTS]
    if bad:
        raise ValueError(f"unknown pinning variant(s) {', '.join(bad)}; known: "
                         f"{', '.join(PIN_VARIANTS)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dataflow.bench.setup_speed",
        description="Time host pinning, engine setup phases and step 1 vs step 2 on this GPU. "
                    "GB means GiB (2^30 bytes).")
    p.add_argument("--out", required=True, help="JSON record to write")
    p.add_argument("--gib", type=positive(float), default=40.0,
                   help="GiB each pinning variant pins (default 40)")
    p.add_argument("--pieces", type=positive(int), default=8,
                   help="ranges (and threads) of 'register-pieces' (default 8)")
    p.add_argument("--variants", default="alloc,register,register-pieces",
                   help=f"pinning variants, comma-separated, of {', '.join(PIN_VARIANTS)}")
    p.add_argument("--model", default="1b")
    p.add_argument("--seqlen", type=positive(int), default=8192)
    p.add_argument("--host-gb", type=positive(float), default=40.0)
    p.add_argument("--dev-gb", type=positive(float), default=16.0)
    p.add_argument("--runs", default="register:warm,register:warm,alloc:cold",
                   help="engine processes in order, PIN:warm|cold each (PIN register|alloc; cold: "
                        "cuDNN graphs built, not read from disk)")
    p.add_argument("--steps", type=_steps, default=2,
                   help="steps per engine run: 0 (setup only) or >= 2 (default 2)")
    p.add_argument("--keep-caches", action="store_true",
                   help="use this user's CuPy, numba and cuDNN graph caches instead of fresh ones")
    p.add_argument("--run-timeout", type=positive(float), default=300.0,
                   help="seconds one engine process may take (default 300)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def _steps(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps >= 0")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.variant_list = parse_variants(args.variants)
        args.run_list = parse_runs(args.runs)
    except ValueError as exc:
        p.error(str(exc))
    if args.steps == 1 and args.run_list:
        p.error(f"--steps {args.steps}: step 1 is compared with step 2, so give at least 2 "
                f"(or 0 for setup only)")
    return args


def config_of(args: argparse.Namespace) -> dict:
    return {"gib": args.gib, "pieces": args.pieces, "variants": list(args.variant_list),
            "model": args.model, "seqlen": args.seqlen, "host_gb": args.host_gb,
            "dev_gb": args.dev_gb, "runs": [r.label for r in args.run_list],
            "steps": args.steps, "keep_caches": bool(args.keep_caches)}


def git_commit() -> str | None:
    """This tree's commit (dataflow.bench.sweep's: a checkout's HEAD, +dirty, or a git archive's)."""
    return commit_of(REPO_ROOT)


def mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- the GPU side --------------------------------------------------------------------------------
class CudaProbe:
    """Pinning and bandwidth measurements in this process, engine runs in child processes."""

    def __init__(self):
        import cupy as cp

        self.cp = cp
        cp.cuda.Device(0).use()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.dev_buf = cp.empty(_COPY_BYTES, dtype=cp.uint8)  # also creates the context
        cp.cuda.runtime.deviceSynchronize()
        import numpy as np

        # numba-compiled (about 2 s to import): loaded by the GPU probe only, beside CuPy
        from dataflow.kernels.host.memory import prefault_zero

        prefault_zero(np.zeros(1 << 16, np.uint8))  # load (or compile) the touch kernel now

    def device(self) -> dict:
        cp = self.cp
        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        return {"name": name.decode() if isinstance(name, bytes) else str(name),
                "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                "cuda_driver": cp.cuda.runtime.driverGetVersion(),
                "host_mem_available_bytes": mem_available_bytes(), "cpu_count": os.cpu_count()}

    def _bandwidth(self, host_ptr: int, nbytes: int, to_device: bool, repeats: int = 4) -> float:
        """Bytes per second of `repeats` async copies of nbytes between host_ptr and the device
        buffer, timed with CUDA events on one stream (one untimed copy first)."""
        cp, s, d = self.cp, self.stream, self.dev_buf.data

        def one():
            if to_device:
                d.copy_from_host_async(host_ptr, nbytes, s)
            else:
                d.copy_to_host_async(host_ptr, nbytes, s)

        one()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(s)
        for _ in range(repeats):
            one()
        end.record(s)
        end.synchronize()
        return nbytes * repeats / (cp.cuda.get_elapsed_time(start, end) / 1e3)

    def pin(self, variant: str, nbytes: int, pieces: int) -> dict:
        """Pin nbytes the `variant` way; time it, the copies from it and the free."""
        import numpy as np

        from dataflow.backends.cupy_backend import MappedHostMemory, piece_bounds  # needs CuPy

        cp = self.cp
        gc.collect()
        rec = {"variant": variant, "nbytes": nbytes}
        rss0 = _rss()
        t0 = time.perf_counter()
        if variant == "alloc":
            mem = cp.cuda.PinnedMemory(nbytes)
            arr = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, nbytes)
            ptr = mem.ptr
        else:
            n_pieces = pieces if variant == "register-pieces" else 1
            populate = {"register-untouched": "none",
                        "register-populate": "populate"}.get(variant, "touch")
            mem = MappedHostMemory(
                nbytes, lambda p, n: cp.cuda.runtime.hostRegister(p, n, 1),
                cp.cuda.runtime.hostUnregister, pieces=n_pieces, populate=populate)
            arr = np.asarray(mem)
            ptr = mem.ptr
            rec.update({f"{k}_s": v for k, v in mem.seconds.items()})
            rec["pieces"] = mem.registered_pieces
        rec["pin_s"] = time.perf_counter() - t0
        rec["rss_growth_minus_pinned_bytes"] = _rss() - rss0 - nbytes
        rec["pin_gib_per_s"] = nbytes / GIB / rec["pin_s"]
        n = min(_COPY_BYTES, nbytes)
        mid = (nbytes - n) // 2 // 4096 * 4096
        if variant == "register-pieces":  # inside the first piece, which starts at 0
            mid = 0 if piece_bounds(nbytes, pieces)[0][1] >= n else mid
        rec["h2d_bytes_per_s"] = self._bandwidth(ptr + mid, n, True)
        rec["d2h_bytes_per_s"] = self._bandwidth(ptr + mid, n, False)
        if variant == "register-pieces" and rec.get("pieces", 1) > 1:
            boundary = piece_bounds(nbytes, pieces)[1][0]
            lo = max(0, min(boundary - n // 2, nbytes - n))
            rec["h2d_across_pieces_bytes_per_s"] = self._bandwidth(ptr + lo, n, True)
            rec["d2h_across_pieces_bytes_per_s"] = self._bandwidth(ptr + lo, n, False)
        self.stream.synchronize()
        t0 = time.perf_counter()
        del arr
        if variant == "alloc":
            del mem  # cudaFreeHost when the last reference goes
        else:
            mem.free()
            del mem
        gc.collect()
        rec["free_s"] = time.perf_counter() - t0
        return rec

    def engine_run(self, args, spec: RunSpec, env: dict) -> dict:
        child = {"model": args.model, "seqlen": args.seqlen, "host_gb": args.host_gb,
                 "dev_gb": args.dev_gb, "steps": args.steps, "warm": spec.warm}
        cmd = [sys.executable, "-m", "dataflow.bench.setup_speed", "--out", "-", "--child",
               json.dumps(child)]
        env = {**os.environ, **env, "DATAFLOW_PIN": spec.pin}
        if not spec.warm:
            env["DATAFLOW_CUDNN_CACHE_DIR"] = "off"
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                  timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            return {"run": spec.label, "status": "timeout", "wall_s": args.run_timeout}
        wall = time.perf_counter() - t0
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr or "").strip().splitlines()[-3:]
            return {"run": spec.label, "status": f"exit {done.returncode}", "wall_s": wall,
                    "error": " | ".join(tail)}
        rec = json.loads(lines[-1])
        rec.update({"run": spec.label, "status": "ok", "wall_s": wall})
        return rec


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def child_main(spec_json: str) -> int:
    """One engine run in this (fresh) process; prints one JSON line."""
    t_proc = time.perf_counter()
    spec = json.loads(spec_json)
    import cupy  # noqa: F401 - timed: the import is part of a run's start-up
    import numpy as np

    from dataflow.engine import Engine  # timed too, as the cupy import above

    imports_s = time.perf_counter() - t_proc
    t0 = time.perf_counter()
    eng = Engine(spec["model"], host_gb=spec["host_gb"], dev_gb=spec["dev_gb"],
                 seqlen=spec["seqlen"], backend="cupy")
    out = {"imports_s": imports_s, "setup_s": time.perf_counter() - t0,
           "rss_after_setup_minus_host_budget_bytes": _rss() - int(spec["host_gb"] * GIB),
           "setup_phases_s": dict(getattr(eng, "setup_seconds", {})),
           "pin": getattr(eng.be, "last_pin", None)}
    out["warmup_parts_s"] = dict(getattr(eng, "warm_up_parts", {}))  # the engine warms itself
    out["prebuild_parts_s"] = dict(getattr(eng, "prebuild_parts", {}))  # in a thread, pinning
    out["warmup_s"] = out["setup_phases_s"].get("warm_up")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, eng.plan.model.vocab_size, (eng.seqs_per_step, spec["seqlen"] + 1),
                          dtype=np.int64)
    steps = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        r = eng.train_step(tokens)
        steps.append({"wall_s": time.perf_counter() - t0, "step_time_s": r.step_time_s,
                      "tok_per_s": r.tok_per_s, "loss": r.loss})
    out["steps"] = steps
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    out["peak_rss_minus_host_budget_bytes"] = peak - int(spec["host_gb"] * GIB)
    out["step1_minus_step2_s"] = steps[0]["wall_s"] - steps[1]["wall_s"] if steps else None
    out["time_to_first_step_s"] = time.perf_counter() - t_proc - sum(s["wall_s"] for s in steps)
    eng.close()
    print(json.dumps(out), flush=True)
    return 0


# -- orchestration (runs with any probe: the CPU tests pass a fake) -------------------------------
def collect(args: argparse.Namespace, probe, log=print) -> dict:
    """Every measurement the arguments ask for, as one JSON-ready dict."""
    record = {"schema": "setup_speed/1", "commit": git_commit(), "config": config_of(args),
              "device": probe.device(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "pinning": [], "engine_runs": []}
    nbytes = int(args.gib * GIB)
    avail = record["device"].get("host_mem_available_bytes")
    for variant in args.variant_list:
        if avail is not None and nbytes > 0.9 * avail:
            record["pinning"].append({"variant": variant, "nbytes": nbytes, "status":
                                      f"skipped: {args.gib:g} GiB > 90 % of available host "
                                      f"memory {avail / GIB:.1f} GiB; lower --gib"})
            continue
        log(f"pinning {args.gib:g} GiB: {variant} ...")
        try:
            rec = probe.pin(variant, nbytes, args.pieces)
            rec["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one failed variant must not lose the others
            rec = {"variant": variant, "nbytes": nbytes, "status": f"{type(exc).__name__}: {exc}"}
        record["pinning"].append(rec)
    cache_root = None
    env = {}
    if args.run_list and not args.keep_caches:
        cache_root = tempfile.mkdtemp(prefix="dataflow-setup-speed-")
        env = {"CUPY_CACHE_DIR": os.path.join(cache_root, "cupy"),
               "NUMBA_CACHE_DIR": os.path.join(cache_root, "numba"),
               "DATAFLOW_CUDNN_CACHE_DIR": os.path.join(cache_root, "cudnn")}
        record["cache_dirs"] = env
    for i, spec in enumerate(args.run_list):
        log(f"engine run {i + 1}/{len(args.run_list)}: {spec.label} ...")
        record["engine_runs"].append(probe.engine_run(args, spec, env))
    return record


def _graphs(parts: dict) -> str:
    built, disk = parts.get("attention_graphs_built"), parts.get("attention_graphs_from_cache")
    return "-" if built is None else f"{built}/{disk}"


def _f(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(record: dict) -> str:
    """The short human summary printed last."""
    lines = [f"device {record['device'].get('name')}  commit {record['commit']}  "
             f"config {json.dumps(record['config'], sort_keys=True)}"]
    if record["pinning"]:
        lines.append(f"{'pinning':20s} {'pin s':>7s} {'GiB/s':>6s} {'touch s':>7s} "
                     f"{'reg s':>6s} {'free s':>6s} {'H2D GB/s':>8s} {'D2H GB/s':>8s} "
                     f"{'H2D across':>10s}")
        for p in record["pinning"]:
            if p.get("status") != "ok":
                lines.append(f"{p['variant']:20s} {p.get('status')}")
                continue
            def gbs(k, p=p):
                return None if p.get(k) is None else p[k] / 1e9

            lines.append(f"{p['variant']:20s} {_f(p.get('pin_s')):>7s} "
                         f"{_f(p.get('pin_gib_per_s'), '{:.1f}'):>6s} "
                         f"{_f(p.get('touch_s')):>7s} {_f(p.get('register_s')):>6s} "
                         f"{_f(p.get('free_s')):>6s} {_f(gbs('h2d_bytes_per_s'), '{:.1f}'):>8s} "
                         f"{_f(gbs('d2h_bytes_per_s'), '{:.1f}'):>8s} "
                         f"{_f(gbs('h2d_across_pieces_bytes_per_s'), '{:.1f}'):>10s}")
    if record["engine_runs"]:
        lines.append(f"{'engine run':16s} {'setup s':>7s} {'pin s':>6s} {'zero s':>6s} "
                     f"{'init s':>6s} {'warm s':>6s} {'step1 s':>7s} {'step2 s':>7s} "
                     f"{'1-2 s':>6s} {'to step1 s':>10s} {'graphs built/disk':>17s}")
        for r in record["engine_runs"]:
            if r.get("status") != "ok":
                lines.append(f"{r['run']:16s} {r.get('status')} {r.get('error', '')}")
                continue
            ph = r.get("setup_phases_s", {})
            steps = r.get("steps", [])
            lines.append(f"{r['run']:16s} {_f(r.get('setup_s')):>7s} "
                         f"{_f((r.get('pin') or {}).get('seconds')):>6s} "
                         f"{_f(ph.get('zero_state')):>6s} {_f(ph.get('init_weights')):>6s} "
                         f"{_f(r.get('warmup_s')):>6s} "
                         f"{_f(steps[0]['wall_s'] if steps else None):>7s} "
                         f"{_f(steps[1]['wall_s'] if len(steps) > 1 else None):>7s} "
                         f"{_f(r.get('step1_minus_step2_s')):>6s} "
                         f"{_f(r.get('time_to_first_step_s')):>10s} "
                         f"{_graphs(r.get('warmup_parts_s') or {}):>17s}")
    return "\n".join(lines)


def write_record(record: dict, out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None, probe=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    if probe is None:
        try:
            probe = CudaProbe()
        except Exception as exc:  # noqa: BLE001 - no CuPy, no GPU: one line, exit 1
            print(f"setup_speed needs CuPy and a GPU: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 1
    record = collect(args, probe, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    write_record(record, args.out)
    print(table(record))
    print(f"record written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
