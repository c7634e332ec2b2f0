"""The executor on the GPU (CuPy backend): matches the NumPy backend on the tiny and small plan
sets, placement-only changes are bit-identical, and CuPy's pool does not grow after the first
round (every buffer comes from the arenas)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.data import token_stream  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.optimizer import AdamWConfig  # noqa: E402
from dataflow.models.config import load_config  # noqa: E402
from tests.dataflow.plans import path_plans, split_plans  # noqa: E402

LR = 1e-3
DEVICE_OPT = {"all_resident", "streamed_2_slots_streamed_opt", "streamed_many_slots_mixed",
              "levels_on_device", "levels_at_home"}
"""Plans whose every block is updated by the CUDA AdamW kernel: bit-identical to each other.
(The host optimizer rounds identically to the NumPy reference, not to the CUDA kernel.)"""


def _run(plan, backend):
    ch, cfg = plan.chunking, plan.model
    with Engine.from_plan(plan, backend=backend, optimizer=AdamWConfig(lr=LR)) as eng:
        losses = []
        for s in range(2):
            batch = token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                 start=s * ch.seqs_per_step * ch.seqlen)
            losses.append(eng.train_step(batch).loss)
        w = eng.weights()
    return losses, [w.embed, *w.layers, w.head]


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_gpu_executor_matches_numpy_backend(model):
    """Loss within 2e-2 relative and the two-step parameter update within 10 % (relative L2)
    of the NumPy backend's, on every forced path."""
    cfg = load_config(model)
    from dataflow.models.init import init_model

    start = init_model(cfg, 0)
    start_blocks = [start.embed, *start.layers, start.head]
    plans = path_plans(cfg) + split_plans(cfg)
    if model == "small":
        plans = plans[:3] + plans[-2:]
    for name, plan in plans:
        g_loss, g_w = _run(plan, "cupy")
        n_loss, n_w = _run(plan, "numpy")
        np.testing.assert_allclose(g_loss, n_loss, rtol=2e-2, err_msg=name)
        for a, b, s in zip(g_w, n_w, start_blocks):
            da = a.astype(np.float64) - s.astype(np.float64)
            db = b.astype(np.float64) - s.astype(np.float64)
            err = np.linalg.norm(da - db) / np.linalg.norm(db)
            assert err < 0.10, f"{model}/{name}: update differs from NumPy by {err:.2%}"


def test_gpu_placement_only_changes_are_bit_identical():
    """Plans that differ only in placement, prefetch depth or saved level: same bits on GPU."""
    cfg = load_config("tiny")
    runs = {name: _run(plan, "cupy") for name, plan in path_plans(cfg) if name in DEVICE_OPT}
    base_loss, base = runs.pop("all_resident")
    for name, (loss, blocks) in runs.items():
        assert loss == base_loss, name
        for a, b in zip(blocks, base):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), name


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_gpu_kv_rebuild_is_bit_identical_to_keeping_kv(model):
    """A split plan whose K/V are re-formed from x (at home and on the device) trains the same
    bits as the same plan keeping its K/V: the forward's kernels on the forward's shapes."""
    plans = dict(split_plans(load_config(model)))
    keep_loss, keep = _run(plans["split_levels_home_streamed"], "cupy")
    loss, blocks = _run(plans["split_kv_rebuild"], "cupy")
    assert loss == keep_loss
    for a, b in zip(blocks, keep):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_cupy_pool_does_not_grow_after_first_round():
    """Everything the hot loop touches comes from the arenas: the pool's used bytes after step 1
    equal those after step 3."""
    cfg = load_config("tiny")
    plan = dict(path_plans(cfg))["levels_at_home"]
    pool = cp.get_default_memory_pool()
    with Engine.from_plan(plan, backend="cupy") as eng:
        ch = plan.chunking
        used = []
        for s in range(3):
            eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                        start=s * 1000))
            eng.be.synchronize()
            used.append(pool.used_bytes())
    assert used[1] == used[0] and used[2] == used[0], used


def _bits_of_updating_at_the_end(model: str, clip, **mode) -> None:
    """Three steps of five path and split plans with the update mode `mode` (Engine options)
    and with the update at the end of each step: the same losses, gradient norms and final
    weights, m and v, bit for bit."""
    cfg = load_config(model)
    plans = path_plans(cfg) + split_plans(cfg)
    for name, plan in plans[1:3] + plans[-3:-1] + [plans[-1]]:
        ch = plan.chunking
        out = []
        for kwargs in ({"deferred_update": False}, mode):
            opt = AdamWConfig(lr=LR, weight_decay=0.1, max_grad_norm=clip)
            with Engine.from_plan(plan, backend="cupy", optimizer=opt, **kwargs) as eng:
                res = [eng.train_step(token_stream(ch.seqlen, ch.seqs_per_step, cfg.vocab_size,
                                                   start=s * ch.seqs_per_step * ch.seqlen))
                       for s in range(3)]
                out.append(([(r.loss, r.grad_norm) for r in res], eng.state_dict()))
        (eager, e_state), (other, o_state) = out
        assert other == eager, name
        for k in e_state:
            a, b = np.atleast_1d(e_state[k]), np.atleast_1d(o_state[k])
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{name}: {k}"


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_gpu_deferred_update_is_the_bits_of_updating_at_the_end(model):
    """On the GPU (real streams, the AdamW kernel on its own stream inside round 0), with
    clipping engaged."""
    _bits_of_updating_at_the_end(model, 0.05, deferred_update=True)


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_gpu_update_in_the_last_round_is_the_bits_of_updating_at_the_end(model):
    """On the GPU (the in-round AdamW on its own stream beside the backward), unclipped, with
    Engine(backward_update=True)."""
    _bits_of_updating_at_the_end(model, None, deferred_update=True, backward_update=True)
