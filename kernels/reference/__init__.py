"""NumPy reference ops, forward and backward: the definitions of truth every fast path is checked
against. Clear and vectorised rather than fast; never imports anything of ours but this package.
Shape legend in `kernels/__init__.py`."""

from dataflow.kernels.reference._dtypes import acc_dtype
from dataflow.kernels.reference.adamw import adamw_step
from dataflow.kernels.reference.attention import attention_bwd, attention_fwd
from dataflow.kernels.reference.embedding import embedding_bwd, embedding_fwd
from dataflow.kernels.reference.fp8 import fp8_linear_bwd, fp8_linear_fwd, quantise
from dataflow.kernels.reference.head_loss import IGNORE, head_loss_fwd_bwd
from dataflow.kernels.reference.linear import bias_bwd, linear_bwd, linear_fwd
from dataflow.kernels.reference.lora import lora_linear_bwd, lora_linear_fwd
from dataflow.kernels.reference.rms_norm import rms_norm_bwd, rms_norm_fwd
from dataflow.kernels.reference.rope import rope_bwd, rope_cos_sin, rope_fwd, rope_inv_freq
from dataflow.kernels.reference.swiglu import swiglu_bwd, swiglu_fwd

__all__ = [
    "acc_dtype", "adamw_step", "attention_bwd", "attention_fwd", "bias_bwd", "embedding_bwd",
    "embedding_fwd", "fp8_linear_bwd", "fp8_linear_fwd", "IGNORE", "quantise",
    "head_loss_fwd_bwd", "linear_bwd", "linear_fwd", "lora_linear_bwd", "lora_linear_fwd",
    "rms_norm_bwd", "rms_norm_fwd",
    "rope_bwd", "rope_cos_sin", "rope_fwd", "rope_inv_freq", "swiglu_bwd", "swiglu_fwd",
]
