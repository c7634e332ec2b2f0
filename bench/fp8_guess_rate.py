"""How often a guessed FP8 scale would hold (docs/fp8.md, "Guessed scales"), measured on the CPU:
trains a model in fp8 on the NumPy backend (the recipe's reference) on real text and, before
every FP8 linear op, computes each operand's per-tensor scale as the recipe does and compares it
with the scale the same site (dataflow.fp8_sites, the keys the CuPy backend's guesses use) had
last time. Prints a table by operand kind (weights, activations, output gradients) and by step,
and writes a JSON record (device, commit, config, counts). Every operand is counted, including
those the GPU reuses without quantising (q/k/v's x after q's, gate/up's after gate's), so it is
the rate of the scales, not of the GPU's quantise calls. Never changes what the model computes.

    python -m dataflow.bench.fp8_guess_rate MODEL --seqlen 256 --tokens-per-step 4096
        --steps 30 [--data PATH] [--host-gb 4 --dev-gb 2] --out DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

import numpy as np

from dataflow.backend import Stream
from dataflow.backends.numpy_backend import NumpyBackend
from dataflow.bench.kernels_bench import _commit
from dataflow.fp8_sites import Fp8Sites
from dataflow.kernels.reference import fp8 as ref_fp8
from dataflow.ops_fp8_numpy import FP8_LINEAR_OPS, fp8_shapes_fit

KINDS = {("linear_fwd", 0): "activation", ("linear_fwd", 1): "weight",
         ("linear_bwd_x", 0): "output gradient", ("linear_bwd_x", 1): "weight",
         ("linear_bwd_w", 0): "output gradient", ("linear_bwd_w", 1): "activation"}
"""What each FP8 op's two operands are (dataflow.ops_cuda_fp8: y = x w^T, dx = dy w,
dw = dy^T x)."""
_FORMATS = {"linear_fwd": (ref_fp8.E4M3, ref_fp8.E4M3), "linear_bwd_x": (ref_fp8.E5M2, ref_fp8.E4M3),
            "linear_bwd_w": (ref_fp8.E5M2, ref_fp8.E4M3)}


def _scale(a: np.ndarray, fmt) -> float:
    amax = float(np.max(np.abs(a.astype(np.float32)))) if a.size else 0.0
    return ref_fp8.fp8_scale(amax, fmt) if np.isfinite(amax) else float("nan")


class ScaleRecorder(NumpyBackend):
    """The NumPy backend, counting before each FP8 linear op whether each operand's scale equals
    its site's last one. Plain mode only: ops run at once, in program order."""

    def __init__(self):
        super().__init__()
        self.sites = Fp8Sites(capacity=1 << 30)
        self.last: dict[tuple, float] = {}
        self.step = 0
        self.counts: dict = collections.defaultdict(lambda: [0, 0])
        """(step, kind) -> [scales seen, scales that differed from their site's last]."""

    def launch(self, stream: Stream, op: str, *args, name: str = "") -> None:
        if getattr(self, "precision", "bf16") == "fp8" and op in FP8_LINEAR_OPS \
                and self._in_fp8(op, args):
            self.sites.at(name or op)
            for region, fmt in enumerate(_FORMATS[op]):
                key = self.sites.key(region, op != "linear_fwd" and (region == 1 or
                                                                     op == "linear_bwd_w"))
                s = _scale(args[region], fmt)
                c = self.counts[(self.step, KINDS[(op, region)])]
                c[0] += 1
                c[1] += self.last.get(key) != s
                if np.isfinite(s):
                    self.last[key] = s
        super().launch(stream, op, *args, name=name)

    @staticmethod
    def _in_fp8(op: str, args) -> bool:
        """Whether the FP8 table runs `op` in FP8 (not its bf16 fallbacks: LoRA's alpha, sizes
        off 16)."""
        if op != "linear_bwd_w" and len(args) > 4 and args[4] != 1.0:
            return False
        a, b = args[0], args[1]
        n = b.shape[0] if op == "linear_fwd" else b.shape[1]
        return fp8_shapes_fit(*a.shape, n)


def run(model, seqlen: int, tokens_per_step: int, steps: int, data, host_gb: float,
        dev_gb: float) -> tuple[ScaleRecorder, list[float], object]:
    """Train `steps` steps in fp8 on the recorder; (recorder, losses, plan)."""
    # Here, not at the top: the engine and the data path are heavy imports for --help.
    from dataflow.data.open_data import open_data
    from dataflow.engine import Engine  # (as the line above)

    be = ScaleRecorder()
    losses = []
    with Engine(model, host_gb=host_gb, dev_gb=dev_gb, seqlen=seqlen, backend=be,
                precision="fp8", tokens_per_step=tokens_per_step) as eng:
        source = open_data(data, eng.plan.chunking.seqlen, eng.plan.model.vocab_size,
                           model=model, progress=False)
        for i in range(steps):
            be.step = i + 1
            batch = source.next_batch(eng.seqs_per_step)  # token rows, or a TokenBatch
            a, kw = batch.step_args() if hasattr(batch, "step_args") else ((batch,), {})
            losses.append(eng.train_step(*a, **kw).loss)
            print(f"step {i + 1}: loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
        plan = eng.plan
    return be, losses, plan


def table(counts: dict, steps: int) -> tuple[str, dict]:
    """The text table (by kind, over step 1, steps 2+ and all) and its numbers."""
    kinds = sorted({k for _, k in counts})
    rows, out = ["  operand            step 1 missed   steps 2+ missed   of scales (2+)"], {}
    for kind in kinds + ["all"]:
        def total(pred):
            seen = sum(v[0] for (st, k), v in counts.items() if pred(st) and kind in (k, "all"))
            miss = sum(v[1] for (st, k), v in counts.items() if pred(st) and kind in (k, "all"))
            return seen, miss
        s1, m1 = total(lambda st: st == 1)
        s2, m2 = total(lambda st: st > 1)
        out[kind] = {"step1_seen": s1, "step1_missed": m1, "later_seen": s2, "later_missed": m2}
        rows.append(f"  {kind:<16} {m1 / max(s1, 1):>14.1%} {m2 / max(s2, 1):>17.1%} "
                    f"{s2:>16,}")
    per_step = [{"step": st, "seen": sum(v[0] for (s, _), v in counts.items() if s == st),
                 "missed": sum(v[1] for (s, _), v in counts.items() if s == st)}
                for st in range(1, steps + 1)]
    out["per_step"] = per_step
    return "\n".join(rows), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataflow.bench.fp8_guess_rate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a zoo name, a config JSON or a Hugging Face directory")
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--data", default=None, help="text or token data (default: the shipped text)")
    ap.add_argument("--host-gb", type=float, default=4.0)
    ap.add_argument("--dev-gb", type=float, default=2.0)
    ap.add_argument("--out", required=True, help="directory for fp8_guess_rate.json")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: give at least 2 (step 1 has no earlier scales)")
    be, losses, plan = run(args.model, args.seqlen, args.tokens_per_step, args.steps, args.data,
                           args.host_gb, args.dev_gb)
    text, numbers = table(be.counts, args.steps)
    ch = plan.chunking
    print(f"fp8 guessed scales on {args.model}: {args.steps} steps of {ch.tokens_per_step:,} "
          f"tokens ({ch.chunks_per_round} chunk(s) x {ch.rounds_per_step} round(s)), "
          f"{len(be.last):,} sites; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"bench": "fp8_guess_rate", "device": be.device_name, "commit": _commit(),
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "plan_hash": plan.hash, "chunks_per_round": ch.chunks_per_round,
              "rounds_per_step": ch.rounds_per_step, "sites": len(be.last), "losses": losses,
              "rates": numbers}
    (out / "fp8_guess_rate.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"record: {out / 'fp8_guess_rate.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
