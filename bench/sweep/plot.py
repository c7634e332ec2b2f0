"""Heatmaps of a sweep table, in ml_dataflow's layout so the pictures compare side by side:
device budget across, host budget down (largest at the top), annotated cells, a fixed colour
range per metric, failed cells labelled by reason. Per (model, seqlen) grid: a 2x2 report (tok/s,
model TFLOP/s, MFU, HFU), predicted / measured tok/s, and measured peak / budget for device and
host; a table of several precisions gets them once per precision. Needs matplotlib (the `plot`
extra). Never runs or plans cells."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from dataflow.bench.sweep.grid import format_number
from dataflow.bench.sweep.record import CellRecord, Status
from dataflow.bench.sweep.table import read_table
from dataflow.models.errors import ConfigError

DPI = 100
REPORT_SIZE_IN = (16, 12)
"""2x2 report, inches; at DPI 100 the PNG is 1600 x 1200 pixels."""
RATIO_SIZE_IN = (9, 7)
MEMORY_SIZE_IN = (18, 7)
RATIO_RANGE = (0.5, 1.5)
"""predicted / measured: 1 is a perfect prediction; the colour saturates at +-50 %."""
MEMORY_RANGE = (0.0, 1.25)
"""peak / budget: above 1 the budget was not honoured."""
FAILED_TEXT = {Status.INFEASIBLE: "infeasible", Status.DEVICE_OOM: "device\nOOM",
               Status.HOST_OOM: "host\nOOM", Status.TIMEOUT: "timeout", Status.CRASH: "crash",
               Status.PREDICTED: "not run"}
FAILED_COLOUR = {Status.INFEASIBLE: "#404040", Status.DEVICE_OOM: "#8B0000",
                 Status.HOST_OOM: "#5B2C6F", Status.TIMEOUT: "#7E5109", Status.CRASH: "#000000",
                 Status.PREDICTED: "#808080"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Heatmap:
    """The table behind one picture: values[i][j] at host hosts[i], device budget devs[j]."""

    hosts: tuple[float, ...]
    """Host budgets, GiB, descending (top row first)."""
    devs: tuple[float, ...]
    """Device budgets, GiB, ascending (left column first)."""
    values: tuple[tuple[float | None, ...], ...]
    """The metric; None where the cell has no value (failed, missing, not measured)."""
    labels: tuple[tuple[str, ...], ...]
    """What each cell says: the formatted value, the failure's reason, or NOT_RUN_TEXT for a
    cell of the grid that has no record (a sweep of several calls, or a slice of a grid)."""
    failed: tuple[tuple[Status | None, ...], ...]
    """The status of cells drawn as failures (no value), else None."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Metric:
    title: str
    value: Callable[[CellRecord], float | None]
    fmt: str
    cmap: str


NOT_RUN_TEXT = "not run"


def heatmap(records: list[CellRecord], metric: Metric) -> Heatmap:
    """The grid of one (model, seqlen): `records` must share both."""
    hosts = tuple(sorted({r.host_gib for r in records}, reverse=True))
    devs = tuple(sorted({r.dev_gib for r in records}))
    by_cell = {(r.host_gib, r.dev_gib): r for r in records}
    values, labels, failed = [], [], []
    for h in hosts:
        vrow, lrow, frow = [], [], []
        for d in devs:
            r = by_cell.get((h, d))
            v = metric.value(r) if r is not None else None
            vrow.append(v)
            if v is not None:
                lrow.append(format(v, metric.fmt))
                frow.append(None)
            elif r is not None and r.state is not Status.OK:
                lrow.append(FAILED_TEXT[r.state])
                frow.append(r.state)
            else:
                lrow.append("n/a" if r is not None else NOT_RUN_TEXT)
                frow.append(None)
        values.append(tuple(vrow))
        labels.append(tuple(lrow))
        failed.append(tuple(frow))
    return Heatmap(hosts=hosts, devs=devs, values=tuple(values), labels=tuple(labels),
                   failed=tuple(failed))


def _measured(name: str):
    return lambda r: getattr(r, name) if r.state is Status.OK else None


def _predicted(name: str):
    return lambda r: getattr(r, f"predicted_{name}") \
        if r.state in (Status.OK, Status.PREDICTED) else None


def report_metrics(predicted: bool) -> tuple[Metric, ...]:
    pick = _predicted if predicted else _measured
    return (Metric(title="tokens/s", value=pick("tok_per_s"), fmt=",.0f", cmap="YlGn"),
            Metric(title="model TFLOP/s", value=pick("model_tflop_per_s"), fmt=".4g",
                   cmap="PuBu"),
            Metric(title="MFU", value=pick("mfu"), fmt=".2f", cmap="RdYlGn"),
            Metric(title="HFU", value=pick("hfu"), fmt=".2f", cmap="RdYlGn"))


RATIO = Metric(title="predicted / measured tok/s", fmt=".2f", cmap="RdBu_r",
               value=lambda r: r.predicted_over_measured if r.state is Status.OK else None)
DEVICE_PEAK = Metric(title="device peak (minus CUDA context) / device budget", fmt=".2f",
                     cmap="RdYlGn_r",
                     value=lambda r: r.device_peak_over_budget if r.state is Status.OK else None)
HOST_PEAK = Metric(title="peak RSS / host budget", fmt=".2f", cmap="RdYlGn_r",
                   value=lambda r: r.host_peak_over_budget if r.state is Status.OK else None)


def colour_ranges(records: list[CellRecord], util_range: tuple[float, float],
                  predicted: bool) -> dict[str, tuple[float, float]]:
    """Fixed ranges, as ml_dataflow fixes them: MFU and HFU over `util_range`; TFLOP/s over the
    same fractions of the peak; tok/s over the tok/s those MFUs would give this model (peak and
    FLOP per token read off the rows, so a CPU sweep and an H100 sweep each get their own)."""
    lo, hi = util_range
    pre = "predicted_" if predicted else ""
    tok_per_mfu = tflop_per_mfu = None
    for r in records:
        tok, tflop, mfu = (getattr(r, pre + k) for k in ("tok_per_s", "model_tflop_per_s", "mfu"))
        if tok and tflop and mfu:
            tok_per_mfu, tflop_per_mfu = tok / mfu, tflop / mfu
            break
    ranges = {"MFU": (lo, hi), "HFU": (lo, hi)}
    if tok_per_mfu:
        ranges["tokens/s"] = (lo * tok_per_mfu, hi * tok_per_mfu)
        ranges["model TFLOP/s"] = (lo * tflop_per_mfu, hi * tflop_per_mfu)
    return ranges


def _draw(ax, hm: Heatmap, metric: Metric, vrange: tuple[float, float] | None):
    import matplotlib.colors as mcolors
    import numpy as np
    from matplotlib import colormaps

    data = np.array([[np.nan if v is None else v for v in row] for row in hm.values], float)
    finite = data[np.isfinite(data)]
    if vrange is None:
        vrange = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if vrange[0] == vrange[1]:
            vrange = (vrange[0] * 0.9, vrange[1] * 1.1 or 1.0)
    cmap = colormaps[metric.cmap].with_extremes(bad="white")
    norm = mcolors.Normalize(*vrange)
    image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto")
    for i, row in enumerate(hm.failed):
        for j, status in enumerate(row):
            if status is not None:
                ax.add_patch(_rect(i, j, FAILED_COLOUR[status]))
    for i, row in enumerate(hm.labels):
        for j, text in enumerate(row):
            if not text:
                continue
            if hm.failed[i][j] is not None or np.isnan(data[i, j]):
                colour = "white" if hm.failed[i][j] is not None else "black"
            else:  # dark text on light cells, as ml_dataflow's luminance rule
                red, green, blue, _ = cmap(norm(data[i, j]))
                colour = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"
            ax.text(j, i, text, ha="center", va="center", color=colour, fontsize=12)
    ax.set_xticks(range(len(hm.devs)), [format_number(d) for d in hm.devs])
    ax.set_yticks(range(len(hm.hosts)), [format_number(h) for h in hm.hosts])
    ax.set_xlabel("device memory budget (GiB)")
    ax.set_ylabel("host memory budget (GiB)")
    ax.set_title(metric.title)
    ax.figure.colorbar(image, ax=ax, label=metric.title)


def _rect(i: int, j: int, colour: str):
    from matplotlib.patches import Rectangle

    return Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=colour, edgecolor="white", lw=1)


def _figure(size_in, title):
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=size_in, dpi=DPI)
    fig.suptitle(title, fontsize=16)
    return fig


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI)  # no bbox 'tight': the pixel size stays size_in x DPI
    plt.close(fig)
    return path


def _require_matplotlib() -> None:
    """ConfigError naming the extra to install when matplotlib is missing (checked before any
    directory is made, so a failed plot leaves nothing behind)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("plotting needs matplotlib, which is not installed; pip install "
                          "'dataflow[plot]' (or pip install matplotlib)") from None


def grids(records: list[CellRecord]) -> dict[tuple[str, int, str], list[CellRecord]]:
    """The records of each (model, seqlen, precision): one set of pictures each."""
    out: dict[tuple[str, int, str], list[CellRecord]] = {}
    for r in sorted(records, key=lambda r: r.cell.sort_key):
        out.setdefault((r.model, r.seqlen, r.cell.precision), []).append(r)
    return out


def plot_sweep(sweep_dir: str | os.PathLike, to: str | os.PathLike | None = None, *,
               util_range: tuple[float, float] = (0.35, 0.7)) -> list[Path]:
    """Write the PNGs of every grid in `sweep_dir`'s table into `to` (default `sweep_dir`):
    MODEL-SEQLEN-report.png always; -predicted.png and -memory.png when cells were measured.
    A table of several precisions (--precision bf16,fp8) gets each picture once per precision,
    MODEL-SEQLEN-PRECISION-report.png and so on, the precision in every title."""
    records = read_table(sweep_dir)  # refuses a missing directory or table before any write
    _require_matplotlib()
    out_dir = Path(to or sweep_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    several = len({r.cell.precision for r in records}) > 1
    for (model, seqlen, precision), recs in grids(records).items():
        measured = any(r.state is not Status.PREDICTED and r.state is not Status.INFEASIBLE
                       for r in recs)
        device = next((r.device_name for r in recs if r.state is Status.OK), recs[0].device_name)
        name = Path(model.rstrip("/")).name
        stem = f"{name}-{seqlen}-{precision}" if several else f"{name}-{seqlen}"
        if several:  # the titles below name the grid as "NAME at seqlen S"
            name = f"{name} in {precision}"
        what = "measured" if measured else "predicted by the planner"
        fig = _figure(REPORT_SIZE_IN, f"{name} at seqlen {seqlen} on {device} ({what}, mean "
                                      "of the steps after the first)" if measured else
                      f"{name} at seqlen {seqlen} on {device} ({what})")
        ranges = colour_ranges(recs, util_range, predicted=not measured)
        for k, metric in enumerate(report_metrics(predicted=not measured)):
            _draw(fig.add_subplot(2, 2, k + 1), heatmap(recs, metric), metric,
                  ranges.get(metric.title))
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{stem}-report.png"))
        if not measured:
            continue
        fig = _figure(RATIO_SIZE_IN, f"{name} at seqlen {seqlen} on {device}: planner vs run")
        _draw(fig.add_subplot(1, 1, 1), heatmap(recs, RATIO), RATIO, RATIO_RANGE)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{stem}-predicted.png"))
        fig = _figure(MEMORY_SIZE_IN, f"{name} at seqlen {seqlen} on {device}: measured peak / "
                                      "budget")
        for k, metric in enumerate((DEVICE_PEAK, HOST_PEAK)):
            _draw(fig.add_subplot(1, 2, k + 1), heatmap(recs, metric), metric, MEMORY_RANGE)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{stem}-memory.png"))
    return written
