"""Data for training: the byte-level corpus shipped with the package (no network), token files,
and the user's text, JSONL, chat and Parquet/Arrow data tokenised once with the model's own
tokenizer (open_data, tokenise, PackedCorpus: batches of ids, labels and document ids).
Produces int32 rows only; never touches a model's weights, a plan or a device."""

from dataflow.data.shipped import (
    BYTE_VOCAB,
    decode,
    encode,
    shipped_text,
    shipped_tokens,
    token_stream,
)

LAZY = {"ArrowTokenDataset": "dataflow.data.arrow", "DataOptions": "dataflow.data.open_data",
        "open_data": "dataflow.data.open_data", "tokenise": "dataflow.data.tokenise",
        "PackedCorpus": "dataflow.data.packed", "TokenBatch": "dataflow.data.packed",
        "load_tokenizer": "dataflow.data.tokenizer", "choose_tokenizer": "dataflow.data.tokenizer"}
"""Loaded when first named: pyarrow, jinja2 and tokenizers add to the import."""

__all__ = [
    "BYTE_VOCAB",
    "ArrowTokenDataset",
    "DataOptions",
    "PackedCorpus",
    "TokenBatch",
    "choose_tokenizer",
    "load_tokenizer",
    "open_data",
    "tokenise",
    "decode",
    "encode",
    "shipped_text",
    "shipped_tokens",
    "token_stream",
]


def __getattr__(name: str):
    if name in LAZY:
        import importlib  # the heavy modules load only when named

        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'dataflow.data' has no attribute '{name}'")
