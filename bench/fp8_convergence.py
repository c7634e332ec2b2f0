"""FP8 against bf16 over a whole training run (issue 53's convergence check): reads the
`dataflow-demo --json` outputs of two runs that differ only in `--precision` (same model, data,
seed and steps), prints a table of their losses at a few steps and the largest relative gap after
step 50, in the training loss and, where the runs validated (`--eval-every`), in the held-out
loss; writes a JSON record (device, commit, both curves, the gaps) and, with matplotlib
installed (the `plot` extra), a PNG of both curves. Never runs a model itself.

    python -m dataflow.bench.fp8_convergence BF16.json FP8.json --out DIR [--after 50]
        [--name NAME]   (the record is NAME.json, the plot NAME.png; default fp8_convergence)
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

from dataflow.bench.kernels_bench import _commit


def _losses(path: str) -> tuple[list[float], dict]:
    d = json.loads(pathlib.Path(path).read_text())
    return [s["loss"] for s in d["steps"]], d


def _validation(d: dict) -> dict[int, float]:
    return {v["step"]: v["loss"] for v in d.get("validation", [])}


def compare_validation(bf16: dict[int, float], fp8: dict[int, float], after: int) -> dict:
    """The held-out losses' gaps at the steps both runs validated, the largest after `after`."""
    steps = sorted(set(bf16) & set(fp8))
    gaps = {st: (fp8[st] - bf16[st]) / bf16[st] for st in steps}
    later = [abs(g) for st, g in gaps.items() if st > after]
    return {"validation_steps": steps,
            "validation_bf16": [bf16[st] for st in steps],
            "validation_fp8": [fp8[st] for st in steps],
            "validation_max_rel_gap_after": max(later) if later else None,
            "validation_mean_rel_gap_after": sum(later) / len(later) if later else None}


def compare(bf16: list[float], fp8: list[float], after: int) -> dict:
    """The gaps (fp8 - bf16) / bf16 per step, the largest after step `after` (1-based) and
    whether either run went non-finite."""
    n = min(len(bf16), len(fp8))
    gaps = [(f - b) / b for b, f in zip(bf16[:n], fp8[:n])]
    later = [abs(g) for g in gaps[after:]]
    return {"steps": n, "after_step": after, "max_rel_gap_after": max(later) if later else None,
            "mean_rel_gap_after": sum(later) / len(later) if later else None,
            "finite": all(math.isfinite(x) for x in bf16[:n] + fp8[:n]), "gaps": gaps}


def _plot(bf16, fp8, val: dict, path: pathlib.Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:  # the plot extra is optional: the record holds the curves
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the headless backend

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(bf16) + 1), bf16, label="bf16", lw=1)
    ax.plot(range(1, len(fp8) + 1), fp8, label="fp8", lw=1, alpha=0.8)
    if val.get("validation_steps"):
        ax.plot(val["validation_steps"], val["validation_bf16"], "k-", lw=1.5,
                label="bf16 held-out")
        ax.plot(val["validation_steps"], val["validation_fp8"], "r--", lw=1.5,
                label="fp8 held-out")
    ax.set_xlabel("step"), ax.set_ylabel("training loss"), ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bf16"), ap.add_argument("fp8")
    ap.add_argument("--out", required=True, help="directory for the record and the plot")
    ap.add_argument("--after", type=int, default=50, help="compare from this step on")
    ap.add_argument("--name", default="fp8_convergence",
                    help="the record's and plot's file name, without suffix")
    args = ap.parse_args(argv)
    bf16, meta = _losses(args.bf16)
    fp8, meta8 = _losses(args.fp8)
    res = compare(bf16, fp8, args.after)
    val = compare_validation(_validation(meta), _validation(meta8), args.after)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = meta.get("plan", {}).get("model", {}).get("name", "?")
    print(f"{'step':>6} {'bf16':>9} {'fp8':>9} {'gap':>8}")
    for i in sorted({0, 9, 49, 99, 199, 299, 399, res["steps"] - 1} & set(range(res["steps"]))):
        print(f"{i + 1:>6} {bf16[i]:>9.4f} {fp8[i]:>9.4f} {res['gaps'][i]:>+8.2%}")
    print(f"{model}: {res['steps']} steps; largest |gap| after step {args.after}: "
          f"{res['max_rel_gap_after']:.2%} (mean {res['mean_rel_gap_after']:.2%}); "
          f"finite: {res['finite']}")
    if val["validation_steps"]:
        print(f"held-out loss at {len(val['validation_steps'])} steps: largest |gap| after step "
              f"{args.after}: {val['validation_max_rel_gap_after']:.2%} (mean "
              f"{val['validation_mean_rel_gap_after']:.2%}); last: bf16 "
              f"{val['validation_bf16'][-1]:.4f}, fp8 {val['validation_fp8'][-1]:.4f}")
    plotted = _plot(bf16, fp8, val, out / f"{args.name}.png",
                    f"{model}: bf16 and fp8 from one initialisation")
    record = {"bench": "fp8_convergence", "device": meta.get("device"), "commit": _commit(),
              "model": model, "bf16_losses": bf16, "fp8_losses": fp8, "plot": plotted,
              **{k: v for k, v in res.items() if k != "gaps"}, **val}
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
