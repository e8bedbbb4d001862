"""The words every stage shares: verdict kinds, severities, job and recovery phases.

Standard library only, importing nothing of stallwatch (as supervisor's states.py), so the rules
engine, the alert policies, the metrics and the daemon all read one spelling. The verdict kinds
and severities are the public contract (docs/contract.md): extend, never rename.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

# -- verdicts (docs/contract.md, "Verdict kinds")

VERDICT_KINDS: tuple[str, ...] = ("healthy", "slow", "hang", "io_stall", "server_hang",
                                  "server_down", "crash", "gpu_fault", "disk_full", "finished",
                                  "unknown")
# A problem verdict opens an incident (daemon/incidents.py); healthy, finished and unknown never do.
PROBLEM_KINDS: tuple[str, ...] = ("hang", "io_stall", "server_hang", "server_down", "crash",
                                  "gpu_fault", "disk_full", "slow")
INCIDENT_KINDS: tuple[str, ...] = tuple(k for k in VERDICT_KINDS
                                        if k not in ("healthy", "finished", "unknown"))
# What `restart = "on-failure"` restarts: the fault is the job's. server_hang, server_down,
# gpu_fault and disk_full are outside it: restarting the client would only burn the budget.
RESTART_KINDS: tuple[str, ...] = ("crash", "hang", "io_stall")
STALL_KINDS: tuple[str, ...] = ("hang", "io_stall")  # held back during a start-up grace

SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")
SEVERITY_RANK: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}


E = TypeVar("E", bound=StrEnum)


# -- a job's phase (jobs.phase in the state database; `stallwatch status`)

class JobPhase(StrEnum):
    """A str (its value), so that rows, JSON and f-strings keep their plain spelling."""
    NEW = "new"                # configured, not started yet
    STARTING = "starting"      # supervised, being spawned
    RUNNING = "running"        # supervised, its process is alive
    ATTACHED = "attached"      # started elsewhere, watched only
    RECOVERING = "recovering"  # kill → wait → validate → backoff → restart in progress
    STOPPED = "stopped"        # not running and not restarted
    FINISHED = "finished"      # exited with code 0
    UNWATCHED = "unwatched"    # removed from the config: no longer watched


class PhaseError(ValueError):
    """A phase change not in its machine's table of edges: a bug in the caller, refused before
    anything was changed or written (supervisor's _assertInState, Prometheus' panic on an
    unknown state). The daemon's tick logs it with its traceback (daemon/core.py)."""


def edge(edges: Mapping[E, frozenset[E]], frm: E, to: str, what: str) -> E:
    """`to` as a phase of `frm`'s machine if `frm -> to` is one of `edges`, else PhaseError.
    `what` names the machine in the message ("job x", "job x: recovery from hang")."""
    kind = type(frm)
    try:
        target = kind(to)
    except ValueError:
        raise PhaseError(f"{what}: {to!r} is not a {kind.__name__}") from None
    if target not in edges[frm]:
        raise PhaseError(f"{what}: no edge {frm} -> {target}")
    return target


_J = JobPhase
# Every change of a job's phase that the daemon makes, as data (JobRunner.set_phase, in
# daemon/jobstate.py, is the only code that takes one). A phase read back from the state database at start-up is not
# an edge: it is where the previous daemon left the job (JobRunner.start resumes it, once).
# A phase may lead to itself where the daemon says something new about it (its detail): a
# running job re-attached to, each step of a recovery.
_ANYWHERE = frozenset({_J.UNWATCHED})  # removed from the config (a reload): from any phase
JOB_EDGES: dict[JobPhase, frozenset[JobPhase]] = {
    # started; not started (dry run, cannot start); a watched job taken over; removed
    _J.NEW: frozenset({_J.STARTING, _J.STOPPED, _J.ATTACHED}) | _ANYWHERE,
    # its pid known; lost and recovered, or stopped; exited 0 before its first tick
    _J.STARTING: frozenset({_J.RUNNING, _J.RECOVERING, _J.STOPPED, _J.FINISHED}) | _ANYWHERE,
    _J.RUNNING: frozenset({_J.RUNNING, _J.RECOVERING, _J.STOPPED, _J.FINISHED}) | _ANYWHERE,
    # killed for its restart_command
    _J.ATTACHED: frozenset({_J.ATTACHED, _J.RECOVERING}) | _ANYWHERE,
    # each step; a dry run left as it is, or nothing to resume; restarted; gave up; a watched
    # job whose recovery a daemon restart interrupted is watched again (never resumed)
    _J.RECOVERING: frozenset({_J.RECOVERING, _J.RUNNING, _J.STARTING, _J.STOPPED,
                              _J.ATTACHED}) | _ANYWHERE,
    # its config changed (started afresh); started from the terminal (a dry run's `run`); a
    # watched job a recovery gave up on is watched again by the next daemon
    _J.STOPPED: frozenset({_J.NEW, _J.STARTING, _J.ATTACHED}) | _ANYWHERE,
    _J.FINISHED: frozenset({_J.NEW}) | _ANYWHERE,
    # back in the config: as a job comes back after a daemon restart
    _J.UNWATCHED: frozenset({_J.STARTING, _J.RUNNING, _J.ATTACHED, _J.STOPPED, _J.FINISHED}),
}
del _J

TERMINAL_PHASES: tuple[str, ...] = (JobPhase.FINISHED.value, JobPhase.STOPPED.value)
# `stallwatch_job_state`: the phases a configured job shows, plus gave_up (stopped, the restart
# budget spent).
JOB_STATES: tuple[str, ...] = ("new", "starting", "running", "attached", "recovering", "stopped",
                               "finished", "gave_up")


# -- a recovery's phase (daemon/recovery.py), with its allowed edges as data

class RecoveryPhase(StrEnum):
    EVIDENCE = "evidence"
    KILL = "kill"
    WAIT_GONE = "wait_gone"
    WAIT_GPU = "wait_gpu"
    VALIDATE = "validate"
    BACKOFF = "backoff"
    RESTART = "restart"
    DONE = "done"
    GAVE_UP = "gave_up"


_R = RecoveryPhase
RECOVERY_FIRST: frozenset[RecoveryPhase] = frozenset({_R.EVIDENCE, _R.KILL})
RECOVERY_EDGES: dict[RecoveryPhase, frozenset[RecoveryPhase]] = {
    _R.EVIDENCE: frozenset({_R.KILL}),
    _R.KILL: frozenset({_R.WAIT_GONE}),
    _R.WAIT_GONE: frozenset({_R.WAIT_GPU}),
    _R.WAIT_GPU: frozenset({_R.VALIDATE}),
    _R.VALIDATE: frozenset({_R.BACKOFF, _R.GAVE_UP}),
    _R.BACKOFF: frozenset({_R.BACKOFF, _R.RESTART, _R.GAVE_UP}),  # backoff → backoff: its wait
    _R.RESTART: frozenset({_R.DONE, _R.GAVE_UP}),
    _R.DONE: frozenset(),
    _R.GAVE_UP: frozenset(),
}
RECOVERY_FINAL: frozenset[RecoveryPhase] = frozenset({_R.DONE, _R.GAVE_UP})
del _R
