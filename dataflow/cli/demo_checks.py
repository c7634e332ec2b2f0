"""What dataflow-demo checks before it starts work, and how it stops on a signal: argument types
that refuse non-finite or out-of-range numbers and unwritable paths, a plan file read and
compared with the positionals, budgets compared with the memory this machine has, and SIGINT /
SIGTERM turned into a stop between steps. Never allocates arenas, never trains."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
from pathlib import Path

import psutil

from dataflow.memplan.plan.plan import Budget, Plan
from dataflow.models.errors import ConfigError
from dataflow.settings import settings_from_env

log = logging.getLogger("dataflow.demo")

GIB, MIB = 1 << 30, 1 << 20
EXIT_NONFINITE = 3
"""Exit status when training stopped on a NaN or infinite loss or gradient norm."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def size_text(nbytes: int) -> str:
    """'24.00 GiB', or MiB below 1 GiB so small budgets stay readable ('20.5 MiB')."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


# -- argument types ---------------------------------------------------------------------------
def positive_float(text: str) -> float:
    """A finite number > 0 ('inf', 'nan', '1e999' refused here, not as an OverflowError later)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 2^63)")
    return value


def writable_file(text: str) -> str:
    """A path whose folder exists and is writable, and that is not a folder itself: checked
    here, so a typo fails before minutes of initialisation rather than after."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file inside it")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} of {text!r} does not exist; "
                                         "create it first or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists()
                                                     and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable; choose another path")
    return text


def readable_file(text: str) -> str:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"plan file {text!r} does not exist (or is not a file)")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"plan file {text!r} is not readable")
    return text


# -- checks before any allocation --------------------------------------------------------------
def load_plan(path: str):
    """The Plan in `path`; ConfigError (exit 2) when it is not one."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read plan file '{path}': {exc}") from None
    try:
        return Plan.from_json(text)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"'{path}' is not a plan file ({type(exc).__name__}: {exc}); make one "
                          "with dataflow-plan ... --json > plan.json") from None


def check_plan_matches(plan, cfg, seqlen: int, host_gb: float, dev_gb: float) -> None:
    """Refuse a plan whose model, seqlen or budgets differ from the positionals (they used to be
    ignored silently, and a different seqlen failed only after initialisation)."""
    want = Budget.from_gib(host_gb, dev_gb)
    diffs = []
    if plan.model != cfg:
        diffs.append(f"model '{plan.model.name}' (not '{cfg.name}')")
    if plan.chunking.seqlen != seqlen:
        diffs.append(f"seqlen {plan.chunking.seqlen} (not {seqlen})")
    if plan.budget.host_bytes != want.host_bytes:
        diffs.append(f"host {size_text(plan.budget.host_bytes)} (not {size_text(want.host_bytes)})")
    if plan.budget.device_bytes != want.device_bytes:
        diffs.append(f"device {size_text(plan.budget.device_bytes)} (not "
                     f"{size_text(want.device_bytes)})")
    if diffs:
        b = plan.budget
        raise ConfigError(f"the plan file is for {', '.join(diffs)}; give its own values "
                          f"({b.host_bytes / GIB:g} {b.device_bytes / GIB:g} "
                          f"{plan.chunking.seqlen} {plan.model.name}) or drop --plan")


HOST_CHECK_ENV = "DATAFLOW_HOST_CHECK"
"""'off' skips the host half of check_budgets_fit_machine: on a virtual machine whose memory
grows as it is used (the lent multi-GPU machines read 31 GiB at start and 255 GiB once filled),
the available memory at start says nothing about what the budget can have."""


def check_budgets_fit_machine(plan, backend) -> None:
    """Refuse budgets larger than this machine's available host memory (both NumPy slabs live
    there; skipped when DATAFLOW_HOST_CHECK=off) or the GPU's free memory, before anything is
    allocated."""
    b = plan.budget
    host_need = b.host_bytes + (b.device_bytes if backend.name == "numpy" else 0)
    avail = psutil.virtual_memory().available
    skip = not settings_from_env().host_check
    if host_need > avail and skip:
        log.warning("%s=off: not refusing %s of budgets against the %s available now",
                    HOST_CHECK_ENV, size_text(host_need), size_text(avail))
    elif host_need > avail:
        what = "host + device budgets" if backend.name == "numpy" else "host budget"
        raise ConfigError(f"{what} {size_text(host_need)} exceed the {size_text(avail)} of "
                          f"memory this machine has available; lower host_gb"
                          f"{' or dev_gb' if backend.name == 'numpy' else ''} to fit (on a "
                          f"machine whose memory grows as it is used, {HOST_CHECK_ENV}=off "
                          f"skips this check)")
    if backend.name != "numpy":
        free = _gpu_free_bytes()
        if free is not None and b.device_bytes > free:
            raise ConfigError(f"device budget {size_text(b.device_bytes)} exceeds the "
                              f"{size_text(free)} free on the GPU; lower dev_gb to fit")


def _gpu_free_bytes() -> int | None:
    try:  # CuPy is the optional `gpu` extra
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    except Exception:  # noqa: BLE001 - no reading: the allocation itself will say
        return None


# -- signals ----------------------------------------------------------------------------------
class StopSignals:
    """`with StopSignals() as stop:` the first SIGINT or SIGTERM asks to stop before the next
    step (`stop.signum` is set; the loop checks it); a second one, inside `with stop.abortable():`
    (initialisation, a step), raises KeyboardInterrupt at once, abandoning that work (inside
`stop.abortable(first_signal=True)`, planning, the first one does); outside it
    (writing the trace, metrics or a checkpoint) the stop waits for the loop, so no file is left
    half-written. Restores the previous handlers on exit (ignores further stop signals once a
    stop was asked for, so the exit code stands). Outside the main thread (where Python
    cannot install handlers) it does nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}
        self._abortable = False
        self._at_first = False

    def abortable(self, *, first_signal: bool = False) -> "_Abortable":
        """Inside it a second signal stops at once; with first_signal=True the first one too
        (planning: nothing is half-done or half-written there, and no step would end it)."""
        return _Abortable(self, first_signal)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if self._abortable:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if self._at_first:
            log.info("%s: stopping now", signal.Signals(signum).name)
            raise KeyboardInterrupt
        log.info("%s: stopping after the step in progress (send it again to stop now)",
                 signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as shells report it: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + (self.signum or signal.SIGINT)

    def __enter__(self) -> "StopSignals":
        try:
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread
            self._previous.clear()
        return self

    def __exit__(self, *exc) -> None:
        # Once a stop was asked for, the process is on its way out with its exit code: a late
        # repeat of the signal must not kill it with the default handler before it returns.
        for s, old in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self.signum is not None else old)


class _Abortable:
    def __init__(self, stop: StopSignals, first_signal: bool):
        self.stop, self.first_signal = stop, first_signal

    def __enter__(self) -> None:
        self.stop._abortable = True
        self.stop._at_first = self.first_signal

    def __exit__(self, *exc) -> None:
        self.stop._abortable = False
        self.stop._at_first = False
