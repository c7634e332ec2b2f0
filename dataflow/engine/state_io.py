"""The Engine's state in and out: every block's weights, AdamW m and v read and written wherever
the plan put them (one block in host memory at a time), as transformers-named state dicts, as
ModelWeights, or block by block (BlockRef) for checkpoints and exports. Settles a pending
deferred update before it reads or writes; never decides placement and never trains."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from dataflow.block_io import read_part, write_part, zero_state
from dataflow.blocks import BLOCK_PARTS, Block, block_parts
from dataflow.fp8_base import from_stored, to_stored, user_layout, write_weights
from dataflow.models.errors import ConfigError
from dataflow.models.init import ModelWeights
from dataflow.models.layout import BlockKind


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRef:
    """One block of the model: the embedding, layer `layer`, or the head (final norm + lm_head;
    the norm alone when the head is tied to the embedding, ModelConfig.tie_embeddings).
    Weights, AdamW m and v of a block share its layout (`Engine.layout(ref)`)."""

    kind: BlockKind
    layer: int | None = None

    @property
    def name(self) -> str:
        return f"layers.{self.layer}" if self.kind is BlockKind.LAYER else self.kind.value




class StateIO:
    """Reads and writes the blocks of a started engine. `steps` (dataflow.engine.steps.StepRunner)
    settles a pending deferred update first and forgets a failed step once a state is loaded."""

    def __init__(self, plan, be, ex, optimizer, steps):
        self.plan, self.be, self.ex, self.optimizer, self.steps = plan, be, ex, optimizer, steps

    def targets(self) -> tuple[Block, ...]:
        """Every block, in model order: embed, layers 0..L-1, head."""
        return self.ex.blocks()

    def zero_state(self) -> None:
        """Zero gradients and AdamW m, v wherever they live (dataflow.block_io.zero_state: host
        memory in parallel, pages that already read as zero left unwritten, so a fresh slab is
        neither written nor faulted in for nothing)."""
        self.be.synchronize()  # once: nothing is queued that touches this state yet
        for b in self.ex.blocks():
            zero_state(self.be, b)

    def discard_failed_step(self) -> None:
        """What a failed step left (pending updates, half-accumulated gradients, m and v), gone
        before a checked checkpoint is written over it (Engine.load_checkpoint)."""
        self.ex.drop_pending()
        self.zero_state()

    def write(self, b: Block, array: np.ndarray, part: str = "weights") -> None:
        """Block `b`'s `part` = `array` (an fp8 base's bf16 layer block quantised once, into
        its home copy where it has one: dataflow.fp8_base)."""
        if part == "weights" and write_weights(self.ex, self.be, b, array):
            return
        write_part(self.ex, self.be, b, to_stored(b, array, part), part)

    def read(self, b: Block, part: str) -> np.ndarray:
        """A host copy of `part` in the block's user layout (an fp8 base's layer dequantised)."""
        return from_stored(b, self.read_stored(b, part), part)

    def read_stored(self, b: Block, part: str) -> np.ndarray:
        """A host copy of `part` as stored (an fp8 base's layer: its codes and scales' bytes)."""
        self.steps.settle()
        return read_part(self.ex, self.be, b, part)

    # -- whole model ------------------------------------------------------------------------------
    def weights(self) -> ModelWeights:
        """The current parameters as host copies."""
        ex = self.ex
        embed = self.read(ex.embed, "weights")
        layers = [self.read(b, "weights") for b in ex.layers]
        return ModelWeights(self.plan.model, embed, layers, self.read(ex.head, "weights"))

    def state_dict(self) -> dict[str, np.ndarray]:
        """Engine.state_dict (which documents it)."""
        out: dict[str, np.ndarray] = {}
        for b in self.targets():
            lay = self.layout_of(b.kind)
            names = block_parts(self.plan, b.kind, b.layer)  # a frozen block: weights only
            parts = {suffix: self.read(b, part) for suffix, part in (
                ("", "weights"), (".exp_avg", "m"), (".exp_avg_sq", "v")) if part in names}
            for t in lay.tensors:
                name = lay.full_name(t.name, b.layer)
                for suffix, block in parts.items():
                    prefix = "optimizer." if suffix else ""
                    out[prefix + name + suffix] = lay.view(block, t.name).copy()
        out["optimizer.step"] = np.array(self.optimizer.step_count, dtype=np.int64)
        return out

    def load_state_dict(self, state: dict, weights_only: bool) -> None:
        """Engine.load_state_dict (which documents it): every problem is found before anything
        is written."""
        writes, step = self._checked_writes(state, weights_only)
        self.ex.drop_pending()  # every block it would update is overwritten or zeroed
        self.zero_state()  # grads (half-accumulated after a failed step), m and v
        bf16 = np.dtype(ml_dtypes.bfloat16)
        for b, part, lay, arrays in writes:
            block = np.zeros(lay.numel, dtype=bf16)
            for tensor, value in arrays.items():
                lay.view(block, tensor)[...] = value
            self.write(b, block, part)
        self.optimizer.step_count = step
        self.optimizer.last_grad_norm = None
        self.steps.failed_step = None
        self.be.synchronize()

    def _checked_writes(self, state: dict, weights_only: bool) -> tuple[list, int]:
        """([(block, part, layout, {tensor name: array})], step) of `state`, or ConfigError
        listing every problem (nothing written)."""
        bf16 = np.dtype(ml_dtypes.bfloat16)
        parts = (("", "weights"),) if weights_only else \
            (("", "weights"), (".exp_avg", "m"), (".exp_avg_sq", "v"))
        problems: list[str] = []
        writes = []  # (block, part, layout, {tensor name: array}) once all are valid
        expected = {"optimizer.step"}
        for b in self.targets():
            lay = self.layout_of(b.kind)
            for suffix, part in parts:
                # a frozen block has no m or v: a state_dict's (one trained whole) is passed over
                frozen = part not in block_parts(self.plan, b.kind, b.layer)
                arrays = {}
                for t in lay.tensors:
                    name = ("optimizer." if suffix else "") + lay.full_name(t.name, b.layer) \
                        + suffix
                    expected.add(name)
                    if frozen:
                        continue
                    value, problem = _checked_tensor(state, name, t.shape, bf16)
                    if problem:
                        problems.append(problem)
                    else:
                        arrays[t.name] = value
                if not frozen:
                    writes.append((b, part, lay, arrays))
        unknown = sorted(k for k in state if k not in expected
                         and not (weights_only and str(k).startswith("optimizer.")))
        if unknown:
            problems.append(f"unknown key(s) {', '.join(repr(k) for k in unknown[:5])}"
                            f"{' ...' if len(unknown) > 5 else ''} (a state_dict of another "
                            "model? drop them)")
        step = 0
        if not weights_only and "optimizer.step" in state:
            raw = np.asarray(state["optimizer.step"])
            if raw.ndim != 0 or raw.dtype.kind not in "iu" or int(raw) < 0:
                problems.append(f"'optimizer.step' is {state['optimizer.step']!r}; it must be a "
                                "whole number >= 0 (or load with weights_only=True)")
            else:
                step = int(raw)
        if problems:
            raise ConfigError(f"state_dict does not fit {self.plan.model.name} "
                              f"({len(problems)} problem(s), nothing was loaded): "
                              + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
        return writes, step

    # -- block by block (stable API for checkpoints and interop) ----------------------------------
    def block_refs(self) -> tuple[BlockRef, ...]:
        return tuple(BlockRef(b.kind, b.layer) for b in self.targets())

    def layout_of(self, kind: BlockKind):
        """The layout every block of `kind` shares (tensors, numel, views)."""
        ex = self.ex
        return user_layout({BlockKind.EMBED: ex.embed, BlockKind.LAYER: ex.layers[0],
                            BlockKind.HEAD: ex.head}[kind].layout)

    def block(self, ref: BlockRef) -> Block:
        ex = self.ex
        return ex.layers[ref.layer] if ref.kind is BlockKind.LAYER else \
            ex.embed if ref.kind is BlockKind.EMBED else ex.head

    def read_block(self, ref: BlockRef, part: str) -> np.ndarray:
        self._check_part(ref, part)
        return self.read(self.block(ref), part)

    def write_block(self, ref: BlockRef, array: np.ndarray, part: str) -> None:
        self._check_part(ref, part)
        self.steps.settle()  # else the pending update would land on top of the written bytes
        self.write(self.block(ref), array, part)
        self.be.synchronize()

    def pretrained_blocks(self):
        """(kind, layer, weights) of every block, read one at a time (save_pretrained's)."""
        return ((ref.kind, ref.layer, self.read_block(ref, "weights"))
                for ref in self.block_refs())


    def _check_part(self, ref: BlockRef, part: str) -> None:
        if part not in BLOCK_PARTS:
            raise ConfigError(f"block part '{part}' is not one of {', '.join(BLOCK_PARTS)}")
        if part not in block_parts(self.plan, ref.kind, ref.layer):
            raise ConfigError(f"block {ref.name} is frozen ({self.plan.frozen.spec()}): it has "
                              f"weights only, no AdamW '{part}'")


def _checked_tensor(state: dict, name: str, shape: tuple, bf16: np.dtype):
    """(array, None) when state[name] can load into a tensor of `shape`, else (None, problem)."""
    if name not in state:
        return None, f"missing '{name}'"
    value = state[name]
    if not isinstance(value, np.ndarray):
        try:
            value = _as_numpy_any(value)
        except (TypeError, ValueError, RuntimeError, BufferError) as exc:
            return None, f"'{name}' is a {type(value).__name__} that NumPy cannot read ({exc})"
    dt = value.dtype
    if dt.kind == "V" and dt != bf16:
        if dt.itemsize != 2 or dt.fields is not None:
            return None, (f"'{name}' holds raw {dt.itemsize}-byte values ({dt.str}); save "
                          "bf16 with its dtype (ml_dtypes.bfloat16) or as float32")
        value = value.view(bf16)  # np.savez keeps bf16 as 2-byte void: same bits
    elif dt != bf16 and dt.kind != "f":
        return None, f"'{name}' has dtype {dt}; expected a float dtype (bf16, float16/32/64)"
    if tuple(value.shape) != tuple(shape):
        return None, f"'{name}' has shape {tuple(value.shape)}, expected {tuple(shape)}"
    if not np.isfinite(value).all():
        return None, f"'{name}' holds NaN or infinite values; load a healthy checkpoint"
    return value, None


def _as_numpy_any(value) -> np.ndarray:
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (TypeError, RuntimeError, BufferError):
            pass
    if hasattr(value, "get"):  # CuPy arrays
        value = value.get()
    return np.asarray(value)
