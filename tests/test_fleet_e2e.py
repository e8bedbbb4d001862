"""A fleet for real (issue 19): three "hosts" as network namespaces, a stallwatch in each watching
its own job and serving metrics on the host's own address, Debian's Prometheus scraping all three
with the shipped scrape config and alert rules, Debian's Alertmanager routing with the shipped
routes and inhibitions to a local webhook receiver.

    host 2's job stopped (SIGSTOP)  -> one notification per receiver, naming host 2 and its job
    host 2's job continued          -> one resolved notification per receiver
    host 3's stallwatch killed      -> the "not watching" alert (StallwatchExporterDown) for host 3
    nothing else, for any host

What the test changes in its copies of the shipped files, and only this: scrape and evaluation
every 2 s and evaluation every second, the rules' `for` durations divided by 30 (5m -> 10s: the
expressions, labels and annotations are the shipped ones), Alertmanager's group_wait/group_interval in seconds, each
receiver's integrations replaced by a webhook to the receiver named like it (repeat_interval,
routes, matchers, continue and inhibit_rules are kept: they are what decides "exactly one").
The deliveries' arrival times against the moments of fault and recovery are the numbers quoted
in docs/fleet.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
from fleetkit import ROOT, Services, WebhookReceiver, dashboard_panels, free_port, stallwatch_exe
from rigs import kill_naming, wait_until

yaml = pytest.importorskip("yaml")

pytestmark = [pytest.mark.slow, pytest.mark.root]

DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "stallwatch-alerts.yml"
PROM_EXAMPLE = DEPLOY / "prometheus" / "prometheus-example.yml"
ROUTES = DEPLOY / "alertmanager" / "route-example.yml"
DASHBOARD = DEPLOY / "grafana" / "stallwatch-dashboard.json"
JOB = ROOT / "tests" / "jobs" / "extract_like.py"
HOSTS = (1, 2, 3)
METRICS_PORT = 9835


def _need() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces (ip netns) and veth pairs")
    for tool, pkg in (("ip", "iproute2"), ("prometheus", "prometheus"),
                      ("prometheus-alertmanager", "prometheus-alertmanager"),
                      ("amtool", "prometheus-alertmanager")):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed (Debian: apt-get install --no-install-recommends "
                        f"{pkg}; .ci/run does)")


# ------------------------------------------------------------------------ the test's copies

_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def scaled_rules(text: str) -> str:
    """The shipped rules with every `for` divided by 30 (5m -> 10s), and nothing else changed.
    Not less: a scrape that misses its deadline on a loaded machine makes a series stale, and a
    `for` of a few scrapes would turn one slow scrape into an alert."""
    def one(m: re.Match) -> str:
        s = int(m.group(2)) * _UNIT_S[m.group(3)]
        return f"{m.group(1)}{s // 30 if s >= 30 else (1 if s else 0)}s"
    out, n = re.subn(r"^(\s+for: )(\d+)([smh])\s*$", one, text, flags=re.M)
    assert n >= 15, f"expected the shipped rules' `for`s, rewrote {n}"
    return out


def test_scaled_rules_change_only_the_for_durations():
    text = RULES.read_text()
    scaled = scaled_rules(text)
    a, b = yaml.safe_load(text), yaml.safe_load(scaled)
    fors = {}
    for ga, gb in zip(a["groups"], b["groups"], strict=True):
        for ra, rb in zip(ga["rules"], gb["rules"], strict=True):
            fors[ra["alert"]] = (ra["for"], rb["for"])
            ra.pop("for"), rb.pop("for")
    assert a == b
    assert fors["StallwatchJobHang"] == ("5m", "10s")
    assert fors["StallwatchExporterDown"] == ("5m", "10s")
    assert fors["StallwatchGPUFault"] == ("0m", "0s")


def alertmanager_config(hook: WebhookReceiver) -> dict:
    """The shipped routes, each receiver a webhook to hook/<receiver name>, timings in seconds."""
    cfg = yaml.safe_load(ROUTES.read_text())

    def fast(route: dict) -> None:
        if "group_wait" in route:
            route["group_wait"] = "1s"
        if "group_interval" in route:
            route["group_interval"] = "2s"
        for r in route.get("routes", []):
            fast(r)

    fast(cfg["route"])
    receivers = []
    for r in cfg["receivers"]:
        integrations = [v for k, v in r.items() if k.endswith("_configs")]
        # send_resolved as shipped: PagerDuty's default is true, the others say it
        resolved = all(c.get("send_resolved", True) for cs in integrations for c in cs)
        new = {"name": r["name"]}
        if integrations:
            new["webhook_configs"] = [{"url": hook.url(r["name"]), "send_resolved": resolved}]
        receivers.append(new)
    cfg["receivers"] = receivers
    return cfg


def prometheus_config(rules: Path, am_port: int, targets: list[str]) -> dict:
    cfg = yaml.safe_load(PROM_EXAMPLE.read_text())
    cfg["global"] = {"scrape_interval": "2s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(rules)]
    cfg["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{am_port}"]}]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    sw = jobs["stallwatch"]
    sw.pop("file_sd_configs")
    sw["scrape_interval"] = "2s"
    sw["scrape_timeout"] = "2s"
    sw["static_configs"] = [{"targets": targets, "labels": {"cluster": "fleet-test"}}]
    cfg["scrape_configs"] = [sw]  # no node_exporter here: the textfile route is test_metrics'
    return cfg


# ------------------------------------------------------------------------------ the hosts

class Netns:
    """Host i: namespace <tag>-h<i>, a veth pair, 10.<net>.<i>.2/30 inside and .1 outside."""

    def __init__(self, tag: str, net: int, i: int) -> None:
        self.name = f"{tag}-h{i}"
        self.outer, self.inner = f"{tag}o{i}", f"{tag}i{i}"
        self.addr, self.gw = f"10.{net}.{i}.2", f"10.{net}.{i}.1"
        self.made = False

    def up(self) -> None:
        def ip(*a: str, ns: str | None = None) -> None:
            argv = ["ip", *(["-n", ns] if ns else []), *a]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
        ip("netns", "add", self.name)
        self.made = True
        ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        ip("link", "set", self.inner, "netns", self.name)
        ip("addr", "add", f"{self.gw}/30", "dev", self.outer)
        ip("link", "set", self.outer, "up")
        ip("addr", "add", f"{self.addr}/30", "dev", self.inner, ns=self.name)
        ip("link", "set", self.inner, "up", ns=self.name)
        ip("link", "set", "lo", "up", ns=self.name)

    def down(self) -> None:
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True, timeout=30,
                       check=False)
        if self.made:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30,
                           check=False)


def host_config(d: Path, i: int, addr: str) -> Path:
    command = [sys.executable, str(JOB), "--out", str(d / "out"), "--n", "100000",
               "--sample-s", "0.2", "--sample-bytes", "256"]
    cfg = d / "stallwatch.toml"
    cfg.write_text(f"""
[daemon]
interval_s = 0.5
state_dir = "{d / 'state'}"
metrics_listen = "{addr}:{METRICS_PORT}"
metrics_allow_remote = true    # the namespace's own address: Prometheus scrapes it from outside
systemd_run = "never"
evidence = false

[[job]]
name = "extract-{i}"
command = {json.dumps(command)}
cwd = "{d}"
log = "{d / 'job.log'}"
restart = "no"                  # the fault must outlive stallwatch's own recovery to page
startup_grace_s = 1             # a fleet's jobs have run for hours: past the grace of a new run
""")
    cfg.chmod(0o644)
    return cfg


def job_status(d: Path, sw: Path) -> dict | None:
    r = subprocess.run([str(sw), "status", "--config", str(d / "stallwatch.toml"), "--json"],
                       capture_output=True, text=True, timeout=60, check=False)
    try:
        return json.loads(r.stdout)["jobs"][0]
    except (ValueError, KeyError, IndexError):
        return None


# ------------------------------------------------------------------------------------ test

def test_three_hosts_one_fault_one_page(tmp_path):
    _need()
    tag = f"swf{os.getpid() % 100000}"
    net = 200 + os.getpid() % 50  # 10.200-249.x.0/30: private, only these namespaces
    hosts = {i: Netns(tag, net, i) for i in HOSTS}
    hook = WebhookReceiver()
    svc = Services(tmp_path)
    sw = stallwatch_exe(tmp_path)
    marker = str(tmp_path)
    try:
        for h in hosts.values():
            h.up()
        dirs = {}
        for i, h in hosts.items():
            dirs[i] = tmp_path / f"host{i}"
            dirs[i].mkdir()
            cfg = host_config(dirs[i], i, h.addr)
            svc.start(f"stallwatch-{i}", ["ip", "netns", "exec", h.name, str(sw), "run",
                                          "--config", str(cfg)])

        (tmp_path / "rules.yml").write_text(scaled_rules(RULES.read_text()))
        am_port, prom_port = free_port(), free_port()
        am_cfg = tmp_path / "alertmanager.yml"
        am_cfg.write_text(yaml.safe_dump(alertmanager_config(hook)))
        r = subprocess.run(["amtool", "check-config", str(am_cfg)], capture_output=True,
                           text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        svc.start("alertmanager", ["prometheus-alertmanager", f"--config.file={am_cfg}",
                                   f"--storage.path={tmp_path / 'am'}",
                                   f"--web.listen-address=127.0.0.1:{am_port}",
                                   "--cluster.listen-address="])
        targets = {i: f"{h.addr}:{METRICS_PORT}" for i, h in hosts.items()}
        prom_cfg = tmp_path / "prometheus.yml"
        prom_cfg.write_text(yaml.safe_dump(prometheus_config(tmp_path / "rules.yml", am_port,
                                                             list(targets.values()))))
        r = subprocess.run(["promtool", "check", "config", str(prom_cfg)], capture_output=True,
                           text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        svc.start("prometheus", ["prometheus", f"--config.file={prom_cfg}",
                                 f"--storage.tsdb.path={tmp_path / 'prom'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"])

        def api(path: str, **params: str):
            url = f"http://127.0.0.1:{prom_port}/api/v1/{path}"
            if params:
                url += "?" + urllib.parse.urlencode(params)
            with urllib.request.urlopen(url, timeout=5) as resp:
                doc = json.loads(resp.read())
            assert doc["status"] == "success", doc
            return doc["data"]

        def query(q: str) -> list:
            for name in ("prometheus", "alertmanager", "stallwatch-1", "stallwatch-2"):
                svc.alive(name)
            try:
                return api("query", query=q)["result"]
            except OSError:
                return []

        # all three scraped, all three jobs healthy, each under its own host
        healthy = wait_until(lambda: len(r := query(
            'stallwatch_job_verdict{kind="healthy"} == 1 and on(instance) up == 1')) == 3 and r,
            timeout=90, what="three healthy jobs scraped from three hosts")
        assert {(x["metric"]["instance"], x["metric"]["job"]) for x in healthy} == {
            (targets[i], f"extract-{i}") for i in HOSTS}

        check_dashboard(api)

        # the fault: host 2's job stops (SIGSTOP: alive, every thread in T, no progress)
        pid = wait_until(lambda: (job_status(dirs[2], sw) or {}).get("pid"), 30, "host 2's job pid")
        t_fault = time.time()
        os.kill(pid, signal.SIGSTOP)

        def on(receiver: str, status: str, alertname: str):
            def match(d):
                return (d.path == receiver and d.body.get("status") == status
                        and any(a["labels"].get("alertname") == alertname
                                for a in d.body.get("alerts", [])))
            return match

        page = hook.wait(on("gpu-oncall-pager", "firing", "StallwatchJobHang"), 90,
                         "the page for host 2's hang")
        t_page = page.at
        (alert,) = page.body["alerts"]
        assert alert["labels"]["instance"] == targets[2]
        assert alert["labels"]["job"] == "extract-2"
        assert alert["labels"]["severity"] == "critical"
        assert alert["annotations"]["summary"] == f"extract-2 on {targets[2]} hangs"
        hook.wait(on("gpu-oncall-slack", "firing", "StallwatchJobHang"), 30, "the Slack post")
        # activeAt: when Prometheus first saw the verdict (the alert went pending)
        (rule,) = [a for a in api("alerts")["alerts"]
                   if a["labels"]["alertname"] == "StallwatchJobHang"]
        pending = _unix(rule["activeAt"])

        # the recovery: the job continues, its verdict turns healthy, the alert resolves
        t_recover = time.time()
        os.kill(pid, signal.SIGCONT)
        done = hook.wait(on("gpu-oncall-pager", "resolved", "StallwatchJobHang"), 90,
                         "the resolved page for host 2")
        t_resolved = done.at
        hook.wait(on("gpu-oncall-slack", "resolved", "StallwatchJobHang"), 30,
                  "the resolved Slack post")

        # host 3's stallwatch dies: its endpoint goes away, "not watching" for host 3
        t_kill = time.time()
        svc.stop("stallwatch-3", signal.SIGKILL)
        down = hook.wait(on("gpu-oncall-pager", "firing", "StallwatchExporterDown"), 90,
                         "StallwatchExporterDown for host 3")
        (alert,) = down.body["alerts"]
        assert alert["labels"]["instance"] == targets[3]
        assert alert["labels"]["job"] == "stallwatch"
        hook.wait(on("gpu-oncall-slack", "firing", "StallwatchExporterDown"), 30,
                  "the Slack post for host 3")

        # Nothing else: a few more evaluation and group intervals, then every delivery so far.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            time.sleep(0.5)  # quiet time on purpose: nothing may arrive in it
        seen = []
        for d in hook.deliveries:
            for a in d.body["alerts"]:
                seen.append((d.path, d.body["status"], a["labels"]["alertname"],
                             a["labels"]["instance"]))
        want = sorted([(rx, st, "StallwatchJobHang", targets[2])
                       for rx in ("gpu-oncall-pager", "gpu-oncall-slack")
                       for st in ("firing", "resolved")]
                      + [(rx, "firing", "StallwatchExporterDown", targets[3])
                         for rx in ("gpu-oncall-pager", "gpu-oncall-slack")])
        assert sorted(seen) == want, seen
        # and Alertmanager itself holds only host 3's alert now
        with urllib.request.urlopen(f"http://127.0.0.1:{am_port}/api/v2/alerts", timeout=5) as resp:
            active = json.loads(resp.read())
        assert [(a["labels"]["alertname"], a["labels"]["instance"]) for a in active] == [
            ("StallwatchExporterDown", targets[3])]

        (inc,) = job_status(dirs[2], sw)["incidents"]
        assert inc["kind"] == "hang" and inc["resolved_at"]
        timings = {"fault_to_page_s": round(t_page - t_fault, 1),
                   "fault_to_verdict_in_prometheus_s": round(pending - t_fault, 1),
                   "fault_to_stallwatch_incident_s": round(inc["started_at"] - t_fault, 1),
                   "recovery_to_resolved_s": round(t_resolved - t_recover, 1),
                   "daemon_killed_to_page_s": round(down.at - t_kill, 1)}
        (tmp_path / "timings.json").write_text(json.dumps(timings))
        print("fleet timings:", json.dumps(timings))
        print("the page:", json.dumps(page.body, indent=1))
    finally:
        svc.close()
        kill_naming(marker)
        hook.close()
        for h in hosts.values():
            h.down()


def _unix(rfc3339: str) -> float:
    """Prometheus' timestamps (nanoseconds, Z) as Unix time."""
    m = re.match(r"(.*T\d\d:\d\d:\d\d)(\.\d{1,6})?\d*Z$", rfc3339)
    assert m, rfc3339
    return datetime.fromisoformat(m.group(1) + (m.group(2) or "") + "+00:00").timestamp()


def check_dashboard(api) -> None:
    """Every query of the Grafana dashboard runs on the real Prometheus: its variables resolve
    to the hosts and jobs it scraped, and every stallwatch_* metric it names is one these
    daemons serve (GPU series only exist where NVML does; their metadata is served all the
    same)."""
    dash = json.loads(DASHBOARD.read_text())
    served = set(api("label/__name__/values"))
    meta = api("metadata")
    # metadata names families: counters without _total, histograms without their suffixes
    known = served | {f"{m}{suffix}" for m in meta
                      for suffix in ("", "_total", "_bucket", "_count", "_sum")}
    values = {}
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
        assert m, f"variable {var['name']}: unexpected query {q}"
        series, label = m.groups()
        series = series.replace("$instance", ".*").replace("${instance}", ".*")
        got = api(f"label/{label}/values", **{"match[]": series})
        assert got, f"variable {var['name']} ({q}) resolves to nothing"
        values[var["name"]] = got
    assert {"instance", "job"} <= set(values)
    n = 0
    for p in dashboard_panels(dash):
        for t in p.get("targets", []):
            expr = t.get("expr")
            if not expr:
                continue
            for m in set(re.findall(r"\bstallwatch_\w+", expr)):
                assert m in known, f"panel {p.get('title')!r} queries {m}, which nobody serves"
            q = (expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
                 .replace("$__range", "1h"))
            for name, vals in values.items():
                q = q.replace(f"${{{name}}}", "|".join(vals)).replace(f"${name}", "|".join(vals))
            api("query", query=q)  # parses and runs: status success
            n += 1
    assert n >= 15, n
