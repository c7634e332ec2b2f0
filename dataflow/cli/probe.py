"""dataflow-probe: measure this GPU and its host, write the HardwareProfile the planner reads
(dataflow-plan, dataflow-demo and the Engine pick it up for the GPU of the same name) and print
it beside the built-in profile. Exit 0 done, 2 bad input or no GPU, 1 a failure while measuring.
The measuring is dataflow.probe's; this module only reads the command line and reports."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dataflow.backends import cupy_backend
from dataflow.cli.args import BAD_INPUT, Debug, OneLineParser, Outcome, positive, run_command
from dataflow.memplan.plan.profiles import default_cache_path, known_profiles, save_profile
from dataflow.probe.profile import build_profile, builtin_profile, format_table
from dataflow.models.config import zoo_names
from dataflow.models.errors import ConfigError
from dataflow.models.hf_config import MODEL_FORMS, model_config

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
    p.add_argument("--model", default="8b", metavar="MODEL",
                   help=f"model whose layer shapes are measured: {MODEL_FORMS} (zoo: "
                        f"{', '.join(zoo_names())}; default 8b)")
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


NO_GPU = ("no NVIDIA GPU usable through CuPy here; the probe measures the GPU it runs on: run it "
          "on the GPU machine (pip install -e '.[gpu]'), or plan with a built-in profile "
          "(dataflow-plan --gpu NAME)")


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv, _measure, log_format=f"{PROG}: %(message)s",
                       outcomes=(
        Outcome(catch=(ConfigError,), exit_code=BAD_INPUT.exit_code, debug=Debug.QUIET),
        Outcome(catch=(Exception,), exit_code=1, debug=Debug.TRACEBACK,
                words="failed while measuring: {name}: {exc} (rerun with --debug)")))


def _measure(args) -> int:
    cfg = model_config(args.model)
    if not cupy_backend.gpu_available():
        raise ConfigError(NO_GPU)
    return _probe(args, cfg)


def _probe(args, cfg) -> int:
    # measure imports CuPy when loaded: imported only once a GPU is known to be usable, so the
    # probe says "no GPU" (exit 2) on a machine without CuPy instead of failing to import
    from dataflow.probe import measure

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
