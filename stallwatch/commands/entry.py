"""The `stallwatch` entry point. `stallwatch run --config FILE`, the daemon as systemd starts it,
is dispatched here without the command-line framework: typer and its click would stay in the
daemon's memory for its whole life (5 MiB of RSS, issue 17's bound) to parse three words. Every
other command line, `--help` included, goes through stallwatch.commands.cli, which gives the
same command the same meaning and the same messages (tests/test_daemon_imports.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from stallwatch.errors import exit_with


def daemon_config(args: list[str]) -> Path | None:
    """The FILE of exactly `run --config FILE` (or `run --config=FILE`), else None."""
    if len(args) == 3 and args[:2] == ["run", "--config"]:
        value = args[2]
    elif len(args) == 2 and args[0] == "run" and args[1].startswith("--config="):
        value = args[1].removeprefix("--config=")
    else:
        return None
    # An empty value or one that looks like an option: the full parser says what is wrong.
    return Path(value) if value and not value.startswith("-") else None


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps every usage/config error to one line on stderr and exit 3."""
    config = daemon_config(sys.argv[1:] if argv is None else argv)
    if config is None:
        from stallwatch.commands.cli import main as cli_main

        cli_main(argv)
        return
    from stallwatch.daemon.config import load_config

    from stallwatch.commands.serve import serve

    exit_with(lambda: serve(load_config(config)))
