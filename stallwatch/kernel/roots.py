"""One object that says where the kernel's files are.

Every read of /proc, /sys and the kernel log goes through a Roots, so parsers and probes run
unchanged on captured fixture trees (node_exporter's collector/fixtures idea) and tests never
depend on the host they run on.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn


class Absent(Exception):
    """The file does not exist (pid gone, feature not built into this kernel)."""


class Denied(Exception):
    """The file exists but this process may not read it (ptrace rules, no CAP_SYS_ADMIN)."""


@dataclass(frozen=True)
class Roots:
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    kmsg: Path = Path("/dev/kmsg")

    @classmethod
    def under(cls, base: str | os.PathLike[str]) -> Roots:
        """A fixture tree laid out as base/proc, base/sys, base/dev/kmsg."""
        b = Path(base)
        return cls(proc=b / "proc", sys=b / "sys", kmsg=b / "dev" / "kmsg")

    def pid_dir(self, pid: int, tid: int | None = None) -> Path:
        d = self.proc / str(pid)
        return d if tid is None else d / "task" / str(tid)

    # These run thousands of times a tick: plain os calls and try/except, no file objects or
    # context managers (bench/: docs/performance.md). `path` may be a str or a Path.

    def read_bytes(self, path: Path | str, limit: int = 1 << 20) -> bytes:
        """Read at most `limit` bytes; map errno to Absent/Denied so callers can report state."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            _raise_mapped(e, path)
        try:
            return read_all(fd, limit)
        except OSError as e:
            _raise_mapped(e, path)
        finally:
            os.close(fd)

    def read_small(self, path: Path | str, limit: int = 16384) -> bytes:
        """One read(2), for the /proc files the kernel renders in a single show (stat, schedstat,
        status, wchan, syscall, stack): their first read returns the whole file, so the second
        read that read_bytes spends finding EOF is saved — a third of the syscalls a thread costs.
        Multi-record seq files (net/tcp, mountinfo, diskstats) must use read_bytes."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            _raise_mapped(e, path)
        try:
            data = os.read(fd, limit)
        except OSError as e:
            _raise_mapped(e, path)
        finally:
            os.close(fd)
        return data if len(data) < limit else data + self.read_bytes(path)[limit:]

    def read_text(self, path: Path | str, limit: int = 1 << 20) -> str:
        return self.read_bytes(path, limit).decode("utf-8", "replace")

    def readlink(self, path: Path | str) -> str:
        try:
            return os.readlink(path)
        except OSError as e:
            _raise_mapped(e, path)

    def listdir(self, path: Path | str) -> list[str]:
        try:
            return os.listdir(path)
        except OSError as e:
            _raise_mapped(e, path)

    def listdir_ino(self, path: Path | str) -> list[tuple[str, int]]:
        """Names with their inode numbers, from the directory entries (no stat of each). A
        /proc/PID directory's inode is made for its process: a pid reused by another process
        lists with another number."""
        # Through a descriptor: scandir(fd) builds no path per entry (a fifth less, on a
        # listing of /proc every ten ticks: procs7).
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            _raise_mapped(e, path)
        try:
            with os.scandir(fd) as entries:
                return [(e.name, e.inode()) for e in entries]
        except OSError as e:
            _raise_mapped(e, path)
        finally:
            os.close(fd)


def read_all(fd: int, limit: int) -> bytes:
    """At most `limit` bytes of an open file from offset 0. One read(2) of a multi-record seq
    file (/proc/net/tcp, mountinfo, diskstats) returns about one page, not the whole file: read
    on until EOF or the limit; pread, so a descriptor kept open is re-read from its start."""
    chunks, size = [], 0
    while size < limit:
        chunk = os.pread(fd, min(limit - size, 1 << 16), size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _raise_mapped(e: OSError, path: Path | str) -> NoReturn:
    m = _mapped(e, path)
    if m is e:
        raise e
    raise m from e


def _mapped(e: OSError, path: Path | str) -> Exception:
    """The task died (ENOENT, ESRCH) → Absent; ptrace or mode checks (EACCES, EPERM) → Denied;
    anything else is the OSError itself."""
    if e.errno in (errno.ESRCH, errno.ENOENT):
        return Absent(str(path))
    if e.errno in (errno.EACCES, errno.EPERM):
        return Denied(str(path))
    return e


@contextmanager
def _mapped_errors(path: Path | str):
    """The same mapping as a context manager, for callers outside the hot paths."""
    try:
        yield
    except OSError as e:
        _raise_mapped(e, path)


DEFAULT_ROOTS = Roots()
