"""The state database: permissions, WAL readers, incidents, and intents that survive SIGKILL."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stallwatch.daemon.reconcile import reconcile_intents
from stallwatch.daemon.supervise import identity_alive, read_status
from stallwatch.errors import UsageError
from stallwatch.daemon.state import StateDB

from rigs import wait_until

ROOT = Path(__file__).resolve().parents[1]


def test_created_private_with_wal(tmp_path: Path) -> None:
    d = tmp_path / "state"
    db = StateDB.open(d)
    try:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert stat.S_IMODE((d / "stallwatch.db").stat().st_mode) == 0o600
        assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.get_meta("schema_version") == "1"
    finally:
        db.close()


def test_readonly_reader_while_a_writer_holds_a_transaction(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path)
    db.ensure_job("a", "command", "{}")
    db.conn.execute("BEGIN IMMEDIATE")
    db.conn.execute("UPDATE jobs SET restarts = 7 WHERE name = 'a'")
    try:
        ro = StateDB.open_readonly(tmp_path)
        assert ro.job("a")["restarts"] == 0  # sees the last commit, does not wait
        ro.close()
    finally:
        db.conn.execute("COMMIT")
    ro = StateDB.open_readonly(tmp_path)
    assert ro.job("a")["restarts"] == 7
    ro.close()
    db.close()


def test_readonly_without_database(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no state database"):
        StateDB.open_readonly(tmp_path)
    assert not (tmp_path / "stallwatch.db").exists()


def test_incidents_episodes_and_actions(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path)
    db.ensure_job("a", "command", "{}")
    i1, e1 = db.open_incident("a", "hang", "stuck", {"kind": "hang"})
    db.add_action("a", "kill", "done", incident_id=i1)
    db.resolve_incident(i1)
    i2, e2 = db.open_incident("a", "hang", "stuck again", {"kind": "hang"})
    i3, e3 = db.open_incident("a", "crash", "died", {"kind": "crash"})
    assert (e1, e2, e3) == (0, 1, 0)
    assert [i["id"] for i in db.open_incidents("a")] == [i2, i3]
    assert db.incident(i1)["state"] == "resolved" and db.incident(i1)["resolved_at"]
    assert [a["what"] for a in db.actions(i1)] == ["kill"]
    db.close()


def test_transaction_rolls_back_as_a_whole(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path)
    db.ensure_job("a", "command", "{}")
    with pytest.raises(RuntimeError), db.tx():
        db.update_job("a", restarts=1)
        db.add_action("a", "restart", "started")
        raise RuntimeError("killed half-way")
    assert db.job("a")["restarts"] == 0 and db.job_actions("a") == []
    db.close()


# A daemon's restart, cut short by SIGKILL at the two points that matter: after the intent is
# recorded but before the spawn, and after the spawn but before the completion.
CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    from stallwatch.daemon.state import StateDB
    from stallwatch.daemon.supervise import spawn
    state, where, attempt = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    db = StateDB.open(state)
    db.ensure_job("job", "command", "{}")
    seq = db.next_seq("job")
    sf = state / "runs" / f"job-{seq}.json"
    db.add_action("job", "restart", "pending", attempt=attempt, done=False,
                  detail=json.dumps({"seq": seq, "status_file": str(sf), "how": "setsid"}))
    if where == "before-spawn":
        os.kill(os.getpid(), signal.SIGKILL)
    spawn("job", seq, ("sleep", "60"), status_file=sf, log=state / "job.log", cwd=None, env={},
          systemd_run=False)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def killed_daemon(state: Path, where: str, attempt: int) -> None:
    r = subprocess.run([sys.executable, "-c", CHILD, str(state), where, str(attempt)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr


def test_restart_intent_killed_before_spawn_is_not_counted(tmp_path: Path) -> None:
    killed_daemon(tmp_path, "before-spawn", 1)
    db = StateDB.open(tmp_path)
    notes = reconcile_intents(db, "job", settle_s=0.0)
    assert notes == [f"restart {db.job_actions('job')[0]['id']}: had not happened"]
    assert db.job("job")["restarts"] == 0 and db.runs("job") == []
    assert db.pending_actions("job") == []
    db.close()


def test_restart_intent_killed_after_spawn_is_counted_exactly_once(tmp_path: Path) -> None:
    killed_daemon(tmp_path, "after-spawn", 1)
    sf = tmp_path / "runs" / "job-1.json"
    doc = wait_until(lambda: (d := read_status(sf)) and d.get("pid") and d, 10, "the wrapper's status")
    try:
        db = StateDB.open(tmp_path)
        reconcile_intents(db, "job")
        reconcile_intents(db, "job")  # a second daemon start finds nothing left to do
        assert db.job("job")["restarts"] == 1
        run, = db.runs("job")
        assert (run["pid"], run["start_ticks"]) == (doc["pid"], doc["start_ticks"])
        assert identity_alive(run["pid"], run["start_ticks"])
        assert [a["outcome"].split(" (")[0] for a in db.job_actions("job")] == ["started run 1"]
        # a later restart intent, killed before its spawn, leaves the count at 1
        db.close()
        killed_daemon(tmp_path, "before-spawn", 2)
        db = StateDB.open(tmp_path)
        reconcile_intents(db, "job", settle_s=0.0)
        assert db.job("job")["restarts"] == 1 and len(db.runs("job")) == 1
        db.close()
    finally:
        os.killpg(doc["pgid"], signal.SIGKILL)
        os.kill(doc["wrapper_pid"], signal.SIGKILL)
