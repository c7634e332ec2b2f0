"""Exact byte sizes of every arena region the executor allocates for a plan: saved activations by
level, the per-chunk workspace, K/V context, residual transitions, head buffers, optimizer
staging. The planner's memory map and the executor's arenas are both built from these tables,
so what the planner promises is what the executor takes. Pure Python: never imports arrays."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan.plan import Precision
from dataflow.models.config import ModelConfig
from dataflow.models.flops import SavedLevel
from dataflow.models.fp8_layout import fp8_layer_layout
from dataflow.models.layout import embed_layout, head_layout, layer_layout

DTYPE_BYTES = {"bf16": 2, "f32": 4, "i32": 4, "i64": 8, "u8": 1}
ALIGN_BYTES = 256
"""Every region and every tensor inside one starts on a 256-byte boundary."""


MAX_ROUNDS_PER_STEP = 512
NORM_PARTS_AT = 8 + 2 * MAX_ROUNDS_PER_STEP
MAX_NORM_PARTS = 256
"""Most blocks one ring rank holds: each has a scalar for its gradient's squared norm."""
SCALARS = NORM_PARTS_AT + MAX_NORM_PARTS
"""fp32 scalars on the device: [0] squared grad norm, [1] clip scale, [8 + 2r : 10 + 2r] the
loss sum and token count of round r (read once per step, so no round waits on the host),
[NORM_PARTS_AT + k] a ring rank's squared norm of its k-th block's gradient (the ranks add them
in the single-device order, dataflow.ring.executor)."""


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    """'bf16', 'f32', 'i32', 'i64' or 'u8'."""

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n


def packed_bytes(specs: tuple[TensorSpec, ...] | list[TensorSpec]) -> int:
    """Bytes of a region holding `specs` back to back, each aligned."""
    return sum(align(s.nbytes) for s in specs)


def offsets(specs) -> dict[str, int]:
    """Byte offset of each tensor inside a region laid out by `packed_bytes`."""
    out, at = {}, 0
    for s in specs:
        out[s.name] = at
        at += align(s.nbytes)
    return out


def lora_saved_name(target: str) -> str:
    """The saved-activation tensor of LoRA target `target`'s s (x a^T) at FULL."""
    return f"lora_xa.{target}"


def saved_activation_specs(cfg: ModelConfig, tokens: int, level: SavedLevel,
                           kv: bool = True, lora=None) -> tuple[TensorSpec, ...]:
    """What the forward keeps of one (layer, chunk) at `level` (see SavedLevel). kv=False (at
    INP_ONLY and INP_ATTN; x and rstd come first, so their offsets stay): no K and V, for a
    split sequence's activation whose K/V the backward re-forms (dataflow.memplan.plan.segments.kv_less).
    lora (Plan.lora): FULL also keeps each target's (T, r) bf16 s (x a^T), last, which the
    backward's db reads instead of re-forming it (no recompute at FULL forms it)."""
    t, d, h, k, e, f = tokens, cfg.model_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    specs = [TensorSpec("x", (t, d), "bf16"), TensorSpec("rstd", (t,), "f32")]
    if not kv and level is SavedLevel.FULL:
        raise ValueError("FULL activations keep their K/V; only INP_ONLY and INP_ATTN can "
                         "leave them out")
    if kv:
        specs += [TensorSpec("k", (t, k, e), "bf16"), TensorSpec("v", (t, k, e), "bf16")]
    if level in (SavedLevel.INP_ATTN, SavedLevel.FULL):
        specs += [TensorSpec("o", (t, h, e), "bf16"), TensorSpec("lse", (h, t), "f32")]
    if level is SavedLevel.FULL:
        specs += [TensorSpec("q", (t, h, e), "bf16"), TensorSpec("h", (t, d), "bf16"),
                  TensorSpec("rstd2", (t,), "f32")]
        specs += (moe_saved_specs(cfg, t) if cfg.moe is not None else
                  [TensorSpec("gate", (t, f), "bf16"), TensorSpec("up", (t, f), "bf16")])
        if lora is not None:
            specs += [TensorSpec(lora_saved_name(x), (t, lora.rank), "bf16")
                      for x in lora.targets]
    return tuple(specs)


def moe_rows(cfg: ModelConfig, tokens: int) -> int:
    """R = tokens x top_k: the routed rows of a chunk. Dropless routing bounds one expert's
    rows only by R (every token may pick it), and all experts together hold exactly R, so
    every per-row buffer is sized R, never R / N."""
    return tokens * cfg.moe.top_k


def moe_saved_specs(cfg: ModelConfig, tokens: int) -> list[TensorSpec]:
    """What an MoE layer's FULL level keeps of its FFN (kernels.reference.moe.MoeSaved): the
    router's fp32 logits and softmax, the top-k choice and weights, the permutation (order,
    per-expert offsets), and each routed row's gate, up and expert output. Indices are int64,
    the dtype of the reference and of the CUDA kernels (kernels/cuda/moe_*.py index rows in 64
    bits: R x D passes 2^31 at long chunks). Below FULL the backward re-forms all of it from the
    FFN's input (dataflow.moe_ffn), the routing bit for bit."""
    t, n, k, f = tokens, cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.expert_ffn_dim
    r = moe_rows(cfg, t)
    return [TensorSpec("router_logits", (t, n), "f32"), TensorSpec("router_probs", (t, n), "f32"),
            TensorSpec("topk_idx", (t, k), "i64"), TensorSpec("topk_weight", (t, k), "f32"),
            TensorSpec("expert_order", (r,), "i64"), TensorSpec("expert_offsets", (n + 1,), "i64"),
            TensorSpec("expert_gate", (r, f), "bf16"), TensorSpec("expert_up", (r, f), "bf16"),
            TensorSpec("expert_out", (r, cfg.model_dim), "bf16")]


MOE_ROUTER_BWD_ROWS = 1024
"""dataflow.kernels.cuda.moe_router.BWD_ROWS: tokens whose x the CUDA router backward widens to
fp32 at a time (its scratch holds that many rows of D)."""
MOE_OP_SCRATCH = ("expert_act", "expert_dgate", "expert_dup", "moe_inv", "moe_tokens_f32",
                  "moe_router_f32", "moe_dlogits", "moe_lse")
"""Chunk-workspace tensors the executor lends to the op table as scratch (dataflow.ops_cuda's
MoE ops; the NumPy table keeps its own temporaries and ignores them)."""
MOE_HOST_REGION = "moe_offsets_host"
"""Pinned host region of an MoE model: the per-expert offsets (N + 1,) int64 of the chunk in
flight, copied there from the device because the CUDA experts' GEMM loop takes its row counts
on the host (dataflow.ops_cuda, kernels/cuda/moe_experts.offsets_to_host)."""


def moe_workspace_specs(cfg: ModelConfig, tokens: int) -> list[TensorSpec]:
    """Scratch of one MoE FFN on a chunk, besides what moe_saved_specs names (formed here below
    FULL): the permuted input and its gradient (R, D), the permuted output's gradient (R, D),
    the activation (R, F), the combine weights' gradient (T, k) fp32; then what only the CUDA
    op table uses (MOE_OP_SCRATCH, lent to it by the executor; the NumPy table keeps its own
    temporaries): the SwiGLU gradients (R, F) (the experts' backward re-forms the activation
    into expert_act), the inverse permutation (R,) int64, an fp32 (T, D) for the combine's
    unrounded sum, the experts' input-gradient sum (one expert has at most T rows) and the
    router's input gradient, one at a time; the router backward's fp32 weight gradient (N, D)
    and widened weights and input rows ((N + min(T, MOE_ROUTER_BWD_ROWS)) x D); the logits'
    gradient (T, N) fp32; logsumexp per token plus one fp32 (T + 1,)."""
    t, k, d, f, n = tokens, cfg.moe.top_k, cfg.model_dim, cfg.moe.expert_ffn_dim, cfg.moe.n_experts
    r = moe_rows(cfg, t)
    router_elems = (2 * n + min(t, MOE_ROUTER_BWD_ROWS)) * d
    return moe_saved_specs(cfg, t) + [
        TensorSpec("expert_in", (r, d), "bf16"), TensorSpec("expert_din", (r, d), "bf16"),
        TensorSpec("expert_dout", (r, d), "bf16"), TensorSpec("expert_act", (r, f), "bf16"),
        TensorSpec("topk_dweight", (t, k), "f32"),
        TensorSpec("expert_dgate", (r, f), "bf16"), TensorSpec("expert_dup", (r, f), "bf16"),
        TensorSpec("moe_inv", (r,), "i64"), TensorSpec("moe_tokens_f32", (t, d), "f32"),
        TensorSpec("moe_router_f32", (router_elems,), "f32"),
        TensorSpec("moe_dlogits", (t, n), "f32"), TensorSpec("moe_lse", (t + 1,), "f32")]


def saved_activation_bytes(cfg: ModelConfig, tokens: int, level: SavedLevel,
                           kv: bool = True, lora=None) -> int:
    return packed_bytes(saved_activation_specs(cfg, tokens, level, kv, lora))


KV_REBUILD_STAGES = 2
"""Saved inputs x a K/V rebuild stages on the device: the next comes over H2D while the compute
re-forms K/V from the last."""


def kv_rebuild_specs(cfg: ModelConfig, tokens: int) -> tuple[TensorSpec, ...]:
    """Device staging of a K/V rebuild (Plan.kv_rebuild): KV_REBUILD_STAGES chunks' saved
    inputs x (dataflow.memplan.step.compile uses them in turn)."""
    return tuple(TensorSpec(f"x{i}", (tokens, cfg.model_dim), "bf16")
                 for i in range(KV_REBUILD_STAGES))


def fp8_projections(cfg: ModelConfig) -> tuple[tuple[str, int, int], ...]:
    """(name, out_features, in_features) of the block projections an FP8 plan runs in FP8:
    q, k, v, o and a dense FFN's gate, up and down (an MoE layer's experts stay bf16)."""
    d = cfg.model_dim
    out = [("q", cfg.q_dim, d), ("k", cfg.kv_dim, d), ("v", cfg.kv_dim, d), ("o", d, cfg.q_dim)]
    if cfg.moe is None:
        out += [("gate", cfg.ffn_dim, d), ("up", cfg.ffn_dim, d), ("down", d, cfg.ffn_dim)]
    return tuple(out)


FP8_AMAX_PARTS = 1024
"""Partial maxima of kernels/cuda/fp8.py's two-stage amax (its AMAX_PARTS)."""
FP8_GUESS_VALUES = 4 + 16_380
"""The guessed scales' state (kernels/cuda/fp8.py quantise_guessed: a 4-word header, then one
slot per site and operand: at most 56 a layer, 1,792 for 8b's 32 layers, 4,480 for 80); 64 KiB.
A run with more quantises the rest as before, amax pass and all."""


def fp8_scratch_specs(cfg: ModelConfig, tokens: int) -> tuple[TensorSpec, ...]:
    """An FP8 plan's operand scratch for one linear op (reused by every op): 'fp8_a' holds its
    first operand in FP8 (x (T, I), dy (T, O) or dy^T (O, T)), 'fp8_b' its second (w (O, I),
    w^T (I, O) or x^T (I, T)), 'fp8_scales' each operand's (1 / scale, scale, amax), padded to
    16 bytes, 'fp8_amax' the amax kernel's partial maxima (FP8_AMAX_PARTS: kernels/cuda/fp8.py's
    AMAX_PARTS, which refuses a smaller one by name), 'fp8_guess' the guessed scales' state
    (FP8_GUESS_VALUES)."""
    a = max(tokens * max(o, i) for _, o, i in fp8_projections(cfg))
    b = max(max(o * i, tokens * i) for _, o, i in fp8_projections(cfg))
    return (TensorSpec("fp8_a", (a,), "u8"), TensorSpec("fp8_b", (b,), "u8"),
            TensorSpec("fp8_scales", (2, 4), "f32"),
            TensorSpec("fp8_amax", (FP8_AMAX_PARTS,), "f32"),
            TensorSpec("fp8_guess", (FP8_GUESS_VALUES,), "f32"))


def chunk_workspace_specs(cfg: ModelConfig, tokens: int,
                          precision: Precision = Precision.BF16) -> tuple[TensorSpec, ...]:
    """Scratch for one (layer, chunk) forward, recompute or backward; reused by every chunk
    (with an FP8 plan's operand scratch, fp8_scratch_specs)."""
    t, d, h, k, e, f = tokens, cfg.model_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    # An MoE layer runs no dense FFN: its (T, F) buffers give way to moe_workspace_specs.
    dense_ffn = [] if cfg.moe is not None else [
        ("gate", (t, f)), ("up", (t, f)), ("act", (t, f)), ("dact", (t, f)), ("dgate", (t, f)),
        ("dup", (t, f))]
    bf = [("xn", (t, d)), ("q", (t, h, e)), ("k", (t, k, e)), ("v", (t, k, e)),
          ("o", (t, h, e)), ("h", (t, d)), ("xn2", (t, d)), *dense_ffn, ("dh", (t, d)),
          ("dxn", (t, d)), ("do", (t, h, e)), ("dq", (t, h, e)), ("dk", (t, k, e)),
          ("dv", (t, k, e))]
    f32 = [("lse", (h, t)), ("rstd", (t,)), ("rstd2", (t,))]
    if cfg.qk_norm:  # QK-norm's inputs and per-head rstd (dataflow.layer_ops.LayerCompute._proj)
        bf += [("qpre", (t, h, e)), ("kpre", (t, k, e))]
        f32 += [("qrstd", (t, h)), ("krstd", (t, k))]
    moe = moe_workspace_specs(cfg, t) if cfg.moe is not None else []
    fp8 = list(fp8_scratch_specs(cfg, t)) if precision is Precision.FP8 else []
    return tuple([TensorSpec(n, s, "bf16") for n, s in bf]
                 + [TensorSpec(n, s, "f32") for n, s in f32] + moe + fp8)


ATTN_WORKSPACE_SCORE_BYTES = 2
"""cuDNN 9.19's deterministic fused-attention backward keeps a bf16 score-sized buffer per head:
its workspace measured on the H100 was 2*T*S*H + 4*T*H*E bytes (+ ~1 MiB) at all three shapes
tried — (T = S = 4096, H 32, E 64): 1.108e9; (8192, 32, 64): 4.363e9; (8192, 32, 128): 4.430e9.
The arena keeps this much, so the library's scratch lives inside the device budget."""
ATTN_WORKSPACE_DQ_BYTES = 4
ATTN_WORKSPACE_SLACK_BYTES = 32 << 20
"""cuDNN asked for 0.5 MiB beyond the formula at T = 4096 and about 1 MiB at 8192; keep room."""


ATTN_NONDET_CONTEXT_BYTES = 16
"""cuDNN 9's non-deterministic (atomic dQ) backward, used when a query chunk attends to a longer
context (split sequences): its workspace measured on the H100 is 16*S*Hk*E + 4*T*H*E bytes plus
at most 2 MiB, for T = 2048..16384, S = 2T..64T, head dims 64 and 128 (46 shapes,
bench/records/attention-workspace-h100.json): fp32 dK/dV-sized buffers over the whole context
and the fp32 dQ of the chunk."""
ATTN_NONDET_SLACK_BYTES = 4 << 20


KEY_BLOCK_TARGET_BYTES = 1 << 30
"""Device bytes one key block of a split sequence's attention backward may cost: the bf16 dK/dV
it writes (4*Hk*E per key) plus cuDNN's atomic-dQ workspace (16*Hk*E per key). Contexts up to
this size take one call per chunk; longer ones (8b past 48k tokens, 1b past 96k) one call per
key block, so the library's scratch stops growing with the sequence. Smaller blocks were also
faster on the H100 (bench/records/attention-blocks-h100.json: 8b at 128k, whole context 505,
64k blocks 514, 32k blocks 517 TFLOP/s; 1b at 512k, 415 / 433 (256k) / 441 (128k))."""


def attention_key_block(cfg: ModelConfig, chunk_tokens: int, seqlen: int) -> int:
    """Keys one fused-attention backward call of a split sequence covers: the whole context
    when it fits KEY_BLOCK_TARGET_BYTES, else the largest multiple of the chunk that does (at
    least one chunk). Packed chunks (seqlen <= chunk) attend within the chunk: the chunk."""
    if seqlen <= chunk_tokens:
        return chunk_tokens
    per_key = (ATTN_NONDET_CONTEXT_BYTES + 4) * cfg.kv_dim
    fit = KEY_BLOCK_TARGET_BYTES // per_key // chunk_tokens * chunk_tokens
    return seqlen if fit >= seqlen else max(chunk_tokens, fit)


def key_block_spans(q_offset: int, n_q: int, block: int) -> list[tuple[int, int, bool]]:
    """(first key, end key, causal) of each backward call of n_q queries at q_offset when the
    context is taken `block` keys at a time: the chunk against its own keys first (causal,
    top-left: the only call with a mask), then the rest of the key block holding it (unmasked,
    its start on a grid of `block` so few shapes recur), then every earlier block (unmasked).
    Masked tiles are cuDNN's slow ones: a call whose keys reach far before the diagonal ran at
    450-475 TFLOP/s at 8b where the chunk alone ran 507 and an unmasked block 560-580
    (bench/records/attention-plans-h100.json). One span when the chunk starts the sequence."""
    if block < n_q:
        raise ValueError(f"a key block of {block} keys is shorter than the {n_q} queries of the "
                         "chunk; the diagonal must fit one block")
    end = q_offset + n_q
    start = q_offset // block * block
    spans = [(q_offset, end, True)]
    if start < q_offset:
        spans.append((start, q_offset, False))
    return spans + [(a, a + block, False) for a in range(0, start, block)]


def attention_workspace_bytes(cfg: ModelConfig, chunk_tokens: int, seqlen: int, *,
                              deterministic: bool = True) -> int:
    """Workspace of the largest fused-attention call of a chunk. Packed chunks attend per
    sequence (T = S = the sequence) with the deterministic backward (2*T*S*H + 4*T*H*E), or
    with `deterministic` False the non-deterministic one (16*T*Hk*E + 4*T*H*E).
    Split sequences would need 2*T*seqlen*H for that, which is hopeless at long context, so
    all their chunks use cuDNN's non-deterministic backward (16*S*Hk*E + 4*T*H*E, S the keys
    of one call: the context, or attention_key_block at long context). The CUDA op table picks
    the deterministic algorithm exactly when its workspace fits the region it was lent."""
    t = min(chunk_tokens, seqlen)
    dq = ATTN_WORKSPACE_DQ_BYTES * t * cfg.q_dim
    if seqlen > chunk_tokens:
        keys = attention_key_block(cfg, chunk_tokens, seqlen)
        return ATTN_NONDET_CONTEXT_BYTES * keys * cfg.kv_dim + dq + ATTN_NONDET_SLACK_BYTES
    if not deterministic:
        return ATTN_NONDET_CONTEXT_BYTES * t * cfg.kv_dim + dq + ATTN_NONDET_SLACK_BYTES
    return ATTN_WORKSPACE_SCORE_BYTES * t * t * cfg.n_heads + dq + ATTN_WORKSPACE_SLACK_BYTES


NORM_BWD_PARTS = 256
"""dataflow.kernels.cuda.rms_norm.MAX_PARTS: the fp32 (parts, D) scratch of an RMSNorm backward."""
SUMSQ_PARTS = 1024
"""dataflow.kernels.cuda.utils.SUMSQ_PARTS: the fp32 partial sums of a squared-norm reduction."""
CUBLAS_WORKSPACE_BYTES = 32 << 20
"""cuBLAS's workspace, set with cublasSetWorkspace (32 MiB is NVIDIA's advice for Hopper)."""


def library_scratch_specs(cfg: ModelConfig) -> tuple[TensorSpec, ...]:
    """Scratch the CUDA op table would otherwise allocate outside the arena: the reduction
    scratch of RMSNorm backward and of a squared-norm sum, and cuBLAS's workspace."""
    return (TensorSpec("norm_scratch", (NORM_BWD_PARTS, cfg.model_dim), "f32"),
            TensorSpec("sumsq_scratch", (SUMSQ_PARTS,), "f32"),
            TensorSpec("cublas_workspace", (CUBLAS_WORKSPACE_BYTES,), "u8"))


def context_specs(cfg: ModelConfig, seqlen: int, chunk_tokens: int,
                  chunks_per_seq: int) -> tuple[TensorSpec, ...]:
    """For split sequences: K/V of the whole sequence (bf16), fp32 accumulators for dK/dV over
    the context, the bf16 dK/dV one fused-attention backward writes before they are added in
    (rows: one key block, attention_key_block) and the fp32 dQ of a chunk summed over the calls
    of its backward (key_block_spans). Packed sequences need none of it: their attention
    backward writes a chunk's bf16 dK/dV whole (attention_bwd_own)."""
    if chunks_per_seq <= 1:
        return ()
    k, e = cfg.n_kv_heads, cfg.head_dim
    rows = max(seqlen, chunk_tokens)
    block = attention_key_block(cfg, chunk_tokens, seqlen)
    specs = [TensorSpec("dk_ctx", (rows, k, e), "f32"), TensorSpec("dv_ctx", (rows, k, e), "f32"),
             TensorSpec("dk16", (block, k, e), "bf16"), TensorSpec("dv16", (block, k, e), "bf16"),
             TensorSpec("dq32", (chunk_tokens, cfg.n_heads, e), "f32"),
             TensorSpec("k_ctx", (seqlen, k, e), "bf16"), TensorSpec("v_ctx", (seqlen, k, e), "bf16")]
    return tuple(specs)


ROUND_ROWS = ("resid_a", "resid_b", "ids", "targets", "positions")
"""The transitions that hold one round's rows (its residual pair and tokens): an overlapped ring
rank keeps a second set of them for its odd rounds
(dataflow.memplan.plan.memory.overlap_regions)."""


def transition_specs(cfg: ModelConfig, round_tokens: int) -> tuple[TensorSpec, ...]:
    """Residual stream (forward) and its gradient (backward) for every chunk of a round,
    ping-ponged between layers; token ids, targets and RoPE positions for the round; a few fp32
    scalars (loss sums, squared gradient norm)."""
    d = cfg.model_dim
    specs = (TensorSpec("resid_a", (round_tokens, d), "bf16"),
             TensorSpec("resid_b", (round_tokens, d), "bf16"),
             TensorSpec("ids", (round_tokens,), "i32"),
             TensorSpec("targets", (round_tokens,), "i32"),
             TensorSpec("positions", (round_tokens,), "i32"),
             TensorSpec("scalars", (SCALARS,), "f32"))
    return specs + (moe_round_specs(cfg) if cfg.moe is not None else ()) + (
        vocab_round_specs(cfg, round_tokens) if cfg.head_vocab_rows else ())


def moe_round_specs(cfg: ModelConfig) -> tuple[TensorSpec, ...]:
    """An MoE model's routing totals over one round's forward (every layer and chunk): what the
    load-balancing loss's gradient needs in every layer's backward (docs/moe.md). Counts are
    int64 (the dtype the reference and the CUDA kernels count in); the fp32 sums hold each
    expert's softmax mass and, last, the sum of logsumexp^2 (the z-loss). `moe_losses` keeps
    each round's (aux, z) for the step's result, read with the LM losses. A ring rank receives
    the previous rank's partial totals into `moe_partial_*` and adds them to its own
    (dataflow.memplan.step.ring_compile, "routing totals")."""
    n = cfg.moe.n_experts
    return (TensorSpec("moe_counts", (n,), "i64"), TensorSpec("moe_sums", (n + 1,), "f32"),
            TensorSpec("moe_losses", (MAX_ROUNDS_PER_STEP, 2), "f32"),
            TensorSpec("moe_partial_counts", (n,), "i64"),
            TensorSpec("moe_partial_sums", (n + 1,), "f32"))


def head_specs(cfg: ModelConfig, chunk_tokens: int, sub_tokens: int) -> tuple[TensorSpec, ...]:
    """Final norm output and gradient for a chunk, and one fp32 logits sub-chunk (of the
    head's rows: a vocabulary-parallel ring rank's shard). A vocabulary-parallel head's also
    the fp32 partial dx of a chunk and the one received (dataflow.memplan.step.ring_vocab; its
    round-long buffers are transitions: vocab_round_specs)."""
    d, v, t = cfg.model_dim, cfg.head_rows, chunk_tokens
    specs = (TensorSpec("xn", (t, d), "bf16"), TensorSpec("dxn", (t, d), "bf16"),
             TensorSpec("rstd", (t,), "f32"),
             TensorSpec("logits", (sub_tokens, v), "f32"),
             TensorSpec("loss", (2,), "f32"))
    if not cfg.head_vocab_rows:
        return specs
    return specs + (TensorSpec("vdx", (t, d), "f32"), TensorSpec("vdx_in", (t, d), "f32"))


def vocab_round_specs(cfg: ModelConfig, round_tokens: int) -> tuple[TensorSpec, ...]:
    """A vocabulary-parallel head's round (dataflow.memplan.step.ring_vocab): every chunk's
    normed hidden state (sent round the ring) and the head rank's rstd, the per-token statistics
    (max, sum-exp, target logit) and those received, kept for the round so that the ranks pass
    one chunk's messages while they compute the next's."""
    t, d = round_tokens, cfg.model_dim
    return (TensorSpec("vocab_xn", (t, d), "bf16"), TensorSpec("vocab_rstd", (t,), "f32"),
            TensorSpec("vocab_stats", (t, 3), "f32"), TensorSpec("vocab_stats_in", (t, 3), "f32"))


def block_elems(cfg: ModelConfig, lora=None) -> dict[str, int]:
    """Elements (bf16, alignment padding included) of the embed, one layer and the head block;
    a LoRA plan with an fp8 base (Plan.lora.base) counts its layer block as E4M3 codes and row
    scales (dataflow.models.fp8_layout: its bytes / 2)."""
    fp8 = lora is not None and lora.fp8_base
    return {"embed": embed_layout(cfg).numel,
            "layer": fp8_layer_layout(cfg).numel if fp8 else layer_layout(cfg).numel,
            "head": head_layout(cfg).numel}


def grad_bytes_per_elem(grad_accum_value: str) -> int:
    """2 for 'bf16' gradient accumulation, 4 for 'fp32'."""
    return 2 if grad_accum_value == "bf16" else 4


def opt_stage_specs(stage_elems: int, grad_elem_dtype: str) -> tuple[TensorSpec, ...]:
    """Double-buffered staging for a STREAMED optimizer: param, grad, m, v pieces, twice."""
    specs = []
    for i in range(2):
        specs += [TensorSpec(f"p{i}", (stage_elems,), "bf16"),
                  TensorSpec(f"g{i}", (stage_elems,), grad_elem_dtype),
                  TensorSpec(f"m{i}", (stage_elems,), "bf16"),
                  TensorSpec(f"v{i}", (stage_elems,), "bf16")]
    return tuple(specs)
