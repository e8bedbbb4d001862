"""The job row's `verdict_json`, written each tick without json.dumps of the whole doc.

A healthy job's verdict changes every tick in its summary ("making progress: 1170/...") and
its evidence's ages, so the doc is encoded each tick; json.dumps of it (the encoder made per
call, the dict and the lists walked in C) cost ~90 k instructions, most of `_persist`. Its
strings are encoded instead with the function json.dumps itself uses for them
(`encode_basestring_ascii`, ensure_ascii being its default) and put in the doc's fixed layout;
the same verdict object again costs nothing, and one with the same fields is not encoded
again. The text is the one `json.dumps(verdict_doc(v, at) + watch_warnings)` gives, byte for
byte (tests/test_state_held.py, fuzzed there).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

from stallwatch.daemon.jobstate import verdict_doc
from stallwatch.engine.alerting import Verdict


def _same(a: Verdict, b: Verdict) -> bool:
    """The fields of verdict_doc are equal (the summary first: what changes tick to tick)."""
    return (a.summary == b.summary and a.kind == b.kind and a.advice == b.advice
            and a.cause == b.cause and a.rule == b.rule and a.severity == b.severity
            and len(a.evidence) == len(b.evidence)
            and all([x.signal == y.signal and x.detail == y.detail
                     for x, y in zip(a.evidence, b.evidence, strict=True)]))


class VerdictJson:
    """One per job: the last verdict's doc as text, without its closing brace."""

    def __init__(self) -> None:
        self._verdict: Verdict | None = None  # the object last seen: the same one costs nothing
        self._head = ""
        self._warnings: list[str] = []
        self._warnings_text = ""
        self.dumps = 0  # how many times the doc was encoded (tests count them)

    def text(self, v: Verdict, at: float, watch_warnings: Sequence[str] = ()) -> str:
        last = self._verdict
        if v is not last:
            if last is None or not _same(v, last):
                self._head = _head(v)
                self.dumps += 1
            self._verdict = v
        # the usual: none, then and now (no list made)
        if (watch_warnings or self._warnings) and list(watch_warnings) != self._warnings:
            self._warnings = list(watch_warnings)
            self._warnings_text = (f', "watch_warnings": {json.dumps(self._warnings)}'
                                   if self._warnings else "")
        return f'{self._head}, "at": {_number(at)}{self._warnings_text}}}'


def _head(v: Verdict) -> str:
    """json.dumps(verdict_doc(v)) without its closing brace: jobstate.verdict_doc's keys in its
    order, json.dumps's default separators, each string as its encoder writes one (it calls this
    function for a str or a subclass of one)."""
    enc = encode_basestring_ascii
    try:
        evidence = ", ".join([f'{{"signal": {enc(e.signal)}, "detail": {enc(e.detail)}}}'
                              for e in v.evidence])
        cause, rule, severity = v.cause, v.rule, v.severity
        return (f'{{"kind": {enc(v.kind)}, "summary": {enc(v.summary)}, "evidence": [{evidence}], '
                f'"advice": [{", ".join(map(enc, v.advice))}], '
                f'"cause": {"null" if cause is None else enc(cause)}, '
                f'"rule": {"null" if rule is None else enc(rule)}, '
                f'"severity": {"null" if severity is None else enc(severity)}')
    except TypeError:  # a field that is no str (a model built unvalidated): as json.dumps has it
        return json.dumps(verdict_doc(v))[:-1]


def _number(x: Any) -> str:
    # What json.dumps writes for a finite float or an int (float.__repr__), without its encoder.
    if type(x) in (float, int) and math.isfinite(x):
        return repr(x)
    return json.dumps(x)
