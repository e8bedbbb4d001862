"""The /metrics endpoint: one thread, bounded connections, every read and write under a deadline.

Why not prometheus-client's `start_http_server` (0.26, `exposition.py`): it is a
`ThreadingWSGIServer`, a thread per connection that waits for the request without a timeout. Any
local user (a job's, on a shared machine) could open idle connections to the loopback port and
hold a thread of the root daemon each, forever; under systemd's `TasksMax=` the daemon then could
not start the threads and processes it needs for evidence and restarts (issue 22 #8). Wrapping
its server class would keep the thread per connection; this serves the library's own WSGI app
(`make_wsgi_app`: content negotiation, OpenMetrics, gzip, `name[]` filters stay the library's)
from an asyncio server on a single thread instead:

- at most `max_connections` connections at once; one more evicts the oldest that has not sent
  its request yet, so a flood of idle connections cannot crowd out a scrape (a scraper sends its
  request at once);
- the request head must arrive whole within `read_timeout_s` and within `max_request_bytes`
  (a trickle of bytes gains nothing); the answer must drain within `write_timeout_s`;
- one request per connection (`Connection: close`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import OrderedDict
from typing import Any
from collections.abc import Callable
from urllib.parse import unquote

log = logging.getLogger("stallwatch.daemon.metrics")

MAX_CONNECTIONS = 32
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 8192


class MetricsServer:
    """Serves a WSGI app (prometheus_client.make_wsgi_app) on host:port; port 0 picks one."""

    def __init__(self, host: str, port: int, app: Callable[..., Any], *,
                 max_connections: int = MAX_CONNECTIONS, read_timeout_s: float = READ_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_connections = max_connections
        self.read_timeout_s, self.write_timeout_s = read_timeout_s, write_timeout_s
        self.max_request_bytes = max_request_bytes
        self.evicted = 0  # connections closed to make room, or for taking too long
        # Bound here, in the caller's thread, so that a taken port is the caller's OSError.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self.server_address = self._sock.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        self._conns: set[asyncio.StreamWriter] = set()
        # Connections that have not sent their request yet, oldest first: the ones to evict.
        self._pending: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self.thread = threading.Thread(target=self._run, name="stallwatch-metrics", daemon=True)

    def start(self) -> MetricsServer:
        self.thread.start()
        self._ready.wait(10.0)
        return self

    def close(self) -> None:
        if self.thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self.thread.join(timeout=5)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
        self._sock.close()

    # -- the loop's thread

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(
            self._serve, sock=self._sock, limit=self.max_request_bytes))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for w in list(self._conns):
                w.transport.abort()
            self._loop.run_until_complete(self._server.wait_closed())
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        self._pending[writer] = None
        while len(self._conns) > self.max_connections and self._pending:
            oldest, _ = self._pending.popitem(last=False)
            self._conns.discard(oldest)
            oldest.transport.abort()  # its handler's read fails, and it ends
            self.evicted += 1
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
            except (asyncio.LimitOverrunError, ValueError):
                await self._answer(writer, "431 Request Header Fields Too Large", [], b"")
                return
            except TimeoutError:
                self.evicted += 1
                return
            if writer not in self._pending:
                return  # evicted just as its request arrived
            del self._pending[writer]
            status, headers, body = self._call(head)
            await self._answer(writer, status, headers, body)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._pending.pop(writer, None)
            self._conns.discard(writer)
            writer.transport.abort()

    def _call(self, head: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", [], b""
        method, target, _version = parts
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path),
                                   "QUERY_STRING": query, "SERVER_PROTOCOL": "HTTP/1.1"}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        got: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
            got[:] = [status, headers]

        try:
            body = b"".join(self.app(environ, start_response))
        except Exception:  # a collector's bug is a 500, not a dead endpoint
            log.exception("rendering the metrics failed")
            return "500 Internal Server Error", [], b""
        if method == "HEAD":
            body = b""
        return got[0], list(got[1]), body

    async def _answer(self, writer: asyncio.StreamWriter, status: str,
                      headers: list[tuple[str, str]], body: bytes) -> None:
        out = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers]
        out += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        writer.write("\r\n".join(out).encode("latin-1") + body)
        await asyncio.wait_for(writer.drain(), self.write_timeout_s)
