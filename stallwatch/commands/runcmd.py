"""`stallwatch run -- COMMAND`, `stallwatch run --config FILE` with `exit_with_jobs`, and
`stallwatch watch`: the foreground daemon (stallwatch.commands.foreground) with its view and the
job's output passed through (stallwatch.commands.live). Logging: on a terminal the daemon's log goes to
`<state_dir>/stallwatch.log`, its warnings also into the scrolling region, dimmed; elsewhere to
stderr as the daemon logs.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from stallwatch.daemon.config import Config

__all__ = ["run_foreground", "use_terminal"]


def use_terminal(fd: int = 1, environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return os.isatty(fd) and env.get("TERM", "") not in ("", "dumb")


class _FooterLog(logging.Handler):
    def __init__(self, footer: Any) -> None:
        super().__init__(logging.WARNING)
        self.footer = footer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.footer.log_line(f"stallwatch: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - logging's own error path, as logging.Handler does
            self.handleError(record)


def _logging(cfg: Config, footer: Any) -> list[logging.Handler]:
    from stallwatch.daemon.core import setup_logging

    root = logging.getLogger("stallwatch")
    if footer is None:
        setup_logging(cfg.daemon.log_level)
        return []
    cfg.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fh = logging.FileHandler(cfg.state_dir / "stallwatch.log", encoding="utf-8")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handlers = [fh, _FooterLog(footer)]
    for h in handlers:
        root.addHandler(h)
    root.setLevel(cfg.daemon.log_level.upper())
    root.propagate = False
    return handlers


def run_foreground(cfg: Config, *, terminal: bool | None = None, tee: bool | None = None,
                   start_in_dry_run: bool = False, plain_every_s: float = 30.0) -> int:
    from stallwatch.commands.foreground import ForegroundDaemon
    from stallwatch.commands.live import Footer, PlainView, Tee

    terminal = use_terminal() if terminal is None else terminal
    tee = terminal if tee is None else tee
    view: Any = Footer(1).start() if terminal else PlainView(sys.stderr, plain_every_s)
    handlers = _logging(cfg, view if terminal else None)
    tees = []
    if tee:
        write = view.output if terminal else _stdout_write
        for j in cfg.job:
            if j.supervised:
                log = j.log or (cfg.state_dir / "logs" / f"{j.name}.log")
                tees.append(Tee(log, write, reader=_reader(j)).start())
    d = ForegroundDaemon(cfg, view=view, start_in_dry_run=start_in_dry_run)
    try:
        code = d.run()
    finally:
        for t in tees:
            t.stop()  # the job's last lines, before the summary
        view.close(d.final_views)
        root = logging.getLogger("stallwatch")
        for h in handlers:
            root.removeHandler(h)
            h.close()
    return code


# What never passes from the invoker's shell to the job, even in a one-liner: the variables that
# make the job look like a systemd service or its socket activation, and stallwatch's own alert
# secrets (the job has no business with the Slack URL stallwatch alerts through).
_NEVER_PASSED = ("NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC", "LISTEN_FDS", "LISTEN_PID",
                 "LISTEN_FDNAMES", "SLACK_WEBHOOK_URL")


def with_invoker_env(cfg: Config, environ: dict[str, str] | None = None) -> Config:
    """`stallwatch run -- CMD` typed in a shell runs CMD with that shell's environment, as
    `time CMD` or `nohup CMD` would (a virtualenv, CUDA_VISIBLE_DEVICES, HF_HOME...). The daemon
    builds a job's environment from a short list instead (stallwatch.daemon.supervise: a service's
    environment holds its secrets); so does a one-liner with --user, which starts the job as
    someone else: the invoker's environment is theirs, not the job user's."""
    env = dict(os.environ if environ is None else environ)
    secrets = {name for a in cfg.alerts if (name := getattr(a, "url_env", None)) is not None}
    for k in (*_NEVER_PASSED, *secrets):
        env.pop(k, None)
    jobs = tuple(j if (not j.restartable or j.user is not None)
                 else j.model_copy(update={"env": {**env, **dict(j.env)}}) for j in cfg.job)
    return cfg.model_copy(update={"job": jobs})


def watch_foreground(cfg: Config, pid: int | None) -> int:
    """`stallwatch watch`: the pid goes into a pid_file in the state directory (admin side,
    0700), so the job is attached exactly as a `pid_file` job of the daemon is."""
    cfg.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    job = cfg.job[0]
    if pid is not None and job.pid_file is not None:
        tmp = job.pid_file.with_name(job.pid_file.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{pid}\n")
        os.replace(tmp, job.pid_file)
    return run_foreground(cfg, tee=False)


def _reader(job: Any) -> Any:
    """Who the log is passed through for: its user, when the job runs as one (a log that user
    could not read is never shown: it is not theirs)."""
    if job.user is None:
        return None
    from stallwatch.daemon.supervise import SpawnError, resolve_user

    try:
        return resolve_user(job.user, job.group)
    except SpawnError:
        return None


def _stdout_write(data: bytes) -> None:
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except (OSError, ValueError):
        pass


def state_dir_note(path: Path) -> str:
    return f"state, log and evidence in {path}"
