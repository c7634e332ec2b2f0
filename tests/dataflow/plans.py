"""Forced plans for the executor tests: every path the executor has, on the tiny and small models,
built through memplan.build_plan with budgets equal to what each plan needs."""

from __future__ import annotations

import dataclasses

from dataflow.memplan import build_plan, get_profile
from dataflow.memplan.plan.plan import (Budget, Chunking, GradAccum, LayerPlacement, OptimizerWhere,
                          SavedActivation, Slots, Where)
from dataflow.models.flops import SavedLevel

PROFILE = get_profile("h100")
RESIDENT = LayerPlacement(weights=Where.DEVICE, grads=Where.DEVICE, optimizer=OptimizerWhere.DEVICE)


def streamed(opt: OptimizerWhere) -> LayerPlacement:
    return LayerPlacement(weights=Where.HOME, grads=Where.HOME, optimizer=opt)


def forced_plan(cfg, seqlen, *, chunk_tokens, seqs_per_chunk=1, chunks_per_seq=1,
                chunks_per_round=1, rounds=1, layers=None, levels=None, homes=None,
                weight_slots=2, grad_slots=1, act_slots=2, embed=RESIDENT, head=RESIDENT,
                grad_accum=GradAccum.BF16, head_sub_tokens=None, opt_stage_elems=None,
                kv_rebuild=False, frozen=None, lora=None):
    """A plan with exactly these decisions and budgets equal to what it needs."""
    n = cfg.n_layers
    layers = layers or (RESIDENT,) * n
    levels = levels or [[SavedLevel.FULL] * chunks_per_round for _ in range(n)]
    homes = homes or [[Where.DEVICE] * chunks_per_round for _ in range(n)]
    acts = tuple(tuple(SavedActivation(level=levels[l][c], home=homes[l][c])
                       for c in range(chunks_per_round)) for l in range(n))
    ch = Chunking(seqlen=seqlen, chunk_tokens=chunk_tokens, seqs_per_chunk=seqs_per_chunk,
                  chunks_per_seq=chunks_per_seq, chunks_per_round=chunks_per_round,
                  rounds_per_step=rounds)
    blocks = list(layers) + [embed, head]
    stage = opt_stage_elems
    if stage is None:
        stage = 3000 if any(b.optimizer is OptimizerWhere.STREAMED for b in blocks) else 0
    slots = Slots(weight_slots=weight_slots, grad_slots=grad_slots, act_slots=act_slots,
                  head_sub_tokens=head_sub_tokens or min(chunk_tokens, 32),
                  opt_stage_elems=stage)
    kw = dict(chunking=ch, slots=slots, layers=tuple(layers), activations=acts, embed=embed,
              head=head, grad_accum=grad_accum, kv_rebuild=kv_rebuild, frozen=frozen,
              lora=lora)
    big = build_plan(cfg, seqlen, Budget(host_bytes=1 << 32, device_bytes=1 << 32), PROFILE, **kw)
    exact = Budget(host_bytes=big.memory.host_bytes,
                   device_bytes=big.memory.device_bytes + PROFILE.library_reserve_bytes)
    return build_plan(cfg, seqlen, exact, PROFILE, **kw)


def path_plans(cfg):
    """(name, plan) pairs that together force every executor path; all share one chunking
    (2 sequences of 64 tokens per chunk, 2 chunks per round, 2 rounds) so their results must be
    bit-identical to each other."""
    n = cfg.n_layers
    common = dict(chunk_tokens=128, seqs_per_chunk=2, chunks_per_round=2, rounds=2)
    host, strm = streamed(OptimizerWhere.HOST), streamed(OptimizerWhere.STREAMED)
    mixed_levels = [[SavedLevel.INP_ONLY, SavedLevel.INP_ATTN], [SavedLevel.FULL,
                                                                  SavedLevel.INP_ONLY]] * n
    plans = [
        ("all_resident", forced_plan(cfg, 64, **common)),
        ("streamed_1_slot_host_opt", forced_plan(cfg, 64, layers=(host,) * n, weight_slots=1,
                                                 **common)),
        ("streamed_2_slots_streamed_opt", forced_plan(cfg, 64, layers=(strm,) * n,
                                                      weight_slots=2, grad_slots=2, **common)),
        ("streamed_many_slots_mixed", forced_plan(
            cfg, 64, layers=tuple(RESIDENT if i % 2 else strm for i in range(n)),
            weight_slots=max(2, n), **common)),
        ("levels_on_device", forced_plan(cfg, 64, levels=mixed_levels[:n], **common)),
        ("levels_at_home", forced_plan(cfg, 64, levels=mixed_levels[:n],
                                       homes=[[Where.HOME, Where.HOME]] * n, act_slots=1,
                                       **common)),
        ("embed_head_at_home", forced_plan(cfg, 64, layers=(strm,) * n, embed=host, head=strm,
                                           homes=[[Where.HOME, Where.DEVICE]] * n, **common)),
    ]
    return plans


def split_plans(cfg):
    """Sequences of 256 tokens split into 4 chunks of 64, one sequence per round, 2 rounds."""
    n = cfg.n_layers
    common = dict(chunk_tokens=64, chunks_per_seq=4, chunks_per_round=4, rounds=2)
    levels = [[SavedLevel.INP_ONLY, SavedLevel.INP_ATTN, SavedLevel.FULL, SavedLevel.INP_ONLY]] * n
    return [
        ("split_resident", forced_plan(cfg, 256, **common)),
        ("split_levels_home_streamed", forced_plan(
            cfg, 256, layers=(streamed(OptimizerWhere.STREAMED),) * n, levels=levels,
            homes=[[Where.HOME, Where.DEVICE, Where.HOME, Where.HOME]] * n, **common)),
        # K/V re-formed from x: at home (chunks 0, 3) and on the device (chunk 1); FULL keeps
        ("split_kv_rebuild", forced_plan(
            cfg, 256, layers=(streamed(OptimizerWhere.STREAMED),) * n, levels=levels,
            homes=[[Where.HOME, Where.DEVICE, Where.HOME, Where.HOME]] * n, kv_rebuild=True,
            **common)),
    ]


def with_grad_accum(plan, grad_accum):
    return dataclasses.replace(plan, grad_accum=grad_accum)


def updated_pieces(events) -> dict[tuple[str, int], int]:
    """Elements AdamW updates in `events`, summed per (block, first element) piece (a deferred
    update's pieces must add up to the lone update schedule's)."""
    from dataflow.memplan.step.compile import Update

    out: dict[tuple[str, int], int] = {}
    for e in events:
        if type(e) is Update:
            out[(e.block, e.start)] = out.get((e.block, e.start), 0) + e.count
    return out
