"""Checkpoint and resume on the GPU (CuPy backend): 6 steps straight equal 3 steps, a save, and
3 more steps in a fresh Engine built from another plan of the same model (other placements),
bit for bit in losses and final weights, for `small` with the demo's default schedule and
clipping."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.data import token_stream  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.lr_schedule import WarmupCosine  # noqa: E402
from dataflow.optimizer import AdamWConfig  # noqa: E402
from dataflow.models.config import load_config  # noqa: E402
from tests.dataflow.plans import path_plans  # noqa: E402


def _batch(plan, step):
    ch, cfg = plan.chunking, plan.model
    return token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                        start=step * ch.seqs_per_step * ch.seqlen)


def test_resume_on_gpu_under_another_plan_is_bit_identical(tmp_path):
    cfg = load_config("small")
    plans = dict(path_plans(cfg))
    first, second = plans["all_resident"], plans["streamed_2_slots_streamed_opt"]
    assert first.chunking == second.chunking
    opt = AdamWConfig(lr=1e-3, max_grad_norm=1.0)
    sched = WarmupCosine(lr=1e-3, warmup_steps=2, total_steps=6, min_lr=1e-4)

    def engine(plan):
        return Engine.from_plan(plan, backend="cupy", optimizer=opt, lr_schedule=sched)

    with engine(first) as eng:
        straight = [eng.train_step(_batch(first, s)).loss for s in range(6)]
        want = eng.weights()
    with engine(first) as eng:
        resumed = [eng.train_step(_batch(first, s)).loss for s in range(3)]
        path = eng.save_checkpoint(tmp_path / "ckpt")
    with engine(second) as eng:
        info = eng.load_checkpoint(path)
        assert info.step == 3
        resumed += [eng.train_step(_batch(second, s)).loss for s in range(3, 6)]
        got = eng.weights()
    assert resumed == straight
    for a, b in zip([got.embed, *got.layers, got.head], [want.embed, *want.layers, want.head]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
