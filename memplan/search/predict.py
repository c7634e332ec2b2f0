"""What a plan is predicted to do: its compiled schedule (dataflow.memplan.step) timed by the
simulator with the cost model's durations, for one device, a ring rank's replica, or a whole
ring at once. A simulation of the compiled events, not a measurement; never imports array
libraries, never touches a device."""

from __future__ import annotations

import dataclasses
import threading

from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.plan import HardwareProfile, Prediction
from dataflow.memplan.plan.ranks import RankPlan
from dataflow.memplan.search.cost import (
    BOTTLENECK_FRAC,
    event_seconds,
    optimizer_cost,
    predict,
    workload_of,
)
from dataflow.memplan.step.compile import compile_schedule
from dataflow.memplan.step.ring_compile import (
    GATHER,
    REDUCE,
    ReplicaCompiler,
    compile_ring_schedule,
)
from dataflow.memplan.step.ring_sim import Arrivals, RingComm
from dataflow.memplan.step.sim import simulate_schedule
from dataflow.models.flops import model_flops_per_seq


def predict_schedule(plan, p: HardwareProfile, update: str = "deferred", *, compiler=None,
                     comm=None) -> Prediction:
    """The predicted step of a Plan or Decisions on hardware `p`: its compiled schedule timed by the
    simulation (a first and a later round, then the optimizer; the later round repeats). step =
    compute + recompute + exposed h2d (waits on host work included) + exposed d2h + optimizer,
    exactly. Bytes are state and activation bytes (the round's token ids, 8 B per token, are not
    counted). update: where AdamW runs (dataflow.memplan.step.compile.UPDATE_MODES): by default as
    the Engine runs it, the previous step's inside round 0 (a step after the first; optimizer_s is
    then only the norm and clip scale after the last round), 'end', or 'backward' (an unclipped
    step's own, inside its last round). `compiler(rounds, update)` and `comm` (as
    simulate_schedule's) time another compilation of the same plan: a ring rank's replica
    (replica_prediction, below)."""
    d = decisions_of(plan)
    cfg, ch = d.model, d.chunking
    w = workload_of(d, p)
    R = ch.rounds_per_step
    # update='backward' makes the last round unlike the middle ones, as does a replica's
    # compiler (its last round reduces the gradients, a split one's writes home its part
    # alone): simulate first, middle and last; otherwise the rounds from 1 on are alike.
    n = min(R, 3 if update == "backward" or compiler is not None else 2)
    sch = compile_schedule(d, rounds=n, update=update) if compiler is None else \
        compiler(n, update)
    tl = simulate_schedule(sch, event_seconds(d, p), p, comm=comm)
    ends = tl.round_end_s
    opt_s = tl.total_s - ends[-1]

    def rounds_total(per_round: list) -> float:
        """Every simulated round once, the middle one (round 1) R - n more times: the same
        extrapolation as the step (a per-round list may end with the tail after the rounds,
        which the optimizer's time holds)."""
        return sum(per_round[:n]) + (R - n) * per_round[min(1, n - 1)]

    step = rounds_total([e - s for s, e in zip([0.0, *ends[:-1]], ends)]) + opt_s

    exp = {k: rounds_total([r[k] for r in tl.exposed_by_round])
           for k in ("h2d", "d2h", "host", "opt")}
    opt_s += exp["opt"]  # rounds waiting on a deferred update count as optimizer time
    busy = rounds_total(list(tl.busy_by_round))
    h2d, d2h = sch.bytes_moved(state_only=True)
    if R > n:  # the middle round's bytes repeat
        mid_end = sch.round_starts[2] if n > 2 else sch.optimizer_start
        later_h2d, later_d2h = sch.bytes_moved(sch.round_starts[1], mid_end, state_only=True)
        h2d, d2h = h2d + (R - n) * later_h2d, d2h + (R - n) * later_d2h
    model_flops = (model_flops_per_seq(cfg, ch.seqlen) - w.frozen_flops_per_seq
                   + w.adapter_flops_per_seq) * ch.seqs_per_step
    hw_flops = model_flops + R * w.extra_flops
    opt = optimizer_cost(w, p)
    opt_name = "host memory" if opt.host_bound else "optimizer"
    parts = (("h2d", exp["h2d"]), ("d2h", exp["d2h"]), ("host", exp["host"]), (opt_name, opt_s))
    name, worst = max(parts, key=lambda kv: kv[1])
    return Prediction(
        step_time_s=step, compute_s=busy - R * w.recompute_s, recompute_s=R * w.recompute_s,
        exposed_h2d_s=exp["h2d"] + exp["host"], exposed_d2h_s=exp["d2h"], optimizer_s=opt_s,
        h2d_bytes=h2d, d2h_bytes=d2h, tok_per_s=ch.tokens_per_step / step,
        model_tflop_per_s=model_flops / step / 1e12,
        mfu=model_flops / step / p.peak_bf16_flop_per_s,
        hfu=hw_flops / step / p.peak_bf16_flop_per_s,
        bottleneck=name if worst >= BOTTLENECK_FRAC * step else "compute")


def replica_prediction(rp: RankPlan, bytes_per_s: float, latency_s: float = 0.0,
                       memo: dict | None = None, *, from_schedule: bool = False):
    """The stand-alone prediction of rank rp's plan as a replica that splits its weight fetches
    (rp.split_fetch) or its update (rp.split_update: its part's AdamW, its part's last-round
    gradient write-back, the gathers of the updated weights): its plan's prediction (the
    search's estimate, as every other rank's) scaled by the ratio of two timings of its
    compiled schedule (dataflow.memplan.search.cost.predict_schedule), with the split (its part
    copies over the host link, the gathers over a link of `bytes_per_s` between replicas) and
    without; its H2D bytes the split schedule's. The step's all-reduce (or reduce-scatter) is
    left out of both (dataflow.memplan.search.layout adds it); Send / Recv are not compiled (the
    rank alone). rp.plan.prediction without a split. A plan parted from the start
    (Plan.state_parts R) is scaled from the search's estimate of its decisions with whole m / v
    (the search estimates it with its part's AdamW, which the ratio holds already). `memo`
    (one per rank plan, kept by the caller over links): the compiled schedules and the whole
    timing, which do not depend on the link (the whole schedule moves nothing between
    replicas but the all-reduce, which is left out). from_schedule: the estimate scaled is the whole
    plan's compiled schedule's (predict_schedule) instead of the search's (the layout's final
    figures: compiled_rank_plans)."""
    if not ((rp.split_fetch or rp.split_update) and rp.replicas > 1):
        return rp.plan.prediction
    memo = {} if memo is None else memo
    timed = []
    for split in (False, True):  # the same plan, whole and as asked (split fetches / updates)
        if not split and "whole" in memo:
            timed.append(memo["whole"])
            continue
        # the whole reference: the same decisions with whole m / v (Plan.state_parts 1)
        r = rp if split else dataclasses.replace(
            rp, split_fetch=False, split_update=False,
            plan=dataclasses.replace(rp.plan, state_parts=1))

        def compiled(rounds: int, update: str, r=r, split=split):
            key = (split, rounds, update)
            if key not in memo:
                memo[key] = ReplicaCompiler(r).compile(rounds, update)
            return memo[key]

        timed.append(_replica_timed(rp, compiled, bytes_per_s, latency_s, reduce=False))
        if not split:
            memo["whole"] = timed[-1]
    k = timed[1].step_time_s / timed[0].step_time_s
    # the ratio scales the search's estimate of the whole update: a plan parted from the start
    # (Plan.state_parts) is estimated with its part's AdamW already, so take its whole one
    whole = rp.plan if rp.plan.state_parts == 1 else dataclasses.replace(rp.plan, state_parts=1)
    if from_schedule:
        p = predict_schedule(whole, rp.plan.profile)
    else:
        p = rp.plan.prediction if rp.plan.state_parts == 1 else predict(whole, rp.plan.profile)
    return dataclasses.replace(
        p, step_time_s=p.step_time_s * k, tok_per_s=p.tok_per_s / k,
        model_tflop_per_s=p.model_tflop_per_s / k, mfu=p.mfu / k, hfu=p.hfu / k,
        h2d_bytes=timed[1].h2d_bytes)


def reduce_exposure_seconds(rp: RankPlan, bytes_per_s: float, latency_s: float = 0.0,
                            memo: dict | None = None) -> float:
    """The seconds the replicas' gradient reduces (RankPlan.replicas, all-reduced or with
    split_update reduce-scattered) add to rank rp's compiled step, timed where the schedule runs
    them: each on the reduce stream after the block's last backward, the compute waiting for it
    there, over a link of `bytes_per_s`; what copy waits already hide is not counted. Send / Recv
    are not compiled (the rank alone), so it is a ring of one's whole reduce and a ring rank's
    estimate. `memo`: by plan, replicas, splits and link. 0 for one replica."""
    if rp.replicas == 1:
        return 0.0
    memo = {} if memo is None else memo
    kind = (rp.plan.hash, rp.rank, rp.replicas, rp.split_fetch, rp.split_update)
    key = ("reduce_exposure", *kind, bytes_per_s, latency_s)
    if key not in memo:
        schedules = memo.setdefault(("replica_schedules", *kind), {})  # the same on every link

        def compiled(rounds: int, update: str):
            if (rounds, update) not in schedules:
                schedules[rounds, update] = ReplicaCompiler(rp).compile(rounds, update)
            return schedules[rounds, update]

        steps = [_replica_timed(rp, compiled, bytes_per_s, latency_s, reduce=reduce).step_time_s
                 for reduce in (False, True)]
        memo[key] = max(0.0, steps[1] - steps[0])
    return memo[key]


def _replica_timed(rp: RankPlan, compiled, bytes_per_s: float, latency_s: float, *,
                   reduce: bool) -> Prediction:
    """predict_schedule of rank rp's replica schedules (`compiled(rounds, update)`), its reduce
    and gather streams timed over a link of `bytes_per_s` (the reduces taking no time unless
    `reduce`)."""
    comm = RingComm(rank=rp.rank, replicas=rp.replicas, bytes_per_s=bytes_per_s,
                    latency_s=latency_s, arrivals=None, streams=(REDUCE, GATHER), reduce=reduce)
    return predict_schedule(rp.plan, rp.plan.profile, comm=comm, compiler=compiled)


def compiled_rank_plans(rps: tuple[RankPlan, ...], memo: dict) -> tuple[RankPlan, ...]:
    """`rps` with each plan's prediction its compiled schedule's (predict_schedule) instead of the
    search's estimate (cost.predict), as the single-device planner's final prediction is. The
    search's per-round estimate charges the deferred update whole, which the schedule mostly
    hides in the next step's first round: a few rounds a step (the replicas of a capped global
    batch) it is ~5 % slow (8b at 80 / 24, 65,536 tokens a step: 8,181 against 8,611 tok/s),
    and over the H200 runs recorded it errs more (1.8 % mean against 1.2 %). A plan parted for
    a split update (Plan.state_parts) does not run alone: its whole-state twin's schedule is
    timed, as replica_prediction scales it. `memo` by plan hash: ranks of one kind once."""
    out = []
    for rp in rps:
        key = rp.plan.hash
        if key not in memo:
            whole = rp.plan if rp.plan.state_parts == 1 else \
                dataclasses.replace(rp.plan, state_parts=1)
            memo[key] = predict_schedule(whole, rp.plan.profile)
        out.append(dataclasses.replace(rp, plan=dataclasses.replace(rp.plan,
                                                                    prediction=memo[key])))
    return tuple(out)


def simulate_ring(rank_plans, bytes_per_s: float, latency_s: float = 0.0,
                  profile=None, update: str = "deferred") -> tuple:
    """The ring's step: every rank's compiled schedule timed by dataflow.memplan.step.sim, all at
    once (a thread per rank; a receive waits for its send's simulated arrival). Returns (one
    Timeline per rank, step seconds: the slowest rank's). A simulation of the compiled events over
    an assumed link, not a measurement. update: where AdamW runs (as a ring runs it by default: the
    previous step's inside round 0, a step after the first; or 'end')."""
    arrivals, out = Arrivals(), {}

    def run(rp) -> None:
        p = profile or rp.plan.profile
        try:
            out[rp.rank] = simulate_schedule(
                compile_ring_schedule(rp, update=update), event_seconds(rp.plan, p), p,
                comm=RingComm(rank=rp.rank, replicas=rp.replicas, bytes_per_s=bytes_per_s,
                              latency_s=latency_s, arrivals=arrivals))
        except Exception as exc:  # noqa: BLE001 - raised below, in the caller's thread
            out[rp.rank] = exc

    threads = [threading.Thread(target=run, args=(rp,)) for rp in rank_plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = tuple(out[rp.rank] for rp in rank_plans)
    for tl in lines:
        if isinstance(tl, Exception):
            raise tl
    return lines, max(tl.total_s for tl in lines)
