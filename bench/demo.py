"""`dataflow-demo <host_gb> <dev_gb> <seqlen> <model>`: train a model under memory budgets on the
shipped text and report throughput and memory. The engine's front door for people; picks the GPU
backend when one is usable, NumPy otherwise. Never decides placement (memplan does)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from models.errors import ConfigError

log = logging.getLogger("dataflow.demo")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be positive")
        return value
    parse.__name__ = kind.__name__
    return parse


def _metrics_path(text: str) -> str:
    from dataflow.metrics_log import FORMATS

    if not text.lower().endswith(FORMATS):
        raise argparse.ArgumentTypeError(f"'{text}' must end in one of {', '.join(FORMATS)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dataflow-demo",
        description="Train a Llama-style model under host and device memory budgets and report "
                    "tokens/s, TFLOP/s, MFU, HFU and memory used. GB means GiB (2^30 bytes).")
    p.add_argument("host_gb", type=_positive(float), help="host (pinned) memory budget, GiB")
    p.add_argument("dev_gb", type=_positive(float), help="device memory budget, GiB")
    p.add_argument("seqlen", type=_positive(int), help="tokens per sequence")
    p.add_argument("model", help="zoo name (tiny, small, 1b, 8b, 15b, 32b) or a saved model dir")
    p.add_argument("--steps", type=_positive(int), default=5, help="optimizer steps (default 5)")
    p.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    p.add_argument("--lr", type=_positive(float), default=None,
                   help="learning rate (default 1e-3 for tiny/small, 3e-4 otherwise)")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed")
    p.add_argument("--plan", metavar="FILE", help="run this plan JSON instead of planning")
    p.add_argument("--rounds", type=_positive(int), default=None,
                   help="rounds per step (default: the planner's, which keeps the optimizer "
                        "under 2%% of the step)")
    p.add_argument("--trace", metavar="FILE.json",
                   help="write the steps' timeline as Chrome trace JSON (Perfetto, chrome://tracing)")
    p.add_argument("--metrics", metavar="FILE", type=_metrics_path,
                   help="append one row per step to this run log (.parquet or .csv)")
    p.add_argument("--json", action="store_true",
                   help="write one JSON document (the run's results) to stdout")
    p.add_argument("--debug", action="store_true", help="tracebacks and debug logging")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(message)s", stream=sys.stderr)
    try:
        return _run(args)
    except (ConfigError, ValueError) as exc:
        if args.debug:
            raise
        print(f"dataflow-demo: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line of reason unless --debug
        if args.debug:
            raise
        print(f"dataflow-demo: failed while running: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _run(args) -> int:
    from dataflow.backends import make_backend
    from dataflow.data import token_stream
    from dataflow.engine import Engine
    from memplan import explain, make_plan
    from memplan.plan import Budget, Plan
    from models.config import load_config

    cfg = load_config(args.model)
    be_probe = make_backend(args.backend)
    backend = be_probe.name
    weights = args.model if not _is_zoo(args.model) else None
    log.info("backend: %s (%s)", backend, getattr(be_probe, "device_name", backend))
    if args.plan:
        with open(args.plan) as f:
            plan = Plan.from_json(f.read())
    else:
        from dataflow.engine import default_profile

        profile = default_profile(be_probe)
        extra = {"rounds_per_step": args.rounds} if args.rounds else {}
        plan = make_plan(cfg, args.seqlen, Budget.from_gib(args.host_gb, args.dev_gb), profile,
                         **extra)
    log.info("%s", explain(plan))
    lr = args.lr or (1e-3 if cfg.model_dim <= 256 else 3e-4)
    t0 = time.perf_counter()
    from dataflow.optimizer import AdamWConfig

    from dataflow.instrument import ChromeTraceWriter, PcieCounter, PcieSampler, op_totals
    from dataflow.metrics_log import MetricsLog, run_metadata
    from dataflow.progress import Progress

    with Progress(cfg.n_layers + 2, f"init {cfg.name}") as init_bar:
        eng = Engine.from_plan(plan, backend=backend, seed=args.seed, weights=weights,
                               optimizer=AdamWConfig(lr=lr), trace=True, progress=init_bar)
    log.info("initialised %s in %.1f s", cfg.name, time.perf_counter() - t0)
    results = []
    start = 0
    device = getattr(eng.be, "device_name", backend)
    trace_file = ChromeTraceWriter(args.trace, process_name=f"dataflow {cfg.name} on {device}") \
        if args.trace else None
    metrics = MetricsLog(args.metrics, run_metadata(backend=eng.be, plan=plan,
                                                    config=vars(args))) if args.metrics else None
    counter = PcieCounter.open(pci_bus_id=eng.be.device.pci_bus_id) \
        if backend == "cupy" and args.metrics else None
    pcie = PcieSampler(counter) if counter else None
    with eng, Progress(args.steps, "steps", logger=log) as bar:
        for step in range(args.steps):
            batch = token_stream(args.seqlen, eng.seqs_per_step, cfg.vocab_size, start=start)
            start += eng.seqs_per_step * args.seqlen
            if pcie:
                pcie.start()
            r = eng.train_step(batch)
            moved = pcie.stop() if pcie else None
            for i, loss in enumerate(r.round_losses):
                bar.info("step %d round %d: %d seqs, %d tokens, loss %.4f", r.step, i,
                         plan.chunking.seqs_per_round, plan.chunking.tokens_per_round, loss)
            mfu = f"{r.mfu:6.1%}" if backend != "numpy" else "   n/a"
            hfu = f"{r.hfu:6.1%}" if backend != "numpy" else "   n/a"
            bar.info("step %d: loss %.4f  %.0f tok/s  %.1f TFLOP/s  MFU %s  HFU %s  %.2f s "
                     "(FLOP model %s)", r.step, r.loss, r.tok_per_s, r.model_tflop_per_s, mfu,
                     hfu, r.step_time_s, r.flop_model_version)
            bar.info("step %d: %s", r.step, r.breakdown.summary())
            if trace_file:
                trace_file.add(eng.last_trace)
            if metrics:
                metrics.append(r, pcie=moved)
            bar.update(info=f"loss {r.loss:.3f}")
            results.append(r)
        mem = eng.memory_used_bytes()
        if hasattr(eng.be, "memory_report"):
            mem.update(eng.be.memory_report())
            log.info("device memory: %.2f GiB used by the process = CUDA context %.2f + arena "
                     "%.2f (the budget) + libraries/pool %.2f GiB",
                     mem["device_used_bytes"] / 2**30, mem["context_baseline_bytes"] / 2**30,
                     mem["arena_bytes"] / 2**30, mem["libraries_and_pool_bytes"] / 2**30)
        import psutil

        mem["host_rss_bytes"] = psutil.Process().memory_info().rss
    log.info("%s", results[-1].breakdown.table())
    log.info("largest compute costs (last step): %s", ", ".join(
        f"{op} {t * 1e3:.1f} ms" for op, t, _ in op_totals(eng.last_trace.spans)[:5]))
    if trace_file:
        trace_file.close()
        log.info("trace: %s (%d events; open in ui.perfetto.dev)", args.trace,
                 trace_file.n_events)
    if metrics:
        metrics.close()
    log.info("memory: device arena %.3f GiB (regions %.3f GiB), host arena %.3f GiB "
             "(regions %.3f GiB)", mem["device_arena"] / 2**30, mem["device_regions"] / 2**30,
             mem["host_arena"] / 2**30, mem["host_regions"] / 2**30)
    if args.json:
        from models.serial import to_dict

        json.dump({"plan_hash": plan.hash, "backend": backend, "memory": mem,
                   "device": getattr(be_probe, "device_name", backend),
                   "plan": json.loads(plan.to_json()),
                   "steps": [to_dict(r) for r in results]}, sys.stdout, indent=2)
        print()
    return 0


def _is_zoo(name: str) -> bool:
    from models.config import zoo_names

    return name in zoo_names()


if __name__ == "__main__":
    sys.exit(main())
