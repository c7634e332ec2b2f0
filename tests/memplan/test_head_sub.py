"""The head sub-chunk a plan takes: the search plans the default (1024 tokens); the chosen plan
then takes 2048 when its larger fp32 logits fit beside every other decision, and the cost model
counts the head's weight-gradient accumulations it saves."""

from __future__ import annotations

import dataclasses

from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.search.cost import LAUNCH_OVERHEAD_FRAC, head_seconds
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.memory import memory_map
from dataflow.memplan.plan.plan import Budget
from dataflow.models.config import load_config

H100 = get_profile("h100")


def _fits_with(plan, sub: int) -> bool:
    d = decisions_of(plan)
    d = dataclasses.replace(d, slots=dataclasses.replace(d.slots, head_sub_tokens=sub))
    mem = memory_map(d)
    return (mem.device_bytes + plan.profile.library_reserve_bytes <= plan.budget.device_bytes
            and mem.host_bytes <= plan.budget.host_bytes)


def test_a_plan_takes_the_longer_sub_chunk_only_where_it_fits():
    """8b at 8k on 80/24 (fast backward) has room for 2048-token logits; 1b at 8k on 40/16
    does not (0.04 GiB short), so it keeps 1024 and its other decisions; a split sequence keeps
    1024 whatever the room."""
    eight = make_plan(load_config("8b"), 8192, Budget.from_gib(80, 24), H100,
                      attention_bwd="fast")
    assert eight.slots.head_sub_tokens == 2048
    one = make_plan(load_config("1b"), 8192, Budget.from_gib(40, 16), H100, attention_bwd="fast")
    assert one.slots.head_sub_tokens == 1024 and not _fits_with(one, 2048)
    split = make_plan(load_config("8b"), 65536, Budget.from_gib(96, 30), H100)
    assert split.chunking.chunks_per_seq > 1 and split.slots.head_sub_tokens == 1024


def test_head_seconds_count_the_accumulations_a_longer_sub_chunk_saves():
    """8b at 8k, bf16 gradients: 2048-token sub-chunks accumulate the (V, D) gradient 4 times
    fewer per chunk than 1024-token ones, each a read and a write of V * D * 2 bytes."""
    cfg = load_config("8b")
    short, long = (head_seconds(cfg, 8192, sub, 2, H100) for sub in (1024, 2048))
    saved = 4 * cfg.vocab_size * cfg.model_dim * 2 * 2 / H100.device_mem_bytes_per_s
    assert abs((short - long) - saved * (1 + LAUNCH_OVERHEAD_FRAC)) < 1e-12
    assert head_seconds(cfg, 8192, 1024, 4, H100) == short  # the default's own cost is calibrated
