"""The processes probe: the job's process tree, every thread's kernel state, and its exits.

Each collect() reads the stat (ppid, start time) of the job's tree — found through the kernel's
per-thread `children` lists, with a scan of every /proc/*/stat at the first look, every 10 s and
for --match — resolves the targets, walks their descendants, and reads per process and per
thread what a stall diagnosis needs: state letter, wait channel, syscall, kernel stack, context switches, CPU, I/O counters, open files and TCP
sockets. The probe keeps a little state between ticks so that rules can stay stateless: how long
each task has been in its state, in D, without a context switch, and without I/O.

A tick reads only what can have changed (issue 17): every thread's stat and schedstat, kept open
and re-read with pread (procfiles.py); wait channel, syscall, stack, status and sched only for a
thread that ran since its last look or changed state (_thread); children lists only for threads
that ran; thread lists when stat's count moves or a thread vanished. On 8 processes × 128 idle
threads that took a collect from 88 to 11 ms (docs/performance.md).

A process is identified by (pid, start_ticks), never by pid alone: a pid that comes back with
another start time is a different process, and the job it stood for is reported as exited.
"""

from __future__ import annotations

import os
import re
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal, Mapping, Protocol, Sequence, TypeVar

from stallwatch.kernel import procfs

from stallwatch.probes import torchrun
from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.model import Frozen
from stallwatch.kernel.procfiles import ProcFiles
from stallwatch.probes.runqueue import RunQueueObs, RunQueueTracker, schedstat_or_none
from stallwatch.kernel.roots import DEFAULT_ROOTS, Absent, Denied, Roots

T = TypeVar("T")
Role = Literal["target", "descendant"]

# An idle thread's stat is re-read one tick in this many (in turn, by tid): the bound on how long
# a letter changed from outside (a wake-up not yet given a CPU) or a comm renamed by another
# thread goes unseen; see ProcessesProbe._thread.
STAT_EVERY_TICKS = 8
_UNREAD = object()  # a thread's schedstat not read by the tree walk this tick

# Syscalls whose first argument is the fd they wait on, so a blocked thread can be tied to a file
# or socket ("write on /data/x.ckpt", "recvfrom on the socket to :30000").
FD_SYSCALLS = frozenset({
    "read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev", "preadv2",
    "pwritev2", "recvfrom", "sendto", "recvmsg", "sendmsg", "recvmmsg", "sendmmsg", "connect",
    "accept", "accept4", "shutdown", "fsync", "fdatasync", "sync_file_range", "ioctl", "fcntl",
    "flock", "ftruncate", "fallocate", "getdents64", "lseek", "close", "fstat", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "sendfile", "splice", "copy_file_range",
})


class TargetSpec(Protocol):
    """What the probe needs of stallwatch.probes.targets.Target."""

    pids: Sequence[int]
    match: str | None


# ---------------------------------------------------------------------------------------- models


class IoObs(Frozen):
    rchar: int
    wchar: int
    syscr: int
    syscw: int
    read_bytes: int
    write_bytes: int
    cancelled_write_bytes: int


class OpenFileObs(Frozen):
    fd: int
    path: str  # readlink target: a path, "pipe:[N]", "anon_inode:[eventfd]", "/dev/nvidia0"...
    write: bool | None = None  # opened O_WRONLY/O_RDWR; None when not checked (non-regular files)
    pos_bytes: int | None = None  # file offset: a reader or writer advancing shows progress


class SocketObs(Frozen):
    fd: int
    local_addr: str
    local_port: int
    remote_addr: str
    remote_port: int
    state: str  # ESTABLISHED, LISTEN, CLOSE_WAIT...
    tx_queue_bytes: int
    rx_queue_bytes: int


class ThreadObs(Frozen):
    tid: int
    comm: str
    state: str  # R S D T t Z X I, as in ps
    state_since_s: float  # how long continuously in `state` (lower bound: 0 on first sight)
    d_state_for_s: float  # how long continuously in D; 0 when not in D
    ctx_unchanged_for_s: float  # how long its context-switch counts have not moved
    voluntary_ctxt_switches: int
    nonvoluntary_ctxt_switches: int
    utime_s: float
    stime_s: float
    cpu_delta_s: float | None  # CPU seconds since the previous tick; None on first sight
    wchan: str | None  # kernel function it sleeps in; None when running or unreadable
    syscall: str | None  # name of the syscall it is blocked in; None when running or unknown
    syscall_nr: int | None = None  # -1: blocked outside a syscall (e.g. a page fault)
    syscall_args: tuple[int, ...] = ()
    syscall_fd: int | None = None
    syscall_file: str | None = None  # what syscall_fd points to, when known
    stack: tuple[str, ...] | None = None  # kernel stack, innermost first; None when unreadable
    # Seconds since it last ran on a CPU (scheduler's se.exec_start); 0 when running, None when
    # the kernel does not say. A lower bound for ctx_unchanged_for_s that needs no watching.
    last_ran_age_s: float | None = None
    runqueue: RunQueueObs | None = None  # whether it stayed runnable since we watch (spinning)


class ProcessObs(Frozen):
    pid: int
    ppid: int
    pgid: int
    sid: int
    uid: int | None
    role: Role
    start_ticks: int
    start_time: float  # Unix seconds
    comm: str
    argv: tuple[str, ...]
    cmdline: str  # argv joined with spaces, for display
    cwd: str | None
    state: str  # of the main thread, as ps shows it
    state_since_s: float
    d_state_for_s: float  # the longest any of its threads has been continuously in D
    ctx_unchanged_for_s: float  # how long no thread of it has been switched in or out
    last_ran_age_s: float | None = None  # since any of its threads last ran (scheduler clock)
    tracked_for_s: float  # how long this probe has watched it: every duration above is <= this
    wchan: str | None
    voluntary_ctxt_switches: int  # summed over its live threads
    nonvoluntary_ctxt_switches: int
    utime_s: float  # whole process, including exited threads
    stime_s: float
    cpu_delta_s: float | None
    cpu_util: float | None  # CPU cores busy over the last interval (1.0 = one core)
    blkio_delay_s: float | None  # total time its threads waited for block I/O (delayacct)
    rss_bytes: int | None
    num_threads: int
    io: IoObs | None  # None when ptrace access is denied
    io_unchanged_for_s: float | None
    num_fds: int | None  # None when the fd table is unreadable
    open_files: tuple[OpenFileObs, ...] = ()
    open_files_truncated: bool = False
    tcp: tuple[SocketObs, ...] = ()
    exit_code: int | None = None  # a zombie's returncode (negative: signal), when readable
    threads: tuple[ThreadObs, ...] = ()
    threads_truncated: bool = False
    # torchrun (stallwatch.probes.torchrun): the agent, and a worker's rank from its environment
    launcher: bool = False
    rank: torchrun.RankInfo | None = None


class ExitObs(Frozen):
    pid: int
    start_ticks: int | None
    start_time: float | None
    role: Role
    comm: str | None
    cmdline: str | None
    last_state: str | None  # the state it was last seen in (Z: it was a zombie, then reaped)
    returncode: int | None  # negative: killed by that signal; None: unknown
    returncode_source: Literal["waitpid", "zombie"] | None
    noticed_at: float  # Unix seconds
    exited_for_s: float  # since it was noticed


class ProcessesObs(Frozen):
    targets: tuple[int, ...]  # live pids that are the job itself
    processes: tuple[ProcessObs, ...]  # targets first, then their descendants, breadth first
    exited: tuple[ExitObs, ...] = ()
    missing: tuple[int, ...] = ()  # explicit pids that did not exist when first looked for
    reused: tuple[int, ...] = ()  # explicit pids now held by another process (not the job)
    zombies: tuple[int, ...] = ()
    denied: tuple[str, ...] = ()  # signals this tick could not read, e.g. ("stack", "io")
    # The tree is the job's user's to grow: past the caps or the time budget its processes are
    # counted and their exits seen, but not examined (issue 22 #9). "" when watched fully.
    truncated: str = ""
    tree_processes: int = 0  # processes in the job's tree (targets and descendants)
    watched_processes: int = 0  # of those, examined this tick (the rest: beyond the caps)
    watched_threads: int = 0


# -------------------------------------------------------------------------------- probe state


@dataclass(slots=True)
class _Track:
    """What one task looked like at the last tick, to turn counters into durations."""

    first_at: float
    seen_at: float
    state: str
    state_at: float
    ctx: int
    ctx_at: float
    cpu_ticks: int
    io_total: int | None = None
    io_at: float = 0.0

    def step(self, now: float, state: str, ctx: int, cpu_ticks: int) -> tuple[float, int]:
        """Move to this tick; returns (seconds since the last tick, CPU ticks used since)."""
        if state != self.state:
            self.state, self.state_at = state, now
        if ctx != self.ctx:
            self.ctx, self.ctx_at = ctx, now
        interval, cpu = now - self.seen_at, cpu_ticks - self.cpu_ticks
        self.seen_at, self.cpu_ticks = now, cpu_ticks
        return interval, cpu


@dataclass(slots=True)
class _Exit:
    pid: int
    start_ticks: int | None
    role: Role
    noticed_mono: float
    noticed_at: float
    comm: str | None = None
    cmdline: str | None = None
    start_time: float | None = None
    last_state: str | None = None
    returncode: int | None = None
    source: Literal["waitpid", "zombie"] | None = None


@dataclass(slots=True)
class _Member:
    """A process of the tree as last seen; what an exit report needs once it is gone."""

    role: Role
    comm: str | None
    cmdline: str | None = None
    start_time: float | None = None
    state: str | None = None
    returncode: int | None = None  # from the zombie's exit_code, if we saw it as one


@dataclass(slots=True)
class _ThreadMemo:
    """A thread's last full reading, reused while it provably did not run (see _thread)."""

    stat_raw: bytes
    stat: procfs.Stat
    sched_raw: bytes | None  # its schedstat when read; None: not read (running, or no schedstat)
    ctx: tuple[int, int]  # voluntary, nonvoluntary context switches
    obs: ThreadObs
    exec_start_s: float | None  # se.exec_start: fixed while it does not run
    denied: tuple[str, ...]  # signals refused at that reading, reported again with it
    seen_at: float
    track: _Track
    stat_path: str
    sched_path: str


@dataclass
class _Tick:
    now: float
    denied: set[str] = field(default_factory=set)
    net: dict[str, dict[int, procfs.TcpSocket]] = field(default_factory=dict)
    uptime_s: float | None = None
    # Read by the tree walk at the start of the tick, reused by the thread reads after it.
    tids: dict[int, list[int]] = field(default_factory=dict)
    sched: dict[tuple[int, int], bytes | None] = field(default_factory=dict)
    number: int = 0  # collects before this one: picks the idle threads whose stat is re-read
    memos_seen: int = 0  # thread memos stamped this tick: _forget rebuilds only when some are stale


@dataclass(frozen=True, slots=True)
class _Caps:
    """How much of one job's tree a tick examines: at most `processes` processes and `threads`
    threads in all (a process's own `max_threads` still applies), within `budget_s` seconds of
    the tick's start (None: no time budget). Targets come first in the tree's order, so the
    job's own processes are always among those examined."""

    processes: int
    threads: int
    budget_s: float | None

    def start(self, now: float) -> _Budget:
        return _Budget(self, now)


@dataclass(slots=True)
class _Budget:
    caps: _Caps
    t0: float
    processes: int = 0
    threads: int = 0
    reason: str = ""  # why the tick stopped examining: the first cap it hit

    def admit(self, num_threads: int, per_process: int, now: float, target: bool) -> int:
        """How many threads of the next process to examine; 0: none, it is past a cap. The
        job's own processes (targets) are examined whatever the time spent."""
        c = self.caps
        if self.reason:
            return 0
        if self.processes >= c.processes:
            self.reason = f"more than max_processes = {c.processes}"
        elif self.threads >= c.threads:
            self.reason = f"more than max_threads = {c.threads} in all"
        elif not target and c.budget_s is not None and now - self.t0 > c.budget_s:
            self.reason = f"the processes probe's time budget ({c.budget_s:g} s) spent"
        if self.reason:
            return 0
        self.processes += 1
        return max(1, min(per_process, c.threads - self.threads, max(num_threads, 1)))

    def used(self, threads: int) -> None:
        self.threads += threads


def uid_of(roots: Roots, pid: int) -> int | None:
    """A process's real uid (the first Uid field of its status); None when unreadable."""
    try:
        return procfs.parse_status(roots.read_text(f"{os.fspath(roots.proc)}/{pid}/status")).uid
    except (Absent, Denied, ValueError, KeyError, IndexError):
        return None


# ---------------------------------------------------------------------------------------- probe


class ProcessesProbe:
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
    ) -> None:
        """known_starts pins explicit pids to a start time (a re-attaching daemon knows it), so a
        reused pid is never adopted; known_names is what the caller last knew them by, reported
        when one is gone before a tick saw it (else a crash reads "crash:  (pid N)"). self_pid is excluded from --match, with its ancestors (the
        shell that runs us has the pattern in its command line too); it defaults to our own pid
        when reading the real /proc."""
        self.roots, self.clock = roots, clock
        # Paths are built as strings: this probe opens thousands of /proc files a tick and
        # pathlib's joins cost more than the reads (bench/: docs/performance.md).
        self._proc = os.fspath(roots.proc)
        self._stat_cache: dict[str, tuple[str, procfs.Stat]] = {}
        self._children_ok: bool | None = None  # the kernel has /proc/PID/task/TID/children
        self._full_scan_at: float | None = None
        self.max_open_files, self.read_stacks = max_open_files, read_stacks
        self.max_threads, self.max_fds_scanned = max_threads, max_fds_scanned
        self.exit_memory_s, self.max_exits = exit_memory_s, max_exits
        # Bounds on one job's tree, so that a user who forks thousands of tasks slows only the
        # watch of their own job: see _Caps.
        self.caps = _Caps(max_processes, max_job_threads, budget_s)
        self._wide = False  # the last tick hit a cap: scan /proc, not the per-thread lists
        # --match adopts only processes of this real uid when set: another user's decoy that
        # matches the pattern must not stand in for the job (issue 22 #10).
        self.match_uid = match_uid
        self._explicit = tuple(dict.fromkeys(int(p) for p in targets.pids))
        self._match = re.compile(targets.match) if targets.match else None
        if self_pid is None and Path(roots.proc) == Path("/proc"):
            self_pid = os.getpid()
        self._self_pid = self_pid
        self._tck = clk_tck or os.sysconf("SC_CLK_TCK")
        self._runq = RunQueueTracker(self._tck)
        self._syscalls = procfs.SYSCALLS if syscall_table is None else syscall_table
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
        self._kids: dict[tuple[int, int], tuple[bytes, list[int]]] = {}
        self._schedstat_ok: bool | None = None
        # Kept descriptors only on the real procfs (its root is inode 1, PROC_ROOT_INO): a
        # fixture tree's files are replaced on disk, and a kept descriptor would read the old.
        try:
            on_procfs = os.stat(self._proc).st_ino == 1
        except OSError:
            on_procfs = False
        self._kept = ProcFiles(roots, None if on_procfs else 0, keep=2 * STAT_EVERY_TICKS)
        self._cmdlines: dict[tuple[int, int, str], tuple[str, ...]] = {}
        self._ranks: dict[tuple[int, int], torchrun.RankInfo | None] = {}
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
                    pid=pid, start_ticks=start_ticks, noticed_mono=now, noticed_at=wall,
                    role="target" if pid in self._explicit or pid in self._job else "descendant",
                    returncode=returncode, source="waitpid", comm=self._names.get(pid),
                    start_time=self._start_time(start_ticks) if start_ticks is not None else None,
                ))

    def collect(self) -> ProcessesObs:
        tick = _Tick(now=self.clock.monotonic(), number=self._collects)
        self._collects, self._tick_tracks = self._collects + 1, 0
        stats = self._scan(tick)
        targets = self._resolve(stats)
        # Members stay in the tree while they live, even when reparented away from the job.
        alive = [k for k in self._members if k[0] in stats and stats[k[0]].start_ticks == k[1]]
        seeds = targets + alive
        tree = self._tree(seeds, stats, exclude=self._self_pid)

        observed, members = [], {}
        budget = self.caps.start(self.clock.monotonic())
        for pid in tree:
            st = stats[pid]
            key = (pid, st.start_ticks)
            role: Role = "target" if self._job.get(pid) == st.start_ticks else "descendant"
            threads = budget.admit(st.num_threads, self.max_threads, self.clock.monotonic(),
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
        self._wide = bool(budget.reason)
        observed = self._torchrun(observed)
        self._notice_exits(members, tick.now)
        self._members = members
        self._forget(stats, tick)
        self._kept.sweep()
        self._first_collect = False

        live = {k[0] for k in members}
        return ProcessesObs(
            targets=tuple(p for p, s in targets if p in live),
            processes=tuple(observed),
            exited=self._exit_obs(tick.now),
            missing=tuple(sorted(self._missing)),
            reused=tuple(p for p in self._explicit
                         if p in self._job and p in stats and stats[p].start_ticks != self._job[p]),
            zombies=tuple(o.pid for o in observed if o.state == "Z"),
            denied=tuple(sorted(tick.denied)),
            truncated=budget.reason, tree_processes=len(tree),
            watched_processes=len(observed), watched_threads=budget.threads,
        )

    def _torchrun(self, observed: list[ProcessObs]) -> list[ProcessObs]:
        """Mark torchrun agents and read their workers' ranks: a worker's environment only when
        it has the agent's uid (the job's user could read it too), once per identity."""
        launchers = {o.pid: o.uid for o in observed if torchrun.is_launcher(o.comm, o.argv)}
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

    # --------------------------------------------------------------------- targets and the tree

    def _pd(self, pid: int, tid: int | None = None) -> str:
        """roots.pid_dir() as a string."""
        return f"{self._proc}/{pid}" if tid is None else f"{self._proc}/{pid}/task/{tid}"

    # Finding new descendants by reading every /proc/*/stat costs ~11 µs per process on the
    # host each tick (20 ms on a 2,000-process GPU node); the kernel's per-thread `children`
    # lists give the job's tree alone. They are documented as possibly missing a child forked
    # while they are read, so a full scan still runs every FULL_SCAN_EVERY_S, and always for
    # --match (which must look at every command line) and at the first look.
    FULL_SCAN_EVERY_S = 10.0

    def _scan(self, tick: _Tick) -> dict[int, procfs.Stat]:
        now = self.clock.monotonic()
        # A tree past the caps costs less through one stat per host process than through the
        # `children` list of each of its threads.
        if (self._match is None and not self._first_collect and not self._wide
                and self._children_readable()
                and self._full_scan_at is not None and now - self._full_scan_at < self.FULL_SCAN_EVERY_S):
            stats = self._scan_tree(tick)
            if stats is not None:
                return stats
        self._full_scan_at = now
        return self._scan_all()

    def _children_readable(self) -> bool:
        if self._children_ok is None:
            me = os.getpid()
            self._children_ok = os.path.isfile(f"{self._proc}/{me}/task/{me}/children")
        return self._children_ok

    def _scan_tree(self, tick: _Tick) -> dict[int, procfs.Stat] | None:
        """The stat of every member and explicit pid and of the children the kernel lists for
        their threads, recursively; None when a list cannot be read (then: a full scan).

        A thread's children list changes when it forks, which it must run to do, or when a
        sibling exits and hands its children over, which changes the thread list: so a list is
        re-read only for a thread whose schedstat moved, or when its process's threads changed.
        Those schedstat readings are the tick's first look at each thread; _thread reuses them."""
        cache, self._stat_cache = self._stat_cache, {}
        stats: dict[int, procfs.Stat] = {}
        queue = list(dict.fromkeys([*self._explicit, *self._job, *(p for p, _ in self._members)]))
        seen: set[int] = set()
        while queue:
            pid = queue.pop()
            if pid in seen:
                continue
            seen.add(pid)
            st = self._read_stat(pid, cache)
            if st is None:
                continue
            stats[pid] = st
            try:
                kids = self._children_of(st, tick)
            except Absent:
                continue  # exited meanwhile
            except Denied:
                return None
            queue.extend(kids)
        return stats

    def _children_of(self, st: procfs.Stat, tick: _Tick) -> list[int]:
        pid, listed = st.pid, False
        tids = self._cached_tids(st)
        if tids is None:
            tids, listed = self._list_tids(st), True
        sched_ok = self._has_schedstat(pid)
        while True:
            out: list[int] = []
            memos, kids_memo, read = self._memos, self._kids, self._kept.read
            for tid in tids:  # the hot loop of a wide job: kept short
                key = (pid, tid)
                sched = None
                if sched_ok:
                    m = memos.get(key)
                    try:
                        sched = read(m.sched_path if m is not None else
                                     f"{self._proc}/{pid}/task/{tid}/schedstat")
                    except (Absent, Denied):
                        if not listed:
                            break  # a thread is gone: the list changed, read it again
                tick.sched[key] = sched
                memo = kids_memo.get(key)
                if not listed and sched is not None and memo is not None and memo[0] == sched:
                    if memo[1]:
                        out.extend(memo[1])
                    continue
                try:
                    kids = [int(k) for k in self.roots.read_small(
                        f"{self._proc}/{pid}/task/{tid}/children").split()]
                except Absent:
                    continue
                if sched is not None:
                    self._kids[(pid, tid)] = (sched, kids)
                out.extend(kids)
            else:
                if listed or sched_ok:  # every thread of a remembered list was read: it holds
                    tick.tids[pid] = tids
                return out
            tids, listed = self._list_tids(st), True

    # A process's thread list is re-listed when stat's thread count moves, or when a thread of
    # the remembered list is gone (one ended and another began between two ticks: the count
    # alone would not show it). Directory metadata is no cheaper signal: /proc/PID/task's mtime
    # is the inode's creation time and never moves, and its link count is 2 + the thread count,
    # the number stat already gives (checked on kernel 6.18).

    def _cached_tids(self, st: procfs.Stat) -> list[int] | None:
        tids = self._tid_lists.get((st.pid, st.start_ticks))
        return tids if tids is not None and len(tids) == st.num_threads else None

    def _list_tids(self, st: procfs.Stat) -> list[int]:
        tids = sorted(int(t) for t in self.roots.listdir(f"{self._pd(st.pid)}/task") if t.isdigit())
        self._tid_lists[(st.pid, st.start_ticks)] = tids
        return tids

    def _has_schedstat(self, pid: int) -> bool:
        """Whether this kernel has /proc/PID/task/TID/schedstat (CONFIG_SCHED_INFO; gVisor and
        fixture trees may not): without it, status's context switches tell whether a thread ran."""
        if self._schedstat_ok is None:
            if not os.path.isdir(self._pd(pid, pid)):
                return False  # decide on a live process
            self._schedstat_ok = os.path.isfile(f"{self._pd(pid, pid)}/schedstat")
        return self._schedstat_ok

    def _kept_or_none(self, path: str) -> bytes | None:
        """A kept file's bytes (procfiles.py); None when it is gone or hidden from us."""
        try:
            return self._kept.read(path)
        except (Absent, Denied):
            return None

    def _scan_all(self) -> dict[int, procfs.Stat]:
        stats = {}
        cache, self._stat_cache = self._stat_cache, {}
        for name in self.roots.listdir(self.roots.proc):
            if name.isdigit():
                st = self._read_stat(int(name), cache)
                if st is not None:
                    stats[int(name)] = st
        return stats

    def _read_stat(self, pid: int, cache: dict[str, tuple[str, procfs.Stat]]) -> procfs.Stat | None:
        """A process's stat, into this scan's cache; None when it exited since it was listed or
        is hidden from us (hidepid). Most processes on a host sleep: their stat line is the same
        as a tick ago, and its parse is reused (the read is not: it is how we know)."""
        name = str(pid)
        try:
            text = self.roots.read_text(f"{self._pd(pid)}/stat")
        except (Absent, Denied):
            return None
        hit = cache.get(name)
        st = hit[1] if hit is not None and hit[0] == text else procfs.parse_stat(text)
        self._stat_cache[name] = (text, st)
        return st

    def _resolve(self, stats: dict[int, procfs.Stat]) -> list[tuple[int, int]]:
        """Target identities (pid, start_ticks) alive now, explicit ones first."""
        for pid in self._explicit:
            if pid in self._job or pid in self._missing:
                continue
            # Adopt an explicit pid only at the first look: a pid that appears later is a new
            # process that happens to get the number, not the job the user named.
            if self._first_collect and pid in stats:
                self._job[pid] = stats[pid].start_ticks
            else:
                self._missing.add(pid)
        if self._match is not None:
            excluded = self._ancestry(stats)
            for pid, st in stats.items():
                if pid in excluded or self._job.get(pid) == st.start_ticks:
                    continue
                if pid == 2 or st.ppid == 2:
                    continue  # kthreadd and kernel threads have no command line
                argv = self._argv(pid, st)
                if argv and self._match.search(" ".join(argv)) and self._users(pid):
                    self._job[pid] = st.start_ticks
        return [(p, s) for p, s in self._job.items() if p in stats and stats[p].start_ticks == s]

    def _users(self, pid: int) -> bool:
        """Whether a --match candidate belongs to the job's user (any process when unknown).
        Read after the pattern matched: a status read per candidate, not per host process."""
        return self.match_uid is None or uid_of(self.roots, pid) == self.match_uid

    def _ancestry(self, stats: dict[int, procfs.Stat]) -> set[int]:
        out, pid = set(), self._self_pid
        while pid is not None and pid > 0 and pid not in out:
            out.add(pid)
            pid = stats[pid].ppid if pid in stats else None
        return out

    @staticmethod
    def _tree(seeds: Iterable[tuple[int, int]], stats: dict[int, procfs.Stat],
              exclude: int | None) -> list[int]:
        """Seeds and their descendants, breadth first; never `exclude` (stallwatch run from
        inside the job's shell would otherwise watch itself)."""
        children: dict[int, list[int]] = {}
        for pid, st in stats.items():
            children.setdefault(st.ppid, []).append(pid)
        order, seen = [], set()
        queue = deque(p for p, _ in seeds)
        while queue:
            pid = queue.popleft()
            if pid in seen or pid == exclude:
                continue
            seen.add(pid)
            order.append(pid)
            queue.extend(sorted(children.get(pid, ())))
        return order

    def _argv(self, pid: int, st: procfs.Stat) -> tuple[str, ...]:
        # Read once per identity: cmdline takes the target's mmap lock, which a process stuck in a
        # page fault can hold for as long as the fault. comm is in the key because exec changes
        # the command line but keeps the pid and start time.
        key = (pid, st.start_ticks, st.comm)
        argv = self._cmdlines.get(key)
        if argv is None:
            try:
                raw = self.roots.read_bytes(f"{self._pd(pid)}/cmdline")
                argv = procfs.parse_cmdline(raw)
            except (Absent, Denied):
                argv = ()
            if argv or st.state in ("Z", "X"):
                self._cmdlines[key] = argv
        return argv

    def _cached_cmdline(self, pid: int, st: procfs.Stat) -> str | None:
        argv = self._cmdlines.get((pid, st.start_ticks, st.comm))
        return " ".join(argv) if argv else None

    # ------------------------------------------------------------------------------ processes

    def _start_time(self, start_ticks: int) -> float:
        if self._btime is None:
            self._btime = procfs.parse_btime(self.roots.read_text(self.roots.proc / "stat"))
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
            fds = self._fds(pid, tick)
            threads = [t for t in (self._thread(pid, tid, fds, tick)
                                   for tid in tids[:limit]) if t is not None]
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
        status = self._optional(f"{d}/status", procfs.parse_status, "status", tick.denied)
        io = self._optional(f"{d}/io", procfs.parse_io, "io", tick.denied)
        cwd = self._link(f"{d}/cwd", "cwd", tick)

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
                tr.io_total, tr.io_at = io.total, now
            io_unchanged = now - tr.io_at
        cpu_delta_s = None if cpu_delta is None else cpu_delta / self._tck
        argv = self._argv(pid, st)
        exit_code = None
        if st.state == "Z" and st.exit_code is not None and io is not None:
            # The kernel shows exit_code only to those who may ptrace the task, else 0; a
            # readable io file is that same permission, so 0 here is a real exit status.
            exit_code = procfs.decode_wait_status(st.exit_code)
        files, truncated, sockets = self._files(pid, fds, tick)
        return ProcessObs(
            pid=pid, ppid=st.ppid, pgid=st.pgid, sid=st.sid, role=role,
            uid=status.uid if status else None,
            start_ticks=st.start_ticks, start_time=self._start_time(st.start_ticks),
            comm=st.comm, argv=argv, cmdline=" ".join(argv), cwd=cwd,
            state=st.state, state_since_s=now - tr.state_at,
            d_state_for_s=d_max,
            ctx_unchanged_for_s=now - tr.ctx_at, tracked_for_s=now - tr.first_at,
            last_ran_age_s=ran,
            wchan=leader.wchan if leader else None,
            voluntary_ctxt_switches=ctx_v, nonvoluntary_ctxt_switches=ctx_n,
            utime_s=st.utime_ticks / self._tck, stime_s=st.stime_ticks / self._tck,
            cpu_delta_s=cpu_delta_s,
            cpu_util=cpu_delta_s / interval if cpu_delta_s is not None and interval > 0 else None,
            blkio_delay_s=(None if st.blkio_delay_ticks is None
                           else st.blkio_delay_ticks / self._tck),
            rss_bytes=status.rss_bytes if status else None, num_threads=st.num_threads,
            io=IoObs(**{f: getattr(io, f) for f in IoObs.model_fields}) if io else None,
            io_unchanged_for_s=io_unchanged,
            num_fds=None if fds is None else len(fds),
            open_files=files, open_files_truncated=truncated, tcp=sockets, exit_code=exit_code,
            threads=tuple(threads), threads_truncated=len(tids) > limit,
        )

    def _thread(self, pid: int, tid: int, fds: dict[int, str] | None,
                tick: _Tick) -> ThreadObs | None:
        """One thread, reading only what can have changed since the last tick.

        Every tick reads its schedstat (nanoseconds on a CPU, nanoseconds waiting for one, times
        scheduled in). A thread off-CPU whose schedstat did not move did not run since its last
        full reading, so its wait channel, syscall, kernel stack, context switches, CPU and
        last-ran time are still those: they are reused. stat's utime+stime cannot be that
        signal: they move in 10 ms ticks, and a thread that wakes for 50 µs a second would look
        idle for minutes. Without schedstat, status's context switches are the signal (a sleeper
        that ran has switched out again). The schedstat read comes first in the tick (the tree
        walk's, when it walked).

        Its stat is not read either then (one pread instead of two: rendering stat costs the
        kernel three times schedstat's). Every way into D, S, T, t or Z is taken by the thread
        itself, on a CPU: it sets its own state and then switches out, which moves schedstat's
        run time and count. The one change made to a thread from outside is a wake-up (S, D or
        T to R: try_to_wake_up sets TASK_RUNNING and queues it), and schedstat moves only once
        it is scheduled in (sched_info_arrive): measured on kernel 6.18, a sleeper woken inside
        a CFS-throttled cgroup read R with its schedstat unchanged until the next period. So
        for a thread woken but not yet given a CPU the letter lags: the moment it runs, the
        next collect reads it afresh; if it never gets a CPU, STAT_EVERY_TICKS bounds the lag
        (each idle thread's stat is re-read in turn), and the same bound holds for a comm
        changed from another thread (/proc/PID/task/TID/comm).
        tests/test_processes_cost.py shows D, T and R entered by a thread seen on the very next
        collect."""
        key = (pid, tid)
        memo = self._memos.get(key)
        if memo is not None and memo.sched_raw is not None:
            # The common case on a wide job, kept short: an idle thread, still idle.
            sched = tick.sched.get(key, _UNREAD)
            if sched is _UNREAD:
                sched = self._kept_or_none(memo.sched_path)
            if sched == memo.sched_raw:
                if (tid + tick.number) % STAT_EVERY_TICKS:
                    return self._thread_idle(memo, fds, tick)
                try:
                    raw = self._kept.read(memo.stat_path)
                except (Absent, Denied):
                    return None
                if raw == memo.stat_raw:
                    return self._thread_idle(memo, fds, tick)
        d, now = self._pd(pid, tid), tick.now
        sched = tick.sched.get(key, _UNREAD)
        if sched is _UNREAD:
            sched = self._kept_or_none(f"{d}/schedstat") if self._has_schedstat(pid) else None
        try:
            raw = self._kept.read(f"{d}/stat")
            status = None if sched is not None else procfs.parse_status(
                self.roots.read_small(f"{d}/status").decode("utf-8", "replace"))
        except (Absent, Denied):  # gone since the listing, or hidden by hidepid
            return None
        if sched is _UNREAD:
            sched = None
        st = (memo.stat if memo is not None and memo.stat_raw == raw
              else procfs.parse_stat(raw.decode("utf-8", "replace")))
        # A running task has no wait channel or stable syscall, and unwinding its stack races
        # with the CPU it runs on: read those only for tasks that are off-CPU.
        blocked = st.state not in ("R", "Z", "X")
        if (blocked and memo is not None and memo.stat.state == st.state
                and memo.stat.start_ticks == st.start_ticks
                and (memo.sched_raw == sched if sched is not None
                     else status is not None and memo.ctx == _ctx(status))):
            return self._thread_again(memo, st, sched, fds, tick)
        try:
            if status is None:
                status = procfs.parse_status(
                    self.roots.read_small(f"{d}/status").decode("utf-8", "replace"))
        except (Absent, Denied):
            return None
        ctx = _ctx(status)
        tr, _, cpu_delta = self._track(("t", tid, st.start_ticks), now, st.state, sum(ctx),
                                       st.utime_ticks + st.stime_ticks)
        denied: set[str] = set()
        wchan = self._optional(f"{d}/wchan", procfs.parse_wchan, "wchan", denied) if blocked else None
        sc = self._optional(f"{d}/syscall", lambda s: procfs.parse_syscall(s, self._syscalls),
                            "syscall", denied) if blocked else None
        stack = (self._optional(f"{d}/stack", procfs.parse_stack, "stack", denied)
                 if blocked and self.read_stacks else None)
        exec_start = (self._optional(f"{d}/sched", procfs.parse_sched_exec_start_s, "sched", denied)
                      if blocked else None)
        run_wait = None  # schedstat's (ns on a CPU, ns waiting for one), for runnable threads
        if st.state == "R" and self._has_schedstat(pid):
            if sched is None:
                try:
                    sched = self._kept.read(f"{d}/schedstat")
                except Absent:
                    pass
                except Denied:
                    denied.add("schedstat")
            run_wait = schedstat_or_none(sched.decode()) if sched is not None else None
        tick.denied |= denied
        runq = self._runq.step(("t", tid, st.start_ticks), now, st.state, ctx[0],
                               st.utime_ticks, st.stime_ticks, run_wait)
        sc_fd = sc.args[0] if sc and sc.name in FD_SYSCALLS and sc.args else None
        if sc_fd is not None and sc_fd >= 1 << 31:  # not an fd: AT_FDCWD or garbage
            sc_fd = None
        obs = ThreadObs(
            tid=tid, comm=st.comm, state=st.state, state_since_s=now - tr.state_at,
            d_state_for_s=now - tr.state_at if st.state == "D" else 0.0,
            ctx_unchanged_for_s=now - tr.ctx_at,
            voluntary_ctxt_switches=ctx[0], nonvoluntary_ctxt_switches=ctx[1],
            utime_s=st.utime_ticks / self._tck, stime_s=st.stime_ticks / self._tck,
            cpu_delta_s=None if cpu_delta is None else cpu_delta / self._tck,
            wchan=wchan, syscall=sc.name if sc else None, syscall_nr=sc.nr if sc else None,
            syscall_args=sc.args if sc else (), syscall_fd=sc_fd,
            syscall_file=fds.get(sc_fd) if fds is not None and sc_fd is not None else None,
            stack=stack, runqueue=runq,
            last_ran_age_s=0.0 if not blocked else self._last_ran_age(exec_start, tick),
        )
        self._memos[key] = _ThreadMemo(raw, st, sched if blocked else None, ctx, obs, exec_start,
                                       tuple(denied), now, tr, f"{d}/stat", f"{d}/schedstat")
        tick.memos_seen += 1
        return obs

    def _thread_idle(self, memo: _ThreadMemo, fds: dict[int, str] | None,
                     tick: _Tick) -> ThreadObs:
        """A thread that did not run since `memo` (its schedstat, and its stat when read, are
        the same bytes): its durations move on, nothing else does. No validation: every value
        comes from a reading validated before. The hot loop of a wide job: kept short."""
        now, old, tr = tick.now, memo.obs, memo.track
        tr.seen_at = now  # _Track.step with the same state, switches and CPU
        self._tick_tracks += 1
        if memo.denied:
            tick.denied.update(memo.denied)
        since = now - tr.state_at
        sc_fd = old.syscall_fd  # the fd table may have changed under it (another thread's close)
        values = old.__dict__.copy()
        values["state_since_s"] = since
        values["d_state_for_s"] = since if old.state == "D" else 0.0
        values["ctx_unchanged_for_s"] = now - tr.ctx_at
        values["cpu_delta_s"] = 0.0
        if sc_fd is not None:
            values["syscall_file"] = fds.get(sc_fd) if fds is not None else None
        if memo.exec_start_s is not None:
            values["last_ran_age_s"] = self._last_ran_age(memo.exec_start_s, tick)
        obs = _evolved(old, values)
        memo.obs, memo.seen_at = obs, now
        tick.memos_seen += 1
        return obs

    def _thread_again(self, memo: _ThreadMemo, st: procfs.Stat, sched: bytes | None,
                      fds: dict[int, str] | None, tick: _Tick) -> ThreadObs:
        """A thread that did not run since `memo`: its durations move on, nothing else does.
        No validation: every value comes from a reading validated before."""
        now, old, tr = tick.now, memo.obs, memo.track
        _, cpu_delta = tr.step(now, st.state, sum(memo.ctx), st.utime_ticks + st.stime_ticks)
        self._tick_tracks += 1
        if memo.denied:
            tick.denied.update(memo.denied)
        sc_fd = old.syscall_fd  # the fd table may have changed under it (another thread's close)
        obs = _evolve(old, {
            "comm": st.comm,  # another thread can rename it through /proc/PID/task/TID/comm
            "state_since_s": now - tr.state_at,
            "d_state_for_s": now - tr.state_at if st.state == "D" else 0.0,
            "ctx_unchanged_for_s": now - tr.ctx_at,
            "utime_s": st.utime_ticks / self._tck, "stime_s": st.stime_ticks / self._tck,
            "cpu_delta_s": None if cpu_delta is None else cpu_delta / self._tck,
            "syscall_file": fds.get(sc_fd) if fds is not None and sc_fd is not None else None,
            "last_ran_age_s": self._last_ran_age(memo.exec_start_s, tick),
        })
        memo.obs, memo.stat, memo.sched_raw, memo.seen_at = obs, st, sched, now
        tick.memos_seen += 1
        return obs

    def _last_ran_age(self, exec_start_s: float | None, tick: _Tick) -> float | None:
        if exec_start_s is None:
            return None
        if tick.uptime_s is None:
            up = self._optional(f"{self._proc}/uptime", procfs.parse_uptime_s, "uptime",
                                tick.denied)
            tick.uptime_s = up if up is not None else -1.0
        return None if tick.uptime_s < 0 else max(0.0, tick.uptime_s - exec_start_s)

    # -------------------------------------------------------------------------- files, sockets

    def _link(self, path: str | Path, signal: str, tick: _Tick) -> str | None:
        try:
            return self.roots.readlink(path)
        except Absent:
            return None
        except Denied:
            tick.denied.add(signal)
            return None

    def _fds(self, pid: int, tick: _Tick) -> dict[int, str] | None:
        """fd -> readlink target, for at most max_fds_scanned fds; None when unreadable."""
        fd_dir = f"{self._pd(pid)}/fd"
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
            tick.denied.add("fd")
            return None
        return links

    def _files(self, pid: int, fds: dict[int, str] | None, tick: _Tick):
        if not fds:
            return (), False, ()
        inodes = procfs.socket_inodes(fds)
        sockets = self._tcp(pid, inodes, tick) if inodes else ()
        others = [(fd, p) for fd, p in fds.items() if fd not in inodes.values()]
        # Regular files first: a checkpoint being written matters more than the 40 fds every
        # CUDA process holds on /dev/nvidia*, and the cap must not push it out.
        others.sort(key=lambda fp: (not fp[1].startswith("/") or fp[1].startswith("/dev/"), fp[0]))
        files = []
        for fd, path in others[:self.max_open_files]:
            write = pos = None
            if path.startswith("/") and not path.startswith("/dev/"):
                info = self._optional(f"{self._pd(pid)}/fdinfo/{fd}",
                                      procfs.parse_fdinfo, "fdinfo", tick.denied)
                if info is not None:
                    pos, flags = info
                    write = procfs.opened_for_write(flags) if flags is not None else None
            files.append(OpenFileObs(fd=fd, path=path, write=write, pos_bytes=pos))
        return tuple(files), len(others) > self.max_open_files, sockets

    def _tcp(self, pid: int, inodes: dict[int, int], tick: _Tick) -> tuple[SocketObs, ...]:
        # Socket tables belong to a network namespace: read the target's own view, once per
        # namespace per tick.
        d = self.roots.pid_dir(pid)
        ns = self._link(d / "ns" / "net", "ns", tick) or f"pid:{pid}"
        table = tick.net.get(ns)
        if table is None:
            table = {}
            for name in ("tcp", "tcp6"):
                socks = self._optional(d / "net" / name, procfs.parse_net_tcp, "net", tick.denied)
                table.update((sock.inode, sock) for sock in socks or ())
            tick.net[ns] = table
        return tuple(
            SocketObs(fd=fd, local_addr=s.local_addr, local_port=s.local_port,
                      remote_addr=s.remote_addr, remote_port=s.remote_port, state=s.state,
                      tx_queue_bytes=s.tx_queue_bytes, rx_queue_bytes=s.rx_queue_bytes)
            for inode, fd in sorted(inodes.items(), key=lambda kv: kv[1])
            if (s := table.get(inode)) is not None
        )

    # ---------------------------------------------------------------------------------- exits

    def _notice_exits(self, members: dict[tuple[int, int], _Member], now: float) -> None:
        wall = self.clock.time()
        with self._lock:
            for (pid, start), m in self._members.items():
                if (pid, start) in members:
                    continue
                rc = self._noted.pop((pid, start), None)
                if rc is None:
                    rc = self._noted.pop((pid, None), None)
                source = ("waitpid" if rc is not None
                          else "zombie" if m.returncode is not None else None)
                self._exits.append(_Exit(
                    pid=pid, start_ticks=start, role=m.role, noticed_mono=now, noticed_at=wall,
                    comm=m.comm, cmdline=m.cmdline, start_time=m.start_time, last_state=m.state,
                    returncode=rc if rc is not None else m.returncode, source=source,
                ))

    def _exit_obs(self, now: float) -> tuple[ExitObs, ...]:
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
                ExitObs(pid=e.pid, start_ticks=e.start_ticks, start_time=e.start_time, role=e.role,
                        comm=e.comm, cmdline=e.cmdline, last_state=e.last_state,
                        returncode=e.returncode, returncode_source=e.source,
                        noticed_at=e.noticed_at, exited_for_s=now - e.noticed_mono)
                for e in keep
            )

    def _forget(self, stats: dict[int, procfs.Stat], tick: _Tick) -> None:
        """Drop memory of tasks that are gone, so a long run does not grow without bound."""
        live = {(p, s.start_ticks) for p, s in stats.items()}
        # Explicit pids keep their identity after death: that is how a reuse is recognised.
        self._job = {p: s for p, s in self._job.items() if p in self._explicit or (p, s) in live}
        # Rebuilt only when some are stale: on a wide idle job nothing ends, and rebuilding
        # three dicts of a thousand entries a tick was a tenth of the probe's cost.
        # (Nothing is stamped twice in a tick: the counts equal the sizes only when all are.)
        now = tick.now
        if len(self._tracks) != self._tick_tracks:
            self._tracks = {k: v for k, v in self._tracks.items() if v.seen_at == now}
        if len(self._memos) != tick.memos_seen or len(self._kids) > len(self._memos):
            memos: dict[tuple[int, int], _ThreadMemo] = {}
            for k, m in self._memos.items():
                if m.seen_at == now:
                    memos[k] = m
                else:  # ended, or no longer examined: its kept descriptors go with it
                    self._kept.release(m.stat_path)
                    self._kept.release(m.sched_path)
            self._memos = memos
            self._kids = {k: v for k, v in self._kids.items() if k in memos}
        self._tid_lists = {k: v for k, v in self._tid_lists.items() if k in live}
        self._cmdlines = {k: v for k, v in self._cmdlines.items() if (k[0], k[1]) in live}
        self._ranks = {k: v for k, v in self._ranks.items() if k in live}
        with self._lock:
            watched = {pid for pid, _ in self._members}
            self._noted = {k: v for k, v in self._noted.items() if k[0] in watched}


def _evolve(obs: ThreadObs, update: dict) -> ThreadObs:
    """obs.model_copy(update=update), for the thousand idle threads of a wide job: model_copy
    goes through copy.copy for each of pydantic's four slots (1.8 µs); this sets them directly
    (0.7 µs). Every field is already set on a ThreadObs, so the fields-set is unchanged, and it
    has no extras or private attributes (tests/test_processes_cost.py compares the two)."""
    values = obs.__dict__.copy()
    values.update(update)
    return _evolved(obs, values)


def _evolved(obs: ThreadObs, values: dict) -> ThreadObs:
    """A ThreadObs like `obs` with these field values (all of them: a copy of its __dict__)."""
    new = _new(ThreadObs)
    _set(new, "__dict__", values)
    _set(new, "__pydantic_fields_set__", obs.__pydantic_fields_set__)
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_private__", None)
    return new


_new, _set = object.__new__, object.__setattr__


def _ctx(status: procfs.Status) -> tuple[int, int]:
    return status.voluntary_ctxt_switches, status.nonvoluntary_ctxt_switches


def _min_known(xs: Iterable[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return min(known) if known else None
