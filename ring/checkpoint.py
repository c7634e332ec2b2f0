"""Checkpoints of a ring, in dataflow.checkpoint's format: a ring's checkpoint is a checkpoint of
the whole model, which one device (or a ring of another size) loads, and a ring loads one
device's. Saving: process 0 creates the temporary directory and the transport's all-gather
tells every process its name; each rank of replica 0 writes its own blocks' files (the other
replicas hold the same bits) and a list of them; process 0 merges the lists in model order,
seals and renames. Loading: every process checks the settings and hashes its own blocks' files;
only when every process found its files sound does any write, so a damaged checkpoint leaves
the whole ring as it was. Every process of the ring must call each function (collective).
The directory must be one that every process sees (one host, or a shared file system). Never
moves a tensor through the transport: each rank reads and writes its own files."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from dataflow import checkpoint as ckpt
from dataflow.checkpoint_dir import check_checkpoint_root
from dataflow.models.errors import ConfigError

_LIST = "rank{rank}.files.json"
"""What rank `rank` wrote into the temporary directory; merged and removed by process 0."""


def save_ring_checkpoint(rank, transport, cfg, root, *, data: dict | None = None, rng=None,
                         extra: dict | None = None, keep: int | None = None,
                         force_dir: bool = False) -> Path:
    """Write the ring's state to `root/step_<step>` (dataflow.checkpoint's layout and checks)
    and return that path on every process. rank: this process's dataflow.ring.rank.RingRank;
    cfg: the whole model's ModelConfig; data / rng / extra / keep / force_dir: as
    dataflow.checkpoint's, taken from process 0 (which refuses a root holding other files
    unless force_dir; every process then raises)."""
    _refuse_vocab_parallel(rank)
    _refuse_split_update(rank)
    keep, rng = ckpt.checked_keep(keep), ckpt.rng_state(rng)
    root, step = Path(root), rank.optimizer.step_count
    leader = transport.rank == 0 and transport.replica == 0
    tmp, failure = None, ""
    if leader:
        try:
            check_checkpoint_root(str(root), force=force_dir, way_out="pass force_dir=True")
            tag = uuid.uuid4().hex[:8]
            tmp = ckpt.new_temp_dir(root, step, tag=tag)
            token = [float(os.getpid()), float(int(tag, 16))]
        except ConfigError as exc:
            token, failure = [-1.0, 0.0], str(exc)
        except OSError as exc:
            token, failure = [-1.0, 0.0], f"process 0 cannot create a checkpoint in {root}: {exc}"
    else:
        token = [0.0, 0.0]
    rows = transport.allgather(np.array(token + [float(step)], np.float64))
    try:
        pid, tag, step0 = int(rows[0][0]), f"{int(rows[0][1]):08x}", int(rows[0][2])
        if pid < 0:
            raise ConfigError(failure or "process 0 could not create the checkpoint's "
                              f"temporary directory under {root} (its error says why)")
        if step0 != step:  # every rank counts the same steps; a mismatch is a bug, not data
            raise ConfigError(f"ring ranks disagree on the step to save ({step} here, {step0} "
                              "on process 0)")
        tmp = root / ckpt.temp_dir_name(step, pid, tag)
        error = None  # this process's own failure: re-raised once every process knows
        if transport.replica == 0:
            try:
                files, manifest = ckpt.write_block_files(rank, rank.block_refs(), tmp)
                _write_list(tmp / _LIST.format(rank=transport.rank), files, manifest)
            except Exception as exc:  # noqa: BLE001 - told to the others, then re-raised
                error = exc
        _agree(transport, error, "could not write their blocks (their errors say why); nothing "
               "was saved")
        final = root / ckpt.step_dir_name(step)
        if leader:
            try:
                files, manifest = _merged_lists(tmp, transport.ring_size, cfg.n_layers)
                meta = ckpt.checkpoint_meta(rank.optimizer, rank.rp.plan, step, data, rng, extra)
                meta["ring"] = {"ranks": transport.ring_size, "replicas": transport.replicas}
                ckpt.seal(tmp, cfg, files, manifest, meta)
                ckpt.move_into_place(tmp, final)
                ckpt.finish(root, final, keep)
            except Exception as exc:  # noqa: BLE001 - told to the others, then re-raised
                error = exc
        _agree(transport, error, "could not complete the checkpoint (its error says why)")
        return final
    except BaseException:
        if leader and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _refuse_split_update(rank) -> None:
    """A split update's replica holds AdamW state for its part of each block alone, which the
    checkpoint format keeps whole: refused by name (the same on every process)."""
    rp = getattr(rank, "rp", None)
    if getattr(rp, "split_update", False) and rp.replicas > 1:
        raise ConfigError("checkpoints of replicas with --split-update are not built yet (each "
                          "replica holds the AdamW state of its part only); train without the "
                          "flag to save or resume")


def _refuse_vocab_parallel(rank) -> None:
    """Every rank of a vocabulary-parallel head holds a shard of the head block, which the
    checkpoint format keeps whole: refused by name (the same on every process)."""
    if getattr(rank.rp, "vocab_parallel", False):  # a stand-in rank plan has none
        raise ConfigError("checkpoints of a ring with --vocab-parallel-head are not built yet "
                          "(each rank holds a shard of the head block); train without the flag "
                          "to save or resume, or read each rank's weights (RingRank.weights)")


def _agree(transport, error: BaseException | None, what: str) -> None:
    """Collective: tell every process whether this one failed; re-raise this process's own
    `error`, else raise ConfigError naming the processes that failed ("process(es) [1] `what`")."""
    rows = transport.allgather(np.array([0.0 if error is not None else 1.0]))
    if error is not None:
        raise error
    bad = [i for i, r in enumerate(rows) if float(r[0]) < 1.0]
    if bad:
        raise ConfigError(f"process(es) {bad} {what}")


def _write_list(path: Path, files: list[dict], manifest: list[dict]) -> None:
    ckpt.write_bytes(path, json.dumps({"files": files, "manifest": manifest}).encode())


def _merged_lists(tmp: Path, ranks: int, n_layers: int) -> tuple[list[dict], list[dict]]:
    """Every rank's file and manifest entries in model order (embed, layers, head; weights, m,
    v), the rank lists removed; refuses a model with a block missing or written twice."""
    files, manifest = [], []
    for r in range(ranks):
        path = tmp / _LIST.format(rank=r)
        part = json.loads(path.read_text())
        files += part["files"]
        manifest += part["manifest"]
        path.unlink()
    order = {"embed": 0, "head": n_layers + 1, **{f"layers.{i}": 1 + i for i in range(n_layers)}}
    parts = {"weights": 0, "m": 1, "v": 2}
    files.sort(key=lambda e: (order[e["block"]], parts[e["part"]]))
    manifest.sort(key=lambda e: (0 if e["kind"] == "embed" else
                                 n_layers + 1 if e["kind"] == "head" else 1 + e["layer"]))
    blocks = [e["block"] for e in files if e["part"] == "weights"]
    if blocks != sorted(order, key=order.get):
        raise ConfigError(f"the ranks wrote blocks {blocks}; a model of {n_layers} layers needs "
                          "each of embed, layers.0.. and head exactly once")
    return files, manifest


def load_ring_checkpoint(rank, transport, cfg, path, *, verify: bool = True,
                         allow_changes: bool = False) -> ckpt.CheckpointInfo:
    """Restore this rank's blocks, the step and the schedule from a checkpoint of the whole
    model (a step directory, or the newest under a root), written by a ring of any size or by
    one device. Checks and (with verify) hashes come first on every process; if any process
    refuses, every process raises and none has written anything."""
    _refuse_vocab_parallel(rank)
    _refuse_split_update(rank)
    problem = None
    try:
        path, meta = ckpt.read_checkpoint(path)
        adopt = ckpt.check_settings(path, meta, cfg, rank.optimizer, allow_changes)
        ckpt.check_frozen(path, meta, rank.rp.plan)  # a frozen one has no m, v of some blocks
        todo = ckpt.block_entries(path, meta, rank, rank.block_refs())
        if verify:
            ckpt.verify_files(path, {"files": [entry for _, _, entry in todo]})
    except Exception as exc:  # noqa: BLE001 - told to the others, then re-raised
        problem = exc
    _agree(transport, problem, f"refused checkpoint {path} (their errors say why); no rank "
           "loaded anything")
    return ckpt.apply(rank, path, meta, todo, adopt, rank.rp.plan.hash)
