"""`stallwatch diagnose`: watch for a few seconds, evaluate the rules, say what is wrong and why.

Read-only: it never signals, kills or writes anything of the job's.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.engine import Evaluation, Evaluator, RuleLoadError, RuleSet, load_rules
from stallwatch.errors import UsageError
from stallwatch.engine.features import features
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.targets import Target

# Nagios plugin convention: diagnose doubles as a monitoring check.
EXIT_OK, EXIT_WARNING, EXIT_CRITICAL, EXIT_UNKNOWN = 0, 1, 2, 3


def builtin_rule_paths() -> list[Path]:
    try:
        root = resources.files("stallwatch._rules")
    except ModuleNotFoundError:
        # Run from a source checkout on PYTHONPATH, not installed: the package-dir mapping of
        # pyproject.toml (rules/ -> stallwatch._rules) exists only in an installed tree.
        root = Path(__file__).resolve().parents[2] / "rules"
        if not (root / "10-faults.toml").is_file():
            raise
    return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".toml"))


_SCHEMA: dict[str, Any] | None = None


def schema() -> dict[str, Any]:
    """Every variable a rule may name: the features of an empty snapshot (all keys present)."""
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = features(Snapshot(t_mono=0.0, t_wall=0.0, host="", target=Target()))
    return _SCHEMA


def load(paths: Iterable[str | Path] | None = None) -> RuleSet:
    """The built-in rules, or the given files/directories instead. Errors → UsageError (exit 3)."""
    chosen = list(paths) if paths else builtin_rule_paths()
    for p in chosen:
        if not Path(p).exists():
            raise UsageError(f"{p}: no such rule file or directory")
    try:
        return load_rules(chosen, schema())
    except RuleLoadError as e:
        raise UsageError("invalid rules:\n" + "\n".join(str(x) for x in e.errors)) from e


def observe(collector, window_s: float, clock: Clock = SYSTEM_CLOCK,
            rules: RuleSet | None = None) -> tuple[Snapshot, Evaluation, dict[str, Any]]:
    """Tick for `window_s` seconds (at least twice, two intervals apart, so rates and deltas
    exist)."""
    ev = Evaluator(rules or load(), ignore_for=True)
    interval = max(0.2, min(1.0, window_s / 4))
    t_end = clock.monotonic() + window_s
    server = getattr(collector, "server", None)
    # Deltas (CPU, the run queue) need ticks that span a real stretch: two intervals. A loaded
    # node may spend most of the window on one tick; then the window stretches, by an interval
    # at a time, until they do.
    min_span_s = min(window_s, 2 * interval)
    first: float | None = None
    while True:
        snap = collector.tick()
        first = snap.t_mono if first is None else first
        v = features(snap)
        evaluation = ev.evaluate(v, snap.t_mono)
        remaining = t_end - clock.monotonic()
        if remaining <= 0 and snap.t_mono - first >= min_span_s:
            return snap, evaluation, v
        now = clock.monotonic()
        until = now + interval if remaining <= 0 else min(now + interval, t_end)
        if server is not None:
            # A health check takes up to 20 s on a busy server: wait for it inside the window.
            server.wait_health(max(0.0, until - clock.monotonic()))
        time.sleep(max(0.0, until - clock.monotonic()))


def exit_code(kind: str, warnings: int) -> int:
    if kind in ("healthy", "finished"):
        return EXIT_WARNING if warnings else EXIT_OK
    if kind == "slow":
        return EXIT_WARNING
    if kind == "unknown":
        return EXIT_UNKNOWN
    return EXIT_CRITICAL


def report(snap: Snapshot, evaluation: Evaluation, v: dict[str, Any], window_s: float) -> dict[str, Any]:
    """The `diagnose --json` document (docs/contract.md, extended)."""
    verdict = evaluation.verdict
    log = v["log"]
    progress = None
    if log["has_progress"]:
        progress = {
            "done": log["done"], "total": log["total"] if log["total_known"] else None,
            "rate_per_s": log["rate_per_s"] if log["rate_per_s"] >= 0 else None,
            "eta_s": log["eta_s"] if log["eta_s"] >= 0 else None,
            "last_progress_age_s": log["idle_s"] if log["idle_known"] else None,
            "last_progress_age_source": log["idle_source"] or None,
            "stall_threshold_s": v["stall_threshold_s"],
            "stall_threshold_why": v["stall_threshold_why"],
            "log": log["path"], "last_line": log["last_line"],
        }
    processes = []
    for p in snap.processes.processes if snap.processes else ():
        processes.append({
            "pid": p.pid, "ppid": p.ppid, "role": p.role, "state": p.state, "wchan": p.wchan,
            "cmdline": p.cmdline, "comm": p.comm, "start_time": p.start_time,
            "rss_bytes": p.rss_bytes, "cpu_util": p.cpu_util, "d_state_for_s": p.d_state_for_s,
            "last_ran_age_s": p.last_ran_age_s,
            "threads": [{"tid": t.tid, "comm": t.comm, "state": t.state, "wchan": t.wchan,
                         "syscall": t.syscall, "file": t.syscall_file, "stack": list(t.stack or ()),
                         "last_ran_age_s": t.last_ran_age_s} for t in p.threads],
        })
    exited = [e.model_dump(mode="json") for e in (snap.processes.exited if snap.processes else ())]
    gpus = [d.model_dump(mode="json") for d in (snap.gpu.devices if snap.gpu else ())]
    disks = [p.model_dump(mode="json") for p in (snap.disks.paths if snap.disks else ())]
    return {
        "verdict": {"kind": verdict.kind, "summary": verdict.summary,
                    "evidence": [e.model_dump() for e in verdict.evidence],
                    "advice": list(verdict.advice), "cause": verdict.cause, "rule": verdict.rule,
                    "severity": verdict.severity},
        "progress": progress,
        "processes": processes,
        "exited": exited,
        "gpus": gpus,
        "gpu_status": snap.gpu.status if snap.gpu else None,
        "disks": disks,
        "server": snap.server.model_dump(mode="json") if snap.server else None,
        "warnings": [{"rule": w.rule, "kind": w.kind, "summary": w.summary,
                      "advice": list(w.advice)} for w in evaluation.warnings],
        "firing": [a.rule for a in evaluation.alerts if a.state == "firing" and not a.warning],
        "rule_errors": [f"{e.rule}: {e.where}: {e.error}" for e in evaluation.errors],
        "probes": [r.model_dump(mode="json") for r in snap.probes],
        "target": snap.target.model_dump(mode="json"),
        "host": snap.host,
        "at_wall": snap.t_wall,
        "window_s": window_s,
    }

