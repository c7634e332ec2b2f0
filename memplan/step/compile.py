"""The step as data: `compile_schedule(plan)` turns a plan into one frozen list of typed events
(fetch, write-back, fill, compute, host task, optimizer update, record, wait), each on its stream
and naming the byte ranges it touches, plus the region table every one of those ranges lives in.
The simulator (memplan/step/sim.py) times exactly this list and the executor
(dataflow/executor.py) dispatches exactly this list, so the plan that is predicted is the plan
that runs.

Slot assignment (which slot a streamed block or saved activation visits, evicting the one needed
farthest ahead) and fetch timing (a fetch is issued as soon as its slot is free) are decided here,
once per plan, by the slot rings of memplan/step/slot_ring.py; the events and Schedule themselves
are memplan/step/events.py. Pure Python: never imports array libraries, never touches a device."""

from __future__ import annotations

from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.step.context import SplitContext
from dataflow.memplan.step.ends import ModelEnds
from dataflow.memplan.step.events import (
    COMPUTE,
    D2H,
    EVENT_TYPES,
    H2D,
    HOST,
    OPT,
    STREAMS,
    Compute,
    Event,
    Fetch,
    Fill,
    HostTask,
    Record,
    Ref,
    Region,
    RegionTable,
    Schedule,
    Update,
    Wait,
    WriteBack,
)
from dataflow.memplan.step.rounds import UPDATE_MODES, Rounds
from dataflow.memplan.step.slot_ring import ZERO
from dataflow.memplan.step.state import (
    EMBED,
    HEAD,
    BlockKey,
    CompilerState,
    block_key,
    region_table,
)
from dataflow.memplan.step.update import OptimizerUpdate
from dataflow.models.errors import ConfigError
from dataflow.models.flops import SavedLevel

# The data (Region, Ref, the events, Schedule) lives in memplan/step/events.py, the slot rings
# in memplan/step/slot_ring.py and the compiler's parts beside them; the public names are
# re-exported here, where the rest of the code imports them.
__all__ = [
    "COMPUTE", "D2H", "EVENT_TYPES", "H2D", "HOST", "OPT", "STREAMS", "ZERO", "Compute", "Event",
    "Fetch", "Fill", "HostTask", "Record", "Ref", "Region", "RegionTable", "Schedule", "Update",
    "Wait", "WriteBack", "BlockKey", "EMBED", "HEAD", "StepCompiler", "UPDATE_MODES", "block_key",
    "compile_eval_schedule", "compile_schedule", "compile_update_schedule", "level_of",
    "region_table",
]


class StepCompiler(Rounds, ModelEnds, SplitContext, OptimizerUpdate, CompilerState):
    """Compiles one plan's step: its state and slot rings (step/state.py), the rounds
    (step/rounds.py), the model's ends (step/ends.py), split-sequence context and segment
    recompute (step/context.py) and the optimizer (step/update.py). A ring rank's compilers
    (step/ring_compile.py) extend it by overriding its hooks."""



def refuse_state_parts(plan) -> None:
    """A plan made for one replica of a split update (Plan.state_parts > 1) holds m / v for a
    part only: run alone or unsplit, its whole update would overrun them. ConfigError."""
    parts = decisions_of(plan).state_parts
    if parts != 1:
        raise ConfigError(f"this plan holds AdamW state for one part of {parts} (planned as a "
                          f"split-update replica, Plan.state_parts); run it as one of {parts} "
                          f"replicas with --split-update, or plan without split updates")


def compile_schedule(plan, *, rounds: int | None = None, update: str = "end") -> Schedule:
    """The event list of one step of `plan` (a Plan or Decisions). `rounds` overrides the
    plan's rounds per step (the search times a first and a later round this way); `update`
    says where AdamW runs (UPDATE_MODES; 'end' unless the trainer defers it)."""
    refuse_state_parts(plan)
    return StepCompiler(plan).compile(rounds, update)


def compile_update_schedule(plan) -> Schedule:
    """The AdamW over every block alone, reading the clip scale a step compiled with
    update='none' or 'deferred' left on the device: the pending update, run before state is
    read, saved or evaluated between steps."""
    refuse_state_parts(plan)
    return StepCompiler(plan).compile_update()


def compile_eval_schedule(plan, rounds: int = 1) -> Schedule:
    """The event list of a forward-only evaluation of `rounds` rounds of `plan` (same region
    table, slots and token staging as its training step; no backward, no optimizer: its
    `optimizer_start` is the end of the list)."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"an evaluation needs a whole number of rounds >= 1, got {rounds!r}")
    refuse_state_parts(plan)
    return StepCompiler(plan).compile_eval(rounds)


def level_of(plan, layer: int, chunk: int) -> SavedLevel:
    return decisions_of(plan).activations[layer][chunk].level
