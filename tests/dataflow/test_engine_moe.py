"""The engine trains mixture-of-experts models (issue 41, step 4) on the NumPy backend: its MoE
ops are kernels.reference.moe's block bit for bit; saved levels, streaming and activation homes
change no bit and count each chunk's routing once; a step of R rounds trains the reference
trainer's objective with R micro-batches (each round its own load-balancing and z-loss, their
mean reported and trained); an idle expert is only decayed; the planner counts every expert in
the layer block and routed rows at tokens x top_k; an op table without MoE ops and rings are
refused by name, and the CUDA op table has every op (its GPU tests: test_engine_moe_cuda.py).

Tolerances. The engine and the reference trainer round the residual stream at different places
(the engine adds o_proj's and the FFN's output into the residual in fp32 and rounds once; the
reference rounds each term first), so their layer inputs differ in the last bf16 bit here and
there, and a token whose k-th and (k+1)-th router probabilities are closer than that picks
another expert. On these tiny models that happens in about a third of random draws and moves a
loss or auxiliary value by up to ~0.5 % and the router's or the experts' gradient by up to ~20 %
(one token's row of a 64-row sum, or of an expert's ~10 rows). So losses, aux and z are compared
within ROUTED_RTOL (1 %, the executor tests' bf16 tolerance) and the router's and experts'
gradients within GRAD_RTOL (without a flip they agree to 0.5 %); a wrong auxiliary scale
(coefficient not divided by the rounds) moves the router's by ~90 %. Where no rounding differs,
the tests are exact: the MoE ops against the reference block, plan changes, the routing counts,
an idle expert's update."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from dataflow import ops_numpy
from dataflow.backends.numpy_backend import NumpyBackend
from dataflow.engine import MOE_NO_OPS, Engine
from dataflow.kernels.reference import adamw_step
from dataflow.kernels.reference.moe import MoeWeights, RouterLossTerms, moe_block_bwd, moe_block_fwd
from dataflow.kernels.reference.moe_experts import unpermute_fwd
from dataflow.memplan import get_profile, make_plan
from dataflow.memplan.plan.buffers import (chunk_workspace_specs, moe_rows, packed_bytes,
                                      saved_activation_bytes)
from dataflow.memplan.plan.memory import device_regions, host_regions
from dataflow.memplan.plan.plan import Budget, GradAccum, OptimizerWhere, Where
from dataflow.memplan.search.build import with_segments
from dataflow.moe_ffn import MoeFfn, RoundRouting, stacked_experts
from dataflow.models.config import MoE, ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.flops import SavedLevel, model_flops_per_token
from dataflow.models.init import BF16, init_model
from dataflow.models.layout import ROUTER_TENSOR, expert_names, layer_layout
from dataflow.optimizer import AdamWConfig
from dataflow.reference_trainer import ReferenceTrainer
from tests.dataflow.plans import forced_plan, streamed
from tests.numeric import weights_copy

BASE = dict(vocab_size=53, model_dim=32, head_dim=8, n_layers=2, n_heads=4, n_kv_heads=2,
            ffn_dim=24, rope_theta=1e4, norm_eps=1e-6, qk_norm=True)
CONFIGS = {
    "qwen3_moe": ModelConfig(name="qwen3-moe-tiny", family="qwen3_moe", **BASE, moe=MoE(
        n_experts=6, top_k=2, expert_ffn_dim=12, norm_topk_prob=True, router_aux_loss_coef=1.0,
        router_z_loss_coef=0.1)),
    "olmoe": ModelConfig(name="olmoe-tiny", family="olmoe", **BASE, moe=MoE(
        n_experts=5, top_k=2, expert_ffn_dim=16, norm_topk_prob=False,
        router_aux_loss_coef=0.8)),
}
"""Qwen3-MoE (renormalised top-k, per-head QK-norm, a z-loss) and OLMoE (raw top-k weights,
QK-norm over the whole projection, no z-loss). The auxiliary coefficients are far above the
released ones (0.001, 0.01) so that their share of the router's gradient shows."""
ROUTED_RTOL = 1e-2
GRAD_RTOL = 0.3
LR, BETA1 = 1e-3, 0.9
SEQLEN = 8
ROUNDS = dict(chunk_tokens=16, seqs_per_chunk=2, chunks_per_round=2, rounds=2)
"""Two rounds of two chunks of two 8-token sequences: 32 tokens a round, 8 rows a step."""


def _weights(cfg, rng):
    """A seeded init with every norm weight 1 + 0.2 N(0, 1), so their gradients are generic."""
    w = init_model(cfg, int(rng.integers(0, 2**31)))
    lay = layer_layout(cfg)
    for block in w.layers:
        for t in lay.tensors:
            if t.name.endswith(("_norm", "layernorm")):
                lay.view(block, t.name)[...] = (1 + 0.2 * rng.standard_normal(t.shape)).astype(BF16)
    return w


def _engine(plan, w, weight_decay: float = 0.0):
    """The plan on the NumPy backend under the schedule sanitizer, AdamW as the reference's."""
    return Engine.from_plan(plan, backend="numpy", weights=w, sanitize=True, lr=LR,
                            betas=(BETA1, 0.95), weight_decay=weight_decay, max_grad_norm=None)


def _blocks(w):
    return [w.embed, *w.layers, w.head]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_engine_trains_the_reference_objective_with_one_micro_batch_per_round(family, rng):
    """Engine (sanitizer on) against the reference trainer with micro_batches = the plan's
    rounds: step-1 loss, aux and z, the router's and the experts' step-1 gradients (AdamW's m /
    (1 - beta1)), and three AdamW steps' losses and aux agree (tolerances: module docstring);
    the routing totals left on the device are the last round's alone (tokens x k x layers
    pairs: cleared every round, never counted again by a recompute)."""
    cfg = CONFIGS[family]
    w = _weights(cfg, rng)
    plan = forced_plan(cfg, SEQLEN, grad_accum=GradAccum.FP32, **ROUNDS)
    batches = [rng.integers(0, cfg.vocab_size, (8, SEQLEN + 1)) for _ in range(3)]
    ref = ReferenceTrainer(cfg, weights_copy(w), lr=LR, betas=(BETA1, 0.95), micro_batches=2)
    _, _, grads = ref.accumulate_grads(batches[0])
    with _engine(plan, w) as eng:
        results = [eng.train_step(batches[0])]
        state = eng.state_dict()
        counts = eng.ex.download(eng.ex.tr["moe_counts"])
        results += [eng.train_step(b) for b in batches[1:]]
    want = [ref.train_step(b) for b in batches]
    assert int(counts.sum()) == plan.chunking.tokens_per_round * cfg.moe.top_k * cfg.n_layers
    for got, exp in zip(results, want):
        np.testing.assert_allclose(got.loss, exp.loss_mean, rtol=ROUTED_RTOL)
        np.testing.assert_allclose(got.aux_loss, exp.aux_loss, rtol=ROUTED_RTOL)
        np.testing.assert_allclose(got.z_loss, exp.z_loss, rtol=ROUTED_RTOL)
    lay = layer_layout(cfg)
    experts = [n for e in range(cfg.moe.n_experts) for n in expert_names(e)]
    for layer in range(cfg.n_layers):
        for names in ([ROUTER_TENSOR], experts):
            ours = np.concatenate([state[f"optimizer.{lay.full_name(n, layer)}.exp_avg"].ravel()
                                   for n in names]).astype(np.float64) / (1 - BETA1)
            true = np.concatenate([lay.view(grads[1 + layer], n).ravel() for n in names])
            err = np.linalg.norm(ours - true) / np.linalg.norm(true)
            assert err <= GRAD_RTOL, (layer, names[0], err)
    assert results[0].flop_model_version.startswith("mldf-1-moe")


def test_saved_levels_streaming_homes_and_segments_change_no_bit(rng):
    """A Qwen3-MoE on every layer resident at FULL; streamed (weights, grads and AdamW at home)
    at INP_ONLY / INP_ATTN with activations at home; and that plan with both layers in one
    recompute segment: the same losses, aux, z and weights bit for bit after two steps. The
    recompute and the segment re-run form the routing again exactly and add nothing to the
    round's totals."""
    cfg = CONFIGS["qwen3_moe"]
    w = _weights(cfg, rng)
    n = cfg.n_layers
    levels = forced_plan(cfg, SEQLEN, layers=(streamed(OptimizerWhere.STREAMED),) * n,
                         levels=[[SavedLevel.INP_ONLY, SavedLevel.INP_ATTN]] * n,
                         homes=[[Where.HOME, Where.DEVICE]] * n, act_slots=1, **ROUNDS)
    big = with_segments(levels, n, Budget(host_bytes=1 << 32, device_bytes=1 << 32))
    segments = with_segments(levels, n, Budget(
        host_bytes=big.memory.host_bytes,
        device_bytes=big.memory.device_bytes + levels.profile.library_reserve_bytes))
    assert segments.segment_layers == n
    plans = [forced_plan(cfg, SEQLEN, **ROUNDS), levels, segments]
    batches = [rng.integers(0, cfg.vocab_size, (8, SEQLEN + 1)) for _ in range(2)]
    runs = []
    for plan in plans:
        with _engine(plan, w, weight_decay=0.01) as eng:
            res = [eng.train_step(b) for b in batches]
            runs.append(([(r.loss, r.aux_loss, r.z_loss) for r in res], _blocks(eng.weights())))
    for losses, weights in runs[1:]:
        assert losses == runs[0][0]
        for a, b in zip(weights, runs[0][1]):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_split_sequences_track_the_reference(rng):
    """OLMoE with 16-token sequences split into two 8-token chunks (the second attends to the
    first's K/V), one sequence a round, two rounds: step-1 loss and aux as the reference
    trainer's with two micro-batches (ROUTED_RTOL)."""
    cfg = CONFIGS["olmoe"]
    w = _weights(cfg, rng)
    plan = forced_plan(cfg, 16, chunk_tokens=8, chunks_per_seq=2, chunks_per_round=2, rounds=2,
                       levels=[[SavedLevel.INP_ONLY, SavedLevel.FULL]] * cfg.n_layers)
    batch = rng.integers(0, cfg.vocab_size, (2, 17))
    with _engine(plan, w) as eng:
        got = eng.train_step(batch)
    want = ReferenceTrainer(cfg, weights_copy(w), lr=LR, betas=(BETA1, 0.95),
                            micro_batches=2).train_step(batch)
    np.testing.assert_allclose([got.loss, got.aux_loss], [want.loss_mean, want.aux_loss],
                               rtol=ROUTED_RTOL)


def test_a_round_where_experts_get_no_token(rng):
    """OLMoE-like, 10 experts, top 1, rounds of 4 tokens: every round leaves at least 6 experts
    of each layer without a token (the round's counts show it). The engine's loss still tracks
    the reference trainer's; an expert no round reached has zero AdamW moments and its weights
    only decayed, bit for bit what AdamW makes of a zero gradient."""
    cfg = dataclasses.replace(CONFIGS["olmoe"], moe=dataclasses.replace(
        CONFIGS["olmoe"].moe, n_experts=10, top_k=1))
    w = _weights(cfg, rng)
    plan = forced_plan(cfg, 4, chunk_tokens=4, rounds=2, grad_accum=GradAccum.FP32)
    batch = rng.integers(0, cfg.vocab_size, (2, 5))
    wd = 0.1
    with _engine(plan, w, weight_decay=wd) as eng:
        res = eng.train_step(batch)
        counts = eng.ex.download(eng.ex.tr["moe_counts"])
        state = eng.state_dict()
    assert int(counts.sum()) == 4 * cfg.n_layers and int((counts == 0).sum()) >= 2
    want = ReferenceTrainer(cfg, weights_copy(w), lr=LR, betas=(BETA1, 0.95), weight_decay=wd,
                            micro_batches=2).train_step(batch)
    # the loss only: with 8 rows a round, one flipped token moves aux by N * dP / 8 (a few %)
    np.testing.assert_allclose(res.loss, want.loss_mean, rtol=ROUTED_RTOL)
    def same_bits(key, got, want):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), key

    idle = idle_experts_only_decayed(cfg, w, state, wd, same_bits)
    assert idle >= 2 * cfg.n_layers  # 8 (token, slot) pairs a layer over 10 experts


def idle_experts_only_decayed(cfg, w, state, wd: float, same) -> int:
    """How many experts of the engine's `state_dict()` after one step from weights `w` no token
    reached (zero first moments); each must have a zero second moment and its weights where
    one decay-only AdamW step (zero gradient) puts them: same(key, got, expected) checks that."""
    lay = layer_layout(cfg)
    idle = 0
    for layer in range(cfg.n_layers):
        for e in range(cfg.moe.n_experts):
            keys = [lay.full_name(n, layer) for n in expert_names(e)]
            if any(np.any(state[f"optimizer.{k}.exp_avg"]) for k in keys):
                continue
            idle += 1
            for name, key in zip(expert_names(e), keys):
                p = lay.view(w.layers[layer], name).copy()
                zero = np.zeros(p.shape, np.float32)
                adamw_step(p, zero, np.zeros_like(p), np.zeros_like(p), step=1, lr=LR,
                           beta1=BETA1, beta2=0.95, eps=1e-8, weight_decay=wd)
                same(key, state[key], p)
                assert not np.any(state[f"optimizer.{key}.exp_avg_sq"]), key
    return idle


def test_moe_ops_are_the_reference_block_bit_for_bit(rng):
    """The op table's MoE ops as dataflow.moe_ffn launches them, on random bf16 inputs, give
    kernels.reference.moe's routing, expert rows, input gradient and weight gradients (into
    zeroed fp32 grads) bit for bit; the combine adds the reference's unrounded fp32 sum onto
    the residual and rounds once (the reference rounds the sum, then the residual add)."""
    cfg = CONFIGS["qwen3_moe"]
    m, t, d = cfg.moe, 12, cfg.model_dim
    lay = layer_layout(cfg)
    flat = (0.3 * rng.standard_normal(lay.numel)).astype(BF16)
    gflat = np.zeros(lay.numel, np.float32)
    w, g = lay.views(flat), lay.views(gflat)
    w.update(stacked_experts(lay, flat, m.n_experts))
    g.update(stacked_experts(lay, gflat, m.n_experts))
    ws = {s.name: np.zeros(s.shape, {"bf16": BF16, "f32": np.float32, "i64": np.int64}[s.dtype])
          for s in chunk_workspace_specs(cfg, t)}
    x = rng.standard_normal((t, d)).astype(BF16)
    h = rng.standard_normal((t, d)).astype(BF16)
    dy = rng.standard_normal((t, d)).astype(BF16)

    def op(name, *args, tag=""):
        getattr(ops_numpy, name)(*args)

    ffn, out = MoeFfn(cfg, ws), h.copy()
    routing = RoundRouting(counts=np.zeros(m.n_experts, np.int64),
                           sums=np.zeros(m.n_experts + 1, np.float32), aux_coef=0.15,
                           z_coef=0.01, n_rows=5 * t)
    mt = ffn.tensors(None, t)
    ffn.forward(op, w, x, mt, out, routing)
    mw = MoeWeights(router=w[ROUTER_TENSOR], gate=w["experts.gate"], up=w["experts.up"],
                    down=w["experts.down"])
    y, saved, stats = moe_block_fwd(x, mw, top_k=m.top_k, norm_topk_prob=m.norm_topk_prob)
    for name, ref in (("router_logits", saved.logits), ("router_probs", saved.probs),
                      ("topk_idx", saved.topk_idx), ("topk_weight", saved.topk_weight),
                      ("expert_order", saved.order), ("expert_offsets", saved.offsets),
                      ("expert_gate", saved.gate), ("expert_up", saved.up),
                      ("expert_out", saved.yp)):
        assert np.array_equal(mt[name], ref.astype(mt[name].dtype)), name
    assert np.array_equal(routing.counts, stats.counts)
    y32 = unpermute_fwd(saved.yp.astype(np.float32), saved.order, saved.topk_weight)
    assert np.array_equal(out.view(np.uint16), (h.astype(np.float32) + y32).astype(BF16).view(
        np.uint16))  # the reference's combine sum in fp32, onto the residual, rounded once
    assert np.array_equal(y, y32.astype(BF16))
    dxn = np.zeros((t, d), BF16)
    ffn.backward(op, w, g, x, mt, dy, dxn, routing, permuted=False)
    terms = RouterLossTerms(aux_coef=0.15, aux_counts=stats.counts.astype(np.int64),
                            aux_rows=5 * t, z_coef=0.01, z_rows=5 * t)
    dx, grads = moe_block_bwd(x, mw, saved, dy, terms)
    assert np.array_equal(dxn.view(np.uint16), dx.view(np.uint16))
    for key, ref in ((ROUTER_TENSOR, grads.router), ("experts.gate", grads.gate),
                     ("experts.up", grads.up), ("experts.down", grads.down)):
        assert np.array_equal(g[key], ref.astype(np.float32)), key


def test_plan_counts_every_expert_and_routed_rows_at_tokens_times_k():
    """Resident and streamed layers take the layout's whole layer block (router and every
    expert) for weights, grads and AdamW state; FULL activations and the chunk workspace hold
    the routed rows at tokens x top_k (dropless: one expert may get them all); the prediction's
    model FLOPs are the active ones."""
    cfg = CONFIGS["qwen3_moe"]
    lay, t = layer_layout(cfg), ROUNDS["chunk_tokens"]
    layer_bytes = lay.numel * 2
    assert lay.numel >= cfg.layer_params
    resident = forced_plan(cfg, SEQLEN, grad_accum=GradAccum.FP32, **ROUNDS)
    dev = dict(device_regions(resident))
    for i in range(cfg.n_layers):
        assert dev[f"layer{i}.weights"] == layer_bytes
        assert dev[f"layer{i}.grads"] == 2 * layer_bytes  # fp32 accumulation
        assert dev[f"layer{i}.m"] == dev[f"layer{i}.v"] == layer_bytes
    home = forced_plan(cfg, SEQLEN, layers=(streamed(OptimizerWhere.STREAMED),) * cfg.n_layers,
                       weight_slots=2, **ROUNDS)
    dev, host = dict(device_regions(home)), dict(host_regions(home))
    assert dev["weight_slots"] == 2 * layer_bytes and dev["grad_slots"] == layer_bytes
    assert host["home.layer1.weights"] == host["home.layer1.m"] == layer_bytes
    r, f, n = moe_rows(cfg, t), cfg.moe.expert_ffn_dim, cfg.moe.n_experts
    assert r == t * cfg.moe.top_k
    full = saved_activation_bytes(cfg, t, SavedLevel.FULL)
    dense = saved_activation_bytes(dataclasses.replace(
        cfg, family="qwen3", moe=None, ffn_dim=1), t, SavedLevel.FULL)
    routed = 2 * r * f * 2 + r * cfg.model_dim * 2 + r * 8 + (n + 1) * 8 \
        + 2 * t * n * 4 + t * cfg.moe.top_k * (8 + 4)  # int64 indices, fp32 weights
    assert full - dense >= routed and full - dense < routed + 12 * 256
    ws = {s.name: s.shape for s in chunk_workspace_specs(cfg, t)}
    assert ws["expert_in"] == (r, cfg.model_dim) and ws["expert_act"] == (r, f)
    assert "gate" not in ws  # no dense (T, ffn_dim) buffers
    assert dev["workspace"] >= packed_bytes(chunk_workspace_specs(cfg, t))
    plan = make_plan(cfg, 64, Budget.from_gib(1, 0.5), get_profile("cpu"))
    pr = plan.prediction
    np.testing.assert_allclose(pr.model_tflop_per_s * 1e12 / pr.tok_per_s,
                               model_flops_per_token(cfg, 64), rtol=1e-9)


def test_a_backend_without_moe_ops_and_rings_refuse_moe_by_name():
    """An MoE model on a backend whose op table has no MoE ops is refused before anything
    starts, naming the backends that have them; a backend asked for by name is not refused
    (both tables have the ops); a ring of 2 or more is refused by the ring planner, naming rings
    and issue 41 (data-parallel replicas, rings of 1, train it: tests/ring/test_ring_moe.py)."""
    from dataflow.engine import refuse_moe_backend
    from dataflow.memplan.search.ring_plan import make_rank_plans

    cfg = CONFIGS["olmoe"]
    for kind in ("numpy", "cupy", "auto"):
        refuse_moe_backend(cfg, kind)

    class NoMoeOps(NumpyBackend):
        name = "fake"

        def __init__(self):
            super().__init__()
            self.writes = {k: v for k, v in self.writes.items() if not k.startswith("moe_")}

    plan = forced_plan(cfg, SEQLEN, **ROUNDS)
    with pytest.raises(ConfigError, match=re.escape(MOE_NO_OPS)):
        Engine.from_plan(plan, backend=NoMoeOps())
    with pytest.raises(ConfigError, match="fake backend: this backend's op table has no MoE ops"):
        Engine(cfg, host_gb=1, dev_gb=0.5, seqlen=SEQLEN, backend=NoMoeOps())
    cpu, budget = get_profile("cpu"), Budget.from_gib(1, 0.5)
    rps = make_rank_plans(cfg, SEQLEN, budget, cpu, n_ranks=2)  # rings pass routing totals
    assert [rp.plan.model.moe for rp in rps] == [cfg.moe, cfg.moe]


def test_executor_lends_the_cuda_moe_scratch_from_its_arenas(rng):
    """The executor lends the op table the MoE scratch the planner counted: chunk-workspace
    views (buffers.MOE_OP_SCRATCH) and the pinned host region of the offsets, int64 (N + 1,),
    which the host memory map holds; dataflow.ops_cuda's MoE ops use them instead of allocating
    (the NumPy table ignores them)."""
    from dataflow.memplan.plan.buffers import MOE_HOST_REGION, MOE_OP_SCRATCH, align

    cfg, lent = CONFIGS["olmoe"], {}
    n = cfg.moe.n_experts

    class Lending(NumpyBackend):
        def lend_scratch(self, scratch):
            lent.update(scratch)

    plan = forced_plan(cfg, SEQLEN, **ROUNDS)
    assert dict(host_regions(plan))[MOE_HOST_REGION] == align((n + 1) * 8)
    with Engine.from_plan(plan, backend=Lending(), weights=_weights(cfg, rng)) as eng:
        for name in MOE_OP_SCRATCH:
            assert lent[name] is eng.ex.ws[name], name
        host = lent["moe_offsets_host"]
        assert host.dtype == np.int64 and host.shape == (n + 1,)
        assert np.shares_memory(host, eng.ex.host.slab.handle)
        eng.train_step(rng.integers(0, cfg.vocab_size, (8, SEQLEN + 1)))


def test_cuda_op_table_defines_every_op_of_the_numpy_table():
    """The CUDA op table (dataflow/ops_cuda.py's CudaOps with its MoE mixin in ops_cuda_moe.py)
    defines every op the NumPy table declares, the MoE ones included, with the same parameter
    names: read from the sources, since CI has no CuPy to import them. This is what lets
    refuse_moe_backend pass the CuPy backend."""
    import ast
    import inspect
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    defined: dict[str, list[str] | None] = {}
    for rel, cls in (("dataflow/ops_cuda_moe.py", "MoeOps"), ("dataflow/ops_cuda.py", "CudaOps")):
        tree = ast.parse((root / rel).read_text())
        for node in tree.body:  # kernels CudaOps binds to its context (_BOUND, MOE_BOUND)
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in (
                    "_BOUND", "MOE_BOUND"):
                for const in ast.walk(node.value):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        defined.setdefault(const.value, None)
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        for node in body:
            if isinstance(node, ast.FunctionDef):
                names = [a.arg for a in node.args.args]
                defined[node.name] = names[1:] if names[:1] == ["self"] else names
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    defined[getattr(target, "id", "")] = None  # a kernel bound as staticmethod
    # the vocabulary-parallel head's ops exist on NumPy only (refused by name elsewhere)
    missing = sorted(set(ops_numpy.WRITES) - set(defined)
                     - {"vocab_grad", "vocab_loss", "vocab_merge", "vocab_stats"})
    assert not missing, f"CudaOps lacks {missing}"
    for name in ops_numpy.WRITES:
        if name.startswith("moe_") and defined[name] is not None:
            want = list(inspect.signature(getattr(ops_numpy, name)).parameters)
            assert defined[name] == want, name


def test_host_side_evaluation_runs_the_moe_block(rng):
    """dataflow.host_forward (held-out loss and logits on the host, through the reference's own
    layer) evaluates an MoE model: its loss is the reference model's on the engine's weights
    (the same code, bit for bit) and within routing-flip tolerance of the engine's evaluation."""
    from dataflow import reference_model
    from dataflow.host_forward import eval_loss, logits

    cfg = CONFIGS["qwen3_moe"]
    w = _weights(cfg, rng)
    plan = forced_plan(cfg, SEQLEN, **ROUNDS)
    tokens = rng.integers(0, cfg.vocab_size, (8, SEQLEN + 1))
    with _engine(plan, w) as eng:
        host = eval_loss(eng, tokens)
        ours = eng.eval_step(tokens)
        out = logits(eng, tokens[:2, :-1])
    total = count = 0.0
    for row in tokens:
        f = reference_model.forward(cfg, w, row)
        total, count = total + f.loss_sum, count + f.n_tokens
    assert host == total / count
    np.testing.assert_allclose(host, ours, rtol=ROUTED_RTOL)
    assert out.shape == (2, SEQLEN, cfg.vocab_size) and np.isfinite(out).all()
