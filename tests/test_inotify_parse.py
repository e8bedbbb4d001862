"""InotifyWatch._parse: a name's path is built once a read (issue 17), and each event still
says what it said before: the same name in another directory is another path, an event on a
watched directory itself is that directory, opens are closes' (path, False)."""

from __future__ import annotations

import struct
from pathlib import Path

from stallwatch.probes import inotify as ino
from stallwatch.probes.inotify import InotifyWatch


def _ev(wd: int, mask: int, name: bytes = b"") -> bytes:
    padded = name + b"\0" * (-len(name) % 16 or (16 if name else 0)) if name else b""
    return struct.pack("iIII", wd, mask, 0, len(padded)) + padded


def test_names_repeated_in_one_read_keep_their_own_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    w = InotifyWatch(str(tmp_path))
    try:
        wd_root = next(wd for wd, p in w._wd.items() if p == str(tmp_path))
        wd_sub = next(wd for wd, p in w._wd.items() if p == str(tmp_path / "sub"))
        buf = b"".join([
            _ev(wd_root, ino.IN_CREATE, b"a.pt"), _ev(wd_root, ino.IN_OPEN, b"a.pt"),
            _ev(wd_sub, ino.IN_CREATE, b"a.pt"),  # the same name in another directory
            _ev(wd_root, ino.IN_CLOSE_WRITE, b"a.pt"),
            _ev(wd_root, ino.IN_OPEN | ino.IN_ISDIR),  # the directory itself, listed
            _ev(wd_sub, ino.IN_ATTRIB),  # an event on the watched directory itself
            _ev(wd_root, ino.IN_OPEN, b"b.pt"), _ev(wd_root, ino.IN_CLOSE_WRITE, b"b.pt"),
            _ev(999, ino.IN_CREATE, b"a.pt"),  # a watch already gone: nothing
        ])
        out: list[str] = []
        w._parse(buf, out)
        a, sub_a, b = str(tmp_path / "a.pt"), str(tmp_path / "sub" / "a.pt"), str(tmp_path / "b.pt")
        assert out == [a, sub_a, a, str(tmp_path / "sub"), b]
        assert w.closes == [(a, False), (a, True), (b, False), (b, True)]
        assert not w.lost and not w.root_gone
        # a second read decodes afresh: nothing is kept from one read to the next
        out2: list[str] = []
        w._parse(_ev(wd_sub, ino.IN_CLOSE_WRITE, b"a.pt") + _ev(wd_root, ino.IN_DELETE_SELF), out2)
        assert out2 == [sub_a, str(tmp_path)] and w.root_gone
    finally:
        w.close()


def test_overflow_and_ignored_in_the_same_read(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    w = InotifyWatch(str(tmp_path))
    try:
        wd_sub = next(wd for wd, p in w._wd.items() if p == str(tmp_path / "sub"))
        out: list[str] = []
        w._parse(_ev(wd_sub, ino.IN_CREATE, b"x") + _ev(wd_sub, ino.IN_IGNORED)
                 + _ev(wd_sub, ino.IN_CREATE, b"x") + _ev(-1, ino.IN_Q_OVERFLOW), out)
        assert out == [str(tmp_path / "sub" / "x")]  # the event after IN_IGNORED: its watch is gone
        assert w.lost and wd_sub not in w._wd and wd_sub not in w._prefix
    finally:
        w.close()
