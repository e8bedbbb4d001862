"""The parent of every supervised job: `python -m stallwatch.daemon.wrap --status-file F -- cmd...`

Why a wrapper at all. The job must outlive the daemon (a daemon restart, an upgrade, a crash of
stallwatch itself must never kill a 3-day extraction), so the daemon starts it in a new session;
but then a restarted daemon is no longer its parent and cannot waitpid() for it, and the exit
status — "killed by SIGKILL", "exit code 1" — is exactly what tells a crash from a finish. So a
tiny parent stays with the job for its whole life, waits for it, and writes the status to a file
in the state directory, atomically (write a temp file, fsync, rename), which any later daemon
reads.

What it does, in order:
1. starts the command as its child, in a process group of its own (pgid = the child's pid), in
   the wrapper's session, through stallwatch.daemon.runas: the child drops to the job's user
   (`--uid/--gid/--groups`), opens the job's log as that user (`--log`), enters `--cwd`, then
   execs the command; a log in the state directory (`--admin-log`, the default log) is opened
   here instead, by root, in root's own directory. A failure before the exec comes back on a
   close-on-exec pipe and is recorded as "cannot start", as an exec failure always was;
2. writes F: {"state": "running", "pid", "start_ticks", "pgid", "wrapper_pid", ...};
3. waits for the child; writes F: {"state": "exited", "returncode", "exit_code" | "signal"};
4. exits with the child's code (128 + N when the child died of signal N).

Signals. The wrapper execs nothing and does nothing but wait, so it must be transparent:
SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 and SIGCONT sent to the wrapper are forwarded
to the child's process group, and the wrapper keeps waiting (it must outlive the child to record
its status). Ignoring them would be wrong — `kill <wrapper>` or `systemctl stop` must reach the
job — and dying of them would lose the exit status and orphan the job. Because the child has a
group of its own, stallwatch's kill action signals that group (the job and anything it spawned)
and never the wrapper, which then records "killed by SIGTERM/SIGKILL" as usual. A signal to the
whole session or cgroup (systemd's KillMode=control-group) reaches the child directly *and*
through the wrapper: the job may see such a signal twice, which programs treat like one (Python's
KeyboardInterrupt on a second SIGINT is the exception to know about). SIGKILL of the wrapper
itself cannot be forwarded: the job keeps running, its status file stays "running", and the
daemon then knows only that the process is gone, not how it ended (it says so).

If the job's process group is left behind by the wrapper's death it becomes orphaned; POSIX then
sends SIGHUP+SIGCONT to it only if one of its members is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from stallwatch.kernel.proc import Proc
from stallwatch.kernel.roots import Absent, Denied

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT)
VERSION = 1


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start_ticks) of a pid, None when there is no such process."""
    try:
        st = Proc(pid).stat()
    except (Absent, Denied, ValueError):
        return None
    return st.state, st.start_ticks


def proc_comm(pid: int, ticks: int) -> str | None:
    """The name (comm) of (pid, start_ticks), a zombie's too; None when that process is gone."""
    try:
        st = Proc(pid).stat()
    except (Absent, Denied, ValueError):
        return None
    return st.comm if st.start_ticks == ticks else None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (its identity against pid reuse)."""
    st = proc_state(pid)
    return st[1] if st else None


def write_status(path: str, doc: dict) -> None:
    """Atomically replace `path` with `doc` as JSON: a reader sees the old or the new, whole."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    data = (json.dumps(doc, sort_keys=True) + "\n").encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


_FORWARD_OPTS = ("--log", "--cwd", "--uid", "--gid", "--groups")


def _parse(argv: list[str]) -> tuple[str, str, list[str], dict[str, str]]:
    status_file, job = None, ""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            cmd = argv[i + 1:]
            break
        if a == "--status-file" and i + 1 < len(argv):
            status_file = argv[i + 1]
            i += 2
        elif a == "--job" and i + 1 < len(argv):
            job = argv[i + 1]
            i += 2
        elif (a in _FORWARD_OPTS or a == "--admin-log") and i + 1 < len(argv):
            opts[a] = argv[i + 1]
            i += 2
        else:
            raise SystemExit(f"stallwatch wrap: unexpected argument {a!r}")
    else:
        cmd = []
    if not status_file or not cmd:
        raise SystemExit("usage: python -m stallwatch.daemon.wrap --status-file FILE "
                         "[--job NAME] [--log F | --admin-log F] [--cwd D] [--uid U --gid G "
                         "--groups G1,G2] -- command [args...]")
    return status_file, job, cmd, opts


def _admin_log(path: str) -> int:
    """The default log, in the state directory: root's side, opened here without following a
    link all the same."""
    from stallwatch.kernel import safefs

    return safefs.open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def _start(cmd: list[str], opts: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """The child, through runas; ("", ok) or its reason for not starting (it has exited)."""
    from stallwatch.daemon.runas import runas_argv

    r, w = os.pipe()  # both close-on-exec; w is passed to the child explicitly
    out = _admin_log(opts["--admin-log"]) if "--admin-log" in opts else None
    groups = tuple(int(g) for g in opts.get("--groups", "").split(",") if g)
    argv = runas_argv(cmd, errfd=w, log=opts.get("--log"), cwd=opts.get("--cwd"),
                      uid=int(opts["--uid"]) if "--uid" in opts else None,
                      gid=int(opts["--gid"]) if "--gid" in opts else None, groups=groups)
    try:
        proc = subprocess.Popen(argv, process_group=0, stdin=None, stdout=out, stderr=out,
                                pass_fds=(w,))
    finally:
        os.close(w)
        if out is not None:
            os.close(out)
    with os.fdopen(r, "rb") as f:
        err = f.read(4096)  # EOF at the exec (close-on-exec) or at the child's exit
    return proc, err.decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> int:
    status_file, job, cmd, opts = _parse(sys.argv[1:] if argv is None else argv)
    me = os.getpid()
    base = {"version": VERSION, "job": job, "argv": cmd, "wrapper_pid": me,
            "wrapper_start_ticks": start_ticks(me)}
    child: dict[str, int] = {}
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        pgid = child.get("pgid")
        if pgid is None:
            pending.append(signum)  # before the child exists: delivered right after it does
            return
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            pass

    for s in FORWARDED:
        signal.signal(s, forward)

    started_wall = time.time()
    try:
        proc, failed = _start(cmd, opts)
    except OSError as e:
        proc, failed = None, f"cannot start: {e}"
    if failed or proc is None:
        code = proc.wait() if proc is not None else 126
        if not failed.startswith("cannot start"):
            failed = f"cannot start: {failed}"
        print(f"stallwatch wrap: {failed}", file=sys.stderr, flush=True)
        write_status(status_file, {**base, "state": "exited", "pid": None, "start_ticks": None,
                                   "pgid": None, "started_at": started_wall,
                                   "ended_at": time.time(), "returncode": code,
                                   "exit_code": code, "signal": None, "error": failed})
        return code
    child["pid"] = proc.pid
    child["pgid"] = proc.pid
    running = {**base, "state": "running", "pid": proc.pid, "start_ticks": start_ticks(proc.pid),
               "pgid": proc.pid, "started_at": started_wall}
    try:
        write_status(status_file, running)
    except OSError as e:
        print(f"stallwatch wrap: cannot write {status_file}: {e}", file=sys.stderr, flush=True)
    while pending:
        forward(pending.pop(0), None)

    rc = proc.wait()  # retried across our signal handlers (PEP 475)
    doc = {**running, "state": "exited", "ended_at": time.time(), "returncode": rc,
           "exit_code": rc if rc >= 0 else None, "signal": -rc if rc < 0 else None}
    if rc < 0:
        try:
            doc["signal_name"] = signal.Signals(-rc).name
        except ValueError:
            pass
    for _ in range(3):
        try:
            write_status(status_file, doc)
            break
        except OSError as e:
            print(f"stallwatch wrap: cannot write {status_file}: {e}", file=sys.stderr, flush=True)
            time.sleep(1)
    return rc if rc >= 0 else 128 + (-rc)


if __name__ == "__main__":
    sys.exit(main())
