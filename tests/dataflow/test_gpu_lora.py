"""LoRA on the GPU (CuPy backend; issue 54): the LoRA plans of tests/dataflow/test_lora.py train
on the GPU with the NumPy backend's losses and adapter trajectories (base bit-identical), the
scale_ kernel against its NumPy reference, and one step's adapter gradients against the NumPy
backend's. Not run on the CPU machine of the session that wrote it: it needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import BF16, cuda_context, dev, host, require_gpu, same_bits  # noqa: E402

cp = require_gpu()

from dataflow.engine import Engine  # noqa: E402
from dataflow.kernels.reference.lora import scale  # noqa: E402
from dataflow.models.config import load_config  # noqa: E402
from tests.dataflow.test_lora import LR, _batch, _forced, _random_b  # noqa: E402


def _train(plan, backend: str, seed: int, steps: int = 3):
    """(losses, adapters at the start and after `steps`, gradients of the first step, base state) of one run
    from the same adapters (B random) and batches."""
    eng = Engine.from_plan(plan, backend=backend, lr=LR, max_grad_norm=None, seed=0)
    rng = np.random.default_rng(seed)
    start = _random_b(eng, rng)
    batches = [_batch(eng, rng) for _ in range(steps)]
    base0 = eng.state_dict()
    losses, grads = [], None
    for i, b in enumerate(batches):
        losses.append(eng.train_step(b).loss)
        if i == 0:
            grads = {k: v for k, v in eng.lora_state().items() if k.endswith(".grad")}
    final = eng.lora_state()
    base1 = eng.state_dict()
    eng.close()
    return losses, start, final, grads, base0, base1


@pytest.mark.parametrize("name", ["streamed", "split"])
def test_gpu_lora_matches_the_numpy_backend(name):
    """Losses within 2e-2, step-1 adapter gradients within 5 % (max relative), the adapters
    after three steps within 20 % of the distance travelled (relative L2), base unchanged."""
    plan = _forced(name, load_config("tiny"))
    g_loss, start, g_ad, g_grad, g_b0, g_b1 = _train(plan, "cupy", 31)
    n_loss, _, n_ad, n_grad, _, _ = _train(plan, "numpy", 31)
    np.testing.assert_allclose(g_loss, n_loss, rtol=2e-2)
    for k, v in n_grad.items():
        err = np.abs(g_grad[k] - v).max() / (np.abs(v).max() + 1e-30)
        assert err < 0.05, (k, err)
    for k, a0 in start.items():
        moved = np.linalg.norm(n_ad[k] - a0)
        assert moved > 0 and np.linalg.norm(g_ad[k] - n_ad[k]) <= 0.2 * moved, k
    for k in g_b0:
        if not k.startswith("optimizer."):
            assert np.array_equal(g_b0[k], g_b1[k]), k


def test_gpu_scale_matches_reference_on_random_bf16():
    """scale_ on the device: the fp32 product rounded once, the reference's bits."""
    # imported here: dataflow.kernels.cuda needs CuPy, which the module-level skip checked
    from dataflow.kernels.cuda import scale_

    rng = np.random.default_rng(7)
    print("seed 7")
    x = rng.standard_normal((64, 8)).astype(np.float32).astype(BF16)
    want = scale(x, 0.37)
    d = dev(x)
    scale_(cuda_context(), d, 0.37)
    assert same_bits(host(d), want)
    xf = rng.standard_normal((33, 5)).astype(np.float32)
    d = cp.asarray(xf)
    scale_(cuda_context(), d, -1.5)
    assert np.array_equal(cp.asnumpy(d), scale(xf, -1.5))
