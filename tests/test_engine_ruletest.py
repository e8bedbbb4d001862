"""Timeline tests of rules (`stallwatch rules test FILE`)."""

from __future__ import annotations

from pathlib import Path

from stallwatch.engine import run_test_file
from stallwatch.engine.ruletest import _timeline, deep_merge

TESTS = Path(__file__).parent / "fixtures" / "rules" / "tests"


def test_passing_file() -> None:
    report = run_test_file(TESTS / "pass.toml")
    assert report.ok, report.lines()
    assert (report.tests, report.failures, report.errors) == (2, (), ())


def test_failing_file_reports_test_time_expected_and_got() -> None:
    report = run_test_file(TESTS / "fail.toml")
    assert not report.ok and report.tests == 2
    assert report.lines() == [
        "test 'wrong expectations' at 15s: verdict: expected 'io_stall', got 'hang'",
        "test 'wrong expectations' at 15s: firing: expected ['io_stall'], got ['hang']",
        "test 'wrong expectations' at 15s: pending: expected ['hang'], got []",
        "test 'wrong expectations' at 15s: not_firing: expected ['hang'], got ['hang']",
        "test 'missing variable' at 0s: rule 'disk_filling' condition: expected 'no evaluation "
        "error', got \"undeclared reference 'disk' in `disk.eta_full_s < 3600`\"",
    ]
    first = report.failures[0]
    assert (first.test, first.at_s, first.what, first.expected, first.got) == (
        "wrong expectations", 15.0, "verdict", "io_stall", "hang")


def test_invalid_test_file_is_located() -> None:
    f = TESTS / "bad.toml"
    assert run_test_file(f).lines() == [
        f"{f}:2:1: unknown key 'colour' in test file",
        f"{f}:8:10: repeat: expected an integer >= 1",
        f"{f}:10:8: at_s: bad duration 'soon': use a number of seconds or units ms, s, m, h, d "
        'like "1h30m"',
        f"{f}:11:8: grow: every leaf must be a number (units per second)",
        f"{f}:14:11: verdict: unknown kind 'stalled'",
        f"{f}:15:11: firing: no rule named 'hnag' (did you mean 'hang'?)",
    ]


def test_time_must_advance() -> None:
    f = TESTS / "backwards.toml"
    assert run_test_file(f).lines() == [f"{f}:9:8: at_s: 12 is not after the previous evaluation at 14"]


def test_rule_file_errors_are_the_report(tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('[[rule]]\nname = "a"\nkind = "nope"\ncondition = "x"\nsummary = "s"\n')
    (tmp_path / "t.toml").write_text('rule_files = ["r.toml", "missing.toml"]\n[[test]]\nname = "t"\n'
                                     "[[test.input]]\nat_s = 0\n")
    report = run_test_file(tmp_path / "t.toml")
    assert report.lines() == [
        f"{tmp_path}/r.toml:3:8: kind: unknown kind 'nope'; one of: healthy, slow, hang, io_stall, "
        "server_hang, server_down, crash, gpu_fault, disk_full, finished, unknown",
        f"{tmp_path}/missing.toml: no such file",
    ]


def test_unreadable_test_file(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text("rule_files = [\n")
    assert run_test_file(tmp_path / "t.toml").lines() == [
        f"{tmp_path}/t.toml:2:1: TOML syntax: Invalid value at end of file"]


def test_expectation_before_the_first_evaluation_fails(tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('[[rule]]\nname = "a"\nkind = "hang"\ncondition = "true"\nsummary = "s"\n')
    (tmp_path / "t.toml").write_text('rule_files = ["r.toml"]\n[[test]]\nname = "early"\n'
                                     "[[test.input]]\nat_s = 10\n[[test.expect]]\nat_s = 5\n"
                                     'verdict = "hang"\n')
    assert run_test_file(tmp_path / "t.toml").lines() == [
        "test 'early' at 5s: evaluation: expected 'an evaluation at or before this time', "
        "got 'first evaluation at 10s'"]


def test_timeline_expansion_set_grow_unset_vars() -> None:
    test = {
        "step_s": 2,
        "base": {"log": {"idle_s": 0.5, "line": "x"}, "proc": {"d": 0}},
        "input": [
            {"repeat": 2},
            {"set": {"proc": {"d": 1}}, "grow": {"log": {"idle_s": 1}, "new": {"v": 0.5}},
             "repeat": 3, "step_s": 5},
            {"unset": ["log.line"]},  # its own step: the test's 2 s
            {"at_s": 100, "vars": {"proc": {"d": 7}}},
        ],
    }
    got = [(t, v) for t, v in _timeline(test)]
    assert [t for t, _ in got] == [0, 2, 7, 12, 17, 19, 100]
    assert [v["log"]["idle_s"] for _, v in got] == [0.5, 0.5, 0.5, 5.5, 10.5, 10.5, 0.5]
    assert [v.get("new", {}).get("v") for _, v in got] == [None, None, 0.0, 2.5, 5.0, 5.0, None]
    assert [v["proc"]["d"] for _, v in got] == [0, 0, 1, 1, 1, 1, 7]
    assert "line" not in got[5][1]["log"] and got[6][1]["log"]["line"] == "x"  # vars: from base


def test_deep_merge_does_not_alias() -> None:
    base = {"a": {"b": 1, "c": [1]}, "d": 1}
    over = {"a": {"c": [2]}, "e": {"f": 1}}
    merged = deep_merge(base, over)
    assert merged == {"a": {"b": 1, "c": [2]}, "d": 1, "e": {"f": 1}}
    merged["e"]["f"] = 9
    merged["a"]["b"] = 9
    assert over["e"]["f"] == 1 and base["a"]["b"] == 1


def test_unset_leaves_earlier_steps_as_they_were_and_is_seen(tmp_path: Path) -> None:
    # deep_merge shares the dicts a step does not override with the step before; `unset` took
    # the key out of that shared dict in place: the earlier step lost it too, and the evaluator,
    # handed last tick's very object, took it as unchanged and kept the rule true.
    test = {"base": {"log": {"idle_s": 1, "line": "x"}}, "input": [{}, {"unset": ["log.line"]}]}
    got = _timeline(test)
    assert got[0][1]["log"] == {"idle_s": 1, "line": "x"} and got[1][1]["log"] == {"idle_s": 1}
    (tmp_path / "r.toml").write_text('[[rule]]\nname = "a"\nkind = "hang"\n'
                                     'condition = "has(log.line)"\nsummary = "s"\n')
    (tmp_path / "t.toml").write_text(
        'rule_files = ["r.toml"]\n[[test]]\nname = "gone"\nbase = { log = { line = "x" } }\n'
        '[[test.input]]\nat_s = 0\n[[test.input]]\nat_s = 1\nunset = ["log.line"]\n'
        '[[test.expect]]\nat_s = 0\nverdict = "hang"\n'
        '[[test.expect]]\nat_s = 1\nverdict = "unknown"\n')
    report = run_test_file(tmp_path / "t.toml")
    assert report.lines() == [] and report.tests == 1, report.lines()
