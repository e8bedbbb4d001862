"""The server probe against a real loopback HTTP server speaking SGLang's endpoints."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from rigs import wait_until
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from stallwatch.clock import FakeClock
from stallwatch.probes.server import ServerObs, ServerProbe, parse_metrics

from fakes import FakeSGLang, sglang_metrics


@pytest.fixture
def server() -> Iterator[FakeSGLang]:
    s = FakeSGLang()
    s.metrics_body = sglang_metrics()
    try:
        yield s
    finally:
        s.close()


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
    assert m.ok and m.counters["sglang:generation_tokens_total"] == 150
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


def test_server_info_hanging_stays_one_call_in_flight(server: FakeSGLang) -> None:
    """Upstream serialises get_internal_state with no timeout: a call we abandoned would still
    queue behind the slow batch and the next would pile up after it. So the one call stays in
    flight, reported overdue past its budget, and no second call is made meanwhile."""
    server.info_gate = threading.Event()
    probe = ServerProbe(server.url, health_timeout_s=5, info_timeout_s=0.3, info_interval_s=0,
                        collect_wait_s=3)
    t0 = time.monotonic()
    obs = probe.collect()
    assert time.monotonic() - t0 < 2.0  # waited for the call's budget, not collect_wait_s
    wait_until(lambda: probe.collect().server_info.overdue, 10, "/server_info to be overdue")
    for _ in range(5):
        obs = probe.collect()
    info = obs.server_info
    assert info.overdue and info.in_flight_for_s >= 0.3 and info.ok is None
    assert server.paths.count("/server_info") == 1  # the old code had called it again each tick
    assert obs.model_info.ok and obs.reachable  # the HTTP process is alive; the schedulers are not
    server.info_gate.set()
    wait_until(lambda: probe.collect().server_info.ok, 10, "/server_info to answer")


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
    for body in (b"\x00\xff\xfe garbage {{{ not prometheus\n", b"sglang:x{a=\"1\" 12\n",
                 b"# TYPE x counter\nx_total abc\n"):
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


def test_old_routes_on_0_5_4_fallback_once_and_remembered(server: FakeSGLang) -> None:
    """SGLang 0.5.0-0.5.5 have only /get_server_info and /get_model_info (docs/upstream.md §3): the old
    code asked /server_info forever and never saw the schedulers' answer (or their silence)."""
    server.old_routes = True
    probe = ServerProbe(server.url, info_interval_s=0, model_info_interval_s=0, collect_wait_s=5)
    for _ in range(3):
        obs = probe.collect()
    assert obs.server_info.ok and obs.server_info.path == "/get_server_info"
    assert obs.model_info.ok and obs.model_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert obs.info_route == "/get_server_info" and obs.version == "0.5.23"
    assert server.paths.count("/server_info") == 1 and server.paths.count("/model_info") == 1
    assert server.paths.count("/get_server_info") == 3


def test_current_routes_never_touch_the_deprecated_ones(server: FakeSGLang) -> None:
    probe = ServerProbe(server.url, info_interval_s=0, collect_wait_s=5)
    for _ in range(2):
        obs = probe.collect()
    assert obs.info_route == "/server_info" and obs.server_info.ok
    assert not [p for p in server.paths if p.startswith("/get_")]  # each logs a deprecation warning


def test_watchdog_timeout_from_server_args_outlives_a_hang(server: FakeSGLang) -> None:
    server.server_args = {"watchdog_timeout": 120.0, "soft_watchdog_timeout": None}
    probe = ServerProbe(server.url, info_timeout_s=0.3, info_interval_s=0, collect_wait_s=5)
    obs = probe.collect()
    assert obs.watchdog_timeout_s == 120.0 and obs.soft_watchdog_timeout_s is None
    server.info_gate = threading.Event()  # the schedulers stop answering
    wait_until(lambda: probe.collect().server_info.overdue, 10, "/server_info to be overdue")
    assert probe.collect().watchdog_timeout_s == 120.0  # still known from the last answer
    server.info_gate.set()


def _ranked_gauges(dp: int, tp: int, running: list[int], queued: list[int]) -> bytes:
    reg = CollectorRegistry()
    labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"]
    r = Gauge("sglang:num_running_reqs", "Running", labels, registry=reg)
    q = Gauge("sglang:num_queue_reqs", "Queued", labels, registry=reg)
    u = Gauge("sglang:token_usage", "Token usage", labels, registry=reg)
    for d in range(dp):
        for t in range(tp):
            lv = ["m", "unified", str(t), "0", str(d)]
            r.labels(*lv).set(running[d])
            q.labels(*lv).set(queued[d])
            u.labels(*lv).set(0.1 * (t + 1))
    return generate_latest(reg)


def test_metrics_at_tp4_with_all_schedulers_report_true_counts() -> None:
    """--enable-metrics-for-all-schedulers: each of the 4 TP ranks exports its group's gauges;
    the old sum said 4x the running and queued requests."""
    _, gauges, _ = parse_metrics(_ranked_gauges(1, 4, running=[7], queued=[3]).decode())
    assert gauges["sglang:num_running_reqs"] == 7 and gauges["sglang:num_queue_reqs"] == 3
    assert gauges["sglang:token_usage"] == pytest.approx(0.4)
    # two DP groups of TP2: different requests, so the groups add up; the ranks do not
    _, gauges, _ = parse_metrics(_ranked_gauges(2, 2, running=[5, 2], queued=[1, 0]).decode())
    assert gauges["sglang:num_running_reqs"] == 7 and gauges["sglang:num_queue_reqs"] == 1


def test_health_checks_moving_realtime_tokens_are_not_progress(server: FakeSGLang) -> None:
    """realtime_tokens_total counts each health check's 1-token prefill (docs/upstream.md §3): on an idle
    server polled by stallwatch it moves, and the old code called that progress."""
    clock = FakeClock()
    probe = ServerProbe(server.url, clock=clock, collect_wait_s=5)
    base = sglang_metrics(running=0)

    def scrape(realtime: int) -> object:
        server.metrics_body = base + (
            "# TYPE sglang:realtime_tokens counter\n"
            f'sglang:realtime_tokens_total{{mode="prefill_compute",tp_rank="0"}} {realtime}\n').encode()
        return probe.collect().metrics

    scrape(10)
    for n in range(1, 4):
        clock.advance(10.0)
        m = scrape(10 + n)  # one health check per scrape, nothing else
    assert m.rates_per_s["sglang:realtime_tokens_total"] == pytest.approx(0.1)
    assert m.progress_unchanged_for_s == 30.0
