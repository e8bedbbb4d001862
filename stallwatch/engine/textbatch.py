"""A rule's texts from one CEL run instead of one a placeholder (issue 17, third pass).

At the daemon's 1 s cadence every CEL call costs what it touches (~50 us cold against ~3 us
back to back here), and the healthy rule renders ~10 placeholders and `when`s every tick,
because the numbers it shows move. So each rule's summary, evidence, advice and cause are
compiled once more as a single list expression:

    [(s1), (s2), (w0) ? [(d0a), (d0b)] : false, [(d1a)], (a0), (c0)]

one element per placeholder, an evidence line's details behind its `when` (CEL's `?:`
evaluates the branch taken alone, as `_render_text` evaluates a detail only when its `when`
holds). A run without error gives exactly the values the placeholders give one by one; any
error (a missing key, a `when` that is not a bool) and the caller renders the usual way, which
says which placeholder failed and how. A rule with `each` evidence (a loop binding `it`) is
rendered the usual way always.

A placeholder that is a variable's path alone (`{log.idle_s}`, most evidence details) is read
from the variables themselves, not from CEL (`plain_paths`, `fill_batch`'s `data`): CEL gives
that same value back, for a string, double, bool or null; anything else (a missing key, a list
or map, whose order CEL does not keep) and the caller renders the usual way. The evaluator's
context then need not hold what only such placeholders read: each value put into a CEL context
costs thousands of instructions (the library tries it as an int and a uint first, raising).
"""

from __future__ import annotations

from typing import Any

from .expr import Expr, ExprError, ExprEvalError, Vars, compile_expr, format_value
from .rulefile import Rule
from .template import Template

__all__ = ["compile_batch", "fill_batch", "plain_paths", "render_batch"]

_NO: Any = object()
# A placeholder read from the variables (not from CEL) -> its path.
Plain = dict[Expr, tuple[str, ...]]


def _items(tpl: Template, plain: Plain) -> list[str]:
    # A newline after each: a `//` comment in a placeholder ends there, not at the list's end.
    return [f"({p.source}\n)" for p in tpl.parts if isinstance(p, Expr) and p not in plain]


def _templates(rule: Rule) -> list[Template]:
    return [rule.summary, *(ev.detail for ev in rule.evidence), *rule.advice,
            *((rule.cause,) if rule.cause is not None else ())]


def plain_paths(rule: Rule) -> Plain:
    """The rule's text placeholders that are a variable's path alone, as written (no spaces,
    calls, indexes or literals): `{log.idle_s}`. Not for a rule with `each` evidence (`it`)."""
    out: Plain = {}
    for tpl in _templates(rule):
        for p in tpl.exprs:
            refs = p.references
            if (len(refs) == 1 and not p.bound and p.source.strip() == ".".join(refs[0].path)
                    and refs[0].path[0] != "it"):
                out[p] = refs[0].path
    return out


def compile_batch(rule: Rule, plain: Plain | None = None) -> Expr | None:
    """The rule's texts as one list expression, less the placeholders of `plain` (which
    `fill_batch` reads from the variables); None when it has `each` evidence or (never for a
    rule that loaded) the combination does not compile."""
    if any(ev.each is not None for ev in rule.evidence):
        return None
    plain = plain or {}
    items = _items(rule.summary, plain)
    for ev in rule.evidence:
        details = "[" + ", ".join(_items(ev.detail, plain)) + "]"
        items.append(details if ev.when is None else f"({ev.when.source}\n) ? {details} : false")
    for tpl in (*rule.advice, *((rule.cause,) if rule.cause is not None else ())):
        items += _items(tpl, plain)
    try:
        return compile_expr("[" + ",\n".join(items) + "]")
    except ExprError:
        return None


class _Unplain(Exception):
    """A plain placeholder whose value CEL might not give back as it is: render as usual."""


def _read(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    """What CEL gives for `path` over `data`, where that is a string, double, bool or null."""
    value: Any = data
    for key in path:
        if type(value) is not dict:
            raise _Unplain
        value = value.get(key, _NO)
        if value is _NO:
            raise _Unplain
    t = type(value)
    if t is str or t is float or t is bool or value is None:
        return value
    raise _Unplain


def _fill(tpl: Template, values: list[Any], at: int, plain: Plain | None,
          data: dict[str, Any] | None) -> tuple[str, int]:
    out = []
    for p in tpl.parts:
        if isinstance(p, str):
            out.append(p)
        elif plain and p in plain:
            out.append(format_value(_read(data, plain[p])))  # type: ignore[arg-type]
        else:
            out.append(format_value(values[at]))
            at += 1
    return "".join(out), at


def render_batch(rule: Rule, batch: Expr, env: Vars, plain: Plain | None = None,
                 data: dict[str, Any] | None = None
                 ) -> tuple[str, list[tuple[str, str]], list[str], str | None] | None:
    """(summary, [(signal, detail)], advice, cause) from one run of `batch` (compiled less
    `plain`, whose values come from `data`); None when the run failed or gave something other
    than the expected shape: render the usual way."""
    try:
        values = batch.evaluate(env)
    except ExprEvalError:
        return None
    return fill_batch(rule, values, plain, data)


def fill_batch(rule: Rule, values: Any, plain: Plain | None = None,
               data: dict[str, Any] | None = None
               ) -> tuple[str, list[tuple[str, str]], list[str], str | None] | None:
    """render_batch's texts from the values a run of the batch gave."""
    if type(values) is not list or (plain and data is None):
        return None
    try:
        summary, at = _fill(rule.summary, values, 0, plain, data)
        evidence: list[tuple[str, str]] = []
        for ev in rule.evidence:
            shown, at = values[at], at + 1
            if shown is False:
                continue
            if type(shown) is not list:
                return None
            detail, _ = _fill(ev.detail, shown, 0, plain, data)
            evidence.append((ev.signal, detail))
        advice = []
        for tpl in rule.advice:
            text, at = _fill(tpl, values, at, plain, data)
            advice.append(text)
        cause = None
        if rule.cause is not None:
            cause, at = _fill(rule.cause, values, at, plain, data)
    except (IndexError, _Unplain):
        return None
    return (summary, evidence, advice, cause) if at == len(values) else None
