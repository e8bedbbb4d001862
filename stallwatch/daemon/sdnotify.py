"""sd_notify(3) by hand: one AF_UNIX datagram to $NOTIFY_SOCKET.

Why no dependency: the protocol is a few lines (newline-separated KEY=VALUE assignments in one
datagram to the socket systemd names in $NOTIFY_SOCKET; a leading '@' means Linux's abstract
namespace, i.e. a NUL byte), and the candidates (python-systemd, sdnotify) either need libsystemd
headers to build or are unmaintained wrappers of these same lines. A watchdog should not fail to
install, or fail at all, over its own heartbeat.

What stallwatch sends: READY=1 after the first tick, WATCHDOG=1 after each tick that completed
within its deadline, STATUS=<one line>, RELOADING=1 / READY=1 around a SIGHUP reload, and
STOPPING=1 on the way out. Without $NOTIFY_SOCKET (not under systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["Notifier", "notify"]


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        addr = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self.address: str | bytes | None = None
        if addr:
            if addr.startswith("@"):
                self.address = "\0" + addr[1:]  # abstract namespace
            elif addr.startswith("/"):
                self.address = addr
            # Anything else (vsock:..., a relative path) is not for us: stay silent.
        self._sock: socket.socket | None = None
        self.errors = 0
        self.last_error: str | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_usec(self) -> int | None:
        """systemd's WatchdogSec= for this process, when it set one (WATCHDOG_USEC/WATCHDOG_PID)."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or not usec.isdigit():
            return None
        if pid and pid.isdigit() and int(pid) != os.getpid():
            return None
        return int(usec)

    def send(self, **fields: object) -> bool:
        """notify(READY=1, STATUS="...") → True when sent (False when disabled or it failed)."""
        if self.address is None:
            return False
        lines = []
        for k, v in fields.items():
            text = str(v).replace("\n", " ")  # one assignment per line: no newlines in values
            lines.append(f"{k}={text}")
        data = "\n".join(lines).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # MSG_DONTWAIT: a receiver that stopped reading (a wedged systemd, a test's socket)
            # fills its queue, and a blocking sendto would stop the daemon's tick, and its
            # SIGTERM handling, with it. A heartbeat that cannot be queued now is dropped
            # (EAGAIN, counted below); the next tick sends a fresh one.
            self._sock.sendto(data, socket.MSG_DONTWAIT, self.address)
            return True
        except OSError as e:
            # systemd gone (daemon-reexec in progress) or the socket not there: the heartbeat
            # is best effort; the next tick tries again with a fresh socket.
            self.errors += 1
            self.last_error = str(e)
            self.close()
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.send(READY=1, **({"STATUS": status} if status else {}))

    def watchdog(self, status: str | None = None) -> bool:
        return self.send(WATCHDOG=1, **({"STATUS": status} if status else {}))

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload units match the reload to this message.
        return self.send(RELOADING=1, MONOTONIC_USEC=int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6))

    def stopping(self, status: str | None = None) -> bool:
        return self.send(STOPPING=1, **({"STATUS": status} if status else {}))

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def notify(**fields: object) -> bool:
    """One-shot: notify(READY=1)."""
    n = Notifier()
    try:
        return n.send(**fields)
    finally:
        n.close()
