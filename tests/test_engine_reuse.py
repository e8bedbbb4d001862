"""What a tick whose inputs barely moved costs the evaluator: a rule false last tick evaluated by
its conjuncts alone, an unchanged verdict handed on as the same object (issue 17, third pass)."""

from __future__ import annotations

from pathlib import Path

from stallwatch.engine import Evaluator, Vars, load_rules
from stallwatch.engine.expr import Expr

RULE = """
[[rule]]
name = "stall"
kind = "hang"
condition = "job.alive && log.idle_s > 3"
summary = "no progress for {log.idle_s} s in {job.comm}"
"""


def _evaluator(tmp_path: Path, text: str = RULE) -> Evaluator:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return Evaluator(load_rules([path]))


def test_a_rule_false_last_tick_is_judged_by_one_run_of_its_conjuncts(tmp_path, monkeypatch) -> None:
    ran: list[str] = []
    real = Expr.evaluate

    def counting(self, data):
        ran.append(self.source.strip())
        return real(self, data)

    monkeypatch.setattr(Expr, "evaluate", counting)
    ev = _evaluator(tmp_path)
    data = {"job": {"alive": True, "comm": "a"}, "log": {"idle_s": 0}}
    ev.evaluate(data, 0.0)
    ran.clear()
    out = ev.evaluate({**data, "log": {"idle_s": 1}}, 1.0)
    # false last tick, idle_s moved: one run says its second conjunct is the first false one
    # (before this pass: the whole condition twice and its two conjuncts, 4 runs)
    [probe] = ran
    assert "job.alive" in probe and "log.idle_s > 3" in probe and "?" in probe
    assert out.alerts == () and out.errors == ()
    ran.clear()
    out = ev.evaluate({**data, "log": {"idle_s": 5}}, 2.0)
    # every conjunct true: the condition as a whole decides, and the rule fires with its text
    assert ran[:2] == [probe, "job.alive && log.idle_s > 3"]
    assert out.verdict.kind == "hang" and out.verdict.summary == "no progress for 5 s in a"
    reference = Evaluator(ev.rules).evaluate(Vars({**data, "log": {"idle_s": 5}}), 0.0)
    assert out.verdict == reference.verdict


def test_a_conjunct_that_fails_leaves_the_whole_condition_to_decide(tmp_path) -> None:
    ev = _evaluator(tmp_path, RULE.replace("job.alive && log.idle_s > 3",
                                           "job.missing && log.idle_s > 3"))
    data = {"job": {"alive": True, "comm": "a"}, "log": {"idle_s": 0}}
    first = ev.evaluate(data, 0.0)
    second = ev.evaluate({**data, "log": {"idle_s": 1}}, 1.0)
    # `job.missing` fails: CEL may still call the condition false (`&&` absorbs an error next to
    # false) or fail it; whichever it is, the cached path says what a full evaluation says
    for got, t in ((first, 0.0), (second, 1.0)):
        full = Evaluator(ev.rules).evaluate(Vars({**data, "log": {"idle_s": t}}), 0.0)
        assert got.errors == full.errors and got.alerts == full.alerts


def test_an_unchanged_verdict_is_the_same_object_and_a_changed_one_is_new(tmp_path,
                                                                         monkeypatch) -> None:
    ev = _evaluator(tmp_path)
    judged: list[int] = []
    real = Evaluator._verdict

    def counting(self, firing):
        judged.append(len(firing))
        return real(self, firing)

    monkeypatch.setattr(Evaluator, "_verdict", counting)
    data = {"job": {"alive": True, "comm": "a"}, "log": {"idle_s": 5}}
    first = ev.evaluate(data, 0.0)
    again = ev.evaluate({**data, "job": {"alive": True, "comm": "a", "other": 1}}, 1.0)
    assert first.verdict.kind == "hang" and again.verdict is first.verdict
    # the same snapshots: the alerts are not sorted nor the verdict chosen again
    assert judged == [1] and again.alerts[0] is first.alerts[0]
    moved = ev.evaluate({**data, "log": {"idle_s": 6}}, 2.0)
    assert moved.verdict is not first.verdict and moved.verdict.summary == "no progress for 6 s in a"
    assert judged == [1, 1] and [a.summary for a in moved.alerts] == ["no progress for 6 s in a"]
    assert ev.evaluate({**data, "log": {"idle_s": 0}}, 3.0).verdict.kind == "unknown"


# ------------------------------------------------------------ a rule's texts from one CEL run

TRACES = Path(__file__).parent / "data" / "traces"


def _vars_of_traces(every: int = 25, only: str = "*"):
    from stallwatch.engine.features import features
    from stallwatch.probes.snapshot import Snapshot
    from stallwatch.probes.trace import read_trace

    for path in sorted(TRACES.glob(f"{only}.jsonl")):
        _, snaps, _ = read_trace(path)
        for raw in snaps[::every]:
            snap = Snapshot.model_validate({k: v for k, v in raw.items() if k != "type"})
            yield path.stem, features(snap)


def test_the_batched_texts_are_those_rendered_placeholder_by_placeholder() -> None:
    from stallwatch.engine import diagnose
    from stallwatch.engine.alerting import _render_text
    from stallwatch.engine.expr import normalise
    from stallwatch.engine.textbatch import compile_batch, plain_paths, render_batch

    rules = list(diagnose.load(None))
    batches = {r.name: compile_batch(r) for r in rules}
    # and less the placeholders that are paths alone, read from the variables instead
    plains = {r.name: plain_paths(r) for r in rules}
    leans = {r.name: compile_batch(r, plains[r.name]) for r in rules}
    assert sum(len(p) for p in plains.values()) > 40  # most evidence details
    # every default rule but those looping over a list (`each`) has one
    assert {n for n, b in batches.items() if b is None} == {
        r.name for r in rules if any(ev.each is not None for ev in r.evidence)}
    batched = failed = 0
    for _, v in _vars_of_traces():
        env, plain = Vars(v), normalise(v)
        for rule in rules:
            if batches[rule.name] is None:
                continue
            errors: list = []
            one_by_one = _render_text(rule, env, errors)
            got = render_batch(rule, batches[rule.name], env)
            lean = render_batch(rule, leans[rule.name], env, plains[rule.name], plain)
            assert lean == got, rule.name
            if errors:  # a placeholder failed: so does the batch, and the usual way says which
                assert got is None, rule.name
                failed += 1
                continue
            assert got is not None, rule.name
            summary, evidence, advice, cause = got
            assert summary == one_by_one.summary
            assert evidence == [(e.signal, e.detail) for e in one_by_one.evidence]
            assert tuple(advice) == one_by_one.advice and cause == one_by_one.cause
            batched += 1
    # real captures, many rules on each (one whose placeholder fails: the test below)
    assert batched > 250 and failed == 0


def test_a_batch_that_fails_falls_back_to_the_placeholders_and_their_errors(tmp_path) -> None:
    ev = _evaluator(tmp_path, RULE + 'evidence = [{ signal = "x", detail = "{job.nope}" },\n'
                    '  { signal = "y", when = "job.alive", detail = "idle {log.idle_s}" }]\n')
    out = ev.evaluate({"job": {"alive": True, "comm": "a"}, "log": {"idle_s": 5}}, 0.0)
    assert out.verdict.summary == "no progress for 5 s in a"
    assert [(e.signal, e.detail) for e in out.verdict.evidence] == [
        ("x", "{?job.nope}"), ("y", "idle 5")]
    assert [(e.rule, e.where) for e in out.errors] == [("stall", "evidence[0]")]


def test_a_path_alone_whose_value_cel_would_not_give_back_as_is_renders_the_usual_way(
        tmp_path) -> None:
    # A list (a map's order is CEL's), a missing key, a path through a list: the texts and
    # errors of rendering placeholder by placeholder, as before the paths were read directly.
    ev = _evaluator(tmp_path, RULE + 'evidence = [{ signal = "x", detail = "pids {job.pids}" },\n'
                    '  { signal = "y", detail = "{job.pids.first}" },\n'
                    '  { signal = "z", detail = "at {log.where}" }]\n')
    data = {"job": {"alive": True, "comm": "a", "pids": [3, 4]}, "log": {"idle_s": 5}}
    out = ev.evaluate(data, 0.0)
    assert [(e.signal, e.detail) for e in out.verdict.evidence] == [
        ("x", "pids 3, 4"), ("y", "{?job.pids.first}"), ("z", "at {?log.where}")]
    assert [(e.rule, e.where) for e in out.errors] == [("stall", "evidence[1]"),
                                                       ("stall", "evidence[2]")]
    again = ev.evaluate({**data, "log": {"idle_s": 6, "where": "x"}}, 1.0)
    assert [(e.signal, e.detail) for e in again.verdict.evidence] == [
        ("x", "pids 3, 4"), ("y", "{?job.pids.first}"), ("z", "at x")]


def test_the_healthy_rules_texts_take_one_cel_run(monkeypatch) -> None:
    from stallwatch.engine import diagnose

    ran: list[str] = []
    real = Expr.evaluate

    def counting(self, data):
        ran.append(self.source)
        return real(self, data)

    [healthy] = [r for r in diagnose.load(None) if r.name == "healthy"]
    _, v = next(_vars_of_traces(only="healthy"))
    ev = Evaluator(diagnose.load(None))
    env = Vars(v)
    monkeypatch.setattr(Expr, "evaluate", counting)
    text = ev._text(healthy, env, [])
    assert len(ran) == 1 and "is making progress" in text.summary  # was one a placeholder
    assert [e.signal for e in text.evidence][:2] == ["progress", "pace"]


# ------------------------------------------------------- features: parts handed on unchanged

def _snaps(name: str):
    from stallwatch.probes.snapshot import Snapshot
    from stallwatch.probes.trace import read_trace

    _, snaps, _ = read_trace(TRACES / f"{name}.jsonl")
    return [Snapshot.model_validate({k: v for k, v in raw.items() if k != "type"}) for raw in snaps]


def test_a_part_whose_observation_was_handed_on_is_the_same_dict() -> None:
    from stallwatch.engine import features as fmod

    snaps = _snaps("healthy")
    a, b = snaps[3], snaps[4]
    first = fmod.features(a)
    # the collector handed on the kernel and gpu observations of the last tick
    handed = b.model_copy(update={"kernel": a.kernel, "gpu": a.gpu})
    assert a.kernel is not None and not a.kernel.events
    again = fmod.features(handed)
    assert again["kernel"] is first["kernel"] and again["gpu"] is first["gpu"]
    fmod._LAST.clear()
    assert fmod.features(handed) == again  # what a fresh build gives
    # a new observation (same content): built again
    assert fmod.features(b)["kernel"] is not again["kernel"]


def test_a_part_with_events_that_age_is_built_every_time() -> None:
    from stallwatch.engine import features as fmod

    snap = next(s for s in _snaps("oom") if s.kernel is not None and s.kernel.events)
    first = fmod.features(snap)
    assert first["kernel"]["oom_any"] > 0
    later = snap.model_copy(update={"t_wall": snap.t_wall + 3600.0})  # the events aged out
    again = fmod.features(later)
    assert again["kernel"] is not first["kernel"] and again["kernel"]["oom_any"] == 0


def test_a_true_rule_evaluated_again_takes_one_run_for_its_condition_and_texts(
        tmp_path, monkeypatch) -> None:
    ran: list[str] = []
    real = Expr.evaluate

    def counting(self, data):
        ran.append(self.source)
        return real(self, data)

    ev = _evaluator(tmp_path)
    data = {"job": {"alive": True, "comm": "a"}, "log": {"idle_s": 5}}
    ev.evaluate(data, 0.0)
    monkeypatch.setattr(Expr, "evaluate", counting)
    out = ev.evaluate({**data, "log": {"idle_s": 6}}, 1.0)
    [both] = ran  # was the condition, then the texts (one run each since the batch, more before)
    # (the summary's placeholders are paths alone, read from the variables: textbatch.plain_paths)
    assert "job.alive && log.idle_s > 3" in both and both.endswith("? [] : false)")
    assert out.verdict.summary == "no progress for 6 s in a" and out.errors == ()
    ran.clear()
    assert ev.evaluate({**data, "log": {"idle_s": 1}}, 2.0).verdict.kind == "unknown"
    # false: the same run says so, texts not evaluated; then its first false conjunct, kept
    # for the next ticks (_Memo.prefix)
    assert ran[0] == both and len(ran) == 2 and "? (2) : 1" in ran[1]
