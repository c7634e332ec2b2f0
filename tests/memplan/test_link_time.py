"""The compiled schedule's simulation carries each direction of the host link once
(memplan.step.sim.LinkTime): two streams' copies over the D2H link (the round's write-backs and a
deferred update's) share it instead of each running at the link's rate, and a streamed update's
pieces, which run beside copies the other way by construction, are timed at the duplex rate.
Hand timelines; no plan."""

from __future__ import annotations

import random

import pytest

from dataflow.memplan.step.events import Fetch, Ref, RegionTable, Schedule, WriteBack
from dataflow.memplan.step.sim import LinkTime, simulate_schedule

GB = 1_000_000_000


def test_a_copy_fills_the_links_free_time_from_when_it_is_issued():
    link = LinkTime()
    assert link.occupy(0.0, 1.0) == (0.0, 1.0)
    assert link.occupy(3.0, 1.0) == (3.0, 4.0)
    assert link.occupy(0.5, 1.5) == (1.0, 2.5)  # waits for the first, fits the gap before 3
    assert link.occupy(2.0, 1.0) == (2.5, 4.5)  # the gap's last 0.5 s, then after the second
    assert (link.starts, link.ends) == ([0.0], [4.5])
    assert link.busy_until(0.2) == 4.5 and link.busy_until(6.0) == 6.0


def test_the_link_never_carries_more_than_its_time():
    """Random copies: every copy gets its seconds, after it is issued, and the busy intervals
    stay disjoint and sum to exactly the seconds asked."""
    rng = random.Random(40)
    for _ in range(50):
        link, asked = LinkTime(), 0.0
        for _ in range(40):
            at, s = rng.uniform(0, 10), rng.uniform(0.01, 1.0)
            first, end = link.occupy(at, s)
            asked += s
            assert first >= at and end >= first + s - 1e-9
        assert all(e <= s for e, s in zip(link.ends, link.starts[1:]))
        assert sum(e - s for s, e in zip(link.starts, link.ends)) == pytest.approx(asked)


def _schedule(*events) -> Schedule:
    table = RegionTable(device=(), host=(), device_budget=0, host_budget=0)
    return Schedule(table, tuple(events), 1, (0,), len(events), 0)


def _ref(nbytes: int) -> Ref:
    return Ref("x", 0, nbytes)


def test_two_streams_writing_home_share_the_d2h_link(h100):
    """A deferred update's write-back (the opt stream) and a round's (the d2h stream), both
    issued at 0: the second ends when the link has carried both, not when it alone would."""
    n = 11 * GB
    sch = _schedule(WriteBack("opt.d2h.L0", _ref(n), _ref(n), stream="opt"),
                    WriteBack("act.d2h", _ref(n), _ref(n)))
    tl = simulate_schedule(sch, lambda ev: 0.0, h100, spans=True)
    one = n / h100.d2h_bytes_per_s
    assert tl.total_s == pytest.approx(2 * one)
    assert [(s, a, b) for s, _, a, b, _ in tl.spans] == [("opt", 0.0, pytest.approx(one)),
                                                          ("d2h", pytest.approx(one),
                                                           pytest.approx(2 * one))]


def test_a_streamed_updates_copies_run_at_the_duplex_rate(h100):
    """Fetch / WriteBack duplex=True (memplan.step.update's pieces) take the duplex rate even
    when nothing else is on the link at the moment the simulation places them; a plain copy
    alone takes the one-way rate."""
    n = 4 * GB
    sch = _schedule(Fetch("opt.h2d.L0", _ref(n), _ref(n), duplex=True),
                    Fetch("w.h2d", _ref(n), _ref(n)),
                    WriteBack("opt.d2h.L0", _ref(n), _ref(n), stream="opt", duplex=True))
    tl = simulate_schedule(sch, lambda ev: 0.0, h100, spans=True)
    (_, _, a0, b0, _), (_, _, a1, b1, _), (_, _, a2, b2, _) = tl.spans
    assert b0 - a0 == pytest.approx(n / h100.h2d_duplex_bytes_per_s)
    assert b2 - a2 == pytest.approx(n / h100.d2h_duplex_bytes_per_s)
    # the plain fetch after it: the D2H link is busy (the write-back) only until b2
    assert a1 == pytest.approx(b0) and b1 > a1 + n / h100.h2d_bytes_per_s - 1e-9
