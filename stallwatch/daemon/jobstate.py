"""One job under the daemon, first layer: its state, its phase, its collector.

JobRunner (daemon/job.py) is built in layers, a module each, every layer reading the ones below:
jobstate (what it remembers, set_phase, the collector) -> incidents (incidents, the decision to
recover or settle, alerts) -> jobrun (taking the job over at start-up, spawning it, following
its run, its exit and its pid file) -> job (the tick, reloads, what a tick persists).
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from stallwatch.daemon.config import JobConfig
from stallwatch.daemon.alertmemory import AlertMemory
from stallwatch.daemon.options import JobOptions, RecoveryOptions
from stallwatch.daemon.recovery import Recovery
from stallwatch.daemon.supervise import (SpawnError, proc_comm, read_status, resolve_user,
                                         status_authentic)
from stallwatch.daemon.watchwarn import WatchWarnings, job_uid
from stallwatch.engine import Evaluator, RuleSet
from stallwatch.engine.alerting import Evaluation, Verdict
from stallwatch.engine.history import History, sparkline_text, sparklines
from stallwatch.probes.collector import Collector
from stallwatch.probes.snapshot import Snapshot
from stallwatch.vocab import JOB_EDGES, TERMINAL_PHASES, JobPhase, PhaseError, edge

log = logging.getLogger("stallwatch.daemon")

HISTORY_WINDOW_S = 300.0  # what the sparklines show: the last five minutes
HISTORY_SAVE_S = 5.0  # how often the history is written for `status` (one JSON row)
TERMINAL = TERMINAL_PHASES


def verdict_doc(v: Verdict, at: float | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": v.kind, "summary": v.summary,
           "evidence": [{"signal": e.signal, "detail": e.detail} for e in v.evidence],
           "advice": list(v.advice), "cause": v.cause, "rule": v.rule, "severity": v.severity}
    if at is not None:
        doc["at"] = at
    return doc


class JobState:
    """What the runner remembers of its job between ticks, its phase (set_phase, the one mutator),
    its restart counts and its collector."""

    def __init__(self, opts: JobOptions, cfg: JobConfig, rules: RuleSet) -> None:
        self.opts = opts
        self.cfg = cfg
        self.name = cfg.name
        self.db = opts.db
        self.clock = opts.clock
        self.actions = opts.actions
        self.rules = rules
        self.evaluator = Evaluator(rules)
        self.alert_memory = AlertMemory(self.name, self.db)  # timers and health, in the db
        self.collector: Collector | None = None
        self._phase = JobPhase.NEW  # changed by set_phase only
        self._phase_changed = False  # set_phase took an edge: no more resuming from the database
        self.run_row: dict[str, Any] | None = None
        self.popen: subprocess.Popen | None = None  # our wrapper (setsid) or systemd-run, while our child
        self.exit_noted = False
        self.exit_rc: int | None = None
        self.synthetic: Verdict | None = None  # the daemon's own verdict: job lost, cannot start
        self.recovery: Recovery | None = None
        self.incidents: dict[str, dict[str, Any]] = {}
        self._proved_run: int | None = None  # the run whose good behaviour reset the streak
        self.last_snap: Snapshot | None = None
        self.last_alive_snap: Snapshot | None = None
        self.last_eval: Evaluation | None = None
        self.last_vars: dict[str, Any] | None = None
        self.verdict: Verdict | None = None
        self._gone_ticks = 0
        self._starting_since: float | None = None
        self._pid_file_pid: int | None = None
        self._pid_file_read_mono: float | None = None
        self._spawn_error = ""
        self._refused_status: set[str] = set()
        self._pid_file_refused = ""
        self._log_refused = ""
        self.dry_run_done: set[int] = set()  # incidents a dry run already walked through
        self._slurm_ask: tuple[int, Any] | None = None  # (run id, Future of its JobState)
        self._watch = WatchWarnings(self.name)
        self.watch_warnings: list[str] = []  # rules failing tick after tick, a too-wide tree
        self.last_tick_s: float | None = None  # how long its previous tick took (the daemon's)
        self.next_due = 0.0  # monotonic; later than now after a tick over its deadline (core)
        self.overruns = 0  # ticks over the deadline in a row
        # The last minutes as numbers (stallwatch.engine.history): sparklines in the live view, alerts,
        # evidence and `status` (saved in the state database every HISTORY_SAVE_S).
        self.history = History()
        self._history_saved_mono: float | None = None
        self._history_saved_n = -1  # history.added when it was last saved

    # ------------------------------------------------------------------------------ helpers

    @property
    def daemon_cfg(self):
        return self.opts.settings()

    @property
    def dry_run(self) -> bool:
        return self.cfg.dry_run if self.cfg.dry_run is not None else self.daemon_cfg.dry_run

    @property
    def mode(self) -> str:
        return "command" if self.cfg.command else ("pid_file" if self.cfg.pid_file else "match")

    def log_path(self) -> Path | None:
        if self.cfg.log is not None:
            return self.cfg.log
        if self.cfg.supervised:
            return self.opts.state_dir / "logs" / f"{self.name}.log"
        return None

    def _current_run(self) -> dict[str, Any]:
        """The run the job is on: start or adoption sets it before anything reads it."""
        if self.run_row is None:
            raise RuntimeError(f"job {self.name}: no run yet")
        return self.run_row

    def _status(self, run: dict[str, Any] | None = None, path: Any = None) -> dict[str, Any] | None:
        """The run's status document, only once it is proved the wrapper's (status_authentic):
        a forged one is refused, said once, and never adopted or signalled."""
        run = run if run is not None else (self.run_row or {})
        path = path or run.get("status_file")
        doc = read_status(path)
        if doc is None:
            return None
        why = status_authentic(doc, path, wrapper=(run.get("wrapper_pid"),
                                                   run.get("wrapper_start_ticks")))
        if why:
            if why not in self._refused_status:
                self._refused_status.add(why)
                log.warning("job %s: status file %s refused: %s", self.name, path, why)
            return None
        return doc

    @property
    def phase(self) -> JobPhase:
        return self._phase

    def set_phase(self, phase: str, detail: str = "", *, persist: bool = True,
                  resumed: bool = False, **extra: Any) -> None:
        """The only code that changes `phase`. An edge not in stallwatch.vocab.JOB_EDGES raises
        PhaseError before anything is written; otherwise the phase, its detail and the `extra`
        job columns are written in one update.

        persist=False: the phase is this daemon's only (a dry run that did not start the job: the
        row keeps `new`, so that a later daemon that is not a dry run starts it).
        resumed=True: the phase the state database holds at start-up, where the previous daemon
        left the job (JobRunner.start, once, before any edge): not an edge, and written nowhere.
        Before that, start-up may write the row itself (reconcile_intents finishing a spawn,
        _adopt_orphan, a reset for a changed config): the previous daemon's changes, finished."""
        if resumed:
            if self._phase_changed:
                raise PhaseError(f"job {self.name}: resuming phase {phase!r} after the daemon "
                                 f"changed it (now {self._phase})")
            self._phase = JobPhase(phase)
            return
        to = edge(JOB_EDGES, self._phase, phase, f"job {self.name}")
        if persist:
            extra["phase"] = to.value
        self.db.update_job(self.name, phase_detail=detail, **extra)
        self._phase = to
        self._phase_changed = True

    def unwatch(self) -> None:
        """Removed from the config by a reload: no longer watched, left running if it runs."""
        self.set_phase(JobPhase.UNWATCHED, "removed from the config: no longer watched (left "
                                           "running if it runs)")
        self.close()

    def restarts(self) -> int:
        row = self.db.job(self.name)
        return int(row["restarts"]) if row else 0

    def _streak_key(self) -> str:
        return f"restart_streak_base:{self.name}"

    def restart_streak(self) -> int:
        """Restarts since the last run that proved itself (restart_reset_after_s up with no
        incident open): what the backoff and the budget count."""
        done = self.restarts()
        try:
            base = int(self.db.get_meta(self._streak_key()) or 0)
        except ValueError:
            base = 0
        return max(0, done - min(base, done))

    def _forget_streak_after_a_good_run(self) -> None:
        # Without this, restarts hours apart added up: a 10-hour job gave up at its fourth
        # transient hang, and the backoff doubled from one incident to the next (the 30-minute
        # soak's restarts waited 64, 128, 256, 300 s, so later faults hit a job still waiting).
        reset = self.cfg.restart_reset_after_s
        if (not reset or not self.cfg.supervised or self.run_row is None or self.recovery is not None
                or self.phase != "running" or self.run_row.get("id") == self._proved_run):
            return
        up_s = self.clock.time() - self.run_row["started_at"]
        if up_s < reset or self.incidents:
            return
        self._proved_run = self.run_row.get("id")  # once per run: no state reads every tick
        if self.restart_streak() == 0:
            return
        done = self.restarts()
        self.db.set_meta(self._streak_key(), done)
        log.info("job %s: run %s up %.0f s with no incident: the restart streak starts over "
                 "(%d restart(s) in all)", self.name, self.run_row.get("seq"), up_s, done)

    def run_started_wall(self) -> float | None:
        return self.run_row["started_at"] if self.run_row else None

    def config_json(self) -> str:
        return self.cfg.model_dump_json()

    # ----------------------------------------------------------------------- the collector

    def _target(self, pids: tuple[int, ...] = ()):
        from stallwatch.probes.targets import Target

        run_as = None
        if self.cfg.log is not None:  # the default log is root's (state_dir/logs): no check
            try:
                run_as = resolve_user(self.cfg.user, self.cfg.group)
            except SpawnError:
                pass  # said where it matters: the start fails with it
        return Target(name=self.name, pids=pids, match=self.cfg.match, log=self.log_path(),
                      progress_regex=self.cfg.progress_regex, outputs=self.cfg.outputs,
                      server=self.cfg.server, log_reader_uid=run_as.uid if run_as else None,
                      log_reader_gids=(run_as.gid, *run_as.groups) if run_as else (),
                      server_log=self.cfg.server_log)

    def _ensure_collector(self, pids: tuple[int, ...] = ()) -> Collector:
        if self.collector is not None:
            return self.collector
        from stallwatch.probes.kmsg import KmsgProbe

        c = self.collector = Collector(self._target(pids), clock=self.clock,
                                       deadline_s=self.daemon_cfg.probe_deadline_s,
                                       gpu=self.opts.gpu)
        c.processes = self._processes_probe(c.target)
        row = self.db.job(self.name)
        boot = self.opts.boot_id
        if row and row.get("kmsg_cursor") is not None and row.get("kmsg_boot_id") == boot:
            # Same boot: read what the kernel said while no daemon was watching (an OOM kill).
            try:
                c.kmsg.close()
            except Exception:  # noqa: BLE001 - the probe is replaced either way
                pass
            c.kmsg = KmsgProbe(clock=self.clock, cursor=row["kmsg_cursor"])
        return c

    def _processes_probe(self, target: Any, **kw: Any) -> Any:
        """The job's processes probe, bounded (issue 22 #9, #10): the caps of its config, half
        its tick deadline to examine the tree, and --match limited to its user when known."""
        from stallwatch.probes.processes import ProcessesProbe

        return ProcessesProbe(target, clock=self.clock, max_processes=self.cfg.max_processes,
                              max_job_threads=self.cfg.max_threads,
                              budget_s=self.daemon_cfg.job_tick_deadline_s / 2,
                              match_uid=job_uid(self.cfg), **kw)

    def set_target(self, pid: int, start_ticks: int) -> None:
        """Watch (pid, start_ticks) from now on; a new run gets a fresh processes probe."""
        c = self._ensure_collector()
        target = self._target((pid,))
        c.target = target
        name = self._known_name(pid, start_ticks)
        c.processes = self._processes_probe(
            target, known_starts={pid: start_ticks}, known_names={pid: name} if name else None)
        self.exit_noted = False
        self.exit_rc = None
        self.synthetic = None
        self._gone_ticks = 0

    def _known_name(self, pid: int, start_ticks: int) -> str:
        """What (pid, start_ticks) is called, for when it is gone before the probe's first
        tick: its comm if it is still there (a zombie too); else, for a job we start, the
        basename of argv[0] cut to 15 bytes, which is what the kernel names it at exec
        (TASK_COMM_LEN)."""
        comm = proc_comm(pid, start_ticks)
        if comm:
            return comm
        if self.cfg.command:
            return os.path.basename(self.cfg.command[0]).encode()[:15].decode(errors="ignore")
        return ""

    def _recovery_options(self) -> RecoveryOptions:
        return RecoveryOptions(name=self.name, clock=self.clock, db=self.db,
                               state_dir=self.opts.state_dir,
                               evidence_timeout_s=self.daemon_cfg.evidence_timeout_s,
                               run_started_wall=self.run_started_wall(), actions=self.actions)

    def _forget_processes(self) -> None:
        """A new run starts: the old run's processes and exits are history, not this run's."""
        if self.collector is not None and self.cfg.supervised:
            target = self._target(())
            self.collector.target = target
            self.collector.processes = self._processes_probe(target)
            if self.collector.log is not None:
                self.collector.log.new_run()

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
            self.collector = None

    def sparklines(self) -> str:
        return sparkline_text(sparklines(list(self.history.samples), HISTORY_WINDOW_S))
