#!/usr/bin/env python3
"""The gpu probe's Python around NVML, without a GPU: GpuProbe.collect() on tests/fakes.py's
FakeNvml (pynvml's own constants, structures and exceptions), against the same NVML calls made
raw (bench/floor.py's NvmlFloor shape), in CPU time a collect. Issue 17's A/B of the probe.

    python bench/gpu_fake.py --src DIR --gpus 8 --collects 2000 --mode vary

--src: the source tree to import stallwatch from (a baseline checkout beside this one); the
fake comes from this tree's tests/. --mode: `vary` changes utilisation and power every collect
(a busy GPU), `steady` changes nothing (an idle one: the probe hands on its observations),
`floor` makes the raw calls. The slow path (every 10 s, in a thread of its own in the daemon) is off,
as in bench/gpu_live.py's `fast` pair. CPU time here swings with the host (docs/performance.md); for
instructions, run it under `valgrind --tool=callgrind` with --collects 0 and N and subtract.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(HERE.parent))
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--collects", type=int, default=2000)
    ap.add_argument("--mode", choices=("vary", "steady", "floor"), default="vary")
    a = ap.parse_args()
    sys.path[:0] = [a.src, str(HERE.parent / "tests")]
    import pynvml
    from fakes import GiB, FakeGpu, FakeNvml

    from stallwatch.clock import FakeClock
    from stallwatch.kernel.nvml import Nvml
    from stallwatch.probes.gpu import GpuProbe

    ecc = {(e, c): 0 for e in (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)
           for c in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC)}
    gpus = [FakeGpu(uuid=f"GPU-{i}", util=(97, 41), mem=(141 * GiB, 40 * GiB, 100 * GiB, GiB),
                    compute=[(1000 + i, 30 * GiB, 0xFFFFFFFF, 0xFFFFFFFF)], ecc=dict(ecc), temp=61,
                    power_mw=650_123, samples=[(1000 + i, 1_000, 50, 10)], pcie_kb=(1000, 2000))
            for i in range(a.gpus)]
    lib, clock = FakeNvml(gpus), FakeClock()
    tick = floor_tick(lib) if a.mode == "floor" else GpuProbe(
        nvml=Nvml(lib=lib, clock=clock), clock=clock, slow_every_s=math.inf).collect

    def step(k: int) -> None:
        if a.mode == "vary":
            for g in gpus:
                g.util, g.power_mw = (90 + k % 7, 40 + k % 3), 650_000 + k % 13
        clock.advance(1.0)
        tick()

    for k in range(20):  # the first collect resolves spellings and registers events
        step(k)
    t0 = time.process_time()
    for k in range(a.collects):
        step(k)
    cpu_us = (time.process_time() - t0) / max(a.collects, 1) * 1e6
    print(f"{a.mode} gpus={a.gpus} collects={a.collects} cpu_us_per_collect={cpu_us:.1f}")


def floor_tick(n: Any) -> Any:
    """NvmlFloor.tick's calls (bench/floor.py) on the double, the probe's spellings."""
    n.nvmlInit()
    handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
    events = n.nvmlEventSetCreate()
    for h in handles:
        n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, events)

    def attempt(fn: Any, *args: Any) -> Any:  # the floor keeps no results
        try:
            return fn(*args)
        except n.NVMLError:
            return None

    def tick() -> None:
        for h in handles:
            attempt(n.nvmlDeviceGetUtilizationRates, h)
            attempt(n.nvmlDeviceGetMemoryInfo, h, n.nvmlMemory_v2)
            attempt(n.nvmlDeviceGetComputeRunningProcesses_v3, h)
            attempt(n.nvmlDeviceGetGraphicsRunningProcesses_v3, h)
            attempt(n.nvmlDeviceGetPersistenceMode, h)
            attempt(n.nvmlDeviceGetCurrentClocksEventReasons, h)
            for counter in (n.NVML_VOLATILE_ECC, n.NVML_AGGREGATE_ECC):
                for etype in (n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_MEMORY_ERROR_TYPE_CORRECTED):
                    attempt(n.nvmlDeviceGetTotalEccErrors, h, etype, counter)
            attempt(n.nvmlDeviceGetTemperatureV, h, n.NVML_TEMPERATURE_GPU)
            attempt(n.nvmlDeviceGetPowerUsage, h)
            attempt(n.nvmlDeviceGetPerformanceState, h)
        attempt(n.nvmlEventSetWait_v2, events, 0)

    return tick


if __name__ == "__main__":
    main()
