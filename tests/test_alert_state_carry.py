"""Alert state that outlives its Evaluator: carried across a reload by rule name and labels,
`for` timers restored after a daemon restart (bounded), one mutator with the edges as data, and
a health per rule. Explicit times; the real daemon is in tests/test_alert_state_daemon.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.engine import AlertState, Evaluator, load_rules
from stallwatch.engine.alerting import (FOR_OUTAGE_TOLERANCE_S, RuleHealth, _EDGES, _Instance)


def ruleset(tmp_path: Path, body: str, name: str = "r.toml"):
    p = tmp_path / name
    p.write_text(body)
    return load_rules([p])


def hang(cond: str = "x", for_: str = "10s", labels: str = "", kind: str = "hang") -> str:
    return (f'[[rule]]\nname = "hang"\nkind = "{kind}"\ncondition = "{cond}"\nfor = "{for_}"\n'
            f'severity = "critical"\nsummary = "hang"\n{labels}\n')


def state(ev, name: str = "hang") -> str | None:
    got = [a.state.value for a in ev.alerts if a.rule == name]
    return got[0] if got else None


def test_zero_value_is_not_evaluated_and_unknown_states_raise(tmp_path: Path) -> None:
    rs = ruleset(tmp_path, hang())
    inst = _Instance(next(iter(rs)), ())
    assert inst.state is AlertState.UNKNOWN
    with pytest.raises(ValueError):
        AlertState("stuck")
    with pytest.raises(ValueError, match="no edge unknown -> firing"):
        inst.enter(AlertState.FIRING, 1.0)  # not an edge: pending comes first
    inst.enter(AlertState.PENDING, 1.0)
    with pytest.raises(ValueError, match="no edge pending -> resolved"):
        inst.enter(AlertState.RESOLVED, 2.0)
    assert set(_EDGES) == set(AlertState)  # every state has its row


def test_pending_timer_and_firing_alert_carry_across_a_reload(tmp_path: Path) -> None:
    labels = 'labels = { gpu = "{x}" }'
    old = Evaluator(ruleset(tmp_path, hang("x != 0", "10s", labels)))
    old.evaluate({"x": 1}, 100.0)
    assert state(old.evaluate({"x": 1}, 106.0)) == "pending"
    new = Evaluator(ruleset(tmp_path, hang("x != 0", "10s", labels), "r2.toml"))
    assert new.carry_from(old) == 1
    r = new.evaluate({"x": 1}, 110.0)  # 10 s after it went pending, not 4 s after the reload
    assert state(r) == "firing" and r.alerts[0].active_mono == 100.0 and r.verdict.kind == "hang"
    newer = Evaluator(ruleset(tmp_path, hang("x != 0", "30s", labels), "r3.toml"))
    newer.carry_from(new)
    r = newer.evaluate({"x": 1}, 111.0)
    assert state(r) == "firing" and r.alerts[0].fired_mono == 110.0 and not r.transitions
    # other labels are another instance: it does not inherit the timer
    r = newer.evaluate({"x": 2}, 112.0)
    assert {a.labels["gpu"]: a.state.value for a in r.alerts} == {"1": "resolved", "2": "pending"}


def test_a_changed_rule_judges_carried_state_from_the_next_tick(tmp_path: Path) -> None:
    old = Evaluator(ruleset(tmp_path, hang("x", "10s")))
    old.evaluate({"x": True, "y": False}, 0.0)
    new = Evaluator(ruleset(tmp_path, hang("y", "5s", kind="io_stall"), "r2.toml"))
    new.carry_from(old)
    r = new.evaluate({"x": True, "y": True}, 6.0)  # the new `for` counts the time already pending
    assert state(r) == "firing" and r.verdict.kind == "io_stall"
    gone = Evaluator(ruleset(tmp_path, hang("y").replace('"hang"', '"other"', 1), "r3.toml"))
    assert gone.carry_from(new) == 0  # its rule is gone: so is its state


def _saved(tmp_path: Path, for_: str = "10s"):
    ev = Evaluator(ruleset(tmp_path, hang("x", for_)))
    ev.evaluate({"x": True}, 500.0)
    ev.evaluate({"x": True}, 504.0)
    return ev.export(504.0, 1_700_000_004.0)  # wall = mono + 1_699_999_500


def test_a_for_timer_resumes_after_a_restart_without_counting_the_outage(tmp_path: Path) -> None:
    docs = _saved(tmp_path)
    assert docs == [{"rule": "hang", "labels": {}, "state": "pending",
                     "active_at": 1_700_000_000.0}]
    ev = Evaluator(ruleset(tmp_path, hang("x")))
    # down at 1_700_000_004 (4 s pending), back 60 s later; a new boot's monotonic clock at 7
    assert ev.restore(docs, 1_700_000_004.0, 1_700_000_064.0) == 1
    r = ev.evaluate({"x": True}, 7.0)
    assert state(r) == "pending" and r.alerts[0].active_mono == 3.0 and not r.transitions
    assert state(ev.evaluate({"x": True}, 12.9)) == "pending"
    assert state(ev.evaluate({"x": True}, 13.0)) == "firing"  # 4 s before + 6 s after


def test_restore_is_bounded(tmp_path: Path) -> None:
    docs = _saved(tmp_path)
    late = Evaluator(ruleset(tmp_path, hang("x")))
    assert late.restore(docs, 1_700_000_004.0, 1_700_000_004.0 + FOR_OUTAGE_TOLERANCE_S + 1) == 0
    assert late.evaluate({"x": True}, 7.0).alerts[0].active_mono == 7.0  # starts over
    false_now = Evaluator(ruleset(tmp_path, hang("x")))
    assert false_now.restore(docs, 1_700_000_004.0, 1_700_000_010.0) == 1
    assert state(false_now.evaluate({"x": False}, 7.0)) is None  # needs fresh evidence
    once = Evaluator(ruleset(tmp_path, hang("x")))
    once.restore(docs, 1_700_000_004.0, 1_700_000_010.0)
    once.evaluate({"x": False}, 7.0)
    assert once.evaluate({"x": True}, 8.0).alerts[0].active_mono == 8.0  # only the first tick
    with pytest.raises(ValueError):
        once.restore([{**docs[0], "state": "stuck"}], 1_700_000_004.0, 1_700_000_010.0)


def test_a_firing_alert_is_restored_firing(tmp_path: Path) -> None:
    ev = Evaluator(ruleset(tmp_path, hang("x", "2s")))
    for t in (0.0, 2.0, 3.0):
        ev.evaluate({"x": True}, t)
    docs = ev.export(3.0, 1003.0)
    assert docs[0]["state"] == "firing" and docs[0]["fired_at"] == 1002.0
    back = Evaluator(ruleset(tmp_path, hang("x", "2s")))
    back.restore(docs, 1003.0, 1030.0)
    r = back.evaluate({"x": True}, 50.0)
    assert state(r) == "firing" and r.alerts[0].fired_mono == 49.0 and not r.transitions
    assert r.verdict.kind == "hang"


def test_each_rule_has_a_health_and_a_last_error(tmp_path: Path) -> None:
    ev = Evaluator(ruleset(tmp_path, hang("x")))
    assert [h.health for h in ev.health()] == [RuleHealth.UNKNOWN]
    r = ev.evaluate({"y": 1}, 0.0)
    (h,) = r.health
    assert h.health == RuleHealth.ERR and h.last_error.startswith("condition: ")
    (h,) = ev.evaluate({"x": False}, 1.0).health
    assert h.health == RuleHealth.OK and h.last_error == ""  # as Prometheus: cleared on success
