"""A ring's layer placement and a rank's plan: which global layers rank r of N owns (cyclic,
balanced or contiguous walks of the ring), where the embedding and the head live, the model a
rank plans, and the RankPlan that carries its single-device plan. Pure data and arithmetic:
never searches, never compiles a schedule, never imports array libraries."""

from __future__ import annotations

import dataclasses
import enum

from dataflow.memplan.plan.plan import Plan
from dataflow.models import serial
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError

MAX_RANKS = 64


def check_ring(n_layers: int, n_ranks: int, rank: int | None = None, replicas: int = 1) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas:
        raise ConfigError(f"replicas {replicas!r} is not a whole number >= 1")
    if isinstance(n_ranks, int) and n_ranks * replicas > MAX_RANKS:
        raise ConfigError(f"{replicas} replicas of a ring of {n_ranks} make {n_ranks * replicas} "
                          f"processes; at most {MAX_RANKS}")
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or not 1 <= n_ranks <= MAX_RANKS:
        raise ConfigError(f"ring size {n_ranks!r} is not a whole number in 1..{MAX_RANKS}")
    if n_ranks > n_layers:
        raise ConfigError(f"a ring of {n_ranks} needs at least {n_ranks} layers (layer i lives on "
                          f"rank i mod N) but the model has {n_layers}; use at most "
                          f"{n_layers} ranks")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                             or not 0 <= rank < n_ranks):
        raise ConfigError(f"rank {rank!r} is outside a ring of {n_ranks}; use 0..{n_ranks - 1}")


class Placement(str, enum.Enum):
    """How a ring deals its layers (layer_owners): CYCLIC, layer i on rank i mod N; BALANCED, a
    walk around the ring in which the head's rank owns fewer layers, by the head's cost in
    layers; CONTIGUOUS, the balanced counts in one block per rank. A str enum that prints and
    serialises as its value ('cyclic'), so plan JSON and CLI text read as before; strings from
    the CLI or constraints are parsed once, by parse_placement."""

    CYCLIC = "cyclic"
    BALANCED = "balanced"
    CONTIGUOUS = "contiguous"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


PLACEMENTS = tuple(p.value for p in Placement)
"""The placements' names, as the CLI and constraints spell them."""


def parse_placement(placement: Placement | str) -> Placement:
    """`placement` as a Placement, or a ConfigError naming the known ones."""
    try:
        return Placement(placement)
    except ValueError:
        raise ConfigError(f"unknown ring placement {placement!r}; known: "
                          f"{', '.join(PLACEMENTS)}") from None


def layer_owners(n_layers: int, n_ranks: int, placement: Placement | str = Placement.CYCLIC,
                 head_layers: float = 0.0) -> tuple[int, ...]:
    """The rank owning each global layer: a walk around the ring (each layer on the rank of the
    one before or on the next rank, (r+1) mod N) from rank 0 (layer 0, beside the embedding) to
    the head's rank (layer L-1). 'cyclic': layer i on rank i mod N. 'balanced': the head's rank
    N-1 owns n_h layers and the others share the rest as evenly as they can (extra layers to the
    lower ranks), n_h chosen so that no rank's layers (the head's rank's plus `head_layers`, the
    head's cost in layers) exceed the least they can; n_h laps 0, 1, .., N-1, each rank's extra
    layers spread over its visits as runs of consecutive layers. 'contiguous': the same counts
    in one visit per rank. Example: 32 layers, N = 2, head worth 2 layers: rank 0 owns 17,
    rank 1 owns 15 (15 laps; two of rank 0's visits hold two layers)."""
    check_ring(n_layers, n_ranks)
    placement = parse_placement(placement)
    if placement is Placement.CYCLIC or n_ranks == 1:
        return tuple(i % n_ranks for i in range(n_layers))
    if not head_layers >= 0:  # also NaN
        raise ConfigError(f"the head's cost in layers must be >= 0, got {head_layers!r}")
    n, others = n_layers, n_ranks - 1

    def counts(n_h: int) -> list[int]:
        q, extra = divmod(n - n_h, others)
        return [q + (r < extra) for r in range(others)] + [n_h]

    # the most layers any rank runs (the head's rank with the head), least first; of equal
    # loads the head's rank keeps more layers (fewer runs, closer to the cyclic walk)
    best = min(range(1, n - others + 1),
               key=lambda n_h: (max(max(counts(n_h)[:-1]), n_h + head_layers), -n_h))
    per_rank = counts(best)
    laps = 1 if placement is Placement.CONTIGUOUS else min(per_rank)
    owners = []
    for lap in range(laps):
        for r, count in enumerate(per_rank):
            extra = count - laps  # spread over the laps: visit `lap` holds 1 + its share
            owners += [r] * (1 + (lap + 1) * extra // laps - lap * extra // laps)
    assert len(owners) == n_layers and owners[0] == 0 and owners[-1] == n_ranks - 1
    return tuple(owners)


def owned_layers(n_layers: int, n_ranks: int, rank: int,
                 owners: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Global indices of the layers rank `rank` owns, in forward order (`owners`: the
    layer_owners of a placement; None: cyclic)."""
    check_ring(n_layers, n_ranks, rank)
    if not owners:
        return tuple(range(rank, n_layers, n_ranks))
    return tuple(i for i, r in enumerate(owners) if r == rank)


def routing_chain(n_layers: int, n_ranks: int, owners: tuple[int, ...] | None = None
                  ) -> tuple[int, ...] | None:
    """The ranks in the order of their last layers (the head's last): the path an MoE model's
    partial routing totals take after each rank's last forward of a round, and back from the
    head before the backward (dataflow.memplan.step.ring_compile). None where that order is not the
    ring's (each rank's successor must be its next neighbour, the only rank it sends
    forward to): then the placement cannot carry MoE layers."""
    last = {}
    for layer, r in enumerate(owners or layer_owners(n_layers, n_ranks)):
        last[r] = layer
    chain = tuple(sorted(last, key=last.get))
    if len(chain) != n_ranks or any(b != (a + 1) % n_ranks for a, b in zip(chain, chain[1:])):
        return None
    return chain


def embed_rank(n_layers: int, n_ranks: int) -> int:
    """The rank holding the embedding: the owner of layer 0 (no hop before the first layer),
    rank 0 in every placement."""
    return 0


def head_rank(n_layers: int, n_ranks: int, owners: tuple[int, ...] | None = None) -> int:
    """The rank holding the final norm and lm_head: the owner of layer L-1 (`owners` as
    owned_layers')."""
    return owners[-1] if owners else (n_layers - 1) % n_ranks


def head_rows(vocab_size: int, n_ranks: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of the lm_head that rank `rank` of a vocabulary-parallel ring of
    `n_ranks` holds: consecutive shards, the first vocab_size % n_ranks one row longer (the
    arithmetic of dataflow.kernels.reference.head_vocab.shard_rows, which memplan may not
    import)."""
    if not 1 <= n_ranks <= vocab_size or not 0 <= rank < n_ranks:
        raise ConfigError(f"a vocabulary of {vocab_size} rows cannot be split over {n_ranks} "
                          f"ranks (rank {rank}); use at most {vocab_size} ranks")
    base, extra = divmod(vocab_size, n_ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def refuse_vocab_parallel(cfg: ModelConfig, n_ranks: int) -> None:
    """The combinations the vocabulary-parallel head does not run yet (on a ring of n_ranks),
    refused by name."""
    if cfg.tie_embeddings:
        raise ConfigError(f"--vocab-parallel-head: model '{cfg.name}' ties its head to the "
                          "embedding, which the vocabulary-parallel head does not split yet; "
                          "leave the flag off (train it on one GPU or as replicas)")
    if cfg.moe is not None:
        raise ConfigError(f"--vocab-parallel-head: model '{cfg.name}' is a mixture of experts, "
                          "whose ring passes routing totals through the head's rank; the "
                          "vocabulary-parallel head does not run with it yet: leave the flag off")


def rank_model(cfg: ModelConfig, n_ranks: int, rank: int,
               owners: tuple[int, ...] | None = None, vocab_parallel: bool = False) -> ModelConfig:
    """The model one rank plans: the same shapes with only its own layers (its plan holds only
    the embedding and head it owns: make_plan's holds_embed / holds_head). With
    `vocab_parallel` every rank's head holds its shard of the lm_head rows (head_rows)."""
    n = len(owned_layers(cfg.n_layers, n_ranks, rank, owners))
    if n_ranks == 1:
        return cfg
    rows = 0
    if vocab_parallel:
        a, b = head_rows(cfg.vocab_size, n_ranks, rank)
        rows = b - a
    return dataclasses.replace(cfg, name=f"{cfg.name}@rank{rank}of{n_ranks}", n_layers=n,
                               head_vocab_rows=rows)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    rank: int
    n_ranks: int
    layers: tuple[int, ...]
    """Global layer indices owned, in forward order; local layer j is global layer layers[j]."""
    has_embed: bool
    has_head: bool
    n_layers: int
    """Layers of the whole model."""
    plan: Plan
    """The single-device plan of this rank's model (rank_model) under the per-device budgets."""
    replicas: int = 1
    """Data-parallel copies of the whole ring: R rings of N ranks train R slices of the global
    batch, and each gradient is summed over the R copies of its rank before the optimizer."""
    placement: Placement = dataclasses.field(default=Placement.CYCLIC,
                                             metadata={"omit_if_default": True})
    """How the ring deals its layers; plans written before placements were cyclic."""
    owners: tuple[int, ...] = dataclasses.field(default=(), metadata={"omit_if_default": True})
    """The owner of every global layer (layer_owners); empty for the cyclic placement."""
    split_fetch: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})
    """With replicas: each replica fetches 1/R of every streamed weight use over its own host
    link and gathers the other parts from the other replicas (their weights are the same bits),
    so the replicas of one host share its copies instead of each moving the whole model
    (dataflow.memplan.step.ring_compile, docs/ring.md)."""
    split_update: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})
    """With replicas (rings of any size; shared memory, NumPy backend): each of this rank's
    blocks' last-round gradient is reduce-scattered over the R replicas' rank `rank` (the
    ranks that hold the block), replica q keeps the reduced part q (a run of whole 1,024-element
    sub-blocks: dataflow.memplan.plan.split), runs AdamW on that part alone with m / v for that
    part only, and the updated weight parts are gathered into every replica's weights; the
    embedding stays all-reduced and updated whole (docs/ring.md "Split updates"). The planner
    counts it (dataflow.memplan.search.layout, choose_layout(split_update=True))."""
    vocab_parallel: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})
    """Every rank holds a shard of the lm_head rows (head_rows) and computes the logits and
    loss over it; the head's rank (has_head: the final norm, the loss sums) sends each chunk's
    normed hidden state round the ring, the ranks merge their per-token max and sum-exp and sum
    their partial input gradients along it in a fixed order (dataflow.memplan.step.ring_vocab,
    docs/ring.md "The vocabulary-parallel head")."""
    round_overlap: int = dataclasses.field(default=0, metadata={"omit_if_default": True})
    """Local layers of the next round this rank runs during a round's drain (issue 56), their
    saved activations beside the round's: the plan was made under the device budget less what
    they hold (dataflow.memplan.search.ring_overlap.overlap_rank_plans). Run by the compiled
    ring step (dataflow.memplan.step.ring_rounds) where it is built; refused by name elsewhere."""

    @property
    def ring_owners(self) -> tuple[int, ...]:
        """The owner of every global layer, whatever the placement."""
        return self.owners or layer_owners(self.n_layers, self.n_ranks)

    @property
    def holds_head_block(self) -> bool:
        """Whether this rank holds a head block: the head's rank, or every rank of a
        vocabulary-parallel head (its shard of the rows)."""
        return self.has_head or self.vocab_parallel

    @property
    def head_owner(self) -> int:
        """The rank of this ring that holds the head (head_rank)."""
        return head_rank(self.n_layers, self.n_ranks, self.owners)

    def to_json(self) -> str:
        return serial.to_json(self)


def moe_routing_chain(name: str, n_layers: int, n_ranks: int, owners: tuple[int, ...],
                      placement: Placement) -> tuple[int, ...]:
    """routing_chain, or a ConfigError naming the placement where the ranks' last layers do not
    follow the ring (the planner refuses such a ring, and so does a hand-made rank's compiler)."""
    chain = routing_chain(n_layers, n_ranks, owners)
    if chain is None:
        raise ConfigError(f"model '{name}': the {placement} placement over {n_ranks} ranks gives "
                          "the ranks' last layers an order that is not the ring's, which the "
                          "routing totals of its MoE layers must follow; use --placement cyclic "
                          "or contiguous")
    return chain
