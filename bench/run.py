#!/usr/bin/env python3
"""stallwatch's benchmark suite: overhead, cost growth, detection latency, GPU — in one run.

    .venv/bin/python -m bench [--smoke | --quick] [--out results.json]
    .venv/bin/python bench/run.py [--quick] [--out results.json] [--sections overhead,growth,...]
        [--baseline-git HEAD | --baseline-src DIR] [--peers-venv DIR] [--install-peers]

Modes: --smoke (seconds of each section at tiny sizes: CI's check that it runs), --quick (a
quarter of an hour), default full (about an hour and a half). Prints a table of targets against
what was measured, then each section's table, and writes everything as JSON.

A baseline tree (`--baseline-git REV` exports that revision with `git archive`) is measured side
by side with this one in the same run: a second daemon watching the same job, and the
in-process tick costs run once per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import coldcache, detection, gpu_live, gpu_traces, instructions, overhead
from bench.common import ROOT, dump, loadavg, machine, rnd

# "outputs": growth's outputs-count rows alone (both trees), for a change to that probe only
SECTIONS = ("overhead", "tick", "growth", "outputs", "detection", "false_positives", "gpu",
            "instructions")
# Asked for by name only: it needs valgrind and runs each process ~50 x slower (bench/instructions.py).
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s != "instructions")
MiB = 1 << 20

MODES: dict[str, dict[str, Any]] = {
    "smoke": {
        "overhead": dict(warmup_s=3, window_s=5, subwindows=2, wide=(2, 8)),
        "tick": dict(ticks=6, interval=0.5),
        "log": dict(sizes=[1 * MiB, 4 * MiB], rates=[20 * MiB, 0], ticks=2),
        "outputs": dict(counts=[100, 1000], ticks=40),
        "tree": dict(sizes=[5, 20], ticks=2),
        "rules": dict(counts=[10, 20], repeats=1, traces=["deadlock"]),
        "detection": dict(rigs=["crash"], warmup_s=4, repeats=1),
        "false_positives": dict(duration_s=15, checkpoint_every_s=5, checkpoint_s=4),
        "gpu": dict(calls=20, overhead=dict(warmup_s=3, window_s=5, subwindows=2)),
    },
    "quick": {
        "overhead": dict(warmup_s=15, window_s=120, subwindows=4, wide=(8, 128)),
        "tick": dict(ticks=60, interval=1.0),
        "log": dict(sizes=[1 * MiB, 10 * MiB, 100 * MiB, 1024 * MiB], rates=[20 * MiB, 0], ticks=8),
        "outputs": dict(counts=[1000, 10_000, 100_000], ticks=310),
        "tree": dict(sizes=[10, 100, 1000], ticks=6),
        "rules": dict(counts=[10, 25, 50, 100, 200], repeats=2),
        "detection": dict(rigs=list(detection.EXPECTED), warmup_s=15, repeats=1),
        "false_positives": dict(duration_s=300, checkpoint_every_s=100, checkpoint_s=90),
        "gpu": dict(calls=300, overhead=dict(warmup_s=15, window_s=120, subwindows=4)),
    },
    "full": {
        "overhead": dict(warmup_s=30, window_s=600, subwindows=10, wide=(8, 128)),
        "tick": dict(ticks=300, interval=1.0),
        "log": dict(sizes=[1 * MiB, 10 * MiB, 100 * MiB, 1024 * MiB, 10240 * MiB], rates=[20 * MiB, 0],
                    ticks=15),
        "outputs": dict(counts=[1000, 10_000, 100_000, 1_000_000], ticks=330),
        "tree": dict(sizes=[10, 100, 1000], ticks=10),
        "rules": dict(counts=[10, 25, 50, 100, 200], repeats=3),
        "detection": dict(rigs=list(detection.EXPECTED), warmup_s=30, repeats=3),
        "false_positives": dict(duration_s=1800, checkpoint_every_s=180, checkpoint_s=90),
        "gpu": dict(calls=1000, overhead=dict(warmup_s=30, window_s=300, subwindows=6)),
    },
}


# ------------------------------------------------------------------------------ sections

def tickcost(what: str, params: dict[str, Any], src: Path | None) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "tickcost.py"), "--what", what,
           "--params", json.dumps(params)]
    if src is not None:
        cmd += ["--src", str(src)]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    sys.stderr.write(p.stderr[-4000:] if p.returncode else "".join(
        line + "\n" for line in p.stderr.splitlines() if line.startswith("    ")))
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def trees(baseline: Path | None) -> dict[str, Path | None]:
    return {"current": None, **({"baseline": baseline} if baseline else {})}


def log_sizes(sizes: list[int]) -> tuple[list[int], str | None]:
    """Drop log sizes the disk cannot hold (with room for the growth and a margin)."""
    free = shutil.disk_usage(os.environ.get("STALLWATCH_BENCH_TMP", tempfile.gettempdir())).free
    keep = [s for s in sizes if s * 1.2 + (2 << 30) < free]
    dropped = [s for s in sizes if s not in keep]
    why = (f"dropped {', '.join(f'{s >> 20} MiB' for s in dropped)}: {free >> 30} GiB free"
           if dropped else None)
    return keep, why


# --------------------------------------------------------------------------------- tables

def _f(x: Any, d: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{d}f}"
    return str(x)


def table(title: str, head: list[str], rows: list[list[Any]]) -> str:
    cells = [[_f(c) for c in r] for r in rows]
    w = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w[i]) for i, h in enumerate(head))
    out = [f"\n{title}", line, "-" * len(line)]
    out += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in cells]
    return "\n".join(out)


def flat_ratio(values: list[float | None]) -> float | None:
    v = [x for x in values if x]
    return rnd(max(v) / min(v), 2) if len(v) >= 2 else None


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the issue, against what this run measured (current tree)."""
    out: list[dict[str, Any]] = []

    def add(name: str, target: str, value: Any, ok: bool | None, note: str = "") -> None:
        out.append({"target": name, "bound": target, "measured": value, "met": ok, "note": note})

    ov = (res.get("overhead") or {}).get("rows", {})
    sw = ov.get("stallwatch", {})
    tot = sw.get("total") or {}
    if tot:
        add("idle overhead, % of one core (1 s interval)", "<= 0.5", tot.get("pct_of_core"),
            tot.get("pct_of_core") is not None and tot["pct_of_core"] <= 0.5,
            f"{tot.get('cpu_ms_per_tick')} ms CPU per tick")
        add("overhead vs the raw floor", "<= 2x", sw.get("x_floor"),
            sw.get("x_floor") is not None and sw["x_floor"] <= 2.0,
            f"floor {((ov.get('floor') or {}).get('total') or {}).get('cpu_ms_per_tick')} ms per tick")
        rss_mb = rnd(sw.get("rss_mib", 0) * 1.048576, 1)
        add("daemon RSS, MB", "<= 80", rss_mb, rss_mb is not None and rss_mb <= 80,
            f"PSS {sw.get('pss_mib')} MiB")
        p99 = (sw.get("tick_wall_ms") or {}).get("p99")
        add("daemon tick p99, ms (wall)", "<= 20", p99, p99 is not None and p99 <= 20,
            f"over {(sw.get('tick_wall_ms') or {}).get('n')} ticks")
    wide = ov.get("stallwatch_wide") or {}
    if (wide.get("total") or {}).get("pct_of_core") is not None:
        w = (res.get("overhead") or {}).get("wide") or {}
        pct = wide["total"]["pct_of_core"]
        add(f"wide job ({w.get('ranks')} x {w.get('threads_per_rank')} idle threads), % of one core",
            "<= 1.5", pct, pct <= 1.5, f"{wide['total'].get('cpu_ms_per_tick')} ms CPU per tick")
        p99 = (wide.get("tick_wall_ms") or {}).get("p99")
        add("wide job: daemon tick p99, ms (wall)", "<= 20", p99, p99 is not None and p99 <= 20, "")
        per = (((res.get("overhead") or {}).get("per_idle_thread") or {}).get("stallwatch") or {})
        add("cost per idle thread, µs CPU per tick", "stated", per.get("us_per_thread_per_tick"),
            None, f"threads {((res.get('overhead') or {}).get('per_idle_thread') or {}).get('threads')}")
    tick = ((res.get("tick") or {}).get("current") or {})
    if tick.get("wall_ms"):
        p99 = tick["wall_ms"].get("p99")
        add("in-process tick p99, ms (wall)", "<= 20", p99, p99 is not None and p99 <= 20,
            f"CPU p99 {tick['cpu_ms'].get('p99')} ms")
    det = ((res.get("detection") or {}).get("by_rig") or {})
    for rig, d in det.items():
        if d.get("skipped"):
            add(f"{d['expected']} detected ({rig})", f"<= {d['target_s']:g} s", "skipped", None, d["skipped"])
            continue
        lat = (d.get("verdict_latency_s") or {}).get("max")
        add(f"{d['expected']} detected ({rig})", f"<= {d['target_s']:g} s", lat,
            d.get("within_target"), f"{d.get('right_kind')}/{d.get('runs')} runs right kind")
    fp = res.get("false_positives") or {}
    if "false_positives" in fp:
        add("false positives (healthy, bursty, checkpoints)", "0", fp["false_positives"],
            fp["false_positives"] == 0, f"{fp.get('duration_s')} s, {fp.get('checkpoints')} checkpoints")
    growth = (res.get("growth") or {}).get("current") or {}
    logr = (growth.get("log") or {}).get("rows") or []
    for label, pick in (("at 20 MB/s growth", lambda r: isinstance(r["rate_bytes_per_s"], int)),
                        ("slow growth", lambda r: not isinstance(r["rate_bytes_per_s"], int))):
        rows = [r for r in logr if pick(r)]
        if len(rows) >= 2:
            ratio = flat_ratio([r["cpu_ms"]["median"] for r in rows])
            add(f"flat cost in log size ({label}), largest/smallest", "~1 (<= 1.5)", ratio,
                ratio is not None and ratio <= 1.5,
                f"{rows[0]['size_bytes'] >> 20} MiB .. {rows[-1]['size_bytes'] >> 20} MiB")
    outr = (growth.get("outputs") or {}).get("rows") or []
    if len(outr) >= 2:
        ratio = flat_ratio([r["cpu_ms"]["median"] for r in outr])
        add("flat cost in outputs count (median tick), largest/smallest", "~1 (<= 1.5)", ratio,
            ratio is not None and ratio <= 1.5, f"{outr[0]['files']} .. {outr[-1]['files']} files")
        ratio = flat_ratio([r["amortized_cpu_ms_per_tick"] for r in outr])
        add("flat cost in outputs count (amortized, reconciles included)", "~1 (<= 1.5)", ratio,
            ratio is not None and ratio <= 1.5, "")
    live = (res.get("gpu") or {}).get("live") or {}
    if live.get("nvml"):
        f = live["nvml"]["fast"]
        add("GPU host: NVML part of a tick, ms wall p99", "within the 20 ms tick",
            f["stallwatch"]["wall_ms"]["p99"], f["stallwatch"]["wall_ms"]["p99"] <= 20,
            f"{live['gpu']}; {f['x_floor_cpu']}x the raw NVML calls' CPU")
    gov = (live.get("overhead") or {}).get("rows", {})
    if gov.get("stallwatch"):
        t = gov["stallwatch"].get("total") or {}
        add("GPU host: overhead, % of one core", "<= 0.5", t.get("pct_of_core"),
            t.get("pct_of_core") is not None and t["pct_of_core"] <= 0.5, "a real GPU job")
        x = gov["stallwatch"].get("x_floor")
        add("GPU host: overhead vs the raw floor (with NVML)", "<= 2x", x, x is not None and x <= 2.0, "")
    if gov.get("stallwatch_standard"):
        t = gov["stallwatch_standard"].get("total") or {}
        add("GPU host: the standard job, % of one core", "<= 0.35", t.get("pct_of_core"),
            t.get("pct_of_core") is not None and t["pct_of_core"] <= 0.35,
            "extract_like.py beside the GPU job, NVML read")
        x = gov["stallwatch_standard"].get("x_floor")
        add("GPU host: the standard job vs its floor (with NVML)", "<= 2x", x,
            x is not None and x <= 2.0, "")
    return out


def overhead_tables(ov: dict[str, Any], title: str) -> list[str]:
    parts: list[str] = []
    if ov.get("rows"):
        parts.append(table(
            f"{title} at a {ov['interval_s']:g} s interval, side by side "
            f"({ov['window_s']:g} s window, {ov['subwindows']} sub-windows; CPU meter: "
            f"{sorted(set(ov.get('cpu_meter', {}).values()))})",
            ["who", "CPU ms/tick (total)", "user/sys ms", "median of windows", "% core", "x floor",
             "RSS MiB", "PSS MiB", "threads", "tick wall p50/p99 ms"],
            [[n, (r.get("total") or {}).get("cpu_ms_per_tick"),
              f"{_f((r.get('total') or {}).get('user_ms_per_tick'))}/"
              f"{_f((r.get('total') or {}).get('sys_ms_per_tick'))}",
              r["cpu_ms_per_tick"].get("median"),
              (r.get("total") or {}).get("pct_of_core"), r.get("x_floor"), r["rss_mib"], r["pss_mib"],
              r["threads"], f"{_f((r.get('tick_wall_ms') or {}).get('median'))}/"
                            f"{_f((r.get('tick_wall_ms') or {}).get('p99'))}" if r.get("tick_wall_ms") else "-"]
             for n, r in ov["rows"].items()]))
        if ov.get("peers"):
            parts.append("peers: " + json.dumps(ov["peers"]))
        if ov.get("per_idle_thread"):
            parts.append("per idle thread: " + json.dumps(ov["per_idle_thread"]))
        for name, groups in (ov.get("by_thread_ms_per_tick") or {}).items():
            parts.append(f"{name} by thread, ms CPU per tick: "
                         + ", ".join(f"{k} {v:.3f}" for k, v in groups.items()))
    return parts


def render(res: dict[str, Any]) -> str:
    parts = []
    m = res["machine"]
    parts.append(f"stallwatch bench ({res['mode']}), {m['nproc']} x {m['cpu_model']}, kernel {m['kernel']}, "
                 f"Python {m['python']}, load {res['load_at_start']} -> {res['load_at_end']}")
    cold = res.get("host_cold") or {}
    if cold:
        parts.append("Host: a small Python op costs " + ", ".join(
            f"{c['factor_1s']} x its back-to-back time after a 1 s sleep at the {when}"
            for when, c in cold.items()) + " (bench/coldcache.py).")
    parts.append(table("Targets (issue 7) against this run", ["target", "bound", "measured", "met", "note"],
                       [[t["target"], t["bound"], t["measured"], {True: "yes", False: "NO", None: "-"}[t["met"]],
                         t["note"]] for t in res["targets"]]))
    if (res.get("overhead") or {}).get("floor_is"):
        parts.append(f"The floor: {res['overhead']['floor_is']}.")
    parts += overhead_tables(res.get("overhead") or {}, "Overhead: watching one healthy job")
    ins = res.get("instructions") or {}
    if ins.get("skipped"):
        parts.append(f"Instructions: {ins['skipped']}.")
    elif ins.get("rows"):
        parts.append(table("Instructions per tick (callgrind, user space; cold memory and the kernel left out)",
                           ["who", "ticks", "Ir per tick", "x floor", "x baseline"],
                           [[n, r["ticks"], r["ir_per_tick"], r["x_floor"], r.get("x_baseline", "")]
                            for n, r in ins["rows"].items()]))
    tk = res.get("tick") or {}
    if tk:
        parts.append(table("In-process tick (collector + features + rules), healthy job",
                           ["tree", "ticks", "CPU median", "CPU p99", "wall median", "wall p99",
                            "collect", "features", "rules", "process CPU/tick", "% core"],
                           [[n, r.get("ticks"), r["cpu_ms"]["median"], r["cpu_ms"]["p99"], r["wall_ms"]["median"],
                             r["wall_ms"]["p99"], r["collect_cpu_ms"]["median"], r["features_cpu_ms"]["median"],
                             r["rules_cpu_ms"]["median"], r.get("process_cpu_ms_per_tick"),
                             r.get("process_cpu_pct_of_core")]
                            for n, r in tk.items() if "cpu_ms" in r]))
    gr = res.get("growth") or {}
    for tree, g in gr.items():
        if not isinstance(g, dict) or "log" not in g:
            continue
        lg = g.get("log") or {}
        if lg.get("rows"):
            parts.append(table(f"Cost growth [{tree}]: log size (ms CPU per tick)",
                               ["size MiB", "growth", "first tick", "median", "p99", "max", "read MiB/tick",
                                "backlog MiB at end"],
                               [[r["size_bytes"] >> 20,
                                 r["rate_bytes_per_s"] if not isinstance(r["rate_bytes_per_s"], int)
                                 else f"{r['rate_bytes_per_s'] >> 20} MiB/s", r["first_tick_cpu_ms"],
                                 r["cpu_ms"]["median"], r["cpu_ms"]["p99"], r["cpu_ms"]["max"],
                                 r["log_probe_read_mib_per_tick"], rnd((r["backlog_bytes_at_end"] or 0) / MiB, 1)]
                                for r in lg["rows"]]))
            if lg.get("note"):
                parts.append(lg["note"])
        og = g.get("outputs") or {}
        if og.get("rows"):
            parts.append(table(f"Cost growth [{tree}]: outputs count (ms CPU per tick; 5 new files a tick)",
                               ["files", "first tick", "median", "p99", "max", "amortized",
                                "reconcile ms median", "reconcile ms max", "seen/expected", "RSS MiB"],
                               [[r["files"], r["first_tick"]["cpu_ms"], r["cpu_ms"]["median"], r["cpu_ms"]["p99"],
                                 r["cpu_ms"]["max"], r["amortized_cpu_ms_per_tick"],
                                 r["reconcile_ms"].get("median"), r["reconcile_ms"].get("max"),
                                 f"{r['files_seen_at_end']}/{r['files_expected_at_end']}",
                                 r.get("process_rss_mib")] for r in og["rows"]]))
        tg = g.get("tree") or {}
        if tg.get("rows"):
            parts.append(table(f"Cost growth [{tree}]: job tree (ms CPU per tick)",
                               ["kind", "tasks", "seen procs/threads", "median", "p99", "us per task"],
                               [[r["mode"], r["tasks"], f"{r['processes_seen']}/{r['threads_seen']}"
                                 + (" (truncated)" if r["threads_truncated"] else ""), r["cpu_ms"]["median"],
                                 r["cpu_ms"]["p99"], r["cpu_us_per_task"]] for r in tg["rows"]]))
        rg = g.get("rules") or {}
        if rg.get("rows"):
            parts.append(table(f"Cost growth [{tree}]: rules (ms CPU per evaluation)",
                               ["rules", "median", "p99", "us per rule"],
                               [[r["rules"], r["evaluate_cpu_ms"]["median"], r["evaluate_cpu_ms"]["p99"],
                                 r["cpu_us_per_rule"]] for r in rg["rows"]]))
    det = res.get("detection") or {}
    if det.get("by_rig"):
        parts.append(table(f"Detection latency in the daemon (default rules, {det['warmup_s']:g} s healthy first)",
                           ["rig", "expected", "runs", "detected", "right kind", "verdict s (median/max)",
                            "alert s (median)", "target s", "met"],
                           [[n, d["expected"], d["runs"], d["detected"], d["right_kind"],
                             f"{_f(d['verdict_latency_s'].get('median'))}/{_f(d['verdict_latency_s'].get('max'))}",
                             d["alert_latency_s"].get("median"), d["target_s"],
                             "skipped" if d.get("skipped") else ("yes" if d["within_target"] else "NO")]
                            for n, d in det["by_rig"].items()]))
    fp = res.get("false_positives") or {}
    if fp:
        parts.append(f"\nFalse positives: {fp.get('false_positives')} incident(s) "
                     f"{fp.get('incident_kinds')} in {fp.get('duration_s')} s of a healthy bursty job with "
                     f"{fp.get('checkpoints')} checkpoint pause(s) of {fp.get('checkpoint_s')} s; "
                     f"verdict samples {fp.get('samples')}")
    gp = res.get("gpu") or {}
    if gp.get("traces"):
        parts.append(table("GPU probe — " + gp["label"],
                           ["trace", "GPUs", "snapshots", "gpu probe ms p50/p99 (upper bound)",
                            "slow-path tick ms p50", "beyond processes ms p50/p99", "tick ms p50/p99"],
                           [[t["trace"].split("/")[-1], t["gpus"], t["snapshots"],
                             f"{_f(t['gpu_probe_ms_upper_bound'].get('median'))}/{_f(t['gpu_probe_ms_upper_bound'].get('p99'))}",
                             t["gpu_probe_slow_path_ms"].get("median"),
                             f"{_f(t['gpu_beyond_processes_ms'].get('median'))}/{_f(t['gpu_beyond_processes_ms'].get('p99'))}",
                             f"{_f(t['tick_ms'].get('median'))}/{_f(t['tick_ms'].get('p99'))}"]
                            for t in gp["traces"]]))
    live = gp.get("live") or {}
    if live.get("nvml"):
        nv = live["nvml"]
        rows = []
        for path in ("fast", "slow"):
            r = nv[path]
            for who in ("stallwatch", "floor"):
                rows.append([path, who, r["calls"], r[who]["cpu_ms"]["mean"], r[who]["cpu_ms"]["p99"],
                             r[who]["wall_ms"]["median"], r[who]["wall_ms"]["p99"],
                             r["x_floor_cpu"] if who == "stallwatch" else "",
                             r["x_floor_wall_median"] if who == "stallwatch" else ""])
        parts.append(table(f"GPU probe, live — {live['gpu']}; not supported here: {nv.get('unsupported')}",
                           ["path", "who", "calls", "CPU ms mean", "CPU ms p99", "wall ms median",
                            "wall ms p99", "x floor CPU", "x floor wall"], rows))
    elif gp:
        parts.append(f"\nGPU probe, live: no GPU here ({live.get('gpu')})")
    if live.get("overhead"):
        parts += overhead_tables(live["overhead"], "Overhead on the GPU host: watching a real GPU job")
    return "\n".join(parts)


# ------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true", help="seconds per section, tiny sizes (CI)")
    g.add_argument("--quick", action="store_true", help="about a quarter of an hour")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated, from {','.join(SECTIONS)} (default: all but instructions)")
    ap.add_argument("--baseline-src", type=Path, help="a stallwatch source tree to measure beside this one")
    ap.add_argument("--baseline-git", metavar="REV", help="export REV with git archive and use it as the baseline")
    ap.add_argument("--peers-venv", type=Path, default=Path(os.environ.get(
        "STALLWATCH_PEERS_VENV", "/tmp/stallwatch-bench-peers")),
        help="virtualenv with glances, nvitop, gpustat (never the project's)")
    ap.add_argument("--install-peers", action="store_true", help="create --peers-venv with pip if missing")
    ap.add_argument("--no-peers", action="store_true")
    a = ap.parse_args(argv)
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    P = MODES[mode]
    want = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in want if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s): {', '.join(bad)}")
    tmp_base = None
    baseline = a.baseline_src
    if a.baseline_git:
        tmp_base = Path(tempfile.mkdtemp(prefix="stallwatch-baseline-"))
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", a.baseline_git], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tmp_base)], input=arch.stdout, check=True)
        baseline = tmp_base
    res: dict[str, Any] = {"mode": mode, "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                           "command": " ".join([Path(sys.executable).name, "-m", "bench", *(argv or sys.argv[1:])]),
                           "machine": machine(), "load_at_start": loadavg(),
                           "baseline": ({"src": str(a.baseline_src)} if a.baseline_src else
                                        {"git": a.baseline_git} if a.baseline_git else None),
                           "params": P}
    if mode != "smoke":  # ~7 s each: what a 1 s sleep costs a small op on this host (coldcache.py)
        res["host_cold"] = {"start": coldcache.measure()}
    t0 = time.monotonic()
    try:
        if "overhead" in want:
            print("== overhead", flush=True)
            res["overhead"] = overhead.run(**P["overhead"], peers_venv=None if a.no_peers else a.peers_venv,
                                           install_peers=a.install_peers, baseline_src=baseline)
        if "tick" in want:
            print("== tick", flush=True)
            res["tick"] = {n: tickcost("tick", P["tick"], src) for n, src in trees(baseline).items()}
        if "growth" in want:
            print("== growth", flush=True)
            sizes, why = log_sizes(P["log"]["sizes"])
            res["growth"] = {}
            for n, src in trees(baseline).items():
                g: dict[str, Any] = {}
                g["log"] = tickcost("log", {**P["log"], "sizes": sizes}, src)
                if why:
                    g["log"]["note"] = why
                g["outputs"] = tickcost("outputs", P["outputs"], src)
                g["tree"] = tickcost("tree", P["tree"], src)
                g["rules"] = tickcost("rules", P["rules"], src)
                res["growth"][n] = g
        if "outputs" in want and "growth" not in want:
            print("== outputs", flush=True)
            res["growth"] = {n: {"outputs": tickcost("outputs", P["outputs"], src)}
                             for n, src in trees(baseline).items()}
        if "detection" in want:
            print("== detection", flush=True)
            d = P["detection"]
            res["detection"] = detection.latency(d["rigs"], d["warmup_s"], repeats=d["repeats"])
        if "false_positives" in want:
            print("== false positives", flush=True)
            res["false_positives"] = detection.false_positives(**P["false_positives"])
        if "gpu" in want:
            print("== gpu", flush=True)
            res["gpu"] = gpu_traces.run()
            res["gpu"]["live"] = gpu_live.run(
                calls=P["gpu"]["calls"], overhead_params=P["gpu"].get("overhead"),
                peers_venv=None if a.no_peers else a.peers_venv, install_peers=a.install_peers,
                baseline_src=baseline)
        if "instructions" in want:
            print("== instructions", flush=True)
            res["instructions"] = instructions.run(window_s=10.0 if mode == "smoke" else 60.0,
                                                   warmup_ticks=3 if mode == "smoke" else 10,
                                                   baseline_src=baseline)
    finally:
        if tmp_base is not None:
            shutil.rmtree(tmp_base, ignore_errors=True)
    res["load_at_end"] = loadavg()
    if "host_cold" in res:
        res["host_cold"]["end"] = coldcache.measure()
    res["duration_s"] = rnd(time.monotonic() - t0, 1)
    res["targets"] = targets(res)
    print(render(res))
    if a.out:
        dump(res, a.out)
        print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
