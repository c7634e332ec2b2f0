"""A traced ring rank (dataflow-ring --trace): the rank's backend wrapped in a TracingBackend
reports each step's breakdown (compute, exposed copy, host, idle), whose parts sum to the
step's wall, and an untraced rank reports none."""

from __future__ import annotations

import numpy as np
import pytest

from dataflow.backends import make_backend
from dataflow.instrument import TracingBackend
from dataflow.models.config import load_config
from tests.ring.small_rings import lone_rank


@pytest.mark.parametrize("traced", [True, False])
def test_a_traced_rank_reports_each_steps_breakdown(traced):
    be, cfg = make_backend("numpy"), load_config("tiny")
    rank = lone_rank(cfg, TracingBackend(be) if traced else be)
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
