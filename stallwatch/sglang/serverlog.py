"""The SGLang server's own log, parsed: the lines that say why a server died or will die.

Pure functions of one line, and a small reducer; the probe (stallwatch.probes.server_log) reads
the file. The lines, as upstream writes them (sgl-project/sglang; docs/upstream.md §3):

- every line `[YYYY-MM-DD HH:MM:SS DP0 TP2] message`: the bracket holds the rank prefix of the
  process that wrote it (none for the HTTP process or a single scheduler);
- the hard watchdog: `Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)`
  (0.5.x before 2025-12: `Watchdog timeout (self.watchdog_timeout=300)`); `soft=True` comes from
  `--soft-watchdog-timeout` and kills nothing. After the line the scheduler sleeps 5 s and
  SIGQUITs the HTTP process, which kills the tree;
- since #18582 (2026-03-29) the SubprocessWatchdog:
  `Subprocess scheduler_2 (pid=4242) crashed with exit code -9. Triggering SIGQUIT for cleanup...`
  (the name is `scheduler_{index}` or `detokenizer`), then the HTTP process's handler:
  `SIGQUIT received. signum=None, frame=None. It usually means one child failed.`;
  older builds: `Received sigquit from a child process. It usually means the child failed.`;
- `Scheduler hit an exception: Traceback ...` (a rank's Python error; it SIGQUITs the parent),
  `Health check failed. ...`, and `The server is fired up and ready to roll!` once per start:
  everything before the last such line belongs to an earlier run of the server;
- the server args at start: `server_args=ServerArgs(... watchdog_timeout=300, ...)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_PREFIX = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)((?: [A-Z][A-Z_]*\d+)*)\]\s?(.*)$")
_WATCHDOG = re.compile(r"(?:Scheduler )?[Ww]atchdog timeout \(self\.watchdog_timeout=([\d.]+)"
                       r"(?:, self\.soft=(True|False))?\)")
_CRASHED = re.compile(r"Subprocess (\S+) \(pid=(\d+)\) crashed with exit code (-?\d+)")
_CHILD_FAILED = re.compile(r"Child process unexpectedly failed with (?:exitcode=|an exit code )(-?\d+)\.? ?pid=(\d+)")
_SIGQUIT = re.compile(r"SIGQUIT received|Received sigquit from a child process")
_ARG = r"(?<![a-z_])(soft_watchdog_timeout|watchdog_timeout)['\"]?\s*[=:]\s*([\d.]+|None)"
_SERVER_ARGS = re.compile(r"server_args\s*=")
_READY = "The server is fired up and ready to roll!"
_MAX_LINE = 600  # evidence lines are shown to people and stored in traces


@dataclass(frozen=True)
class LogEvent:
    kind: str  # watchdog | crashed | child_failed | sigquit | exception | health_failed | ready | args
    line: str
    rank: str = ""  # DP0_TP2, from the line's prefix
    timeout_s: float | None = None  # watchdog: its timeout; args: --watchdog-timeout
    soft: bool = False
    soft_timeout_s: float | None = None  # args: --soft-watchdog-timeout
    name: str = ""  # crashed: scheduler_2, detokenizer
    pid: int | None = None
    exit_code: int | None = None


def parse_line(line: str) -> LogEvent | None:
    m = _PREFIX.match(line)
    rank, msg = ("_".join(m[2].split()), m[3]) if m else ("", line)
    text = line[:_MAX_LINE]
    if (w := _WATCHDOG.search(msg)) is not None:
        return LogEvent("watchdog", text, rank, timeout_s=float(w[1]), soft=w[2] == "True")
    if (c := _CRASHED.search(msg)) is not None:
        return LogEvent("crashed", text, rank, name=c[1], pid=int(c[2]), exit_code=int(c[3]))
    if (c := _CHILD_FAILED.search(msg)) is not None:
        return LogEvent("child_failed", text, rank, pid=int(c[2]), exit_code=_exit_of_status(int(c[1])))
    if _SIGQUIT.search(msg):
        return LogEvent("sigquit", text, rank)
    if msg.startswith("Scheduler hit an exception"):
        return LogEvent("exception", text, rank)
    if msg.startswith("Health check failed"):
        return LogEvent("health_failed", text, rank)
    if _READY in msg:
        return LogEvent("ready", text, rank)
    if _SERVER_ARGS.search(msg):
        args = {k: v for k, v in re.findall(_ARG, msg)}
        if args:
            return LogEvent("args", text[:200], rank, timeout_s=_num(args.get("watchdog_timeout")),
                            soft_timeout_s=_num(args.get("soft_watchdog_timeout")))
    return None


def _num(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "None") else None
    except ValueError:
        return None


def _exit_of_status(raw: int) -> int:
    """SGLang's SIGCHLD handler prints the raw wait status: signal N as N, exit code E as E<<8."""
    if raw > 0 and raw & 0x7F == 0:
        return raw >> 8
    return -(raw & 0x7F) if raw > 0 else raw


@dataclass
class LogState:
    """What the log says about the current run of the server (reset at each start)."""

    watchdog: LogEvent | None = None  # the last hard watchdog firing
    soft_watchdog: LogEvent | None = None
    crashed: LogEvent | None = None  # the first child that died (the cause; later ones follow it)
    sigquit: LogEvent | None = None
    exception: LogEvent | None = None
    health_failed: LogEvent | None = None
    args: LogEvent | None = None  # kept across restarts only until the next args line
    starts: int = 0

    def feed(self, ev: LogEvent) -> None:
        if ev.kind == "ready":
            args = self.args
            self.__init__(starts=self.starts + 1)  # type: ignore[misc]  # reset in place; no subclass
            self.args = args
        elif ev.kind == "args":
            self.args = ev
        elif ev.kind == "watchdog":
            if ev.soft:
                self.soft_watchdog = ev
            else:
                self.watchdog = ev
        elif ev.kind in ("crashed", "child_failed"):
            # The first child that died is the cause; the SubprocessWatchdog's line, which
            # follows the SIGCHLD handler's for the same child on current SGLang, says more.
            if self.crashed is None or (ev.kind == "crashed" and self.crashed.kind == "child_failed"):
                self.crashed = ev
        elif ev.kind == "sigquit":
            self.sigquit = self.sigquit or ev
        elif ev.kind == "exception":
            self.exception = self.exception or ev
        elif ev.kind == "health_failed":
            self.health_failed = ev


def down_cause(state: Any, rank_of_pid: dict[int, str] | None = None) -> str:
    """Why the server died, in a person's words, from the log alone ("" when it does not say).
    `state`: a LogState, or anything with its crashed/watchdog/exception/sigquit events (the
    probe's ServerLogObs).

    The crashed child's rank comes from the pid: the SubprocessWatchdog names schedulers by their
    index (`scheduler_2`), and `rank_of_pid` (what stallwatch saw of the tree) says DP0_TP2.
    """
    c = state.crashed
    if c is not None:
        who = (rank_of_pid or {}).get(c.pid or -1) or c.rank or c.name or f"pid {c.pid}"
        what = "rank " + who if not who.startswith(("detokenizer", "pid ")) else who
        how = f"exit code {c.exit_code}" if c.exit_code is None or c.exit_code >= 0 else \
            f"killed by signal {-c.exit_code}"
        tail = ("; SGLang's subprocess watchdog then killed the server" if c.kind == "crashed"
                else "; the HTTP front stayed up without it"
                + (f" until SGLang's watchdog killed the tree after {state.watchdog.timeout_s:g} s"
                   if state.watchdog is not None else ""))
        return f"{what} crashed: {how}{tail}"
    w = state.watchdog
    if w is not None:
        where = f" on {w.rank}" if w.rank else ""
        return (f"SGLang's watchdog killed it after {w.timeout_s:g} s without a forward step{where} "
                f"(--watchdog-timeout)")
    if state.exception is not None:
        where = f" {state.exception.rank}" if state.exception.rank else ""
        return f"a scheduler{where} hit an exception and SIGQUIT the server"
    if state.sigquit is not None:
        return "a child process failed and the server killed its tree (SIGQUIT)"
    return ""
