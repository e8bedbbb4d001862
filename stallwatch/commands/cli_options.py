"""The options several commands share (stallwatch.commands.cli and cli_run), typed once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["PidOpt", "MatchOpt", "LogOpt", "RegexOpt", "OutputsOpt", "ServerOpt", "ServerLogOpt", "WindowOpt",
           "RulesOpt", "JobName", "StateDirOpt", "AlertOpt", "IntervalOpt", "GraceOpt", "PrintOpt", "TeeOpt"]

PidOpt = Annotated[list[int], typer.Option("--pid", help="Process id of the job (repeatable; may have exited).")]
MatchOpt = Annotated[str | None, typer.Option("--match", help="Regex over command lines that finds the job.")]
LogOpt = Annotated[Path | None, typer.Option("--log", help="The job's progress log.")]
RegexOpt = Annotated[str | None, typer.Option("--progress-regex", help="Regex with named groups done and total.")]
OutputsOpt = Annotated[Path | None, typer.Option("--outputs", help="The job's outputs directory.")]
ServerOpt = Annotated[str | None, typer.Option("--server", help="Base URL of the SGLang server.")]
ServerLogOpt = Annotated[Path | None, typer.Option(
    "--server-log", help="The SGLang server's own log (default: its stdout/stderr when a file).")]
WindowOpt = Annotated[float, typer.Option("--window", help="Seconds to watch before judging.")]
RulesOpt = Annotated[list[Path], typer.Option(
    "--rules", help="Rule file or directory instead of the built-in rules (repeatable).")]
JobName = Annotated[str | None, typer.Option("--name", help="The job's name (default: from the command).")]
StateDirOpt = Annotated[Path | None, typer.Option(
    "--state-dir", help="State, logs and evidence (default: ~/.local/state/stallwatch/run/NAME).")]
AlertOpt = Annotated[list[str], typer.Option(
    "--alert", help="slack[=URL], webhook=URL, desktop[=USER] or command=ARGV (repeatable).")]
IntervalOpt = Annotated[float | None, typer.Option("--interval", help="Seconds between ticks (default 1).")]
GraceOpt = Annotated[float | None, typer.Option(
    "--startup-grace", help="Seconds a (re)started job is not killed for a stall (default: its stall threshold).")]
PrintOpt = Annotated[bool, typer.Option(
    "--print-config", help="Print the equivalent TOML (for `stallwatch run --config`) and exit.")]
TeeOpt = Annotated[bool | None, typer.Option(
    "--tee/--no-tee", help="Pass the job's output to stdout (default: on a terminal).")]
