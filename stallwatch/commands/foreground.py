"""The daemon with its jobs in the foreground: `stallwatch run -- COMMAND` and `[daemon]
exit_with_jobs = true`.

It is the daemon (stallwatch.daemon.core) with three differences, nothing else:
- it exits once every supervised job has ended for good (finished, stopped, given up), with the
  job's status: its exit code (128 + N for signal N, as a shell says it), or, when stallwatch
  gave up on it (restart budget used up, outputs it could not set aside), the verdict's code as
  `diagnose` gives it (2 for crash, hang, io_stall);
- SIGINT and SIGTERM are passed to the job, as its own Ctrl-C would reach it: the job runs in a
  session of its own (so that a daemon restart never kills it), so the terminal's Ctrl-C reaches
  only stallwatch, which forwards it to the job's process group (each press, as the terminal
  would) and then waits for the job to end. Nothing is restarted after that: the user stopped it;
- after each tick a view (stallwatch.commands.live: the footer on a terminal, plain lines elsewhere) is
  shown the jobs.

A daemon whose config does not say exit_with_jobs keeps the service behaviour: SIGINT and SIGTERM
stop the daemon and leave the jobs running.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from stallwatch.daemon.core import Daemon
from stallwatch.daemon.job import JobRunner
from stallwatch.daemon.jobstate import TERMINAL
from stallwatch.daemon.supervise import identity_exists

log = logging.getLogger("stallwatch.daemon")

__all__ = ["ForegroundDaemon", "exit_status"]

_PASSED = (signal.SIGINT, signal.SIGTERM)
_NAGIOS = {"healthy": 0, "finished": 0, "slow": 1, "unknown": 3}
_GONE_S = 5.0
QUICK_TICK_S = 0.25
QUICK_FOR_S = 10.0  # a watched job gone this long ends the watch whatever the verdict says


def exit_status(returncode: int | None) -> int:
    """A wrapper's returncode as a shell's `$?`: the code, or 128 + N for signal N."""
    if returncode is None:
        return 3
    return returncode if returncode >= 0 else 128 - returncode


class ForegroundDaemon(Daemon):
    def __init__(self, config: Any, *, view: Any = None, start_in_dry_run: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.view = view
        # `stallwatch run --dry-run -- CMD` starts what the user typed; only stallwatch's own
        # actions (kill, quarantine, restart) are dry. The daemon's dry run starts nothing.
        self.start_in_dry_run = start_in_dry_run
        self.interrupted: int | None = None  # the last signal passed to the jobs
        self.exit_code: int | None = None
        self._signals: list[int] = []
        self.final_views: list[dict[str, Any]] = []
        self.opened_wall: float | None = None  # the view shows this run's incidents only

    # ---------------------------------------------------------------------------- signals

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum in _PASSED:
            self._signals.append(signum)  # passed on by the loop (on_wake), not in a handler
            return
        super()._on_signal(signum, frame)

    def on_wake(self) -> None:
        while self._signals:
            self.pass_signal(self._signals.pop(0))

    def pass_signal(self, signum: int) -> None:
        """Send `signum` to every supervised job's process group; from now on nothing is
        restarted (a recovery in progress gives up at its backoff: restart = "no")."""
        self.interrupted = signum
        name = signal.Signals(signum).name
        if not any(r.cfg.supervised for r in self.jobs.values()):
            # `stallwatch watch`: the job is not ours; Ctrl-C ends the watch, never the job.
            self.exit_code = max((_NAGIOS.get(r.verdict.kind if r.verdict else "unknown", 2)
                                  for r in self.jobs.values()), default=3)
            self.request_stop()
            return
        for r in self.jobs.values():
            if not r.cfg.supervised or r.phase in TERMINAL:
                continue
            if r.cfg.restart != "no":
                r.cfg = r.cfg.model_copy(update={"restart": "no"})
            sent = _signal_run(r.run_row or {}, signum)
            r.db.add_action(r.name, "interrupt", f"{name} passed to the job ({sent})")
            log.info("job %s: %s passed to the job (%s)", r.name, name, sent)
        if self.view is not None:
            self.view.note(f"{name} passed to the job; waiting for it to end")

    # ------------------------------------------------------------------------------ ticks

    def _keep_previous_log(self, job: Any) -> None:
        """The log stallwatch keeps (state_dir/logs, never a --log of the user's) starts empty
        for a new run of the command, the previous one kept as NAME.log.1: its last progress
        line is not this run's."""
        if job.log is not None:
            return
        path = self.state_dir / "logs" / f"{job.name}.log"
        try:
            os.replace(path, path.with_name(path.name + ".1"))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("job %s: cannot set the previous log aside: %s", job.name, e)

    def next_interval(self, interval: float) -> float:
        """Quick ticks (QUICK_TICK_S) while a job has no verdict yet, for at most QUICK_FOR_S:
        the job's first progress line is judged when it appears, not up to a tick later."""
        quick = (self.ticks * QUICK_TICK_S < QUICK_FOR_S and any(
            r.verdict is None or r.verdict.kind == "unknown" for r in self.jobs.values()))
        return min(interval, QUICK_TICK_S) if quick else interval

    def before_jobs(self) -> None:
        """A job that ended (finished, stopped, given up) under an earlier run of this command
        is started again: a foreground run means "run it now". One still running (stallwatch was
        killed, the job was not) is re-attached to, never started a second time beside itself."""
        now = self.opened_wall = self.clock.time()
        for job in self.config.job:
            row = self.db.job(job.name)
            if not job.supervised or row is None:
                continue
            if row["phase"] in TERMINAL or row["phase"] == "new":
                with self.db.tx():
                    for inc in self.db.open_incidents(job.name):
                        self.db.resolve_incident(inc["id"], now)
                    self.db.update_job(job.name, phase="new", phase_detail="", restarts=0,
                                       recovery_incident=None)
                    self.db.set_meta(f"restart_streak_base:{job.name}", 0)
                self._keep_previous_log(job)
            else:
                log.warning("job %s: still %s from an earlier run (pid %s): re-attaching to it, "
                            "not starting it again", job.name, row["phase"], row["pid"])

    def open(self) -> None:
        super().open()
        if self.start_in_dry_run:
            for r in self.jobs.values():
                if r.cfg.supervised and r.run_row is None and r.phase == "stopped":
                    r._spawn("start", None, None)

    def tick(self) -> None:
        if self.interrupted is None:
            super().tick()
        else:
            self._wait_for_the_end(self.interrupted)
        if self.view is not None:
            try:
                self.view.update(self)
            except Exception:  # a drawing bug must not stop the watch
                log.exception("the live view failed; going on without it")
                self.view = None
        code = self._ended()
        if code is not None:
            self.exit_code = code
            self.request_stop()

    def _wait_for_the_end(self, signum: int) -> None:
        """After a passed Ctrl-C the job's end is the user's doing, not a crash to judge, alert
        and restart: only its exit is collected, and the job marked stopped."""
        name = signal.Signals(signum).name
        for r in self.jobs.values():
            if not r.cfg.supervised or r.phase in TERMINAL:
                continue
            r.recovery = None
            r._poll_run()
            if r.exit_noted or r.synthetic is not None:
                how = "lost" if not r.exit_noted else (
                    f"killed by {_signame(-(r.exit_rc or 0))}" if (r.exit_rc or 0) < 0
                    else f"exit code {r.exit_rc}")
                r.set_phase("stopped", f"stopped by {name} from the terminal: {how}",
                            recovery_incident=None)
                log.info("job %s: stopped by %s: %s", r.name, name, how)

    def _ended(self) -> int | None:
        runners = [r for r in self.jobs.values() if r.cfg.supervised]
        if not runners:
            return self._watched_ended()
        if not runners or any(r.phase not in TERMINAL or r.recovery is not None
                              or _bundle_pending(r) for r in runners):
            return None
        return max(self._code(r) for r in runners)

    def _watched_ended(self) -> int | None:
        """Jobs stallwatch did not start (`watch`): ended when every one has exited and its
        verdict says how (finished, crash), or has been gone for `_GONE_S`."""
        codes = []
        for r in self.jobs.values():
            if r.recovery is not None:  # --restart-command: killing it, or about to restart it
                return None
            j = (r.last_vars or {}).get("job") or {}
            kind = r.verdict.kind if r.verdict is not None else "unknown"
            if not (j.get("seen") and not j.get("alive")):
                return None
            if kind not in ("finished", "crash") and j.get("exited_for_s", 0.0) < _GONE_S:
                return None
            codes.append(_NAGIOS.get(kind, 2))
        return max(codes) if codes else None

    def _code(self, r: JobRunner) -> int:
        last = [a for a in self.db.job_actions(r.name)
                if a["what"] in ("start", "restart", "give_up", "interrupt")][-1:]
        if last and last[0]["what"] == "give_up":  # stallwatch gave up: the verdict's code
            inc = self.db.incident(last[0]["incident_id"]) if last[0]["incident_id"] else None
            return _NAGIOS.get(inc["kind"] if inc else "crash", 2)
        if r.phase == "finished":
            return 0
        if r.exit_noted:
            return exit_status(r.exit_rc)
        if r.synthetic is not None or r.run_row is None:
            return 2  # lost, or could not be started: no status of its own
        return exit_status((r.run_row or {}).get("returncode"))

    def shutdown(self) -> None:
        if self.view is not None and self._db is not None:
            try:  # what the view shows last, while the state database is still open
                from stallwatch.commands.live import job_view

                self.final_views = [job_view(r, since_wall=self.opened_wall) for r in self.jobs.values()]
            except Exception:
                log.exception("the live view's last state")
        super().shutdown()

    def run(self) -> int:
        super().run()
        return self.exit_code if self.exit_code is not None else 0


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _bundle_pending(r: JobRunner) -> bool:
    """An evidence bundle still being written: exiting now would cut it off."""
    return any(inc.get("evidence_future") is not None and not inc["evidence_future"].done()
               for inc in r.incidents.values())


def _signal_run(run: dict[str, Any], signum: int) -> str:
    """Signal the run's process group, identity-checked (never a reused pid's group); before
    the job exists, its wrapper, which passes the signal on as soon as the job runs."""
    pid, ticks, pgid = run.get("pid"), run.get("start_ticks"), run.get("pgid")
    if pid and pgid and identity_exists(pid, ticks):
        try:
            os.killpg(pgid, signum)
            return f"process group {pgid}"
        except ProcessLookupError:
            return "already gone"
    wpid, wticks = run.get("wrapper_pid"), run.get("wrapper_start_ticks")
    if wpid and identity_exists(wpid, wticks):
        try:
            os.kill(wpid, signum)
            return f"its wrapper, pid {wpid}"
        except ProcessLookupError:
            pass
    return "no live process"
