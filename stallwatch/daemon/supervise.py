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

Either way the wrapper stays root (it writes the status file into the root-only state
directory) and its child, stallwatch.daemon.runas, drops to the job's `user`/`group` before it
opens the job's log and execs the job: the log, on the job user's side, is never opened by the
daemon, the wrapper or PID 1 (no `StandardOutput=append:` on a user's path). The job's
environment is built here (`job_environment`), never the daemon's own: the daemon holds alert
secrets (`url_env`) and credentials that the job's user must not read.

Either way the daemon learns the job's pid, start time and exit status from the wrapper's status
file (state_dir/runs/<job>-<n>.json), never from being the parent. Identity is always
(pid, start_ticks): a pid whose start time differs is someone else, never adopted, never killed.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallwatch.kernel import safefs
from stallwatch.kernel.proc import DEAD_STATES, Proc, pids
from stallwatch.kernel.roots import Absent, Denied
from stallwatch.daemon.wrap import proc_comm, proc_state, start_ticks

__all__ = ["Spawned", "SpawnError", "RunAs", "resolve_user", "job_environment", "spawn",
           "read_status", "identity_alive", "find_wrapper", "use_systemd_run", "wrapper_argv",
           "systemd_run_argv", "proc_state", "proc_comm"]

STATUS_MAX_BYTES = 64 << 10  # a status document is a few hundred bytes
# What a job inherits from the daemon's environment, and nothing else: the locale, the search
# paths, where temporary files go, which GPUs and CUDA. Secrets (url_env), credentials (AWS_*,
# tokens), the daemon's sd_notify socket and whatever else the admin's shell exported stay with
# the daemon; a job needs more through its `env`.
INHERITED_ENV = re.compile(r"^(PATH|LANG|LANGUAGE|LC_[A-Z_]+|TZ|TMPDIR|PYTHONPATH|LD_LIBRARY_PATH"
                           r"|VIRTUAL_ENV|CUDA_HOME|CUDA_VISIBLE_DEVICES)$")


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


@dataclass(frozen=True)
class RunAs:
    """Who the job runs as: the config's `user`/`group`, resolved when it is started."""
    uid: int
    gid: int
    groups: tuple[int, ...]
    name: str | None
    home: str | None


def resolve_user(user: str | int | None, group: str | int | None = None) -> RunAs | None:
    """`user` (a name or a uid) and `group` (default: the user's primary group) → ids; the
    supplementary groups of a named user come along (`id NAME`), a bare uid gets none."""
    if user is None:
        return None
    try:
        pw = pwd.getpwnam(user) if isinstance(user, str) and not user.isdigit() \
            else pwd.getpwuid(int(user))
    except KeyError:
        if isinstance(user, str) and not user.isdigit():
            raise SpawnError(f"user {user!r}: no such user") from None
        pw = None
    uid = pw.pw_uid if pw else int(user)
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid if isinstance(group, str) and not group.isdigit() \
                else int(group)
        except KeyError:
            raise SpawnError(f"group {group!r}: no such group") from None
    else:
        gid = pw.pw_gid if pw else uid
    groups = tuple(os.getgrouplist(pw.pw_name, gid)) if pw else ()
    return RunAs(uid=uid, gid=gid, groups=groups, name=pw.pw_name if pw else None,
                 home=pw.pw_dir if pw else None)


def job_environment(extra: dict[str, str], run_as: RunAs | None,
                    environ: dict[str, str] | None = None) -> dict[str, str]:
    """The job's environment, built: the locale and PATH from ours, the user's identity, then
    the config's `env` (which wins)."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in env.items() if INHERITED_ENV.match(k)}
    out.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    if run_as is not None:
        if run_as.name:
            out["USER"] = out["LOGNAME"] = run_as.name
        if run_as.home:
            out["HOME"] = run_as.home
    elif "HOME" in env:
        out["HOME"] = env["HOME"]
    out.update(extra)
    return out


def wrapper_argv(status_file: Path, job: str, command: tuple[str, ...] | list[str], *,
                 log: Path | None = None, admin_log: bool = False, cwd: Path | None = None,
                 run_as: RunAs | None = None) -> list[str]:
    argv = [sys.executable, "-m", "stallwatch.daemon.wrap", "--status-file", str(status_file),
            "--job", job]
    if log is not None:
        argv += ["--admin-log" if admin_log else "--log", str(log)]
    if cwd is not None:
        argv += ["--cwd", str(cwd)]
    if run_as is not None:
        argv += ["--uid", str(run_as.uid), "--gid", str(run_as.gid),
                 "--groups", ",".join(str(g) for g in run_as.groups)]
    return argv + ["--", *command]


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
                     cwd: Path | None, log: Path, env: dict[str, str], *,
                     admin_log: bool = False, run_as: RunAs | None = None) -> list[str]:
    """The transient unit runs the wrapper as root; its output goes to the journal. The job's
    log is opened by the wrapper's child after it dropped to the job's user, never by PID 1
    (`StandardOutput=append:` would open a user's path as root, outside the unit's sandbox)."""
    argv = [shutil.which("systemd-run") or "systemd-run", f"--unit={unit_name(job, seq)}",
            "--collect", "--quiet", "--no-block",
            "-p", "KillMode=control-group",
            "-p", f"Description=stallwatch job {job} (run {seq})"]
    # A transient unit starts with systemd's environment, not ours: `env` is the job's whole
    # environment, built by job_environment.
    for k, v in env.items():
        argv.append(f"--setenv={k}={v}")
    return argv + ["--", *wrapper_argv(status_file, job, command, log=log, admin_log=admin_log,
                                       cwd=cwd, run_as=run_as)]


def spawn(job: str, seq: int, command: tuple[str, ...], *, status_file: Path, log: Path,
          cwd: Path | None, env: dict[str, str], systemd_run: bool, admin_log: bool = False,
          run_as: RunAs | None = None) -> Spawned:
    """Start the wrapper; returns at once (the status file appears when the child runs).

    `env` is added to the built environment (job_environment); `admin_log`: the log lies in
    the state directory (the default log), root's side, and the wrapper opens it itself."""
    status_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        status_file.unlink()
    except FileNotFoundError:
        pass
    if admin_log:
        log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    env = job_environment(env, run_as)
    if systemd_run:
        argv = systemd_run_argv(job, seq, status_file, command, cwd, log, env,
                                admin_log=admin_log, run_as=run_as)
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise SpawnError(f"systemd-run: {e}") from e
        return Spawned(how="systemd-run", status_file=status_file, popen=p,
                       unit=unit_name(job, seq) + ".service")
    # The wrapper's own words (a job that cannot start) go beside its status file, root's.
    out_path = status_file.with_suffix(".out")
    try:
        out = safefs.open_file(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError as e:
        raise SpawnError(f"cannot open {out_path}: {e}") from e
    try:
        p = subprocess.Popen(wrapper_argv(status_file, job, command, log=log, admin_log=admin_log,
                                          cwd=cwd, run_as=run_as),
                             stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             start_new_session=True, env=env, close_fds=True)
    except OSError as e:
        raise SpawnError(f"cannot start the wrapper: {e}") from e
    finally:
        os.close(out)
    return Spawned(how="setsid", status_file=status_file, popen=p, wrapper_pid=p.pid,
                   wrapper_start_ticks=start_ticks(p.pid))


def read_status(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The wrapper's status document, or None while it is not there, unreadable, or not
    provably the wrapper's: it must be a regular file (no link followed) of at most
    STATUS_MAX_BYTES, owned by us and writable by nobody else, in a directory of ours that
    nobody else can write — only the wrapper (root, as we are) can have written it. Who wrote
    it is then checked against the process itself by `status_authentic`."""
    if not path:
        return None
    try:
        parent, name = os.path.split(os.fspath(path))
        dfd = safefs.open_dir(parent)
        try:
            dst = os.fstat(dfd)
            if dst.st_uid != os.geteuid() or dst.st_mode & 0o022:
                return None
            fd = safefs.open_in(dfd, name)
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022 or st.st_nlink != 1:
                return None
            data = os.read(fd, STATUS_MAX_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > STATUS_MAX_BYTES:
            return None
        doc = json.loads(data)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def status_authentic(doc: dict[str, Any], status_file: str | os.PathLike[str], *,
                     wrapper: tuple[int | None, int | None] = (None, None)) -> str:
    """"" when `doc` may be believed, else why not. The wrapper it names must be the one we
    started (`wrapper`, when known) or, alive, a process of our uid whose command line names
    this status file; the job it names (alive) must be that wrapper's child; never pid 1 or 0."""
    wpid, wticks = doc.get("wrapper_pid"), doc.get("wrapper_start_ticks")
    pid = doc.get("pid")
    for v in (wpid, pid):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 1):
            return f"names pid {v!r}"
    if wrapper[0] is not None and (wpid, wticks) != wrapper:
        return (f"names wrapper pid {wpid} (start {wticks}), not the wrapper started "
                f"(pid {wrapper[0]}, start {wrapper[1]})")
    wrapper_alive = identity_exists(wpid, wticks)
    if wrapper[0] is None and wrapper_alive and wpid is not None and not _is_wrapper_of(wpid, status_file):
        return f"wrapper pid {wpid} is not a wrapper of ours for this status file"
    if pid is not None and wrapper_alive and identity_exists(pid, doc.get("start_ticks")) \
            and _ppid(pid) != wpid:
        return f"pid {pid} is not the child of wrapper pid {wpid}"
    return ""


def _ppid(pid: int) -> int | None:
    try:
        return Proc(pid).stat().ppid
    except (Absent, Denied, OSError, ValueError):
        return None


def _is_wrapper_of(pid: int, status_file: str | os.PathLike[str]) -> bool:
    try:
        p = Proc(pid)
        if p.owner_uid() != os.geteuid():
            return False
        argv = p.argv_bytes(1 << 16)
    except (Absent, Denied, OSError):
        return False
    return b"stallwatch.daemon.wrap" in argv and os.fsencode(str(status_file)) in argv


def identity_alive(pid: int | None, ticks: int | None) -> bool:
    """Is (pid, start_ticks) a live process (not a zombie)? A reused pid answers False."""
    if not pid or ticks is None:
        return False
    st = proc_state(pid)
    if st is None or st[1] != ticks:
        return False
    # A zombie leader whose other threads live on (one blocked in D) is not gone.
    return st[0] not in DEAD_STATES or Proc(pid).live_thread() is not None


def identity_exists(pid: int | None, ticks: int | None) -> bool:
    """Like identity_alive, but a zombie still counts (it holds its pid and its group)."""
    if not pid or ticks is None:
        return False
    st = proc_state(pid)
    return st is not None and st[1] == ticks


def find_wrapper(status_file: str | os.PathLike[str]) -> int | None:
    """A live wrapper process for this status file (its command line names the file, and it
    runs as the daemon does: a job's user can name any command line, not take our uid)."""
    needle = os.fsencode(str(status_file))
    try:
        candidates = pids()
    except (Absent, Denied, OSError):
        return None
    for pid in candidates:
        p = Proc(pid)
        try:
            argv = p.argv_bytes()
        except (Absent, Denied, OSError):
            continue
        if b"stallwatch.daemon.wrap" in argv and needle in argv:
            try:  # a command line is anyone's to choose; the wrapper runs as we do
                if p.owner_uid() != os.geteuid():
                    continue
            except (Absent, Denied, OSError):
                continue
            st = proc_state(pid)
            if st and st[0] not in DEAD_STATES:
                return pid
    return None
