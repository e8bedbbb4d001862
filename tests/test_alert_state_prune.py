"""A job removed from the config: its saved alert state (`alerts:<job>`, `rules:<job>`) is kept
for the grace (a job put back soon resumes its timers), then deleted (daemon/alertmemory.py)."""

from __future__ import annotations

import time
from pathlib import Path

from stallwatch.clock import FakeClock
from stallwatch.daemon.alertmemory import PRUNE_EVERY_S, PRUNE_GRACE_S, prune_removed
from stallwatch.daemon.config import load_config
from stallwatch.daemon.core import Daemon
from stallwatch.daemon.state import StateDB
from stallwatch.engine.alerting import FOR_OUTAGE_TOLERANCE_S


def _saved(db: StateDB) -> set[str]:
    return {k for k in db.meta() if k.startswith(("alerts:", "rules:"))}


def test_rows_of_a_removed_job_go_after_the_grace_and_no_other(tmp_path: Path) -> None:
    clock = FakeClock()
    db = StateDB.open(tmp_path / "state", clock=clock)
    try:
        for job in ("gone", "kept"):
            db.ensure_job(job, "match", "{}")
            db.set_meta(f"alerts:{job}", "[]")
            db.set_meta(f"rules:{job}", "[]")
        db.set_meta("alerts:ghost", "[]")  # no job row: nothing could ever restore it
        db.set_meta("alerts", "{}")  # the alert sinks' status, not a job's
        db.set_meta("restart_streak_base:gone", "2")  # not alert state
        # the grace is the outage after which no restore would take the rows anyway
        assert PRUNE_GRACE_S == FOR_OUTAGE_TOLERANCE_S
        assert prune_removed(db, {"kept"}, clock.time()) == ["ghost"]
        clock.advance(PRUNE_GRACE_S)
        assert prune_removed(db, {"kept"}, clock.time()) == []  # not yet over the grace
        clock.advance(1.0)
        assert prune_removed(db, {"kept"}, clock.time()) == ["gone"]
        assert _saved(db) == {"alerts:kept", "rules:kept"}
        assert {"alerts", "restart_streak_base:gone"} <= set(db.meta())
        assert db.job("gone") is not None  # the job's own row stays (status shows it unwatched)
    finally:
        db.close()


def _config(path: Path, jobs: tuple[str, ...]) -> Path:
    tag = f"names-prune-{time.time_ns()}"  # matches no process: nothing is started or killed
    path.write_text('[daemon]\ninterval_s = 1\nstate_dir = "state"\n\n' + "".join(
        f'[[job]]\nname = "{j}"\nmatch = "{tag}-{j}$"\n\n' for j in jobs))
    path.chmod(0o644)
    return path


def test_the_daemon_prunes_a_removed_jobs_alert_state_after_the_grace(tmp_path: Path) -> None:
    clock = FakeClock(wall=time.time())
    cfg = _config(tmp_path / "sw.toml", ("kept", "gone"))
    d = Daemon(load_config(cfg), clock=clock, gpu=False, install_signals=False)
    d.open()
    try:
        d.tick()
        assert _saved(d.db) == {"alerts:kept", "rules:kept", "alerts:gone", "rules:gone"}
        _config(cfg, ("kept",))
        assert d.reload()
        assert d.db.job("gone")["phase"] == "unwatched"
        clock.advance(PRUNE_EVERY_S)
        d.tick()
        assert "alerts:gone" in _saved(d.db), "pruned within the grace"
        clock.advance(PRUNE_GRACE_S)
        d.tick()
        assert _saved(d.db) == {"alerts:kept", "rules:kept"}
    finally:
        d.shutdown()
