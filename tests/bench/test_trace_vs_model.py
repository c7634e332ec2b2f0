"""bench/trace_vs_model.py on a recorded H100 trace (bench/records/s40/call3/: 8b at 8k, two
rounds of one chunk, 16,384 tokens a step): the measured and simulated rows of each copy and host
op kind line up by count and bytes, the step's wall is within 5 % both ways, and what is not a
trace or a plan is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.bench import trace_vs_model

CALL3 = Path(__file__).resolve().parents[2] / "bench" / "records" / "s40" / "call3"
TRACE = CALL3 / "8b-8192-16384-estimate.trace.json.gz"
RUN = CALL3 / "8b-8192-16384-estimate.json"


def test_a_traced_step_lines_up_with_its_simulation(tmp_path, capsys):
    c = trace_vs_model.compare(TRACE, RUN, step=3)
    rows = {(r["stream"], r["op"]): r for r in c["rows"]}
    for key in (("h2d", "opt.h2d"), ("opt", "opt.d2h"), ("h2d", "w.h2d"), ("d2h", "g.d2h"),
                ("d2h", "act.d2h")):
        r = rows[key]
        assert r["count"][0] == r["count"][1] > 0, key
        assert r["bytes"][0] == r["bytes"][1] > 0, key
    assert rows[("host", "gnorm.embed")]["ms"][1] == pytest.approx(
        rows[("host", "gnorm.embed")]["ms"][0], rel=0.05)  # cost.HOST_SUMSQ_BYTES_PER_S
    measured, simulated = c["wall_s"]
    assert 0.95 < measured / simulated < 1.05
    out = tmp_path / "cmp.json"
    assert trace_vs_model.main([str(TRACE), str(RUN), "--top", "3", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["step"] == 3
    assert "opt.h2d" in capsys.readouterr().out


def test_what_is_not_a_trace_or_a_plan_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="no traceEvents"):
        trace_vs_model.main([str(bad), str(RUN)])
    with pytest.raises(SystemExit, match="not a readable Chrome trace"):
        trace_vs_model.main([str(tmp_path / "missing.json.gz"), str(RUN)])
    with pytest.raises(SystemExit, match="neither a plan nor a run record"):
        trace_vs_model.main([str(TRACE), str(bad)])
    with pytest.raises(SystemExit, match="holds steps"):
        trace_vs_model.main([str(TRACE), str(RUN), "--step", "9"])
