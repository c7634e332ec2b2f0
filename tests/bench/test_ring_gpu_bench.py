"""bench/ring_gpu.py on CPU (--backend numpy: shared-memory ring, NumPy single device): the ring
and the one-device run train the same global batches to the same losses, ring.cli's --rounds
reaches every rank, and the record and table say so."""

import json

from bench import ring_gpu


def test_ring_and_single_device_agree_and_the_record_says_so(tmp_path, capsys):
    out = tmp_path / "rg"
    code = ring_gpu.main([str("tiny"), "64", "--out", str(out), "--ring-budget", "1:0.25",
                          "--single-budget", "1:0.25", "--backend", "numpy", "--steps", "2",
                          "--rounds", "3"])
    assert code == 0
    rec = json.loads((out / "ring_gpu.json").read_text())
    assert rec["ring"]["exit_code"] == 0 and rec["single"]["exit_code"] == 0
    assert rec["ring"]["rank0"]["chunking"]["rounds_per_step"] == 3
    assert len(rec["single"]["losses"]) == 2
    assert rec["comparison"]["losses_identical"] is True
    assert not list((out / "ring").glob("*.npz"))  # --no-weights
    assert "losses identical True" in capsys.readouterr().out


def test_budgets_are_refused_with_the_expected_form():
    import pytest

    with pytest.raises(SystemExit):
        ring_gpu.build_parser().parse_args(["8b", "8192", "--out", "x", "--ring-budget", "60"])
