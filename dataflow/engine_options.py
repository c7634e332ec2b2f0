"""The Engine's options as frozen records (EngineOptions: the budgets and batch the planner works
to, and RunOptions: how the plan runs), the checks of their names and values, and the helpers the
constructor and train_step share: a checkpoint directory as the model, a step's batch arriving in
pieces. Never decides placement and never touches a backend."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from dataflow.batch import _as_int_array
from dataflow.checkpoint import META, SEAL, latest_checkpoint
from dataflow.optimizer import AdamWConfig
from dataflow.precision import check_precision
from dataflow.models.errors import ConfigError


class UnknownOptionError(ConfigError, TypeError):
    """A keyword the Engine does not take. A TypeError, as Python raises for an unexpected
    keyword, and a ConfigError, as every other refusal of the Engine's input. Fields: `name`
    (the bad keyword) and `suggestion` (the closest valid one, or None)."""

    def __init__(self, message: str, *, name: str, suggestion: str | None):
        super().__init__(message)
        self.name = name
        self.suggestion = suggestion


def check_option_names(given: Iterable[str], valid: Iterable[str], where: str) -> None:
    """Refuse the first keyword of `given` not in `valid`, naming the closest valid one."""
    valid = sorted(valid)
    for name in given:
        if name in valid:
            continue
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownOptionError(f"{where} got an unexpected keyword argument {name!r}; {hint}"
                                 f"valid keywords: {', '.join(valid)}",
                                 name=name, suggestion=close[0] if close else None)


def _kind(value) -> str:
    """'a string', 'a list', 'None': what a refused value is, in words."""
    if value is None:
        return "None"
    words = {str: "string", bool: "bool", list: "list", tuple: "tuple", dict: "dict",
             float: "float", int: "int", bytes: "bytes object"}
    name = words.get(type(value), type(value).__name__)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def check_numbers(owner, reals: tuple[str, ...] = (), whole: tuple[str, ...] = (),
                  optional: tuple[str, ...] = ()) -> None:
    """Refuse, by name, a field of `owner` that is not a number ('host_gb must be a number, got
    '1' (a string)'): `reals` any real number, `whole` a whole number; a name also in
    `optional` may be None. bool is refused (True is not a budget). The values themselves are
    checked where they are used (Budget, AdamWConfig, the planner), which name them too."""
    for names, cls, words in ((reals, numbers.Real, "a number"),
                              (whole, numbers.Integral, "a whole number")):
        for name in names:
            value = getattr(owner, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, cls):
                alt = " or None" if name in optional else ""
                raise ConfigError(f"{name} must be {words}{alt}, got {value!r} ({_kind(value)})")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How an Engine runs a plan (everything but the plan itself); Engine.from_plan takes it
    (or these as keywords), Engine.__init__ inside EngineOptions; Engine.__init__ documents
    each."""

    backend: Any = "auto"
    seed: int = 0
    weights: Any = None
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    optimizer: AdamWConfig | None = None
    lr_schedule: Callable[[int], float] | None = None
    sanitize: bool = False
    sanitize_seed: int = 0
    trace: bool = False
    progress: Any = None
    schedule: Any = None
    deferred_update: bool = True
    backward_update: bool = False

    def __post_init__(self) -> None:
        check_numbers(self, reals=("lr", "eps", "weight_decay", "max_grad_norm"),
                      whole=("seed", "sanitize_seed"), optional=("max_grad_norm",))
        betas = self.betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
                isinstance(b, numbers.Real) and not isinstance(b, bool) for b in betas)):
            raise ConfigError(f"betas must be a pair of numbers (beta1, beta2), got {betas!r} "
                              f"({_kind(betas)})")

    @classmethod
    def from_keywords(cls, options: dict, where: str) -> "RunOptions":
        check_option_names(options, (f.name for f in dataclasses.fields(cls)), where)
        return cls(**options)

    def adamw(self) -> AdamWConfig:
        """The AdamW settings: `optimizer` when given, else the single keywords (validated)."""
        if self.optimizer is not None:
            return self.optimizer
        return AdamWConfig(lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                           weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm)

    def check(self) -> None:
        """Refuse combinations that would silently not do what they ask for."""
        clip = self.adamw().max_grad_norm
        if self.backward_update and clip is not None:
            raise ConfigError(
                f"backward_update=True runs a step's AdamW before its global gradient norm is "
                f"known, so it cannot clip (max_grad_norm {clip:g}); pass max_grad_norm=0 (or "
                "None) to turn clipping off, or drop backward_update")


PLAN_FIELDS = ("host_gb", "dev_gb", "seqlen", "seqs_per_step", "tokens_per_step", "profile",
               "plan_options", "precision", "freeze", "lora")
"""The keywords of Engine() that the planner takes (EngineOptions' own fields)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineOptions:
    """Everything Engine(model, ...) takes besides the model and a ring: the budgets and the
    batch the planner works to, and `run` (RunOptions). Engine(model, EngineOptions(...)) is the
    engine Engine(model, host_gb=..., ...) builds from the same values; Engine.__init__
    documents each field."""

    host_gb: float
    dev_gb: float
    seqlen: int
    seqs_per_step: int | None = None
    tokens_per_step: int | None = None
    profile: Any = None
    plan_options: dict | None = None
    precision: str = "bf16"
    freeze: Any = None
    """Blocks that train no further: a spec such as 'embed,head,layers:0-29' or a Frozen
    (dataflow.memplan.plan.frozen; Plan.frozen); None or '' freezes nothing."""
    lora: Any = None
    """LoRA adapters (docs/lora.md; Plan.lora): a Lora, a rank, or dict(rank=, alpha=,
    targets=); the base model is then frozen whole. None: no adapters."""
    run: RunOptions = dataclasses.field(default_factory=RunOptions)

    def __post_init__(self) -> None:
        check_numbers(self, reals=("host_gb", "dev_gb"),
                      whole=("seqlen", "seqs_per_step", "tokens_per_step"),
                      optional=("seqs_per_step", "tokens_per_step"))
        check_precision(self.precision)
        if not isinstance(self.run, RunOptions):
            raise ConfigError(f"run must be a RunOptions, got {_kind(self.run)}")

    def plan_keywords(self) -> dict:
        """plan_options with seqs_per_step / tokens_per_step added where given: the keywords
        of dataflow.memplan.make_plan beyond model, seqlen, budget and profile."""
        out = dict(self.plan_options or {})
        for key, value in (("seqs_per_step", self.seqs_per_step),
                           ("tokens_per_step", self.tokens_per_step)):
            if value is not None:
                out[key] = value
        if self.precision != "bf16":
            out["precision"] = self.precision
        if self.freeze:
            out["freeze"] = self.freeze
        if self.lora is not None:
            out["lora"] = self.lora
        return out

    def keywords(self) -> dict:
        """The options as Engine() keywords: the budgets and seqlen, and every other field set
        to something other than its default (what a ring's RingEngine takes)."""
        out = {"host_gb": self.host_gb, "dev_gb": self.dev_gb, "seqlen": self.seqlen}
        out.update({f: getattr(self, f) for f in PLAN_FIELDS[3:]
                    if getattr(self, f) not in (None, "bf16", "")})  # their defaults
        for f in dataclasses.fields(RunOptions):
            value = getattr(self.run, f.name)
            if value != f.default:
                out[f.name] = value
        return out


_DEFAULT_ADAMW = AdamWConfig()


def with_checkpoint_defaults(passed: AdamWConfig, stored: AdamWConfig) -> AdamWConfig:
    """AdamW settings for an Engine built on a checkpoint: each setting left at its default
    takes the checkpoint's; each one the caller changed is kept."""
    changes = {f.name: getattr(stored, f.name) for f in dataclasses.fields(AdamWConfig)
               if getattr(passed, f.name) == getattr(_DEFAULT_ADAMW, f.name)}
    return dataclasses.replace(passed, **changes)


def checkpoint_dir(model) -> Path | None:
    """The checkpoint directory `model` names (a step directory, or the newest sealed one under a
    checkpoint root), else None (a zoo name, config file, model or Hugging Face directory)."""
    if not isinstance(model, (str, Path)):
        return None
    path = Path(model)
    if not path.is_dir():
        return None
    if (path / META).is_file() or (path / SEAL).is_file():
        return path
    if (path / "config.json").is_file():
        return None  # a model directory
    return latest_checkpoint(path)


# -- a step's batch in pieces ------------------------------------------------------------------
def is_pieces(value) -> bool:
    """True for an iterable of 2-D blocks of rows (a list or tuple of 2-D arrays, or any
    iterator); False for one array (NumPy, __array__, __dlpack__, or nested lists of rows)."""
    if value is None or isinstance(value, (np.ndarray, str, bytes)):
        return False
    if hasattr(value, "__array__") or hasattr(value, "__dlpack__"):
        return False
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and _ndim(value[0]) == 2
    return hasattr(value, "__iter__") or hasattr(value, "__next__")


def _ndim(value) -> int:
    if hasattr(value, "ndim"):
        return int(value.ndim)
    return np.ndim(value) if isinstance(value, (list, tuple)) else -1


def join_pieces(value, name: str, rows: int, seqlen: int):
    """`value` itself when it is one array; else its pieces (2-D blocks of whole sequences of
    seqlen + 1 columns, in order) joined into one (rows, seqlen + 1) array, the same bits as
    the caller passing that array. Refuses pieces that are not 2-D, have another width, or do
    not add up to `rows` rows, naming the piece."""
    if not is_pieces(value):
        return value
    parts, counts = [], []
    for i, piece in enumerate(value):
        try:
            arr = _as_int_array(f"{name} piece {i}", piece, None)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; each piece of {name} is a 2-D block of whole sequences, "
                              f"shape (n, {seqlen + 1})") from None
        if arr.shape[1] != seqlen + 1:
            raise ConfigError(f"{name} piece {i} has shape {arr.shape}; every piece holds whole "
                              f"sequences of seqlen + 1 = {seqlen + 1} ids, shape (n, "
                              f"{seqlen + 1})")
        parts.append(arr)
        counts.append(arr.shape[0])
        if sum(counts) > rows:
            break
    if sum(counts) != rows:
        raise ConfigError(f"the pieces of {name} hold {sum(counts)} rows "
                          f"({' + '.join(map(str, counts)) or 'none'}); a step takes "
                          f"seqs_per_step = {rows} rows: pass pieces that add up to {rows}")
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
