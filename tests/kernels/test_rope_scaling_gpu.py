"""The CUDA RoPE with Llama 3.1-style scaled frequencies ('llama3') against the NumPy reference
on fresh random inputs, forward and backward, in place and out of place, bf16 and fp32 storage;
and an engine on the GPU with a scaled config against the same engine on the NumPy backend.
Tolerance rule as tests/kernels/test_cuda_ops.py (STYLE §7): error against the float64 truth at
most twice the bf16 (or fp32) reference's. GPU only: skipped cleanly without CuPy or a device."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import require_gpu

cupy = require_gpu()

import dataflow.kernels.cuda as kc  # noqa: E402
import dataflow.kernels.reference as ref  # noqa: E402
from dataflow.models.init import BF16  # noqa: E402
from tests.gpu import cuda_context  # noqa: E402
from tests.gpu import dev as _dev  # noqa: E402
from tests.gpu import host as _host  # noqa: E402
from tests.gpu import poisoned as _poisoned  # noqa: E402
from tests.gpu import rel as _rel  # noqa: E402

pytestmark = pytest.mark.gpu
CTX = cuda_context()
"""The CudaContext every kernel call of this module launches through."""

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
FP32_FLOOR = 1e-5
# (head_dim, n_heads, theta, (factor, low, high, original_max_position_embeddings))
SCALED = {"llama3.1-8b": (128, 2, 500000.0, (8.0, 1.0, 4.0, 8192)),
          "llama3.2-1b": (64, 4, 500000.0, (32.0, 1.0, 4.0, 8192)),
          "small": (16, 3, 10000.0, (4.0, 1.0, 4.0, 256))}


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", sorted(SCALED))
def test_rope_cuda_with_llama3_scaling_matches_reference(rng, name, dtype):
    """rope_fwd/rope_bwd on the GPU with a scaled table match the reference given the same
    table (positions up to 131072 and one near 10^6), out of place and in place identically."""
    e, n, theta, scaling = SCALED[name]
    table = ref.rope_inv_freq(e, theta, scaling)
    assert not np.array_equal(table, ref.rope_inv_freq(e, theta))
    t = 300
    x = rng.standard_normal((t, n, e)).astype(dtype)
    pos = rng.integers(0, 131_073, size=t).astype(np.int32)
    pos[:3] = (0, 131_072, 999_999)
    for op, fn_c, fn_r in (("rope_fwd", kc.rope_fwd, ref.rope_fwd),
                           ("rope_bwd", kc.rope_bwd, ref.rope_bwd)):
        truth, r = fn_r(x.astype(F64), pos, table), fn_r(x, pos, table)
        out = _poisoned(x.shape, dtype)
        fn_c(CTX, _dev(x), _dev(pos), table, out)
        err, err_ref = _rel(_host(out), truth), _rel(r, truth)
        bound = max(2.0 * err_ref, FP32_FLOOR)
        print(f"{op} {name} {dtype}: err {err:.3e} reference {err_ref:.3e} bound {bound:.3e}")
        assert err <= bound, (op, name, err, bound)
        inplace = _dev(x)
        fn_c(CTX, inplace, _dev(pos), table, inplace)
        assert np.array_equal(_host(inplace).view(np.uint8), _host(out).view(np.uint8))


def test_rope_cuda_theta_and_plain_table_give_identical_bits(rng):
    """A number (plain theta) and the plain table it stands for launch the same kernel with the
    same frequencies: identical output bits."""
    x = _dev(rng.standard_normal((64, 4, 64)).astype(BF16))
    pos = _dev(rng.integers(0, 1 << 20, size=64).astype(np.int32))
    a, b = _poisoned(x.shape, BF16), _poisoned(x.shape, BF16)
    kc.rope_fwd(CTX, x, pos, 500000.0, a)
    kc.rope_fwd(CTX, x, pos, ref.rope_inv_freq(64, 500000.0), b)
    assert np.array_equal(_host(a).view(np.uint16), _host(b).view(np.uint16))


def test_engine_on_gpu_with_llama3_scaling_matches_numpy_backend():
    """Two training steps of a scaled small config on the CuPy backend match the NumPy backend
    (the reference ops) within bf16 tolerance: the table reaches the CUDA ops through the op
    table, and nothing is allocated outside the arena for it (the allocation guard is on)."""
    import dataclasses

    from dataflow.data import token_stream
    from dataflow.engine import Engine
    from dataflow.optimizer import AdamWConfig
    from dataflow.models.config import RopeScaling, load_config

    cfg = dataclasses.replace(load_config("small"), name="small-llama3", rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))
    losses = {}
    for backend in ("numpy", "cupy"):
        with Engine(cfg, host_gb=1, dev_gb=1, seqlen=256, seqs_per_step=2, backend=backend,
                    seed=5, optimizer=AdamWConfig(lr=1e-3)) as eng:
            batches = [token_stream(256, 2, cfg.vocab_size, start=s * 512) for s in range(2)]
            losses[backend] = [eng.train_step(b).loss for b in batches]
    np.testing.assert_allclose(losses["cupy"], losses["numpy"], rtol=1e-2)
