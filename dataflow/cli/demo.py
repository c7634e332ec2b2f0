"""`dataflow-demo <host_gb> <dev_gb> <seqlen> <model>`: train a model under memory budgets on the
shipped text and report throughput and memory. The engine's front door for people; picks the GPU
backend when one is usable, NumPy otherwise. Never decides placement (memplan does)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
import time
import warnings

import psutil

from dataflow.backend import BackendError
from dataflow.backends import make_backend
from dataflow.cli import demo_checks as checks
from dataflow.cli.args import (OneLineParser, Outcome, add_freeze_flag, add_lora_flags,
                               add_version_flag, lora_of,
                               run_command, seqlen_tokens)
from dataflow.cli.demo_ring import run_ring
from dataflow.cli.demo_training import Training, add_flags, default_lr
from dataflow.instrument import ChromeTraceWriter, PcieCounter, PcieSampler, op_totals
from dataflow.memplan import explain, make_plan
from dataflow.memplan.plan.frozen import parse_freeze
from dataflow.memplan.plan.plan import Budget
from dataflow.metrics_log import FORMATS, MetricsLog, run_metadata
from dataflow.models.config import zoo_names
from dataflow.models.errors import ConfigError, NonFiniteError
from dataflow.models.hf_config import model_config
from dataflow.models.serial import to_dict
from dataflow.precision import PRECISIONS
from dataflow.progress import Progress, SlowNotice, StepWatch

# The engine and models.hf load NumPy and numba (seconds): they are imported inside the
# functions that train, so --help and a refused argument answer at once.

log = logging.getLogger("dataflow.demo")
PROG = "dataflow-demo"
CPU_CAVEAT = ("  (a rough prediction: the CPU profile is not calibrated, its peak and rates are "
              "round guesses, so measured tok/s may differ several-fold; MFU and HFU use the "
              "same guessed peak in the plan and in each step)")
"""Said under the plan's prediction when it was made for the NumPy backend's CPU profile."""


def _metrics_path(text: str) -> str:
    if not text.lower().endswith(FORMATS):
        raise argparse.ArgumentTypeError(f"{text!r} must end in one of {', '.join(FORMATS)}")
    return checks.writable_file(text)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Train a Llama-style model under host and device memory budgets and report "
                    "tokens/s, TFLOP/s, MFU, HFU and memory used. GB means GiB (2^30 bytes).",
        epilog="Exit status: 0 done; 2 bad input (including budgets above the memory this "
               "machine has); 1 failure while running; 3 the loss or gradient norm became NaN "
               "or infinite; 130/143 stopped by SIGINT/SIGTERM (the first signal stops after "
               "the step in progress, a second one at once; while planning the first one stops "
               "at once; --json, --trace and --metrics are closed and valid either way).")
    p.add_argument("host_gb", type=checks.positive_float,
                   help="host (pinned) memory budget, GiB")
    p.add_argument("dev_gb", type=checks.positive_float, help="device memory budget, GiB")
    p.add_argument("seqlen", type=seqlen_tokens, help="tokens per sequence (at most 16,777,216)")
    p.add_argument("model", help="zoo name (tiny, small, 1b, 8b, 15b, 32b, 70b, llama3.2-1b, "
                        "mistral-7b, qwen2.5-7b, qwen3-8b, ...), a saved model or a Hugging "
                        "Face directory")
    p.add_argument("--steps", type=checks.positive_int, default=5,
                   help="optimizer steps (default 5)")
    p.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    p.add_argument("--lr", type=checks.positive_float, default=None,
                   help="peak learning rate (default 1e-3 for tiny/small, 3e-4 up to width "
                        "2048 (1b), 3e-4 * 2048 / width above it (8b: 1.5e-4))")
    p.add_argument("--seed", type=checks.seed, default=0, help="initialisation seed")
    p.add_argument("--plan", metavar="FILE", type=checks.readable_file,
                   help="run this plan JSON instead of planning (the positionals must match it)")
    p.add_argument("--fast-attention", action="store_true",
                   help="cuDNN's faster non-deterministic attention backward for packed "
                        "sequences too: frees its 2*T*T*heads-byte workspace (4.1 GiB at 8k "
                        "for 1b and 8b) for the plan; dQ may then differ in the last bits from "
                        "run to run (default: deterministic; not built for --gpus yet)")
    p.add_argument("--eager-update", action="store_true",
                   help="run each step's AdamW after its last round (default: deferred into "
                        "the next step's first round, behind its compute, and run before the "
                        "model is saved or evaluated; the same bits either way)")
    p.add_argument("--backward-update", action="store_true",
                   help="run each step's AdamW inside its own last round, each streamed "
                        "layer's right after its gradient is final, instead of in the next "
                        "step's first round (needs --max-grad-norm 0: clipping needs the whole "
                        "gradient's norm first; the same bits, but a non-finite step's update "
                        "is then not dropped)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="the linear layers' arithmetic: bf16 (default; with --plan, the "
                        "plan's) or fp8, their GEMMs in the FP8 recipe of docs/fp8.md (E4M3 "
                        "forward, E5M2 gradients, per-tensor scales) on an sm_89+ GPU or the "
                        "numpy backend; it pays at 8b-sized layers (1.22x on an H200), not "
                        "at small widths (docs/fp8.md)")
    add_freeze_flag(p)
    add_lora_flags(p)
    p.add_argument("--rounds", type=checks.positive_int, default=None,
                   help="rounds per step (default: the planner's, which keeps the optimizer "
                        "under 2%% of the step)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--seqs-per-step", type=checks.positive_int, default=None, metavar="N",
                       help="global batch: exactly N sequences per step (the planner chooses "
                            "chunks and rounds around it)")
    batch.add_argument("--tokens-per-step", type=checks.positive_int, default=None, metavar="N",
                       help="the same in tokens (a multiple of SEQLEN)")
    p.add_argument("--gpus", type=checks.positive_int, default=1, metavar="N",
                   help="train on a ring of N ranks, layer i on rank i mod N, the budgets per "
                        "GPU (default 1: this process alone); spawns the ranks, or under "
                        "torchrun/srun pass N = WORLD_SIZE. A ring prints each rank's steps and "
                        "one summary line (--json: ring shape, exit codes, losses, step times); "
                        "constant --lr; checkpoints as on one GPU; --plan, --trace, --metrics, "
                        "the batch, schedule and data options are not built for it yet (see "
                        "docs/ring.md)")
    p.add_argument("--trace", metavar="FILE.json", type=checks.writable_file,
                   help="write the steps' timeline as Chrome trace JSON (Perfetto, chrome://tracing)")
    p.add_argument("--metrics", metavar="FILE", type=_metrics_path,
                   help="append one row per step to this run log (.parquet or .csv)")
    p.add_argument("--json", action="store_true",
                   help="write one JSON document to stdout: status, plan, memory, setup "
                        "phases and one record per step")
    p.add_argument("--debug", action="store_true", help="tracebacks and debug logging")
    add_version_flag(p)
    add_flags(p)  # --warmup --min-lr --max-grad-norm --data --eval-every, checkpoints, --resume
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv, _train, log_format="%(message)s", outcomes=(
        Outcome(catch=(ConfigError, ValueError), exit_code=2),
        Outcome(catch=(Exception,), exit_code=1, words="failed while running: {name}: {exc}")))


def _train(args) -> int:
    """The run's exit code: 0 done, 3 NaN or infinite, 130/143 stopped by a signal."""
    if not args.debug:  # a diverging run overflows in NumPy ops; the NaN check says it in a line
        warnings.filterwarnings("ignore", message="(overflow|invalid value) encountered",
                                category=RuntimeWarning)
    try:
        with checks.StopSignals() as stop:
            return _run(args, stop)
    except KeyboardInterrupt:  # a second signal, or one before the handlers were installed
        if args.debug:
            raise
        print(f"{PROG}: {_stop_words(args)}", file=sys.stderr)
        return stop.exit_code if "stop" in locals() else 130
    except NonFiniteError as exc:
        if args.debug:
            raise
        print(f"{PROG}: {exc.what} became {_nonfinite(exc.value)} at step {exc.step} "
              f"(lr {exc.lr:g}); lower --lr", file=sys.stderr)
        return checks.EXIT_NONFINITE


def _run(args, stop: checks.StopSignals) -> int:
    t_start = time.perf_counter()
    from dataflow.engine.setup import check_weights_match  # loads numba: off the --help path

    cfg = model_config(args.model)  # a zoo name, a saved model or a Hugging Face directory
    if not _is_zoo(args.model):  # before any planning: a wrong config.json can plan for hours
        check_weights_match(cfg, args.model)
    lr = args.lr or default_lr(cfg.model_dim)
    if args.gpus > 1:
        if args.fast_attention:
            raise ConfigError("--fast-attention is not built for --gpus yet (a ring plans "
                              "the deterministic backward); drop one of them")
        if args.backward_update or args.freeze or args.lora_rank:
            flag = ("--backward-update" if args.backward_update else
                    "--freeze" if args.freeze else "--lora-rank")
            raise ConfigError(f"{flag} "
                              "is for one device so far (a ring rank updates after its "
                              "gradients are summed); drop it or --gpus")

        return run_ring(args, build_parser(), lr)
    if args.backward_update and (args.eager_update or args.max_grad_norm):
        raise ConfigError(f"--backward-update runs the update in the step's last round, so it "
                          f"takes no --eager-update and no clipping (--max-grad-norm "
                          f"{args.max_grad_norm:g}); add --max-grad-norm 0")
    lora = lora_of(args)  # a bad --lora-* is refused here (exit 2), before any work
    training = Training(args, cfg, lr)  # schedule, clipping, data, checkpoints
    training.open_data(args.seqlen)  # a bad --data is refused here, before any work or output
    plan = checks.load_plan(args.plan) if args.plan else None
    if plan is not None:
        if args.rounds or args.seqs_per_step or args.tokens_per_step or args.fast_attention:
            raise ConfigError("--rounds / --seqs-per-step / --tokens-per-step / "
                              "--fast-attention cannot change a --plan file; edit the plan or "
                              "drop --plan")
        checks.check_plan_matches(plan, cfg, args.seqlen, args.host_gb, args.dev_gb)
        if args.precision not in (None, plan.precision.value):
            raise ConfigError(f"--precision {args.precision} differs from the --plan file's "
                              f"{plan.precision.value}; plan again with --precision, or drop it")
        if args.freeze is not None and parse_freeze(args.freeze, cfg.n_layers) != plan.frozen:
            raise ConfigError(f"--freeze {args.freeze} differs from the --plan file's "
                              f"'{plan.frozen.spec()}'; plan again with --freeze, or drop it")
        if lora is not None and lora != plan.lora:
            raise ConfigError(f"--lora-rank/--lora-alpha/--lora-targets/--lora-base ({lora}) "
                              f"differ from the --plan file's ({plan.lora}); plan again with "
                              "them, or drop them")
    precision = plan.precision.value if plan is not None else args.precision or "bf16"
    try:
        be_probe = make_backend(args.backend)
        be_probe.set_precision(precision)  # refused here, before any planning
    except BackendError as exc:  # e.g. --backend cupy without a GPU: bad input, not a crash
        raise ConfigError(str(exc)) from None
    backend = be_probe.name
    weights = args.model if not _is_zoo(args.model) else None
    log.info("backend: %s (%s)", backend, getattr(be_probe, "device_name", backend))
    if plan is None:
        from dataflow.engine import default_profile  # loads numba: off the --help path (top)

        profile = default_profile(be_probe)
        extra = {"rounds_per_step": args.rounds} if args.rounds else {}
        if precision != "bf16":
            extra["precision"] = precision
        if args.fast_attention:
            extra["attention_bwd"] = "fast"
        if args.freeze:
            extra["freeze"] = args.freeze
        if lora is not None:
            extra["lora"] = lora
        if args.seqs_per_step or args.tokens_per_step:
            extra.update(seqs_per_step=args.seqs_per_step, tokens_per_step=args.tokens_per_step)
        # the first signal stops a search at once (no step to finish); one that runs long says so
        with stop.abortable(first_signal=True), SlowNotice(
                f"planning {cfg.name} ({cfg.n_layers:,} layers)", log.info,
                hint="Ctrl-C stops it"):
            plan = make_plan(cfg, args.seqlen, Budget.from_gib(args.host_gb, args.dev_gb),
                             profile, **extra)
    checks.check_budgets_fit_machine(plan, be_probe)
    log.info("%s", _with_caveat(plan, explain(plan, update="backward" if args.backward_update
                                              else "end" if args.eager_update else "deferred")))

    if stop.signum:
        return _interrupted(args, stop)
    from dataflow.engine import Engine  # loads numba: off the --help path (top)

    t0 = time.perf_counter()
    with Progress(cfg.n_layers + 2, f"init {cfg.name}") as init_bar, stop.abortable():
        eng = Engine.from_plan(plan, backend=backend, seed=args.seed, weights=weights,
                               optimizer=training.optimizer, lr_schedule=training.schedule,
                               trace=True, progress=init_bar,
                               deferred_update=not args.eager_update,
                               backward_update=args.backward_update)
    training.start(eng)  # opens --data; with --resume loads the newest checkpoint
    init_s = time.perf_counter() - t0
    phases = dict(eng.setup_seconds)
    log.info("initialised %s in %.1f s (%s)", cfg.name, init_s,
             ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    warm = getattr(eng, "warm_up_parts", {})
    prebuild = getattr(eng, "prebuild_parts", {})
    for what, parts in (("built while pinning", prebuild), ("warm_up", warm)):
        if parts:
            log.info("%s: %s", what, ", ".join(f"{k} {v:.1f} s" if isinstance(v, float)
                                              else f"{k} {v}" for k, v in parts.items()))
    pin = getattr(getattr(eng.be, "inner", eng.be), "last_pin", None)
    if pin:  # the host slab's pinning is most of the executor phase on a large host budget
        log.info("pinned %.1f GiB of host by %s in %.1f s (%s)", pin["nbytes"] / 2**30,
                 pin["method"], pin["seconds"], ", ".join(
                     f"{k[:-2]} {v:.1f} s" for k, v in pin.items() if k.endswith("_s")))
    run = _Run(args, plan, eng, be_probe, t_start=t_start)
    run.setup = {"init_s": init_s, "phases_s": phases, "warm_up": warm, "prebuild": prebuild,
                 "pin": pin}
    run.training = training
    try:
        run.train(stop)
    finally:
        run.close()
    if stop.signum:
        return _interrupted(args, stop)
    return 0


def _with_caveat(plan, text: str) -> str:
    """The plan's explanation, with CPU_CAVEAT under its prediction when the profile is the
    CPU one (the NumPy backend's): the lines after 'Prediction on cpu' up to the search's own
    estimate are the prediction."""
    if plan.profile.name != "cpu":
        return text
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if line.startswith("  (the search ranked")),
              len(lines) - 1)
    return "\n".join(lines[:at + 1] + [CPU_CAVEAT] + lines[at + 1:])


def _interrupted(args, stop) -> int:
    print(f"{PROG}: {_stop_words(args)}", file=sys.stderr)
    return stop.exit_code


def _stop_words(args) -> str:
    """Where an interrupted run stopped, in the words its --json status and --metrics use:
    'interrupted at step 2' (a first signal: step 2 was the last, finished) or 'interrupted in
    step 3' (a second one abandoned step 3; 2 steps finished)."""
    done = getattr(args, "steps_done", 0)
    status = getattr(args, "stop_status", None)
    if status is None:
        return f"interrupted at step {done}" + (" (before the first step)" if not done else "")
    if status.startswith("interrupted in step"):
        return f"{status} (abandoned it; {done} step(s) finished)"
    return status


class _Run:
    """The training loop and everything it writes (trace, metrics, --json), closed in close()
    on every way out: done, interrupted, non-finite, or failed."""

    def __init__(self, args, plan, eng, be_probe, *, t_start: float):
        self.args, self.plan, self.eng, self.be_probe = args, plan, eng, be_probe
        self.backend = be_probe.name
        self.results = []
        self.last_trace = None
        """The last finished step's StepTrace (read after the engine is closed)."""
        self.mem = None
        self.precision_counts = None
        """The backend's precision counts at the end (fp8: its guessed scales and misses)."""
        self.setup = None
        """Engine setup: {'init_s': wall seconds, 'phases_s': Engine.setup_seconds, 'warm_up':
        Engine.warm_up_parts, 'prebuild': Engine.prebuild_parts, 'pin': the CuPy backend's
        last_pin (how the host slab was pinned, seconds per part) or None}."""
        self.status = "failed"
        self.t_start = t_start
        """perf_counter() when the demo began work (before planning): the summary's total."""
        self._warned: set[str] = set()
        args.steps_done = 0
        device = getattr(eng.be, "device_name", self.backend)
        self.trace = ChromeTraceWriter(args.trace, process_name=f"dataflow {plan.model.name} "
                                       f"on {device}") if args.trace else None
        config = {k: v for k, v in vars(args).items() if k != "steps_done"}
        self.metrics = MetricsLog(args.metrics, run_metadata(backend=eng.be, plan=plan,
                                                             config=config)) \
            if args.metrics else None
        counter = PcieCounter.open(pci_bus_id=eng.be.device.pci_bus_id) \
            if self.backend == "cupy" and args.metrics else None
        self.pcie = PcieSampler(counter) if counter else None

    def train(self, stop) -> None:
        args, eng = self.args, self.eng
        with eng, Progress(args.steps, "steps", logger=log) as bar:
            for _ in range(self.training.remaining(eng)):
                if stop.signum:
                    break
                batch, batch_kwargs = self.training.next_batch(eng)
                if self.pcie:
                    self.pcie.start()
                try:
                    with stop.abortable(), StepWatch(eng.step_progress,
                                                     f"step {args.steps_done + 1}", bar.info):
                        r = eng.train_step(*batch, **batch_kwargs)  # reports every 30 s
                except NonFiniteError as exc:
                    self.status = f"nonfinite {exc.what} at step {exc.step}"
                    moved = self.pcie.stop() if self.pcie else None
                    if self.metrics and exc.result is not None:
                        self.metrics.append(exc.result, pcie=moved)  # the row, loss NaN/inf
                    raise
                except KeyboardInterrupt:
                    self.status = args.stop_status = f"interrupted in step {args.steps_done + 1}"
                    raise
                moved = self.pcie.stop() if self.pcie else None
                self.results.append(r)
                args.steps_done = r.step
                self._report(r, bar)
                self.last_trace = eng.last_trace  # kept: Engine.close() drops its own
                if self.trace:
                    self.trace.add(self.last_trace)
                if self.metrics:
                    self.metrics.append(r, pcie=moved)
                bar.update(info=f"loss {r.loss:.3f}")
                self.training.after_step(eng, r)  # validation loss, checkpoint
            self.mem = self._memory()
            self.precision_counts = eng.be.precision_counts()
        self.status = f"interrupted at step {args.steps_done}" if stop.signum else "done"
        if stop.signum:
            args.stop_status = self.status

    def _report(self, r, bar) -> None:
        plan = self.plan
        for i, loss in enumerate(r.round_losses):
            bar.info("step %d round %d: %d seqs, %d tokens, loss %.4f", r.step, i,
                     plan.chunking.seqs_per_round, plan.chunking.tokens_per_round, loss)
        # the plan's peak and formula (docs/flops.md), so a step's MFU compares with the plan's;
        # on a CPU both rest on the CPU profile's guessed peak (CPU_CAVEAT)
        mfu, hfu = f"{r.mfu:6.1%}", f"{r.hfu:6.1%}"
        norm = f"{r.grad_norm:.3g}" if r.grad_norm is not None else "n/a"
        bar.info("step %d: loss %.4f  lr %.3g  grad_norm %s  %.0f tok/s  %.1f TFLOP/s  MFU %s  "
                 "HFU %s  %.2f s (FLOP model %s)", r.step, r.loss, r.lr, norm, r.tok_per_s,
                 r.model_tflop_per_s, mfu, hfu, r.step_time_s, r.flop_model_version)
        if getattr(r, "aux_loss", None) is not None:  # MoE: the router's terms beside the loss
            bar.info("step %d: router load-balancing loss %.4f, z-loss %.4f (means over the "
                     "step's rounds, unscaled; the loss above is the language-model loss)",
                     r.step, r.aux_loss, r.z_loss if r.z_loss is not None else 0.0)
        bar.info("step %d: %s", r.step, r.breakdown.summary())
        trace = getattr(self.eng, "last_trace", None)
        if trace is not None:  # every step: a run cut short still says where its time went
            bar.info("step %d: largest compute costs: %s", r.step, ", ".join(
                f"{op} {t * 1e3:,.1f} ms ({n:,}x)" for op, t, n in op_totals(trace.spans)[:5]))
        ex = getattr(self.eng, "ex", None)
        if len(self.results) == 1 and getattr(ex, "deferred", False) \
                and not getattr(ex, "backward_update", False):
            bar.info("step %d ran no AdamW update: each step's update runs inside the next "
                     "step's first round (--eager-update: at its own end), so tok/s is steady "
                     "from the second step on", r.step)
        self._warn_once(r)

    def _warn_once(self, r) -> None:
        """Warnings (stderr) a run gets at most once each: a loss that diverges while finite,
        and a gradient norm of exactly 0 (nothing learns: e.g. every label ignored as -100, or
        a broken backward), which otherwise passes silently with an unchanged loss."""
        first = self.results[0].loss
        if r.loss > 2 * first and "diverges" not in self._warned:
            self._warned.add("diverges")  # finite but diverging (e.g. --lr 10)
            log.warning("warning: loss %.4g is over twice step 1's %.4g: training diverges; "
                        "lower --lr", r.loss, first)
        if r.grad_norm == 0 and "zero_grad" not in self._warned:
            self._warned.add("zero_grad")
            log.warning("warning: step %d's gradient norm is exactly 0 (loss %.4f): the weights "
                        "do not move; check that the data has labels to learn (not all -100) "
                        "and that --lr is not 0", r.step, r.loss)

    def _memory(self) -> dict:
        eng = self.eng
        mem = eng.memory_used_bytes()
        if hasattr(eng.be, "memory_report"):
            mem.update(eng.be.memory_report())
            log.info("device memory: %.2f GiB used = in use before the arena (this CUDA context "
                     "and whatever else the device held) %.2f + arena %.2f (the budget less the "
                     "libraries' reserve) + libraries/pool %.2f GiB",
                     mem["device_used_bytes"] / 2**30, mem["context_baseline_bytes"] / 2**30,
                     mem["arena_bytes"] / 2**30, mem["libraries_and_pool_bytes"] / 2**30)
        mem["host_rss_bytes"] = psutil.Process().memory_info().rss
        return mem

    def close(self) -> None:
        """Close the trace and the metrics log and write --json, whatever stopped the loop."""
        args = self.args
        if self.results and self.status == "done":
            last = self.results[-1]
            log.info("%s", last.breakdown.table())
            ceil = last.breakdown.ceilings(last.tokens)
            if ceil["no_stalls"]:
                log.info("ceilings at this step's kernel rates (python -m dataflow.bench.floors): %s tok/s "
                         "with every copy hidden, %s with no recompute either (more memory)%s",
                         f"{ceil['no_stalls']:,.0f}", f"{ceil['no_recompute']:,.0f}",
                         f"; its attention alone {ceil['attention_alone']:,.0f}"
                         if ceil["attention_alone"] else "")
        if self.trace:
            self.trace.close()
            log.info("trace: %s (%d events; open in ui.perfetto.dev)", args.trace,
                     self.trace.n_events)
        if self.metrics:
            self.metrics.close(status=self.status)
        mem = self.mem
        if mem is not None:
            log.info("memory: device arena %.3f GiB (regions %.3f GiB), host arena %.3f GiB "
                     "(regions %.3f GiB)", mem["device_arena"] / 2**30,
                     mem["device_regions"] / 2**30, mem["host_arena"] / 2**30,
                     mem["host_regions"] / 2**30)
        if self.precision_counts:
            c = self.precision_counts
            log.info("fp8 scales: %d quantisations guessed their site's last scale, %d of them "
                     "missed and cast again", c["guessed"], c["missed"])
        # the run's one-line result: stdout for people, stderr under --json (stdout is the doc)
        print(self.summary(), file=sys.stderr if args.json else sys.stdout, flush=True)
        if args.json:
            json.dump({"status": self.status, "plan_hash": self.plan.hash,
                       "backend": self.backend, "precision": self.plan.precision.value,
                       "memory": mem, "setup": self.setup,
                       **({"fp8_scales": self.precision_counts} if self.precision_counts
                          else {}),
                       "device": getattr(self.be_probe, "device_name", self.backend),
                       "plan": json.loads(self.plan.to_json()),
                       "steps": [to_dict(r) for r in self.results],
                       "validation": [{"step": st, "loss": lo}
                                      for st, lo in self.training.eval_losses]},
                      sys.stdout, indent=2)
            print()
            sys.stdout.flush()

    def summary(self) -> str:
        """'summary: tiny done: 5 step(s) in 3.2 s (init 0.4 s); 9,100 tok/s mean over steps
        2-5; loss 5.5452 -> 4.9120' (steps after the first: the first runs no update and
        warms caches, so it is not steady)."""
        status = _stop_words(self.args) if self.status.startswith("interrupted") \
            else self.status
        total_s = time.perf_counter() - self.t_start
        init = f" (init {self.setup['init_s']:.1f} s)" if self.setup else ""
        head = f"summary: {self.plan.model.name} {status}: "
        rs = self.results
        if not rs:
            return head + f"no step finished in {total_s:.1f} s{init}"
        steady = rs[1:] or rs
        tok_per_s = sum(r.tok_per_s for r in steady) / len(steady)  # as the sweep's table
        which = f"steps {steady[0].step}-{steady[-1].step}" if len(steady) > 1 \
            else f"step {steady[0].step}"
        return (head + f"{len(rs)} step(s) in {total_s:.1f} s{init}; {tok_per_s:,.0f} tok/s "
                f"mean over {which}; loss {rs[0].loss:.4f} -> {rs[-1].loss:.4f}")


def _nonfinite(value: float) -> str:
    return "NaN" if value != value else ("+inf" if value > 0 else "-inf")


def _is_zoo(name: str) -> bool:
    """A zoo name or a model config JSON file: a shape to initialise, no weights to read."""
    if name in zoo_names():
        return True
    try:
        return Path(name).is_file()
    except OSError:  # a name too long for a path is no file (the model check then names it)
        return False


if __name__ == "__main__":
    sys.exit(main())
