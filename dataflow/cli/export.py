"""`dataflow-export RUN_OR_CKPT OUT_DIR`: write the weights of a checkpoint (a step directory,
or the newest under a --checkpoint-dir) or of a saved model directory as a Hugging Face
directory of the model's family in bf16 (LlamaForCausalLM, Qwen3ForCausalLM, ...) that
`AutoModelForCausalLM.from_pretrained` loads, with the source's tokenizer and generation config
when the model came from a Hugging Face directory, and say in one line what it wrote. Reads the
command line and reports; the blocks come from dataflow.export, the files from models.hf. Never
starts an engine or touches a device."""

from __future__ import annotations

import argparse
import sys

from dataflow.cli.args import Outcome, add_version_flag, run_command
from dataflow.export import blocks_of
from dataflow.models.errors import ChecksumError, ConfigError

PROG = "dataflow-export"
OVERWRITE = "--overwrite"
"""The flag's spelling, named in the refusal of an occupied OUT_DIR."""


def build_parser() -> argparse.ArgumentParser:
    # a plain ArgumentParser: a mistake prints the usage before its error line, as it always has;
    # flags only as spelled in full, as the other CLIs take them (args.OneLineParser)
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Export a checkpoint or saved model as a Hugging Face directory of its "
                    "family (config.json + bf16 safetensors, sharded at 5 GiB with an index; "
                    "a model imported from a Hugging Face directory keeps its config values, "
                    "tokenizer files and generation_config.json). Prints one line on stderr "
                    "saying what was written; a failed export leaves nothing at OUT_DIR.")
    p.add_argument("source", metavar="RUN_OR_CKPT",
                   help="a checkpoint directory (step_*), a checkpoint root (its newest "
                        "checkpoint is used) or a saved model directory")
    p.add_argument("out", metavar="OUT_DIR", help="new or empty directory to write")
    p.add_argument(OVERWRITE, action="store_true",
                   help="replace OUT_DIR if it already holds a Hugging Face model")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 checks")
    add_version_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv, _export, outcomes=(
        Outcome(catch=(ConfigError, ChecksumError), exit_code=2),
        Outcome(catch=(OSError,), exit_code=1, words="failed while writing: {exc}")))


def _export(args) -> int:
    # models.hf loads NumPy and numba (seconds): imported once the command line is read, so
    # --help and a mistake answer at once
    from dataflow.models.hf import check_export_dir, export_pretrained

    check_export_dir(args.out, args.overwrite, flag=OVERWRITE)  # before reading any weights
    cfg, blocks, source = blocks_of(args.source, verify=not args.no_verify)
    result = export_pretrained(cfg, blocks, args.out, overwrite=args.overwrite, source=source,
                               flag=OVERWRITE)
    print(f"{PROG}: {result.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
