"""How fast dataflow.data.tokenise.tokenise turns a user's data into a cached corpus, against the
number of worker processes. Builds three synthetic corpora in a temporary folder (bench.chat_data):

  text   a folder of plain text files: the shipped text's paragraphs shuffled and varied
  jsonl  JSONL of {"text": ...} records, one to eight paragraphs each
  chat   JSONL of {"messages": [...]} records, random conversations of 1-4 turns rendered with
         the tokenizer's ChatML template (assistant tokens learnt, the rest masked)

and a tokenizer (the chat example's byte-level BPE; --large-vocab a 150,000-id one of the size
of Qwen's and Llama 3's; or --tokenizer DIR, a real model's folder with tokenizer.json and, for
the chat corpus, a chat template), then times tokenise() on each at every --jobs count, into a
fresh cache folder each time (nothing is found cached). Data under 8 MiB is tokenised in-process
whatever --jobs says (tokenise.PARALLEL_BYTES), so the corpora are made larger than that,
--quick too.

    python -m dataflow.bench.tokenise_speed --out bench/records/tokenise-speed-16core.json
    python -m dataflow.bench.tokenise_speed --quick
    python -m dataflow.bench.tokenise_speed --large-vocab --out bench/records/tokenise-speed-150k.json
    python -m dataflow.bench.tokenise_speed --tokenizer ~/models/Qwen3-8B --jobs 1,8,16

Prints a table last (MB = 10^6 bytes of input; tok/s; speed-up over jobs = 1) and, with --out,
writes one JSON record (host CPU, cores, commit, versions, config, every run). Never trains."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from dataflow.bench.chat_data import corpus_words, random_conversation, varied_text, \
    write_tokenizer_dir
from dataflow.bench.sweep.sweep import git_commit
from dataflow.data.tokenise import PARALLEL_BYTES, tokenise
from dataflow.data.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
KINDS = ("text", "jsonl", "chat")
MB = 1_000_000
SIZES = {"full": {"text_mb": 48, "jsonl_mb": 32, "chat_records": 50_000, "text_files": 4},
         "quick": {"text_mb": 10, "jsonl_mb": 10, "chat_records": 20_000, "text_files": 2}}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_jobs(cores: int) -> list[int]:
    """1, then powers of two below `cores`, then `cores`."""
    jobs, n = [1], 2
    while n < cores:
        jobs.append(n)
        n *= 2
    return jobs + [cores] if cores > 1 else jobs


def make_corpora(folder: Path, sizes: dict, seed: int) -> dict[str, Path]:
    """The three corpora under `folder` (see the module's docstring)."""
    rng = random.Random(seed)
    text = folder / "text"
    text.mkdir(parents=True)
    per_file = int(sizes["text_mb"] * MB) // sizes["text_files"]
    for i in range(sizes["text_files"]):
        (text / f"part-{i:03d}.txt").write_text(varied_text(rng, per_file), encoding="utf-8")
    paragraphs = [p for p in varied_text(rng, 4 * MB).split("\n\n") if p.strip()]
    with open(folder / "records.jsonl", "w", encoding="utf-8") as f:
        size = 0
        while size < sizes["jsonl_mb"] * MB:
            line = json.dumps({"text": "\n\n".join(rng.sample(paragraphs, rng.randint(1, 8)))},
                              ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
    words = corpus_words()
    with open(folder / "chats.jsonl", "w", encoding="utf-8") as f:
        for _ in range(sizes["chat_records"]):
            f.write(json.dumps({"messages": random_conversation(rng, words)},
                               ensure_ascii=False) + "\n")
    return {"text": text, "jsonl": folder / "records.jsonl", "chat": folder / "chats.jsonl"}


def time_tokenise(data: Path, tok, jobs: int, cache_root: Path) -> dict:
    """One tokenise() of `data` into a fresh cache folder: wall seconds and the summary."""
    cache = Path(tempfile.mkdtemp(prefix=f"jobs{jobs}-", dir=cache_root))
    t0 = time.perf_counter()
    corpus = tokenise(data, tok, cache_dir=cache, jobs=jobs, progress=False)
    wall = time.perf_counter() - t0
    s = corpus.summary
    return {"jobs": jobs, "parallel": jobs > 1 and s.input_bytes >= PARALLEL_BYTES,
            "input_mb": round(s.input_bytes / MB, 3), "records": s.records, "tokens": s.tokens,
            "learnt": s.learnt, "wall_s": round(wall, 3), "tokenise_s": round(s.seconds, 3),
            "mb_per_s": round(s.input_bytes / MB / wall, 3),
            "tok_per_s": round(s.tokens / wall, 1)}


def _table(runs: list[dict]) -> str:
    lines = [f"{'corpus':6s} {'jobs':>4s} {'MB':>7s} {'records':>8s} {'tokens':>11s} "
             f"{'wall s':>7s} {'MB/s':>7s} {'tok/s':>11s} {'speed-up':>8s}"]
    base = {r["corpus"]: r["wall_s"] for r in runs if r["jobs"] == 1}
    for r in runs:
        up = f"{base[r['corpus']] / r['wall_s']:.2f}x" if r["corpus"] in base else "-"
        lines.append(f"{r['corpus']:6s} {r['jobs']:4d} {r['input_mb']:7.1f} {r['records']:8,d} "
                     f"{r['tokens']:11,d} {r['wall_s']:7.2f} {r['mb_per_s']:7.2f} "
                     f"{r['tok_per_s']:11,.0f} {up:>8s}{'' if r['parallel'] else ' (in-process)'}")
    return "\n".join(lines)


def _jobs(text: str) -> list[int]:
    try:
        jobs = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of counts") \
            from None
    if not jobs or min(jobs) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': every job count must be at least 1")
    return jobs


def main(argv: list[str] | None = None) -> int:
    cores = usable_cores()
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.tokenise_speed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smaller corpora (10 MB text, 10 MB JSONL, 20,000 chats; default 48 MB, "
                        "32 MB, 50,000)")
    p.add_argument("--jobs", type=_jobs, default=None, metavar="N,N,...",
                   help=f"worker counts to time (default {','.join(map(str, default_jobs(cores)))}"
                        ": 1, powers of two, every usable core)")
    p.add_argument("--corpora", default=",".join(KINDS), metavar="K,K",
                   help=f"which of {', '.join(KINDS)} (default all)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a folder with tokenizer.json (and a chat template for 'chat') instead "
                        "of the chat example's 480-id BPE")
    p.add_argument("--large-vocab", action="store_true",
                   help="a 150,000-id BPE trained on random words instead of the example's "
                        "(a tokenizer.json of about 10 MB, as Qwen's and Llama 3's: loading and "
                        "encoding cost what a real model's do; about 15 s to train)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="build the corpora here (default: a temporary folder, removed after)")
    p.add_argument("--out", default="", metavar="FILE", help="write the JSON record here")
    args = p.parse_args(argv)
    kinds = [k for k in args.corpora.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--corpora {args.corpora}: choose from {', '.join(KINDS)}")
    jobs = args.jobs or default_jobs(cores)
    sizes = SIZES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="tokenise-speed-", dir=args.work_dir) as tmp:
        tmp = Path(tmp)
        folder = Path(args.tokenizer) if args.tokenizer else write_tokenizer_dir(
            tmp / "tokenizer", "chatml", large=args.large_vocab)
        tok = load_tokenizer(folder)
        t0 = time.perf_counter()
        corpora = make_corpora(tmp / "data", sizes, args.seed)
        print(f"corpora built in {time.perf_counter() - t0:.1f} s under {tmp}; tokenizer "
              f"{tok.info.name} ({tok.info.vocab_size:,} ids)", file=sys.stderr)
        runs = []
        for kind in kinds:
            for n in jobs:
                run = {"corpus": kind, **time_tokenise(corpora[kind], tok, n, tmp)}
                runs.append(run)
                print(f"{kind} jobs {n}: {run['mb_per_s']:.2f} MB/s, "
                      f"{run['tok_per_s']:,.0f} tok/s", file=sys.stderr)
    record = {"kind": "tokenise_speed", "commit": git_commit(REPO_ROOT),
              "device": {"cpu": cpu_name(), "cores": os.cpu_count(), "usable_cores": cores,
                         "host": platform.node()},
              "versions": {"python": platform.python_version(), "tokenizers": _version(
                  "tokenizers"), "jinja2": _version("jinja2")},
              "config": {"quick": args.quick, **sizes, "jobs": jobs, "corpora": kinds,
                         "tokenizer": args.tokenizer or ("bench.chat_data large BPE (150,000 "
                                                         "ids)" if args.large_vocab else
                                                         "bench.chat_data BPE (480 ids)"),
                         "vocab_size": tok.info.vocab_size, "seed": args.seed},
              "runs": runs}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{record['device']['cpu']}, {cores} usable cores; commit {record['commit']}")
    print(_table(runs))
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
