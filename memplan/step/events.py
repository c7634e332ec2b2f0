"""The step's data: the region table (every byte range a step touches, by place), the `Ref`s
into it, the typed events of a schedule (fetch, write-back, fill, compute, host task, optimizer
update, record, wait) and `Schedule`, the frozen event list with its JSON round trip. The
compiler (memplan/step/compile.py) writes these, the simulator times them and the executor dispatches
them. Data only: never compiles, never decides placement, never imports array libraries."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Union

STREAMS = ("compute", "h2d", "d2h", "host", "opt")
COMPUTE, H2D, D2H, HOST, OPT = STREAMS


# -- the ops of compute events and host tasks -----------------------------------------------------
class ComputeOp(str, enum.Enum):
    """What a Compute event runs (see Compute). A str enum: its values are the schedule JSON's
    strings, and a member equals its string, so comparisons with 'layer_fwd' still hold."""

    LAYER_FWD = "layer_fwd"
    LAYER_REFWD = "layer_refwd"
    LAYER_BWD = "layer_bwd"
    HEAD = "head"
    HEAD_LOSS = "head_loss"
    MOE_TOTALS_ADD = "moe_totals_add"
    CTX_CAST = "ctx_cast"
    KV_REBUILD = "kv_rebuild"
    EMBED_FWD = "embed_fwd"
    EMBED_BWD = "embed_bwd"
    GRAD_SUMSQ = "grad_sumsq"
    CLIP_SCALE = "clip_scale"
    VOCAB_NORM = "vocab_norm"
    VOCAB_STATS = "vocab_stats"
    VOCAB_MERGE = "vocab_merge"
    VOCAB_LOSS = "vocab_loss"
    VOCAB_GRAD = "vocab_grad"
    VOCAB_DX_ADD = "vocab_dx_add"
    VOCAB_NORM_BWD = "vocab_norm_bwd"

    def __str__(self) -> str:
        return self.value  # f-strings and str() give the JSON string on every Python


VOCAB_HEAD_OPS = frozenset({ComputeOp.VOCAB_NORM, ComputeOp.VOCAB_STATS, ComputeOp.VOCAB_MERGE,
                            ComputeOp.VOCAB_LOSS, ComputeOp.VOCAB_GRAD, ComputeOp.VOCAB_DX_ADD,
                            ComputeOp.VOCAB_NORM_BWD})
"""The vocabulary-parallel head's ops: only a ring rank's schedule holds them
(dataflow.memplan.step.ring_vocab), and only dataflow.ring.executor.RingExecutor handles them."""


class HostOp(str, enum.Enum):
    """What a HostTask runs (see HostTask); a str enum like ComputeOp."""

    TOKENS_STAGE = "tokens_stage"
    EMBED_GATHER = "embed_gather"
    EMBED_SCATTER = "embed_scatter"
    GRAD_SUMSQ = "grad_sumsq"

    def __str__(self) -> str:
        return self.value


def _as_op(kind: type[enum.Enum], op):
    """`op` as a member of `kind`, refusing an unknown string by name."""
    try:
        return kind(op)
    except ValueError:
        raise ValueError(f"unknown {kind.__name__} {op!r}; known: "
                         f"{', '.join(m.value for m in kind)}") from None


# -- the region table ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    name: str
    place: str
    """'device' or 'host'."""
    offset: int
    """First byte inside its place's arena."""
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class RegionTable:
    """Every byte range a step touches, by place, laid out back to back (aligned) in the order
    dataflow.memplan.plan.memory lists them. The arenas are exactly the budgets; regions use a prefix."""

    device: tuple[Region, ...]
    host: tuple[Region, ...]
    device_budget: int
    host_budget: int

    def get(self, name: str) -> Region:
        for r in self.device + self.host:
            if r.name == name:
                return r
        raise KeyError(f"no region '{name}'")

    def by_name(self) -> dict[str, Region]:
        return {r.name: r for r in self.device + self.host}

    def used_bytes(self, place: str) -> int:
        regions = self.device if place == "device" else self.host
        return regions[-1].offset + regions[-1].nbytes if regions else 0



@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """Bytes [offset, offset + nbytes) of region `region`."""

    region: str
    offset: int
    nbytes: int


# -- events ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Fetch:
    """Copy host bytes `src` to device bytes `dst` on the h2d stream."""

    name: str
    dst: Ref
    src: Ref
    stream: str = H2D
    duplex: bool = False
    """The copy runs beside copies the other way by construction (a streamed update's pieces:
    each fetch beside the write-back of the piece before), so it is timed at the duplex rate."""


@dataclasses.dataclass(frozen=True, slots=True)
class WriteBack:
    """Copy device bytes `src` to host bytes `dst` on the d2h stream."""

    name: str
    dst: Ref
    src: Ref
    stream: str = D2H
    duplex: bool = False
    """As Fetch.duplex (a streamed update's write-backs, beside the next piece's fetches)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fill:
    """Zero `dst` (viewed as `dtype`) on `stream`."""

    name: str
    dst: Ref
    dtype: str
    stream: str = COMPUTE


@dataclasses.dataclass(frozen=True, slots=True)
class Compute:
    """One unit of model work on the compute stream. op: 'embed_fwd' / 'embed_bwd' (device
    table), 'layer_fwd' / 'layer_bwd' (one layer on one chunk; a forward with no `save` keeps
    nothing, as in evaluation), 'layer_refwd' (a segment's recompute in the backward: the
    same forward, reading its input from the saved activation `src` (the segment's boundary,
    whose kept attention output, if its level has one, spares the Q projection and attention)
    or from the rows of x, keeping that input and what its level says in `save`, writing its
    output over the rows of y, which may be x), 'head' (final norm, lm_head and loss of one round, all chunks,
    forward and backward), 'head_loss' (the same forward only: evaluation), 'ctx_cast' (copy a
    chunk's saved K/V into the sequence context), 'kv_rebuild' (re-form a chunk's K/V in the
    sequence context from the x at the start of `save` with the layer's `weights`:
    Plan.kv_rebuild), 'vocab_*' (a ring rank's part of a vocabulary-parallel head on one chunk:
    dataflow.memplan.step.ring_vocab). x and y name the transition buffers read and written."""

    name: str
    op: ComputeOp
    round: int
    layer: int = -1
    chunk: int = -1
    weights: Ref | None = None
    grads: Ref | None = None
    save: Ref | None = None
    x: str = ""
    y: str = ""
    stream: str = COMPUTE
    src: Ref | None = None

    def __post_init__(self):
        object.__setattr__(self, "op", _as_op(ComputeOp, self.op))  # emitters pass strings


@dataclasses.dataclass(frozen=True, slots=True)
class HostTask:
    """CPU work on the host stream. op: 'tokens_stage' (the round's data into the bytes `dst`
    names of the pinned token buffer: both rows take the input ids and RoPE positions, the
    second row alone takes the targets, once the positions have left it), 'embed_gather' /
    'embed_scatter' (embedding rows of a HOME table: the gather writes the round's rows into
    `dst`; the scatter adds the gradient rows at `src` into the gradient `dst`), 'grad_sumsq'
    (the squared norm of a HOME embedding gradient `dst`)."""

    name: str
    op: HostOp
    round: int = -1
    dst: Ref | None = None
    stream: str = HOST
    src: Ref | None = None

    def __post_init__(self):
        object.__setattr__(self, "op", _as_op(HostOp, self.op))


@dataclasses.dataclass(frozen=True, slots=True)
class Update:
    """AdamW over elements [start, start + count) of `block` ('embed', 'layer3', 'head'):
    params, grads, m, v at the given refs (device refs on the compute stream, host refs on the
    host stream)."""

    name: str
    block: str
    start: int
    count: int
    params: Ref
    grads: Ref
    m: Ref
    v: Ref
    stream: str = COMPUTE


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """Event `id` marks everything enqueued on `stream` so far."""

    stream: str
    id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    """Later work on `stream` starts after event `id` has passed."""

    stream: str
    id: int


Event = Union[Fetch, WriteBack, Fill, Compute, HostTask, Update, Record, Wait]
EVENT_TYPES = {cls.__name__: cls for cls in (Fetch, WriteBack, Fill, Compute, HostTask, Update,
                                             Record, Wait)}


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """One optimizer step: `events` in issue order (rounds, then the optimizer). Every step of a
    plan runs the same list; the executor synchronises between steps."""

    regions: RegionTable
    events: tuple[Event, ...]
    rounds: int
    round_starts: tuple[int, ...]
    """Index of the first event of each round; the optimizer starts at `optimizer_start`."""
    optimizer_start: int
    n_ids: int
    """Record ids run 0..n_ids-1."""

    def bytes_moved(self, start: int = 0, stop: int | None = None, *,
                    state_only: bool = False) -> tuple[int, int]:
        """(host to device, device to host) bytes of events [start, stop) (default: the step);
        `state_only` leaves out the token ids and targets."""
        events = self.events[start:stop]
        skip = "tokens." if state_only else "\0"
        h2d = sum(e.dst.nbytes for e in events if type(e) is Fetch and not e.name.startswith(skip))
        d2h = sum(e.dst.nbytes for e in events if type(e) is WriteBack)
        return h2d, d2h

    def to_json(self) -> str:
        def enc(e):
            out = {"type": type(e).__name__}
            out.update({f.name: getattr(e, f.name) for f in dataclasses.fields(e)})
            return {k: (dataclasses.asdict(v) if isinstance(v, Ref) else v) for k, v in out.items()}

        return json.dumps({"regions": dataclasses.asdict(self.regions), "rounds": self.rounds,
                           "round_starts": list(self.round_starts),
                           "optimizer_start": self.optimizer_start, "n_ids": self.n_ids,
                           "events": [enc(e) for e in self.events]})

    @classmethod
    def from_json(cls, text: str, extra_types: dict | None = None) -> "Schedule":
        """Inverse of to_json; `extra_types` names event classes beyond EVENT_TYPES (a ring's
        Send / Recv / AllReduce: dataflow.memplan.step.ring_compile.RING_EVENT_TYPES)."""
        types = {**EVENT_TYPES, **(extra_types or {})}
        raw = json.loads(text)
        regs = raw["regions"]
        table = RegionTable(device=tuple(Region(**r) for r in regs["device"]),
                            host=tuple(Region(**r) for r in regs["host"]),
                            device_budget=regs["device_budget"], host_budget=regs["host_budget"])
        events = []
        for e in raw["events"]:
            kind = types[e.pop("type")]
            events.append(kind(**{k: Ref(**v) if isinstance(v, dict) else v
                                  for k, v in e.items()}))
        return cls(table, tuple(events), raw["rounds"], tuple(raw["round_starts"]),
                   raw["optimizer_start"], raw["n_ids"])
