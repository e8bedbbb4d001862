"""Builds the probes for one target and runs them once per tick into a frozen Snapshot.

Every probe runs in a worker under a deadline (DeadlineRunner): /proc/PID/cmdline can block on a
process stuck holding its mmap lock, NVML can hang in a wedged driver, and a log on a frozen
filesystem blocks read(). A probe that fails or hangs becomes a ProbeReport, never a hung tick.
A tick's probes are one batch for the runner's lane thread, the disks probe last (its paths come
from the processes probe's answer).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.probes.base import (
    DeadlineRunner, Probe, ProbeReport, ProbeStatus, field_defaults, made, report_for_observation,
    run_inline,
)
from stallwatch.probes.disks import DisksProbe
from stallwatch.probes.gpu import GpuProbe
from stallwatch.probes.kmsg import KmsgProbe
from stallwatch.probes.log import LogProbe
from stallwatch.probes.outputs import OutputsProbe
from stallwatch.probes.processes import ProcessesObs, ProcessesProbe
from stallwatch.probes.server import ServerProbe
from stallwatch.probes.server_log import ServerLogProbe, stdio_log
from stallwatch.probes.server_processes import ServerProcessesProbe
from stallwatch.sglang.titles import parse_title
from stallwatch.kernel.roots import DEFAULT_ROOTS, Roots
from stallwatch.probes.snapshot import PROBE_FIELDS, Snapshot
from stallwatch.probes.targets import Target

_SNAPSHOT_DEFAULTS = field_defaults(Snapshot)
# A probe as the tick runs it: (probe, name, snapshot field, its unchanged(), its cannot_block())
_Planned = tuple[Probe, str, str, Callable[[], bool] | None, Callable[[], bool] | None]


class Collector:
    def __init__(
        self,
        target: Target,
        *,
        roots: Roots = DEFAULT_ROOTS,
        clock: Clock = SYSTEM_CLOCK,
        nvml=None,
        gpu: bool = True,
        kernel_history: bool = False,
        deadline_s: float = 5.0,
        use_inotify: bool = True,
        gpu_slow_in_background: bool = True,
    ) -> None:
        self.target = target
        self.clock = clock
        self.deadline_s = deadline_s
        self.host = socket.gethostname()
        self.runner = DeadlineRunner(clock)
        self.processes = ProcessesProbe(target, roots=roots, clock=clock)
        self.gpu = GpuProbe(nvml=nvml, clock=clock, slow_in_background=gpu_slow_in_background) if gpu else None
        reader = (None if target.log_reader_uid is None
                  else (target.log_reader_uid, frozenset(target.log_reader_gids)))
        self.log = LogProbe(target.log, target.progress_regex, clock=clock,
                            reader=reader) if target.log else None
        self.outputs = (OutputsProbe(target.outputs, clock=clock, use_inotify=use_inotify, roots=roots)
                        if target.outputs else None)
        self.server = ServerProbe(target.server, clock=clock) if target.server else None
        port = _local_port(target.server)
        self.server_processes = ServerProcessesProbe(port, roots, clock) if port else None
        # The server's own log: configured, or found next tick from its stdout/stderr.
        self.server_log = (ServerLogProbe(target.server_log, clock, reader=reader)
                           if target.server or target.server_log else None)
        self.kmsg = KmsgProbe(roots=roots, clock=clock, history=kernel_history)
        self._static_paths = [str(p) for p in (target.log and Path(target.log).parent,
                                               target.outputs) if p]
        # statvfs has its own deadline inside the probe, so a stuck mount is named in the result;
        # the outer deadline only catches the probe itself hanging.
        self.disks = DisksProbe(list(self._static_paths), roots=roots, clock=clock,
                                statvfs_deadline_s=min(2.0, deadline_s))
        self.also_got: Any = None  # the answer of the last tick's `also` call (None: not in time)
        # probe name -> (probe, value, final report) of the last tick, for reuse by identity
        self._last: dict[str, tuple[Probe, Any, ProbeReport]] = {}
        self._plan: list[_Planned] | None = None  # made by the first tick (_make_plan)
        self._disk_paths_memo: tuple[tuple, list[str]] | None = None  # (its key, the paths)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in PROBE_FIELDS:  # a probe added or replaced: the tick's list is made again
            object.__setattr__(self, "_plan", None)
        object.__setattr__(self, name, value)

    def note_exit(self, pid: int, start_ticks: int | None, returncode: int) -> None:
        """The supervisor reaped its child: the probe reports the real exit status."""
        self.processes.note_exit(pid, start_ticks, returncode)

    def probes(self) -> list[Probe]:
        """The probes this target has, in the snapshot's order: each is the attribute named
        after it (snapshot.PROBE_FIELDS is the one list of probes)."""
        return [p for name in PROBE_FIELDS if (p := getattr(self, name)) is not None]

    def _make_plan(self) -> list[_Planned]:
        """The probes but disks, in the snapshot's order, each with its snapshot field and its
        `unchanged` and `cannot_block` (or None): made once, again when a probe is replaced
        (__setattr__), not each tick (issue 17)."""
        plan = [(p, p.name, PROBE_FIELDS[p.name], getattr(p, "unchanged", None),
                 getattr(p, "cannot_block", None))
                 for p in self.probes() if p is not self.disks]
        names = {e[1] for e in plan}
        for gone in [n for n in self._last if n not in names]:
            del self._last[gone]
        object.__setattr__(self, "_plan", plan)
        return plan

    def tick(self, also: tuple[str, Callable[[], Any], float] | None = None) -> Snapshot:
        """One snapshot. `also`, a (name, function, deadline_s) call of the caller's (the pid
        file's re-check), runs last in the same batch, its answer left in `also_got`: its own
        handoff to a thread cost more than its work (issue 17)."""
        clock = self.clock
        t0 = clock.monotonic()
        plan = self._plan or self._make_plan()
        last = self._last
        procs: list[ProcessesObs] = []
        # Held until the processes probe's call ends: a bare lock is the cheapest thing to wait
        # on (an Event makes a Condition and a lock per tick).
        procs_ran = threading.Lock()
        procs_ran.acquire()
        procs_busy = self.runner.is_stuck(self.processes.name)  # its call will not be made

        def processes() -> ProcessesObs:
            try:
                procs.append(self.processes.collect())
            finally:
                procs_ran.release()
            return procs[-1]

        def disks():
            # The filesystems that matter are those the job works in and writes to, known once
            # the processes probe ran: before this, in the same lane. Handed out of a late lane,
            # this waits for it as long as its deadline, then goes on with the static paths
            # alone, as when the processes probe times out (or is still stuck: not in the batch).
            if not procs_busy and procs_ran.acquire(
                    timeout=max(0.0, t0 + self.deadline_s - self.clock.monotonic())):
                procs_ran.release()
            self.disks.paths = self._disk_paths(procs[0] if procs else None)
            return self.disks.collect()

        deadline_s, processes_probe = self.deadline_s, self.processes
        # Each probe's (value, final report) got without the lane, or None: in the batch (a
        # probe with neither hook always is).
        got: list[tuple[Any, ProbeReport] | None] = []
        batch: list[tuple[str, Callable[[], Any], float]] = []
        for e in plan:
            g = None if e[3] is None and e[4] is None else self._without_worker(e, last)
            got.append(g)
            if g is None:
                batch.append((e[1], processes if e[0] is processes_probe else e[0].collect,
                              deadline_s))
        # Its own statvfs deadline (and a second) after the processes probe's, as when it ran
        # after the others: a slow processes probe must not leave it no time.
        batch.append((self.disks.name, disks, deadline_s + self.disks.statvfs_deadline_s + 1.0))
        if also is not None:
            batch.append(also)
        ran = iter(self.runner.call_many(batch))
        # Unvalidated: every part is a model built by a probe or a float of the clock, and
        # validating them again cost more than the rest of the tick's own work (issue 17;
        # test_collector checks it equals a validated build).
        values: dict[str, Any] = {"t_mono": float(t0), "host": self.host, "target": self.target}
        ok = ProbeStatus.ok
        reports: list[ProbeReport] = []
        for e, g in zip(plan, got, strict=True):
            if g is None:
                value, report = next(ran)
                if getattr(value, "status", ok) is not ok:  # else report_for_observation's answer
                    report = report_for_observation(report, value)
            else:
                value, report = g
            last[e[1]] = (e[0], value, report)
            values[e[2]] = value
            reports.append(report)
        value, report = next(ran)
        if getattr(value, "status", ok) is not ok:
            report = report_for_observation(report, value)
        values["disks"] = value
        reports.append(report)
        self.also_got = next(ran)[0] if also is not None else None
        if self.server_log is not None:
            self._find_server_log(values.get("server_processes"))
        values["t_wall"] = float(clock.time())
        values["probes"] = tuple(reports)
        values["tick_duration_s"] = float(clock.monotonic() - t0)
        return made(Snapshot, _SNAPSHOT_DEFAULTS, values)

    def _without_worker(self, e: _Planned, last: dict[str, tuple[Probe, Any, ProbeReport]]
                        ) -> tuple[Any, ProbeReport] | None:
        """A probe's (value, report) got without the lane: the last ones again when the probe
        says nothing it reads can have changed (gpu without NVML and no retry due, kmsg with
        nothing waiting after a tick that read nothing), its collect()
        run here when it cannot block (kmsg on /dev/kmsg): handing a call to a thread costs
        more than its work (issue 17). None: the probe goes in the batch."""
        p, name, _, unchanged, cannot_block = e
        prev = last.get(name)
        if prev is not None and (prev[0] is not p or prev[1] is None):
            # The probe was replaced (a resumed kmsg cursor), or its last run failed or was late:
            # no observation of it to hand on.
            prev = None
        if prev is not None and unchanged is not None and unchanged():
            return prev[1], prev[2]
        if cannot_block is not None and cannot_block():
            return run_inline(name, p.collect, self.clock, prev and (prev[1], prev[2]))
        return None

    def _disk_paths(self, procs: ProcessesObs | None) -> list[str]:
        """_disk_paths of the static paths and `procs`, the last list again while each process's
        cwd and open files are those of last tick (the files' tuple is kept by identity while
        the fd table stands: then its comparison is one identity test, issue 17)."""
        key = tuple([(p.cwd, p.open_files) for p in procs.processes]) if procs else ()
        memo = self._disk_paths_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        paths = _disk_paths(self._static_paths, procs)
        self._disk_paths_memo = (key, paths)
        return paths

    def _find_server_log(self, sp: ProcessesObs | None) -> None:
        """No server_log configured: the listening process's stdout/stderr, when a file. And
        the schedulers' rank labels, which the log's crash lines name only by index."""
        if self.server_log is None or sp is None:
            return
        self.server_log.note_schedulers({p.pid: t.label for p in sp.processes
                                         if (t := parse_title(p.cmdline)) is not None and t.role == "scheduler"})
        if self.server_log.path is not None:
            return
        root = next((p for p in sp.processes if p.pid == self.server_processes.pid), None) \
            if self.server_processes is not None else None
        if root is None:
            return
        found = stdio_log(root.open_files, root.pid)
        if found is not None and root.uid is not None:
            # its groups are not observed: a file shared by group only is left unread (safe side)
            self.server_log.discover(found[0], found[1], root.uid)

    def close(self) -> None:
        for p in self.probes():
            close = getattr(p, "close", None)
            if close:
                close()


def _disk_paths(static: list[str], procs: ProcessesObs | None, limit: int = 16) -> list[str]:
    """Paths whose filesystem matters: the log and outputs, the job's cwd, files it writes."""
    paths = list(static)
    for p in procs.processes if procs else ():
        if p.cwd and p.cwd.startswith("/"):
            paths.append(p.cwd)
        for f in p.open_files:
            if f.write and f.path.startswith("/") and not f.path.startswith(("/dev/", "/proc/")):
                paths.append(os.path.dirname(f.path))
    seen: dict[str, None] = {}
    for path in paths:
        seen.setdefault(os.path.normpath(path), None)
    return list(seen)[:limit]


def _local_port(url: str | None) -> int | None:
    """The port of a server on this host; None for a remote one (its processes are not ours)."""
    if not url:
        return None
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None
    local = {"localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname()}
    return port if (u.hostname or "") in local or (u.hostname or "").startswith("127.") else None
