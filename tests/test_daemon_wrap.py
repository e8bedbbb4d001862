"""The wrapper every supervised job runs under, and the supervisor's spawn/identity helpers."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


from stallwatch.daemon.supervise import (find_wrapper, identity_alive, read_status, spawn,
                                         systemd_run_argv, use_systemd_run)

TRAP = """
import signal, sys, time
def on(sig, _f):
    print(f"got {signal.Signals(sig).name}", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, on)
print("ready", flush=True)
time.sleep(60)
"""


def wait_for(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        v = probe()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def start(tmp_path: Path, argv: list[str]) -> tuple[object, Path, Path]:
    sf, log = tmp_path / "runs" / "j-1.json", tmp_path / "j.log"
    sp = spawn("j", 1, tuple(argv), status_file=sf, log=log, cwd=tmp_path, env={"X_TEST": "1"},
               systemd_run=False)
    return sp, sf, log


def test_exit_code_and_identity(tmp_path: Path) -> None:
    sp, sf, log = start(tmp_path, [sys.executable, "-c",
                                   "import os, sys; print(os.environ['X_TEST'], os.getcwd()); sys.exit(3)"])
    assert sp.popen.wait(30) == 3
    doc = read_status(sf)
    assert doc["state"] == "exited" and doc["returncode"] == 3 and doc["exit_code"] == 3
    assert doc["pgid"] == doc["pid"] != doc["wrapper_pid"] == sp.wrapper_pid
    assert log.read_text().strip() == f"1 {tmp_path}"  # env and cwd, stdout into the log
    assert not identity_alive(doc["pid"], doc["start_ticks"])
    assert os.stat(sf).st_mode & 0o077 == 0


def test_running_status_then_signal_to_the_jobs_group(tmp_path: Path) -> None:
    sp, sf, log = start(tmp_path, ["sleep", "60"])
    doc = wait_for(lambda: (d := read_status(sf)) and d.get("state") == "running" and d,
                   10, "the running status")
    assert identity_alive(doc["pid"], doc["start_ticks"])
    assert find_wrapper(sf) == sp.wrapper_pid
    # The job has a group of its own, in the wrapper's new session: the daemon's kill hits the
    # job's group, and the wrapper lives on to record how it ended.
    assert os.getpgid(doc["pid"]) == doc["pid"] and os.getsid(doc["pid"]) == sp.wrapper_pid
    os.killpg(doc["pgid"], signal.SIGKILL)
    sp.popen.wait(30)
    doc = read_status(sf)
    assert doc["returncode"] == -9 and doc["signal"] == 9 and doc["signal_name"] == "SIGKILL"
    assert sp.popen.returncode == 128 + 9


def test_wrapper_forwards_sigterm_and_waits(tmp_path: Path) -> None:
    sp, sf, log = start(tmp_path, [sys.executable, "-c", TRAP])
    # The log is opened by the job's first stage (runas), so it appears when the job starts.
    wait_for(lambda: log.exists() and "ready" in log.read_text(), 10, "the job's handler")
    os.kill(sp.wrapper_pid, signal.SIGTERM)  # `kill <wrapper>`, `systemctl stop`: reaches the job
    assert sp.popen.wait(30) == 7
    assert "got SIGTERM" in log.read_text()
    assert read_status(sf)["returncode"] == 7


def test_command_that_cannot_start(tmp_path: Path) -> None:
    sp, sf, log = start(tmp_path, [str(tmp_path / "no-such-program")])
    assert sp.popen.wait(30) == 127
    doc = read_status(sf)
    assert doc["state"] == "exited" and doc["pid"] is None and "cannot start" in doc["error"]


def test_systemd_run_choice_and_argv(tmp_path: Path) -> None:
    assert not use_systemd_run("never", {"INVOCATION_ID": "x"})
    assert not use_systemd_run("auto", {})
    assert use_systemd_run("always", {})
    argv = systemd_run_argv("extract", 3, tmp_path / "s.json", ("python", "x.py"), Path("/data"),
                            Path("/data/x.log"), {"A": "1"})
    assert "--unit=stallwatch-extract-3" in argv and "--collect" in argv
    assert "KillMode=control-group" in argv and "--setenv=A=1" in argv
    # PID 1 never opens the job's log (attack #1 of docs/security.md): the wrapper's child does,
    # as the job's user, and enters the working directory as that user too.
    assert not any(a.startswith(("StandardOutput", "StandardError", "WorkingDirectory"))
                   for a in argv)
    tail = argv[argv.index("--") + 1:]
    assert tail[1:4] == ["-m", "stallwatch.daemon.wrap", "--status-file"]
    assert tail[tail.index("--log"):tail.index("--log") + 4] == ["--log", "/data/x.log",
                                                                  "--cwd", "/data"]
    assert tail[-3:] == ["--", "python", "x.py"]
