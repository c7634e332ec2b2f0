"""On-disk model format: a directory with config.json (the ModelConfig), manifest.json (format
version and, per block file, its kind, layer, byte size, sha256 and the transformers name, byte
offset, shape and dtype of each tensor) and one raw little-endian bf16 file per block (embed.bin,
layer_000.bin, ..., head.bin), byte-for-byte the in-memory block. Never leaves a half-written
model under the final name, never deletes a directory that is not a model, and never returns
bytes whose size or checksum disagrees with the manifest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dataflow.models.atomic_io import write_hashed
from dataflow.models.config import ModelConfig
from dataflow.models.errors import ChecksumError, ConfigError
from dataflow.models.init import BF16, ModelWeights
from dataflow.models.layout import BlockKind, BlockLayout, embed_layout, head_layout, layer_layout
from dataflow.models.serial import from_dict, to_json

FORMAT = "dataflow-model"
FORMAT_VERSION = 1
_READ_BYTES = 64 << 20
"""Files are read and hashed in 64 MiB pieces: large enough that hashlib (which releases the GIL)
keeps the threads busy, small enough to stay in cache between read and hash."""


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def block_file(kind: BlockKind, layer: int | None) -> str:
    """File name of a block: embed.bin, layer_007.bin, head.bin."""
    return f"layer_{layer:03d}.bin" if kind is BlockKind.LAYER else f"{kind.value}.bin"


def _block_entry(layout: BlockLayout, layer: int | None, nbytes: int, sha256: str) -> dict:
    return {
        "file": block_file(layout.kind, layer),
        "kind": layout.kind.value,
        "layer": layer,
        "nbytes": nbytes,
        "sha256": sha256,
        "tensors": [
            {
                "name": layout.full_name(t.name, layer),
                "offset_bytes": 2 * t.offset,
                "shape": list(t.shape),
                "dtype": "bfloat16",
            }
            for t in layout.tensors
        ],
    }


def _expected_entries(cfg: ModelConfig) -> list[dict]:
    """Manifest entries the config implies, with sizes but no checksums (for comparison)."""
    lay = layer_layout(cfg)
    blocks = [(embed_layout(cfg), None)] + [(lay, i) for i in range(cfg.n_layers)]
    blocks.append((head_layout(cfg), None))
    return [_block_entry(layout, layer, layout.nbytes, "") for layout, layer in blocks]


def _write_block(path: Path, block: np.ndarray) -> str:
    """Write one block file, fsync it, and return the sha256 of the bytes written."""
    return write_hashed(path, memoryview(block.view(np.uint8)))


def is_model_dir(path: str | Path) -> bool:
    """True for a directory save_model wrote (manifest.json beside config.json)."""
    path = Path(path)
    return (path / "manifest.json").is_file() and (path / "config.json").is_file()


def save_model(weights: ModelWeights, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write `weights` as a model directory at `path`, atomically: everything goes into a
    temporary directory beside it, which is renamed into place only when complete. An existing
    empty directory is replaced; an existing model directory only with overwrite=True; any other
    existing path is refused. Blocks are written and hashed on a thread pool."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"cannot save a model to {path}: it is a file; choose a new path")
        if any(path.iterdir()):
            if not is_model_dir(path):
                raise ConfigError(
                    f"cannot save a model to {path}: it is a non-empty directory "
                    "that is not a model; choose a new or empty path"
                )
            if not overwrite:
                raise ConfigError(
                    f"a model already exists at {path}; pass overwrite=True to "
                    "replace it, or choose a new path"
                )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        blocks = weights.blocks()
        with ThreadPoolExecutor(_threads()) as pool:
            digests = list(
                pool.map(lambda b: _write_block(tmp / block_file(b[0], b[1]), b[3]), blocks)
            )
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "byte_order": "little",
            "blocks": [
                _block_entry(layout, layer, block.nbytes, sha)
                for (_, layer, layout, block), sha in zip(blocks, digests)
            ],
        }
        (tmp / "config.json").write_text(to_json(weights.cfg) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename tmp to path; an old directory there is first moved aside, then deleted."""
    old = None
    if path.exists():
        if any(path.iterdir()):
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(old)
        else:
            path.rmdir()
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old)


def read_manifest(path: str | Path) -> tuple[ModelConfig, dict]:
    """The config and manifest of a model directory, checked against each other: the block
    list, sizes, tensor names, offsets and shapes must be exactly what the config implies."""
    path = Path(path)
    if not is_model_dir(path):
        raise ConfigError(
            f"{path} is not a model directory (it needs config.json and "
            "manifest.json); save one with dataflow.models.storage.save_model"
        )
    try:
        cfg_data = json.loads((path / "config.json").read_text())
        manifest = json.loads((path / "manifest.json").read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: config.json or manifest.json is not valid JSON ({exc}); re-save the model"
        ) from None
    cfg = from_dict(ModelConfig, cfg_data, where=str(path / "config.json"))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{path / 'manifest.json'} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"{path}: manifest format_version {manifest.get('format_version')!r} "
            f"is not supported; this version reads {FORMAT_VERSION}"
        )
    blocks = manifest.get("blocks")
    expected = _expected_entries(cfg)
    if not isinstance(blocks, list) or len(blocks) != len(expected):
        got = len(blocks) if isinstance(blocks, list) else blocks
        raise ConfigError(
            f"{path}: manifest lists {got} blocks but model '{cfg.name}' has "
            f"{len(expected)}; the directory is damaged, re-save it"
        )
    for got, want in zip(blocks, expected):
        shown = {k: got.get(k) for k in want if k != "sha256"} if isinstance(got, dict) else got
        if shown != {k: v for k, v in want.items() if k != "sha256"}:
            raise ConfigError(
                f"{path}: manifest entry {shown} does not match the block "
                f"'{want['file']}' that config.json implies; re-save the model"
            )
        if not isinstance(got.get("sha256"), str):
            raise ConfigError(f"{path}: manifest entry for {want['file']} has no sha256")
    return cfg, manifest


def _read_block(path: Path, entry: dict, out: np.ndarray, verify: bool) -> None:
    """Read one block file into `out` (its bytes), refusing a size or checksum mismatch."""
    file = path / entry["file"]
    want = entry["nbytes"]
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise ChecksumError(
            f"block file {file} is missing (expected {want} bytes); re-save or re-copy the model",
            path=str(file),
            expected=f"{want} bytes",
            actual="missing",
        ) from None
    if size != want:
        how = "truncated" if size < want else "oversized"
        raise ChecksumError(
            f"block file {file} is {how}: {size} bytes, manifest says {want}; re-copy the model",
            path=str(file),
            expected=f"{want} bytes",
            actual=f"{size} bytes",
        )
    data = memoryview(out.view(np.uint8))
    digest = hashlib.sha256()
    with open(file, "rb", buffering=0) as f:
        for start in range(0, want, _READ_BYTES):
            piece = data[start : start + _READ_BYTES]
            n = f.readinto(piece)
            if n != len(piece):
                raise ChecksumError(
                    f"block file {file} ended early at byte {start + n}",
                    path=str(file),
                    expected=f"{want} bytes",
                    actual=f"{start + n} bytes",
                )
            if verify:
                digest.update(piece)
    if verify and digest.hexdigest() != entry["sha256"]:
        raise ChecksumError(
            f"block file {file} fails its checksum: sha256 "
            f"{digest.hexdigest()}, manifest says {entry['sha256']}; the file "
            "is corrupt, re-copy the model",
            path=str(file),
            expected=entry["sha256"],
            actual=digest.hexdigest(),
        )


def load_model(path: str | Path, *, verify: bool = True) -> ModelWeights:
    """Read a model directory into fresh host blocks. Sizes are always checked; with verify,
    every block's sha256 too (on a thread pool). Raises ConfigError for a directory that is not
    a model, ChecksumError for a missing, truncated, oversized or corrupt block file."""
    path = Path(path)
    cfg, manifest = read_manifest(path)
    weights = ModelWeights.empty(cfg)
    arrays = [b[3] for b in weights.blocks()]
    with ThreadPoolExecutor(_threads()) as pool:
        for fut in [
            pool.submit(_read_block, path, e, a, verify) for e, a in zip(manifest["blocks"], arrays)
        ]:
            fut.result()
    return weights


def load_block_into(
    path: str | Path,
    kind: BlockKind | str,
    layer: int | None,
    out_array: np.ndarray,
    *,
    verify: bool = True,
) -> np.ndarray:
    """Read one block (kind 'embed' | 'layer' | 'head'; layer index for 'layer', else None)
    straight into `out_array`, a 1-D C-contiguous host bf16 array of the block's size (e.g.
    pinned or arena memory). On a checksum error `out_array` holds the corrupt bytes."""
    path = Path(path)
    try:
        kind = BlockKind(kind)
    except ValueError:
        raise ConfigError(
            f"unknown block kind {kind!r}; use one of {[k.value for k in BlockKind]}"
        ) from None
    is_index = isinstance(layer, (int, np.integer)) and not isinstance(layer, bool)
    if (kind is BlockKind.LAYER and not is_index) or (
        kind is not BlockKind.LAYER and layer is not None
    ):
        raise ConfigError(
            f"block kind '{kind.value}' with layer {layer!r}: pass a layer index "
            "for 'layer' blocks and None for 'embed' and 'head'"
        )
    _, manifest = read_manifest(path)
    wanted = block_file(kind, None if layer is None else int(layer))
    entry = next((e for e in manifest["blocks"] if e["file"] == wanted), None)
    if entry is None:
        n_layers = len(manifest["blocks"]) - 2
        raise ConfigError(
            f"layer {layer} is not in the model at {path}, which has {n_layers} "
            f"layers; pass 0 <= layer < {n_layers}"
        )
    if (
        not isinstance(out_array, np.ndarray)
        or out_array.dtype != BF16
        or out_array.ndim != 1
        or out_array.nbytes != entry["nbytes"]
        or not out_array.flags.c_contiguous
    ):
        raise ConfigError(
            f"out_array for {wanted} must be a 1-D C-contiguous host bfloat16 "
            f"array of {entry['nbytes'] // 2} elements, got "
            f"{getattr(out_array, 'dtype', type(out_array).__name__)} "
            f"{getattr(out_array, 'shape', '')}; allocate one with that size"
        )
    _read_block(path, entry, out_array, verify)
    return out_array
