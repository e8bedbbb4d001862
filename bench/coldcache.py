#!/usr/bin/env python3
"""How much dearer one small piece of Python is after a 1 s sleep than back to back, on this host.

    python bench/coldcache.py [--samples 6]

A watchdog ticks once a second: between ticks the host runs other work, and the tick starts
with cold caches and TLBs. On some virtual machines that costs a small operation 50-300x its
hot time (measured on this project's 2-vCPU VM: a 100-entry dict walk, 4 us back to back,
200-330 us after 1 s), on others almost nothing. A daemon's tick CPU then follows how much
memory the tick touches more than how many instructions it runs, while bench/floor.py, which
touches little, barely moves: the run records this factor beside its ratios (`host_cold` in the
JSON) so a "x floor" can be read against the host it was measured on.

It also times the first write to each page of a buffer that was written before the sleep, and
counts the page faults the guest kernel saw meanwhile (getrusage). On this project's VM each
such page cost ~40 us after 1 s with no guest fault at all: the host, not Linux inside, had
taken the memory back (its own reclaim or ballooning), so the daemon pays per distinct page a
tick touches, not per instruction; instructions (bench/instructions.py) are the measure that
such a host does not move.
Standard library only; nothing of stallwatch is imported.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

_TABLE = {i: str(i) for i in range(100)}


def _op() -> int:
    n = 0
    for k, v in _TABLE.items():
        n += k + len(v)
    return n


def _median_us(gap_s: float, samples: int) -> float:
    out = []
    for _ in range(samples):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.thread_time()
        _op()
        out.append((time.thread_time() - t0) * 1e6)
    return statistics.median(out)


_PAGE_BYTES = 4096
_PAGES = 256  # 1 MiB: a tick's worth of Python objects, modules and library pages


def _pages_after(gap_s: float, buf: bytearray) -> tuple[float, int]:
    """CPU microseconds per page of one write to each page of `buf` after `gap_s` of sleep,
    and the guest's page faults (minor + major) during those writes."""
    time.sleep(gap_s)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.thread_time()
    for i in range(0, len(buf), _PAGE_BYTES):
        buf[i] = (buf[i] + 1) & 0xFF
    us = (time.thread_time() - t0) * 1e6
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    faults = (r1.ru_minflt - r0.ru_minflt) + (r1.ru_majflt - r0.ru_majflt)
    return us / (len(buf) // _PAGE_BYTES), faults


def measure_pages(samples: int = 3) -> dict[str, Any]:
    """Median CPU microseconds per already-written page touched back to back and after 1 s, and
    the guest page faults seen in the 1 s samples (0 with a cost: the host's doing)."""
    buf = bytearray(b"\1" * (_PAGES * _PAGE_BYTES))  # written once: resident for the guest
    hot = [_pages_after(0, buf)[0] for _ in range(max(samples, 5))]
    cold = [_pages_after(1.0, buf) for _ in range(samples)]
    return {"page_hot_us": round(statistics.median(hot), 2),
            "page_after_1s_us": round(statistics.median(c[0] for c in cold), 2),
            "page_faults_after_1s": sum(c[1] for c in cold), "pages": _PAGES}


def measure(samples: int = 6) -> dict[str, Any]:
    """Median CPU microseconds of the same operation back to back, after 0.1 s and after 1 s."""
    _median_us(0, 50)  # warm: the first calls pay for allocation, not for the host
    hot = _median_us(0, max(samples, 20))
    after_100ms = _median_us(0.1, samples)
    after_1s = _median_us(1.0, samples)
    hot, after_1s = round(hot, 1), round(after_1s, 1)  # the factor is of the numbers shown
    return {"hot_us": hot, "after_0.1s_us": round(after_100ms, 1), "after_1s_us": after_1s,
            "factor_1s": round(after_1s / hot, 1) if hot else None, "samples": samples,
            **measure_pages(max(1, samples // 2))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=6)
    print(json.dumps(measure(ap.parse_args().samples)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
