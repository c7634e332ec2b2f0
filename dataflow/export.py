"""`dataflow-export RUN_OR_CKPT OUT_DIR`: write the weights of a checkpoint (a step directory,
or the newest under a --checkpoint-dir) or of a saved model directory as a Hugging Face Llama
directory in bf16 that `LlamaForCausalLM.from_pretrained` loads. Reads and writes one block at a
time, checksums verified; never starts an engine or touches a device."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dataflow import __version__
from dataflow.models.errors import ChecksumError, ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dataflow-export",
        description="Export a checkpoint or saved model as a Hugging Face Llama directory "
                    "(config.json + bf16 safetensors, sharded at 5 GiB with an index).")
    p.add_argument("source", metavar="RUN_OR_CKPT",
                   help="a checkpoint directory (step_*), a checkpoint root (its newest "
                        "checkpoint is used) or a saved model directory")
    p.add_argument("out", metavar="OUT_DIR", help="new or empty directory to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it already holds a Hugging Face model")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 checks")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def blocks_of(source: str | Path, *, verify: bool = True):
    """(ModelConfig, iterator of (kind, layer, block)) for a checkpoint or a model directory."""
    from dataflow.checkpoint import checkpoint_model, iter_weight_blocks, resolve_checkpoint

    source = Path(source)
    try:
        ckpt = resolve_checkpoint(source)
    except ConfigError:
        ckpt = None
    if ckpt is not None:
        return checkpoint_model(ckpt), iter_weight_blocks(ckpt, verify=verify)
    from dataflow.models.init import BF16
    from dataflow.models.storage import load_block_into, read_manifest

    cfg, manifest = read_manifest(source)  # refuses, naming what a model directory needs

    def gen():
        import numpy as np

        for entry in manifest["blocks"]:
            out = np.empty(entry["nbytes"] // 2, BF16)
            yield (_kind(entry["kind"]), entry["layer"],
                   load_block_into(source, entry["kind"], entry["layer"], out, verify=verify))

    return cfg, gen()


def _kind(value: str):
    from dataflow.models.layout import BlockKind

    return BlockKind(value)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dataflow.models.hf import save_pretrained

    try:
        cfg, blocks = blocks_of(args.source, verify=not args.no_verify)
        out = save_pretrained(cfg, blocks, args.out, overwrite=args.overwrite)
    except (ConfigError, ChecksumError) as exc:
        print(f"dataflow-export: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"dataflow-export: failed while writing: {exc}", file=sys.stderr)
        return 1
    print(f"dataflow-export: wrote {cfg.name} ({cfg.n_params / 1e6:.1f}M parameters, bf16) "
          f"to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
