"""A ring rank's handlers of the vocabulary-parallel head's compute events (ComputeOp.VOCAB_*,
compiled by dataflow.memplan.step.ring_vocab): the final norm of a chunk on the head's rank, a
shard's statistics, their merge, the loss from the merged statistics, a shard's gradients, the
sum of the partial dx and the norm's backward. Each runs the kernels its event names on the
views the schedule binds; never sends or receives (the schedule's Send / Recv do), never decides
an order."""

from __future__ import annotations

from dataflow.backend import Stream
from dataflow.memplan.plan.ranks import head_rows
from dataflow.memplan.step.events import VOCAB_HEAD_OPS, Compute, ComputeOp


class VocabHeadOps:
    """Mixed into dataflow.ring.executor.RingExecutor, whose Executor binds the head buffers
    (hb), the transitions, the head layout and the grad scale these read."""

    def _vocab_handlers(self) -> dict:
        rp = self.rp
        self._vocab_row0 = head_rows(self.cfg.vocab_size, rp.n_ranks, rp.rank)[0]
        """The first global lm_head row of this rank's shard."""
        handlers = {ComputeOp.VOCAB_NORM: self._vocab_norm,
                    ComputeOp.VOCAB_STATS: self._vocab_stats,
                    ComputeOp.VOCAB_MERGE: self._vocab_merge,
                    ComputeOp.VOCAB_LOSS: self._vocab_loss, ComputeOp.VOCAB_GRAD: self._vocab_grad,
                    ComputeOp.VOCAB_DX_ADD: self._vocab_dx_add,
                    ComputeOp.VOCAB_NORM_BWD: self._vocab_norm_bwd}
        assert set(handlers) == VOCAB_HEAD_OPS
        return handlers

    def _vocab_rows(self, ev: Compute) -> slice:
        return self.chunks[ev.chunk].rows

    def _vocab_round(self, name: str, ev: Compute):
        """The event's chunk's rows of a round-long buffer (vocab_xn, vocab_rstd, vocab_stats,
        vocab_stats_in)."""
        return self.tr[name][self._vocab_rows(ev)]

    def _vocab_norm(self, ev: Compute) -> None:
        """The head's rank: the final norm of one chunk into xn (which the ring then sends)."""
        w = self._block_views(ev.weights, self.head_lay)
        self.be.launch(Stream.COMPUTE, "rms_norm_fwd", self.tr[ev.x][self._vocab_rows(ev)],
                       w["norm"], self.cfg.norm_eps, self._vocab_round("vocab_xn", ev),
                       self._vocab_round("vocab_rstd", ev), name=ev.name)

    def _vocab_stats(self, ev: Compute) -> None:
        hb = self.hb
        w = self._block_views(ev.weights, self.head_lay)
        self.be.launch(Stream.COMPUTE, "vocab_stats", self._vocab_round("vocab_xn", ev),
                       w["lm_head"], self._row("targets", ev.round)[self._vocab_rows(ev)],
                       self._vocab_row0,
                       hb["logits"], self._vocab_round("vocab_stats", ev), name=ev.name)

    def _vocab_merge(self, ev: Compute) -> None:
        self.be.launch(Stream.COMPUTE, "vocab_merge", self._vocab_round("vocab_stats", ev),
                       self._vocab_round("vocab_stats_in", ev), name=ev.name)

    def _vocab_loss(self, ev: Compute) -> None:
        """The head's rank: the chunk's loss sum and valid count into the round's scalars."""
        loss_acc = self.tr["scalars"][8 + 2 * ev.round:10 + 2 * ev.round]
        self.be.launch(Stream.COMPUTE, "vocab_loss", self._vocab_round("vocab_stats", ev),
                       self._row("targets", ev.round)[self._vocab_rows(ev)], loss_acc, name=ev.name)

    def _vocab_grad(self, ev: Compute) -> None:
        hb = self.hb
        w = self._block_views(ev.weights, self.head_lay)
        g = self._block_views(ev.grads, self.head_lay, self.gdt)
        self.be.launch(Stream.COMPUTE, "vocab_grad", self._vocab_round("vocab_xn", ev),
                       w["lm_head"], self._row("targets", ev.round)[self._vocab_rows(ev)],
                       self._vocab_row0,
                       self._vocab_round("vocab_stats", ev), hb["logits"], self.grad_scale,
                       hb["vdx"], g["lm_head"], name=ev.name)

    def _vocab_dx_add(self, ev: Compute) -> None:
        """The partial dx of the ranks after this one (received) added onto this rank's."""
        self.be.launch(Stream.COMPUTE, "add_", self.hb["vdx"], self.hb["vdx_in"], name=ev.name)

    def _vocab_norm_bwd(self, ev: Compute) -> None:
        """The head's rank: the summed dx rounded once to bf16, then the norm's backward into
        the last layer's gradient rows (and the norm's weight gradient)."""
        hb, rows = self.hb, self._vocab_rows(ev)
        w = self._block_views(ev.weights, self.head_lay)
        g = self._block_views(ev.grads, self.head_lay, self.gdt)
        self.be.launch(Stream.COMPUTE, "cast", hb["vdx"], hb["dxn"], name=f"{ev.name}.cast")
        self.be.launch(Stream.COMPUTE, "rms_norm_bwd", self.tr[ev.x][rows], w["norm"],
                       self._vocab_round("vocab_rstd", ev), hb["dxn"], self.tr[ev.y][rows],
                       g["norm"], name=ev.name)
