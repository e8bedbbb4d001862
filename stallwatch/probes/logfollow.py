"""Follow one growing log file: new lines at a cost that depends on the new bytes only.

Each poll opens the file, fstats it, reads from its remembered offset (at most a chunk budget)
and closes it again. Closing every tick means a rotated or deleted log is never kept alive by us
and a mount is never held busy. The log probe (probes/log.py) and the server-log probe
(probes/server_log.py) read through it.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field

from stallwatch.kernel import safefs
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.text.bars import cursor_ups
from stallwatch.probes.text.progress import clean_line


_SEP = re.compile(rb"[\r\n]")  # tqdm redraws with \r: every redraw is a line of its own
_FINGERPRINT = 64


@dataclass
class FollowResult:
    status: ProbeStatus
    error: str | None = None
    size: int | None = None
    mtime_s: float | None = None
    ident: tuple[int, int] | None = None  # (device, inode)
    lines: list[str] = field(default_factory=list)
    # per line: (cursor-up escapes that ended it, ended by "\n"): a tqdm bar's position (bars.py)
    meta: list[tuple[int, bool]] = field(default_factory=list)
    ups: bool = False  # some line of `lines` was ended by cursor-up escapes (any meta[i][0])
    partial: str | None = None  # the unterminated last line: tqdm's newest bar sits there
    partial_ups: int = 0
    first: bool = False  # this read learned history (the file's last initial_tail_bytes)
    read_bytes: int = 0


class LogFollower:
    def __init__(
        self, path: str | os.PathLike[str], *, max_line_bytes: int = 64 * 1024,
        initial_tail_bytes: int = 1 << 20, chunk_budget_bytes: int = 2 << 20, read_size: int = 1 << 20,
        reader: tuple[int, frozenset[int]] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        # Split once: the daemon never changes its working directory, and this is every tick.
        self._parent, self._name = os.path.split(os.path.abspath(self.path))
        self._parent_parts = safefs.split_dir(self._parent)
        # (uid, gids) of the job's user: a log it could not read itself is refused, so that
        # nothing it cannot read reaches alerts and evidence through its log (security.md #5).
        self.reader = reader
        self.max_line_bytes = max_line_bytes
        self.initial_tail_bytes = initial_tail_bytes
        self.chunk_budget_bytes = chunk_budget_bytes
        self.read_size = min(read_size, chunk_budget_bytes)
        self.offset = 0
        self.ident: tuple[int, int] | None = None
        self.size = 0
        self._partial = bytearray()
        # None, or why bytes up to the next separator are discarded: "overlong" (a line past
        # max_line_bytes; its head is kept) or "cut" (the first read began mid-line).
        self._dropping: str | None = None
        self._fingerprint = b""
        self._fingerprint_end = -1  # the offset the fingerprint's bytes end at
        self._vanished = False  # seen absent after we knew it
        self.rotations = self.truncations = self.overlong_lines = 0
        self.bytes_read_total = self.lines_total = self.skipped_hole_bytes = 0
        self.skipped_backlog_bytes = 0
        # Beyond this backlog the follower jumps to the newest bytes (_catch_up).
        self.max_backlog_bytes = 4 * chunk_budget_bytes

    def poll(self) -> FollowResult:
        try:
            # The log is on the job user's side (docs/security.md): its directories resolved
            # without following a link the user could have made, the file itself never a link.
            # O_NONBLOCK: opening a FIFO put in place of the log must not wait for a writer.
            dfd = safefs.open_dir_split(self._parent, self._parent_parts)
            try:
                fd = os.open(self._name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW,
                             dir_fd=dfd)
            finally:
                os.close(dfd)
        except FileNotFoundError:
            self._vanished = self.ident is not None
            return FollowResult(ProbeStatus.absent, f"{self.path} does not exist")
        except safefs.UnsafePath as e:
            return FollowResult(ProbeStatus.denied, f"{e}")
        except PermissionError as e:
            return FollowResult(ProbeStatus.denied, f"{self.path}: {e.strerror}")
        except OSError as e:
            if e.errno == errno.ELOOP:
                return FollowResult(ProbeStatus.denied, f"{self.path} is a symlink: not followed")
            st = ProbeStatus.absent if e.errno == errno.ENOTDIR else ProbeStatus.error
            return FollowResult(st, f"{self.path}: {e.strerror or e}")
        try:
            return self._poll_fd(fd)
        except OSError as e:
            return FollowResult(ProbeStatus.error, f"{self.path}: {e.strerror or e}")
        finally:
            os.close(fd)

    def _poll_fd(self, fd: int) -> FollowResult:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        res = FollowResult(ProbeStatus.ok, size=st.st_size, mtime_s=st.st_mtime, ident=ident)
        if not stat.S_ISREG(st.st_mode):
            res.status = ProbeStatus.not_a_file
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            res.error = f"{self.path} is {kind}"
            self._vanished = self.ident is not None
            return res
        if self.reader is not None and not safefs.readable_by(st, *self.reader):
            return FollowResult(ProbeStatus.denied, f"{self.path} is a file uid {self.reader[0]} "
                                                  "(the job's user) cannot read: refused")
        budget = self.chunk_budget_bytes
        restarted = True
        if self.ident is None:
            # First sight: learn history from the tail only, whatever the file's size.
            res.first = True
            self.offset = max(0, st.st_size - self.initial_tail_bytes)
            # Starting mid-file: the first line is cut unless the byte before us ends a line.
            cut = self.offset > 0 and os.pread(fd, 1, self.offset - 1) not in (b"\n", b"\r")
            self._dropping = "cut" if cut else None
            budget = max(budget, self.initial_tail_bytes)
        elif ident != self.ident or self._vanished:
            # Renamed away and recreated, or deleted and recreated (which may reuse the inode
            # number): the new file is read from its start.
            self.rotations += 1
            self._restart()
        elif st.st_size < self.offset or not self._same_prefix(fd):
            # Truncated, or copytruncate'd and refilled past our offset before we looked.
            self.truncations += 1
            self._restart()
        else:
            restarted = False
        self.ident, self.size, self._vanished = ident, st.st_size, False
        # A hole (below) comes with a restart, or from a writer seeking past the end: where
        # neither is known, the first bytes read tell (a hole reads as NULs), and the lseek a
        # tick is spared. Before a catch-up the order stays as it was: hole first.
        hole_unknown = not restarted and st.st_size - self.offset <= self.max_backlog_bytes
        if not hole_unknown:
            self._skip_hole(fd, st.st_size)
        if not res.first:
            self._catch_up(fd, st.st_size)
        # The fingerprint is the last bytes read, when this read went on from where the last
        # one ended or read enough: no pread for it (issue 17).
        tail = self._fingerprint if self._fingerprint_end == self.offset else None
        while budget > 0 and self.offset < st.st_size:
            # What fstat says is there, not a whole read_size: a 1 MiB pread made glibc mmap a
            # fresh buffer, mremap it down and munmap it every tick for the few hundred bytes a
            # tick brings (issue 17, strace on the H200). Bytes written after the fstat are read
            # next tick.
            data = os.pread(fd, min(self.read_size, budget, st.st_size - self.offset), self.offset)
            if not data:
                break
            if hole_unknown:
                hole_unknown = False
                if data[0] == 0 and self._skip_hole(fd, st.st_size):
                    tail = None
                    continue  # read from the data after the hole
            self.offset += len(data)
            budget -= len(data)
            res.read_bytes += len(data)
            tail = (tail + data[-_FINGERPRINT:])[-_FINGERPRINT:] if tail is not None else data[-_FINGERPRINT:]
            self._feed(data, res)
        self.bytes_read_total += res.read_bytes
        self.lines_total += len(res.lines)
        if res.read_bytes:
            n = min(_FINGERPRINT, self.offset)
            if tail is None or len(tail) < n:  # a jump, then fewer bytes than a fingerprint
                tail = os.pread(fd, n, self.offset - n)
            self._fingerprint, self._fingerprint_end = tail, self.offset
        if self._partial and self._dropping is None:
            raw = self._partial.decode("utf-8", "replace")
            res.partial = clean_line(raw) or None
            res.partial_ups = cursor_ups(raw)
        return res

    def _restart(self) -> None:
        self.offset = 0
        self._partial.clear()
        self._dropping = None
        self._fingerprint, self._fingerprint_end = b"", 0

    def _same_prefix(self, fd: int) -> bool:
        """The bytes just before our offset are still those we read: one small pread a tick."""
        n = len(self._fingerprint)
        return n == 0 or os.pread(fd, n, self.offset - n) == self._fingerprint

    def _catch_up(self, fd: int, size: int) -> None:
        # A log growing faster than a tick's budget is read (a debug flood: parsing costs ~0.1 s
        # of CPU per MiB of tqdm redraws, so the budget is 2 MiB a tick) would leave us further
        # behind every tick, and a stall would show only once the backlog drained, hours later.
        # Jump to the newest bytes instead; what is jumped over is counted, never parsed.
        if size - self.offset <= self.max_backlog_bytes:
            return
        new = size - self.chunk_budget_bytes
        self.skipped_backlog_bytes += new - self.offset
        self.offset = new
        self._partial.clear()
        self._dropping = "cut" if os.pread(fd, 1, new - 1) not in (b"\n", b"\r") else None

    def _skip_hole(self, fd: int, size: int) -> bool:
        """True when the offset moved past a hole."""
        # A writer without O_APPEND keeps its offset across copytruncate and leaves a hole of
        # NULs up to it; SEEK_DATA jumps over it instead of reading gigabytes of zeros.
        if self.offset >= size:
            return False
        try:
            nxt = os.lseek(fd, self.offset, os.SEEK_DATA)
        except OSError:  # ENXIO: only hole up to EOF; EINVAL: not supported here
            return False
        if nxt > self.offset:
            self.skipped_hole_bytes += nxt - self.offset
            self.offset = nxt
            self._partial.clear()
            return True
        return False

    def _feed(self, data: bytes, res: FollowResult) -> None:
        # One kind of separator (tqdm's redraws: "\r" only; a plain log: "\n" only): split in C,
        # and a whole printable line without escapes taken as it is (clean_line would only strip
        # it), not through _end_line, _emit and clean_line (issue 17: ~5 redraws a tick).
        newline = b"\n" in data
        if newline and b"\r" in data:
            self._feed_mixed(data, res)
            return
        pieces = data.split(b"\n" if newline else b"\r")
        rest = pieces.pop()
        lines, meta, limit = res.lines, res.meta, self.max_line_bytes
        for piece in pieces:
            if self._dropping is not None or self._partial or len(piece) > limit:
                self._end_line(piece, res, newline)
            elif piece:
                raw = piece.decode("utf-8", "replace")
                if "\x1b" in raw or not raw.isprintable():
                    self._emit(raw, res, newline)
                elif line := raw.rstrip():
                    lines.append(line)
                    meta.append((0, newline))
        self._grow_partial(rest)

    def _feed_mixed(self, data: bytes, res: FollowResult) -> None:
        """_feed for any bytes: each line through _end_line (tests hold _feed to it)."""
        pos = 0
        for m in _SEP.finditer(data):
            self._end_line(data[pos : m.start()], res, m.group() == b"\n")
            pos = m.end()
        self._grow_partial(data[pos:])

    def _grow_partial(self, piece: bytes) -> None:
        if self._dropping or not piece:
            return
        room = self.max_line_bytes - len(self._partial)
        self._partial += piece[:room]
        if len(piece) > room:
            self._dropping = "overlong"  # keep the head, discard the rest until a separator
            self.overlong_lines += 1

    def _end_line(self, piece: bytes, res: FollowResult, newline: bool) -> None:
        if self._dropping is None and not self._partial and len(piece) <= self.max_line_bytes:
            # a whole line in this read (most): decoded as it is, not through the partial buffer
            if piece:
                self._emit(piece.decode("utf-8", "replace"), res, newline)
            return
        if self._dropping == "cut":
            self._dropping = None
            return
        if self._dropping is None:
            self._grow_partial(piece)
        self._dropping = None
        if self._partial:
            raw = self._partial.decode("utf-8", "replace")
            self._partial.clear()
            self._emit(raw, res, newline)

    def _emit(self, raw: str, res: FollowResult, newline: bool) -> None:
        line = clean_line(raw)
        if line:
            ups = cursor_ups(raw) if "\x1b" in raw else 0
            res.lines.append(line)
            res.meta.append((ups, newline))
            if ups:
                res.ups = True
