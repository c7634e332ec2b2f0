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

from dataflow.models.errors import ConfigError
from dataflow.models.serial import to_json
from dataflow.memplan.cli_args import OneLineParser, parse_or_exit_code, print_report

PROG = "dataflow-plan"


def _budget_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number of GiB")
    return value


def _seqlen(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of tokens")
    from dataflow.memplan.chunking import MAX_SEQLEN

    if value > MAX_SEQLEN:  # past it planning would be slow, and no budget fits such a step
        raise argparse.ArgumentTypeError(f"{value:,} tokens is above the {MAX_SEQLEN:,} the "
                                         f"planner handles; use at most {MAX_SEQLEN}")
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
    p.add_argument("seqlen", type=_seqlen, help="tokens per sequence (at most 16,777,216)")
    p.add_argument("model", help="zoo name (tiny, small, 1b, 8b, 15b, 32b) or a config path")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gpu", metavar="NAME", default=None,
                     help="built-in hardware profile (default h100; a measured profile cached by "
                          "dataflow-probe replaces the built-in one of the same name)")
    src.add_argument("--profile", metavar="FILE", help="hardware profile JSON to plan for")
    p.add_argument("--gpus", type=_ranks, default=1, metavar="N",
                   help="plan a ring of N devices (layer i on device i mod N; budgets are per "
                        "device): each device's plan and memory, the predicted ring throughput "
                        "and a scaling model for N = 2..64 over NVLink, InfiniBand, 10 GbE and "
                        "a 1 Gb/s internet link (see docs/ring.md)")
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
    return p


def _run(args) -> str:
    from dataflow.memplan.explain import explain
    from dataflow.memplan.plan import Budget
    from dataflow.memplan.profiles import get_profile, load_profile
    from dataflow.memplan.search import make_plan
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
    plan = make_plan(cfg, args.seqlen, budget, profile, **batch)
    return plan.to_json() if args.json else explain(plan)


def _ring_text(cfg, args, budget, profile) -> str:
    """Per-device plans of a ring of args.gpus, its predicted throughput and the scaling model."""
    import json

    from dataflow.memplan.ring_plan import (LINKS, speedup_text, best_rank_plans, predict_ring, ring_profile,
                                   scaling, scaling_text)

    # the ranks run over NCCL on GPUs: their device budget also holds its buffers
    plans = best_rank_plans(cfg, args.seqlen, budget, ring_profile(profile, args.gpus, "nccl"),
                            args.gpus)
    preds, single, note = scaling(cfg, args.seqlen, budget, profile)
    here = [predict_ring(plans, link, single) for link in LINKS]
    if args.json:
        return json.dumps({"ranks": [json.loads(rp.to_json()) for rp in plans],
                           "ring": [json.loads(to_json(p)) for p in here],
                           "scaling": [json.loads(to_json(p)) for p in preds],
                           "single_tok_per_s": single, "note": note}, sort_keys=True)
    gib = 2 ** 30
    lines = [f"ring of {args.gpus} for {cfg.name} at seqlen {args.seqlen} (budgets per device; "
             f"chunking {plans[0].plan.chunking.chunk_tokens} tokens x "
             f"{plans[0].plan.chunking.chunks_per_round} chunks x "
             f"{plans[0].plan.chunking.rounds_per_step} rounds on every device):"]
    for rp in plans:
        p = rp.plan
        extra = " + embedding" * rp.has_embed + " + head" * rp.has_head
        lines.append(f"  device {rp.rank}: layers {_layers_text(rp.layers)}{extra}; device "
                     f"{p.memory.device_bytes / gib:.2f} GiB, host {p.memory.host_bytes / gib:.2f}"
                     f" GiB; alone it would predict {p.prediction.tok_per_s:,.0f} tok/s")
    alone = "does not fit" if single is None else f"{single:,.0f} tok/s"
    lines.append(f"  predicted ring throughput (single device: {alone}):")
    for p in here:
        lines.append(f"    {p.link:<16} {p.tok_per_s:>12,.0f} tok/s  "
                     f"({speedup_text(p.speedup)}; step {p.step_time_s:.3f} s, fill {p.fill_s:.3f} s, bubble {p.bubble_frac:.0%})")
    return "\n".join(lines + [scaling_text(preds, single, note)])


def _layers_text(layers) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 6 else \
        f"{layers[0]}, {layers[1]}, ..., {layers[-1]} ({len(layers)})"


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
