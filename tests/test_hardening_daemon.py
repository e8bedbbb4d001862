"""Hardening: the daemon SIGKILLed at every step of a kill-and-resume.

A failpoint (a monkeypatch in the daemon process, set by SW_FAILPOINT) makes the first daemon
SIGKILL itself right after one step of the recovery of a deadlocked job; a second, plain daemon
takes over from the state database. At every step: never two writers at once, exactly one
restart counted, one run more, the incident resolved once, every output whole, no intent left
pending. tests/test_daemon_live.py covers a kill mid-run and during the backoff; this walks
every step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rigs import wait_until
from daemonkit import Harness, fast_rules, scan_writers

pytestmark = pytest.mark.slow

FAILPOINT = r"""
import os, signal, sys
step = os.environ["SW_FAILPOINT"]

def die(why):
    sys.stderr.write(f"FAILPOINT {step}: SIGKILL {why}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)

import stallwatch.daemon.job as job
import stallwatch.daemon.jobrun as jobrun
import stallwatch.daemon.recovery as rec

if step == "detect":  # the incident is recorded, the recovery not begun
    orig_open = job.JobRunner._open_incident
    def _open(self, *a, **k):
        orig_open(self, *a, **k)
        die("after opening the incident")
    job.JobRunner._open_incident = _open
elif step == "kill:first-signal":  # SIGTERM sent, SIGKILL not yet
    orig_kill = rec.Recovery._kill
    def _kill(self, snap):
        orig_kill(self, snap)
        if self.kill is not None:
            die("after the first kill step")
    rec.Recovery._kill = _kill
elif step.startswith("enter:"):
    phase = step.split(":", 1)[1]
    orig_enter = rec.Recovery._enter
    def _enter(self, p, detail=""):
        orig_enter(self, p, detail)
        if p == phase:
            die(f"on entering {p}")
    rec.Recovery._enter = _enter
elif step in ("spawn:before", "spawn:after"):
    orig_spawn = jobrun.spawn
    def _spawn(name, seq, *a, **k):
        if seq > 1 and step == "spawn:before":
            die("with the restart intent recorded, before the spawn")
        sp = orig_spawn(name, seq, *a, **k)
        if seq > 1:
            die("after the spawn, before its completion was recorded")
        return sp
    jobrun.spawn = _spawn
else:
    raise SystemExit(f"unknown failpoint {step}")

from stallwatch.commands.cli import main
main(sys.argv[1:])
"""

STEPS = ["detect", "enter:kill", "kill:first-signal", "enter:wait_gone", "enter:wait_gpu",
         "enter:validate", "enter:backoff", "enter:restart", "spawn:before", "spawn:after"]


def start_with_failpoint(h: Harness, step: str) -> subprocess.Popen:
    n = len(h.daemons)
    with open(h.dir / f"daemon-{n}.log", "wb") as err:
        p = subprocess.Popen([sys.executable, "-c", FAILPOINT, "run", "--config", str(h.cfg)],
                             stdout=err, stderr=subprocess.STDOUT, cwd=h.dir,
                             env={**os.environ, "SW_FAILPOINT": step})
    h.daemons.append(p)
    return p


class WriterWatch:
    """Samples the job's writers all along: the largest number ever seen at once."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.most = 0
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            w = [p for p, st in scan_writers(self.marker) if st not in "ZX"]
            self.most = max(self.most, len(w))
            self.pids.update(w)
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_every_recovery_step_restarts_exactly_once(step: str, tmp_path: Path) -> None:
    h = Harness(tmp_path)
    watch = WriterWatch(str(tmp_path / "out"))
    try:
        h.write_config(["--count", "12", "--interval", "0.1", "--deadlock-at", "5",
                        "--once", str(tmp_path / "fault-fired")],
                       rules=fast_rules(tmp_path / "rules"),
                       job="max_restarts = 2\nstartup_grace_s = 2")
        first = start_with_failpoint(h, step)
        wait_until(lambda: first.poll() is not None, 60, f"the failpoint {step}")
        assert first.returncode == -9, h.daemon_log(0)[-3000:]
        assert f"FAILPOINT {step}: SIGKILL" in h.daemon_log(0)
        second = h.start()
        h.wait_phase("finished", 90)
        j = h.job()
        assert j["restarts"] == 1, f"{step}: restarts {j['restarts']}"
        assert len(h.q("SELECT * FROM runs")) == 2, h.q("SELECT * FROM runs")
        incs = h.incidents()
        assert [(i["kind"], i["state"]) for i in incs] == [("hang", "resolved")], incs
        assert h.q("SELECT * FROM actions WHERE outcome = 'pending'") == []
        restarts = [a for a in h.actions("restart") if a["outcome"].startswith("started")]
        assert len(restarts) == 1, h.actions("restart")
        h.assert_outputs_complete(12)
        assert h.stop(second) == 0
        watch.stop()
        assert watch.most == 1, f"{step}: {watch.most} writers at once"
        assert len(watch.pids) == 2  # the deadlocked run and the one restart
    finally:
        watch.stop()
        h.cleanup()
