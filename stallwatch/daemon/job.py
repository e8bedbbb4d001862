"""One job under the daemon: observe, judge, remember, act — once per tick, never blocking.

Each tick: the wrapper's status file (did the job start? exit? with what status?) → collector
tick → features → rules (evaluator.evaluate(now = snapshot.t_mono)) → incidents → actions.

Incidents. One per job and verdict kind *episode*: opened when a problem verdict (hang, io_stall,
server_hang, server_down, crash, gpu_fault, disk_full, slow) is the job's verdict and no incident
of that kind is open; resolved when no rule of that kind fires any more, no recovery for it is
in progress, and the job's verdict is positive evidence of something else (healthy, slow,
finished, another problem) — not `unknown`. So a crash loop is one incident with several
restarts, and "resolved" means the job was seen working again, not merely restarted. Every
incident gets an evidence bundle and a firing alert; resolution sends a resolved alert.

Actions with restart = "on-failure" on crash, hang and io_stall: stallwatch.daemon.recovery.
server_hang, server_down, gpu_fault and disk_full never restart the job: the fault is outside it
(the server, a GPU that needs a health check, a full disk), and restarting the client would only
burn the restart budget; they alert and wait.

A freshly (re)started job gets `startup_grace_s` (default: the stall threshold the features
computed) before a stall verdict may kill it: its log's last progress line is the previous
run's, so "no progress for N s" is not yet about this run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from stallwatch.kernel import safefs
from stallwatch.kernel.proc import Proc
from stallwatch.kernel.roots import Absent, Denied
from stallwatch.daemon.config import JobConfig
from stallwatch.daemon.alertmemory import AlertMemory
from stallwatch.daemon.options import JobOptions, RecoveryOptions
from stallwatch.daemon.recovery import Recovery, candidates_from, run_in_thread
from stallwatch.daemon.supervise import (SpawnError, find_wrapper, identity_alive,
                                         identity_exists, proc_comm, proc_state, read_status,
                                         resolve_user, spawn, status_authentic, use_systemd_run)
from stallwatch.daemon.watchwarn import WatchWarnings, job_uid, with_width_evidence
from stallwatch.engine import Evaluator, RuleSet
from stallwatch.engine.alerting import AlertState, Evaluation, Verdict
from stallwatch.alerts.events import AlertEvent, EvidenceLine, ProgressInfo
from stallwatch.engine.features import features
from stallwatch.engine.history import History, sample, sparkline_text, sparklines
from stallwatch.vocab import (JOB_EDGES, PROBLEM_KINDS, RESTART_KINDS, STALL_KINDS,
                              TERMINAL_PHASES, JobPhase, PhaseError, edge)

log = logging.getLogger("stallwatch.daemon")

HISTORY_WINDOW_S = 300.0  # what the sparklines show: the last five minutes
HISTORY_SAVE_S = 5.0  # how often the history is written for `status` (one JSON row)
TERMINAL = TERMINAL_PHASES
PID_FILE_MAX_BYTES = 64  # "12345\n" and then some: a pid file is never more
# While the process the pid file named is alive, the file is re-read this often, not every tick
# (a read costs a worker-thread handoff: the file is on the job's filesystem, which may hang);
# every tick until then and from the tick its process is seen gone (issue 17).
PID_FILE_RECHECK_S = 5.0


def verdict_doc(v: Verdict, at: float | None = None) -> dict[str, Any]:
    doc = {"kind": v.kind, "summary": v.summary,
           "evidence": [{"signal": e.signal, "detail": e.detail} for e in v.evidence],
           "advice": list(v.advice), "cause": v.cause, "rule": v.rule, "severity": v.severity}
    if at is not None:
        doc["at"] = at
    return doc


class JobRunner:
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
        self.collector = None
        self._phase = JobPhase.NEW  # changed by set_phase only
        self._phase_changed = False  # set_phase took an edge: no more resuming from the database
        self.run_row: dict[str, Any] | None = None
        self.popen = None  # our wrapper (setsid) or systemd-run, while it is our child
        self.exit_noted = False
        self.exit_rc: int | None = None
        self.synthetic: Verdict | None = None  # the daemon's own verdict: job lost, cannot start
        self.recovery: Recovery | None = None
        self.incidents: dict[str, dict[str, Any]] = {}
        self._proved_run: int | None = None  # the run whose good behaviour reset the streak
        self.last_snap = None
        self.last_alive_snap = None
        self.last_eval: Evaluation | None = None
        self.last_vars: dict[str, Any] | None = None
        self.verdict: Verdict | None = None
        self._gone_ticks = 0
        self._starting_since: float | None = None
        self._pid_file_pid: int | None = None
        self._pid_file_read_at: float | None = None  # monotonic
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
        self._history_saved_at: float | None = None

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

    def _ensure_collector(self, pids: tuple[int, ...] = ()) -> None:
        if self.collector is not None:
            return
        from stallwatch.probes.collector import Collector
        from stallwatch.probes.kmsg import KernelLogProbe

        self.collector = Collector(self._target(pids), clock=self.clock,
                                   deadline_s=self.daemon_cfg.probe_deadline_s,
                                   gpu=self.opts.gpu)
        self.collector.processes = self._processes_probe(self.collector.target)
        row = self.db.job(self.name)
        boot = self.opts.boot_id
        if row and row.get("kmsg_cursor") is not None and row.get("kmsg_boot_id") == boot:
            # Same boot: read what the kernel said while no daemon was watching (an OOM kill).
            try:
                self.collector.kmsg.close()
            except Exception:  # noqa: BLE001
                pass
            self.collector.kmsg = KernelLogProbe(clock=self.clock, cursor=row["kmsg_cursor"])

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
        self._ensure_collector()
        target = self._target((pid,))
        self.collector.target = target
        name = self._known_name(pid, start_ticks)
        self.collector.processes = self._processes_probe(
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

    def update(self, cfg: JobConfig, rules: RuleSet, *, rules_changed: bool) -> None:
        """A reload changed this job. What it watches applies now; how it is started applies at
        the next (re)start: a running job is never restarted because its config changed."""
        if self.cfg.supervised and not cfg.supervised and cfg.restart_command:
            cfg = cfg.as_restarted()  # already replaced by its restart_command: it stays ours
        watched = ("log", "progress_regex", "outputs", "server", "match", "pid_file")
        refresh = any(getattr(cfg, k) != getattr(self.cfg, k) for k in watched)
        old_json = self.config_json()
        self.cfg = cfg
        afresh = self.recovery is None and self._afresh(self.phase, old_json)
        self.db.update_job(self.name, config_json=self.config_json())
        if rules_changed:
            # Pending `for` timers and firing alerts carry over by rule name and labels
            # (Evaluator.carry_from says what carries when a rule changed).
            self.rules = rules
            fresh = Evaluator(rules)
            carried = fresh.carry_from(self.evaluator)
            self.evaluator = fresh
            log.info("job %s: new rules: %d alert(s) carried over", self.name, carried)
        if refresh and self.collector is not None:
            pids = self.collector.target.pids
            processes = self.collector.processes
            self.collector.close()
            self.collector = None
            self._ensure_collector(pids)
            if self.cfg.match is None and self.cfg.pid_file is None:
                self.collector.processes = processes  # keep the job's identity and exit memory
                self.collector.target = self._target(pids)
            self._pid_file_pid = None
        if afresh:
            log.info("job %s: its configuration changed while it was %s: starting afresh",
                     self.name, self.phase)
            self.set_phase(JobPhase.NEW, "", restarts=0)
            self.start_first()

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

    # ------------------------------------------------------------------------------ start-up

    def start(self) -> None:
        """Take over the job: from the state database, re-attach, resume a recovery, or start."""
        row = self.db.ensure_job(self.name, self.mode, self.config_json())
        if (row["mode"] == "command" and self.cfg.restart_command and not self.cfg.supervised
                and row["phase"] not in TERMINAL):
            # A previous daemon replaced the watched job by its restart_command, and that run is
            # not over: the job is that process, supervised (re-attached below, never started
            # again beside itself, never left to the old pid_file or match).
            self.cfg = self.cfg.as_restarted()
        if row["mode"] != self.mode or self._afresh(row["phase"], row["config_json"]):
            log.info("job %s: its configuration changed since it was %s: starting afresh",
                     self.name, row["phase"])
            self.db.update_job(self.name, mode=self.mode, phase="new", phase_detail="",
                               restarts=0, recovery_incident=None)
        self.db.update_job(self.name, config_json=self.config_json())
        row = self.db.job(self.name)
        if row["phase"] != "new":  # not afresh: the previous daemon's `for` timers resume
            self.alert_memory.restore(self.evaluator, row["verdict_at"], self.clock.time())
        for inc in self.db.open_incidents(self.name):
            self.incidents[inc["kind"]] = {"id": inc["id"], "episode": inc["episode"]}
        self._ensure_collector()
        if self.cfg.supervised:
            reconcile_intents(self.db, self.name)
            if self.db.latest_run(self.name) is None:
                self._adopt_orphan()
        # Read the row again: reconciling may have completed a restart the previous daemon
        # made (phase starting, no recovery in progress). Going on from the stale row would
        # resume that recovery and kill the freshly restarted run: a double restart.
        before, row = row, self.db.job(self.name)
        self.set_phase(row["phase"], resumed=True)
        if self.cfg.supervised:
            done = before["recovery_incident"]
            if done and row["recovery_incident"] is None and row["phase"] == "starting":
                self.resolve_by_restart(done, int(row["restarts"]))
            self._start_supervised(row)
        else:
            how = "pid_file" if self.cfg.pid_file is not None else "match"
            self.set_phase("attached", f"attached by {how}: " + (
                "killed and restarted with restart_command on " + ", ".join(sorted(RESTART_KINDS))
                if self.cfg.restart_command else "never restarted by stallwatch"))

    def _adopt_orphan(self) -> None:
        """No run on record (a fresh or reset state database), yet the wrappers' status files
        may name a run of this job that is still alive: adopt it rather than start a second
        copy beside it, and never reuse the number of a status file that exists."""
        prefix = f"{self.name}-"
        found: list[tuple[int, Path]] = []
        try:
            entries = list(self._runs_dir().iterdir())
        except OSError:
            return
        for f in entries:
            if f.suffix == ".json" and f.stem.startswith(prefix) and f.stem[len(prefix):].isdigit():
                found.append((int(f.stem[len(prefix):]), f))
        if not found:
            return
        found.sort()
        self.db.update_job(self.name, starts=max(int(self.db.job(self.name)["starts"]),
                                                 found[-1][0]))
        for seq, f in reversed(found):
            doc = self._status({}, f) or {}
            alive = identity_alive(doc.get("pid"), doc.get("start_ticks"))
            wrapper = identity_alive(doc.get("wrapper_pid"), doc.get("wrapper_start_ticks"))
            if doc.get("state") == "exited" or not (alive or wrapper):
                continue
            with self.db.tx():
                self.db.add_run(self.name, seq, "setsid", status_file=str(f),
                                pid=doc.get("pid"), start_ticks=doc.get("start_ticks"),
                                pgid=doc.get("pgid"), wrapper_pid=doc.get("wrapper_pid"),
                                wrapper_start_ticks=doc.get("wrapper_start_ticks"))
                self.db.update_job(self.name, phase="running", phase_detail=f"adopted run {seq}")
                self.db.add_action(self.name, "adopt", f"run {seq} (pid {doc.get('pid')}) found "
                                   "alive from its status file: adopted, not started again")
            log.warning("job %s: no run on record, but run %d (pid %s) is alive: adopted, not "
                        "started again", self.name, seq, doc.get("pid"))
            return

    def _afresh(self, phase: str, old_json: str | None) -> bool:
        """Is a finished or stopped job to be started again? Only when its config changed: a
        finished job when what it runs changed (command, cwd, env), a stopped one (given up,
        or crashed with restart = "no") also when its restart policy changed. A job that is
        running is never restarted for a config change: the new command applies at its next
        (re)start."""
        if phase not in TERMINAL or not self.cfg.supervised:
            return False
        try:
            old = json.loads(old_json or "")
        except ValueError:
            return True
        new = json.loads(self.config_json())
        keys = ["command", "cwd", "env"]
        if phase == "stopped":
            keys += ["restart", "max_restarts"]
        return any(old.get(k) != new.get(k) for k in keys)

    def _start_supervised(self, row: dict[str, Any]) -> None:
        run = self.db.latest_run(self.name)
        phase = row["phase"]
        if phase in TERMINAL:
            self.run_row = run
            log.info("job %s: %s (%s); not started again", self.name, phase, row["phase_detail"])
            return
        if run is None or phase == "new":
            self.start_first()
            return
        self.run_row = run
        doc = self._status(run)
        if doc and doc.get("pid") and run["pid"] is None:
            self._adopt_status(doc)
            run = self.run_row
        if run["pid"] is not None:
            pid, ticks = run["pid"], run["start_ticks"]
            if identity_alive(pid, ticks):
                log.info("job %s: re-attached to pid %d (start ticks %d) of run %d", self.name,
                         pid, ticks, run["seq"])
                self.set_target(pid, ticks)
                self.db.add_action(self.name, "reattach", f"re-attached to pid {pid}")
                if self.phase == "starting":  # a spawn completed on start-up: it runs
                    self.set_phase("running", f"pid {pid}", pid=pid, start_ticks=ticks)
            else:
                st = proc_state(pid)
                if st is not None:
                    log.warning("job %s: pid %d now belongs to another process (start ticks %d, "
                                "not %d): not adopting it, never signalling it", self.name, pid,
                                st[1], ticks)
                self.set_target(pid, ticks)  # the probe reports it exited, never the stranger
        else:
            self._starting_since = self.clock.monotonic()
        if phase == "recovering":
            self._resume_recovery(row)
        elif self.phase not in ("starting",) and run["pid"] is not None:
            self.set_phase("running", f"pid {run['pid']}", pid=run["pid"],
                           start_ticks=run["start_ticks"])

    def _resume_recovery(self, row: dict[str, Any]) -> None:
        iid = row["recovery_incident"]
        inc = self.db.incident(iid) if iid else None
        if inc is None:
            self.set_phase("running", "")
            return
        run = self.run_row or {}
        targets = []
        if run.get("pid") and identity_alive(run["pid"], run["start_ticks"]):
            targets.append((run["pid"], run["start_ticks"]))
        log.info("job %s: resuming the recovery from %s (incident %d) interrupted by a daemon "
                 "restart", self.name, inc["kind"], iid)
        self.db.add_action(self.name, "resume", "recovery resumed after a daemon restart",
                           incident_id=iid)
        self.recovery = Recovery(self._recovery_options(), self, iid, inc["kind"], targets=targets,
                                 pgid=run.get("pgid") if targets else None, gpu_pids=set(),
                                 candidates=[], failure_wall=inc["started_at"], resumed=True)

    # ------------------------------------------------------------------------------ spawning

    def _runs_dir(self) -> Path:
        return self.opts.state_dir / "runs"

    def _spawn(self, what: str, attempt: int | None, incident_id: int | None) -> None:
        """Intent → spawn → completion. The completion transaction is the only place a restart
        is counted."""
        edge(JOB_EDGES, self.phase, JobPhase.STARTING, f"job {self.name}")  # refused before a spawn
        seq = self.db.next_seq(self.name)
        status_file = self._runs_dir() / f"{self.name}-{seq}.json"
        sysd = use_systemd_run(self.daemon_cfg.systemd_run)
        aid = self.db.add_action(
            self.name, what, "pending", incident_id=incident_id, attempt=attempt,
            detail=json.dumps({"seq": seq, "status_file": str(status_file),
                               "how": "systemd-run" if sysd else "setsid"}), done=False)
        try:
            sp = spawn(self.name, seq, tuple(self.cfg.command or ()), status_file=status_file,
                       log=self.log_path(), cwd=self.cfg.cwd, env=dict(self.cfg.env),
                       systemd_run=sysd, admin_log=self.cfg.log is None,
                       run_as=resolve_user(self.cfg.user, self.cfg.group))
        except SpawnError as e:
            self.db.complete_action(aid, f"failed: {e}")
            raise
        with self.db.tx():
            run_id = self.db.add_run(self.name, seq, sp.how, status_file=str(status_file),
                                     unit=sp.unit, wrapper_pid=sp.wrapper_pid,
                                     wrapper_start_ticks=sp.wrapper_start_ticks)
            self.db.complete_action(aid, f"started run {seq} ({sp.how}"
                                         + (f", wrapper pid {sp.wrapper_pid}" if sp.wrapper_pid else "")
                                         + (f", unit {sp.unit}" if sp.unit else "") + ")")
            fields: dict[str, Any] = {"recovery_incident": None, "pid": None, "start_ticks": None}
            if attempt is not None:
                fields["restarts"] = attempt
            self.set_phase(JobPhase.STARTING, f"run {seq}", **fields)
        self.popen = sp.popen
        self.run_row = self.db.run(run_id)
        self._forget_processes()
        self._starting_since = self.clock.monotonic()
        self.exit_noted = False
        self.synthetic = None
        log.info("job %s: %s run %d (%s)%s", self.name,
                 "started" if attempt is None else f"restarted (restart {attempt})", seq, sp.how,
                 f": {' '.join(self.cfg.command or ())}")

    def start_first(self) -> None:
        if self.dry_run:
            # Only in memory: a later daemon that is not a dry run starts it.
            self.set_phase(JobPhase.STOPPED, "dry run: not started", persist=False)
            log.info("job %s: dry run: not started", self.name)
            return
        try:
            self._spawn("start", None, None)
        except SpawnError as e:
            log.error("job %s: cannot start: %s", self.name, e)
            self.set_phase("stopped", f"cannot start: {e}")

    def restart(self, attempt: int, incident_id: int) -> None:
        if not self.cfg.supervised and self.cfg.restart_command:
            # The watched tree is gone (the recovery killed it and waited): from here on the job
            # is the restart command's process, supervised like a `command` job; the pid_file or
            # match no longer names it, so only the new tree is watched, never two.
            log.info("job %s: the watched job is replaced by its restart_command: %s", self.name,
                     " ".join(self.cfg.restart_command))
            self.cfg = self.cfg.as_restarted()
            self.db.update_job(self.name, mode=self.mode, config_json=self.config_json())
        self._spawn("restart", attempt, incident_id)

    def _adopt_status(self, doc: dict[str, Any]) -> None:
        run = self.run_row
        pid, ticks = doc.get("pid"), doc.get("start_ticks")
        self.db.update_run(run["id"], pid=pid, start_ticks=ticks, pgid=doc.get("pgid"),
                           wrapper_pid=doc.get("wrapper_pid"),
                           wrapper_start_ticks=doc.get("wrapper_start_ticks"))
        self.run_row = self.db.run(run["id"])
        if pid and ticks is not None:
            self.set_target(pid, ticks)
            self.set_phase("running", f"pid {pid}", pid=pid, start_ticks=ticks)
            log.info("job %s: running as pid %d (run %d)", self.name, pid, run["seq"])

    # --------------------------------------------------------------------------- exits

    def reap(self) -> None:
        """Collect our wrapper's exit (SIGCHLD woke us): keeps zombies from piling up."""
        if self.popen is not None and self.popen.poll() is not None:
            if self.run_row and self.run_row.get("how") == "systemd-run":
                err = b""
                try:
                    err = self.popen.stderr.read() if self.popen.stderr else b""
                    if self.popen.stderr:
                        self.popen.stderr.close()
                except OSError:
                    pass
                if self.popen.returncode != 0:
                    self._spawn_error = (err.decode("utf-8", "replace").strip()
                                         or f"exit status {self.popen.returncode}")
            self.popen = None

    def _poll_run(self) -> None:
        run = self.run_row
        if run is None:
            return
        wrapper_running = self.popen is not None and self.popen.poll() is None
        self.reap()
        doc = self._status(run)
        if run["pid"] is None:
            if self.synthetic is not None:
                return  # already known lost
            if doc and doc.get("pid"):
                self._adopt_status(doc)
                run = self.run_row
            elif doc and doc.get("state") == "exited":
                self._lost(f"could not start: {doc.get('error') or 'exit ' + str(doc.get('returncode'))}")
                self.db.update_run(run["id"], ended_at=doc.get("ended_at"),
                                   returncode=doc.get("returncode"), end_reason="exec failed")
                return
            else:
                waited = self.clock.monotonic() - (self._starting_since or self.clock.monotonic())
                if run["how"] == "systemd-run":
                    # The unit starts asynchronously: wait for its wrapper's status file.
                    if self.popen is not None:
                        return
                    if self._spawn_error:
                        self._lost(f"systemd-run failed: {self._spawn_error}")
                    elif waited > 30.0:
                        self._lost("the transient unit wrote no status within 30 s")
                    else:
                        return
                    self.db.update_run(run["id"], ended_at=self.clock.time(),
                                       end_reason="spawn failed")
                    return
                if wrapper_running or identity_alive(run["wrapper_pid"], run["wrapper_start_ticks"]):
                    return
                doc = self._status(run)  # it may have written just before exiting
                if doc and doc.get("pid"):
                    self._adopt_status(doc)
                    return
                self._lost("the wrapper exited without starting the job")
                self.db.update_run(run["id"], ended_at=self.clock.time(), end_reason="lost")
                return
        if self.exit_noted or self.synthetic is not None:
            return
        pid, ticks = run["pid"], run["start_ticks"]
        if doc and doc.get("state") == "exited" and doc.get("pid") == pid:
            rc = int(doc.get("returncode"))
            self.collector.note_exit(pid, ticks, rc)
            self.exit_noted, self.exit_rc = True, rc
            self.db.update_run(run["id"], ended_at=doc.get("ended_at"), returncode=rc,
                               end_reason="exited")
            self.run_row = self.db.run(run["id"])
            how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
            log.info("job %s: pid %d exited (%s)", self.name, pid, how)
            return
        if identity_exists(pid, ticks):
            self._gone_ticks = 0
            return
        wrapper_alive = wrapper_running or identity_alive(run["wrapper_pid"],
                                                          run["wrapper_start_ticks"])
        self._gone_ticks += 1
        if wrapper_alive and self._gone_ticks < 50:
            return  # it is writing the status right now
        if self._gone_ticks >= 3:
            self.db.update_run(run["id"], ended_at=self.clock.time(), end_reason="lost")
            self._lost(f"pid {pid} is gone and its exit status was never written (the wrapper "
                       "was killed, or the machine rebooted)")

    def _lost(self, why: str) -> None:
        self.synthetic = Verdict(kind="crash", summary=f"{self.name}: {why}", cause="lost",
                                 severity="critical", rule="daemon:lost",
                                 advice=("read the end of the job's log for how it ended",))
        log.warning("job %s: %s", self.name, why)

    def _pid_file_due(self) -> bool:
        now = self.clock.monotonic()
        snap = self.last_snap
        alive = self._pid_file_pid is not None and snap is not None and any(
            p.pid == self._pid_file_pid and p.role == "target" and p.state not in ("Z", "X")
            for p in (snap.processes.processes if snap.processes is not None else ()))
        if alive and self._pid_file_read_at is not None \
                and now - self._pid_file_read_at < PID_FILE_RECHECK_S:
            return False
        self._pid_file_read_at = now
        return True

    def _poll_pid_file(self) -> None:
        if not self._pid_file_due():
            return
        path = self.cfg.pid_file

        def read() -> tuple[int | None, str, int | None]:
            """(pid, why refused, the file's owner): the file is the job user's to forge, so
            it is read as safefs reads that side: no link followed, a regular file only, and
            at most PID_FILE_MAX_BYTES (a pid file symlinked to /dev/zero is refused, not
            read until memory runs out)."""
            try:
                fd = safefs.open_file(path)
                try:
                    owner = os.fstat(fd).st_uid
                    data = os.read(fd, PID_FILE_MAX_BYTES + 1)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                return None, "", None
            except OSError as e:
                return None, str(e), None
            if len(data) > PID_FILE_MAX_BYTES:
                return None, f"{path}: larger than {PID_FILE_MAX_BYTES} bytes: not a pid file", None
            try:
                return int(data.split()[0]), "", owner
            except (ValueError, IndexError):
                return None, f"{path}: no pid in its first {len(data)} bytes", None

        got, _rep = self.collector.runner.call(f"pid_file-{self.name}", read, 2.0)
        pid, why, owner = got if got else (None, "", None)
        if pid is not None and pid == self._pid_file_pid:
            return
        if pid is not None and not why:
            why = self._pid_refused(pid, owner)
        if why:
            if why != self._pid_file_refused:
                self._pid_file_refused = why
                log.warning("job %s: pid_file refused: %s", self.name, why)
                self.db.update_job(self.name, phase_detail=f"pid_file refused: {why}")
            return
        if not pid:
            return
        st = proc_state(pid)
        if st is None:
            return
        self._pid_file_refused = ""
        self._pid_file_pid = pid
        self.set_target(pid, st[1])
        self.db.add_run(self.name, 0, "attached", pid=pid, start_ticks=st[1])
        self.db.update_job(self.name, pid=pid, start_ticks=st[1])
        log.info("job %s: attached to pid %d from %s", self.name, pid, path)

    def _pid_refused(self, pid: int, file_owner: int | None) -> str:
        """Why a pid named by the pid file is not this job's, or "". Never pid 1 or 0 (the whole
        system would become "the job": other users' stacks into evidence, their names into
        alerts); never a process of another user than the job's (`user`, else the pid file's
        owner when that is not root)."""
        if pid <= 1:
            return f"names pid {pid}: never a job"
        if self.cfg.user is not None:
            try:
                run_as = resolve_user(self.cfg.user, self.cfg.group)
            except SpawnError as e:
                return str(e)
            uid = run_as.uid if run_as else None
        else:
            uid = file_owner if file_owner else None
        if uid is not None:
            try:
                puid = Proc(pid).owner_uid()
            except (Absent, Denied, OSError):
                return ""  # gone: nothing to adopt, the next read tries again
            if puid != uid:
                return f"pid {pid} runs as uid {puid}, not the job's uid {uid}: not adopted"
        return ""

    # --------------------------------------------------------------------------------- tick

    def tick(self) -> None:
        if self.phase in TERMINAL and self.recovery is None:
            self._poll_evidence()  # a bundle still being written for its last incident
            return
        if self.cfg.supervised:
            self._poll_run()
            if self._ended_by_slurm():
                return
        elif self.cfg.pid_file is not None:
            self._poll_pid_file()
        self._ensure_collector()
        snap = self.collector.tick()
        self._say_log_refused(snap)
        v = features(snap)
        ev = self.evaluator.evaluate(v, snap.t_mono)
        # The wall time of t_mono itself (snap.t_wall is read after the probes, up to a tick's
        # collection later): the saved anchors then stay put from tick to tick.
        mono_wall = snap.t_mono + (self.clock.time() - self.clock.monotonic())
        self.alert_memory.save(self.evaluator, snap.t_mono, mono_wall)
        self.last_snap, self.last_eval, self.last_vars = snap, ev, v
        self._record(snap, v)
        if snap.processes is not None and snap.processes.processes:
            self.last_alive_snap = snap
        for e in ev.errors:
            log.debug("job %s: rule %s: %s: %s", self.name, e.rule, e.where, e.error)
        self.watch_warnings = self._watch.update(ev.errors, snap.processes, snap.t_mono,
                                                 self.last_tick_s if self.next_due else None,
                                                 self.daemon_cfg.job_tick_deadline_s)
        verdict = with_width_evidence(ev.verdict, snap.processes)
        if self.synthetic is not None and verdict.kind in ("unknown", "finished", "healthy"):
            verdict = self.synthetic
        self.verdict = verdict
        self._persist(snap, verdict)
        self._poll_evidence()
        self._incidents(snap, ev, v, verdict)
        self._act(snap, v, verdict)
        if self.recovery is not None:
            self.recovery.step(snap)
            if self.recovery.finished:
                if self.recovery.dry_run_walked:  # not walked again for the same incident
                    self.dry_run_done.add(self.recovery.incident_id)
                self.recovery = None
        self._settle(verdict)
        self._forget_streak_after_a_good_run()

    def _ended_by_slurm(self) -> bool:
        """True while the job's abnormal exit may be Slurm ending its allocation (the answer is
        pending), and once Slurm said so: then the job is stopped quietly, with no incident and
        no restart. scancel signals the job and stallwatch in no fixed order, so the exit may
        reach a tick first; slurmctld marks the job before any signal is sent (stallwatch.daemon.slurm).
        Asked once per run, off the tick, with a deadline."""
        jid = self.cfg.slurm_job_id
        run = self.run_row
        if (jid is None or run is None or not self.exit_noted or self.exit_rc == 0
                or self.recovery is not None):
            return False
        if self._slurm_ask is None or self._slurm_ask[0] != run["id"]:
            self._slurm_ask = (run["id"], run_in_thread(f"slurm-{self.name}",
                                                        self.actions.slurm_job_state, jid))
        fut = self._slurm_ask[1]
        if not fut.done():
            return True
        try:
            state = fut.result()
        except Exception as e:  # noqa: BLE001 - no answer: judged as if there were no Slurm
            log.warning("job %s: cannot ask Slurm about job %s: %s", self.name, jid, e)
            state = None
        from stallwatch.daemon.slurm import ended_by_slurm

        if not ended_by_slurm(state):
            return False
        if self.phase not in TERMINAL:
            how = f"killed by signal {-self.exit_rc}" if (self.exit_rc or 0) < 0 else \
                f"exit code {self.exit_rc}"
            why = (f"Slurm is ending job {jid} (JobState={state}: cancelled, time limit or "
                   f"preemption); {how}: not a crash, not restarted")
            self.set_phase("stopped", why)
            log.warning("job %s: cancelled: %s", self.name, why)
        return True

    def _record(self, snap: Any, v: dict[str, Any]) -> None:
        self.history.add(sample(snap.t_wall, v, snap))
        now = self.clock.monotonic()
        if self._history_saved_at is None or now - self._history_saved_at >= HISTORY_SAVE_S:
            self._history_saved_at = now
            self.db.set_meta(f"history:{self.name}",
                             json.dumps(self.history.docs(HISTORY_WINDOW_S)))

    def sparklines(self) -> str:
        return sparkline_text(sparklines(list(self.history.samples), HISTORY_WINDOW_S))

    def _say_log_refused(self, snap: Any) -> None:
        """A log the probe refuses (a symlink, a file the job's user cannot read: security.md
        #5) is said once in the daemon's log, not only in `log.status`."""
        lg = getattr(snap, "log", None)
        why = (lg.error or "") if lg is not None and lg.status == "denied" else ""
        if why != self._log_refused:
            self._log_refused = why
            if why:
                log.warning("job %s: log refused: %s", self.name, why)

    def _persist(self, snap: Any, verdict: Verdict) -> None:
        doc = verdict_doc(verdict, snap.t_wall)
        if self.watch_warnings:
            doc["watch_warnings"] = self.watch_warnings
        fields: dict[str, Any] = {"verdict_json": json.dumps(doc),
                                  "verdict_at": snap.t_wall}
        if snap.kernel is not None and snap.kernel.cursor is not None:
            fields["kmsg_cursor"] = snap.kernel.cursor
            fields["kmsg_boot_id"] = self.opts.boot_id
        if snap.processes is not None and snap.processes.targets:
            pid = snap.processes.targets[0]
            p = next((p for p in snap.processes.processes if p.pid == pid), None)
            fields["pid"] = pid
            if p is not None:
                fields["start_ticks"] = p.start_ticks
        self.db.update_job(self.name, **fields)

    # ----------------------------------------------------------------------------- incidents

    def _in_startup_grace(self, v: dict[str, Any]) -> bool:
        if not self.cfg.supervised or self.run_row is None:
            return False
        return self.clock.time() - self.run_row["started_at"] < self._startup_grace_s(v)

    def _incidents(self, snap: Any, ev: Evaluation, v: dict[str, Any], verdict: Verdict) -> None:
        kind = verdict.kind
        firing = {a.kind for a in ev.alerts if a.state == AlertState.FIRING and not a.warning}
        if self.synthetic is not None:
            firing.add(self.synthetic.kind)
        # A rule whose condition holds but whose `for` has not elapsed again (pending) is no
        # evidence that the problem is gone: after a daemon restart every rule starts over as
        # pending, and resolving then re-firing the same incident would alert twice.
        holding = firing | {a.kind for a in ev.alerts
                            if a.state == AlertState.PENDING and not a.warning}
        if (kind in PROBLEM_KINDS and kind not in self.incidents and self.recovery is None
                and (self.phase != "starting" or self.synthetic is not None)
                and not (kind in STALL_KINDS and self._in_startup_grace(v))):
            self._open_incident(kind, verdict, snap, ev, v)
        for k, inc in list(self.incidents.items()):
            if k in holding:
                continue
            if self.recovery is not None and self.recovery.incident_id == inc["id"]:
                continue
            if kind == "unknown" or self.phase == "starting":
                continue  # no positive evidence yet that the problem is gone
            self._resolve(k, inc, snap.t_wall, f"no longer {k}: now {kind}")

    def resolve_by_restart(self, incident_id: int, attempt: int) -> None:
        """The recovery restarted the job: the failed run is gone, so is this incident. If the
        new run fails too, that is a new episode with an alert of its own."""
        for k, inc in list(self.incidents.items()):
            if inc["id"] == incident_id:
                self._resolve(k, inc, self.clock.time(), f"restarted (restart {attempt})")

    def _open_incident(self, kind: str, verdict: Verdict, snap: Any, ev: Evaluation,
                       v: dict[str, Any]) -> None:
        vd = verdict_doc(verdict, snap.t_wall)
        iid, episode = self.db.open_incident(self.name, kind, verdict.summary, vd,
                                             started_at=snap.t_wall)
        inc: dict[str, Any] = {"id": iid, "episode": episode}
        self.incidents[kind] = inc
        log.warning("job %s: incident %d: %s: %s", self.name, iid, kind, verdict.summary)
        self.db.add_action(self.name, "detect", f"{kind}: {verdict.summary}", incident_id=iid)
        if self.daemon_cfg.evidence:
            bundle = self.opts.state_dir / "evidence" / f"{self.name}-{iid}-{kind}"
            inc["bundle"] = str(bundle)
            inc["evidence_action"] = self.db.add_action(self.name, "evidence", "pending",
                                                        incident_id=iid, detail=str(bundle),
                                                        done=False)
            inc["evidence_future"] = run_in_thread(
                f"evidence-{self.name}", self.actions.evidence, snap, verdict, bundle,
                evaluation=ev, features=v, clock=self.clock,
                timeout_s=min(15.0, self.daemon_cfg.evidence_timeout_s),
                history=self.history.docs(HISTORY_WINDOW_S))
            self.db.update_incident(iid, evidence_bundle=str(bundle))
        note = self._budget_note(kind)
        if note:
            self.db.update_incident(iid, note=note)
        self.emit_alert(iid, "firing", summary_override=f"{verdict.summary}; {note}" if note else None)

    def _budget_note(self, kind: str) -> str:
        """Said in the incident's first alert when this failure will not be restarted: the
        dispatcher sends one firing alert per incident, so the news must be in that one."""
        if not (self.cfg.restartable and self.cfg.restart == "on-failure" and kind in RESTART_KINDS):
            return ""
        done = self.restart_streak()
        if done >= self.cfg.max_restarts:
            what = "it is left stopped" if kind == "crash" else "it is killed and left stopped"
            return (f"restart budget used up ({done} of max_restarts = {self.cfg.max_restarts}): "
                    f"{what}")
        return ""

    def _poll_evidence(self) -> None:
        for inc in self.incidents.values():
            fut = inc.get("evidence_future")
            if fut is None or not fut.done():
                continue
            inc["evidence_future"] = None
            try:
                path = fut.result()
                self.db.complete_action(inc["evidence_action"], f"written: {path}")
                self.db.update_incident(inc["id"], evidence_bundle=str(path))
            except Exception as e:  # noqa: BLE001
                log.warning("job %s: evidence bundle failed: %s: %s", self.name,
                            type(e).__name__, e)
                self.db.complete_action(inc["evidence_action"], f"failed: {type(e).__name__}: {e}")

    def _resolve(self, kind: str, inc: dict[str, Any], at: float, why: str) -> None:
        self.db.resolve_incident(inc["id"], at)
        self.db.add_action(self.name, "resolve", why, incident_id=inc["id"])
        log.info("job %s: incident %d (%s) resolved: %s", self.name, inc["id"], kind, why)
        del self.incidents[kind]
        self.emit_alert(inc["id"], "resolved")

    # --------------------------------------------------------------------------------- acting

    def _startup_grace_s(self, v: dict[str, Any]) -> float:
        if self.cfg.startup_grace_s is not None:
            return self.cfg.startup_grace_s
        return float(v.get("stall_threshold_s") or 0.0)

    def _act(self, snap: Any, v: dict[str, Any], verdict: Verdict) -> None:
        kind = verdict.kind
        if (self.recovery is not None or not self.cfg.restartable or kind not in RESTART_KINDS
                or kind not in self.incidents):
            return
        running = self.phase == "running" or (self.phase == "attached" and self.cfg.restart_command)
        if not running and not (self.phase == "starting" and self.synthetic):
            return
        if self.cfg.restart != "on-failure":
            return
        if kind in STALL_KINDS and self._in_startup_grace(v):
            return
        inc = self.incidents[kind]
        if inc["id"] in self.dry_run_done:
            return
        run = self.run_row or {}
        base = self.last_alive_snap or snap
        targets: list[tuple[int, int]] = []
        gpu_pids: set[int] = set()
        if base.processes is not None:
            targets = [(p.pid, p.start_ticks) for p in base.processes.processes
                       if p.state not in ("Z", "X")]
        if run.get("pid") and run.get("start_ticks") is not None:
            targets.insert(0, (run["pid"], run["start_ticks"]))
        # Only identities that still hold: a reused pid is never handed to the kill.
        targets = [t for t in dict.fromkeys(targets) if identity_exists(*t)]
        pgid = run.get("pgid") if targets else None
        if base.gpu is not None and base.gpu.status == "ok":
            pids = {p for p, _ in targets} | {p.pid for p in (base.processes.processes
                                                              if base.processes else ())}
            gpu_pids = {pr.pid for d in base.gpu.devices for pr in (d.processes or ())
                        if pr.pid in pids}
        log.warning("job %s: %s: killing and resuming (incident %d)", self.name, kind, inc["id"])
        self.recovery = Recovery(self._recovery_options(), self, inc["id"], kind, targets=targets,
                                 pgid=pgid,
                                 gpu_pids=gpu_pids,
                                 candidates=candidates_from(base, self.cfg.outputs),
                                 failure_wall=snap.t_wall, evidence=inc.get("evidence_future"))

    def _settle(self, verdict: Verdict) -> None:
        """Terminal phases: a supervised job that ended and will not be restarted."""
        if not self.cfg.supervised or self.recovery is not None or self.phase in TERMINAL:
            return
        ended = self.exit_noted or self.synthetic is not None
        if not ended:
            return
        if self.exit_rc == 0 and self.synthetic is None:
            self.set_phase("finished", "exit code 0")
            log.info("job %s: finished", self.name)
            return
        if self.cfg.restart == "on-failure" and verdict.kind in RESTART_KINDS:
            return  # the recovery starts on the next tick that has the incident
        how = "lost" if self.synthetic is not None else (
            f"killed by signal {-self.exit_rc}" if (self.exit_rc or 0) < 0 else f"exit code {self.exit_rc}")
        why = f'{how}; restart = "no"' if self.cfg.restart == "no" else \
            f"{how} with verdict {verdict.kind}: not restarted for that"
        self.set_phase("stopped", why)
        log.warning("job %s: stopped: %s", self.name, why)

    # --------------------------------------------------------------------------------- alerts

    def emit_alert(self, incident_id: int, state: str, summary_override: str | None = None) -> None:
        inc = self.db.incident(incident_id)
        if inc is None:
            return
        try:
            vd = json.loads(inc["verdict_json"])
        except ValueError:
            vd = {}
        actions = tuple(f"{a['what']}: {a['outcome']}" for a in self.db.actions(incident_id)
                        if a["outcome"] != "pending")
        progress = None
        lv = (self.last_vars or {}).get("log") or {}
        if lv.get("has_progress"):
            progress = ProgressInfo(
                done=lv.get("done"), total=lv.get("total") if lv.get("total_known") else None,
                rate_per_s=lv.get("rate_per_s") if (lv.get("rate_per_s") or -1) >= 0 else None,
                eta_s=lv.get("eta_s") if (lv.get("eta_s") or -1) >= 0 else None,
                last_progress_age_s=lv.get("idle_s") if lv.get("idle_known") else None)
        sev = vd.get("severity") or "critical"
        if sev not in ("info", "warning", "critical"):
            sev = "critical"
        event = AlertEvent(
            job=self.name, kind=inc["kind"], state=state,
            summary=summary_override or inc["summary"] or vd.get("summary", ""),
            evidence=tuple(EvidenceLine(signal=e.get("signal", ""), detail=e.get("detail", ""))
                           for e in vd.get("evidence", ())),
            advice=tuple(vd.get("advice", ())), cause=vd.get("cause"), severity=sev,
            host=self.opts.host, incident_id=incident_id, episode=inc["episode"],
            started_at=inc["started_at"], resolved_at=inc["resolved_at"], at=self.clock.time(),
            progress=progress, actions=actions, evidence_bundle=inc["evidence_bundle"],
            sparklines=self.sparklines())
        self.opts.submit_alert(event)


# --------------------------------------------------------------------------------- reconcile

def reconcile_intents(db, job: str, *, settle_s: float = 5.0, clock=None) -> list[str]:
    """Finish the intents a killed daemon left `pending`, from what exists now. Returns notes.

    start/restart: the spawn happened if its status file exists or a wrapper naming that file
    is alive — then the run is recorded and (for a restart) counted, once, here; otherwise it
    never happened and nothing is counted (the recovery, resumed, will do it). A spawn younger
    than `settle_s` is given that long to show itself first (a wrapper between fork and exec
    does not yet carry its command line). Other intents (kill, validate, evidence) are marked
    interrupted: the resumed recovery redoes them, identity-checked.
    """
    import time as _time

    clock = clock or _time
    notes: list[str] = []
    for a in db.pending_actions(job):
        if a["what"] in ("start", "restart"):
            try:
                d = json.loads(a["detail"] or "{}")
            except ValueError:
                d = {}
            sf = d.get("status_file")
            doc = read_status(sf)
            if doc is not None and status_authentic(doc, sf):
                doc = None  # forged or not provably the wrapper's: as if absent
            wrapper = find_wrapper(sf) if (doc is None and sf) else None
            if doc is None and wrapper is None and sf:
                age = clock.time() - a["at"]
                if age < settle_s:
                    _time.sleep(settle_s - age)
                    doc = read_status(sf)
                    if doc is not None and status_authentic(doc, sf):
                        doc = None
                    wrapper = find_wrapper(sf) if doc is None else None
            if doc is not None or wrapper is not None:
                with db.tx():
                    fields: dict[str, Any] = {"status_file": sf, "started_at": a["at"]}
                    if doc is not None:
                        fields.update(pid=doc.get("pid"), start_ticks=doc.get("start_ticks"),
                                      pgid=doc.get("pgid"), wrapper_pid=doc.get("wrapper_pid"),
                                      wrapper_start_ticks=doc.get("wrapper_start_ticks"))
                    elif wrapper is not None:
                        st = proc_state(wrapper)
                        fields.update(wrapper_pid=wrapper,
                                      wrapper_start_ticks=st[1] if st else None)
                    db.add_run(job, int(d.get("seq") or 0), d.get("how") or "setsid", **fields)
                    db.complete_action(a["id"], f"started run {d.get('seq')} (completed on "
                                                "daemon start-up: the spawn had happened)")
                    upd: dict[str, Any] = {"phase": "starting", "recovery_incident": None}
                    if a["what"] == "restart" and a["attempt"] is not None:
                        row = db.job(job)
                        upd["restarts"] = max(int(row["restarts"]), int(a["attempt"]))
                    db.update_job(job, **upd)
                notes.append(f"{a['what']} {a['id']}: had happened")
                log.info("job %s: a %s the previous daemon began did happen: recorded once",
                         job, a["what"])
            else:
                db.complete_action(a["id"], "not started: the daemon stopped before the spawn "
                                            "(reconciled on start-up; not counted)")
                notes.append(f"{a['what']} {a['id']}: had not happened")
                log.info("job %s: a %s the previous daemon intended never happened: not counted",
                         job, a["what"])
        else:
            db.complete_action(a["id"], "interrupted by a daemon restart")
            notes.append(f"{a['what']} {a['id']}: interrupted")
    return notes
