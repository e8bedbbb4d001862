"""The command sink: run a program (argv, never a shell) once per event.

The event arrives twice: as environment variables (STALLWATCH_JOB, STALLWATCH_KIND,
STALLWATCH_STATE, STALLWATCH_SUMMARY, ... see `event_env`) and as the webhook's JSON on stdin.
The program runs in its own session with the daemon's environment plus those variables plus the
config's `env`; it is killed (its whole process group) after `timeout_s`.

Exit 0 is success; exit 75 (EX_TEMPFAIL) asks for a retry, like a timeout; any other exit status
is a permanent failure of this event.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

from stallwatch import __version__
from stallwatch.alerts.events import AlertEvent

from .base import PermanentError, RetryableError, Sink, fmt_progress, title, webhook_payload
from .config import CommandConfig
from .redact import get_logger, redact

log = get_logger("stallwatch.alerts.command")

EX_TEMPFAIL = 75


def _s(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v).replace("\0", "")


def event_env(event: AlertEvent) -> dict[str, str]:
    """The STALLWATCH_* variables for one event. Absent values are empty strings."""
    p = event.progress
    env = {
        "STALLWATCH_JOB": event.job,
        "STALLWATCH_KIND": event.kind,
        "STALLWATCH_STATE": event.state,
        "STALLWATCH_SEVERITY": event.severity,
        "STALLWATCH_SUMMARY": event.summary,
        "STALLWATCH_TITLE": title(event),
        "STALLWATCH_HOST": event.host,
        "STALLWATCH_CAUSE": event.cause,
        "STALLWATCH_INCIDENT_ID": event.incident_id,
        "STALLWATCH_EPISODE": event.episode,
        "STALLWATCH_STARTED_AT": event.started_at,
        "STALLWATCH_RESOLVED_AT": event.resolved_at,
        "STALLWATCH_AT": event.at,
        "STALLWATCH_EVIDENCE": "\n".join(f"{e.signal}: {e.detail}" for e in event.evidence),
        "STALLWATCH_ADVICE": "\n".join(event.advice),
        "STALLWATCH_ACTIONS": "\n".join(event.actions),
        "STALLWATCH_PROGRESS": fmt_progress(p),
        "STALLWATCH_PROGRESS_DONE": p.done if p else None,
        "STALLWATCH_PROGRESS_TOTAL": p.total if p else None,
        "STALLWATCH_ETA_S": p.eta_s if p else None,
        "STALLWATCH_EVIDENCE_BUNDLE": event.evidence_bundle,
        "STALLWATCH_TEST": event.test,
        "STALLWATCH_RENOTIFY": event.renotify,
        "STALLWATCH_VERSION": __version__,
    }
    return {k: _s(v) for k, v in env.items()}


def _tail(data: bytes, n: int = 300) -> str:
    text = data.decode("utf-8", "replace").strip()
    if len(text) > n:
        text = "…" + text[-n:]
    return redact(text.replace("\n", " | "))


class CommandSink(Sink):
    type = "command"

    def __init__(self, config: CommandConfig) -> None:
        super().__init__(config)
        self.argv = list(config.argv)

    def describe(self) -> str:
        return "run " + redact(" ".join(self.argv))

    def deliver(self, event: AlertEvent) -> None:
        cfg = self.config
        env = {**os.environ, **event_env(event), **cfg.env}
        stdin = json.dumps(webhook_payload(event), ensure_ascii=False).encode("utf-8") + b"\n"
        prog = os.path.basename(self.argv[0])
        try:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd=cfg.cwd,
                                    start_new_session=True, close_fds=True)
        except FileNotFoundError:
            raise PermanentError(f"command: {self.argv[0]}: no such program") from None
        except PermissionError:
            raise PermanentError(f"command: {self.argv[0]}: permission denied") from None
        except OSError as e:
            raise PermanentError(f"command: {self.argv[0]}: {e.strerror or e}") from None
        try:
            out, err = proc.communicate(stdin, timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            raise RetryableError(f"command {prog} did not finish within {cfg.timeout_s:g} s (killed)") from None
        if out or err:
            log.debug("command %s (pid %d) said: %s %s", prog, proc.pid, _tail(out), _tail(err))
        if proc.returncode == 0:
            return
        if proc.returncode < 0:
            why = f"killed by signal {-proc.returncode}"
        else:
            why = f"exit status {proc.returncode}"
        detail = _tail(err) or _tail(out)
        msg = f"command {prog} failed: {why}" + (f": {detail}" if detail else "")
        if proc.returncode == EX_TEMPFAIL:
            raise RetryableError(msg)
        raise PermanentError(msg)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:  # a descendant in another session holds the pipes
            for f in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    if f:
                        f.close()
                except OSError:
                    pass
            proc.wait(timeout=2.0)
