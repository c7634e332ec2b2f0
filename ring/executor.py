"""Runs one ring rank's compiled schedule: the single-device Executor with two more dispatch
entries (Send / Recv on the transport) and the send / recv streams' records and waits handed to the
transport, plus the replicas' gradient all-reduce. The step's loss (the head rank's of every
replica) and the global squared gradient norm (each rank's device sum over its own blocks, after
the all-reduce) are shared through the transport's all-gather. Never decides placement or what
is sent: the schedule does."""

from __future__ import annotations

import dataclasses

import numpy as np

from dataflow.executor import Executor, RoundStats, StepStats
from dataflow.memplan.plan.ranks import RankPlan
from dataflow.memplan.step.ring_compile import (COMM_STREAMS, AllReduce, GatherParts, Recv, Send,
                                            compile_ring_eval_schedule, compile_ring_schedule,
                                            compile_ring_update_schedule)
from dataflow.memplan.step.compile import Record, Schedule, Wait
from dataflow.ring.transport import Transport


class RingExecutor(Executor):
    def __init__(self, rp: RankPlan, be, transport: Transport, schedule: Schedule | None = None,
                 *, deferred_update: bool = False):
        """deferred_update: as the single-device Executor's (each step's AdamW of this rank's
        blocks inside the next step's round 0, or in flush()). The schedules are those of the
        transport's replica (with rp.split_fetch each replica fetches its own weight parts)."""
        q = transport.replica if transport is not None else 0
        super().__init__(rp.plan, be, schedule, deferred_update=deferred_update,
                         compile_step=lambda update: compile_ring_schedule(rp, update=update,
                                                                           replica=q),
                         compile_update=lambda: compile_ring_update_schedule(rp),
                         compile_eval=lambda rounds: compile_ring_eval_schedule(rp, rounds, q))
        self.rp, self.transport = rp, transport
        self.aux_round_factor = rp.replicas
        self.aux_layers = rp.n_layers  # the routing totals a ring passes round are the model's
        self._dispatch.update({Send: self._send, Recv: self._recv, AllReduce: self._allreduce,
                               GatherParts: self._gather_parts, Record: self._ring_record,
                               Wait: self._ring_wait})
        ch, cfg = rp.plan.chunking, rp.plan.model
        reduced = [ev.dst.nbytes for ev in self.schedule.events if type(ev) is AllReduce]
        gathered = [ev.dst.nbytes for ev in self.schedule.events if type(ev) is GatherParts]
        # Per neighbour at most one round's chunks travel each way (each chunk's residual is in
        # one place at a time), and a ring of 2 shares one mailbox for both directions.
        # An MoE model's ranks also pass the round's routing totals on: two small messages
        # each way (dataflow.memplan.step.ring_compile).
        totals = 4 if cfg.moe is not None and rp.n_ranks > 1 else 0
        transport.bind(be, ch.chunk_tokens * cfg.model_dim * 2, 2 * ch.chunks_per_round + totals,
                       max(reduced, default=0), max(gathered, default=0))

    # -- dispatch -------------------------------------------------------------------------------
    def _send(self, ev: Send) -> None:
        self.transport.send(self._view(ev.src), ev.peer, ev.tag)

    def _recv(self, ev: Recv) -> None:
        self.transport.recv(self._view(ev.dst), ev.peer, ev.tag)

    def _allreduce(self, ev: AllReduce) -> None:
        self.transport.allreduce(self._view(ev.dst, dtype=ev.dtype))

    def _gather_parts(self, ev: GatherParts) -> None:
        self.transport.gather_parts(self._view(ev.dst))

    def _ring_record(self, ev: Record) -> None:
        if ev.stream in COMM_STREAMS:
            self._events[ev.id] = self.transport.record(ev.stream)
        else:
            self._record(ev)

    def _ring_wait(self, ev: Wait) -> None:
        if ev.stream in COMM_STREAMS:
            self.transport.wait(ev.stream, self._events[ev.id])
        else:
            self._wait(ev)

    # -- what the ranks share -------------------------------------------------------------------
    def _global_index(self) -> list[tuple[int, object]]:
        """(index in the single-device block order embed, layers 0..L-1, head; Block) of every
        block this rank owns."""
        rp = self.rp
        out = [(0, self.embed)] if rp.has_embed else []
        out += [(1 + g, self.layers[j]) for j, g in enumerate(rp.layers)]
        if rp.has_head:
            out.append((rp.n_layers + 1, self.head))
        return out

    def _compute(self, ev) -> None:
        if ev.op == "clip_scale":
            self._global_sumsq()
        super()._compute(ev)

    def _global_sumsq(self) -> None:
        """Before the clip scale: every rank holds the squared norm of its own blocks' gradients
        (device scalar 0, and the host's part of a HOME embedding in scalar 2); gather them and
        put the global sum in scalar 0 on every rank, so all clip alike. One host sync, where
        the ring already synchronises (collective: every rank reaches it at the same point)."""
        sc = self.tr["scalars"]
        local = self.download(sc[0:3]).astype(np.float64)
        rows = self._own_ring(self.transport.allgather(np.array([local[0] + local[2]])))
        total = np.zeros(3, np.float32)
        total[0] = np.float32(sum(float(row[0]) for row in rows))
        self.upload(sc[0:3], total)

    def _own_ring(self, rows: list) -> list:
        """Of an all-gather's rows (every process, replica-major), those of this rank's ring:
        after the all-reduce every replica holds the same gradients, so one ring's norm is
        the global norm."""
        n, q = self.rp.n_ranks, self.transport.replica
        return rows[q * n:(q + 1) * n]

    def step(self, batch, optimizer) -> StepStats:
        """One step of this rank on its replica's slice of the global batch (a Batch whose
        `counted` is the whole global batch's, so every replica scales its gradients alike). The
        loss is the head ranks' round sums of every replica, in replica order: the rounds of the
        single-device step over the global batch."""
        return self._ring_loss(super().step(batch, optimizer))

    def evaluate(self, batch) -> StepStats:
        """A forward-only evaluation of this replica's slice (whole rounds, the same number on
        every process); the loss over every replica's rows, as step's. Collective."""
        return self._ring_loss(super().evaluate(batch))

    def _ring_loss(self, stats: StepStats) -> StepStats:
        """`stats` with the loss and rounds of the head ranks of every replica (their round sums
        gathered through the transport), tokens counted over the replicas; an MoE model's
        auxiliary losses the mean over every replica's rounds, each as its head rank computed
        them (the ring passes the round's routing totals to the head; a ring of 1 is its own)."""
        rounds = len(stats.rounds)
        pairs = self.download(self.tr["scalars"][8:8 + 2 * rounds]).astype(np.float64)
        moe = stats.aux_loss is not None
        extra = np.array([stats.aux_loss, stats.z_loss or 0.0]) if moe else np.zeros(0)
        rows = self.transport.allgather(np.concatenate([pairs, extra]))
        head = self.rp.head_owner  # the placement's owner of the last layer
        loss_pairs = np.concatenate([rows[q * self.rp.n_ranks + head][:2 * rounds]
                                     for q in range(self.rp.replicas)]).astype(
            np.float32).reshape(-1, 2)
        if moe:  # the head's round losses: its routing totals are the whole ring's
            terms = np.array([rows[q * self.rp.n_ranks + head][2 * rounds:]
                              for q in range(self.rp.replicas)]).mean(axis=0)
            stats = dataclasses.replace(stats, aux_loss=float(terms[0]),
                                        z_loss=float(terms[1]) if stats.z_loss is not None
                                        else None)
        rounds = tuple(RoundStats(r, float(s), int(n)) for r, (s, n) in enumerate(loss_pairs))
        total = float(loss_pairs[:, 0].sum()) / max(1.0, float(loss_pairs[:, 1].sum()))
        return dataclasses.replace(stats, loss=total, rounds=rounds,
                                   tokens=stats.tokens * self.rp.replicas)
