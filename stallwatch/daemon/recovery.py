"""Kill and resume one job safely: a state machine advanced once per tick, never blocking.

    evidence ─► kill ─► wait_gone ─► wait_gpu ─► validate ─► backoff ─► restart ─► (done)
                 │          │                        │           │
                 │          └ a process in D: keep waiting, say so (once), never start a
                 │            second writer beside it
                 └ (the job already died: the kill finds nothing and is done at once)
                                                     └ broken outputs moved to quarantine
                                                                 └ budget used up: give up,
                                                                   alert, leave it stopped

Each phase is one small step per tick: the kill is stallwatch.actions.kill.KillOperation (it
only reads /proc and sends signals); evidence and validation touch the job's filesystem, which
may be the very thing that is stuck, so they run in a worker thread and this machine only looks
at their future (bounded waits, said so when exceeded). Backoff counts on the injected clock.

Crash safety (stallwatch.daemon.state): the restart is an intent row before the spawn and is completed —
with the restart counter — in one transaction after it; a daemon killed in between finds the
intent on start-up and reconciles it with the processes that exist (see job.reconcile_intents).
A daemon killed anywhere else in this machine resumes it from `kill` (identity-checked, so it
never signals a stranger) because the job row says phase = recovering.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stallwatch.actions.kill import KillOperation, KillState
from stallwatch.actions.validate import ValidationReport
from stallwatch.daemon.supervise import SpawnError, identity_alive
from stallwatch.vocab import RECOVERY_EDGES, RECOVERY_FINAL, RECOVERY_FIRST, RecoveryPhase, edge

if TYPE_CHECKING:
    from stallwatch.daemon.options import RecoveryHost, RecoveryOptions

log = logging.getLogger("stallwatch.daemon")

PHASES = tuple(RecoveryPhase)


def run_in_thread(name: str, fn, *args, **kwargs) -> Future:
    """A daemon thread with a Future: a call stuck in the kernel never holds up the tick, and
    never keeps the process from exiting."""
    fut: Future = Future()

    def work() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
            fut.set_exception(e)

    threading.Thread(target=work, name=name, daemon=True).start()
    return fut


class Recovery:
    """One recovery of one incident. `opts` are fixed when it begins; `job` is asked for what may
    change while it runs (see stallwatch.daemon.options.RecoveryHost)."""

    def __init__(self, opts: RecoveryOptions, job: RecoveryHost, incident_id: int, kind: str, *,
                 targets: list[tuple[int, int]], pgid: int | None,
                 gpu_pids: set[int], candidates: list[str], failure_wall: float,
                 evidence: Future | None = None, resumed: bool = False) -> None:
        self.opts = opts
        self.job = job  # its settings as they are now, its phase, alerts and restart
        self.name = opts.name
        self.db = opts.db
        self.clock = opts.clock
        self.incident_id = incident_id
        self.kind = kind
        self.targets = list(dict.fromkeys(targets))
        self.pgid = pgid
        self.gpu_pids = set(gpu_pids)
        self.candidates = candidates
        self.failure_wall = failure_wall
        self.evidence = evidence
        self.phase = RecoveryPhase.EVIDENCE if evidence is not None else RecoveryPhase.KILL
        assert self.phase in RECOVERY_FIRST
        # One step per phase, a table of handlers rather than names built from the phase's
        # spelling; bound here, so that a step a test wrapped on the class (the hardening tests'
        # failpoints) is the one run.
        self._steps: dict[RecoveryPhase, Callable[[Any], None]] = {
            RecoveryPhase.EVIDENCE: self._evidence, RecoveryPhase.KILL: self._kill,
            RecoveryPhase.WAIT_GONE: self._wait_gone, RecoveryPhase.WAIT_GPU: self._wait_gpu,
            RecoveryPhase.VALIDATE: self._validate, RecoveryPhase.BACKOFF: self._backoff,
            RecoveryPhase.RESTART: self._restart, RecoveryPhase.DONE: self._final,
            RecoveryPhase.GAVE_UP: self._final,
        }
        self.entered = self.clock.monotonic()
        self.kill: KillOperation | None = None
        self.validation: Future[ValidationReport] | None = None
        self.restart_due_mono: float | None = None
        self.attempt: int | None = None
        self._said: set[str] = set()
        self.dry_run_walked = False
        self.resumed = resumed
        job.set_phase("recovering", f"{kind}: {self.phase}", recovery_incident=incident_id)

    # ---------------------------------------------------------------------------------- utils

    @property
    def dry_run(self) -> bool:
        return self.job.dry_run

    def _move(self, to: str) -> RecoveryPhase:
        """The only code that changes `phase` after __init__: an edge not in
        stallwatch.vocab.RECOVERY_EDGES is a bug here, refused (PhaseError) before anything is
        done."""
        self.phase = to = edge(RECOVERY_EDGES, self.phase, to,
                               f"job {self.name}: recovery from {self.kind}")
        self.entered = self.clock.monotonic()
        return to

    def _enter(self, phase: str, detail: str = "") -> None:
        phase = self._move(phase)
        self.job.set_phase("recovering", f"{self.kind}: {phase}" + (f" ({detail})" if detail else ""),
                           recovery_incident=self.incident_id)
        log.info("job %s: recovery from %s: %s%s", self.name, self.kind, phase,
                 f" ({detail})" if detail else "")

    def _held(self) -> float:
        return self.clock.monotonic() - self.entered

    def _action(self, what: str, outcome: str, detail: str = "", **kw: Any) -> int:
        return self.db.add_action(self.name, what, outcome, incident_id=self.incident_id,
                                    detail=detail, **kw)

    @property
    def finished(self) -> bool:
        return self.phase in RECOVERY_FINAL

    # ----------------------------------------------------------------------------------- step

    def step(self, snap: Any) -> None:
        """Advance as far as the world allows this tick (several phases when they are instant)."""
        for _ in range(len(PHASES)):
            before = self.phase
            self._steps[self.phase](snap)
            if self.phase == before or self.finished:
                return

    def _final(self, snap: Any) -> None:
        """done, gave_up: nothing left to do."""

    def _evidence(self, snap: Any) -> None:
        fut = self.evidence
        timeout = self.opts.evidence_timeout_s
        if fut is not None and not fut.done() and self._held() < timeout:
            return
        if fut is not None and not fut.done():
            self._action("evidence", f"not finished after {timeout:g} s: killing anyway")
        self._enter("kill")

    def _kill(self, snap: Any) -> None:
        if self.kill is None:
            live = [(p, t) for p, t in self.targets if identity_alive(p, t)]
            if not live and self.pgid is None:
                self._action("kill", "nothing to kill: every process of the job is gone")
                self._enter("wait_gone")
                return
            grace_s = self.job.cfg.kill_grace_s
            self.kill = self.opts.actions.kill(self.targets, self.pgid, grace_s=grace_s,
                                               kill_wait_s=min(10.0, max(1.0, grace_s)),
                                               clock=self.clock, dry_run=self.dry_run)
            self._kill_action = self._action(
                "kill", "pending", json.dumps({"targets": self.targets, "pgid": self.pgid}),
                done=False)
        if not self.kill_finished():
            self.kill.step()
        if self.kill.state is KillState.unkillable and "unkillable" not in self._said:
            self._said.add("unkillable")
            self._unkillable()
        if self.kill_finished():
            rep = self._kill_report()
            outcome = "dry-run: would have signalled " + rep if self.dry_run else "done: " + rep
            self.db.complete_action(self._kill_action, outcome)
            self._enter("wait_gone")

    def kill_finished(self) -> bool:
        return self.kill is not None and self.kill.finished

    def _kill_report(self) -> str:
        assert self.kill is not None
        rep = self.kill.report()
        sigs = ", ".join(f"{s.signal} {s.scope} {s.id}: {s.outcome}" for s in rep.signals)
        refused = "; ".join(r.reason for r in rep.refused)
        out = rep.history[-1].reason if rep.history else ""
        if sigs:
            out += f" [{sigs}]"
        if refused:
            out += f" refused: {refused}"
        return out or str(rep.state)

    def _unkillable(self) -> None:
        assert self.kill is not None
        survivors = self.kill.survivors
        parts = []
        for s in survivors[:4]:
            parts.append(f"pid {s.pid} in {s.state or '?'}, wchan {s.wchan or '?'}")
        more = f" and {len(survivors) - 4} more" if len(survivors) > 4 else ""
        note = f"unkillable: {'; '.join(parts)}{more}; resume waits"
        self.db.update_incident(self.incident_id, note=note)
        self._action("kill", note)
        log.warning("job %s: %s", self.name, note)
        self.job.emit_alert(self.incident_id, "firing", summary_override=note)

    def _wait_gone(self, snap: Any) -> None:
        alive = [(p, t) for p, t in self.targets if identity_alive(p, t)]
        if self.kill is not None and not self.kill_finished():
            self.kill.step()
        if alive and not self.dry_run:
            if self._held() > 1.0 and "wait_gone" not in self._said:
                self._said.add("wait_gone")
                self._action("wait", "waiting for " + ", ".join(f"pid {p}" for p, _ in alive)
                             + " to exit before resuming")
            return
        self._enter("wait_gpu")

    def _wait_gpu(self, snap: Any) -> None:
        if not self.gpu_pids:
            self._enter("validate")
            return
        gpu = snap.gpu
        if gpu is None or gpu.status != "ok":
            self._action("wait_gpu", "GPU state not readable now: not waiting for its memory")
            self._enter("validate")
            return
        held = {pr.pid for d in gpu.devices for pr in (d.processes or ()) if pr.pid in self.gpu_pids}
        if not held:
            self._action("wait_gpu", "GPU memory of " + ", ".join(map(str, sorted(self.gpu_pids)))
                         + " released")
            self._enter("validate")
            return
        limit = self.job.cfg.gpu_release_timeout_s
        if self._held() >= limit:
            self._action("wait_gpu", f"GPU memory of pids {sorted(held)} still held after "
                                     f"{limit:g} s: resuming anyway")
            self._enter("validate")

    def _validate(self, snap: Any) -> None:
        cfg = self.job.cfg
        if cfg.outputs is None:
            self._enter("backoff", "no outputs configured: nothing to validate")
            return
        if self.validation is None:
            since = self.failure_wall - cfg.validate_window_s
            start = self.opts.run_started_wall
            if start is not None:
                since = max(since, start - 60.0)
            qdir = cfg.quarantine_dir(self.opts.state_dir)
            self._validate_action = self._action("validate", "pending", done=False)
            self.validation = run_in_thread(
                f"validate-{self.name}", self.opts.actions.validate, cfg.outputs, since, qdir,
                candidates=self.candidates, max_files=cfg.validate_max_files,
                dry_run=self.dry_run, budget_s=60.0, clock=self.clock)
            return
        if not self.validation.done():
            if self._held() > 120.0 and "validate_slow" not in self._said:
                self._said.add("validate_slow")
                self._action("validate", "still validating after 120 s (the outputs filesystem "
                                         "may be stuck): the resume waits")
            return
        try:
            rep = self.validation.result()
        except Exception as e:  # noqa: BLE001 - a validation that failed any way means: not resumed
            self.db.complete_action(self._validate_action, f"failed: {type(e).__name__}: {e}")
            self._give_up(f"validating the outputs failed ({type(e).__name__}: {e}); not "
                          "resuming onto outputs that were not checked")
            return
        moved, errors, skipped = rep.quarantined, rep.errors, rep.skipped
        text = f"checked {rep.checked}, valid {rep.valid}, quarantined {len(moved)}"
        if moved:
            text += ": " + "; ".join(f"{q.src} → {q.dst} ({q.reason})" for q in moved[:5])
        if skipped:
            text += f"; skipped {len(skipped)}: " + "; ".join(f"{s.path} ({s.reason})"
                                                             for s in skipped[:3])
        if errors:
            text += "; errors: " + "; ".join(errors[:3])
        self.db.complete_action(self._validate_action, ("dry-run: " if self.dry_run else "") + text)
        if moved:
            log.warning("job %s: quarantined %d broken output(s): %s", self.name, len(moved),
                        ", ".join(q.dst for q in moved[:5]))
        if errors and not self.dry_run:
            self._give_up("broken outputs could not be moved aside (" + "; ".join(errors[:2])
                          + "): resuming would make the job skip them forever")
            return
        self._enter("backoff")

    def _backoff(self, snap: Any) -> None:
        cfg = self.job.cfg
        if self.attempt is None:
            done = self.job.restart_streak()
            self.attempt = self.job.restarts() + 1  # numbers the restart; the streak counts it
            if cfg.restart != "on-failure":
                self._give_up('restart = "no"', alert=False)
                return
            if done + 1 > cfg.max_restarts:
                self._give_up(f"restart budget used up: {done} of max_restarts = "
                              f"{cfg.max_restarts}")
                return
            wait = cfg.backoff_s(done + 1)
            self.restart_due_mono = self.clock.monotonic() + wait
            self._enter("backoff", f"restart {self.attempt} of {cfg.max_restarts} in {wait:g} s")
            return
        if self.restart_due_mono is not None and self.clock.monotonic() < self.restart_due_mono:
            return
        self._enter("restart")

    def _restart(self, snap: Any) -> None:
        if self.dry_run:
            self._action("restart", f"dry-run: would restart (attempt {self.attempt})",
                         attempt=self.attempt)
            self.db.update_incident(self.incident_id, note="dry run: would have killed, "
                                    "validated and restarted the job; nothing was done")
            self.job.set_phase("running", "dry run: left as it is", recovery_incident=None)
            self.dry_run_walked = True  # its job does not walk the same incident again
            self._move(RecoveryPhase.DONE)
            return
        try:
            self.job.restart(self.attempt or 1, self.incident_id)
        except SpawnError as e:
            self._give_up(f"restart failed: {e}")
            return
        self._move(RecoveryPhase.DONE)
        self.job.resolve_by_restart(self.incident_id, self.attempt or 1)

    def _give_up(self, why: str, alert: bool = True) -> None:
        note = f"gave up: {why}; the job is left stopped"
        self._action("give_up", note)
        self.db.update_incident(self.incident_id, note=note)
        self.job.set_phase("stopped", why, recovery_incident=None)
        log.error("job %s: %s", self.name, note)
        if alert:
            self.job.emit_alert(self.incident_id, "firing", summary_override=note)
        self._move(RecoveryPhase.GAVE_UP)

    def describe(self) -> str:
        return f"{self.kind}: {self.phase}"


def candidates_from(snap: Any, outputs: Path | None) -> list[str]:
    """Files under the outputs that the job had open for writing: the likeliest broken ones."""
    if outputs is None or snap is None or snap.processes is None:
        return []
    root = str(outputs).rstrip("/") + "/"
    out = []
    for p in snap.processes.processes:
        for f in p.open_files:
            if f.write and f.path.startswith(root):
                out.append(f.path)
    return list(dict.fromkeys(out))
