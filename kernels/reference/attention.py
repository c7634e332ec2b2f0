"""Causal grouped-query attention that can continue a sequence across chunks: a query chunk of T
tokens at absolute positions q_offset .. q_offset+T-1 attends to every key at a position <= its
own among S context keys (the earlier chunks of the same sequence and itself). Returns the
log-sum-exp of the scores so the backward need not keep the probabilities. Scale 1/sqrt(E).
Query head h reads kv head h // (H / K). Scores and softmax in the acc dtype, never in bf16."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up

_Q_BLOCK = 512  # query rows scored at once: bounds the (rows, S) score matrix held in memory


def _check(q, k, v, q_offset):
    t, h, e = q.shape
    s, kh, _ = k.shape
    if v.shape != k.shape or k.shape[2] != e or h % kh:
        raise ValueError(f"attention shapes q {q.shape}, k {k.shape}, v {v.shape} do not agree")
    if q_offset < 0 or q_offset + t > s:
        raise ValueError(f"query chunk [{q_offset}, {q_offset + t}) lies outside the {s} keys")
    return t, h, e, s, kh, h // kh


def attention_fwd(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  q_offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """q (T, H, E), k (S, K, E), v (S, K, E) -> o (T, H, E) in q's dtype, lse (H, T) acc dtype."""
    t, h, e, s, kh, group = _check(q, k, v, q_offset)
    dt = acc_dtype(q, k, v)
    scale = dt.type(1.0 / np.sqrt(e))
    qf, kf, vf = up(q, dt), up(k, dt), up(v, dt)
    o = np.empty((t, h, e), dtype=dt)
    lse = np.empty((h, t), dtype=dt)
    key_pos = np.arange(s)
    for r0 in range(0, t, _Q_BLOCK):
        r1 = min(t, r0 + _Q_BLOCK)
        masked = key_pos[None, :] > (q_offset + np.arange(r0, r1))[:, None]  # (rows, S)
        for head in range(h):
            kvh = head // group
            sc = (qf[r0:r1, head] @ kf[:, kvh].T) * scale
            sc[masked] = -np.inf
            mx = sc.max(axis=1, keepdims=True)
            p = np.exp(sc - mx)
            denom = p.sum(axis=1, keepdims=True)
            o[r0:r1, head] = (p @ vf[:, kvh]) / denom
            lse[head, r0:r1] = (mx + np.log(denom))[:, 0]
    return o.astype(q.dtype), lse


def attention_bwd(q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray, lse: np.ndarray,
                  do: np.ndarray, q_offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of attention_fwd: -> dq (T, H, E) in q's dtype; dk, dv (S, K, E) in the acc
    dtype, covering the whole context (earlier chunks' keys receive gradient too)."""
    t, h, e, s, kh, group = _check(q, k, v, q_offset)
    dt = acc_dtype(q, k, v, do)
    scale = dt.type(1.0 / np.sqrt(e))
    qf, kf, vf, dof = up(q, dt), up(k, dt), up(v, dt), up(do, dt)
    delta = np.sum(dof * up(o, dt), axis=-1)  # (T, H): rowsum(dO * O)
    dq = np.zeros((t, h, e), dtype=dt)
    dk = np.zeros((s, kh, e), dtype=dt)
    dv = np.zeros((s, kh, e), dtype=dt)
    key_pos = np.arange(s)
    for r0 in range(0, t, _Q_BLOCK):
        r1 = min(t, r0 + _Q_BLOCK)
        masked = key_pos[None, :] > (q_offset + np.arange(r0, r1))[:, None]
        for head in range(h):
            kvh = head // group
            sc = (qf[r0:r1, head] @ kf[:, kvh].T) * scale
            p = np.exp(sc - up(lse[head, r0:r1], dt)[:, None])
            p[masked] = 0.0
            dv[:, kvh] += p.T @ dof[r0:r1, head]
            dp = dof[r0:r1, head] @ vf[:, kvh].T
            ds = p * (dp - delta[r0:r1, head][:, None]) * scale
            dq[r0:r1, head] = ds @ kf[:, kvh]
            dk[:, kvh] += ds.T @ qf[r0:r1, head]
    return dq.astype(q.dtype), dk, dv
