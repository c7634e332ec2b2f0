"""Argument parsing shared by the command lines (dataflow-plan, dataflow-demo, dataflow-sweep,
dataflow-export, dataflow-probe, dataflow-ring): a parser whose errors are one line (no usage
dump), argument types, the checkpoint flags' checks, and run_command, the preamble every main()
shares (parse, logging, one line per error with its exit code, tracebacks only with --debug).
Never imports array libraries, so dataflow-plan stays free of them."""

from __future__ import annotations

import argparse
import difflib
import enum
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from dataflow.checkpoint_dir import check_checkpoint_root
from dataflow.memplan.plan.chunking import MAX_SEQLEN
from dataflow.models.errors import ConfigError


class UsageError(Exception):
    """A command-line mistake, already worded for the user."""


class OneLineParser(argparse.ArgumentParser):
    """The CLIs' parser: a mistake is one line with a did-you-mean (UsageError), and flags are
    taken only as spelled in full. argparse's prefix matching would take --eval-seq for
    --eval-seqs silently, and a flag added later would turn a script's working abbreviation into
    an 'ambiguous option' error; a misspelt or shortened flag now gets the hint instead."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(message + self._close_flags(message))

    def _close_flags(self, message: str) -> str:
        """'; did you mean --steps?' for a misspelt flag of an 'unrecognized arguments' error
        (Python 3.12 only learned to suggest; the floor is 3.10)."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        hints = []
        for word in message.split(":", 1)[1].split():
            flag = word.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75) if \
                flag.startswith("--") else []
            hints += [f"{close[0]} for {flag}"] if close else []
        return f"; did you mean {', '.join(hints)}?" if hints else ""


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


def add_freeze_flag(parser: argparse.ArgumentParser) -> None:
    """Add --freeze SPEC (Plan.frozen; docs/freeze.md), one help text for every command. The
    spec is checked against the model's layers when the plan is made."""
    parser.add_argument(
        "--freeze", metavar="SPEC", default=None,
        help="blocks that train no further, comma-separated: embed, head, layers:A-B, "
             "layers:N, layers:all (e.g. embed,head,layers:0-29): they keep their weights and "
             "get no gradient, AdamW state, gradient copy or weight-gradient GEMM, and the "
             "plan counts only what trains (docs/freeze.md; one device only)")


def int_at_least(low: int, *, not_int: str = "'{text}' is not a whole number",
                 too_small: str = "{text} must be at least {low}") -> Callable[[str], int]:
    """An argparse type: a whole number >= low; otherwise ArgumentTypeError with `not_int` or
    `too_small` (format fields: text, low), so each flag words its own hint."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(not_int.format(text=text, low=low)) from None
        if value < low:
            raise argparse.ArgumentTypeError(too_small.format(text=text, low=low))
        return value

    return parse


_LORA_RANK_ERROR = "LoRA rank must be a positive integer, got {text!r} (e.g. 8)"
_lora_rank = int_at_least(1, not_int=_LORA_RANK_ERROR, too_small=_LORA_RANK_ERROR)


def _lora_alpha(text: str) -> float:
    try:
        a = float(text)
    except ValueError:
        a = float("nan")
    if not a > 0 or a == float("inf"):
        raise argparse.ArgumentTypeError(f"LoRA alpha must be a positive number, got {text!r} "
                                         "(e.g. 16)")
    return a


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """Add --lora-rank / --lora-alpha / --lora-targets / --lora-base (Plan.lora; docs/lora.md),
    one help text for every command; lora_of(args) turns them into a Lora."""
    g = parser.add_argument_group("LoRA adapters (docs/lora.md; one device, dense models)")
    g.add_argument("--lora-rank", type=_lora_rank, default=None, metavar="R",
                   help="train LoRA adapters of rank R; the base model (every layer, the "
                        "embedding and the head) is frozen")
    g.add_argument("--lora-alpha", type=_lora_alpha, default=None, metavar="A",
                   help="LoRA alpha: the adapters' output is scaled by A / R (default: A = R, "
                        "scale 1)")
    g.add_argument("--lora-targets", default=None, metavar="LIST",
                   help="adapted linears, comma-separated from q,k,v,o,gate,up,down (default: "
                        "all seven)")
    g.add_argument("--lora-base", default=None, metavar="{bf16,fp8}",
                   help="storage of the frozen base's seven linears: bf16 (default) or fp8 "
                        "(E4M3 codes with an fp32 scale per output row, about half the host "
                        "memory and H2D bytes; the model trained is the FP8-rounded base plus "
                        "the adapters); needs --lora-rank")


def lora_of(args):
    """The Lora of parsed --lora-* flags, or None; ConfigError (exit 2) naming a bad value."""
    # imported here: the CLI helpers load no planner module until a command asks for LoRA
    from dataflow.memplan.plan.lora import parse_lora
    return parse_lora(getattr(args, "lora_rank", None), getattr(args, "lora_alpha", None),
                      getattr(args, "lora_targets", None), getattr(args, "lora_base", None))


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """Add --version: prints `PROG VERSION` and exits 0. VERSION is the installed distribution's,
    read the way dataflow.__version__ reads it (from the metadata, so that this module needs
    nothing of the dataflow package's own __init__)."""
    try:
        text = version("dataflow")
    except PackageNotFoundError:  # a source checkout that was never installed
        text = "0+unknown"
    parser.add_argument("--version", action="version", version=f"%(prog)s {text}")


def parse_or_exit_code(parser: argparse.ArgumentParser, argv: list[str], prog: str):
    """(args, None), or (None, exit code): 2 after printing a usage error as one line naming
    --help, or the code of argparse's own exit (0 for --help and --version; 2 after the usage
    a plain ArgumentParser prints for a mistake)."""
    try:
        return parser.parse_args(argv), None
    except UsageError as exc:
        return None, _usage_error(prog, exc)
    except SystemExit as exc:  # --help
        return None, int(exc.code or 0)


def _usage_error(prog: str, exc: UsageError) -> int:
    print(f"{prog}: error: {exc} (see {prog} --help)", file=sys.stderr)
    return 2


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


def check_checkpoint_flags(checkpoint_dir: str, save_every: int, keep: int, resume: bool,
                           force_dir: bool = False) -> None:
    """Refuse checkpoint flags that cannot work (ConfigError, one line): the same for
    dataflow-demo (one GPU or a ring) and dataflow-ring. A --checkpoint-dir that holds anything
    but this engine's checkpoints (a model, other files) is refused unless force_dir
    (--force-checkpoint-dir)."""
    if (save_every or resume) and not checkpoint_dir:
        raise ConfigError("--save-every and --resume need --checkpoint-dir D")
    if force_dir and not checkpoint_dir:
        raise ConfigError("--force-checkpoint-dir needs --checkpoint-dir D")
    if keep < 0:
        raise ConfigError(f"--keep {keep} is negative; give 0 (keep all) or more")
    if checkpoint_dir and os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {checkpoint_dir} is a file; pass a directory")
    if checkpoint_dir:
        check_checkpoint_root(checkpoint_dir, force=force_dir,
                              way_out="add --force-checkpoint-dir")


# -- the preamble of every main() -------------------------------------------------------------
class Debug(enum.Enum):
    """What --debug does to an error a command otherwise reports in one line."""

    RAISE = "raise"
    """Re-raise it: Python prints the traceback and the process exits 1."""
    TRACEBACK = "traceback"
    """Print the traceback, then the one line, and keep the outcome's exit code."""
    QUIET = "quiet"
    """The one line only, --debug or not."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """How run_command reports one kind of exception from a command's work: `PROG: ` and one
    line on stderr, then an exit code (2 bad input, 1 a failure while running)."""

    catch: tuple[type[Exception], ...]
    """The exception types this outcome takes (the first outcome that matches wins)."""
    exit_code: int
    words: str = "{exc}"
    """The line after `PROG: `; {exc} is the exception's text, {name} its type's name."""
    debug: Debug = Debug.RAISE
    """What --debug adds (commands without a --debug flag never see it)."""


BAD_INPUT = Outcome(catch=(ConfigError,), exit_code=2)
"""A refusal already worded for the user (bad model, budgets nothing fits): its text, exit 2."""
FAILED = Outcome(catch=(Exception,), exit_code=1,
                 words="failed while running: {name}: {exc} (rerun with --debug)")
"""Anything else: one line of reason, exit 1."""


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None,
                work: Callable[[argparse.Namespace], int | str], *,
                outcomes: tuple[Outcome, ...] = (BAD_INPUT, FAILED),
                log_format: str | None = None) -> int:
    """The exit code of a command: parse argv (sys.argv[1:] when None; a mistake is one line and
    2, --help 0), set up logging to stderr when log_format is given (DEBUG with --debug, INFO
    otherwise), then run work(args). Work returns an exit code, or a report that is printed
    on stdout (print_report: 0, or 141 when the reader went away); a UsageError it raises reads
    like a parse error; other exceptions are reported by the first of `outcomes` that catches
    them (none: the exception propagates)."""
    prog = parser.prog
    args, code = parse_or_exit_code(parser, sys.argv[1:] if argv is None else argv, prog)
    if args is None:
        return code
    debug = getattr(args, "debug", False)  # a subcommand's flag: absent when none was given
    if log_format is not None:
        logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format=log_format,
                            stream=sys.stderr)
    try:
        result = work(args)
    except UsageError as exc:
        return _usage_error(prog, exc)
    except Exception as exc:
        outcome = next((o for o in outcomes if isinstance(exc, o.catch)), None)
        if outcome is None or (debug and outcome.debug is Debug.RAISE):
            raise
        if debug and outcome.debug is Debug.TRACEBACK:
            traceback.print_exc()
        print(f"{prog}: {outcome.words.format(exc=exc, name=type(exc).__name__)}",
              file=sys.stderr)
        return outcome.exit_code
    return print_report(result) if isinstance(result, str) else result
