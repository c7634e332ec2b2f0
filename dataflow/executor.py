"""Runs a compiled Schedule on a Backend: binds the schedule's region table to the backend's
arenas, then dispatches the step's events in order — fetches, write-backs and fills as copies,
compute events and host tasks through a table of one handler per ComputeOp / HostOp
(dataflow.executor_ops), records and waits as backend events. Every decision (slots, fetch timing, placement) was made by
memplan.schedule; nothing here decides placement or calls CuPy / NumPy kernels directly.

An MoE model's auxiliary losses are per round (dataflow.moe_ffn): the executor clears the round's
routing totals before its first forward, has each forward proper add to them, reads them in every
backward of the round with the coefficients divided by the step's rounds, and keeps each round's
(aux, z) beside its LM loss; the step reports their mean over rounds."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from dataflow.arena import Arena
from dataflow.backend import Backend, BackendError, Place, Stream
from dataflow.batch import Batch, default_chunks, make_batch, round_chunks
from dataflow.blocks import Block, bind_blocks
from dataflow.layer_ops import LayerCompute
from dataflow.lora_adapters import DeviceAdapters
from dataflow.moe_ffn import RoundRouting, stacked_experts
from dataflow.executor_ops import OpHandlers
from dataflow.fp8_base import base_decoder, stored_layer_layout
from dataflow.fp8_base import block_views as fp8_block_views
from dataflow.kernels.host import adamw as host_adamw
from dataflow.kernels.host.memory import zero_fill
from dataflow.memplan.plan import buffers
from dataflow.memplan.step.events import ComputeOp, HostOp
from dataflow.memplan.plan.memory import (ODD_ROWS, OVERLAP_ROWS_REGION, overlap_row_specs,
                                          round_row_name)
from dataflow.memplan.plan.plan import AttentionBwd, GradAccum, Plan
from dataflow.memplan.plan.segments import kv_less
from dataflow.memplan.search.expert_cost import expert_path
from dataflow.memplan.step.compile import (Compute, Fetch, Fill, HostTask, Record, Ref, Schedule, Update,
                              Wait, WriteBack, compile_eval_schedule, compile_schedule,
                              compile_update_schedule)
from dataflow.models.fp8_layout import Fp8LayerLayout
from dataflow.models.layout import embed_layout, head_layout

STREAM = {s.value: s for s in Stream}
DTYPE_BYTES = buffers.DTYPE_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class RoundStats:
    round: int
    loss_sum: float
    tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    loss: float
    """Mean cross-entropy over the step's counted targets (labels other than -100)."""
    tokens: int
    rounds: tuple[RoundStats, ...]
    step_time_s: float
    h2d_bytes: int
    d2h_bytes: int
    grad_norm: float | None = None
    """Global L2 norm of the step's gradients before clipping (None for an evaluation)."""
    aux_loss: float | None = None
    """MoE models: the load-balancing loss, the mean over the rounds of each round's (one
    forward's) value, unscaled by its coefficient; None when dense."""
    z_loss: float | None = None
    """MoE models: the router z-loss, likewise the mean of the rounds'; None when dense."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepProgress:
    """How far the step (or evaluation) in flight has been dispatched: `dispatched` of `events`
    schedule events, the last of them named `at`. The NumPy backend runs each event as it is
    dispatched; the CuPy backend lets the compute stream run at most a few hundred ops ahead of
    the GPU (dataflow.backends.cupy_backend.RUN_AHEAD_OPS), so it is a close lower bound there
    too. Read from another thread while a long step runs (the demo's progress lines)."""

    dispatched: int
    events: int
    at: str

    @property
    def fraction(self) -> float:
        return self.dispatched / max(1, self.events)


class Executor(OpHandlers):
    def __init__(self, plan: Plan, be: Backend, schedule: Schedule | None = None, *,
                 deferred_update: bool = False, compile_step=None, compile_update=None,
                 compile_eval=None, backward_update: bool = False):
        """deferred_update: a step's AdamW runs inside the next step's round 0 (each streamed
        layer's update fills the weight slot its forward reads, hiding the update behind that
        round's compute), or in `flush()`; a given `schedule` runs as it is (not deferred).
        compile_step(update), compile_update() and compile_eval(rounds): the step's, the lone
        update's and an evaluation's schedules (default: dataflow.memplan.step.compile's of `plan`; a ring
        rank's add its messages). backward_update: a step that does not clip runs its AdamW
        inside its own last round (update='backward': each streamed layer's right after its
        gradient is final, from its slots; the same bits as at the end), after running any
        deferred update still pending; clipped steps keep the mode above."""
        self.plan, self.be, self.cfg = plan, be, plan.model
        cfg, ch = plan.model, plan.chunking
        self.aux_round_factor = 1
        """The step's rounds over all processes per round of this one (R data-parallel replicas
        each run 1/R of the global batch's rounds): an MoE model's auxiliary losses are the mean
        over all of them."""
        self.aux_layers = cfg.n_layers
        """The MoE layers whose rows a round's auxiliary losses average over: the model's (a ring
        rank's plan holds only its own layers; its routing totals are the whole ring's)."""
        if ch.rounds_per_step > buffers.MAX_ROUNDS_PER_STEP:
            raise BackendError(f"rounds_per_step {ch.rounds_per_step} exceeds "
                               f"{buffers.MAX_ROUNDS_PER_STEP}; use longer chunks or fewer rounds")
        self.deferred = deferred_update and schedule is None
        self.backward_update = backward_update and schedule is None
        self._backward_schedule = None  # compiled on the first step that uses it
        self.pending_hyper: tuple | None = None
        """This step's AdamW hyperparameters while its update waits (deferred_update)."""
        step = compile_step or (lambda update: compile_schedule(plan, update=update))
        self._compile_step = step
        self._compile_eval = compile_eval or (lambda rounds: compile_eval_schedule(plan, rounds))
        if self.deferred:
            self.schedule = step("deferred")
            self._first_schedule = step("none")
            self._update_schedule = (compile_update or (lambda: compile_update_schedule(plan)))()
        else:
            self.schedule = schedule or step("end")
        table = self.schedule.regions
        # the libraries' own state beside the arena, inside the budget (plus an overlap's regions)
        self.dev = Arena(be, Place.DEVICE, max(plan.budget.device_bytes, table.device_budget)
                         - plan.profile.library_reserve_bytes,
                         [(r.name, r.nbytes) for r in table.device])
        self.host = Arena(be, Place.HOST, plan.budget.host_bytes,
                          [(r.name, r.nbytes) for r in table.host], whole_budget=False)
        self._arena = {r.name: self.dev for r in table.device}
        self._arena.update({r.name: self.host for r in table.host})
        self.gdt = "f32" if plan.grad_accum is GradAccum.FP32 else "bf16"
        self.lay, self.emb_lay, self.head_lay = stored_layer_layout(plan), embed_layout(cfg), head_layout(cfg)
        self.T, self.C = ch.chunk_tokens, ch.chunks_per_round
        self.chunks = default_chunks(ch)
        self._round_chunks: list = []
        """Per round of the running step: its chunks, with the batch's document segments."""
        self._batch: Batch | None = None
        self._eval_schedules: dict[int, Schedule] = {}
        self.ws = self.dev.tensors("workspace", buffers.chunk_workspace_specs(cfg, self.T,
                                                                              plan.precision))
        self.ctx = self.dev.tensors("context", buffers.context_specs(
            cfg, ch.seqlen, self.T, ch.chunks_per_seq))
        self.tr, self._odd_rows = self._bind_rows()
        self.hb = self.dev.tensors("head_buffers", buffers.head_specs(
            cfg, self.T, plan.slots.head_sub_tokens)) if plan.holds_head else None
        self.compute = LayerCompute(be, cfg, self.ws, self.ctx, base_decoder(plan, be, self.dev))
        self.lora = None if plan.lora is None else DeviceAdapters(be, self.dev, cfg, plan.lora,
                                                                  self.T)
        """A LoRA plan's adapters (dataflow.lora_adapters): set up by the Engine."""
        self._routing: RoundRouting | None = None
        """An MoE model's round totals and the auxiliary losses' scale for the step in flight."""
        self._moe_round: int | None = None
        """The round whose routing the totals hold (cleared before its first forward)."""
        self.embed, self.layers, self.head = bind_blocks(plan, self.dev, self.host, self.gdt)
        self._tied = self._tied_views(plan) if cfg.tie_embeddings and plan.holds_head else None
        """A tied head's projection and its gradient: the embedding's resident table and
        gradient (ModelConfig.tie_embeddings; the planner keeps that table on the device)."""
        self.act_specs = {}
        self._views: dict = {}
        self._events: list = []
        self._dispatch = {Fetch: self._copy, WriteBack: self._copy, Fill: self._fill,
                          Compute: self._compute, HostTask: self._host_task,
                          Update: self._update, Record: self._record, Wait: self._wait}
        self._compute_ops = {
            ComputeOp.LAYER_FWD: self._layer_fwd, ComputeOp.LAYER_REFWD: self._refwd,
            ComputeOp.LAYER_BWD: self._layer_bwd, ComputeOp.HEAD: self._head,
            ComputeOp.HEAD_LOSS: self._head, ComputeOp.MOE_TOTALS_ADD: self._moe_totals_add,
            ComputeOp.CTX_CAST: self._ctx_cast, ComputeOp.KV_REBUILD: self._kv_rebuild,
            ComputeOp.EMBED_FWD: self._embed_fwd, ComputeOp.EMBED_BWD: self._embed_bwd,
            ComputeOp.GRAD_SUMSQ: self._grad_sumsq, ComputeOp.CLIP_SCALE: self._clip_scale}
        """The handler of each compute op (dataflow.executor_ops.OpHandlers)."""
        self._host_ops = {
            HostOp.TOKENS_STAGE: self._tokens_stage, HostOp.EMBED_GATHER: self._embed_gather,
            HostOp.EMBED_SCATTER: self._embed_scatter, HostOp.GRAD_SUMSQ: self._host_grad_sumsq}
        """The handler of each host task."""
        self.dispatched: list | None = None
        """Set to a list to have every dispatched event appended (tests, the null backend)."""
        self._n_events = self._n_done = 0
        self._at = None
        self._kv_less = kv_less(plan)
        """(layer, chunk)s whose saved activation keeps no K/V (dataflow.memplan.plan.segments.kv_less)."""
        self.step_index = 0
        self._lend_scratch(plan, be, cfg)

    def _lend_scratch(self, plan: Plan, be: Backend, cfg) -> None:
        """The backend's library scratch from the arena (below), and an MoE model's expert GEMM
        path, the one the cost model charged (memplan.search.expert_cost.expert_path)."""
        # Library scratch comes from the arena, not from outside it: cuDNN's attention
        # workspace (the planner's region, or the budgeted bytes no region uses, whichever is
        # larger) and the bf16 dK/dV of a context. A plan that chose the fast attention
        # backward lends its region only, so packed chunks take the algorithm it planned.
        spare = self.dev.slab.nbytes - self.dev.used_bytes
        if plan.attention_bwd is AttentionBwd.FAST:
            spare = 0
        region = self.dev.nbytes("attn_workspace") if self.dev.has("attn_workspace") else 0
        scratch = {n: self.ctx[n] for n in ("dk16", "dv16", "dq32") if n in self.ctx}
        scratch.update(self.dev.tensors("library_scratch", buffers.library_scratch_specs(cfg)))
        if "fp8_a" in self.ws:  # an FP8 plan's operand scratch (memplan.plan.buffers)
            scratch.update({n: self.ws[n] for n in ("fp8_a", "fp8_b", "fp8_scales", "fp8_amax",
                                                     "fp8_guess")})
        if cfg.moe is not None:  # the CUDA MoE ops' scratch and their offsets' pinned host copy
            be.set_moe_experts(expert_path(cfg, plan.profile, plan.chunking.chunk_tokens))
            scratch.update({n: self.ws[n] for n in buffers.MOE_OP_SCRATCH})
            scratch["moe_offsets_host"] = self.host.view(
                buffers.MOE_HOST_REGION, (cfg.moe.n_experts + 1,), "i64")
        if region and region >= spare:
            scratch["attn_workspace"] = self.dev.view("attn_workspace", (region,), "u8")
        elif spare >= 1 << 20:
            scratch["attn_workspace"] = be.view(self.dev.slab, self.dev.used_bytes, (spare,), "u8")
        be.lend_scratch(scratch)

    def _tied_views(self, plan: Plan) -> tuple:
        """(table (V, D) bf16, its gradient (V, D) in the gradient dtype) on the device: the
        head of a tied model reads the one and adds its weight gradient into the other, on the
        compute stream like every other use of them (the lookup, its scatter-add, the AdamW and
        zero fill of the embedding block), so stream order alone orders them."""
        w, g = self.embed.device("weights"), self.embed.device("grads")
        if w is None or (g is None and not plan.frozen.embed) or not plan.holds_embed:
            raise BackendError(f"{plan.model.name} ties its head to the embedding, but this plan "
                               "keeps the embedding off the device (embed placement "
                               f"{plan.embed.weights.value}/{plan.embed.grads.value}); plan it "
                               "again with dataflow.memplan.make_plan, which keeps a tied table "
                               "resident")
        # a frozen table (and head: Plan.frozen freezes both of a tied pair) has no gradient
        return self.emb_lay.view(w, "embed_tokens"), \
            None if g is None else self.emb_lay.view(g, "embed_tokens")

    def blocks(self) -> tuple[Block, ...]:
        """Every block in model order: embed, layers, head."""
        return (self.embed, *self.layers, self.head)

    # -- setup-time transfers -------------------------------------------------------------------
    def upload(self, dst, array: np.ndarray) -> None:
        """Synchronous copy of a host array into any view, through the io staging region.
        For setup and state loading only, never inside a round."""
        src = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        stage = self.host.view("io_staging", (self.host.nbytes("io_staging"),), "u8")
        flat = dst.reshape(-1).view(np.uint8)
        self.be.synchronize()
        if self.be.device_is_host_memory:
            flat[...] = src
            return
        for at in range(0, src.size, stage.size):
            n = min(stage.size, src.size - at)
            stage[:n] = src[at:at + n]
            self.be.copy(flat[at:at + n], stage[:n], Stream.H2D, name="upload")
            self.be.synchronize()

    def download(self, src) -> np.ndarray:
        """Synchronous host copy of any view (setup, state_dict, tests)."""
        return self.be.to_numpy(src)

    # -- one step -------------------------------------------------------------------------------
    def step(self, batch: Batch | np.ndarray, optimizer) -> StepStats:
        """One optimizer step. batch: a dataflow.batch.Batch of seqs_per_step rows (ids,
        targets, positions, document segments), or (seqs_per_step, seqlen + 1) int token ids
        (inputs and next-token targets, one document per row). The loss is the mean over the
        counted targets: every gradient is scaled by 1 / batch.counted."""
        ch, sch = self.plan.chunking, self.schedule
        in_backward = self.backward_update and optimizer.config.max_grad_norm is None
        if in_backward:
            self.flush()  # a clipped step's deferred update first
            if self._backward_schedule is None:
                self._backward_schedule = self._compile_step("backward")
            sch = self._backward_schedule
        elif self.deferred and self.pending_hyper is None:
            sch = self._first_schedule  # no update of an earlier step to run in round 0
        t0 = time.perf_counter()
        if not isinstance(batch, Batch):
            batch = make_batch(batch, vocab_size=self.cfg.vocab_size, rows=ch.seqs_per_step,
                               seqlen=ch.seqlen)
        if batch.rows != ch.seqs_per_step:
            raise BackendError(f"a step takes {ch.seqs_per_step} rows, the batch has "
                               f"{batch.rows}")
        self._begin(batch, sch, ch.rounds_per_step)
        if self.lora is not None:
            self.lora.zero_grads()
        self.grad_scale = 1.0 / max(1, batch.counted)
        self.hyper, self.pending_hyper = self.pending_hyper, None  # the last step's, if deferred
        if in_backward:  # this step's own AdamW runs inside its last round
            self.hyper, self.max_norm = optimizer.begin_step(), None
        self._run(sch.events[:sch.optimizer_start])                # rounds: layers x chunks
        if not in_backward:
            self.hyper = optimizer.begin_step()
            self.max_norm = optimizer.config.max_grad_norm
        self._run(sch.events[sch.optimizer_start:])                # norm (and AdamW unless deferred)
        if self.lora is not None:  # the adapters' AdamW, this step's, behind the clip scale
            self.lora.update(self.hyper, self.tr["scalars"][1:2])
        if self.deferred and not in_backward:
            self.pending_hyper = self.hyper
        self.step_index += 1
        return self._finish(sch, ch.rounds_per_step, ch.tokens_per_step, t0, norm=True)

    @property
    def update_pending(self) -> bool:
        """A deferred step's AdamW has not run yet (the home weights are the step's before)."""
        return self.pending_hyper is not None

    def flush(self) -> float:
        """Run the pending deferred AdamW now and wait for it; returns its seconds (0.0 when
        nothing is pending). Reading, saving or evaluating the model needs this first."""
        if self.pending_hyper is None:
            return 0.0
        t0 = time.perf_counter()
        sch = self._update_schedule
        self.hyper = self.pending_hyper
        self._events = [None] * sch.n_ids
        self._run(sch.events)
        self.be.synchronize()
        self.pending_hyper = None
        return time.perf_counter() - t0

    def drop_pending(self) -> None:
        """Forget a pending deferred update (a failed step, or state about to be replaced)."""
        self.pending_hyper = None

    def evaluate(self, batch: Batch) -> StepStats:
        """Forward only over `batch` (any whole number of rounds, padded rows counting nothing):
        the loss per round and overall; no gradient, weight or AdamW state changes."""
        ch = self.plan.chunking
        self.flush()  # its list zeroes the clip scale a pending update still reads
        t0 = time.perf_counter()
        rounds = -(-batch.rows // ch.seqs_per_round)
        if rounds * ch.seqs_per_round != batch.rows or rounds > buffers.MAX_ROUNDS_PER_STEP:
            raise BackendError(f"an evaluation takes whole rounds of {ch.seqs_per_round} rows "
                               f"(at most {buffers.MAX_ROUNDS_PER_STEP}); got {batch.rows}")
        sch = self._eval_schedules.get(rounds)
        if sch is None:
            sch = self._eval_schedules[rounds] = self._compile_eval(rounds)
        self._begin(batch, sch, rounds)
        self.grad_scale = 0.0
        self._run(sch.events)
        return self._finish(sch, rounds, rounds * ch.tokens_per_round, t0)

    def _begin(self, batch: Batch, sch: Schedule, rounds: int) -> None:
        self._batch = batch
        m = self.cfg.moe
        if m is not None:
            # One round is one forward call of transformers (a micro-batch): its own auxiliary
            # losses, averaged over the step's rounds as its LM mean weighs them (equal rows);
            # data-parallel replicas' rounds are all of theirs (aux_round_factor).
            rounds *= self.aux_round_factor
            self._moe_round = None
            self._routing = RoundRouting(
                counts=self.tr["moe_counts"], sums=self.tr["moe_sums"],
                aux_coef=m.router_aux_loss_coef / rounds, z_coef=m.router_z_loss_coef / rounds,
                n_rows=self.plan.chunking.tokens_per_round * self.aux_layers)
        self._round_chunks = [round_chunks(self.plan.chunking, batch, r)
                              for r in range(sch.rounds)]
        self._events = [None] * sch.n_ids
        self._n_done, self._at, self._n_events = 0, None, len(sch.events)

    def _run(self, events) -> None:
        dispatch, log, base = self._dispatch, self.dispatched, self._n_done
        for i, ev in enumerate(events):
            dispatch[type(ev)](ev)
            if log is not None:
                log.append(ev)
            if not i & 63:  # for progress(), read by another thread; every event would cost
                self._n_done, self._at = base + i + 1, ev
        self._n_done = base + len(events)

    def progress(self) -> StepProgress | None:
        """The step or evaluation in flight (None between them): see StepProgress."""
        total, at = self._n_events, self._at
        if not total:
            return None
        return StepProgress(min(self._n_done, total), total, getattr(at, "name", "") or "")

    def _finish(self, sch: Schedule, rounds: int, tokens: int, t0: float,
                norm: bool = False) -> StepStats:
        # Reading the losses (and the gradient norm) is the one host sync of the step: it orders
        # the next step after this one.
        scalars = self.download(self.tr["scalars"][:8 + 2 * rounds])
        self._n_events = 0  # nothing in flight
        loss_pairs = scalars[8:].reshape(-1, 2)
        self._batch = None
        stats = tuple(RoundStats(r, float(s), int(n)) for r, (s, n) in enumerate(loss_pairs))
        total = float(loss_pairs[:, 0].sum()) / max(1.0, float(loss_pairs[:, 1].sum()))
        h2d, d2h = sch.bytes_moved()
        aux = z = None
        if self.cfg.moe is not None:  # every round's (aux, z), in the same sync as the losses
            aux, z = (float(v) for v in self.download(
                self.tr["moe_losses"][:rounds]).astype(np.float64).mean(axis=0))
        return StepStats(total, tokens, stats, time.perf_counter() - t0, h2d, d2h,
                         float(np.sqrt(scalars[0])) if norm else None, aux, z)

    # -- views ----------------------------------------------------------------------------------
    def _view(self, ref: Ref, shape=None, dtype: str = "u8", at: int = 0):
        """A typed view of `shape` at byte `at` inside `ref` (the whole ref as bytes when no
        shape is given); views are built once and reused."""
        key = (ref, shape, dtype, at)
        v = self._views.get(key)
        if v is None:
            shape = (ref.nbytes // DTYPE_BYTES[dtype],) if shape is None else shape
            v = self._views[key] = self._arena[ref.region].view(ref.region, shape, dtype,
                                                                ref.offset + at)
        return v

    def _bind_rows(self) -> tuple[dict, bool]:
        """(the transitions' views by name, whether the odd rounds have rows of their own): an
        overlapped ring rank's table has the regions of
        dataflow.memplan.plan.memory.overlap_regions, whose rows (residuals, tokens) its odd
        rounds use, viewed here under their names with ODD_ROWS."""
        n = self.plan.chunking.tokens_per_round
        tr = self.dev.tensors("transitions", buffers.transition_specs(self.cfg, n))
        if not self.dev.has(OVERLAP_ROWS_REGION):
            return tr, False
        odd = self.dev.tensors(OVERLAP_ROWS_REGION, overlap_row_specs(self.cfg, n))
        return {**tr, **{name + ODD_ROWS: v for name, v in odd.items()}}, True

    def _row(self, name: str, rnd: int):
        """Round `rnd`'s rows of `name` (ids, positions, targets): an overlapped ring rank's odd
        rounds read their own set (round_row_name, the compiler's rule)."""
        return self.tr[round_row_name(name, rnd, self._odd_rows)]

    def _block_views(self, ref: Ref, layout, dtype: str = "bf16") -> dict:
        """The block's tensors by name; an MoE layer's also its experts stacked
        (dataflow.moe_ffn.stacked_experts), which the expert ops read and accumulate into."""
        key = (ref, "layout", dtype)
        v = self._views.get(key)
        if v is None:
            if isinstance(layout, Fp8LayerLayout):  # codes and scales by byte offset
                v = self._views[key] = fp8_block_views(self._view, ref, layout)
                return v
            flat = self._view(ref, (layout.numel,), dtype)
            v = self._views[key] = layout.views(flat)
            if layout is self.lay and self.cfg.moe is not None:
                v.update(stacked_experts(layout, flat, self.cfg.moe.n_experts))
        return v

    def _save_views(self, ref: Ref, layer: int, chunk: int) -> dict:
        """Saved-activation tensors of (layer, chunk) at its level, inside `ref`."""
        level = self.plan.activations[layer][chunk].level
        kv = (layer, chunk) not in self._kv_less  # else home.ctx_kv has them, or a rebuild
        key = (ref, "save", level, kv)
        v = self._views.get(key)
        if v is None:
            specs = buffers.saved_activation_specs(self.cfg, self.T, level, kv, self.plan.lora)
            offs = buffers.offsets(specs)
            v = self._views[key] = {s.name: self._view(ref, s.shape, s.dtype, offs[s.name])
                                    for s in specs}
        return v

    # -- dispatch -------------------------------------------------------------------------------
    def _copy(self, ev) -> None:
        self.be.copy(self._view(ev.dst), self._view(ev.src), STREAM[ev.stream], name=ev.name)

    def _fill(self, ev: Fill) -> None:
        view = self._view(ev.dst, dtype=ev.dtype)
        if ev.stream == "host":
            # In parallel: the 8b embedding gradient's 1 GiB took 0.29 s with view.fill(0).
            self.be.host_call(Stream.HOST, lambda: zero_fill(view), writes=(view,), name=ev.name)
        else:
            self.be.launch(STREAM[ev.stream], "fill_", view, 0.0, name=ev.name)

    def _record(self, ev: Record) -> None:
        self._events[ev.id] = self.be.record(STREAM[ev.stream])

    def _wait(self, ev: Wait) -> None:
        self.be.wait(STREAM[ev.stream], self._events[ev.id])

    def _compute(self, ev: Compute) -> None:
        self._compute_ops[ev.op](ev)

    def _host_task(self, ev: HostTask) -> None:
        self._host_ops[ev.op](ev)

    def _update(self, ev: Update) -> None:
        n = ev.count
        p, m, v = (self._view(r, (n,), "bf16") for r in (ev.params, ev.m, ev.v))
        g = self._view(ev.grads, (n,), self.gdt)
        if ev.stream == "host":
            hp = self.hyper
            scale = self.host.view("norm_host", (2,), "f32")[1:2]  # the clip scale, via D2H
            self.be.host_call(Stream.HOST,
                              lambda: host_adamw.adamw_step(p, g, m, v, *hp, float(scale[0])),
                              reads=(g, scale), writes=(p, m, v), name=ev.name)
        else:
            # a deferred update's kernel runs on the OPT stream (dataflow.memplan.step.compile)
            self.be.launch(Stream(ev.stream), "adamw_step", p, g, m, v, *self.hyper,
                           self.tr["scalars"][1:2], name=ev.name)
