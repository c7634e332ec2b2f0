"""`dataflow-sweep run ...` and `dataflow-sweep plot DIR`: the sweep's command line. Parses and
checks arguments, then hands a SweepConfig to dataflow.bench.sweep's run_sweep or a directory to
its plot_sweep. Exit 0 when done (failed cells are results, not errors), 2 with one line for bad
input, 1 for a failure while running; tracebacks only with --debug. Never decides anything
itself and never runs a cell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dataflow.bench.sweep.executors import SubmititExecutor
from dataflow.bench.sweep.grid import (
    expand,
    parse_ints,
    parse_names,
    parse_numbers,
    parse_precisions,
)
from dataflow.bench.sweep.planning import resolve_backend
from dataflow.bench.sweep.sweep import SweepConfig, run_sweep
from dataflow.cli.args import (
    BAD_INPUT,
    FAILED,
    OneLineParser,
    Outcome,
    UsageError,
    add_lora_flags,
    add_version_flag,
    lora_of,
    positive,
    run_command,
)
from dataflow.memplan.plan.chunking import MAX_SEQLEN
from dataflow.memplan.plan.lora import refuse_unsupported
from dataflow.models.errors import ConfigError
from dataflow.models.hf_config import MODEL_FORMS, model_config
from dataflow.precision import PRECISIONS

PROG = "dataflow-sweep"

EPILOG = """\
examples:
  dataflow-sweep run --model tiny --seqlen 128 --host 1,2 --dev 0.25,0.5 --steps 2 \\
      --backend numpy --out runs/tiny
  dataflow-sweep run --model 8b --seqlen 8192 --host 60,80,100,120 --dev 16:40:8,78 \\
      --steps 3 --backend cupy --out runs/8b-8k
  dataflow-sweep run --predict-only --gpu h100 --model 1b,8b --seqlen 8192 \\
      --host 20:120:20 --dev 8:80:8 --out runs/predicted
  dataflow-sweep run --predict-only --gpu h200 --model 8b,32b --seqlen 8192 \\
      --host 24:80:8 --dev 24 --lora-rank 16 --out runs/lora
  dataflow-sweep run --predict-only --gpu h200 --model 8b --seqlen 8192 \\
      --host 64,80 --dev 24 --precision bf16,fp8 --out runs/8b-fp8
  dataflow-sweep plot runs/8b-8k

GB means GiB (2^30 bytes). A range start:stop:step includes stop when the steps land on it.
Run again to resume: cells with a record in the directory are skipped (--redo runs them again).
--precision bf16,fp8 makes precision a grid axis: every cell in both, one table row each.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog=EPILOG,
                description="Memory x throughput sweeps: run the demo's engine for every cell "
                            "of a grid of host and device budgets (each in a fresh process), "
                            "keep one resumable table (Parquet + CSV) and draw heatmaps.")
    add_version_flag(p)
    sub = p.add_subparsers(dest="command", metavar="{run,plot}", parser_class=OneLineParser)
    run = sub.add_parser("run", help="run (or predict) a grid of cells into a sweep directory",
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    run.add_argument("--model", required=True,
                     help=f"models, comma-separated (e.g. 1b,8b); each {MODEL_FORMS}")
    run.add_argument("--seqlen", required=True, help="tokens per sequence: list or range")
    run.add_argument("--host", required=True,
                     help="host budgets in GiB: a list (60,80,100) or a range (20:60:10)")
    run.add_argument("--dev", required=True, help="device budgets in GiB: list or range")
    run.add_argument("--out", required=True, metavar="DIR", help="sweep directory")
    run.add_argument("--steps", type=positive(int), default=3,
                     help="optimizer steps per cell; means are over the steps after the first "
                          "(default 3)")
    run.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto",
                     help="passed to every cell's demo (default auto: cupy when a GPU is usable)")
    run.add_argument("--timeout", type=positive(float), default=1800.0, metavar="SECONDS",
                     help="per cell, model initialisation included (default 1800)")
    run.add_argument("--redo", action="store_true", help="run cells that already have a record")
    run.add_argument("--predict-only", action="store_true",
                     help="fill the table from the planner alone, starting no process")
    run.add_argument("--fast-attention", action="store_true",
                     help="plan every cell with cuDNN's faster non-deterministic attention "
                          "backward (as dataflow-demo --fast-attention); a sweep directory "
                          "holds one kind")
    run.add_argument("--precision", default="bf16", metavar="LIST",
                     help=f"the linear layers' precision, {' or '.join(PRECISIONS)} (fp8: "
                          "docs/fp8.md), or a comma list (bf16,fp8: a grid axis, each cell "
                          "planned and run in each, one row per cell and precision); a "
                          "directory resumes only with its own precisions (default bf16)")
    add_lora_flags(run)
    prof = run.add_mutually_exclusive_group()
    prof.add_argument("--gpu", metavar="NAME",
                      help="plan for this built-in profile (default: the local GPU's; h100 "
                           "for --predict-only without a GPU; cpu for --backend numpy)")
    prof.add_argument("--profile", metavar="FILE", help="plan for this hardware profile JSON")
    run.add_argument("--executor", choices=("local", "submitit"), default="local",
                     help="local: one cell after another here (default); submitit: one job per "
                          "cell on a Slurm cluster (pip install 'dataflow[sweep-slurm]')")
    run.add_argument("--cluster", choices=("slurm", "local", "debug"), default=None,
                     help="submitit's cluster (default: Slurm when present)")
    run.add_argument("--partition", metavar="NAME", help="Slurm partition for submitit jobs")
    run.add_argument("--debug", action="store_true", help="tracebacks and debug logging")
    plot = sub.add_parser("plot", help="draw the heatmaps of a sweep directory as PNGs")
    plot.add_argument("dir", metavar="DIR", help="sweep directory (holds sweep.parquet)")
    plot.add_argument("--to", metavar="DIR", help="write the PNGs here (default: DIR)")
    plot.add_argument("--util-range", metavar="LO,HI", default="0.35,0.7",
                      help="colour range of MFU and HFU; TFLOP/s and tok/s follow from it "
                           "(default 0.35,0.7, as ml_dataflow's H100 reports)")
    plot.add_argument("--debug", action="store_true", help="tracebacks and debug logging")
    return p


def _config(args) -> SweepConfig:
    if args.executor == "local" and (args.cluster or args.partition):
        raise ConfigError("--cluster and --partition apply to --executor submitit only")
    seqlens = parse_ints(args.seqlen, "--seqlen")
    if max(seqlens) > MAX_SEQLEN:
        raise ConfigError(f"--seqlen {max(seqlens):,} is too large: the planner handles at most "
                          f"{MAX_SEQLEN:,} tokens per sequence")
    models = parse_names(args.model, "--model")
    precisions = parse_precisions(args.precision)
    lora = lora_of(args)  # a bad --lora-* is refused before the sweep directory is made
    for model in models:  # so is a bad model, or LoRA on a model it is not built for
        cfg = model_config(model)
        for precision in precisions:  # or on an FP8 base, also as one item of a list
            refuse_unsupported(cfg, lora, precision=precision, where="dataflow-sweep --lora-rank")
    cells = expand(models, seqlens,
                   parse_numbers(args.host, "--host"), parse_numbers(args.dev, "--dev"),
                   precisions)
    return SweepConfig(cells=cells, out=args.out, steps=args.steps, backend=args.backend,
                       timeout_s=args.timeout, redo=args.redo, predict_only=args.predict_only,
                       gpu=args.gpu, profile_file=args.profile,
                       attention_bwd="fast" if args.fast_attention else "deterministic",
                       precisions=precisions, lora=lora)


def _run(args) -> int:
    config = _config(args)
    executor = None
    if args.executor == "submitit" and not args.predict_only:
        backend = resolve_backend(args.backend)
        executor = SubmititExecutor(str(Path(args.out) / "submitit"), cluster=args.cluster,
                                    timeout_s=args.timeout, partition=args.partition,
                                    gpus_per_node=1 if backend == "cupy" else 0)
    run_sweep(config, executor)
    return 0


def _plot(args) -> int:
    try:
        lo, hi = (float(v) for v in args.util_range.split(","))
    except ValueError:
        raise ConfigError(f"--util-range {args.util_range!r}: write two fractions LO,HI, "
                          "e.g. 0.35,0.7") from None
    if not 0 <= lo < hi:
        raise ConfigError(f"--util-range {args.util_range!r}: need 0 <= LO < HI, e.g. 0.35,0.7")
    try:  # plotting is the optional `plot` extra (matplotlib): imported only to plot
        from dataflow.bench.sweep.plot import plot_sweep
    except ImportError as exc:
        raise ConfigError(f"plotting needs matplotlib ({exc}); pip install 'dataflow[plot]'") \
            from None
    for path in plot_sweep(args.dir, args.to, util_range=(lo, hi)):
        print(path)
    return 0


def _command(args) -> int:
    if args.command is None:
        raise UsageError("say run or plot")
    return _run(args) if args.command == "run" else _plot(args)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv, _command, log_format="%(message)s", outcomes=(
        Outcome(catch=(ConfigError, ImportError, OSError), exit_code=BAD_INPUT.exit_code),
        FAILED))


if __name__ == "__main__":
    sys.exit(main())
