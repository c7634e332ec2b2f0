"""Tokenise a user's data once, into a cached corpus the packer memory-maps: the ids of every
record, which of them carry loss (assistant tokens of chat records; every token of text), and
where each record starts. Cached beside the data (or in --cache-dir) under a key of the
tokenizer's and the data's hashes, so a changed file or tokenizer re-tokenises and an unchanged
one never does. Parallel over worker processes, with progress and an ETA; written to a temporary
folder renamed into place, so a crash or Ctrl-C leaves no half-written corpus. Never packs rows
and never touches a model's weights or a device.

A corpus folder holds tokens.npy (uint16 when the vocabulary fits, else uint32), learn.npy
(uint8, 1 where the token is learnt), starts.npy (int64, each record's first token, then the
total), chat.npy (uint8 per record: 1 for a chat record, packed whole) and corpus.json (what was
tokenised with what, and the summary)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dataflow.data.chat import ChatError, ChatTemplate, assistant_token_mask
from dataflow.data.records import (TEXT_SUFFIXES, FileSlice, Fields, Record, data_files,
                                   plan_slices, read_slice)
from dataflow.data.tokenizer import Tokenizer, TokenizerInfo
from dataflow.models.errors import ConfigError
from dataflow.progress import Progress

log = logging.getLogger(__name__)

FORMAT = 1
"""Bumped when what a corpus holds or how records become ids changes: old caches re-tokenise."""
UNIT_BYTES = 1 << 18
"""Input bytes per unit of work sent to a worker."""
PARALLEL_BYTES = 8 << 20
"""Data smaller than this is tokenised in this process (starting workers costs about a second)."""
START_METHOD = "fork" if sys.platform == "linux" else "spawn"
"""How workers start. Spawned workers re-import the calling script, which then must call
tokenise under `if __name__ == "__main__":` (a script without it dies in the workers); forked
ones do not, as PyTorch's DataLoader and datasets' map fork on Linux. A worker only reads files,
tokenises and returns arrays: it never touches CUDA or the parent's threads (the tokenizers
library turns its own thread pool off in a forked child)."""
CACHE_FOLDER = ".dataflow-cache"
DIGEST_MEMO = "digests.json"
"""The cache folder's memo of data files' sha256 (_DigestMemo); everything else there is a
corpus folder."""


@dataclasses.dataclass(frozen=True)
class CorpusSummary:
    records: int
    tokens: int
    learnt: int
    """Tokens that carry loss (everything but chat records' prompts and template text)."""
    longest: int
    longest_where: str
    chat_records: int
    silent_records: int
    """Records with no learnt token (a chat without an assistant turn)."""
    input_bytes: int
    seconds: float

    @property
    def masked_share(self) -> float:
        return 1.0 - self.learnt / max(1, self.tokens)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenised corpus on disk (what tokenise() returns)."""

    path: Path
    key: str
    summary: CorpusSummary
    tokenizer: str
    cached: bool
    """Found in the cache (nothing was tokenised this time)."""

    def arrays(self):
        """(tokens, learn, starts, chat), memory-mapped."""
        load = functools.partial(np.load, mmap_mode="r", allow_pickle=False)
        return (load(self.path / "tokens.npy"), load(self.path / "learn.npy"),
                load(self.path / "starts.npy"), load(self.path / "chat.npy"))


def tokenise(data: str | Path, tokenizer: Tokenizer, *, fields: Fields = Fields(),
             chat_template: str | None = None, cache_dir: str | Path | None = None,
             jobs: int | None = None, progress: bool = True) -> Corpus:
    """The corpus of `data` (a file or folder) under `tokenizer`: from the cache when its key
    is there, else tokenised now. chat_template: a template to use instead of the tokenizer's.
    jobs: worker processes (default: the machine's cores; 1 tokenises in this process)."""
    files = data_files(data)
    template = chat_template if chat_template is not None else tokenizer.info.chat_template
    root = _cache_root(Path(data), cache_dir)
    cut = tokenizer.cuts_cleanly
    if not cut and any(f.suffix in TEXT_SUFFIXES for f in files):
        log.info("tokenizer %s prepends a space to each input: its text files are tokenised "
                 "whole (one worker per file), so the ids are those of each file at once",
                 tokenizer.info.name)
    key = _key(files, tokenizer.info, fields, template, root, cut)
    final = root / f"{Path(data).resolve().name}-{key[:16]}"
    if (final / "corpus.json").is_file():
        meta = json.loads((final / "corpus.json").read_text())
        return Corpus(final, key, CorpusSummary(**meta["summary"]), tokenizer.info.name, True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        summary = _tokenise_into(tmp, files, tokenizer, fields, template, jobs, progress, cut)
        meta = {"format": FORMAT, "key": key, "tokenizer": dataclasses.asdict(tokenizer.info)
                | {"chat_template": template}, "fields": dataclasses.asdict(fields),
                "files": [str(f) for f in files], "summary": dataclasses.asdict(summary)}
        (tmp / "corpus.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another process cached the same key meanwhile: theirs is the same
            if not (final / "corpus.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Corpus(final, key, summary, tokenizer.info.name, False)


def _key(files, info: TokenizerInfo, fields: Fields, template, root: Path,
         cut_text: bool = True) -> str:
    """sha256 of the format, the tokenizer's files, the fields and template, whether text is
    cut into pieces (a tokenizer that does not cut cleanly gets keys of its own, so a corpus
    an older version cut is tokenised again), and every data file's path and contents
    (through _DigestMemo)."""
    memo = _DigestMemo(root)
    parts = [FORMAT, info.digest, dataclasses.asdict(fields), template]
    h = hashlib.sha256(json.dumps(parts + ([] if cut_text else ["whole-text"])).encode())
    for f in files:
        h.update(str(f.resolve()).encode() + b"\0" + memo.digest(f).encode() + b"\0")
    memo.save()
    return h.hexdigest()


class _DigestMemo:
    """Each data file's sha256, remembered in the cache folder by path, size and mtime, so an
    unchanged 10 GB corpus is not read again on every run (a file whose size or mtime changed
    is hashed again; an edit keeping both, which tools do not make, would go unseen)."""

    def __init__(self, root: Path):
        self.path = root / DIGEST_MEMO
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def digest(self, f: Path) -> str:
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        hit = self.known.get(str(f.resolve()))
        if hit and hit[:2] == stamp:
            return hit[2]
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
        self.known[str(f.resolve())] = stamp + [h.hexdigest()]
        self.changed = True
        return h.hexdigest()

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(self.known))
            os.replace(tmp, self.path)
        except OSError:  # a memo only: without it the next run hashes again
            pass


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/dataflow/tokens (default ~/.cache/dataflow/tokens): for data that
    cannot have a cache beside it (the shipped text, inside the installed package)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dataflow" / "tokens"


def _cache_root(data: Path, cache_dir) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).resolve()
    root = data.resolve().parent / CACHE_FOLDER
    parent = root if root.exists() else root.parent
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot write the tokenised corpus beside {data} ({parent} is not "
                          "writable); pass --cache-dir DIR")
    return root


def _tokenise_into(out: Path, files, tokenizer, fields, template, jobs, progress,
                   cut_text: bool = True):
    t0 = time.perf_counter()
    total = sum(f.stat().st_size for f in files)
    jobs = jobs or os.cpu_count() or 1
    dtype = np.uint16 if tokenizer.info.vocab_size <= 1 << 16 else np.uint32
    writer = _Writer(out, dtype, tokenizer.info.eos_id)
    units = _units(plan_slices(files, UNIT_BYTES, fields, cut_text))
    mib = max(1, total >> 20)
    bar = Progress(mib, "tokenising MiB", logger=log) if progress and total >= PARALLEL_BYTES \
        else None
    done_bytes = 0
    try:
        for result, size in _results(units, tokenizer, template, fields, jobs, total):
            writer.add(result)
            done_bytes += size
            if bar:
                bar.update(min(mib, done_bytes >> 20) - bar.done,
                           info=f"{writer.tokens:,} tokens")
    finally:
        if bar:
            bar.close()
    seconds = time.perf_counter() - t0
    return writer.close(total, seconds)


def _units(work):
    """(unit, input bytes): a FileSlice (a worker reads it), or a list of records read here."""
    for unit in work:
        yield unit, unit.size if isinstance(unit, FileSlice) else sum(r.size for r in unit)


def _results(units, tokenizer, template, fields, jobs, total):
    """(unit result, input bytes) in order, from worker processes when worth it."""
    if jobs <= 1 or total < PARALLEL_BYTES:
        for unit, size in units:
            yield _tokenise_unit(tokenizer, template, unit, fields), size
        return
    ctx = multiprocessing.get_context(START_METHOD)
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx,
                                                initializer=_quiet_worker) as pool:
        pending = collections.deque()
        try:
            for unit, size in units:
                pending.append((pool.submit(_tokenise_unit, tokenizer, template, unit, fields),
                                size))
                if len(pending) >= 2 * jobs:
                    future, n = pending.popleft()
                    yield future.result(), n
            while pending:
                future, n = pending.popleft()
                yield future.result(), n
        except BaseException:
            for future, _ in pending:
                future.cancel()
            raise


def _quiet_worker():
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the
    # parallelism


@functools.lru_cache(maxsize=4)
def _template(source: str, specials: tuple, added: tuple) -> ChatTemplate:
    return ChatTemplate(source, dict(specials), added)


def _tokenise_unit(tokenizer: Tokenizer, template: str | None, unit, fields: Fields = Fields()):
    """The ids, learn flags, chat flags, continuation flags and places of a unit's records (a
    FileSlice, read here, or a list of Records; ConfigError naming a bad record). The texts are encoded in two library batch calls (with
    and without the post-processor's special tokens), which the library spreads over its
    threads when this runs in the main process."""
    kept, texts, spans = [], [], []
    for r in read_slice(unit, fields) if isinstance(unit, FileSlice) else unit:
        if r.text is not None and not r.text and not r.continues:
            continue  # an empty document: nothing to learn, not even its end
        kept.append(r)
        if r.messages is None:
            texts.append(r.text)
            spans.append(None)
            continue
        text, s = _render(tokenizer, template, r)
        texts.append(text)
        spans.append(s)
    special = [r.messages is None and not r.continues for r in kept]
    encoded = tokenizer.encode_many(texts, special, offsets=[s is not None for s in spans])
    ids, learn = [], []
    for (t, offsets), s in zip(encoded, spans):
        ids.append(t)
        learn.append(np.ones(t.size, np.uint8) if s is None else
                     assistant_token_mask(offsets, s).astype(np.uint8))
    return (ids, learn, [r.messages is not None for r in kept], [r.continues for r in kept],
            [r.where for r in kept])


def _render(tokenizer: Tokenizer, template: str | None, r: Record):
    """A chat record's rendered text and assistant spans."""
    if tokenizer.is_bytes:  # before the template: passing one would not help
        raise ConfigError(f"{r.where}: a chat record needs a model's tokenizer (its "
                          "tokenizer.json and chat template), not bytes; pass a model "
                          "directory that has one, or --tokenizer PATH")
    if template is None:
        raise ConfigError(
            f"{r.where}: a chat record, but tokenizer {tokenizer.info.name} has no chat "
            "template (tokenizer_config.json's chat_template or chat_template.jinja); "
            "pass --chat-template FILE")
    tpl = _template(template, tuple(sorted(tokenizer.info.special_tokens.items())),
                    tokenizer.added_tokens())
    try:
        return tpl.render_with_spans(_drop_none(r.messages))
    except ChatError as exc:
        raise ConfigError(f"{r.where}: {exc}") from None


def _drop_none(messages):
    """As transformers does before rendering: keys whose value is None are left out (a
    Parquet struct's missing fields come as None)."""
    if not isinstance(messages, list):
        return messages
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
            for m in messages]


class _Writer:
    """Appends units to the corpus's files, one record at a time: a text file's later pieces
    join its document, and the tokenizer's EOS ends each text document (learnt: the model learns
    where documents end; the packer keeps attention from crossing it)."""

    def __init__(self, out: Path, dtype, eos_id: int | None):
        self.out, self.dtype, self.eos_id = out, dtype, eos_id
        self._tok = open(out / "tokens.raw", "wb")
        self._learn = open(out / "learn.raw", "wb")
        self.starts, self.chat = [], []
        self.tokens = self.learnt = self.silent = 0
        self.longest = (0, "")
        self._open = None
        """(where, is chat, tokens so far, learnt so far) of the record being written."""

    def add(self, result) -> None:
        for t, m, c, k, where in zip(*result):
            if not k:
                self._close_record()
                self._open = [where, c, 0, 0]
                self.starts.append(self.tokens)
                self.chat.append(c)
            self._write(t, m)

    def _write(self, t, m) -> None:
        self._tok.write(np.asarray(t).astype(self.dtype).tobytes())
        self._learn.write(np.asarray(m, np.uint8).tobytes())
        learnt = int(np.count_nonzero(m))
        self.tokens += len(t)
        self.learnt += learnt
        self._open[2] += len(t)
        self._open[3] += learnt

    def _close_record(self) -> None:
        if self._open is None:
            return
        where, chat, n, _ = self._open
        if not chat and self.eos_id is not None:
            self._write([self.eos_id], [1])
        where, chat, n, learnt = self._open
        self.silent += learnt == 0
        if n > self.longest[0]:
            self.longest = (n, where)
        self._open = None

    def close(self, input_bytes: int, seconds: float) -> CorpusSummary:
        self._close_record()
        self._tok.close()
        self._learn.close()
        n = self.tokens
        for name, dtype in (("tokens", self.dtype), ("learn", np.uint8)):
            raw = self.out / f"{name}.raw"
            arr = np.memmap(raw, dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
            np.save(self.out / f"{name}.npy", arr)
            del arr
            raw.unlink()
        np.save(self.out / "starts.npy", np.asarray(self.starts + [n], np.int64))
        np.save(self.out / "chat.npy", np.asarray(self.chat, np.uint8))
        return CorpusSummary(len(self.chat), n, self.learnt, self.longest[0], self.longest[1],
                             int(sum(self.chat)), int(self.silent), input_bytes, seconds)
