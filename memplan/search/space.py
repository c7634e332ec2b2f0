"""The search space for one chunking: a compact State (how many layers are resident, slot
counts, where embedding/head/optimizer live, how many saved activations sit in each (home, level)
class) and the fixed patterns that turn it into full Decisions. Memory and work of a State are
computed in O(layers), and agree exactly with memory.py and cost.py on the materialised plan
(tested). Never imports array libraries."""

from __future__ import annotations

import dataclasses
import functools

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.chunking import head_sub_tokens
from dataflow.memplan.plan.decisions import HOME_HOST, HOME_STREAMED, RESIDENT, Decisions
from dataflow.memplan.plan.frozen import NOTHING_FROZEN, Frozen
from dataflow.memplan.plan.lora import region_sizes
from dataflow.memplan.plan.memory import (
    NORM_HOST_BYTES,
    TOKEN_ID_BYTES,
    TOKEN_STAGING_ROWS,
    grad_bpe,
    row_parts,
    state_elems,
)
from dataflow.memplan.plan.plan import (
    AttentionBwd,
    Precision,
    Chunking,
    GradAccum,
    HardwareProfile,
    SavedActivation,
    Slots,
    Where,
)
from dataflow.memplan.plan.segments import (
    REBUILT_KV_LEVELS,
    is_inner,
    kv_region_nbytes,
    segment_bounds,
)
from dataflow.memplan.search.cost import (
    KEEPS_ATTN_OUT,
    LEVEL_INDEX,
    OptimizerCost,
    adamw_cost,
    chunk_costs,
    head_seconds,
    kv_rebuild_cost,
    make_workload,
    segment_recompute,
)
from dataflow.memplan.search.round_sim import Workload
from dataflow.models.config import ModelConfig
from dataflow.models.flops import SavedLevel

ACT_CLASSES = ((Where.DEVICE, SavedLevel.FULL), (Where.DEVICE, SavedLevel.INP_ATTN),
               (Where.DEVICE, SavedLevel.INP_ONLY), (Where.HOME, SavedLevel.FULL),
               (Where.HOME, SavedLevel.INP_ATTN), (Where.HOME, SavedLevel.INP_ONLY))
"""Saved-activation classes in the order they are laid along the spread order (State.acts)."""
_CLASS_LEVEL = tuple(LEVEL_INDEX[level] for _, level in ACT_CLASSES)
"""LEVEL_INDEX of each class (the search's inner loops look it up per layer)."""
OPT_STAGE_TARGET_ELEMS = 1 << 24
"""Elements per piece of a STREAMED optimizer (param, grad, m, v double-buffered)."""


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class State:
    resident: int
    """Layers whose state lives on the device (spread evenly over the stack)."""
    embed_dev: bool
    head_dev: bool
    opt_streamed: bool
    """Home blocks' AdamW runs STREAMED through the device (else on the host)."""
    weight_slots: int
    grad_slots: int
    act_slots: int
    acts: tuple[int, int, int, int, int, int]
    """Counts per ACT_CLASSES entry; they sum to kept layers x chunks per round (every layer
    without segments; the segments' boundary layers with them)."""

    def but(self, **changes) -> State:
        """This State with `changes`: dataclasses.replace without its scan of the fields (the
        search makes some 10^5 States a request)."""
        kw = {"resident": self.resident, "embed_dev": self.embed_dev,
              "head_dev": self.head_dev, "opt_streamed": self.opt_streamed,
              "weight_slots": self.weight_slots, "grad_slots": self.grad_slots,
              "act_slots": self.act_slots, "acts": self.acts}
        kw.update(changes)
        return State(**kw)

    def key(self) -> tuple:
        """The fields in order: sorted(states, key=State.key) orders as sorted(states), with
        one tuple built per State instead of two per comparison."""
        return (self.resident, self.embed_dev, self.head_dev, self.opt_streamed,
                self.weight_slots, self.grad_slots, self.act_slots, self.acts)


def spread_order(n: int) -> list[int]:
    """0..n-1 in bit-reversed order, so every prefix is spread evenly."""
    bits = max(1, (n - 1).bit_length())
    keys = [(int(format(i, f"0{bits}b")[::-1], 2), i) for i in range(1 << bits)]
    return [i for _, i in sorted(keys) if i < n]


class Space:
    """Everything fixed for one (model, chunking, profile, grad accumulation) and, for layer-
    segment recompute (memplan/plan/segments.py), one segment length with one ACT_CLASSES entry for
    every rebuilt inner activation. The State's activation classes then spread over the kept
    (boundary) layers only."""

    def __init__(self, cfg: ModelConfig, ch: Chunking, p: HardwareProfile, grad_accum: GradAccum,
                 segment_layers: int = 1, inner_class: int = 5,
                 attention_bwd: AttentionBwd = AttentionBwd.DETERMINISTIC,
                 holds: tuple[bool, bool] = (True, True), kv_rebuild: bool = False,
                 precision: Precision = Precision.BF16, frozen: Frozen = NOTHING_FROZEN,
                 lora=None, state_parts: int = 1, whole_update_cost: bool = False):
        self.cfg, self.ch, self.p, self.grad_accum = cfg, ch, p, grad_accum
        self.attention_bwd = attention_bwd
        self.precision = precision
        self.frozen = frozen
        """Plan.frozen: blocks with weights only (no gradients, AdamW state or their work)."""
        self.lora = lora
        """Plan.lora: the adapters' device regions and work (dataflow.memplan.plan.lora)."""
        self.state_parts = state_parts
        """Plan.state_parts: a split-update replica's layers and head hold m / v for a part."""
        self.whole_update_cost = whole_update_cost
        """Decisions.whole_update_cost: its AdamW scored as if whole (else for its part)."""
        self.kv_rebuild = kv_rebuild
        """Plan.kv_rebuild: INP_ONLY/INP_ATTN activations keep no K/V; each costs a re-forming."""
        self.holds = holds
        """(embedding, head) this plan holds: a ring rank holds only those it owns."""
        self.holds_embed, self.holds_head = holds
        self.L, self.C = cfg.n_layers, ch.chunks_per_round
        self.k, self.inner_class = segment_layers, inner_class
        kept = [first for first, _ in segment_bounds(self.L, self.k)]
        self.N = len(kept) * self.C
        self.order = spread_order(self.L)
        self.rank = {layer: r for r, layer in enumerate(self.order)}
        self.kept_rank = {kept[i]: r for r, i in enumerate(spread_order(len(kept)))}
        self.n_kept = len(kept)
        # Split sequences: boundaries kept at home at INP_ONLY leave their K/V to one shared
        # region (dataflow.memplan.plan.segments.shares_boundary_kv); a last segment of one layer keeps them.
        self.kv_free_b = self.kv_region_b = 0
        self.kv_keeper = None
        if self.k > 1 and ch.chunks_per_seq > 1:
            t = ch.chunk_tokens
            self.kv_free_b = buffers.saved_activation_bytes(cfg, t, SavedLevel.INP_ONLY) \
                - buffers.saved_activation_bytes(cfg, t, SavedLevel.INP_ONLY, kv=False)
            self.kv_region_b = buffers.align(kv_region_nbytes(cfg, ch))
            self.kv_keeper = kept[-1] if self.L - kept[-1] == 1 else None
        self.n_inner = (self.L - self.n_kept) * self.C
        """Rebuilt activations per round; their storage is reused by every segment:"""
        self.n_inner_slots = (min(self.k, self.L) - 1) * self.C
        self.elems = buffers.block_elems(cfg, lora)
        self.gbpe = grad_bpe(grad_accum)
        e = self.elems
        self.layer_b, self.layer_g = e["layer"] * 2, e["layer"] * self.gbpe
        self.mv_b = {k: 2 * n * 2 for k, n in e.items()}
        """Bytes of a block's m and v (bf16): a split replica's layers and head hold a part."""
        if state_parts > 1:
            for k in ("layer", "head"):
                self.mv_b[k] = 2 * buffers.align(state_elems(e[k], state_parts) * 2)
        self.block_state = {k: n * 2 + n * self.gbpe + self.mv_b[k] for k, n in e.items()}
        t = ch.chunk_tokens
        self.act_size = tuple(buffers.saved_activation_bytes(
            cfg, t, lv, kv=not (kv_rebuild and lv in REBUILT_KV_LEVELS), lora=lora)
            for _, lv in ACT_CLASSES)
        self.head_sub = head_sub_tokens(t)
        self.fixed_device = self._fixed_device_bytes(t)
        part = ch.tokens_per_round * cfg.model_dim * 2
        self.rows_b = {n: buffers.align(n * part) for n in (1, 2)}
        """Host bytes of a HOME embedding's pinned rows by their parts (memory.row_parts)."""
        held = [e["layer"]] + [e["embed"]] * self.holds_embed + [e["head"]] * self.holds_head
        self.fixed_host = max(held) * 2 + buffers.align(
            TOKEN_STAGING_ROWS * ch.tokens_per_round * TOKEN_ID_BYTES) + NORM_HOST_BYTES
        self.opt_stage_elems = min(OPT_STAGE_TARGET_ELEMS, max(e.values()))
        gdt = "bf16" if grad_accum is GradAccum.BF16 else "f32"
        self.opt_stage_b = buffers.packed_bytes(buffers.opt_stage_specs(self.opt_stage_elems, gdt))
        self.costs = chunk_costs(cfg, ch, p, attention_bwd is AttentionBwd.DETERMINISTIC,
                                 precision, lora)
        kv_s, kv_f = kv_rebuild_cost(cfg, t, p) if kv_rebuild else (0.0, 0.0)
        rebuilt = [LEVEL_INDEX[lv] for lv in REBUILT_KV_LEVELS] if kv_rebuild else []
        rec_s = [tuple(r + kv_s * (i in rebuilt) for i, r in enumerate(c.rec_s))
                 for c in self.costs]
        rec_f = [tuple(r + kv_f * (i in rebuilt) for i, r in enumerate(c.rec_flops))
                 for c in self.costs]
        # prefix sums over chunk index of recompute seconds/FLOPs per level index
        self.rec_pre = [[0.0] for _ in range(3)]
        self.recf_pre = [[0.0] for _ in range(3)]
        for rs, rf in zip(rec_s, rec_f):
            for i in range(3):
                self.rec_pre[i].append(self.rec_pre[i][-1] + rs[i])
                self.recf_pre[i].append(self.recf_pre[i][-1] + rf[i])
        self.fwd_s = sum(c.fwd_s for c in self.costs)
        self._init_frozen(frozen)
        self.compute_round_s = self.L * self.fwd_s + sum(self.bwd_of) + self.holds_head \
            * self.C * head_seconds(cfg, t, self.head_sub, self.gbpe, p, frozen.head)
        # A chunk kept at home brings x over H2D a second time for its re-forming, during the
        # backward of the layer above (dataflow.memplan.step.compile.prefill_context): H2D bytes of that
        # layer's activation traffic, which the workload hides behind compute where it can.
        x_b = t * cfg.model_dim * 2 if kv_rebuild else 0
        self.class_extra_b = tuple(x_b if where is Where.HOME and lv in REBUILT_KV_LEVELS
                                   else 0 for where, lv in ACT_CLASSES)
        self.seg_s, self.seg_flops = segment_recompute(self.costs, self.L, self.k)
        self._init_rerun()
        rerun = bool(self.top_of)
        self.min_rec_s = tuple(
            min(r[LEVEL_INDEX[lv]] - rerun * (self.rerun_pre[LEVEL_INDEX[lv]][c + 1]
                                              - self.rerun_pre[LEVEL_INDEX[lv]][c])
                for c, r in enumerate(rec_s)) for _, lv in ACT_CLASSES)
        """Per class, the least recompute of one of its items (a boundary's re-run saving
        counted off: a bound)."""
        inner_level = ACT_CLASSES[inner_class][1]
        self.inner_rec_s = (self.L - self.n_kept) * (
            self.rec_pre[LEVEL_INDEX[inner_level]][-1]) + sum(self.seg_s)
        """Recompute seconds of the rebuilt layers (their levels and the segments' forward)."""
        self.resident_set = functools.cache(self._resident_set)
        self._work_by_acts: dict | None = None
        """State.acts -> _layer_work (lists shared by Workloads: nothing mutates them), while
        the search grows this space's chains (start_chains to end_chains); None otherwise."""

    def _init_rerun(self) -> None:
        """A boundary of a segment of two or more layers that keeps its attention output is
        re-run without attention: seg_s charges a whole forward to the segment's top layer,
        which gets the difference back per boundary chunk at such a level (prefix sums by
        level index; zero for INP_ONLY)."""
        self.top_of = {first: end - 1 for first, end in segment_bounds(self.L, self.k)
                       if end - first >= 2}
        self.rerun_pre = [[0.0] for _ in range(3)]
        self.rerunf_pre = [[0.0] for _ in range(3)]
        for cc in self.costs:
            for i, lv in enumerate((SavedLevel.FULL, SavedLevel.INP_ATTN, SavedLevel.INP_ONLY)):
                kept = lv in KEEPS_ATTN_OUT
                self.rerun_pre[i].append(self.rerun_pre[i][-1]
                                         + kept * (cc.fwd_s - cc.refwd_kept_s))
                self.rerunf_pre[i].append(self.rerunf_pre[i][-1]
                                          + kept * (cc.fwd_flops - cc.refwd_kept_flops))

    def _init_frozen(self, frozen: Frozen) -> None:
        """Per-layer backward seconds (a frozen layer's without its weight-gradient GEMMs) and
        the counts State.memory needs: frozen layers among the first k of the spread order
        (the resident ones), and the bytes a frozen block holds less than a trained one."""
        self.bwd0 = sum(c.bwd_s for c in self.costs)
        bwd_frozen = sum(c.bwd_frozen_s for c in self.costs)
        self.bwd_of = [bwd_frozen if frozen.layer(i) else self.bwd0 for i in range(self.L)]
        self.frozen_res = [0]
        for layer in self.order:
            self.frozen_res.append(self.frozen_res[-1] + frozen.layer(layer))
        self.n_frozen = len(frozen.layers)
        self.untrained_b = {k: v - self.elems[k] * 2 for k, v in self.block_state.items()}
        """Bytes of gradient and AdamW state a frozen block does not hold (per block kind)."""

    def _fixed_device_bytes(self, t: int) -> int:
        """Device bytes every state of this space holds whatever it places: a chunk's
        workspace, the context, transitions, library scratch, the head's buffers and weights
        where this plan holds it, the attention workspace and the library reserve."""
        cfg, ch, e = self.cfg, self.ch, self.elems
        fixed = sum(buffers.packed_bytes(s) for s in (
            buffers.chunk_workspace_specs(cfg, t, self.precision),
            buffers.context_specs(cfg, ch.seqlen, t, ch.chunks_per_seq),
            buffers.transition_specs(cfg, ch.tokens_per_round),
            buffers.library_scratch_specs(cfg)))
        if self.holds_head:  # its buffers, and its weights and grads (a region or a slot)
            fixed += buffers.packed_bytes(buffers.head_specs(cfg, t, self.head_sub)) \
                + e["head"] * 2 + e["head"] * self.gbpe * (not self.frozen.head)
        fixed += buffers.align(buffers.attention_workspace_bytes(
            cfg, t, ch.seqlen, deterministic=self.attention_bwd is AttentionBwd.DETERMINISTIC))
        fixed += self.p.library_reserve_bytes  # outside the arena, inside the budget
        # the LoRA adapter regions (memory.device_regions)
        fixed += sum(buffers.align(n) for n in region_sizes(cfg, self.lora, t).values())
        if self.kv_rebuild:
            fixed += buffers.align(buffers.packed_bytes(buffers.kv_rebuild_specs(cfg, t)))
        return fixed

    def _resident_set(self, k: int) -> frozenset[int]:
        return frozenset(self.order[:k])

    # -- memory ----------------------------------------------------------------------------
    def _trained_home_layers(self, s: State) -> int:
        """Layers at home (not among the resident) that train: their gradients use slots."""
        return self.L - s.resident - (self.n_frozen - self.frozen_res[s.resident])

    def _any_streamed_opt(self, s: State) -> bool:
        fz = self.frozen
        return s.opt_streamed and (self._trained_home_layers(s) > 0
                                   or not (s.embed_dev or fz.embed)
                                   or not (s.head_dev or fz.head))

    def memory(self, s: State, rounds_per_step: int | None = None) -> tuple[int, int]:
        """(device bytes, host bytes) of the materialised plan at `rounds_per_step` rounds a
        step (default: this space's chunking's), computed in O(1). Only a HOME embedding's
        pinned rows depend on the rounds (one part at one round, two at more); the device
        bytes never do."""
        e, L = self.elems, self.L
        if rounds_per_step is None:
            rounds_per_step = self.ch.rounds_per_step
        fz, less = self.frozen, self.untrained_b
        frozen_res = self.frozen_res[s.resident]
        dev = self.fixed_device + s.resident * self.block_state["layer"] \
            - frozen_res * less["layer"]
        host = self.fixed_host + (L - s.resident) * self.block_state["layer"] \
            - (self.n_frozen - frozen_res) * less["layer"]
        if s.resident < L:
            dev += s.weight_slots * self.layer_b
            dev += s.grad_slots * self.layer_g * (self._trained_home_layers(s) > 0)
        if not self.holds_embed:
            pass
        elif s.embed_dev:
            dev += self.block_state["embed"] - fz.embed * less["embed"]
        else:
            host += self.block_state["embed"] - fz.embed * less["embed"] \
                + self.rows_b[row_parts(rounds_per_step)]
        if not self.holds_head:
            pass
        elif s.head_dev:
            dev += self.mv_b["head"] * (not fz.head)
        else:
            host += self.block_state["head"] - fz.head * less["head"]
        dev += sum(n * b for n, b in zip(s.acts[:3], self.act_size[:3]))
        host += sum(n * b for n, b in zip(s.acts[3:], self.act_size[3:]))
        home_max = max((b for n, b in zip(s.acts[3:], self.act_size[3:]) if n), default=0)
        if self.n_inner_slots:  # rebuilt activations' storage, shared by the segments
            size = self.act_size[self.inner_class]
            if self.inner_class >= 3:
                host += self.n_inner_slots * size
                home_max = max(home_max, size)
            else:
                dev += self.n_inner_slots * size
        if self.kv_free_b and s.acts[5]:
            n = s.acts[5]
            if self.kv_keeper is not None:
                n -= sum(hi - lo for cls, lo, hi in self._layer_classes(
                    self.kv_keeper, self._bounds(s)) if cls == 5)
            if n:
                host += self.kv_region_b - n * self.kv_free_b
        dev += s.act_slots * home_max
        if self._any_streamed_opt(s):
            dev += self.opt_stage_b
        return dev, host

    def optimizer(self, s: State) -> OptimizerCost:
        """The AdamW of `s` (cost.adamw_cost): a split update's replica (state_parts R) updates
        its part of every layer and of the head (make_workload counts the same), unless
        whole_update_cost."""
        e, fz = self.elems, self.frozen
        parts = 1 if self.whole_update_cost else self.state_parts
        layer = state_elems(e["layer"], parts)
        emb = e["embed"] * self.holds_embed * (not fz.embed)
        head = state_elems(e["head"], parts) * self.holds_head * (not fz.head)
        trained_res = s.resident - self.frozen_res[s.resident]
        dev = trained_res * layer + s.embed_dev * emb + s.head_dev * head
        home = self._trained_home_layers(s) * layer + (not s.embed_dev) * emb \
            + (not s.head_dev) * head
        return adamw_cost(dev, home * s.opt_streamed, home * (not s.opt_streamed), self.gbpe,
                          self.p)

    def round_lower_bound_s(self, s: State) -> float:
        """A lower bound on a round's seconds: compute plus the least recompute of its levels."""
        return self.compute_round_s + sum(n * r for n, r in zip(s.acts, self.min_rec_s)) \
            + self.inner_rec_s

    # -- patterns --------------------------------------------------------------------------
    def _layer_classes(self, layer: int, bounds: list[int]):
        """(class index, first chunk, end chunk) ranges of `layer` for class bounds along the
        spread order of the kept layers (column r holds chunk C-1-r; position r*kept + rank);
        a rebuilt inner layer's chunks are all in the inner class."""
        C = self.C
        if is_inner(layer, self.k):
            return [(self.inner_class, 0, C)]
        rho, L = self.kept_rank[layer], self.n_kept
        out = []
        b0 = bounds[0]
        for k in range(6):  # an empty class (equal bounds) has no chunks: skipped unclipped
            b1 = bounds[k + 1]
            if b1 > b0:
                lo = -(-(b0 - rho) // L)
                hi = -(-(b1 - rho) // L)
                lo, hi = (lo if lo > 0 else 0), (hi if hi < C else C)
                if hi > lo:
                    out.append((k, C - hi, C - lo))
            b0 = b1
        return out

    @staticmethod
    def _bounds(s: State) -> list[int]:
        b = [0]
        for n in s.acts:
            b.append(b[-1] + n)
        return b

    def workload(self, s: State) -> Workload:
        cache = self._work_by_acts
        per_layer = None if cache is None else cache.get(s.acts)
        if per_layer is None:
            per_layer = self._layer_work(s)
            if cache is not None:
                cache[s.acts] = per_layer
        bwd_s, act_count, act_bytes, rec_s, rec_f = per_layer
        return make_workload(self._shell(s), self.p, fwd_s=self.fwd_s, bwd_s=bwd_s,
                             act_count=act_count, act_bytes=act_bytes, rec_s=rec_s,
                             rec_flops=rec_f, costs=self.costs, elems=self.elems, gbpe=self.gbpe)

    def start_chains(self) -> None:
        """Keep each activation split's per-layer work until end_chains: most chain moves
        (resident layers, slots, embedding, head, optimizer) leave the split alone."""
        self._work_by_acts = {}

    def end_chains(self) -> None:
        """Drop the per-acts work: kept, it would add a quarter to a cached candidate table
        (2.5 MiB of 11.5 for 8b at 65k), and grow with every budget a sweep asks about."""
        self._work_by_acts = None

    def _layer_work(self, s: State) -> tuple:
        """(backward seconds, home activation count, their bytes) per layer, and the round's
        recompute seconds and FLOPs, of `s`'s activation classes (nothing else of `s`)."""
        bounds = self._bounds(s)
        bwd_s, act_count, act_bytes = [], [], []
        rec_s, rec_f = 0.0, self.seg_flops
        saved = {}  # segment top layer -> re-run (seconds, FLOPs) its boundary saves
        for layer in range(self.L):
            r, rf = self.seg_s[layer], 0.0
            r_off, rf_off = saved.pop(layer, (0.0, 0.0))
            r, rf = r - r_off, rf - rf_off
            k = b = 0
            top = self.top_of.get(layer)
            for cls, c0, c1 in self._layer_classes(layer, bounds):
                li = _CLASS_LEVEL[cls]
                r += self.rec_pre[li][c1] - self.rec_pre[li][c0]
                rf += self.recf_pre[li][c1] - self.recf_pre[li][c0]
                if top is not None:
                    a, af = saved.get(top, (0.0, 0.0))
                    saved[top] = (a + self.rerun_pre[li][c1] - self.rerun_pre[li][c0],
                                  af + self.rerunf_pre[li][c1] - self.rerunf_pre[li][c0])
                if cls >= 3:
                    k += c1 - c0
                    b += (c1 - c0) * (self.act_size[cls] + self.class_extra_b[cls])
            bwd_s.append(self.bwd_of[layer] + r)
            rec_s += r
            rec_f += rf
            act_count.append(k)
            act_bytes.append(b)
        return bwd_s, act_count, act_bytes, rec_s, rec_f

    def _shell(self, s: State, rounds_per_step: int = 1, activations=()) -> Decisions:
        home = HOME_STREAMED if s.opt_streamed else HOME_HOST
        res = self.resident_set(s.resident)
        layers = tuple(RESIDENT if i in res else home for i in range(self.L))
        streamed = s.resident < self.L
        n_home = sum(s.acts[3:]) + (self.n_inner if self.inner_class >= 3 else 0)
        slots = Slots(weight_slots=s.weight_slots if streamed else 0,
                      grad_slots=s.grad_slots if self._trained_home_layers(s) else 0,
                      act_slots=s.act_slots if n_home else 0, head_sub_tokens=self.head_sub,
                      opt_stage_elems=self.opt_stage_elems if self._any_streamed_opt(s) else 0)
        ch = dataclasses.replace(self.ch, rounds_per_step=rounds_per_step)
        return Decisions(model=self.cfg, chunking=ch, slots=slots, layers=layers,
                         activations=activations, embed=RESIDENT if s.embed_dev else home,
                         head=RESIDENT if s.head_dev else home, grad_accum=self.grad_accum,
                         segment_layers=self.k, attention_bwd=self.attention_bwd,
                         holds_embed=self.holds_embed, holds_head=self.holds_head,
                         kv_rebuild=self.kv_rebuild, precision=self.precision,
                         frozen=self.frozen, lora=self.lora, state_parts=self.state_parts,
                         whole_update_cost=self.whole_update_cost)

    def decisions(self, s: State, rounds_per_step: int) -> Decisions:
        """The full Decisions a State stands for."""
        bounds = self._bounds(s)
        rows = []
        for layer in range(self.L):
            row = [None] * self.C
            for cls, c0, c1 in self._layer_classes(layer, bounds):
                where, level = ACT_CLASSES[cls]
                for c in range(c0, c1):
                    row[c] = SavedActivation(level=level, home=where)
            rows.append(tuple(row))
        return self._shell(s, rounds_per_step, tuple(rows))
