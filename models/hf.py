"""Hugging Face Llama, Mistral, Qwen2, Qwen3, OLMoE and Qwen3-MoE directories in and out
(docs/models.md): config.json in the family's own spelling (transformers' LlamaConfig,
MistralConfig, Qwen2Config, Qwen3Config, OlmoeConfig, Qwen3MoeConfig) plus model.safetensors, or
model-0000i-of-0000n.safetensors with model.safetensors.index.json. Experts are read under the
released per-expert names or transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj`,
and written under the released names.
Reads lazily, one layer block at a time from memory-mapped files, converting to bf16; writes
bf16 one block at a time into a temporary directory renamed into place when complete. Never
holds the whole model in memory, and never accepts a config it cannot run exactly (RoPE scaling
other than Llama 3.1's 'llama3', biases beyond Qwen2's q/k/v, sliding windows in use, other
activations, OLMoE's clip_qkv, Qwen3-MoE's dense layers are refused by name).
tie_word_embeddings stays one parameter both ways: imported into the embedding block (a stored
lm_head.weight must equal it), exported with tie_word_embeddings true and no lm_head.weight, as
transformers saves a tied model."""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path

import numpy as np

from dataflow.models.config import ModelConfig, RopeScaling
from dataflow.models.errors import ConfigError
from dataflow.models.hf_config import ARCHITECTURES, INDEX, SINGLE, hf_config, is_hf_dir
from dataflow.models.hf_export import (ExportResult, ModelSource, missing_tokenizer,
                                       rebuilt_config, source_config)
from dataflow.models.hf_moe import DROP, moe_hf_dict
from dataflow.models.init import BF16
from dataflow.models.layout import BlockKind, embed_layout, head_layout, layer_layout
from dataflow.models.safetensors_io import SafetensorsFile, SafetensorsWriter
from dataflow.models.storage import load_model

MAX_SHARD_BYTES = 5 << 30
"""transformers' default max_shard_size ("5GB"); a block larger than this gets a shard alone."""
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some older exports carry; RoPE frequencies are recomputed from rope_theta and
rope_scaling."""


def hf_rope_scaling(scaling: RopeScaling | None) -> dict | None:
    """transformers' `rope_scaling` entry for a RopeScaling (None for plain RoPE)."""
    if scaling is None:
        return None
    return {"rope_type": scaling.rope_type.value, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def hf_config_dict(cfg: ModelConfig, *, max_position_embeddings: int | None = None) -> dict:
    """transformers' config fields for `cfg` in its family's spelling (LlamaConfig,
    MistralConfig, Qwen2Config, Qwen3Config, OlmoeConfig or Qwen3MoeConfig; tie_word_embeddings
    as cfg.tie_embeddings; rope_scaling as the config has it; no sliding window in use).
    max_position_embeddings does not change any number transformers computes for these RoPE
    types; by default 8192 for plain RoPE and the extended context
    (original_max_position_embeddings * factor) with llama3 scaling."""
    _refuse_unexportable(cfg)
    if max_position_embeddings is None:
        sc = cfg.rope_scaling
        max_position_embeddings = (8192 if sc is None else
                                   int(round(sc.original_max_position_embeddings * sc.factor)))
    out = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.model_dim,
        "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "rope_scaling": hf_rope_scaling(cfg.rope_scaling),
        "initializer_range": 0.02, "pad_token_id": cfg.pad_token_id,
        "pretraining_tp": 1, "use_cache": True, "torch_dtype": "bfloat16",
    }
    if cfg.family == "mistral":  # MistralConfig's own spelling: a window, no bias switches
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            del out[key]
        out["sliding_window"] = cfg.sliding_window
    if cfg.family in ("qwen2", "qwen3"):
        # Qwen2Config has no bias switches (q/k/v always biased); Qwen3Config's attention_bias
        # stays False (it would bias o_proj too). Neither slides a window here.
        for key in ("mlp_bias", "pretraining_tp") + (("attention_bias",)
                                                     if cfg.family == "qwen2" else ()):
            del out[key]
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.n_layers)
    if cfg.moe is not None:
        out.update(moe_hf_dict(cfg))
    return {k: v for k, v in out.items() if v is not DROP}


def _refuse_unexportable(cfg: ModelConfig) -> None:
    """Refuse what the family's config.json cannot say: shared experts (neither OLMoE nor
    Qwen3-MoE has them), OLMoE heads whose width is not model_dim / n_heads."""
    if cfg.moe is not None and cfg.moe.n_shared_experts:
        raise ConfigError(f"model '{cfg.name}': {cfg.moe.n_shared_experts} shared experts "
                          f"cannot be written as {ARCHITECTURES[cfg.family]} (it has none); "
                          "export a model with n_shared_experts 0")
    if cfg.family == "olmoe" and cfg.head_dim * cfg.n_heads != cfg.model_dim:
        raise ConfigError(f"model '{cfg.name}': head_dim {cfg.head_dim} x n_heads "
                          f"{cfg.n_heads} is not model_dim {cfg.model_dim}; OlmoeConfig has "
                          "no head_dim (it uses hidden_size // num_attention_heads)")



def weight_map(path: str | Path) -> dict[str, str]:
    """Tensor name -> the safetensors file of a Hugging Face directory that holds it (its
    index's weight_map, or every tensor of model.safetensors); reads headers only."""
    path = Path(path)
    if not (path / INDEX).is_file():
        return {n: SINGLE for n in SafetensorsFile(path / SINGLE).names()}
    try:
        index = json.loads((path / INDEX).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        index = None
    where = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(where, dict):
        raise ConfigError(f"{path / INDEX} has no weight_map; re-save the model")
    return dict(where)


def open_weights(path):
    """Weights at `path`: a Hugging Face directory (HFWeights, read lazily) or a dataflow.models.storage
    model directory (read whole, verified)."""
    if is_hf_dir(path):
        return HFWeights(path)
    return load_model(path)


def _fused_names(layer: int) -> tuple[str, str]:
    """transformers 5's fused expert parameters of one layer: gate_up_proj (N, 2F, D) and
    down_proj (N, D, F) (its conversion_mapping merges the released per-expert tensors so)."""
    return (f"model.layers.{layer}.mlp.experts.gate_up_proj",
            f"model.layers.{layer}.mlp.experts.down_proj")


def _blocks_of(cfg: ModelConfig):
    lay = layer_layout(cfg)
    return ([(BlockKind.EMBED, None, embed_layout(cfg))]
            + [(BlockKind.LAYER, i, lay) for i in range(cfg.n_layers)]
            + [(BlockKind.HEAD, None, head_layout(cfg))])


class HFWeights:
    """A Hugging Face directory of a supported family as our blocks, read on demand: `blocks()`
    yields
    (kind, layer, layout, 1-D bf16 block) one block at a time, each built from memory-mapped
    tensors (converted to bf16 with round-to-nearest-even when stored wider)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.cfg = hf_config(self.path)
        self._where = weight_map(self.path)
        self._files: dict[str, SafetensorsFile] = {}
        known = {lay.full_name(t.name, layer) for _, layer, lay in _blocks_of(self.cfg)
                 for t in lay.tensors}
        self._fused = self._fused_layers(known)
        """Layers whose experts are stored as transformers 5's fused tensors."""
        known |= {n for i in self._fused for n in _fused_names(i)}
        unknown = sorted(n for n in self._where if n not in known
                         and not n.endswith(_IGNORED_SUFFIXES))
        self.tied = self.cfg.tie_embeddings
        """tie_word_embeddings: one table, in the embedding block (the head holds its norm
        only). transformers' save_pretrained leaves lm_head.weight out of a tied model; a file
        that has it must hold the embedding's bits (checked when the embedding is read)."""
        if self.tied:
            unknown = [n for n in unknown if n != "lm_head.weight"]
        if unknown:
            raise ConfigError(f"{self.path}: tensors {unknown[:5]} are not part of a "
                              f"{ARCHITECTURES[self.cfg.family]} with this config; expected "
                              "names like model.layers.0.self_attn.q_proj.weight")

    def _fused_layers(self, known: set[str]) -> frozenset[int]:
        """Layers stored with fused experts (both fused tensors, no per-expert name); a layer
        with one fused tensor only, or with fused and per-expert tensors both, is refused."""
        if self.cfg.moe is None:
            return frozenset()
        fused = set()
        for i in range(self.cfg.n_layers):
            have = [n in self._where for n in _fused_names(i)]
            if not any(have):
                continue
            per_expert = sorted(n for n in self._where if n in known
                                and n.startswith(f"model.layers.{i}.mlp.experts."))
            if not all(have) or per_expert:
                raise ConfigError(
                    f"{self.path}: layer {i} stores {'both ' if all(have) else 'only '}"
                    f"{' and '.join(n for n, h in zip(_fused_names(i), have) if h)}"
                    + (f" and per-expert tensors ({per_expert[0]}, ...)" if per_expert else "")
                    + "; store its experts either fused (gate_up_proj (N, 2F, D) and down_proj "
                    "(N, D, F), transformers 5) or per expert (mlp.experts.{e}.gate_proj.weight, "
                    "... as released), not both")
            fused.add(i)
        return frozenset(fused)

    def _expert_tensor(self, layer: int, slot: str) -> np.ndarray:
        """Expert e's gate (F, D), up (F, D) or down (D, F) of a fused layer: gate_up_proj[e]
        holds gate then up along its rows (transformers' Concatenate(dim=1) of [gate, up])."""
        m = self.cfg.moe
        n, f, d = m.n_experts, m.expert_ffn_dim, self.cfg.model_dim
        gate_up_name, down_name = _fused_names(layer)
        gate_up, down = self._tensor(gate_up_name), self._tensor(down_name)
        for name, got, want in ((gate_up_name, gate_up.shape, (n, 2 * f, d)),
                                (down_name, down.shape, (n, d, f))):
            if got != want:
                raise ConfigError(f"{self.path}: '{name}' has shape {list(got)}, the config "
                                  f"implies {list(want)}; config.json and the weights disagree")
        _, e, which = slot.split(".")[1:]
        e = int(e)
        if which == "gate_proj":
            return gate_up[e, :f]
        return gate_up[e, f:] if which == "up_proj" else down[e]

    def _tensor(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ConfigError(f"{self.path} has no tensor '{name}'; the directory is incomplete")
        file = self._where[name]
        if file not in self._files:
            self._files[file] = SafetensorsFile(self.path / file)
        return self._files[file].tensor(name)

    def block(self, kind: BlockKind, layer: int | None, lay) -> np.ndarray:
        out = np.zeros(lay.numel, BF16)  # alignment padding stays zero, as init leaves it
        for t in lay.tensors:
            name = lay.full_name(t.name, layer)
            if layer in self._fused and t.name.startswith("mlp.experts."):
                src = self._expert_tensor(layer, t.name)
            else:
                src = self._tensor(name)
            if src.shape != t.shape:
                raise ConfigError(f"{self.path}: '{name}' has shape {list(src.shape)}, the "
                                  f"config implies {list(t.shape)}; config.json and the "
                                  "weights disagree")
            lay.view(out, t.name)[...] = src if src.dtype == BF16 else src.astype(BF16)
        if kind is BlockKind.EMBED and self.tied and "lm_head.weight" in self._where:
            self._check_tied_head(lay.view(out, "embed_tokens"))
        return out

    def _check_tied_head(self, table: np.ndarray) -> None:
        """A tied directory that also stores lm_head.weight: transformers would tie it to the
        embedding (the stored head is dropped), so it must be the embedding, bit for bit in
        bf16; anything else is two parameters and is refused rather than silently dropped."""
        head = self._tensor("lm_head.weight")
        same = head.shape == table.shape and np.array_equal(
            (head if head.dtype == BF16 else head.astype(BF16)).view(np.uint16),
            table.view(np.uint16))
        if not same:
            raise ConfigError(f"{self.path}: config.json says tie_word_embeddings true, but "
                              "lm_head.weight differs from model.embed_tokens.weight; set "
                              "tie_word_embeddings false to train them as two parameters, or "
                              "drop lm_head.weight to tie the head to the embedding")

    def blocks(self):
        for kind, layer, lay in _blocks_of(self.cfg):
            yield kind, layer, lay, self.block(kind, layer, lay)


def save_pretrained(cfg: ModelConfig, blocks, path: str | Path, *,
                    max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False,
                    source: ModelSource | None = None) -> Path:
    """Write a Hugging Face directory at `path` from `blocks` and return the path
    (export_pretrained, which also says what it wrote)."""
    return export_pretrained(cfg, blocks, path, max_shard_bytes=max_shard_bytes,
                             overwrite=overwrite, source=source).path


def export_pretrained(cfg: ModelConfig, blocks, path: str | Path, *,
                      max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False,
                      source: ModelSource | None = None,
                      flag: str = "overwrite=True") -> ExportResult:
    """Write a Hugging Face directory (config.json in cfg's family's spelling) at `path` from
    `blocks`, an iterable of (kind, layer, 1-D bf16 block) in model order (embed, layers
    0..L-1, head), consumed one at a time. One model.safetensors when it fits in
    max_shard_bytes, else shards plus model.safetensors.index.json. With `source` (the
    Hugging Face directory the model was imported from, models.hf_export.ModelSource) its
    config.json is kept (token ids, context length, rope spelling; dtype bfloat16) when it still
    describes cfg, and its generation_config.json and tokenizer files are copied byte for byte.
    All or nothing: written into a hidden directory beside `path`, renamed into place when
    complete; on failure it and any parent directory this call made are removed. `flag`: how
    the caller spells overwrite, for the refusal of an occupied `path`."""
    _refuse_unexportable(cfg)
    path = Path(path)
    check_export_dir(path, overwrite, flag=flag)
    made = [p for p in reversed(path.parents) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _write_weights(cfg, blocks, tmp, max_shard_bytes)
        changes = _write_config(cfg, source, tmp)
        kept = []
        for name, body in source.copied() if source is not None else ():
            (tmp / name).write_bytes(body)
            kept.append(name)
        files = tuple(sorted(p.name for p in tmp.iterdir()))
        nbytes = sum((tmp / f).stat().st_size for f in files)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in reversed(made):  # deepest first; only those still empty
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    return ExportResult(path=path, architecture=ARCHITECTURES[cfg.family],
                        n_layers=cfg.n_layers, n_params=cfg.n_params, files=files,
                        nbytes=nbytes, source=None if source is None else source.path,
                        kept=tuple(kept), changes=tuple(changes),
                        missing=missing_tokenizer(cfg, source))


def check_export_dir(path: str | Path, overwrite: bool, *, flag: str = "overwrite=True") -> None:
    """Refuse an export to a file, to a non-empty directory that is not a Hugging Face model,
    or to one that is without overwrite. `flag`: how the caller spells overwrite
    ('overwrite=True' in Python, '--overwrite' on dataflow-export's command line)."""
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not path.is_dir():
        raise ConfigError(f"{path} is a file; choose a new or empty directory to export to")
    if not is_hf_dir(path):
        raise ConfigError(f"{path} exists and holds files that are not a Hugging Face model "
                          f"({flag} replaces only one); choose a new or empty directory")
    if not overwrite:
        raise ConfigError(f"{path} already holds a Hugging Face model; pass {flag} to replace "
                          "it, or choose a new path")


def _shards(cfg: ModelConfig, max_shard_bytes: int) -> list[list[tuple[str, object]]]:
    """(name, tensor layout) of every tensor, grouped into shards of at most max_shard_bytes
    (a tensor larger than that gets a shard alone)."""
    tensors = [(lay.full_name(t.name, layer), t) for _, layer, lay in _blocks_of(cfg)
               for t in lay.tensors]
    shards, current, size = [], [], 0
    for name, t in tensors:
        nbytes = 2 * t.numel
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    shards.append(current)
    return shards


def _write_weights(cfg: ModelConfig, blocks, tmp: Path, max_shard_bytes: int) -> None:
    """The safetensors files (and index) of `blocks` in `tmp`, one block in memory at a time."""
    shards = _shards(cfg, max_shard_bytes)
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                     for i in range(n)]
    shard_of = {name: i for i, shard in enumerate(shards) for name, _ in shard}
    writers: list[SafetensorsWriter | None] = [None] * n
    total = 0
    it = iter(blocks)
    for kind, layer, lay in _blocks_of(cfg):
        try:
            got_kind, got_layer, block = next(it)
        except StopIteration:
            raise ConfigError(f"save_pretrained got too few blocks: {kind.value} "
                              f"{layer} is missing") from None
        if (got_kind, got_layer) != (kind, layer) or block.size != lay.numel:
            raise ConfigError(f"save_pretrained expected block {kind.value} {layer} of "
                              f"{lay.numel} elements, got {got_kind} {got_layer} of "
                              f"{block.size}")
        for t in lay.tensors:
            name = lay.full_name(t.name, layer)
            i = shard_of[name]
            if writers[i] is None:
                if i and writers[i - 1] is not None:
                    writers[i - 1].close()
                writers[i] = SafetensorsWriter(
                    tmp / names[i], [(nm, BF16, tt.shape) for nm, tt in shards[i]],
                    metadata={"format": "pt"})
            writers[i].write(name, lay.view(block, t.name).astype(BF16, copy=False))
            total += 2 * t.numel
        del block
    for w in writers:
        if w is not None:
            w.close()
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: names[i] for name, i in shard_of.items()}}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _write_config(cfg: ModelConfig, source: ModelSource | None, tmp: Path) -> list[str]:
    """Write config.json into `tmp` (the source's where it still describes cfg, read back with
    hf_config to check) and return the changes the summary states."""
    ours = hf_config_dict(cfg)
    data, changes = source_config(ours, source)
    where = tmp / "config.json"
    where.write_text(json.dumps(data, indent=2) + "\n")
    if data is ours:
        return changes
    try:
        back = dataclasses.replace(hf_config(tmp), name=cfg.name)
        why = None if back == cfg else "the source's config.json describes another shape"
    except ConfigError as exc:
        why = f"the source's config.json does not import: {exc}"
    if why is None:
        return changes
    data, changes = rebuilt_config(ours, source, why)
    where.write_text(json.dumps(data, indent=2) + "\n")
    return changes


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename tmp to path; an old directory there is first moved aside, then deleted."""
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
