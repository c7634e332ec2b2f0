"""The cost model: compute seconds from FLOPs, copy seconds from bytes, their overlap per layer
window, the optimizer, and the predicted step (dataflow.memplan.plan.plan.Prediction). Every constant is named
here and explained in docs/planner.md. Pure arithmetic: never imports array libraries, never reads
the clock, never touches a device.

A round is the window sequence F0..F(L-1), head, B(L-1)..B0. Copies run in need order on one
host->device and one device->host stream (sim.py); a copy waits for its stream and for a free
slot; a window waits for what it needs. Exposed copy time is the time compute waits."""

from __future__ import annotations

import dataclasses
import functools
import math

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.chunking import head_sub_tokens
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.memory import grad_bpe, state_elems
from dataflow.memplan.plan.lora import (
    KEPT_TARGETS as KEPT,
    RECOMPUTED_TARGETS as RECOMPUTED,
    adapter_fwd_flops_per_token,
    adapter_model_flops_per_seq,
    adapter_rebuild_flops_per_token,
    base_dequant_seconds,
    lora_seconds,
    rebuild_seconds,
)
from dataflow.memplan.plan.plan import (
    AttentionBwd,
    Chunking,
    HardwareProfile,
    OptimizerWhere,
    Precision,
    Prediction,
    Where,
)
from dataflow.memplan.plan.segments import kv_rebuilt, segment_bounds
from dataflow.memplan.search.round_sim import RoundResult, Workload, simulate_round
from dataflow.models.config import ModelConfig
from dataflow.models.flops import (
    SavedLevel,
    attn_bwd_flops,
    attn_fwd_flops,
    flash_recompute_flops,
    frozen_flops_per_seq,
    head_flops,
    layer_matmul_flops,
    level_recompute_flops,
    model_flops_per_seq,
)

LAUNCH_OVERHEAD_FRAC = 0.03
"""Kernel launch gaps and small ops, as a fraction of the GEMM and elementwise time. Not of
the fused attention's: one call is milliseconds to seconds long, and the model's attention
time alone matched the measured one within 1.5 % at 65k, 131k and 262k (fourteenth session,
bench/records/README.md), where charging it the overhead made those steps 1-2 s too slow."""
ELEMENTWISE_FWD_WIDTHS = (12, 2, 2, 3)
"""Memory-bound forward work per token and layer, in bf16 values moved through HBM, as
multiples of (D, H*E, K*E, F): two RMSNorms, RoPE on Q and K, SwiGLU, two residual adds."""
MOE_ELEMENTWISE_FWD_WIDTHS = (3, 3, 4)
"""An MoE layer's memory-bound FFN work per token instead of the dense SwiGLU's 3 F, as multiples
of (k F_e, k D, N): SwiGLU over its k routed rows; the permutation's gather written and the
combine's k rows read (plus the residual); the router's fp32 logits and softmax (4 bf16-sized
values per expert). Not measured yet (no CUDA MoE ops): a count, like the dense widths."""
ELEMENTWISE_BWD_FACTOR = 2.0
"""The backward moves about twice the forward's elementwise bytes; a recompute, once."""
CROSS_ENTROPY_PASSES = 4
"""fp32 logits are written, read for max/sum-exp, the gradient written, and read by the GEMM."""
GEMM_REF_TOKENS, GEMM_HALF_TOKENS = 8192, 512
"""GEMM efficiency scales as t / (t + HALF), normalised to the profile's value at REF tokens."""
GEMM_REF_DIM, GEMM_HALF_DIM = 4096, 256
"""... and likewise with the model width (narrow models run small, inefficient GEMMs)."""
ATTN_REF_TOKENS, ATTN_HALF_TOKENS, ATTN_LONG_CONTEXT_CAP = 8192, 1024, 1.2
"""Attention efficiency scales with the keys a query chunk sees (its sequence so far), up to
20% above the profile's value (measured causal at 8k, where masked diagonal blocks and tails
cost most) when a chunk attends to a long unmasked context. A guess to be measured ..."""
ATTN_REF_HEAD_DIM, ATTN_HALF_HEAD_DIM = 128, 32
"""... and with the head dim (the profile's value is for head_dim 128)."""
ATTN_ATOMIC_BWD_SPEEDUP = 520 / 444
"""The profile's attn_bwd_efficiency is cuDNN's deterministic backward of a packed chunk (what
dataflow-probe measures). Its atomic-dQ backward, which split sequences always use and packed
chunks use under Plan.attention_bwd = fast, ran at 518-520 TFLOP/s against 444 at 8k on the
H100 (bench/records/kernels-nvidia-h100-80gb-hbm3.json)."""
ADAMW_STATE_BYTES_PER_ELEM = 12
"""AdamW reads and writes bf16 param, m and v (2 B each, both ways); plus the grad read."""
HOST_SUMSQ_BYTES_PER_S = 9.5e9
"""The host's squared norm of a HOME embedding gradient (kernels.host.norms over 16 cores) on the
lent H100's host: 8b's bf16 gradient (the default accumulation), 1.05 GB, in 111 ms (traced,
bench/records/s40/call3/). It ends the last round on the critical path (the clip scale waits
for it); charged before as two round-row copies at the host AdamW rate (32 ms). Measured with the
kernel's unpack-then-square loop; its bf16 square table since ran 11x that on this machine's
two cores (0.56 -> 6.4 GB/s) and is not measured on the GPU machine's host yet, so this rate
may charge that wait up to ~100 ms too much a step."""
HOST_FILL_BYTES_PER_S = 57e9
"""Zeroing a HOME gradient on the host (a memset of pinned memory): 8b's bf16 embedding gradient,
1.05 GB, in 18.3 ms on the lent H100's host (bench/records/s40/call3/); charged before at the
host AdamW rate, 250 ms."""
HOST_SCATTER_BYTES_PER_S = 24e9
"""The embedding gradient's scatter-add on the host (kernels.host.embedding), as the rows' bf16
bytes read + written: 8b's 8,192 rows in 5.5 ms on the lent H100's host
(bench/records/s40/call3/); charged before at the host AdamW rate, 32 ms."""
DEFAULT_OPT_TARGET_FRAC = 0.02
"""Rounds per step: the fewest that keep the optimizer under this share of the step."""
BOTTLENECK_FRAC = 0.05
"""A non-compute part of the step is named the bottleneck when it takes at least this share."""
MAX_ROUNDS_PER_STEP = getattr(buffers, "MAX_ROUNDS_PER_STEP", 512)


def _scale(x: float, ref: float, half: float, cap: float = 1.0) -> float:
    return min(cap, (x / (x + half)) / (ref / (ref + half)))


def gemm_flop_per_s(cfg: ModelConfig, p: HardwareProfile, tokens: int) -> float:
    return (p.peak_bf16_flop_per_s * p.gemm_efficiency
            * _scale(tokens, GEMM_REF_TOKENS, GEMM_HALF_TOKENS)
            * _scale(cfg.model_dim, GEMM_REF_DIM, GEMM_HALF_DIM))


FP8_QUANT_BYTES_PER_ELEM = 5
"""HBM bytes per element of one FP8 operand copy (kernels/cuda/fp8.py on a bf16 input): the amax
pass reads 2, the cast reads 2 and writes 1."""

FP8_RECAST_BYTES_PER_ELEM = 3
"""HBM bytes per element of a tensor's second layout when its scale is still in the region (the
cast alone: dataflow.ops_cuda_fp8)."""

_FP8_DY_RECAST = frozenset({"q", "o", "gate", "up", "down"})
"""Projections whose output gradient the backward quantises once and only casts again for its
other GEMM (dx and dw next to each other: layer_ops' order); k's and v's are quantised twice."""


def fp8_gemm_flop_per_s(cfg: ModelConfig, p: HardwareProfile, tokens: int) -> float:
    """The FP8 GEMM rate: the profile's measured one, scaled by size as the bf16 rate is; the
    bf16 rate where none is measured."""
    if p.fp8_gemm_flop_per_s is None:
        return gemm_flop_per_s(cfg, p, tokens)
    return gemm_flop_per_s(cfg, p, tokens) * p.fp8_gemm_flop_per_s / (
        p.peak_bf16_flop_per_s * p.gemm_efficiency)


FP8_OP_FIXED_S = 30e-6
"""Seconds an FP8 linear op takes beyond its GEMM and quantise bytes: its quantise kernels'
launches and the one-block amax finish (five kernels where bf16 has one). Fitted to 1b at 8k in
40/16 on an H200 (bench/records/s26-fp8/: 10.82 s measured against 10.08 s a step without it,
over 23,520 FP8 ops); it moves 8b at 8k by 3 % and at 64k by under 1 %."""


def _fp8_inputs(cfg: ModelConfig) -> int:
    """Features of the distinct inputs an FP8 layer quantises once each (dataflow.ops_cuda_fp8
    reuses an operand already in its region: q, k and v read one x, as gate and up do)."""
    seen: dict[str, int] = {}
    for name, _, i in buffers.fp8_projections(cfg):
        seen.setdefault({"k": "q", "v": "q", "up": "gate"}.get(name, name), i)
    return sum(seen.values())


def fp8_extra_seconds(cfg: ModelConfig, p: HardwareProfile, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds an FP8 plan's layer over `tokens` takes beyond the bf16 one:
    the FP8 projections' (buffers.fp8_projections) GEMMs at the FP8 rate instead of the bf16
    rate, plus their quantise passes as the linear ops run them (forward x once per distinct
    input and every w; backward w^T for dx, dy in both layouts (quantised once and cast again
    where _FP8_DY_RECAST says, twice for k and v), x^T once per distinct input but twice for
    gate and up, whose dw ops are no longer next to each other) and FP8_OP_FIXED_S an op.
    Negative when FP8 is faster."""
    t, gemm, fp8 = tokens, gemm_flop_per_s(cfg, p, tokens), fp8_gemm_flop_per_s(cfg, p, tokens)
    hbm = p.device_mem_bytes_per_s
    proj = buffers.fp8_projections(cfg)
    flops = sum(2.0 * t * o * i for _, o, i in proj)
    weights, inputs = sum(o * i for _, o, i in proj), t * _fp8_inputs(cfg)
    quant, recast = FP8_QUANT_BYTES_PER_ELEM, FP8_RECAST_BYTES_PER_ELEM
    dy_bytes = sum(t * o * (quant + (recast if name in _FP8_DY_RECAST else quant))
                   for name, o, _ in proj)
    xt_again = sum(t * i for name, _, i in proj if name == "up")  # xn2^T for up's dw again
    fwd_s = (weights + inputs) * quant / hbm
    bwd_s = (dy_bytes + (weights + inputs + xt_again) * quant) / hbm
    return (flops / fp8 - flops / gemm + fwd_s + len(proj) * FP8_OP_FIXED_S,
            2 * flops / fp8 - 2 * flops / gemm + bwd_s + 2 * len(proj) * FP8_OP_FIXED_S)


def attn_flop_per_s(cfg: ModelConfig, p: HardwareProfile, efficiency: float, keys: int) -> float:
    return (p.peak_bf16_flop_per_s * efficiency
            * _scale(keys, ATTN_REF_TOKENS, ATTN_HALF_TOKENS, ATTN_LONG_CONTEXT_CAP)
            * _scale(cfg.head_dim, ATTN_REF_HEAD_DIM, ATTN_HALF_HEAD_DIM))


def elementwise_fwd_bytes(cfg: ModelConfig, tokens: int) -> int:
    """HBM bytes of one layer's memory-bound forward ops over `tokens` tokens; with
    attention_bias the biased projections' outputs are written once more (the bias fill) and
    read by the GEMM that accumulates onto them; with qk_norm, q and k are read before the
    norm and written after it; with moe, MOE_ELEMENTWISE_FWD_WIDTHS replace the SwiGLU's."""
    widths = (cfg.model_dim, cfg.q_dim, cfg.kv_dim, cfg.ffn_dim)
    values = sum(m * w for m, w in zip(ELEMENTWISE_FWD_WIDTHS, widths))
    if cfg.moe is not None:  # no dense FFN: its routed rows, permutation and router instead
        m = cfg.moe
        moe_widths = (m.top_k * m.expert_ffn_dim, m.top_k * cfg.model_dim, m.n_experts)
        values += sum(a * w for a, w in zip(MOE_ELEMENTWISE_FWD_WIDTHS, moe_widths)) \
            - ELEMENTWISE_FWD_WIDTHS[3] * cfg.ffn_dim
    values += 2 * (cfg.q_dim + 2 * cfg.kv_dim) * cfg.attention_bias
    values += 2 * (cfg.q_dim + cfg.kv_dim) * cfg.qk_norm
    return 2 * tokens * values


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkCosts:
    """Seconds and FLOPs of one layer over one chunk of a round (all sequences it packs)."""

    fwd_s: float
    bwd_s: float
    """Backward including the fused-attention score recompute."""
    rec_s: tuple[float, float, float]
    """Extra seconds by level: (FULL, INP_ATTN, INP_ONLY)."""
    rec_flops: tuple[float, float, float]
    """Extra hardware FLOPs by level; with LoRA the adapters' re-runs and the x a^T re-formed
    for db where neither the saved activation (FULL keeps them) nor the backward's own
    recompute formed it (adapter_rebuild_flops_per_token: K, V and down below FULL)."""
    flash_flops: float
    fwd_flops: float = 0.0
    """Forward FLOPs (GEMMs, adapters, attention): what a segment recompute repeats per layer."""
    refwd_kept_s: float = 0.0
    refwd_kept_flops: float = 0.0
    """A segment boundary's re-run from the attention output it kept (KEEPS_ATTN_OUT): the
    O projection and the FFN (and K/V of a split sequence), no Q projection or attention."""
    bwd_frozen_s: float = 0.0
    """The backward of a frozen layer (Plan.frozen): bwd_s without the weight-gradient GEMMs
    (dx only) and without their FP8 share."""


KEEPS_ATTN_OUT = (SavedLevel.INP_ATTN, SavedLevel.FULL)
"""Levels whose saved activation holds the attention output, so a segment's re-run of that
boundary skips the attention (dataflow.layer_ops.LayerCompute.forward's attn_out)."""


LEVEL_INDEX = {SavedLevel.FULL: 0, SavedLevel.INP_ATTN: 1, SavedLevel.INP_ONLY: 2}


def head_seconds(cfg: ModelConfig, chunk_tokens: int, sub_tokens: int, grad_bytes: int,
                 p: HardwareProfile, frozen: bool = False) -> float:
    """The head of one chunk: its three GEMMs, the cross-entropy passes over fp32 logits, and
    the weight gradient's accumulation, which reads and writes the whole (V, D) gradient (V the
    head's rows: a vocabulary-parallel ring rank's shard) once per sub-chunk (at 8b, 2 GiB of
    bf16 a time: a 2048-token sub-chunk halves it). The GEMM term alone matched the head
    measured with the default sub-chunk (8b at 8k: 44.9 ms predicted, 43.5 measured), so
    accumulations are counted beyond or short of that one's. A frozen head (Plan.frozen) runs
    no weight-gradient GEMM and accumulates nothing."""
    t = chunk_tokens
    hbm = p.device_mem_bytes_per_s
    ce_bytes = t * cfg.head_rows * 4 * CROSS_ENTROPY_PASSES
    extra = t // sub_tokens - t // head_sub_tokens(t)
    acc_bytes = extra * cfg.head_rows * cfg.model_dim * grad_bytes * 2
    flops = head_flops(cfg, t)
    if frozen:
        flops, acc_bytes = flops * 2 // 3, 0
    return (flops / gemm_flop_per_s(cfg, p, t) + (ce_bytes + acc_bytes) / hbm) \
        * (1.0 + LAUNCH_OVERHEAD_FRAC)


@functools.lru_cache(maxsize=256)
def chunk_costs(cfg: ModelConfig, ch: Chunking, p: HardwareProfile,
                deterministic: bool = True,
                precision: Precision = Precision.BF16, lora=None) -> tuple[ChunkCosts, ...]:
    """Per chunk of a round (chunks differ by their context offset when a sequence is split).
    deterministic: packed chunks take cuDNN's deterministic attention backward (else, as split
    sequences always do, the atomic-dQ one: ATTN_ATOMIC_BWD_SPEEDUP). precision FP8: the
    projections as fp8_extra_seconds says. lora (Plan.lora): each layer's adapters as
    lora_seconds says, on the forward, every recompute and the backward."""
    t = ch.chunk_tokens
    piece = t // ch.seqs_per_chunk  # one sequence's tokens in this chunk
    over = 1.0 + LAUNCH_OVERHEAD_FRAC
    gemm = gemm_flop_per_s(cfg, p, t)
    hbm = p.device_mem_bytes_per_s
    ew_s = elementwise_fwd_bytes(cfg, t) / hbm
    mm = layer_matmul_flops(cfg, t)
    # O-proj and FFN; K and V too for a split sequence (its later chunks attend to them)
    mm_kept = mm - 2 * t * cfg.model_dim * (cfg.q_dim + 2 * cfg.kv_dim * (ch.chunks_per_seq == 1))
    rec_attn = level_recompute_flops(cfg, SavedLevel.INP_ATTN, t)
    rec_full = level_recompute_flops(cfg, SavedLevel.FULL, t)  # 0 unless QK-norm re-projects
    # Not at the top: expert_cost reads this module's GEMM rate (an import circle otherwise).
    from dataflow.memplan.search.expert_cost import expert_extra_seconds

    exp_fwd_s, exp_bwd_s = expert_extra_seconds(cfg, p, t)
    f8_fwd_s, f8_bwd_s = fp8_extra_seconds(cfg, p, t) if precision is Precision.FP8 else (0, 0)
    lo_fwd_s, lo_bwd_s = lora_seconds(cfg, t, lora, gemm, hbm, over)
    # an fp8 base decodes each base weight before its GEMM: the forward's seven, the
    # backward's seven (dx), a recompute's and a kept re-run's projections again
    dq_all, dq_rec, dq_kept = (base_dequant_seconds(cfg, lora, hbm, ts) * over for ts in (
        None, RECOMPUTED, KEPT[ch.chunks_per_seq == 1]))
    lo_f, lo_rec = (t * adapter_fwd_flops_per_token(cfg, lora, ts) for ts in (None, RECOMPUTED))
    lo_kept = t * adapter_fwd_flops_per_token(cfg, lora, KEPT[ch.chunks_per_seq == 1])
    # db's s (x a^T) where the backward's own recompute did not form it (none at FULL)
    rb_full, rb_below = (t * adapter_rebuild_flops_per_token(cfg, lora, f) for f in (True, False))
    rb_full_s, rb_below_s = (rebuild_seconds(cfg, t, lora, f, gemm, hbm, over)
                             for f in (True, False))
    out = []
    for c in range(ch.chunks_per_round):
        ctx = ch.chunk_context(c)
        n = ch.seqs_per_chunk
        keys = piece + ctx
        a_fwd = n * attn_fwd_flops(cfg, piece, ctx)
        flash = n * flash_recompute_flops(cfg, piece, ctx)
        a_bwd = n * attn_bwd_flops(cfg, piece, ctx) + flash
        a_fwd_s = a_fwd / attn_flop_per_s(cfg, p, p.attn_fwd_efficiency, keys)
        bwd_eff = p.attn_bwd_efficiency
        if ch.chunks_per_seq > 1 or not deterministic:
            bwd_eff *= ATTN_ATOMIC_BWD_SPEEDUP
        a_bwd_s = a_bwd / attn_flop_per_s(cfg, p, bwd_eff, keys)
        fwd_s = (mm / gemm + ew_s + f8_fwd_s) * over + a_fwd_s + exp_fwd_s + lo_fwd_s + dq_all
        bwd_s = (2 * mm / gemm + ELEMENTWISE_BWD_FACTOR * ew_s + f8_bwd_s) * over + a_bwd_s \
            + exp_bwd_s
        bwd_frozen_s = (mm / gemm + ELEMENTWISE_BWD_FACTOR * ew_s + f8_bwd_s / 2) * over \
            + a_bwd_s + exp_bwd_s + lo_bwd_s + dq_all
        # A recompute re-runs its projections in FP8 too: the forward's difference in their share.
        rec_a = (rec_attn / gemm + ew_s + f8_fwd_s * rec_attn / mm) * over + exp_fwd_s \
            + lo_fwd_s + dq_rec + rb_below_s
        rec_f = rec_full / gemm * over + rb_full_s
        out.append(ChunkCosts(fwd_s=fwd_s, bwd_s=bwd_s, rec_s=(rec_f, rec_a, rec_a + a_fwd_s),
                              rec_flops=(rec_full + rb_full, rec_attn + lo_rec + rb_below,
                                         rec_attn + lo_rec + rb_below + a_fwd),
                              flash_flops=flash, fwd_flops=mm + a_fwd + lo_f,
                              refwd_kept_s=(mm_kept / gemm + ew_s + f8_fwd_s * mm_kept / mm)
                              * over + exp_fwd_s + lo_fwd_s + dq_kept,
                              refwd_kept_flops=mm_kept + lo_kept, bwd_frozen_s=bwd_frozen_s))
    return tuple(out)


def kv_rebuild_cost(cfg: ModelConfig, tokens: int, p: HardwareProfile) -> tuple[float, float]:
    """(seconds, FLOPs) of re-forming one chunk's K/V from its saved input (Plan.kv_rebuild):
    RMSNorm of x, the K and V projections, RoPE on K. Hardware FLOPs: HFU counts them."""
    flops = 2.0 * tokens * cfg.model_dim * 2 * cfg.kv_dim
    moved = tokens * (cfg.model_dim * 2 * 2 + cfg.kv_dim * 2 * 4)  # x in, xn out; K, V; RoPE
    gemm = gemm_flop_per_s(cfg, p, tokens)
    return (flops / gemm + moved / p.device_mem_bytes_per_s) * (1.0 + LAUNCH_OVERHEAD_FRAC), flops


def segment_recompute(costs: tuple[ChunkCosts, ...], n_layers: int, k: int,
                      boundary_level=None) -> tuple[list[float], float]:
    """Layer-segment recompute (memplan/plan/segments.py): (seconds added to each layer's backward
    window, FLOPs per round). A segment of m >= 2 layers re-runs all m layers' forward over
    every chunk before the backward of its top layer; hardware FLOPs, so HFU counts them and
    MFU does not. `boundary_level(layer, chunk)`: the level a boundary kept; where it keeps
    the attention output, the boundary's re-run is refwd_kept_s. Without it, every re-run is
    a whole forward (dataflow.memplan.search.space takes the boundaries' share off per level)."""
    per_layer_s = [0.0] * n_layers
    fwd_s, fwd_flops = sum(c.fwd_s for c in costs), sum(c.fwd_flops for c in costs)
    flops = 0.0
    for first, end in segment_bounds(n_layers, k):
        if end - first >= 2:
            per_layer_s[end - 1] = (end - first) * fwd_s
            flops += (end - first) * fwd_flops
            if boundary_level is not None:
                for c, cc in enumerate(costs):
                    if boundary_level(first, c) in KEEPS_ATTN_OUT:
                        per_layer_s[end - 1] -= cc.fwd_s - cc.refwd_kept_s
                        flops -= cc.fwd_flops - cc.refwd_kept_flops
    return per_layer_s, flops


def workload_of(plan, p: HardwareProfile) -> Workload:
    """The per-round work of a Plan or Decisions, in the form the simulation reads."""
    d = decisions_of(plan)
    cfg, ch = d.model, d.chunking
    costs = chunk_costs(cfg, ch, p, d.attention_bwd is AttentionBwd.DETERMINISTIC, d.precision,
                        d.lora)
    elems = buffers.block_elems(cfg, d.lora)
    gbpe = grad_bpe(d.grad_accum)
    act_size = {(lv, kv): buffers.saved_activation_bytes(cfg, ch.chunk_tokens, lv, kv, d.lora)
                for lv in SavedLevel for kv in (True, False) if kv or lv is not SavedLevel.FULL}
    fwd_s = sum(c.fwd_s for c in costs)
    bwd_by_frozen = (sum(c.bwd_s for c in costs), sum(c.bwd_frozen_s for c in costs))
    bwd_s, act_count, act_bytes = [], [], []
    rec_s = rec_flops = 0.0
    seg_s, seg_flops = segment_recompute(costs, cfg.n_layers, d.segment_layers,
                                         lambda layer, c: d.activations[layer][c].level)
    rec_flops += seg_flops
    rebuilt = kv_rebuilt(d)
    kv_s, kv_flops = kv_rebuild_cost(cfg, ch.chunk_tokens, p)
    for layer, row in enumerate(d.activations):
        n_kv = sum((layer, c) in rebuilt for c in range(len(row)))
        r = sum(costs[c].rec_s[LEVEL_INDEX[a.level]] for c, a in enumerate(row)) + seg_s[layer] \
            + n_kv * kv_s
        rec_flops += sum(costs[c].rec_flops[LEVEL_INDEX[a.level]] for c, a in enumerate(row)) \
            + n_kv * kv_flops
        bwd_s.append(bwd_by_frozen[d.frozen.layer(layer)] + r)
        rec_s += r
        # a re-formed chunk at home crosses H2D twice: its activation, and x for the re-forming
        home = [act_size[(a.level, (layer, c) not in rebuilt)]
                + ((layer, c) in rebuilt) * ch.chunk_tokens * cfg.model_dim * 2
                for c, a in enumerate(row) if a.home is Where.HOME]
        act_count.append(len(home))
        act_bytes.append(sum(home))
    return make_workload(d, p, fwd_s=fwd_s, bwd_s=bwd_s, act_count=act_count,
                         act_bytes=act_bytes, rec_s=rec_s, rec_flops=rec_flops, costs=costs,
                         elems=elems, gbpe=gbpe)


def make_workload(d, p, *, fwd_s, bwd_s, act_count, act_bytes, rec_s, rec_flops, costs, elems,
                  gbpe) -> Workload:
    """Assemble a Workload; `d` needs model, chunking, slots, layers, embed, head, frozen (a
    frozen block has no gradient traffic and no optimizer work) and state_parts (a split
    update's replica runs AdamW on its part of the layers and the head, unless
    whole_update_cost)."""
    cfg, ch, L, fz = d.model, d.chunking, d.model.n_layers, d.frozen
    emb, head = d.holds_embed, d.holds_head  # a ring rank runs only the blocks it owns
    head_s = ch.chunks_per_round * head_seconds(cfg, ch.chunk_tokens, d.slots.head_sub_tokens,
                                                gbpe, p, fz.head) if head else 0.0
    rows = ch.tokens_per_round * cfg.model_dim * 2
    opt = {OptimizerWhere.DEVICE: 0, OptimizerWhere.STREAMED: 0, OptimizerWhere.HOST: 0}
    # a split update's replica (Decisions.state_parts R) updates its part of every layer and
    # of the head, the largest of the R parts; the embedding whole
    parts = 1 if d.whole_update_cost else d.state_parts
    updated = {k: state_elems(elems[k], parts) for k in ("layer", "head")}
    for i, q in enumerate(d.layers):
        opt[q.optimizer] += updated["layer"] * (not fz.layer(i))
    opt[d.embed.optimizer] += elems["embed"] * emb * (not fz.embed)
    opt[d.head.optimizer] += updated["head"] * head * (not fz.head)
    bwd_base = (sum(c.bwd_s for c in costs), sum(c.bwd_frozen_s for c in costs))
    return Workload(
        n_layers=L, fwd_s=fwd_s, bwd_s=bwd_s, head_s=head_s,
        streamed=[q.weights is Where.HOME for q in d.layers],
        grads_home=[q.grads is Where.HOME and not fz.layer(i) for i, q in enumerate(d.layers)],
        act_count=act_count,
        act_bytes=act_bytes,
        layer_bytes=elems["layer"] * 2, grad_bytes=elems["layer"] * gbpe,
        weight_slots=d.slots.weight_slots, grad_slots=d.slots.grad_slots,
        act_slots=d.slots.act_slots,
        head_w_bytes=elems["head"] * 2 if head and d.head.weights is Where.HOME else 0,
        head_g_bytes=elems["head"] * gbpe if head and d.head.grads is Where.HOME
        and not fz.head else 0,
        embed_rows_bytes=rows if emb and d.embed.weights is Where.HOME else 0,
        embed_grad_rows_bytes=rows if emb and d.embed.grads is Where.HOME and not fz.embed
        else 0,
        compute_s=L * fwd_s + sum(bwd_base[fz.layer(i)] for i in range(L)) + head_s,
        recompute_s=rec_s,
        extra_flops=rec_flops + L * sum(c.flash_flops for c in costs),
        opt_device_elems=opt[OptimizerWhere.DEVICE],
        opt_streamed_elems=opt[OptimizerWhere.STREAMED], opt_host_elems=opt[OptimizerWhere.HOST],
        gbpe=gbpe, frozen_flops_per_seq=frozen_flops_per_seq(
            cfg, ch.seqlen, len(fz.layers), fz.head and head),
        adapter_flops_per_seq=adapter_model_flops_per_seq(cfg, d.lora, ch.seqlen))


@dataclasses.dataclass(frozen=True, slots=True)
class OptimizerCost:
    time_s: float
    host_bound: bool
    h2d_bytes: int
    d2h_bytes: int


def optimizer_cost(w: Workload, p: HardwareProfile) -> OptimizerCost:
    return adamw_cost(w.opt_device_elems, w.opt_streamed_elems, w.opt_host_elems, w.gbpe, p)


def adamw_cost(device_elems: int, streamed_elems: int, host_elems: int, gbpe: int,
               p: HardwareProfile) -> OptimizerCost:
    """Device AdamW is HBM bound; streamed AdamW is PCIe bound (param, grad, m, v in; param, m,
    v out); host AdamW is host-memory bound. The three run one after another (the executor's
    optimizer driver walks the blocks in turn)."""
    per_elem = ADAMW_STATE_BYTES_PER_ELEM + gbpe
    device_s = device_elems * per_elem / p.device_mem_bytes_per_s
    h2d, d2h = streamed_elems * (6 + gbpe), streamed_elems * 6
    streamed_s = max(h2d / p.h2d_duplex_bytes_per_s, d2h / p.d2h_duplex_bytes_per_s)
    host_s = host_elems * per_elem / p.host_mem_bytes_per_s
    gpu_s = device_s + streamed_s
    return OptimizerCost(time_s=host_s + gpu_s, host_bound=host_s > gpu_s, h2d_bytes=h2d,
                         d2h_bytes=d2h)


MAX_TOKENS_PER_STEP = 1 << 20
"""Rounds per step stop growing once a step holds this many tokens (a 1M-token global batch;
ml_dataflow's recorded steps hold 0.4-0.6M). Without it a slow optimizer would be hidden by an
absurd batch (a host AdamW on 1b asked for 329 rounds, 10.8M tokens per step)."""


def max_rounds(tokens_per_round: int) -> int:
    return max(1, min(MAX_ROUNDS_PER_STEP, MAX_TOKENS_PER_STEP // tokens_per_round))


def rounds_for_target(first_s: float, later_s: float, opt_s: float, target_frac: float,
                      cap: int = MAX_ROUNDS_PER_STEP) -> int:
    """The fewest rounds per step for which the optimizer takes at most `target_frac`, but at
    most `cap` (see max_rounds)."""
    if opt_s <= 0 or target_frac >= 1:
        return 1
    need = opt_s * (1 - target_frac) / target_frac - first_s
    rounds = 1 + max(0, math.ceil(need / later_s - 1e-9)) if later_s > 0 else 1
    return max(1, min(cap, rounds))


@dataclasses.dataclass(frozen=True, slots=True)
class RoundTimes:
    first: RoundResult
    later: RoundResult
    optimizer: OptimizerCost


def round_times(w: Workload, p: HardwareProfile) -> RoundTimes:
    return RoundTimes(first=simulate_round(w, p, first=True),
                      later=simulate_round(w, p, first=False), optimizer=optimizer_cost(w, p))


def compose(cfg: ModelConfig, ch: Chunking, p: HardwareProfile, w: Workload,
            rt: RoundTimes) -> Prediction:
    """The step prediction for `ch.rounds_per_step` rounds."""
    R, first, later, opt = ch.rounds_per_step, rt.first, rt.later, rt.optimizer
    step = first.time_s + (R - 1) * later.time_s + opt.time_s
    exp_h = first.exposed_h2d_s + (R - 1) * later.exposed_h2d_s
    exp_d = first.exposed_d2h_s + (R - 1) * later.exposed_d2h_s
    model_flops = (model_flops_per_seq(cfg, ch.seqlen) - w.frozen_flops_per_seq
                   + w.adapter_flops_per_seq) * ch.seqs_per_step
    hw_flops = model_flops + R * w.extra_flops
    compute, recompute = R * w.compute_s, R * w.recompute_s
    opt_name = "host memory" if opt.host_bound else "optimizer"
    parts = (("h2d", exp_h), ("d2h", exp_d), (opt_name, opt.time_s))
    name, worst = max(parts, key=lambda kv: kv[1])
    return Prediction(
        step_time_s=step, compute_s=compute, recompute_s=recompute, exposed_h2d_s=exp_h,
        exposed_d2h_s=exp_d, optimizer_s=opt.time_s,
        h2d_bytes=first.h2d_bytes + (R - 1) * later.h2d_bytes + opt.h2d_bytes,
        d2h_bytes=first.d2h_bytes + (R - 1) * later.d2h_bytes + opt.d2h_bytes,
        tok_per_s=ch.tokens_per_step / step, model_tflop_per_s=model_flops / step / 1e12,
        mfu=model_flops / step / p.peak_bf16_flop_per_s,
        hfu=hw_flops / step / p.peak_bf16_flop_per_s,
        bottleneck=name if worst >= BOTTLENECK_FRAC * step else "compute")


def event_seconds(plan, p: HardwareProfile):
    """Duration of a schedule event that is not a copy (copies are timed by bytes and link
    rate in the simulation): compute from chunk_costs, host work and fills from memory rates."""
    d = decisions_of(plan)
    cfg, ch = d.model, d.chunking
    costs = chunk_costs(cfg, ch, p, d.attention_bwd is AttentionBwd.DETERMINISTIC, d.precision,
                        d.lora)
    hbm, host = p.device_mem_bytes_per_s, p.host_mem_bytes_per_s
    copy = p.host_copy_bytes_per_s or host
    per_elem = ADAMW_STATE_BYTES_PER_ELEM + grad_bpe(d.grad_accum)
    rows = ch.tokens_per_round * cfg.model_dim * 2
    head_s = ch.chunks_per_round * head_seconds(cfg, ch.chunk_tokens, d.slots.head_sub_tokens,
                                                grad_bpe(d.grad_accum), p, d.frozen.head)
    ctx_s = 4 * ch.chunk_tokens * cfg.kv_dim * 2 / hbm
    kv_s = kv_rebuild_cost(cfg, ch.chunk_tokens, p)[0]

    def seconds(ev) -> float:
        kind = type(ev).__name__
        if kind == "Compute":
            if ev.op == "layer_refwd" and ev.src is not None and \
                    d.activations[ev.layer][ev.chunk].level in KEEPS_ATTN_OUT:
                return costs[ev.chunk].refwd_kept_s  # a boundary that kept its attention
            if ev.op in ("layer_fwd", "layer_refwd"):  # a segment's recompute: a forward
                return costs[ev.chunk].fwd_s
            if ev.op == "layer_bwd":
                level = d.activations[ev.layer][ev.chunk].level
                cc = costs[ev.chunk]  # no gradient ref: a frozen layer's (dx only)
                return (cc.bwd_s if ev.grads is not None else cc.bwd_frozen_s) \
                    + cc.rec_s[LEVEL_INDEX[level]]
            if ev.op == "head":
                return head_s
            if ev.op == "ctx_cast":
                return ctx_s
            if ev.op == "kv_rebuild":
                return kv_s
            if ev.op == "moe_totals_add":  # a ring rank's routing totals: a few hundred bytes
                return 0.0
            if ev.op in ("vocab_stats", "vocab_grad"):  # a vocabulary shard's chunk: 1, 3 GEMMs
                return head_s / ch.chunks_per_round * (1 if ev.op == "vocab_stats" else 3) / 3
            if str(ev.op).startswith("vocab_"):  # a chunk's norm, merge, loss or dx sum
                return 2 * rows / ch.chunks_per_round / hbm
            return 2 * rows / hbm  # embedding rows gathered or scattered on the device
        if kind == "Update":
            return ev.count * per_elem / (host if ev.stream == "host" else hbm)
        if kind == "Fill":
            return ev.dst.nbytes / (HOST_FILL_BYTES_PER_S if ev.stream == "host" else hbm)
        if kind == "HostTask":  # row copies at the host's copy rate; the others at traced rates
            if ev.op == "tokens_stage":
                return 3 * ch.tokens_per_round * 4 / copy
            if ev.op == "grad_sumsq":
                return ev.dst.nbytes / HOST_SUMSQ_BYTES_PER_S
            return 2 * rows / (copy if ev.op == "embed_gather" else HOST_SCATTER_BYTES_PER_S)
        return 0.0

    return seconds


def predict(plan, p: HardwareProfile) -> Prediction:
    """The search's estimate of a Plan or Decisions on hardware `p` (the per-round overlap
    formula of sim.simulate_round; fast enough to rank thousands of candidates). What a plan is
    predicted to do comes from `predict_schedule`, which times the compiled schedule itself."""
    d = decisions_of(plan)
    w = workload_of(d, p)
    return compose(d.model, d.chunking, p, w, round_times(w, p))
