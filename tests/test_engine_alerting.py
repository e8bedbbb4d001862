"""The alert state machine with explicit times, and the verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from stallwatch.clock import FakeClock
from stallwatch.engine import AlertState, Evaluator, RuleSet, evaluate_once, load_rules

P, F, R, I = AlertState.PENDING, AlertState.FIRING, AlertState.RESOLVED, AlertState.INACTIVE  # noqa: E741 - P F R I: the four states, short for the tables below


def rules(tmp_path: Path, *tables: str) -> RuleSet:
    path = tmp_path / "rules.toml"
    path.write_text("\n".join("[[rule]]\n" + t.strip() + "\n" for t in tables))
    return load_rules([path])


def rule(name: str, condition: str, *, extra: str = "", kind: str = "hang", priority: int = 0,
         severity: str = "warning", for_: str = "10s") -> str:
    return (f'name = "{name}"\nkind = "{kind}"\ncondition = "{condition}"\nfor = "{for_}"\n'
            f'priority = {priority}\nseverity = "{severity}"\nsummary = "{name} fired"\n{extra}')


def states(result: Any) -> dict[str, str]:
    return {a.rule + "".join(f"{{{v}}}" for v in a.labels.values()): a.state.value
            for a in result.alerts}


def moves(result: Any) -> list[tuple[str, str, str]]:
    return [(t.rule, t.from_state.value, t.to_state.value) for t in result.transitions]


def test_pending_then_firing_after_for(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("hang", "x")))
    clock = FakeClock(monotonic=100.0)
    r = ev.evaluate({"x": True}, clock.monotonic())
    assert states(r) == {"hang": "pending"} and moves(r) == [("hang", "inactive", "pending")]
    assert r.verdict.kind == "unknown"
    clock.advance(9.9)
    r = ev.evaluate({"x": True}, clock.monotonic())
    assert states(r) == {"hang": "pending"} and moves(r) == []
    clock.advance(0.1)
    r = ev.evaluate({"x": True}, clock.monotonic())
    assert states(r) == {"hang": "firing"} and moves(r) == [("hang", "pending", "firing")]
    alert = r.alerts[0]
    assert (alert.active_mono, alert.fired_mono, alert.since) == (100.0, 110.0, 110.0)
    assert r.verdict.kind == "hang" and r.verdict.summary == "hang fired"


def test_for_zero_fires_on_the_first_evaluation(tmp_path: Path) -> None:
    r = Evaluator(rules(tmp_path, rule("hang", "x", for_="0s"))).evaluate({"x": True}, 0.0)
    assert states(r) == {"hang": "firing"}
    assert moves(r) == [("hang", "inactive", "pending"), ("hang", "pending", "firing")]


def test_one_false_evaluation_restarts_the_pending_timer(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("hang", "x")))
    for t in range(6):
        ev.evaluate({"x": True}, float(t))
    r = ev.evaluate({"x": False}, 6.0)
    assert states(r) == {} and moves(r) == [("hang", "pending", "inactive")]
    ev.evaluate({"x": True}, 7.0)
    assert states(ev.evaluate({"x": True}, 16.9)) == {"hang": "pending"}
    r = ev.evaluate({"x": True}, 17.0)
    assert states(r) == {"hang": "firing"} and r.alerts[0].active_mono == 7.0


def test_resolution_retention_and_refiring(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("hang", "x")), resolved_retention_s=60)
    ev.evaluate({"x": True}, 0.0)
    ev.evaluate({"x": True}, 10.0)
    r = ev.evaluate({"x": False}, 11.0)
    assert states(r) == {"hang": "resolved"} and moves(r) == [("hang", "firing", "resolved")]
    assert (r.alerts[0].fired_mono, r.alerts[0].resolved_mono) == (10.0, 11.0)
    assert r.transitions[0].alert.state == R and r.verdict.kind == "unknown"
    assert states(ev.evaluate({"x": False}, 71.0)) == {"hang": "resolved"}  # 60 s retention
    assert states(ev.evaluate({"x": False}, 71.5)) == {}
    r = ev.evaluate({"x": True}, 80.0)  # a fresh instance, not the old one revived
    assert states(r) == {"hang": "pending"} and r.alerts[0].active_mono == 80.0


def test_refiring_within_retention_starts_a_new_pending_instance(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("hang", "x")))
    ev.evaluate({"x": True}, 0.0)
    ev.evaluate({"x": True}, 10.0)
    ev.evaluate({"x": False}, 11.0)
    r = ev.evaluate({"x": True}, 12.0)
    assert states(r) == {"hang": "pending"}
    assert moves(r) == [("hang", "inactive", "pending")] and r.alerts[0].fired_mono is None


def test_keep_firing_for_holds_then_resolves(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("io", "x", extra='keep_firing_for = "10s"')))
    ev.evaluate({"x": True}, 0.0)
    assert states(ev.evaluate({"x": True}, 10.0)) == {"io": "firing"}
    assert states(ev.evaluate({"x": False}, 20.0)) == {"io": "firing"}
    r = ev.evaluate({"x": False}, 29.9)
    assert states(r) == {"io": "firing"} and r.verdict.kind == "hang"
    r = ev.evaluate({"x": False}, 30.0)
    assert states(r) == {"io": "resolved"} and r.alerts[0].resolved_mono == 30.0


def test_keep_firing_clock_resets_when_the_condition_returns(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("io", "x", extra='keep_firing_for = "10s"')))
    ev.evaluate({"x": True}, 0.0)
    ev.evaluate({"x": True}, 10.0)
    ev.evaluate({"x": False}, 20.0)
    ev.evaluate({"x": True}, 25.0)
    ev.evaluate({"x": False}, 26.0)
    assert states(ev.evaluate({"x": False}, 35.9)) == {"io": "firing"}
    assert states(ev.evaluate({"x": False}, 36.0)) == {"io": "resolved"}


def test_keep_firing_for_does_not_hold_a_pending_alert(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("io", "x", extra='keep_firing_for = "1h"')))
    ev.evaluate({"x": True}, 0.0)
    assert states(ev.evaluate({"x": False}, 5.0)) == {}


def test_instances_are_identified_by_labels(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("io", "stuck", extra='keep_firing_for = "5s"\n'
                                                           'labels = {mount = "{mount}"}')))
    ev.evaluate({"stuck": True, "mount": "/a"}, 0.0)
    r = ev.evaluate({"stuck": True, "mount": "/a"}, 10.0)
    assert states(r) == {"io{/a}": "firing"}
    r = ev.evaluate({"stuck": True, "mount": "/b"}, 12.0)
    assert states(r) == {"io{/a}": "firing", "io{/b}": "pending"}  # /a kept by keep_firing_for
    assert moves(r) == [("io", "inactive", "pending")]
    r = ev.evaluate({"stuck": True, "mount": "/b"}, 17.0)
    assert states(r) == {"io{/a}": "resolved", "io{/b}": "pending"}
    r = ev.evaluate({"stuck": True, "mount": "/b"}, 22.0)
    assert states(r) == {"io{/a}": "resolved", "io{/b}": "firing"}
    assert r.verdict.labels == {"mount": "/b"}
    assert {t.labels["mount"]: t.to_state for t in r.transitions} == {"/b": F}


def test_a_failing_rule_is_reported_and_skipped_not_fatal(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("broken", "log.missing > 1", priority=99),
                         rule("hang", "x", priority=1)))
    r = ev.evaluate({"x": True, "log": {}}, 0.0)
    assert [(e.rule, e.where) for e in r.errors] == [("broken", "condition")]
    assert r.errors[0].error == "no such key 'missing' in `log.missing > 1`"
    assert states(r) == {"hang": "pending"}
    assert ev.evaluate({"x": True, "log": {}}, 10.0).verdict.kind == "hang"


def test_a_failing_tick_keeps_the_alert_state(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("hang", "log.idle_s > 30")))
    ev.evaluate({"log": {"idle_s": 40}}, 0.0)
    ev.evaluate({"log": {"idle_s": 50}}, 10.0)
    r = ev.evaluate({"log": {}}, 11.0)  # neither resolved nor restarted by the error
    assert states(r) == {"hang": "firing"} and moves(r) == [] and len(r.errors) == 1
    r = ev.evaluate({"log": {"idle_s": 10}}, 12.0)
    assert states(r) == {"hang": "resolved"}


def test_label_errors_skip_the_rule(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("io", "true", extra='labels = {m = "{nope}"}')))
    r = ev.evaluate({}, 0.0)
    assert states(r) == {} and [(e.rule, e.where) for e in r.errors] == [("io", "labels")]


def test_template_errors_do_not_hide_the_alert(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, 'name = "hang"\nkind = "hang"\ncondition = "true"\n'
                                   'summary = "idle {log.idle_s}s"\nadvice = ["{nope}", "ok"]'))
    r = ev.evaluate({"log": {}}, 0.0)
    assert r.verdict.kind == "hang"
    assert r.verdict.summary == "idle {?log.idle_s}s" and r.verdict.advice == ("{?nope}", "ok")
    assert [(e.where, e.error) for e in r.errors] == [
        ("summary", "no such key 'idle_s' in `log.idle_s`"),
        ("advice[0]", "undeclared reference 'nope' in `nope`")]


def test_evidence_each_when_limit_and_cause(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, (
        'name = "crash"\nkind = "crash"\ncondition = "job.exited"\n'
        'summary = "exit {job.code}"\ncause = "{job.oom ? \'oom_kill\' : \'exit\'}"\n'
        'evidence = [\n'
        '  {signal = "thread", each = "threads", when = "it.state == \'D\'", '
        'detail = "tid {it.tid} in D", limit = 2},\n'
        '  {signal = "log", detail = "never shown", when = "false"},\n'
        '  {signal = "log", detail = "{job.code}"},\n'
        ']')))
    threads = [{"tid": i, "state": "D" if i % 2 else "S"} for i in range(10)]
    r = ev.evaluate({"job": {"exited": True, "code": 137, "oom": True}, "threads": threads}, 0.0)
    assert r.verdict.cause == "oom_kill" and r.verdict.summary == "exit 137"
    assert [(e.signal, e.detail) for e in r.verdict.evidence] == [
        ("thread", "tid 1 in D"), ("thread", "tid 3 in D"), ("thread", "... and 3 more"),
        ("log", "137")]


def test_evidence_each_must_be_a_list(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, 'name = "a"\nkind = "hang"\ncondition = "true"\n'
                                   'summary = "s"\nevidence = [{signal = "t", each = "x", '
                                   'detail = "{it}"}]'))
    r = ev.evaluate({"x": 3}, 0.0)
    assert r.verdict.kind == "hang" and r.verdict.evidence == ()
    assert [(e.where, e.error) for e in r.errors] == [("evidence[0]", "expected a list, got double in `x`")]


# --------------------------------------------------------------------------- verdict

def test_verdict_highest_priority_then_severity_then_name(tmp_path: Path) -> None:
    rs = rules(tmp_path,
               rule("b_low", "true", priority=10, severity="critical", for_="0s"),
               rule("z_high", "true", priority=50, severity="info", for_="0s", kind="io_stall"),
               rule("y_high", "true", priority=50, severity="critical", for_="0s",
                    kind="server_hang"),
               rule("a_high", "true", priority=50, severity="info", for_="0s", kind="crash"))
    r = evaluate_once(rs, {})
    assert r.verdict.kind == "server_hang" and r.verdict.rule == "y_high"
    r = evaluate_once(RuleSet(tuple(x for x in rs if x.name != "y_high")), {})
    assert r.verdict.rule == "a_high"  # same priority and severity: first name


def test_warnings_never_decide_the_verdict(tmp_path: Path) -> None:
    rs = rules(tmp_path,
               rule("filling", "true", priority=100, kind="disk_full", for_="0s",
                    extra="warning = true"),
               rule("ok", "true", priority=0, kind="healthy", for_="0s"))
    r = evaluate_once(rs, {})
    assert r.verdict.kind == "healthy"
    assert [w.rule for w in r.warnings] == ["filling"]
    assert states(r) == {"filling": "firing", "ok": "firing"}


def test_nothing_firing_is_unknown(tmp_path: Path) -> None:
    r = evaluate_once(rules(tmp_path, rule("hang", "false")), {})
    assert r.verdict.kind == "unknown" and r.verdict.rule is None and r.alerts == ()


def test_evaluate_once_ignores_for_and_leaves_state_alone(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("hang", "x", for_="1h")))
    ev.evaluate({"x": True}, 0.0)
    once = ev.evaluate_once({"x": True})
    assert states(once) == {"hang": "firing"} and once.verdict.kind == "hang"
    strict = ev.evaluate_once({"x": True}, ignore_for=False)
    assert states(strict) == {"hang": "pending"} and strict.verdict.kind == "unknown"
    r = ev.evaluate({"x": True}, 1.0)
    assert states(r) == {"hang": "pending"} and r.alerts[0].active_mono == 0.0


def test_time_must_not_go_backwards(tmp_path: Path) -> None:
    ev = Evaluator(rules(tmp_path, rule("hang", "x")))
    ev.evaluate({"x": True}, 5.0)
    with pytest.raises(ValueError, match="backwards"):
        ev.evaluate({"x": True}, 4.0)


def test_evaluation_is_frozen_and_serialisable(tmp_path: Path) -> None:
    r = evaluate_once(rules(tmp_path, rule("hang", "true")), {})
    with pytest.raises(ValidationError):
        r.verdict.kind = "x"  # type: ignore[misc]
    data = r.model_dump(mode="json")
    assert data["verdict"]["kind"] == "hang" and data["alerts"][0]["state"] == "firing"
