"""sd_notify against a real AF_UNIX datagram socket, as systemd listens on one."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from stallwatch.daemon.sdnotify import Notifier, notify


@pytest.fixture
def listener(tmp_path: Path):
    path = tmp_path / "notify.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(5)
    yield str(path), s
    s.close()


def recv(s: socket.socket) -> dict[str, str]:
    data = s.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


def test_ready_watchdog_status_stopping(listener) -> None:
    path, s = listener
    n = Notifier(path)
    assert n.enabled
    assert n.ready("1 job: extract healthy")
    assert recv(s) == {"READY": "1", "STATUS": "1 job: extract healthy"}
    assert n.watchdog()
    assert recv(s) == {"WATCHDOG": "1"}
    assert n.status("line one\nline two")  # one assignment per line: newlines are flattened
    assert recv(s) == {"STATUS": "line one line two"}
    assert n.reloading()
    msg = recv(s)
    assert msg["RELOADING"] == "1" and int(msg["MONOTONIC_USEC"]) > 0
    assert n.stopping()
    assert recv(s) == {"STOPPING": "1"}
    n.close()


def test_abstract_namespace_address() -> None:
    name = f"stallwatch-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        n = Notifier("@" + name)
        assert n.send(READY=1)
        assert recv(s) == {"READY": "1"}
    finally:
        s.close()


def test_environment_and_disabled(listener, monkeypatch: pytest.MonkeyPatch) -> None:
    path, s = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify(READY=1)
    assert recv(s) == {"READY": "1"}
    monkeypatch.delenv("NOTIFY_SOCKET")
    n = Notifier()
    assert not n.enabled and not n.ready() and not n.watchdog()
    assert not Notifier("vsock:2:1234").enabled  # not an AF_UNIX address: silently off


def test_socket_gone_is_not_an_error(tmp_path: Path) -> None:
    n = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert n.send(WATCHDOG=1) is False
    assert n.errors == 1 and n.last_error


def test_watchdog_usec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier("/x").watchdog_usec() == 60_000_000
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert Notifier("/x").watchdog_usec() is None


def test_a_receiver_that_stops_reading_never_blocks_the_sender(listener) -> None:
    # A full receive queue: a blocking sendto would hang here (and the daemon's tick with it).
    path, s = listener
    n = Notifier(path)
    sent = 0
    while n.send(WATCHDOG=1, STATUS="x" * 200):
        sent += 1
        assert sent < 100_000, "the queue never filled"
    assert sent > 0 and n.errors == 1 and n.last_error
    # Once the receiver reads again, the next heartbeat goes through on a fresh socket.
    s.recv(4096)
    assert n.send(WATCHDOG=1)
