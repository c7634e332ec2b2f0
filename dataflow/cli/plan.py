"""`dataflow-plan <host_gb> <dev_gb> <seqlen> <model> [--gpu NAME | --profile FILE] [--gpus N]
[--seqs-per-step N | --tokens-per-step N] [--json]`: print the plan the planner would choose (or
exactly one JSON document with --json); with --gpus N, the layout chosen for N GPUs (replicas of
a ring, from memplan.layout) with the alternatives it weighed, the chosen ring's per-device
plans, its predicted throughput over each link, the same choice for N = 2..64, and the ring-only
scaling model. Exit 0 on success, 2 with one paragraph on stderr for bad input or infeasible
budgets, 1 for an internal failure; tracebacks only with --debug. Never imports array libraries
and never decides anything itself (memplan does)."""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

from dataflow.cli.args import (
    BAD_INPUT,
    Debug,
    OneLineParser,
    Outcome,
    add_freeze_flag,
    add_lora_flags,
    int_at_least,
    lora_of,
    add_version_flag,
    run_command,
    seqlen_tokens,
)
from dataflow.memplan.plan.errors import InfeasibleBudget, categories_text, size_text
from dataflow.memplan.search.explain import explain
from dataflow.memplan.search.layout import LayoutChoice, choose_layout, layout_text
from dataflow.memplan.plan.plan import Budget, Precision
from dataflow.memplan.plan.split import split_memory_map
from dataflow.memplan.plan.profiles import get_profile, load_profile
from dataflow.memplan.search.ring_plan import LINKS, scaling, scaling_text
from dataflow.memplan.search.search import make_plan
from dataflow.models.errors import ConfigError
from dataflow.models.hf_config import MODEL_FORMS, model_config
from dataflow.models.serial import to_json
from dataflow.progress import SlowNotice

PROG = "dataflow-plan"
GPU_COUNTS = (2, 4, 8, 16, 32, 64)
"""The ring sizes the --gpus report compares."""
GIB = 2 ** 30


def _budget_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number of GiB")
    return value


_count = int_at_least(1, not_int="{text!r} is not a whole number",
                      too_small="{text!r} must be a positive whole number")


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
    p.add_argument("model", help=f"{MODEL_FORMS} (zoo: tiny, small, 1b, 8b, 15b, 32b, 70b, "
                                 "llama3.2-1b, mistral-7b, qwen2.5-7b, qwen3-8b, ...)")
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
    p.add_argument("--vocab-parallel-head", action="store_true",
                   help="with --gpus: weigh rings whose every device computes the logits and "
                        "loss over 1/N of the vocabulary beside rings whose last device "
                        "carries the whole head (docs/ring.md)")
    p.add_argument("--split-update", action="store_true",
                   help="with --gpus: weigh data-parallel replicas (rings of any size) "
                        "that reduce-scatter their gradients and each update 1/R of every "
                        "rank's blocks with AdamW state for that part only (each rank "
                        "planned so: what that frees goes to the plan, and layouts that "
                        "fit only split are found) "
                        "beside whole updates; the faster is kept (docs/ring.md \"Split "
                        "updates\")")
    p.add_argument("--fast-attention", action="store_true",
                   help="cuDNN's faster non-deterministic attention backward for packed "
                        "sequences too: frees its 2*T*T*heads-byte workspace (4.1 GiB at 8k "
                        "for 1b and 8b) for the plan; dQ may then differ in the last bits from "
                        "run to run (default: deterministic; not built for --gpus yet)")
    p.add_argument("--precision", choices=[x.value for x in Precision], default="bf16",
                   help="the block projections' GEMMs in bf16 (default) or fp8 (docs/fp8.md): "
                        "an fp8 plan holds the FP8 operand scratch and is predicted at the "
                        "profile's measured FP8 rate, or at the bf16 rate (no speedup claimed) "
                        "where none is measured; with --gpus, every rank and the one device "
                        "it is compared with")
    p.add_argument("--no-round-overlap", action="store_true",
                   help="with --gpus: predict rings whose rounds run in turn (default: the next "
                        "round's first layers start during a round's drain, as deep as each "
                        "device's budget allows; planned and simulated, not run by dataflow-ring "
                        "yet; docs/ring.md)")
    add_freeze_flag(p)
    add_lora_flags(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_version_flag(p)
    return p


def _run(args) -> str:
    profile = load_profile(args.profile) if args.profile else get_profile(args.gpu or "h100")
    cfg = model_config(args.model)
    budget = Budget.from_gib(args.host_gb, args.dev_gb)
    lora = lora_of(args)
    if args.gpus > 1:
        if lora is not None:
            raise ConfigError("--lora-rank is planned for one device so far; drop --gpus or "
                              "--lora-rank")
        if args.fast_attention:
            raise ConfigError("--fast-attention is not built for --gpus yet (a ring plans the "
                              "deterministic backward); drop one of them")
        if args.freeze:
            raise ConfigError("--freeze is planned for one device so far; drop --gpus or "
                              "--freeze")
        return ring_report(cfg, args, budget, profile)
    if args.vocab_parallel_head:
        raise ConfigError("--vocab-parallel-head splits a ring's head over its devices; give "
                          "--gpus 2 or more, or drop the flag")
    if args.split_update:
        raise ConfigError("--split-update splits the update over data-parallel replicas; give "
                          "--gpus 2 or more, or drop the flag")
    batch = {k: v for k, v in (("seqs_per_step", args.seqs_per_step),
                               ("tokens_per_step", args.tokens_per_step)) if v is not None}
    if args.fast_attention:
        batch["attention_bwd"] = "fast"
    if args.precision != "bf16":
        batch["precision"] = args.precision
    if args.freeze:
        batch["freeze"] = args.freeze
    if lora is not None:
        batch["lora"] = lora
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


# -- --gpus N: the layout, its rings' plans and predictions ------------------------------------
def _global_batch(args) -> int | None:
    if getattr(args, "tokens_per_step", None):
        return args.tokens_per_step
    if getattr(args, "seqs_per_step", None):
        return args.seqs_per_step * args.seqlen
    return None


def _link_rows(choice: LayoutChoice) -> list[dict]:
    return [{"link": p.link, "tok_per_s": p.tok_per_s, "speedup": p.speedup,
             "bubble_frac": p.bubble_frac, "step_time_s": p.step_time_s,
             "allreduce_s": p.allreduce_s} for p in choice.chosen.predictions]


def ring_report(cfg, args, budget, profile) -> str:
    """The report of `dataflow-plan ... --gpus N` (text, or JSON with args.json)."""
    cap = _global_batch(args)
    if cap is not None and cap % args.seqlen:
        raise ConfigError(f"--tokens-per-step {cap:,} is not a multiple of seqlen {args.seqlen}")
    memo: dict = {}  # the rings planned, shared by the choices for 2..64 GPUs below
    fixed = {"precision": args.precision} if args.precision != "bf16" else None
    vocab = bool(getattr(args, "vocab_parallel_head", False))
    overlap = not getattr(args, "no_round_overlap", False)
    split = bool(getattr(args, "split_update", False))
    # 64 GPUs with both schedules take minutes on one core: say what is being weighed
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    with SlowNotice(f"weighing layouts of {args.gpus} GPUs", say, interval_s=15.0,
                    hint="Ctrl-C stops it") as notice:
        choice = choose_layout(cfg, args.seqlen, budget, profile, args.gpus,
                               tokens_per_step=cap, memo=memo, constraints=fixed,
                               vocab_parallel_head=vocab, round_overlap=overlap,
                               split_update=split)
        single = choice.single_tok_per_s
        by_gpus = []
        for i, g in enumerate(GPU_COUNTS):
            notice.label = f"weighing layouts of {g} GPUs for the table ({i + 1} of " \
                           f"{len(GPU_COUNTS)})"
            try:
                c = choice if g == args.gpus else choose_layout(
                    cfg, args.seqlen, budget, profile, g, tokens_per_step=cap,
                    single_tok_per_s=single, memo=memo, quick=True, constraints=fixed,
                    vocab_parallel_head=vocab, round_overlap=overlap, split_update=split)
                by_gpus.append((g, c, ""))
            except ConfigError as exc:  # InfeasibleBudget included: say so, go on with other N
                by_gpus.append((g, None, str(exc).split("\n")[0][:160]))
    preds, _, note = scaling(cfg, args.seqlen, budget, profile, precision=args.precision)
    if args.json:
        return json.dumps({
            **choice.to_json_dict(),
            "ranks": [json.loads(rp.to_json()) for rp in choice.rank_plans],
            "by_gpus": [{"gpus": g, "layout": None if c is None else
                         json.loads(to_json(c.chosen.layout)),
                         "links": None if c is None else _link_rows(c), "refused": why or None}
                        for g, c, why in by_gpus],
            "scaling": [json.loads(to_json(p)) for p in preds], "scaling_note": note},
            sort_keys=True)
    lines = [layout_text(choice)]
    if args.precision != "bf16":
        lines.append(f"precision {args.precision}: every rank, and the one device the speedups "
                     "compare with (docs/fp8.md)")
    rps = choice.rank_plans
    ch = rps[0].plan.chunking
    lines.append(f"the chosen ring's devices (budgets per device; {ch.chunk_tokens} tokens x "
                 f"{ch.chunks_per_round} chunks x {ch.rounds_per_step} rounds per replica):")
    for rp in rps:
        p = rp.plan
        extra = " + embedding" * rp.has_embed + " + head" * rp.has_head
        if rp.vocab_parallel:
            extra += f" + {rp.plan.model.head_rows:,} head rows"
        mem = p.memory
        if rp.split_update and rp.replicas > 1:  # m / v for its part: host bytes fall with R
            extra += f", split update (1/{rp.replicas} of the AdamW state)"
            mem = split_memory_map(p, rp.replicas)
        lines.append(f"  device {rp.rank}: layers {_layers_text(rp.layers)}{extra}; device "
                     f"{mem.device_bytes / GIB:.2f} GiB, host {mem.host_bytes / GIB:.2f}"
                     f" GiB; alone it would predict {p.prediction.tok_per_s:,.0f} tok/s")
    lines.append("  predicted over each link:")
    for p in choice.chosen.predictions:
        speed = "n/a" if p.speedup is None else f"{p.speedup:.2f}x"
        lines.append(f"    {p.link:<16} {p.tok_per_s:>12,.0f} tok/s  ({speed}; step "
                     f"{p.step_time_s:.3f} s, all-reduce {p.allreduce_s:.3f} s, bubble "
                     f"{p.bubble_frac:.1%})")
    lines.append(f"layouts by number of GPUs (over {LINKS[0].name}; per-device budgets as above; "
                 f"quick: rings at the planner's chunk size, rounded up to full, except for "
                 f"{args.gpus}; --gpus G weighs smaller chunks too):")
    for g, c, why in by_gpus:
        if c is None:
            lines.append(f"  {g:>3} GPUs: not possible ({why})")
            continue
        o, p = c.chosen, c.chosen.on(c.link)
        speed = "n/a" if p.speedup is None else f"{p.speedup:.2f}x"
        lines.append(f"  {g:>3} GPUs: {o.layout.replicas:>2} x ring of {o.layout.ring_size:<2} "
                     f"{o.layout.tokens_per_step:>12,} tokens/step {p.tok_per_s:>10,.0f} tok/s "
                     f"{speed:>7} bubble {p.bubble_frac:.1%}")
    return "\n".join(lines + ["one ring of N (no replicas), for comparison:",
                              scaling_text(preds, single, note)])


def _layers_text(layers) -> str:
    if len(layers) <= 6:
        return ", ".join(map(str, layers))
    steps = {b - a for a, b in zip(layers, layers[1:])}
    if len(steps) == 1:  # every N-th layer (cyclic), or one block
        return f"{layers[0]}, {layers[1]}, ..., {layers[-1]} ({len(layers)})"
    runs = [[layers[0]]]  # a placement with runs of consecutive layers: "14-15"
    for g in layers[1:]:
        if g == runs[-1][-1] + 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) + \
        f" ({len(layers)})"


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv, _run, outcomes=(
        # bad model, GPU or profile; budgets that nothing fits
        Outcome(catch=(ConfigError,), exit_code=BAD_INPUT.exit_code, debug=Debug.TRACEBACK),
        Outcome(catch=(Exception,), exit_code=1,
                words="internal error: {name}: {exc} (rerun with --debug)")))


if __name__ == "__main__":
    sys.exit(main())
