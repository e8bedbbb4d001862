"""When a log line says it was written: the leading timestamp, in the forms jobs actually print.

A one-shot diagnosis has watched the job for three seconds; the log's own timestamps say how
fast it went before. Only differences between lines are used (how long between two progress
lines), so a naive local time and a UTC one are equally good, and the time zone is never
guessed: every dated form reads as if it were UTC.

Hand-written, not dateutil: its fuzzy parser finds a "date" in any run of numbers (a counter,
a loss of 0.1234) and costs ~50 µs a line; here a timestamp must sit in the line's first
`_HEAD` characters, in one of five fixed shapes, and a miss costs one regex search.
"""

from __future__ import annotations

import re
from datetime import datetime, UTC
from typing import Literal

from stallwatch.model import Frozen

Style = Literal["iso8601", "python_logging", "bracketed", "date_time", "hms", "epoch"]

# What evidence calls each style (the user recognises their log by these).
STYLE_NAMES: dict[str, str] = {
    "iso8601": "ISO 8601",
    "python_logging": "Python logging's asctime",
    "bracketed": "[YYYY-MM-DD HH:MM:SS]",
    "date_time": "YYYY-MM-DD HH:MM:SS",
    "hms": "HH:MM:SS",
    "epoch": "epoch seconds",
}

_HEAD = 64  # a timestamp leads its line; past a rank prefix, a level, a logger name at most
_DAY_S = 86400.0

_DATED = re.compile(
    r"(?P<open>\[)?(?P<date>\d{4}-\d{2}-\d{2})(?P<sep>[T ])(?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})"
    r"(?:(?P<fsep>[.,])(?P<frac>\d{1,9}))?(?P<tz>Z|[+-]\d{2}:?\d{2})?(?![\d:])"
)
# A time of day alone: zero-padded hours (strftime's %H), so a duration (`eta 0:01:23`, Python's
# timedelta) is not one. Not tqdm's `[01:02:03<...` or `[01:02:03, 4it/s]` either (its elapsed
# field): a time of day is followed by a space, `]`, `|`, a fraction (`.123`, `,123`) or the end.
_HMS = re.compile(
    r"(?<![\d:.])(?P<h>[01]\d|2[0-3]):(?P<m>[0-5]\d):(?P<s>[0-5]\d|60)"
    r"(?:[.,](?P<frac>\d{1,9}))?(?=\s|\]|\||$)"
)
# Unix time at the very start of the line (optionally in brackets): 10 digits, 2001 to 2065.
_EPOCH = re.compile(r"^\s*\[?(?P<sec>[12]\d{9})(?:\.(?P<frac>\d{1,9}))?(?![\d])")


class LineTime(Frozen):
    """A line's time: seconds on the style's own axis (epoch-like for dated forms, seconds since
    midnight for `hms`). Compare only values of one style."""

    t_s: float
    style: Style


def _frac(text: str | None) -> float:
    return float("0." + text) if text else 0.0


def line_time(line: str) -> LineTime | None:
    head = line[:_HEAD]
    m = _EPOCH.match(head)
    if m:
        return LineTime(t_s=int(m["sec"]) + _frac(m["frac"]), style="epoch")
    if head.count(":") < 2:  # both forms below need H:M:S; most lines stop here
        return None
    m = _DATED.search(head)
    if m:
        y, mo, dd = m["date"].split("-")
        try:
            d = datetime(int(y), int(mo), int(dd))  # strptime costs 5x more
        except ValueError:  # 2026-13-45: not a date
            return None
        t = (d.replace(tzinfo=UTC).timestamp() + int(m["h"]) * 3600 + int(m["m"]) * 60
             + int(m["s"]) + _frac(m["frac"]))
        if m["open"]:
            style: Style = "bracketed"
        elif m["sep"] == "T" or m["tz"]:
            style = "iso8601"
        elif m["fsep"] == "," and m["frac"] and len(m["frac"]) == 3:
            style = "python_logging"
        else:
            style = "date_time"
        return LineTime(t_s=t, style=style)
    m = _HMS.search(head)
    if m:
        return LineTime(t_s=int(m["h"]) * 3600 + int(m["m"]) * 60 + int(m["s"]) + _frac(m["frac"]),
                        style="hms")
    return None


def gap_s(earlier: LineTime, later: LineTime) -> float | None:
    """Seconds from one line to a later one; None across styles or when time runs backwards
    (a clock step, an interleaved writer). A time of day that jumps back by more than half a day
    wrapped at midnight (23:59:59 → 00:00:01 is 2 s); a whole day between two lines is unseen."""
    if earlier.style != later.style:
        return None
    d = later.t_s - earlier.t_s
    if earlier.style == "hms" and d < -_DAY_S / 2:
        d += _DAY_S
    return d if d >= 0 else None
