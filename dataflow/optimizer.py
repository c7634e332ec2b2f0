"""AdamW's hyperparameters, learning-rate hook and step counter. Where and in what order blocks are
updated is part of the compiled schedule (dataflow.memplan.step.compile); the maths lives in the op tables.
Never decides placement and never issues copies."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable

from dataflow.models.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AdamWConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; 0 or None: no clipping (0 is stored as None,
    so both spellings compare equal, as the CLI's --max-grad-norm 0 and the API's None)."""

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ConfigError(f"lr must be >= 0, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"betas must lie in [0, 1), got {self.beta1}, {self.beta2}")
        if not self.eps > 0 or not self.weight_decay >= 0:
            raise ConfigError(f"eps must be > 0 and weight_decay >= 0, got {self.eps}, "
                              f"{self.weight_decay}")
        clip = self.max_grad_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, numbers.Real)
                                 or not clip >= 0):
            raise ConfigError(f"max_grad_norm must be a positive number, or 0 or None for no "
                              f"clipping; got {clip!r}")
        if clip == 0:
            object.__setattr__(self, "max_grad_norm", None)  # one spelling of "off"


class AdamW:
    """Hyperparameters and the step counter. The updates themselves are events of the compiled
    schedule (dataflow.memplan.step.compile: on the device, streamed through the device, or on the host);
    the executor asks `begin_step` for this step's hyperparameters before dispatching them."""

    __slots__ = ("config", "schedule", "step_count", "last_grad_norm")

    def __init__(self, config: AdamWConfig, schedule: Callable[[int], float] | None = None):
        self.config = config
        self.schedule = schedule
        """Optional hook: step (1-based) -> lr, replacing config.lr."""
        self.step_count = 0
        self.last_grad_norm: float | None = None

    def __setattr__(self, name: str, value) -> None:
        method = callable(getattr(type(self), name, None))
        # a subclass (a test's probe) has a __dict__ and may add fields, never shadow a method
        if name not in AdamW.__slots__ and (method or not hasattr(self, "__dict__")):
            what = "a method" if method else "not a setting"
            raise AttributeError(
                f"AdamW.{name} is {what} and cannot be assigned (got {value!r}); to change the "
                "learning rate use Engine.set_lr(lr) or train_step(..., lr=lr), for the other "
                "settings build the Engine with them (read the current lr as Engine.lr)")
        object.__setattr__(self, name, value)

    def lr(self) -> float:
        """The lr of the step counted last (the schedule's, else config.lr)."""
        return self.schedule(self.step_count) if self.schedule else self.config.lr

    def begin_step(self) -> tuple:
        """Count the step and return (step, lr, beta1, beta2, eps, weight_decay) for its AdamW
        events. The gradient's clip scale is not among them: the schedule computes it on the
        device from the global norm (min(1, max_grad_norm / (norm + 1e-6)), or 1 without
        clipping) and every update reads it there, so no host sync is needed."""
        self.step_count += 1
        cfg = self.config
        return (self.step_count, self.lr(), cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay)
