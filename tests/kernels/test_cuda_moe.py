"""The CUDA mixture-of-experts ops (kernels/cuda/moe_router.py, kernels/cuda/moe_experts.py)
against their NumPy references (kernels/reference/moe_router.py, moe_experts.py, moe.py) on
fresh random inputs, plus CPU checks of the facts the GPU tests' exact comparisons rest on.

What is compared how:
- Exact (array_equal on the bits): everything that only moves or counts (topk indices given the
  probabilities, expert_order's order / offsets / inv, permute_fwd, counts) and the sums the
  kernels add in the reference's own fp32 order (permute_bwd with and without the fp32
  residual, unpermute_fwd, unpermute_bwd's dyp, load_balancing_stats' prob_sum). NumPy adds
  along a non-contiguous axis one slice after another; test_reference_slot_and_token_sums_are_
  sequential_fp32_adds checks that on the CPU, so a NumPy that changed it fails there first.
- Tolerance (STYLE §7, as tests/kernels/test_cuda_ops.py): the truth is the reference run in
  float64 on the same stored inputs; the "bf16 reference" is the reference on the stored inputs
  in its fp32 arithmetic. The GPU's relative error (norm-wise) against the truth may be at most
  twice the bf16 reference's, and never has to beat FP32_FLOOR (fp32 sums taken in another
  order: cuBLAS tiles, warp trees, CUDA's expf against NumPy's exp).
- Routing is discontinuous: GPU and NumPy logits differ by fp32 rounding, so a token whose k-th
  and (k+1)-th probabilities are within that rounding may be routed differently. The tests
  check the GPU's choice against the tie rule on the GPU's own probabilities (exact), and
  against the reference's choice only up to such near-ties (TIE_REL); exact ties are built from
  logits that are exact in any summation order.
Outputs are poisoned with NaN first, so an unwritten element fails. GPU tests carry the `gpu`
mark and skip without CuPy or a device; the CPU tests run everywhere. Inputs come from the
shared `rng` fixture (tests/conftest.py: fresh seed per test, printed, replayable).
"""

from __future__ import annotations

import ast
import math
import pathlib
import re

import numpy as np
import pytest

from dataflow.kernels.reference import moe as rmoe
from dataflow.kernels.reference import moe_experts as rexp
from dataflow.kernels.reference import moe_router as rrt
from tests.gpu import (BF16, F32, I64, bf, check_close, cuda_context, dev, f64,
                       host, poisoned, rel, same_bits)

try:
    import cupy

    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - no CuPy, no driver, or CuPy built for another CUDA
    cupy = None
    HAVE_GPU = False

if HAVE_GPU:
    from dataflow.kernels.cuda import moe_experts as kexp
    from dataflow.kernels.cuda import moe_router as krt
CTX = cuda_context() if HAVE_GPU else None
"""The CudaContext every kernel call of this module launches through."""

needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCALAR_REL = 1e-6
"""The losses are summed in fp64 on both sides and rounded once to fp32 on the GPU: 2^-24."""
TIE_REL = 1e-5
"""Probabilities closer than this (relative) are a near-tie the two sides may order apart."""


# ------------------------------------------------------------------------------------ helpers

def routed_idx(rng, t: int, n: int, k: int, idle=()) -> np.ndarray:
    """(t, k) int64: k distinct experts per token, none from `idle`, in random order."""
    allowed = np.array([e for e in range(n) if e not in set(idle)])
    pick = np.argsort(rng.random((t, allowed.size)), axis=1)[:, :k]
    return allowed[pick].astype(np.int64)


def assert_choice_is_reference_up_to_near_ties(idx_gpu, idx_ref, probs_ref) -> None:
    """Slot by slot, the reference probability of the GPU's choice equals the reference's own
    top-k probability within TIE_REL: equal choices, or choices swapped at a near-tie."""
    p_gpu = np.take_along_axis(probs_ref, idx_gpu, axis=1)
    p_ref = np.take_along_axis(probs_ref, idx_ref, axis=1)
    np.testing.assert_allclose(p_gpu, p_ref, rtol=TIE_REL, atol=0)


# ------------------------------------------------------------------------------ CPU checks

def _launcher_names(py: str) -> tuple[str, ...]:
    """A launcher's _NAMES, evaluated from its source with only the module constants it uses
    (CuPy is not importable on the CPU machine)."""
    tree = ast.parse((ROOT / "kernels" / "cuda" / py).read_text())
    ns: dict = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("_TYPES", "_NAMES")
                                                for t in node.targets):
            exec(compile(ast.Module(body=[node], type_ignores=[]), py, "exec"), ns)  # noqa: S102
    return tuple(ns["_NAMES"])


@pytest.mark.parametrize("py, cu", [("moe_router.py", "moe_router.cu"),
                                    ("moe_experts.py", "moe_experts.cu"),
                                    ("moe_grouped.py", "moe_grouped.cu")])
def test_moe_launchers_name_only_kernels_their_source_defines(py, cu):
    """Every instantiation a launcher hands NVRTC is a __global__ of its .cu, a template exactly
    when its name has arguments: a typo otherwise shows only on a GPU, at compile time."""
    src = (ROOT / "kernels" / "cuda" / cu).read_text()
    names = _launcher_names(py)
    assert names
    for name in names:
        base = name.split("<")[0]
        m = re.search(r"(template\s*<[^>]*>\s*)?__global__\s+void\s+"
                      r"(?:__launch_bounds__\([^)]*\)\s*)?" + re.escape(base) + r"\s*\(", src)
        assert m, f"{name} of {py} is not a __global__ in {cu}"
        assert bool(m.group(1)) == ("<" in name), f"{name}: template-ness differs from {cu}"


def test_reference_slot_and_token_sums_are_sequential_fp32_adds(rng):
    """The reference's slot sums (permute_bwd, unpermute_fwd) and token sums (prob_sum) equal
    plain fp32 adds in slot / token order: the order the CUDA kernels add in, which is what makes
    the GPU tests' bit-exact comparisons valid."""
    t, k, d, n = 257, 8, 40, 24
    idx = routed_idx(rng, t, n, k)
    order, _ = rexp.expert_order(idx, n)
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    rows = (rng.standard_normal((t * k, d)) * np.exp(2 * rng.standard_normal((t * k, d))))
    rows = rows.astype(F32)
    w = rng.random((t, k)).astype(F32)
    acc = rows[inv[0::k]].copy()
    comb = w[:, 0:1] * rows[inv[0::k]]
    for j in range(1, k):
        acc = acc + rows[inv[j::k]]
        comb = comb + w[:, j:j + 1] * rows[inv[j::k]]
    assert same_bits(rexp.permute_bwd(rows, order, k), acc)
    assert same_bits(rexp.unpermute_fwd(rows, order, w), comb)
    probs = rng.random((t, n)).astype(F32)
    s = np.zeros(n, F32)
    for row in probs:
        s = s + row
    assert same_bits(rrt.load_balancing_stats(probs, idx)[1], s)


def test_cuda_moe_modules_need_no_registration_to_be_found_by_precompile():
    """Both launchers follow the _SRC / _NAMES convention, so _build.kernel_sources (and thus
    precompile and the pinning test) finds them without any op-table entry."""
    for py, cu in (("moe_router.py", "moe_router.cu"), ("moe_experts.py", "moe_experts.cu"),
                   ("moe_grouped.py", "moe_grouped.cu")):
        tree = ast.parse((ROOT / "kernels" / "cuda" / py).read_text())
        srcs = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", "") == "_SRC" for t in node.targets)]
        assert srcs == [cu]


# ---------------------------------------------------------------------------------- router

ROUTER_CASES = [  # (T, N, k, D)
    (300, 64, 8, 256),    # OLMoE's N and k
    (77, 200, 6, 136),    # N not a multiple of 32, D not of 64
    (64, 8, 2, 128),      # fewer experts than lanes
    (33, 256, 8, 64),     # the most experts the row kernels hold
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("norm", [False, True], ids=["olmoe", "qwen3"])
@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: "T{}-N{}-k{}-D{}".format(*c))
def test_router_fwd_cuda_matches_reference_on_random_bf16(rng, case, norm):
    """logits and probs within the bf16 rule; topk_idx is exactly the tie rule applied to the
    GPU's probs and the reference's choice up to near-ties; weights are the chosen probs
    (exactly, or renormalised to fp32 rounding)."""
    t, n, k, d = case
    x = bf(rng.standard_normal((t, d)) * rng.uniform(0.5, 2.0, (t, 1)))
    wr = bf(rng.standard_normal((n, d)) / math.sqrt(d))
    lg_t, p_t, _, _ = rrt.router_fwd(f64(x), f64(wr), k, norm_topk_prob=norm)
    lg_r, p_r, idx_r, _ = rrt.router_fwd(x, wr, k, norm_topk_prob=norm)
    logits, probs = poisoned((t, n), F32), poisoned((t, n), F32)
    idx, w = poisoned((t, k), I64), poisoned((t, k), F32)
    krt.router_fwd(CTX, dev(x), dev(wr), k, logits, probs, idx, w, norm_topk_prob=norm)
    check_close("router logits", host(logits), lg_t, lg_r)
    check_close("router probs", host(probs), p_t, p_r)
    p_gpu, idx_gpu, w_gpu = host(probs), host(idx), host(w)
    assert same_bits(idx_gpu, rrt.router_topk(p_gpu, k))
    assert_choice_is_reference_up_to_near_ties(idx_gpu, idx_r, p_r)
    chosen = np.take_along_axis(p_gpu, idx_gpu, axis=1)
    if norm:
        want = chosen / chosen.sum(axis=1, keepdims=True)
        assert rel(w_gpu, want) <= 1e-6  # a k-term fp32 sum and a division: a few ulps
        assert np.allclose(w_gpu.sum(axis=1), 1.0, rtol=1e-5)
    else:
        assert same_bits(w_gpu, chosen)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("norm", [False, True], ids=["olmoe", "qwen3"])
def test_router_topk_cuda_orders_exact_ties_by_lower_expert_first(rng, norm):
    """Logits that are exact in any summation order (x @ I with x on a coarse grid) have many
    exactly equal probabilities, including across the k-th place and whole constant rows (a
    zero-initialised router): the GPU picks exactly the reference's experts in its order."""
    t, n, k = 200, 48, 6
    x = bf(rng.integers(-2, 3, size=(t, n)) * 0.5)      # values in {-1, -0.5, 0, 0.5, 1}
    x[:5] = bf(np.full((5, n), 0.75))                   # constant rows: every expert ties
    eye = bf(np.eye(n))
    lg_r, p_r, idx_r, w_r = rrt.router_fwd(x, eye, k, norm_topk_prob=norm)
    assert np.array_equal(lg_r, x.astype(F32))          # the premise: exact logits
    logits, probs = poisoned((t, n), F32), poisoned((t, n), F32)
    idx, w = poisoned((t, k), I64), poisoned((t, k), F32)
    krt.router_fwd(CTX, dev(x), dev(eye), k, logits, probs, idx, w, norm_topk_prob=norm)
    assert same_bits(host(logits), lg_r)
    got = host(idx)
    assert same_bits(got, idx_r)
    assert np.array_equal(got[:5], np.tile(np.arange(k), (5, 1)))
    assert rel(host(w), w_r) <= 1e-6
    # equal logits give equal probabilities on the GPU too, so the tie rule decided
    p_gpu = host(probs)
    assert same_bits(got, rrt.router_topk(p_gpu, k))
    assert np.all(p_gpu[:5] == p_gpu[0, 0])


@pytest.mark.gpu
@needs_gpu
def test_load_balancing_and_z_loss_cuda_match_reference(rng):
    """counts (exact), prob_sum (exact: summed in token order), both accumulated over two
    chunks; the load-balancing loss and z-loss as device scalars; lse per row."""
    n, k = 64, 8
    chunks = []
    for t in (300, 129):
        x = bf(rng.standard_normal((t, 96)) * 2.0)
        wr = bf(rng.standard_normal((n, 96)) / math.sqrt(96))
        logits, probs, idx, _ = rrt.router_fwd(x, wr, k, norm_topk_prob=False)
        chunks.append((logits, probs, idx))
    counts, prob_sum = poisoned((n,), I64), poisoned((n,), F32)
    want_c, want_p = np.zeros(n, I64), np.zeros(n, F32)
    for i, (_, probs, idx) in enumerate(chunks):
        krt.load_balancing_stats(CTX, dev(probs), dev(idx), counts, prob_sum, accumulate=i > 0)
        c, p = rrt.load_balancing_stats(probs, idx)
        want_c, want_p = want_c + c, want_p + p
        if i == 0:
            assert same_bits(host(counts), c) and same_bits(host(prob_sum), p)
    assert same_bits(host(counts), want_c)
    assert same_bits(host(prob_sum), want_p)
    n_rows = sum(c[0].shape[0] for c in chunks)
    loss = poisoned((1,), F32)
    krt.load_balancing_loss(CTX, counts, prob_sum, n_rows, loss)
    want = rrt.load_balancing_loss(want_c, want_p, n_rows)
    assert abs(float(host(loss)[0]) - want) <= SCALAR_REL * abs(want)
    krt.load_balancing_loss(CTX, counts, prob_sum, n_rows, loss, accumulate=True)
    assert abs(float(host(loss)[0]) - 2 * want) <= SCALAR_REL * abs(2 * want)

    z = poisoned((1,), F32)
    want_z = 0.0
    for i, (logits, _, _) in enumerate(chunks):
        lse = poisoned((logits.shape[0],), F32)
        krt.router_z_loss(CTX, dev(logits), n_rows, lse, z, accumulate=i > 0)
        zi, lse_r = rrt.router_z_loss(logits, n_rows)
        _, lse_t = rrt.router_z_loss(f64(logits), n_rows)
        check_close("router_z_loss lse", host(lse), lse_t, lse_r)
        want_z += zi
    assert abs(float(host(z)[0]) - want_z) <= SCALAR_REL * abs(want_z)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("norm", [False, True], ids=["olmoe", "qwen3"])
def test_router_backward_cuda_matches_reference(rng, norm):
    """d_logits from the selected weights, plus the load-balancing and z-loss terms added in the
    block's order; then dx (fp32) and dw_router (accumulated into fp32) over more tokens than
    one fp32 pass of router_bwd holds."""
    t, n, k, d = krt.BWD_ROWS + 300, 64, 8, 192
    x = bf(rng.standard_normal((t, d)))
    wr = bf(rng.standard_normal((n, d)) / math.sqrt(d))
    logits, probs, idx, _ = rrt.router_fwd(x, wr, k, norm_topk_prob=norm)
    d_w = (rng.standard_normal((t, k)) * 0.1).astype(F32)
    counts = rng.integers(1, 3 * t, size=n).astype(I64)     # the forward's, several layers
    aux_rows, aux_coef, z_rows, z_coef = 3 * t, 0.01, t, 1e-3
    _, lse = rrt.router_z_loss(logits, z_rows)

    def dlogits(p, lg, ls, dw):
        terms = (rrt.router_logits_bwd(p, idx, dw, norm_topk_prob=norm),
                 rrt.load_balancing_loss_bwd(p, counts, aux_rows, aux_coef),
                 rrt.router_z_loss_bwd(lg, ls, z_rows, z_coef))
        return terms, terms[0] + terms[1] + terms[2]

    terms_t, dl_t = dlogits(f64(probs), f64(logits), f64(lse), f64(d_w))
    terms_r, dl_r = dlogits(probs, logits, lse, d_w)
    # each term on its own, then the sum as the block forms it
    dl = poisoned((t, n), F32)
    for i, name in enumerate(("topk", "aux", "z")):
        if name == "topk":
            krt.router_logits_bwd(CTX, dev(probs), dev(idx), dev(d_w), dl, norm_topk_prob=norm)
        elif name == "aux":
            krt.load_balancing_loss_bwd(CTX, dev(probs), dev(counts), aux_rows, aux_coef, dl)
        else:
            krt.router_z_loss_bwd(CTX, dev(logits), dev(lse), z_rows, z_coef, dl)
        check_close(f"d_logits {name}", host(dl), terms_t[i], terms_r[i])
    dl = poisoned((t, n), F32)
    krt.router_logits_bwd(CTX, dev(probs), dev(idx), dev(d_w), dl, norm_topk_prob=norm)
    krt.load_balancing_loss_bwd(CTX, dev(probs), dev(counts), aux_rows, aux_coef, dl,
                                accumulate=True)
    krt.router_z_loss_bwd(CTX, dev(logits), dev(lse), z_rows, z_coef, dl, accumulate=True)
    check_close("d_logits sum", host(dl), dl_t, dl_r)

    dx_t, dw_t = rrt.router_bwd(f64(x), f64(wr), dl_t)
    dx_r, dw_r = rrt.router_bwd(x, wr, dl_r)
    dw0 = rng.standard_normal((n, d)).astype(F32)
    dx, dw = poisoned((t, d), F32), dev(dw0)
    krt.router_bwd(CTX, dev(x), dev(wr), dev(dl_r), dx, dw)
    check_close("router_bwd dx", host(dx), dx_t, dx_r)
    check_close("router_bwd dw +=", host(dw), f64(dw0) + dw_t, dw0 + dw_r)
    dx0 = rng.standard_normal((t, d)).astype(F32)
    dx, dw = dev(dx0), poisoned((n, d), F32)
    krt.router_bwd(CTX, dev(x), dev(wr), dev(dl_r), dx, dw, accumulate_dx=True, accumulate_dw=False)
    check_close("router_bwd dx +=", host(dx), f64(dx0) + dx_t, dx0 + dx_r)
    check_close("router_bwd dw =", host(dw), dw_t, dw_r)


# ----------------------------------------------------------------------------- permutation

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("t, n, k, idle", [(333, 16, 4, (0, 5, 15)), (1000, 64, 8, ()),
                                           (7, 8, 8, ())],
                         ids=["idle-experts", "olmoe-shape", "k-equals-n"])
def test_expert_order_cuda_is_the_reference_stable_sort(rng, t, n, k, idle):
    """order, offsets and inv equal the reference's exactly (several placement passes at
    R = 8000; idle experts get empty ranges); inverse_order rebuilds inv from order."""
    idx = routed_idx(rng, t, n, k, idle)
    order_r, offsets_r = rexp.expert_order(idx, n)
    inv_r = np.empty_like(order_r)
    inv_r[order_r] = np.arange(order_r.size)
    order, offsets, inv = poisoned((t * k,), I64), poisoned((n + 1,), I64), poisoned((t * k,), I64)
    kexp.expert_order(CTX, dev(idx), n, order, offsets, inv)
    assert same_bits(host(order), order_r)
    assert same_bits(host(offsets), offsets_r)
    assert same_bits(host(inv), inv_r)
    for e in idle:
        assert offsets_r[e] == offsets_r[e + 1]
    inv2 = poisoned((t * k,), I64)
    kexp.inverse_order(CTX, order, inv2)
    assert same_bits(host(inv2), inv_r)
    off_h = np.empty(n + 1, I64)
    kexp.offsets_to_host(CTX, offsets, off_h).synchronize()
    assert same_bits(off_h, offsets_r)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("where", ["host_alloc", "registered"])
def test_offsets_reach_the_host_through_the_mapping_as_through_a_copy(rng, where):
    """offsets_to_host with `mapped` (a kernel storing through the device's mapping, no copy
    engine) writes the same values as its memcpy, into cudaHostAlloc'd memory and into a view in
    the middle of a cudaHostRegister'd range (the engine's host arena); pageable memory has no
    mapping (None: the caller copies)."""
    import cupyx

    from dataflow.backends.cupy_backend import _HOST_REGISTER_PORTABLE, MappedHostMemory

    n = int(rng.integers(60, 130))
    offsets = dev(np.cumsum(np.concatenate([[0], rng.integers(0, 500, n)])).astype(I64))
    assert kexp.mapped_address(np.empty(n + 1, I64)) is None
    if where == "host_alloc":
        out = cupyx.empty_pinned((n + 1,), I64)
    else:
        mem = MappedHostMemory(1 << 20, lambda p, m: cupy.cuda.runtime.hostRegister(
            p, m, _HOST_REGISTER_PORTABLE), cupy.cuda.runtime.hostUnregister)
        out = np.asarray(mem)[4096 + 8:4096 + 8 + 8 * (n + 1)].view(I64)
    out[:] = -7
    mapped = kexp.mapped_address(out)
    assert mapped is not None
    kexp.offsets_to_host(CTX, offsets, out, mapped=mapped).synchronize()
    assert same_bits(out, host(offsets))
    copied = cupyx.empty_pinned((n + 1,), I64)
    kexp.offsets_to_host(CTX, offsets, copied).synchronize()
    assert same_bits(copied, out)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [256, 100], ids=["vector", "scalar"])
def test_permute_and_unpermute_cuda_are_the_reference_bits(rng, d):
    """permute_fwd (a gather), permute_bwd (fp32 out; bf16 out with the router's fp32 dx as
    residual), unpermute_fwd and unpermute_bwd's dyp are bit-identical to the reference;
    unpermute_bwd's d_topk_weight (a length-D dot product) is within the fp32 rule."""
    t, n, k = 130, 16, 4
    idx = routed_idx(rng, t, n, k, idle=(3,))
    order_r, _ = rexp.expert_order(idx, n)
    order, offsets, inv = poisoned((t * k,), I64), poisoned((n + 1,), I64), poisoned((t * k,), I64)
    kexp.expert_order(CTX, dev(idx), n, order, offsets, inv)
    x = bf(rng.standard_normal((t, d)))
    xp = poisoned((t * k, d), BF16)
    kexp.permute_fwd(CTX, dev(x), order, k, xp)
    assert same_bits(host(xp), rexp.permute_fwd(x, order_r, k))

    dxp = bf(rng.standard_normal((t * k, d)))
    dx = poisoned((t, d), F32)
    kexp.permute_bwd(CTX, dev(dxp), inv, k, dx)
    assert same_bits(host(dx), rexp.permute_bwd(dxp, order_r, k))
    resid = rng.standard_normal((t, d)).astype(F32)
    dx = poisoned((t, d), BF16)
    kexp.permute_bwd(CTX, dev(dxp), inv, k, dx, residual=dev(resid))
    assert same_bits(host(dx), (resid + rexp.permute_bwd(dxp, order_r, k)).astype(BF16))

    yp = bf(rng.standard_normal((t * k, d)))
    w = rng.random((t, k)).astype(F32)
    y = poisoned((t, d), BF16)
    kexp.unpermute_fwd(CTX, dev(yp), inv, dev(w), y)
    assert same_bits(host(y), rexp.unpermute_fwd(yp, order_r, w))

    dy = bf(rng.standard_normal((t, d)))
    dyp_r, dw_r = rexp.unpermute_bwd(dy, yp, order_r, w)
    _, dw_t = rexp.unpermute_bwd(f64(dy), f64(yp), order_r, f64(w))
    dyp, d_w = poisoned((t * k, d), BF16), poisoned((t, k), F32)
    kexp.unpermute_bwd(CTX, dev(dy), dev(yp), order, dev(w), dyp, d_w)
    assert same_bits(host(dyp), dyp_r)
    check_close("unpermute_bwd d_topk_weight", host(d_w), dw_t, dw_r)


# ------------------------------------------------------------------------------- experts

def _expert_weights(rng, n, f, d):
    def mat(o, i):
        return bf(rng.standard_normal((n, o, i)) / math.sqrt(i))
    return mat(f, d), mat(f, d), mat(d, f)


def _as_device(w: np.ndarray, stacked: bool, idle):
    """A stacked device array, or a list of per-expert device matrices with None for idle
    experts (proving the op reads none of their weights)."""
    if stacked:
        return dev(w)
    return [None if e in idle else dev(w[e]) for e in range(w.shape[0])]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-expert-list"])
@pytest.mark.parametrize("t, n, k, d, f, idle",
                         [(96, 8, 2, 128, 96, (2, 6)), (150, 16, 4, 72, 40, (0, 1, 15))],
                         ids=["aligned", "ragged"])
@pytest.mark.parametrize("grad_dtype", [F32, BF16], ids=["f32-grads", "bf16-grads"])
def test_experts_cuda_match_reference_and_leave_idle_experts_untouched(
        rng, t, n, k, d, f, idle, stacked, grad_dtype):
    """experts_fwd (yp, gate, up) and experts_bwd (dxp, and dW accumulated into existing grads)
    within the bf16 rule; experts without rows launch nothing: their grads keep their bits and
    their weights may be absent (None)."""
    idx = routed_idx(rng, t, n, k, idle)
    order, offsets = rexp.expert_order(idx, n)
    wg, wu, wd = _expert_weights(rng, n, f, d)
    x = bf(rng.standard_normal((t, d)))
    xp = rexp.permute_fwd(x, order, k)
    r = t * k
    yp_t, gate_t, up_t = rexp.experts_fwd(f64(xp), offsets, f64(wg), f64(wu), f64(wd))
    yp_r, gate_r, up_r = rexp.experts_fwd(xp, offsets, wg, wu, wd)
    yp, gate, up, h = (poisoned(s, BF16) for s in ((r, d), (r, f), (r, f), (r, f)))
    dwg, dwu, dwd = (_as_device(w, stacked, idle) for w in (wg, wu, wd))
    kexp.experts_fwd(CTX, dev(xp), offsets, dwg, dwu, dwd, yp, gate, up, h=h)
    check_close("experts_fwd gate", host(gate), gate_t, gate_r)
    check_close("experts_fwd up", host(up), up_t, up_r)
    check_close("experts_fwd yp", host(yp), yp_t, yp_r)

    dyp = bf(rng.standard_normal((r, d)))
    # the backward gets the same saved gate/up on every path, so it is judged on its own
    dxp_t, gg_t, gu_t, gd_t = rexp.experts_bwd(f64(xp), offsets, f64(wg), f64(wu), f64(wd),
                                               f64(gate_r), f64(up_r), f64(dyp))
    dxp_r, gg_r, gu_r, gd_r = rexp.experts_bwd(xp, offsets, wg, wu, wd, gate_r, up_r, dyp)
    g0 = [(rng.standard_normal(s.shape)).astype(F32).astype(grad_dtype)
          for s in (gg_r, gu_r, gd_r)]
    grads = [dev(a) if stacked else [dev(a[e]) for e in range(n)] for a in g0]
    dxp = poisoned((r, d), BF16)
    scratch = dict(dgate=poisoned((r, f), BF16), dup=poisoned((r, f), BF16),
                   h=poisoned((r, f), BF16),
                   dx_acc=poisoned((kexp.experts_bwd_acc_elems(offsets, d),), F32))
    kexp.experts_bwd(CTX, dev(xp), offsets, dwg, dwu, dwd, dev(gate_r), dev(up_r), dev(dyp), dxp,
                     *grads, **scratch)
    check_close("experts_bwd dxp", host(dxp), dxp_t, dxp_r)
    active = [e for e in range(n) if e not in idle]
    for name, g, a0, truth, ref in (("dw_gate", grads[0], g0[0], gg_t, gg_r),
                                    ("dw_up", grads[1], g0[1], gu_t, gu_r),
                                    ("dw_down", grads[2], g0[2], gd_t, gd_r)):
        got = host(g) if stacked else np.stack([host(m) for m in g])
        for e in idle:
            assert same_bits(got[e], a0[e]), f"{name}[{e}] of an idle expert changed"
        want = (a0.astype(F32) + ref).astype(grad_dtype)
        check_close(f"experts_bwd {name} += {grad_dtype}", got[active],
                    f64(a0)[active] + truth[active], want[active])


@pytest.mark.gpu
@needs_gpu
def test_experts_bwd_rounds_the_same_bits_whatever_its_dx_acc_holds(rng):
    """experts_bwd rounds the input gradient of as many consecutive experts as dx_acc holds with
    one cast: dx_acc of the largest expert's rows (a cast every expert or two) and of every row
    (one cast) give the same dxp bits, and both the reference's within the bf16 rule."""
    t, n, k, d, f = 200, 8, 2, 64, 48
    idx = routed_idx(rng, t, n, k, (3,))
    order, offsets = rexp.expert_order(idx, n)
    wg, wu, wd = _expert_weights(rng, n, f, d)
    xp = rexp.permute_fwd(bf(rng.standard_normal((t, d))), order, k)
    _, gate_r, up_r = rexp.experts_fwd(xp, offsets, wg, wu, wd)
    r = t * k
    dyp = bf(rng.standard_normal((r, d)))
    dxp_t = rexp.experts_bwd(f64(xp), offsets, f64(wg), f64(wu), f64(wd), f64(gate_r),
                             f64(up_r), f64(dyp))[0]
    dxp_r = rexp.experts_bwd(xp, offsets, wg, wu, wd, gate_r, up_r, dyp)[0]
    got = []
    for elems in (kexp.experts_bwd_acc_elems(offsets, d), r * d):
        dxp = poisoned((r, d), BF16)
        grads = [cupy.zeros((n, f, d), F32), cupy.zeros((n, f, d), F32),
                 cupy.zeros((n, d, f), F32)]
        kexp.experts_bwd(CTX, dev(xp), offsets, dev(wg), dev(wu), dev(wd), dev(gate_r), dev(up_r),
                         dev(dyp), dxp, *grads, dgate=poisoned((r, f), BF16),
                         dup=poisoned((r, f), BF16), h=poisoned((r, f), BF16),
                         dx_acc=poisoned((elems,), F32))
        got.append(host(dxp))
    assert same_bits(got[0], got[1])
    check_close("experts_bwd dxp", got[1], dxp_t, dxp_r)


@pytest.mark.gpu
@needs_gpu
def test_experts_fwd_refuses_device_offsets_and_offsets_that_miss_rows(rng):
    """Host offsets are the documented sync point: device offsets are refused (no hidden .get()),
    and offsets that do not end at R (an out-of-range expert index) are refused by name."""
    t, n, k, d, f = 16, 4, 2, 32, 16
    wg, wu, wd = (dev(w) for w in _expert_weights(rng, n, f, d))
    xp = dev(bf(rng.standard_normal((t * k, d))))
    outs = [poisoned(s, BF16) for s in ((t * k, d), (t * k, f), (t * k, f))]
    good = np.array([0, 10, 10, 20, t * k], I64)
    with pytest.raises(TypeError, match="offsets_to_host"):
        kexp.experts_fwd(CTX, xp, dev(good), wg, wu, wd, *outs, h=poisoned((t * k, f), BF16))
    with pytest.raises(ValueError, match="routed rows"):
        kexp.experts_fwd(CTX, xp, good - np.array([0, 0, 0, 0, 1]), wg, wu, wd, *outs,
                         h=poisoned((t * k, f), BF16))


# --------------------------------------------------------------- the block, composed of them

def _gpu_block_fwd(x, wr, wg, wu, wd, top_k, norm):
    """The MoE block forward composed of the CUDA ops, in the order the executor would run them
    (device arrays in; a dict of what the backward keeps out)."""
    t, _ = x.shape
    n, f = wr.shape[0], wg.shape[1]
    r = t * top_k
    s = {"logits": poisoned((t, n), F32), "probs": poisoned((t, n), F32),
         "idx": poisoned((t, top_k), I64), "w": poisoned((t, top_k), F32),
         "order": poisoned((r,), I64), "offsets": poisoned((n + 1,), I64),
         "inv": poisoned((r,), I64), "xp": poisoned((r, x.shape[1]), BF16),
         "yp": poisoned((r, x.shape[1]), BF16), "gate": poisoned((r, f), BF16),
         "up": poisoned((r, f), BF16), "counts": poisoned((n,), I64),
         "prob_sum": poisoned((n,), F32), "lse": poisoned((t,), F32),
         "lse_sq": poisoned((1,), F32)}
    krt.router_fwd(CTX, x, wr, top_k, s["logits"], s["probs"], s["idx"], s["w"],
                   norm_topk_prob=norm)
    kexp.expert_order(CTX, s["idx"], n, s["order"], s["offsets"], s["inv"])
    s["offsets_host"] = np.empty(n + 1, I64)
    kexp.offsets_to_host(CTX, s["offsets"], s["offsets_host"]).synchronize()   # the one sync
    kexp.permute_fwd(CTX, x, s["order"], top_k, s["xp"])
    kexp.experts_fwd(CTX, s["xp"], s["offsets_host"], wg, wu, wd, s["yp"], s["gate"], s["up"],
                     h=poisoned((r, f), BF16))
    y = poisoned(x.shape, BF16)
    kexp.unpermute_fwd(CTX, s["yp"], s["inv"], s["w"], y)
    krt.load_balancing_stats(CTX, s["probs"], s["idx"], s["counts"], s["prob_sum"])
    krt.router_z_loss(CTX, s["logits"], 1, s["lse"], s["lse_sq"])
    return y, s


def _gpu_block_bwd(x, wr, wg, wu, wd, s, dy, losses, norm):
    t, d = x.shape
    n, f = wr.shape[0], wg.shape[1]
    top_k = s["idx"].shape[1]
    r = t * top_k
    dyp, d_w = poisoned((r, d), BF16), poisoned((t, top_k), F32)
    kexp.unpermute_bwd(CTX, dy, s["yp"], s["order"], s["w"], dyp, d_w)
    kexp.permute_fwd(CTX, x, s["order"], top_k, s["xp"])    # xp is gathered again, not saved
    dxp = poisoned((r, d), BF16)
    dwg, dwu = cupy.zeros((n, f, d), F32), cupy.zeros((n, f, d), F32)
    dwd = cupy.zeros((n, d, f), F32)
    kexp.experts_bwd(CTX, s["xp"], s["offsets_host"], wg, wu, wd, s["gate"], s["up"], dyp, dxp,
                     dwg, dwu, dwd, dgate=poisoned((r, f), BF16), dup=poisoned((r, f), BF16),
                     h=poisoned((r, f), BF16))
    dl = poisoned((t, n), F32)
    krt.router_logits_bwd(CTX, s["probs"], s["idx"], d_w, dl, norm_topk_prob=norm)
    krt.load_balancing_loss_bwd(CTX, s["probs"], dev(losses.aux_counts), losses.aux_rows,
                                losses.aux_coef, dl, accumulate=True)
    krt.router_z_loss_bwd(CTX, s["logits"], s["lse"], losses.z_rows, losses.z_coef, dl,
                          accumulate=True)
    dx_router, dwr = poisoned((t, d), F32), poisoned((n, d), F32)
    krt.router_bwd(CTX, x, wr, dl, dx_router, dwr, accumulate_dw=False)
    dx = poisoned((t, d), BF16)
    kexp.permute_bwd(CTX, dxp, s["inv"], top_k, dx, residual=dx_router)
    return dx, dwr, dwg, dwu, dwd


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("norm", [False, True], ids=["olmoe", "qwen3"])
def test_moe_block_composed_of_cuda_ops_matches_reference_block(rng, norm):
    """The whole block, forward and backward with both auxiliary losses, composed of the CUDA
    ops matches moe_block_fwd / moe_block_bwd: y, dx and every weight gradient within the bf16
    rule, the statistics exactly or to fp32 rounding. Inputs are redrawn until every token's
    k-th and (k+1)-th probabilities are 1e-5 apart, so both sides route alike."""
    t, d, n, k, f = 128, 128, 16, 4, 64
    tie_margin = 1e-5  # >> the ~1e-7 by which fp32 probabilities of the two sides differ
    x = bf(rng.standard_normal((t, d)))
    wg, wu, wd = _expert_weights(rng, n, f, d)
    for _ in range(100):
        wr = bf(rng.standard_normal((n, d)) / math.sqrt(d))
        p = -np.sort(-rrt.router_fwd(f64(x), f64(wr), k, norm_topk_prob=norm)[1], axis=1)
        if np.min(p[:, k - 1] - p[:, k]) > tie_margin:
            break
    else:
        pytest.skip("no router with a routing margin drawn")  # not expected at these shapes
    w_r = rmoe.MoeWeights(router=wr, gate=wg, up=wu, down=wd)
    w_t = rmoe.MoeWeights(router=f64(wr), gate=f64(wg), up=f64(wu), down=f64(wd))
    y_r, saved_r, stats_r = rmoe.moe_block_fwd(x, w_r, top_k=k, norm_topk_prob=norm)
    y_t, saved_t, _ = rmoe.moe_block_fwd(f64(x), w_t, top_k=k, norm_topk_prob=norm)
    assert np.array_equal(saved_r.topk_idx, saved_t.topk_idx)

    on_dev = [dev(a) for a in (x, wr, wg, wu, wd)]       # x, router, gate, up, down
    y, s = _gpu_block_fwd(*on_dev, k, norm)
    assert same_bits(host(s["idx"]), saved_r.topk_idx)
    assert same_bits(host(s["order"]), saved_r.order)
    assert same_bits(s["offsets_host"], saved_r.offsets)
    check_close("block y", host(y), y_t, y_r)
    assert same_bits(host(s["counts"]), stats_r.counts)
    check_close("block prob_sum", host(s["prob_sum"]), f64(saved_t.probs).sum(axis=0),
                stats_r.prob_sum)
    assert abs(float(host(s["lse_sq"])[0]) - stats_r.lse_sq_sum) <= 1e-5 * stats_r.lse_sq_sum

    dy = bf(rng.standard_normal((t, d)))
    losses = rmoe.RouterLossTerms(aux_coef=0.01, aux_counts=stats_r.counts * 3, aux_rows=3 * t,
                                  z_coef=1e-3, z_rows=t)
    dx_r, g_r = rmoe.moe_block_bwd(x, w_r, saved_r, dy, losses)
    dx_t, g_t = rmoe.moe_block_bwd(f64(x), w_t, saved_t, f64(dy), losses)
    dx, dwr, dwg, dwu, dwd = _gpu_block_bwd(*on_dev, s, dev(dy), losses, norm)
    check_close("block dx", host(dx), dx_t, dx_r)
    for name, got, truth, ref in (("router", dwr, g_t.router, g_r.router),
                                  ("gate", dwg, g_t.gate, g_r.gate),
                                  ("up", dwu, g_t.up, g_r.up),
                                  ("down", dwd, g_t.down, g_r.down)):
        check_close(f"block grad {name}", host(got), truth, ref)
