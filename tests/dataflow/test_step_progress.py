"""Progress inside one step: the executor says how much of the step's schedule it has
dispatched (Engine.step_progress), and StepWatch turns that into periodic lines for the demo."""

from __future__ import annotations

import time

from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.executor import StepProgress
from dataflow.progress import StepWatch
from dataflow.models.config import load_config
from tests.dataflow.plans import path_plans


def test_step_progress_rises_through_a_step_and_is_none_between_steps():
    cfg = load_config("tiny")
    plan = dict(path_plans(cfg))["levels_at_home"]
    ch = plan.chunking
    with Engine.from_plan(plan, backend="numpy") as eng:
        assert eng.step_progress() is None
        seen = []
        launch = eng.be.launch

        def sampling_launch(*args, **kw):
            seen.append(eng.step_progress())
            return launch(*args, **kw)

        eng.be.launch = sampling_launch
        eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size))
        assert eng.step_progress() is None
    assert seen and all(isinstance(p, StepProgress) for p in seen)
    done = [p.dispatched for p in seen]
    assert done == sorted(done) and 0 < done[-1] <= seen[-1].events
    # updated every 64 events (a cheap write for the thread that reads it): a few positions
    assert seen[-1].fraction > 0.5 and len({p.dispatched for p in seen}) >= 2


def test_step_watch_reports_while_the_step_runs_and_not_after():
    lines = []
    state = {"p": StepProgress(5, 10, "b.L1.c0")}
    with StepWatch(lambda: state["p"], "step 7", lines.append, interval_s=0.02):
        time.sleep(0.15)
    n = len(lines)
    time.sleep(0.06)
    assert n >= 2 and len(lines) == n
    assert lines[0].startswith("step 7: 50% of its 10 events dispatched (b.L1.c0), ")
    assert "to go" in lines[0]


def test_step_watch_writes_nothing_for_a_short_step():
    lines = []
    with StepWatch(lambda: StepProgress(1, 2, "f.L0.c0"), "step 1", lines.append,
                   interval_s=10.0):
        pass
    assert lines == []


def test_progress_eta_is_taken_from_the_rate_after_the_first_unit(monkeypatch):
    """A slow start (setup before the first unit: 26.5 s of an 8b engine) does not make the
    ETA extrapolate it: after units taking 1 s each, the ETA is 1 s a unit left."""
    import io

    from dataflow import progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    out = io.StringIO()
    bar = progress.Progress(34, "init 8b", stream=out, interval_s=0.0)
    now[0] += 26.5
    bar.update()
    assert "eta" not in out.getvalue().splitlines()[-1]
    for _ in range(3):
        now[0] += 1.0
        bar.update()
    assert out.getvalue().splitlines()[-1] == "init 8b: 4/34 (12%) 29.5 s, eta 30 s"
