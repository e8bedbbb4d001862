"""The Daemon object in-process (a thread): the API that `stallwatch run` wraps, a command that
cannot start, a dry run, and status from the database."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
import time
from pathlib import Path

import pytest

from stallwatch.daemon.config import load_config
from stallwatch.errors import UsageError
from stallwatch.daemon.core import Daemon
from stallwatch.daemon.status import exit_code, render_status, status_doc
from stallwatch.daemon.state import StateDB

from daemonkit import daemon_in_thread
from rigs import wait_until

ROOT = Path(__file__).resolve().parents[1]
WRITER = ROOT / "tests" / "jobs" / "pt_writer.py"


def config(tmp_path: Path, extra: str = "") -> Path:
    p = tmp_path / "sw.toml"
    p.write_text(f"""
[daemon]
interval_s = 0.2
state_dir = "state"

[[job]]
name = "writer"
command = {json.dumps([sys.executable, str(WRITER), "--out", "out", "--count", "4", "--interval", "0.05"])}
cwd = "."
outputs = "out"
restart = "on-failure"

[[job]]
name = "missing"
command = ["{tmp_path}/no-such-program"]
restart = "on-failure"
max_restarts = 1
restart_backoff_s = 0.1
{extra}
""")
    p.chmod(0o644)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_daemon_in_a_thread(tmp_path: Path) -> None:
    port = free_port()
    p = config(tmp_path)
    p.write_text(p.read_text().replace('state_dir = "state"',
                                       f'state_dir = "state"\nmetrics_listen = "127.0.0.1:{port}"'))
    cfg = load_config(p)
    d = Daemon(cfg, gpu=False)
    with daemon_in_thread(d):
        state = tmp_path / "state"

        def row(name):
            db = StateDB.open_readonly(state)
            try:
                return db.job(name)
            finally:
                db.close()

        wait_until(lambda: row("writer")["phase"] == "finished", 30, "the writer to finish")
        # The command that cannot start: exit 127 from the wrapper, a crash, one restart, given up.
        wait_until(lambda: row("missing")["phase"] == "stopped", 30, "the missing command given up")
        assert row("missing")["restarts"] == 1 and row("writer")["restarts"] == 0
        assert "restart budget used up" in row("missing")["phase_detail"]
        db = StateDB.open_readonly(state)
        doc = status_doc(db, state)
        missing = [i for i in db.incidents("missing")]
        db.close()
        assert [j["name"] for j in doc["jobs"]] == ["writer", "missing"]
        assert doc["jobs"][0]["verdict"]["kind"] == "finished"
        assert all(i["kind"] == "crash" for i in missing) and len(missing) == 2
        assert "cannot start" in missing[0]["summary"] or "127" in missing[0]["verdict_json"]
        assert exit_code(doc) == 2  # a job is down
        # one daemon per state directory
        with pytest.raises(UsageError, match="another stallwatch daemon"):
            Daemon(cfg, gpu=False).open()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'stallwatch_job_verdict{job="writer",kind="finished"} 1.0' in metrics
        assert 'stallwatch_job_restarts_total{job="missing"} 1.0' in metrics
        d.request_reload()  # same file: nothing changes, nothing breaks
        ticks = d.ticks
        wait_until(lambda: d.ticks > ticks + 2, 10, "ticks after the reload")
    db = StateDB.open_readonly(tmp_path / "state")
    doc = status_doc(db, tmp_path / "state")
    db.close()
    assert doc["daemon"]["running"] is False and doc["daemon"]["stopped_at"]
    assert exit_code(doc) == 3
    from rich.console import Console

    console = Console(record=True, width=120)
    render_status(doc, console)
    text = console.export_text()
    assert "writer" in text and "finished" in text and "not running" in text


def test_dry_run_starts_and_kills_nothing(tmp_path: Path) -> None:
    p = config(tmp_path)
    p.write_text(p.read_text().replace('state_dir = "state"', 'state_dir = "state"\ndry_run = true'))
    cfg = load_config(p)
    d = Daemon(cfg, gpu=False)
    with daemon_in_thread(d):
        ticks = d.ticks
        wait_until(lambda: d.ticks > ticks + 3, 10, "a few ticks")
    db = StateDB.open(tmp_path / "state")
    assert db.runs("writer") == [] and db.runs("missing") == []
    assert db.job("writer")["phase"] == "new"  # a later real daemon starts it
    db.close()
    assert not (tmp_path / "out").exists()


def test_attached_by_match_is_watched_never_restarted(tmp_path: Path) -> None:
    tag = f"{time.time_ns() % 10**9}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", tag],
                               start_new_session=True)
    p = tmp_path / "sw.toml"
    p.write_text(f'[daemon]\ninterval_s = 0.2\nstate_dir = "state"\n\n'
                 f'[[job]]\nname = "other"\nmatch = "time.sleep.300. {tag}$"\n')
    p.chmod(0o644)
    d = Daemon(load_config(p), gpu=False)
    try:
        with daemon_in_thread(d):
            state = tmp_path / "state"

            def row():
                db = StateDB.open_readonly(state)
                try:
                    return db.job("other")
                finally:
                    db.close()

            wait_until(lambda: row()["pid"] == sleeper.pid, 10, "the match to find the process")
            assert row()["phase"] == "attached"
            sleeper.kill()
            sleeper.wait(10)
            wait_until(lambda: '"unknown"' in row()["verdict_json"] and "exited" in row()["verdict_json"],
                       10, "the exit to be seen")
            db = StateDB.open_readonly(state)
            doc = status_doc(db, state)
            db.close()
            job, = doc["jobs"]
            assert job["phase"] == "attached" and "never restarts" in job["note"]
            assert job["restarts"] == 0 and not job["supervised"]
    finally:
        sleeper.kill()
