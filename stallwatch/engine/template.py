"""Text templates: literal text with `{cel expression}` placeholders, `{{` and `}}` for braces.

Compiled at rule-load time so a typo in a summary is a load error with a position, not a
broken alert at 3 a.m.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable, Mapping

from .expr import (Expr, ExprError, ExprEvalError, Vars, compile_expr, format_value,
                   line_col)

__all__ = ["Template", "compile_template"]


@dataclass(frozen=True, slots=True, eq=False)
class Template:
    source: str
    parts: tuple[str | Expr, ...]

    @property
    def exprs(self) -> tuple[Expr, ...]:
        return tuple(p for p in self.parts if isinstance(p, Expr))

    def render(self, data: Mapping[str, Any] | Vars) -> str:
        """Render; raises ExprEvalError from the first placeholder that fails."""
        return "".join(p if isinstance(p, str) else format_value(p.evaluate(data))
                       for p in self.parts)

    def render_lenient(self, data: Mapping[str, Any] | Vars) -> tuple[str, list[ExprEvalError]]:
        """Render every placeholder it can; a failing one reads `{?expr}` and is returned.

        Used for alert text: a broken summary must not hide the alert it describes.
        """
        out, errors = [], []
        for p in self.parts:
            if isinstance(p, str):
                out.append(p)
                continue
            try:
                out.append(format_value(p.evaluate(data)))
            except ExprEvalError as exc:
                errors.append(exc)
                out.append("{?" + p.source + "}")
        return "".join(out), errors


def _closing_brace(source: str, start: int) -> int:
    """Index of the `}` closing the placeholder opened at start, skipping CEL strings and maps."""
    depth = 0
    i = start + 1
    while i < len(source):
        c = source[i]
        if c in "'\"":
            quote = source[i : i + 3] if source[i : i + 3] in ("'''", '"""') else c
            i += len(quote)
            while i < len(source) and not source.startswith(quote, i):
                i += 2 if source[i] == "\\" else 1
            i += len(quote)
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            if depth == 0:
                return i
            depth -= 1
        i += 1
    return -1


def compile_template(
    source: str,
    *,
    names: Mapping[str, Any] | None = None,
    extra_names: Iterable[str] = (),
    reserved: Mapping[str, str] | None = None,
) -> Template:
    """Compile; ExprError positions are relative to the template text, not the placeholder."""
    parts: list[str | Expr] = []
    text: list[str] = []
    i = 0
    while i < len(source):
        c = source[i]
        if source.startswith("{{", i) or source.startswith("}}", i):
            text.append(c)
            i += 2
        elif c == "}":
            line, col = line_col(source, i)
            raise ExprError("single '}' in template (write '}}' for a literal brace)", line, col)
        elif c == "{":
            end = _closing_brace(source, i)
            if end < 0:
                line, col = line_col(source, i)
                raise ExprError("unclosed '{' in template (write '{{' for a literal brace)",
                                line, col)
            inner = source[i + 1 : end]
            try:
                expr = compile_expr(inner, names=names, extra_names=extra_names, reserved=reserved)
            except ExprError as exc:
                offset = exc.offset_in(inner)
                line, col = line_col(source, i + 1 + (offset if offset is not None else 0))
                raise ExprError(exc.message, line, col) from None
            if text:
                parts.append("".join(text))
                text = []
            parts.append(expr)
            i = end + 1
        else:
            text.append(c)
            i += 1
    if text:
        parts.append("".join(text))
    return Template(source, tuple(parts))
