"""The mixture-of-experts ops of the CuPy op table (dataflow.ops_cuda.CudaOps inherits them): the
names, signatures and semantics of dataflow.ops_numpy's MoE ops, composed of dataflow.kernels.cuda's
router, grouped-GEMM and expert kernels as tests/kernels/test_cuda_moe.py composes the block.
Scratch comes from the chunk workspace the executor lends
(dataflow.memplan.plan.buffers.MOE_OP_SCRATCH), the experts' row counts reach the host through the
pinned region buffers.MOE_HOST_REGION. Never decides placement and never waits for anything but the
one event below.

The experts' GEMMs run one of two ways, the plan's (memplan.search.expert_cost.expert_path, which
the executor hands to set_moe_experts; DATAFLOW_MOE_EXPERTS=loop|grouped overrides it): the loop
below, or 'grouped' (kernels/cuda/moe_grouped.py), which launches each GEMM kind once over all of a
layer's experts, reading the row offsets in device memory, so no MoE op waits for the host; it needs
D and F multiples of 256 and the stacked weight views the engine lends (any other shape takes the
loop). The grouped kernels run at 0.30-0.36 of the dense GEMM rate against 0.50-0.60 for the loop's
cuBLASLt calls on the GPU, so olmoe-1b-7b keeps the loop (26,335 tok/s grouped against 32,286,
bench/records/s30-grouped/call1/); where the loop is launch bound (many small experts:
qwen3-30b-a3b's 128 at 8k tokens) the planner picks grouped (docs/moe.md).

The host wait (the loop only). The experts' GEMM loop (kernels/cuda/moe_experts.py) launches a
cuBLASLt call per expert and matrix (gate and up as one batch of two) with that expert's row count,
so moe_experts_fwd and moe_experts_bwd store the chunk's offsets ((N + 1) int64) to the host on the
compute stream (a one-block kernel through the region's device mapping, so no copy engine is
involved), record an event after the store and wait for that event alone (with the GIL released: the
backend's polling wait), not for the device. Only the compute stream's work up to the router is
waited for, but the host enqueues nothing meanwhile, so the GPU idles for a poll and a launch after
each wait. The loop's backward copies the offsets again (they come from a saved region or a
recompute, which the op cannot tell apart), so a layer and chunk waits twice; keeping the forward's
host offsets per (layer, chunk) would save the second (docs/moe.md).

Where the kernels' conventions differ from the NumPy table's: the gathers that sum a token's k rows
(the combine, the input gradient) read the inverse permutation, which each op forms from `order` in
the lent `moe_inv` (one small launch); the combine's fp32 sum goes to a lent fp32 (T, D) and is then
added onto the residual with one rounding (ops_numpy.moe_combine); the router's weight gradient is
formed in fp32 and then added into the gradient of either dtype (add_: one rounding, as ops_numpy's
_store)."""

from __future__ import annotations

import cupy as cp
import numpy as np

import dataflow.kernels.cuda as K
from dataflow.kernels.cuda import moe_grouped as KG

F32, I64 = np.dtype(np.float32), np.dtype(np.int64)
MOE_BOUND = {"moe_permute": "permute_fwd", "moe_combine_bwd": "unpermute_bwd"}
"""Ops that are a kernel with the table's CudaContext bound first (CudaOps binds them):
moe_permute (x, order, top_k, xp): xp = x[order // top_k], an exact gather; moe_combine_bwd
(dy, yp, order, topk_weight, dyp, d_topk_weight), as ops_numpy.moe_combine_bwd."""


class MoeOps:
    """Mixin of dataflow.ops_cuda.CudaOps: uses its `ctx` (the kernels' CudaContext),
    `_scratch(name, shape, dtype)` (a lent arena view, or its own buffer when none was lent),
    `_lent` and `_wait(event)`."""

    _offsets_event = None
    """The event recorded after each offsets copy (one, reused: every wait follows its record)."""
    _moe_experts = "loop"
    """How the experts' GEMMs run: the plan's path (set_moe_experts), or the one
    DATAFLOW_MOE_EXPERTS forces (settings.Settings.moe_experts; CudaOps reads it when made)."""
    _moe_forced = "auto"
    _offsets_own: np.ndarray | None = None
    """Pinned host offsets when no arena region was lent (CudaOps used on its own, in tests)."""

    def moe_route(self, x, w_router, top_k, norm_topk_prob, logits, probs, topk_idx, topk_weight,
                  order, offsets):
        """As ops_numpy.moe_route: the router's GEMM into fp32 logits, softmax and top-k (ties:
        lower expert first), then the stable counting sort by expert (order, offsets; int64)."""
        K.router_fwd(self.ctx, x, w_router, top_k, logits, probs, topk_idx, topk_weight,
                     norm_topk_prob=bool(norm_topk_prob))
        K.expert_order(self.ctx, topk_idx, w_router.shape[0], order, offsets)

    def moe_route_stats(self, logits, probs, topk_idx, counts, sums):
        """As ops_numpy.moe_route_stats: counts (N,) int64 and sums[:N] += the chunk's pairs per
        expert and softmax mass per expert; sums[N] += sum of logsumexp^2 (an fp64 sum rounded
        to fp32, then added)."""
        n, t = counts.shape[0], logits.shape[0]
        K.load_balancing_stats(self.ctx, probs, topk_idx, counts, sums[:n], accumulate=True)
        K.router_z_loss(self.ctx, logits, 1, self._scratch("moe_lse", (t + 1,), F32)[:t], sums[n:],
                        accumulate=True)

    def moe_round_losses(self, counts, sums, n_rows, out):
        """As ops_numpy.moe_round_losses: out (2,) fp32 = (load-balancing loss, z-loss) of the
        round's totals over n_rows rows; on the device, read with the step's losses."""
        n = counts.shape[0]
        K.load_balancing_loss(self.ctx, counts, sums[:n], n_rows, out[0:1])
        cp.divide(sums[n:], float(n_rows), out=out[1:2])  # fp32 division: correctly rounded

    @staticmethod
    def moe_totals_add(counts, sums, partial_counts, partial_sums):
        """As ops_numpy.moe_totals_add: a ring rank's routing totals += the previous ranks'
        (CuPy's in-place add: int64 exact, fp32 one rounding; nothing allocated)."""
        cp.add(counts, partial_counts, out=counts)
        cp.add(sums, partial_sums, out=sums)

    def moe_experts_fwd(self, xp, offsets, w_gate, w_up, w_down, gate, up, act, yp):
        """As ops_numpy.moe_experts_fwd (act = silu(gate) * up): the grouped kernels on the
        device offsets where they take the shapes (_grouped), else wait for the offsets' copy to
        the host (module docstring), then the per-expert GEMM loop."""
        if self._grouped(xp, gate, w_gate, w_up, w_down):
            KG.grouped_experts_fwd(self.ctx, xp, offsets, w_gate, w_up, w_down, yp, gate, up,
                                   h=act)
            return
        K.experts_fwd(self.ctx, xp, self._offsets_on_host(offsets), w_gate, w_up, w_down, yp, gate,
                      up, h=act)

    def moe_combine(self, yp, order, topk_weight, out):
        """As ops_numpy.moe_combine: out (T, D) += the k weighted rows of each token, summed in
        fp32 in slot order into the lent fp32 (T, D), then added onto out and rounded once."""
        y32 = self._scratch("moe_tokens_f32", out.shape, F32)
        K.unpermute_fwd(self.ctx, yp, self._inverse(order), topk_weight, y32)
        K.add_(self.ctx, out, y32)

    def moe_experts_bwd(self, xp, offsets, w_gate, w_up, w_down, gate, up, dyp, dxp, dw_gate,
                        dw_up, dw_down):
        """As ops_numpy.moe_experts_bwd: dxp written, the stacked weight gradients += (an idle
        expert's untouched: the reference adds exact zeros); waits for the offsets' copy. Scratch:
        the lent SwiGLU gradients, the activation re-formed into expert_act, and the fp32 input
        gradient sums of consecutive experts (T rows at a time) in moe_tokens_f32."""
        r, f = gate.shape
        if self._grouped(xp, gate, w_gate, w_up, w_down, dw_gate, dw_up, dw_down):
            KG.grouped_experts_bwd(self.ctx, xp, offsets, w_gate, w_up, w_down, gate, up, dyp, dxp,
                                   dw_gate, dw_up, dw_down,
                                   dgate=self._scratch("expert_dgate", (r, f), xp.dtype),
                                   dup=self._scratch("expert_dup", (r, f), xp.dtype),
                                   h=self._scratch("expert_act", (r, f), xp.dtype))
            return
        host = self._offsets_on_host(offsets)
        # All of the lent (T, D) fp32, not only the largest expert's rows: experts_bwd rounds the
        # input gradient of as many experts at a time as it holds (fewer cast launches).
        lent = self._lent.get("moe_tokens_f32")
        acc = self._scratch("moe_tokens_f32", (max(K.experts_bwd_acc_elems(host, xp.shape[1]),
                                                   0 if lent is None else lent.size),), F32)
        K.experts_bwd(self.ctx, xp, host, w_gate, w_up, w_down, gate, up, dyp, dxp, dw_gate, dw_up,
                      dw_down,
                      dgate=self._scratch("expert_dgate", (r, f), xp.dtype),
                      dup=self._scratch("expert_dup", (r, f), xp.dtype),
                      h=self._scratch("expert_act", (r, f), xp.dtype), dx_acc=acc)

    def moe_router_bwd(self, x, w_router, logits, probs, topk_idx, d_topk_weight, norm_topk_prob,
                       counts, aux_coef, z_coef, n_rows, dxp, order, dx, dw_router):
        """As ops_numpy.moe_router_bwd: d_logits (lent, fp32) from the k selected weights, plus
        the load-balancing and z-loss terms (each only when its coefficient is not 0); the
        router's input gradient in fp32 (lent (T, D)) and weight gradient in fp32 (lent), the
        latter added into dw_router; dx = the router's input gradient + each token's k permuted
        rows, summed in fp32, rounded once."""
        t, n = probs.shape
        d = x.shape[1]
        d_logits = self._scratch("moe_dlogits", (t, n), F32)
        K.router_logits_bwd(self.ctx, probs, topk_idx, d_topk_weight, d_logits,
                            norm_topk_prob=bool(norm_topk_prob))
        if aux_coef:
            K.load_balancing_loss_bwd(self.ctx, probs, counts, n_rows, aux_coef, d_logits,
                                      accumulate=True)
        if z_coef:
            lse = self._scratch("moe_lse", (t + 1,), F32)  # logsumexp per token, a spare sum
            K.router_z_loss(self.ctx, logits, 1, lse[:t], lse[t:])
            K.router_z_loss_bwd(self.ctx, logits, lse[:t], n_rows, z_coef, d_logits,
                                accumulate=True)
        work = self._scratch("moe_router_f32", (n * d + K.router_bwd_scratch_elems(t, d, n),), F32)
        dw32 = work[:n * d].reshape(n, d)
        dx32 = self._scratch("moe_tokens_f32", (t, d), F32)
        K.router_bwd(self.ctx, x, w_router, d_logits, dx32, dw32, accumulate_dw=False,
                     scratch=work[n * d:])
        K.add_(self.ctx, dw_router, dw32)
        K.permute_bwd(self.ctx, dxp, self._inverse(order), topk_idx.shape[1], dx, residual=dx32)

    def set_moe_experts(self, path: str) -> None:
        """The expert GEMMs on `path` ('loop' or 'grouped': the plan's,
        memplan.search.expert_cost.expert_path) unless DATAFLOW_MOE_EXPERTS forced one."""
        if path not in ("loop", "grouped"):
            raise ValueError(f"expert path {path!r}: 'loop' or 'grouped'")
        if self._moe_forced == "auto":
            self._moe_experts = path

    def _grouped(self, xp, gate, *mats) -> bool:
        """True when the grouped kernels run these experts: the path is 'grouped' (the plan's,
        or DATAFLOW_MOE_EXPERTS) and moe_grouped.grouped_supported takes the shapes and the
        stacked weights (and gradients, all of one dtype)."""
        if self._moe_experts != "grouped":
            return False
        grads = mats[3:]
        if grads and len({g.dtype for g in grads}) != 1:
            return False
        return KG.grouped_supported(xp.shape[1], gate.shape[1], xp.dtype, *mats)

    def _inverse(self, order):
        """inv (R,) int64 with inv[order[r]] = r, in the lent moe_inv."""
        inv = self._scratch("moe_inv", order.shape, I64)
        K.inverse_order(self.ctx, order, inv)
        return inv

    def _offsets_on_host(self, offsets) -> np.ndarray:
        """offsets (N + 1,) int64 stored on the current (compute) stream into pinned host memory
        (the lent region, buffers.MOE_HOST_REGION), then waited for: the one host wait of the
        MoE block. The store is a small kernel writing through the device's mapping of the
        region where it has one (no copy engine, so it never queues behind the engine's
        transfers), else a D2H copy. The host array is read (experts_fwd / experts_bwd turn it
        into Python ints) before the next store into it is enqueued."""
        host = self._lent.get("moe_offsets_host")
        if host is None or host.shape != offsets.shape:
            if self._offsets_own is None or self._offsets_own.shape != offsets.shape:
                import cupyx

                self._offsets_own = cupyx.empty_pinned(offsets.shape, I64)
            host = self._offsets_own
        if self._offsets_event is None:
            self._offsets_event = cp.cuda.Event(block=False, disable_timing=True)
        # Queried each time (a few us): the lent region moves with the arena an Engine lends.
        K.offsets_to_host(self.ctx, offsets, host, self._offsets_event,
                          mapped=K.mapped_address(host))
        self._wait(self._offsets_event)
        return host
