"""The words every stage shares: verdict kinds, severities, job and recovery phases.

Standard library only, importing nothing of stallwatch (as supervisor's states.py), so the rules
engine, the alert policies, the metrics and the daemon all read one spelling. The verdict kinds
and severities are the public contract (docs/contract.md): extend, never rename.
"""

from __future__ import annotations

from enum import StrEnum

# -- verdicts (docs/contract.md, "Verdict kinds")

VERDICT_KINDS: tuple[str, ...] = ("healthy", "slow", "hang", "io_stall", "server_hang",
                                  "server_down", "crash", "gpu_fault", "disk_full", "finished",
                                  "unknown")
# A problem verdict opens an incident (daemon/job.py); healthy, finished and unknown never do.
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
