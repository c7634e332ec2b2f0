"""The sites of FP8 quantisations, for guessed scales (docs/fp8.md): a site names "the same
operand of the same op in the same layer visit, whatever the chunk", so a quantisation can take
the scale its site had last time (a round or a chunk earlier) as its guess. The backend tells
at() each FP8 op's name (dataflow.layer_ops' tags: 'f.L3.c0.linear_fwd', 'b.L3.c1.linear_bwd_x',
...); slot() gives each (site, operand, layout) a small integer, in order of first use, up to a
capacity. Pure bookkeeping on the host: never touches an array, never decides a scale."""

from __future__ import annotations

import re

_VISIT = re.compile(r"^(.*?\.c\d+)\.")
"""A site name's layer visit: up to its chunk ('f.L3.c0' of 'f.L3.c0.linear_fwd')."""
_CHUNK = re.compile(r"\.c\d+$")


class Fp8Sites:
    """Site keys and their slots for one stream of FP8 ops (one backend)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._visit, self._calls = "", {}
        """The layer visit of the op now running (its name up to the chunk) and each op's calls
        in it so far."""
        self.site: tuple | None = None
        """(visit without its chunk, op, call) of the op now running; None before any at()."""
        self._slots: dict[tuple, int] = {}

    def at(self, name: str) -> None:
        """The next op runs at site `name` (its calls in one visit are told apart by order)."""
        m = _VISIT.match(name)
        visit, op = (m.group(1), name[m.end():]) if m else (name, "")
        if visit != self._visit:
            self._visit, self._calls = visit, {}
        call = self._calls[op] = self._calls.get(op, -1) + 1
        self.site = (_CHUNK.sub("", visit), op, call)

    def key(self, region: int, transposed: bool) -> tuple | None:
        """The running op's operand `region` (0: first, 1: second) in its layout, or None."""
        return None if self.site is None else (self.site, region, transposed)

    def slot(self, region: int, transposed: bool) -> int | None:
        """That operand's slot (given out in order of first use), None without a site or once
        `capacity` slots are out."""
        key = self.key(region, transposed)
        if key is None:
            return None
        slot = self._slots.get(key)
        if slot is None and len(self._slots) < self.capacity:
            slot = self._slots[key] = len(self._slots)
        return slot

    def clear(self) -> None:
        """Forget every slot (their state was zeroed or replaced)."""
        self._slots = {}

    def __len__(self) -> int:
        return len(self._slots)
