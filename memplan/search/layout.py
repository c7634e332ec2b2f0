"""Planning for a number of GPUs, not a ring size: of every way to split G devices into R
replicas of a ring of N = G / R (N = 1: plain data parallelism; R = 1: one ring), the one whose
predicted tokens per second is highest under the per-device budgets and an optional cap on the
global batch. Each candidate is a ring planned as memplan.ring_plan plans it (every rank's own
plan, the faster of the planner's chunking and a full ring's), its step predicted by
ring_plan.predict_ring plus the replicas' gradient all-reduce; the alternatives are kept so a
user sees what was weighed. Pure Python: never imports array libraries, never touches a device;
the predictions are a model, not measurements."""

from __future__ import annotations

import dataclasses
import json

from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.plan import Budget, GradAccum, HardwareProfile, Where
from dataflow.memplan.plan.ranks import MAX_RANKS, PLACEMENTS, RankPlan
from dataflow.memplan.plan.split import split_memory_map
from dataflow.memplan.search.layout_chunkings import (fewer_resident_shapes, fewer_rounds_shapes,
                                                      full_ring_chunkings)
from dataflow.memplan.search.layout_final import best_of_each, compiled_tok_per_s
from dataflow.memplan.search.predict import (compiled_rank_plans, reduce_exposure_seconds,
                                            replica_prediction)
from dataflow.memplan.search.ring_overlap import (OVERLAP_DEPTHS, QUICK_OVERLAP_DEPTHS,
                                                  overlap_bytes, overlap_rank_plans)
from dataflow.memplan.search.ring_plan import (
    LINKS,
    Link,
    make_rank_plans,
    predict_ring,
    ring_profile,
)
from dataflow.memplan.search.search import make_plan
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.serial import to_json

PLACEMENT = "cyclic"
"""Layer i on rank i mod N: the default placement (docs/ring.md)."""

WEIGHED_PLACEMENTS = ("cyclic", "balanced")
"""The placements choose_layout weighs for a ring of two or more unless told otherwise (a
'placement' constraint fixes one): the faster predicted is kept, cyclic on a tie. predict_ring
follows the round's critical path, on which nothing runs beside the head (every rank waits for
its gradient), so the balanced walk's extra layers on the other ranks usually cost more than
the head's rank saves (8b at 8k on H100s: rings of 2 and 4 predict 2 % and 19 % behind cyclic;
simulate_ring agrees). 'contiguous' is never weighed: one visit per rank serialises the ring."""

PLACEMENT_MARGIN = 0.02
"""How far ahead of the cyclic ring another placement must be predicted to be chosen: 32b at
125 / 40 on 2 H100s (one chunk a round) predicts balanced 0.1 % ahead and simulates it 2 %
behind; the model does not resolve differences that small."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    gpus: int
    ring_size: int
    replicas: int
    placement: str
    tokens_per_step: int
    """The global batch: every replica's ring trains tokens_per_step / replicas tokens a step."""
    split_fetch: bool = False
    """The replicas split every streamed weight use's host copy among them and gather the parts
    from each other over the link (RankPlan.split_fetch; dataflow-ring --split-fetch)."""
    split_update: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})
    """The replicas (rings of any size) reduce-scatter their gradients and each updates its part
    alone, with AdamW state for that part only (RankPlan.split_update; dataflow-ring
    --split-update)."""
    vocab_parallel_head: bool = dataclasses.field(default=False,
                                                  metadata={"omit_if_default": True})
    """Every rank of the ring holds a shard of the head's vocabulary (RankPlan.vocab_parallel;
    dataflow-ring --vocab-parallel-head)."""
    round_overlap: int = dataclasses.field(default=0, metadata={"omit_if_default": True})
    """Local layers of the next round each rank runs during this round's drain, as deep as the
    ranks' device budgets allow (dataflow.memplan.search.ring_overlap; 0: rounds in turn, as
    with dataflow-plan --no-round-overlap). Predicted over the choosing link."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkPrediction:
    link: str
    tok_per_s: float
    speedup: float | None
    """Against one device under the same per-device budgets; None when one device does not fit."""
    bubble_frac: float
    """Share of the step each rank waits: an under-full ring's idle share plus the pipeline's
    fill and drain, over the step (0 for plain data parallelism)."""
    step_time_s: float
    allreduce_s: float
    """What the replicas' gradient all-reduce (or reduce-scatter) adds to a step: it runs in the
    last round where each block's gradient is final, and the compute stream waits for it. For
    replicas of one device, the time it adds to the compiled step (copy waits hide some); for
    rings of two or more, its whole wire time."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayoutOption:
    layout: Layout
    chunk_tokens: int
    chunks_per_round: int
    rounds_per_step: int
    predictions: tuple[LinkPrediction, ...]
    device_bytes: int
    host_bytes: int
    constraints: tuple[tuple[str, int], ...] = ()
    """What every rank's make_plan must be given to plan this option (a full ring's chunks per
    round, a capped batch's tokens per replica); empty for the planner's own chunking."""

    def on(self, link: str) -> LinkPrediction:
        return next(p for p in self.predictions if p.link == link)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayoutChoice:
    chosen: LayoutOption
    options: tuple[LayoutOption, ...]
    """Every layout that fit, fastest first over the choosing link."""
    refused: tuple[str, ...]
    """One line per ring size that was not possible, saying why."""
    single_tok_per_s: float | None
    link: str
    """The link the choice was made for."""
    rank_plans: tuple[RankPlan, ...] = dataclasses.field(repr=False, compare=False)
    """The chosen ring's plans (one per rank); not serialised."""

    def to_json_dict(self) -> dict:
        def one(o: LayoutOption) -> dict:
            return json.loads(to_json(o))

        layout = dataclasses.asdict(self.chosen.layout)
        for key in ("round_overlap", "split_update"):  # as before them: no key while off
            if not layout[key]:
                del layout[key]
        return {"layout": layout, "link": self.link,
                "single_tok_per_s": self.single_tok_per_s,
                "links": [dataclasses.asdict(p) for p in self.chosen.predictions],
                "chosen": one(self.chosen), "options": [one(o) for o in self.options],
                "refused": list(self.refused)}


def ring_sizes(gpus: int, n_layers: int) -> list[int]:
    """Ring sizes N that split `gpus` into whole replicas and hold at least a layer per rank."""
    return [n for n in range(1, gpus + 1) if gpus % n == 0 and n <= n_layers]


def allreduce_seconds(rp: RankPlan, replicas: int, link: Link) -> float:
    """One step's all-reduce of rank rp's owned gradients over `replicas` copies: a ring
    all-reduce moves 2 (R - 1) / R of the bytes each way over the link (a split update's
    reduce-scatter half that). The compiled step reduces a layer's and the head's gradient where
    its last round leaves the finished sum, in device memory (a slot that fetched the earlier
    rounds' sums, or the resident block: the copies are the schedule's own), so only an
    embedding gradient kept at home is reduced in host memory: NCCL takes it through a device
    staging buffer, across PCIe once each way. Zero for one replica."""
    if replicas == 1:
        return 0.0
    plan, cfg = rp.plan, rp.plan.model
    per = 4 if plan.grad_accum == GradAccum.FP32 else 2
    blocks = [cfg.layer_params for _ in plan.layers]
    if rp.has_embed:
        blocks.append(cfg.embed_params)
    if rp.has_head:
        blocks.append(cfg.head_params)
    total = sum(blocks) * per
    embed = cfg.embed_params * per * rp.has_embed  # all-reduced whole, even by a split update
    home = embed if rp.has_embed and plan.embed.grads == Where.HOME else 0
    prof = plan.profile
    staged = home / prof.h2d_bytes_per_s + home / prof.d2h_bytes_per_s
    wire = 2 * (replicas - 1) / replicas * total / link.bytes_per_s
    if rp.split_update:  # every block but the embedding reduce-scattered: half an all-reduce
        wire = (replicas - 1) / replicas * (total + embed) / link.bytes_per_s
    return wire + staged + len(blocks) * link.latency_s


def split_plans(rps: tuple[RankPlan, ...], replicas: int, link: Link,
                memo: dict | None = None, *, fetch: bool = True,
                update: bool = False, compiled: bool = False) -> tuple[RankPlan, ...]:
    """The ring's rank plans as replicas that split their weight fetches (`fetch`:
    RankPlan.split_fetch) and / or their update (`update`: RankPlan.split_update), each plan's
    prediction its stand-alone step compiled so, with its part copies and the gathers over
    `link` (ring_schedule.replica_prediction; compiled: scaling the compiled whole step's).
    Ranks of one kind (layers, embedding, head) are predicted once per `memo`."""
    memo = {} if memo is None else memo
    out = []
    for rp in rps:
        rp = dataclasses.replace(rp, replicas=replicas, split_fetch=fetch, split_update=update)
        kind = (len(rp.layers), rp.has_embed, rp.has_head, fetch, update)
        key = (*kind, link.name)
        if key not in memo:  # the compiled schedules and the whole timing: once for all links
            memo[key] = replica_prediction(rp, link.bytes_per_s, link.latency_s,
                                           memo.setdefault(kind, {}), from_schedule=compiled)
        out.append(dataclasses.replace(rp, plan=dataclasses.replace(rp.plan,
                                                                    prediction=memo[key])))
    return tuple(out)


def _streams_weights(rps: tuple[RankPlan, ...]) -> bool:
    return any(lp.weights is Where.HOME for rp in rps for lp in rp.plan.layers) or \
        any(rp.has_head and rp.plan.head.weights is Where.HOME for rp in rps)


def _option(rps: tuple[RankPlan, ...], gpus: int, replicas: int, links: tuple[Link, ...],
            single: float | None, constraints: dict, split_fetch: bool = False,
            overlap: bool = False, split_update: bool = False,
            compiled: dict | None = None) -> LayoutOption:
    """The layout's prediction over every link. split_fetch: replicas that stream weights
    split their fetches, the gathers crossing each link (over a slow link that costs more than
    it saves). overlap: the ring's rounds overlap where its budgets allow (predict_ring).
    split_update: replicas split their update (rank k of every replica its part of rank k's
    blocks: its part's AdamW and state, each rank predicted from its compiled split schedule;
    its memory the split replica's). compiled (a memo): every rank predicted from its compiled
    schedule (compiled_rank_plans), the final figures, a ring of one's gradient reduces timed
    in that schedule (reduce_exposure_seconds); None: the search's estimates, and the reduces
    charged whole after the step (allreduce_seconds)."""
    if compiled is not None:
        rps = compiled_rank_plans(rps, compiled)
    ch = rps[0].plan.chunking
    tokens = ch.tokens_per_step * replicas
    split = split_fetch and replicas > 1 and _streams_weights(rps)
    su = split_update and replicas > 1
    preds, memo, depth = [], {}, 0
    for link in links:
        ring_rps = split_plans(rps, replicas, link, memo, fetch=split, update=su,
                               compiled=compiled is not None) if split or su else rps
        ring = predict_ring(ring_rps, link, overlap=overlap)
        depth = max(depth, ring.overlap_depth)
        if compiled is not None and len(rps) == 1 and replicas > 1:
            # a ring of one's final figure: its reduces timed in its compiled step
            reduce_s = reduce_exposure_seconds(
                dataclasses.replace(ring_rps[0], replicas=replicas), link.bytes_per_s,
                link.latency_s, compiled)
        else:
            reduce_s = max(allreduce_seconds(rp, replicas, link) for rp in ring_rps)
        step = ring.step_time_s + reduce_s
        tok = tokens / step
        idle = (ring.step_time_s - ring.rank_step_time_s) / step if len(rps) > 1 else 0.0
        preds.append(LinkPrediction(
            link=link.name, tok_per_s=tok, speedup=tok / single if single else None,
            bubble_frac=max(0.0, idle), step_time_s=step, allreduce_s=reduce_s))
    return LayoutOption(
        layout=Layout(gpus=gpus, ring_size=len(rps), replicas=replicas,
                      placement=rps[0].placement,
                      tokens_per_step=tokens, split_fetch=split, split_update=su,
                      vocab_parallel_head=rps[0].vocab_parallel, round_overlap=depth),
        chunk_tokens=ch.chunk_tokens, chunks_per_round=ch.chunks_per_round,
        rounds_per_step=ch.rounds_per_step, predictions=tuple(preds),
        # with overlapped rounds the memory the overlap holds beside each rank's plan counts too
        device_bytes=max(_memory(rp, replicas, su).device_bytes + overlap_bytes(rp, depth)[0]
                         for rp in rps),
        host_bytes=max(_memory(rp, replicas, su).host_bytes + overlap_bytes(rp, depth)[1]
                       for rp in rps),
        constraints=tuple(sorted(constraints.items())))


def _memory(rp: RankPlan, replicas: int, split_update: bool):
    """The memory map of one of rp's replicas: with a split update its m / v for its part."""
    return split_memory_map(rp.plan, replicas) if split_update else rp.plan.memory


def _ring(memo: dict | None, cfg, seqlen, budget, profile, n: int, constraints: dict):
    """make_rank_plans, remembered in `memo` (refusals too) for the length of one report: the
    table for 2..64 GPUs plans the same rings again (every world of 4 or more processes
    reserves the same memory)."""
    if memo is None:
        return _plans(cfg, seqlen, budget, profile, n, constraints)
    key = (cfg, seqlen, budget, profile, n, tuple(sorted(constraints.items())))
    if key not in memo:
        try:
            memo[key] = _plans(cfg, seqlen, budget, profile, n, constraints)
        except (ConfigError, ValueError) as exc:
            memo[key] = exc
    got = memo[key]
    if isinstance(got, Exception):
        raise got
    return got


def _plans(cfg, seqlen, budget, profile, n: int, constraints: dict) -> tuple[RankPlan, ...]:
    """make_rank_plans, or with a 'round_overlap' depth among the constraints the plans that
    leave room for it (ring_overlap.overlap_rank_plans)."""
    rest = {k: v for k, v in constraints.items() if k != "round_overlap"}
    if constraints.get("round_overlap"):
        return overlap_rank_plans(cfg, seqlen, budget, profile, n, constraints["round_overlap"],
                                  **rest)
    return make_rank_plans(cfg, seqlen, budget, profile, n, **rest)


def _overlap_candidates(cfg, seqlen, budget, profile, n: int, candidates: list, link: Link,
                        memo: dict | None, quick: bool) -> list:
    """Beside a ring's candidates, the fastest of them (over `link`) planned again with room for
    OVERLAP_DEPTHS local layers of round overlap (QUICK_OVERLAP_DEPTHS when `quick`), where the
    ring has more than one round a step and the smaller device budget fits."""
    if n < 2 or not candidates:
        return []
    used, rps = max(candidates, key=lambda c: predict_ring(c[1], link, overlap=True).tok_per_s)
    if rps[0].plan.chunking.rounds_per_step < 2:
        return []
    out = []
    for depth in QUICK_OVERLAP_DEPTHS if quick else OVERLAP_DEPTHS:
        if depth > min(len(rp.layers) for rp in rps):
            break
        asked = dict(used, round_overlap=depth)
        if "chunks_per_round" not in asked:  # keep the chunking the room is made for
            ch = rps[0].plan.chunking
            asked.update(chunks_per_round=ch.chunks_per_round, chunk_tokens=ch.chunk_tokens)
        try:
            out.append((asked, _ring(memo, cfg, seqlen, budget, profile, n, asked)))
        except (ConfigError, ValueError):  # InfeasibleBudget included: no room for it
            break
    return out


def _candidates(cfg, seqlen, budget, profile, n: int, constraints: dict,
                placements: tuple[str, ...] = WEIGHED_PLACEMENTS, memo: dict | None = None,
                quick: bool = False):
    """(constraints, rank plans) of a ring of n with the planner's chunking and, when that leaves
    the ring under-full (fewer chunks per round than ranks), with a multiple of n chunks a round
    if that fits (the planner then trades recompute or host activations for the room); for each
    of `placements` unless the constraints fix one ('placement')."""
    if n > 1 and "placement" not in constraints and tuple(placements) != (PLACEMENT,):
        out, errors = [], []
        for placement in placements:
            try:
                out += _candidates(cfg, seqlen, budget, profile, n,
                                   dict(constraints, placement=placement), memo=memo,
                                   quick=quick)
            except ConfigError as exc:  # InfeasibleBudget included: refused if none fits
                errors.append(exc)
        if not out:
            raise errors[0]
        return out
    if constraints.get("placement") not in (*PLACEMENTS, None):
        raise ConfigError(f"unknown ring placement {constraints['placement']!r}; known: "
                          f"{', '.join(PLACEMENTS)}")
    if constraints.get("placement") == PLACEMENT or n == 1:  # the default: carried by nothing
        constraints = {k: v for k, v in constraints.items() if k != "placement"}
    base = _ring(memo, cfg, seqlen, budget, profile, n, constraints)
    out = [(constraints, base)]
    if n == 1:
        return out + _fewer_rounds(cfg, seqlen, budget, profile, constraints, base, memo)
    for shape in full_ring_chunkings(base[0].plan.chunking, n, constraints,
                                      few=quick or "placement" in constraints):
        full = dict(constraints, **shape)
        try:
            out.append((full, _ring(memo, cfg, seqlen, budget, profile, n, full)))
        except (ConfigError, ValueError):  # InfeasibleBudget included: these chunks do not fit
            pass
    return out


def _fewer_rounds(cfg, seqlen, budget, profile, constraints: dict, base, memo) -> list:
    """(constraints, rank plans) of one device's replica planned with its sequences in fewer,
    fuller rounds (layout_chunkings.fewer_rounds_shapes), and each of those and `base` with
    fewer resident layers (fewer_resident_shapes), where they fit."""
    def planned(asked):
        try:
            return [(asked, _ring(memo, cfg, seqlen, budget, profile, 1, asked))]
        except (ConfigError, ValueError):  # InfeasibleBudget included: the shape does not fit
            return []
    shaped = [(constraints, base)]
    for shape in fewer_rounds_shapes(base[0].plan.chunking, constraints):
        shaped += planned(dict(constraints, **shape))
    out = shaped[1:]
    for used, rps in shaped:
        plan = rps[0].plan
        for shape in fewer_resident_shapes(plan.chunking, plan.resident_layers, used):
            # the chunking kept: the cap is weighed against the same rounds
            out += planned(dict(used, chunks_per_round=plan.chunking.chunks_per_round, **shape))
    return out


def _ring_candidates(cfg, seqlen, budget, profile, n: int, constraints: dict,
                     vocab_parallel_head: bool, placements, memo, quick: bool,
                     round_overlap: bool, link: Link) -> tuple[list, list]:
    """(candidates, refusals) of a ring of n under `constraints` (`profile` the ring's): the
    planner's and full rings' chunkings (_candidates), with the vocabulary-parallel head too
    where asked, and the overlapped rounds' (_overlap_candidates) where asked."""
    variants = [constraints] + ([dict(constraints, vocab_parallel=True)]
                                if vocab_parallel_head and n > 1 else [])
    candidates, errors = [], []
    for asked in variants:
        try:
            candidates += _candidates(cfg, seqlen, budget, profile, n, asked, placements,
                                      memo=memo, quick=quick)
        except ConfigError as exc:  # InfeasibleBudget included
            errors.append(exc)
    if round_overlap and candidates:
        candidates += _overlap_candidates(cfg, seqlen, budget, profile, n, candidates, link,
                                          memo, quick)
    return candidates, errors


def choose_layout(cfg: ModelConfig, seqlen: int, budget: Budget, profile: HardwareProfile,
                  gpus: int, *, tokens_per_step: int | None = None, link: Link = LINKS[0],
                  links: tuple[Link, ...] = LINKS, transport: str = "nccl",
                  ring_size: int | None = None,
                  single_tok_per_s: float | None = ...,
                  constraints: dict | None = None,
                  placements: tuple[str, ...] = WEIGHED_PLACEMENTS,
                  memo: dict | None = None, quick: bool = False,
                  split_fetch: bool = False, vocab_parallel_head: bool = False,
                  round_overlap: bool = True, split_update: bool = False) -> LayoutChoice:
    """The fastest predicted split of `gpus` devices into replicas of a ring, over `link`.
    tokens_per_step caps the global batch (each replica then takes at most its share, in whole
    sequences); ring_size fixes the ring (and so the replicas). `placements`: how rings of two
    or more may deal their layers (WEIGHED_PLACEMENTS to weigh them; a 'placement' constraint
    fixes one; the option's constraints carry a placement other than cyclic). `quick` weighs
    a ring's chunking only as the planner chose it or rounded up to a full ring (not the
    smaller chunks and longer rounds of _full_ring_chunkings: a third of the planning time,
    for overviews such as dataflow-plan's table over 2..64 GPUs). split_fetch: replicas split
    their weight fetches (Layout.split_fetch; off unless asked for). vocab_parallel_head: rings
    of two or more are weighed with their head split over the vocabulary too (the option's
    constraints then carry vocab_parallel). round_overlap: rings overlap their rounds' drain
    with the next round's fill where the budgets allow (Layout.round_overlap; False: rounds in
    turn). split_update: replicas (of rings of any size) are weighed with their update split
    too (Layout.split_update), the faster kept. Raises ConfigError when no ring size fits, naming
    every refusal."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_RANKS:
        raise ConfigError(f"--gpus {gpus!r} is not a whole number in 1..{MAX_RANKS}")
    if tokens_per_step is not None and (isinstance(tokens_per_step, bool)
                                        or not isinstance(tokens_per_step, int)
                                        or tokens_per_step < seqlen):
        raise ConfigError(f"tokens per step {tokens_per_step!r} must be a whole number of at "
                          f"least one sequence ({seqlen:,} tokens)")
    if link not in links:
        links = (link, *links)
    if single_tok_per_s is ...:
        try:
            # one device in the ring's precision: the speedup compares like with like
            precision = (constraints or {}).get("precision", "bf16")
            single_tok_per_s = compiled_tok_per_s(make_plan(cfg, seqlen, budget, profile,
                                                             precision=precision))
        except InfeasibleBudget:  # a ring may fit where one device does not
            single_tok_per_s = None
    sizes = ring_sizes(gpus, cfg.n_layers)
    if ring_size is not None:  # the user fixed the split (--replicas): weigh only that one
        if ring_size not in sizes:
            raise ConfigError(f"{gpus} GPUs do not split into rings of {ring_size} for "
                              f"{cfg.name} ({cfg.n_layers} layers); ring sizes that work: "
                              f"{', '.join(map(str, sizes))}")
        sizes = [ring_size]
    options, refused, plans, made = [], [], {}, {}
    fixed = constraints
    for n in sizes:
        replicas = gpus // n
        constraints = dict(fixed or {})
        if tokens_per_step is not None:
            seqs = tokens_per_step // replicas // seqlen
            if seqs < 1:
                refused.append(f"{replicas} replicas of a ring of {n}: the cap of "
                               f"{tokens_per_step:,} tokens a step is under one sequence each")
                continue
            constraints["tokens_per_step"] = seqs * seqlen
        ring_prof = ring_profile(profile, gpus, transport, replicas)
        candidates, errors = _ring_candidates(
            cfg, seqlen, budget, ring_prof, n, constraints, vocab_parallel_head, placements,
            memo, quick, round_overlap, link)
        # Split-update replicas planned with m / v for their part from the start
        # (Plan.state_parts): what that frees goes to resident layers, activations and slots,
        # and layouts that fit only so are found. Searched twice: with the part's AdamW
        # charged, and with the whole one's (Decisions.whole_update_cost), since the search's
        # estimate rates a streamed layer's part update cheaper than its compiled split
        # schedule does (8b at 80 / 24 on 16-64 GPUs: the whole scoring's plans are faster).
        parted = [c for whole in (False, True) for c in _ring_candidates(
            cfg, seqlen, budget, ring_prof, n,
            dict(constraints, state_parts=replicas, **({"whole_update_cost": True}
                                                       if whole else {})),
            vocab_parallel_head, placements, memo, quick, round_overlap,
            link)[0]] if split_update and replicas > 1 else []
        if not candidates and not parted:
            refused.append(f"{replicas} replicas of a ring of {n}: "
                           f"{str(errors[0]).split(';')[0][:160]}")
            continue
        weighed = [(used, rps, False) for used, rps in candidates]
        if split_update and replicas > 1:  # the same replicas, update split
            weighed += [(used, rps, True) for used, rps in candidates + parted]
        for used, rps, su in weighed:
            try:
                opt = _option(rps, gpus, replicas, links, single_tok_per_s, used,
                              split_fetch, round_overlap, split_update=su)
            except ConfigError as exc:  # a model split updates refuse (MoE, say)
                refused.append(f"{replicas} split-update replicas: {str(exc)[:160]}")
                continue
            options.append(opt)
            made[id(opt)] = (rps, replicas, used, su)
            plans[id(opt)] = tuple(dataclasses.replace(rp, replicas=replicas, split_update=True)
                                   for rp in rps) if su else rps
    if not options:
        raise ConfigError(
            f"no split of {gpus} GPUs fits {budget.host_bytes / 2**30:g} GiB host and "
            f"{budget.device_bytes / 2**30:g} GiB device each for {cfg.name} at seqlen "
            f"{seqlen}:\n  " + "\n  ".join(refused))
    # One option per layout (the faster chunking and placement of a ring size), fastest first;
    # another placement than cyclic must be PLACEMENT_MARGIN ahead; replicas of one device
    # are chosen by their compiled figures (layout_final)
    def merit(o: LayoutOption) -> float:
        tok = o.on(link.name).tok_per_s
        return tok if o.layout.placement == PLACEMENT else tok / (1.0 + PLACEMENT_MARGIN)

    def again(o: LayoutOption, timed={}) -> LayoutOption:  # noqa: B006 - one memo a choice
        rps, replicas, used, su = made[id(o)]
        new = _option(rps, gpus, replicas, links, single_tok_per_s, used, split_fetch,
                      round_overlap, split_update=su, compiled=timed)
        plans[id(new)] = plans[id(o)]
        return new
    best = best_of_each(options, merit, again)
    ranked = sorted(best.values(), key=lambda o: -o.on(link.name).tok_per_s)
    chosen = ranked[0]
    return LayoutChoice(chosen=chosen, options=tuple(ranked), refused=tuple(refused),
                        single_tok_per_s=single_tok_per_s, link=link.name,
                        rank_plans=plans[id(chosen)])


def predict_layout(cfg: ModelConfig, seqlen: int, budget: Budget, profile: HardwareProfile,
                   gpus: int, ring_size: int, *, links: tuple[Link, ...] = LINKS,
                   transport: str = "nccl", split_fetch: bool = False,
                   round_overlap: bool = False, split_update: bool = False,
                   overlap_depth: int = 0, **constraints) -> LayoutOption:
    """The prediction of one given layout (gpus / ring_size replicas of a ring of ring_size),
    its ranks planned under `constraints` (a run's chunking, say; vocab_parallel, state_parts
    and whole_update_cost among them as make_rank_plans takes them), the replicas splitting
    their fetches and / or their update as asked: what a benchmark compares its measurement
    with. overlap_depth: the ranks planned with room for that many local layers of overlapped
    rounds (overlap_rank_plans, as dataflow-ring --round-overlap D plans them) and predicted
    overlapped; round_overlap alone: the given plans' rounds overlapped where they allow."""
    if gpus % ring_size:
        raise ConfigError(f"{gpus} GPUs do not split into rings of {ring_size}")
    replicas = gpus // ring_size
    if overlap_depth:
        constraints = dict(constraints, round_overlap=overlap_depth)
        round_overlap = True
    rps = _plans(cfg, seqlen, budget, ring_profile(profile, gpus, transport, replicas),
                 ring_size, constraints)
    try:
        single = compiled_tok_per_s(make_plan(cfg, seqlen, budget, profile))
    except InfeasibleBudget:
        single = None
    return _option(rps, gpus, gpus // ring_size, links, single, constraints, split_fetch,
                   round_overlap, split_update=split_update,
                   compiled={} if ring_size == 1 else None)


def layout_text(choice: LayoutChoice) -> str:
    """The choice and the alternatives weighed, one line each, over the choosing link."""
    c = choice.chosen.layout
    alone = ("does not fit" if choice.single_tok_per_s is None
             else f"{choice.single_tok_per_s:,.0f} tok/s")
    shape = (f"{c.replicas} replicas of a ring of {c.ring_size}" if c.replicas > 1 and c.ring_size > 1
             else f"{c.replicas} data-parallel replicas (rings of 1)" if c.ring_size == 1
             else f"one ring of {c.ring_size}")
    head = ", vocabulary-parallel head" if c.vocab_parallel_head else ""
    head += ", split update" if c.split_update else ""
    lines = [f"layout for {c.gpus} GPUs over {choice.link}: {shape}, {c.placement} layers{head}, "
             f"{c.tokens_per_step:,} tokens a step (one device at these budgets: {alone})",
             f"  {'ring':>4} {'replicas':>8} {'chunk':>6} {'C x rounds':>11} {'tokens/step':>12} "
             f"{'head':>5} {'ovl':>3} "
             f"{'tok/s':>10} "
             f"{'speedup':>8} {'bubble':>7} {'all-reduce s':>12} {'dev GiB':>8} {'host GiB':>9}"]
    for o in choice.options:
        p = o.on(choice.link)
        mark = "*" if o is choice.chosen else " "
        speed = "n/a" if p.speedup is None else f"{p.speedup:.2f}x"
        lines.append(f" {mark}{o.layout.ring_size:>4} {o.layout.replicas:>8} "
                     f"{o.chunk_tokens:>6} {o.chunks_per_round:>4} x {o.rounds_per_step:<4} "
                     f"{o.layout.tokens_per_step:>12,} "
                     f"{'vocab' if o.layout.vocab_parallel_head else 'one':>5} "
                     f"{o.layout.round_overlap:>3} "
                     f"{p.tok_per_s:>10,.0f} {speed:>8} "
                     f"{p.bubble_frac:>6.1%} {p.allreduce_s:>12.3f} "
                     f"{o.device_bytes / 2**30:>8.2f} {o.host_bytes / 2**30:>9.2f}")
    for r in choice.refused:
        lines.append(f"  not possible: {r}")
    return "\n".join(lines)
