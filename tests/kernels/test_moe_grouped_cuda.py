"""The grouped expert GEMMs (kernels/cuda/moe_grouped.py) against the float64 reference of the
routed experts (kernels/reference/moe_experts.py) and beside the per-expert cuBLASLt loop
(kernels/cuda/moe_experts.py), on fresh random routings: experts with no rows, one expert taking
every row, row counts that end inside a 128-row tile and a 64-row K step, and the engine's
layer-block views (an expert's three matrices together, so the stacked weights step over more
than one matrix). The bound is tests/gpu.check_close's (STYLE §7): the GPU's norm-wise error
against the float64 truth at most twice the fp32 reference's on the same bf16 inputs. An idle
expert's gradients keep their bits. GPU tests: skipped without CuPy or a device."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dataflow.kernels.reference import moe_experts as rexp
from tests.gpu import BF16, F32, bf, check_close, cuda_context, dev, f64, host, poisoned, same_bits

try:
    import cupy

    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, or CuPy built for another CUDA
    cupy = None
    HAVE_GPU = False

if HAVE_GPU:
    from dataflow.kernels.cuda import moe_grouped as kgr
CTX = cuda_context() if HAVE_GPU else None
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")


def _routing(rng, t: int, n: int, k: int, idle) -> np.ndarray:
    allowed = np.array([e for e in range(n) if e not in set(idle)])
    pick = np.argsort(rng.random((t, allowed.size)), axis=1)[:, :k]
    return allowed[pick].astype(np.int64)


def _weights(rng, n: int, f: int, d: int, block: bool):
    """wg, wu (n, f, d) and wd (n, d, f) bf16 on the host, and their device forms: stacked
    arrays, or views of one (n, 3 f d) block as the engine lays a layer out."""
    mats = [bf(rng.standard_normal((n, o, i)) / math.sqrt(i)) for o, i in ((f, d), (f, d), (d, f))]
    if not block:
        return mats, [dev(m) for m in mats]
    blk = cupy.asarray(np.concatenate([m.reshape(n, -1) for m in mats], axis=1))
    views = [blk[:, j * f * d:(j + 1) * f * d].reshape(n, *m.shape[1:])
             for j, m in enumerate(mats)]
    return mats, views


def _grads(a0, block: bool):
    if not block:
        return [dev(a) for a in a0]
    n = a0[0].shape[0]
    blk = cupy.asarray(np.concatenate([a.reshape(n, -1) for a in a0], axis=1))
    size = a0[0][0].size
    return [blk[:, j * size:(j + 1) * size].reshape(a.shape) for j, a in enumerate(a0)]


CASES = [  # (T, N, k, D, F, idle experts)
    (96, 8, 2, 256, 256, (2, 6)),          # rows below one tile per expert, idle experts
    (700, 6, 2, 256, 512, (4,)),           # several tiles an expert, tails inside tiles and K steps
    (300, 5, 1, 512, 256, (0, 1, 3, 4)),   # one expert takes every row
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=["small", "multi-tile", "one-expert"])
@pytest.mark.parametrize("block", [False, True], ids=["stacked", "layer-block"])
@pytest.mark.parametrize("grad_dtype", [F32, BF16], ids=["f32-grads", "bf16-grads"])
def test_grouped_experts_match_reference_and_leave_idle_experts_untouched(rng, case, block,
                                                                          grad_dtype):
    t, n, k, d, f, idle = case
    idx = _routing(rng, t, n, k, idle)
    order, offsets = rexp.expert_order(idx, n)
    mats, wdev = _weights(rng, n, f, d, block)
    wg, wu, wd = mats
    assert kgr.grouped_supported(d, f, BF16, *wdev)
    xp = rexp.permute_fwd(bf(rng.standard_normal((t, d))), order, k)
    r = t * k
    off_dev = dev(offsets)
    yp_t, gate_t, up_t = rexp.experts_fwd(f64(xp), offsets, f64(wg), f64(wu), f64(wd))
    yp_r, gate_r, up_r = rexp.experts_fwd(xp, offsets, wg, wu, wd)
    yp, gate, up, h = (poisoned(s, BF16) for s in ((r, d), (r, f), (r, f), (r, f)))
    kgr.grouped_experts_fwd(CTX, dev(xp), off_dev, *wdev, yp, gate, up, h=h)
    check_close("grouped fwd gate", host(gate), gate_t, gate_r)
    check_close("grouped fwd up", host(up), up_t, up_r)
    check_close("grouped fwd yp", host(yp), yp_t, yp_r)

    dyp = bf(rng.standard_normal((r, d)))
    dxp_t, gg_t, gu_t, gd_t = rexp.experts_bwd(f64(xp), offsets, f64(wg), f64(wu), f64(wd),
                                               f64(gate_r), f64(up_r), f64(dyp))
    dxp_r, gg_r, gu_r, gd_r = rexp.experts_bwd(xp, offsets, wg, wu, wd, gate_r, up_r, dyp)
    g0 = [rng.standard_normal(a.shape).astype(F32).astype(grad_dtype) for a in (gg_r, gu_r, gd_r)]
    grads = _grads(g0, block)
    dxp = poisoned((r, d), BF16)
    kgr.grouped_experts_bwd(CTX, dev(xp), off_dev, *wdev, dev(gate_r), dev(up_r), dev(dyp), dxp,
                            *grads, dgate=poisoned((r, f), BF16), dup=poisoned((r, f), BF16),
                            h=poisoned((r, f), BF16))
    check_close("grouped bwd dxp", host(dxp), dxp_t, dxp_r)
    active = [e for e in range(n) if e not in idle]
    for name, g, a0, truth, ref in (("dw_gate", grads[0], g0[0], gg_t, gg_r),
                                    ("dw_up", grads[1], g0[1], gu_t, gu_r),
                                    ("dw_down", grads[2], g0[2], gd_t, gd_r)):
        got = host(g)
        for e in idle:
            assert same_bits(got[e], a0[e]), f"{name}[{e}] of an idle expert changed"
        want = (a0.astype(F32) + ref).astype(grad_dtype)
        check_close(f"grouped bwd {name} += {grad_dtype}", got[active],
                    f64(a0)[active] + truth[active], want[active])


@pytest.mark.gpu
@needs_gpu
def test_grouped_experts_refuse_shapes_and_host_offsets_by_name(rng):
    n, f, d, r = 4, 96, 256, 32
    w = [dev(bf(rng.standard_normal(s))) for s in ((n, f, d), (n, f, d), (n, d, f))]
    assert not kgr.grouped_supported(d, f, BF16, *w)
    off = np.array([0, 8, 16, 24, 32], np.int64)
    out = [poisoned(s, BF16) for s in ((r, d), (r, f), (r, f), (r, f))]
    x = dev(bf(rng.standard_normal((r, d))))
    with pytest.raises(TypeError, match="device"):
        kgr.grouped_experts_fwd(CTX, x, off, *w, *out[:3], h=out[3])
    with pytest.raises(ValueError, match="multiples of 256"):
        kgr.grouped_experts_fwd(CTX, x, dev(off), *w, *out[:3], h=out[3])
