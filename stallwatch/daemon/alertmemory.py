"""A job's alert state in the state database, so that a restarted daemon resumes its `for`
timers (engine/alerting.py `Evaluator.export`/`restore`, after Prometheus' RestoreForState), and
each rule's health for `stallwatch status`.

Two meta rows per job, written only when they change (not every tick: the timers are stored as
wall-clock anchors, which do not move while an alert stays put), in the daemon's one transaction
of the tick (StateDB.held):
- `alerts:<job>`: the pending and firing instances, `{"rule", "labels", "state", "active_at",
  "fired_at"}` with wall times;
- `rules:<job>`: `[{"rule", "health", "last_error"}]`, one per rule, in rule-file order.
When the old daemon stopped observing is the job row's `verdict_at` (written every tick): the
outage is measured from there, and the timers resume from there.

A job removed from the config keeps its two rows for `PRUNE_GRACE_S` after the daemon last wrote
its job row, so that a job put back soon resumes its timers; `prune_removed` then deletes them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from typing import Any

from stallwatch.engine.alerting import FOR_OUTAGE_TOLERANCE_S, Evaluator
from stallwatch.daemon.state import StateDB

log = logging.getLogger("stallwatch.daemon")

ANCHOR_SLACK_S = 1.0  # wall anchors recomputed each tick jitter by microseconds; a step is news
_ROUNDING_S = 0.01  # what rounding anchors to 1 ms and float sums may add to an offset's change

# After this long without a daemon writing its job row, nothing of a job's saved alert state can
# be restored (`Evaluator.restore` refuses an outage over the tolerance): a removed job's rows are
# kept that long, in case it is put back, and no longer.
PRUNE_GRACE_S = FOR_OUTAGE_TOLERANCE_S
PRUNE_EVERY_S = 600.0  # how often the daemon looks for rows to prune (and at its first tick)
_PREFIXES = ("alerts", "rules")


def alerts_key(job: str) -> str:
    return f"alerts:{job}"


def rules_key(job: str) -> str:
    return f"rules:{job}"


class AlertMemory:
    """One per job: what was last written, so that an unchanged state costs no write."""

    def __init__(self, job: str, db: StateDB) -> None:
        self.job = job
        self.db = db
        self._alerts: list[dict[str, Any]] | None = None
        self._health: list[dict[str, str]] | None = None
        self._health_seen: tuple[Evaluator, int] | None = None  # and its health_changes then
        # What `_alerts` was exported from: the evaluator, its export_key() and the offset
        # between the two clocks then. While all three hold (the offset within the slack), the
        # docs `export` would give are those written, to the slack: no export is made.
        self._exported: tuple[Evaluator, tuple[Any, ...], float] | None = None

    def restore(self, evaluator: Evaluator, down_wall: float | None, now_wall: float) -> int:
        """Hand the previous daemon's timers to `evaluator`; a row that cannot be read is logged
        and ignored (timers start over), never a reason not to start."""
        raw = self.db.get_meta(alerts_key(self.job))
        if not raw or down_wall is None:
            return 0
        try:
            docs = json.loads(raw)
            kept = evaluator.restore(docs, float(down_wall), now_wall)
        except (ValueError, TypeError, KeyError) as e:
            log.warning("job %s: the saved alert state cannot be read (%s): timers start over",
                        self.job, e)
            return 0
        outage_s = max(0.0, now_wall - float(down_wall))
        log.info("job %s: %d of %d saved alert timer(s) restored after %.1f s without a daemon",
                 self.job, kept, len(docs), outage_s)
        self._alerts = docs
        return kept

    def save(self, evaluator: Evaluator, now: float, now_wall: float) -> None:
        key, offset = evaluator.export_key(), now_wall - now
        last = self._exported
        # An anchor is offset + a monotonic time, rounded to 1 ms: with the same key, one moves
        # by the offset's change (and the rounding), so below the slack `_moved` would say no.
        if not (last is not None and last[0] is evaluator and last[1] == key
                and abs(offset - last[2]) < ANCHOR_SLACK_S - _ROUNDING_S):
            docs = evaluator.export(now, now_wall)
            if (self._alerts is None or last is None or last[1] != key
                    or _moved(self._alerts, docs)):
                # (written too when what was restored, or a timer, changed within the slack:
                # then what is written is known, and what is exported next is compared with it)
                self.db.set_metas_later({alerts_key(self.job): json.dumps(docs)})
                self._alerts = docs
                self._exported = (evaluator, key, offset)
            else:  # the same timers in another evaluator (a reload): what was written stands
                self._exported = (evaluator, key, last[2])
        seen = self._health_seen
        if seen is not None and seen[0] is evaluator and seen[1] == evaluator.health_changes:
            return  # no rule's health changed since it was last compared and written
        health = [{"rule": h.rule, "health": h.health.value, "last_error": h.last_error}
                  for h in evaluator.health()]
        if health != self._health:
            self.db.set_metas_later({rules_key(self.job): json.dumps(health)})
            self._health = health
        self._health_seen = (evaluator, evaluator.health_changes)  # after the write: a failed
        # one is tried again next tick (a held one fails with the tick's transaction, and stays
        # held for the next: StateDB.held)


def _moved(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> bool:
    def ident(d: dict[str, Any]) -> tuple:
        return d["rule"], sorted(d["labels"].items()), d["state"]

    if [ident(d) for d in old] != [ident(d) for d in new]:
        return True
    for a, b in zip(old, new, strict=True):  # the same identities, checked above
        for k in ("active_at", "fired_at"):
            if (a.get(k) is None) != (b.get(k) is None):
                return True
            if a.get(k) is not None and abs(a[k] - b[k]) > ANCHOR_SLACK_S:
                return True
    return False


def prune_removed(db: StateDB, watched: Collection[str], now_wall: float,
                  grace_s: float = PRUNE_GRACE_S) -> list[str]:
    """Delete the saved alert state (`alerts:<job>`, `rules:<job>`) of every job not in `watched`
    whose job row was last written more than `grace_s` before `now_wall` (wall seconds), or that
    has no job row. Returns those jobs, sorted."""
    keys: dict[str, list[str]] = {}
    for key in db.meta():
        prefix, sep, job = key.partition(":")
        if sep and prefix in _PREFIXES and job not in watched:
            keys.setdefault(job, []).append(key)
    pruned: list[str] = []
    for job in sorted(keys):
        row = db.job(job)
        if row is not None and now_wall - float(row["updated_at"]) <= grace_s:
            continue
        db.delete_meta(*keys[job])
        pruned.append(job)
    if pruned:
        log.info("saved alert state of %d job(s) no longer in the config deleted (%s): unwatched "
                 "for over %.0f s", len(pruned), ", ".join(pruned), grace_s)
    return pruned
