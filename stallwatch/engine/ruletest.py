"""Timeline tests of rules, like `promtool test rules`: feed variables at times, check states.

A test file names rule files (relative to itself) and holds `[[test]]` cases. Each case starts
from `base`, then walks its `[[test.input]]` steps in time order; `set` deep-merges onto the
variables carried from the previous step, `grow` makes leaves rise per second (durations such as
`log.idle_s` grow while nothing happens), `repeat`/`step_s` expand a step into many evaluations.
`[[test.expect]]` checks the latest evaluation at or before its `at_s`. See docs/rules.md.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from stallwatch.model import Frozen

from .alerting import AlertState, Evaluation, Evaluator, evaluate_once
from .duration import parse_duration
from .rulefile import KINDS, RuleLoadError, RuleSet, load_rules
from .tomlpos import Located, Positions, load_toml

__all__ = ["TestFailure", "TestReport", "deep_merge", "run_test_file"]

_TOP_KEYS = ("rule_files", "test")
_TEST_KEYS = ("name", "step_s", "once", "allow_eval_errors", "base", "input", "expect")
_INPUT_KEYS = ("at_s", "repeat", "step_s", "set", "vars", "grow", "unset")
_STATE_KEYS = ("firing", "pending", "resolved", "not_firing", "warnings")
_EXPECT_KEYS = ("at_s", "verdict", "cause", "summary") + _STATE_KEYS
_EPS = 1e-9


class TestFailure(Frozen):
    __test__ = False  # not a pytest class
    test: str
    at_s: float
    what: str
    expected: Any = None
    got: Any = None

    def __str__(self) -> str:
        return (f"test '{self.test}' at {self.at_s:g}s: {self.what}: "
                f"expected {self.expected!r}, got {self.got!r}")


class TestReport(Frozen):
    __test__ = False
    file: str
    tests: int = 0
    failures: tuple[TestFailure, ...] = ()
    errors: tuple[str, ...] = ()          # the file or its rules could not be loaded

    @property
    def ok(self) -> bool:
        return not self.failures and not self.errors

    def lines(self) -> list[str]:
        return [*self.errors, *map(str, self.failures)]


def deep_merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = deep_merge(base.get(k), v)
        return out
    return copy.deepcopy(override)


def run_test_file(path: str | Path, schema: Mapping[str, Any] | None = None) -> TestReport:
    """Run every case of one test file; `schema` is passed on to load_rules."""
    path = Path(path)
    data, pos, errors = load_toml(path, str(path))
    if data is None or pos is None:
        return TestReport(file=str(path), errors=tuple(map(str, errors)))
    check = _Checker(str(path), pos)
    check.top(data)
    rules = RuleSet()
    files = data.get("rule_files")
    if isinstance(files, list) and all(isinstance(f, str) for f in files):
        try:
            rules = load_rules([path.parent / f for f in files], schema)
        except RuleLoadError as exc:
            return TestReport(file=str(path), errors=tuple(map(str, check.errors + exc.errors)))
        tests = data.get("test", [])
        for i, test in enumerate(tests if isinstance(tests, list) else []):
            if isinstance(test, dict):
                check.rule_names(("test", i), test, rules)
    if check.errors:
        errors = sorted(check.errors, key=lambda e: (e.line, e.column))
        return TestReport(file=str(path), errors=tuple(map(str, errors)))
    failures: list[TestFailure] = []
    tests = data.get("test", [])
    for i, test in enumerate(tests):
        try:
            timeline = _timeline(test)
        except _StepError as exc:
            check.error(("test", i, "input", exc.step, "at_s"), str(exc))
            continue
        failures += _run_case(test, timeline, rules)
    if check.errors:
        return TestReport(file=str(path), errors=tuple(map(str, check.errors)))
    return TestReport(file=str(path), tests=len(tests), failures=tuple(failures))


# --------------------------------------------------------------------------- running

class _StepError(Exception):
    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


def _timeline(test: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """Expand inputs into (time, variables) evaluations; _StepError if time does not advance."""
    default_step = parse_duration(test.get("step_s", 1))
    carried = copy.deepcopy(test.get("base", {}))
    out: list[tuple[float, dict[str, Any]]] = []
    t = 0.0
    for n, step in enumerate(test["input"]):
        every = parse_duration(step.get("step_s", default_step))
        if "at_s" in step:
            at = parse_duration(step["at_s"])
            if out and at <= t:
                raise _StepError(n, f"at_s: {at:g} is not after the previous evaluation at {t:g}")
            t = at
        elif n:
            t += every
        if "vars" in step:
            carried = deep_merge(test.get("base", {}), step["vars"])
        start = deep_merge(carried, step.get("set", {}))
        for dotted in step.get("unset", []):
            _unset(start, dotted.split("."))
        for k in range(step.get("repeat", 1)):
            elapsed = k * every
            now = deep_merge(start, _scaled(step.get("grow", {}), elapsed, start))
            out.append((t + elapsed, now))
        carried = out[-1][1]
        t = out[-1][0]
    return out


def _scaled(rates: dict[str, Any], elapsed: float, start: dict[str, Any]) -> dict[str, Any]:
    """The grown leaves: start value + rate * elapsed seconds (start 0 where unset)."""
    out = {}
    for k, rate in rates.items():
        base = start.get(k) if isinstance(start, dict) else None
        if isinstance(rate, dict):
            out[k] = _scaled(rate, elapsed, base if isinstance(base, dict) else {})
        else:
            out[k] = (base if isinstance(base, (int, float)) else 0) + rate * elapsed
    return out


def _unset(d: dict[str, Any], keys: list[str]) -> None:
    """Take the dotted path out of `d`, copying each dict along it: deep_merge shares what it
    does not override with the variables of earlier evaluations, and the evaluator takes a dict
    that is the very object it was given last tick as unchanged (expr.renormalise), so a key
    popped in place would both rewrite an earlier step and go unseen by this one."""
    here: Any = d
    for k in keys[:-1]:
        below = here.get(k)
        if not isinstance(below, dict):
            return
        here[k] = below = dict(below)
        here = below
    here.pop(keys[-1], None)


def _run_case(test: dict[str, Any], timeline: list[tuple[float, dict[str, Any]]],
              rules: RuleSet) -> list[TestFailure]:
    name = test["name"]
    evaluator = Evaluator(rules)
    history: list[Evaluation] = []
    failures: list[TestFailure] = []
    reported: set[tuple[str, str, str]] = set()
    for t, variables in timeline:
        result = (evaluate_once(rules, variables) if test.get("once")
                  else evaluator.evaluate(variables, t))
        history.append(result.model_copy(update={"at": t}))
        if test.get("allow_eval_errors"):
            continue
        for e in result.errors:
            if (e.rule, e.where, e.error) not in reported:
                reported.add((e.rule, e.where, e.error))
                failures.append(TestFailure(test=name, at_s=t, what=f"rule '{e.rule}' {e.where}",
                                            expected="no evaluation error", got=e.error))
    for exp in test.get("expect", []):
        at = parse_duration(exp["at_s"])
        got = next((h for h in reversed(history) if h.at <= at + _EPS), None)
        if got is None:
            failures.append(TestFailure(test=name, at_s=at, what="evaluation",
                                        expected="an evaluation at or before this time",
                                        got=f"first evaluation at {history[0].at:g}s"))
            continue
        failures += _compare(name, at, exp, got)
    return failures


def _compare(name: str, at: float, exp: dict[str, Any], got: Evaluation) -> list[TestFailure]:
    out = []

    def fail(what: str, expected: Any, actual: Any) -> None:
        out.append(TestFailure(test=name, at_s=at, what=what, expected=expected, got=actual))

    if "verdict" in exp and exp["verdict"] != got.verdict.kind:
        fail("verdict", exp["verdict"], got.verdict.kind)
    if "cause" in exp and exp["cause"] != got.verdict.cause:
        fail("cause", exp["cause"], got.verdict.cause)
    if "summary" in exp and exp["summary"] != got.verdict.summary:
        fail("summary", exp["summary"], got.verdict.summary)
    firing = got.names(AlertState.FIRING)
    states = {"firing": firing, "pending": got.names(AlertState.PENDING),
              "resolved": got.names(AlertState.RESOLVED),
              "warnings": sorted({a.rule for a in got.warnings})}
    for key, actual in states.items():
        missing = [n for n in exp.get(key, []) if n not in actual]
        if missing:
            fail(key, sorted(exp[key]), actual)
    unexpected = [n for n in exp.get("not_firing", []) if n in firing]
    if unexpected:
        fail("not_firing", sorted(exp["not_firing"]), firing)
    return out


# --------------------------------------------------------------------------- validation

class _Checker:
    """Shape checks of a test file, each error located like the rule loader's."""

    def __init__(self, file: str, pos: Positions):
        self.file, self.pos = file, pos
        self.errors: list[Located] = []

    def error(self, path: tuple, message: str, at_key: bool = False) -> None:
        line, col = self.pos.key(path) if at_key else self.pos.value(path)
        self.errors.append(Located(file=self.file, line=line, column=col, message=message))

    def keys(self, path: tuple, t: dict, allowed: tuple[str, ...], what: str) -> None:
        for key in t:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                self.error(path + (key,), f"unknown key '{key}' in {what}{hint}", at_key=True)

    def top(self, data: dict[str, Any]) -> None:
        self.keys((), data, _TOP_KEYS, "test file")
        files = data.get("rule_files")
        if not (isinstance(files, list) and files and all(isinstance(f, str) for f in files)):
            self.error(("rule_files",), "rule_files: expected a non-empty array of paths "
                                        "relative to this file")
        tests = data.get("test", [])
        if not isinstance(tests, list) or not tests:
            self.error(("test",), "no [[test]] cases")
            return
        for i, test in enumerate(tests):
            if self.table(("test", i), test):
                self.test(("test", i), test)

    def table(self, path: tuple, value: Any) -> bool:
        if not isinstance(value, dict):
            self.error(path, f"expected a table, got {type(value).__name__}")
        return isinstance(value, dict)

    def test(self, path: tuple, t: dict[str, Any]) -> None:
        self.keys(path, t, _TEST_KEYS, "test")
        if not isinstance(t.get("name"), str):
            self.error(path + ("name",), "name: every test needs a name")
        self.duration(path, t, "step_s")
        if not isinstance(t.get("base", {}), dict):
            self.error(path + ("base",), "base: expected a table of variables")
        inputs = t.get("input")
        if not isinstance(inputs, list) or not inputs:
            self.error(path, "test has no [[test.input]] steps", at_key=True)
            inputs = []
        for n, step in enumerate(inputs):
            p = path + ("input", n)
            if not self.table(p, step):
                continue
            self.keys(p, step, _INPUT_KEYS, "input")
            if "set" in step and "vars" in step:
                self.error(p + ("vars",), "input: use either `set` (merged onto the previous "
                                          "step) or `vars` (from base), not both", at_key=True)
            self.duration(p, step, "at_s")
            self.duration(p, step, "step_s")
            repeat = step.get("repeat", 1)
            if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
                self.error(p + ("repeat",), "repeat: expected an integer >= 1")
            for key in ("set", "vars", "grow"):
                if not isinstance(step.get(key, {}), dict):
                    self.error(p + (key,), f"{key}: expected a table")
            if not _numeric_leaves(step.get("grow", {})):
                self.error(p + ("grow",), "grow: every leaf must be a number (units per second)")
            unset = step.get("unset", [])
            if not isinstance(unset, list) or not all(isinstance(u, str) for u in unset):
                self.error(p + ("unset",), "unset: expected an array of dotted paths")
        expects = t.get("expect", [])
        if not isinstance(expects, list):
            self.error(path + ("expect",), "expect: write [[test.expect]] tables")
            expects = []
        for n, exp in enumerate(expects):
            p = path + ("expect", n)
            if not self.table(p, exp):
                continue
            self.keys(p, exp, _EXPECT_KEYS, "expect")
            if "at_s" not in exp:
                self.error(p, "expect: missing at_s", at_key=True)
            self.duration(p, exp, "at_s")
            if "verdict" in exp and exp["verdict"] not in KINDS:
                self.error(p + ("verdict",), f"verdict: unknown kind {exp['verdict']!r}")
            for key in _STATE_KEYS:
                value = exp.get(key, [])
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    self.error(p + (key,), f"{key}: expected an array of rule names")

    def duration(self, path: tuple, t: dict, key: str) -> None:
        if key in t:
            try:
                parse_duration(t[key])
            except ValueError as exc:
                self.error(path + (key,), f"{key}: {exc}")

    def rule_names(self, path: tuple, t: dict[str, Any], rules: RuleSet) -> None:
        """Expectations naming no loaded rule would pass vacuously (`not_firing`): refuse them."""
        known = [r.name for r in rules]
        expects = t.get("expect", [])
        for n, exp in enumerate(expects if isinstance(expects, list) else []):
            for key in _STATE_KEYS if isinstance(exp, dict) else ():
                names = exp.get(key, [])
                for m, name in enumerate(names if isinstance(names, list) else []):
                    if isinstance(name, str) and name not in known:
                        close = difflib.get_close_matches(name, known, n=1)
                        hint = f" (did you mean '{close[0]}'?)" if close else ""
                        self.error(path + ("expect", n, key, m),
                                   f"{key}: no rule named '{name}'{hint}")


def _numeric_leaves(tree: Any) -> bool:
    if isinstance(tree, dict):
        return all(_numeric_leaves(v) for v in tree.values())
    return isinstance(tree, (int, float)) and not isinstance(tree, bool)
