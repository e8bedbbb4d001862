"""A job stopped by SIGSTOP goes healthy → hang with no `unknown` between: the real process and
the real collector, evaluated tick by tick with every rule's `for` as the daemon does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rigs import spawned, wait_for_state, wait_until

from stallwatch.probes.collector import Collector
from stallwatch.engine.diagnose import load
from stallwatch.engine import Evaluator
from stallwatch.engine.features import features
from stallwatch.probes.targets import Target

JOB = Path(__file__).resolve().parent / "jobs" / "paced.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def test_sigstopped_job_goes_healthy_to_hang_without_unknown(tmp_path):
    log = tmp_path / "job.log"
    argv = [sys.executable, str(JOB), "--log", str(log), "--style", "iso", "--per-s", "10"]
    with spawned(argv, stdin=subprocess.DEVNULL) as proc:
        wait_until(lambda: log.exists() and log.read_text().count("\n") >= 20, 30, "2 s of progress")
        c = Collector(Target(pids=[proc.pid], log=log))
        ev = Evaluator(load())
        kinds: list[tuple[float, str, bool]] = []

        def tick() -> str:
            snap = c.tick()
            v = features(snap)
            e = ev.evaluate(v, snap.t_mono)
            kinds.append((snap.t_mono, e.verdict.kind, v["job"]["stopped"]))
            return e.verdict.kind

        try:
            for _ in range(4):
                assert tick() == "healthy", kinds
                time.sleep(0.25)
            os.kill(proc.pid, signal.SIGSTOP)
            wait_for_state(proc.pid, "T", 10)
            deadline = time.monotonic() + 30
            while tick() != "hang":
                assert time.monotonic() < deadline, kinds
                time.sleep(0.25)
        finally:
            c.close()
            os.kill(proc.pid, signal.SIGCONT)
    seen = [k for _, k, _ in kinds]
    assert "unknown" not in seen, kinds
    stopped_at = next(t for t, _, s in kinds if s)
    # quiet 1 s + `for` 2 s after the stop: hang by the second tick past those 3 s, counted in
    # ticks, not seconds (under -n 3 a tick itself can take over a second; "< 6 s" failed there)
    late = [k for t, k, _ in kinds if t >= stopped_at + 3.0]
    assert late and late[-1] == "hang" and len(late) <= 3, kinds
