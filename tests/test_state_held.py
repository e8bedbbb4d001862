"""One transaction a tick (issue 17): the rows a tick rewrites each time are held and written
together at its end; this connection reads them at once, other connections when it ends."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.daemon.config import load_config
from stallwatch.daemon.core import Daemon
from stallwatch.daemon.jobstate import verdict_doc
from stallwatch.daemon.state import StateDB
from stallwatch.daemon.status import status_doc
from stallwatch.daemon.verdictjson import VerdictJson
from stallwatch.engine.alerting import EvidenceItem, Verdict


def _trace(db: StateDB) -> list[str]:
    stmts: list[str] = []
    db.conn.file.set_trace_callback(stmts.append)
    return stmts


def _begins(stmts: list[str]) -> int:
    return sum(s.lstrip().upper().startswith("BEGIN") for s in stmts)


def _reader(d: Path) -> StateDB:
    return StateDB.open_readonly(d)


def test_held_rows_are_read_here_at_once_elsewhere_after_one_transaction(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path)
    db.ensure_job("a", "command", "{}")
    stmts = _trace(db)
    with db.held():
        db.update_job_later("a", verdict_at=5.0, pid=10)
        db.update_job_later("a", verdict_at=6.0)  # the latest value wins
        db.set_metas_later({"last_tick_at": "6.0", "ticks": "1"})
        db.set_metas_later({"ticks": "2"})
        assert stmts == []  # nothing written yet
        assert db.job("a")["verdict_at"] == 6.0 and db.job("a")["pid"] == 10
        assert db.existing_job("a")["pid"] == 10 and db.jobs()[0]["verdict_at"] == 6.0
        assert db.get_meta("ticks") == "2" and db.meta()["last_tick_at"] == "6.0"
        ro = _reader(tmp_path)
        assert ro.job("a")["verdict_at"] is None and ro.get_meta("ticks") is None
        ro.close()
    db.flush()
    assert _begins(stmts) == 1
    db.flush()  # nothing held: no transaction
    assert _begins(stmts) == 1
    ro = _reader(tmp_path)
    assert ro.job("a")["verdict_at"] == 6.0 and ro.job("a")["pid"] == 10
    assert ro.get_meta("ticks") == "2" and ro.get_meta("last_tick_at") == "6.0"
    ro.close()
    db.close()


def test_a_write_at_once_goes_out_with_the_held_ones_and_wins(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path)
    db.ensure_job("a", "command", "{}")
    stmts = _trace(db)
    with db.held():
        db.update_job_later("a", pid=10, verdict_at=1.0)
        db.update_job("a", pid=11)  # newer (a pid file named another process): it wins
        assert _begins(stmts) == 1
        ro = _reader(tmp_path)
        assert ro.job("a")["pid"] == 11 and ro.job("a")["verdict_at"] == 1.0
        ro.close()
        with db.tx():  # inside a transaction a later write joins it, held by nobody
            db.update_job_later("a", verdict_at=2.0)
        assert _begins(stmts) == 2
    db.flush()
    assert _begins(stmts) == 2  # nothing was left held
    assert db.job("a")["pid"] == 11 and db.job("a")["verdict_at"] == 2.0
    db.update_job_later("a", verdict_at=3.0)  # outside `held`: written at once
    assert _begins(stmts) == 3
    db.close()


def test_a_failed_flush_keeps_the_rows_for_the_next_transaction(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path)
    db.ensure_job("a", "command", "{}")
    # A write refused mid-transaction, after the job row went in (not the file's trouble).
    db.conn.execute("CREATE TEMP TRIGGER refuse BEFORE INSERT ON meta "
                    "BEGIN SELECT RAISE(ABORT, 'simulated refusal'); END")
    with db.held():
        db.update_job_later("a", verdict_at=7.0)
        db.set_metas_later({"alerts:a": "[1]"})
    with pytest.raises(sqlite3.DatabaseError, match="simulated"):
        db.flush()
    assert not db.conn.in_transaction and db.degraded is None
    assert db.get_meta("alerts:a") == "[1]" and db.job("a")["verdict_at"] == 7.0  # still held
    ro = _reader(tmp_path)
    assert ro.job("a")["verdict_at"] is None  # the job row was rolled back with the rest
    ro.close()
    db.conn.execute("DROP TRIGGER refuse")
    db.flush()
    ro = _reader(tmp_path)
    assert ro.get_meta("alerts:a") == "[1]" and ro.job("a")["verdict_at"] == 7.0
    ro.close()
    db.close()


def test_a_flush_the_file_refuses_goes_to_memory_then_back(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path, busy_timeout_s=0.1)
    db.ensure_job("a", "command", "{}")
    other = sqlite3.connect(tmp_path / "stallwatch.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        with db.held():
            db.update_job_later("a", verdict_at=8.0)
            db.set_metas_later({"ticks": "3"})
        db.flush()
        assert db.degraded and "locked" in db.degraded
        assert db.get_meta("ticks") == "3" and db.job("a")["verdict_at"] == 8.0
        assert db.conn.mem.execute("SELECT value FROM meta WHERE key = 'ticks'").fetchone() == ("3",)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert db.write_back() and db.degraded is None
    ro = _reader(tmp_path)
    assert ro.get_meta("ticks") == "3" and ro.job("a")["verdict_at"] == 8.0
    ro.close()
    db.close()


def test_close_writes_what_is_held(tmp_path: Path) -> None:
    db = StateDB.open(tmp_path)
    with db.held():
        db.set_metas_later({"ticks": "9"})
    db.close()
    ro = _reader(tmp_path)
    assert ro.get_meta("ticks") == "9"
    ro.close()


V = Verdict(kind="healthy", summary="progress 3/10 \u2714 \"quoted\"",
            evidence=(EvidenceItem(signal="log", detail="line 3 at 12:00"),),
            advice=("wait",), rule="healthy", severity="info")


@pytest.mark.parametrize("at", [1764635000.123456, 0.1, 5, 1e21, 1764635000.0])
@pytest.mark.parametrize("warnings", [[], ["rule x fails: no such key"], ["a", "b\u00e9"]])
def test_verdict_json_is_json_dumps_of_the_doc_byte_for_byte(at: float, warnings: list[str]) -> None:
    doc = verdict_doc(V, at)
    if warnings:
        doc["watch_warnings"] = warnings
    assert VerdictJson().text(V, at, warnings) == json.dumps(doc)


_TEXT = st.text(st.characters(codec=None), max_size=40)  # any code point: escapes, surrogates
_EVIDENCE = st.lists(st.builds(EvidenceItem, signal=_TEXT, detail=_TEXT), max_size=3).map(tuple)


@settings(max_examples=300, deadline=None)
@given(kind=_TEXT, summary=_TEXT, evidence=_EVIDENCE, advice=st.lists(_TEXT, max_size=3).map(tuple),
       cause=st.none() | _TEXT, rule=st.none() | _TEXT, severity=st.none() | _TEXT,
       at=st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**60, 2**60),
       warnings=st.lists(_TEXT, max_size=2))
def test_verdict_json_is_json_dumps_of_any_verdict(kind: str, summary: str, evidence: tuple,
                                                   advice: tuple, cause: str | None,
                                                   rule: str | None, severity: str | None,
                                                   at: float, warnings: list[str]) -> None:
    # The doc's strings are encoded one by one (verdictjson._head), not by json.dumps of it.
    v = Verdict(kind=kind, summary=summary, evidence=evidence, advice=advice, cause=cause,
                rule=rule, severity=severity)
    doc = verdict_doc(v, at)
    if warnings:
        doc["watch_warnings"] = warnings
    vj = VerdictJson()
    assert vj.text(V, 1.0) == json.dumps(verdict_doc(V, 1.0))
    assert vj.text(v, at, warnings) == json.dumps(doc)  # another verdict after one: seen


def test_verdict_json_of_a_verdict_built_unvalidated_is_json_dumps_of_it() -> None:
    v = Verdict.model_construct(kind="healthy", summary="ok", evidence=(), advice=(), cause=None,
                                rule="healthy", severity=3)  # no str: as json.dumps writes it
    assert VerdictJson().text(v, 2.5) == json.dumps(verdict_doc(v, 2.5))


def test_verdict_json_dumps_only_when_the_verdict_changed() -> None:
    vj = VerdictJson()
    a = vj.text(V, 1.0)
    same = V.model_copy()  # a new object each tick, the same fields
    b = vj.text(same, 2.0)
    assert vj.dumps == 1 and json.loads(b)["at"] == 2.0 and json.loads(a)["at"] == 1.0
    assert json.loads(b)["summary"] == V.summary
    changed = V.model_copy(update={"evidence": (EvidenceItem(signal="log", detail="line 4"),)})
    c = vj.text(changed, 3.0)
    assert vj.dumps == 2 and json.loads(c)["evidence"][0]["detail"] == "line 4"
    d = vj.text(changed, 4.0, ["w"])
    assert json.loads(d)["watch_warnings"] == ["w"] and vj.dumps == 2
    assert "watch_warnings" not in json.loads(vj.text(changed, 5.0, []))


def test_daemon_tick_is_one_transaction_and_status_reads_it(tmp_path: Path) -> None:
    tag = f"persist5-{time.time_ns() % 10**9}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", tag],
                               start_new_session=True)
    p = tmp_path / "sw.toml"
    p.write_text(f'[daemon]\ninterval_s = 0.2\nstate_dir = "state"\n\n'
                 f'[[job]]\nname = "other"\nmatch = "time.sleep.120. {tag}$"\n')
    p.chmod(0o644)
    d = Daemon(load_config(p), gpu=False, install_signals=False)
    try:
        d.open()
        runner = d.jobs["other"]
        deadline = time.monotonic() + 20
        while True:  # the attach and the first verdict write at once: let them settle
            d.tick()
            snap = runner.last_snap
            if snap is not None and tuple(snap.processes.targets) == (sleeper.pid,):
                break
            assert time.monotonic() < deadline, "the match never found the sleeper"
        d.tick()
        stmts = _trace(d.db)
        dumps = runner._verdict_json.dumps
        state = tmp_path / "state"
        for _i in range(4):
            stmts.clear()
            d.tick()
            assert _begins(stmts) == 1, stmts  # job row, meta rows, alert memory: together
            ro = _reader(state)
            try:
                row, meta = ro.job("other"), ro.meta()
                doc = status_doc(ro, state)
            finally:
                ro.close()
            assert int(meta["ticks"]) == d.ticks  # bench/overhead.py reads these each tick
            assert float(meta["tick_duration_s"]) >= 0.0
            assert row["verdict_at"] == runner.last_snap.t_wall  # advances every tick
            assert json.loads(row["verdict_json"])["at"] == row["verdict_at"]
            assert row["pid"] == sleeper.pid
            assert doc["daemon"]["last_tick_at"] == pytest.approx(float(meta["last_tick_at"]))
        assert runner._verdict_json.dumps == dumps  # the same verdict: not dumped again

        class Sinks:  # the alert dispatcher's health, as Dispatcher.status() gives it
            doc: ClassVar[dict[str, Any]] = {"sinks": [{"name": "ops", "ok": True, "sent": 0}]}

            def status(self) -> dict[str, Any]:
                return json.loads(json.dumps(self.doc))  # a new object each tick, like the real one

        d.dispatcher = Sinks()
        written = []
        for sent in (0, 0, 0, 1, 1):
            Sinks.doc["sinks"][0]["sent"] = sent
            stmts.clear()
            d.tick()
            assert _begins(stmts) == 1
            written.append(any("'alerts'" in s for s in stmts))
            ro = _reader(state)
            assert json.loads(ro.get_meta("alerts")) == Sinks.doc
            ro.close()
        assert written == [True, False, False, True, False]  # written when it changed
    finally:
        sleeper.kill()
        sleeper.wait(10)
        d.dispatcher = None  # the stand-in has nothing to close
        d.shutdown()


def test_history_json_made_at_the_save_matches_its_docs_across_the_ring() -> None:
    from stallwatch.engine.history import History, Sample

    h = History(keep=7)
    dumps = []
    real = json.dumps

    def counting(x: Any, *a: Any, **k: Any) -> str:
        dumps.append(x)
        return real(x, *a, **k)

    import stallwatch.engine.history as hist
    hist.json.dumps, saved = counting, hist.json.dumps
    try:
        saved_n = 0
        for i in range(40):
            h.add(Sample(t=float(i), done=float(i), cpu_cores=0.5 if i % 2 else None))
            assert not dumps  # adding a sample dumps nothing
            if i % 5 in (0, 3) or i in (20, 21, 22):  # saves between 1 and 12 samples apart
                got = h.docs_json(None)
                assert got == real(h.docs(None)) and h.docs_json(3.0) == real(h.docs(3.0))
                assert len(dumps) == min(h.added - saved_n, 7)  # each new sample once
                saved_n = h.added
                dumps.clear()
    finally:
        hist.json.dumps = saved
