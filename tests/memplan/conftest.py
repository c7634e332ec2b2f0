"""Fixtures for the planner tests: a seeded `random.Random` whose seed is printed (replay with
DATAFLOW_TEST_SEED), the built-in H100 profile, and a cache directory of our own so a profile
cached on this machine by dataflow-probe never changes what the tests see."""

import os
import random
import secrets

import pytest

from dataflow.memplan.plan.profiles import BUILTIN_PROFILES


@pytest.fixture(autouse=True)
def _private_profile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def prng(request) -> random.Random:
    """A `random.Random` seeded freshly per test; the seed is printed (shown on failure)."""
    seed = int(os.environ.get("DATAFLOW_TEST_SEED") or secrets.randbits(63))
    print(f"[{request.node.nodeid}] random seed {seed} (replay: DATAFLOW_TEST_SEED={seed})")
    return random.Random(seed)


@pytest.fixture
def h100():
    return BUILTIN_PROFILES["h100"]
