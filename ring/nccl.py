"""NCCL point-to-point ring transport through cupy.cuda.nccl: one process per GPU (LOCAL_RANK
picks the device), sends and receives on CUDA streams of their own (one each) ordered against the
backend's streams by CUDA events, one 2-rank communicator per directed neighbour pair so a send
waiting for its receiver never blocks a receive (and group calls around each), bf16 moved as bytes (NCCL_UINT8).
The unique id travels over the TCP rendezvous (ring/rendezvous.py). Written against the CuPy 14
/ NCCL 2.28 API seen on the H100 image; NOT yet run on GPUs (see docs/ring.md). Never imports
cupyx.distributed (hangs at exit, no bf16, single-use barrier; DESIGN.md §8)."""

from __future__ import annotations

import os

from ring.transport import RingError, Transport


def directed_pairs(world_size: int) -> list[tuple[int, int]]:
    """Every (src, dst) pair of neighbours, in one order all ranks agree on."""
    pairs = {(r, (r + 1) % world_size) for r in range(world_size)}
    pairs |= {(r, (r - 1) % world_size) for r in range(world_size)}
    return sorted(p for p in pairs if p[0] != p[1])


class NcclTransport(Transport):
    """One 2-rank communicator per directed neighbour pair (src sends, dst receives, nothing
    else), plus one world communicator for the all-gather. NCCL serialises the operations of a
    communicator; with a communicator per direction a send that waits for its receiver can never
    stand in front of a receive on the same communicator (a ring with two chunks in flight would
    otherwise deadlock on large messages)."""

    def __init__(self, env, *, timeout_s: float = 60.0):
        import cupy as cp
        from cupy.cuda import nccl

        from ring.rendezvous import share_from_rank0

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
        self.cp, self.nccl = cp, nccl
        self.rank, self.world_size, self.timeout_s = env.rank, env.world_size, timeout_s
        cp.cuda.Device(env.local_rank).use()
        pairs = directed_pairs(env.world_size)
        ids = None
        if env.rank == 0:
            ids = b"".join(bytes(x % 256 for x in nccl.get_unique_id())
                           for _ in range(len(pairs) + 1))
        raw = share_from_rank0(env.rank, env.world_size, env.master_addr, env.master_port, ids,
                               timeout_s)
        n = len(raw) // (len(pairs) + 1)
        uids = [tuple(b if b < 128 else b - 256 for b in raw[i * n:(i + 1) * n])
                for i in range(len(pairs) + 1)]  # cupy's id is a tuple of C chars
        self.world = nccl.NcclCommunicator(env.world_size, uids[-1], env.rank)
        self.out: dict[int, object] = {}
        """peer -> the communicator this rank sends to it on (this rank is its rank 0)."""
        self.inn: dict[int, object] = {}
        """peer -> the communicator this rank receives from it on (this rank is its rank 1)."""
        nccl.groupStart()  # initialise every pair communicator at once: no ordering deadlock
        for (src, dst), uid in zip(pairs, uids):
            if src == env.rank:
                self.out[dst] = nccl.NcclCommunicator(2, uid, 0)
            elif dst == env.rank:
                self.inn[src] = nccl.NcclCommunicator(2, uid, 1)
        nccl.groupEnd()
        self.streams = {"send": cp.cuda.Stream(non_blocking=True),
                        "recv": cp.cuda.Stream(non_blocking=True)}
        self.be = None

    def bind(self, be, max_message_bytes: int, depth: int) -> None:
        if getattr(be, "device_is_host_memory", False):
            raise RingError(f"rank {self.rank}: the NCCL transport needs the CuPy backend; use "
                            "the shared-memory transport with the NumPy backend", rank=self.rank)
        self.be = be

    def _bytes(self, view):
        return view.reshape(-1).view(self.cp.uint8)

    def send(self, view, peer: int, tag: int) -> None:
        buf = self._bytes(view)
        nccl = self.nccl
        nccl.groupStart()
        self.out[peer].send(buf.data.ptr, buf.size, nccl.NCCL_UINT8, 1,
                            self.streams["send"].ptr)
        nccl.groupEnd()

    def recv(self, view, peer: int, tag: int) -> None:
        buf = self._bytes(view)
        nccl = self.nccl
        nccl.groupStart()
        self.inn[peer].recv(buf.data.ptr, buf.size, nccl.NCCL_UINT8, 0,
                            self.streams["recv"].ptr)
        nccl.groupEnd()

    def record(self, stream: str):
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record(self.streams[stream])
        return ev

    def wait(self, stream: str, event) -> None:
        if event is not None:
            self.streams[stream].wait_event(event)

    def allgather(self, values) -> list:
        import numpy as np

        cp, nccl = self.cp, self.nccl
        values = np.asarray(values, np.float64).reshape(-1)
        send = cp.asarray(values)
        out = cp.empty(values.size * self.world_size, cp.float64)
        self.world.allGather(send.data.ptr, out.data.ptr, values.size, nccl.NCCL_FLOAT64,
                            self.streams["send"].ptr)
        self.streams["send"].synchronize()
        host = cp.asnumpy(out).reshape(self.world_size, values.size)
        return [host[r].copy() for r in range(self.world_size)]

    def abort(self, reason: str = "") -> None:
        for comm in (self.world, *self.out.values(), *self.inn.values()):
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass

    def close(self) -> None:
        if self.world is not None:
            for stream in self.streams.values():
                stream.synchronize()
            for comm in (self.world, *self.out.values(), *self.inn.values()):
                comm.destroy()
            self.world = None
            self.out.clear()
            self.inn.clear()
