"""Times a compiled schedule (dataflow.memplan.step.compile) event by event, as the streams would
run it: the prediction of a plan comes from this timeline, not from a formula. Never compiles,
never decides, never reads the clock; the durations of compute and host work come from the
caller (dataflow.memplan.search.cost.event_seconds)."""

from __future__ import annotations

import bisect
import dataclasses

from dataflow.memplan.plan.plan import HardwareProfile


@dataclasses.dataclass(frozen=True, slots=True)
class Timeline:
    """What `simulate_schedule` found: when each stream finished, when each round ended, and
    how long the compute stream waited on each other stream."""

    total_s: float
    round_end_s: tuple[float, ...]
    """Compute-stream time at the end of each round (the optimizer follows the last)."""
    compute_busy_s: float
    exposed_s: dict
    """Seconds the compute stream waited on 'h2d', 'd2h', 'host' and 'opt' (a deferred
    update)."""
    exposed_by_round: tuple
    """The same, per round, then the optimizer."""
    busy_by_round: tuple
    """Compute-stream busy seconds per round, then the optimizer."""
    events: tuple
    """The events timed, in order: the schedule's own list."""
    spans: tuple = ()
    """With simulate_schedule(spans=True): (stream, event name, start s, end s, bytes) of every
    timed event (not records and waits), for the same stall analysis as a measured trace."""


def copy_seconds(nbytes: int, both_s: float, duplex_bytes_per_s: float,
                 one_way_bytes_per_s: float) -> float:
    """Seconds of a copy of `nbytes` that starts while the other direction stays busy for
    `both_s` more seconds (<= 0: idle): the duplex rate while both directions run, the one-way
    rate for what is left after (as duplex_rates averages a phase: round_sim). Charging the
    whole copy at the duplex rate because the other direction was busy at its start
    overcharged a layer's fetch that a short activation write-back only partly overlaps (8b
    LoRA at one chunk a round: 9.3 ms a fetch instead of 8.4)."""
    if both_s <= 0:
        return nbytes / one_way_bytes_per_s
    shared = both_s * duplex_bytes_per_s
    if nbytes <= shared:
        return nbytes / duplex_bytes_per_s
    return both_s + (nbytes - shared) / one_way_bytes_per_s


class LinkTime:
    """When one direction of the host link is taken: merged busy intervals, in time order. Two
    streams copy over the D2H link (the round's write-backs and a deferred update's), and the
    link carries their bytes once: a copy fills the link's free time from when its stream
    reaches it, so a stream's copies can not run at the link's rate beside another's (the
    double count that predicted 8b at one round a step 16 % fast: bench/records/s40/)."""

    __slots__ = ("starts", "ends")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def busy_until(self, at: float) -> float:
        """The end of the busy interval `at` falls in; `at` itself if the link is free then."""
        i = bisect.bisect_right(self.ends, at)
        return self.ends[i] if i < len(self.starts) and self.starts[i] <= at else at

    def occupy(self, at: float, seconds: float) -> tuple[float, float]:
        """Take `seconds` of the link's free time from `at` on; (first free moment, end)."""
        i = bisect.bisect_right(self.ends, at)
        first = at if i == len(self.starts) or self.starts[i] > at else self.ends[i]
        t, left, j = first, seconds, i
        while j < len(self.starts):
            if self.starts[j] > t:
                if self.starts[j] - t >= left:
                    break
                left -= self.starts[j] - t
            t = max(t, self.ends[j])
            j += 1
        end = t + left
        # [first, end] is busy now, the intervals i..j-1 inside it, one that touches it too
        lo = min(first, self.starts[i]) if i < j else first
        if i and self.ends[i - 1] >= lo:  # it starts as the one before ends
            i, lo = i - 1, self.starts[i - 1]
        if j < len(self.starts) and self.starts[j] <= end:
            end_merged, j = self.ends[j], j + 1
        else:
            end_merged = end
        self.starts[i:j], self.ends[i:j] = [lo], [end_merged]
        return first, end


def simulate_schedule(schedule, seconds, p: HardwareProfile, *, comm=None,
                      spans: bool = False) -> Timeline:
    """Time `schedule.events` in order, as the streams would run them: an event starts when its
    stream is free (a wait moves the stream's clock to the waited record); copies run at the
    duplex rate while the other direction is busy, else at the one-way rate, and each direction
    of the link carries one copy at a time, whichever stream issued it (LinkTime). `seconds(event)`
    gives the compute / host / fill durations (dataflow.memplan.search.cost.event_seconds).
    `comm` (a ring rank's: dataflow.memplan.step.ring_sim.RingComm) times the events on its
    `streams` (Send, Recv, AllReduce): `comm.finish(event, start)` is when one ends."""
    clock = {"compute": 0.0, "h2d": 0.0, "d2h": 0.0, "host": 0.0, "opt": 0.0}
    recorded = [0.0] * schedule.n_ids
    origin = [""] * schedule.n_ids
    exposed = {"h2d": 0.0, "d2h": 0.0, "host": 0.0, "opt": 0.0}
    for s in comm.streams if comm is not None else ():
        clock[s] = exposed[s] = 0.0
    busy = 0.0
    round_end, by_round, busy_at = [], [], []
    boundaries = set(schedule.round_starts[1:]) | {schedule.optimizer_start}
    timed: list = []
    one_way = {"h2d": p.h2d_bytes_per_s, "d2h": p.d2h_bytes_per_s}
    duplex = {"h2d": p.h2d_duplex_bytes_per_s, "d2h": p.d2h_duplex_bytes_per_s}
    other = {"h2d": "d2h", "d2h": "h2d"}
    link = {"h2d": "h2d", "d2h": "d2h", "opt": "d2h"}
    """A deferred update's write-backs (the 'opt' stream) cross the D2H link."""
    links = {"h2d": LinkTime(), "d2h": LinkTime()}
    for i, ev in enumerate(schedule.events):
        if boundaries and i in boundaries:
            round_end.append(clock["compute"])
            by_round.append(dict(exposed))
            busy_at.append(busy)
        kind = type(ev).__name__
        s = ev.stream
        if kind == "Record":
            recorded[ev.id], origin[ev.id] = clock[s], s
        elif kind == "Wait":
            t = recorded[ev.id]
            if t > clock[s]:
                if s == "compute" and origin[ev.id] in exposed:
                    exposed[origin[ev.id]] += t - clock[s]
                clock[s] = t
        elif comm is not None and s in comm.streams:
            start = clock[s]
            clock[s] = comm.finish(ev, clock[s])
            if spans:
                timed.append((s, ev.name, start, clock[s], 0))
        elif kind in ("Fetch", "WriteBack"):
            d = link[s]
            at = clock[s]
            both_s = float("inf") if ev.duplex else links[other[d]].busy_until(at) - at
            on_link = copy_seconds(ev.dst.nbytes, both_s, duplex[d], one_way[d])
            start, clock[s] = links[d].occupy(at, on_link)
            if spans:
                timed.append((s, ev.name, start, clock[s], ev.dst.nbytes))
        else:
            d = seconds(ev)
            if spans:
                timed.append((s, ev.name, clock[s], clock[s] + d, 0))
            clock[s] += d
            if s == "compute":
                busy += d
    by_round.append(dict(exposed))
    busy_at.append(busy)
    per = [{k: b[k] - (by_round[i - 1][k] if i else 0.0) for k in b} for i, b in enumerate(by_round)]
    busy_per = [b - (busy_at[i - 1] if i else 0.0) for i, b in enumerate(busy_at)]
    return Timeline(total_s=max(clock.values()), round_end_s=tuple(round_end),
                    compute_busy_s=busy, exposed_s=exposed, exposed_by_round=tuple(per),
                    busy_by_round=tuple(busy_per), events=schedule.events,
                    spans=tuple(timed))
