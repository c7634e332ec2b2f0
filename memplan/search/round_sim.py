"""Timing. `simulate_schedule` times a compiled schedule (dataflow.memplan.step.compile) event by
event: the prediction of a plan comes from it. `simulate_round` is the search's fast screen over
candidates (one round of the overlap model: compute windows F0..F(L-1), head, B(L-1)..B0 on one
stream; copies in need order on an h2d and a d2h stream. A copy starts when its stream is free and
its slot is free (weight slot: the use `weight_slots` uses back has ended; grad slot: the grads
`grad_slots` layers back have gone home; activation slot: the item `act_slots` items back has been
sent home or consumed). A window starts when its inputs have arrived. The home activations of a
window are treated as evenly spread over its compute). Pure arithmetic, no arrays, no clock."""

from __future__ import annotations

import bisect
import dataclasses

from dataflow.memplan.plan.plan import HardwareProfile


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """What one round does, per layer; built by cost.workload_of or by the search."""

    n_layers: int
    fwd_s: float
    """Forward seconds of one layer over the round's chunks."""
    bwd_s: list[float]
    """Backward seconds per layer, recompute included."""
    head_s: float
    streamed: list[bool]
    grads_home: list[bool]
    act_count: list[int]
    """Saved activations of each layer that live at home."""
    act_bytes: list[int]
    """Their bytes."""
    layer_bytes: int
    grad_bytes: int
    weight_slots: int
    grad_slots: int
    act_slots: int
    head_w_bytes: int
    head_g_bytes: int
    embed_rows_bytes: int
    embed_grad_rows_bytes: int
    compute_s: float
    """Model compute of the round (no recompute)."""
    recompute_s: float
    extra_flops: float
    """Recompute plus fused-attention score recompute FLOPs of the round (for HFU)."""
    opt_device_elems: int
    opt_streamed_elems: int
    opt_host_elems: int
    gbpe: int
    frozen_flops_per_seq: float = 0.0
    """Model FLOPs per sequence the frozen blocks' skipped weight-gradient GEMMs take off
    (dataflow.models.flops.frozen_flops_per_seq): MFU counts the work that runs."""
    adapter_flops_per_seq: float = 0.0
    """Model FLOPs per sequence of the LoRA adapters (dataflow.memplan.plan.lora.
    adapter_model_flops_per_seq): they run, so MFU counts them."""


@dataclasses.dataclass(frozen=True, slots=True)
class RoundResult:
    time_s: float
    exposed_h2d_s: float
    exposed_d2h_s: float
    h2d_bytes: int
    d2h_bytes: int


def duplex_rates(h2d_bytes: float, d2h_bytes: float, p: HardwareProfile) -> tuple[float, float]:
    """Average rates of a phase: duplex rates while both directions run, alone rates after."""
    if not h2d_bytes or not d2h_bytes:
        return p.h2d_bytes_per_s, p.d2h_bytes_per_s
    th, td = h2d_bytes / p.h2d_duplex_bytes_per_s, d2h_bytes / p.d2h_duplex_bytes_per_s
    if th >= td:
        rest = h2d_bytes - td * p.h2d_duplex_bytes_per_s
        return h2d_bytes / (td + rest / p.h2d_bytes_per_s), p.d2h_duplex_bytes_per_s
    rest = d2h_bytes - th * p.d2h_duplex_bytes_per_s
    return p.h2d_duplex_bytes_per_s, d2h_bytes / (th + rest / p.d2h_bytes_per_s)


class _Items:
    """Windows of evenly spread items: (first index, count, time of first, time of last)."""

    def __init__(self):
        self.first, self.rows = [], []

    def add(self, i0: int, k: int, t_first: float, t_last: float) -> None:
        self.first.append(i0)
        self.rows.append((i0, k, t_first, t_last))

    def time(self, i: int) -> float:
        i0, k, a, b = self.rows[bisect.bisect_right(self.first, i) - 1]
        return b if k == 1 else a + (b - a) * (i - i0) / (k - 1)


def simulate_round(w: Workload, p: HardwareProfile, *, first: bool) -> RoundResult:
    """Seconds of one round (`first`: the round after an optimizer step: no running gradient sums
    to fetch, no weights left in slots) and the part of it compute waited for each stream."""
    # The search calls this twice per candidate it scores: the per-layer lists are read into
    # locals and two-way maxima written as conditionals (same values, about a quarter less time).
    S, streamed, act_bytes, layer_bytes = w.weight_slots, w.streamed, w.act_bytes, w.layer_bytes
    order = [i for i in range(w.n_layers) if streamed[i]]
    n = len(order)
    fpos = {layer: j for j, layer in enumerate(order)}
    held = min(S, n)
    n_g = sum(w.grads_home)
    acts = sum(act_bytes)
    sums = 0 if first else 1
    h_f = w.embed_rows_bytes + (n if first else n - held) * layer_bytes + w.head_w_bytes \
        + sums * w.head_g_bytes
    h_b = (n - held) * layer_bytes + sums * n_g * w.grad_bytes + acts
    d_b = n_g * w.grad_bytes + w.head_g_bytes + w.embed_grad_rows_bytes
    rhf, rdf = duplex_rates(h_f, acts, p)
    rhb, rdb = duplex_rates(h_b, d_b, p)

    use_end: list[float] = []
    fwd_items = _Items()
    t, hfree, dfree, exp_h, exp_d = _forward(w, fpos, first, rhf, rdf, use_end, fwd_items)

    arr = t  # head: its weights and running grad sum queue behind the forward's loads
    if w.head_w_bytes or (sums and w.head_g_bytes):
        hfree += (w.head_w_bytes + sums * w.head_g_bytes) / rhf
        arr = max(arr, hfree)
    exp_h += arr - t
    t = arr + w.head_s
    if w.head_g_bytes:
        dfree = max(dfree, t) + w.head_g_bytes / rdb

    t, hfree, dfree, exp_h, exp_d = _backward(w, fpos, first, n - held, rhb, rdb, use_end,
                                              fwd_items, (t, hfree, dfree, exp_h, exp_d))
    if w.embed_grad_rows_bytes:
        dfree = max(dfree, t) + w.embed_grad_rows_bytes / rdb
    tail = max(hfree, dfree) - t
    if tail > 0:
        if dfree >= hfree:
            exp_d += tail
        else:
            exp_h += tail
        t += tail
    return RoundResult(time_s=t, exposed_h2d_s=exp_h, exposed_d2h_s=exp_d,
                       h2d_bytes=round(h_f + h_b), d2h_bytes=round(acts + d_b))


def _forward(w: Workload, fpos: dict[int, int], first: bool, rhf: float, rdf: float,
             use_end: list[float], fwd_items: _Items) -> tuple[float, float, float, float, float]:
    """The forward windows F0..F(L-1) of simulate_round, at the forward phase's rates: (time,
    h2d free, d2h free, exposed h2d, exposed d2h) after them. Appends each streamed layer's end
    of use to `use_end` and each window's home activations to `fwd_items`."""
    L, S, AS = w.n_layers, w.weight_slots, w.act_slots
    streamed, act_count, act_bytes, fwd_s = w.streamed, w.act_count, w.act_bytes, w.fwd_s
    layer_f = w.layer_bytes / rhf
    t = dfree = exp_h = exp_d = 0.0
    fwd_time = fwd_items.time
    hfree = w.embed_rows_bytes / rhf  # the round's embedding rows, needed by layer 0
    fi = 0
    for layer in range(L):  # forward
        arr_w, slot_first = (hfree if layer == 0 else 0.0), 0.0
        is_streamed = streamed[layer]
        if is_streamed:
            j = fpos[layer]
            if first or j >= S:
                if j >= S and use_end[j - S] > hfree:
                    hfree = use_end[j - S]
                hfree += layer_f
                arr_w = hfree
        k = act_count[layer]
        if k and fi - AS >= 0:
            slot_first = fwd_time(fi - AS)
        start = t
        if arr_w > start:
            start = arr_w
        if slot_first > start:
            start = slot_first
        if start > t:
            if arr_w >= slot_first:
                exp_h += start - t
            else:
                exp_d += start - t
        c = fwd_s
        end = start + c
        if k:
            item_s = act_bytes[layer] / k / rdf
            begin = start + c / k
            if dfree > begin:
                begin = dfree
            last = fi + k - 1 - AS
            if last >= fi:
                slot_last = begin + (last - fi + 1) * item_s
            else:
                slot_last = fwd_time(last) if last >= 0 else 0.0
            if slot_last + c / k > end:
                exp_d += slot_last + c / k - end
                end = slot_last + c / k
            dfree = begin + k * item_s
            if end + item_s > dfree:
                dfree = end + item_s
            fwd_items.add(fi, k, begin + item_s, dfree)
            fi += k
        if is_streamed:
            use_end.append(end)
        t = end
    return t, hfree, dfree, exp_h, exp_d


def _backward(w: Workload, fpos: dict[int, int], first: bool, not_held: int, rhb: float,
              rdb: float, use_end: list[float], fwd_items: _Items,
              state: tuple[float, float, float, float, float]
              ) -> tuple[float, float, float, float, float]:
    """The backward windows B(L-1)..B0 of simulate_round, at the backward phase's rates, from
    `state` (time, h2d free, d2h free, exposed h2d, exposed d2h) after the head; the same after
    them. `not_held`: streamed layers whose weights the forward did not leave in slots."""
    L, S, GS, AS = w.n_layers, w.weight_slots, w.grad_slots, w.act_slots
    streamed, grads_home, act_count, act_bytes = w.streamed, w.grads_home, w.act_count, w.act_bytes
    bwd_s = w.bwd_s
    layer_b, grad_b, grad_d = w.layer_bytes / rhb, w.grad_bytes / rhb, w.grad_bytes / rdb
    t, hfree, dfree, exp_h, exp_d = state
    bwd_items = _Items()
    n_items = sum(act_count)
    g_done: list[float] = []
    bj = 0
    for layer in reversed(range(L)):  # backward
        arr_w = arr_g = arr_a = 0.0
        g_wait_is_d2h = False
        is_streamed = streamed[layer]
        if is_streamed:
            j = fpos[layer]
            if j < not_held:
                u = use_end[len(use_end) - S]
                if u > hfree:
                    hfree = u
                hfree += layer_b
                arr_w = hfree
        g_home = grads_home[layer]
        if g_home:
            q = len(g_done)
            slot = g_done[q - GS] if q >= GS else 0.0
            if first:
                arr_g, g_wait_is_d2h = slot, True
            else:
                if slot > hfree:
                    hfree = slot
                hfree += grad_b
                arr_g = hfree
        k = act_count[layer]
        if k:
            item_s = act_bytes[layer] / k / rhb
            free = _act_slot(bj - AS, bwd_items, fwd_items, n_items)
            begin = hfree if hfree >= free else free
            arr_a = begin + item_s
            hfree = begin + k * item_s
        start = t
        if arr_w > start:
            start = arr_w
        if arr_g > start:
            start = arr_g
        if arr_a > start:
            start = arr_a
        if start > t:
            if g_wait_is_d2h and arr_g >= arr_w and arr_g >= arr_a:
                exp_d += start - t
            else:
                exp_h += start - t
        c = bwd_s[layer]
        end = start + c
        if k:
            last = bj + k - 1 - AS
            if last >= bj:
                slot_last = start + (last - bj + 1) * c / k
            else:
                slot_last = _act_slot(last, bwd_items, fwd_items, n_items)
            if slot_last + item_s > hfree:
                hfree = slot_last + item_s
            if hfree + c / k > end:
                exp_h += hfree + c / k - end
                end = hfree + c / k
            bwd_items.add(bj, k, start + c / k, end)
            bj += k
        if g_home:
            dfree = (dfree if dfree >= end else end) + grad_d
            g_done.append(dfree)
        if is_streamed:
            use_end.append(end)
        t = end
    return t, hfree, dfree, exp_h, exp_d


def _act_slot(i: int, bwd_items: _Items, fwd_items: _Items, n_items: int) -> float:
    """When backward item `i`'s activation slot is free: item i-AS consumed, or for the first
    AS items, the forward item that held the slot has gone home."""
    if i >= 0:
        return bwd_items.time(i)
    i += n_items
    return fwd_items.time(i) if i >= 0 else 0.0
