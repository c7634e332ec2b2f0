"""SwiGLU gate on the GPU (kernels/cuda/swiglu.cu): h = silu(gate) * up and its backward;
matches dataflow.kernels.reference.swiglu. fp32 math on bf16|f32 storage. Enqueued on the current CuPy
stream; no sync, no allocation."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.cuda import _build

_SRC = "swiglu.cu"
_NAMES = tuple([f"swiglu_fwd_kernel<{t}, {v}>" for t in ("bf16", "float") for v in (1, 8)]
               + [f"swiglu_bwd_kernel<{t}, {v}, {h}>" for t in ("bf16", "float") for v in (1, 8)
                  for h in ("false", "true")])
_THREADS = 256


def _launch(ctx, direction: str, arrays: tuple, names: tuple[str, ...], extra: str = "") -> None:
    first = arrays[0]
    for nm, a in zip(names, arrays):
        _build.check(nm, a, tuple(first.shape), (first.dtype,))
    n = first.size
    vec = 8 if _build.aligned16(*arrays) else 1
    k = _build.kernel(ctx, _SRC, _NAMES, f"swiglu_{direction}_kernel"
                      f"<{_build.ctype(first.dtype, names[0])}, {vec}{extra}>")
    if n:
        k((_build.flat_grid(ctx, -(-n // vec), _THREADS),), (_THREADS,), (*arrays, np.int64(n)))


def swiglu_fwd(ctx, gate, up, out) -> None:
    """gate, up (T, F) bf16|f32 -> out (T, F) same dtype: silu(gate) * up. out may alias gate."""
    _launch(ctx, "fwd", (gate, up, out), ("gate", "up", "out"))


def swiglu_bwd(ctx, gate, up, dh, dgate, dup, out=None) -> None:
    """gate, up, dh (T, F) -> dgate = dh * up * silu'(gate), dup = dh * silu(gate); with `out`,
    also out = silu(gate) * up, the bits swiglu_fwd writes, in the same pass.

    dgate may alias gate (or dh) and dup may alias up: each element is read before it is written
    by the same thread. `out` must alias none of them.
    """
    write_h = "false" if out is None else "true"  # without out, dup stands in (never written)
    _launch(ctx, "bwd", (gate, up, dh, dgate, dup, dup if out is None else out),
            ("gate", "up", "dh", "dgate", "dup", "out"), f", {write_h}")
