"""bench.hf_train_throughput (transformers' own training throughput, issue 41's baseline) on the
CPU with a small OLMoE shape: it builds the model from our config, keeps the largest batch that
fits, times the steps and reports tok/s. Needs torch and transformers (skipped without them, as
in CI)."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_transformers_trains_a_small_olmoe_and_the_record_says_how_fast(tmp_path):
    from dataflow.bench.hf_train_throughput import main
    from dataflow.models.config import load_config
    from dataflow.models.serial import to_json

    big = load_config("olmoe-1b-7b")
    cfg = dataclasses.replace(big, name="olmoe-mini", vocab_size=512, model_dim=64, head_dim=16,
                              n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=32,
                              moe=dataclasses.replace(big.moe, n_experts=4, top_k=2,
                                                      expert_ffn_dim=32))
    (tmp_path / "cfg.json").write_text(to_json(cfg))
    out = tmp_path / "hf.json"
    assert main([str(tmp_path / "cfg.json"), "--seqlen", "32", "--device", "cpu",
                 "--batches", "2", "--steps", "2", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["family"] == "olmoe" and rec["batch"] == 2 and rec["tokens_per_step"] == 64
    assert len(rec["step_times_s"]) == 2 and rec["tok_per_s"] > 0
    assert all(loss > 0 for loss in rec["losses"])
