"""What one ring process does: plan its rank, open the transport, train the job's steps on the
global batches and write its result (losses on every rank, its own blocks' weights) to the job's
output folder. The launcher (ring/launch.py) or torchrun / srun starts one of these per rank.
Never spawns processes and never reads another rank's memory except through the transport."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from dataflow.checkpoint import latest_checkpoint
from dataflow.models.errors import ConfigError
from dataflow.optimizer import AdamWConfig
from dataflow.ring.bootstrap import open_rank
from dataflow.ring.checkpoint import load_ring_checkpoint, save_ring_checkpoint
from dataflow.ring.env import RankEnv
from dataflow.ring.job import (RingJob, batches, eval_batch, model_config, model_weights_dir,
                               step_batch)
from dataflow.ring.transport import RingError
from dataflow.settings import settings_from_env

log = logging.getLogger("dataflow.ring.worker")


def run_rank(job: RingJob, env: RankEnv) -> int:
    """Train `job` as rank env.rank. 0 done; 1 with one line on stderr when this rank or the
    ring failed (a RingError names the rank that died or hung)."""
    tag = f"[rank {env.rank}/{env.gpus}]"
    transport = None
    try:
        cfg = model_config(job.model)
        rank, transport = open_rank(
            cfg, job.seqlen, job.host_gb, job.dev_gb, env=env, replicas=job.replicas,
            backend=job.backend, transport=job.transport, timeout_s=job.timeout_s,
            seed=job.seed, optimizer=AdamWConfig(lr=job.lr, max_grad_norm=job.max_grad_norm),
            grad_accum=job.grad_accum, deferred_update=not job.eager_update, trace=job.trace,
            split_fetch=job.split_fetch, split_update=job.split_update,
            **{"placement": job.placement, "precision": job.precision,
               "vocab_parallel": job.vocab_parallel_head, **dict(job.constraints)})
        rp = rank.rp
        ring_size = rp.n_ranks
        losses, norms, times, breakdowns = [], [], [], []
        kill = job.fault.split(":") if job.fault.startswith("kill:") else None
        seqs = rp.plan.chunking.seqs_per_step * job.replicas
        start = _resume(job, rank, transport, cfg, tag)
        source = model_weights_dir(job.model)
        if start == 0 and source is not None:  # a fine-tune starts from the model's weights
            rank.load_weights(source)
        for step, batch in enumerate(batches(job, cfg, seqs, start), start):
            if kill and int(kill[1]) == env.rank and int(kill[2]) == step:
                os.kill(os.getpid(), signal.SIGKILL)
            stats = rank.train_step(batch)
            losses.append(stats.loss)
            norms.append(stats.grad_norm)
            times.append(stats.step_time_s)
            print(f"{tag} step {step + 1}/{job.steps} loss {stats.loss:.6f} "
                  f"{stats.tokens / max(stats.step_time_s, 1e-12):,.0f} tok/s "
                  f"({stats.step_time_s:.3f} s)", file=sys.stderr, flush=True)
            if rank.last_breakdown is not None:
                bd = rank.last_breakdown
                breakdowns.append({"wall_s": bd.wall_s, **bd.parts()})
                print(f"{tag} step {step + 1}: {bd.summary()}", file=sys.stderr, flush=True)
            if job.save_every and ((step + 1) % job.save_every == 0 or step + 1 == job.steps):
                t0 = time.perf_counter()
                path = save_ring_checkpoint(rank, transport, cfg, job.checkpoint_dir,
                                            data={"source": job.data, "step": step + 1},
                                            keep=job.keep or None,
                                            force_dir=job.force_checkpoint_dir)
                if env.rank == 0:
                    print(f"{tag} step {step + 1}: checkpoint {path} "
                          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        eval_loss = None
        if job.eval_seqs:
            q = rp.plan.chunking.seqs_per_round * job.replicas
            held = step_batch(eval_batch(job, cfg, seqs), cfg, job.seqlen, pad_rows_to=q)
            eval_loss = rank.evaluate(held).loss
            print(f"{tag} eval loss {eval_loss:.6f} ({job.eval_seqs} sequences)",
                  file=sys.stderr, flush=True)
        if job.out_dir:
            out = Path(job.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            if job.save_weights:
                np.savez(out / f"rank{env.rank}.npz", **{k: v.view(np.uint16)
                                                         for k, v in rank.weights().items()})
            (out / f"rank{env.rank}.json").write_text(json.dumps({
                "rank": env.rank % ring_size, "replica": env.rank // ring_size,
                "world_size": env.gpus,
                "layers": list(rp.layers), "placement": rp.placement,
                "split_fetch": rp.split_fetch, "split_update": rp.split_update,
                "vocab_parallel": rp.vocab_parallel, "round_overlap": rp.round_overlap,
                "state_parts": rp.plan.state_parts,
                "has_embed": rp.has_embed, "has_head": rp.has_head, "losses": losses,
                "grad_norms": norms,
                "step_times_s": times, "eval_loss": eval_loss, "breakdowns": breakdowns,
                "tokens_per_step": rp.plan.chunking.tokens_per_step * job.replicas,
                "chunking": {"chunk_tokens": rp.plan.chunking.chunk_tokens,
                             "chunks_per_round": rp.plan.chunking.chunks_per_round,
                             "rounds_per_step": rp.plan.chunking.rounds_per_step},
                "head_sub_tokens": rp.plan.slots.head_sub_tokens if rp.has_head else None,
                "device_bytes": rp.plan.memory.device_bytes,
                "host_bytes": rp.plan.memory.host_bytes, "plan_hash": rp.plan.hash}))
        # a close that hangs (a communicator waiting for a peer) says where, once a minute
        faulthandler.dump_traceback_later(60, repeat=True, file=sys.stderr)
        try:
            rank.close()
        finally:
            faulthandler.cancel_dump_traceback_later()
        transport = None
        return 0
    except RingError as exc:
        print(f"{tag} ring error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - one line; the other ranks are told to stop
        if transport is not None:
            transport.abort(str(exc))
        print(f"{tag} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if settings_from_env().ring_debug:
            raise
        return 1
    finally:
        if transport is not None:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def _resume(job: RingJob, rank, transport, cfg, tag: str) -> int:
    """With job.resume, load the newest checkpoint in job.checkpoint_dir into this rank (every
    rank the same one) and return its step; else 0."""
    if not job.resume:
        return 0
    path = latest_checkpoint(job.checkpoint_dir)
    found = transport.allgather(np.array([-1.0 if path is None else float(path.name[5:])]))
    if len({float(row[0]) for row in found}) > 1:
        raise ConfigError(f"the ranks see different newest checkpoints in {job.checkpoint_dir} "
                          f"(steps {[int(row[0]) for row in found]}); give every rank the same "
                          "directory")
    if path is None:
        print(f"{tag} no checkpoint in {job.checkpoint_dir} yet: starting at step 0",
              file=sys.stderr, flush=True)
        return 0
    info = load_ring_checkpoint(rank, transport, cfg, path)
    if info.data is not None and info.data.get("source", job.data) != job.data:
        log.warning("%s checkpoint %s was trained on data %r; this run reads %r", tag, path,
                    info.data.get("source"), job.data)
    print(f"{tag} resumed from {path} at step {info.step}", file=sys.stderr, flush=True)
    return info.step


def child_main(job_json: str, env_json: str) -> None:
    """Entry point of a spawned rank (multiprocessing target): exits with run_rank's code."""
    job, env = RingJob.from_json(job_json), RankEnv.from_json(env_json)
    started = time.monotonic()
    code = run_rank(job, env)
    log.debug("rank %d finished in %.1f s", env.rank, time.monotonic() - started)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: nothing of ours is left to flush
