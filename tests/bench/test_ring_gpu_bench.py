"""bench/ring_gpu.py on CPU (--backend numpy: shared-memory ring, NumPy single device): the ring
and the one-device run train the same global batches to the same losses, dataflow.cli.ring's --rounds
reaches every rank, and the record and table say so."""

import json

from dataflow.bench import ring_gpu


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


def test_a_ring_run_then_its_baseline_from_a_second_call_make_one_record(tmp_path):
    """--no-single, then --ring-from in a second call (one comparison split over two device
    calls on the same machine): the second record holds the first's ring and the baseline, and
    a second call with other arguments is refused before anything runs."""
    import pytest

    base = ["tiny", "64", "--ring-budget", "1:0.25", "--single-budget", "1:0.25", "--backend",
            "numpy", "--steps", "2", "--rounds", "3"]
    first, second = tmp_path / "ring", tmp_path / "single"
    assert ring_gpu.main([*base, "--out", str(first), "--no-single"]) == 0
    assert "single" not in json.loads((first / "ring_gpu.json").read_text())
    assert ring_gpu.main([*base, "--out", str(second), "--ring-from", str(first)]) == 0
    rec = json.loads((second / "ring_gpu.json").read_text())
    assert rec["ring_from"]["dir"] == str(first) and not (second / "ring.log").exists()
    assert rec["comparison"]["losses_identical"] is True
    with pytest.raises(SystemExit, match="differs"):
        ring_gpu.main([*base[:-1], "4", "--out", str(tmp_path / "x"), "--ring-from", str(first)])
    with pytest.raises(SystemExit, match="cannot read"):
        ring_gpu.main([*base, "--out", str(tmp_path / "y"), "--ring-from", str(tmp_path / "no")])


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


def test_the_single_run_takes_the_ring_head_ranks_head_sub_chunk():
    """One H200 at 120/24 plans a 2,048-token head sub-chunk for 8b at 8k where a ring rank at
    60/24 keeps 1,024: the single run takes the ring's, so the loss and the head's gradient are
    summed in the same pieces (on the H200 pair the two runs' losses differed by 2e-4 from it)."""
    from types import SimpleNamespace

    from dataflow.bench.ring_gpu import _single_plan
    from dataflow.models.config import load_config

    chunking = {"chunk_tokens": 8192, "chunks_per_round": 2, "rounds_per_step": 24}
    spec = {"seqlen": 8192, "budget": [120, 24], "chunking": chunking}
    be = SimpleNamespace(name="cupy", device_name="NVIDIA H200")
    cfg = load_config("8b")
    assert _single_plan(cfg, spec, be).slots.head_sub_tokens == 2048
    plan = _single_plan(cfg, {**spec, "head_sub_tokens": 1024}, be)
    assert plan.slots.head_sub_tokens == 1024 and plan.chunking.rounds_per_step == 24


def test_ring_gpu_refuses_without_enough_gpus_and_refuses_round_overlap(tmp_path, monkeypatch):
    """The CuPy ring needs one GPU a rank: with fewer visible it stops before running anything,
    naming how many it sees and what would work; --round-overlap over NCCL (CuPy's default
    transport) is refused by name (it runs over shared memory only)."""
    import pytest

    monkeypatch.setattr(ring_gpu.ProcessPeaks, "device_names", lambda self: ["GPU-A"])
    with pytest.raises(SystemExit, match=r"--gpus 3: this machine shows 1 GPU"):
        ring_gpu.main(["tiny", "64", "--out", str(tmp_path / "a"), "--gpus", "3"])
    assert not (tmp_path / "a" / "ring_gpu.json").exists()
    with pytest.raises(SystemExit):
        ring_gpu.main(["tiny", "64", "--out", str(tmp_path / "b"), "--round-overlap"])


def _numpy_ring(out, *flags: str) -> dict:
    """bench.ring_gpu's record of a 2-process NumPy ring of tiny (1 / 0.25 GiB, 3 rounds, 2
    steps, no one-device run) with `flags`."""
    assert ring_gpu.main(["tiny", "64", "--out", str(out), "--ring-budget", "1:0.25",
                          "--backend", "numpy", "--steps", "2", "--rounds", "3", "--gpus", "2",
                          *flags, "--no-single"]) == 0
    return json.loads((out / "ring_gpu.json").read_text())


def test_split_update_replicas_run_and_the_record_and_prediction_say_so(tmp_path, capsys):
    """--split-update reaches every rank (their records say split_update), the record's config
    and the table name it, and the prediction is of split-update replicas."""
    rec = _numpy_ring(tmp_path / "su", "--replicas", "2", "--split-update")
    assert rec["config"]["split_update"] is True and rec["config"]["transport"] == "shm"
    assert all(rec["ring"][f"rank{r}"]["split_update"] for r in range(2))
    assert rec["predicted"]["split_update"] is True and rec["predicted"]["replicas"] == 2
    assert "shm, split update) exit 0" in capsys.readouterr().out


def test_schedule_flags_that_cannot_run_are_refused_by_name(tmp_path, capsys):
    """NCCL with the numpy backend: exit 2 before anything runs, naming what would work; a CuPy
    ring over shared memory needs one GPU, not one a rank. (The vocabulary-parallel head over
    NCCL is no longer refused here: dataflow-ring checks its schedule, ring_rendezvous.)"""
    import pytest

    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        ring_gpu.main(["tiny", "64", "--out", str(out), "--backend", "numpy", "--transport",
                       "nccl"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "needs --backend cupy" in err
    assert not out.exists()
    args = ring_gpu.build_parser().parse_args(["tiny", "64", "--out", "x", "--gpus", "4",
                                               "--transport", "shm"])
    ring_gpu._enough_gpus(args, ["GPU-A"])  # four ranks share the one GPU: no refusal
    with pytest.raises(SystemExit, match="--transport shm"):
        ring_gpu._enough_gpus(ring_gpu.build_parser().parse_args(
            ["tiny", "64", "--out", "x", "--gpus", "4"]), ["GPU-A"])


def test_the_single_run_keeps_its_own_head_sub_chunk_where_the_rings_does_not_fit(capsys):
    """s37, one H100: split-update ranks (half the AdamW state each) planned a 2,048-token head
    sub-chunk for 1b at 4096; one device at 40/16 spends its room on saved activations, and with
    the ring's sub-chunk forced on it needed 16.3 GiB of 16 and did not run. It now keeps the
    planner's sub-chunk and says so."""
    from types import SimpleNamespace

    from dataflow.bench.ring_gpu import _single_plan
    from dataflow.models.config import load_config

    chunking = {"chunk_tokens": 8192, "chunks_per_round": 2, "rounds_per_step": 35}
    spec = {"seqlen": 4096, "budget": [40, 16], "chunking": chunking}
    be = SimpleNamespace(name="cupy", device_name="NVIDIA H100 80GB HBM3")
    cfg = load_config("1b")
    own = _single_plan(cfg, spec, be)
    assert own.slots.head_sub_tokens != 2048
    plan = _single_plan(cfg, {**spec, "head_sub_tokens": 2048}, be)
    assert plan.slots.head_sub_tokens == own.slots.head_sub_tokens
    assert plan.memory.device_bytes <= plan.budget.device_bytes
    assert "head sub-chunk of 2048 tokens does not fit" in capsys.readouterr().err


def test_round_overlap_runs_over_shared_memory_and_is_predicted_as_it_ran(tmp_path, capsys):
    """--round-overlap reaches dataflow-ring over shared memory (NumPy here; CuPy ranks sharing
    a GPU alike): the record's config says so, every rank's record gives the depth it ran, and
    the prediction is of that depth, and the table names it."""
    rec = _numpy_ring(tmp_path / "ov", "--replicas", "1", "--round-overlap")
    assert rec["config"]["round_overlap"] is True and rec["config"]["transport"] == "shm"
    depths = {rec["ring"][f"rank{r}"]["round_overlap"] for r in range(2)}
    assert len(depths) == 1
    assert depths == {1}  # tiny's 4 layers over 2 ranks at 1 / 0.25 GiB: depth 1 predicted
    assert rec["predicted"]["overlapped"]["round_overlap"] == 1
    assert rec["predicted"]["tok_per_s"] == rec["predicted"]["overlapped"]["tok_per_s"]
    assert "shm, round overlap) exit 0" in capsys.readouterr().out
