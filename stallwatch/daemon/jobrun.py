"""One job under the daemon: taking it over at start-up, spawning it, following its run, acting.

At start-up, from the state database: re-attach to the run that is alive, resume an interrupted
recovery, adopt an orphan run the status files name, or start the job. Each tick: the wrapper's
status file (did the job start? exit? with what status?), or the pid file of a watched job.

Actions with restart = "on-failure" on crash, hang and io_stall: stallwatch.daemon.recovery.
server_hang, server_down, gpu_fault and disk_full never restart the job: the fault is outside it
(the server, a GPU that needs a health check, a full disk), and restarting the client would only
burn the restart budget; they alert and wait.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stallwatch.kernel import safefs
from stallwatch.kernel.proc import Proc
from stallwatch.kernel.roots import Absent, Denied
from stallwatch.daemon.recovery import Recovery, candidates_from
from stallwatch.daemon.supervise import (SpawnError, identity_alive, identity_exists, proc_state,
                                         resolve_user, spawn, use_systemd_run)
from stallwatch.engine.alerting import Verdict
from stallwatch.daemon.incidents import JobIncidents
from stallwatch.daemon.jobstate import TERMINAL
from stallwatch.daemon.reconcile import reconcile_intents
from stallwatch.vocab import JOB_EDGES, RESTART_KINDS, STALL_KINDS, JobPhase, edge

log = logging.getLogger("stallwatch.daemon")

PID_FILE_MAX_BYTES = 64  # "12345\n" and then some: a pid file is never more
# While the process the pid file named is alive, the file is re-read this often, not every tick
# (a read costs a worker-thread handoff: the file is on the job's filesystem, which may hang);
# every tick until then and from the tick its process is seen gone (issue 17).
PID_FILE_RECHECK_S = 5.0
# A pid-file read for the collector's batch: (call name, function, deadline in seconds).
PidFileCall = tuple[str, Callable[[], tuple[int | None, str, int | None]], float]


class JobRun(JobIncidents):
    """Taking the job over at start-up, spawning it, following its run to its exit, and acting
    on its incidents: recover, or settle it as finished or stopped."""

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
        row = self.db.existing_job(self.name)
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
        before, row = row, self.db.existing_job(self.name)
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
        self.db.update_job(self.name, starts=max(int(self.db.existing_job(self.name)["starts"]),
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
        log_file = self.log_path()
        if log_file is None:  # a supervised job always has one (log_path)
            raise RuntimeError(f"job {self.name}: no log file for a supervised run")
        try:
            sp = spawn(self.name, seq, tuple(self.cfg.command or ()), status_file=status_file,
                       log=log_file, cwd=self.cfg.cwd, env=dict(self.cfg.env),
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
        self.run_row = self.db.existing_run(run_id)
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
        run = self._current_run()
        pid, ticks = doc.get("pid"), doc.get("start_ticks")
        self.db.update_run(run["id"], pid=pid, start_ticks=ticks, pgid=doc.get("pgid"),
                           wrapper_pid=doc.get("wrapper_pid"),
                           wrapper_start_ticks=doc.get("wrapper_start_ticks"))
        self.run_row = self.db.existing_run(run["id"])
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
                run = self._current_run()
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
            rc = int(doc["returncode"])
            self._ensure_collector().note_exit(pid, ticks, rc)
            self.exit_noted, self.exit_rc = True, rc
            self.db.update_run(run["id"], ended_at=doc.get("ended_at"), returncode=rc,
                               end_reason="exited")
            self.run_row = self.db.existing_run(run["id"])
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

    def _poll_pid_file(self, path: Path) -> PidFileCall | None:
        """Read the pid file now when no live process of it is known. The re-check while its
        process lives (every PID_FILE_RECHECK_S) is returned instead, for the caller to run in
        the collector's batch (Collector.tick `also`) and give its answer to `take_pid_file`:
        a handoff of its own cost the main thread more than the read (issue 17: ~0.6 ms a
        re-check on a loaded machine). A new pid is then adopted at the end of that tick,
        a tick later than by a read before it, and read once more before the next (that tick's
        snapshot does not show the new process yet). Runs every tick, so the usual answer
        (None: its process lives, no re-check due) costs two tuple lookups in one frame: the
        processes probe's live targets, less its zombies (issue 17)."""
        now = self.clock.monotonic()
        pid, snap, read_mono = self._pid_file_pid, self.last_snap, self._pid_file_read_mono
        procs = snap.processes if snap is not None else None
        alive = (pid is not None and procs is not None and pid in procs.targets
                 and pid not in procs.zombies)
        if alive and read_mono is not None and now - read_mono < PID_FILE_RECHECK_S:
            return None
        self._pid_file_read_mono = now
        call = (f"pid_file-{self.name}", self._pid_file_reader(path), 2.0)
        if alive:
            return call
        got, _rep = self._ensure_collector().runner.call(*call)
        self.take_pid_file(path, got)
        return None

    @staticmethod
    def _pid_file_reader(path: Path) -> Callable[[], tuple[int | None, str, int | None]]:
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

        return read

    def take_pid_file(self, path: Path, got: tuple[int | None, str, int | None] | None) -> None:
        """The pid file's answer (None: the read did not end in time): attach to a new pid."""
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

    # --------------------------------------------------------------------------------- acting

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
            f"killed by signal {-(self.exit_rc or 0)}" if (self.exit_rc or 0) < 0 else f"exit code {self.exit_rc}")
        why = f'{how}; restart = "no"' if self.cfg.restart == "no" else \
            f"{how} with verdict {verdict.kind}: not restarted for that"
        self.set_phase("stopped", why)
        log.warning("job %s: stopped: %s", self.name, why)
