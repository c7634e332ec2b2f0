"""The on-disk cuDNN graph cache (dataflow.kernels.cuda.graph_cache) through the attention ops: a second
process deserialises every SDPA graph the first one built (forward, deterministic and atomic
backward, an offset chunk, an unmasked key block) and gets the same outputs (bit-identical from
the forward and the deterministic backward; the atomic backward sums dQ in any order, so there
to bf16 rounding); with the cache off every graph is built again. Each run is a fresh process (a cache hit must really come from
disk, not from this process's graphs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dataflow.backends.cupy_backend import gpu_available
from tests.gpu import random_bf16_preamble

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and CuPy")]

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = random_bf16_preamble(11) + textwrap.dedent("""
    import json, sys, time
    from dataflow.kernels import cuda as K
    from dataflow.settings import settings_from_env

    ctx = K.CudaContext(cudnn_cache_dir=settings_from_env().cudnn_cache_dir)
    t, h, kh, e = 512, 8, 2, 128
    outs = {}
    t0 = time.perf_counter()
    for name, q_off, s, causal, det in (("self", 0, 512, True, True),
                                        ("self_atomic", 0, 512, True, False),
                                        ("offset", 512, 1024, True, False),
                                        ("block", 0, 768, False, False)):
        q, k, v = bf((t, h, e)), bf((s, kh, e)), bf((s, kh, e))
        o, lse = cp.empty((t, h, e), BF16), cp.empty((h, t), cp.float32)
        if causal:
            K.attention_fwd(ctx, q, k, v, q_off, o, lse, impl="cudnn")
        else:  # an unmasked block's backward takes o, lse of the whole attention: any will do
            o, lse = bf((t, h, e)), cp.asarray(rng.standard_normal((h, t)), cp.float32)
        do = bf((t, h, e))
        dq, dk, dv = cp.empty((t, h, e), BF16), cp.empty((s, kh, e), BF16), \\
            cp.empty((s, kh, e), BF16)
        K.attention_bwd(ctx, q, k, v, o, lse, do, q_off, dq, dk, dv, impl="cudnn",
                        deterministic=det, causal=causal)
        for part, a in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            outs[f"{name}.{part}"] = cp.asnumpy(a.view(cp.uint16) if a.dtype == BF16 else a)
    cp.cuda.runtime.deviceSynchronize()
    seconds = time.perf_counter() - t0
    np.savez(sys.argv[1], **outs)
    print(json.dumps({"sources": ctx.graph_sources(), "seconds": seconds}))
""")


def _run(tmp_path, cache: str, name: str) -> tuple[dict, dict]:
    env = {**__import__("os").environ, "DATAFLOW_CUDNN_CACHE_DIR": cache}
    out = tmp_path / f"{name}.npz"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(out) as z:
        return report, {k: z[k] for k in z.files}


def test_a_second_process_loads_every_graph_from_disk_and_computes_the_same_bits(tmp_path):
    cache = str(tmp_path / "cudnn")
    first, want = _run(tmp_path, cache, "first")
    assert first["sources"] == {"built": 6, "cache": 0}, first
    assert len(list(Path(cache).glob("*.cudnn"))) == 6
    second, got = _run(tmp_path, cache, "second")
    assert second["sources"] == {"built": 0, "cache": 6}, second
    off, again = _run(tmp_path, "off", "off")
    assert off["sources"] == {"built": 6, "cache": 0}, off
    print(f"graphs: built {first['seconds']:.2f} s, from disk {second['seconds']:.2f} s")
    for key, a in want.items():
        for other in (got[key], again[key]):
            if key.startswith("self.") or key.endswith((".o", ".lse")):
                np.testing.assert_array_equal(other, a, err_msg=key)
            else:
                np.testing.assert_allclose(_f32(other), _f32(a), rtol=2e-2, atol=2e-2,
                                           err_msg=key)


def _f32(bits: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return bits.view(ml_dtypes.bfloat16).astype(np.float32) if bits.dtype == np.uint16 else bits
