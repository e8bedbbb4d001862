"""The pure parts behind `stallwatch run`: the history and its sparklines, the one-liner's
config (its TOML loads into the same Config), the footer's and plain lines' text."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.daemon.config import parse_config
from stallwatch.errors import UsageError
from stallwatch.engine.history import (BARS, NO_DATA, History, Sample, buckets, from_docs, series,
                                spark, sparkline_text, sparklines)
from stallwatch.commands.live import footer_text, plain_line
from stallwatch.commands.oneliner import OneLiner, alert_table, job_name, to_toml


# ------------------------------------------------------------------------------------ history

def test_spark_scales_to_the_top_and_leaves_gaps_blank() -> None:
    assert spark([0, 1, 2, 4]) == BARS[0] + BARS[2] + BARS[4] + BARS[-1]
    assert spark([None, 0.0, None]) == NO_DATA + BARS[0] + NO_DATA
    assert spark([0.0, 0.0]) == BARS[0] * 2  # all zero: flat at the bottom, not blank


def test_rates_come_from_counters_and_never_across_a_reset() -> None:
    s = [Sample(t=0, done=0, io_bytes=0), Sample(t=2, done=10, io_bytes=4096),
         Sample(t=3, done=2, io_bytes=100), Sample(t=4, done=5, io_bytes=200)]
    ser = series(s)
    assert [v for _, v in ser["rate"]] == [None, 5.0, None, 3.0]  # the restart: no rate
    assert [v for _, v in ser["io"]] == [None, 2048.0, None, 100.0]


def test_buckets_average_by_time_hold_over_jitter_and_show_gaps() -> None:
    pts = [(0.0, 1.0), (1.0, 3.0), (9.0, 8.0)]
    # sampled every second, then nothing for 8 s: a bucket just after a sample holds it (tick
    # jitter), the ones further on are gaps
    assert buckets(pts, end_t=10.0, window_s=10.0, width=5) == [2.0, 3.0, None, None, 8.0]
    jittery = [(0.0, 1.0), (1.9, 1.0), (2.1, 1.0), (4.0, 1.0), (6.1, 1.0), (7.9, 1.0)]
    assert None not in buckets(jittery, end_t=8.0, window_s=8.0, width=8)


def test_sparklines_show_a_stop_and_round_trip_through_their_docs() -> None:
    h = History(keep=100)
    for i in range(60):
        stopped = i >= 40
        h.add(Sample(t=1000.0 + i, done=120.0 if stopped else i * 3.0,
                     cpu_cores=0.0 if stopped else 0.9, gpu_util_pct=2.0 if stopped else 95.0))
    h.add(Sample(t=1000.0, done=0.0))  # a step back in time is dropped
    rows = sparklines(list(h.samples), window_s=300.0, width=30)
    by = {r["key"]: r for r in rows}
    assert set(by) == {"rate", "cpu", "gpu"}  # no GPU memory, no I/O: no rows for them
    assert by["rate"]["spark"].startswith(BARS[-1]) and by["rate"]["spark"].endswith(BARS[0])
    assert by["rate"]["now"] == 0.0 and by["rate"]["max"] == pytest.approx(3.0)
    assert by["gpu"]["now_text"] == "2%" and by["gpu"]["max_text"] == "95%"
    text = sparkline_text(rows)
    assert text == sparkline_text(sparklines(from_docs(h.docs()), 300.0, 30))
    assert text.endswith("(the last 59 s, oldest on the left)")


# ---------------------------------------------------------------------------------- one-liner

@pytest.mark.parametrize("argv, name", [
    (["python", "extract.py", "--out", "x"], "extract"),
    (["torchrun", "--nproc_per_node", "8", "scripts/prepare_hidden_states.py"],
     "prepare_hidden_states"),
    (["torchrun", "--nproc_per_node=8", "scripts/prepare_hidden_states.py"], "prepare_hidden_states"),
    (["python3.11", "-m", "mod", "--x", "a.py"], "mod"),
    (["uv", "run", "worker", "--n", "3"], "run"),
    (["./run it.sh"], "run-it"),
    (["/usr/bin/sleep", "10"], "sleep"),
])
def test_job_name_is_the_scripts(argv: list[str], name: str) -> None:
    assert job_name(argv) == name


def test_alert_specs() -> None:
    assert alert_table("slack") == {"type": "slack"}
    assert alert_table("webhook=https://h/x") == {"type": "webhook", "url": "https://h/x"}
    assert alert_table("command=notify-send 'a b'") == {"type": "command",
                                                        "argv": ["notify-send", "a b"]}
    with pytest.raises(UsageError, match="expected slack"):
        alert_table("pager=1")
    with pytest.raises(UsageError, match="URL is missing"):
        alert_table("webhook")


def test_the_printed_toml_loads_into_the_job_it_stands_for(tmp_path: Path) -> None:
    ol = OneLiner(name="extract", state_dir=tmp_path / "st",
                  command=["python", "x.py", 'a "quoted" arg', "tab\there", "ünï"],
                  cwd=tmp_path, log=tmp_path / "x.log", restart="on-failure", max_restarts=5,
                  startup_grace_s=2.5, restart_backoff_s=0.5, rules=[tmp_path / "r"],
                  progress_regex=r"(?P<done>\d+)/(?P<total>\d+)",
                  alerts=[{"type": "command", "argv": ["echo", "hi"]}], interval_s=0.5)
    text = to_toml(ol.tables(), header="a header\nof two lines")
    assert text.startswith("# a header\n# of two lines\n\n[daemon]\n")
    cfg = parse_config(text, "printed")
    j = cfg.job[0]
    assert j.command == ("python", "x.py", 'a "quoted" arg', "tab\there", "ünï")
    assert (j.name, j.restart, j.max_restarts, j.startup_grace_s, j.restart_backoff_s) == \
        ("extract", "on-failure", 5, 2.5, 0.5)
    assert j.cwd == tmp_path and j.log == tmp_path / "x.log" and j.rules == (tmp_path / "r",)
    assert j.progress_regex == r"(?P<done>\d+)/(?P<total>\d+)"
    assert cfg.daemon.exit_with_jobs and cfg.daemon.interval_s == 0.5
    assert cfg.state_dir == tmp_path / "st"
    assert cfg.alerts[0].argv == ("echo", "hi")


# ------------------------------------------------------------------------------------- views

def view(**over) -> dict:
    v = {"name": "extract", "phase": "running", "detail": "", "verdict": "healthy",
         "summary": "", "pid": 4242, "run": 1, "supervised": True, "restarts": 1,
         "max_restarts": 3, "progress": {"done": 120.0, "total": 1000.0, "rate_per_s": 3.2,
                                         "eta_s": 275.0, "idle_s": 0.4},
         "ranks": [], "gpus": [{"index": 0, "util_pct": 97.0, "mem_used_bytes": 2 ** 34,
                                "mem_total_bytes": 2 ** 37}],
         "incident": None, "sparks": []}
    v.update(over)
    return v


def test_plain_line() -> None:
    assert plain_line(view()) == ("stallwatch: extract: healthy · 120/1,000 (12%) · 3.2/s · "
                                  "ETA 4 min 35 s · GPU0 97% 16.0 GiB · restarts 1/3")
    line = plain_line(view(verdict="hang", summary="no progress for 40 s",
                           progress={"done": 5.0, "total": None, "rate_per_s": None,
                                     "eta_s": None, "idle_s": 40.0}, gpus=[]))
    assert line == ("stallwatch: extract: hang · 5 · no progress for 40.0 s · restarts 1/3 — "
                    "no progress for 40 s")


def test_footer_rows_fit_the_width_and_show_each_rank() -> None:
    ranks = [{"rank": r, "done": float(d), "total": 100.0, "rate_per_s": 1.0, "eta_s": 9.0,
              "idle_s": 0.0} for r, d in ((0, 50), (1, 20))]
    rows = footer_text([view(verdict="slow", ranks=ranks)], width=72, color=False)
    assert rows[0] == "─" * 72
    assert rows[1].startswith("stallwatch extract   slow   pid 4242 run 1  restarts 1/3")
    assert [r.split()[0:2] for r in rows[2:5]] == [["progress", rows[2].split()[1]],
                                                   ["rank", "0"], ["rank", "1"]]
    assert "50/100 (50%)" in rows[3] and "20/100 (20%)" in rows[4]
    assert rows[5] == "GPU0 97% 16.0 GiB/128.0 GiB"
    assert all(len(r) <= 72 for r in rows)


def test_rank_bars_get_a_rate_and_eta_from_what_the_view_saw() -> None:
    from types import SimpleNamespace

    from stallwatch.commands.live import Pace, job_view

    pace = Pace(window_s=30.0)

    def runner(done0: float, done1: float):
        lg = {"has_progress": True, "done": done0 + done1, "total": 200.0, "total_known": True,
              "bars": [{"position": 0, "done": done0, "total": 100.0, "idle_s": 0.5,
                        "complete": done0 >= 100},
                       {"position": 1, "done": done1, "total": 100.0, "idle_s": 12.0,
                        "complete": False}]}
        db = SimpleNamespace(incidents=lambda *a, **k: [], job=lambda n: {"restarts": 0},
                             actions=lambda i: [])
        return SimpleNamespace(name="x", db=db, phase="running", verdict=None, run_row=None,
                               last_vars={"log": lg}, history=SimpleNamespace(samples=[]),
                               cfg=SimpleNamespace(supervised=True, restartable=True, restart="no",
                                                  max_restarts=3))

    assert [r["rate_per_s"] for r in job_view(runner(10, 10), pace, now=100.0)["ranks"]] == \
        [None, None]  # one sighting: no rate yet
    ranks = job_view(runner(30, 10), pace, now=110.0)["ranks"]
    assert [(r["rank"], r["rate_per_s"]) for r in ranks] == [(0, 2.0), (1, 0.0)]
    assert ranks[0]["eta_s"] == 35.0 and ranks[1]["eta_s"] is None  # a stopped bar: no ETA
    assert ranks[1]["idle_s"] == 12.0
    ranks = job_view(runner(5, 12), pace, now=120.0)["ranks"]  # bar 0 started over (a restart)
    assert ranks[0]["rate_per_s"] is None and ranks[1]["rate_per_s"] == 0.1


def test_the_view_shows_only_the_incidents_of_its_own_run() -> None:
    """`stallwatch run` in a terminal: an incident of an earlier run, in the same state
    directory, is not this run's (the foreground daemon gives the view its start, wall time)."""
    from types import SimpleNamespace

    from stallwatch.commands.live import job_view

    def runner(started_wall: float):
        inc = {"id": 1, "kind": "hang", "started_at": started_wall, "resolved_at": None}
        db = SimpleNamespace(incidents=lambda *a, **k: [inc], job=lambda n: {"restarts": 0},
                             actions=lambda i: [{"what": "kill", "outcome": "done"}])
        return SimpleNamespace(name="x", db=db, phase="running", verdict=None, run_row=None,
                               last_vars={}, history=SimpleNamespace(samples=[]),
                               cfg=SimpleNamespace(supervised=True, restartable=True,
                                                   restart="no", max_restarts=3))

    opened = 1_700_000_000.0
    assert job_view(runner(opened - 3600.0), since_wall=opened)["incident"] is None
    shown = job_view(runner(opened + 5.0), since_wall=opened)["incident"]
    assert shown["kind"] == "hang" and shown["last_action"] == "kill: done"
    assert job_view(runner(opened - 3600.0))["incident"] is not None  # no start given: all


def test_a_recorded_h200_stop_drawn_from_its_trace() -> None:
    """The trace recorded on an H200 (tests/data/gpu_h200_stop_kill.jsonl): the job ran at full
    GPU, then its progress stopped while the GPU went idle, then it was killed and the memory
    freed. Drawn from the trace with the function the daemon samples its ticks with."""
    from stallwatch.engine.history import samples_from_trace

    rows = {r["key"]: r for r in sparklines(
        samples_from_trace(Path(__file__).parent / "data" / "gpu_h200_stop_kill.jsonl"),
        300.0, 40)}
    gpu, rate, mem = rows["gpu"]["spark"], rows["rate"]["spark"], rows["gpu_mem"]["spark"]
    assert rows["gpu"]["max"] == pytest.approx(100.0) and rows["gpu"]["now"] == 0.0
    stop = rate.index(BARS[0])  # progress stopped here...
    assert set(rate[:stop]) <= set(BARS[3:]) and set(rate[stop:].strip()) == {BARS[0]}
    assert gpu[:stop - 1] == BARS[-1] * (stop - 1)  # ...with the GPU busy until then...
    assert set(gpu[stop + 1:]) <= {BARS[0], BARS[1]}  # ...and idle after
    assert mem.index(BARS[0]) > stop + 5  # the memory held on, until the kill freed it


def test_desktop_and_slack_render_the_sparklines() -> None:
    from stallwatch.alerts.config import DesktopConfig
    from stallwatch.alerts.desktop import render
    from stallwatch.alerts.slack import slack_message
    from stallwatch.alerts.events import AlertEvent

    text = "progress ██▁▁ 0/s (max 4/s)\nCPU      ▁▁▁▁ 0 cores (max 0 cores)\n(the last 4 s, oldest on the left)"
    ev = AlertEvent(job="x", kind="hang", state="firing", summary="stuck <here>", sparklines=text)
    body = render(ev, DesktopConfig(type="desktop"))["body"]
    assert "progress ██▁▁ 0/s (max 4/s)\nCPU      ▁▁▁▁ 0 cores" in body
    assert "oldest on the left" not in body  # the rows, not the legend
    blocks = slack_message(ev)["blocks"]
    last = next(b["text"]["text"] for b in blocks if "Last minutes" in b.get("text", {}).get("text", ""))
    assert last == f"*Last minutes*\n```{text}```"


def test_the_invokers_environment_passes_but_not_secrets_nor_to_another_user(tmp_path: Path) -> None:
    from stallwatch.commands.runcmd import with_invoker_env

    text = to_toml(OneLiner(name="a", state_dir=tmp_path, command=["true"],
                            alerts=[{"type": "slack", "url_env": "MY_HOOK"}]).tables())
    env = {"PATH": "/bin", "HF_HOME": "/data/hf", "MY_HOOK": "https://hooks/x",
           "SLACK_WEBHOOK_URL": "https://hooks/y", "NOTIFY_SOCKET": "/run/n"}
    job = with_invoker_env(parse_config(text), env).job[0]
    assert job.env == {"PATH": "/bin", "HF_HOME": "/data/hf"}
    text = to_toml(OneLiner(name="a", state_dir=tmp_path, command=["true"], user="nobody").tables())
    assert with_invoker_env(parse_config(text), env).job[0].env == {}  # built by the daemon


def test_a_command_option_is_split_as_a_shell_would_and_refused_when_empty_or_unbalanced() -> None:
    from stallwatch.errors import UsageError
    from stallwatch.commands.oneliner import alert_table, split_command

    assert split_command("--restart-command", "python x.py --out '/data/a b'") == [
        "python", "x.py", "--out", "/data/a b"]
    for text, why in (("", "the command is missing"), ('a "b', "cannot split it")):
        with pytest.raises(UsageError, match=why):
            split_command("--restart-command", text)
    assert alert_table("command=notify-send 'a b'") == {"type": "command",
                                                        "argv": ["notify-send", "a b"]}
    with pytest.raises(UsageError, match="--alert command=ARGV: the command is missing"):
        alert_table("command=")


def test_the_saved_history_json_is_the_window_of_docs_made_once_per_sample() -> None:
    import json

    h = History(keep=50)
    assert h.docs_json(300.0) == "[]" and h.added == 0
    for i in range(80):  # past `keep`: the oldest are dropped from both
        h.add(Sample(t=100.0 + i * 2, done=float(i), io_bytes=None if i % 3 else 4096.0 * i))
    h.add(Sample(t=100.0, done=1.0))  # a step back: not added, `added` says nothing new
    assert h.added == 80
    for window in (None, 0.0, 7.0, 30.0, 1e9):
        assert h.docs_json(window) == json.dumps(h.docs(window))
        assert [d["t"] for d in h.docs(window)] == [s.t for s in h.samples
                                                    if window is None or s.t >= 258.0 - window]
