"""bench/floor.py, the divisor of every "x floor": it must tick on the jobs the benchmarks watch.

A floor that crashed on its first tick (its socket sets were made in sweep(), after the first
read of them) read as "floor 0.00 ms" on the H200, whose GPU job holds unix sockets; the healthy
job here holds none, so nothing here had run that path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import socket, sys, time
u = socket.socketpair(socket.AF_UNIX)
t = socket.socket(); t.bind(("127.0.0.1", 0)); t.listen()
print("ready", flush=True)
sys.stdin.read()
"""


def test_the_floor_ticks_on_a_job_that_holds_unix_and_tcp_sockets(tmp_path: Path) -> None:
    job = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        ticks = tmp_path / "ticks"
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "floor.py"), "--pid", str(job.pid),
                            "--interval", "0.05", "--duration", "0.5", "--ticks-file", str(ticks)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr[-2000:]
        assert int(ticks.read_text()) >= 2
    finally:
        job.kill()
        job.wait()
