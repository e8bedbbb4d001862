"""A job whose progress reached its total and that then does not exit, live: a real process and
the real collector beside a CPU hog, evaluated tick by tick with every rule's `for` as the daemon
does. It is healthy and "exiting" within the exit grace (features_job.EXIT_GRACE_S, shortened
here), busy and then asleep, and hang by `not_exiting` once the grace and `for` are over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from rigs import spawned, wait_until

import stallwatch.engine.features as feat
import stallwatch.engine.features_job as feat_job
from stallwatch.engine import Evaluator
from stallwatch.engine.diagnose import load
from stallwatch.engine.features import features
from stallwatch.probes.collector import Collector
from stallwatch.probes.targets import Target

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

TOTAL = 30
GRACE_S = 10.0      # the exit grace for this test (120 s in production)
WINDOW_S = 4.0      # activity.working's window (10 s in production): the last write ages out sooner
BUSY_S = 4.0        # the job spins this long after "Done" (joining writers under load), then sleeps
DEADLINE_S = 90.0   # for hang after the last progress, on a loaded machine

# Progress every 50 ms to TOTAL, "Done", a busy exit of BUSY_S (its own clock), then asleep
# for good: a teardown that never returns.
JOB = f"""
import sys, threading, time
out = open(sys.argv[1], "a", buffering=1)
for n in range(1, {TOTAL} + 1):
    out.write(f"processed {{n}}/{TOTAL} items\\n")
    time.sleep(0.05)
out.write("Done\\n")
end = time.monotonic() + {BUSY_S}
while time.monotonic() < end:
    pass
threading.Event().wait()
"""
HOG = "while True: pass"


def test_finished_job_is_healthy_exiting_then_hang_not_exiting(tmp_path, monkeypatch):
    monkeypatch.setattr(feat_job, "EXIT_GRACE_S", GRACE_S)
    monkeypatch.setattr(feat, "ACTIVITY_WINDOW_S", WINDOW_S)
    log = tmp_path / "job.log"
    cpu = min(os.sched_getaffinity(0))  # job and hog share one core: the exit runs under load
    pin = {"preexec_fn": lambda: os.sched_setaffinity(0, {cpu})}
    with spawned([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL, **pin), \
         spawned([sys.executable, "-c", JOB, str(log)], stdin=subprocess.DEVNULL, **pin) as proc:
        wait_until(lambda: log.exists() and "processed 3/" in log.read_text(), 30, "progress")
        c = Collector(Target(pids=[proc.pid], log=log))
        ev = Evaluator(load())
        # (idle_s, verdict kind, rule, running threads, summary) per tick
        seen: list[tuple[float, str, str, int, str]] = []
        try:
            deadline = time.monotonic() + DEADLINE_S + 30
            while not (seen and seen[-1][1] == "hang"):
                assert time.monotonic() < deadline, seen
                snap = c.tick()
                v = features(snap)
                e = ev.evaluate(v, snap.t_mono)
                seen.append((v["log"]["idle_s"] if v["log"]["complete"] else -1.0, e.verdict.kind,
                             e.verdict.rule or "", v["proc"]["running"], e.verdict.summary))
                time.sleep(0.5)
        finally:
            c.close()
    timeline = "\n".join(f"idle {i:6.1f} s  {k:8} {r:12} R={n} {s}" for i, k, r, n, s in seen)
    print(timeline)  # the verdict timeline, for the report (-s)
    assert "unknown" not in [k for _, k, _, _, _ in seen], timeline
    after = [x for x in seen if x[0] >= 0]  # ticks after the last progress line (complete)
    exiting = [x for x in after if x[1] == "healthy"]
    assert exiting, timeline
    # Within the grace: healthy, and it says so; spinning past the cadence threshold is no hang.
    assert all(x[1] == "healthy" for x in after if x[0] < GRACE_S), timeline
    for x in exiting:
        text = x[4]
        if text.startswith("until "):  # past the grace, kept firing (keep_firing_for): said so
            assert x[0] >= GRACE_S, timeline
            assert text.endswith(" (no longer holds; kept firing up to 3 s)"), timeline
            text = text.split(" s ago: ", 1)[1].rsplit(" (no longer holds", 1)[0]
        assert f"reached the end of its progress ({TOTAL}/{TOTAL}) " in text, timeline
        assert text.endswith(" s ago: exiting, or starting its next stage"), timeline
    assert any(x[3] > 0 for x in exiting), f"no tick saw the busy exit\n{timeline}"
    # Past it: hang by not_exiting, saying what it saw: the end reached, no exit, no next stage.
    kind, rule, summary = seen[-1][1], seen[-1][2], seen[-1][4]
    assert (kind, rule) == ("hang", "not_exiting"), timeline
    assert GRACE_S <= seen[-1][0] <= DEADLINE_S, timeline
    assert f"reached the end of its progress ({TOTAL}/{TOTAL}) " in summary
    assert "s ago and has neither exited nor shown a next stage: " in summary
    assert summary.endswith(": every thread asleep"), summary


def test_an_early_bar_at_its_end_is_not_called_the_work_done(tmp_path):
    # SGLang and transformers print a bar that ends long before the job's work does (a model's
    # shards loaded); a job stuck right after it is at the end of *a* progress, which the words
    # must not call finished work (and recovery restarts it as any hang: docs/runbooks/hang.md).
    log = tmp_path / "job.log"
    log.write_text("Loading safetensors checkpoint shards: 100% Completed | 4/4 [00:02<00:00,  1.50it/s]\n")
    with spawned([sys.executable, "-c", "import threading; threading.Event().wait()"]) as p:
        out = subprocess.run([sys.executable, "-m", "stallwatch", "diagnose", "--pid", str(p.pid),
                              "--log", str(log), "--window", "1", "--json"],
                             capture_output=True, text=True, timeout=120)
    v = json.loads(out.stdout)["verdict"]
    assert v["kind"] == "healthy", v
    assert "reached the end of its progress (4/4)" in v["summary"], v["summary"]
    assert v["summary"].endswith(": exiting, or starting its next stage"), v["summary"]
    assert "work" not in v["summary"] and "finished" not in v["summary"], v["summary"]
