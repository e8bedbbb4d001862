"""Security, the bounds and rendering half of issue 22 (#8–#12), at the unit level.

What the job's user controls (process names, file names, log lines, how many processes and
threads it runs, connections to the loopback metrics port) must neither exhaust the daemon nor
come out as markup or an evaluation failure. The attacks run for real as uid 65534 under a root
daemon are in tests/test_security_attacks_bounds.py.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from alertkit import SLACK_PATH, dispatcher, event

from stallwatch.alerts.slack import slack_message

# ----------------------------------------------------------------------------- #11 Slack


CHANNEL = "<!channel>"


def _no_markup(text: str) -> None:
    """No control sequence a job's user could have planted: every <, > and & is escaped."""
    assert "<!" not in text and "<http" not in text and "<@" not in text
    assert CHANNEL not in text


def test_slack_escapes_everything_the_job_names(receiver_factory) -> None:
    rx = receiver_factory()
    d = dispatcher([{"type": "slack", "url": rx.url(SLACK_PATH), "mention": "<!here>"}])
    hostile = f"{CHANNEL} <http://evil.example|click> & <@U123>"
    try:
        d.submit(event(summary=f"process {hostile} exited 1", job="job<!channel>",
                       host="h<!everyone>", cause=hostile, evidence_bundle=f"/x/{hostile}",
                       advice=(hostile,), actions=(hostile,)))
        d.submit(event(state="resolved", summary=hostile, job="job<!channel>"))
        firing, resolved = (r.json() for r in rx.wait_for(2))
    finally:
        d.close()
    # The admin's own mention stays live; nothing else is markup.
    assert firing["text"].startswith("<!here> ")
    _no_markup(firing["text"][len("<!here> "):])
    assert "&lt;!channel&gt;" in firing["text"] and "&amp;" in firing["text"]
    assert firing["blocks"][1]["text"]["text"].startswith("<!here> ")
    rest = [firing["blocks"][0]["text"]["text"], firing["blocks"][1]["text"]["text"][8:]]
    for b in firing["blocks"][1:]:
        rest += [f["text"] for f in b.get("fields", ())]
        rest += [e["text"] for e in b.get("elements", ())]
        if b is not firing["blocks"][1] and "text" in b:
            rest.append(b["text"]["text"])
    for t in rest:
        _no_markup(t)
    _no_markup(resolved["text"])
    for b in resolved["attachments"][0]["blocks"]:
        for t in [b.get("text", {}).get("text", "")] + [e["text"] for e in b.get("elements", ())]:
            _no_markup(t)


def test_slack_message_escapes_top_level_text_without_a_mention() -> None:
    msg = slack_message(event(summary="a & b <!channel>"))
    assert msg["text"].endswith(": a &amp; b &lt;!channel&gt;")


# ------------------------------------------------------------------------- #8 metrics server


def _scrape(port: int, timeout: float = 10.0) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.status, r.read().decode()


@pytest.fixture()
def exporter():
    from stallwatch.daemon.metrics import DaemonView, JobView
    from stallwatch.daemon.metrics_export import MetricsExporter

    e = MetricsExporter("127.0.0.1:0").start()
    e.update([JobView(name="victim", kind="healthy")], DaemonView(version="t"))
    yield e
    e.close()


def test_idle_connections_hold_no_thread_and_never_crowd_out_a_scrape(exporter) -> None:
    import threading

    threads_before = threading.active_count()
    idle = []
    try:
        for _ in range(300):  # ten times the connection limit
            idle.append(socket.create_connection(("127.0.0.1", exporter.port), timeout=10))
        t0 = time.monotonic()
        status, text = _scrape(exporter.port)
        took = time.monotonic() - t0
        assert status == 200 and 'stallwatch_job_verdict{job="victim",kind="healthy"} 1.0' in text
        assert took < 5.0, f"a scrape behind 300 idle connections took {took:.1f} s"
        # prometheus_client's own server would hold ~300 threads now.
        assert threading.active_count() <= threads_before + 1
        assert exporter._httpd.evicted >= 300 - exporter._httpd.max_connections - 1
    finally:
        for s in idle:
            s.close()


def test_a_trickled_request_is_cut_off_after_the_read_timeout() -> None:
    from prometheus_client import CollectorRegistry, make_wsgi_app

    from stallwatch.daemon.metrics_http import MetricsServer

    srv = MetricsServer("127.0.0.1", 0, make_wsgi_app(CollectorRegistry()),
                        read_timeout_s=0.5).start()
    try:
        s = socket.create_connection(srv.server_address, timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        t0 = time.monotonic()
        for _ in range(20):  # a header line every 0.1 s, never the blank line
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
            time.sleep(0.1)
        s.settimeout(10)
        assert s.recv(100) == b""  # closed, without an answer
        assert time.monotonic() - t0 < 5.0
        s.close()
        big = socket.create_connection(srv.server_address, timeout=10)
        big.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        assert big.recv(100).startswith(b"HTTP/1.1 431")
        big.close()
    finally:
        srv.close()


# ------------------------------------------------------------- #12 names that are not UTF-8


def test_an_output_name_that_is_not_utf8_is_judged_with_every_rule(tmp_path) -> None:
    from stallwatch.engine import diagnose
    from stallwatch.probes.collector import Collector
    from stallwatch.engine import Evaluator
    from stallwatch.engine.features import features
    from stallwatch.probes.targets import Target

    out = tmp_path / "out"
    out.mkdir()
    # What a job's user can name a file: bytes that decode to nothing.
    fd = os.open(os.fsencode(out) + b"/shard-\xff\xfe.bin", os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"x" * 10)
    os.close(fd)
    c = Collector(Target(name="j", pids=(os.getpid(),), outputs=out), gpu=False,
                  use_inotify=False)
    try:
        snap = c.tick()
    finally:
        c.close()
    v = features(snap)
    ev = Evaluator(diagnose.load(None)).evaluate(v, snap.t_mono)
    assert ev.errors == (), ev.errors
    from stallwatch.engine.expr import Vars, compile_expr

    assert compile_expr("outputs.newest").evaluate(Vars(v)) == "shard-\\xff\\xfe.bin"


def test_variables_cel_refuses_are_an_evaluation_error_not_an_exception() -> None:
    from stallwatch.engine import diagnose
    from stallwatch.engine import Evaluator

    ev = Evaluator(diagnose.load(None)).evaluate({"job": {"x": object()}}, 1.0)
    assert ev.verdict.kind == "unknown"
    assert [(e.rule, e.where) for e in ev.errors] == [("*", "variables")]


def test_a_rule_failing_every_tick_becomes_a_warning(caplog) -> None:
    import logging

    from stallwatch.daemon.watchwarn import FAILING_TICKS, WatchWarnings
    from stallwatch.engine.alerting import EvalError

    w = WatchWarnings("victim")
    err = [EvalError(rule="hang", where="condition", error="no such key 'x'")]
    with caplog.at_level(logging.WARNING, logger="stallwatch.daemon"):
        seen = [w.update(err, None, float(t)) for t in range(FAILING_TICKS + 2)]
    assert seen[FAILING_TICKS - 2] == []  # a hiccup is not a warning
    assert "rule hang fails on every tick" in seen[FAILING_TICKS - 1][0]
    assert "not judged by it" in seen[-1][0]
    logged = [r for r in caplog.records if "rule hang fails" in r.getMessage()]
    assert len(logged) == 1  # once, not every tick
    assert w.update([], None, 99.0) == []  # evaluates again: the warning is gone
    with caplog.at_level(logging.WARNING, logger="stallwatch.daemon"):
        for t, took in ((100.0, 0.61), (101.0, 0.72), (102.0, 0.65)):
            assert "tick over its deadline" in w.update([], None, t, took, 0.5)[0]
    assert sum("tick over its deadline" in r.getMessage() for r in caplog.records) == 1


def test_watch_warnings_after_quiet_ticks_see_what_comes(caplog) -> None:
    # A quiet tick (no rule failing, none before, nothing to say) returns at once: what comes
    # after it is still seen, and a warning that was logged goes away (issue 17).
    import logging
    from types import SimpleNamespace

    from stallwatch.daemon.watchwarn import FAILING_TICKS, WatchWarnings
    from stallwatch.engine.alerting import EvalError

    w = WatchWarnings("j")
    assert w.update((), None, 0.0) == [] and w.update((), None, 1.0, 0.1, 0.5) == []
    wide = SimpleNamespace(truncated="more than max_processes", watched_processes=3,
                           tree_processes=9, watched_threads=12)
    with caplog.at_level(logging.WARNING, logger="stallwatch.daemon"):
        assert "too wide to watch fully" in w.update((), wide, 2.0)[0]
        assert w.update((), None, 3.0) == []
        assert "tick over its deadline" in w.update((), None, 4.0, 0.9, 0.5)[0]
        err = (EvalError(rule="r", where="condition", error="boom"),)
        got = [w.update(err, None, 5.0 + t) for t in range(FAILING_TICKS)]
    assert got[-1] and "rule r fails" in got[-1][0] and all(g == [] for g in got[:-1])
    assert w.update((), None, 20.0) == [] and w.update((), None, 21.0) == []
    assert sum("too wide" in r.getMessage() for r in caplog.records) == 1
    with caplog.at_level(logging.WARNING, logger="stallwatch.daemon"):
        caplog.clear()
        assert "too wide" in w.update((), wide, 22.0)[0]  # gone, then back: logged again
    assert sum("too wide" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------ #9 a tree too wide, #10


def _wait(pred, timeout: float = 20.0, what: str = ""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class _Pids:
    def __init__(self, pids=(), match=None):
        self.pids, self.match = tuple(pids), match


def test_a_tree_past_the_caps_is_watched_in_part_said_so_and_its_exits_still_seen() -> None:
    import subprocess

    from stallwatch.daemon.watchwarn import width_warning
    from stallwatch.probes.processes import ProcessesProbe

    job = subprocess.Popen(["bash", "-c", "for i in {1..30}; do sleep 300 & done; wait"])
    try:
        probe = ProcessesProbe(_Pids([job.pid]), max_processes=10)
        obs = _wait(lambda: (o := probe.collect()).tree_processes == 31 and o, what="31 tasks")
        assert obs.truncated == "more than max_processes = 10", obs.truncated
        assert obs.watched_processes == len(obs.processes) == 10, obs.watched_processes
        assert obs.processes[0].pid == job.pid  # the target is always among those examined
        assert "too wide to watch fully" in width_warning(obs)
        seen = {p.pid for p in obs.processes}
        kids = [int(p) for p in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]
        victim = next(k for k in kids if k not in seen)
        os.kill(victim, 9)
        obs = _wait(lambda: (o := probe.collect()).exited and o, what="the exit")
        assert [(e.pid, e.comm) for e in obs.exited] == [(victim, "sleep")], obs.exited
        # A time budget stops examination early too, and says which limit it was.
        tight = ProcessesProbe(_Pids([job.pid]), budget_s=0.0)
        o = tight.collect()
        assert "time budget" in o.truncated and o.watched_processes >= 1, o.truncated
        # ... counted in the collecting thread's CPU time: a tick whose reads wait for a CPU on a
        # loaded host (wall time passing, no CPU spent) is not cut short; one that spends it is.
        idle_cpu = ProcessesProbe(_Pids([job.pid]), budget_s=0.25, cpu_clock=lambda: 0.0)
        o = idle_cpu.collect()
        assert o.truncated == "" and o.watched_processes == o.tree_processes >= 30, o.truncated
        spent: list[float] = []
        busy_cpu = ProcessesProbe(_Pids([job.pid]), budget_s=0.25,
                                  cpu_clock=lambda: spent.append(0.1) or sum(spent))
        o = busy_cpu.collect()
        assert "time budget" in o.truncated and 1 <= o.watched_processes < o.tree_processes, o.truncated
        # Within the caps: watched fully, no warning.
        full = ProcessesProbe(_Pids([job.pid]))
        o = full.collect()
        assert o.truncated == "" and width_warning(o) is None, o.truncated
    finally:
        for k in [int(p) for p in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]:
            os.kill(k, 9)
        job.wait(timeout=20)


def test_match_adopts_only_processes_of_the_jobs_user() -> None:
    import subprocess

    from stallwatch.probes.processes import ProcessesProbe

    marker = f"sec-bounds-decoy-{os.getpid()}"
    decoy = subprocess.Popen(["bash", "-c", f"exec -a {marker} sleep 300"])
    try:
        # bash's own command line names the marker too: wait for the exec to be over (comm is
        # the new program's), since a process in the middle of execve can show an empty
        # command line, which no pattern matches (a daemon's next tick would adopt it)
        _wait(lambda: Path(f"/proc/{decoy.pid}/comm").read_text().strip() == "sleep"
              and marker.encode() in Path(f"/proc/{decoy.pid}/cmdline").read_bytes(),
              what="the exec")
        other_uid = os.getuid() + 1 if os.getuid() != 65534 else 0
        mine = ProcessesProbe(_Pids(match=marker), match_uid=os.getuid()).collect()
        theirs = ProcessesProbe(_Pids(match=marker), match_uid=other_uid).collect()
        anyone = ProcessesProbe(_Pids(match=marker)).collect()
        assert mine.targets == (decoy.pid,) and anyone.targets == (decoy.pid,)
        assert theirs.targets == ()
    finally:
        decoy.kill()
        decoy.wait(timeout=20)


def test_a_job_over_its_tick_deadline_is_ticked_less_often_and_last() -> None:
    from types import SimpleNamespace

    from stallwatch.daemon.core import Daemon

    cfg = SimpleNamespace(daemon=SimpleNamespace(job_tick_deadline_s=0.5))
    too_wide = SimpleNamespace(processes=SimpleNamespace(truncated="more than max_processes"))
    # What Daemon._due_jobs and _spaced read of a runner (a JobRunner starts with these).
    fresh = {"next_due": 0.0, "last_tick_s": None, "overruns": 0}
    wide = SimpleNamespace(name="wide", last_snap=too_wide, **fresh)
    victim = SimpleNamespace(name="victim", last_snap=None, **fresh)
    d = SimpleNamespace(config=cfg, jobs={"wide": wide, "victim": victim},
                        OVERRUN_SPACING=Daemon.OVERRUN_SPACING)
    assert Daemon._due_jobs(d, 0.0) == [wide, victim]  # the config's order
    Daemon._spaced(d, wide, 0.0, 1.2)  # 1.2 s: over the 0.5 s deadline
    Daemon._spaced(d, victim, 1.2, 1.21)
    assert Daemon._due_jobs(d, 1.4) == [victim]  # the others keep their cadence
    assert Daemon._due_jobs(d, 1.2 + 4 * 1.2 + 0.01) == [victim, wide]  # then it, last
    Daemon._spaced(d, wide, 10.0, 10.1)  # back within its deadline: every tick again
    assert Daemon._due_jobs(d, 10.2) == [wide, victim]
    # A job that is not too wide, slow once (a loaded machine), keeps its cadence; slow three
    # times in a row, it is spaced too.
    for n, t in enumerate((20.0, 21.0, 22.0)):
        Daemon._spaced(d, victim, t, t + 0.8, 0.7)
        assert (victim in Daemon._due_jobs(d, t + 0.9)) == (n < 2)
    # Slow in wall time but not in CPU, however often: the machine's load, not the job's tree;
    # its watch keeps every tick (a stall's verdict must not wait on load).
    Daemon._spaced(d, victim, 30.0, 30.1, 0.1)
    for t in (31.0, 32.0, 33.0, 34.0):
        Daemon._spaced(d, victim, t, t + 0.8, 0.05)
        assert victim in Daemon._due_jobs(d, t + 0.9)


def test_status_shows_the_watch_warnings_as_text(tmp_path) -> None:
    import json

    from rich.console import Console

    from stallwatch.daemon.status import render_status, status_doc
    from stallwatch.daemon.state import StateDB

    db = StateDB.open(tmp_path / "state")
    try:
        db.ensure_job("wide", "command", "{}")
        warning = "too wide to watch fully: more than max_processes = 1024 [bold]x[/]"
        db.update_job("wide", verdict_json=json.dumps(
            {"kind": "healthy", "summary": "ok", "watch_warnings": [warning]}))
        doc = status_doc(db, tmp_path / "state")
    finally:
        db.close()
    job = doc["jobs"][0]
    assert job["watch_warnings"] == [warning] and "watch_warnings" not in job["verdict"]
    console = Console(record=True, width=200)
    render_status(doc, console)
    assert f"wide: warning: {warning}" in console.export_text()  # markup in it stays text


def test_a_tick_reads_the_cpu_spent_again_only_when_over_its_deadline(monkeypatch) -> None:
    # Daemon._tick reads the process's CPU clock (a syscall) after a job's tick only when that
    # tick was over job_tick_deadline_s: _spaced looks at the CPU then alone (issue 17).
    from types import SimpleNamespace

    import stallwatch.daemon.core as core
    from stallwatch.daemon.core import Daemon

    reads: list[float] = []
    monkeypatch.setattr(core.time, "process_time", lambda: reads.append(0.0) or 0.25 * len(reads))
    now = [0.0]
    took = {"fast": 0.1, "slow": 0.9}
    spaced: list[tuple[str, float | None]] = []

    def tick_of(name: str):
        def tick() -> None:
            now[0] += took[name]
        return tick

    runners = [SimpleNamespace(name=n, tick=tick_of(n)) for n in ("fast", "slow")]
    d = SimpleNamespace(
        clock=SimpleNamespace(monotonic=lambda: now[0], time=lambda: 1e9 + now[0]),
        config=SimpleNamespace(daemon=SimpleNamespace(job_tick_deadline_s=0.5)),
        _due_jobs=lambda t: runners, _job_errors={}, _db=None, ticks=0, dispatcher=None,
        db=SimpleNamespace(set_metas_later=lambda rows: None), tick_errors=0,
        _spaced=lambda r, start, end, cpu_s=None: spaced.append((r.name, cpu_s)))
    Daemon._tick(d)
    assert spaced == [("fast", None), ("slow", 0.25)]  # the slow one's CPU: read, and its own
    assert len(reads) == 3  # before each job's tick, after the slow one's only
