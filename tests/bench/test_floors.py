"""bench/floors.py: the ceilings of a recorded step (no stalls, no recompute, attention alone)
from its breakdown, the attention time taken from the run's log for records without it (its
re-run forward attention left out), the verdict against a target, and refusals of files that
are no run records (exit 2, nothing written)."""

from __future__ import annotations

import json

import pytest

from dataflow.bench.floors import attention_from_log, floors, main

GIB = 2**30


def _run(attention_s=None) -> dict:
    bd = {"wall_s": 110.0, "compute_busy_s": 100.0, "recompute_s": 20.0}
    if attention_s is not None:
        bd["attention_s"] = attention_s
    return {"plan": {"model": {"name": "8b"}, "chunking": {"seqlen": 131072},
                     "budget": {"host_bytes": 120 * GIB, "device_bytes": 24 * GIB}},
            "setup": {"init_s": 30.0},
            "steps": [{"tokens": 1000, "tok_per_s": 1.0, "breakdown": {}},
                      {"tokens": 400_000, "tok_per_s": 400_000 / 110.0, "breakdown": bd}]}


LOG = ("step 1 ...\nlargest compute costs (last step): b.attention_bwd 9.0 ms\n"
       "largest compute costs (last step): b.attention_bwd 40000.0 ms, f.attention_fwd "
       "15000.0 ms, b.attention_fwd.re 2000.0 ms, b.seg.attention_fwd 1000.0 ms, "
       "f.linear_fwd 5000.0 ms\n")


def test_ceilings_come_from_the_last_steps_breakdown():
    row = floors(_run(attention_s=50.0))
    assert row["cell"] == "8b at 131,072 (120/24)"
    assert row["no_stalls_tok_s"] == 4000 and row["no_recompute_tok_s"] == 5000
    assert row["attention_alone_tok_s"] == 8000 and row["attention_source"] == "breakdown"
    assert row["no_recompute_step_s"] == 80 and row["setup_s"] == 30


def test_attention_from_the_log_leaves_out_recompute_and_takes_the_last_step():
    assert attention_from_log(LOG) == pytest.approx(55.0)
    per_step = ("step 1: largest compute costs: b.attention_bwd 9.0 ms (4x)\n"
                "step 2: largest compute costs: b.attention_bwd 40,000.0 ms (16x), "
                "f.attention_fwd 15,000.0 ms (16x), b.attention_fwd.re 2,000.0 ms (16x)\n")
    assert attention_from_log(per_step) == pytest.approx(55.0)  # the demo's line since s20
    assert attention_from_log("no such line") is None
    row = floors(_run(), LOG)
    assert row["attention_s"] == pytest.approx(55.0)
    assert row["attention_source"].startswith("log")


def test_main_prints_verdicts_and_writes_its_record(tmp_path, capsys):
    run = tmp_path / "x.demo.json"
    run.write_text(json.dumps(_run(attention_s=50.0)))
    out = tmp_path / "floors.json"
    assert main([f"{run}:4500", f"{run}:6000", f"{run}:3000", str(run), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["verdict"] for r in rows] == [
        "needs less recompute (memory) or faster kernels", "needs faster kernels", "met", ""]
    assert [r["target_tok_s"] for r in rows] == [4500, 6000, 3000, None]
    assert "needs faster kernels" in capsys.readouterr().out


def test_a_file_that_is_no_run_record_is_refused(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"budget": {}}))
    out = tmp_path / "floors.json"
    assert main([str(bad), "--out", str(out)]) == 2
    assert main([str(tmp_path / "missing.json")]) == 2
    assert not out.exists()
    assert "not a run record" in capsys.readouterr().err
