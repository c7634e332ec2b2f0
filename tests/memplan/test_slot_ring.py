"""dataflow.memplan.step.slot_ring._Ring, taken ahead of turn (what the schedule's K/V re-forming a layer ahead
does): `ready` says whether a use's fetch could be issued, and `acquire` refuses a slot whose
fetch never was (it would read the block the slot still holds)."""

from __future__ import annotations

import pytest

from dataflow.memplan.step.events import Fetch, Ref, Wait
from dataflow.memplan.step.slot_ring import _Emitter, _Ring, _Use


def _ring(n_slots: int, n_uses: int = 3) -> _Ring:
    em = _Emitter()
    ring = _Ring(em, [Ref("slots", i * 64, 64) for i in range(n_slots)], "w")
    uses = [_Use(key=f"layer{i}", fetch=Ref(f"home.layer{i}", 0, 64)) for i in range(n_uses)]
    ring.begin(uses, ring.assign(uses))
    return ring


def test_one_slot_is_not_ready_for_the_next_use_until_the_current_one_is_released():
    ring = _ring(1)
    ring.acquire(0)
    assert not ring.ready(1)
    with pytest.raises(RuntimeError, match="acquired before its fetch could be issued"):
        ring.acquire(1)
    ring.release(0)
    assert ring.ready(1)
    ring.acquire(1)


def test_two_slots_let_the_next_use_be_taken_while_the_current_one_is_held():
    ring = _ring(2)
    ring.acquire(0)
    assert ring.ready(1)
    ring.acquire(1)  # waits for its own fetch: the compute stream's wait on its record
    events = ring.em.events
    fetch = [i for i, ev in enumerate(events) if isinstance(ev, Fetch) and "layer1" in ev.name]
    assert fetch and any(isinstance(ev, Wait) for ev in events[fetch[0]:])
    ring.release(0)
    ring.acquire(1)  # its turn comes: taken again without a second fetch
    assert sum(isinstance(ev, Fetch) and "layer1" in ev.name for ev in ring.em.events) == 1
