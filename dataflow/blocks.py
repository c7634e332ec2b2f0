"""Typed blocks: the embedding, each layer and the head, with the device and home views of their
weights, gradients and AdamW m / v bound to the arenas' regions. The engine reads and writes
state through these; the executor's hot loop works on the schedule's byte ranges instead.
Never decides placement (a view exists exactly where the plan put a region)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dataflow.arena import Arena
from dataflow.memplan.plan.plan import LayerPlacement, Where
from dataflow.models.fp8_layout import fp8_layer_layout
from dataflow.models.layout import BlockKind, embed_layout, head_layout, layer_layout

PARTS = ("weights", "grads", "m", "v")
BLOCK_PARTS = ("weights", "m", "v")
"""The parts of a block that persist across steps (gradients are cleared by every step)."""


def block_parts(plan, kind: BlockKind, layer: int | None = None) -> tuple[str, ...]:
    """The persistent parts of a block under `plan`: weights, m and v; the weights alone for a
    frozen block (Plan.frozen), which has no AdamW state."""
    if plan.frozen.block("layer" if kind is BlockKind.LAYER else kind.value, layer):
        return ("weights",)
    return BLOCK_PARTS


@dataclasses.dataclass(frozen=True, slots=True)
class BlockKey:
    """Which block: the embedding, layer `layer` (its index in the plan) or the head. Typed, so
    code asks for `key.layer` instead of parsing it out of a region name."""

    kind: BlockKind
    layer: int | None = None

    @classmethod
    def of_layer(cls, layer: int) -> "BlockKey":
        return cls(BlockKind.LAYER, layer)

    @property
    def region(self) -> str:
        """The prefix of the block's regions in the plan's table: 'embed', 'layer3', 'head'
        (dataflow.memplan.plan.memory names them so)."""
        return f"layer{self.layer}" if self.kind is BlockKind.LAYER else self.kind.value


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    kind: BlockKind
    layer: int | None
    placement: LayerPlacement
    numel: int
    layout: Any
    views: dict
    """(part, 'device' | 'home') -> array view, for the copies that exist."""

    @property
    def key(self) -> BlockKey:
        return BlockKey(self.kind, self.layer)

    def device(self, part: str):
        """The device copy of `part`, or None (streamed through slots, or home only)."""
        return self.views.get((part, "device"))

    def home(self, part: str):
        """The pinned host copy of `part`, or None."""
        return self.views.get((part, "home"))

    @property
    def resident(self) -> bool:
        """The weights live on the device for the whole step (not only in a slot)."""
        return self.placement.weights is Where.DEVICE


def _bind(kind, layer, placement, layout, dev: Arena, host: Arena, gdt: str) -> Block:
    key = BlockKey(kind, layer).region
    views = {}
    for part in PARTS:
        dt = gdt if part == "grads" else "bf16"
        for where, arena, name in (("device", dev, f"{key}.{part}"),
                                   ("home", host, f"home.{key}.{part}")):
            if arena.has(name):
                # A split update's replica holds m / v for its part alone, in smaller regions
                # (dataflow.memplan.step.ring_split): its views are as long as they are.
                n = layout.numel if part in ("weights", "grads") else \
                    min(layout.numel, arena.nbytes(name) // 2)
                views[(part, where)] = arena.view(name, (n,), dt)
    return Block(kind, layer, placement, layout.numel, layout, views)


def bind_blocks(plan, dev: Arena, host: Arena, gdt: str) -> tuple[Block, tuple[Block, ...], Block]:
    """(embed, layers, head) bound to the arenas of `plan`."""
    cfg = plan.model
    # an fp8 base's layer blocks hold E4M3 codes and row scales (dataflow.fp8_base)
    lay = fp8_layer_layout(cfg) if plan.lora is not None and plan.lora.fp8_base \
        else layer_layout(cfg)
    layers = tuple(_bind(BlockKind.LAYER, i, p, lay, dev, host, gdt)
                   for i, p in enumerate(plan.layers))
    return (_bind(BlockKind.EMBED, None, plan.embed, embed_layout(cfg), dev, host, gdt), layers,
            _bind(BlockKind.HEAD, None, plan.head, head_layout(cfg), dev, host, gdt))
