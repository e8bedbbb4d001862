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
