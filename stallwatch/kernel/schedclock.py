"""The scheduler's clock in /proc/uptime seconds, CPU by CPU.

/proc/PID/sched's se.exec_start (when a task last ran) is stamped with the rq_clock_task of the CPU
it ran on: that CPU's clock less the time the hypervisor stole from it (paravirt steal
accounting) and, with CONFIG_IRQ_TIME_ACCOUNTING, less its time in interrupts. So it falls behind
/proc/uptime by that CPU's own stolen (and interrupt) time, which only grows with the machine's
uptime. Measured on the CI VM (kernel 6.18, 3 h 52 min up): 5.0 s behind on CPU 0 and 3.5 s on
CPU 1, near each CPU's steal in /proc/stat (5.45 s, 3.71 s). `uptime - exec_start` read a thread
that polls every 50 ms as quiet for 3.5 s, and a 3 s stall threshold called it a hang; on a VM up
for weeks the lag is minutes.

A CPU's lag is measured, not estimated from /proc/stat (which does not say whether interrupt time
is taken out): our own thread is moved onto that CPU for a moment (sched_setaffinity), where the
switch stamps its exec_start with that CPU's clock, and reads it next to /proc/uptime. A lag is
measured when a CPU is first asked for and again once `refresh_s` old. A CPU this thread may not
run on (a cpuset) has no known lag: None, and the caller goes without the scheduler's memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from stallwatch.kernel.procfs import parse_sched_exec_start_s, parse_uptime_s


def measure_lag_s(cpu: int) -> float | None:
    """How far CPU `cpu`'s rq_clock_task is behind /proc/uptime, in seconds; None when this
    thread may not run there or a read fails. Moves the calling thread only (pid 0), and back."""
    try:
        allowed = os.sched_getaffinity(0)
    except OSError:
        return None
    if cpu not in allowed:
        return None
    try:
        # The kernel migrates the running caller before sched_setaffinity returns, and the switch
        # in on `cpu` stamps exec_start with its clock. uptime is read after that stamp: the lag
        # comes out a few microseconds long, which errs towards a shorter quiet, never a longer.
        os.sched_setaffinity(0, {cpu})
        try:
            with open("/proc/uptime", "rb") as f:
                up_s = parse_uptime_s(f.read().decode())
            with open("/proc/thread-self/sched", "rb") as f:
                start_s = parse_sched_exec_start_s(f.read().decode("utf-8", "replace"))
        finally:
            os.sched_setaffinity(0, allowed)
    except (OSError, ValueError):
        return None
    return None if start_s is None else max(0.0, up_s - start_s)


class SchedClock:
    """Each CPU's lag (measure_lag_s), measured when first asked for and again after refresh_s.
    A stale lag errs both ways: a run before the measurement reads a little younger, a run
    after it older by the steal accrued since (at most refresh_s of it; 0.02 s in 7 minutes on
    the CI VM). Measuring costs 40-140 µs a CPU (a migration there and back), too much each tick
    for each CPU of a wide host."""

    def __init__(self, clock: Callable[[], float], refresh_s: float = 60.0,
                 measure: Callable[[int], float | None] = measure_lag_s) -> None:
        self._clock, self.refresh_s, self._measure = clock, refresh_s, measure
        self._lags: dict[int, tuple[float, float | None]] = {}  # cpu -> (measured at, lag)

    def lag_s(self, cpu: int) -> float | None:
        now_mono = self._clock()
        got = self._lags.get(cpu)
        if got is None or now_mono - got[0] >= self.refresh_s:
            got = (now_mono, self._measure(cpu))
            self._lags[cpu] = got
        return got[1]

    def uptime_of(self, exec_start_s: float | None, cpu: int | None) -> float | None:
        """se.exec_start of a task that last ran on `cpu`, as /proc/uptime seconds; None when
        either is unknown."""
        if exec_start_s is None or cpu is None:
            return None
        lag = self.lag_s(cpu)
        return None if lag is None else exec_start_s + lag
