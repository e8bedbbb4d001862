"""The processes probe's safety net under the kernel's `children` lists (processes_tree.py): every
host process new since the last listing is looked at once per cycle, a slice a collect, instead
of all of /proc every 10 s in one tick (issue 17: that tick was the wide job's p99). A child the
lists missed is found by the slice that holds it, and the whole scan then runs in that tick."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rigs import spawned, wait_until

from stallwatch.clock import FakeClock
from stallwatch.kernel.roots import Roots
from stallwatch.probes.processes import ProcessesProbe
from stallwatch.probes.targets import Target

pytestmark = pytest.mark.skipif(
    not os.path.isfile(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
    reason="this kernel has no /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")

# A parent that forks one sleeping child when told to on stdin, and prints its pid.
PARENT = ("import subprocess, sys\n"
          "sys.stdin.readline()\n"
          "p = subprocess.Popen(['sleep', '600'])\n"
          "print(p.pid, flush=True)\n"
          "sys.stdin.readline()\n")


def test_a_child_the_lists_missed_is_found_by_its_slice():
    clock = FakeClock()
    with spawned([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                 text=True) as proc:
        probe = ProcessesProbe(Target(pids=(proc.pid,)), clock=clock)
        probe.collect()  # the first look: all of /proc
        full_at = probe._full_scan_mono
        # The kernel's lists "may miss a child forked while read" (proc(5)): this probe's walk
        # misses every child of the parent from now on.
        real = probe._children_of
        probe._children_of = lambda st, tick: [] if st.pid == proc.pid else real(st, tick)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("fork\n")
        proc.stdin.flush()
        kid = int(proc.stdout.readline())
        found_after = None
        # Collect until the cycle's listing holds the child (it was born after the first one)
        # and its slice is read: at most two cycles.
        for n in range(1, 2 * ProcessesProbe.SCAN_SLICES + 2):
            clock.advance(0.5)  # the cycle's deadline (FULL_SCAN_EVERY_S) not reached first
            obs = probe.collect()
            if kid in [p.pid for p in obs.processes]:
                found_after = n
                break
            assert probe._full_scan_mono == full_at  # no whole scan until its slice
        assert found_after is not None, "the sliced scan never found the missed child"
        assert probe._full_scan_mono == clock.monotonic()  # found by the whole scan it set off
        assert [p.ppid for p in obs.processes if p.pid == kid] == [proc.pid]


@dataclass(frozen=True)
class CountingRoots(Roots):
    """The host's /proc, noting each /proc/PID/stat read as text (the scans' reads)."""

    reads: list[int] = field(default_factory=list)

    def read_text(self, path, limit: int = 1 << 20) -> str:
        self._note(path)
        return super().read_text(path, limit)

    def read_small(self, path, limit: int = 16384) -> bytes:  # the slices' one read
        self._note(path)
        return super().read_small(path, limit)

    def _note(self, path) -> None:
        parts = str(path).split("/")
        if parts[-1] == "stat" and len(parts) == 4:  # /proc/PID/stat, not a thread's
            self.reads.append(int(parts[2]))


def test_each_new_host_process_is_read_once_a_cycle_in_slices():
    """A cycle reads the stat of each process its listing holds and the last one did not, once,
    in SCAN_SLICES collects of near-equal size; a collect past FULL_SCAN_EVERY_S since the
    listing reads the rest at once. A process looked at before (here: at the whole scan of the
    first look) is not read again: its parent changes only when that parent exits."""
    clock = FakeClock()
    with spawned([sys.executable, "-c", PARENT], stdin=subprocess.PIPE) as proc:
        reads: list[int] = []
        probe = ProcessesProbe(Target(pids=(proc.pid,)), roots=CountingRoots(reads=reads), clock=clock)
        before = {int(n) for n in os.listdir("/proc") if n.isdigit()}  # all in the whole scan
        probe.collect()
        born = [subprocess.Popen(["sleep", "600"]) for _ in range(12)]
        try:
            reads.clear()
            sizes = []
            for _ in range(3):
                clock.advance(0.5)
                n = len(reads)
                probe.collect()
                sizes.append(len(reads) - n)
            pids = probe._host_pids
            assert {p.pid for p in born} <= set(pids)
            assert not set(pids) & before & {int(n) for n in os.listdir("/proc") if n.isdigit()}
            assert probe._host_pos == min(len(pids), 3 * probe._host_step)
            assert set(reads) <= set(pids) and len(reads) == len(set(reads))  # each once
            assert max(sizes) <= probe._host_step
            clock.advance(ProcessesProbe.FULL_SCAN_EVERY_S)  # the cycle's deadline: the rest now
            probe.collect()
            assert probe._host_pos == len(pids)
            alive = {int(n) for n in os.listdir("/proc") if n.isdigit()}
            assert not (set(pids) & alive) - set(reads) - {proc.pid}
            reads.clear()
            for _ in range(ProcessesProbe.SCAN_SLICES):  # the next cycle: they are known now
                clock.advance(0.5)
                probe.collect()
            assert not {p.pid for p in born} & set(reads)
        finally:
            for p in born:
                p.kill()
                p.wait()


def test_a_spent_time_budget_sets_off_no_whole_scan_and_a_size_cap_does():
    """Past a size cap the next collect reads all of /proc (cheaper than the children lists of a
    huge tree); a spent time budget says the host is loaded, not that the tree is wide: a whole
    scan, whose threads are then read one by one outside the walk's batch, would make the next
    tick slower still (seen here at load 20: every such trip was followed by one)."""
    with spawned(["bash", "-c", "sleep 300 & wait"]) as job:
        wait_until(lambda: Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split(), 10)
        for kw, whole_scan in ((dict(budget_s=0.0), False), (dict(max_processes=1), True)):
            probe = ProcessesProbe(Target(pids=(job.pid,)), **kw)
            first = probe.collect()
            assert first.truncated and first.tree_processes == 2, (kw, first.truncated)
            full_at = probe._full_scan_mono
            again = probe.collect()
            assert again.truncated == first.truncated and again.tree_processes == 2
            assert (probe._full_scan_mono != full_at) is whole_scan, kw
