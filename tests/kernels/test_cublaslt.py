"""kernels/cuda/_cublaslt.py: the size buckets (CPU) and its GEMM loop on the GPU against float64
on fresh random inputs (sizes that change every call, both transposes, bf16 and fp32 outputs,
accumulation, pointers aligned to only 2 or 4 bytes), plus its bits repeating for one bucket.
Tolerance as tests/kernels/test_cuda_ops.py (STYLE §7): the GPU's relative error against the
float64 product of the stored inputs at most twice that of the product rounded once to the
output dtype, never below an fp32 floor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.gpu import cuda_context

try:
    import cupy

    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, or CuPy built for another CUDA
    cupy = None
    HAVE_GPU = False

needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")
CTX = cuda_context() if HAVE_GPU else None
"""The CudaContext every GEMM loop of this module launches through."""

BF16, F32, F64 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64)


def _bucket_fn():
    """_cublaslt.bucket, loaded from its file alone: the package's __init__ needs CuPy, the
    module itself imports it only where it calls it."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "cuda" / "_cublaslt.py"
    spec = importlib.util.spec_from_file_location("_cublaslt_alone", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.bucket


def test_buckets_cover_their_sizes_within_a_quarter_four_to_an_octave():
    bucket = _bucket_fn()

    sizes = range(1, 70_000)
    b = [bucket(x) for x in sizes]
    assert all(y >= x for x, y in zip(sizes, b))
    assert all(y <= max(16, 1.25 * x) for x, y in zip(sizes, b))
    assert b == sorted(b)
    assert [bucket(x) for x in (1, 16, 17, 32, 33, 1024, 1025, 1280, 1281, 2048, 2049)] == \
        [16, 16, 20, 32, 40, 1024, 1280, 1280, 1536, 2048, 2560]
    octave = {bucket(x) for x in range(1025, 2049)}
    assert sorted(octave) == [1280, 1536, 1792, 2048]


def _stored(rng, shape, dtype):
    return rng.standard_normal(shape).astype(F32).astype(dtype)


def _dev(a, extra_elems=0):
    """a on the device, starting `extra_elems` elements into its buffer (misaligned pointers)."""
    flat = np.ascontiguousarray(a).reshape(-1)
    raw = np.zeros(flat.size + extra_elems, dtype=a.dtype)
    raw[extra_elems:] = flat
    if a.dtype == BF16:
        d = cupy.asarray(raw.view(np.uint16)).view(BF16)
    else:
        d = cupy.asarray(raw)
    return d, d.data.ptr + extra_elems * a.dtype.itemsize


def _host(d, n, extra, dtype):
    if dtype == BF16:
        return cupy.asnumpy(d.view(cupy.uint16)).view(BF16)[extra:extra + n]
    return cupy.asnumpy(d)[extra:extra + n]


def _rel(got, want):
    return float(np.linalg.norm(got.astype(F64) - want) / max(np.linalg.norm(want), 1e-300))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ab, c", [(BF16, BF16), (BF16, F32), (F32, F32)],
                         ids=["bf16", "bf16-f32out", "f32"])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("misalign", [0, 1], ids=["aligned", "misaligned"])
def test_gemm_loop_matches_float64_over_changing_sizes(rng, ab, c, trans_a, trans_b, misalign):
    from dataflow.kernels.cuda._cublaslt import gemm_loop

    launch = gemm_loop(CTX, ab, c)
    # Sizes change every call, as the experts' row counts do, and cross bucket edges.
    for m, n, k in [(1, 48, 64), (7, 40, 72), (300, 64, 136), (17, 200, 8), (1025, 96, 64),
                    (130, 64, 1000)]:
        a_store = _stored(rng, (k, m) if trans_a else (m, k), ab)
        b_store = _stored(rng, (n, k) if trans_b else (k, n), ab)
        c0 = _stored(rng, (m, n), c)
        a_op = a_store.astype(F64).T if trans_a else a_store.astype(F64)
        b_op = b_store.astype(F64).T if trans_b else b_store.astype(F64)
        for accumulate in (False, True):
            truth = a_op @ b_op + (c0.astype(F64) if accumulate else 0.0)
            da, pa = _dev(a_store, misalign)
            db, pb = _dev(b_store, misalign)
            dc, pc = _dev(c0, misalign)
            launch(m, n, k, pa, a_store.shape[1], trans_a, pb, b_store.shape[1], trans_b, pc, n,
                   accumulate)
            got = _host(dc, m * n, misalign, c).reshape(m, n)
            once = truth.astype(c)  # the product rounded once to the output dtype
            bound = max(2 * _rel(once, truth), 1e-5)
            if accumulate and c != F32:
                # Some algorithms round the product to C's dtype before adding C (on H200:
                # (1, 48, 64) at 2.3x once's error, 48 elements, call A of s22): twice rounded.
                twice = ((a_op @ b_op).astype(c).astype(F64) + c0.astype(F64)).astype(c)
                bound = max(bound, 2 * _rel(twice, truth))
            err = _rel(got, truth)
            assert err <= bound, (f"({m}, {n}, {k}) trans {trans_a, trans_b} acc {accumulate}: "
                                  f"rel err {err:.3g} > {bound:.3g}")
            if misalign:
                head = _host(dc, misalign, 0, c)
                assert not np.any(head.astype(F32)), "wrote before C"


@pytest.mark.gpu
@needs_gpu
def test_gemm_loop_repeats_its_bits_for_sizes_of_one_bucket(rng):
    """The algorithm is the bucket's: the same sizes give the same bits, and a size of the same
    bucket run between them does not change that."""
    from dataflow.kernels.cuda._cublaslt import bucket, gemm_loop

    launch = gemm_loop(CTX, BF16, BF16)
    k, n = 256, 128
    assert bucket(1100) == bucket(1200)
    a, b = _stored(rng, (1200, k), BF16), _stored(rng, (k, n), BF16)
    da, pa = _dev(a)
    db, pb = _dev(b)
    outs = []
    for m in (1100, 1200, 1100):
        dc = cupy.zeros((m, n), dtype=cupy.uint16).view(BF16)
        launch(m, n, k, pa, k, False, pb, n, False, dc.data.ptr, n, False)
        outs.append(cupy.asnumpy(dc.view(cupy.uint16)))
    assert np.array_equal(outs[0], outs[2])


@pytest.mark.gpu
@needs_gpu
def test_a_released_table_takes_its_workspace_back_from_the_cublas_handle():
    """The handle outlives the arena its workspace lies in: CudaOps.release_scratch (the CuPy
    backend's close) takes the workspace back, unless another table of the same CudaContext
    lent one since. Before this, a GEMM after an Engine closed wrote into its freed arena (an
    illegal address)."""
    import dataflow.kernels.cuda as K
    from dataflow.ops_cuda import CudaOps

    ctx = cuda_context()
    first, second = CudaOps(ctx), CudaOps(ctx)
    ws1, ws2 = cupy.empty(1 << 20, cupy.uint8), cupy.empty(1 << 20, cupy.uint8)
    first.lend_scratch({"cublas_workspace": ws1})
    assert K.cublas_workspace(ctx) == (ws1.data.ptr, ws1.nbytes)
    second.lend_scratch({"cublas_workspace": ws2})
    first.release_scratch()
    assert K.cublas_workspace(ctx) == (ws2.data.ptr, ws2.nbytes)
    second.release_scratch()
    assert K.cublas_workspace(ctx) == (0, 0)
    ctx.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shared", ["a", "b"])
def test_a_strided_batch_of_two_is_the_two_products(rng, shared):
    """batch = (2, stride A, stride B, stride C): one operand shared (stride 0, as the experts'
    x forward and backward), the other two a stride apart; against float64, and against two
    unbatched calls of the same loop within the same bound."""
    from dataflow.kernels.cuda._cublaslt import gemm_loop

    launch = gemm_loop(CTX, BF16, F32)
    m, n, k = 300, 96, 136
    a_all = _stored(rng, (1 if shared == "a" else 2, m, k), BF16)
    b_all = _stored(rng, (1 if shared == "b" else 2, k, n), BF16)
    c0 = _stored(rng, (2, m, n), F32)
    da, pa = _dev(a_all)
    db, pb = _dev(b_all)
    dc, pc = _dev(c0)
    batch = (2, 0 if shared == "a" else m * k, 0 if shared == "b" else k * n, m * n)
    launch(m, n, k, pa, k, False, pb, n, False, pc, n, True, batch)
    got = _host(dc, 2 * m * n, 0, F32).reshape(2, m, n)
    for i in range(2):
        truth = (a_all[min(i, len(a_all) - 1)].astype(F64) @ b_all[min(i, len(b_all) - 1)]
                 .astype(F64) + c0[i].astype(F64))
        bound = max(2 * _rel(truth.astype(F32), truth), 1e-5)
        assert _rel(got[i], truth) <= bound, i


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ab, c", [(BF16, BF16), (F32, F32)], ids=["bf16", "f32"])
def test_grouped_gemm_matches_float64_per_problem(rng, ab, c):
    """kernels/cuda/grouped_gemm: one cuBLAS call over problems of different sizes, both
    transposes and accumulation mixed (the experts' three GEMM kinds), each problem within the
    same bound as the loop above; an empty problem and a bf16-to-fp32 call are refused."""
    from dataflow.kernels.cuda import grouped_gemm as G

    if not G.available(CTX):
        pytest.skip("this cuBLAS has no cublasGemmGroupedBatchedEx (cuBLAS < 12.5)")
    shapes = [(1, 48, 64, False, True, False), (300, 64, 136, False, False, False),
              (64, 40, 7, True, False, True), (1025, 96, 64, False, True, True),
              (17, 200, 8, True, False, False)]
    problems, checks = [], []
    for m, n, k, trans_a, trans_b, accumulate in shapes:
        a_store = _stored(rng, (k, m) if trans_a else (m, k), ab)
        b_store = _stored(rng, (n, k) if trans_b else (k, n), ab)
        c0 = _stored(rng, (m, n), c)
        a_op = a_store.astype(F64).T if trans_a else a_store.astype(F64)
        b_op = b_store.astype(F64).T if trans_b else b_store.astype(F64)
        truth = a_op @ b_op + (c0.astype(F64) if accumulate else 0.0)
        (da, pa), (db, pb), (dc, pc) = _dev(a_store), _dev(b_store), _dev(c0)
        problems.append((m, n, k, pa, a_store.shape[1], trans_a, pb, b_store.shape[1], trans_b,
                         pc, n, accumulate))
        checks.append((m, n, k, accumulate, truth, (da, db, dc), a_op, b_op, c0))
    G.launch(CTX, G.prepare(problems, ab, c))
    cupy.cuda.get_current_stream().synchronize()
    for m, n, k, accumulate, truth, (da, db, dc), a_op, b_op, c0 in checks:
        got = _host(dc, m * n, 0, c).reshape(m, n)
        bound = max(2 * _rel(truth.astype(c), truth), 1e-5)
        if accumulate and c != F32:  # product rounded to C's dtype before the add: see above
            twice = ((a_op @ b_op).astype(c).astype(F64) + c0.astype(F64)).astype(c)
            bound = max(bound, 2 * _rel(twice, truth))
        err = _rel(got, truth)
        assert err <= bound, f"({m}, {n}, {k}) acc {accumulate}: rel err {err:.3g} > {bound:.3g}"
    with pytest.raises(ValueError, match="m, n, k >= 1"):
        G.prepare([(0, 8, 8, *problems[0][3:])], ab, c)
    with pytest.raises(TypeError, match="one dtype"):  # NOT_SUPPORTED on cuBLAS 13.0 (s36)
        G.prepare(problems, BF16, F32)
