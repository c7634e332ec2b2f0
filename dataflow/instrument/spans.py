"""Spans: one record per op, copy or host call the executor enqueued during a step, with its
stream, its name, the bytes a copy moved and when it ran (seconds since the tracer started).
Also reads the step/round/layer/chunk and the category out of the names the executor gives
its work ("f.L3.c1.linear_fwd", "w.h2d3", "act.d2h(2, 0)", "adamw.layer4"). Pure Python: never
imports array libraries and never touches a device or the clock."""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

from dataflow.backend import Stream


class SpanKind(enum.Enum):
    OP = "op"
    """An op of the backend's op table (Backend.launch)."""
    COPY = "copy"
    """An async copy (Backend.copy); carries its byte count."""
    HOST = "host"
    """A CPU function ordered on a stream (Backend.host_call)."""


class Clock(enum.Enum):
    HOST = "host"
    """time.perf_counter around the callable as it actually runs (NumPy backend)."""
    CUDA_EVENTS = "cuda_events"
    """Timing-enabled CUDA events recorded on the op's stream before and after it."""


class Span(NamedTuple):
    """One op, copy or host call as it ran. A NamedTuple rather than a frozen dataclass: a big
    step makes tens of thousands, and building these is on the end-of-step path."""

    step: int
    round: int | None
    """Round of the step (counted from the executor's per-round "tokens.ids" copy);
    None before the first round and for the optimizer."""
    stream: Stream
    name: str
    kind: SpanKind
    nbytes: int
    """Bytes moved, for copies; 0 otherwise."""
    start_s: float
    """Seconds since the tracer was created."""
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


# -- names ------------------------------------------------------------------------------------
ROUND_MARKER = "tokens.ids"
"""The first copy of every round (its token ids to the device), enqueued when the round begins;
the tracer counts rounds by it. (The host staging of a round's data runs one round ahead, so it
cannot mark the round.)"""

OPTIMIZER_PREFIXES = ("adamw", "opt.", "zero_grads")
"""Optimizer work: AdamW launches and host calls ("adamw.layer4", "adamw.host.embed",
"adamw.head.3"), the copies of a streamed update ("opt.h2d.head") and the gradient zeroing
that follows an update ("zero_grads.layer4")."""

RECOMPUTE_OPS = ("rms_norm_fwd", "linear_fwd", "rope_fwd", "swiglu_fwd", "attention_fwd")
"""Forward ops. Launched under a backward tag ("b.L3.c0.linear_fwd") they can only be recompute:
dataflow/layer_ops.py re-runs the forward pieces a saved-activation level left out, tagging the
attention and FFN ones '.re' ("b.L3.c0.attention_fwd.re") but not the input norm, q projection
and rope. The one recompute op this misses is the 'cast' of x into the residual buffer, which
the backward also uses for non-recompute work."""

RING_NAME = re.compile(r"^(w|g|act|headw|headg)\.(h2d|d2h|zero)(.*)$")
_RING_CATEGORY = {"w": "weights", "headw": "weights", "g": "grads", "headg": "grads",
                  "act": "activations"}
_LAYER = re.compile(r"(?:^|\.)L(\d+)(?=\.|$)")
_CHUNK = re.compile(r"(?:^|\.)c(\d+)(?=\.|$)")
_BLOCK = re.compile(r"(?:^|\.)layer(\d+)(?=\.|$)")
_PAIR = re.compile(r"^\((\d+), (\d+)\)$")


def is_recompute(name: str) -> bool:
    """A compute op of the backward that re-runs forward work (see RECOMPUTE_OPS)."""
    if not name.startswith("b."):
        return False
    parts = name.split(".")
    return parts[-1] == "re" or parts[-1] in RECOMPUTE_OPS


def is_optimizer(name: str) -> bool:
    return name.startswith(OPTIMIZER_PREFIXES)


def category(name: str) -> str:
    """One of forward, recompute, backward, head, embed, context, optimizer, weights, grads,
    activations, data, other."""
    if is_optimizer(name):
        return "optimizer"
    ring = RING_NAME.match(name)
    if ring:
        return _RING_CATEGORY[ring.group(1)]
    if name.startswith("f."):
        return "forward"
    if name.startswith("b."):
        return "recompute" if is_recompute(name) else "backward"
    for prefix, cat in (("head.", "head"), ("embed.", "embed"), ("ctx.", "context"),
                        ("tokens.", "data")):
        if name.startswith(prefix):
            return cat
    return "other"


def parse_name(name: str) -> dict:
    """{'layer': int, 'chunk': int, 'category': str} with layer/chunk only where the name has
    them: 'f.L3.c1.linear_fwd' -> layer 3, chunk 1; 'w.h2d3' -> layer 3; 'act.d2h(2, 0)' ->
    layer 2, chunk 0; 'adamw.layer4.2' -> layer 4; 'head.c0.loss' -> chunk 0."""
    out: dict = {"category": category(name)}
    ring = RING_NAME.match(name)
    if ring:
        key = ring.group(3)
        pair = _PAIR.match(key)
        if key.isdigit():
            out["layer"] = int(key)
        elif pair:
            out["layer"], out["chunk"] = int(pair.group(1)), int(pair.group(2))
        return out
    for field, pattern in (("layer", _LAYER), ("chunk", _CHUNK), ("layer", _BLOCK)):
        m = pattern.search(name)
        if m and field not in out:
            out[field] = int(m.group(1))
    return out
