"""Stalls: compute gaps are found, charged to the copies running in them and to the op that
waited, summed by the waiting op's position, and read back from a written Chrome trace."""

from __future__ import annotations

from dataflow.backend import Stream
from dataflow.instrument import write_chrome_trace
from dataflow.instrument.breakdown import StepTrace
from dataflow.instrument.spans import Clock, Span, SpanKind
from dataflow.instrument.stalls import find_stalls, position, read_chrome_trace, summarize


def _span(stream, name, a, b, kind=SpanKind.OP, nbytes=0, rnd=0):
    return Span(1, rnd, stream, name, kind, nbytes, a, b)


def _trace():
    c, h2d, d2h = Stream.COMPUTE, Stream.H2D, Stream.D2H
    spans = (
        _span(c, "f.L0.c0.linear_fwd", 0.0, 1.0),
        _span(h2d, "w.h2d1", 0.5, 1.5, SpanKind.COPY, 100),     # 0.5 s exposed
        _span(c, "f.L1.c0.linear_fwd", 1.5, 2.0),
        _span(d2h, "act.d2h(1, 0)", 1.9, 2.3, SpanKind.COPY, 50),  # 0.3 s exposed
        _span(Stream.HOST, "embed.gather", 2.3, 2.4, SpanKind.HOST),  # 0.1 s host
        _span(c, "b.L1.c0.linear_bwd_w", 2.5, 3.0),
    )
    return StepTrace(step=1, start_s=0.0, end_s=3.0, spans=spans, clock=Clock.CUDA_EVENTS)


def test_gaps_are_charged_to_copies_and_the_waiting_op():
    stalls = find_stalls(_trace())
    assert [(round(s.start_s, 6), round(s.end_s, 6)) for s in stalls] == [(1.0, 1.5), (2.0, 2.5)]
    first, second = stalls
    assert first.after == "f.L1.c0.linear_fwd" and first.before == "f.L0.c0.linear_fwd"
    assert abs(first.copy_s - 0.5) < 1e-9 and first.copies[0][0] == "w.h2d"
    assert abs(second.copy_s - 0.3) < 1e-9 and abs(second.host_s - 0.1) < 1e-9
    rows = summarize(stalls, n_layers=2)
    assert rows[0][0] == "f.Llast.linear_fwd" and abs(rows[0][2] - 0.5) < 1e-9


def test_position_folds_chunks_and_layers():
    assert position("b.L15.c3.linear_bwd_w") == "b.L15.linear_bwd_w"
    assert position("b.L15.c3.linear_bwd_w", 32) == "b.Lmid.linear_bwd_w"
    assert position("b.L31.c0.attention_bwd", 32) == "b.Llast.attention_bwd"
    assert position("") == "(step edge)"


def test_read_back_from_chrome_trace(tmp_path):
    path = tmp_path / "t.json"
    write_chrome_trace([_trace()], path)
    (step,) = read_chrome_trace(path)
    assert step.step == 1 and len(step.spans) == 6
    assert [round(s.copy_s, 6) for s in find_stalls(step)] == [0.5, 0.3]


def test_simulated_step_reads_like_a_trace():
    """The planner's simulation of a tiny plan as a StepTrace: every stream's spans inside the
    step, copies with their bytes, and the same report as a measured step."""
    from dataflow.memplan import make_plan
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.plan.profiles import get_profile
    from dataflow.models.config import load_config
    from dataflow.instrument.stalls import report, simulated_trace

    plan = make_plan(load_config("tiny"), 256, Budget.from_gib(4, 1), get_profile("h100"))
    step = simulated_trace(plan)
    assert step.spans and all(0.0 <= s.start_s <= s.end_s <= step.end_s + 1e-12
                              for s in step.spans)
    assert any(s.stream is Stream.COMPUTE and s.name.startswith("b.L0") for s in step.spans)
    assert all(s.nbytes > 0 for s in step.spans if s.kind is SpanKind.COPY)
    assert report(step, n_layers=plan.model.n_layers).startswith("step 1:")


def test_cli_names_a_file_it_cannot_read(tmp_path, capsys):
    from dataflow.instrument.stalls import main

    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main([str(tmp_path / "missing.json")]) == 2
    assert main([str(bad)]) == 2
    assert main([str(bad), "--simulated"]) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and "Chrome trace" in err and "plan JSON" in err


def test_simulated_step_written_as_a_chrome_trace_reads_back(tmp_path, capsys):
    """--simulated --chrome writes the planner's timeline of a plan as a trace that opens like
    a measured one and gives the same report."""
    from dataflow.memplan import make_plan
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.plan.profiles import get_profile
    from dataflow.models.config import load_config
    from dataflow.instrument.stalls import main

    plan = make_plan(load_config("tiny"), 256, Budget.from_gib(4, 1), get_profile("h100"))
    (tmp_path / "plan.json").write_text(plan.to_json())
    out = tmp_path / "sim.json"
    assert main([str(tmp_path / "plan.json"), "--simulated", "--chrome", str(out)]) == 0
    first = capsys.readouterr().out
    (step,) = read_chrome_trace(out)
    assert step.spans and main([str(out), "--layers", str(plan.model.n_layers)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == first.splitlines()[0]
