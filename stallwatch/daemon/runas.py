"""The job's first moments: `python -m stallwatch.daemon.runas [options] -- cmd...`, exec'd into cmd.

The wrapper (root: it must write the status file into the root-only state directory) starts
this as its child; it drops to the job's user, then opens the job's log, then execs the job —
in that order, so that the log, a path in the job user's own directory, is opened with that
user's rights and no others: a log replaced by a symlink to /etc/passwd is refused by the
kernel, not appended to by root (docs/security.md, attack #1). The same pid execs the command,
so the wrapper's (pid, start time) of its child is the job's identity.

Without `--uid` (a job run as root, or one that drops privileges itself, e.g. through
`setpriv`), the log is still opened as it would be by root anywhere on the user's side: no
symlink followed (stallwatch.kernel.safefs), a regular file only, and not a file with a second hard
link (a link made to a file the user cannot read: `fs.protected_hardlinks` stops that, and this
does too where the sysctl is off).

A failure before the exec is written to `--errfd` (close-on-exec, so an exec that succeeds
closes it empty) and the process exits 126 (127: the program was not found), the shell's codes.
"""

from __future__ import annotations

import os
import sys

from stallwatch.kernel import safefs

__all__ = ["runas_argv", "main"]

LOG_MODE = 0o640


def runas_argv(command: list[str] | tuple[str, ...], *, errfd: int | None = None,
               log: str | None = None, log_opened: bool = False, cwd: str | None = None,
               uid: int | None = None, gid: int | None = None,
               groups: tuple[int, ...] = ()) -> list[str]:
    argv = [sys.executable, "-m", "stallwatch.daemon.runas"]
    if errfd is not None:
        argv += ["--errfd", str(errfd)]
    if log is not None and not log_opened:
        argv += ["--log", log]
    if cwd is not None:
        argv += ["--cwd", cwd]
    if uid is not None:
        argv += ["--uid", str(uid), "--gid", str(gid if gid is not None else uid),
                 "--groups", ",".join(str(g) for g in groups)]
    return argv + ["--", *command]


def _parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return opts, argv[i + 1:]
        if a in ("--errfd", "--log", "--cwd", "--uid", "--gid", "--groups") and i + 1 < len(argv):
            opts[a[2:]] = argv[i + 1]
            i += 2
        else:
            raise SystemExit(f"stallwatch runas: unexpected argument {a!r}")
    raise SystemExit("usage: python -m stallwatch.daemon.runas [--uid U --gid G --groups ...] "
                     "[--log FILE] [--cwd DIR] [--errfd N] -- command [args...]")


def drop(uid: int, gid: int, groups: list[int]) -> None:
    """setgroups, setresgid, setresuid: all three ids, so nothing can be regained. A daemon not
    run as root can only be the user already (`user` = the daemon's own user)."""
    if os.geteuid() != 0 and os.getresuid() == (uid, uid, uid) and os.getegid() == gid:
        return
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise PermissionError(f"could not drop to uid {uid} gid {gid}")


def open_log(path: str) -> int:
    fd = safefs.open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, LOG_MODE)
    if os.geteuid() == 0 and os.fstat(fd).st_nlink != 1:
        os.close(fd)
        raise safefs.UnsafePath(path, "has more than one hard link: not opened by root")
    return fd


def main(argv: list[str] | None = None) -> int:
    opts, cmd = _parse(sys.argv[1:] if argv is None else argv)
    errfd = int(opts["errfd"]) if "errfd" in opts else 2
    if errfd != 2:
        os.set_inheritable(errfd, False)
    step = "start"
    try:
        if "uid" in opts:
            step = "drop privileges"
            groups = [int(g) for g in opts.get("groups", "").split(",") if g]
            drop(int(opts["uid"]), int(opts.get("gid", opts["uid"])), groups)
        if "log" in opts:
            step = "open the log"
            fd = open_log(opts["log"])
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        if "cwd" in opts:
            step = "enter the working directory"
            os.chdir(opts["cwd"])
        step = "start"
        os.execvp(cmd[0], cmd)
    except OSError as e:
        code = 127 if step == "start" and isinstance(e, (FileNotFoundError, NotADirectoryError)) \
            else 126
        what = f"cannot {step}: {e}" if step != "start" else f"cannot start {cmd[0]!r}: {e}"
        try:
            os.write(errfd, what.encode("utf-8", "backslashreplace"))
        except OSError:
            pass
        return code
    return 126  # not reached: execvp returns only by raising


if __name__ == "__main__":
    sys.exit(main())
