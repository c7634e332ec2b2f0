"""Runs a Plan on a Backend: for each round, the forward layer-major over chunks, the head in
token sub-chunks, the backward in reverse; then the optimizer. Slot schedules are compiled once
per plan and replayed every round; nothing inside a round waits on the host. Never decides
placement (the plan does) and never calls CuPy or NumPy kernels directly (the op table does)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from dataflow.arena import Arena
from kernels.host import embedding as host_embedding
from dataflow.backend import Backend, BackendError, Place, Stream
from dataflow.layer_ops import ChunkInfo, LayerCompute
from dataflow.slots import ZERO, SlotRing, Use
from memplan import buffers
from memplan.memory import device_regions, host_regions
from memplan.plan import GradAccum, OptimizerWhere, Plan, Where
from models.layout import embed_layout, head_layout, layer_layout


@dataclasses.dataclass(frozen=True, slots=True)
class RoundStats:
    round: int
    loss_sum: float
    tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    loss: float
    """Mean next-token cross-entropy over the step's tokens."""
    tokens: int
    rounds: tuple[RoundStats, ...]
    step_time_s: float
    h2d_bytes: int
    d2h_bytes: int


class Executor:
    def __init__(self, plan: Plan, be: Backend):
        self.plan, self.be, self.cfg = plan, be, plan.model
        cfg, ch = plan.model, plan.chunking
        if ch.rounds_per_step > buffers.MAX_ROUNDS_PER_STEP:
            raise BackendError(f"rounds_per_step {ch.rounds_per_step} exceeds "
                               f"{buffers.MAX_ROUNDS_PER_STEP}; use longer chunks or fewer rounds")
        self.dev = Arena(be, Place.DEVICE, plan.budget.device_bytes, device_regions(plan))
        self.host = Arena(be, Place.HOST, plan.budget.host_bytes, host_regions(plan))
        self.gdt = "f32" if plan.grad_accum is GradAccum.FP32 else "bf16"
        self.lay, self.emb_lay, self.head_lay = layer_layout(cfg), embed_layout(cfg), head_layout(cfg)
        self.T, self.C = ch.chunk_tokens, ch.chunks_per_round
        self.chunks = [self._chunk_info(c) for c in range(self.C)]
        self.ws = self.dev.tensors("workspace", buffers.chunk_workspace_specs(cfg, self.T))
        self.ctx = self.dev.tensors("context", buffers.context_specs(
            cfg, ch.seqlen, self.T, ch.chunks_per_seq))
        self.tr = self.dev.tensors("transitions", buffers.transition_specs(cfg, ch.tokens_per_round))
        self.hb = self.dev.tensors("head_buffers", buffers.head_specs(
            cfg, self.T, plan.slots.head_sub_tokens))
        self.compute = LayerCompute(be, cfg, self.ws, self.ctx)
        self._bind_blocks()
        self._build_rings()
        self._load_positions()
        self.step_index = 0
        if hasattr(be, "lend_workspace"):
            # cuDNN's workspace comes from the arena (the planner's attn_workspace region, or
            # the budgeted bytes no region uses, whichever is larger), not from outside it.
            spare = plan.budget.device_bytes - self.dev.used_bytes
            region = self.dev.nbytes("attn_workspace") if self.dev.has("attn_workspace") else 0
            if region >= spare and region:
                be.lend_workspace(self.dev.view("attn_workspace", (region,), "u8"))
            elif spare >= 1 << 20:
                be.lend_workspace(be.view(self.dev.slab, self.dev.used_bytes, (spare,), "u8"))

    # -- layout of blocks ---------------------------------------------------------------------
    def _block(self, arena: Arena, name: str, numel: int, dtype: str = "bf16"):
        return arena.view(name, (numel,), dtype) if arena.has(name) else None

    def _bind_blocks(self) -> None:
        """Device and home views of every block that has a fixed place (slots come later)."""
        n = self.lay.numel
        self.blocks = {}
        names = [(f"layer{i}", n, p) for i, p in enumerate(self.plan.layers)]
        names += [("embed", self.emb_lay.numel, self.plan.embed),
                  ("head", self.head_lay.numel, self.plan.head)]
        for key, numel, place in names:
            b = {}
            for part, dt in (("weights", "bf16"), ("grads", self.gdt), ("m", "bf16"), ("v", "bf16")):
                b["dev_" + part] = self._block(self.dev, f"{key}.{part}", numel, dt)
                b["home_" + part] = self._block(self.host, f"home.{key}.{part}", numel, dt)
            b["place"], b["numel"] = place, numel
            self.blocks[key] = b

    def _slot_views(self, region: str, count: int, numel: int, dtype: str) -> list:
        if count == 0 or not self.dev.has(region):
            return []
        size = numel * (2 if dtype == "bf16" else 4)
        return [self.dev.view(region, (numel,), dtype, i * size) for i in range(count)]

    def _build_rings(self) -> None:
        plan, L = self.plan, self.cfg.n_layers
        n = self.lay.numel
        be = self.be
        self.wring = self.gring = self.aring = None
        streamed = [i for i in range(L) if plan.layers[i].weights is Where.HOME]
        if streamed:
            self.wring = SlotRing(be, self._slot_views("weight_slots", plan.slots.weight_slots,
                                                       n, "bf16"), "w")
            uses = [Use(i, self.blocks[f"layer{i}"]["home_weights"]) for i in streamed]
            uses += [Use(i, self.blocks[f"layer{i}"]["home_weights"]) for i in reversed(streamed)]
            self.w_uses = uses
            self.w_compiled = self.wring.compile(uses)
            self.w_index = {("f", i): j for j, i in enumerate(streamed)}
            self.w_index.update({("b", i): len(streamed) + j
                                 for j, i in enumerate(reversed(streamed))})
        gstreamed = [i for i in reversed(range(L)) if plan.layers[i].grads is Where.HOME]
        if gstreamed:
            self.gring = SlotRing(be, self._slot_views("grad_slots", plan.slots.grad_slots, n,
                                                       self.gdt), "g")
            home = {i: self.blocks[f"layer{i}"]["home_grads"] for i in gstreamed}
            self.g_uses = {first: [Use(i, ZERO if first else home[i], home[i]) for i in gstreamed]
                           for first in (True, False)}
            self.g_compiled = {k: self.gring.compile(u) for k, u in self.g_uses.items()}
            self.g_index = {i: j for j, i in enumerate(gstreamed)}
        home_acts = [(l, c) for l in range(L) for c in range(self.C)
                     if plan.activations[l][c].home is Where.HOME]
        self.act_specs = {}
        for l in range(L):
            for c in range(self.C):
                self.act_specs[(l, c)] = buffers.saved_activation_specs(
                    self.cfg, self.T, plan.activations[l][c].level)
        if home_acts:
            size = max(buffers.packed_bytes(self.act_specs[k]) for k in home_acts)
            slots = [i * size for i in range(plan.slots.act_slots)]
            self.aring = SlotRing(be, slots, "act")
            self.act_home = {k: self.host.view(f"home.act.{k[0]}.{k[1]}",
                                               (buffers.packed_bytes(self.act_specs[k]),), "u8")
                             for k in home_acts}
            fwd = [Use(k, None, self.act_home[k]) for k in home_acts]
            bwd = [Use(k, self.act_home[k], None) for k in
                   sorted(home_acts, key=lambda lc: (-lc[0], -lc[1]))]
            self.a_uses = fwd + bwd
            # Slot byte views are typed per use (levels differ), so the ring holds raw slots.
            self.aring.slots = [self.dev.view("act_slots", (size,), "u8", off) for off in slots]
            self.a_compiled = self.aring.compile(self.a_uses)
            self.a_index = {("f",) + k: j for j, k in enumerate(home_acts)}
            self.a_index.update({("b",) + u.key: len(home_acts) + j
                                 for j, u in enumerate(bwd)})
        hb = self.blocks["head"]
        self.head_w_ring = None
        if hb["place"].weights is Where.HOME:
            self.head_w_ring = SlotRing(be, [hb["dev_weights"]], "headw")
            self.head_w_uses = [Use("head", hb["home_weights"])]
            self.head_w_compiled = self.head_w_ring.compile(self.head_w_uses)
        self.head_g_ring = None
        if hb["place"].grads is Where.HOME:
            self.head_g_ring = SlotRing(be, [hb["dev_grads"]], "headg")
            self.head_g_uses = {f: [Use("head", ZERO if f else hb["home_grads"],
                                        hb["home_grads"])] for f in (True, False)}
            self.head_g_compiled = {f: self.head_g_ring.compile(u)
                                    for f, u in self.head_g_uses.items()}

    def _chunk_info(self, c: int) -> ChunkInfo:
        ch = self.plan.chunking
        rows = slice(c * self.T, (c + 1) * self.T)
        if ch.chunks_per_seq > 1:
            part = c % ch.chunks_per_seq
            return ChunkInfo(c, rows, ((0, self.T),), True, part * self.T, part == 0,
                             part == ch.chunks_per_seq - 1)
        segs = tuple((s * ch.seqlen, (s + 1) * ch.seqlen) for s in range(ch.seqs_per_chunk))
        return ChunkInfo(c, rows, segs, False, 0, True, True)

    def _load_positions(self) -> None:
        ch = self.plan.chunking
        pos = np.concatenate([np.arange(ch.seqlen, dtype=np.int32)] * ch.seqs_per_round)
        self.upload(self.tr["positions"], pos)

    def upload(self, dst, array: np.ndarray) -> None:
        """Synchronous copy of a host array into any view, through the io staging region.
        For setup and state loading only, never inside a round."""
        src = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        stage = self.host.view("io_staging", (self.host.nbytes("io_staging"),), "u8")
        flat = dst.reshape(-1).view(np.uint8) if isinstance(dst, np.ndarray) else None
        if flat is not None and self.be.name == "numpy":
            self.be.synchronize()
            flat[...] = src
            return
        for at in range(0, src.size, stage.size):
            n = min(stage.size, src.size - at)
            self.be.synchronize()
            stage[:n] = src[at:at + n]
            self.be.copy(self.be.byte_slice(dst, at, n), stage[:n], Stream.H2D, name="upload")
            self.be.synchronize()

    def download(self, src) -> np.ndarray:
        """Synchronous host copy of any view (setup, state_dict, tests)."""
        return self.be.to_numpy(src)

    # -- views used by the loop -----------------------------------------------------------------
    def _act_views(self, key, slot_bytes=None) -> dict:
        """Saved-activation tensors of (layer, chunk): its device region or an activation slot."""
        specs = self.act_specs[key]
        if slot_bytes is not None:
            offs = buffers.offsets(specs)
            return {s.name: self.be.typed_view(slot_bytes, offs[s.name], s.shape, s.dtype)
                    for s in specs}
        return self.dev.tensors(f"act.{key[0]}.{key[1]}", specs)

    def _weights(self, phase: str, layer: int) -> dict:
        b = self.blocks[f"layer{layer}"]
        if b["dev_weights"] is not None:
            return self.lay.views(b["dev_weights"])
        return self.lay.views(self.wring.acquire(self.w_index[(phase, layer)]))

    def _release_weights(self, phase: str, layer: int) -> None:
        if self.blocks[f"layer{layer}"]["dev_weights"] is None:
            self.wring.release(self.w_index[(phase, layer)])

    def _grads(self, layer: int) -> dict:
        b = self.blocks[f"layer{layer}"]
        if b["dev_grads"] is not None:
            return self.lay.views(b["dev_grads"])
        return self.lay.views(self.gring.acquire(self.g_index[layer]))

    def _release_grads(self, layer: int) -> None:
        if self.blocks[f"layer{layer}"]["dev_grads"] is None:
            self.gring.release(self.g_index[layer])

    def _act(self, phase: str, layer: int, chunk: int) -> dict:
        if self.plan.activations[layer][chunk].home is Where.DEVICE:
            return self._act_views((layer, chunk))
        raw = self.aring.acquire(self.a_index[(phase, layer, chunk)])
        return self._act_views((layer, chunk), raw)

    def _release_act(self, phase: str, layer: int, chunk: int) -> None:
        if self.plan.activations[layer][chunk].home is Where.HOME:
            self.aring.release(self.a_index[(phase, layer, chunk)])

    # -- one step -------------------------------------------------------------------------------
    def step(self, batch: np.ndarray, optimizer) -> StepStats:
        """batch (seqs_per_step, seqlen + 1) int token ids: inputs and next-token targets."""
        ch, be = self.plan.chunking, self.be
        t0 = time.perf_counter()
        h2d0, d2h0 = self.bytes_moved()
        scalars = self.tr["scalars"]
        be.launch(Stream.COMPUTE, "fill_", scalars, 0.0, name="zero.scalars")
        grad_scale = 1.0 / ch.tokens_per_step
        per_round = ch.seqs_per_round
        for rnd in range(ch.rounds_per_step):
            self._round(rnd, batch[rnd * per_round:(rnd + 1) * per_round], grad_scale)
        optimizer.step(self)
        loss_pairs = self.download(scalars[8:8 + 2 * ch.rounds_per_step]).reshape(-1, 2)
        h2d1, d2h1 = self.bytes_moved()
        self.step_index += 1
        rounds = tuple(RoundStats(r, float(s), int(n)) for r, (s, n) in enumerate(loss_pairs))
        total = float(loss_pairs[:, 0].sum()) / max(1.0, float(loss_pairs[:, 1].sum()))
        return StepStats(total, ch.tokens_per_step, rounds, time.perf_counter() - t0,
                         h2d1 - h2d0, d2h1 - d2h0)

    def bytes_moved(self) -> tuple[int, int]:
        rings = [r for r in (self.wring, self.gring, self.aring, self.head_w_ring,
                             self.head_g_ring) if r is not None]
        return (sum(r.bytes_h2d for r in rings) + self.extra_h2d,
                sum(r.bytes_d2h for r in rings) + self.extra_d2h)

    extra_h2d = 0
    extra_d2h = 0

    def _copy(self, dst, src, stream: Stream, name: str) -> None:
        self.be.copy(dst, src, stream, name=name)
        if stream is Stream.H2D:
            self.extra_h2d += dst.nbytes
        else:
            self.extra_d2h += dst.nbytes

    def _round(self, rnd: int, seqs: np.ndarray, grad_scale: float) -> None:
        cfg, be, L = self.cfg, self.be, self.cfg.n_layers
        if self.wring is not None:
            self.wring.begin(self.w_uses, self.w_compiled)
        if self.gring is not None:
            self.gring.begin(self.g_uses[rnd == 0], self.g_compiled[rnd == 0])
        if self.aring is not None:
            self.aring.begin(self.a_uses, self.a_compiled)
        if self.head_w_ring is not None:
            self.head_w_ring.begin(self.head_w_uses, self.head_w_compiled)
        if self.head_g_ring is not None:
            self.head_g_ring.begin(self.head_g_uses[rnd == 0], self.head_g_compiled[rnd == 0])
        self._load_tokens(seqs)
        resid_in, resid_out = self.tr["resid_a"], self.tr["resid_b"]
        self._embed_fwd(resid_in)
        for layer in range(L):                                          # forward, layer-major
            w = self._weights("f", layer)
            for chunk in self.chunks:
                save = self._act("f", layer, chunk.index)
                self.compute.forward(f"f.L{layer}.c{chunk.index}", w, resid_in[chunk.rows],
                                     resid_out[chunk.rows], self.tr["positions"][chunk.rows],
                                     chunk, save, self.plan.activations[layer][chunk.index].level)
                self._release_act("f", layer, chunk.index)
            self._release_weights("f", layer)
            if layer == L - 2 and self.head_w_ring is not None:
                self.head_w_ring.prefetch(0)                        # head weights arrive early
            resid_in, resid_out = resid_out, resid_in
        self._head(rnd, resid_in, resid_out, grad_scale)
        dy, dx = resid_out, resid_in
        for layer in reversed(range(L)):                                # backward, reverse order
            w = self._weights("b", layer)
            g = self._grads(layer)
            for chunk in reversed(self.chunks):
                if chunk.split and chunk.last_of_seq:
                    self._fill_context(layer, chunk)
                save = self._act("b", layer, chunk.index)
                self.compute.backward(f"b.L{layer}.c{chunk.index}", w, g, save,
                                      self.plan.activations[layer][chunk.index].level,
                                      dy[chunk.rows], dx[chunk.rows],
                                      self.tr["positions"][chunk.rows], chunk)
                self._release_act("b", layer, chunk.index)
            self._release_grads(layer)
            self._release_weights("b", layer)
            dy, dx = dx, dy
        self._embed_bwd(dy)

    def _load_tokens(self, seqs: np.ndarray) -> None:
        """Token ids and targets of the round: host staging (HOST stream), then one H2D each."""
        be, n = self.be, self.plan.chunking.tokens_per_round
        ids = self.host.view("tokens", (2, n), "i32")
        if getattr(self, "_tokens_free", None) is not None:
            be.wait(Stream.HOST, self._tokens_free)
        ins = np.ascontiguousarray(seqs[:, :-1], dtype=np.int32).reshape(-1)
        tgt = np.ascontiguousarray(seqs[:, 1:], dtype=np.int32).reshape(-1)

        def stage():
            ids[0] = ins
            ids[1] = tgt

        be.host_call(Stream.HOST, stage, writes=(ids,), name="tokens.stage")
        be.wait(Stream.H2D, be.record(Stream.HOST))
        # The compute stream may still read last round's ids/targets (head, embedding bwd).
        be.wait(Stream.H2D, be.record(Stream.COMPUTE))
        self._copy(self.tr["ids"], ids[0], Stream.H2D, "tokens.ids")
        self._copy(self.tr["targets"], ids[1], Stream.H2D, "tokens.targets")
        ev = be.record(Stream.H2D)
        self._tokens_free = ev
        be.wait(Stream.COMPUTE, ev)

    def _embed_fwd(self, out) -> None:
        b, be = self.blocks["embed"], self.be
        if b["dev_weights"] is not None:
            table = self.emb_lay.view(b["dev_weights"], "embed_tokens")
            be.launch(Stream.COMPUTE, "embedding_fwd", self.tr["ids"], table, out,
                      name="embed.fwd")
            return
        rows = self.host.view("embed_rows", (2,) + out.shape, "bf16")
        table = self.emb_lay.view(b["home_weights"], "embed_tokens")
        ids_host = self.host.view("tokens", (2, out.shape[0]), "i32")[0]
        be.wait(Stream.HOST, be.record(Stream.H2D))  # staging free: the last upload is done
        if getattr(self, "_embed_host_ready", None) is not None:
            be.wait(Stream.HOST, self._embed_host_ready)
        be.host_call(Stream.HOST, lambda: np.take(table, ids_host, axis=0, out=rows[0]),
                     reads=(table, ids_host), writes=(rows[0],), name="embed.gather")
        be.wait(Stream.H2D, be.record(Stream.HOST))
        self._copy(out, rows[0], Stream.H2D, "embed.rows")
        be.wait(Stream.COMPUTE, be.record(Stream.H2D))

    def _embed_bwd(self, dx) -> None:
        b, be = self.blocks["embed"], self.be
        if b["dev_grads"] is not None:
            table_g = self.emb_lay.view(b["dev_grads"], "embed_tokens")
            be.launch(Stream.COMPUTE, "embedding_bwd", self.tr["ids"], dx, table_g,
                      name="embed.bwd")
            return
        rows = self.host.view("embed_rows", (2,) + dx.shape, "bf16")
        ids_host = self.host.view("tokens", (2, dx.shape[0]), "i32")[0]
        grads = self.emb_lay.view(b["home_grads"], "embed_tokens")
        be.wait(Stream.D2H, be.record(Stream.COMPUTE))
        self._copy(rows[1], dx, Stream.D2H, "embed.dx")
        be.wait(Stream.HOST, be.record(Stream.D2H))
        be.host_call(Stream.HOST, lambda: host_embedding.embedding_bwd(ids_host, rows[1], grads),
                     reads=(ids_host, rows[1]), writes=(grads,), name="embed.scatter")
        ev = be.record(Stream.HOST)
        self._embed_host_ready = ev
        self.embed_grads_ready = ev

    def _head(self, rnd: int, final, dfinal, grad_scale: float) -> None:
        be, hb, cfg = self.be, self.hb, self.cfg
        b = self.blocks["head"]
        wblock = self.head_w_ring.acquire(0) if self.head_w_ring else b["dev_weights"]
        gblock = self.head_g_ring.acquire(0) if self.head_g_ring else b["dev_grads"]
        w, g = self.head_lay.views(wblock), self.head_lay.views(gblock)
        loss_acc = self.tr["scalars"][8 + 2 * rnd:10 + 2 * rnd]
        for chunk in self.chunks:
            x, tag = final[chunk.rows], f"head.c{chunk.index}"
            be.launch(Stream.COMPUTE, "rms_norm_fwd", x, w["norm"], cfg.norm_eps, hb["xn"],
                      hb["rstd"], name=f"{tag}.norm")
            be.launch(Stream.COMPUTE, "head_loss_fwd_bwd", hb["xn"], w["lm_head"],
                      self.tr["targets"][chunk.rows], hb["logits"], grad_scale, hb["dxn"],
                      g["lm_head"], loss_acc, name=f"{tag}.loss")
            be.launch(Stream.COMPUTE, "rms_norm_bwd", x, w["norm"], hb["rstd"], hb["dxn"],
                      dfinal[chunk.rows], g["norm"], name=f"{tag}.norm_bwd")
        if self.head_g_ring:
            self.head_g_ring.release(0)
        if self.head_w_ring:
            self.head_w_ring.release(0)

    def _fill_context(self, layer: int, last: ChunkInfo) -> None:
        """Before the backward of a split sequence at `layer`, gather its K/V from every chunk's
        saved activation (device copies on compute; home copies straight over H2D)."""
        be, ch = self.be, self.plan.chunking
        first = last.index - ch.chunks_per_seq + 1
        free = be.record(Stream.COMPUTE)
        waited = False
        for c in range(first, last.index + 1):
            rows = slice(self.chunks[c].context, self.chunks[c].context + self.T)
            key = (layer, c)
            if self.plan.activations[layer][c].home is Where.DEVICE:
                save = self._act_views(key)
                be.launch(Stream.COMPUTE, "cast", save["k"], self.ctx["k_ctx"][rows],
                          name=f"ctx.k.L{layer}.c{c}")
                be.launch(Stream.COMPUTE, "cast", save["v"], self.ctx["v_ctx"][rows],
                          name=f"ctx.v.L{layer}.c{c}")
                continue
            if not waited:
                be.wait(Stream.H2D, free)
                waited = True
            if key in self.aring.host_ready:
                be.wait(Stream.H2D, self.aring.host_ready[key])
            home = self._act_views(key, self.act_home[key])
            self._copy(self.ctx["k_ctx"][rows], home["k"], Stream.H2D, f"ctx.k.L{layer}.c{c}")
            self._copy(self.ctx["v_ctx"][rows], home["v"], Stream.H2D, f"ctx.v.L{layer}.c{c}")
        if waited:
            be.wait(Stream.COMPUTE, be.record(Stream.H2D))
