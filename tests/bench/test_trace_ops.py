"""bench/trace_ops.py: a step's spans summed by op kind (breakdown.op_key) per stream,
the compute stream's idle gaps, and refusals of what is not a dataflow-demo trace."""

import json

import pytest

from dataflow.bench import trace_ops


def _trace(path):
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": n}}
            for t, n in ((0, "steps"), (1, "compute"), (2, "h2d"))]

    def x(name, tid, ts, dur, step=2):
        return {"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                "args": {"step": step}}

    events = meta + [x("step 1", 0, 0, 50, step=1), x("f.L0.c0.linear_fwd", 1, 0, 40, step=1),
                     x("step 2", 0, 100, 1000),
                     x("f.L0.c0.linear_fwd", 1, 100, 200), x("f.L1.c3.linear_fwd", 1, 300, 100),
                     x("b.L1.c3.moe_experts_bwd", 1, 600, 500), x("w.h2d1", 2, 100, 300)]
    path.write_text(json.dumps({"traceEvents": events}))


def test_the_last_step_is_summed_by_op_kind_per_stream(tmp_path, capsys):
    _trace(tmp_path / "t.json")
    events, names = trace_ops.read_trace(tmp_path / "t.json")
    s = trace_ops.summarize(events, names)
    assert s["step"] == 2 and s["wall_ms"] == pytest.approx(1.0)
    compute = {r["op"]: r for r in s["streams"]["compute"]}
    assert compute["f.linear_fwd"]["count"] == 2
    assert compute["f.linear_fwd"]["total_ms"] == pytest.approx(0.3)
    assert s["streams"]["compute"][0]["op"] == "b.moe_experts_bwd"  # largest first
    assert s["streams"]["h2d"][0]["op"] == "w.h2d"
    assert s["compute_idle_ms"] == pytest.approx(0.2)  # 400..600 idle, nothing after 1100
    assert trace_ops.summarize(events, names, step=1)["streams"]["compute"][0]["count"] == 1
    out = tmp_path / "ops.json"
    assert trace_ops.main([str(tmp_path / "t.json"), "--top", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["step"] == 2
    assert "moe_experts_bwd" in capsys.readouterr().out


def test_what_is_not_a_trace_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="no traceEvents"):
        trace_ops.main([str(bad)])
    with pytest.raises(SystemExit, match="not a readable Chrome trace"):
        trace_ops.main([str(tmp_path / "missing.json")])
    _trace(tmp_path / "t.json")
    with pytest.raises(SystemExit, match="holds steps"):
        trace_ops.main([str(tmp_path / "t.json"), "--step", "7"])
