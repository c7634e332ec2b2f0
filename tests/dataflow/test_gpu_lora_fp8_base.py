"""LoRA on an FP8-stored frozen base on the GPU (CuPy backend; `--lora-base fp8`): a tiny
engine's streamed and resident fp8-base plans train with the NumPy backend's losses (within
2e-2 relative, as tests/dataflow/test_gpu_lora.py's bf16 base: the decode is bit-exact, the rest
is bf16 GEMMs summing in another order) and step-1 adapter gradients (within 5 % max relative),
the stored codes bit-identical after training, the dequantised base the NumPy engine's bit for
bit. Not run on the CPU machine of the session that wrote it: it needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.engine import Engine  # noqa: E402
from tests.dataflow.test_lora_fp8_base import (_batch, _random_b, _stored,  # noqa: E402
                                               _streamed_plan)


def _train(plan, backend: str, seed: int, steps: int = 2):
    """(losses, step-1 adapter gradients, stored codes before and after, the dequantised base)."""
    eng = Engine.from_plan(plan, backend=backend, lr=2e-3, max_grad_norm=None, seed=0)
    rng = np.random.default_rng(seed)
    _random_b(eng, rng)
    batches = [_batch(eng, rng) for _ in range(steps)]
    before, base = _stored(eng), eng.weights()
    losses, grads = [], None
    for i, b in enumerate(batches):
        losses.append(eng.train_step(b).loss)
        if i == 0:
            grads = {k: v for k, v in eng.lora_state().items() if k.endswith(".grad")}
    after = _stored(eng)
    eng.close()
    return losses, grads, before, after, base


def _resident_plan():
    # Imported here: the planner's entry is only needed by this one plan.
    from dataflow.memplan import make_plan
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.plan.profiles import get_profile
    from dataflow.models.config import load_config

    return make_plan(load_config("tiny"), 32, Budget.from_gib(1, 0.5), get_profile("cpu"),
                     lora=dict(rank=4, alpha=8, base="fp8"))


@pytest.mark.parametrize("where", ["streamed", "resident"])
def test_gpu_fp8_base_lora_matches_the_numpy_backend(where):
    """Losses within 2e-2, step-1 adapter gradients within 5 %, codes unchanged, the same
    dequantised base on both backends."""
    plan = _streamed_plan() if where == "streamed" else _resident_plan()
    assert plan.lora.fp8_base
    g_loss, g_grad, g_before, g_after, g_base = _train(plan, "cupy", 53)
    n_loss, n_grad, n_before, _, n_base = _train(plan, "numpy", 53)
    np.testing.assert_allclose(g_loss, n_loss, rtol=2e-2)
    for k, v in n_grad.items():
        err = np.abs(g_grad[k] - v).max() / (np.abs(v).max() + 1e-30)
        assert err < 0.05, (k, err)
    for a, b, c in zip(g_before, g_after, n_before):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
        assert np.array_equal(a.view(np.uint16), c.view(np.uint16))
    for a, b in zip(g_base.layers, n_base.layers):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
