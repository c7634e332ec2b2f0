"""The device sub-block norms of replicas (dataflow.ring.executor.device_norm_sums, the path the
CuPy backend takes: each block's sub-block sums by the `sumsq_blocks` op, copied to a pinned
buffer and added exactly by a host function on the compute stream), forced on the NumPy backend,
where the op is norm_parts.sub_block_sums: split and unsplit replicas give the bits of the
backend's own exact sumsq path, losses, gradient norms (clipping active) and weights, and the
sanitizing backend finds no race between the sums, their copy and the host function. The CUDA
kernel itself: tests/kernels/test_cuda_sumsq_blocks.py (GPU)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataflow.backends import make_backend
from dataflow import ops_numpy
from dataflow.ops_numpy import sumsq_blocks
from dataflow.memplan.plan.plan import GradAccum
from dataflow.memplan.plan.split import SUB_BLOCK
from dataflow.norm_parts import sub_block_sums
from dataflow.ring import executor as ring_executor
from dataflow.ring.nccl import NcclTransport
from dataflow.ring.shm import SharedMemoryTransport
from tests.ring import test_split_update as one_ring
from tests.ring import test_split_update_rings as rings


def _same(a, b) -> None:
    """Two runs' per-process (losses, norms, weights, state) bit for bit."""
    assert len(a) == len(b)
    for i, ((al, an, aw, _), (bl, bn, bw, _)) in enumerate(zip(a, b)):
        assert al == bl and an == bn, (i, al, bl, an, bn)
        assert sorted(aw) == sorted(bw)
        for key in aw:
            assert np.array_equal(np.asarray(aw[key]).view(np.uint16),
                                  np.asarray(bw[key]).view(np.uint16)), (i, key)


@pytest.fixture
def forced(monkeypatch):
    """Every rank with replicas takes the device-sums path, as on CuPy; the list of the
    replica counts it was asked for, then the sizes the sumsq_blocks op was launched on."""
    calls = []

    def force(be, rp, transport):
        calls.append(rp.replicas)
        return rp.replicas > 1

    def counted(x, out):
        calls.append(("sumsq_blocks", x.size))
        sumsq_blocks(x, out)  # the op itself (imported before the patch)
    monkeypatch.setattr(ring_executor, "device_norm_sums", force)
    monkeypatch.setattr(ops_numpy, "sumsq_blocks", counted)  # the NumPy backend's table
    return calls


def test_numpy_sumsq_blocks_is_norm_parts_sub_block_sums(rng):
    """The op's truth: one float64 sum of squares per 1,024 elements, the last one short."""
    x = rng.standard_normal(3 * SUB_BLOCK + 77).astype(np.float32)
    out = np.full(4, np.nan)
    sumsq_blocks(x, out)
    assert np.array_equal(out, sub_block_sums(x))


@pytest.mark.parametrize("where,replicas", [("resident", 2), ("streamed", 3)])
def test_device_norm_sums_give_the_exact_sumsq_bits_split_and_unsplit(rng, forced, where,
                                                                      replicas):
    """R replicas of a ring of 1 on the device-sums path (the op launched on every layer's
    and the head's gradient, or its part), split and unsplit: the same losses, gradient
    norms (clipping active) and weights over 3 steps."""
    seed = int(rng.integers(0, 2**31))
    data = [rng.integers(0, one_ring.CFG.vocab_size, (4 * replicas, 65), dtype=np.int32)
            for _ in range(3)]
    kw = dict(replicas=replicas, grad_accum=GradAccum.FP32)
    unsplit = one_ring._train(one_ring._rank_plan(where, split=False, **kw), data, seed, True)
    split = one_ring._train(one_ring._rank_plan(where, split=True, **kw), data, seed, True)
    asked = [c for c in forced if not isinstance(c, tuple)]
    sizes = [c[1] for c in forced if isinstance(c, tuple)]
    assert asked and all(r == replicas for r in asked)
    whole = max(sizes)  # a part of the largest block is about 1 / R of it
    assert any(n <= -(-whole // (SUB_BLOCK * replicas)) * SUB_BLOCK for n in sizes)
    _same(unsplit, split)
    assert min(unsplit[0][1]) > 0.05  # clipping was on and active


def test_device_norm_sums_equal_the_host_path(rng, monkeypatch):
    """The forced device path's bits are the NumPy path's (the same sub-block sums, added
    exactly): 2 replicas of a ring of 1, unsplit, with and without it."""
    seed = int(rng.integers(0, 2**31))
    data = [rng.integers(0, one_ring.CFG.vocab_size, (8, 65), dtype=np.int32)
            for _ in range(3)]
    rp = one_ring._rank_plan("resident", split=False, replicas=2)
    plain = one_ring._train(rp, data, seed, True)
    monkeypatch.setattr(ring_executor, "device_norm_sums", lambda be, rp, tr: rp.replicas > 1)
    _same(one_ring._train(rp, data, seed, True), plain)


def test_device_norm_sums_of_split_rings_are_race_free(rng, forced):
    """2 replicas of a ring of 3 (streamed layers and head) on the sanitizing backend, split
    against unsplit, both through the device sums: bit for bit, no race reported."""
    cfg, rps = rings._plans(3, 2, 3, streamed=True, vocab=False, overlap=0)
    seed = int(rng.integers(0, 2**30))
    rows = rps[0].plan.chunking.seqs_per_step * 2
    data = [rng.integers(0, cfg.vocab_size, (rows, 65), dtype=np.int32) for _ in range(3)]
    want = rings._train(rps, data, seed, split=False, sanitize=True)
    got = rings._train(rps, data, seed, split=True, sanitize=True)
    assert forced
    _same(want, got)


def test_backends_take_the_device_path_only_with_replicas_over_shared_memory():
    """CuPy-like backends (device memory the host cannot read) with replicas over a transport
    that splits updates: shared memory always, NCCL for split updates only (its unsplit
    replicas keep the kernel); never NumPy, never without replicas, never over a transport
    without reduce-scatter, never the null backend (no op table)."""
    rp = one_ring._rank_plan("resident", split=False, replicas=2)
    one = dataclasses.replace(rp, replicas=1)
    shm, nccl = SharedMemoryTransport, NcclTransport

    class Device:
        device_is_host_memory = False
        ops = object()
    class NoSplit:
        splits_updates = False
    assert shm.splits_updates and nccl.splits_updates
    assert shm.split_bits_promised and not nccl.split_bits_promised
    assert ring_executor.device_norm_sums(Device(), rp, shm)
    # NCCL: a split update needs the exact part sums; unsplit replicas keep the kernel
    assert ring_executor.device_norm_sums(Device(), dataclasses.replace(rp, split_update=True),
                                          nccl)
    assert not ring_executor.device_norm_sums(Device(), rp, nccl)
    assert not ring_executor.device_norm_sums(Device(), one, shm)
    assert not ring_executor.device_norm_sums(Device(), rp, NoSplit)
    assert not ring_executor.device_norm_sums(Device(), rp, None)
    assert not ring_executor.device_norm_sums(make_backend("numpy"), rp, shm)
    assert not ring_executor.device_norm_sums(make_backend("null"), rp, shm)
