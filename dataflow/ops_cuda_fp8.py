"""The CuPy op table's linear ops in FP8 precision (Plan.precision FP8): each op quantises its two
operands into the plan's FP8 scratch (the executor lends 'fp8_a', 'fp8_b', 'fp8_scales' and
'fp8_amax': dataflow.memplan.plan.buffers.fp8_scratch_specs) with dataflow.kernels.cuda.fp8 and
multiplies them with the cuBLASLt FP8 GEMM (dataflow.kernels.cuda.fp8_gemm): the recipe of
dataflow.kernels.reference.fp8, as the NumPy table (dataflow.ops_fp8_numpy) runs it. The operands
are K-contiguous, so the backward's ops quantise into the transposed layouts: dx = dy w takes
(dy, w^T), dw = dy^T x takes (dy^T, x^T). A shape the FP8 GEMM cannot take (a size not a
multiple of 16) runs the bf16 op instead, as the NumPy table does. Ops run in stream order, so
one scratch serves them all.

Guessed scales (DATAFLOW_FP8_SCALES=guessed; level with current within noise, not the default):
where the executor lends 'fp8_guess' too and the backend names each op's site (at()), a tensor's
quantisation casts with the scale its site had last time and takes the amax in the same pass,
casting again only where the true scale differs (kernels/cuda/fp8.py quantise_guessed): the
bytes of current scaling, one pass over the tensor instead of two where the guess holds. A site
is the layer visit without its chunk ("f.L3.c0" -> "f.L3"), the op, its call within the visit,
the operand and its layout: the same layer's same operand a round or a chunk earlier.
See docs/fp8.md. Never allocates, never synchronises."""

from __future__ import annotations

import numpy as np

import dataflow.kernels.cuda as K
from dataflow.fp8_sites import Fp8Sites
from dataflow.models.errors import ConfigError
from dataflow.ops_fp8_numpy import FP8_LINEAR_OPS, fp8_shapes_fit
from dataflow.settings import settings_from_env

SCALINGS = ("current", "guessed")
"""DATAFLOW_FP8_SCALES' values (dataflow.settings)."""


class Fp8Linears:
    """linear_fwd / linear_bwd_x / linear_bwd_w over `ops` (a dataflow.ops_cuda.CudaOps): its
    CudaContext, its lent scratch, and its bf16 ops for the shapes FP8 cannot take.

    An operand already in its region is not quantised again: q, k and v read the same x, as do
    gate and up, and their weight gradients the same x^T. A region asked for the same tensor in
    its other layout (dy for dx, then dy^T for dw, or the reverse) keeps its scale and only
    casts again: the amax pass is the same tensor's. The backend tells wrote() what every other
    op, copy and host call writes (forget() where it cannot say), and an op's own output drops a
    region made from the memory it writes. This holds because every tensor of a run is an arena
    view written only through the backend; a caller passing temporaries must keep them alive (a
    freed block can come back at the same address with other values)."""

    def __init__(self, ops):
        self.ops, self.ctx = ops, ops.ctx
        scaling = settings_from_env().fp8_scales
        if scaling not in SCALINGS:
            raise ConfigError(f"DATAFLOW_FP8_SCALES={scaling!r}: use 'current' (the default: "
                             "each operand's amax pass, then its cast) or 'guessed' (its site's "
                             "last scale, cast again where it missed)")
        self.guessing = scaling == "guessed"
        self.bf16 = {name: getattr(ops, name) for name in FP8_LINEAR_OPS}
        self.sites: Fp8Sites | None = None
        """The sites the backend names (at()) and their guess slots, once a state is lent."""
        self._guess = None
        """The lent 'fp8_guess' state while its slots are this object's (zeroed at first use)."""
        self._held: list[tuple | None] = [None, None]
        """Per region (first operand, second): ((source pointer, bytes, shape, strides, format),
        transposed) of the tensor whose FP8 copy it holds, or None. The region's scale triple
        is that tensor's while its source matches, in either layout."""

    def install(self) -> None:
        """Put the FP8 ops in the table's place (instance attributes, as its bound kernels)."""
        for name in FP8_LINEAR_OPS:
            setattr(self.ops, name, getattr(self, name))

    def forget(self) -> None:
        self._held = [None, None]

    def wrote(self, arrays) -> None:
        """Drop the regions made from memory any of `arrays` (device or host arrays, None
        skipped) covers: they are being written."""
        for y in arrays:
            span = _span(y)
            if span is not None:
                lo, hi = span
                self._held = [h if h is None or h[0][0] >= hi or h[0][0] + h[0][1] <= lo
                              else None for h in self._held]

    def at(self, name: str) -> None:
        """The next op runs at site `name` (the backend's op name, e.g. 'b.L3.c1.linear_bwd_x':
        dataflow.layer_ops' tags)."""
        if self.guessing:
            if self.sites is None:
                self.sites = Fp8Sites(0)
            self.sites.at(name)

    def guess_counts(self) -> tuple[int, int] | None:
        """(quantisations that guessed, guesses that missed) so far; None where none guessed.
        Synchronises (a diagnostic for the end of a run)."""
        return None if self._guess is None else K.fp8_guess_counts(self._guess)

    def _slot(self, region: int, transposed: bool) -> int | None:
        """The guess slot of this op's operand, or None (not guessing, no state lent, no site,
        or no slot left: quantise as always)."""
        state = self.ops._lent.get("fp8_guess")
        if not self.guessing or state is None or self.sites is None:
            return None
        if self._guess is None or self._guess.data.ptr != state.data.ptr:
            # every guess 0: a slot's first use always misses, so casts again
            K.fill_(self.ctx, state, 0.0)
            self._guess = state
            self.sites.clear()
            self.sites.capacity = state.size - K.FP8_GUESS_HEADER
        return self.sites.slot(region, transposed)

    def _quantise(self, region: int, x, fmt: str, scales, out, out_t=None) -> None:
        src, transposed = (x.data.ptr, x.nbytes, x.shape, x.strides, fmt), out is None
        held = self._held[region]
        if held is not None and held[0] == src:
            if held[1] == transposed:
                return
            K.fp8_cast(self.ctx, x, fmt, scales, out, out_t)  # scales: this tensor's already
        else:
            slot = self._slot(region, transposed)
            if slot is None:
                K.fp8_quantise(self.ctx, x, fmt, scales, out, out_t, scratch=self.amax)
            else:
                K.fp8_quantise_guessed(self.ctx, x, fmt, scales, out, out_t, self._guess, slot)
        self._held[region] = (src, transposed)

    def _wrote(self, y) -> None:
        self.wrote((y,))

    def _scratch(self, m: int, k: int, n: int):
        """(first operand (m, k), second (n, k), their two scale triples) in the lent scratch."""
        lent = self.ops._lent
        if "fp8_a" not in lent:
            raise RuntimeError("precision fp8 needs the plan's FP8 scratch (fp8_a, fp8_b, "
                               "fp8_scales, fp8_amax), which this executor did not lend: "
                               "plan with precision='fp8'")
        a = lent["fp8_a"][:m * k].reshape(m, k)
        b = lent["fp8_b"][:n * k].reshape(n, k)
        sc = lent["fp8_scales"]
        self.amax = lent["fp8_amax"]
        return a, b, sc[0, :3], sc[1, :3]

    def linear_fwd(self, x, w, y, accumulate=False, alpha=1.0):
        t, i = x.shape
        o = w.shape[0]
        if alpha != 1.0 or not fp8_shapes_fit(t, o, i):  # alpha: LoRA's, never a projection
            self.forget()  # the bf16 op writes y unseen
            return self.bf16["linear_fwd"](x, w, y, accumulate, *_alpha(alpha))
        a, b, sa, sb = self._scratch(t, i, o)
        self._quantise(0, x, "e4m3", sa, a)
        self._quantise(1, w, "e4m3", sb, b)
        K.fp8_gemm(self.ctx, a, "e4m3", sa, b, "e4m3", sb, y, accumulate)
        self._wrote(y)

    def linear_bwd_x(self, dy, w, dx, accumulate=False, alpha=1.0):
        t, o = dy.shape
        i = w.shape[1]
        if alpha != 1.0 or not fp8_shapes_fit(t, o, i):
            self.forget()  # the bf16 op writes dx unseen
            return self.bf16["linear_bwd_x"](dy, w, dx, accumulate, *_alpha(alpha))
        a, bt, sa, sb = self._scratch(t, o, i)  # dy (T, O); w^T (I, O)
        self._quantise(0, dy, "e5m2", sa, a)
        self._quantise(1, w, "e4m3", sb, None, bt)
        K.fp8_gemm(self.ctx, a, "e5m2", sa, bt, "e4m3", sb, dx, accumulate)
        self._wrote(dx)

    def linear_bwd_w(self, dy, x, dw, accumulate=True):
        t, o = dy.shape
        i = x.shape[1]
        if not fp8_shapes_fit(t, o, i):
            self.forget()  # the bf16 op writes dw unseen
            return self.bf16["linear_bwd_w"](dy, x, dw, accumulate)
        at, bt, sa, sb = self._scratch(o, t, i)  # dy^T (O, T); x^T (I, T)
        self._quantise(0, dy, "e5m2", sa, None, at)
        self._quantise(1, x, "e4m3", sb, None, bt)
        K.fp8_gemm(self.ctx, at, "e5m2", sa, bt, "e4m3", sb, dw, accumulate)
        self._wrote(dw)


def _alpha(alpha: float) -> tuple:
    """The bf16 op's trailing alpha argument: none at 1 (the call as it always was)."""
    return () if alpha == 1.0 else (alpha,)


def _span(a) -> tuple[int, int] | None:
    """[start, end) bytes of a CuPy or NumPy array's memory; None for anything else. A NumPy
    array's `.data` is a memoryview, which bf16 arrays cannot even form: use its ctypes."""
    if isinstance(a, np.ndarray):
        ptr = a.ctypes.data
    else:
        ptr = getattr(getattr(a, "data", None), "ptr", None)
        if ptr is None:
            return None
    return ptr, ptr + a.nbytes
