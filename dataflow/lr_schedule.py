"""Learning-rate schedules: frozen, JSON-serialisable callables step -> lr, so a checkpoint can
store the schedule and a resumed run continues on exactly the same curve. Steps are 1-based, as
AdamW counts them (the first update uses schedule(1)). Never reads the clock or global state."""

from __future__ import annotations

import dataclasses
import math

from dataflow.models.errors import ConfigError
from dataflow.models.serial import from_dict, to_dict


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WarmupCosine:
    """Linear warmup from lr / warmup_steps to lr over steps 1..warmup_steps, then cosine decay
    from lr to min_lr over steps warmup_steps..total_steps, then min_lr (nanoGPT's curve)."""

    lr: float
    """Peak learning rate, reached at step warmup_steps."""
    total_steps: int
    """Step at which the decay reaches min_lr."""
    warmup_steps: int = 0
    min_lr: float = 0.0
    """Floor of the decay and the lr after total_steps."""

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ConfigError(f"schedule lr must be positive, got {self.lr!r}; try 3e-4")
        for name in ("total_steps", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"schedule {name} must be a non-negative integer, got "
                                  f"{value!r}")
        if self.total_steps < 1:
            raise ConfigError(f"schedule total_steps must be >= 1, got {self.total_steps}")
        if self.warmup_steps > self.total_steps:
            raise ConfigError(f"schedule warmup_steps {self.warmup_steps} exceeds total_steps "
                              f"{self.total_steps}; warm up for at most the whole run")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"schedule min_lr {self.min_lr!r} must lie in [0, lr {self.lr}]; "
                              f"try {self.lr / 10:g}")

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ConfigError(f"schedule steps start at 1, got {step}")
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0 or step >= self.total_steps:
            return self.min_lr if decay_steps > 0 else self.lr
        frac = (step - self.warmup_steps) / decay_steps
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * frac))


SCHEDULES = {"warmup_cosine": WarmupCosine}
"""Serialisable schedules by the name a checkpoint records."""


def schedule_to_dict(schedule) -> dict | None:
    """{'kind': name, 'params': {...}} for a known schedule; None for no schedule. An arbitrary
    callable cannot be stored: it is refused, naming the serialisable kinds."""
    if schedule is None:
        return None
    for name, cls in SCHEDULES.items():
        if type(schedule) is cls:
            return {"kind": name, "params": to_dict(schedule)}
    raise ConfigError(f"lr schedule {schedule!r} cannot be stored in a checkpoint; use one of "
                      f"{sorted(SCHEDULES)} (dataflow.lr_schedule) or no schedule")


def schedule_from_dict(data: dict | None):
    """Inverse of schedule_to_dict."""
    if data is None:
        return None
    if not isinstance(data, dict) or data.get("kind") not in SCHEDULES:
        got = data.get("kind") if isinstance(data, dict) else data
        raise ConfigError(f"unknown lr schedule {got!r}; known: {sorted(SCHEDULES)}")
    return from_dict(SCHEDULES[data["kind"]], data.get("params"), where=f"schedule {data['kind']}")
