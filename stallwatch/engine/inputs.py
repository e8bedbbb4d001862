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

import itertools
from typing import Any
from collections.abc import Iterable, Mapping

from .expr import Expr, ExprError, _tokens, compile_expr

__all__ = ["Paths", "conjuncts", "exact", "expr_paths", "merge", "paths", "pick", "tokens",
           "unchanged"]

_MISSING: Any = object()

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
                    child = node.get(key)  # absent, or a dict (None broke out above)
                    if child is None:
                        child = node[key] = {}
                    node = child
    return root


def merge(a: Paths, b: Paths) -> Paths:
    out: Paths = dict(a)
    for key, sub in b.items():
        if key not in out:
            out[key] = sub
            continue
        have = out[key]
        out[key] = None if have is None or sub is None else merge(have, sub)
    return out


def conjuncts(expr: Expr) -> tuple[Expr, ...]:
    """`a && b && c` as (a, b, c), compiled; () for anything else (a top-level `||` or `?:`
    binds looser than `&&`, so then there is no such split).

    A condition that was false because its first false conjunct was, with that conjunct and the
    ones before it (all true) reading what they read then, is false again, whatever the rest
    reads: CEL's `&&` is false as soon as one side is false, and left to right the evaluation
    stops there with the same values. The hang rule, false while `activity.working`, is then
    not evaluated again each tick for its `proc.quiet_s`, which moves every tick."""
    toks = _tokens(expr.source)
    depth, cuts = 0, [-1]
    for i, t in enumerate(toks):
        if t.kind != "op":
            continue
        if t.text in "([{":
            depth += 1
        elif t.text in ")]}":
            depth -= 1
        elif depth == 0 and t.text in "?:":
            return ()
        elif depth == 0 and t.text in "|&" and i + 1 < len(toks) and toks[i + 1].text == t.text:
            if t.text == "|":
                return ()
            cuts.append(i)
    if len(cuts) < 2:
        return ()
    bounds = [*cuts, len(toks)]
    out = []
    for a, b in itertools.pairwise(bounds):
        lo = toks[a + 1 + (a >= 0)].start if a >= 0 else 0  # past the `&&` (two tokens)
        hi = toks[b].start if b < len(toks) else len(expr.source)
        part = expr.source[lo:hi]
        try:
            out.append(compile_expr(part))
        except ExprError:
            return ()
    return tuple(out)


def pick(data: Mapping[str, Any], trie: Paths) -> dict[str, Any]:
    """The slice of `data` that `trie` names (values shared, not copied)."""
    out: dict[str, Any] = {}
    for key, sub in trie.items():
        if key in data:
            value = data[key]
            out[key] = value if sub is None or type(value) is not dict else pick(value, sub)
    return out


def unchanged(trie: Paths, same: dict[str, Any]) -> bool:
    """True when every path of `trie` reads only what `same` (expr.renormalise's tree of what
    did not change since the last tick) says is as it was: then so is its slice (`pick`), and a
    rule whose slice is what it read last time needs neither evaluating nor slicing again.

    Two levels are walked here without a call (renormalise's tree is two deep in the
    evaluator): this runs for every rule every tick (issue 17, fifth pass)."""
    for key, sub in trie.items():
        below = same.get(key, _MISSING)
        if below is None:
            continue
        if below is _MISSING or sub is None:
            return False
        for key2, sub2 in sub.items():
            below2 = below.get(key2, _MISSING)
            if below2 is None:
                continue
            if below2 is _MISSING or sub2 is None or not unchanged(sub2, below2):
                return False
    return True


# `unchanged` as one set operation (issue 17, seventh pass): a rule's trie as the set of what may
# move under it (`tokens`), a tick's moves as the set expr.renormalise fills (its `moved`); the
# trie is unchanged when the two are disjoint, tested in C for each of ~20 rules a tick, instead
# of walking every trie against renormalise's `same` in Python. A token is a root (the whole
# root is read; it moved, or something below it did) or a (root, key) pair (that key moved,
# appeared or went), or (root, None) (the root moved whole: appeared, went, changed type).
Token = str | tuple[str, str | None]


def tokens(trie: Paths) -> frozenset[Token]:
    """What renormalise's `moved` holds when something `trie` reads may have moved. Two levels
    deep, as renormalise compares them in the evaluator: below that a key read is taken whole."""
    out: set[Token] = set()
    for key, sub in trie.items():
        if sub is None:
            out.add(key)
        else:
            out.add((key, None))
            out.update((key, key2) for key2 in sub)
    return frozenset(out)


def exact(trie: Paths) -> bool:
    """True when `trie` reads nothing below two levels: then `same` says exactly whether its
    slice moved, and a slice renormalise says moved need not be compared with the last one."""
    return all(sub is None or all(s is None for s in sub.values()) for sub in trie.values())
