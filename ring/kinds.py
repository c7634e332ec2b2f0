"""The closed sets of values a ring option takes: the transport (an enum) and the placement (a
typing.Literal, since memplan's ring planner takes the placement as its string). Text from a
command line, a JSON job or a caller's keyword is parsed here once; below this edge the ring
passes these types, never free strings. Never imports anything of the ring's own."""

from __future__ import annotations

import enum
from typing import Literal, get_args

from dataflow.models.errors import ConfigError

Placement = Literal["cyclic", "balanced", "contiguous"]
"""How a ring deals its layers (dataflow.memplan.plan.ranks.PLACEMENTS)."""

PlacementChoice = Literal["cyclic", "balanced", "contiguous", "auto"]
"""A Placement, or 'auto': the one the layout chooser predicts fastest."""

PLACEMENT_CHOICES: tuple[str, ...] = get_args(PlacementChoice)
"""What --placement and Ring(placement=) accept, in the order --help lists them."""


class TransportKind(enum.Enum):
    """How ranks pass messages: NCCL (one GPU per rank), shared memory (one host: the NumPy
    backend, or ranks sharing GPUs) or AUTO (NCCL on a GPU backend, shared memory on NumPy)."""

    AUTO = "auto"
    NCCL = "nccl"
    SHM = "shm"

    @classmethod
    def parse(cls, value: TransportKind | str) -> TransportKind:
        """`value` as a TransportKind; ConfigError naming the choices for any other text."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"unknown ring transport '{value}'; choose auto, nccl or shm") \
                from None

    def resolve(self, backend: str) -> TransportKind:
        """AUTO as a backend named `backend` runs it: SHM on NumPy, else NCCL; others as given."""
        if self is not TransportKind.AUTO:
            return self
        return TransportKind.SHM if backend == "numpy" else TransportKind.NCCL
