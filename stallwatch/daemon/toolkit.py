"""The side-effecting pieces the daemon drives, behind one seam: kill, validate, evidence, alerts.

The real ones live in stallwatch.actions (kill, validate, evidence) and stallwatch.alerts (the
dispatcher); they are imported lazily, when first used, so the daemon starts without them and a
missing optional piece (no evidence module, no alert sinks) degrades to "recorded in the state
database and logged" instead of a crash. Tests pass a Toolkit of their own.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

log = logging.getLogger("stallwatch.daemon")


def _accepted(fn: Callable, **kwargs: Any) -> dict[str, Any]:
    """The subset of kwargs that fn accepts (the action modules grow options over time)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


@dataclass
class Toolkit:
    kill_factory: Callable[..., Any] | None = None
    validate: Callable[..., Any] | None = None
    capture_evidence: Callable[..., Any] | None = None
    dispatcher_factory: Callable[[list[Any]], Any] | None = None
    slurm_job_state: Callable[[str], str | None] | None = None  # job id -> JobState, or None
    _warned: set[str] = field(default_factory=set)

    # -- kill

    def make_kill(self, targets: list[tuple[int, int]], pgid: int | None, *, grace_s: float,
                  clock: Any, dry_run: bool) -> Any:
        factory = self.kill_factory
        if factory is None:
            from stallwatch.actions.kill import KillOperation

            factory = KillOperation
        kw = _accepted(factory, grace_s=grace_s, clock=clock, dry_run=dry_run,
                       kill_wait_s=min(10.0, max(1.0, grace_s)))
        return factory(targets, pgid, **kw)

    # -- validate

    def run_validate(self, outputs: Path, since_wall: float | None, quarantine: Path,
                     **kwargs: Any) -> Any:
        fn = self.validate
        if fn is None:
            from stallwatch.actions.validate import validate_outputs

            fn = validate_outputs
        return fn(outputs, since_wall, quarantine, **_accepted(fn, **kwargs))

    # -- evidence

    def evidence_available(self) -> bool:
        if self.capture_evidence is not None:
            return True
        try:
            from stallwatch.actions.evidence import capture_evidence  # noqa: F401
        except ImportError as e:
            self._warn_once("evidence", f"evidence bundles are off: {e}")
            return False
        return True

    def run_evidence(self, snapshot: Any, verdict: Any, bundle_dir: Path, **kwargs: Any) -> Path:
        fn = self.capture_evidence
        if fn is None:
            from stallwatch.actions.evidence import capture_evidence

            fn = capture_evidence
        return fn(snapshot, verdict, bundle_dir, **_accepted(fn, **kwargs))

    # -- Slurm

    def slurm_state(self, job_id: str) -> str | None:
        fn = self.slurm_job_state
        if fn is None:
            from stallwatch.daemon.slurm import job_state

            fn = job_state
        return fn(job_id)

    # -- alerts

    def make_dispatcher(self, alert_configs: list[Any], **kwargs: Any) -> Any | None:
        factory = self.dispatcher_factory
        if factory is None:
            if not alert_configs:
                return None
            try:
                from stallwatch.alerts import AlertDispatcher  # type: ignore[attr-defined]

                factory = AlertDispatcher
            except ImportError:
                try:
                    from stallwatch.alerts.dispatch import AlertDispatcher  # type: ignore

                    factory = AlertDispatcher
                except ImportError as e:
                    self._warn_once("alerts", f"alert sinks are off (no dispatcher: {e}); "
                                              "alert events are only logged and recorded")
                    return None
            if isinstance(alert_configs, tuple):
                alert_configs = list(alert_configs)
            if alert_configs and isinstance(alert_configs[0], dict):
                self._warn_once("alerts-raw", "the [[alert]] tables were not validated "
                                              "(stallwatch.alerts.config missing): alerts are off")
                return None
        return factory(alert_configs, **_accepted(factory, **kwargs))

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)
