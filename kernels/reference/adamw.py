"""AdamW over a whole block: bf16 param/m/v storage, fp32 math, bias correction, decoupled weight
decay (Loshchilov & Hutter: p -= lr * wd * p, not added to the gradient). Updates in place."""

import numpy as np

from dataflow.kernels.reference._dtypes import acc_dtype, up


def adamw_step(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, *,
               step: int, lr: float, beta1: float = 0.9, beta2: float = 0.95,
               eps: float = 1e-8, weight_decay: float = 0.0, grad_scale: float = 1.0) -> None:
    """param, grad, m, v: same shape; step >= 1 counts updates including this one.

    g = grad * grad_scale (clipping and mean-over-rounds fold into grad_scale);
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
    p = p - lr * (wd * p + (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps)).
    """
    if step < 1:
        raise ValueError(f"AdamW step counts from 1, got {step}")
    dt = acc_dtype(param, grad)
    g = up(grad, dt) * dt.type(grad_scale)
    mf = dt.type(beta1) * up(m, dt) + dt.type(1 - beta1) * g
    vf = dt.type(beta2) * up(v, dt) + dt.type(1 - beta2) * g * g
    m_hat = mf / dt.type(1 - beta1 ** step)
    v_hat = vf / dt.type(1 - beta2 ** step)
    p = up(param, dt)
    p = p - dt.type(lr) * (dt.type(weight_decay) * p + m_hat / (np.sqrt(v_hat) + dt.type(eps)))
    param[...] = p.astype(param.dtype)
    m[...] = mf.astype(m.dtype)
    v[...] = vf.astype(v.dtype)
