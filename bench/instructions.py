"""Instructions per tick: the daemon (this tree and a baseline) and the raw floor, under callgrind.

A tick's CPU time on a virtual machine moves with the host: on this project's VM the first touch
of each page after a 1 s sleep cost ~40 us with no guest page fault (bench/coldcache.py), so the
same tree measured ±35 % from one run to the next. The user-space instructions a tick executes
do not move with the host: counted by valgrind's callgrind, two runs of one tree agree within
~1.5 %. They leave out the kernel's side (the syscalls, which the daemon and the floor make
about equally many of: 122 against 127 a tick on the standard job) and the cost of cold
memory, so they are the measure of the daemon's own work, beside the time-based figures of
bench/overhead.py, not instead of them.

Each measured process runs under `valgrind --tool=callgrind` watching the same healthy job
(tests/jobs/extract_like.py). After `warmup_ticks` ticks its counters are zeroed
(`callgrind_control -z`), after `window_s` dumped (`-d`); the daemon's ticks in between come from
its state database (meta row `ticks`); the floor keeps a fixed 1 s schedule, so its ticks are
the window's seconds (±1). Needs valgrind (skipped with the reason when absent).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, db_meta, python_for, rnd, stop, wait_for, workdir

_TOTALS = re.compile(rb"^(?:totals|summary):\s+(\d+)", re.M)


def _config(wd: Path, name: str, job: Path) -> Path:
    cfg = wd / f"{name}.toml"
    cfg.write_text(f'[daemon]\ninterval_s = 1.0\nstate_dir = "{wd / ("state-" + name)}"\n\n'
                   f'[[job]]\nname = "extract"\npid_file = "{job}"\nlog = "{wd / "job.log"}"\n'
                   f'outputs = "{wd / "out"}"\n')
    return cfg


def _ticks(who: dict[str, Any]) -> int:
    """A daemon's ticks so far (its state database's meta row)."""
    return int(db_meta(who["state"]).get("ticks", 0) or 0)


def _ir_dumped(out_prefix: Path, after: set[Path]) -> int | None:
    """Instructions in the dump `callgrind_control -d` wrote (the file not seen before it)."""
    new = [p for p in out_prefix.parent.glob(out_prefix.name + ".*") if p not in after]
    for p in new:
        m = _TOTALS.search(p.read_bytes())
        if m:
            return int(m.group(1))
    return None


def run(*, window_s: float = 40.0, warmup_ticks: int = 10,
        baseline_src: Path | None = None) -> dict[str, Any]:
    valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
    if not valgrind or not control:
        return {"skipped": "valgrind (callgrind) is not installed: instructions not counted"}
    out: dict[str, Any] = {"how": "user-space instructions (callgrind Ir) per tick, same job, side by side"}
    with workdir("instructions") as wd:
        argv, env = python_for(None)
        job = subprocess.Popen([*argv, str(ROOT / "tests" / "jobs" / "extract_like.py"),
                                "--out", str(wd / "out"), "--log", str(wd / "job.log"),
                                "--n", "100000000", "--sample-s", "0.2"],
                               start_new_session=True, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        who: dict[str, dict[str, Any]] = {}
        try:
            wait_for(lambda: (wd / "job.log").exists(), 30, "the job to start")
            pidf = wd / "job.pid"
            pidf.write_text(f"{job.pid}\n")
            trees = {"stallwatch": None, **({"stallwatch_baseline": baseline_src} if baseline_src else {})}
            for name, src in trees.items():
                a, e = python_for(src)
                prefix = wd / f"cg-{name}"
                cmd = [valgrind, "--tool=callgrind", f"--callgrind-out-file={prefix}.%p",
                       "--dump-instr=no", *a, "-m", "stallwatch", "run", "--config",
                       str(_config(wd, name, pidf))]
                who[name] = {"kind": "daemon", "prefix": prefix, "state": wd / f"state-{name}",
                             "proc": subprocess.Popen(cmd, env=e, cwd=wd, start_new_session=True,
                                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                      stderr=open(wd / f"{name}.err", "ab"))}  # noqa: SIM115 - closed with the process
            prefix = wd / "cg-floor"
            cmd = [valgrind, "--tool=callgrind", f"--callgrind-out-file={prefix}.%p", "--dump-instr=no",
                   *argv, str(ROOT / "bench" / "floor.py"), "--pid", str(job.pid), "--log",
                   str(wd / "job.log"), "--outputs", str(wd / "out")]
            who["floor"] = {"kind": "floor", "prefix": prefix,
                            "proc": subprocess.Popen(cmd, env=env, cwd=wd, start_new_session=True,
                                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                     stderr=subprocess.DEVNULL)}
            # under callgrind a daemon starts in tens of seconds: wait for its first ticks (the
            # floor, started with them and light under callgrind, is on its schedule by then)
            daemons = [w for w in who.values() if w["kind"] == "daemon"]
            wait_for(lambda: all(_ticks(w) >= warmup_ticks for w in daemons), 600,
                     "every measured daemon to tick")
            for w in who.values():
                subprocess.run([control, "-z", str(w["proc"].pid)], capture_output=True, timeout=60)
                w["t0"] = _ticks(w) if w["kind"] == "daemon" else 0
            t_zero = time.monotonic()
            time.sleep(window_s)
            t_dump = time.monotonic()
            for w in who.values():
                w["seen"] = set(w["prefix"].parent.glob(w["prefix"].name + ".*"))
                subprocess.run([control, "-d", str(w["proc"].pid)], capture_output=True, timeout=60)
                w["t1"] = _ticks(w) if w["kind"] == "daemon" else 0
            # the floor keeps a fixed 1 s schedule: its ticks are the window's seconds (±1)
            who["floor"]["t1"] = round(t_dump - t_zero)
            rows: dict[str, Any] = {}
            for name, w in who.items():
                ir = wait_for(lambda w=w: _ir_dumped(w["prefix"], w["seen"]), 60, f"{name}'s dump")
                n = w["t1"] - w["t0"]
                rows[name] = {"ticks": n, "ir": ir, "ir_per_tick": round(ir / n) if n > 0 else None}
            floor = rows["floor"]["ir_per_tick"]
            for r in rows.values():
                r["x_floor"] = rnd(r["ir_per_tick"] / floor, 2) if floor and r["ir_per_tick"] else None
            if "stallwatch_baseline" in rows and rows["stallwatch_baseline"]["ir_per_tick"]:
                rows["stallwatch"]["x_baseline"] = rnd(
                    rows["stallwatch"]["ir_per_tick"] / rows["stallwatch_baseline"]["ir_per_tick"], 3)
            out["rows"] = rows
        finally:
            for w in who.values():
                stop(w["proc"])
            stop(job)
    return out


if __name__ == "__main__":
    import json

    base = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    print(json.dumps(run(baseline_src=base), indent=1))
