"""The command line. Every user error ends in one line on stderr and exit 3, never a traceback."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from stallwatch.commands.cli_options import (LogOpt, MatchOpt, OutputsOpt, PidOpt, RegexOpt,
                                             RulesOpt, ServerLogOpt, ServerOpt, WindowOpt)
from stallwatch.commands.cli_run import run, watch
from stallwatch.errors import UsageError, exit_with

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="A watchdog for long GPU pipelines: sees a stall, says why, acts safely.")
rules_app = typer.Typer(no_args_is_help=True, help="Validate and test rule files.")
app.add_typer(rules_app, name="rules")


def make_target(pid: list[int], match: str | None, log: Path | None, progress_regex: str | None,
                outputs: Path | None, server: str | None, name: str = "job", server_log: Path | None = None):
    from stallwatch.probes.text.progress import compile_progress_regex
    from stallwatch.probes.targets import Target

    if match is not None:
        try:
            re.compile(match)
        except re.error as e:
            raise UsageError(f"--match: not a valid regex: {e}") from e
    if progress_regex is not None:
        try:
            compile_progress_regex(progress_regex)
        except ValueError as e:
            raise UsageError(f"--progress-regex: {e}") from e
    if outputs is not None and outputs.exists() and not outputs.is_dir():
        raise UsageError(f"--outputs {outputs}: not a directory")
    if log is not None and log.exists() and log.is_dir():
        raise UsageError(f"--log {log}: is a directory, not a log file")
    if server is not None and not re.match(r"^https?://[^/\s]+", server):
        raise UsageError(f"--server {server}: expected a URL like http://127.0.0.1:30000")
    if server_log is not None and server_log.exists() and server_log.is_dir():
        raise UsageError(f"--server-log {server_log}: is a directory, not a log file")
    if any(p <= 0 for p in pid):
        raise UsageError(f"--pid: process ids are positive integers, got {min(pid)}")
    # Absolute paths: the disks probe maps them to mounts, and a trace must mean the same later.
    return Target(name=name, pids=tuple(pid), match=match, log=log and log.absolute(),
                  progress_regex=progress_regex, outputs=outputs and outputs.absolute(),
                  server=server.rstrip("/") if server else None,
                  server_log=server_log and server_log.absolute())


def target_from_config(path: Path, name: str | None):
    """The Target of one [[job]]: its pid from the pid_file, its match, or for a supervised job
    the pid the daemon's state database holds."""
    from stallwatch.daemon.config import load_config
    from stallwatch.probes.targets import Target

    cfg = load_config(path)
    jobs = [j for j in cfg.job if name is None or j.name == name]
    if not jobs:
        raise UsageError(f"{path}: no [[job]] named {name!r}" if name else f"{path}: no [[job]]")
    j = jobs[0]
    pids: tuple[int, ...] = ()
    if j.pid_file is not None:
        try:
            pids = (int(j.pid_file.read_text().split()[0]),)
        except (OSError, ValueError, IndexError) as e:
            raise UsageError(f"{j.pid_file}: no pid in the job's pid_file ({e})") from e
    elif j.command is not None:
        from stallwatch.daemon.state import StateDB

        db = StateDB.open_readonly(cfg.state_dir)
        row = db.job(j.name) or {}
        if not row.get("pid"):
            raise UsageError(f"job {j.name!r} has no running process in {cfg.state_dir} "
                             "(is `stallwatch run` supervising it?)")
        pids = (int(row["pid"]),)
    return Target(name=j.name, pids=pids, match=j.match, log=j.log, progress_regex=j.progress_regex,
                  outputs=j.outputs, server=j.server, server_log=j.server_log)


@app.command()
def snapshot(
    pid: PidOpt = [], match: MatchOpt = None, log: LogOpt = None, progress_regex: RegexOpt = None,
    outputs: OutputsOpt = None, server: ServerOpt = None, server_log: ServerLogOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON (the only format for now).")] = True,
) -> None:
    """One raw observation from every probe, no verdict."""
    from stallwatch.probes.collector import Collector

    target = make_target(pid, match, log, progress_regex, outputs, server, server_log=server_log)
    c = Collector(target, kernel_history=True)
    try:
        snap = c.tick()
    finally:
        c.close()
    sys.stdout.write(snap.model_dump_json(indent=2) + "\n")


@app.command()
def record(
    out: Annotated[Path, typer.Option("--out", help="Trace file to write (JSON Lines).")],
    pid: PidOpt = [], match: MatchOpt = None, log: LogOpt = None, progress_regex: RegexOpt = None,
    outputs: OutputsOpt = None, server: ServerOpt = None, server_log: ServerLogOpt = None,
    duration: Annotated[float | None, typer.Option(
        "--duration", help="Seconds to record; default until interrupted.")] = None,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between snapshots.")] = 1.0,
    note: Annotated[str | None, typer.Option("--note", help="Free text stored in the trace header.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", help="Record a job of this daemon config instead of flags.")] = None,
    job: Annotated[str | None, typer.Option("--job", help="With --config: which [[job]] (default: the first).")] = None,
) -> None:
    """The flight recorder: one snapshot per interval into a JSON Lines trace (.gz: compressed)."""
    from stallwatch.probes.collector import Collector
    from stallwatch.probes.trace import TraceWriter

    if interval <= 0:
        raise UsageError("--interval must be positive")
    if duration is not None and duration < 0:
        raise UsageError("--duration must not be negative")
    if config is not None:
        if pid or match or log or outputs or server or server_log:
            raise UsageError("--config names the job: give either --config or target flags, not both")
        target = target_from_config(config, job)
    else:
        target = make_target(pid, match, log, progress_regex, outputs, server, server_log=server_log)
    c = Collector(target)
    n = 0
    with TraceWriter(out, {"note": note, "interval_s": interval}) as w:
        t_end = None if duration is None else time.monotonic() + duration
        try:
            while True:
                t0 = time.monotonic()
                w.write_snapshot(c.tick())
                n += 1
                if t_end is not None and time.monotonic() >= t_end:
                    break
                time.sleep(max(0.0, interval - (time.monotonic() - t0)))
        except KeyboardInterrupt:
            pass
        finally:
            c.close()
    print(f"recorded {n} snapshots to {out}", file=sys.stderr)


@app.command()
def diagnose(
    pid: PidOpt = [], match: MatchOpt = None, log: LogOpt = None, progress_regex: RegexOpt = None,
    outputs: OutputsOpt = None, server: ServerOpt = None, window: WindowOpt = 3.0,
    server_log: ServerLogOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the diagnosis as JSON.")] = False,
    rules: RulesOpt = [],
) -> int:
    """One-shot diagnosis: the verdict, its evidence and advice. Read-only; exit code as Nagios."""
    from rich.console import Console

    from stallwatch.engine import diagnose as dg
    from stallwatch.probes.collector import Collector
    from stallwatch.probes.discover import discover
    from stallwatch.commands.render import render

    if window < 0:
        raise UsageError("--window must not be negative")
    ruleset = dg.load(rules)
    target = make_target(pid, match, log, progress_regex, outputs, server, server_log=server_log)
    if not (target.pids or target.match):
        target = discover(target)
    if target.server:  # given, or discovered
        window = max(window, 6.0)  # /server_info's timeout is itself the evidence of a stuck scheduler
    c = Collector(target, kernel_history=True)
    try:
        snap, evaluation, v = dg.observe(c, window, rules=ruleset)
    finally:
        c.close()
    doc = dg.report(snap, evaluation, v, window)
    if json_out:
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    else:
        render(doc, Console())
    return dg.exit_code(doc["verdict"]["kind"], len(doc["warnings"]))


@app.command()
def replay(
    trace: Annotated[Path, typer.Argument(help="A trace written by `stallwatch record`.")],
    rules: RulesOpt = [],
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per verdict change.")] = False,
) -> int:
    """Re-evaluate a recorded trace: the verdict timeline, with `for` and pending states as live."""
    from stallwatch.commands.replay import replay_trace, print_timeline

    timeline = replay_trace(trace, rules)
    print_timeline(timeline, json_out)
    from stallwatch.engine import diagnose as dg
    kinds = [row["kind"] for row in timeline if "kind" in row]
    return dg.exit_code(kinds[-1], 0) if kinds else 3


@rules_app.command("check")
def rules_check(paths: Annotated[list[Path], typer.Argument(
    help="Rule files or directories; default: the built-in rules.")] = []) -> int:
    """Validate rule files: every problem as file:line:column: problem."""
    from stallwatch.engine import diagnose as dg
    from stallwatch.engine import check_paths

    chosen = paths or dg.builtin_rule_paths()
    for p in chosen:
        if not Path(p).exists():
            raise UsageError(f"{p}: no such rule file or directory")
    errors = check_paths(chosen, dg.schema())
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        return 3
    n = len(dg.load(chosen).rules)
    print(f"{n} rules OK in {len(chosen)} path(s)")
    return 0


@rules_app.command("test")
def rules_test(file: Annotated[Path, typer.Argument(help="A rule-test file (TOML).")]) -> int:
    """Run timeline tests of rules, like `promtool test rules`."""
    from stallwatch.engine import diagnose as dg
    from stallwatch.engine import run_test_file

    if not file.is_file():
        raise UsageError(f"{file}: no such rule-test file")
    rep = run_test_file(file, dg.schema())
    for line in rep.lines():
        print(line)
    print(f"{rep.tests} tests, {len(rep.failures)} failed ({file})")
    if rep.errors:
        return 3
    return 0 if rep.ok else 1


alert_app = typer.Typer(no_args_is_help=True, help="Check alert delivery (Slack, webhook, desktop, command).")
app.add_typer(alert_app, name="alert")


@alert_app.command("test")
def alert_test(
    config: Annotated[Path | None, typer.Option(
        "--config", help="The daemon's config file; default $STALLWATCH_CONFIG or /etc/stallwatch.toml.")] = None,
    sink: Annotated[list[str], typer.Option("--sink", help="Only the alert sink of this name (repeatable).")] = [],
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds to wait for every sink, retries included.")] = 30.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> int:
    """Send a sample io_stall alert (marked test) through every configured sink.

    Prints one line per sink (ok, or failed: why). Exit 0 if all delivered, 2 otherwise, 3 on
    config errors.
    """
    import os

    from stallwatch.alerts import AlertDispatcher, sample_event
    from stallwatch.alerts.redact import redact

    if timeout <= 0:
        raise UsageError("--timeout must be positive")
    if config is None:
        config = Path(os.environ.get("STALLWATCH_CONFIG") or "/etc/stallwatch.toml")
        if not config.exists():
            raise UsageError(f"{config}: no such config file (pass --config FILE)")
    try:
        from stallwatch.daemon.config import load_config
    except ImportError:  # without the daemon's config module: the [[alert]] tables alone
        from stallwatch.alerts.config import load_alerts_file
        configs, state_dir = load_alerts_file(config), None
    else:
        cfg = load_config(config)
        configs, state_dir = list(cfg.alerts), str(cfg.state_dir)
    if not configs:
        raise UsageError(f"{config}: no [[alert]] tables: nothing to test")
    if sink:
        unknown = [s for s in sink if s not in {c.name for c in configs}]
        if unknown:
            raise UsageError(f"--sink {unknown[0]}: no such [[alert]] (names: "
                             f"{', '.join(c.name for c in configs)})")
        configs = [c for c in configs if c.name in sink]
    d = AlertDispatcher(configs, state_dir=state_dir, tick_interval_s=None)
    try:
        d.submit(sample_event())
        finished = d.flush(timeout)
    finally:
        d.close(timeout_s=0.5)
    results = []
    for s in d.status()["sinks"]:
        ok = s["sent"] > 0
        if ok:
            error = None
        elif not finished and (s["retrying"] or s["queued"] or not s["failed"]):
            error = (f"not delivered within {timeout:g} s"
                     + (f" (last error: {s['last_error']})" if s["last_error"] else ""))
        else:
            error = s["last_error"] or "not delivered"
        results.append({"name": s["name"], "type": s["type"], "target": s["target"], "ok": ok,
                        "error": redact(error) if error else None})
    all_ok = all(r["ok"] for r in results)
    if json_out:
        sys.stdout.write(json.dumps({"ok": all_ok, "sinks": results}, indent=2) + "\n")
    else:
        for r in results:
            verdict = "ok" if r["ok"] else f"failed: {r['error']}"
            print(f"{r['name']}: {verdict}  [{r['target']}]")
    return 0 if all_ok else 2


app.command(context_settings={"allow_interspersed_args": False})(run)
app.command()(watch)


@app.command()
def status(
    config: Annotated[Path | None, typer.Option(
        "--config", help="The daemon's config file; default $STALLWATCH_CONFIG or /etc/stallwatch.toml when it "
        "exists.")] = None,
    state_dir: Annotated[Path | None, typer.Option(
        "--state-dir", help="Read this state directory instead of the config's.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    watch_: Annotated[bool, typer.Option(
        "--watch", help="A live table, refreshed in place until Ctrl-C (as `stallwatch top`).")] = False,
    every: Annotated[float, typer.Option("--every", help="With --watch: seconds between refreshes.")] = 1.0,
) -> int:
    """Each job's current verdict, restarts and incidents, from the daemon's state database.

    Exit code as Nagios: the worst job (0 healthy/finished, 1 slow, 2 a problem); 3 when no daemon is running.
    """
    if watch_:
        if json_out:
            raise UsageError("--watch draws a table: it does not go with --json")
        return top(config=config, state_dir=state_dir, every=every)
    from stallwatch.daemon.status import exit_code, render_status, status_doc
    from stallwatch.daemon.state import StateDB

    state_dir, names = _status_source(config, state_dir)
    db = StateDB.open_readonly(state_dir)
    try:
        doc = status_doc(db, Path(state_dir), names)
    finally:
        db.close()
    if json_out:
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    else:
        from rich.console import Console

        render_status(doc, Console())
    return exit_code(doc)


def _status_source(config: Path | None, state_dir: Path | None) -> tuple[Path, list[str] | None]:
    import os

    from stallwatch.daemon.config import default_state_dir, load_config

    names = None
    if config is None and state_dir is None:
        env = os.environ.get("STALLWATCH_CONFIG")
        if env:
            config = Path(env)
        elif Path("/etc/stallwatch.toml").exists():
            config = Path("/etc/stallwatch.toml")
    if config is not None:
        try:
            cfg = load_config(config, check_permissions=False)
        except UsageError as e:
            if state_dir is None:
                raise
            print(f"stallwatch: warning: {e} (reading {state_dir} anyway)", file=sys.stderr)
        else:
            names = [j.name for j in cfg.job]
            state_dir = state_dir or cfg.state_dir
    return Path(state_dir or default_state_dir()), names


@app.command()
def top(
    config: Annotated[Path | None, typer.Option(
        "--config", help="The daemon's config file; default $STALLWATCH_CONFIG or /etc/stallwatch.toml when it "
        "exists.")] = None,
    state_dir: Annotated[Path | None, typer.Option(
        "--state-dir", help="Read this state directory instead of the config's.")] = None,
    every: Annotated[float, typer.Option("--every", help="Seconds between refreshes.")] = 1.0,
) -> int:
    """Every job of a running daemon in a live table, refreshed in place (Ctrl-C to quit)."""
    from rich.console import Console
    from rich.live import Live

    from stallwatch.daemon.status import status_doc, status_renderable
    from stallwatch.daemon.state import StateDB

    if every <= 0:
        raise UsageError("--every must be positive")
    sd, names = _status_source(config, state_dir)

    def frame():
        db = StateDB.open_readonly(sd)
        try:
            return status_renderable(status_doc(db, sd, names))
        finally:
            db.close()

    console = Console()
    try:
        with Live(frame(), console=console, auto_refresh=False, screen=False,
                  redirect_stdout=False, redirect_stderr=False) as live:
            while True:
                time.sleep(every)  # a refresh period, not a wait for an event
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return 0


@app.command()
def demo(
    fault: Annotated[str, typer.Option("--fault", help="hang, io_stall (needs root), crash or server_hang.")] = "hang",
    keep: Annotated[bool, typer.Option(
        "--keep", help="Keep the temporary directory (config, logs, state, outputs).")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Narrate on stderr; print the summary as JSON on stdout.")] = False,
    pipeline: Annotated[str, typer.Option(
        "--pipeline", help="http (an SGLang-protocol server and its client) or torchrun (SpecForge's shape: 3 ranks on "
        "CPU; hang or crash; needs torch).")] = "http",
) -> int:
    """A built-in pipeline (SGLang-protocol server + extraction client, or a torchrun job shaped
    like SpecForge's), supervised, with a fault injected: detection, alert, kill, quarantine,
    resume to completion, in about a minute.

    Exit 0 when everything happened as it should, 2 otherwise (saying what), 3 when the fault
    cannot be staged here (io_stall without root).
    """
    from stallwatch.commands.demo import FAULTS, Demo, run_demo

    if pipeline not in ("http", "torchrun"):
        raise UsageError(f"--pipeline {pipeline}: expected http or torchrun")
    if fault not in FAULTS:
        raise UsageError(f"--fault {fault}: expected one of {', '.join(FAULTS)}")
    kind = Demo
    if pipeline == "torchrun":
        from stallwatch.commands.demo_torchrun import TorchrunDemo

        kind = TorchrunDemo
    return run_demo(fault, keep=keep, json_out=json_out, kind=kind)


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps every usage/config error to one line on stderr and exit 3."""
    exit_with(lambda: _app(argv))


def _app(argv: list[str] | None) -> object:
    """The typer app, its own exits and click's usage errors mapped; the rest as exit_with() maps
    them (a UsageError has no format_message: re-raised to it)."""
    try:
        return app(args=argv, standalone_mode=False, prog_name="stallwatch")
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:  # click's UsageError/BadParameter: vendored inside typer
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            print(f"stallwatch: {e.format_message()}{hint}", file=sys.stderr)
            sys.exit(3)
        raise
