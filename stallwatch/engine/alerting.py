"""Alert state per rule instance, after Prometheus' rules/alerting.go, and the verdict.

inactive -> pending (condition true) -> firing (true for `for` seconds) -> resolved (false, after
`keep_firing_for`). A pending instance whose condition is false once is dropped, so the `for`
timer restarts. Time is the caller's monotonic `now`; nothing here reads a clock, which keeps
replay and tests deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from stallwatch.model import Frozen

from .expr import ExprEvalError, Vars, prepare
from .rulefile import Rule, RuleSet

__all__ = [
    "Alert", "AlertState", "EvalError", "Evaluation", "Evaluator", "EvidenceItem", "Transition",
    "Verdict", "evaluate_once",
]

RESOLVED_RETENTION_S = 900.0  # Prometheus keeps resolved alerts 15 min so receivers see them
_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


class AlertState(str, Enum):
    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


class EvidenceItem(Frozen):
    signal: str
    detail: str


class Alert(Frozen):
    rule: str
    kind: str
    severity: str
    priority: int
    warning: bool = False
    labels: dict[str, str] = {}
    state: AlertState
    since: float                 # when the current state began
    active_at: float             # when it went pending
    fired_at: float | None = None
    resolved_at: float | None = None
    summary: str = ""
    evidence: tuple[EvidenceItem, ...] = ()
    advice: tuple[str, ...] = ()
    cause: str | None = None


class Transition(Frozen):
    rule: str
    labels: dict[str, str] = {}
    from_state: AlertState
    to_state: AlertState
    at: float
    alert: Alert                 # the instance as it is after this transition


class EvalError(Frozen):
    rule: str
    where: str                   # "condition", "labels", "summary", "evidence[0]", ...
    error: str


class Verdict(Frozen):
    kind: str
    summary: str
    evidence: tuple[EvidenceItem, ...] = ()
    advice: tuple[str, ...] = ()
    cause: str | None = None
    rule: str | None = None
    severity: str | None = None
    labels: dict[str, str] = {}


UNKNOWN = Verdict(kind="unknown", summary="no rule fired: not enough evidence yet")


class Evaluation(Frozen):
    at: float
    verdict: Verdict
    alerts: tuple[Alert, ...] = ()       # pending, firing and recently resolved instances
    warnings: tuple[Alert, ...] = ()     # firing instances of `warning = true` rules
    transitions: tuple[Transition, ...] = ()
    errors: tuple[EvalError, ...] = ()

    def names(self, state: AlertState | str) -> list[str]:
        return sorted({a.rule for a in self.alerts if a.state == state})


@dataclass(slots=True)
class _Text:
    summary: str = ""
    evidence: tuple[EvidenceItem, ...] = ()
    advice: tuple[str, ...] = ()
    cause: str | None = None


@dataclass(slots=True)
class _Instance:
    rule: Rule
    labels: tuple[tuple[str, str], ...]
    state: AlertState
    active_at: float
    since: float
    fired_at: float | None = None
    resolved_at: float | None = None
    keep_firing_since: float | None = None
    text: _Text = field(default_factory=_Text)

    def snapshot(self) -> Alert:
        r, t = self.rule, self.text
        return Alert(rule=r.name, kind=r.kind, severity=r.severity, priority=r.priority,
                     warning=r.warning, labels=dict(self.labels), state=self.state,
                     since=self.since, active_at=self.active_at, fired_at=self.fired_at,
                     resolved_at=self.resolved_at, summary=t.summary, evidence=t.evidence,
                     advice=t.advice, cause=t.cause)


_Key = tuple[str, tuple[tuple[str, str], ...]]


class Evaluator:
    """Holds alert state across evaluations of one rule set (one per job)."""

    def __init__(self, rules: RuleSet, *, resolved_retention_s: float = RESOLVED_RETENTION_S,
                 ignore_for: bool = False):
        self.rules = rules
        self.resolved_retention_s = resolved_retention_s
        self.ignore_for = ignore_for
        self._active: dict[_Key, _Instance] = {}
        self._last: float | None = None
        self._order = {r.name: i for i, r in enumerate(rules)}

    def evaluate(self, data: Mapping[str, Any] | Vars, now: float) -> Evaluation:
        if self._last is not None and now < self._last:
            raise ValueError(f"time went backwards: {now} < {self._last}")
        self._last = now
        errors: list[EvalError] = []
        transitions: list[Transition] = []
        try:
            env: Vars | None = prepare(data)
        except (ValueError, TypeError) as exc:
            # Variables CEL cannot take: every rule is skipped as if its query failed (state
            # kept, nothing fires or resolves by accident) and the error is reported, never
            # raised out of the tick.
            env = None
            errors.append(EvalError(rule="*", where="variables", error=str(exc)[:500]))
        for rule in self.rules if env is not None else ():
            self._evaluate_rule(rule, env, now, errors, transitions)
        alerts = sorted((i.snapshot() for i in self._active.values()),
                        key=lambda a: (self._order[a.rule], sorted(a.labels.items())))
        firing = [a for a in alerts if a.state == AlertState.FIRING]
        return Evaluation(
            at=now, verdict=_verdict([a for a in firing if not a.warning]),
            alerts=tuple(alerts), warnings=tuple(a for a in firing if a.warning),
            transitions=tuple(transitions), errors=tuple(errors))

    def evaluate_once(self, data: Mapping[str, Any] | Vars, *, ignore_for: bool = True
                      ) -> Evaluation:
        """A one-shot diagnosis with fresh state; this evaluator's state is left alone.

        ignore_for=True treats every `for` as already satisfied: right for rules whose
        conditions test durations the collectors computed (`log.idle_s > 30`).
        """
        return Evaluator(self.rules, ignore_for=ignore_for).evaluate(data, 0.0)

    # -- one rule

    def _evaluate_rule(self, rule: Rule, env: Vars, now: float, errors: list[EvalError],
                       transitions: list[Transition]) -> None:
        # A failing rule is skipped for this tick: its instances keep their state, as in
        # Prometheus when a query fails, so a broken rule neither fires nor resolves by accident.
        try:
            active = rule.condition.evaluate_bool(env)
        except ExprEvalError as exc:
            errors.append(_error(rule, "condition", exc))
            return
        try:
            labels = _render_labels(rule, env) if active else ()
        except ExprEvalError as exc:
            errors.append(_error(rule, "labels", exc))  # no labels, no identity
            return
        seen: _Key | None = None
        if active:
            seen = (rule.name, labels)
            inst = self._active.get(seen)
            if inst is None or inst.state == AlertState.RESOLVED:
                inst = _Instance(rule, labels, AlertState.PENDING, active_at=now, since=now)
                self._active[seen] = inst
                inst.text = _render_text(rule, env, errors)
                transitions.append(_transition(inst, AlertState.INACTIVE, now))
            else:
                inst.text = _render_text(rule, env, errors)
        for key, inst in list(self._active.items()):
            if inst.rule is rule:
                self._advance(key, inst, key == seen, now, transitions)

    def _advance(self, key: _Key, inst: _Instance, seen: bool, now: float,
                 transitions: list[Transition]) -> None:
        rule = inst.rule
        if not seen:
            keep = False
            if inst.state == AlertState.FIRING and rule.keep_firing_for_s > 0:
                if inst.keep_firing_since is None:
                    inst.keep_firing_since = now
                keep = now - inst.keep_firing_since < rule.keep_firing_for_s
            if inst.state == AlertState.PENDING:
                del self._active[key]
                inst.state, inst.since = AlertState.INACTIVE, now
                transitions.append(_transition(inst, AlertState.PENDING, now))
            elif inst.state == AlertState.RESOLVED:
                if now - (inst.resolved_at or now) > self.resolved_retention_s:
                    del self._active[key]
            elif inst.state == AlertState.FIRING and not keep:
                inst.state, inst.since, inst.resolved_at = AlertState.RESOLVED, now, now
                transitions.append(_transition(inst, AlertState.FIRING, now))
            return
        inst.keep_firing_since = None
        hold = 0.0 if self.ignore_for else rule.for_s
        if inst.state == AlertState.PENDING and now - inst.active_at >= hold:
            inst.state, inst.since, inst.fired_at = AlertState.FIRING, now, now
            transitions.append(_transition(inst, AlertState.PENDING, now))


def evaluate_once(rules: RuleSet, data: Mapping[str, Any] | Vars, *, ignore_for: bool = True
                  ) -> Evaluation:
    return Evaluator(rules, ignore_for=ignore_for).evaluate(data, 0.0)


def _transition(inst: _Instance, before: AlertState, now: float) -> Transition:
    return Transition(rule=inst.rule.name, labels=dict(inst.labels), from_state=before,
                      to_state=inst.state, at=now, alert=inst.snapshot())


def _error(rule: Rule, where: str, exc: ExprEvalError) -> EvalError:
    return EvalError(rule=rule.name, where=where, error=f"{exc.message} in `{exc.source}`")


def _render_labels(rule: Rule, env: Vars) -> tuple[tuple[str, str], ...]:
    return tuple((k, tpl.render(env)) for k, tpl in rule.labels)


def _render_text(rule: Rule, env: Vars, errors: list[EvalError]) -> _Text:
    """Summary, evidence, advice and cause; a failing placeholder is reported, not fatal."""
    def lenient(tpl: Any, where: str) -> str:
        text, errs = tpl.render_lenient(env)
        errors.extend(_error(rule, where, e) for e in errs)
        return text

    evidence: list[EvidenceItem] = []
    for n, ev in enumerate(rule.evidence):
        where = f"evidence[{n}]"
        try:
            if ev.each is None:
                if ev.when is None or ev.when.evaluate_bool(env):
                    evidence.append(EvidenceItem(signal=ev.signal,
                                                 detail=lenient(ev.detail, where)))
                continue
            shown = hidden = 0
            for item in ev.each.evaluate_list(env):
                env.bind("it", item)
                if ev.when is not None and not ev.when.evaluate_bool(env):
                    continue
                if shown < ev.limit:
                    evidence.append(EvidenceItem(signal=ev.signal,
                                                 detail=lenient(ev.detail, where)))
                    shown += 1
                else:
                    hidden += 1
            if hidden:
                evidence.append(EvidenceItem(signal=ev.signal, detail=f"... and {hidden} more"))
        except ExprEvalError as exc:
            errors.append(_error(rule, where, exc))
    return _Text(
        summary=lenient(rule.summary, "summary"),
        evidence=tuple(evidence),
        advice=tuple(lenient(t, f"advice[{n}]") for n, t in enumerate(rule.advice)),
        cause=lenient(rule.cause, "cause") if rule.cause is not None else None,
    )


def _verdict(firing: list[Alert]) -> Verdict:
    if not firing:
        return UNKNOWN
    best = min(firing, key=lambda a: (-a.priority, -_SEVERITY_RANK[a.severity], a.rule,
                                      sorted(a.labels.items())))
    return Verdict(kind=best.kind, summary=best.summary, evidence=best.evidence,
                   advice=best.advice, cause=best.cause, rule=best.rule,
                   severity=best.severity, labels=best.labels)
