"""Checkpoints as the issue defines "done": a run resumed in a new process under another plan is
bit-identical to the run that never stopped; damaged files are refused by name with nothing
overwritten; a save killed mid-write leaves the previous checkpoint loadable; keep-last-K."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dataflow.checkpoint import SEAL, list_checkpoints
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.lr_schedule import WarmupCosine
from dataflow.optimizer import AdamWConfig
from dataflow.memplan.plan.plan import Plan
from dataflow.models.config import load_config
from dataflow.models.errors import ChecksumError, ConfigError
from tests.dataflow.plans import path_plans

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = WarmupCosine(lr=2e-3, total_steps=6, warmup_steps=2, min_lr=2e-4)
OPT = AdamWConfig(lr=2e-3, max_grad_norm=1.0)

# The resuming process: loads the checkpoint under the plan it is given, trains to step 6 on the
# data position the checkpoint recorded, and writes its losses and final state.
CHILD = """
import json, sys
import numpy as np
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.optimizer import AdamWConfig
from dataflow.memplan.plan.plan import Plan
plan_file, ckpt, out = sys.argv[1:4]
plan = Plan.from_json(open(plan_file).read())
with Engine.from_plan(plan, backend="numpy", seed=99,
                      optimizer=AdamWConfig(lr=2e-3, max_grad_norm=1.0)) as eng:
    info = eng.load_checkpoint(ckpt)
    start = info.data["start"]
    losses = []
    while eng.optimizer.step_count < 6:
        batch = token_stream(64, eng.seqs_per_step, 512, start=start)
        start += eng.seqs_per_step * 64
        r = eng.train_step(batch)
        losses.append([r.loss, r.lr, r.grad_norm])
    state = {f"{ref.name}.{part}": eng.read_block(ref, part).view(np.uint16)
             for ref in eng.block_refs() for part in ("weights", "m", "v")}
np.savez(out, **state)
json.dump(losses, open(out + ".json", "w"))
"""


def _engine(plan, **kw):
    return Engine.from_plan(plan, backend="numpy", optimizer=OPT, lr_schedule=SCHEDULE, **kw)


def _train(eng, steps: int, start: int) -> tuple[list, int]:
    out = []
    for _ in range(steps):
        r = eng.train_step(token_stream(64, eng.seqs_per_step, 512, start=start))
        start += eng.seqs_per_step * 64
        out.append([r.loss, r.lr, r.grad_norm])
    return out, start


def _state(eng) -> dict[str, np.ndarray]:
    return {f"{ref.name}.{part}": eng.read_block(ref, part).view(np.uint16)
            for ref in eng.block_refs() for part in ("weights", "m", "v")}


def _run_child(code: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def plans():
    named = dict(path_plans(load_config("tiny")))
    return {k: named[k] for k in ("all_resident", "streamed_1_slot_host_opt",
                                  "embed_head_at_home")}


@pytest.fixture(scope="module")
def straight(plans):
    """Six steps without stopping, under the all-resident plan."""
    with _engine(plans["all_resident"]) as eng:
        losses, _ = _train(eng, 6, 0)
        return losses, _state(eng)


@pytest.fixture(scope="module")
def saved(plans, tmp_path_factory):
    """Three steps and a checkpoint at step 3 (root directory, weights after step 3)."""
    root = tmp_path_factory.mktemp("ckpt")
    with _engine(plans["all_resident"]) as eng:
        losses, start = _train(eng, 3, 0)
        eng.save_checkpoint(root, data={"start": start}, keep=2)
        return root, losses, _state(eng)


@pytest.mark.parametrize("resume_plan", ["streamed_1_slot_host_opt", "embed_head_at_home"])
def test_resume_in_a_new_process_under_another_plan_is_bit_identical(
        plans, straight, saved, resume_plan, tmp_path):
    """3 steps + save + a new process resuming for 3 steps under a different plan gives the
    losses, lrs, grad norms, weights, m and v of 6 uninterrupted steps, bit for bit."""
    root, first, _ = saved
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plans[resume_plan].to_json())
    assert Plan.from_json(plan_file.read_text()).hash != plans["all_resident"].hash
    out = tmp_path / "resumed.npz"
    res = _run_child(CHILD, plan_file, root, out)
    assert res.returncode == 0, res.stderr[-3000:]
    straight_losses, straight_state = straight
    resumed = json.loads(Path(str(out) + ".json").read_text())
    assert first + resumed == straight_losses
    assert resumed[0][1] == SCHEDULE(4)  # the schedule continued, not restarted
    with np.load(out) as got:
        assert sorted(got.files) == sorted(straight_state)
        for name, want in straight_state.items():
            assert np.array_equal(got[name], want), name


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("damage", ["truncated", "bit_flipped", "missing"])
@pytest.mark.parametrize("victim", ["layer_001.m.bin", "embed.bin", "checkpoint.json"])
def test_damaged_checkpoint_file_is_refused_by_name_and_nothing_changes(
        plans, saved, damage, victim, tmp_path, rng):
    """A truncated, bit-flipped or missing file is refused with its name; the engine's state
    and every file on disk are left exactly as they were."""
    import shutil

    src = list_checkpoints(saved[0])[-1]
    ckpt = tmp_path / src.name
    shutil.copytree(src, ckpt)
    f = ckpt / victim
    data = bytearray(f.read_bytes())
    if damage == "truncated":
        f.write_bytes(data[: int(rng.integers(0, len(data)))])
    elif damage == "bit_flipped":
        i = int(rng.integers(0, len(data)))
        data[i] ^= 1 << int(rng.integers(0, 8))
        f.write_bytes(bytes(data))
    else:
        f.unlink()
    before_files = _digests(ckpt)
    with _engine(plans["all_resident"], seed=5) as eng:
        before = _state(eng)
        with pytest.raises((ChecksumError, ConfigError), match=victim.replace(".", r"\.")):
            eng.load_checkpoint(ckpt)
        after = _state(eng)
        assert eng.optimizer.step_count == 0
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert _digests(ckpt) == before_files


KILLED_SAVE = """
import os, signal, sys
import dataflow.checkpoint as ck
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.lr_schedule import WarmupCosine
from dataflow.optimizer import AdamWConfig
from dataflow.memplan.plan.plan import Plan
plan = Plan.from_json(open(sys.argv[1]).read())
root, kill_after = sys.argv[2], int(sys.argv[3])
with Engine.from_plan(plan, backend="numpy", optimizer=AdamWConfig(lr=2e-3, max_grad_norm=1.0),
                      lr_schedule=WarmupCosine(lr=2e-3, total_steps=6, warmup_steps=2,
                                               min_lr=2e-4)) as eng:
    info = eng.load_checkpoint(root)
    eng.train_step(token_stream(64, eng.seqs_per_step, 512, start=info.data["start"]))
    real, calls = ck._write_file, [0]
    def dying(path, array):
        calls[0] += 1
        if calls[0] > kill_after:
            os.kill(os.getpid(), signal.SIGKILL)   # as a power cut or the OOM killer would
        return real(path, array)
    ck._write_file = dying
    eng.save_checkpoint(root, data={"start": 0})
"""


@pytest.mark.parametrize("kill_after", [0, 5])
def test_save_killed_mid_write_leaves_the_previous_checkpoint_loadable(
        plans, saved, kill_after, tmp_path):
    """SIGKILL during a save leaves only a hidden temporary directory: the previous checkpoint
    still loads exactly, and the next save clears the leftover."""
    import shutil

    root, _, state3 = saved
    work = tmp_path / "root"
    shutil.copytree(root, work)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plans["all_resident"].to_json())
    res = _run_child(KILLED_SAVE, plan_file, work, kill_after)
    assert res.returncode == -9, res.stderr[-3000:]
    leftovers = [p.name for p in work.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1 and ".tmp-" in leftovers[0]
    assert [p.name for p in list_checkpoints(work)] == ["step_00000003"]
    with _engine(plans["all_resident"], seed=5) as eng:
        info = eng.load_checkpoint(work)
        assert info.step == 3 and eng.optimizer.step_count == 3
        got = _state(eng)
        assert all(np.array_equal(got[k], state3[k]) for k in state3)
        eng.save_checkpoint(work)  # step 3 again: replaces it atomically, clears the leftover
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


def test_keep_last_k_deletes_only_older_sealed_checkpoints(plans, tmp_path):
    """keep=2 leaves the newest two checkpoints and never touches other entries of a root
    forced to hold them (force_dir: a root with other files is refused otherwise)."""
    (tmp_path / "notes.txt").write_text("mine")
    with _engine(plans["all_resident"]) as eng:
        for step in range(3):
            _train(eng, 1, step * 1000)
            eng.save_checkpoint(tmp_path, keep=2, force_dir=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert all((p / SEAL).is_file() for p in list_checkpoints(tmp_path))


def test_load_refuses_other_optimizer_settings_and_names_them(plans, saved):
    """A checkpoint trained with weight decay 0 and clipping at 1.0 is not silently resumed
    with other values of either (the run would use them; the config's lr is not judged under a
    schedule, see test_engine_contract)."""
    with Engine.from_plan(plans["all_resident"], backend="numpy",
                          optimizer=AdamWConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=0.5),
                          lr_schedule=SCHEDULE) as eng:
        with pytest.raises(ConfigError, match="optimizer.max_grad_norm.*optimizer.weight_decay"):
            eng.load_checkpoint(saved[0])
        info = eng.load_checkpoint(saved[0], allow_changes=True)
        assert info.step == 3


def test_engine_without_schedule_adopts_the_checkpoints(plans, saved):
    """An engine built without a schedule continues the checkpoint's schedule."""
    with Engine.from_plan(plans["all_resident"], backend="numpy", optimizer=OPT) as eng:
        eng.load_checkpoint(saved[0])
        assert eng.optimizer.schedule == SCHEDULE


def test_checkpoint_weights_form_a_model_directory(saved):
    """The weights of a checkpoint load as a dataflow.models.storage model directory (verified)."""
    from dataflow.models.storage import load_model

    root, _, state3 = saved
    weights = load_model(list_checkpoints(root)[-1])
    assert np.array_equal(weights.embed.view(np.uint16), state3["embed.weights"])
