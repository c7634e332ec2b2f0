"""Budget-independent candidate plans for one request: for each candidate chunking, chains of
States grown from the smallest plan by greedy moves (one more resident layer, one more slot, a
group of saved activations moved to the device or up a level, embedding/head/optimizer onto the
device), each the best predicted gain per device byte, plus the host fill of every chain state
(home activations raised a level at a time). Pure Python: never imports array libraries."""

from __future__ import annotations

import dataclasses
import functools
import math

from dataflow.memplan.plan.chunking import chunking_candidates
from dataflow.memplan.plan.plan import GradAccum, HardwareProfile, OptimizerWhere
from dataflow.memplan.search.cost import max_rounds, round_times, rounds_for_target
from dataflow.memplan.search.space import Space, State
from dataflow.models.config import ModelConfig

MAX_WEIGHT_SLOTS = 8
MAX_GRAD_SLOTS = 8
MAX_ACT_SLOTS = 64
ACT_MOVE_GROUPS = 16
"""Saved activations move in groups of at most 1/16 of a round's (layer, chunk) pairs ..."""
ACT_MOVE_DEVICE_FRAC, ACT_MOVE_MIN_BYTES = 1 / 8, 256 << 20
"""... and of at most 1/8 of the device bytes the state uses (at least 256 MiB), so the
chain's steps stay small where device budgets are decided."""
RESIDENT_MOVE_GROUPS = 32
MIN_MOVE_COST_BYTES = 1 << 20
REL_TOL = 1e-6
MAX_CHAIN_MOVES = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    device_bytes: int
    host_bytes: int
    lower_bound_sec_per_token: float
    """A lower bound on the predicted seconds per token (compute, least recompute, optimizer)."""
    space: int
    state: State


@dataclasses.dataclass(frozen=True, slots=True)
class Score:
    sec_per_token: float
    rounds_per_step: int
    pcie_bytes_per_token: float


class Table:
    """Budget-independent candidates of one request, with their scores computed on demand."""

    def __init__(self, spaces: list[Space], candidates: list[Candidate], opts: dict):
        self.spaces, self.candidates, self.opts = tuple(spaces), tuple(candidates), opts
        self._scorers = [_scorer(sp, opts) for sp in spaces]

    def score(self, c: Candidate) -> Score:
        return self._scorers[c.space](c.state)


CHAINS = ((5, ((5, 0), (5, 1), (5, 2), (1, 0), (2, 1))), (4, ((4, 0), (4, 1), (1, 0))),
          (3, ((3, 0),)))
"""Device chains: the ACT_CLASSES index every home activation starts in (INP_ONLY, INP_ATTN,
FULL) and the (from, to) activation moves the chain may take."""


def _moves(sp: Space, s: State, opts: dict, act_moves) -> list[tuple[str, State]]:
    L, N, out = sp.L, sp.N, []
    cap = opts["max_resident_layers"]
    if s.resident < cap:
        step = -(-L // RESIDENT_MOVE_GROUPS)
        out.append(("resident", s.but(resident=min(cap, s.resident + step))))
    if s.resident < L:
        if s.weight_slots < min(MAX_WEIGHT_SLOTS, L - s.resident):
            out.append(("weight_slot", s.but(weight_slots=s.weight_slots + 1)))
        if s.grad_slots < min(MAX_GRAD_SLOTS, L - s.resident):
            out.append(("grad_slot", s.but(grad_slots=s.grad_slots + 1)))
    n_home = sum(s.acts[3:])
    if n_home and s.act_slots < min(MAX_ACT_SLOTS, n_home):
        nxt = min(n_home, s.act_slots + max(1, s.act_slots // 4))
        out.append(("act_slot", s.but(act_slots=nxt)))
    by_count = -(-N // ACT_MOVE_GROUPS)
    reach = max(ACT_MOVE_MIN_BYTES, sp.memory(s)[0] * ACT_MOVE_DEVICE_FRAC)
    for src, dst in act_moves:
        n = min(by_count, max(1, int(reach // sp.act_size[dst])), s.acts[src])
        if n:
            acts = list(s.acts)
            acts[src] -= n
            acts[dst] += n
            out.append((f"acts{src}{dst}", s.but(acts=tuple(acts))))
    if not s.embed_dev:
        out.append(("embed", s.but(embed_dev=True)))
    if not s.head_dev:
        out.append(("head", s.but(head_dev=True)))
    if not s.opt_streamed and opts.get("home_optimizer") is None:
        out.append(("opt", s.but(opt_streamed=True)))
    return out


def _scorer(sp: Space, opts: dict):
    p, tokens = sp.p, sp.ch.tokens_per_round

    @functools.cache
    def score(s: State) -> Score:
        w = sp.workload(s)
        rt = round_times(w, p)
        rounds = opts.get("rounds_per_step") or rounds_for_target(
            rt.first.time_s, rt.later.time_s, rt.optimizer.time_s, opts["target_optimizer_frac"],
            max_rounds(tokens))
        step = rt.first.time_s + (rounds - 1) * rt.later.time_s + rt.optimizer.time_s
        pcie = (rt.first.h2d_bytes + rt.first.d2h_bytes
                + (rounds - 1) * (rt.later.h2d_bytes + rt.later.d2h_bytes)
                + rt.optimizer.h2d_bytes + rt.optimizer.d2h_bytes)
        return Score(step / (rounds * tokens), rounds, pcie / (rounds * tokens))
    return score


def _chain(sp: Space, start: State, score, opts: dict, act_moves) -> list[State]:
    """Greedy: repeatedly take the move with the best predicted gain per device byte (these
    moves only free host memory or leave it alone). Lazy: a move is re-scored only while its
    last score could still win; the chain ends when a pass that re-scored every move finds none
    that helps."""
    s, spt, dev = start, score(start).sec_per_token, sp.memory(start)[0]
    out, stale = [s], {}
    for _ in range(MAX_CHAIN_MOVES):
        moves = sorted(_moves(sp, s, opts, act_moves), key=lambda m: -stale.get(m[0], math.inf))
        best = None
        for name, nxt in moves:
            if best is not None and stale.get(name, math.inf) <= best[0]:
                break
            gain = spt - score(nxt).sec_per_token
            cost = max(sp.memory(nxt)[0] - dev, 0)
            stale[name] = gain / max(cost, MIN_MOVE_COST_BYTES) if gain > spt * REL_TOL else 0.0
            if stale[name] > 0 and (best is None or stale[name] > best[0]):
                best = (stale[name], nxt)
        if best is None:
            break
        s = best[1]
        spt, dev = score(s).sec_per_token, sp.memory(s)[0]
        out.append(s)
    return out


def _home_upgrades(sp: Space, s: State, base: int) -> list[State]:
    """The host fill of a chain state whose home activations are all in class `base`: raise
    them a group at a time (INP_ONLY -> INP_ATTN -> FULL), each with the state's and with
    twice its activation slots."""
    n = s.acts[base]
    if not n or base == 3:
        return []
    group = -(-sp.N // ACT_MOVE_GROUPS)
    ups = range(group, n + group, group)
    homes = [(min(n, u), n - min(n, u), 0) for u in ups]  # (FULL, INP_ATTN, INP_ONLY) at home
    if base == 5:
        homes = [(0, min(n, u), n - min(n, u)) for u in ups] + homes
    slots = sorted({s.act_slots, min(2 * s.act_slots, MAX_ACT_SLOTS, n)})
    return [s.but(acts=s.acts[:3] + h, act_slots=k) for h in homes for k in slots]


@functools.lru_cache(maxsize=64)
def candidate_table(cfg: ModelConfig, seqlen: int, p: HardwareProfile, grad_accum: GradAccum,
                    options: tuple) -> Table:
    """Every candidate plan of a request (budget-independent) with its memory and bound."""
    """Every candidate plan of a request (budget-independent) with its memory and bound."""
    opts = dict(options)
    spaces, cands, chains = [], [], []
    for ch in chunking_candidates(cfg, seqlen, chunk_tokens=opts.get("chunk_tokens"),
                                  chunks_per_round=opts.get("chunks_per_round")):
        for rebuild in kv_rebuild_choices(ch, opts.get("kv_rebuild")):
            sp = Space(cfg, ch, p, grad_accum, attention_bwd=opts["attention_bwd"],
                       holds=(opts["holds_embed"], opts["holds_head"]), kv_rebuild=rebuild,
                       precision=opts["precision"], frozen=opts["freeze"],
                       lora=opts["lora"], state_parts=opts["state_parts"],
                       whole_update_cost=opts["whole_update_cost"])
            states, chain = _space_states(sp, opts)
            cands += _candidates(sp, opts, len(spaces), states)
            spaces.append(sp)
            chains.append(chain)
    table = Table(spaces, cands, opts)
    table.chain_states = tuple(chains)
    return table


def kv_rebuild_choices(ch, wanted: bool | None) -> tuple[bool, ...]:
    """Plan.kv_rebuild values the search tries for chunking `ch`: both for split sequences
    unless the caller fixed one (None), only False for packed ones."""
    if ch.chunks_per_seq < 2:
        return (False,)
    return (False, True) if wanted is None else (wanted,)


@functools.lru_cache(maxsize=16)
def segment_table(cfg: ModelConfig, seqlen: int, p: HardwareProfile, grad_accum: GradAccum,
                  options: tuple) -> Table:
    """The layer-segment recompute candidates of a request: for each chunking, segment length
    (segment_lengths) and place of the rebuilt activations (SEGMENT_INNER_CLASSES), the chain
    states of the plain search carried over (memory.segments). No chains of their own: their
    skeletons (resident layers, slots, embedding, head, optimizer) are the plain search's,
    with its saved-activation classes spread in the same proportions over the kept layers."""
    plain = candidate_table(cfg, seqlen, p, grad_accum, options)
    spaces, cands = [], []
    for base, chain in zip(plain.spaces, plain.chain_states):
        if base.kv_rebuild:  # segments keep their own boundary K/V scheme (dataflow.memplan.plan.segments)
            continue
        for k in segment_lengths(cfg.n_layers):
            for inner in SEGMENT_INNER_CLASSES:
                sp = Space(cfg, base.ch, p, grad_accum, k, inner, base.attention_bwd,
                           holds=base.holds, precision=base.precision, frozen=base.frozen,
                           lora=base.lora, state_parts=base.state_parts,
                           whole_update_cost=base.whole_update_cost)
                states = {_carried(s, base.N, sp) for s in chain}
                cands += _candidates(sp, plain.opts, len(spaces), states)
                spaces.append(sp)
    return Table(spaces, cands, plain.opts)


def _carried(s: State, n_from: int, sp: Space) -> State:
    """`s` with its activation counts scaled from n_from items to the kept layers' sp.N."""
    acts = [n * sp.N // n_from for n in s.acts]
    big = acts.index(max(acts))  # the first of the largest
    acts[big] += sp.N - sum(acts)
    return s.but(acts=tuple(acts))


SEGMENT_INNER_CLASSES = (5, 4, 2)
"""Where a segment plan keeps its rebuilt activations (ACT_CLASSES): at home at INP_ONLY (the
least memory), at home at INP_ATTN (the backward need not run attention a third time: at long
context that is most of a layer) or on the device at INP_ONLY (no copies)."""


def segment_lengths(n_layers: int) -> list[int]:
    """For every number of segments from L-1 down to 1, the shortest segment length giving it
    (longer ones keep the same boundaries and only need more storage for rebuilt layers)."""
    return sorted({-(-n_layers // n) for n in range(1, n_layers)} - {1})


def _space_states(sp: Space, opts: dict) -> tuple[set[State], list[State]]:
    """(every candidate State of one space, the chain states among them): the greedy chains,
    the host fill of each chain state, and the two all-device anchors."""
    score = _scorer(sp, opts)
    L, N = sp.L, sp.N
    streamed = opts.get("home_optimizer") is OptimizerWhere.STREAMED
    # A tied embedding is resident in every candidate (decisions._check_tied): no move to take.
    base = State(resident=0, embed_dev=sp.cfg.tie_embeddings and sp.holds_embed, head_dev=False,
                 opt_streamed=streamed,
                 weight_slots=1, grad_slots=1, act_slots=1, acts=(0, 0, 0, 0, 0, N))
    states, chain = set(), []
    sp.start_chains()
    for home_class, act_moves in CHAINS:
        acts = tuple(N if i == home_class else 0 for i in range(6))
        for s in _chain(sp, base.but(acts=acts), score, opts, act_moves):
            states.add(s)
            chain.append(s)
            states.update(_home_upgrades(sp, s, home_class))
    sp.end_chains()
    if opts["max_resident_layers"] == L:
        for acts in ((N, 0, 0, 0, 0, 0), (0, 0, N, 0, 0, 0)):  # all on device; least host
            states.add(State(resident=L, embed_dev=True, head_dev=True, opt_streamed=streamed,
                             weight_slots=1, grad_slots=1, act_slots=1, acts=acts))
    return states, chain


def _candidates(sp: Space, opts: dict, index: int, states) -> list[Candidate]:
    """States of space number `index` as candidates, with their memory and bounds. The rounds
    of the bound are the most the state's plan can run (its simulated rounds take at least
    the bound's, so Score.rounds_per_step is never more), so the memory at those rounds never
    counts a HOME embedding's rows short (one part at one round, two at more: exact unless the
    bound allows 2+ rounds and the plan runs 1)."""
    tokens = sp.ch.tokens_per_round
    out = []
    for s in sorted(states, key=State.key):
        lb_round = sp.round_lower_bound_s(s)
        opt_s = sp.optimizer(s).time_s
        rounds = opts.get("rounds_per_step") or rounds_for_target(
            lb_round, lb_round, opt_s, opts["target_optimizer_frac"], max_rounds(tokens))
        dev, host = sp.memory(s, rounds)
        lb = (rounds * lb_round + opt_s) / (rounds * tokens)
        out.append(Candidate(dev, host, lb, index, s))
    return out


