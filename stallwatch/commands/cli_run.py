"""`stallwatch run` and `stallwatch watch`: the daemon from a config file, or one job supervised
(or watched) from its command line, the options standing for the config file they write
(stallwatch.commands.oneliner). Registered as commands in stallwatch.commands.cli."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from stallwatch.commands.cli_options import (AlertOpt, GraceOpt, IntervalOpt, JobName, LogOpt, MatchOpt,
                                             OutputsOpt, PrintOpt, RegexOpt, RulesOpt, ServerOpt,
                                             StateDirOpt, TeeOpt)
from stallwatch.errors import UsageError


def run(
    command: Annotated[list[str] | None, typer.Argument(
        help="The job: COMMAND [ARGS]... (after --).", show_default=False)] = None,
    config: Annotated[Path | None, typer.Option("--config", help="The daemon's config file (TOML).")] = None,
    name: JobName = None, log: LogOpt = None, outputs: OutputsOpt = None, server: ServerOpt = None,
    progress_regex: RegexOpt = None,
    restart: Annotated[str, typer.Option(
        "--restart", help="no, or on-failure: kill and resume on crash, hang, io_stall.")] = "no",
    max_restarts: Annotated[int | None, typer.Option("--max-restarts", help="Then give up (default 3).")] = None,
    alert: AlertOpt = [], state_dir: StateDirOpt = None, rules: RulesOpt = [],
    interval: IntervalOpt = None, startup_grace: GraceOpt = None, print_config: PrintOpt = False,
    tee: TeeOpt = None,
    restart_backoff: Annotated[float | None, typer.Option(
        "--restart-backoff", help="Seconds before the first restart, doubling after (default 5).")] = None,
    user: Annotated[str | None, typer.Option(
        "--user", help="Run the job as this user (root only); its log is opened as that user.")] = None,
    group: Annotated[str | None, typer.Option(
        "--group", help="With --user: the job's group (default: the user's).")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Watch and alert, but never kill, quarantine or restart anything.")] = False,
    log_level: Annotated[str | None, typer.Option(
        "--log-level", help="debug, info, warning or error (default: the config's).")] = None,
) -> int:
    """Supervise COMMAND in the foreground (stallwatch run -- CMD), or run a config's daemon.

    With a COMMAND: its output goes to a log stallwatch keeps (and on a terminal to the screen,
    under a live footer); Ctrl-C stops the job as its own Ctrl-C would; the exit status is the
    job's, or the verdict's code (2) when stallwatch gave up on it.

    With --config: SIGHUP reloads the config and rules, keeping the last good ones on error;
    SIGTERM and SIGINT stop the daemon and leave the jobs running (unless the config says
    `exit_with_jobs = true`, as --print-config writes it).
    """
    from stallwatch.daemon.config import load_config, parse_config

    if log_level is not None and log_level.lower() not in ("debug", "info", "warning", "error"):
        raise UsageError(f"--log-level {log_level}: expected debug, info, warning or error")
    if command:
        if config is not None:
            raise UsageError("give either --config FILE or a command after --, not both")
        text = _oneliner_toml(list(command), name=name, log=log, outputs=outputs, server=server,
                              progress_regex=progress_regex, restart=restart,
                              max_restarts=max_restarts, alert=alert, state_dir=state_dir,
                              rules=rules, interval=interval, startup_grace=startup_grace,
                              dry_run=dry_run, restart_backoff=restart_backoff, user=user,
                              group=group)
        if print_config:
            sys.stdout.write(text)
            return 0
        from stallwatch.commands.runcmd import with_invoker_env

        cfg = with_invoker_env(parse_config(text, "stallwatch run", base=Path.cwd()))
    else:
        if config is None:
            raise UsageError("give a command to supervise (stallwatch run -- COMMAND [ARGS]...) "
                             "or --config FILE")
        given = [f for f, v in (("--name", name), ("--log", log), ("--outputs", outputs),
                                ("--server", server), ("--progress-regex", progress_regex),
                                ("--max-restarts", max_restarts), ("--alert", alert),
                                ("--state-dir", state_dir), ("--rules", rules),
                                ("--interval", interval), ("--startup-grace", startup_grace),
                                ("--restart-backoff", restart_backoff), ("--user", user),
                                ("--group", group),
                                ("--print-config", print_config)) if v]
        if restart != "no":
            given.append("--restart")
        if given:
            raise UsageError(f"{given[0]} is a job option: with --config the file says it")
        cfg = load_config(config)
        if dry_run:
            cfg = cfg.model_copy(update={"daemon": cfg.daemon.model_copy(update={"dry_run": True})})
    if log_level is not None:
        cfg = cfg.model_copy(update={"daemon": cfg.daemon.model_copy(
            update={"log_level": log_level.lower()})})
    from stallwatch.commands.serve import serve

    return serve(cfg, tee=tee)


def _oneliner_toml(command: list[str], *, name, log, outputs, server, progress_regex, restart,
                   max_restarts, alert, state_dir, rules, interval, startup_grace, dry_run,
                   restart_backoff: float | None = None, pid_file: Path | None = None,
                   match: str | None = None, user: str | None = None,
                   group: str | None = None, restart_command: list[str] | None = None) -> str:
    """The one-liner's options as the config file they stand for (stallwatch.commands.oneliner)."""
    from stallwatch.commands.oneliner import OneLiner, alert_table, default_state_dir, job_name, to_toml

    if restart not in ("no", "on-failure"):
        raise UsageError(f"--restart {restart}: expected no or on-failure")
    if max_restarts is not None and max_restarts < 0:
        raise UsageError("--max-restarts must not be negative")
    name = name or job_name(command or ([match] if match else ["job"]))
    sd = (state_dir or default_state_dir(name)).absolute()
    ol = OneLiner(name=name, state_dir=sd, command=command or None, pid_file=pid_file,
                  match=match, restart_command=restart_command,
                  cwd=Path.cwd() if command or restart_command else None,
                  log=log and log.absolute(), outputs=outputs and outputs.absolute(),
                  server=server, progress_regex=progress_regex, restart=restart,
                  max_restarts=max_restarts, startup_grace_s=startup_grace,
                  restart_backoff_s=restart_backoff, user=user, group=group,
                  rules=[r.absolute() for r in rules], alerts=[alert_table(a) for a in alert],
                  dry_run=dry_run, interval_s=interval)
    how = "stallwatch " + ("run" if command else "watch")
    return to_toml(ol.tables(), header=f"Written by `{how} --print-config`; run it with\n"
                   "`stallwatch run --config FILE` (exit_with_jobs: in the foreground, exits with "
                   "the job).\nFor a service, set exit_with_jobs = false (docs/run.md). The "
                   "one-liner passes your shell's\nenvironment to the job; from a file the job "
                   "gets PATH, LANG, PYTHONPATH, CUDA_VISIBLE_DEVICES...\nand what `env` adds.")


def watch(
    pid: Annotated[int | None, typer.Option("--pid", help="Process id of the job.")] = None,
    match: MatchOpt = None, name: JobName = None, log: LogOpt = None, outputs: OutputsOpt = None,
    server: ServerOpt = None, progress_regex: RegexOpt = None, alert: AlertOpt = [],
    state_dir: StateDirOpt = None, rules: RulesOpt = [], interval: IntervalOpt = None,
    print_config: PrintOpt = False,
    restart_command: Annotated[str | None, typer.Option(
        "--restart-command", help="On crash, hang or io_stall: kill the watched job's tree, check --outputs, run this "
        "(split like a shell, never run by one) and supervise it from then on.")] = None,
    max_restarts: Annotated[int | None, typer.Option(
        "--max-restarts", help="With --restart-command: then give up (default 3).")] = None,
    startup_grace: GraceOpt = None,
    restart_backoff: Annotated[float | None, typer.Option(
        "--restart-backoff", help="With --restart-command: seconds before the first restart, doubling after (default "
        "5).")] = None,
) -> int:
    """Watch a job stallwatch did not start: the live view and alerts; kills only with --restart-command.

    Exits when the job has ended (0 finished, 2 crash); Ctrl-C stops watching, never the job.
    """
    from stallwatch.daemon.config import parse_config
    from stallwatch.commands.runcmd import watch_foreground

    if (pid is None) == (match is None):
        raise UsageError("give exactly one of --pid PID or --match RE")
    if pid is not None and pid <= 0:
        raise UsageError(f"--pid: process ids are positive integers, got {pid}")
    if match is not None:
        try:
            re.compile(match)
        except re.error as e:
            raise UsageError(f"--match: not a valid regex: {e}") from e
    from stallwatch.commands.oneliner import default_state_dir, split_command

    jname = name or (_comm_name(pid) if pid else None)
    sd = (state_dir or default_state_dir(jname or "watch")).absolute()
    pid_file = sd / "watch.pid" if pid is not None else None
    again = None
    if restart_command is not None:
        again = split_command("--restart-command", restart_command)
    elif max_restarts is not None or restart_backoff is not None or startup_grace is not None:
        raise UsageError("--max-restarts, --restart-backoff and --startup-grace go with "
                         "--restart-command: without it the watched job is never restarted")
    text = _oneliner_toml([], name=jname, log=log, outputs=outputs, server=server,
                          progress_regex=progress_regex,
                          restart="on-failure" if again else "no", max_restarts=max_restarts,
                          alert=alert, state_dir=sd, rules=rules, interval=interval,
                          startup_grace=startup_grace, restart_backoff=restart_backoff,
                          dry_run=False, pid_file=pid_file, match=match, restart_command=again)
    if print_config:
        sys.stdout.write(text)
        return 0
    from stallwatch.commands.runcmd import with_invoker_env

    cfg = with_invoker_env(parse_config(text, "stallwatch watch", base=Path.cwd()))
    return watch_foreground(cfg, pid)


def _comm_name(pid: int) -> str:
    from stallwatch.commands.oneliner import job_name
    from stallwatch.kernel.proc import Proc
    from stallwatch.kernel.roots import Absent, Denied

    try:
        argv = Proc(pid).argv()
    except (Absent, Denied, OSError) as e:
        raise UsageError(f"--pid {pid}: no such process") from e
    return job_name([a for a in argv if a])
