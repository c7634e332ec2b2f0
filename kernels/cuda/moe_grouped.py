"""Grouped expert GEMMs (kernels/cuda/moe_grouped.cu): the routed experts' SwiGLU forward and
backward with each GEMM kind a single launch over all of a layer's experts, the experts' row
ranges read from `offsets` in device memory. The same contract as moe_experts.experts_fwd /
experts_bwd except that offsets stay ON THE DEVICE: nothing here waits for the host, so the
compute stream runs a layer's MoE ops back to back. Never decides routing, never synchronises,
never allocates (scratch is passed in, as to experts_bwd).

Bits: fp32 accumulation in a different order from cuBLAS's, one rounding at each store (the
input gradient's two products summed in one fp32 accumulator, as the loop path's fp32 dx_acc
does), so results equal the loop path's within bf16 rounding, not bit for bit
(tests/kernels/test_moe_grouped_cuda.py states the bound).

Speed (bench/records/s30-grouped/call1/, H200, bench.moe_experts_bench --grouped --as-engine):
a layer's forward and backward at 0.30-0.36 of the dense GEMM rate (olmoe-1b-7b 264 TFLOP/s at
8k tokens, 281 at 16k; qwen3-30b-a3b 229), enqueued in 0.2-0.4 ms of host time; the loop's
cuBLASLt calls run at 0.50-0.60 of dense on the GPU but need 6-19 ms of host time. mma.sync
without wgmma and one CTA of 8 warps an SM (144 KiB of shared memory, ~230 registers) is the
limit; the engine keeps the loop by default (DATAFLOW_MOE_EXPERTS).

Shapes the kernel takes (grouped_supported): D and F multiples of 256, bf16 activations and
weights, each expert's matrices C-contiguous and a multiple of 16 bytes apart (the stacked
(N, F, D) arrays or the engine's layer-block views, where an expert's three matrices lie
together). Otherwise callers keep the loop path."""

from __future__ import annotations

import cupy
import numpy as np

from dataflow.kernels.cuda import _build
from dataflow.kernels.cuda._build import BF16, F32
from dataflow.kernels.cuda.swiglu import swiglu_bwd, swiglu_fwd

_SRC = "moe_grouped.cu"
_NAMES = ("grouped_rows_kernel<true, false>", "grouped_rows_kernel<false, false>",
          "grouped_rows_kernel<false, true>", "grouped_k_kernel<float>",
          "grouped_k_kernel<bf16>")
I64 = np.dtype(np.int64)
_BM, _BN, _BK, _THREADS = 128, 256, 64, 256
_SMEM = 3 * (_BM * _BK + _BN * _BK) * 2  # 3 stages of A and B tiles, bf16: 144 KiB


def grouped_supported(model_dim: int, ffn_dim: int, dtype, *mats) -> bool:
    """True when the grouped kernels take these shapes: D, F multiples of 256, bf16, and each
    stacked weight (N, rows, cols) C-contiguous per expert with its experts 16 bytes apart."""
    if model_dim % _BN or ffn_dim % _BN or np.dtype(dtype) != BF16:
        return False
    for w in mats:
        if not isinstance(w, cupy.ndarray) or w.ndim != 3:
            return False
        isz = w.dtype.itemsize
        if (tuple(w.strides[1:]) != (w.shape[2] * isz, isz) or w.strides[0] % 16
                or w.strides[0] < w.shape[1] * w.shape[2] * isz or w.data.ptr % 16):
            return False
    return True


def _launch(ctx, name: str, grid, args) -> None:
    fn = _build.kernel(ctx, _SRC, _NAMES, name)
    if fn.max_dynamic_shared_size_bytes < _SMEM:  # above 48 KiB needs the opt-in, once
        fn.max_dynamic_shared_size_bytes = _SMEM
    fn(grid, (_THREADS,), args, shared_mem=_SMEM)


def _stacked(what: str, w, n_experts: int, shape: tuple[int, int], dtypes=(BF16,)):
    """(pointer, expert stride in elements) of a stacked (N, rows, cols) weight, checked."""
    if not isinstance(w, cupy.ndarray) or w.ndim != 3 or tuple(w.shape) != (n_experts, *shape):
        raise ValueError(f"{what} must be a stacked ({n_experts}, {shape[0]}, {shape[1]}) CuPy "
                         f"array for the grouped kernels; got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    if np.dtype(w.dtype) not in dtypes:
        raise TypeError(f"{what} has dtype {w.dtype}; this op takes "
                        f"{', '.join(str(d) for d in dtypes)}")
    isz = w.dtype.itemsize
    if (tuple(w.strides[1:]) != (shape[1] * isz, isz) or w.strides[0] % 16
            or w.strides[0] < shape[0] * shape[1] * isz or w.data.ptr % 16):
        raise ValueError(f"{what}: each expert's matrix must be C-contiguous and the experts a "
                         f"multiple of 16 bytes apart (strides {w.strides})")
    return np.uint64(w.data.ptr), np.int64(w.strides[0] // isz)


def _check_offsets(offsets) -> int:
    if not isinstance(offsets, cupy.ndarray) or offsets.ndim != 1 or offsets.dtype != I64 \
            or offsets.size < 2:
        raise TypeError("offsets must be a device (N + 1,) int64 array (expert_order writes it)")
    return offsets.size - 1


def _rows(ctx, offsets, n_rows: int, a0, a1, b0, b1, c0, c1, b_estride, lda, ldb, ldc, n, k,
          b_kcontig: bool, two_segs: bool, problems: int = 1) -> None:
    """out rows of each expert = A rows @ op(B_e) (the .cu's grouped_rows_kernel)."""
    n_experts = offsets.size - 1
    if n_rows == 0:
        return
    tiles = -(-n_rows // _BM) + n_experts  # an upper bound: at most one partial tile an expert
    name = f"grouped_rows_kernel<{'true' if b_kcontig else 'false'}, " \
           f"{'true' if two_segs else 'false'}>"
    _launch(ctx, name, (n // _BN, tiles, problems),
            (offsets, np.int32(n_experts), a0, a1, b0, b1, c0, c1, b_estride, np.int32(lda),
             np.int32(ldb), np.int32(ldc), np.int32(k)))


def _kgrad(ctx, offsets, a0, a1, b, c0, c1, c_estride, m, n, lda, ldb, out_dtype,
           accumulate: bool, problems: int) -> None:
    """C_e (+)= A_e^T @ B_e over each expert's rows (the .cu's grouped_k_kernel)."""
    n_experts = offsets.size - 1
    name = f"grouped_k_kernel<{_build.ctype(out_dtype, 'weight gradient')}>"
    _launch(ctx, name, (n // _BN, m // _BM, n_experts * problems),
            (offsets, np.int32(problems), a0, a1, b, c0, c1, c_estride, np.int32(lda),
             np.int32(ldb), np.int32(n), np.int32(bool(accumulate))))


def _ptr(a) -> np.uint64:
    return np.uint64(a.data.ptr)


def grouped_experts_fwd(ctx, xp, offsets, w_gate, w_up, w_down, yp, gate, up, *, h) -> None:
    """As moe_experts.experts_fwd, with offsets (N + 1,) int64 ON THE DEVICE and the weights
    stacked (N, F, D), (N, F, D), (N, D, F) bf16: gate and up in one launch, one swiglu launch,
    down in one launch."""
    r, d = xp.shape
    n_experts = _check_offsets(offsets)
    f = gate.shape[1] if gate.ndim == 2 else -1
    _build.check("xp", xp, (r, d), (BF16,))
    for what, a, shape in (("yp", yp, (r, d)), ("gate", gate, (r, f)), ("up", up, (r, f)),
                           ("h", h, (r, f))):
        _build.check(what, a, shape, (BF16,))
    if h.data.ptr in (gate.data.ptr, up.data.ptr) and r:
        raise ValueError("h must not alias gate or up: the backward needs both")
    if d % _BN or f % _BN:
        raise ValueError(f"the grouped kernels take D and F multiples of {_BN}; got D={d}, F={f} "
                         f"(use moe_experts.experts_fwd)")
    pg, sg = _stacked("w_gate", w_gate, n_experts, (f, d))
    pu, su = _stacked("w_up", w_up, n_experts, (f, d))
    pd, sd = _stacked("w_down", w_down, n_experts, (d, f))
    if sg != su:
        raise ValueError(f"w_gate and w_up must step over experts alike (strides {sg}, {su})")
    x = _ptr(xp)
    _rows(ctx, offsets, r, x, x, pg, pu, _ptr(gate), _ptr(up), sg, d, d, f, f, d,
          b_kcontig=True, two_segs=False, problems=2)
    swiglu_fwd(ctx, gate, up, h)
    _rows(ctx, offsets, r, _ptr(h), _ptr(h), pd, pd, _ptr(yp), _ptr(yp), sd, f, f, d, d, f,
          b_kcontig=True, two_segs=False)


def grouped_experts_bwd(ctx, xp, offsets, w_gate, w_up, w_down, gate, up, dyp, dxp, dw_gate,
                        dw_up, dw_down, *, dgate, dup, h, accumulate: bool = True) -> None:
    """As moe_experts.experts_bwd, with offsets ON THE DEVICE and stacked weights and weight
    gradients (the gradients fp32 or bf16, the three of one dtype): dh = dy @ Wd (one launch,
    into dgate), one swiglu_bwd, dWd (+)= dy^T h and dWg, dWu (+)= dgate^T x, dup^T x (two
    launches), dx = dgate @ Wg + dup @ Wu in one fp32 accumulator, rounded once (one launch).
    No dx_acc scratch: the sum stays in registers. An idle expert's gradients are untouched."""
    r, d = xp.shape
    n_experts = _check_offsets(offsets)
    f = gate.shape[1] if gate.ndim == 2 else -1
    _build.check("xp", xp, (r, d), (BF16,))
    for what, a, shape in (("gate", gate, (r, f)), ("up", up, (r, f)), ("dyp", dyp, (r, d)),
                           ("dxp", dxp, (r, d)), ("dgate", dgate, (r, f)),
                           ("dup", dup, (r, f)), ("h", h, (r, f))):
        _build.check(what, a, shape, (BF16,))
    if r and (dgate.data.ptr in (gate.data.ptr, up.data.ptr)
              or h.data.ptr in (gate.data.ptr, up.data.ptr, dgate.data.ptr, dup.data.ptr)
              or dup.data.ptr == gate.data.ptr):
        raise ValueError("grouped_experts_bwd scratch aliases an input: dgate must not alias "
                         "gate or up, dup not gate, h nothing")
    if d % _BN or f % _BN:
        raise ValueError(f"the grouped kernels take D and F multiples of {_BN}; got D={d}, F={f} "
                         f"(use moe_experts.experts_bwd)")
    pg, sg = _stacked("w_gate", w_gate, n_experts, (f, d))
    pu, su = _stacked("w_up", w_up, n_experts, (f, d))
    pd, sd = _stacked("w_down", w_down, n_experts, (d, f))
    gdt = np.dtype(dw_gate.dtype) if isinstance(dw_gate, cupy.ndarray) else None
    qg, tg = _stacked("dw_gate", dw_gate, n_experts, (f, d), (BF16, F32))
    qu, tu = _stacked("dw_up", dw_up, n_experts, (f, d), (gdt,))
    qd, td = _stacked("dw_down", dw_down, n_experts, (d, f), (gdt,))
    if sg != su or tg != tu:
        raise ValueError("w_gate/w_up and dw_gate/dw_up must step over experts alike")
    if r == 0:
        return
    dy, dg, du, hh, x = _ptr(dyp), _ptr(dgate), _ptr(dup), _ptr(h), _ptr(xp)
    # dh (R, F) = dy (R, D) @ Wd_e (D, F), into dgate
    _rows(ctx, offsets, r, dy, dy, pd, pd, dg, dg, sd, d, f, f, f, d,
          b_kcontig=False, two_segs=False)
    swiglu_bwd(ctx, gate, up, dgate, dgate, dup, out=h)  # dgate reads dh then overwrites it
    _kgrad(ctx, offsets, dy, dy, hh, qd, qd, td, d, f, d, f, gdt, accumulate, 1)
    _kgrad(ctx, offsets, dg, du, x, qg, qu, tg, f, d, f, d, gdt, accumulate, 2)
    _rows(ctx, offsets, r, dg, du, pg, pu, _ptr(dxp), _ptr(dxp), sg, f, d, d, d, f,
          b_kcontig=False, two_segs=True)
