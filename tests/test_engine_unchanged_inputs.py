"""Rules evaluated only when what they read changed (engine/inputs.py): the same alerts,
transitions, verdicts and errors as evaluating every rule every tick, and fewer evaluations."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.engine import diagnose
from stallwatch.engine import Evaluator, RuleSet, Vars, load_rules
from stallwatch.engine.inputs import exact, paths, pick, tokens, unchanged
from stallwatch.engine.expr import compile_expr, normalise, renormalise

RULES = """
[[rule]]
name = "stall"
kind = "hang"
condition = "job.alive && log.idle_s > 3"
for = "2s"
summary = "no progress for {log.idle_s} s in {job.comm}"
labels = { pid = "{string(int(job.pid))}" }

[[rule]]
name = "dthreads"
kind = "io_stall"
priority = 5
condition = "proc.threads.exists(t, t.state == 'D')"
keep_firing_for = "1s"
summary = "{size(proc.threads.filter(t, t.state == 'D'))} in D"

[[rule.evidence]]
signal = "thread"
each = "proc.threads.filter(t, t.state == 'D')"
detail = "tid {it.tid}"

[[rule]]
name = "missing"
kind = "slow"
condition = "job.nope > 1"
summary = "never"

[[rule]]
name = "whole"
kind = "slow"
condition = "size(job) > 4 && log['idle_s'] > 5"
summary = "{log.idle_s}"
"""


# A conjunct that fails once the one before it is true: `false && error` is false, and only then
# may the evaluator skip it (inputs.conjuncts).
GUARDED = """
[[rule]]
name = "guarded"
kind = "slow"
condition = "log.idle_s > 3 && job.nope > 1 && job.alive"
summary = "never"
"""


def _rules(tmp_path: Path, extra: str = "") -> RuleSet:
    path = tmp_path / "r.toml"
    path.write_text(RULES + extra)
    return load_rules([path])


def _same(a, b) -> None:
    assert a.verdict == b.verdict
    assert a.alerts == b.alerts
    assert a.transitions == b.transitions
    assert a.errors == b.errors
    assert a.health == b.health


ticks = st.lists(st.fixed_dictionaries({
    "dt": st.sampled_from([0.5, 1.0, 2.0]),
    "alive": st.booleans(),
    "idle": st.sampled_from([0, 1, 4, 4, 6]),
    "comm": st.sampled_from(["a", "b"]),
    "pid": st.sampled_from([10, 11]),
    "d": st.lists(st.sampled_from([1, 2, 3]), max_size=2),
    "noise": st.integers(0, 3),
}), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(timeline=ticks)
def test_skipping_unchanged_rules_changes_nothing(tmp_path_factory, timeline) -> None:
    rules = _rules(tmp_path_factory.mktemp("r"), GUARDED)
    cached, full = Evaluator(rules, resolved_retention_s=5), Evaluator(rules, resolved_retention_s=5)
    t = 0.0
    for s in timeline:
        t += s["dt"]
        data = {"job": {"alive": s["alive"], "comm": s["comm"], "pid": s["pid"],
                        "noise": s["noise"]},
                "log": {"idle_s": s["idle"], "other": s["noise"]},
                "proc": {"threads": [{"tid": tid, "state": "D"} for tid in s["d"]]}}
        # A Vars is evaluated by every rule (the path before issue 17): the reference.
        _same(cached.evaluate(data, t), full.evaluate(Vars(data), t))


@settings(max_examples=100, deadline=None)
@given(timeline=ticks, proxied=st.lists(st.booleans(), min_size=40, max_size=40))
def test_memos_made_without_slices_are_compared_right_after_other_inputs(
        tmp_path_factory, timeline, proxied) -> None:
    # A condition no deeper than two levels is not sliced while renormalise says what moved
    # (its memo's cond_in is None); a tick given some other Mapping compares slices instead,
    # and must then take such a memo as changed, never as matching.
    rules = _rules(tmp_path_factory.mktemp("r"), GUARDED)
    cached, full = Evaluator(rules, resolved_retention_s=5), Evaluator(rules, resolved_retention_s=5)
    t = 0.0
    for s, proxy in zip(timeline, proxied, strict=False):
        t += s["dt"]
        data = {"job": {"alive": s["alive"], "comm": s["comm"], "pid": s["pid"],
                        "noise": s["noise"]},
                "log": {"idle_s": s["idle"], "other": s["noise"]},
                "proc": {"threads": [{"tid": tid, "state": "D"} for tid in s["d"]]}}
        given = MappingProxyType(data) if proxy else data
        _same(cached.evaluate(given, t), full.evaluate(Vars(data), t))


def test_a_rule_whose_inputs_did_not_change_is_not_evaluated_again(tmp_path, monkeypatch) -> None:
    rules = _rules(tmp_path)
    judged: list[str] = []
    judge = Evaluator._fresh  # every rule evaluated afresh goes through it

    def counting(self, rule, *args):
        judged.append(rule.name)
        return judge(self, rule, *args)

    monkeypatch.setattr(Evaluator, "_fresh", counting)
    ev = Evaluator(rules)
    data = {"job": {"alive": True, "comm": "a", "pid": 1, "noise": 0},
            "log": {"idle_s": 4, "other": 0}, "proc": {"threads": [], "n": 0}}
    first = ev.evaluate(data, 0.0)
    assert sorted(judged) == ["dthreads", "missing", "stall", "whole"]
    assert [e.rule for e in first.errors] == ["missing"]
    judged.clear()
    # Only an unread variable moved: nothing is evaluated but the failing rule (a rule that
    # failed is evaluated again, so its error and health stay true)...
    second = ev.evaluate({**data, "proc": {"threads": [], "n": 7}}, 2.5)
    assert judged == ["missing"]
    # ...and time alone still moves the timers: `for = 2s` fired without an evaluation.
    assert second.verdict.kind == "hang" and [e.rule for e in second.errors] == ["missing"]
    judged.clear()
    # `whole` reads all of `log`, but it is false for its first conjunct, `size(job) > 4`,
    # which reads `job` alone: not evaluated again while `job` stays...
    ev.evaluate({**data, "log": {"idle_s": 4, "other": 7}}, 3.0)
    assert sorted(judged) == ["missing"]
    judged.clear()
    # ...and again once that conjunct is true: then the second one is the first false one.
    wide = {**data, "job": {**data["job"], "extra": 1}}
    ev.evaluate({**wide, "log": {"idle_s": 4, "other": 8}}, 3.5)
    assert sorted(judged) == ["missing", "whole"]  # `stall` reads job.alive, not all of job
    judged.clear()
    ev.evaluate({**wide, "log": {"idle_s": 4, "other": 9}}, 4.0)
    assert sorted(judged) == ["missing", "whole"]


def test_a_value_cel_refuses_still_fails_every_rule(tmp_path) -> None:
    ev = Evaluator(_rules(tmp_path))
    ok = {"job": {"alive": True, "comm": "a", "pid": 1}, "log": {"idle_s": 0},
          "proc": {"threads": []}}
    ev.evaluate(ok, 0.0)
    bad = ev.evaluate({**ok, "unread": object()}, 1.0)
    assert [(e.rule, e.where) for e in bad.errors] == [("*", "variables")]


def test_paths_take_the_deepest_node_named_and_whole_roots_for_bound_names() -> None:
    e = compile_expr("log.idle_s > 1.0 && proc.threads.exists(log, log.x == 1) "
                     "&& size(gpu.lost) > 0 && disk.a.b == disk.a.c")
    trie = paths([e])
    assert trie == {"log": None, "proc": {"threads": None}, "gpu": {"lost": None},
                    "disk": {"a": {"b": None, "c": None}}}
    data = {"log": {"idle_s": 1, "z": 2}, "proc": {"threads": [1], "n": 3}, "disk": {"a": 5}}
    assert pick(data, trie) == {"log": {"idle_s": 1, "z": 2}, "proc": {"threads": [1]},
                                "disk": {"a": 5}}


@pytest.mark.parametrize("trace", ["healthy", "deadlock"])
def test_the_default_rules_on_recorded_ticks_agree_with_every_rule_every_tick(trace) -> None:
    """The daemon's own variables, from real captures: same outcome, fewer evaluations."""
    from stallwatch.engine.features import features
    from stallwatch.probes.snapshot import Snapshot
    from stallwatch.probes.trace import read_trace

    _, raw, _ = read_trace(Path(__file__).parent / "data" / "traces" / f"{trace}.jsonl")
    snaps = [Snapshot.model_validate({k: v for k, v in s.items() if k != "type"}) for s in raw]
    rules = diagnose.load(None)
    cached, full = Evaluator(rules), Evaluator(rules)
    kinds = set()
    for s in snaps:
        v = features(s)
        a = cached.evaluate(v, s.t_mono)
        _same(a, full.evaluate(Vars(v), s.t_mono))
        kinds.add(a.verdict.kind)
    assert kinds - {"unknown"}, kinds  # the trace does get a verdict


# ------------------------------------------------------------ what did not change (renormalise)

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.sampled_from([0.0, 1.0, 2.5]),
                  st.sampled_from(["a", "b", "é"]))
_tree = st.recursive(_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.tuples(kids), st.dictionaries(st.sampled_from("xyz"), kids,
                                                                  max_size=3)), max_leaves=8)
_vars = st.dictionaries(st.sampled_from(["job", "log", "proc", "now"]), _tree, max_size=4)


def _typed(x):
    """x with every value's type spelled out: `==` alone takes True for 1.0."""
    if isinstance(x, dict):
        return {k: _typed(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_typed(v) for v in x]
    return (type(x).__name__, x)


def _leaves(x, path=()):
    if isinstance(x, dict) and x:
        for k, v in x.items():
            yield from _leaves(v, (*path, k))
    else:
        yield path


def _tries_of(x):
    """(path, the trie naming it alone) for each leaf path of `x`."""
    for path in _leaves(x):
        if not path:
            continue
        trie: dict = {}
        node = trie
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = None
        yield path, trie


@settings(max_examples=200, deadline=None)
@given(a=_vars, b=_vars)
def test_renormalise_is_normalise_and_says_only_what_is_unchanged(a, b) -> None:
    odd: list[type] = []
    prev = normalise(a, odd)
    got, same = renormalise(b, prev, odd)
    assert not odd
    assert _typed(got) == _typed(normalise(b))
    # every path `same` says is unchanged reads the same slice in both (what the memo compares)
    for path, trie in _tries_of(b):
        if unchanged(trie, same):
            assert pick(got, trie) == pick(prev, trie), path
    # and what is unchanged is reused as it is, not copied
    for key, below in same.items():
        if below is None and isinstance(got[key], (dict, list)):
            assert got[key] is prev[key]


@settings(max_examples=200, deadline=None)
@given(a=_vars, b=_vars, handed=st.sets(st.sampled_from(["job", "log", "proc", "now"])))
def test_renormalise_takes_what_is_handed_on_as_the_same_object_as_unchanged(a, b, handed
                                                                              ) -> None:
    # features() hands on a part that did not change as last tick's object (issue 17, sixth
    # pass): with the last call's input (`raw`), such a part is not compared, and the result
    # is what comparing it gives.
    odd: list[type] = []
    prev, _ = renormalise(a, None, odd)
    b = {**b, **{k: a[k] for k in handed if k in a}}  # some parts handed on as they were
    got, same = renormalise(b, prev, odd, raw=a)
    want, want_same = renormalise(b, prev, odd)
    assert not odd
    assert _typed(got) == _typed(want)
    # what comparing says did not change, still did not; what more is said (a part handed on
    # whole, where comparing found each key below it equal) reads the same slice
    for path, trie in _tries_of(b):
        if unchanged(trie, want_same):
            assert unchanged(trie, same), path
        if unchanged(trie, same):
            assert pick(got, trie) == pick(prev, trie), path
    for k in handed:
        if k in a and type(a[k]) in (dict, list) and k in prev:
            assert same[k] is None and got[k] is prev[k]



def _prefixes(x):
    """Tries naming each path of `x`, each of its prefixes, and a key below each that is not
    there: what a rule may read of it."""
    for path, _ in _tries_of(x):
        for n in range(1, len(path) + 1):
            for p in (path[:n], (*path[:n], "absent")):
                trie: dict = {}
                node = trie
                for key in p[:-1]:
                    node = node.setdefault(key, {})
                node[p[-1]] = None
                yield p, trie


@settings(max_examples=300, deadline=None)
@given(a=_vars, b=_vars, handed=st.sets(st.sampled_from(["job", "log", "proc", "now"])))
def test_what_renormalise_says_moved_is_what_same_says_changed(a, b, handed) -> None:
    # The evaluator tests each rule's tokens against the set renormalise fills (issue 17,
    # seventh pass), not its trie against `same`: whatever `same` calls unchanged, so does the
    # set, and whatever the set calls unchanged reads the same slice as last time, for paths
    # that are there, went, came, or are not there at all.
    odd: list[type] = []
    prev, _ = renormalise(a, None, odd)
    b = {**b, **{k: a[k] for k in handed if k in a}}
    for raw in (None, a):
        moved: set = set()
        got, same = renormalise(b, prev, odd, raw=raw, moved=moved)
        assert not odd
        for path, trie in [*_prefixes(a), *_prefixes(b), (("gone",), {"gone": None})]:
            clean = tokens(trie).isdisjoint(moved)
            if unchanged(trie, same):
                assert clean, (path, moved)
            if clean:
                assert pick(got, trie) == pick(prev, trie), (path, moved)


def test_a_key_that_went_or_came_is_moved_and_one_deeper_moves_its_parent() -> None:
    odd: list[type] = []
    prev, _ = renormalise({"log": {"a": 1, "b": {"c": {"d": 1}}}, "job": 1}, None, odd)
    moved: set = set()
    renormalise({"log": {"b": {"c": {"d": 2}}, "n": 1.0}, "now": 2}, prev, odd, moved=moved)
    assert moved == {"log", ("log", "a"), ("log", "b"), ("log", "n"), "job", ("job", None),
                     "now", ("now", None)}
    assert tokens({"log": {"b": {"c": None}}}) == {("log", None), ("log", "b")}
    assert not exact({"log": {"b": {"c": None}}}) and exact({"log": {"b": None}, "job": None})


deep = st.lists(st.fixed_dictionaries({
    "dt": st.sampled_from([0.5, 1.0]),
    "idle": st.sampled_from([0, 4, 6]),
    "d": st.sampled_from([{"state": "D", "n": 1}, {"state": "S", "n": 1}, {"state": "D"}, [1],
                          None]),
    "extra": st.sampled_from([None, {"k": 1}, {"k": 2}]),
    "pid": st.sampled_from([10, 11, True]),
}), min_size=1, max_size=30)

DEEP = """
[[rule]]
name = "deep"
kind = "io_stall"
condition = "proc.main.thread.state == 'D' && log.idle_s > 3"
for = "1s"
summary = "{proc.main.thread.n} in D, pid {job.pid}"

[[rule]]
name = "has"
kind = "slow"
condition = "has(job.extra) && job.extra.k > 1"
summary = "extra {job.extra.k}"
labels = { k = "{string(job.extra.k)}" }
"""


@settings(max_examples=150, deadline=None)
@given(timeline=deep)
def test_values_that_come_go_and_change_type_below_the_top_change_nothing(tmp_path_factory,
                                                                           timeline) -> None:
    """Three levels deep, keys that appear and go, a dict that becomes a list or null: the
    evaluator that reuses what did not change agrees with every rule evaluated every tick."""
    rules = _rules(tmp_path_factory.mktemp("r"), DEEP)
    cached, full = Evaluator(rules, resolved_retention_s=5), Evaluator(rules, resolved_retention_s=5)
    t = 0.0
    for s in timeline:
        t += s["dt"]
        job = {"alive": True, "comm": "a", "pid": s["pid"], "noise": 0}
        if s["extra"] is not None:
            job["extra"] = s["extra"]
        data = {"job": job, "log": {"idle_s": s["idle"], "other": 0},
                "proc": {"threads": [], "main": {"thread": s["d"]}}}
        _same(cached.evaluate(data, t), full.evaluate(Vars(data), t))


def test_a_rule_false_last_time_gets_its_condition_reads_alone_until_it_turns_true(
        tmp_path, monkeypatch) -> None:
    import stallwatch.engine.alerting as alerting

    built: list[dict] = []
    held: dict[int, dict] = {}
    real = alerting.Vars

    class Seen(real):  # type: ignore[misc, valid-type]
        """Each context as it is when rules run on it: built, or a kept one brought up to date
        root by root (`Vars.put`): then as the last one with those roots replaced."""
        __slots__ = ()

        def __init__(self, data, **kw):
            held[id(self)] = data
            built.append(data)
            super().__init__(data, **kw)

        def put(self, name, value):
            held[id(self)] = {**held[id(self)], name: value}
            built.append(held[id(self)])
            super().put(name, value)

    monkeypatch.setattr(alerting, "Vars", Seen)
    path = tmp_path / "r.toml"
    path.write_text('[[rule]]\nname = "stall"\nkind = "hang"\n'
                    'condition = "job.alive && log.idle_s > 3"\n'
                    'summary = "no progress for {log.idle_s} s in {job.comm}"\n'
                    'labels = { pid = "{string(int(job.pid))}" }\n')
    ev = Evaluator(load_rules([path]))
    data = {"job": {"alive": True, "comm": "trainer", "pid": 7}, "log": {"idle_s": 0}}
    ev.evaluate(data, 0.0)
    # first: all it reads (but the summary's paths alone, read from the variables)
    assert built[-1]["job"] == {"alive": True, "pid": 7.0}
    ev.evaluate({**data, "log": {"idle_s": 1}}, 1.0)
    # false last time, evaluated again (idle_s moved): what its condition reads, no more
    assert built[-1] == {"job": {"alive": True}, "log": {"idle_s": 1.0}}
    built.clear()
    out = ev.evaluate({**data, "log": {"idle_s": 4}}, 2.0)
    # true now: a context with what its labels and summary read too, and they are rendered
    # (but for the summary's paths alone, read from the variables: textbatch.plain_paths)
    assert built[-1]["job"] == {"alive": True, "pid": 7.0}
    [alert] = out.alerts
    assert alert.labels == {"pid": "7"} and alert.summary == "no progress for 4 s in trainer"


def test_health_is_true_through_ok_ticks_an_error_and_back(tmp_path) -> None:
    ev = Evaluator(_rules(tmp_path))
    ok = {"job": {"alive": True, "comm": "a", "pid": 1, "nope": 0}, "log": {"idle_s": 0},
          "proc": {"threads": []}}
    seen = []
    for t, data in enumerate([ok, ok, {**ok, "job": {"alive": True, "comm": "a", "pid": 1}},
                              ok, ok]):
        out = ev.evaluate(data, float(t))
        assert out.health == ev.health()
        seen.append({h.rule: h.health.value for h in out.health}["missing"])
    assert seen == ["ok", "ok", "err", "ok", "ok"]  # `missing` reads job.nope
