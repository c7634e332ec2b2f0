"""Split updates launched by dataflow-ring and Ring (issue 56): every rank of a split replica of
R is planned with m / v for one part of R from the start (Plan.state_parts R), so a layout that
fits only split launches (2 replicas of tiny2s on the CPU, shared memory, NumPy backend), and
where the whole plan fits too the parted split replicas train the unsplit replicas' bits.
The split schedule itself: tests/ring/test_split_update.py."""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest

from dataflow.cli.ring import main
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.profiles import get_profile
from dataflow.memplan.search.ring_plan import make_rank_plans, ring_profile
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError
from dataflow.models.serial import to_json
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.split import split_memory_map
from dataflow.memplan.search.layout import choose_layout
from dataflow.ring.bootstrap import _rank_plan, _state_parts
from tests.ring.threads import in_threads

CFG = dataclasses.replace(load_config("tiny"), name="tiny2s", n_layers=2)
MODEL = to_json(CFG)
SPLIT_ONLY = ("0.0002", "0.06413")
"""Host / device GiB a rank of 2 replicas fits only with m / v for its half (the CPU profile's
reserve fills most of the device budget)."""
BOTH = ("0.0002", "0.0643")
"""Host / device GiB where the whole plan fits too."""


def _fits(budget: tuple[str, str], parts: int) -> bool:
    """Whether a rank of 2 replicas of a ring of 1 plans under `budget` with m / v in parts."""
    prof = ring_profile(get_profile("cpu"), 2, "shm", 2)
    try:
        make_rank_plans(CFG, 64, Budget.from_gib(*map(float, budget)), prof, 1, replicas=2,
                        state_parts=parts, tokens_per_step=64)
    except InfeasibleBudget:
        return False
    return True


def _run(tmp_path, name: str, budget, *flags: str) -> tuple[int, list, dict]:
    """dataflow-ring on 2 processes: (exit code, each rank's rank<r>.json, rank 0's weights)."""
    out = tmp_path / name
    code = main(["--gpus", "2", *budget, "64", MODEL, "--steps", "2", "--lr", "1e-2",
                 "--max-grad-norm", "0.05", "--tokens-per-step", "128", "--timeout", "60",
                 "--out", str(out), *flags])
    if code:
        return code, [], {}
    info = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    with np.load(out / "rank0.npz") as z:
        weights = {k: z[k].view(ml_dtypes.bfloat16).view(np.uint16) for k in z.files}
    return code, info, weights


@pytest.mark.parametrize("replicas", [("--replicas", "2"), ()])
def test_dataflow_ring_launches_a_layout_that_fits_only_split(tmp_path, capsys, replicas):
    """At budgets where only the split replica's plan fits, dataflow-ring --split-update (with
    --replicas 2, or choosing the layout itself) trains 2 replicas, every rank planned parted
    within the device budget; without the flag --replicas 2 is refused by name (exit 2) and
    the layout chooser falls back to one ring of 2."""
    assert _fits(SPLIT_ONLY, 2) and not _fits(SPLIT_ONLY, 1)  # the premise
    code, info, _ = _run(tmp_path, "split", SPLIT_ONLY, *replicas, "--split-update")
    assert code == 0
    for i in info:
        assert i["split_update"] is True and i["state_parts"] == 2
        assert i["device_bytes"] <= float(SPLIT_ONLY[1]) * 2**30
    assert {i["replica"] for i in info} == {0, 1}
    capsys.readouterr()
    code, info, _ = _run(tmp_path, "whole", SPLIT_ONLY, *replicas)
    if replicas:
        assert code == 2 and "does not fit" in capsys.readouterr().err
    else:
        assert code == 0 and [i["replica"] for i in info] == [0, 0]


def test_dataflow_ring_parted_split_replicas_train_the_unsplit_bits(tmp_path):
    """Where both fit, the split replicas (planned parted, smaller on the device) give the
    unsplit replicas' losses and final weights bit for bit over 2 steps, clipping on."""
    assert _fits(BOTH, 1)
    code_a, whole, w_whole = _run(tmp_path, "whole", BOTH, "--replicas", "2")
    code_b, split, w_split = _run(tmp_path, "split", BOTH, "--replicas", "2", "--split-update")
    assert code_a == code_b == 0
    assert [i["state_parts"] for i in whole + split] == [1, 1, 2, 2]
    assert split[0]["chunking"] == whole[0]["chunking"]
    assert split[0]["device_bytes"] < whole[0]["device_bytes"]
    assert [i["losses"] for i in split] == [i["losses"] for i in whole]
    assert sorted(w_split) == sorted(w_whole)
    for key in w_whole:
        assert np.array_equal(w_split[key], w_whole[key]), key


@pytest.mark.parametrize("replicas", [2, None])
def test_ring_engine_plans_split_replicas_parted(rng, replicas):
    """Engine(..., ring=Ring(split_update=True)) at budgets that fit only split: each
    process's rank plan holds m / v for its half (Plan.state_parts 2) and trains the global
    batch, the same losses on both replicas."""
    from dataflow.engine import Engine
    from dataflow.ring.engine import Ring
    from dataflow.ring.env import RankEnv

    data = [rng.integers(0, CFG.vocab_size, (2, 65), dtype=np.int32) for _ in range(2)]

    def rank(r, run_id):
        env = RankEnv(rank=r, gpus=2, local_rank=r, master_addr="127.0.0.1", master_port=0,
                      run_id=run_id)
        ring = Ring(env=env, replicas=replicas, split_update=True, transport="shm",
                    timeout_s=30)
        with Engine(CFG, ring=ring, host_gb=float(SPLIT_ONLY[0]), dev_gb=float(SPLIT_ONLY[1]),
                    seqlen=64, backend="numpy", seed=3, lr=1e-2, seqs_per_step=2) as eng:
            rp = eng.rank_plan
            assert rp.replicas == 2 and rp.split_update and rp.plan.state_parts == 2
            return [eng.train_step(b).loss for b in data]

    a, b = in_threads(rank, 2)
    assert a == b and np.isfinite(a).all()


def test_a_state_parts_constraint_that_does_not_match_the_replicas_is_refused_by_name():
    """A layout's 'state_parts' must be the replicas of a split update, 1 without one."""
    assert _state_parts({}, 4, True) == 4 and _state_parts({"state_parts": 1}, 4, False) == 1
    with pytest.raises(ConfigError, match="state_parts 2 .* must be 4"):
        _state_parts({"state_parts": 2}, 4, True)
    with pytest.raises(ConfigError, match="state_parts 2 .* add --split-update"):
        _state_parts({"state_parts": 2}, 2, False)


def test_a_launched_split_rank_runs_the_decisions_its_layout_predicted():
    """8 split replicas of 1b at 40 / 10 (H100 profile): whichever option the layout chooses
    (a whole plan run split, or one searched parted, its AdamW scored by the part or the
    whole), a rank launched with its constraints plans the same decisions, with m / v for
    one part of 8 in its plan."""
    cfg, budget, h100 = load_config("1b"), Budget.from_gib(40, 10), get_profile("h100")
    prof = ring_profile(h100, 8, "nccl", 8)
    c = choose_layout(cfg, 8192, budget, h100, 8, tokens_per_step=8 * 16 * 8192, ring_size=1,
                      quick=True, split_update=True)
    asked = [dict(c.chosen.constraints)] + [
        {"tokens_per_step": 16 * 8192, "state_parts": 8, **extra}
        for extra in ({}, {"whole_update_cost": True})] + [{"tokens_per_step": 16 * 8192}]
    for cons in asked:
        want = make_rank_plans(cfg, 8192, budget, prof, 1, replicas=8, **cons)[0].plan
        got = _rank_plan(cfg, 8192, budget, prof, 1, 0, 8, True, **cons)
        assert got.split_update and got.plan.state_parts == 8, cons
        assert dataclasses.replace(decisions_of(got.plan), state_parts=1) == \
            dataclasses.replace(decisions_of(want), state_parts=1), cons
        assert got.plan.memory == (want.memory if want.state_parts == 8
                                   else split_memory_map(want, 8)), cons


@pytest.mark.parametrize("flags,says", [
    (("--checkpoint-dir", "ckpt"), "runs without --checkpoint-dir so far")])
def test_dataflow_ring_refuses_split_updates_it_cannot_run_before_spawning(tmp_path, capsys,
                                                                          flags, says):
    """--split-update with checkpoints exits 2 with one line naming what to change, before any
    rank is spawned (over NCCL it is no longer refused: ring/nccl.py's reduce_scatter)."""
    flags = tuple(str(tmp_path / f) if f == "ckpt" else f for f in flags)
    assert main(["--gpus", "2", *BOTH, "64", MODEL, "--replicas", "2", "--split-update",
                 *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
