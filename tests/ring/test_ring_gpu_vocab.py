"""The vocabulary-parallel head on the CuPy backend (issue 56, "one GPU"): rings of 2, 3 and 4 ranks
sharing one GPU through the shared-memory transport, each holding its share of the lm_head rows
(RankPlan.vocab_parallel, the CUDA vocab_* ops of kernels/cuda/head_vocab), against the Engine on
the same GPU, within the bound the NumPy rings state (tests/ring/test_ring_vocab_head.py,
docs/ring.md): the first loss within 1e-6 relative, later ones within 3e-4, every block's weights
within relative L2 steps * 2^-8 (the head assembled from the shards). GPU only. Rings of 3 and 4
were added in the thirty-eighth session and have not yet run on a GPU (the same jobs ran on the
NumPy backend through the same RingJob path)."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow.ring.job import RingJob, model_config  # noqa: E402
from dataflow.ring.kinds import TransportKind  # noqa: E402
from dataflow.ring.launch import launch  # noqa: E402
from dataflow.ring.rank import whole_head  # noqa: E402
from tests.ring.test_ring_gpu import CHUNKING, DEV_GB, HOST_GB, _single_device  # noqa: E402

FP32_LOSS_REL = 1e-6
"""The first step's loss: the same weights, only the head's fp32 sums split over the shards."""


def _ring(job: RingJob):
    """Each rank's losses and the blocks' weights as bf16, the head whole from the shards."""
    res = launch(job)
    assert res.exit_codes == (0,) * job.gpus, res
    losses, blocks, shards, head_rank = [], {}, {}, None
    for r in range(job.gpus):
        with open(os.path.join(job.out_dir, f"rank{r}.json")) as f:
            info = json.load(f)
        losses.append(info["losses"])
        head_rank = r if info["has_head"] else head_rank
        with np.load(os.path.join(job.out_dir, f"rank{r}.npz")) as z:
            for key in z.files:
                if key == "head":
                    shards[r] = z[key].view(ml_dtypes.bfloat16)
                else:
                    blocks[key] = z[key].view(ml_dtypes.bfloat16)
    assert sorted(shards) == list(range(job.gpus)) and head_rank is not None
    blocks["head"] = whole_head(model_config(job.model), job.gpus, head_rank, shards)
    return losses, blocks


@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_vocab_parallel_ring_sharing_one_gpu_matches_one_device(tmp_path, gpus):
    """`small` (4 layers) at seqlen 256, 3 steps, clipping on: every rank's losses and every
    block's weights within the bound against the Engine on one GPU."""
    job = RingJob(gpus=gpus, model="small", seqlen=256, host_gb=HOST_GB, dev_gb=DEV_GB / 2, steps=3,
                  seed=7, data="random:15", lr=1e-3, backend="cupy", transport=TransportKind.SHM,
                  timeout_s=120, out_dir=str(tmp_path), constraints=CHUNKING,
                  vocab_parallel_head=True)
    want_losses, want = _single_device(job, DEV_GB)
    losses, got = _ring(job)
    for row in losses:
        assert len(row) == job.steps
        np.testing.assert_allclose(row[0], want_losses[0], rtol=FP32_LOSS_REL)
        np.testing.assert_allclose(row, want_losses, rtol=3e-4)
    assert sorted(got) == sorted(want)
    for key in want:
        a, b = got[key].astype(np.float64), np.asarray(want[key]).astype(np.float64)
        assert np.linalg.norm(a - b) <= job.steps * 2.0**-8 * np.linalg.norm(b), key
