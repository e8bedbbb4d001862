"""Slack and webhook sinks against real loopback HTTP servers (alertkit.Receiver): payloads,
retries, failures."""

from __future__ import annotations

import itertools
import json
import logging
import time

import pytest

from stallwatch.alerts import sample_event
from stallwatch.alerts.redact import REDACTOR

from alertkit import FAST, SECRET_TOKEN, SLACK_PATH, Reply, dispatcher, event, wait_stats


@pytest.fixture(autouse=True)
def _forget_secrets():
    yield
    REDACTOR.forget_all()


# --------------------------------------------------------------------------------- Slack


def test_slack_block_kit_message(receiver_factory, monkeypatch) -> None:
    rx = receiver_factory()
    monkeypatch.setenv("SLACK_WEBHOOK_URL", rx.url(SLACK_PATH))
    d = dispatcher([{"type": "slack"}])
    try:
        d.submit(event())
        d.submit(event(state="resolved"))
        reqs = rx.wait_for(2)
        assert d.flush(5)
    finally:
        d.close()
    assert all(r.path == SLACK_PATH for r in reqs)
    assert reqs[0].headers["Content-Type"].startswith("application/json")
    msg = reqs[0].json()
    types = [b["type"] for b in msg["blocks"]]
    assert types[0] == "header" and types[-1] == "context"
    assert types.count("section") >= 4
    header = msg["blocks"][0]["text"]
    assert header["type"] == "plain_text"
    assert "I/O stall" in header["text"] and "extract" in header["text"]
    main = msg["blocks"][1]
    assert "no progress for 41 s" in main["text"]["text"]
    fields = [f["text"] for f in main["fields"]]
    assert any("*Host*" in f and "gpu-node-3" in f for f in fields)
    assert any("*Job*" in f and "extract" in f for f in fields)
    assert any("io_stall" in f for f in fields)
    texts = [b["text"]["text"] for b in msg["blocks"] if b["type"] == "section"]
    evidence = next(t for t in texts if t.startswith("*Evidence*"))
    assert evidence.count("\n• ") == 3  # the three strongest
    assert "percpu_rwsem_wait" in evidence and "GPU 0" not in evidence
    progress = next(t for t in texts if t.startswith("*Progress*"))
    assert "18,380 / 37,312 (49%)" in progress and "ETA 5h 09m" in progress
    assert any(t.startswith("*Advice*") and "frozen" in t for t in texts)
    ctx = msg["blocks"][-1]["elements"][0]["text"]
    assert "incident 7" in ctx and "2023-11-14 22:13:20 UTC" in ctx
    assert msg["text"].startswith("\U0001F534 I/O stall") and "gpu-node-3" in msg["text"]

    resolved = reqs[1].json()
    assert "blocks" not in resolved
    att = resolved["attachments"][0]
    assert att["color"] == "#2EB67D"
    assert [b["type"] for b in att["blocks"]] == ["section", "context"]
    assert "Resolved" in att["blocks"][0]["text"]["text"] and "after 5m" in att["blocks"][0]["text"]["text"]
    assert resolved["text"].startswith("\u2705 Resolved: I/O stall")
    st = d.status()["sinks"][0]
    assert st["sent"] == 2 and st["failed"] == 0 and st["ok"]


def test_slack_mrkdwn_is_escaped_and_mention_added(receiver_factory) -> None:
    rx = receiver_factory()
    d = dispatcher([{"type": "slack", "url": rx.url(SLACK_PATH), "mention": "<!here>"}])
    try:
        d.submit(event(summary="queue <empty> & stuck"))
        msg = rx.wait_for(1)[0].json()
    finally:
        d.close()
    assert msg["blocks"][1]["text"]["text"] == "<!here> queue &lt;empty&gt; &amp; stuck"
    assert msg["text"].startswith("<!here> ")


def test_slack_429_honours_retry_after(receiver_factory) -> None:
    rx = receiver_factory([Reply(429, "rate_limited", {"Retry-After": "1"}), Reply(200, "ok")])
    d = dispatcher([{"type": "slack", "url": rx.url(SLACK_PATH), **FAST}])
    try:
        d.submit(event())
        reqs = rx.wait_for(2, timeout=10)
        assert d.flush(5)
        st = d.status()["sinks"][0]
    finally:
        d.close()
    gap = reqs[1].at - reqs[0].at
    assert gap >= 0.9, f"retried after {gap:.2f} s, Retry-After said 1 s"
    assert reqs[0].body == reqs[1].body
    assert st["sent"] == 1 and st["retries"] == 1 and st["failed"] == 0
    assert "HTTP 429" in st["last_error"]  # the last error stays visible after the recovery


def test_slack_5xx_backs_off_exponentially(receiver_factory) -> None:
    rx = receiver_factory([Reply(500, "oops"), Reply(503, "busy"), Reply(500, "oops"), Reply(200, "ok")])
    d = dispatcher([{"type": "slack", "url": rx.url(SLACK_PATH), "retry_initial_s": 0.1,
                     "retry_max_s": 5}])
    try:
        d.submit(event())
        reqs = rx.wait_for(4, timeout=10)
        assert d.flush(5)
        st = d.status()["sinks"][0]
    finally:
        d.close()
    gaps = [b.at - a.at for a, b in itertools.pairwise(reqs)]
    # waits of 0.1, 0.2, 0.4 s ± 10 % jitter: lower bounds (a loaded machine only adds)
    assert gaps[0] >= 0.09 and gaps[1] >= 0.18 and gaps[2] >= 0.36, gaps
    assert st["sent"] == 1 and st["retries"] == 3 and st["retrying"] == 0


def test_slack_4xx_is_not_retried(receiver_factory, caplog) -> None:
    rx = receiver_factory([Reply(400, "invalid_payload")])
    d = dispatcher([{"type": "slack", "url": rx.url(SLACK_PATH), **FAST}])
    try:
        with caplog.at_level(logging.INFO, logger="stallwatch.alerts"):
            d.submit(event())
            rx.wait_for(1)
            assert d.flush(5)
        st = d.status()["sinks"][0]
    finally:
        d.close()
    assert len(rx.requests) == 1
    assert st["failed"] == 1 and st["sent"] == 0 and not st["ok"]
    assert st["last_error"] == "Slack answered HTTP 400: invalid_payload"
    assert any("failed" in r.getMessage() and "invalid_payload" in r.getMessage() for r in caplog.records)


def test_slow_slack_times_out_and_never_blocks_submit_or_other_sinks(receiver_factory) -> None:
    slow = receiver_factory([Reply(hang=True)])
    hook = receiver_factory()
    d = dispatcher([{"type": "slack", "url": slow.url(SLACK_PATH), "timeout_s": 0.5,
                     "max_attempts": 2, **FAST},
                    {"type": "webhook", "url": hook.url()}])
    try:
        d.submit(event(incident_id=1))
        slow.wait_for(1)  # Slack is now hanging on the first event
        t0 = time.perf_counter()
        for i in range(2, 52):
            d.submit(event(incident_id=i))
        per_submit = (time.perf_counter() - t0) / 50
        assert per_submit < 0.02, f"submit took {per_submit * 1000:.1f} ms while Slack hangs"
        # the webhook got every event while Slack was still stuck on its first one
        got = hook.wait_for(20, timeout=10)  # rate limit: the first 20 go out at once
        assert d.status()["sinks"][0]["sent"] == 0
        assert {r.json()["incident_id"] for r in got} >= set(range(1, 21))
        # Slack's first event: timed out twice (max_attempts=2), reported
        wait_stats(d, 0, lambda s: s.failed >= 1)
        st = d.status()["sinks"][0]
        assert "Slack did not answer within 0.5 s" in st["last_error"]
        assert st["failed"] >= 1 and not st["ok"]
        assert d.status()["sinks"][1]["ok"]
    finally:
        slow.release()
        d.close(timeout_s=0.2)


def test_slack_unreachable_is_reported(receiver_factory) -> None:
    rx = receiver_factory()
    url = rx.url(SLACK_PATH)
    rx.close()  # nothing listens there now
    d = dispatcher([{"type": "slack", "url": url, "max_attempts": 2, **FAST}])
    try:
        d.submit(event())
        assert d.flush(10)
        st = d.status()["sinks"][0]
    finally:
        d.close()
    assert st["failed"] == 1 and st["retries"] == 1
    assert st["last_error"].startswith("Slack refused the connection")
    assert SECRET_TOKEN not in json.dumps(d.status())


# ------------------------------------------------------------------------------- webhook


def test_webhook_posts_the_json_contract(receiver_factory) -> None:
    rx = receiver_factory([Reply(204, "")])
    d = dispatcher([{"type": "webhook", "url": rx.url("/alerts"),
                     "headers": {"Authorization": "Bearer abc123456789", "X-Team": "ml"}}])
    try:
        d.submit(event())
        d.submit(event(state="resolved"))
        reqs = rx.wait_for(2)
        assert d.flush(5)
    finally:
        d.close()
    first, second = reqs[0].json(), reqs[1].json()
    for doc in (first, second):
        for key in ("job", "kind", "state", "summary", "evidence", "stallwatch_version"):
            assert key in doc
    assert first["state"] == "firing" and second["state"] == "resolved"
    assert first["job"] == "extract" and first["kind"] == "io_stall"
    assert first["evidence"][0] == {"signal": "process",
                                    "detail": "pid 1234 thread 1240 in D for 41 s, wchan percpu_rwsem_wait"}
    assert first["progress"]["eta_s"] == 18560 and first["incident_id"] == 7
    assert reqs[0].headers["Authorization"] == "Bearer abc123456789"
    assert reqs[0].headers["X-Team"] == "ml"
    assert reqs[0].headers["Content-Type"] == "application/json"
    assert reqs[0].headers["User-Agent"].startswith("stallwatch/")
    st = d.status()["sinks"][0]
    assert st["sent"] == 2 and "abc123456789" not in json.dumps(d.status())


def test_webhook_retries_5xx_then_gives_up(receiver_factory) -> None:
    rx = receiver_factory([Reply(502, "bad gateway")])
    d = dispatcher([{"type": "webhook", "url": rx.url(), "max_attempts": 3, **FAST}])
    try:
        d.submit(event())
        rx.wait_for(3)
        assert d.flush(5)
        st = d.status()["sinks"][0]
    finally:
        d.close()
    assert len(rx.requests) == 3
    assert st["failed"] == 1 and st["sent"] == 0 and st["retries"] == 2
    assert st["last_error"] == (f"webhook http://127.0.0.1:{rx.port}/*** answered HTTP 502: bad gateway "
                                "(gave up after 3 attempts)")


def test_webhook_timeout_is_retried(receiver_factory) -> None:
    def script(i: int) -> Reply:
        return Reply(hang=True) if i == 0 else Reply(200, "ok")

    rx = receiver_factory(script)
    d = dispatcher([{"type": "webhook", "url": rx.url(), "timeout_s": 0.3, **FAST}])
    try:
        d.submit(event())
        reqs = rx.wait_for(2, timeout=10)
        assert d.flush(5)
        st = d.status()["sinks"][0]
    finally:
        rx.release()
        d.close()
    assert reqs[1].at - reqs[0].at >= 0.3
    assert st["sent"] == 1 and st["retries"] == 1
    assert "did not answer within 0.3 s" in st["last_error"]


def test_sample_event_is_a_realistic_test_io_stall() -> None:
    e = sample_event("node-1")
    assert e.test and e.kind == "io_stall" and e.state == "firing" and e.host == "node-1"
    assert len(e.evidence) >= 3 and e.progress is not None and e.advice


def test_slack_reminder_and_test_headers(receiver_factory) -> None:
    rx = receiver_factory()
    d = dispatcher([{"type": "slack", "url": rx.url(SLACK_PATH)}])
    try:
        d.submit(event(renotify=2, incident_id=1))
        d.submit(sample_event("node-1"))
        reqs = rx.wait_for(2)
    finally:
        d.close()
    reminder, test = (r.json() for r in reqs)
    assert reminder["blocks"][0]["text"]["text"] == "\U0001F501 Still firing: I/O stall \u2014 extract"
    assert "reminder 2" in reminder["blocks"][-1]["elements"][0]["text"]
    assert test["blocks"][0]["text"]["text"] == "\U0001F9EA [TEST] I/O stall \u2014 extract"
    assert "sent by `stallwatch alert test`" in test["blocks"][-1]["elements"][0]["text"]
