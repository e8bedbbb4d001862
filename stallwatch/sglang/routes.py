"""The stand-in server's HTTP routes (SGLang's, per version) and /generate's request shapes.

Part of the stand-in SGLang server (stallwatch.sglang.protocol_server; docs/sglang-templates.md).
"""

from __future__ import annotations

import json
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stallwatch.sglang.detokenizer import tokenize
from stallwatch.sglang.procutil import access_logger, logger
from stallwatch.sglang.tokenizer_manager import TokenizerManager


class _BadRequest(ValueError):
    pass


def _normalize(body: dict, vocab: int) -> tuple[list[dict[str, Any]], bool]:
    """The items of a /generate body (one, or a batch), each with input_ids and params."""
    if "input_ids" in body and body["input_ids"] is not None:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise _BadRequest("input_ids must be a non-empty list")
        batch = isinstance(ids[0], list)
        items = ids if batch else [ids]
    elif "text" in body and body["text"] is not None:
        text = body["text"]
        batch = isinstance(text, list)
        items = [tokenize(t) for t in (text if batch else [text])]
    else:
        raise _BadRequest("Either text or input_ids should be provided.")
    for ids in items:
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise _BadRequest("input_ids must be lists of non-negative integers")
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * len(items)
    if len(sps) != len(items):
        raise _BadRequest("sampling_params must have one entry per prompt")
    rids = body.get("rid")
    if rids is not None and not isinstance(rids, list):
        rids = [rids]
    if rids is not None and len(rids) != len(items):
        raise _BadRequest("rid must have one entry per prompt")
    out = []
    for i, (ids, p) in enumerate(zip(items, sps, strict=True)):
        if not isinstance(p, dict):
            raise _BadRequest("sampling_params must be an object")
        mnt = p.get("max_new_tokens", 128)
        if not isinstance(mnt, int) or mnt < 0:
            raise _BadRequest("max_new_tokens must be a non-negative integer")
        out.append({"input_ids": ids, "max_new_tokens": mnt,
                    "rid": str(rids[i]) if rids is not None else uuid.uuid4().hex})
    return out, batch


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    tm: TokenizerManager  # set on the subclass made in main()

    def setup(self) -> None:
        super().setup()
        try:  # as uvicorn: no Nagle delay between the header and body writes
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        try:
            phrase = self.responses.get(int(code), ("",))[0]
        except (TypeError, ValueError):
            phrase = ""
        host, port = self.client_address[:2]
        access_logger.info(f'{host}:{port} - "{self.requestline}" {code} {phrase}')

    def log_message(self, format: str, *args: Any) -> None:  # http.server's signature
        access_logger.debug(format % args)

    # -- helpers --------------------------------------------------------------------------------

    def _client_gone(self) -> bool:
        """True once the client closed its side (it gave up waiting)."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            if not r:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _reply(self, code: int, body: bytes = b"", ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj: Any) -> None:
        self._reply(code, json.dumps(obj).encode())

    def _error(self, code: int, message: str) -> None:
        self._json(code, {"error": {"message": message}})

    # -- routes ---------------------------------------------------------------------------------

    def do_GET(self) -> None:  # http.server's naming
        path = self.path.split("?", 1)[0]
        tm = self.tm
        try:
            if path in ("/health", "/health_generate"):
                code = tm.health_generate(self._client_gone)
                if not self._client_gone():
                    self._reply(code)
            elif not self._route_exists(path):
                self._json(404, {"detail": "Not Found"})
            elif path in ("/model_info", "/get_model_info"):
                self._json(200, self._model_info())
            elif path in ("/server_info", "/get_server_info"):
                states = tm.internal_state(self._client_gone)
                if states is not None:
                    self._json(200, self._server_info(states))
            elif path == "/ready":
                up = tm.warmed_up
                self._json(200 if up else 503, {"status": "ready" if up else "starting"})
            elif path == "/metrics" and tm.metrics is not None:
                body, ctype = tm.metrics.render()
                self._reply(200, body, ctype)
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": tm.model_name, "object": "model",
                                                             "owned_by": "sglang", "root": tm.args.model}]})
            else:
                self._json(404, {"detail": "Not Found"})
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _route_exists(self, path: str) -> bool:
        """0.5.0-0.5.5 have only the /get_* names; from 0.5.6 both, the old one deprecated."""
        shape = self.tm.shape
        if path in ("/server_info", "/model_info"):
            return shape.new_routes
        if path in ("/get_server_info", "/get_model_info") and shape.new_routes:
            # stand-in wording; upstream logs a deprecation warning on each call
            logger.warning(f"Endpoint '{path}' is deprecated and will be removed in a future "
                           f"version. Please use '{path.replace('/get_', '/')}' instead.")
        return True

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            length = self.headers.get("Content-Length")
            if length is None:
                self._error(411, "Content-Length required")
                return
            raw = self.rfile.read(int(length))
            if path != "/generate":
                self._json(404, {"detail": "Not Found"})
                return
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise _BadRequest("the body must be a JSON object")
                self._generate(body)
            except (ValueError, _BadRequest) as e:
                self._error(400, str(e))
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _generate(self, body: dict) -> None:
        tm = self.tm
        a = tm.args
        if body.get("stream"):
            raise _BadRequest("stream=true is not supported by this template server")
        # Upstream's only hidden-state field: return_hidden_states -> meta_info["hidden_states"]
        # (no return_aux_hidden_states; an EAGLE-3 target returns its capture in hidden_states).
        want_hidden = bool(body.get("return_hidden_states"))
        if want_hidden and not a.enable_return_hidden_states:
            raise _BadRequest("The server is not configured to return the hidden states. Please set "
                              "`--enable-return-hidden-states` to enable this feature.")
        items, batch = _normalize(body, a.vocab_size)
        states = []
        for it in items:
            states.append((it, tm.submit(it["rid"], it["input_ids"], it["max_new_tokens"],
                                         want_hidden)))
        results = []
        for it, st in states:
            while not st.event.wait(0.25):  # no timeout: a stuck scheduler keeps the client waiting
                if self._client_gone():
                    for it2, st2 in states:
                        if not st2.event.is_set():
                            tm.abort(it2["rid"])
                    return
            o = st.out or {}
            m = o.get("meta", {})
            meta = {"id": it["rid"], "finish_reason": m.get("finish_reason"),
                    "prompt_tokens": m.get("prompt_tokens"), "completion_tokens": m.get("completion_tokens"),
                    "cached_tokens": m.get("cached_tokens", 0), "weight_version": "default",
                    "e2e_latency": time.monotonic() - st.created_mono}
            if want_hidden:
                meta["hidden_states"] = m.get("hidden_states", [])
            results.append({"text": o.get("text", ""), "output_ids": o.get("output_ids", []), "meta_info": meta})
        self._json(200, results if batch else results[0])

    def _model_info(self) -> dict:
        a = self.tm.args
        return {"model_path": a.model, "tokenizer_path": a.model, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "stallwatch_tiny", "architectures": ["TinyForCausalLM"]}

    def _server_info(self, states: list) -> dict:
        tm = self.tm
        a = vars(tm.args)
        info = {k: v for k, v in a.items() if not k.startswith("fault")}
        info.update({"model_path": tm.args.model, "tp_size": tm.args.tp, "pp_size": tm.args.pp,
                     "ep_size": tm.args.ep, "served_model_name": tm.model_name,
                     "watchdog_timeout": tm.args.watchdog_timeout, "soft_watchdog_timeout": None,
                     "scheduler_info": {"max_total_num_tokens": tm.args.max_total_tokens},
                     "internal_states": states, "version": tm.shape.version, "kv_events": None,
                     "server_impl": "stallwatch.sglang.protocol_server",
                     "processes": {name: p.get("pid") for name, p in tm.ready.items()},
                     "model_runtime": tm.ready.get("scheduler_0", {})})
        return info


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


