"""Times a checkpoint save and load (and a Hugging Face export) of a real engine and samples the
process RSS while they run, so "host memory stays within the budget plus one block" is measured,
not assumed; when torch and transformers are importable it also loads the export with
LlamaForCausalLM.from_pretrained and prints the largest logits difference against our forward.
Run on the GPU machine, e.g.:

    python -m dataflow.bench.checkpoint_bench 80 24 8192 8b --dir /tmp/ckpt      # 8b save/load timing
    python -m dataflow.bench.checkpoint_bench 8 4 256 small --dir /tmp/ck --hf-check

Writes one JSON document to stdout (human lines to stderr). Never changes what it measures:
the engine trains one step (so m and v are not zero), then saves, loads and exports."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

from dataflow.data import token_stream
from dataflow.host_forward import logits


class RssSampler:
    """Peak resident set size of this process, sampled every `period_s` on a thread."""

    def __init__(self, period_s: float = 0.02):
        import psutil

        self._proc, self._period = psutil.Process(), period_s
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._period)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _digest(eng) -> str:
    import hashlib

    h = hashlib.sha256()
    for ref in eng.block_refs():
        for part in ("weights", "m", "v"):
            h.update(eng.read_block(ref, part).view(np.uint8))
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.checkpoint_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("host_gb", type=float)
    p.add_argument("dev_gb", type=float)
    p.add_argument("seqlen", type=int)
    p.add_argument("model")
    p.add_argument("--dir", required=True, help="checkpoint root to write (and an hf/ beside)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--hf-check", action="store_true",
                   help="export, load with transformers (if importable), compare logits")
    p.add_argument("--logits-tokens", type=int, default=32)
    p.add_argument("--seqs-per-step", type=int, default=None,
                   help="sequences in the one training step (default: the planner's); fewer "
                        "make the step shorter and change nothing that is saved")
    p.add_argument("--digest", action="store_true",
                   help="hash all state before and after the load (reads everything twice)")
    args = p.parse_args(argv)

    import psutil

    # the engine loads numba (about 2 s): imported once the arguments are parsed, so --help is quick
    from dataflow.engine import Engine

    out: dict = {"model": args.model, "seqlen": args.seqlen, "host_gb": args.host_gb,
                 "dev_gb": args.dev_gb}
    eng = Engine(args.model, host_gb=args.host_gb, dev_gb=args.dev_gb, seqlen=args.seqlen,
                 backend=args.backend, lr=1e-4, max_grad_norm=1.0,
                 seqs_per_step=args.seqs_per_step)
    cfg = eng.plan.model
    with eng:
        r = eng.train_step(token_stream(args.seqlen, eng.seqs_per_step, cfg.vocab_size))
        out.update(device=getattr(eng.be, "device_name", eng.be.name), loss=r.loss,
                   rss_after_step_bytes=psutil.Process().memory_info().rss,
                   host_arena_bytes=eng.memory_used_bytes()["host_arena"],
                   largest_block_bytes=max(eng.layout(ref).nbytes for ref in eng.block_refs()))
        before = _digest(eng) if args.digest else None
        with RssSampler() as rss:
            t0 = time.perf_counter()
            path = eng.save_checkpoint(args.dir, keep=1, force_dir=True)
            out["save_s"] = time.perf_counter() - t0
        out["rss_peak_save_bytes"] = rss.peak
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in path.iterdir())
        with RssSampler() as rss:
            t0 = time.perf_counter()
            eng.load_checkpoint(path)
            out["load_s"] = time.perf_counter() - t0
        out["rss_peak_load_bytes"] = rss.peak
        if before is not None:
            out["load_exact"] = _digest(eng) == before
        out["save_gb_per_s"] = out["checkpoint_bytes"] / out["save_s"] / 1e9
        out["load_gb_per_s"] = out["checkpoint_bytes"] / out["load_s"] / 1e9
        print(f"save {out['save_s']:.1f} s, load (sha256-verified) {out['load_s']:.1f} s for "
              f"{out['checkpoint_bytes'] / 2**30:.2f} GiB; RSS peak {rss.peak / 2**30:.2f} GiB "
              f"(after the step {out['rss_after_step_bytes'] / 2**30:.2f} GiB, largest block "
              f"{out['largest_block_bytes'] / 2**30:.2f} GiB)", file=sys.stderr)
        if args.hf_check:
            _hf_check(eng, args, out)
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


def _hf_check(eng, args, out: dict) -> None:
    from pathlib import Path

    hf_dir = Path(args.dir) / "hf"
    t0 = time.perf_counter()
    eng.save_pretrained(hf_dir, overwrite=True)
    out["export_s"] = time.perf_counter() - t0
    ids = token_stream(args.logits_tokens, 1, eng.plan.model.vocab_size, start=1000)[:, :-1]
    ours = logits(eng, ids)[0]
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError as exc:
        out["transformers"] = f"not importable ({exc}); export written to {hf_dir}"
        print(out["transformers"], file=sys.stderr)
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, device=dev)).logits[0].float().cpu().numpy()
    diff = float(np.max(np.abs(theirs - ours)))
    out.update(transformers_max_abs_logit_diff=diff,
               transformers_logit_scale=float(np.max(np.abs(theirs))),
               transformers_argmax_agree=float(np.mean(theirs.argmax(-1) == ours.argmax(-1))))
    print(f"transformers LlamaForCausalLM (fp32 from our bf16 export) vs our bf16 forward: "
          f"max |logit diff| {diff:.4g} (max |logit| {out['transformers_logit_scale']:.3g}), "
          f"argmax agreement {out['transformers_argmax_agree']:.1%}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
