"""The rules stage: a snapshot's variables, CEL conditions, rule files, alert state, timeline tests.

The rules machinery (alerting, expr, rulefile, template, ruletest) knows nothing about probes: it
evaluates rules over whatever nested dict of variables it is given. `features.py` builds that dict
from a probes Snapshot; `diagnose.py` and `history.py` use both. The CLI needs only the two
functions below.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Mapping

from .alerting import (Alert, AlertState, EvalError, Evaluation, Evaluator, EvidenceItem,
                       Transition, Verdict, evaluate_once)
from .expr import Expr, ExprError, ExprEvalError, Vars, compile_expr
from .rulefile import KINDS, SEVERITIES, Rule, RuleLoadError, RuleSet, load_rules
from .tomlpos import Located

if TYPE_CHECKING:
    from .ruletest import TestFailure, TestReport, run_test_file

__all__ = [
    "Alert", "AlertState", "EvalError", "Evaluation", "Evaluator", "EvidenceItem", "Expr",
    "ExprError", "ExprEvalError", "KINDS", "Located", "Rule", "RuleLoadError", "RuleSet",
    "SEVERITIES", "TestFailure", "TestReport", "Transition", "Vars", "Verdict", "check_paths",
    "compile_expr", "evaluate_once", "load_rules", "run_test_file",
]


def check_paths(paths: Iterable[str | Path], schema: Mapping[str, Any] | None = None) -> list[str]:
    """`stallwatch rules check`: every problem as `file:line:column: problem`; [] when valid."""
    try:
        load_rules(paths, schema)
    except RuleLoadError as exc:
        return [str(e) for e in exc.errors]
    return []


def __getattr__(name: str) -> Any:
    """The timeline tests (`stallwatch rules test`) on first use: the daemon never runs them
    (issue 17's RSS)."""
    if name in ("TestFailure", "TestReport", "run_test_file"):
        from . import ruletest

        return getattr(ruletest, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
