"""Keep secrets (Slack webhook URLs, tokens, header values) out of logs, JSON, errors and files.

Two layers:
- known values: every secret a sink resolves (a URL read from `url_env`, a credential file, a
  header value) is registered here, and any text that contains it shows `***` instead;
- patterns: things that look like secrets even when nobody registered them
  (`hooks.slack.com/services/T.../B.../xyz` → `hooks.slack.com/services/***`, `xoxb-...` tokens,
  `user:password@` in URLs, `token=`/`key=`/`sig=` query values).

`RedactingFilter` applies both to a log record's message, its arguments and its traceback text.
The alert package's loggers all carry it (`get_logger`), and so does the logger handed to
slack_sdk (which logs the webhook URL at DEBUG level).
"""

from __future__ import annotations

import logging
import re
import threading
import traceback
from collections.abc import Iterable

MASK = "***"

# (pattern, replacement). Order matters: the Slack URL before the generic query-string rule.
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(hooks\.slack(?:-gov)?\.com/(?:services|workflows|triggers|commands))/[^\s\"'<>)\]}]+",
                re.IGNORECASE), r"\1/" + MASK),
    (re.compile(r"\b(xox[abposrce]|xapp)-[A-Za-z0-9-]+"), r"\1-" + MASK),
    (re.compile(r"(://)[^/\s:@\"']+:[^/\s@\"']+@"), r"\1" + MASK + "@"),
    (re.compile(r"([?&](?:token|access_token|api_key|apikey|key|sig|signature|secret|password|auth)=)"
                r"[^&\s\"'#]+", re.IGNORECASE), r"\1" + MASK),
    (re.compile(r"(\bBearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE), r"\1" + MASK),
)

_MIN_SECRET_LEN = 6  # shorter "secrets" would mask ordinary words


class Redactor:
    """A set of known secret values plus the patterns above."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._secrets: tuple[str, ...] = ()

    def register(self, *values: str | None) -> None:
        with self._lock:
            known = set(self._secrets)
            for v in values:
                if v and len(v) >= _MIN_SECRET_LEN:
                    known.add(v)
            # longest first, so a URL is masked whole before any part of it
            self._secrets = tuple(sorted(known, key=len, reverse=True))

    def forget_all(self) -> None:
        with self._lock:
            self._secrets = ()

    def redact(self, text: str) -> str:
        if not text:
            return text
        for s in self._secrets:
            if s in text:
                text = text.replace(s, MASK)
        for pat, repl in _PATTERNS:
            text = pat.sub(repl, text)
        return text


REDACTOR = Redactor()


def register_secret(*values: str | None) -> None:
    """Remember secret values: from now on every redaction masks them."""
    REDACTOR.register(*values)


def redact(text: object) -> str:
    """`text` as a string with every known secret and secret-looking URL part masked."""
    return REDACTOR.redact(text if isinstance(text, str) else str(text))


def redact_obj(obj: object) -> object:
    """A copy of a JSON-like structure (dicts, lists, strings) with every string redacted."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact(k) if isinstance(k, str) else k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj


def describe_error(exc: BaseException) -> str:
    """One redacted line for an exception: `TypeName: message` (no traceback, no URL)."""
    msg = str(exc) or repr(exc)
    name = type(exc).__name__
    return redact(f"{name}: {msg}" if name not in msg else msg)


def redact_traceback(exc: BaseException) -> str:
    return redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


class RedactingFilter(logging.Filter):
    """Rewrites a record in place: message (with its args), exception text and stack text redacted.

    Filters on a logger apply only to records logged on that very logger, so attach it to each
    logger that may carry a secret (`get_logger` does) or to a handler.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string: keep the raw parts, redacted
            msg = f"{record.msg} {record.args}"
        record.msg = redact(msg)
        record.args = None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = redact_traceback(record.exc_info[1])
            record.exc_info = None  # handlers would format the raw traceback again
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FILTER = RedactingFilter()


def install(loggers: Iterable[logging.Logger | str]) -> None:
    for lg in loggers:
        lg = logging.getLogger(lg) if isinstance(lg, str) else lg
        if _FILTER not in lg.filters:
            lg.addFilter(_FILTER)


def get_logger(name: str) -> logging.Logger:
    """A logger with the redacting filter attached."""
    lg = logging.getLogger(name)
    install([lg])
    return lg
