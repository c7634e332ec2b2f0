"""Shared-memory ring transport between processes of one host: one mailbox per directed neighbour
pair (a ring buffer of fixed-size slots in multiprocessing.shared_memory, single writer, single
reader), one all-reduce segment per ring rank when there are data-parallel replicas (a slot per
replica; each replica sums the slots in replica order, in fp32) and a board for the control plane
(all-gather, abort flag, pids of every process). Sends, receives and all-reduces run as host
callbacks on the backend's HOST stream, so the schedule's events order them and the sanitizer
sees their byte ranges. On the CuPy backend (several ranks sharing one GPU) device bytes pass
through a pinned staging buffer by copies on that same stream. Never waits forever: every wait
checks the abort flag, the other processes and a deadline, and raises RingError naming the rank.

Relies on x86's store order (the payload is written before the counter that publishes it);
CPython does not reorder the stores. Between GPUs use dataflow.ring.nccl instead."""

from __future__ import annotations

import os
import time
from multiprocessing import shared_memory

import numpy as np

from dataflow.backend import Place, Stream
from dataflow.ring.transport import RingError, Transport, check_part_bounds

GATHER_MAX = 4096
"""Most float64 values one all-gather carries per process (loss pairs of 512 rounds)."""
MAX_WORLD = 64
"""Most processes (replicas x ranks)."""
LAUNCHER = -1
"""The abort flag's value when the launcher stopped the ring."""
HEADER = 128
"""Mailbox header: the write count (sender) at byte 0, the read count (receiver) at byte 64, on
separate cache lines."""
SLOT_HEADER = 16
"""Per slot: the message tag and its byte count (int64 each)."""


def _attach(name: str, deadline: float, what: str, rank: int, peer: int | None,
            aborted=lambda: None) -> shared_memory.SharedMemory:
    """Open a segment another process creates, waiting for it until `deadline`."""
    while True:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except (FileNotFoundError, ValueError):  # ValueError: created, not yet sized
            reason = aborted()
            if reason:
                raise RingError(reason, rank=rank, peer=peer) from None
            if time.monotonic() > deadline:
                raise RingError(f"rank {rank}: {what} never appeared (shared memory '{name}'); "
                                f"rank {peer if peer is not None else 0} did not start or died "
                                "before the rendezvous", rank=rank, peer=peer) from None
            time.sleep(0.01)
            continue
        # Python < 3.13 registers attached segments with the resource tracker too. Spawned ranks
        # share their launcher's tracker, where the creator's unlink balances it; ranks started
        # by torchrun have their own and may see a "leaked shared_memory" warning at exit.
        return shm


def _create(name: str, nbytes: int, rank: int) -> shared_memory.SharedMemory:
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    except FileExistsError:
        raise RingError(f"rank {rank}: shared memory '{name}' already exists: another ring "
                        "with the same run id is running (or one crashed and left it); set a "
                        "different DATAFLOW_RING_ID or MASTER_PORT, or remove /dev/shm/" + name,
                        rank=rank) from None
    np.frombuffer(shm.buf, np.uint8)[:] = 0
    return shm


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not known yet
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class SharedMemoryTransport(Transport):
    """Rank `rank` of ring `replica` (of `replicas` rings of `ring_size` ranks) on one host,
    found by `run_id` (the launcher's DATAFLOW_RING_ID, else MASTER_PORT). `timeout_s` bounds
    every wait for another process."""

    splits_updates = split_bits_promised = True

    def __init__(self, rank: int, ring_size: int, run_id: str, *, replica: int = 0,
                 replicas: int = 1, timeout_s: float = 60.0):
        gpus = ring_size * replicas
        if not 1 <= gpus <= MAX_WORLD or not 0 <= rank < ring_size or \
                not 0 <= replica < replicas:
            raise RingError(f"rank {rank} of ring {replica} ({replicas} rings of {ring_size}) "
                            f"is not a ring position; use 0 <= rank < ring_size, 0 <= replica "
                            f"< replicas, ring_size * replicas <= {MAX_WORLD}", rank=rank)
        self.rank, self.ring_size, self.timeout_s = rank, ring_size, timeout_s
        self.replica, self.replicas, self.gpus = replica, replicas, gpus
        self.me = self.proc(rank)
        self.prefix = f"dfr-{run_id}"
        self.be = None
        self._owned: list[shared_memory.SharedMemory] = []
        self._attached: list[shared_memory.SharedMemory] = []
        board_bytes = 8 * (16 + 2 * MAX_WORLD + 2 * MAX_WORLD * GATHER_MAX)
        name = self.board_name(self.prefix)
        if self.me == 0:
            self._board_shm = _create(name, board_bytes, rank)
            self._owned.append(self._board_shm)
        else:
            self._board_shm = _attach(name, time.monotonic() + timeout_s, "rank 0's board", rank,
                                      0)
            self._attached.append(self._board_shm)
        words = np.frombuffer(self._board_shm.buf, np.int64)
        self._flags = words[:16]
        """[0]: 0, or 1 + the process that aborted (or LAUNCHER)."""
        self._pids = words[16:16 + MAX_WORLD]
        self._gens = words[16 + MAX_WORLD:16 + 2 * MAX_WORLD]
        self._rows = np.frombuffer(self._board_shm.buf, np.float64)[16 + 2 * MAX_WORLD:].reshape(
            2, MAX_WORLD, GATHER_MAX)
        self._pids[self.me] = os.getpid()
        self._gen = 0
        self._out: dict[int, tuple] = {}
        self._in: dict[int, tuple] = {}
        self._early: dict | None = None
        """Bound out of order: (peer, tag) -> a message that came before its receive."""
        self._reduce = None
        """(arrived, done, slots) of this rank's all-reduce segment, with replicas."""
        self._reduce_gen = 0
        self._stage: dict[str, np.ndarray] = {}
        """Pinned host staging for device views (CuPy backend): 'send', 'recv', 'reduce'."""
        self._failed: RingError | None = None
        """An error raised inside a host callback (re-raised by the next all-gather)."""

    def proc(self, rank: int, replica: int | None = None) -> int:
        """The process number of `rank` of ring `replica` (default: this one)."""
        return (self.replica if replica is None else replica) * self.ring_size + rank

    @staticmethod
    def board_name(prefix: str) -> str:
        return f"{prefix}-board"

    # -- waiting ---------------------------------------------------------------------------------
    def _aborted(self) -> str | None:
        who = int(self._flags[0])
        if not who:
            return None
        if who == LAUNCHER:
            return f"rank {self.rank}: the launcher stopped the ring (another rank died)"
        return f"rank {self.rank}: process {who - 1} aborted the ring"

    def _wait_until(self, ready, what: str, peer: int | None) -> None:
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while not ready():
            spins += 1
            if spins < 200:
                time.sleep(0)
                continue
            time.sleep(min(1e-3, 1e-5 * (spins - 199)))
            if spins % 64:
                continue
            reason = self._aborted()
            if reason:
                raise RingError(f"{reason} while {what}", rank=self.rank, peer=peer)
            procs = [self.proc(peer)] if peer is not None else range(self.gpus)
            for p in procs:
                if not _alive(int(self._pids[p])):
                    who = f"rank {p % self.ring_size}" + (
                        f" of ring {p // self.ring_size}" if self.replicas > 1 else "")
                    raise RingError(f"rank {self.rank}: {who} (pid {int(self._pids[p])}) "
                                    f"died while {what}", rank=self.rank,
                                    peer=p % self.ring_size)
            if time.monotonic() > deadline:
                raise RingError(f"rank {self.rank}: timed out after {self.timeout_s:g} s "
                                f"{what}; rank {peer if peer is not None else '?'} hung or is "
                                "too slow (raise --timeout)", rank=self.rank, peer=peer)

    # -- mailboxes -------------------------------------------------------------------------------
    def bind(self, be, max_message_bytes: int, depth: int, max_reduce_bytes: int = 0,
             max_gather_bytes: int = 0, out_of_order: bool = False) -> None:
        max_reduce_bytes = max(max_reduce_bytes, max_gather_bytes)  # one segment serves both
        self.be = be
        self._early = {} if out_of_order else None
        slot = SLOT_HEADER + -(-max_message_bytes // 64) * 64
        nbytes = HEADER + depth * slot
        peers = sorted({(self.rank + 1) % self.ring_size, (self.rank - 1) % self.ring_size}
                       - {self.rank})
        for p in peers:
            shm = _create(f"{self.prefix}-{self.me}-{self.proc(p)}", nbytes, self.rank)
            self._owned.append(shm)
            self._out[p] = self._mailbox(shm, depth, slot)
        if self.replicas > 1 and max_reduce_bytes:
            self._bind_reduce(max_reduce_bytes)
        deadline = time.monotonic() + self.timeout_s
        for p in peers:
            shm = _attach(f"{self.prefix}-{self.proc(p)}-{self.me}", deadline,
                          f"rank {p}'s mailbox", self.rank, p, self._aborted)
            self._attached.append(shm)
            self._in[p] = self._mailbox(shm, depth, slot)
        if not be.device_is_host_memory:  # a GPU: device bytes pass through pinned staging
            for what, n in (("send", max_message_bytes), ("recv", max_message_bytes),
                            ("reduce", max_reduce_bytes if self.replicas > 1 else 0)):
                if n:
                    self._stage[what] = be.view(be.alloc(n, Place.HOST), 0, (n,), "u8")

    def _bind_reduce(self, max_bytes: int) -> None:
        """The all-reduce segment of this ring rank: replica 0 creates it, the others attach."""
        slot = -(-max_bytes // 64) * 64
        head = 8 * 2 * MAX_WORLD
        name = f"{self.prefix}-ar{self.rank}"
        if self.replica == 0:
            shm = _create(name, head + self.replicas * slot, self.rank)
            self._owned.append(shm)
        else:
            shm = _attach(name, time.monotonic() + self.timeout_s, "ring 0's all-reduce segment",
                          self.rank, self.rank, self._aborted)
            self._attached.append(shm)
        counts = np.frombuffer(shm.buf, np.int64, 2 * MAX_WORLD)
        slots = np.frombuffer(shm.buf, np.uint8, self.replicas * slot, head).reshape(
            self.replicas, slot)
        self._reduce = (counts[:MAX_WORLD], counts[MAX_WORLD:], slots)

    @staticmethod
    def _mailbox(shm, depth: int, slot: int):
        raw = np.frombuffer(shm.buf, np.uint8)
        counts = raw[:HEADER].view(np.int64)  # [0] written, [8] read
        slots = raw[HEADER:HEADER + depth * slot].reshape(depth, slot)
        return counts, slots, depth

    def _send_now(self, payload: np.ndarray, peer: int, tag: int) -> None:
        counts, slots, depth = self._out[peer]
        written = int(counts[0])
        self._wait_until(lambda: written - int(counts[8]) < depth,
                         f"sending message {tag} to rank {peer} (its mailbox is full)", peer)
        s = slots[written % depth]
        n = payload.size
        if n > s.size - SLOT_HEADER:
            raise RingError(f"rank {self.rank}: message {tag} of {n} bytes exceeds the "
                            f"{s.size - SLOT_HEADER}-byte mailbox slot", rank=self.rank, peer=peer)
        s[SLOT_HEADER:SLOT_HEADER + n] = payload
        s[:SLOT_HEADER].view(np.int64)[:] = (tag, n)
        counts[0] = written + 1  # publish after the payload (x86 keeps store order)

    def _recv_now(self, out: np.ndarray, peer: int, tag: int) -> None:
        if self._early is not None:  # bound out of order: the message of this tag, wherever
            self._recv_tagged(out, peer, tag)
            return
        counts, slots, depth = self._in[peer]
        read = int(counts[8])
        self._wait_until(lambda: int(counts[0]) > read,
                         f"waiting for message {tag} from rank {peer}", peer)
        s = slots[read % depth]
        got_tag, n = (int(v) for v in s[:SLOT_HEADER].view(np.int64))
        if got_tag != tag or n != out.size:
            raise RingError(f"rank {self.rank}: expected message {tag} ({out.size} bytes) from "
                            f"rank {peer}, got {got_tag} ({n} bytes): the ranks run different "
                            "schedules (same plan files and ring size on every rank?)",
                            rank=self.rank, peer=peer)
        out[...] = s[SLOT_HEADER:SLOT_HEADER + n]
        counts[8] = read + 1

    def _recv_tagged(self, out: np.ndarray, peer: int, tag: int) -> None:
        """The message `tag` from `peer` into `out`: one that came ahead of an earlier receive's
        (kept aside then), else the mailbox's next ones, each other tag kept aside in a host
        copy until its receive comes (at most the messages one link carries ahead of their
        turn: an overlapped ring's of a round, a few chunks' rows; outside the plan's bytes,
        as the mailboxes are)."""
        early = self._early.pop((peer, tag), None)
        if early is None:
            counts, slots, depth = self._in[peer]
            while True:
                read = int(counts[8])
                self._wait_until(lambda: int(counts[0]) > read,
                                 f"waiting for message {tag} from rank {peer}", peer)
                s = slots[read % depth]
                got_tag, n = (int(v) for v in s[:SLOT_HEADER].view(np.int64))
                payload = s[SLOT_HEADER:SLOT_HEADER + n]
                if got_tag == tag:
                    early = payload.copy() if n != out.size else None
                    if early is None:
                        out[...] = payload
                    counts[8] = read + 1
                    break
                if (peer, got_tag) in self._early:
                    raise RingError(f"rank {self.rank}: message {got_tag} from rank {peer} came "
                                    "twice in one step: the ranks run different schedules",
                                    rank=self.rank, peer=peer)
                self._early[(peer, got_tag)] = payload.copy()
                counts[8] = read + 1
            if early is None:
                return
        if early.size != out.size:
            raise RingError(f"rank {self.rank}: message {tag} from rank {peer} has {early.size} "
                            f"bytes, the receive {out.size}: the ranks run different schedules "
                            "(same plan files and ring size on every rank?)", rank=self.rank,
                            peer=peer)
        out[...] = early

    def _exchange_now(self, raw: np.ndarray, mine: slice, combine, what: str) -> None:
        """One exchange between the replicas through the all-reduce segment: publish raw[mine]
        in this replica's slot, wait for every slot, combine(the slots' first raw.size bytes),
        then mark it read. All-reduces and gathers share the segment and its generations: they
        run on the host stream in schedule order, the same on every replica."""
        arrived, done, slots = self._reduce
        gen, r = self._reduce_gen + 1, self.replicas
        self._wait_until(lambda: all(int(done[q]) >= gen - 1 for q in range(r)),
                         f"waiting for the replicas to read {what} {gen - 1}", None)
        slots[self.replica, mine] = raw[mine]
        arrived[self.replica] = gen
        self._wait_until(lambda: all(int(arrived[q]) >= gen for q in range(r)),
                         f"in {what} {gen}", None)
        combine([slots[q, :raw.size] for q in range(r)])
        done[self.replica] = gen
        self._reduce_gen = gen

    def _reduce_now(self, arr: np.ndarray) -> None:
        """Sum `arr` (bf16 or f32) over the replicas: publish it in this replica's slot, wait for
        every slot, add them in replica order in fp32, round once. Every replica computes the
        same sum from the same bytes, so all end bit-identical."""
        def total(parts) -> None:
            acc = parts[0].view(arr.dtype).astype(np.float32)
            for part in parts[1:]:
                acc += part.view(arr.dtype).astype(np.float32)
            arr.reshape(-1)[...] = acc.astype(arr.dtype)

        raw = arr.reshape(-1).view(np.uint8)
        self._exchange_now(raw, slice(0, raw.size), total, "all-reduce")

    def _reduce_part_now(self, arr: np.ndarray, bounds) -> None:
        """Part q of `arr` (bytes [bounds[q], bounds[q + 1])) summed over the replicas (in
        replica order in fp32, rounded once: the same bits as _reduce_now's part q) into this
        replica's part q; the rest is untouched."""
        flat = arr.reshape(-1)
        size = flat.itemsize
        q = self.replica
        mine = slice(bounds[q] // size, bounds[q + 1] // size)

        def total(parts) -> None:
            acc = parts[0].view(arr.dtype)[mine].astype(np.float32)
            for part in parts[1:]:
                acc += part.view(arr.dtype)[mine].astype(np.float32)
            flat[mine] = acc.astype(arr.dtype)

        raw = flat.view(np.uint8)
        self._exchange_now(raw, slice(0, raw.size), total, "reduce-scatter")

    def _gather_now(self, raw: np.ndarray, bounds=()) -> None:
        """Replica q's part of `raw` (bytes [bounds[q], bounds[q + 1]), or with no bounds
        [q n / R, (q + 1) n / R)) to every replica."""
        r = self.replicas
        if not bounds:
            n = raw.size // r
            bounds = tuple(q * n for q in range(r + 1))
        part = [slice(bounds[q], bounds[q + 1]) for q in range(r)]

        def take(slots) -> None:
            for q, s in enumerate(slots):
                if q != self.replica:
                    raw[part[q]] = s[part[q]]

        self._exchange_now(raw, part[self.replica], take, "part gather")

    def _guarded(self, fn):
        """A host callback that remembers its RingError (on a GPU it runs on a driver thread)."""
        def run():
            try:
                fn()
            except RingError as exc:
                self._failed = self._failed or exc
                raise
        return run

    def _on_host(self, view, what: str, fn, *, to_host: bool, from_host: bool, name: str):
        """Run fn(host bytes of `view`) on the HOST stream; a device view goes through the
        `what` staging buffer, copied there first (to_host) and / or back after (from_host)."""
        be = self.be
        if isinstance(view, np.ndarray):
            flat = view.reshape(-1).view(np.uint8)
            be.host_call(Stream.HOST, self._guarded(lambda: fn(flat)),
                         reads=(view,) if to_host else (), writes=(view,) if from_host else (),
                         name=name)
            return
        stage = self._stage[what][:view.nbytes]
        dev = view.reshape(-1).view(np.uint8)
        if to_host:
            be.copy(stage, dev, Stream.HOST, name=f"{name}.d2h")
        be.host_call(Stream.HOST, self._guarded(lambda: fn(stage)), reads=(stage,),
                     writes=(stage,), name=name)
        if from_host:
            be.copy(dev, stage, Stream.HOST, name=f"{name}.h2d")

    def send(self, view, peer: int, tag: int) -> None:
        self._on_host(view, "send", lambda b: self._send_now(b, peer, tag), to_host=True,
                      from_host=False, name=f"send{tag}")

    def recv(self, view, peer: int, tag: int) -> None:
        self._on_host(view, "recv", lambda b: self._recv_now(b, peer, tag), to_host=False,
                      from_host=True, name=f"recv{tag}")

    def allreduce(self, view) -> None:
        dtype = view.dtype
        self._on_host(view, "reduce", lambda b: self._reduce_now(b.view(dtype)), to_host=True,
                      from_host=True, name="allreduce")

    def reduce_scatter(self, view, bounds) -> None:
        check_part_bounds(view, bounds, self.replicas, self.rank)
        dtype = view.dtype
        self._on_host(view, "reduce", lambda b: self._reduce_part_now(b.view(dtype), bounds),
                      to_host=True, from_host=True, name="reduce_scatter")

    def gather_parts(self, view, bounds=()) -> None:
        if bounds:
            check_part_bounds(view, bounds, self.replicas, self.rank)
        elif view.nbytes % self.replicas:
            raise RingError(f"rank {self.rank}: {view.nbytes} bytes do not split into "
                            f"{self.replicas} parts", rank=self.rank)
        self._on_host(view, "reduce", lambda b: self._gather_now(b, bounds), to_host=True,
                      from_host=True, name="gather_parts")

    def record(self, stream: str):
        return self.be.record(Stream.HOST)  # sends and receives share the host stream: sends
        # never wait for their receiver (the mailbox holds a round's chunks), so none blocks one

    def wait(self, stream: str, event) -> None:
        self.be.wait(Stream.HOST, event)

    # -- control plane ---------------------------------------------------------------------------
    def allgather(self, values) -> list:
        if self._failed is not None:
            raise self._failed
        values = np.asarray(values, np.float64).reshape(-1)
        if values.size > GATHER_MAX:
            raise RingError(f"all-gather of {values.size} values exceeds {GATHER_MAX}",
                            rank=self.rank)
        parity = self._gen % 2
        # Double-buffered by parity: a rank can only reach the all-gather after next once every
        # rank has published this one's successor, i.e. finished reading this one.
        self._rows[parity, self.me, :values.size] = values
        self._gens[self.me] = self._gen + 1
        target = self._gen + 1
        self._wait_until(lambda: all(int(self._gens[p]) >= target for p in range(self.gpus)),
                         f"in all-gather {target}", None)
        self._gen = target
        return [self._rows[parity, p, :values.size].copy() for p in range(self.gpus)]

    def abort(self, reason: str = "") -> None:
        if not int(self._flags[0]):
            self._flags[0] = self.me + 1

    def close(self) -> None:
        self._out.clear()
        self._in.clear()
        self._stage.clear()
        self._flags = self._pids = self._gens = self._rows = self._reduce = None
        for shm in self._attached:
            try:
                shm.close()
            except BufferError:  # a view is still alive somewhere: leave the mapping
                pass
        for shm in self._owned:
            try:
                shm.close()
            except BufferError:
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self._attached.clear()
        self._owned.clear()


def abort_ring(run_id: str) -> bool:
    """From outside the ring (the launcher): set the abort flag so every process stops waiting.
    False when the board is already gone."""
    try:
        shm = shared_memory.SharedMemory(name=SharedMemoryTransport.board_name(f"dfr-{run_id}"))
    except FileNotFoundError:
        return False
    flags = np.frombuffer(shm.buf, np.int64)[:1]
    flags[0] = LAUNCHER
    del flags
    shm.close()
    return True


def cleanup(run_id: str) -> None:
    """Unlink every segment of a ring whose processes are gone (after a crash)."""
    prefix = f"dfr-{run_id}-"
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except FileNotFoundError:
        return
    for name in names:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        shm.close()
        shm.unlink()
