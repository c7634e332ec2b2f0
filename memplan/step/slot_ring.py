"""Slot rings: a few device slots cycled over uses known in advance. `_Ring.assign` decides
which slot each use visits by Belady's rule (evict the block needed farthest ahead), once per
plan; `_Ring.prefetch` / `acquire` / `release` place each fetch as soon as its slot is free and
each write-back as soon as the compute is done, as events on the compiler's `_Emitter`. Used by
memplan/step/compile.py's compiler only. Pure Python: never imports array libraries, never touches a
device, never decides placement (the plan says what is streamed)."""

from __future__ import annotations

import dataclasses
from typing import Hashable

from dataflow.memplan.step.events import (
    COMPUTE,
    D2H,
    H2D,
    Fetch,
    Fill,
    Record,
    Ref,
    Wait,
    WriteBack,
)

ZERO = "zero"
"""A slot use whose fetch is a zero fill (the first round's gradient sums)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Use:
    key: Hashable
    fetch: Ref | str | None = None
    """Host bytes to fetch, ZERO, or None (the compute writes the slot from scratch)."""
    writeback: Ref | None = None
    dtype: str = "bf16"


def for_round(assignments: tuple, rnd: int) -> list[tuple[int, bool]]:
    """Round `rnd`'s entry of _Ring.assign_rounds' (round 0, round 1, rounds 2 on)."""
    return assignments[min(rnd, len(assignments) - 1)]


class _Emitter:
    def __init__(self):
        self.events: list = []
        self.n_ids = 0

    def add(self, ev) -> None:
        self.events.append(ev)

    def record(self, stream: str) -> int:
        i = self.n_ids
        self.n_ids += 1
        self.events.append(Record(stream, i))
        return i

    def wait(self, stream: str, ev: int | None) -> None:
        if ev is not None:
            self.events.append(Wait(stream, ev))


class _Ring:
    """A few device slots cycled over uses known in advance: Belady assignment compiled once,
    fetches issued as soon as their slot is free, write-backs as soon as the compute is done."""

    def __init__(self, em: _Emitter, slots: list[Ref], name: str):
        if not slots:
            raise ValueError(f"slot ring '{name}' needs at least one slot")
        self.em, self.slots, self.name = em, slots, name
        self.free: list[int | None] = [None] * len(slots)
        self.host_ready: dict[Hashable, int] = {}
        """Event after which the home copy of a key holds its latest bytes."""
        self.fill = None
        """Optional hook (use, slot ref) -> (ready, read out) or None: fills a slot in place of
        its fetch (a deferred AdamW writes the updated weights into it: dataflow.memplan.step.compile).
        `ready` orders the use's compute; `read out` is the record after the slot's bytes were
        copied home, which the slot's next fill waits for."""
        self.read_out: dict[int, int] = {}
        """Slot -> the record after a fill hook's write-back out of it."""
        self.fetch = None
        """Optional hook (use, slot ref, name) -> record or None: brings a use's home bytes into
        its slot in place of the one whole Fetch (data-parallel replicas each fetch a part and
        gather the rest from each other: dataflow.memplan.step.ring_compile). Called after the
        slot's waits on the H2D stream; the record is what the use's compute waits for."""
        self.writeback = None
        """Optional hook (home ref, slot ref) -> (home ref, slot ref): the bytes a release
        writes home in place of the whole use (a replica splitting its update writes only its
        reduced part: dataflow.memplan.step.ring_compile)."""

    def assign(self, uses: list[_Use]) -> list[tuple[int, bool]]:
        """For each use: (slot, needs a fetch). Evicts the block needed farthest ahead, never
        one of the last len(slots) - 1 uses (they may still be in flight)."""
        n_slots = len(self.slots)
        following: list[float] = [float("inf")] * len(uses)
        """following[i]: the next position after i that uses the same key."""
        last_seen: dict[Hashable, int] = {}
        for i in range(len(uses) - 1, -1, -1):
            following[i] = last_seen.get(uses[i].key, float("inf"))
            last_seen[uses[i].key] = i
        held: list[Hashable | None] = [None] * n_slots
        next_use: list[float] = [float("inf")] * n_slots
        out: list[tuple[int, bool]] = []
        for i, use in enumerate(uses):
            if use.key in held:
                slot = held.index(use.key)
                next_use[slot] = following[i]
                out.append((slot, False))
                continue
            recent = {s for s, _ in out[max(0, i - n_slots + 1):]}
            candidates = [s for s in range(n_slots) if s not in recent] or list(range(n_slots))
            slot = max(candidates, key=lambda s: (next_use[s], -s))
            held[slot], next_use[slot] = use.key, following[i]
            out.append((slot, use.fetch is not None))
        return out

    def assign_rounds(self, uses: list[_Use]) -> tuple[list[tuple[int, bool]], ...]:
        """Assignments of the rounds of a step whose blocks do not change within it (weights):
        (round 0, round 1, rounds 2 on). Round 0 starts from empty slots; a later round starts
        from what the round before left, so a block still held needs no fetch (the last
        layers of a backward are the first of the next forward). Belady looks across the round
        boundary. Falls back to every round starting afresh unless the rounds from 2 on repeat
        one assignment."""
        n = len(uses)
        a = self.assign(list(uses) * 4)
        parts = tuple(a[i * n:(i + 1) * n] for i in range(4))
        if parts[3] != parts[2]:
            fresh = self.assign(uses)
            return fresh, fresh, fresh
        return parts[:3]

    def begin(self, uses: list[_Use], assigned: list[tuple[int, bool]]) -> None:
        """Start a round of `uses` with the slots of `assigned` (one round's assignment)."""
        self.uses, self.assigned = uses, assigned
        self.prev = []
        last: dict[int, int] = {}
        for j, (slot, _) in enumerate(assigned):
            self.prev.append(last.get(slot, -1))
            last[slot] = j
        self.fetched: dict[int, int] = {}
        self.next_fetch = 0
        self.released = -1

    def _slot_part(self, slot: int, nbytes: int) -> Ref:
        """The leading bytes of a slot that hold a smaller item (activation slots are sized for
        the largest saved level)."""
        s = self.slots[slot]
        return s if nbytes == s.nbytes else Ref(s.region, s.offset, nbytes)

    def prefetch(self, upto: int) -> None:
        """Issue the fetches of uses up to `upto`, as far as their slots are free."""
        em = self.em
        while self.next_fetch <= min(upto, len(self.uses) - 1):
            j = self.next_fetch
            if self.prev[j] > self.released:
                return  # its slot still holds a use that is not done
            slot, needs = self.assigned[j]
            use = self.uses[j]
            if needs:
                if use.fetch == ZERO:
                    # On the D2H stream, behind the write-back that frees the slot: on the
                    # compute stream this prefetch made compute wait for the write-back of
                    # the layer it had just finished (8.5 ms per layer of 8b's first round).
                    em.wait(D2H, self.free[slot])
                    em.add(Fill(f"{self.name}.zero{use.key}", self.slots[slot], use.dtype,
                                D2H))
                    self.fetched[j] = em.record(D2H)
                else:
                    em.wait(H2D, self.free[slot])
                    em.wait(H2D, self.host_ready.get(use.key))
                    em.wait(H2D, self.read_out.pop(slot, None))
                    part = self._slot_part(slot, use.fetch.nbytes)
                    filled = self.fill(use, part) if self.fill is not None else None
                    if filled is None:
                        name = f"{self.name}.h2d{use.key}"
                        got = self.fetch(use, part, name) if self.fetch is not None else None
                        if got is None:
                            em.add(Fetch(name, part, use.fetch))
                            got = em.record(H2D)
                        self.fetched[j] = got
                    else:
                        self.fetched[j], self.read_out[slot] = filled
            self.next_fetch += 1

    def ready(self, i: int) -> bool:
        """Whether use i may be acquired now, ahead of its turn: its fetch is issued (its slot
        was free) or it needs none. With one slot, the next use waits for the current one's
        release."""
        self.prefetch(i + len(self.slots) - 1)
        return not self.assigned[i][1] or i in self.fetched or self.next_fetch > i

    def acquire(self, i: int) -> Ref:
        """The slot of use i; compute waits for its fetch. Prefetches the next uses."""
        self.prefetch(i + len(self.slots) - 1)
        slot, needs = self.assigned[i]
        if needs and i not in self.fetched and self.next_fetch <= i:
            raise RuntimeError(f"slot ring '{self.name}': use {i} acquired before its fetch "
                               "could be issued (its slot still holds a use not released)")
        if i in self.fetched:
            self.em.wait(COMPUTE, self.fetched.pop(i))
        elif not needs:
            # The compute writes the slot from scratch or rereads it: order it after the last
            # write-back or use of whatever the slot held.
            self.em.wait(COMPUTE, self.free[slot])
        return self.slots[slot]

    def release(self, i: int, after: int | None = None) -> None:
        """Use i's compute is enqueued: write back if asked, mark the slot free, prefetch on.
        `after`: a record later than every use of the slot (work on another stream that read
        or copied it out, itself ordered after the compute), which the slot's next fill waits
        for instead of the compute."""
        em = self.em
        slot = self.assigned[i][0]
        done = em.record(COMPUTE) if after is None else after
        use = self.uses[i]
        if use.writeback is not None:
            em.wait(D2H, done)
            em.wait(D2H, self.host_ready.get(use.key))  # earlier readers of the home copy
            home, part = use.writeback, self._slot_part(slot, use.writeback.nbytes)
            if self.writeback is not None:
                home, part = self.writeback(home, part)
            em.add(WriteBack(f"{self.name}.d2h{use.key}", home, part))
            done = em.record(D2H)
            self.host_ready[use.key] = done
        self.free[slot] = done
        self.released = i
        self.prefetch(i + len(self.slots))
