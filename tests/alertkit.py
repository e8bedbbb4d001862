"""Alert receivers and the helpers the alert tests share.

`Receiver` is an http.server in a thread that records every request and answers from a script:
200 "ok", 429 with Retry-After, 500, or "hang" (the handler blocks on an Event until the test
releases it: a receiver slower than the sink's timeout). Tests synchronise on its
received-request condition, with deadlines. It is the one loopback receiver of the suite: the
alert sinks' tests, the daemon's (the `webhook` and `receiver_factory` fixtures in conftest.py)
and the fleet's (fleetkit.WebhookReceiver) all post to it.

`event()` is a realistic AlertEvent, `dispatcher()` an AlertDispatcher of sink tables,
`deliver()` the submit-flush-status round most sink tests make.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from collections.abc import Callable

from stallwatch.alerts import AlertDispatcher, parse_alerts
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
    wall: float  # time.time() when it arrived: what end-to-end tests set against their faults

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    status: int = 200
    body: str = "ok"
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False  # block until Receiver.release() (or 30 s), then answer


class Receiver:
    """A loopback HTTP server that records requests and answers from a script: the receiving end
    of a Slack or webhook sink, of Alertmanager's webhook_configs, of a daemon's alerts.

    `script` is a list of Reply consumed in order (the last one repeats), or a function of the
    request number (0-based) returning a Reply. `bodies` is every request's JSON body (None
    where it is not JSON), kept in step with `requests`, for tests that hold on to the list.
    """

    def __init__(self, script: list[Reply] | Callable[[int], Reply] | None = None) -> None:
        self.script = script or [Reply()]
        self.requests: list[Recorded] = []
        self.bodies: list[Any] = []
        self.cond = threading.Condition()
        self.released = threading.Event()
        rig = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                rec = Recorded("POST", self.path, dict(self.headers.items()), body,
                               time.monotonic(), time.time())
                try:
                    doc = rec.json()
                except ValueError:
                    doc = None
                with rig.cond:
                    i = len(rig.requests)
                    rig.requests.append(rec)
                    rig.bodies.append(doc)
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

    def wait(self, match: Callable[[Recorded], bool], timeout: float, what: str) -> Recorded:
        """The first request that matches, waiting on arrivals; TimeoutError showing what came."""
        with self.cond:
            if not self.cond.wait_for(lambda: any(match(r) for r in self.requests), timeout):
                got = [(r.path, r.body[:200]) for r in self.requests]
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}; "
                                   f"requests so far: {got}")
            return next(r for r in self.requests if match(r))

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


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


def deliver(tables: list[dict[str, Any]], *events: AlertEvent, flush_s: float = 10.0,
            **kw: Any) -> dict[str, Any]:
    """Submit `events` (one default event if none) to a dispatcher of `tables`, wait until its
    sinks are done with them (asserted), and return its status, read before it closes."""
    d = dispatcher(tables, **kw)
    try:
        for e in events or (event(),):
            d.submit(e)
        assert d.flush(flush_s)
        return d.status()
    finally:
        d.close()
