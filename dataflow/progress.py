"""Progress for long work (model init, training steps): a bar redrawn in place when stderr is a
terminal, plain periodic lines otherwise (logs, CI). Log lines pass through `info` so they never
tangle with the bar. `StepWatch` reports inside one long step from a background thread. No
dependencies; never prints to stdout (that is for --json)."""

from __future__ import annotations

import logging
import sys
import threading
import time


class Progress:
    """`with Progress(24, "steps") as bar: ...; bar.update(info="loss 3.2")`."""

    def __init__(self, total: int, label: str, *, stream=None, width: int = 28,
                 interval_s: float = 10.0, logger: logging.Logger | None = None):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        """Seconds between plain lines when not on a terminal (the first and last always)."""
        self.logger = logger
        self.done = 0
        self.info_text = ""
        self._t0 = time.perf_counter()
        self._first = None
        """(time, units done) after the first update: the ETA's rate is taken from there on, so
        work before the first unit ends (an engine's setup before its weights) never inflates
        it; the first line has no ETA."""
        self._last_line = None
        self._drawn = False

    def update(self, n: int = 1, info: str = "") -> None:
        """Count `n` more units done; `info` is shown beside the count."""
        self.done = min(self.total, self.done + n)
        if self._first is None:
            self._first = (time.perf_counter(), self.done)
        self.info_text = info or self.info_text
        if self.tty:
            self._draw()
            return
        now = time.perf_counter()
        if (self._last_line is None or now - self._last_line >= self.interval_s
                or self.done == self.total):
            self._last_line = now
            self.stream.write(self._text() + "\n")
            self.stream.flush()

    def _text(self) -> str:
        now = time.perf_counter()
        elapsed = now - self._t0
        frac = self.done / self.total
        head = f"{self.label}: {self.done}/{self.total} ({frac:.0%}) {elapsed:.1f} s"
        t1, d1 = self._first or (now, self.done)
        if d1 < self.done < self.total and now > t1:
            head += f", eta {(now - t1) / (self.done - d1) * (self.total - self.done):.0f} s"
        return head + (f"  {self.info_text}" if self.info_text else "")

    def _draw(self) -> None:
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r\x1b[K[{bar}] {self._text()}")
        self.stream.flush()
        self._drawn = True

    def _clear(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def info(self, msg: str, *args) -> None:
        """Log `msg % args` at INFO through the logger (plain write when none), bar redrawn."""
        self._clear()
        if self.logger is not None:
            self.logger.info(msg, *args)
        else:
            self.stream.write((msg % args if args else msg) + "\n")
        if self.tty and self.done:
            self._draw()

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Ticker:
    """A daemon thread that runs the subclass's `_loop` while the `with` block runs (`_t0` is
    when it began); leaving the block stops and joins it."""

    def __init__(self, thread_name: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._t0 = 0.0  # set when the block starts (__enter__)

    def _loop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class StepWatch(_Ticker):
    """While a step runs, every `interval_s` write `say(line)` with how far it has got:
    `with StepWatch(eng.step_progress, "step 3", log.info): eng.train_step(...)`. A step
    shorter than the interval writes nothing. `position()` returns an object with `fraction`,
    `dispatched`, `events` and `at` (dataflow.executor.StepProgress), or None."""

    def __init__(self, position, label: str, say, *, interval_s: float = 30.0):
        super().__init__("dataflow-step-watch")
        self.position, self.label, self.say, self.interval_s = position, label, say, interval_s

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            p = self.position()
            if p is None:
                continue
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / p.fraction - elapsed if p.fraction > 0.02 else None
            self.say(f"{self.label}: {p.fraction:.0%} of its {p.events:,} events dispatched "
                     f"({p.at}), {elapsed:.0f} s" + (f", about {eta:.0f} s to go" if eta
                                                     else ""))


class SlowNotice(_Ticker):
    """While a long call runs, every `interval_s` write `say(line)` saying it is still running:
    `with SlowNotice("planning 8b", log.info, hint="Ctrl-C stops it"): make_plan(...)`. A call
    shorter than the interval writes nothing (the planner's search has no cheap fraction done,
    so this says only the time). `label` may be reassigned while it runs (the next line says
    the new one: dataflow-plan names the GPU count it is weighing)."""

    def __init__(self, label: str, say, *, interval_s: float = 5.0, hint: str = ""):
        super().__init__("dataflow-slow-notice")
        self.label, self.say, self.interval_s, self.hint = label, say, interval_s, hint

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            elapsed = time.perf_counter() - self._t0
            self.say(f"{self.label}: still running after {elapsed:.0f} s"
                     + (f" ({self.hint})" if self.hint else ""))
