"""The ends of the model in a round: token staging on the host and its upload, the embedding's
forward and backward (rows gathered and scattered on the host for a HOME table) and the head.
Part of dataflow.memplan.step.compile.StepCompiler; never imports memplan.search, never touches
a device."""

from __future__ import annotations

from dataflow.memplan.step.events import (
    COMPUTE,
    D2H,
    H2D,
    HOST,
    Compute,
    Fetch,
    HostTask,
    Ref,
    WriteBack,
)
from dataflow.memplan.step.state import EMBED, HEAD


class ModelEnds:
    """Tokens, embedding and head events of a round (StepCompiler's part)."""

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
        return self.d.holds_embed and self.block(EMBED, "weights", False) is None

    def load_tokens(self, rnd: int) -> None:
        """Token ids, RoPE positions and targets of the round (staged on the host, usually one
        round ahead): one H2D each, once the compute no longer reads the last round's."""
        em = self.em
        self.stage(rnd)
        em.wait(H2D, self.staged[rnd])
        em.wait(H2D, em.record(COMPUTE))
        for row, name in enumerate(("ids", "positions", "targets")):
            em.add(Fetch(f"tokens.{name}", self.round_rows(rnd, name), self._tokens(rnd, row)))
        ev = em.record(H2D)
        em.wait(COMPUTE, ev)
        em.wait(COMPUTE, self.dx_sent)  # this round overwrites the residual buffers
        self.targets_ready = ev
        self.buf_free[rnd % 2].append(ev)

    def embed_fwd(self, rnd: int, out: str) -> None:
        em = self.em
        dev = self.block(EMBED, "weights", False)
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
        """The lookup's gradient: a scatter-add on the device, or the rows sent home and added
        there; nothing for a frozen table (Plan.frozen), whose rows get no gradient."""
        if self.d.frozen.embed:
            return
        em = self.em
        dev = self.block(EMBED, "grads", False)
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
        home = self.block(EMBED, "grads", True)
        em.add(HostTask("embed.scatter", "embed_scatter", rnd, home, src=rows))
        if rnd == self.last_round:  # the squared norm of the finished sum, on the host
            em.add(HostTask("gnorm.embed", "grad_sumsq", rnd, home))
        ev = em.record(HOST)
        self.embed_grads_ready = ev
        self.buf_free[rnd % 2].append(ev)  # the scatter read this round's ids
        self.rows_free[rnd % self.row_parts].append(ev)  # and the gradient rows in its part

    def head_eval(self, rnd: int, final: str, other: str) -> None:
        """An evaluation round's head: the loss of every chunk, forward only (a hook: a
        vocabulary-parallel ring rank runs its part instead)."""
        em = self.em
        w = self.hw_ring.acquire(0) if self.hw_ring else self.block(HEAD, "weights", False)
        em.wait(COMPUTE, self.targets_ready)
        # The loss kernel also forms lm_head's gradient; at grad_scale 0 it adds exact zeros
        # into the device head.grads region (a slot or the resident sum, idle between steps).
        g = None if self.d.frozen.head else self.ref("head.grads", 0, self.numel["head"] * (
            2 if self.gdt == "bf16" else 4))  # a frozen head has no gradient region
        em.add(Compute("head", "head_loss", rnd, weights=w, grads=g, x=final, y=other))
        if self.hw_ring is not None:
            self.hw_ring.release(0)

    def head(self, rnd: int, final: str, dfinal: str) -> None:
        w = self.hw_ring.acquire(0) if self.hw_ring else self.block(HEAD, "weights", False)
        g = self.hg_ring.acquire(0) if self.hg_ring else self.block(HEAD, "grads", False)
        self.em.wait(COMPUTE, self.targets_ready)
        self.em.add(Compute("head", "head", rnd, weights=w, grads=g, x=final, y=dfinal))
        self.sumsq(rnd, "head", g)
        if self.hg_ring:
            self.hg_ring.release(0)
        if self.hw_ring:
            self.hw_ring.release(0)
