"""Traces recorded on NVIDIA H200s (one host, two GPUs) by tools/record_sglang_traces.py.

The protocol server ran its model on the GPUs (tensor parallel over two ranks with NCCL for the
tp2 scenarios), the extraction client wrote .ckpt files, and `stallwatch record` watched the
client with the server given by URL, so the server's own processes were observed through its
listening port. Each replays in CI to the verdict a person would give, with per-GPU and per-rank
evidence. Five scenarios ran at once on the same two GPUs, so GPU utilisation is shared: the
per-process memory and the per-rank process states are the discriminating evidence.

They record the OLD failure model (the stand-in then behaved like SGLang before 2026-03): a
killed rank left a zombie HTTP front (`tp2_rank_killed` -> server_hang) and no hard watchdog
ended a stopped rank's hang. Current SGLang kills its tree within seconds of a rank's death and
300-450 s after a batch stops; that behaviour is tested live against both stand-in shapes in
test_sglang_matrix.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.commands.replay import evaluate_trace
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.trace import read_trace

DATA = Path(__file__).parent / "data" / "sglang"


def load(name: str):
    header, rows, events = evaluate_trace(DATA / f"{name}.jsonl.gz")
    fault = next(e for e in events if e.get("phase") == "fault")
    return header, rows, fault


def before(rows, fault):
    return [r for r in rows if r["t_wall"] < fault["wall"]]


def first(rows, fault, kind):
    return next((r for r in rows if r["t_wall"] >= fault["wall"] and r["kind"] == kind), None)


def test_recorded_on_h200s_with_the_server_on_the_gpus():
    _, snaps, _ = read_trace(DATA / "tp2_rank_stopped.jsonl.gz")
    s = Snapshot.model_validate({k: v for k, v in snaps[5].items() if k != "type"})
    assert {d.name for d in s.gpu.devices} == {"NVIDIA H200"} and len(s.gpu.devices) == 2
    ranks = {p.cmdline: p.pid for p in s.server_processes.processes if p.cmdline.startswith("sglang::scheduler")}
    assert set(ranks) == {"sglang::scheduler_TP0", "sglang::scheduler_TP1"}
    holders = {pr.pid: d.index for d in s.gpu.devices for pr in d.processes or ()}
    # One rank per GPU, each holding memory there.
    assert holders[ranks["sglang::scheduler_TP0"]] == 0 and holders[ranks["sglang::scheduler_TP1"]] == 1


@pytest.mark.parametrize("name, kind, bound_s", [
    ("tp2_rank_stopped", "server_hang", 30.0),
    ("tp2_rank_killed", "server_hang", 30.0),  # old behaviour: the zombie front (docstring)
    ("server_stopped", "server_hang", 30.0),
    ("client_hang", "hang", 30.0),
    ("client_crash", "crash", 2.5),
])
def test_each_fault_replays_to_its_verdict_within_the_bound(name, kind, bound_s):
    _, rows, fault = load(name)
    pre = before(rows, fault)
    assert pre and all(r["kind"] == "healthy" for r in pre[3:]), {r["kind"] for r in pre}
    hit = first(rows, fault, kind)
    assert hit is not None, [r["kind"] for r in rows]
    # The bound counts from the last progress, which is at (or a moment before) the fault.
    assert hit["t_wall"] - fault["wall"] <= bound_s
    after = [r for r in rows if fault["wall"] <= r["t_wall"] < hit["t_wall"]]
    assert all(r["kind"] in ("healthy", kind) for r in after), [r["kind"] for r in after]


def _evidence(row, signal):
    return [e["detail"] for e in row["evidence"] if e["signal"] == signal]


def test_one_rank_stopped_while_the_other_spins_in_the_collective():
    _, rows, fault = load("tp2_rank_stopped")
    hit = first(rows, fault, "server_hang")
    assert any("one rank is stuck while the others wait on it" in d for d in _evidence(hit, "ranks"))
    ranks = _evidence(hit, "rank")
    tp1 = next(d for d in ranks if d.startswith("TP1"))
    tp0 = next(d for d in ranks if d.startswith("TP0"))
    assert f"pid {fault['victim_pid']}" in tp1 and "state T" in tp1 and "GPU 1 at 0%" in tp1
    assert "state R" in tp0 and "GPU 0" in tp0  # NCCL busy-waits on the stopped peer
    assert any("/server_info timed out" in d for d in _evidence(hit, "server_info"))


def test_one_rank_killed_is_named_as_gone():
    _, rows, fault = load("tp2_rank_killed")
    hit = first(rows, fault, "server_hang")
    assert any("TP1" in d and "has exited" in d for d in _evidence(hit, "rank"))
    assert any("one rank is stuck" in d for d in _evidence(hit, "ranks"))


def test_stopped_scheduler_http_alive_health_failing():
    _, rows, fault = load("server_stopped")
    hit = first(rows, fault, "server_hang")
    assert any("health check failed" in d for d in _evidence(hit, "health"))
    assert any("state T" in d for d in _evidence(hit, "rank"))
    # The HTTP process answers: this is not server_down.
    assert not any(r["kind"] == "server_down" for r in rows
                   if fault["wall"] <= r["t_wall"] <= hit["t_wall"] + 20)


def test_a_client_deadlock_with_a_healthy_server_is_the_clients_hang():
    _, rows, fault = load("client_hang")
    hit = first(rows, fault, "hang")
    assert not any(r["kind"] == "server_hang" for r in rows)
    assert any("futex" in d for d in _evidence(hit, "process"))


def test_client_crash_quotes_the_traceback():
    _, rows, fault = load("client_crash")
    hit = first(rows, fault, "crash")
    assert hit["cause"] == "exit code 1"
    assert any("RuntimeError: injected fault" in d for d in _evidence(hit, "log"))
