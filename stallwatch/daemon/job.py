"""One job under the daemon: observe, judge, remember, act — once per tick, never blocking.

Each tick: the wrapper's status file (did the job start? exit? with what status?) → collector
tick → features → rules (evaluator.evaluate(now = snapshot.t_mono)) → incidents → actions.

The layers below JobRunner, a module each: jobstate (its state, phase and collector),
incidents (when one opens and resolves, its alerts), jobrun (start-up, the run, its exit, and
acting: recover with stallwatch.daemon.recovery, or settle).
"""

from __future__ import annotations

import logging
from typing import Any

from stallwatch.daemon.config import JobConfig
from stallwatch.daemon.recovery import run_in_thread
from stallwatch.daemon.watchwarn import with_width_evidence
from stallwatch.engine import Evaluator, RuleSet
from stallwatch.engine.alerting import Verdict
from stallwatch.engine.features import features
from stallwatch.engine.history import sample
from stallwatch.daemon.jobrun import JobRun
from stallwatch.daemon.jobstate import HISTORY_SAVE_S, HISTORY_WINDOW_S, TERMINAL
from stallwatch.daemon.verdictjson import VerdictJson
from stallwatch.vocab import JobPhase

log = logging.getLogger("stallwatch.daemon")


class JobRunner(JobRun):
    """One job: observe, judge, remember, act, once per tick (the layers: daemon/jobstate.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verdict_json = VerdictJson()  # the job row's verdict, dumped when it changed

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
            c = self._ensure_collector(pids)
            if self.cfg.match is None and self.cfg.pid_file is None:
                c.processes = processes  # keep the job's identity and exit memory
                c.target = self._target(pids)
            self._pid_file_pid = None
        if afresh:
            log.info("job %s: its configuration changed while it was %s: starting afresh",
                     self.name, self.phase)
            self.set_phase(JobPhase.NEW, "", restarts=0)
            self.start_first()

    def tick(self) -> None:
        if self._phase in TERMINAL and self.recovery is None:
            self._poll_evidence()  # a bundle still being written for its last incident
            return
        supervised = self.cfg.supervised
        if supervised:
            self._poll_run()
            if self._ended_by_slurm():
                return
        recheck = None
        if not supervised and self.cfg.pid_file is not None:
            recheck = self._poll_pid_file(self.cfg.pid_file)
        collector = self.collector or self._ensure_collector()
        snap = collector.tick(also=recheck)
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
        if self.incidents:  # else _poll_evidence has none to look at
            self._poll_evidence()
        self._incidents(snap, ev, v, verdict)
        if verdict.kind in self.incidents:  # else _act has nothing to act on
            self._act(snap, v, verdict)
        if self.recovery is not None:
            self.recovery.step(snap)
            if self.recovery.finished:
                if self.recovery.dry_run_walked:  # not walked again for the same incident
                    self.dry_run_done.add(self.recovery.incident_id)
                self.recovery = None
        # Both are about a run stallwatch started (the cfg as it is now: the recovery may have
        # just made the job its restart_command's run).
        if self.cfg.supervised:
            self._settle(verdict)
            self._forget_streak_after_a_good_run()
        if recheck is not None and self.cfg.pid_file is not None:
            # Last: this tick's rows and actions are about the process it collected; a new pid
            # is the next tick's target (and the job row's pid from then on, not one tick back).
            self.take_pid_file(self.cfg.pid_file, collector.also_got)

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
            how = f"killed by signal {-(self.exit_rc or 0)}" if (self.exit_rc or 0) < 0 else \
                f"exit code {self.exit_rc}"
            why = (f"Slurm is ending job {jid} (JobState={state}: cancelled, time limit or "
                   f"preemption); {how}: not a crash, not restarted")
            self.set_phase("stopped", why)
            log.warning("job %s: cancelled: %s", self.name, why)
        return True

    def _record(self, snap: Any, v: dict[str, Any]) -> None:
        self.history.add(sample(snap.t_wall, v, snap))
        now = self.clock.monotonic()
        if self._history_saved_mono is None or now - self._history_saved_mono >= HISTORY_SAVE_S:
            self._history_saved_mono = now
            if self.history.added != self._history_saved_n:  # else the row says it already
                self._history_saved_n = self.history.added
                self.db.set_metas_later(
                    {f"history:{self.name}": self.history.docs_json(HISTORY_WINDOW_S)})

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
        # Held for the daemon's one transaction a tick (StateDB.held); the same verdict as last
        # tick is not dumped again (daemon/verdictjson.py).
        text = self._verdict_json.text(verdict, snap.t_wall, self.watch_warnings)
        fields: dict[str, Any] = {"verdict_json": text, "verdict_at": snap.t_wall}
        if snap.kernel is not None and snap.kernel.cursor is not None:
            fields["kmsg_cursor"] = snap.kernel.cursor
            fields["kmsg_boot_id"] = self.opts.boot_id
        if snap.processes is not None and snap.processes.targets:
            pid = snap.processes.targets[0]
            p = next((p for p in snap.processes.processes if p.pid == pid), None)
            fields["pid"] = pid
            if p is not None:
                fields["start_ticks"] = p.start_ticks
        self.db.update_job_later(self.name, **fields)
