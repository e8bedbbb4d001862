"""A loaded config run: `stallwatch run`'s last step, from the CLI or from commands/entry.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallwatch.daemon.config import Config


def serve(cfg: Config, tee: bool | None = None) -> int:
    """Run a loaded config: in the foreground with its jobs (exit_with_jobs), or as the daemon."""
    if cfg.daemon.exit_with_jobs:
        from stallwatch.commands.runcmd import run_foreground

        return run_foreground(cfg, tee=tee, start_in_dry_run=cfg.daemon.dry_run)
    from stallwatch.daemon.core import run_daemon

    return run_daemon(cfg)
