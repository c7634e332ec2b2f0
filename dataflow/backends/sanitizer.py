"""Schedule sanitizer for the NumPy backend: every queued op declares the byte ranges it reads and
writes; a vector clock per stream tracks what events order. Two conflicting accesses (same bytes,
one a write) from different streams that no chain of events orders are reported, naming both ops.
Independently, queued ops run in a random order that respects events (seeded, reproducible), so
a missing event also corrupts results visibly. Never reorders ops within one stream."""

from __future__ import annotations

import dataclasses
import random
from collections import deque

from dataflow.backend import BackendError, Stream

STREAMS = tuple(Stream)


class ScheduleRace(BackendError):
    """Two accesses from different streams touch the same bytes with no event between them."""

    def __init__(self, message: str, first: str, second: str):
        super().__init__(message)
        self.first = first
        self.second = second


@dataclasses.dataclass(slots=True)
class Access:
    start: int
    end: int
    write: bool
    stream: Stream
    clock: int
    """The op's position on its stream (1-based): later ops of other streams are ordered after
    it only if their vector clock's entry for this stream has reached this value."""
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    clocks: tuple[int, ...]
    """Vector clock at record time: ops at or before these positions have completed."""


class Sanitizer:
    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.vc = {s: [0] * len(STREAMS) for s in STREAMS}
        self.history: list[Access] = []
        self.queues: dict[Stream, deque] = {s: deque() for s in STREAMS}
        self.done = {s: 0 for s in STREAMS}
        self.n_checked = 0

    def _idx(self, s: Stream) -> int:
        return STREAMS.index(s)

    def enqueue(self, stream: Stream, fn, ranges: list[tuple[int, int, bool]], name: str) -> None:
        """Check `ranges` (start, end, is_write) against unordered earlier accesses, then queue."""
        vc = self.vc[stream]
        vc[self._idx(stream)] += 1
        clock = vc[self._idx(stream)]
        for start, end, write in ranges:
            for a in self.history:
                if a.stream is stream or a.end <= start or end <= a.start:
                    continue
                if not (write or a.write):
                    continue
                if a.clock <= vc[self._idx(a.stream)]:
                    continue  # ordered by an event chain
                raise ScheduleRace(
                    f"schedule race: '{name}' on {stream.value} {'writes' if write else 'reads'} "
                    f"bytes [{start}, {end}) that '{a.name}' on {a.stream.value} "
                    f"{'writes' if a.write else 'reads'} with no event ordering them",
                    a.name, name)
            self.n_checked += 1
        for start, end, write in ranges:
            self.history.append(Access(start, end, write, stream, clock, name))
        self.queues[stream].append(("op", fn, clock))
        if len(self.history) > 4096:
            self._prune()

    def _prune(self) -> None:
        """Forget accesses every stream is already ordered after."""
        floor = [min(self.vc[s][i] for s in STREAMS) for i in range(len(STREAMS))]
        self.history = [a for a in self.history if a.clock > floor[self._idx(a.stream)]]

    def record(self, stream: Stream) -> Event:
        return Event(tuple(self.vc[stream]))

    def wait(self, stream: Stream, event: Event) -> None:
        vc = self.vc[stream]
        for i, c in enumerate(event.clocks):
            vc[i] = max(vc[i], c)
        self.queues[stream].append(("wait", event, None))

    def _ready(self, stream: Stream) -> bool:
        kind, obj, _ = self.queues[stream][0]
        if kind == "op":
            return True
        return all(self.done[s] >= obj.clocks[self._idx(s)] for s in STREAMS)

    def drain(self) -> None:
        """Run every queued op, picking among ready streams at random."""
        while True:
            ready = [s for s in STREAMS if self.queues[s] and self._ready(s)]
            if not ready:
                if any(self.queues.values()):
                    raise BackendError("schedule deadlock: every stream waits on an event "
                                       "that no queued op can reach")
                # A synchronize orders everything done before it before everything after it.
                top = [max(self.vc[s][i] for s in STREAMS) for i in range(len(STREAMS))]
                for s in STREAMS:
                    self.vc[s] = list(top)
                self.history.clear()
                return
            s = self.rng.choice(ready)
            kind, obj, clock = self.queues[s].popleft()
            if kind == "op":
                obj()
                self.done[s] = clock
