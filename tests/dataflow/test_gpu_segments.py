"""Layer-segment recompute on the GPU: the packed (k = n_layers) and split (k = 2, boundaries
leaving their K/V to home.ctx_kv) segment plans of tests/dataflow/test_segments.py train on the
CuPy backend as on the NumPy one (a split sequence's backward uses cuDNN's atomic-dQ attention
there, so within tolerance, not bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.models.init import init_model  # noqa: E402
from tests.dataflow.test_gpu_executor import _run  # noqa: E402
from tests.dataflow.test_segments import SEGMENTS, _cfg, _exact, _plans  # noqa: E402


@pytest.mark.parametrize("name", sorted(SEGMENTS))
def test_segment_plans_on_gpu_match_the_numpy_backend(name):
    plan = _exact(_plans()[name], SEGMENTS[name])
    start = init_model(_cfg(), 0)
    g_loss, g_w = _run(plan, "cupy")
    n_loss, n_w = _run(plan, "numpy")
    np.testing.assert_allclose(g_loss, n_loss, rtol=2e-2, err_msg=name)
    for a, b, s in zip(g_w, n_w, [start.embed, *start.layers, start.head]):
        da = a.astype(np.float64) - s.astype(np.float64)
        db = b.astype(np.float64) - s.astype(np.float64)
        err = np.linalg.norm(da - db) / np.linalg.norm(db)
        assert err < 0.10, f"{name}: update differs from NumPy by {err:.2%}"
