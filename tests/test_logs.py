"""The log probe on real files in tmp_path, timed with a FakeClock (no sleeps)."""

from __future__ import annotations

import os
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest

from stallwatch.clock import FakeClock
from stallwatch.probes.base import DeadlineRunner, ProbeStatus
from stallwatch.probes.log import LogObs, LogProbe


def bar(i: int, total: int = 100, elapsed: int | None = None, rate: str = " 1.00it/s") -> str:
    e = i if elapsed is None else elapsed
    return f"Gen: {i * 100 // total:3d}%|#| {i}/{total} [{e // 60:02d}:{e % 60:02d}<00:00, {rate}, processed={i}]"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(monotonic=1000.0, wall=time.time())


def append(path, text: str | bytes) -> None:
    with open(path, "ab") as f:
        f.write(text.encode() if isinstance(text, str) else text)


def test_appends_across_ticks_idle_and_cadence(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "loading model\n")
    probe = LogProbe(log, clock=clock)
    o = probe.collect()
    assert o.status == ProbeStatus.ok and o.progress is None and o.idle_s is None
    assert o.tail == ("loading model",)
    for i in range(1, 8):
        clock.advance(10)
        append(log, f"sample {i}/100\n")
        o = probe.collect()
        assert o.progress.done == i and o.idle_s == 0.0 and o.idle_source == "observed"
    assert o.progress_changes == 7 and o.progress_events == 7
    # the first change had nothing to measure against; the next six were 10 s apart
    assert o.cadence_s.median_s == 10.0 and o.cadence_s.max_s == 10.0 and o.cadence_s.source == "observed"
    assert o.rate_per_s == pytest.approx(0.1)
    assert o.eta_s == pytest.approx(93 / 0.1)
    clock.advance(25)
    o = probe.collect()
    assert o.read_bytes == 0 and o.idle_s == 25.0
    assert o.rate_per_s < 0.1  # the measured rate decays while nothing moves


def test_same_done_is_an_event_not_a_change(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "step 5/10\n")
    probe = LogProbe(log, clock=clock)
    probe.collect()
    clock.advance(30)
    append(log, "step 5/10 (retrying)\n")
    o = probe.collect()
    assert o.progress_events == 2 and o.progress_changes == 1 and o.idle_s == 30.0


def test_partial_line_waits_for_its_end(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "")
    probe = LogProbe(log, clock=clock)
    probe.collect()
    append(log, "step 5/1")  # cut mid-number: must not read as 5/1 (nor anything)
    o = probe.collect()
    assert o.progress is None and o.tail == ("step 5/1",)
    append(log, "0\n")
    o = probe.collect()
    assert (o.progress.done, o.progress.total) == (5, 10) and o.tail == ("step 5/10",)


def test_tqdm_newest_bar_read_before_its_terminator_and_counted_once(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "")
    probe = LogProbe(log, clock=clock)
    probe.collect()
    append(log, "\r" + bar(1))
    o = probe.collect()
    assert o.progress.done == 1 and o.progress_events == 1
    clock.advance(5)
    append(log, "\r" + bar(2) + "\r" + bar(3))
    o = probe.collect()
    assert o.progress.done == 3 and o.progress_events == 3 and o.progress_changes == 3
    # redraws collapse into the one line a terminal would show
    assert o.tail == (bar(3),)
    clock.advance(5)
    append(log, "\n")  # tqdm's close: the same bar, now terminated
    o = probe.collect()
    assert o.progress_events == 3 and o.idle_s == 5.0


def test_rotation_by_rename_and_recreate(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "sample 1/10\n")
    probe = LogProbe(log, clock=clock)
    probe.collect()
    os.rename(log, tmp_path / "job.log.1")
    append(log, "sample 2/10\n")
    clock.advance(1)
    o = probe.collect()
    assert o.rotations == 1 and o.progress.done == 2 and o.offset_bytes == len("sample 2/10\n")


def test_truncation_restarts_at_zero(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "x" * 100 + "\nsample 1/10\n")
    probe = LogProbe(log, clock=clock)
    probe.collect()
    with open(log, "wb") as f:
        f.write(b"sample 2/10\n")
    o = probe.collect()
    assert o.truncations == 1 and o.progress.done == 2 and o.rotations == 0


def test_copytruncate_refilled_past_our_offset(tmp_path, clock):
    # logrotate copytruncate, then the job (O_APPEND) writes more than we had read before we look:
    # size alone cannot tell; the bytes before our offset can.
    log = tmp_path / "job.log"
    append(log, "sample 1/10\n")
    probe = LogProbe(log, clock=clock)
    probe.collect()
    shutil.copyfile(log, tmp_path / "job.log.1")
    os.truncate(log, 0)
    append(log, "new run started, much longer than before\nsample 2/10\n")
    o = probe.collect()
    assert o.truncations == 1 and o.progress.done == 2
    assert "new run started, much longer than before" in o.tail


def test_copytruncate_with_non_append_writer_skips_the_hole(tmp_path, clock):
    # A writer without O_APPEND keeps its offset: the file restarts as a hole of NULs up to it.
    log = tmp_path / "job.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"y" * (1 << 20) + b"\nsample 1/10\n")
    probe = LogProbe(log, clock=clock, initial_tail_bytes=64)
    probe.collect()
    os.truncate(log, 0)
    os.write(fd, b"sample 2/10\n")  # lands at offset ~1 MiB
    os.close(fd)
    o = probe.collect()
    assert o.truncations == 1 and o.progress.done == 2
    assert o.read_bytes < 1 << 20  # SEEK_DATA jumped the hole: no MiB of zeros read
    assert all("\x00" not in line for line in o.tail)


def test_runaway_line_keeps_memory_bounded(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "")
    probe = LogProbe(log, clock=clock, max_line_bytes=64 * 1024)
    probe.collect()
    block = b"z" * (1 << 20)
    with open(log, "ab") as f:
        for _ in range(100):  # 100 MiB with no separator, real bytes (a hole would be skipped)
            f.write(block)
    del block
    tracemalloc.start()
    try:
        for _ in range(40):
            o = probe.collect()
            if o.backlog_bytes == 0:
                break
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert o.backlog_bytes == 0 and o.offset_bytes == 100 << 20
    assert peak < 8 << 20, f"peak {peak} bytes while following a 100 MiB line"
    assert len(probe.follower._partial) <= 64 * 1024
    # 100 MiB is more than 4 tick budgets (8 MiB): all but the newest 2 MiB were jumped over,
    # mid-line, so the rest of that line is dropped up to its end.
    assert o.skipped_backlog_bytes == 98 << 20
    append(log, "\nsample 5/10\n")
    o = probe.collect()
    assert o.progress.done == 5 and o.tail[-1] == "sample 5/10"
    assert not any(line.startswith("z") for line in o.tail)


def test_chunk_budget_and_cost_of_new_bytes_only(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "")
    probe = LogProbe(log, clock=clock, chunk_budget_bytes=1 << 20)
    probe.collect()
    append(log, ("filler line\n" * 200_000) + "sample 9/10\n")  # ~2.4 MB
    o = probe.collect()
    assert o.read_bytes == 1 << 20 and o.backlog_bytes > 0
    while o.backlog_bytes:
        o = probe.collect()
    assert o.progress.done == 9
    o = probe.collect()
    assert o.read_bytes == 0


def test_binary_garbage(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, os.urandom(200_000) + b"\nsample 3/10\n\xff\xfe\x00broken\n")
    o = LogProbe(log, clock=clock).collect()
    assert o.status == ProbeStatus.ok and o.progress.done == 3
    assert "\ufffd\ufffdbroken" in o.tail
    LogObs.model_validate_json(o.model_dump_json())


def test_deleted_log_keeps_state_and_waits(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "sample 4/10\n")
    probe = LogProbe(log, clock=clock)
    probe.collect()
    clock.advance(1)
    append(log, "sample 5/10\n")
    probe.collect()
    log.unlink()
    clock.advance(40)
    o = probe.collect()
    assert o.status == ProbeStatus.absent and o.progress.done == 5 and o.idle_s == 40.0
    assert o.size_bytes is None and "does not exist" in o.error
    append(log, "sample 6/10\n")
    o = probe.collect()
    assert o.status == ProbeStatus.ok and o.rotations == 1 and o.progress.done == 6 and o.idle_s == 0


def test_missing_from_the_start(tmp_path, clock):
    o = LogProbe(tmp_path / "nope" / "job.log", clock=clock).collect()
    assert o.status == ProbeStatus.absent and o.progress is None


def test_directory_in_place_of_the_log(tmp_path, clock):
    log = tmp_path / "job.log"
    log.mkdir()
    o = LogProbe(log, clock=clock).collect()
    assert o.status == ProbeStatus.not_a_file and "directory" in o.error


def test_fifo_in_place_of_the_log_does_not_block(tmp_path, clock):
    log = tmp_path / "job.log"
    os.mkfifo(log)
    o = LogProbe(log, clock=clock).collect()
    assert o.status == ProbeStatus.not_a_file


def test_history_idle_from_mtime_when_progress_was_last(tmp_path, clock):
    log = tmp_path / "job.log"
    lines = "".join(f"\r{bar(i, 1000, elapsed=i * 2, rate='0.50it/s')}" for i in range(1, 50))
    append(log, "x" * 5000 + "\n" + lines)
    t = time.time() - 100
    os.utime(log, (t, t))
    o = LogProbe(log, clock=clock, initial_tail_bytes=4096).collect()
    assert o.offset_bytes == log.stat().st_size and o.read_bytes <= 4096
    assert o.progress.done == 49 and o.idle_source == "mtime"
    assert o.idle_s == pytest.approx(100, abs=2)
    assert o.last_growth_age_s == pytest.approx(100, abs=2)
    # tqdm's elapsed field between redraws of one bar: 2 s each
    assert o.cadence_s.source == "tqdm_elapsed" and o.cadence_s.median_s == 2.0


def test_history_lower_bound_when_other_lines_follow(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "sample 3/10\nsaving checkpoint...\n")
    t = time.time() - 50
    os.utime(log, (t, t))
    o = LogProbe(log, clock=clock).collect()
    assert o.idle_source == "mtime_lower_bound" and o.idle_s == pytest.approx(50, abs=2)


def test_history_cadence_from_tqdm_rate(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "\r" + bar(7, rate="300.00s/it"))
    o = LogProbe(log, clock=clock).collect()
    assert o.cadence_s.source == "tqdm_rate" and o.cadence_s.median_s == pytest.approx(300)
    assert o.eta_s == pytest.approx(93 * 300)


def test_history_estimates_leave_the_ring_as_measurements_arrive(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "\r" + bar(7, rate="300.00s/it"))
    probe = LogProbe(log, clock=clock)
    probe.collect()
    clock.advance(2)
    append(log, "\r" + bar(8, rate="300.00s/it"))
    assert probe.collect().cadence_s.source == "mixed"


def test_initial_tail_starting_exactly_at_a_line_keeps_that_line(tmp_path, clock):
    log = tmp_path / "job.log"
    head = b"a" * 99 + b"\n"
    append(log, head + b"sample 1/2\n")
    o = LogProbe(log, clock=clock, initial_tail_bytes=len("sample 1/2\n")).collect()
    assert o.progress.done == 1 and o.tail == ("sample 1/2",)


def test_traceback_at_the_end_and_cleared_by_progress(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "sample 1/10\n")
    probe = LogProbe(log, clock=clock)
    probe.collect()
    append(log, (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "    f()\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
        "Killed\n"
    ))
    o = probe.collect()
    assert o.traceback.exception_type == "RuntimeError" and o.tracebacks_seen == 1
    assert [f.kind for f in o.fatal] == ["cuda_error", "killed"]
    assert o.tail[-1] == "Killed"
    append(log, "sample 2/10\n")  # it was caught and logged: the job went on
    o = probe.collect()
    assert o.traceback is None and o.fatal == () and o.tracebacks_seen == 1


def test_unchanged_bar_after_traceback_keeps_it(tmp_path, clock):
    # tqdm redraws its last bar when the exception unwinds through it: not progress.
    log = tmp_path / "job.log"
    append(log, bar(3) + "\nTraceback (most recent call last):\n  File \"a\", line 1\nValueError: x\n" + bar(3) + "\n")
    o = LogProbe(log, clock=clock).collect()
    assert o.traceback is not None and o.traceback.exception == "ValueError: x"


def test_user_regex_and_bad_regex(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "wrote 12 of 40\n" + bar(3) + "\n")
    o = LogProbe(log, progress_regex=r"wrote (?P<done>\d+) of (?P<total>\d+)", clock=clock).collect()
    assert (o.progress.done, o.progress.total, o.progress.source) == (12, 40, "regex")
    with pytest.raises(ValueError, match="done"):
        LogProbe(log, progress_regex=r"(\d+)/(\d+)")


def test_tail_lines_and_truncation(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "".join(f"line {i}\n" for i in range(50)) + "w" * 5000 + "\n")
    o = LogProbe(log, clock=clock, tail_lines=5).collect()
    assert o.tail[:4] == ("line 46", "line 47", "line 48", "line 49")
    assert len(o.tail) == 5 and len(o.tail[-1]) == LogProbe.TAIL_LINE_CHARS


def test_obs_json_round_trip(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "\r" + bar(3) + "\nTraceback (most recent call last):\n  x\n")
    append(log, "OSError: [Errno 28] No space left on device\n")
    o = LogProbe(log, clock=clock).collect()
    again = LogObs.model_validate_json(o.model_dump_json())
    assert again == o and again.fatal[0].kind == "disk_full"


def test_runs_under_the_deadline_runner(tmp_path, clock):
    log = tmp_path / "job.log"
    append(log, "sample 1/2\n")
    probe = LogProbe(log, clock=clock, name="log:extract")
    obs, report = DeadlineRunner().call(probe.name, probe.collect, 5.0)
    assert report.status == ProbeStatus.ok and report.name == "log:extract" and obs.progress.done == 1


def test_new_run_forgets_the_old_runs_rhythm(tmp_path, clock):
    """A restarted job: the downtime is not a cadence interval, and its silence starts now."""
    log = tmp_path / "job.log"
    probe = LogProbe(log, clock=clock)
    append(log, "sample 0/100\n")
    probe.collect()
    for i in range(1, 8):
        clock.advance(1)
        append(log, f"sample {i}/100\n")
        probe.collect()
    clock.advance(300)  # the job hung, was killed, restarted
    o = probe.collect()
    assert o.idle_s == 300.0 and o.cadence_s.max_s == 1.0
    probe.new_run()
    o = probe.collect()
    assert o.idle_s == 0.0 and o.cadence_s is None and o.rate_per_s is None
    clock.advance(1)
    append(log, "sample 8/100\n")
    o = probe.collect()
    # A one-off 301 s gap would not be learned now anyway (an outlier); new_run() also forgets
    # the old rate and restarts the silence.
    assert o.progress.done == 8 and (o.cadence_s is None or o.cadence_s.max_s <= 1.0)


def _steady(probe, log, clock, start: int, n: int, step_s: float = 1.0) -> LogObs:
    o = None
    for i in range(start, start + n):
        clock.advance(step_s)
        append(log, f"sample {i}/1000\n")
        o = probe.collect()
    return o


def _started(tmp_path, clock) -> tuple[LogProbe, Path]:
    """A probe that has read `sample 0/1000`: the job's first progress line."""
    log = tmp_path / "job.log"
    probe = LogProbe(log, clock=clock)
    append(log, "sample 0/1000\n")
    probe.collect()
    return probe, log


def test_a_one_off_long_gap_is_not_learned_as_rhythm(tmp_path, clock):
    """A stall that ends on its own (a stopped server resumed) must not stretch the next
    stall's threshold: the soak missed 4 of 10 stalls when 2 × that gap became the threshold."""
    probe, log = _started(tmp_path, clock)
    _steady(probe, log, clock, 1, 10)
    clock.advance(45)  # the server was stopped for 45 s, then resumed
    o = _steady(probe, log, clock, 11, 1, step_s=0.0)
    assert o.cadence_s.max_s == 1.0 and o.cadence_s.outliers == 1 and o.cadence_s.last_outlier_s == 45.0
    o = _steady(probe, log, clock, 12, 40)  # the gap would still be inside a 32-interval ring
    assert o.cadence_s.max_s == 1.0 and o.cadence_s.p90_s == 1.0
    from stallwatch.engine.features import stall_threshold_s
    from stallwatch.probes.snapshot import Snapshot
    from stallwatch.probes.targets import Target
    snap = Snapshot(t_mono=clock.monotonic(), t_wall=clock.time(), host="t", target=Target(log=log), log=o)
    t, why = stall_threshold_s(snap)
    assert t == 20.0, why  # the floor, not 2 × 45 s
    assert "left out" in why


def test_a_recurring_long_gap_is_learned_from_its_second_occurrence(tmp_path, clock):
    """An eval every tenth step is rhythm: the second 25 s gap enters the cadence."""
    probe, log = _started(tmp_path, clock)
    _steady(probe, log, clock, 1, 9)
    clock.advance(25)
    o = _steady(probe, log, clock, 10, 1, step_s=0.0)
    assert o.cadence_s.max_s == 1.0  # once: an outlier
    _steady(probe, log, clock, 11, 9)
    clock.advance(24)
    o = _steady(probe, log, clock, 20, 1, step_s=0.0)
    assert o.cadence_s.max_s == 24.0 and o.cadence_s.outliers == 2


def test_a_slower_pace_is_learned(tmp_path, clock):
    """A job that slows from 1 s to 30 s a step: the second slow step is already rhythm."""
    probe, log = _started(tmp_path, clock)
    _steady(probe, log, clock, 1, 10)
    o = _steady(probe, log, clock, 11, 2, step_s=30.0)
    assert o.cadence_s.max_s == 30.0
    o = _steady(probe, log, clock, 13, 10, step_s=30.0)
    assert o.cadence_s.p90_s == 30.0


def test_gaps_far_apart_do_not_count_as_recurring(tmp_path, clock):
    """Two stalls more than a ring's worth of intervals apart are two one-offs."""
    probe, log = _started(tmp_path, clock)
    _steady(probe, log, clock, 1, 10)
    clock.advance(40)
    _steady(probe, log, clock, 11, 1, step_s=0.0)
    _steady(probe, log, clock, 12, LogProbe.CADENCE_RING + 1)
    clock.advance(40)
    o = _steady(probe, log, clock, 100, 1, step_s=0.0)
    assert o.cadence_s.max_s == 1.0 and o.cadence_s.outliers == 2


def test_a_log_growing_faster_than_it_is_read_is_caught_up_not_lagged(tmp_path, clock):
    """Past 4 tick budgets of backlog the follower jumps to the newest bytes: a job that stops
    must not look alive for as long as a flood of old lines takes to read."""
    log = tmp_path / "job.log"
    append(log, "step 1/1000\n")
    probe = LogProbe(log, clock=clock, chunk_budget_bytes=4096)
    assert probe.collect().progress.done == 1
    for i in range(2, 900):  # ~10 KiB: within 4 budgets (16 KiB), read in slices
        append(log, f"step {i}/1000\n")
    clock.advance(1)
    o = probe.collect()
    assert o.skipped_backlog_bytes == 0 and o.backlog_bytes > 0 and o.progress.done < 899
    append(log, "".join(f"debug line {i} " + "x" * 80 + "\n" for i in range(2000)))  # ~190 KiB
    append(log, "step 900/1000\n")
    clock.advance(1)
    o = probe.collect()
    assert o.progress.done == 900 and o.backlog_bytes == 0
    assert o.skipped_backlog_bytes > 150_000
    assert all(not line.startswith("step") or line == "step 900/1000" for line in o.tail[-3:])


def test_a_log_symlinked_elsewhere_or_unreadable_to_its_user_is_refused(tmp_path: Path) -> None:
    """security.md #5: the job's user replaced its log with a symlink to a root-only file; the
    probe read that file and its last line reached the alerts."""
    secret = tmp_path / "secret"
    secret.write_text("AWS_SECRET_ACCESS_KEY=abc\n")
    secret.chmod(0o600)
    log = tmp_path / "job.log"
    log.write_text("step 1/10\n")
    probe = LogProbe(log, clock=FakeClock(), reader=(65534, frozenset({65534})))
    log.chmod(0o644)
    assert probe.collect().status == ProbeStatus.ok
    log.unlink()
    os.symlink(secret, log)
    o = probe.collect()
    assert o.status == ProbeStatus.denied and "symlink: not followed" in (o.error or "")
    assert all("AWS" not in line for line in o.tail)
    log.unlink()
    os.link(secret, log)  # what fs.protected_hardlinks stops for a user; root can show it
    o = probe.collect()
    assert o.status == ProbeStatus.denied and "cannot read: refused" in (o.error or "")
    assert all("AWS" not in line for line in o.tail)


def test_split_lines_read_as_each_line_through_end_line(tmp_path):
    """LogFollower._feed splits a read of one separator kind in C and takes a clean line as it
    is: random reads (\\r or \\n only, both, escapes, controls, invalid UTF-8, lines over the
    limit, a cut first line) give the lines, meta, partial and counts that _feed_mixed gives."""
    import random

    from stallwatch.probes.logfollow import FollowResult, LogFollower

    rng = random.Random(17)
    alphabet = [b"a", b"b", b" ", b"\r", b"\r", b"\n", b"\x1b[A", b"\x07", b"\xe2\x96\x88", b"\xe2",
                b"12/34 [00:01<00:02, 1.0it/s]"]
    for trial in range(400):
        fast = LogFollower(tmp_path / "x.log", max_line_bytes=rng.choice([4, 16, 64 << 10]))
        slow = LogFollower(tmp_path / "x.log", max_line_bytes=fast.max_line_bytes)
        if trial % 5 == 0:
            fast._dropping = slow._dropping = "cut"
        for _ in range(rng.randint(1, 6)):
            kind = rng.choice(["cr", "nl", "any"])
            parts = [p for p in alphabet if kind == "any" or p not in ({b"\n"} if kind == "cr" else {b"\r"})]
            data = b"".join(rng.choice(parts) for _ in range(rng.randint(0, 30)))
            a, b = FollowResult(ProbeStatus.ok), FollowResult(ProbeStatus.ok)
            fast._feed(data, a)
            slow._feed_mixed(data, b)
            assert (a.lines, a.meta, a.ups) == (b.lines, b.meta, b.ups), data
            assert (bytes(fast._partial), fast._dropping, fast.overlong_lines) == \
                (bytes(slow._partial), slow._dropping, slow.overlong_lines), data
