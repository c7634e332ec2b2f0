"""Split updates of data-parallel replicas (RankPlan.split_update, docs/ring.md "Split
updates"), as a mixin of dataflow.memplan.step.ring_compile.ReplicaCompiler: in the step's last
round each layer's and the head's finished gradient is reduce-scattered (replica q of R keeps
its part, a run of whole sub-blocks: dataflow.memplan.plan.split), its squared norm is taken over
that part alone, replica q runs AdamW on its part with m / v held for that part only, and a
GatherParts of the updated weights gives every replica the other parts. The embedding stays
all-reduced and updated whole. Pure Python: never imports array libraries, never touches a
device, never talks to another replica (the events do, through a transport)."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.buffers import align
from dataflow.memplan.plan.split import (part_byte_bounds, part_range, split_state_numel,
                                         state_part_regions, sub_blocks)
from dataflow.memplan.step.compile import COMPUTE, Ref, StepCompiler, refuse_state_parts
from dataflow.memplan.step.events import Compute, Region, RegionTable
from dataflow.memplan.step.state import EMBED, HEAD, BlockKey
from dataflow.models.errors import ConfigError

REDUCE, GATHER = "reduce", "gather"
"""The streams of the replicas' gradient all-reduce (and reduce-scatter) and of their parts'
gathers (dataflow.memplan.step.ring_compile.COMM_STREAMS lists them with the ring's)."""


def _bounds_tuple(obj, field: str) -> None:
    """A schedule read back from JSON gives lists: keep the event's bounds a tuple."""
    object.__setattr__(obj, field, tuple(getattr(obj, field)))


@dataclasses.dataclass(frozen=True, slots=True)
class GatherParts:
    """The R replicas of this ring rank each hold their own part of `dst`: give every replica
    every part, in place, on the gather stream. Replica q's part is bytes [bounds[q],
    bounds[q + 1]) of `dst` (a split update's sub-block runs), or with no bounds bytes
    [q n / R, (q + 1) n / R) (a split fetch's equal parts)."""

    name: str
    dst: Ref
    parts: int
    stream: str = GATHER
    bounds: tuple[int, ...] = ()

    def __post_init__(self):
        _bounds_tuple(self, "bounds")


@dataclasses.dataclass(frozen=True, slots=True)
class ReduceScatter:
    """Sum part q of the gradient bytes `dst` (elements of `dtype`, bytes [bounds[q],
    bounds[q + 1]) of it) over the R replicas of this ring rank into replica q's `dst`, in
    place, on the reduce stream (RankPlan.split_update); the other parts keep this replica's
    own contribution."""

    name: str
    dst: Ref
    dtype: str
    parts: int
    bounds: tuple[int, ...] = ()
    stream: str = REDUCE

    def __post_init__(self):
        _bounds_tuple(self, "bounds")


def refuse_split_update(rp, numel: dict[str, int]) -> None:
    """RankPlan.split_update's unbuilt combinations, refused by name (ConfigError). `numel`:
    the split blocks' elements ('layer', 'head')."""
    if rp.plan.model.moe is not None:
        raise ConfigError(f"split updates of the MoE model {rp.plan.model.name} are not built "
                          "yet; leave --split-update off")
    for what, n in numel.items():
        if sub_blocks(n) < rp.replicas:
            raise ConfigError(f"split updates: the {what} block has {n} elements, "
                              f"{sub_blocks(n)} sub-blocks of 1024, fewer than the "
                              f"{rp.replicas} replicas; use --replicas {sub_blocks(n)} or "
                              "fewer, or leave --split-update off")


def split_state_table(table: RegionTable, numel: dict[str, int], replicas: int) -> RegionTable:
    """`table` with the split blocks' m / v regions (device and home) cut to one replica's part
    (state_part_regions), every place laid out again back to back."""
    def lay(regions):
        sizes = dict(state_part_regions([(r.name, r.nbytes) for r in regions], numel, replicas,
                                        align))
        out, at = [], 0
        for r in regions:
            out.append(Region(r.name, r.place, at, sizes[r.name]))
            at += align(sizes[r.name])
        return tuple(out)

    return dataclasses.replace(table, device=lay(table.device), host=lay(table.host))


class SplitUpdate:
    """The split update's hooks of the single-device compiler (update_range, state_origin,
    weights_updated, sumsq, fused, round_begin) for replica self.replica of self.rp.replicas.
    Mixed in ahead of StepCompiler; inert unless RankPlan.split_update with replicas."""

    def _split_setup(self) -> None:
        """After the compiler's own setup: refusals, then the own-part m / v regions."""
        rp = self.rp
        self.split_update = bool(rp.split_update) and rp.replicas > 1
        self.gbpe = 2 if self.gdt == "bf16" else 4
        if self.plan.state_parts != 1 and (not self.split_update
                                           or rp.replicas != self.plan.state_parts):
            refuse_state_parts(self.plan)  # planned for a split it is not run with
        if not self.split_update:
            return
        refuse_split_update(rp, {k: n for k, n in self.numel.items() if k != "embed"})
        cut = split_state_table(self.table, split_state_numel(self.plan), rp.replicas)
        if self.plan.state_parts == rp.replicas:  # planned parted (what the launchers run):
            # its memory map holds the parts already, so the cut must change nothing
            assert cut == self.table, "a parted plan's m / v regions are not its parts"
            return
        # a whole plan run split (the planner's whole candidates, hand-made rank plans): m / v
        # cut to this replica's part here, after planning
        self.table = cut
        self._regions = self.table.by_name()

    def splits(self, what: str) -> bool:
        """Whether block `what` ('L3', 'head', 'embed') has its update split over the replicas:
        every owned block but the embedding (all-reduced and updated whole)."""
        return self.split_update and what != "embed"

    def byte_bounds(self, ref: Ref, bpe: int) -> tuple[int, ...]:
        """The R + 1 byte offsets (inside `ref`, a whole block of `bpe`-byte elements) of the
        replicas' parts."""
        return part_byte_bounds(ref.nbytes, bpe, self.rp.replicas)

    def part(self, ref: Ref, bpe: int | None = None) -> Ref:
        """This replica's part of the whole block `ref` (gradient elements unless `bpe`)."""
        b = self.byte_bounds(ref, bpe or self.gbpe)
        q = self.replica
        return Ref(ref.region, ref.offset + b[q], b[q + 1] - b[q])

    def sumsq(self, rnd: int, what: str, grads: Ref) -> None:
        """With split_update the last round's squared norm of a split block is taken over this
        replica's reduced part alone (the executor adds the replicas' exact partial sums)."""
        if not (self.splits(what) and rnd == self.last_round and grads is not None):
            return super().sumsq(rnd, what, grads)
        self.grads_final(what, grads, COMPUTE)
        self.em.add(Compute(f"gnorm.{what}", "grad_sumsq", rnd, grads=self.part(grads)))

    def _block_what(self, key: BlockKey) -> str:
        return "embed" if key == EMBED else "head" if key == HEAD else f"L{key.layer}"

    def update_range(self, key: BlockKey) -> tuple[int, int]:
        lo, hi = super().update_range(key)
        if not self.splits(self._block_what(key)):
            return lo, hi
        return part_range(hi - lo, self.rp.replicas, self.replica)

    def state_origin(self, key: BlockKey) -> int:
        """A split block's m / v hold this replica's part alone: its first element is at 0."""
        if not self.splits(self._block_what(key)):
            return super().state_origin(key)
        return self.update_range(key)[0]

    def weights_updated(self, key: BlockKey, weights: Ref, stream: str) -> None:
        """A split update leaves only this replica's part of `weights` new: gather the others'
        parts into it (on the gather stream, after `stream`'s update; `stream` waits for it)."""
        if self.update_range(key) == StepCompiler.update_range(self, key):
            return
        em = self.em
        em.wait(GATHER, em.record(stream))
        em.add(GatherParts(f"gather.{key.name}", weights, self.rp.replicas,
                           bounds=self.byte_bounds(weights, 2)))
        em.wait(stream, em.record(GATHER))

    def round_begin(self, rnd: int) -> None:
        """With split_update the last round's gradient releases write home this replica's
        reduced part alone (the AdamW reads nothing else; earlier rounds keep the whole sums)."""
        if self.split_update:
            hook = self._part_writeback if rnd == self.last_round else None
            for ring in (self.gring, self.hg_ring):
                if ring is not None:
                    ring.writeback = hook
        super().round_begin(rnd)

    def _part_writeback(self, home: Ref, slot: Ref) -> tuple[Ref, Ref]:
        b = self.byte_bounds(home, self.gbpe)
        q = self.replica
        return self.part(home), Ref(slot.region, slot.offset + b[q], b[q + 1] - b[q])

    def fused(self, key: BlockKey) -> bool:
        """A split update is never fused into round 0's weight fetch: the whole block is
        updated (in parts) and gathered at home first, then fetched as usual."""
        return False if self.split_update else super().fused(key)
