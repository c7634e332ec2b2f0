"""Split updates on the CuPy backend (issue 56, "one GPU"): 2, 3 and 4 data-parallel replicas of a
ring of 1 sharing one GPU through the shared-memory transport, each updating its part of every layer
and the head (RankPlan.split_update), against the same replicas unsplit. Both runs take the device
sub-block norms (dataflow.ring.executor.device_norm_sums: sumsq_blocks on the GPU, added exactly on
the host), so the clip norm, and with it every bit, must agree. GPU only; the same job on the NumPy
backend: tests/ring/test_split_update_launch.py. Rings of 3 and 4 were added in the thirty-eighth
session and have not yet run on a GPU (the same jobs ran on the NumPy backend through the same
RingJob path)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.memplan.plan.plan import GradAccum  # noqa: E402
from dataflow.ring.job import RingJob  # noqa: E402
from dataflow.ring.kinds import TransportKind  # noqa: E402
from dataflow.ring.launch import launch  # noqa: E402

MAX_NORM = 0.05
"""Below every step's gradient norm of `small` here, so clipping is active."""


def _run(job: RingJob):
    """Each process's (losses, gradient norms, its rank json) and the blocks' weights (uint16
    bits; replicas must agree exactly)."""
    res = launch(job)
    assert res.exit_codes == (0,) * job.gpus, res
    runs, blocks = [], {}
    for r in range(job.gpus):
        with open(os.path.join(job.out_dir, f"rank{r}.json")) as f:
            info = json.load(f)
        runs.append((info["losses"], info["grad_norms"], info))
        with np.load(os.path.join(job.out_dir, f"rank{r}.npz")) as z:
            for key in z.files:
                if key in blocks:
                    assert np.array_equal(z[key], blocks[key]), (r, key)
                blocks[key] = z[key]
    return runs, blocks


@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_split_replicas_sharing_one_gpu_equal_unsplit_replicas_bit_for_bit(tmp_path, gpus):
    """`small` at seqlen 256, 3 steps, clipping active: every replica's losses and gradient
    norms and the final weights of every block are the unsplit replicas' bit for bit, and the
    split run holds AdamW state for one part of `gpus`."""
    job = RingJob(gpus=gpus, model="small", seqlen=256, host_gb=2.0, dev_gb=1.0, steps=3, seed=6,
                  data="random:14", lr=1e-3, max_grad_norm=MAX_NORM, backend="cupy",
                  transport=TransportKind.SHM, grad_accum=GradAccum.FP32, replicas=gpus,
                  timeout_s=120, out_dir=str(tmp_path / "whole"),
                  constraints=(("chunk_tokens", 256), ("chunks_per_round", 1),
                               ("rounds_per_step", 2)))
    want, want_w = _run(job)
    got, got_w = _run(dataclasses.replace(job, split_update=True,
                                          out_dir=str(tmp_path / "split")))
    for (wl, wn, wi), (gl, gn, gi) in zip(want, got):
        assert gl == wl and gn == wn, (gl, wl, gn, wn)
        assert min(gn) > MAX_NORM, gn  # clipping was on and active
        assert gi["split_update"] is True and gi["state_parts"] == gpus
        assert wi["split_update"] is False
    assert sorted(got_w) == sorted(want_w)
    for key in want_w:
        assert np.array_equal(got_w[key], want_w[key]), key
