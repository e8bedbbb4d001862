"""What the processes probe remembers between ticks, and its per-tick scratch and caps (moved out
of probes/processes.py as they were)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from stallwatch.kernel import procfs
from stallwatch.kernel.procfiles import ProcPaths
from stallwatch.kernel.roots import Absent, Denied, Roots
from stallwatch.probes.processes_obs import Role, ThreadObs


@dataclass(slots=True)
class _Track:
    """What one task looked like at the last tick, to turn counters into durations."""

    first_mono: float
    seen_mono: float
    state: str
    state_mono: float
    ctx: int
    ctx_mono: float
    cpu_ticks: int
    io_total: int | None = None
    io_mono: float = 0.0

    def step(self, now: float, state: str, ctx: int, cpu_ticks: int) -> tuple[float, int]:
        """Move to this tick; returns (seconds since the last tick, CPU ticks used since)."""
        if state != self.state:
            self.state, self.state_mono = state, now
        if ctx != self.ctx:
            self.ctx, self.ctx_mono = ctx, now
        interval, cpu = now - self.seen_mono, cpu_ticks - self.cpu_ticks
        self.seen_mono, self.cpu_ticks = now, cpu_ticks
        return interval, cpu


@dataclass(slots=True)
class _Exit:
    pid: int
    start_ticks: int | None
    role: Role
    noticed_mono: float
    noticed_wall: float
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
    """A thread's last full reading, reused while it provably did not run (see _thread). One
    object for the thread's life, updated in place: a process's memos, in its thread list's
    order, are its rows (ProcessesProbe._rows), which the tick walks without a lookup."""

    tid: int
    stat_raw: bytes
    stat: procfs.Stat
    sched_raw: bytes | None  # its schedstat when read; None: not read (running, or no schedstat)
    ctx: tuple[int, int]  # voluntary, nonvoluntary context switches
    obs: ThreadObs
    ran_uptime_s: float | None  # when it last ran, in /proc/uptime seconds: fixed while it does not
    # run (se.exec_start and its CPU's clock, ThreadReader._ran_uptime)
    denied: tuple[str, ...]  # signals refused at that reading, reported again with it
    seen_mono: float
    track: _Track
    stat_path: str
    sched_path: str
    # Its schedstat descriptor, held (ProcFiles.take) and read by number in the hot loop; -1:
    # none (no room, no schedstat, or closed: set to -1 in the same step that closes it).
    sched_fd: int = -1
    # This tick's schedstat, read by the tree walk: valid when sched_tick is the tick's number.
    sched_tick: int = -1
    sched_now: bytes | None = None
    # Its children list, read under this schedstat: the same while it does not run (TreeWalk).
    kids_sched: bytes | None = None
    kids: list[int] = field(default_factory=list)


class _Tick:
    """One collect's scratch. A plain slotted class: a dataclass's generated __init__ tests a
    sentinel for each default factory, per collect (procs7)."""

    __slots__ = ("now", "denied", "net", "unix", "uptime_s", "tids", "sched", "rows", "number",
                 "memos_seen", "leader_status")

    def __init__(self, now: float, number: int = 0) -> None:
        self.now = now
        self.denied: set[str] = set()
        self.net: dict[str, dict[int, str]] = {}  # ns -> inode -> net/tcp* line
        self.unix: dict[str, frozenset[int]] = {}  # ns -> net/unix's inodes
        self.uptime_s: float | None = None
        # Read by the tree walk at the start of the tick, reused by the thread reads after it.
        self.tids: dict[int, list[int]] = {}
        # threads with no memo: their schedstat
        self.sched: dict[tuple[int, int], bytes | None] = {}
        # pid -> its memos, one per listed thread, each with this tick's schedstat (sched_now):
        # the tree walk read them all through their held descriptors.
        self.rows: dict[int, list[_ThreadMemo]] = {}
        self.number = number  # collects before this one: picks the idle threads whose stat is re-read
        # thread memos stamped this tick: _forget rebuilds only when some are stale
        self.memos_seen = 0
        # pid -> its main thread's task/PID/status, when read this tick (it ran): the process's
        # own status is the same rendering of the same task, so it is not read and parsed again.
        self.leader_status: dict[int, procfs.Status] = {}


@dataclass(frozen=True, slots=True)
class _Caps:
    """How much of one job's tree a tick examines: at most `processes` processes and `threads`
    threads in all (a process's own `max_threads` still applies), within `budget_s` seconds of
    CPU time of the collecting thread from the tick's start (None: no time budget). Targets
    come first in the tree's order, so the job's own processes are always among those examined."""

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
    # That cap was the time budget: a loaded host can spend it on a narrow tree, which a scan of
    # all of /proc next tick would only make slower (TreeWalk._scan; issue 17).
    timed_out: bool = False

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
            self.timed_out = True
        if self.reason:
            return 0
        self.processes += 1
        return max(1, min(per_process, c.threads - self.threads, max(num_threads, 1)))

    def used(self, threads: int) -> None:
        self.threads += threads


def uid_of(roots: Roots, pid: int) -> int | None:
    """A process's real uid (the first Uid field of its status); None when unreadable."""
    try:
        return procfs.parse_status(roots.read_text(ProcPaths(roots).pid(pid, "status"))).uid
    except (Absent, Denied, ValueError, KeyError, IndexError):
        return None
