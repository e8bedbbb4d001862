"""Offline re-evaluation of a recorded trace: the same features and rules as live, same clock."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from pydantic import ValidationError

from stallwatch.engine import diagnose as dg
from stallwatch.engine import Evaluator
from stallwatch.errors import UsageError
from stallwatch.engine.features import features
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.trace import read_trace


def evaluate_trace(path: Path, rules: Iterable[Path] | None = None) -> tuple[dict, list[dict[str, Any]], list[dict]]:
    """(header, one row per snapshot, events). Each row: t_s (since the first snapshot), t_wall,
    kind, rule, summary, evidence, advice, cause, firing, pending, warnings."""
    header, snaps, events = read_trace(path)
    ev = Evaluator(dg.load(rules))
    rows: list[dict[str, Any]] = []
    t0 = None
    for i, raw in enumerate(snaps):
        raw = {k: v for k, v in raw.items() if k != "type"}
        try:
            snap = Snapshot.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            raise UsageError(f"{path}: snapshot {i + 1} does not fit this stallwatch: "
                             f"{first['loc']}: {first['msg']}") from e
        t0 = snap.t_mono if t0 is None else t0
        res = ev.evaluate(features(snap), snap.t_mono)
        rows.append({
            "t_s": round(snap.t_mono - t0, 3), "t_wall": snap.t_wall,
            "kind": res.verdict.kind, "rule": res.verdict.rule, "summary": res.verdict.summary,
            "cause": res.verdict.cause,
            "evidence": [e.model_dump() for e in res.verdict.evidence],
            "advice": list(res.verdict.advice),
            "firing": res.names("firing"), "pending": res.names("pending"),
            "warnings": [w.rule for w in res.warnings],
            "errors": [f"{e.rule}: {e.error}" for e in res.errors],
        })
    return header, rows, events


def replay_trace(path: Path, rules: Iterable[Path] | None = None) -> list[dict[str, Any]]:
    _header, rows, events = evaluate_trace(path, rules)
    return _changes(rows, events)


def _changes(rows: list[dict[str, Any]], events: list[dict]) -> list[dict[str, Any]]:
    """Collapse per-snapshot rows into verdict changes, with the trace's own events in between."""
    out: list[dict[str, Any]] = []
    marks = sorted((e for e in events if "wall" in e), key=lambda e: e["wall"])
    for row in rows:
        while marks and marks[0]["wall"] <= row["t_wall"]:
            m = marks.pop(0)
            out.append({"t_s": row["t_s"], "t_wall": m["wall"], "event": m.get("phase") or m.get("kind")})
        if not out or out[-1].get("kind") != row["kind"] or "event" in out[-1]:
            last_kind = next((o["kind"] for o in reversed(out) if "kind" in o), None)
            if last_kind != row["kind"]:
                out.append(row)
    return out


def print_timeline(timeline: list[dict[str, Any]], as_json: bool) -> None:
    for row in timeline:
        if as_json:
            sys.stdout.write(json.dumps(row, default=str) + "\n")
        elif "event" in row:
            print(f"{row['t_s']:>8.1f}s  -- {row['event']} --")
        else:
            print(f"{row['t_s']:>8.1f}s  {row['kind']:<12} {row['summary']}")
            for e in row["evidence"][:3]:
                print(f"{'':>22}{e['signal']}: {e['detail']}")
