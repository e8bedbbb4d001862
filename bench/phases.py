#!/usr/bin/env python3
"""Per-phase CPU of a real daemon: `stallwatch run`, in process, watching a live job.

    python bench/phases.py --job standard|gpu [--seconds 60] [--warm 15] [--out FILE]

The daemon's own methods (each probe's collect() in the probe lane; Collector.tick, features,
Evaluator.evaluate, the state flush and the JobRunner and Daemon steps on the main thread) are
wrapped with `time.thread_time_ns` while the window is open: inclusive CPU of the calling thread
per tick, and each thread's user and system time (/proc/self/task, 10 ms ticks: read over a
window of a minute or more). This is how issue 17's per-phase numbers on the lent H200 were taken
(`bench/results/h200-phases-*.json`). The wrappers cost a few microseconds a call; compare phases
with each other and trees with each other in one run, not with the overhead section's totals.
Run from the root of the tree to measure (it imports stallwatch from the working directory).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import pkgutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(os.getcwd())
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from bench.common import emit  # noqa: E402 - after the tree to measure is put first
_acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # label -> [ns, calls]
_on = [False]


def _wrap(owner: Any, name: str, label: str) -> None:
    f = getattr(owner, name)
    tt = time.thread_time_ns

    @functools.wraps(f)
    def timed(*a: Any, **k: Any) -> Any:
        if not _on[0]:
            return f(*a, **k)
        t = tt()
        try:
            return f(*a, **k)
        finally:
            r = _acc[label]
            r[0] += tt() - t
            r[1] += 1
    setattr(owner, name, timed)


def _patch() -> None:
    import stallwatch.probes as probes
    for m in pkgutil.iter_modules(probes.__path__):
        mod = importlib.import_module(f"stallwatch.probes.{m.name}")
        for n, c in list(vars(mod).items()):
            if isinstance(c, type) and c.__module__ == mod.__name__ and "collect" in vars(c):
                _wrap(c, "collect", f"lane: {n}.collect")
    from stallwatch.probes.collector import Collector
    _wrap(Collector, "tick", "main: Collector.tick (its own CPU, not the lane's)")
    import stallwatch.daemon.job as job
    _wrap(job, "features", "main: features")
    _wrap(job.JobRunner, "tick", "main: JobRunner.tick")
    for n in ("_record", "_persist", "_incidents", "_poll_pid_file", "take_pid_file"):
        if hasattr(job.JobRunner, n):
            _wrap(job.JobRunner, n, f"main: JobRunner.{n}")
    from stallwatch.engine.alerting import Evaluator
    _wrap(Evaluator, "evaluate", "main: Evaluator.evaluate")
    from stallwatch.daemon.alertmemory import AlertMemory
    _wrap(AlertMemory, "save", "main: AlertMemory.save")
    from stallwatch.daemon.state import StateDB
    _wrap(StateDB, "flush", "main: StateDB.flush")
    from stallwatch.daemon.core import Daemon
    for n in ("tick", "_after_tick", "_prune_alert_state", "_update_metrics"):
        _wrap(Daemon, n, f"main: Daemon.{n}")


def _threads() -> dict[int, tuple[str, float, float, float]]:
    """tid -> (name, user s, system s, on-CPU s)."""
    hz = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                s = f.read()
            with open(f"/proc/self/task/{t}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue
        fields = s[s.rindex(")") + 2:].split()
        out[int(t)] = (names.get(int(t), "?"), int(fields[11]) / hz, int(fields[12]) / hz, ns / 1e9)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", choices=("standard", "gpu"), default="standard")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warm", type=float, default=15.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    wd = Path(tempfile.mkdtemp(prefix="stallwatch-phases-"))
    log, outdir = wd / "job.log", wd / "out"
    cmd = ([sys.executable, str(ROOT / "bench/jobs/gpu_job.py"), "--out", str(outdir), "--log", str(log),
            "--step-s", "0.2"] if a.job == "gpu" else
           [sys.executable, str(ROOT / "tests/jobs/extract_like.py"), "--out", str(outdir), "--log", str(log),
            "--n", "100000000", "--sample-s", "0.2"])
    job = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        while not (outdir.exists() and log.exists()):
            if job.poll() is not None:
                raise SystemExit(f"the job exited with {job.returncode}")
            time.sleep(0.1)
        (wd / "job.pid").write_text(f"{job.pid}\n")
        cfg = wd / "stallwatch.toml"
        cfg.write_text(f'[daemon]\ninterval_s = 1\nstate_dir = "{wd}/state"\n\n[[job]]\nname = "job"\n'
                       f'pid_file = "{wd}/job.pid"\nlog = "{log}"\noutputs = "{outdir}"\n')
        _patch()
        from stallwatch.daemon.config import load_config
        from stallwatch.daemon.core import Daemon
        daemon = Daemon(load_config(cfg))
        res: dict[str, Any] = {"job": a.job, "seconds": a.seconds}

        def window() -> None:
            time.sleep(a.warm)
            t0, n0 = _threads(), daemon.ticks
            _on[0] = True
            time.sleep(a.seconds)
            _on[0] = False
            t1, ticks = _threads(), daemon.ticks - n0
            res["ticks"] = ticks
            res["phases_ms_per_tick"] = {k: round(v[0] / 1e6 / ticks, 4) for k, v in
                                         sorted(_acc.items(), key=lambda kv: -kv[1][0])}
            res["calls_per_tick"] = {k: round(v[1] / ticks, 2) for k, v in _acc.items()}
            res["threads_ms_per_tick"] = {
                f"{nm} ({tid})": {"user": round((u - t0[tid][1]) / ticks * 1e3, 3),
                                  "sys": round((s - t0[tid][2]) / ticks * 1e3, 3),
                                  "on_cpu": round((ns - t0[tid][3]) / ticks * 1e3, 3)}
                for tid, (nm, u, s, ns) in t1.items() if tid in t0}
            daemon.request_stop()

        threading.Thread(target=window, daemon=True, name="phases-window").start()
        daemon.run()
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except OSError:
            pass
        job.wait()
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
