"""Shared-memory ring transport between processes of one host (NumPy backend): one mailbox per
directed neighbour pair (a ring buffer of fixed-size slots in multiprocessing.shared_memory,
single writer, single reader) and a board for the control plane (all-gather, abort flag, pids).
Sends and receives run as host callbacks on the backend's HOST stream, so the schedule's events
order them and the sanitizer sees their byte ranges. Never waits forever: every wait checks the
abort flag, the neighbour's process and a deadline, and raises RingError naming the rank.

Relies on x86's store order (the payload is written before the counter that publishes it);
CPython does not reorder the stores. Never used with a GPU backend (use ring.nccl there)."""

from __future__ import annotations

import os
import time
from multiprocessing import shared_memory

import numpy as np

from ring.transport import RingError, Transport

GATHER_MAX = 4096
"""Most float64 values one all-gather carries per rank (loss pairs of 512 rounds, block norms)."""
MAX_WORLD = 64
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
        except FileNotFoundError:
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
    """Ranks `0..world_size-1` of one ring on one host, found by `run_id` (the launcher's
    DATAFLOW_RING_ID, else MASTER_PORT). `timeout_s` bounds every wait for a neighbour."""

    def __init__(self, rank: int, world_size: int, run_id: str, *, timeout_s: float = 60.0):
        if not 1 <= world_size <= MAX_WORLD or not 0 <= rank < world_size:
            raise RingError(f"rank {rank} of world size {world_size} is not a ring position; "
                            f"use 0 <= rank < world_size <= {MAX_WORLD}", rank=rank)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.prefix = f"dfr-{run_id}"
        self.be = None
        self._owned: list[shared_memory.SharedMemory] = []
        self._attached: list[shared_memory.SharedMemory] = []
        board_bytes = 8 * (16 + 2 * MAX_WORLD + 2 * MAX_WORLD * GATHER_MAX)
        name = self.board_name(self.prefix)
        if rank == 0:
            self._board_shm = _create(name, board_bytes, rank)
            self._owned.append(self._board_shm)
        else:
            self._board_shm = _attach(name, time.monotonic() + timeout_s, "rank 0's board", rank,
                                      0)
            self._attached.append(self._board_shm)
        words = np.frombuffer(self._board_shm.buf, np.int64)
        self._flags = words[:16]
        """[0]: 0, or 1 + the rank that aborted (or world_size + 1: the launcher)."""
        self._pids = words[16:16 + MAX_WORLD]
        self._gens = words[16 + MAX_WORLD:16 + 2 * MAX_WORLD]
        self._rows = np.frombuffer(self._board_shm.buf, np.float64)[16 + 2 * MAX_WORLD:].reshape(
            2, MAX_WORLD, GATHER_MAX)
        self._pids[rank] = os.getpid()
        self._gen = 0
        self._out: dict[int, tuple] = {}
        self._in: dict[int, tuple] = {}

    @staticmethod
    def board_name(prefix: str) -> str:
        return f"{prefix}-board"

    # -- waiting ---------------------------------------------------------------------------------
    def _aborted(self) -> str | None:
        who = int(self._flags[0])
        if not who:
            return None
        if who == self.world_size + 1:
            return f"rank {self.rank}: the launcher stopped the ring (another rank died)"
        return f"rank {self.rank}: rank {who - 1} aborted the ring"

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
            peers = [peer] if peer is not None else range(self.world_size)
            for p in peers:
                if not _alive(int(self._pids[p])):
                    raise RingError(f"rank {self.rank}: rank {p} (pid {int(self._pids[p])}) "
                                    f"died while {what}", rank=self.rank, peer=p)
            if time.monotonic() > deadline:
                raise RingError(f"rank {self.rank}: timed out after {self.timeout_s:g} s "
                                f"{what}; rank {peer if peer is not None else '?'} hung or is "
                                "too slow (raise --timeout)", rank=self.rank, peer=peer)

    # -- mailboxes -------------------------------------------------------------------------------
    def bind(self, be, max_message_bytes: int, depth: int) -> None:
        if not getattr(be, "device_is_host_memory", False):
            raise RingError(f"rank {self.rank}: the shared-memory transport runs on the NumPy "
                            f"backend only, not '{be.name}'; use the NCCL transport on GPUs",
                            rank=self.rank)
        self.be = be
        slot = SLOT_HEADER + -(-max_message_bytes // 64) * 64
        nbytes = HEADER + depth * slot
        peers = sorted({(self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size}
                       - {self.rank})
        for p in peers:
            shm = _create(f"{self.prefix}-{self.rank}-{p}", nbytes, self.rank)
            self._owned.append(shm)
            self._out[p] = self._mailbox(shm, depth, slot)
        deadline = time.monotonic() + self.timeout_s
        for p in peers:
            shm = _attach(f"{self.prefix}-{p}-{self.rank}", deadline, f"rank {p}'s mailbox",
                          self.rank, p, self._aborted)
            self._attached.append(shm)
            self._in[p] = self._mailbox(shm, depth, slot)

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

    def send(self, view, peer: int, tag: int) -> None:
        from dataflow.backend import Stream

        flat = view.reshape(-1).view(np.uint8)
        self.be.host_call(Stream.HOST, lambda: self._send_now(flat, peer, tag), reads=(view,),
                          name=f"send{tag}")

    def recv(self, view, peer: int, tag: int) -> None:
        from dataflow.backend import Stream

        flat = view.reshape(-1).view(np.uint8)
        self.be.host_call(Stream.HOST, lambda: self._recv_now(flat, peer, tag), writes=(view,),
                          name=f"recv{tag}")

    def record(self, stream: str):
        from dataflow.backend import Stream

        return self.be.record(Stream.HOST)  # sends and receives share the host stream: sends
        # never wait for their receiver (the mailbox holds a round's chunks), so none blocks one

    def wait(self, stream: str, event) -> None:
        from dataflow.backend import Stream

        self.be.wait(Stream.HOST, event)

    # -- control plane ---------------------------------------------------------------------------
    def allgather(self, values) -> list:
        values = np.asarray(values, np.float64).reshape(-1)
        if values.size > GATHER_MAX:
            raise RingError(f"all-gather of {values.size} values exceeds {GATHER_MAX}",
                            rank=self.rank)
        parity = self._gen % 2
        # Double-buffered by parity: a rank can only reach the all-gather after next once every
        # rank has published this one's successor, i.e. finished reading this one.
        self._rows[parity, self.rank, :values.size] = values
        self._gens[self.rank] = self._gen + 1
        target = self._gen + 1
        self._wait_until(lambda: all(int(self._gens[r]) >= target
                                     for r in range(self.world_size)),
                         f"in all-gather {target}", None)
        self._gen = target
        return [self._rows[parity, r, :values.size].copy() for r in range(self.world_size)]

    def abort(self, reason: str = "") -> None:
        if not int(self._flags[0]):
            self._flags[0] = self.rank + 1

    def close(self) -> None:
        self._out.clear()
        self._in.clear()
        self._flags = self._pids = self._gens = self._rows = None
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


def abort_ring(run_id: str, world_size: int) -> bool:
    """From outside the ring (the launcher): set the abort flag so every rank stops waiting.
    False when the board is already gone."""
    try:
        shm = shared_memory.SharedMemory(name=SharedMemoryTransport.board_name(f"dfr-{run_id}"))
    except FileNotFoundError:
        return False
    flags = np.frombuffer(shm.buf, np.int64)[:1]
    flags[0] = world_size + 1
    del flags
    shm.close()
    return True


def cleanup(run_id: str, world_size: int) -> None:
    """Unlink every segment of a ring whose ranks are gone (after a crash)."""
    names = [SharedMemoryTransport.board_name(f"dfr-{run_id}")]
    for r in range(world_size):
        for p in ((r + 1) % world_size, (r - 1) % world_size):
            names.append(f"dfr-{run_id}-{r}-{p}")
    for name in set(names):
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        shm.close()
        shm.unlink()
