"""`stallwatch status`: what the state database says, as JSON (docs/contract.md) or a table.

Reads only (SQLite opened read-only; WAL lets it read while the daemon writes). Whether a daemon
is running is asked of the kernel, not of a pid in a file: the daemon holds an flock on
state_dir/daemon.lock for as long as it lives, and a lock that can be taken means nobody does.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from stallwatch.daemon.state import StateDB

_NAGIOS = {"healthy": 0, "finished": 0, "slow": 1, "unknown": 3}


def daemon_running(state_dir: Path) -> bool | None:
    """True/False; None when the lock file cannot be opened (permissions)."""
    path = Path(state_dir) / "daemon.lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _f(x: Any) -> float | None:
    try:
        return float(x) if x not in (None, "") else None
    except (TypeError, ValueError):
        return None


def status_doc(db: StateDB, state_dir: Path, job_names: list[str] | None = None,
               incidents_limit: int = 20) -> dict[str, Any]:
    meta = db.meta()
    rows = {r["name"]: r for r in db.jobs()}
    names = list(job_names) if job_names is not None else list(rows)
    names += [n for n in rows if n not in names]
    jobs: list[dict[str, Any]] = []
    for name in names:
        row = rows.get(name)
        if row is None:
            jobs.append({"name": name, "verdict": {"kind": "unknown",
                                                   "summary": "not seen by the daemon yet"},
                         "restarts": 0, "pid": None, "incidents": [], "phase": "new",
                         "configured": True})
            continue
        try:
            verdict = json.loads(row["verdict_json"]) if row["verdict_json"] else None
        except ValueError:
            verdict = None
        verdict = verdict or {"kind": "unknown", "summary": "not observed yet"}
        watch_warnings = verdict.pop("watch_warnings", None) or []
        try:
            cfg = json.loads(row["config_json"])
        except ValueError:
            cfg = {}
        incidents = []
        verdicts: dict[int, str] = {}  # the verdict each incident opened with, as stored
        for inc in db.incidents(name, limit=incidents_limit):
            verdicts[inc["id"]] = inc["verdict_json"]
            incidents.append({
                "id": inc["id"], "kind": inc["kind"], "episode": inc["episode"],
                "state": inc["state"], "started_at": inc["started_at"],
                "resolved_at": inc["resolved_at"], "summary": inc["summary"],
                "note": inc["note"] or None, "evidence_bundle": inc["evidence_bundle"],
                "actions": [{"what": a["what"], "at": a["at"], "outcome": a["outcome"],
                             **({"attempt": a["attempt"]} if a["attempt"] is not None else {})}
                            for a in db.actions(inc["id"])],
            })
        supervised = row["mode"] == "command"
        last_exit = _last_exit(db.latest_run(name), incidents) if supervised else None
        if row["phase"] == "stopped":
            verdict = _gave_up_verdict(verdict, incidents, verdicts, row["restarts"]) or verdict
        doc = {
            "name": name,
            "verdict": verdict,
            "restarts": row["restarts"],
            "pid": row["pid"],
            "incidents": incidents,
            "phase": row["phase"],
            "phase_detail": row["phase_detail"],
            "mode": row["mode"],
            "supervised": supervised,
            "restart": cfg.get("restart", "no") if supervised else "never (attached)",
            "max_restarts": cfg.get("max_restarts") if supervised else None,
            "start_ticks": row["start_ticks"],
            "verdict_at": row["verdict_at"],
            "open_incidents": sum(1 for i in incidents if i["state"] == "open"),
            "last_exit": last_exit,
            "configured": job_names is None or name in job_names,
            # What keeps this job from being judged fully: rules failing tick after tick, a tree
            # too wide to watch (daemon/watchwarn.py).
            "watch_warnings": watch_warnings,
        }
        doc["sparklines"] = _sparklines(meta.get(f"history:{name}"))
        # Each rule's health (ok, err, unknown = not evaluated yet) and last error, as the daemon
        # last saw them (daemon/alertmemory.py); a rule that errs leaves the job unjudged by it.
        doc["rules"] = _rules(meta.get(f"rules:{name}"))
        if not supervised:
            doc["note"] = (f"attached by {row['mode']}: stallwatch did not start this job and "
                           "never restarts it")
        jobs.append(doc)
    running = daemon_running(state_dir)
    alerts = None
    if meta.get("alerts"):
        try:
            alerts = json.loads(meta["alerts"])
        except ValueError:
            alerts = None
    return {
        "jobs": jobs,
        "daemon": {
            "running": running,
            "pid": int(meta["daemon_pid"]) if (meta.get("daemon_pid") or "").isdigit() else None,
            "started_at": _f(meta.get("daemon_started_at")),
            "stopped_at": _f(meta.get("daemon_stopped_at")),
            "last_tick_at": _f(meta.get("last_tick_at")),
            "tick_duration_s": _f(meta.get("tick_duration_s")),
            "config": meta.get("config_path") or None,
            "host": meta.get("host"),
            "last_reload_error": meta.get("last_reload_error") or None,
        },
        "alerts": alerts,
        "state_dir": str(state_dir),
    }


def _gave_up_verdict(verdict: dict[str, Any], incidents: list[dict[str, Any]],
                     verdicts: dict[int, str], restarts: int) -> dict[str, Any] | None:
    """A job the recovery gave up on reads as the verdict that led there, not as the exit
    stallwatch's own kill caused (a `crash` by SIGTERM): the incident's verdict, and how it ended."""
    inc = next((i for i in reversed(incidents)
                if any(a["what"] == "give_up" for a in i["actions"])), None)
    if inc is None:
        return None
    try:
        vd = json.loads(verdicts.get(inc["id"]) or "{}")
    except ValueError:
        vd = {}
    vd = {"kind": inc["kind"], "summary": inc["summary"], **vd}
    word = "restart" if restarts == 1 else "restarts"
    vd["summary"] = f"{vd.get('summary') or inc['kind']}; gave up after {restarts} {word}"
    vd["gave_up"] = {"incident": inc["id"], "restarts": restarts,
                     "outcome": next(a["outcome"] for a in inc["actions"] if a["what"] == "give_up"),
                     "last_verdict": verdict}
    return vd


def _last_exit(run: dict[str, Any] | None, incidents: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How the latest run ended, and whether stallwatch's recovery killed it (a kill action of
    one of its incidents between the run's start and end)."""
    if run is None or run.get("ended_at") is None:
        return None
    rc = run.get("returncode")
    kill = next((i for i in reversed(incidents) for a in i["actions"]
                 if a["what"] == "kill" and str(a["outcome"]).startswith("done")
                 and run["started_at"] <= a["at"] <= run["ended_at"]), None)
    how = ("unknown" if rc is None else
           f"killed by {_signame(-rc)}" if rc < 0 else f"exit code {rc}")
    by = "stallwatch" if kill is not None else "the job"
    text = how + (f": stallwatch's kill (incident #{kill['id']}, {kill['kind']})"
                  if kill is not None else "")
    return {"returncode": rc, "ended_at": run["ended_at"], "end_reason": run.get("end_reason"),
            "caused_by": by, "incident": kill["id"] if kill is not None else None, "text": text}


def _signame(n: int) -> str:
    import signal

    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _rules(raw: str | None) -> list[dict[str, str]]:
    try:
        docs = json.loads(raw) if raw else []
    except ValueError:
        return []
    return [d for d in docs if isinstance(d, dict)] if isinstance(docs, list) else []


def rules_line(rules: list[dict[str, str]]) -> str:
    """"rules: 27 ok, 1 err (hang: condition: no such key 'x')"; "" before the first tick."""
    if not rules:
        return ""
    counts: dict[str, int] = {}
    for r in rules:
        counts[r.get("health", "unknown")] = counts.get(r.get("health", "unknown"), 0) + 1
    text = "rules: " + ", ".join(f"{n} {h}" for h, n in sorted(counts.items()))
    errs = [f"{r.get('rule')}: {r.get('last_error')}" for r in rules if r.get("health") == "err"]
    return text + (f" ({'; '.join(errs)})" if errs else "")


def _sparklines(raw: str | None) -> str:
    """The last minutes the daemon saved for this job (stallwatch.engine.history), drawn; "" if none."""
    if not raw:
        return ""
    from stallwatch.engine.history import from_docs, sparkline_text, sparklines

    try:
        docs = json.loads(raw)
    except ValueError:
        return ""
    return sparkline_text(sparklines(from_docs(docs if isinstance(docs, list) else [])))


def exit_code(doc: dict[str, Any]) -> int:
    """Nagios convention, as diagnose: the worst job; 3 when no daemon is running."""
    if doc["daemon"]["running"] is False or not doc["jobs"]:
        return 3
    codes = {_NAGIOS.get(j["verdict"].get("kind", "unknown"), 2) for j in doc["jobs"]}
    for c in (2, 3, 1):  # critical, then unknown, then warning
        if c in codes:
            return c
    return 0


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def render_status(doc: dict[str, Any], console) -> None:
    console.print(status_renderable(doc))


def status_renderable(doc: dict[str, Any]):
    """The status as one rich renderable: printed once, or refreshed in place (`--watch`)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []

    class _Out:  # collects what the table-and-lines layout below prints
        @staticmethod
        def print(x: Any) -> None:
            parts.append(Text.from_markup(x) if isinstance(x, str) else x)

    console = _Out()
    d = doc["daemon"]
    state = {True: "[green]running[/]", False: "[red]not running[/]", None: "unknown"}[d["running"]]
    console.print(f"stallwatch daemon: {state}" + (f" (pid {d['pid']})" if d["running"] else "")
                  + f", last tick {_when(d['last_tick_at'])}, state {doc['state_dir']}")
    if d.get("last_reload_error"):
        console.print(f"[yellow]last reload failed:[/] {d['last_reload_error']}")
    colors = {"healthy": "green", "finished": "green", "slow": "yellow", "unknown": "dim"}
    t = Table(show_lines=False)
    for col in ("job", "phase", "verdict", "restarts", "pid", "incidents", "summary"):
        t.add_column(col)
    for j in doc["jobs"]:
        kind = j["verdict"].get("kind", "unknown")
        c = colors.get(kind, "red")
        restarts = f"{j['restarts']}/{j['max_restarts']}" if j.get("max_restarts") is not None \
            else ("-" if not j.get("supervised", True) else str(j["restarts"]))
        t.add_row(j["name"], j.get("phase", ""), f"[{c}]{kind}[/]", restarts,
                  str(j["pid"] or "-"),
                  f"{j.get('open_incidents', 0)} open / {len(j['incidents'])}",
                  j["verdict"].get("summary", "") + (f"\n{j['phase_detail']}"
                                                     if j.get("phase_detail") else "")
                  + (f"\nlast exit: {j['last_exit']['text']}" if j.get("last_exit") else ""))
    console.print(t)
    for j in doc["jobs"]:
        for w in j.get("watch_warnings") or ():
            console.print(f"[yellow]{escape(j['name'])}: warning:[/] {escape(w)}")
        line = rules_line(j.get("rules") or [])
        if line:
            console.print(f"{escape(j['name'])}: {escape(line)}")
    for j in doc["jobs"]:
        if j.get("sparklines"):
            parts.append(Text(f"{j['name']}, the last minutes:", style="bold"))
            parts.append(Text("\n".join("  " + x for x in j["sparklines"].splitlines()[:-1]),
                              style="cyan"))
    for j in doc["jobs"]:
        for inc in j["incidents"][-5:]:
            end = "open" if inc["resolved_at"] is None else f"resolved {_when(inc['resolved_at'])}"
            console.print(f"[bold]{j['name']}[/] #{inc['id']} {inc['kind']} "
                          f"{_when(inc['started_at'])} → {end}: {inc['summary']}")
            if inc.get("note"):
                console.print(f"    note: {inc['note']}")
            for a in inc["actions"]:
                console.print(f"    {_when(a['at'])} {a['what']}: {a['outcome']}")
    if doc.get("alerts"):
        parts.append(Text(f"alerts: {json.dumps(doc['alerts'])[:500]}"))
    return Group(*parts)
