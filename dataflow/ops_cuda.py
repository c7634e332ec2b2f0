"""The op table for the CuPy backend: the same names, signatures and semantics as
dataflow.ops_numpy, implemented by dataflow.kernels.cuda. One `CudaOps` per backend (two backends on two
GPUs can live in one process), bound to that backend's CudaContext (the kernels' handles, graphs
and caches), which every kernel call is given. Adapts the few places where the CUDA kernels'
conventions differ (cuDNN writes bf16 dK/dV that the engine accumulates in fp32; AdamW takes
keywords). Library scratch comes from the device arena: the executor lends the planner's regions
(attention workspace, bf16 dK/dV of a context) through `lend_scratch`; only a shape that outgrows
them allocates outside the arena, and `library_workspace_bytes()` reports it. `quiesce` goes to
every cuDNN call (dataflow.kernels.cuda.attention says why). The mixture-of-experts ops live in
dataflow.ops_cuda_moe (MoeOps, inherited), with the one host wait they need. Never decides
placement."""

from __future__ import annotations

import functools

import cupy as cp

import dataflow.kernels.cuda as K
from dataflow.ops_cuda_moe import MOE_BOUND, MoeOps
from dataflow.ops_numpy import WRITES
from dataflow.memplan.plan.buffers import key_block_spans
from dataflow.memplan.plan.split import SUB_BLOCK
from dataflow.settings import settings_from_env


_ZERO_ROWS = cp.ElementwiseKernel(
    "raw I ids, int64 d, I value", "T x", "if (ids[i / d] == value) x = (T)0;",
    "dataflow_zero_rows_where")
"""x (T, D) in place: the rows whose id is `value` set to zero bits."""


_BOUND = {name: name for name in (
    "rms_norm_fwd", "linear_fwd", "linear_bwd_x", "linear_bwd_w", "bias_fill", "bias_bwd",
    "rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd", "embedding_fwd", "embedding_bwd",
    "head_loss_fwd_bwd", "add_", "cast", "clip_scale", "scale_", "fp8_base_dequant",
    "vocab_stats", "vocab_merge", "vocab_loss", "vocab_grad")} | MOE_BOUND
"""Op name -> the kernel it is, with the table's CudaContext bound first."""


class CudaOps(MoeOps):
    WRITES = WRITES

    def fill_(self, x, value):
        """K.fill_ for bf16 and fp32; an integer view (an MoE model's routing counts, int64)
        through CuPy's own fill, on the current stream, allocating nothing."""
        if x.dtype.kind in "iu":
            x.fill(int(value))
        else:
            K.fill_(self.ctx, x, value)

    @staticmethod
    def zero_rows_where_(ids, x, value):
        """As dataflow.ops_numpy's, in place on x's bits: no temporary array (the backend
        refuses allocations outside the arena after setup), no sync."""
        bits = x.view(cp.uint16 if x.dtype.itemsize == 2 else cp.uint32)
        flat = ids.reshape(-1)
        _ZERO_ROWS(flat, bits.shape[-1], flat.dtype.type(value), bits)

    def __init__(self, ctx=None, quiesce=None, wait=None):
        self.ctx = ctx if ctx is not None else K.CudaContext(
            cudnn_cache_dir=settings_from_env().cudnn_cache_dir)
        """The kernels' CudaContext: the backend's (its close() releases it); a table made
        without one (tests, benchmarks) makes its own, whose handles stay until ctx.close()."""
        for name, kernel in _BOUND.items():  # partials, not methods: no extra Python frame
            setattr(self, name, functools.partial(getattr(K, kernel), self.ctx))
        self._moe_forced = settings_from_env().moe_experts
        if self._moe_forced not in ("auto", "grouped", "loop"):
            raise ValueError(f"DATAFLOW_MOE_EXPERTS={self._moe_forced!r}: use 'auto' (the "
                             "default: the plan's choice), 'loop' or 'grouped'")
        self._moe_experts = "loop" if self._moe_forced == "auto" else self._moe_forced
        self._quiesce = quiesce
        """Waits, GIL released, until no Python host function is queued (see
        dataflow.kernels.cuda.attention)."""
        self._wait = wait or (lambda event: event.synchronize())
        """Blocks until a CUDA event has passed (the backend's: polling, GIL released); the MoE
        ops' offsets copy (dataflow.ops_cuda_moe) is the only event an op waits for."""
        self._lent: dict = {}
        """Arena views lent by the executor: 'attn_workspace', 'dk16', 'dv16', 'dq32',
        'norm_scratch', 'sumsq_scratch', 'cublas_workspace'; an MoE model's chunk-workspace
        scratch (dataflow.memplan.plan.buffers.MOE_OP_SCRATCH) and 'moe_offsets_host' (pinned)."""
        self._own: dict[tuple, cp.ndarray] = {}
        self._det_fits: dict[tuple, bool] = {}
        """Scratch allocated outside the arena because a lent region was too small."""

    def lend_scratch(self, scratch: dict) -> None:
        self._lent.update(scratch)
        if "cublas_workspace" in scratch:
            K.set_cublas_workspace(self.ctx, scratch["cublas_workspace"])

    def release_scratch(self) -> None:
        """Forget every lent view, and take the cuBLAS workspace back from the handle (which
        outlives the arena those views lie in), unless another table has lent it one since: the
        backend calls this before it frees the arena."""
        ws = self._lent.get("cublas_workspace")
        if ws is not None and K.cublas_workspace(self.ctx)[0] == ws.data.ptr:
            K.set_cublas_workspace(self.ctx, None)
        self._lent.clear()

    def rms_norm_bwd(self, x, w, rstd, dy, dx, dw_acc, residual=None):
        parts, d = K.rms_norm_bwd_scratch_shape(x.shape[0], x.shape[1])
        K.rms_norm_bwd(self.ctx, x, w, rstd, dy, dx, dw_acc,
                       scratch=self._scratch("norm_scratch", (parts, d), cp.float32),
                       residual=residual)

    def sumsq(self, x, out, accumulate: bool = True):
        K.sumsq(self.ctx, x, out, accumulate,
                scratch=self._scratch("sumsq_scratch", (1024,), cp.float32))

    def sumsq_blocks(self, x, out):
        """out (ceil(x.size / SUB_BLOCK),) f64 = each sub-block's float64 sum of squares
        (dataflow.norm_parts' sub-blocks), no scratch: a ring with replicas adds them exactly
        on the host (dataflow.ring.executor), so split and unsplit replicas agree bit for bit."""
        K.sumsq_blocks(self.ctx, x.reshape(-1), out, SUB_BLOCK)

    def _scratch(self, name: str, shape, dtype) -> cp.ndarray:
        n = 1
        for s in shape:
            n *= s
        lent = self._lent.get(name)
        if lent is not None and lent.size >= n and lent.dtype == dtype:
            return lent.reshape(-1)[:n].reshape(shape)
        key = (name, str(dtype))
        buf = self._own.get(key)
        if buf is None or buf.size < n:
            buf = self._own[key] = cp.empty(n, dtype=dtype)
        return buf[:n].reshape(shape)

    def library_workspace_bytes(self) -> int:
        """Bytes of scratch this table allocated outside the arena (0 when the plan's regions
        were large enough)."""
        return sum(b.nbytes for b in self._own.values())

    def attention_fwd(self, q, k, v, q_offset, o, lse):
        K.attention_fwd(self.ctx, q, k, v, q_offset, o, lse,
                        workspace=self._lent.get("attn_workspace"), quiesce=self._quiesce)

    def attention_bwd(self, q, k, v, o, lse, do, q_offset, dq, dk, dv):
        """dq overwritten; dk and dv (fp32, whole context) accumulate (+=), as in ops_numpy.
        A context longer than the lent bf16 dK/dV scratch (the planner's key block) is taken
        one key block at a time (_attention_bwd_blocked), and so is any chunk past the first
        when the plan lent the fp32 dQ scratch that needs: its mask then covers its own keys
        only (dataflow.memplan.plan.buffers.key_block_spans)."""
        end = q_offset + q.shape[0]
        block = self._key_block(k)
        if block is not None and (end > block or (q_offset > 0 and "dq32" in self._lent)):
            return self._attention_bwd_blocked(q, k, v, o, lse, do, q_offset, dq, dk, dv, block)
        dk16 = self._scratch("dk16", k.shape, k.dtype)
        dv16 = self._scratch("dv16", v.shape, v.dtype)
        self._cudnn_bwd(q, k, v, o, lse, do, q_offset, dq, dk16, dv16)
        K.add_(self.ctx, dk, dk16)
        K.add_(self.ctx, dv, dv16)

    def attention_bwd_own(self, q, k, v, o, lse, do, dq, dk, dv):
        """A chunk against its own keys: cuDNN writes dq and the bf16 dk, dv directly (the
        values attention_bwd would accumulate from zero, with no fp32 pass)."""
        self._cudnn_bwd(q, k, v, o, lse, do, 0, dq, dk, dv)

    def _cudnn_bwd(self, q, k, v, o, lse, do, q_offset, dq, dk, dv):
        """One cuDNN backward call writing bf16 dq, dk, dv, in the lent workspace: the
        deterministic algorithm where it fits (_deterministic_fits), else the atomic one."""
        ws = self._lent.get("attn_workspace")
        K.attention_bwd(self.ctx, q, k, v, o, lse, do, q_offset, dq, dk, dv,
                        deterministic=self._deterministic_fits(q, k, q_offset, ws),
                        workspace=ws, quiesce=self._quiesce)

    def attention_workspace_nbytes(self) -> int | None:
        """Bytes of the lent attention workspace (None when none was lent)."""
        ws = self._lent.get("attn_workspace")
        return None if ws is None else int(ws.nbytes)

    def _key_block(self, k) -> int | None:
        """Rows of the lent bf16 dK/dV scratch (the planner's key block), None when unlent."""
        lent = self._lent.get("dk16")
        if lent is None:
            return None
        return lent.size // (k.shape[1] * k.shape[2])

    def _attention_bwd_blocked(self, q, k, v, o, lse, do, q_offset, dq, dk, dv, block):
        """The backward of one query chunk against a long context, one key block per cuDNN
        call (dataflow.memplan.plan.buffers.key_block_spans): the chunk against its own keys (causal), the
        rest of its key block, then every block wholly before it (no mask). Exact: each call
        sees the forward's o and lse, so its softmax weights are the global ones; dK/dV of a
        block are complete, and dQ is the fp32 sum of the blocks' bf16 parts. Bounds the
        library workspace and the bf16 dK/dV scratch by the block instead of the context, and
        keeps the number of distinct cuDNN graphs small. Uses cuDNN's atomic-dQ algorithm (its
        workspace grows with the block, not T*S)."""
        ws = self._lent.get("attn_workspace")
        dq32 = self._scratch("dq32", dq.shape, cp.float32)
        kh, e = k.shape[1], k.shape[2]
        for i, (a, b, causal) in enumerate(key_block_spans(q_offset, q.shape[0], block)):
            dk16 = self._scratch("dk16", (b - a, kh, e), k.dtype)
            dv16 = self._scratch("dv16", (b - a, kh, e), v.dtype)
            K.attention_bwd(self.ctx, q, k[a:b], v[a:b], o, lse, do,
                            q_offset - a if causal else 0, dq, dk16, dv16, deterministic=False,
                            workspace=ws, causal=causal, quiesce=self._quiesce)
            K.add_(self.ctx, dk[a:b], dk16)
            K.add_(self.ctx, dv[a:b], dv16)
            if i == 0:
                K.cast(self.ctx, dq, dq32)
            else:
                K.add_(self.ctx, dq32, dq)
        K.cast(self.ctx, dq32, dq)

    def _deterministic_fits(self, q, k, q_offset: int, ws) -> bool:
        """Deterministic (bit-reproducible) backward when a chunk attends to itself only and
        cuDNN's workspace for it (2*T*T*H + ...) fits the lent region; otherwise the atomic-dQ
        algorithm, whose workspace grows with the context, not with T*S. The planner sizes
        the region the same way (dataflow.memplan.plan.buffers.attention_workspace_bytes)."""
        if k.shape[0] != q.shape[0]:
            return False
        key = (q.shape, k.shape, q_offset)
        fits = self._det_fits.get(key)
        if fits is None:
            need = K.attention_workspace_bytes(self.ctx, "bwd", q.shape[0], q.shape[1],
                                               k.shape[1], q.shape[2], q_offset,
                                               deterministic=True, quiesce=self._quiesce)
            fits = self._det_fits[key] = ws is not None and need <= ws.nbytes
        return fits

    def adamw_step(self, param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
        """grad_scale: a float, or a (1,) fp32 device array read by the kernel (the clip scale
        the schedule computed on the device: no host sync)."""
        dev = grad_scale if isinstance(grad_scale, cp.ndarray) else None
        K.adamw_step(self.ctx, param, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay,
                     grad_scale=1.0 if dev is not None else float(grad_scale),
                     grad_scale_dev=dev)
