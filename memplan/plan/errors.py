"""The planner's typed error: a request whose budgets no plan fits. It carries the bytes the
smallest plan needs per category and the smallest budgets that would work, as fields for callers
and as one paragraph for people. Never imports array libraries."""

from __future__ import annotations

from dataflow.models.errors import ConfigError

GIB = 1 << 30
MIB = 1 << 20


def gib_up(nbytes: int) -> float:
    """`nbytes` in GiB rounded UP to one decimal (what messages name as a budget that works)."""
    return -(-int(nbytes) * 10 // GIB) / 10


def gib_text(nbytes: int) -> str:
    return f"{gib_up(nbytes):.1f}"


def size_text(nbytes: int) -> str:
    """'12.4 GiB' rounded up at or above 1 GiB; below it MiB alone ('34.5 MiB'), since 0.1 GiB
    steps hid small budgets ('0.1 GiB' for both 20.5 and 34.5 MiB)."""
    if nbytes >= GIB:
        return f"{gib_text(nbytes)} GiB"
    return f"{-(-int(nbytes) * 10 // MIB) / 10:.1f} MiB"


def categories_text(needed: tuple[tuple[str, int], ...]) -> str:
    """'weights 1.4, grads 1.4 GiB', or in MiB when the total is below 1 GiB (where GiB printed
    'weights 0.0, grads 0.0 ...')."""
    total = sum(nbytes for _, nbytes in needed)
    unit, scale = ("GiB", GIB) if total >= GIB else ("MiB", MIB)
    parts = [f"{name} {nbytes / scale:.1f}" for name, nbytes in needed if nbytes]
    return ", ".join(parts) + f" {unit}" if parts else "nothing"


class InfeasibleBudget(ConfigError):
    """No plan fits the budgets. Fields (bytes):

    - `device_needed`, `host_needed`: (category, bytes) of the closest plan tried;
    - `min_host_bytes`, `min_device_bytes`: the smallest budgets that work *together* for this
      model and sequence length (device first: no smaller device budget works with any host
      budget; no smaller host budget works with that device budget);
    - `host_bytes_at_device_budget`: the smallest host budget that works with the requested
      device budget (None when that device budget is too small for any host budget);
    - `device_bytes_at_host_budget`: likewise for the requested host budget (None if none).
    """

    def __init__(self, message: str, *, device_needed: tuple[tuple[str, int], ...],
                 host_needed: tuple[tuple[str, int], ...], min_host_bytes: int,
                 min_device_bytes: int, host_budget_bytes: int, device_budget_bytes: int,
                 host_bytes_at_device_budget: int | None = None,
                 device_bytes_at_host_budget: int | None = None):
        super().__init__(message)
        self.device_needed = device_needed
        self.host_needed = host_needed
        self.min_host_bytes = min_host_bytes
        self.min_device_bytes = min_device_bytes
        self.host_budget_bytes = host_budget_bytes
        self.device_budget_bytes = device_budget_bytes
        self.host_bytes_at_device_budget = host_bytes_at_device_budget
        self.device_bytes_at_host_budget = device_bytes_at_host_budget

    @property
    def device_needed_bytes(self) -> int:
        return sum(b for _, b in self.device_needed)

    @property
    def host_needed_bytes(self) -> int:
        return sum(b for _, b in self.host_needed)
