"""The sanity table of docs/planner-sanity.md: predictions with the built-in H100 profile beside
ml_dataflow's published H100 measurements (shared/reference/ml_dataflow-measured.md).
`python -m dataflow.memplan.search.sanity` prints it; `--write` replaces the table in the doc. Never imports
array libraries."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dataflow.memplan.plan.plan import Budget, Where
from dataflow.memplan.plan.profiles import BUILTIN_PROFILES
from dataflow.memplan.search.search import make_plan
from dataflow.models.config import load_config

ANCHORS = (
    # model, seqlen, host GiB, device GiB, ml_dataflow tok/s, its MFU, note
    ("1b", 8192, 24, 16, 49151, 0.449, "smallest device"),
    ("1b", 8192, 16, 78, 55090, 0.503, "best"),
    ("8b", 8192, 70, 24, 9772, 0.509, "headline, dev 24"),
    ("8b", 8192, 75, 24, 9781, 0.509, ""),
    ("8b", 8192, 70, 78, 11370, 0.592, "headline, max dev"),
    ("8b", 8192, 75, 78, 11406, 0.594, ""),
    ("8b", 4096, 70, 24, 10420, 0.508, ""),
    ("8b", 65536, 144, 78, 5487, 0.536, "best"),
    ("8b", 65536, 96, 30, 5008, 0.489, "smallest working dev"),
    ("15b", 8192, 128, 24, 4952, 0.500, ""),
    ("32b", 8192, 256, 40, 2430, 0.511, "min host/dev"),
    ("32b", 65536, 320, 40, 1491, 0.484, "min"),
    ("32b", 65536, 416, 77, 1618, 0.525, "best"),
    ("8b", 524288, 356, 70, 1128, 0.522, "best"),
)
MLDF_LIKE = dict(chunk_tokens=16384, max_resident_layers=0, home_optimizer="streamed")
"""ml_dataflow's recorded configuration as constraints: 16k chunks, every layer's state at
home, AdamW streamed through the device (its embedding and head stay on the device when they
fit; its activation levels are still chosen by our search)."""
MLDF_ROWS = (("8b", 8192, 75, 24, 9781), ("8b", 8192, 75, 78, 11406),
             ("8b", 65536, 144, 78, 5487), ("32b", 65536, 416, 77, 1618))
BEGIN, END = "<!-- sanity-table:begin -->", "<!-- sanity-table:end -->"
DOC = Path(__file__).resolve().parent.parent / "docs" / "planner-sanity.md"


def _summary(plan) -> str:
    ch = plan.chunking
    resident = plan.resident_layers
    acts = [a for row in plan.activations for a in row]
    dev_acts = sum(a.home is Where.DEVICE for a in acts)
    return (f"{ch.chunk_tokens // 1024}k x{ch.chunks_per_round}, R {ch.rounds_per_step}, "
            f"res {resident}/{len(plan.layers)}, dev acts {dev_acts}/{len(acts)}, "
            f"slots w{plan.slots.weight_slots}/g{plan.slots.grad_slots}/a{plan.slots.act_slots}")


def table(profile_name: str = "h100") -> str:
    profile = BUILTIN_PROFILES[profile_name]
    rows = ["| model @ seqlen | host / dev GiB | ml_dataflow tok/s (MFU) | predicted tok/s (MFU, "
            "HFU) | pred / meas | bottleneck | our plan |",
            "|---|---|---|---|---|---|---|"]
    for model, seqlen, host, dev, tok, mfu, note in ANCHORS:
        plan = make_plan(load_config(model), seqlen, Budget.from_gib(host, dev), profile)
        pr = plan.prediction
        label = f"{model} @ {seqlen:,}" + (f" ({note})" if note else "")
        rows.append(f"| {label} | {host} / {dev} | {tok:,} ({mfu:.3f}) | {pr.tok_per_s:,.0f} "
                    f"({pr.mfu:.3f}, {pr.hfu:.3f}) | {pr.tok_per_s / tok:.2f} | {pr.bottleneck} "
                    f"| {_summary(plan)} |")
    rows += ["", "Same cells, our cost model constrained to ml_dataflow's configuration "
             f"({', '.join(f'{k}={v}' for k, v in MLDF_LIKE.items())}):", "",
             "| model @ seqlen | host / dev GiB | ml_dataflow tok/s | predicted tok/s "
             "| pred / meas | our plan |", "|---|---|---|---|---|---|"]
    for model, seqlen, host, dev, tok in MLDF_ROWS:
        plan = make_plan(load_config(model), seqlen, Budget.from_gib(host, dev), profile,
                         **MLDF_LIKE)
        pr = plan.prediction
        rows.append(f"| {model} @ {seqlen:,} | {host} / {dev} | {tok:,} | {pr.tok_per_s:,.0f} | "
                    f"{pr.tok_per_s / tok:.2f} | {_summary(plan)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataflow.memplan.search.sanity", description=__doc__)
    ap.add_argument("--write", action="store_true", help=f"replace the table in {DOC}")
    args = ap.parse_args(argv)
    text = table()
    if not args.write:
        print(text)
        return 0
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        print(f"{DOC} has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
