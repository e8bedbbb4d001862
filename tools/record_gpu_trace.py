#!/usr/bin/env python
"""Record a real GPU trace for CI to replay: busy -> SIGSTOP -> SIGKILL, seen by `stallwatch record`.

Run on a machine with an NVIDIA GPU and torch (the lead ran it on the lent H200):

    PYTHONPATH=. python tools/record_gpu_trace.py --out tests/data/gpu_stop_kill.jsonl

The child holds GPU memory, runs a matmul loop and reports progress with tqdm into a log, as an
extraction job would. The recorder is the real CLI in its own process. Phase boundaries (wall
times) are written into the trace as `event` lines, so replay tests can assert verdicts per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import os, sys, time, torch
from tqdm import tqdm
hold = torch.empty(int(os.environ["HOLD_BYTES"]), dtype=torch.uint8, device="cuda")
a = torch.randn(8192, 8192, device="cuda"); b = torch.randn(8192, 8192, device="cuda")
torch.cuda.synchronize()
total = 100000
with open(os.environ["LOG"], "a", buffering=1) as log:
    print("ready", flush=True)
    bar = tqdm(total=total, desc="Generating Hidden States", file=log, mininterval=0.2)
    for i in range(total):
        for _ in range(8):
            c = a @ b
        torch.cuda.synchronize()
        bar.update(1)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--busy-s", type=float, default=15)
    ap.add_argument("--stopped-s", type=float, default=20)
    ap.add_argument("--after-kill-s", type=float, default=8)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--hold-gib", type=float, default=8)
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="sw-gpu-")
    log = os.path.join(work, "extract.log")
    env = dict(os.environ, LOG=log, HOLD_BYTES=str(int(a.hold_gib * (1 << 30))))
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    if child.stdout.readline().strip() != "ready":
        print("child did not start", file=sys.stderr)
        return 2
    total_s = a.busy_s + a.stopped_s + a.after_kill_s + 2
    rec = subprocess.Popen([sys.executable, "-m", "stallwatch", "record", "--pid", str(child.pid),
                            "--log", log, "--out", a.out, "--interval", str(a.interval),
                            "--duration", str(total_s), "--note",
                            "tools/record_gpu_trace.py: torch matmul + tqdm log; busy, SIGSTOP, SIGKILL"])
    phases = [{"phase": "busy", "wall": time.time()}]
    time.sleep(a.busy_s)
    os.kill(child.pid, signal.SIGSTOP)
    phases.append({"phase": "stopped", "wall": time.time()})
    time.sleep(a.stopped_s)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    phases.append({"phase": "killed", "wall": time.time()})
    rec.wait()
    with open(a.out, "a") as f:
        for p in phases:
            f.write(json.dumps({"type": "event", "kind": "phase", **p}) + "\n")
    print(json.dumps({"out": a.out, "phases": phases, "recorder_rc": rec.returncode}))
    return rec.returncode


if __name__ == "__main__":
    sys.exit(main())
