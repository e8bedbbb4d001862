#!/usr/bin/env python3
"""Soak: the daemon watches a supervised job while a fault is injected every minute.

    sudo .venv/bin/python bench/soak.py --duration 1800 --every 60 --out /tmp/soak

Faults rotate: deadlock (every thread asleep), crash (exit 3), busy loop (100 % CPU, no
progress), stopped server (SIGSTOP of the job's inference server, SIGCONT after --hold s) and,
as root, fsfreeze of the filesystem the job writes its outputs to (thawed after --hold s). The
job is a small client (written into the work dir) that polls a control file for the next fault,
logs `step N/M` every 0.2 s, asks a loopback SGLang stand-in (tests/jobs/toy_server.py) for each
step and writes one output file a step. The daemon runs the built-in rules with
`restart = "on-failure"`; this script restarts the daemon if it ever exits (Restart=on-failure).

Every 10 s it records the daemon's RSS and open file descriptors; at the end it counts, per
fault, incidents opened and resolved in that fault's window and writes `soak.json` and a
markdown table (`soak.md`) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tests" / "jobs" / "toy_server.py"

EXPECTED = {"deadlock": "hang", "crash": "crash", "busy": "hang", "server": "server_hang",
            "fsfreeze": "io_stall"}

JOB = r'''
import os, sys, threading, time, urllib.request, json
ctl, out, server = sys.argv[1], sys.argv[2], sys.argv[3]
total = 10**7
step = 0
os.makedirs(out, exist_ok=True)
while True:
    try:
        taken = ctl + f".taken-{os.getpid()}"
        os.rename(ctl, taken)
        fault = open(taken).read().strip()
    except OSError:
        fault = None
    if fault == "deadlock":
        print("fault: deadlock", flush=True)
        a, b = threading.Lock(), threading.Lock()
        def other():
            with b:
                time.sleep(0.1)
                with a:
                    pass
        threading.Thread(target=other, daemon=True).start()
        with a:
            time.sleep(0.1)
            with b:
                pass
    elif fault == "crash":
        print("fault: crash", flush=True)
        raise SystemExit(3)
    elif fault == "busy":
        print("fault: busy loop", flush=True)
        x = 0
        while True:
            x += 1
    step += 1
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1},
                       "return_hidden_states": True}).encode()
    req = urllib.request.Request(server + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:  # blocks while the server is stopped
        r.read()
    with open(os.path.join(out, f"step_{step % 50}.bin"), "wb") as f:  # blocks while frozen
        f.write(os.urandom(4096))
    print(f"step {step}/{total}", flush=True)
    time.sleep(0.2)
'''


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


class Fs:
    """A loop-mounted ext4 for the job's outputs (root only): the fsfreeze fault."""

    def __init__(self, base: Path) -> None:
        self.img = base / "fs.img"
        self.mnt = base / "mnt"
        self.mnt.mkdir(exist_ok=True)
        with open(self.img, "wb") as f:
            f.truncate(64 << 20)
        sh("mkfs.ext4", "-q", "-F", str(self.img))
        self.dev = sh("losetup", "--find", "--show", str(self.img))
        sh("mount", self.dev, str(self.mnt))
        self.frozen = False

    def freeze(self) -> None:
        sh("fsfreeze", "-f", str(self.mnt))
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            subprocess.run(["fsfreeze", "-u", str(self.mnt)], capture_output=True)
            self.frozen = False

    def close(self) -> None:
        self.thaw()
        subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
        subprocess.run(["losetup", "-d", self.dev], capture_output=True)


def proc_figures(pid: int) -> tuple[int | None, int | None, int | None]:
    """(RSS KiB, open fds, threads) of a process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return rss, fds, threads
    except (OSError, AttributeError):
        return None, None, None


def incidents(db: Path) -> list[dict]:
    try:
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        try:
            cur = c.execute("SELECT id, kind, state, started_at, resolved_at FROM incidents")
            return [dict(zip([d[0] for d in cur.description], r, strict=True)) for r in cur.fetchall()]
        finally:
            c.close()
    except sqlite3.Error:
        return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of faults")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between faults")
    ap.add_argument("--hold", type=float, default=None,
                    help="how long a stopped server / frozen fs stays so (default 0.75 × every)")
    ap.add_argument("--faults", default=None,
                    help="comma-separated rotation (default deadlock,crash,busy,server[,fsfreeze])")
    ap.add_argument("--out", type=Path, default=None, help="work dir (default a temp dir)")
    ap.add_argument("--settle", type=float, default=45.0, help="seconds to wait after the last fault")
    a = ap.parse_args()
    hold = a.hold if a.hold is not None else 0.75 * a.every
    root = os.geteuid() == 0 and shutil.which("fsfreeze") and shutil.which("losetup")
    faults = a.faults.split(",") if a.faults else \
        ["deadlock", "crash", "busy", "server"] + (["fsfreeze"] if root else [])
    work = a.out or Path(tempfile.mkdtemp(prefix="stallwatch-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.py").write_text(JOB)
    ctl = work / "fault"
    fs = Fs(work) if "fsfreeze" in faults else None
    outputs = (fs.mnt if fs else work) / "out"
    srv = subprocess.Popen([sys.executable, str(SERVER)], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                           start_new_session=True)
    port = re.match(r"listening on (\d+)", srv.stdout.readline().decode()).group(1)
    url = f"http://127.0.0.1:{port}"
    state = work / "state"
    cfg = work / "soak.toml"
    cmd = [sys.executable, str(work / "job.py"), str(ctl), str(outputs), url]
    cfg.write_text(f"""
[daemon]
interval_s = 1.0
state_dir = "{state}"

[[job]]
name = "soak"
command = {json.dumps(cmd)}
cwd = "{work}"
log = "{work / 'job.log'}"
outputs = "{outputs}"
server = "{url}"
restart = "on-failure"
max_restarts = 100000
restart_backoff_s = 1
# A fault a minute compresses hours into minutes: a run that stayed up 20 s between two faults
# is what a 10-minute healthy run is on a real job (the default restart_reset_after_s).
restart_reset_after_s = 20
kill_grace_s = 3
""")
    cfg.chmod(0o600)
    dlog = open(work / "daemon.log", "ab")  # noqa: SIM115 - every restarted daemon writes to it

    def start_daemon() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "stallwatch", "run", "--config", str(cfg)],
                                stdout=dlog, stderr=subprocess.STDOUT, cwd=work)

    daemon = start_daemon()
    daemon_restarts = 0
    samples: list[dict] = []
    windows: list[dict] = []
    t_start = time.time()
    next_sample = 0.0
    undo_at: float | None = None
    undo = None
    i = 0
    time.sleep(min(30.0, a.every / 2))  # the job starts and shows some progress first
    t_faults = time.time()
    next_fault = t_faults
    end = t_faults + a.duration
    try:
        while True:
            now = time.time()
            if daemon.poll() is not None:
                daemon_restarts += 1
                print(f"daemon exited ({daemon.returncode}); restarting it", flush=True)
                time.sleep(5)
                daemon = start_daemon()
            if now >= next_sample:
                rss, fds, threads = proc_figures(daemon.pid)
                samples.append({"t": round(now - t_start, 1), "rss_kib": rss, "fds": fds,
                                "threads": threads})
                next_sample = now + 10.0
            if undo_at is not None and now >= undo_at:
                undo()
                undo_at = None
            if now >= next_fault and now < end:
                if undo_at is not None:
                    undo()
                    undo_at = None
                fault = faults[i % len(faults)]
                i += 1
                windows.append({"fault": fault, "at": now})
                print(f"{now - t_start:7.1f} s  fault {i}: {fault}", flush=True)
                if fault in ("deadlock", "crash", "busy"):
                    ctl.write_text(fault)
                elif fault == "server":
                    os.kill(srv.pid, signal.SIGSTOP)
                    undo, undo_at = (lambda: os.kill(srv.pid, signal.SIGCONT)), now + hold
                elif fault == "fsfreeze":
                    fs.freeze()
                    undo, undo_at = fs.thaw, now + hold
                next_fault += a.every
            if now >= end + a.settle and undo_at is None:
                break
            time.sleep(0.2)
    finally:
        if undo_at is not None:
            undo()
        rss, fds, threads = proc_figures(daemon.pid)
        samples.append({"t": round(time.time() - t_start, 1), "rss_kib": rss, "fds": fds,
                        "threads": threads})
        alive = daemon.poll() is None
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        st = subprocess.run([sys.executable, "-m", "stallwatch", "status", "--json", "--config",
                             str(cfg)], capture_output=True, text=True)
        # stop the job (it outlives the daemon by design) and the server
        try:
            doc = json.loads(st.stdout)
            pid = doc["jobs"][0].get("pid")
            if pid:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ValueError, KeyError, IndexError, ProcessLookupError, OSError):
            pass
        os.kill(srv.pid, signal.SIGCONT)
        srv.kill()
        if fs:
            time.sleep(1)
            fs.close()

    incs = incidents(state / "stallwatch.db")
    ends = [w["at"] for w in windows[1:]] + [end + a.settle]
    per_fault: dict[str, dict] = {}
    rows = []
    for w, until in zip(windows, ends, strict=True):
        inside = [x for x in incs if w["at"] - 1 <= x["started_at"] < until]
        want = EXPECTED[w["fault"]]
        hit = [x for x in inside if x["kind"] == want]
        other = [x for x in inside if x["kind"] != want]
        resolved = [x for x in hit if x["state"] == "resolved"]
        r = {"fault": w["fault"], "expected": want, "opened": len(hit), "resolved": len(resolved),
             "other": [x["kind"] for x in other],
             "detect_s": round(hit[0]["started_at"] - w["at"], 1) if hit else None}
        rows.append(r)
        pf = per_fault.setdefault(w["fault"], {"injected": 0, "detected_once": 0, "missed": 0,
                                               "duplicated": 0, "resolved": 0, "other": 0,
                                               "detect_s": []})
        pf["injected"] += 1
        pf["detected_once"] += len(hit) == 1
        pf["missed"] += not hit
        pf["duplicated"] += len(hit) > 1
        pf["resolved"] += len(resolved)
        pf["other"] += len(other)
        if r["detect_s"] is not None:
            pf["detect_s"].append(r["detect_s"])
    rss = [s["rss_kib"] for s in samples if s["rss_kib"]]
    fds = [s["fds"] for s in samples if s["fds"] is not None]
    result = {
        "duration_s": round(a.duration, 1), "every_s": a.every, "hold_s": hold,
        "ran_s": round(time.time() - t_start, 1), "faults": len(windows),
        "daemon_alive_at_end": alive, "daemon_restarts": daemon_restarts,
        "rss_kib": {"first": rss[0] if rss else None, "last": rss[-1] if rss else None,
                    "min": min(rss, default=None), "max": max(rss, default=None)},
        "fds": {"first": fds[0] if fds else None, "last": fds[-1] if fds else None,
                "min": min(fds, default=None), "max": max(fds, default=None)},
        "per_fault": per_fault, "windows": rows, "samples": samples,
        "incidents_total": len(incs), "open_at_end": [x for x in incs if x["state"] == "open"],
    }
    (work / "soak.json").write_text(json.dumps(result, indent=2))
    md = ["| fault | injected | detected once | missed | duplicated | resolved | other kinds | "
          "detection (s, median) |", "|---|---|---|---|---|---|---|---|"]
    for f, pf in per_fault.items():
        d = sorted(pf["detect_s"])
        med = d[len(d) // 2] if d else "—"
        md.append(f"| {f} ({EXPECTED[f]}) | {pf['injected']} | {pf['detected_once']} | "
                  f"{pf['missed']} | {pf['duplicated']} | {pf['resolved']} | {pf['other']} | {med} |")
    (work / "soak.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(json.dumps({k: result[k] for k in ("ran_s", "faults", "daemon_alive_at_end",
                                              "daemon_restarts", "rss_kib", "fds",
                                              "incidents_total")}, indent=1))
    print(f"work dir: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
