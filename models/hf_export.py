"""What a Hugging Face export carries besides the weights: the source directory's files that
training never changes (config.json, generation_config.json and the tokenizer files, kept as
bytes in a ModelSource so a checkpoint can store them), the config.json an export writes from
them, what an export without them lacks, and the summary of what an export wrote.
Never reads weights and never writes outside the directory it is given."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dataflow.models.config import ModelConfig, load_config, zoo_names

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")
"""The files AutoTokenizer.from_pretrained reads (fast and slow tokenizers, BPE vocab and
merges, SentencePiece model, the chat template transformers 4.43+ saves beside the config)."""
GENERATION_CONFIG = "generation_config.json"
CONFIG = "config.json"
SOURCE_FILES = (CONFIG, GENERATION_CONFIG) + TOKENIZER_FILES
"""Copied from a Hugging Face source, byte for byte, whichever exist."""
COPIED_FILES = (GENERATION_CONFIG,) + TOKENIZER_FILES
"""Written into an export unchanged (config.json is written from the trained model)."""
_DTYPE_KEYS = ("torch_dtype", "dtype")
"""transformers 4's and 5's spelling of the stored weights' dtype."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    """The Hugging Face directory a model was imported from: where it was, and the bytes of its
    files in SOURCE_FILES that exist (read once, so an export still has them after the
    directory moved)."""

    path: str
    files: tuple[tuple[str, bytes], ...]
    """(file name, bytes) in SOURCE_FILES order."""

    def file(self, name: str) -> bytes | None:
        return dict(self.files).get(name)

    def config(self) -> dict | None:
        """The source's config.json as a dict (None when it has none or it is not an object)."""
        body = self.file(CONFIG)
        try:
            data = None if body is None else json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def copied(self) -> list[tuple[str, bytes]]:
        """The files an export writes unchanged: generation config and tokenizer."""
        return [(n, b) for n, b in self.files if n in COPIED_FILES]

    def has_tokenizer(self) -> bool:
        return any(n in TOKENIZER_FILES for n, _ in self.files)


def read_source(path: str | Path) -> ModelSource:
    """The ModelSource of a Hugging Face directory: its SOURCE_FILES that exist, as bytes."""
    path = Path(path)
    files = tuple((name, (path / name).read_bytes()) for name in SOURCE_FILES
                  if (path / name).is_file())
    return ModelSource(path=str(path.resolve()), files=files)


def source_config(ours: dict, source: ModelSource | None) -> tuple[dict, list[str]]:
    """(config.json to write, changes stated in the summary). `ours`: the config our model
    implies (models.hf.hf_config_dict). With a source config.json, the source's own dict is
    kept (bos/eos/pad token ids, max_position_embeddings, rope scaling spelling, architectures,
    every key transformers reads and we do not train), its dtype set to bfloat16, the dtype in
    which the weights are written; the caller checks that it still describes our model."""
    data = None if source is None else source.config()
    if data is None:
        return ours, []
    data, changes = dict(data), []
    stated = [k for k in _DTYPE_KEYS if k in data]
    for key in stated or ["torch_dtype"]:
        if data.get(key) != "bfloat16":
            was = data.get(key)
            changes.append(f"{key} {'unset' if was is None else was} -> bfloat16 (the weights "
                           "are written in bf16)")
            data[key] = "bfloat16"
    return data, changes


def rebuilt_config(ours: dict, source: ModelSource, why: str) -> tuple[dict, list[str]]:
    """The fallback when the source's config.json does not describe the trained model: ours,
    keeping the source's token ids and context length (training changes neither)."""
    data = source.config() or {}
    kept = {k: data[k] for k in ("bos_token_id", "eos_token_id", "max_position_embeddings")
            if k in data}
    return {**ours, **kept}, [f"config.json rebuilt from the trained model ({why})"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    """What an export wrote (models.hf.export_pretrained's answer)."""

    path: Path
    architecture: str
    n_layers: int
    n_params: int
    files: tuple[str, ...]
    """Names written, sorted."""
    nbytes: int
    """Bytes of all files written."""
    source: str | None
    """The Hugging Face directory whose config values and files were kept, or None."""
    kept: tuple[str, ...]
    """Files copied from the source unchanged."""
    changes: tuple[str, ...]
    """Source values the export had to change, each with why."""
    missing: str | None
    """What an export without a source lacks and what that means (no tokenizer ...)."""

    def summary(self) -> str:
        """One line: architecture, layers, parameters, where, files and bytes, what was kept
        from the source, what changed, what is missing."""
        line = (f"wrote {self.architecture} ({self.n_layers} layers, "
                f"{self.n_params / 1e6:.1f}M parameters, bf16) to {self.path}: "
                f"{len(self.files)} files, {_size(self.nbytes)} ({', '.join(self.files)})")
        if self.source is not None:
            n_tok = sum(name in TOKENIZER_FILES for name in self.kept)
            kept = ["config values"] + (["generation config"] if GENERATION_CONFIG in self.kept
                                        else []) + ([f"tokenizer ({n_tok} files)"] if n_tok else [])
            line += f"; kept from {self.source}: {', '.join(kept)}"
        if self.changes:
            line += f"; changed: {', '.join(self.changes)}"
        if self.missing:
            line += f"; {self.missing}"
        return line


def missing_tokenizer(cfg: ModelConfig, source: ModelSource | None) -> str | None:
    """What an export lacks for AutoTokenizer, and why (None when the source had a tokenizer)."""
    if source is not None:
        return None if source.has_tokenizer() else (
            f"no tokenizer: {source.path} held no tokenizer files; AutoTokenizer will not load "
            "this directory")
    if cfg.name in zoo_names() and load_config(cfg.name) == cfg:
        return (f"no tokenizer: {cfg.name} is a zoo model (byte-level ids when trained on "
                "text); AutoTokenizer will not load this directory")
    return (f"no tokenizer: model '{cfg.name}' records no Hugging Face source directory "
            "(trained from a config, or saved before sources were recorded); copy the "
            "tokenizer files of the model it came from beside config.json to load it with "
            "AutoTokenizer")


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} bytes"
