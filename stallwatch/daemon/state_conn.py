"""The state database's connection, with a way out when the file cannot be written (see `_Conn`).

Split from daemon/state.py, which opens it and runs every statement through it.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Any

log = logging.getLogger("stallwatch.daemon.state")

# A write that fails with one of these is the file's trouble, not the statement's: the disk is
# full, another process holds the write lock, the filesystem went read-only or failed.
_DEGRADING = ("full", "locked", "busy", "disk i/o", "readonly", "read-only", "unable to open")


def _degrading(e: BaseException) -> bool:
    return isinstance(e, sqlite3.OperationalError) and any(w in str(e).lower() for w in _DEGRADING)


class _Conn:
    """The database connection, with a way out when the file cannot be written.

    A watchdog must keep watching when its own state cannot be saved (a full disk, a lock held by
    another process, a filesystem gone read-only). On the first write that fails for such a
    reason, the committed state is copied into an in-memory database, the transaction under way
    is replayed there, and the daemon goes on from memory (`degraded` says why). `write_back`
    copies the memory back to the file once it can be written, and the file is used again.
    """

    def __init__(self, file_conn: sqlite3.Connection) -> None:
        self.file = file_conn
        self.active = file_conn
        self.mem: sqlite3.Connection | None = None
        self.degraded: str | None = None
        self.degraded_wall: float | None = None
        self._stmts: list[tuple[str, tuple]] | None = None  # the current transaction's writes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.active, name)

    def execute(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        head = sql.lstrip()[:8].upper()
        try:
            cur = self.active.execute(sql, args)
        except sqlite3.OperationalError as e:
            if self.active is not self.file or not _degrading(e):
                raise
            self.degrade(e)
            if not head.startswith("BEGIN") and self._stmts is not None:
                self.active.execute("BEGIN IMMEDIATE")
                for s, a in self._stmts:
                    self.active.execute(s, a)
            cur = self.active.execute(sql, args)
        if head.startswith("BEGIN"):
            self._stmts = []
        elif head.startswith(("COMMIT", "ROLLBACK")):
            self._stmts = None
        elif self._stmts is not None and not head.startswith("SELECT"):
            self._stmts.append((sql, tuple(args)))
        return cur

    def degrade(self, e: BaseException) -> None:
        """Go on from an in-memory copy of what the file holds (committed transactions only)."""
        try:
            if self.file.in_transaction:
                self.file.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        mem = sqlite3.connect(":memory:", isolation_level=None)
        try:
            self.file.backup(mem)
        except sqlite3.Error:
            mem.close()
            raise e from None
        mem.execute("PRAGMA foreign_keys=ON")
        self.mem, self.active = mem, mem
        self.degraded, self.degraded_wall = f"{type(e).__name__}: {e}", time.time()
        log.error("state database cannot be written (%s): the state is kept in memory and the "
                  "watch goes on; it is written back when the file can be written again "
                  "(a daemon restart before then loses what happened since)", self.degraded)

    def write_back(self) -> bool:
        """Copy the in-memory state to the file; True when the file is in use again."""
        if self.mem is None:
            return True
        if self.mem.in_transaction:
            return False
        # sqlite3's backup() waits as long as another process holds the lock: ask first, without
        # waiting, so a tick never blocks on it.
        try:
            timeout = self.file.execute("PRAGMA busy_timeout").fetchone()[0]
            self.file.execute("PRAGMA busy_timeout=0")
            try:
                self.file.execute("BEGIN IMMEDIATE")
                self.file.execute("ROLLBACK")
            finally:
                self.file.execute(f"PRAGMA busy_timeout={int(timeout)}")
            self.mem.backup(self.file)
        except sqlite3.Error as e:
            log.debug("state database still cannot be written: %s", e)
            return False
        since = time.time() - (self.degraded_wall or time.time())
        log.warning("state database writable again: %.0f s of state kept in memory written back "
                    "(it was: %s)", since, self.degraded)
        self.mem.close()
        self.mem, self.active, self.degraded, self.degraded_wall = None, self.file, None, None
        return True

    def close(self) -> None:
        if self.mem is not None:
            self.write_back()
        if self.mem is not None:
            self.mem.close()
        self.file.close()
