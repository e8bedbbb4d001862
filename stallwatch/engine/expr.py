"""Safe expressions: CEL through the `cel` package (Rust core), never Python's eval.

stallwatch reads every number as a double, like PromQL and like CEL's own JSON mapping. CEL does
not convert between int and double in arithmetic (`1.5 * 2` is an error), and a probe may report
the same variable as 40 one tick and 40.5 the next; without one numeric type a rule such as
`log.idle_s > 2 * threshold_s` would fail on some ticks only. So:

* variables: every Python int (not bool) is turned into a float before evaluation;
* sources: integer literals are rewritten as double literals (`2` -> `2.0`), except inside
  `[...]` indexes (CEL indexes lists with ints), `{...}` map literals (CEL map keys cannot be
  doubles) and right after `%` (ints only). Error positions refer to the source as written.

What stays int: `size()`, `int()` and indexes. Comparisons mix int and double freely in this
library (`size(x) > 2.5` works), arithmetic does not: `double(size(x)) * 2` is the spelling.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import re
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from collections.abc import Iterable, Mapping


def _load_cel() -> ModuleType:
    """The `cel` package's Rust extension alone. The package's __init__ also imports its REPL
    (typer, rich, prompt_toolkit, pygments: 400 modules, +28 MB of RSS in the daemon) for a
    command line we never use; only compile() and Context() are needed."""
    if "cel.cel" in sys.modules:
        return sys.modules["cel.cel"]
    try:
        spec = importlib.util.find_spec("cel")  # finds the package without running __init__
        where = list(spec.submodule_search_locations or []) if spec else []
        found = importlib.machinery.FileFinder(
            where[0], (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
        ).find_spec("cel.cel") if where else None
        if found is None or found.loader is None:
            raise ImportError("no extension module in the cel package")
        mod = importlib.util.module_from_spec(found)
        found.loader.exec_module(mod)
        if not (hasattr(mod, "compile") and hasattr(mod, "Context")):
            raise ImportError("the cel extension lacks compile/Context")
        return mod
    except Exception:  # noqa: BLE001 - any surprise in the layout: the ordinary import
        import cel

        return cel


cel = _load_cel()

__all__ = [
    "Expr",
    "ExprError",
    "ExprEvalError",
    "Vars",
    "compile_expr",
    "format_value",
    "line_col",
    "normalise",
    "prepare",
    "renormalise",
]


class ExprError(Exception):
    """A compile-time problem; line and column are 1-based within the expression, or None."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None):
        super().__init__(message if line is None else f"{line}:{column}: {message}")
        self.message = message
        self.line = line
        self.column = column

    def offset_in(self, source: str) -> int | None:
        """Character offset of (line, column) in source, for callers that embed expressions."""
        if self.line is None or self.column is None:
            return None
        lines = source.split("\n")
        if self.line > len(lines):
            return len(source)
        return sum(len(x) + 1 for x in lines[: self.line - 1]) + self.column - 1


class ExprEvalError(Exception):
    """An evaluation problem (missing key, wrong type, ...): the expression, then why."""

    def __init__(self, message: str, source: str = ""):
        super().__init__(message)
        self.message = message
        self.source = source


# --------------------------------------------------------------------------- tokens

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<str>(?:[rR][bB]?|[bB][rR]?)?
        (?:'''(?:\\.|[^\\])*?'''|\"\"\"(?:\\.|[^\\])*?\"\"\"
          |'(?:\\.|[^\\'\n])*'|"(?:\\.|[^\\"\n])*"))
  | (?P<num>0[xX][0-9a-fA-F]+[uU]?|\d+\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+
          |\.\d+(?:[eE][+-]?\d+)?|\d+[uU]?)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>\S)
    """,
    re.VERBOSE | re.DOTALL,
)

# Names that look like identifiers but are not variables.
_NOT_VARIABLES = frozenset(["true", "false", "null", "in", "int", "uint", "double", "bool", "string", "bytes",
                            "list", "map", "null_type", "type", "dyn"])
_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str
    text: str
    start: int


def _tokens(source: str) -> list[_Tok]:
    return [
        _Tok(m.lastgroup or "op", m.group(), m.start())
        for m in _TOKEN.finditer(source)
        if m.lastgroup != "ws"
    ]


def _is_int_literal(text: str) -> bool:
    return text.isdigit() or (text[:2].lower() == "0x" and text[-1] not in "uU")


def _doubles(source: str, toks: list[_Tok]) -> str:
    """The source with integer literals turned into double literals (see module docstring)."""
    out: list[str] = []
    last = 0
    stack: list[str] = []  # "(", "index", "list", "map"
    prev: _Tok | None = None
    for t in toks:
        if t.kind == "op" and t.text == "[":
            ends_operand = prev is not None and (
                prev.kind in ("num", "str")
                or (prev.kind == "ident" and prev.text != "in")
                or prev.text in (")", "]", "}")
            )
            stack.append("index" if ends_operand else "list")
        elif t.kind == "op" and t.text in "({":
            stack.append("(" if t.text == "(" else "map")
        elif t.kind == "op" and t.text in ")]}" and stack:
            stack.pop()
        elif t.kind == "num" and _is_int_literal(t.text):
            # CEL's % is defined on ints only, so `int(x) % 2` keeps its int.
            modulo = prev is not None and prev.text == "%"
            if "index" not in stack and "map" not in stack and not modulo:
                out.append(source[last : t.start])
                base = 16 if t.text[:2].lower() == "0x" else 10
                out.append(f"{int(t.text, base)}.0")
                last = t.start + len(t.text)
        prev = t
    out.append(source[last:])
    return "".join(out)


def _bound_names(toks: list[_Tok]) -> set[str]:
    """Variables bound by comprehension macros: the `p` in `procs.exists(p, p.state == 'D')`."""
    bound = set()
    for i in range(len(toks) - 4):
        a, b, c, d, e = toks[i : i + 5]
        if (a.text == "." and b.kind == "ident" and b.text in _MACROS and c.text == "("
                and d.kind == "ident" and e.text == ","):
            bound.add(d.text)
    return bound


@dataclass(frozen=True, slots=True)
class Reference:
    """A variable path as written (`log.idle_s`), with the offset of its first character."""

    path: tuple[str, ...]
    offset: int


def _references(toks: list[_Tok]) -> list[Reference]:
    refs = []
    i = 0
    while i < len(toks):
        t = toks[i]
        after_dot = i > 0 and toks[i - 1].text == "."
        is_call = i + 1 < len(toks) and toks[i + 1].text == "("
        if t.kind != "ident" or after_dot or is_call or t.text in _NOT_VARIABLES:
            i += 1
            continue
        path = [t.text]
        j = i + 1
        while (j + 1 < len(toks) and toks[j].text == "." and toks[j + 1].kind == "ident"
               and not (j + 2 < len(toks) and toks[j + 2].text == "(")):
            path.append(toks[j + 1].text)
            j += 2
        refs.append(Reference(tuple(path), t.start))
        i = j
    return refs


# --------------------------------------------------------------------------- values

def safe_text(text: str) -> str:
    """`text` as valid UTF-8, a name's undecodable bytes as `\\xff` escapes.

    Python hands file names it cannot decode over with lone surrogates (surrogateescape), and the
    CEL library refuses such a string, which failed every rule of the job on every tick: a job's
    user who names an output file `b'\\xff'` would never be judged (issue 22 #12). The bytes are
    kept, as text a person can read."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that no undecodable byte made
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def normalise(value: Any, odd: list | None = None) -> Any:
    """Ints become floats all the way down (see module docstring); containers become lists/dicts.

    With `odd`, the type of every value left as it is (not a plain str, number, bool, None,
    bytes, dict, list, tuple or set: the CEL library may refuse it) and of every map key that is
    not a str is appended to it: the evaluator then builds the whole context, as before issue 17,
    so that such a value fails every rule alike."""
    # Exact types first: this runs over every variable every tick, and isinstance against the
    # typing ABCs below is slow (bench/: docs/performance.md).
    t = type(value)
    if t is str:
        return value if value.isascii() else safe_text(value)
    if t is float or t is bool or value is None:
        return value
    if t is int:
        return float(value)
    if t is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                if odd is not None:
                    odd.append(type(k))
            elif not k.isascii():
                k = safe_text(k)
            tv = type(v)  # the common leaves inline: a call per value was half the cost
            if tv is float or tv is bool or v is None or (tv is str and v.isascii()):
                out[k] = v
            elif tv is int:
                out[k] = float(v)
            else:
                out[k] = normalise(v, odd)
        return out
    if t is list or t is tuple:
        return [normalise(v, odd) for v in value]
    if isinstance(value, str):
        return safe_text(str(value))
    if isinstance(value, bool) or value is None or isinstance(value, (float, bytes)):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, Mapping):
        return {k: normalise(v, odd) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalise(v, odd) for v in value]
    if isinstance(value, (set, frozenset)):
        return [normalise(v, odd) for v in sorted(value, key=repr)]
    if odd is not None:
        odd.append(t)
    return value


_MISSING = object()


def renormalise(value: dict[str, Any], prev: dict[str, Any] | None, odd: list,
                depth: int = 2, raw: dict[str, Any] | None = None, moved: set | None = None,
                _at: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`normalise(value, odd)` of a dict, reusing the subtrees of `prev` (the last call's result)
    that equal `value`'s, `depth` levels down; and the tree of what did not change: key -> None
    (the whole value equals the last one) or key -> the same tree one level down (a dict some of
    whose keys changed). A key that is absent from it changed, appeared or went.

    The rules' variables are ~6 KB rebuilt every tick, most of which is what it was (a healthy
    job's GPU, server, kernel and disk parts): normalising them again was most of what an
    evaluation cost (issue 17), and what did not change needs no rule evaluated again.

    "Equal" is Python's `==`, as the evaluator's memo of each rule's inputs compares them
    (so `True` and `1.0` are alike); only plain dicts and lists are reused, and a value of a type
    `normalise` reports in `odd` is reused never: pass prev=None after a call that found one.

    `raw` is the last call's `value` (with its `prev`): a dict or list of `value` that is the very
    object it held is taken as unchanged without comparing it. So nothing may change such a
    value in place between calls: features() hands on the parts that did not change that way
    (the job's, the server's, a process list; issue 17, sixth pass), and builds the rest anew.

    `moved` (a set) is given what moved, as inputs.tokens names it, two levels down: a key
    absent from `same`'s tree, or that went, is there (k, and (k, None) unless it is a dict
    compared key by key; (k, k2) one level down). What moved deeper is its (k, k2) moving."""
    out: dict[str, Any] = {}
    same: dict[str, Any] = {}
    last: dict[str, Any] = prev if prev is not None else {}
    was: dict[str, Any] = raw if raw is not None and prev is not None else {}
    new = 0  # keys not in `last`: with len(last), whether any of it went
    for k, v in value.items():
        p = last.get(k, _MISSING)
        tv = type(v)
        if (tv is dict or tv is list) and p is not _MISSING and was.get(k) is v:
            out[k] = p  # (a key of `was` is one of `last` too: the same call made both)
            same[k] = None
            continue
        if p is _MISSING or type(k) is not str:  # (a key of `last` is valid text already)
            if type(k) is not str:
                odd.append(type(k))
            elif not k.isascii():
                k = safe_text(k)
                p = last.get(k, _MISSING)
            new += p is _MISSING
        if tv is float or tv is bool or v is None or (
                tv is str and ((type(p) is str and p == v) or v.isascii())):
            # a plain leaf, most of what a tick brings: compared as below, in one step (a
            # string equal to last tick's is valid text: that one was normalised)
            if type(p) is tv and p == v:
                out[k] = p
                same[k] = None
            else:
                out[k] = v
                if moved is not None:
                    _move(moved, k, _at)
            continue
        if tv is int:
            n = float(v)
        elif (tv is dict or tv is list) and type(p) is tv and v == p:
            out[k] = p
            same[k] = None
            continue
        elif tv is dict and depth > 1 and type(p) is dict:
            below = was.get(k)
            if moved is not None and _at is not None:  # (three levels down: moved whole)
                _move(moved, k, _at)
            out[k], same[k] = renormalise(v, p, odd, depth - 1,
                                          below if type(below) is dict else None,
                                          moved if _at is None else None, k)
            if moved is not None and _at is None:
                moved.add(k)  # (what moved below it is there as (k, k2))
            continue
        else:
            n = normalise(v, odd)
        if type(p) is type(n) and p == n:  # strictly at this level: True is not 1.0 here
            n, same[k] = p, None
        elif moved is not None:
            _move(moved, k, _at)
        out[k] = n
    if moved is not None and len(out) - new < len(last):
        for k in last.keys() - out.keys():  # went
            _move(moved, k, _at)
    return out, same


def _move(moved: set, key: str, at: str | None) -> None:
    if at is None:
        moved.add(key)
        moved.add((key, None))
    else:
        moved.add((at, key))


class Vars:
    """Variables prepared once per evaluation.

    Building a CEL context converts the whole nested dict into CEL values (milliseconds for a
    big process list); executing against it is sub-microsecond. So a tick prepares once and
    evaluates every rule against the same Vars.
    """

    __slots__ = ("_ctx",)

    def __init__(self, data: Mapping[str, Any], *, normalised: bool = False):
        self._ctx = cel.Context(variables=data if normalised else normalise(data))

    def bind(self, name: str, value: Any) -> None:
        # The context is shared and CEL has no scopes of ours, so binding overwrites in place.
        # Only `it` is bound this way, and rule loading refuses `it` outside evidence `each`.
        self._ctx.add_variable(name, normalise(value))

    def put(self, name: str, value: Any) -> None:
        """Set (or replace) one variable, already normalised: how the evaluator brings a kept
        context up to date root by root. Raises what building a context with it raises."""
        self._ctx.add_variable(name, value)


def prepare(data: Mapping[str, Any] | Vars) -> Vars:
    return data if isinstance(data, Vars) else Vars(data)


# --------------------------------------------------------------------------- compile / eval

_POSITION = re.compile(r"ERROR: <input>:(\d+):(\d+): ([^\n]*)")
_UNDEFINED = re.compile(r"Undefined variable or function: '([^']*)'")


def _eval_message(exc: Exception) -> str:
    text = str(exc.args[0]) if exc.args else str(exc)
    if isinstance(exc, KeyError):
        return f"no such key '{text}'"
    if isinstance(exc, ZeroDivisionError):
        return "division by zero"
    m = _UNDEFINED.search(text)
    if m:
        return f"undeclared reference '{m.group(1)}'"
    if isinstance(exc, TypeError):
        # The library's messages are long tutorials; the first sentence says what failed, and
        # the likely cause here is an int from size()/int() meeting our doubles.
        first = text.split(". ", 1)[0].rstrip(".")
        if "int" in first or "overload" in first:
            first += " (numbers are doubles; size() and int() return ints: wrap them in double())"
        return first
    return text or type(exc).__name__


@dataclass(frozen=True, slots=True, eq=False)
class Expr:
    """A compiled expression. `source` is as written; the program runs the numeric rewrite."""

    source: str
    references: tuple[Reference, ...] = field(repr=False)
    bound: frozenset[str] = field(repr=False)
    _program: Any = field(repr=False)

    @property
    def root_names(self) -> frozenset[str]:
        return frozenset(r.path[0] for r in self.references) - self.bound

    def evaluate(self, data: Mapping[str, Any] | Vars) -> Any:
        try:
            return self._program.execute(prepare(data)._ctx)
        except Exception as exc:  # the library raises many types; none may escape a tick
            raise ExprEvalError(_eval_message(exc), self.source) from exc

    def evaluate_bool(self, data: Mapping[str, Any] | Vars) -> bool:
        value = self.evaluate(data)
        if not isinstance(value, bool):
            raise ExprEvalError(f"expected a bool, got {_cel_type(value)}", self.source)
        return value

    def evaluate_list(self, data: Mapping[str, Any] | Vars) -> list[Any]:
        value = self.evaluate(data)
        if not isinstance(value, list):
            raise ExprEvalError(f"expected a list, got {_cel_type(value)}", self.source)
        return value


def _cel_type(value: Any) -> str:
    names = {bool: "bool", int: "int", float: "double", str: "string", bytes: "bytes",
             list: "list", dict: "map", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _compile_program(source: str) -> Any:
    try:
        return cel.compile(source)
    except Exception as exc:  # noqa: BLE001 - the CEL library raises its own types, re-raised as ExprError
        text = str(exc)
        m = _POSITION.search(text)
        if m:
            raise ExprError(m.group(3).strip(), int(m.group(1)), int(m.group(2))) from None
        raise ExprError(text.strip() or "invalid expression") from None


def compile_expr(
    source: str,
    *,
    names: Mapping[str, Any] | None = None,
    extra_names: Iterable[str] = (),
    reserved: Mapping[str, str] | None = None,
) -> Expr:
    """Compile `source`; raise ExprError with a position where one is known.

    With `names` (a nested dict of known variables: a dict value lists its keys exhaustively,
    anything else is a leaf), references to unknown variables are refused here rather than
    failing on every tick. `extra_names` are variables bound by the caller (e.g. `it`);
    `reserved` maps names that must not be used here to the reason why.
    """
    if not source.strip():
        raise ExprError("empty expression", 1, 1)
    toks = _tokens(source)
    try:
        program = cel.compile(_doubles(source, toks))
    except Exception:  # noqa: BLE001 - re-raised as ExprError with the source's positions
        _compile_program(source)  # raises, with positions that refer to the source as written
        raise ExprError("internal: the numeric rewrite broke a valid expression") from None
    expr = Expr(source, tuple(_references(toks)), frozenset(_bound_names(toks)), program)
    extra = frozenset(extra_names)
    for ref in expr.references:
        root = ref.path[0]
        if reserved and root in reserved and root not in extra and root not in expr.bound:
            raise ExprError(reserved[root], *line_col(source, ref.offset))
    if names is not None:
        _check_names(expr, names, extra)
    return expr


def line_col(source: str, offset: int) -> tuple[int, int]:
    line = source.count("\n", 0, offset) + 1
    return line, offset - (source.rfind("\n", 0, offset) + 1) + 1


def _check_names(expr: Expr, names: Mapping[str, Any], extra: frozenset[str]) -> None:
    for ref in expr.references:
        root = ref.path[0]
        if root in expr.bound or root in extra:
            continue
        node: Any = names
        for depth, key in enumerate(ref.path):
            if not isinstance(node, Mapping):
                break
            if key not in node:
                line, col = line_col(expr.source, _segment_offset(expr.source, ref, depth))
                dotted = ".".join(ref.path[: depth + 1])
                raise ExprError(f"undeclared reference '{dotted}'{_suggest(key, node)}", line, col)
            node = node[key]


def _segment_offset(source: str, ref: Reference, depth: int) -> int:
    """Offset of path segment `depth` of ref, so `log.idel_s` points at `idel_s`."""
    pos = ref.offset
    for key in ref.path[1 : depth + 1]:
        pos = source.index(key, source.index(".", pos))
    return pos


def _suggest(key: str, known: Mapping[str, Any]) -> str:
    import difflib

    close = difflib.get_close_matches(key, [str(k) for k in known], n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def format_value(value: Any) -> str:
    """How a value reads in a summary or evidence line: 41.0 -> "41", 1.0234 -> "1.023"."""
    t = type(value)  # the exact types first: a text renders ~15 values a tick
    if t is str:
        return value
    if t is float:
        return _format_float(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _format_float(value)
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return ", ".join(format_value(v) for v in value)
    if isinstance(value, dict):
        items = (f"{format_value(k)}: {format_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return str(value)


def _format_float(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    if abs(value) < 1 or abs(value) >= 1e15:
        return format(value, ".3g")
    return f"{value:.3f}".rstrip("0").rstrip(".")
