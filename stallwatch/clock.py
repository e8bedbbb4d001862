"""Injected time: monotonic seconds for durations, wall seconds for display and logs.

Rules, probes and the daemon take a Clock so that timelines (for, keep_firing_for, idle_s) are
tested deterministically with FakeClock instead of sleeps.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def time(self) -> float: ...


class SystemClock:
    """The system's clocks. The methods ARE time.monotonic and time.time (C functions, no
    Python frame): ~47 reads a tick of the daemon, each a frame more as a method (issue 17)."""

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


class FakeClock:
    """A clock that moves only when told to; wall time moves with it."""

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._mono = monotonic
        self._offset = wall - monotonic
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def time(self) -> float:
        with self._lock:
            return self._mono + self._offset

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._mono += seconds

    def set(self, monotonic: float) -> None:
        with self._lock:
            self._mono = monotonic


SYSTEM_CLOCK = SystemClock()
