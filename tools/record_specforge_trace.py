#!/usr/bin/env python
"""Record a SpecForge-shaped torchrun extraction holding the GPU with a stuck rank, and diagnose it
with no arguments: the GPU truth that CI replays (tests/test_specforge_gpu_trace.py).

Run on a machine with an NVIDIA GPU and torch (issue 14 ran it on the lent H200):

    PYTHONPATH=. python tools/record_specforge_trace.py --out-dir OUT

The job is tests/jobs/specforge_job.py under `torchrun --nproc_per_node 2` with `--device cuda`
(both ranks on GPU 0, each holding `--hold-gib` besides its weights; collectives on gloo), DP
ranks; rank 1's writer deadlocks half-way through a file at batch `--fault-batch`, rank 0
finishes its bar and waits at the final barrier. `stallwatch record` follows the agent from the
start; once the log has been silent for `--stuck-s`, zero-config `stallwatch diagnose` (text,
then JSON) runs from the job's folder; then the tree is killed. Phase boundaries go into the
trace as `event` lines. Files in OUT: specforge_h200.jsonl.gz, diagnose.txt, diagnose.json,
job.log, driver.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = Path(__file__).resolve().parents[1] / "tests" / "jobs" / "specforge_job.py"


def wait_for(probe, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        v = probe()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s:g} s")
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    """Child pids, from a scan of /proc/*/stat (gVisor has no task/TID/children file)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[1]) == pid:
            out.append(int(name))
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hold-gib", type=float, default=4.0)
    ap.add_argument("--num-samples", type=int, default=480)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batch-s", type=float, default=0.3)
    ap.add_argument("--fault-batch", type=int, default=8)
    ap.add_argument("--stuck-s", type=float, default=32.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--after-kill-s", type=float, default=6.0)
    a = ap.parse_args()

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="specforge-"))
    hs, log = work / "hs", work / "job.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), str(JOB),
           "--output-path", str(hs), "--num-samples", str(a.num_samples),
           "--batch-size", str(a.batch_size), "--batch-s", str(a.batch_s), "--device", a.device,
           "--gpu-mem-gib", str(a.hold_gib), "--fault", "deadlock", "--fault-rank", "1",
           "--fault-batch", str(a.fault_batch)]
    t0 = time.time()
    with open(log, "wb") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work)
    phases = [{"phase": "running", "wall": time.time()}]
    driver: dict = {"cmd": cmd, "work": str(work), "launcher": job.pid}
    rec = None
    trace = out / "specforge_h200.jsonl.gz"
    try:
        wait_for(lambda: len(children(job.pid)) >= a.nproc, 120, "workers")
        driver["workers"] = children(job.pid)
        total_s = 240.0
        rec = subprocess.Popen([sys.executable, "-m", "stallwatch", "record", "--pid", str(job.pid),
                                "--log", str(log), "--outputs", str(hs), "--out", str(trace),
                                "--interval", str(a.interval), "--duration", str(total_s), "--note",
                                "tools/record_specforge_trace.py: torchrun x2 on one GPU, DP ranks, "
                                "rank 1 deadlocked mid-write"], env=env)
        marker = hs / ".specforge_job_fault_deadlock_rank1"
        wait_for(marker.exists, 240, "fault")
        phases.append({"phase": "stuck", "wall": time.time()})
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        wait_for(lambda: "Generation loop finished" in text(), 240, "rank 0's closing line")
        phases.append({"phase": "others_done", "wall": time.time()})
        time.sleep(a.stuck_s)
        phases.append({"phase": "diagnose", "wall": time.time()})
        d = subprocess.run([sys.executable, "-m", "stallwatch", "diagnose"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
        (out / "diagnose.txt").write_text(f"$ stallwatch diagnose   (cwd {work}, exit {d.returncode})\n"
                                          + d.stderr + d.stdout)
        j = subprocess.run([sys.executable, "-m", "stallwatch", "diagnose", "--json"], cwd=work,
                           env=env, capture_output=True, text=True, timeout=120)
        (out / "diagnose.json").write_text(j.stdout or j.stderr)
        driver["diagnose_rc"], driver["diagnose_json_rc"] = d.returncode, j.returncode
    finally:
        phases.append({"phase": "killed", "wall": time.time()})
        kids = children(job.pid)
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout=15)
        except subprocess.TimeoutExpired:
            job.kill()
        for k in kids:
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if rec is not None:
            time.sleep(a.after_kill_s)
            rec.send_signal(signal.SIGINT)
            try:
                driver["recorder_rc"] = rec.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rec.kill()
                driver["recorder_rc"] = "killed"
        driver["phases"] = phases
        if rec is not None and trace.exists():
            with gzip.open(trace, "at", encoding="utf-8") as f:  # a second gzip member: still one stream
                for p in phases:
                    f.write(json.dumps({"type": "event", "kind": "phase", **p}) + "\n")
        driver["seconds"] = round(time.time() - t0, 1)
        (out / "job.log").write_bytes(log.read_bytes()[-200_000:])
        (out / "driver.json").write_text(json.dumps(driver, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
