"""Stall detection for the engine's step loop: work waits, yet no step has finished for `stall_s`.

A step that never returns (a kernel that hangs, a device that stops answering) or a loop thread that never wakes
leaves every request waiting with no error to report. The serving app asks `stalled()` in its health answers and in
Ray Serve's `check_health`, so the replica says NOT_SERVING and Ray replaces it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DEFAULT_STALL_S = 120.0  # above the slowest honest step: a first long prefill on a busy CPU, kernel builds


class StallDetector:
    """The clock starts when work arrives at an idle engine and restarts at every finished step."""

    def __init__(self, stall_s: float = DEFAULT_STALL_S, clock: Callable[[], float] = time.monotonic):
        if stall_s <= 0:
            raise ValueError("stall_s: must be > 0")
        self.stall_s = stall_s
        self._clock = clock
        self._lock = threading.Lock()
        self._since = clock()
        self._idle = True

    def work_arrived(self) -> None:
        """A request was added; if the engine was idle, the wait for its next step starts now."""
        with self._lock:
            if self._idle:
                self._since, self._idle = self._clock(), False

    def stepped(self) -> None:
        with self._lock:
            self._since = self._clock()

    def idle(self) -> None:
        """The loop found no work and goes to sleep."""
        with self._lock:
            self._idle = True

    def stalled(self, has_work: bool) -> bool:
        with self._lock:
            return has_work and not self._idle and self._clock() - self._since > self.stall_s
