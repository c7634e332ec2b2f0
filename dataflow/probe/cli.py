"""dataflow-probe: measure this GPU and its host, write the HardwareProfile the planner reads
(dataflow-plan, dataflow-demo and the Engine pick it up for the GPU of the same name) and print
it beside the built-in profile. Exit 0 done, 2 bad input or no GPU, 1 a failure while measuring."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

from dataflow.memplan.cli_args import OneLineParser, parse_or_exit_code, positive
from dataflow.memplan.plan.profiles import default_cache_path, known_profiles, save_profile
from dataflow.models.config import load_config, zoo_names
from dataflow.models.errors import ConfigError

PROG = "dataflow-probe"
log = logging.getLogger("dataflow.probe")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=(
        "Measure this machine on its first GPU with the engine's own copy path and kernels: "
        "pinned host->device and device->host bandwidth alone and both at once, device memory "
        "bandwidth (device-to-device copy), the host AdamW rate (and host memcpy, shown only), "
        "one layer's bf16 GEMMs at MODEL's dimensions and 8192-token chunks, and fused "
        "attention forward and backward for an 8192-token chunk and for the last chunk of a "
        "65536-token sequence. Compute is timed for seconds, so efficiencies are the sustained "
        "(power-capped) rates over the datasheet peak. Writes the profile (the built-in one of "
        "this GPU with every measured field replaced) and prints it beside the built-in. "
        "Needs an NVIDIA GPU with CuPy: without one it exits with status 2."))
    p.add_argument("--model", default="8b", metavar="NAME",
                   help=f"model whose layer shapes are measured: {', '.join(zoo_names())} or a "
                        "config path (default 8b)")
    p.add_argument("--quick", action="store_true",
                   help="smaller copies and 8 s of GEMMs instead of 30 (under a minute on an "
                        "H100); the default takes about 90 s")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help=f"where to write the profile (default {default_cache_path()}, which "
                        "get_profile reads: dataflow-plan --gpu NAME and dataflow-demo then use "
                        "it; another FILE is used with dataflow-plan --profile FILE)")
    p.add_argument("--base", default=None, metavar="NAME",
                   help="built-in profile to compare with and to take the unmeasured fields "
                        f"from ({', '.join(known_profiles())}; default: the one matching the "
                        "GPU's name); the written profile carries this name")
    p.add_argument("--peak-tflops", type=positive(float), default=None, metavar="X",
                   help="this GPU's dense bf16 peak in TFLOP/s (default: the base profile's); "
                        "the efficiencies are measured rates over it")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    return p


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, code = parse_or_exit_code(build_parser(), argv, PROG)
    if args is None:
        return code
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format=f"{PROG}: %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(args.model)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    from dataflow.backends.cupy_backend import gpu_available

    if not gpu_available():
        return _fail("no NVIDIA GPU usable through CuPy here; the probe measures the GPU it runs "
                     "on: run it on the GPU machine (pip install -e '.[gpu]'), or plan with a "
                     "built-in profile (dataflow-plan --gpu NAME)", 2)
    try:
        return _probe(args, cfg)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    except Exception as exc:  # noqa: BLE001 - one line of reason; traceback with --debug
        if args.debug:
            traceback.print_exc()
        return _fail(f"failed while measuring: {type(exc).__name__}: {exc} (rerun with --debug)",
                     1)


def _probe(args, cfg) -> int:
    from dataflow.probe import measure
    from dataflow.probe.profile import build_profile, builtin_profile, format_table

    name, _, _ = measure.device_info()
    base = builtin_profile(name, args.base)  # before measuring: a bad --base costs nothing
    settings = measure.QUICK if args.quick else measure.FULL
    m = measure.measure_all(cfg, settings)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    prof = build_profile(base, m, cfg, peak)
    out = save_profile(prof, args.out if args.out is not None else default_cache_path())
    print(format_table(base, prof, m, cfg))
    how = (f"dataflow-plan --gpu {base.name} and dataflow-demo on this GPU use it"
           if args.out is None else f"plan with it: dataflow-plan ... --profile {out}")
    print(f"wrote {out} ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
