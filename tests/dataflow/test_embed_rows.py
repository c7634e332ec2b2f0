"""The pinned embedding rows of a HOME table (host region `embed_rows`): one part when a step has
one round, two (alternate rounds) otherwise; a round's gradient rows come home over its own
gathered rows. Every access to those bytes is ordered by the schedule's events (checked on the
compiled lists, two steps back to back), and training and evaluation on the NumPy backend
under the sanitizer stay bit-identical to the all-resident plan."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.optimizer import AdamWConfig
from dataflow.memplan import make_plan
from dataflow.memplan.plan.memory import embed_row_parts, host_regions
from dataflow.memplan.plan.plan import Budget, OptimizerWhere
from dataflow.memplan.plan.profiles import get_profile
from dataflow.memplan.step.compile import (STREAMS, Fetch, HostTask, Record, Wait, WriteBack, StepCompiler,
                              compile_eval_schedule, compile_schedule)
from dataflow.models.config import load_config
from tests.dataflow.plans import forced_plan, streamed

LR = 1e-3
ROWS = "embed_rows"


def _plan(rounds, home=True, **kw):
    cfg = load_config("tiny")
    n = cfg.n_layers
    if home:
        strm = streamed(OptimizerWhere.STREAMED)
        kw = dict(embed=streamed(OptimizerWhere.HOST), layers=(strm,) * n, head=strm, **kw)
    return forced_plan(cfg, 64, chunk_tokens=128, seqs_per_chunk=2, chunks_per_round=1,
                       rounds=rounds, **kw)


def _row_accesses(ev):
    """(ref, is_write) of the event's accesses to the embedding rows."""
    out = []
    if type(ev) is HostTask:
        out = [(ev.dst, True), (ev.src, False)]
    elif type(ev) is Fetch:
        out = [(ev.src, False)]
    elif type(ev) is WriteBack:
        out = [(ev.dst, True)]
    return [(r, w) for r, w in out if r is not None and r.region == ROWS]


def unordered_row_accesses(events, n_ids):
    """Pairs of accesses to the same bytes of `embed_rows` (one a write) on different streams
    that no chain of records and waits orders, over two runs of `events` back to back (the
    second's record ids shifted) with the executor's synchronisation of every stream between
    them."""
    vc = {s: dict.fromkeys(STREAMS, 0) for s in STREAMS}
    marks, history, bad = {}, [], []
    for step in range(2):
        if step:  # the step's end reads its losses after synchronising every stream
            done = {s: max(vc[t][s] for t in STREAMS) for s in STREAMS}
            vc = {t: dict(done) for t in STREAMS}
        for ev in events:
            if type(ev) is Record:
                marks[ev.id + step * n_ids] = dict(vc[ev.stream])
                continue
            if type(ev) is Wait:
                mine = vc[ev.stream]
                for s, c in marks[ev.id + step * n_ids].items():
                    mine[s] = max(mine[s], c)
                continue
            s = ev.stream
            vc[s][s] += 1
            for ref, write in _row_accesses(ev):
                lo, hi = ref.offset, ref.offset + ref.nbytes
                for (s2, pos2, lo2, hi2, w2, name2) in history:
                    if s2 == s or hi2 <= lo or hi <= lo2 or not (write or w2):
                        continue
                    if vc[s][s2] < pos2:
                        bad.append((name2, ev.name))
                history.append((s, vc[s][s], lo, hi, write, ev.name))
    return bad


def test_host_plan_counts_one_part_for_one_round_and_two_for_more():
    """tokens_per_round x model_dim bf16 rows per part: 1 part at one round a step, 2 at 2 or 4;
    no region when the table is on the device."""
    for rounds, parts in ((1, 1), (2, 2), (4, 2)):
        plan = _plan(rounds)
        ch, cfg = plan.chunking, plan.model
        assert embed_row_parts(ch) == parts
        host = dict(host_regions(plan))
        assert host[ROWS] == parts * ch.tokens_per_round * cfg.model_dim * 2, rounds
        sch = compile_schedule(plan)
        assert sch.regions.get(ROWS).nbytes == host[ROWS]
    assert ROWS not in dict(host_regions(_plan(1, home=False)))


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_gradient_rows_share_their_rounds_gather_buffer_in_order(rounds):
    """Round r gathers into part r % parts, fetches from it, takes its gradient rows back into
    it and scatters from it. The gradient write-back waits (on D2H, explicitly) for the record
    after the round's row fetch; the next gather into that part waits (on the host) for the
    record after the scatter that read it; and no two accesses to the same bytes are unordered
    across two steps."""
    plan = _plan(rounds)
    sch = compile_schedule(plan)
    parts = embed_row_parts(plan.chunking)
    nb = plan.chunking.tokens_per_round * plan.model.model_dim * 2
    evs = sch.events
    fetches = [(i, e) for i, e in enumerate(evs) if type(e) is Fetch and e.name == "embed.rows"]
    backs = [(i, e) for i, e in enumerate(evs) if type(e) is WriteBack and e.name == "embed.dx"]
    scatters = [(i, e) for i, e in enumerate(evs)
                if type(e) is HostTask and e.op == "embed_scatter"]
    gathers = [(i, e) for i, e in enumerate(evs) if type(e) is HostTask and e.op == "embed_gather"]
    assert len(fetches) == len(backs) == len(scatters) == len(gathers) == rounds
    for r in range(rounds):
        part = (r % parts) * nb
        (gi, g), (fi, f), (bi, b), (si, s) = gathers[r], fetches[r], backs[r], scatters[r]
        assert g.dst.offset == f.src.offset == b.dst.offset == s.src.offset == part
        assert gi < fi < bi < si
        rec = evs[fi + 1]
        assert type(rec) is Record and rec.stream == "h2d"
        assert any(type(e) is Wait and e.stream == "d2h" and e.id == rec.id
                   for e in evs[fi + 2:bi]), r
        if r + parts < rounds:
            rec = next(e for e in evs[si:] if type(e) is Record and e.stream == "host")
            gi2 = gathers[r + parts][0]
            assert any(type(e) is Wait and e.stream == "host" and e.id == rec.id
                       for e in evs[si:gi2]), r
    assert unordered_row_accesses(evs, sch.n_ids) == []


def test_one_part_over_several_rounds_stages_after_the_backward():
    """A one-round plan compiled for 3 rounds, or evaluated over 3: every round shares the one
    part, so the next round is not gathered ahead (its gather would meet the gradient rows the
    backward sends home); forcing the stage ahead is reported as unordered."""
    plan = _plan(1)
    for sch in (compile_schedule(plan, rounds=3), compile_eval_schedule(plan, 3)):
        offs = {e.dst.offset for e in sch.events if type(e) is HostTask and e.op == "embed_gather"}
        assert offs == {0}
        assert unordered_row_accesses(sch.events, sch.n_ids) == []
    broken = StepCompiler(plan)
    broken.stage_ahead_ok = lambda rnd: True
    sch = broken.compile(3)
    assert unordered_row_accesses(sch.events, sch.n_ids)


def test_8b_at_524288_keeps_one_part_and_orders_it():
    """8b at 524,288 tokens (one round a step, HOME embedding): embed_rows is one part, 4 GiB,
    and its accesses are ordered."""
    plan = make_plan(load_config("8b"), 524288, Budget.from_gib(130, 24), get_profile("h100"))
    assert plan.chunking.rounds_per_step == 1 and plan.embed.weights.value == "home"
    sch = compile_schedule(plan)
    assert sch.regions.get(ROWS).nbytes == 524288 * 4096 * 2
    assert {e.dst.offset for e in sch.events if type(e) is WriteBack and e.name == "embed.dx"} \
        == {0}
    assert unordered_row_accesses(sch.events, sch.n_ids) == []


def _run(plan, steps=2, seed_off=0):
    cfg, ch = plan.model, plan.chunking
    eng = Engine.from_plan(plan, backend="numpy", seed=0, sanitize=True,
                           sanitize_seed=ch.rounds_per_step + seed_off,
                           optimizer=AdamWConfig(lr=LR))
    with eng:
        losses = [eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                              start=s * ch.seqs_per_step * ch.seqlen)).loss
                  for s in range(steps)]
        ev = eng.eval_step(token_stream(ch.seqlen, 3 * ch.seqs_per_round, cfg.vocab_size,
                                        start=12345))
        w = eng.weights()
    return losses, ev, [w.embed, *w.layers, w.head]


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_home_embedding_training_is_bit_identical_to_resident(rounds):
    """Two steps and a 3-round evaluation with a HOME embedding (host AdamW), streamed layers
    and head, under the sanitizer: losses, evaluation loss and every parameter bit-identical
    to the all-resident plan of the same chunking."""
    got = _run(_plan(rounds))
    want = _run(_plan(rounds, home=False), seed_off=1)
    assert got[0] == want[0] and got[1] == want[1]
    for a, b in zip(got[2], want[2]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
