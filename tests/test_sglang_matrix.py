"""The fault matrix: the same faults against both stand-in shapes, judged by stallwatch live.

Each scenario is a real stand-in server (`--sglang-version current` or `0.5.4`, its stdout and
stderr in a file that stallwatch finds on its own), the reference client extracting against
it, and stallwatch's own Collector and built-in rules ticking every half second, in this process.
The verdicts are what upstream behaviour implies (docs/upstream.md §3):

| fault | current (2026) | 0.5.4 |
|---|---|---|
| a TP rank SIGSTOPped mid-batch | server_hang (the watchdog's deadline said), then server_down: "SGLang's watchdog killed it" | the same |
| a rank killed | server_down within seconds: "rank TP1 crashed: killed by signal 9" | server_hang (the zombie front), then server_down when the watchdog kills it |
| the scheduler stopped (tp 1) | server_hang; its watchdog is stopped with it, nothing will end it | the same |
| a client deadlock | hang, never server_hang | the same |
| one long batch on a healthy server (health 503) | healthy (working), never server_hang | the same |

Short thresholds make it fast: a 20 s hard watchdog, a 3 s health budget, and the stall floor and
activity window of stallwatch.engine.features lowered to 4 s. The ten scenarios run five at a
time (AT_ONCE); every wait is on an observation with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stallwatch.engine import diagnose as dg
from stallwatch.engine import features as feat
from stallwatch.probes.collector import Collector
from stallwatch.engine import Evaluator
from stallwatch.sglang.launch import launch_server
from stallwatch.sglang.procutil import set_pdeathsig
from stallwatch.probes.targets import Target

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process states")

SHAPES = ("current", "0.5.4")
FAULTS = ("rank_stopped", "rank_killed", "scheduler_stopped", "client_deadlock", "long_batch")
WATCHDOG_S = 20.0
LONG_BATCH_S = 18.0
SERVER = ["--device", "python", "--hidden-size", "16", "--num-layers", "2", "--enable-metrics",
          "--enable-return-hidden-states", "--health-timeout-s", "3", "--forward-delay-s", "0.05",
          "--decode-log-interval", "1000", "--watchdog-timeout", str(WATCHDOG_S)]
WARM_SAMPLES = 12  # progress before the fault: a cadence to judge by
DEADLINE_S = 120.0
# Scenarios ticking at once in this process: all ten shared one GIL, and beside CI's other
# workers (-n 3 on 2 cores) their half-second ticks stretched to 4-8 s, past the 4 s activity
# window, so a rank or the client read as "moving" between two ticks and a hang as a long step
# (rank_stopped, rank_killed on 0.5.4, long_batch failed that way in two CI runs, 2026-12-02).
AT_ONCE = 5


@dataclass
class Row:
    t: float  # since the fault
    kind: str
    rule: str | None
    summary: str
    evidence: list[str]
    advice: list[str]
    firing: list[str]
    server: dict


@dataclass
class Outcome:
    shape: str
    fault: str
    rows: list[Row] = field(default_factory=list)
    server_log: str = ""
    error: str = ""

    def first(self, kind: str) -> Row | None:
        return next((r for r in self.rows if r.kind == kind), None)

    def fired(self, rule: str) -> bool:
        return any(rule in r.firing for r in self.rows)

    def __str__(self) -> str:  # what an assertion failure shows
        lines = [f"{self.shape}/{self.fault}: {self.error}"]
        lines += [f"  {r.t:6.1f} {r.kind:12} {r.summary}" for r in self.rows[-40:]]
        return "\n".join(lines) + "\n--- server log tail:\n" + self.server_log[-3000:]


def _samples(out: Path) -> int:
    return sum(1 for _ in out.rglob("data_*.ckpt"))


def _run(shape: str, fault: str, work: Path) -> Outcome:
    res = Outcome(shape, fault)
    work.mkdir(parents=True)
    slog_path, clog, out = work / "server.out", work / "client.log", work / "hs"
    tp = "1" if fault == "scheduler_stopped" else "2"
    extra = ["--fault", "long", "--fault-after-requests", str(WARM_SAMPLES + 8),
             "--fault-slow-s", str(LONG_BATCH_S), "--watchdog-timeout", "300"] if fault == "long_batch" else []
    client_extra = ["--fault", "hang", "--fault-at", str(WARM_SAMPLES + 8)] if fault == "client_deadlock" else []
    server = client = None
    slog = open(slog_path, "ab")  # noqa: SIM115 - the server's log while it runs
    try:
        server = launch_server([*SERVER, "--sglang-version", shape, "--tp", tp, *extra], stdout=slog,
                               stderr=slog, die_with_parent=True, ready_timeout=90)
        client = subprocess.Popen(
            [sys.executable, "-m", "stallwatch.sglang.extract_client", "--server", server.url, "--out", str(out),
             "--num-samples", "100000", "--seq-len", "8", "--retry-s", "600", "--log", str(clog), *client_extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=set_pdeathsig)
        collector = Collector(Target(name="extract", pids=(client.pid,), log=clog, outputs=out, server=server.url),
                              gpu=False, use_inotify=False)
        ev = Evaluator(dg.load())
        deadline = time.monotonic() + DEADLINE_S
        while _samples(out) < WARM_SAMPLES:  # the watcher runs from the start, as a daemon would
            collector.tick()
            if time.monotonic() > deadline or client.poll() is not None:
                raise RuntimeError(f"the client made no progress (exit {client.poll()})")
            time.sleep(0.3)
        scheds = server.scheduler_pids()
        if fault in ("rank_stopped", "scheduler_stopped"):
            os.kill(scheds[-1], signal.SIGSTOP)
        elif fault == "rank_killed":
            os.kill(scheds[-1], signal.SIGKILL)
        t0 = time.monotonic()
        done = _done(fault, shape)
        while time.monotonic() < deadline:
            snap = collector.tick()
            v = feat.features(snap)
            e = ev.evaluate(v, snap.t_mono)
            vd = e.verdict
            res.rows.append(Row(time.monotonic() - t0, vd.kind, vd.rule, vd.summary,
                                [f"{x.signal}: {x.detail}" for x in vd.evidence], list(vd.advice),
                                e.names("firing"),
                                {k: v["server"][k] for k in ("busy", "health_failed", "down_cause")}))
            if done(res):
                break
            time.sleep(0.5)
        else:
            res.error = "deadline passed"
        collector.close()
    except Exception:  # noqa: BLE001 - reported by the scenario's test, not the fixture
        res.error = traceback.format_exc()
    finally:
        for pid in (server.scheduler_pids() if server else []):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if client is not None:
            client.kill()
            client.wait(10)
        if server is not None:
            server.stop()
        slog.close()
        res.server_log = slog_path.read_text(errors="replace")
    return res


def _done(fault: str, shape: str):
    """When a scenario has shown what it must (then the test asserts on the rows)."""
    def down_after_hang(r: Outcome) -> bool:
        return r.first("server_down") is not None and r.rows[-1].t - r.first("server_down").t >= 3
    if fault == "rank_stopped" or (fault == "rank_killed" and shape == "0.5.4"):
        return down_after_hang
    if fault == "rank_killed":
        return lambda r: r.first("server_down") is not None
    if fault == "scheduler_stopped":
        return lambda r: sum(1 for x in r.rows if x.kind == "server_hang") >= 6
    if fault == "client_deadlock":
        return lambda r: sum(1 for x in r.rows if x.kind == "hang") >= 6
    # long batch: seen working through the 503s, then progressing again
    return lambda r: (any(x.server["health_failed"] and x.kind == "healthy" and x.rule == "working_without_progress"
                          for x in r.rows) and r.rows[-1].t > LONG_BATCH_S + 6)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    # STALLWATCH_MATRIX=current/rank_killed,0.5.4/long_batch runs only those (for debugging)
    only = {tuple(x.split("/", 1)) for x in os.environ.get("STALLWATCH_MATRIX", "").split(",") if "/" in x}
    wanted = {(s, f) for s in SHAPES for f in FAULTS if not only or (s, f) in only}
    saved = feat.STALL_FLOOR_S, feat.ACTIVITY_WINDOW_S
    feat.STALL_FLOOR_S, feat.ACTIVITY_WINDOW_S = 4.0, 4.0  # short thresholds (module doc)
    base = tmp_path_factory.mktemp("matrix")
    try:
        with ThreadPoolExecutor(min(len(wanted), AT_ONCE)) as pool:
            futs = {k: pool.submit(_run, k[0], k[1], base / f"{k[0]}-{k[1]}") for k in sorted(wanted)}
            return {k: f.result() for k, f in futs.items()}
    finally:
        feat.STALL_FLOOR_S, feat.ACTIVITY_WINDOW_S = saved


def _get(matrix: dict, key: tuple[str, str]) -> Outcome:
    if key not in matrix:
        pytest.skip(f"{key} not selected by STALLWATCH_MATRIX")
    return matrix[key]


def _ev(row: Row, signal: str) -> list[str]:
    return [e for e in row.evidence if e.startswith(signal + ": ")]


@pytest.mark.parametrize("shape", SHAPES)
def test_rank_stopped_mid_batch_hangs_then_the_watchdog_kills_it(matrix, shape):
    r = _get(matrix, (shape, "rank_stopped"))
    assert not r.error, str(r)
    hang, down = r.first("server_hang"), r.first("server_down")
    assert hang is not None and down is not None and hang.t < down.t, str(r)
    assert any("one rank is stuck while the others wait on it" in e for e in hang.evidence), str(r)
    assert any("TP1 pid" in e and "state T" in e for e in _ev(hang, "rank")), str(r)
    watchdog = " ".join(_ev(hang, "watchdog"))
    route = "/server_info" if shape == "current" else "/get_server_info"  # whichever answers
    assert f"SGLang's watchdog (--watchdog-timeout {WATCHDOG_S:g} s, from {route}) kills the whole " \
        f"server {WATCHDOG_S:g}-{1.5 * WATCHDOG_S + 5:g} s after the last forward step" in watchdog, str(r)
    # SGLang's own watchdog fires 20-30 s after the last forward, +5 s: the verdict turns, with the cause
    assert f"SGLang's watchdog killed it after {WATCHDOG_S:g} s without a forward step on TP0" in down.summary, str(r)
    line = "Scheduler watchdog timeout (self.watchdog_timeout=20, self.soft=False)" if shape == "current" \
        else "Watchdog timeout (self.watchdog_timeout=20)"
    assert any(line in e for e in _ev(down, "server_log")), str(r)
    assert not any(x.kind == "hang" for x in r.rows), str(r)


def test_rank_killed_on_current_sglang_is_server_down_at_once(matrix):
    r = _get(matrix, ("current", "rank_killed"))
    assert not r.error, str(r)
    down = r.first("server_down")
    assert down is not None and down.t < 15, str(r)
    assert not r.fired("server_hang"), r  # no zombie front any more (#18582)
    assert "rank TP1 crashed: killed by signal 9; SGLang's subprocess watchdog then killed the server" \
        in down.summary, str(r)
    assert any("Subprocess scheduler_1 (pid=" in e and "crashed with exit code -9" in e
               for e in _ev(down, "server_log")), str(r)
    assert any("SIGQUIT received" in e for e in _ev(down, "server_log")), str(r)


def test_rank_killed_on_0_5_4_is_a_zombie_until_the_watchdog(matrix):
    r = _get(matrix, ("0.5.4", "rank_killed"))
    assert not r.error, str(r)
    hang, down = r.first("server_hang"), r.first("server_down")
    assert hang is not None and down is not None and hang.t < down.t, str(r)
    assert any("sglang::scheduler_TP1" in e and "has exited" in e for e in _ev(hang, "rank")), str(r)
    assert any("Child process unexpectedly failed with exitcode=9" in e for e in _ev(hang, "server_log")), str(r)
    assert ("rank TP1 crashed: killed by signal 9; the HTTP front stayed up without it until SGLang's "
            f"watchdog killed the tree after {WATCHDOG_S:g} s") in down.summary, str(r)


@pytest.mark.parametrize("shape", SHAPES)
def test_scheduler_stopped_is_server_hang_that_no_watchdog_ends(matrix, shape):
    r = _get(matrix, (shape, "scheduler_stopped"))
    assert not r.error, str(r)
    hang = r.first("server_hang")
    assert hang is not None and not r.fired("server_down"), str(r)
    assert any("will not end this: every scheduler is stopped" in e for e in _ev(hang, "watchdog")), str(r)
    assert any("TP0 pid" in e and "state T" in e for e in _ev(hang, "rank")), str(r)


@pytest.mark.parametrize("shape", SHAPES)
def test_client_deadlock_is_hang_not_the_server(matrix, shape):
    r = _get(matrix, (shape, "client_deadlock"))
    assert not r.error, str(r)
    assert r.first("hang") is not None and not r.fired("server_hang") and not r.fired("server_down"), str(r)


@pytest.mark.parametrize("shape", SHAPES)
def test_long_batch_on_a_healthy_server_is_not_server_hang(matrix, shape):
    """One batch longer than SGLANG_HEALTH_CHECK_TIMEOUT: /health_generate answers 503 on a
    healthy server; every rank computes, so the job is waiting on work, not on a hang."""
    r = _get(matrix, (shape, "long_batch"))
    assert not r.error, str(r)
    assert not r.fired("server_hang") and not r.fired("hang") and not r.fired("server_down"), str(r)
    working = [x for x in r.rows if x.server["health_failed"] and x.rule == "working_without_progress"]
    assert working and all(x.server["busy"] for x in working), str(r)
    assert "Health check failed" in r.server_log, str(r)
