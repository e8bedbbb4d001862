"""The daemon under test: `stallwatch run` as a subprocess over a config of one pt_writer job
(tests/jobs/pt_writer.py) or any command, and what the tests read back: the state database,
the daemon's log, the writer processes alive. The `h` fixture (conftest.py) is one Harness
whose daemons and jobs are gone after the test.

Every wait is on an event (a state-database row, a daemon log line, a /proc state) with a
deadline. `fast_rules` is the built-in rules with small thresholds, for the stall tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


from stallwatch.actions.filecheck import validate_file
from stallwatch.daemon.core import Daemon
from stallwatch.kernel import proc
from stallwatch.kernel.roots import Absent, Denied

from rigs import live_processes, query_state, wait_until

ROOT = Path(__file__).resolve().parents[1]
WRITER = ROOT / "tests" / "jobs" / "pt_writer.py"


# --------------------------------------------------------------------------------- harness

def fast_rules(dest: Path) -> Path:
    """The built-in rules with small stall thresholds: 3 s without progress, 2 s in D, 1 s `for`."""
    dest.mkdir()
    for f in sorted((ROOT / "rules").glob("*.toml")):
        text = f.read_text()
        text = text.replace("proc.d_quiet_s >= 10", "proc.d_quiet_s >= 2")
        text = text.replace("!activity.working",
                            "!(activity.known && activity.age_s >= 0.0 && activity.age_s < 2.0)")
        text = text.replace("stall_threshold_s", "3.0")
        text = re.sub(r'^for = "2s"', 'for = "1s"', text, flags=re.M)
        (dest / f.name).write_text(text)
    return dest


def scan_writers(marker: str) -> list[tuple[int, str]]:
    """(pid, state) of every live pt_writer process whose command line names `marker`."""
    # argv[1]: the writer itself, not its wrapper (which names it after `--`)
    return [(p.pid, p.state) for p in live_processes(marker)
            if len(p.argv) > 1 and p.argv[1].endswith(b"pt_writer.py")]


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.state = tmp_path / "state"
        self.out = tmp_path / "out"
        self.log = tmp_path / "job.log"
        self.cfg = tmp_path / "sw.toml"
        self.daemons: list[subprocess.Popen] = []

    # -- config and daemon

    def write_config(self, job_args: list[str], *, rules: Path | None = None, job: str = "",
                     daemon: str = "", alerts: str = "", interval: float = 0.25,
                     outputs: Path | None = None, command: list[str] | None = None,
                     kill_grace_s: float = 1) -> Path:
        """The daemon's config for one job "extract": pt_writer with `job_args`, or `command`."""
        command = command or [sys.executable, str(WRITER), "--out", str(outputs or self.out),
                              *job_args]
        text = f"""
[daemon]
interval_s = {interval}
state_dir = "{self.state}"
{f'rules = ["{rules}"]' if rules else ""}
{daemon}

[[job]]
name = "extract"
command = {json.dumps(command)}
cwd = "{self.dir}"
log = "{self.log}"
outputs = "{outputs or self.out}"
restart = "on-failure"
restart_backoff_s = 0.2
kill_grace_s = {kill_grace_s}
{job}

{alerts}
"""
        self.cfg.write_text(text)
        self.cfg.chmod(0o644)
        return self.cfg

    def start(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        n = len(self.daemons)
        with open(self.dir / f"daemon-{n}.log", "wb") as err:
            p = subprocess.Popen([sys.executable, "-m", "stallwatch", "run", "--config", str(self.cfg)],
                                 stdout=err, stderr=subprocess.STDOUT, cwd=self.dir,
                                 env={**os.environ, **(env or {})})
        self.daemons.append(p)
        return p

    def wait_phase(self, phase: str, timeout: float, name: str = "extract") -> None:
        """Wait for the job's phase; fail at once, with the daemon's log, if the daemon died."""
        def probe() -> bool:
            d = self.daemons[-1]
            if d.poll() is not None:
                raise AssertionError(f"the daemon exited ({d.returncode}):\n"
                                     + self.daemon_log()[-3000:])
            return self.phase(name) == phase
        wait_until(probe, timeout, f"job {name} to be {phase}")

    def daemon_log(self, n: int = -1) -> str:
        n = n if n >= 0 else len(self.daemons) - 1
        return (self.dir / f"daemon-{n}.log").read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float, n: int = -1) -> re.Match:
        return wait_until(lambda: re.search(pattern, self.daemon_log(n)), timeout,
                        f"daemon log line /{pattern}/")

    def stop(self, p: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
        p.send_signal(sig)
        return p.wait(30)

    # -- state database

    def q(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        return query_state(self.state, sql, args)

    def job(self, name: str = "extract") -> dict[str, Any] | None:
        rows = self.q("SELECT * FROM jobs WHERE name = ?", (name,))
        return rows[0] if rows else None

    def phase(self, name: str = "extract") -> str | None:
        j = self.job(name)
        return j["phase"] if j else None

    def incidents(self) -> list[dict[str, Any]]:
        return self.q("SELECT * FROM incidents ORDER BY id")

    def actions(self, what: str | None = None) -> list[dict[str, Any]]:
        if what:
            return self.q("SELECT * FROM actions WHERE what = ? ORDER BY id", (what,))
        return self.q("SELECT * FROM actions ORDER BY id")

    def ticks(self) -> int:
        rows = self.q("SELECT value FROM meta WHERE key = 'ticks'")
        return int(rows[0]["value"]) if rows and rows[0]["value"] else 0

    def status_json(self) -> dict[str, Any]:
        r = subprocess.run([sys.executable, "-m", "stallwatch", "status", "--json", "--config",
                            str(self.cfg), "--state-dir", str(self.state)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode in (0, 1, 2, 3), r.stderr
        return json.loads(r.stdout)

    # -- outputs

    def assert_outputs_complete(self, count: int) -> None:
        names = sorted(p.name for p in self.out.iterdir())
        assert names == sorted(f"data_{i}.pt" for i in range(count)), names
        for i in range(count):
            p = self.out / f"data_{i}.pt"
            ok, why = validate_file(p)
            assert ok, f"{p}: {why}"
            with zipfile.ZipFile(p) as z:
                assert z.testzip() is None

    # -- cleanup: daemons, then every job process started under this test's directory

    def cleanup(self) -> None:
        for p in self.daemons:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        for sf in (self.state / "runs").glob("*.json") if (self.state / "runs").exists() else ():
            try:
                doc = json.loads(sf.read_text())
            except (OSError, ValueError):
                continue
            for pid, ticks in ((doc.get("pid"), doc.get("start_ticks")),
                               (doc.get("wrapper_pid"), doc.get("wrapper_start_ticks"))):
                if pid and start_ticks(pid) == ticks:
                    try:
                        os.killpg(pid, signal.SIGKILL) if pid == doc.get("pgid") else \
                            os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for pid, _ in scan_writers(str(self.dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (with its pid, who it is); None once it is gone."""
    try:
        return proc.Proc(pid).stat().start_ticks
    except (Absent, Denied, OSError, ValueError):
        return None


@contextmanager
def daemon_in_thread(daemon: Daemon) -> Iterator[threading.Thread]:
    """Run an in-process Daemon in a thread from its first tick (asserted within 30 s) to the
    end of the block: then it is asked to stop, and asserted gone within 30 s."""
    t = threading.Thread(target=daemon.run, name="daemon", daemon=True)
    t.start()
    try:
        assert daemon.started.wait(30), "the daemon did not tick"
        yield t
    finally:
        daemon.request_stop()
        t.join(30)
    assert not t.is_alive(), "the daemon did not stop"
