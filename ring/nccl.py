"""NCCL point-to-point ring transport through cupy.cuda.nccl: one process per GPU (LOCAL_RANK
picks the device), sends, receives and the replicas' all-reduce on CUDA streams of their own,
ordered against the backend's streams by CUDA events; one 2-rank communicator per directed
neighbour pair of each ring, so a send waiting for its receiver never blocks a receive (group
calls around each); one communicator per ring rank across the replicas for the gradient
all-reduce (bf16 or f32 sums, in place); one world communicator for the all-gather. Activations
travel as bytes (NCCL_UINT8). The unique ids travel over the TCP rendezvous (ring/rendezvous.py).
Split updates (RankPlan.split_update) reduce-scatter by one ncclReduce per part and gather
uneven parts by one broadcast per part. Written against the CuPy 14 / NCCL 2.28 API seen on the
H100 image; rings and replicas ran on 2 H200s (docs/ring.md), the split update's calls have NOT
run on two GPUs yet (tests/ring/test_ring_gpu.py checks what one GPU allows). Never imports
cupyx.distributed (hangs at exit, no bf16, single-use barrier; DESIGN.md §8)."""

from __future__ import annotations

import os

import numpy as np

from dataflow.ring.rendezvous import share_from_rank0
from dataflow.ring.shm import GATHER_MAX
from dataflow.ring.transport import RingError, Transport, check_part_bounds

REDUCE_STAGE_BYTES = 64 << 20
"""Device staging (outside the budget) for all-reducing a gradient kept in pinned host memory."""


def part_pieces(bounds, step: int) -> list[tuple[int, int, int]]:
    """(q, start, stop): byte ranges covering part q = 0, 1, .. of `bounds` in turn, each at most
    `step` bytes (a multiple of the element size) and inside one part: how a pinned host view's
    reduce-scatter passes the device staging buffer. Every replica cuts the same pieces in the
    same order, as NCCL matches collectives by the order they are issued in."""
    out = []
    for q, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        out += [(q, at, min(hi, at + step)) for at in range(lo, hi, step)]
    return out


def directed_pairs(ring_size: int) -> list[tuple[int, int]]:
    """Every (src, dst) pair of neighbours of one ring, in one order all ranks agree on."""
    pairs = {(r, (r + 1) % ring_size) for r in range(ring_size)}
    pairs |= {(r, (r - 1) % ring_size) for r in range(ring_size)}
    return sorted(p for p in pairs if p[0] != p[1])


def communicators(ring_size: int, replicas: int) -> list[tuple[str, tuple[int, ...]]]:
    """(what, member processes in communicator rank order) of every communicator, in the one
    order every process initialises them (each initialisation blocks until its members arrive;
    a common order cannot deadlock): the world, each ring's directed pairs, and with replicas
    each ring rank's copies across the rings (the all-reduce and the weight-part gathers) --
    except for rings of 1, whose world has the same members and serves as that communicator
    (one 2-rank communicator over NVLink holds 0.2-0.4 GiB of device memory)."""
    gpus = ring_size * replicas
    out = [("world", tuple(range(gpus)))]
    for q in range(replicas):
        out += [("pair", (q * ring_size + a, q * ring_size + b))
                for a, b in directed_pairs(ring_size)]
    if replicas > 1 and ring_size > 1:
        out += [("replicas", tuple(q * ring_size + r for q in range(replicas)))
                for r in range(ring_size)]
    return out


def uid_bytes(uid) -> bytes:
    """NCCL's unique id as bytes: CuPy 14 gives bytes, older CuPy a tuple of C chars."""
    return bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(x % 256 for x in uid)


def communicator_from_id(nccl, n: int, raw: bytes, rank: int):
    """NcclCommunicator from the id's bytes, in whichever form this CuPy takes it."""
    try:
        return nccl.NcclCommunicator(n, raw, rank)
    except TypeError:  # CuPy before 14: a tuple of C chars
        return nccl.NcclCommunicator(n, tuple(b if b < 128 else b - 256 for b in raw), rank)


class NcclTransport(Transport):
    """Process env.rank of env.gpus: rank env.rank % ring_size of ring
    env.rank // ring_size. With a ring of 1 (tests on one GPU) a send to and a receive from
    itself share a 1-rank communicator (issue both inside one nccl.groupStart/groupEnd), and an
    all-reduce with one replica runs on a 1-rank communicator (a copy)."""

    splits_updates = True
    """reduce_scatter and uneven part gathers are built (written; not yet run on two GPUs)."""

    def __init__(self, env, *, ring_size: int | None = None, timeout_s: float = 60.0):
        import cupy as cp  # optional: only a GPU ring imports it
        from cupy.cuda import nccl

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
        self.cp, self.nccl = cp, nccl
        n = ring_size or env.gpus
        if env.gpus % n:
            raise RingError(f"{env.gpus} processes do not form rings of {n}", rank=env.rank)
        self.rank, self.ring_size, self.timeout_s = env.rank % n, n, timeout_s
        self.replica, self.replicas, self.gpus = env.rank // n, env.gpus // n, env.gpus
        me = env.rank
        cp.cuda.Device(env.local_rank).use()
        comms = communicators(n, self.replicas)
        ids = None
        if me == 0:
            ids = b"".join(uid_bytes(nccl.get_unique_id()) for _ in comms)
        raw = share_from_rank0(me, env.gpus, env.master_addr, env.master_port, ids,
                               timeout_s)
        size = len(raw) // len(comms)
        self.out: dict[int, tuple] = {}
        """ring peer -> (communicator, peer's index in it) this rank sends to it on."""
        self.inn: dict[int, tuple] = {}
        """ring peer -> (communicator, peer's index in it) this rank receives from it on."""
        self.world = self.group = None
        self._made: list = []
        """This process's communicators in the one global order of `communicators` (close
        destroys them in it: see close)."""
        for i, (what, members) in enumerate(comms):
            if me not in members:
                continue
            comm = communicator_from_id(nccl, len(members), raw[i * size:(i + 1) * size],
                                        members.index(me))
            self._made.append(comm)
            if what == "world":
                self.world = comm
            elif what == "replicas":
                self.group = comm
            elif members[0] == me:
                self.out[members[1] % n] = (comm, 1)
            else:
                self.inn[members[0] % n] = (comm, 0)
        self.streams = {s: cp.cuda.Stream(non_blocking=True)
                        for s in ("send", "recv", "reduce", "ctl")}
        # The weight-part gathers share the all-reduce's communicator and stream: a second
        # communicator across the replicas cost 0.2-0.4 GiB of device memory (2 H200s, s19),
        # enough to halve 8b's chunk at 60/24, and NCCL calls on one communicator must not run
        # on two streams at once. One stream in schedule order cannot deadlock: every wait
        # names an earlier record, and every replica issues the same collectives in that order.
        self.streams["gather"] = self.streams["reduce"]
        if n == 1 and self.replicas > 1:
            # Rings of 1: the world is the replicas' communicator (communicators), so the
            # control plane's all-gathers join the all-reduces on their stream, in the order
            # every process issues them, as the gathers do.
            self.group = self.world
            self.streams["ctl"] = self.streams["reduce"]
        self.be = None
        self._stage = None
        self._gather = None
        """(send, receive) float64 device buffers of the all-gather, made before the backend
        forbids allocations (bind)."""

    def _self_comm(self):
        """A 1-rank communicator of this process alone (no rendezvous needed)."""
        return self.nccl.NcclCommunicator(1, self.nccl.get_unique_id(), 0)

    def bind(self, be, max_message_bytes: int, depth: int, max_reduce_bytes: int = 0,
             max_gather_bytes: int = 0, out_of_order: bool = False) -> None:
        if out_of_order:
            raise RingError(f"rank {self.rank}: overlapped rounds (round_overlap) take a link's "
                            "messages out of the order they were sent, which the NCCL "
                            "transport does not do yet; use --transport shm or "
                            "--no-round-overlap", rank=self.rank)
        if be.device_is_host_memory:
            raise RingError(f"rank {self.rank}: the NCCL transport needs the CuPy backend; use "
                            "the shared-memory transport with the NumPy backend", rank=self.rank)
        self.be = be
        if self.ring_size == 1 and 0 not in self.out:
            # made here, not on first send: a communicator created inside the caller's
            # groupStart/groupEnd is not initialised until groupEnd, and a send on it then
            # fails with NCCL_ERROR_INVALID_ARGUMENT (seen on the H100 with CuPy 14)
            comm = self._self_comm()
            self.out[0] = self.inn[0] = (comm, 0)
        if self.replicas > 1 and max_reduce_bytes:  # for gradients kept in pinned host memory
            self._stage = self.cp.empty(min(max_reduce_bytes, REDUCE_STAGE_BYTES), self.cp.uint8)
        self._gather_buffers()

    def _gather_buffers(self):
        if self._gather is None:
            self._gather = (self.cp.empty(GATHER_MAX, self.cp.float64),
                            self.cp.empty(GATHER_MAX * self.gpus, self.cp.float64))
        return self._gather

    def _bytes(self, view):
        return view.reshape(-1).view(self.cp.uint8)

    def _pair(self, table: dict, peer: int):
        if peer not in table:
            raise RingError(f"rank {self.rank}: no NCCL communicator to ring peer {peer} (bind "
                            "the transport before sending)", rank=self.rank)
        return table[peer]

    def send(self, view, peer: int, tag: int) -> None:
        buf, nccl = self._bytes(view), self.nccl
        comm, to = self._pair(self.out, peer)
        nccl.groupStart()
        comm.send(buf.data.ptr, buf.size, nccl.NCCL_UINT8, to, self.streams["send"].ptr)
        nccl.groupEnd()

    def recv(self, view, peer: int, tag: int) -> None:
        buf, nccl = self._bytes(view), self.nccl
        comm, src = self._pair(self.inn, peer)
        nccl.groupStart()
        comm.recv(buf.data.ptr, buf.size, nccl.NCCL_UINT8, src, self.streams["recv"].ptr)
        nccl.groupEnd()

    def _reduce_group(self, view) -> tuple:
        """(communicator across the replicas, NCCL element type, element size) of gradient
        `view` (bf16 or f32)."""
        if self.group is None:
            self.group = self._self_comm()
        itemsize = np.dtype(view.dtype).itemsize
        return (self.group, self.nccl.NCCL_FLOAT32 if itemsize == 4 else self.nccl.NCCL_BFLOAT16,
                itemsize)

    def _staging(self, nbytes: int, itemsize: int) -> tuple:
        """(device staging memory, bytes a piece may take) for a pinned host view."""
        if self._stage is None:
            self._stage = self.cp.empty(min(nbytes, REDUCE_STAGE_BYTES), self.cp.uint8)
        return self._stage.data, self._stage.nbytes - self._stage.nbytes % itemsize

    def allreduce(self, view) -> None:
        """In place on the reduce stream: a device view directly; a pinned host view in pieces
        through the device staging buffer (H2D, all-reduce, D2H, all on the reduce stream)."""
        group, dtype, itemsize = self._reduce_group(view)
        stream, op = self.streams["reduce"], self.nccl.NCCL_SUM
        if not isinstance(view, np.ndarray):
            ptr = view.data.ptr
            group.allReduce(ptr, ptr, view.size, dtype, op, stream.ptr)
            return
        host = view.reshape(-1).view(np.uint8)
        dev, step = self._staging(view.nbytes, itemsize)
        for at in range(0, host.size, step):
            n = min(step, host.size - at)
            dev.copy_from_host_async(host.ctypes.data + at, n, stream)
            group.allReduce(dev.ptr, dev.ptr, n // itemsize, dtype, op, stream.ptr)
            dev.copy_to_host_async(host.ctypes.data + at, n, stream)

    def reduce_scatter(self, view, bounds) -> None:
        """In place on the reduce stream: part q summed into replica q by one ncclReduce (root
        q) per part, grouped; a pinned host view in pieces through the device staging buffer,
        each piece copied up on every replica, reduced to its part's replica and copied back
        there only (elsewhere the host bytes of the piece stay as they were). The sums are
        NCCL's: over two replicas one rounding of a + b, as the all-reduce; over more its
        order, which the unsplit all-reduce need not share (shared memory promises the bits)."""
        b = check_part_bounds(view, bounds, self.replicas, self.rank)
        group, dtype, itemsize = self._reduce_group(view)
        stream, op, nccl = self.streams["reduce"], self.nccl.NCCL_SUM, self.nccl
        if not isinstance(view, np.ndarray):
            ptr = view.data.ptr
            nccl.groupStart()
            for q, (lo, hi) in enumerate(zip(b, b[1:])):
                if hi > lo:  # every replica skips the same empty parts
                    group.reduce(ptr + lo, ptr + lo, (hi - lo) // itemsize, dtype, op, q,
                                 stream.ptr)
            nccl.groupEnd()
            return
        host = view.reshape(-1).view(np.uint8)
        dev, step = self._staging(view.nbytes, itemsize)
        for q, lo, hi in part_pieces(b, step):
            dev.copy_from_host_async(host.ctypes.data + lo, hi - lo, stream)
            group.reduce(dev.ptr, dev.ptr, (hi - lo) // itemsize, dtype, op, q, stream.ptr)
            if q == self.replica:
                dev.copy_to_host_async(host.ctypes.data + lo, hi - lo, stream)

    def gather_parts(self, view, bounds=()) -> None:
        """In place on the gather stream: equal parts through NCCL's all-gather with each
        replica's send buffer its own part of the receive buffer (in place, as NCCL allows);
        a split update's uneven `bounds` by one broadcast per part from its replica, grouped."""
        if isinstance(view, np.ndarray):
            raise RingError(f"rank {self.rank}: weight parts are gathered on the device, got a "
                            "host view", rank=self.rank)
        if self.group is None:  # one replica (tests on one GPU): a 1-rank communicator
            self.group = self._self_comm()
        buf, stream, nccl = self._bytes(view), self.streams["gather"], self.nccl
        ptr = buf.data.ptr
        if bounds:
            b = check_part_bounds(view, bounds, self.replicas, self.rank)
            nccl.groupStart()
            for q, (lo, hi) in enumerate(zip(b, b[1:])):
                if hi > lo:
                    self.group.broadcast(ptr + lo, ptr + lo, hi - lo, nccl.NCCL_UINT8, q,
                                         stream.ptr)
            nccl.groupEnd()
            return
        n = buf.size // self.replicas
        self.group.allGather(ptr + self.replica * n, ptr, n, nccl.NCCL_UINT8, stream.ptr)

    def record(self, stream: str):
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record(self.streams[stream])
        return ev

    def wait(self, stream: str, event) -> None:
        if event is not None:
            self.streams[stream].wait_event(event)

    def allgather(self, values) -> list:
        values = np.ascontiguousarray(values, np.float64).reshape(-1)
        send, out = self._gather_buffers()
        k, stream = values.size, self.streams["ctl"]
        if k > send.size:
            raise RingError(f"all-gather of {k} values exceeds {send.size}", rank=self.rank)
        send[:k].set(values, stream=stream)
        self.world.allGather(send.data.ptr, out.data.ptr, k, self.nccl.NCCL_FLOAT64, stream.ptr)
        host = out[:k * self.gpus].get(stream=stream).reshape(self.gpus, k)  # synchronises
        return [host[p].copy() for p in range(self.gpus)]

    def _comms(self) -> list:
        """Every communicator of this process: the shared ones in the global order they were
        made in (the same on every process), then its 1-rank ones."""
        seen, out = set(), []
        for comm in (*self._made, self.world, self.group, *(c for c, _ in self.out.values()),
                     *(c for c, _ in self.inn.values())):
            if comm is not None and id(comm) not in seen:
                seen.add(id(comm))
                out.append(comm)
        return out

    def abort(self, reason: str = "") -> None:
        for comm in self._comms():
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass

    def close(self) -> None:
        if self.world is None:
            return
        for stream in self.streams.values():
            stream.synchronize()
        # ncclCommDestroy finalises the communicator first, which waits for its other members
        # to finalise it too: destroyed in per-process orders that differ (rank 0 its send pair
        # first, rank 1 its own send pair first) two ranks wait for each other for ever (seen
        # on 2 H200s at cc3682e: every ring trained, then hung at exit). One global order.
        for comm in self._comms():
            comm.destroy()
        self._made = []
        self.world = self.group = self._stage = self._gather = None
        self.out.clear()
        self.inn.clear()
