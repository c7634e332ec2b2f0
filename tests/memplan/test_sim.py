"""The overlap simulation against a timeline worked out by hand."""

import dataclasses

import pytest

from dataflow.memplan.search.round_sim import Workload, duplex_rates, simulate_round


def _two_streamed_layers(p, **over) -> Workload:
    w = Workload(n_layers=2, fwd_s=0.3, bwd_s=[0.6, 0.6], head_s=0.2, streamed=[True, True],
                 grads_home=[True, True], act_count=[0, 0], act_bytes=[0, 0],
                 layer_bytes=int(55e9 * 0.1), grad_bytes=int(55e9 * 0.05), weight_slots=1,
                 grad_slots=1, act_slots=0, head_w_bytes=0, head_g_bytes=0, embed_rows_bytes=0,
                 embed_grad_rows_bytes=0, compute_s=0.0, recompute_s=0.0, extra_flops=0.0,
                 opt_device_elems=0, opt_streamed_elems=0, opt_host_elems=0, gbpe=2)
    return dataclasses.replace(w, **over)


def test_one_slot_round_matches_the_hand_timeline(h100):
    """Two streamed layers, one weight and one grad slot, first round:
    F0 waits for its load (W); F1's load starts when F0 ends; B1 reuses the weights still in
    the slot; B0's load starts when B1 ends and B0 also waits for B1's grads to go home."""
    w = _two_streamed_layers(h100)
    r = simulate_round(w, h100, first=True)
    W, f, h, b = 0.1, 0.3, 0.2, 0.6
    rh, rd = duplex_rates(w.layer_bytes, 2 * w.grad_bytes, h100)
    Wb, Gb = w.layer_bytes / rh, w.grad_bytes / rd
    assert r.time_s == pytest.approx(2 * W + 2 * f + h + 2 * b + max(Wb, Gb) + Gb)
    assert r.time_s == pytest.approx(2 * f + h + 2 * b + r.exposed_h2d_s + r.exposed_d2h_s)
    assert r.h2d_bytes == 3 * w.layer_bytes and r.d2h_bytes == 2 * w.grad_bytes


def test_two_slots_hide_the_second_load_and_keep_both_layers(h100):
    """With two weight slots F1's load overlaps F0's compute and both layers stay in their
    slots for the backward; a later round moves only the running gradient sums."""
    one = simulate_round(_two_streamed_layers(h100), h100, first=True)
    w = _two_streamed_layers(h100, weight_slots=2)
    two = simulate_round(w, h100, first=True)
    W, f, h, b = 0.1, 0.3, 0.2, 0.6
    Gb = w.grad_bytes / duplex_rates(0, 2 * w.grad_bytes, h100)[1]
    assert two.time_s == pytest.approx(W + 2 * f + h + 2 * b + 2 * Gb)
    assert two.time_s < one.time_s and two.h2d_bytes == 2 * w.layer_bytes
    later = simulate_round(w, h100, first=False)
    assert later.h2d_bytes == 2 * w.grad_bytes and later.d2h_bytes == 2 * w.grad_bytes
