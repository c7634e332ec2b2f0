"""The step compiler's state: the region table of a plan, the slot rings its streamed weights,
gradients and saved activations visit (memplan/step/slot_ring.py), the refs every event names,
and the hooks a wrapping compiler (memplan/step/ring_compile.py) overrides. Emits no event of
the step itself; never imports memplan.search, never touches a device."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.memory import device_regions, embed_row_parts, grad_bpe, host_regions
from dataflow.memplan.plan.plan import Where
from dataflow.memplan.plan.segments import (
    boundary_kv_sharers,
    inner_region,
    is_inner,
    kv_rebuilt,
    segment_bounds,
)
from dataflow.memplan.step.events import (
    Ref,
    Region,
    RegionTable,
)
from dataflow.memplan.step.slot_ring import ZERO, _Emitter, _Ring, _Use
from dataflow.models.flops import SavedLevel


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


@dataclasses.dataclass(frozen=True, slots=True)
class BlockKey:
    """One block of the model the compiler moves and updates: a layer (by its index in the
    plan), the embedding or the head. Typed, so a layer's index is never parsed back out of
    its name; `name` is what the region table and the events spell ('layer3', 'embed')."""

    kind: str
    """'layer', 'embed' or 'head'."""
    layer: int | None = None
    """The plan's layer index (a ring rank's local one); None for the embedding and head."""

    @classmethod
    def of_layer(cls, layer: int) -> BlockKey:
        return cls("layer", layer)

    @property
    def is_layer(self) -> bool:
        return self.kind == "layer"

    @property
    def name(self) -> str:
        """The block's name in region and event names: 'layer3', 'embed', 'head'."""
        return f"layer{self.layer}" if self.is_layer else self.kind


EMBED, HEAD = BlockKey("embed"), BlockKey("head")


def block_key(kind: str, layer: int | None = None) -> str:
    """The name of a block in the region table and the events (BlockKey.name)."""
    return BlockKey(kind, layer if kind == "layer" else None).name


class CompilerState:
    """What every part of the step compiler reads: the plan's decisions, its region table and
    refs, the slot rings and the hooks. The parts (rounds, model ends, context, update) are
    mixed into dataflow.memplan.step.compile.StepCompiler with it."""

    def __init__(self, plan):
        self.plan = plan
        self.d = d = decisions_of(plan)
        self.cfg, self.ch = d.model, d.chunking
        self.table = region_table(plan)
        self.em = _Emitter()
        self.gdt = "bf16" if grad_bpe(d.grad_accum) == 2 else "f32"
        self.numel = buffers.block_elems(self.cfg, d.lora)
        """Elements of each kind of block (an fp8 base's layer: its codes and scales)."""
        self.L, self.C, self.T = self.cfg.n_layers, self.ch.chunks_per_round, self.ch.chunk_tokens
        self.k = d.segment_layers
        self.segments = segment_bounds(self.L, self.k)
        self.targets_ready: int | None = None
        self.embed_grads_ready: int | None = None
        self.embed_w_ready: int | None = None
        """The deferred update of a HOME embedding table has written it back (HOST or OPT)."""
        self.pending: set[BlockKey] = set()
        """Blocks whose deferred AdamW (update='deferred') is still to be placed in round 0."""
        self.deferring = False
        """Compiling a deferred update (its gradients were final before this list began)."""
        self.in_backward: frozenset[BlockKey] = frozenset()
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
            self.cfg, self.T, lv, lora=self.d.lora)) for lv in SavedLevel}
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

    def block(self, key: BlockKey, part: str, home: bool) -> Ref | None:
        bpe = {"weights": 2, "grads": 2 if self.gdt == "bf16" else 4, "m": 2, "v": 2}[part]
        name = ("home." if home else "") + f"{key.name}.{part}"
        return self.ref(name, 0, self.numel[key.kind] * bpe) if self.has(name) else None

    def placement(self, key: BlockKey):
        if key.is_layer:
            return self.d.layers[key.layer]
        return self.d.embed if key == EMBED else self.d.head

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
            home = {i: self.block(BlockKey.of_layer(i), "weights", True) for i in streamed}
            order = [("f", i) for i in streamed] + [(ph, i) for ph, i in back if i in home]
            self.w_uses = [_Use(i, home[i]) for _, i in order]
            self.w_assigned = self.wring.assign_rounds(self.w_uses)
            self.w_index = {use: j for j, use in enumerate(order)}
        gstreamed = [i for i in reversed(range(L))
                     if d.layers[i].grads is Where.HOME and not d.frozen.layer(i)]
        if gstreamed:
            self.gring = _Ring(em, self._slots("grad_slots", d.slots.grad_slots, n * gb), "g")
            home = {i: self.block(BlockKey.of_layer(i), "grads", True) for i in gstreamed}
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
                    self.cfg, self.T, a.level, kv=(layer, c) not in no_kv, lora=d.lora)
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
            self.hw_uses = [_Use("head", self.block(HEAD, "weights", True))]
            self.hw_assigned = self.hw_ring.assign_rounds(self.hw_uses)
        if head.grads is Where.HOME and d.holds_head and not d.frozen.head:
            self.hg_ring = _Ring(em, [self.ref("head.grads", 0, nh * gb)], "headg")
            hg = self.block(HEAD, "grads", True)
            self.hg_uses = {f: [_Use("head", ZERO if f else hg, hg, self.gdt)]
                            for f in (True, False)}
            self.hg_assigned = {f: self.hg_ring.assign(u) for f, u in self.hg_uses.items()}

    def weights(self, phase: str, layer: int) -> Ref:
        dev = self.block(BlockKey.of_layer(layer), "weights", False)
        return dev if dev is not None else self.wring.acquire(self.w_index[(phase, layer)])

    def weights_ahead(self, phase: str, layer: int) -> Ref | None:
        """weights(phase, layer) acquired before the use ahead of it is released, or None when
        the ring cannot yet (its slot still holds that use: a ring of one slot)."""
        dev = self.block(BlockKey.of_layer(layer), "weights", False)
        if dev is not None:
            return dev
        i = self.w_index[(phase, layer)]
        return self.wring.acquire(i) if self.wring.ready(i) else None

    def release_weights(self, phase: str, layer: int) -> None:
        if self.block(BlockKey.of_layer(layer), "weights", False) is None:
            self.wring.release(self.w_index[(phase, layer)])

    def frozen(self, key: BlockKey) -> bool:
        """Whether `key` is frozen (Plan.frozen): no gradient, no AdamW."""
        return self.d.frozen.block(key.kind, key.layer)

    def grads(self, layer: int) -> Ref | None:
        """Where layer `layer`'s gradient accumulates; None for a frozen layer (its backward
        forms the input gradient only)."""
        if self.d.frozen.layer(layer):
            return None
        dev = self.block(BlockKey.of_layer(layer), "grads", False)
        return dev if dev is not None else self.gring.acquire(self.g_index[layer])

    def release_grads(self, layer: int) -> None:
        if self.d.frozen.layer(layer):
            return
        if self.block(BlockKey.of_layer(layer), "grads", False) is None:
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

    def _transition(self, name: str) -> tuple[int, int]:
        return self._tr_offsets[name], self._tr_specs[name].nbytes

    def round_rows(self, rnd: int, name: str) -> Ref:
        """Round `rnd`'s rows of the transition `name` (one set for every round; an overlapped
        ring rank's odd rounds have their own: dataflow.memplan.step.ring_rounds)."""
        return self.ref("transitions", *self._transition(name))

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

    def owned_blocks(self) -> list[BlockKey]:
        """The blocks the optimizer updates (one device: all of them but the frozen ones; a
        plan that does not hold the embedding or head: not those)."""
        keys = [BlockKey.of_layer(i) for i in range(self.L)] + [EMBED] * self.has_embed \
            + [HEAD] * self.has_head
        return [k for k in keys if not self.frozen(k)]
