"""Errors that end a command with one clear line and exit code 3 (usage or configuration)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user: a flag, a path, a config or rule file. Exit 3, no traceback."""

    exit_code = 3
