"""`stallwatch run -- COMMAND`: start-up to the first verdict, and what the live footer costs.

    .venv/bin/python bench/oneliner.py [--runs 5] [--refreshes 300] [--out bench/results/oneliner.json]

- **start-up**: `stallwatch run` (no terminal, plain lines) of a healthy job (tests/jobs/
  pt_writer.py, a progress line every 0.2 s), from the spawn to the first plain line whose verdict
  is not `unknown`, and to the first line at all; `--runs` times, median and max. Wall time: it is
  what the user waits for (on a busy machine it is longer, and that is measured too).
- **footer**: one refresh is what the foreground daemon does after each tick: `job_view` of a
  real JobRunner-shaped job (a real state database with an incident and its actions, five minutes
  of history, two ranks and a GPU in the variables), `footer_text` at 120 columns, the redraw
  written to a real pseudo-terminal. CPU time (process_time) per refresh, p50/p99 over
  `--refreshes`, and as a share of one core at the default refresh rate (1 Hz: one per tick).
- **pass-through**: the Tee following an idle log for 10 s (it polls every 50 ms): CPU share.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stallwatch.daemon.config import JobConfig  # noqa: E402 - after the sys.path insert: run from a checkout
from stallwatch.engine.alerting import Verdict  # noqa: E402 - after the sys.path insert: run from a checkout
from stallwatch.engine.history import History, Sample  # noqa: E402 - after the sys.path insert: run from a checkout
from stallwatch.commands.live import Footer, Tee, footer_text, job_view  # noqa: E402 - after the sys.path insert: run from a checkout
from stallwatch.daemon.state import StateDB  # noqa: E402 - after the sys.path insert: run from a checkout


def startup(runs: int) -> dict:
    first, verdict = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="sw-bench-run-") as d:
            argv = [sys.executable, "-m", "stallwatch", "run", "--state-dir", f"{d}/st", "--",
                    sys.executable, str(ROOT / "tests/jobs/pt_writer.py"), "--out", f"{d}/out",
                    "--count", "60", "--interval", "0.2"]
            t0 = time.monotonic()
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, cwd=d)
            t_first = t_verdict = None
            for line in p.stderr:
                if not line.startswith("stallwatch: pt_writer: "):
                    continue
                t_first = t_first or time.monotonic() - t0
                if not line.startswith("stallwatch: pt_writer: unknown"):
                    t_verdict = time.monotonic() - t0
                    break
            p.terminate()  # passed to the job as SIGTERM: it ends, and so does stallwatch
            p.communicate(timeout=30)
            first.append(t_first)
            verdict.append(t_verdict)
    return {"runs": runs, "first_line_s": _stats(first), "first_verdict_s": _stats(verdict),
            "target_s": 2.0, "met": max(verdict) <= 2.0}


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 3), "max": round(xs[-1], 3),
            "p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 5)}


def fake_runner(state_dir: Path):
    """A JobRunner as job_view reads it: a real state database, real history, real variables."""
    db = StateDB.open(state_dir)
    db.ensure_job("extract", "command", "{}")
    db.update_job("extract", phase="running", restarts=1)
    iid, _ = db.open_incident("extract", "hang", "no progress for 31 s", {}, started_at=time.time() - 600)
    for what in ("detect", "evidence", "kill", "validate", "restart"):
        db.add_action("extract", what, f"{what}: done", incident_id=iid)
    db.resolve_incident(iid, time.time() - 500)
    h = History(keep=600)
    now = time.time()
    for i in range(300):
        h.add(Sample(t=now - 300 + i, done=i * 3.0, gpu_util_pct=90.0 + i % 7,
                     gpu_mem_bytes=40e9, cpu_cores=1.2, io_bytes=i * 2e6))
    lg = {"has_progress": True, "done": 900.0, "total": 4000.0, "total_known": True,
          "rate_per_s": 3.0, "eta_s": 1033.0, "idle_s": 0.3, "idle_known": True,
          "ranks": [{"rank": r, "done": 450.0, "total": 2000.0, "rate_per_s": 1.5, "eta_s": 1033.0,
                     "idle_s": 0.3} for r in (0, 1)]}
    gpu = {"present": True, "job_gpus": [0, 1], "list": [
        {"index": g, "util_pct": 93.0, "mem_used_bytes": 40e9, "mem_total_bytes": 141e9}
        for g in (0, 1)]}
    return SimpleNamespace(
        name="extract", db=db, phase="running", verdict=Verdict(kind="healthy", summary="ok"),
        last_vars={"log": lg, "gpu": gpu, "job": {"pid": 4242}}, history=h,
        run_row={"pid": 4242, "seq": 2}, cfg=JobConfig(name="extract", command=("x",),
                                                       restart="on-failure"))


def footer(refreshes: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sw-bench-footer-") as d:
        runner = fake_runner(Path(d))
        daemon = SimpleNamespace(jobs={"extract": runner})
        master, slave = pty.openpty()
        drain = threading.Thread(target=_drain, args=(master,), daemon=True)
        drain.start()
        os.environ.setdefault("COLUMNS", "120")
        f = Footer(slave)
        f.cols, f.rows = 120, 40
        cpu = []
        for _ in range(refreshes):
            t0 = time.process_time()
            f.update(daemon)
            cpu.append(time.process_time() - t0)
        f.close()
        rows = footer_text([job_view(runner)], 120, color=False)
        runner.db.close()
        os.close(slave)
    p50 = statistics.median(cpu)
    return {"refreshes": refreshes, "cpu_per_refresh_s": _stats(cpu), "refresh_hz": 1.0,
            "core_pct_at_1hz": round(100.0 * p50 * 1.0, 3), "target_core_pct": 2.0,
            "met": 100.0 * p50 <= 2.0, "rows": rows}


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 65536):
                return
        except OSError:
            return


def passthrough(seconds: float = 10.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="sw-bench-tee-") as d:
        log = Path(d) / "job.log"
        log.write_bytes(b"x\n")
        t = Tee(log, lambda b: None)
        c0 = time.process_time()
        t.start()
        time.sleep(seconds)  # the measured window: an idle log
        t.stop()
        used = time.process_time() - c0
    return {"seconds": seconds, "cpu_s": round(used, 4), "core_pct": round(100 * used / seconds, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--refreshes", type=int, default=300)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    res = {"machine": {"cpus": os.cpu_count(), "load1": os.getloadavg()[0]},
           "startup": startup(a.runs), "footer": footer(a.refreshes),
           "passthrough": passthrough()}
    text = json.dumps(res, indent=2, ensure_ascii=False)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0 if res["startup"]["met"] and res["footer"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
