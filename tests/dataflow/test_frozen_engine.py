"""Frozen blocks through the Engine and the command lines (issue 54, first step): Engine(freeze=)
plans and trains them frozen, its state_dict and checkpoints hold weights alone for them, a
resume with another frozen set is refused by name, and dataflow-plan / dataflow-demo take
--freeze (and refuse a bad spec with exit code 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataflow.cli.demo import main as demo_main
from dataflow.cli.plan import main as plan_main
from dataflow.data import token_stream
from dataflow.engine import Engine
from dataflow.models.errors import ConfigError

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
