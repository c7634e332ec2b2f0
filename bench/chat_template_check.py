"""Does dataflow render and tokenise chat records exactly as transformers does? For each of
bench.chat_data's templates (ChatML, ChatML with {% generation %} tags, a Llama-3 style one) it
saves a tokenizer directory, loads it with transformers.AutoTokenizer.from_pretrained and with
dataflow.data.tokenizer.load_tokenizer, and for random conversations (1-4 turns, a system prompt
in about half) compares:

  text  ChatTemplate.render_with_spans' text with apply_chat_template(messages, tokenize=False)
  ids   the ids dataflow.data.tokenise.tokenise writes for the record (a JSONL of the
        conversations, the whole data path) with apply_chat_template(messages, tokenize=True)
  mask  for the generation-tag template, the learn flags tokenise writes with transformers'
        assistant_masks (return_assistant_tokens_mask=True, return_dict=True)

    python -m dataflow.bench.chat_template_check --out bench/records/chat-template-check.json
    python bench/chat_template_check.py --conversations 50

Prints a table of agreements last and, with --out, writes one JSON record (commit, library
versions, config, counts, the first disagreements). Exit 0 when everything agrees, 1 when
something does not, 2 without transformers (pip install transformers; torch is not needed).
Never trains."""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
from pathlib import Path

from dataflow.bench.chat_data import TEMPLATES, corpus_words, random_conversation, \
    write_tokenizer_dir
from dataflow.bench.sweep.sweep import git_commit
from dataflow.data.chat import ChatTemplate
from dataflow.data.tokenise import tokenise
from dataflow.data.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SHOWN = 3
"""Disagreements kept per template and kind in the record."""


def _ids(encoded) -> list[int]:
    """apply_chat_template's ids: a list (transformers 4) or a BatchEncoding (5)."""
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def _first_difference(a, b) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_template(name: str, conversations: list, workdir: Path) -> dict:
    """Counts of agreement (and the first disagreements) for one template."""
    import transformers  # optional: main has checked it is there

    folder = write_tokenizer_dir(workdir / name, name)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = load_tokenizer(folder)
    template = ChatTemplate(ours.info.chat_template, ours.info.special_tokens,
                            ours.added_tokens())
    data = workdir / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations),
                    encoding="utf-8")
    corpus = tokenise(data, ours, cache_dir=workdir / "cache", jobs=1, progress=False)
    tokens, learn, starts, _ = corpus.arrays()
    if corpus.summary.records != len(conversations):
        raise RuntimeError(f"{name}: {corpus.summary.records} records tokenised from "
                           f"{len(conversations)} conversations")
    row = {"template": name, "conversations": len(conversations), "text_agree": 0,
           "ids_agree": 0, "mask_agree": 0 if template.tracks_generation else None,
           "tokens": int(corpus.summary.tokens), "learnt": int(corpus.summary.learnt),
           "disagreements": []}
    for i, messages in enumerate(conversations):
        a, b = int(starts[i]), int(starts[i + 1])
        text, _ = template.render_with_spans(messages)
        hf_text = hf.apply_chat_template(messages, tokenize=False)
        ids, hf_ids = [int(t) for t in tokens[a:b]], _ids(
            hf.apply_chat_template(messages, tokenize=True))
        checks = [("text", text, hf_text), ("ids", ids, hf_ids)]
        if template.tracks_generation:
            mask = [int(x) for x in learn[a:b]]
            hf_mask = [int(x) for x in hf.apply_chat_template(
                messages, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True)["assistant_masks"]]
            checks.append(("mask", mask, hf_mask))
        for kind, mine, theirs in checks:
            if mine == theirs:
                row[f"{kind}_agree"] += 1
            elif sum(d["kind"] == kind for d in row["disagreements"]) < SHOWN:
                k = _first_difference(mine, theirs)
                row["disagreements"].append({
                    "kind": kind, "conversation": i, "messages": messages, "at": k,
                    "ours": mine[max(0, k - 8):k + 8], "transformers": theirs[max(0, k - 8):k + 8]})
    return row


def _table(rows: list[dict]) -> str:
    lines = [f"{'template':18s} {'convs':>6s} {'text':>11s} {'ids':>11s} {'mask':>11s} "
             f"{'tokens':>9s} {'learnt':>7s}"]
    for r in rows:
        n = r["conversations"]
        agree = [f"{r[k]}/{n}" if r[k] is not None else "-"
                 for k in ("text_agree", "ids_agree", "mask_agree")]
        lines.append(f"{r['template']:18s} {n:6d} {agree[0]:>11s} {agree[1]:>11s} "
                     f"{agree[2]:>11s} {r['tokens']:9d} "
                     f"{100 * r['learnt'] / max(1, r['tokens']):6.1f}%")
    return "\n".join(lines)


def _agrees(r: dict) -> bool:
    n = r["conversations"]
    return r["text_agree"] == n and r["ids_agree"] == n and r["mask_agree"] in (None, n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataflow.bench.chat_template_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=300, metavar="N",
                   help="random conversations per template (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--templates", default=",".join(TEMPLATES),
                   help=f"comma-separated, of {', '.join(TEMPLATES)} (default all)")
    p.add_argument("--out", default="", metavar="FILE", help="write the JSON record here")
    args = p.parse_args(argv)
    names = [t for t in args.templates.split(",") if t]
    unknown = [t for t in names if t not in TEMPLATES]
    if unknown or args.conversations < 1:
        p.error(f"--templates {','.join(unknown)} unknown; known: {', '.join(TEMPLATES)}"
                if unknown else f"--conversations {args.conversations} must be at least 1")
    try:
        import jinja2
        import tokenizers
        import transformers
    except ImportError as exc:
        print(f"chat_template_check compares with transformers and needs it, tokenizers and "
              f"jinja2 ({exc}); pip install transformers 'dataflow[data]' (torch is not needed)",
              file=sys.stderr)
        return 2
    rng, words = random.Random(args.seed), corpus_words()
    conversations = [random_conversation(rng, words) for _ in range(args.conversations)]
    with tempfile.TemporaryDirectory(prefix="chat-check-") as tmp:
        rows = [check_template(name, conversations, Path(tmp)) for name in names]
    record = {"kind": "chat_template_check", "commit": git_commit(REPO_ROOT),
              "host": platform.node(),
              "versions": {"transformers": transformers.__version__,
                           "tokenizers": tokenizers.__version__, "jinja2": jinja2.__version__,
                           "python": platform.python_version()},
              "config": {"conversations": args.conversations, "seed": args.seed,
                         "templates": names},
              "agree": all(_agrees(r) for r in rows), "results": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    for r in rows:
        for d in r["disagreements"]:
            print(f"{r['template']}: {d['kind']} differs in conversation {d['conversation']} at "
                  f"{d['at']}: ours {d['ours']!r}, transformers {d['transformers']!r}",
                  file=sys.stderr)
    print(_table(rows))
    return 0 if record["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
