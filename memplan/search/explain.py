"""Terminal text for a Plan: its chunking, rounds, slots, saved-activation levels, placement,
memory map against the budgets, predicted step, and one sentence of reason per decision. Reads
the plan only (works for forced plans too). Never imports array libraries."""

from __future__ import annotations

import dataclasses

from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.chunking import chunk_target_tokens
from dataflow.memplan.plan.decisions import decisions_of
from dataflow.memplan.plan.lora import LoraBase, adapter_bytes, adapter_params, region_sizes
from dataflow.memplan.plan.frozen import NOTHING_FROZEN
from dataflow.memplan.plan.memory import CATEGORIES, memory_map
from dataflow.memplan.plan.plan import OptimizerWhere, Plan, Where
from dataflow.memplan.search.cost import DEFAULT_OPT_TARGET_FRAC
from dataflow.memplan.search.predict import predict_schedule
from dataflow.models.flops import (
    SavedLevel,
    flop_model_version,
    frozen_flops_per_seq,
    model_flops_per_seq,
)

GIB, MIB = 1 << 30, 1 << 20


def _size(nbytes: float) -> str:
    """GiB from 1 GiB up, MiB below (a budget of 0.25 GiB reads '256.0 MiB')."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _t(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.2f} ms"


def _chunking_lines(plan: Plan) -> list[str]:
    ch = plan.chunking
    if ch.chunks_per_seq > 1:
        shape = (f"each sequence of {ch.seqlen:,} tokens is split into {ch.chunks_per_seq} "
                 f"chunks of {ch.chunk_tokens:,}")
    else:
        shape = f"{ch.seqs_per_chunk} sequence(s) of {ch.seqlen:,} tokens packed per chunk of " \
                f"{ch.chunk_tokens:,}"
    return [(f"Chunking: {shape}; {ch.chunks_per_round} chunk(s) per round "
            f"({ch.tokens_per_round:,} tokens); {ch.rounds_per_step} round(s) per step "
            f"({ch.seqs_per_step:,} sequences, {ch.tokens_per_step:,} tokens)")]


def _activation_line(plan: Plan) -> str:
    counts = {}
    for row in plan.activations:
        for a in row:
            counts[(a.home, a.level)] = counts.get((a.home, a.level), 0) + 1
    parts = []
    for where in (Where.DEVICE, Where.HOME):
        levels = ", ".join(f"{lv.value} {counts.get((where, lv), 0)}" for lv in SavedLevel)
        parts.append(f"{where.value}: {levels}")
    total = sum(counts.values())
    line = f"Saved activations ({total} per round): " + "; ".join(parts)
    k = plan.segment_layers
    if k > 1:
        line += (f"; layer segments of {k}: layers 0, {k}, ... keep theirs from the forward, the "
                 f"others are rebuilt in the backward (storage for {min(k, plan.model.n_layers) - 1}"
                 " layers, reused by every segment)")
    if plan.kv_rebuild:
        line += ("; inp_only and inp_attn keep no K/V: the backward re-forms them from the saved "
                 "input")
    return line


def _placement_line(plan: Plan) -> str:
    resident = plan.resident_layers
    home_opts = {p.optimizer.value for p in plan.layers if p.weights is Where.HOME}
    layers = f"{resident}/{len(plan.layers)} layers resident"
    if home_opts:
        layers += f", the rest at home (optimizer {'/'.join(sorted(home_opts))})"
    return (f"Placement: {layers}; embedding {_block(plan.embed)}; head {_block(plan.head)}")


def _block(p) -> str:
    if p.weights is Where.DEVICE:
        return "on the device"
    return f"at home (optimizer {p.optimizer.value})"


def _memory_lines(plan: Plan) -> list[str]:
    dev, host = dict(plan.memory.device), dict(plan.memory.host)
    big = max(plan.budget.device_bytes, plan.budget.host_bytes) >= GIB
    unit, scale = ("GiB", GIB) if big else ("MiB", MIB)
    rows = [(cat, dev.get(cat, 0), host.get(cat, 0)) for cat in CATEGORIES]
    prof = plan.profile
    rows += [("libraries", prof.library_reserve_bytes, 0),
             ("total", plan.memory.device_bytes + prof.library_reserve_bytes,
              plan.memory.host_bytes),
             ("budget", plan.budget.device_bytes, plan.budget.host_bytes)]
    out = [f"  {'memory (' + unit + ')':<18}{'device':>10}{'host':>10}"]
    out += [f"  {name:<18}{d / scale:>10.3f}{h / scale:>10.3f}" for name, d, h in rows]
    out.append(f"  (libraries: what cuDNN, cuBLAS and CuPy hold beside the device arena; the process "
               f"RSS may exceed the host budget by {_size(prof.host_overhead_bytes)} for the "
               f"interpreter and libraries)")
    return out


def _prediction_lines(plan: Plan, pr, update: str) -> list[str]:
    est = plan.prediction.tok_per_s
    version = flop_model_version(plan.model, plan.lora is not None)
    mode = "" if update == "deferred" else f", the update {UPDATE_WHERE[update]}"
    return [
        (f"Prediction on {plan.profile.name} (its compiled schedule{mode}, simulated): step "
        f"{_t(pr.step_time_s)} = compute "
        f"{_t(pr.compute_s)} + recompute {_t(pr.recompute_s)} + exposed h2d "
        f"{_t(pr.exposed_h2d_s)} + exposed d2h {_t(pr.exposed_d2h_s)} + optimizer "
        f"{_t(pr.optimizer_s)}"),
        (f"  {pr.tok_per_s:,.0f} tok/s, model {pr.model_tflop_per_s:.0f} TFLOP/s, MFU "
        f"{pr.mfu:.1%}, HFU {pr.hfu:.1%} (FLOP model {version}); bottleneck: "
        f"{pr.bottleneck}"),
        f"  PCIe per step: h2d {_size(pr.h2d_bytes)}, d2h {_size(pr.d2h_bytes)}",
        f"  (the search ranked candidates with its faster per-round estimate: {est:,.0f} tok/s)",
        *_moe_caveat(plan),
    ]


def _moe_caveat(plan: Plan) -> list[str]:
    """An MoE model's prediction rests on two measured shapes (memplan/search/cost.py's expert GEMM
    constants, olmoe-1b-7b and qwen3-30b-a3b on an H200); the user should know how far it was
    borne out."""
    if plan.model.moe is None:
        return []
    return ["  (MoE: the routed experts are charged at a small-GEMM rate fitted to two models "
            "on an H200, where the CuPy engine then ran at 1.01 (olmoe-1b-7b, 120/24) and 1.05 "
            "(qwen3-30b-a3b, 180/90) of the prediction at 8k; other MoE shapes and GPUs are not "
            "measured: docs/moe.md, 'Measured on the GPU')"]


def _reasons(plan: Plan, pr, update: str = "deferred") -> list[str]:
    """The reasons, with shares and the bottleneck from `pr`, the simulated prediction printed
    above them (the search's per-round estimate could name another bottleneck)."""
    cfg, ch, s = plan.model, plan.chunking, plan.slots
    target = chunk_target_tokens(cfg)
    out = []
    if ch.chunks_per_seq > 1:
        out.append(f"chunk: a sequence longer than the {target:,}-token chunk target for a "
                   f"{cfg.model_dim}-wide model is split; later chunks attend to the K/V of "
                   "earlier ones, so activations stay per chunk")
    else:
        out.append(f"chunk: whole sequences are packed to about the {target:,}-token target so "
                   "GEMMs run at high arithmetic intensity")
    out.append(f"chunks per round: every streamed block crosses PCIe once per round each way, so "
               f"{ch.chunks_per_round} chunk(s) share each crossing; more would need more saved "
               "activations per layer")
    share = pr.optimizer_s / pr.step_time_s if pr.step_time_s else 0.0
    out.append(f"rounds per step: {ch.rounds_per_step} keep the optimizer ({_t(pr.optimizer_s)}) "
               f"at {share:.1%} of the step (target {DEFAULT_OPT_TARGET_FRAC:.0%})")
    resident = plan.resident_layers
    layer_b = buffers.block_elems(cfg, plan.lora)["layer"] * 2
    if resident == cfg.n_layers:
        out.append("layers: all state fits on the device, so no weight or gradient crosses PCIe")
    else:
        frozen = (f"; a frozen one {_size(layer_b)}, its weights alone"
                  if plan.frozen.layers else "")
        out.append(f"layers: {resident} resident (each costs {_size(4 * layer_b)} of device for "
                   f"weights, grads, m and v{frozen}); the others stream through "
                   f"{s.weight_slots} weight and {s.grad_slots} grad slot(s) (prefetch depth "
                   f"{s.weight_slots - 1}), {_size(layer_b)} per crossing")
    home = [p for p in (*plan.layers, plan.embed, plan.head) if p.weights is Where.HOME]
    if home:
        opt = home[0].optimizer
        how = ("streamed through the device (PCIe bound)" if opt is OptimizerWhere.STREAMED
               else "on the host (host-memory bound, no PCIe traffic)")
        out.append(f"optimizer: home blocks update {how}; device blocks update in HBM; "
                   f"the Engine runs a step's update {UPDATE_WHERE[update]} "
                   "(what it does not hide there is the prediction's optimizer time)")
    rows = ch.tokens_per_round * cfg.model_dim * 2
    fz = plan.frozen
    if plan.embed.weights is Where.HOME:
        out.append(f"embedding: the host gathers {_size(rows)} of rows per round instead of the "
                   f"device holding the table" + (" (frozen: no gradient rows come back)"
                                                  if fz.embed else ", its grads and AdamW state"))
    else:
        out.append("embedding: on the device" + (" (frozen: weights only)" if fz.embed else
                                                 " with its grads and AdamW state"))
    if fz.head:
        out.append("head: frozen, its weights " + ("visit the device once a step"
                                                   if plan.head.weights is Where.HOME else
                                                   "resident") + "; no gradient or AdamW state")
    else:
        out.append("head: " + ("weights visit the device once a step (a later round finds "
                               "them still in their slot), grads each round"
                               if plan.head.weights is Where.HOME else
                               "resident with its AdamW state"))
    out.append(_act_reason(plan))
    exposed = pr.exposed_h2d_s + pr.exposed_d2h_s
    out.append(f"bottleneck: {pr.bottleneck} (exposed copies {_t(exposed)}, recompute "
               f"{_t(pr.recompute_s)} of {_t(pr.step_time_s)})")
    return out


def _act_reason(plan: Plan) -> str:
    acts = [a for row in plan.activations for a in row]
    home = [a for a in acts if a.home is Where.HOME]
    if not home:
        return ("activations: all kept on the device" +
                (" at FULL: nothing is recomputed" if all(a.level is SavedLevel.FULL for a in acts)
                 else "; lower levels trade recompute for device memory"))
    out = (f"activations: {len(acts) - len(home)} on the device, {len(home)} at home through "
           f"{plan.slots.act_slots} slot(s); lower levels save host memory and PCIe bytes at the "
           "cost of recompute in the backward")
    if plan.segment_layers > 1:
        out += ("; no plan without layer segments fits these budgets (or one predicts less), "
                "so each segment re-runs its forward before its backward (one more forward of "
                "every layer, without attention for a boundary that kept its output: HFU counts "
                "it, MFU not)")
    if plan.kv_rebuild:
        out += ("; K/V are re-formed from each chunk's saved input before its layer's backward "
                "(the K and V projections again, and its input over PCIe once more) instead of "
                "kept, so the memory they took holds more attention outputs (less attention "
                "recompute)")
    return out


UPDATE_WHERE = {
    "deferred": "inside the next step's first round",
    "end": "at the end of its own step (--eager-update)",
    "backward": ("inside its own last round, each streamed layer's right after its gradient is "
                 "final (--backward-update)"),
}
"""Where the Engine runs a step's AdamW, by dataflow.memplan.step.compile.UPDATE_MODES name."""


def _precision_lines(plan: Plan) -> list[str]:
    """What an FP8 plan holds and how its speed was predicted (nothing for bf16)."""
    if plan.precision.value == "bf16":
        return []
    scratch = sum(buffers.packed_bytes((s,)) for s in buffers.fp8_scratch_specs(
        plan.model, plan.chunking.chunk_tokens))
    rate = plan.profile.fp8_gemm_flop_per_s
    how = (f"at the profile's measured FP8 rate {rate / 1e12:,.0f} TFLOP/s" if rate else
           "at the bf16 rate: this profile has no measured FP8 rate, so no speedup is claimed")
    return [f"Precision fp8: the block projections' GEMMs in FP8 (docs/fp8.md), predicted {how}, "
            f"their quantise passes counted; {_size(scratch)} of FP8 operand scratch in the "
            "workspace"]


def _frozen_lines(plan: Plan) -> list[str]:
    """What a plan freezes and what that saves against the same decisions trained whole
    (nothing when nothing is frozen)."""
    fz = plan.frozen
    if not fz.anything:
        return []
    cfg, ch = plan.model, plan.chunking
    # trained whole, a base is bf16 (an fp8 base's codes exist only for a frozen LoRA base)
    lora = plan.lora if plan.lora is None or not plan.lora.fp8_base else \
        dataclasses.replace(plan.lora, base=LoraBase.BF16)
    whole = memory_map(dataclasses.replace(decisions_of(plan), frozen=NOTHING_FROZEN, lora=lora))
    saved_host = whole.host_bytes - plan.memory.host_bytes
    saved_dev = whole.device_bytes - plan.memory.device_bytes
    flops = frozen_flops_per_seq(cfg, ch.seqlen, len(fz.layers), fz.head)
    share = flops / (model_flops_per_seq(cfg, ch.seqlen)) if flops else 0.0
    return [f"Frozen: {fz.describe(cfg.n_layers)} ('{fz.spec()}', docs/freeze.md): no gradient, "
            f"AdamW state, gradient copy or weight-gradient GEMM for them; the same decisions "
            f"training everything would hold {_size(saved_host)} more host and "
            f"{_size(saved_dev)} more device; the skipped GEMMs are {share:.1%} of the whole "
            "model's FLOPs (the MFU below counts only what runs)"]


def _lora_lines(plan: Plan) -> list[str]:
    """The adapters of a LoRA plan (nothing without LoRA)."""
    lo = plan.lora
    if lo is None:
        return []
    n = adapter_params(plan.model, lo)
    return [f"LoRA: rank {lo.rank}, alpha {lo.alpha:g} (scale {lo.scale:g}) on {lo.spec()} of "
            f"every layer (docs/lora.md): {n:,} adapter parameters, resident on the device in "
            f"fp32 with their gradients, AdamW state and a bf16 working copy ({_size(adapter_bytes(plan.model, lo, plan.chunking.chunk_tokens))}); "
            "the base model is frozen whole", *_fp8_base_lines(plan)]


def _fp8_base_lines(plan: Plan) -> list[str]:
    """An fp8 base's storage (Plan.lora.base; nothing for a bf16 base)."""
    lo, cfg = plan.lora, plan.model
    if lo is None or not lo.fp8_base:
        return []
    fp8_b = buffers.block_elems(cfg, lo)["layer"] * 2
    bf16_b = buffers.block_elems(cfg)["layer"] * 2
    dq = region_sizes(cfg, lo, plan.chunking.chunk_tokens)["lora.base_dequant"]
    return [f"  base stored in fp8 (--lora-base fp8): q, k, v, o, gate, up, down as E4M3 codes "
            f"with an fp32 scale per output row, {_size(fp8_b)} a layer against {_size(bf16_b)} "
            f"in bf16 (host, slots and H2D alike); each base GEMM reads a bf16 copy decoded into "
            f"lora.base_dequant ({_size(dq)}); the model trained is the FP8-rounded base plus "
            "the adapters"]


def explain(plan: Plan, update: str = "deferred") -> str:
    """A terminal overview of `plan` and the reason for each decision, the prediction for the
    update mode the run uses (UPDATE_WHERE; the Engine's default, 'deferred', unless told)."""
    if update not in UPDATE_WHERE:
        raise ValueError(f"update={update!r}; choose one of {', '.join(UPDATE_WHERE)}")
    cfg, b = plan.model, plan.budget
    head = (f"Plan for {cfg.name} at seqlen {plan.chunking.seqlen:,} on {plan.profile.name}: "
            f"budgets host {_size(b.host_bytes)}, device {_size(b.device_bytes)} "
            f"[{plan.planner_version}, hash {plan.hash}, grads {plan.grad_accum.value}, "
            f"attention backward {plan.attention_bwd.value}, precision {plan.precision.value}]")
    s = plan.slots
    pr = predict_schedule(plan, plan.profile, update=update)
    lines = [head, *_chunking_lines(plan), *_precision_lines(plan), *_frozen_lines(plan), *_lora_lines(plan),
             (f"Slots: weight {s.weight_slots}, grad {s.grad_slots}, activation {s.act_slots}; "
             f"head sub-chunk {s.head_sub_tokens:,} tokens; optimizer stage "
             f"{s.opt_stage_elems:,} elements"),
             _placement_line(plan), _activation_line(plan), *_memory_lines(plan),
             *_prediction_lines(plan, pr, update), "Why:"]
    lines += [f"  - {r}" for r in _reasons(plan, pr, update)]
    return "\n".join(lines)
