"""Slot rings: a few device slots cycled over a sequence of uses known before the round starts
(weights of layer 0..L-1 then L-1..0, gradient blocks, saved activations kept at home). The
assignment of uses to slots is computed once per schedule (keep a block that is used again soon;
evict the one needed farthest ahead), then replayed: fetches are issued as early as their slot is
free, writebacks as soon as the compute that filled the slot is done. All ordering is by events.
Never decides how many slots there are (the plan does)."""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable

from dataflow.backend import Backend, Stream

ZERO = "zero"
"""Fetch source meaning: fill the slot with zeros on the compute stream instead of copying."""


@dataclasses.dataclass(frozen=True, slots=True)
class Use:
    key: Hashable
    fetch: Any = None
    """A host view to copy in, ZERO, or None (the compute writes the slot from scratch)."""
    writeback: Any = None
    """A host view to copy the slot to once the use is done, or None."""


class SlotRing:
    def __init__(self, be: Backend, slots: list, name: str):
        if not slots:
            raise ValueError(f"slot ring '{name}' needs at least one slot")
        self.be = be
        self.slots = slots
        self.name = name
        self.free_event: list = [None] * len(slots)
        self.host_ready: dict[Hashable, Any] = {}
        """Event after which the home copy of a key holds its latest bytes."""
        self.bytes_h2d = 0
        self.bytes_d2h = 0

    # -- schedule, built once ----------------------------------------------------------------
    def compile(self, uses: list[Use]) -> list[tuple[int, bool]]:
        """For each use: (slot index, needs fetch). Belady eviction over the known sequence."""
        held: list[Hashable | None] = [None] * len(self.slots)
        out = []
        for i, use in enumerate(uses):
            if use.key in held:
                out.append((held.index(use.key), False))
                continue
            recent = {s for s, _ in out[max(0, i - len(self.slots) + 1):]}

            def next_use(slot: int) -> float:
                key = held[slot]
                for j in range(i + 1, len(uses)):
                    if uses[j].key == key:
                        return j
                return float("inf")

            candidates = [s for s in range(len(self.slots)) if s not in recent] or \
                list(range(len(self.slots)))
            slot = max(candidates, key=lambda s: (next_use(s), -s))
            held[slot] = use.key
            out.append((slot, use.fetch is not None))
        return out

    # -- replay -------------------------------------------------------------------------------
    def begin(self, uses: list[Use], compiled: list[tuple[int, bool]]) -> None:
        self.uses, self.compiled = uses, compiled
        self.fetched: dict[int, Any] = {}
        self.next_fetch = 0
        self.released = -1

    def _prev_occupant(self, j: int) -> int:
        slot = self.compiled[j][0]
        for p in range(j - 1, -1, -1):
            if self.compiled[p][0] == slot:
                return p
        return -1

    def _issue_fetches(self, upto: int) -> None:
        while self.next_fetch <= min(upto, len(self.uses) - 1):
            j = self.next_fetch
            if self._prev_occupant(j) > self.released:
                return  # its slot is still in use by a use not yet done
            slot, needs = self.compiled[j]
            use = self.uses[j]
            if needs:
                view = self.slots[slot]
                if isinstance(use.fetch, str) and use.fetch == ZERO:
                    if self.free_event[slot] is not None:
                        self.be.wait(Stream.COMPUTE, self.free_event[slot])
                    self.be.launch(Stream.COMPUTE, "fill_", view, 0.0,
                                   name=f"{self.name}.zero{use.key}")
                else:
                    if self.free_event[slot] is not None:
                        self.be.wait(Stream.H2D, self.free_event[slot])
                    if use.key in self.host_ready:
                        self.be.wait(Stream.H2D, self.host_ready[use.key])
                    dev = self._part(view, use.fetch)
                    self.be.copy(dev, use.fetch, Stream.H2D, name=f"{self.name}.h2d{use.key}")
                    self.bytes_h2d += dev.nbytes
                    self.fetched[j] = self.be.record(Stream.H2D)
            self.next_fetch += 1

    def prefetch(self, upto: int) -> None:
        """Issue the fetches of uses up to `upto` now (e.g. the head's weights during the last
        forward layers), as far as their slots are free."""
        self._issue_fetches(upto)

    def _part(self, slot_view, host_view):
        """The leading bytes of a slot that hold a smaller item (activation slots are sized
        for the largest saved level)."""
        if host_view.nbytes == slot_view.nbytes:
            return slot_view
        return self.be.byte_slice(slot_view, 0, host_view.nbytes)

    def acquire(self, i: int):
        """The slot view for use i; compute waits for its fetch. Prefetches the next uses."""
        self._issue_fetches(i + len(self.slots) - 1)
        slot, needs = self.compiled[i]
        if i in self.fetched:
            self.be.wait(Stream.COMPUTE, self.fetched.pop(i))
        elif not needs and self.free_event[slot] is not None:
            # The compute writes the slot from scratch (or rereads it): order after the last
            # writeback or use of whatever it held.
            self.be.wait(Stream.COMPUTE, self.free_event[slot])
        return self.slots[self.compiled[i][0]]

    def release(self, i: int) -> None:
        """Use i's compute is enqueued: write back if asked, mark the slot free, prefetch on."""
        slot = self.compiled[i][0]
        done = self.be.record(Stream.COMPUTE)
        use = self.uses[i]
        if use.writeback is not None:
            self.be.wait(Stream.D2H, done)
            if use.key in self.host_ready:
                self.be.wait(Stream.D2H, self.host_ready[use.key])  # earlier readers of home
            dev = self._part(self.slots[slot], use.writeback)
            self.be.copy(use.writeback, dev, Stream.D2H, name=f"{self.name}.d2h{use.key}")
            self.bytes_d2h += dev.nbytes
            done = self.be.record(Stream.D2H)
            self.host_ready[use.key] = done
        self.free_event[slot] = done
        self.released = i
        self._issue_fetches(i + len(self.slots))

