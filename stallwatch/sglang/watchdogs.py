"""SGLang's two watchdogs, as the stand-in server runs them (docs/upstream.md §3).

- `HardWatchdog`, in every scheduler process (both shapes): while a batch runs and the forward
  counter has not moved for `--watchdog-timeout`, checked every timeout/2 — so 1x-1.5x the
  timeout after the last forward — it logs the version's line, sleeps 5 s (so the HTTP process
  can log) and SIGQUITs its parent, whose handler kills the tree. A rank that is SIGSTOPped
  stops its own watchdog with it; the ranks waiting on it in a collective are the ones that fire.
  Idle schedulers are never killed (#33858).
- `SubprocessWatchdog`, in the HTTP process (current shape only, #18582 of 2026-03-29): every
  second, a child that is no longer alive is logged
  (`Subprocess scheduler_1 (pid=…) crashed with exit code -9. Triggering SIGQUIT for cleanup...`)
  and the SIGQUIT handler runs: a dead rank takes the whole server down within ~1-2 s.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any
from collections.abc import Callable

from stallwatch.sglang.procutil import flush_logs, logger
from stallwatch.sglang.versions import Shape

KILL_SLEEP_S = 5.0


class HardWatchdog:
    def __init__(self, timeout_s: float, shape: Shape) -> None:
        self.timeout_s = timeout_s
        self.shape = shape
        self.forward_ct = 0  # bumped after every forward step
        self.in_batch = False  # a batch is running (or waiting on the other ranks)

    def start(self) -> None:
        if self.timeout_s > 0:
            threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def _run(self) -> None:
        last_ct, last_t = self.forward_ct, time.monotonic()
        while True:
            time.sleep(max(self.timeout_s / 2, 0.05))
            now = time.monotonic()
            if not self.in_batch:
                # Restarted whenever no batch runs (a precaution of ours): an idle spell never
                # counts against the next batch.
                last_ct, last_t = self.forward_ct, now
            elif self.forward_ct != last_ct:
                last_ct, last_t = self.forward_ct, now
            elif now > last_t + self.timeout_s:
                break
        logger.error(self.shape.watchdog_message(self.timeout_s))
        flush_logs()
        time.sleep(KILL_SLEEP_S)  # "so that the parent process can print the error"
        os.kill(os.getppid(), signal.SIGQUIT)


class SubprocessWatchdog:
    def __init__(self, procs: list[tuple[str, Any]], on_crash: Callable[[], None],
                 stopping: Callable[[], bool], interval_s: float = 1.0) -> None:
        self.procs = procs  # (name, multiprocessing.Process): scheduler_0 ..., detokenizer
        self.on_crash = on_crash
        self.stopping = stopping
        self.interval_s = interval_s

    def start(self) -> None:
        threading.Thread(target=self._run, name="subprocess-watchdog", daemon=True).start()
        logger.info(f"SubprocessMonitor started, monitoring {len(self.procs)} process(es) "
                    f"with {self.interval_s}s interval")

    def _run(self) -> None:
        while not self.stopping():
            for name, p in self.procs:
                if p.exitcode is not None and not self.stopping():
                    logger.error(f"Subprocess {name} (pid={p.pid}) crashed with exit code {p.exitcode}. "
                                 "Triggering SIGQUIT for cleanup...")
                    self.on_crash()
                    return
            time.sleep(self.interval_s)
