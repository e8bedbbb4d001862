"""The daemon's own footprint: CPU time, resident memory, open descriptors, threads.

Read with psutil, not by hand: these are facts about stallwatch's OWN process (trusted, not the
job's), wanted only when something asks (a scrape, a textfile write, `bench`), and psutil reads
all four in one `oneshot()` (one `/proc/self/stat` + `statm` parse in C, the fd count by a
directory listing) portably and well kept. The per-thread /proc hot path of the job stays
hand-kept (`kernel/procfiles.py`: descriptors kept open and re-read with `pread`, measured
cheaper than psutil there, docs/performance.md, issue 17).

    usage = read_self_usage()          # SelfUsage(cpu_s=1.93, rss_bytes=55_812_096, ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil


@dataclass(frozen=True, slots=True)
class SelfUsage:
    cpu_s: float  # user + system CPU seconds since the process started (every thread)
    rss_bytes: int  # resident set size
    open_fds: int | None  # None where the platform cannot count them
    threads: int


def read_self_usage(process: Any = None) -> SelfUsage | None:
    """The footprint of `process` (default: this one), or None if it cannot be read.

    A failed read is never an error for the caller: metrics leave the series out."""
    try:
        p = process if process is not None else psutil.Process()
        with p.oneshot():
            t = p.cpu_times()
            try:
                fds: int | None = p.num_fds()
            except (AttributeError, psutil.AccessDenied):  # num_fds is POSIX-only
                fds = None
            return SelfUsage(cpu_s=float(t.user + t.system), rss_bytes=int(p.memory_info().rss),
                             open_fds=fds, threads=int(p.num_threads()))
    except (psutil.Error, OSError):
        return None
