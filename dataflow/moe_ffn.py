"""The mixture-of-experts FFN of one layer on one chunk (ModelConfig.moe), forward and backward,
as op-table launches on the compute stream: route, permute, experts, combine, and back through
them (kernels.reference.moe's block, split into ops that read and write arena views).
dataflow.layer_ops calls it in place of the dense SwiGLU FFN. Never decides placement, never
copies between host and device, and never adds a chunk's routing to the round's totals more than
once: only the forward proper counts (`routing`), a recompute for the backward does not.

The auxiliary losses are per round (one round = one transformers forward call, a micro-batch of
gradient accumulation): the forward of every chunk and layer adds its routing to the round's
totals (RoundRouting), and each backward reads the totals of its round, complete because a round
runs every forward before any backward (docs/moe.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dataflow.memplan.plan.buffers import moe_rows, moe_saved_specs
from dataflow.models.config import ModelConfig
from dataflow.models.layout import ROUTER_TENSOR, BlockLayout, expert_names

EXPERT_STACKS = ("experts.gate", "experts.up", "experts.down")
"""Keys of the stacked expert views a layer's view dict gets (stacked_experts)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RoundRouting:
    """The running round's routing totals on the device, and the auxiliary losses' share of
    every MoE backward of the step."""

    counts: Any
    """(N,) int64 view: (token, slot) pairs per expert over the round's forward so far."""
    sums: Any
    """(N + 1,) fp32 view: the softmax summed per expert, then the sum of logsumexp^2."""
    aux_coef: float
    """router_aux_loss_coef / rounds: the step's objective is the LM mean plus the coefficient
    times the MEAN of its rounds' load-balancing losses (each round has the same rows)."""
    z_coef: float
    """router_z_loss_coef / rounds, likewise."""
    n_rows: int
    """Rows each auxiliary loss of a round averages over: tokens_per_round x MoE layers."""


def stacked_experts(layout: BlockLayout, flat, n_experts: int) -> dict:
    """Views of the routed experts' gate (N, F, D), up (N, F, D) and down (N, D, F) stacked
    over the experts, into `flat` (a 1-D view of a whole layer block, weights or grads).
    models.layout keeps each expert's three matrices contiguous and every expert the same
    size, so expert e starts `stride` elements after expert e - 1 and the stacks are strided
    views of the block, not copies; the ops index expert e as stack[e]."""
    first = [layout.slot(n) for n in expert_names(0)]
    start = first[0].offset
    stride = (layout.slot(expert_names(1)[0]).offset - start if n_experts > 1
              else first[-1].offset + first[-1].numel - start)
    for e in range(n_experts):  # the layout's promise, checked once per block view
        for s0, name in zip(first, expert_names(e)):
            assert layout.slot(name).offset == s0.offset + e * stride, (name, stride)
    rows = flat[start:start + n_experts * stride].reshape(n_experts, stride)
    out = {}
    for key, s in zip(EXPERT_STACKS, first):
        at = s.offset - start
        out[key] = rows[:, at:at + s.numel].reshape(n_experts, *s.shape)
    return out


class MoeFfn:
    """The MoE FFN's launches for one layer and chunk; `op(name, *args, tag=)` enqueues an op of
    the backend's table on the compute stream (dataflow.layer_ops.LayerCompute._op)."""

    def __init__(self, cfg: ModelConfig, ws: dict):
        self.cfg, self.ws = cfg, ws
        self.names = tuple(s.name for s in moe_saved_specs(cfg, 1))

    def tensors(self, save: dict | None, tokens: int) -> dict:
        """Where a chunk of `tokens` forms (forward) or finds (backward) the routing and the
        experts' rows: the saved region's view when the level keeps it (FULL), else the chunk
        workspace."""
        r = moe_rows(self.cfg, tokens)
        out = {}
        for name in self.names:
            view = self.ws[name]
            if name == "expert_offsets":
                pass
            elif name.startswith("expert_"):
                view = view[:r]
            else:
                view = view[:tokens]
            out[name] = save[name] if save is not None and name in save else view
        return out

    def forward(self, op: Callable, w: dict, xn, m: dict, out=None,
                routing: RoundRouting | None = None, tag: str = "") -> None:
        """xn (T, D), the FFN norm's output -> the routing and every routed row's gate, up and
        expert output in `m` (tensors()); with `out` the combine adds the FFN's output onto it
        (out holds the residual). `routing`: add this chunk's routing to the round's totals
        (the forward proper only). `tag` '.re' marks a backward's recompute."""
        moe, ws = self.cfg.moe, self.ws
        r = moe_rows(self.cfg, xn.shape[0])
        op("moe_route", xn, w[ROUTER_TENSOR], moe.top_k, moe.norm_topk_prob,
           m["router_logits"], m["router_probs"], m["topk_idx"], m["topk_weight"],
           m["expert_order"], m["expert_offsets"], tag=tag)
        if routing is not None:
            op("moe_route_stats", m["router_logits"], m["router_probs"], m["topk_idx"],
               routing.counts, routing.sums)
        op("moe_permute", xn, m["expert_order"], moe.top_k, ws["expert_in"][:r], tag=tag)
        op("moe_experts_fwd", ws["expert_in"][:r], m["expert_offsets"], *self._stacks(w),
           m["expert_gate"], m["expert_up"], ws["expert_act"][:r], m["expert_out"], tag=tag)
        if out is not None:
            op("moe_combine", m["expert_out"], m["expert_order"], m["topk_weight"], out)

    def backward(self, op: Callable, w: dict, g: dict, xn, m: dict, dy, dxn,
                 routing: RoundRouting, permuted: bool) -> None:
        """dy (T, D), the gradient of the FFN's output -> dxn (T, D), the gradient of its input
        xn; the router's and every expert's weight gradients accumulate into g. `m` holds the
        forward's tensors (saved or just re-formed); `permuted`: the workspace's permuted input
        is this chunk's already (a recompute formed it), else it is gathered again."""
        moe, ws = self.cfg.moe, self.ws
        r = moe_rows(self.cfg, xn.shape[0])
        xp, dyp, dxp = ws["expert_in"][:r], ws["expert_dout"][:r], ws["expert_din"][:r]
        dw = ws["topk_dweight"][:xn.shape[0]]
        op("moe_combine_bwd", dy, m["expert_out"], m["expert_order"], m["topk_weight"], dyp, dw)
        if not permuted:
            op("moe_permute", xn, m["expert_order"], moe.top_k, xp)
        op("moe_experts_bwd", xp, m["expert_offsets"], *self._stacks(w), m["expert_gate"],
           m["expert_up"], dyp, dxp, *self._stacks(g))
        op("moe_router_bwd", xn, w[ROUTER_TENSOR], m["router_logits"], m["router_probs"],
           m["topk_idx"], dw, moe.norm_topk_prob, routing.counts, routing.aux_coef,
           routing.z_coef, routing.n_rows, dxp, m["expert_order"], dxn, g[ROUTER_TENSOR])

    @staticmethod
    def _stacks(views: dict) -> tuple:
        return tuple(views[k] for k in EXPERT_STACKS)
