"""The GPU part, measured live on a GPU host (the lent H200; nothing here has a GPU).

    python -m bench --sections gpu          # live when NVML finds a GPU, else from the traces

Two measurements, side by side in one run:
  - nvml: stallwatch's gpu probe (`GpuProbe.collect()`, through the NVML choke point) against the
    raw floor of the same NVML calls (bench/floor.py's NvmlFloor), alternated call by call: CPU
    (process time, so driver threads count) and wall per call, for the fast path alone and with
    the per-process utilisation samples (the slow path, every 10 s in a tick);
  - overhead: bench/overhead.py with a real GPU job (bench/jobs/gpu_job.py: bf16 matmuls on every
    GPU, an output file and a progress line every 0.2 s) watched by `stallwatch run`, the floor
    with `--nvml`, and the peers (nvitop and gpustat now read a real GPU).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, rnd, summary


def nvml_available() -> tuple[bool, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if n else ""
        driver = pynvml.nvmlSystemGetDriverVersion()
        return n > 0, f"{n} × {name}, driver {driver}"
    except Exception as e:  # noqa: BLE001 - any failure means: no live GPU here
        return False, f"{type(e).__name__}: {e}"


def _pair(calls: int, ours: Any, floor: Any) -> dict[str, Any]:
    c_ours, w_ours, c_floor, w_floor = [], [], [], []
    for _ in range(3):  # warm both
        ours()
        floor()
    for _ in range(calls):
        for fn, cpu, wall in ((ours, c_ours, w_ours), (floor, c_floor, w_floor)):
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            fn()
            wall.append((time.perf_counter_ns() - w0) / 1e9)
            cpu.append((time.process_time_ns() - c0) / 1e9)
    out = {"calls": calls,
           "stallwatch": {"cpu_ms": summary(c_ours, 1e3, 3), "wall_ms": summary(w_ours, 1e3, 3)},
           "floor": {"cpu_ms": summary(c_floor, 1e3, 3), "wall_ms": summary(w_floor, 1e3, 3)}}
    mf = out["floor"]["cpu_ms"]["mean"]
    out["x_floor_cpu"] = rnd(out["stallwatch"]["cpu_ms"]["mean"] / mf, 2) if mf else None
    mw = out["floor"]["wall_ms"]["median"]
    out["x_floor_wall_median"] = rnd(out["stallwatch"]["wall_ms"]["median"] / mw, 2) if mw else None
    return out


def nvml_part(calls: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "bench"))
    from floor import NvmlFloor

    from stallwatch.probes.gpu import GpuProbe

    fast, fl = GpuProbe(slow_every_s=math.inf), NvmlFloor()
    fl.SLOW_S = math.inf
    res: dict[str, Any] = {"fast": _pair(calls, fast.collect, fl.tick)}
    obs = fast.collect()
    res["devices"] = len(obs.devices)
    res["unsupported"] = sorted({k for d in obs.devices for k in (d.errors or {})})
    slow, fl2 = GpuProbe(slow_every_s=0.0), NvmlFloor()
    fl2.SLOW_S = 0.0
    res["slow"] = _pair(max(10, calls // 10), slow.collect, fl2.tick)
    fast.close()
    slow.close()
    return res


def run(*, calls: int, overhead_params: dict[str, Any] | None, peers_venv: Path | None,
        install_peers: bool = False, baseline_src: Path | None = None) -> dict[str, Any]:
    ok, what = nvml_available()
    out: dict[str, Any] = {"live": ok, "gpu": what}
    if not ok:
        return out
    out["nvml"] = nvml_part(calls)
    if overhead_params:
        from bench import overhead

        out["overhead"] = overhead.run(
            **overhead_params, peers_venv=peers_venv, install_peers=install_peers,
            baseline_src=baseline_src,
            job_argv=[sys.executable, str(ROOT / "bench" / "jobs" / "gpu_job.py"), "--out", "{out}",
                      "--log", "{log}", "--step-s", "0.2"],
            floor_args=("--nvml",), standard_beside=True)
    return out
