"""Has a thread left the run queue since we started watching it? Spinning judged by the kernel.

A busy loop is not "100 % CPU": on a loaded node a spinning thread gets 38 % of a core, or 10 %,
and a verdict that waits for a share of a core turns red exactly where stalls happen. What does
not change with load is that it never waits for anything: every sample finds it runnable (state
R), its voluntary context switches (sleeps, blocking syscalls, I/O waits) never move, and the
scheduler's own accounting (/proc/PID/task/TID/schedstat: time on a CPU + time waiting for one)
covers the whole wall time. Whatever CPU it is given, it uses.

One stretch per thread, restarted whenever a sample finds it not runnable or a voluntary switch
happened; schedstat is read for runnable threads only (the caller passes None otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from stallwatch.model import Frozen
from stallwatch.kernel.procfs import parse_schedstat


class RunQueueObs(Frozen):
    """The current stretch in which the thread never left the run queue (0 s when it did)."""

    runnable_for_s: float  # R in every sample, no voluntary context switch, for this long
    samples: int  # samples in the stretch (≥ 2 to say anything)
    cpu_share: float | None  # CPU it got over the stretch: 1.0 = a whole core
    wait_share: float | None  # runnable but waiting for a CPU (schedstat run_delay); None: unknown
    user_share: float | None  # of its CPU time, the part in user space (utime / utime + stime)


# What every thread out of the run queue reports: one frozen record, shared (a model validated
# per sleeping thread a tick was a tenth of a narrow job's thread reading, procs7).
NOT_RUNNABLE = RunQueueObs(runnable_for_s=0.0, samples=0, cpu_share=None, wait_share=None,
                           user_share=None)


@dataclass(slots=True)
class _Stretch:
    since: float
    seen_mono: float
    samples: int
    voluntary: int
    cpu_ticks: int
    user_ticks: int
    sched: tuple[int, int] | None


class RunQueueTracker:
    FORGET_S = 60.0  # a thread not sampled this long has gone

    def __init__(self, clk_tck: int) -> None:
        self._tck = clk_tck
        self._stretches: dict[object, _Stretch] = {}
        self._pruned_mono = 0.0

    def step(self, key: object, now: float, state: str, voluntary: int, utime_ticks: int,
             stime_ticks: int, sched: tuple[int, int] | None) -> RunQueueObs:
        self._prune(now)
        cpu = utime_ticks + stime_ticks
        s = self._stretches.get(key)
        if state != "R":
            self._stretches.pop(key, None)
            return NOT_RUNNABLE
        if s is None or s.voluntary != voluntary:
            s = self._stretches[key] = _Stretch(now, now, 1, voluntary, cpu, utime_ticks, sched)
        else:
            s.samples += 1
            s.seen_mono = now
        wall = now - s.since
        if s.samples < 2 or wall <= 0:
            return RunQueueObs(runnable_for_s=0.0, samples=s.samples, cpu_share=None,
                               wait_share=None, user_share=None)
        d_cpu, d_user = cpu - s.cpu_ticks, utime_ticks - s.user_ticks
        cpu_share = wait_share = None
        if sched is not None and s.sched is not None:  # ns, far finer than clock ticks
            cpu_share = (sched[0] - s.sched[0]) / 1e9 / wall
            wait_share = (sched[1] - s.sched[1]) / 1e9 / wall
        else:
            cpu_share = d_cpu / self._tck / wall
        return RunQueueObs(runnable_for_s=wall, samples=s.samples, cpu_share=max(0.0, cpu_share),
                           wait_share=None if wait_share is None else max(0.0, wait_share),
                           user_share=d_user / d_cpu if d_cpu > 0 else None)

    def _prune(self, now: float) -> None:
        if now - self._pruned_mono < self.FORGET_S:
            return
        self._pruned_mono = now
        for k in [k for k, s in self._stretches.items() if now - s.seen_mono > self.FORGET_S]:
            del self._stretches[k]


def schedstat_or_none(text: str) -> tuple[int, int] | None:
    """A malformed schedstat costs the wait share, not the tick."""
    try:
        return parse_schedstat(text)
    except ValueError:
        return None
