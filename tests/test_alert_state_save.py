"""AlertMemory.save skips `Evaluator.export` while nothing it reads changed (issue 17): the rows
it writes, and when, are exactly those of exporting every tick and comparing (`_moved`), with
the wall clock jittering against the monotonic one, stepping, alerts coming and going, a
reload (a new Evaluator carrying the state) and a restore."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from stallwatch.daemon import alertmemory
from stallwatch.daemon.alertmemory import AlertMemory, _moved, alerts_key
from stallwatch.engine import Evaluator, load_rules

RULES = """
[[rule]]
name = "a"
kind = "hang"
for = "3s"
condition = "x > 0.0"
summary = "a"

[[rule]]
name = "b"
kind = "slow"
condition = "y > 0.0"
summary = "b"
labels = {at = "{at}"}
"""


class _DB:
    def __init__(self, saved: str | None = None) -> None:
        self.writes: list[tuple[int, str, str]] = []
        self.saved = saved
        self.tick = 0

    def set_metas_later(self, rows: dict[str, str]) -> None:
        self.writes += [(self.tick, k, v) for k, v in rows.items() if k.startswith("alerts:")]

    def get_meta(self, key: str) -> str | None:
        return self.saved


class _Every(AlertMemory):
    """The former save: an export every tick, written when `_moved` says so."""

    def save(self, evaluator: Evaluator, now: float, now_wall: float) -> None:
        docs = evaluator.export(now, now_wall)
        if self._alerts is None or _moved(self._alerts, docs):
            self.db.set_metas_later({alerts_key(self.job): json.dumps(docs)})
            self._alerts = docs


def _run(tmp_path: Path, seed: int, cls: type[AlertMemory], saved: str | None = None
         ) -> tuple[list[tuple[int, str, str]], int]:
    p = tmp_path / "r.toml"
    p.write_text(RULES)
    rules = load_rules([p])
    rnd = random.Random(seed)
    ev = Evaluator(rules)
    db = _DB(saved)
    mem = cls("j", db)  # type: ignore[arg-type]
    if saved is not None:
        mem.restore(ev, 1_000.0, 1_010.0)
    exports = 0
    real = Evaluator.export

    def counted(self: Evaluator, now: float, now_wall: float) -> list[dict[str, Any]]:
        nonlocal exports
        exports += 1
        return real(self, now, now_wall)

    Evaluator.export = counted  # type: ignore[method-assign]
    try:
        offset, now = 1_000_000.0, 100.0
        x = y = 0.0
        at = "p"
        for tick in range(400):
            db.tick = tick
            now += rnd.choice((1.0, 1.0, 0.5, 2.0))  # ticks late and early
            offset += rnd.uniform(-0.3, 0.3)  # NTP slews the wall clock
            if rnd.random() < 0.02:
                offset += rnd.choice((-5.0, 5.0))  # and steps it
            if rnd.random() < 0.1:
                x = rnd.choice((0.0, 1.0))
            if rnd.random() < 0.05:
                y, at = rnd.choice((0.0, 1.0)), rnd.choice(("p", "q"))
            if tick == 200:  # a reload: a new evaluator takes the state over
                fresh = Evaluator(rules)
                fresh.carry_from(ev)
                ev = fresh
            ev.evaluate({"x": x, "y": y, "at": at}, now)
            mem.save(ev, now, now + offset)
    finally:
        Evaluator.export = real  # type: ignore[method-assign]
    return db.writes, exports


def test_save_writes_exactly_what_exporting_every_tick_wrote(tmp_path: Path) -> None:
    for seed in range(6):
        new, new_exports = _run(tmp_path, seed, AlertMemory)
        old, old_exports = _run(tmp_path, seed, _Every)
        assert len(old) > 10  # the timeline moves: alerts come and go, the clock steps
        assert new == old, seed
        assert old_exports == 400
        assert new_exports < 200, new_exports  # most ticks export nothing


def test_after_a_restore_the_first_save_writes_the_timers_then_they_stand(tmp_path: Path
                                                                           ) -> None:
    saved = json.dumps([{"rule": "a", "labels": {}, "state": "pending", "active_at": 1_000.0}])
    new, exports = _run(tmp_path, 7, AlertMemory, saved)
    assert new and new[0][0] == 0  # what was restored is then known to be what is written
    assert exports < 200


def test_the_slack_kept_below_the_comparison(tmp_path: Path) -> None:
    # An offset change just under the slack is skipped only with the rounding's margin to spare.
    assert alertmemory._ROUNDING_S > 0.0005 + 1e-6
    assert alertmemory.ANCHOR_SLACK_S - alertmemory._ROUNDING_S > 0.5
