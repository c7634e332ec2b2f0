"""A traced ring rank (dataflow-ring --trace): the rank's backend wrapped in a TracingBackend
reports each step's breakdown (compute, exposed copy, host, idle), whose parts sum to the
step's wall, and an untraced rank reports none."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from dataflow.backends import make_backend
from dataflow.instrument import TracingBackend
from dataflow.memplan.plan import OptimizerWhere
from dataflow.memplan.ring_plan import RankPlan
from dataflow.models.config import load_config
from dataflow.ring.rank import RingRank
from dataflow.ring.shm import SharedMemoryTransport, cleanup
from tests.dataflow.plans import forced_plan, streamed


def _rank(be):
    cfg = load_config("tiny")
    home = streamed(OptimizerWhere.HOST)
    plan = forced_plan(cfg, 64, chunk_tokens=64, layers=(home,) * cfg.n_layers, embed=home,
                       head=home, head_sub_tokens=64)
    rp = RankPlan(rank=0, n_ranks=1, layers=tuple(range(cfg.n_layers)), has_embed=True,
                  has_head=True, n_layers=cfg.n_layers, plan=plan)
    run_id = uuid.uuid4().hex[:12]
    try:
        tr = SharedMemoryTransport(0, 1, run_id, replica=0, replicas=1, timeout_s=30)
        return RingRank(rp, be, tr, seed=0), cfg
    finally:
        cleanup(run_id)


@pytest.mark.parametrize("traced", [True, False])
def test_a_traced_rank_reports_each_steps_breakdown(traced):
    be = make_backend("numpy")
    rank, cfg = _rank(TracingBackend(be) if traced else be)
    try:
        rows = rank.rp.plan.chunking.seqs_per_step
        tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (rows, 65), np.int32)
        for _ in range(2):
            stats = rank.train_step(tokens)
            bd = rank.last_breakdown
            if not traced:
                assert bd is None
                continue
            assert bd is not None and bd.wall_s > 0
            assert sum(bd.parts().values()) == pytest.approx(bd.wall_s, rel=1e-6, abs=1e-6)
            assert bd.compute_busy_s > 0
        assert np.isfinite(stats.loss)
    finally:
        rank.close()
