"""What a rule reads, so that a rule whose inputs did not change is not evaluated again (issue 17).

A rule's result is a function of the variables its expressions name and nothing else: CEL has
no clock and no state, and a rule's `for` / `keep_firing_for` are timed by the evaluator, not
by CEL (alerting.py `_advance` runs every tick). So the evaluator keeps, per rule, the slice of
the variables its condition reads (and, while it is active, the slice its labels and texts
read), and evaluates it again only when that slice differs from the last one. A rule reading
`log.idle_s` is evaluated every tick (the number moves); one reading `job.exited` only when that
flag flips.

The slice of a variable path is the deepest node that exists along it: `log.idle_s` takes
`log["idle_s"]` alone, `proc.threads.exists(t, ...)` the whole `proc["threads"]` list, `log`
alone (a map iterated or indexed: `log['x']`) the whole `log`. A missing key is left missing, so
a rule fails on the slice exactly as on the whole ("no such key"). A name bound by a
comprehension (`t` above) is not a variable; if it shadows one, the whole root is taken.

The CEL context is then built from the union of the slices of the rules evaluated this tick,
not from every variable: building it is what an evaluation costs (0.3 ms for a healthy job's
~6 KB of variables; the programs themselves run in microseconds).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable, Mapping

from .expr import Expr

__all__ = ["Paths", "expr_paths", "merge", "paths", "pick"]

# A trie of variable paths: key -> the keys read below it, or None for "the whole node".
Paths = dict[str, "Paths | None"]


def expr_paths(expr: Expr) -> Iterable[tuple[str, ...]]:
    for ref in expr.references:
        yield ref.path[:1] if ref.path[0] in expr.bound else ref.path


def paths(exprs: Iterable[Expr]) -> Paths:
    root: Paths = {}
    for expr in exprs:
        for path in expr_paths(expr):
            node: Paths = root
            for i, key in enumerate(path):
                if key in node and node[key] is None:
                    break  # already taken whole
                if i == len(path) - 1:
                    node[key] = None
                else:
                    node = node.setdefault(key, {})  # type: ignore[assignment]
    return root


def merge(a: Paths, b: Paths) -> Paths:
    out: Paths = dict(a)
    for key, sub in b.items():
        if key not in out:
            out[key] = sub
        elif out[key] is None or sub is None:
            out[key] = None
        else:
            out[key] = merge(out[key], sub)  # type: ignore[arg-type]
    return out


def pick(data: Mapping[str, Any], trie: Paths) -> dict[str, Any]:
    """The slice of `data` that `trie` names (values shared, not copied)."""
    out: dict[str, Any] = {}
    for key, sub in trie.items():
        if key in data:
            value = data[key]
            out[key] = value if sub is None or type(value) is not dict else pick(value, sub)
    return out
