"""The embedding's padding row on the GPU (CuPy backend): the CUDA op table's zero_rows_where_
equals the NumPy op bit for bit on fresh random rows, and a CuPy engine with pad_token_id leaves
that row where it was while training the others (tests/dataflow/test_pad_token.py: the NumPy
engine and the reference)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow import ops_numpy  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.models.config import load_config  # noqa: E402
from dataflow.models.layout import embed_layout  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
PAD = 5


def test_zero_rows_where_matches_numpy(rng):
    from dataflow.ops_cuda import CudaOps

    x = rng.standard_normal((257, 64)).astype(np.float32).astype(BF16)
    ids = rng.integers(0, 16, 257).astype(np.int32)
    ids[::7] = PAD
    want = x.copy()
    ops_numpy.zero_rows_where_(ids, want, PAD)
    dev = cp.asarray(x.view(np.uint16)).view(BF16)
    CudaOps.zero_rows_where_(cp.asarray(ids), dev, PAD)
    got = cp.asnumpy(dev.view(cp.uint16))
    assert np.array_equal(got, want.view(np.uint16))
    assert not np.array_equal(got, x.view(np.uint16))


def test_cupy_engine_leaves_the_padding_row(rng):
    cfg = dataclasses.replace(load_config("tiny"), n_layers=2, pad_token_id=PAD)
    with Engine(cfg, host_gb=2, dev_gb=2, seqlen=64, backend="cupy", lr=1e-2,
                max_grad_norm=None, seed=int(rng.integers(0, 2**31))) as eng:
        batch = rng.integers(0, cfg.vocab_size, (eng.seqs_per_step, 65))
        batch[:, ::4] = PAD
        before = embed_layout(cfg).view(eng.weights().embed, "embed_tokens").astype(np.float32)
        eng.train_step(batch)
        after = embed_layout(cfg).view(eng.weights().embed, "embed_tokens").astype(np.float32)
    assert np.array_equal(after[PAD], before[PAD])
    used = np.setdiff1d(np.unique(batch[:, :-1]), [PAD])
    assert not np.array_equal(after[used], before[used])
