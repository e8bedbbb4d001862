"""The flight recorder's file format: JSON Lines, one header then one snapshot per line.

A trace must survive the recorder being killed at any moment, so every line is written whole and
flushed, and the reader ignores a torn last line instead of refusing the whole trace.
"""

from __future__ import annotations

import gzip
import json
import platform
import socket
import time
from pathlib import Path
from typing import IO

from stallwatch import __version__
from stallwatch.errors import UsageError

FORMAT_VERSION = 1


def _open_for_writing(path: Path) -> IO[str]:
    """The trace's file, kept open while it is recorded (TraceWriter.close() closes it)."""
    if path.suffix == ".gz":  # compressed as it is written (JSON compresses about 10×)
        return gzip.open(path, "wt", encoding="utf-8")
    return open(path, "w", encoding="utf-8")


class TraceWriter:
    def __init__(self, path: Path, meta: dict | None = None) -> None:
        self.path = Path(path)
        try:
            self._f = _open_for_writing(self.path)
        except OSError as e:
            raise UsageError(f"{path}: cannot write trace: {e.strerror}") from e
        header = {
            "type": "header",
            "format": FORMAT_VERSION,
            "stallwatch": __version__,
            "host": socket.gethostname(),
            "kernel": platform.release(),
            "created_wall": time.time(),
        }
        header.update(meta or {})
        self._write(header)

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def write_snapshot(self, snap) -> None:
        self._write({"type": "snapshot", **snap.model_dump(mode="json")})

    def write_event(self, kind: str, **fields) -> None:
        """Free-form annotations (e.g. 'fault injected') that replays can print beside verdicts."""
        self._write({"type": "event", "kind": kind, **fields})

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_trace(path: Path) -> tuple[dict, list[dict], list[dict]]:
    """Return (header, snapshot dicts, event dicts). Raises UsageError on an unreadable trace."""
    p = Path(path)
    try:
        text = _read_text(p)
    except OSError as e:
        raise UsageError(f"{p}: cannot read trace: {e.strerror or e}") from e
    header: dict | None = None
    snaps: list[dict] = []
    events: list[dict] = []
    lines = text.split("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno >= len(lines) - 1:
                break  # torn last line: the recorder died mid-write
            raise UsageError(f"{p}:{lineno}:{e.colno}: not JSON: {e.msg}") from e
        t = obj.get("type")
        if t == "header":
            header = obj
        elif t == "snapshot":
            snaps.append(obj)
        elif t == "event":
            events.append(obj)
    if header is None:
        raise UsageError(f"{p}:1:1: not a stallwatch trace (no header line)")
    if header.get("format", 0) > FORMAT_VERSION:
        raise UsageError(f"{p}:1:1: trace format {header['format']} is newer than this stallwatch reads "
                         f"({FORMAT_VERSION})")
    return header, snaps, events


def _read_text(p: Path) -> str:
    if p.suffix != ".gz":
        return p.read_text(encoding="utf-8")
    chunks: list[bytes] = []
    with gzip.open(p, "rb") as g:
        try:
            while chunk := g.read(1 << 20):
                chunks.append(chunk)
        except EOFError:
            pass  # a recorder killed mid-write: keep what was flushed, the torn line is dropped
    return b"".join(chunks).decode("utf-8", "replace")
