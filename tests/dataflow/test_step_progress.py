"""Progress inside one step: the executor says how much of the step's schedule it has
dispatched (Engine.step_progress), and StepWatch turns that into periodic lines for the demo."""

from __future__ import annotations

import time

from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.executor import StepProgress
from dataflow.progress import StepWatch
from models.config import load_config
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
