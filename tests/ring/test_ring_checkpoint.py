"""Ring checkpoints on CPU (ring/checkpoint.py; ranks as threads, NumPy backend, shared-memory
transport): a ring saves a checkpoint of the whole model in the Engine's format, so a ring of
another size, a data-parallel ring and one device all resume from it to the same losses and
weights, bit for bit, and a ring resumes from one device's. A damaged file makes every rank
refuse the checkpoint with nothing loaded anywhere."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow.checkpoint import iter_weight_blocks, list_checkpoints
from dataflow.engine import Engine
from dataflow.models.config import load_config
from dataflow.models.errors import ChecksumError, ConfigError
from dataflow.ring.engine import Ring
from dataflow.ring.env import RankEnv
from tests.ring.threads import in_threads

CHUNKING = (("chunk_tokens", 128), ("chunks_per_round", 2), ("rounds_per_step", 2))
CFG = dataclasses.replace(load_config("tiny"), name="tiny4", n_layers=4)
COMMON = dict(host_gb=0.25, dev_gb=0.25, seqlen=64, backend="numpy", lr=1e-2,
              plan_options=dict(CHUNKING))


def _ring(n: int, fn, replicas: int = 1) -> list:
    """fn(engine) on each of n ring processes (threads); their results in process order."""
    def rank(r, run_id):
        env = RankEnv(rank=r, gpus=n, local_rank=r, master_addr="127.0.0.1",
                      master_port=0, run_id=run_id)
        with Engine(CFG, ring=Ring(env=env, replicas=replicas, timeout_s=30), seed=SEED,
                    **COMMON) as eng:
            return fn(eng)

    return in_threads(rank, n)


SEED = 7


def _bits(blocks: dict) -> dict:
    return {k: v.view(np.uint16).copy() for k, v in blocks.items()}


def _one_device_weights(eng) -> dict:
    w = eng.weights()
    out = {"embed": w.embed, "head": w.head}
    out.update({f"layer{i}": b for i, b in enumerate(w.layers)})
    return _bits(out)


def _assert_same(got: dict, want: dict, what="") -> None:
    assert sorted(got) == sorted(want), what
    for key in want:
        assert np.array_equal(got[key], want[key]), (what, key)


def _merged(results) -> dict:
    out = {}
    for _, blocks in results:
        out.update(_bits(blocks))
    return out


def test_every_ring_size_and_one_device_resume_from_a_rings_checkpoint(tmp_path, rng):
    """One device trains 3 steps. A ring of 2 trains 2, saves, trains the 3rd: its losses are
    one device's. From that checkpoint a ring of 3 and one device each train step 3 to the same
    loss and weights; and a ring of 2 resumes as well from one device's own checkpoint."""
    with Engine(CFG, seed=SEED, **COMMON) as eng:
        rows = eng.seqs_per_step
        data = [rng.integers(0, CFG.vocab_size, (rows, 65), dtype=np.int32) for _ in range(3)]
        want_losses = [eng.train_step(data[0]).loss, eng.train_step(data[1]).loss]
        one_ckpt = eng.save_checkpoint(tmp_path / "one")
        want_losses.append(eng.train_step(data[2]).loss)
        want = _one_device_weights(eng)

    def train_save_train(eng):
        losses = [eng.train_step(b).loss for b in data[:2]]
        path = eng.save_checkpoint(tmp_path / "ring", data={"step": 2}, keep=1)
        losses.append(eng.train_step(data[2]).loss)
        return losses, path, eng.weights()

    out = _ring(2, train_save_train)
    assert [o[0] for o in out] == [want_losses] * 2
    assert len({str(o[1]) for o in out}) == 1
    _assert_same(_merged((o[0], o[2]) for o in out), want, "uninterrupted ring")
    ring_ckpt = out[0][1]
    assert list_checkpoints(tmp_path / "ring") == [ring_ckpt]
    blocks = list(iter_weight_blocks(ring_ckpt))  # the weights are one model directory
    assert [(k.value, layer) for k, layer, _ in blocks] == \
        [("embed", None)] + [("layer", i) for i in range(4)] + [("head", None)]
    assert not [p.name for p in ring_ckpt.iterdir() if p.name.startswith("rank")]

    def resume(path):
        def fn(eng):
            info = eng.load_checkpoint(path)
            assert info.step == 2
            return [eng.train_step(data[2]).loss], eng.weights()
        return fn

    for n, path in ((3, ring_ckpt), (2, one_ckpt)):
        got = _ring(n, resume(path))
        assert [g[0] for g in got] == [[want_losses[2]]] * n, n
        _assert_same(_merged(got), want, f"ring of {n}")
    with Engine(CFG, seed=SEED + 1, **COMMON) as eng:
        info = eng.load_checkpoint(ring_ckpt)
        assert info.step == 2 and info.data == {"step": 2}
        assert eng.train_step(data[2]).loss == want_losses[2]
        _assert_same(_one_device_weights(eng), want, "one device")


def test_replicas_write_each_block_once_and_resume_bit_for_bit(tmp_path, rng):
    """2 replicas of a ring of 2 (4 processes): the checkpoint after step 1 holds each block
    once; a fresh ring of 2 replicas loads it and its step 2 matches the uninterrupted run."""
    data = []

    def straight(eng):
        if not data:
            data.extend(np.random.default_rng(3).integers(
                0, CFG.vocab_size, (eng.seqs_per_step, 65), dtype=np.int32) for _ in range(2))
        loss = eng.train_step(data[0]).loss
        path = eng.save_checkpoint(tmp_path)
        return [loss, eng.train_step(data[1]).loss], path, eng.weights()

    out = _ring(4, straight, replicas=2)
    path = out[0][1]
    blocks = list(iter_weight_blocks(path))
    assert len(blocks) == CFG.n_layers + 2

    def resumed(eng):
        assert eng.load_checkpoint(path).step == 1
        return [eng.train_step(data[1]).loss], eng.weights()

    back = _ring(4, resumed, replicas=2)
    for (losses, _, weights), (loss2, weights2) in zip(out, back):
        assert loss2 == losses[1:]
        _assert_same(_bits(weights2), _bits(weights), "resumed replica")


def test_a_damaged_block_file_is_refused_by_every_rank_and_nothing_loads(tmp_path, rng):
    """One byte of one rank's AdamW file flipped (size unchanged): the rank that owns the block
    raises ChecksumError naming the file, the other rank raises ConfigError naming that
    process; neither rank's weights or step change."""
    data = rng.integers(0, CFG.vocab_size, (8, 65), dtype=np.int32)

    def save(eng):
        eng.train_step(data)
        return eng.save_checkpoint(tmp_path)

    path = _ring(2, save)[0]
    victim = path / "layer_001.m.bin"  # layer 1 lives on rank 1 of 2
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))

    def load(eng):
        before = _bits(eng.weights())
        with pytest.raises((ChecksumError, ConfigError)) as err:
            eng.load_checkpoint(path)
        assert eng.rank.optimizer.step_count == 0
        _assert_same(_bits(eng.weights()), before, "after the refused load")
        return type(err.value).__name__, str(err.value)

    (kind0, msg0), (kind1, msg1) = _ring(2, load)
    assert kind1 == "ChecksumError" and "layer_001.m.bin" in msg1
    assert kind0 == "ConfigError" and "process(es) [1]" in msg0


def test_dataflow_ring_saves_and_resumes_where_the_data_left_off(tmp_path):
    """`dataflow-ring --gpus 2 ... --steps 4 --checkpoint-dir D --save-every 2` saves at steps 2
    and 4; with step 4's checkpoint removed, `--resume --steps 4` continues from step 2 on the
    shipped text's next batches and its steps 3-4 give the first run's losses exactly (and,
    with --eval-seqs, an evaluation loss after them)."""
    import json
    import shutil

    from dataflow.cli.ring import main

    ck = tmp_path / "ck"
    args = ["1", "0.25", "64", "tiny", "--gpus", "2", "--steps", "4", "--checkpoint-dir",
            str(ck)]
    assert main(args + ["--save-every", "2", "--out", str(tmp_path / "a")]) == 0
    first = json.loads((tmp_path / "a" / "rank0.json").read_text())["losses"]
    assert [p.name for p in list_checkpoints(ck)] == ["step_00000002", "step_00000004"]
    shutil.rmtree(ck / "step_00000004")
    assert main(args + ["--resume", "--out", str(tmp_path / "b"), "--eval-seqs", "2"]) == 0
    again = json.loads((tmp_path / "b" / "rank0.json").read_text())
    assert again["losses"] == first[2:]
    assert np.isfinite(again["eval_loss"])  # --eval-seqs: the loss after the last step


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank_and_leaves_nothing(
        tmp_path, rng, monkeypatch):
    """Rank 1's block files fail to write (a full disk): rank 1 raises its own OSError, rank 0
    a ConfigError naming process 1; no checkpoint and no temporary directory remain, and the
    next save succeeds."""
    from dataflow import checkpoint as ckpt

    real = ckpt.write_block_files

    def full_disk(eng, refs, directory):
        if eng.rp.rank == 1 and not getattr(full_disk, "healed", False):
            raise OSError(28, "No space left on device")
        return real(eng, refs, directory)

    monkeypatch.setattr(ckpt, "write_block_files", full_disk)
    data = rng.integers(0, CFG.vocab_size, (8, 65), dtype=np.int32)

    def save(eng):
        eng.train_step(data)
        try:
            eng.save_checkpoint(tmp_path)
        except (OSError, ConfigError) as exc:
            return type(exc).__name__, str(exc)
        return None

    (kind0, msg0), (kind1, msg1) = _ring(2, save)
    assert kind1 == "OSError" and "No space" in msg1
    assert kind0 == "ConfigError" and "process(es) [1]" in msg0
    assert list_checkpoints(tmp_path) == [] and not list(tmp_path.iterdir())
    full_disk.healed = True
    paths = _ring(2, lambda eng: (eng.train_step(data), eng.save_checkpoint(tmp_path))[1])
    assert list_checkpoints(tmp_path) == [paths[0]]


def test_the_demo_on_a_ring_saves_checkpoints_one_device_can_resume(tmp_path, monkeypatch):
    """`dataflow-demo ... --gpus 2 --checkpoint-dir D --save-every 1` saves a checkpoint after
    each step, and an Engine on one device loads the newest (its own optimizer settings, so
    allow_changes)."""
    from dataflow.cli.demo import main

    for var in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    ck = tmp_path / "ck"
    args = ["1", "0.25", "64", "tiny", "--backend", "numpy", "--checkpoint-dir", str(ck)]
    assert main(args + ["--gpus", "2", "--steps", "2", "--save-every", "1"]) == 0
    assert [p.name for p in list_checkpoints(ck)] == ["step_00000001", "step_00000002"]
    with Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy", lr=3e-4) as eng:
        assert eng.load_checkpoint(ck, allow_changes=True).step == 2
