"""Overlapped rounds compiled (issue 56): a ring rank whose plan says RankPlan.round_overlap runs
its rounds' pieces (dataflow.memplan.step.rounds: a round's begin, each layer's forward and
backward chunk by chunk, the head) in the order dataflow.memplan.step.ring_overlap gives it, in
which round k+1's forward of the rank's first `depth` local layers may run during round k's
backward. Two rounds are then in flight, so the odd rounds take a second set of the round's rows
(the residual pair, ids, targets, positions) and a second copy of the hoisted layers' saved
activations, the regions dataflow.memplan.plan.memory.overlap_regions lists (the planner took
their bytes out of the rank's budget). Every layer's gradient still sums its rounds in order
(check_gradient_order), so the step's bits are the plain ring's.

Part of dataflow.memplan.step.ring_compile.RingCompiler; pure Python: never imports array
libraries, never touches a device, never talks to another rank."""

from __future__ import annotations

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.memory import (OVERLAP_ROWS_REGION, overlap_regions, overlap_row_specs,
                                          round_row_name)
from dataflow.memplan.plan.plan import Where
from dataflow.memplan.plan.segments import boundary_kv_sharers, kv_rebuilt
from dataflow.memplan.step.events import Ref, Region, RegionTable
from dataflow.memplan.step.ring_overlap import BWD, FWD, RingCosts, time_overlapped
from dataflow.models.errors import ConfigError

ORDER_COSTS = dict(fwd_s=1.0, bwd_s=2.0, head_s=1.0, hop_s=0.25)
"""The relative op seconds (a chunk's forward, its backward, the head a chunk, a hop) at which
a rank's overlapped order is timed: fixed ratios rather than the planner's op seconds, so every
rank derives the same orders from its own plan alone (its owners, chunks, rounds and depth);
the order changes when ops run, never the step's bits."""


def overlap_orders(owners: tuple[int, ...], chunks: int, rounds: int, depth: int,
                   head_rank: int, vocab: bool = False) -> tuple[tuple[tuple, ...], ...]:
    """Every rank's ops (kind, round, global layer, chunk) in the overlapped order its compiled
    step runs them: dataflow.memplan.step.ring_overlap.time_overlapped at ORDER_COSTS, the
    'wait' policy (a hoisted forward only where the rank would otherwise wait). `vocab`: a
    vocabulary-parallel head, every rank's part of it a collective (its share of the head's
    seconds on each rank)."""
    n, k = max(owners) + 1, ORDER_COSTS
    head = k["head_s"] * chunks
    costs = RingCosts(owners=tuple(owners), chunks=chunks, rounds=rounds,
                      fwd_s=((k["fwd_s"],) * chunks,) * len(owners),
                      bwd_s=((k["bwd_s"],) * chunks,) * len(owners),
                      head_s=tuple(head / n if vocab else head if r == head_rank else 0.0
                                   for r in range(n)),
                      head_rank=head_rank, vocab=vocab, vocab_s=k["hop_s"] if vocab else 0.0,
                      hop_s=k["hop_s"])
    return time_overlapped(costs, depth, "wait").orders


def overlap_unsupported(rp) -> tuple[str, ...]:
    """Why rank plan `rp`'s overlapped rounds do not compile yet (empty: they do): slot rings
    of its layers (streamed weights, gradients or saved activations: their uses are one round's,
    in turn), a HOME embedding table (its row parts), split sequences, shared or rebuilt K/V,
    MoE routing totals. (Replicas run: a block's all-reduce is in the last round's backward,
    which no round overlaps; so does a vocabulary-parallel head: every rank's part of round k's
    head comes before its backward, so before any of round k+1's forwards.)"""
    d = decisions_of(rp.plan)
    streamed = any(lay.weights is Where.HOME or (lay.grads is Where.HOME
                                                  and not d.frozen.layer(i))
                   for i, lay in enumerate(d.layers)) or any(
        a.home is Where.HOME for row in d.activations for a in row)
    return tuple(what for what, bad in (
        ("streamed layer weights, gradients or saved activations (slot rings)", streamed),
        ("a HOME embedding table", d.holds_embed and d.embed.weights is Where.HOME),
        ("sequences split over chunks", d.chunking.chunks_per_seq > 1),
        ("shared or rebuilt K/V", bool(boundary_kv_sharers(d) or kv_rebuilt(d))),
        ("an MoE model", d.model.moe is not None)) if bad)


class OverlapRounds:
    """The overlapped step of a ring rank (RingCompiler's part): off (the plain rounds in turn)
    unless the rank plan has round_overlap."""

    depth = 0
    """Local layers of the next round run during a round's backward (0: rounds in turn)."""
    _cur = 0
    """The round whose piece is being emitted (it picks the rows and saved activations). An
    evaluation's rounds keep 0: its residuals are the plain set's, its token rows follow
    round_rows' parity rule, as the executor reads them."""

    def _overlap_setup(self) -> None:
        """Called by RingCompiler once its state is built: the depth, the refusals by name,
        and the region table with the overlap's regions after the plan's."""
        rp = self.rp
        self.depth = min(rp.round_overlap, len(rp.layers)) if rp.n_ranks > 1 else 0
        if not self.depth:
            return
        self._refuse_unsupported()
        extra = overlap_regions(rp.plan, self.depth)
        t = self.table
        at = max((r.offset + buffers.align(r.nbytes) for r in t.device), default=0)
        regions = []
        for name, nbytes in extra:
            regions.append(Region(name, "device", at, nbytes))
            at += buffers.align(nbytes)
        self.table = RegionTable(device=t.device + tuple(regions), host=t.host,
                                 device_budget=t.device_budget
                                 + sum(buffers.align(nb) for _, nb in extra),
                                 host_budget=t.host_budget)
        self._regions = self.table.by_name()
        specs = overlap_row_specs(self.cfg, self.ch.tokens_per_round)
        self._odd_offsets = buffers.offsets(specs)
        self._odd_specs = {s.name: s for s in specs}

    def _refuse_unsupported(self) -> None:
        """What the overlapped step does not build yet (overlap_unsupported), refused by name."""
        rp = self.rp
        why = overlap_unsupported(rp)
        if why:
            raise ConfigError(f"rank {rp.rank}'s plan overlaps {rp.round_overlap} local layer(s) "
                              f"of the next round (round_overlap), which the compiled ring step "
                              f"does not run with {'; '.join(why)} yet; plan the ring with "
                              "round_overlap=0 (dataflow-ring --no-round-overlap, the default) "
                              "or budgets that keep the rank's layers on the device")

    # -- the rows and saved activations of the round being emitted -------------------------------
    def resid(self, layer: int) -> tuple[str, str]:
        x, y = super().resid(layer)
        on = bool(self.depth)
        return round_row_name(x, self._cur, on), round_row_name(y, self._cur, on)

    def rows(self, buffer: str, chunk: int) -> Ref:
        name = buffer.split("@")[0]
        if name == buffer:
            return super().rows(buffer, chunk)
        per = self._odd_specs[name].nbytes // self.C
        return Ref(OVERLAP_ROWS_REGION, self._odd_offsets[name] + chunk * per, per)

    def round_rows(self, rnd: int, name: str) -> Ref:
        if not self.depth or round_row_name(name, rnd, True) == name:
            return super().round_rows(rnd, name)
        return Ref(OVERLAP_ROWS_REGION, self._odd_offsets[name], self._odd_specs[name].nbytes)

    def act(self, phase: str, layer: int, chunk: int) -> Ref:
        if self.depth and self._cur % 2 and layer < self.depth:
            return self.ref(f"overlap.act.{layer}.{chunk}", 0, self.act_bytes[(layer, chunk)])
        return super().act(phase, layer, chunk)

    # -- the rounds in the overlapped order --------------------------------------------------
    def run_rounds(self, rounds: int) -> list[int]:
        """The step's rounds as this rank's overlapped order runs them (overlap_orders): each
        round begun before its first op, a layer's forward begun at its chunk 0 and ended after
        its last, its backward begun at its last chunk and ended after chunk 0."""
        if not self.depth:
            return super().run_rounds(rounds)
        rp = self.rp
        order = overlap_orders(rp.ring_owners, self.C, rounds, self.depth, rp.head_owner,
                               rp.vocab_parallel)[rp.rank]
        local = {g: j for j, g in enumerate(rp.layers)}
        starts: dict[int, int] = {}
        held: dict[tuple, tuple] = {}
        prefilled: dict = {}
        last = self.C - 1
        for kind, rnd, g, c in order:
            self._cur = rnd
            if rnd not in starts:
                starts[rnd] = len(self.em.events)
                self.round_begin(rnd)
            if kind == FWD:
                layer = local[g]
                if c == 0:
                    held[(FWD, rnd, layer)] = (self.fwd_begin(rnd, layer),)
                self.fwd_chunk(rnd, layer, c, *held[(FWD, rnd, layer)])
                if c == last:
                    del held[(FWD, rnd, layer)]
                    self.fwd_end(rnd, layer)
            elif kind == BWD:
                layer = local[g]
                if c == last:
                    held[(BWD, rnd, layer)] = self.bwd_begin(rnd, layer)
                w, grads = held[(BWD, rnd, layer)]
                self.bwd_chunk(rnd, layer, c, w, grads, prefilled)
                if c == 0:
                    del held[(BWD, rnd, layer)]
                    self.bwd_end(rnd, layer, w, grads)
            else:
                self.round_head(rnd)
        assert not held and sorted(starts) == list(range(rounds)), (held, starts)
        self._cur = 0
        return [starts[r] for r in range(rounds)]
