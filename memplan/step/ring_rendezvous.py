"""Whether a ring's compiled schedules can run over a transport that matches each link's messages
in the order they were sent and completes a send only once its receive is posted: NCCL's
point-to-point calls (one communicator per directed neighbour pair, ring/nccl.py) for large
messages. Each rank's streams run their events in order, a Wait holds its stream until the
Record it names has passed, a Send ends no sooner than its Recv starts and a Recv no sooner than
its Send starts. The schedules deadlock under those rules exactly when the graph of what must
happen before what has a cycle; `check_rendezvous` finds one, or the first link whose receives
do not take its sends in order. Collectives across replicas (AllReduce, ReduceScatter,
GatherParts) are taken as events of their stream alone. Pure Python: never imports array
libraries, never touches a device."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.step.events import Record, Wait
from dataflow.memplan.step.ring_compile import Recv, Send, compile_ring_schedule
from dataflow.models.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class RendezvousReport:
    """What check_rendezvous found: `order` names the first link (sender -> receiver) whose
    k-th receive does not carry its k-th send's tag and size ('' when every link's do); `cycle`
    the events, "rank r: name (start|end)", of one cycle of waits ('()' when there is none)."""

    sends: int
    order: str = ""
    cycle: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.order and not self.cycle


def check_rendezvous(schedules, *, rendezvous: bool = True) -> RendezvousReport:
    """`schedules`: one compiled step per rank of a ring (rank r's at index r). rendezvous False:
    sends complete without their receiver (a transport with room for every message in flight,
    as the shared-memory one has), so only the links' order is checked and any cycle comes from
    the schedules themselves."""
    deps: list[list[int]] = []
    names: list[str] = []

    def node(label: str, *after: int | None) -> int:
        deps.append([a for a in after if a is not None])
        names.append(label)
        return len(deps) - 1

    links: dict[tuple[int, int], tuple[list, list]] = {}
    for rank, sch in enumerate(schedules):
        last: dict[str, int | None] = {}
        records: dict[int, int | None] = {}
        for ev in sch.events:
            kind = type(ev)
            if kind is Record:
                records[ev.id] = last.get(ev.stream)
                continue
            if kind is Wait:
                last[ev.stream] = node(f"rank {rank}: wait {ev.id} on {ev.stream}",
                                       last.get(ev.stream), records.get(ev.id))
                continue
            start = node(f"rank {rank}: {ev.name} (start)", last.get(ev.stream))
            end = node(f"rank {rank}: {ev.name} (end)", start)
            last[ev.stream] = end
            if kind is Send:
                links.setdefault((rank, ev.peer), ([], []))[0].append(
                    (ev.tag, ev.src.nbytes, start, end))
            elif kind is Recv:
                links.setdefault((ev.peer, rank), ([], []))[1].append(
                    (ev.tag, ev.dst.nbytes, start, end))
    sends = 0
    for (src, dst), (sent, got) in sorted(links.items()):
        sends += len(sent)
        if [m[:2] for m in sent] != [m[:2] for m in got]:
            at = next((i for i, (a, b) in enumerate(zip(sent, got)) if a[:2] != b[:2]),
                      min(len(sent), len(got)))
            return RendezvousReport(sends, order=(
                f"rank {src} -> rank {dst}: message {at} is sent as (tag, bytes) "
                f"{sent[at][:2] if at < len(sent) else None} but received as "
                f"{got[at][:2] if at < len(got) else None}"))
        for (_, _, s_start, s_end), (_, _, r_start, r_end) in zip(sent, got):
            deps[r_end].append(s_start)
            if rendezvous:
                deps[s_end].append(r_start)
    return RendezvousReport(sends, cycle=_cycle(deps, names))


def _cycle(deps: list[list[int]], names: list[str]) -> tuple[str, ...]:
    """One cycle of the graph (node -> the nodes it waits for), as names, or () if none."""
    state = [0] * len(deps)  # 0 unseen, 1 on the path, 2 done
    for root in range(len(deps)):
        if state[root]:
            continue
        path, stack = [], [(root, iter(deps[root]))]
        state[root] = 1
        path.append(root)
        while stack:
            n, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[n] = 2
            elif state[nxt] == 1:
                return tuple(names[m] for m in path[path.index(nxt):])
            elif state[nxt] == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(deps[nxt])))
    return ()


def refuse_rendezvous_deadlock(plans, update: str = "deferred", *, what: str = "this ring") -> int:
    """Compile every rank plan of one ring (`plans`, rank order) as its process will and raise
    ConfigError, naming the first problem, where the schedules would hang or mismatch over a
    rendezvous transport (NCCL); returns the messages checked."""
    report = check_rendezvous([compile_ring_schedule(rp, update=update) for rp in plans])
    if report.order:
        raise ConfigError(f"{what} over NCCL: its messages would be received out of the order "
                          f"they are sent ({report.order}); use --transport shm")
    if report.cycle:
        raise ConfigError(f"{what} over NCCL would deadlock: a send waits for a receive that "
                          f"waits for it ({' <- '.join(report.cycle[:6])}, ...); use "
                          "--transport shm")
    return report.sends
