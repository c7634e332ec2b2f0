"""The step of one ring rank as data: the single-device schedule of the rank's own plan (its
layers, slots, fetches, write-backs, optimizer) plus Send / Recv events that carry the residual
stream of each chunk to rank (r+1) mod N in the forward and its gradient to rank (r-1) mod N in
the backward. Sends and receives are ordered on their own stream ('comm') by the same Record /
Wait events as everything else, so a transport can overlap them with compute. Sends and
receives get a stream each ('send', 'recv'): with rendezvous semantics (NCCL, large messages) a
send that waits for its receiver must never sit in front of a receive the receiver needs first.

Reuses dataflow.memplan.step.compile's compiler whole (slot rings, fetch timing, the round, the optimizer)
and overrides only its hooks (a layer's input arrives, its output leaves, a block's gradient is
final, which blocks are owned): no `if ring:` branch exists in the single-device code. Pure
Python: never imports array libraries, never touches a device, never talks to another rank."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.ranks import RankPlan, moe_routing_chain
from dataflow.memplan.step.compile import (
    COMPUTE,
    H2D,
    HOST,
    Fetch,
    HostTask,
    Ref,
    Schedule,
    StepCompiler,
)
from dataflow.memplan.step.events import Compute
from dataflow.memplan.step.ring_rounds import OverlapRounds
from dataflow.memplan.step.ring_split import (GATHER, REDUCE, GatherParts, ReduceScatter,
                                              SplitUpdate)
from dataflow.memplan.step.ring_vocab import VocabHead
from dataflow.memplan.step.state import EMBED, HEAD, BlockKey
from dataflow.models.errors import ConfigError

SEND, RECV = "send", "recv"
COMM_STREAMS = (SEND, RECV, REDUCE, GATHER)
"""The streams of sends, of receives, of the replicas' gradient all-reduce and of their weight
parts' gathers (a transport maps each to a CUDA stream of its own, or all to the backend's host
stream)."""

PART_ALIGN = 64
"""Bytes a split weight use's parts are aligned to: a use whose slot bytes do not split into
R parts of a multiple of this is fetched whole (the same on every replica)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """Send the bytes `src` to rank `peer` on the comm stream; `tag` is checked on arrival."""

    name: str
    src: Ref
    peer: int
    tag: int
    stream: str = SEND


@dataclasses.dataclass(frozen=True, slots=True)
class Recv:
    """Receive into `dst` the next message from rank `peer`; it must carry `tag`."""

    name: str
    dst: Ref
    peer: int
    tag: int
    stream: str = RECV


@dataclasses.dataclass(frozen=True, slots=True)
class AllReduce:
    """Sum the gradient bytes `dst` (elements of `dtype`) over the R replicas of this ring rank,
    in place, on the reduce stream; every replica ends with the same bits."""

    name: str
    dst: Ref
    dtype: str
    stream: str = REDUCE


def message_tag(rnd: int, backward: bool, layer: int, chunk: int, n_layers: int,
                n_chunks: int) -> int:
    """A number unique within a step for the residual (or gradient) of `chunk` leaving global
    layer `layer`: sender and receiver compute it alike, so a mismatched schedule is caught."""
    return ((rnd * 2 + int(backward)) * n_layers + layer) * n_chunks + chunk


class ReplicaCompiler(SplitUpdate, StepCompiler):
    """Rank r's compiler with data-parallel replicas: the single-device compiler of the rank's
    plan plus an all-reduce of each owned block's gradient where it is final. A ring of one rank
    (plain data parallelism) is this alone: the single-device round, nothing to send. With
    rp.split_fetch, replica `replica` fetches its part of every streamed weight use and the
    replicas gather the rest from each other (fetch_part)."""

    def __init__(self, rp: RankPlan, replica: int = 0):
        super().__init__(rp.plan)
        self.rp, self.replica = rp, replica
        if not 0 <= replica < rp.replicas:
            raise ValueError(f"replica {replica} of {rp.replicas}: use 0 <= replica < replicas")
        if rp.split_fetch and rp.replicas > 1:
            for ring in (self.wring, self.hw_ring):
                if ring is not None:
                    ring.fetch = self.fetch_part
        self._split_setup()  # RankPlan.split_update: the parts, the own-part m / v regions

    def fetch_part(self, use, slot: Ref, name: str) -> int | None:
        """A streamed weight use split over the replicas (the slot ring's fetch hook): this
        replica's part comes over its own host link, the others from the replicas that fetched
        them, every replica holding the same bits at home (all-reduced gradients, the same
        update). The gather waits for this part's copy; the compute waits for the gather (and
        with it the copy). None (fetch whole) where the bytes do not split evenly."""
        r, q, em = self.rp.replicas, self.replica, self.em
        if slot.nbytes % (r * PART_ALIGN):
            return None
        n = slot.nbytes // r
        em.add(Fetch(name, Ref(slot.region, slot.offset + q * n, n),
                     Ref(use.fetch.region, use.fetch.offset + q * n, n)))
        em.wait(GATHER, em.record(H2D))
        em.add(GatherParts(name.replace(".h2d", ".gather"), slot, r))
        return em.record(GATHER)

    def allreduce(self, what: str, grads: Ref, stream: str = COMPUTE) -> None:
        """Data-parallel replicas: the finished gradient `grads` (written on `stream`) is summed
        over the replicas before anything reads it again (its squared norm, its write-back home,
        the optimizer). With split_update a split block's is reduce-scattered instead."""
        em = self.em
        em.wait(REDUCE, em.record(stream))
        if self.splits(what):
            em.add(ReduceScatter(f"reducescatter.{what}", grads, self.gdt, self.rp.replicas,
                                 self.byte_bounds(grads, self.gbpe)))
        else:
            em.add(AllReduce(f"allreduce.{what}", grads, self.gdt))
        em.wait(stream, em.record(REDUCE))

    def grads_final(self, what: str, grads: Ref, stream: str) -> None:
        """In the last round a block's gradient is complete where its squared norm is taken: with
        replicas, all-reduce it there first (layers, head, a device embedding)."""
        if self.rp.replicas > 1:
            self.allreduce(what, grads, stream)

    def embed_bwd(self, rnd: int, dx: str) -> None:
        """A HOME embedding's gradient is finished on the host, by the last round's scatter: with
        replicas its all-reduce goes between that scatter and the host's squared norm. (Spliced
        in after the fact rather than through grads_final, which would number the host's record
        after the all-reduce's and so change the schedule's event ids.)"""
        events = self.em.events
        start = len(events)
        super().embed_bwd(rnd, dx)
        if self.rp.replicas == 1 or rnd != self.last_round or \
                self.block(EMBED, "grads", False) is not None:
            return
        at = next(i for i in range(start, len(events)) if type(events[i]) is HostTask
                  and events[i].op == "grad_sumsq")
        tail = events[at:]
        del events[at:]
        self.allreduce("embed", self.block(EMBED, "grads", True), HOST)
        events.extend(tail)


class RingCompiler(OverlapRounds, VocabHead, ReplicaCompiler):
    """Rank r of a ring of N > 1: the rank's plan is a single-device plan of its own layers
    (local layer j is global layer rp.layers[j]); the single-device round runs them, and the
    hooks below receive each layer's input from the previous rank and send its output on.
    A placement other than cyclic gives a rank *runs* of consecutive global layers: only a
    run's first layer receives (forward) and only its last sends; inside a run the layers
    ping-pong between the two residual buffers as on one device."""

    def __init__(self, rp: RankPlan, replica: int = 0):
        if getattr(rp.plan, "segment_layers", 1) > 1:
            raise ConfigError(f"rank {rp.rank}'s plan recomputes segments of "
                              f"{rp.plan.segment_layers} layers, which a ring rank cannot run "
                              "(dataflow.memplan.search.ring_plan refuses such plans); plan it again")
        self.run_pos = []
        """Each local layer's position in its run of consecutive global layers (0: first)."""
        for j, g in enumerate(rp.layers):
            self.run_pos.append(self.run_pos[-1] + 1 if j and rp.layers[j - 1] == g - 1 else 0)
        super().__init__(rp, replica)
        # With a vocabulary-parallel head every rank runs the round's head (its shard).
        self.has_embed, self.has_head = rp.has_embed, rp.holds_head_block
        if rp.vocab_parallel:
            self._vocab_setup()
        self.prev = (rp.rank - 1) % rp.n_ranks
        self.next = (rp.rank + 1) % rp.n_ranks
        self.sent: dict[tuple[str, int], int] = {}
        """(buffer, chunk) -> send-stream event after which a send of those rows is done."""
        self.chain_pos = None
        """An MoE model: this rank's place in routing_chain (the ranks by their last layer)."""
        if rp.plan.model.moe is not None:
            chain = moe_routing_chain(rp.plan.model.name, rp.n_layers, rp.n_ranks, rp.owners,
                                      rp.placement)
            self.chain_pos = chain.index(rp.rank)
        self._totals_back: set[int] = set()
        """Rounds whose backward has its routing totals (passed back before its first layer)."""
        self._overlap_setup()  # RankPlan.round_overlap: the overlapped order and its regions

    def rows(self, buffer: str, chunk: int) -> Ref:
        off, nbytes = self._transition(buffer)
        per = nbytes // self.C
        return self.ref("transitions", off + chunk * per, per)

    def tag(self, rnd: int, backward: bool, layer: int, chunk: int) -> int:
        return message_tag(rnd, backward, layer, chunk, self.rp.n_layers, self.C)

    def recv(self, rnd: int, backward: bool, src_layer: int, buffer: str, chunk: int) -> None:
        em = self.em
        em.wait(RECV, em.record(COMPUTE))  # earlier computes are done reading these rows
        # ... and an earlier send of them (a run's last output may sit where a receive lands)
        em.wait(RECV, self.sent.pop((buffer, chunk), None))
        em.add(Recv(f"recv.{'b' if backward else 'f'}.L{src_layer}.c{chunk}",
                    self.rows(buffer, chunk), self.next if backward else self.prev,
                    self.tag(rnd, backward, src_layer, chunk)))
        em.wait(COMPUTE, em.record(RECV))

    def send(self, rnd: int, backward: bool, layer: int, buffer: str, chunk: int) -> None:
        em = self.em
        em.wait(SEND, em.record(COMPUTE))  # the compute that wrote the rows is done
        em.add(Send(f"send.{'b' if backward else 'f'}.L{layer}.c{chunk}",
                    self.rows(buffer, chunk), self.prev if backward else self.next,
                    self.tag(rnd, backward, layer, chunk)))
        self.sent[(buffer, chunk)] = em.record(SEND)

    # -- an MoE model's routing totals ------------------------------------------------------
    # Every layer's backward needs the round's routing totals over ALL layers (the load-balancing
    # loss's gradient), and each rank adds only its own layers' routing. After a rank's last
    # forward of the round its totals are final; the ranks in the order of their last layers
    # (routing_chain: neighbours, the head last) pass them on, each adding what it received
    # (moe_totals_add), so the head's are the ring's, from which it computes the round's
    # losses; before the backward the head's totals travel back along the chain, each rank
    # taking them in place of its own. Counts and fp32 sums go as two small messages with
    # negative tags (an activation's are never negative), after the activation each follows.
    def _totals(self, partial: bool) -> tuple[Ref, Ref]:
        names = (("moe_partial_counts", "moe_partial_sums") if partial
                 else ("moe_counts", "moe_sums"))
        return tuple(self.ref("transitions", *self._transition(n)) for n in names)

    @staticmethod
    def _totals_tag(rnd: int, backward: bool, part: int) -> int:
        return -(1 + 4 * (2 * rnd + int(backward)) + part)

    def _totals_forward(self, rnd: int) -> None:
        """After this rank's last forward of round `rnd`: the earlier ranks' totals added to
        its own, then passed to the next rank (the head keeps them)."""
        em, last = self.em, self.rp.n_ranks - 1
        if self.chain_pos > 0:
            em.wait(RECV, em.record(COMPUTE))  # the last round's add is done with the partials
            for part, ref in enumerate(self._totals(partial=True)):
                em.add(Recv(f"recv.f.totals{part}.r{rnd}", ref, self.prev,
                            self._totals_tag(rnd, False, part)))
            em.wait(COMPUTE, em.record(RECV))
            em.add(Compute(f"moe.totals_add.r{rnd}", "moe_totals_add", rnd))
        if self.chain_pos < last:
            self._send_totals(rnd, False, self.next)

    def _totals_backward(self, rnd: int) -> None:
        """Before this rank's first backward of round `rnd`: the ring's totals from the next
        rank (the head has them), passed on to the previous one (the chain's first keeps them)."""
        em, last = self.em, self.rp.n_ranks - 1
        if self.chain_pos < last:
            em.wait(RECV, em.record(COMPUTE))  # nothing still reads or sends this rank's own
            for part, ref in enumerate(self._totals(partial=False)):
                em.add(Recv(f"recv.b.totals{part}.r{rnd}", ref, self.next,
                            self._totals_tag(rnd, True, part)))
            em.wait(COMPUTE, em.record(RECV))
        if self.chain_pos > 0:
            self._send_totals(rnd, True, self.prev)

    def _send_totals(self, rnd: int, backward: bool, peer: int) -> None:
        em = self.em
        em.wait(SEND, em.record(COMPUTE))  # the totals are final (the compute waited any receive)
        for part, ref in enumerate(self._totals(partial=False)):
            em.add(Send(f"send.{'b' if backward else 'f'}.totals{part}.r{rnd}", ref, peer,
                        self._totals_tag(rnd, backward, part)))
        # before anything on this rank overwrites them (a receive, the next round's clear)
        em.wait(COMPUTE, em.record(SEND))

    # -- the hooks of the single-device round ---------------------------------------------------
    def global_layer(self, layer: int) -> int:
        return self.rp.layers[layer]

    def resid(self, layer: int) -> tuple[str, str]:
        """The first layer of a run reads "resid_a", where its input arrives (or the embedding
        writes it), and writes "resid_b"; the run's later layers ping-pong as on one device
        (layer j+1 reads what layer j wrote). The backward keeps the chain: a layer reads its
        gradient from its forward's input buffer and writes its input gradient to its output
        buffer (the head writes its gradient into the last layer's input buffer)."""
        return ("resid_a", "resid_b") if self.run_pos[layer] % 2 == 0 else ("resid_b", "resid_a")

    def local(self, layer: int, step: int) -> bool:
        """Whether the global layer `step` after local layer `layer`'s (-1: before) is also
        this rank's, the next (or previous) local layer of the same run."""
        j, layers = layer + step, self.rp.layers
        return 0 <= j < len(layers) and layers[j] == layers[layer] + step

    def embed_fwd(self, rnd: int, out: str) -> None:
        """The embedding overwrites every row of `out`: after any send of them is done."""
        for c in range(self.C):
            ev = self.sent.pop((out, c), None)
            self.em.wait(COMPUTE, ev)
            self.em.wait(H2D, ev)
        super().embed_fwd(rnd, out)

    def input_arrives(self, rnd: int, backward: bool, layer: int, buffer: str,
                      chunk: int) -> None:
        """The forward's input comes from the rank of the global layer before (none for layer 0,
        whose input is the embedding's), the backward's from the rank of the layer after (none
        for the last layer, whose gradient is the head's); none either where that layer is this
        rank's too (inside a run its rows are already here)."""
        if backward and self.chain_pos is not None and rnd not in self._totals_back:
            self._totals_back.add(rnd)
            self._totals_backward(rnd)
        g = self.rp.layers[layer]
        if not backward and g > 0 and not self.local(layer, -1):
            self.recv(rnd, False, g - 1, buffer, chunk)
        elif backward and g < self.rp.n_layers - 1 and not self.local(layer, 1):
            self.recv(rnd, True, g + 1, buffer, chunk)

    def before_write(self, buffer: str, chunk: int) -> None:
        """A compute is about to overwrite rows that may still be on their way out (also the
        next round's first computes, of rows the last round sent)."""
        self.em.wait(COMPUTE, self.sent.pop((buffer, chunk), None))

    def output_leaves(self, rnd: int, backward: bool, layer: int, buffer: str,
                      chunk: int) -> None:
        """The forward's output goes to the next layer's rank (the last layer's stays for the
        head), the backward's input gradient to the previous layer's (layer 0's stays for the
        embedding); nothing leaves inside a run (the next layer to run them is this rank's)."""
        g = self.rp.layers[layer]
        if not backward and g < self.rp.n_layers - 1 and not self.local(layer, 1):
            self.send(rnd, False, g, buffer, chunk)
        elif backward and g > 0 and not self.local(layer, -1):
            self.send(rnd, True, g, buffer, chunk)
        if (not backward and self.chain_pos is not None and layer == len(self.rp.layers) - 1
                and chunk == self.C - 1):  # this rank's last forward of the round
            self._totals_forward(rnd)

    def owned_blocks(self) -> list[BlockKey]:
        """AdamW over the blocks this rank owns (the unused embedding / head of other ranks are
        never updated)."""
        keys = [BlockKey.of_layer(j) for j in range(len(self.rp.layers))]
        return keys + [EMBED] * self.rp.has_embed + [HEAD] * self.rp.holds_head_block

    def head(self, rnd: int, final: str, dfinal: str) -> None:
        """The round's head: the single-device one on the head's rank, or this rank's part of
        a vocabulary-parallel head (dataflow.memplan.step.ring_vocab)."""
        if self.rp.vocab_parallel:
            self.vocab_head(rnd, final, dfinal)
        else:
            super().head(rnd, final, dfinal)

    def compile(self, rounds: int | None = None, update: str = "end") -> Schedule:
        return self._sends_done(super().compile(rounds, update))

    def head_eval(self, rnd: int, final: str, other: str) -> None:
        """An evaluation round's head: the single-device one, or this rank's part of a
        vocabulary-parallel head's forward (dataflow.memplan.step.ring_vocab)."""
        if self.rp.vocab_parallel:
            self.vocab_head_eval(rnd, final)
        else:
            super().head_eval(rnd, final, other)

    def compile_eval(self, rounds: int) -> Schedule:
        return self._sends_done(super().compile_eval(rounds))

    def _sends_done(self, sched: Schedule) -> Schedule:
        """Every send must be done before the step ends (the executor synchronises the backend's
        streams, which do not include a GPU transport's send stream)."""
        for ev in self.sent.values():
            self.em.wait(COMPUTE, ev)
        self.sent.clear()
        if self.rp.vocab_parallel:
            self.vocab_sends_done()
        return dataclasses.replace(sched, events=tuple(self.em.events), n_ids=self.em.n_ids)


def _compiler(rp: RankPlan, replica: int = 0) -> ReplicaCompiler:
    return (RingCompiler if rp.n_ranks > 1 else ReplicaCompiler)(rp, replica)


def compile_ring_schedule(rp: RankPlan, *, rounds: int | None = None,
                          update: str = "end", replica: int = 0) -> Schedule:
    """The event list of one step of rank `rp.rank`: its plan's events plus Send / Recv (and
    with rp.split_fetch, replica `replica`'s weight parts: they differ between replicas only in
    which part each fetches).
    `update` as dataflow.memplan.step.compile.compile_schedule: 'deferred' runs the previous step's AdamW of
    this rank's own blocks inside its round 0 (no message is involved: the gradients were
    all-reduced and the clip scale made global before the previous step ended).
    A rank plan with round_overlap runs its rounds overlapped (dataflow.memplan.step.ring_rounds;
    what that does not build yet is refused by name, a ConfigError)."""
    if update == "backward":
        raise ValueError("a ring rank updates after its replicas' gradients are summed and its "
                         "clip scale is global; update='backward' is for one device")
    return _compiler(rp, replica).compile(rounds, update)


def compile_ring_update_schedule(rp: RankPlan, replica: int = 0) -> Schedule:
    """The AdamW of this rank's own blocks alone, after a step compiled with update='none' or
    'deferred' (as dataflow.memplan.step.compile.compile_update_schedule): no sends, no receives
    (with rp.split_update, replica `replica`'s parts and the gathers of the updated weights)."""
    return _compiler(rp, replica).compile_update()


def compile_ring_eval_schedule(rp: RankPlan, rounds: int = 1, replica: int = 0) -> Schedule:
    """A forward-only evaluation of `rounds` rounds on rank `rp.rank` (as
    dataflow.memplan.step.compile.compile_eval_schedule), with the forward's sends and receives: each layer's
    input arrives from the rank before it and its output leaves for the rank after."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"an evaluation needs a whole number of rounds >= 1, got {rounds!r}")
    return _compiler(rp, replica).compile_eval(rounds)


RING_EVENT_TYPES = {cls.__name__: cls for cls in (Send, Recv, AllReduce, GatherParts,
                                                  ReduceScatter)}
"""For Schedule.from_json(text, RING_EVENT_TYPES): a ring schedule's own events."""
