"""Chooses the fastest predicted Plan for a model, sequence length and budgets. Never imports
array libraries, never touches a device, never reads the clock.

The candidates (candidates.py) do not depend on the budgets: the answer for a budget is the
fastest candidate that fits it, found exactly by scoring candidates in order of a lower bound
on their time. So more memory never predicts less throughput than a smaller budget's plan was
ranked at (the longer head sub-chunk a chosen plan takes afterward, _longer_head_sub, is outside
the ranking), and the smallest budgets named in errors are exact over the same candidate set."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.chunking import (
    MAX_ROUND_TOKENS,
    ROUND_MULTIPLES,
    _divisors,
    check_seqlen,
    chunk_candidates,
    chunk_target_tokens,
    head_sub_choices,
)
from dataflow.memplan.plan.decisions import refuse_moe
from dataflow.memplan.plan.errors import InfeasibleBudget, categories_text, gib_up, size_text
from dataflow.memplan.plan.frozen import as_frozen
from dataflow.memplan.plan.lora import as_lora, base_frozen, refuse_unsupported
from dataflow.memplan.plan.memory import memory_map
from dataflow.memplan.plan.plan import (
    AttentionBwd,
    Precision,
    Budget,
    GradAccum,
    HardwareProfile,
    OptimizerWhere,
    Plan,
)
from dataflow.memplan.plan.profiles import get_profile
from dataflow.memplan.search.build import build_plan, finish_segment_plan, validate_budget
from dataflow.memplan.search.candidates import (
    Candidate,
    Score,
    Table,
    candidate_table,
    segment_table,
)
from dataflow.memplan.search.layout_chunkings import FEWER_ROUNDS_FROM, fewer_resident_shapes
from dataflow.memplan.search.layout_final import compiled_tok_per_s
from dataflow.memplan.search.cost import (
    DEFAULT_OPT_TARGET_FRAC,
    MAX_ROUNDS_PER_STEP,
    segment_recompute,
)
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.flops import SavedLevel

__all__ = ["build_plan", "make_plan", "minimum_budgets", "MinimumBudgets", "CONSTRAINTS",
           "BATCH_CONSTRAINTS", "batch_chunkings", "global_batch"]

CONSTRAINTS = ("chunk_tokens", "chunks_per_round", "rounds_per_step", "target_optimizer_frac",
               "home_optimizer", "max_resident_layers", "attention_bwd", "holds_embed",
               "holds_head", "kv_rebuild", "segments", "precision", "freeze", "lora",
               "state_parts", "whole_update_cost")
BATCH_CONSTRAINTS = ("seqs_per_step", "tokens_per_step")
"""The trainer's global batch: the planner keeps it and chooses chunks and rounds around it."""
TIE_REL = 1e-9
"""Predictions this close count as a tie (broken by fewer PCIe bytes, then less memory)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MinimumBudgets:
    """The smallest budgets that work together, exactly and as messages name them.

    `device_bytes`: no smaller device budget works with any host budget; `host_bytes`: no
    smaller host budget works with a device budget of `device_bytes`. `device_gib`,
    `host_gib`: the same at 0.1 GiB resolution (rounded up; the host minimum is taken within a
    device budget of `device_gib`, so it may be smaller than `host_bytes`)."""

    device_bytes: int
    host_bytes: int
    device_gib: float
    host_gib: float


def _segments_allowed(constraints: dict) -> tuple[dict, bool]:
    """(the constraints without `segments`, whether layer-segment recompute may be planned):
    False for a ring rank, whose consecutive local layers are not consecutive in the model."""
    rest = dict(constraints)
    allowed = rest.pop("segments", True)
    if not isinstance(allowed, bool):
        raise ConfigError(f"constraint segments must be True or False, got {allowed!r}")
    return rest, allowed


def _options(cfg: ModelConfig, constraints: dict) -> tuple:
    unknown = sorted(set(constraints) - set(CONSTRAINTS))
    if unknown:
        raise ConfigError(f"unknown plan constraints {unknown}; known: {', '.join(CONSTRAINTS)}")
    opts = dict(constraints)
    for key in ("chunk_tokens", "chunks_per_round", "rounds_per_step"):
        v = opts.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(f"constraint {key} must be a positive integer, got {v!r}")
    if opts.get("rounds_per_step", 1) > MAX_ROUNDS_PER_STEP:
        raise ConfigError(f"rounds_per_step {opts['rounds_per_step']} exceeds "
                          f"{MAX_ROUNDS_PER_STEP}; use longer chunks or more chunks per round")
    frac = opts.get("target_optimizer_frac", DEFAULT_OPT_TARGET_FRAC)
    if not isinstance(frac, (int, float)) or not 0 < frac < 1:
        raise ConfigError(f"target_optimizer_frac must be in (0, 1), got {frac!r}")
    opt = opts.get("home_optimizer")
    if opt is not None:
        opt = OptimizerWhere(opt) if not isinstance(opt, OptimizerWhere) else opt
        if opt is OptimizerWhere.DEVICE:
            raise ConfigError("home_optimizer must be 'streamed' or 'host' (home blocks cannot "
                              "run AdamW over device-resident state)")
        opts["home_optimizer"] = opt
    cap = opts.get("max_resident_layers", cfg.n_layers)
    if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= cfg.n_layers:
        raise ConfigError(f"max_resident_layers must be in 0..{cfg.n_layers}, got {cap!r}")
    opts["max_resident_layers"], opts["target_optimizer_frac"] = cap, float(frac)
    for key in ("holds_embed", "holds_head"):  # a ring rank's: see Plan.holds_embed
        v = opts.get(key, True)
        if not isinstance(v, bool):
            raise ConfigError(f"constraint {key} must be True or False, got {v!r}")
        opts[key] = v
    parts = opts.get("state_parts", 1)  # Plan.state_parts: a split-update replica's
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ConfigError(f"constraint state_parts must be a whole number of replicas, 1 or "
                          f"more, got {parts!r}")
    opts["state_parts"] = parts
    whole = opts.get("whole_update_cost", False)  # Decisions.whole_update_cost
    if not isinstance(whole, bool):
        raise ConfigError(f"constraint whole_update_cost must be True or False, got {whole!r}")
    opts["whole_update_cost"] = whole
    rebuild = opts.get("kv_rebuild")
    if rebuild is not None and not isinstance(rebuild, bool):
        raise ConfigError(f"constraint kv_rebuild must be True, False or None (the search "
                          f"decides), got {rebuild!r}")
    precision = opts.get("precision", Precision.BF16)
    try:
        opts["precision"] = Precision(precision)
    except ValueError:
        raise ConfigError(f"precision must be one of {[x.value for x in Precision]}, got "
                          f"{precision!r}") from None
    opts["freeze"] = as_frozen(opts.get("freeze"), cfg.n_layers)  # Plan.frozen
    opts["lora"] = as_lora(opts.get("lora"))  # Plan.lora: the base frozen whole
    if opts["lora"] is not None:
        refuse_unsupported(cfg, opts["lora"], precision=opts["precision"])
        if opts["freeze"] and opts["freeze"] != base_frozen(cfg):
            raise ConfigError(f"LoRA freezes the whole base model; freeze "
                              f"'{opts['freeze'].spec()}' asks for part of it; drop --freeze")
        opts["freeze"] = base_frozen(cfg)
    attn = opts.get("attention_bwd", AttentionBwd.DETERMINISTIC)
    try:
        opts["attention_bwd"] = AttentionBwd(attn)
    except ValueError:
        raise ConfigError(f"attention_bwd must be one of "
                          f"{[a.value for a in AttentionBwd]}, got {attn!r}") from None
    return tuple(sorted(opts.items(), key=lambda kv: kv[0]))


_SKELETON_MOVES = ("resident", "weight_slot", "grad_slot", "act_slot", "embed", "head", "opt")
def _table(cfg, seqlen, profile, grad_accum, constraints, *, segments: bool = False) -> Table:
    """The plain candidates, or with `segments` the layer-segment recompute ones."""
    if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen <= 0:
        raise ConfigError(f"seqlen must be a positive integer, got {seqlen!r}")
    make = segment_table if segments else candidate_table
    return make(cfg, seqlen, profile, grad_accum, _options(cfg, constraints))


def _boundary_keeps_attention(layer: int, chunk: int) -> SavedLevel:
    """Every boundary at INP_ATTN: its re-run the cheapest (a floor must not overcount)."""
    return SavedLevel.INP_ATTN


def _segment_floor(table: Table) -> float:
    """No segment plan of this request predicts fewer seconds per token: every one adds a
    forward of each layer in a segment of two or more to the plain compute, a boundary's
    without attention at best (search.py asks for the segment candidates only when the best
    plain plan is slower than this)."""
    floors = []
    for sp in table.spaces:
        extra = min((sum(segment_recompute(sp.costs, sp.L, k, _boundary_keeps_attention)[0])
                     for k in range(2, sp.L + 1)), default=float("inf"))
        floors.append((sp.compute_round_s + extra) / sp.ch.tokens_per_round)
    return min(floors, default=float("inf"))


def _profile(profile: HardwareProfile | None) -> HardwareProfile:
    if profile is None:
        return get_profile()
    return profile


def _decisions(table: Table, c: Candidate):
    return table.spaces[c.space].decisions(c.state, table.score(c).rounds_per_step)


def make_plan(cfg: ModelConfig, seqlen: int, budget: Budget, profile: HardwareProfile | None = None,
              *, grad_accum: GradAccum = GradAccum.BF16, **constraints) -> Plan:
    """The fastest predicted plan that fits `budget`. Constraints (all optional): chunk_tokens,
    chunks_per_round, rounds_per_step, target_optimizer_frac (default 0.02), home_optimizer
    ('streamed' or 'host'), max_resident_layers, attention_bwd ('deterministic', the default,
    or 'fast': see AttentionBwd), kv_rebuild (True / False; by default the search tries both
    for split sequences: see Plan.kv_rebuild), holds_embed and holds_head (False for a ring
    rank that does not own the embedding / head: dataflow.memplan.search.ring_plan), freeze (a
    spec such as 'embed,head,layers:0-29' or a Frozen: Plan.frozen), and the trainer's global
    batch as seqs_per_step or tokens_per_step (a multiple of seqlen): the plan then takes
    exactly that many sequences per step (chunks x rounds chosen to fit it). Raises
    InfeasibleBudget naming the smallest budgets that work."""
    refuse_moe(cfg, holds_embed=constraints.get("holds_embed", True),
               holds_head=constraints.get("holds_head", True))
    check_plan_size(cfg)
    profile = _profile(profile)
    validate_budget(budget)
    if cfg.sliding_window is not None and seqlen > cfg.sliding_window:
        raise ConfigError(f"{cfg.name} attends over a sliding window of {cfg.sliding_window:,} "
                          f"tokens, and seqlen {seqlen:,} is longer: the kernels compute full "
                          f"causal attention, which would train another model; use seqlen "
                          f"{cfg.sliding_window:,} or less")
    constraints = dict(constraints)
    batch = global_batch(seqlen, constraints.pop("seqs_per_step", None),
                         constraints.pop("tokens_per_step", None))
    if batch is not None:
        return _plan_for_batch(cfg, seqlen, budget, profile, grad_accum, constraints, batch)
    plan = _best_plan(cfg, seqlen, budget, profile, grad_accum, constraints)
    chunk = ML_DATAFLOW_LIKE["chunk_tokens"]
    shaping = {k: v for k, v in constraints.items()
               if k not in ("attention_bwd", "segments", "precision", "freeze", "lora",
                            "state_parts", "whole_update_cost")}
    if (shaping or cfg.model_dim < 2048 or (seqlen % chunk and chunk % seqlen)
            or plan.prediction.h2d_bytes == 0):
        return plan
    # The greedy candidate chains can miss ml_dataflow's own fixed configuration (seen for 8b at
    # 64k); score it too for the large models it was designed for, so the search never predicts
    # less than the design it means to beat.
    try:
        fixed = _best_plan(cfg, seqlen, budget, profile, grad_accum,
                           dict(ML_DATAFLOW_LIKE, **constraints))
    except ConfigError:  # InfeasibleBudget included
        return plan
    return fixed if fixed.prediction.tok_per_s > plan.prediction.tok_per_s else plan


MAX_PLAN_LAYERS = 1024
"""The most layers the planner searches. Its time grows faster than linearly with n_layers
(measured on a 2-core CPU for the tiny shape: 0.8 s at 128 layers, 3 s at 512, 6 s at 1,024,
18 s at 2,048; docs/planner.md), and no model anyone trains comes close (the largest released
dense models have about 126 layers): a config.json saying 1,000,000 is a typo, refused at
once instead of searching for hours."""


def check_plan_size(cfg: ModelConfig) -> None:
    """Refuse a model with more layers than MAX_PLAN_LAYERS, before any search, by name."""
    if cfg.n_layers > MAX_PLAN_LAYERS:
        raise ConfigError(f"model '{cfg.name}' has {cfg.n_layers:,} layers; the planner searches "
                          f"at most {MAX_PLAN_LAYERS:,} (its time grows faster than the layer "
                          f"count: about 6 s at 1,024 layers on a small CPU, hours at "
                          f"1,000,000); check num_hidden_layers / n_layers in the config")


ML_DATAFLOW_LIKE = {"chunk_tokens": 16384, "max_resident_layers": 0, "home_optimizer": "streamed"}
"""ml_dataflow's fixed heuristics (16k-token chunks, every layer's state at home, AdamW streamed
through the device), as search constraints."""


def global_batch(seqlen: int, seqs_per_step=None, tokens_per_step=None) -> int | None:
    """Sequences per step from either spelling of the trainer's batch (None when neither)."""
    for name, v in (("seqs_per_step", seqs_per_step), ("tokens_per_step", tokens_per_step)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(f"{name} must be a positive whole number, got {v!r}")
    seqs = seqs_per_step
    if tokens_per_step is not None:
        if tokens_per_step % seqlen:
            lo = max(1, tokens_per_step // seqlen)
            raise ConfigError(f"tokens_per_step {tokens_per_step:,} is not a multiple of seqlen "
                              f"{seqlen:,}; try {lo * seqlen:,} or {(lo + 1) * seqlen:,}")
        if seqs is not None and seqs * seqlen != tokens_per_step:
            raise ConfigError(f"seqs_per_step {seqs} and tokens_per_step {tokens_per_step:,} "
                              f"disagree at seqlen {seqlen:,}; give one of them")
        seqs = tokens_per_step // seqlen
    return seqs


def batch_chunkings(cfg: ModelConfig, seqlen: int, seqs: int,
                    constraints: dict) -> list[tuple[int, int, int]]:
    """(chunk_tokens, chunks_per_round, rounds_per_step) choices that take exactly `seqs`
    sequences per step: chunks near the usual sizes whose sequences per round divide `seqs`,
    1, 2 or 4 sequences' worth of chunks per round, at most MAX_ROUNDS_PER_STEP rounds, and
    whatever chunk_tokens / chunks_per_round / rounds_per_step the caller fixed."""
    check_seqlen(seqlen)
    fixed = {k: constraints.get(k) for k in ("chunk_tokens", "chunks_per_round",
                                             "rounds_per_step")}
    sizes = chunk_candidates(cfg, seqlen)
    out = []
    if seqlen <= chunk_target_tokens(cfg):  # whole sequences packed per chunk
        divs = [d for d in _divisors(seqs) if d * seqlen <= max(MAX_ROUND_TOKENS, seqlen)]
        want = sorted({t // seqlen for t in sizes})
        per_chunk = {k for k in want if seqs % k == 0}
        for k in want:  # the divisors of the batch nearest each usual size
            per_chunk.add(max((d for d in divs if d <= k), default=1))
            per_chunk.add(min((d for d in divs if d >= k), default=divs[-1]))
        if fixed["chunk_tokens"]:
            per_chunk = {fixed["chunk_tokens"] // seqlen} if fixed["chunk_tokens"] % seqlen == 0 \
                else set()
        for k in sorted(per_chunk):
            for c in ROUND_MULTIPLES:
                if seqs % (k * c) == 0 and (c == 1 or c * k * seqlen <= MAX_ROUND_TOKENS):
                    out.append((k * seqlen, c, seqs // (k * c)))
    else:  # each sequence split into chunks
        for t in ((fixed["chunk_tokens"],) if fixed["chunk_tokens"] else sizes):
            if seqlen % t:
                continue
            for m in ROUND_MULTIPLES:
                if seqs % m == 0 and (m == 1 or m * seqlen <= MAX_ROUND_TOKENS):
                    out.append((t, m * (seqlen // t), seqs // m))
    return [(t, c, r) for t, c, r in out if r <= MAX_ROUNDS_PER_STEP
            and fixed["chunks_per_round"] in (None, c) and fixed["rounds_per_step"] in (None, r)]


def _plan_for_batch(cfg, seqlen, budget, profile, grad_accum, constraints, seqs) -> Plan:
    """The fastest predicted plan taking exactly `seqs` sequences per step."""
    choices = batch_chunkings(cfg, seqlen, seqs, constraints)
    if not choices:
        raise ConfigError(f"no chunking takes exactly {seqs} sequences of {seqlen:,} tokens per "
                          f"step within {MAX_ROUNDS_PER_STEP} rounds and the other constraints; "
                          "try a batch with more divisors (a multiple of 4), or drop "
                          "chunk_tokens / chunks_per_round / rounds_per_step")
    planned, smallest = [], None
    for t, c, r in choices:
        opts = dict(constraints, chunk_tokens=t, chunks_per_round=c, rounds_per_step=r)
        try:
            planned.append(_best_plan(cfg, seqlen, budget, profile, grad_accum, opts))
        except InfeasibleBudget:
            tables = _tables(cfg, seqlen, profile, grad_accum, opts)
            mb = _minimum(tables)
            if smallest is None or (mb.device_bytes, mb.host_bytes) < smallest[0]:
                smallest = ((mb.device_bytes, mb.host_bytes), tables)
    if not planned:
        raise _infeasible(cfg, seqlen, budget, smallest[1], seqs)
    best = max(planned, key=lambda plan: plan.prediction.tok_per_s)  # the first of equals
    if not _one_device(constraints):
        return best
    few = sorted((p for p in planned if p.chunking.rounds_per_step <= FEWER_ROUNDS_FROM),
                 key=lambda plan: -plan.prediction.tok_per_s)[:RESCORED_CHUNKINGS]
    again = [best, *(p for p in few if p is not best)]
    for plan in few:
        ch = plan.chunking
        # the batch is capped (popped from `constraints` by make_plan): say so to the shapes
        for cap in fewer_resident_shapes(ch, plan.resident_layers,
                                         dict(constraints, tokens_per_step=seqs * seqlen)):
            try:
                again.append(_best_plan(cfg, seqlen, budget, profile, grad_accum, dict(
                    constraints, chunk_tokens=ch.chunk_tokens, chunks_per_round=ch.chunks_per_round,
                    rounds_per_step=ch.rounds_per_step, **cap)))
            except InfeasibleBudget:  # fewer resident layers keep more state on the host
                pass
    if len(again) == 1:
        return best
    compiled = [compiled_tok_per_s(plan) for plan in again]
    top = max(range(len(again)), key=compiled.__getitem__)
    return again[top] if compiled[top] > compiled[0] * (1 + RESCORE_MIN_GAIN) else best


RESCORED_CHUNKINGS = 3
"""A capped global batch on one device (a replica of a ring of one alike): the chunkings of at
most layout_chunkings.FEWER_ROUNDS_FROM rounds a step that the search's estimates rank best, each
also planned with no resident layer and with half its resident layers
(layout_chunkings.fewer_resident_shapes); these and the estimate's pick are then predicted again
from their compiled schedules, which choose. The per-round estimate charges every round as a
middle one (its first fetches and the deferred update whole) and a resident layer's saved fetches
as if each round paid them, so at a few rounds a step it misranks plans (8b at 8k, 80 / 24, h100
profile, 16,384 tokens a step: its pick, 2 rounds of one chunk with 4 resident layers, 5,932 tok/s
compiled; one round of two chunks with 3 resident, half of what the estimate keeps there, 6,627;
not yet measured). The compiled figures are the prediction a run is measured against
(memplan.search.predict). Outside the exact ranking, as _longer_head_sub is: a larger budget's
pick is not compared with a smaller one's here."""

RESCORE_MIN_GAIN = 0.01
"""The compiled figures replace the estimate's pick only when another plan is predicted at least
this much faster: about the compiled model's own error over the recorded runs (1.2 % mean,
bench/records/s32/plan-compiled/), so a plan does not change for a difference the model cannot
tell (the cpu profile's 'small' at 8 sequences of 64: +0.3 %)."""


def _one_device(constraints: dict) -> bool:
    """Whether `constraints` plan a device that runs the whole model and its whole update (one
    device, or a replica in a ring of one): not a ring rank, not a split-update replica, whose
    compiled steps only their ring's or replicas' schedules predict (layout_final)."""
    return (constraints.get("holds_embed", True) and constraints.get("holds_head", True)
            and constraints.get("state_parts", 1) == 1
            and not constraints.get("whole_update_cost", False))


def _best_plan(cfg, seqlen, budget, profile, grad_accum, constraints) -> Plan:
    """The fastest fitting candidate of the plain search and, when it finds none or one slower
    than any segment plan could be (_segment_floor), of the segment candidates too."""
    constraints, segments = _segments_allowed(constraints)
    table = _table(cfg, seqlen, profile, grad_accum, constraints)
    picks = [_pick(table, budget)]
    if segments and (picks[0] is None or picks[0][2].sec_per_token > _segment_floor(table)):
        seg = _table(cfg, seqlen, profile, grad_accum, constraints, segments=True)
        picks.append(_pick(seg, budget))
    picks = [p for p in picks if p is not None]
    if not picks:
        raise _infeasible(cfg, seqlen, budget, _tables(cfg, seqlen, profile, grad_accum,
                                                       constraints))
    t, best, best_score = picks[0]
    if len(picks) > 1 and _better(picks[1][2], picks[1][1], best_score, best):
        t, best, best_score = picks[1]
    d = t.spaces[best.space].decisions(best.state, best_score.rounds_per_step)
    return finish_segment_plan(_longer_head_sub(d, budget, profile), budget, profile)


def _longer_head_sub(d, budget: Budget, profile: HardwareProfile):
    """The search plans the shortest head sub-chunk (chunking.HEAD_SUB_TARGET_TOKENS); the
    chosen plan then takes the longest of chunking.head_sub_choices whose larger fp32 logits
    still fit beside every other decision (fewer accumulations of the head's weight gradient:
    cost.head_seconds). Not a search dimension: trading activations or slots for it picked a
    1b plan at 8k that the cost model put 0.9 % ahead and the H100 ran 3 % behind."""
    if not d.holds_head or d.chunking.chunks_per_seq > 1:
        return d  # a split sequence's head is a few percent of its step
    for sub in sorted(head_sub_choices(d.chunking.chunk_tokens), reverse=True):
        if sub <= d.slots.head_sub_tokens:
            break
        wider = dataclasses.replace(d, slots=dataclasses.replace(d.slots, head_sub_tokens=sub))
        mem = memory_map(wider)
        if (mem.device_bytes + profile.library_reserve_bytes <= budget.device_bytes
                and mem.host_bytes <= budget.host_bytes):
            return wider
    return d


def _pick(table: Table, budget: Budget) -> tuple[Table, Candidate, Score] | None:
    """The exactly fastest candidate of `table` that fits `budget`, or None."""
    fits = [c for c in table.candidates
            if c.device_bytes <= budget.device_bytes and c.host_bytes <= budget.host_bytes]
    if not fits:
        return None
    fits.sort(key=lambda c: (c.lower_bound_sec_per_token, c.device_bytes + c.host_bytes))
    best = best_score = None
    for c in fits:  # exact best: stop once no lower bound can beat the best score found
        bound = c.lower_bound_sec_per_token
        if best_score is not None and bound > best_score.sec_per_token * (1 + TIE_REL):
            break
        sc = table.score(c)
        if best is None or _better(sc, c, best_score, best,
                                   (table.spaces[c.space].kv_rebuild,
                                    table.spaces[best.space].kv_rebuild)):
            best, best_score = c, sc
    return table, best, best_score


def _tables(cfg, seqlen, profile, grad_accum, constraints) -> tuple[Table, Table]:
    """(plain, segment) candidate tables of a request (the plain one twice where segments are
    not allowed)."""
    constraints, segments = _segments_allowed(constraints)
    plain = _table(cfg, seqlen, profile, grad_accum, constraints)
    return plain, (_table(cfg, seqlen, profile, grad_accum, constraints, segments=True)
                   if segments else plain)


def _better(sc: Score, c: Candidate, best_sc: Score, best: Candidate,
            rebuild: tuple[bool, bool] = (False, False)) -> bool:
    """Faster wins; within TIE_REL, no K/V rebuild (`rebuild`: c's and best's kv_rebuild; it
    only pays where it is faster), then fewer PCIe bytes per token, then less memory."""
    if sc.sec_per_token < best_sc.sec_per_token * (1 - TIE_REL):
        return True
    if sc.sec_per_token > best_sc.sec_per_token * (1 + TIE_REL):
        return False
    return ((rebuild[0], sc.pcie_bytes_per_token, c.device_bytes + c.host_bytes)
            < (rebuild[1], best_sc.pcie_bytes_per_token, best.device_bytes + best.host_bytes))


def _all(tables) -> list[tuple[Table, Candidate]]:
    """Every (table, candidate) of one or several tables (plain and segment candidates)."""
    tables = (tables,) if isinstance(tables, Table) else tables
    return [(t, c) for t in tables for c in t.candidates]


def _host_within(tables, device_bytes: int) -> int | None:
    return min((c.host_bytes for _, c in _all(tables) if c.device_bytes <= device_bytes),
               default=None)


def _minimum(tables) -> MinimumBudgets:
    """The smallest budgets over the candidates of `tables` (a Table or several)."""
    dev = min(c.device_bytes for _, c in _all(tables))
    dev_gib = gib_up(dev)
    host_gib = gib_up(_host_within(tables, Budget.from_gib(1.0, dev_gib).device_bytes))
    return MinimumBudgets(device_bytes=dev, host_bytes=_host_within(tables, dev),
                          device_gib=dev_gib, host_gib=host_gib)


def minimum_budgets(cfg: ModelConfig, seqlen: int, profile: HardwareProfile | None = None, *,
                    grad_accum: GradAccum = GradAccum.BF16, **constraints) -> MinimumBudgets:
    """The smallest (host, device) budgets make_plan accepts for this model and seqlen: the
    device minimum over all plans, then the host minimum within that device budget (in GiB
    rounded up to 0.1, as messages name it). Layer-segment recompute included: make_plan
    turns to it when nothing cheaper fits."""
    return _minimum(_tables(cfg, seqlen, _profile(profile), grad_accum, constraints))


def _infeasible(cfg, seqlen, budget: Budget, tables: tuple[Table, Table],
                seqs: int | None = None) -> InfeasibleBudget:
    """The refusal: what the closest plan needs, the smallest budgets with layer-segment
    recompute (the fields) and without it, and a way out (over both kinds of plan)."""
    mb, plain = _minimum(tables), _minimum(tables[0])
    both = _all(tables)
    host_at_dev = _host_within(tables, budget.device_bytes)
    dev_at_host = min((c.device_bytes for _, c in both if c.host_bytes <= budget.host_bytes),
                      default=None)
    have = f"host {size_text(budget.host_bytes)} / device {size_text(budget.device_bytes)}"
    if host_at_dev is not None:
        t, closest = min(((t, c) for t, c in both if c.device_bytes <= budget.device_bytes),
                         key=lambda tc: (tc[1].host_bytes, tc[1].device_bytes))
        mem = memory_map(_decisions(t, closest))
        why = (f"within that device budget the smallest plan needs host {size_text(host_at_dev)} "
               f"({categories_text(mem.host)})")
        way = f"try host_gb {gib_up(host_at_dev)}"
    else:
        t, closest = min(both, key=lambda tc: (tc[1].device_bytes, tc[1].host_bytes))
        mem = memory_map(_decisions(t, closest))
        why = (f"the smallest plan needs device {size_text(mb.device_bytes)} "
               f"({categories_text(mem.device)})")
        way = f"try dev_gb {mb.device_gib}"
        # at that (rounded-up) device budget, the least host a plan needs may still be more
        host_there = _host_within(tables, Budget.from_gib(1.0, mb.device_gib).device_bytes)
        if host_there is not None and host_there > budget.host_bytes:
            way += f" with host_gb {gib_up(host_there)}"
    k = t.spaces[closest.space].k
    if k > 1:
        why += f", recomputing segments of {k} layers"
    segs = (f" (with layer-segment recompute; without it host {plain.host_gib:.1f} GiB with "
            f"device {plain.device_gib:.1f} GiB)"
            if (plain.host_gib, plain.device_gib) != (mb.host_gib, mb.device_gib) else "")
    table = tables[0]
    if dev_at_host is not None and dev_at_host <= table.spaces[0].p.device_mem_bytes \
            and f"dev_gb {gib_up(dev_at_host)}" != way.removeprefix("try "):  # not twice
        way += f", or dev_gb {gib_up(dev_at_host)} with your host budget"
    lora = table.spaces[0].lora
    if lora is not None and not lora.fp8_base:
        way += ", or --lora-base fp8 (the frozen base as E4M3 codes: about half its host bytes)"
    request = f"{cfg.name} at seqlen {seqlen}" + (
        f" with {seqs} sequences per step" if seqs is not None else "")
    msg = (f"{request} does not fit {have}: {why}. The smallest budgets that "
           f"work together are host {mb.host_gib:.1f} GiB with device {mb.device_gib:.1f} GiB"
           f"{segs}; {way}; or a shorter seqlen{' or fewer sequences per step' if seqs else ''}.")
    return InfeasibleBudget(msg, device_needed=mem.device, host_needed=mem.host,
                            min_host_bytes=mb.host_bytes, min_device_bytes=mb.device_bytes,
                            host_budget_bytes=budget.host_bytes,
                            device_budget_bytes=budget.device_bytes,
                            host_bytes_at_device_budget=host_at_dev,
                            device_bytes_at_host_budget=dev_at_host)
