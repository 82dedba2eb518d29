"""Progress lines for long work, on standard error, numbered `[k/N]` the same way for every verb.

Quick work stays silent: a phase is announced once it, or the work so far, has taken `after`
seconds (one by default), so checking a small spec prints nothing and compiling a 512-rank plan
says which phase it is in, with the time so far.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

#: Seconds of work after which phases announce themselves.
QUIET_FOR_S = 1.0


class Progress:
    def __init__(self, label: str, total: int, *, after: float | None = None, stream: TextIO | None = None):
        self.label, self.total = label, total
        self.after = QUIET_FOR_S if after is None else after
        self.stream = stream
        self.done = 0
        self.started = time.perf_counter()
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def _say(self, number: int, what: str) -> None:
        with self._lock:
            if number != self.done:  # the phase ended before its timer fired
                return
            elapsed = time.perf_counter() - self.started
            stream = self.stream if self.stream is not None else sys.stderr
            print(
                f"mixle-compile {self.label} [{number}/{self.total}] {what} ({elapsed:.1f} s so far)",
                file=stream,
                flush=True,
            )

    def step(self, what: str) -> None:
        """Phase `done + 1` of `total` begins; it is announced now if the work has run `after`
        seconds already, else when it has itself run until then."""
        self.close()
        with self._lock:
            self.done += 1
            number = self.done
        wait = self.after - (time.perf_counter() - self.started)
        if wait <= 0:
            self._say(number, what)
            return
        self._timer = threading.Timer(wait, self._say, (number, what))
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        """The work is over: no more lines."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Silent(Progress):
    """No lines: for callers that did not ask for progress."""

    def __init__(self):
        super().__init__("", 0)

    def step(self, what: str) -> None:
        self.done += 1
