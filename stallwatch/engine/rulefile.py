"""Rule files: TOML `[[rule]]` tables, validated completely before anything runs.

Every problem in every file is collected and reported as `file:line:column: problem`; loading
stops only after all files were read, so one `rules check` run shows the whole list.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Iterator, Mapping, Sequence

from stallwatch.vocab import SEVERITIES, VERDICT_KINDS

from .duration import parse_duration
from .expr import Expr, ExprError, compile_expr
from .template import Template, compile_template
from .tomlpos import Located, Positions, load_toml

__all__ = [
    "KINDS", "SEVERITIES", "Evidence", "Rule", "RuleLoadError", "RuleSet",
    "expand_paths", "load_rules",
]

KINDS = VERDICT_KINDS  # the contract's vocabulary, spelled once in stallwatch.vocab
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_RULE_KEYS = ("name", "kind", "severity", "priority", "condition", "for", "keep_firing_for",
              "summary", "evidence", "advice", "cause", "labels", "warning", "description")
_EVIDENCE_KEYS = ("signal", "detail", "each", "when", "limit")
_EACH_VAR = "it"
# The evaluator binds `it` on a shared context, so a stale value would leak into any other use.
_RESERVED = {_EACH_VAR: f"'{_EACH_VAR}' is bound only in evidence that has `each`"}


@dataclass(frozen=True, slots=True, eq=False)
class Evidence:
    signal: str
    detail: Template
    each: Expr | None = None   # a list expression; detail and when see each element as `it`
    when: Expr | None = None
    limit: int = 10            # elements of `each` shown; the rest are counted, not listed


@dataclass(frozen=True, slots=True, eq=False)
class Rule:
    name: str
    kind: str
    condition: Expr
    summary: Template
    severity: str = "warning"
    priority: int = 0
    for_s: float = 0.0
    keep_firing_for_s: float = 0.0
    evidence: tuple[Evidence, ...] = ()
    advice: tuple[Template, ...] = ()
    cause: Template | None = None
    labels: tuple[tuple[str, Template], ...] = ()
    warning: bool = False
    description: str = ""
    file: str = ""
    line: int = 0


@dataclass(frozen=True, slots=True)
class RuleSet:
    rules: tuple[Rule, ...] = ()

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def get(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)


class RuleLoadError(Exception):
    def __init__(self, errors: list[Located]):
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given, directories as their *.toml files in name order."""
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.toml")) if p.is_dir() else [p])
    return out


def load_rules(paths: Iterable[str | Path], schema: Mapping[str, Any] | None = None) -> RuleSet:
    """Load and validate; RuleLoadError lists every problem found in every file."""
    errors: list[Located] = []
    rules: list[Rule] = []
    first_seen: dict[str, str] = {}
    for path in expand_paths(paths):
        named, file_errors = _load_file(path, str(path), schema)
        for name, where, rule in named:
            if name in first_seen:
                file_errors.append(where.model_copy(update={
                    "message": f"rule '{name}' defined twice (first at {first_seen[name]})"}))
                continue
            first_seen[name] = f"{where.file}:{where.line}:{where.column}"
            if rule is not None:
                rules.append(rule)
        errors += sorted(file_errors, key=lambda e: (e.line, e.column))
    if errors:
        raise RuleLoadError(errors)
    return RuleSet(tuple(rules))


def _load_file(path: Path, display: str, schema: Mapping[str, Any] | None
               ) -> tuple[list[tuple[str, Located, Rule | None]], list[Located]]:
    """(name, where the name is, the rule or None if invalid) for each rule, and the errors."""
    if not path.is_file():
        return [], [Located(file=display, message="no such file")]
    data, pos, errors = load_toml(path, display)
    if data is None or pos is None:
        return [], errors
    v = _Validator(display, pos, schema)
    for key in data:
        if key != "rule":
            v.error((key,), f"unknown top-level key '{key}' (a rule file holds [[rule]] tables)",
                    at_key=True)
    tables = data.get("rule", [])
    if not isinstance(tables, list):
        v.error(("rule",), "'rule' must be an array of tables: write [[rule]]")
        tables = []
    named = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            v.error(("rule", i), "each rule must be a table")
            continue
        rule = v.rule(("rule", i), table)
        if isinstance(table.get("name"), str):
            line, col = pos.key(("rule", i, "name"))
            named.append((table["name"], Located(file=display, line=line, column=col, message=""),
                          rule))
    return named, errors + v.errors


class _Validator:
    """Checks one file's rule tables; each check records a Located error and returns None."""

    def __init__(self, file: str, pos: Positions, schema: Mapping[str, Any] | None):
        self.file, self.pos, self.schema = file, pos, schema
        self.errors: list[Located] = []

    def error(self, path: tuple, message: str, *, at_key: bool = False,
              where: tuple[int, int] | None = None) -> None:
        line, col = where or (self.pos.key(path) if at_key else self.pos.value(path))
        self.errors.append(Located(file=self.file, line=line, column=col, message=message))

    def rule(self, path: tuple, t: dict[str, Any]) -> Rule | None:
        before = len(self.errors)
        self.unknown_keys(path, t, _RULE_KEYS, "rule")
        for key in ("name", "kind", "condition", "summary"):
            if key not in t:
                self.error(path, f"rule is missing required key '{key}'", at_key=True)
        name = self.string(path, t, "name")
        if name is not None and not _NAME.match(name):
            self.error(path + ("name",), f"name: {name!r} is not a name (letters, digits, _ and -)")
        kind = self.choice(path, t, "kind", KINDS)
        severity = self.choice(path, t, "severity", SEVERITIES, "warning")
        priority = self.typed(path, t, "priority", int, "an integer", 0)
        warning = self.typed(path, t, "warning", bool, "true or false", False)
        description = self.string(path, t, "description") or ""
        for_s = self.duration(path, t, "for")
        keep_s = self.duration(path, t, "keep_firing_for")
        condition = self.expr(path + ("condition",), t.get("condition"))
        summary = self.template(path + ("summary",), t.get("summary"))
        cause = self.template(path + ("cause",), t.get("cause")) if "cause" in t else None
        advice = self.templates(path + ("advice",), t.get("advice", []))
        evidence = self.evidence_list(path + ("evidence",), t.get("evidence", []))
        labels = self.labels(path + ("labels",), t.get("labels", {}))
        if (len(self.errors) > before or name is None or kind is None or condition is None
                or summary is None or severity is None):
            return None
        return Rule(name=name, kind=kind, condition=condition, summary=summary,
                    severity=severity, priority=priority, for_s=for_s, keep_firing_for_s=keep_s,
                    evidence=evidence, advice=advice, cause=cause, labels=labels,
                    warning=warning, description=description, file=self.file,
                    line=self.pos.key(path)[0])

    # -- generic checks

    def unknown_keys(self, path: tuple, t: dict, allowed: Sequence[str], what: str) -> None:
        for key in t:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                self.error(path + (key,), f"unknown key '{key}' in {what}{hint}", at_key=True)

    def typed(self, path: tuple, t: dict, key: str, typ: type, what: str, default: Any) -> Any:
        if key not in t:
            return default
        value = t[key]
        # bool is an int in Python, not in TOML: `priority = true` is a mistake.
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            self.error(path + (key,), f"{key}: expected {what}, got {_toml_type(value)}")
            return default
        return value

    def string(self, path: tuple, t: dict, key: str) -> str | None:
        value = self.typed(path, t, key, str, "a string", None)
        if value is not None and not value.strip():
            self.error(path + (key,), f"{key}: must not be empty")
            return None
        return value

    def choice(self, path: tuple, t: dict, key: str, allowed: Sequence[str],
               default: str | None = None) -> str | None:
        value = self.string(path, t, key) if key in t else default
        if value is not None and value not in allowed:
            close = difflib.get_close_matches(value, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            self.error(path + (key,), f"{key}: unknown {key} '{value}'{hint}; "
                                      f"one of: {', '.join(allowed)}")
            return None
        return value

    def duration(self, path: tuple, t: dict, key: str) -> float:
        if key not in t:
            return 0.0
        try:
            return parse_duration(t[key])
        except ValueError as exc:
            self.error(path + (key,), f"{key}: {exc}")
            return 0.0

    # -- expressions and templates

    def _located_expr_error(self, path: tuple, exc: ExprError, source: str) -> None:
        offset = exc.offset_in(source)
        where = self.pos.in_string(path, offset) if offset is not None else None
        self.error(path, f"{_dotted(path)}: {exc.message}", where=where)

    def expr(self, path: tuple, source: Any, *, each_scope: bool = False) -> Expr | None:
        if source is None:
            return None
        if not isinstance(source, str):
            self.error(path, f"{_dotted(path)}: expected a CEL expression string, "
                             f"got {_toml_type(source)}")
            return None
        extra = (_EACH_VAR,) if each_scope else ()
        try:
            return compile_expr(source, names=self.schema, extra_names=extra, reserved=_RESERVED)
        except ExprError as exc:
            self._located_expr_error(path, exc, source)
            return None

    def template(self, path: tuple, source: Any, *, each_scope: bool = False) -> Template | None:
        if source is None:
            return None
        if not isinstance(source, str):
            self.error(path, f"{_dotted(path)}: expected a string, got {_toml_type(source)}")
            return None
        extra = (_EACH_VAR,) if each_scope else ()
        try:
            return compile_template(source, names=self.schema, extra_names=extra,
                                    reserved=_RESERVED)
        except ExprError as exc:
            self._located_expr_error(path, exc, source)
            return None

    def templates(self, path: tuple, values: Any) -> tuple[Template, ...]:
        if not isinstance(values, list):
            self.error(path, f"{_dotted(path)}: expected an array of strings, "
                             f"got {_toml_type(values)}")
            return ()
        out = (self.template(path + (i,), v) for i, v in enumerate(values))
        return tuple(t for t in out if t is not None)

    def labels(self, path: tuple, values: Any) -> tuple[tuple[str, Template], ...]:
        if not isinstance(values, dict):
            self.error(path, f"labels: expected a table of templates, got {_toml_type(values)}")
            return ()
        out = []
        for key, value in values.items():
            if not _NAME.match(key):
                self.error(path + (key,), f"labels: {key!r} is not a label name", at_key=True)
            tpl = self.template(path + (key,), value)
            if tpl is not None:
                out.append((key, tpl))
        return tuple(sorted(out))

    def evidence_list(self, path: tuple, values: Any) -> tuple[Evidence, ...]:
        if not isinstance(values, list):
            self.error(path, f"evidence: expected an array of tables, got {_toml_type(values)}")
            return ()
        out = []
        for i, t in enumerate(values):
            p = path + (i,)
            if not isinstance(t, dict):
                self.error(p, f"{_dotted(p)}: expected a table {{signal = ..., detail = ...}}")
                continue
            before = len(self.errors)
            self.unknown_keys(p, t, _EVIDENCE_KEYS, "evidence")
            for key in ("signal", "detail"):
                if key not in t:
                    self.error(p, f"{_dotted(p)}: missing required key '{key}'")
            signal = self.string(p, t, "signal")
            each = self.expr(p + ("each",), t.get("each"))
            scoped = each is not None or "each" in t
            detail = self.template(p + ("detail",), t.get("detail"), each_scope=scoped)
            when = self.expr(p + ("when",), t.get("when"), each_scope=scoped)
            limit = self.typed(p, t, "limit", int, "an integer", 10)
            if isinstance(limit, int) and limit < 1:
                self.error(p + ("limit",), f"{_dotted(p)}.limit: must be at least 1")
            if len(self.errors) == before and signal is not None and detail is not None:
                out.append(Evidence(signal, detail, each, when, limit))
        return tuple(out)


def _dotted(path: tuple) -> str:
    """("rule", 3, "evidence", 1, "detail") -> "evidence[1].detail" (the rule is the context)."""
    parts = list(path[2:]) if path[:1] == ("rule",) else list(path)
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _toml_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
             list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)
