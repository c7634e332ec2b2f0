"""The reference trainer: the whole model resident in host memory, one sequence at a time, no
chunking, no rounds, no recompute: forward, loss, backward per sequence, gradient accumulation
over the sequences of a step, then AdamW on every block. Slow and plain on purpose: it is the
oracle the engine is compared against (DESIGN.md §5). Never plans, never touches a device, and
computes only through dataflow.kernels.reference.

An MoE model (ModelConfig.moe) trains here too (the engine's oracle): its objective is the mean
cross-entropy plus router_aux_loss_coef times the batch's load-balancing loss (and
router_z_loss_coef times its z-loss), as transformers' OlmoeForCausalLM / Qwen3MoeForCausalLM
with output_router_logits=True; the loss reported stays the cross-entropy, the auxiliary values
beside it (StepResult.aux_loss, z_loss). With micro_batches R the batch is R forward calls, each
with its own auxiliary losses, and the objective adds the coefficients times their MEAN (what
the engine computes with R rounds a step: docs/moe.md). AdamW updates every block, so an expert
no token reached still has its moments and weights decayed, as transformers' OLMoE 4.x (which
calls every expert) does; Qwen3-MoE with zero_grad(set_to_none=True) would skip it
(docs/moe.md)."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from dataflow.kernels.reference import IGNORE, adamw_step
from dataflow.reference_model import RouterTotals, backward, forward, forward_backward
from dataflow.memplan.plan.frozen import as_frozen
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)
CLIP_EPS = 1e-6
"""Added to the gradient norm before dividing, as torch.nn.utils.clip_grad_norm_ does."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    step: int
    """Optimizer steps taken including this one (AdamW's bias-correction step)."""
    loss_mean: float
    """Cross-entropy averaged over every valid target of the step, before the update."""
    n_tokens: int
    """Valid targets in the step (targets equal to IGNORE excluded)."""
    grad_norm: float
    """Global L2 norm of the mean-loss gradient over all blocks, before clipping."""
    clip_coef: float
    """Factor the gradient was multiplied by for AdamW: min(1, max_grad_norm / norm), or 1."""
    aux_loss: float | None = None
    """MoE models: the load-balancing loss of the step's batch (unscaled; the objective adds
    router_aux_loss_coef times it to loss_mean, which stays the language model's), the mean over
    its micro-batches' when there are several; None when dense."""
    z_loss: float | None = None
    """MoE models: the router z-loss of the batch (unscaled; objective coefficient
    router_z_loss_coef), likewise; None when dense."""


class ReferenceTrainer:
    """Trains `weights` (dataflow.models.init.ModelWeights or any object with `.embed`, `.layers`,
    `.head` 1-D blocks laid out by dataflow.models.layout) in place.

    lr, betas, eps, weight_decay: AdamW's (decoupled decay, applied to every block, norms and
    embedding included). grad_accum_dtype: dtype of the per-block gradient accumulators summed
    over the sequences of a step (float32 by default; bf16 reproduces ml_dataflow's lossy
    choice, float64 is the most precise). max_grad_norm: clip the global gradient norm to this
    value (folded into AdamW's grad_scale), or None. AdamW's m and v have the weights' dtype
    (bf16 for ModelWeights) and start at zero. micro_batches: an MoE model's batch is this many
    forward calls of consecutive equal groups of rows (the engine's rounds), each with its own
    auxiliary losses, whose mean the objective adds; it changes nothing for a dense model (the
    batch's rows must still divide into them). frozen: blocks that train no further (a Frozen
    or a spec such as 'embed,layers:0-1': dataflow.memplan.plan.frozen): they keep their
    weights, get no AdamW step and no m or v, and their gradients are left out of the norm
    (the engine forms none for them).
    """

    def __init__(self, cfg: ModelConfig, weights, *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, grad_accum_dtype=np.float32,
                 max_grad_norm: float | None = None, micro_batches: int = 1, frozen=None):
        if not lr > 0:
            raise ConfigError(f"lr must be positive, got {lr!r}; try 3e-4")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {betas!r}; "
                              "try (0.9, 0.95)")
        if not eps > 0 or not weight_decay >= 0:
            raise ConfigError(f"eps must be positive and weight_decay non-negative, got eps "
                              f"{eps!r} and weight_decay {weight_decay!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}; "
                              "try 1.0, or None for no clipping")
        accum = np.dtype(grad_accum_dtype)
        if accum not in (BF16, np.dtype(np.float32), np.dtype(np.float64)):
            raise ConfigError(f"grad_accum_dtype {accum} is not supported; use float32, "
                              "float64 or bfloat16")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
                or micro_batches < 1:
            raise ConfigError(f"micro_batches must be a positive integer, got {micro_batches!r}; "
                              "pass the engine's rounds_per_step")
        if len(weights.layers) != cfg.n_layers:
            raise ConfigError(f"model '{cfg.name}' has {cfg.n_layers} layers, weights hold "
                              f"{len(weights.layers)}")
        self.cfg = cfg
        self.weights = weights
        self.lr, self.betas, self.eps = float(lr), (float(betas[0]), float(betas[1])), float(eps)
        self.weight_decay = float(weight_decay)
        self.grad_accum_dtype = accum
        self.max_grad_norm = max_grad_norm
        self.micro_batches = micro_batches
        self.frozen = as_frozen(frozen, cfg.n_layers)
        self.trains = [not self.frozen.embed] + [not self.frozen.layer(i)
                                                 for i in range(cfg.n_layers)] \
            + [not self.frozen.head]
        """Per block in file order (embed, layers..., head): whether it trains."""
        self.m = [np.zeros_like(b) if t else None for b, t in zip(self.blocks, self.trains)]
        self.v = [np.zeros_like(b) if t else None for b, t in zip(self.blocks, self.trains)]
        self.step = 0
        """Optimizer steps taken so far."""
        self.last_routers: tuple[RouterTotals, ...] = ()
        """MoE models: the routing totals of each micro-batch of the last batch."""

    @property
    def blocks(self) -> list[np.ndarray]:
        """The weight blocks, in file order (embed, layers..., head); updated in place."""
        return [self.weights.embed, *self.weights.layers, self.weights.head]

    def accumulate_grads(self, batch: np.ndarray,
                         labels: np.ndarray | None = None) -> tuple[float, int, list[np.ndarray]]:
        """Mean loss and its gradient over a batch, without updating anything.

        batch (n_seqs, seqlen + 1) int: one sequence per row (inputs row[:-1], targets row[1:]);
        labels: the batch's shape, targets labels[:, 1:] instead (IGNORE masks), as transformers.
        Returns (loss_mean, n_tokens, grads): grads one 1-D block per weight block in
        grad_accum_dtype, the gradient of the loss averaged over all n_tokens valid targets
        (each sequence's backward is scaled by 1 / n_tokens, then summed)."""
        batch = np.asarray(batch)
        if batch.ndim != 2 or batch.shape[1] < 2:
            raise ConfigError(f"batch must have shape (n_seqs, seqlen + 1) with seqlen >= 1, "
                              f"got {batch.shape}")
        targets = (batch if labels is None else np.asarray(labels))[:, 1:]
        n_tokens = int(np.count_nonzero(targets != IGNORE))
        if n_tokens == 0:
            raise ConfigError("every target of the batch is IGNORE; a step needs at least one "
                              "token to learn from")
        if batch.shape[0] % self.micro_batches:
            raise ConfigError(f"a batch of {batch.shape[0]} rows does not split into "
                              f"{self.micro_batches} equal micro-batches; pass a multiple of "
                              f"{self.micro_batches} rows")
        grad_scale = 1.0 / n_tokens
        accum = [np.zeros(b.size, self.grad_accum_dtype) for b in self.blocks]
        loss_sum = 0.0
        if self.cfg.moe is not None:
            return self._accumulate_moe(batch, labels, grad_scale, n_tokens, accum)
        for i, row in enumerate(batch):
            seq_loss, _, grads = forward_backward(self.cfg, self.weights, row, grad_scale,
                                                  labels=None if labels is None else labels[i])
            loss_sum += seq_loss
            for acc, g in zip(accum, grads.blocks()):
                _accumulate(acc, g)
        return loss_sum / n_tokens, n_tokens, accum

    @property
    def last_router(self) -> RouterTotals | None:
        """The routing totals of the last batch when it was one forward call (None otherwise:
        see last_routers)."""
        return self.last_routers[0] if len(self.last_routers) == 1 else None

    def _accumulate_moe(self, batch, labels, grad_scale, n_tokens, accum):
        """An MoE model's batch, micro-batch by micro-batch: every sequence's forward of a
        micro-batch first, so its auxiliary losses are those of the micro-batch as one forward
        call (transformers concatenates every layer's router logits of the call: one
        load-balancing loss, not a sum of per-sequence ones), then each sequence's backward
        with those totals and the coefficients divided by the number of micro-batches. Keeps a
        micro-batch's activations: the reference is for small models. The totals stay in
        `last_routers`."""
        routers, loss_sum = [], 0.0
        per = batch.shape[0] // self.micro_batches
        for first in range(0, batch.shape[0], per):
            rows = range(first, first + per)
            fwds = [forward(self.cfg, self.weights, batch[i], grad_scale,
                            labels=None if labels is None else labels[i]) for i in rows]
            router = RouterTotals(self.cfg.moe.n_experts)
            for f in fwds:
                router.merge(f.router)
            routers.append(router)
            for f in fwds:
                loss_sum += f.loss_sum
                for acc, g in zip(accum, backward(f, router, 1.0 / self.micro_batches).blocks()):
                    _accumulate(acc, g)
        self.last_routers = tuple(routers)
        return loss_sum / n_tokens, n_tokens, accum

    def train_step(self, batch: np.ndarray, labels: np.ndarray | None = None) -> StepResult:
        """One optimizer step on `batch` (n_seqs, seqlen + 1) int (and `labels`, as in
        accumulate_grads): accumulate the mean-loss gradient over its sequences, clip it if
        asked, then AdamW on every block that trains."""
        loss_mean, n_tokens, grads = self.accumulate_grads(batch, labels)
        grad_norm = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64)))
                                  for g, t in zip(grads, self.trains) if t))
        clip_coef = 1.0
        if self.max_grad_norm is not None:
            clip_coef = min(1.0, self.max_grad_norm / (grad_norm + CLIP_EPS))
        self.step += 1
        for param, grad, m, v, trains in zip(self.blocks, grads, self.m, self.v, self.trains):
            if not trains:  # a frozen block keeps its weights
                continue
            adamw_step(param, grad, m, v, step=self.step, lr=self.lr, beta1=self.betas[0],
                       beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay,
                       grad_scale=clip_coef)
        aux = z = None
        if self.cfg.moe is not None:
            aux = sum(r.aux_loss for r in self.last_routers) / len(self.last_routers)
            z = sum(r.z_loss for r in self.last_routers) / len(self.last_routers)
        return StepResult(step=self.step, loss_mean=loss_mean, n_tokens=n_tokens,
                          grad_norm=grad_norm, clip_coef=clip_coef, aux_loss=aux, z_loss=z)


def _accumulate(acc: np.ndarray, g: np.ndarray) -> None:
    """acc += g, the sum formed in at least fp32 and rounded once to acc's dtype."""
    if acc.dtype == g.dtype:
        acc += g
    else:
        wide = np.promote_types(np.promote_types(acc.dtype, g.dtype), np.float32)
        acc[...] = (acc.astype(wide) + g.astype(wide)).astype(acc.dtype)
