"""The rendezvous: rank 0 hands a few bytes (NCCL's unique id) to every other rank over TCP at
MASTER_ADDR:MASTER_PORT. Every wait has a deadline, so a rank that never arrives is an error
naming it, never a hang. Never carries tensors."""

from __future__ import annotations

import socket
import struct
import time

from dataflow.ring.transport import RingError

MAGIC = b"DFRING1\0"


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            raise ConnectionError("peer closed the connection")
        out += part
    return out


def share_from_rank0(rank: int, gpus: int, addr: str, port: int, payload: bytes | None,
                     timeout_s: float) -> bytes:
    """Rank 0 passes `payload` and serves it to ranks 1..N-1 (waiting at most `timeout_s` for
    all of them); the others pass None and get it. Raises RingError naming missing ranks."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        if payload is None:
            raise ValueError("rank 0 must pass the payload to share")
        srv = socket.create_server(("", port), reuse_port=False)
        srv.settimeout(0.5)
        seen: set[int] = set()
        try:
            while len(seen) < gpus - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, gpus)) - seen)
                    raise RingError(f"rank 0: ranks {missing} never reached the rendezvous at "
                                    f"port {port} within {timeout_s:g} s (not started, wrong "
                                    "MASTER_ADDR/MASTER_PORT, or died)", rank=0,
                                    peer=missing[0])
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    continue
                with conn:
                    conn.settimeout(max(0.1, deadline - time.monotonic()))
                    head = _recv_exact(conn, len(MAGIC) + 4)
                    if head[:len(MAGIC)] != MAGIC:
                        continue  # not one of ours
                    seen.add(struct.unpack("<i", head[len(MAGIC):])[0])
                    conn.sendall(struct.pack("<i", len(payload)) + payload)
        finally:
            srv.close()
        return payload
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0) as conn:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                conn.sendall(MAGIC + struct.pack("<i", rank))
                n = struct.unpack("<i", _recv_exact(conn, 4))[0]
                return _recv_exact(conn, n)
        except (ConnectionError, socket.timeout, OSError):
            if time.monotonic() > deadline:
                raise RingError(f"rank {rank}: rank 0 never answered at {addr}:{port} within "
                                f"{timeout_s:g} s (not started, wrong MASTER_ADDR/MASTER_PORT, "
                                "or died)", rank=rank, peer=0) from None
            time.sleep(0.1)
