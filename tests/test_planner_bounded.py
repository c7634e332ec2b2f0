"""Issue 51, part B: the planner cannot hang. A config whose layer count disagrees with its
weights, or that no search finishes in bounded time, is refused in a line before planning (exit 2,
nothing written, within seconds); a signal stops the demo while it plans; on a CPU the demo says
its prediction is rough and prints each step's MFU with the plan's peak."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataflow.cli.demo import main as demo_main
from dataflow.engine import Engine
from dataflow.memplan import make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.profiles import get_profile
from dataflow.memplan.search.search import MAX_PLAN_LAYERS
from dataflow.models.config import ModelConfig, load_config
from dataflow.models.errors import ConfigError
from dataflow.models.hf import save_pretrained
from dataflow.models.init import init_model
from dataflow.models.serial import to_dict
from dataflow.models.storage import save_model
from dataflow.progress import SlowNotice

ROOT = Path(__file__).resolve().parents[1]
SMALL = ModelConfig(name="two", vocab_size=300, model_dim=64, head_dim=16, n_layers=2, n_heads=4,
                    n_kv_heads=2, ffn_dim=96, rope_theta=5e4, norm_eps=1e-6)


def _hf_dir(path: Path, cfg: ModelConfig = SMALL, **config_edits) -> Path:
    """A Hugging Face directory of `cfg`'s weights whose config.json then gets `config_edits`."""
    save_pretrained(cfg, ((k, layer, block) for k, layer, _, block
                          in init_model(cfg, 0).blocks()), path)
    data = json.loads((path / "config.json").read_text())
    data.update(config_edits)
    (path / "config.json").write_text(json.dumps(data))
    return path


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_demo_refuses_a_million_layer_config_over_two_layers_of_weights_fast(tmp_path, capsys):
    """The user's config.json (num_hidden_layers 1000000, weights for 2) used to hang the planner
    for 12+ minutes: now exit 2 within 10 s, one line naming both counts, no output file."""
    model = _hf_dir(tmp_path / "hf", num_hidden_layers=1_000_000)
    trace = tmp_path / "t.json"
    t0 = time.perf_counter()
    code = demo_main(["1", "0.25", "64", str(model), "--backend", "numpy", "--trace", str(trace)])
    assert time.perf_counter() - t0 < 10
    err = _one_line(capsys, code)
    assert "1,000,000" in err and "2 layer" in err, err
    assert not trace.exists()


@pytest.mark.parametrize("edit,named", [({"num_hidden_layers": 3}, "num_hidden_layers 3"),
                                        ({"hidden_size": 128, "head_dim": 32}, "hidden_size 128"),
                                        ({"vocab_size": 301}, "vocab_size 301")])
def test_engine_refuses_config_that_disagrees_with_its_weights_before_planning(tmp_path, edit,
                                                                              named):
    """Engine(hf_dir) compares layers, hidden size and vocab with the safetensors headers first."""
    model = _hf_dir(tmp_path / "hf", **edit)
    with pytest.raises(ConfigError, match="config.json and the weights disagree") as info:
        Engine(str(model), host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy")
    assert named in str(info.value)
    assert "\n" not in str(info.value)


def test_matching_hf_directory_still_trains(tmp_path, rng):
    """The check lets a directory whose config and weights agree through."""
    model = _hf_dir(tmp_path / "hf")
    with Engine(str(model), host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy") as eng:
        tokens = rng.integers(0, SMALL.vocab_size, (eng.seqs_per_step, 65))
        assert eng.train_step(tokens).loss > 0


def test_planner_refuses_more_layers_than_it_can_search_at_once():
    """make_plan refuses n_layers above MAX_PLAN_LAYERS up front, naming the count and the bound."""
    cfg = dataclasses.replace(load_config("tiny"), n_layers=1_000_000)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=f"at most {MAX_PLAN_LAYERS:,}") as info:
        make_plan(cfg, 128, Budget.from_gib(1, 0.25), get_profile("cpu"))
    assert time.perf_counter() - t0 < 1
    assert "1,000,000 layers" in str(info.value)


def test_demo_refuses_a_huge_config_json_without_weights_fast(tmp_path, capsys):
    """A config JSON (no weights to compare) with 10^6 layers: exit 2 within 10 s, one line."""
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(to_dict(dataclasses.replace(load_config("tiny"),
                                                           n_layers=1_000_000))))
    t0 = time.perf_counter()
    code = demo_main(["1", "0.25", "128", str(path), "--backend", "numpy"])
    assert time.perf_counter() - t0 < 10
    err = _one_line(capsys, code)
    assert "1,000,000 layers" in err and f"{MAX_PLAN_LAYERS:,}" in err, err


def test_demo_stops_on_sigint_while_planning(tmp_path):
    """A legal config the planner takes seconds over (tiny at MAX_PLAN_LAYERS layers): a SIGINT
    a second into the search stops the demo at once with exit 130 and one 'interrupted' line."""
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(to_dict(dataclasses.replace(load_config("tiny"),
                                                           n_layers=MAX_PLAN_LAYERS))))
    cmd = [sys.executable, "-m", "dataflow.cli.demo", "1", "0.25", "128", str(path),
           "--backend", "numpy", "--json"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    lines = []
    for line in proc.stderr:  # 'backend: ...' is the last line before the search starts
        lines.append(line)
        if line.startswith("backend:"):
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    out, rest = proc.communicate(timeout=60)
    err = "".join(lines) + rest
    assert time.monotonic() - t0 < 3, err
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Plan for" not in err, err
    assert err.strip().splitlines()[-1].startswith("dataflow-demo: interrupted at step 0"), err
    assert out == ""


def test_demo_on_cpu_says_the_prediction_is_rough_and_prints_step_mfu(caplog):
    """NumPy backend: the prediction carries the CPU profile's caveat, and each step line prints
    MFU/HFU as percentages of the same peak the plan used, never 'n/a'."""
    caplog.set_level(logging.INFO, logger="dataflow.demo")
    assert demo_main(["0.5", "0.25", "64", "tiny", "--backend", "numpy", "--steps", "1"]) == 0
    err = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "rough prediction: the CPU profile is not calibrated" in err
    plan_mfu = re.search(r"MFU (\d+\.\d)%, HFU", err)
    step = re.search(r"step 1: loss .* MFU +(\d+\.\d)%  HFU +(\d+\.\d)%", err)
    assert plan_mfu and step, err
    assert "n/a" not in step.group(0)


def test_slow_notice_says_a_long_call_is_still_running_and_a_short_one_nothing():
    """SlowNotice (the demo's 'planning ...: still running after N s') speaks only past its
    interval."""
    said = []
    with SlowNotice("planning x", said.append, interval_s=0.05, hint="Ctrl-C stops it"):
        time.sleep(0.3)
    assert said and said[0].startswith("planning x: still running after") and "Ctrl-C" in said[0]
    quiet = []
    with SlowNotice("planning y", quiet.append, interval_s=5):
        pass
    assert quiet == []
    moved = []  # dataflow-plan --gpus renames it for each GPU count of its table
    with SlowNotice("weighing 64 GPUs", moved.append, interval_s=0.05) as notice:
        time.sleep(0.15)
        notice.label = "weighing 2 GPUs for the table (1 of 6)"
        time.sleep(0.2)
    assert moved[0].startswith("weighing 64 GPUs") and moved[-1].startswith("weighing 2 GPUs")


def test_demo_refuses_a_saved_model_whose_config_disagrees_with_its_manifest(tmp_path, capsys):
    """A dataflow model directory (save_model) whose config.json was edited to 10^6 layers: its
    manifest's block count is compared first, exit 2 in a line within 10 s."""
    path = save_model(init_model(SMALL, 0), tmp_path / "saved")
    data = json.loads((path / "config.json").read_text())
    data["n_layers"] = 1_000_000
    (path / "config.json").write_text(json.dumps(data))
    t0 = time.perf_counter()
    code = demo_main(["1", "0.25", "64", str(path), "--backend", "numpy"])
    assert time.perf_counter() - t0 < 10
    err = _one_line(capsys, code)
    assert "n_layers 1,000,000" in err and "2 layer block(s)" in err, err
