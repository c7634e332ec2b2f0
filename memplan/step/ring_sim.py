"""How a ring rank's compiled schedule is timed: the arrivals of the simulated ring's messages
(each rank timed in a thread) and RingComm, the durations simulate_schedule gives the events of
the communication streams (Send, Recv, AllReduce, GatherParts). Never compiles, never predicts a
plan (dataflow.memplan.search.predict does), never touches a device or a network."""

from __future__ import annotations

import dataclasses
import threading

from dataflow.memplan.step.ring_compile import (COMM_STREAMS, GatherParts, Recv, ReduceScatter,
                                              Send)


class Arrivals:
    """When each message of a simulated ring is in its receiver's buffer, posted by the sending
    rank's simulation and awaited by the receiving rank's (each rank is timed in a thread)."""

    def __init__(self, timeout_s: float = 600.0):
        self._cv = threading.Condition()
        self._times: dict = {}
        self.timeout_s = timeout_s

    def post(self, key, t: float) -> None:
        with self._cv:
            self._times[key] = t
            self._cv.notify_all()

    def take(self, key) -> float:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._times, self.timeout_s):
                raise RuntimeError(f"simulated ring: message {key} (sending rank, tag) never "
                                   "sent: the ranks' schedules do not match")
            return self._times[key]


@dataclasses.dataclass(slots=True)
class RingComm:
    """How dataflow.memplan.step.sim.simulate_schedule times one rank's communication: a Send
    occupies the send stream for bytes / link rate + latency, after which its message has arrived; a
    Recv ends when its stream reaches it or when the matching message (peer, tag) arrived, whichever
    is later; an AllReduce of B bytes over R replicas takes a ring all-reduce's 2 (R - 1) / R * B /
    rate + latency, a GatherParts of B bytes an all-gather's (R - 1) / R * B / rate + latency (the
    replicas run in step), a ReduceScatter half an all-reduce's: (R - 1) / R * B / rate + latency
    (RankPlan.split_update). `reduce` False: the all-reduce and the reduce-scatter take no time (a
    layout that adds them to the step itself)."""

    rank: int
    replicas: int
    bytes_per_s: float
    latency_s: float
    arrivals: Arrivals | None
    streams: tuple = COMM_STREAMS
    reduce: bool = True

    def finish(self, ev, start: float) -> float:
        if type(ev) is Send:
            end = start + ev.src.nbytes / self.bytes_per_s + self.latency_s
            self.arrivals.post((self.rank, ev.tag), end)
            return end
        if type(ev) is Recv:
            return max(start, self.arrivals.take((ev.peer, ev.tag)))
        r = self.replicas
        if type(ev) is GatherParts:
            return start + (r - 1) / r * ev.dst.nbytes / self.bytes_per_s + self.latency_s
        if not self.reduce:
            return start
        if type(ev) is ReduceScatter:
            return start + (r - 1) / r * ev.dst.nbytes / self.bytes_per_s + self.latency_s
        return start + 2 * (r - 1) / r * ev.dst.nbytes / self.bytes_per_s + self.latency_s
