"""Output head and next-token cross-entropy, forward and backward together, in sub-chunks of
tokens so that logits for a long chunk (T x V, e.g. 8192 x 128256) never exist at once.
`x` is the final-normed hidden state; the final RMSNorm is a separate op."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up

IGNORE = -100
"""A target equal to IGNORE contributes no loss and no gradient: -100, the ignore index of
transformers (and torch.nn.CrossEntropyLoss), so a trainer's masked labels pass through as they
are."""


def head_loss_fwd_bwd(x: np.ndarray, w: np.ndarray, targets: np.ndarray, *,
                      sub_tokens: int = 1024, grad_scale: float = 1.0
                      ) -> tuple[float, int, np.ndarray, np.ndarray]:
    """x (T, D), w (V, D), targets (T,) int -> (loss_sum, n_valid, dx (T, D), dw (V, D)).

    loss_sum is the sum over valid tokens of logsumexp(logits) - logits[target] (float).
    dx is in x's dtype and dw in the acc dtype; both are the gradient of grad_scale * loss_sum
    (pass grad_scale = 1 / tokens_per_step for a mean loss).
    """
    if sub_tokens <= 0:
        raise ValueError(f"sub_tokens must be positive, got {sub_tokens}")
    dt = acc_dtype(x, w)
    wf = up(w, dt)
    targets = np.asarray(targets)
    dx = np.empty(x.shape, dtype=dt)
    dw = np.zeros(w.shape, dtype=dt)
    loss_sum, n_valid = 0.0, 0
    for t0 in range(0, x.shape[0], sub_tokens):
        t1 = min(x.shape[0], t0 + sub_tokens)
        xs, tgt = up(x[t0:t1], dt), targets[t0:t1]
        valid = tgt != IGNORE
        logits = xs @ wf.T                                   # (t, V)
        mx = logits.max(axis=1, keepdims=True)
        p = np.exp(logits - mx)
        denom = p.sum(axis=1, keepdims=True)
        lse = (mx + np.log(denom))[:, 0]
        rows = np.nonzero(valid)[0]
        loss_sum += float(np.sum(lse[rows] - logits[rows, tgt[rows]]))
        n_valid += int(rows.size)
        p /= denom
        p[rows, tgt[rows]] -= 1.0                            # d loss / d logits
        p[~valid] = 0.0
        p *= dt.type(grad_scale)
        dx[t0:t1] = p @ wf
        dw += p.T @ xs
    return loss_sum, n_valid, dx.astype(x.dtype), dw
