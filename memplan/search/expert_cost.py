"""The routed experts' GEMM time of an MoE layer (the cost model's part for them): the per-expert
cuBLASLt loop's small-GEMM rate, its launches and its offsets wait, or the grouped kernels' rate,
and which of the two the CuPy backend runs (expert_path: the executor hands it to the backend, so
the plan is charged what runs). Fitted constants with the records they come from. Pure
arithmetic on a ModelConfig and a HardwareProfile: never plans, never touches a backend."""

from __future__ import annotations

from dataflow.memplan.plan.plan import HardwareProfile
from dataflow.memplan.search.cost import GEMM_REF_TOKENS, gemm_flop_per_s
from dataflow.models.config import ModelConfig

EXPERT_GEMM_HALF_ROWS = 1000
"""A routed expert's GEMMs run at the dense GEMM rate (gemm_flop_per_s at the chunk's tokens)
times rows / (rows + this), rows being the expert's share of the chunk's routed rows (T k / N):
each is a small GEMM (OLMoE: ~2,000 x 1,024 x 2,048) that fills the GPU's SMs less well.
Fitted in the twenty-second session, with EXPERT_GEMM_HOST_S, to two whole steps measured on an
H200 (bench/records/s22-h200-offsets/: olmoe-1b-7b at 120/24 8k, 2,048 rows, the planner's
layout; qwen3-30b-a3b at 180/90 8k, 1,024 rows, 4 rounds): both predicted within 2 %, from 6 %
and 22 % too slow with 1450 and 22 us. The loop alone (bench.moe_experts_bench, queued behind a
spinning kernel) ran at 0.56-0.60 of the dense rate at 2,048 rows and 0.42-0.43 at 1,024 (s21,
s22), i.e. 1,340-1,630 rows; inside the engine the expert ops ran faster than that (olmoe
forward 3.75 ms a layer and chunk, qwen3 3.03 ms: 0.63-0.69 of the dense rate), so the fit is
to the engine, not to the bench. Two models on one GPU: not yet checked on a third."""
EXPERT_GEMM_HOST_S = 12e-6
"""Host time of one expert GEMM launch (kernels/cuda/_cublaslt.py: a dict lookup and a ctypes
call into cublasLtMatmul) once a step's row counts have been seen. Bounded by the engine's own
op times: qwen3-30b-a3b's forward launches 256 calls in the 3.03 ms its op takes on the GPU
(<= 11.8 us a call), its backward 640 in 6.59 ms (<= 10.3 us). The bench measured 17-22 us a
call, 13 us unbatched, with cold call caches and, in s22, beside another process's heavy host
work (bench/records/s21-h200-lt/f, s22-h200-offsets/c). The loop takes the longer of the GPU's
time and this times its calls: a chunk small enough that its GEMMs take less than this is
launch bound."""
EXPERT_CALLS_FWD, EXPERT_CALLS_BWD = 2, 5
"""cuBLASLt calls per expert with rows: forward gate+up (one strided batch of 2) and down;
backward dh, dW_down, dW_gate+dW_up (one batch), and dx's two."""
EXPERT_GROUPED_DENSE_FRACTION = 0.33
"""The grouped expert kernels' rate (kernels/cuda/moe_grouped.py: one launch per GEMM kind over
all of a layer's experts, offsets read on the device, no host wait) as a fraction of the dense
GEMM rate at GEMM_REF_TOKENS: a layer's forward and backward at 0.35 (olmoe-1b-7b, 8k tokens),
0.36 (16k) and 0.30 (qwen3-30b-a3b, 8k) of the same FLOPs as dense GEMMs on an H200
(bench/records/s30-grouped/call1/, bench.moe_experts_bench --grouped --as-engine)."""
EXPERT_GROUPED_TILE = 256
"""D and F must be multiples of this for the grouped kernels (moe_grouped.grouped_supported)."""
EXPERT_SYNC_S = 1.5e-4
"""Each MoE layer and chunk's forward, recompute and backward copy the expert offsets to the
host and wait for them (dataflow/ops_cuda_moe.py): the stream drains, then the GPU idles for the
host's poll (0.1 ms) and first launches. Not measured on its own; a poll and a few launches."""


def _expert_seconds(cfg: ModelConfig, p: HardwareProfile, tokens: int, path: str):
    """(forward, backward) seconds of one layer's routed-expert GEMMs over `tokens` on `path`
    ('loop': the small-GEMM rate or the launches, whichever is slower, plus the offsets' wait;
    'grouped': EXPERT_GROUPED_DENSE_FRACTION of the dense rate, no launches, no wait), and the
    same FLOPs at the dense rate layer_matmul_flops charges."""
    m = cfg.moe
    routed = tokens * m.top_k
    rows = routed / m.n_experts
    active = min(m.n_experts, routed)
    flops = 2.0 * routed * cfg.model_dim * 3 * m.expert_ffn_dim  # one forward pass
    dense = gemm_flop_per_s(cfg, p, tokens)  # what layer_matmul_flops was charged at
    ref = gemm_flop_per_s(cfg, p, GEMM_REF_TOKENS)
    # The rows factor replaces the dense rate's own small-token one (both at the reference
    # size where it was fitted: 8k and 16k tokens are at GEMM_REF_TOKENS' cap).
    slow = ref * rows / (rows + EXPERT_GEMM_HALF_ROWS)
    took = []
    for passes, calls in ((1, EXPERT_CALLS_FWD), (2, EXPERT_CALLS_BWD)):
        if path == "grouped":
            took.append(passes * flops / (ref * EXPERT_GROUPED_DENSE_FRACTION))
        else:
            took.append(max(passes * flops / slow, calls * active * EXPERT_GEMM_HOST_S)
                        + EXPERT_SYNC_S)
    return took[0], took[1], flops / dense


def expert_path(cfg: ModelConfig, p: HardwareProfile, tokens: int) -> str:
    """How the CuPy backend runs an MoE model's expert GEMMs over chunks of `tokens`: 'grouped'
    where the grouped kernels take the shapes (D and F multiples of EXPERT_GROUPED_TILE) and this
    model predicts them faster than the loop (many small experts, where the loop is launch
    bound: qwen3-30b-a3b), else 'loop' (olmoe-1b-7b). 'loop' for a dense model. The executor
    tells the backend (Backend.set_moe_experts) and the cost model charges the same path."""
    m = cfg.moe
    if (m is None or tokens <= 0 or cfg.model_dim % EXPERT_GROUPED_TILE
            or m.expert_ffn_dim % EXPERT_GROUPED_TILE):
        return "loop"
    loop_f, loop_b, _ = _expert_seconds(cfg, p, tokens, "loop")
    grouped_f, grouped_b, _ = _expert_seconds(cfg, p, tokens, "grouped")
    return "grouped" if grouped_f + grouped_b < loop_f + loop_b else "loop"


def expert_extra_seconds(cfg: ModelConfig, p: HardwareProfile, tokens: int,
                         path: str | None = None) -> tuple[float, float]:
    """(forward, backward) seconds the routed experts' GEMMs of one layer over `tokens` take
    beyond their FLOPs at the dense rate (which layer_matmul_flops / gemm_flop_per_s already
    count), on `path` (default expert_path's): the loop's small-GEMM rate (EXPERT_GEMM_HALF_ROWS)
    or its launches (EXPERT_GEMM_HOST_S), whichever is slower, plus the offsets' wait
    (EXPERT_SYNC_S); or the grouped kernels' rate. (0, 0) for a dense model. A recompute below
    FULL re-runs the forward, so it costs the forward's extra again."""
    if cfg.moe is None or tokens <= 0:
        return 0.0, 0.0
    path = path or expert_path(cfg, p, tokens)
    fwd, bwd, dense_s = _expert_seconds(cfg, p, tokens, path)
    return fwd - dense_s, bwd - 2 * dense_s
