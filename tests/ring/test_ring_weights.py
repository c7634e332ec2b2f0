"""A ring on a model directory starts from that directory's weights, as one device does (a
fine-tune, not the seeded initialisation): a saved dataflow model here (the Hugging Face case is
tests/ring/test_ring_data.py), each rank reading only its own blocks."""

from __future__ import annotations

import json

import numpy as np

from dataflow.engine import Engine
from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.models.config import load_config
from dataflow.models.init import init_model
from dataflow.models.serial import to_json
from dataflow.models.storage import save_model
from dataflow.ring.job import RingJob, batches, model_config, model_weights_dir
from dataflow.ring.launch import launch


def test_a_ring_on_a_saved_model_starts_from_its_weights(tmp_path, rng):
    cfg = load_config("tiny")
    model = save_model(init_model(cfg, int(rng.integers(0, 2**31))), tmp_path / "model")
    assert model_weights_dir(str(model)) == model and model_weights_dir("tiny") is None
    # A worker gets an inline JSON config longer than a file name may be (the GPU MoE ring test
    # found ENAMETOOLONG raised from Path.is_dir); it names no directory.
    assert model_weights_dir(to_json(load_config("olmoe-1b-7b")) + " " * 300) is None
    assert model_weights_dir("x" * 5000) is None
    seed = int(rng.integers(0, 2**31))
    job = RingJob(gpus=2, model=str(model), seqlen=64, host_gb=0.5, dev_gb=0.25, steps=2,
                  seed=seed, data=f"random:{seed}", lr=1e-2, max_grad_norm=None,
                  timeout_s=60, out_dir=str(tmp_path / "out"), save_weights=False,
                  constraints=(("chunk_tokens", 128), ("chunks_per_round", 2),
                               ("rounds_per_step", 2)))
    res = launch(job)
    assert res.exit_codes == (0, 0), res
    ring = json.loads((tmp_path / "out" / "rank0.json").read_text())["losses"]
    plan = make_plan(model_config(job.model), job.seqlen, Budget.from_gib(0.5, 0.25),
                     get_profile("cpu"), **dict(job.constraints))
    want = {}
    for weights in (str(model), None):  # the directory's weights, and the seeded init
        with Engine.from_plan(plan, backend="numpy", seed=seed, lr=job.lr, weights=weights,
                              max_grad_norm=None) as eng:
            want[weights] = [eng.train_step(b).loss
                             for b in batches(job, cfg, plan.chunking.seqs_per_step)]
    assert ring == want[str(model)] != want[None]
    assert np.isfinite(ring).all()
