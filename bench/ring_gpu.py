"""The ring on a machine with several GPUs against one GPU (issue 18). Runs, each in fresh
processes and one after the other:

  ring     N ranks, one GPU each (NCCL; --transport shm: ranks sharing the GPUs there are),
           with the schedules asked for (--split-fetch, --split-update, --vocab-parallel-head,
           --round-overlap: shared memory only),
           per-device budgets --ring-budget, launched by
           `dataflow-ring --gpus N` or `torchrun --nproc-per-node N -m dataflow.cli.ring` (--launcher);
           every rank's losses and step times come back through dataflow.cli.ring's --out files.
  single   unless --no-single: one GPU (dataflow.engine.Engine) at --single-budget with the
           ring's own chunking (chunk tokens, chunks per round, rounds per step, read from rank
           0's record) and its head rank's head sub-chunk, so both train the same global
           batches (dataflow.ring.job.batches: the shipped text) from the same initial weights, with
           the ring's learning rate and seed.
  own      with --single-own: one GPU again, at the chunking the planner gives it for the
           ring's global batch (tokens_per_step): the speed baseline where the ring chose
           smaller chunks than one device would.

While each runs, every process of it is sampled every 0.5 s: its RSS (psutil) and its device
memory (NVML, per process, CUDA context included); a child that only creates a CuPy context
first measures that context. The record (JSON, --out/ring_gpu.json) holds the device names,
commit, config, per-process peaks against the per-device budgets, both runs' losses and step
times, the losses' differences and the ring's tok/s over the single GPU's (steps after the first).
The short table comes last on stdout. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0);
every NCCL_* variable the ranks see is recorded (try NCCL_MAX_NCHANNELS or
NCCL_P2P_USE_CUDA_MEMCPY=1 to take NCCL's copies off the SMs).

    python -m dataflow.bench.ring_gpu --out runs/ring8b 8b 8192 --ring-budget 60:24 --single-budget 120:24
    python -m dataflow.bench.ring_gpu --out runs/ring32b 32b 8192 --ring-budget 125:40 --no-single \\
        --launcher torchrun --steps 2
    python -m dataflow.bench.ring_gpu --out runs/su8 8b 8192 --gpus 8 --replicas 8 --split-update \\
        --ring-budget 80:24 --single-budget 120:24 --single-timeout 1200
    python -m dataflow.bench.ring_gpu --out runs/vocab 1b 4096 --gpus 2 --vocab-parallel-head \\
        --transport shm --ring-budget 30:8 --single-budget 30:8      # one GPU: the bits

Never trains in its own process and never creates a CUDA context in it."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from dataflow.backends import make_backend
from dataflow.bench.process_peaks import ProcessPeaks, child_env, context_bytes, run_sampled
from dataflow.bench.sweep.sweep import git_commit
from dataflow.engine import Engine, default_profile
from dataflow.memplan import make_plan
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.profiles import get_profile, profile_for_device
from dataflow.memplan.search.build import finish_plan
from dataflow.memplan.search.layout import predict_layout
from dataflow.memplan.search.ring_plan import LINKS, Link
from dataflow.optimizer import AdamWConfig
from dataflow.ring.job import RingJob, batches, model_config

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
LAUNCHERS = ("dataflow-ring", "torchrun")


def _budget(text: str) -> tuple[float, float]:
    try:
        host, dev = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write HOST_GB:DEV_GB, e.g. 60:24") from None
    if host <= 0 or dev <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: both budgets must be > 0")
    return host, dev


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.ring_gpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("seqlen", type=int)
    p.add_argument("--out", required=True, help="directory for the record and the logs")
    p.add_argument("--gpus", type=int, default=2, help="processes in all, one GPU each")
    p.add_argument("--replicas", default="1", metavar="R|auto",
                   help="data-parallel replicas (rings of gpus / R); 'auto': the planner's "
                        "layout (dataflow-ring without --replicas). Default 1: one ring")
    p.add_argument("--ring-budget", type=_budget, default=(60.0, 24.0), metavar="HOST:DEV",
                   help="per-device budgets of each rank, GiB (default 60:24)")
    p.add_argument("--single-budget", type=_budget, default=(120.0, 24.0), metavar="HOST:DEV",
                   help="budgets of the one-GPU run, GiB (default 120:24)")
    p.add_argument("--no-single", action="store_true", help="run the ring only")
    p.add_argument("--ring-from", metavar="DIR", default=None,
                   help="do not run the ring: take its run from DIR/ring_gpu.json (an earlier "
                        "--no-single run of the same model, length, GPUs and budgets, on this "
                        "machine) and run the one-GPU baseline against it: a comparison too long "
                        "for one call split over two on the same machine")
    p.add_argument("--single-own", action="store_true",
                   help="also run one GPU at the planner's own chunking for the ring's global "
                        "batch (the fair speed baseline where the ring chose smaller chunks "
                        "than one device would; its losses differ in the last bits)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="dataflow-ring")
    p.add_argument("--split-fetch", action="store_true",
                   help="replicas split their weight fetches (dataflow-ring --split-fetch)")
    p.add_argument("--split-update", action="store_true",
                   help="replicas split their update (dataflow-ring --split-update): each "
                        "reduce-scatters, updates and gathers 1/R of every block")
    p.add_argument("--vocab-parallel-head", action="store_true",
                   help="every ring rank takes 1/N of the head's vocabulary (dataflow-ring "
                        "--vocab-parallel-head; over NCCL its schedule is checked for "
                        "rendezvous deadlocks before the communicators are made, and has not "
                        "run on two GPUs yet; --transport shm runs it on one GPU)")
    p.add_argument("--transport", choices=("auto", "nccl", "shm"), default="auto",
                   help="auto: NCCL with cupy, shared memory with numpy; shm with cupy runs "
                        "the ranks on the GPUs there are, several to a GPU where fewer (a "
                        "proof of the bits on one GPU, not a speed measurement)")
    p.add_argument("--trace", action="store_true",
                   help="the ring's ranks trace their streams (dataflow-ring --trace): each "
                        "step's compute / exposed copy / host / idle per rank in ring.log and "
                        "ring/rank<r>.json")
    p.add_argument("--round-overlap", action="store_true",
                   help="overlapped rounds (dataflow-ring --round-overlap, the depth the "
                        "planner predicts fastest, perhaps none): over the shared-memory "
                        "transport only (NCCL would deadlock on them); without it the record "
                        "still shows them beside what ran (predicted.overlapped)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--placement", choices=("cyclic", "balanced", "contiguous", "auto"),
                   default="cyclic", help="dataflow-ring --placement: how the ring deals layers")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per step (dataflow.cli.ring --rounds; default: the planner's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=0.0, metavar="X",
                   help="clipping of both runs (default 0, off: the ring sums the global norm's "
                        "partial sums in another order, so clipped runs agree to about 1e-5, "
                        "unclipped ones bit for bit)")
    p.add_argument("--backend", choices=("cupy", "numpy"), default="cupy",
                   help="numpy: a CPU smoke run of this script (shared-memory transport)")
    p.add_argument("--timeout", type=float, default=480.0,
                   help="seconds each run may take before it is killed (default 480)")
    p.add_argument("--single-timeout", type=float, default=None, metavar="S",
                   help="seconds the one-GPU runs may take (default: --timeout; one GPU runs "
                        "every replica's rounds, so give it about replicas x the ring's)")
    p.add_argument("--link-bytes-per-s", type=float, default=None, metavar="B",
                   help="predict for this measured one-way link rate (bench.link_bandwidth) "
                        "instead of the assumed NVLink")
    p.add_argument("--single-child", help=argparse.SUPPRESS)
    return p


# -- the two runs -------------------------------------------------------------------------------
def ring_command(args) -> list[str]:
    host, dev = args.ring_budget
    common = [f"{host:g}", f"{dev:g}", str(args.seqlen), args.model, "--backend", args.backend,
              "--steps", str(args.steps), "--lr", f"{args.lr:g}",
              "--max-grad-norm", f"{args.max_grad_norm:g}", "--out",
              str(Path(args.out) / "ring"), "--no-weights", "--timeout", "300"]
    if args.rounds:
        common += ["--rounds", str(args.rounds)]
    if getattr(args, "placement", "cyclic") != "cyclic":
        common += ["--placement", args.placement]
    if args.replicas != "auto":
        common += ["--replicas", str(args.replicas)]
    if getattr(args, "trace", False):
        common += ["--trace"]
    if getattr(args, "round_overlap", False):
        common += ["--round-overlap"]
    for flag in ("split_fetch", "split_update", "vocab_parallel_head"):
        if getattr(args, flag, False):
            common += ["--" + flag.replace("_", "-")]
    if args.launcher == "torchrun":
        given = [] if args.transport == "auto" else ["--transport", args.transport]
        return [shutil.which("torchrun") or "torchrun", "--standalone",
                f"--nproc-per-node={args.gpus}", "-m", "dataflow.cli.ring", *given, *common]
    transport = _transport(args)
    return [sys.executable, "-m", "dataflow.cli.ring", "--gpus", str(args.gpus), "--transport", transport,
            *common]


def _transport(args) -> str:
    """The ring's transport: --transport, or auto's (NCCL with cupy, shared memory with numpy)."""
    kind = getattr(args, "transport", "auto")
    return kind if kind != "auto" else "nccl" if args.backend == "cupy" else "shm"


def single_child(spec_json: str) -> int:
    """The one-GPU run in this fresh process: prints one JSON line (losses, step times)."""
    spec = json.loads(spec_json)
    cfg = model_config(spec["model"])
    host, dev = spec["budget"]
    job = RingJob(model=spec["model"], seqlen=spec["seqlen"], host_gb=host, dev_gb=dev, gpus=1,
                  steps=spec["steps"], lr=spec["lr"],
                  max_grad_norm=spec.get("max_grad_norm") or None)
    t0 = time.perf_counter()
    be = make_backend(spec["backend"])
    eng = Engine.from_plan(_single_plan(cfg, spec, be), backend=be, seed=job.seed,
                           optimizer=AdamWConfig(lr=job.lr, max_grad_norm=job.max_grad_norm))
    ch = eng.plan.chunking
    out = {"setup_s": time.perf_counter() - t0, "losses": [], "step_times_s": [],
           "tokens_per_step": ch.tokens_per_step,
           "chunking": {"chunk_tokens": ch.chunk_tokens, "chunks_per_round": ch.chunks_per_round,
                        "rounds_per_step": ch.rounds_per_step},
           "device_bytes": eng.plan.memory.device_bytes, "host_bytes": eng.plan.memory.host_bytes,
           "head_sub_tokens": eng.plan.slots.head_sub_tokens}
    for batch in batches(job, cfg, eng.seqs_per_step):
        r = eng.train_step(batch)
        out["losses"].append(r.loss)
        out["step_times_s"].append(r.step_time_s)
        print(f"single step {len(out['losses'])}: loss {r.loss:.6f} {r.tok_per_s:,.0f} tok/s",
              file=sys.stderr, flush=True)
    eng.close()
    print(json.dumps(out), flush=True)
    return 0


def _single_plan(cfg, spec: dict, be):
    """The one-GPU plan: this GPU's profile, the ring's chunking and, where the ring's head rank
    took a shorter head sub-chunk than the planner gives one device (the planner lengthens it
    where memory allows), that one: the loss and the head's gradient are then summed in the same
    pieces, so the two runs can agree bit for bit."""
    import dataclasses

    host, dev = spec["budget"]
    plan = make_plan(cfg, spec["seqlen"], Budget.from_gib(host, dev), default_profile(be),
                     **dict(spec["chunking"]))
    sub = spec.get("head_sub_tokens")
    if sub and sub != plan.slots.head_sub_tokens:
        d = decisions_of(plan)
        try:
            plan = finish_plan(dataclasses.replace(d, slots=dataclasses.replace(
                d.slots, head_sub_tokens=sub)), plan.budget, plan.profile)
        except InfeasibleBudget as exc:  # the ring's longer sub-chunk does not fit beside
            # what this plan spends its room on: keep the planner's (losses then agree within
            # the head's bf16 bound, not bit for bit)
            print(f"single: the ring's head sub-chunk of {sub} tokens does not fit this plan "
                  f"({exc}); keeping the planner's {plan.slots.head_sub_tokens}",
                  file=sys.stderr, flush=True)
    return plan


def _tok_s(rec: dict | None) -> float | None:
    if not rec or not rec.get("step_times_s"):
        return None
    times = rec["step_times_s"][1:] or rec["step_times_s"]
    return rec["tokens_per_step"] / (sum(times) / len(times))


def _last_json(path: Path) -> dict | None:
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def _failure(path: Path) -> dict:
    """{'error': the last line of a failed run's log} (its exception, say), or {}."""
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    except OSError:
        return {}
    return {"error": lines[-1][:400]} if lines else {}


def _earlier_ring(args) -> dict:
    """The ring run of --ring-from, refused unless it ran what this call would have run."""
    path = Path(args.ring_from) / "ring_gpu.json"
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--ring-from {args.ring_from}: cannot read {path} ({exc}); run the "
                         f"ring first with --no-single --out {args.ring_from}")
    cfg = earlier.get("config", {})
    want = {"model": args.model, "seqlen": args.seqlen, "gpus": args.gpus,
            "ring_budget_gib": list(args.ring_budget), "steps": args.steps, "lr": args.lr,
            "rounds": args.rounds, "replicas": args.replicas, "split_fetch": args.split_fetch,
            "max_grad_norm": args.max_grad_norm, **_schedule(args)}
    # records written before a key existed ran without it: its default
    had = {"split_update": False, "vocab_parallel_head": False, "transport": "nccl",
           "round_overlap": False}
    differ = {k: (cfg.get(k, had.get(k)), v) for k, v in want.items()
              if cfg.get(k, had.get(k)) != v}
    if differ:
        raise SystemExit(f"--ring-from {args.ring_from}: its run differs from this call's "
                         f"(earlier, now): {differ}; pass the same arguments")
    return earlier


def _schedule(args) -> dict:
    """The record's keys of the schedule flags and the transport that ran."""
    return {"split_update": args.split_update, "vocab_parallel_head": args.vocab_parallel_head,
            "transport": _transport(args), "round_overlap": bool(args.round_overlap)}


def _enough_gpus(args, devices: list[str]) -> None:
    """Refuse before anything runs where this machine shows fewer GPUs than the ring needs
    (NCCL: one a rank; shared memory lets ranks share one)."""
    need = args.gpus if _transport(args) == "nccl" else 1
    if args.backend == "cupy" and len(devices) < need:
        raise SystemExit(f"--gpus {args.gpus}: this machine shows {len(devices)} GPU(s) "
                         f"({', '.join(devices) or 'none through NVML'}); run on a machine "
                         f"with {args.gpus}, or give --gpus {max(1, len(devices))}, "
                         "--transport shm (ranks sharing GPUs: bits, not speed) or "
                         "--backend numpy (the CPU ring)")


def collect(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    probe = ProcessPeaks()
    _enough_gpus(args, probe.device_names())
    record = {"kind": "ring_gpu", "commit": git_commit(REPO_ROOT), "devices": probe.device_names(),
              "config": {"model": args.model, "seqlen": args.seqlen, "gpus": args.gpus,
                         "ring_budget_gib": list(args.ring_budget),
                         "single_budget_gib": None if args.no_single else list(args.single_budget),
                         "launcher": args.launcher, "steps": args.steps, "lr": args.lr,
                         "rounds": args.rounds, "replicas": args.replicas,
                         "split_fetch": args.split_fetch, **_schedule(args),
                         "max_grad_norm": args.max_grad_norm},
              "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "nccl_env": {k: v for k, v in sorted(child_env().items()) if k.startswith("NCCL_")}}
    if args.ring_from:
        earlier = _earlier_ring(args)
        ring = earlier["ring"]
        record["ring_from"] = {"dir": args.ring_from, "time_utc": earlier.get("time_utc"),
                               "commit": earlier.get("commit")}
        record["context_bytes"] = ctx = earlier.get("context_bytes")
        rc, wall = ring["exit_code"], ring["wall_s"]
    else:
        record["context_bytes"] = ctx = context_bytes(out) if args.backend == "cupy" else None
        print(f"CUDA context: {None if ctx is None else round(ctx / GIB, 3)} GiB", flush=True)
        cmd = ring_command(args)
        print("ring:", " ".join(cmd), flush=True)
        rc, wall, rows = run_sampled(cmd, out / "ring.log", args.timeout, child_env())
        ring = {"exit_code": rc, "wall_s": wall, "processes": rows}
        for r in range(args.gpus):
            try:
                ring[f"rank{r}"] = json.loads((out / "ring" / f"rank{r}.json").read_text())
            except (OSError, ValueError):
                ring[f"rank{r}"] = None
    record["ring"] = ring
    rank0 = ring.get("rank0")
    print(f"ring exit {rc} in {wall:.0f} s; losses {rank0 and rank0['losses']}", flush=True)
    if not args.no_single and rank0 and rank0.get("chunking"):
        head = next((ring[f"rank{r}"] for r in range(args.gpus) if ring.get(f"rank{r}")
                     and ring[f"rank{r}"].get("head_sub_tokens")), None)
        chunking = dict(rank0["chunking"])
        per_replica = chunking["chunk_tokens"] * chunking["chunks_per_round"] * \
            chunking["rounds_per_step"]
        replicas = max(1, rank0["tokens_per_step"] // per_replica)
        if replicas > 1:  # the global batch: each replica's rounds, one after the other
            chunking["rounds_per_step"] *= replicas
        spec = {"model": args.model, "seqlen": args.seqlen, "budget": list(args.single_budget),
                "backend": args.backend,
                "steps": args.steps, "lr": args.lr, "chunking": chunking,
                "max_grad_norm": args.max_grad_norm,
                "head_sub_tokens": head and head["head_sub_tokens"]}
        cmd = [sys.executable, "-m", "dataflow.bench.ring_gpu", args.model, str(args.seqlen), "--out",
               str(out), "--single-child", json.dumps(spec)]
        env = {**child_env(), "CUDA_VISIBLE_DEVICES": "0"}
        single_s = args.single_timeout or args.timeout
        rc, wall, rows = run_sampled(cmd, out / "single.log", single_s, env)
        record["single"] = {"exit_code": rc, "wall_s": wall, "processes": rows,
                            **(_last_json(out / "single.log") or _failure(out / "single.log"))}
        if args.single_own:
            own = dict(spec, chunking={"tokens_per_step": rank0["tokens_per_step"]},
                       head_sub_tokens=None)
            cmd = cmd[:-1] + [json.dumps(own)]
            rc, wall, rows = run_sampled(cmd, out / "single_own.log", single_s, env)
            record["single_own"] = {"exit_code": rc, "wall_s": wall, "processes": rows,
                                    **(_last_json(out / "single_own.log") or {})}
    record["predicted"] = predicted(args, probe.device_names(), rank0)
    _judge(record, args)
    return record


def predicted(args, devices: list[str], rank0: dict | None) -> dict | None:
    """The planner's prediction for what ran (the profile of GPU 0's name, the ring size and
    replicas rank 0 reports, the same rounds): tok/s over NVLink for the ring, and one device
    at the single budget with the ring's chunking. A model; the record holds both."""
    if not rank0 or not rank0.get("chunking"):
        return None
    prof = profile_for_device(devices[0]) if devices and args.backend == "cupy" else \
        get_profile("cpu")
    cfg = model_config(args.model)
    ch = rank0["chunking"]
    per_replica = ch["chunk_tokens"] * ch["chunks_per_round"] * ch["rounds_per_step"]
    replicas = max(1, rank0["tokens_per_step"] // per_replica)
    link = LINKS[0] if not args.link_bytes_per_s else \
        Link(name="measured", bytes_per_s=args.link_bytes_per_s, latency_s=100e-6)
    ran = {"chunk_tokens": ch["chunk_tokens"], "chunks_per_round": ch["chunks_per_round"],
           "rounds_per_step": ch["rounds_per_step"],
           **({"vocab_parallel": True} if rank0.get("vocab_parallel") else {}),
           **({"state_parts": rank0["state_parts"]} if rank0.get("state_parts", 1) > 1 else {})}

    def predict(**kw):
        """The fastest prediction of what ran: a split update's ranks may have been searched
        with the part's AdamW charged or the whole one's (choose_layout weighs both)."""
        costs = ({}, {"whole_update_cost": True}) if "state_parts" in ran else ({},)
        return max((predict_layout(
            cfg, args.seqlen, Budget.from_gib(*args.ring_budget), prof, args.gpus,
            args.gpus // replicas, links=(link,), transport=_transport(args),
            split_fetch=bool(rank0.get("split_fetch", False)),
            split_update=bool(rank0.get("split_update", False)), **ran, **cost, **kw)
            for cost in costs), key=lambda o: o.on(link.name).tok_per_s)

    placed = {"placement": rank0["placement"]} if rank0.get("placement", "cyclic") != "cyclic" \
        else {}
    depth = rank0.get("round_overlap") or 0  # the ranks ran overlapped: predict that depth
    opt = predict(**placed, overlap_depth=depth) if depth else predict(**placed)
    over = predict(round_overlap=True)
    on = opt.on(link.name)
    out = {"overlapped": {"tok_per_s": over.on(link.name).tok_per_s,
                          "round_overlap": over.layout.round_overlap},
           "profile": prof.name, "ring_size": opt.layout.ring_size, "link": link.name,
           "link_bytes_per_s": link.bytes_per_s,
           "replicas": opt.layout.replicas, "split_fetch": opt.layout.split_fetch,
           "split_update": opt.layout.split_update,
           "vocab_parallel_head": opt.layout.vocab_parallel_head,
           "tok_per_s": on.tok_per_s,
           "allreduce_s": on.allreduce_s, "bubble_frac": on.bubble_frac}
    if not args.no_single:
        try:
            single = make_plan(cfg, args.seqlen, Budget.from_gib(*args.single_budget), prof,
                               chunk_tokens=ch["chunk_tokens"],
                               chunks_per_round=ch["chunks_per_round"],
                               rounds_per_step=ch["rounds_per_step"] * replicas)
            out["single_tok_per_s"] = single.prediction.tok_per_s
        except Exception as exc:  # noqa: BLE001 - a record without it, and why
            out["single_error"] = str(exc)[:200]
    return out


def _judge(record: dict, args) -> None:
    """Per-process budget checks and the ring against the single GPU."""
    ctx = record.get("context_bytes") or 0

    def checks(rows, budget):
        host, dev = budget
        return [{"gpu": row["gpu"],
                 "device_minus_context_minus_budget_gib":
                     (row["device_used_bytes"] - ctx) / GIB - dev,
                 "rss_minus_host_budget_gib":
                     None if row["rss_bytes"] is None else row["rss_bytes"] / GIB - host}
                for row in rows]

    record["ring"]["budget_checks"] = checks(record["ring"]["processes"], args.ring_budget)
    for key in ("single", "single_own"):
        if record.get(key):
            record[key]["budget_checks"] = checks(record[key]["processes"], args.single_budget)
    rank0, single = record["ring"].get("rank0"), record.get("single")
    cmp = {"ring_tok_per_s": _tok_s(rank0), "single_tok_per_s": _tok_s(single)}
    if cmp["ring_tok_per_s"] and cmp["single_tok_per_s"]:
        cmp["speedup"] = cmp["ring_tok_per_s"] / cmp["single_tok_per_s"]
    own = _tok_s(record.get("single_own"))
    if own:
        cmp["single_own_tok_per_s"] = own
        cmp["single_own_chunking"] = record["single_own"].get("chunking")
        if cmp["ring_tok_per_s"]:
            cmp["speedup_over_own"] = cmp["ring_tok_per_s"] / own
    if rank0 and single and single.get("losses"):
        a, b = rank0["losses"], single["losses"]
        cmp["losses_identical"] = a == b
        cmp["loss_max_rel_diff"] = max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=None)
    pred = record.get("predicted") or {}
    if cmp.get("ring_tok_per_s") and pred.get("tok_per_s"):
        cmp["ring_measured_over_predicted"] = cmp["ring_tok_per_s"] / pred["tok_per_s"]
    if cmp.get("single_tok_per_s") and pred.get("single_tok_per_s"):
        cmp["single_measured_over_predicted"] = cmp["single_tok_per_s"] / pred["single_tok_per_s"]
    record["comparison"] = cmp


def table(record: dict) -> str:
    c, ring = record["comparison"], record["ring"]
    lines = [f"devices {record['devices']}  commit {record['commit']}",
             f"{record['config']['gpus']} GPUs, replicas {record['config'].get('replicas')} "
             f"({record['config']['launcher']}, {record['config'].get('transport', 'nccl')}"
             + "".join(f", {k.replace('_', ' ')}" for k in ("split_fetch", "split_update",
                                                          "vocab_parallel_head", "round_overlap")
                       if record["config"].get(k)) + ") exit "
             f"{ring['exit_code']} in {ring['wall_s']:.0f} s; losses "
             f"{ring.get('rank0') and ring['rank0']['losses']}"]
    lines += _check_lines(ring)
    s = record.get("single")
    if s:
        lines.append(f"single GPU exit {s['exit_code']} in {s['wall_s']:.0f} s; losses "
                     f"{s.get('losses')}" + (f"; {s['error']}" if s.get("error") else ""))
        lines += _check_lines(s)
    o = record.get("single_own")
    if o:
        lines.append(f"single GPU, its own chunking {o.get('chunking')}: exit {o['exit_code']} "
                     f"in {o['wall_s']:.0f} s; losses {o.get('losses')}")
        lines += _check_lines(o)
    fmt = lambda v: "n/a" if v is None else f"{v:,.0f}"  # noqa: E731
    lines.append(f"tok/s ring {fmt(c.get('ring_tok_per_s'))}, "
                 f"single {fmt(c.get('single_tok_per_s'))}"
                 + (f", speedup {c['speedup']:.3f}x" if c.get("speedup") else "")
                 + (f"; losses identical {c['losses_identical']}, max rel diff "
                    f"{c['loss_max_rel_diff']:.2e}" if "losses_identical" in c else "")
                 + (f"; single at its own chunking {fmt(c['single_own_tok_per_s'])}, speedup "
                    f"{c['speedup_over_own']:.3f}x" if c.get("speedup_over_own") else ""))
    pred = record.get("predicted") or {}
    if pred:
        lines.append(f"predicted ({pred.get('profile')}, {pred.get('replicas')} x ring of "
                     f"{pred.get('ring_size')}): ring {fmt(pred.get('tok_per_s'))}, single "
                     f"{fmt(pred.get('single_tok_per_s'))}; measured/predicted ring "
                     f"{c.get('ring_measured_over_predicted', float('nan')):.3f}, single "
                     f"{c.get('single_measured_over_predicted', float('nan')):.3f}")
        ranks, gpus = record["config"]["gpus"], len(record.get("devices") or ())
        if gpus and gpus < ranks:  # the prediction is of one GPU a rank
            lines.append(f"  ({ranks} ranks shared {gpus} GPU{'s' * (gpus > 1)}: the ring's "
                         "tok/s is not its speed on one GPU a rank; bits and memory only)")
    return "\n".join(lines)


def _check_lines(run: dict) -> list[str]:
    out = []
    for chk in run.get("budget_checks", []):
        rss = chk["rss_minus_host_budget_gib"]
        out.append(f"  GPU {chk['gpu']}: device used - context - budget "
                   f"{chk['device_minus_context_minus_budget_gib']:+.2f} GiB, RSS - host budget "
                   f"{'n/a' if rss is None else f'{rss:+.2f}'} GiB")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.single_child:
        return single_child(args.single_child)
    if args.launcher == "torchrun" and shutil.which("torchrun") is None:
        parser.error("--launcher torchrun: no torchrun on PATH (it comes with PyTorch); use "
                     "--launcher dataflow-ring")
    if args.ring_from and args.no_single:
        parser.error("--ring-from runs only the one-GPU baseline; drop --no-single")
    if args.round_overlap and _transport(args) != "shm":
        parser.error("--round-overlap runs over the shared-memory transport only (NCCL takes a "
                     "link's messages in the order sent and would deadlock on them); add "
                     "--transport shm, or drop the flag: the record's predicted.overlapped "
                     "gives the planner's overlapped prediction")
    if args.backend == "numpy" and args.transport == "nccl":
        parser.error("--transport nccl needs --backend cupy (NCCL carries device arrays); the "
                     "numpy ring runs over shared memory (--transport shm or auto)")
    if args.gpus < 1 or args.steps < 1:
        parser.error(f"--gpus {args.gpus} and --steps {args.steps} must be at least 1")
    record = collect(args)
    path = Path(args.out) / "ring_gpu.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(table(record))
    return 0 if record["ring"]["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
