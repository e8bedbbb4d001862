"""kernel/schedclock.py: each CPU's scheduler clock against /proc/uptime, measured on the CPU."""

from __future__ import annotations

import os

from stallwatch.clock import FakeClock
from stallwatch.kernel.schedclock import SchedClock, measure_lag_s


def test_a_lag_is_measured_once_per_cpu_until_it_is_refresh_s_old():
    clock, asked = FakeClock(), []

    def measure(cpu: int) -> float | None:
        asked.append(cpu)
        return {0: 5.0, 1: 3.5}.get(cpu)

    sc = SchedClock(clock.monotonic, refresh_s=60.0, measure=measure)
    assert sc.uptime_of(100.0, 0) == 105.0 and sc.uptime_of(100.0, 1) == 103.5
    assert sc.uptime_of(100.0, 0) == 105.0 and asked == [0, 1]
    clock.advance(60.0)
    assert sc.uptime_of(100.0, 1) == 103.5 and asked == [0, 1, 1]
    assert sc.uptime_of(100.0, 7) is None  # a CPU we may not run on: no lag, no age
    assert sc.uptime_of(None, 0) is None and sc.uptime_of(100.0, None) is None


def test_the_lag_of_each_cpu_is_measured_there_and_the_affinity_is_given_back():
    allowed = os.sched_getaffinity(0)
    for cpu in sorted(allowed)[:4]:
        lag = measure_lag_s(cpu)
        assert lag is not None and lag >= 0.0
        assert os.sched_getaffinity(0) == allowed
    assert measure_lag_s(max(allowed) + 4096) is None
