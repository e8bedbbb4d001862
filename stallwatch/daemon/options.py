"""What the daemon hands its parts: narrow, typed things, never itself.

As Prometheus' rules.ManagerOptions (one struct of what a rule manager uses) and supervisor's
options (the OS behind one object that tests replace): a JobRunner gets JobOptions, a Recovery
gets RecoveryOptions plus a RecoveryHost (the few things it asks of its job while it runs), and
the side-effecting actions arrive as callables in Actions: the real ones by default, fakes in
tests, through this one seam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from stallwatch.actions.evidence import capture_evidence
from stallwatch.actions.kill import KillOperation
from stallwatch.actions.validate import ValidationReport, validate_outputs
from stallwatch.alerts.dispatcher import AlertDispatcher
from stallwatch.daemon.slurm import job_state

if TYPE_CHECKING:
    from stallwatch.clock import Clock
    from stallwatch.daemon.config import DaemonConfig, JobConfig
    from stallwatch.alerts.events import AlertEvent
    from stallwatch.daemon.state import StateDB


@dataclass(frozen=True)
class Actions:
    """The daemon's acts on the world, with the signatures of the real ones."""
    # (targets, pgid, *, grace_s, kill_wait_s, clock, dry_run) -> a kill to step tick by tick
    kill: Callable[..., KillOperation] = KillOperation
    # (outputs, since_wall, quarantine_dir, *, candidates, max_files, dry_run, budget_s, clock)
    validate: Callable[..., ValidationReport] = validate_outputs
    # (snapshot, verdict, bundle_dir, *, evaluation, features, clock, timeout_s, history)
    evidence: Callable[..., Path] = capture_evidence
    slurm_job_state: Callable[[str], str | None] = job_state  # job id -> JobState, or None
    # (alert configs, *, clock, state_dir, host) -> submit(event), status(), close()
    dispatcher: Callable[..., AlertDispatcher] = AlertDispatcher


@dataclass(frozen=True)
class JobOptions:
    """What a JobRunner uses of its daemon."""
    db: StateDB
    clock: Clock
    state_dir: Path
    host: str  # named in its alerts
    boot_id: str  # a kmsg cursor is only good within one boot
    gpu: bool  # watch the GPUs (NVML)
    submit_alert: Callable[[AlertEvent], None]
    settings: Callable[[], DaemonConfig]  # the [daemon] table as it is now: a reload replaces it
    actions: Actions = field(default_factory=Actions)


@dataclass(frozen=True)
class RecoveryOptions:
    """What a Recovery is given when it begins; what may change while it runs is its host's."""
    name: str
    clock: Clock
    db: StateDB
    state_dir: Path  # under which a job without its own quarantine_dir quarantines
    evidence_timeout_s: float  # how long the kill waits for the incident's evidence bundle
    run_started_wall: float | None  # the failed run's start: what validation looks back to
    actions: Actions = field(default_factory=Actions)


class RecoveryHost(Protocol):
    """What a recovery asks of its job (a JobRunner) while it runs: its settings as they are now
    (a reload, or Ctrl-C in the foreground that sets restart = "no", applies mid-recovery), its
    phase and alerts, its restart counts, and the restart itself."""

    @property
    def cfg(self) -> JobConfig: ...

    @property
    def dry_run(self) -> bool: ...

    def set_phase(self, phase: str, detail: str = "", **extra: Any) -> None: ...

    def emit_alert(self, incident_id: int, state: Literal["firing", "resolved"],
                   summary_override: str | None = None) -> None: ...

    def restarts(self) -> int: ...

    def restart_streak(self) -> int: ...

    def restart(self, attempt: int, incident_id: int) -> None: ...  # raises SpawnError

    def resolve_by_restart(self, incident_id: int, attempt: int) -> None: ...
