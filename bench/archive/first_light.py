"""First light on a GPU: runs `dataflow-demo` for the issue's configurations, each in its own
process with a time limit, and writes one JSON record (device, commit, configs, per-step numbers,
memory) to bench/records/. Prints a table last. Usage:

    python bench/archive/first_light.py [--out FILE] [--steps N] [--only 8b,1b-8k,1b-4k]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "8b-8k-24": ["80", "24", "8192", "8b"],
    "1b-8k-8": ["40", "8", "8192", "1b"],
    "1b-4k-78": ["60", "78", "4096", "1b"],
}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=None, help="rounds per step override")
    p.add_argument("--only", default=",".join(CONFIGS))
    p.add_argument("--timeout", type=int, default=540, help="seconds per configuration")
    p.add_argument("--logdir", default=None)
    p.add_argument("--trace-dir", default=None, help="write each run's Chrome trace here")
    args = p.parse_args(argv)
    runs = {}
    for name in args.only.split(","):
        cmd = [sys.executable, "-m", "dataflow.cli.demo", *CONFIGS[name], "--steps", str(args.steps),
               "--json"]
        if args.trace_dir:
            cmd += ["--trace", str(Path(args.trace_dir, f"{name}.trace.json"))]
        if args.rounds:
            cmd += ["--rounds", str(args.rounds)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out, err = exc.stdout or "", exc.stderr or ""
            out = out.decode() if isinstance(out, bytes) else out
            err = (err.decode() if isinstance(err, bytes) else err) + "\nTIMEOUT"
            rc = 124
        wall = time.perf_counter() - t0
        if args.logdir:
            Path(args.logdir, f"{name}.log").write_text(err)
        record = {"argv": CONFIGS[name], "rc": rc, "wall_s": wall, "stderr_tail": err[-3000:]}
        if rc == 0:
            record.update(json.loads(out))
        runs[name] = record
        print(err[-1500:], file=sys.stderr)
    device = next((r.get("device") for r in runs.values() if r.get("device")), "unknown")
    doc = {"what": "first light: dataflow-demo on the lent GPU", "device": device,
           "commit": _commit(), "steps": args.steps, "runs": runs}
    out = Path(args.out or f"bench/records/first-light-{device.replace(' ', '-').lower()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"{'config':<10} {'rc':>3} {'tok/s (last)':>13} {'MFU':>7} {'step s':>8} {'loss':>8} "
          f"{'dev used GiB':>13}")
    for name, r in runs.items():
        steps = r.get("steps") or [{}]
        last = steps[-1]
        mem = r.get("memory", {})
        print(f"{name:<10} {r['rc']:>3} {last.get('tok_per_s', 0):>13.0f} "
              f"{last.get('mfu', 0):>7.1%} {last.get('step_time_s', 0):>8.2f} "
              f"{last.get('loss', 0):>8.4f} {mem.get('device_used_bytes', 0) / 2**30:>13.2f}")
    print(f"record: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
