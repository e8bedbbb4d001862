"""The command line. Every user error ends in one line on stderr and exit 3, never a traceback."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from stallwatch.errors import UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="A watchdog for long GPU pipelines: sees a stall, says why, acts safely.")
rules_app = typer.Typer(no_args_is_help=True, help="Validate and test rule files.")
app.add_typer(rules_app, name="rules")

PidOpt = Annotated[list[int], typer.Option("--pid", help="Process id of the job (repeatable; may have exited).")]
MatchOpt = Annotated[Optional[str], typer.Option("--match", help="Regex over command lines that finds the job.")]
LogOpt = Annotated[Optional[Path], typer.Option("--log", help="The job's progress log.")]
RegexOpt = Annotated[Optional[str], typer.Option("--progress-regex", help="Regex with named groups done and total.")]
OutputsOpt = Annotated[Optional[Path], typer.Option("--outputs", help="The job's outputs directory.")]
ServerOpt = Annotated[Optional[str], typer.Option("--server", help="Base URL of the SGLang server.")]


def make_target(pid: list[int], match: str | None, log: Path | None, progress_regex: str | None,
                outputs: Path | None, server: str | None, name: str = "job"):
    from stallwatch.progress import compile_progress_regex
    from stallwatch.targets import Target

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
    if any(p <= 0 for p in pid):
        raise UsageError(f"--pid: process ids are positive integers, got {min(pid)}")
    return Target(name=name, pids=tuple(pid), match=match, log=log, progress_regex=progress_regex,
                  outputs=outputs, server=server.rstrip("/") if server else None)


@app.command()
def snapshot(
    pid: PidOpt = [], match: MatchOpt = None, log: LogOpt = None, progress_regex: RegexOpt = None,
    outputs: OutputsOpt = None, server: ServerOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON (the only format for now).")] = True,
) -> None:
    """One raw observation from every probe, no verdict."""
    from stallwatch.collector import Collector

    target = make_target(pid, match, log, progress_regex, outputs, server)
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
    outputs: OutputsOpt = None, server: ServerOpt = None,
    duration: Annotated[Optional[float], typer.Option("--duration", help="Seconds to record; default until interrupted.")] = None,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between snapshots.")] = 1.0,
    note: Annotated[Optional[str], typer.Option("--note", help="Free text stored in the trace header.")] = None,
) -> None:
    """The flight recorder: one snapshot per interval into a JSON Lines trace."""
    from stallwatch.collector import Collector
    from stallwatch.trace import TraceWriter

    if interval <= 0:
        raise UsageError("--interval must be positive")
    if duration is not None and duration < 0:
        raise UsageError("--duration must not be negative")
    target = make_target(pid, match, log, progress_regex, outputs, server)
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


WindowOpt = Annotated[float, typer.Option("--window", help="Seconds to watch before judging.")]
RulesOpt = Annotated[list[Path], typer.Option("--rules", help="Rule file or directory instead of the built-in rules (repeatable).")]


@app.command()
def diagnose(
    pid: PidOpt = [], match: MatchOpt = None, log: LogOpt = None, progress_regex: RegexOpt = None,
    outputs: OutputsOpt = None, server: ServerOpt = None, window: WindowOpt = 3.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the diagnosis as JSON.")] = False,
    rules: RulesOpt = [],
) -> int:
    """One-shot diagnosis: the verdict, its evidence and advice. Read-only; exit code as Nagios."""
    from rich.console import Console

    from stallwatch import diagnose as dg
    from stallwatch.collector import Collector
    from stallwatch.discover import discover
    from stallwatch.render import render

    if window < 0:
        raise UsageError("--window must not be negative")
    ruleset = dg.load(rules)
    target = make_target(pid, match, log, progress_regex, outputs, server)
    if not (target.pids or target.match):
        target = discover(target)
    if server:
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
    from stallwatch.replay import replay_trace, print_timeline

    timeline = replay_trace(trace, rules)
    print_timeline(timeline, json_out)
    from stallwatch import diagnose as dg
    kinds = [row["kind"] for row in timeline if "kind" in row]
    return dg.exit_code(kinds[-1], 0) if kinds else 3


@rules_app.command("check")
def rules_check(paths: Annotated[list[Path], typer.Argument(help="Rule files or directories; default: the built-in rules.")] = []) -> int:
    """Validate rule files: every problem as file:line:column: problem."""
    from stallwatch import diagnose as dg
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
    from stallwatch import diagnose as dg
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


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps every usage/config error to one line on stderr and exit 3."""
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="stallwatch")
    except UsageError as e:
        print(f"stallwatch: {e}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:
        sys.exit(130)
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
    sys.exit(rv if isinstance(rv, int) else 0)
