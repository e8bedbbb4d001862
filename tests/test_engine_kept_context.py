"""The evaluator's CEL context kept from tick to tick (alerting.Evaluator._env): only the roots
whose slice may have changed are converted again, and rules see exactly what a context built
afresh would show them, also when roots come and go and rules read different slices."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_unchanged_inputs import _same

import stallwatch.engine.alerting as alerting
from stallwatch.engine import Evaluator, RuleSet, Vars, load_rules

RULES = """
[[rule]]
name = "ax"
kind = "slow"
condition = "a.x > 1.0"
summary = "x {a.x}, y {b.y}"

[[rule]]
name = "by"
kind = "hang"
condition = "b.y == 'on' && c.z > 0.0"
summary = "z {c.z}"

[[rule]]
name = "cwhole"
kind = "io_stall"
priority = 5
condition = "size(c) > 1 && a.w == 1.0"
summary = "c {c.z}"
"""


def _rules(tmp_path: Path) -> RuleSet:
    path = tmp_path / "r.toml"
    path.write_text(RULES)
    return load_rules([path])


part = st.one_of(st.none(), st.sampled_from([0, 1, 2]))
ticks = st.lists(st.fixed_dictionaries({
    "ax": part, "aw": part, "by": st.one_of(st.none(), st.sampled_from(["on", "off"])),
    "cz": part, "cq": part,
}), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(timeline=ticks)
def test_a_kept_context_shows_rules_what_a_fresh_one_would(tmp_path_factory, timeline) -> None:
    """Roots present or absent (a rule then fails on it), keys below them coming and going:
    the same results as every rule against every variable, tick after tick."""
    rules = _rules(tmp_path_factory.mktemp("r"))
    kept, full = Evaluator(rules), Evaluator(rules)
    for n, s in enumerate(timeline):
        data: dict = {}
        for root, keys in (("a", ("ax", "aw")), ("b", ("by",)), ("c", ("cz", "cq"))):
            if all(s[k] is None for k in keys):
                continue  # the root is absent this tick
            data[root] = {k[1]: s[k] for k in keys if s[k] is not None}
        _same(kept.evaluate(data, float(n)), full.evaluate(Vars(data), float(n)))


def test_only_roots_that_changed_are_converted_again(tmp_path, monkeypatch) -> None:
    made: list[dict] = []
    put: list[str] = []
    real = alerting.Vars

    class Seen(real):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def __init__(self, data, **kw):
            made.append(data)
            super().__init__(data, **kw)

        def put(self, name, value):
            put.append(name)
            super().put(name, value)

    monkeypatch.setattr(alerting, "Vars", Seen)
    ev = Evaluator(_rules(tmp_path))
    data = {"a": {"x": 2, "w": 0}, "b": {"y": "on"}, "c": {"z": 1, "q": 1}}
    ev.evaluate(data, 0.0)
    assert len(made) == 1 and put == []
    # `c.z` moved: `by` (true) and `cwhole` are evaluated again on the kept context, with `c`
    # new and `a` cut to what `cwhole`'s condition reads (a held slice costs every CEL run)
    ev.evaluate({**data, "c": {"z": 3, "q": 1}}, 1.0)
    assert len(made) == 1 and put == ["c", "a"]
    put.clear()
    # and again: now `c` alone is converted again, `a` and `b` are as they were
    out = ev.evaluate({**data, "c": {"z": 4, "q": 1}}, 2.0)
    assert len(made) == 1 and put == ["c"]
    assert [(a.rule, a.summary) for a in out.alerts] == [("ax", "x 2, y on"), ("by", "z 4")]
    # a root read now and gone: no variable can leave a CEL context, so it is built afresh,
    # and a rule that reads it fails on it as it always did
    put.clear()
    out = ev.evaluate({"a": data["a"], "b": data["b"]}, 3.0)
    assert len(made) == 2 and put == [] and "c" not in made[-1]
    # (`cwhole` reads `c` too, but CEL's `&&` is false by its false `a.w == 1.0` whatever `c` is)
    assert [(e.rule, e.where) for e in out.errors] == [("by", "condition")]
