#!/usr/bin/env python3
"""A job that logs its own progress lines at a steady pace, in one of the timestamp styles jobs
print, and then (optionally) gets stuck: spins on the CPU or deadlocks. Standard library only.

    python paced.py --log /tmp/j.log --style logging --per-s 20 --stall-at 100 --stall spin

Styles (one progress line per item, `processed N/TOTAL items`, with the line's timestamp):
    iso       2026-12-01T15:21:36.123456+00:00 processed 5/1000000 items
    logging   2026-12-01 15:21:36,123 INFO processed 5/1000000 items   (logging's default asctime)
    bracket   [2026-12-01 15:21:36] processed 5/1000000 items          (SGLang's style)
    hms       15:21:36 processed 5/1000000 items                        (a time of day only)
    epoch     1764602496.123 processed 5/1000000 items
    tqdm      items:   0%|          | 5/1000000 [00:00<13:53:20, 20.00it/s]   (redrawn with \\r)
    plain     processed 5 items                                           (no time, no total)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import datetime, UTC

from pt_writer import deadlock  # two threads, two locks, the main thread joins: all asleep

TOTAL = 1_000_000


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def line_for(style: str, n: int, started: float) -> str:
    now = time.time()
    local = datetime.fromtimestamp(now)
    msg = f"processed {n}/{TOTAL} items"
    if style == "iso":
        return f"{datetime.fromtimestamp(now, UTC).isoformat()} {msg}\n"
    if style == "bracket":
        return f"[{local:%Y-%m-%d %H:%M:%S}] {msg}\n"
    if style == "hms":
        return f"{local:%H:%M:%S} {msg}\n"
    if style == "epoch":
        return f"{now:.3f} {msg}\n"
    if style == "plain":
        return f"processed {n} items\n"
    if style == "tqdm":
        elapsed = now - started
        rate = n / elapsed if elapsed > 0 else 0.0
        left = (TOTAL - n) / rate if rate else 0.0
        return f"\ritems:   0%|          | {n}/{TOTAL} [{_clock(elapsed)}<{_clock(left)}, {rate:.2f}it/s]"
    raise ValueError(style)


def spin() -> None:
    flag = False
    while not flag:  # nobody sets it: runnable forever, no syscalls, no progress
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--style", required=True)
    ap.add_argument("--per-s", type=float, default=20.0)
    ap.add_argument("--stall-at", type=int, default=0)
    ap.add_argument("--stall", choices=("spin", "deadlock"), default="spin")
    a = ap.parse_args()
    out = open(a.log, "a", buffering=1)  # noqa: SIM115 - the job's log, open for the job's life
    log = None
    if a.style == "logging":
        handler = logging.StreamHandler(out)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log = logging.getLogger("paced")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    started = time.time()
    n = 0
    while True:
        n += 1
        if log is not None:
            log.info("processed %d/%d items", n, TOTAL)
        else:
            out.write(line_for(a.style, n, started))
            out.flush()
        if n == a.stall_at:
            (spin if a.stall == "spin" else deadlock)()
        time.sleep(1.0 / a.per_s)


if __name__ == "__main__":
    sys.exit(main())
