"""Frozen blocks through the Engine and the command lines (issue 54, first step): Engine(freeze=)
plans and trains them frozen, its state_dict and checkpoints hold weights alone for them, a
resume with another frozen set is refused by name, and dataflow-plan / dataflow-demo take
--freeze (and refuse a bad spec with exit code 2)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dataflow.cli.demo import main as demo_main
from dataflow.cli.plan import main as plan_main
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.init import init_model
from dataflow.reference_trainer import ReferenceTrainer

SPEC = "embed,layers:0"
BUDGET = dict(host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy", seed=11)


def _batch(eng, step: int):
    ch = eng.plan.chunking
    return token_stream(ch.seqlen, ch.seqs_per_step, eng.plan.model.vocab_size,
                        start=97 + step * ch.seqs_per_step * ch.seqlen)


def test_engine_freeze_trains_only_the_unfrozen_blocks():
    """Engine(freeze=) plans the frozen set; after two steps the frozen blocks are unchanged
    and the trained ones moved."""
    with Engine("tiny", freeze=SPEC, **BUDGET) as eng:
        assert eng.plan.frozen.spec() == SPEC
        before = eng.weights()
        for s in range(2):
            eng.train_step(_batch(eng, s))
        after = eng.weights()
    assert np.array_equal(before.embed.view(np.uint16), after.embed.view(np.uint16))
    assert np.array_equal(before.layers[0].view(np.uint16), after.layers[0].view(np.uint16))
    assert not np.array_equal(before.layers[1].view(np.uint16), after.layers[1].view(np.uint16))
    assert not np.array_equal(before.head.view(np.uint16), after.head.view(np.uint16))


def test_state_dict_and_checkpoint_hold_weights_only_for_frozen_blocks(tmp_path):
    """No AdamW m / v of a frozen block in the state_dict or the checkpoint's files; resuming
    with the same set continues bit for bit like the run that did not stop, and another set is
    refused by name."""
    with Engine("tiny", freeze=SPEC, **BUDGET) as eng:
        eng.train_step(_batch(eng, 0))
        sd = eng.state_dict()
        path = eng.save_checkpoint(tmp_path / "ckpt")
        eng.train_step(_batch(eng, 1))
        straight = eng.weights()
    assert "model.embed_tokens.weight" in sd
    assert not any(k.startswith("optimizer.model.embed_tokens") for k in sd)
    assert not any(k.startswith("optimizer.model.layers.0.") for k in sd)
    assert any(k.startswith("optimizer.model.layers.1.") for k in sd)
    meta = json.loads((path / "checkpoint.json").read_text())
    parts = {(f["block"], f["part"]) for f in meta["files"] if "part" in f}
    assert ("embed", "weights") in parts and ("embed", "m") not in parts
    assert ("layers.0", "v") not in parts and ("layers.1", "v") in parts
    assert meta["frozen"] == SPEC
    with Engine(path, freeze=SPEC, **BUDGET) as eng:
        eng.train_step(_batch(eng, 1))
        resumed = eng.weights()
    for a, b in zip([straight.embed, *straight.layers, straight.head],
                    [resumed.embed, *resumed.layers, resumed.head]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    with pytest.raises(ConfigError, match="trained with frozen blocks 'embed,layers:0', this "
                                          "engine freezes 'none'; resume with freeze="):
        Engine(path, **BUDGET)


def test_reading_a_frozen_blocks_adamw_state_is_refused_by_name():
    from dataflow.engine import BlockRef
    from dataflow.models.layout import BlockKind

    with Engine("tiny", freeze=SPEC, **BUDGET) as eng:
        with pytest.raises(ConfigError, match="block embed is frozen"):
            eng.read_block(BlockRef(BlockKind.EMBED), "m")


def test_dataflow_plan_takes_freeze_and_refuses_a_bad_spec(capsys):
    """--freeze shows in the explanation and the JSON; a bad item exits 2 naming it."""
    assert plan_main(["1", "0.25", "64", "tiny", "--gpu", "cpu", "--freeze", SPEC]) == 0
    out = capsys.readouterr().out
    assert "Frozen: embedding and 1 of 2 layers (0)" in out
    assert plan_main(["1", "0.25", "64", "tiny", "--gpu", "cpu", "--freeze", SPEC,
                      "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["frozen"]["layers"] == [0]
    assert plan_main(["1", "0.25", "64", "tiny", "--gpu", "cpu", "--freeze", "layers:7"]) == 2
    assert "layer 7 is outside 0-1" in capsys.readouterr().err


def test_dataflow_demo_trains_with_freeze(capsys):
    """dataflow-demo --freeze runs its steps with the frozen plan (its --json result names the
    plan's hash, which differs from the unfrozen plan's)."""
    argv = ["1", "0.25", "64", "tiny", "--backend", "numpy", "--steps", "2", "--json"]
    assert demo_main(argv + ["--freeze", "head,layers:1"]) == 0
    frozen = json.loads(capsys.readouterr().out)
    assert demo_main(["1", "0.25", "64", "tiny", "--backend", "numpy", "--freeze", "hed"]) == 2
    assert "'hed' is not understood" in capsys.readouterr().err
    assert frozen["plan_hash"]


BASE = ModelConfig(name="odd", vocab_size=300, model_dim=64, head_dim=16, n_layers=3, n_heads=4,
                   n_kv_heads=2, ffn_dim=96, rope_theta=5e4, norm_eps=1e-6)
FAMILIES = {
    "llama": BASE,
    "qwen2": dataclasses.replace(BASE, name="qwen2-odd", family="qwen2", attention_bias=True),
    "qwen3": dataclasses.replace(BASE, name="qwen3-odd", family="qwen3", qk_norm=True,
                                 head_dim=32),
    "tied": dataclasses.replace(BASE, name="tied-odd", tie_embeddings=True),
}


@pytest.mark.parametrize("family,spec,options", [
    ("qwen2", "layers:1,head", {}),                       # biases' gradients skipped
    ("qwen3", "embed,layers:0", {}),                      # QK-norm weights' gradients skipped
    ("tied", "embed,head,layers:2", {}),                  # one table, frozen as one
    ("llama", "layers:0-1", {"backward_update": True, "max_grad_norm": None}),
    ("llama", "embed,layers:2", {"deferred_update": False, "max_grad_norm": 0.5}),
])
def test_families_and_update_modes_match_the_reference_when_frozen(family, spec, options, rng):
    """Biased and QK-normed projections, a tied table, the update inside the backward and at
    the end of the step (with clipping over the trained blocks only): frozen blocks keep their
    bits over three steps, trained ones track ReferenceTrainer(frozen=) within 10 %."""
    cfg = FAMILIES[family]
    seed = int(rng.integers(0, 2**31))
    clip = options.get("max_grad_norm", 1.0)
    with Engine(cfg, host_gb=1, dev_gb=0.25, seqlen=32, backend="numpy", seed=seed, lr=1e-3,
                freeze=spec, sanitize=True, **options) as eng:
        ch = eng.plan.chunking
        batches = [rng.integers(0, cfg.vocab_size, (ch.seqs_per_step, ch.seqlen + 1))
                   for _ in range(3)]
        losses = [eng.train_step(b).loss for b in batches]
        got = eng.weights()
    ref = ReferenceTrainer(cfg, init_model(cfg, seed), lr=1e-3, frozen=spec,
                           max_grad_norm=clip or None)
    ref_losses = [ref.train_step(b).loss_mean for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2, err_msg=f"seed {seed}")
    start = init_model(cfg, seed)
    for i, (g, want, s, trains) in enumerate(zip([got.embed, *got.layers, got.head], ref.blocks,
                                                 [start.embed, *start.layers, start.head],
                                                 ref.trains)):
        if not trains:
            assert np.array_equal(g.view(np.uint16), s.view(np.uint16)), (i, seed)
            continue
        d_got, d_want = g.astype(np.float64) - s, want.astype(np.float64) - s
        err = np.linalg.norm(d_got - d_want) / np.linalg.norm(d_want)
        # 10 %, not test_frozen.py's 5 %: these 3-layer shapes at 64 sequences a step show
        # 4.5-6.6 % unfrozen already (AdamW's first steps turn bf16 rounding into sign flips)
        assert err < 0.10, f"{family} {spec} block {i}: {err:.3%} (seed {seed})"


def test_a_tied_model_freezes_embed_and_head_together():
    with pytest.raises(ConfigError, match="ties its head to the embedding .* freeze both or "
                                          "neither"):
        Engine(FAMILIES["tied"], host_gb=1, dev_gb=0.25, seqlen=32, backend="numpy",
               freeze="embed")


def test_eval_step_runs_with_a_frozen_head():
    """Evaluation reads a frozen head's weights and forms no gradient: the loss is the one
    train_step reports for the same batch before its update."""
    with Engine("tiny", freeze="head,layers:1", **BUDGET) as eng:
        batch = _batch(eng, 0)
        loss = eng.eval_step(batch)
        assert eng.train_step(batch).loss == pytest.approx(loss, rel=1e-6)


def test_a_ring_with_freeze_is_refused_by_name():
    """Rings are not built for frozen blocks yet: refused before any process starts."""
    from dataflow.ring.engine import Ring  # test-only: the ring's public entry point

    with pytest.raises(ConfigError, match="freeze= is built for one device so far"):
        Engine("tiny", ring=Ring(), freeze="head", **BUDGET)


def test_a_whole_models_state_dict_loads_into_a_frozen_engine():
    """The frozen blocks take their weights and pass over their AdamW keys; the trained ones
    take weights, m and v; the frozen engine's own state_dict loads back bit for bit."""
    with Engine("tiny", **BUDGET) as whole:
        whole.train_step(_batch(whole, 0))
        state = whole.state_dict()
        want = whole.weights()
    with Engine("tiny", freeze=SPEC, **BUDGET) as eng:
        eng.load_state_dict(state)
        got = eng.weights()
        for a, b in zip([want.embed, *want.layers, want.head],
                        [got.embed, *got.layers, got.head]):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
        mine = eng.state_dict()
        assert mine["optimizer.step"] == state["optimizer.step"]
        key = "optimizer.model.layers.1.mlp.up_proj.weight.exp_avg"
        assert np.array_equal(mine[key].view(np.uint16), state[key].view(np.uint16))
        eng.load_state_dict(mine)
        again = eng.state_dict()
    assert sorted(again) == sorted(mine)
    for k in mine:
        assert np.asarray(again[k]).tobytes() == np.asarray(mine[k]).tobytes(), k
