"""Compare the two CEL implementations on stallwatch-shaped work, side by side in one run.

    .venv/bin/python bench/bench_expr.py [--out bench_expr.json] [--procs 20] [--threads 30]

`cel` (common-expression-language, Rust core) against `celpy` (cel-python, pure Python):
compile time per condition, the per-tick cost of turning the variables into CEL values, the
evaluation time per condition, and the semantic points the engine depends on (error positions,
missing keys, has(), int/double mixing). The stallwatch wrapper (stallwatch.engine.expr) is
measured too, so its overhead over the raw library is visible.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cel
import celpy

from stallwatch.engine.expr import Vars, compile_expr, normalise

CONDITIONS = [
    "log.idle_s > stall_threshold_s && proc.d_threads > 0.0 && !job.exited",
    "log.idle_s > 3.0 * log.median_interval_s && proc.d_threads == 0.0 && gpu.util_max < 5.0",
    "procs.exists(p, p.state == 'D' && p.wchan.startsWith('nfs'))",
    "size(procs.filter(p, p.threads.exists(t, t.state == 'D'))) >= 1",
    "disks.exists(d, d.free_bytes < 1073741824.0 || d.free_inodes < 1000.0)",
    "server.up && server.health_age_s > 20.0 && server.running_reqs == 0.0",
    "!server.up && server.refused",
    "job.exited && job.exit_code != 0.0 && kernel.oom_kill_pids.exists(x, x == job.pid)",
    "gpus.exists(g, g.xid_count > 0.0 || g.ecc_uncorrected > 0.0)",
    "has(progress.total) && progress.done >= progress.total",
    "outputs.write_age_s < 90.0 && log.idle_s > 30.0 && outputs.bytes_per_s > 1048576.0",
]


def realistic_vars(n_procs: int, n_threads: int) -> dict[str, Any]:
    procs = [
        {"pid": 4000 + i, "ppid": 3999, "state": "D" if i == 3 else "S",
         "wchan": "nfs_wait_bit_killable" if i == 3 else "futex_wait_queue",
         "cmdline": f"python extract.py --rank {i}", "rss_bytes": 12_000_000_000 + i,
         "cpu_pct": 3.5 + i, "voluntary_ctxt": 100_000 + i,
         "threads": [{"tid": 4000 + i * 100 + j, "state": "D" if (i, j) == (3, 0) else "S",
                      "wchan": "futex_wait_queue"} for j in range(n_threads)]}
        for i in range(n_procs)
    ]
    gpus = [{"index": g, "util": 97.0, "mem_used": 70e9, "power_w": 650.0, "xid_count": 0,
             "ecc_uncorrected": 0, "pids": [4000 + g]} for g in range(8)]
    return {
        "stall_threshold_s": 30,
        "job": {"pid": 4000, "exited": False, "exit_code": 0, "restarts": 0},
        "log": {"idle_s": 41.5, "median_interval_s": 1.02, "last_line": "Generating: 18380/37312"},
        "progress": {"done": 18380, "total": 37312, "rate_per_s": 1.02, "eta_s": 17300.0},
        "proc": {"d_threads": 1, "threads": n_procs * n_threads},
        "procs": procs,
        "gpu": {"util_max": 0.0, "count": 8},
        "gpus": gpus,
        "disks": [{"mount": "/data", "device": "nvme0n1", "free_bytes": 8e12, "free_inodes": 1e8,
                   "io_ms_per_s": 0.0}],
        "server": {"up": True, "refused": False, "health_age_s": 3.0, "running_reqs": 12,
                   "queue_reqs": 40},
        "outputs": {"write_age_s": 400.0, "bytes_per_s": 0.0, "files": 9190},
        "kernel": {"oom_kill_pids": [], "xids": [], "hung_tasks": []},
    }


def timed(fn: Callable[[], Any], reps: int, rounds: int = 5) -> float:
    """Median over rounds of the mean microseconds per call."""
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / reps / 1000)
    return statistics.median(per_call)


def probe(fn: Callable[[], Any]) -> str:
    try:
        return repr(fn())
    except Exception as exc:  # noqa: BLE001 - the point is to record what each library does
        text = str(exc).split("\n")[0]
        return f"{type(exc).__name__}: {text[:110]}"


def semantics() -> dict[str, dict[str, str]]:
    env = celpy.Environment()

    def cp(src: str, data: dict[str, Any]) -> Any:
        return env.program(env.compile(src)).evaluate(celpy.json_to_cel(data))

    def cp_pos(src: str) -> Any:
        try:
            env.compile(src)
        except Exception as exc:  # noqa: BLE001 - the error and its position are the measurement
            return (getattr(exc, "line", None), getattr(exc, "column", None))
        return None

    def cel_pos(src: str) -> Any:
        try:
            cel.compile(src)
        except Exception as exc:  # noqa: BLE001 - the error and its position are the measurement
            return str(exc).split("ERROR: ")[1].split(" Syntax")[0]
        return None

    cases = {
        "syntax error position (`a >\\n && b`)": (lambda: cel_pos("a >\n && b"),
                                                   lambda: cp_pos("a >\n && b")),
        "missing key (`a.c`)": (lambda: cel.compile("a.c").execute({"a": {"b": 1}}),
                                lambda: cp("a.c", {"a": {"b": 1}})),
        "has(a.c)": (lambda: cel.compile("has(a.c)").execute({"a": {"b": 1}}),
                     lambda: cp("has(a.c)", {"a": {"b": 1}})),
        "double > int literal (`x > 1`, x=1.5)": (lambda: cel.compile("x > 1").execute({"x": 1.5}),
                                                  lambda: cp("x > 1", {"x": 1.5})),
        "double == int literal (`x == 1`, x=1.0)": (
            lambda: cel.compile("x == 1").execute({"x": 1.0}), lambda: cp("x == 1", {"x": 1.0})),
        "double * int literal (`x * 2`, x=1.5)": (lambda: cel.compile("x * 2").execute({"x": 1.5}),
                                                  lambda: cp("x * 2", {"x": 1.5})),
        "int / int (`a / b`, 1 and 2)": (lambda: cel.compile("a / b").execute({"a": 1, "b": 2}),
                                         lambda: cp("a / b", {"a": 1, "b": 2})),
    }
    return {name: {"cel": probe(a), "celpy": probe(b)} for name, (a, b) in cases.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--procs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=30)
    args = ap.parse_args()

    raw = realistic_vars(args.procs, args.threads)
    data = normalise(raw)  # both libraries see the same doubles, as the engine feeds them
    env = celpy.Environment()

    # Agreement first: a fast library that answers differently is no candidate.
    ctx = cel.Context(variables=data)
    activation = celpy.json_to_cel(data)
    rows = []
    for src in CONDITIONS:
        a = cel.compile(src).execute(ctx)
        b = env.program(env.compile(src)).evaluate(activation)
        w = compile_expr(src).evaluate(data)
        rows.append({
            "condition": src,
            "result": {"cel": a, "celpy": bool(b), "stallwatch": w},
            "compile_us": {
                "cel": timed(lambda: cel.compile(src), 200),
                "celpy": timed(lambda: env.program(env.compile(src)), 5, 3),
                "stallwatch": timed(lambda: compile_expr(src), 200),
            },
            "eval_us": {},
        })
        prg_a, prg_b, prg_w = cel.compile(src), env.program(env.compile(src)), compile_expr(src)
        sw_vars = Vars(data)
        rows[-1]["eval_us"] = {
            "cel": timed(lambda: prg_a.execute(ctx), 2000),
            "celpy": timed(lambda: prg_b.evaluate(activation), 20, 3),
            "stallwatch": timed(lambda: prg_w.evaluate(sw_vars), 2000),
            "cel_dict_per_call": timed(lambda: prg_a.execute(data), 20, 3),
        }
    prepare = {
        "cel_context_us": timed(lambda: cel.Context(variables=data), 20, 3),
        "celpy_json_to_cel_us": timed(lambda: celpy.json_to_cel(data), 5, 3),
        "stallwatch_vars_us": timed(lambda: Vars(raw), 20, 3),
    }
    sums = {k: sum(r["eval_us"][k] for r in rows) for k in ("cel", "celpy", "stallwatch")}
    tick = {"cel": prepare["cel_context_us"] + sums["cel"],
            "celpy": prepare["celpy_json_to_cel_us"] + sums["celpy"],
            "stallwatch": prepare["stallwatch_vars_us"] + sums["stallwatch"]}
    agree = all(len({bool(v) for v in r["result"].values()}) == 1 for r in rows)
    result = {
        "python": platform.python_version(), "machine": platform.machine(),
        "versions": {"cel": _version("common-expression-language"), "celpy": _version("cel-python")},
        "variables": {"procs": args.procs, "threads_per_proc": args.threads,
                      "json_bytes": len(json.dumps(raw))},
        "conditions": rows, "prepare_us": prepare, "tick_us": tick, "results_agree": agree,
        "semantics": semantics(),
    }
    _print(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if agree else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _print(r: dict[str, Any]) -> None:
    v = r["variables"]
    print(f"cel {r['versions']['cel']} vs celpy {r['versions']['celpy']}, Python {r['python']}; "
          f"variables: {v['procs']} procs x {v['threads_per_proc']} threads, "
          f"{v['json_bytes']} bytes as JSON\n")
    print(f"{'#':>2} {'compile us':>30} {'eval us (prepared vars)':>38}  result")
    print(f"{'':>2} {'cel':>9} {'celpy':>10} {'wrapper':>9} {'cel':>9} {'celpy':>10} "
          f"{'wrapper':>9} {'cel+dict':>9}")
    for i, row in enumerate(r["conditions"], 1):
        c, e = row["compile_us"], row["eval_us"]
        print(f"{i:>2} {c['cel']:>9.1f} {c['celpy']:>10.0f} {c['stallwatch']:>9.1f} "
              f"{e['cel']:>9.2f} {e['celpy']:>10.1f} {e['stallwatch']:>9.2f} "
              f"{e['cel_dict_per_call']:>9.0f}  {row['result']['cel']}")
    p = r["prepare_us"]
    print(f"\nprepare variables once per tick: cel Context {p['cel_context_us']:.0f} us, "
          f"celpy json_to_cel {p['celpy_json_to_cel_us']:.0f} us, "
          f"stallwatch Vars (normalise + Context) {p['stallwatch_vars_us']:.0f} us")
    t = r["tick_us"]
    print(f"one tick (prepare + {len(r['conditions'])} conditions): cel {t['cel']:.0f} us, "
          f"celpy {t['celpy']:.0f} us, stallwatch {t['stallwatch']:.0f} us; "
          f"results agree: {r['results_agree']}\n")
    print(f"{'semantics':<42} {'cel':<48} celpy")
    for name, s in r["semantics"].items():
        print(f"{name:<42} {s['cel'][:47]:<48} {s['celpy'][:60]}")


if __name__ == "__main__":
    raise SystemExit(main())
