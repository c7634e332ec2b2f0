"""Split-sequence context and layer-segment recompute: the K/V rows a split sequence's
backward reads, prefilled, refilled from home or KV_REGION, or re-formed from x (kv_rebuild),
and a segment's forward re-run before its backward. Part of
dataflow.memplan.step.compile.StepCompiler; never imports memplan.search, never touches a
device."""

from __future__ import annotations

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.plan import Where
from dataflow.memplan.plan.segments import (
    KV_REGION,
)
from dataflow.memplan.step.events import (
    COMPUTE,
    D2H,
    H2D,
    Compute,
    Fetch,
    Ref,
    WriteBack,
)


class SplitContext:
    """Context fills, K/V rebuilds and segment recompute (StepCompiler's part)."""

    def prefill_context(self, rnd: int, layer: int, seq: int, j: int, prefilled: dict,
                        w: Ref) -> None:
        """A split sequence's backward chunk j reads context rows of chunks 0..j only, so once
        it is enqueued the rows of chunk j are free: queue the next (layer, sequence)'s rows
        there now, first in the H2D queue, instead of all of them after its last chunk (the
        whole fill then waited behind the weight and gradient fetches: ~30 ms per layer at
        8b@64k). Not across a segment's top layer, whose recompute must rebuild its K/V
        first. Into the next layer of a kv_rebuild plan, re-forming its K/V takes that layer's
        weights: their slot is acquired now where the ring can (prefetched layers ahead, so
        this waits on nothing in the steady state; not with a single weight slot), and the x
        fetches spread over this layer's backward instead of queueing at the next one's start,
        where compute waited on them (1.9 of the 3.1 s of gaps simulated for 8b at 131k,
        120/24)."""
        if seq > 0:
            nxt, w_next = (layer, seq - 1), w
        elif layer > 0 and layer - 1 not in self.recompute_top:
            nxt = (layer - 1, self.C // self.ch.chunks_per_seq - 1)
            w_next = self.weights_ahead("b", layer - 1) if self.d.kv_rebuild else w
        else:
            return
        if w_next is None:  # its weights cannot come yet: the next layer fills at its start
            return
        c = nxt[1] * self.ch.chunks_per_seq + j
        if self.fill_context_rows(rnd, nxt[0], c, self.em.record(COMPUTE), w_next):
            prefilled[nxt] = self.em.record(H2D)
        else:
            prefilled.setdefault(nxt, None)

    def recompute(self, rnd: int, first: int, end: int, buf: str) -> None:
        """Rebuild the saved activations of layers first+1..end-1 before the backward of the
        segment: re-run its forward layer-major from the boundary's saved input, in place
        over the round's free residual buffer `buf` (the backward writes its input gradient
        there only afterwards), each inner layer keeping its input and level into its storage.
        The top layer's output is not needed, but its forward forms the K/V and statistics its
        level keeps."""
        em = self.em
        for layer in range(first, end):
            w = self.weights("r", layer)
            for c in range(self.C):
                name = f"b.L{layer}.c{c}.seg"  # backward-phase forward work: recompute
                if self.kv_stored and (layer > first or c % self.ch.chunks_per_seq == 0):
                    # this chunk re-forms context rows the boundary's K/V copies still read
                    em.wait(COMPUTE, self.kv_stored[max(self.kv_stored)])
                if layer == first:
                    src = self.act("r", layer, c)
                    em.add(Compute(name, "layer_refwd", rnd, layer, c, weights=w, y=buf,
                                   src=src))
                    self.release_act("r", layer, c)
                    if (layer, c) in self.kv_sharers:
                        self.store_boundary_kv(c)
                else:
                    save = self.act("w", layer, c)
                    em.add(Compute(name, "layer_refwd", rnd, layer, c, weights=w, save=save,
                                   x=buf, y=buf))
                    self.release_act("w", layer, c)
            self.release_weights("r", layer)

    def _kv_rows(self, part: str, c: int) -> Ref:
        """Chunk c's rows of K (part 'k') or V in KV_REGION: a round's K rows, then its V rows."""
        row = self.cfg.n_kv_heads * self.cfg.head_dim * 2
        at = (0 if part == "k" else self.ch.tokens_per_round * row) + c * self.T * row
        return self.ref(KV_REGION, at, self.T * row)

    def store_boundary_kv(self, c: int) -> None:
        """After a segment boundary's re-run forward of chunk c formed its K/V in the context
        buffer, send them to KV_REGION (once the last refill from it has read the rows there)."""
        em, row = self.em, self.cfg.n_kv_heads * self.cfg.head_dim * 2
        em.wait(D2H, self.kv_read)
        em.wait(D2H, em.record(COMPUTE))
        at = self.ch.chunk_context(c) * row
        for part in ("k", "v"):
            em.add(WriteBack(f"ctx.{part}.store.c{c}", self._kv_rows(part, c),
                             self.ref("context", self._ctx_offsets[f"{part}_ctx"] + at,
                                      self.T * row)))
        self.kv_stored[c] = em.record(D2H)

    def fill_context(self, rnd: int, layer: int, last: int, w: Ref) -> None:
        """Before the backward of a split sequence at `layer` (weights `w`), gather its K/V from
        every chunk's saved activation (device copies on compute; home copies straight over
        H2D; re-formed from x where the plan rebuilds them)."""
        first = last - self.ch.chunks_per_seq + 1
        free = self.em.record(COMPUTE)
        fetched = [self.fill_context_rows(rnd, layer, c, free, w)
                   for c in range(first, last + 1)]
        if any(fetched):
            self.em.wait(COMPUTE, self.em.record(H2D))

    def fill_context_rows(self, rnd: int, layer: int, c: int, free: int, w: Ref) -> bool:
        """Chunk c's K/V rows of the context at `layer`, once compute passes record `free` (the
        last reader of those rows): a cast on compute for a device-resident chunk, two H2D
        copies from its home copy, or (Plan.kv_rebuild) a re-forming from its saved x with the
        layer's weights `w`; True when it queued copies into the context (compute must wait
        for the H2D stream before it reads them)."""
        em, T, cfg = self.em, self.T, self.cfg
        a = self.d.activations[layer][c]
        if (layer, c) in self.kv_rebuilt:
            self.rebuild_kv(rnd, layer, c, w)
            return False
        if a.home is Where.DEVICE:
            em.add(Compute(f"ctx.L{layer}.c{c}", "ctx_cast", rnd, layer, c,
                           save=self.act("b", layer, c)))
            return False
        em.wait(H2D, free)
        ctx, row = self._ctx_offsets, cfg.n_kv_heads * cfg.head_dim * 2
        at = self.ch.chunk_context(c) * row
        shared = (layer, c) in self.kv_sharers
        if shared:
            em.wait(H2D, self.kv_stored.pop(c))
        else:
            em.wait(H2D, self.aring.host_ready.get((layer, c)))
        offs = self._act_offsets[a.level]
        home = self.act_home[(layer, c)]
        for part in ("k", "v"):
            src = self._kv_rows(part, c) if shared else \
                Ref(home.region, home.offset + offs[part], T * row)
            em.add(Fetch(f"ctx.{part}.L{layer}.c{c}",
                         self.ref("context", ctx[f"{part}_ctx"] + at, T * row), src))
        if shared:
            self.kv_read = em.record(H2D)
        return True

    def rebuild_kv(self, rnd: int, layer: int, c: int, w: Ref) -> None:
        """Re-form chunk c's K/V rows of the context at `layer` on compute, from its saved x:
        in place for a device-resident activation, else after x came over H2D into a
        kv_rebuild staging buffer (KV_REBUILD_STAGES of them, used in turn). Compute writes
        the context rows in its own order, after every earlier reader of them."""
        em, name = self.em, f"ctx.kv.L{layer}.c{c}"
        if self.d.activations[layer][c].home is Where.DEVICE:
            em.add(Compute(name, "kv_rebuild", rnd, layer, c, weights=w,
                           save=self.act_dev[(layer, c)]))
            return
        xb = self.T * self.cfg.model_dim * 2  # x comes first in every saved layout
        i = self.kv_stage_next
        self.kv_stage_next = (i + 1) % buffers.KV_REBUILD_STAGES
        stage = self.ref("kv_rebuild", i * buffers.align(xb), xb)
        em.wait(H2D, self.kv_stage_free[i])
        em.wait(H2D, self.aring.host_ready.get((layer, c)))
        home = self.act_home[(layer, c)]
        em.add(Fetch(f"ctx.x.L{layer}.c{c}", stage, Ref(home.region, home.offset, xb)))
        em.wait(COMPUTE, em.record(H2D))
        em.add(Compute(name, "kv_rebuild", rnd, layer, c, weights=w, save=stage))
        self.kv_stage_free[i] = em.record(COMPUTE)
