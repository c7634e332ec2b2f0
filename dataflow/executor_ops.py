"""The executor's handlers of the schedule's model work: one small method per ComputeOp (layer
forward, recompute and backward, head, embedding, context casts, K/V rebuilds, the gradient norm
and clip scale) and per HostOp (token staging, a HOME embedding's gather and scatter, its
gradient norm). Each runs exactly the kernels its event names, on the views the schedule's refs
bind; none of them decides placement, orders streams or calls CuPy / NumPy kernels directly."""

from __future__ import annotations

import numpy as np

from dataflow.backend import Stream
from dataflow.kernels.host import embedding as host_embedding
from dataflow.kernels.host import norms as host_norms
from dataflow.memplan.step.events import Compute, ComputeOp, HostTask


class OpHandlers:
    """Mixed into dataflow.executor.Executor, whose __init__ binds what these read (the plan, the
    backend, the transition / workspace / context tensors, the layer compute, the blocks, the
    views) and maps each op to its handler (Executor._compute_ops, Executor._host_ops)."""

    # -- compute ops: the compute stream ----------------------------------------------------------
    def _layer_fwd(self, ev: Compute) -> None:
        """One layer on one chunk, keeping what its level says in `save` (nothing when None)."""
        tr = self.tr
        chunk = self._round_chunks[ev.round][ev.chunk]
        save = None if ev.save is None else self._save_views(ev.save, ev.layer, ev.chunk)
        if self._routing is not None and ev.round != self._moe_round:
            self._clear_routing(ev.round)
        self.compute.adapt(self._adapters(ev.layer))
        self.compute.forward(ev.name, self._block_views(ev.weights, self.lay),
                             tr[ev.x][chunk.rows], tr[ev.y][chunk.rows],
                             self._row("positions", ev.round)[chunk.rows], chunk, save,
                             self.plan.activations[ev.layer][ev.chunk].level,
                             routing=self._routing)

    def _layer_bwd(self, ev: Compute) -> None:
        """One layer's backward on one chunk, from its saved activation; a frozen layer's (no
        `grads`: Plan.frozen) forms the input gradient only."""
        tr = self.tr
        chunk = self._round_chunks[ev.round][ev.chunk]
        # the totals are this round's: every forward of a round runs before its backwards
        assert self._routing is None or self._moe_round == ev.round, (ev.name, self._moe_round)
        grads = None if ev.grads is None else self._block_views(ev.grads, self.lay, self.gdt)
        self.compute.adapt(self._adapters(ev.layer))
        self.compute.backward(ev.name, self._block_views(ev.weights, self.lay), grads,
                              self._save_views(ev.save, ev.layer, ev.chunk),
                              self.plan.activations[ev.layer][ev.chunk].level,
                              tr[ev.x][chunk.rows], tr[ev.y][chunk.rows],
                              self._row("positions", ev.round)[chunk.rows], chunk,
                              routing=self._routing)

    def _adapters(self, layer: int):
        """Layer `layer`'s LoRA adapters (Plan.lora), or None."""
        return None if self.lora is None else self.lora.layer(layer)

    def _clear_routing(self, rnd: int) -> None:
        """Zero the routing totals before round `rnd`'s first forward, on the compute stream
        behind the last round's backwards that read them."""
        r = self._routing
        self.be.launch(Stream.COMPUTE, "fill_", r.counts, 0.0, name=f"moe.clear.r{rnd}")
        self.be.launch(Stream.COMPUTE, "fill_", r.sums, 0.0, name=f"moe.clear_sums.r{rnd}")
        self._moe_round = rnd

    def _refwd(self, ev: Compute) -> None:
        """A segment's recompute of one layer on one chunk: the forward's own kernels, from the
        boundary's saved input (`src`) or from rows of x first kept into `save`, so its output
        may overwrite those rows and what it keeps is bit-identical to a forward's. A boundary
        that kept its attention output (INP_ATTN, FULL) skips the attention: dataflow.memplan.search.cost
        charges that re-run as refwd_kept_s."""
        chunk = self._round_chunks[ev.round][ev.chunk]
        rows, tr = chunk.rows, self.tr
        save = attn_out = None
        if ev.src is not None:
            kept = self._save_views(ev.src, ev.layer, ev.chunk)
            x, attn_out = kept["x"], kept.get("o")  # a boundary that kept its attention output
        else:
            save = self._save_views(ev.save, ev.layer, ev.chunk)
            self.be.launch(Stream.COMPUTE, "cast", tr[ev.x][rows], save["x"],
                           name=f"{ev.name}.keep_x")
            x = save["x"]
        self.compute.adapt(self._adapters(ev.layer))
        self.compute.forward(ev.name, self._block_views(ev.weights, self.lay), x, tr[ev.y][rows],
                             self._row("positions", ev.round)[rows], chunk, save,
                             self.plan.activations[ev.layer][ev.chunk].level, input_saved=True,
                             attn_out=attn_out)

    def _head(self, ev: Compute) -> None:
        """Final norm, lm_head and loss of every chunk of the round; for 'head' also their
        backward. 'head_loss' (evaluation) runs at grad_scale 0, so the lm_head gradient the
        loss kernel forms adds exact zeros into the head's gradient region. A tied head reads
        the embedding's table and adds its weight gradient into the embedding's gradient (in
        each round before the lookup's scatter-add of that round: one order, every run). A
        frozen head (no `grads`: Plan.frozen) forms the input gradient only."""
        be, hb, cfg, tr = self.be, self.hb, self.cfg, self.tr
        backward = ev.op is ComputeOp.HEAD
        w = self._block_views(ev.weights, self.head_lay)
        g = {"lm_head": None, "norm": None} if ev.grads is None else \
            self._block_views(ev.grads, self.head_lay, self.gdt)
        lm_w, lm_g = self._tied if self._tied is not None else (w["lm_head"], g["lm_head"])
        loss_acc = tr["scalars"][8 + 2 * ev.round:10 + 2 * ev.round]
        final, dfinal = tr[ev.x], tr[ev.y]
        if self._routing is not None:  # the round's forward is complete: its (aux, z)
            r = self._routing
            be.launch(Stream.COMPUTE, "moe_round_losses", r.counts, r.sums, r.n_rows,
                      tr["moe_losses"][ev.round], name=f"moe.losses.r{ev.round}")
        for chunk in self.chunks:
            x, tag = final[chunk.rows], f"head.c{chunk.index}"
            be.launch(Stream.COMPUTE, "rms_norm_fwd", x, w["norm"], cfg.norm_eps, hb["xn"],
                      hb["rstd"], name=f"{tag}.norm")
            be.launch(Stream.COMPUTE, "head_loss_fwd_bwd", hb["xn"], lm_w,
                      self._row("targets", ev.round)[chunk.rows], hb["logits"],
                      self.grad_scale, hb["dxn"], lm_g, loss_acc, name=f"{tag}.loss")
            if backward:
                be.launch(Stream.COMPUTE, "rms_norm_bwd", x, w["norm"], hb["rstd"],
                          hb["dxn"], dfinal[chunk.rows], g["norm"], name=f"{tag}.norm_bwd")

    def _moe_totals_add(self, ev: Compute) -> None:
        """A ring rank: add the previous ranks' routing totals into this round's."""
        tr = self.tr
        self.be.launch(Stream.COMPUTE, "moe_totals_add", tr["moe_counts"], tr["moe_sums"],
                       tr["moe_partial_counts"], tr["moe_partial_sums"], name=ev.name)

    def _ctx_cast(self, ev: Compute) -> None:
        """Copy a chunk's saved K/V into the sequence context."""
        save = self._save_views(ev.save, ev.layer, ev.chunk)
        at = self.chunks[ev.chunk].context
        rows = slice(at, at + self.T)
        for part in ("k", "v"):
            self.be.launch(Stream.COMPUTE, "cast", save[part], self.ctx[f"{part}_ctx"][rows],
                           name=f"ctx.{part}.L{ev.layer}.c{ev.chunk}")

    def _kv_rebuild(self, ev: Compute) -> None:
        """Re-form a chunk's K/V in the sequence context from the x at the start of `save`."""
        chunk = self._round_chunks[ev.round][ev.chunk]
        at = chunk.context
        rows = slice(at, at + self.T)
        self.compute.adapt(self._adapters(ev.layer))
        self.compute.rebuild_kv(ev.name, self._block_views(ev.weights, self.lay),
                                self._view(ev.save, (self.T, self.cfg.model_dim), "bf16"),
                                self.ctx["k_ctx"][rows], self.ctx["v_ctx"][rows],
                                self._row("positions", ev.round)[chunk.rows])

    def _embed_fwd(self, ev: Compute) -> None:
        """The round's embedding lookup from the device table."""
        tr = self.tr
        table = self.emb_lay.view(self._view(ev.weights, dtype="bf16"), "embed_tokens")
        self.be.launch(Stream.COMPUTE, "embedding_fwd", self._row("ids", ev.round), table,
                       tr[ev.y], name=ev.name)

    def _embed_bwd(self, ev: Compute) -> None:
        """The lookup's scatter-add into the device table's gradient."""
        tr = self.tr
        table = self.emb_lay.view(self._view(ev.grads, dtype=self.gdt), "embed_tokens")
        pad = self.cfg.pad_token_id
        if pad is not None:  # nn.Embedding(padding_idx): that row's lookup adds nothing
            self.be.launch(Stream.COMPUTE, "zero_rows_where_", self._row("ids", ev.round),
                           tr[ev.x], pad, name=f"{ev.name}.pad")
        self.be.launch(Stream.COMPUTE, "embedding_bwd", self._row("ids", ev.round), tr[ev.x],
                       table, name=ev.name)

    def _grad_sumsq(self, ev: Compute) -> None:
        """Add a device gradient's squared norm into scalar 0."""
        self.be.launch(Stream.COMPUTE, "sumsq", self._view(ev.grads, dtype=self.gdt),
                       self.tr["scalars"][0:1], True, name=ev.name)

    def _clip_scale(self, ev: Compute) -> None:
        """The global norm (the host's part added) and the clip scale AdamW reads."""
        sc = self.tr["scalars"]
        if self.lora is not None:  # the adapters train too: their share of the norm
            self.lora.add_sumsq(sc[0:1])
        self.be.launch(Stream.COMPUTE, "add_", sc[0:1], sc[2:3], name="gnorm.add_host")
        max_norm = float("inf") if self.max_norm is None else self.max_norm
        self.be.launch(Stream.COMPUTE, "clip_scale", sc[0:1], max_norm, sc[1:2], name=ev.name)

    # -- host ops: the host stream ----------------------------------------------------------------
    def _round_ids(self, rnd: int):
        """Round `rnd`'s input ids in the pinned token staging: buffer (round % 2) x rows (ids,
        positions, targets)."""
        n = self.plan.chunking.tokens_per_round
        return self.host.view("tokens", (2, 3, n), "i32")[rnd % 2, 0]

    def _tokens_stage(self, ev: HostTask) -> None:
        """The round's ids, positions and targets into the pinned token buffer `dst`."""
        n, per = self.plan.chunking.tokens_per_round, self.plan.chunking.seqs_per_round
        rows = slice(ev.round * per, (ev.round + 1) * per)
        dst = self._view(ev.dst, (3, n), "i32")
        b = self._batch
        src = (b.ids[rows].reshape(-1), b.positions[rows].reshape(-1),
               b.targets[rows].reshape(-1))

        def stage():
            for row, values in zip(dst, src):
                row[...] = values

        self.be.host_call(Stream.HOST, stage, writes=(dst,), name=ev.name)

    def _embed_gather(self, ev: HostTask) -> None:
        """A HOME table's rows of the round's ids into `dst`."""
        ids = self._round_ids(ev.round)
        rows = self._view(ev.dst, (self.plan.chunking.tokens_per_round, self.cfg.model_dim),
                          "bf16")
        table = self.emb_lay.view(self.embed.home("weights"), "embed_tokens")
        # mode="clip": ids were checked against the vocabulary (dataflow.batch), and the
        # default mode="raise" buffers `out` in a temporary as large as the rows (1 GiB of
        # RSS at 8b's 131,072-token rounds) and ran 50x slower for bf16 rows.
        self.be.host_call(Stream.HOST,
                          lambda: np.take(table, ids, axis=0, out=rows, mode="clip"),
                          reads=(table, ids), writes=(rows,), name=ev.name)

    def _embed_scatter(self, ev: HostTask) -> None:
        """Add the gradient rows at `src` (the round's part of embed_rows) into the HOME
        gradient `dst`."""
        ids = self._round_ids(ev.round)
        rows = self._view(ev.src, (self.plan.chunking.tokens_per_round, self.cfg.model_dim),
                          "bf16")
        grads = self.emb_lay.view(self._view(ev.dst, dtype=self.gdt), "embed_tokens")
        pad = self.cfg.pad_token_id

        def scatter():
            if pad is not None:  # nn.Embedding(padding_idx): that row's lookup adds none
                rows[ids.reshape(-1) == pad] = 0
            host_embedding.embedding_bwd(ids, rows, grads)

        self.be.host_call(Stream.HOST, scatter, reads=(ids, rows),
                          writes=(grads,) if pad is None else (grads, rows), name=ev.name)

    def _host_grad_sumsq(self, ev: HostTask) -> None:
        """A HOME embedding gradient's squared norm into the host norm scalar."""
        grads = self._view(ev.dst, dtype=self.gdt)
        out = self.host.view("norm_host", (2,), "f32")[0:1]
        self.be.host_call(Stream.HOST, lambda: host_norms.sumsq_into(grads, out),
                          reads=(grads,), writes=(out,), name=ev.name)
