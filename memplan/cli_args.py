"""Argument parsing shared by the command lines (dataflow-plan, dataflow-ring, dataflow-sweep): a
parser whose errors are one line (the caller prints it and exits 2, no usage dump), a
positive-number argument type, the parse step every main() shares and the checkpoint flags'
checks. Pure Python; never imports array libraries."""

from __future__ import annotations

import argparse
import math
import os
import sys


class UsageError(Exception):
    """A command-line mistake, already worded for the user."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def positive(kind):
    """An argparse type: `kind` (int or float) parsed from text, finite and > 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value
    parse.__name__ = kind.__name__
    return parse


def seqlen_tokens(text: str) -> int:
    """An argparse type for SEQLEN: a whole number of tokens in [1, MAX_SEQLEN]. Exponent forms
    of whole numbers ('8e3') are read; one too large is refused as too large, naming the limit."""
    from dataflow.memplan.plan.chunking import MAX_SEQLEN

    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens; give "
                                             "e.g. 4096") from None
        if math.isfinite(number) and number > MAX_SEQLEN:
            value = MAX_SEQLEN + 1  # exact below; only "too large" matters above
        elif not math.isfinite(number) or number != int(number):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens; give "
                                             "e.g. 4096") from None
        else:
            value = int(number)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of tokens")
    if value > MAX_SEQLEN:  # past it planning would be slow, and no budget fits such a step
        raise argparse.ArgumentTypeError(f"{text!r} tokens is too large: the planner handles at "
                                         f"most {MAX_SEQLEN:,} tokens per sequence; give at "
                                         f"most {MAX_SEQLEN}")
    return value


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """Add --version: prints `PROG VERSION` and exits 0. VERSION is the installed distribution's,
    read the way dataflow.__version__ reads it (the planner may not import the dataflow
    package itself, see tests/test_layering.py)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("dataflow")
    except PackageNotFoundError:  # a source checkout that was never installed
        text = "0+unknown"
    parser.add_argument("--version", action="version", version=f"%(prog)s {text}")


def parse_or_exit_code(parser: argparse.ArgumentParser, argv: list[str], prog: str):
    """(args, None), or (None, exit code): 2 after printing a usage error as one line naming
    --help, or --help's own 0."""
    try:
        return parser.parse_args(argv), None
    except UsageError as exc:
        print(f"{prog}: error: {exc} (see {prog} --help)", file=sys.stderr)
        return None, 2
    except SystemExit as exc:  # --help
        return None, int(exc.code or 0)


SIGPIPE_EXIT = 141
"""What a shell reports for a command its reader stopped (128 + SIGPIPE)."""


def print_report(text: str) -> int:
    """Print a command's report: 0, or SIGPIPE_EXIT without a traceback when the reader went
    away first (`dataflow-plan ... --json | head`): stdout is pointed at /dev/null so the
    interpreter's final flush does not raise again."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_EXIT
    return 0


def check_checkpoint_flags(checkpoint_dir: str, save_every: int, keep: int, resume: bool) -> None:
    """Refuse checkpoint flags that cannot work (ConfigError, one line): the same for
    dataflow-demo (one GPU or a ring) and dataflow-ring."""
    from dataflow.models.errors import ConfigError

    if (save_every or resume) and not checkpoint_dir:
        raise ConfigError("--save-every and --resume need --checkpoint-dir D")
    if keep < 0:
        raise ConfigError(f"--keep {keep} is negative; give 0 (keep all) or more")
    if checkpoint_dir and os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {checkpoint_dir} is a file; pass a directory")
