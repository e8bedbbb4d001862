"""Replays the trace recorded on the lent NVIDIA H200 by tools/record_specforge_trace.py (issue 14).

A SpecForge-shaped extraction (tests/jobs/specforge_job.py) under `torchrun --nproc_per_node 2`,
both ranks on GPU 0 holding ~4.7 GiB each, DP ranks; rank 1's writer deadlocked half-way through
a file at batch 8 while rank 0 finished its bar and waited at the barrier. Phases: running,
stuck (the fault fired), others_done (rank 0's closing line), diagnose, killed. Zero-config
`stallwatch diagnose` ran at the `diagnose` phase; its output is tests/data/specforge/diagnose.txt.
CI has no GPU: this is the GPU truth the rules and the per-rank parts are checked against.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stallwatch.engine.features import features
from stallwatch.commands.replay import evaluate_trace
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.trace import read_trace

DATA = Path(__file__).parent / "data" / "specforge"
TRACE = DATA / "specforge_h200.jsonl.gz"
DRIVER = json.loads((DATA / "driver.json").read_text())
RANK1_PID = DRIVER["workers"][1]


@pytest.fixture(scope="module")
def trace():
    _, snaps, events = read_trace(TRACE)
    phases = {e["phase"]: e["wall"] for e in events if e.get("kind") == "phase"}
    rows = [Snapshot.model_validate({k: v for k, v in s.items() if k != "type"}) for s in snaps]
    return rows, phases


@pytest.fixture(scope="module")
def verdicts():
    _, rows, events = evaluate_trace(TRACE)
    return rows, {e["phase"]: e["wall"] for e in events if e.get("kind") == "phase"}


def test_the_trace_is_a_torchrun_job_holding_a_real_h200(trace) -> None:
    rows, phases = trace
    running = [s for s in rows if phases["running"] + 8 <= s.t_wall < phases["killed"]]
    assert running
    for s in running:
        assert {d.name for d in s.gpu.devices} == {"NVIDIA H200"}
        v = features(s)
        assert v["job"]["torchrun"] and v["job"]["launcher_pid"] == DRIVER["launcher"]
        assert [r["rank"] for r in v["job"]["ranks"]] == [0, 1]
        assert v["gpu"]["job_mem_bytes"] >= 8 * (1 << 30)  # two ranks, 4 GiB each plus contexts
        assert set(v["gpu"]["list"][0]["pids"]) == set(DRIVER["workers"])


def test_per_rank_bars_never_call_it_complete_while_rank_1_is_stuck(trace) -> None:
    rows, phases = trace
    late = [s for s in rows if phases["others_done"] + 2 <= s.t_wall < phases["killed"]]
    assert late
    for s in late:
        v = features(s)
        assert v["log"]["bar_count"] == 2 and not v["log"]["complete"]
        bars = {b["position"]: b for b in v["log"]["bars"]}
        assert bars[0]["complete"] and not bars[1]["complete"]
        assert bars[1]["done"] < bars[1]["total"]


def test_verdict_is_hang_naming_rank_1_within_30_s_never_server(verdicts) -> None:
    rows, phases = verdicts
    live = [r for r in rows if r["t_wall"] < phases["killed"]]
    assert not any(r["kind"].startswith("server_") or r["kind"] == "finished" for r in live)
    hang = [r for r in live if r["kind"] == "hang"]
    assert hang, "the stuck rank was never called"
    # rank 0's last progress came with its closing line (others_done): called within 30 s of it
    assert hang[0]["t_wall"] - phases["others_done"] <= 30.0
    assert f"rank 1 (pid {RANK1_PID})" in hang[0]["summary"]
    assert "half-written" in hang[0]["summary"]
    before = [r for r in live if r["t_wall"] < phases["stuck"]]
    assert before and all(r["kind"] in ("healthy", "unknown") for r in before)


def test_zero_config_diagnose_on_the_h200_said_hang() -> None:
    text = (DATA / "diagnose.txt").read_text()
    assert "HANG" in text and "torchrun job: agent pid" in text and f"rank 1 pid {RANK1_PID}" in text
    doc = json.loads((DATA / "diagnose.json").read_text())
    assert doc["verdict"]["kind"] == "hang"
    assert f"rank 1 (pid {RANK1_PID})" in doc["verdict"]["summary"]
    assert "is not an SGLang server" in text and "discovered: server:" not in text
