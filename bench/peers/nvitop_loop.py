#!/usr/bin/env python3
"""nvitop's API doing what its monitor does each refresh, at a fixed interval (a peer for bench/).

    <peers-venv>/bin/python bench/peers/nvitop_loop.py --pid PID [--interval 1]

Per refresh: every NVML device and its processes (Device.all(), device.processes(),
GpuProcess.take_snapshots), the host's CPU, memory, swap and load (the monitor's header), and
the job's process tree as host snapshots with the attributes nvitop shows for a GPU process
(status, user, name, command line, CPU %, memory %, RSS, running time). Without a GPU,
Device.all() is empty (NVML is not found): only the host part runs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from nvitop import Device, GpuProcess, HostProcess, host

ATTRS = ["status", "username", "name", "cmdline", "cpu_percent", "memory_percent", "memory_info",
         "create_time", "num_threads"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--report", help="write what it could read here (JSON) at exit")
    a = ap.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    seen = {"devices": None, "gpu_processes": 0, "host_processes": 0, "errors": []}
    nxt = time.monotonic()
    while not stop:
        try:
            devices = Device.all()
            seen["devices"] = len(devices)
            procs = []
            for d in devices:
                procs += list(d.processes().values())
            snaps = GpuProcess.take_snapshots(procs, failsafe=True) if procs else []
            seen["gpu_processes"] = len(snaps)
        except Exception as e:  # noqa: BLE001 - what the peer can do without a GPU is the point
            if len(seen["errors"]) < 3:
                seen["errors"].append(f"{type(e).__name__}: {e}")
        host.cpu_percent()
        host.virtual_memory()
        host.swap_memory()
        host.load_average()
        try:
            root = HostProcess(a.pid)
            tree = [root] + root.children(recursive=True)
            snaps = [p.as_snapshot(attrs=ATTRS) for p in tree]
            seen["host_processes"] = len(snaps)
        except Exception as e:  # noqa: BLE001 - what the peer can do without a GPU is the point
            if len(seen["errors"]) < 3:
                seen["errors"].append(f"{type(e).__name__}: {e}")
        nxt += a.interval
        d = nxt - time.monotonic()
        if d > 0:
            time.sleep(d)
        else:
            nxt = time.monotonic()
    if a.report:
        with open(a.report, "w") as f:
            json.dump(seen, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
