"""Engine setup writes each block straight into where it lives (home, host-memory device, or the
pinned staging region then one copy) and clears state in parallel; the bytes must be exactly
those of the old path: dataflow.models.init on fresh arrays, copied in, and zeroed state."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dataflow.backends.numpy_backend import NumpyBackend
from dataflow.engine import Engine
from dataflow.models.config import load_config
from dataflow.models.init import init_model
from tests.dataflow.plans import path_plans

TINY = load_config("tiny")
PLANS = {name: plan for name, plan in path_plans(TINY)
         if name in ("all_resident", "streamed_many_slots_mixed", "embed_head_at_home")}

GOLDEN = {("tiny", 0): "36ed9f4e8aa19f0869132f9c1a2d696b231c3bd1e3faa40130207db9e1b73322",
          ("small", 3): "2f44fed97ef6ab0f94171093b17b54ce12418676ec84df439a968337fa7ae548",
          ("tiny", 2**64 - 1): "b16ef8cb99ce0bb0cb5054285025879aa8b1e3d61eaee0dd6d52de3bad05523e"}
"""sha256 over every block of init_model(cfg, seed), made with models/init.py as it was before
the work items were built as arrays (commit b9f984b): the initialisation must never drift."""


class StagedNumpy(NumpyBackend):
    """A NumPy backend that claims its device is not host memory, so the engine takes the GPU
    paths (pinned staging, asynchronous copies from home); sanitized, copies run only when the
    engine synchronises, so a missing synchronisation shows up as wrong bytes."""

    device_is_host_memory = False

    def __init__(self):
        super().__init__(sanitize=True, seed=1)


def _assert_weights_equal_fresh_init(eng, seed):
    want = init_model(eng.plan.model, seed)
    got = eng.weights()
    for (_, layer, _, a), (_, _, _, b) in zip(want.blocks(), got.blocks()):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), layer


def _state_views(eng):
    for b in eng.ex.blocks():
        for part in ("grads", "m", "v"):
            for view in (b.device(part), b.home(part)):
                if view is not None:
                    yield b.key, part, view


@pytest.mark.parametrize("backend", ["numpy", "staged"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_engine_init_is_bit_identical_to_init_model_and_state_is_zero(rng, name, backend):
    """Weights written in place equal init_model's fresh arrays byte for byte on plans with
    resident, streamed and home embed/head blocks; every gradient and AdamW byte is zero."""
    seed = int(rng.integers(0, 2**63))
    be = StagedNumpy() if backend == "staged" else "numpy"
    with Engine.from_plan(PLANS[name], backend=be, seed=seed) as eng:
        _assert_weights_equal_fresh_init(eng, seed)
        for key, part, view in _state_views(eng):
            assert not eng.be.to_numpy(view).view(np.uint8).any(), (key, part)


def test_init_model_bytes_match_the_recorded_digests():
    """init_model still produces the exact bytes it did before this change (golden sha256)."""
    for (model, seed), digest in GOLDEN.items():
        h = hashlib.sha256()
        for *_, block in init_model(load_config(model), seed).blocks():
            h.update(block.tobytes())
        assert h.hexdigest() == digest, (model, seed)


@pytest.mark.parametrize("backend", ["numpy", "staged"])
def test_reload_clears_dirty_state_and_writes_weights_through_home(rng, backend):
    """After every state byte is scrambled, load_state_dict(weights_only=True) zeroes gradients,
    m and v (pages that hold data are written, not skipped) and writes the weights exactly."""
    seed = int(rng.integers(0, 2**63))
    be = StagedNumpy() if backend == "staged" else "numpy"
    with Engine.from_plan(PLANS["streamed_many_slots_mixed"], backend=be, seed=seed) as eng:
        weights = {k: v for k, v in eng.state_dict().items() if not k.startswith("optimizer.")}
        eng.be.synchronize()
        for key, part, view in _state_views(eng):
            raw = view.reshape(-1).view(np.uint8)
            raw[...] = rng.integers(1, 256, raw.size, dtype=np.uint8)
        for ref in eng.block_refs():  # scramble the weights too: the reload must restore them
            arr = eng.read_block(ref)
            eng.write_block(ref, rng.permutation(arr))
        eng.load_state_dict(weights, weights_only=True)
        _assert_weights_equal_fresh_init(eng, seed)
        for key, part, view in _state_views(eng):
            assert not eng.be.to_numpy(view).view(np.uint8).any(), (key, part)


def test_setup_phases_are_disjoint_and_add_up_to_at_most_the_wall_time():
    """Engine.setup_seconds times each phase once ('plan' is the planner alone, not the planner
    and everything after it), so the phases sum to no more than the constructor's wall time;
    warm_up's own parts are reported beside them."""
    import time

    t0 = time.perf_counter()
    eng = Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=128, backend="numpy")
    wall = time.perf_counter() - t0
    phases = eng.setup_seconds
    assert {"backend", "plan", "executor", "init_weights", "warm_up"} <= set(phases)
    assert sum(phases.values()) <= wall + 1e-3, phases
    assert "host_kernels" in eng.warm_up_parts
    eng.close()
