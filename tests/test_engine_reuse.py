"""What a tick whose inputs barely moved costs the evaluator: a rule false last tick evaluated by
its conjuncts alone, an unchanged verdict handed on as the same object (issue 17, third pass)."""

from __future__ import annotations

from pathlib import Path

from stallwatch.engine import Evaluator, Vars, load_rules
from stallwatch.engine.expr import Expr

RULE = """
[[rule]]
name = "stall"
kind = "hang"
condition = "job.alive && log.idle_s > 3"
summary = "no progress for {log.idle_s} s in {job.comm}"
"""


def _evaluator(tmp_path: Path, text: str = RULE) -> Evaluator:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return Evaluator(load_rules([path]))


def test_a_rule_false_last_tick_is_evaluated_once_by_its_conjuncts(tmp_path, monkeypatch) -> None:
    ran: list[str] = []
    real = Expr.evaluate

    def counting(self, data):
        ran.append(self.source.strip())
        return real(self, data)

    monkeypatch.setattr(Expr, "evaluate", counting)
    ev = _evaluator(tmp_path)
    data = {"job": {"alive": True, "comm": "a"}, "log": {"idle_s": 0}}
    ev.evaluate(data, 0.0)
    ran.clear()
    out = ev.evaluate({**data, "log": {"idle_s": 1}}, 1.0)
    # false last tick, idle_s moved: the first conjunct (true), the second (false), no more;
    # the whole condition once more and its conjuncts again (4) before this pass
    assert ran == ["job.alive", "log.idle_s > 3"]
    assert out.alerts == () and out.errors == ()
    ran.clear()
    out = ev.evaluate({**data, "log": {"idle_s": 5}}, 2.0)
    # every conjunct true: the condition as a whole decides, and the rule fires with its text
    assert ran[:2] == ["job.alive", "log.idle_s > 3"] and ran[2] == "job.alive && log.idle_s > 3"
    assert out.verdict.kind == "hang" and out.verdict.summary == "no progress for 5 s in a"
    reference = Evaluator(ev.rules).evaluate(Vars({**data, "log": {"idle_s": 5}}), 0.0)
    assert out.verdict == reference.verdict


def test_a_conjunct_that_fails_leaves_the_whole_condition_to_decide(tmp_path) -> None:
    ev = _evaluator(tmp_path, RULE.replace("job.alive && log.idle_s > 3",
                                           "job.missing && log.idle_s > 3"))
    data = {"job": {"alive": True, "comm": "a"}, "log": {"idle_s": 0}}
    first = ev.evaluate(data, 0.0)
    second = ev.evaluate({**data, "log": {"idle_s": 1}}, 1.0)
    # `job.missing` fails: CEL may still call the condition false (`&&` absorbs an error next to
    # false) or fail it; whichever it is, the cached path says what a full evaluation says
    for got, t in ((first, 0.0), (second, 1.0)):
        full = Evaluator(ev.rules).evaluate(Vars({**data, "log": {"idle_s": t}}), 0.0)
        assert got.errors == full.errors and got.alerts == full.alerts


def test_an_unchanged_verdict_is_the_same_object_and_a_changed_one_is_new(tmp_path) -> None:
    ev = _evaluator(tmp_path)
    data = {"job": {"alive": True, "comm": "a"}, "log": {"idle_s": 5}}
    first = ev.evaluate(data, 0.0)
    again = ev.evaluate({**data, "job": {"alive": True, "comm": "a", "other": 1}}, 1.0)
    assert first.verdict.kind == "hang" and again.verdict is first.verdict
    moved = ev.evaluate({**data, "log": {"idle_s": 6}}, 2.0)
    assert moved.verdict is not first.verdict and moved.verdict.summary == "no progress for 6 s in a"
    assert ev.evaluate({**data, "log": {"idle_s": 0}}, 3.0).verdict.kind == "unknown"
