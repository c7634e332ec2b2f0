"""Overlapped rounds of a ring ("fill overlapped with drain", issue 56) as data and their timing:
the order in which each rank runs its (round, layer, chunk) computes when the next round's
forward of its first `depth` local layers may run where the rank would otherwise wait for this
round's backward, and the step that order takes over a link, every rank timed together, op by
op. Round k+1's forward ops are only ever moved ahead of round k's backward ops on the same rank,
never a backward ahead of an older backward: each layer's gradient still sums its rounds in
round order (the order check in overlap_orders proves it for every order it returns).

Pure Python: never imports array libraries or memplan.search (the seconds of every op arrive as
plain numbers in RingCosts), never compiles a step, never touches a device."""

from __future__ import annotations

import dataclasses

FWD, HEAD, BWD = "f", "h", "b"

POLICIES = ("wait", "tail", "eager")
"""When a rank runs a hoisted forward (of the next round, one of its first `depth` local layers)
instead of its plain next op: 'wait' only where it starts strictly before the plain op could
(the rank would otherwise wait); 'tail' also at the same time as the plain op once the plain op
is a backward of the rank's first local layer (its drain's tail, off the round's critical
path); 'eager' whenever it can start no later than the plain op. Which is fastest depends on the
ring (none is for every ring): the planner times each and keeps the fastest
(dataflow.memplan.search.ring_overlap), a choice every rank derives alike from the same plans."""


@dataclasses.dataclass(frozen=True, slots=True)
class RingCosts:
    """What the op-level timing of a ring needs: who owns each global layer, the seconds of
    every layer's forward and backward per chunk, each rank's head seconds a round, and the
    link's one hop (a chunk's residual or gradient)."""

    owners: tuple[int, ...]
    chunks: int
    rounds: int
    fwd_s: tuple[tuple[float, ...], ...]
    """Per global layer, per chunk."""
    bwd_s: tuple[tuple[float, ...], ...]
    """Per global layer, per chunk (recompute included)."""
    head_s: tuple[float, ...]
    """Per rank, a round's head (0 where the rank holds none)."""
    head_rank: int
    vocab: bool
    """A vocabulary-parallel head: every rank's head of a round starts when every rank's forward
    of it is done and ends for all at once, vocab_s (its messages) after the slowest shard."""
    vocab_s: float
    hop_s: float

    @property
    def n_ranks(self) -> int:
        return max(self.owners) + 1


@dataclasses.dataclass(frozen=True, slots=True)
class OverlapTiming:
    step_s: float
    """The step's compute and messages: the last op's end on any rank."""
    busy_s: tuple[float, ...]
    """Per rank, seconds of compute."""
    orders: tuple[tuple[tuple, ...], ...]
    """Per rank, its ops in the order it ran them: (kind, round, global layer, chunk)."""
    hoisted: int
    """Forward ops run ahead of the previous round's backward on their rank."""
    policy: str = "wait"


def rank_sequence(c: RingCosts, rank: int, rnd: int) -> list[tuple]:
    """Rank `rank`'s ops of round `rnd` in the plain ring's order: its layers' forwards
    layer-major (chunks ascending), its head, its layers' backwards in reverse (chunks
    descending), as the compiled round runs them (dataflow.memplan.step.rounds)."""
    mine = [g for g, r in enumerate(c.owners) if r == rank]
    out = [(FWD, rnd, g, k) for g in mine for k in range(c.chunks)]
    if c.vocab or rank == c.head_rank:
        out.append((HEAD, rnd, -1, -1))
    out += [(BWD, rnd, g, k) for g in reversed(mine) for k in reversed(range(c.chunks))]
    return out


def _seconds(c: RingCosts, op: tuple) -> float:
    kind, _, g, k = op
    if kind == FWD:
        return c.fwd_s[g][k]
    if kind == BWD:
        return c.bwd_s[g][k]
    return (max(c.head_s) + c.vocab_s) if c.vocab else c.head_s[c.head_rank]


class _Ring:
    """The state of the op-by-op timing: per rank its plain sequence and position, the hoist
    candidates of the next round, when it is free, when its send stream is free; per op when it
    ended; per message when it arrived."""

    def __init__(self, c: RingCosts, depth: int, policy: str):
        self.c, self.depth, self.policy, n = c, depth, policy, c.n_ranks
        self.seq = [[op for rnd in range(c.rounds) for op in rank_sequence(c, r, rnd)]
                    for r in range(n)]
        self.pos = [0] * n
        self.free = [0.0] * n
        self.send_free = [0.0] * n
        self.end: dict[tuple, float] = {}
        self.arrive: dict[tuple, float] = {}
        self.fwd_left = [{rnd: sum(1 for op in rank_sequence(c, r, rnd) if op[0] == FWD)
                          for rnd in range(c.rounds)} for r in range(n)]
        self.fwd_done_at: dict[int, float] = {}
        self.head_wait: dict[int, dict[int, float]] = {}
        self.orders = [[] for _ in range(n)]
        self.busy = [0.0] * n
        self.hoisted = 0
        self.mine = [[g for g, o in enumerate(c.owners) if o == r] for r in range(n)]

    def ready(self, r: int, op: tuple) -> float | None:
        """When op's inputs are on rank r, or None while they are not known yet."""
        c, (kind, rnd, g, k) = self.c, op
        if kind == FWD:
            if g == 0:
                return 0.0
            src = (FWD, rnd, g - 1, k)
            return self.end.get(src) if c.owners[g - 1] == r else self.arrive.get(src)
        if kind == HEAD:
            return self.fwd_done_at.get(rnd) if c.vocab else \
                self.end.get((FWD, rnd, len(c.owners) - 1, c.chunks - 1))
        if g == len(c.owners) - 1:
            return self.end.get((HEAD, rnd, -1, -1, c.head_rank if not c.vocab else r))
        src = (BWD, rnd, g + 1, k)
        return self.end.get(src) if c.owners[g + 1] == r else self.arrive.get(src)

    def hoist(self, r: int) -> tuple | None:
        """The next forward op of the round after the current one that rank r may run early:
        the current op is in its round's backward, the op is in the rank's first `depth`
        local layers and not yet run."""
        if not self.depth or self.pos[r] >= len(self.seq[r]):
            return None
        kind, rnd = self.seq[r][self.pos[r]][:2]
        if kind != BWD or rnd + 1 >= self.c.rounds:
            return None
        for g in self.mine[r][:self.depth]:
            for k in range(self.c.chunks):
                if (FWD, rnd + 1, g, k) not in self.end:
                    return (FWD, rnd + 1, g, k)
        return None

    def skip_done(self, r: int) -> None:
        seq = self.seq[r]
        while self.pos[r] < len(seq) and seq[self.pos[r]] in self.end:
            self.pos[r] += 1


def _candidate(ring: _Ring, r: int) -> tuple[float, tuple, bool] | None:
    """(start, op, hoisted) of the op rank r would run next if no input came sooner: its plain
    next op, or a hoisted one where the policy (POLICIES) prefers it."""
    ring.skip_done(r)
    if ring.pos[r] >= len(ring.seq[r]) or ring.free[r] == float("inf"):
        return None  # done, or waiting in a vocabulary-parallel head's collective
    plain = ring.seq[r][ring.pos[r]]
    t = ring.ready(r, plain)
    best = None if t is None else (max(t, ring.free[r]), plain, False)
    if plain[0] == HEAD and ring.c.vocab and best is not None:
        return best
    h = ring.hoist(r)
    if h is not None:
        th = ring.ready(r, h)
        th = None if th is None else max(th, ring.free[r])
        eager = ring.policy == "eager" or (ring.policy == "tail" and plain[0] == BWD
                                           and plain[2] == ring.mine[r][0])
        if th is not None and (best is None or th < best[0] or (eager and th <= best[0])):
            best = (th, h, True)
    return best


def _commit(ring: _Ring, r: int, start: float, op: tuple, hoisted: bool) -> None:
    c = ring.c
    kind, rnd, g, k = op
    if kind == HEAD and c.vocab:  # a collective: ends on every rank once every rank is in it
        waiting = ring.head_wait.setdefault(rnd, {})
        waiting[r] = start
        ring.free[r] = float("inf")  # the rank sits in the collective
        if len(waiting) < c.n_ranks:
            return
        end = max(waiting.values()) + _seconds(c, op)
        for q, s in waiting.items():
            ring.end[(HEAD, rnd, -1, -1, q)] = end
            ring.end[(HEAD, rnd, -1, -1)] = end
            ring.free[q] = end
            ring.busy[q] += c.head_s[q]
            ring.orders[q].append(op)
            ring.pos[q] += 1
        return
    end = start + _seconds(c, op)
    ring.end[op] = end
    if kind == HEAD:
        ring.end[(HEAD, rnd, -1, -1, r)] = end
    ring.free[r] = end
    ring.busy[r] += _seconds(c, op)
    ring.orders[r].append(op)
    ring.hoisted += hoisted
    if not hoisted:
        ring.pos[r] += 1
    if kind == FWD:
        ring.fwd_left[r][rnd] -= 1
        if all(left[rnd] == 0 for left in ring.fwd_left):
            ring.fwd_done_at[rnd] = max(ring.end[(FWD, rnd, q, kk)] for q in range(len(c.owners))
                                        for kk in range(c.chunks))
    nxt = g + 1 if kind == FWD else g - 1
    if kind != HEAD and 0 <= nxt < len(c.owners) and c.owners[nxt] != r:
        s = max(ring.send_free[r], end) + c.hop_s
        ring.send_free[r] = s
        ring.arrive[op] = s


def time_overlapped(c: RingCosts, depth: int, policy: str = "wait") -> OverlapTiming:
    """The step of the ring over its rounds with the next round's forward of each rank's first
    `depth` local layers allowed ahead of this round's backward (0: the plain ring), op by op:
    each rank runs one op at a time, its plain sequence in order, taking a hoisted op where
    `policy` (POLICIES) says; the op that starts earliest over the ring is committed first, so no later message could have
    made another choice start sooner. A send occupies the sender's send stream for one hop."""
    if depth < 0:
        raise ValueError(f"overlap depth {depth}: use 0 (off) or a number of local layers")
    if policy not in POLICIES:
        raise ValueError(f"overlap policy {policy!r}: use one of {', '.join(POLICIES)}")
    ring = _Ring(c, depth, policy)
    n = c.n_ranks
    cand = [_candidate(ring, r) for r in range(n)]
    while True:
        live = [(cd[0], r) for r, cd in enumerate(cand) if cd is not None]
        if not live:
            break
        _, r = min(live)
        start, op, hoisted = cand[r]
        _commit(ring, r, start, op, hoisted)
        # only the rank that ran and the ranks its op feeds can have a new candidate (every
        # rank after a vocabulary-parallel head's collective or its round's last forward)
        touched = set(range(n)) if c.vocab else {r}
        g = op[2]
        for h in (g - 1, g + 1):
            if op[0] != HEAD and 0 <= h < len(c.owners):
                touched.add(c.owners[h])
        if op[0] == FWD and g == len(c.owners) - 1:
            touched.add(c.head_rank)
        if op[0] == HEAD:
            touched.add(c.owners[-1])
        for q in touched:
            cand[q] = _candidate(ring, q)
    if any(ring.pos[r] < len(ring.seq[r]) for r in range(n)):
        stuck = [(r, ring.seq[r][ring.pos[r]]) for r in range(n) if ring.pos[r] < len(ring.seq[r])]
        raise RuntimeError(f"overlapped ring deadlocked (rank, op waiting): {stuck[:4]}")
    orders = tuple(tuple(o) for o in ring.orders)
    check_gradient_order(orders)
    step = max(ring.end[op] for op in ring.end)
    return OverlapTiming(step_s=step, busy_s=tuple(ring.busy), orders=orders,
                         hoisted=ring.hoisted, policy=policy)


def check_gradient_order(orders) -> None:
    """Every layer's backward ops in round order on its rank (its gradient sums keep the plain
    ring's order, so the overlapped ring's bits are the plain ring's): raises where not."""
    for r, order in enumerate(orders):
        last: dict[int, int] = {}
        for kind, rnd, g, _ in order:
            if kind != BWD:
                continue
            if last.get(g, -1) > rnd:
                raise AssertionError(f"rank {r}: layer {g}'s backward of round {rnd} after "
                                     f"round {last[g]}'s; the gradient sums would change order")
            last[g] = rnd
