"""What SGLang itself will do, or did, to a stuck server: variables for the server rules.

Current SGLang does not leave a stuck server standing (docs/upstream.md §3): the hard watchdog
(`--watchdog-timeout`, default 300 s) runs in every scheduler while a batch is in flight, polls
every timeout/2, and 5 s after it fires the whole tree is killed — 300-450 s after the last
forward step (+5 s). Since 2026-03-29 a dead child takes the tree down within ~1-2 s. So a
`server_hang` has a deadline, and a `server_down` has a cause that only the server's log keeps.

Pure: from the features already computed (server, ranks, client) and the snapshot's server log
and server process tree.
"""

from __future__ import annotations

import re
from typing import Any

from stallwatch.sglang.serverlog import down_cause
from stallwatch.sglang.titles import parse_title
from stallwatch.probes.snapshot import Snapshot

DEFAULT_WATCHDOG_S = 300.0  # ServerArgs.watchdog_timeout since 0.5.0
KILL_SLEEP_S = 5.0  # the watchdog sleeps this long after its log line before the SIGQUIT
_FLAG = re.compile(r"^--watchdog[-_]timeout(?:=(.*))?$")


def server_fate(snap: Snapshot, server: dict[str, Any], client: dict[str, Any]) -> dict[str, Any]:
    slog = snap.server_log
    out: dict[str, Any] = {
        "log_known": bool(slog and slog.status == "ok"),
        "log_path": (slog.path or "") if slog else "",
        "log_error": (slog.error or "") if slog and slog.status != "ok" else "",
        "crash_line": _line(slog.crashed) if slog else "",
        "watchdog_line": _line(slog.watchdog) if slog else "",
        "sigquit_line": _line(slog.sigquit) if slog else "",
        "exception_line": _line(slog.exception) if slog else "",
        "watchdog_fired": bool(slog and slog.watchdog),
        "down_cause": _cause(snap),
    }
    timeout, source = _watchdog_timeout(snap, server)
    out.update(watchdog_timeout_s=timeout if timeout is not None else -1.0, watchdog_source=source)
    out.update(_deadline(server, client, timeout, source))
    return out


def _line(ev) -> str:
    return ev.line if ev is not None else ""


def _cause(snap: Snapshot) -> str:
    return down_cause(snap.server_log, _rank_of_pid(snap)) if snap.server_log else ""


def _rank_of_pid(snap: Snapshot) -> dict[int, str]:
    """pid -> rank label of every scheduler stallwatch saw, alive or exited."""
    sp = snap.server_processes
    out: dict[int, str] = {}
    for pid, cmdline in ([(p.pid, p.cmdline) for p in sp.processes] + [(e.pid, e.cmdline or "") for e in sp.exited]
                         if sp else []):
        t = parse_title(cmdline)
        if t is not None and t.role == "scheduler":
            out[pid] = t.label
    return out


def _watchdog_timeout(snap: Snapshot, server: dict[str, Any]) -> tuple[float | None, str]:
    """The hard watchdog's timeout: /server_info's server args, the log's, the command line, or
    SGLang's default when the server is SGLang (it has scheduler processes)."""
    s = snap.server
    if s is not None and s.watchdog_timeout_s is not None:
        return s.watchdog_timeout_s, f"from {s.info_route or '/server_info'}"
    slog = snap.server_log
    if slog is not None and slog.args_watchdog_timeout_s is not None:
        return slog.args_watchdog_timeout_s, "from the server's log"
    sp = snap.server_processes
    for p in (sp.processes if sp else ()):
        argv = list(p.argv)
        for i, a in enumerate(argv):
            m = _FLAG.match(a)
            if m is None:
                continue
            value = m[1] if m[1] is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                return float(value), "from its command line"
            except ValueError:
                break
    if server.get("ranks"):
        return DEFAULT_WATCHDOG_S, "SGLang's default"
    return None, ""


def _deadline(server: dict[str, Any], client: dict[str, Any], timeout: float | None,
              source: str) -> dict[str, Any]:
    """When the hard watchdog will kill a stuck server, and whether it can at all."""
    none = {"watchdog_armed": False, "watchdog_kill_lo_s": -1.0, "watchdog_kill_hi_s": -1.0,
            "watchdog_text": ""}
    ranks = server.get("ranks") or []
    in_flight = bool(client.get("waiting")) or server.get("running_reqs", -1.0) > 0
    if timeout is None or not ranks or not in_flight:
        return none
    if all(r["state"] in ("T", "t") for r in ranks):
        return {**none, "watchdog_text": (
            f"SGLang's watchdog (--watchdog-timeout {timeout:g} s) will not end this: every scheduler "
            "is stopped, and its watchdog thread with it; only kill -CONT or a restart will")}
    stuck = [r["quiet_s"] for r in ranks if r.get("stuck")]
    since = max(stuck) if stuck else max(0.0, float(client.get("quiet_s") or 0.0))
    lo = max(0.0, timeout - since)
    hi = max(0.0, 1.5 * timeout + KILL_SLEEP_S - since)
    text = (f"SGLang's watchdog (--watchdog-timeout {timeout:g} s, {source}) kills the whole server "
            f"{timeout:g}-{1.5 * timeout + KILL_SLEEP_S:g} s after the last forward step "
            f"({since:.0f} s ago): in {lo:.0f}-{hi:.0f} s, and the requests in flight are lost then")
    if since > 1.5 * timeout + KILL_SLEEP_S:
        text = (f"SGLang's watchdog (--watchdog-timeout {timeout:g} s, {source}) should have killed "
                f"the server by now ({since:.0f} s without a forward step) and has not: it is off, "
                "soft, or stopped with its rank")
    return {"watchdog_armed": True, "watchdog_kill_lo_s": lo, "watchdog_kill_hi_s": hi,
            "watchdog_text": text}


BUSY_MIN_S = 2.0  # a rank seen in R this long, not a wake-up caught by one sample


def server_busy(server: dict[str, Any], client: dict[str, Any]) -> bool:
    """One long batch, not a hang (a large return_hidden_states prefill copies T×H rows to the
    CPU inside the loop): the client waits for its answer — blocked reading the socket, or (a
    client with a socket timeout sleeps in poll) asleep while the gauges say a request runs —
    every scheduler rank has stayed on the CPU (state R: running or runnable, whatever its share
    of a loaded machine) for BUSY_MIN_S, none is stuck or gone, and the gauges, when known, do
    not say the server is empty (an idle SGLang scheduler may spin too). Bounded by the
    watchdog: past its timeout SGLang itself calls the batch stuck."""
    ranks = server.get("ranks") or []
    running = server.get("metrics_ok") and server.get("running_reqs", -1.0) > 0
    if not ranks or server.get("ranks_gone") or not (client.get("blocked") or (client.get("waiting") and running)):
        return False
    if any(r.get("stuck") or r["state"] != "R" or r.get("state_for_s", 0.0) < BUSY_MIN_S for r in ranks):
        return False
    if server.get("metrics_ok") and server.get("running_reqs", -1.0) == 0 and server.get("queue_reqs", -1.0) == 0:
        return False
    timeout = server.get("watchdog_timeout_s", -1.0)
    return timeout <= 0 or float(client.get("quiet_s") or 0.0) < timeout
