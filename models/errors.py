"""Typed errors shared by every package. Each carries fields for callers and a message for
people that names the bad value, the limit and a way out. Never imports array libraries."""


class ConfigError(ValueError):
    """A config, plan or argument holds a value we cannot use."""


class ChecksumError(ValueError):
    """A file on disk does not match the checksum or size its manifest recorded."""

    def __init__(self, message: str, *, path: str, expected: str, actual: str):
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.actual = actual


class NonFiniteError(FloatingPointError):
    """Training produced a NaN or infinite loss or gradient norm. Fields: `step` (1-based, the
    step that produced it), `lr` (that step's learning rate), `what` ('loss' or 'grad norm'),
    `value`, and `result` (the step's StepResult, so a log can record the bad row; may be None).
    The engine refuses further steps until its state is reloaded."""

    def __init__(self, message: str, *, step: int, lr: float, what: str, value: float,
                 result=None):
        super().__init__(message)
        self.step = step
        self.lr = lr
        self.what = what
        self.value = value
        self.result = result


class StepFailedError(RuntimeError):
    """An Engine whose last step failed or was interrupted refuses to step again until its
    state is reloaded (its gradients and AdamW state may be half-updated). Fields: `step` (the
    step that failed) and `reason` (one line)."""

    def __init__(self, message: str, *, step: int, reason: str):
        super().__init__(message)
        self.step = step
        self.reason = reason
