"""One vocabulary (stallwatch.vocab) and the phase machines that use it."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from stallwatch import vocab
from stallwatch.clock import FakeClock

ROOT = Path(__file__).resolve().parents[1]


def test_the_vocabulary_module_depends_on_nothing_of_stallwatch() -> None:
    tree = ast.parse((ROOT / "stallwatch" / "vocab.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "collections.abc", "enum", "typing"}  # stdlib only


def test_the_verdict_vocabulary_is_spelled_once() -> None:
    from stallwatch.daemon import metrics
    from stallwatch.alerts import config as alerts_config
    from stallwatch.engine import rulefile

    assert rulefile.KINDS is alerts_config.KINDS is metrics.VERDICT_KINDS is vocab.VERDICT_KINDS
    assert rulefile.SEVERITIES is alerts_config.SEVERITIES is vocab.SEVERITIES
    assert set(vocab.PROBLEM_KINDS) == set(vocab.INCIDENT_KINDS)
    assert set(vocab.RESTART_KINDS) <= set(vocab.PROBLEM_KINDS)


def _recovery():
    from stallwatch.daemon.recovery import Recovery

    from stallwatch.daemon.options import RecoveryOptions

    phases: list[str] = []
    job = SimpleNamespace(dry_run=False,
                          set_phase=lambda phase, detail="", **kw: phases.append(detail))
    opts = RecoveryOptions(name="job", clock=FakeClock(), db=None, state_dir=ROOT,  # type: ignore[arg-type]
                           evidence_timeout_s=1.0, run_started_wall=None)
    return Recovery(opts, job, 1, "hang", targets=[], pgid=None, gpu_pids=set(), candidates=[],
                    failure_wall=0.0), phases


def test_every_recovery_phase_has_a_step_and_a_row_of_edges() -> None:
    rec, _ = _recovery()
    assert set(rec._steps) == set(vocab.RecoveryPhase) == set(vocab.RECOVERY_EDGES)
    assert all(callable(step) for step in rec._steps.values())
    finals = {p for p, to in vocab.RECOVERY_EDGES.items() if not to}
    assert finals == vocab.RECOVERY_FINAL


def test_a_recovery_refuses_an_edge_not_in_the_table() -> None:
    rec, said = _recovery()
    assert rec.phase == vocab.RecoveryPhase.KILL and said == ["hang: kill"]
    with pytest.raises(ValueError, match="no edge kill -> restart"):
        rec._enter("restart")  # a restart before the job is known gone: never
    assert rec.phase == "kill" and said == ["hang: kill"]  # refused before anything was done
    rec._enter("wait_gone")
    assert said[-1] == "hang: wait_gone" and not rec.finished
    with pytest.raises(ValueError):
        rec._enter("sleeping")  # not a phase at all


def test_a_job_phase_outside_the_vocabulary_raises() -> None:
    assert vocab.JobPhase("running") == "running" and f"{vocab.JobPhase.RUNNING}" == "running"
    with pytest.raises(ValueError):
        vocab.JobPhase("gave_up")  # a metrics state, not a phase
    assert set(vocab.TERMINAL_PHASES) <= {p.value for p in vocab.JobPhase}


def test_a_recovery_takes_every_edge_of_its_table_and_refuses_every_other() -> None:
    taken = refused = 0
    for frm in vocab.RecoveryPhase:
        for to in vocab.RecoveryPhase:
            rec, _ = _recovery()
            rec.phase = frm  # the test puts it there; only _move changes it after __init__
            if to in vocab.RECOVERY_EDGES[frm]:
                assert rec._move(to) == to and rec.phase == to
                taken += 1
            else:
                with pytest.raises(vocab.PhaseError, match=f"no edge {frm} -> {to}"):
                    rec._move(to)
                assert rec.phase == frm
                refused += 1
    assert taken == sum(map(len, vocab.RECOVERY_EDGES.values())) and refused > taken


def test_every_job_phase_has_a_row_of_edges() -> None:
    assert set(vocab.JOB_EDGES) == set(vocab.JobPhase)
    # Nothing leads back to a job never seen, but a config change that starts it afresh.
    into_new = {p for p, to in vocab.JOB_EDGES.items() if vocab.JobPhase.NEW in to}
    assert into_new == {vocab.JobPhase.FINISHED, vocab.JobPhase.STOPPED}
