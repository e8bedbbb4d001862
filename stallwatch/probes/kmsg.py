"""Kernel log probe: OOM kills, hung tasks, Xids, I/O and fs errors, segfaults from /dev/kmsg.

/dev/kmsg is read non-blocking, one record per read(2), from a cursor kept in the open file: so
each tick costs a few syscalls and never waits. We never shell out to dmesg: if the kernel log
is not readable (not root, dmesg_restrict, a container without /dev/kmsg) that is the answer,
reported as denied/absent. A regular file in the same format (a fixture tree's dev/kmsg, one
record a line) is read the same way, minus EAGAIN/EPIPE.
"""

from __future__ import annotations

import errno
import os
import select
import stat
from collections import Counter, deque
from pathlib import Path

from pydantic import Field

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.kernel.proc import btime
from stallwatch.kernel.kmsgparse import KernelEvent, KernelEventParser, KmsgRecord, parse_record
from stallwatch.model import Frozen
from stallwatch.probes.base import ProbeStatus
from stallwatch.kernel.roots import DEFAULT_ROOTS, Absent, Denied, Roots

_READ_SIZE = 16384  # above the kernel's record limit (CONSOLE_EXT_LOG_MAX, 8 KiB): no EINVAL


class KmsgObs(Frozen):
    status: ProbeStatus
    error: str | None = None
    source: str
    history: bool = False
    cursor: int | None = None  # seq of the last record read
    prev_cursor: int | None = None  # cursor before this tick: events with seq > it are new
    records_read: int = 0  # this tick
    records_lost: int = 0  # since start: overwritten before we read them (seq gaps)
    events: tuple[KernelEvent, ...] = ()  # the ring: the last N events, oldest first
    counts: dict[str, int] = Field(default_factory=dict)  # events by kind since the probe started
    boot_wall_time: float | None = None


class KmsgReader:
    """A cursor over /dev/kmsg or a text file of records.

    history=False starts at the end (only what happens from now on); history=True starts at the
    oldest record still in the ring buffer (SEEK_DATA: after the last `dmesg -C`), for diagnose.
    `after_seq` resumes from a stored cursor: history is read and records up to it are skipped.
    """

    def __init__(self, path: Path, history: bool = False, after_seq: int | None = None) -> None:
        self.path = path
        self.history = history or after_seq is not None
        self.last_seq = after_seq
        self.lost = 0
        self._fd: int | None = None
        self._is_file = False
        self._partial = b""
        self._poll: select.poll | None = None  # on /dev/kmsg: is a record waiting?

    def open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise Absent(f"{self.path}: {e.strerror}") from e
        except PermissionError as e:
            raise Denied(f"{self.path}: {e.strerror} (needs root, or CAP_SYSLOG when "
                         f"kernel.dmesg_restrict=1)") from e
        self._is_file = stat.S_ISREG(os.fstat(fd).st_mode)
        try:
            if self._is_file:
                os.lseek(fd, 0, os.SEEK_SET if self.history else os.SEEK_END)
            else:
                os.lseek(fd, 0, os.SEEK_DATA if self.history else os.SEEK_END)
                self._poll = select.poll()
                self._poll.register(fd, select.POLLIN)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    @property
    def is_device(self) -> bool:
        """Open on /dev/kmsg (O_NONBLOCK: a read never waits), not on a file of records."""
        return self._fd is not None and not self._is_file

    def nothing_new(self) -> bool:
        """On /dev/kmsg, no record waits (poll: a read would answer EAGAIN, without raising
        it); the kernel's devkmsg_poll says POLLIN for a new record, POLLERR|POLLPRI when ours
        was overwritten. False on a file of records: read it to know."""
        return self._poll is not None and not self._poll.poll(0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._poll = None, None

    def read(self, limit: int) -> list[KmsgRecord]:
        """Up to `limit` new records; fewer when the log has no more right now."""
        fd = self._fd
        assert fd is not None
        raw = self._read_file(fd, limit) if self._is_file else self._read_device(fd, limit)
        out: list[KmsgRecord] = []
        for chunk in raw:
            rec = parse_record(chunk)
            if rec is None or (self.last_seq is not None and rec.seq <= self.last_seq):
                continue
            if self.last_seq is not None and rec.seq > self.last_seq + 1:
                self.lost += rec.seq - self.last_seq - 1
            self.last_seq = rec.seq
            out.append(rec)
        return out

    def _read_device(self, fd: int, limit: int) -> list[str]:
        out: list[str] = []
        overrun = 0
        while len(out) < limit:
            try:
                data = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                break  # EAGAIN: nothing more for now
            except OSError as e:
                if e.errno == errno.EPIPE and overrun < 3:
                    # Our position was overwritten; the kernel moved it to the oldest record kept,
                    # and the seq gap counts what we lost.
                    overrun += 1
                    continue
                if e.errno in (errno.EPERM, errno.EACCES):
                    raise Denied(f"{self.path}: {e.strerror}") from e
                raise
            if not data:
                break
            out.append(data.decode("utf-8", "replace"))
        return out

    def _read_file(self, fd: int, limit: int) -> list[str]:
        # A text dump: one record a line; continuation lines start with a space. The file may be
        # rewritten shorter (a fixture regenerated): start over and let seq filtering skip.
        if os.fstat(fd).st_size < os.lseek(fd, 0, os.SEEK_CUR):
            os.lseek(fd, 0, os.SEEK_SET)
            self._partial = b""
        out: list[str] = []
        while len(out) < limit:
            data = os.read(fd, _READ_SIZE)
            if not data:
                break
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()  # an unterminated last line waits for its newline
            out.extend(ln.decode("utf-8", "replace") for ln in lines if ln and not ln.startswith(b" "))
        return out


class KmsgProbe:
    name = "kmsg"

    def __init__(
        self,
        roots: Roots = DEFAULT_ROOTS,
        clock: Clock = SYSTEM_CLOCK,
        history: bool = False,
        ring_size: int = 256,
        max_records_per_tick: int = 10_000,
        cursor: int | None = None,
    ) -> None:
        self.roots = roots
        self.clock = clock
        self.max_records_per_tick = max_records_per_tick
        self._reader = KmsgReader(roots.kmsg, history=history, after_seq=cursor)
        self._ring: deque[KernelEvent] = deque(maxlen=ring_size)
        self._counts: Counter[str] = Counter()
        self._parser: KernelEventParser | None = None
        self._boot_wall: float | None = None
        self._last: KmsgObs | None = None  # the last ok observation

    def open(self) -> None:
        """Open now, so that what happens from here on is seen (collect() also opens lazily)."""
        if not self._reader.is_open:
            self._reader.open()
            self._boot_wall = self._boot_wall_time()
            self._parser = KernelEventParser(self._boot_wall)

    def close(self) -> None:
        self._reader.close()

    def cannot_block(self) -> bool:
        """Once /dev/kmsg is open, a collect is non-blocking reads of a character device: the
        collector runs it inline, without a worker-thread handoff (issue 17). A file of records
        (a capture) could sit on a filesystem that hangs: a worker then, as every probe."""
        return self._reader.is_device

    def unchanged(self) -> bool:
        """Read nothing last tick, and nothing waits now: collect() would return its last
        observation (an OOM summary held for its Killed line is let out by the tick after the
        one that read it, so none is held after a tick that read nothing). The collector then
        hands it on without running collect() (issue 17)."""
        last = self._last
        return last is not None and last.records_read == 0 and self._reader.nothing_new()

    def collect(self) -> KmsgObs:
        if self.unchanged():
            return self._last  # type: ignore[return-value]  # (unchanged: not None)
        prev = self._reader.last_seq
        try:
            self.open()
            records = self._reader.read(self.max_records_per_tick)
        except Absent as e:
            return self._failed(ProbeStatus.absent, str(e))
        except Denied as e:
            self._reader.close()
            return self._failed(ProbeStatus.denied, str(e))
        except OSError as e:
            self._reader.close()  # reopen next tick rather than read a broken descriptor forever
            return self._failed(ProbeStatus.error, f"{self.roots.kmsg}: {e}")
        assert self._parser is not None
        new: list[KernelEvent] = []
        for rec in records:
            new.extend(self._parser.feed(rec))
        new.extend(self._parser.end_batch())
        last = self._last
        if (not records and not new and last is not None and last.records_read == 0
                and last.cursor == prev and last.records_lost == self._reader.lost):
            # Nothing new, as last tick: the same object, equal field for field (prev_cursor
            # is the cursor), so what is built from it downstream can be reused (issue 17).
            return last
        for ev in new:
            self._ring.append(ev)
            self._counts[ev.kind.value] += 1
        self._last = KmsgObs(
            status=ProbeStatus.ok, cursor=self._reader.last_seq, prev_cursor=prev,
            records_read=len(records), records_lost=self._reader.lost, events=tuple(self._ring),
            counts=dict(self._counts), boot_wall_time=self._boot_wall,
            source=str(self.roots.kmsg), history=self._reader.history,
        )
        return self._last

    def _failed(self, status: ProbeStatus, error: str) -> KmsgObs:
        self._last = None
        return KmsgObs(status=status, error=error, source=str(self.roots.kmsg),
                       history=self._reader.history)

    def _boot_wall_time(self) -> float | None:
        """Wall time at boot, to date kernel timestamps: /proc/stat btime (whole seconds), else
        the clock (on Linux, monotonic time is time since boot, as the kernel's usec are)."""
        try:
            return float(btime(self.roots))
        except (Absent, Denied, OSError, ValueError):
            pass
        return self.clock.time() - self.clock.monotonic()
