"""capture_evidence on snapshots of real processes: a live deadlocked Python job, a py-spy that
never answers, a missing py-spy, size limits, secrets, and — as root — a Python writer frozen
in D by fsfreeze, where `py-spy dump --nonblocking` must still come back within its timeout.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest
from rigs import (frozen_ext4, root, spawn_in_state, spawned,  # noqa: F401 (root: a fixture)
                  wait_for_state)

from stallwatch.actions.evidence import capture_evidence, find_py_spy
from stallwatch.clock import FakeClock
from stallwatch.engine.alerting import EvidenceItem, Verdict
from stallwatch.kernel.kmsgparse import EventKind, KernelEvent
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.kmsg import KmsgObs
from stallwatch.probes.log import LogProbe
from stallwatch.probes.processes import ProcessesProbe
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.targets import Target

PY_SPY = find_py_spy("py-spy")
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed "
                                                         "(pip install py-spy)")
FILES = ("README.txt", "verdict.json", "snapshot.json", "threads.txt", "log_tail.txt",
         "gpus.txt", "disks.txt", "kernel.txt")


def snapshot_of(pid: int, tmp_path: Path, server: str | None = None) -> Snapshot:
    target = Target(name="extract", pids=(pid,), server=server)
    log = tmp_path / "extract.log"
    log.write_text("Generating Hidden States:  49%|####9     | 18380/37312 [5:00:00<5:09:00,"
                   " 1.02it/s]\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "RuntimeError: boom\n")
    kernel = KmsgObs(status=ProbeStatus.ok, source="fixture", events=(KernelEvent(
        kind=EventKind.hung_task, seq=7, kernel_usec=204_000_000, pid=pid, comm="python",
        blocked_for_s=120, message=f"INFO: task python:{pid} blocked for more than 120 seconds."),))
    return Snapshot(t_mono=1000.0, t_wall=time.time(), host="test", target=target,
                    processes=ProcessesProbe(target).collect(), log=LogProbe(log).collect(),
                    kernel=kernel)


VERDICT = Verdict(kind="hang", summary="no progress for 41 s; 3 threads asleep in futex",
                  evidence=(EvidenceItem(signal="threads", detail="futex"),))


def bundle_files(b: Path) -> set[str]:
    return {p.name for p in b.iterdir()}


# ------------------------------------------------------------------------------ live job


@needs_py_spy
def test_bundle_for_a_live_deadlocked_python_job(tmp_path):
    with spawn_in_state("S") as proc:
        snap = snapshot_of(proc.pid, tmp_path)
        t0 = time.monotonic()
        b = capture_evidence(snap, VERDICT, tmp_path / "state" / "evidence" / "inc-1",
                             py_spy=PY_SPY, py_spy_timeout_s=10, clock=FakeClock())
        took = time.monotonic() - t0
    assert b == tmp_path / "state" / "evidence" / "inc-1"
    assert stat.S_IMODE(b.stat().st_mode) == 0o700
    assert bundle_files(b) == set(FILES) | {f"py-spy-{proc.pid}.txt"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in b.iterdir())
    threads = (b / "threads.txt").read_text()
    assert f"pid {proc.pid} (python" in threads and "syscall futex" in threads
    assert threads.count("  thread ") == 3
    dump = (b / f"py-spy-{proc.pid}.txt").read_text()
    assert f"Process {proc.pid}" in dump and "grab" in dump, dump  # the deadlocked function
    assert '"kind":"hang"' in (b / "verdict.json").read_text().replace(" ", "")
    assert "18380/37312" in (b / "log_tail.txt").read_text()
    assert "RuntimeError: boom" in (b / "log_tail.txt").read_text()
    assert "hung_task" in (b / "kernel.txt").read_text()
    assert "no GPU observation" in (b / "gpus.txt").read_text()
    readme = (b / "README.txt").read_text()
    assert "verdict: hang" in readme and "notes:\n  - none" in readme, readme
    assert took < 10


def test_py_spy_missing_or_disabled_is_a_note(tmp_path):
    with spawn_in_state("S") as proc:
        snap = snapshot_of(proc.pid, tmp_path)
        b1 = capture_evidence(snap, VERDICT, tmp_path / "b", py_spy="/nonexistent/py-spy")
        b2 = capture_evidence(snap, VERDICT, tmp_path / "b", py_spy=None)
    assert b2 == tmp_path / "b-1"  # an existing bundle is never reused
    assert bundle_files(b1) == set(FILES) == bundle_files(b2)
    assert "'/nonexistent/py-spy' not found" in (b1 / "README.txt").read_text()
    assert "py-spy: disabled" in (b2 / "README.txt").read_text()


def test_py_spy_that_never_answers_is_killed_at_the_timeout(tmp_path):
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\nexec sleep 1000\n")
    fake.chmod(0o755)
    with spawn_in_state("S") as proc:
        snap = snapshot_of(proc.pid, tmp_path)
        t0 = time.monotonic()
        b = capture_evidence(snap, VERDICT, tmp_path / "b", py_spy=str(fake),
                             py_spy_timeout_s=0.5)
        took = time.monotonic() - t0
    assert took < 5
    assert f"py-spy for pid {proc.pid}: no answer in 0.5 s, killed" in \
        (b / "README.txt").read_text()


def test_py_spy_error_is_a_note(tmp_path):
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Error: Permission Denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    with spawn_in_state("S") as proc:
        b = capture_evidence(snapshot_of(proc.pid, tmp_path), VERDICT, tmp_path / "b",
                             py_spy=str(fake))
    assert "exit status 1: Error: Permission Denied" in (b / "README.txt").read_text()


def test_non_python_job_gets_no_py_spy(tmp_path):
    with spawned(["sleep", "1000"]) as proc:
        wait_for_state(proc.pid, "S")
        b = capture_evidence(snapshot_of(proc.pid, tmp_path), VERDICT, tmp_path / "b",
                             py_spy=PY_SPY or "py-spy")
    assert not any(n.startswith("py-spy-") for n in bundle_files(b))
    assert "sleep 1000" in (b / "threads.txt").read_text()


def test_bounded_size_and_no_credentials(tmp_path):
    with spawn_in_state("S") as proc:
        snap = snapshot_of(proc.pid, tmp_path, server="http://admin:s3cret@127.0.0.1:30000")
        b = capture_evidence(snap, VERDICT, tmp_path / "b", py_spy=None, max_file_bytes=2000)
    for p in b.iterdir():
        assert "s3cret" not in p.read_text()
        if p.name != "README.txt":
            assert p.stat().st_size <= 2000
    assert "http://***@127.0.0.1:30000" in (b / "snapshot.json").read_text()
    assert "snapshot.json: cut at 2000 bytes" in (b / "README.txt").read_text()


def test_never_raises_and_falls_back_when_the_bundle_dir_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with spawn_in_state("S") as proc:
        snap = snapshot_of(proc.pid, tmp_path)
    b = capture_evidence(snap, VERDICT, blocker / "bundle", py_spy=None)
    try:
        assert b.is_dir() and b != blocker / "bundle"
        assert f"could not create {blocker / 'bundle'}" in (b / "README.txt").read_text()
    finally:
        for p in b.iterdir():
            p.unlink()
        b.rmdir()

    class Broken:
        kind = "hang"
        summary = "x"

        def model_dump_json(self, **_):
            raise RuntimeError("cannot serialise")

    b = capture_evidence(snap, Broken(), tmp_path / "b", py_spy=None)  # type: ignore[arg-type]
    assert "verdict.json: not written: RuntimeError: cannot serialise" in \
        (b / "README.txt").read_text()


# ----------------------------------------------------------------------- frozen in D (root)

# A Python process whose main thread blocks in D creating a file on the frozen mount.
D_WRITER = "import sys, time\nopen(sys.argv[1] + '/stuck.pt', 'wb').write(b'x')\n"


@needs_py_spy
@pytest.mark.root
def test_bundle_for_a_python_process_frozen_in_d(root, tmp_path):
    with frozen_ext4() as (mnt, _dev):  # noqa: SIM117 - the filesystem, then the writer stuck on it: two steps
        with spawn_in_state("D", where=mnt, argv=[sys.executable, "-c", D_WRITER, str(mnt)]) \
                as proc:
            snap = snapshot_of(proc.pid, tmp_path)
            t0 = time.monotonic()
            b = capture_evidence(snap, Verdict(kind="io_stall", summary="writer in D"),
                                 tmp_path / "b", py_spy=PY_SPY, py_spy_timeout_s=5)
            took = time.monotonic() - t0
            assert os.path.exists(f"/proc/{proc.pid}")
    assert took < 5 + 3  # the py-spy deadline, plus a kill and the writes
    threads = (b / "threads.txt").read_text()
    assert f"pid {proc.pid} (python" in threads and " D for " in threads
    assert "wchan percpu_rwsem_wait  syscall openat" in threads
    assert "      mnt_want_write\n" in threads  # the kernel stack, one function a line
    # --nonblocking reads the stack without stopping the thread (which would never stop):
    # it answers at once, with the frame the writer is stuck in.
    dump = (b / f"py-spy-{proc.pid}.txt").read_text()
    assert f"Process {proc.pid}" in dump and "<module> (<string>:2)" in dump, dump
    assert "notes:\n  - none" in (b / "README.txt").read_text()


def test_overall_timeout_evaluation_and_features(tmp_path):
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\nexec sleep 1000\n")
    fake.chmod(0o755)
    with spawn_in_state("S") as proc:
        snap = snapshot_of(proc.pid, tmp_path)
        t0 = time.monotonic()
        b = capture_evidence(snap, VERDICT, tmp_path / "b", py_spy=str(fake),
                             py_spy_timeout_s=30, timeout_s=1.5, evaluation=VERDICT,
                             features={"log.idle_s": 41.0, "proc.states": ["S", "S"]})
        took = time.monotonic() - t0
    assert took < 5  # py-spy got 0.5 s of the 1.5 s, not 30
    assert "no answer in 0.5 s" in (b / "README.txt").read_text()
    assert '"log.idle_s": 41.0' in (b / "features.json").read_text()
    assert (b / "evaluation.json").exists()
