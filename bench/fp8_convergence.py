"""FP8 against bf16 over a whole training run (issue 53's convergence check): reads the
`dataflow-demo --json` outputs of two runs that differ only in `--precision` (same model, data,
seed and steps), prints a table of their losses at a few steps and the largest relative gap after
step 50, writes a JSON record (device, commit, both curves, the gaps) and, with matplotlib
installed (the `plot` extra), a PNG of both curves. Never runs a model itself.

    python -m dataflow.bench.fp8_convergence BF16.json FP8.json --out DIR [--after 50]
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


def compare(bf16: list[float], fp8: list[float], after: int) -> dict:
    """The gaps (fp8 - bf16) / bf16 per step, the largest after step `after` (1-based) and
    whether either run went non-finite."""
    n = min(len(bf16), len(fp8))
    gaps = [(f - b) / b for b, f in zip(bf16[:n], fp8[:n])]
    later = [abs(g) for g in gaps[after:]]
    return {"steps": n, "after_step": after, "max_rel_gap_after": max(later) if later else None,
            "mean_rel_gap_after": sum(later) / len(later) if later else None,
            "finite": all(math.isfinite(x) for x in bf16[:n] + fp8[:n]), "gaps": gaps}


def _plot(bf16, fp8, path: pathlib.Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:  # the plot extra is optional: the record holds the curves
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the headless backend

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(bf16) + 1), bf16, label="bf16", lw=1)
    ax.plot(range(1, len(fp8) + 1), fp8, label="fp8", lw=1, alpha=0.8)
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
    args = ap.parse_args(argv)
    bf16, meta = _losses(args.bf16)
    fp8, _ = _losses(args.fp8)
    res = compare(bf16, fp8, args.after)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = meta.get("plan", {}).get("model", {}).get("name", "?")
    print(f"{'step':>6} {'bf16':>9} {'fp8':>9} {'gap':>8}")
    for i in sorted({0, 9, 49, 99, 199, 299, 399, res["steps"] - 1} & set(range(res["steps"]))):
        print(f"{i + 1:>6} {bf16[i]:>9.4f} {fp8[i]:>9.4f} {res['gaps'][i]:>+8.2%}")
    print(f"{model}: {res['steps']} steps; largest |gap| after step {args.after}: "
          f"{res['max_rel_gap_after']:.2%} (mean {res['mean_rel_gap_after']:.2%}); "
          f"finite: {res['finite']}")
    plotted = _plot(bf16, fp8, out / "fp8_convergence.png",
                    f"{model}: bf16 and fp8 from one initialisation")
    record = {"bench": "fp8_convergence", "device": meta.get("device"), "commit": _commit(),
              "model": model, "bf16_losses": bf16, "fp8_losses": fp8, "plot": plotted,
              **{k: v for k, v in res.items() if k != "gaps"}}
    (out / "fp8_convergence.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
