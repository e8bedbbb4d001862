"""Warnings about the watch itself: what keeps a job from being judged fully, said, never silent.

Two things a job's user can cause (issue 22 #9, #12) end here:
- a rule that fails on every tick leaves the job unjudged by it: after `FAILING_TICKS` failing
  ticks in a row it is a warning (log, `status`, metrics) until it evaluates again;
- a job tree wider than the caps (`max_processes`, `max_threads` per job) or than the processes
  probe's time budget is watched in part: "too wide to watch fully", with the counts.
The warnings are plain strings: they go into the stored verdict document (`watch_warnings`, read
by `stallwatch status`), the metrics and, for the width, the verdict's evidence.
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Iterable

from stallwatch.engine.alerting import EvidenceItem, Verdict

log = logging.getLogger("stallwatch.daemon")

FAILING_TICKS = 3  # a rule failing this many ticks in a row is no longer a passing hiccup
RELOG_S = 600.0  # the same warning again in the log at most this often


def width_warning(procs: Any) -> str | None:
    """"too wide to watch fully: …" when the processes probe watched the tree in part."""
    if procs is None or not getattr(procs, "truncated", None):
        return None
    return (f"too wide to watch fully: {procs.truncated}; watched {procs.watched_processes} of "
            f"{procs.tree_processes} processes and {procs.watched_threads} threads; the rest "
            f"is counted, its exits seen, its threads not examined")


def with_width_evidence(verdict: Verdict, procs: Any) -> Verdict:
    """The verdict with the width warning as its last evidence line: alerts, the evidence bundle
    and `status` then all say that this judgement rests on part of the tree."""
    wide = width_warning(procs)
    if not wide:
        return verdict
    return verdict.model_copy(update={
        "evidence": (*verdict.evidence, EvidenceItem(signal="watch", detail=wide))})


def job_uid(cfg: Any) -> int | None:
    """The uid of the job's user, where the config names one (`user`: a name or a number)."""
    user = getattr(cfg, "user", None)
    if user is None or user == "":
        return None
    if isinstance(user, int) or str(user).isdigit():
        return int(user)
    import pwd

    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        return None


class WatchWarnings:
    """Per job: which rules have failed for FAILING_TICKS ticks in a row, and the tree's width."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._streaks: dict[tuple[str, str], int] = {}
        self._logged: dict[str, float] = {}  # warning text -> when last logged (monotonic)

    def update(self, errors: Iterable[Any], procs: Any, now: float,
               last_tick_s: float | None = None, deadline_s: float | None = None) -> list[str]:
        """This tick's warnings. `last_tick_s`: the previous tick's duration when the daemon
        spaced the job for it (daemon/core.py), else None."""
        if not errors and not self._streaks and not self._logged and not (
                procs is not None and getattr(procs, "truncated", None)) and not (
                last_tick_s is not None and deadline_s is not None and last_tick_s > deadline_s):
            return []  # the usual tick: no rule failing, none before, nothing to say (issue 17)
        failing: dict[tuple[str, str], str] = {(e.rule, e.where): e.error for e in errors}
        self._streaks = {k: self._streaks.get(k, 0) + 1 for k in failing}
        # (key, text): the texts carry counts that change every tick; the key does not.
        out = [(f"rule {rule} {where}",
                f"rule {rule} fails on every tick ({self._streaks[(rule, where)]} in a row, "
                f"{where}): {failing[(rule, where)]}; the job is not judged by it")
               for rule, where in failing if self._streaks[(rule, where)] >= FAILING_TICKS]
        wide = width_warning(procs)
        if wide:
            out.append(("wide", wide))
        if last_tick_s is not None and deadline_s is not None and last_tick_s > deadline_s:
            out.append(("deadline", f"tick over its deadline: the last took {last_tick_s:.2f} s "
                                    f"(job_tick_deadline_s = {deadline_s:g}); ticked less often, "
                                    f"after the other jobs, so that they keep their cadence"))
        self._log(out, now)
        return [text for _, text in out]

    def _log(self, warnings: list[tuple[str, str]], now: float) -> None:
        """Each warning once when it appears, again every RELOG_S while it lasts."""
        for key, text in warnings:
            last = self._logged.get(key)
            if last is None or now - last >= RELOG_S:
                self._logged[key] = now
                log.warning("job %s: %s", self.job, text)
        keys = {key for key, _ in warnings}
        self._logged = {k: t for k, t in self._logged.items() if k in keys}
