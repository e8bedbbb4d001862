"""Where things are in a TOML file.

tomllib gives positions only for syntax errors, yet a rule author needs `file:line:column` for
every semantic error too (a bad duration, an unknown kind, a typo inside a condition). This is a
position-only scanner run after tomllib accepted the file: it maps each key path, e.g.
("rule", 2, "evidence", 0, "detail"), to where its key and its value start, and can map a
character offset inside a string value back to the file, escapes and multi-line strings included.
It never decides what a value is; tomllib does that.
"""

from __future__ import annotations

import re
import tomllib
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallwatch.model import Frozen

__all__ = ["Located", "Positions", "load_toml"]

Path_ = tuple[str | int, ...]


class Located(Frozen):
    """One problem at one place; line and column are 1-based, 0 when the place is unknown."""

    file: str
    line: int = 0
    column: int = 0
    message: str

    def __str__(self) -> str:
        if self.line <= 0:
            return f"{self.file}: {self.message}"
        return f"{self.file}:{self.line}:{self.column}: {self.message}"


@dataclass(slots=True)
class _Entry:
    key: int    # offset of the key (or the table header's '[')
    value: int  # offset of the value (same as key for tables)
    end: int = -1  # end of a string value's raw token, -1 otherwise


_BARE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {"b", "t", "n", "f", "r", '"', "\\", "e"}


@dataclass
class Positions:
    """Key paths of one TOML document mapped to offsets; built by `scan`."""

    source: str
    entries: dict[Path_, _Entry] = field(default_factory=dict)
    _lines: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lines = [0] + [m.end() for m in re.finditer(r"\n", self.source)]

    def line_col(self, offset: int) -> tuple[int, int]:
        i = bisect_right(self._lines, offset) - 1
        return i + 1, offset - self._lines[i] + 1

    def _nearest(self, path: Path_) -> _Entry | None:
        while path:
            if path in self.entries:
                return self.entries[path]
            path = path[:-1]
        return None

    def key(self, path: Path_) -> tuple[int, int]:
        """Position of the key at path (or of its nearest enclosing table)."""
        e = self._nearest(path)
        return self.line_col(e.key) if e else (1, 1)

    def value(self, path: Path_) -> tuple[int, int]:
        e = self._nearest(path)
        return self.line_col(e.value) if e else (1, 1)

    def in_string(self, path: Path_, index: int) -> tuple[int, int]:
        """Position of character `index` of the decoded string value at path."""
        e = self.entries.get(path)
        if e is None or e.end < 0:
            return self.value(path)
        offsets = _decoded_offsets(self.source, e.value, e.end)
        if not offsets:
            return self.line_col(e.value)
        return self.line_col(offsets[min(index, len(offsets) - 1)])


def _decoded_offsets(src: str, start: int, end: int) -> list[int]:
    """For each character of the decoded string token src[start:end], its offset in src.

    One extra entry at the end points at the closing quote, so an error at end-of-input lands
    on the quote.
    """
    quote = src[start : start + 3] if src[start : start + 3] in ('"""', "'''") else src[start]
    i, stop = start + len(quote), end - len(quote)
    basic = quote[0] == '"'
    if len(quote) == 3 and src.startswith("\r\n", i):
        i += 2
    elif len(quote) == 3 and src.startswith("\n", i):
        i += 1
    out: list[int] = []
    while i < stop:
        c = src[i]
        if basic and c == "\\":
            nxt = src[i + 1] if i + 1 < stop else ""
            if nxt in _ESCAPES:
                out.append(i)
                i += 2
            elif nxt in "uU" or nxt == "x":
                out.append(i)
                i += 2 + {"u": 4, "U": 8, "x": 2}[nxt]
            else:  # line-ending backslash: swallow whitespace and newlines
                i += 1
                while i < stop and src[i] in " \t\r\n":
                    i += 1
            continue
        out.append(i)
        i += 1
    out.append(stop)
    return out


class _Scanner:
    """Walks a TOML document that tomllib already accepted; records offsets, skips values."""

    def __init__(self, source: str) -> None:
        self.s = source
        self.i = 0
        self.pos = Positions(source)
        self.arrays: dict[Path_, int] = {}  # array-of-tables path -> elements seen

    def run(self) -> Positions:
        table: Path_ = ()
        while self._skip(newlines=True) < len(self.s):
            if self.s[self.i] == "[":
                table = self._header()
            else:
                self._keyval(table)
        return self.pos

    def _skip(self, newlines: bool) -> int:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                while self.i < len(s) and s[self.i] != "\n":
                    self.i += 1
            else:
                break
        return self.i

    def _keys(self) -> list[tuple[str, int]]:
        keys = []
        while True:
            self._skip(False)
            start = self.i
            if self.s[self.i] in "\"'":
                end = self._string_end(self.i)
                keys.append((tomllib.loads(f"k = {self.s[start:end]}")["k"], start))
                self.i = end
            else:
                m = _BARE.match(self.s, self.i)
                assert m, "scanner out of sync with tomllib"
                keys.append((m.group(), start))
                self.i = m.end()
            self._skip(False)
            if self.i < len(self.s) and self.s[self.i] == ".":
                self.i += 1
                continue
            return keys

    def _header(self) -> Path_:
        start = self.i
        is_array = self.s.startswith("[[", self.i)
        self.i += 2 if is_array else 1
        keys = [k for k, _ in self._keys()]
        self.i += 2 if is_array else 1
        path: Path_ = ()
        for n, k in enumerate(keys):
            path += (k,)
            if is_array and n == len(keys) - 1:
                count = self.arrays.get(path, 0)
                self.arrays[path] = count + 1
                path += (count,)
            elif path in self.arrays:
                path += (self.arrays[path] - 1,)
        self.pos.entries[path] = _Entry(start, start)
        return path

    def _keyval(self, table: Path_) -> None:
        keys = self._keys()
        path = table + tuple(k for k, _ in keys)
        self.i += 1  # '='
        self._skip(False)
        self._value(path, keys[-1][1])

    def _value(self, path: Path_, key_offset: int) -> None:
        s, start = self.s, self.i
        entry = _Entry(key_offset, start)
        self.pos.entries[path] = entry
        c = s[start]
        if c in "\"'":
            self.i = entry.end = self._string_end(start)
        elif c == "[":
            self.i += 1
            n = 0
            while self._skip(True) < len(s) and s[self.i] != "]":
                self._value(path + (n,), self.i)
                n += 1
                self._skip(True)
                if s[self.i] == ",":
                    self.i += 1
            self.i += 1
        elif c == "{":
            self.i += 1
            while self._skip(True) < len(s) and s[self.i] != "}":
                keys = self._keys()
                self.i += 1  # '='
                self._skip(False)
                self._value(path + tuple(k for k, _ in keys), keys[-1][1])
                self._skip(True)
                if s[self.i] == ",":
                    self.i += 1
            self.i += 1
        else:  # number, bool, date: up to a delimiter (dates may contain one space)
            while self.i < len(s) and s[self.i] not in ",]}#\r\n":
                self.i += 1

    def _string_end(self, start: int) -> int:
        s = self.s
        quote = s[start : start + 3] if s[start : start + 3] in ('"""', "'''") else s[start]
        i = start + len(quote)
        while True:
            if quote[0] == '"' and s[i] == "\\":
                i += 2
            elif s.startswith(quote, i):
                # A multi-line string may end with up to two extra quote characters.
                end = i + len(quote)
                while len(quote) == 3 and end < len(s) and s[end] == quote[0] and end - i < 5:
                    end += 1
                return end
            else:
                i += 1


def scan(source: str) -> Positions:
    return _Scanner(source).run()


_TOML_POS = re.compile(r"\(at line (\d+), column (\d+)\)")


def load_toml(path: Path, display: str
              ) -> tuple[dict[str, Any] | None, Positions | None, list[Located]]:
    """Read and parse one file; problems come back as Located values, never raised."""
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, None, [Located(file=display, message=f"cannot read: {exc}")]
    try:
        data = tomllib.loads(source)
    except tomllib.TOMLDecodeError as exc:
        text = str(exc)
        m = _TOML_POS.search(text)
        if m:
            line, col = int(m.group(1)), int(m.group(2))
        elif "(at end of document)" in text:
            lines = source.split("\n")
            line, col = len(lines), len(lines[-1]) + 1
        else:
            line, col = 0, 0
        message = _TOML_POS.sub("", text).replace("(at end of document)", "at end of file").strip()
        return None, None, [Located(file=display, line=line, column=col,
                                    message=f"TOML syntax: {message}")]
    return data, scan(source), []
