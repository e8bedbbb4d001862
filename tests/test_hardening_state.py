"""Hardening: the state database corrupt, locked by another process, or on a full disk.

The daemon must keep watching through each of them and say so — never a traceback per tick,
never a crash loop, never a second copy of a job it lost track of. Before the fixes these
faults gave: a corrupt file → `stallwatch run` died with a DatabaseError traceback (a crash
loop under systemd); a lock held by another process → every write waited 10 s, so a tick took
(jobs + 1) × 10 s; a full disk → a traceback twice a tick and no detection at all (the job's
tick died at its first write, before incidents and alerts).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rigs import wait_until
from daemonkit import Harness, scan_writers

from stallwatch.daemon.state import DB_NAME, StateDB

LOCKER = r"""
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN EXCLUSIVE")
c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('locker', 'x')")
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
c.execute("ROLLBACK")
"""


class Locker:
    """Another process holding the state database's write lock until released."""

    def __init__(self, db: Path) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", LOCKER, str(db)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)
        assert self.p.stdout.readline() == b"locked\n"

    def release(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(10)


def _garbage(path: Path, n: int = 16384) -> None:
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    path.write_bytes(os.urandom(n))


# ----------------------------------------------------------------------------- the module

def test_corrupt_database_is_set_aside_and_a_fresh_one_started(tmp_path: Path) -> None:
    _garbage(tmp_path / DB_NAME)
    db = StateDB.open(tmp_path)
    try:
        assert db.degraded is None
        assert "was corrupt" in db.get_meta("state_reset")
        db.ensure_job("a", "command", "{}")
    finally:
        db.close()
    aside = list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))
    assert len(aside) == 1 and aside[0].stat().st_size == 16384  # kept, never deleted


def test_half_corrupt_database_fails_its_check_and_is_set_aside(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path)
    for _ in range(200):
        db.add_action("a", "detect", "x" * 200)
    db.close()
    # A valid header, garbage pages after it: only an integrity check sees it.
    p = tmp_path / DB_NAME
    for suffix in ("-wal", "-shm"):
        Path(str(p) + suffix).unlink(missing_ok=True)
    data = bytearray(p.read_bytes())
    data[4096 * 2:4096 * 4] = os.urandom(4096 * 2)
    p.write_bytes(bytes(data))
    db = StateDB.open(tmp_path)
    try:
        assert "was corrupt" in (db.get_meta("state_reset") or "")
    finally:
        db.close()


def test_locked_by_another_process_writes_go_to_memory_then_back(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path, busy_timeout_s=0.5)
    db.ensure_job("a", "command", "{}")
    locker = Locker(tmp_path / DB_NAME)
    try:
        t0 = time.monotonic()
        db.update_job("a", phase="running")
        iid, _ = db.open_incident("a", "hang", "stuck", {"kind": "hang"})
        assert time.monotonic() - t0 < 3.0  # one busy timeout, not one per write
        assert db.degraded and "locked" in db.degraded
        assert db.incident(iid)["kind"] == "hang" and db.job("a")["phase"] == "running"
        t0 = time.monotonic()
        assert db.write_back() is False  # still locked: says so at once, never waits for it
        assert time.monotonic() - t0 < 1.0
    finally:
        locker.release()
    assert db.write_back() is True and db.degraded is None
    db.add_action("a", "resolve", "fine", incident_id=iid)
    db.close()
    ro = StateDB.open_readonly(tmp_path)
    try:
        assert ro.incident(iid)["summary"] == "stuck"  # what happened while locked was kept
        assert [a["what"] for a in ro.actions(iid)] == ["resolve"]
        assert ro.get_meta("locker") is None  # the other process's transaction rolled back
    finally:
        ro.close()


def test_disk_full_mid_transaction_replays_it_whole_in_memory(tmp_path: Path) -> None:
    """The disk fills between two statements of one transaction (SQLITE_FULL, made here with
    max_page_count): the whole transaction lands in memory, with the same row ids, and is
    written back once there is room."""
    db = StateDB.open(tmp_path)
    db.ensure_job("a", "command", "{}")
    pages = db.conn.file.execute("PRAGMA page_count").fetchone()[0]
    with db.tx():
        first = db.add_action("a", "restart", "pending", done=False)
        db.conn.file.execute(f"PRAGMA max_page_count={pages}")
        second = db.add_action("a", "restart", "x" * 50000)  # needs new pages: the disk is full
    assert db.degraded and "full" in db.degraded
    assert [a["id"] for a in db.job_actions("a")] == [first, second]
    assert db.write_back() is False  # still full
    db.conn.file.execute("PRAGMA max_page_count=1073741823")
    assert db.write_back() is True
    db.close()
    ro = StateDB.open_readonly(tmp_path)
    try:
        assert [a["id"] for a in ro.job_actions("a")] == [first, second]
    finally:
        ro.close()


# ----------------------------------------------------------------------------- the daemon

def _match_config(h: Harness, state: Path, extra: str = "") -> Path:
    h.cfg.write_text(f"""
[daemon]
interval_s = 0.25
state_dir = "{state}"
{extra}

[[job]]
name = "sleeper"
match = "hardening-sleeper-{os.getpid()}"
""")
    h.cfg.chmod(0o600)
    return h.cfg


def test_daemon_on_a_corrupt_database_keeps_watching_and_says_so(h: Harness) -> None:
    h.state.mkdir()
    _garbage(h.state / DB_NAME)
    _match_config(h, h.state)
    d = h.start()
    h.wait_log(r"was corrupt .*set aside as .*started afresh", 30)
    wait_until(lambda: h.ticks() >= 4, 30, "ticks on the fresh database")
    assert d.poll() is None
    assert "Traceback" not in h.daemon_log()
    assert h.q("SELECT value FROM meta WHERE key = 'state_reset'")[0]["value"]
    assert h.stop(d) == 0


def test_corrupt_database_under_a_running_job_adopts_it_never_a_second_copy(
        h: Harness, tmp_path: Path) -> None:
    # The job waits after its 5th sample until the second daemon has adopted it: on a loaded
    # machine that daemon's start-up alone can outlast the job's remaining seconds (an import
    # of 10 s beside three CPU hogs), and a job that has finished is not adopted.
    go = tmp_path / "adopted"
    h.write_config(["--count", "60", "--interval", "0.1", "--hold-at", "5",
                    "--hold-until", str(go)], job="max_restarts = 2")
    first = h.start()
    wait_until(lambda: h.phase() == "running", 30, "the job to run")
    wait_until(lambda: h.log.exists() and "5/60" in h.log.read_text(), 30, "progress")
    first.kill()
    first.wait(30)
    (pid, _), = scan_writers(str(h.out))
    _garbage(h.state / DB_NAME)
    second = h.start()
    h.wait_log(rf"run 1 \(pid {pid}\) is alive: adopted", 30)
    h.wait_log(rf"re-attached to pid {pid} ", 30)
    go.touch()
    deadline = time.monotonic() + 60
    while h.phase() != "finished":
        assert [w[0] for w in scan_writers(str(h.out))] in ([pid], []), "a second writer"
        assert time.monotonic() < deadline, "the job did not finish"
        assert second.poll() is None, h.daemon_log()
        time.sleep(0.1)
    assert len(h.q("SELECT * FROM runs")) == 1 and h.job()["restarts"] == 0
    assert h.job()["starts"] >= 1  # the next run never reuses run 1's status file
    h.assert_outputs_complete(60)
    assert h.stop(second) == 0


def test_daemon_started_while_another_process_locks_the_state(h: Harness) -> None:
    _match_config(h, h.state)
    d = h.start()
    wait_until(lambda: h.ticks() >= 2, 30, "first ticks")
    assert h.stop(d) == 0
    locker = Locker(h.state / DB_NAME)
    try:
        d = h.start()
        h.wait_log(r"state database cannot be written \(OperationalError: database is locked\)",
                   30)
        h.wait_log(r"daemon ready: STATE IN MEMORY", 30)  # it says so, in its STATUS too
        time.sleep(2)
        assert d.poll() is None
    finally:
        locker.release()
    before = h.ticks()
    h.wait_log(r"state database writable again", 30)
    wait_until(lambda: h.ticks() > before + 4, 30, "ticks written to the file again")
    assert h.daemon_log().count("Traceback") == 0
    assert h.stop(d) == 0


@pytest.mark.root
def test_full_disk_under_the_state_dir_detects_alerts_and_writes_back(h: Harness, webhook,
                                                                      tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts a 1 MiB tmpfs as the state dir)")
    from faultrigs import fill_up, small_tmpfs

    url, events = webhook
    with small_tmpfs(tmp_path / "small", "1M") as mnt:
        try:
            h.state = mnt / "state"
            once = tmp_path / "crash-fired"
            h.write_config(["--count", "400", "--interval", "0.05", "--crash-at", "60",
                            "--once", str(once)],
                           job='max_restarts = 1',
                           alerts=f'[[alert]]\ntype = "webhook"\nurl = "{url}"\nretry_initial_s = 0.2\n')
            d = h.start()
            wait_until(lambda: h.phase() == "running", 30, "the job to run")
            fill_up(mnt / "fill")  # the state dir's filesystem
            # The job crashes at sample 60 with the disk full: detected, alerted, restarted.
            wait_until(lambda: any(e["kind"] == "crash" and e["state"] == "firing" for e in events),
                       60, "the crash alert with the state on a full disk")
            h.wait_log(r"state database cannot be written \(OperationalError: database or disk is "
                       r"full\)", 10)
            wait_until(lambda: any(e["kind"] == "crash" and e["state"] == "resolved" for e in events),
                       60, "the restart resolving the incident")
            assert d.poll() is None
            log = h.daemon_log()
            assert log.count("state database cannot be written") == 1  # said once, not every tick
            assert log.count("Traceback") <= 1, log[-3000:]
            (mnt / "fill").unlink()
            h.wait_log(r"state database writable again", 30)
            wait_until(lambda: h.phase() == "finished", 60, "the job to finish")
            inc, = [i for i in h.incidents() if i["kind"] == "crash"]
            assert inc["state"] == "resolved" and h.job()["restarts"] == 1
            assert len(h.q("SELECT * FROM runs")) == 2
            assert h.stop(d) == 0
        finally:
            h.cleanup()
