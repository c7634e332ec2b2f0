"""The rounds of a step, as the algorithm reads: for each round, the forward for each layer and
chunk, the head, then the backward for each layer and chunk in reverse; plus the forward-only
rounds of an evaluation. Part of dataflow.memplan.step.compile.StepCompiler; never imports
memplan.search, never touches a device."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.plan import Where
from dataflow.memplan.plan.segments import (
    is_inner,
)
from dataflow.memplan.step.events import (
    COMPUTE,
    Compute,
    Fill,
    Ref,
    Schedule,
)
from dataflow.memplan.step.slot_ring import _Ring, _Use, for_round
from dataflow.memplan.step.state import HEAD, BlockKey

UPDATE_MODES = ("end", "none", "deferred", "backward")
"""Where a step's AdamW runs (StepCompiler.compile): after its last round, not in its list, the
previous step's inside its round 0, or inside its own last round, each streamed layer's right
after its gradient is final ('backward': no clipping, whose global norm would have to come
first; the other blocks after the last round, as 'end')."""


class Rounds:
    """The step's and an evaluation's round loops (StepCompiler's part)."""

    # -- the step ---------------------------------------------------------------------------
    def compile(self, rounds: int | None = None, update: str = "end") -> Schedule:
        """update: 'end' (this step's AdamW after its last round), 'none' (not in this list: a
        deferred first step), 'deferred' (the previous step's AdamW runs inside round 0, each
        streamed layer's update filling the weight slot its forward reads; this step's waits
        for the next step or compile_update_schedule), 'backward' (this step's AdamW inside its
        last round, each streamed layer's from its slots right after its backward: for steps
        that do not clip)."""
        if update not in UPDATE_MODES:
            raise ValueError(f"update={update!r}; choose one of {', '.join(UPDATE_MODES)}")
        em = self.em
        rounds = self.ch.rounds_per_step if rounds is None else rounds
        off, nb = self._transition("scalars")
        if update == "deferred":  # the clip scale (scalar 1) is the pending update's
            em.add(Fill("zero.scalars", self.ref("transitions", off, 4), "f32"))
            em.add(Fill("zero.scalars", self.ref("transitions", off + 8, nb - 8), "f32"))
        else:
            em.add(Fill("zero.scalars", self.ref("transitions", off, nb), "f32"))
        self.last_round, self.n_rounds = rounds - 1, rounds
        self.pending = set(self.owned_blocks()) if update == "deferred" else set()
        self.in_backward = self._backward_updated() if update == "backward" else frozenset()
        if self.in_backward:
            # No clipping: the scale every update reads is 1 from the start (clip_scale of a
            # zero norm under an infinite max norm), not after the last round.
            em.add(Compute("unit_scale", "clip_scale", 0))
        self.backward_done = None
        starts = self.run_rounds(rounds)
        if self.pending:
            raise RuntimeError("deferred updates never placed: "
                               f"{sorted(k.name for k in self.pending)}")
        opt_start = len(em.events)
        # The last in-round update still reads the scale that clip_scale rewrites (to 1 again),
        # and the step ends after its write-back.
        em.wait(COMPUTE, self.backward_done)
        self.grad_norm()
        if update in ("end", "backward"):
            self.optimizer(skip=self.in_backward)
        return Schedule(self.table, tuple(em.events), rounds, tuple(starts), opt_start, em.n_ids)

    def compile_eval(self, rounds: int) -> Schedule:
        """Forward-only rounds: tokens, embedding, layers (saving nothing), head loss. No
        gradient leaves the device, nothing is written home and no optimizer event runs. The
        training round's hooks apply (a ring rank runs the embedding or head only if it holds
        them, and receives and sends each layer's input and output)."""
        em, L = self.em, self.L
        self.n_rounds = rounds
        em.add(Fill("zero.scalars", self.ref("transitions", *self._transition("scalars")), "f32"))
        ring = uses = assigned = None
        streamed = [i for i in range(L) if self.d.layers[i].weights is Where.HOME]
        if streamed:  # the training ring's slots, visited by the forward's uses alone
            ring = _Ring(em, self.wring.slots, "w")
            uses = [_Use(i, self.block(BlockKey.of_layer(i), "weights", True)) for i in streamed]
            assigned = ring.assign(uses)
            index = {i: j for j, i in enumerate(streamed)}
        starts = []
        for rnd in range(rounds):
            starts.append(len(em.events))
            if ring is not None:
                ring.begin(uses, assigned)
            if self.hw_ring is not None:
                self.hw_ring.begin(self.hw_uses, for_round(self.hw_assigned, rnd))
            self.load_tokens(rnd)
            if self.has_embed:
                self.embed_fwd(rnd, self.resid(0)[0])
            for layer in range(L):
                x, y = self.resid(layer)
                name = self.global_layer(layer)
                dev = self.block(BlockKey.of_layer(layer), "weights", False)
                w = dev if dev is not None else ring.acquire(index[layer])
                for c in range(self.C):
                    self.input_arrives(rnd, False, layer, x, c)
                    self.before_write(y, c)
                    em.add(Compute(f"f.L{name}.c{c}", "layer_fwd", rnd, layer, c, weights=w,
                                   x=x, y=y))
                    self.output_leaves(rnd, False, layer, y, c)
                if dev is None:
                    ring.release(index[layer])
                if self.has_head and layer == L - 2 and self.hw_ring is not None:
                    self.hw_ring.prefetch(0)
            if not self.has_head:
                continue
            other, final = self.resid(L - 1)
            for c in range(self.C):
                self.before_write(other, c)
            self.head_eval(rnd, final, other)
        end = len(em.events)
        return Schedule(self.table, tuple(em.events), rounds, tuple(starts), end, em.n_ids)

    def run_rounds(self, rounds: int) -> list[int]:
        """The step's rounds one after another; the index of each round's first event."""
        starts = []
        for rnd in range(rounds):
            starts.append(len(self.em.events))
            self.round(rnd)
        return starts

    def round(self, rnd: int) -> None:
        """Round `rnd` in the plain order: its forward layer-major, its head, its backward in
        reverse (the pieces below; an overlapped ring rank calls the same pieces in its own
        order: dataflow.memplan.step.ring_rounds)."""
        L = self.L
        self.round_begin(rnd)
        for layer in range(L):                                          # forward, layer-major
            w = self.fwd_begin(rnd, layer)
            for c in range(self.C):
                self.fwd_chunk(rnd, layer, c, w)
            self.fwd_end(rnd, layer)
        self.round_head(rnd)
        prefilled: dict[tuple[int, int], int | None] = {}
        """(layer, sequence) whose context rows were queued while the one before it ran: the
        H2D record after the last of them that came over H2D (None if none did)."""
        for layer in reversed(range(L)):                                # backward, reverse order
            w, g = self.bwd_begin(rnd, layer)
            for c in reversed(range(self.C)):
                self.bwd_chunk(rnd, layer, c, w, g, prefilled)
            self.bwd_end(rnd, layer, w, g)

    def round_begin(self, rnd: int) -> None:
        """The round's slot rings begun, its tokens loaded, its embedding (this plan's)."""
        first = rnd == 0
        if self.wring is not None:
            self.wring.begin(self.w_uses, for_round(self.w_assigned, rnd))
        if self.aring is not None:
            self.aring.begin(self.a_uses, self.a_assigned)
        if self.hw_ring is not None:
            self.hw_ring.begin(self.hw_uses, for_round(self.hw_assigned, rnd))
        if self.gring is not None:
            uses = self.g_uses[first]
            if self.in_backward and rnd == self.last_round:  # the update reads the slot
                uses = [dataclasses.replace(u, writeback=None)
                        if BlockKey.of_layer(u.key) in self.in_backward else u
                        for u in uses]
            self.gring.begin(uses, self.g_assigned[first])
        if self.hg_ring is not None:
            self.hg_ring.begin(self.hg_uses[first], self.hg_assigned[first])
        if first and self.pending:
            self.deferred_prefix()
        self.load_tokens(rnd)
        if self.has_embed:
            self.embed_fwd(rnd, self.resid(0)[0])
        self.stage_next(rnd)
        if first and self.has_embed:
            self.zero_home_embed_grads()

    def fwd_begin(self, rnd: int, layer: int) -> Ref:
        """The weights layer `layer`'s forward reads (acquired once for all its chunks)."""
        return self.weights("f", layer)

    def fwd_chunk(self, rnd: int, layer: int, c: int, w: Ref) -> None:
        em = self.em
        x, y = self.resid(layer)
        keep = not is_inner(layer, self.k)  # a segment's inner layers keep nothing
        self.input_arrives(rnd, False, layer, x, c)
        self.before_write(y, c)
        save = self.act("f", layer, c) if keep else None
        em.add(Compute(f"f.L{self.global_layer(layer)}.c{c}", "layer_fwd", rnd, layer, c,
                       weights=w, save=save, x=x, y=y))
        if keep:
            self.release_act("f", layer, c)
        self.output_leaves(rnd, False, layer, y, c)

    def fwd_end(self, rnd: int, layer: int) -> None:
        L = self.L
        self.release_weights("f", layer)
        if rnd == 0 and HEAD in self.pending and layer == max(L - 2, 0):
            self.deferred_update(HEAD)
        if self.has_head and layer == L - 2 and self.hw_ring is not None:
            self.hw_ring.prefetch(0)                                  # head weights arrive early

    def round_head(self, rnd: int) -> None:
        if self.has_head:
            dfinal, final = self.resid(self.L - 1)  # the last output; its input's rows take dfinal
            for c in range(self.C):
                self.before_write(dfinal, c)
            self.head(rnd, final, dfinal)

    def bwd_begin(self, rnd: int, layer: int) -> tuple[Ref, Ref | None]:
        """(weights, gradient) of layer `layer`'s backward, after its segment's recompute."""
        if layer in self.recompute_top:
            self.recompute(rnd, *self.recompute_top[layer], buf=self.resid(layer)[1])
        return self.weights("b", layer), self.grads(layer)

    def bwd_chunk(self, rnd: int, layer: int, c: int, w: Ref, g: Ref | None,
                  prefilled: dict) -> None:
        em = self.em
        dy, dx = self.resid(layer)
        split, cps = self.ch.chunks_per_seq > 1, self.ch.chunks_per_seq
        self.input_arrives(rnd, True, layer, dy, c)
        seq, j = divmod(c, cps)
        if split and j == cps - 1:
            if (layer, seq) not in prefilled:
                self.fill_context(rnd, layer, c, w)
            else:  # not a record taken now: the queue may hold later layers' fetches
                em.wait(COMPUTE, prefilled.pop((layer, seq)))
        self.before_write(dx, c)
        save = self.act("b", layer, c)
        em.add(Compute(f"b.L{self.global_layer(layer)}.c{c}", "layer_bwd", rnd, layer, c,
                       weights=w, grads=g, save=save, x=dy, y=dx))
        if split:
            self.prefill_context(rnd, layer, seq, j, prefilled, w)
        self.release_act("b", layer, c)
        self.output_leaves(rnd, True, layer, dx, c)

    def bwd_end(self, rnd: int, layer: int, w: Ref, g: Ref | None) -> None:
        if layer == 0 and self.has_embed:
            # First in the D2H queue: the next round's forward waits for the embedding's
            # gradient rows to leave, not for layer 0's gradient write-back.
            self.embed_bwd(rnd, self.resid(layer)[1])
        self.sumsq(rnd, f"L{self.global_layer(layer)}", g)
        if rnd == self.last_round and BlockKey.of_layer(layer) in self.in_backward:
            self.update_in_backward(layer, w, g)
            return
        self.release_grads(layer)
        self.release_weights("b", layer)
