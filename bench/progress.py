"""A one-line progress display on stderr (the summary tables go to stdout).

On a terminal the line is rewritten in place; into a file or pipe a line is
written every few seconds instead, so a log stays readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

TTY_INTERVAL_S = 0.25
LOG_INTERVAL_S = 5.0


class Progress:
    def __init__(self, label: str, total: int, *, stream: TextIO | None = None) -> None:
        self._label = label
        self._total = total
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._start = time.monotonic()
        self._last = 0.0
        self._shown = False

    def update(self, done: int, *, force: bool = False) -> None:
        now = time.monotonic()
        interval = TTY_INTERVAL_S if self._tty else LOG_INTERVAL_S
        if not force and now - self._last < interval:
            return
        self._last = now
        elapsed = now - self._start
        line = f"{self._label}: {done}/{self._total} requests, {elapsed:.1f} s"
        if self._tty:
            self._stream.write("\r\x1b[K" + line)
        else:
            self._stream.write(line + "\n")
        self._shown = True
        self._stream.flush()

    def close(self, done: int) -> None:
        self.update(done, force=True)
        if self._tty and self._shown:
            self._stream.write("\n")
            self._stream.flush()


def note(message: str) -> None:
    """A message for the person running the bench (stderr, so stdout stays the results)."""
    print(message, file=sys.stderr, flush=True)
