"""The daemon's memory: SQLite in WAL mode in the state directory.

What it must survive: a daemon killed with SIGKILL at any instant, then started again. So
- every change is one transaction (sqlite's journal makes it all or nothing);
- an action with a side effect outside the database (start a process, kill one, move a file)
  is recorded as an *intent* first (`actions.outcome = 'pending'`), done, then completed in a
  second transaction. On start-up `pending` intents are reconciled with reality (is there a
  process for that restart? then it happened; else it did not) — so a restart is counted exactly
  once, in the transaction that completes it;
- a process is identified by (pid, start_ticks), never by pid alone: a reused pid is a stranger;
- the rows every tick rewrites (a job's verdict, the last tick) are held and go out in the
  tick's one transaction (`held`, `update_job_later`, `set_metas_later`): a SIGKILL mid-tick
  loses that tick's, and the restarted daemon resumes from the tick before.

WAL lets `stallwatch status` read while the daemon writes. synchronous=NORMAL: in WAL mode that
is durable against a crash of the process (SIGKILL); only a power loss may lose the last
transactions, never corrupt the file.

Tables (schema version 1):
    meta(key, value)                      daemon pid, start, last tick, config path, boot id
    jobs(name, ...)                       one row per configured job: phase, restarts, verdict,
                                          current pid + start_ticks, kmsg cursor
    runs(id, job, seq, ...)               each process stallwatch started (wrapper and job) or
                                          attached to, with pid + start_ticks, exit status
    incidents(id, job, kind, episode,...) one per job+kind episode; verdict JSON, evidence bundle
    actions(id, incident_id, job, what, attempt, at, outcome, detail, done_at)
    alert_events(id, incident_id, job, kind, state, at, summary, event_json)
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import stat
import time
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping

from stallwatch.daemon.state_conn import _Conn, _degrading
from stallwatch.errors import UsageError

DB_NAME = "stallwatch.db"
SCHEMA_VERSION = 1

log = logging.getLogger("stallwatch.daemon.state")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT
);
CREATE TABLE IF NOT EXISTS jobs (
    name          TEXT PRIMARY KEY,
    mode          TEXT NOT NULL,              -- command | pid_file | match
    config_json   TEXT NOT NULL,
    phase         TEXT NOT NULL DEFAULT 'new',
    phase_detail  TEXT NOT NULL DEFAULT '',
    restarts      INTEGER NOT NULL DEFAULT 0, -- completed restarts (intents do not count)
    starts        INTEGER NOT NULL DEFAULT 0, -- spawns so far: numbers status files and units
    recovery_incident INTEGER,                -- the incident a recovery in progress serves
    verdict_json  TEXT,
    verdict_at    REAL,
    pid           INTEGER,                    -- the job's main process now, with its identity
    start_ticks   INTEGER,
    kmsg_cursor   INTEGER,
    kmsg_boot_id  TEXT,
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id            INTEGER PRIMARY KEY,
    job           TEXT NOT NULL,
    seq           INTEGER NOT NULL,           -- jobs.starts at spawn time; 0 for attached
    how           TEXT NOT NULL,              -- setsid | systemd-run | attached
    pid           INTEGER,                    -- the job's process (the wrapper's child)
    start_ticks   INTEGER,
    pgid          INTEGER,
    wrapper_pid   INTEGER,
    wrapper_start_ticks INTEGER,
    status_file   TEXT,
    unit          TEXT,
    started_at    REAL NOT NULL,
    ended_at      REAL,
    returncode    INTEGER,                    -- negative: killed by that signal
    end_reason    TEXT
);
CREATE INDEX IF NOT EXISTS runs_job ON runs(job, id);
CREATE TABLE IF NOT EXISTS incidents (
    id            INTEGER PRIMARY KEY,
    job           TEXT NOT NULL,
    kind          TEXT NOT NULL,
    episode       INTEGER NOT NULL,           -- earlier incidents of this job and kind
    state         TEXT NOT NULL DEFAULT 'open', -- open | resolved
    started_at    REAL NOT NULL,
    resolved_at   REAL,
    summary       TEXT NOT NULL DEFAULT '',
    verdict_json  TEXT NOT NULL,
    evidence_bundle TEXT,
    note          TEXT NOT NULL DEFAULT ''    -- e.g. "unkillable: pid 123 in D, wchan ...; resume waits"
);
CREATE INDEX IF NOT EXISTS incidents_job ON incidents(job, state);
CREATE TABLE IF NOT EXISTS actions (
    id            INTEGER PRIMARY KEY,
    incident_id   INTEGER,
    job           TEXT NOT NULL,
    what          TEXT NOT NULL,              -- evidence | kill | wait | validate | restart | give_up | alert ...
    attempt       INTEGER,
    at            REAL NOT NULL,
    outcome       TEXT NOT NULL,              -- 'pending' while an intent; then what happened
    detail        TEXT NOT NULL DEFAULT '',
    done_at       REAL
);
CREATE INDEX IF NOT EXISTS actions_incident ON actions(incident_id);
CREATE TABLE IF NOT EXISTS alert_events (
    id            INTEGER PRIMARY KEY,
    incident_id   INTEGER,
    job           TEXT NOT NULL,
    kind          TEXT NOT NULL,
    state         TEXT NOT NULL,              -- firing | resolved
    at            REAL NOT NULL,
    summary       TEXT NOT NULL,
    event_json    TEXT NOT NULL
);
"""


_SET_META = ("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) "
             "DO UPDATE SET value = excluded.value")


@functools.lru_cache(maxsize=64)
def _update_sql(cols: tuple[str, ...]) -> str:
    """The UPDATE of a job row's `cols` (made once per set of columns: the tick's is the same)."""
    return f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in cols)} WHERE name = ?"


@functools.lru_cache(maxsize=64)
def _set_metas_sql(n: int) -> str:
    """The upsert of `n` meta rows in one statement."""
    return (f"INSERT INTO meta(key, value) VALUES {', '.join(['(?, ?)'] * n)} "
            f"ON CONFLICT(key) DO UPDATE SET value = excluded.value")


class _Holding:
    """`StateDB.held()`: a counter, not a generator (one context manager a tick, kept)."""

    __slots__ = ("db",)

    def __init__(self, db: StateDB) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db._holding += 1

    def __exit__(self, *exc: object) -> None:
        self.db._holding -= 1


def _inserted_id(cur: sqlite3.Cursor) -> int:
    if cur.lastrowid is None:  # sqlite3 sets it after every INSERT
        raise RuntimeError("sqlite3 reported no row id for an INSERT")
    return cur.lastrowid


def _row(cur: sqlite3.Cursor, row: tuple) -> dict[str, Any]:
    return {d[0]: v for d, v in zip(cur.description, row, strict=True)}


class StateDB:
    """One connection, used from one thread (the daemon's loop, or `status`)."""

    def __init__(self, conn: sqlite3.Connection, path: Path, clock=time) -> None:
        self.conn = conn if isinstance(conn, _Conn) else _Conn(conn)
        self.path = path
        self._clock = clock
        self._depth = 0
        # Writes held for the tick's one transaction (`held`, `update_job_later`,
        # `set_metas_later`): job name -> columns, meta key -> value; the latest value wins.
        self._holding = 0
        self._holding_ctx = _Holding(self)
        self._held_jobs: dict[str, dict[str, Any]] = {}
        self._held_meta: dict[str, str | None] = {}
        # Transactions committed by `tx` (every write but the held rows' flush): what was read
        # of a phase, a restart count or a restart streak still holds while it is the same, for
        # those are never held (metrics_export.py reads them so, not by a query a tick).
        self.commits = 0

    # ------------------------------------------------------------------------------ opening

    @classmethod
    def open(cls, state_dir: str | os.PathLike[str], *, clock=time,
             busy_timeout_s: float = 10.0) -> StateDB:
        """Create the state dir (0700) and the database (0600) if needed; migrate; WAL.

        A database that is not one (garbage bytes, a failed integrity check) is set aside as
        `stallwatch.db.corrupt-<time>` and a fresh one is started: the watch goes on, and the
        meta row `state_reset` says what happened. A file that cannot be written (full disk,
        locked by another process) is used from an in-memory copy (see `_Conn`).
        """
        d = Path(state_dir)
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.stat()
            if stat.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.geteuid():
                os.chmod(d, 0o700)
                st = d.stat()
        except OSError as e:
            raise UsageError(f"state_dir {d}: cannot create or use it: {e.strerror or e}") from None
        if stat.S_IMODE(st.st_mode) & 0o022 or st.st_uid not in (os.geteuid(), 0):
            # Whoever can write here can plant a database naming processes for the daemon to
            # signal, or status files it trusts: refused, not used.
            raise UsageError(f"state_dir {d}: owned by uid {st.st_uid} with mode "
                             f"{stat.S_IMODE(st.st_mode):04o}; it must be ours and writable by "
                             f"nobody else (chown it, chmod 0700)")
        path = d / DB_NAME
        try:
            pst = path.lstat()
        except FileNotFoundError:
            pst = None
        if pst is not None and (not stat.S_ISREG(pst.st_mode) or pst.st_uid not in (os.geteuid(), 0)):
            raise UsageError(f"{path}: not a regular file of ours (uid {pst.st_uid}): refused")
        reset: str | None = None
        for attempt in (1, 2):
            conn = cls._connect(path, busy_timeout_s)
            try:
                cls._check(conn)
                break
            except sqlite3.OperationalError as e:
                if not _degrading(e):
                    conn.close()
                    raise UsageError(f"{path}: cannot use the state database: {e}") from None
                break  # usable for reading; the writes below go to memory
            except sqlite3.DatabaseError as e:
                conn.close()
                if attempt == 2:
                    raise UsageError(f"{path}: cannot use the state database: {e}") from None
                aside = path.with_name(f"{DB_NAME}.corrupt-{int(time.time())}")
                for suffix in ("", "-wal", "-shm"):
                    try:
                        os.replace(str(path) + suffix, str(aside) + suffix)
                    except FileNotFoundError:
                        pass
                    except OSError as oe:
                        raise UsageError(f"{path}: corrupt ({e}), and it cannot be set aside: "
                                         f"{oe.strerror or oe}") from None
                reset = f"{path} was corrupt ({e}): set aside as {aside}; started afresh"
                log.error("state database %s", reset)
        db = cls(conn, path, clock)
        try:
            db.conn.executescript(_SCHEMA)
        except sqlite3.OperationalError as e:
            if not _degrading(e):
                raise UsageError(f"{path}: cannot use the state database: {e}") from None
            try:
                db.conn.degrade(e)
            except sqlite3.Error as e2:
                raise UsageError(f"{path}: cannot use the state database: {e2}") from None
            db.conn.active.executescript(_SCHEMA)
        for suffix in ("-wal", "-shm"):
            try:
                os.chmod(str(path) + suffix, 0o600)
            except OSError:
                pass
        with db.tx():
            v = db.get_meta("schema_version")
            if v is None:
                db.set_meta("schema_version", str(SCHEMA_VERSION))
            elif int(v) > SCHEMA_VERSION:
                raise UsageError(f"{path}: written by a newer stallwatch (schema {v}); "
                                 f"this one knows {SCHEMA_VERSION}")
            if reset:
                db.set_meta("state_reset", f"{time.time():.3f} {reset}")
        return db

    @staticmethod
    def _connect(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
        old_umask = os.umask(0o077)
        try:
            conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
        except sqlite3.Error as e:
            raise UsageError(f"{path}: cannot open the state database: {e}") from None
        finally:
            os.umask(old_umask)
        try:
            os.chmod(path, 0o600)
        except OSError:
            pass
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        return conn

    @staticmethod
    def _check(conn: sqlite3.Connection) -> None:
        """Raises DatabaseError for a file that is not a sound database."""
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        row = conn.execute("PRAGMA quick_check").fetchone()
        if not row or row[0] != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {row[0] if row else '?'}")

    @classmethod
    def open_readonly(cls, state_dir: str | os.PathLike[str]) -> StateDB:
        """For `status`: never creates anything; works while the daemon writes (WAL)."""
        path = Path(state_dir) / DB_NAME
        if not path.exists():
            raise UsageError(f"{path}: no state database (has `stallwatch run` run with this "
                             f"state_dir?)")
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0,
                                   isolation_level=None)
            conn.execute("PRAGMA busy_timeout=10000")
            conn.execute("SELECT 1 FROM meta LIMIT 1")
        except sqlite3.Error as e:
            raise UsageError(f"{path}: cannot read the state database: {e}") from None
        return cls(conn, path)

    def close(self) -> None:
        try:
            self.flush()
        except sqlite3.Error as e:  # closing: what the last tick held is lost, as on a crash
            log.warning("state database: the last tick's rows cannot be written: %s", e)
        self.conn.close()

    @property
    def degraded(self) -> str | None:
        """Why the state is kept in memory (the file cannot be written), or None."""
        return self.conn.degraded

    def write_back(self) -> bool:
        """Try to write the in-memory state back to the file; True when the file is in use."""
        return self.conn.write_back()

    # --------------------------------------------------------------------------- transactions

    @contextmanager
    def tx(self) -> Iterator[_Conn]:
        """One transaction; nested uses join the outer one."""
        if self._depth:
            self._depth += 1
            try:
                yield self.conn
            finally:
                self._depth -= 1
            return
        self.conn.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            self._write_held(self.conn)  # first: every write after them is newer
            yield self.conn
        except BaseException:
            self._depth = 0
            self._rollback()
            raise
        self._depth = 0
        try:
            self.conn.execute("COMMIT")
        except BaseException:
            self._rollback()  # never leave a transaction open: every later BEGIN would fail
            raise
        self.commits += 1
        # Committed with it (nothing is held while a transaction is open: see `_hold`).
        self._held_jobs.clear()
        self._held_meta.clear()

    # ------------------------------------------------------------------------- held writes
    # At a 1 s cadence each SQLite transaction is cold memory (the library, its page cache, the
    # WAL): the rows a tick rewrites every time (the job's verdict, the daemon's last tick) are
    # held and written in the tick's one transaction, with whatever else the tick wrote. Held
    # rows go out with the next transaction of any kind, first in it, so a later write of the
    # same column wins; a failed transaction keeps them for the next. Reads of this connection
    # see them at once (`job`, `jobs`, `get_meta`, `meta`); other connections (`status`) when
    # the tick ends. Only rows a crash may lose one tick of are held: an intent, an incident or
    # a phase is written at once, as before.

    def held(self) -> _Holding:
        """`with db.held():` inside, the `*_later` writes are held: the next transaction, or
        `flush`, writes them."""
        return self._holding_ctx

    def flush(self) -> None:
        """Write the held rows now, in one transaction (none when nothing is held).

        The tick's own path, once a tick: straight to the connection in use, without `tx` and
        `_Conn`'s statement log (each frame more is cold memory at 1 s). A write the file
        refuses (full disk, a lock) moves the state to memory (`_Conn.degrade`) and the rows,
        still held until the COMMIT, are written there."""
        if self._depth or not (self._held_jobs or self._held_meta):
            return
        conn = self.conn
        try:
            self._write_held_tx(conn.active)
        except sqlite3.OperationalError as e:
            if conn.active is not conn.file or not _degrading(e):
                raise
            conn.degrade(e)
            self._write_held_tx(conn.active)
        self._held_jobs.clear()
        self._held_meta.clear()

    def _write_held_tx(self, c: sqlite3.Connection) -> None:
        c.execute("BEGIN IMMEDIATE")
        try:
            self._write_held(c)
            c.execute("COMMIT")
        except BaseException:
            try:
                if c.in_transaction:
                    c.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise

    def _hold(self) -> bool:
        """True when a `*_later` write is to be held; else it is written at once (outside a
        `held` block, or inside an open transaction, which it joins)."""
        return self._holding > 0 and not self._depth

    def _write_held(self, c: Any) -> None:
        for name, fields in self._held_jobs.items():
            c.execute(_update_sql(tuple(fields)), (*fields.values(), name))
        if self._held_meta:  # one statement for them all: each is another trip into sqlite
            c.execute(_set_metas_sql(len(self._held_meta)),
                      tuple(chain.from_iterable(self._held_meta.items())))

    def _rollback(self) -> None:
        try:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def _q(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        cur = self.conn.execute(sql, args)
        return [_row(cur, r) for r in cur.fetchall()]

    def _the_one(self, sql: str, args: tuple = ()) -> dict[str, Any]:
        """The row a query must find (an aggregate, a row this transaction just wrote)."""
        row = self._one(sql, args)
        if row is None:
            raise LookupError(f"no row for {sql!r} {args!r}")
        return row

    def _one(self, sql: str, args: tuple = ()) -> dict[str, Any] | None:
        rows = self._q(sql, args)
        return rows[0] if rows else None

    def now(self) -> float:
        return self._clock.time()

    # ------------------------------------------------------------------------------------ meta

    def get_meta(self, key: str) -> str | None:
        if key in self._held_meta:
            return self._held_meta[key]
        r = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        return r["value"] if r else None

    def set_meta(self, key: str, value: Any) -> None:
        if not isinstance(value, str) and value is not None:
            value = json.dumps(value)
        with self.tx():
            self.conn.execute(_SET_META, (key, value))

    def set_metas(self, rows: Mapping[str, str | None]) -> None:
        """Several meta rows in one transaction (the daemon's per-tick rows). One execute a row:
        the connection records each for its in-memory fallback (state_conn.py)."""
        with self.tx():
            for key, value in rows.items():
                self.conn.execute(_SET_META, (key, value))

    def set_metas_later(self, rows: Mapping[str, str | None]) -> None:
        """`set_metas`, held for the tick's transaction inside `held` (see there)."""
        if self._hold():
            self._held_meta.update(rows)
        else:
            self.set_metas(rows)

    def delete_meta(self, *keys: str) -> None:
        with self.tx():
            self.conn.execute(f"DELETE FROM meta WHERE key IN ({', '.join('?' * len(keys))})",
                              keys)

    def meta(self) -> dict[str, str]:
        out = {r["key"]: r["value"] for r in self._q("SELECT key, value FROM meta")}
        out.update(self._held_meta)
        return out

    # ------------------------------------------------------------------------------------ jobs

    def ensure_job(self, name: str, mode: str, config_json: str) -> dict[str, Any]:
        now = self.now()
        with self.tx():
            self.conn.execute(
                "INSERT INTO jobs(name, mode, config_json, created_at, updated_at) "
                "VALUES(?, ?, ?, ?, ?) ON CONFLICT(name) DO NOTHING",
                (name, mode, config_json, now, now))
        return self.existing_job(name)

    def job(self, name: str) -> dict[str, Any] | None:
        row = self._one("SELECT * FROM jobs WHERE name = ?", (name,))
        return self._with_held(row)

    def existing_job(self, name: str) -> dict[str, Any]:
        """The row of a job known to be there (ensure_job made it); LookupError if it is not."""
        return self._with_held(self._the_one("SELECT * FROM jobs WHERE name = ?", (name,)))

    def jobs(self) -> list[dict[str, Any]]:
        return [self._with_held(r) for r in self._q("SELECT * FROM jobs ORDER BY created_at, name")]

    def _with_held(self, row: Any) -> Any:
        held = self._held_jobs.get(row["name"]) if row is not None else None
        return {**row, **held} if held else row

    def update_job(self, name: str, **fields: Any) -> None:
        if not fields:
            return
        fields["updated_at"] = self.now()
        with self.tx():
            self._update_job_now(name, fields)

    def update_job_later(self, name: str, **fields: Any) -> None:
        """`update_job`, held for the tick's transaction inside `held` (see there)."""
        if not self._hold():
            self.update_job(name, **fields)
            return
        fields["updated_at"] = self.now()
        self._held_jobs.setdefault(name, {}).update(fields)

    def _update_job_now(self, name: str, fields: Mapping[str, Any]) -> None:
        self.conn.execute(_update_sql(tuple(fields)), (*fields.values(), name))

    def next_seq(self, name: str) -> int:
        """Reserve the next spawn number (status file and unit name) — its own transaction, so a
        number is never reused even when the spawn that took it never happened."""
        with self.tx():
            self.conn.execute("UPDATE jobs SET starts = starts + 1, updated_at = ? WHERE name = ?",
                              (self.now(), name))
            return self._the_one("SELECT starts FROM jobs WHERE name = ?", (name,))["starts"]

    # ------------------------------------------------------------------------------------ runs

    def add_run(self, job: str, seq: int, how: str, **fields: Any) -> int:
        fields.setdefault("started_at", self.now())
        cols = ["job", "seq", "how", *fields]
        with self.tx():
            cur = self.conn.execute(
                f"INSERT INTO runs({', '.join(cols)}) VALUES({', '.join('?' * len(cols))})",
                (job, seq, how, *fields.values()))
            return _inserted_id(cur)

    def update_run(self, run_id: int, **fields: Any) -> None:
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.tx():
            self.conn.execute(f"UPDATE runs SET {cols} WHERE id = ?", (*fields.values(), run_id))

    def run(self, run_id: int) -> dict[str, Any] | None:
        return self._one("SELECT * FROM runs WHERE id = ?", (run_id,))

    def existing_run(self, run_id: int) -> dict[str, Any]:
        """The row of a run known to be there (add_run made it); LookupError if it is not."""
        return self._the_one("SELECT * FROM runs WHERE id = ?", (run_id,))

    def latest_run(self, job: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM runs WHERE job = ? ORDER BY id DESC LIMIT 1", (job,))

    def runs(self, job: str) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM runs WHERE job = ? ORDER BY id", (job,))

    # ------------------------------------------------------------------------------- incidents

    def open_incident(self, job: str, kind: str, summary: str, verdict: dict[str, Any],
                      started_at: float | None = None) -> tuple[int, int]:
        """(incident id, episode): episode counts this job's earlier incidents of this kind."""
        with self.tx():
            ep = self._the_one("SELECT COUNT(*) AS n FROM incidents WHERE job = ? AND kind = ?",
                               (job, kind))["n"]
            cur = self.conn.execute(
                "INSERT INTO incidents(job, kind, episode, started_at, summary, verdict_json) "
                "VALUES(?, ?, ?, ?, ?, ?)",
                (job, kind, ep, started_at if started_at is not None else self.now(), summary,
                 json.dumps(verdict, default=str)))
            return _inserted_id(cur), ep

    def update_incident(self, incident_id: int, **fields: Any) -> None:
        if "verdict_json" in fields and not isinstance(fields["verdict_json"], str):
            fields["verdict_json"] = json.dumps(fields["verdict_json"], default=str)
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.tx():
            self.conn.execute(f"UPDATE incidents SET {cols} WHERE id = ?",
                              (*fields.values(), incident_id))

    def resolve_incident(self, incident_id: int, at: float | None = None) -> None:
        with self.tx():
            self.conn.execute("UPDATE incidents SET state = 'resolved', resolved_at = ? "
                              "WHERE id = ? AND state = 'open'",
                              (at if at is not None else self.now(), incident_id))

    def incident(self, incident_id: int) -> dict[str, Any] | None:
        return self._one("SELECT * FROM incidents WHERE id = ?", (incident_id,))

    def open_incidents(self, job: str) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM incidents WHERE job = ? AND state = 'open' ORDER BY id",
                       (job,))

    def incidents(self, job: str, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._q("SELECT * FROM incidents WHERE job = ? ORDER BY id DESC LIMIT ?",
                       (job, limit))
        return list(reversed(rows))

    # --------------------------------------------------------------------------------- actions

    def add_action(self, job: str, what: str, outcome: str, *, incident_id: int | None = None,
                   attempt: int | None = None, detail: str = "", done: bool = True) -> int:
        now = self.now()
        with self.tx():
            cur = self.conn.execute(
                "INSERT INTO actions(incident_id, job, what, attempt, at, outcome, detail, done_at) "
                "VALUES(?, ?, ?, ?, ?, ?, ?, ?)",
                (incident_id, job, what, attempt, now, outcome, detail, now if done else None))
            return _inserted_id(cur)

    def complete_action(self, action_id: int, outcome: str, detail: str | None = None) -> None:
        with self.tx():
            if detail is None:
                self.conn.execute("UPDATE actions SET outcome = ?, done_at = ? WHERE id = ?",
                                  (outcome, self.now(), action_id))
            else:
                self.conn.execute("UPDATE actions SET outcome = ?, detail = ?, done_at = ? "
                                  "WHERE id = ?", (outcome, detail, self.now(), action_id))

    def pending_actions(self, job: str, what: str | None = None) -> list[dict[str, Any]]:
        if what is None:
            return self._q("SELECT * FROM actions WHERE job = ? AND outcome = 'pending' "
                           "ORDER BY id", (job,))
        return self._q("SELECT * FROM actions WHERE job = ? AND what = ? AND outcome = 'pending' "
                       "ORDER BY id", (job, what))

    def actions(self, incident_id: int) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM actions WHERE incident_id = ? ORDER BY id", (incident_id,))

    def job_actions(self, job: str) -> list[dict[str, Any]]:
        return self._q("SELECT * FROM actions WHERE job = ? ORDER BY id", (job,))

    # ---------------------------------------------------------------------------------- alerts

    def record_alert(self, incident_id: int | None, job: str, kind: str, state: str,
                     summary: str, event: dict[str, Any]) -> int:
        with self.tx():
            cur = self.conn.execute(
                "INSERT INTO alert_events(incident_id, job, kind, state, at, summary, event_json) "
                "VALUES(?, ?, ?, ?, ?, ?, ?)",
                (incident_id, job, kind, state, self.now(), summary,
                 json.dumps(event, default=str)))
            return _inserted_id(cur)

    def alert_events(self, job: str | None = None) -> list[dict[str, Any]]:
        if job is None:
            return self._q("SELECT * FROM alert_events ORDER BY id")
        return self._q("SELECT * FROM alert_events WHERE job = ? ORDER BY id", (job,))
