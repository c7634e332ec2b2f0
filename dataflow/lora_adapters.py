"""The LoRA adapters of a plan on the device (Plan.lora; docs/lora.md): binds the planner's
lora.* regions to named views (fp32 master a and b, their fp32 gradients and AdamW m / v, the
bf16 working copy the GEMMs read, the (T, r) bf16 intermediates: u = s (dy b) and one
s (x a^T) per target), and enqueues the adapters'
own step work on the compute stream: their share of the gradient norm, their AdamW, the
working copy's refresh and the gradients' zeroing. Never decides placement and never calls
CuPy or NumPy kernels directly (everything goes through the backend's op table)."""

from __future__ import annotations

import dataclasses

import numpy as np

from dataflow.backend import Backend, Stream
from dataflow.kernels.reference.lora import lora_init
from dataflow.memplan.plan.lora import Lora, adapter_specs, target_shape


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    """One adapted linear of one layer: a (r, I), b (O, r) as the GEMMs read them (bf16), their
    gradients da, db (fp32, accumulated over a step's chunks and rounds)."""

    a: object
    b: object
    da: object
    db: object


@dataclasses.dataclass(frozen=True, slots=True)
class LayerAdapters:
    """What LayerCompute reads for one layer: its adapters by target ('q', ..., 'down'), the
    scale alpha / r, and the (T, r) bf16 intermediates (shared by all layers: the compute
    stream runs one layer at a time): u, the backward's s (dy b), and xa, by target, each
    target's s (x a^T), so a backward's recompute leaves every one for its db."""

    by_target: dict
    scale: float
    u: object
    xa: dict


class DeviceAdapters:
    """The lora.* regions of `arena` (dataflow.arena.Arena) as views; `layer(i)` is what the
    layer compute of layer i reads."""

    def __init__(self, be: Backend, arena, cfg, lora: Lora, chunk_tokens: int):
        self.be, self.cfg, self.lora = be, cfg, lora
        self.specs = adapter_specs(cfg, lora)
        n = sum(s[0] * s[1] for *_, s in self.specs)
        self.n = n
        self.flat = {part: arena.view(f"lora.{part}", (n,), "f32")
                     for part in ("weights", "grads", "m", "v")}
        self.work = arena.view("lora.work", (n,), "bf16")
        r, t = lora.rank, chunk_tokens
        self.u = arena.view("lora.work", (t, r), "bf16", byte_offset=2 * n)
        self.xa = {target: arena.view("lora.work", (t, r), "bf16",
                                      byte_offset=2 * n + 2 * t * r * (1 + i))
                   for i, target in enumerate(lora.targets)}
        """target -> its (T, r) s (x a^T), after u, in lora.targets' order
        (dataflow.memplan.plan.lora.region_sizes counts them)."""
        self.offsets = []
        """(layer, target, 'a'|'b', shape, start) of each matrix in the flat regions."""
        at = 0
        for layer, target, ab, shape in self.specs:
            self.offsets.append((layer, target, ab, shape, at))
            at += shape[0] * shape[1]
        self._layers = [self._bind(i) for i in range(cfg.n_layers)]

    def _bind(self, layer: int) -> LayerAdapters:
        parts: dict = {}
        for lay, target, ab, shape, at in self.offsets:
            if lay != layer:
                continue
            n = shape[0] * shape[1]
            parts.setdefault(target, {})[ab] = (self.work[at:at + n].reshape(shape),
                                                self.flat["grads"][at:at + n].reshape(shape))
        by_target = {t: Adapter(a=p["a"][0], b=p["b"][0], da=p["a"][1], db=p["b"][1])
                     for t, p in parts.items()}
        return LayerAdapters(by_target, self.lora.scale, self.u, self.xa)

    def layer(self, i: int) -> LayerAdapters:
        return self._layers[i]

    # -- the step's adapter work, on the compute stream -------------------------------------
    def add_sumsq(self, out) -> None:
        """Add the adapters' squared gradient norm into the device scalar `out` (1,) fp32: the
        global norm clipping reads is over everything that trains."""
        self.be.launch(Stream.COMPUTE, "sumsq", self.flat["grads"], out, True, name="lora.gnorm")

    def update(self, hyper: tuple, clip_scale) -> None:
        """AdamW over every adapter (fp32 master, gradient, m, v) with the step's (step, lr,
        beta1, beta2, eps, weight_decay) and the device clip scale, then the bf16 working copy
        refreshed from the masters. The gradients stay (state() reads them) until zero_grads
        at the start of the next step."""
        f, be = self.flat, self.be
        be.launch(Stream.COMPUTE, "adamw_step", f["weights"], f["grads"], f["m"], f["v"], *hyper,
                  clip_scale, name="lora.adamw")
        self.refresh()

    def zero_grads(self) -> None:
        """Zero the gradients before a step's first backward (compute stream order)."""
        self.be.launch(Stream.COMPUTE, "fill_", self.flat["grads"], 0.0, name="lora.zero_grads")

    def refresh(self) -> None:
        """The bf16 working copy from the fp32 masters."""
        self.be.launch(Stream.COMPUTE, "cast", self.flat["weights"], self.work, name="lora.work")

    # -- state (setup, checkpoints, tests) ----------------------------------------------------
    def state(self, download) -> dict[str, np.ndarray]:
        """{'layers.{i}.{target}.{a|b}{|.m|.v}': fp32 array} of every adapter and its AdamW
        state, read through `download` (Executor.download)."""
        host = {part: download(v) for part, v in self.flat.items()}
        out = {}
        for layer, target, ab, shape, at in self.offsets:
            n = shape[0] * shape[1]
            key = f"layers.{layer}.{target}.{ab}"
            for part, suffix in (("weights", ""), ("m", ".m"), ("v", ".v"), ("grads", ".grad")):
                out[key + suffix] = np.array(host[part][at:at + n].reshape(shape))
        return out

    def load(self, tensors: dict[str, np.ndarray], upload, parts=("weights", "m", "v")) -> None:
        """Write adapters (and AdamW state) from `tensors` keyed as state() names them through
        `upload` (Executor.upload); a part missing from `tensors` is zeroed (m, v of a fresh
        adapter). Refreshes the working copy and zeroes the gradients."""
        suffix = {"weights": "", "m": ".m", "v": ".v"}
        for part in ("weights", "m", "v", "grads"):
            flat = np.zeros(self.n, np.float32)
            if part in parts:
                for layer, target, ab, shape, at in self.offsets:
                    key = f"layers.{layer}.{target}.{ab}{suffix[part]}"
                    if key in tensors:
                        arr = np.asarray(tensors[key], np.float32)
                        if arr.shape != tuple(shape):
                            raise ValueError(f"adapter {key} has shape {arr.shape}; this model's "
                                             f"is {tuple(shape)}")
                        flat[at:at + arr.size] = arr.reshape(-1)
                    elif part == "weights":
                        raise KeyError(f"adapter {key} is missing")
            upload(self.flat[part], flat)
        self.refresh()
        self.be.synchronize()


def peft_init(cfg, lora: Lora, seed: int) -> dict[str, np.ndarray]:
    """Fresh adapters as PEFT initialises them (a uniform in +-1/sqrt(in), b zeros), from a
    numpy generator seeded with `seed`, keyed as DeviceAdapters.state names them."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(cfg.n_layers):
        for target in lora.targets:
            n_in, n_out = target_shape(cfg, target)
            a, b = lora_init(n_in, n_out, lora.rank, rng)
            out[f"layers.{layer}.{target}.a"], out[f"layers.{layer}.{target}.b"] = a, b
    return out
