"""The weights of a checkpoint (a step directory, or the newest under a --checkpoint-dir) or of a
saved model directory, read one block at a time with checksums verified, and the Hugging Face
files of the directory the model came from (a checkpoint's stored source/ copy), for
`dataflow-export RUN_OR_CKPT OUT_DIR` (dataflow.cli.export) to write as a Hugging Face
directory of the model's family. Never starts an engine or touches a device."""

from __future__ import annotations

from pathlib import Path

from dataflow.models.errors import ConfigError
from dataflow.models.layout import BlockKind


def blocks_of(source: str | Path, *, verify: bool = True):
    """(ModelConfig, iterator of (kind, layer, block), ModelSource or None) for a checkpoint or
    a model directory; the ModelSource is the Hugging Face files a checkpoint stored (a model
    directory stores none)."""
    # Here, not at the top: they load numba (0.7 s), and `dataflow-export --help` imports this.
    from dataflow.checkpoint import (checkpoint_model, checkpoint_source, iter_weight_blocks,
                                     resolve_checkpoint)

    source = Path(source)
    try:
        ckpt = resolve_checkpoint(source)
    except ConfigError:
        ckpt = None
    if ckpt is not None and (ckpt / "lora_checkpoint.json").is_file():
        raise ConfigError(f"{ckpt} is a LoRA checkpoint (adapters alone, docs/lora.md): export "
                          "it from an Engine built on its base with lora= and load_checkpoint: "
                          "Engine.export_peft(dir) or Engine.save_merged(dir)")
    if ckpt is not None:
        return (checkpoint_model(ckpt), iter_weight_blocks(ckpt, verify=verify),
                checkpoint_source(ckpt))
    # numba again (models.init, models.storage): see the import of dataflow.checkpoint above.
    from dataflow.models.init import BF16
    from dataflow.models.storage import load_block_into, read_manifest  # numba, as above

    cfg, manifest = read_manifest(source)  # refuses, naming what a model directory needs

    def gen():
        import numpy as np

        for entry in manifest["blocks"]:
            out = np.empty(entry["nbytes"] // 2, BF16)
            yield (_kind(entry["kind"]), entry["layer"],
                   load_block_into(source, entry["kind"], entry["layer"], out, verify=verify))

    return cfg, gen(), None


def _kind(value: str):
    return BlockKind(value)
