"""Detection latency in the daemon, per verdict kind, on the real fault rigs; false positives.

Each rig (tests/faultrigs.py) starts the extraction-like job (a progress line every 0.2 s, an
output file per sample); `stallwatch run` (a subprocess, interval 1 s, the DEFAULT rules)
attaches to it by pid_file, watches it healthy for `warmup_s`, then the fault happens. Latency is
from the fault's onset (the rig's `fault_wall`: the job's last progress write, the freeze, the
SIGSTOP, the death) to
  - verdict: the daemon's incident row (`started_at`, the wall time of the snapshot that first
    carried the verdict), read from its state database;
  - alert: a webhook POST arriving at a loopback receiver in this process.

The false-positive run supervises a healthy job with bursty progress and long checkpoint
writes (bench/jobs/bursty.py) under the same daemon and default rules, and counts incidents and
alerts (there should be none) and the share of ticks per verdict.
"""

from __future__ import annotations

import http.server
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from bench.common import (ROOT, db_query, kill_identity, rnd, start_daemon, stop, summary, wait_for,
                          workdir)

EXPECTED = {
    "deadlock": ("hang", None), "busy_loop": ("hang", None), "crash": ("crash", None),
    "oom": ("crash", "oom_kill"), "fsfreeze": ("io_stall", None),
    "server_stopped": ("server_hang", None),
}
# The contract's bound per kind (seconds from the fault's onset)
TARGET_S = {"crash": 2.0, "hang": 30.0, "io_stall": 30.0, "server_hang": 30.0}


class _Hook(http.server.BaseHTTPRequestHandler):
    events: ClassVar[list[tuple[float, dict[str, Any]]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        t = time.time()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {"raw": body[:200].decode("utf-8", "replace")}
        type(self).events.append((t, doc))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class Receiver:
    def __init__(self) -> None:
        class H(_Hook):
            events: ClassVar[list[tuple[float, dict[str, Any]]]] = []

        self.handler = H
        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    @property
    def events(self) -> list[tuple[float, dict[str, Any]]]:
        return self.handler.events

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def _config(wd: Path, job: str, hook: str, interval: float) -> Path:
    cfg = wd / "sw.toml"
    cfg.write_text(f"""
[daemon]
interval_s = {interval}
state_dir = "{wd / 'state'}"

{job}

[[alert]]
type = "webhook"
url = "{hook}"
retry_initial_s = 0.2
""")
    return cfg


def _rigs():
    sys.path.insert(0, str(ROOT / "tests"))
    import faultrigs  # tests/ on the path only for this
    from rigs import RigUnavailable

    return faultrigs, RigUnavailable


def one_rig(name: str, warmup_s: float, interval: float = 1.0, timeout_s: float = 90.0,
            src: Path | None = None) -> dict[str, Any]:
    faultrigs, RigUnavailable = _rigs()
    kind, cause = EXPECTED[name]
    out: dict[str, Any] = {"rig": name, "expected": kind, "expected_cause": cause}
    at = math.ceil(warmup_s / faultrigs.SAMPLE_S)
    kw = {"at": at} if name in ("deadlock", "busy_loop", "crash", "oom") else {}
    rx = Receiver()
    daemon = None
    try:
        with workdir(f"det-{name}") as wd:
            try:
                cm = faultrigs.RIGS[name](**kw)
                rig = cm.__enter__()
            except RigUnavailable as e:
                out["skipped"] = str(e)
                return out
            try:
                pidfile = wd / "job.pid"
                pidfile.write_text(f"{rig.pid}\n")
                job = (f'[[job]]\nname = "rig"\npid_file = "{pidfile}"\nlog = "{rig.log}"\n'
                       f'outputs = "{rig.out}"\n' + (f'server = "{rig.server}"\n' if rig.server else ""))
                cfg = _config(wd, job, rx.url, interval)
                t_start = time.time()
                daemon = start_daemon(cfg, wd / "daemon.log", src=src)
                wait_for(lambda: db_query(wd / "state", "SELECT pid FROM jobs WHERE pid IS NOT NULL"),
                         30, "the daemon to attach to the job")
                if not kw:  # faults we cause: after the warm-up
                    time.sleep(max(0.0, warmup_s - (time.time() - t_start)))
                rig.fault(timeout=warmup_s + 120)
                t_fault = rig.fault_wall
                out["watched_before_fault_s"] = rnd(t_fault - t_start, 1)

                def incident():
                    rows = db_query(wd / "state", "SELECT * FROM incidents ORDER BY id")
                    return [r for r in rows if r["started_at"] >= t_fault - 1] or None

                try:
                    rows = wait_for(incident, timeout_s, f"{name}: an incident", every=0.05)
                except TimeoutError:
                    rows = None
                if rows is None:
                    out["detected"] = False
                    v = db_query(wd / "state", "SELECT verdict_json FROM jobs")
                    out["last_verdict"] = (json.loads(v[0]["verdict_json"])["kind"]
                                           if v and v[0]["verdict_json"] else None)
                else:
                    first = rows[0]
                    vd = json.loads(first["verdict_json"] or "{}")
                    out.update(detected=True, kind=first["kind"], cause=vd.get("cause"),
                               rule=vd.get("rule"), summary=first["summary"],
                               verdict_latency_s=rnd(first["started_at"] - t_fault, 2),
                               other_incidents=[r["kind"] for r in rows[1:]])
                    try:
                        wait_for(lambda: any(d.get("state") == "firing" for _, d in rx.events), 15,
                                 "the webhook alert")
                        t_alert, doc = next((t, d) for t, d in rx.events if d.get("state") == "firing")
                        out["alert_latency_s"] = rnd(t_alert - t_fault, 2)
                        out["alert_kind"] = doc.get("kind")
                    except TimeoutError:
                        out["alert_latency_s"] = None
                    out["ok_kind"] = first["kind"] == kind and (cause is None or vd.get("cause") == cause)
                    target = TARGET_S.get(kind)
                    out["target_s"] = target
                    out["within_target"] = bool(out["ok_kind"] and target is not None
                                                and out["verdict_latency_s"] <= target)
                if "oom_start" in rig.phases:
                    out["oom_alloc_s"] = rnd(rig.phases["exit"] - rig.phases["oom_start"], 2)
            finally:
                stop(daemon)
                daemon = None
                cm.__exit__(None, None, None)
    except Exception as e:  # noqa: BLE001 - one broken rig must not sink the suite
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop(daemon)
        rx.close()
    return out


def latency(rigs: list[str], warmup_s: float, repeats: int = 1, **kw: Any) -> dict[str, Any]:
    runs = []
    for _ in range(repeats):
        for name in rigs:
            r = one_rig(name, warmup_s, **kw)
            runs.append(r)
            print(f"  detection {name}: " + ((r.get("skipped") and f"skipped ({r['skipped']})")
                  or r.get("error") or f"{r.get('kind')} in {r.get('verdict_latency_s')} s "
                  f"(alert {r.get('alert_latency_s')} s)"), flush=True)
    by: dict[str, Any] = {}
    for name in rigs:
        rs = [r for r in runs if r["rig"] == name]
        ok = [r for r in rs if r.get("detected")]
        by[name] = {
            "expected": EXPECTED[name][0], "runs": len(rs),
            "skipped": next((r["skipped"] for r in rs if r.get("skipped")), None),
            "detected": len(ok), "right_kind": sum(1 for r in ok if r.get("ok_kind")),
            "verdict_latency_s": summary([r["verdict_latency_s"] for r in ok], digits=2),
            "alert_latency_s": summary([r["alert_latency_s"] for r in ok
                                        if r.get("alert_latency_s") is not None], digits=2),
            "target_s": TARGET_S.get(EXPECTED[name][0]),
            "within_target": bool(ok) and all(r.get("within_target") for r in ok) and len(ok) == len(rs),
        }
    return {"warmup_s": warmup_s, "interval_s": kw.get("interval", 1.0), "rules": "default",
            "by_rig": by, "runs": runs}


# ------------------------------------------------------------------------------ false positives

def false_positives(duration_s: float, *, checkpoint_every_s: float, checkpoint_s: float,
                    interval: float = 1.0, src: Path | None = None, seed: int = 1) -> dict[str, Any]:
    rx = Receiver()
    daemon = None
    out: dict[str, Any] = {"duration_s": duration_s, "checkpoint_every_s": checkpoint_every_s,
                           "checkpoint_s": checkpoint_s, "interval_s": interval, "rules": "default"}
    try:
        with workdir("fp") as wd:
            cmd = [sys.executable, str(ROOT / "bench" / "jobs" / "bursty.py"), "--out", str(wd / "out"),
                   "--seed", str(seed), "--checkpoint-every", str(checkpoint_every_s),
                   "--checkpoint-s", str(checkpoint_s)]
            job = (f'[[job]]\nname = "bursty"\ncommand = {json.dumps(cmd)}\nlog = "{wd / "job.log"}"\n'
                   f'outputs = "{wd / "out"}"\nrestart = "on-failure"\n')
            cfg = _config(wd, job, rx.url, interval)
            daemon = start_daemon(cfg, wd / "daemon.log", src=src)
            t0 = time.monotonic()
            tally: dict[str, int] = {}
            last_at = None
            while time.monotonic() - t0 < duration_s:
                time.sleep(interval)
                rows = db_query(wd / "state", "SELECT verdict_json, verdict_at FROM jobs")
                if rows and rows[0]["verdict_json"] and rows[0]["verdict_at"] != last_at:
                    last_at = rows[0]["verdict_at"]
                    k = json.loads(rows[0]["verdict_json"])["kind"]
                    tally[k] = tally.get(k, 0) + 1
            incidents = db_query(wd / "state", "SELECT kind, started_at, summary FROM incidents")
            text = (wd / "job.log").read_text(errors="replace") if (wd / "job.log").exists() else ""
            out.update(
                samples=tally, incidents=len(incidents),
                incident_kinds=[i["kind"] for i in incidents],
                incident_summaries=[i["summary"] for i in incidents][:5],
                alerts_firing=sum(1 for _, d in rx.events if d.get("state") == "firing"),
                checkpoints=text.count("checkpoint saved"),
                restarts=(db_query(wd / "state", "SELECT restarts FROM jobs") or [{}])[0].get("restarts"),
                false_positives=len(incidents),
            )
            stop(daemon)
            daemon = None
            # The supervised job outlives the daemon by design: end it (and its wrapper) here.
            for r in db_query(wd / "state", "SELECT * FROM runs"):
                kill_identity(r["pid"], r["start_ticks"])
                kill_identity(r["wrapper_pid"], r["wrapper_start_ticks"])
    finally:
        stop(daemon)
        rx.close()
    return out
