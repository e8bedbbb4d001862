#!/usr/bin/env python3
"""In-process tick cost: collector.tick() + features() + rules evaluation, in CPU time.

Run by bench/run.py in a subprocess per source tree (so a baseline tree can be measured side by
side with this one):

    python bench/tickcost.py --src DIR --what tick|log|outputs|tree|rules --params JSON

and prints one JSON document on its last line of stdout. CPU is time.process_time(): every
thread of this process (the probes run in worker threads, inotify in watchdog's), so what a
tick costs the daemon, not only its main thread. Wall time (perf_counter) is reported for the
tick's latency (p99).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RULES_DIR = ROOT / "rules"


def _summary(xs: list[float], scale: float = 1e3, digits: int = 3) -> dict[str, Any]:
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # after the measured source tree: bench/ only
    from bench.common import summary

    return summary(xs, scale, digits)


# ----------------------------------------------------------------------------- the tick loop

def _sw(path: str, name: str, before: str) -> Any:
    """stallwatch's `name` from `path`, or from `before`, where a baseline tree from before
    issue 21's moves has it (the tick section runs such a tree side by side)."""
    import importlib

    try:
        return getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError):
        return getattr(importlib.import_module(before), name)


class Ticker:
    """Runs ticks and records, per tick, CPU (all threads) and wall time of each stage."""

    def __init__(self, collector, rules=None) -> None:
        from stallwatch.engine import Evaluator

        load = _sw("stallwatch.engine.diagnose", "load", "stallwatch.diagnose")
        self.collector = collector
        self.evaluator = Evaluator(rules if rules is not None else load([RULES_DIR]))
        self.rows: list[dict[str, float]] = []
        self.last = None

    def tick(self) -> Any:
        features = _sw("stallwatch.engine.features", "features", "stallwatch.features")
        c0, w0 = time.process_time(), time.perf_counter()
        snap = self.collector.tick()
        c1 = time.process_time()
        v = features(snap)
        c2 = time.process_time()
        ev = self.evaluator.evaluate(v, snap.t_mono)
        c3, w3 = time.process_time(), time.perf_counter()
        self.rows.append({"cpu": c3 - c0, "collect": c1 - c0, "features": c2 - c1,
                          "rules": c3 - c2, "wall": w3 - w0})
        self.last = (snap, v, ev)
        return snap

    def run(self, n: int, interval: float, before=None) -> None:
        nxt = time.monotonic()
        for i in range(n):
            if before is not None:
                before(i)
            self.tick()
            if interval > 0:
                nxt += interval
                d = nxt - time.monotonic()
                if d > 0:
                    time.sleep(d)
                else:
                    nxt = time.monotonic()

    def report(self, skip: int = 0) -> dict[str, Any]:
        rows = self.rows[skip:]
        return {
            "ticks": len(rows),
            "cpu_ms": _summary([r["cpu"] for r in rows]),
            "wall_ms": _summary([r["wall"] for r in rows]),
            "collect_cpu_ms": _summary([r["collect"] for r in rows]),
            "features_cpu_ms": _summary([r["features"] for r in rows]),
            "rules_cpu_ms": _summary([r["rules"] for r in rows]),
        }


def _collector(target, **kw):
    return _sw("stallwatch.probes.collector", "Collector", "stallwatch.collector")(target, **kw)


def _spawn(argv: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, **kw)


def _kill(p: subprocess.Popen | None) -> None:
    if p is None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _healthy_job(work: Path) -> tuple[subprocess.Popen, Path, Path]:
    log, out = work / "job.log", work / "out"
    p = _spawn([sys.executable, str(ROOT / "tests" / "jobs" / "extract_like.py"), "--out", str(out),
                "--log", str(log), "--n", "10000000", "--sample-s", "0.2"])
    deadline = time.monotonic() + 30
    while not (log.exists() and b"/" in log.read_bytes()[-200:]):
        if time.monotonic() > deadline or p.poll() is not None:
            raise RuntimeError("the healthy job did not start")
        time.sleep(0.1)
    return p, log, out


# ------------------------------------------------------------------------------------ tick

def what_tick(params: dict[str, Any], work: Path) -> dict[str, Any]:
    """A healthy job (a progress line and an output file every 0.2 s): the steady tick."""
    Target = _sw("stallwatch.probes.targets", "Target", "stallwatch.targets")

    job, log, out = _healthy_job(work)
    try:
        time.sleep(2)
        c = _collector(Target(name="job", pids=(job.pid,), log=log, outputs=out))
        t = Ticker(c)
        cpu0, w0 = time.process_time(), time.monotonic()
        t.run(params["ticks"], params.get("interval", 1.0))
        cpu_all, wall = time.process_time() - cpu0, time.monotonic() - w0
        rep = t.report(skip=2)
        # Threads work between ticks too (inotify events): the whole process's CPU per tick.
        rep["process_cpu_ms_per_tick"] = round(cpu_all / len(t.rows) * 1e3, 3)
        rep["process_cpu_pct_of_core"] = round(cpu_all / wall * 100, 3)
        rep["verdict"] = t.last[2].verdict.kind
        rep["probe_ms_last"] = {r.name: round(r.duration_s * 1e3, 3) for r in t.last[0].probes}
        c.close()
        return rep
    finally:
        _kill(job)


# ------------------------------------------------------------------------------------- log

_BAR = ("\rGenerating Hidden States:  49%|████▉     | {n}/37312 [04:58<05:07,  1.03it/s, "
        "processed={n}, skipped=0]")


def _block(size: int, start: int = 0) -> bytes:
    parts, n, total = [], start, 0
    while total < size:
        s = _BAR.format(n=n).encode()
        parts.append(s)
        total += len(s)
        n += 1
    return b"".join(parts)


WRITER = r"""
import os, sys, time
path, rate, block = sys.argv[1], float(sys.argv[2]), open(sys.argv[3], 'rb').read()
fd = os.open(path, os.O_WRONLY | os.O_APPEND)
step = 0.1
chunk = int(rate * step)
nxt = time.monotonic()
while True:
    left = chunk
    while left > 0:
        n = min(left, len(block))
        os.write(fd, block[:n])
        left -= n
    nxt += step
    d = nxt - time.monotonic()
    if d > 0:
        time.sleep(d)
"""

SLOW_WRITER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
n = 0
while True:
    n += 1
    os.write(fd, ('\rGenerating Hidden States:  49%%|####      | %d/37312 [04:58<05:07,  5.00it/s]' % n).encode())
    time.sleep(0.2)
"""


def what_log(params: dict[str, Any], work: Path) -> dict[str, Any]:
    """Tick cost against the log's size, the log growing at `rate` bytes/s while measured."""
    from stallwatch.probes.targets import Target

    block_path = work / "block.bin"
    block = _block(2 << 20)
    block_path.write_bytes(block)
    rows = []
    for size in params["sizes"]:
        for rate in params["rates"]:
            log = work / "big.log"
            with open(log, "wb") as f:
                left = size
                while left > 0:
                    n = min(left, len(block))
                    f.write(block[:n])
                    left -= n
            writer = (_spawn([sys.executable, "-c", WRITER, str(log), str(rate), str(block_path)])
                      if rate > 1000 else _spawn([sys.executable, "-c", SLOW_WRITER, str(log)]))
            try:
                time.sleep(0.5)
                c = _collector(Target(name="job", pids=(writer.pid,), log=log), gpu=False)
                t = Ticker(c)
                t.tick()  # first sight: learns history from the last 1 MiB
                first = dict(t.rows[0])
                t.run(params["ticks"], 1.0)
                lo = t.last[0].log
                rep = t.report(skip=1)
                rows.append({
                    "size_bytes": size, "rate_bytes_per_s": rate if rate > 1000 else "one bar every 0.2 s",
                    "first_tick_cpu_ms": round(first["cpu"] * 1e3, 3),
                    "cpu_ms": rep["cpu_ms"], "wall_ms": rep["wall_ms"],
                    "size_at_end_bytes": lo.size_bytes, "backlog_bytes_at_end": lo.backlog_bytes,
                    "read_bytes_total": lo.read_bytes_total,
                    "log_probe_read_mib_per_tick": round(lo.read_bytes_total / max(1, len(t.rows)) / 2**20, 2),
                })
                print(f"    log {size >> 20} MiB @ {rate >> 20 if rate > 1000 else 'slow'}: "
                      f"{rep['cpu_ms']['median']} ms/tick", file=sys.stderr, flush=True)
                c.close()
            finally:
                _kill(writer)
                log.unlink(missing_ok=True)
    return {"rows": rows, "chunk_budget_bytes_per_tick": 8 << 20, "initial_tail_bytes": 1 << 20}


# --------------------------------------------------------------------------------- outputs

def _rss_mib() -> float | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def _make_outputs(root: Path, count: int, per_dir: int = 2000) -> None:
    for i in range(count):
        if i % per_dir == 0:
            d = root / f"rows_{i}-{i + per_dir}"
            d.mkdir(parents=True, exist_ok=True)
            ds = str(d)
        os.close(os.open(f"{ds}/data_{i}.pt", os.O_CREAT | os.O_WRONLY, 0o644))


def what_outputs(params: dict[str, Any], work: Path) -> dict[str, Any]:
    """Tick cost against the outputs count, 5 new files a tick, 1 s of (fake) clock per tick:
    `ticks` ticks cover the periodic reconciliations (every 30 s) and the re-stat of every file
    (all at once every 10th reconciliation before the change, a tenth of them in each after),
    back to back."""
    from stallwatch.clock import FakeClock
    from stallwatch.probes.targets import Target

    rows = []
    sleeper = _spawn(["sleep", "100000"])
    try:
        for count in params["counts"]:
            out = work / f"out-{count}"
            t0 = time.monotonic()
            _make_outputs(out, count)
            made_s = time.monotonic() - t0
            time.sleep(2.2)  # past the racy window: listed directories are trusted from now on
            clock = FakeClock(monotonic=1000.0, wall=time.time())
            # 10^6 files' first scan takes longer than the default 5 s probe deadline under load:
            # without a longer one the first tick has no outputs at all
            c = _collector(Target(name="job", pids=(sleeper.pid,), outputs=out), clock=clock,
                           gpu=False, deadline_s=120.0)
            t = Ticker(c)
            w0 = time.perf_counter()
            t.tick()
            first = {"cpu_ms": round(t.rows[0]["cpu"] * 1e3, 2),
                     "wall_ms": round((time.perf_counter() - w0) * 1e3, 2)}
            nxt = [count]
            writes_cpu = [0.0]
            reconciles: list[tuple[int, float]] = []
            prev = [t.last[0].outputs.reconciliations]

            def before(i: int) -> None:
                w = time.thread_time()
                for _ in range(5):
                    k = nxt[0]
                    d = out / f"rows_{k // 2000 * 2000}-{k // 2000 * 2000 + 2000}"
                    if k % 2000 == 0:
                        d.mkdir(exist_ok=True)
                    with open(d / f"data_{k}.pt", "wb") as f:
                        f.write(b"x" * 4096)
                    nxt[0] += 1
                writes_cpu[0] += time.thread_time() - w
                clock.advance(1.0)
                o = t.last[0].outputs
                if o is not None and o.reconciliations != prev[0]:
                    reconciles.append((o.reconciliations, o.last_reconcile_duration_s or 0.0))
                    prev[0] = o.reconciliations

            cpu0 = time.process_time()
            t.run(params["ticks"], 0.0, before=before)
            time.sleep(0.5)
            o = c.outputs.collect()
            cpu_all = time.process_time() - cpu0 - writes_cpu[0]
            rep = t.report(skip=1)
            rows.append({
                "files": count, "made_in_s": round(made_s, 1), "first_tick": first,
                "cpu_ms": rep["cpu_ms"], "wall_ms": rep["wall_ms"],
                "amortized_cpu_ms_per_tick": round(cpu_all / len(t.rows) * 1e3, 3),
                # every periodic reconciliation (30 s of the fake clock), its real duration
                "reconcile_ms": _summary([d for _, d in reconciles]),
                "files_seen_at_end": o.file_count, "files_expected_at_end": nxt[0],
                "watch_mode": o.watch_mode, "events_seen": o.events_seen,
                "process_rss_mib": _rss_mib(),
            })
            print(f"    outputs {count}: {rep['cpu_ms']['median']} ms/tick median, p99 "
                  f"{rep['cpu_ms']['p99']}, max {rep['cpu_ms']['max']}", file=sys.stderr, flush=True)
            c.close()
            shutil.rmtree(out, ignore_errors=True)
    finally:
        _kill(sleeper)
    return {"rows": rows, "new_files_per_tick": 5, "clock": "fake, 1 s per tick, ticks back to back"}


# ------------------------------------------------------------------------------------ tree

TREE = r"""
import os, subprocess, sys, threading, time
mode, n = sys.argv[1], int(sys.argv[2])
kids = []
if mode == "procs":
    for _ in range(n - 1):
        kids.append(subprocess.Popen(["sleep", "100000"]))
else:
    ev = threading.Event()
    for _ in range(n - 1):
        threading.Thread(target=ev.wait, daemon=True).start()
print("ready", flush=True)
time.sleep(100000)
"""


def what_tree(params: dict[str, Any], work: Path) -> dict[str, Any]:
    from stallwatch.probes.targets import Target

    rows = []
    for mode in ("procs", "threads"):
        for n in params["sizes"]:
            p = _spawn([sys.executable, "-c", TREE, mode, str(n)], stdout=subprocess.PIPE)
            try:
                assert p.stdout is not None
                p.stdout.readline()
                c = _collector(Target(name="job", pids=(p.pid,)), gpu=False)
                t = Ticker(c)
                t.tick()
                t.run(params["ticks"], 0.5)
                po = t.last[0].processes
                rep = t.report(skip=1)
                rows.append({
                    "mode": mode, "tasks": n, "processes_seen": len(po.processes),
                    "threads_seen": sum(len(x.threads) for x in po.processes),
                    "threads_truncated": any(x.threads_truncated for x in po.processes),
                    "cpu_ms": rep["cpu_ms"], "wall_ms": rep["wall_ms"],
                    "cpu_us_per_task": round(rep["cpu_ms"]["median"] * 1e3 / n, 1),
                    "host_processes": sum(1 for x in os.listdir("/proc") if x.isdigit()),
                })
                print(f"    tree {mode} {n}: {rep['cpu_ms']['median']} ms/tick", file=sys.stderr, flush=True)
                c.close()
            finally:
                _kill(p)
    return {"rows": rows}


# ----------------------------------------------------------------------------------- rules

def clone_rules(n: int, dest: Path) -> Path:
    """n rules: the defaults in order, then copies of them under new names."""
    chunks: list[str] = []
    for f in sorted(RULES_DIR.glob("*.toml")):
        parts = re.split(r"(?m)^(?=\[\[rule\]\]\s*$)", f.read_text())
        chunks += [p for p in parts if p.startswith("[[rule]]")]
    out, k = [], 0
    while len(out) < n:
        base = chunks[len(out) % len(chunks)]
        if len(out) >= len(chunks):
            k = len(out) // len(chunks)
            base = re.sub(r'(?m)^name = "([^"]+)"', lambda m: f'name = "{m[1]}_clone{k}"', base, count=1)
        out.append(base)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"rules-{n}.toml"
    path.write_text("\n".join(out))
    return path


def what_rules(params: dict[str, Any], work: Path) -> dict[str, Any]:
    """Rules evaluation cost against the number of rules, over recorded snapshots (a healthy
    job, then a deadlock: rules pending, firing, evidence rendered)."""
    from stallwatch.engine import diagnose
    from stallwatch.engine import Evaluator
    from stallwatch.engine.features import features
    from stallwatch.probes.snapshot import Snapshot
    from stallwatch.probes.trace import read_trace

    snaps = []
    for name in params.get("traces", ["healthy", "deadlock"]):
        _, raw, _ = read_trace(ROOT / "tests" / "data" / "traces" / f"{name}.jsonl")
        snaps.append([Snapshot.model_validate({k: v for k, v in s.items() if k != "type"}) for s in raw])
    feats = [[features(s) for s in ss] for ss in snaps]
    fcost = []
    for s in snaps[0][:50]:
        c0 = time.process_time()
        features(s)
        fcost.append(time.process_time() - c0)
    rows = []
    for n in params["counts"]:
        rs = diagnose.load([clone_rules(n, work / "rules")])
        per = []
        for _ in range(params.get("repeats", 3)):
            for ss, fs in zip(snaps, feats, strict=True):
                ev = Evaluator(rs)
                for s, v in zip(ss, fs, strict=True):
                    c0 = time.process_time()
                    ev.evaluate(v, s.t_mono)
                    per.append(time.process_time() - c0)
        rows.append({"rules": len(rs), "evaluate_cpu_ms": _summary(per),
                     "cpu_us_per_rule": round(statistics.median(per) * 1e6 / len(rs), 1)})
        print(f"    rules {n}: {statistics.median(per) * 1e3:.3f} ms/eval", file=sys.stderr, flush=True)
    return {"rows": rows, "features_cpu_ms": _summary(fcost),
            "snapshots": sum(len(s) for s in snaps), "traces": params.get("traces", ["healthy", "deadlock"])}


WHAT = {"tick": what_tick, "log": what_log, "outputs": what_outputs, "tree": what_tree,
        "rules": what_rules}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=str(ROOT), help="the stallwatch source tree to measure")
    ap.add_argument("--what", required=True, choices=sorted(WHAT))
    ap.add_argument("--params", default="{}")
    a = ap.parse_args()
    sys.path.insert(0, a.src)
    import stallwatch

    global RULES_DIR
    # The measured tree's own rules: an installed checkout maps its built-in rules to itself,
    # and a baseline's schema may lack variables the current rules name.
    if (Path(a.src) / "rules").is_dir():
        RULES_DIR = Path(a.src) / "rules"

    base = Path(os.environ.get("STALLWATCH_BENCH_TMP", tempfile.gettempdir()))
    work = Path(tempfile.mkdtemp(prefix=f"stallwatch-bench-{a.what}-", dir=base))
    try:
        res = WHAT[a.what](json.loads(a.params), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["src"] = a.src
    res["stallwatch_file"] = stallwatch.__file__
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
