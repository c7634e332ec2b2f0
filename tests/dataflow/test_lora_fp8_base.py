"""LoRA on an FP8-stored frozen base (`--lora-base fp8`, docs/lora.md): the quantiser's bound,
zero rows and its refusal of inf / NaN, per-row against per-tensor scales; an fp8-base engine's
step-1 loss and adapter gradients against the float64 transcription on the dequantised base
(resident and streamed plans), the stored codes bit-identical after training, checkpoints that
refuse the other storage, and the flag's refusals."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dataflow import Engine
from dataflow.kernels.reference.fp8_base import fp8_base_dequant
from dataflow.lora_reference import loss_and_grads
from dataflow.memplan.plan.lora import Lora, LoraBase, parse_lora
from dataflow.memplan.plan.plan import OptimizerWhere
from dataflow.models.config import load_config
from dataflow.models.errors import ConfigError
from dataflow.models.fp8_layout import E4M3_MAX, FP8_TENSORS, fp8_layer_layout
from dataflow.models.fp8_quant import (E4M3, decode_block, dequantise_rows, encode_block,
                                       quantise_rows)
from dataflow.models.flops import SavedLevel
from dataflow.models.layout import layer_layout
from tests.dataflow.plans import forced_plan, streamed
from tests.dataflow.test_lora import _batch, _random_b  # the same adapters and batches

BF16 = np.dtype(ml_dtypes.bfloat16)
LORA = Lora(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"),
            base=LoraBase.FP8)


def _half_ulp(v: np.ndarray) -> np.ndarray:
    """Half an E4M3 ulp at |v| (subnormals below 2^-6 step by 2^-9)."""
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -6)))
    return 0.5 * 2.0 ** (e - 3)


def test_quantiser_is_within_half_an_e4m3_ulp_of_each_row_scaled_value():
    """|codes - w / scale| <= half an ulp of w / scale, for rows of very different magnitudes."""
    seed = 3
    print("seed", seed)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((48, 96)) * (10.0 ** rng.uniform(-4, 3, (48, 1)))
    w = w.astype(ml_dtypes.bfloat16)
    codes, scales = quantise_rows(w)
    # the row-scaled value as the quantiser forms it (one fp32 division; a float64 one can
    # sit a hair past a tie the fp32 value lands on exactly)
    x = (w.astype(np.float32) / scales[:, None]).astype(np.float64)
    assert np.abs(x).max() <= E4M3_MAX * (1 + 2 ** -22)  # amax / (amax / 448): an fp32 ulp
    x = np.clip(x, -E4M3_MAX, E4M3_MAX)
    got = codes.view(E4M3).astype(np.float64)
    assert np.all(np.abs(got - x) <= _half_ulp(x))
    # the reference op's bf16 copy is that value times its scale, rounded once
    want = (got.astype(np.float32) * scales[:, None]).astype(ml_dtypes.bfloat16)
    assert np.array_equal(fp8_base_dequant(codes, scales).view(np.uint16), want.view(np.uint16))


def test_quantiser_gives_a_zero_row_scale_one_and_refuses_inf_and_nan_by_row():
    """A zero row is scale 1, codes 0; a non-finite row is refused naming the tensor and row."""
    w = np.ones((4, 8), np.float32)
    w[2] = 0
    codes, scales = quantise_rows(w, "q")
    assert scales[2] == 1 and not codes[2].any()
    assert np.array_equal(dequantise_rows(codes, scales), w)
    for bad in (np.inf, np.nan):
        w[3, 5] = bad
        with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj.*row 3"):
            quantise_rows(w, "model.layers.1.self_attn.q_proj")


def test_per_row_scales_beat_one_per_tensor_scale_on_rows_of_different_magnitudes():
    """Rows 1e5 apart: per-row scales keep the small rows; one tensor scale sends them to
    E4M3's subnormals, where they lose most of their bits."""
    seed = 5
    print("seed", seed)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((32, 64)) * np.where(np.arange(32) % 2, 1e-5, 1.0)[:, None])
    w = w.astype(np.float32)
    codes, scales = quantise_rows(w)
    amax = np.abs(w).max(axis=1)
    row_err = (np.abs(dequantise_rows(codes, scales) - w).max(axis=1) / amax).max()
    s = np.float32(np.abs(w).max() / E4M3_MAX)
    tensor = (w / s).astype(E4M3).astype(np.float32) * s
    tensor_err = (np.abs(tensor - w).max(axis=1) / amax).max()
    assert row_err <= 2 ** -4  # half an ulp of 448's binade, relative to the row's amax
    assert tensor_err > 4 * row_err, (row_err, tensor_err)


def test_fp8_block_encodes_linears_as_codes_and_keeps_norms_bit_exact():
    """encode_block / decode_block: norms unchanged, linears as the rows' dequantised values,
    the block about half the bf16 bytes."""
    cfg = load_config("tiny")
    lay, bf = fp8_layer_layout(cfg), layer_layout(cfg)
    rng = np.random.default_rng(7)
    block = (rng.standard_normal(bf.numel) * 0.02).astype(ml_dtypes.bfloat16)
    back = decode_block(lay, encode_block(lay, block))
    for t in bf.tensors:
        a, b = bf.view(block, t.name), bf.view(back, t.name)
        if t.name in FP8_TENSORS:
            codes, scales = quantise_rows(a)
            assert np.array_equal(b.view(np.uint16),
                                  fp8_base_dequant(codes, scales).view(np.uint16)), t.name
        else:
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), t.name
    assert lay.nbytes < 0.6 * bf.nbytes


def _engine(plan=None, lora=LORA, **kw):
    common = dict(backend="numpy", sanitize=True, lr=2e-3, max_grad_norm=None, seed=0, **kw)
    if plan is not None:
        return Engine.from_plan(plan, **common)
    return Engine("tiny", seqlen=32, host_gb=1, dev_gb=0.5, lora=lora, **common)


def _stored(eng):
    return [eng._state.read_stored(b, "weights").copy() for b in eng.ex.layers]


def _streamed_plan():
    cfg = load_config("tiny")
    n, lv = cfg.n_layers, SavedLevel
    return forced_plan(cfg, 64, layers=(streamed(OptimizerWhere.HOST),) * n, weight_slots=2,
                       grad_slots=0, levels=[[lv.INP_ONLY, lv.INP_ATTN]] * n, chunk_tokens=64,
                       chunks_per_round=2, rounds=2, lora=LORA)


@pytest.mark.parametrize("where", ["resident", "streamed"])
def test_fp8_base_engine_matches_float64_lora_on_the_dequantised_base(where):
    """Step-1 loss and every adapter gradient against the float64 transcription applied to the
    dequantised base (what the engine trains), the stored codes bit-identical after 2 steps."""
    eng = _engine(_streamed_plan() if where == "streamed" else None)
    assert eng.plan.lora.fp8_base
    seed = 17
    print("seed", seed)
    rng = np.random.default_rng(seed)
    adapters = _random_b(eng, rng)
    batch = _batch(eng, rng)
    base = eng.weights()  # the dequantised base (codes * row scale, bf16)
    stored = _stored(eng)
    assert stored[0].size == fp8_layer_layout(eng.plan.model).numel
    ref_loss, ref_g = loss_and_grads(base, eng.plan.lora, adapters, batch)
    eng.set_lr(0.0)
    loss = eng.train_step(batch).loss
    got = eng.lora_state()
    assert abs(loss - ref_loss) < 0.005 * abs(ref_loss)
    for k, g in ref_g.items():
        rel = float(np.abs(got[k + ".grad"] - g).max() / np.abs(g).max())
        assert rel < 0.05, (k, rel)
    eng.set_lr(2e-3)
    eng.train_step(_batch(eng, rng))
    for a, b in zip(stored, _stored(eng)):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    eng.close()


def test_fp8_base_is_the_bf16_base_quantised_once_whether_initialised_or_loaded():
    """The fp8 engine's base is exactly decode(encode(bf16 base)): from the seed's
    initialisation and from weights= (resident, and streamed from its homes) alike; a loaded
    row holding inf is refused by name."""
    a = _engine(lora=dict(rank=4))
    wa = a.weights()
    a.close()
    lay = fp8_layer_layout(wa.cfg)
    want = [decode_block(lay, encode_block(lay, block)) for block in wa.layers]
    b = _engine(lora=dict(rank=4, base="fp8"))
    c = _engine(lora=dict(rank=4, base="fp8"), weights=wa)
    d = _engine(_streamed_plan(), weights=wa)  # quantised straight into the layers' homes
    for e in (b, c, d):
        w = e.weights()
        for got, exp in zip(w.layers, want):
            assert np.array_equal(got.view(np.uint16), exp.view(np.uint16))
        assert np.array_equal(w.embed.view(np.uint16), wa.embed.view(np.uint16))
        e.close()
    bad = wa.layers[1].copy()
    layer_layout(wa.cfg).view(bad, "mlp.up_proj")[5, 3] = np.inf
    wa.layers[1] = bad
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj.*row 5"):
        _engine(lora=dict(rank=4, base="fp8"), weights=wa)


def test_requantising_a_decoded_base_gives_back_its_codes(rng):
    """Rows of magnitudes 2^-29 to 2^7 (and zero rows): encode, decode to bf16, encode again:
    the same codes and scales' decode. The decoded row's amax is 448 x scale rounded to bf16,
    so the second scale is within 2^-8 of the first and every value lands back on its code
    (half an E4M3 step is 2^-4 of it), subnormal codes included. So an fp8 base's own
    state_dict loads back to the codes it came from."""
    o, i = 96, 256
    w = (rng.standard_normal((o, i)) * np.exp2(rng.uniform(-29, 7, (o, 1)))).astype(BF16)
    w[:2] = 0
    codes, scales = quantise_rows(w)
    again, scales2 = quantise_rows(dequantise_rows(codes, scales).astype(BF16))
    assert np.array_equal(again, codes)
    assert np.array_equal(dequantise_rows(again, scales2).astype(BF16).view(np.uint16),
                          dequantise_rows(codes, scales).astype(BF16).view(np.uint16))
    eng = _engine()
    stored = _stored(eng)
    eng.load_state_dict(eng.state_dict())
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
               for a, b in zip(stored, _stored(eng)))
    eng.close()


def test_lora_checkpoint_records_the_base_storage_and_refuses_the_other(tmp_path):
    """A checkpoint of an fp8-base run names its storage; a bf16-base engine refuses it by
    name (and the other way round); the same storage resumes."""
    fp8 = _engine()
    fp8.train_step(_batch(fp8, np.random.default_rng(1)))
    path = fp8.save_checkpoint(tmp_path / "ck")
    bf16 = _engine(lora=dict(rank=4, alpha=8))
    with pytest.raises(ConfigError, match="fp8 base storage.*bf16"):
        bf16.load_checkpoint(path)
    again = _engine()
    again.load_checkpoint(path)
    assert again.step == 1
    path2 = bf16.save_checkpoint(tmp_path / "ck2")
    with pytest.raises(ConfigError, match="bf16 base storage.*fp8"):
        again.load_checkpoint(path2)
    for e in (fp8, bf16, again):
        e.close()


def test_lora_base_flag_needs_a_rank_and_is_spelt_bf16_or_fp8():
    """--lora-base fp8 without --lora-rank names both; a bad storage lists the spellings."""
    with pytest.raises(ConfigError, match="--lora-base fp8 needs --lora-rank"):
        parse_lora(None, base="fp8")
    with pytest.raises(ConfigError, match="spell bf16, fp8"):
        parse_lora(8, base="fp16")
    assert parse_lora(None, base="bf16") is None
    assert parse_lora(8, base="fp8").base is LoraBase.FP8
    assert parse_lora(8).base is LoraBase.BF16


def test_demo_trains_an_fp8_base_resumes_it_and_refuses_the_other_storage(tmp_path, capsys):
    """dataflow-demo --lora-base fp8 trains and resumes; resuming with a bf16 base exits 2
    naming the storage; --lora-base fp8 without --lora-rank exits 2 naming both."""
    # Imported here: the demo's command line is only what this test drives.
    from dataflow.cli.demo import main as demo_main

    argv = ["1", "0.5", "64", "tiny", "--backend", "numpy", "--lora-rank", "4",
            "--checkpoint-dir", str(tmp_path / "run"), "--save-every", "1"]
    assert demo_main(argv + ["--steps", "1", "--lora-base", "fp8"]) == 0
    meta = (tmp_path / "run" / "step_00000001" / "lora_checkpoint.json").read_text()
    assert '"storage": "fp8"' in meta
    assert demo_main(argv + ["--steps", "2", "--resume", "--lora-base", "fp8"]) == 0
    capsys.readouterr()
    assert demo_main(argv + ["--steps", "3", "--resume"]) == 2
    assert "fp8 base storage" in capsys.readouterr().err
    assert demo_main(["1", "0.5", "64", "tiny", "--backend", "numpy", "--lora-base",
                      "fp8"]) == 2
    assert "--lora-base fp8 needs --lora-rank" in capsys.readouterr().err
