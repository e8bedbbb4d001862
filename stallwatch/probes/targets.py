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
    # Who must be able to read the log (the job's user, config `user`/`group`, for a log on its
    # side): a log it could not read itself is refused (docs/security.md #5). None: no check.
    log_reader_uid: int | None = None
    log_reader_gids: tuple[int, ...] = ()
    server_log: Path | None = None  # the server's own log (else found from its stdout/stderr)
