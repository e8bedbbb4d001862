"""The dispatcher's policy against a real loopback webhook: once per incident and state,
re-notification, filters, the rate limit and its summary, bounded queues, close() with a deadline.

Time for the policy comes from FakeClock; `tick()` is called explicitly (the ticker thread is off).
"""

from __future__ import annotations

import json
import time

from stallwatch.alerts import AlertDispatcher, parse_alerts
from stallwatch.clock import FakeClock

from alertkit import Reply, dispatcher, event, wait_stats


def kinds_states(reqs) -> list[tuple]:
    return [(r.json()["incident_id"], r.json()["state"], r.json().get("renotify", 0)) for r in reqs]


def test_one_firing_and_one_resolved_per_incident(receiver_factory) -> None:
    rx = receiver_factory()
    d = dispatcher([{"type": "webhook", "url": rx.url()}])
    try:
        for _ in range(5):  # the daemon may re-submit the firing event every tick
            d.submit(event(incident_id=1))
        d.submit(event(incident_id=2, kind="hang"))
        for _ in range(3):
            d.submit(event(incident_id=1, state="resolved"))
        d.submit(event(incident_id=2, kind="hang", state="resolved"))
        rx.wait_for(4)
        assert d.flush(5)
    finally:
        d.close()
    assert kinds_states(rx.requests) == [(1, "firing", 0), (2, "firing", 0), (1, "resolved", 0),
                                         (2, "resolved", 0)]
    st = d.status()
    assert st["duplicates"] == 6 and st["sinks"][0]["sent"] == 4


def test_key_falls_back_to_episode(receiver_factory) -> None:
    rx = receiver_factory()
    d = dispatcher([{"type": "webhook", "url": rx.url()}])
    try:
        d.submit(event(incident_id=None, episode=1))
        d.submit(event(incident_id=None, episode=1))
        d.submit(event(incident_id=None, episode=2))
        rx.wait_for(2)
        assert d.flush(5)
    finally:
        d.close()
    assert [r.json()["episode"] for r in rx.requests] == [1, 2]


def test_renotify_until_resolved(receiver_factory) -> None:
    rx = receiver_factory()
    clock = FakeClock()
    d = dispatcher([{"type": "webhook", "url": rx.url(), "renotify_every_s": 600},
                    {"type": "webhook", "url": rx.url("/no-reminders"), "name": "quiet"}], clock=clock)
    try:
        d.submit(event(incident_id=1))
        rx.wait_for(2)
        clock.advance(599)
        d.tick()
        # a fresher firing event (same key) is not sent again, but later reminders say it
        d.submit(event(incident_id=1, summary="extract: no progress for 10m"))
        clock.advance(1)
        d.tick()
        d.tick()  # due once, not twice
        rx.wait_for(3)
        clock.advance(600)
        d.tick()
        rx.wait_for(4)
        d.submit(event(incident_id=1, state="resolved"))
        rx.wait_for(6)
        clock.advance(6000)
        d.tick()
        assert d.flush(5)
    finally:
        d.close()
    main = [r.json() for r in rx.requests if r.path == "/hook"]
    quiet = [r.json() for r in rx.requests if r.path == "/no-reminders"]
    assert [(e["state"], e["renotify"]) for e in main] == [("firing", 0), ("firing", 1), ("firing", 2),
                                                           ("resolved", 0)]
    assert main[1]["summary"] == "extract: no progress for 10m"
    assert main[1]["at"] == clock.time() - 6000 - 600  # stamped when re-sent
    assert [(e["state"], e["renotify"]) for e in quiet] == [("firing", 0), ("resolved", 0)]


def test_filters_min_severity_kinds_send_resolved(receiver_factory) -> None:
    rx = receiver_factory()
    d = dispatcher([
        {"type": "webhook", "url": rx.url("/crit"), "min_severity": "critical"},
        {"type": "webhook", "url": rx.url("/hang"), "kinds": ["hang", "crash"]},
        {"type": "webhook", "url": rx.url("/noresolve"), "send_resolved": False},
    ])
    try:
        d.submit(event(incident_id=1, severity="warning", kind="slow"))
        d.submit(event(incident_id=2, severity="critical", kind="hang"))
        d.submit(event(incident_id=1, severity="warning", kind="slow", state="resolved"))
        d.submit(event(incident_id=2, severity="critical", kind="hang", state="resolved"))
        rx.wait_for(6)
        assert d.flush(5)
    finally:
        d.close()
    by = {}
    for r in rx.requests:
        by.setdefault(r.path, []).append((r.json()["incident_id"], r.json()["state"]))
    assert by["/crit"] == [(2, "firing"), (2, "resolved")]
    assert by["/hang"] == [(2, "firing"), (2, "resolved")]
    assert by["/noresolve"] == [(1, "firing"), (2, "firing")]
    assert d.status()["sinks"][0]["filtered"] == 2  # the warning's firing and resolved


def test_rate_limit_counts_and_summarises(receiver_factory) -> None:
    rx = receiver_factory()
    clock = FakeClock()
    d = dispatcher([{"type": "webhook", "url": rx.url(), "rate_limit_per_min": 2}], clock=clock)
    try:
        for i in range(1, 6):
            d.submit(event(incident_id=i))
        rx.wait_for(2)
        assert d.flush(5)
        st = d.status()["sinks"][0]
        assert st["rate_limited"] == 3 and st["sent"] == 2
        clock.advance(29)  # a token comes back after 30 s at 2/min
        d.tick()
        assert d.flush(5) and len(rx.requests) == 2
        clock.advance(1)
        d.tick()
        reqs = rx.wait_for(3)
        assert d.flush(5)
    finally:
        d.close()
    assert [r.json()["incident_id"] for r in reqs[:2]] == [1, 2]
    summary = reqs[2].json()
    assert summary["kind"] == "alerts_suppressed" and summary["job"] == "stallwatch"
    assert summary["summary"].startswith("3 alerts to webhook held back by its rate limit (2/min)")
    assert [e["detail"].split(" at ")[0] for e in summary["evidence"]] == [
        "extract io_stall firing"] * 3
    assert d.status()["sinks"][0]["rate_limited"] == 3


def test_test_events_bypass_filters_and_dedupe(receiver_factory) -> None:
    rx = receiver_factory()
    d = dispatcher([{"type": "webhook", "url": rx.url(), "kinds": ["crash"], "min_severity": "critical"}])
    try:
        d.submit(event(test=True, severity="info"))
        d.submit(event(test=True, severity="info"))
        rx.wait_for(2)
        assert d.flush(5)
    finally:
        d.close()
    assert all(r.json()["test"] is True for r in rx.requests)


def test_full_queue_drops_and_counts(receiver_factory) -> None:
    rx = receiver_factory([Reply(hang=True)])
    d = dispatcher([{"type": "webhook", "url": rx.url(), "queue_size": 2, "timeout_s": 5}])
    try:
        d.submit(event(incident_id=1))
        rx.wait_for(1)  # the worker holds #1 in flight; #2 and #3 fill the queue
        for i in range(2, 6):
            d.submit(event(incident_id=i))
        st = d.status()["sinks"][0]
        assert st["queued"] == 2 and st["dropped"] == 2
        assert st["last_error"] == "queue full (2 events): event dropped"
    finally:
        rx.release()
        d.close(timeout_s=5)
    assert sorted(r.json()["incident_id"] for r in rx.requests) == [1, 2, 3]


def test_close_drains_within_its_deadline(receiver_factory) -> None:
    ok_rx = receiver_factory()
    d = dispatcher([{"type": "webhook", "url": ok_rx.url()}])
    for i in range(1, 4):
        d.submit(event(incident_id=i))
    assert d.close(timeout_s=5) is True
    assert len(ok_rx.requests) == 3 and d.status()["sinks"][0]["sent"] == 3

    stuck = receiver_factory([Reply(hang=True)])
    d = dispatcher([{"type": "webhook", "url": stuck.url(), "timeout_s": 10}])
    try:
        for i in range(1, 4):
            d.submit(event(incident_id=i))
        stuck.wait_for(1)
        t0 = time.monotonic()
        assert d.close(timeout_s=0.5) is False
        took = time.monotonic() - t0
        assert took < 2.0, f"close(0.5) took {took:.2f} s"
        st = d.status()["sinks"][0]
        assert st["dropped"] == 2 and st["last_error"] == "2 event(s) not delivered before shutdown"
        d.submit(event(incident_id=9))  # after close: ignored, no exception
    finally:
        stuck.release()


def test_close_cuts_a_backoff_that_would_pass_the_deadline(receiver_factory) -> None:
    rx = receiver_factory([Reply(500, "down")])
    d = dispatcher([{"type": "webhook", "url": rx.url(), "retry_initial_s": 30}])
    d.submit(event())
    rx.wait_for(1)
    wait_stats(d, 0, lambda s: s.retrying == 1)
    t0 = time.monotonic()
    d.close(timeout_s=2)
    assert time.monotonic() - t0 < 1.5
    st = d.status()["sinks"][0]
    assert st["dropped"] == 1 and "not delivered before shutdown" in st["last_error"]
    assert st["retrying"] == 0


def test_broken_sink_is_reported_not_raised(monkeypatch) -> None:
    monkeypatch.delenv("SLACK_WEBHOOK_URL", raising=False)
    d = AlertDispatcher(parse_alerts([{"type": "slack"}], "t.toml"), tick_interval_s=None)
    try:
        d.submit(event())
        assert d.flush(5)
        st = d.status()["sinks"][0]
    finally:
        d.close()
    assert st["failed"] == 1 and not st["ok"]
    assert st["last_error"] == ("url_env: environment variable SLACK_WEBHOOK_URL (the default) "
                                "is not set")
    json.dumps(d.status())  # JSON-ready


def test_ticker_thread_sends_reminders_by_itself(receiver_factory) -> None:
    rx = receiver_factory()
    clock = FakeClock()
    d = AlertDispatcher(parse_alerts([{"type": "webhook", "url": rx.url(), "renotify_every_s": 60}],
                                     "t.toml"), clock=clock, tick_interval_s=0.05)
    try:
        d.submit(event())
        rx.wait_for(1)
        clock.advance(61)
        reqs = rx.wait_for(2, timeout=5)  # no tick() call: the ticker did it
    finally:
        d.close()
    assert reqs[1].json()["renotify"] == 1
