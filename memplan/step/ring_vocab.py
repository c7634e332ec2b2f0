"""The vocabulary-parallel head of a ring as events: every rank holds a shard of the lm_head rows
(dataflow.memplan.plan.ranks.head_rows) and, for each chunk, computes the logits and loss terms
over its shard. The head's rank H (the final norm, the loss sums) norms the chunk and sends the
normed hidden state round the ring (H -> H+1 -> ... -> H-1, neighbours only, as the residuals
travel); each rank forms its per-token statistics (max, sum-exp, target logit) and the ranks
merge them back along the ring (the last rank's first, each rank merging what it received into
its own), H computes the loss from the merged statistics and sends them round again; each rank
forms its shard's weight gradient and an fp32 partial dx, summed back along the ring in the same
fixed order, and H rounds the sum once and runs the norm's backward. Each of the four passes
runs over all the round's chunks (the hidden states and statistics are kept for the round), so
the ring carries one chunk's messages while its ranks compute the next's. The orders never
change, so a run is reproducible; they are not one device's (the fp32 sums over the vocabulary
are split), so the results match one device up to fp32 rounding. A mixin of
dataflow.memplan.step.ring_compile.RingCompiler; pure Python, never touches a device."""

from __future__ import annotations

from dataflow.memplan.plan import buffers
from dataflow.memplan.step.events import COMPUTE, Compute, Ref
from dataflow.memplan.step.state import HEAD

XN, STATS, MERGED, DX = range(4)
"""The four messages of a chunk: normed hidden state (bf16), statistics (fp32, merged toward
H), the merged statistics (from H round the ring), partial dx (fp32, summed toward H)."""
TAG_BASE = 1 << 40
"""Vocabulary-head tags are negative and below every routing-totals tag."""


class VocabHead:
    """RingCompiler's part for RankPlan.vocab_parallel: head() on every rank."""

    def _vocab_setup(self) -> None:
        rp = self.rp
        self.vocab_pos = (rp.rank - rp.head_owner) % rp.n_ranks
        """This rank's place in the head's chain (0: the head's rank)."""
        specs = buffers.head_specs(rp.plan.model, self.T, rp.plan.slots.head_sub_tokens)
        self._hb_specs = {sp.name: sp for sp in specs}
        self._hb_offsets = buffers.offsets(specs)
        self.vsent: dict[tuple[str, int], int] = {}
        """(buffer, chunk) -> send-stream event after which its last send is done."""

    def _vbuf(self, name: str, chunk: int) -> Ref:
        """Chunk `chunk`'s rows of a round-long transition buffer (vocab_*), or a head buffer
        (one chunk's: vdx, vdx_in)."""
        if name.startswith("vocab_"):
            off, nbytes = self._transition(name)
            per = nbytes // self.C
            return self.ref("transitions", off + chunk * per, per)
        return self.ref("head_buffers", self._hb_offsets[name], self._hb_specs[name].nbytes)

    def _vkey(self, name: str, chunk: int) -> tuple[str, int]:
        return (name, chunk if name.startswith("vocab_") else -1)

    def _vtag(self, rnd: int, chunk: int, kind: int) -> int:
        return -(TAG_BASE + (rnd * self.C + chunk) * 4 + kind)

    def _vsend(self, rnd: int, chunk: int, kind: int, buf: str, peer: int) -> None:
        """Send `buf`'s rows of `chunk` once the compute that wrote them is done."""
        from dataflow.memplan.step.ring_compile import SEND, Send  # ring_compile imports us

        em = self.em
        em.wait(SEND, em.record(COMPUTE))
        em.add(Send(f"send.vocab{kind}.{buf}.r{rnd}.c{chunk}", self._vbuf(buf, chunk), peer,
                    self._vtag(rnd, chunk, kind)))
        self.vsent[self._vkey(buf, chunk)] = em.record(SEND)

    def _vrecv(self, rnd: int, chunk: int, kind: int, buf: str, peer: int) -> None:
        """Receive into `buf`'s rows of `chunk` once the computes reading them and their last
        send are done; the computes after wait for it."""
        from dataflow.memplan.step.ring_compile import RECV, Recv  # ring_compile imports us

        em = self.em
        em.wait(RECV, em.record(COMPUTE))
        em.wait(RECV, self.vsent.pop(self._vkey(buf, chunk), None))
        em.add(Recv(f"recv.vocab{kind}.{buf}.r{rnd}.c{chunk}", self._vbuf(buf, chunk), peer,
                    self._vtag(rnd, chunk, kind)))
        em.wait(COMPUTE, em.record(RECV))

    def _vcompute(self, name: str, op: str, rnd: int, chunk: int, writes: tuple[str, ...],
                  **refs) -> None:
        em = self.em
        for buf in writes:  # its last send must be done before the compute overwrites it
            em.wait(COMPUTE, self.vsent.pop(self._vkey(buf, chunk), None))
        em.add(Compute(f"vocab.{name}.c{chunk}", op, rnd, chunk=chunk, **refs))

    def vocab_head(self, rnd: int, final: str, dfinal: str) -> None:
        """The round's head on this rank in four passes over its chunks (see the module's
        docstring), each chunk's messages sent as soon as it is computed, so the ring passes
        one chunk's while its ranks compute the next's."""
        w = self.hw_ring.acquire(0) if self.hw_ring else self.block(HEAD, "weights", False)
        g = self.hg_ring.acquire(0) if self.hg_ring else self.block(HEAD, "grads", False)
        self.em.wait(COMPUTE, self.targets_ready)
        first, last = self.vocab_pos == 0, self.vocab_pos == self.rp.n_ranks - 1
        prev, nxt, chunks = self.prev, self.next, range(self.C)
        wg = dict(weights=w, grads=g)
        for c in chunks:  # the normed hidden state round the ring; each rank's statistics
            if first:
                self._vcompute("norm", "vocab_norm", rnd, c, ("vocab_xn", "vocab_rstd"),
                               weights=w, x=final)
            else:
                self._vrecv(rnd, c, XN, "vocab_xn", prev)
            if not last:
                self._vsend(rnd, c, XN, "vocab_xn", nxt)
            self._vcompute("stats", "vocab_stats", rnd, c, ("vocab_stats",), weights=w)
        for c in chunks:  # merged back toward the head's rank, the last rank's first
            if not last:
                self._vrecv(rnd, c, STATS, "vocab_stats_in", nxt)
                self._vcompute("merge", "vocab_merge", rnd, c, ("vocab_stats",))
            if not first:
                self._vsend(rnd, c, STATS, "vocab_stats", prev)
        for c in chunks:  # the loss there, and the merged statistics round the ring again
            if first:
                self._vcompute("loss", "vocab_loss", rnd, c, ())
            else:
                self._vrecv(rnd, c, MERGED, "vocab_stats", prev)
            if not last:
                self._vsend(rnd, c, MERGED, "vocab_stats", nxt)
        for c in chunks:  # each shard's gradients; the partial dx summed toward the head
            self._vcompute("grad", "vocab_grad", rnd, c, ("vdx",), **wg)
            if not last:
                self._vrecv(rnd, c, DX, "vdx_in", nxt)
                self._vcompute("dx_add", "vocab_dx_add", rnd, c, ("vdx",))
            if first:
                self._vcompute("norm_bwd", "vocab_norm_bwd", rnd, c, (), **wg, x=final,
                               y=dfinal)
            else:
                self._vsend(rnd, c, DX, "vdx", prev)
        self.sumsq(rnd, "head", g)
        if self.hg_ring:
            self.hg_ring.release(0)
        if self.hw_ring:
            self.hw_ring.release(0)

    def vocab_head_eval(self, rnd: int, final: str) -> None:
        """An evaluation round's head on this rank: the first two passes (the normed hidden
        states round the ring, the statistics merged back) and the loss on the head's rank."""
        w = self.hw_ring.acquire(0) if self.hw_ring else self.block(HEAD, "weights", False)
        self.em.wait(COMPUTE, self.targets_ready)
        first, last = self.vocab_pos == 0, self.vocab_pos == self.rp.n_ranks - 1
        for c in range(self.C):
            if first:
                self._vcompute("norm", "vocab_norm", rnd, c, ("vocab_xn", "vocab_rstd"),
                               weights=w, x=final)
            else:
                self._vrecv(rnd, c, XN, "vocab_xn", self.prev)
            if not last:
                self._vsend(rnd, c, XN, "vocab_xn", self.next)
            self._vcompute("stats", "vocab_stats", rnd, c, ("vocab_stats",), weights=w)
        for c in range(self.C):
            if not last:
                self._vrecv(rnd, c, STATS, "vocab_stats_in", self.next)
                self._vcompute("merge", "vocab_merge", rnd, c, ("vocab_stats",))
            if first:
                self._vcompute("loss", "vocab_loss", rnd, c, ())
            else:
                self._vsend(rnd, c, STATS, "vocab_stats", self.prev)
        if self.hw_ring is not None:
            self.hw_ring.release(0)

    def vocab_sends_done(self) -> None:
        """The step ends after its last sends of head buffers."""
        for ev in self.vsent.values():
            self.em.wait(COMPUTE, ev)
        self.vsent.clear()
