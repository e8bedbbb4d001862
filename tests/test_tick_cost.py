"""What a steady tick no longer does (issue 17), and that what it skips is still seen in time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from stallwatch.daemon import jobrun as job_module
from stallwatch.daemon.config import load_config
from stallwatch.daemon.core import Daemon
from stallwatch.daemon.state import StateDB
from stallwatch.kernel import safefs
from stallwatch.probes.base import DeadlineRunner

from rigs import wait_until


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)


def test_the_pid_file_is_reread_while_its_process_lives_only_every_recheck(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(job_module, "PID_FILE_RECHECK_S", 1.0)
    pid_file = tmp_path / "job.pid"
    reads: list[float] = []
    real_open = safefs.open_file

    def counting_open(path, *a, **kw):
        if Path(path) == pid_file:
            reads.append(time.monotonic())
        return real_open(path, *a, **kw)

    monkeypatch.setattr(safefs, "open_file", counting_open)
    batches: list[tuple[str, ...]] = []  # the names of each batch handed to the probe lane
    real_call_many = DeadlineRunner.call_many

    def recording_call_many(self, calls):
        batches.append(tuple(c[0] for c in calls))
        return real_call_many(self, calls)

    monkeypatch.setattr(DeadlineRunner, "call_many", recording_call_many)
    first, second, third = _sleeper(), _sleeper(), _sleeper()
    pid_file.write_text(f"{first.pid}\n")
    cfg = tmp_path / "sw.toml"
    cfg.write_text(f'[daemon]\ninterval_s = 0.1\nstate_dir = "state"\n\n'
                   f'[[job]]\nname = "j"\npid_file = "{pid_file}"\n')
    cfg.chmod(0o644)
    d = Daemon(load_config(cfg), gpu=False)
    t = threading.Thread(target=d.run, name="daemon")
    t.start()

    def pid() -> int | None:
        db = StateDB.open_readonly(tmp_path / "state")
        try:
            return (db.job("j") or {}).get("pid")
        finally:
            db.close()

    try:
        assert d.started.wait(30)
        wait_until(lambda: pid() == first.pid, 20, "the first process adopted")
        ticks0, reads0, t0, batches0 = d.ticks, len(reads), time.monotonic(), len(batches)
        wait_until(lambda: d.ticks - ticks0 >= 20, 30, "20 ticks")
        ticks, wall_s = d.ticks - ticks0, time.monotonic() - t0
        # Once a second (the recheck), not once a tick (10 a second).
        assert len(reads) - reads0 <= wall_s / 1.0 + 2, (len(reads) - reads0, ticks, wall_s)
        # While its process lives, the re-check rides the probes' batch: no handoff of its own.
        alive = batches[batches0:]
        assert ("pid_file-j",) not in alive, alive
        assert any("pid_file-j" in b and "processes" in b for b in alive), alive
        # A new pid while the old process lives: adopted at the next recheck.
        pid_file.write_text(f"{second.pid}\n")
        wait_until(lambda: pid() == second.pid, 10, "the second process adopted")
        # The process gone: the file is read again on the next tick, not a recheck later.
        monkeypatch.setattr(job_module, "PID_FILE_RECHECK_S", 3600.0)
        pid_file.write_text(f"{third.pid}\n")
        second.kill()
        second.wait(10)
        wait_until(lambda: pid() == third.pid, 10, "the third process adopted after the second died")
    finally:
        d.request_stop()
        t.join(30)
        for p in (first, second, third):
            p.kill()


def test_a_hot_output_closed_after_writing_is_restated_at_the_slow_cadence(tmp_path: Path,
                                                                           monkeypatch) -> None:
    from stallwatch.clock import FakeClock
    from stallwatch.probes import outputs as outputs_mod

    out = tmp_path / "out"
    out.mkdir()
    clock = FakeClock(monotonic=1000.0, wall=time.time())
    probe = outputs_mod.OutputsProbe(out, clock=clock)
    stats: list[str] = []
    real = outputs_mod.os.lstat
    monkeypatch.setattr(outputs_mod.os, "lstat",
                        lambda p, *a, **kw: stats.append(os.path.basename(p)) or real(p, *a, **kw))

    def collect_until(cond) -> outputs_mod.OutputsObs:
        deadline = time.monotonic() + 10
        while True:
            o = probe.collect()
            if cond(o):
                return o
            assert time.monotonic() < deadline, o
            time.sleep(0.01)

    try:
        probe.collect()
        (out / "done.bin").write_bytes(b"x" * 10)  # written and closed
        kept = open(out / "open.bin", "wb")  # noqa: SIM115 - kept open across collects
        kept.write(b"y" * 5)
        kept.flush()
        collect_until(lambda o: o.total_bytes == 15)
        stats.clear()
        for _ in range(4):
            clock.advance(1.0)
            probe.collect()
        # The file being written: every tick; the closed one: not within HOT_SLOW_EVERY_S.
        assert stats.count("open.bin") == 4 and stats.count("done.bin") == 0, stats
        # Written again in place with no event we listen to (opened, never closed yet): seen
        # at the slow cadence, and fresh again from then on.
        again = open(out / "done.bin", "ab")  # noqa: SIM115 - held open across ticks on purpose (opened, never closed yet)
        again.write(b"z" * 90)
        again.flush()
        clock.advance(outputs_mod.HOT_SLOW_EVERY_S)
        assert probe.collect().total_bytes == 105
        stats.clear()
        clock.advance(1.0)
        probe.collect()
        assert stats.count("done.bin") == 1
        again.close()
        kept.close()
    finally:
        probe.close()


def test_probes_that_cannot_block_run_inline_and_still_report(monkeypatch) -> None:
    from stallwatch.clock import FakeClock
    from stallwatch.kernel.nvml import OK, Nvml
    from stallwatch.probes.collector import Collector
    from stallwatch.probes.targets import Target

    clock = FakeClock()
    nv = Nvml(clock=clock)
    if nv.init() == OK:
        import pytest

        pytest.skip("NVML works here: the gpu probe must use its worker")
    assert nv.idle()
    clock.advance(61.0)  # a retry is due: the next init may load a driver, which can hang
    assert not nv.idle()
    if not os.access("/dev/kmsg", os.R_OK):
        import pytest

        pytest.skip("/dev/kmsg unreadable (not root): the kmsg probe stays in its worker")
    # Its own NVML session (not the process-wide one other tests may have tried already): a
    # retry is due, so the first tick tries it in a worker, and the next ones need not.
    c = Collector(Target(name="x", pids=(os.getpid(),)), gpu=True, nvml=nv)
    handed: list[list[str]] = []
    real = c.runner.call_many
    monkeypatch.setattr(c.runner, "call_many",
                        lambda calls: handed.append([n for n, _, _ in calls]) or real(calls))
    try:
        snaps = [c.tick() for _ in range(3)]
    finally:
        c.close()
    assert len(handed) == 3  # one batch a tick, disks last in it (it needs the processes)
    assert "kmsg" in handed[0] and "gpu" in handed[0]  # not open, not tried yet: the lane
    assert handed[1:] == [["processes", "disks"], ["processes", "disks"]], handed
    for s in snaps:
        assert [r.name for r in s.probes] == ["processes", "gpu", "kmsg", "disks"]
        assert s.kernel is not None and s.kernel.status == "ok" and s.gpu is not None


def test_dev_shm_on_tmpfs_is_read_inline_and_still_reported(tmp_path: Path, monkeypatch) -> None:
    import pytest

    from stallwatch.kernel.diskfs import mount_for_path, parse_mountinfo
    from stallwatch.probes import disks

    here = mount_for_path(parse_mountinfo(Path("/proc/self/mountinfo").read_text()), "/dev/shm")
    if here is None or here.mount_point != "/dev/shm" or here.fs_type != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs mount here: it stays in its worker")
    probe = disks.DisksProbe([str(tmp_path)], dev_shm="/dev/shm")
    handed: list[str] = []
    real = probe._lane.start
    monkeypatch.setattr(probe._lane, "start", lambda calls: handed.extend(c.name for c in calls) or real(calls))
    try:
        obs = [probe.collect() for _ in range(3)]
    finally:
        probe.close()
    # The first collect has no mountinfo yet: a thread; then inline. The other path: a thread.
    assert handed.count("/dev/shm") == 1 and handed.count(str(tmp_path)) == 3, handed
    for o in obs:
        shm, = [u for u in o.paths if u.kind == "dev_shm"]
        assert shm.status == "ok" and shm.shm_segments is not None and shm.total_bytes


def test_a_paths_realpath_is_reused_until_its_filesystem_changes(tmp_path: Path, monkeypatch) -> None:
    """realpath walks every component with lstat; it is re-done only when statvfs of the path
    lands on another filesystem (or after RESOLVE_TTL_S): a link moved to another mount is seen
    on the next collect."""
    import os
    import uuid

    import pytest

    from stallwatch.probes import disks

    other = Path("/dev/shm") / f"lane-{uuid.uuid4().hex[:8]}"
    if not Path("/dev/shm").is_dir() or os.statvfs("/dev/shm").f_fsid == os.statvfs(tmp_path).f_fsid:
        pytest.skip("needs /dev/shm on a filesystem other than the test's tmp dir")
    here = tmp_path / "data"
    here.mkdir()
    link = tmp_path / "out"
    link.symlink_to(here)
    walks: list[str] = []
    real = os.path.realpath
    monkeypatch.setattr(disks.os.path, "realpath", lambda p, *a, **k: walks.append(p) or real(p, *a, **k))
    probe = disks.DisksProbe([link], dev_shm=None)
    other.mkdir()
    try:
        for _ in range(3):
            (entry,) = probe.collect().paths
            assert entry.status == "ok" and entry.resolved_path == str(here)
        assert walks.count(str(link)) == 1, walks  # resolved once, then reused
        link.unlink()
        link.symlink_to(other)  # the job points it at another filesystem
        (entry,) = probe.collect().paths
        assert entry.resolved_path == str(other) and entry.mount.fs_type == "tmpfs"
        assert walks.count(str(link)) == 2
    finally:
        probe.close()
        other.rmdir()
