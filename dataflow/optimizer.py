"""AdamW driver: after the last round of a step, update every block where the plan says — on the
device over resident state, streamed through the device in double-buffered pieces, or on the
host over the home copies — then zero what accumulates in place. Hyperparameters live here; the
maths lives in the op tables. Never decides placement."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from dataflow import ops_numpy
from kernels.host import adamw as host_adamw
from dataflow.backend import Stream
from memplan import buffers
from memplan.plan import OptimizerWhere


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AdamWConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this value (None: no clipping)."""

    def __post_init__(self) -> None:
        from models.errors import ConfigError

        if not self.lr >= 0:
            raise ConfigError(f"lr must be >= 0, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"betas must lie in [0, 1), got {self.beta1}, {self.beta2}")
        if not self.eps > 0 or not self.weight_decay >= 0:
            raise ConfigError(f"eps must be > 0 and weight_decay >= 0, got {self.eps}, "
                              f"{self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be positive, got {self.max_grad_norm}")


class AdamW:
    def __init__(self, config: AdamWConfig, schedule: Callable[[int], float] | None = None):
        self.config = config
        self.schedule = schedule
        """Optional hook: step (1-based) -> lr, replacing config.lr."""
        self.step_count = 0
        self.last_grad_norm: float | None = None
        self._stage_free = [None, None]

    def lr(self) -> float:
        return self.schedule(self.step_count) if self.schedule else self.config.lr

    def step(self, ex) -> None:
        """Update every block of executor `ex`; enqueued on the streams the plan implies."""
        self.step_count += 1
        cfg = self.config
        scale = 1.0
        if cfg.max_grad_norm is not None:
            norm = self._grad_norm(ex)
            self.last_grad_norm = norm
            scale = min(1.0, cfg.max_grad_norm / (norm + 1e-6))
        hp = (self.step_count, self.lr(), cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, scale)
        for key, b in ex.blocks.items():
            where = b["place"].optimizer
            if where is OptimizerWhere.DEVICE:
                self._device(ex, key, b, hp)
            elif where is OptimizerWhere.HOST:
                self._host(ex, key, b, hp)
            else:
                self._streamed(ex, key, b, hp)

    def _grad_norm(self, ex) -> float:
        """Global L2 norm of the step's gradients (one host sync, between steps)."""
        ex.be.synchronize()
        total = 0.0
        for b in ex.blocks.values():
            g = b["dev_grads"] if b["dev_grads"] is not None else b["home_grads"]
            total += float(np.sum(np.square(ex.download(g).astype(np.float64))))
        return float(np.sqrt(total))

    def _device(self, ex, key, b, hp) -> None:
        be = ex.be
        be.launch(Stream.COMPUTE, "adamw_step", b["dev_weights"], b["dev_grads"], b["dev_m"],
                  b["dev_v"], *hp, name=f"adamw.{key}")
        be.launch(Stream.COMPUTE, "fill_", b["dev_grads"], 0.0, name=f"zero_grads.{key}")

    def _ring_for(self, ex, key):
        if key.startswith("layer"):
            return ex.wring, ex.gring, int(key[5:])
        if key == "head":
            return ex.head_w_ring, ex.head_g_ring, "head"
        return None, None, key

    def _grads_ready(self, ex, key, stream) -> None:
        _, gring, gkey = self._ring_for(ex, key)
        if gring is not None and gkey in gring.host_ready:
            ex.be.wait(stream, gring.host_ready[gkey])
        if key == "embed" and getattr(ex, "embed_grads_ready", None) is not None:
            ex.be.wait(stream, ex.embed_grads_ready)

    def _weights_written(self, ex, key, event) -> None:
        """Later fetches of this block's weights wait for the update."""
        wring, _, wkey = self._ring_for(ex, key)
        if wring is not None:
            wring.host_ready[wkey] = event
        if key == "embed":
            ex._embed_host_ready = event

    def _host(self, ex, key, b, hp) -> None:
        be = ex.be
        self._grads_ready(ex, key, Stream.HOST)
        # The device may still be reading the home weights (a prefetch): order after it.
        be.wait(Stream.HOST, be.record(Stream.H2D))
        p, g, m, v = b["home_weights"], b["home_grads"], b["home_m"], b["home_v"]
        be.host_call(Stream.HOST, lambda: host_adamw.adamw_step(p, g, m, v, *hp),
                     reads=(g,), writes=(p, m, v), name=f"adamw.host.{key}")
        self._weights_written(ex, key, be.record(Stream.HOST))
        self._zero_home_grads(ex, key, b)

    def _zero_home_grads(self, ex, key, b) -> None:
        """The embedding's home gradient accumulates in place on the host (layers' home
        gradients restart from a zero fill in round 0 instead), so clear it for the next step."""
        if key != "embed":
            return
        be, g = ex.be, b["home_grads"]
        be.wait(Stream.HOST, be.record(Stream.H2D))  # a streamed update may still read it
        be.host_call(Stream.HOST, lambda: ops_numpy.fill_(g, 0.0), writes=(g,),
                     name="zero_grads.embed")
        ex.embed_grads_ready = be.record(Stream.HOST)

    def _streamed(self, ex, key, b, hp) -> None:
        """Pieces of opt_stage_elems: H2D p, g, m, v -> AdamW on compute -> D2H p, m, v."""
        be = ex.be
        n_stage = ex.plan.slots.opt_stage_elems
        specs = buffers.opt_stage_specs(n_stage, ex.gdt)
        stage = ex.dev.tensors("opt_stage", specs)
        self._grads_ready(ex, key, Stream.H2D)
        be.wait(Stream.H2D, be.record(Stream.COMPUTE))
        home = (b["home_weights"], b["home_grads"], b["home_m"], b["home_v"])
        free = self._stage_free  # staging halves stay busy across blocks until their D2H is done
        for i, start in enumerate(range(0, b["numel"], n_stage)):
            n = min(n_stage, b["numel"] - start)
            buf = i % 2
            dev = [stage[f"{x}{buf}"][:n] for x in "pgmv"]
            if free[buf] is not None:
                be.wait(Stream.H2D, free[buf])
            for d, h in zip(dev, home):
                ex._copy(d, h[start:start + n], Stream.H2D, f"opt.h2d.{key}")
            be.wait(Stream.COMPUTE, be.record(Stream.H2D))
            be.launch(Stream.COMPUTE, "adamw_step", *dev, *hp, name=f"adamw.{key}.{i}")
            be.wait(Stream.D2H, be.record(Stream.COMPUTE))
            for d, h in zip((dev[0], dev[2], dev[3]), (home[0], home[2], home[3])):
                ex._copy(h[start:start + n], d, Stream.D2H, f"opt.d2h.{key}")
            free[buf] = be.record(Stream.D2H)
        self._weights_written(ex, key, be.record(Stream.D2H))
        self._zero_home_grads(ex, key, b)
