"""The planner's search counts a split-update replica's own-part AdamW state from the start
(Plan.state_parts, make_plan(state_parts=R), choose_layout(split_update=True)): layouts that fit
only thanks to the split are found, what the split frees is spent by the usual search, the
compiled split schedule allocates exactly the plan's memory map, a parted plan is refused where
it would run unsplit, and unsplit plans keep their bytes, JSON and hashes."""

from __future__ import annotations

import dataclasses

import pytest

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.plan import Budget, Plan
from dataflow.memplan.plan.split import part_numel_max, split_memory_map
from dataflow.memplan.search.layout import choose_layout
from dataflow.memplan.step.compile import compile_schedule
from dataflow.memplan.step.ring_compile import ReplicaCompiler
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError

H100 = get_profile("h100")
CAP = 1_048_576
TIGHT = Budget.from_gib(30, 24)
"""8b at 8k: one device, and a replica of a ring of 1 holding whole m / v, need 53.8 GiB host."""


@pytest.fixture(scope="module")
def eight_split():
    """8b at 30 / 24 on 8 GPUs as 8 replicas of a ring of 1, update split."""
    return choose_layout(load_config("8b"), 8192, TIGHT, H100, 8, tokens_per_step=CAP,
                         ring_size=1, quick=True, split_update=True)


def test_a_layout_that_fits_only_split_is_planned(eight_split):
    """8 x ring of 1 at 30 / 24 is refused for host memory without the split and planned with
    it: every replica's plan holds m / v for one part of 8 and fits both budgets."""
    with pytest.raises(ConfigError, match="8 replicas of a ring of 1"):
        choose_layout(load_config("8b"), 8192, TIGHT, H100, 8, tokens_per_step=CAP,
                      ring_size=1, quick=True)
    c = eight_split
    assert c.chosen.layout.split_update and c.chosen.layout.replicas == 8
    assert dict(c.chosen.constraints)["state_parts"] == 8
    for rp in c.rank_plans:
        mem = rp.plan.memory
        assert rp.split_update and rp.replicas == 8 and rp.plan.state_parts == 8
        assert mem.host_bytes <= TIGHT.host_bytes
        assert mem.device_bytes + H100.library_reserve_bytes <= TIGHT.device_bytes
        assert split_memory_map(rp.plan, 8) == mem  # cutting again changes nothing


def test_a_parted_plans_compiled_split_schedule_allocates_its_memory_map(eight_split):
    """Every replica's compiled split schedule lays out exactly the plan's device and host
    bytes, and its layers' and head's m / v hold the largest part alone."""
    rp = eight_split.rank_plans[0]
    elems = buffers.block_elems(rp.plan.model)
    for q in (0, 3, 7):
        table = ReplicaCompiler(rp, q).table
        assert table.used_bytes("device") == rp.plan.memory.device_bytes
        assert table.used_bytes("host") == rp.plan.memory.host_bytes
        sizes = {r.name: r.nbytes for r in table.device + table.host}
        for name, n in sizes.items():
            if name.endswith((".m", ".v")) and "embed" not in name:
                kind = "head" if "head" in name else "layer"
                assert n == buffers.align(part_numel_max(elems[kind], 8) * 2), name


def test_a_parted_plan_is_refused_where_it_would_run_unsplit(eight_split):
    """A plan with m / v for one part runs only as a split replica of that many: alone, unsplit
    or over another replica count it is refused by name."""
    rp = eight_split.rank_plans[0]
    with pytest.raises(ConfigError, match="one part of 8"):
        compile_schedule(rp.plan)
    for other in (dataclasses.replace(rp, split_update=False),
                  dataclasses.replace(rp, replicas=4)):
        with pytest.raises(ConfigError, match="one part of 8"):
            ReplicaCompiler(other)


def test_the_split_frees_memory_the_search_spends():
    """8b at 56 / 24 GiB, one replica of 4 (state_parts 4): the whole plan shrunk afterwards
    would leave 20 GiB of host idle; planned with the part from the start it spends them on a
    second chunk a round, within the budgets and predicted faster."""
    cfg, budget = load_config("8b"), Budget.from_gib(56, 24)
    whole = make_plan(cfg, 8192, budget, H100, tokens_per_step=131072)
    parted = make_plan(cfg, 8192, budget, H100, tokens_per_step=131072, state_parts=4)
    assert parted.state_parts == 4 and whole.state_parts == 1
    shrunk = split_memory_map(whole, 4)
    assert parted.memory.host_bytes <= budget.host_bytes
    assert parted.memory.host_bytes > shrunk.host_bytes + 10 * 2**30
    assert parted.chunking.chunks_per_round > whole.chunking.chunks_per_round
    assert parted.prediction.tok_per_s > whole.prediction.tok_per_s


def test_unsplit_plans_their_json_and_hashes_are_unchanged():
    """state_parts 1 (the default) leaves plans as they were: no key in the JSON, the hashes
    recorded before Plan.state_parts existed, the same plan when asked for explicitly.

    Those hashes were recorded on an H100 profile without an FP8 GEMM rate or a host copy rate;
    the rates it carries now are part of every H100 plan's profile, so the old hashes are checked
    with them taken out and today's with them in (the same decisions)."""
    cfg = load_config("8b")
    plan = make_plan(cfg, 8192, Budget.from_gib(80, 24), H100)
    assert "state_parts" not in plan.to_json()
    assert plan.hash == "d1d707f1142d9ddc"
    assert make_plan(load_config("1b"), 4096, Budget.from_gib(40, 16), H100).hash \
        == "6abc45ee48d9e18c"
    before_copy = dataclasses.replace(H100, host_copy_bytes_per_s=None)
    assert make_plan(cfg, 8192, Budget.from_gib(80, 24), before_copy).hash == "af2ee1b5c273c246"
    assert make_plan(load_config("1b"), 4096, Budget.from_gib(40, 16), before_copy).hash \
        == "3276b120c167fa81"
    before_fp8 = dataclasses.replace(before_copy, fp8_gemm_flop_per_s=None)
    assert make_plan(cfg, 8192, Budget.from_gib(80, 24), before_fp8).hash == "93b22ba2d67ce4fb"
    assert make_plan(load_config("1b"), 4096, Budget.from_gib(40, 16), before_fp8).hash \
        == "2811064bd9d6d30d"
    assert make_plan(cfg, 8192, Budget.from_gib(80, 24), H100, state_parts=1) == plan
    with pytest.raises(ConfigError, match="state_parts"):
        make_plan(cfg, 8192, Budget.from_gib(80, 24), H100, state_parts=0)


def test_a_parted_plan_round_trips_through_json_with_its_part_count():
    """Plan.state_parts is written (and hashed) where it is not 1 and read back."""
    plan = make_plan(load_config("tiny"), 256, Budget.from_gib(4, 2), H100, state_parts=3)
    assert '"state_parts": 3' in plan.to_json()
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.hash != dataclasses.replace(plan, state_parts=1).hash
