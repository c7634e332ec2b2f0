"""Shared pytest fixtures. Kept minimal: a fresh random generator per test whose seed is printed,
so a failure shows the seed that reproduces it (set DATAFLOW_TEST_SEED to replay one)."""

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A `numpy.random.default_rng` seeded freshly for every test; the seed is printed to the
    captured stdout, which pytest shows only when the test fails."""
    seed = int(os.environ.get("DATAFLOW_TEST_SEED") or secrets.randbits(63))
    print(f"[{request.node.nodeid}] rng seed {seed} (replay: DATAFLOW_TEST_SEED={seed})")
    return np.random.default_rng(seed)
