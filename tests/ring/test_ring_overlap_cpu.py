"""Overlapped rounds run (issue 56): a ring whose rank plans carry round_overlap runs round k+1's
forward of each rank's first local layers during round k's backward (the compiled order of
dataflow.memplan.step.ring_rounds), on the NumPy backend over the shared-memory transport in
threads. Every layer's gradient still sums its rounds in order, so the losses and final weights
are the plain ring's and one device's, bit for bit; the executor's device arena is the plan's
budget plus exactly the overlap's regions the planner took out of it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow.engine import Engine
from dataflow.memplan.plan.memory import overlap_regions
from dataflow.memplan.search.ring_overlap import overlap_bytes, overlap_rank_plans
from dataflow.memplan.search.ring_plan import make_rank_plans
from dataflow.memplan.step.events import Compute
from dataflow.memplan.step.ring_compile import compile_ring_schedule
from dataflow.models.errors import ConfigError
from tests.ring.small_rings import BUDGET, CPU, tiny_with
from tests.ring.threads import assert_same_blocks, in_threads, sanitized_pair_trains_as_one_device

CHUNKING = dict(chunk_tokens=128, chunks_per_round=2, rounds_per_step=3)
"""Two chunks of two 64-token sequences a round, three rounds a step (two round boundaries to
overlap, odd and even rounds both ahead of the one before)."""


def _hoisted(sched) -> int:
    """Forward computes of round k+1 that run before some backward of round k."""
    ops = [(e.op, e.round) for e in sched.events if type(e) is Compute
           and e.op in ("layer_fwd", "layer_bwd")]
    return sum(1 for i, (op, r) in enumerate(ops) if op == "layer_fwd"
               and any(o == "layer_bwd" and q == r - 1 for o, q in ops[i + 1:]))


def _run_ring(plans, data, seed, lr, clip):
    """Every rank of `plans` as a RingRank in a thread: its losses and owned weights."""
    from dataflow.backends import make_backend
    from dataflow.optimizer import AdamWConfig
    from dataflow.ring.rank import RingRank
    from dataflow.ring.shm import SharedMemoryTransport

    def rank(r, run_id):
        tr = SharedMemoryTransport(r, len(plans), run_id, timeout_s=120)
        rk = RingRank(plans[r], make_backend("numpy"), tr, seed=seed,
                      optimizer=AdamWConfig(lr=lr, max_grad_norm=clip))
        try:
            losses = [rk.train_step(b).loss for b in data]
            dev = rk.ex.dev
            return losses, rk.weights(), (dev.used_bytes, dev.slab.nbytes)
        finally:
            rk.close()

    return in_threads(rank, len(plans))


@pytest.mark.parametrize("n_ranks,n_layers,depth", [(2, 4, 1), (3, 6, 2), (4, 4, 1)])
def test_overlapped_rounds_reproduce_the_plain_ring_and_one_device_bit_for_bit(
        rng, n_ranks, n_layers, depth):
    """Rings of 2, 3 and 4 with overlapped rounds (depth 1 or 2 local layers, three rounds a
    step, gradient clipping on, two steps with the AdamW deferred into the next step's first
    round) give the plain ring's and one device's losses and every block's final weights bit
    for bit; their schedules do run forwards of the next round ahead of this round's backward,
    and each rank's device arena holds its plan's regions plus exactly the overlap's."""
    cfg = tiny_with(n_layers)
    seed, lr, clip = int(rng.integers(0, 2**31)), 1e-2, 1.0
    over = overlap_rank_plans(cfg, 64, BUDGET, CPU, n_ranks, depth, **CHUNKING)
    plain = make_rank_plans(cfg, 64, BUDGET, CPU, n_ranks, **CHUNKING)
    assert [rp.round_overlap for rp in over] == [depth] * n_ranks
    assert sum(_hoisted(compile_ring_schedule(rp)) for rp in over) > 0
    with Engine(cfg, host_gb=0.25, dev_gb=0.25, seqlen=64, backend="numpy", seed=seed, lr=lr,
                max_grad_norm=clip, plan_options=dict(CHUNKING)) as eng:
        data = [rng.integers(0, cfg.vocab_size, (eng.seqs_per_step, 65), dtype=np.int32)
                for _ in range(2)]
        want_losses = [eng.train_step(b).loss for b in data]
        w = eng.weights()
    want = {"embed": w.embed, "head": w.head, **{f"layer{i}": b for i, b in enumerate(w.layers)}}
    for plans in (plain, over):
        got = {}
        for r, (losses, blocks, (used, slab)) in enumerate(_run_ring(plans, data, seed, lr,
                                                                      clip)):
            assert losses == want_losses, (r, losses, want_losses)
            got.update(blocks)
            if plans is over:  # the overlap's regions, and only those, beside the plan's
                rp = over[r]
                base = compile_ring_schedule(dataclasses.replace(rp, round_overlap=0)).regions
                table = compile_ring_schedule(rp).regions
                extra = table.device[len(base.device):]
                assert table.device[:len(base.device)] == base.device
                assert [(x.name, x.nbytes) for x in extra] == list(overlap_regions(rp.plan,
                                                                                  depth))
                assert used - _arena_bytes(base) == overlap_bytes(rp, depth)[0]
                assert slab == (rp.plan.budget.device_bytes + overlap_bytes(rp, depth)[0]
                                - rp.plan.profile.library_reserve_bytes)
        assert sorted(got) == sorted(want)
        for key in want:
            assert np.array_equal(got[key].view(np.uint16), want[key].view(np.uint16)), key
    assert want_losses[1] != want_losses[0]  # the weights moved between the two steps


def _arena_bytes(table) -> int:
    from dataflow.memplan.plan.buffers import align

    return sum(align(r.nbytes) for r in table.device)


def test_overlapped_rounds_refuse_what_they_do_not_run_by_name():
    """A rank plan with round_overlap whose layers stream through slot rings (8b at 8k on the
    H100 profile) is refused by the compiler with a ConfigError naming round_overlap and why."""
    from dataflow.memplan import get_profile
    from dataflow.memplan.plan.plan import Budget
    from dataflow.models.config import load_config

    from dataflow.memplan.step.ring_rounds import overlap_unsupported

    rps = overlap_rank_plans(load_config("8b"), 8192, Budget.from_gib(30, 24),
                             get_profile("h100"), 4, 2, chunks_per_round=4)
    assert any("slot rings" in why for why in overlap_unsupported(rps[1]))
    with pytest.raises(ConfigError, match="round_overlap.*slot rings"):
        compile_ring_schedule(rps[1])
    tiny = overlap_rank_plans(tiny_with(4), 64, BUDGET, CPU, 2, 1, **CHUNKING)
    assert [overlap_unsupported(rp) for rp in tiny] == [(), ()]


def test_the_planners_overlap_falls_back_to_rounds_in_turn_where_it_would_not_run(
        capsys, monkeypatch):
    """dataflow-ring --round-overlap (the planner's depth): tiny's ring of 2 gets an overlapped
    layout (a depth among every rank's constraints); where the chosen ranks are ones the
    overlapped step does not run (overlap_unsupported, forced here), the layout falls back to
    rounds in turn and says why on stderr, rather than starting ranks that would refuse."""
    from dataflow.ring import layout
    from dataflow.ring.kinds import TransportKind

    def resolve():
        return layout.resolve_layout("tiny", 64, 0.25, 0.25, 2, backend="numpy",
                                     transport=TransportKind.SHM, replicas=1,
                                     tokens_per_step=None, rounds=3,
                                     round_overlap=layout.AUTO_OVERLAP)

    assert dict(resolve()[1]).get("round_overlap", 0) >= 1
    monkeypatch.setattr(layout, "overlap_unsupported", lambda rp: ("a thing it lacks",))
    capsys.readouterr()
    assert "round_overlap" not in dict(resolve()[1])
    assert "a thing it lacks" in capsys.readouterr().err


def test_dataflow_ring_round_overlap_trains_as_rounds_in_turn(tmp_path):
    """dataflow-ring --round-overlap 1 (a ring of 2 processes, three rounds a step) writes the
    same losses and weights, bit for bit, as the same command with --no-round-overlap, from
    rank plans of their own (the overlap's room taken out of the budget: another plan hash)."""
    import json

    from dataflow.cli import ring as ring_cli  # the console script, run as a user runs it

    base = ["0.25", "0.25", "64", "tiny", "--gpus", "2", "--replicas", "1", "--rounds", "3",
            "--steps", "2", "--seed", "7", "--lr", "1e-2"]
    outs = {}
    for flag in ("--round-overlap", "--no-round-overlap"):
        out = tmp_path / flag.strip("-")
        args = base + [flag] + (["1"] if flag == "--round-overlap" else []) + ["--out", str(out)]
        assert ring_cli.main(args) == 0
        outs[flag] = out
    on, off = outs["--round-overlap"], outs["--no-round-overlap"]
    for r in range(2):
        a, b = (json.loads((d / f"rank{r}.json").read_text()) for d in (on, off))
        assert a["losses"] == b["losses"] and a["plan_hash"] != b["plan_hash"]
        with np.load(on / f"rank{r}.npz") as za, np.load(off / f"rank{r}.npz") as zb:
            assert sorted(za.files) == sorted(zb.files)
            for key in za.files:
                assert np.array_equal(za[key], zb[key]), (r, key)


def test_an_overlapped_ring_runs_clean_under_the_schedule_sanitizer(rng):
    """An overlapped ring of 2 (depth 1) on the sanitizing NumPy backend, whose ops run in a
    random order that respects the events and which reports any two unordered accesses to the
    same bytes: no race between the two rounds in flight, and one device's losses bit for bit."""
    cfg = tiny_with(4)
    plans = overlap_rank_plans(cfg, 64, BUDGET, CPU, 2, 1, **CHUNKING)
    sanitized_pair_trains_as_one_device(cfg, plans, rng, CHUNKING)


def test_simulate_ring_times_the_compiled_overlapped_step_shorter_than_rounds_in_turn():
    """simulate_ring (every rank's compiled schedule timed together, receives matched by tag)
    runs the overlapped schedules of a ring of 4 (depth 1, four rounds a step) and finds their
    step shorter than the plain ring's on the same assumed link: the hoisted forwards fill the
    drain's waits. A simulation of the CPU profile's costs, not a measurement."""
    from dataflow.memplan.search.predict import simulate_ring

    cfg, ch = tiny_with(4), dict(CHUNKING, rounds_per_step=4)
    over = overlap_rank_plans(cfg, 64, BUDGET, CPU, 4, 1, **ch)
    plain = make_rank_plans(cfg, 64, BUDGET, CPU, 4, **ch)
    assert simulate_ring(over, 1e9)[1] < simulate_ring(plain, 1e9)[1]


def test_replicas_of_an_overlapped_ring_give_the_plain_replicas_bits():
    """2 data-parallel replicas of an overlapped ring of 2 (4 threads; each block's gradient
    all-reduced in the last round's backward, which no round overlaps) give the losses and
    weights of 2 replicas of the plain ring bit for bit (the same sums in the same order)."""
    from dataflow.backends import make_backend
    from dataflow.optimizer import AdamWConfig
    from dataflow.ring.rank import RingRank
    from dataflow.ring.shm import SharedMemoryTransport

    cfg, seed, lr = tiny_with(4), 11, 1e-2
    rng = np.random.default_rng(seed)
    rows = 2 * 2 * CHUNKING["chunks_per_round"] * CHUNKING["rounds_per_step"]
    data = [rng.integers(0, cfg.vocab_size, (rows, 65), dtype=np.int32) for _ in range(2)]

    def run(plans):
        def proc(i, run_id):
            q, r = divmod(i, 2)
            tr = SharedMemoryTransport(r, 2, run_id, replica=q, replicas=2, timeout_s=120)
            rk = RingRank(plans[r], make_backend("numpy"), tr, seed=seed,
                          optimizer=AdamWConfig(lr=lr))
            try:
                return [rk.train_step(b).loss for b in data], rk.weights()
            finally:
                rk.close()
        return in_threads(proc, 4)

    plain = make_rank_plans(cfg, 64, BUDGET, CPU, 2, replicas=2, **CHUNKING)
    over = overlap_rank_plans(cfg, 64, BUDGET, CPU, 2, 1, replicas=2, **CHUNKING)
    assert over[0].replicas == 2 and sum(_hoisted(compile_ring_schedule(rp)) for rp in over)
    want, got = run(plain), run(over)
    for (wl, wb), (gl, gb) in zip(want, got):
        assert gl == wl and sorted(gb) == sorted(wb)
        for key in wb:
            assert np.array_equal(gb[key].view(np.uint16), wb[key].view(np.uint16)), key


def test_an_overlapped_ring_evaluates_as_the_plain_ring():
    """An evaluation (forward only, three rounds: an odd one among them) on the ranks of an
    overlapped ring of 2, after two training steps, gives the plain ring's loss bit for bit: its
    rounds run in turn, on the rows its compiler and the executor name alike."""
    from dataflow.backends import make_backend
    from dataflow.batch import make_batch
    from dataflow.optimizer import AdamWConfig
    from dataflow.ring.rank import RingRank
    from dataflow.ring.shm import SharedMemoryTransport

    cfg, rng = tiny_with(4), np.random.default_rng(3)
    rows = 2 * CHUNKING["chunks_per_round"] * CHUNKING["rounds_per_step"]
    data = [rng.integers(0, cfg.vocab_size, (rows, 65), dtype=np.int32) for _ in range(2)]
    held_out = make_batch(rng.integers(0, cfg.vocab_size, (rows, 65), dtype=np.int32),
                          vocab_size=cfg.vocab_size, rows=rows, seqlen=64)

    def run(plans):
        def rank(r, run_id):
            tr = SharedMemoryTransport(r, 2, run_id, timeout_s=120)
            rk = RingRank(plans[r], make_backend("numpy"), tr, seed=5,
                          optimizer=AdamWConfig(lr=1e-2))
            try:
                return [rk.train_step(b).loss for b in data], rk.evaluate(held_out).loss
            finally:
                rk.close()
        return in_threads(rank, 2)

    want = run(make_rank_plans(cfg, 64, BUDGET, CPU, 2, **CHUNKING))
    assert run(overlap_rank_plans(cfg, 64, BUDGET, CPU, 2, 1, **CHUNKING)) == want


@pytest.mark.parametrize("n_ranks,n_layers", [(2, 4), (3, 6)])
def test_an_overlapped_vocabulary_parallel_ring_gives_the_plain_ones_bits(n_ranks, n_layers):
    """A vocabulary-parallel head (every rank's part of round k's head comes before its
    backward, so before any of round k+1's forwards): rings of 2 and 3, overlapped at depth 1,
    give the plain vocabulary-parallel ring's losses and weights bit for bit (which match one
    device up to fp32 rounding: tests/ring/test_ring_vocab_head.py)."""
    cfg, seed, lr = tiny_with(n_layers), 13, 1e-2
    rng = np.random.default_rng(seed)
    rows = 2 * CHUNKING["chunks_per_round"] * CHUNKING["rounds_per_step"]
    data = [rng.integers(0, cfg.vocab_size, (rows, 65), dtype=np.int32) for _ in range(2)]
    plain = make_rank_plans(cfg, 64, BUDGET, CPU, n_ranks, vocab_parallel=True, **CHUNKING)
    over = overlap_rank_plans(cfg, 64, BUDGET, CPU, n_ranks, 1, vocab_parallel=True,
                              **CHUNKING)
    assert over[0].vocab_parallel and sum(_hoisted(compile_ring_schedule(rp)) for rp in over)
    want = _run_ring(plain, data, seed, lr, None)
    got = _run_ring(over, data, seed, lr, None)
    for (wl, wb, _), (gl, gb, _) in zip(want, got):
        assert gl == wl and sorted(gb) == sorted(wb)
        for key in wb:
            assert np.array_equal(gb[key].view(np.uint16), wb[key].view(np.uint16)), key


def test_the_ring_engine_runs_overlapped_rounds_from_its_plan_options(rng):
    """Engine(..., ring=Ring(...), plan_options={..., 'round_overlap': 1}) in 2 threads: every
    rank's plan carries the depth and the ranks give one device's losses and weights bit for
    bit (the library path: each rank plans the whole ring alike, make_rank_plan)."""
    from dataflow.ring.engine import Ring, RingEngine
    from dataflow.ring.env import RankEnv

    cfg, seed, lr = tiny_with(4), int(rng.integers(0, 2**31)), 1e-2
    common = dict(host_gb=0.25, dev_gb=0.25, seqlen=64, backend="numpy", seed=seed, lr=lr)
    with Engine(cfg, plan_options=dict(CHUNKING), **common) as eng:
        data = [rng.integers(0, cfg.vocab_size, (eng.seqs_per_step, 65), dtype=np.int32)
                for _ in range(2)]
        want_losses = [eng.train_step(b).loss for b in data]
        w = eng.weights()
    want = {"embed": w.embed, "head": w.head, **{f"layer{i}": b for i, b in enumerate(w.layers)}}

    def rank(r, run_id):
        env = RankEnv(rank=r, gpus=2, local_rank=r, master_addr="127.0.0.1", master_port=0,
                      run_id=run_id)
        with Engine(cfg, ring=Ring(env=env, replicas=1, timeout_s=30),
                    plan_options=dict(CHUNKING, round_overlap=1), **common) as eng:
            assert isinstance(eng, RingEngine) and eng.rank_plan.round_overlap == 1
            return [eng.train_step(b).loss for b in data], eng.weights()

    got = {}
    for losses, blocks in in_threads(rank, 2):
        assert losses == want_losses
        got.update(blocks)
    assert_same_blocks(got, want)
