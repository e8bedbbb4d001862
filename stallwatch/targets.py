"""What to watch: the user's description of one job, from CLI flags or a [[job]] table."""

from __future__ import annotations

from pathlib import Path

from stallwatch.model import Frozen


class Target(Frozen):
    name: str = "job"
    pids: tuple[int, ...] = ()
    match: str | None = None  # regex over the command line
    log: Path | None = None
    progress_regex: str | None = None
    outputs: Path | None = None
    server: str | None = None  # base URL of an SGLang server
