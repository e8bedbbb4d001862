#!/usr/bin/env python3
"""Markdown tables from a results JSON of bench/run.py (what docs/performance.md shows).

    .venv/bin/python -m bench.report bench/results/full.json > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _f(x: Any, d: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.{d}f}"
    return str(x)


def md(head: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _pair(s: dict[str, Any], a: str = "median", b: str = "p99") -> str:
    return f"{_f(s.get(a))} / {_f(s.get(b))}"


def overhead_md(ov: dict[str, Any], title: str) -> list[str]:
    parts: list[str] = []
    if ov.get("rows"):
        parts.append(
            f"### {title} ({ov['interval_s']:g} s interval, {ov['window_s']:g} s window in "
            f"{ov['subwindows']} sub-windows after {ov['warmup_s']:g} s; load {ov.get('load_at_start')} → "
            f"{ov.get('load_at_end')})\n\n" + md(
                ["who", "CPU ms per tick", "median of sub-windows (p90)", "% of one core", "× floor",
                 "RSS MiB", "PSS MiB", "threads", "tick wall ms p50 / p99"],
                [[f"`{n}`", (r.get("total") or {}).get("cpu_ms_per_tick"),
                  f"{_f(r['cpu_ms_per_tick'].get('median'))} ({_f(r['cpu_ms_per_tick'].get('p90'))})",
                  (r.get("total") or {}).get("pct_of_core"), r.get("x_floor"), r["rss_mib"], r["pss_mib"],
                  r["threads"], _pair(r["tick_wall_ms"]) if r.get("tick_wall_ms") else "–"]
                 for n, r in ov["rows"].items()]))
        if ov.get("floor_is"):
            parts.append(f"The floor (× floor): {ov['floor_is']}.")
        peers = ov.get("peers") or {}
        if peers:
            parts.append("Peers: " + "; ".join(f"{k}: {json.dumps(v)}" for k, v in peers.items())
                         + f"; versions {json.dumps((ov.get('peers_venv') or {}).get('versions'))}.")
        bt = ov.get("by_thread_ms_per_tick") or {}
        if bt and all(g.startswith("tid ") or g.startswith("threads ") for n in bt for g in bt[n]):
            bt = {}  # no names (py-spy absent on that host): a list of thread ids says nothing
        if bt:
            names = list(bt)
            groups = list(dict.fromkeys(g for n in names for g in bt[n]))
            parts.append("The daemons' CPU per tick by thread (ms; schedstat of each live thread, "
                         "names from `py-spy dump`):\n\n" + md(
                             ["thread", *[f"`{n}`" for n in names]],
                             [[g, *[bt[n].get(g) for n in names]] for g in groups]))
    return parts


def render(res: dict[str, Any]) -> str:
    parts: list[str] = []
    m = res["machine"]
    parts.append(
        f"Run: `{res.get('command')}` ({res['mode']}), {res.get('started')}, {res.get('duration_s')} s; "
        f"{m['nproc']} × {m['cpu_model']}, kernel {m['kernel']}, Python {m['python']}, "
        f"{m['mem_total_gib']} GiB, {m['processes_on_host']} processes on the host; load average "
        f"{res.get('load_at_start')} at the start, {res.get('load_at_end')} at the end; baseline: "
        f"{res.get('baseline')}.")
    parts.append("### Targets\n\n" + md(
        ["target", "bound", "measured", "met", "note"],
        [[t["target"], t["bound"], t["measured"], t["met"] if t["met"] is not None else "–", t["note"]]
         for t in res.get("targets", [])]))
    parts += overhead_md(res.get("overhead") or {}, "Overhead")
    tk = res.get("tick") or {}
    if tk:
        parts.append("### In-process tick (collector + features + rules; healthy job; ms)\n\n" + md(
            ["tree", "ticks", "CPU p50 / p99", "wall p50 / p99", "collect", "features", "rules",
             "whole process CPU per tick", "% of one core"],
            [[n, r.get("ticks"), _pair(r["cpu_ms"]), _pair(r["wall_ms"]), r["collect_cpu_ms"]["median"],
              r["features_cpu_ms"]["median"], r["rules_cpu_ms"]["median"], r.get("process_cpu_ms_per_tick"),
              r.get("process_cpu_pct_of_core")] for n, r in tk.items() if "cpu_ms" in r]))
    for tree, g in (res.get("growth") or {}).items():
        lg = (g.get("log") or {}).get("rows") or []
        if lg:
            parts.append(f"### Log size [{tree}] (ms CPU per tick)\n\n" + md(
                ["size", "growth", "first tick", "p50 / p99", "max", "MiB read per tick", "backlog at end MiB"],
                [[f"{r['size_bytes'] / MiB:g} MiB", r["rate_bytes_per_s"] if not isinstance(r["rate_bytes_per_s"], int)
                  else f"{r['rate_bytes_per_s'] / MiB:g} MiB/s", r["first_tick_cpu_ms"], _pair(r["cpu_ms"]),
                  r["cpu_ms"]["max"], r["log_probe_read_mib_per_tick"],
                  round((r["backlog_bytes_at_end"] or 0) / MiB, 1)] for r in lg])
                + (f"\n\n{g['log']['note']}" if g["log"].get("note") else ""))
        og = (g.get("outputs") or {}).get("rows") or []
        if og:
            parts.append(f"### Outputs count [{tree}] (ms CPU per tick, 5 new files a tick)\n\n" + md(
                ["files", "first tick", "p50 / p99", "max", "amortized", "reconcile ms p50 / max",
                 "seen / expected", "process RSS MiB"],
                [[f"{r['files']:,}", r["first_tick"]["cpu_ms"], _pair(r["cpu_ms"]), r["cpu_ms"]["max"],
                  r["amortized_cpu_ms_per_tick"], _pair(r.get("reconcile_ms") or {}, "median", "max"),
                  f"{r['files_seen_at_end']:,} / {r['files_expected_at_end']:,}", r.get("process_rss_mib")]
                 for r in og]))
        tg = (g.get("tree") or {}).get("rows") or []
        if tg:
            parts.append(f"### Job tree [{tree}] (ms CPU per tick)\n\n" + md(
                ["kind", "tasks", "seen processes / threads", "p50 / p99", "µs per task"],
                [[r["mode"], r["tasks"], f"{r['processes_seen']} / {r['threads_seen']}"
                  + (" (capped)" if r["threads_truncated"] else ""), _pair(r["cpu_ms"]), r["cpu_us_per_task"]]
                 for r in tg]))
        rg = (g.get("rules") or {}).get("rows") or []
        if rg:
            parts.append(f"### Rules [{tree}] (ms CPU per evaluation, recorded healthy + deadlock snapshots)\n\n"
                         + md(["rules", "p50 / p99", "µs per rule"],
                              [[r["rules"], _pair(r["evaluate_cpu_ms"]), r["cpu_us_per_rule"]] for r in rg]))
    det = res.get("detection") or {}
    if det.get("by_rig"):
        parts.append(f"### Detection latency (daemon, default rules, {det['warmup_s']:g} s healthy first; s)\n\n" + md(
            ["rig", "expected verdict", "runs", "detected", "right kind", "verdict p50 / max", "alert p50 / max",
             "bound", "met"],
            [[n, d["expected"], d["runs"], d["detected"], d["right_kind"],
              _pair(d["verdict_latency_s"], "median", "max"), _pair(d["alert_latency_s"], "median", "max"),
              d["target_s"], "skipped: " + d["skipped"] if d.get("skipped") else d["within_target"]]
             for n, d in det["by_rig"].items()]))
    fp = res.get("false_positives") or {}
    if fp:
        parts.append(f"### False positives\n\n{fp.get('false_positives')} incident(s) {fp.get('incident_kinds')} "
                     f"and {fp.get('alerts_firing')} firing alert(s) in {fp.get('duration_s')} s of a healthy "
                     f"job with bursty progress and {fp.get('checkpoints')} checkpoint write(s) of "
                     f"{fp.get('checkpoint_s')} s without progress; verdict per tick: {fp.get('samples')}.")
    gp = res.get("gpu") or {}
    if gp.get("traces"):
        parts.append("### GPU probe — " + gp["label"] + " (ms)\n\n" + md(
            ["trace", "GPUs", "ticks", "gpu probe p50 / p99 (upper bound)", "slow-path ticks p50",
             "beyond the processes probe p50 / p99", "… on slow-path ticks p50 / max", "tick p50 / p99"],
            [[t["trace"].split("/")[-1], t["gpus"], t["snapshots"], _pair(t["gpu_probe_ms_upper_bound"]),
              t["gpu_probe_slow_path_ms"].get("median"), _pair(t["gpu_beyond_processes_ms"]),
              _pair(t["gpu_beyond_processes_slow_path_ms"], "median", "max"), _pair(t["tick_ms"])]
             for t in gp["traces"]]))
    live = gp.get("live") or {}
    if live.get("nvml"):
        nv = live["nvml"]
        rows = []
        for path, what in (("fast", "every tick"), ("slow", "every 10 s, off the tick")):
            r = nv[path]
            for who in ("stallwatch", "floor"):
                rows.append([f"{path} ({what})", f"`{who}`", r["calls"], _pair(r[who]["cpu_ms"], "mean", "p99"),
                             _pair(r[who]["wall_ms"]), r["x_floor_cpu"] if who == "stallwatch" else ""])
        parts.append(f"### GPU probe, live on {live['gpu']} (ms per call)\n\n" + md(
            ["path", "who", "calls", "CPU mean / p99", "wall p50 / p99", "× floor CPU"], rows))
    elif gp and "live" in gp:
        parts.append(f"GPU probe, live: no GPU on this machine ({live.get('gpu')}).")
    if live.get("overhead"):
        parts += overhead_md(live["overhead"], "Overhead on the GPU host, watching a real GPU job")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(render(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
