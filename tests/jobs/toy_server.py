#!/usr/bin/env python3
"""A loopback stand-in for an SGLang server, speaking just enough of its HTTP protocol.

    POST /generate          {"input_ids": [...], "return_hidden_states": true, ...}
                            -> {"text": "...", "meta_info": {"hidden_states": [[...]], ...}}
    GET  /health, /health_generate, /model_info, /server_info, /metrics

It prints `listening on PORT` once it accepts connections (port 0: the kernel picks one), so a
parent can read the URL from its stdout. Stop it with SIGSTOP and it still accepts connections in
the kernel (the listen backlog), but never answers: its clients block in recvfrom.

The backlog is 2048, as uvicorn's (SGLang's HTTP server): with socketserver's default of 5, a
stopped server's queue fills with a watchdog's health checks within seconds and new connections
time out, which looks like a server that is gone rather than one that hangs.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Stats:
    lock = threading.Lock()
    requests = 0
    prompt_tokens = 0
    generation_tokens = 0
    running = 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "toy-sglang/0.1"
    delay_s = 0.0
    hidden = 8

    def log_message(self, fmt: str, *args) -> None:  # quiet: the job's log is what matters
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj: dict, code: int = 200) -> None:
        self._send(code, json.dumps(obj).encode())

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            self._send(200, b"")
        elif path in ("/model_info", "/get_model_info"):
            self._json({"model_path": "toy/llama-tiny", "is_generation": True})
        elif path in ("/server_info", "/get_server_info"):
            self._json({"version": "0.5.toy", "enable_return_hidden_states": True})
        elif path == "/metrics":
            with Stats.lock:
                text = (
                    "# TYPE sglang:num_requests_total counter\n"
                    f'sglang:num_requests_total{{model_name="toy"}} {Stats.requests}\n'
                    "# TYPE sglang:prompt_tokens_total counter\n"
                    f'sglang:prompt_tokens_total{{model_name="toy"}} {Stats.prompt_tokens}\n'
                    "# TYPE sglang:generation_tokens_total counter\n"
                    f'sglang:generation_tokens_total{{model_name="toy"}} {Stats.generation_tokens}\n'
                    "# TYPE sglang:num_running_reqs gauge\n"
                    f'sglang:num_running_reqs{{model_name="toy"}} {Stats.running}\n'
                    "# TYPE sglang:num_queue_reqs gauge\n"
                    'sglang:num_queue_reqs{model_name="toy"} 0\n'
                )
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._json({"detail": "Not Found"}, 404)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.split("?")[0] != "/generate":
            self._json({"detail": "Not Found"}, 404)
            return
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            self._json({"detail": "invalid JSON"}, 400)
            return
        ids = req.get("input_ids") or [0]
        with Stats.lock:
            Stats.running += 1
        time.sleep(self.delay_s)
        hidden = [[0.01 * ((i + j) % 7) for j in range(self.hidden)] for i in range(len(ids))]
        with Stats.lock:
            Stats.running -= 1
            Stats.requests += 1
            Stats.prompt_tokens += len(ids)
            Stats.generation_tokens += 1
        meta = {"prompt_tokens": len(ids), "completion_tokens": 1}
        if req.get("return_hidden_states"):
            meta["hidden_states"] = hidden
        self._json({"text": ".", "meta_info": meta})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay-s", type=float, default=0.0, help="seconds per /generate")
    a = ap.parse_args()
    Handler.delay_s = a.delay_s
    srv = Server((a.host, a.port), Handler)
    print(f"listening on {srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
