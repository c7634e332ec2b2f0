"""CUDA implementations of every op in `dataflow.kernels.reference`, for the CuPy backend: CuPy arrays in
and out, OUTPUT BUFFERS PASSED IN (the engine preallocates everything in one arena), all work
enqueued on the current CuPy stream (`cupy.cuda.get_current_stream()`), no host synchronisation
inside any op. Every launcher takes a CudaContext first (`ctx`, kernels/cuda/context.py): its
compiled modules, library handles, cuDNN graphs and scratch live there, owned by the backend that
made it, never in module globals. Elementwise and reduction ops are CUDA C++ templates (one `.cu`
per op beside its launcher, compiled once per device and context by NVRTC, cached in the context);
GEMMs go through cuBLAS gemmEx (FP8 GEMMs through cuBLASLt, fp8_gemm); attention through cuDNN's fused SDPA (nvidia-cudnn-frontend).
Importing this package needs CuPy; the NumPy backend never imports it. Shape legend in
`kernels/__init__.py`.

Scratch: the ops that need a reduction scratch (rms_norm_bwd, sumsq) or a cuDNN workspace
(attention) take it as an argument; when none is passed they keep one in the context per device
and stream from first use (allocated once, outside the steady-state loop).

Mixture of experts (moe_router, moe_experts): the experts' GEMM loop takes each expert's row
count on the host, so offsets_to_host is the one copy whose event a caller waits on before
experts_fwd / experts_bwd (moe_experts says what that costs).
"""

from dataflow.kernels.cuda._cublas import handle as cublas_handle
from dataflow.kernels.cuda._cublas import set_workspace as set_cublas_workspace
from dataflow.kernels.cuda._cublas import workspace as cublas_workspace
from dataflow.kernels.cuda._cublaslt import gemm_loop as cublaslt_gemm_loop
from dataflow.kernels.cuda.adamw import adamw_step
from dataflow.kernels.cuda.attention import attention_bwd, attention_fwd, attention_workspace_bytes
from dataflow.kernels.cuda.context import CudaContext
from dataflow.kernels.cuda.embedding import embedding_bwd, embedding_fwd
from dataflow.kernels.cuda.fp8 import amax_scale as fp8_amax_scale
from dataflow.kernels.cuda.fp8 import cast as fp8_cast
from dataflow.kernels.cuda.fp8 import GUESS_HEADER as FP8_GUESS_HEADER
from dataflow.kernels.cuda.fp8 import guess_counts as fp8_guess_counts
from dataflow.kernels.cuda.fp8 import quantise as fp8_quantise
from dataflow.kernels.cuda.fp8 import quantise_guessed as fp8_quantise_guessed
from dataflow.kernels.cuda.fp8_base import fp8_base_dequant
from dataflow.kernels.cuda.fp8_gemm import fp8_gemm
from dataflow.kernels.cuda import grouped_gemm
from dataflow.kernels.cuda.head_loss import IGNORE, head_loss_fwd_bwd
from dataflow.kernels.cuda.head_vocab import vocab_grad, vocab_loss, vocab_merge, vocab_stats
from dataflow.kernels.cuda.linear import linear_bwd_w, linear_bwd_x, linear_fwd
from dataflow.kernels.cuda.moe_experts import (expert_order, experts_bwd, experts_bwd_acc_elems,
                                             experts_fwd, inverse_order, mapped_address,
                                             offsets_to_host, permute_bwd, permute_fwd,
                                             unpermute_bwd, unpermute_fwd)
from dataflow.kernels.cuda.moe_router import (load_balancing_loss, load_balancing_loss_bwd,
                                            load_balancing_stats, router_bwd,
                                            router_bwd_scratch_elems, router_fwd,
                                            router_logits_bwd, router_z_loss, router_z_loss_bwd)
from dataflow.kernels.cuda.rms_norm import rms_norm_bwd, rms_norm_bwd_scratch_shape, rms_norm_fwd
from dataflow.kernels.cuda.rope import rope_bwd, rope_fwd
from dataflow.kernels.cuda.swiglu import swiglu_bwd, swiglu_fwd
from dataflow.kernels.cuda.utils import (add_, bias_bwd, bias_fill, cast, clip_scale, fill_, scale_,
                                         sumsq, sumsq_blocks)

__all__ = [
    "adamw_step", "add_", "attention_bwd", "attention_fwd", "attention_workspace_bytes",
    "bias_bwd", "bias_fill", "cast", "cublas_handle", "cublas_workspace", "cublaslt_gemm_loop", "CudaContext",
    "clip_scale", "embedding_bwd", "embedding_fwd", "expert_order", "experts_bwd",
    "experts_bwd_acc_elems", "experts_fwd", "fill_", "scale_", "fp8_amax_scale", "fp8_base_dequant", "fp8_cast", "fp8_gemm",
    "FP8_GUESS_HEADER", "fp8_guess_counts", "fp8_quantise", "fp8_quantise_guessed", "grouped_gemm",
    "head_loss_fwd_bwd",
    "IGNORE", "inverse_order",
    "linear_bwd_w", "linear_bwd_x", "linear_fwd", "load_balancing_loss", "load_balancing_loss_bwd",
    "load_balancing_stats", "mapped_address", "offsets_to_host", "permute_bwd", "permute_fwd",
    "rms_norm_bwd", "rms_norm_bwd_scratch_shape", "rms_norm_fwd", "rope_bwd", "rope_fwd",
    "router_bwd", "router_bwd_scratch_elems", "router_fwd", "router_logits_bwd", "router_z_loss",
    "router_z_loss_bwd", "set_cublas_workspace", "sumsq", "sumsq_blocks", "swiglu_bwd",
    "swiglu_fwd",
    "unpermute_bwd", "unpermute_fwd", "vocab_grad", "vocab_loss", "vocab_merge", "vocab_stats",
]
