"""Token sources for training: the byte-level corpus shipped with the package (no network) and
a resumable packer of pre-tokenised Parquet data. Produces int32 token rows only; never touches
a model, a plan or a device."""

from dataflow.data.shipped import (
    BYTE_VOCAB,
    decode,
    encode,
    shipped_text,
    shipped_tokens,
    token_stream,
)

__all__ = [
    "BYTE_VOCAB",
    "ArrowTokenDataset",
    "decode",
    "encode",
    "shipped_text",
    "shipped_tokens",
    "token_stream",
]


def __getattr__(name: str):
    if name == "ArrowTokenDataset":
        # pyarrow adds about 0.2 s to the import: loaded only when the Parquet loader is used
        from dataflow.data.arrow import ArrowTokenDataset

        return ArrowTokenDataset
    raise AttributeError(f"module 'dataflow.data' has no attribute '{name}'")
