"""The `command` alert sink of `stallwatch demo` (commands/demo.py): the event, JSON on stdin,
appended as one line to the file named by its argument, which the demo narrates from.

A module of its own that imports nothing of stallwatch: the daemon runs it for every alert,
with a 10 s timeout, and on a loaded host the demo's own imports (the daemon, rich, the server
launcher: ~1 s of CPU) made each run take seconds, time the loaded host does not have.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m stallwatch.commands.demo_sink FILE (the alert sink of "
              "`stallwatch demo`)", file=sys.stderr)
        return 3
    data = sys.stdin.read().strip()
    if data:
        with open(argv[0], "a", encoding="utf-8") as f:
            f.write(json.dumps(json.loads(data)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
