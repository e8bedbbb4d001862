"""Overhead of `stallwatch run` against the raw floor and peers, side by side, in one run.

One healthy job (tests/jobs/extract_like.py: a progress line and an output file every 0.2 s) is
watched at the same 1 s interval, all at the same time, by
  - stallwatch: the daemon (`python -m stallwatch run --config`), attached by pid_file, default
    rules; optionally a second daemon from a baseline source tree (before/after a change);
  - floor: bench/floor.py, the same /proc, /sys, kernel-log, log and outputs reads, nothing else;
  - peers from PyPI, in their own virtualenv: glances (`--stdout cpu,mem -t 1`), nvitop's API
    (bench/peers/nvitop_loop.py), gpustat (`-i 1`; no GPU here).
With `wide` (default 8 × 128), two more jobs run beside it, each under its own daemon (and the
baseline's): the wide job (bench/jobs/wide.py: 8 processes of 128 idle threads, a SpecForge
node's write pools) and the narrow one (the same script, 1 process of 1 thread); the difference
of their daemons' CPU per tick over the difference of their threads is the cost per idle thread.
Each one's CPU is read every sub-window (cgroup cpuacct when root, else /proc/PID/stat), after a
warm-up; per-tick CPU is the sub-window's CPU over its ticks (the daemon's own tick counter, else
wall / interval); the median over sub-windows is reported, and the whole window's total.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (FLOOR_IS, ROOT, cpu_meter, db_meta, db_query, loadavg, memory, python_for, rnd,
                          start_daemon, stop, summary, threads_of, wait_for, workdir)

READS = {
    "stallwatch": "job tree: every thread's state, wchan, syscall, kernel stack, ctx switches, CPU, "
                  "I/O, fds, sockets; the log (progress, cadence, tracebacks); the outputs index "
                  "(inotify + reconcile); kernel log; disks (statvfs, diskstats, mountinfo, sysfs); "
                  "GPU via NVML when present; rules, verdict, state database",
    "floor": FLOOR_IS,
    "glances": "host-wide CPU and memory only (the `cpu,mem` plugins printed; others still load): "
               "nothing about the job, its threads, log, outputs or disks paths",
    "nvitop": "NVML devices and GPU processes (none here: NVML not found) and host snapshots of the "
              "job's processes (status, CPU %, memory, command line): no threads, wait channels, "
              "syscalls, log, outputs, kernel log or disks",
    "gpustat": "NVML only: without a GPU it reads nothing",
}


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """On-CPU nanoseconds of each live thread (/proc/PID/task/TID/schedstat)."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                out[int(t)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def thread_names(pid: int) -> dict[int, str]:
    """tid -> Python thread name, and "watchdog (inotify)" for watchdog's threads, from
    `py-spy dump --nonblocking` (in the project's venv with its test extra); {} without it."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not spy:
        return {}
    try:
        text = subprocess.run([spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    names: dict[int, str] = {}
    for block in re.split(r"\n(?=Thread )", text):
        m = re.match(r'Thread (?:0x[0-9A-Fa-f]+ \()?(\d+)\)?[^"]*"([^"]*)"', block)
        if m:
            names[int(m[1])] = "watchdog (inotify)" if "watchdog" in block else m[2]
    return names


def breakdown(a: dict[int, int], b: dict[int, int], cpu_s: float | None, ticks: float,
              names: dict[int, str]) -> dict[str, float]:
    """ms CPU per tick by thread group; threads that started or ended inside the window (the
    thread-per-call model) are what is left of the process's total."""
    groups: dict[str, float] = {}
    live = 0.0
    for tid, ns in b.items():
        if tid not in a:
            continue
        d = (ns - a[tid]) / 1e6 / ticks
        live += d
        name = names.get(tid, f"tid {tid}")
        name = "statvfs workers" if name.startswith("statvfs:") else name
        groups[name] = round(groups.get(name, 0.0) + d, 3)
    if cpu_s is not None:
        groups["threads started or ended in the window"] = round(max(0.0, cpu_s * 1e3 / ticks - live), 3)
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def _peers_python(venv: Path | None) -> Path | None:
    if venv is None:
        return None
    py = venv / "bin" / "python"
    return py if py.exists() else None


def ensure_peers(venv: Path, install: bool) -> tuple[Path | None, str]:
    """The peers' virtualenv (never the project's): created on request with pip."""
    py = _peers_python(venv)
    if py is not None:
        return py, "present"
    if not install:
        return None, f"no peers venv at {venv} (run with --install-peers)"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "glances", "nvitop", "gpustat"],
                       check=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not install the peers: {e}"
    return _peers_python(venv), "installed"


def _versions(py: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('glances', 'nvitop', 'gpustat', 'psutil', 'nvidia-ml-py')}))")
    try:
        return json.loads(subprocess.run([str(py), "-c", code], capture_output=True, text=True,
                                         timeout=60).stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


def run(*, warmup_s: float, window_s: float, subwindows: int, interval: float = 1.0,
        peers_venv: Path | None = None, install_peers: bool = False,
        baseline_src: Path | None = None, job_argv: list[str] | None = None,
        floor_args: tuple[str, ...] = (), wide: tuple[int, int] | None = (8, 128),
        standard_beside: bool = False) -> dict[str, Any]:
    """job_argv: the watched job (`{out}` and `{log}` are filled in), default extract_like.py;
    floor_args: more arguments for bench/floor.py (`--nvml` on a GPU host); standard_beside: with
    a job_argv, also the standard job (extract_like.py) under its own daemons and its own floor
    (rows `*_standard`, `floor_standard`), so a GPU host measures the issue's standard job too."""
    out: dict[str, Any] = {"interval_s": interval, "warmup_s": warmup_s, "window_s": window_s,
                           "subwindows": subwindows, "reads": READS, "floor_is": FLOOR_IS}
    py_peers, why = (ensure_peers(peers_venv, install_peers) if peers_venv else (None, "disabled"))
    out["peers_venv"] = {"path": str(peers_venv) if peers_venv else None, "status": why,
                         "versions": _versions(py_peers) if py_peers else {}}
    procs: dict[str, subprocess.Popen] = {}
    meters: dict[str, Any] = {}
    side_jobs: dict[str, subprocess.Popen] = {}
    with workdir("overhead") as wd:
        log, outdir = wd / "job.log", wd / "out"
        argv, env = python_for(None)
        cmd = ([a.format(out=outdir, log=log) for a in job_argv] if job_argv else
               [*argv, str(ROOT / "tests" / "jobs" / "extract_like.py"), "--out", str(outdir),
                "--log", str(log), "--n", "100000000", "--sample-s", "0.2"])
        out["job"] = cmd
        with open(wd / "job.err", "ab") as err:
            job = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, env=env,
                                   stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_for(lambda: outdir.exists() and log.exists(), 30, "the job to start")
            (wd / "job.pid").write_text(f"{job.pid}\n")
            daemons = {"stallwatch": None}
            if baseline_src is not None:
                daemons["stallwatch_baseline"] = baseline_src
            watches = {name: "job" for name in daemons}
            std_log, std_out = wd / "std.log", wd / "std-out"
            if standard_beside and job_argv:
                side_jobs["standard"] = j = subprocess.Popen(
                    [*argv, str(ROOT / "tests" / "jobs" / "extract_like.py"), "--out", str(std_out),
                     "--log", str(std_log), "--n", "100000000", "--sample-s", "0.2"],
                    start_new_session=True, stdin=subprocess.DEVNULL, env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                wait_for(lambda: std_out.exists() and std_log.exists(), 30, "the standard job to start")
                (wd / "standard.pid").write_text(f"{j.pid}\n")
                for name, src in list(daemons.items()):
                    daemons[f"{name}_standard"] = src
                    watches[f"{name}_standard"] = "standard"
            if wide is not None:
                for kind, (ranks, threads) in (("wide", wide), ("narrow", (1, 1))):
                    side_jobs[kind] = j = subprocess.Popen(
                        [*argv, str(ROOT / "bench" / "jobs" / "wide.py"), "--ranks", str(ranks),
                         "--threads", str(threads)], start_new_session=True, env=env,
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
                    assert j.stdout is not None
                    j.stdout.readline()
                    (wd / f"{kind}.pid").write_text(f"{j.pid}\n")
                    for name, src in list(daemons.items()):
                        if name in watches and watches[name] == "job":
                            daemons[f"{name}_{kind}"] = src
                            watches[f"{name}_{kind}"] = kind
                out["wide"] = {"ranks": wide[0], "threads_per_rank": wide[1]}
            for name, src in daemons.items():
                state = wd / f"state-{name}"
                cfg = wd / f"{name}.toml"
                rules = f'rules = ["{src}/rules"]' if src is not None else ""
                # The wide and narrow jobs do nothing, and read as a hang some 16 s in: the
                # incident's evidence bundle (a py-spy dump of each of the 9 processes, 0.15 s of
                # CPU in children of the daemon's cgroup, and the bundle's writer thread) landed
                # in the window as 1.8 ms a tick of "threads started or ended" that no tick
                # costs. Their daemons measure watching, so they make no bundle.
                if watches[name] not in ("job", "standard"):
                    rules += "\nevidence = false"
                job_toml = (f'pid_file = "{wd / "job.pid"}"\nlog = "{log}"\noutputs = "{outdir}"'
                            if watches[name] == "job" else
                            f'pid_file = "{wd / "standard.pid"}"\nlog = "{std_log}"\noutputs = "{std_out}"'
                            if watches[name] == "standard" else
                            f'pid_file = "{wd / (watches[name] + ".pid")}"')
                cfg.write_text(f"""
[daemon]
interval_s = {interval}
state_dir = "{state}"
{rules}

[[job]]
name = "{'extract' if watches[name] == 'job' else watches[name]}"
{job_toml}
""")
                procs[name] = start_daemon(cfg, wd / f"{name}.log", src=src)
            procs["floor"] = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "floor.py"), "--pid", str(job.pid), "--log", str(log),
                 "--outputs", str(outdir), "--interval", str(interval), *floor_args],
                start_new_session=True, stdin=subprocess.DEVNULL)
            if "standard" in side_jobs:
                procs["floor_standard"] = subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "floor.py"), "--pid", str(side_jobs["standard"].pid),
                     "--log", str(std_log), "--outputs", str(std_out), "--interval", str(interval),
                     *floor_args], start_new_session=True, stdin=subprocess.DEVNULL)
            peer_info: dict[str, Any] = {}
            if py_peers is not None:
                bindir = py_peers.parent
                procs["glances"] = subprocess.Popen(
                    [str(bindir / "glances"), "--stdout", "cpu,mem", "-t", str(int(interval))],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                    start_new_session=True)
                procs["nvitop"] = subprocess.Popen(
                    [str(py_peers), str(ROOT / "bench" / "peers" / "nvitop_loop.py"), "--pid", str(job.pid),
                     "--interval", str(interval), "--report", str(wd / "nvitop.json")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                    start_new_session=True)
                gs = subprocess.Popen([str(bindir / "gpustat"), "-i", str(int(interval))],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
                procs["gpustat"] = gs
            for name, p in procs.items():
                meters[name] = cpu_meter(name, p.pid)
            for name in daemons:
                state = wd / f"state-{name}"
                try:
                    wait_for(lambda s=state: db_meta(s).get("ticks"), 60, f"{name} to tick")
                except TimeoutError as e:
                    said = (wd / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise TimeoutError(f"{e}; its log ends:\n{said}") from None
            time.sleep(warmup_s)
            if "gpustat" in procs:
                gs = procs["gpustat"]
                if gs.poll() is not None:
                    text = gs.stdout.read().decode("utf-8", "replace") if gs.stdout else ""
                    peer_info["gpustat"] = {"exited": True, "returncode": gs.returncode,
                                            "said": " / ".join(text.strip().splitlines()[:2])}
                    meters.pop("gpustat").close()
                    procs.pop("gpustat")
                else:
                    peer_info["gpustat"] = {"exited": False}
            # -- the measured window
            sub = window_s / subwindows
            marks: list[dict[str, Any]] = []
            tick_durs: dict[str, dict[int, float]] = {n: {} for n in daemons}

            def mark() -> None:
                m: dict[str, Any] = {"t": time.monotonic(), "load": loadavg()}
                for name, meter in meters.items():
                    m[name] = {"cpu": meter.seconds(), "user_sys": meter.user_sys(),
                               **memory(procs[name].pid),
                               "threads": threads_of(procs[name].pid)}
                for name in daemons:
                    meta = db_meta(wd / f"state-{name}")
                    m[name]["ticks"] = int(meta.get("ticks") or 0)
                    m[name]["threads_ns"] = thread_cpu_ns(procs[name].pid)
                marks.append(m)

            mark()
            load_start = loadavg()
            for _ in range(subwindows):
                end = time.monotonic() + sub
                while time.monotonic() < end:
                    for name in daemons:
                        meta = db_meta(wd / f"state-{name}")
                        if meta.get("ticks") and meta.get("tick_duration_s"):
                            tick_durs[name][int(meta["ticks"])] = float(meta["tick_duration_s"])
                    time.sleep(min(0.45, max(0.0, end - time.monotonic())))
                mark()
            out["load_at_start"], out["load_at_end"] = load_start, loadavg()
            out["by_thread_ms_per_tick"] = {}
            for name in daemons:
                a, b = marks[0][name], marks[-1][name]
                ticks = b["ticks"] - a["ticks"]
                if ticks > 0 and a["cpu"] is not None and b["cpu"] is not None:
                    out["by_thread_ms_per_tick"][name] = breakdown(
                        a["threads_ns"], b["threads_ns"], b["cpu"] - a["cpu"], ticks,
                        thread_names(procs[name].pid))
            out["cpu_meter"] = {n: m.how for n, m in meters.items()}
            rows: dict[str, Any] = {}
            for name in meters:
                per_tick, pct = [], []
                for a, b in itertools.pairwise(marks):
                    if a[name]["cpu"] is None or b[name]["cpu"] is None:
                        continue
                    dcpu, dt = b[name]["cpu"] - a[name]["cpu"], b["t"] - a["t"]
                    ticks = (b[name]["ticks"] - a[name]["ticks"]) if name in daemons else dt / interval
                    if ticks > 0:
                        per_tick.append(dcpu / ticks)
                    pct.append(dcpu / dt * 100)
                a, b = marks[0], marks[-1]
                total = None
                if a[name]["cpu"] is not None and b[name]["cpu"] is not None:
                    dt = b["t"] - a["t"]
                    ticks = (b[name]["ticks"] - a[name]["ticks"]) if name in daemons else dt / interval
                    total = {"cpu_s": rnd(b[name]["cpu"] - a[name]["cpu"], 4), "wall_s": rnd(dt, 1),
                             "ticks": rnd(ticks, 1),
                             "cpu_ms_per_tick": (rnd((b[name]["cpu"] - a[name]["cpu"]) / ticks * 1e3, 3)
                                                 if ticks else None),
                             "pct_of_core": rnd((b[name]["cpu"] - a[name]["cpu"]) / dt * 100, 3)}
                    if ticks and a[name]["user_sys"] and b[name]["user_sys"]:
                        # the cgroup's split (cpuacct.stat counts in 10 ms ticks: a window of
                        # minutes keeps it within a few per cent)
                        (ua, sa), (ub, sb) = a[name]["user_sys"], b[name]["user_sys"]
                        total["user_ms_per_tick"] = rnd((ub - ua) / ticks * 1e3, 3)
                        total["sys_ms_per_tick"] = rnd((sb - sa) / ticks * 1e3, 3)
                rows[name] = {
                    "cpu_ms_per_tick": summary(per_tick, 1e3, 3),
                    "pct_of_core": summary(pct, 1.0, 3),
                    "total": total,
                    "rss_mib": max((m[name]["rss_mib"] or 0) for m in marks),
                    "hwm_mib": max((m[name]["hwm_mib"] or 0) for m in marks),
                    "pss_mib": marks[-1][name]["pss_mib"],
                    "threads": marks[-1][name]["threads"],
                }
                if name in daemons:
                    durs = list(tick_durs[name].values())
                    rows[name]["tick_wall_ms"] = summary(durs, 1e3, 2)
            # A measured process that died in the window measured nothing: its row says so, and
            # nothing is divided by it (a floor that crashed on its first tick once read as
            # "floor 0.00 ms" and left every "x floor" blank without a word).
            for name, p in procs.items():
                if name in rows and p.poll() is not None:
                    rows[name].update(exited=p.returncode, total=None)
                    print(f"bench overhead: {name} exited with {p.returncode} during the window; "
                          f"its row is void", file=sys.stderr)
            for rname, r in rows.items():
                floor_name = "floor_standard" if rname.endswith("_standard") else "floor"
                floor = rows.get(floor_name, {}).get("total") or {}
                t = r.get("total") or {}
                if floor.get("cpu_ms_per_tick") and t.get("cpu_ms_per_tick") is not None:
                    r["x_floor"] = rnd(t["cpu_ms_per_tick"] / floor["cpu_ms_per_tick"], 2)
            out["rows"] = rows
            if wide is not None:
                out["per_idle_thread"] = per_idle_thread(rows, daemons, side_jobs)
            if (wd / "nvitop.json").exists() or "nvitop" in procs:
                stop(procs.pop("nvitop", None))
                try:
                    peer_info["nvitop"] = json.loads((wd / "nvitop.json").read_text())
                except (OSError, ValueError):
                    pass
            out["peers"] = peer_info
            for name in daemons:
                d = db_query(wd / f"state-{name}", "SELECT verdict_json FROM jobs")
                out.setdefault("verdicts", {})[name] = (json.loads(d[0]["verdict_json"])["kind"]
                                                        if d and d[0]["verdict_json"] else None)
        finally:
            for p in procs.values():
                stop(p)
            for m in meters.values():
                m.close()
            stop(job)
            for j in side_jobs.values():
                try:
                    os.killpg(j.pid, signal.SIGKILL)  # the launcher and its ranks (own session)
                except ProcessLookupError:
                    pass
                stop(j)
    return out


def per_idle_thread(rows: dict[str, Any], daemons: dict[str, Any],
                    jobs: dict[str, subprocess.Popen]) -> dict[str, Any]:
    """CPU per tick of watching one more idle thread: (wide - narrow) / (their threads' difference)."""
    count = {k: sum(threads_of(int(c)) or 0 for c in [j.pid, *_children(j.pid)])
             for k, j in jobs.items()}
    out: dict[str, Any] = {"threads": count}
    for name in daemons:
        if name.endswith("_wide"):
            base = name[:-len("_wide")]
            w = ((rows.get(name) or {}).get("total") or {}).get("cpu_ms_per_tick")
            n = ((rows.get(f"{base}_narrow") or {}).get("total") or {}).get("cpu_ms_per_tick")
            extra = count["wide"] - count["narrow"]
            if w is not None and n is not None and extra > 0:
                out[base] = {"us_per_thread_per_tick": rnd((w - n) * 1e3 / extra, 2),
                             "wide_ms_per_tick": w, "narrow_ms_per_tick": n}
    return out


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(k) for k in f.read().split()]
    except OSError:
        return []
