"""The server-log probe: follow the SGLang server's own log and keep what says why it dies.

Current SGLang kills its whole tree within seconds of a rank dying, and its hard watchdog kills
it minutes after a batch stops (docs/upstream.md §3): by the time stallwatch sees `server_down`, the
per-rank evidence is gone, and only the server's log still says why. The lines are parsed by
stallwatch.sglang.serverlog; this probe reads the file like the job log (LogFollower: bounded
reads per tick, rotation and truncation handled) and times each finding with the injected clock.

The path is configured (`server_log`) or found in the server's own stdout/stderr (fd 1/2) when
they are a regular file. That file belongs to the job's user, who may swap it for a symlink to
anything: LogFollower opens it as it opens the job's log (safefs: no link followed, regular files
only), and only when the server's user (a discovered log) or the job's user (a configured one,
config `user`/`group`) could read it himself (docs/security.md).
"""

from __future__ import annotations

import os
from typing import Any

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.model import Frozen
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.logfollow import LogFollower
from stallwatch.sglang.serverlog import LogEvent, LogState, parse_line

_MAX_SCAN_LINES = 20_000  # lines parsed per tick; the follower already bounds the bytes


class ServerLogEvent(Frozen):
    kind: str
    line: str
    rank: str = ""
    timeout_s: float | None = None
    soft: bool = False
    name: str = ""
    pid: int | None = None
    exit_code: int | None = None
    age_s: float = 0.0  # since stallwatch read the line (history read at start counts from then)


class ServerLogObs(Frozen):
    path: str | None = None
    discovered: bool = False  # found as the server's stdout/stderr, not configured
    how: str = ""  # how it was found
    status: ProbeStatus = ProbeStatus.none  # none: no server log known (yet)
    error: str | None = None
    lines_read: int = 0
    starts: int = 0  # "ready to roll" lines seen: runs of the server in this file
    watchdog: ServerLogEvent | None = None  # the hard watchdog fired (this run)
    soft_watchdog: ServerLogEvent | None = None
    crashed: ServerLogEvent | None = None  # the first child that died
    sigquit: ServerLogEvent | None = None
    exception: ServerLogEvent | None = None
    health_failed: ServerLogEvent | None = None
    args_watchdog_timeout_s: float | None = None  # from the server_args line at start
    args_soft_watchdog_timeout_s: float | None = None


class ServerLogProbe:
    name = "server_log"

    def __init__(self, path: str | os.PathLike[str] | None = None, clock: Clock = SYSTEM_CLOCK,
                 reader: tuple[int, frozenset[int]] | None = None) -> None:
        self.clock = clock
        self._follower: LogFollower | None = None
        self._discovered = False
        self._how = ""
        self._state = LogState()
        self._seen_mono: dict[int, float] = {}  # id(event) -> when read
        self._lines = 0
        # pid -> rank label of the schedulers seen alive: SGLang's crash line names a rank by its
        # index (scheduler_2), and by the time it is read the tree may be gone.
        self._labels: dict[int, str] = {}
        if path is not None:
            self._follower = LogFollower(path, initial_tail_bytes=256 << 10, chunk_budget_bytes=1 << 20,
                                         reader=reader)
            self._how = "configured"

    @property
    def path(self) -> str | None:
        return self._follower.path if self._follower else None

    def discover(self, path: str, how: str, uid: int, gids: frozenset[int] = frozenset()) -> None:
        """Follow `path`, found in the server's fds; read it only if its user (uid) could."""
        if self._follower is not None:
            return
        self._follower = LogFollower(path, initial_tail_bytes=256 << 10, chunk_budget_bytes=1 << 20,
                                     reader=(uid, frozenset(gids)))
        self._discovered, self._how = True, how

    def note_schedulers(self, labels: dict[int, str]) -> None:
        self._labels.update(labels)
        while len(self._labels) > 1024:
            self._labels.pop(next(iter(self._labels)))

    def collect(self) -> ServerLogObs:
        if self._follower is None:
            return ServerLogObs(error="no server log configured or found in the server's stdout/stderr")
        res = self._follower.poll()
        now = self.clock.monotonic()
        base: dict[str, Any] = dict(path=self._follower.path, discovered=self._discovered, how=self._how,
                    status=res.status, error=res.error)
        if res.status == ProbeStatus.ok:
            for line in res.lines[-_MAX_SCAN_LINES:]:
                ev = parse_line(line)
                if ev is not None:
                    self._state.feed(ev)
                    self._seen_mono.setdefault(id(ev), now)
            self._lines += len(res.lines)
        st = self._state
        live = {id(e) for e in (st.watchdog, st.soft_watchdog, st.crashed, st.sigquit, st.exception,
                                st.health_failed, st.args) if e is not None}
        self._seen_mono = {k: v for k, v in self._seen_mono.items() if k in live}
        args = st.args
        return ServerLogObs(
            **base, lines_read=self._lines, starts=st.starts,
            watchdog=self._event(st.watchdog, now), soft_watchdog=self._event(st.soft_watchdog, now),
            crashed=self._event(st.crashed, now), sigquit=self._event(st.sigquit, now),
            exception=self._event(st.exception, now), health_failed=self._event(st.health_failed, now),
            args_watchdog_timeout_s=args.timeout_s if args else None,
            args_soft_watchdog_timeout_s=args.soft_timeout_s if args else None,
        )

    def _event(self, ev: LogEvent | None, now: float) -> ServerLogEvent | None:
        if ev is None:
            return None
        rank = ev.rank or (self._labels.get(ev.pid, "") if ev.pid is not None else "")
        return ServerLogEvent(kind=ev.kind, line=ev.line, rank=rank, timeout_s=ev.timeout_s, soft=ev.soft,
                              name=ev.name, pid=ev.pid, exit_code=ev.exit_code,
                              age_s=now - self._seen_mono.get(id(ev), now))


def stdio_log(files: tuple, how_pid: int) -> tuple[str, str] | None:
    """The server's log from its open files: fd 2, else fd 1, when a regular file's path."""
    by_fd = {f.fd: f.path for f in files}
    for fd, what in ((2, "stderr"), (1, "stdout")):
        path = by_fd.get(fd, "")
        if (path.startswith("/") and not path.startswith(("/dev/", "/proc/", "/sys/"))
                and not path.endswith(" (deleted)")):
            return path, f"the server's {what} (pid {how_pid}, fd {fd})"
    return None


__all__ = ["ServerLogProbe", "ServerLogObs", "ServerLogEvent", "stdio_log"]
