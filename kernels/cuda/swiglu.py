"""SwiGLU gate on the GPU (kernels/cuda/swiglu.cu): h = silu(gate) * up and its backward;
matches kernels.reference.swiglu. fp32 math on bf16|f32 storage. Enqueued on the current CuPy
stream; no sync, no allocation."""

from __future__ import annotations

import numpy as np

from kernels.cuda import _build

_SRC = "swiglu.cu"
_NAMES = tuple(f"swiglu_{d}_kernel<{t}, {v}>" for d in ("fwd", "bwd")
               for t in ("bf16", "float") for v in (1, 8))
_THREADS = 256


def _launch(direction: str, arrays: tuple, names: tuple[str, ...]) -> None:
    first = arrays[0]
    for nm, a in zip(names, arrays):
        _build.check(nm, a, tuple(first.shape), (first.dtype,))
    n = first.size
    vec = 8 if _build.aligned16(*arrays) else 1
    k = _build.kernel(_SRC, _NAMES,
                      f"swiglu_{direction}_kernel<{_build.ctype(first.dtype, names[0])}, {vec}>")
    if n:
        k((_build.flat_grid(-(-n // vec), _THREADS),), (_THREADS,), (*arrays, np.int64(n)))


def swiglu_fwd(gate, up, out) -> None:
    """gate, up (T, F) bf16|f32 -> out (T, F) same dtype: silu(gate) * up. out may alias gate."""
    _launch("fwd", (gate, up, out), ("gate", "up", "out"))


def swiglu_bwd(gate, up, dh, dgate, dup) -> None:
    """gate, up, dh (T, F) -> dgate = dh * up * silu'(gate), dup = dh * silu(gate).

    dgate may alias gate (or dh) and dup may alias up: each element is read before it is written
    by the same thread.
    """
    _launch("bwd", (gate, up, dh, dgate, dup), ("gate", "up", "dh", "dgate", "dup"))
