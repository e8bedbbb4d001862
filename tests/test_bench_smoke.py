"""CI smoke of the benchmark suite (bench/, issue 7): every section runs, at tiny sizes.

It must run, not be fast: the numbers of a smoke run mean nothing, only their shape and sanity
are checked (docs/performance.md has the real figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_bench_smoke_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--no-peers", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=280,
                       env={**os.environ, "STALLWATCH_BENCH_TMP": str(tmp_path)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Targets (issue 7)" in p.stdout
    res = json.loads(out.read_text())
    assert res["mode"] == "smoke"
    assert {"machine", "overhead", "tick", "growth", "detection", "false_positives", "gpu",
            "targets"} <= set(res)
    assert res["machine"]["nproc"] >= 1 and res["machine"]["kernel"]

    # overhead: the daemon and the floor, each with CPU per tick and memory
    rows = res["overhead"]["rows"]
    for who in ("stallwatch", "floor"):
        tot = rows[who]["total"]
        assert tot is not None and 0.01 < tot["cpu_ms_per_tick"] < 1000, (who, tot)
        assert 1 < rows[who]["rss_mib"] < 2000
    assert rows["stallwatch"]["x_floor"] > 0
    assert rows["stallwatch"]["tick_wall_ms"]["n"] >= 1

    # the in-process tick, and each cost-growth axis with at least two sizes
    tick = res["tick"]["current"]
    assert 0 < tick["cpu_ms"]["median"] < 1000 and tick["ticks"] >= 1
    g = res["growth"]["current"]
    assert len(g["log"]["rows"]) >= 2 and all(r["cpu_ms"]["median"] > 0 for r in g["log"]["rows"])
    assert len(g["outputs"]["rows"]) >= 2
    for r in g["outputs"]["rows"]:
        assert r["files_seen_at_end"] == r["files_expected_at_end"], r
    assert {r["mode"] for r in g["tree"]["rows"]} == {"procs", "threads"}
    for r in g["tree"]["rows"]:
        assert r["processes_seen"] >= 1 and r["threads_seen"] >= 1
    assert [r["rules"] for r in g["rules"]["rows"]] == [10, 20]

    # detection: the crash rig is judged a crash by the daemon, within seconds
    crash = res["detection"]["by_rig"]["crash"]
    assert crash["detected"] == 1 and crash["right_kind"] == 1, res["detection"]["runs"]
    assert 0 <= crash["verdict_latency_s"]["max"] < 30

    fp = res["false_positives"]
    assert isinstance(fp["false_positives"], int) and sum(fp["samples"].values()) >= 1

    assert any(t["snapshots"] > 0 for t in res["gpu"]["traces"])
    assert "H200" in res["gpu"]["label"]
    assert res["targets"] and all({"target", "bound", "measured", "met"} <= set(t) for t in res["targets"])
