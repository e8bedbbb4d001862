"""The SpecForge-shaped torchrun job (tests/jobs/specforge_job.py: torchrun, 3 ranks, gloo on
CPU) started for a test, its ranks found, and the whole tree killed after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).parent / "jobs" / "specforge_job.py"


def children(pid: int) -> list[int]:
    """The kernel's list of pid's children (cheap enough to poll)."""
    try:
        return sorted(int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except OSError:
        return []


# Waits for a file, then becomes torchrun (exec: the same pid), with no child of its own.
GATE = ("import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
        "os.execv(sys.argv[2], sys.argv[2:])")


def torchrun(out: Path, log: Path, *args: str, nproc: int = 3,
             gate: Path | None = None) -> subprocess.Popen:
    """torchrun of the job; with `gate`, its pid waits for that file to exist before it becomes
    torchrun, so a watcher can be started on that pid and be watching before any rank runs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), str(JOB),
           "--output-path", str(out), "--num-samples", "120", "--batch-size", "4",
           "--batch-s", "0.3", *args]
    if gate is not None:
        cmd = [sys.executable, "-c", GATE, str(gate), *cmd]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))


def kill_tree(job: subprocess.Popen, kids: list[int]) -> None:
    for pid in [job.pid, *kids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait(30)
