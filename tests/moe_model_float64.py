"""A float64 transcription of transformers' OlmoeForCausalLM / Qwen3MoeForCausalLM loss on a
batch, with output_router_logits=True: the mean next-token cross-entropy over the batch's valid
targets plus router_aux_loss_coef times load_balancing_loss_func over every layer's router
logits of the whole batch (attention_mask None: all rows), plus, for a config with a z-loss
coefficient, switch_transformers' router_z_loss_func over the same rows. Composed from
tests.llama_float64 (attention, per-family QK-norm, head) and tests.moe_float64 (the sparse
block, the auxiliary losses); independent of dataflow.kernels.reference."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.reference import IGNORE
from tests.llama_float64 import llama_loss_float64
from tests.moe_float64 import load_balancing_loss_float64, router_z_loss_float64


def moe_causal_lm_loss_float64(cfg, w, batch):
    """batch (B, S + 1) int -> (objective, lm_loss, aux_loss, z_loss): objective = lm_loss +
    aux_coef * aux_loss + z_coef * z_loss, lm_loss the mean cross-entropy over the valid
    targets, aux_loss and z_loss unscaled."""
    batch = np.asarray(batch)
    ce_sum, logits = 0.0, []
    for row in batch:
        per_layer = []
        ce_sum += llama_loss_float64(cfg, w, row, router_logits=per_layer)
        logits.append(per_layer)
    n_valid = int(np.count_nonzero(batch[:, 1:] != IGNORE))
    # transformers' router_logits: one (B*T, N) tensor per layer; the loss concatenates them all
    layers = [np.concatenate([seq[layer] for seq in logits], axis=0)
              for layer in range(cfg.n_layers)]
    aux = load_balancing_loss_float64(tuple(layers), cfg.moe.n_experts, cfg.moe.top_k)
    z = router_z_loss_float64(np.concatenate(layers, axis=0))
    lm = ce_sum / n_valid
    m = cfg.moe
    return lm + m.router_aux_loss_coef * aux + m.router_z_loss_coef * z, lm, aux, z
