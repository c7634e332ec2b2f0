"""The one small interface every ring transport implements: point-to-point send / receive of a
backend view to a neighbour and the replicas' gradient all-reduce, ordered on the transport's own
streams by events, plus a tiny synchronous control plane (all-gather of a few float64 values,
abort). Processes are numbered replica-major: process replica * N + rank. Never decides what is
sent or when: the compiled ring schedule does (dataflow.memplan.step.ring_compile)."""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from dataflow.models.errors import ConfigError


class RingError(RuntimeError):
    """A ring rank could not go on: a neighbour died, aborted, or never answered in time.
    `peer` is the rank blamed (None when unknown)."""

    def __init__(self, message: str, *, rank: int, peer: int | None = None):
        super().__init__(message)
        self.rank, self.peer = rank, peer


class Transport(abc.ABC):
    rank: int
    """This process's place in its ring (0..ring_size-1)."""
    ring_size: int
    """Ranks in one ring (N)."""
    replica: int = 0
    """Which of the R data-parallel rings this process belongs to."""
    replicas: int = 1
    splits_updates: bool = False
    """Whether reduce_scatter is built (split updates run over this transport)."""
    split_bits_promised: bool = False
    """Whether split replicas train the unsplit replicas' bits over this transport (its sums
    keep one order either way), so unsplit replicas take the split ones' exact norms too
    (ring.executor.device_norm_sums)."""

    @abc.abstractmethod
    def bind(self, be, max_message_bytes: int, depth: int, max_reduce_bytes: int = 0,
             max_gather_bytes: int = 0, out_of_order: bool = False) -> None:
        """Prepare for messages of at most `max_message_bytes`, up to `depth` in flight per
        neighbour, all-reduces of at most `max_reduce_bytes` and part gathers of at most
        `max_gather_bytes`, between views of backend `be`. out_of_order: a receive takes the
        message of its tag even where the sender sent others first (an overlapped ring's
        ranks send and take one link's messages in different orders); else each receive takes
        the next message, which must carry its tag. Called once by the executor, before any
        step; collective (every process calls it)."""

    @abc.abstractmethod
    def send(self, view, peer: int, tag: int) -> None:
        """Enqueue sending `view`'s bytes to `peer` on the send stream (returns at once on a
        GPU; may block on the NumPy backend until the neighbour's mailbox has room)."""

    @abc.abstractmethod
    def recv(self, view, peer: int, tag: int) -> None:
        """Enqueue receiving the next message from `peer` into `view` on the recv stream; it must
        carry `tag`."""

    @abc.abstractmethod
    def allreduce(self, view) -> None:
        """Enqueue on the reduce stream: sum `view` (bf16 or f32 gradients, on the device or in
        pinned host memory) over the replicas of this rank, in place. Every replica ends with the
        same bits. Never called when there is one replica."""

    @abc.abstractmethod
    def gather_parts(self, view, bounds=()) -> None:
        """Enqueue on the gather stream: `view`'s bytes split into R parts, replica q's part
        (bytes [bounds[q], bounds[q + 1]); with no bounds the equal parts [q n / R, (q + 1) n /
        R)) written by replica q, given to every replica in place. Every replica passes a view
        of the same size. Never called with one replica."""

    def reduce_scatter(self, view, bounds) -> None:
        """Enqueue on the reduce stream: part q of `view` (bytes [bounds[q], bounds[q + 1]),
        dataflow.memplan.plan.split's sub-block runs) summed over the replicas into replica q's
        view (RankPlan.split_update); the rest of the view may hold anything afterwards. Only
        transports with splits_updates have it."""
        raise ConfigError(f"{type(self).__name__} has no reduce-scatter: split updates "
                          "(--split-update) run on the shared-memory and NCCL transports; use "
                          "one of them or leave --split-update off")

    @abc.abstractmethod
    def record(self, stream: str) -> Any:
        """An event marking everything enqueued so far on `stream` ('send', 'recv', 'reduce'
        or 'gather'); the backend's streams can wait on it with Backend.wait."""

    @abc.abstractmethod
    def wait(self, stream: str, event: Any) -> None:
        """Later work on `stream` ('send', 'recv', 'reduce' or 'gather') starts after `event`,
        an event of the backend's streams."""

    @abc.abstractmethod
    def allgather(self, values) -> list:
        """Synchronous: every process passes a 1-D float64 NumPy array of the same length and
        gets every process's array, replica-major (R * N rows, row replica * N + rank). For a
        step's few scalars, not for tensors."""

    def abort(self, reason: str) -> None:
        """Tell the other ranks to stop waiting for this one (best effort)."""

    def close(self) -> None:
        """Release what bind allocated."""


def check_part_bounds(view, bounds, replicas: int, rank: int) -> tuple[int, ...]:
    """`bounds` as a tuple, checked to cut `view`'s bytes into `replicas` parts of whole
    elements (0 first, the view's size last, never decreasing); a RingError naming them if not."""
    b = tuple(int(x) for x in bounds)
    size = np.dtype(view.dtype).itemsize
    if len(b) != replicas + 1 or b[0] != 0 or b[-1] != view.nbytes or \
            any(x > y or x % size for x, y in zip(b, b[1:])):
        raise RingError(f"rank {rank}: part bounds {b} do not cut {view.nbytes} bytes of "
                        f"{size}-byte elements into {replicas} parts", rank=rank)
    return b
