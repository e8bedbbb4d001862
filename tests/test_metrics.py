"""Fleet metrics (issue 8): the exporter over real HTTP and as a textfile, parsed with
prometheus_client's own parser; the deploy/ files (alert rules through promtool, the Grafana
dashboard, the Kubernetes DaemonSet, the Slurm scripts); and the real daemon when it is wired."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stallwatch import __version__
from stallwatch.daemon.metrics import (
    INCIDENT_KINDS,
    JOB_STATES,
    VERDICT_KINDS,
    DaemonStats,
    DaemonView,
    GpuView,
    JobGpu,
    JobView,
)
from stallwatch.daemon.metrics_export import MetricsExporter, parse_listen, write_atomic
from stallwatch.probes.base import ProbeReport, ProbeStatus

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "stallwatch-alerts.yml"
RULES_TEST = DEPLOY / "prometheus" / "stallwatch-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "stallwatch-dashboard.json"
DAEMONSET = DEPLOY / "kubernetes" / "daemonset.yaml"
H200_TRACE = ROOT / "tests" / "data" / "gpu_h200_stop_kill.jsonl"

UUID0 = "GPU-5d70701d-d248-f54b-823f-e296dcfc4706"
UUID1 = "GPU-00000000-1111-2222-3333-444444444444"


# --------------------------------------------------------------------------------- helpers

def scrape(port: int, host: str = "127.0.0.1", path: str = "/metrics") -> str:
    h = f"[{host}]" if ":" in host else host
    with urllib.request.urlopen(f"http://{h}:{port}{path}", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)], through prometheus_client's own parser."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(ss, metric: str, /, **labels: str) -> float:
    hits = [v for lab, v in ss.get(metric, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, f"{metric}{labels}: {len(hits)} samples in {ss.get(metric)}"
    return hits[0]


def job_view(name="extract", **kw) -> JobView:
    base = dict(name=name, kind="io_stall", state="running", done=18380, total=37312,
                rate_per_s=1.02, eta_s=17300, last_progress_timestamp_s=1_795_000_000.5,
                restarts=2, max_restarts=3, incidents={"io_stall": 2, "hang": 1},
                gpus=(JobGpu(index=0, uuid=UUID0, used_bytes=10_311_696_384),))
    base.update(kw)
    return JobView(**base)


def daemon_view() -> DaemonView:
    st = DaemonStats(interval_s=1.0, sinks=["webhook", "slack"])
    st.tick(0.012, [ProbeReport(name="processes", status=ProbeStatus.ok, duration_s=0.004),
                    ProbeReport(name="disks", status=ProbeStatus.timeout, duration_s=5.0,
                                error="statvfs on /data did not return in 5 s")])
    st.tick(0.3, [ProbeReport(name="processes", status=ProbeStatus.ok, duration_s=0.006)])
    st.tick(7.0)
    st.rule_error()
    st.delivery("webhook", True)
    st.delivery("webhook", True)
    st.delivery("slack", False)
    gpus = (GpuView(index=0, uuid=UUID0, name="NVIDIA H200", utilization_ratio=0.99,
                    memory_used_bytes=10_320_936_960, memory_total_bytes=150_754_820_096),
            GpuView(index=1, uuid=UUID1, name="NVIDIA H200", utilization_ratio=None,
                    memory_used_bytes=None, memory_total_bytes=150_754_820_096, lost=True))
    return st.view(gpus=gpus)


@pytest.fixture
def exporter():
    made: list[MetricsExporter] = []

    def make(*a, **kw) -> MetricsExporter:
        e = MetricsExporter(*a, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


# ------------------------------------------------------------------------------- over HTTP

def test_scrape_over_http_names_labels_and_values(exporter):
    e = exporter("127.0.0.1:0").start()
    assert e.port and e.port != 0 and e.address == f"127.0.0.1:{e.port}"
    e.update([job_view(), job_view("embed", kind="healthy", state="attached", total=None,
                                   eta_s=None, max_restarts=None, restarts=0, incidents={},
                                   gpus=())],
             daemon_view())
    ss = samples(scrape(e.port))

    # the verdict: one series per kind of the fixed vocabulary, 1 for the current kind
    for job, current in (("extract", "io_stall"), ("embed", "healthy")):
        got = {lab["kind"]: v for lab, v in ss["stallwatch_job_verdict"] if lab["job"] == job}
        assert got == {k: (1.0 if k == current else 0.0) for k in VERDICT_KINDS}
        st = {lab["state"]: v for lab, v in ss["stallwatch_job_state"] if lab["job"] == job}
        want = "running" if job == "extract" else "attached"
        assert st == {s: (1.0 if s == want else 0.0) for s in JOB_STATES}

    assert value(ss, "stallwatch_job_progress_done", job="extract") == 18380
    assert value(ss, "stallwatch_job_progress_total", job="extract") == 37312
    assert value(ss, "stallwatch_job_progress_rate_per_second", job="extract") == pytest.approx(1.02)
    assert value(ss, "stallwatch_job_eta_seconds", job="extract") == 17300
    assert value(ss, "stallwatch_job_last_progress_timestamp_seconds",
                 job="extract") == pytest.approx(1_795_000_000.5)
    assert value(ss, "stallwatch_job_restarts_total", job="extract") == 2
    assert value(ss, "stallwatch_job_max_restarts", job="extract") == 3
    inc = {lab["kind"]: v for lab, v in ss["stallwatch_job_incidents_total"] if lab["job"] == "extract"}
    assert inc == {k: {"io_stall": 2.0, "hang": 1.0}.get(k, 0.0) for k in INCIDENT_KINDS}
    assert value(ss, "stallwatch_job_gpu_memory_used_bytes", job="extract", gpu="0",
                 uuid=UUID0) == 10_311_696_384
    # unknown numbers are absent, not 0 or NaN
    assert [lab for lab, _ in ss["stallwatch_job_progress_total"]] == [{"job": "extract"}]
    assert [lab for lab, _ in ss["stallwatch_job_eta_seconds"]] == [{"job": "extract"}]
    assert [lab for lab, _ in ss["stallwatch_job_max_restarts"]] == [{"job": "extract"}]
    assert value(ss, "stallwatch_job_progress_done", job="embed") == 18380

    # per GPU: index, uuid and model name as labels; utilisation as a ratio
    g0 = dict(gpu="0", uuid=UUID0, name="NVIDIA H200")
    assert value(ss, "stallwatch_gpu_utilization_ratio", **g0) == pytest.approx(0.99)
    assert value(ss, "stallwatch_gpu_memory_used_bytes", **g0) == 10_320_936_960
    assert value(ss, "stallwatch_gpu_memory_total_bytes", **g0) == 150_754_820_096
    assert value(ss, "stallwatch_gpu_lost", **g0) == 0
    g1 = dict(gpu="1", uuid=UUID1, name="NVIDIA H200")
    assert value(ss, "stallwatch_gpu_lost", **g1) == 1
    assert value(ss, "stallwatch_gpu_memory_total_bytes", **g1) == 150_754_820_096
    assert not [lab for lab, _ in ss["stallwatch_gpu_utilization_ratio"] if lab["gpu"] == "1"]

    # the daemon itself
    assert value(ss, "stallwatch_tick_last_duration_seconds") == 7.0
    assert value(ss, "stallwatch_tick_duration_seconds_count") == 3
    assert value(ss, "stallwatch_tick_duration_seconds_sum") == pytest.approx(7.312)
    buckets = {lab["le"]: v for lab, v in ss["stallwatch_tick_duration_seconds_bucket"]}
    assert buckets["0.025"] == 1 and buckets["0.5"] == 2 and buckets["5.0"] == 2
    assert buckets["10.0"] == 3 and buckets["+Inf"] == 3
    assert value(ss, "stallwatch_tick_interval_seconds") == 1.0
    assert time.time() - value(ss, "stallwatch_last_tick_timestamp_seconds") < 60
    assert value(ss, "stallwatch_probe_runs_total", probe="processes", status="ok") == 2
    assert value(ss, "stallwatch_probe_runs_total", probe="disks", status="timeout") == 1
    assert value(ss, "stallwatch_probe_runs_total", probe="disks", status="ok") == 0
    assert value(ss, "stallwatch_probe_last_duration_seconds", probe="disks") == 5.0
    assert value(ss, "stallwatch_rule_evaluation_errors_total") == 1
    assert value(ss, "stallwatch_alert_deliveries_total", sink="webhook", result="success") == 2
    assert value(ss, "stallwatch_alert_deliveries_total", sink="webhook", result="failure") == 0
    assert value(ss, "stallwatch_alert_deliveries_total", sink="slack", result="failure") == 1
    assert value(ss, "stallwatch_build_info", version=__version__) == 1


def test_types_are_what_prometheus_expects(exporter):
    e = exporter()
    e.update([job_view()], daemon_view())
    types = {f.name: f.type for f in text_string_to_metric_families(e.render())}
    assert types["stallwatch_job_verdict"] == "gauge"
    assert types["stallwatch_job_restarts"] == "counter"
    assert types["stallwatch_job_incidents"] == "counter"
    assert types["stallwatch_probe_runs"] == "counter"
    assert types["stallwatch_rule_evaluation_errors"] == "counter"
    assert types["stallwatch_alert_deliveries"] == "counter"
    assert types["stallwatch_tick_duration_seconds"] == "histogram"
    assert types["stallwatch_job_progress_total"] == "gauge"


def test_a_removed_job_disappears_and_a_new_one_appears(exporter):
    e = exporter("127.0.0.1:0").start()
    d = daemon_view()
    e.update([job_view("a"), job_view("b", kind="hang")], d)
    jobs = {lab["job"] for lab, _ in samples(scrape(e.port))["stallwatch_job_verdict"]}
    assert jobs == {"a", "b"}
    e.update([job_view("b", kind="healthy"), job_view("c")], d)
    text = scrape(e.port)
    assert 'job="a"' not in text  # no stale series of any metric
    ss = samples(text)
    assert {lab["job"] for lab, _ in ss["stallwatch_job_verdict"]} == {"b", "c"}
    assert value(ss, "stallwatch_job_verdict", job="b", kind="healthy") == 1
    assert value(ss, "stallwatch_job_verdict", job="b", kind="hang") == 0
    e.update([], d)
    assert "job=" not in scrape(e.port)


def test_no_pid_label_anywhere(exporter):
    e = exporter("127.0.0.1:0").start()
    e.update([job_view(), job_view("second")], daemon_view())
    text = scrape(e.port)
    names = {k for lst in samples(text).values() for lab, _ in lst for k in lab}
    assert names and not {n for n in names if "pid" in n.lower()}
    assert not re.search(r"[{,]\s*\w*pid\w*=", text)
    assert not [f for f in JobView.model_fields if "pid" in f]  # nothing to put one in either


def test_unknown_numbers_and_bad_vocabulary():
    v = JobView(name="j", rate_per_s=-1.0, eta_s=float("nan"), done=-1, total=float("inf"))
    assert (v.rate_per_s, v.eta_s, v.done, v.total) == (None, None, None, None)
    with pytest.raises(ValueError):
        JobView(name="j", kind="stalled")
    with pytest.raises(ValueError):
        JobView(name="j", state="zombie")
    with pytest.raises(ValueError):
        JobView(name="j", incidents={"oops": 1})
    with pytest.raises(ValueError):
        JobView(name="j", pid=123)  # extra fields are refused, a pid above all


def test_duplicate_job_names_do_not_break_the_scrape(exporter):
    e = exporter()
    e.update([job_view("a"), job_view("a", kind="hang")], None)
    ss = samples(e.render())
    assert value(ss, "stallwatch_job_verdict", job="a", kind="io_stall") == 1


def test_views_from_a_real_h200_snapshot():
    from stallwatch.probes.snapshot import Snapshot
    from stallwatch.probes.trace import read_trace
    _, snaps, events = read_trace(H200_TRACE)
    busy = next(e["wall"] for e in events if e.get("phase") == "busy")
    s = next(Snapshot.model_validate({k: v for k, v in r.items() if k != "type"})
             for r in snaps if r["t_wall"] > busy + 2)
    v = JobView.from_snapshot("matmul", s, kind="healthy", restarts=1, max_restarts=3,
                              incidents={"hang": 1})
    assert v.done and v.done > 0 and v.total == 100000
    assert v.rate_per_s and v.rate_per_s > 0 and v.eta_s and v.eta_s > 0
    assert s.t_wall - 60 < v.last_progress_timestamp_s <= s.t_wall
    assert v.gpus and v.gpus[0].uuid.startswith("GPU-") and v.gpus[0].used_bytes > 1 << 30
    (g,) = GpuView.from_obs(s.gpu)
    assert g.name == "NVIDIA H200" and 0.5 < g.utilization_ratio <= 1.0
    assert g.memory_total_bytes > 100 * (1 << 30)
    assert JobView.from_snapshot("x", None).done is None and GpuView.from_obs(None) == ()


def test_daemon_metrics_adapter_reads_the_daemon(tmp_path):
    """DaemonMetrics against a stand-in daemon: states (gave_up from the actions), incidents
    by kind from the state database, probe runs counted once per snapshot, deliveries from the
    dispatcher's status, and never an exception into the tick."""
    from types import SimpleNamespace as NS

    from stallwatch.daemon.metrics_export import DaemonMetrics, deliveries_from_status

    class DB:
        def __init__(self):
            self.inc = {"a": [{"kind": "hang"}, {"kind": "hang"}, {"kind": "crash"}], "b": []}
            self.acts = {"a": [{"what": "start"}, {"what": "restart"}, {"what": "give_up"}],
                         "b": [{"what": "give_up"}, {"what": "restart"}]}

        def incidents(self, job, limit=50):
            return self.inc[job][:limit]

        def job_actions(self, job):
            return self.acts[job]

    reps = (ProbeReport(name="processes", status=ProbeStatus.ok, duration_s=0.01),
            ProbeReport(name="log", status=ProbeStatus.denied, duration_s=0.001))
    snap_a = NS(probes=reps, gpu=None, log=None, processes=None, t_wall=time.time())
    snap_b = NS(probes=reps[:1], gpu=None, log=None, processes=None, t_wall=time.time())
    ev = NS(errors=("boom",))

    def runner(name, phase, kind, snap, restarts, incidents):
        return NS(name=name, phase=phase, verdict=NS(kind=kind), last_snap=snap, last_eval=ev,
                  incidents=incidents, restarts=lambda: restarts, restart_streak=lambda: restarts,
                  watch_warnings=[], cfg=NS(restart="on-failure", max_restarts=3))

    disp = NS(status=lambda: {"sinks": [
        {"name": "ops", "type": "webhook", "sent": 4, "failed": 1},
        {"name": "team", "type": "webhook", "sent": 1, "failed": 0},
        {"name": "slack", "type": "slack", "sent": 0, "failed": 2}]})
    daemon = NS(jobs={"a": runner("a", "stopped", "crash", snap_a, 3, {}),
                      "b": runner("b", "stopped", "hang", snap_b, 1, {"hang": {"id": 9}})},
                db=DB(), dispatcher=disp)
    m = DaemonMetrics(MetricsExporter(), DaemonStats(interval_s=1.0))
    m.tick(daemon, 0.02)
    m.tick(daemon, 0.03)  # same snapshots: their probes are not counted twice
    ss = samples(m.exporter.render())
    assert value(ss, "stallwatch_job_state", job="a", state="gave_up") == 1
    assert value(ss, "stallwatch_job_state", job="b", state="stopped") == 1
    assert value(ss, "stallwatch_job_incidents_total", job="a", kind="hang") == 2
    assert value(ss, "stallwatch_job_incidents_total", job="a", kind="crash") == 1
    assert value(ss, "stallwatch_job_restarts_total", job="a") == 3
    assert value(ss, "stallwatch_job_max_restarts", job="a") == 3
    assert value(ss, "stallwatch_probe_runs_total", probe="processes", status="ok") == 2
    assert value(ss, "stallwatch_probe_runs_total", probe="log", status="denied") == 1
    assert value(ss, "stallwatch_rule_evaluation_errors_total") == 2
    assert value(ss, "stallwatch_tick_duration_seconds_count") == 2
    assert value(ss, "stallwatch_alert_deliveries_total", sink="webhook", result="success") == 5
    assert value(ss, "stallwatch_alert_deliveries_total", sink="slack", result="failure") == 2
    assert deliveries_from_status({}) == {}

    # a broken daemon object: logged, not raised
    m.tick(NS(jobs={"x": NS(name="x")}), 0.01)
    assert m._failures == 1
    m.close()
    assert DaemonMetrics.from_config(NS(metrics_listen=None)) is None
    assert DaemonMetrics.from_config(NS(metrics_listen="0.0.0.0:9835")) is None  # refused, logged


def test_daemon_metrics_read_restarts_again_only_after_a_commit(tmp_path, monkeypatch):
    """The restart counts are read from the state database once, then again only after it
    committed a transaction (a quiet tick reads none), and always show what it holds; the GPU
    views are made again only for another GPU observation (the probe hands the same one on)."""
    from types import SimpleNamespace as NS

    import stallwatch.daemon.metrics_export as me
    from stallwatch.daemon.metrics_export import DaemonMetrics
    from stallwatch.daemon.state import StateDB

    db = StateDB.open(tmp_path / "lane7-state")
    db.ensure_job("a", "command", "{}")
    reads = []

    def restarts() -> int:
        reads.append("restarts")
        return int(db.existing_job("a")["restarts"])

    made = []
    real_from_obs = me.GpuView.from_obs
    monkeypatch.setattr(me.GpuView, "from_obs", lambda obs: made.append(obs) or real_from_obs(obs))
    gpu = NS(devices=(NS(index=0, uuid="GPU-1", name="H200", util_gpu_pct=50, mem_used_bytes=1,
                         mem_total_bytes=2, lost=False, processes=()),))
    snap = NS(probes=(), gpu=gpu, log=None, processes=None, t_wall=time.time())
    r = NS(name="a", phase="running", verdict=NS(kind="healthy"), last_snap=snap, last_eval=None,
           incidents={}, restarts=restarts, restart_streak=restarts, watch_warnings=[],
           cfg=NS(restart="on-failure", max_restarts=3))
    daemon = NS(jobs={"a": r}, db=db, dispatcher=None)
    m = DaemonMetrics(MetricsExporter(), DaemonStats(interval_s=1.0))
    try:
        m.tick(daemon, 0.01)
        m.tick(daemon, 0.01)
        assert len(reads) == 2 and len(made) == 1  # read and made once for the two ticks
        db.update_job("a", restarts=2)  # a commit: read again, and the metric follows
        m.tick(daemon, 0.01)
        assert len(reads) == 4
        assert value(samples(m.exporter.render()), "stallwatch_job_restarts_total", job="a") == 2
        r.last_snap = NS(probes=(), gpu=NS(devices=()), log=None, processes=None, t_wall=1.0)
        m.tick(daemon, 0.01)
        assert len(made) == 2 and m._failures == 0
        assert "stallwatch_gpu_utilization_ratio" not in samples(m.exporter.render())
    finally:
        m.close()
        db.close()


# ------------------------------------------------------------------------- listen addresses

@pytest.mark.parametrize("listen, want", [
    ("127.0.0.1:9835", ("127.0.0.1", 9835)),
    (":9835", ("127.0.0.1", 9835)),
    ("9835", ("127.0.0.1", 9835)),
    ("localhost:9835", ("127.0.0.1", 9835)),
    ("[::1]:9835", ("::1", 9835)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
    ("[::]:9835", ("::", 9835)),
])
def test_parse_listen(listen, want):
    assert parse_listen(listen) == want


@pytest.mark.parametrize("bad", ["", "host:", "127.0.0.1:http", "::1:9835", "[::1]9835",
                                 "127.0.0.1:65536"])
def test_parse_listen_refuses(bad):
    with pytest.raises(ValueError):
        parse_listen(bad)


@pytest.mark.parametrize("listen", ["0.0.0.0:9835", "[::]:9835", "192.0.2.7:9835",
                                    "[2001:db8::1]:9835"])
def test_non_loopback_is_refused_unless_allowed(listen):
    with pytest.raises(ValueError, match="not a loopback address"):
        MetricsExporter(listen)
    e = MetricsExporter(listen, allow_remote=True)  # explicit: accepted (not started here)
    assert e.host == parse_listen(listen)[0]


def test_colon_port_listens_on_loopback_only(exporter):
    e = exporter(":0").start()
    assert e.host == "127.0.0.1"
    assert e._httpd.server_address[0] == "127.0.0.1"
    e.update([job_view()], None)
    assert 'job="extract"' in scrape(e.port)


def test_ipv6_loopback(exporter):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.bind(("::1", 0))
        s.close()
    except OSError as err:
        pytest.skip(f"cannot bind [::1] here: {err}")
    e = exporter("[::1]:0").start()
    e.update([job_view()], None)
    assert e.address == f"[::1]:{e.port}"
    assert 'job="extract"' in scrape(e.port, host="::1")


def test_close_frees_the_port():
    e = MetricsExporter("127.0.0.1:0").start()
    port = e.port
    e.close()
    e.close()  # twice is fine
    with pytest.raises(OSError):
        scrape(port)


# -------------------------------------------------------------------------------- textfile

def _wait_for(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.02)


def test_textfile_is_written_parses_and_is_readable_by_node_exporter(tmp_path, exporter):
    (tmp_path / ".stallwatch.prom.leftover.tmp").write_text("half")  # a killed daemon's temp
    e = exporter(textfile=tmp_path)
    assert e.textfile == tmp_path / "stallwatch.prom"
    assert not (tmp_path / ".stallwatch.prom.leftover.tmp").exists()
    e.update([job_view()], daemon_view())
    _wait_for(e.textfile)
    ss = samples(e.textfile.read_text())
    assert value(ss, "stallwatch_job_verdict", job="extract", kind="io_stall") == 1
    assert value(ss, "stallwatch_gpu_memory_total_bytes", gpu="0", uuid=UUID0,
                 name="NVIDIA H200") == 150_754_820_096
    assert stat.S_IMODE(e.textfile.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stallwatch.prom"]  # no temp left


def test_textfile_path_may_name_the_file(tmp_path, exporter):
    e = exporter(textfile=tmp_path / "gpu-node-7.prom")
    e.update([job_view()], None)
    e.flush()
    assert 'job="extract"' in (tmp_path / "gpu-node-7.prom").read_text()
    with pytest.raises(ValueError, match="no such directory"):
        MetricsExporter(textfile=tmp_path / "missing" / "x.prom")


def test_textfile_is_written_at_most_every_interval(tmp_path, exporter):
    e = exporter(textfile=tmp_path, textfile_interval_s=3600)
    e.update([job_view("first")], None)
    _wait_for(e.textfile)
    for i in range(20):
        e.update([job_view(f"next{i}")], None)
    time.sleep(0.3)
    assert 'job="first"' in e.textfile.read_text()  # throttled: not rewritten yet
    e.close()  # the last state is not lost
    text = e.textfile.read_text()
    assert 'job="next19"' in text and 'job="first"' not in text


def test_textfile_interval_elapses_then_rewrites(tmp_path, exporter):
    e = exporter(textfile=tmp_path, textfile_interval_s=0.2)
    e.update([job_view("first")], None)
    _wait_for(e.textfile)
    e.update([job_view("second")], None)
    deadline = time.monotonic() + 10
    while 'job="second"' not in e.textfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_textfile_writes_are_atomic(tmp_path, exporter, monkeypatch):
    """A reader never sees a partial file: the temp file is in the same directory (rename is
    atomic only within one filesystem), is not a *.prom (node_exporter ignores it), and replaces
    the file in one rename. Checked by a reader racing many rewrites."""
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src, dst):
        renames.append((str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    e = exporter(textfile=tmp_path)
    big = [job_view(f"job-{i:03d}") for i in range(150)]  # ~100 KB: many write() calls
    e.update(big, daemon_view())
    e.flush()
    stop = threading.Event()
    bad: list[str] = []

    def reader():
        while not stop.is_set():
            text = e.textfile.read_text()
            whole = (text.endswith("stallwatch_metrics_textfile_write_errors_total 0.0\n")
                     and text.count("stallwatch_job_verdict{") == 150 * len(VERDICT_KINDS)
                     and f'stallwatch_gpu_lost{{gpu="1",name="NVIDIA H200",uuid="{UUID1}"}} 1.0'
                     in text)
            if not whole:
                bad.append(text[-200:])
            list(text_string_to_metric_families(text))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(40):
            e.update(big[i % 7:] + big[: i % 7], daemon_view())
            e.flush()
    finally:
        stop.set()
        t.join()
    assert not bad
    assert renames and all(Path(src).parent == tmp_path and dst == str(e.textfile)
                           and not src.endswith(".prom") for src, dst in renames)


def test_write_atomic_leaves_the_old_file_when_it_fails(tmp_path, monkeypatch):
    p = tmp_path / "stallwatch.prom"
    write_atomic(p, b"old 1\n")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_atomic(p, b"new 2\n")
    assert p.read_bytes() == b"old 1\n"
    assert [x.name for x in tmp_path.iterdir()] == ["stallwatch.prom"]


def test_a_failing_textfile_never_raises_into_the_tick(tmp_path, exporter):
    d = tmp_path / "tf"
    d.mkdir()
    e = exporter(textfile=d)
    shutil.rmtree(d)  # node_exporter's directory vanished
    e.update([job_view()], None)  # does not raise
    e.flush()  # neither does a forced write
    ss = samples(e.render())
    assert value(ss, "stallwatch_metrics_textfile_write_errors_total") >= 1


# ------------------------------------------------------------------- promtool and deploy/

def _promtool() -> str:
    p = shutil.which("promtool")
    if not p:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus; .ci/run does)")
    return p


def test_promtool_check_rules():
    r = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_promtool_test_rules():
    """The alert rules' own unit tests: each alert fires on the series it is meant for."""
    r = subprocess.run([_promtool(), "test", "rules", RULES_TEST.name], capture_output=True,
                       text=True, timeout=120, cwd=RULES_TEST.parent, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_metrics_lints_the_exposition(exporter):
    e = exporter()
    e.update([job_view(), job_view("b")], daemon_view())
    r = subprocess.run([_promtool(), "check", "metrics"], input=e.render(), capture_output=True,
                       text=True, timeout=60, check=False)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    # The one accepted lint: the issue names the gauge stallwatch_job_progress_total ("total"
    # as in "items in all", not a counter suffix).
    problems = [p for p in problems if not p.startswith("stallwatch_job_progress_total ")]
    assert not problems, problems


def test_alert_rules_cover_the_problem_kinds_and_staleness():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"] if "alert" in r]
    exprs = " ".join(r["expr"] for r in rules)
    for kind in ("hang", "io_stall", "server_hang", "crash", "gpu_fault", "disk_full"):
        assert re.search(rf'kind\s*=~?\s*"[^"]*\b{kind}\b', exprs), kind
    assert "up" in exprs and "stallwatch_last_tick_timestamp_seconds" in exprs
    assert "stallwatch_job_restarts_total" in exprs and 'state="gave_up"' in exprs
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


def test_grafana_dashboard_has_the_panels():
    from fleetkit import dashboard_panels

    dash = json.loads(DASHBOARD.read_text())
    panels = dashboard_panels(dash)

    def exprs(p):
        return " ".join(t.get("expr", "") for t in p.get("targets", []))

    def find(type_: str | None, *metrics: str):
        hits = [p for p in panels if (type_ is None or p["type"] == type_)
                and all(m in exprs(p) for m in metrics)]
        assert hits, f"no {type_ or 'any'} panel over {metrics}"
        return hits[0]

    find("state-timeline", "stallwatch_job_verdict")
    find(None, "stallwatch_job_progress_done", "stallwatch_job_progress_total")
    find(None, "stallwatch_job_progress_rate_per_second")
    find(None, "stallwatch_job_eta_seconds")
    find(None, "stallwatch_gpu_utilization_ratio")
    find(None, "stallwatch_gpu_memory_used_bytes", "stallwatch_gpu_memory_total_bytes")
    find(None, "stallwatch_tick_duration_seconds_bucket")
    find(None, "stallwatch_job_restarts_total")
    # every metric a panel queries is one the exporter exports
    names = {f.name for f in text_string_to_metric_families(_full_render())}
    sample_names = {s.name for f in text_string_to_metric_families(_full_render()) for s in f.samples}
    for p in panels:
        for m in re.findall(r"\bstallwatch_\w+", exprs(p)):
            assert m in names | sample_names, f"panel {p.get('title')!r} queries unknown {m}"
    # a job variable, and a datasource variable so it imports into any Grafana
    var_names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job"} <= var_names
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36


def _full_render() -> str:
    e = MetricsExporter()
    e.update([job_view()], daemon_view())
    return e.render()


def test_every_metric_in_alerts_exists():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(RULES.read_text())
    text = _full_render()
    known = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for g in doc["groups"]:
        for r in g["rules"]:
            for m in re.findall(r"\bstallwatch_\w+", r["expr"]):
                assert m in known, f"{r.get('alert') or r.get('record')}: unknown metric {m}"


def test_kubernetes_daemonset_manifest():
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "ConfigMap"} <= kinds
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    c = next(c for c in spec["containers"] if c["name"] == "stallwatch")
    assert c["command"][:2] == ["stallwatch", "run"] or "run" in c.get("args", [])
    caps = set(c["securityContext"]["capabilities"]["add"])
    assert {"SYS_PTRACE", "SYSLOG", "KILL"} <= caps
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    host_paths = {v["hostPath"]["path"]: n for n, v in vols.items() if "hostPath" in v}
    assert "/proc" in host_paths and mounts[host_paths["/proc"]]["readOnly"] is True
    assert "/dev/kmsg" in host_paths
    assert any(p.startswith("/var/lib/stallwatch") for p in host_paths)
    # /dev/nvidia* come from the NVIDIA container runtime
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    toml = next(iter(cm["data"].values()))
    assert re.search(r'metrics_listen\s*=\s*"127\.0\.0\.1:9835"', toml)
    from stallwatch.daemon.config import parse_config
    cfg = parse_config(toml, "daemonset.yaml ConfigMap")  # the daemon would accept it
    assert cfg.daemon.metrics_listen == "127.0.0.1:9835" and cfg.job
    # the sidecar publishes the loopback endpoint
    proxy = next(c for c in spec["containers"] if c["name"] == "kube-rbac-proxy")
    assert "--upstream=http://127.0.0.1:9835/" in proxy["args"]


def test_slurm_scripts_are_valid_shell():
    scripts = sorted((DEPLOY / "slurm").glob("*.sh")) + sorted((DEPLOY / "slurm").glob("*.sbatch"))
    assert len(scripts) >= 2
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, f"{s}: {r.stderr}"


def test_slurm_node_script_writes_a_config_the_daemon_accepts(tmp_path):
    from stallwatch.daemon.config import parse_config
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_NODEID="3", SLURM_JOB_NUM_NODES="16",
               SLURM_JOB_NAME="extract", STALLWATCH_WORKDIR=str(tmp_path / "w"),
               STALLWATCH_OUTPUTS="/data/hs", STALLWATCH_ALERT_WEBHOOK="https://hooks.example/x")
    r = subprocess.run([str(DEPLOY / "slurm" / "stallwatch-node.sh"), "--print-config",
                        "python", "extract.py", "--shard", "{shard}", "--of", "{shards}",
                        "--tag", 'odd "quoted" \\ arg'],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30,
                       check=False)
    assert r.returncode == 0, r.stderr
    cfg = parse_config(r.stdout, "stallwatch-node.sh output")
    (job,) = cfg.job
    assert job.name == "extract-3"
    assert job.command == ("python", "extract.py", "--shard", "3", "--of", "16", "--tag",
                           'odd "quoted" \\ arg')
    assert job.restart == "on-failure" and job.max_restarts == 3
    assert cfg.daemon.metrics_listen == "127.0.0.1:9835"
    assert str(cfg.daemon.state_dir).startswith(str(tmp_path / "w"))
    # textfile instead of a port
    if "metrics_textfile" in type(cfg.daemon).model_fields:
        env.update(STALLWATCH_METRICS="", STALLWATCH_TEXTFILE=str(tmp_path / "job-4242.prom"))
        r = subprocess.run([str(DEPLOY / "slurm" / "stallwatch-node.sh"), "--print-config",
                            "python", "x.py"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=30, check=False)
        cfg = parse_config(r.stdout, "stallwatch-node.sh output")
        assert cfg.daemon.metrics_listen is None
        assert cfg.daemon.metrics_textfile == tmp_path / "job-4242.prom"


@pytest.mark.slow
@pytest.mark.parametrize("exit_code, want_rc", [(0, 0), (1, 1)])
def test_slurm_node_script_runs_the_daemon_until_the_job_ends(tmp_path, exit_code, want_rc):
    """stallwatch-node.sh with the real `stallwatch run`: a job that finishes → exit 0; a job
    that keeps failing with no restart budget → stallwatch gives up → exit 1."""
    if not (ROOT / "stallwatch" / "daemon" / "core.py").exists():
        pytest.skip("the daemon (stallwatch/daemon/) has not landed yet")
    sw = tmp_path / "sw"
    sw.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m stallwatch \"$@\"\n")
    sw.chmod(0o755)
    env = dict(os.environ, SLURM_JOB_ID="77", SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1",
               STALLWATCH=str(sw), STALLWATCH_MAX_RESTARTS="0",
               STALLWATCH_METRICS=f"127.0.0.1:{_free_port()}")
    code = f"import sys, time\nfor i in range(1, 4):\n    print(f'{{i}}/3', flush=True)\n" \
           f"    time.sleep(0.2)\nsys.exit({exit_code})"
    # its own process group: on a timeout the script and its daemon go together
    p = subprocess.Popen([str(DEPLOY / "slurm" / "stallwatch-node.sh"), sys.executable, "-c",
                          code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=tmp_path, start_new_session=True)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        import signal
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"stallwatch-node.sh did not end: {err[-2000:]}")
    assert p.returncode == want_rc, out + err
    assert ("the job finished" if want_rc == 0 else "did not finish") in err
    (log,) = tmp_path.glob("stallwatch/77/*/job.log")
    assert "3/3" in log.read_text()


def test_alertmanager_route_example_parses():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((DEPLOY / "alertmanager" / "route-example.yml").read_text())
    assert doc["route"]["receiver"] and doc["receivers"]
    assert "Stallwatch" in json.dumps(doc["route"])


def test_alertmanager_routes_with_amtool():
    """amtool (Debian: prometheus-alertmanager; .ci/run installs it for the fleet tests)."""
    amtool = shutil.which("amtool")
    if not amtool:
        pytest.skip("amtool not installed (Debian: apt-get install prometheus-alertmanager)")
    cfg = DEPLOY / "alertmanager" / "route-example.yml"
    r = subprocess.run([amtool, "check-config", str(cfg)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr

    def route(**labels: str) -> str:
        r = subprocess.run([amtool, "config", "routes", "test", f"--config.file={cfg}",
                            *[f"{k}={v}" for k, v in labels.items()]],
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert route(alertname="StallwatchJobHang", severity="critical", job="extract",
                 instance="gpu-07:9835") == "gpu-oncall-pager,gpu-oncall-slack"
    assert route(alertname="StallwatchProbeFailing", severity="warning") == "gpu-oncall-slack"
    assert route(alertname="StallwatchJobSlow", severity="info") == "pipelines-info"
    assert route(alertname="SomethingElse", severity="critical") == "default"


@pytest.mark.slow
def test_a_real_prometheus_scrapes_relabels_alerts_and_runs_the_dashboard_query(tmp_path,
                                                                                  exporter):
    """Debian's prometheus server (same package as promtool) with the shipped scrape example,
    alert rules and the dashboard's verdict query, against a live exporter and a textfile served
    the way node_exporter serves it."""
    yaml = pytest.importorskip("yaml")
    prom = shutil.which("prometheus")
    if not prom:
        pytest.skip("the prometheus server is not installed (Debian: apt-get install prometheus)")
    e = exporter("127.0.0.1:0").start()
    e.update([job_view("extract", kind="gpu_fault"), job_view("embed", kind="healthy")],
             daemon_view())
    # "node_exporter": a textfile written by another exporter, served over HTTP as is
    tf = exporter(textfile=tmp_path)
    tf.update([job_view("from-textfile", kind="hang")], None)
    tf.flush()
    import http.server

    class Node(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = tf.textfile.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    node = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Node)
    threading.Thread(target=node.serve_forever, daemon=True).start()

    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-example.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(RULES)]
    cfg.pop("alerting")
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    jobs["stallwatch"].pop("file_sd_configs")
    jobs["stallwatch"]["scrape_interval"] = "1s"
    jobs["stallwatch"]["static_configs"] = [{"targets": [f"127.0.0.1:{e.port}"]}]
    jobs["node"]["static_configs"] = [{"targets": [f"127.0.0.1:{node.server_address[1]}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    web = _free_port()
    p = subprocess.Popen([prom, f"--config.file={tmp_path / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'data'}",
                          f"--web.listen-address=127.0.0.1:{web}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def api(path: str, **params) -> list:
        url = f"http://127.0.0.1:{web}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        data = doc["data"]
        return data["result"] if "result" in data else data["alerts"]

    def until(fn, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            assert p.poll() is None, p.stderr.read().decode(errors="replace")[-2000:]
            try:
                last = fn()
                if last:
                    return last
            except OSError as err:
                last = err
            time.sleep(0.5)
        pytest.fail(f"{what}: {last}")

    import urllib.parse
    try:
        # honor_labels keeps stallwatch's job label; instance is the host
        r = until(lambda: api("query", query='stallwatch_job_verdict{kind="gpu_fault"} == 1'),
                  "verdict series")
        assert [x["metric"]["job"] for x in r] == ["extract"]
        assert r[0]["metric"]["instance"] == f"127.0.0.1:{e.port}"
        assert "exported_job" not in r[0]["metric"]
        r = until(lambda: api("query", query='up{job="stallwatch"} == 1'), "up")
        # names that look like suffixes survive Prometheus' (OpenMetrics) scrape
        for q, want in (('stallwatch_job_progress_total{job="extract"}', 37312),
                        ('stallwatch_job_restarts_total{job="extract"}', 2),
                        ('stallwatch_job_incidents_total{job="extract",kind="io_stall"}', 2),
                        ('stallwatch_tick_duration_seconds_count', 3),
                        (f'stallwatch_build_info{{version="{__version__}"}}', 1)):
            r = until(lambda q=q: api("query", query=q), q)
            assert float(r[0]["value"][1]) == want, (q, r)
        # the textfile route: the node scrape's relabelling moves exported_job back to job
        r = until(lambda: api("query", query='stallwatch_job_verdict{kind="hang"} == 1'),
                  "textfile series")
        assert [(x["metric"]["job"], "exported_job" in x["metric"]) for x in r] == [
            ("from-textfile", False)]
        # the dashboard's state-timeline query maps each job to the index of its kind
        dash = json.loads(DASHBOARD.read_text())
        expr = next(t["expr"] for pn in dash["panels"] if pn["type"] == "state-timeline"
                    for t in pn["targets"])
        expr = expr.replace("$instance", ".*").replace("$job", ".*")
        r = until(lambda: [x for x in api("query", query=expr)
                           if x["metric"]["job"] in ("extract", "embed")], "dashboard query")
        got = {x["metric"]["job"]: VERDICT_KINDS[int(float(x["value"][1]))] for x in r}
        assert got == {"extract": "gpu_fault", "embed": "healthy"}
        # an alert from the shipped rules fires on the live series
        alerts = until(lambda: [a for a in api("alerts")
                                if a["labels"]["alertname"] == "StallwatchGPUFault"
                                and a["state"] == "firing"], "StallwatchGPUFault firing")
        assert alerts[0]["labels"]["job"] == "extract"
        assert alerts[0]["annotations"]["summary"] == f"GPU fault under extract on 127.0.0.1:{e.port}"
    finally:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        node.shutdown()
        node.server_close()


# ---------------------------------------------------------------------- the real daemon

COUNTER_JOB = """
import os, sys, time
stop = sys.argv[1]
for i in range(1, 1001):
    print(f"{i}/1000", flush=True)
    if os.path.exists(stop):
        break
    time.sleep(0.1)
"""


def _daemon_wiring() -> str | None:
    """None when `stallwatch run` starts DaemonMetrics; else what is missing."""
    d = ROOT / "stallwatch" / "daemon"
    if not d.is_dir():
        return "the daemon (stallwatch/daemon/) has not landed yet"
    src = "".join(p.read_text(errors="replace") for p in d.rglob("*.py"))
    if "DaemonMetrics" not in src and "MetricsExporter" not in src:
        return ("stallwatch/daemon/core.py does not use stallwatch.daemon.metrics yet: its own "
                "_start_metrics/_update_metrics still build ad-hoc gauges (the 3 lines in "
                "docs/fleet.md, 'Wiring into the daemon', replace them)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon_config(tmp_path: Path, port: int) -> Path:
    job = tmp_path / "job.py"
    job.write_text(COUNTER_JOB)
    cfg = tmp_path / "stallwatch.toml"
    cfg.write_text(textwrap.dedent(f"""
        [daemon]
        interval_s = 0.5
        state_dir = "{tmp_path / 'state'}"
        metrics_listen = "127.0.0.1:{port}"
        systemd_run = "never"
        evidence = false

        [[job]]
        name = "counter"
        command = ["{sys.executable}", "{job}", "{tmp_path / 'stop'}"]
        log = "{tmp_path / 'job.log'}"
        restart = "on-failure"
        max_restarts = 2
    """))
    return cfg


def _check_daemon_scrape(port: int, deadline_s: float = 60.0, alive=lambda: True) -> dict:
    deadline = time.monotonic() + deadline_s
    ss: dict = {}
    while time.monotonic() < deadline:
        alive()
        try:
            ss = samples(scrape(port))
        except OSError:
            time.sleep(0.3)
            continue
        done = [v for lab, v in ss.get("stallwatch_job_progress_done", [])
                if lab["job"] == "counter"]
        ticks = [v for _, v in ss.get("stallwatch_tick_duration_seconds_count", [])]
        if done and done[0] >= 5 and ticks and ticks[0] >= 3:
            break
        time.sleep(0.3)
    verdict = {lab["kind"]: v for lab, v in ss.get("stallwatch_job_verdict", [])
               if lab["job"] == "counter"}
    assert set(verdict) == set(VERDICT_KINDS), ss.keys()
    assert sum(verdict.values()) == 1
    assert verdict["healthy"] == 1 or verdict["unknown"] == 1, verdict
    assert value(ss, "stallwatch_job_progress_total", job="counter") == 1000
    assert value(ss, "stallwatch_job_progress_done", job="counter") >= 5
    assert time.time() - 30 < value(ss, "stallwatch_job_last_progress_timestamp_seconds",
                                    job="counter") <= time.time() + 1
    assert value(ss, "stallwatch_job_state", job="counter", state="running") == 1
    assert value(ss, "stallwatch_job_restarts_total", job="counter") == 0
    assert value(ss, "stallwatch_job_max_restarts", job="counter") == 2
    assert value(ss, "stallwatch_job_incidents_total", job="counter", kind="hang") == 0
    assert value(ss, "stallwatch_tick_duration_seconds_count") >= 3
    assert value(ss, "stallwatch_tick_interval_seconds") == 0.5
    assert value(ss, "stallwatch_build_info", version=__version__) == 1
    assert value(ss, "stallwatch_probe_runs_total", probe="processes", status="ok") >= 3
    assert value(ss, "stallwatch_rule_evaluation_errors_total") == 0
    names = {k for lst in ss.values() for lab, _ in lst for k in lab}
    assert not {n for n in names if "pid" in n}
    return ss


@pytest.mark.slow
def test_the_real_daemon_with_the_exporter_wired_in(tmp_path, monkeypatch):
    """The real Daemon (in a thread, as the daemon's own tests run it) with DaemonMetrics wired
    in exactly as docs/fleet.md tells the daemon to: a supervised job, scraped over HTTP."""
    from stallwatch.daemon.config import load_config
    from stallwatch.daemon.core import Daemon
    from stallwatch.daemon.metrics_export import DaemonMetrics

    if _daemon_wiring() is not None:  # not wired yet: apply the documented wiring here
        def start(self):
            self._metrics = DaemonMetrics.from_config(self.config.daemon)

        def update(self, dur):
            if self._metrics:
                self._metrics.tick(self, dur)

        real_shutdown = Daemon.shutdown

        def shutdown(self):
            if self._metrics:
                self._metrics.close()
            real_shutdown(self)

        monkeypatch.setattr(Daemon, "_start_metrics", start)
        monkeypatch.setattr(Daemon, "_update_metrics", update)
        monkeypatch.setattr(Daemon, "shutdown", shutdown)
    port = _free_port()
    cfg = load_config(_daemon_config(tmp_path, port))
    d = Daemon(cfg, gpu=False, install_signals=False)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        assert d.started.wait(30), "the daemon did not tick"

        def alive():
            assert t.is_alive(), "the daemon stopped"

        _check_daemon_scrape(port, alive=alive)
    finally:
        (tmp_path / "stop").touch()  # the job ends itself; the daemon leaves jobs running
        time.sleep(0.5)
        d.request_stop()
        t.join(30)
    assert not t.is_alive()
    with pytest.raises(OSError):
        scrape(port)  # the endpoint closed with the daemon


@pytest.mark.slow
def test_the_real_daemon_writes_the_textfile(tmp_path):
    """`metrics_textfile` without `metrics_listen`: the daemon writes node_exporter's file, and
    its last state when it stops."""
    missing = _daemon_wiring()
    if missing:
        pytest.skip(missing)
    from stallwatch.daemon.config import load_config
    from stallwatch.daemon.core import Daemon

    tf = tmp_path / "textfile"
    tf.mkdir()
    cfg_path = _daemon_config(tmp_path, 0)
    text = cfg_path.read_text().replace('metrics_listen = "127.0.0.1:0"',
                                        f'metrics_textfile = "{tf}"')
    cfg_path.write_text(text)
    d = Daemon(load_config(cfg_path), gpu=False, install_signals=False)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    prom = tf / "stallwatch.prom"
    try:
        assert d.started.wait(30), "the daemon did not tick"
        _wait_for(prom, 30)
        ss = samples(prom.read_text())
        assert value(ss, "stallwatch_job_state", job="counter", state="starting") in (0, 1)
        time.sleep(2.5)  # a few ticks of progress; the file is rewritten at most every 10 s
    finally:
        (tmp_path / "stop").touch()
        time.sleep(0.5)
        d.request_stop()
        t.join(30)
    ss = samples(prom.read_text())  # the last state, flushed by close()
    assert value(ss, "stallwatch_tick_duration_seconds_count") >= 3
    assert value(ss, "stallwatch_job_progress_done", job="counter") >= 3
    assert value(ss, "stallwatch_job_progress_total", job="counter") == 1000
    assert sorted(p.name for p in tf.iterdir()) == ["stallwatch.prom"]


def test_the_config_refuses_a_remote_metrics_listen_unless_allowed(tmp_path):
    from stallwatch.daemon.config import parse_config
    from stallwatch.errors import UsageError

    if "metrics_allow_remote" not in __import__("stallwatch.daemon.config").daemon.config.DaemonConfig.model_fields:
        pytest.skip("DaemonConfig has no metrics_allow_remote yet")
    with pytest.raises(UsageError, match="not a loopback address"):
        parse_config('[daemon]\nmetrics_listen = "0.0.0.0:9835"\n')
    cfg = parse_config('[daemon]\nmetrics_listen = "0.0.0.0:9835"\nmetrics_allow_remote = true\n')
    assert cfg.daemon.metrics_listen == "0.0.0.0:9835"
    cfg = parse_config('[daemon]\nmetrics_listen = ":9835"\n')
    assert cfg.daemon.metrics_listen == ":9835"


@pytest.mark.slow
def test_a_running_daemon_serves_its_jobs_metrics(tmp_path):
    """`stallwatch run` as a process, once its own code starts the exporter."""
    missing = _daemon_wiring()
    if missing:
        pytest.skip(missing)
    port = _free_port()  # the config refuses port 0
    cfg = _daemon_config(tmp_path, port)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "stallwatch", "run", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=tmp_path)

    def alive():
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]

    try:
        _check_daemon_scrape(port, alive=alive)
    finally:
        (tmp_path / "stop").touch()
        time.sleep(0.5)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
