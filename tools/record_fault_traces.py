#!/usr/bin/env python
"""Record the golden fault traces that CI replays (tests/test_golden_traces.py).

Run as root on a Linux machine (loop devices, fsfreeze, memory cgroups, /dev/kmsg):

    sudo .venv/bin/python tools/record_fault_traces.py                 # all of them
    sudo .venv/bin/python tools/record_fault_traces.py deadlock crash  # some

Each fault rig of tests/faultrigs.py runs the extraction-like job (tests/jobs/extract_like.py);
the real `stallwatch record` CLI, in its own process, records it with `--interval 0.5`. The fault
comes after a healthy lead-in of about 10 s, and the recording goes on for about 40 s past it:
long enough for a stall of a job with a 0.2 s cadence to pass the 20 s threshold floor. The trace
then gets `event` lines appended:

    {"type":"event","kind":"rig", "pid":..., "mount":..., "device":..., "server_port":...}
    {"type":"event","kind":"phase","phase":"fault","wall":...}     (and "exit", "oom_start", ...)

so the replay tests can check verdicts per phase and evidence against what the rig knows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import faultrigs
from rigs import wait_until

NOTES = {
    "healthy": "no fault: a sample every 0.2 s, one output file each",
    "deadlock": "two threads take two locks in opposite order (--deadlock-at): all threads in S",
    "busy_loop": "the main thread spins on a flag (--spin-at): state R, no progress",
    "crash": "RuntimeError at sample N (--crash-at): traceback, exit code 1, left unreaped",
    "oom": "allocates until its memory cgroup's limit (--oom-at): OOM-killed, SIGKILL",
    "fsfreeze": "outputs on a loop-mounted ext4 frozen with fsfreeze -f: the writer in D",
    "server_stopped": "the loopback inference server SIGSTOPped: the client blocks in recvfrom",
    "checkpoint": "a 45 s checkpoint write (--checkpoint-every): I/O moves, no progress lines",
}
IN_JOB = {"deadlock", "busy_loop", "crash", "oom", "checkpoint"}  # faults at sample `at`
CHECKPOINT_S = 45.0


def record(name: str, out: Path, lead_in: float, after: float, interval: float) -> dict:
    recorder_startup_s = 1.5  # the recorder's first snapshot comes about this long after spawn
    at = 3 + round((lead_in + recorder_startup_s) / faultrigs.SAMPLE_S)
    kw = {"at": at, "seconds": CHECKPOINT_S}
    with faultrigs.RIGS[name](**kw) as rig:
        rig.wait_progress(3)
        argv = [sys.executable, "-m", "stallwatch", "record", "--pid", str(rig.pid),
                "--log", str(rig.log), "--outputs", str(rig.out), "--interval", str(interval),
                "--out", str(out), "--note", f"tools/record_fault_traces.py {name}: {NOTES[name]}"]
        if rig.server:
            argv += ["--server", rig.server]
        started = time.time()
        rec = subprocess.Popen(argv, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            # The lead-in counts from the recorder's first snapshot, not from its spawn.
            wait_until(lambda: out.exists() and out.read_text().count('"type":"snapshot"') >= 1,
                       30, "the recorder's first snapshot")
            started = time.time()
            if name == "healthy":
                end = started + lead_in + after
            else:
                if name not in IN_JOB:
                    time.sleep(lead_in)  # a planned healthy stretch, not a wait for an event
                rig.fault(timeout=lead_in + 60)
                end = rig.fault_wall + after
                if name == "checkpoint":
                    rig.phases["checkpoint_end"] = rig.wait_log("checkpoint saved", CHECKPOINT_S + 30)
                    end = max(end, rig.phases["checkpoint_end"] + 10)
            # Recording the fault as it ages: wall time passing is the point here.
            time.sleep(max(0.0, end - time.time()))
        finally:
            rec.send_signal(signal.SIGINT)
            rc = rec.wait(timeout=30)
        facts = rig.facts()
        phases = {"record_start": started}
        if rig.fault_wall is not None:
            phases["fault"] = rig.fault_wall
        phases.update(rig.phases)
    with open(out, "a") as f:
        f.write(json.dumps({"type": "event", "kind": "rig", **facts}) + "\n")
        f.writelines(json.dumps({"type": "event", "kind": "phase", "phase": phase, "wall": wall}) + "\n" for phase, wall in sorted(phases.items(), key=lambda kv: kv[1]))
    return {"trace": str(out), "recorder_rc": rc, "bytes": out.stat().st_size,
            "phases": {k: round(v - started, 2) for k, v in phases.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("faults", nargs="*", help=f"default: all of {', '.join(faultrigs.RIGS)}")
    ap.add_argument("--outdir", type=Path, default=REPO / "tests" / "data" / "traces")
    ap.add_argument("--lead-in", type=float, default=10.0)
    ap.add_argument("--after", type=float, default=40.0)
    ap.add_argument("--interval", type=float, default=0.5)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root: loop devices, fsfreeze, memory cgroups, /dev/kmsg", file=sys.stderr)
        return 3
    unknown = [f for f in a.faults if f not in faultrigs.RIGS]
    if unknown:
        print(f"unknown fault(s) {unknown}; known: {', '.join(faultrigs.RIGS)}", file=sys.stderr)
        return 3
    a.outdir.mkdir(parents=True, exist_ok=True)
    rc = 0
    for name in a.faults or list(faultrigs.RIGS):
        res = record(name, a.outdir / f"{name}.jsonl", a.lead_in, a.after, a.interval)
        print(json.dumps({name: res}), flush=True)
        rc |= res["recorder_rc"] != 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
