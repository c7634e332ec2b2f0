"""A ring trains on a user's data as one device does (issue 52): dataflow-ring --data on a
Hugging Face directory with its own tokenizer reads the chat JSONL through the same data path as
dataflow-demo (tokenised once, assistant-only labels, records never attending across), and its
losses and weights equal one device's on the same batches bit for bit, both starting from the
directory's weights."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np

from dataflow.data.open_data import DataOptions, open_data
from dataflow.engine import Engine
from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.plan import Budget
from dataflow.ring.job import RingJob, model_config
from dataflow.ring.launch import launch
from tests.data.tokenizer_fixture import (  # noqa: F401 (fixtures are used by name)
    bpe_dir, hf_llama_dir, write_chat_jsonl)

CHUNKING = (("chunk_tokens", 128), ("chunks_per_round", 2), ("rounds_per_step", 2))


def test_ring_on_chat_data_matches_one_device_bit_for_bit(hf_llama_dir, tmp_path, rng):
    """A ring of 2 processes, 2 steps on 60 chat records (two of them in flight per chunk),
    against the Engine fed the same TokenBatches (tokens, labels, doc ids), both starting from the
    directory's own weights (not the seeded initialisation: a fine-tune)."""
    data = tmp_path / "chats.jsonl"
    write_chat_jsonl(data, rng, 60)
    options = DataOptions(cache_dir=str(tmp_path / "cache"), jobs=1)
    job = RingJob(gpus=2, model=str(hf_llama_dir), seqlen=64, host_gb=0.25, dev_gb=0.25,
                  steps=2, seed=int(rng.integers(0, 2**31)), data=f"text:{data}",
                  data_options=tuple(vars(options).items()), lr=1e-2, timeout_s=60,
                  out_dir=str(tmp_path / "out"), constraints=CHUNKING)
    cfg = model_config(job.model)
    plan = make_plan(cfg, job.seqlen, Budget.from_gib(job.host_gb, job.dev_gb),
                     get_profile("cpu"), **dict(job.constraints))
    source = open_data(data, job.seqlen, cfg.vocab_size, model=job.model, options=options)
    want = []
    with Engine.from_plan(plan, backend="numpy", seed=job.seed, lr=job.lr, weights=job.model,
                          max_grad_norm=job.max_grad_norm) as eng:
        for _ in range(job.steps):
            b = source.next_batch(plan.chunking.seqs_per_step)
            assert (b.labels == -100).any() and (b.labels != -100).any()
            want.append(eng.train_step(b.tokens, b.labels, doc_ids=b.doc_ids).loss)
        w = eng.weights()
    res = launch(job)
    assert res.exit_codes == (0, 0), res
    blocks = {"embed": w.embed, "head": w.head} | {f"layer{i}": b for i, b in enumerate(w.layers)}
    seen = set()
    for r in range(2):
        info = json.loads((tmp_path / "out" / f"rank{r}.json").read_text())
        assert info["losses"] == want, (r, info["losses"], want)
        with np.load(tmp_path / "out" / f"rank{r}.npz") as z:
            for key in z.files:
                got = z[key].view(ml_dtypes.bfloat16)
                assert np.array_equal(got.view(np.uint16), blocks[key].view(np.uint16)), key
                seen.add(key)
    assert seen == set(blocks)
    assert want[1] != want[0]
