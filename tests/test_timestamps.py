"""Log-line timestamps (stallwatch/probes/text/timestamps.py), the pace the log probe learns from them at first
sight, the words features() gives it, and the run-queue tracker (probes/runqueue.py). Pure or on
tmp_path files with a FakeClock: no sleeps."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.clock import FakeClock
from stallwatch.engine.diagnose import load
from stallwatch.engine import Evaluator
from stallwatch.engine.features import features, stall_threshold_s
from stallwatch.probes.log import LogProbe
from stallwatch.probes.processes import ProcessesProbe
from stallwatch.probes.runqueue import RunQueueTracker
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.targets import Target
from stallwatch.probes.text.timestamps import LineTime, gap_s, line_time

# ---------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("line, style, seconds_of_day", [
    ("2026-12-01T15:21:36.123456+00:00 processed 5/100 items", "iso8601", 55296.123456),
    ("2026-12-01T15:21:36Z step 5", "iso8601", 55296.0),
    ("2026-12-01 15:21:36,123 INFO processed 5/100 items", "python_logging", 55296.123),
    ("[2026-12-01 15:21:36] Prefill batch. #new-seq: 1", "bracketed", 55296.0),
    ("[2026-12-01 15:21:36 TP0] Decode batch", "bracketed", 55296.0),
    ("2026-12-01 15:21:36 step 5", "date_time", 55296.0),
    ("[rank0]: 2026-12-01 15:21:36,500 INFO step", "python_logging", 55296.5),
    ("15:21:36 processed 5/100 items", "hms", 55296.0),
    ("[15:21:36] step 5", "hms", 55296.0),
    ("I1201 15:21:36.250000 12345 main.cc:42] step 5", "hms", 55296.25),
    ("1764602496.123 processed 5/100 items", "epoch", None),
    ("[1764602496] step 5", "epoch", None),
])
def test_each_style_is_read(line, style, seconds_of_day):
    t = line_time(line)
    assert t is not None and t.style == style
    if seconds_of_day is not None:
        assert t.t_s % 86400 == pytest.approx(seconds_of_day)
    else:
        assert t.t_s == pytest.approx(float(line.strip("[").split()[0].rstrip("]")))


@pytest.mark.parametrize("line", [
    "items:  49%|####9     | 18380/37312 [1:04:58<5:07:12, 1.03it/s]",  # tqdm's elapsed
    "1234it [1:00:05, 246.80it/s]",
    "processed 5/100 items",
    "loss 12:34 ratio",  # MM:SS-like, two parts
    "step 1764602496",  # a big counter, not at the line's start
    "2026-13-45 15:21:36 not a date",
    "x" * 70 + " 2026-12-01 15:21:36",  # a date deep in the payload is not the line's time
    "version 1.2.3:4:5",
    "step 5/100 eta 0:01:23 left",  # a duration, not a time of day
])
def test_what_is_not_a_timestamp(line):
    assert line_time(line) is None


stampish = st.lists(st.sampled_from(list("0123456789:-.,[] TZ+|<") + ["2026-12-01", "23:59:60",
                                                                     "1764602496", "\x00", "é"]),
                   max_size=40).map("".join)


@settings(max_examples=300, deadline=1000)
@given(stampish, stampish)
def test_random_text_never_raises_and_gaps_are_never_negative(a, b):
    ta, tb = line_time(a), line_time(b)
    if ta is not None and tb is not None:
        g = gap_s(ta, tb)
        assert g is None or g >= 0


def test_gaps_within_one_style_only_and_across_midnight():
    a, b = line_time("23:59:59 x"), line_time("00:00:01 x")
    assert gap_s(a, b) == 2.0
    assert gap_s(LineTime(t_s=10.0, style="hms"), LineTime(t_s=5.0, style="hms")) is None
    assert gap_s(line_time("2026-12-01T00:00:00Z a"), line_time("1764602496 b")) is None
    assert gap_s(line_time("1764602496.5 a"), line_time("1764602497.0 b")) == 0.5


# ------------------------------------------------------------------ the pace from history


def _write(path, lines, mtime):
    path.write_text("".join(lines))
    os.utime(path, (mtime, mtime))


def _snap(clock, log_path, obs) -> Snapshot:
    return Snapshot(t_mono=clock.monotonic(), t_wall=clock.time(), host="t",
                    target=Target(log=log_path), log=obs)


def test_first_sight_learns_the_cadence_and_rate_from_the_lines_timestamps(tmp_path):
    clock = FakeClock(monotonic=1000.0, wall=1_764_600_000.0)
    t0 = 1_764_600_000.0 - 60  # 100 lines at 20 a second, the last one 55 s ago
    lines = [f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t0 + i * 0.05))},"
             f"{round((t0 + i * 0.05) % 1 * 1000):03d} INFO processed {i}/100000 items\n"
             for i in range(1, 101)]
    log = tmp_path / "job.log"
    _write(log, lines, t0 + 100 * 0.05)
    o = LogProbe(log, clock=clock).collect()
    assert o.cadence_s.source == "log_timestamps" and o.cadence_s.max_s <= 0.06
    assert o.history_style == "python_logging" and o.history_lines == 100
    assert o.history_rate_per_s == pytest.approx(20.0, rel=0.05)
    assert o.idle_s == pytest.approx(55.0) and o.idle_source == "mtime"
    snap = _snap(clock, log, o)
    t, why = stall_threshold_s(snap)
    assert t == 20.0 and "from the log's timestamps" in why, why
    v = features(snap)
    assert v["log"]["pace"]["known"] and v["log"]["pace"]["text"] == "~20 a second"
    assert "of the log's timestamps" in v["log"]["pace"]["source"]
    assert not v["log"]["pace"]["recent"]


def test_lines_after_the_last_progress_date_it_by_their_timestamps(tmp_path):
    """A heartbeat logged after progress stopped moves the mtime; the timestamps say how much
    earlier the progress was."""
    clock = FakeClock(monotonic=1000.0, wall=1_764_600_000.0)
    lines = [f"[2026-12-01 10:00:{s:02d}] processed {s}/1000\n" for s in range(10)]
    lines.append("[2026-12-01 10:00:39] WARNING still waiting for the server\n")
    log = tmp_path / "job.log"
    _write(log, lines, 1_764_600_000.0 - 5)  # the heartbeat: 5 s ago
    o = LogProbe(log, clock=clock).collect()
    assert o.idle_source == "mtime_timestamps"
    assert o.idle_s == pytest.approx(5 + 30)  # the heartbeat came 30 s after progress 9


def test_a_new_bar_starts_the_run_the_rate_is_taken_from(tmp_path):
    clock = FakeClock(monotonic=1000.0, wall=1_764_600_000.0)
    old = [f"{1_764_500_000 + i} processed {i}/10\n" for i in range(1, 11)]  # 1 a second
    new = [f"{1_764_599_000 + i * 0.1:.1f} processed {i}/10000\n" for i in range(1, 21)]  # 10/s
    log = tmp_path / "job.log"
    _write(log, old + new, 1_764_599_002.0)
    o = LogProbe(log, clock=clock).collect()
    assert o.history_lines == 20 and o.history_rate_per_s == pytest.approx(10.0, rel=0.01)


def _healthy_words(tmp_path, age_s: float) -> str:
    clock = FakeClock(monotonic=1000.0, wall=1_764_600_000.0)
    end = 1_764_600_000.0 - age_s
    lines = [f"{end - (100 - i) * 0.05:.3f} processed {i}/100000 items\n" for i in range(1, 101)]
    log = tmp_path / "job.log"
    _write(log, lines, end)
    snap = _snap(clock, log, LogProbe(log, clock=clock).collect())
    me = Target(log=log, pids=[os.getpid()])  # a live job: this test's own process
    snap = snap.model_copy(update={"target": me, "processes": ProcessesProbe(me, self_pid=0).collect()})
    ev = Evaluator(load(), ignore_for=True).evaluate(features(snap), snap.t_mono)
    return ev.verdict.kind + ": " + ev.verdict.summary


def test_healthy_says_making_progress_only_when_recent_for_the_pace(tmp_path):
    """At 20 a second, 12 s of silence is not "making progress" although under the 20 s
    threshold: the summary says what is known."""
    kind, _, summary = _healthy_words(tmp_path, 12.0).partition(": ")
    assert kind == "healthy"
    assert "is making progress" not in summary, summary
    assert "shows no progress for 12.0 s; it made ~20 a second before" in summary, summary


def test_a_recent_last_progress_is_making_progress(tmp_path):
    kind, _, summary = _healthy_words(tmp_path, 1.0).partition(": ")
    assert kind == "healthy" and "is making progress: 100/100000" in summary, summary


# ------------------------------------------------------------------------ run-queue tracker


def test_runqueue_a_thread_that_never_leaves_the_run_queue():
    rq = RunQueueTracker(clk_tck=100)
    # 4 samples 0.5 s apart, R each time, voluntary switches unchanged; it got a quarter of a
    # core and waited the rest (a hog on its core).
    obs = None
    for i in range(4):
        obs = rq.step("t1", 10.0 + 0.5 * i, "R", 7, 100 + 12 * i, 0,
                      (int(0.125e9 * i), int(0.375e9 * i)))
    assert obs.samples == 4 and obs.runnable_for_s == pytest.approx(1.5)
    assert obs.cpu_share == pytest.approx(0.25) and obs.wait_share == pytest.approx(0.75)
    assert obs.user_share == 1.0


def test_runqueue_a_sleep_or_a_voluntary_switch_restarts_the_stretch():
    rq = RunQueueTracker(clk_tck=100)
    rq.step("t", 0.0, "R", 1, 0, 0, (0, 0))
    assert rq.step("t", 1.0, "R", 2, 50, 0, (int(5e8), 0)).runnable_for_s == 0.0  # it slept
    assert rq.step("t", 2.0, "S", 2, 60, 0, None).samples == 0
    obs = rq.step("t", 3.0, "R", 2, 70, 0, (int(6e8), 0))
    assert obs.samples == 1 and obs.runnable_for_s == 0.0
