"""On-disk model format: bit-exact round trip, and refusal of damaged or foreign directories."""

import json

import numpy as np
import pytest

from dataflow.models import ChecksumError, ConfigError, load_config
from dataflow.models.init import BF16, init_model
from dataflow.models.layout import BlockKind, head_layout, layer_layout
from dataflow.models.storage import load_block_into, load_model, read_manifest, save_model

TINY = load_config("tiny")


@pytest.fixture
def saved(tmp_path):
    weights = init_model(TINY, 3)
    path = save_model(weights, tmp_path / "model")
    return weights, path


def _same(a, b) -> bool:
    return np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_round_trip_on_tiny_is_bit_exact(saved):
    """Saving then loading gives the same config and byte-identical blocks."""
    weights, path = saved
    loaded = load_model(path)
    assert loaded.cfg == TINY
    for (_, _, _, a), (_, _, _, b) in zip(weights.blocks(), loaded.blocks()):
        assert _same(a, b)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "embed.bin",
        "head.bin",
        "layer_000.bin",
        "layer_001.bin",
        "manifest.json",
    ]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_manifest_records_names_offsets_shapes_and_checksums(saved):
    """The manifest names every tensor as transformers does, with byte offsets and shapes."""
    _, path = saved
    manifest = json.loads((path / "manifest.json").read_text())
    layer1 = manifest["blocks"][2]
    assert layer1["file"] == "layer_001.bin" and layer1["kind"] == "layer"
    assert layer1["layer"] == 1 and layer1["nbytes"] == layer_layout(TINY).nbytes
    assert len(layer1["sha256"]) == 64
    q = layer1["tensors"][1]
    assert q == {
        "name": "model.layers.1.self_attn.q_proj.weight",
        "offset_bytes": 256,
        "shape": [TINY.q_dim, TINY.model_dim],
        "dtype": "bfloat16",
    }
    assert manifest["blocks"][-1]["tensors"][1]["name"] == "lm_head.weight"


def test_load_block_into_caller_memory(saved):
    """One block loads straight into a caller-provided buffer, bit-exact."""
    weights, path = saved
    out = np.zeros(layer_layout(TINY).numel, BF16)
    assert load_block_into(path, "layer", 1, out) is out
    assert _same(out, weights.layers[1])
    head = np.zeros(head_layout(TINY).numel, BF16)
    load_block_into(path, BlockKind.HEAD, None, head)
    assert _same(head, weights.head)
    with pytest.raises(ConfigError, match="has 2 layers"):
        load_block_into(path, "layer", 5, out)
    with pytest.raises(ConfigError, match="46336 elements"):
        load_block_into(path, "layer", 0, np.zeros(5, BF16))


def test_flipped_byte_is_refused_with_checksum_error(saved):
    """A single changed byte fails the sha256 check, naming the file and both digests."""
    _, path = saved
    file = path / "layer_001.bin"
    data = bytearray(file.read_bytes())
    data[1000] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="layer_001.bin") as err:
        load_model(path)
    manifest = read_manifest(path)[1]
    assert err.value.expected == manifest["blocks"][2]["sha256"]
    assert len(err.value.actual) == 64 and err.value.actual != err.value.expected
    load_model(path, verify=False)  # sizes still match, so an unverified load goes through


def test_truncated_or_oversized_file_is_refused(saved):
    """A block file of the wrong size is refused even without checksum verification."""
    _, path = saved
    file = path / "embed.bin"
    data = file.read_bytes()
    file.write_bytes(data[:-2])
    with pytest.raises(ChecksumError, match="truncated") as err:
        load_model(path, verify=False)
    assert err.value.expected == f"{len(data)} bytes"
    assert err.value.actual == f"{len(data) - 2} bytes"
    file.write_bytes(data + b"\0\0")
    with pytest.raises(ChecksumError, match="oversized"):
        load_model(path)


def test_missing_file_is_refused(saved):
    """A deleted block file is reported by name."""
    _, path = saved
    (path / "head.bin").unlink()
    with pytest.raises(ChecksumError, match="head.bin.*missing") as err:
        load_model(path)
    assert err.value.actual == "missing"


def test_non_model_directory_is_refused(tmp_path):
    """A directory without config.json and manifest.json is not a model."""
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="not a model directory"):
        load_model(tmp_path)
    with pytest.raises(ConfigError, match="not a model directory"):
        load_model(tmp_path / "absent")


def test_manifest_that_disagrees_with_config_is_refused(saved):
    """A manifest whose tensors do not match config.json is refused as ConfigError."""
    _, path = saved
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["blocks"][1]["tensors"][1]["shape"] = [1, 1]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="does not match"):
        load_model(path)


def test_save_refuses_to_overwrite_unless_asked(saved, tmp_path):
    """An existing model is kept unless overwrite=True; a foreign directory is never replaced."""
    _, path = saved
    other = init_model(TINY, 4)
    with pytest.raises(ConfigError, match="overwrite=True"):
        save_model(other, path)
    assert not _same(load_model(path).embed, other.embed)
    save_model(other, path, overwrite=True)
    assert _same(load_model(path).embed, other.embed)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a model"):
        save_model(other, foreign, overwrite=True)
    assert (foreign / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    save_model(other, empty)
    assert _same(load_model(empty).head, other.head)
