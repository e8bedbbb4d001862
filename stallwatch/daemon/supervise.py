"""Starting a supervised job so that it outlives the daemon, and finding it again later.

Two ways, chosen per spawn:
- **setsid** (the default, and what tests exercise): the wrapper (stallwatch.daemon.wrap) is
  started with start_new_session=True, in the job's cwd, stdout and stderr appended to its log.
  A new session has no controlling terminal, so nothing is sent to it when the daemon exits.
  This is enough outside systemd, and inside a service with KillMode=process.
- **systemd-run**, when the daemon runs as a systemd service (INVOCATION_ID is set) and
  systemd-run exists (or `[daemon] systemd_run = "always"`): the wrapper runs in a transient
  unit of its own, `stallwatch-<job>-<n>.service`, with KillMode=control-group. Then the job is
  in its own cgroup, not in the daemon's: `systemctl restart stallwatch` cannot kill it whatever
  the daemon unit's KillMode says, and `systemctl status stallwatch-extract-3` shows it.

Either way the daemon learns the job's pid, start time and exit status from the wrapper's status
file (state_dir/runs/<job>-<n>.json), never from being the parent. Identity is always
(pid, start_ticks): a pid whose start time differs is someone else, never adopted, never killed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallwatch.daemon.wrap import proc_state, start_ticks

__all__ = ["Spawned", "SpawnError", "spawn", "read_status", "identity_alive", "find_wrapper",
           "use_systemd_run", "wrapper_argv", "systemd_run_argv", "proc_state"]


class SpawnError(Exception):
    pass


@dataclass
class Spawned:
    how: str  # "setsid" | "systemd-run"
    status_file: Path
    popen: subprocess.Popen | None  # the wrapper (setsid) or systemd-run itself
    unit: str | None = None
    wrapper_pid: int | None = None
    wrapper_start_ticks: int | None = None


def wrapper_argv(status_file: Path, job: str, command: tuple[str, ...] | list[str]) -> list[str]:
    return [sys.executable, "-m", "stallwatch.daemon.wrap", "--status-file", str(status_file),
            "--job", job, "--", *command]


def use_systemd_run(mode: str, environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if mode == "never":
        return False
    if mode == "always":
        return True
    # auto: we are a systemd service (INVOCATION_ID) and can ask systemd for a unit.
    return bool(env.get("INVOCATION_ID")) and shutil.which("systemd-run") is not None \
        and os.path.isdir("/run/systemd/system")


def unit_name(job: str, seq: int) -> str:
    return f"stallwatch-{job}-{seq}"


def systemd_run_argv(job: str, seq: int, status_file: Path, command: tuple[str, ...],
                     cwd: Path | None, log: Path, env: dict[str, str]) -> list[str]:
    argv = [shutil.which("systemd-run") or "systemd-run", f"--unit={unit_name(job, seq)}",
            "--collect", "--quiet", "--no-block",
            "-p", "KillMode=control-group",
            "-p", f"StandardOutput=append:{log}",
            "-p", f"StandardError=append:{log}",
            "-p", f"Description=stallwatch job {job} (run {seq})"]
    if cwd is not None:
        argv += ["-p", f"WorkingDirectory={cwd}"]
    # A transient unit starts with systemd's environment, not ours: pass what the job needs.
    for k in ("PATH", "PYTHONPATH", "LANG", "HOME"):
        if k in os.environ and k not in env:
            argv.append(f"--setenv={k}={os.environ[k]}")
    for k, v in env.items():
        argv.append(f"--setenv={k}={v}")
    return argv + ["--", *wrapper_argv(status_file, job, command)]


def spawn(job: str, seq: int, command: tuple[str, ...], *, status_file: Path, log: Path,
          cwd: Path | None, env: dict[str, str], systemd_run: bool) -> Spawned:
    """Start the wrapper; returns at once (the status file appears when the child runs)."""
    status_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        status_file.unlink()
    except FileNotFoundError:
        pass
    log.parent.mkdir(parents=True, exist_ok=True)
    if systemd_run:
        argv = systemd_run_argv(job, seq, status_file, command, cwd, log, env)
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise SpawnError(f"systemd-run: {e}") from e
        return Spawned(how="systemd-run", status_file=status_file, popen=p,
                       unit=unit_name(job, seq) + ".service")
    full_env = dict(os.environ)
    full_env.update(env)
    # NOTIFY_SOCKET and the watchdog variables are the daemon's, not the job's.
    for k in ("NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC", "LISTEN_FDS", "LISTEN_PID"):
        full_env.pop(k, None)
    try:
        with open(log, "ab") as out:
            p = subprocess.Popen(wrapper_argv(status_file, job, command), cwd=cwd,
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True, env=full_env, close_fds=True)
    except OSError as e:
        raise SpawnError(f"cannot start the wrapper: {e}") from e
    return Spawned(how="setsid", status_file=status_file, popen=p, wrapper_pid=p.pid,
                   wrapper_start_ticks=start_ticks(p.pid))


def read_status(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The wrapper's status document, or None while it is not there (or unreadable)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def identity_alive(pid: int | None, ticks: int | None) -> bool:
    """Is (pid, start_ticks) a live process (not a zombie)? A reused pid answers False."""
    if not pid or ticks is None:
        return False
    st = proc_state(pid)
    if st is None or st[1] != ticks:
        return False
    # A zombie leader whose other threads live on (one blocked in D) is not gone.
    return st[0] not in ("Z", "X") or _threads_alive(pid)


def _threads_alive(pid: int) -> bool:
    """Does a thread of `pid` other than its exited leader still live?"""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        if text[text.rfind(")") + 2:][:1] not in ("Z", "X"):
            return True
    return False


def identity_exists(pid: int | None, ticks: int | None) -> bool:
    """Like identity_alive, but a zombie still counts (it holds its pid and its group)."""
    if not pid or ticks is None:
        return False
    st = proc_state(pid)
    return st is not None and st[1] == ticks


def find_wrapper(status_file: str | os.PathLike[str]) -> int | None:
    """A live wrapper process for this status file (its command line names the file)."""
    needle = os.fsencode(str(status_file))
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"stallwatch.daemon.wrap" in argv and needle in argv:
            st = proc_state(int(name))
            if st and st[0] not in ("Z", "X"):
                return int(name)
    return None
