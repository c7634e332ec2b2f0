"""build_plan forces particular plans on the tiny and small models (as the executor's parity
tests do) with budgets in the MiB range, and refuses decisions that do not fit."""

import pytest

from dataflow.memplan.search.build import build_plan
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.plan import Budget, GradAccum, OptimizerWhere, Plan, Where
from dataflow.models.flops import SavedLevel

from .forced import HOME_HOST, HOME_STREAMED, RESIDENT, acts, forced

MIB = 1 << 20


def _exact(plan: Plan) -> Budget:
    """The plan's own needs: its regions, and on the device the libraries' reserve too."""
    return Budget(host_bytes=plan.memory.host_bytes,
                  device_bytes=plan.memory.device_bytes + plan.profile.library_reserve_bytes)


def _round_trip(plan: Plan) -> None:
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.memory.device_bytes <= plan.budget.device_bytes
    assert plan.memory.host_bytes <= plan.budget.host_bytes


PATHS = {
    "all_resident": dict(),
    "streamed_1_slot": dict(layers=(HOME_HOST,) * 4, weight_slots=1, grad_slots=1),
    "streamed_2_slots": dict(layers=(HOME_HOST,) * 4, weight_slots=2, grad_slots=2),
    "streamed_many_slots": dict(layers=(HOME_STREAMED, RESIDENT) * 2, weight_slots=8,
                                grad_slots=3, opt_stage_elems=5000),
    "optimizer_streamed": dict(layers=(HOME_STREAMED,) * 4, weight_slots=2, grad_slots=2,
                               embed=HOME_STREAMED, head=HOME_STREAMED, opt_stage_elems=1 << 14),
    "optimizer_host": dict(layers=(HOME_HOST,) * 4, weight_slots=2, grad_slots=1,
                           embed=HOME_HOST, head=HOME_HOST),
    "fp32_grads": dict(layers=(HOME_HOST, RESIDENT) * 2, weight_slots=1, grad_slots=1,
                       grad_accum=GradAccum.FP32),
}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_forced_placement_paths_build_and_fit_their_exact_budget(h100, name):
    """Each placement path builds on small, fits a budget equal to its own needs (MiB range),
    round-trips through JSON, and fails one byte below it."""
    plan = forced(h100, "small", 256, chunk_tokens=512, chunks_per_round=2, rounds=2,
                  **PATHS[name])
    exact = _exact(plan)
    assert plan.memory.device_bytes < 128 * MIB and exact.host_bytes < 128 * MIB
    _round_trip(forced(h100, "small", 256, chunk_tokens=512, chunks_per_round=2, rounds=2,
                       budget=exact, **PATHS[name]))
    tight = Budget(host_bytes=exact.host_bytes, device_bytes=exact.device_bytes - 1)
    with pytest.raises(InfeasibleBudget) as exc:
        forced(h100, "small", 256, chunk_tokens=512, chunks_per_round=2, rounds=2,
               budget=tight, **PATHS[name])
    assert exc.value.min_device_bytes == exact.device_bytes
    assert "device" in str(exc.value) and "GiB" in str(exc.value)


@pytest.mark.parametrize("level", list(SavedLevel))
@pytest.mark.parametrize("home", list(Where))
def test_each_activation_level_at_home_and_on_device(h100, level, home):
    """Every (level, home) pair builds on tiny; home ones need an activation slot."""
    plan = forced(h100, "tiny", 64, chunk_tokens=128, chunks_per_round=2,
                  activations=acts(2, 2, level, home), act_slots=1 if home is Where.HOME else 0)
    _round_trip(plan)
    names = [n for n, _ in plan.memory.device]
    assert names[3] == "saved_activations"
    assert (plan.prediction.recompute_s == 0) == (level is SavedLevel.FULL)


def test_long_sequence_split_over_several_chunks(h100):
    """tiny at seqlen 1024 in 8 chunks of 128, one sequence per round, 3 rounds."""
    plan = forced(h100, "tiny", 1024, chunk_tokens=128, chunks_per_round=8, rounds=3)
    ch = plan.chunking
    assert (ch.chunks_per_seq, ch.seqs_per_chunk, ch.seqs_per_step) == (8, 1, 3)
    assert [ch.chunk_context(c) for c in range(3)] == [0, 128, 256]
    _round_trip(plan)


def test_several_sequences_packed_per_chunk_and_several_rounds(h100):
    """tiny at seqlen 32 with 4 sequences per chunk, 2 chunks per round, 5 rounds."""
    plan = forced(h100, "tiny", 32, chunk_tokens=128, chunks_per_round=2, rounds=5)
    ch = plan.chunking
    assert (ch.seqs_per_chunk, ch.seqs_per_round, ch.seqs_per_step) == (4, 8, 40)
    _round_trip(plan)


def test_build_plan_rejects_mismatched_seqlen_and_non_activation_entries(h100):
    """seqlen must match the chunking; activations must be SavedActivation objects."""
    plan = forced(h100, "tiny", 64)
    kw = dict(chunking=plan.chunking, slots=plan.slots, layers=plan.layers, embed=plan.embed,
              head=plan.head)
    with pytest.raises(ValueError, match="differs"):
        build_plan(plan.model, 128, plan.budget, h100, activations=plan.activations, **kw)
    with pytest.raises(ValueError, match="SavedActivation"):
        build_plan(plan.model, 64, plan.budget, h100, activations=[["full"], ["full"]], **kw)
    assert plan.layers[0].optimizer is OptimizerWhere.DEVICE
