"""The warmup + cosine schedule: its curve, its JSON round trip, and refusals of bad settings."""

from __future__ import annotations

import json
import math

import pytest

from dataflow.lr_schedule import WarmupCosine, schedule_from_dict, schedule_to_dict
from dataflow.models.errors import ConfigError


def test_warmup_rises_linearly_then_cosine_decays_to_min_lr(rng):
    """lr grows as step / warmup up to the peak, falls monotonically to min_lr at total_steps
    and stays there, passing the midpoint (lr + min_lr) / 2 halfway through the decay."""
    lr, warm, total = float(rng.uniform(1e-4, 1e-2)), int(rng.integers(1, 20)), 200
    s = WarmupCosine(lr=lr, total_steps=total, warmup_steps=warm, min_lr=lr / 10)
    assert [s(i) for i in range(1, warm + 1)] == pytest.approx([lr * i / warm
                                                                 for i in range(1, warm + 1)])
    decay = [s(i) for i in range(warm, total + 1)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert s(total) == pytest.approx(lr / 10) and s(total + 50) == pytest.approx(lr / 10)
    if (total - warm) % 2 == 0:
        assert s(warm + (total - warm) // 2) == pytest.approx(0.55 * lr)
    assert s(warm + 1) == pytest.approx(lr / 10 + 0.45 * lr * (1 + math.cos(math.pi / (total - warm))))


def test_schedule_round_trips_through_json():
    """A stored schedule comes back equal, so a resumed run follows the same curve."""
    s = WarmupCosine(lr=3e-4, total_steps=100, warmup_steps=10, min_lr=3e-5)
    assert schedule_from_dict(json.loads(json.dumps(schedule_to_dict(s)))) == s
    assert schedule_to_dict(None) is None
    with pytest.raises(ConfigError, match="warmup_cosine"):
        schedule_to_dict(lambda step: 1e-3)


@pytest.mark.parametrize("kw,match", [({"lr": 0.0}, "lr must be positive"),
                                      ({"warmup_steps": 500}, "exceeds total_steps"),
                                      ({"min_lr": 1.0}, "min_lr"),
                                      ({"total_steps": 0}, "total_steps")])
def test_bad_schedules_are_refused_by_name(kw, match):
    """Impossible settings are refused naming the field and a value that works."""
    base = dict(lr=1e-3, total_steps=100, warmup_steps=5, min_lr=1e-4)
    with pytest.raises(ConfigError, match=match):
        WarmupCosine(**{**base, **kw})
