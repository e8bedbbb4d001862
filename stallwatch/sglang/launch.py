"""Starting the stand-in server from tests, the demo and scripts, and talking to it.

Part of the stand-in SGLang server (stallwatch.sglang.protocol_server; docs/sglang-templates.md).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from stallwatch.sglang.procutil import set_pdeathsig
from stallwatch.sglang.titles import parse_title


def http_request(url: str, method: str = "GET", body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body); raises TimeoutError when the server does not answer within `timeout`
    (connect, or any read), ConnectionRefusedError when nothing listens."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, u.path or "/", body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except TimeoutError:
        raise TimeoutError(f"{method} {url} did not answer within {timeout:g} s") from None
    finally:
        conn.close()


def child_processes(pid: int) -> dict[str, list[int]]:
    """The server's children by role, from /proc: {"scheduler": [...], "detokenizer": [...],
    "other": [...]} — schedulers in rank order (their titles' rank tuples, either shape)."""
    out: dict[str, list[tuple[tuple, int]]] = {"scheduler": [], "detokenizer": [], "other": []}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            if int(stat[stat.rfind(b")") + 2:].split()[1]) != pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0].decode("utf-8", "replace")
        except (OSError, ValueError, IndexError):
            continue
        title = parse_title(argv0)
        role = title.role if title is not None and title.role in ("scheduler", "detokenizer") else "other"
        out[role].append((title.key if title else (), int(d)))
    return {k: [p for _, p in sorted(v)] for k, v in out.items()}


class ServerProcess:
    """A protocol server started by `launch_server`; a context manager that stops it."""

    def __init__(self, proc: Any, host: str, port: int, log: str | None) -> None:
        self.proc, self.host, self.port, self.log = proc, host, port, log

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def children(self) -> dict[str, list[int]]:
        return child_processes(self.proc.pid)

    def scheduler_pids(self) -> list[int]:
        return self.children()["scheduler"]

    def detokenizer_pid(self) -> int | None:
        d = self.children()["detokenizer"]
        return d[0] if d else None

    def request(self, path: str, method: str = "GET", body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
        return http_request(self.url + path, method, body, timeout)

    def generate(self, input_ids: list, max_new_tokens: int = 1, timeout: float = 30.0, **extra: Any) -> Any:
        code, raw = self.request("/generate", "POST", {"input_ids": input_ids,
                                                      "sampling_params": {"max_new_tokens": max_new_tokens},
                                                      **extra}, timeout)
        if code != 200:
            raise RuntimeError(f"/generate: HTTP {code}: {raw[:300]!r}")
        return json.loads(raw)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"protocol server exited with code {self.proc.returncode}")
            try:
                if self.request("/ready", timeout=2.0)[0] == 200:
                    return
            except (OSError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"protocol server not ready within {timeout:g} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (the server kills its children), then SIGKILL of its process group."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except Exception:  # noqa: BLE001 - stopped, or ignoring SIGTERM: kill below
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers (own session: only ours)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout)
        except Exception:  # noqa: BLE001 - stopping: the return code below says the rest
            pass
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def launch_server(args: list[str] | tuple[str, ...] = (), *, host: str = "127.0.0.1", port: int = 0,
                  log: str | None = None, python: str | None = None, env: dict | None = None,
                  ready_timeout: float = 120.0, wait_ready: bool = True, stdout: Any = None,
                  stderr: Any = None, die_with_parent: bool = False) -> ServerProcess:
    """Start `python -m stallwatch.sglang.protocol_server` in its own session, wait until it
    listens (and, with wait_ready, until /ready), and return a handle. Extra flags in `args`.

    The server outlives its caller unless stopped (use the handle as a context manager).
    `die_with_parent=True` makes the kernel SIGKILL it when the calling *thread* exits
    (PR_SET_PDEATHSIG): right for tests and scripts, wrong when called from a worker thread.
    """
    import subprocess
    import tempfile

    tmp = tempfile.mkdtemp(prefix="sw-sglang-")
    port_file = os.path.join(tmp, "port")
    argv = [python or sys.executable, "-m", "stallwatch.sglang.protocol_server", "--host", host,
            "--port", str(port), "--port-file", port_file, *args]
    if log:
        argv += ["--log", log]
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            preexec_fn=set_pdeathsig if die_with_parent else None,
                            stdout=stdout if stdout is not None else subprocess.DEVNULL,
                            stderr=stderr if stderr is not None else subprocess.DEVNULL)
    server = ServerProcess(proc, host, 0, log)
    deadline = time.monotonic() + ready_timeout
    try:
        while not os.path.exists(port_file):
            if proc.poll() is not None:
                raise RuntimeError(f"protocol server exited with code {proc.returncode} before listening"
                                   + (f" (see {log})" if log else ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"protocol server did not listen within {ready_timeout:g} s")
            time.sleep(0.02)
        with open(port_file) as f:
            server.port = int(f.read().strip())
        if wait_ready:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        server.stop()
        raise
    finally:
        try:
            os.unlink(port_file)
            os.rmdir(tmp)
        except OSError:
            pass
    return server
