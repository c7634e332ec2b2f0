"""The optimizer in the step: the gradient norm and clip scale, AdamW on the device, on the host
or streamed through the device in pieces, and the previous step's update deferred into round 0
or this step's placed inside its backward. Part of dataflow.memplan.step.compile.StepCompiler;
never imports memplan.search, never touches a device."""

from __future__ import annotations

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.plan import OptimizerWhere, Where
from dataflow.memplan.step.events import (
    COMPUTE,
    D2H,
    H2D,
    HOST,
    OPT,
    Compute,
    Fetch,
    Fill,
    Ref,
    Schedule,
    Update,
    WriteBack,
)
from dataflow.memplan.step.state import EMBED, HEAD, BlockKey


class OptimizerUpdate:
    """Gradient norm, clipping and AdamW events (StepCompiler's part)."""

    def _backward_updated(self) -> frozenset[BlockKey]:
        """The layers update='backward' updates inside the last round: streamed ones whose
        weights and gradients both pass through slots and whose AdamW streams through the
        device."""
        if self.wring is None or self.gring is None:
            return frozenset()
        out = set()
        for key in (BlockKey.of_layer(i) for i in range(self.L)):
            if self.frozen(key):
                continue
            p = self.placement(key)
            if p.weights is Where.HOME and p.grads is Where.HOME \
                    and p.optimizer is OptimizerWhere.STREAMED:
                out.add(key)
        return frozenset(out)

    def update_in_backward(self, layer: int, w: Ref, g: Ref) -> None:
        """update='backward': right after the last round's backward of `layer`, its AdamW from
        the weight and gradient slots (m and v come over H2D), on the OPT stream so the next
        layer's backward does not queue behind it; the gradient slot is free after the
        kernels, the weight slot after the weights' write-back."""
        em, key = self.em, BlockKey.of_layer(layer)
        em.wait(OPT, em.record(COMPUTE))  # the layer's backward and gradient norm are done
        self.deferring = True
        done = self.update_streamed(key, params=w, grads=g)
        self.deferring = False
        self.gring.release(self.g_index[layer], after=self.params_ready)
        self.wring.release(self.w_index[("b", layer)], after=done)
        self.backward_done = done

    def compile_update(self) -> Schedule:
        """The AdamW of a step compiled with update='none' or 'deferred' alone: what is pending
        when the trainer reads or saves state, or evaluates, between steps."""
        self.scale_on_host = None  # the last step's scale reached the host before it ended
        self.optimizer()
        return Schedule(self.table, tuple(self.em.events), 0, (), 0, self.em.n_ids)

    # -- gradient norm and clipping, on the device -------------------------------------------
    def sumsq(self, rnd: int, what: str, grads: Ref) -> None:
        """In the step's last round a block's gradient sum is complete (in its slot or resident
        region) right after its backward: add its squared norm into the device scalar. A
        frozen block (no `grads`) adds nothing: the norm is over the trained blocks only."""
        if rnd == self.last_round and grads is not None:
            self.grads_final(what, grads, COMPUTE)
            self.em.add(Compute(f"gnorm.{what}", "grad_sumsq", rnd, grads=grads))

    def grad_norm(self) -> None:
        """Global squared norm (plus the host's part for a HOME embedding gradient) and the clip
        scale every update reads, both on the device; the host gets the scale by one small D2H
        when a block is updated there. Nothing waits on the host."""
        em = self.em
        if self.block(EMBED, "grads", False) is None and not self.d.frozen.embed:
            em.wait(H2D, self.embed_grads_ready)
            em.add(Fetch("gnorm.embed", self.ref("transitions", self._scalar(2), 4),
                         self.ref("norm_host", 0, 4)))
            em.wait(COMPUTE, em.record(H2D))
        em.add(Compute("clip_scale", "clip_scale", self.last_round))
        self.scale_on_host = None
        keys = [BlockKey.of_layer(i) for i in range(self.L)] + [EMBED, HEAD]
        if any(self.placement(k).optimizer is OptimizerWhere.HOST for k in keys
               if not self.frozen(k)):
            em.wait(D2H, em.record(COMPUTE))
            em.wait(D2H, self.host_scale_read)  # deferred host updates read the last scale
            em.add(WriteBack("gnorm.scale", self.ref("norm_host", 4, 4),
                             self.ref("transitions", self._scalar(1), 4)))
            self.scale_on_host = em.record(D2H)

    def _scalar(self, i: int) -> int:
        return self._transition("scalars")[0] + 4 * i

    # -- the optimizer ----------------------------------------------------------------------
    def optimizer(self, skip=frozenset()) -> None:
        for key in [k for k in self.owned_blocks() if k not in skip]:
            where = self.placement(key).optimizer
            if where is OptimizerWhere.DEVICE:
                self.update_device(key)
            elif where is OptimizerWhere.HOST:
                self.update_host(key)
            else:
                self.update_streamed(key)

    def _grads_ready(self, key: BlockKey, stream: str) -> None:
        ring = self.gring if key.is_layer else self.hg_ring if key == HEAD else None
        if ring is not None:  # the rings' uses are keyed by layer index, or 'head'
            self.em.wait(stream, ring.host_ready.get(key.layer if key.is_layer else key.kind))
        if key == EMBED:
            self.em.wait(stream, self.embed_grads_ready)

    def _numel(self, key: BlockKey) -> int:
        return self.numel[key.kind]

    def update_range(self, key: BlockKey) -> tuple[int, int]:
        """The elements [lo, hi) of `key` this compiler's AdamW updates: all of them on one
        device (a replica splitting its update overrides it, dataflow.memplan.step.ring_compile)."""
        return 0, self._numel(key)

    def weights_updated(self, key: BlockKey, weights: Ref, stream: str) -> None:
        """After `stream`'s AdamW of key's elements update_range(key) in `weights`: nothing on
        one device (a replica splitting its update gathers the other parts there)."""

    def state_origin(self, key: BlockKey) -> int:
        """The element of `key` at the start of its m / v regions: 0 on one device, where they
        hold the whole block (a split replica's hold its part alone and say where it starts)."""
        return 0

    def _origins(self, key: BlockKey) -> list[int]:
        """The element at offset 0 of key's weights, grads, m and v, in that order."""
        o = self.state_origin(key)
        return [0, 0, o, o]

    def _range_refs(self, key: BlockKey, home: bool) -> list[Ref]:
        """key's weights, grads, m, v refs restricted to update_range(key)."""
        lo, hi = self.update_range(key)
        refs = [self.block(key, p, home) for p in ("weights", "grads", "m", "v")]
        if (lo, hi) == (0, self._numel(key)):
            return refs
        return [Ref(r.region, r.offset + (lo - o) * b, (hi - lo) * b)
                for r, b, o in zip(refs, self._part_bytes(), self._origins(key))]

    def _part_bytes(self) -> list[int]:
        """Bytes per element of a block's weights, grads, m and v, in that order."""
        return [2, 2 if self.gdt == "bf16" else 4, 2, 2]

    def update_device(self, key: BlockKey) -> None:
        parts = self._range_refs(key, False)
        lo, hi = self.update_range(key)
        self.em.add(Update(f"adamw.{key.name}", key.name, lo, hi - lo, *parts))
        self.weights_updated(key, self.block(key, "weights", False), COMPUTE)
        self.em.add(Fill(f"zero_grads.{key.name}", self.block(key, "grads", False), self.gdt))

    def update_host(self, key: BlockKey) -> None:
        em = self.em
        self._grads_ready(key, HOST)
        em.wait(HOST, self.scale_on_host)
        em.wait(HOST, em.record(H2D))  # the device may still be reading the home weights
        parts = self._range_refs(key, True)
        lo, hi = self.update_range(key)
        em.add(Update(f"adamw.host.{key.name}", key.name, lo, hi - lo, *parts, stream=HOST))
        self.weights_updated(key, self.block(key, "weights", True), HOST)
        em.record(HOST)

    def zero_home_embed_grads(self) -> None:
        """The embedding's home gradient accumulates in place on the host (layers' home
        gradients restart from a zero fill in round 0 instead): clear it early in round 0,
        behind the next round's staging and long before round 0's scatter, not at the end of
        the last step, where its 0.3 s (8b) was the step's tail. Between steps it holds the
        last step's sum."""
        home = self.block(EMBED, "grads", True)
        if home is None or self.d.embed.grads is not Where.HOME:
            return
        em = self.em
        em.wait(HOST, self.embed_grads_ready)
        em.add(Fill("zero_grads.embed", home, self.gdt, HOST))
        self.embed_grads_ready = em.record(HOST)

    def update_streamed(self, key: BlockKey, params: Ref | None = None,
                        grads: Ref | None = None) -> int:
        """Pieces of opt_stage_elems: H2D p, g, m, v -> AdamW -> write-back of p, m, v (on the
        compute and D2H streams; a deferred update's on the OPT stream). `params`: a device copy
        of the whole block to update the weights in (a deferred update filling the weight slot
        the next forward reads) instead of the stage. `grads`: the whole gradient on the device
        (update='backward': its slot), and then `params` already holds the weights, so neither
        comes over H2D. Returns the record after the last write-back."""
        em = self.em
        n_stage = self.d.slots.opt_stage_elems
        specs = buffers.opt_stage_specs(n_stage, self.gdt)
        offs = buffers.offsets(specs)
        self._grads_ready(key, H2D)
        if not self.deferring:  # the step's own update: after its last backward
            em.wait(H2D, em.record(COMPUTE))
        home = [self.block(key, p, True) for p in ("weights", "grads", "m", "v")]
        bpe = self._part_bytes()
        lo, hi = self.update_range(key)
        for i, start in enumerate(range(lo, hi, n_stage)):
            n = min(n_stage, hi - start)
            buf = i % 2
            dev = [self.ref("opt_stage", offs[f"{x}{buf}"], n * b) for x, b in zip("pgmv", bpe)]
            if params is not None:
                dev[0] = Ref(params.region, params.offset + start * 2, n * 2)
            if grads is not None:
                dev[1] = Ref(grads.region, grads.offset + start * bpe[1], n * bpe[1])
            host = [Ref(h.region, h.offset + (start - o) * b, n * b)
                    for h, b, o in zip(home, bpe, self._origins(key))]
            em.wait(H2D, self.stage_free[buf])
            for j, (dst, src) in enumerate(zip(dev, host)):
                if grads is None or j >= 2:  # in place: weights and gradient are on the device
                    em.add(Fetch(f"opt.h2d.{key.name}", dst, src, duplex=True))
            # A deferred update's kernel and write-backs run on their own stream: the compute
            # stream never queues behind its fetches, nor the activations' write-backs behind
            # its copies.
            ust, wst = (OPT, OPT) if self.deferring else (COMPUTE, D2H)
            em.wait(ust, em.record(H2D))
            em.add(Update(f"adamw.{key.name}.{i}", key.name, start, n, *dev, stream=ust))
            if wst != ust:
                em.wait(wst, em.record(ust))
            elif start + n == hi:
                self.params_ready = em.record(OPT)  # the last piece's kernel, before its copies
            for j in (0, 2, 3):
                em.add(WriteBack(f"opt.d2h.{key.name}", host[j], dev[j], stream=wst,
                                 duplex=True))
            self.stage_free[buf] = em.record(wst)
        self.weights_updated(key, home[0], wst)
        return em.record(wst)

    # -- the previous step's update, deferred into round 0 (update='deferred') ---------------
    def fused(self, key: BlockKey) -> bool:
        """A streamed layer whose deferred update fills the weight slot of its round-0
        forward: the update's H2D of the weights is that forward's fetch."""
        if not key.is_layer or self.wring is None:
            return False
        p = self.placement(key)
        return p.weights is Where.HOME and p.optimizer is OptimizerWhere.STREAMED

    def deferred_prefix(self) -> None:
        """Round 0's start: the pending updates that are not fused into a weight fetch (the
        embedding, resident and host-updated layers), before anything reads those blocks;
        then the first fused layer fetches are queued, ahead of the token and row uploads."""
        for key in [k for k in self.owned_blocks() if k != HEAD and not self.fused(k)]:
            self.deferred_update(key)
        if self.wring is not None:
            self.wring.fill = self.fill_weights
            self.wring.prefetch(len(self.wring.slots) - 1)

    def deferred_update(self, key: BlockKey) -> None:
        """The pending AdamW of `key`, placed where the round no longer reads its old state;
        marks when its home weights and gradients are free again for the round's own copies."""
        self.pending.discard(key)
        where = self.placement(key).optimizer
        self.deferring = True
        if where is OptimizerWhere.DEVICE:
            self.update_device(key)
        elif where is OptimizerWhere.HOST:
            self.update_host(key)
            done = self.host_scale_read = self.em.record(HOST)
            self._home_updated(key, done)
        else:
            self._home_updated(key, self.update_streamed(key))
        self.deferring = False

    def _home_updated(self, key: BlockKey, done: int) -> None:
        """After `done`, key's home weights hold the update and its home gradient was read:
        the round's weight fetches, gradient write-backs, gathers and zero fills wait for it."""
        if key == EMBED:
            self.embed_w_ready = self.embed_grads_ready = done
            return
        rings = (self.wring, self.gring) if key.is_layer else (self.hw_ring, self.hg_ring)
        rkey = key.layer if key.is_layer else key.kind  # the rings' use keys
        for ring in rings:
            if ring is not None:
                ring.host_ready[rkey] = done

    def fill_weights(self, use, slot: Ref) -> tuple[int, int] | None:
        """The weight ring's fill hook in round 0 of a deferred step: a pending streamed
        layer's first fetch is its update, in the slot (None: fetch as usual). Returns (OPT
        record after its last kernel, OPT record after the updated weights left the slot)."""
        key = BlockKey.of_layer(use.key)
        if key not in self.pending or not self.fused(key):
            return None
        self.pending.discard(key)
        self.deferring = True
        done = self.update_streamed(key, params=slot)
        self.deferring = False
        self._home_updated(key, done)
        return self.params_ready, done
