"""`dataflow-plan <host_gb> <dev_gb> <seqlen> <model> [--gpu NAME | --profile FILE] [--gpus N]
[--seqs-per-step N | --tokens-per-step N] [--json]`: print the plan the planner would choose (or exactly one JSON document with --json);
with --gpus N, each ring device's plan, the ring's predicted throughput and its scaling model. Exit 0 on
success, 2 with one paragraph on stderr for bad input or infeasible budgets, 1 for an internal
failure; tracebacks only with --debug. Never imports array libraries."""

from __future__ import annotations

import argparse
import math
import sys
import traceback

from dataflow.memplan.plan.errors import InfeasibleBudget, categories_text, size_text
from dataflow.models.errors import ConfigError
from dataflow.models.serial import to_json
from dataflow.memplan.cli_args import (
    OneLineParser,
    add_version_flag,
    parse_or_exit_code,
    print_report,
    seqlen_tokens,
)

PROG = "dataflow-plan"


def _budget_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number of GiB")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number")
    return value


def _ranks(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of devices") from None
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{value} devices is outside 1..64")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=(
        "Plan where every byte of training state lives for MODEL at SEQLEN under the host and "
        "device memory budgets, and predict the step. GB means GiB (2^30 bytes)."))
    p.add_argument("host_gb", type=_budget_gib, help="pinned host memory budget in GiB (2^30 B)")
    p.add_argument("dev_gb", type=_budget_gib, help="device memory budget in GiB (2^30 B)")
    p.add_argument("seqlen", type=seqlen_tokens, help="tokens per sequence (at most 16,777,216)")
    p.add_argument("model", help="zoo name (tiny, small, 1b, 8b, 15b, 32b, llama3.2-1b, mistral-7b, qwen2.5-7b, "
                        "qwen3-8b, ...) or a config path")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gpu", metavar="NAME", default=None,
                     help="built-in hardware profile (default h100; a measured profile cached by "
                          "dataflow-probe replaces the built-in one of the same name)")
    src.add_argument("--profile", metavar="FILE", help="hardware profile JSON to plan for")
    p.add_argument("--gpus", type=_ranks, default=1, metavar="N",
                   help="plan for N GPUs (budgets are per device): the split into replicas of a "
                        "ring (layer i on device i mod ring size) that predicts the most tok/s, "
                        "with the alternatives weighed, each device's plan, the prediction over "
                        "NVLink, InfiniBand, 10 GbE and a 1 Gb/s internet link, and the same "
                        "for N = 2..64 (see docs/ring.md); --tokens-per-step caps the global "
                        "batch")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--seqs-per-step", type=_count, default=None, metavar="N",
                       help="the trainer's global batch: plan exactly N sequences per step "
                            "(chunks and rounds chosen around it; default: the planner's)")
    batch.add_argument("--tokens-per-step", type=_count, default=None, metavar="N",
                       help="the same in tokens (a multiple of SEQLEN)")
    p.add_argument("--fast-attention", action="store_true",
                   help="cuDNN's faster non-deterministic attention backward for packed "
                        "sequences too: frees its 2*T*T*heads-byte workspace (4.1 GiB at 8k "
                        "for 1b and 8b) for the plan; dQ may then differ in the last bits from "
                        "run to run (default: deterministic; not built for --gpus yet)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_version_flag(p)
    return p


def _run(args) -> str:
    from dataflow.memplan.search.explain import explain
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.plan.profiles import get_profile, load_profile
    from dataflow.memplan.search.search import make_plan
    from dataflow.models.config import load_config

    profile = load_profile(args.profile) if args.profile else get_profile(args.gpu or "h100")
    cfg = load_config(args.model)
    budget = Budget.from_gib(args.host_gb, args.dev_gb)
    if args.gpus > 1:
        if args.fast_attention:
            raise ConfigError("--fast-attention is not built for --gpus yet (a ring plans the "
                              "deterministic backward); drop one of them")
        return _ring_text(cfg, args, budget, profile)
    batch = {k: v for k, v in (("seqs_per_step", args.seqs_per_step),
                               ("tokens_per_step", args.tokens_per_step)) if v is not None}
    if args.fast_attention:
        batch["attention_bwd"] = "fast"
    try:
        plan = make_plan(cfg, args.seqlen, budget, profile, **batch)
    except InfeasibleBudget as exc:
        hardware = _hardware_text(args, profile)
        raise ConfigError(f"{_infeasible_text(exc, profile)} {hardware[0].upper()}{hardware[1:]}") \
            from exc
    if args.json:  # the plan embeds its profile; stdout holds the one document only
        return plan.to_json()
    return f"{explain(plan)}\nHardware: {_hardware_text(args, profile)}"


# -- single-device output: which hardware was planned for, and a refusal whose parts add up ----
def _local_gpu() -> bool:
    """Whether this machine shows an NVIDIA GPU (read from the driver's files: the planner never
    imports array libraries, so it cannot ask CuPy as the demo does)."""
    import glob
    import os

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"))


def _hardware_text(args, profile) -> str:
    """One sentence: the profile planned for, where it came from, and, when --gpu/--profile was
    not given on a machine without a GPU, the profile dataflow-demo here would plan with."""
    if args.profile:
        return f"planned for the {profile.name!r} profile of {args.profile}."
    if args.gpu:
        return f"planned for the {profile.name!r} profile (--gpu {args.gpu})."
    if _local_gpu():
        return (f"planned for the {profile.name!r} profile (the default; --gpu NAME plans for "
                "another GPU).")
    return (f"planned for the {profile.name!r} profile (the default), but this machine has no "
            "GPU: dataflow-demo here runs the NumPy backend, which plans with the 'cpu' profile; "
            "add --gpu cpu to see that plan.")


def _infeasible_text(exc: InfeasibleBudget, profile) -> str:
    """The planner's refusal with its device list completed: the plan's own categories leave out
    what the device budget holds outside the arena (the libraries' reserve, and any other fixed
    part), so the list did not add up to the total it named."""
    total = size_text(exc.min_device_bytes)
    listed = f"needs device {total} ({categories_text(exc.device_needed)})"
    missing = exc.min_device_bytes - exc.device_needed_bytes
    if listed not in str(exc) or missing <= 0:  # a refusal over the host list, or complete
        return str(exc)
    reserve = min(profile.library_reserve_bytes, missing)
    parts = exc.device_needed + (("library reserve", reserve), ("other fixed", missing - reserve))
    return str(exc).replace(listed, f"needs device {total} ({categories_text(parts)})", 1)


def _ring_text(cfg, args, budget, profile) -> str:
    """The layout chosen for args.gpus GPUs, its rings' plans and predictions (layout_cli)."""
    from dataflow.memplan.layout_cli import ring_report

    return ring_report(cfg, args, budget, profile)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, code = parse_or_exit_code(build_parser(), argv, PROG)
    if args is None:
        return code
    try:
        text = _run(args)
    except ConfigError as exc:  # bad model, GPU or profile; budgets that nothing fits
        if args.debug:
            traceback.print_exc()
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # one line of reason; the traceback only with --debug
        if args.debug:
            raise
        print(f"{PROG}: internal error: {type(exc).__name__}: {exc} (rerun with --debug)",
              file=sys.stderr)
        return 1
    return print_report(text)


if __name__ == "__main__":
    sys.exit(main())
