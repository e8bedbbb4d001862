"""The suite's reaper (conftest.py): a process a test leaves behind, in a session of its own and
naming the test's tmp_path, is gone once the test is over. The two tests run in this order, in
one worker (--dist loadfile keeps a file together)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

LEFT: list[int] = []


def test_a_test_leaves_a_process_in_its_own_session(tmp_path: Path) -> None:
    p = subprocess.Popen(["sleep", "600", str(tmp_path / "marker")], start_new_session=True)
    LEFT.append(p.pid)
    assert Path(f"/proc/{p.pid}").exists()


def test_it_was_reaped_after_that_test() -> None:
    assert LEFT, "the first test did not run before this one"
    pid = LEFT[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # our child: reap the zombie SIGKILL left
        except ChildProcessError:
            break
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()
