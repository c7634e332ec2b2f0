"""The one door from a `--data` argument to a source of batches: token files as they are
(dataflow.data.sources), everything else tokenised once with the run's tokenizer
(dataflow.data.tokenizer.choose_tokenizer: the model's own by default) and packed
(dataflow.data.packed). Used by dataflow-demo, dataflow-data and Python callers alike. Never
touches a device and never decides placement.

Byte-level text stays as it always was for a model without a tokenizer of its own (the zoo's
byte models): a text file is its bytes, memory-mapped, one stream."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from dataflow.data.records import JSONL_SUFFIXES, TABLE_SUFFIXES, Fields, table_has_tokens
from dataflow.data.shipped import shipped_text_path
from dataflow.data.sources import check_regular_file, open_source
from dataflow.data.tokenizer import BYTES, Tokenizer, choose_tokenizer, own_tokenizer_file
from dataflow.models.errors import ConfigError

log = logging.getLogger(__name__)

TOKEN_SUFFIXES = (".npy", ".bin")
TOKENISED_SUFFIXES = JSONL_SUFFIXES + TABLE_SUFFIXES
"""What even the byte-level tokenizer tokenises (a byte model's text file is its bytes as they
are; a folder is tokenised whatever the tokenizer)."""


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """How --data becomes tokens (the flags of dataflow-demo and dataflow-data)."""

    tokenizer: str | None = None
    """'bytes', a tokenizer.json or a folder holding one; None: the model's own, else bytes."""
    text_field: str = "text"
    messages_field: str = "messages"
    chat_template: str | None = None
    """A Jinja file to render chat records with instead of the tokenizer's template."""
    too_long: str = "truncate"
    """A chat record longer than a row: 'truncate' or 'drop'."""
    cache_dir: str | None = None
    """Where tokenised corpora are cached (default: .dataflow-cache beside the data)."""
    jobs: int | None = None
    """Worker processes for tokenising (default: the machine's cores)."""
    seed: int = 0
    """Seeds the record order of each epoch."""

    @classmethod
    def from_args(cls, args) -> "DataOptions":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})

    @property
    def fields(self) -> Fields:
        return Fields(self.text_field, self.messages_field)


def is_token_file(path: str | Path | None) -> bool:
    """Data that is already token ids (.npy, .bin, Parquet with a 'tokens' column)."""
    if path is None:
        return False
    path = Path(path)
    if path.suffix in TOKEN_SUFFIXES:
        return True
    return (path.is_dir() or path.suffix == ".parquet") and table_has_tokens(path)


def open_data(path: str | Path | None, seqlen: int, vocab_size: int, *, model=None,
              options: DataOptions = DataOptions(), eval_seqs: int = 0,
              progress: bool = True):
    """A source of batches (next_batch(n), eval_batch(n), state(), load_state()) for `path`
    (None: the shipped text) under the tokenizer choose_tokenizer picks for `model`."""
    if is_token_file(path):
        return open_source(path, seqlen, vocab_size, eval_seqs=eval_seqs)
    if path is not None and not Path(path).is_dir():
        check_regular_file(Path(path))
    tok = choose_tokenizer(model, options.tokenizer, vocab_size)
    if options.tokenizer == BYTES and own_tokenizer_file(model):
        log.warning("--tokenizer bytes: %s has a tokenizer of its own, but its text becomes "
                    "byte ids 0..255 as asked", model)
    if tok.is_bytes and (path is None or (not Path(path).is_dir()
                                          and Path(path).suffix not in TOKENISED_SUFFIXES)):
        return open_source(path, seqlen, vocab_size, eval_seqs=eval_seqs)
    corpus = tokenise_data(path, tok, options, progress=progress)
    return packed_source(corpus, seqlen, tok, options, eval_seqs=eval_seqs)


def tokenise_data(path, tok: Tokenizer, options: DataOptions, *, progress: bool = True):
    """The cached (or newly tokenised) corpus of `path` (None: the shipped text)."""
    # the tokeniser: only when text is tokenised
    from dataflow.data.tokenise import tokenise, user_cache_dir

    template = None
    if options.chat_template is not None:
        try:
            template = Path(options.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {options.chat_template} cannot be read ({exc})"
                              ) from None
    cache = options.cache_dir
    if path is None:  # the shipped text lives in the package, maybe read-only
        path, cache = shipped_text_path(), cache or user_cache_dir()
    corpus = tokenise(path, tok, fields=options.fields, chat_template=template,
                      cache_dir=cache, jobs=options.jobs, progress=progress)
    s = corpus.summary
    log.info("%s %s: %d records, %s tokens (%.0f%% learnt) with %s, in %s", path,
             "found tokenised" if corpus.cached else f"tokenised in {s.seconds:.1f} s",
             s.records, f"{s.tokens:,}", 100 * (1 - s.masked_share), tok.info.name, corpus.path)
    return corpus


def packed_source(corpus, seqlen: int, tok: Tokenizer, options: DataOptions, *,
                  eval_seqs: int = 0):
    # the packer: only when a tokenised corpus trains
    from dataflow.data.packed import PackedCorpus

    pad = tok.token_to_id(tok.info.special_tokens.get("pad_token", "")) \
        if tok.info.special_tokens.get("pad_token") else None
    src = PackedCorpus(corpus, seqlen, eval_seqs=eval_seqs, too_long=options.too_long,
                       seed=options.seed, pad_id=pad if pad is not None else (tok.info.eos_id or 0))
    if src.too_long_records:
        log.warning("%d chat records are longer than seqlen + 1 = %d tokens: %s",
                    src.too_long_records, seqlen + 1,
                    "cut to the row (their endings are not learnt)"
                    if options.too_long == "truncate" else "left out (--too-long drop)")
    if src.silent_records:
        log.warning("%d chat records learn nothing inside a row of %d tokens (no assistant "
                    "turn%s): left out", src.silent_records, seqlen + 1,
                    ", or it lies past the cut" if options.too_long == "truncate" else "")
    return src


def describe_data(model, data, options: DataOptions = DataOptions(), *,
                  seqlen: int | None = None) -> dict:
    """Tokenise `data` (or find it cached) as a run of `model` would, and say what it holds:
    dataflow-data's report (records, tokens, masked share, longest record, speed; with seqlen,
    the records longer than a row)."""
    # NumPy and the model resolution: only when data is described
    from dataflow.models.hf_config import model_config
    import numpy as np

    cfg = model_config(model)
    if is_token_file(data):
        raise ConfigError(f"{data} is token ids already; dataflow-demo reads it as it is "
                          "(nothing to tokenise)")
    tok = choose_tokenizer(model, options.tokenizer, cfg.vocab_size)
    corpus = tokenise_data(data, tok, options, progress=True)
    s = corpus.summary
    report = {"data": str(data), "tokenizer": tok.info.name, "corpus": str(corpus.path),
              "cached": corpus.cached, "records": s.records, "chat_records": s.chat_records,
              "tokens": s.tokens, "learnt_tokens": s.learnt,
              "masked_share": round(s.masked_share, 6), "longest_record": s.longest,
              "longest_where": s.longest_where, "records_learning_nothing": s.silent_records,
              "input_mb": round(s.input_bytes / 1e6, 3), "seconds": round(s.seconds, 3),
              "mb_per_s": round(s.input_bytes / 1e6 / s.seconds, 2) if s.seconds else None}
    if seqlen:
        _, _, starts, chat = corpus.arrays()
        lengths = np.diff(np.asarray(starts))
        long = lengths > seqlen + 1
        report |= {"seqlen": seqlen, "longer_than_row": int(long.sum()),
                   "chat_longer_than_row": int((long & np.asarray(chat, bool)).sum()),
                   "too_long": options.too_long}
    return report
