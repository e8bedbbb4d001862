"""The NVML part of a tick, from traces RECORDED ON A REAL H200 (no GPU on the bench machine).

Each snapshot in a trace carries its probes' reports. How to read `duration_s` (see
stallwatch/probes/base.py, DeadlineRunner.call_many): every probe of a tick starts at once in
its own thread, and the runner then takes their results in order (processes, gpu, log, ...);
each probe's `duration_s` is the time from the tick's start until its result was taken. So the
gpu probe's figure is an UPPER BOUND on the NVML work (it cannot be less than the processes
probe's, taken before it), and `gpu - processes` is how much longer the tick waited for the GPU.
(Traces recorded since the runner's lane, issue 17, read more exactly: the probes run one after
the other in that order, `duration_s` runs until each call ended, so `gpu - processes` is the
NVML work itself, unless the batch was late and handed out.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import ROOT, rnd, summary

TRACES = [ROOT / "tests" / "data" / "gpu_h200_stop_kill.jsonl",
          *sorted((ROOT / "tests" / "data" / "sglang").glob("*.jsonl.gz"))]


def one(path: Path) -> dict[str, Any]:
    from stallwatch.probes.trace import read_trace

    header, snaps, _ = read_trace(path)
    gpu, procs, excess, ticks, slow_gpu, fast_gpu, slow_x = [], [], [], [], [], [], []
    devices = set()
    for s in snaps:
        reps = {p["name"]: p for p in s.get("probes", [])}
        g = reps.get("gpu")
        if not g or g.get("status") != "ok":
            continue
        pr = reps.get("processes")
        gpu.append(g["duration_s"])
        ticks.append(s.get("tick_duration_s") or 0.0)
        if pr:
            procs.append(pr["duration_s"])
            excess.append(max(0.0, g["duration_s"] - pr["duration_s"]))
        obs = s.get("gpu") or {}
        devs = obs.get("devices") or []
        devices.add(len(devs))
        # The slow path (per-process utilisation, PCIe counters) runs every 10 s: those ticks
        # carry slow_sampled_at equal to this collect's time.
        slow = any(d.get("slow_sampled_at") is not None and
                   abs((d.get("slow_sampled_at") or 0) - (obs.get("collected_at") or -1)) < 1e-6
                   for d in devs)
        (slow_gpu if slow else fast_gpu).append(g["duration_s"])
        if slow and pr:
            slow_x.append(max(0.0, g["duration_s"] - pr["duration_s"]))
    return {
        "trace": str(path.relative_to(ROOT)), "recorded_on": header.get("host"),
        "kernel": header.get("kernel"), "note": header.get("note"),
        "interval_s": header.get("interval_s"), "snapshots": len(gpu),
        "gpus": sorted(devices),
        "gpu_probe_ms_upper_bound": summary(gpu, 1e3, 2),
        "gpu_probe_fast_path_ms": summary(fast_gpu, 1e3, 2),
        "gpu_probe_slow_path_ms": summary(slow_gpu, 1e3, 2),
        "processes_probe_ms": summary(procs, 1e3, 2),
        "gpu_beyond_processes_ms": summary(excess, 1e3, 2),
        "gpu_beyond_processes_slow_path_ms": summary(slow_x, 1e3, 2),
        "tick_ms": summary(ticks, 1e3, 2),
    }


def run() -> dict[str, Any]:
    rows = [one(p) for p in TRACES if p.exists()]
    allg = [r["gpu_probe_ms_upper_bound"] for r in rows if r["snapshots"]]
    return {
        "label": "RECORDED on a real NVIDIA H200 host (committed traces); not measured on this machine",
        "how_to_read": __doc__.split("\n\n", 1)[1].strip(),
        "traces": rows,
        "median_of_medians_ms": rnd(sorted(x["median"] for x in allg)[len(allg) // 2]) if allg else None,
    }
