"""Properties of the alert state machine over random timelines (hypothesis)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.engine import AlertState, Evaluator, RuleSet, load_rules

F, P, R = AlertState.FIRING, AlertState.PENDING, AlertState.RESOLVED


def _rules(for_s: float, keep_s: float) -> RuleSet:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.toml"
        path.write_text(f'[[rule]]\nname = "r"\nkind = "hang"\ncondition = "c"\nsummary = "s"\n'
                        f"for = {for_s}\nkeep_firing_for = {keep_s}\n")
        return load_rules([path])


# Half-second steps keep the arithmetic exact, so boundaries (>= for) are tested precisely.
timelines = st.lists(st.tuples(st.integers(1, 12).map(lambda n: n / 2), st.booleans()),
                     min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(for_s=st.integers(0, 16).map(lambda n: n / 2), keep_s=st.integers(0, 10).map(lambda n: n / 2),
       timeline=timelines)
def test_for_and_keep_firing_for_invariants(for_s: float, keep_s: float,
                                            timeline: list[tuple[float, bool]]) -> None:
    ev = Evaluator(_rules(for_s, keep_s), resolved_retention_s=1e9)
    t = 0.0
    run_start: float | None = None      # first evaluation of the current run of true ones
    false_since: float | None = None    # first false evaluation after the last true one
    was_firing = False
    for dt, cond in timeline:
        t += dt
        if cond:
            run_start = t if run_start is None else run_start
            false_since = None
        else:
            run_start = None
            false_since = t if false_since is None else false_since
        result = ev.evaluate({"c": cond}, t)
        state = result.alerts[0].state if result.alerts else None
        alert = result.alerts[0] if result.alerts else None

        # Never firing before `for` seconds of continuous truth...
        if state == F and alert is not None and alert.fired_mono == t:
            assert cond and run_start is not None and t - run_start >= for_s
            assert alert.active_mono == run_start
        # ...and always firing after.
        if cond and run_start is not None and t - run_start >= for_s:
            assert state == F
        # Pending means true now and not yet long enough.
        if state == P:
            assert cond and run_start is not None and t - run_start < for_s
        # A false condition keeps an alert firing only within keep_firing_for.
        if state == F and not cond:
            assert false_since is not None and t - false_since < keep_s
        if was_firing and not cond and false_since is not None and t - false_since >= keep_s:
            assert state == R
        if state == R:
            assert not cond
        was_firing = state == F


@settings(max_examples=150, deadline=None)
@given(for_s=st.integers(0, 10).map(lambda n: n / 2), timeline=timelines)
def test_transitions_are_consistent_with_states(for_s: float,
                                                timeline: list[tuple[float, bool]]) -> None:
    ev = Evaluator(_rules(for_s, 0), resolved_retention_s=1e9)
    t, previous = 0.0, None
    allowed = {(None, P), (None, F), (P, F), (P, None), (F, R), (R, P), (R, F)}
    for dt, cond in timeline:
        t += dt
        result = ev.evaluate({"c": cond}, t)
        state = result.alerts[0].state if result.alerts else None
        if state != previous:
            assert (previous, state) in allowed
            assert result.transitions, "a state change must be reported as a transition"
            assert result.transitions[-1].to_state == (state or AlertState.INACTIVE)
        else:
            assert result.transitions == ()
        assert all(tr.at == t for tr in result.transitions)
        previous = state


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abxy"), inner,
                                                                max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(data=st.dictionaries(st.sampled_from(["a", "x", "log"]), json_values, max_size=3))
def test_evaluation_never_raises_on_any_variables(data: dict) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.toml"
        path.write_text(
            '[[rule]]\nname = "r1"\nkind = "hang"\ncondition = "log.idle_s > 2 * x"\n'
            'summary = "{log.idle_s} {a.b}"\nlabels = {k = "{x}"}\n'
            '[[rule]]\nname = "r2"\nkind = "hang"\ncondition = "true"\nsummary = "{a}"\n'
            'evidence = [{signal = "s", each = "a", detail = "{it.b}"}]\n')
        rules = load_rules([path])
    result = Evaluator(rules).evaluate(data, 0.0)
    assert "r2" in {a.rule for a in result.alerts}  # one bad rule never hides another
    assert all(e.rule in ("r1", "r2") for e in result.errors)
