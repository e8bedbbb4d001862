"""The command sink runs a real program: argv without a shell, STALLWATCH_* variables, the JSON
on stdin, a timeout that kills its process group, exit 75 retried, other failures reported."""

from __future__ import annotations

import json
import os
import select
import sys
import textwrap
import time
from pathlib import Path

import pytest

from alertkit import FAST, deliver, dispatcher, event

RECORDER = textwrap.dedent("""
    import json, os, sys
    out = sys.argv[1]
    doc = {"argv": sys.argv[1:], "stdin": sys.stdin.read(),
           "env": {k: v for k, v in os.environ.items() if k.startswith("STALLWATCH_") or k == "EXTRA"},
           "sid_is_own": os.getsid(0) == os.getpid()}
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, out)
""")


@pytest.fixture
def recorder(tmp_path: Path) -> Path:
    p = tmp_path / "recorder.py"
    p.write_text(RECORDER)
    return p


def test_command_gets_env_and_json_on_stdin(tmp_path: Path, recorder: Path) -> None:
    out = tmp_path / "got.json"
    st = deliver([{"type": "command", "argv": [sys.executable, str(recorder), str(out), "$HOME; rm -rf /"],
                   "env": {"EXTRA": "yes"}}], event(cause="oom_kill"))["sinks"][0]
    assert st["sent"] == 1, st
    doc = json.loads(out.read_text())
    assert doc["argv"][1] == "$HOME; rm -rf /"  # no shell: passed verbatim
    assert doc["sid_is_own"] is True  # its own session: a timeout kills the whole group
    env = doc["env"]
    assert env["STALLWATCH_JOB"] == "extract"
    assert env["STALLWATCH_KIND"] == "io_stall"
    assert env["STALLWATCH_STATE"] == "firing"
    assert env["STALLWATCH_SEVERITY"] == "critical"
    assert env["STALLWATCH_SUMMARY"].startswith("extract: no progress for 41 s")
    assert env["STALLWATCH_HOST"] == "gpu-node-3"
    assert env["STALLWATCH_CAUSE"] == "oom_kill"
    assert env["STALLWATCH_INCIDENT_ID"] == "7" and env["STALLWATCH_EPISODE"] == "1"
    assert env["STALLWATCH_STARTED_AT"] == "1700000000"
    assert env["STALLWATCH_RESOLVED_AT"] == ""
    assert (env["STALLWATCH_EVIDENCE"].splitlines()[0]
            == "process: pid 1234 thread 1240 in D for 41 s, wchan percpu_rwsem_wait")
    assert env["STALLWATCH_PROGRESS_DONE"] == "18380" and env["STALLWATCH_ETA_S"] == "18560"
    assert env["STALLWATCH_TEST"] == "0"
    assert env["STALLWATCH_TITLE"] == "I/O stall \u2014 extract"
    assert env["EXTRA"] == "yes"
    payload = json.loads(doc["stdin"])
    assert payload["job"] == "extract" and payload["state"] == "firing"
    assert payload["evidence"][1]["signal"] == "disk" and "stallwatch_version" in payload


def test_command_exit_75_is_retried(tmp_path: Path) -> None:
    marker = tmp_path / "tries"
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        p = {str(marker)!r}
        n = len(open(p).read()) if __import__("os").path.exists(p) else 0
        open(p, "a").write("x")
        sys.exit(75 if n < 2 else 0)
    """))
    st = deliver([{"type": "command", "argv": [sys.executable, str(script)], **FAST}])["sinks"][0]
    assert marker.read_text() == "xxx"
    assert st["sent"] == 1 and st["retries"] == 2


def test_command_failure_reports_stderr(tmp_path: Path) -> None:
    st = deliver([{"type": "command", "argv": [sys.executable, "-c",
                   "import sys; sys.stderr.write('curl: (6) Could not resolve host\\n'); sys.exit(6)"],
                   **FAST}])["sinks"][0]
    assert st["failed"] == 1 and st["retries"] == 0
    prog = os.path.basename(sys.executable)
    assert st["last_error"] == f"command {prog} failed: exit status 6: curl: (6) Could not resolve host"


def test_command_timeout_kills_the_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    # the program starts a child that would outlive it, then hangs
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pidfile)!r}, "w").write(str(c.pid))
        time.sleep(60)
    """))
    d = dispatcher([{"type": "command", "argv": [sys.executable, str(script)], "timeout_s": 1.0,
                     "max_attempts": 1}])
    try:
        t0 = time.monotonic()
        d.submit(event())
        assert time.monotonic() - t0 < 0.5  # submit does not wait for the program
        assert d.flush(10)
        st = d.status()["sinks"][0]
    finally:
        d.close()
    assert st["failed"] == 1
    assert "did not finish within 1 s (killed)" in st["last_error"]
    child = int(pidfile.read_text())
    # killpg reached the grandchild too: its pidfd turns readable when it has exited
    try:
        fd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # already gone and reaped
    try:
        assert select.select([fd], [], [], 5.0)[0], f"grandchild {child} still alive 5 s after the kill"
    finally:
        os.close(fd)


def test_missing_program_fails_permanently() -> None:
    st = deliver([{"type": "command", "argv": ["/nonexistent/notify-me"], **FAST}])["sinks"][0]
    assert st["failed"] == 1 and st["retries"] == 0
    assert st["last_error"] == "command: /nonexistent/notify-me: no such program"
