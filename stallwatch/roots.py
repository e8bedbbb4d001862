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
    def under(cls, base: str | os.PathLike[str]) -> "Roots":
        """A fixture tree laid out as base/proc, base/sys, base/dev/kmsg."""
        b = Path(base)
        return cls(proc=b / "proc", sys=b / "sys", kmsg=b / "dev" / "kmsg")

    def pid_dir(self, pid: int, tid: int | None = None) -> Path:
        d = self.proc / str(pid)
        return d if tid is None else d / "task" / str(tid)

    def read_bytes(self, path: Path, limit: int = 1 << 20) -> bytes:
        """Read at most `limit` bytes; map errno to Absent/Denied so callers can report state."""
        with _mapped_errors(path):
            with open(path, "rb", buffering=0) as f:
                # One read(2) of a multi-record seq file (/proc/net/tcp, mountinfo, diskstats)
                # returns about one page, not the whole file: read until EOF or the limit.
                chunks, size = [], 0
                while size < limit:
                    chunk = f.read(limit - size)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                return b"".join(chunks)

    def read_text(self, path: Path, limit: int = 1 << 20) -> str:
        return self.read_bytes(path, limit).decode("utf-8", "replace")

    def readlink(self, path: Path) -> str:
        with _mapped_errors(path):
            return os.readlink(path)

    def listdir(self, path: Path) -> list[str]:
        with _mapped_errors(path):
            return os.listdir(path)


@contextmanager
def _mapped_errors(path: Path):
    """The task died (ENOENT, ESRCH) → Absent; ptrace or mode checks (EACCES, EPERM) → Denied."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ESRCH, errno.ENOENT):
            raise Absent(str(path)) from e
        if e.errno in (errno.EACCES, errno.EPERM):
            raise Denied(str(path)) from e
        raise


DEFAULT_ROOTS = Roots()
