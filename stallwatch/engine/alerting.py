"""Alert state per rule instance, after Prometheus' rules/alerting.go, and the verdict.

inactive -> pending (condition true) -> firing (true for `for` seconds) -> resolved (false, after
`keep_firing_for`). A pending instance whose condition is false once is dropped, so the `for`
timer restarts. Time is the caller's monotonic `now`; nothing here reads a clock, which keeps
replay and tests deterministic.

One owner: `AlertState` is the state type (zero value `unknown`: not evaluated yet; a value
outside it raises) and `_Instance.enter` its only mutator, with the allowed edges as data
(`_EDGES`). The state outlives the `Evaluator` that made it in two ways (docs/rules.md,
"Across reloads and restarts"): `Evaluator.carry_from` copies it across a reload by
rule name and labels (Prometheus' rules/manager.go + group.go `CopyState`), and
`export`/`restore` keep `for` timers across a daemon restart (Prometheus' `RestoreForState`),
bounded by an outage tolerance. Each rule also has a health and a last error (rules/rule.go).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import Field
from collections.abc import Callable, Mapping

from stallwatch.model import Frozen
from stallwatch.vocab import SEVERITY_RANK

from .expr import (ExprError, ExprEvalError, Vars, compile_expr, format_value, normalise,
                   renormalise)
from .expr import Expr
from .inputs import (Paths, Token, conjuncts, exact, merge, paths, pick, tokens,
                     unchanged)
from .rulefile import Rule, RuleSet
from .textbatch import Plain, compile_batch, fill_batch, plain_paths, render_batch

__all__ = [
    "Alert", "AlertState", "EvalError", "Evaluation", "Evaluator", "EvidenceItem",
    "FOR_OUTAGE_TOLERANCE_S", "RuleHealth", "RuleStatus", "Transition", "Verdict",
    "evaluate_once",
]

RESOLVED_RETENTION_S = 900.0  # Prometheus keeps resolved alerts 15 min so receivers see them
# A daemon down longer than this restores no `for` timer: what held before such an outage says
# little about now (Prometheus' --rules.alert.for-outage-tolerance, default 1h, v2.x-3.x).
FOR_OUTAGE_TOLERANCE_S = 3600.0


class AlertState(str, Enum):
    """An alert instance's state. `AlertState("bogus")` raises ValueError: a stored or passed
    state outside this set is a bug or corruption, never silently some state."""
    UNKNOWN = "unknown"          # the zero value: not evaluated yet
    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


# The allowed edges, as data: `_Instance.enter` refuses any other. unknown -> firing is the
# restore of a firing instance after a daemon restart (it goes through pending on the way, so
# the edge is unknown -> pending -> firing at the restored times); resolved -> pending never
# happens in place: a resolved instance whose condition holds again is a new instance.
_EDGES: dict[AlertState, frozenset[AlertState]] = {
    AlertState.UNKNOWN: frozenset({AlertState.PENDING}),
    AlertState.INACTIVE: frozenset({AlertState.PENDING}),
    AlertState.PENDING: frozenset({AlertState.FIRING, AlertState.INACTIVE}),
    AlertState.FIRING: frozenset({AlertState.RESOLVED}),
    AlertState.RESOLVED: frozenset(),
}


class RuleHealth(str, Enum):
    """Prometheus' rules/rule.go RuleHealth: unknown until the rule is evaluated once."""
    UNKNOWN = "unknown"
    OK = "ok"
    ERR = "err"


class RuleStatus(Frozen):
    rule: str
    health: RuleHealth = RuleHealth.UNKNOWN
    last_error: str = ""         # "where: error" when it failed this tick; "" once it passes
    # How many ticks in a row it failed is daemon/watchwarn.py's to count (it turns a streak
    # into a warning); this is the rule's state now.


class EvidenceItem(Frozen):
    signal: str
    detail: str


class Alert(Frozen):
    rule: str
    kind: str
    severity: str
    priority: int
    warning: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    state: AlertState
    # Times are the caller's monotonic `now` (see `Evaluator.evaluate`); `export` turns them
    # into wall-clock anchors for the state database.
    since: float                 # when the current state began
    active_mono: float           # when it went pending
    fired_mono: float | None = None
    resolved_mono: float | None = None
    summary: str = ""
    evidence: tuple[EvidenceItem, ...] = ()
    advice: tuple[str, ...] = ()
    cause: str | None = None


class Transition(Frozen):
    rule: str
    labels: dict[str, str] = Field(default_factory=dict)
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
    labels: dict[str, str] = Field(default_factory=dict)


UNKNOWN = Verdict(kind="unknown", summary="no rule fired: not enough evidence yet")


class Evaluation(Frozen):
    at: float
    verdict: Verdict
    alerts: tuple[Alert, ...] = ()       # pending, firing and recently resolved instances
    warnings: tuple[Alert, ...] = ()     # firing instances of `warning = true` rules
    transitions: tuple[Transition, ...] = ()
    errors: tuple[EvalError, ...] = ()
    health: tuple[RuleStatus, ...] = ()  # one per rule, in rule-file order

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
    state: AlertState = AlertState.UNKNOWN
    active_mono: float = 0.0
    since: float = 0.0
    fired_mono: float | None = None
    resolved_mono: float | None = None
    keep_firing_since: float | None = None
    seen_mono: float = 0.0  # the last evaluation that found its condition true
    text: _Text = field(default_factory=_Text)
    # While kept firing (condition false, within keep_firing_for): the text of the last true
    # evaluation, which `text` shows labelled (`_kept_text`); None otherwise.
    held: _Text | None = None
    shot: Alert | None = None  # snapshot() until the state, the text or the rule changes

    def set_text(self, text: _Text) -> None:
        if text is not self.text:
            self.text, self.shot = text, None

    def enter(self, to: AlertState, at: float) -> AlertState:
        """The only code that changes `state`; returns the state left. An edge not in `_EDGES`
        raises: it would be a bug in this module, not something a rule file can cause."""
        to = AlertState(to)
        before = self.state
        if to not in _EDGES[before]:
            raise ValueError(f"alert {self.rule.name}: no edge {before.value} -> {to.value}")
        self.state, self.since, self.shot = to, at, None
        if to == AlertState.PENDING:
            self.active_mono = at
        elif to == AlertState.FIRING:
            self.fired_mono = at
        elif to == AlertState.RESOLVED:
            self.resolved_mono = at
        return before

    def snapshot(self) -> Alert:
        if self.shot is None:
            r, t = self.rule, self.text
            self.shot = Alert(rule=r.name, kind=r.kind, severity=r.severity,
                              priority=r.priority, warning=r.warning, labels=dict(self.labels),
                              state=self.state, since=self.since, active_mono=self.active_mono,
                              fired_mono=self.fired_mono, resolved_mono=self.resolved_mono,
                              summary=t.summary, evidence=t.evidence, advice=t.advice,
                              cause=t.cause)
        return self.shot


@dataclass(slots=True)
class _Memo:
    """A rule's last evaluation without an error: what it read and what it gave (inputs.py)."""
    cond_in: dict[str, Any] | None  # None: not sliced (`_Reads.exact`), never matched
    active: bool
    labels: tuple[tuple[str, str], ...]
    text_in: dict[str, Any] | None = None  # while active: what its labels and texts read
    text: _Text | None = None
    # While inactive: what its first false conjunct and those before it read (inputs.conjuncts)
    prefix: tuple[Paths, dict[str, Any]] | None = None

    def kept_text(self) -> _Text:
        return self.text or _Text()  # set whenever it was active


@dataclass(frozen=True, slots=True)
class _Reads:
    cond: Paths    # what the condition reads
    text: Paths    # what the labels, summary, evidence, advice and cause read
    every: Paths
    # The condition's `&&` conjuncts, each with what it and those before it read
    conj: tuple[tuple[Expr, Paths], ...] = ()
    # What a CEL context must hold for the condition, labels and texts when the placeholders
    # of `plain` are read from the variables (textbatch.plain_paths); `every` without them
    ctx: Paths = field(default_factory=dict)
    plain: Plain = field(default_factory=dict)
    # `cond`'s and `every`'s tokens, and each conjunct prefix's by its trie's id (what
    # renormalise's `moved` is tested against: inputs.tokens)
    cond_t: frozenset[Token] = frozenset()
    every_t: frozenset[Token] = frozenset()
    conj_t: dict[int, frozenset[Token]] = field(default_factory=dict)
    exact: bool = False  # inputs.exact(cond): a moved condition slice need not be compared


def _reads(rule: Rule) -> _Reads:
    plain = plain_paths(rule) if all(ev.each is None for ev in rule.evidence) else {}
    exprs = [e for _, tpl in rule.labels for e in tpl.exprs] + list(rule.summary.exprs)
    for ev in rule.evidence:
        exprs += [*ev.detail.exprs, *(x for x in (ev.each, ev.when) if x is not None)]
    for tpl in (*rule.advice, *((rule.cause,) if rule.cause is not None else ())):
        exprs += tpl.exprs
    cond, text = paths([rule.condition]), paths(exprs)
    conj: list[tuple[Expr, Paths]] = []
    upto: Paths = {}
    for c in conjuncts(rule.condition):
        upto = merge(upto, paths([c]))
        conj.append((c, upto))
    every = merge(cond, text)
    ctx = merge(cond, paths([e for e in exprs if e not in plain])) if plain else every
    return _Reads(cond, text, every, tuple(conj), ctx, plain, tokens(cond), tokens(every),
                  {id(upto): tokens(upto) for _, upto in conj}, exact(cond))


_Key = tuple[str, tuple[tuple[str, str], ...]]


class _Saved(Frozen):
    """A pending or firing instance as a restarted daemon gets it back: how long it had been
    active (and firing) when the old daemon last evaluated it."""
    active_s: float
    firing_s: float | None = None


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
        self._health: dict[str, RuleStatus] = {r.name: RuleStatus(rule=r.name) for r in rules}
        self._restore: dict[_Key, _Saved] = {}  # used by the first evaluation, then dropped
        self._reads = {r.name: _reads(r) for r in rules}
        self._memo: dict[str, _Memo] = {}
        self._unions: dict[tuple[tuple[str, ...], tuple[str, ...]], Paths] = {}
        # The last variables normalised (a plain dict without odd values), whose unchanged
        # subtrees the next tick's reuse (expr.renormalise); None after any other input.
        self._plain: dict[str, Any] | None = None
        self._raw: dict[str, Any] | None = None  # the variables `_plain` was made of
        self.health_changes = 0  # how many times a rule's health changed: what savers compare
        self._all_ok = -1  # health_changes when every rule was last seen ok
        self._health_shot: tuple[int, tuple[RuleStatus, ...]] | None = None
        self._probes: dict[str, Expr | None] = {}  # rule name -> _conj_probe
        self._batches: dict[str, Expr | None] = {}  # rule name -> textbatch.compile_batch
        self._leans: dict[str, Expr | None] = {}  # the same less its plain placeholders
        self._boths: dict[str, Expr | None] = {}  # rule name -> _both
        # (rule, context, values): the texts' values `_fresh` got with the condition
        self._ready: tuple[Rule, Vars, Any] | None = None  # rule name -> textbatch.compile_batch
        self._having: set[str] = set()  # the rules with instances as this tick began
        # The last verdict and the alert it was made of: an alert snapshot is a new object only
        # when its state or text changed (_Instance.shot), and so is the verdict then.
        self._verdict_of: tuple[Alert, Verdict] | None = None
        # The last tick's snapshots (in `_active`'s order) and the alerts, verdict and warnings
        # made of them: reused while every snapshot is the same object (`_Instance.shot`).
        self._shots: tuple[list[Alert], tuple[Alert, ...], Verdict, tuple[Alert, ...]] | None = None
        self._perm: tuple[tuple[_Key, ...], list[int]] | None = None  # `_active`'s keys, sorted
        # The context of the last tick's fresh rules, kept for the next (`_env`): the roots in it
        # that are current as of that tick, with the slice (trie) each holds, and every root it
        # holds at all (a stale one may only be left where no rule of the tick reads it).
        self._kept: Vars | None = None
        self._kept_roots: Paths = {}
        self._kept_has: set[str] = set()

    # -- state that outlives this evaluator

    def carry_from(self, old: Evaluator) -> int:
        """Take over `old`'s alert state after a reload, by rule name and labels, as Prometheus
        does (rules/group.go CopyState). An instance whose rule is gone is dropped. One whose
        rule changed (condition, `for`, kind, severity, text) keeps its state and timers and is
        judged by the new rule from the next tick on: a condition now false drops a pending
        instance and resolves a firing one (after `keep_firing_for`); a new `for` applies to the
        time already pending. Health carries too. Returns the instances carried."""
        by_name = {r.name: r for r in self.rules}
        for (name, labels), inst in old._active.items():
            rule = by_name.get(name)
            if rule is not None:
                inst.rule, inst.shot = rule, None
                self._active[(name, labels)] = inst
        self._restore = {k: v for k, v in old._restore.items() if k[0] in by_name}
        self._health.update({n: h for n, h in old._health.items() if n in by_name})
        self.health_changes += 1
        self._last = old._last
        return len(self._active)

    def export(self, now: float, now_wall: float) -> list[dict[str, Any]]:
        """Pending and firing instances with wall-clock anchors, for the state database; the
        monotonic clock does not survive a reboot, wall time does."""
        out = []
        for (name, labels), inst in self._active.items():
            if inst.state not in (AlertState.PENDING, AlertState.FIRING):
                continue
            doc: dict[str, Any] = {"rule": name, "labels": dict(labels),
                                   "state": inst.state.value,
                                   "active_at": round(now_wall - (now - inst.active_mono), 3)}
            if inst.fired_mono is not None:
                doc["fired_at"] = round(now_wall - (now - inst.fired_mono), 3)
            out.append(doc)
        return out

    def export_key(self) -> tuple[Any, ...]:
        """All that `export` reads but the clocks: equal keys and the same offset between the
        two clocks give equal docs (daemon/alertmemory.py skips `export` then)."""
        return tuple((key, inst.state, inst.active_mono, inst.fired_mono)
                     for key, inst in self._active.items()
                     if inst.state is AlertState.PENDING or inst.state is AlertState.FIRING)

    def restore(self, docs: list[dict[str, Any]], down_wall: float, now_wall: float, *,
                tolerance_s: float = FOR_OUTAGE_TOLERANCE_S) -> int:
        """Give a restarted daemon the timers of `export`'s docs, saved by a daemon that last
        evaluated at wall time `down_wall`. Bounded, after Prometheus' RestoreForState:
        - an outage longer than `tolerance_s` restores nothing (timers start over);
        - the outage itself does not count as pending time: nothing was observed then, so a
          timer resumes where it stopped (Prometheus shifts activeAt by the outage too);
        - a timer is only taken back by an instance whose condition holds at the first
          evaluation after the restart, with the same rule name and labels: a restored firing
          alert stays firing on fresh evidence, never on old evidence alone.
        Raises ValueError for a doc with an unknown state. Returns the timers kept."""
        outage_s = max(0.0, now_wall - down_wall)
        saved: dict[_Key, _Saved] = {}
        for d in docs:
            state = AlertState(d["state"])
            if state not in (AlertState.PENDING, AlertState.FIRING):
                raise ValueError(f"saved alert {d.get('rule')!r}: state {state.value} is not kept")
            labels = tuple(sorted((str(k), str(v)) for k, v in dict(d["labels"]).items()))
            fired = d.get("fired_at") if state == AlertState.FIRING else None
            saved[(str(d["rule"]), labels)] = _Saved(
                active_s=max(0.0, down_wall - float(d["active_at"])),
                firing_s=None if fired is None else max(0.0, down_wall - float(fired)))
        if outage_s > tolerance_s:
            return 0
        self._restore = {k: v for k, v in saved.items() if k[0] in self._order}
        return len(self._restore)

    def health(self) -> tuple[RuleStatus, ...]:
        if self._health_shot is None or self._health_shot[0] != self.health_changes:
            self._health_shot = (self.health_changes,
                                 tuple(self._health[r.name] for r in self.rules))
        return self._health_shot[1]

    # -- evaluation

    def evaluate(self, data: Mapping[str, Any] | Vars, now: float) -> Evaluation:
        """Every rule over the variables `data` at monotonic time `now`. A dict or list in
        `data` (two levels down) that is the very object the last call's held is taken as
        unchanged (expr.renormalise): change none in place between calls; build anew what
        changed, as features() does."""
        if self._last is not None and now < self._last:
            raise ValueError(f"time went backwards: {now} < {self._last}")
        self._last = now
        self._having = {name for name, _ in self._active}
        errors: list[EvalError] = []
        transitions: list[Transition] = []
        odd: list[type] = []
        same: dict[str, Any] | None = None
        moved: set[Token] | None = None  # what renormalise says moved, where `same` is not None
        if isinstance(data, Vars):
            plain: Any = data
        elif type(data) is dict:
            prev = self._plain
            moved = set()
            plain, same = renormalise(data, prev, odd, raw=self._raw, moved=moved)
            self._plain = None if odd else plain
            self._raw = data  # what `plain` was made of (renormalise reads it with `_plain` alone)
            if prev is None:
                same = moved = None  # nothing to compare with: every rule's slice is compared
        else:
            plain = normalise(data, odd)
            self._plain = None  # the next dict is compared with nothing, not an older tick
        if isinstance(plain, Vars) or odd:
            # Every rule against every variable, as before issue 17: a prepared context, or a
            # value the CEL library may refuse (which must then fail every rule alike).
            self._memo.clear()
            self._plain = None
            whole = self._context(plain, errors)
            if whole is not None:
                for rule in self.rules:
                    self._evaluate_rule(rule, whole, now, errors, transitions)
        else:
            self._evaluate_changed(plain, same, moved, now, errors, transitions)
        self._restore = {}  # Prometheus restores once, at the first evaluation
        self._ready = None
        self._note_health(errors)
        shots = [i.snapshot() for i in self._active.values()]
        last = self._shots
        if last is not None and len(last[0]) == len(shots) and all(map(operator.is_, shots,
                                                                        last[0])):
            # The same snapshots in the same order (none changed state or text): so are the
            # sorted alerts, the verdict and the warnings made of them.
            alerts, verdict, warnings = last[1], last[2], last[3]
        else:
            # Sorted by rule-file order, then labels: a function of the instances' keys alone,
            # so the order found for the same keys is reused (the healthy rule's text, and so
            # its snapshot, changes every tick; the instances do not).
            keys = tuple(self._active)
            perm = self._perm[1] if self._perm is not None and self._perm[0] == keys else None
            if perm is None:
                perm = sorted(range(len(keys)), key=lambda i: (self._order[keys[i][0]],
                                                               sorted(keys[i][1])))
                self._perm = (keys, perm)
            alerts = tuple([shots[i] for i in perm])
            firing = [a for a in alerts if a.state == AlertState.FIRING]
            verdict = self._verdict([a for a in firing if not a.warning])
            warnings = tuple(a for a in firing if a.warning)
            self._shots = (shots, alerts, verdict, warnings)
        # Validated, not model_construct: pydantic 2's validation (Rust) takes half the time
        # of model_construct (Python) for these models (2 µs against 4 µs for an Alert).
        return Evaluation(
            at=now, verdict=verdict, alerts=alerts, warnings=warnings,
            transitions=tuple(transitions), errors=tuple(errors), health=self.health())

    def _verdict(self, firing: list[Alert]) -> Verdict:
        if not firing:
            return UNKNOWN
        best = firing[0] if len(firing) == 1 else _best(firing)
        last = self._verdict_of
        if last is None or last[0] is not best:  # a frozen model: the same one is shared
            last = self._verdict_of = (best, _verdict_from(best))
        return last[1]

    def evaluate_once(self, data: Mapping[str, Any] | Vars, *, ignore_for: bool = True
                      ) -> Evaluation:
        """A one-shot diagnosis with fresh state; this evaluator's state is left alone.

        ignore_for=True treats every `for` as already satisfied: right for rules whose
        conditions test durations the collectors computed (`log.idle_s > 30`).
        """
        return Evaluator(self.rules, ignore_for=ignore_for).evaluate(data, 0.0)

    def _note_health(self, errors: list[EvalError]) -> None:
        if not errors and self._all_ok == self.health_changes:
            return  # every rule was ok and still is
        first: dict[str, EvalError] = {}
        for e in errors:
            first.setdefault(e.rule, e)
        every = first.get("*")  # the variables failed: no rule was evaluated
        for name, old in self._health.items():
            err = first.get(name, every)
            health, last_error = ((RuleHealth.OK, "") if err is None
                                  else (RuleHealth.ERR, f"{err.where}: {err.error}"))
            if (old.health, old.last_error) != (health, last_error):  # a new model only then
                self._health[name] = RuleStatus(rule=name, health=health, last_error=last_error)
                self.health_changes += 1
        if not errors:
            self._all_ok = self.health_changes  # every rule is ok as of this count

    @staticmethod
    def _context(data: Any, errors: list[EvalError], *, normalised: bool = True) -> Vars | None:
        if isinstance(data, Vars):
            return data
        try:
            return Vars(data, normalised=normalised)
        except (ValueError, TypeError) as exc:
            # Variables CEL cannot take: every rule is skipped as if its query failed (state
            # kept, nothing fires or resolves by accident) and the error is reported, never
            # raised out of the tick.
            errors.append(EvalError(rule="*", where="variables", error=str(exc)[:500]))
            return None

    def _evaluate_changed(self, data: dict[str, Any], same: dict[str, Any] | None,
                          moved: set[Token] | None, now: float, errors: list[EvalError],
                          transitions: list[Transition]) -> None:
        """Each rule evaluated again only if what it reads changed since its last evaluation
        (inputs.py); the others give what they gave then, and every instance's timers advance
        (`_advance`) as on any tick: `for` and `keep_firing_for` are timed here, not in CEL.

        A memo's `active` is always what its condition gives for its `cond_in`, and it held at
        the last tick (a rule whose slice moved is evaluated again, or kept false by its first
        false conjunct), so a rule that reads only what `same` says did not change since then
        keeps its memo without slicing anything; an active memo's `text_in` is the last tick's.
        What `same` says is read as one set, `moved` (renormalise's), against each rule's tokens."""
        plan: list[tuple[Rule, _Memo | None, dict[str, Any] | None]] = []
        fresh: list[str] = []
        # Rules false at their last evaluation: the context holds what their conditions read,
        # not their texts (each value in it costs microseconds to build: inputs.py); one that
        # turns true gets its own context with what its labels and texts read as well.
        lean: list[str] = []
        for rule in self.rules:
            reads, memo = self._reads[rule.name], self._memo.get(rule.name)
            was_false = memo is not None and not memo.active
            if memo is not None and moved is not None and (
                    reads.every_t if memo.active else reads.cond_t).isdisjoint(moved):
                plan.append((rule, memo, memo.cond_in))
                continue
            if (was_false and memo is not None and memo.prefix is not None and moved is not None
                    and self._still(reads, memo.prefix[0], moved)):
                # False still, for the conjuncts that made it false, which read nothing that
                # moved: no slice taken. Its memo's `cond_in` may then be older than the last
                # tick's; that only makes a later comparison miss, never match wrongly (a
                # condition given the slice it was given before gives what it gave then).
                plan.append((rule, memo, memo.cond_in))
                continue
            cond_in: dict[str, Any] | None = None
            if moved is not None and reads.exact:
                # `moved` says whether its condition's slice moved, no less deep than it reads:
                # not sliced, nor compared (its memo keeps None, which a comparison never
                # matches). Where it moved, so did its first false conjunct's (had it not, it
                # would be kept above: the prefix reads part of what the condition reads).
                if memo is not None:
                    if not reads.cond_t.isdisjoint(moved) or (
                            memo.active and memo.text_in != pick(data, reads.text)):
                        memo = None
                    else:
                        cond_in = memo.cond_in
            else:
                cond_in = pick(data, reads.cond)
                if memo is not None and memo.cond_in != cond_in:
                    if memo.prefix is not None and pick(data, memo.prefix[0]) == memo.prefix[1]:
                        memo.cond_in = cond_in  # false still: its first false conjunct says so
                    else:
                        memo = None
                elif memo is not None and memo.active and memo.text_in != pick(data, reads.text):
                    memo = None
            plan.append((rule, memo, cond_in))
            if memo is None:
                fresh.append(rule.name)
                if was_false:
                    lean.append(rule.name)
        env = self._env(data, same, self._union(tuple(fresh), tuple(lean)), errors) if fresh else None
        if not fresh:
            self._kept_roots = {}  # none of the kept context is known current after this tick
        if fresh and env is None:
            self._memo.clear()
            self._plain = None
            return
        having = self._having
        for rule, memo, cond_in in plan:
            if memo is not None:
                if memo.active or rule.name in having:  # (else: no instance, none to add)
                    self._apply(rule, memo.active, memo.labels, memo.kept_text, now, transitions)
                continue
            if env is None:  # never: a rule evaluated afresh has a context
                continue
            self._memo.pop(rule.name, None)
            n_errors = len(errors)
            reads = self._reads[rule.name]
            judged = self._fresh(rule, env, rule.name in lean, data, errors)
            if judged is None:
                continue
            active, labels, use, prefix = judged
            texts: list[_Text] = []

            def text(rule: Rule = rule, texts: list[_Text] = texts, env: Vars = use) -> _Text:
                texts.append(self._text(rule, env, errors, data))
                return texts[-1]

            self._apply(rule, active, labels, text, now, transitions)
            if len(errors) == n_errors:  # a rule that failed is evaluated again next tick
                self._memo[rule.name] = _Memo(
                    cond_in, active, labels, pick(data, reads.text) if active else None,
                    texts[-1] if texts else None, None if active else prefix)

    @staticmethod
    def _still(reads: _Reads, prefix: Paths, moved: set[Token]) -> bool:
        """Whether nothing a conjunct prefix of the rule (`_Memo.prefix`) reads moved."""
        toks = reads.conj_t.get(id(prefix))
        return (toks if toks is not None else tokens(prefix)).isdisjoint(moved)

    def _env(self, data: dict[str, Any], same: dict[str, Any] | None, union: Paths,
             errors: list[EvalError]) -> Vars | None:
        """The context of this tick's fresh rules: `pick(data, union)`, as last tick's context
        with only the roots whose slice may have changed added again. Converting a value into
        CEL costs ~7,000 instructions (the library tries it as an int, then a uint, raising a
        Python exception each time, before a double), most of building a context; a healthy
        job's `job`, `activity` and threshold slices do not move from tick to tick.

        A root kept must have held the slice read now at the last tick, which `same` says did
        not change since (one that held more is put again: what is held costs every tick, see
        below). It is built afresh as always on any failure, when a root read
        now is absent from `data` but held (no variable can be taken out of a CEL context, and
        a rule must fail on it as before), and when it holds a root no rule of this tick reads
        (the first CEL run after a change converts the whole context again: cel's
        build_cel_context, so what is held and unread costs every tick)."""
        kept, roots, has = self._kept, self._kept_roots, self._kept_has
        self._kept, self._kept_roots, self._kept_has = None, {}, set()
        if kept is not None and same is not None and has.issubset(union):
            now_roots: Paths = {}
            try:
                for key, sub in union.items():
                    if key not in data:
                        if key in has:
                            break
                        continue
                    if not (key in roots and roots[key] == sub
                            and unchanged({key: sub}, same)):
                        kept.put(key, pick(data, {key: sub})[key])
                        has.add(key)
                    now_roots[key] = sub
                else:
                    self._kept, self._kept_roots, self._kept_has = kept, now_roots, has
                    return kept
            except (ValueError, TypeError):
                pass  # built afresh below, which reports the failure as it always did
        env = self._context(pick(data, union), errors)
        if env is not None:
            self._kept_roots = {k: sub for k, sub in union.items() if k in data}
            self._kept, self._kept_has = env, set(self._kept_roots)
        return env

    def _fresh(self, rule: Rule, env: Vars, lean: bool, data: dict[str, Any],
               errors: list[EvalError]) -> tuple[bool, tuple[tuple[str, str], ...], Vars,
                                                  tuple[Paths, dict[str, Any]] | None] | None:
        """A rule evaluated afresh: active, labels, the context its texts render from, and while
        false its first false conjunct's prefix (`_Memo.prefix`); None when it failed.

        A `lean` rule (false last tick, its context holding what its condition reads alone) is
        most likely false still: its first false conjunct is looked for first (then so is the
        condition: CEL's `&&`, inputs.conjuncts), instead of the whole condition and then its
        conjuncts again. Only an error, a non-bool or every conjunct true evaluates the whole
        condition, as for any rule.

        Any other rule without labels (true last tick, or new) runs its condition and, if it
        holds, its texts in one CEL run (`_both`), which `_text` then reads; a failure of
        either goes the usual way, which says which part failed."""
        reads = self._reads[rule.name]
        prefix = self._first_false(rule, env, data) if lean else None
        if prefix is not None:
            return False, (), env, prefix
        both = self._both(rule) if not lean and not rule.labels else None
        if both is not None:
            try:
                got = both.evaluate(env)
            except ExprEvalError:
                got = None
            if got is False:
                return False, (), env, self._first_false(rule, env, data)
            if type(got) is list:
                self._ready = (rule, env, got)
                return True, (), env, None
        try:
            active = rule.condition.evaluate_bool(env)
        except ExprEvalError as exc:
            errors.append(_error(rule, "condition", exc))
            return None
        if not active:  # (lean: _first_false found no prefix in the same context)
            return False, (), env, None if lean else self._first_false(rule, env, data)
        if lean:  # true now: its labels and texts read more than its condition
            wide = self._context(pick(data, reads.ctx), errors)
            if wide is None:
                return None
            env = wide
        labels = self._labels(rule, env, errors)
        return None if labels is None else (True, labels, env, None)

    def _first_false(self, rule: Rule, env: Vars, data: dict[str, Any]
                     ) -> tuple[Paths, dict[str, Any]] | None:
        """The first conjunct that is false, after only true ones: what they read, and its
        slice; None when every one is true, or one fails or is not a bool.

        Found by one CEL run of `c0 ? (c1 ? 2 : 1) : 0` (CEL's `?:` runs the branch taken
        alone, as the conjuncts one by one would); only when that fails are they run one by
        one, to tell a failure from a non-bool exactly as before."""
        conj = self._reads[rule.name].conj
        if not conj:
            return None
        if rule.name not in self._probes:
            self._probes[rule.name] = _conj_probe(conj)
        probe = self._probes[rule.name]
        if probe is not None:
            try:
                at = probe.evaluate(env)
            except ExprEvalError:
                at = None
            if type(at) is float and 0 <= at <= len(conj) and at == int(at):
                if at == len(conj):
                    return None  # every conjunct true
                upto = conj[int(at)][1]
                return upto, pick(data, upto)
        return _first_false(conj, env, data)

    def _batch(self, rule: Rule) -> Expr | None:
        if rule.name not in self._batches:
            self._batches[rule.name] = compile_batch(rule)
        return self._batches[rule.name]

    def _lean(self, rule: Rule) -> Expr | None:
        """The batch less the placeholders read from the variables (`_Reads.plain`)."""
        if rule.name not in self._leans:
            plain = self._reads[rule.name].plain
            self._leans[rule.name] = compile_batch(rule, plain) if plain else self._batch(rule)
        return self._leans[rule.name]

    def _both(self, rule: Rule) -> Expr | None:
        """`(condition) ? [the texts' values] : false`, compiled once; None without a batch."""
        if rule.name not in self._boths:
            batch = self._lean(rule)
            both = None
            if batch is not None:
                try:
                    both = compile_expr(f"(({rule.condition.source}\n) ? {batch.source} : false)")
                except ExprError:
                    both = None
            self._boths[rule.name] = both
        return self._boths[rule.name]

    def _text(self, rule: Rule, env: Vars, errors: list[EvalError],
              data: dict[str, Any] | None = None) -> _Text:
        """The rule's texts: from one CEL run where that runs without error (textbatch.py;
        the values `_fresh` got with the condition, when it did), else placeholder by
        placeholder, each failure reported.

        With `data` (the variables `env` was sliced from: `_Reads.ctx`), the plain
        placeholders are read from it; placeholder by placeholder, the context then takes
        all that the texts read (`_Reads.every`), as it always did."""
        ready, self._ready = self._ready, None
        plain = self._reads[rule.name].plain if data is not None else None
        batch = self._lean(rule) if data is not None else self._batch(rule)
        if ready is not None and ready[0] is rule and ready[1] is env:
            got = fill_batch(rule, ready[2], plain, data)
        else:
            got = render_batch(rule, batch, env, plain, data) if batch is not None else None
        if got is None:
            if plain:
                wide = self._context(pick(data, self._reads[rule.name].every), [])  # type: ignore[arg-type]
                env = wide if wide is not None else env
            return _render_text(rule, env, errors)
        summary, evidence, advice, cause = got
        return _Text(summary=summary,
                     evidence=tuple(EvidenceItem(signal=s, detail=d) for s, d in evidence),
                     advice=tuple(advice), cause=cause)

    def _union(self, names: tuple[str, ...], lean: tuple[str, ...] = ()) -> Paths:
        """What the rules `names` read; those also in `lean`, their conditions alone."""
        union = self._unions.get((names, lean))
        if union is None:
            union = {}
            for name in names:
                reads = self._reads[name]
                union = merge(union, reads.cond if name in lean else reads.ctx)
            if len(self._unions) > 64:
                self._unions.clear()
            self._unions[(names, lean)] = union
        return union

    # -- one rule

    def _evaluate_rule(self, rule: Rule, env: Vars, now: float, errors: list[EvalError],
                       transitions: list[Transition]) -> None:
        judged = self._judge(rule, env, errors)
        if judged is not None:
            self._apply(rule, *judged, lambda: self._text(rule, env, errors), now, transitions)

    @staticmethod
    def _judge(rule: Rule, env: Vars, errors: list[EvalError]
               ) -> tuple[bool, tuple[tuple[str, str], ...]] | None:
        # A failing rule is skipped for this tick: its instances keep their state, as in
        # Prometheus when a query fails, so a broken rule neither fires nor resolves by accident.
        try:
            active = rule.condition.evaluate_bool(env)
        except ExprEvalError as exc:
            errors.append(_error(rule, "condition", exc))
            return None
        labels = Evaluator._labels(rule, env, errors) if active else ()
        return None if labels is None else (active, labels)

    @staticmethod
    def _labels(rule: Rule, env: Vars, errors: list[EvalError]
                ) -> tuple[tuple[str, str], ...] | None:
        try:
            return tuple((k, tpl.render(env)) for k, tpl in rule.labels)
        except ExprEvalError as exc:
            errors.append(_error(rule, "labels", exc))  # no labels, no identity
            return None

    def _apply(self, rule: Rule, active: bool, labels: tuple[tuple[str, str], ...],
               text: Callable[[], _Text], now: float, transitions: list[Transition]) -> None:
        seen: _Key | None = None
        if active:
            seen = (rule.name, labels)
            inst = self._active.get(seen)
            if inst is None or inst.state == AlertState.RESOLVED:
                inst = _Instance(rule, labels)
                self._active[seen] = inst
                inst.set_text(text())
                saved = self._restore.get((rule.name, tuple(sorted(labels))))
                if saved is None:
                    inst.enter(AlertState.PENDING, now)
                    transitions.append(_transition(inst, AlertState.INACTIVE, now))
                else:  # a timer from before a daemon restart: no transition, nothing new
                    inst.enter(AlertState.PENDING, now - saved.active_s)
                    if saved.firing_s is not None:
                        inst.enter(AlertState.FIRING, now - saved.firing_s)
            else:
                inst.set_text(text())
        elif rule.name not in self._having:
            return  # no instance to advance (an inactive rule adds none)
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
                transitions.append(_transition(inst, inst.enter(AlertState.INACTIVE, now), now))
            elif inst.state == AlertState.RESOLVED:
                if now - (inst.resolved_mono or now) > self.resolved_retention_s:
                    del self._active[key]
            elif inst.state == AlertState.FIRING and not keep:
                if inst.held is not None:  # resolved: the text of its last true evaluation
                    inst.set_text(inst.held)
                    inst.held = None
                transitions.append(_transition(inst, inst.enter(AlertState.RESOLVED, now), now))
            elif keep:
                if inst.held is None:
                    inst.held = inst.text
                inst.set_text(_kept_text(inst.held, now - inst.seen_mono, rule.keep_firing_for_s))
            return
        inst.keep_firing_since = None
        inst.seen_mono = now
        inst.held = None  # (its text was rendered afresh by `_apply`)
        hold = 0.0 if self.ignore_for else rule.for_s
        if inst.state == AlertState.PENDING and now - inst.active_mono >= hold:
            transitions.append(_transition(inst, inst.enter(AlertState.FIRING, now), now))


def evaluate_once(rules: RuleSet, data: Mapping[str, Any] | Vars, *, ignore_for: bool = True
                  ) -> Evaluation:
    return Evaluator(rules, ignore_for=ignore_for).evaluate(data, 0.0)


def _transition(inst: _Instance, before: AlertState, now: float) -> Transition:
    return Transition(rule=inst.rule.name, labels=dict(inst.labels), from_state=before,
                      to_state=inst.state, at=now, alert=inst.snapshot())


def _error(rule: Rule, where: str, exc: ExprEvalError) -> EvalError:
    return EvalError(rule=rule.name, where=where, error=f"{exc.message} in `{exc.source}`")


def _conj_probe(conj: tuple[tuple[Expr, Paths], ...]) -> Expr | None:
    """`c0 ? (c1 ? (c2 ? 3 : 2) : 1) : 0`: the index of the first false conjunct, or their
    number when all hold (the literals are doubles: expr.py rewrites ints)."""
    body = str(len(conj))
    for i in range(len(conj) - 1, -1, -1):
        # newlines: a `//` comment in a conjunct ends there
        body = f"(({conj[i][0].source}\n) ? ({body}) : {i})"
    try:
        return compile_expr(body)
    except ExprError:
        return None


def _first_false(conj: tuple[tuple[Expr, Paths], ...], env: Vars, data: dict[str, Any]
                 ) -> tuple[Paths, dict[str, Any]] | None:
    """The first conjunct that is false, after only true ones: what they read, and its slice."""
    for expr, upto in conj:
        try:
            value = expr.evaluate(env)
        except ExprEvalError:
            return None
        if value is False:
            return upto, pick(data, upto)
        if value is not True:
            return None
    return None


def _kept_text(held: _Text, age_s: float, keep_s: float) -> _Text:
    """A firing alert's text while only `keep_firing_for` keeps it (its condition is false):
    the last true evaluation's, labelled as such. Its words describe a state that held until
    then; shown bare they would claim it still does (healthy's "is making progress" during the
    seconds a hang's `for` runs). Evidence, advice and cause stay as they were: the label on
    the summary says when they were true."""
    summary = (f"until {format_value(round(age_s, 1))} s ago: {held.summary} (no longer holds; "
               f"kept firing up to {format_value(keep_s)} s)")
    return _Text(summary=summary, evidence=held.evidence, advice=held.advice, cause=held.cause)


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


def _best(firing: list[Alert]) -> Alert:
    return min(firing, key=lambda a: (-a.priority, -SEVERITY_RANK[a.severity], a.rule,
                                      sorted(a.labels.items())))


def _verdict_from(best: Alert) -> Verdict:
    return Verdict(kind=best.kind, summary=best.summary, evidence=best.evidence,
                   advice=best.advice, cause=best.cause, rule=best.rule,
                   severity=best.severity, labels=best.labels)
