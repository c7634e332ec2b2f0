"""A float64 transcription of LoRA training (the oracle of the engine's LoRA path, issue 54):
the adapted model is the plain model with each adapted weight merged, w + s b a, so its loss
is dataflow.reference_model's on merged float64 weights, and the adapters' gradients follow
from the merged weight's gradient G by the chain rule: da = s b^T G, db = s G a^T (the base
gets none). AdamW on the adapters as dataflow.kernels.reference.adamw_step, in float64. Never
plans, never touches a device; slow and plain on purpose."""

from __future__ import annotations

import types

import numpy as np

from dataflow.kernels.reference import adamw_step
from dataflow.kernels.reference.lora import merged_weight
from dataflow.memplan.plan.lora import HF_NAMES, Lora
from dataflow.models.init import ModelWeights
from dataflow.models.layout import layer_layout
from dataflow.reference_model import forward_backward

F64 = np.float64


def merged_weights(weights: ModelWeights, lora: Lora, adapters: dict, dtype=F64):
    """The base `weights` with every adapted linear replaced by w + s b a, in `dtype`
    (float64 for the oracle; the base's bf16 for an export of merged weights). adapters:
    'layers.{i}.{target}.a' / '.b' arrays (Engine.lora_state's names)."""
    cfg = weights.cfg
    lay = layer_layout(cfg)
    layers = []
    for i, block in enumerate(weights.layers):
        base = lay.views(np.asarray(block, F64))
        out = block.astype(dtype)
        views = lay.views(out)
        for t in lora.targets:
            a, b = (np.asarray(adapters[f"layers.{i}.{t}.{p}"], F64) for p in "ab")
            name = HF_NAMES[t]
            views[name][...] = merged_weight(base[name], a, b, lora.scale).astype(dtype)
        layers.append(out)
    if np.dtype(dtype) == weights.embed.dtype:
        return ModelWeights(cfg, weights.embed.copy(), layers, weights.head.copy())
    # ModelWeights holds bf16 only; the reference model reads any object with these blocks
    return types.SimpleNamespace(cfg=cfg, embed=weights.embed.astype(dtype), layers=layers,
                                 head=weights.head.astype(dtype))


def loss_and_grads(weights: ModelWeights, lora: Lora, adapters: dict,
                   batch: np.ndarray) -> tuple[float, dict]:
    """(mean cross-entropy over the batch's targets, {adapter name: float64 gradient of that
    mean}) for rows `batch` (B, S + 1)."""
    cfg = weights.cfg
    merged = merged_weights(weights, lora, adapters)
    lay = layer_layout(cfg)
    total, count = 0.0, 0
    g_sum = [np.zeros(lay.numel, F64) for _ in range(cfg.n_layers)]
    for row in np.asarray(batch):
        loss_sum, n, grads = forward_backward(cfg, merged, row)
        total, count = total + loss_sum, count + n
        for acc, g in zip(g_sum, grads.layers):
            acc += g
    out = {}
    for i, g in enumerate(g_sum):
        views = lay.views(g / count)
        for t in lora.targets:
            a, b = (np.asarray(adapters[f"layers.{i}.{t}.{p}"], F64) for p in "ab")
            gw = views[HF_NAMES[t]]
            out[f"layers.{i}.{t}.a"] = lora.scale * (b.T @ gw)
            out[f"layers.{i}.{t}.b"] = lora.scale * (gw @ a.T)
    return total / count, out


class LoraReferenceTrainer:
    """AdamW on float64 adapters over a frozen base: step(batch) -> the step's mean loss before
    its update. lr, betas, eps, weight_decay as dataflow.optimizer.AdamWConfig; no clipping."""

    def __init__(self, weights: ModelWeights, lora: Lora, adapters: dict, *, lr: float,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        self.weights, self.lora = weights, lora
        self.adapters = {k: np.array(v, F64) for k, v in adapters.items()
                         if k.endswith((".a", ".b"))}
        self.m = {k: np.zeros_like(v) for k, v in self.adapters.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.adapters.items()}
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                          weight_decay=weight_decay)
        self.steps = 0
        self.last_grads: dict = {}

    def step(self, batch: np.ndarray) -> float:
        loss, grads = loss_and_grads(self.weights, self.lora, self.adapters, batch)
        self.steps += 1
        for k, g in grads.items():
            adamw_step(self.adapters[k], g, self.m[k], self.v[k], step=self.steps, **self.hyper)
        self.last_grads = grads
        return loss
