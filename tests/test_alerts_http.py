"""Slack and webhook sinks against real loopback HTTP servers: payloads, retries, failures.

The `Receiver` rig (also imported by the other test_alerts_* files) is an http.server in a
thread that records every request and answers from a script: 200 "ok", 429 with Retry-After,
500, or "hang" (the handler blocks on an Event until the test releases it — a receiver slower
than the sink's timeout). Tests synchronise on its received-request condition, with deadlines.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from collections.abc import Callable

import pytest

from stallwatch.alerts import AlertDispatcher, parse_alerts, sample_event
from stallwatch.alerts.redact import REDACTOR
from stallwatch.alerts.events import AlertEvent, EvidenceLine, ProgressInfo

SECRET_TOKEN = "Xq7SECRETtokenZZ9"
SLACK_PATH = f"/services/T0TEAM/B0HOOK/{SECRET_TOKEN}"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when it arrived

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    status: int = 200
    body: str = "ok"
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False  # block until Receiver.release() (or 30 s), then answer


class Receiver:
    """A loopback HTTP server that records requests and answers from a script.

    `script` is a list of Reply consumed in order (the last one repeats), or a function of the
    request number (0-based) returning a Reply.
    """

    def __init__(self, script: list[Reply] | Callable[[int], Reply] | None = None) -> None:
        self.script = script or [Reply()]
        self.requests: list[Recorded] = []
        self.cond = threading.Condition()
        self.released = threading.Event()
        rig = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                with rig.cond:
                    i = len(rig.requests)
                    rig.requests.append(Recorded("POST", self.path, dict(self.headers.items()),
                                                 body, time.monotonic()))
                    rig.cond.notify_all()
                reply = rig.reply(i)
                if reply.hang:
                    rig.released.wait(30.0)
                data = reply.body.encode()
                try:
                    self.send_response(reply.status)
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def reply(self, i: int) -> Reply:
        if callable(self.script):
            return self.script(i)
        return self.script[min(i, len(self.script) - 1)]

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_for(self, n: int, timeout: float = 10.0) -> list[Recorded]:
        """Block until at least n requests arrived; TimeoutError saying how many did."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.requests) >= n, timeout):
                raise TimeoutError(f"expected {n} requests within {timeout:g} s, got {len(self.requests)}")
            return list(self.requests)

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver_factory():
    made: list[Receiver] = []

    def make(script=None) -> Receiver:
        r = Receiver(script)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture(autouse=True)
def _forget_secrets():
    yield
    REDACTOR.forget_all()


def event(job: str = "extract", kind: str = "io_stall", state: str = "firing", incident_id: int = 7,
          **kw: Any) -> AlertEvent:
    base = dict(
        job=job, kind=kind, state=state, severity="critical", host="gpu-node-3",
        summary=f"{job}: no progress for 41 s; pid 1234 in D on /data (nvme0n1)",
        evidence=(EvidenceLine(signal="process", detail="pid 1234 thread 1240 in D for 41 s, wchan percpu_rwsem_wait"),
                  EvidenceLine(signal="disk", detail="/data on /dev/loop3: 0 I/O completed in 40 s"),
                  EvidenceLine(signal="log", detail="last progress 41 s ago: '18380/37312'"),
                  EvidenceLine(signal="gpu", detail="GPU 0 at 0% for 40 s")),
        advice=("Check the filesystem /data: it is frozen or its device does not answer.",),
        incident_id=incident_id, episode=1, started_at=1_700_000_000.0, at=1_700_000_041.0,
        progress=ProgressInfo(done=18380, total=37312, rate_per_s=1.02, eta_s=18560, last_progress_age_s=41),
    )
    if state == "resolved":
        base.update(resolved_at=1_700_000_300.0, at=1_700_000_300.0, summary=f"{job}: progressing again")
    base.update(kw)
    return AlertEvent(**base)


def dispatcher(tables: list[dict[str, Any]], **kw: Any) -> AlertDispatcher:
    kw.setdefault("tick_interval_s", None)
    return AlertDispatcher(parse_alerts(tables, "test.toml"), **kw)


FAST = {"retry_initial_s": 0.05, "retry_max_s": 0.2}


def wait_stats(d: AlertDispatcher, i: int, pred: Callable[[Any], bool], timeout: float = 10.0) -> None:
    """Block until sink i's counters satisfy pred (woken by every change the worker makes)."""
    r = d._runners[i]
    with r.cond:
        if not r.cond.wait_for(lambda: pred(r.stats), timeout):
            raise TimeoutError(f"sink {r.name}: {r.stats} after {timeout:g} s")


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
