"""What `stallwatch demo` tells and checks (a part of commands/demo.py's `Demo`): the narration
of what the daemon does (its incidents, actions, alerts and quarantine, read back from its state
database and the alert sink's file), the checks at the end, the summary and its table."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallwatch.commands.demo_rig import JOB, LoopFS


@dataclass
class Event:
    t: float  # seconds since the demo started
    what: str
    text: str
    detail: list[str] = field(default_factory=list)



class DemoStory:
    """The narrating and judging half of `Demo`, which sets up and drives the run and keeps the
    state below (assigned in Demo.__init__)."""

    fault: str
    n: int
    keep: bool
    console: Any
    t0: float
    dir: Path | None
    loopfs: LoopFS | None
    db: Any
    events: list[Event]
    problems: list[str]
    fault_wall: float | None
    fault_how: str
    last_progress_wall: float | None
    progress_walls: list[float]
    incidents: dict[int, dict[str, Any]]
    first_incident: dict[str, Any] | None
    detected_wall: float | None
    progress_wall_at_detection: float | None
    delivered: list[dict[str, Any]]
    _delivered_lines: int
    unkillable_seen: float | None
    second_writer: bool
    phase: str
    quarantined: list[dict[str, str]]
    outputs_report: dict[str, Any]
    _restarts: int | None

    # -- narration ------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, what: str, text: str, detail: list[str] | tuple[str, ...] = (),
            style: str = "") -> None:
        from rich.markup import escape

        ev = Event(round(self.now(), 1), what, text, list(detail))
        self.events.append(ev)
        colour = style or {"fault": "bold red", "detect": "bold yellow", "alert": "magenta",
                           "kill": "red", "validate": "cyan", "quarantine": "bold cyan",
                           "restart": "green", "resolve": "green", "done": "bold green",
                           "operator": "bold blue", "problem": "bold red"}.get(what, "")
        tag = f"[{colour}]{what:<10}[/]" if colour else f"{what:<10}"
        self.console.print(f"[dim]{ev.t:6.1f}s[/]  {tag} {escape(text)}", highlight=False,
                           soft_wrap=True)
        for line in detail:
            self.console.print(f"{'':19}[dim]·[/] {escape(line)}", highlight=False, soft_wrap=True)

    # -- where things are --------------------------------------------------------------

    @property
    def out(self) -> Path:
        assert self.dir is not None
        if self.loopfs is not None:
            return self.loopfs.mnt / "hidden_states"
        return self.dir / "hidden_states"

    @property
    def job_log(self) -> Path:
        assert self.dir is not None
        return self.dir / "extract.log"

    @property
    def alerts_file(self) -> Path:
        assert self.dir is not None
        return self.dir / "alerts.jsonl"

    @property
    def state_dir(self) -> Path:
        assert self.dir is not None
        return self.dir / "state"

    def quarantine_dir(self) -> Path:
        return self.state_dir / "quarantine" / JOB  # the daemon's default, root's side

    def _expected_outputs(self) -> set[Path]:
        from stallwatch.sglang.extract_client import sample_path

        return {sample_path(self.out, i) for i in range(self.n)}

    # -- what the daemon did ------------------------------------------------------------

    def _narrate_detection(self, inc: dict[str, Any]) -> None:
        try:
            vd = json.loads(inc["verdict_json"])
        except ValueError:
            vd = {}
        evidence = [f"{e.get('signal')}: {e.get('detail')}" for e in vd.get("evidence", [])]
        after = ""
        if self.fault_wall is not None:
            after = f" {inc['started_at'] - self.fault_wall:.1f} s after the fault"
        # the last progress before the verdict: a late poll may already have read the resumed
        # run's first lines
        last_progress = max((w for w in self.progress_walls if w <= inc["started_at"]), default=None)
        if self.first_incident is None:
            self.first_incident = inc
            self.detected_wall = inc["started_at"]
            self.progress_wall_at_detection = last_progress
        shown = evidence[:4] + [e for e in evidence[4:] if e.startswith("progress:")][:1]
        self.say("detect", f"verdict {inc['kind']}{after}: {inc['summary']}", shown)
        if inc["kind"] in ("hang", "io_stall", "server_hang") and last_progress is not None:
            idle = inc["started_at"] - last_progress
            self.console.print(
                f"{'':19}[dim]({idle:.0f} s after the last progress line: the stall threshold "
                "of a job this fast is 20 s without progress — the floor; a slower job gets "
                "5 × its own cadence — then 2 s of confirmation)[/]", highlight=False,
                soft_wrap=True)

    def _narrate_action(self, a: dict[str, Any]) -> None:
        what, out = a["what"], a["outcome"]
        if what == "detect" or what == "start":
            return
        if what == "evidence":
            self.say("evidence", f"evidence bundle: {out.removeprefix('written: ')}"
                     if out.startswith("written") else f"evidence bundle: {out}")
        elif what == "kill":
            if out.startswith("unkillable"):
                self.unkillable_seen = time.time()
                self.say("kill", out + " — SIGKILL cannot take a task out of D; stallwatch will "
                                       "not start a second writer beside it")
            else:
                self.say("kill", out)
        elif what == "wait":
            self.say("wait", out)
        elif what == "validate":
            self.say("validate", out)
            self._quarantine_from(out)
        elif what == "restart":
            self.say("restart", out)
        elif what == "resolve":
            self.say("resolve", f"incident {a['incident_id']} resolved: {out}")
        elif what == "give_up":
            self.say("problem", out)
        else:
            self.say(what, out)

    def _quarantine_from(self, outcome: str) -> None:
        qdir = self.quarantine_dir()
        manifest = qdir / "MANIFEST.jsonl"
        try:
            lines = manifest.read_text().splitlines()
        except OSError:
            lines = []
        known = {q["path"] for q in self.quarantined}
        for line in lines:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            dst = str(doc.get("dst") or doc.get("quarantined") or doc.get("to") or "")
            if not dst or dst in known:
                continue
            src = str(doc.get("src") or doc.get("path") or doc.get("from") or "")
            reason = str(doc.get("reason") or "")
            self.quarantined.append({"path": dst, "from": src, "reason": reason})
            self.say("quarantine", f"moved {src} → {dst}: {reason} (moved aside, never deleted, "
                                   "so the resumed run writes it again)")
        if not lines and "quarantined 0" in outcome:
            self.console.print(f"{'':19}[dim](nothing to quarantine: the files written around "
                               "the failure are whole archives)[/]", highlight=False,
                               soft_wrap=True)

    def _read_delivered(self) -> None:
        try:
            lines = self.alerts_file.read_text().splitlines()
        except OSError:
            return
        for line in lines[self._delivered_lines:]:
            self._delivered_lines += 1
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            self.delivered.append(doc)
            kind, state = doc.get("kind"), doc.get("state")
            self.say("alert", f"[{doc.get('severity', '?')}] {kind} {state} — delivered by the "
                              f"command sink: {doc.get('summary', '')}")

    # -- the end ---------------------------------------------------------------------------

    def _verify(self) -> None:
        from stallwatch.actions.filecheck import validate_file

        expected_kind = self.fault
        inc = self.first_incident
        if inc is None:
            self.problems.append(f"no incident: stallwatch never called it {expected_kind}")
        elif inc["kind"] != expected_kind:
            self.problems.append(f"the first verdict was {inc['kind']}, expected {expected_kind}")
        self._restarts = self.restarts()
        if self.phase != "finished":
            self.problems.append(f"the job did not finish (phase {self.phase or '?'})")
        want_restarts = 0 if self.fault == "server_hang" else 1
        restarts = self._restarts
        if restarts != want_restarts:
            self.problems.append(f"{restarts} restart(s), expected {want_restarts}")
        if self.second_writer:
            self.problems.append("a second writer was started while the first was stuck in D")
        if self.fault == "io_stall" and self.unkillable_seen is None:
            self.problems.append("the kill never said the writer was unkillable in D")
        if not any(d.get("state") == "firing" and d.get("kind") == expected_kind
                   for d in self.delivered):
            self.problems.append(f"no firing {expected_kind} alert reached the terminal sink")
        # every output present once, each a whole archive; nothing else in the outputs
        expected = self._expected_outputs()
        present = {p for p in self.out.rglob("*") if p.is_file() and p.suffix == ".ckpt"}
        missing = sorted(str(p) for p in expected - present)
        extra = sorted(str(p) for p in present - expected)
        broken = []
        valid = 0
        for p in sorted(expected & present):
            r = validate_file(p)
            if r.ok:
                valid += 1
            else:
                broken.append(f"{p}: {r.reason}")
        self.outputs_report = {"expected": self.n, "present": len(expected & present),
                               "valid": valid, "missing": missing, "broken": broken,
                               "extra": extra}
        if missing:
            self.problems.append(f"{len(missing)} output(s) missing, e.g. {missing[0]}")
        if broken:
            self.problems.append(f"{len(broken)} broken output(s) left in place, e.g. {broken[0]}")
        if extra:
            self.problems.append(f"unexpected files in the outputs, e.g. {extra[0]}")
        for q in self.quarantined:
            p = Path(q["path"])
            if p.exists() and validate_file(p).ok:
                self.problems.append(f"{p} was quarantined but is a whole archive")

    def restarts(self) -> int:
        if self._restarts is not None and self.db is None:
            return self._restarts
        try:
            row = self.db.job(JOB) if self.db is not None else None
        except Exception:  # noqa: BLE001 - a count for the summary: 0 when the database cannot say
            row = None
        return int(row["restarts"]) if row else 0

    def summary(self) -> dict[str, Any]:
        inc = self.first_incident
        vd: dict[str, Any] = {}
        if inc is not None:
            try:
                vd = json.loads(inc["verdict_json"])
            except ValueError:
                vd = {}
        detected_after = None
        if inc is not None and self.fault_wall is not None:
            detected_after = round(inc["started_at"] - self.fault_wall, 1)
        since_progress = None
        lp = self.progress_wall_at_detection
        if inc is not None and lp is not None and lp <= inc["started_at"]:
            since_progress = round(inc["started_at"] - lp, 1)
        return {
            "fault": self.fault,
            "ok": not self.problems,
            "problems": list(self.problems),
            "expected_verdict": self.fault,
            "verdict": inc["kind"] if inc else None,
            "summary": inc["summary"] if inc else None,
            "evidence": [f"{e.get('signal')}: {e.get('detail')}" for e in vd.get("evidence", [])],
            "fault_injected": self.fault_how,
            "detected_after_s": detected_after,
            "detected_after_last_progress_s": since_progress,
            "restarts": self.restarts(),
            "job_phase": self.phase,
            "incidents": [{"id": i["id"], "kind": i["kind"], "state": i["state"],
                           "summary": i["summary"], "note": i["note"]}
                          for i in self.incidents.values()],
            "alerts": [{"kind": d.get("kind"), "state": d.get("state"),
                        "summary": d.get("summary")} for d in self.delivered],
            "outputs": self.outputs_report,
            "quarantined": [q["path"] for q in self.quarantined],
            "quarantine": self.quarantined,
            "elapsed_s": round(self.now(), 1),
            "workdir": str(self.dir) if self.keep and self.dir else None,
            "timeline": [{"t": e.t, "what": e.what, "text": e.text, "detail": e.detail}
                         for e in self.events],
        }

    def render_table(self, doc: dict[str, Any]) -> None:
        from rich.table import Table

        t = Table(title=f"stallwatch demo: {doc['fault']}", show_header=False, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        o = doc["outputs"] or {}
        t.add_row("fault", f"{doc['fault']} ({doc['fault_injected'] or 'not injected'})")
        t.add_row("verdict", f"{doc['verdict'] or 'none'} (expected {doc['expected_verdict']})")
        t.add_row("detected after", f"{_fmt_s(doc['detected_after_s'])} from the fault; "
                                    f"{_fmt_s(doc['detected_after_last_progress_s'])} from the "
                                    "last progress")
        t.add_row("alerts", ", ".join(f"{a['kind']} {a['state']}" for a in doc["alerts"]) or "none")
        t.add_row("restarts", str(doc["restarts"]))
        t.add_row("outputs valid", f"{o.get('valid', 0)}/{o.get('expected', self.n)}")
        t.add_row("quarantined", "\n".join(f"{q['path']} ({q['reason']})" for q in doc["quarantine"])
                  or "none (no broken output)")
        t.add_row("job", doc["job_phase"] or "?")
        t.add_row("took", _fmt_s(doc["elapsed_s"]))
        if doc["workdir"]:
            t.add_row("kept", doc["workdir"])
        self.console.print(t)
        if doc["ok"]:
            self.console.print("[bold green]OK[/]: everything happened as it should.")
        else:
            self.console.print("[bold red]FAILED[/]:")
            for p in doc["problems"]:
                self.console.print(f"  - {p}", highlight=False)



def _fmt_s(s: float | None) -> str:
    return "—" if s is None else f"{s:.1f} s"
