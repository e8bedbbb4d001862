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
"""

from __future__ import annotations

from typing import Any

from .expr import Expr, ExprError, ExprEvalError, Vars, compile_expr, format_value
from .rulefile import Rule
from .template import Template

__all__ = ["compile_batch", "fill_batch", "render_batch"]


def _items(tpl: Template) -> list[str]:
    # A newline after each: a `//` comment in a placeholder ends there, not at the list's end.
    return [f"({p.source}\n)" for p in tpl.parts if isinstance(p, Expr)]


def compile_batch(rule: Rule) -> Expr | None:
    """The rule's texts as one list expression; None when it has `each` evidence or (never
    for a rule that loaded) the combination does not compile."""
    if any(ev.each is not None for ev in rule.evidence):
        return None
    items = _items(rule.summary)
    for ev in rule.evidence:
        details = "[" + ", ".join(_items(ev.detail)) + "]"
        items.append(details if ev.when is None else f"({ev.when.source}\n) ? {details} : false")
    for tpl in (*rule.advice, *((rule.cause,) if rule.cause is not None else ())):
        items += _items(tpl)
    try:
        return compile_expr("[" + ",\n".join(items) + "]")
    except ExprError:
        return None


def _fill(tpl: Template, values: list[Any], at: int) -> tuple[str, int]:
    out = []
    for p in tpl.parts:
        if isinstance(p, str):
            out.append(p)
        else:
            out.append(format_value(values[at]))
            at += 1
    return "".join(out), at


def render_batch(rule: Rule, batch: Expr, env: Vars
                 ) -> tuple[str, list[tuple[str, str]], list[str], str | None] | None:
    """(summary, [(signal, detail)], advice, cause) from one run of `batch`; None when the
    run failed or gave something other than the expected shape: render the usual way."""
    try:
        values = batch.evaluate(env)
    except ExprEvalError:
        return None
    return fill_batch(rule, values)


def fill_batch(rule: Rule, values: Any
               ) -> tuple[str, list[tuple[str, str]], list[str], str | None] | None:
    """render_batch's texts from the values a run of the batch gave."""
    if type(values) is not list:
        return None
    try:
        summary, at = _fill(rule.summary, values, 0)
        evidence: list[tuple[str, str]] = []
        for ev in rule.evidence:
            shown, at = values[at], at + 1
            if shown is False:
                continue
            if type(shown) is not list:
                return None
            detail, _ = _fill(ev.detail, shown, 0)
            evidence.append((ev.signal, detail))
        advice = []
        for tpl in rule.advice:
            text, at = _fill(tpl, values, at)
            advice.append(text)
        cause = None
        if rule.cause is not None:
            cause, at = _fill(rule.cause, values, at)
    except IndexError:
        return None
    return (summary, evidence, advice, cause) if at == len(values) else None
