"""The Plan: every placement and schedule decision the executor obeys, as frozen dataclasses that
round-trip through JSON with a stable hash. A Plan embeds the model, budget and hardware profile
it was made from, so a plan file alone can be re-run and explained. Holds decisions only: never
imports array libraries and never computes them (search.py does)."""

from __future__ import annotations

import dataclasses
import enum
import math

from dataflow.memplan.plan.frozen import NOTHING_FROZEN, Frozen
from dataflow.memplan.plan.lora import Lora
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ConfigError
from dataflow.models.flops import SavedLevel
from dataflow.models.serial import from_json, stable_hash, to_json

GIB = 1 << 30


class Where(enum.Enum):
    DEVICE = "device"
    """Lives on the GPU for the whole step (a resident working copy)."""
    HOME = "home"
    """Lives in pinned host memory and visits the device in a slot when needed."""


class OptimizerWhere(enum.Enum):
    DEVICE = "device"
    """AdamW runs on the GPU over state resident there."""
    STREAMED = "streamed"
    """Param, grad, m and v live at home, visit the device for the update, and go back."""
    HOST = "host"
    """AdamW runs on the CPU over the home copies (numba, parallel)."""


class AttentionBwd(enum.Enum):
    DETERMINISTIC = "deterministic"
    """cuDNN's deterministic fused-attention backward for chunks that attend to themselves only
    (packed sequences): bit-identical run to run, plan to plan and rank to rank, at the price of
    a score-sized workspace (2*T*T*H bytes: 4.1 GiB for T = 8192 and 32 heads) and a slower
    kernel (444 against 518 TFLOP/s at 8k on the H100, bench/records/kernels-*.json)."""
    FAST = "fast"
    """cuDNN's atomic-dQ backward everywhere (split sequences always use it): a workspace of
    16*T*Hk*E + 4*T*H*E bytes (0.25 GiB at 8k for 8b) and the faster kernel; dQ's float sums
    may then differ in the last bits from run to run."""


class Precision(enum.Enum):
    BF16 = "bf16"
    """Every GEMM in bf16 with fp32 accumulation (the default, and every plan made before)."""
    FP8 = "fp8"
    """The block projections' GEMMs (q, k, v, o, gate, up, down; not the experts, attention or
    the head) in the FP8 recipe of docs/fp8.md: each linear op quantises its operands into the
    chunk workspace's FP8 scratch (buffers.fp8_scratch_specs)."""


class GradAccum(enum.Enum):
    BF16 = "bf16"
    """Accumulate weight gradients across rounds in bf16, as ml_dataflow does."""
    FP32 = "fp32"
    """Accumulate in fp32: twice the gradient bytes, no precision lost over many rounds."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    host_bytes: int
    device_bytes: int

    @classmethod
    def from_gib(cls, host_gib: float, device_gib: float) -> "Budget":
        """Budgets in GiB; a value that is not finite, or above MAX_BUDGET_GIB (where its bytes
        would overflow or stop being exact), is refused by name."""
        for what, gib in (("host", host_gib), ("device", device_gib)):
            if not (math.isfinite(gib) and gib <= MAX_BUDGET_GIB):
                raise ConfigError(f"{what} budget {gib:g} GiB is beyond any machine (at most "
                                  f"{MAX_BUDGET_GIB:,} GiB, 1 PiB); give its memory in GiB")
        return cls(host_bytes=int(host_gib * GIB), device_bytes=int(device_gib * GIB))


MAX_BUDGET_GIB = 1 << 20
"""1 PiB: far beyond any host or device, and small enough that its bytes are exact integers."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    name: str
    peak_bf16_flop_per_s: float
    """Datasheet dense bf16 peak: the denominator of MFU and HFU."""
    gemm_efficiency: float
    """Achieved fraction of peak for the layer GEMMs at large chunk sizes."""
    attn_fwd_efficiency: float
    attn_bwd_efficiency: float
    h2d_bytes_per_s: float
    """Pinned host->device copy rate when nothing else crosses PCIe."""
    d2h_bytes_per_s: float
    h2d_duplex_bytes_per_s: float
    """Host->device rate while a device->host copy runs at the same time."""
    d2h_duplex_bytes_per_s: float
    host_mem_bytes_per_s: float
    """Host DRAM bandwidth available to the CPU optimizer."""
    device_mem_bytes_per_s: float
    """HBM bandwidth (read + write counted), for memory-bound kernels and the optimizer."""
    pcie_gen: int
    device_mem_bytes: int
    """Physical device memory, to warn when a budget exceeds it."""
    library_reserve_bytes: int = 0
    """Device memory the libraries hold outside the arena after setup (cuDNN and cuBLAS handles,
    loaded kernel modules, CuPy's own state): part of the device budget, so the arena is the
    budget less this. Measured, not guessed (memplan/plan/profiles.py LIBRARY_RESERVE_BYTES)."""
    host_overhead_bytes: int = 0
    """Process memory beyond the pinned host arena (the interpreter, imported libraries, page
    tables, staging of loaded files): the plan states it, and the process RSS stays within the
    host budget plus this."""
    fp8_gemm_flop_per_s: float | None = dataclasses.field(default=None,
                                                          metadata={"omit_if_default": True})
    """Measured FP8 GEMM rate at large sizes (Plan.precision FP8): the built-in H200 profile's
    (memplan/plan/profiles.py) or one dataflow-probe measured; None elsewhere, and an
    FP8 plan's GEMMs are then predicted at the bf16 rate (no speedup claimed), the quantise
    passes counted all the same. Left out of the JSON while None."""
    host_copy_bytes_per_s: float | None = dataclasses.field(default=None,
                                                            metadata={"omit_if_default": True})
    """Host memory copy rate (read + write counted) of the host's row gathers: a HOME embedding
    table's rows of a round into pinned memory (np.take) and the round's token ids. A copy, not
    AdamW's arithmetic, so it runs far above host_mem_bytes_per_s: the built-in H200 profile's
    is measured (memplan/plan/profiles.py HOST_GATHER_BYTES_PER_S). None: host_mem_bytes_per_s
    (the old, pessimistic charge). Left out of the JSON while None."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Chunking:
    seqlen: int
    chunk_tokens: int
    """Tokens one layer processes at once: seqs_per_chunk * seqlen, or seqlen / chunks_per_seq."""
    seqs_per_chunk: int
    """Short sequences packed into one chunk (1 when a sequence spans chunks)."""
    chunks_per_seq: int
    """Chunks one long sequence is split into (1 when sequences are packed); later chunks
    attend to the K/V of earlier chunks of the same sequence."""
    chunks_per_round: int
    """A multiple of chunks_per_seq: a round holds whole sequences."""
    rounds_per_step: int

    @property
    def seqs_per_round(self) -> int:
        return self.chunks_per_round * self.seqs_per_chunk // self.chunks_per_seq

    @property
    def seqs_per_step(self) -> int:
        return self.seqs_per_round * self.rounds_per_step

    @property
    def tokens_per_round(self) -> int:
        return self.chunks_per_round * self.chunk_tokens

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_round * self.rounds_per_step

    def chunk_context(self, chunk: int) -> int:
        """Tokens of the same sequence that precede chunk `chunk` (its attention offset)."""
        return (chunk % self.chunks_per_seq) * self.chunk_tokens


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayerPlacement:
    weights: Where
    grads: Where
    """DEVICE: gradients accumulate on the device all step. HOME: each round's backward fetches
    the running sum into a grad slot (zeros in round 0), adds to it and sends it home."""
    optimizer: OptimizerWhere
    """DEVICE requires weights, grads and AdamW state on the device (state counted on device)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SavedActivation:
    level: SavedLevel
    home: Where
    """DEVICE: kept in the device arena from forward to backward. HOME: sent to pinned host memory
    after the forward and fetched back into an activation slot before the backward."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Slots:
    weight_slots: int
    """Device slots for streamed layer weight blocks (prefetch depth + the one in use)."""
    grad_slots: int
    """Device slots for streamed layer gradient blocks."""
    act_slots: int
    """Device slots for saved activations whose home is the host (fetch-ahead depth + one)."""
    head_sub_tokens: int
    """Tokens per head/cross-entropy sub-chunk (bounds the fp32 logits buffer)."""
    opt_stage_elems: int
    """Elements per piece when a block's AdamW is STREAMED through the device (0 if none is):
    param, grad, m and v of one piece visit the device, double-buffered."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MemoryMap:
    device: tuple[tuple[str, int], ...]
    """(category, bytes) on the device; categories: weights, grads, optimizer_state,
    saved_activations, workspaces, buffers."""
    host: tuple[tuple[str, int], ...]

    @property
    def device_bytes(self) -> int:
        return sum(b for _, b in self.device)

    @property
    def host_bytes(self) -> int:
        return sum(b for _, b in self.host)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    step_time_s: float
    compute_s: float
    recompute_s: float
    exposed_h2d_s: float
    exposed_d2h_s: float
    optimizer_s: float
    h2d_bytes: int
    d2h_bytes: int
    tok_per_s: float
    model_tflop_per_s: float
    mfu: float
    hfu: float
    bottleneck: str
    """What bounds the step: 'compute', 'h2d', 'd2h', 'optimizer' or 'host memory'."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    model: ModelConfig
    budget: Budget
    profile: HardwareProfile
    chunking: Chunking
    slots: Slots
    layers: tuple[LayerPlacement, ...]
    """One per transformer layer."""
    activations: tuple[tuple[SavedActivation, ...], ...]
    """activations[layer][chunk] for every chunk of a round."""
    embed: LayerPlacement
    """weights HOME: the host gathers embedding rows for each round and sends them, and
    scatter-adds the first layer's input gradient into the home gradient (no device table)."""
    head: LayerPlacement
    """Final norm + lm_head."""
    grad_accum: GradAccum
    memory: MemoryMap
    prediction: Prediction
    planner_version: str
    segment_layers: int = 1
    """Layer-segment recompute (memplan/plan/segments.py): k > 1 keeps the saved activations of layers
    0, k, 2k, ... only and rebuilds the others in the backward by re-running the segment's
    forward; their `activations` entries then say where and at which level the rebuilt ones
    live. 1 (the default, and every plan written before segments existed): none."""
    attention_bwd: AttentionBwd = dataclasses.field(default=AttentionBwd.DETERMINISTIC,
                                                    metadata={"omit_if_default": True})
    """Which fused-attention backward chunks that attend to themselves use (AttentionBwd); the
    plan reserves its workspace. Left out of the JSON (and hash) while deterministic."""
    holds_embed: bool = dataclasses.field(default=True, metadata={"omit_if_default": True})
    """False for a ring rank that does not own the embedding (dataflow.memplan.search.ring_plan): no region of
    the embedding's state or pinned rows exists on it. Left out of the JSON while True."""
    holds_head: bool = dataclasses.field(default=True, metadata={"omit_if_default": True})
    """False for a ring rank that does not own the final norm and lm_head: no region of the
    head's state or buffers exists on it. Left out of the JSON while True."""
    precision: Precision = dataclasses.field(default=Precision.BF16,
                                             metadata={"omit_if_default": True})
    """What the block projections' GEMMs compute in (Precision); the FP8 scratch is in the
    memory map when FP8. Left out of the JSON (and hash) while bf16."""
    kv_rebuild: bool = dataclasses.field(default=False, metadata={"omit_if_default": True})
    """Split sequences only, without segments: INP_ONLY and INP_ATTN activations keep no K/V
    (a third of an INP_ONLY one); before a layer's backward fills the sequence's context, each
    chunk's K/V are re-formed from its saved input x (RMSNorm, the K and V projections and RoPE,
    the forward's own kernels, so bit for bit), x coming over H2D into the `kv_rebuild` staging
    for a chunk kept at home. Left out of the JSON while False."""
    frozen: Frozen = dataclasses.field(default=NOTHING_FROZEN, metadata={"omit_if_default": True})
    """Blocks that train no further (dataflow.memplan.plan.frozen): no gradient or AdamW region,
    no gradient copy, no weight-gradient GEMM. Left out of the JSON (and hash) while nothing is
    frozen."""
    lora: Lora | None = dataclasses.field(default=None, metadata={"omit_if_default": True})
    """LoRA adapters (dataflow.memplan.plan.lora): the base is frozen whole (`frozen`), the
    adapters and their fp32 gradients and AdamW state are the device regions lora.weights /
    .grads / .m / .v. Left out of the JSON (and hash) without LoRA."""
    state_parts: int = dataclasses.field(default=1, metadata={"omit_if_default": True})
    """R > 1: planned as one replica of a split update over R replicas (RankPlan.split_update,
    docs/ring.md "Split updates"): the m / v regions of every layer and the head hold the
    largest replica part alone (dataflow.memplan.plan.split.part_numel_max), so the search
    spends what that frees; such a plan runs only as a split replica of R. The embedding's state
    stays whole. Left out of the JSON (and hash) while 1."""

    def to_json(self) -> str:
        return to_json(self)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return from_json(cls, text)

    @property
    def hash(self) -> str:
        return stable_hash(self)

    @property
    def resident_layers(self) -> int:
        """How many layers keep their weights on the device (Where.DEVICE)."""
        return sum(p.weights is Where.DEVICE for p in self.layers)
