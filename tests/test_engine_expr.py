"""CEL wrapper: compile errors with positions, evaluation errors, and one numeric type."""

from __future__ import annotations

import pytest

from stallwatch.engine.duration import parse_duration
from stallwatch.engine.expr import (ExprError, ExprEvalError, Vars, compile_expr, format_value,
                                    normalise)
from stallwatch.engine.template import compile_template

VARS = {
    "log": {"idle_s": 41.5, "median_interval_s": 1},
    "proc": {"d_threads": 2, "threads": [{"tid": 7, "state": "D"}, {"tid": 8, "state": "S"}]},
    "job": {"exited": False, "pid": 1234},
    "stall_threshold_s": 30,
    "progress": {"done": 1, "total": 2},
}


def test_typical_condition_is_true() -> None:
    expr = compile_expr("log.idle_s > stall_threshold_s && proc.d_threads > 0 && !job.exited")
    assert expr.evaluate(VARS) is True


def test_comprehensions_and_has() -> None:
    assert compile_expr("proc.threads.exists(t, t.state == 'D')").evaluate(VARS) is True
    assert compile_expr("proc.threads.filter(t, t.state == 'D').map(t, t.tid)").evaluate(VARS) == [7.0]
    assert compile_expr("has(log.idle_s) && !has(log.nope)").evaluate(VARS) is True


@pytest.mark.parametrize(
    "source, value, expected",
    [
        # the int literal meets a double variable: comparison, arithmetic, equality
        ("x > 1", 1.5, True),
        ("x > 2 * y", 41.5, True),           # y=20 given as a Python int
        ("x * 2 > 80", 41.5, True),
        ("x == 40", 40.0, True),
        ("x == 40", 40, True),                # a probe reporting 40 one tick, 40.5 the next
        ("x + 1 > 41", 40.5, True),
        ("x - 0x10 == 24.5", 40.5, True),      # hex literals too
        ("x in [40, 41]", 40, True),
    ],
)
def test_int_and_double_mix_without_surprises(source: str, value: object, expected: bool) -> None:
    assert compile_expr(source).evaluate({"x": value, "y": 20}) is expected


def test_division_of_counters_is_real_division() -> None:
    # With CEL ints, 1 / 2 == 0 and `done / total > 0.4` would be silently false.
    assert compile_expr("progress.done / progress.total > 0.4").evaluate(VARS) is True


def test_indexes_and_map_keys_stay_int() -> None:
    data = {"xs": [10, 20, 30]}
    assert compile_expr("xs[0] + 1 == 11").evaluate(data) is True
    assert compile_expr("xs[size(xs) - 1] == 30").evaluate(data) is True
    assert compile_expr("{1: 'a'}[1] == 'a'").evaluate({}) is True
    assert compile_expr("int(x) % 2 == 1").evaluate({"x": 7}) is True


def test_literals_inside_strings_and_comments_are_left_alone() -> None:
    expr = compile_expr("s == 'n=1 // 2' && r'\\d 3' == t // 4 is a comment\n && x == 1")
    assert expr.evaluate({"s": "n=1 // 2", "t": "\\d 3", "x": 1}) is True


def test_size_is_int_and_compares_with_doubles() -> None:
    assert compile_expr("size(proc.threads) > 1.5").evaluate(VARS) is True
    with pytest.raises(ExprEvalError, match=r"wrap them in double\(\)"):
        compile_expr("size(proc.threads) * 2 > 3").evaluate(VARS)
    assert compile_expr("double(size(proc.threads)) * 2 > 3").evaluate(VARS) is True


def test_normalise_turns_ints_into_floats_but_not_bools() -> None:
    out = normalise({"a": 1, "b": True, "c": [1, {"d": 2}], "e": (3,), "f": None})
    assert out == {"a": 1.0, "b": True, "c": [1.0, {"d": 2.0}], "e": [3.0], "f": None}
    assert isinstance(out["a"], float) and out["b"] is True


@pytest.mark.parametrize(
    "source, line, column, fragment",
    [
        ("log.idle_s > ", 1, 14, "Syntax error"),
        ("log.idle_s >\n  && x", 2, 3, "extraneous input '&&'"),
        ("a +* b", 1, 4, "'*'"),
        ("   ", 1, 1, "empty expression"),
    ],
)
def test_compile_errors_have_positions(source: str, line: int, column: int, fragment: str) -> None:
    with pytest.raises(ExprError) as info:
        compile_expr(source)
    assert (info.value.line, info.value.column) == (line, column)
    assert fragment in info.value.message


def test_unknown_variables_refused_at_compile_time_with_position() -> None:
    schema = {"log": {"idle_s": 0.0}, "proc": {"threads": []}}
    with pytest.raises(ExprError) as info:
        compile_expr("proc.threads.exists(t, t.x) && lgo.idle_s > 1", names=schema)
    assert (info.value.line, info.value.column) == (1, 32)
    assert info.value.message == "undeclared reference 'lgo' (did you mean 'log'?)"
    with pytest.raises(ExprError) as info:
        compile_expr("log.idel_s > 1", names=schema)
    assert (info.value.column, info.value.message) == (
        5, "undeclared reference 'log.idel_s' (did you mean 'idle_s'?)")
    # comprehension variables, function names and methods are not variables
    compile_expr("proc.threads.exists(t, t.state == 'D') && size(log) > 0 && "
                 "log.idle_s.string() != ''", names=schema)


def test_reserved_names_refused_with_position() -> None:
    with pytest.raises(ExprError) as info:
        compile_expr("x && it.y", reserved={"it": "no it here"})
    assert (info.value.column, info.value.message) == (6, "no it here")
    compile_expr("it.y", reserved={"it": "no"}, extra_names=["it"])


@pytest.mark.parametrize(
    "source, data, message",
    [
        ("log.nope > 1", VARS, "no such key 'nope'"),
        ("nope > 1", VARS, "undeclared reference 'nope'"),
        ("job.pid + 'x'", VARS, "Unsupported operation: float + string"),
        ("x > 1", {"x": None}, "No such overload"),
        ("size(xs) / size(xs)", {"xs": []}, "division by zero"),
    ],
)
def test_eval_errors_are_exprevalerror(source: str, data: dict, message: str) -> None:
    expr = compile_expr(source)
    with pytest.raises(ExprEvalError) as info:
        expr.evaluate(data)
    assert message in info.value.message
    assert info.value.source == source


def test_evaluate_bool_refuses_non_bool() -> None:
    with pytest.raises(ExprEvalError, match="expected a bool, got double"):
        compile_expr("log.idle_s").evaluate_bool(VARS)


def test_prepared_vars_are_a_snapshot_and_bind_overrides() -> None:
    data = {"a": {"b": 1}}
    env = Vars(data)
    data["a"]["b"] = 5
    assert compile_expr("a.b").evaluate(env) == 1.0
    env.bind("it", 3)
    env.bind("it", 4)
    assert compile_expr("it + 1").evaluate(env) == 5.0


def test_double_division_by_zero_is_infinite_not_an_error() -> None:
    assert compile_expr("x / 0").evaluate({"x": 1}) == float("inf")


def test_no_code_execution(tmp_path) -> None:
    marker = tmp_path / "ran"
    expr = compile_expr(f"__import__('os').system('touch {marker}')")
    with pytest.raises(ExprEvalError, match="undeclared reference '__import__'"):
        expr.evaluate({})
    with pytest.raises(ExprEvalError):
        compile_expr("x.__class__").evaluate({"x": 1})
    assert not marker.exists()


# --------------------------------------------------------------------------- templates

def test_template_renders_placeholders_and_literal_braces() -> None:
    tpl = compile_template("{{x}} idle {log.idle_s}s, pid {job.pid}, map {{'a': {{1: 2}}}} {'}'}")
    assert tpl.render(VARS) == "{x} idle 41.5s, pid 1234, map {'a': {1: 2}} }"


def test_template_placeholder_may_hold_a_map_literal() -> None:
    assert compile_template("{ {'k': 'v'}.k }").render({}) == "v"


@pytest.mark.parametrize(
    "source, column, fragment",
    [("a {b", 3, "unclosed '{'"), ("a } b", 3, "single '}'"), ("ok {x +* y}", 8, "Syntax error"),
     ("{}", 2, "empty expression")],
)
def test_template_errors_have_positions(source: str, column: int, fragment: str) -> None:
    with pytest.raises(ExprError) as info:
        compile_template(source)
    assert (info.value.line, info.value.column) == (1, column)
    assert fragment in info.value.message


def test_lenient_render_keeps_going() -> None:
    text, errors = compile_template("a={log.idle_s} b={log.nope}").render_lenient(VARS)
    assert text == "a=41.5 b={?log.nope}"
    assert [e.message for e in errors] == ["no such key 'nope'"]


@pytest.mark.parametrize(
    "value, text",
    [(41.0, "41"), (1.02345, "1.023"), (17300.5, "17300.5"), (0.1 + 0.2, "0.3"),
     (0.0015, "0.0015"), (None, "null"), (True, "true"), ([1.0, 2.5], "1, 2.5"), ("s", "s")],
)
def test_format_value(value: object, text: str) -> None:
    assert format_value(value) == text


# --------------------------------------------------------------------------- durations

@pytest.mark.parametrize(
    "value, seconds",
    [(30, 30.0), (2.5, 2.5), ("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25),
     ("1d", 86400.0), ("1.5s", 1.5), ("0", None)],
)
def test_parse_duration(value: object, seconds: float | None) -> None:
    if seconds is None:
        with pytest.raises(ValueError, match="a bare number needs no quotes"):
            parse_duration(value)
    else:
        assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["30s5m", "5m5m", "-5s", "5 m", "", "5x", True, -1, float("inf"), [1]])
def test_parse_duration_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)
