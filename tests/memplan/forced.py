"""Helpers that build explicit decisions for the tiny and small models (tests only)."""

from __future__ import annotations

from dataflow.memplan.search.build import build_plan
from dataflow.memplan.plan.chunking import make_chunking
from dataflow.memplan.plan.decisions import HOME_HOST, HOME_STREAMED, RESIDENT
from dataflow.memplan.plan.plan import Budget, GradAccum, SavedActivation, Slots, Where
from dataflow.models.config import load_config
from dataflow.models.flops import SavedLevel

BIG = Budget(host_bytes=1 << 40, device_bytes=1 << 40)
__all__ = ["forced", "RESIDENT", "HOME_HOST", "HOME_STREAMED", "BIG", "acts", "cfg_of"]


def cfg_of(name: str):
    return load_config(name)


def acts(n_layers: int, n_chunks: int, level=SavedLevel.FULL, home=Where.DEVICE):
    return tuple(tuple(SavedActivation(level=level, home=home) for _ in range(n_chunks))
                 for _ in range(n_layers))


def forced(profile, model="tiny", seqlen=64, *, chunk_tokens=64, chunks_per_round=None,
           rounds=1, layers=None, activations=None, embed=RESIDENT, head=RESIDENT,
           weight_slots=0, grad_slots=0, act_slots=0, head_sub_tokens=None, opt_stage_elems=0,
           grad_accum=GradAccum.BF16, budget=BIG):
    """A Plan from explicit decisions (defaults: everything resident, FULL on the device)."""
    cfg = load_config(model)
    ch = make_chunking(seqlen, chunk_tokens, chunks_per_round, rounds)
    layers = layers or (RESIDENT,) * cfg.n_layers
    activations = activations or acts(cfg.n_layers, ch.chunks_per_round)
    slots = Slots(weight_slots=weight_slots, grad_slots=grad_slots, act_slots=act_slots,
                  head_sub_tokens=head_sub_tokens or min(chunk_tokens, 32),
                  opt_stage_elems=opt_stage_elems)
    return build_plan(cfg, seqlen, budget, profile, chunking=ch, slots=slots, layers=layers,
                      activations=activations, embed=embed, head=head, grad_accum=grad_accum)
