"""How a start-up phase that takes seconds shows itself: ``phase(log, what, ...)``.

Owns the one rule for long phases (the GGUF conversion, the kernel build, the dtype and
matmul-form measurements, the KV pool's first touch, the warm-up step):

* Always: a log line when the phase starts (``what ...``) and one when it ends (``what: done in
  N.Ns``, or ``failed after``), so a log file says what ran, when and for how long. A phase
  given ``every`` seconds also logs a line at that interval while it runs (only the kernel
  build, which takes minutes), with its count and how long is likely left.
* On a terminal (stderr is a TTY, and ``LOCKGATE_PROGRESS`` is not ``0``), also a tqdm bar on
  stderr while the phase runs: what is happening, how far it is and how long is left, redrawn in
  place. Never in a file or pipe: there a redrawn bar is carriage-return spam.

A phase counts either steps (``total``: ``advance()`` / ``to()``) or time against an expected
duration (``expected_s``: the bar fills with the seconds spent, and stretches when the phase
runs longer than expected). ``detail(text)`` names the current step. Thread-safe enough for one
worker and one ticker: the counters are plain attribute writes.

Torch-free, no I/O but stderr; a lowest-layer unit any other may use.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

ENV = "LOCKGATE_PROGRESS"  # "0": never draw bars (log lines only); anything else: bars on a TTY
TICK_SECONDS = 0.5  # how often a bar is redrawn (time-based bars, and the elapsed time of counted ones)


def bars_wanted(stream: Any = None) -> bool:
    """Whether ``stream`` (default: stderr) gets bars: a terminal, and ``$LOCKGATE_PROGRESS`` not 0."""
    if os.environ.get(ENV, "").strip() == "0":
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _AroundBars:
    """A log handler's stream that lifts this process's bars off the line while it writes (tqdm's
    ``external_write_mode``), so log lines never land on the end of a half-drawn bar."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, s: str) -> int:
        from tqdm import tqdm

        if not getattr(tqdm, "_instances", None):
            return int(self.stream.write(s))
        with tqdm.external_write_mode(file=self.stream):
            return int(self.stream.write(s))

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


_routed = False


def _logs_around_bars() -> None:
    """Once per process, before its first bar: the root logger's stderr handlers write around bars."""
    global _routed
    if _routed:
        return
    _routed = True
    for h in logging.getLogger().handlers:
        if type(h) is logging.StreamHandler and h.stream is sys.stderr:
            h.setStream(_AroundBars(h.stream))  # type: ignore[arg-type]


FALLBACK_COLUMNS = 120


def _columns(stream: Any) -> int:
    """The terminal's width behind ``stream``; 0 when it reports none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return 0


def _fmt_s(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f}s" if seconds < 90 else f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"


class Phase:
    """One running phase; made by ``phase()``."""

    def __init__(self, log: logging.Logger, what: str, total: int | None, unit: str, expected_s: float | None,
                 every: float | None, stream: Any, left: Callable[[float], float | None] | None = None) -> None:
        self.log, self.what, self.total, self.unit = log, what, total, unit
        self.expected_s = expected_s
        self.left = left
        self.every = every
        self.n = 0
        self.text = ""
        self.t0 = time.monotonic()
        self._done = threading.Event()
        self._bar: Any = None
        if bars_wanted(stream):
            from tqdm import tqdm

            _logs_around_bars()
            fmt = "{desc} |{bar}| {percentage:3.0f}%{postfix}"
            out = stream if stream is not None else sys.stderr
            sized = _columns(out) > 0  # a terminal that reports no size (a bare pty) gets a fixed size: tqdm draws nothing in 0 rows
            short = what.split(" (", 1)[0]  # the bar keeps room to draw: the log lines carry the parenthesis
            self._bar = tqdm(total=100, desc=short, bar_format=fmt, file=out, leave=False, mininterval=0.2,
                             dynamic_ncols=sized, ncols=None if sized else FALLBACK_COLUMNS, nrows=None if sized else 20)
        if self._bar is not None or every is not None:
            threading.Thread(target=self._tick, name="progress", daemon=True).start()

    # ---- what the worker calls ----
    def advance(self, k: int = 1) -> None:
        """``k`` more of ``total`` steps done."""
        self.n += k
        self._draw()

    def to(self, n: int) -> None:
        """``n`` of ``total`` steps done."""
        self.n = n
        self._draw()

    def at(self, n: int, text: str) -> None:
        """``n`` of ``total`` steps done, and now doing ``text``."""
        self.n, self.text = n, text
        self._draw()

    def detail(self, text: str) -> None:
        """Name what the phase is doing now (shown on the bar and in ``every`` lines)."""
        self.text = text
        self._draw()

    # ---- figures ----
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def fraction(self) -> float:
        """How far the phase is, 0..1 (never 1 before it ends)."""
        if self.total:
            return min(self.n / self.total, 0.99)
        if self.expected_s:
            return min(self.elapsed() / self.expected_s, 0.99)
        return 0.0

    def left_s(self) -> float | None:
        """Seconds likely left: from the steps' rate once one is done, else the expected duration;
        None when neither says anything."""
        elapsed = self.elapsed()
        if self.left is not None:
            told = self.left(elapsed)
            if told is not None:
                return max(told, 0.0)
        guess = None if self.expected_s is None else max(self.expected_s - elapsed, 0.0)
        if self.total and self.n > 0:
            by_rate = elapsed * (self.total - self.n) / self.n
            guess = by_rate if guess is None else max(by_rate, guess) if self.n < self.total / 3 else by_rate
        return guess

    def status(self) -> str:
        parts = []
        if self.total:
            parts.append(f"{self.n}/{self.total}{' ' + self.unit if self.unit else ''}")
        if self.text:
            parts.append(self.text)
        parts.append(f"{_fmt_s(self.elapsed())} so far")
        left = self.left_s()
        if left is not None:
            parts.append(f"~{_fmt_s(left)} left" if left >= 1 else "finishing")
        return ", ".join(parts)

    # ---- drawing ----
    def _draw(self) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.n = round(100 * self.fraction())
        bar.set_postfix_str(self.status(), refresh=False)
        bar.refresh()

    def _tick(self) -> None:
        last_line = time.monotonic()
        while not self._done.wait(TICK_SECONDS):
            self._draw()
            if self.every is not None and self._bar is None and time.monotonic() - last_line >= self.every:
                last_line = time.monotonic()
                self.log.info("%s: %s", self.what, self.status())

    def _close(self, ok: bool) -> None:
        self._done.set()
        if self._bar is not None:
            self._bar.close()
        if ok:
            self.log.info("%s: done in %.1fs", self.what, self.elapsed())
        else:
            self.log.warning("%s: failed after %.1fs", self.what, self.elapsed())


@contextmanager
def phase(log: logging.Logger, what: str, *, total: int | None = None, unit: str = "",
          expected_s: float | None = None, every: float | None = None, stream: Any = None,
          left: Callable[[float], float | None] | None = None) -> Iterator[Phase]:
    """Run a phase: ``with phase(log, "measuring the matmul forms", total=9) as p: ... p.advance()``.

    ``what`` says what is happening (logged with `` ...`` at the start, then on the bar);
    ``total`` steps of ``unit``, or ``expected_s`` seconds, or both (the bar follows the steps and
    the time left is the larger guess until a third of them are done); ``every``: also log the
    status at that interval when no bar is drawn; ``stream``: where a bar goes (default stderr);
    ``left(elapsed)``: the caller's own guess of the seconds left (None: the default guess)."""
    extra = f" (~{_fmt_s(expected_s)} expected)" if expected_s else ""
    log.info("%s ...%s", what, extra)
    p = Phase(log, what, total, unit, expected_s, every, stream, left)
    try:
        yield p
    except BaseException:
        p._close(False)
        raise
    p._close(True)
