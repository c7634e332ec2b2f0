"""Transformer descriptions: configs and the zoo, block layouts, FLOP counts, initialisation and
the on-disk model format. Everything else imports this package; it imports none of ours."""

from dataflow.models.config import ModelConfig, load_config, zoo_names
from dataflow.models.errors import ChecksumError, ConfigError
from dataflow.models.flops import FLOP_MODEL_VERSION, SavedLevel, model_flops_per_seq
from dataflow.models.layout import BlockKind, BlockLayout, embed_layout, head_layout, layer_layout

__all__ = [
    "ModelConfig", "load_config", "zoo_names", "ConfigError", "ChecksumError",
    "FLOP_MODEL_VERSION", "SavedLevel", "model_flops_per_seq", "BlockKind", "BlockLayout",
    "embed_layout", "head_layout", "layer_layout",
]
