"""A recursive inotify watch drained on the probe's tick: no thread, one read(2) per tick.

Hand-written (ctypes on libc) rather than through `watchdog`, on measurement: watchdog's observer
runs three threads that wake on every event and build an event object per event; watching a job
that writes 5 files a second cost 2.0 ms of CPU per second that way, against 0.5 ms for draining
the same inotify queue once a tick (bench/, docs/performance.md). The outputs probe needs only
"these paths changed" — its reconciliation is the source of truth — so the pairing of moves,
event objects and dispatch threads are cost without use here.

Semantics: `drain()` returns the paths that changed since the last drain (directories created
under a watched one are watched at once, and their entries are reported, since events in them
may have come before the watch); `lost` is set when the kernel queue overflowed or a watch could
not be added, so the caller reconciles. Linux only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import sys

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE, IN_OPEN = 0x2, 0x4, 0x8, 0x20
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR = 0x4000, 0x8000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000
# Events that are not about a name in a watched directory: each checked for in turn only when
# one of these bits is set (a queue of file events tests this one mask an event)
_RARE = IN_Q_OVERFLOW | IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF
# Not IN_MODIFY: one event per write(2), and a file being written is re-stat'ed every tick while
# it is hot anyway (from its creation to its close). IN_OPEN: a file closed after writing is
# left alone until it is opened again (the outputs probe), one event per open.
MASK = (IN_CLOSE_WRITE | IN_OPEN | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
        | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len
_READ_BYTES = 256 * 1024
# os.fsdecode's own steps, once: it is called for every event's name (issue 17)
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()

_libc = None


def _lib():  # -> ctypes.CDLL
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


class InotifyWatch:
    """Watches `root` and every directory under it; close() releases the fd and the watches."""

    def __init__(self, root: str, max_watches: int = 100_000) -> None:
        self.root = root
        self.max_watches = max_watches
        self.lost = False  # since the last drain: the caller must reconcile
        self.error: str | None = None  # the last watch that could not be added
        self.root_gone = False
        # Since the last drain, in order: (file, True) closed after writing, (file, False) opened.
        # An open changes nothing by itself, so it is not among drain()'s paths.
        self.closes: list[tuple[str, bool]] = []
        self._wd: dict[int, str] = {}
        # wd -> its path with a trailing "/": an event's path is this and the name (os.path.join's
        # answer for a name the kernel gave: one component, never absolute), without a call
        self._prefix: dict[int, str] = {}
        lib = _lib()
        fd = lib.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        self.fd = fd
        try:
            self._add_tree(root, report=None)
            if not self._wd:
                raise OSError(errno.ENOENT, self.error or f"cannot watch {root}")
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return self.fd >= 0 and not self.root_gone

    def _add(self, path: str) -> bool:
        if len(self._wd) >= self.max_watches:
            self.error, self.lost = f"more than {self.max_watches} directories: not all watched", True
            return False
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), MASK)
        if wd < 0:
            e = ctypes.get_errno()
            if e not in (errno.ENOENT, errno.ENOTDIR):  # gone meanwhile: nothing to watch
                self.error, self.lost = f"inotify_add_watch {path}: {os.strerror(e)}", True
            return False
        self._wd[wd] = path
        self._prefix[wd] = path if path.endswith("/") else path + "/"
        return True

    def _add_tree(self, top: str, report: list[str] | None) -> None:
        stack = [top]
        while stack:
            d = stack.pop()
            if not self._add(d):
                continue
            try:
                with os.scandir(d) as it:
                    for e in it:
                        if report is not None:
                            report.append(e.path)
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
            except OSError:
                continue  # removed or unreadable meanwhile: the reconciliation says so

    def drain(self) -> list[str]:
        """Changed paths since the last call (a path may appear twice); never blocks."""
        out: list[str] = []
        if self.fd < 0:
            return out
        while True:
            try:
                buf = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                break
            except OSError as e:
                self.error, self.lost = f"inotify read: {e.strerror or e}", True
                break
            if not buf:
                break
            self._parse(buf, out)
            if len(buf) < _READ_BYTES // 2:
                break  # the queue is empty, most likely: spare the EAGAIN round trip
        return out

    def _parse(self, buf: bytes, out: list[str]) -> None:
        off, n, size, unpack = 0, len(buf), _EVENT.size, _EVENT.unpack_from
        wds, prefixes, closes = self._wd, self._prefix, self.closes
        # (wd, the name's bytes as the kernel padded them) -> its path: a written file's
        # IN_CREATE, IN_OPEN and IN_CLOSE_WRITE come in one read, its name decoded once (issue 17)
        paths: dict[tuple[int, bytes], str] = {}
        while off + size <= n:
            wd, mask, _cookie, ln = unpack(buf, off)
            start = off + size
            off = start + ln
            if mask & _RARE or wd not in prefixes:
                if mask & IN_Q_OVERFLOW:
                    self.lost = True
                    continue
                base = wds.get(wd)
                if mask & IN_IGNORED:
                    wds.pop(wd, None)
                    prefixes.pop(wd, None)
                    if base == self.root:
                        self.root_gone = True
                    continue
                if base is None:
                    continue
                # IN_DELETE_SELF, IN_MOVE_SELF
                if base == self.root:
                    self.root_gone = True
                out.append(base)
                continue
            key = (wd, buf[start:off])
            path = paths.get(key)
            if path is None:
                raw = key[1].rstrip(b"\0")
                # "": the event is about the watched directory itself
                path = paths[key] = prefixes[wd] + raw.decode(_FS_ENCODING, _FS_ERRORS) if raw else ""
            if mask & IN_OPEN:
                if path and not mask & IN_ISDIR:
                    closes.append((path, False))
                continue
            if not path:
                path = wds[wd]
            out.append(path)
            if mask & IN_CLOSE_WRITE and not mask & IN_ISDIR:
                closes.append((path, True))
            if mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                self._add_tree(path, out)

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            try:
                os.close(fd)  # drops every watch with it
            except OSError:
                pass
        self._wd, self._prefix = {}, {}
