"""The wrapper every supervised job runs under, and the supervisor's spawn/identity helpers."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


from stallwatch.daemon.supervise import (find_wrapper, identity_alive, read_status, spawn,
                                         systemd_run_argv, use_systemd_run)

from rigs import wait_until

TRAP = """
import signal, sys, time
def on(sig, _f):
    print(f"got {signal.Signals(sig).name}", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, on)
print("ready", flush=True)
time.sleep(60)
"""


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
    sp, sf, _log = start(tmp_path, ["sleep", "60"])
    doc = wait_until(lambda: (d := read_status(sf)) and d.get("state") == "running" and d,
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
    wait_until(lambda: log.exists() and "ready" in log.read_text(), 10, "the job's handler")
    os.kill(sp.wrapper_pid, signal.SIGTERM)  # `kill <wrapper>`, `systemctl stop`: reaches the job
    assert sp.popen.wait(30) == 7
    assert "got SIGTERM" in log.read_text()
    assert read_status(sf)["returncode"] == 7


def test_command_that_cannot_start(tmp_path: Path) -> None:
    sp, sf, _log = start(tmp_path, [str(tmp_path / "no-such-program")])
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


# ------------------------------------------------------------- the trust boundary (security.md)

def test_the_job_runs_as_its_user_with_a_built_environment(tmp_path: Path, monkeypatch) -> None:
    import json
    import shutil
    import tempfile

    from stallwatch.daemon.supervise import resolve_user

    if os.geteuid() != 0:
        import pytest
        pytest.skip("needs root: the wrapper drops to another user")
    monkeypatch.setenv("SLACK_WEBHOOK_URL", "https://hooks.example/SECRET")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SECRET2")
    home = Path(tempfile.mkdtemp(prefix="swwrap-"))  # reachable by nobody, unlike tmp_path
    try:
        home.chmod(0o711)
        (home / "u").mkdir()
        os.chown(home / "u", 65534, 65534)
        log = home / "u" / "j.log"
        code = ("import os, json; print(json.dumps([os.getresuid(), os.getresgid(), "
                "os.getgroups(), dict(os.environ), os.getcwd()]))")
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        sp = spawn("j", 1, (python, "-c", code), status_file=tmp_path / "runs" / "j-1.json",
                   log=log, cwd=home / "u", env={"X_TEST": "1"}, systemd_run=False,
                   run_as=resolve_user("65534"))
        assert sp.popen.wait(30) == 0, (tmp_path / "runs" / "j-1.out").read_text()
        uids, gids, groups, env, cwd = json.loads(log.read_text())
        assert uids == [65534] * 3 and gids[0] == gids[1] == gids[2] and 0 not in groups
        assert log.stat().st_uid == 65534  # opened by the job's user, not by root
        assert env["X_TEST"] == "1" and "PATH" in env and cwd == str(home / "u")
        assert "SLACK_WEBHOOK_URL" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    finally:
        shutil.rmtree(home)


def test_status_files_are_read_only_when_provably_the_wrappers(tmp_path: Path) -> None:
    import json

    from stallwatch.daemon.supervise import status_authentic

    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    doc = {"state": "running", "pid": 1, "start_ticks": 1, "wrapper_pid": None}
    f = runs / "j-1.json"
    f.write_text(json.dumps(doc))
    f.chmod(0o600)
    assert read_status(f) == doc
    assert "names pid 1" in status_authentic(doc, f)
    # the wrapper we started is the only one whose word counts
    doc2 = {**doc, "pid": 12345, "wrapper_pid": 999, "wrapper_start_ticks": 7}
    assert "not the wrapper started" in status_authentic(doc2, f, wrapper=(1000, 7))
    # writable by others, a link, too big: not read at all
    f.chmod(0o622)
    assert read_status(f) is None
    f.chmod(0o600)
    os.symlink(f, runs / "j-2.json")
    assert read_status(runs / "j-2.json") is None
    (runs / "j-3.json").write_text(" " * (70 << 10) + "{}")
    assert read_status(runs / "j-3.json") is None
    if os.geteuid() == 0:
        os.chown(f, 65534, 65534)  # someone else's file in our directory
        assert read_status(f) is None


def test_systemd_run_hands_the_user_and_the_log_to_the_wrapper(tmp_path: Path) -> None:
    from stallwatch.daemon.supervise import RunAs

    who = RunAs(uid=1234, gid=1235, groups=(1235, 27), name="alice", home="/home/alice")
    argv = systemd_run_argv("extract", 3, tmp_path / "s.json", ("python", "x.py"), None,
                            Path("/home/alice/x.log"), {"PATH": "/usr/bin"}, run_as=who)
    tail = argv[argv.index("--") + 1:]
    i = tail.index("--uid")
    assert tail[i:i + 6] == ["--uid", "1234", "--gid", "1235", "--groups", "1235,27"]
    assert "--log" in tail and "--admin-log" not in tail
    assert not any(a.startswith("User=") for a in argv)  # the wrapper stays root: runs/ is root's
