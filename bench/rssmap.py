#!/usr/bin/env python3
"""What the daemon's resident memory is made of: /proc/PID/smaps grouped by mapping.

    python bench/rssmap.py [--nvml] [--seconds 30] [--out FILE]

Starts `stallwatch run` watching a sleeping process (and, with --nvml, bench/floor.py reading
NVML beside it: on a GPU host the driver's libraries and their allocations are most of a bare
loop's RSS), waits, and prints each one's RSS by mapping ([anon], [heap], each library), largest
first. This is how issue 17's RSS on the lent H200 was taken apart (`bench/results/h200-rss-*.json`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import emit, start_daemon, workdir


def by_mapping(pid: int, top: int = 25) -> dict[str, Any]:
    """RSS and anonymous KiB per mapping name (a file's base name, or [anon], [heap], ...)."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    name = "[anon]"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if not parts[0].endswith(":"):  # a mapping's header line
                path = parts[5] if len(parts) > 5 else "[anon]"
                name = os.path.basename(path) if path.startswith("/") else path
            elif parts[0] == "Rss:":
                groups[name][0] += int(parts[1])
            elif parts[0] == "Anonymous:":
                groups[name][1] += int(parts[1])
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"rss_kib": sum(v[0] for v in groups.values()),
            "top": [{"mapping": k, "rss_kib": v[0], "anon_kib": v[1]} for k, v in rows[:top]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvml", action="store_true", help="also the floor reading NVML")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    with workdir("rssmap") as wd:
        job = subprocess.Popen(["sleep", str(int(a.seconds) + 60)])
        procs: dict[str, subprocess.Popen] = {}
        try:
            (wd / "job.pid").write_text(f"{job.pid}\n")
            cfg = wd / "stallwatch.toml"
            cfg.write_text(f'[daemon]\ninterval_s = 1\nstate_dir = "{wd}/state"\nevidence = false\n\n'
                           f'[[job]]\nname = "job"\npid_file = "{wd}/job.pid"\n')
            procs["stallwatch"] = start_daemon(cfg, wd / "daemon.log")
            if a.nvml:
                procs["floor_nvml"] = subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("floor.py")), "--pid", str(job.pid),
                     "--log", "/dev/null", "--outputs", str(wd), "--nvml"])
            time.sleep(a.seconds)
            out = {name: (by_mapping(p.pid) if p.poll() is None else {"exited": p.returncode})
                   for name, p in procs.items()}
        finally:
            for p in (*procs.values(), job):
                p.kill()
                p.wait()
    emit(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
