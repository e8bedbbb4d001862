"""Durations as rule authors write them: 30, 2.5, "30s", "5m", "1h30m", "250ms"."""

from __future__ import annotations

import math
import re

__all__ = ["parse_duration"]

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|d|h|m|s)")


def parse_duration(value: object) -> float:
    """Seconds as a float; ValueError with a reason a rule author can act on."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected seconds or a string like \"30s\", got {type(value).__name__}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"must be a finite number of seconds >= 0, got {value}")
        return float(value)
    text = value.strip()
    pos, total, seen = 0, 0.0, []
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        seen.append(m.group(2))
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not text or pos != len(text):
        hint = " (a bare number needs no quotes: 30, or write \"30s\")" if _is_number(text) else ""
        raise ValueError(f"bad duration {value!r}: use a number of seconds or units ms, s, m, h, d "
                         f"like \"1h30m\"{hint}")
    ranks = [list(_UNITS).index(u) for u in seen]
    if ranks != sorted(set(ranks)):
        # "30s5m" is more likely a typo than a wish for 5m30s.
        raise ValueError(f"bad duration {value!r}: units must be in order d, h, m, s, ms, "
                         f"each at most once")
    return total


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
