"""A ring rank's host memory at setup: everything it keeps lives in the plan's slab, and setting
up passes through no block-sized temporary beside it (a rank on the GPUs once initialised every
block into a fresh array while still holding the last one: two blocks of RSS outside the plan,
0.8 GiB on 8b, 1.8-2.4 GiB on 32b). Measured in a fresh process, whose peak RSS is reset once
imports and numba's kernels are loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, re, sys

from dataflow.backends import make_backend
from dataflow.models.config import ModelConfig, load_config
from dataflow.models.layout import embed_layout, layer_layout
from tests.ring.small_rings import lone_rank


def status(key):
    text = open("/proc/self/status").read()
    return int(re.search(key + r":\s+(\d+)", text).group(1)) << 10


def rank_of(cfg):
    return lone_rank(cfg, make_backend("numpy"))


rank_of(load_config("tiny")).close()  # imports, numba's init and host kernels: loaded now
d, f, v = map(int, sys.argv[1:4])
cfg = ModelConfig(name="wide", vocab_size=v, model_dim=d, head_dim=64, n_layers=2,
                  n_heads=d // 64, n_kv_heads=d // 64, ffn_dim=f, rope_theta=1e4, norm_eps=1e-5)
try:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
except OSError as exc:
    print(json.dumps({"no_reset": str(exc)}))
    sys.exit(0)
start = status("VmRSS")
rank = rank_of(cfg)
print(json.dumps({"start": start, "peak": status("VmHWM"), "end": status("VmRSS"),
                  "layer_bytes": layer_layout(cfg).numel * 2,
                  "embed_bytes": embed_layout(cfg).numel * 2,
                  "host_bytes": rank.rp.plan.memory.host_bytes}))
rank.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_ring_rank_setup_passes_through_no_block_sized_temporary():
    """Setting up a ring rank whose blocks all live at home (layers of 56 MiB, embedding and
    head of 64 MiB) peaks less than a quarter of a layer block above the RSS it keeps once set
    up: each block is initialised straight into its home copy. A temporary per block peaked
    one layer block (56 MiB) above it here, two blocks above the slab on the GPUs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, "1024", "8192", "32768"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if "no_reset" in got:
        pytest.skip(f"cannot reset the peak RSS (/proc/self/clear_refs): {got['no_reset']}")
    mib = 1 << 20
    over = got["peak"] - got["end"]
    assert got["end"] - got["start"] > 2 * got["layer_bytes"], (
        f"setup kept only {(got['end'] - got['start']) / mib:.1f} MiB: the test measures nothing")
    assert over < got["layer_bytes"] // 4, (
        f"setup peaked {over / mib:.1f} MiB above the {(got['end'] - got['start']) / mib:.1f} MiB "
        f"it keeps (a layer block is {got['layer_bytes'] / mib:.1f} MiB, the embedding "
        f"{got['embed_bytes'] / mib:.1f} MiB): a block passed through a host temporary")
