"""Replays the trace recorded on a real NVIDIA H200 by tools/record_gpu_trace.py.

The phases were: a torch matmul loop writing a tqdm log (busy), SIGSTOP (stopped), SIGKILL
(killed). CI has no GPU; this is the GPU truth it checks the probe and the rules against.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.engine.features import features
from stallwatch.commands.replay import evaluate_trace
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.trace import read_trace

TRACE = Path(__file__).parent / "data" / "gpu_h200_stop_kill.jsonl"


@pytest.fixture(scope="module")
def trace():
    header, snaps, events = read_trace(TRACE)
    phases = {e["phase"]: e["wall"] for e in events if e.get("kind") == "phase"}
    rows = [Snapshot.model_validate({k: v for k, v in s.items() if k != "type"}) for s in snaps]
    return header, rows, phases


def _in(rows, phases, start, end, settle_s=2.0):
    lo = phases[start] + settle_s
    hi = phases[end] if end else float("inf")
    return [s for s in rows if lo <= s.t_wall < hi]


def test_the_trace_comes_from_a_real_h200(trace):
    _, rows, _ = trace
    names = {d.name for s in rows if s.gpu for d in s.gpu.devices}
    assert names == {"NVIDIA H200"}
    assert all(s.gpu.status == "ok" for s in rows)
    assert rows[0].gpu.driver_version and rows[0].gpu.devices[0].mem_total_bytes > 100 * (1 << 30)


def test_busy_gpu_is_utilised_and_the_job_holds_memory(trace):
    _, rows, phases = trace
    busy = _in(rows, phases, "busy", "stopped")
    assert len(busy) >= 10
    job = busy[0].target.pids[0]
    for s in busy:
        v = features(s)
        assert v["gpu"]["util_max_pct"] >= 90
        assert v["gpu"]["job_mem_bytes"] >= 8 * (1 << 30)  # the child holds 8 GiB plus its context
        assert job in v["gpu"]["list"][0]["pids"]


def test_sigstop_drops_utilisation_to_zero_with_memory_still_held(trace):
    _, rows, phases = trace
    stopped = _in(rows, phases, "stopped", "killed", settle_s=1.0)
    assert len(stopped) >= 10
    for s in stopped:
        v = features(s)
        assert v["gpu"]["util_max_pct"] == 0
        assert v["gpu"]["job_mem_bytes"] >= 8 * (1 << 30)
        assert v["job"]["stopped"]


def test_sigkill_releases_the_memory(trace):
    _, rows, phases = trace
    after = _in(rows, phases, "killed", None, settle_s=1.0)
    assert after
    for s in after:
        v = features(s)
        assert v["gpu"]["job_mem_bytes"] == 0 and v["gpu"]["mem_used_bytes"] < (1 << 30)
        assert v["job"]["exited"] and not v["job"]["alive"]


def test_verdicts_follow_the_phases():
    _header, rows, events = evaluate_trace(TRACE)
    phases = {e["phase"]: e["wall"] for e in events if e.get("kind") == "phase"}
    busy = [r for r in rows if phases["busy"] <= r["t_wall"] < phases["stopped"]]
    assert busy and all(r["kind"] == "healthy" for r in busy)
    stopped = [r for r in rows if phases["stopped"] <= r["t_wall"] < phases["killed"]]
    hang = [r for r in stopped if r["kind"] == "hang"]
    assert hang, "a SIGSTOPped job was never called hang"
    assert hang[0]["t_wall"] - phases["stopped"] <= 30.0
    assert any("state T" in e["detail"] for e in hang[0]["evidence"])
    assert not any(r["kind"] in ("io_stall", "crash", "server_hang") for r in stopped)
    after = [r for r in rows if r["t_wall"] >= phases["killed"] + 1.0]
    # Not stallwatch's child: the exit status is unknown, and nothing in the log says crash.
    assert after and all(r["kind"] == "unknown" and r["rule"] == "exited_unknown" for r in after)
