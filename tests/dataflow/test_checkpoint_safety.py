"""Issue 51 D: a checkpoint directory cannot clobber a model or someone's files (refused unless
forced, nothing written), a resume of another model's checkpoint says what would work, and a
save after a failed step refuses unless the state is provably whole or the caller forces it
(the checkpoint is then marked)."""

from __future__ import annotations

import json
import logging
import shutil
import warnings

import numpy as np
import pytest

from dataflow import checkpoint as ckpt
from dataflow.cli.demo import main as demo_main
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.models.errors import ConfigError, StepFailedError
from tests.faults import fail_on as _fail_on

BASE = ["0.5", "0.25", "64", "tiny", "--backend", "numpy", "--steps", "1"]


def _engine(**kw):
    kw.setdefault("lr", 1e-3)
    return Engine("tiny", host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy", **kw)


def _batch(eng, start=0):
    return token_stream(64, eng.seqs_per_step, 512, start=start)


def _listing(path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Hugging Face directory (config.json, model.safetensors) plus a tokenizer file."""
    path = tmp_path_factory.mktemp("hf") / "tiny-hf"
    with _engine() as eng:
        eng.save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    return path


def _demo(capsys, *extra) -> tuple[int, str]:
    capsys.readouterr()
    code = demo_main([*BASE, *extra])
    return code, capsys.readouterr().err


def test_demo_refuses_a_hugging_face_directory_as_checkpoint_dir_and_writes_nothing(
        hf_dir, capsys):
    """--checkpoint-dir at a model directory: exit 2, one line naming the directory, what is
    there and the way out; the directory is unchanged."""
    before = _listing(hf_dir)
    code, err = _demo(capsys, "--save-every", "1", "--checkpoint-dir", str(hf_dir))
    lines = [line for line in err.splitlines() if line.startswith("dataflow-demo:")]
    assert code == 2 and len(lines) == 1, err
    assert str(hf_dir) in lines[0] and "config.json" in lines[0]
    assert "holds a model" in lines[0] and "--force-checkpoint-dir" in lines[0]
    assert _listing(hf_dir) == before


def test_demo_refuses_a_directory_with_other_files_and_force_writes_there(tmp_path, capsys):
    """A stray file refuses as well (naming it); --force-checkpoint-dir saves beside it."""
    root = tmp_path / "ck"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    code, err = _demo(capsys, "--save-every", "1", "--checkpoint-dir", str(root))
    assert code == 2 and "notes.txt" in err and "not checkpoints" in err, err
    assert _listing(root) == {"notes.txt": 4}
    code, err = _demo(capsys, "--save-every", "1", "--checkpoint-dir", str(root),
                      "--force-checkpoint-dir")
    assert code == 0, err
    assert sorted(_listing(root)) == ["notes.txt", "step_00000001"]
    assert (root / "notes.txt").read_text() == "mine"


def test_a_directory_of_checkpoints_is_accepted_again(tmp_path, capsys):
    """What the engine writes (step_* directories) never makes its own directory foreign."""
    root = tmp_path / "ck"
    assert _demo(capsys, "--steps", "2", "--save-every", "1", "--checkpoint-dir",
                 str(root))[0] == 0
    shutil.rmtree(root / "step_00000002")  # as if the run had stopped after step 1
    code, err = _demo(capsys, "--steps", "2", "--save-every", "1", "--checkpoint-dir",
                      str(root), "--resume")
    assert code == 0, err
    assert sorted(_listing(root)) == ["step_00000001", "step_00000002"]


def test_python_api_refuses_a_model_directory_unless_force_dir(hf_dir, tmp_path):
    """Engine.save_checkpoint names force_dir=True; a step directory itself names its parent."""
    before = _listing(hf_dir)
    with _engine() as eng:
        with pytest.raises(ConfigError, match=r"holds a model .*force_dir=True"):
            eng.save_checkpoint(hf_dir)
        assert _listing(hf_dir) == before
        step_dir = eng.save_checkpoint(tmp_path / "ck")
        with pytest.raises(ConfigError, match=r"is itself one checkpoint.*pass its parent"):
            eng.save_checkpoint(step_dir)
        forced = eng.save_checkpoint(tmp_path / "other", force_dir=True)
        assert forced.name == "step_00000000"


def test_demo_resume_of_another_models_checkpoint_names_that_model(tmp_path, capsys):
    """A checkpoint of 'tiny' resumed by 'small': exit 2 naming tiny and --checkpoint-dir, not
    the lr/steps advice meant for changed settings."""
    root = tmp_path / "ck"
    assert _demo(capsys, "--save-every", "1", "--checkpoint-dir", str(root))[0] == 0
    capsys.readouterr()
    code = demo_main(["1", "0.5", "64", "small", "--backend", "numpy", "--steps", "2",
                      "--checkpoint-dir", str(root), "--resume"])
    err = capsys.readouterr().err
    assert code == 2, err
    line = [x for x in err.splitlines() if x.startswith("dataflow-demo:")][-1]
    assert "'tiny'" in line and "'small'" in line and "--checkpoint-dir" in line
    assert "--lr" not in line and "--steps" not in line



def test_save_after_a_step_failed_mid_update_refuses_and_force_marks_the_manifest(tmp_path,
                                                                                 caplog):
    """Step 2 interrupted in its backward, after step 1's deferred AdamW ran in its first
    round: save_checkpoint and save_pretrained refuse, writing nothing; forced, the checkpoint
    records the failed step and loading it warns."""
    with _engine() as eng:
        eng.train_step(_batch(eng))
        fired = _fail_on(eng, "b.", KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            eng.train_step(_batch(eng, 1000))
        assert fired
        with pytest.raises(StepFailedError, match=r"step 2 failed .*allow_failed_step=True"):
            eng.save_checkpoint(tmp_path / "ck")
        with pytest.raises(StepFailedError, match="save_pretrained"):
            eng.save_pretrained(tmp_path / "hf")
        assert not (tmp_path / "ck").exists() and not (tmp_path / "hf").exists()
        path = eng.save_checkpoint(tmp_path / "ck", allow_failed_step=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            eng.save_pretrained(tmp_path / "hf", allow_failed_step=True)
        assert any("half-updated" in str(w.message) for w in seen)
    meta = json.loads((path / ckpt.META).read_text())
    assert meta["failed_step"] == {"step": 2, "reason": "interrupted"}
    caplog.set_level(logging.WARNING, logger="dataflow.checkpoint")
    with _engine() as again:
        again.load_checkpoint(path)
    assert "saved by force after step 2 failed" in caplog.text


@pytest.mark.parametrize("deferred", [True, False])
def test_save_after_a_failure_before_any_update_is_allowed_and_whole(tmp_path, deferred):
    """A failure in a step's backward with no earlier update pending (the first step, or any
    step without a deferred update) leaves weights, m, v and step exactly as before it: the
    save goes through unmarked and holds those bits."""
    with _engine(deferred_update=deferred) as eng:
        if not deferred:
            eng.train_step(_batch(eng))
        want = eng.state_dict()
        _fail_on(eng, "b.", RuntimeError("injected"))
        with pytest.raises(RuntimeError):
            eng.train_step(_batch(eng, 1000))
        path = eng.save_checkpoint(tmp_path / "ck")
    meta = json.loads((path / ckpt.META).read_text())
    assert "failed_step" not in meta and meta["step"] == want["optimizer.step"]
    with _engine() as again:
        again.load_checkpoint(path, allow_changes=True)
        got = again.state_dict()
    for k, v in want.items():
        assert np.asarray(v).tobytes() == np.asarray(got[k]).tobytes(), k


def test_ring_command_lines_refuse_a_model_directory_before_launching(hf_dir, capsys):
    """dataflow-ring and dataflow-demo --gpus 2: exit 2, one line, nothing written."""
    from dataflow.cli.ring import main as ring_main

    argv = ["1", "0.25", "64", "tiny", "--gpus", "2", "--backend", "numpy", "--save-every", "1"]
    before = _listing(hf_dir)
    for main in (ring_main, demo_main):
        capsys.readouterr()
        assert main([*argv, "--checkpoint-dir", str(hf_dir)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds a model" in err and str(hf_dir) in err, err
    assert _listing(hf_dir) == before


class _OneProcess:
    """A transport of one process (rank 0 of replica 0): all-gathers return its own row."""

    rank, replica, ring_size, replicas = 0, 0, 1, 1

    def allgather(self, row):
        return [np.asarray(row)]


class _EngineAsRank:
    """An Engine in the shape save_ring_checkpoint reads (blocks, optimizer, rp.plan)."""

    def __init__(self, eng):
        self.eng, self.optimizer = eng, eng.optimizer
        self.rp = type("RankPlan", (), {"plan": eng.plan})()

    def block_refs(self):
        return self.eng.block_refs()

    def layout(self, ref):
        return self.eng.layout(ref)

    def read_block(self, ref, part):
        return self.eng.read_block(ref, part)


def test_ring_save_refuses_a_model_directory_unless_force_dir(hf_dir, tmp_path):
    """save_ring_checkpoint (RingEngine.save_checkpoint's) refuses on process 0, naming the
    directory, and writes nothing; with force_dir the checkpoint lands and loads."""
    from dataflow.ring.checkpoint import save_ring_checkpoint

    before = _listing(hf_dir)
    with _engine() as eng:
        rank = _EngineAsRank(eng)
        with pytest.raises(ConfigError, match=r"holds a model .*force_dir=True"):
            save_ring_checkpoint(rank, _OneProcess(), eng.plan.model, hf_dir)
        assert _listing(hf_dir) == before
        root = tmp_path / "forced"
        root.mkdir()
        (root / "notes.txt").write_text("mine")
        path = save_ring_checkpoint(rank, _OneProcess(), eng.plan.model, root, force_dir=True)
    with _engine() as again:
        assert again.load_checkpoint(path).step == 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the blow-up overflows on purpose
def test_save_after_a_non_finite_step_refuses(tmp_path):
    """A NaN/inf step was counted (its deferred update dropped): the step count no longer
    matches the weights, so saving refuses and writes nothing."""
    from dataflow.models.errors import NonFiniteError

    with _engine(lr=1e9) as eng:
        with pytest.raises(NonFiniteError):
            for i in range(4):
                eng.train_step(_batch(eng, 1000 * i))
        with pytest.raises(StepFailedError, match=r"failed \((loss|grad norm) "):
            eng.save_checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
