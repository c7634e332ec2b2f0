"""The FLOP model: ml_dataflow's model FLOPs per token for 8b at seqlen 8192 worked out by hand,
and the recompute FLOPs that HFU adds per saved-activation level."""

import pytest

from dataflow.models.config import load_config
from dataflow.models.flops import (FLOP_MODEL_VERSION, SavedLevel, attn_fwd_flops, flash_recompute_flops,
                          hardware_flops_per_seq, model_flops_per_seq, model_flops_per_token)


@pytest.fixture(scope="module")
def cfg8b():
    return load_config("8b")


def test_8b_model_flops_per_token_at_seqlen_8192_equal_the_hand_calculation(cfg8b):
    """8b at S = 8192: 51,470,401,536 model FLOPs per token, computed step by step below."""
    S, d, L, V = 8192, 4096, 32, 128256
    kv = 8 * 128          # n_kv_heads * head_dim = 1024
    F = 14336
    # One layer's forward matmuls: Q and O (d x d each), K and V (d x kv each), gate/up/down
    # (d x F each), 2 FLOPs per multiply-add: 2 * S * d * (2d + 2kv + 3F)
    #   = 2 * 8192 * 4096 * (8192 + 2048 + 43008) = 2 * 8192 * 4096 * 53248
    layer_matmul_fwd = 3_573_412_790_272
    assert layer_matmul_fwd == 2 * S * d * (2 * d + 2 * kv + 3 * F)
    # Forward + backward (dX and dW) = 3 times the forward.
    layer_matmul = 3 * layer_matmul_fwd                         # 10,720,238,370,816
    # Causal attention forward, QK^T and PV at half (causal): .5 * 2 * (2 * S * S * d)
    attn_fwd = 549_755_813_888
    assert attn_fwd == 2 * S * S * d
    # Attention backward, four matmuls at half: .5 * 4 * (2 * S * S * d)
    attn_bwd = 1_099_511_627_776
    assert attn_bwd == 4 * S * S * d
    per_layer = layer_matmul + attn_fwd + attn_bwd              # 12,369,505,812,480
    assert per_layer == 12_369_505_812_480
    # Head: forward and two backward matmuls of S x d x V; the embedding gather is free.
    head = 3 * 2 * S * d * V                                    # 25,821,343,383,552
    assert head == 25_821_343_383_552
    per_seq = L * per_layer + head                              # 421,645,529,382,912
    assert per_seq == 421_645_529_382_912
    per_token = per_seq // S
    assert per_token * S == per_seq and per_token == 51_470_401_536
    # Cross-check with the "6N + attention" form: N = matmul weights (layers + lm_head),
    # attention 6 * L * S * d per token.
    n_matmul = L * d * (2 * d + 2 * kv + 3 * F) + V * d        # 7,504,658,432
    assert 6 * n_matmul + 6 * L * S * d == per_token

    assert model_flops_per_seq(cfg8b, S) == per_seq
    assert model_flops_per_token(cfg8b, S) == per_token


def test_flop_model_has_a_version_string():
    """Reports quote the FLOP model they used, so it carries a non-empty version string."""
    assert isinstance(FLOP_MODEL_VERSION, str) and FLOP_MODEL_VERSION


def test_chunked_attention_flops_sum_to_the_whole_sequence(cfg8b):
    """Query chunks at offsets score the same causal pairs as the whole sequence at once."""
    S, c = 8192, 2048
    chunks = sum(attn_fwd_flops(cfg8b, c, start) for start in range(0, S, c))
    assert chunks == attn_fwd_flops(cfg8b, S)


@pytest.mark.parametrize("chunk_tokens", [8192, 2048])
def test_full_level_adds_only_the_flash_attention_recompute(cfg8b, chunk_tokens):
    """With every layer FULL, hardware FLOPs exceed model FLOPs only by the score matrix fused
    attention rebuilds in its backward: L * (.5 * 2 * S * S * d), however the sequence is
    chunked."""
    S, d, L = 8192, 4096, 32
    hw = hardware_flops_per_seq(cfg8b, S, chunk_tokens, [SavedLevel.FULL] * L)
    assert hw - model_flops_per_seq(cfg8b, S) == L * S * S * d
    assert L * flash_recompute_flops(cfg8b, S) == L * S * S * d


def test_recompute_flops_order_inp_only_above_inp_attn_above_full(cfg8b):
    """INP_ONLY recomputes attention on top of INP_ATTN's Q, O and gate/up matmuls, which FULL
    does not recompute at all; the gaps equal those matmuls' forward FLOPs."""
    S, d, L, F = 8192, 4096, 32, 14336
    hw = {lv: hardware_flops_per_seq(cfg8b, S, 4096, [lv] * L) for lv in SavedLevel}
    assert hw[SavedLevel.INP_ONLY] > hw[SavedLevel.INP_ATTN] > hw[SavedLevel.FULL]
    assert hw[SavedLevel.INP_ATTN] - hw[SavedLevel.FULL] == L * (2 * S * d * 2 * d
                                                                 + 2 * S * d * 2 * F)
    assert hw[SavedLevel.INP_ONLY] - hw[SavedLevel.INP_ATTN] == L * attn_fwd_flops(cfg8b, S)


def test_hardware_flops_add_up_per_layer_for_mixed_levels(cfg8b):
    """A mix of levels costs the per-layer extras of each level, summed over layers."""
    S, L = 4096, 32
    mixed = [SavedLevel.INP_ONLY] * 10 + [SavedLevel.INP_ATTN] * 12 + [SavedLevel.FULL] * 10
    base = model_flops_per_seq(cfg8b, S)
    extra = {lv: (hardware_flops_per_seq(cfg8b, S, S, [lv] * L) - base) / L for lv in SavedLevel}
    want = base + 10 * extra[SavedLevel.INP_ONLY] + 12 * extra[SavedLevel.INP_ATTN] \
        + 10 * extra[SavedLevel.FULL]
    assert hardware_flops_per_seq(cfg8b, S, S, mixed) == pytest.approx(want, rel=1e-15)


def test_hardware_flops_refuse_a_level_list_of_the_wrong_length(cfg8b):
    """One saved level per layer is required; the error names both counts."""
    with pytest.raises(ValueError, match=r"\(32\), got 3"):
        hardware_flops_per_seq(cfg8b, 8192, 8192, [SavedLevel.FULL] * 3)
