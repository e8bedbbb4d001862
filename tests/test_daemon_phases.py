"""A job's phase changes only along stallwatch.vocab.JOB_EDGES, through JobRunner.set_phase."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.clock import FakeClock
from stallwatch.daemon.config import DaemonConfig, JobConfig
from stallwatch.daemon.job import JobRunner
from stallwatch.daemon.options import JobOptions
from stallwatch.engine.rulefile import RuleSet
from stallwatch.daemon.state import StateDB
from stallwatch.vocab import JOB_EDGES, JobPhase, PhaseError


@pytest.fixture
def db(tmp_path: Path):
    db = StateDB.open(tmp_path / "state")
    yield db
    db.close()


def _runner(db: StateDB, name: str) -> JobRunner:
    opts = JobOptions(db=db, clock=FakeClock(), state_dir=db.path.parent, host="host",
                      boot_id="", gpu=False, submit_alert=lambda event: None,
                      settings=DaemonConfig)
    runner = JobRunner(opts, JobConfig(name=name, command=["true"]), RuleSet())
    db.ensure_job(name, runner.mode, runner.config_json())
    return runner


def test_every_edge_of_the_table_is_taken_and_every_other_refused(db: StateDB) -> None:
    taken = refused = 0
    for frm in JobPhase:
        for to in JobPhase:
            name = f"{frm}-{to}"
            r = _runner(db, name)
            db.update_job(name, phase=frm.value, phase_detail="before")
            r.set_phase(frm.value, resumed=True)  # where a previous daemon left it
            if to in JOB_EDGES[frm]:
                r.set_phase(to.value, f"to {to}")
                assert r.phase is to
                assert (db.job(name)["phase"], db.job(name)["phase_detail"]) == (to, f"to {to}")
                taken += 1
            else:
                with pytest.raises(PhaseError, match=f"job {name}: no edge {frm} -> {to}"):
                    r.set_phase(to.value, f"to {to}")
                assert r.phase is frm  # refused before anything was written
                assert (db.job(name)["phase"], db.job(name)["phase_detail"]) == (frm, "before")
                refused += 1
    assert taken == sum(map(len, JOB_EDGES.values())) and refused == 64 - taken


def test_a_phase_outside_the_vocabulary_and_a_late_resume_are_refused(db: StateDB) -> None:
    r = _runner(db, "job")
    with pytest.raises(PhaseError, match="'gave_up' is not a JobPhase"):
        r.set_phase("gave_up")  # a metrics state, not a phase
    r.set_phase("new", resumed=True)
    r.set_phase("starting", "run 1")
    with pytest.raises(PhaseError, match="resuming phase 'running' after the daemon changed it"):
        r.set_phase("running", resumed=True)
    assert r.phase is JobPhase.STARTING and db.job("job")["phase"] == "starting"


def test_a_dry_run_keeps_its_phase_to_itself(db: StateDB) -> None:
    r = _runner(db, "job")
    r.set_phase(JobPhase.STOPPED, "dry run: not started", persist=False)
    assert r.phase is JobPhase.STOPPED
    row = db.job("job")
    assert (row["phase"], row["phase_detail"]) == ("new", "dry run: not started")


def test_no_code_assigns_a_phase_but_the_mutators() -> None:
    import re

    root = Path(__file__).resolve().parents[1] / "stallwatch" / "daemon"
    found = [f"{p.name}:{n}: {line.strip()}" for p in sorted(root.glob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\.(_?phase)\s*=[^=]", line)]
    # job.py: the initial phase, set_phase's edge and its resume; recovery.py: the first phase
    # and _move's edge.
    assert len(found) == 5, "\n".join(found)


def test_the_docs_show_the_table_of_edges() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "daemon.md").read_text()
    for frm, to in JOB_EDGES.items():
        row = f"| `{frm}` | " + ", ".join(f"`{t}`" for t in JobPhase if t in to) + " |"
        assert row in text, row


def test_a_recovery_walks_to_done_with_the_actions_it_is_given(db: StateDB, tmp_path: Path) -> None:
    """The actions arrive through options.Actions (the one seam for fakes): a kill whose senders
    record what they send (and send it, to a real child), a validation that reports one
    quarantined file; the recovery reads both typed and asks its job (a RecoveryHost) for the
    restart."""
    import functools
    import os
    import signal
    import subprocess
    import time
    from types import SimpleNamespace

    from stallwatch.actions.kill import KillOperation
    from stallwatch.actions.validate import Quarantined, ValidationReport
    from stallwatch.daemon.options import Actions, RecoveryOptions
    from stallwatch.daemon.recovery import Recovery
    from stallwatch.daemon.supervise import proc_state
    from stallwatch.vocab import RecoveryPhase

    sent: list[tuple[int, int]] = []

    def send(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        os.kill(pid, sig)
    validated: list[tuple] = []

    def validate(outputs, since, qdir, **kw):
        validated.append((outputs, qdir, kw["candidates"], kw["dry_run"]))
        return ValidationReport(outputs_dir=str(outputs), quarantine_dir=str(qdir), since_wall=since,
                                checked=2, valid=1,
                                quarantined=(Quarantined("a.pt", "q/a.pt", "zip cut short"),))

    clock = FakeClock()
    db.ensure_job("job", "command", "{}")
    iid, _ = db.open_incident("job", "hang", "hung", {})
    restarted: list[tuple[int, int]] = []
    phases: list[str] = []
    job = SimpleNamespace(
        cfg=JobConfig(name="job", command=["true"], outputs=tmp_path / "out", restart="on-failure",
                      restart_backoff_s=1.0),
        dry_run=False, set_phase=lambda phase, detail="", **kw: phases.append(f"{phase}: {detail}"),
        emit_alert=lambda *a, **kw: None, restarts=lambda: 0, restart_streak=lambda: 0,
        restart=lambda attempt, incident: restarted.append((attempt, incident)),
        resolve_by_restart=lambda incident, attempt: None)
    actions = Actions(kill=functools.partial(KillOperation, kill=send, killpg=send), validate=validate)
    opts = RecoveryOptions(name="job", clock=clock, db=db, state_dir=tmp_path, evidence_timeout_s=1.0,
                           run_started_wall=None, actions=actions)
    child = subprocess.Popen(["sleep", "60"])
    try:
        st = proc_state(child.pid)
        assert st is not None
        rec = Recovery(opts, job, iid, "hang", targets=[(child.pid, st[1])], pgid=None,
                       gpu_pids=set(), candidates=["out/a.pt"], failure_wall=0.0)
        deadline = time.monotonic() + 20
        while not rec.finished and time.monotonic() < deadline:
            rec.step(None)
            if rec.phase is RecoveryPhase.VALIDATE and rec.validation is not None:
                rec.validation.result(timeout=10)  # the worker thread's answer, not a sleep
            if sent:
                child.wait(10)  # its end, after the SIGTERM (reaped: not a zombie of ours)
            if rec.phase is RecoveryPhase.BACKOFF:
                clock.advance(0.5)  # only the backoff waits on the clock
    finally:
        child.kill()
        child.wait(10)
    assert rec.phase is RecoveryPhase.DONE and restarted == [(1, iid)]
    assert validated == [(tmp_path / "out", tmp_path / "quarantine" / "job", ["out/a.pt"], False)]
    acts = {a["what"]: a["outcome"] for a in db.actions(iid)}
    assert sent[0] == (child.pid, signal.SIGTERM) and {p for p, _ in sent} == {child.pid}, sent
    assert acts["kill"].startswith("done: ") and "SIGTERM" in acts["kill"], acts["kill"]
    assert acts["validate"] == "checked 2, valid 1, quarantined 1: a.pt → q/a.pt (zip cut short)"
    assert phases[-1] == "recovering: hang: restart"
