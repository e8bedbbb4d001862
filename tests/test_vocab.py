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
    assert imported <= {"__future__", "enum"}


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

    phases: list[str] = []
    runner = SimpleNamespace(name="job", clock=FakeClock(), dry_run=False,
                             set_phase=lambda phase, detail="", **kw: phases.append(detail))
    return Recovery(runner, 1, "hang", targets=[], pgid=None, gpu_pids=set(), candidates=[],
                    failure_wall=0.0), phases


def test_every_recovery_phase_has_a_step_and_a_row_of_edges() -> None:
    from stallwatch.daemon.recovery import Recovery

    assert set(Recovery._steps) == set(vocab.RecoveryPhase) == set(vocab.RECOVERY_EDGES)
    assert all(callable(getattr(Recovery, name)) for name in Recovery._steps.values())
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
