"""Test helpers shared by the float64 checks: central differences and copies of a model's
weights (ModelWeights or any object with embed, layers, head). Never imports the engine."""

from __future__ import annotations

import types

import numpy as np

STEP = 1e-5
"""Central-difference step: in float64 a truncation error O(STEP^2) ~ 1e-10 and a rounding error
~ 1e-16 |L| / STEP ~ 1e-10."""


def central_difference(f, flat: np.ndarray, j: int, step: float = STEP) -> float:
    """(f() at flat[j] + step - f() at flat[j] - step) / (2 step); flat[j] is restored."""
    keep = flat[j]
    flat[j] = keep + step
    up = f()
    flat[j] = keep - step
    down = f()
    flat[j] = keep
    return (up - down) / (2 * step)


def numeric_grad(f, x: np.ndarray, step: float = STEP) -> np.ndarray:
    """Central-difference gradient of the scalar f() with respect to every element of x (x is
    perturbed in place and restored)."""
    flat = x.reshape(-1)
    g = np.array([central_difference(f, flat, i, step) for i in range(flat.size)])
    return g.reshape(x.shape)


def weights_f64(w):
    """The weights' blocks as float64 arrays (embed, layers, head)."""
    return types.SimpleNamespace(embed=w.embed.astype(np.float64),
                                 layers=[b.astype(np.float64) for b in w.layers],
                                 head=w.head.astype(np.float64))


def weights_copy(w):
    """A copy of the weights' blocks in their own dtype."""
    return types.SimpleNamespace(embed=w.embed.copy(), layers=[b.copy() for b in w.layers],
                                 head=w.head.copy())
