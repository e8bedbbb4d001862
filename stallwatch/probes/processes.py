"""The processes probe: the job's process tree, every thread's kernel state, and its exits.

Each collect() reads the stat (ppid, start time) of the job's tree — found through the kernel's
per-thread `children` lists, with a scan of every /proc/*/stat at the first look and for --match,
and a tenth of the host's stat files a collect (processes_tree.py) — resolves the targets, walks
their descendants, and reads per process and per thread what a stall diagnosis needs: state
letter, wait channel, syscall, kernel stack, context switches, CPU, I/O counters, open files and
TCP sockets. The probe keeps a little state between ticks so that rules can stay stateless: how
long each task has been in its state, in D, without a context switch, and without I/O.

A tick reads only what can have changed (issue 17): every thread's schedstat, kept open and
re-read with pread (kernel/procfiles.py); stat, wait channel, syscall, stack, status and sched
only for a thread that ran since its last look (processes_threads.py); children lists only for
threads that ran; thread lists when stat's count moves or a thread vanished (processes_tree.py).

Its parts: processes_obs.py (what it reports), processes_state.py (what it remembers between
ticks), processes_tree.py (which processes), processes_threads.py (each thread), and here the
collect, each process, its files and sockets, and exits.

A process is identified by (pid, start_ticks), never by pid alone: a pid that comes back with
another start time is a different process, and the job it stood for is reported as exited.
"""

from __future__ import annotations

import operator
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, TypeVar, cast
from collections.abc import Callable, Mapping, Sequence

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.kernel import procfs
from stallwatch.kernel.procfiles import ProcFiles, ProcPaths
from stallwatch.kernel.roots import DEFAULT_ROOTS, Absent, Denied, Roots
from stallwatch.kernel.schedclock import SchedClock, measure_lag_s
from stallwatch.probes import torchrun
from stallwatch.probes.processes_obs import (ExitObs, IoObs, OpenFileObs, ProcessesObs,
                                             ProcessObs, Role, SocketObs, ThreadObs, built)
from stallwatch.probes.processes_state import _Caps, _Exit, _Member, _ThreadMemo, _Tick, _Track
from stallwatch.probes.processes_threads import STAT_EVERY_TICKS, ThreadReader
from stallwatch.probes.processes_tree import TreeWalk
from stallwatch.probes.runqueue import RunQueueTracker

__all__ = ["ExitObs", "IoObs", "OpenFileObs", "ProcessObs", "ProcessesObs", "ProcessesProbe",
           "SocketObs", "TargetSpec", "ThreadObs"]

T = TypeVar("T")
# procfs.Io is a named tuple of IoObs's fields, in its order: an IoObs is built from it in C.
_IO_FIELDS = tuple(IoObs.model_fields)
assert procfs.Io._fields == _IO_FIELDS
# Socket inodes remembered per network namespace as unix or TCP (ProcessesProbe._tcp): past this
# many the set starts over, so a job that opens and closes sockets all day costs bounded memory.
_MAX_SOCKETS_REMEMBERED = 4096


@dataclass(slots=True)
class _FdTable:
    """A process's fd table and cwd as read on a tick when every thread's schedstat was read
    before them (the tree walk's batch), reused while it can not have changed in a way that
    shows: see ProcessesProbe._fd_table."""

    fds: dict[int, str] | None  # None: unreadable (such a table is not kept)
    count: int  # fds listed: /proc/PID/fd's st_size is the same while none opens or closes
    cwd: str | None
    denied: frozenset[str]  # signals those reads were refused, reported again with them
    # No thread of it ran since it was read (True when read): a table reused while they ran is
    # read again on the first tick they all sleep, so a stall's evidence is exact.
    exact: bool = True
    # What _files made of it, computed once per table: its sockets (inode -> fd), the fds it
    # shows with their fdinfo path (None: not a regular file), and whether some were left out.
    inodes: dict[int, int] | None = None
    shown: tuple[tuple[int, str, str | None], ...] = ()
    truncated: bool = False
    # The fdinfo readings _files last used (one per shown fd), their inode numbers, and the
    # files built from them; (fd, path) -> (its fdinfo reading, its OpenFileObs): an fd whose
    # reading is the same object as last tick's (_kept_parsed) keeps its record.
    infos: tuple[object, ...] = ()
    inos: tuple[int | None, ...] = ()
    files: tuple[OpenFileObs, ...] = ()
    built: dict[tuple[int, str], tuple[object, OpenFileObs]] = field(default_factory=dict)
    infos_tick: int = -1  # infos were read this tick by _fd_table's check: _files uses them
    net_ns: str | None = None  # ns/net's readlink, once read (_tcp): only a thread changes it


class TargetSpec(Protocol):
    """What the probe needs of stallwatch.probes.targets.Target (read only: a frozen model fits)."""

    @property
    def pids(self) -> Sequence[int]: ...

    @property
    def match(self) -> str | None: ...


# ---------------------------------------------------------------------------------------- probe


class ProcessesProbe(TreeWalk, ThreadReader):
    name = "processes"

    def __init__(
        self,
        targets: TargetSpec,
        roots: Roots = DEFAULT_ROOTS,
        clock: Clock = SYSTEM_CLOCK,
        max_open_files: int = 64,
        read_stacks: bool = True,
        *,
        max_threads: int = 512,
        max_fds_scanned: int = 1024,
        known_starts: Mapping[int, int] | None = None,
        known_names: Mapping[int, str] | None = None,
        self_pid: int | None = None,
        clk_tck: int | None = None,
        syscall_table: Mapping[int, str] | None = None,
        exit_memory_s: float = 600.0,
        max_exits: int = 64,
        max_processes: int = 1024,
        max_job_threads: int = 8192,
        budget_s: float | None = None,
        match_uid: int | None = None,
        sched_lag_s: Callable[[int], float | None] | None = None,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        """known_starts pins explicit pids to a start time (a re-attaching daemon knows it), so a
        reused pid is never adopted; known_names is what the caller last knew them by, reported
        when one is gone before a tick saw it (else a crash reads "crash:  (pid N)"). self_pid is
        excluded from --match, with its ancestors (the shell that runs us has the pattern in its
        command line too); it defaults to our own pid when reading the real /proc."""
        self.roots, self.clock = roots, clock
        # Paths are built as strings: this probe opens thousands of /proc files a tick and
        # pathlib's joins cost more than the reads (bench/: docs/performance.md).
        self._paths = ProcPaths(roots)
        self._stat_cache: dict[str, tuple[str, procfs.Stat]] = {}
        # A process's files read every tick, with their parse (_kept_parsed): this tick's, and
        # the last tick's to compare with.
        self._parsed: dict[str, tuple[bytes, object]] = {}
        self._parsed_before: dict[str, tuple[bytes, object]] = {}
        # The same for a thread's files read when it ran (_kept_optional): a thread that wakes
        # every tick to sleep in the same place renders the same wait channel, syscall and
        # stack each time, and is not parsed again. Only this tick's and the last tick's.
        self._ran_parsed: dict[str, tuple[bytes, object]] = {}
        self._ran_parsed_before: dict[str, tuple[bytes, object]] = {}
        self._children_ok: bool | None = None  # the kernel has /proc/PID/task/TID/children
        self._full_scan_mono: float | None = None
        self.max_open_files, self.read_stacks = max_open_files, read_stacks
        self.max_threads, self.max_fds_scanned = max_threads, max_fds_scanned
        self.exit_memory_s, self.max_exits = exit_memory_s, max_exits
        # Bounds on one job's tree, so that a user who forks thousands of tasks slows only the
        # watch of their own job: see _Caps.
        self.caps = _Caps(max_processes, max_job_threads, budget_s)
        # budget_s is CPU seconds of the thread that collects, not wall time: on a loaded host a
        # narrow tree's reads wait for a CPU, and a wall-time budget cut a torchrun job's ranks
        # out of ticks it did not make wide (the demo's torchrun hang at load 20: 7 of 98 ticks).
        # A read that blocks costs no CPU: the runner's wall-time deadline bounds that.
        self._cpu_clock = cpu_clock
        self._wide = False  # the last tick hit a cap: scan /proc, not the per-thread lists
        # --match adopts only processes of this real uid when set: another user's decoy that
        # matches the pattern must not stand in for the job (issue 22 #10).
        self.match_uid = match_uid
        self._explicit = tuple(dict.fromkeys(int(p) for p in targets.pids))
        self._match = re.compile(targets.match) if targets.match else None
        if self_pid is None and self._paths.is_host():
            self_pid = os.getpid()
        self._self_pid = self_pid
        self._tck = clk_tck or os.sysconf("SC_CLK_TCK")
        self._runq = RunQueueTracker(self._tck)
        self._syscalls = procfs.SYSCALLS if syscall_table is None else syscall_table
        # Turns a thread's se.exec_start into uptime seconds (kernel/schedclock): each CPU's lag is
        # measured on the host; a fixture tree keeps its clocks unless given the lags it stands for
        # (sched_lag_s: CPU -> seconds its scheduler clock is behind /proc/uptime, None unknown).
        lag = sched_lag_s if sched_lag_s is not None else (
            measure_lag_s if self._paths.is_host() else None)
        self._sched_clock = None if lag is None else SchedClock(clock.monotonic, measure=lag)
        # Unix socket inodes, by network namespace: ns -> inodes. A socket's inode names one
        # socket for its life (sockfs numbers them from a global counter), so a unix socket never
        # becomes TCP, and a process holding only unix sockets needs no TCP table read. That read
        # is the dearest of the tick where /proc is emulated: 2.8 ms for each of net/tcp and
        # net/tcp6 on the lent H200 (gVisor) against 0.016 ms for net/unix and 0.005 ms for a
        # thread's stat, and every CUDA process holds a unix socket. Known only by finding it in
        # net/unix: "absent from the TCP tables" would not do, since a TCP socket is listed there
        # only once bound or connected, and one read between socket() and connect() would hide
        # it for good.
        self._unix: dict[str, set[int]] = {}
        self._tcp_seen: dict[str, set[int]] = {}  # ns -> inodes once found in a TCP table
        self._btime: int | None = None
        self._first_collect = True
        self._collects = 0
        self._tick_tracks = 0  # tracks stamped this collect (see _forget)
        self._job: dict[int, int] = dict(known_starts or {})  # pid -> start of target identities
        self._missing: set[int] = set()
        # Pinned identities start as members, so the first tick reports them exited if gone.
        self._names = {int(p): n for p, n in (known_names or {}).items() if n}
        self._members: dict[tuple[int, int], _Member] = {
            (pid, start): _Member(role="target", comm=self._names.get(pid))
            for pid, start in self._job.items()}
        self._tracks: dict[tuple[str, int, int], _Track] = {}
        # What lets a tick read only what can have changed (docs/performance.md, "Reading only
        # what changed"): each thread's last reading, each process's thread list, and each
        # thread's children list with the schedstat it was read under.
        self._memos: dict[tuple[int, int], _ThreadMemo] = {}
        self._tid_lists: dict[tuple[int, int], list[int]] = {}
        # (pid, start) -> (its thread list, their memos in that order): see TreeWalk._rows_of.
        self._rows: dict[tuple[int, int], tuple[list[int], list[_ThreadMemo]]] = {}
        self._schedstat_ok: bool | None = None
        # Kept descriptors only on the real procfs (its root is inode 1, PROC_ROOT_INO): a
        # fixture tree's files are replaced on disk, and a kept descriptor would read the old.
        self._kept = ProcFiles(roots, None if self._paths.is_procfs() else 0,
                               keep=2 * STAT_EVERY_TICKS)
        self._cmdlines: dict[tuple[int, int, str], tuple[str, ...]] = {}
        self._tables: dict[tuple[int, int], _FdTable] = {}  # (pid, start) -> see _fd_table
        self._fd_counts_ok: bool | None = None
        self._live_before: set[tuple[int, int]] = set()  # identities at the last _forget
        self._ranks: dict[tuple[int, int], torchrun.RankInfo | None] = {}
        self._launchers: dict[tuple[str, tuple[str, ...]], bool] = {}  # (comm, argv) -> agent?
        self._exits: list[_Exit] = []
        self._noted: dict[tuple[int, int | None], int] = {}
        self._lock = threading.Lock()  # note_exit comes from the supervisor's thread

    # ------------------------------------------------------------------------------ public API

    def note_exit(self, pid: int, start_ticks: int | None, returncode: int) -> None:
        """The supervisor reaped its child: record the status waitpid gave (negative = signal)."""
        with self._lock:
            for ex in reversed(self._exits):
                if ex.pid == pid and start_ticks in (None, ex.start_ticks):
                    ex.returncode, ex.source = returncode, "waitpid"
                    return
            self._noted[(pid, start_ticks)] = returncode
            known = [k for k in self._members if k[0] == pid and start_ticks in (None, k[1])]
            if not known:
                # It exited before any tick saw it: report it now rather than never.
                now, wall = self.clock.monotonic(), self.clock.time()
                self._exits.append(_Exit(
                    pid=pid, start_ticks=start_ticks, noticed_mono=now, noticed_wall=wall,
                    role="target" if pid in self._explicit or pid in self._job else "descendant",
                    returncode=returncode, source="waitpid", comm=self._names.get(pid),
                    start_time=self._start_time(start_ticks) if start_ticks is not None else None,
                ))

    def collect(self) -> ProcessesObs:
        # float: every duration below is one, and ProcessObs is built unvalidated (built)
        tick = _Tick(now=float(self.clock.monotonic()), number=self._collects)
        self._parsed_before, self._parsed = self._parsed, {}
        self._ran_parsed_before, self._ran_parsed = self._ran_parsed, {}
        self._collects, self._tick_tracks = self._collects + 1, 0
        stats = self._scan(tick)
        targets = self._resolve(stats)
        # Members stay in the tree while they live, even when reparented away from the job.
        alive = [k for k in self._members if k[0] in stats and stats[k[0]].start_ticks == k[1]]
        seeds = targets + alive
        tree = self._tree(seeds, stats, exclude=self._self_pid)

        observed, members = [], {}
        budget = self.caps.start(self._cpu_clock())
        for pid in tree:
            st = stats[pid]
            key = (pid, st.start_ticks)
            role: Role = "target" if self._job.get(pid) == st.start_ticks else "descendant"
            threads = budget.admit(st.num_threads, self.max_threads, self._cpu_clock(),
                                   role == "target")
            if threads == 0:
                # Beyond the caps: what the stat line says is all this tick learns of it, and
                # enough to see it exit.
                members[key] = _Member(role=role, comm=st.comm, state=st.state,
                                       cmdline=self._cached_cmdline(pid, st),
                                       start_time=self._start_time(st.start_ticks))
                continue
            obs = self._process(st, role, tick, threads)
            budget.used(len(obs.threads) if obs is not None else 0)
            if obs is not None:
                observed.append(obs)
                members[key] = _Member(role=role, comm=obs.comm, cmdline=obs.cmdline,
                                       start_time=obs.start_time, state=obs.state,
                                       returncode=obs.exit_code)
            else:
                # It died while we read it: keep it so the next tick reports the exit.
                members[key] = self._members.get(key) or _Member(role=role, comm=st.comm)
        self._wide = bool(budget.reason) and not budget.timed_out  # past a size cap
        observed = self._torchrun(observed)
        self._notice_exits(members, tick.now)
        self._members = members
        self._forget(stats, tick)
        self._kept.sweep()
        self._first_collect = False

        live = {k[0] for k in members}
        return built(ProcessesObs, dict(  # unvalidated, as ProcessObs: our own typed values
            targets=tuple([p for p, s in targets if p in live]),
            processes=tuple(observed),
            exited=self._exit_obs(tick.now),
            missing=tuple(sorted(self._missing)),
            reused=tuple([p for p in self._explicit if p in self._job and p in stats
                          and stats[p].start_ticks != self._job[p]]),
            zombies=tuple([o.pid for o in observed if o.state == "Z"]),
            denied=tuple(sorted(tick.denied)),
            truncated=budget.reason, tree_processes=len(tree),
            watched_processes=len(observed), watched_threads=budget.threads,
        ))

    def _torchrun(self, observed: list[ProcessObs]) -> list[ProcessObs]:
        """Mark torchrun agents and read their workers' ranks: a worker's environment only when
        it has the agent's uid (the job's user could read it too), once per identity."""
        known = self._launchers
        launchers = {}
        for o in observed:
            # Once per command (argv is read once per identity): basename of each word a tick
            # for every process was most of this step.
            it = known.get((o.comm, o.argv))
            if it is None:
                if len(known) > _MAX_SOCKETS_REMEMBERED:
                    known.clear()
                it = known[(o.comm, o.argv)] = torchrun.is_launcher(o.comm, o.argv)
            if it:
                launchers[o.pid] = o.uid
        if not launchers:
            return observed
        out = []
        for o in observed:
            if o.pid in launchers:
                o = o.model_copy(update={"launcher": True})
            elif o.ppid in launchers and o.uid is not None and o.uid == launchers[o.ppid]:
                key = (o.pid, o.start_ticks)
                if key not in self._ranks:
                    self._ranks[key] = torchrun.read_rank(self.roots, o.pid)
                if self._ranks[key] is not None:
                    o = o.model_copy(update={"rank": self._ranks[key]})
            out.append(o)
        return out

    # ------------------------------------------------------------------------------ processes

    def _start_time(self, start_ticks: int) -> float:
        if self._btime is None:
            self._btime = procfs.parse_btime(self.roots.read_text(self._paths.host("stat")))
        return self._btime + start_ticks / self._tck

    def _optional(self, path: str | Path, parse: Callable[[str], T], signal: str,
                  denied: set[str]) -> T | None:
        """A read whose failure is a value: Absent (task gone, feature missing) or Denied (the
        signal's name goes into `denied`)."""
        try:
            return parse(self.roots.read_text(path))
        except Absent:
            return None
        except Denied:
            denied.add(signal)
            return None

    def _kept_optional(self, path: str, parse: Callable[[str], T], signal: str,
                       denied: set[str]) -> T | None:
        """_optional for a task's small single-show files read again on later ticks (a thread's
        wchan, syscall, stack, sched and status, when it ran): kept open and re-read with one
        pread instead of open, read, read, close (kernel/procfiles.py; a kept descriptor is bound
        to its task, so a reused tid never reads another's). They may fill half the kept budget
        only (ProcFiles.read's share); _forget_memo closes them with the thread's memo. Bytes
        the same as at the last tick are not parsed again (_ran_parsed)."""
        try:
            raw = self._kept.read_task_file(path)
        except Absent:
            return None
        except Denied:
            denied.add(signal)
            return None
        hit = self._ran_parsed_before.get(path)
        # a path is always parsed by the same parser: its cached value is a T
        value = cast(T, hit[1]) if hit is not None and hit[0] == raw else parse(raw.decode("utf-8", "replace"))
        self._ran_parsed[path] = (raw, value)
        return value

    def _kept_parsed(self, path: str, parse: Callable[[str], T], signal: str,
                     denied: set[str]) -> T | None:
        """_optional for a process's own small files read every tick (stat, status, io, a
        regular file's fdinfo): kept open and re-read with pread, and parsed again only when their
        bytes changed, which for a sleeping process they mostly do not (a wide job's ranks: 9
        status and io parses a tick were 0.8 ms). Those not read in a tick are closed (_forget)."""
        try:
            raw = self._kept.read(path, 0.5)  # a wide job's stat and schedstat come first
        except Absent:
            return None
        except Denied:
            denied.add(signal)
            return None
        hit = self._parsed_before.get(path)
        # a path is always parsed by the same parser: its cached value is a T
        value = cast(T, hit[1]) if hit is not None and hit[0] == raw else parse(raw.decode("utf-8", "replace"))
        self._parsed[path] = (raw, value)
        return value

    def _track(self, key: tuple[str, int, int], now: float, state: str, ctx: int,
               cpu: int) -> tuple[_Track, float, int | None]:
        """The task's memory, seconds since its last tick, CPU ticks since (None: first sight)."""
        self._tick_tracks += 1
        tr = self._tracks.get(key)
        if tr is None:
            self._tracks[key] = _Track(now, now, state, now, ctx, now, cpu)
            return self._tracks[key], 0.0, None
        interval, cpu_delta = tr.step(now, state, ctx, cpu)
        return tr, interval, cpu_delta

    def _process(self, st: procfs.Stat, role: Role, tick: _Tick,
                 max_threads: int | None = None) -> ProcessObs | None:
        pid, now, d = st.pid, tick.now, self._pd(st.pid)
        limit = self.max_threads if max_threads is None else max_threads
        tids, listed = tick.tids.get(pid), pid in tick.tids
        if tids is None:
            tids = self._cached_tids(st)
        try:
            if tids is None:
                tids, listed = self._list_tids(st), True
            rows = tick.rows.get(pid)
            table = self._fd_table(st, rows, limit, tick)
            fds = table.fds
            if rows is not None:  # the tree walk read every thread's schedstat: in a batch
                threads = self._thread_rows(pid, rows[:limit] if len(rows) > limit else rows,
                                            fds, tick)
            else:
                threads, thread = [], self._thread
                for tid in tids[:limit]:
                    t = thread(pid, tid, fds, tick)
                    if t is not None:
                        threads.append(t)
            if not listed and len(threads) < min(len(tids), limit):
                # A remembered thread is gone: the list changed under an unchanged count.
                tids = self._list_tids(st)
                done = {t.tid for t in threads}
                threads += [t for t in (self._thread(pid, tid, fds, tick)
                                        for tid in tids[:limit] if tid not in done)
                            if t is not None]
                threads.sort(key=lambda t: t.tid)
        except (Absent, Denied):
            return None
        if not threads:
            return None
        leader = next((t for t in threads if t.tid == pid), None)
        status = tick.leader_status.get(pid) or self._kept_parsed(
            f"{d}/status", procfs.parse_status, "status", tick.denied)
        io = self._kept_parsed(f"{d}/io", procfs.parse_io, "io", tick.denied)
        cwd = table.cwd

        ctx_v = ctx_n = 0
        d_max, ran = 0.0, None  # the longest in D; the most recent run (last_ran_age_s)
        for t in threads:  # one pass: a wide job's processes have hundreds
            ctx_v += t.voluntary_ctxt_switches
            ctx_n += t.nonvoluntary_ctxt_switches
            if t.d_state_for_s > d_max:
                d_max = t.d_state_for_s
            if t.last_ran_age_s is not None and (ran is None or t.last_ran_age_s < ran):
                ran = t.last_ran_age_s
        cpu_ticks = st.utime_ticks + st.stime_ticks
        tr, interval, cpu_delta = self._track(("p", pid, st.start_ticks), now, st.state,
                                              ctx_v + ctx_n, cpu_ticks)
        io_unchanged = None
        if io is not None:
            if tr.io_total != io.total:
                tr.io_total, tr.io_mono = io.total, now
            io_unchanged = now - tr.io_mono
        cpu_delta_s = None if cpu_delta is None else cpu_delta / self._tck
        argv = self._argv(pid, st)
        exit_code = None
        if st.state == "Z" and st.exit_code is not None and io is not None:
            # The kernel shows exit_code only to those who may ptrace the task, else 0; a
            # readable io file is that same permission, so 0 here is a real exit status.
            exit_code = procfs.decode_wait_status(st.exit_code)
        files, truncated, sockets = self._files(pid, fds, tick, table)
        return built(ProcessObs, dict(
            pid=pid, ppid=st.ppid, pgid=st.pgid, sid=st.sid,
            uid=status.uid if status else None, role=role,
            start_ticks=st.start_ticks, start_time=self._start_time(st.start_ticks),
            comm=st.comm, argv=argv, cmdline=" ".join(argv), cwd=cwd,
            state=st.state, state_since_s=now - tr.state_mono,
            d_state_for_s=d_max,
            ctx_unchanged_for_s=now - tr.ctx_mono, last_ran_age_s=ran,
            tracked_for_s=now - tr.first_mono,
            wchan=leader.wchan if leader else None,
            voluntary_ctxt_switches=ctx_v, nonvoluntary_ctxt_switches=ctx_n,
            utime_s=st.utime_ticks / self._tck, stime_s=st.stime_ticks / self._tck,
            cpu_delta_s=cpu_delta_s,
            cpu_util=cpu_delta_s / interval if cpu_delta_s is not None and interval > 0 else None,
            blkio_delay_s=(None if st.blkio_delay_ticks is None
                           else st.blkio_delay_ticks / self._tck),
            rss_bytes=status.rss_bytes if status else None, num_threads=st.num_threads,
            io=built(IoObs, dict(zip(_IO_FIELDS, io, strict=True))) if io else None,
            io_unchanged_for_s=io_unchanged,
            num_fds=None if fds is None else len(fds),
            open_files=files, open_files_truncated=truncated, tcp=sockets, exit_code=exit_code,
            threads=tuple(threads), threads_truncated=len(tids) > limit,
            launcher=False, rank=None,
        ))

    # -------------------------------------------------------------------------- files, sockets

    def _link(self, path: str | Path, signal: str, denied: set[str]) -> str | None:
        try:
            return self.roots.readlink(path)
        except Absent:
            return None
        except Denied:
            denied.add(signal)
            return None

    def _fd_table(self, st: procfs.Stat, rows: list[_ThreadMemo] | None, limit: int,
                  tick: _Tick) -> _FdTable:
        """The process's fd table and cwd: read afresh, or an earlier tick's.

        Only a task sharing the table can open, close or dup an fd in it, and to do so it
        must run: for the process's own threads (io_uring's workers among them), their
        schedstat moves. So when the tree walk read every thread's schedstat this tick
        (`rows`) and none moved since the read that preceded the table's, the table is the
        same: no listing, no readlink of each fd, no cwd readlink.

        When some ran (every tick, on a busy job) the table is reused too while what shows
        of it stands: the count of open fds (/proc/PID/fd's size, Linux >= 6.2) is the same,
        and each regular file it shows is still the same file (fdinfo's inode number, read
        here for _files); it is then no longer `exact`, and is read afresh on the first tick
        none of its threads ran, so the evidence of a stall (the half-written file a sleeping
        or D thread holds, a blocked thread's fd) is exact. What this leaves unseen while the
        threads run is an fd opened again as another non-regular file (a pipe, a socket) in
        the same tick as one closes: the table's turn, below, bounds it.

        Read afresh in any case one tick in STAT_EVERY_TICKS (in turn, by pid), which bounds
        what no thread of it does: a file renamed by another process (a readlink shows the new
        path), a process sharing the table without being a thread (clone CLONE_FILES); the
        count, checked every tick, shows at once what such a sharer opens or closes. A table
        read without `rows` (the first look, a thread list that changed) is not kept: its
        threads' schedstat was read after it."""
        pid, key = st.pid, (st.pid, st.start_ticks)
        fd_dir = self._paths.pid(pid, "fd")
        table = self._tables.get(key)
        if table is not None and rows is not None and len(rows) <= limit \
                and (pid + tick.number) % STAT_EVERY_TICKS:
            ran = False
            for m in rows:  # before _thread_rows, which moves a thread that ran to this reading
                if m.sched_raw is None or m.sched_now != m.sched_raw:
                    ran = True
                    break
            counts = self._fd_counts()
            if ran and counts:
                try:
                    if os.stat(fd_dir).st_size == table.count and self._same_files(
                            pid, table, tick):
                        table.exact = False
                        tick.denied.update(table.denied)
                        return table
                except OSError:
                    pass  # gone, or hidden: read below, which says which
            elif not ran and table.exact:
                try:
                    if not counts or os.stat(fd_dir).st_size == table.count:
                        tick.denied.update(table.denied)
                        return table
                except OSError:
                    pass
        denied: set[str] = set()
        fds = self._fds(pid, denied)
        cwd = self._link(f"{self._pd(pid)}/cwd", "cwd", denied)
        tick.denied |= denied
        new = _FdTable(fds, len(fds) if fds is not None else 0, cwd, frozenset(denied))
        if table is not None:  # the records of the fds still open on the same files carry over
            new.built, new.net_ns = table.built, table.net_ns
        if fds is not None and rows is not None:
            self._tables[key] = new
        else:
            self._tables.pop(key, None)
        return new

    def _same_files(self, pid: int, table: _FdTable, tick: _Tick) -> bool:
        """Whether each regular file the table shows is still open on the same file: its
        fdinfo read (for _files, this tick) names the inode it had."""
        if table.inodes is None:
            return False
        infos = self._fdinfos(pid, table.shown, tick)
        for info, ino in zip(infos, table.inos, strict=True):
            if info is not None and cast("tuple[int, int, int]", info)[2] != ino:
                return False
            if info is None and ino is not None:
                return False  # closed (or refused): read the table again
        table.infos_tick, table.infos = tick.number, infos
        return True

    def _fdinfos(self, pid: int, shown: tuple[tuple[int, str, str | None], ...],
                 tick: _Tick) -> tuple[object, ...]:
        """The fdinfo of each shown regular file, kept like status and io, and released with
        them when the process leaves; None for the others."""
        kept, denied, parse = self._kept_parsed, tick.denied, procfs.parse_fdinfo_ino
        return tuple([None if path is None else kept(path, parse, "fdinfo", denied)
                      for _, _, path in shown])

    def _fd_counts(self) -> bool:
        """Whether this procfs gives a process's count of open fds as its fd directory's size
        (Linux >= 6.2); read on our own, which always has some open."""
        if self._fd_counts_ok is None:
            try:
                self._fd_counts_ok = os.stat(self._paths.pid(os.getpid(), "fd")).st_size > 0
            except OSError:
                self._fd_counts_ok = False
        return self._fd_counts_ok

    def _fds(self, pid: int, denied: set[str]) -> dict[int, str] | None:
        """fd -> readlink target, for at most max_fds_scanned fds; None when unreadable."""
        fd_dir = self._paths.pid(pid, "fd")
        links = {}
        try:
            names = sorted(int(n) for n in self.roots.listdir(fd_dir) if n.isdigit())
            for fd in names[:self.max_fds_scanned]:
                try:
                    links[fd] = self.roots.readlink(f"{fd_dir}/{fd}")
                except Absent:
                    continue  # closed since the listing
        except Absent:
            return None
        except Denied:
            # Listing can be allowed while every readlink is refused: report no table at all
            # rather than an empty one that reads as "no open files".
            denied.add("fd")
            return None
        return links

    def _files(self, pid: int, fds: dict[int, str] | None, tick: _Tick, table: _FdTable):
        """Open files (regular files first, with their fdinfo's position and mode) and TCP
        sockets. The fdinfo of each regular file is read every tick, even for an unchanged
        table: a file description shared with another process (a log inherited across fork)
        moves when that one writes. A file whose fdinfo reads as last tick (the same parse, by
        identity: _kept_parsed) keeps last tick's record; when all do, the table's files are
        reused whole."""
        if not fds:
            return (), False, ()
        if table.inodes is None:
            self._shown(pid, fds, table)
        inodes = cast("dict[int, int]", table.inodes)
        sockets = self._tcp(pid, inodes, tick, table) if inodes else ()
        if table.infos_tick == tick.number:
            infos = table.infos  # read by _same_files this tick
        else:
            infos = self._fdinfos(pid, table.shown, tick)
        if table.files and _same_objects(infos, table.infos):
            return table.files, table.truncated, sockets
        old, new, files = table.built, {}, []
        for (fd, path, _), info in zip(table.shown, infos, strict=True):
            hit = old.get((fd, path))
            if hit is not None and hit[0] is info:
                obs = hit[1]
            else:
                write = pos = None
                if info is not None:
                    pos, flags, _ = cast("tuple[int | None, int | None, int | None]", info)
                    write = procfs.opened_for_write(flags) if flags is not None else None
                obs = built(OpenFileObs, {"fd": fd, "path": path, "write": write,
                                          "pos_bytes": pos})
            new[(fd, path)] = (info, obs)
            files.append(obs)
        table.infos, table.files, table.built = infos, tuple(files), new
        table.inos = tuple(None if i is None else cast("tuple[int, int, int]", i)[2]
                           for i in infos)
        return table.files, table.truncated, sockets

    def _shown(self, pid: int, fds: dict[int, str], table: _FdTable) -> None:
        """What of a table _files shows, once per table: its sockets, and the fds listed with
        their fdinfo's path (regular files only)."""
        inodes = procfs.socket_inodes(fds)
        sock_fds = set(inodes.values())
        others = [(fd, p) for fd, p in fds.items() if fd not in sock_fds]
        # Regular files first: a checkpoint being written matters more than the 40 fds every
        # CUDA process holds on /dev/nvidia*, and the cap must not push it out.
        others.sort(key=lambda fp: (not fp[1].startswith("/") or fp[1].startswith("/dev/"), fp[0]))
        table.shown = tuple(
            (fd, path, self._paths.pid(pid, f"fdinfo/{fd}")
             if path.startswith("/") and not path.startswith("/dev/") else None)
            for fd, path in others[:self.max_open_files])
        table.inodes, table.truncated = inodes, len(others) > self.max_open_files

    def _tcp(self, pid: int, inodes: dict[int, int], tick: _Tick,
             table: _FdTable | None = None) -> tuple[SocketObs, ...]:
        # Socket tables belong to a network namespace: read the target's own view, once per
        # namespace per tick.
        ns = table.net_ns if table is not None else None
        if ns is None:
            ns = self._link(self._paths.pid(pid, "ns/net"), "ns", tick.denied)
            if table is not None:  # kept when read: a refusal is read (and reported) again
                table.net_ns = ns
            ns = ns or f"pid:{pid}"
        unix, tcp = self._unix.setdefault(ns, set()), self._tcp_seen.setdefault(ns, set())
        if any(i not in unix and i not in tcp for i in inodes):
            found = tick.unix.get(ns)
            if found is None:  # once per namespace per tick, as the TCP tables below
                found = tick.unix[ns] = self._optional(
                    self._paths.pid(pid, "net/unix"), procfs.parse_net_unix_inodes, "net",
                    tick.denied) or frozenset()
            if len(unix) > _MAX_SOCKETS_REMEMBERED:  # a job that churns sockets starts over
                unix.clear()
            unix.update(i for i in inodes if i in found)
        if unix.issuperset(inodes):
            return ()
        lines = tick.net.get(ns)
        if lines is None:  # inode -> line: only the job's own sockets' lines are parsed
            lines = {}
            for name in ("tcp", "tcp6"):
                lines.update(self._optional(self._paths.pid(pid, f"net/{name}"),
                                            procfs.net_tcp_lines, "net", tick.denied) or ())
            tick.net[ns] = lines
        if len(tcp) > _MAX_SOCKETS_REMEMBERED:
            tcp.clear()
        tcp.update(i for i in inodes if i in lines)
        return tuple(
            built(SocketObs, dict(
                fd=fd, local_addr=s.local_addr, local_port=s.local_port,
                remote_addr=s.remote_addr, remote_port=s.remote_port, state=s.state,
                tx_queue_bytes=s.tx_queue_bytes, rx_queue_bytes=s.rx_queue_bytes))
            for inode, fd in sorted(inodes.items(), key=lambda kv: kv[1])
            if (line := lines.get(inode)) is not None and (s := procfs.parse_tcp_line(line))
        )

    # ---------------------------------------------------------------------------------- exits

    def _notice_exits(self, members: dict[tuple[int, int], _Member], now: float) -> None:
        if members.keys() >= self._members.keys():
            return  # none left the tree (a set comparison in C, every tick)
        wall = self.clock.time()
        with self._lock:
            for (pid, start), m in self._members.items():
                if (pid, start) in members:
                    continue
                rc = self._noted.pop((pid, start), None)
                if rc is None:
                    rc = self._noted.pop((pid, None), None)
                source: Literal["waitpid", "zombie"] | None = (
                    "waitpid" if rc is not None else "zombie" if m.returncode is not None else None)
                self._exits.append(_Exit(
                    pid=pid, start_ticks=start, role=m.role, noticed_mono=now, noticed_wall=wall,
                    comm=m.comm, cmdline=m.cmdline, start_time=m.start_time, last_state=m.state,
                    returncode=rc if rc is not None else m.returncode, source=source,
                ))

    def _exit_obs(self, now: float) -> tuple[ExitObs, ...]:
        if not self._exits:  # read without the lock: note_exit only appends
            return ()
        with self._lock:
            # Target exits stay (a crash verdict must not fade); descendants' only for a while,
            # since data-loader workers come and go by the hundred.
            keep = [e for e in self._exits
                    if e.role == "target" or now - e.noticed_mono <= self.exit_memory_s]
            while len(keep) > self.max_exits:
                victim = next((e for e in keep if e.role != "target"), keep[0])
                keep.remove(victim)
            self._exits = keep
            return tuple(
                built(ExitObs, dict(
                    pid=e.pid, start_ticks=e.start_ticks, start_time=e.start_time, role=e.role,
                    comm=e.comm, cmdline=e.cmdline, last_state=e.last_state,
                    returncode=e.returncode, returncode_source=e.source,
                    noticed_at=float(e.noticed_wall), exited_for_s=float(now - e.noticed_mono)))
                for e in keep
            )

    def _forget(self, stats: dict[int, procfs.Stat], tick: _Tick) -> None:
        """Drop memory of tasks that are gone, so a long run does not grow without bound."""
        live = {(p, s.start_ticks) for p, s in stats.items()}
        # Explicit pids keep their identity after death: that is how a reuse is recognised.
        if any(p not in self._explicit and (p, s) not in live for p, s in self._job.items()):
            self._job = {p: s for p, s in self._job.items() if p in self._explicit or (p, s) in live}
        # Rebuilt only when some are stale: on a wide idle job nothing ends, and rebuilding
        # three dicts of a thousand entries a tick was a tenth of the probe's cost.
        # (Nothing is stamped twice in a tick: the counts equal the sizes only when all are.)
        now = tick.now
        for path in self._parsed_before.keys() - self._parsed.keys():
            self._kept.release(path)  # a process that left: its kept files go with it
        if len(self._tracks) != self._tick_tracks:
            self._tracks = {k: v for k, v in self._tracks.items() if v.seen_mono == now}
        if len(self._memos) != tick.memos_seen:
            memos: dict[tuple[int, int], _ThreadMemo] = {}
            for k, m in self._memos.items():
                if m.seen_mono == now:
                    memos[k] = m
                else:  # ended, or no longer examined: its kept descriptors go with it
                    self._forget_memo(m)
            self._memos = memos
            self._rows = {}  # some held a memo just forgotten: rebuilt from those left
        # What is kept by identity goes stale only when an identity leaves: every entry made
        # this tick is for one in `live`, so while it is last tick's set there is nothing to drop.
        if live != self._live_before:
            self._live_before = live
            self._tid_lists = {k: v for k, v in self._tid_lists.items() if k in live}
            self._rows = {k: v for k, v in self._rows.items() if k in live}
            self._cmdlines = {k: v for k, v in self._cmdlines.items() if (k[0], k[1]) in live}
            self._tables = {k: v for k, v in self._tables.items() if k in live}
            self._ranks = {k: v for k, v in self._ranks.items() if k in live}
        if self._noted:
            with self._lock:
                watched = {pid for pid, _ in self._members}
                self._noted = {k: v for k, v in self._noted.items() if k[0] in watched}


def _same_objects(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Whether two tuples hold the very same objects, in order (in C: no generator a tick)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))
