"""One job under the daemon: its incidents and the alerts they send.

Incidents. One per job and verdict kind *episode*: opened when a problem verdict (hang, io_stall,
server_hang, server_down, crash, gpu_fault, disk_full, slow) is the job's verdict and no incident
of that kind is open; resolved when no rule of that kind fires any more, no recovery for it is
in progress, and the job's verdict is positive evidence of something else (healthy, slow,
finished, another problem) — not `unknown`. So a crash loop is one incident with several
restarts, and "resolved" means the job was seen working again, not merely restarted. Every
incident gets an evidence bundle and a firing alert; resolution sends a resolved alert.

A freshly (re)started job gets `startup_grace_s` (default: the stall threshold the features
computed) before a stall verdict may kill it: its log's last progress line is the previous
run's, so "no progress for N s" is not yet about this run.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from stallwatch.daemon.recovery import run_in_thread
from stallwatch.engine.alerting import AlertState, Evaluation, Verdict
from stallwatch.alerts.events import AlertEvent, EvidenceLine, ProgressInfo
from stallwatch.daemon.jobstate import HISTORY_WINDOW_S, JobState, verdict_doc
from stallwatch.vocab import PROBLEM_KINDS, RESTART_KINDS, STALL_KINDS

log = logging.getLogger("stallwatch.daemon")


class JobIncidents(JobState):
    """Incidents and the alerts they send."""

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
            except Exception as e:  # noqa: BLE001 - the bundle is evidence: its failure is noted, never the tick's
                log.warning("job %s: evidence bundle failed: %s: %s", self.name,
                            type(e).__name__, e)
                self.db.complete_action(inc["evidence_action"], f"failed: {type(e).__name__}: {e}")

    def _resolve(self, kind: str, inc: dict[str, Any], at: float, why: str) -> None:
        self.db.resolve_incident(inc["id"], at)
        self.db.add_action(self.name, "resolve", why, incident_id=inc["id"])
        log.info("job %s: incident %d (%s) resolved: %s", self.name, inc["id"], kind, why)
        del self.incidents[kind]
        self.emit_alert(inc["id"], "resolved")

    def _startup_grace_s(self, v: dict[str, Any]) -> float:
        if self.cfg.startup_grace_s is not None:
            return self.cfg.startup_grace_s
        return float(v.get("stall_threshold_s") or 0.0)

    def emit_alert(self, incident_id: int, state: Literal["firing", "resolved"],
                   summary_override: str | None = None) -> None:
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
