"""The server probe against a real loopback HTTP server speaking SGLang's endpoints."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stallwatch.clock import FakeClock
from stallwatch.probes.server import ServerObs, ServerProbe, parse_metrics


class FakeSGLang:
    """Just enough of sglang.srt.entrypoints.http_server: switchable health, gates that hold a
    request open until the test releases it, and a /metrics body the test sets."""

    def __init__(self) -> None:
        self.health_status = 200
        self.has_health_generate = True
        self.health_gate: threading.Event | None = None
        self.info_gate: threading.Event | None = None
        self.metrics_body = b""
        self.metrics_content_length = True
        self.paths: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                fake.paths.append(self.path)
                if self.path == "/health_generate" and not fake.has_health_generate:
                    return self.reply(404, b'{"detail":"Not Found"}')
                if self.path in ("/health", "/health_generate"):
                    if fake.health_gate is not None:
                        fake.health_gate.wait(30)
                    return self.reply(fake.health_status, b"")
                if self.path == "/server_info":
                    if fake.info_gate is not None:
                        fake.info_gate.wait(30)
                    return self.reply(200, json.dumps({"version": "0.5.23", "tp_size": 2}).encode())
                if self.path == "/model_info":
                    return self.reply(200, json.dumps({"model_path": "meta-llama/Llama-3.1-8B-Instruct",
                                                       "is_generation": True}).encode())
                if self.path == "/metrics":
                    return self.reply(200, fake.metrics_body, length=fake.metrics_content_length,
                                      ctype="text/plain; version=0.0.4; charset=utf-8")
                return self.reply(404, b'{"detail":"Not Found"}')

            def reply(self, code: int, body: bytes, length: bool = True, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass  # the probe hung up on an oversized body: that is the point

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        for gate in (self.health_gate, self.info_gate):
            if gate is not None:
                gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeSGLang]:
    s = FakeSGLang()
    s.metrics_body = sglang_metrics()
    try:
        yield s
    finally:
        s.close()


def sglang_metrics(gen: tuple[float, float] = (100, 50), prompt: float = 1000, reqs: float = 10,
                   running: float = 2, queued: float = 0, fwd: float = 3.0, idle: float = 1.0,
                   usage: tuple[float, float] = (0.25, 0.5)) -> bytes:
    """A /metrics body in the exposition format prometheus_client writes, with SGLang's names
    and per-tp_rank label sets (as with --enable-metrics-for-all-schedulers)."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine_type", "tp_rank", "pp_rank"]
    g = Counter("sglang:generation_tokens", "Generation tokens", labels, registry=reg)
    p = Counter("sglang:prompt_tokens", "Prompt tokens", labels, registry=reg)
    n = Counter("sglang:num_requests", "Requests", labels, registry=reg)
    f = Counter("sglang:forward_execution_seconds", "Forward time", labels + ["category"], registry=reg)
    i = Counter("sglang:scheduler_idle_seconds", "Idle time", labels, registry=reg)
    r = Gauge("sglang:num_running_reqs", "Running", labels, registry=reg)
    q = Gauge("sglang:num_queue_reqs", "Queued", labels, registry=reg)
    u = Gauge("sglang:token_usage", "Token usage", labels, registry=reg)
    h = Histogram("sglang:e2e_request_latency_seconds", "E2E", labels, registry=reg, buckets=(1, 10))
    for rank in (0, 1):
        lv = ["m", "unified", str(rank), "0"]
        g.labels(*lv).inc(gen[rank])
        if rank == 0:
            p.labels(*lv).inc(prompt)
            n.labels(*lv).inc(reqs)
            f.labels(*lv, "prefill").inc(fwd / 3)
            f.labels(*lv, "decode").inc(fwd * 2 / 3)
            i.labels(*lv).inc(idle)
            h.labels(*lv).observe(2.0)
        r.labels(*lv).set(running / 2)
        q.labels(*lv).set(queued / 2)
        u.labels(*lv).set(usage[rank])
    return generate_latest(reg)


def test_healthy_server(server: FakeSGLang) -> None:
    probe = ServerProbe(server.url, health_timeout_s=5, collect_wait_s=5)
    probe.collect()
    assert probe.wait_health(5)
    obs = probe.collect()
    assert obs.reachable is True and obs.error is None and obs.port == server.port
    assert obs.health.ok and obs.health.path == "/health_generate" and obs.health.status_code == 200
    assert obs.health.latency_s >= 0 and obs.health.age_s >= 0 and obs.health.in_flight_for_s is None
    assert obs.server_info.ok and obs.version == "0.5.23"
    assert obs.model_info.ok and obs.model_path == "meta-llama/Llama-3.1-8B-Instruct"
    m = obs.metrics
    assert m.ok and m.counters["sglang:generation_tokens_total"] == 150  # summed over tp ranks
    assert m.counters["sglang:forward_execution_seconds_total"] == pytest.approx(3.0)
    assert m.counters["sglang:e2e_request_latency_seconds_count"] == 1
    assert m.gauges["sglang:num_running_reqs"] == 2 and m.gauges["sglang:token_usage"] == 0.5
    assert ServerObs.model_validate_json(obs.model_dump_json()) == obs


def test_health_falls_back_to_health_on_404(server: FakeSGLang) -> None:
    server.has_health_generate = False
    probe = ServerProbe(server.url, health_timeout_s=5, health_interval_s=0)
    assert probe.wait_health(5)
    obs = probe.collect()
    assert obs.health.ok and obs.health.path == "/health"
    assert probe.wait_health(5) and probe.wait_health(5)
    assert server.paths.count("/health_generate") == 1  # remembered: not asked again
    assert server.paths.count("/health") >= 3


def test_health_503_is_a_failed_check(server: FakeSGLang) -> None:
    server.health_status = 503
    probe = ServerProbe(server.url, health_timeout_s=5)
    assert probe.wait_health(5)
    h = probe.collect().health
    assert h.ok is False and h.status_code == 503 and "HTTP 503" in h.error and not h.timed_out


def test_slow_health_in_flight_beyond_budget_does_not_block_the_tick(server: FakeSGLang) -> None:
    clock = FakeClock()
    server.health_gate = threading.Event()
    probe = ServerProbe(server.url, clock=clock, health_timeout_s=25, collect_wait_s=5,
                        health_interval_s=3600)  # so the last collect shows this check, not a new one
    t0 = time.monotonic()
    obs = probe.collect()
    assert time.monotonic() - t0 < 2.0  # the tick waited for the quick endpoints only
    assert obs.health.ok is None and obs.health.in_flight_for_s == 0 and not obs.health.overdue
    assert obs.metrics.ok and obs.reachable  # everything else answered meanwhile

    clock.advance(30)
    obs = probe.collect()
    assert obs.health.in_flight_for_s == 30 and obs.health.overdue  # evidence: 30 s > 25 s budget
    assert server.paths.count("/health_generate") == 1  # never a second check piled on the first

    server.health_gate.set()
    assert probe.wait_health(5)
    h = probe.collect().health
    assert h.ok and h.latency_s == 30 and h.age_s == 0 and h.in_flight_for_s is None


def test_server_info_hanging_is_a_timeout_signal(server: FakeSGLang) -> None:
    server.info_gate = threading.Event()
    probe = ServerProbe(server.url, health_timeout_s=5, info_timeout_s=0.3, collect_wait_s=3)
    t0 = time.monotonic()
    obs = probe.collect()
    assert time.monotonic() - t0 < 2.0
    info = obs.server_info
    assert info.ok is False and info.timed_out and info.error == "GET /server_info did not answer within 0.3 s"
    assert obs.model_info.ok and obs.reachable  # the HTTP process is alive; the schedulers are not


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused_is_server_down_evidence() -> None:
    port = free_port()
    probe = ServerProbe(f"http://127.0.0.1:{port}", health_timeout_s=5, collect_wait_s=5)
    probe.collect()
    assert probe.wait_health(5)
    obs = probe.collect()
    assert obs.reachable is False and obs.error == f"connection refused by 127.0.0.1:{port}"
    for r in (obs.health, obs.server_info, obs.model_info, obs.metrics_endpoint):
        assert r.ok is False and r.status_code is None
    assert obs.metrics.ok is False and obs.port == port


def test_garbage_metrics_is_reported_not_raised(server: FakeSGLang) -> None:
    probe = ServerProbe(server.url, collect_wait_s=5)
    for body in (b"\x00\xff\xfe garbage {{{ not prometheus\n", b"sglang:x{a=\"1\" 12\n", b"# TYPE x counter\nx_total abc\n"):
        server.metrics_body = body
        m = probe.collect().metrics
        assert m.ok is False and m.error.startswith("unparseable /metrics"), body
    server.metrics_body = sglang_metrics()
    assert probe.collect().metrics.ok  # and it recovers on the next good scrape


@pytest.mark.parametrize("content_length", [True, False])
def test_huge_metrics_is_capped(server: FakeSGLang, content_length: bool) -> None:
    server.metrics_body = b"sglang:num_running_reqs 1\n" * 40_000  # ~1 MiB
    server.metrics_content_length = content_length
    probe = ServerProbe(server.url, collect_wait_s=5, max_response_bytes=64 << 10)
    obs = probe.collect()
    assert obs.metrics_endpoint.ok is False and "exceeds the 65536 byte cap" in obs.metrics_endpoint.error
    assert obs.metrics.ok is False and obs.reachable


def test_counter_rates_across_scrapes_with_fake_clock(server: FakeSGLang) -> None:
    clock = FakeClock()
    probe = ServerProbe(server.url, clock=clock, collect_wait_s=5)
    first = probe.collect().metrics
    assert first.ok and first.rates_per_s == {} and first.interval_s is None

    clock.advance(2.0)
    server.metrics_body = sglang_metrics(gen=(400, 50), prompt=1600, reqs=14, fwd=5.0, idle=1.5)
    m = probe.collect().metrics
    assert m.interval_s == 2.0 and m.age_s == 0
    assert m.rates_per_s["sglang:generation_tokens_total"] == pytest.approx(150.0)
    assert m.rates_per_s["sglang:prompt_tokens_total"] == pytest.approx(300.0)
    assert m.rates_per_s["sglang:num_requests_total"] == pytest.approx(2.0)
    assert m.rates_per_s["sglang:forward_execution_seconds_total"] == pytest.approx(1.0)
    assert m.rates_per_s["sglang:scheduler_idle_seconds_total"] == pytest.approx(0.25)
    assert m.progress_unchanged_for_s == 0 and not m.gauges_possibly_stale

    # The scheduler hangs: counters freeze, the mostrecent gauges keep claiming 2 running requests.
    for _ in range(2):
        clock.advance(5.0)
        m = probe.collect().metrics
    assert m.rates_per_s["sglang:generation_tokens_total"] == 0
    assert m.progress_unchanged_for_s == 10.0 and m.gauges_possibly_stale
    assert m.gauges_unchanged_for_s == 12.0 and m.gauges["sglang:num_running_reqs"] == 2

    # Relaunched on the same port: counters start over; no negative rate, the reset is named.
    clock.advance(1.0)
    server.metrics_body = sglang_metrics(gen=(3, 0), prompt=10, reqs=1)
    m = probe.collect().metrics
    assert "sglang:generation_tokens_total" in m.counter_resets
    assert "sglang:generation_tokens_total" not in m.rates_per_s and m.progress_unchanged_for_s == 0


def test_parse_metrics_untyped_and_non_finite() -> None:
    counters, gauges, families = parse_metrics(
        "sglang:realtime_tokens_total{mode=\"prefill\"} 5\nsglang:realtime_tokens_total{mode=\"decode\"} 7\n"
        "sglang:gen_throughput 12.5\nsglang:cache_hit_rate NaN\n")
    assert counters == {"sglang:realtime_tokens_total": 12} and gauges == {"sglang:gen_throughput": 12.5}
    assert families == 4  # the NaN family is counted, its sample dropped


def test_url_parsing() -> None:
    assert (ServerProbe("http://10.0.0.5:30000").port, ServerProbe("http://10.0.0.5:30000").host) == (30000, "10.0.0.5")
    assert ServerProbe("http://example").port == 80 and ServerProbe("https://example/").port == 443
    assert ServerProbe("127.0.0.1:8000").port == 8000
    assert ServerProbe("http://gw:8080/sglang/")._prefix == "/sglang"


def test_a_call_stuck_from_an_earlier_tick_is_not_waited_for_again(server: FakeSGLang) -> None:
    server.info_gate = threading.Event()
    probe = ServerProbe(server.url, health_timeout_s=5, info_timeout_s=20, info_interval_s=0,
                        collect_wait_s=0.5)
    probe.collect()  # starts /server_info, which hangs; this tick waits collect_wait_s for it
    t0 = time.monotonic()
    obs = probe.collect()
    assert time.monotonic() - t0 < 0.4
    assert obs.server_info.in_flight_for_s > 0 and obs.server_info.ok is None
    assert server.paths.count("/server_info") == 1
