"""The LoRA path's fused scale and kept products (issue 54, docs/lora.md): s = alpha / r is the
adapters' GEMMs' alpha (one rounding of each (T, r) product, no scale_ launch), and db reads
s (x a^T) from where the forward or the backward's recompute formed it (a FULL activation keeps
every target's; below FULL the recompute's Q, O, gate and up), re-forming only K, V and down
below FULL. On the NumPy backend: the ops' rounding, the launches by name, the same bits as
re-forming every product, the float64 oracle on a plan of every level, and the planner's bytes
of what the executor binds."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from dataflow import Engine
from dataflow import ops_numpy
from dataflow.layer_ops import LayerCompute
from dataflow.lora_reference import loss_and_grads
from dataflow.memplan.plan import buffers
from dataflow.memplan.plan.lora import region_sizes
from dataflow.models.config import load_config
from dataflow.models.flops import SavedLevel
from tests.dataflow.test_lora import LORA, LR, _batch, _forced, _random_b, _rel

def _bf16():
    import ml_dtypes  # test-only dependency of the NumPy backend

    return ml_dtypes.bfloat16


@pytest.mark.parametrize("op", ["linear_fwd", "linear_bwd_x"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_numpy_linear_alpha_rounds_the_scaled_product_once(op, accumulate):
    """linear_fwd / linear_bwd_x with alpha: alpha x the fp32 product (plus the output when
    accumulating) rounded once to bf16, so within half a bf16 ulp of the float64 value."""
    bf16, seed = _bf16(), 21
    rng = np.random.default_rng(seed)
    print("seed", seed)
    t, i, o, s = 48, 40, 8, 0.37
    x = rng.standard_normal((t, i if op == "linear_fwd" else o)).astype(bf16)
    w = (rng.standard_normal((o, i)) / np.sqrt(i)).astype(bf16)
    y0 = rng.standard_normal((t, o if op == "linear_fwd" else i)).astype(bf16)
    y = y0.copy() if accumulate else np.full_like(y0, np.nan)
    getattr(ops_numpy, op)(x, w, y, accumulate, s)
    xf, wf = x.astype(np.float64), w.astype(np.float64)
    prod = xf @ wf.T if op == "linear_fwd" else xf @ wf
    want = s * prod + (y0.astype(np.float64) if accumulate else 0.0)
    # half a bf16 ulp (2^-8 of the value's binade, so at most 2^-8 |value|) plus the fp32
    # product's own error; two roundings (the product, then its scaling) may exceed it
    bound = np.abs(want) * 2.0 ** -8 * (1 + 1e-3) + 1e-6 * np.abs(prod).max()
    assert np.all(np.abs(y.astype(np.float64) - want) <= bound)
    y1 = np.empty_like(y0) if not accumulate else y0.copy()
    getattr(ops_numpy, op)(x, w, y1, accumulate)  # alpha 1: the path without it
    y2 = np.empty_like(y0) if not accumulate else y0.copy()
    getattr(ops_numpy, op)(x, w, y2, accumulate, 1.0)
    assert np.array_equal(y1.view(np.uint16), y2.view(np.uint16))


def _names(eng):
    """Record the name of every launch of `eng`'s backend."""
    names, launch = [], eng.be.launch

    def recording(stream, op, *args, name=None, **kw):
        names.append(name or op)
        return launch(stream, op, *args, name=name, **kw)

    eng.be.launch = recording
    return names


def _run(plan, seed: int):
    """(launch names, loss, {adapter: gradient}) of one step from adapters with B random."""
    eng = Engine.from_plan(plan, backend="numpy", sanitize=True, lr=LR, max_grad_norm=None)
    rng = np.random.default_rng(seed)
    _random_b(eng, rng)
    batch = _batch(eng, rng)
    names = _names(eng)
    eng.set_lr(0.0)
    loss = eng.train_step(batch).loss
    grads = {k: v for k, v in eng.lora_state().items() if k.endswith(".grad")}
    eng.close()
    return names, loss, grads


def test_lora_launches_no_scale_and_re_forms_only_what_nothing_kept():
    """No scale_ launch; the backward's lora_xa runs for K, V and down of each (layer, chunk)
    below FULL and for none at FULL; the recompute's own lora_a runs for Q, O, gate, up."""
    plan = _forced("split", load_config("tiny"))
    names, _, _ = _run(plan, 41)
    assert not [n for n in names if "scale_" in n or n.endswith(".lora_s")]
    count = collections.Counter(names)
    levels = set()
    for layer, row in enumerate(plan.activations):
        for c, a in enumerate(row):
            full = a.level is SavedLevel.FULL
            levels.add(a.level)
            tag = f"b.L{layer}.c{c}.linear_fwd"
            assert count[f"{tag}.lora_xa"] == (0 if full else 3), (layer, c, a.level)
            assert count[f"{tag}.lora_a"] == (0 if full else 4), (layer, c, a.level)
            assert count[f"b.L{layer}.c{c}.linear_bwd_w.lora_db"] == 7, (layer, c)
    assert levels == set(SavedLevel)  # every level occurs


def test_kept_products_give_the_bits_of_re_forming_every_one(monkeypatch):
    """Reading the kept s (x a^T) is the same op on the same x as re-forming it: loss and every
    adapter gradient bit-identical to a run whose backward re-forms all seven."""
    plan = _forced("split", load_config("tiny"))
    _, loss, grads = _run(plan, 42)
    lin_bwd_w = LayerCompute._lin_bwd_w

    def re_forming(self, name, dy, x, g):
        self.formed = {}
        return lin_bwd_w(self, name, dy, x, g)

    monkeypatch.setattr(LayerCompute, "_lin_bwd_w", re_forming)
    names, loss2, grads2 = _run(plan, 42)
    assert sum(n.endswith(".lora_xa") for n in names) == 7 * sum(map(len, plan.activations))
    assert loss == loss2
    for k, g in grads.items():
        assert np.array_equal(g, grads2[k]), k


def test_lora_gradients_match_float64_reference_on_a_plan_of_every_level():
    """Step-1 loss and adapter gradients of the split plan (FULL, INP_ATTN, INP_ONLY; FULL at
    home) within bf16 tolerance of the float64 oracle."""
    plan = _forced("split", load_config("tiny"))
    eng = Engine.from_plan(plan, backend="numpy", sanitize=True, lr=LR, max_grad_norm=None)
    rng = np.random.default_rng(43)
    print("seed 43")
    adapters = _random_b(eng, rng)
    batch = _batch(eng, rng)
    ref_loss, ref_g = loss_and_grads(eng.weights(), plan.lora, adapters, batch)
    eng.set_lr(0.0)
    loss = eng.train_step(batch).loss
    got = eng.lora_state()
    eng.close()
    assert abs(loss - ref_loss) < 0.005 * abs(ref_loss)
    for k, g in ref_g.items():
        assert _rel(got[k + ".grad"], g) < 0.05, (k, _rel(got[k + ".grad"], g))


def test_planner_counts_the_products_the_executor_binds():
    """A FULL activation with LoRA holds one aligned (T, r) bf16 product per target after what
    it held without; lora.work ends exactly where the last per-target buffer does."""
    cfg, t = load_config("tiny"), 32
    full = buffers.saved_activation_bytes(cfg, t, SavedLevel.FULL)
    with_lora = buffers.saved_activation_bytes(cfg, t, SavedLevel.FULL, lora=LORA)
    assert with_lora - full == len(LORA.targets) * buffers.align(2 * t * LORA.rank)
    for lv in (SavedLevel.INP_ONLY, SavedLevel.INP_ATTN):
        assert buffers.saved_activation_bytes(cfg, t, lv, lora=LORA) == \
            buffers.saved_activation_bytes(cfg, t, lv)
    plan = _forced("split", cfg)
    eng = Engine.from_plan(plan, backend="numpy", lr=LR)
    ad, t = eng.ex.lora, plan.chunking.chunk_tokens
    last = ad.xa[LORA.targets[-1]]
    end = last.ctypes.data + last.nbytes - ad.work.ctypes.data
    eng.close()
    assert end == region_sizes(cfg, LORA, t)["lora.work"]
