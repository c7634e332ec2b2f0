"""The Engine API and the demo CLI as a user meets them: state round trips, clear errors for bad
input, clipping and schedules, exit codes."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.cli.demo import main as demo_main
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.models.errors import ConfigError


def _engine(**kw):
    return Engine("tiny", host_gb=0.5, dev_gb=0.25, seqlen=64, backend="numpy", lr=1e-3, **kw)


def _batch(eng, start=0):
    return token_stream(64, eng.seqs_per_step, 512, start=start)


def test_state_dict_round_trip_restores_training_exactly():
    """Saving after one step and loading into a fresh engine gives the same second step."""
    with _engine() as a:
        a.train_step(_batch(a))
        state = a.state_dict()
        assert "model.layers.0.self_attn.q_proj.weight" in state
        assert "optimizer.lm_head.weight.exp_avg" in state and int(state["optimizer.step"]) == 1
        second = a.train_step(_batch(a, 5000)).loss
    with _engine(seed=7) as b:
        b.load_state_dict(state)
        assert b.train_step(_batch(b, 5000)).loss == second


def test_load_state_dict_refuses_a_wrong_shape_and_names_it():
    """A tensor of the wrong shape is refused with its name and both shapes."""
    with _engine() as eng:
        state = eng.state_dict()
        state["model.norm.weight"] = np.zeros(3, dtype=state["model.norm.weight"].dtype)
        with pytest.raises(ConfigError, match="model.norm.weight"):
            eng.load_state_dict(state)


def test_train_step_refuses_bad_tokens_with_the_expected_shape():
    """Wrong shape, out-of-vocabulary ids and floats are refused before anything runs."""
    with _engine() as eng:
        good = _batch(eng)
        with pytest.raises(ConfigError, match="seqs_per_step"):
            eng.train_step(good[:, :10])
        bad = good.copy()
        bad[0, 0] = 9999
        with pytest.raises(ConfigError, match="9999"):
            eng.train_step(bad)
        with pytest.raises(ConfigError, match="integer"):
            eng.train_step(good.astype(np.float32))


def test_clipping_and_schedule_are_applied():
    """A schedule sets each step's lr; clipping reports the global gradient norm."""
    with _engine(max_grad_norm=0.5, lr_schedule=lambda step: 1e-3 / step) as eng:
        r1 = eng.train_step(_batch(eng))
        r2 = eng.train_step(_batch(eng, 3000))
        assert r1.lr == pytest.approx(1e-3) and r2.lr == pytest.approx(5e-4)
        assert r1.grad_norm is not None and r1.grad_norm > 0


def test_closed_engine_refuses_to_train():
    """After the context manager exits, train_step says the engine is closed."""
    with _engine() as eng:
        batch = _batch(eng)
    with pytest.raises(ConfigError, match="closed"):
        eng.train_step(batch)


@pytest.mark.parametrize("argv", [["2", "-1", "256", "tiny"], ["2", "x", "256", "tiny"],
                                  ["2", "0.25", "256", "llama"], ["2", "0.0001", "256", "tiny"],
                                  ["2", "0.25", "0", "tiny"]])
def test_demo_exits_2_on_bad_input(argv, capsys):
    """Bad numbers, unknown models and impossible budgets exit with status 2, no traceback."""
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(demo_main(argv + ["--backend", "numpy"]))
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_demo_trains_tiny_on_numpy_with_falling_loss(capsys):
    """The README's demo command trains: the last step's loss is below the first's."""
    import json

    assert demo_main(["2", "0.25", "256", "tiny", "--steps", "3", "--backend", "numpy",
                      "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    losses = [s["loss"] for s in out["steps"]]
    assert losses[-1] < losses[0]
