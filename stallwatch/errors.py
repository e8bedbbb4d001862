"""Errors that end a command with one clear line and exit code 3 (usage or configuration)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn


class UsageError(Exception):
    """Bad input from the user: a flag, a path, a config or rule file. Exit 3, no traceback."""

    exit_code = 3


def exit_with(call: Callable[[], object]) -> NoReturn:
    """Run a command and exit with its code: a usage or config error is one line on stderr and
    exit 3, Ctrl-C exit 130. The one mapping both entry points use (commands/entry.py;
    commands/cli.py adds typer's own exits and click's usage errors)."""
    try:
        rv = call()
    except UsageError as e:
        print(f"stallwatch: {e}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
