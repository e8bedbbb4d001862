"""`stallwatch run` supervising `torchrun … specforge_job.py` with restart = "on-failure" (issue 14).

Rank 1's writer deadlocks half-way through a file (the job's own fault hook, once): the daemon
calls it a hang, kills the whole tree — the torchrun agent and the three ranks, each in a session
of its own — quarantines the half-written file, restarts the command, and the resumed run (which
skips every file that exists, as SpecForge does) completes with every output whole. A watcher
thread counts the torchrun agents alive for this job at every moment: never two.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]' installs it)")
pytest.importorskip("tqdm", reason="needs tqdm (a test dependency)")

import torch

from stallwatch.actions.filecheck import validate_file
from rigs import live_processes
from daemonkit import Harness, fast_rules

pytestmark = pytest.mark.slow

JOB = Path(__file__).parent / "jobs" / "specforge_job.py"
SAMPLES = 60


def job_processes(marker: str) -> list[tuple[int, int, bool]]:
    """(pid, ppid, is_agent) of every live process of this test's job (its command line names
    `marker`, the outputs folder)."""
    out = []
    for p in live_processes(marker):
        agent = list(p.argv[1:3]) == [b"-m", b"torch.distributed.run"]  # not the daemon's wrapper
        if agent or any(a.endswith(b"specforge_job.py") for a in p.argv[1:3]):
            out.append((p.pid, p.ppid, agent))
    return out


class TreeWatch(threading.Thread):
    """Samples the job's agents every 50 ms; the most seen alive at once."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker, self.max_agents, self.samples = marker, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            procs = job_processes(self.marker)
            agent_pids = {pid for pid, _, agent in procs if agent}
            # A child of the agent between its fork and its exec (subprocess's vfork) still shows
            # the agent's command line: that is the agent starting a rank, not a second tree. A
            # second tree is a second agent whose parent is not an agent of this job.
            trees = [pid for pid, ppid, agent in procs if agent and ppid not in agent_pids]
            self.max_agents = max(self.max_agents, len(trees))
            self.samples += 1


@pytest.fixture
def h(tmp_path: Path):
    harness = Harness(tmp_path)
    try:
        yield harness
    finally:
        harness.cleanup()
        for pid, _, _ in job_processes(str(harness.out)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_deadlocked_rank_kills_the_tree_quarantines_and_resumes_once(h: Harness, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", str(JOB),
               "--output-path", str(h.out), "--num-samples", str(SAMPLES), "--batch-size", "4",
               "--batch-s", "0.2", "--fault", "deadlock", "--fault-rank", "1", "--fault-batch", "2"]
    h.write_config([], command=command, rules=fast_rules(tmp_path / "rules"), interval=0.5,
                   kill_grace_s=2, job="max_restarts = 2\nstartup_grace_s = 5")
    watch = TreeWatch(str(h.out))
    watch.start()
    daemon = h.start(env={"OMP_NUM_THREADS": "1"})
    try:
        h.wait_phase("finished", 240)
    finally:
        watch.stop.set()
        watch.join(5)
    assert watch.samples > 20, watch.samples
    assert watch.max_agents == 1, f"{watch.max_agents} torchrun agents alive at once"
    assert h.job()["restarts"] == 1
    inc, = h.incidents()
    assert inc["kind"] == "hang" and inc["state"] == "resolved"
    kill, = h.actions("kill")
    assert kill["outcome"].startswith("done")
    # every sample once, whole and loadable; the half-written file aside, broken
    files = sorted(h.out.glob("rows_0-2000/data_*.ckpt"))
    assert sorted(int(p.stem.split("_")[1]) for p in files) == list(range(SAMPLES))
    for p in files:
        assert validate_file(p).ok, p
        torch.load(io.BytesIO(p.read_bytes()), weights_only=True)
    # the quarantine (under the state folder; <outputs>.quarantine before): the half-written file
    aside = list(h.state.rglob("data_*.ckpt")) + list(h.dir.glob("*.quarantine/**/data_*.ckpt"))
    assert aside and all(not validate_file(p).ok for p in aside)
    assert "data_" in h.actions("validate")[0]["outcome"]
    assert h.stop(daemon) == 0
