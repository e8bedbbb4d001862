"""Desktop notifications through a real dbus-daemon session bus to python-dbusmock's
notification_daemon template, checked by its recorded Notify calls: the direct route (the daemon
in a user session), the gdbus fallback, and the spool → per-user agent → Notify route.

The bus is started here (`dbus-daemon --session --print-address`); tests wait on D-Bus signals
(NameOwnerChanged, the mock's MethodCalled) with deadlines.
"""

from __future__ import annotations

import json
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from stallwatch.alerts.config import parse_alerts
from stallwatch.alerts.desktop import Agent, DesktopSink, Spool, notify, render

from alertkit import deliver, dispatcher, event

if not shutil.which("dbus-daemon"):
    pytest.skip("dbus-daemon is not installed (apt-get install dbus): no session bus to test on",
                allow_module_level=True)
jeepney = pytest.importorskip("jeepney", reason="jeepney (the test's D-Bus client) is not installed: "
                              "pip install -e '.[test]'")
pytest.importorskip("dbusmock", reason="python-dbusmock is not installed (needs libdbus-1-dev "
                    "libglib2.0-dev pkg-config to build dbus-python): pip install -e '.[test]'")

from jeepney import DBusAddress, MatchRule, new_method_call  # noqa: E402 - after importorskip: without dbusmock the module is skipped first
from jeepney.bus_messages import message_bus  # noqa: E402 - after importorskip: without dbusmock the module is skipped first
from jeepney.io.blocking import Proxy, open_dbus_connection  # noqa: E402 - after importorskip: without dbusmock the module is skipped first

NOTIF = "org.freedesktop.Notifications"
NOTIF_PATH = "/org/freedesktop/Notifications"
MOCK_IFACE = "org.freedesktop.DBus.Mock"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bus_address(tmp_path_factory) -> Iterator[str]:
    log = open(tmp_path_factory.mktemp("dbus") / "dbus-daemon.log", "w")  # noqa: SIM115 - dbus-daemon's stderr for the module's life
    p = subprocess.Popen(["dbus-daemon", "--session", "--print-address=1", "--nofork", "--nopidfile"],
                         stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 10.0)
        if not ready:
            pytest.fail("dbus-daemon printed no address within 10 s")
        addr = p.stdout.readline().strip()
        assert addr.startswith("unix:"), addr
        yield addr
    finally:
        p.terminate()
        p.wait(10)
        log.close()


class NotificationServer:
    """python-dbusmock's notification_daemon on the test bus, and a client that reads its calls."""

    def __init__(self, address: str, logdir: Path) -> None:
        self.address = address
        self.conn = open_dbus_connection(bus=address)
        bus = Proxy(message_bus, self.conn)
        owner = MatchRule(type="signal", sender="org.freedesktop.DBus", interface="org.freedesktop.DBus",
                          member="NameOwnerChanged", path="/org/freedesktop/DBus")
        owner.add_arg_condition(0, NOTIF)
        bus.AddMatch(owner)
        self.called = MatchRule(type="signal", interface=MOCK_IFACE, member="MethodCalled", path=NOTIF_PATH)
        bus.AddMatch(self.called)
        self._called_q = self.conn.filter(self.called, bufsize=1000)
        self._called_queue = self._called_q.__enter__()
        self.log = open(logdir / "dbusmock.log", "w")  # noqa: SIM115 - the mock's log, closed in stop()
        with self.conn.filter(owner) as q:
            self.proc = subprocess.Popen([sys.executable, "-m", "dbusmock", "--session", "-t",
                                          "notification_daemon"],
                                         env={**os.environ, "DBUS_SESSION_BUS_ADDRESS": address},
                                         stdout=self.log, stderr=subprocess.STDOUT)
            msg = self.conn.recv_until_filtered(q, timeout=20)
            assert msg.body[0] == NOTIF and msg.body[2], msg.body
        self.mock = DBusAddress(NOTIF_PATH, bus_name=NOTIF, interface=MOCK_IFACE)

    def wait_notify(self, n: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Block until n more Notify calls were made (the mock's MethodCalled signal)."""
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"expected {n} Notify calls within {timeout:g} s, saw {seen}")
            msg = self.conn.recv_until_filtered(self._called_queue, timeout=left)
            if msg.body[0] == "Notify":
                seen += 1
        return self.calls()

    def calls(self) -> list[dict[str, Any]]:
        reply = self.conn.send_and_get_reply(new_method_call(self.mock, "GetMethodCalls", "s", ("Notify",)),
                                             timeout=5)
        out = []
        for _ts, args in reply.body[0]:
            vals = [v for _sig, v in args]
            hints = {k: v for k, (_s, v) in vals[6].items()}
            out.append({"app_name": vals[0], "replaces_id": vals[1], "icon": vals[2], "summary": vals[3],
                        "body": vals[4], "actions": vals[5], "hints": hints, "expire_timeout": vals[7]})
        return out

    def clear(self) -> None:
        self.conn.send_and_get_reply(new_method_call(self.mock, "ClearCalls"), timeout=5)
        self._called_queue.clear()

    def close(self) -> None:
        self._called_q.__exit__(None, None, None)
        self.proc.terminate()
        self.proc.wait(10)
        self.conn.close()
        self.log.close()


@pytest.fixture(scope="module")
def server(bus_address: str, tmp_path_factory) -> Iterator[NotificationServer]:
    s = NotificationServer(bus_address, tmp_path_factory.mktemp("mock"))
    yield s
    s.close()


@pytest.fixture
def notifications(server: NotificationServer) -> NotificationServer:
    server.clear()
    return server


def desktop(**kw: Any):
    return parse_alerts([{"type": "desktop", **kw}], "t.toml")[0]


# ------------------------------------------------------------------------------- direct


def test_direct_notify_from_a_user_session(notifications, bus_address, monkeypatch) -> None:
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", bus_address)
    d = dispatcher([{"type": "desktop"}])
    try:
        assert d.status()["sinks"][0]["target"] == "desktop notifications on this session bus"
        d.submit(event())
        calls = notifications.wait_notify(1)
        d.submit(event(state="resolved"))
        calls = notifications.wait_notify(1)
        assert d.flush(5)
        st = d.status()["sinks"][0]
    finally:
        d.close()
    assert st["sent"] == 2 and st["ok"]
    fire, res = calls
    assert fire["app_name"] == "stallwatch"
    assert fire["summary"] == "I/O stall \u2014 extract"
    body = fire["body"].splitlines()
    assert body[0] == "extract: no progress for 41 s; pid 1234 in D on /data (nvme0n1)"
    assert body[1] == "• process: pid 1234 thread 1240 in D for 41 s, wchan percpu_rwsem_wait"
    assert sum(1 for b in body if b.startswith("• ")) == 3
    assert any(b.startswith("Progress: 18,380 / 37,312 (49%)") and "ETA 5h 09m" in b for b in body)
    assert any(b.startswith("→ Check the filesystem /data") for b in body)
    assert fire["hints"]["urgency"] == 2
    assert fire["replaces_id"] == 0 and fire["expire_timeout"] == -1
    # the resolved notification replaces the firing one, at low urgency
    assert res["summary"] == "Resolved: I/O stall \u2014 extract"
    assert res["hints"]["urgency"] == 0
    assert res["replaces_id"] > 0
    assert res["body"].splitlines() == ["extract: progressing again", "after 5m on gpu-node-3"]


@pytest.mark.parametrize("severity,urgency", [("critical", 2), ("warning", 1), ("info", 0)])
def test_urgency_from_severity(notifications, bus_address, monkeypatch, severity, urgency) -> None:
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", bus_address)
    sink = DesktopSink(desktop())
    sink.deliver(event(severity=severity))
    assert notifications.wait_notify(1)[0]["hints"]["urgency"] == urgency


def test_urgency_map_overrides(notifications, bus_address) -> None:
    cfg = desktop(urgency_map={"warning": 2}, app_name="gpu-watch", expire_timeout_ms=0)
    note = render(event(severity="warning", summary="x < y & z"), cfg)
    notify(note["summary"], note["body"], urgency=note["urgency"], app_name=note["app_name"],
           expire_timeout_ms=note["expire_timeout_ms"], bus_address=bus_address)
    call = notifications.wait_notify(1)[0]
    assert call["hints"]["urgency"] == 2 and call["app_name"] == "gpu-watch"
    assert call["expire_timeout"] == 0
    assert call["body"].startswith("x &lt; y &amp; z")  # escaped for body-markup


def test_gdbus_fallback(notifications, bus_address) -> None:
    if not shutil.which("gdbus"):
        pytest.skip("gdbus (libglib2.0-bin) is not installed")
    nid = notify("It's \"quoted\" \\ ü", "line 1\nline 2 'x'", urgency=1, bus_address=bus_address,
                 backend="gdbus")
    call = notifications.wait_notify(1)[0]
    assert nid > 0
    assert call["summary"] == "It's \"quoted\" \\ ü"
    assert call["body"] == "line 1\nline 2 'x'"
    assert call["hints"]["urgency"] == 1 and call["app_name"] == "stallwatch"


def test_no_notification_server_is_a_retryable_failure(bus_address, monkeypatch) -> None:
    # a bus without the notification service (the agent waits and retries the same way)
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent/bus")
    st = deliver([{"type": "desktop", "max_attempts": 2, "retry_initial_s": 0.05}])["sinks"][0]
    assert st["failed"] == 1 and st["retries"] == 1
    assert st["last_error"].startswith("desktop: cannot connect to the session bus")


# ------------------------------------------------------------------------ spool and agent


def test_spool_agent_notify(notifications, bus_address, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)
    spool = tmp_path / "state" / "desktop" / "alice"
    d = dispatcher([{"type": "desktop", "mode": "spool", "spool_dir": str(spool)}])
    try:
        d.submit(event())
        assert d.flush(5)
        assert d.status()["sinks"][0]["sent"] == 1
    finally:
        d.close()
    files = sorted(spool.glob("*.json"))
    assert len(files) == 1
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    doc = json.loads(files[0].read_text())
    assert doc["notification"]["summary"] == "I/O stall \u2014 extract" and doc["event"]["job"] == "extract"

    env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": bus_address,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    agent_log = open(tmp_path / "agent.log", "w")  # noqa: SIM115 - the agent's log while it runs
    agent = subprocess.Popen([sys.executable, "-m", "stallwatch.alerts.desktop", "agent",
                              "--spool", str(spool), "--poll", "30"],
                             env=env, stdout=agent_log, stderr=subprocess.STDOUT)
    try:
        call = notifications.wait_notify(1, timeout=20)[0]
        assert call["summary"] == "I/O stall \u2014 extract" and call["hints"]["urgency"] == 2
        assert call["body"].startswith("extract: no progress for 41 s")
        # a new file while the agent runs: inotify wakes it (its rescan is 30 s away)
        d2 = dispatcher([{"type": "desktop", "mode": "spool", "spool_dir": str(spool)}])
        try:
            d2.submit(event(state="resolved"))
            assert d2.flush(5)
        finally:
            d2.close()
        t0 = time.monotonic()
        calls = notifications.wait_notify(1, timeout=10)
        assert time.monotonic() - t0 < 10
        assert calls[1]["summary"] == "Resolved: I/O stall \u2014 extract"
        assert calls[1]["replaces_id"] > 0  # it replaces the firing popup
    finally:
        agent.send_signal(signal.SIGTERM)  # the agent finishes its pass, then exits
        rc = agent.wait(10)
        agent_log.close()
    assert not list(spool.glob("*.json"))  # delivered files are removed
    assert rc == 0, (tmp_path / "agent.log").read_text()


def test_agent_keeps_files_while_no_server_and_drops_stale_ones(tmp_path) -> None:
    spool = tmp_path / "spool"
    s = Spool(spool)
    cfg = desktop()
    fresh = s.put({"notification": render(event(), cfg), "expires_at": time.time() + 3600})
    stale = s.put({"notification": render(event(incident_id=8), cfg), "expires_at": time.time() - 1})
    (spool / "0-garbage.json").write_text("{not json")
    a = Agent(spool, bus_address="unix:path=/nonexistent/bus")
    assert a.drain_once() is False  # no bus: the fresh one waits
    assert fresh.exists()
    assert not (spool / "0-garbage.json").exists() and a.dropped == 1
    assert "cannot connect to the session bus" in a.last_error
    assert stale.exists()  # behind the fresh one in order; dropped once reached
    a2 = Agent(spool, bus_address="unix:path=/nonexistent/bus", now=lambda: time.time() + 7200)
    a2.drain_once()
    assert not fresh.exists() and not stale.exists() and a2.dropped == 2


def test_agent_run_loop_delivers_and_stops(notifications, bus_address, tmp_path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    a = Agent(spool, bus_address=bus_address, poll_s=30)
    t = threading.Thread(target=a.run, daemon=True)
    t.start()
    try:
        Spool(spool).put({"notification": render(event(kind="hang"), desktop()),
                          "expires_at": time.time() + 60})
        call = notifications.wait_notify(1)[0]
        assert call["summary"] == "Hang \u2014 extract"
    finally:
        a.stop()
        t.join(5)
    assert not t.is_alive()


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user can traverse (pytest's own tmp root is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="stallwatch-alerts-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown of the spool to another user needs root")
def test_root_daemon_spools_for_the_named_user(public_dir: Path) -> None:
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody'")
    state = public_dir / "state"
    state.mkdir(mode=0o711)
    os.chmod(state, 0o711)  # systemd's StateDirectoryMode=0711
    sink = DesktopSink(desktop(user="nobody"), state_dir=str(state))
    assert sink.mode == "spool"
    sink.deliver(event())
    d = state / "desktop" / "nobody"
    f = next(d.glob("*.json"))
    assert d.stat().st_uid == nobody.pw_uid and f.stat().st_uid == nobody.pw_uid
    assert stat.S_IMODE((state / "desktop").stat().st_mode) == 0o711
    assert "via the agent of nobody" in sink.describe()
    # and nobody can actually read it: the agent's view
    r = subprocess.run([sys.executable, "-c", f"import os; os.setgid({nobody.pw_gid}); os.setgroups([]); "
                        f"os.setuid({nobody.pw_uid}); print(open({str(f)!r}).read()[:1])"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "{", r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="chown of the spool to another user needs root")
def test_state_dir_the_user_cannot_traverse_is_reported(public_dir: Path) -> None:
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody'")
    state = public_dir / "state"
    state.mkdir()
    os.chmod(state, 0o700)  # StateDirectoryMode=0700
    st = deliver([{"type": "desktop", "user": "nobody"}], state_dir=str(state), flush_s=5)["sinks"][0]
    assert st["failed"] == 1
    assert st["last_error"].startswith(f"desktop: nobody cannot reach {state}/desktop/nobody: "
                                       f"{state} is mode 0700.")
    assert "StateDirectoryMode=0711" in st["last_error"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the root-without-user check applies to root")
def test_root_without_user_or_bus_is_a_config_problem(monkeypatch) -> None:
    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)
    if Path("/run/user/0/bus").exists():
        pytest.skip("root has a session bus here")
    st = deliver([{"type": "desktop"}], flush_s=5)["sinks"][0]
    assert st["failed"] == 1
    assert 'name the desktop\'s user (user = "alice")' in st["last_error"]


def test_systemd_user_unit_runs_the_agent() -> None:
    unit = (REPO / "systemd" / "stallwatch-desktop-agent.service").read_text()
    assert "ExecStart=/usr/bin/env python3 -m stallwatch.alerts.desktop agent" in unit
    assert "WantedBy=default.target" in unit
    if shutil.which("systemd-analyze"):
        r = subprocess.run(["systemd-analyze", "verify", str(REPO / "systemd" / "stallwatch-desktop-agent.service")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
