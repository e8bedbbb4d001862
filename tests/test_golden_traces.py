"""Golden traces: real faults recorded by `stallwatch record`, replayed through today's rules.

tests/data/traces/<fault>.jsonl were recorded as root by tools/record_fault_traces.py from the
rigs in tests/faultrigs.py: the extraction-like job healthy for about 10 s, then the fault, then
about 40 s more. Each trace ends with a `rig` event (pid, log, mount, device, server port: what
the rig knew, independently of stallwatch) and `phase` events (wall times: "fault", "exit").

For each trace, replayed with evaluate_trace (the same features and rules as live, `for` included):
- before the fault the verdict is healthy, from the first snapshot on (no warm-up: the recorder
  starts after the job's first progress lines, and the log's history gives a cadence at once);
- after the fault the expected kind appears within the contract's bound (a stall of a job with a
  ≤ 1 s cadence: ≤ 30 s after its last progress; a crash: ≤ 2 s after the exit), and stays;
- its evidence names the concrete thing (thread, wait channel, syscall, mount, device, socket,
  exit status, traceback line, kernel line), checked against the rig's own facts.
A healthy job and one writing a 45 s checkpoint never get a stall verdict.

Re-record after a probe changes what it records: `sudo .venv/bin/python tools/record_fault_traces.py`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from stallwatch.engine.features import STALL_FLOOR_S
from stallwatch.commands.replay import evaluate_trace
from stallwatch.probes.trace import read_trace

TRACES = Path(__file__).parent / "data" / "traces"
_PROGRESS = re.compile(r"\| \d+/\d+ \[")
STALL_BOUND_S = 30.0  # docs/contract.md: a job with a ≤ 1 s cadence is classified within 30 s of its last progress
CRASH_BOUND_S = 2.0  # ... and a crash within 2 s of the exit
STALL_KINDS = {"hang", "io_stall", "server_hang", "server_down"}
# A stall rule holds for `for = "2s"` once the threshold is passed; `healthy` no longer holds
# then, so the verdict is `unknown` for that long (plus one 0.5 s tick of jitter), no longer.
PENDING_GAP_S = 2.0 + 0.5 + 0.1


@dataclass
class Golden:
    name: str
    header: dict
    rows: list[dict]
    snaps: list[dict]
    facts: dict
    phases: dict[str, float]

    def before(self, wall: float) -> list[dict]:
        return [r for r in self.rows if r["t_wall"] < wall]

    def after(self, wall: float) -> list[dict]:
        return [r for r in self.rows if r["t_wall"] >= wall]

    def snap(self, row: dict) -> dict:
        return self.snaps[self.rows.index(row)]

    def timeline(self) -> str:
        """Verdict changes, for assertion messages."""
        out, last = [], None
        for r in self.rows:
            if r["kind"] != last:
                out.append(f"{r['t_s']:6.1f}s {r['kind']} ({r['rule']})")
                last = r["kind"]
        return "\n".join(out)


@functools.cache
def golden(name: str) -> Golden:
    path = TRACES / f"{name}.jsonl"
    header, rows, events = evaluate_trace(path)
    _, snaps, _ = read_trace(path)
    assert len(rows) == len(snaps) > 0
    (facts,) = [e for e in events if e.get("kind") == "rig"]
    phases = {e["phase"]: e["wall"] for e in events if e.get("kind") == "phase"}
    return Golden(name, header, rows, snaps, facts, phases)


def evidence(row: dict, signal: str) -> list[str]:
    return [e["detail"] for e in row["evidence"] if e["signal"] == signal]


def number_after(text: str, marker: str) -> float:
    m = re.search(re.escape(marker) + r"\s*(-?\d+(?:\.\d+)?)", text)
    assert m, f"no number after {marker!r} in {text!r}"
    return float(m[1])


def last_progress_wall(g: Golden, row: dict) -> float:
    """When the job last progressed: the log's mtime, its last write being the stalled bar.
    (The probe's own idle_s counts from the tick that saw the change, up to one interval late.)"""
    log = g.snap(row)["log"]
    assert _PROGRESS.search(log["tail"][-1]), log["tail"][-1]
    return log["mtime_epoch_s"]


def assert_healthy_before_fault(g: Golden) -> None:
    before = g.before(g.phases["fault"])
    assert len(before) >= 18, f"lead-in too short: {len(before)} snapshots"  # ~10 s at 0.5 s
    kinds = [r["kind"] for r in before]
    assert set(kinds) == {"healthy"}, g.timeline()


def detect(g: Golden, kind: str) -> dict:
    """The first row of `kind` after the fault; asserts it stays, and what came in between."""
    after = g.after(g.phases["fault"])
    hits = [i for i, r in enumerate(after) if r["kind"] == kind]
    assert hits, f"{g.name}: no {kind} after the fault\n{g.timeline()}"
    first = hits[0]
    assert all(r["kind"] == kind for r in after[first:]), f"{kind} does not stay\n{g.timeline()}"
    return after[first]


STALLS = {
    # trace: (kind, rule)
    "deadlock": ("hang", "hang"),
    "busy_loop": ("hang", "hang"),
    "fsfreeze": ("io_stall", "io_stall"),
    "server_stopped": ("server_hang", "server_hang"),
}


@pytest.mark.parametrize("name", sorted(STALLS))
def test_stall_is_detected_within_30s_of_the_last_progress_and_stays(name):
    g = golden(name)
    kind, rule = STALLS[name]
    assert_healthy_before_fault(g)
    row = detect(g, kind)
    assert row["rule"] == rule
    last = last_progress_wall(g, row)
    if g.facts["at"] is not None:  # an in-job fault starts right after the bar shows `at`
        assert last == pytest.approx(g.phases["fault"], abs=0.01)
    else:  # freeze or SIGSTOP from outside: the sample under way may still finish
        assert g.phases["fault"] - 1.0 <= last <= g.phases["fault"] + g.facts["sample_s"] + 0.1
    latency = row["t_wall"] - last
    assert STALL_FLOOR_S <= latency <= STALL_BOUND_S, (latency, g.timeline())
    # Between the fault and the verdict: healthy while under the threshold, then `unknown` only
    # while the stall rule is pending.
    gap = [r for r in g.after(g.phases["fault"]) if r["t_wall"] < row["t_wall"]]
    assert {r["kind"] for r in gap} <= {"healthy", "unknown"}, g.timeline()
    unknown = [r for r in gap if r["kind"] == "unknown"]
    if unknown:
        assert row["t_wall"] - unknown[0]["t_wall"] <= PENDING_GAP_S, g.timeline()
    # No other stall kind on the way.
    assert not {r["kind"] for r in g.rows} & (STALL_KINDS - {kind}), g.timeline()


def test_deadlock_evidence_names_the_thread_states():
    g = golden("deadlock")
    row = detect(g, "hang")
    pid = g.facts["pid"]
    assert row["summary"].endswith("every thread asleep")
    (proc,) = evidence(row, "process")
    assert proc.startswith(f"pid {pid}: threads 3 S; main thread S in futex, wchan futex"), proc
    (quiet,) = evidence(row, "quiet")
    assert number_after(quiet, "no thread has run for") >= STALL_FLOOR_S
    (progress,) = evidence(row, "progress")
    assert progress.startswith(f"last progress {g.facts['at']}/{g.facts['n']}, "), progress


def test_busy_loop_evidence_names_the_running_thread_and_cpu():
    g = golden("busy_loop")
    row = detect(g, "hang")
    assert row["summary"].endswith("spinning on the CPU")
    (proc,) = evidence(row, "process")
    assert proc.startswith(f"pid {g.facts['pid']}: threads 1 R; main thread R in user space"), proc
    (cpu,) = evidence(row, "cpu")
    assert number_after(cpu, "CPU") >= 90 and cpu.endswith("a busy loop or livelock"), cpu


def test_io_stall_evidence_names_tid_wchan_syscall_mount_and_device():
    g = golden("fsfreeze")
    row = detect(g, "io_stall")
    pid, mount, device = g.facts["pid"], g.facts["mount"], g.facts["device"]
    (thread,) = evidence(row, "thread")
    d_threads = [t for p in g.snap(row)["processes"]["processes"] for t in p["threads"]
                 if t["state"] == "D"]
    (t,) = d_threads
    assert re.match(rf"pid {pid} tid {t['tid']} \(python[\d.]*\) in D for ", thread), thread
    assert number_after(thread, "in D for") >= 10
    assert "wchan percpu_rwsem_wait" in thread, thread
    syscall = t["syscall"]
    assert syscall in ("openat", "write"), syscall  # opening the next output, or writing it
    assert f"syscall {syscall}" in thread
    disks = evidence(row, "disk")
    assert f"{g.facts['outputs']} is on {mount} ({device} backed by " in "\n".join(disks), disks
    # The advice names the frozen filesystem (where the outputs go), not merely the tightest one.
    (check,) = [a for a in row["advice"] if a.startswith("check the filesystem")]
    assert check.startswith(f"check the filesystem {mount} on {device} backed by "), check
    assert "(holds the outputs directory)" in check or "the stuck thread's file" in check, check
    (stack,) = evidence(row, "stack")
    assert stack.startswith(f"kernel stack of tid {t['tid']}: percpu_rwsem_wait"), stack


def test_server_hang_evidence_names_the_clients_syscall_on_the_servers_port():
    g = golden("server_stopped")
    row = detect(g, "server_hang")
    pid, port = g.facts["pid"], g.facts["server_port"]
    (client,) = evidence(row, "client")
    assert client.startswith(f"pid {pid} tid {pid}: blocked reading the server socket "
                             f"(recvfrom on 127.0.0.1:{port}) for "), client
    assert number_after(client, ") for") >= 10
    assert g.facts["server"] in row["summary"]


def test_crash_is_detected_within_2s_of_the_exit_with_exit_code_and_traceback():
    g = golden("crash")
    assert_healthy_before_fault(g)
    row = detect(g, "crash")
    latency = row["t_wall"] - g.phases["fault"]  # the traceback's write: at or before the exit
    assert 0 <= latency <= CRASH_BOUND_S, (latency, g.timeline())
    assert row["cause"] == "exit code 1"
    assert evidence(row, "exit") == [f"exit status of pid {g.facts['pid']}: code 1"]
    assert evidence(row, "log")[0] == (f"traceback at the end of {g.facts['log']}: RuntimeError: "
                                       "CUDA error: an illegal memory access was encountered")


def test_oom_kill_is_a_crash_with_cause_oom_kill_and_the_pid():
    g = golden("oom")
    assert_healthy_before_fault(g)
    row = detect(g, "crash")
    pid = g.facts["pid"]
    assert row["rule"] == "crash_oom" and row["cause"] == "oom_kill"
    # The exit as the kernel timed it (kmsg), or as the rig saw it: whichever is earlier.
    kills = [e for s in g.snaps for e in (s["kernel"] or {}).get("events", [])
             if e["kind"] == "oom_kill" and e["pid"] == pid]
    assert kills, "the trace holds no oom_kill event for the job"
    died = min([g.phases["exit"]] + [e["wall_time"] for e in kills if e.get("wall_time")])
    latency = row["t_wall"] - died
    assert 0 <= latency <= CRASH_BOUND_S, (latency, g.timeline())
    (kernel,) = evidence(row, "kernel")
    assert f"Killed process {pid} (python" in kernel, kernel
    assert evidence(row, "exit") == ["exit status: SIGKILL"]
    assert g.facts["cgroup"]


def test_healthy_trace_is_healthy_throughout():
    g = golden("healthy")
    assert len(g.rows) >= 90  # ~50 s at 0.5 s
    kinds = {r["kind"] for r in g.rows}
    assert kinds == {"healthy"}, g.timeline()
    assert all(r["warnings"] == [] and r["errors"] == [] for r in g.rows)


def test_checkpoint_is_never_a_stall():
    g = golden("checkpoint")
    assert_healthy_before_fault(g)
    start, end = g.phases["fault"], g.phases["checkpoint_end"]
    assert end - start >= 40
    kinds = {r["kind"] for r in g.rows}
    assert not kinds & STALL_KINDS, g.timeline()
    assert kinds == {"healthy"}, g.timeline()
    # The trace exercises the point: past the stall threshold without progress, the job is
    # healthy only because its I/O moves.
    during = [r for r in g.rows if start <= r["t_wall"] < end]
    working = [r for r in during if r["rule"] == "working_without_progress"]
    assert working, g.timeline()
    assert working[0]["t_wall"] - start <= STALL_BOUND_S
    for r in working:
        (activity,) = evidence(r, "activity")
        assert activity.startswith("I/O counters changed"), activity
    after = [r for r in g.rows if r["t_wall"] >= end + 2]
    assert after and all(r["rule"] == "healthy" for r in after), g.timeline()


def test_every_committed_trace_is_tested_and_small():
    names = {p.stem for p in TRACES.glob("*.jsonl")}
    assert names == set(STALLS) | {"crash", "oom", "healthy", "checkpoint"}
    for p in TRACES.glob("*.jsonl"):
        assert p.stat().st_size < 2 << 20, p
