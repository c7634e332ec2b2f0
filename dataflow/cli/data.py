"""`dataflow-data MODEL DATA`: tokenise a user's data ahead of a run, with the tokenizer the run
would use (the model directory's own by default), into the cache dataflow-demo reads, and print
what it holds: records, tokens, the share of tokens that learn nothing (prompts, template text),
the longest record, and with --seqlen how many records do not fit a row. Also home of the
tokenising flags dataflow-demo shares. Reads the command line and reports; never starts an
engine or touches a device."""

from __future__ import annotations

import argparse
import json
import sys

from dataflow.cli.args import OneLineParser, add_version_flag, positive, run_command, \
    seqlen_tokens

PROG = "dataflow-data"
LOG_FORMAT = "%(name)s: %(message)s"


def add_tokenise_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say how --data becomes tokens (dataflow.data.open_data.DataOptions)."""
    g = p.add_argument_group(
        "tokenising", "Text, JSONL and Parquet/Arrow text are tokenised once with the model "
        "directory's own tokenizer (tokenizer.json; pip install 'dataflow[data]') and cached "
        "beside the data; chat records ('messages') are rendered with its chat template and "
        "only the assistant's tokens are learnt. Token files (.npy, .bin, Parquet 'tokens') "
        "are used as they are.")
    g.add_argument("--tokenizer", metavar="PATH|bytes",
                   help="tokenize with this tokenizer.json (or a folder holding one), or "
                        "'bytes' for byte ids 0..255 (default: the model directory's own "
                        "tokenizer, else bytes for the zoo's byte models)")
    g.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSONL field / Parquet column of plain text (default 'text')")
    g.add_argument("--messages-field", default="messages", metavar="NAME",
                   help="JSONL field / Parquet column of chat messages (default 'messages')")
    g.add_argument("--chat-template", metavar="FILE",
                   help="render chat records with this Jinja template instead of the "
                        "tokenizer's (tokenizer_config.json's chat_template or "
                        "chat_template.jinja)")
    g.add_argument("--too-long", choices=("truncate", "drop"), default="truncate",
                   help="a chat record longer than seqlen + 1 tokens: cut to the row "
                        "(default) or left out; counted either way (text documents continue "
                        "into the next row)")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="cache tokenised corpora here (default: .dataflow-cache beside the "
                        "data; the shipped text: ~/.cache/dataflow/tokens)")
    g.add_argument("--jobs", type=positive(int), default=None, metavar="N",
                   help="worker processes for tokenising (default: every core)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Tokenise DATA once with the tokenizer MODEL's runs use and cache it where "
                    "dataflow-demo finds it (keyed by the tokenizer's and the data's hashes: a "
                    "changed file or tokenizer tokenises again). Prints the records, tokens, "
                    "the masked share and the longest record.")
    p.add_argument("model", metavar="MODEL",
                   help="a Hugging Face model directory (its tokenizer is used), a checkpoint, "
                        "or a zoo name (byte-level)")
    p.add_argument("data", metavar="DATA",
                   help="a text file or folder, JSONL (a text field or chat 'messages'), "
                        "Parquet or Arrow")
    p.add_argument("--seqlen", type=seqlen_tokens, default=None, metavar="N",
                   help="also count the records longer than a row of N + 1 tokens")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--debug", action="store_true", help="tracebacks for failures")
    add_tokenise_flags(p)
    add_version_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv, _run, log_format=LOG_FORMAT)


def _run(args):
    # NumPy, the model resolution and the tokeniser: imported once the command line is read
    from dataflow.data.open_data import DataOptions, describe_data

    report = describe_data(args.model, args.data, DataOptions.from_args(args),
                           seqlen=args.seqlen)
    return json.dumps(report, indent=1) if args.json else _table(report)


def _table(r: dict) -> str:
    lines = [f"{'corpus' if r['cached'] else 'tokenised'}: {r['corpus']}",
             f"tokenizer:        {r['tokenizer']}",
             f"records:          {r['records']:,} ({r['chat_records']:,} chat)",
             f"tokens:           {r['tokens']:,}",
             f"masked (no loss): {100 * r['masked_share']:.1f} %",
             f"longest record:   {r['longest_record']:,} tokens ({r['longest_where']})"]
    if r["records_learning_nothing"]:
        lines.append(f"learn nothing:    {r['records_learning_nothing']:,} records (no "
                     "assistant turn)")
    if "seqlen" in r:
        lines.append(f"over seqlen+1:    {r['longer_than_row']:,} records "
                     f"({r['chat_longer_than_row']:,} chat: --too-long {r['too_long']})")
    if not r["cached"]:
        lines.append(f"speed:            {r['input_mb']:.1f} MB in {r['seconds']:.1f} s "
                     f"({r['mb_per_s'] or 0:.1f} MB/s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
