"""Desktop notifications: freedesktop `org.freedesktop.Notifications.Notify` over D-Bus.

Two routes, because a root system service cannot reach a user's session bus:

- **direct**: the daemon runs inside a user session (DBUS_SESSION_BUS_ADDRESS set, or the
  user's `/run/user/UID/bus` exists) and calls Notify itself;
- **spool**: the daemon writes each notification as one JSON file into
  `<state_dir>/desktop/<user>/` (directory owned by that user, mode 0700; files written to a
  temporary name and renamed, so a reader never sees half a file), and the per-user agent
  (`python -m stallwatch.alerts.desktop agent`, started by the `systemd --user` unit
  `stallwatch-desktop-agent.service`) watches that directory (inotify, plus a rescan every few
  seconds), calls Notify on its own session bus, and deletes each file once it is shown. Files
  wait while the user is logged out and are dropped, with a log line, once older than
  `max_age_s`. A spool directory was chosen over a socket: the daemon never waits on the agent,
  nothing is lost while the agent is down, and the only shared state is a directory.

The D-Bus client is jeepney (pure Python) when it is installed, else `gdbus call` (GLib).
Urgency comes from the severity (critical 2, warning 1, info 0; `urgency_map` overrides); a
resolved or repeated event replaces the incident's earlier notification (replaces_id).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

from stallwatch.alerts.events import AlertEvent
from stallwatch.kernel.proc import self_fd_path  # chmod of an O_PATH fd names it by its path

from .base import (PermanentError, RetryableError, Sink, fmt_duration, fmt_progress,
                   incident_age, strongest_evidence, title)
from .config import DesktopConfig
from .redact import get_logger, redact

log = get_logger("stallwatch.alerts.desktop")

BUS_NAME = "org.freedesktop.Notifications"
OBJECT_PATH = "/org/freedesktop/Notifications"
INTERFACE = "org.freedesktop.Notifications"
DEFAULT_STATE_DIR = "/var/lib/stallwatch"
SPOOL_VERSION = 1


class NotifyError(Exception):
    """Notify could not be called (no bus, no notification server, an error reply)."""


# ------------------------------------------------------------------------------ D-Bus client


def session_bus_address(uid: int | None = None) -> str | None:
    """This process's session bus: $DBUS_SESSION_BUS_ADDRESS, else /run/user/UID/bus if present."""
    addr = os.environ.get("DBUS_SESSION_BUS_ADDRESS")
    if addr:
        return addr
    path = Path(f"/run/user/{os.geteuid() if uid is None else uid}/bus")
    return f"unix:path={path}" if path.exists() else None


def _notify_jeepney(address: str, args: tuple, timeout_s: float) -> int:
    from jeepney import DBusAddress, new_method_call
    from jeepney.io.blocking import open_dbus_connection
    from jeepney.wrappers import DBusErrorResponse, unwrap_msg

    target = DBusAddress(OBJECT_PATH, bus_name=BUS_NAME, interface=INTERFACE)
    msg = new_method_call(target, "Notify", "susssasa{sv}i", args)
    try:
        conn = open_dbus_connection(bus=address, auth_timeout=timeout_s)
    except (OSError, ValueError, StopIteration) as e:
        raise NotifyError(f"cannot connect to the session bus: {type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 - jeepney's auth errors
        raise NotifyError(f"cannot connect to the session bus: {type(e).__name__}: {e}") from None
    try:
        reply = conn.send_and_get_reply(msg, timeout=timeout_s)
        return int(unwrap_msg(reply)[0])
    except DBusErrorResponse as e:
        raise NotifyError(f"Notify failed: {e.name}: {' '.join(map(str, e.data))}") from None
    except TimeoutError:
        raise NotifyError(f"Notify did not answer within {timeout_s:g} s") from None
    except OSError as e:
        raise NotifyError(f"Notify failed: {type(e).__name__}: {e}") from None
    finally:
        conn.close()


def _gvariant_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a valid GVariant text-format string literal


def _notify_gdbus(address: str, args: tuple, timeout_s: float) -> int:
    gdbus = shutil.which("gdbus")
    if gdbus is None:
        raise NotifyError("no D-Bus client: install jeepney (pip install jeepney) or gdbus (libglib2.0-bin)")
    app, replaces, icon, summary, body, _actions, hints, expire = args
    hint_txt = "{" + ", ".join(
        f"{_gvariant_str(k)}: <{'byte ' + str(v) if sig == 'y' else _gvariant_str(str(v))}>"
        for k, (sig, v) in hints.items()) + "}"
    argv = [gdbus, "call", "--address", address, "--dest", BUS_NAME, "--object-path", OBJECT_PATH,
            "--method", f"{INTERFACE}.Notify", "--timeout", str(max(1, int(timeout_s))),
            "--",  # an expire timeout of -1 must not read as an option
            _gvariant_str(app), str(int(replaces)), _gvariant_str(icon), _gvariant_str(summary),
            _gvariant_str(body), "@as []", hint_txt, str(int(expire))]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 5)
    except subprocess.TimeoutExpired:
        raise NotifyError(f"gdbus call did not return within {timeout_s + 5:g} s") from None
    if r.returncode != 0:
        raise NotifyError(f"Notify failed: {r.stderr.strip()[:300]}")
    m = re.search(r"uint32\s+(\d+)", r.stdout)
    return int(m.group(1)) if m else 0


def notify(summary: str, body: str, *, urgency: int = 1, app_name: str = "stallwatch",
           replaces_id: int = 0, expire_timeout_ms: int = -1, icon: str = "",
           category: str = "x-stallwatch.alert", bus_address: str | None = None,
           timeout_s: float = 5.0, backend: str = "auto") -> int:
    """Call Notify on a session bus; returns the notification id. Raises NotifyError."""
    address = bus_address or session_bus_address()
    if not address:
        raise NotifyError("no session bus: DBUS_SESSION_BUS_ADDRESS is not set")
    hints = {"urgency": ("y", int(urgency)), "category": ("s", category)}
    actions: list[str] = []
    args = (app_name, int(replaces_id), icon, summary, body, actions, hints, int(expire_timeout_ms))
    if backend == "auto":
        try:
            import jeepney  # noqa: F401 - whether it imports is the question
            backend = "jeepney"
        except ImportError:
            backend = "gdbus"
    if backend == "jeepney":
        return _notify_jeepney(address, args, timeout_s)
    return _notify_gdbus(address, args, timeout_s)


# ---------------------------------------------------------------------------- the message


def _markup(text: str) -> str:
    """Escape for the body-markup most servers apply (&, <, >)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render(event: AlertEvent, config: DesktopConfig) -> dict[str, Any]:
    """{app_name, summary, body, urgency, expire_timeout_ms, key, state}: one notification."""
    lines: list[str] = []
    if event.state == "resolved":
        age = incident_age(event)
        where = f" on {event.host}" if event.host else ""
        lines.append(f"{event.summary}" if event.summary else "The job is progressing again.")
        lines.append(f"after {fmt_duration(age)}{where}" if age is not None else where.strip())
    else:
        lines.append(event.summary)
        for e in strongest_evidence(event, 3):
            lines.append(f"• {e.signal}: {e.detail}")
        prog = fmt_progress(event.progress)
        if prog:
            lines.append(f"Progress: {prog}")
        if event.sparklines:
            lines.extend(event.sparklines.splitlines()[:-1])  # the rows, not the legend
        if event.advice:
            lines.append(f"→ {event.advice[0]}")
        tail = [x for x in (event.host and f"on {event.host}",
                            event.incident_id is not None and f"incident {event.incident_id}",
                            event.renotify and f"reminder {event.renotify}") if x]
        if tail:
            lines.append(" · ".join(tail))
    body = "\n".join(_markup(x) for x in lines if x)
    return {
        "app_name": config.app_name,
        "summary": title(event),
        "body": body,
        "urgency": config.urgency(event.severity, event.state),
        "expire_timeout_ms": config.expire_timeout_ms,
        "key": "\x1f".join(str(x) for x in (event.job, event.kind, event.incident_id, event.episode)),
        "state": event.state,
    }


class _Ids:
    """Notification ids by incident key, so a resolved event replaces the firing popup."""

    def __init__(self, limit: int = 1000) -> None:
        self._ids: dict[str, int] = {}
        self._limit = limit

    def get(self, key: str) -> int:
        return self._ids.get(key, 0)

    def put(self, key: str, nid: int, state: str) -> None:
        if state == "resolved":
            self._ids.pop(key, None)
            return
        self._ids[key] = nid
        while len(self._ids) > self._limit:
            self._ids.pop(next(iter(self._ids)))


def show(note: dict[str, Any], ids: _Ids, bus_address: str | None, timeout_s: float,
         backend: str = "auto") -> int:
    key = note.get("key", "")
    nid = notify(note["summary"], note["body"], urgency=int(note.get("urgency", 1)),
                 app_name=note.get("app_name", "stallwatch"), replaces_id=ids.get(key),
                 expire_timeout_ms=int(note.get("expire_timeout_ms", -1)),
                 bus_address=bus_address, timeout_s=timeout_s, backend=backend)
    ids.put(key, nid, note.get("state", "firing"))
    return nid


# ------------------------------------------------------------------------------ the spool


def spool_dir_for(user: str, state_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(state_dir or DEFAULT_STATE_DIR) / "desktop" / user


class Spool:
    """The daemon's side: one JSON file per notification, atomically, readable by the user only."""

    _seq = itertools.count()

    def __init__(self, directory: str | os.PathLike[str], user: str | None = None) -> None:
        self.dir = Path(directory)
        self.user = user
        self._owner: tuple[str, int, int] | None = None  # (user, uid, gid) the files are handed to
        if user is not None and os.geteuid() == 0:
            try:
                pw = pwd.getpwnam(user)
                self._owner = (user, pw.pw_uid, pw.pw_gid)
            except KeyError:
                raise PermanentError(f"desktop: no such user '{user}'") from None
        self._ready = False

    def _open(self) -> int:
        """The spool directory's fd, made (0700, then given to the user) on first use.

        The directory is on the user's side once it is theirs, and a spool_dir set outside
        the state directory may lie in a place the user can write: so it is resolved without
        following a link another user could have made (stallwatch.kernel.safefs), created and handed
        over by fchownat without following a link, and every file in it is created relative to
        its fd. A spool made a symlink to /var/lib/stallwatch/runs is refused, never chowned
        (docs/security.md #3)."""
        from stallwatch.kernel import safefs

        if not self._ready:
            parent = self.dir.parent
            created = not parent.exists()
            pfd = safefs.open_dir(parent, create=True)
            try:
                if created:
                    os.chmod(self_fd_path(pfd), 0o711)  # the users may pass through, not list
                dfd = safefs.subdir(pfd, self.dir.name, create=True)
                try:
                    st = os.fstat(dfd)
                    if self._owner is not None and st.st_uid != self._owner[1]:
                        if st.st_uid != os.geteuid():
                            raise safefs.UnsafePath(str(self.dir), "owned by another user: "
                                                                   "not taken over")
                        now = os.stat(self.dir.name, dir_fd=pfd, follow_symlinks=False)
                        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                            raise safefs.UnsafePath(str(self.dir), "replaced while it was "
                                                                   "prepared")
                        os.chown(self.dir.name, self._owner[1], self._owner[2],
                                 dir_fd=pfd, follow_symlinks=False)
                    if stat.S_IMODE(st.st_mode) != 0o700:
                        os.chmod(self_fd_path(dfd), 0o700)
                finally:
                    os.close(dfd)
            finally:
                os.close(pfd)
            if self._owner is not None:
                blocked = self._blocking_ancestor(*self._owner)
                if blocked is not None:
                    path, mode = blocked
                    raise PermanentError(
                        f"desktop: {self.user} cannot reach {self.dir}: {path} is mode {mode:04o}. "
                        f"Let users pass through it (chmod o+x {path}; under systemd "
                        f"StateDirectoryMode=0711 in stallwatch.service) or set spool_dir to a "
                        f"directory they can reach")
            self._ready = True
        return safefs.open_dir(self.dir)

    def _blocking_ancestor(self, user: str, uid: int, gid: int) -> tuple[Path, int] | None:
        """The first directory above the spool that the user may not traverse, if any."""
        try:
            groups = set(os.getgrouplist(user, gid))
        except (KeyError, OSError):
            groups = {gid}
        for parent in self.dir.resolve().parents:
            st = parent.stat()
            if st.st_uid == uid:
                ok = bool(st.st_mode & 0o100)
            elif st.st_gid in groups:
                ok = bool(st.st_mode & 0o010)
            else:
                ok = bool(st.st_mode & 0o001)
            if not ok:
                return parent, stat.S_IMODE(st.st_mode)
        return None

    def put(self, doc: dict[str, Any]) -> Path:
        from stallwatch.kernel import safefs

        try:
            dfd = self._open()
            try:
                name = f"{time.time_ns():020d}-{os.getpid()}-{next(self._seq):06d}.json"
                tmp = f".{name}.tmp"
                data = json.dumps(doc, ensure_ascii=False).encode("utf-8")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=dfd)
                try:
                    os.write(fd, data)
                    if self._owner is not None:
                        os.fchown(fd, self._owner[1], self._owner[2])
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                return self.dir / name
            finally:
                os.close(dfd)
        except safefs.UnsafePath as e:
            raise PermanentError(f"desktop spool {self.dir}: {e.why}") from None
        except PermissionError as e:
            hint = ""
            if self._owner is not None:
                hint = (f" (handing files to {self.user} needs CAP_CHOWN: add it to "
                        f"CapabilityBoundingSet= in stallwatch.service)")
            raise PermanentError(f"desktop spool {self.dir}: {e.strerror}{hint}") from None
        except OSError as e:
            raise RetryableError(f"desktop spool {self.dir}: {e.strerror or e}") from None


# ------------------------------------------------------------------------------- the sink


def _current_user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


class DesktopSink(Sink):
    type = "desktop"

    def __init__(self, config: DesktopConfig, state_dir: str | os.PathLike[str] | None = None,
                 backend: str = "auto") -> None:
        super().__init__(config)
        self._ids = _Ids()
        self._backend = backend
        me = _current_user()
        other_user = config.user is not None and config.user != me
        mode = config.mode
        if mode == "auto":
            mode = "spool" if other_user or session_bus_address() is None else "direct"
        if mode == "spool":
            user = config.user or me
            if config.user is None and os.geteuid() == 0 and config.spool_dir is None:
                raise PermanentError("desktop: the daemon runs as root without a session bus: "
                                     "name the desktop's user (user = \"alice\") so that user's "
                                     "agent delivers")
            if other_user and os.geteuid() != 0:
                raise PermanentError(f"desktop: this daemon runs as {me}, so it cannot hand "
                                     f"notifications to {config.user}'s agent (only root can "
                                     f"give files to another user): run the daemon as root or "
                                     f"as {config.user}")
            d = Path(config.spool_dir) if config.spool_dir else spool_dir_for(user, state_dir)
            self.spool: Spool | None = Spool(d, user)
        else:
            self.spool = None
        self.mode = mode

    def describe(self) -> str:
        if self.spool is not None:
            return f"desktop via the agent of {self.spool.user} (spool {self.spool.dir})"
        return "desktop notifications on this session bus"

    def deliver(self, event: AlertEvent) -> None:
        note = render(event, self.config)
        if self.spool is not None:
            now = time.time()
            self.spool.put({"version": SPOOL_VERSION, "notification": note, "created_at": now,
                            "expires_at": now + self.config.max_age_s,
                            "event": event.model_dump(mode="json")})
            return
        try:
            show(note, self._ids, None, self.config.timeout_s, self._backend)
        except NotifyError as e:
            raise RetryableError(f"desktop: {e}") from None


# ------------------------------------------------------------------------------ the agent


class Agent:
    """Delivers spooled notifications on this user's session bus, oldest first.

    `run()` (until `stop()`) watches the directory (inotify through watchdog, plus a rescan
    every `poll_s`), and backs off up to `max_backoff_s` while the bus or the notification
    server is missing.
    """

    def __init__(self, spool_dir: str | os.PathLike[str], *, bus_address: str | None = None,
                 poll_s: float = 5.0, max_backoff_s: float = 60.0, timeout_s: float = 5.0,
                 backend: str = "auto", now: Callable[[], float] = time.time) -> None:
        self.dir = Path(spool_dir)
        self.bus_address = bus_address
        self.poll_s = poll_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.backend = backend
        self.now = now
        self.ids = _Ids()
        self.delivered = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()

    def pending(self) -> list[Path]:
        try:
            return sorted(p for p in self.dir.iterdir()
                          if p.suffix == ".json" and not p.name.startswith("."))
        except FileNotFoundError:
            return []

    def drain_once(self) -> bool:
        """Deliver every pending file; False when delivery failed (the file stays for later)."""
        for path in self.pending():
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
                note = doc["notification"]
                expires = float(doc.get("expires_at") or 0)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("desktop agent: dropping unreadable %s: %s", path.name, e)
                self._unlink(path)
                self.dropped += 1
                continue
            if expires and self.now() > expires:
                log.warning("desktop agent: dropping stale notification %s (%s)", path.name,
                            note.get("summary", ""))
                self._unlink(path)
                self.dropped += 1
                continue
            try:
                show(note, self.ids, self.bus_address, self.timeout_s, self.backend)
            except NotifyError as e:
                self.last_error = redact(str(e))
                log.warning("desktop agent: cannot notify yet (%s); %d waiting", self.last_error,
                            len(self.pending()))
                return False
            self._unlink(path)
            self.delivered += 1
            self.last_error = None
        return True

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    def _watch(self):
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:
            return None
        wake = self._wake

        class _H(FileSystemEventHandler):
            def on_any_event(self, event):  # created, moved (the rename), modified
                wake.set()

        obs = Observer()
        obs.schedule(_H(), str(self.dir), recursive=False)
        obs.daemon = True
        obs.start()
        return obs

    def run(self) -> None:
        """Deliver until stop() is called."""
        log.info("desktop agent: delivering from %s", self.dir)
        observer = None
        backoff = 0.0
        try:
            while not self._stop.is_set():
                if observer is None and self.dir.is_dir():
                    try:
                        observer = self._watch()
                    except OSError as e:  # inotify limits: the rescan still works
                        log.warning("desktop agent: cannot watch %s (%s); rescanning every %g s",
                                    self.dir, e, self.poll_s)
                        observer = False
                self._wake.clear()
                ok = self.drain_once()
                backoff = 0.0 if ok else min(self.max_backoff_s, max(1.0, backoff * 2))
                if backoff:  # the bus or the server is missing: new files would not help
                    self._stop.wait(backoff)
                else:  # a new file (inotify) or stop() ends the wait early
                    self._wake.wait(self.poll_s)
        finally:
            if observer:
                observer.stop()
                observer.join(timeout=2.0)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()


def agent_main(argv: list[str] | None = None) -> int:
    import logging
    import signal

    ap = argparse.ArgumentParser(prog="python -m stallwatch.alerts.desktop agent",
                                 description="Show stallwatch's desktop notifications on this "
                                 "user's session bus (run as a systemd --user service).")
    ap.add_argument("--spool", help="Spool directory (default <state-dir>/desktop/$USER).")
    ap.add_argument("--state-dir", default=os.environ.get("STALLWATCH_STATE_DIR", DEFAULT_STATE_DIR))
    ap.add_argument("--poll", type=float, default=5.0, help="Rescan interval, seconds.")
    ap.add_argument("--once", action="store_true", help="Deliver what is there and exit.")
    ap.add_argument("--backend", choices=("auto", "jeepney", "gdbus"), default="auto")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(levelname)s %(message)s")
    spool = Path(a.spool) if a.spool else spool_dir_for(_current_user(), a.state_dir)
    agent = Agent(spool, poll_s=a.poll, backend=a.backend)
    if a.once:
        return 0 if agent.drain_once() else 1
    signal.signal(signal.SIGTERM, lambda signum, frame: agent.stop())
    signal.signal(signal.SIGINT, lambda signum, frame: agent.stop())
    agent.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "agent":
        print("usage: python -m stallwatch.alerts.desktop agent [--spool DIR] [--state-dir DIR] "
              "[--once]", file=sys.stderr)
        return 3
    return agent_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
