"""LoRA adapters (issue 54): which linears of every transformer layer carry a low-rank adapter
y = x w^T + (alpha / rank) (x a^T) b^T, its rank and alpha, and what the adapters cost in bytes
and FLOPs. With LoRA the base model is frozen whole (Plan.frozen: every layer, the embedding and
the head); the adapters live on the device in fp32 (weights, gradients, AdamW m and v: 16 bytes
per adapter parameter), outside the layer blocks. Parsed once at the CLI / Engine edge. Never
imports array libraries."""

from __future__ import annotations

import dataclasses
import enum

from dataflow.memplan.plan.frozen import Frozen
from dataflow.models.errors import ConfigError
from dataflow.models.fp8_layout import largest_linear

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The adapted linears, in the order adapters are laid out in the adapter region."""
HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
            "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
            "down": "mlp.down_proj"}
"""Each target's module under model.layers.{i} (transformers' names; PEFT's target_modules are
the last part: q_proj, ...)."""
SPELLING = "q, k, v, o, gate, up, down (comma-separated, e.g. q,k,v,o)"
ADAPTER_BPE = 18
"""Bytes per adapter parameter on the device: the fp32 master weight, its fp32 gradient, AdamW m
and v in fp32, and the bf16 working copy the GEMMs read (cuBLAS takes both operands of a GEMM in
one dtype, and the activations are bf16)."""


class LoraBase(enum.Enum):
    """How the frozen base's seven adapted linears are stored (`--lora-base`): bf16 as trained,
    or FP8 (E4M3 codes with an fp32 scale per output row: dataflow.models.fp8_layout), each base
    GEMM then reading a bf16 copy dequantised into lora.base_dequant."""

    BF16 = "bf16"
    FP8 = "fp8"


BASE_SPELLING = "bf16, fp8"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Lora:
    rank: int
    """r: the adapters' inner dimension."""
    alpha: float
    """The scale is alpha / rank (PEFT's LoraLayer scaling; not rsLoRA's)."""
    targets: tuple[str, ...]
    """Adapted linears of every layer, a subset of TARGETS in TARGETS' order."""
    base: LoraBase = dataclasses.field(default=LoraBase.BF16, metadata={"omit_if_default": True})
    """The frozen base's storage; left out of the JSON and hash while bf16, so a bf16 plan is
    unchanged."""

    def __post_init__(self):
        if not isinstance(self.base, LoraBase):
            raise ConfigError(f"LoRA base {self.base!r} is not a storage; spell "
                              f"{BASE_SPELLING} (e.g. --lora-base fp8)")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank must be a positive integer, got {self.rank!r}; "
                              "try --lora-rank 8")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not self.alpha > 0:
            raise ConfigError(f"LoRA alpha must be a positive number, got {self.alpha!r}; "
                              "try --lora-alpha 16")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"LoRA targets {list(self.targets)!r}: "
                              f"{'unknown ' + repr(bad) if bad else 'empty or repeated'}; "
                              f"spell {SPELLING}")
        if list(self.targets) != [t for t in TARGETS if t in self.targets]:
            raise ConfigError(f"LoRA targets {self.targets!r} must be in the order {TARGETS}; "
                              "build them with parse_lora")

    def __repr__(self) -> str:
        # a bf16 base is left out, as in the JSON: records name earlier Loras so
        base = "" if self.base is LoraBase.BF16 else f", base='{self.base.value}'"
        return (f"Lora(rank={self.rank!r}, alpha={self.alpha!r}, targets={self.targets!r}"
                f"{base})")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def fp8_base(self) -> bool:
        """The base's linears are stored as E4M3 codes with row scales (LoraBase.FP8)."""
        return self.base is LoraBase.FP8

    def spec(self) -> str:
        return ",".join(self.targets)


def target_shape(cfg, target: str) -> tuple[int, int]:
    """(in_features, out_features) of target `target` of a layer of `cfg`."""
    d, f = cfg.model_dim, cfg.ffn_dim
    return {"q": (d, cfg.q_dim), "k": (d, cfg.kv_dim), "v": (d, cfg.kv_dim),
            "o": (cfg.q_dim, d), "gate": (d, f), "up": (d, f), "down": (f, d)}[target]


def adapter_specs(cfg, lora: Lora) -> tuple[tuple[int, str, str, tuple[int, int]], ...]:
    """(layer, target, 'a' or 'b', shape) of every adapter matrix, in region order: layer-major,
    targets in TARGETS' order, a (r, in) then b (out, r)."""
    out = []
    for layer in range(cfg.n_layers):
        for t in lora.targets:
            n_in, n_out = target_shape(cfg, t)
            out += [(layer, t, "a", (lora.rank, n_in)), (layer, t, "b", (n_out, lora.rank))]
    return tuple(out)


def adapter_params(cfg, lora: Lora | None) -> int:
    """Adapter parameters of the whole model (0 without LoRA)."""
    if lora is None:
        return 0
    per_layer = sum(sum(target_shape(cfg, t)) for t in lora.targets) * lora.rank
    return per_layer * cfg.n_layers


def adapter_bytes(cfg, lora: Lora | None, chunk_tokens: int = 0) -> int:
    """Device bytes of the adapters' weights, gradients, AdamW state and working copy, and
    (chunk_tokens given) their (T, r) bf16 intermediates (region_sizes' sum, unaligned)."""
    return sum(n for name, n in region_sizes(cfg, lora, chunk_tokens).items()
               if name != "lora.base_dequant")


def region_sizes(cfg, lora: Lora | None, chunk_tokens: int) -> dict[str, int]:
    """Bytes of each LoRA device region: lora.weights, .grads, .m, .v (fp32, region order
    adapter_specs), lora.work (the bf16 working copy, then the (T, r) bf16 intermediates: the
    backward's u = s (dy b) and one s (x a^T) per target, which a backward's recompute leaves
    for db: dataflow.lora_adapters); lora.base_dequant (an fp8 base's: the bf16 copy of its
    largest linear); empty without LoRA."""
    if lora is None:
        return {}
    n = adapter_params(cfg, lora)
    products = 1 + len(lora.targets)
    out = {"lora.weights": 4 * n, "lora.grads": 4 * n, "lora.m": 4 * n, "lora.v": 4 * n,
           "lora.work": 2 * n + 2 * products * chunk_tokens * lora.rank}
    if lora.fp8_base:  # the bf16 copy of one base linear, dequantised before each base GEMM
        out["lora.base_dequant"] = 2 * largest_linear(cfg)
    return out


def adapter_flops_per_token(cfg, lora: Lora | None) -> tuple[int, int]:
    """(forward, backward) FLOPs per token of one layer's adapters: forward x a^T, then . b^T
    (2 r (in + out)); backward dy b and its dx contribution, da and db (2 r (in + out) twice).
    The s (x a^T) that db reads where no recompute of the backward left it is re-formed:
    adapter_rebuild_flops_per_token, by level."""
    if lora is None:
        return 0, 0
    fwd = bwd = 0
    for t in lora.targets:
        n_in, n_out = target_shape(cfg, t)
        fwd += 2 * lora.rank * (n_in + n_out)
        bwd += 4 * lora.rank * (n_in + n_out)
    return fwd, bwd


def lora_seconds(cfg, t: int, lora: Lora | None, gemm_flop_per_s: float,
                 hbm_bytes_per_s: float, overhead: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's LoRA adapters on a chunk of t tokens, for the
    cost model (dataflow.memplan.search.cost.chunk_costs gives the chunk's GEMM rate, the HBM
    rate and its launch overhead factor): rank-r GEMMs are bound by memory, not FLOPs (x a^T
    reads all of x for 2 r FLOPs per element), so each is the longer of its FLOPs at the GEMM
    rate and its bytes at HBM rate: the forward reads x and reads and writes the output it adds
    into (2 t (in + 2 out) bytes in bf16), the backward reads dy twice, x once (da) and reads
    and writes dx (2 t (3 in + 2 out)). The scale s is the GEMMs' alpha: no pass of its own.
    The re-formed s (x a^T) of db is rebuild_seconds', by level."""
    if lora is None:
        return 0.0, 0.0
    fwd_f, bwd_f = adapter_flops_per_token(cfg, lora)
    fwd_b = bwd_b = 0
    for target in lora.targets:
        n_in, n_out = target_shape(cfg, target)
        fwd_b += 2 * t * (n_in + 2 * n_out)
        bwd_b += 2 * t * (3 * n_in + 2 * n_out)
    return (max(fwd_f * t / gemm_flop_per_s, fwd_b / hbm_bytes_per_s) * overhead,
            max(bwd_f * t / gemm_flop_per_s, bwd_b / hbm_bytes_per_s) * overhead)


def rebuild_targets(cfg, lora: Lora | None, full: bool) -> tuple[str, ...]:
    """The adapted linears whose s (x a^T) a backward re-forms for db (lora_xa) at FULL
    (`full`) or below: none at FULL, whose saved activation keeps every target's product
    (dataflow.memplan.plan.buffers.saved_activation_specs); below it those its own recompute
    does not form (dataflow.layer_ops keeps each target's product in its own buffer for the
    visit): the recompute forms Q, O, gate and up (RECOMPUTED_TARGETS), QK-norm K too."""
    if lora is None or full:
        return ()
    formed = set(RECOMPUTED_TARGETS) | ({"k"} if cfg.qk_norm else set())
    return tuple(t for t in lora.targets if t not in formed)


def rebuild_seconds(cfg, t: int, lora: Lora | None, full: bool, gemm_flop_per_s: float,
                    hbm_bytes_per_s: float, overhead: float) -> float:
    """Seconds of the s (x a^T) one layer's backward re-forms on a chunk of t tokens at FULL
    (`full`) or below (rebuild_targets): 2 r in FLOPs per token each, or its read of x
    (2 t in bytes) at HBM rate, whichever is longer (as lora_seconds)."""
    flops = t * adapter_rebuild_flops_per_token(cfg, lora, full)
    moved = sum(2 * t * target_shape(cfg, x)[0] for x in rebuild_targets(cfg, lora, full))
    return max(flops / gemm_flop_per_s, moved / hbm_bytes_per_s) * overhead


def base_dequant_seconds(cfg, lora: Lora | None, hbm_bytes_per_s: float, targets=None) -> float:
    """Seconds of an fp8 base's dequantisation passes for one use of each base linear in
    `targets` (default all seven; 0 without LoRA or with a bf16 base): every base GEMM first
    decodes its weight into lora.base_dequant, an HBM-rate pass reading 1 byte (plus the row
    scales) and writing 2 per element. Per chunk: the forward, every recompute of a projection
    and the backward's dx each pay it again (one shared region; nothing is kept)."""
    if lora is None or not lora.fp8_base:
        return 0.0
    moved = 0
    for t in TARGETS if targets is None else targets:
        n_in, n_out = target_shape(cfg, t)
        moved += 3 * n_in * n_out + 4 * n_out
    return moved / hbm_bytes_per_s


RECOMPUTED_TARGETS = ("q", "o", "gate", "up")
"""The adapted linears a recompute below FULL re-runs: the projections level_recompute_flops
counts (Q and O, gate and up; dataflow.models.flops). K and V are saved at every level."""


KEPT_TARGETS = {True: ("o", "gate", "up", "down"), False: ("k", "v", "o", "gate", "up", "down")}
"""By whether a sequence is one chunk: the adapted linears a segment boundary's re-run from its
kept attention output re-forms (the O projection and the FFN, K and V too for a split
sequence: dataflow.memplan.search.cost.ChunkCosts.refwd_kept_flops)."""


def adapter_fwd_flops_per_token(cfg, lora: Lora | None, targets=None) -> int:
    """Forward FLOPs per token of one layer's adapters on `targets` (default all of lora's):
    x a^T then . b^T, 2 r (in + out) each."""
    if lora is None:
        return 0
    return sum(2 * lora.rank * sum(target_shape(cfg, t)) for t in lora.targets
               if targets is None or t in targets)


def adapter_model_flops_per_seq(cfg, lora: Lora | None, seqlen: int) -> float:
    """Model FLOPs of the adapters of every layer for one sequence (docs/flops.md): forward,
    backward-x (dy b, then . a), backward-a and backward-b: 3 x the forward, as the base's 3 x
    layer matmul. The x a^T the backward re-forms for db is recompute (hardware FLOPs only)."""
    return 3 * cfg.n_layers * seqlen * adapter_fwd_flops_per_token(cfg, lora)


def adapter_rebuild_flops_per_token(cfg, lora: Lora | None, full: bool) -> int:
    """Hardware FLOPs per token of one layer's backward beyond the model's, at FULL (`full`)
    or below: the x a^T it re-forms for db (2 r in per linear of rebuild_targets)."""
    if lora is None:
        return 0
    return sum(2 * lora.rank * target_shape(cfg, t)[0]
               for t in rebuild_targets(cfg, lora, full))


def base_frozen(cfg) -> Frozen:
    """What LoRA freezes: everything of the base (every layer, the embedding and the head)."""
    return Frozen(embed=True, head=True, layers=tuple(range(cfg.n_layers)))


def refuse_unsupported(cfg, lora: Lora | None, *, precision=None, where: str = "LoRA") -> None:
    """Refuse, by name, what the LoRA path does not support."""
    if lora is None:
        return
    if cfg.moe is not None:
        raise ConfigError(f"{where}: {cfg.name} is a mixture-of-experts model; LoRA adapters "
                          "on experts (or on MoE layers at all) are not supported yet; use a "
                          "dense model or train without --lora-rank")
    if precision is not None and getattr(precision, "value", precision) != "bf16":
        raise ConfigError(f"{where}: an FP8 base ({precision}) is not supported with LoRA yet; "
                          "use --precision bf16")


def parse_base(value) -> LoraBase:
    """LoraBase from 'bf16' / 'fp8' (or a LoraBase); ConfigError naming the value otherwise."""
    if isinstance(value, LoraBase):
        return value
    try:
        return LoraBase(value)
    except ValueError:
        raise ConfigError(f"--lora-base {value!r} is not a storage; spell {BASE_SPELLING} "
                          "(e.g. --lora-base fp8)") from None


def parse_lora(rank, alpha=None, targets: str | None = None, base=None) -> Lora | None:
    """Lora from the CLI's --lora-rank / --lora-alpha / --lora-targets / --lora-base (rank
    None: no LoRA). alpha defaults to the rank (scale 1); targets to all seven; base to bf16.
    Raises ConfigError naming the bad value and the spelling."""
    if rank is None:
        if base is not None and parse_base(base) is LoraBase.FP8:
            raise ConfigError("--lora-base fp8 needs --lora-rank R (e.g. --lora-rank 16): the "
                              "fp8 base is the frozen base of LoRA adapters")
        if alpha is not None or targets:
            raise ConfigError("--lora-alpha / --lora-targets need --lora-rank R (e.g. "
                              "--lora-rank 8)")
        return None
    names = TARGETS if not targets else tuple(t.strip() for t in targets.split(","))
    bad = [t for t in names if t not in TARGETS]
    if bad:
        raise ConfigError(f"--lora-targets item {bad[0]!r} is not a target; spell {SPELLING}")
    return Lora(rank=rank, alpha=float(rank if alpha is None else alpha),
                targets=tuple(t for t in TARGETS if t in names),
                base=LoraBase.BF16 if base is None else parse_base(base))


def as_lora(value) -> Lora | None:
    """A Lora from a Lora, None, a rank (int) or a dict of rank/alpha/targets/base (the Engine's
    and make_plan's argument)."""
    if value is None or isinstance(value, Lora):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return parse_lora(value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"rank", "alpha", "targets", "base"})
        if unknown:
            raise ConfigError(f"lora keys {unknown} are not understood; known: rank, alpha, "
                              "targets, base")
        t = value.get("targets")
        return parse_lora(value.get("rank"), value.get("alpha"),
                          ",".join(t) if isinstance(t, (list, tuple)) else t, value.get("base"))
    raise ConfigError(f"lora must be a Lora, a rank or a dict(rank=, alpha=, targets=, base=), got "
                      f"{type(value).__name__}")
