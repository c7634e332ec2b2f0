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
