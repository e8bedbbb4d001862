"""The job row's `verdict_json`, dumped again only when the verdict changed.

A healthy job's verdict is the same tick after tick, apart from its time (`at`), yet the
evaluator builds a new Verdict object each tick: at a 1 s cadence a json.dumps of the whole doc
is cold code and memory (docs/performance.md), so the doc without its time is kept as text,
keyed by the verdict's fields, and the time spliced in. The text is the one
`json.dumps(verdict_doc(v, at) + watch_warnings)` gives, byte for byte (tests/test_verdictjson.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from stallwatch.daemon.jobstate import verdict_doc
from stallwatch.engine.alerting import Verdict


def _key(v: Verdict) -> tuple:
    return (v.kind, v.summary, tuple((e.signal, e.detail) for e in v.evidence), v.advice,
            v.cause, v.rule, v.severity)


class VerdictJson:
    """One per job: the last verdict's doc as text, without its closing brace."""

    def __init__(self) -> None:
        self._verdict: Verdict | None = None  # the object last seen: the same one costs nothing
        self._key: tuple | None = None
        self._head = ""
        self._warnings: list[str] = []
        self._warnings_text = ""
        self.dumps = 0  # how many times the doc was dumped (tests count them)

    def text(self, v: Verdict, at: float, watch_warnings: Sequence[str] = ()) -> str:
        if v is not self._verdict:
            key = _key(v)
            if key != self._key:
                self._head = json.dumps(verdict_doc(v))[:-1]
                self._key = key
                self.dumps += 1
            self._verdict = v
        if list(watch_warnings) != self._warnings:
            self._warnings = list(watch_warnings)
            self._warnings_text = (f', "watch_warnings": {json.dumps(self._warnings)}'
                                   if self._warnings else "")
        return f'{self._head}, "at": {_number(at)}{self._warnings_text}}}'


def _number(x: Any) -> str:
    # What json.dumps writes for a finite float or an int (float.__repr__), without its encoder.
    if type(x) in (float, int) and math.isfinite(x):
        return repr(x)
    return json.dumps(x)
