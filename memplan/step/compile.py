"""The step as data: `compile_schedule(plan)` turns a plan into one frozen list of typed events
(fetch, write-back, fill, compute, host task, optimizer update, record, wait), each on its stream
and naming the byte ranges it touches, plus the region table every one of those ranges lives in.
The simulator (memplan/search/round_sim.py) times exactly this list and the executor (dataflow/executor.py)
dispatches exactly this list, so the plan that is predicted is the plan that runs.

Slot assignment (which slot a streamed block or saved activation visits, evicting the one needed
farthest ahead) and fetch timing (a fetch is issued as soon as its slot is free) are decided here,
once per plan, by the slot rings of memplan/step/slot_ring.py; the events and Schedule themselves are
memplan/step/events.py. Pure Python: never imports array libraries, never touches a device."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.step.events import (
    COMPUTE,
    D2H,
    EVENT_TYPES,
    H2D,
    HOST,
    OPT,
    STREAMS,
    Compute,
    Event,
    Fetch,
    Fill,
    HostTask,
    Record,
    Ref,
    Region,
    RegionTable,
    Schedule,
    Update,
    Wait,
    WriteBack,
)
from dataflow.memplan.plan.memory import device_regions, embed_row_parts, grad_bpe, host_regions
from dataflow.memplan.plan.plan import OptimizerWhere, Where
from dataflow.memplan.plan.segments import (KV_REGION, boundary_kv_sharers, inner_region, is_inner,
                              kv_rebuilt, segment_bounds)
from dataflow.memplan.step.slot_ring import ZERO, _Emitter, _Ring, _Use, for_round
from dataflow.models.flops import SavedLevel
from dataflow.models.layout import embed_layout, head_layout, layer_layout

# The data (Region, Ref, the events, Schedule) lives in memplan/step/events.py and the slot rings in
# memplan/step/slot_ring.py; the public names are re-exported here, where the rest of the code imports
# them.
__all__ = [
    "COMPUTE", "D2H", "EVENT_TYPES", "H2D", "HOST", "OPT", "STREAMS", "ZERO", "Compute", "Event",
    "Fetch", "Fill", "HostTask", "Record", "Ref", "Region", "RegionTable", "Schedule", "Update",
    "Wait", "WriteBack", "UPDATE_MODES", "block_key", "compile_eval_schedule", "compile_schedule",
    "compile_update_schedule", "level_of", "region_table",
]


def region_table(plan) -> RegionTable:
    d = decisions_of(plan)

    def lay(place, regions):
        out, at = [], 0
        for name, nbytes in regions:
            out.append(Region(name, place, at, nbytes))
            at += buffers.align(nbytes)
        return tuple(out)

    budget = plan.budget if hasattr(plan, "budget") else None
    return RegionTable(device=lay("device", device_regions(d)), host=lay("host", host_regions(d)),
                       device_budget=budget.device_bytes if budget else 0,
                       host_budget=budget.host_bytes if budget else 0)


def block_key(kind: str, layer: int | None = None) -> str:
    return f"layer{layer}" if kind == "layer" else kind


class _Compiler:
    def __init__(self, plan):
        self.plan = plan
        self.d = d = decisions_of(plan)
        self.cfg, self.ch = d.model, d.chunking
        self.table = region_table(plan)
        self.em = _Emitter()
        self.gdt = "bf16" if grad_bpe(d.grad_accum) == 2 else "f32"
        self.numel = {"layer": layer_layout(self.cfg).numel,
                      "embed": embed_layout(self.cfg).numel, "head": head_layout(self.cfg).numel}
        self.L, self.C, self.T = self.cfg.n_layers, self.ch.chunks_per_round, self.ch.chunk_tokens
        self.k = d.segment_layers
        self.segments = segment_bounds(self.L, self.k)
        self.targets_ready: int | None = None
        self.embed_grads_ready: int | None = None
        self.embed_w_ready: int | None = None
        """The deferred update of a HOME embedding table has written it back (HOST or OPT)."""
        self.pending: set[str] = set()
        """Blocks whose deferred AdamW (update='deferred') is still to be placed in round 0."""
        self.deferring = False
        """Compiling a deferred update (its gradients were final before this list began)."""
        self.in_backward: frozenset[str] = frozenset()
        """Layers whose AdamW update='backward' runs in the last round (_backward_updated)."""
        self.backward_done: int | None = None
        """OPT record after the last such update's write-back."""
        self.scale_on_host: int | None = None
        self.host_scale_read: int | None = None
        """HOST record after the deferred host updates read the last step's clip scale."""
        self.params_ready: int | None = None
        """OPT record after a deferred streamed update's last kernel (before its write-backs)."""
        self.dx_sent: int | None = None
        """The last round's embedding gradient rows have left the residual buffer (D2H)."""
        self.n_rounds = self.ch.rounds_per_step
        self.staged: dict[int, int] = {}
        """Round -> the host record after its token rows (and embedding rows) were staged."""
        self.buf_free: list[list[int]] = [[], []]
        """Per pinned staging buffer: what must finish before it is restaged (its fetches, and
        the embedding scatter that read its ids)."""
        self.stage_free: list[int | None] = [None, None]
        self.has_embed, self.has_head = d.holds_embed, d.holds_head  # a ring rank's plan: its own
        self.row_parts = embed_row_parts(self.ch)
        """Parts of the pinned embedding rows (a HOME table): round r gathers into, fetches
        from and takes its gradient rows back into part r % row_parts."""
        self.rows_free: list[list[int]] = [[] for _ in range(self.row_parts)]
        """Per part of the embedding rows: what must finish before it is gathered into again
        (the fetch out of it, the scatter that read the gradient rows in it)."""
        self.rows_sent: dict[int, int] = {}
        """Round -> the H2D record after its gathered rows left their part for the device."""
        self._regions = self.table.by_name()
        self._ctx_offsets = buffers.offsets(buffers.context_specs(
            self.cfg, self.ch.seqlen, self.T, self.ch.chunks_per_seq))
        self._act_offsets = {lv: buffers.offsets(buffers.saved_activation_specs(
            self.cfg, self.T, lv)) for lv in SavedLevel}
        self._tr_specs = {sp.name: sp for sp in buffers.transition_specs(
            self.cfg, self.ch.tokens_per_round)}
        self._tr_offsets = buffers.offsets(tuple(self._tr_specs.values()))
        self.kv_sharers = boundary_kv_sharers(self.d)
        """(layer, chunk)s whose K/V go through KV_REGION (dataflow.memplan.plan.segments)."""
        self.kv_rebuilt = kv_rebuilt(self.d)
        """(layer, chunk)s whose K/V the backward re-forms from x (Plan.kv_rebuild)."""
        self.kv_stage_free: list[int | None] = [None] * buffers.KV_REBUILD_STAGES
        """Per kv_rebuild staging buffer: the compute record after the last re-forming that read
        it (its next H2D waits for it)."""
        self.kv_stage_next = 0
        self.kv_stored: dict[int, int] = {}
        """Chunk -> the D2H record after a shared boundary's K/V rows of it reached KV_REGION."""
        self.kv_read: int | None = None
        """The H2D record after the last refill from KV_REGION (its next writer waits for it)."""
        self._build_rings()

    # -- refs -------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._regions

    def ref(self, name: str, offset: int = 0, nbytes: int | None = None) -> Ref:
        r = self._regions[name]
        return Ref(name, offset, r.nbytes - offset if nbytes is None else nbytes)

    def block(self, key: str, part: str, home: bool) -> Ref | None:
        kind = "layer" if key.startswith("layer") else key
        bpe = {"weights": 2, "grads": 2 if self.gdt == "bf16" else 4, "m": 2, "v": 2}[part]
        name = ("home." if home else "") + f"{key}.{part}"
        return self.ref(name, 0, self.numel[kind] * bpe) if self.has(name) else None

    def placement(self, key: str):
        if key.startswith("layer"):
            return self.d.layers[int(key[5:])]
        return self.d.embed if key == "embed" else self.d.head

    def _slots(self, region: str, count: int, size: int) -> list[Ref]:
        if count == 0 or not self.has(region):
            return []
        return [Ref(region, i * size, size) for i in range(count)]

    # -- rings ------------------------------------------------------------------------------
    def _build_rings(self) -> None:
        d, L, em = self.d, self.L, self.em
        n = self.numel["layer"]
        gb = 2 if self.gdt == "bf16" else 4
        self.wring = self.gring = self.aring = self.hw_ring = self.hg_ring = None
        # The backward's layer visits in issue order: per segment, top first, its recompute
        # ('r', forward order) then its backward ('b', reverse order); without segments the
        # backward alone, L-1..0.
        k = self.k
        self.recompute_top = {}
        back: list[tuple[str, int]] = []
        for first, end in reversed(self.segments):
            if end - first >= 2:
                self.recompute_top[end - 1] = (first, end)
                back += [("r", j) for j in range(first, end)]
            back += [("b", j) for j in reversed(range(first, end))]
        streamed = [i for i in range(L) if d.layers[i].weights is Where.HOME]
        if streamed:
            self.wring = _Ring(em, self._slots("weight_slots", d.slots.weight_slots, n * 2), "w")
            home = {i: self.block(f"layer{i}", "weights", True) for i in streamed}
            order = [("f", i) for i in streamed] + [(ph, i) for ph, i in back if i in home]
            self.w_uses = [_Use(i, home[i]) for _, i in order]
            self.w_assigned = self.wring.assign_rounds(self.w_uses)
            self.w_index = {use: j for j, use in enumerate(order)}
        gstreamed = [i for i in reversed(range(L)) if d.layers[i].grads is Where.HOME]
        if gstreamed:
            self.gring = _Ring(em, self._slots("grad_slots", d.slots.grad_slots, n * gb), "g")
            home = {i: self.block(f"layer{i}", "grads", True) for i in gstreamed}
            self.g_uses = {first: [_Use(i, ZERO if first else home[i], home[i], self.gdt)
                                   for i in gstreamed] for first in (True, False)}
            self.g_assigned = {k: self.gring.assign(u) for k, u in self.g_uses.items()}
            self.g_index = {i: j for j, i in enumerate(gstreamed)}
        no_kv = self.kv_sharers | self.kv_rebuilt
        self.act_bytes, self.act_dev, self.act_home = {}, {}, {}
        for layer in range(L):
            for c in range(self.C):
                a = d.activations[layer][c]
                nb = self.act_bytes[(layer, c)] = buffers.saved_activation_bytes(
                    self.cfg, self.T, a.level, kv=(layer, c) not in no_kv)
                name = inner_region(layer, c, k, a.home) if is_inner(layer, k) else \
                    f"{'home.' if a.home is Where.HOME else ''}act.{layer}.{c}"
                (self.act_home if a.home is Where.HOME else self.act_dev)[(layer, c)] = \
                    self.ref(name, 0, nb)
        if self.act_home:
            # Uses of the activation slots in issue order: the forward writes the kept ones;
            # per segment, top first, the recompute reads the boundary ('r') and writes the
            # rebuilt inner ones ('w'), then the backward reads them all ('b').
            home, C = self.act_home, self.C
            order = [("f", l, c) for l in range(L) for c in range(C)
                     if (l, c) in home and not is_inner(l, k)]
            for ph, j in back:
                chunks = range(C) if ph == "r" else reversed(range(C))
                phase = "b" if ph == "b" else "w" if is_inner(j, k) else "r"
                order += [(phase, j, c) for c in chunks if (j, c) in home]
            size = max(self.act_bytes[key] for key in home)
            self.aring = _Ring(em, self._slots("act_slots", d.slots.act_slots, size), "act")
            self.a_uses = [_Use((l, c), None, home[(l, c)]) if ph in "fw" else
                           _Use((l, c), home[(l, c)], None) for ph, l, c in order]
            self.a_assigned = self.aring.assign(self.a_uses)
            self.a_index = {use: j for j, use in enumerate(order)}
        head = d.head
        nh = self.numel["head"]
        if head.weights is Where.HOME and d.holds_head:
            self.hw_ring = _Ring(em, [self.ref("head.weights", 0, nh * 2)], "headw")
            self.hw_uses = [_Use("head", self.block("head", "weights", True))]
            self.hw_assigned = self.hw_ring.assign_rounds(self.hw_uses)
        if head.grads is Where.HOME and d.holds_head:
            self.hg_ring = _Ring(em, [self.ref("head.grads", 0, nh * gb)], "headg")
            hg = self.block("head", "grads", True)
            self.hg_uses = {f: [_Use("head", ZERO if f else hg, hg, self.gdt)]
                            for f in (True, False)}
            self.hg_assigned = {f: self.hg_ring.assign(u) for f, u in self.hg_uses.items()}

    def weights(self, phase: str, layer: int) -> Ref:
        dev = self.block(f"layer{layer}", "weights", False)
        return dev if dev is not None else self.wring.acquire(self.w_index[(phase, layer)])

    def weights_ahead(self, phase: str, layer: int) -> Ref | None:
        """weights(phase, layer) acquired before the use ahead of it is released, or None when
        the ring cannot yet (its slot still holds that use: a ring of one slot)."""
        dev = self.block(f"layer{layer}", "weights", False)
        if dev is not None:
            return dev
        i = self.w_index[(phase, layer)]
        return self.wring.acquire(i) if self.wring.ready(i) else None

    def release_weights(self, phase: str, layer: int) -> None:
        if self.block(f"layer{layer}", "weights", False) is None:
            self.wring.release(self.w_index[(phase, layer)])

    def grads(self, layer: int) -> Ref:
        dev = self.block(f"layer{layer}", "grads", False)
        return dev if dev is not None else self.gring.acquire(self.g_index[layer])

    def release_grads(self, layer: int) -> None:
        if self.block(f"layer{layer}", "grads", False) is None:
            self.gring.release(self.g_index[layer])

    def act(self, phase: str, layer: int, chunk: int) -> Ref:
        """Where (layer, chunk)'s saved activation is, for its use in `phase`: 'f' forward
        save, 'r' / 'w' a segment recompute reading the boundary / writing an inner one, 'b'
        backward."""
        if self.d.activations[layer][chunk].home is Where.DEVICE:
            return self.act_dev[(layer, chunk)]
        slot = self.aring.acquire(self.a_index[(phase, layer, chunk)])
        return Ref(slot.region, slot.offset, self.act_bytes[(layer, chunk)])

    def release_act(self, phase: str, layer: int, chunk: int) -> None:
        if self.d.activations[layer][chunk].home is Where.HOME:
            self.aring.release(self.a_index[(phase, layer, chunk)])

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
        starts = []
        for rnd in range(rounds):
            starts.append(len(em.events))
            self.round(rnd)
        if self.pending:
            raise RuntimeError(f"deferred updates never placed: {sorted(self.pending)}")
        opt_start = len(em.events)
        # The last in-round update still reads the scale that clip_scale rewrites (to 1 again),
        # and the step ends after its write-back.
        em.wait(COMPUTE, self.backward_done)
        self.grad_norm()
        if update in ("end", "backward"):
            self.optimizer(skip=self.in_backward)
        return Schedule(self.table, tuple(em.events), rounds, tuple(starts), opt_start, em.n_ids)

    def _backward_updated(self) -> frozenset[str]:
        """The layers update='backward' updates inside the last round: streamed ones whose
        weights and gradients both pass through slots and whose AdamW streams through the
        device."""
        if self.wring is None or self.gring is None:
            return frozenset()
        out = set()
        for key in (f"layer{i}" for i in range(self.L)):
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
        em, key = self.em, f"layer{layer}"
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
            uses = [_Use(i, self.block(f"layer{i}", "weights", True)) for i in streamed]
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
                dev = self.block(f"layer{layer}", "weights", False)
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
            w = self.hw_ring.acquire(0) if self.hw_ring else self.block("head", "weights", False)
            em.wait(COMPUTE, self.targets_ready)
            # The loss kernel also forms lm_head's gradient; at grad_scale 0 it adds exact zeros
            # into the device head.grads region (a slot or the resident sum, idle between steps).
            em.add(Compute("head", "head_loss", rnd, weights=w,
                           grads=self.ref("head.grads", 0, self.numel["head"] * (
                               2 if self.gdt == "bf16" else 4)), x=final, y=other))
            if self.hw_ring is not None:
                self.hw_ring.release(0)
        end = len(em.events)
        return Schedule(self.table, tuple(em.events), rounds, tuple(starts), end, em.n_ids)

    def _transition(self, name: str) -> tuple[int, int]:
        return self._tr_offsets[name], self._tr_specs[name].nbytes

    # -- hooks: where a wrapping compiler (memplan/step/ring_compile.py) adds its events ---------
    has_embed = True
    """This compiler's rounds run the embedding (a ring rank: only the owner of layer 0)."""
    has_head = True
    """This compiler's rounds run the head (a ring rank: only the owner of the last layer)."""

    def global_layer(self, layer: int) -> int:
        """The model's index of plan layer `layer`, for event names (one device: the same)."""
        return layer

    def resid(self, layer: int) -> tuple[str, str]:
        """(input, output) residual buffers of `layer`'s forward; its backward reads the
        gradient from the first and writes the input gradient into the second. One device:
        consecutive layers ping-pong between the two."""
        return ("resid_a", "resid_b") if layer % 2 == 0 else ("resid_b", "resid_a")

    def stage_next(self, rnd: int) -> None:
        """After round `rnd`'s embedding: the next round's host work hides behind this round
        (unless both rounds share one part of the embedding rows: the next round is then staged
        when its tokens load, after this round's backward)."""
        if self.stage_ahead_ok(rnd + 1):
            self.stage(rnd + 1)

    def input_arrives(self, rnd: int, backward: bool, layer: int, buffer: str,
                      chunk: int) -> None:
        """Before `layer`'s compute of `chunk` reads its rows of `buffer` (one device: they are
        already there)."""

    def before_write(self, buffer: str, chunk: int) -> None:
        """Before a compute overwrites `chunk`'s rows of `buffer` (one device: nothing reads
        them after the compute that wrote them)."""

    def output_leaves(self, rnd: int, backward: bool, layer: int, buffer: str,
                      chunk: int) -> None:
        """After `layer`'s compute of `chunk` wrote its rows of `buffer` (one device: they stay
        for the next layer)."""

    def grads_final(self, what: str, grads: Ref, stream: str) -> None:
        """The step's gradient of block `what` is complete in `grads` (written on `stream`),
        right before its squared norm (one device: nothing more to add)."""

    def owned_blocks(self) -> list[str]:
        """The blocks the optimizer updates (one device: all of them; a plan that does not hold
        the embedding or head: not those)."""
        return [f"layer{i}" for i in range(self.L)] + ["embed"] * self.has_embed \
            + ["head"] * self.has_head

    def round(self, rnd: int) -> None:
        em, L, first = self.em, self.L, rnd == 0
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
                        if f"layer{u.key}" in self.in_backward else u for u in uses]
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
        for layer in range(L):                                          # forward, layer-major
            x, y = self.resid(layer)
            name = self.global_layer(layer)
            w = self.weights("f", layer)
            keep = not is_inner(layer, self.k)  # a segment's inner layers keep nothing
            for c in range(self.C):
                self.input_arrives(rnd, False, layer, x, c)
                self.before_write(y, c)
                save = self.act("f", layer, c) if keep else None
                em.add(Compute(f"f.L{name}.c{c}", "layer_fwd", rnd, layer, c, weights=w,
                               save=save, x=x, y=y))
                if keep:
                    self.release_act("f", layer, c)
                self.output_leaves(rnd, False, layer, y, c)
            self.release_weights("f", layer)
            if first and "head" in self.pending and layer == max(L - 2, 0):
                self.deferred_update("head")
            if self.has_head and layer == L - 2 and self.hw_ring is not None:
                self.hw_ring.prefetch(0)                              # head weights arrive early
        if self.has_head:
            dfinal, final = self.resid(L - 1)  # the last output; its input's rows take dfinal
            for c in range(self.C):
                self.before_write(dfinal, c)
            self.head(rnd, final, dfinal)
        split, cps = self.ch.chunks_per_seq > 1, self.ch.chunks_per_seq
        prefilled: dict[tuple[int, int], int | None] = {}
        """(layer, sequence) whose context rows were queued while the one before it ran: the
        H2D record after the last of them that came over H2D (None if none did)."""
        for layer in reversed(range(L)):                                # backward, reverse order
            dy, dx = self.resid(layer)
            name = self.global_layer(layer)
            if layer in self.recompute_top:
                self.recompute(rnd, *self.recompute_top[layer], buf=dx)
            w = self.weights("b", layer)
            g = self.grads(layer)
            for c in reversed(range(self.C)):
                self.input_arrives(rnd, True, layer, dy, c)
                seq, j = divmod(c, cps)
                if split and j == cps - 1:
                    if (layer, seq) not in prefilled:
                        self.fill_context(rnd, layer, c, w)
                    else:  # not a record taken now: the queue may hold later layers' fetches
                        em.wait(COMPUTE, prefilled.pop((layer, seq)))
                self.before_write(dx, c)
                save = self.act("b", layer, c)
                em.add(Compute(f"b.L{name}.c{c}", "layer_bwd", rnd, layer, c, weights=w,
                               grads=g, save=save, x=dy, y=dx))
                if split:
                    self.prefill_context(rnd, layer, seq, j, prefilled, w)
                self.release_act("b", layer, c)
                self.output_leaves(rnd, True, layer, dx, c)
            if layer == 0 and self.has_embed:
                # First in the D2H queue: the next round's forward waits for the embedding's
                # gradient rows to leave, not for layer 0's gradient write-back.
                self.embed_bwd(rnd, dx)
            self.sumsq(rnd, f"L{name}", g)
            if rnd == self.last_round and f"layer{layer}" in self.in_backward:
                self.update_in_backward(layer, w, g)
                continue
            self.release_grads(layer)
            self.release_weights("b", layer)

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

    def _tokens(self, rnd: int, row: int | None = None) -> Ref:
        """Pinned token staging of round `rnd` (buffer rnd % 2): rows ids, positions, targets;
        one row, or all three."""
        n4 = self.ch.tokens_per_round * 4
        at = (rnd % 2) * 3 * n4
        return self.ref("tokens", at, 3 * n4) if row is None else \
            self.ref("tokens", at + row * n4, n4)

    def _rows(self, rnd: int) -> Ref:
        """Round `rnd`'s part of the pinned embedding rows (part rnd % row_parts: two parts for
        alternate rounds when a step has more than one round, else one): its gathered rows, and
        later the gradient rows the backward sends home over them."""
        nb = self.ch.tokens_per_round * self.cfg.model_dim * 2
        return self.ref("embed_rows", (rnd % self.row_parts) * nb, nb)

    def stage(self, rnd: int) -> None:
        """Round `rnd`'s host work: its ids, positions and targets (the trainer's data) into
        pinned buffer rnd % 2 and, for a HOME embedding table, its rows gathered next to them.
        Issued one round ahead, so it runs on the host while the previous round computes; the
        table does not change within a step."""
        if rnd in self.staged or rnd >= self.n_rounds:
            return
        em = self.em
        gather = self.gathers_rows()
        waits = self.buf_free[rnd % 2]
        if gather:  # with two parts these are already among the staging buffer's
            part = rnd % self.row_parts
            waits = waits + [ev for ev in self.rows_free[part] if ev not in waits]
            self.rows_free[part] = []
        for ev in waits:
            em.wait(HOST, ev)
        if gather:  # a deferred update of the table it gathers from
            em.wait(HOST, self.embed_w_ready)
        self.buf_free[rnd % 2] = []
        em.add(HostTask("tokens.stage", "tokens_stage", rnd, self._tokens(rnd)))
        if gather:
            em.add(HostTask("embed.gather", "embed_gather", rnd, self._rows(rnd)))
        self.staged[rnd] = em.record(HOST)

    def stage_ahead_ok(self, rnd: int) -> bool:
        """Whether round `rnd` may be staged before the previous round's backward: not when
        both share one part of the embedding rows, whose gradient rows come home only then."""
        return not self.gathers_rows() or self.row_parts > 1

    def gathers_rows(self) -> bool:
        """The host gathers each round's embedding rows: a HOME table this plan holds (a ring
        rank without the embedding gathers nothing)."""
        return self.d.holds_embed and self.block("embed", "weights", False) is None

    def load_tokens(self, rnd: int) -> None:
        """Token ids, RoPE positions and targets of the round (staged on the host, usually one
        round ahead): one H2D each, once the compute no longer reads the last round's."""
        em = self.em
        self.stage(rnd)
        em.wait(H2D, self.staged[rnd])
        em.wait(H2D, em.record(COMPUTE))
        for row, name in enumerate(("ids", "positions", "targets")):
            off, nb = self._transition(name)
            em.add(Fetch(f"tokens.{name}", self.ref("transitions", off, nb),
                         self._tokens(rnd, row)))
        ev = em.record(H2D)
        em.wait(COMPUTE, ev)
        em.wait(COMPUTE, self.dx_sent)  # this round overwrites the residual buffers
        self.targets_ready = ev
        self.buf_free[rnd % 2].append(ev)

    def embed_fwd(self, rnd: int, out: str) -> None:
        em = self.em
        dev = self.block("embed", "weights", False)
        if dev is not None:
            em.add(Compute("embed.fwd", "embed_fwd", rnd, weights=dev, y=out))
            return
        off, nb = self._transition(out)
        em.add(Fetch("embed.rows", self.ref("transitions", off, nb), self._rows(rnd)))
        ev = em.record(H2D)
        em.wait(COMPUTE, ev)
        self.buf_free[rnd % 2].append(ev)
        self.rows_free[rnd % self.row_parts].append(ev)
        self.rows_sent[rnd] = ev

    def embed_bwd(self, rnd: int, dx: str) -> None:
        em = self.em
        dev = self.block("embed", "grads", False)
        if dev is not None:
            em.add(Compute("embed.bwd", "embed_bwd", rnd, grads=dev, x=dx))
            self.sumsq(rnd, "embed", dev)
            return
        em.wait(D2H, em.record(COMPUTE))
        em.wait(D2H, self.embed_grads_ready)  # the last scatter is done (kept: the D2H order)
        # The gradient rows come home over the round's gathered rows: after those left for the
        # device (the next gather into this part waits for the scatter: rows_free).
        em.wait(D2H, self.rows_sent[rnd])
        off, n = self._transition(dx)
        rows = self._rows(rnd)
        em.add(WriteBack("embed.dx", rows, self.ref("transitions", off, n)))
        self.dx_sent = em.record(D2H)
        em.wait(HOST, self.dx_sent)
        home = self.block("embed", "grads", True)
        em.add(HostTask("embed.scatter", "embed_scatter", rnd, home, src=rows))
        if rnd == self.last_round:  # the squared norm of the finished sum, on the host
            em.add(HostTask("gnorm.embed", "grad_sumsq", rnd, home))
        ev = em.record(HOST)
        self.embed_grads_ready = ev
        self.buf_free[rnd % 2].append(ev)  # the scatter read this round's ids
        self.rows_free[rnd % self.row_parts].append(ev)  # and the gradient rows in its part

    def head(self, rnd: int, final: str, dfinal: str) -> None:
        w = self.hw_ring.acquire(0) if self.hw_ring else self.block("head", "weights", False)
        g = self.hg_ring.acquire(0) if self.hg_ring else self.block("head", "grads", False)
        self.em.wait(COMPUTE, self.targets_ready)
        self.em.add(Compute("head", "head", rnd, weights=w, grads=g, x=final, y=dfinal))
        self.sumsq(rnd, "head", g)
        if self.hg_ring:
            self.hg_ring.release(0)
        if self.hw_ring:
            self.hw_ring.release(0)

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

    # -- gradient norm and clipping, on the device -------------------------------------------
    def sumsq(self, rnd: int, what: str, grads: Ref) -> None:
        """In the step's last round a block's gradient sum is complete (in its slot or resident
        region) right after its backward: add its squared norm into the device scalar."""
        if rnd == self.last_round:
            self.grads_final(what, grads, COMPUTE)
            self.em.add(Compute(f"gnorm.{what}", "grad_sumsq", rnd, grads=grads))

    def grad_norm(self) -> None:
        """Global squared norm (plus the host's part for a HOME embedding gradient) and the clip
        scale every update reads, both on the device; the host gets the scale by one small D2H
        when a block is updated there. Nothing waits on the host."""
        em = self.em
        if self.block("embed", "grads", False) is None:
            em.wait(H2D, self.embed_grads_ready)
            em.add(Fetch("gnorm.embed", self.ref("transitions", self._scalar(2), 4),
                         self.ref("norm_host", 0, 4)))
            em.wait(COMPUTE, em.record(H2D))
        em.add(Compute("clip_scale", "clip_scale", self.last_round))
        self.scale_on_host = None
        keys = [f"layer{i}" for i in range(self.L)] + ["embed", "head"]
        if any(self.placement(k).optimizer is OptimizerWhere.HOST for k in keys):
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

    def _grads_ready(self, key: str, stream: str) -> None:
        ring = self.gring if key.startswith("layer") else self.hg_ring if key == "head" else None
        gkey = int(key[5:]) if key.startswith("layer") else key
        if ring is not None:
            self.em.wait(stream, ring.host_ready.get(gkey))
        if key == "embed":
            self.em.wait(stream, self.embed_grads_ready)

    def _numel(self, key: str) -> int:
        return self.numel["layer" if key.startswith("layer") else key]

    def update_device(self, key: str) -> None:
        parts = [self.block(key, p, False) for p in ("weights", "grads", "m", "v")]
        self.em.add(Update(f"adamw.{key}", key, 0, self._numel(key), *parts))
        self.em.add(Fill(f"zero_grads.{key}", parts[1], self.gdt))

    def update_host(self, key: str) -> None:
        em = self.em
        self._grads_ready(key, HOST)
        em.wait(HOST, self.scale_on_host)
        em.wait(HOST, em.record(H2D))  # the device may still be reading the home weights
        parts = [self.block(key, p, True) for p in ("weights", "grads", "m", "v")]
        em.add(Update(f"adamw.host.{key}", key, 0, self._numel(key), *parts, stream=HOST))
        em.record(HOST)

    def zero_home_embed_grads(self) -> None:
        """The embedding's home gradient accumulates in place on the host (layers' home
        gradients restart from a zero fill in round 0 instead): clear it early in round 0,
        behind the next round's staging and long before round 0's scatter, not at the end of
        the last step, where its 0.3 s (8b) was the step's tail. Between steps it holds the
        last step's sum."""
        home = self.block("embed", "grads", True)
        if home is None or self.d.embed.grads is not Where.HOME:
            return
        em = self.em
        em.wait(HOST, self.embed_grads_ready)
        em.add(Fill("zero_grads.embed", home, self.gdt, HOST))
        self.embed_grads_ready = em.record(HOST)

    def update_streamed(self, key: str, params: Ref | None = None,
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
        bpe = [2, 2 if self.gdt == "bf16" else 4, 2, 2]
        numel = self._numel(key)
        for i, start in enumerate(range(0, numel, n_stage)):
            n = min(n_stage, numel - start)
            buf = i % 2
            dev = [self.ref("opt_stage", offs[f"{x}{buf}"], n * b) for x, b in zip("pgmv", bpe)]
            if params is not None:
                dev[0] = Ref(params.region, params.offset + start * 2, n * 2)
            if grads is not None:
                dev[1] = Ref(grads.region, grads.offset + start * bpe[1], n * bpe[1])
            host = [Ref(h.region, h.offset + start * b, n * b) for h, b in zip(home, bpe)]
            em.wait(H2D, self.stage_free[buf])
            for j, (dst, src) in enumerate(zip(dev, host)):
                if grads is None or j >= 2:  # in place: weights and gradient are on the device
                    em.add(Fetch(f"opt.h2d.{key}", dst, src))
            # A deferred update's kernel and write-backs run on their own stream: the compute
            # stream never queues behind its fetches, nor the activations' write-backs behind
            # its copies.
            ust, wst = (OPT, OPT) if self.deferring else (COMPUTE, D2H)
            em.wait(ust, em.record(H2D))
            em.add(Update(f"adamw.{key}.{i}", key, start, n, *dev, stream=ust))
            if wst != ust:
                em.wait(wst, em.record(ust))
            elif start + n == numel:
                self.params_ready = em.record(OPT)  # the last piece's kernel, before its copies
            for j in (0, 2, 3):
                em.add(WriteBack(f"opt.d2h.{key}", host[j], dev[j], stream=wst))
            self.stage_free[buf] = em.record(wst)
        return em.record(wst)

    # -- the previous step's update, deferred into round 0 (update='deferred') ---------------
    def fused(self, key: str) -> bool:
        """A streamed layer whose deferred update fills the weight slot of its round-0
        forward: the update's H2D of the weights is that forward's fetch."""
        if not key.startswith("layer") or self.wring is None:
            return False
        p = self.placement(key)
        return p.weights is Where.HOME and p.optimizer is OptimizerWhere.STREAMED

    def deferred_prefix(self) -> None:
        """Round 0's start: the pending updates that are not fused into a weight fetch (the
        embedding, resident and host-updated layers), before anything reads those blocks;
        then the first fused layer fetches are queued, ahead of the token and row uploads."""
        for key in [k for k in self.owned_blocks() if k != "head" and not self.fused(k)]:
            self.deferred_update(key)
        if self.wring is not None:
            self.wring.fill = self.fill_weights
            self.wring.prefetch(len(self.wring.slots) - 1)

    def deferred_update(self, key: str) -> None:
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

    def _home_updated(self, key: str, done: int) -> None:
        """After `done`, key's home weights hold the update and its home gradient was read:
        the round's weight fetches, gradient write-backs, gathers and zero fills wait for it."""
        if key == "embed":
            self.embed_w_ready = self.embed_grads_ready = done
            return
        rings = (self.wring, self.gring) if key.startswith("layer") else \
            (self.hw_ring, self.hg_ring)
        rkey = int(key[5:]) if key.startswith("layer") else key
        for ring in rings:
            if ring is not None:
                ring.host_ready[rkey] = done

    def fill_weights(self, use, slot: Ref) -> tuple[int, int] | None:
        """The weight ring's fill hook in round 0 of a deferred step: a pending streamed
        layer's first fetch is its update, in the slot (None: fetch as usual). Returns (OPT
        record after its last kernel, OPT record after the updated weights left the slot)."""
        key = f"layer{use.key}"
        if key not in self.pending or not self.fused(key):
            return None
        self.pending.discard(key)
        self.deferring = True
        done = self.update_streamed(key, params=slot)
        self.deferring = False
        self._home_updated(key, done)
        return self.params_ready, done


UPDATE_MODES = ("end", "none", "deferred", "backward")
"""Where a step's AdamW runs (_Compiler.compile): after its last round, not in its list, the
previous step's inside its round 0, or inside its own last round, each streamed layer's right
after its gradient is final ('backward': no clipping, whose global norm would have to come
first; the other blocks after the last round, as 'end')."""


def compile_schedule(plan, *, rounds: int | None = None, update: str = "end") -> Schedule:
    """The event list of one step of `plan` (a Plan or Decisions). `rounds` overrides the
    plan's rounds per step (the search times a first and a later round this way); `update`
    says where AdamW runs (UPDATE_MODES; 'end' unless the trainer defers it)."""
    return _Compiler(plan).compile(rounds, update)


def compile_update_schedule(plan) -> Schedule:
    """The AdamW over every block alone, reading the clip scale a step compiled with
    update='none' or 'deferred' left on the device: the pending update, run before state is
    read, saved or evaluated between steps."""
    return _Compiler(plan).compile_update()


def compile_eval_schedule(plan, rounds: int = 1) -> Schedule:
    """The event list of a forward-only evaluation of `rounds` rounds of `plan` (same region
    table, slots and token staging as its training step; no backward, no optimizer: its
    `optimizer_start` is the end of the list)."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"an evaluation needs a whole number of rounds >= 1, got {rounds!r}")
    return _Compiler(plan).compile_eval(rounds)


def level_of(plan, layer: int, chunk: int) -> SavedLevel:
    return decisions_of(plan).activations[layer][chunk].level
