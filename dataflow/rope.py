"""The RoPE inverse-frequency table of a ModelConfig, computed once per (head_dim, rope_theta,
rope_scaling) by the one shared definition (dataflow.kernels.reference.rope_inv_freq) and handed to every
RoPE op, NumPy and CUDA alike, so both rotate by bit-identical frequencies. Never decides
placement and never touches a device."""

from __future__ import annotations

import functools

import numpy as np

from dataflow.kernels.reference.rope import rope_inv_freq
from dataflow.models.config import ModelConfig, RopeScaling, RopeType


def rope_table(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies (E/2,) float64, read-only: plain rope_theta ** (-2j/E) when
    cfg.rope_scaling is None, else scaled as transformers' rope_type of that name does."""
    return _table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


@functools.lru_cache(maxsize=64)
def _table(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    if scaling is None:
        table = rope_inv_freq(head_dim, theta)
    elif scaling.rope_type is RopeType.LLAMA3:
        table = rope_inv_freq(head_dim, theta, (scaling.factor, scaling.low_freq_factor,
                                                scaling.high_freq_factor,
                                                scaling.original_max_position_embeddings))
    else:  # pragma: no cover - RopeScaling refuses other types
        raise ValueError(f"rope_type {scaling.rope_type} has no frequency table")
    table.setflags(write=False)
    return table
