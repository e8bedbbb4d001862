"""Names of times say which clock (docs/README.md, "How the code is laid out"): an internal point
in time ends in `_mono` or `_wall`; `*_at` is kept only for public spellings, which are all
wall-clock Unix seconds (docs/contract.md#times). This keeps a new `*_at` from creeping back."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "stallwatch"
AT = re.compile(r"^_?[a-z0-9_]+_at$")

# (module, name): public spellings (wall clock) and the `_at`s that are not times.
KEPT = {
    ("actions/kill.py", "started_at"), ("actions/kill.py", "finished_at"),  # KillReport
    ("alerts/events.py", "started_at"), ("alerts/events.py", "resolved_at"),  # alert events
    ("daemon/state.py", "started_at"),  # open_incident(): the incidents column
    ("probes/gpu.py", "collected_at"), ("probes/gpu.py", "slow_sampled_at"),  # snapshot fields
    ("probes/processes_obs.py", "noticed_at"),  # ExitObs, a snapshot field
    ("commands/demo.py", "fault_at"),  # a sample number (--fault-at)
    ("probes/disks.py", "probe_at"),  # a path: where statvfs is asked
}


def _declared(tree: ast.AST) -> set[str]:
    """Fields, assigned variables and attributes, and parameters: the names a module chooses
    (not keyword arguments or dict keys, which spell someone else's names)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out.add(n.id)
                    elif isinstance(n, ast.Attribute):
                        out.add(n.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.update(a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs)
    return out


def test_internal_times_are_named_by_their_clock() -> None:
    found = set()
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("sglang/"):  # the stand-in server, a side package with its own names
            continue
        found |= {(rel, n) for n in _declared(ast.parse(path.read_text())) if AT.match(n)}
    assert found - KEPT == set(), (
        "a time named *_at: name it by its clock (*_mono or *_wall, docs/README.md); a public "
        "spelling goes in KEPT with its clock in docs/contract.md#times")
    assert KEPT - found == set(), "KEPT lists a name that is gone: take it out"
