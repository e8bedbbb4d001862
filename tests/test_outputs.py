"""The outputs probe on real directories: inotify events, reconciliation, odd states.

inotify delivery is asynchronous, so tests that rely on it call collect() until the expected
state shows, with a deadline. A FakeClock that does not move keeps reconciliation from running,
so what those tests see came through events alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from stallwatch.clock import FakeClock
from stallwatch.probes import outputs as outputs_mod
from stallwatch.probes.base import DeadlineRunner, ProbeStatus
from stallwatch.probes.outputs import OutputsObs, OutputsProbe, fs_type, is_network_fs
from stallwatch.kernel.roots import Roots


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(monotonic=1000.0, wall=time.time())


@pytest.fixture
def make_probe():
    made: list[OutputsProbe] = []

    def make(*a, **kw) -> OutputsProbe:
        p = OutputsProbe(*a, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def wait_for(probe: OutputsProbe, cond, timeout: float = 10.0) -> OutputsObs:
    deadline = time.monotonic() + timeout
    while True:
        o = probe.collect()
        if cond(o):
            return o
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {o}")
        time.sleep(0.01)


def write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_events_track_create_grow_delete_in_nested_dirs(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    write(out / "rows_0-2000" / "data_0.ckpt", 10)
    probe = make_probe(out, clock=clock)
    o = probe.collect()
    assert (o.status, o.file_count, o.total_bytes, o.watch_mode) == (ProbeStatus.ok, 1, 10, "inotify")
    assert o.reconciliations == 1
    write(out / "rows_0-2000" / "data_1.ckpt", 20)
    write(out / "rows_2000-4000" / "data_2000.ckpt", 30)  # a new subdirectory, SpecForge style
    o = wait_for(probe, lambda o: o.file_count == 3 and o.total_bytes == 60)
    assert o.dir_count == 2 and o.events_seen > 0
    with open(out / "rows_0-2000" / "data_1.ckpt", "ab") as f:
        f.write(b"y" * 100)
    o = wait_for(probe, lambda o: o.total_bytes == 160)
    (out / "rows_0-2000" / "data_0.ckpt").unlink()
    o = wait_for(probe, lambda o: o.file_count == 2 and o.total_bytes == 150)
    shutil.rmtree(out / "rows_2000-4000")
    o = wait_for(probe, lambda o: o.file_count == 1 and o.dir_count == 1)
    assert o.reconciliations == 1  # all of it came from events
    assert [f.path for f in o.recent] == ["rows_0-2000/data_1.ckpt"]


def test_move_between_directories(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    write(out / "a" / "f.ckpt", 5)
    (out / "b").mkdir()
    probe = make_probe(out, clock=clock)
    probe.collect()
    os.rename(out / "a" / "f.ckpt", out / "b" / "g.ckpt")
    o = wait_for(probe, lambda o: o.newest is not None and o.newest.path == "b/g.ckpt")
    assert o.file_count == 1 and o.total_bytes == 5


def test_lost_events_are_corrected_by_reconciliation(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    out.mkdir()
    probe = make_probe(out, clock=clock, reconcile_every_s=30.0)
    probe.collect()
    probe._enqueue = lambda *paths: None  # every event from now on is lost
    for i in range(5):
        write(out / "rows_0-2000" / f"data_{i}.ckpt", 7)
    o = probe.collect()
    assert o.file_count == 0  # stale: nothing told us
    clock.advance(30)
    o = probe.collect()
    assert (o.file_count, o.total_bytes, o.reconciliations) == (5, 35, 2)
    assert o.reconcile_changes == 5


def test_a_real_inotify_queue_overflow_forces_reconciliation(fast_tmp, clock, make_probe):
    """More events between two ticks than the kernel queues (fs.inotify.max_queued_events): the
    kernel says IN_Q_OVERFLOW, and the probe reconciles at once rather than at its period."""
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if limit > 50_000:
        pytest.skip(f"fs.inotify.max_queued_events is {limit}: too many files to overflow it here")
    out = fast_tmp / "hs"
    out.mkdir()
    probe = make_probe(out, clock=clock)
    probe.collect()
    n = limit + 500  # each file: IN_CREATE and IN_CLOSE_WRITE
    for i in range(n):
        os.close(os.open(out / f"data_{i}.ckpt", os.O_CREAT | os.O_WRONLY))
    o = probe.collect()  # the clock did not move: only the overflow can have triggered this
    assert (o.file_count, o.overflows, o.reconciliations) == (n, 1, 2)


def test_pending_event_bound_forces_reconciliation(tmp_path, clock, make_probe, monkeypatch):
    monkeypatch.setattr(outputs_mod, "MAX_PENDING", 10)
    out = tmp_path / "hs"
    out.mkdir()
    probe = make_probe(out, clock=clock, use_inotify=False)
    probe.collect()
    for i in range(30):
        write(out / f"data_{i}.ckpt", 1)
        probe._enqueue(str(out / f"data_{i}.ckpt"))
    assert len(probe._pending) <= 10
    o = probe.collect()
    assert (o.file_count, o.overflows, o.reconciliations) == (30, 1, 2)


def test_polling_without_watchdog(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    out.mkdir()
    probe = make_probe(out, clock=clock, use_inotify=False, reconcile_every_s=30.0, poll_every_s=5.0)
    o = probe.collect()
    assert o.watch_mode == "polling" and o.watch_error is None
    write(out / "d" / "x.ckpt", 1)
    assert probe.collect().file_count == 0
    clock.advance(5)  # the polling period, not the 30 s reconcile period
    o = probe.collect()
    assert o.file_count == 1 and o.last_change_age_s == 0.0 and o.hot_files == 1
    # a file just seen is hot: re-stat'ed every tick, so its growth shows without a listing
    with open(out / "d" / "x.ckpt", "ab") as f:
        f.write(b"z" * 99)
    clock.advance(1)
    o = probe.collect()
    assert o.total_bytes == 100 and o.reconciliations == 2 and o.last_change_age_s == 0.0
    clock.advance(3)
    assert probe.collect().last_change_age_s == 3.0


def test_unchanged_directories_are_not_listed_again(tmp_path, clock, make_probe, monkeypatch):
    out = tmp_path / "hs"
    for d in range(3):
        for i in range(10):
            write(out / f"rows_{d}" / f"data_{i}.ckpt", 1)
    old = time.time() - 3600
    for d in [out, *out.iterdir()]:
        os.utime(d, (old, old))
    probe = make_probe(out, clock=clock, use_inotify=False, full_every=1000)
    assert probe.collect().file_count == 30
    listed: list[str] = []
    real_scandir = os.scandir

    def counting_scandir(p):
        listed.append(os.fspath(p))
        return real_scandir(p)

    monkeypatch.setattr(outputs_mod.os, "scandir", counting_scandir)
    clock.advance(60)
    assert probe.collect().file_count == 30 and listed == []
    write(out / "rows_1" / "data_99.ckpt", 1)  # changes rows_1's mtime only
    clock.advance(60)
    o = probe.collect()
    assert o.file_count == 31 and listed == [str(out / "rows_1")]


def test_racy_listing_is_not_trusted(tmp_path, clock, make_probe):
    # A file added in the same timestamp tick as the listing leaves the directory's mtime as it
    # was; simulate that by putting the old mtime back.
    out = tmp_path / "hs"
    write(out / "a.ckpt", 1)
    probe = make_probe(out, clock=clock, use_inotify=False, full_every=1000)
    assert probe.collect().file_count == 1
    st = os.stat(out)
    write(out / "b.ckpt", 1)
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
    clock.advance(60)
    assert probe.collect().file_count == 2


def test_full_reconcile_catches_rewrite_of_a_cold_file(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    write(out / "a.ckpt", 1)
    old = time.time() - 3600
    os.utime(out / "a.ckpt", (old, old))
    os.utime(out, (old, old))
    probe = make_probe(out, clock=clock, use_inotify=False, full_every=2)
    assert probe.collect().total_bytes == 1
    with open(out / "a.ckpt", "wb") as f:  # rewritten in place: the directory does not change
        f.write(b"q" * 50)
    os.utime(out, (old, old))
    clock.advance(60)
    assert probe.collect().total_bytes == 1  # incremental: the cached stat stands
    clock.advance(60)
    assert probe.collect().total_bytes == 50  # the every-2nd full pass re-stats everything


def test_directory_missing_removed_replaced(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    probe = make_probe(out, clock=clock)
    o = probe.collect()
    assert o.status == ProbeStatus.absent and o.file_count == 0 and "does not exist" in o.error
    write(out / "a.ckpt", 3)
    o = probe.collect()
    assert o.status == ProbeStatus.ok and o.file_count == 1 and o.watch_mode == "inotify"
    shutil.rmtree(out)
    clock.advance(2)
    o = probe.collect()
    assert o.status == ProbeStatus.absent and o.file_count == 0 and o.last_change_age_s == 0.0
    assert o.watch_mode == "polling"  # the watch went with the directory
    out.write_text("not a dir")
    o = probe.collect()
    assert o.status == ProbeStatus.not_a_dir
    out.unlink()
    write(out / "b.ckpt", 4)
    o = probe.collect()
    assert o.status == ProbeStatus.ok and o.file_count == 1 and o.total_bytes == 4
    write(out / "c.ckpt", 5)
    wait_for(probe, lambda o: o.file_count == 2)  # the watch was started again on the new dir


def test_pattern_counts_only_matching_files(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    write(out / "r" / "data_0.ckpt", 10)
    write(out / "r" / "notes.txt", 1000)
    probe = make_probe(out, clock=clock, pattern="data_*.ckpt")
    o = probe.collect()
    assert (o.file_count, o.total_bytes) == (1, 10)
    write(out / "r" / "more.txt", 1)
    write(out / "r" / "data_1.ckpt", 10)
    wait_for(probe, lambda o: o.file_count == 2 and o.total_bytes == 20)


def test_recent_and_newest(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    out.mkdir()
    now = time.time()
    for i in range(5):
        write(out / f"old_{i}.ckpt", 1)
        os.utime(out / f"old_{i}.ckpt", (now - 100 + i, now - 100 + i))
    probe = make_probe(out, clock=clock, recent_n=3)
    o = probe.collect()
    # history: the newest files by mtime, oldest first; the last change is the newest mtime
    assert [f.path for f in o.recent] == ["old_2.ckpt", "old_3.ckpt", "old_4.ckpt"]
    assert o.newest.path == "old_4.ckpt" and o.newest.age_s == pytest.approx(96, abs=2)
    assert o.last_change_age_s == pytest.approx(96, abs=2)
    for i in range(2):
        write(out / f"new_{i}.ckpt", 1)
    o = wait_for(probe, lambda o: len(o.recent) == 3 and o.recent[-1].path == "new_1.ckpt")
    assert [f.path for f in o.recent] == ["old_4.ckpt", "new_0.ckpt", "new_1.ckpt"]
    (out / "new_1.ckpt").unlink()
    o = wait_for(probe, lambda o: o.file_count == 6)
    assert [f.path for f in o.recent] == ["old_4.ckpt", "new_0.ckpt"]
    assert o.newest.path == "new_0.ckpt"


def test_network_filesystem_polls(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    out.mkdir()
    fake = tmp_path / "fixture"
    (fake / "proc" / "self").mkdir(parents=True)
    (fake / "proc" / "self" / "mountinfo").write_text(
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"40 22 0:40 / {tmp_path} rw,relatime shared:9 - nfs4 server:/export rw,vers=4.2\n"
    )
    roots = Roots.under(fake)
    assert fs_type(out, roots) == "nfs4" and is_network_fs("nfs4") and not is_network_fs("ext4")
    probe = make_probe(out, clock=clock, roots=roots)
    o = probe.collect()
    assert o.watch_mode == "polling" and o.fs_type == "nfs4" and probe._watch is None


def test_mountinfo_escapes_and_longest_prefix(tmp_path):
    fake = tmp_path / "fixture"
    (fake / "proc" / "self").mkdir(parents=True)
    (fake / "proc" / "self" / "mountinfo").write_text(
        "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        "41 22 0:41 / /mnt/my\\040data rw - cifs //srv/x rw\n"
        "42 22 0:42 / /mnt/my rw - xfs /dev/vdb rw\n"
    )
    roots = Roots.under(fake)
    assert fs_type("/mnt/my data/hs", roots) == "cifs"
    assert fs_type("/mnt/my/hs", roots) == "xfs"
    assert fs_type("/mnt/mydata", roots) == "ext4"


def test_close_releases_the_inotify_descriptor(tmp_path, clock):
    out = tmp_path / "hs"
    out.mkdir()
    probe = OutputsProbe(out, clock=clock)
    assert probe.collect().watch_mode == "inotify"
    fd = probe._watch.fd
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    probe.close()
    assert probe._watch is None
    assert not os.path.exists(f"/proc/self/fd/{fd}") or \
        os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:inotify"
    probe.close()  # idempotent


def test_no_thread_is_started_to_watch(tmp_path, clock):
    """The queue is drained on the tick: watching costs no thread (watchdog's observer ran three)."""
    out = tmp_path / "hs"
    out.mkdir()
    before = threading.active_count()
    probe = OutputsProbe(out, clock=clock)
    write(out / "a.ckpt", 1)
    assert probe.collect().watch_mode == "inotify"
    write(out / "sub" / "b.ckpt", 2)
    o = probe.collect()
    assert (o.file_count, o.total_bytes) == (2, 3)  # from events: the clock did not move
    assert o.reconciliations == 1 and threading.active_count() == before
    probe.close()


def test_watch_failure_falls_back_to_polling(tmp_path, clock, make_probe, monkeypatch):
    out = tmp_path / "hs"
    write(out / "a.ckpt", 1)

    def broken(*a, **kw):
        raise OSError(28, "inotify watch limit reached")

    monkeypatch.setattr(outputs_mod, "InotifyWatch", broken)
    o = make_probe(out, clock=clock).collect()
    assert o.watch_mode == "polling" and "watch limit" in o.watch_error and o.file_count == 1


def test_obs_json_round_trip(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    write(out / "r" / "a.ckpt", 3)
    o = make_probe(out, clock=clock).collect()
    assert OutputsObs.model_validate_json(o.model_dump_json()) == o


def test_runs_under_the_deadline_runner(tmp_path, clock, make_probe):
    write(tmp_path / "hs" / "a.ckpt", 2)
    probe = make_probe(tmp_path / "hs", clock=clock, name="outputs:extract")
    obs, report = DeadlineRunner().call(probe.name, probe.collect, 5.0)
    assert report.status == ProbeStatus.ok and obs.file_count == 1 and obs.watch_mode == "inotify"


@pytest.fixture
def fast_tmp(tmp_path):
    """A tmpfs directory when there is one: creating 10^5 files there takes about a second,
    on a busy virtual disk it took up to a minute, which would time the disk, not the probe."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="stallwatch-test-", dir=shm))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_hundred_thousand_files(fast_tmp, make_probe):
    """10^5 files in 50 SpecForge-like directories, created while watched (an event flood that
    can overflow the kernel queue): the count comes out right and the probe's own work is cheap.
    Only the probe's costs are timed; creating the files depends on the machine's load."""
    out = fast_tmp / "hs"
    out.mkdir()
    probe = make_probe(out, reconcile_every_s=30.0)
    probe.collect()
    for d in range(50):
        sub = out / f"rows_{d * 2000}-{d * 2000 + 2000}"
        sub.mkdir()
        for i in range(2000):
            os.close(os.open(sub / f"data_{i}.ckpt", os.O_CREAT | os.O_WRONLY))
    o = wait_for(probe, lambda o: o.file_count == 100_000, timeout=60)
    assert o.dir_count == 50
    t = time.perf_counter()
    o = probe.collect()
    tick = time.perf_counter() - t
    t = time.perf_counter()
    probe._reconcile(probe.clock.monotonic(), full=True)
    full = time.perf_counter() - t
    t = time.perf_counter()
    probe._reconcile(probe.clock.monotonic(), full=False)
    incremental = time.perf_counter() - t
    assert probe.collect().file_count == 100_000
    # measured ~1 ms, ~0.3 s, ~10 ms on an idle 2-core machine; bounds leave room for load
    assert tick < 0.5 and full < 5 and incremental < 1, (tick, full, incremental)


def _old_tree(out: Path, dirs: int, per_dir: int) -> list[Path]:
    """`dirs` directories nested a few deep, `per_dir` files each, all mtimes an hour old (past
    the racy window, so listings are trusted)."""
    made = []
    for i in range(dirs):
        d = out / f"g{i % 4}" / f"rows_{i}" / "shard"
        for k in range(per_dir):
            write(d / f"data_{k}.ckpt", 1)
        made.append(d)
    old = time.time() - 3600
    for p in sorted(out.rglob("*"), reverse=True) + [out]:
        os.utime(p, (old, old), follow_symlinks=False)
    return made


def test_sliced_reconcile_bounds_each_tick_and_finds_a_deep_file(tmp_path, clock, make_probe,
                                                                   monkeypatch):
    out = tmp_path / "hs"
    made = _old_tree(out, dirs=40, per_dir=30)  # 1,200 files, 40 + 4 + 40 + 1 directories
    slice_n = 50
    probe = make_probe(out, clock=clock, use_inotify=False, poll_every_s=5.0, full_every=1,
                       reconcile_slice_entries=slice_n)
    o = probe.collect()  # the first reconciliation learns the tree whole, at once
    assert (o.file_count, o.reconciliations) == (1200, 1)

    work: list[int] = [0]  # what the probe looks at: a name listed or a path lstat'ed, one each
    real_scandir, real_lstat = os.scandir, os.lstat

    def counting_scandir(p):
        work[0] += len(os.listdir(p))
        return real_scandir(p)

    def counting_lstat(p, *a, **kw):
        work[0] += 1
        return real_lstat(p, *a, **kw)

    monkeypatch.setattr(outputs_mod.os, "scandir", counting_scandir)
    monkeypatch.setattr(outputs_mod.os, "lstat", counting_lstat)
    work[0] = 0
    probe.collect()  # no sweep due: what every tick costs anyway (realpath's lstats of the root)
    idle = work[0]
    deep = made[17] / "new.ckpt"
    write(deep, 9)  # polling, no events: only the sweep can find it
    clock.advance(5)
    per_tick: list[int] = []
    counts: list[int] = []
    while True:
        work[0] = 0
        o = probe.collect()
        per_tick.append(work[0] - idle)
        counts.append(o.file_count)
        if o.reconciliations == 2 or len(per_tick) > 200:
            break
        clock.advance(1)
    # full_every=1: every directory re-listed and every file re-stat'ed, 85 + 1,201 entries
    full_sweep = 85 + 1201
    assert o.reconciliations == 2 and o.file_count == 1201 and o.reconcile_changes == 1
    assert len(per_tick) >= full_sweep // (slice_n + 31)  # spread over ticks, not at once
    assert len(per_tick) <= full_sweep // slice_n + 2  # and found within the full sweep period
    # no tick overspends by more than one directory's listing (the debt the next ones repay)...
    assert max(per_tick) <= slice_n + 31, per_tick
    # ...and the sweep's average is the slice
    assert sum(per_tick) / len(per_tick) <= slice_n * 1.05, per_tick
    # mid-sweep the index neither lost nor invented files: 1,200 until the walk reached the
    # new file's directory, 1,201 from then on
    assert set(counts) == {1200, 1201} and counts == sorted(counts), counts


def test_lost_events_mid_sweep_reconcile_whole_at_once(tmp_path, clock, make_probe):
    out = tmp_path / "hs"
    made = _old_tree(out, dirs=20, per_dir=20)
    probe = make_probe(out, clock=clock, use_inotify=False, poll_every_s=5.0, full_every=1,
                       reconcile_slice_entries=30)
    assert probe.collect().file_count == 400
    clock.advance(5)
    o = probe.collect()  # a sliced sweep has started
    assert o.reconciliations == 1 and probe._sweep is not None
    write(made[3] / "late.ckpt", 1)
    probe._pending_lost = True  # what an IN_Q_OVERFLOW (or the pending bound) leaves
    o = probe.collect()  # the clock did not move: only the loss can have finished a sweep
    assert (o.reconciliations, o.file_count, o.overflows) == (2, 401, 1)
    assert probe._sweep is None


@pytest.mark.parametrize("base", ["/data/out", "/data/out/", "/"])
@pytest.mark.parametrize("tail", ["a.bin", "sub/a.bin", ".hidden", "..x", "a/../b", "a/./b", "a//b",
                                  "", "../sibling/f", "a/", "sub/.hidden", "/abs"])
def test_event_path_made_relative_as_relpath_does(base: str, tail: str, tmp_path: Path) -> None:
    """The cut used for event paths answers what os.path.relpath answered for every spelling."""
    probe = OutputsProbe(tmp_path, use_inotify=False)
    probe._base = base.rstrip("/") or "/"
    path = f"{probe._base.rstrip('/')}/{tail}" if tail else probe._base
    assert probe._rel(path) == os.path.relpath(path, probe._base)


def test_a_periodic_sweep_under_inotify_checks_names_and_leaves_cold_files_alone(
        tmp_path, clock, make_probe, monkeypatch):
    """The directory being written, re-listed each period: while the watch reported everything,
    its names are compared in C and only the evented and hot files are lstat'ed. The index
    ends as the scandir listing leaves it (a twin probe that always lists by scandir)."""
    out = tmp_path / "hs"
    rows = out / "rows_0-2000"
    for i in range(300):
        write(rows / f"data_{i}.pt", 10)
    old = time.time() - 3600
    for p in [*rows.iterdir(), rows, out]:
        os.utime(p, (old, old))
    quick = make_probe(out, clock=clock, reconcile_every_s=30.0)
    twin = make_probe(out, clock=clock, reconcile_every_s=30.0)
    monkeypatch.setattr(twin, "_relist_by_name", lambda *a: None)
    quick.collect(), twin.collect()
    for i in range(300, 305):
        write(rows / f"data_{i}.pt", 20)
    wait_for(quick, lambda o: o.file_count == 305)
    wait_for(twin, lambda o: o.file_count == 305)
    # new since the last drain and one grown: the sweep finds them first (4 changes), as scandir would
    for i in range(305, 308):
        write(rows / f"data_{i}.pt", 30)
    (rows / "data_300.pt").write_bytes(b"y" * 99)  # a hot file grown
    time.sleep(0.05)  # the kernel queues the events; the next collect drains them
    listed: list[str] = []
    real_scandir = os.scandir

    def counting_scandir(p):
        listed.append(os.fspath(p))
        return real_scandir(p)

    clock.advance(30)
    monkeypatch.setattr(outputs_mod.os, "scandir", counting_scandir)
    a = quick.collect()
    assert quick._sweep is None and a.reconciliations == 2
    assert listed == []  # rows checked by name: no scandir, no Python step over its 300 cold files
    b = twin.collect()
    assert listed == [str(rows)]
    assert (a.file_count, a.total_bytes, a.reconcile_changes, a.reconciliations) == \
        (b.file_count, b.total_bytes, b.reconcile_changes, b.reconciliations) == (308, 3269, 4, 2)
    assert [f.path for f in a.recent] == [f.path for f in b.recent]
    assert {k: d.files for k, d in quick._dirs.items()} == {k: d.files for k, d in twin._dirs.items()}
    assert list(quick._hot) == list(twin._hot)
