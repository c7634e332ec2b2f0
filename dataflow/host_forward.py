"""Forward-only passes on the host for validation loss and logits: the reference kernels
(dataflow.kernels.reference, the oracle the engine matches) applied layer by layer to weights fetched one
block at a time through Engine.read_block, so host memory holds one block plus the batch's
activations. Slow (NumPy) but exact to the reference; meant for small held-out batches and for
comparing logits with transformers. Never updates weights, optimizer state or the step count."""

from __future__ import annotations

import numpy as np

from dataflow.kernels.reference.embedding import embedding_fwd
from dataflow.kernels.reference.head_loss import head_loss_fwd_bwd
from dataflow.kernels.reference.rms_norm import rms_norm_fwd
from dataflow.models.layout import BlockKind
from dataflow.reference_model import layer_forward


def _final_hidden(eng, inputs: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Normed final hidden states (one (T, D) per row) and the lm_head weight (V, D): the
    embedding table when the model ties them."""
    cfg = eng.plan.model
    refs = eng.block_refs()
    by_kind = {r.kind: r for r in refs if r.kind is not BlockKind.LAYER}
    emb_lay = eng.layout(by_kind[BlockKind.EMBED])
    table = emb_lay.view(eng.read_block(by_kind[BlockKind.EMBED]), "embed_tokens")
    xs = [embedding_fwd(row, table) for row in inputs]
    if not cfg.tie_embeddings:  # a tied table is the head's projection too
        del table
    pos = np.arange(inputs.shape[1])
    for ref in refs:
        if ref.kind is BlockKind.LAYER:
            w = eng.layout(ref).views(eng.read_block(ref))
            # the reference's own layer: dense SwiGLU or the MoE block, biases and QK-norm
            # as the family has them
            xs = [layer_forward(cfg, w, x, pos) for x in xs]
    head_ref = by_kind[BlockKind.HEAD]
    head = eng.read_block(head_ref)
    lay = eng.layout(head_ref)
    norm_w = lay.view(head, "norm")
    lm_head = table if cfg.tie_embeddings else lay.view(head, "lm_head")
    return [rms_norm_fwd(x, norm_w, cfg.norm_eps)[0] for x in xs], lm_head


def eval_loss(eng, tokens: np.ndarray) -> float:
    """Mean next-token cross-entropy of `tokens` (n, seqlen + 1) under the engine's current
    weights, without training (inputs row[:-1], targets row[1:])."""
    tokens = np.asarray(tokens)
    hidden, lm_head = _final_hidden(eng, tokens[:, :-1])
    total, count = 0.0, 0
    for xn, targets in zip(hidden, tokens[:, 1:]):
        loss_sum, n, _, _ = head_loss_fwd_bwd(xn, lm_head, targets)
        total, count = total + loss_sum, count + n
    return total / max(count, 1)


def logits(eng, inputs: np.ndarray) -> np.ndarray:
    """fp32 logits (n, T, V) of `inputs` (n, T) token ids under the engine's current weights."""
    hidden, lm_head = _final_hidden(eng, np.asarray(inputs))
    w = lm_head.astype(np.float32)
    return np.stack([xn.astype(np.float32) @ w.T for xn in hidden])
