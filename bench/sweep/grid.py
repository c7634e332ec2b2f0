"""Grid parsing for sweeps: value lists ('60,80,100'), inclusive ranges ('16:80:8') and the cells
they span (model x seqlen x host x device x precision). Pure parsing: never plans, never runs
anything."""

from __future__ import annotations

import dataclasses
import decimal
import hashlib
import re

from dataflow.models.errors import ConfigError
from dataflow.precision import PRECISIONS

MAX_VALUES = 1000
"""A range longer than this is almost certainly a typo ('16:80:0.001')."""


def _decimal(text: str, what: str) -> decimal.Decimal:
    try:
        value = decimal.Decimal(text.strip())
    except decimal.InvalidOperation:
        raise ConfigError(f"{what}: {text.strip()!r} is not a number; write e.g. '16,24,32' or "
                          "'16:80:8'") from None
    if not value.is_finite():
        raise ConfigError(f"{what}: {text.strip()!r} is not a finite number")
    return value


def parse_numbers(text: str, what: str = "values") -> tuple[float, ...]:
    """'16,24,30' or '16:80:8' (start:stop:step, stop included when the steps land on it), or a
    mix ('8,16:32:8'), as sorted unique positive numbers. Decimal arithmetic, so '0.1:0.3:0.1'
    gives exactly 0.1, 0.2, 0.3."""
    values: set[decimal.Decimal] = set()
    for part in (p for p in text.split(",") if p.strip()):
        if ":" in part:
            pieces = part.split(":")
            if len(pieces) != 3:
                raise ConfigError(f"{what}: range {part.strip()!r} needs start:stop:step, "
                                  "e.g. '16:80:8'")
            start, stop, step = (_decimal(p, what) for p in pieces)
            if step <= 0 or stop < start:
                raise ConfigError(f"{what}: range {part.strip()!r} needs step > 0 and "
                                  "stop >= start, e.g. '16:80:8'")
            if (stop - start) / step > MAX_VALUES:
                raise ConfigError(f"{what}: range {part.strip()!r} has more than {MAX_VALUES} "
                                  "values; use a larger step")
            v = start
            while v <= stop:
                values.add(v)
                v += step
        else:
            values.add(_decimal(part, what))
    if not values:
        raise ConfigError(f"{what}: no values in {text!r}; write e.g. '16,24,32' or '16:80:8'")
    bad = sorted(v for v in values if v <= 0)
    if bad:
        raise ConfigError(f"{what}: {format_number(float(bad[0]))} is not positive; budgets and "
                          "lengths must be > 0")
    return tuple(float(v) for v in sorted(values))


def parse_ints(text: str, what: str = "values") -> tuple[int, ...]:
    values = parse_numbers(text, what)
    frac = [v for v in values if v != int(v)]
    if frac:
        raise ConfigError(f"{what}: {format_number(frac[0])} is not a whole number")
    return tuple(int(v) for v in values)


def parse_names(text: str, what: str = "models") -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ConfigError(f"{what}: no names in {text!r}; write e.g. '1b,8b'")
    return names


def parse_precisions(text: str, what: str = "--precision") -> tuple[str, ...]:
    """'bf16', 'fp8' or a comma list ('bf16,fp8': a grid axis), unique, in the order given."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ConfigError(f"{what}: no precision in {text!r}; write e.g. 'bf16' or 'bf16,fp8'")
    bad = [n for n in names if n not in PRECISIONS]
    if bad:
        raise ConfigError(f"{what}: {bad[0]!r} is not a precision; choose from "
                          f"{', '.join(PRECISIONS)}, or a comma list such as "
                          f"{','.join(PRECISIONS)} (docs/fp8.md)")
    return names


def format_number(value: float) -> str:
    """Shortest text that reads back as the same budget: 1.0 -> '1', 0.25 -> '0.25'."""
    return f"{value:g}" if float(f"{value:g}") == value else repr(value)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Cell:
    """One point of a sweep: a model at a sequence length under two budgets (GiB = 2^30 B), in
    one precision."""

    model: str
    """Zoo name or a saved model directory, as the demo takes it."""
    seqlen: int
    host_gib: float
    dev_gib: float
    precision: str = "bf16"
    """'bf16' or 'fp8' (dataflow.precision): a sweep's cells and records are keyed by it too."""

    @property
    def key(self) -> tuple[str, int, float, float]:
        """The grid point, whatever the precision (a precision grid has one cell per precision
        at each; the Cell itself, precision included, keys records)."""
        return (self.model, self.seqlen, self.host_gib, self.dev_gib)

    @property
    def sort_key(self) -> tuple[str, int, float, float, str]:
        """The table's order: grid point, then precision."""
        return (*self.key, self.precision)

    @property
    def label(self) -> str:
        tag = "" if self.precision == "bf16" else f" {self.precision}"
        return (f"{self.model} s{self.seqlen} host {format_number(self.host_gib)} "
                f"dev {format_number(self.dev_gib)}{tag}")

    @property
    def slug(self) -> str:
        """File-name-safe name for this cell's record and logs, unique over model, seqlen and
        budgets; a precision grid's directory adds the precision (table.SweepStore)."""
        model = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model.rstrip("/").split("/")[-1]) or "model"
        if model != self.model:  # a path: keep two dirs of the same basename apart
            model += "-" + hashlib.sha256(self.model.encode()).hexdigest()[:8]
        return (f"{model}-s{self.seqlen}-h{format_number(self.host_gib)}"
                f"-d{format_number(self.dev_gib)}")


def expand(models: tuple[str, ...], seqlens: tuple[int, ...], hosts: tuple[float, ...],
           devs: tuple[float, ...], precisions: tuple[str, ...] = ("bf16",)) -> tuple[Cell, ...]:
    """Every cell, one grid per (model, seqlen); within a grid host-major, device ascending,
    each budget pair in every precision one after the other (so the two run back to back, at
    like clocks and temperatures)."""
    return tuple(Cell(model=m, seqlen=s, host_gib=h, dev_gib=d, precision=p)
                 for m in models for s in seqlens for h in hosts for d in devs
                 for p in precisions)
