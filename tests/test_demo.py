"""`stallwatch demo --fault X --json`, each fault end to end through the real CLI.

Each demo takes 30-65 s, mostly waiting (the default rules need 20 s without progress, plus 2 s
of confirmation, to call a ~0.4 s-cadence job stalled; the contract allows 30 s from the last
progress, which the demo times by the log's mtime). The selected demos are started together
by a module fixture, each in its own temporary directory with its own server port, state
database and (for io_stall) loop device, and each test waits for its own: the module takes about
as long as the slowest demo instead of the sum.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from stallwatch.actions.filecheck import validate_file

pytestmark = pytest.mark.slow

FAULTS = ("hang", "crash", "server_hang", "io_stall")
WAIT_S = 280.0


def _io_stall_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "io_stall needs root (loop device, mount, fsfreeze)"
    missing = [t for t in ("losetup", "mkfs.ext4", "fsfreeze", "mount", "umount")
               if shutil.which(t) is None]
    if missing:
        return f"io_stall needs {', '.join(missing)}"
    return None


class Running:
    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.t0 = time.monotonic()
        self.out = tempfile.TemporaryFile()  # noqa: SIM115 - the demo's output, read back when it ends
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 - the demo's output, read back when it ends
        pipeline, _, kind = fault.rpartition(":")  # "torchrun:hang": the torchrun pipeline
        extra = ["--pipeline", pipeline] if pipeline else []
        self.proc = subprocess.Popen([sys.executable, "-m", "stallwatch", "demo", "--fault", kind,
                                      *extra, "--json"], stdout=self.out, stderr=self.err,
                                     stdin=subprocess.DEVNULL)
        self.result: tuple[int, dict, str, float] | None = None

    def wait(self) -> tuple[int, dict, str, float]:
        if self.result is None:
            try:
                rc = self.proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # the demo cleans up in-process; a kill leaves tmp dirs only
                rc = self.proc.wait()
            took = time.monotonic() - self.t0
            self.out.seek(0)
            self.err.seek(0)
            out = self.out.read().decode("utf-8", "replace")
            err = self.err.read().decode("utf-8", "replace")
            try:
                doc = json.loads(out) if out.strip() else {}
            except ValueError:
                doc = {"unparsed": out}
            self.result = (rc, doc, err, took)
        return self.result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.out.close()
        self.err.close()


@pytest.fixture(scope="module")
def demos(request):
    """Start every demo the session selected from this module, all at once."""
    wanted = []
    for item in request.session.items:
        if item.module is not None and item.module.__name__ == __name__:
            cs = getattr(item, "callspec", None)
            fault = cs.params.get("fault") if cs is not None else None
            if fault and fault not in wanted:
                if fault == "io_stall" and _io_stall_unavailable():
                    continue
                wanted.append(fault)
    running = {f: Running(f) for f in wanted}
    yield running
    for r in running.values():
        r.close()


def _check(key: str, demos) -> dict:
    fault = key.rpartition(":")[2]
    if fault == "io_stall" and (why := _io_stall_unavailable()):
        pytest.skip(why)
    rc, doc, err, took = demos[key].wait()
    print(f"demo {fault}: exit {rc} in {took:.1f} s; detected after "
          f"{doc.get('detected_after_s')} s")
    assert rc == 0, f"demo --fault {fault} exited {rc}: {doc.get('problems')}\n{err[-4000:]}"
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["fault"] == fault and doc["expected_verdict"] == fault
    assert doc["verdict"] == fault, doc.get("summary")
    assert doc["evidence"], "a verdict comes with evidence"
    assert doc["job_phase"] == "finished"
    o = doc["outputs"]
    assert o["expected"] == o["present"] == o["valid"] and o["valid"] > 0
    assert o["missing"] == [] and o["broken"] == [] and o["extra"] == []
    # anything quarantined is broken (moved aside, never deleted)
    for q in doc["quarantined"]:
        p = Path(q)
        assert not p.exists() or not validate_file(p).ok
    alerts = {(a["kind"], a["state"]) for a in doc["alerts"]}
    assert (fault, "firing") in alerts, doc["alerts"]
    whats = [e["what"] for e in doc["timeline"]]
    assert "fault" in whats and "detect" in whats and "done" in whats
    assert whats.index("fault") < whats.index("detect") < whats.index("done")
    return doc


def _within_contract(doc: dict) -> None:
    """The contract (DESIGN.md, docs/contract.md): a job progressing at least every second is
    classified within 30 s of its last progress (its stall threshold is the rules' 20 s floor),
    never before that floor. A loaded host can slow the demo's ~0.4 s job past that cadence
    (seen at load 20: 2.5 s a sample, a learned threshold of 25.2 s, in the verdict's evidence);
    the rules then adapt, as the contract says, and the bound is that threshold plus the same
    10 s the contract allows over the floor."""
    after = doc["detected_after_last_progress_s"]
    threshold_s = max((float(t) for e in doc["evidence"]
                       for t in re.findall(r"\(threshold ([0-9.]+) s", e)), default=20.0)
    bound_s = 30.0 + max(0.0, threshold_s - 20.0)
    assert after is not None and 18 <= after <= bound_s, \
        f"{after} s after the last progress (bound {bound_s:g} s); the evidence: {doc['evidence']}"


@pytest.mark.parametrize("fault", ["hang"])
def test_demo_hang(fault, demos) -> None:
    doc = _check(fault, demos)
    _within_contract(doc)
    # the writer hangs with one write queued (--max-pending-io 1): the progress stops with the
    # fault, so "after the fault" is the contract's "after the last progress" (the log's mtime)
    assert -0.3 <= doc["detected_after_s"] - doc["detected_after_last_progress_s"] < 2, doc
    assert doc["restarts"] == 1
    whats = [e["what"] for e in doc["timeline"]]
    for step in ("alert", "kill", "validate", "restart", "resume"):
        assert step in whats, step
    assert whats.index("detect") < whats.index("kill") < whats.index("validate") \
        < whats.index("restart") < whats.index("resume")
    assert any(i["kind"] == "hang" and i["state"] == "resolved" for i in doc["incidents"])
    # The writer hung half-way through a file: it is moved aside, and the resume rewrites it.
    assert [Path(q).name for q in doc["quarantined"]] == ["data_16.ckpt"]
    assert "quarantine" in whats and whats.index("validate") <= whats.index("quarantine") < whats.index("resume")


@pytest.mark.parametrize("fault", ["crash"])
def test_demo_crash(fault, demos) -> None:
    doc = _check(fault, demos)
    assert doc["detected_after_s"] is not None and doc["detected_after_s"] < 5
    assert doc["restarts"] == 1
    assert any("RuntimeError: injected fault" in e for e in doc["evidence"])
    whats = [e["what"] for e in doc["timeline"]]
    assert whats.index("detect") < whats.index("validate") < whats.index("resume")


@pytest.mark.parametrize("fault", ["server_hang"])
def test_demo_server_hang(fault, demos) -> None:
    doc = _check(fault, demos)
    _within_contract(doc)
    # the fault is in the server: the client is never restarted; the demo, as the operator,
    # resumes the scheduler and the same client run finishes
    assert doc["restarts"] == 0
    whats = [e["what"] for e in doc["timeline"]]
    assert "kill" not in whats and "resume" not in whats
    assert whats.index("detect") < whats.index("operator") < whats.index("done")
    assert any("TP0" in e and "state T" in e for e in doc["evidence"]), doc["evidence"]
    assert ("server_hang", "resolved") in {(a["kind"], a["state"]) for a in doc["alerts"]}


@pytest.mark.root
@pytest.mark.parametrize("fault", ["io_stall"])
def test_demo_io_stall(fault, demos) -> None:
    doc = _check(fault, demos)
    assert doc["detected_after_s"] is not None and doc["detected_after_s"] <= 35
    assert doc["restarts"] == 1
    assert any("in D" in e and "percpu_rwsem_wait" in e for e in doc["evidence"])
    texts = [(e["what"], e["text"]) for e in doc["timeline"]]
    unkillable = [i for i, (w, t) in enumerate(texts) if w == "kill" and t.startswith("unkillable")]
    thaw = [i for i, (w, t) in enumerate(texts) if w == "operator"]
    resume = [i for i, (w, t) in enumerate(texts) if w == "resume"]
    # unkillable and waiting (no second writer) before the thaw; the resume only after it
    assert unkillable and thaw and resume and unkillable[0] < thaw[0] < resume[0]
    check = [t for w, t in texts if w == "check"]
    assert check and "no second writer" in check[0]


@pytest.mark.parametrize("fault", ["torchrun:hang"])
def test_demo_torchrun_hang(fault, demos) -> None:
    """SpecForge's shape (docs/specforge.md): rank 1 named, the tree killed, the file aside."""
    pytest.importorskip("torch", reason="the torchrun pipeline needs torch (the test extra)")
    doc = _check(fault, demos)
    assert doc["detected_after_s"] is not None and doc["detected_after_s"] <= 30
    assert doc["restarts"] == 1
    assert "rank 1 (pid" in doc["summary"] and "half-written" in doc["summary"]
    assert any("finished its bar and waits at the barrier" in e for e in doc["evidence"])
    assert len(doc["quarantined"]) == 1 and doc["quarantined"][0].endswith(".ckpt")
    assert doc["outputs"]["valid"] == 60


def test_demo_unknown_fault_is_a_usage_error() -> None:
    r = subprocess.run([sys.executable, "-m", "stallwatch", "demo", "--fault", "meteor"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    assert "--fault meteor" in r.stderr and "hang" in r.stderr


ZOMBIE_LEADER = r"""
import ctypes, threading, time
def worker():
    time.sleep(60)  # a writer thread: in the demo it is blocked in D on the frozen filesystem
threading.Thread(target=worker, daemon=True).start()
print("ready", flush=True)
ctypes.CDLL(None).syscall(60 if ctypes.sizeof(ctypes.c_void_p) == 8 else 1, 0)  # SYS_exit: this thread only
"""


def test_zombie_leader_with_a_live_thread_is_not_gone() -> None:
    """What the io_stall demo caught: SIGTERM kills a client's main thread at once, but its
    writer thread, stuck in D, lives on; the leader then reads as a zombie. That process is not
    gone — the kill must not report `done` and the resume must not start a second writer."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("SYS_exit number for x86_64 only in this test")
    from stallwatch.actions.kill import KillOperation, KillState
    from stallwatch.daemon.supervise import identity_alive
    from stallwatch.daemon.wrap import proc_state

    p = subprocess.Popen([sys.executable, "-c", ZOMBIE_LEADER], stdout=subprocess.PIPE,
                         start_new_session=True)
    try:
        assert p.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 10
        while (st := proc_state(p.pid)) is None or st[0] != "Z":
            assert time.monotonic() < deadline, f"the leader never exited: {st}"
            time.sleep(0.02)
        ticks = st[1]
        assert identity_alive(p.pid, ticks), "a zombie leader with a live thread counts as alive"
        sent = []
        k = KillOperation([(p.pid, ticks)], None, grace_s=5, kill=lambda pid, sig: sent.append(sig),
                          adopt_group=False)
        k.step()
        assert k.state is KillState.term_sent and not k.finished, k.report()
        # the worker's state: S once it sleeps, R while it is still getting there (the leader
        # can exit before the worker has reached its sleep; seen 2 in 20 runs): never Z
        assert sent and k.survivors[0].state in ("S", "R"), k.survivors
        os.killpg(p.pid, 9)
        p.wait(10)
        assert not identity_alive(p.pid, ticks)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
        p.stdout.close()


def test_detection_is_timed_from_the_last_progress_before_the_verdict(tmp_path) -> None:
    """A poll that comes late may read the resumed run's first progress before it reads the
    incident: the time from the last progress is taken from the progress written before it."""
    import io

    from rich.console import Console

    from stallwatch.commands.demo import Demo

    d = Demo("hang", console=Console(file=io.StringIO()))
    d.fault_wall = 1000.0
    d.progress_walls = [990.0, 999.5, 1000.1, 1026.0]  # 1026: the resumed run, read late
    inc = {"id": 1, "kind": "hang", "summary": "s", "started_at": 1023.0, "state": "firing",
           "note": "", "verdict_json": json.dumps({"evidence": []})}
    d._narrate_detection(inc)
    doc = d.summary()
    assert doc["detected_after_s"] == 23.0
    assert doc["detected_after_last_progress_s"] == 22.9


def test_the_contract_bound_follows_a_learned_threshold() -> None:
    """The bound is 30 s for a job at the 20 s floor, its threshold + 10 s for a slower one."""
    fast = {"detected_after_last_progress_s": 31.0,
            "evidence": ["progress: last progress 17/48, 28.9 s ago (threshold 20 s: 5 × p90 0.5 s)"]}
    with pytest.raises(AssertionError):
        _within_contract(fast)
    slow = {"detected_after_last_progress_s": 34.6,
            "evidence": ["progress: last progress 17/48, 32.0 s ago (threshold 25.222 s: 5 × p90 5.04 s)"]}
    _within_contract(slow)
    slow["detected_after_last_progress_s"] = 35.3
    with pytest.raises(AssertionError):
        _within_contract(slow)
