"""Pieces the many-node end-to-end tests share (tests/test_fleet_e2e.py, tests/test_slurm_e2e.py):
a webhook receiver that records every delivery with its arrival time, a stallwatch launcher
that runs this checkout, and service processes that always die in teardown (the sweep that
kills what a test left running is rigs.kill_naming).

Import as `from fleetkit import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import ctypes
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stallwatch_exe(where: Path) -> Path:
    """A `stallwatch` executable that runs this checkout with this interpreter (Slurm and
    `ip netns exec` start it by path, outside pytest's environment)."""
    where.mkdir(parents=True, exist_ok=True)
    sw = where / "stallwatch"
    sw.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m stallwatch \"$@\"\n")
    sw.chmod(0o755)
    return sw


@dataclass
class Delivery:
    at: float  # time.time() when it arrived
    path: str  # the receiver's name: the URL path without its slash
    body: dict[str, Any]


@dataclass
class WebhookReceiver:
    """HTTP POSTs recorded as they come: Alertmanager's webhook_configs and stallwatch's own
    webhook sink both post JSON."""
    deliveries: list[Delivery] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        rx = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = {"raw": raw.decode(errors="replace")}
                self.send_response(200)
                self.end_headers()
                with rx.arrived:
                    rx.deliveries.append(Delivery(time.time(), self.path.strip("/"), body))
                    rx.arrived.notify_all()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="webhook", daemon=True).start()

    def url(self, name: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def wait(self, match: Callable[[Delivery], bool], timeout: float, what: str) -> Delivery:
        """The first delivery that matches, waiting on arrivals (no polling sleep)."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while True:
                hit = next((d for d in self.deliveries if match(d)), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if left <= 0:
                    got = [(d.path, d.body.get("status"), d.body.get("groupLabels"))
                           for d in self.deliveries]
                    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}; "
                                       f"deliveries so far: {got}")
                self.arrived.wait(left)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Services:
    """Long-running processes of one test, each with its output in a file; all stopped, TERM
    then KILL, in reverse order, by `close()`."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=_die_with_parent, **kw)
        self.procs.append((name, p))
        return p

    def log(self, name: str) -> str:
        try:
            return (self.logs / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def alive(self, name: str) -> None:
        """Fails loudly, with the end of its log, when a service died."""
        p = dict(self.procs)[name]
        if p.poll() is not None:
            raise AssertionError(f"{name} exited with {p.returncode}: {self.log(name)[-3000:]}")

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        p = dict(self.procs)[name]
        _stop(p, sig)

    def close(self) -> None:
        for _name, p in reversed(self.procs):
            _stop(p, signal.SIGTERM)


def _die_with_parent() -> None:
    """In the child: SIGKILL when pytest dies (killed by a timeout, it runs no teardown), so
    no munged, slurmctld, Prometheus or stallwatch outlives the test run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stop(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=15)


def dashboard_panels(dash: dict) -> list[dict]:
    """Every panel of a Grafana dashboard, rows' nested panels included."""
    out: list[dict] = []

    def walk(ps: list[dict]) -> None:
        for p in ps:
            out.append(p)
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out
