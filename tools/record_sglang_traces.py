#!/usr/bin/env python
"""Record SGLang-pipeline traces on a GPU host: the protocol server holding the GPUs, the
extraction client writing .ckpt files, `stallwatch record` watching both, a fault injected.

    PYTHONPATH=. python tools/record_sglang_traces.py --out-dir tests/data/sglang --scenarios all

Scenarios (each a trace `<name>.jsonl` with `phase` events at the fault):
  tp2_rank_stopped  --tp 2; SIGSTOP the TP1 scheduler: TP0 waits on it in the collective
  tp2_rank_killed   --tp 2; SIGKILL the TP1 scheduler
  server_stopped    --tp 1; SIGSTOP the scheduler: HTTP alive, /health_generate hangs
  client_hang       --tp 1; the client deadlocks (its --fault hang)
  client_crash      --tp 1; the client raises (its --fault crash)
Scenarios run concurrently (one machine lease); each server gets its own port.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PY = sys.executable
SCEN = {
    "tp2_rank_stopped": {"tp": 2, "fault": ("signal", "TP1", signal.SIGSTOP)},
    "tp2_rank_killed": {"tp": 2, "fault": ("signal", "TP1", signal.SIGKILL)},
    "server_stopped": {"tp": 1, "fault": ("signal", "scheduler", signal.SIGSTOP)},
    "client_hang": {"tp": 1, "fault": ("client", "hang")},
    "client_crash": {"tp": 1, "fault": ("client", "crash")},
}


def children(pid: int) -> list[tuple[int, str]]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = open(f"/proc/{d}/stat").read()
                ppid = int(st.rsplit(")", 1)[1].split()[1])
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if ppid == pid:
                out.append((int(d), cmd))
    return out


CLIENT_FAULT_AT = 60
INTERVAL_S = float(os.environ.get("SW_INTERVAL", "1.0"))
DEVICE = os.environ.get("SW_DEVICE", "cuda")  # "python" for a dry run on a machine without a GPU


def progress_done(log: Path) -> int:
    tail = log.read_bytes()[-400:].decode("utf-8", "replace")
    m = re.findall(r"\| *(\d+)/\d+ \[", tail)
    return int(m[-1]) if m else 0


def wait(pred, timeout: float, what: str):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            v = pred()
        except OSError:  # not listening yet, or 503 while the scheduler warms up
            v = None
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError(what)


def scenario(name: str, spec: dict, out_dir: Path, lead_s: float, after_s: float, results: dict,
             version: str = "current") -> None:
    work = Path(tempfile.mkdtemp(prefix=f"sw-{name}-"))
    port_file, slog, clog, outs = work / "port", work / "server.log", work / "extract.log", work / "hs"
    srv = subprocess.Popen([PY, "-m", "stallwatch.sglang.protocol_server", "--port", "0",
                            "--port-file", str(port_file), "--tp", str(spec["tp"]), "--device", DEVICE,
                            "--sglang-version", version,
                            "--enable-metrics", "--enable-return-hidden-states", "--no-access-log", "--hidden-size", "256",
                            "--num-layers", "8", "--busy-factor", "200", "--kv-cache-gb", "4",
                            "--log", str(slog)], start_new_session=True)
    procs = [srv]
    try:
        port = wait(lambda: port_file.exists() and port_file.read_text().strip(), 180, "server port")
        url = f"http://127.0.0.1:{port}"
        wait(lambda: urllib.request.urlopen(url + "/ready", timeout=5).status == 200, 180, "ready")
        cargs = [PY, "-m", "stallwatch.sglang.extract_client", "--server", url, "--out", str(outs),
                 "--num-samples", "100000", "--seq-len", "128", "--log", str(clog)]
        f = spec["fault"]
        if f[0] == "client":
            cargs += ["--fault", f[1], "--fault-at", str(CLIENT_FAULT_AT)]
        cli = subprocess.Popen(cargs, start_new_session=True)
        procs.append(cli)
        wait(lambda: clog.exists() and clog.stat().st_size > 0, 60, "client progress")
        trace = out_dir / f"{name}.jsonl"
        # The job is the client; the server's processes are found from its port by the collector.
        rec = subprocess.Popen([PY, "-m", "stallwatch", "record", "--pid", str(cli.pid),
                                "--log", str(clog), "--outputs", str(outs), "--server", url,
                                "--out", str(trace), "--interval", str(INTERVAL_S),
                                "--note", f"tools/record_sglang_traces.py {name}: protocol server tp={spec['tp']} "
                                          f"on GPU, extraction client, fault {f[0]} {f[1]}"])
        victim = None
        if f[0] == "signal":
            time.sleep(lead_s)
            victim = next(p for p, c in children(srv.pid) if c.startswith("sglang::scheduler") and
                          (f[1] == "scheduler" or c.endswith(f[1])))
            os.kill(victim, f[2])
        else:  # the client's own fault fires at sample CLIENT_FAULT_AT
            wait(lambda: progress_done(clog) >= CLIENT_FAULT_AT - 1 or cli.poll() is not None, 600, "fault")
        fault_wall = time.time()
        time.sleep(after_s)
        rec.send_signal(signal.SIGINT)
        rec.wait(timeout=30)
        with open(trace, "a") as fh:
            fh.write(json.dumps({"type": "event", "kind": "phase", "phase": "fault", "wall": fault_wall,
                                 "fault": f"{f[0]} {f[1]}", "victim_pid": victim,
                                 "client_pid": cli.pid, "server_pid": srv.pid}) + "\n")
        results[name] = {"ok": rec.returncode == 0, "trace": str(trace), "bytes": trace.stat().st_size}
    except Exception as e:  # noqa: BLE001 - one scenario failing must not lose the others
        results[name] = {"ok": False, "error": repr(e),
                         "server_log_tail": slog.read_text()[-2000:] if slog.exists() else ""}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--scenarios", default="all")
    ap.add_argument("--lead-s", type=float, default=10)
    ap.add_argument("--after-s", type=float, default=35)
    # The traces in tests/data/sglang predate the shapes (old failure model, like 0.5.4);
    # `current` records today's: a killed rank takes the server down, the watchdog kills a stall.
    ap.add_argument("--sglang-version", default="current", choices=("current", "0.5.4"))
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(SCEN) if a.scenarios == "all" else a.scenarios.split(",")
    results: dict = {}
    threads = [threading.Thread(target=scenario, args=(n, SCEN[n], out, a.lead_s, a.after_s, results,
                                                       a.sglang_version))
               for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
