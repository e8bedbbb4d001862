"""`stallwatch run`: the daemon that supervises jobs, diagnoses them every tick and acts.

Kept import-light on purpose: `python -m stallwatch.daemon.wrap` (the tiny parent of every
supervised job) imports this package, and must start fast and pull in nothing it does not need.

Modules:
    wrap        the job's parent: waits for it, writes its exit status atomically to a file
    supervise   starting a job (setsid, or a transient systemd unit), status files, identity
    job         one job: collector → features → rules → incidents → actions, once per tick, in
                layers: jobstate (state, phase, collector), incidents, jobrun (start-up, the
                run, its exit, acting), job (the tick); reconcile (intents left at start-up)
    options     what the daemon hands a job and a recovery: typed options, the actions' seam
    recovery    the kill → wait → GPU → validate → backoff → restart state machine
    core        the loop, signals (HUP reload, TERM/INT stop), sd_notify, metrics
    status      `stallwatch status`: the state database as JSON or a table
"""

from __future__ import annotations

__all__ = ["Daemon", "run_daemon"]


def __getattr__(name: str):
    if name in __all__:
        from stallwatch.daemon import core

        return getattr(core, name)
    raise AttributeError(name)
