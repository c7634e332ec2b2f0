"""A split sequence's attention forward as two cuDNN calls merged by their log-sum-exps
(CudaOps.attention_fwd with the o_part / lse_part scratch lent; memplan.buffers.
splits_attention_forward): the merge kernel against the NumPy reference, and every chunk of a
sequence against the float64 reference and the one-call forward, on fresh random inputs, with
nothing allocated outside what was lent."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import require_gpu

pytestmark = pytest.mark.gpu


def _rel(out, truth) -> float:
    out, truth = np.asarray(out, np.float64), np.asarray(truth, np.float64)
    return float(np.linalg.norm(out - truth) / np.linalg.norm(truth))


def test_merge_kernel_matches_the_reference(rng):
    require_gpu()
    import cupy as cp
    import ml_dtypes

    from kernels.cuda import attention as kattn
    from kernels.reference.attention import attention_merge

    bf16 = np.dtype(ml_dtypes.bfloat16)
    t, h, e = 300, 6, 128
    o, o_part = (rng.standard_normal((t, h, e)).astype(bf16) for _ in range(2))
    lse, lse_part = (rng.standard_normal((h, t)).astype(np.float32) * 4 for _ in range(2))
    want_o, want_lse = attention_merge(o, lse, o_part, lse_part)
    d = lambda a: cp.asarray(a.view(np.uint16)).view(bf16) if a.dtype == bf16 else cp.asarray(a)  # noqa: E731
    do, dl = d(o), d(lse)
    kattn.attention_merge(do, dl, d(o_part), d(lse_part))
    got_o = cp.asnumpy(do.view(cp.uint16)).view(bf16)
    # the same fp32 formula: o differs from the reference by at most one bf16 rounding step
    assert _rel(got_o, want_o) < 4e-3
    np.testing.assert_allclose(cp.asnumpy(dl), want_lse, rtol=1e-6, atol=1e-6)


def test_split_forward_matches_one_call_and_allocates_nothing(rng):
    require_gpu()
    import cupy as cp
    import ml_dtypes

    import kernels.reference as ref
    from dataflow.ops_cuda import CudaOps
    from kernels.cuda import attention as kattn

    bf16 = np.dtype(ml_dtypes.bfloat16)
    t, h, kh, e, s = 256, 4, 2, 128, 1024
    q = rng.standard_normal((s, h, e)).astype(bf16)
    k = rng.standard_normal((s, kh, e)).astype(bf16)
    v = rng.standard_normal((s, kh, e)).astype(bf16)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    want_o, want_lse = ref.attention_fwd(f64(q), f64(k), f64(v), 0)

    def dev(a):
        return cp.asarray(np.ascontiguousarray(a).view(np.uint16)).view(bf16)

    def run(ops):
        o, lse = cp.empty((s, h, e), bf16), cp.empty((h, s), cp.float32)
        kd, vd = dev(k), dev(v)
        for c in range(s // t):
            a, b = c * t, (c + 1) * t
            oc, lc = cp.empty((t, h, e), bf16), cp.empty((h, t), cp.float32)
            ops.attention_fwd(dev(q[a:b]), kd[:b], vd[:b], a, oc, lc)
            o[a:b], lse[:, a:b] = oc, lc
        cp.cuda.get_current_stream().synchronize()
        return cp.asnumpy(o.view(cp.uint16)).view(bf16), cp.asnumpy(lse)

    kattn.forget_graphs()
    split = CudaOps()
    split.lend_scratch({"o_part": cp.empty((t, h, e), bf16),
                        "lse_part": cp.empty((h, t), cp.float32),
                        "attn_workspace": cp.empty(64 << 20, cp.uint8)})
    o2, lse2 = run(split)
    assert split.library_workspace_bytes() == 0 and kattn.own_workspace_bytes() == 0
    o1, lse1 = run(CudaOps())
    for o, lse in ((o1, lse1), (o2, lse2)):
        assert _rel(o, want_o) < 1e-2
        np.testing.assert_allclose(lse, want_lse, rtol=1e-3, atol=1e-3)
    assert _rel(o2, o1) < 1e-2
    assert np.array_equal(o2[:t].view(np.uint16), o1[:t].view(np.uint16))  # chunk 0: one call
