"""Timeline tests of the default rules: every tests/rules/*.test.toml, and the CLI around them.

Each file is run as `stallwatch rules test` runs it (with the variables' schema), and a failing
file fails here with its report lines. The files' bases are generated from tests/rules/base.toml
by tests/rules/sync_base.py; the checks below keep that base complete (every schema key the
rules read, with the schema's types) and keep every input free of typos (a misspelt key in
`set` would be a silent no-op).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stallwatch.engine.diagnose import builtin_rule_paths, load, schema
from stallwatch.engine import Rule, run_test_file

ROOT = Path(__file__).resolve().parent.parent
RULE_TESTS = ROOT / "tests" / "rules"
FILES = sorted(RULE_TESTS.glob("*.test.toml"))


def _sync_base():
    spec = importlib.util.spec_from_file_location("sync_base", RULE_TESTS / "sync_base.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sync_base = _sync_base()


def _tests(path: Path) -> list[dict[str, Any]]:
    return tomllib.loads(path.read_text())["test"]


def test_there_are_rule_test_files() -> None:
    assert {f.name for f in FILES} >= {"faults.test.toml", "stalls.test.toml", "progress.test.toml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_rule_timelines(path: Path) -> None:
    report = run_test_file(path, schema())
    assert report.ok, "\n".join(report.lines())
    assert report.tests == len(_tests(path)) > 0


# ------------------------------------------------------------------------------ the bases

def test_base_toml_matches_the_schema() -> None:
    assert sync_base.schema_problems(sync_base.load_base(), schema()) == []


def test_every_base_block_is_in_sync_with_base_toml() -> None:
    """Edit tests/rules/base.toml, then run `.venv/bin/python tests/rules/sync_base.py`."""
    assert [f.name for f in sync_base.stale_files(write=False)] == []
    for path in FILES:
        for test in _tests(path):
            assert test.get("base") == sync_base.load_base(), (path.name, test["name"])


def _paths(rule: Rule) -> Iterator[tuple[str, ...]]:
    """Every variable path a rule reads (its condition, texts and evidence), `it` excluded."""
    exprs = [rule.condition, *rule.summary.exprs]
    for tpl in (*rule.advice, *(t for _, t in rule.labels), *([rule.cause] if rule.cause else [])):
        exprs += tpl.exprs
    for ev in rule.evidence:
        exprs += [*ev.detail.exprs, *([ev.each] if ev.each else []), *([ev.when] if ev.when else [])]
    for expr in exprs:
        for ref in expr.references:
            if ref.path[0] not in expr.bound and ref.path[0] != "it":
                yield ref.path


def _has(variables: Any, path: tuple[str, ...]) -> bool:
    node = variables
    for key in path:
        if not isinstance(node, dict):
            return True  # a leaf or a list: CEL indexes into it from here, not a key of ours
        if key not in node:
            return False
        node = node[key]
    return True


def test_each_base_covers_every_variable_the_rules_read() -> None:
    read = sorted({p for rule in load() for p in _paths(rule)})
    assert len(read) > 100  # the default rules read much of the schema
    assert [".".join(p) for p in read if not _has(schema(), p)] == []
    for path in FILES:
        for test in _tests(path):
            missing = [".".join(p) for p in read if not _has(test["base"], p)]
            assert missing == [], (path.name, test["name"])


def _leaf_paths(tree: Any, at: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            yield from _leaf_paths(v, at + (k,))
    else:
        yield at


def _in_schema(path: tuple[str, ...]) -> bool:
    node: Any = schema()
    for key in path:
        if isinstance(node, dict) and not node:
            return True  # an open map (proc.states, probes)
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_inputs_name_only_variables_of_the_schema() -> None:
    """A typo in `set`, `vars`, `grow` or `unset` would silently test nothing."""
    bad = []
    for path in FILES:
        for test in _tests(path):
            for n, step in enumerate(test["input"]):
                paths = [p for key in ("set", "vars", "grow") for p in _leaf_paths(step.get(key, {}))]
                paths += [tuple(u.split(".")) for u in step.get("unset", [])]
                bad += [f"{path.name}: {test['name']}: input {n}: {'.'.join(p)}"
                        for p in paths if p and not _in_schema(p)]
    assert bad == []


# ------------------------------------------------------------------------------ coverage

def _expectations() -> list[tuple[str, dict[str, Any]]]:
    return [(t["name"], e) for path in FILES for t in _tests(path) for e in t.get("expect", [])]


def test_every_default_rule_is_seen_firing_and_its_for_and_keep_firing_for_are_timed() -> None:
    exps = _expectations()

    def named(key: str) -> set[str]:
        return {r for _, e in exps for r in e.get(key, [])}

    firing, pending, resolved = named("firing") | named("warnings"), named("pending"), named("resolved")
    for rule in load():
        assert rule.name in firing, f"no timeline shows {rule.name} firing"
        if rule.for_s > 0:
            assert rule.name in pending, f"no timeline shows {rule.name} pending (not before `for`)"
        if rule.keep_firing_for_s > 0:
            assert rule.name in resolved, f"no timeline shows {rule.name} resolved"
            assert any("keep_firing_for" in name and rule.name in name for name, _ in exps), \
                f"no timeline named after {rule.name}'s keep_firing_for"


# ------------------------------------------------------------------------------------- CLI

def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stallwatch", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120, check=False)


def test_cli_rules_test_passing_file_exits_0() -> None:
    path = RULE_TESTS / "stalls.test.toml"
    res = _cli("rules", "test", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1] == f"{len(_tests(path))} tests, 0 failed ({path})"


def test_cli_rules_test_failing_file_exits_1_with_readable_lines(tmp_path: Path) -> None:
    text = (RULE_TESTS / "progress.test.toml").read_text()
    text = text.replace('rule_files = ["../../rules"]', f'rule_files = ["{ROOT / "rules"}"]')
    # two wrong expectations in "finished: exit code 0 (our child)"
    text = text.replace('at_s = 3\nverdict = "finished"\nfiring = ["finished"]',
                        'at_s = 3\nverdict = "crash"\nfiring = ["crash"]', 1)
    bad = tmp_path / "wrong.test.toml"
    bad.write_text(text)
    res = _cli("rules", "test", str(bad))
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout.splitlines() == [
        "test 'finished: exit code 0 (our child)' at 3s: verdict: expected 'crash', got 'finished'",
        ("test 'finished: exit code 0 (our child)' at 3s: firing: expected ['crash'], got "
         "['finished', 'healthy']"),
        # the summary counts failed expectations, not failed tests
        f"{len(_tests(bad))} tests, 2 failed ({bad})",
    ]


def test_cli_rules_test_unloadable_file_exits_3(tmp_path: Path) -> None:
    bad = tmp_path / "typo.test.toml"
    bad.write_text(f'rule_files = ["{ROOT / "rules"}"]\n[[test]]\nname = "t"\n[[test.input]]\n'
                   '[[test.expect]]\nat_s = 0\nfiring = ["hnag"]\n')
    res = _cli("rules", "test", str(bad))
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"{bad}:7:11: firing: no rule named 'hnag' (did you mean 'hang'?)" in res.stdout


def test_cli_rules_check_default_rules_exits_0() -> None:
    res = _cli("rules", "check")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{len(load())} rules OK in {len(builtin_rule_paths())} path(s)"


def test_cli_rules_check_bad_file_prints_file_line_column_and_exits_3(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nname = "stuck"\nkind = "hang"\nfor = "30 s"\n'
                   'condition = "log.idel_s > stall_threshold_s"\nsummary = "{proc.d_threads} in D"\n'
                   'colour = "red"\n')
    res = _cli("rules", "check", str(bad))
    assert res.returncode == 3, res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert all(re.match(rf"{re.escape(str(bad))}:\d+:\d+: ", line) for line in lines), lines
    assert lines == [
        (f"{bad}:4:7: for: bad duration '30 s': use a number of seconds or units ms, s, m, h, d "
         'like "1h30m"'),
        f"{bad}:5:18: condition: undeclared reference 'log.idel_s' (did you mean 'idle_s'?)",
        f"{bad}:7:1: unknown key 'colour' in rule",
    ]
