"""Pieces the many-node end-to-end tests share (tests/test_fleet_e2e.py, tests/test_slurm_e2e.py):
a webhook receiver that records every delivery with its arrival time, a stallwatch launcher
that runs this checkout, and service processes that always die in teardown (the sweep that
kills what a test left running is rigs.kill_naming).

Import as `from fleetkit import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from alertkit import Receiver, Recorded

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


class WebhookReceiver(Receiver):
    """The suite's receiver as Alertmanager's webhook_configs and stallwatch's own webhook sink
    see it: JSON deliveries, by receiver name (the URL path), with their arrival times."""

    @staticmethod
    def _delivery(r: Recorded) -> Delivery:
        try:
            body = r.json()
        except ValueError:
            body = {"raw": r.body.decode(errors="replace")}
        return Delivery(r.wall, r.path.strip("/"), body)

    @property
    def deliveries(self) -> list[Delivery]:
        with self.cond:
            return [self._delivery(r) for r in self.requests]

    def url(self, name: str = "") -> str:
        return super().url(f"/{name}")

    def wait(self, match: Callable[[Delivery], bool], timeout: float, what: str) -> Delivery:
        """The first delivery that matches, waiting on arrivals (no polling sleep)."""
        try:
            return self._delivery(super().wait(lambda r: match(self._delivery(r)), timeout, what))
        except TimeoutError as e:
            got = [(d.path, d.body.get("status"), d.body.get("groupLabels"))
                   for d in self.deliveries]
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}; "
                               f"deliveries so far: {got}") from e


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
