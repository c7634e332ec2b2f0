"""A ring clips by the bits one device clips by: each rank keeps every block's squared gradient
norm apart and the ranks add them in the order one device's compiled step adds them
(dataflow.ring.executor.single_device_norm_order). This checks that order against the schedule
the single-device compiler emits, for an embedding on the device and one at home, so a change to
the compiler's backward order cannot silently make rings clip by other bits."""

from __future__ import annotations

import pytest

from dataflow.memplan.plan.plan import OptimizerWhere
from dataflow.memplan.step.compile import Compute, HostTask, compile_schedule
from dataflow.models.config import load_config
from dataflow.ring.executor import single_device_norm_order
from tests.dataflow.plans import RESIDENT, forced_plan, streamed


@pytest.mark.parametrize("embed", ["device", "home"])
@pytest.mark.parametrize("update", ["end", "deferred"])
def test_the_ring_adds_block_norms_in_the_single_device_order(embed, update):
    cfg = load_config("tiny")
    home = streamed(OptimizerWhere.HOST)
    layers = tuple(home if i % 2 else RESIDENT for i in range(cfg.n_layers))
    plan = forced_plan(cfg, 64, chunk_tokens=128, seqs_per_chunk=2, chunks_per_round=2,
                       rounds=2, layers=layers, embed=RESIDENT if embed == "device" else home)
    sch = compile_schedule(plan, update=update)
    device = [ev.name.removeprefix("gnorm.") for ev in sch.events
              if type(ev) is Compute and ev.op == "grad_sumsq"]
    on_host = [ev.name for ev in sch.events if type(ev) is HostTask and ev.op == "grad_sumsq"]
    want = single_device_norm_order(cfg.n_layers)
    if embed == "home":  # its norm is the host's part, added last (scalar 2)
        want.remove("embed")
        assert on_host == ["gnorm.embed"]
    assert device == want
