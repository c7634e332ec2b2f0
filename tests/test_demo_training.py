"""dataflow-demo's training-run flags: a run resumed with --resume continues exactly where its
checkpoint stopped, changed settings are refused, user data and validation work, and flag
mistakes exit 2 with one line."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import numpy as np
import pytest

from dataflow.cli.demo import main as demo_main

BASE = ["0.5", "0.25", "64", "tiny", "--backend", "numpy"]


def _run(capsys, *extra) -> tuple[int, dict | None, str]:
    capsys.readouterr()  # drop what came before (the rng fixture prints its seed)
    code = demo_main([*BASE, "--json", *extra])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def _digest(path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())
            if p.name.endswith(".bin")}


def test_demo_resume_continues_bit_identically(tmp_path, capsys, caplog):
    """4 steps saving every 2; then, from the step-2 checkpoint, --resume trains steps 3-4 with
    the same losses, lrs and grad norms, and saves the same weights and AdamW state."""
    caplog.set_level(logging.INFO, logger="dataflow.demo")
    ck = tmp_path / "ck"
    code, full, err = _run(capsys, "--steps", "4", "--save-every", "2", "--checkpoint-dir",
                           str(ck), "--warmup", "2")
    assert code == 0, err
    want_files = _digest(ck / "step_00000004")
    shutil.rmtree(ck / "step_00000004")  # as if the first run had stopped after step 2
    code, resumed, err = _run(capsys, "--steps", "4", "--save-every", "2", "--checkpoint-dir",
                              str(ck), "--warmup", "2", "--resume")
    assert code == 0, err
    assert "resumed from" in caplog.text and [s["step"] for s in resumed["steps"]] == [3, 4]
    pick = [(s["loss"], s["lr"], s["grad_norm"]) for s in full["steps"][2:]]
    assert [(s["loss"], s["lr"], s["grad_norm"]) for s in resumed["steps"]] == pick
    assert _digest(ck / "step_00000004") == want_files


def test_demo_resume_with_other_settings_exits_2_naming_them(tmp_path, capsys):
    """Resuming with another --steps past the warmup (so another cosine) is refused, not
    silently reset; inside a warmup longer than both runs the curve is the same, so the resume
    goes on."""
    ck, other = tmp_path / "ck", tmp_path / "other"
    assert _run(capsys, "--steps", "2", "--warmup", "1", "--save-every", "2", "--checkpoint-dir",
                str(ck))[0] == 0
    code, _, err = _run(capsys, "--steps", "5", "--warmup", "1", "--checkpoint-dir", str(ck),
                        "--resume")
    assert code == 2 and "schedule" in err and "Traceback" not in err
    assert _run(capsys, "--steps", "2", "--warmup", "10", "--save-every", "2",
                "--checkpoint-dir", str(other))[0] == 0
    code, resumed, _ = _run(capsys, "--steps", "3", "--warmup", "10", "--checkpoint-dir",
                            str(other), "--resume")
    assert code == 0 and [s["step"] for s in resumed["steps"]] == [3]
    assert resumed["steps"][0]["lr"] == pytest.approx(3 * 1e-3 / 10)


def test_demo_trains_on_user_data_with_validation(tmp_path, capsys, caplog, rng):
    """--data with a raw uint16 token file trains; --eval-every logs a validation loss."""
    caplog.set_level(logging.INFO, logger="dataflow.demo")
    path = tmp_path / "tokens.bin"
    rng.integers(0, 512, 20_000).astype(np.uint16).tofile(path)
    code, res, err = _run(capsys, "--steps", "2", "--data", str(path), "--eval-every", "1")
    assert code == 0, err
    assert caplog.text.count("validation loss") == 2 and len(res["steps"]) == 2
    assert all(s["grad_norm"] > 0 for s in res["steps"])
    assert [v["step"] for v in res["validation"]] == [1, 2]
    assert "4 held-out sequences" in caplog.text


def test_demo_eval_seqs_sets_the_held_out_rows(tmp_path, capsys, caplog, rng):
    """--eval-seqs N validates on N held-out rows: the --json document lists each validation's
    step and loss, and a different N gives a different held-out set (so another loss)."""
    caplog.set_level(logging.INFO, logger="dataflow.demo")
    path = tmp_path / "tokens.bin"
    rng.integers(0, 512, 20_000).astype(np.uint16).tofile(path)
    common = ["--steps", "2", "--data", str(path), "--eval-every", "2"]
    code, two, err = _run(capsys, *common, "--eval-seqs", "2")
    assert code == 0, err
    assert "2 held-out sequences" in caplog.text
    code, eight, err = _run(capsys, *common, "--eval-seqs", "8")
    assert code == 0, err
    assert "8 held-out sequences" in caplog.text
    assert [v["step"] for v in two["validation"]] == [2] == [v["step"] for v in eight["validation"]]
    assert two["validation"][0]["loss"] != eight["validation"][0]["loss"]
    assert np.isfinite(eight["validation"][0]["loss"])


@pytest.mark.parametrize("extra", [["--save-every", "2"], ["--resume"],
                                   ["--data", "/nonexistent/tokens.bin"],
                                   ["--max-grad-norm", "-1"], ["--min-lr", "1.0"],
                                   ["--eval-every", "1", "--eval-seqs", "0"]])
def test_demo_training_flag_mistakes_exit_2(extra, capsys):
    """Missing --checkpoint-dir, a missing --data file, a negative clip or min-lr above lr exit
    2 with one line and no traceback."""
    try:
        code = demo_main([*BASE, "--steps", "1", *extra])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()


def test_default_peak_lr_shrinks_with_width_above_1b():
    """The demo's peak lr: 1e-3 for the toy models, 3e-4 up to 1b's width, then 3e-4 * 2048 /
    width, which kept 8b's loss falling over its first 3 steps on the H100 (3e-4 made it rise)."""
    from dataflow.cli.demo_training import default_lr
    from dataflow.models.hf_config import model_config as get_model

    assert [default_lr(get_model(n).model_dim) for n in ("tiny", "small", "1b", "8b")] == \
        [1e-3, 1e-3, 3e-4, pytest.approx(1.5e-4)]
    assert default_lr(get_model("32b").model_dim) < 1.5e-4


def test_demo_fast_attention_plans_the_fast_backward_and_trains(capsys):
    """--fast-attention reaches the planner (the NumPy backend has one attention backward, so
    the losses equal the default run's)."""
    code, fast, _ = _run(capsys, "--steps", "1", "--fast-attention")
    assert code == 0 and fast["plan"]["attention_bwd"] == "fast"
    code, det, _ = _run(capsys, "--steps", "1")
    assert code == 0 and "attention_bwd" not in det["plan"]
    assert [s["loss"] for s in fast["steps"]] == [s["loss"] for s in det["steps"]]


def test_default_warmup_is_cut_to_short_runs_only_up_to_1b_width():
    from dataflow.cli.demo_training import default_warmup
    from dataflow.models.hf_config import model_config

    assert [default_warmup(model_config(n).model_dim, 3) for n in ("tiny", "1b", "8b")] == \
        [3, 3, 10]
    assert default_warmup(model_config("8b").model_dim, 40) == 10


def test_demo_json_and_log_carry_the_setup_phases(capsys, caplog):
    """--json has the engine's setup: its wall time and each phase (executor with the arenas,
    state zeroing, weight init, warm-up), which add up to at most the wall time; the log's
    'initialised' line names them too."""
    caplog.set_level(logging.INFO, logger="dataflow.demo")
    code, doc, err = _run(capsys, "--steps", "1")
    assert code == 0, err
    setup = doc["setup"]
    phases = setup["phases_s"]
    assert {"executor", "zero_state", "init_weights", "warm_up"} <= set(phases)
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) <= setup["init_s"] + 1e-6
    assert "initialised tiny in" in caplog.text and "warm_up" in caplog.text


def test_demo_trains_an_moe_directory_and_logs_the_router_losses(tmp_path, capsys, caplog):
    """An OLMoE Hugging Face directory trains on the NumPy backend; each step's line is
    followed by the router's load-balancing and z-loss (means over the step's rounds), and
    --json's steps carry them."""
    from dataflow.models.config import MoE, ModelConfig
    from dataflow.models.hf import save_pretrained
    from dataflow.models.init import init_model
    from dataflow.models.layout import BlockKind

    cfg = ModelConfig(name="olmoe-tiny", family="olmoe", vocab_size=256, model_dim=64,
                      head_dim=16, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=32,
                      rope_theta=1e4, norm_eps=1e-5, qk_norm=True,
                      moe=MoE(n_experts=4, top_k=2, expert_ffn_dim=32, norm_topk_prob=False,
                              router_aux_loss_coef=0.01))
    w = init_model(cfg, 3)
    blocks = [(BlockKind.EMBED, None, w.embed),
              *[(BlockKind.LAYER, i, b) for i, b in enumerate(w.layers)],
              (BlockKind.HEAD, None, w.head)]
    save_pretrained(cfg, blocks, tmp_path / "olmoe")
    caplog.set_level(logging.INFO, logger="dataflow.demo")
    capsys.readouterr()
    code = demo_main(["1", "0.5", "64", str(tmp_path / "olmoe"), "--backend", "numpy",
                      "--steps", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    steps = json.loads(out)["steps"]
    assert len(steps) == 2 and all(np.isfinite(s["aux_loss"]) for s in steps)
    assert "step 2: router load-balancing loss" in caplog.text


def test_demo_never_trains_a_models_text_on_byte_ids_unasked(tmp_path, capsys, caplog):
    """A model directory with a tokenizer of its own (here one the library cannot read), given
    a text file: exit 2 naming that tokenizer, before any work; --tokenizer bytes trains on byte
    ids as asked, saying so; a token file never needs a tokenizer."""
    from dataflow.engine import Engine

    with Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy") as eng:
        eng.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "train.txt").write_text("a user's own text, " * 100)
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, 2000))
    caplog.set_level(logging.INFO, logger="dataflow")
    base = ["2", "0.25", "64", str(tmp_path / "model"), "--steps", "1", "--backend", "numpy"]
    capsys.readouterr()
    assert demo_main(base + ["--data", str(tmp_path / "train.txt")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "tokenizers library" in err, err
    caplog.clear()
    assert demo_main(base + ["--data", str(tmp_path / "train.txt"), "--tokenizer", "bytes"]) == 0
    assert any("byte ids 0..255 as asked" in r.getMessage() for r in caplog.records)
    assert demo_main(base + ["--data", str(tmp_path / "ids.npy")]) == 0
