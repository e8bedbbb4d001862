"""A long healthy SpecForge-shaped run ends in a slow write-queue drain: nothing may be raised.

    python -m bench.specforge_drain --out bench/results/specforge_drain.json

tests/jobs/specforge_job.py under `torchrun --nproc_per_node 3` (gloo, CPU) for about ten
minutes, its writes slowed (`--write-s`, one writer thread a rank, `--io-queue-size 50`) so that
the queue is full the whole run and takes about a minute to drain after the bars close (the
`Finalizing Writes` bars, as upstream's HEAD prints them). `stallwatch record` follows it; the
trace is judged on replay by the default rules. Issue 14's bar: every verdict is `healthy` (or
`unknown` before the first progress, `finished` after the exit) and no alert fires.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stallwatch.engine.features import features
from stallwatch.commands.replay import evaluate_trace
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.trace import read_trace

JOB = Path(__file__).resolve().parents[1] / "tests" / "jobs" / "specforge_job.py"
OK = {"healthy", "unknown", "finished"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=1350)
    ap.add_argument("--write-s", type=float, default=1.2)
    ap.add_argument("--interval", type=float, default=2.0)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specforge-drain-"))
    log, hs, trace = work / "job.log", work / "hs", work / "trace.jsonl.gz"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", str(JOB),
           "--output-path", str(hs), "--num-samples", str(a.samples), "--batch-size", "4",
           "--batch-s", "0.2", "--write-s", str(a.write_s), "--num-io-threads", "1",
           "--io-queue-size", "50"]
    t0 = time.time()
    with open(log, "wb") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    rec = subprocess.Popen([sys.executable, "-m", "stallwatch", "record", "--pid", str(job.pid),
                            "--log", str(log), "--outputs", str(hs), "--out", str(trace),
                            "--interval", str(a.interval)], stdout=subprocess.DEVNULL)
    rc = job.wait()
    text = log.read_text(errors="replace")
    time.sleep(3 * a.interval)
    rec.send_signal(2)
    rec.wait(60)
    _, rows, _ = evaluate_trace(trace)
    kinds = collections.Counter(r["kind"] for r in rows)
    bad = [r for r in rows if r["kind"] not in OK]
    fired = sorted({n for r in rows for n in r["firing"] if n not in ("healthy", "finished")})
    # the drain: from the first snapshot whose bars are all closed (with the closing lines) to
    # the first one that sees the job gone
    _, snaps, _ = read_trace(trace)
    t_closed = t_exit = None
    for s in snaps:
        v = features(Snapshot.model_validate({k: x for k, x in s.items() if k != "type"}))
        if t_closed is None and v["log"]["complete"]:
            t_closed = v["now_wall"]
        if t_exit is None and v["job"]["exited"]:
            t_exit = v["now_wall"]
    drain_s = round(t_exit - t_closed, 1) if t_closed and t_exit else None
    closed = text.count("Generation loop finished.")
    doc = {"job_rc": rc, "seconds": round(time.time() - t0, 1), "snapshots": len(rows),
           "verdicts": dict(kinds), "not_ok": [(r["t_s"], r["kind"], r["summary"]) for r in bad][:10],
           "firing_other_than_healthy": fired, "closing_lines": closed, "drain_s": drain_s,
           "finalizing_bars": text.count("Finalizing Writes"),
           "files": sum(1 for _ in hs.rglob("data_*.ckpt")), "work": str(work)}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0 if rc == 0 and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
