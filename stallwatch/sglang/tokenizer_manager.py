"""The stand-in server's tokenizer manager: request state, the receive loop, health, internal state.

Part of the stand-in SGLang server (stallwatch.sglang.protocol_server; docs/sglang-templates.md).
"""

from __future__ import annotations

import argparse
import multiprocessing.connection as mpc
import threading
import time
import traceback
import uuid
from typing import Any, cast
from collections.abc import Callable

from stallwatch.sglang.front_metrics import FrontMetrics
from stallwatch.sglang.procutil import logger
from stallwatch.sglang.versions import SHAPES


class _State:
    __slots__ = ("event", "out", "created", "created_mono", "log_metrics")

    def __init__(self, log_metrics: bool) -> None:
        self.event = threading.Event()
        self.out: dict | None = None
        self.created = time.time()
        self.created_mono = time.monotonic()
        self.log_metrics = log_metrics


class TokenizerManager:
    """The front's side: request state, the receive loop, health, internal state, metrics."""

    def __init__(self, args: argparse.Namespace, send_q: Any, conns: dict[Any, str],
                 procs: dict[str, Any]) -> None:
        self.args = args
        self.shape = SHAPES[args.sglang_version]
        self.send_q = send_q
        self.conns = conns  # connection -> name, read by the receive loop
        self.procs = procs  # name -> multiprocessing.Process
        self.model_name = args.served_model_name or args.model
        self.lock = threading.Lock()
        self.rid_to_state: dict[str, _State] = {}
        self.recv_cond = threading.Condition()
        self.last_receive_tstamp = 0.0
        self.server_status = "Starting"
        self.shutting_down = False  # children killed on purpose are not failures
        self.warmed_up = False
        self.ready: dict[str, dict] = {}
        self.ready_event = threading.Event()
        self.info_waiters: dict[str, tuple[threading.Event, list]] = {}
        self.metrics = FrontMetrics(self.model_name) if args.enable_metrics else None

    # -- receive loop ---------------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._recv_loop, name="tokenizer-recv", daemon=True).start()
        threading.Thread(target=self._watch_children, name="child-watch", daemon=True).start()

    def _recv_loop(self) -> None:
        conns: list[mpc.Connection] = list(self.conns)
        while conns:
            # wait() hands back the very objects it was given: connections here
            for c in cast("list[mpc.Connection]", mpc.wait(conns)):
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    conns.remove(c)
                    logger.error(f"Lost the connection to {self.conns[c]}")
                    continue
                try:
                    self._dispatch(msg)
                except Exception:  # noqa: BLE001 - a bad message must not kill the loop
                    logger.error(f"Tokenizer manager: cannot handle a message: {traceback.format_exc()}")

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "batch_str_out":
            now = time.time()
            with self.recv_cond:
                self.last_receive_tstamp = now
                self.recv_cond.notify_all()
            for o in msg[1]:
                if not o.get("finished"):
                    continue
                with self.lock:
                    st = self.rid_to_state.pop(o["rid"], None)
                if st is None:
                    continue
                st.out = o
                if self.metrics is not None and st.log_metrics:
                    m = o["meta"]
                    ftt = m.get("first_token_time")
                    self.metrics.observe(m["prompt_tokens"], m["completion_tokens"],
                                         time.monotonic() - st.created_mono,
                                         None if ftt is None else ftt - st.created)
                st.event.set()
        elif kind == "metrics":
            if self.metrics is not None:
                self.metrics.snapshots[msg[1]] = msg[2]
        elif kind == "internal_state":
            w = self.info_waiters.pop(msg[1], None)
            if w is not None:
                w[1].append(msg[2])
                w[0].set()
        elif kind == "ready":
            self.ready[msg[1]] = msg[2]
            if len(self.ready) == len(self.procs):
                self.ready_event.set()

    def _watch_children(self) -> None:
        alive = dict(self.procs)
        while alive:
            sentinels = {p.sentinel: name for name, p in alive.items()}
            for s in mpc.wait(list(sentinels)):
                name = sentinels[s]
                p = alive.pop(name)
                p.join(1)
                code = p.exitcode
                raw = (code << 8) if code is not None and code >= 0 else -(code or 0)
                if code != 0 and not self.shutting_down:  # SGLang's SIGCHLD handler says this
                    logger.warning(f"Child process unexpectedly failed with exitcode={raw}. pid={p.pid} "
                                   f"({name})")

    # -- requests -------------------------------------------------------------------------------

    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int, return_hidden: bool,
               log_metrics: bool = True) -> _State:
        st = _State(log_metrics)
        with self.lock:
            if rid in self.rid_to_state:
                raise ValueError(f"Duplicate request ID {rid}")
            self.rid_to_state[rid] = st
        self.send_q.put(("generate", {"rid": rid, "input_ids": input_ids, "max_new_tokens": max_new_tokens,
                                      "return_hidden": return_hidden, "log_metrics": log_metrics}))
        return st

    def abort(self, rid: str) -> None:
        with self.lock:
            self.rid_to_state.pop(rid, None)
        self.send_q.put(("abort", rid))

    def health_generate(self, gone: Callable[[], bool]) -> int:
        """SGLang's /health_generate: a 1-token generation; 200 as soon as anything arrives from
        the detokenizer after the check started, else 503 after the budget."""
        if self.server_status == "Starting":
            return 503
        budget = self.args.health_timeout_s
        tic = time.time()
        rid = f"HEALTH_CHECK_{tic}_{uuid.uuid4().hex[:6]}"
        self.submit(rid, [0], 1, False, log_metrics=False)  # as upstream: log_metrics=False
        deadline = time.monotonic() + budget
        with self.recv_cond:
            while self.last_receive_tstamp <= tic:
                left = deadline - time.monotonic()
                if left <= 0 or gone():
                    break
                self.recv_cond.wait(min(left, 0.25))
            ok = self.last_receive_tstamp > tic
        if ok:
            with self.lock:
                self.rid_to_state.pop(rid, None)
            self.server_status = "Up"
            return 200
        self.abort(rid)
        if gone():
            return 503
        tic_s = time.strftime("%H:%M:%S", time.localtime(tic))
        last_s = time.strftime("%H:%M:%S", time.localtime(self.last_receive_tstamp))
        logger.error(f"Health check failed. Server couldn't get a response from detokenizer for last "
                     f"{budget:g} seconds. tic start time: {tic_s}. last_heartbeat time: {last_s}")
        self.server_status = "UnHealthy"
        return 503

    def internal_state(self, gone: Callable[[], bool]) -> list | None:
        req_id = uuid.uuid4().hex
        ev: threading.Event = threading.Event()
        box: list = []
        self.info_waiters[req_id] = (ev, box)
        self.send_q.put(("get_internal_state", req_id))
        while not ev.wait(0.25):  # no timeout, as SGLang: it hangs while the scheduler does
            if gone():
                self.info_waiters.pop(req_id, None)
                return None
        return box


