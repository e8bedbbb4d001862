"""Per-thread /proc files kept open and re-read with pread(2).

A wide job (8 ranks × 128 threads) asks for two small files per thread every tick: stat and
schedstat. open+read+close costs three syscalls and a path walk through /proc/PID/task/TID each
time (7 µs for a stat here); pread at offset 0 on a kept descriptor is one syscall (2.9 µs): the
kernel renders a seq file afresh on every read from offset 0. A kept descriptor is also bound to
the task it was opened on: once that thread ends, its reads fail with ESRCH even if the number is
reused, so nothing is ever read from the wrong task.

Kept descriptors live at or above FD_FLOOR (fcntl F_DUPFD_CLOEXEC), so that however many a wide
job needs, the daemon's own files keep the low numbers: select() fails on a descriptor past 1023,
and code that uses it (the daemon's wake-up pipe, test rigs) must never be handed one because the
cache grew. They are bounded by what lies between FD_FLOOR and the soft RLIMIT_NOFILE; past it,
files are read the ordinary way. Those not read during the last `keep` sweeps (ticks) are closed
by sweep(), or at once by release() when their owner knows the task is gone: an idle thread's
stat is read one tick in eight, and must not be reopened each time. A descriptor can also be
handed over (take): its owner then reads it by number, with no lookup by path (a thread's
schedstat, read for every thread every tick), and alone closes it (drop), so the number is never
closed and reused under it.
"""

from __future__ import annotations

import fcntl
import os
import resource
import weakref

from stallwatch.kernel.roots import Absent, Roots, _raise_mapped

READ_LIMIT = 16384  # stat, schedstat: well under a page
SCHEDSTAT_LIMIT = 128  # schedstat: three u64s in decimal, at most 62 bytes; a smaller buffer is a
# cheaper read, and it is read for every thread every tick
FD_FLOOR = 1024  # FD_SETSIZE: select() handles descriptors below it only


def default_budget() -> int:
    """Half of what lies above FD_FLOOR under the soft fd limit, at most 4,096 (2,048 threads):
    the unit's LimitNOFILE=16384 gives that (systemd/stallwatch.service); systemd's default soft
    limit, 1,024, gives none, and every read is then an ordinary open, read, close."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(0, min(4096, (soft - FD_FLOOR) // 2))


class ProcFiles:
    def __init__(self, roots: Roots, max_open: int | None = None, keep: int = 1) -> None:
        self.roots = roots
        self.max_open = default_budget() if max_open is None else max_open
        self.keep = keep  # sweeps a descriptor survives unread
        self._fds: dict[str, int] = {}
        self._sweeps = 0
        self._read_sweep: dict[str, int] = {}  # path -> the sweep count when it was last read
        # Descriptors handed out by take(): their owner reads and closes them (drop), sweep()
        # never does, so a number held by an owner is never closed and reused under it.
        self._taken: set[int] = set()
        # The read a taken descriptor gets: an attribute, so a test can count reads by wrapping it.
        self.pread = os.pread
        # The probe is replaced when a job restarts; its descriptors must not outlive it.
        self._finalizer = weakref.finalize(self, _close_all, self._fds, self._taken)

    def read(self, path: str, share: float = 1.0) -> bytes:
        """The file's bytes; Absent when the task is gone, Denied when hidden from us. A file
        that is not kept yet is opened to be kept only while fewer than `share` of max_open are:
        files read only when a thread ran (its wait channel, stack) take at most half, so that
        on a wide job they never crowd out the stat and schedstat every thread needs."""
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) + len(self._taken) >= self.max_open * share:
                return self.roots.read_small(path, READ_LIMIT)
            low, fd = self._open(path)
            if fd is None:
                try:
                    return os.read(low, READ_LIMIT)
                except OSError as e:
                    _raise_mapped(e, path)
                finally:
                    os.close(low)
            self._fds[path] = fd
        try:
            data = os.pread(fd, READ_LIMIT, 0)
        except OSError as e:
            self.release(path)
            _raise_mapped(e, path)
        self._read_sweep[path] = self._sweeps
        return data

    def read_task_file(self, path: str) -> bytes:
        """read() for a file read only when its task ran (a thread's wchan, stack, children):
        within half the budget (see read), and opened afresh once when the kept descriptor
        fails, since its task has ended and the number may be another task's by now."""
        kept = path in self._fds
        try:
            return self.read(path, 0.5)
        except Absent:
            if not kept:
                raise
            return self.read(path, 0.5)

    def _open(self, path: str) -> tuple[int, int | None]:
        """(a plain descriptor, None) or (-1, one at or above FD_FLOOR)."""
        try:
            low = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            _raise_mapped(e, path)
        try:
            fd = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, FD_FLOOR)
        except OSError:  # EMFILE/EINVAL: no room up there after all
            return low, None
        os.close(low)
        return -1, fd

    def take(self, path: str) -> int | None:
        """A descriptor kept on this file, handed over: the caller reads it with
        self.pread(fd, n, 0) and gives it back with drop(fd), which alone closes it. For the
        hot loop of a wide job, which holds each thread's schedstat descriptor in its memo and
        reads it without a lookup by path. None when there is no room (read by path then);
        Absent or Denied as read()."""
        fd = self._fds.pop(path, None)
        self._read_sweep.pop(path, None)
        if fd is None:
            if len(self._fds) + len(self._taken) >= self.max_open:
                return None
            low, fd = self._open(path)
            if fd is None:
                os.close(low)
                return None
        self._taken.add(fd)
        return fd

    def drop(self, fd: int) -> None:
        """Close a descriptor take() handed out (its task is gone, or its owner forgets it)."""
        if fd in self._taken:
            self._taken.discard(fd)
            os.close(fd)

    def sweep(self) -> None:
        """Close the descriptors of files not read during the last `keep` sweeps (threads that
        ended, processes that left the job). It looks at them every `keep` sweeps only: a wide
        job keeps thousands open, and most ticks nothing has ended."""
        self._sweeps += 1
        if self._sweeps % self.keep:
            return
        oldest = self._sweeps - self.keep
        for path in [p for p, n in self._read_sweep.items() if n < oldest]:
            del self._read_sweep[path]
            fd = self._fds.pop(path, None)
            if fd is not None:
                os.close(fd)

    def release(self, path: str) -> None:
        """Close this file's descriptor now (its owner knows the task is gone)."""
        self._read_sweep.pop(path, None)
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def __len__(self) -> int:
        return len(self._fds) + len(self._taken)

    def close(self) -> None:
        self._finalizer()


def _close_all(fds: dict[str, int], taken: set[int]) -> None:
    for fd in [*fds.values(), *taken]:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    taken.clear()


class ProcPaths:
    """The paths of a Roots' procfs as strings, for the processes probe: it names thousands of
    per-thread files and keeps their descriptors by path (ProcFiles), and pathlib's joins cost
    more than the reads. The one place that knows their layout (issue 21)."""

    __slots__ = ("root",)

    def __init__(self, roots: Roots) -> None:
        self.root = os.fspath(roots.proc)

    def host(self, name: str) -> str:
        """A host-wide file: "stat", "uptime"."""
        return f"{self.root}/{name}"

    def pid(self, pid: int, name: str = "") -> str:
        """A process's directory, or a file under it ("stat", "fd/3", "net/tcp")."""
        return f"{self.root}/{pid}/{name}" if name else f"{self.root}/{pid}"

    def task(self, pid: int, tid: int, name: str = "") -> str:
        """One thread's directory, or a file under it ("schedstat", "children")."""
        return f"{self.root}/{pid}/task/{tid}/{name}" if name else f"{self.root}/{pid}/task/{tid}"

    def is_host(self) -> bool:
        """Whether this is the host's own /proc (not a fixture tree or a container's)."""
        return os.path.normpath(self.root) == "/proc"

    def is_procfs(self) -> bool:
        """Whether it is a mounted procfs: its root is inode 1 (PROC_ROOT_INO). A fixture tree's
        files are replaced on disk, and a descriptor kept on one would read the old file."""
        try:
            return os.stat(self.root).st_ino == 1
        except OSError:
            return False
