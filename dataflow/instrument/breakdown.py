"""StepTrace (every span of one step) and StepBreakdown: where the step's wall time and bytes
went, computed from its spans. The wall is partitioned into four parts that add up to it
exactly: compute busy, copy time the compute did not cover (exposed copy), host-stream time
covered by neither (exposed host), and time when nothing ran (idle: host overhead and bubbles).
Beside them: per-stream busy times, hidden copy time, bytes and achieved rates per direction,
recompute and optimizer time. Pure Python: never touches a device, never reads the clock."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from dataflow.backend import Stream
from dataflow.instrument.spans import RING_NAME, Clock, Span, is_optimizer, is_recompute

Intervals = list[tuple[float, float]]


@dataclasses.dataclass(frozen=True, slots=True)
class StepTrace:
    """Every span of one step and the step's window (from begin_step to the end-of-step sync)."""

    step: int
    start_s: float
    end_s: float
    spans: tuple[Span, ...]
    clock: Clock

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s

    def breakdown(self) -> StepBreakdown:
        """This step's StepBreakdown (compute_breakdown below)."""
        return compute_breakdown(self)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepBreakdown:
    step: int
    clock: Clock
    """Where the times come from: CUDA events on the GPU, host clocks on the NumPy backend."""
    wall_s: float
    """From begin_step to the end-of-step synchronize."""
    compute_busy_s: float
    """Union of the compute stream's spans."""
    copy_exposed_s: float
    """Time some H2D or D2H copy ran while the compute stream was idle."""
    host_exposed_s: float
    """Time the HOST stream ran while neither the compute stream nor a copy did."""
    idle_s: float
    """Time nothing traced ran (host enqueue overhead, waits on the host, bubbles)."""
    h2d_busy_s: float
    d2h_busy_s: float
    host_busy_s: float
    copy_busy_s: float
    """Union of H2D and D2H spans (both directions at once count once)."""
    copy_hidden_s: float
    """Copy time that overlapped compute: copy_busy_s - copy_exposed_s."""
    h2d_exposed_s: float
    """H2D time while the compute stream was idle (may overlap d2h_exposed_s)."""
    d2h_exposed_s: float
    h2d_bytes: int
    d2h_bytes: int
    recompute_s: float
    """Union of compute spans that re-run forward work a saved-activation level left out
    (spans.is_recompute, less the input norm and SwiGLU that every level re-derives: those are
    no recompute in the plan's or the FLOP model's sense, yet took 2-4 % of a NumPy step)."""
    optimizer_s: float
    """Union over all streams of optimizer spans (spans.OPTIMIZER_PREFIXES)."""
    n_spans: int
    attention_s: float = 0.0
    """Union of compute spans of fused attention (forward and backward) that are no recompute:
    the part of a long-context step that no schedule can shorten (bench/floors.py). 0 in
    records written before it existed."""

    @property
    def compute_idle_s(self) -> float:
        """The compute stream's bubble: wall minus compute busy."""
        return self.copy_exposed_s + self.host_exposed_s + self.idle_s

    @property
    def copy_hidden_frac(self) -> float:
        return self.copy_hidden_s / self.copy_busy_s if self.copy_busy_s > 0 else 1.0

    @property
    def compute_busy_frac(self) -> float:
        return self.compute_busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def h2d_bytes_per_s(self) -> float:
        """Achieved host-to-device rate while an H2D copy ran."""
        return self.h2d_bytes / self.h2d_busy_s if self.h2d_busy_s > 0 else 0.0

    @property
    def d2h_bytes_per_s(self) -> float:
        return self.d2h_bytes / self.d2h_busy_s if self.d2h_busy_s > 0 else 0.0

    @property
    def recompute_frac(self) -> float:
        """Share of compute busy time spent recomputing."""
        return self.recompute_s / self.compute_busy_s if self.compute_busy_s > 0 else 0.0

    @property
    def optimizer_frac(self) -> float:
        """Share of the wall time with optimizer work running on some stream."""
        return self.optimizer_s / self.wall_s if self.wall_s > 0 else 0.0

    def ceilings(self, tokens: int) -> dict[str, float | None]:
        """Tokens per second this step could reach at its own kernel rates (ceilings())."""
        return ceilings(tokens, self.compute_busy_s, self.recompute_s, self.attention_s)

    def parts(self) -> dict[str, float]:
        """The four parts of the wall time, in seconds; they sum to wall_s."""
        return {"compute_busy_s": self.compute_busy_s, "copy_exposed_s": self.copy_exposed_s,
                "host_exposed_s": self.host_exposed_s, "idle_s": self.idle_s}

    def summary(self) -> str:
        """One line: the four parts of the wall as %, copy rates, hidden copy, recompute and
        optimizer shares."""
        w = self.wall_s or 1.0
        return (f"compute {self.compute_busy_s / w:.0%} | exposed copy "
                f"{self.copy_exposed_s / w:.0%} | host {self.host_exposed_s / w:.0%} | idle "
                f"{self.idle_s / w:.0%} | h2d {_moved(self.h2d_bytes, self.h2d_bytes_per_s)}, "
                f"d2h {_moved(self.d2h_bytes, self.d2h_bytes_per_s)}, "
                f"{self.copy_hidden_frac:.0%} hidden | recompute {_share(self.recompute_frac)} | "
                f"optimizer {_share(self.optimizer_frac)}")

    def table(self) -> str:
        """A few lines for people: the partition of the wall, then streams and bytes."""
        w = self.wall_s or 1.0
        rows = [(f"step {self.step} breakdown ({self.clock.value} clock), wall "
                 f"{self.wall_s * 1e3:.1f} ms:")]
        for label, t in (("compute busy", self.compute_busy_s),
                         ("exposed copy", self.copy_exposed_s),
                         ("exposed host", self.host_exposed_s), ("idle", self.idle_s)):
            rows.append(f"  {label:<13}{t * 1e3:10.1f} ms {t / w:6.1%}")
        rows.append(f"  streams: h2d {self.h2d_busy_s * 1e3:.1f} ms, d2h "
                    f"{self.d2h_busy_s * 1e3:.1f} ms, host {self.host_busy_s * 1e3:.1f} ms; "
                    f"copy hidden {self.copy_hidden_frac:.1%}")
        rows.append(f"  bytes: h2d {_moved(self.h2d_bytes, self.h2d_bytes_per_s)}, d2h "
                    f"{_moved(self.d2h_bytes, self.d2h_bytes_per_s)}")
        rows.append(f"  recompute {self.recompute_frac:.1%} of compute, optimizer "
                    f"{self.optimizer_frac:.1%} of wall, {self.n_spans} spans")
        return "\n".join(rows)


def ceilings(tokens: int, compute_busy_s: float, recompute_s: float,
             attention_s: float = 0.0) -> dict[str, float | None]:
    """What a better schedule alone could reach at the kernel rates a step ran at, tok/s:
    'no_stalls' (every copy, host call and bubble hidden), 'no_recompute' (that, and every
    activation kept: more memory), 'attention_alone' (its non-recompute attention, which no
    schedule removes; None when unknown). A target above 'no_recompute' needs faster kernels."""
    def rate(seconds: float) -> float | None:
        return tokens / seconds if seconds > 0 else None

    return {"no_stalls": rate(compute_busy_s), "no_recompute": rate(compute_busy_s - recompute_s),
            "attention_alone": rate(attention_s)}


def _bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps them above 1 ('16.0 KiB', '1.52 GiB')."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if scale < 2**30 else f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _moved(nbytes: int, rate: float) -> str:
    """'none' when nothing moved (a rate of nothing says nothing), else bytes and rate."""
    return "none" if nbytes <= 0 else f"{_bytes(nbytes)} at {rate / 1e9:.1f} GB/s"


def _share(frac: float) -> str:
    """A share as %, with '0%' kept for exactly nothing and '<1%' for a trace of it."""
    return "0%" if frac <= 0 else ("<1%" if frac < 0.005 else f"{frac:.0%}")


ALWAYS_REDERIVED = ("rms_norm_fwd", "swiglu_fwd")
"""Forward ops the backward re-runs untagged at every saved-activation level (the input norm,
and at FULL the FFN norm; SwiGLU from saved gate/up until swiglu_bwd wrote its output, so older
traces have it): cheap re-derivations, not the recompute a plan chooses, so not counted in
recompute_s."""


def is_level_recompute(name: str) -> bool:
    """A backward span re-running forward work because of its chunk's saved-activation level."""
    return is_recompute(name) and name.rsplit(".", 1)[-1] not in ALWAYS_REDERIVED


def is_attention(name: str) -> bool:
    """A fused attention op of the forward or the backward ('f.L3.c0.attention_fwd',
    'b.L3.c1.attention_bwd_own'), recompute included (is_level_recompute tells those apart)."""
    parts = name.split(".")
    op = parts[-2] if parts[-1] == "re" and len(parts) > 1 else parts[-1]
    return op.startswith("attention_")


def compute_breakdown(trace: StepTrace) -> StepBreakdown:
    """The StepBreakdown of one step; spans are clipped to the step's window."""
    lo, hi = trace.start_s, trace.end_s
    by_stream: dict[Stream, Intervals] = defaultdict(list)
    recompute, optimizer, attention = [], [], []
    nbytes = {Stream.H2D: 0, Stream.D2H: 0}
    for s in trace.spans:
        iv = (max(lo, s.start_s), min(hi, s.end_s))
        if iv[1] <= iv[0]:
            iv = None
        # a deferred update's write-backs (the OPT stream) cross the D2H link
        stream = Stream.D2H if s.stream is Stream.OPT and s.nbytes else s.stream
        if stream in nbytes:
            nbytes[stream] += s.nbytes
        if iv is None:
            continue
        by_stream[stream].append(iv)
        if s.stream is Stream.COMPUTE and is_level_recompute(s.name):
            recompute.append(iv)
        elif s.stream is Stream.COMPUTE and is_attention(s.name):
            attention.append(iv)
        if is_optimizer(s.name):
            optimizer.append(iv)
    comp = union(by_stream[Stream.COMPUTE])
    h2d, d2h = union(by_stream[Stream.H2D]), union(by_stream[Stream.D2H])
    host = union(by_stream[Stream.HOST])
    copies = union(h2d + d2h)
    copy_exposed = subtract(copies, comp)
    host_exposed = subtract(subtract(host, comp), copies)
    wall = max(0.0, hi - lo)
    busy = length(comp)
    exposed_c, exposed_h = length(copy_exposed), length(host_exposed)
    return StepBreakdown(
        step=trace.step, clock=trace.clock, wall_s=wall, compute_busy_s=busy,
        copy_exposed_s=exposed_c, host_exposed_s=exposed_h,
        idle_s=max(0.0, wall - busy - exposed_c - exposed_h),
        h2d_busy_s=length(h2d), d2h_busy_s=length(d2h), host_busy_s=length(host),
        copy_busy_s=length(copies), copy_hidden_s=length(copies) - exposed_c,
        h2d_exposed_s=length(subtract(h2d, comp)), d2h_exposed_s=length(subtract(d2h, comp)),
        h2d_bytes=nbytes[Stream.H2D], d2h_bytes=nbytes[Stream.D2H],
        recompute_s=length(union(recompute)), optimizer_s=length(union(optimizer)),
        n_spans=len(trace.spans), attention_s=length(union(attention)))


def op_totals(spans: list[Span] | tuple[Span, ...], stream: Stream = Stream.COMPUTE
              ) -> list[tuple[str, float, int]]:
    """(op, seconds, count) on `stream`, largest first; the op is the name with its layer,
    chunk and block indices dropped ('b.L3.c0.linear_bwd_w' -> 'b.linear_bwd_w',
    'b.L3.c0.attention_fwd.re' -> 'b.attention_fwd.re', 'w.h2d3' -> 'w.h2d',
    'adamw.layer4.2' -> 'adamw', 'head.c0.loss' -> 'head.loss')."""
    tot: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for s in spans:
        if s.stream is stream:
            key = op_key(s.name)
            tot[key][0] += s.duration_s
            tot[key][1] += 1
    return sorted(((k, t, n) for k, (t, n) in tot.items()), key=lambda r: -r[1])


def op_key(name: str) -> str:
    """A span name without its layer, chunk and block indices (see op_totals)."""
    ring = RING_NAME.match(name)
    if ring:
        return f"{ring.group(1)}.{ring.group(2)}"
    parts = [p for p in name.split(".") if not _INDEX.fullmatch(p)]
    if parts and parts[0] in ("adamw", "zero_grads", "opt"):
        return ".".join(p for p in parts if p not in ("embed", "head"))
    return ".".join(parts)


_INDEX = re.compile(r"L\d+|c\d+|layer\d+|\d+")


# -- interval arithmetic over sorted, disjoint lists -------------------------------------------
def union(intervals: Intervals) -> Intervals:
    """Sorted disjoint intervals covering exactly the given ones."""
    out: Intervals = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def subtract(u: Intervals, v: Intervals) -> Intervals:
    """u minus v, both sorted and disjoint (as union returns them)."""
    out: Intervals = []
    j = 0
    for a, b in u:
        while j < len(v) and v[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(v) and v[k][0] < b:
            if v[k][0] > cur:
                out.append((cur, v[k][0]))
            cur = max(cur, v[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def length(u: Intervals) -> float:
    return sum(b - a for a, b in u)
