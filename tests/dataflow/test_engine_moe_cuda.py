"""The engine trains mixture-of-experts models on the CuPy backend (issue 41) as it does on the
NumPy backend: the CUDA op table's MoE ops (dataflow/ops_cuda_moe.py), launched as
dataflow.moe_ffn launches them, against the NumPy table's and a float64 truth; whole engines on
both backends with the same fresh random weights and batches, for both families; an expert that
receives no token; saved levels, streamed weights at home and segments changing no bit on the GPU.
GPU only (every test is marked `gpu` and the module skips without CuPy or a device):

    python -m pytest -q -m gpu tests/dataflow/test_engine_moe_cuda.py

Shapes: tests/dataflow/test_engine_moe.py's two tiny configs (Qwen3-MoE: 6 experts, top 2,
renormalised, a z-loss; OLMoE: 5 experts, top 2, raw weights), widened to head_dim 16 (model dim
64), the head width the CuPy engine's other GPU tests (the 'tiny' model) run cuDNN's attention at.

Tolerances. Routing is discontinuous: the two backends' layer inputs differ by bf16 rounding
(cuBLAS and cuDNN against NumPy), so a token whose k-th and (k+1)-th router probabilities are that
close may pick another expert on one backend. Such a flip moves one token's FFN output, which
moves the mean LM loss of a step by about 1e-4 (inside STEP1_RTOL) but the load-balancing loss,
whose counts change by one pair, by up to about 1e-3 of its value: so aux is compared within
ROUTED_RTOL (the NumPy engine tests' bf16 tolerance), as are the losses of later AdamW steps.
The z-loss is continuous in the logits (STEP1_RTOL). The op-level test draws a router whose
choices have a margin, so there the routing is compared exactly and the values by STYLE §7's rule
(at most twice the NumPy table's error against float64)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu import require_gpu  # noqa: E402

cp = require_gpu()

from dataflow import ops_numpy  # noqa: E402
from dataflow.engine import Engine  # noqa: E402
from dataflow.kernels.reference import moe_router as rrt  # noqa: E402
from dataflow.kernels.reference.moe import (MoeWeights, RouterLossTerms, moe_block_bwd,  # noqa: E402
                                            moe_block_fwd)
from dataflow.memplan.plan.buffers import MOE_OP_SCRATCH, chunk_workspace_specs  # noqa: E402
from dataflow.memplan.plan.plan import Budget, GradAccum, OptimizerWhere, Where  # noqa: E402
from dataflow.memplan.search.build import with_segments  # noqa: E402
from dataflow.moe_ffn import EXPERT_STACKS, MoeFfn, RoundRouting, stacked_experts  # noqa: E402
from dataflow.models.flops import SavedLevel  # noqa: E402
from dataflow.models.init import BF16  # noqa: E402
from dataflow.models.layout import ROUTER_TENSOR, expert_names, layer_layout  # noqa: E402
from tests.dataflow.plans import forced_plan, streamed  # noqa: E402
from tests.dataflow.test_engine_moe import (BETA1, CONFIGS, LR, ROUNDS, ROUTED_RTOL,  # noqa: E402
                                            SEQLEN, _weights, idle_experts_only_decayed)
from tests.gpu import check_close, dev, host  # noqa: E402

CFGS = {family: dataclasses.replace(cfg, name=f"{cfg.name}-gpu", model_dim=64, head_dim=16)
        for family, cfg in CONFIGS.items()}
STEP1_RTOL = 1e-3
STEPS = 4
F32, I64 = np.dtype(np.float32), np.dtype(np.int64)


def _train(plan, w, backend: str, batches, weight_decay: float = 0.0):
    """(step results, the last round's routing counts, state_dict, bytes of op scratch the CuPy
    table allocated outside the arena) of `batches` on `backend`, AdamW as the NumPy tests'."""
    with Engine.from_plan(plan, backend=backend, weights=w, lr=LR, betas=(BETA1, 0.95),
                          weight_decay=weight_decay, max_grad_norm=None) as eng:
        results = [eng.train_step(b) for b in batches]
        counts = eng.ex.download(eng.ex.tr["moe_counts"])
        state = eng.state_dict()
        outside = eng.be.ops.library_workspace_bytes() if backend == "cupy" else 0
    return results, counts, state, outside


@pytest.mark.parametrize("family", sorted(CFGS))
def test_cupy_engine_trains_moe_as_the_numpy_engine(family, rng):
    """Two rounds of two chunks, fp32 gradient accumulation: the CuPy engine's step-1 LM loss and
    z-loss within STEP1_RTOL of the NumPy engine's, its aux loss and the losses of four AdamW
    steps within ROUTED_RTOL (module docstring); the routing totals on the device are int64 and
    the last round's alone; no op scratch was allocated outside the arena."""
    cfg = CFGS[family]
    w = _weights(cfg, rng)
    plan = forced_plan(cfg, SEQLEN, grad_accum=GradAccum.FP32, **ROUNDS)
    batches = [rng.integers(0, cfg.vocab_size, (8, SEQLEN + 1)) for _ in range(STEPS)]
    gpu, counts, _, outside = _train(plan, w, "cupy", batches)
    cpu, _, _, _ = _train(plan, w, "numpy", batches)
    assert outside == 0
    assert counts.dtype == I64
    assert int(counts.sum()) == plan.chunking.tokens_per_round * cfg.moe.top_k * cfg.n_layers
    g, c = gpu[0], cpu[0]
    assert np.isfinite([g.loss, g.aux_loss, g.z_loss]).all() and g.aux_loss > 0
    np.testing.assert_allclose(g.loss, c.loss, rtol=STEP1_RTOL)
    np.testing.assert_allclose(g.z_loss, c.z_loss, rtol=STEP1_RTOL)
    np.testing.assert_allclose(g.aux_loss, c.aux_loss, rtol=ROUTED_RTOL)
    np.testing.assert_allclose([r.loss for r in gpu], [r.loss for r in cpu], rtol=ROUTED_RTOL)
    np.testing.assert_allclose([r.aux_loss for r in gpu], [r.aux_loss for r in cpu],
                               rtol=ROUTED_RTOL)
    assert gpu[0].flop_model_version.startswith("mldf-1-moe")


def test_cupy_engine_with_experts_that_get_no_token(rng):
    """OLMoE-like, 10 experts, top 1, rounds of 4 tokens: every step leaves experts of each
    layer without a token (the counts show it). The CuPy engine's loss tracks the NumPy engine's
    (ROUTED_RTOL: one flipped token is an eighth of the rows here); an expert no round reached
    has zero AdamW moments on the GPU and its weights only decayed (within one bf16 ulp of what
    the reference AdamW makes of a zero gradient: the CUDA AdamW kernel rounds on its own)."""
    cfg = dataclasses.replace(CFGS["olmoe"], moe=dataclasses.replace(
        CFGS["olmoe"].moe, n_experts=10, top_k=1))
    w = _weights(cfg, rng)
    plan = forced_plan(cfg, 4, chunk_tokens=4, rounds=2, grad_accum=GradAccum.FP32)
    batches = [rng.integers(0, cfg.vocab_size, (2, 5))]
    wd = 0.1
    gpu, counts, state, outside = _train(plan, w, "cupy", batches, weight_decay=wd)
    cpu, _, _, _ = _train(plan, w, "numpy", batches, weight_decay=wd)
    assert outside == 0
    assert int(counts.sum()) == 4 * cfg.n_layers and int((counts == 0).sum()) >= 2
    np.testing.assert_allclose(gpu[0].loss, cpu[0].loss, rtol=ROUTED_RTOL)
    def within_an_ulp(key, got, want):  # one bf16 ulp at most
        np.testing.assert_allclose(got.astype(F32), want.astype(F32), rtol=2.0**-7, err_msg=key)

    idle = idle_experts_only_decayed(cfg, w, state, wd, within_an_ulp)
    assert idle >= 2 * cfg.n_layers  # 8 (token, slot) pairs a layer a step over 10 experts


def test_cupy_levels_streaming_homes_and_segments_change_no_bit(rng):
    """Qwen3-MoE on the GPU: every layer resident at FULL; streamed from the host (weights,
    grads and AdamW state at HOME) at INP_ONLY / INP_ATTN with activations at home; that plan
    with both layers in one recompute segment: the same losses and weights bit for bit after
    two steps (the recomputes re-run the same kernels on the same shapes). The streamed plan
    also tracks the NumPy engine on the same plan (step 1 within STEP1_RTOL, aux and step 2
    within ROUTED_RTOL)."""
    cfg = CFGS["qwen3_moe"]
    w = _weights(cfg, rng)
    n = cfg.n_layers
    levels = forced_plan(cfg, SEQLEN, layers=(streamed(OptimizerWhere.STREAMED),) * n,
                         levels=[[SavedLevel.INP_ONLY, SavedLevel.INP_ATTN]] * n,
                         homes=[[Where.HOME, Where.DEVICE]] * n, act_slots=1, **ROUNDS)
    assert all(p.weights is Where.HOME for p in levels.layers)
    big = with_segments(levels, n, Budget(host_bytes=1 << 32, device_bytes=1 << 32))
    segments = with_segments(levels, n, Budget(
        host_bytes=big.memory.host_bytes,
        device_bytes=big.memory.device_bytes + levels.profile.library_reserve_bytes))
    assert segments.segment_layers == n
    batches = [rng.integers(0, cfg.vocab_size, (8, SEQLEN + 1)) for _ in range(2)]
    runs = []
    for plan in (forced_plan(cfg, SEQLEN, **ROUNDS), levels, segments):
        res, _, state, outside = _train(plan, w, "cupy", batches, weight_decay=0.01)
        assert outside == 0
        runs.append(([(r.loss, r.aux_loss, r.z_loss) for r in res], state))
    for losses, state in runs[1:]:
        assert losses == runs[0][0]
        for key, value in runs[0][1].items():
            a, b = np.atleast_1d(value), np.atleast_1d(state[key])
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), key
    cpu, _, _, _ = _train(levels, w, "numpy", batches, weight_decay=0.01)
    gpu = runs[1][0]
    np.testing.assert_allclose(gpu[0][0], cpu[0].loss, rtol=STEP1_RTOL)
    np.testing.assert_allclose(gpu[0][1], cpu[0].aux_loss, rtol=ROUTED_RTOL)
    np.testing.assert_allclose(gpu[1][0], cpu[1].loss, rtol=ROUTED_RTOL)


# ------------------------------------------------------------------------------- the op table

def _layer(cfg, rng, x):
    """A random layer block (bf16) whose router gives every token of x a margin of 1e-5 between
    its k-th and (k + 1)-th probabilities (float64), so both tables route alike."""
    lay, m, d = layer_layout(cfg), cfg.moe, cfg.model_dim
    flat = (rng.standard_normal(lay.numel) / math.sqrt(d)).astype(BF16)
    router = lay.view(flat, ROUTER_TENSOR)
    for _ in range(100):
        router[...] = (rng.standard_normal(router.shape) / math.sqrt(d)).astype(BF16)
        p = rrt.router_fwd(x.astype(np.float64), router.astype(np.float64), m.top_k,
                           norm_topk_prob=m.norm_topk_prob)[1]
        p = -np.sort(-p, axis=1)
        if np.min(p[:, m.top_k - 1] - p[:, m.top_k]) > 1e-5:
            return flat
    pytest.skip("no router with a routing margin drawn")  # not expected at these shapes


def _views(lay, flat, n_experts):
    v = lay.views(flat)
    v.update(stacked_experts(lay, flat, n_experts))
    return v


@pytest.mark.parametrize("family", sorted(CFGS))
def test_cuda_moe_ops_match_the_numpy_table_through_moe_ffn(family, rng):
    """dataflow.moe_ffn's forward and backward of one chunk, launched on the CUDA op table with
    the executor's lent scratch (chunk workspace and pinned host offsets), against the NumPy
    table's (bit for bit kernels.reference.moe's block) and a float64 truth: routing, order,
    offsets and counts exact; the residual plus the FFN output, the input gradient and the
    router's and experts' gradients within STYLE §7's bound; nothing allocated outside the lent
    scratch. The combine on the same inputs is the NumPy table's bit for bit (fp32 sum in slot
    order, added onto the residual, rounded once)."""
    import cupyx

    from dataflow.ops_cuda import CudaOps

    cfg = CFGS[family]
    m, t, d = cfg.moe, 24, cfg.model_dim
    lay = layer_layout(cfg)
    x = rng.standard_normal((t, d)).astype(BF16)
    h = rng.standard_normal((t, d)).astype(BF16)
    dy = rng.standard_normal((t, d)).astype(BF16)
    flat = _layer(cfg, rng, x)
    terms = dict(aux_coef=0.15, z_coef=0.01, n_rows=5 * t)
    specs = chunk_workspace_specs(cfg, t)
    np_dtype = {"bf16": BF16, "f32": F32, "i64": I64}

    def run(ops, xp):
        """(table's tensors, out, dxn, grads, counts) on one table; xp: numpy or cupy."""
        on = (lambda a: a) if xp is np else dev
        ws = {s.name: xp.zeros(s.shape, np_dtype[s.dtype]) if s.dtype != "bf16"
              else on(np.zeros(s.shape, BF16)) for s in specs}
        if xp is cp:
            ops.lend_scratch({**{n: ws[n] for n in MOE_OP_SCRATCH},
                              "moe_offsets_host": cupyx.empty_pinned((m.n_experts + 1,), I64)})
        w = _views(lay, on(flat), m.n_experts)
        g = _views(lay, xp.zeros(lay.numel, F32), m.n_experts)
        routing = RoundRouting(counts=xp.zeros(m.n_experts, I64),
                               sums=xp.zeros(m.n_experts + 1, F32), **terms)

        def op(name, *args, tag=""):
            getattr(ops, name)(*args)

        ffn, out, dxn = MoeFfn(cfg, ws), on(h.copy()), on(np.zeros((t, d), BF16))
        mt = ffn.tensors(None, t)
        ffn.forward(op, w, on(x), mt, out, routing)
        ffn.backward(op, w, g, on(x), mt, on(dy), dxn, routing, permuted=False)
        get = (lambda a: np.array(a)) if xp is np else host
        return ({k: get(v) for k, v in mt.items()}, get(out), get(dxn),
                {k: get(g[k]) for k in (ROUTER_TENSOR, *EXPERT_STACKS)}, get(routing.counts))

    cuda_ops = CudaOps()
    mt_g, out_g, dxn_g, g_g, counts_g = run(cuda_ops, cp)
    mt_n, out_n, dxn_n, g_n, counts_n = run(ops_numpy, np)
    assert cuda_ops.library_workspace_bytes() == 0
    for name in ("topk_idx", "expert_order", "expert_offsets"):
        assert np.array_equal(mt_g[name], mt_n[name]), name
    assert np.array_equal(counts_g, counts_n)

    w64 = {k: v.astype(np.float64) for k, v in _views(lay, flat, m.n_experts).items()}
    mw = MoeWeights(router=w64[ROUTER_TENSOR], gate=w64["experts.gate"], up=w64["experts.up"],
                    down=w64["experts.down"])
    y_t, saved_t, stats_t = moe_block_fwd(x.astype(np.float64), mw, top_k=m.top_k,
                                          norm_topk_prob=m.norm_topk_prob)
    check_close("moe out (residual + FFN)", out_g, h.astype(np.float64) + y_t, out_n)
    loss_terms = RouterLossTerms(aux_coef=terms["aux_coef"],
                                 aux_counts=stats_t.counts.astype(np.int64),
                                 aux_rows=terms["n_rows"], z_coef=terms["z_coef"],
                                 z_rows=terms["n_rows"])
    dx_t, grads_t = moe_block_bwd(x.astype(np.float64), mw, saved_t, dy.astype(np.float64),
                                  loss_terms)
    check_close("moe dx", dxn_g, dx_t, dxn_n)
    for key, truth in ((ROUTER_TENSOR, grads_t.router), ("experts.gate", grads_t.gate),
                       ("experts.up", grads_t.up), ("experts.down", grads_t.down)):
        check_close(f"moe grad {key}", g_g[key], truth, g_n[key])

    # the combine alone, on the NumPy table's own expert rows: the same bits
    out = h.copy()
    ops_numpy.moe_combine(mt_n["expert_out"], mt_n["expert_order"], mt_n["topk_weight"], out)
    out_d = dev(h)
    cuda_ops.moe_combine(dev(mt_n["expert_out"]), dev(mt_n["expert_order"]),
                         dev(mt_n["topk_weight"]), out_d)
    assert np.array_equal(host(out_d).view(np.uint16), out.view(np.uint16))


def test_stacked_expert_views_alias_a_cupy_layer_block(rng):
    """dataflow.moe_ffn.stacked_experts on a CuPy block: each expert's matrix is a view at its
    layout offset (no copy), so the expert ops read the block and accumulate into it."""
    cfg = CFGS["qwen3_moe"]
    lay = layer_layout(cfg)
    flat = dev(rng.standard_normal(lay.numel).astype(BF16))
    stacks = stacked_experts(lay, flat, cfg.moe.n_experts)
    for e in range(cfg.moe.n_experts):
        for key, name in zip(EXPERT_STACKS, expert_names(e)):
            view = stacks[key][e]
            assert view.flags.c_contiguous, (key, e)
            assert view.data.ptr == flat.data.ptr + lay.slot(name).offset * flat.itemsize
            assert tuple(view.shape) == tuple(lay.slot(name).shape)


def test_grouped_experts_train_as_the_loop_and_never_wait_for_the_host(rng, monkeypatch):
    """Qwen3-MoE widened to D = F = 256 (the grouped kernels' shapes): the same plan, weights and
    batches under DATAFLOW_MOE_EXPERTS=loop and =grouped give step-1 losses within STEP1_RTOL and
    four AdamW steps within ROUTED_RTOL (the two paths sum the expert GEMMs in other orders, so
    routing may flip at near-ties); the loop path waited for the host offsets, the grouped path
    never recorded that event (no MoE op waited for the host)."""
    base = CFGS["qwen3_moe"]
    cfg = dataclasses.replace(base, name="qwen3-moe-grouped", model_dim=256, head_dim=64,
                              moe=dataclasses.replace(base.moe, expert_ffn_dim=256))
    w = _weights(cfg, rng)
    plan = forced_plan(cfg, SEQLEN, grad_accum=GradAccum.FP32, **ROUNDS)
    batches = [rng.integers(0, cfg.vocab_size, (8, SEQLEN + 1)) for _ in range(STEPS)]
    runs = {}
    for mode in ("loop", "grouped"):
        monkeypatch.setenv("DATAFLOW_MOE_EXPERTS", mode)
        with Engine.from_plan(plan, backend="cupy", weights=w, lr=LR, betas=(BETA1, 0.95),
                              max_grad_norm=None) as eng:
            results = [eng.train_step(b) for b in batches]
            runs[mode] = (results, eng.be.ops._offsets_event is not None)
    (loop, loop_waited), (grouped, grouped_waited) = runs["loop"], runs["grouped"]
    assert loop_waited and not grouped_waited
    assert np.isfinite([r.loss for r in grouped]).all()
    np.testing.assert_allclose(grouped[0].loss, loop[0].loss, rtol=STEP1_RTOL)
    np.testing.assert_allclose([r.loss for r in grouped], [r.loss for r in loop],
                               rtol=ROUTED_RTOL)
