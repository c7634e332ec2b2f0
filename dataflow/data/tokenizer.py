"""The tokenizer a run's text becomes ids with: a model directory's own (tokenizer.json read by
the `tokenizers` library, the special tokens and chat template of tokenizer_config.json and
chat_template.jinja, as transformers reads them) or the byte-level one of the zoo's byte models.
choose_tokenizer decides which, and refuses the byte-level trap: a model with a tokenizer of its
own trains on byte ids only when asked for by name. Never reads data, never touches a device.

The `tokenizers` library is the `data` extra (pip install 'dataflow[data]'); it is imported only
when a model's tokenizer is used, and its absence is a ConfigError naming the tokenizer and the
install command."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from dataflow.data.shipped import BYTE_VOCAB
from dataflow.models.errors import ConfigError

BYTES = "bytes"
"""--tokenizer's name for the byte-level tokenizer (ids 0..255, the zoo's byte models)."""
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
"""The named special tokens transformers passes a chat template (its special_tokens_map)."""
INSTALL = "pip install 'dataflow[data]'"


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """What identifies a tokenizer and what the data path needs of it (JSON-able)."""

    name: str
    """The tokenizer.json path, or 'bytes'."""
    digest: str
    """sha256 over its files (tokenizer.json, tokenizer_config.json, chat_template.jinja): a
    changed tokenizer re-tokenises a cached corpus."""
    vocab_size: int
    """Ids it can produce, added tokens included."""
    eos_id: int | None
    special_tokens: dict
    """bos_token, eos_token, ... as strings (what a chat template sees)."""
    chat_template: str | None


class Tokenizer:
    """A model's tokenizer (tokenizers.Tokenizer) or the byte-level one, behind one interface.
    Picklable by path, so worker processes load their own copy."""

    def __init__(self, info: TokenizerInfo):
        self.info = info
        self._tok = None
        if info.name != BYTES:
            self._tok = _load_library_tokenizer(Path(info.name))

    def __getstate__(self):
        return {"info": self.info}

    def __setstate__(self, state):
        # A worker process unpickles the tokenizer with every unit of work it is sent: load each
        # tokenizer once per process (a 150k-id tokenizer.json takes about 0.6 s to load, longer
        # than encoding a unit; loading it per unit made 2 workers 5x slower than 1 process).
        self.info = state["info"]
        self._tok = None if self.info.name == BYTES else _process_tokenizer(self.info.name,
                                                                             self.info.digest)

    @property
    def is_bytes(self) -> bool:
        return self._tok is None

    def encode(self, text: str, *, special: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids, char offsets (n, 2) or None for bytes) of `text`. special: add the tokens the
        tokenizer's post-processor adds (a Llama's BOS), as transformers' tokenizer(text) does;
        False as apply_chat_template tokenises its rendering."""
        if self._tok is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64), None
        enc = self._tok.encode(text, add_special_tokens=special)
        return np.asarray(enc.ids, np.int64), np.asarray(enc.offsets, np.int64).reshape(-1, 2)

    def encode_many(self, texts: list[str], special: list[bool], *,
                    offsets: list[bool]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """encode() of each text in order, through the library's batch call (one per value of
        `special`); offsets only where asked (they cost about 15 % of an encode to convert)."""
        out: list = [None] * len(texts)
        for flag in (True, False):
            at = [i for i, s in enumerate(special) if s is flag]
            if not at:
                continue
            if self._tok is None:
                for i in at:
                    out[i] = (np.frombuffer(texts[i].encode("utf-8"), np.uint8)
                              .astype(np.int64), None)
                continue
            for i, enc in zip(at, self._tok.encode_batch([texts[i] for i in at],
                                                         add_special_tokens=flag)):
                out[i] = (np.asarray(enc.ids, np.int64),
                          np.asarray(enc.offsets, np.int64).reshape(-1, 2) if offsets[i]
                          else None)
        return out

    @property
    def cuts_cleanly(self) -> bool:
        """True when encoding a text in pieces cut at a newline a letter follows gives the ids
        of encoding it whole (the byte-level BPEs of Llama 3, Qwen, GPT-2: their pre-tokenisers
        split there anyway); False for one that prepends a space to every input (Llama 2's and
        Mistral's SentencePiece style): their text files are then tokenised whole
        (dataflow.data.records.plan_slices). Found by trying CUT_PROBES, once per object."""
        if self._tok is None:
            return True
        cached = getattr(self, "_cuts_cleanly", None)
        if cached is None:
            cached = self._cuts_cleanly = all(_cuts_cleanly(self._tok, t) for t in CUT_PROBES)
        return cached

    def token_to_id(self, token: str) -> int | None:
        return None if self._tok is None else self._tok.token_to_id(token)

    def added_tokens(self) -> tuple[str, ...]:
        """The added tokens' strings (<|im_end|>, ...), longest first."""
        if self._tok is None:
            return ()
        tokens = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        return tuple(sorted(tokens, key=len, reverse=True))


CUT_PROBES = ("The first line of text.\nSecond line, with words.\n\nA new paragraph here.\n",
              "  indented code()\nreturn x\n#comment\nÜber naïve café.\nEnd of it all",
              "one\ntwo\nthree 3\nFour\tfive\n")
"""Texts whose every newline-then-letter cut must not change the ids (Tokenizer.cuts_cleanly)."""


def _cuts_cleanly(tok, text: str) -> bool:
    # The cut rule of dataflow.data.records (_TEXT_CUT): after a newline an ASCII letter follows.
    cuts = [m.start() + 1 for m in re.finditer(r"\n(?=[A-Za-z])", text)]
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    whole = tok.encode(text, add_special_tokens=False).ids
    return whole == [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids]


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(TokenizerInfo(BYTES, "bytes-v1", BYTE_VOCAB, None, {}, None))


def own_tokenizer_file(model: str | Path | None) -> Path | None:
    """The tokenizer a model directory ships (tokenizer.json, else tokenizer.model), or None."""
    if model is None or not Path(model).is_dir():
        return None
    for name in (TOKENIZER_FILE, "tokenizer.model"):
        if (Path(model) / name).is_file():
            return Path(model) / name
    return None


def choose_tokenizer(model: str | Path | None, tokenizer: str | None,
                     vocab_size: int) -> Tokenizer:
    """The tokenizer for a run of `model` (a zoo name, a model or checkpoint directory):
    `tokenizer` when given ('bytes', a tokenizer.json or a directory holding one), else the
    model directory's own, else bytes. ConfigError (exit 2) for a tokenizer that cannot be used,
    one whose vocabulary is larger than the model's, and a model shipping only a SentencePiece
    tokenizer.model."""
    if tokenizer == BYTES:
        tok = byte_tokenizer()
    elif tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        own = own_tokenizer_file(model) or _checkpoint_source_tokenizer(model)
        if own is None:
            tok = byte_tokenizer()
        elif own.name != TOKENIZER_FILE:
            raise ConfigError(
                f"{model} ships a SentencePiece {own.name} but no {TOKENIZER_FILE}; write one "
                "with transformers (AutoTokenizer.from_pretrained(d).save_pretrained(d)), pass "
                "--tokenizer PATH to another tokenizer.json, or --tokenizer bytes to train on "
                "byte ids (not that model's tokens)")
        else:
            tok = load_tokenizer(own)
    if tok.info.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {tok.info.name} has {tok.info.vocab_size:,} ids but the model's "
            f"vocab_size is {vocab_size:,}: its larger ids have no embedding row; use the "
            "tokenizer the model was trained with (a model may have more rows than its "
            "tokenizer ids, never fewer)")
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json (or a directory holding one) with the tokenizer_config.json and
    chat_template.jinja beside it, if any."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--tokenizer {path}: no {TOKENIZER_FILE} there; pass a "
                          f"{TOKENIZER_FILE}, a directory holding one, or '{BYTES}'")
    config = _read_config(file.parent / CONFIG_FILE)
    template = _chat_template(file.parent, config)
    specials = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES
                if config.get(name) is not None}
    digest = hashlib.sha256()
    for f in (file, file.parent / CONFIG_FILE, file.parent / TEMPLATE_FILE):
        digest.update(f.name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"") + b"\0")
    lib = _load_library_tokenizer(file)
    eos = specials.get("eos_token")
    eos_id = lib.token_to_id(eos) if eos else None
    info = TokenizerInfo(str(file), digest.hexdigest(), lib.get_vocab_size(with_added_tokens=True),
                         eos_id, specials, template)
    tok = Tokenizer.__new__(Tokenizer)
    tok.info, tok._tok = info, lib
    return tok


@functools.lru_cache(maxsize=4)
def _process_tokenizer(name: str, digest: str):
    """The library tokenizer of `name`, loaded once per process for each digest."""
    return _load_library_tokenizer(Path(name))


def _load_library_tokenizer(file: Path):
    try:
        import tokenizers  # the data extra: only when a model's own tokenizer is used
    except ImportError:
        raise ConfigError(f"tokenizing with {file} needs the tokenizers library ({INSTALL}); "
                          f"or pass --tokenizer {BYTES} to train on byte ids (not that model's "
                          "tokens)") from None
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception for a malformed file
        raise ConfigError(f"{file} is not a tokenizer the tokenizers library can read "
                          f"({str(exc)[:200]}); pass --tokenizer with a tokenizer.json that "
                          f"transformers or tokenizers wrote, or --tokenizer {BYTES}") from None


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); write it again with "
                          "transformers' save_pretrained") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def _chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja (transformers 4.43+ writes it), else tokenizer_config.json's
    chat_template: a string, or a list of {name, template} of which 'default' is used."""
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{folder / CONFIG_FILE}: chat_template is "
                          f"{type(template).__name__}, not a Jinja template string")
    return template


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value)


def _checkpoint_source_tokenizer(model) -> Path | None:
    """A checkpoint step directory keeps its source model's tokenizer under source/."""
    if model is None:
        return None
    return own_tokenizer_file(Path(model) / "source")
