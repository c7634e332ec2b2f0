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


def test_bad_input_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A budget without its device half, a missing torchrun, no steps: exit 2, one message,
    nothing written."""
    import pytest

    with pytest.raises(SystemExit):
        ring_gpu.build_parser().parse_args(["8b", "8192", "--out", "x", "--ring-budget", "60"])
    monkeypatch.setattr(ring_gpu.shutil, "which", lambda name: None)
    out = tmp_path / "never"
    for extra in (["--launcher", "torchrun"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exc:
            ring_gpu.main(["tiny", "64", "--out", str(out), *extra])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no torchrun on PATH" in err and "--steps 0" in err
    assert not out.exists()
