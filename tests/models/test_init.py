"""Seeded bf16 initialisation: determinism, thread-count independence, statistics, padding,
rounding, and the transformers-named state_dict view."""

import math
import time

import ml_dtypes
import numba
import numpy as np
import pytest

from dataflow.models import ConfigError, load_config
from dataflow.models.init import (
    BF16,
    EMBED_STD,
    f32_to_bf16_bits,
    init_embed_block,
    init_head_block,
    init_layer_block,
    init_model,
    state_dict,
)
from dataflow.models.layout import embed_layout, head_layout, layer_layout

TINY = load_config("tiny")


def _model_bytes(w) -> list[bytes]:
    return [b.tobytes() for *_, b in w.blocks()]


def test_same_seed_gives_identical_bytes_and_other_seed_differs():
    """Two inits from one seed are byte-identical; another seed changes every block."""
    a, b, c = init_model(TINY, 7), init_model(TINY, 7), init_model(TINY, 8)
    assert _model_bytes(a) == _model_bytes(b)
    for x, y in zip(_model_bytes(a), _model_bytes(c)):
        assert x != y


def test_layers_differ_from_each_other():
    """Each layer draws its own stream: layer 0 and layer 1 are not copies."""
    w = init_model(TINY, 0)
    assert not np.array_equal(w.layers[0].view(np.uint16), w.layers[1].view(np.uint16))


def test_result_is_independent_of_numba_thread_count():
    """Bytes depend only on the seed, not on how many threads filled them."""
    cfg = load_config("small")
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = init_layer_block(cfg, 1, 3), init_embed_block(cfg, 3)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = init_layer_block(cfg, 1, 3), init_embed_block(cfg, 3)
    finally:
        numba.set_num_threads(before)
    for x, y in zip(one, many):
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16))


def test_linear_weights_are_uniform_within_bound_with_expected_moments():
    """Projections lie in ±1/sqrt(fan_in) with mean ~0 and std ~bound/sqrt(3)."""
    cfg = load_config("small")
    sd = state_dict(init_model(cfg, 11))
    for name, w in sd.items():
        if w.ndim != 2 or "embed_tokens" in name:
            continue
        x = w.astype(np.float32)
        bound = 1.0 / math.sqrt(w.shape[1])
        # bf16 rounding may move a value by half an ulp (2^-9 relative) past the bound
        assert np.abs(x).max() <= bound * (1 + 2**-8), name
        assert np.abs(x).max() >= bound * 0.99, name
        std = bound / math.sqrt(3)
        assert abs(x.mean()) < 5 * std / math.sqrt(x.size), name
        assert abs(x.std() / std - 1) < 0.02, name


def test_norms_are_exactly_one():
    """input/post-attention layernorms and the final norm are exactly 1.0."""
    sd = state_dict(init_model(TINY, 5))
    norms = [k for k in sd if "layernorm" in k or k == "model.norm.weight"]
    assert len(norms) == 2 * TINY.n_layers + 1
    for k in norms:
        assert np.all(sd[k].astype(np.float32) == 1.0), k


def test_embedding_is_standard_normal():
    """Embedding entries have mean ~0, std ~EMBED_STD and Gaussian tails."""
    cfg = load_config("small")
    x = init_embed_block(cfg, 2).astype(np.float32)[: cfg.vocab_size * cfg.model_dim]
    assert abs(x.mean()) < 5 * EMBED_STD / math.sqrt(x.size)
    assert abs(x.std() / EMBED_STD - 1) < 0.01
    assert abs(np.mean(np.abs(x) > 2 * EMBED_STD) - 0.0455) < 0.005


def test_padding_is_zero_even_when_out_holds_garbage():
    """Alignment gaps are zeroed, also when filling a caller buffer that held other bytes."""
    rng = np.random.default_rng(0)
    for layout, init in [
        (layer_layout(TINY), lambda o: init_layer_block(TINY, 0, 1, out=o)),
        (embed_layout(TINY), lambda o: init_embed_block(TINY, 1, out=o)),
        (head_layout(TINY), lambda o: init_head_block(TINY, 1, out=o)),
    ]:
        out = rng.integers(1, 2**15, layout.numel, dtype=np.uint16).view(BF16)
        assert init(out) is out
        used = np.zeros(layout.numel, bool)
        for t in layout.tensors:
            used[t.offset : t.offset + t.numel] = True
        assert np.all(out.view(np.uint16)[~used] == 0)


def test_bf16_rounding_matches_ml_dtypes_cast():
    """Our float32 -> bf16 rounding equals ml_dtypes' cast, including ties, NaN, inf, subnormals."""
    seed = 1234
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint32)
    bits[:1000] = (bits[:1000] & 0xFFFF0000) | 0x8000  # exact ties
    special = np.array(
        [
            np.nan,
            -np.nan,
            np.inf,
            -np.inf,
            0.0,
            -0.0,
            3.4e38,
            -3.4e38,
            1e-40,
            -1e-45,
            1.0,
            2.0**-126,
        ],
        np.float32,
    )
    x = np.concatenate([bits.view(np.float32), special])
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(f32_to_bf16_bits(x), want), f"seed {seed}"


def test_state_dict_names_and_shapes_follow_transformers():
    """Keys are transformers' names, linear weights are [out, in], and views alias the blocks."""
    w = init_model(TINY, 0)
    sd = state_dict(w)
    d, v = TINY.model_dim, TINY.vocab_size
    names = list(sd)
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert sd["model.embed_tokens.weight"].shape == (v, d)
    assert sd["model.layers.1.self_attn.k_proj.weight"].shape == (TINY.kv_dim, d)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (d, TINY.ffn_dim)
    assert sd["lm_head.weight"].shape == (v, d)
    assert sum(a.size for a in sd.values()) == TINY.n_params
    sd["model.norm.weight"][0] = 3.0
    assert float(w.head[0]) == 3.0


def test_bad_seed_layer_and_out_are_refused():
    """Negative seeds, out-of-range layers and wrong-sized out buffers raise ConfigError."""
    with pytest.raises(ConfigError, match="seed"):
        init_model(TINY, -1)
    with pytest.raises(ConfigError, match="has 2 layers"):
        init_layer_block(TINY, 2, 0)
    with pytest.raises(ConfigError, match="46336"):
        init_layer_block(TINY, 0, 0, out=np.empty(10, BF16))
    with pytest.raises(ConfigError, match="bfloat16"):
        init_embed_block(TINY, 0, out=np.empty(embed_layout(TINY).numel, np.float32))


def test_1b_layer_init_throughput_is_reported():
    """Prints init throughput of one 1b layer (timing sanity only; no assertion on speed)."""
    cfg = load_config("1b")
    out = np.empty(layer_layout(cfg).numel, BF16)
    init_layer_block(cfg, 0, 0, out=out)  # touch pages, warm the kernel
    t0 = time.perf_counter()
    init_layer_block(cfg, 0, 1, out=out)
    dt = time.perf_counter() - t0
    print(
        f"\n1b layer init: {out.nbytes / 2**20:.0f} MiB in {dt * 1e3:.1f} ms = "
        f"{out.nbytes / dt / 2**30:.2f} GiB/s on {numba.get_num_threads()} threads"
    )
    assert np.isfinite(out[:1000].astype(np.float32)).all()
