"""dataflow-sweep with --lora-rank / --lora-alpha / --lora-targets: every cell is planned with
the adapters (its plan file holds them and its record says so), run by the demo on the NumPy
backend with a tiny model, and a sweep directory holds one LoRA setting; bad flags exit 2."""

import json

import pytest

from dataflow.bench.sweep.table import read_table
from dataflow.cli.sweep import main

TINY = ["run", "--model", "tiny", "--seqlen", "128", "--host", "1", "--dev", "0.25,0.5",
        "--steps", "1", "--backend", "numpy"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,v"]
FLAGS = "--lora-rank 4 --lora-alpha 8 --lora-targets q,v"


def test_a_lora_sweep_plans_and_trains_every_cell_with_the_adapters(tmp_path):
    """Each cell's plan carries the Lora, its demo trains it (status ok) and the lora column
    names the flags."""
    assert main([*TINY, *LORA, "--out", str(tmp_path)]) == 0
    rows = read_table(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert r.status == "ok" and r.lora == FLAGS and r.tok_per_s > 0, r
        plan = json.loads((tmp_path / "plans" / f"{r.plan_hash}.json").read_text())
        assert plan["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q", "v"]}
        assert plan["frozen"]["embed"] and plan["frozen"]["head"]


def test_a_lora_sweep_directory_refuses_a_resume_with_other_adapters(tmp_path, capsys):
    """A directory of LoRA cells refuses a resume without them (or with another rank) by name,
    and a plain directory refuses LoRA; predictions differ with and without adapters."""
    base = ["run", "--model", "8b", "--seqlen", "8192", "--host", "64", "--dev", "24",
            "--predict-only", "--gpu", "h200"]
    assert main([*base, "--lora-rank", "16", "--out", str(tmp_path / "l")]) == 0
    assert main([*base, "--out", str(tmp_path / "f")]) == 0
    (lora,), (full,) = read_table(tmp_path / "l"), read_table(tmp_path / "f")
    assert lora.lora == "--lora-rank 16 --lora-alpha 16 --lora-targets q,k,v,o,gate,up,down"
    assert full.lora is None
    assert lora.predicted_tok_per_s > full.predicted_tok_per_s  # no base gradients, no AdamW
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "l")]) == 2
    assert "planned with LoRA (--lora-rank 16" in capsys.readouterr().err
    assert main([*base, "--lora-rank", "8", "--out", str(tmp_path / "l")]) == 2
    assert "run with --lora-rank 16" in capsys.readouterr().err
    assert main([*base, "--lora-rank", "16", "--out", str(tmp_path / "f")]) == 2
    assert "planned without LoRA; run without --lora-rank" in capsys.readouterr().err


@pytest.mark.parametrize("extra, words", [
    (["--lora-rank", "0"], "positive"),
    (["--lora-alpha", "8"], "need --lora-rank"),
    (["--lora-rank", "4", "--lora-targets", "q,x"], "'x' is not a target"),
    (["--lora-rank", "4", "--precision", "fp8"], "FP8 base"),
])
def test_bad_lora_flags_exit_2_naming_the_value(tmp_path, capsys, extra, words):
    """A bad --lora-* value, or LoRA with what it does not support, exits 2 with one line."""
    assert main([*TINY, *extra, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert not (tmp_path / "x").exists()


def test_a_lora_sweep_with_an_fp8_base_predicts_more_host_room(tmp_path, capsys):
    """dataflow-sweep run --lora-base fp8: 70b at 120/24 plans (its lora column says fp8), the
    bf16 base does not fit there; a bf16 directory refuses the fp8 resume."""
    base = ["run", "--model", "70b", "--seqlen", "8192", "--host", "120", "--dev", "24",
            "--predict-only", "--gpu", "h200", "--lora-rank", "16"]
    assert main([*base, "--lora-base", "fp8", "--out", str(tmp_path / "f8")]) == 0
    (row,) = read_table(tmp_path / "f8")
    assert row.lora.endswith("--lora-base fp8") and row.predicted_tok_per_s > 0, row
    assert main([*base, "--out", str(tmp_path / "bf")]) == 0
    (bf,) = read_table(tmp_path / "bf")
    assert bf.status != "ok" and not bf.predicted_tok_per_s, bf
    capsys.readouterr()
    assert main([*base, "--lora-base", "fp8", "--out", str(tmp_path / "bf")]) == 2
