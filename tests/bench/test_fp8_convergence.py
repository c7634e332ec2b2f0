"""bench.fp8_convergence reads two `dataflow-demo --json` documents: the training-loss gaps after
a step and, where both runs validated, the held-out gaps at the steps both logged."""

from __future__ import annotations

import json

import pytest

from dataflow.bench import fp8_convergence as conv


def _doc(losses, validation):
    return {"device": "cpu", "plan": {"model": {"name": "m"}},
            "steps": [{"loss": x} for x in losses],
            "validation": [{"step": s, "loss": x} for s, x in validation]}


def test_gaps_of_training_and_held_out_losses(tmp_path, capsys):
    bf16 = _doc([4.0, 3.0, 2.0, 2.0], [(2, 3.0), (4, 2.0)])
    fp8 = _doc([4.0, 3.3, 2.02, 1.98], [(2, 3.3), (4, 2.01), (6, 1.0)])
    (tmp_path / "b.json").write_text(json.dumps(bf16))
    (tmp_path / "f.json").write_text(json.dumps(fp8))
    assert conv.main([str(tmp_path / "b.json"), str(tmp_path / "f.json"), "--out",
                      str(tmp_path / "o"), "--after", "2", "--name", "r"]) == 0
    rec = json.loads((tmp_path / "o" / "r.json").read_text())
    assert rec["max_rel_gap_after"] == pytest.approx(0.01)  # steps 3 and 4: +1 %, -1 %
    assert rec["validation_steps"] == [2, 4]  # step 6 only fp8 logged
    assert rec["validation_max_rel_gap_after"] == pytest.approx(0.005)  # step 4 alone
    assert "held-out loss at 2 steps" in capsys.readouterr().out


def test_runs_without_validation_compare_training_alone(tmp_path):
    for name in "bf":
        (tmp_path / f"{name}.json").write_text(json.dumps(_doc([2.0, 1.0], [])))
    assert conv.main([str(tmp_path / "b.json"), str(tmp_path / "f.json"), "--out",
                      str(tmp_path), "--after", "0"]) == 0
    rec = json.loads((tmp_path / "fp8_convergence.json").read_text())
    assert rec["max_rel_gap_after"] == 0 and rec["validation_max_rel_gap_after"] is None
