"""The daemon's own footprint (stallwatch/daemon/selfusage.py, psutil) and its `stallwatch_daemon_*`
series: each number moves when the process really does what it counts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
from prometheus_client.parser import text_string_to_metric_families

from stallwatch.daemon.metrics import DaemonStats
from stallwatch.daemon.metrics_export import MetricsExporter
from stallwatch.daemon.selfusage import SelfUsage, read_self_usage


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("stallwatch_daemon_")}


def test_each_number_follows_what_the_process_does():
    before = read_self_usage()
    assert before is not None and before.threads >= 1 and before.open_fds is not None
    pipes = [os.pipe() for _ in range(5)]  # 10 descriptors
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="cost2-extra")
    t.start()
    ballast = bytearray(64 << 20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touch every page: resident
    cpu_end = time.process_time() + 0.2
    while time.process_time() < cpu_end:  # burn 0.2 s of CPU, whatever the load
        pass
    try:
        after = read_self_usage()
        assert after is not None
        assert after.open_fds - before.open_fds == 10
        assert after.threads - before.threads == 1
        assert after.rss_bytes - before.rss_bytes >= 48 << 20
        assert after.cpu_s - before.cpu_s >= 0.15
    finally:
        stop.set()
        t.join()
        for r, w in pipes:
            os.close(r)
            os.close(w)
        del ballast


def test_a_process_that_is_gone_reads_as_none_not_an_error():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(p.pid)
    p.wait()  # reaped: the pid no longer exists
    assert read_self_usage(proc) is None


def test_series_in_the_daemon_scrape_and_absent_when_unreadable():
    e = MetricsExporter()
    e.update([], DaemonStats(interval_s=1.0).view())
    types = {f.name: f.type for f in text_string_to_metric_families(e.render())}
    assert types["stallwatch_daemon_cpu_seconds"] == "counter"
    assert types["stallwatch_daemon_resident_memory_bytes"] == "gauge"
    ss = _samples(e.render())
    assert ss["stallwatch_daemon_threads"] >= 1
    assert ss["stallwatch_daemon_open_fds"] >= 3
    assert ss["stallwatch_daemon_resident_memory_bytes"] > 10 << 20

    fixed = SelfUsage(cpu_s=1.5, rss_bytes=55_812_096, open_fds=None, threads=12)
    e2 = MetricsExporter(self_usage=lambda: fixed)
    e2.update([], DaemonStats().view())
    assert _samples(e2.render()) == {"stallwatch_daemon_cpu_seconds_total": 1.5,
                                     "stallwatch_daemon_resident_memory_bytes": 55_812_096.0,
                                     "stallwatch_daemon_threads": 12.0}  # no fd count: no series

    e3 = MetricsExporter(self_usage=lambda: None)
    e3.update([], DaemonStats().view())
    assert _samples(e3.render()) == {}
    e4 = MetricsExporter()
    e4.update([], None)  # no daemon view (a one-shot export): not the daemon's footprint
    assert _samples(e4.render()) == {}
