"""Runs one ring rank's compiled schedule: the single-device Executor with two more dispatch
entries (Send / Recv on the transport) and the send / recv streams' records and waits handed to the
transport, plus the replicas' gradient all-reduce. The step's loss (the head rank's of every
replica) and the global squared gradient norm (each block's own, after the all-reduce, added in
the single-device order) are shared through the transport's all-gather. Never decides placement or what
is sent: the schedule does."""

from __future__ import annotations

import dataclasses

import numpy as np

from dataflow import norm_parts
from dataflow.backend import BackendError, Place, Stream
from dataflow.executor import Executor, RoundStats, StepStats
from dataflow.memplan.plan.buffers import MAX_NORM_PARTS, NORM_PARTS_AT
from dataflow.memplan.plan.ranks import RankPlan
from dataflow.memplan.plan.split import SUB_BLOCK
from dataflow.memplan.step.ring_compile import (COMM_STREAMS, AllReduce, GatherParts, Recv,
                                            ReduceScatter, Send, compile_ring_eval_schedule,
                                            compile_ring_schedule, compile_ring_update_schedule)
from dataflow.memplan.step.compile import Compute, Record, Schedule, Wait
from dataflow.memplan.step.events import ComputeOp
from dataflow.models.errors import ConfigError
from dataflow.ring.shm import GATHER_MAX
from dataflow.ring.transport import Transport
from dataflow.ring.vocab_ops import VocabHeadOps


SPLIT = 2.0
"""The flag of a split block's entry in the norms' all-gathered rows (an unsplit owned block's
is 1.0, a block not owned 0.0): its value arrives as the replicas' exact partial sums."""


class RingExecutor(VocabHeadOps, Executor):
    def __init__(self, rp: RankPlan, be, transport: Transport, schedule: Schedule | None = None,
                 *, deferred_update: bool = False):
        """deferred_update: as the single-device Executor's (each step's AdamW of this rank's
        blocks inside the next step's round 0, or in flush()). The schedules are those of the
        transport's replica (with rp.split_fetch each replica fetches its own weight parts)."""
        q = transport.replica if transport is not None else 0
        ops = getattr(be, "ops", None)  # the null backend has no table and runs nothing
        if rp.vocab_parallel and ops is not None and getattr(ops, "vocab_stats", None) is None:
            raise ConfigError(f"--vocab-parallel-head on the {be.name} backend: its op table has "
                              "no vocabulary-parallel head kernels (the NumPy and CuPy backends "
                              "have them); use one of those, or leave the flag off")
        super().__init__(rp.plan, be, schedule, deferred_update=deferred_update,
                         compile_step=lambda update: compile_ring_schedule(rp, update=update,
                                                                           replica=q),
                         compile_update=lambda: compile_ring_update_schedule(rp, q),
                         compile_eval=lambda rounds: compile_ring_eval_schedule(rp, rounds, q))
        self.rp, self.transport = rp, transport
        self.aux_round_factor = rp.replicas
        self.aux_layers = rp.n_layers  # the routing totals a ring passes round are the model's
        self._dispatch.update({Send: self._send, Recv: self._recv, AllReduce: self._allreduce,
                               GatherParts: self._gather_parts, Record: self._ring_record,
                               Wait: self._ring_wait, ReduceScatter: self._reduce_scatter})
        self._partials: dict[int, tuple[int, float]] = {}
        """Split blocks' exact partial squared norms (norm_parts.exact_units), by norm part."""
        self._whole: dict[int, tuple[int, float]] = {}
        """With device sub-block sums (self._sums), the unsplit blocks' exact squared norms."""
        self._sums = self._bind_sums() if device_norm_sums(be, rp, transport) else None
        """(device, pinned host) float64 views for one block's sub-block sums, or None where
        the backend's own sumsq is used (device_norm_sums)."""
        if rp.vocab_parallel:
            self._compute_ops.update(self._vocab_handlers())
        ch, cfg = rp.plan.chunking, rp.plan.model
        reduced = [ev.dst.nbytes for ev in self.schedule.events
                   if type(ev) in (AllReduce, ReduceScatter)]
        gathered = [ev.dst.nbytes for ev in self.schedule.events if type(ev) is GatherParts]
        # Per neighbour at most one round's chunks travel each way (each chunk's residual is in
        # one place at a time), and a ring of 2 shares one mailbox for both directions.
        # An MoE model's ranks also pass the round's routing totals on: two small messages
        # each way (dataflow.memplan.step.ring_compile).
        totals = 4 if cfg.moe is not None and rp.n_ranks > 1 else 0
        owned = (["embed"] * rp.has_embed + [f"L{g}" for g in rp.layers]
                 + ["head"] * rp.holds_head_block)
        if len(owned) > MAX_NORM_PARTS:
            raise ConfigError(f"rank {rp.rank} holds {len(owned)} blocks; a ring rank holds at "
                              f"most {MAX_NORM_PARTS} (dataflow.memplan.plan.buffers): use more "
                              "ranks")
        self._norm_part = {f"gnorm.{what}": k for k, what in enumerate(owned)}
        # A vocabulary-parallel head sends fp32 partial dx (twice a residual's bytes) and up to
        # four messages a chunk each way beside the residuals; every rank binds alike (the
        # mailboxes' sizes must agree).
        vocab = 4 * ch.chunks_per_round if rp.vocab_parallel else 0
        message = ch.chunk_tokens * cfg.model_dim * (4 if rp.vocab_parallel else 2)
        # Overlapped rounds (RankPlan.round_overlap): two rounds' chunks may travel at once, and
        # a link's messages are taken in the order the receiver runs, not the sender's.
        overlap = bool(rp.round_overlap) and rp.n_ranks > 1
        transport.bind(be, message,
                       (4 if overlap else 2) * ch.chunks_per_round + totals + vocab,
                       max(reduced, default=0), max(gathered, default=0), out_of_order=overlap)

    # -- dispatch -------------------------------------------------------------------------------
    def _send(self, ev: Send) -> None:
        self.transport.send(self._view(ev.src), ev.peer, ev.tag)

    # A transport writes its destination behind the backend's back: the backend is told, so
    # that nothing it derived from the old bytes (an FP8 copy of a weight) outlives them.
    def _recv(self, ev: Recv) -> None:
        dst = self._view(ev.dst)
        self.transport.recv(dst, ev.peer, ev.tag)
        self.be.written((dst,))

    def _allreduce(self, ev: AllReduce) -> None:
        dst = self._view(ev.dst, dtype=ev.dtype)
        self.transport.allreduce(dst)
        self.be.written((dst,))

    def _reduce_scatter(self, ev: ReduceScatter) -> None:
        dst = self._view(ev.dst, dtype=ev.dtype)
        self.transport.reduce_scatter(dst, ev.bounds)
        self.be.written((dst,))

    def _gather_parts(self, ev: GatherParts) -> None:
        dst = self._view(ev.dst)
        if ev.bounds:  # a split update's sub-block runs
            self.transport.gather_parts(dst, ev.bounds)
        else:  # a split fetch's equal parts (every transport has them)
            self.transport.gather_parts(dst)
        self.be.written((dst,))

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
        if rp.holds_head_block:
            out.append((rp.n_layers + 1, self.head))
        return out

    def _compute(self, ev) -> None:
        if ev.op == "clip_scale":
            self._global_sumsq()
        super()._compute(ev)

    def _grad_sumsq(self, ev) -> None:
        """A block's squared gradient norm into its own scalar (not added into scalar 0): the
        ranks add the blocks' norms in the single-device order once all are known. A split
        block's part, and with device sums every block but the embedding (updated whole on
        every path), is summed exactly instead (dataflow.norm_parts)."""
        k = self._norm_part[ev.name]
        grads = self._view(ev.grads, dtype=self.gdt)
        split = self.rp.split_update and self.rp.replicas > 1 and ev.name != "gnorm.embed"
        if self._sums is not None and ev.name != "gnorm.embed":
            self._device_sumsq(k, grads, self._partials if split else self._whole, ev.name)
        elif split:
            self._partial_sumsq(k, grads)
        else:
            at = NORM_PARTS_AT + k
            self.be.launch(Stream.COMPUTE, "sumsq", grads, self.tr["scalars"][at:at + 1], False,
                           name=ev.name)

    def _bind_sums(self) -> tuple:
        """(device, host) float64 views of the most sub-blocks any gradient norm of this
        rank's schedules sums: two small slabs beside the arenas, outside the plan's budget
        (a block's gradient bytes / 256 at bf16, / 512 at fp32, each side), allocated at
        setup, before the backend seals. The host one is pinned (the backend's host slab)."""
        size = 4 if self.gdt == "f32" else 2
        schedules = [self.schedule, getattr(self, "_first_schedule", None)]
        most = max((ev.grads.nbytes // size for sch in schedules if sch is not None
                    for ev in sch.events
                    if type(ev) is Compute and ev.op == ComputeOp.GRAD_SUMSQ), default=0)
        n = max(1, -(-most // SUB_BLOCK))
        return tuple(self.be.view(self.be.alloc(8 * n, place), 0, (8 * n,), "u8").view(
            np.float64) for place in (Place.DEVICE, Place.HOST))

    def _device_sumsq(self, k: int, grads, into: dict, name: str) -> None:
        """`grads`' sub-block sums on the device (sumsq_blocks), copied into the pinned
        buffer and added exactly there by a host function (norm_parts.exact_units), all on the
        compute stream, kept in `into` under norm part k. A host function holds its stream
        until it returns, so the next block's sums may reuse both buffers; _global_sumsq's
        download waits for all of them. A part's sub-blocks are the whole block's, so split
        and unsplit replicas add the same float64 values: the same bits."""
        dev, host = self._sums
        n = -(-grads.size // SUB_BLOCK)
        if n > dev.size:
            raise BackendError(f"{name}: {n} sub-blocks of gradient, but the norm buffers were "
                               f"bound for {dev.size} at setup (RingExecutor._bind_sums); a "
                               "schedule compiled later holds a larger block")
        if n == 0:  # an empty part (a block of fewer sub-blocks than replicas)
            into[k] = (0, 0.0)
            return
        d, h = dev[:n], host[:n]
        self.be.launch(Stream.COMPUTE, "sumsq_blocks", grads, d, name=f"{name}.sums")
        self.be.copy(h, d, Stream.COMPUTE, name=f"{name}.sums.d2h")

        def run() -> None:
            into[k] = norm_parts.exact_units(h)
        self.be.host_call(Stream.COMPUTE, run, reads=(h,), name=f"{name}.exact")

    def _partial_sumsq(self, k: int, grads) -> None:
        """A split block's part (RankPlan.split_update, whole sub-blocks): its exact squared
        norm (dataflow.norm_parts, an integer in units of 2^-1074), kept for _global_sumsq."""
        def run() -> None:
            self._partials[k] = norm_parts.exact_units(norm_parts.sub_block_sums(grads))
        self.be.host_call(Stream.COMPUTE, run, reads=(grads,), name=f"gnorm.part{k}")

    def _split_norms(self, rows: list, order: list[str]) -> None:
        """The split blocks' squared norms into `rows` (this ring's, one per ring rank; a split
        block's flag is SPLIT): every replica's exact partial sum as fixed-width limbs through
        all-gathers, added exactly, rounded to float64 once and to fp32: the unsplit sumsq
        kernel's bits (dataflow.ops_numpy.sumsq) for any R. Each rank sends its split blocks in
        the single-device order, padded to the most any ring rank holds (every process then
        makes the same calls with the same sizes), and fills every ring rank's row alike."""
        w, n, r_count = norm_parts.WIDTH, self.rp.n_ranks, self.rp.replicas
        split_of = [[i for i in range(len(order)) if r[1 + 2 * i] == SPLIT] for r in rows]
        most = max(len(s) for s in split_of)
        name_of = {k: name.removeprefix("gnorm.") for name, k in self._norm_part.items()}
        mine = {order.index(name_of[k]): k for k in self._partials}
        flat = np.zeros(most * w, np.float64)
        for j, i in enumerate(sorted(mine)):
            flat[j * w:(j + 1) * w] = norm_parts.encode(*self._partials[mine[i]])
        pieces = [self.transport.allgather(flat[at:at + GATHER_MAX])  # rows are bounded
                  for at in range(0, flat.size, GATHER_MAX)]
        everyone = [np.concatenate([c[p] for c in pieces]) for p in range(len(pieces[0]))]
        for r, row in enumerate(rows):
            for j, i in enumerate(split_of[r]):
                partials = [everyone[q * n + r][j * w:(j + 1) * w] for q in range(r_count)]
                row[2 + 2 * i] = float(np.float32(norm_parts.add_partials(partials)))

    def _global_sumsq(self) -> None:
        """Before the clip scale: every rank holds the squared norm of each of its blocks'
        gradients (and the host's part of a HOME embedding in scalar 2); gather them and put
        the global sum in scalar 0 on every rank, added in fp32 in the order one device adds
        them (single_device_norm_order), so the ring clips by the same bits. One host sync,
        where the ring already synchronises (collective: every rank reaches it there)."""
        sc, n = self.tr["scalars"], len(self._norm_part)
        host_part = float(self.download(sc[2:3])[0])
        parts = self.download(sc[NORM_PARTS_AT:NORM_PARTS_AT + n]).astype(np.float64)
        order = single_device_norm_order(self.rp.n_layers)
        row = np.zeros(1 + 2 * len(order))
        row[0] = host_part
        for name, k in self._norm_part.items():
            i = order.index(name.removeprefix("gnorm."))
            if k in self._partials:
                row[1 + 2 * i:3 + 2 * i] = (SPLIT, 0.0)
            elif k in self._whole:  # rounded as a split block's sum is (_split_norms)
                whole = np.float32(norm_parts.to_float(*self._whole[k]))
                row[1 + 2 * i:3 + 2 * i] = (1.0, float(whole))
            else:
                row[1 + 2 * i:3 + 2 * i] = (1.0, parts[k])
        rows = [np.array(r, np.float64) for r in self._own_ring(self.transport.allgather(row))]
        if any(r[1 + 2 * i] == SPLIT for r in rows for i in range(len(order))):
            self._split_norms(rows, order)
        total = np.float32(0.0)
        for i in range(len(order)):
            for r in rows:
                if r[1 + 2 * i]:
                    total = np.float32(total + np.float32(r[2 + 2 * i]))
        host = np.float32(sum(np.float32(r[0]) for r in rows))  # only the embedding's rank's
        self.upload(sc[0:3], np.array([np.float32(total + host), 0, 0], np.float32))

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


def device_norm_sums(be, rp: RankPlan, transport) -> bool:
    """Whether a rank's block norms are each sub-block's float64 sum on the device
    (sumsq_blocks), added exactly on the host (dataflow.norm_parts), on a backend whose device
    memory the host cannot read (CuPy), whose own sumsq sums a tree of its own: with replicas
    over a transport that splits updates, for a split update (RankPlan.split_update: a part's
    exact sum is what the replicas add) and, over a transport whose split and unsplit replicas
    promise the same bits (shared memory), for unsplit replicas too, so both add the same
    values. The NumPy backend's sumsq is exact already; one device, rings without replicas and
    unsplit NCCL replicas (the exact sum costs a host function per block in the last round)
    keep the backend's sumsq, its bits and speed. The null backend runs nothing."""
    split = rp.split_update or getattr(transport, "split_bits_promised", False)
    return (rp.replicas > 1 and getattr(transport, "splits_updates", False) and split
            and not be.device_is_host_memory and getattr(be, "ops", None) is not None)


def single_device_norm_order(n_layers: int) -> list[str]:
    """The blocks in the order one device adds their squared gradient norms in a step's last
    round (dataflow.memplan.step): the head, layers L-1 .. 1, the device embedding (its
    backward runs inside layer 0's), layer 0. tests/ring/test_ring_norm_order.py checks it
    against the compiled single-device schedule."""
    layers = [f"L{g}" for g in range(n_layers - 1, 0, -1)]
    return ["head"] + layers + ["embed"] + ["L0"] * (n_layers > 0)
