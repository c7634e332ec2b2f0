"""What a checkpoint root may hold: this engine's `step_*` directories and the hidden
temporaries of its saves, nothing else, so a --checkpoint-dir pointed at a model directory or
at someone's files is refused before anything is written there. Pure Python (the command lines
check it before loading NumPy); never creates, writes or deletes anything."""

from __future__ import annotations

import os
import re

from dataflow.models.errors import ConfigError

STEP_DIR = re.compile(r"^step_(\d{8,})$")
TEMP_DIR = re.compile(r"^\.step_\d{8,}\.(tmp|old)-(\d+)-[0-9a-f]+$")
META = "checkpoint.json"
_MODEL_FILES = re.compile(r"^(config\.json|.*\.safetensors(\.index\.json)?|tokenizer.*|"
                          r"special_tokens_map\.json|generation_config\.json|manifest\.json|"
                          r".*\.bin|.*\.gguf|.*\.pt|.*\.pth)$")
"""Names that mark a model directory (Hugging Face's or dataflow.models.storage's)."""


def foreign_entries(root: str) -> list[str]:
    """The names under `root` that are not this engine's checkpoints or save temporaries
    (sorted; empty when root is missing or holds only checkpoints)."""
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root)
                  if not ((STEP_DIR.match(name) or TEMP_DIR.match(name))
                          and os.path.isdir(os.path.join(root, name))))


def check_checkpoint_root(root: str, *, force: bool, way_out: str) -> None:
    """Refuse (ConfigError, one line) a checkpoint root that holds anything but checkpoints:
    a model (config.json, *.safetensors, tokenizer files), a step directory itself, or other
    files, naming the directory and what is there. force: allow it anyway. way_out: how the
    caller forces it ('--force-checkpoint-dir', 'force_dir=True')."""
    found = [] if force else foreign_entries(root)
    if not found:
        return
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    if os.path.isfile(os.path.join(root, META)):
        what = f"is itself one checkpoint (it holds {META}), not a directory of them"
        fix = f"pass its parent {os.path.dirname(os.path.abspath(root))}"
    elif any(_MODEL_FILES.match(name) for name in found):
        what = f"holds a model ({shown})"
        fix = "pass an empty or new directory (e.g. a checkpoints/ folder beside it)"
    else:
        what = f"holds files that are not checkpoints ({shown})"
        fix = "pass an empty or new directory"
    raise ConfigError(f"checkpoint directory {root} {what}; saving would write step_* "
                      f"directories among them: {fix}, or {way_out} to write there anyway")
