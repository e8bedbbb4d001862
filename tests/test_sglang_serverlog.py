"""The SGLang server's own log: parsing real lines, the probe's safety, and what the rules see.

The lines are captures from real SGLang logs (0.5.x, 2026: watchdog kills, subprocess crashes,
SIGQUIT handling) quoted in public bug reports; docs/upstream.md §3 has where each comes from.
"""

from __future__ import annotations

import os

import pytest

from stallwatch.clock import FakeClock
from stallwatch.probes.server_log import ServerLogProbe, stdio_log
from stallwatch.probes.processes import OpenFileObs
from stallwatch.engine.serverfate import _deadline, server_busy
from stallwatch.sglang.serverlog import LogState, down_cause, parse_line

CRASHED = ("[2026-08-10 09:47:36] Subprocess scheduler_0 (pid=3417555) crashed with exit code -3. "
           "Triggering SIGQUIT for cleanup...")
SIGQUIT = "[2026-08-10 09:47:36] SIGQUIT received. signum=None, frame=None. It usually means one child failed."
WATCHDOG = "[2026-09-22 01:05:16] Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)"
WATCHDOG_OLD = "[2025-08-20 10:00:00 TP1] Watchdog timeout (self.watchdog_timeout=300)"
SOFT = "[2026-09-22 01:05:16 DP0 TP2] Scheduler watchdog timeout (self.watchdog_timeout=60, self.soft=True)"
CHILD_FAILED = "[2025-04-22 13:37:01] Child process unexpectedly failed with exitcode=256. pid=32885"
READY = "[2026-03-04 13:00:00] The server is fired up and ready to roll!"
ARGS = ("[2026-03-04 12:59:00] server_args=ServerArgs(model_path='m', tp_size=2, "
        "soft_watchdog_timeout=None, watchdog_timeout=120.0, dist_timeout=None)")


def test_real_lines() -> None:
    c = parse_line(CRASHED)
    assert (c.kind, c.name, c.pid, c.exit_code) == ("crashed", "scheduler_0", 3417555, -3)
    assert parse_line(SIGQUIT).kind == "sigquit"
    w = parse_line(WATCHDOG)
    assert (w.kind, w.timeout_s, w.soft, w.rank) == ("watchdog", 300.0, False, "")
    assert parse_line(WATCHDOG_OLD).timeout_s == 300.0 and parse_line(WATCHDOG_OLD).rank == "TP1"
    s = parse_line(SOFT)
    assert s.soft and s.rank == "DP0_TP2" and s.timeout_s == 60.0
    f = parse_line(CHILD_FAILED)  # the raw wait status: 256 is exit code 1
    assert (f.kind, f.pid, f.exit_code) == ("child_failed", 32885, 1)
    a = parse_line(ARGS)  # soft_watchdog_timeout=None must not be read as watchdog_timeout
    assert a.kind == "args" and a.timeout_s == 120.0 and a.soft_timeout_s is None
    assert parse_line('INFO:     127.0.0.1:5000 - "GET /health_generate HTTP/1.1" 200 OK') is None


def test_causes_in_words() -> None:
    st = LogState()
    for line in (CRASHED, SIGQUIT):
        st.feed(parse_line(line))
    assert down_cause(st, {3417555: "DP0_TP2"}) == (
        "rank DP0_TP2 crashed: killed by signal 3; SGLang's subprocess watchdog then killed the server")
    assert down_cause(st).startswith("rank scheduler_0 crashed: killed by signal 3")
    st = LogState()
    st.feed(parse_line(WATCHDOG))
    st.feed(parse_line(SIGQUIT))
    assert down_cause(st) == ("SGLang's watchdog killed it after 300 s without a forward step "
                              "(--watchdog-timeout)")
    st = LogState()
    st.feed(parse_line(SOFT))  # soft: logged, kills nothing
    assert down_cause(st) == "" and st.soft_watchdog is not None


def test_a_restart_forgets_the_previous_run() -> None:
    st = LogState()
    for line in (ARGS, CRASHED, SIGQUIT, READY):
        st.feed(parse_line(line))
    assert st.crashed is None and st.sigquit is None and st.starts == 1
    assert st.args is not None and st.args.timeout_s == 120.0  # the args line precedes "ready"


def test_probe_reads_history_then_new_lines_with_ages(tmp_path) -> None:
    log = tmp_path / "server.log"
    log.write_text(ARGS + "\n" + READY + "\n")
    clock = FakeClock()
    probe = ServerLogProbe(log, clock)
    obs = probe.collect()
    assert obs.status == "ok" and obs.args_watchdog_timeout_s == 120.0 and obs.crashed is None
    with log.open("a") as f:
        f.write(CRASHED + "\n" + SIGQUIT + "\n")
    clock.advance(1.0)
    probe.collect()
    clock.advance(4.0)
    obs = probe.collect()
    assert obs.crashed.pid == 3417555 and obs.crashed.age_s == 4.0 and obs.sigquit is not None


def test_a_symlink_in_place_of_the_log_is_not_followed(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(CRASHED + "\n")
    link = tmp_path / "server.log"
    link.symlink_to(secret)
    obs = ServerLogProbe(link).collect()
    assert obs.status == "denied" and "symlink: not followed" in obs.error and obs.crashed is None


def test_a_discovered_log_its_user_could_not_read_is_not_read(tmp_path) -> None:
    log = tmp_path / "server.log"
    log.write_text(CRASHED + "\n")
    os.chmod(log, 0o600)
    other = os.stat(log).st_uid + 1000
    probe = ServerLogProbe()
    probe.discover(str(log), "the server's stderr", other)
    obs = probe.collect()
    assert obs.status == "denied" and obs.crashed is None and obs.discovered
    mine = ServerLogProbe()
    mine.discover(str(log), "the server's stderr", os.stat(log).st_uid)
    assert mine.collect().crashed is not None
    files = (OpenFileObs(fd=1, path="/dev/pts/3"), OpenFileObs(fd=2, path=str(log)))
    assert stdio_log(files, 77) == (str(log), "the server's stderr (pid 77, fd 2)")
    assert stdio_log((OpenFileObs(fd=2, path="pipe:[123]"),), 77) is None


def _rank(state: str, quiet_s: float = 0.0, stuck: bool = False, state_for_s: float = 5.0) -> dict:
    return {"state": state, "quiet_s": quiet_s, "stuck": stuck, "state_for_s": state_for_s}


def test_watchdog_deadline_from_the_last_forward() -> None:
    server = {"ranks": [_rank("R"), _rank("T", 40.0, True)], "running_reqs": 1.0}
    d = _deadline(server, {"waiting": True, "quiet_s": 40.0}, 300.0, "from /server_info")
    assert d["watchdog_armed"] and d["watchdog_kill_lo_s"] == 260.0 and d["watchdog_kill_hi_s"] == 415.0
    assert "in 260-415 s" in d["watchdog_text"]
    # every scheduler stopped: their watchdog threads are stopped too, nothing will fire
    d = _deadline({"ranks": [_rank("T", 40.0, True)]}, {"waiting": True}, 300.0, "")
    assert not d["watchdog_armed"] and "will not end this" in d["watchdog_text"]
    # no batch in flight: the watchdog is not active (#33858)
    assert not _deadline({"ranks": [_rank("S")], "running_reqs": 0.0}, {"waiting": False}, 300.0, "")["watchdog_armed"]


@pytest.mark.parametrize("ranks, blocked, running, busy", [
    ([_rank("R"), _rank("R")], True, 1.0, True),
    ([_rank("R"), _rank("T", 30.0, True)], True, 1.0, False),  # one rank stopped: the others spin on it
    ([_rank("R"), _rank("S")], True, 1.0, False),
    ([_rank("R"), _rank("R", state_for_s=0.5)], True, 1.0, False),  # a wake-up caught by one sample
    ([_rank("R"), _rank("R")], False, 1.0, False),  # the client is not waiting for an answer
    ([_rank("R"), _rank("R")], True, 0.0, False),  # an idle scheduler spinning (SGLang's loop)
])
def test_server_busy(ranks, blocked, running, busy) -> None:
    server = {"ranks": ranks, "ranks_gone": [], "watchdog_timeout_s": 300.0, "metrics_ok": True,
              "running_reqs": running, "queue_reqs": 0.0}
    assert server_busy(server, {"blocked": blocked, "quiet_s": 30.0}) is busy


def test_config_server_log_is_a_path_relative_to_the_config(tmp_path) -> None:
    from stallwatch.daemon.config import parse_config

    cfg = parse_config('[[job]]\nname = "x"\nmatch = "extract"\nserver = "http://127.0.0.1:30000"\n'
                       'server_log = "logs/sglang.log"\n', base=tmp_path)
    assert cfg.job[0].server_log == tmp_path / "logs" / "sglang.log"
