"""Rule files: good files load, every problem of bad files is reported at file:line:column."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.engine import check_paths, load_rules
from stallwatch.engine.rulefile import RuleLoadError

FIXTURES = Path(__file__).parent / "fixtures" / "rules"
SCHEMA = {
    "log": {"idle_s": 0.0, "median_interval_s": 0.0},
    "proc": {"d_threads": 0, "threads": []},
    "job": {"pid": 0, "exited": False, "exit_code": 0, "oom_killed": False},
    "disk": {"mount": "", "device": "", "io_ms_per_s": 0.0, "eta_full_s": 0.0},
}


def _errors(tmp_path: Path, text: str, schema: dict | None = SCHEMA) -> list[str]:
    path = tmp_path / "r.toml"
    path.write_text(text)
    with pytest.raises(RuleLoadError) as info:
        load_rules([path], schema)
    return [str(e).replace(f"{path}:", "r.toml:") for e in info.value.errors]


def test_good_rules_load_with_schema() -> None:
    rules = load_rules([FIXTURES / "good"], SCHEMA)
    assert [r.name for r in rules] == ["progressing", "hang", "io_stall", "crash", "disk_filling"]
    io = rules.get("io_stall")
    assert io is not None
    assert (io.kind, io.severity, io.priority, io.for_s, io.keep_firing_for_s) == (
        "io_stall", "critical", 50, 10.0, 20.0)
    assert [e.signal for e in io.evidence] == ["thread", "disk"]
    assert io.evidence[0].limit == 2 and io.evidence[0].each is not None
    assert [k for k, _ in io.labels] == ["mount"]
    assert io.line == 22 and io.file.endswith("stall.toml")
    assert rules.get("disk_filling").warning is True
    assert rules.get("crash").cause is not None


def test_every_error_of_the_bad_directory_is_reported_in_order() -> None:
    bad = FIXTURES / "bad"
    got = [e.replace(str(bad) + "/", "") for e in check_paths([bad], SCHEMA)]
    assert got == [
        "dup_b.toml:2:1: rule 'hang' defined twice (first at dup_a.toml:3:1)",
        "errors.toml:3:8: kind: unknown kind 'io_stal' (did you mean 'io_stall'?); one of: "
        "healthy, slow, hang, io_stall, server_hang, server_down, crash, gpu_fault, disk_full, "
        "finished, unknown",
        "errors.toml:4:12: severity: unknown severity 'fatal'; one of: info, warning, critical",
        "errors.toml:5:12: priority: expected an integer, got a float",
        "errors.toml:6:14: condition: undeclared reference 'lgo' (did you mean 'log'?)",
        "errors.toml:7:7: for: bad duration '30 s': use a number of seconds or units ms, s, m, "
        "h, d like \"1h30m\"",
        "errors.toml:8:19: keep_firing_for: must be a finite number of seconds >= 0, got -5",
        "errors.toml:9:20: summary: unclosed '{' in template (write '{{' for a literal brace)",
        "errors.toml:10:1: unknown key 'colour' in rule",
        "errors.toml:13:8: name: 'two words' is not a name (letters, digits, _ and -)",
        "errors.toml:17:3: condition: Syntax error: extraneous input '&&' expecting {'[', '{', "
        "'(', '.', '-', '!', 'true', 'false', 'null', NUM_FLOAT, NUM_INT, NUM_UINT, STRING, "
        "BYTES, IDENTIFIER}",
        "errors.toml:19:13: advice[0]: 'it' is bound only in evidence that has `each`",
        "errors.toml:21:40: evidence[0].detail: undeclared reference 'log.idel_s' "
        "(did you mean 'idle_s'?)",
        "errors.toml:21:59: evidence[0].limit: must be at least 1",
        "errors.toml:22:3: evidence[1]: missing required key 'signal'",
        "errors.toml:25:1: rule is missing required key 'name'",
        "errors.toml:27:13: condition: expected a CEL expression string, got an integer",
        "errors.toml:29:18: labels.pid: unclosed '{' in template (write '{{' for a literal brace)",
        "errors.toml:30:11: warning: expected true or false, got a string",
        "syntax.toml:4:29: TOML syntax: Illegal character '\\n'",
    ]


def test_duplicate_names_across_files_point_at_both() -> None:
    a, b = FIXTURES / "bad" / "dup_a.toml", FIXTURES / "bad" / "dup_b.toml"
    assert check_paths([a, b]) == [f"{b}:2:1: rule 'hang' defined twice (first at {a}:3:1)"]
    assert check_paths([a]) == []


def test_without_schema_unknown_variables_are_accepted() -> None:
    assert check_paths([FIXTURES / "bad" / "dup_a.toml"], schema=None) == []


def test_missing_file(tmp_path: Path) -> None:
    assert check_paths([tmp_path / "nope.toml"]) == [f"{tmp_path / 'nope.toml'}: no such file"]


def test_unknown_top_level_key_and_unknown_evidence_key(tmp_path: Path) -> None:
    text = (
        'title = "x"\n'
        "[[rule]]\n"
        'name = "a"\n'
        'kind = "hang"\n'
        'condition = "true"\n'
        'summary = "s"\n'
        "[[rule.evidence]]\n"
        'signal = "log"\n'
        'detail = "d"\n'
        'detial = "d"\n'
    )
    assert _errors(tmp_path, text) == [
        "r.toml:1:1: unknown top-level key 'title' (a rule file holds [[rule]] tables)",
        "r.toml:10:1: unknown key 'detial' in evidence (did you mean 'detail'?)",
    ]


def test_positions_inside_escaped_and_multiline_strings(tmp_path: Path) -> None:
    text = (
        "[[rule]]\n"
        'name = "a"\n'
        'kind = "hang"\n'
        'condition = "job.pid != \\"x\\" && lgo.x"\n'     # escapes before the error
        "summary = '''\n"
        "first line\n"
        "  {log.nope} here'''\n"
        'advice = ["""a \\\n'
        '     {lgo}"""]\n'                                # line-ending backslash
    )
    assert _errors(tmp_path, text) == [
        "r.toml:4:34: condition: undeclared reference 'lgo' (did you mean 'log'?)",
        "r.toml:7:8: summary: undeclared reference 'log.nope'",
        "r.toml:9:7: advice[0]: undeclared reference 'lgo' (did you mean 'log'?)",
    ]


def test_rule_must_be_array_of_tables(tmp_path: Path) -> None:
    assert _errors(tmp_path, "rule = 3\n") == [
        "r.toml:1:8: 'rule' must be an array of tables: write [[rule]]"]
    assert _errors(tmp_path, "rule = [1]\n") == ["r.toml:1:9: each rule must be a table"]


def test_it_is_allowed_in_each_scope_only(tmp_path: Path) -> None:
    text = (
        "[[rule]]\n"
        'name = "a"\n'
        'kind = "hang"\n'
        'condition = "it.x"\n'
        'summary = "s"\n'
        "evidence = [\n"
        '  {signal = "t", each = "proc.threads", when = "it.state == \'D\'", detail = "{it.tid}"},\n'
        '  {signal = "t", detail = "{it.tid}"},\n'
        "]\n"
    )
    assert _errors(tmp_path, text) == [
        "r.toml:4:14: condition: 'it' is bound only in evidence that has `each`",
        "r.toml:8:29: evidence[1].detail: 'it' is bound only in evidence that has `each`",
    ]


def test_bad_label_names_and_types(tmp_path: Path) -> None:
    text = (
        "[[rule]]\n"
        'name = "a"\n'
        'kind = "hang"\n'
        'condition = "true"\n'
        'summary = "s"\n'
        'labels = {"bad name" = "x", ok = 3}\n'
        'evidence = {signal = "x"}\n'
        'advice = "not a list"\n'
    )
    assert _errors(tmp_path, text) == [
        "r.toml:6:11: labels: 'bad name' is not a label name",
        "r.toml:6:34: labels.ok: expected a string, got an integer",
        "r.toml:7:12: evidence: expected an array of tables, got a table",
        "r.toml:8:10: advice: expected an array of strings, got a string",
    ]


def test_durations_accept_numbers_and_strings(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text('[[rule]]\nname = "a"\nkind = "hang"\ncondition = "true"\nsummary = "s"\n'
                    'for = 90\nkeep_firing_for = "1h30m"\n')
    rule = load_rules([path]).get("a")
    assert (rule.for_s, rule.keep_firing_for_s, rule.severity, rule.priority) == (
        90.0, 5400.0, "warning", 0)
