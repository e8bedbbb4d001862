"""Typed reads of /proc: the one place outside the parsers that knows where its files are.

prometheus/procfs's shape: `Proc(pid)` is one process, with a method per file it reads
(`stat()`, `status()`, `argv()`, `tids()`, ...), and the module functions read the host-wide files
(`pids()`, `btime()`, `boot_id()`, `net_tcp()`). Each goes through a `Roots` (the real /proc by
default, a fixture tree in tests) and hands the text to the pure parsers of `procfs.py`. The paths
come from `procfiles.ProcPaths`, the one owner of the layout, which the processes probe's hot path
uses directly; nothing outside kernel/ builds a /proc or /sys path (tests/test_layout.py checks).

Errors are the Roots' own: `Absent` (gone), `Denied` (ptrace or mode checks), an `OSError`
otherwise; a malformed file raises ValueError (procfs). Callers that want "None when gone" say so
where they call. The per-thread hot path of the processes probe keeps its own descriptors
(`procfiles.py`), measured cheaper than opening a path per read (docs/performance.md).

    p = Proc(pid)
    p.stat().start_ticks, p.status().uid, p.argv(), p.owner_uid()
    p.live_thread()        # a zombie leader's thread that still runs (one in D on a frozen fs)
    btime(), boot_id(), pids()
"""

from __future__ import annotations

import os
import time

from stallwatch.kernel import procfs
from stallwatch.kernel.procfiles import ProcPaths
from stallwatch.kernel.roots import DEFAULT_ROOTS, Absent, Denied, Roots, _mapped

__all__ = ["Proc", "pids", "btime", "boot_id", "net_tcp", "diskstats", "kernel_stat",
           "self_mountinfo", "mountinfo_path", "self_fd_path", "boottime_is_uptime", "DEAD_STATES"]

# A task in these states has exited: Z (zombie, waiting to be reaped), X (dead).
DEAD_STATES = ("Z", "X")


class Proc:
    """One process (or, with `tid`, one of its threads' files) under a Roots."""

    __slots__ = ("pid", "roots", "_paths")

    def __init__(self, pid: int, roots: Roots = DEFAULT_ROOTS) -> None:
        self.pid, self.roots = int(pid), roots
        self._paths = ProcPaths(roots)

    def __repr__(self) -> str:
        return f"Proc({self.pid})"

    def _file(self, name: str) -> str:
        return self._paths.pid(self.pid, name)

    def stat(self) -> procfs.Stat:
        return procfs.parse_stat(self.roots.read_text(self._file("stat")))

    def thread_stat(self, tid: int) -> procfs.Stat:
        return procfs.parse_stat(self.roots.read_text(self._paths.task(self.pid, tid, "stat")))

    def status(self) -> procfs.Status:
        return procfs.parse_status(self.roots.read_text(self._file("status")))

    def wchan(self, tid: int | None = None) -> str | None:
        path = self._file("wchan") if tid is None else self._paths.task(self.pid, tid, "wchan")
        return procfs.parse_wchan(self.roots.read_text(path))

    def argv_bytes(self, limit: int = 1 << 20) -> tuple[bytes, ...]:
        """The raw NUL-split command line, trailing padding dropped; () for a kernel thread or a
        zombie. Bytes: a caller matching a file name compares what the kernel holds."""
        data = self.roots.read_bytes(self._file("cmdline"), limit).rstrip(b"\0")
        return tuple(data.split(b"\0")) if data else ()

    def argv(self) -> tuple[str, ...]:
        return procfs.parse_cmdline(self.roots.read_bytes(self._file("cmdline")))

    def environ_bytes(self, limit: int = 1 << 20) -> bytes:
        """The raw NUL-separated environment (the owner's or root's to read)."""
        return self.roots.read_bytes(self._file("environ"), limit)

    def owner_uid(self) -> int:
        """The uid that owns /proc/PID (the process's effective uid; root's while it is not
        dumpable): the check a command line cannot forge."""
        path = self._paths.pid(self.pid)
        try:
            return os.stat(path).st_uid
        except OSError as e:
            raise _mapped(e, path) from e

    def tids(self) -> list[int]:
        return sorted(int(n) for n in self.roots.listdir(self._file("task")) if n.isdigit())

    def live_thread(self) -> procfs.Stat | None:
        """The stat of a thread that has not exited (its `pid` field is the thread's id), one in
        D first; None when every thread has exited. A zombie leader whose other threads live on
        (one blocked in D writing to a frozen filesystem) still holds its files and its blocked
        write: it is not gone. Threads that vanish (or cannot be read) while looked at are skipped."""
        try:
            tids = self.tids()
        except (Absent, Denied, OSError):
            return None
        best: procfs.Stat | None = None
        for tid in tids:
            try:
                st = self.thread_stat(tid)
            except (Absent, Denied, OSError, ValueError):
                continue
            if st.state in DEAD_STATES:
                continue
            if best is None or st.state == "D":
                best = st
            if st.state == "D":
                break
        return best

    def fds(self) -> list[int]:
        """The numbers of its open descriptors (ptrace-read access needed)."""
        return sorted(int(n) for n in self.roots.listdir(self._file("fd")) if n.isdigit())

    def fd_target(self, fd: int) -> str:
        """What descriptor `fd` points at: a path, "socket:[INODE]", "pipe:[N]", ..."""
        return self.roots.readlink(self._file(f"fd/{int(fd)}"))

    def fdinfo(self, fd: int) -> tuple[int | None, int | None]:
        """(pos, open flags) of descriptor `fd`."""
        return procfs.parse_fdinfo(self.roots.read_text(self._file(f"fdinfo/{int(fd)}")))

    def cwd(self) -> str:
        return self.roots.readlink(self._file("cwd"))

    def mountinfo(self) -> str:
        return self.roots.read_text(self._file("mountinfo"), 16 << 20)


def pids(roots: Roots = DEFAULT_ROOTS) -> list[int]:
    """Every process id /proc lists now (threads are not listed at the top level)."""
    return sorted(int(n) for n in roots.listdir(roots.proc) if n.isdigit())


def kernel_stat(roots: Roots = DEFAULT_ROOTS) -> str:
    return roots.read_text(ProcPaths(roots).host("stat"))


def btime(roots: Roots = DEFAULT_ROOTS) -> int:
    """Boot time in Unix seconds (/proc/stat btime)."""
    return procfs.parse_btime(kernel_stat(roots))


def boot_id(roots: Roots = DEFAULT_ROOTS) -> str:
    """This boot's random id: a state file from another boot names other processes."""
    return roots.read_text(ProcPaths(roots).host("sys/kernel/random/boot_id")).strip()


def net_tcp(table: str, roots: Roots = DEFAULT_ROOTS, limit: int = 64 << 20) -> str:
    """The text of /proc/net/`table` ("tcp" or "tcp6")."""
    if table not in ("tcp", "tcp6"):
        raise ValueError(f"not a TCP table: {table!r}")
    return roots.read_text(ProcPaths(roots).host(f"net/{table}"), limit=limit)


def diskstats(roots: Roots = DEFAULT_ROOTS) -> str:
    return roots.read_text(ProcPaths(roots).host("diskstats"), 16 << 20)


def self_mountinfo(roots: Roots = DEFAULT_ROOTS) -> str:
    return roots.read_text(mountinfo_path(roots), 16 << 20)


def mountinfo_path(roots: Roots = DEFAULT_ROOTS, pid: int | None = None) -> str:
    """/proc/self/mountinfo, or another process's (its mount namespace): for a caller that keeps
    the descriptor open and polls it (POLLPRI says a mount or unmount happened)."""
    paths = ProcPaths(roots)
    return paths.host("self/mountinfo") if pid is None else paths.pid(pid, "mountinfo")


def self_fd_path(fd: int) -> str:
    """The path that names our own open descriptor `fd` (re-opening or linking a file by fd:
    the walk that opened it followed no link, and this path follows none either)."""
    return f"/proc/self/fd/{int(fd)}"


def boottime_is_uptime() -> bool:
    """Whether this system's /proc/uptime reads as CLOCK_BOOTTIME does (Linux; an emulated
    /proc, gVisor's, may keep its own): read between two clock readings, it must lie between
    them, to its hundredth. Once per probe."""
    try:
        before = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 100) / 100
        with open("/proc/uptime", "rb") as f:
            up = procfs.parse_uptime_s(f.read().decode())
        after = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 100) / 100
    except (OSError, ValueError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME here
        return False
    return before <= up <= after
