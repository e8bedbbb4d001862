"""From a one-liner's options to the daemon's config: `stallwatch run [OPTIONS] -- COMMAND` and
`stallwatch watch --pid PID | --match RE` build TOML text and load it with the config loader the
daemon uses (stallwatch.daemon.config.parse_config). So `--print-config` prints exactly what runs, and
`stallwatch run --config` of that text is the same daemon with the same job: a one-liner grows into
a service without a second meaning for any key.

No TOML writer exists in the standard library (tomllib only reads); the values here are strings,
numbers, booleans and lists of strings, and a JSON string literal is a valid TOML basic string
(the same escapes), so a few lines suffice.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallwatch.errors import UsageError

__all__ = ["OneLiner", "job_name", "default_state_dir", "alert_table", "to_toml"]

_LAUNCHERS = {"python", "python3", "torchrun", "uv", "accelerate", "deepspeed", "srun", "bash",
              "sh", "env", "nohup", "time"}


def job_name(command: list[str]) -> str:
    """A job name from the command: the script's name rather than the interpreter's
    (`torchrun … scripts/prepare_hidden_states.py` → prepare_hidden_states)."""
    pick = command[0] if command else "job"
    scripts = [a for a in command if re.search(r"\.(py|sh)$", a) and not a.startswith("-")]
    if "-m" in command[:-1]:
        scripts.insert(0, command[command.index("-m") + 1])
    for a in scripts or command:
        base = os.path.basename(a)
        if a.startswith("-") or "=" in a:
            continue
        if re.sub(r"[\d.]+$", "", base) in _LAUNCHERS:
            continue
        pick = a
        break
    stem = os.path.basename(pick)
    stem = re.sub(r"\.(py|sh)$", "", stem)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "job"
    if not stem[0].isalnum():
        stem = "job-" + stem
    return stem[:64]


def default_state_dir(name: str, environ: dict[str, str] | None = None) -> Path:
    """$XDG_STATE_HOME/stallwatch/run/<name> (~/.local/state/...): one per job name, so two
    one-liners never share a daemon lock, and the same name finds its history again."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "stallwatch" / "run" / name


def split_command(option: str, text: str) -> list[str]:
    """A command given as one option value, split as a shell would (never run by one)."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise UsageError(f"{option}: cannot split it: {e}") from None
    if not argv:
        raise UsageError(f"{option}: the command is missing")
    return argv


def alert_table(spec: str) -> dict[str, Any]:
    """`--alert` values: slack[=URL], webhook=URL, desktop[=USER], command=ARGV (split like a
    shell, never run by one). Without a URL, slack reads $SLACK_WEBHOOK_URL."""
    kind, _, target = spec.partition("=")
    kind = kind.strip().lower()
    if kind == "slack":
        return {"type": "slack", "url": target} if target else {"type": "slack"}
    if kind == "webhook":
        if not target:
            raise UsageError("--alert webhook=URL: the URL is missing")
        return {"type": "webhook", "url": target}
    if kind == "desktop":
        return {"type": "desktop", "user": target} if target else {"type": "desktop"}
    if kind == "command":
        return {"type": "command", "argv": split_command("--alert command=ARGV", target)}
    raise UsageError(f"--alert {spec}: expected slack[=URL], webhook=URL, desktop[=USER] or "
                     "command=ARGV")


@dataclass
class OneLiner:
    """The options of `run`/`watch`, as the config keys they mirror."""
    name: str
    state_dir: Path
    command: list[str] | None = None
    pid_file: Path | None = None
    match: str | None = None
    restart_command: list[str] | None = None  # watch: how to start the job again
    cwd: Path | None = None
    log: Path | None = None
    outputs: Path | None = None
    server: str | None = None
    progress_regex: str | None = None
    restart: str = "no"
    max_restarts: int | None = None
    startup_grace_s: float | None = None
    restart_backoff_s: float | None = None
    user: str | None = None
    group: str | None = None
    rules: list[Path] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    dry_run: bool = False
    interval_s: float | None = None

    def tables(self) -> dict[str, Any]:
        daemon: dict[str, Any] = {"state_dir": str(self.state_dir), "exit_with_jobs":
                                  self.command is not None}
        if self.interval_s is not None:
            daemon["interval_s"] = self.interval_s
        if self.dry_run:
            daemon["dry_run"] = True
        job: dict[str, Any] = {"name": self.name}
        for k in ("command", "pid_file", "match", "restart_command", "cwd", "log", "outputs",
                  "server", "progress_regex", "user", "group"):
            v = getattr(self, k)
            if v is not None:
                job[k] = [str(a) for a in v] if k.endswith("command") else str(v)
        if self.command is not None or self.restart_command is not None:
            job["restart"] = self.restart
        if self.max_restarts is not None:
            job["max_restarts"] = self.max_restarts
        for k in ("startup_grace_s", "restart_backoff_s"):
            if getattr(self, k) is not None:
                job[k] = getattr(self, k)
        if self.rules:
            job["rules"] = [str(p) for p in self.rules]
        return {"daemon": daemon, "job": [job], "alert": list(self.alerts)}


def to_toml(tables: dict[str, Any], header: str = "") -> str:
    lines = [f"# {h}" if h else "#" for h in header.splitlines()] if header else []
    if lines:
        lines.append("")
    lines.append("[daemon]")
    lines += [f"{k} = {_value(v)}" for k, v in tables["daemon"].items()]
    for name in ("job", "alert"):
        for t in tables.get(name, ()):
            lines += ["", f"[[{name}]]"]
            lines += [f"{k} = {_value(v)}" for k, v in t.items()]
    return "\n".join(lines) + "\n"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v), ensure_ascii=False)
