"""What the processes probe reports: the job's processes, their threads, open files, sockets and
exits (moved out of probes/processes.py as they were)."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from stallwatch.model import Frozen
from stallwatch.probes import torchrun
from stallwatch.probes.runqueue import RunQueueObs

Role = Literal["target", "descendant"]
M = TypeVar("M", bound=Frozen)
_new, _set = object.__new__, object.__setattr__
_FIELDS: dict[type, tuple[str, ...]] = {}  # a model's field names, in their declared order
_ALL_SET: dict[type, set[str]] = {}  # the same as a set: copied as a record's fields set


def built(cls: type[M], values: dict[str, Any], fields_set: set[str] | None = None) -> M:
    """cls(**values) without validation, for what the probe builds every tick from its own
    parsers' typed values (a ProcessObs: 11.5 µs validated, 0.8 µs so). `values` must name
    every field (a KeyError otherwise), with its declared type (tests/test_processes_cost.py
    checks a real collect's against validation); fields_set defaults to all of them, and then
    they are put in the declared order."""
    if fields_set is None:  # in the declared order, as validation leaves them (dumps, repr)
        names = _FIELDS.get(cls)
        if names is None:  # model_fields is a descriptor that builds a dict: once per class
            names = _FIELDS[cls] = tuple(cls.model_fields)
            _ALL_SET[cls] = set(names)
        # A dict written in that order (the probe's own, every tick) is used as it is: the
        # comparison runs in C, the reordering in Python (a third of built's cost, procs7).
        if tuple(values) != names:
            values = {name: values[name] for name in names}
        fields_set = _ALL_SET[cls].copy()
    new = _new(cls)
    _set(new, "__dict__", values)
    _set(new, "__pydantic_fields_set__", fields_set)
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_private__", None)
    return new



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
    # Seconds since it last ran on a CPU (se.exec_start on its CPU's clock: kernel/schedclock.py);
    # 0 when running, None when the kernel does not say. A lower bound for ctx_unchanged_for_s
    # that needs no watching.
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
