"""A small server speaking SGLang's HTTP protocol, built like SGLang so that its faults look real.

    python -m stallwatch.sglang.protocol_server --port 30000 --enable-metrics \\
        --enable-return-hidden-states [--device auto|cpu|cuda|python] [--tp N] [--log FILE]

Process tree (as in `python -m sglang.launch_server`):

    python -m stallwatch.sglang.protocol_server ...   HTTP front + tokenizer manager (threads)
    ├── sglang::scheduler          (sglang::scheduler_TP0, _TP1 ... with --tp N) runs the model
    ├── sglang::detokenizer        turns token ids into text, forwards outputs to the front
    └── python -c from multiprocessing.resource_tracker ...   (multiprocessing's helper)

Requests go front -> scheduler (a multiprocessing queue), outputs scheduler -> detokenizer ->
front (pipes), and control replies (/server_info) and metric snapshots scheduler -> front (a
pipe). So SIGSTOP of the scheduler alone gives what #33858 and #4191 describe: the HTTP process
answers /model_info, /health_generate fails after its budget with SGLang's log line,
/server_info hangs, and /metrics keeps serving the last gauges while its counters stop.

Endpoints (SGLang 0.5.x): POST /generate, GET /health, /health_generate, /server_info
(/get_server_info), /model_info (/get_model_info), /metrics (with --enable-metrics), /ready.
Fault hooks: --fault hang|crash|exit|slow --fault-after-requests N [--fault-rank R], and SIGUSR1
(to the server or a scheduler) toggles a scheduler hang at runtime. See docs/sglang-templates.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

SGLANG_VERSION = "0.5.23"  # the protocol version mirrored
DEFAULT_PORT = 30000
FORCE_STREAM_INTERVAL = 50  # SGLang sends a non-streamed request's output every 50 tokens
FAULTS = ("hang", "crash", "exit", "slow")

logger = logging.getLogger("sglang")
access_logger = logging.getLogger("uvicorn.access")


# ------------------------------------------------------------------------------ arguments


def _health_default() -> float:
    try:
        return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
    except ValueError:
        return 20.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m stallwatch.sglang.protocol_server",
        description="A small server speaking SGLang's HTTP protocol (a template; see "
                    "docs/sglang-templates.md).")
    a = p.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port (see --port-file)")
    a("--port-file", help="write the bound port here once the HTTP server listens")
    a("--model", "--model-path", dest="model", default="tiny", help="reported as model_path")
    a("--served-model-name", default=None, help="the model_name metric label (default: --model)")
    a("--device", default="auto", help="auto | cpu | cuda | cuda:N | python (pure-Python model)")
    a("--hidden-size", type=int, default=256)
    a("--num-layers", type=int, default=4)
    a("--vocab-size", type=int, default=1024)
    a("--seed", type=int, default=0)
    a("--aux-layers", default=None, help="comma-separated layers captured for aux hidden states "
      "(default: SpecForge's 1, L/2-1, L-4)")
    a("--tp", "--tp-size", dest="tp", type=int, default=1, help="scheduler processes (tensor parallel)")
    a("--enable-metrics", action="store_true")
    a("--enable-metrics-for-all-schedulers", action="store_true")
    a("--enable-return-hidden-states", action="store_true",
      help="allow return_hidden_states in /generate (as SGLang requires)")
    a("--log", default=None, help="append the log (every process) to this file as well as stderr")
    a("--no-access-log", action="store_true", help="no uvicorn-style access log lines")
    a("--health-timeout-s", type=float, default=_health_default(),
      help="budget of /health and /health_generate (SGLANG_HEALTH_CHECK_TIMEOUT, default 20)")
    a("--decode-log-interval", type=int, default=40)
    a("--chunked-prefill-size", type=int, default=8192)
    a("--max-running-requests", type=int, default=64)
    a("--max-total-tokens", type=int, default=65536, help="KV pool size (for token_usage)")
    a("--busy-factor", type=int, default=1, help="repeat each forward N times (GPU utilisation)")
    a("--kv-cache-gb", type=float, default=0.0, help="reserve this much device memory (torch)")
    a("--forward-delay-s", type=float, default=0.0, help="sleep this long in each forward step")
    a("--fault", choices=FAULTS, default=None,
      help="hang: scheduler stops answering; crash: scheduler exits alone (HTTP stays up); "
           "exit: scheduler raises and takes the whole server down (SIGQUIT, as SGLang); "
           "slow: each forward step sleeps --fault-slow-s")
    a("--fault-after-requests", type=int, default=None,
      help="inject --fault once this many requests have finished (health checks excluded)")
    a("--fault-rank", type=int, default=0, help="the tp rank that gets the fault")
    a("--fault-slow-s", type=float, default=0.5)
    a("--fault-marker", default=None,
      help="inject the fault only if this file does not exist, and create it (once across restarts)")
    a("--dist-port", type=int, default=0, help="torch.distributed rendezvous port (0: pick one)")
    a("--dist-timeout-s", type=float, default=600.0)
    a("--startup-timeout-s", type=float, default=600.0)
    return p


# ------------------------------------------------------------------------- process helpers


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Die with the parent, as SGLang's children do (kill_itself_when_parent_died)."""
    try:
        _libc().prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: nothing to do
        pass


def set_process_title(title: str) -> None:
    """What `ps`, /proc/PID/cmdline and psutil show: `sglang::scheduler`, like setproctitle.

    Uses the setproctitle module when installed (SGLang's dependency); otherwise sets the
    thread name (comm, 15 bytes) with prctl(PR_SET_NAME) and rewrites the argv area in place,
    found from /proc/self/stat, with its last byte non-NUL so the kernel reports only the title.
    """
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(title)
        return
    except Exception:  # noqa: BLE001
        pass
    try:
        _libc().prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rfind(b")") + 2:].split()
        arg_start, arg_end = int(fields[45]), int(fields[46])
        size = arg_end - arg_start
        if size < 3:
            return
        raw = title.encode()[: size - 2]
        buf = raw + b"\0" + b" " * (size - len(raw) - 1)
        ctypes.memmove(arg_start, buf, size)
    except Exception:  # noqa: BLE001 - cosmetic: never fatal
        pass


def configure_logging(log_file: str | None, prefix: str = "", access_log: bool = True) -> None:
    """SGLang's format: `[2026-11-29 12:00:00 TP0] message`; uvicorn's for access lines."""
    fmt = logging.Formatter(f"[%(asctime)s{prefix}] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    afmt = logging.Formatter("%(levelname)s:     %(message)s")
    for lg, f, on in ((logger, fmt, True), (access_logger, afmt, access_log)):
        lg.handlers.clear()
        lg.propagate = False
        lg.setLevel(logging.INFO if on else logging.WARNING)
        handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
        if log_file:
            handlers.append(logging.FileHandler(log_file, mode="a", encoding="utf-8"))
        for h in handlers:
            h.setFormatter(f)
            lg.addHandler(h)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ scheduler


@dataclass
class _Req:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    return_hidden: bool
    return_aux: bool
    log_metrics: bool
    cache: Any = None
    prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)
    hidden: list = field(default_factory=list)
    aux: list = field(default_factory=list)
    first_token_time: float | None = None
    streamed: int = 0


class Scheduler:
    """The event loop of one tp rank. Rank 0 receives requests, plans each step, sends the plan
    to the other ranks (so all run the same forwards and collectives), runs it, and sends
    outputs to the detokenizer; other ranks execute plans."""

    def __init__(self, args: dict, rank: int, recv_q: Any, plan_in: Any, plan_outs: list,
                 to_detok: Any, to_front: Any) -> None:
        self.a = args
        self.rank = rank
        self.tp = args["tp"]
        self.recv_q, self.plan_in, self.plan_outs = recv_q, plan_in, plan_outs
        self.to_detok, self.to_front = to_detok, to_front
        self.waiting: deque[_Req] = deque()
        self.chunked: _Req | None = None
        self.running: list[_Req] = []
        self.caches: dict[str, Any] = {}  # followers
        self.hung = False
        self._hang_logged = False
        self.slow = False
        self.n_finished = 0  # finished requests that count (no warm-up, no health checks)
        self.armed = False  # any request finished (the warm-up is the first)
        self.fault_fired = False
        self.decode_steps = 0
        self.report_metrics = rank == 0 or args["enable_metrics_for_all_schedulers"]
        # metrics state
        self.forward_s = {"extend": 0.0, "decode": 0.0}
        self.idle_s = 0.0
        self.tokens = {"prefill_compute": 0, "prefill_cache": 0, "decode": 0}
        self.gen_throughput = 0.0
        self._last_decode_log = (time.monotonic(), 0)
        self._last_report = 0.0
        self._was_busy = False
        self.model: Any = None
        self.device = "python"

    # -- setup ----------------------------------------------------------------------------------

    def init_model(self) -> dict:
        from stallwatch.sglang.model import ModelConfig, load_model, resolve_device

        a = self.a
        dev = resolve_device(a["device"])
        all_reduce = None
        if dev != "python":
            import torch

            if self.tp > 1:
                import datetime

                import torch.distributed as dist

                if dev.startswith("cuda") and torch.cuda.device_count() >= self.tp:
                    dev = f"cuda:{self.rank}"
                    torch.cuda.set_device(self.rank)
                    backend = "nccl"
                else:
                    if dev.startswith("cuda"):
                        logger.warning(f"--tp {self.tp} needs {self.tp} GPUs, torch sees "
                                       f"{torch.cuda.device_count()}: running the ranks on CPU with gloo")
                    dev, backend = "cpu", "gloo"
                logger.info(f"Init torch distributed begin. backend={backend}, rank={self.rank}, "
                            f"world_size={self.tp}")
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{a['dist_port']}",
                                        rank=self.rank, world_size=self.tp,
                                        timeout=datetime.timedelta(seconds=a["dist_timeout_s"]))
                warm = torch.ones(1, device=dev)
                dist.all_reduce(warm)
                logger.info(f"Init torch distributed ends. all_reduce check: {warm.item():g}")

                all_reduce = dist.all_reduce
            elif dev == "cuda":
                dev = f"cuda:{torch.cuda.current_device()}"
        aux = tuple(int(x) for x in a["aux_layers"].split(",")) if a["aux_layers"] else None
        cfg = ModelConfig(hidden_size=a["hidden_size"], num_layers=a["num_layers"],
                          vocab_size=a["vocab_size"], seed=a["seed"], aux_layers=aux)
        t0 = time.monotonic()
        self.model = load_model(cfg, dev, tp_rank=self.rank, tp_size=self.tp, all_reduce=all_reduce,
                                busy_factor=a["busy_factor"], kv_cache_gb=a["kv_cache_gb"])
        self.device = self.model.device
        logger.info(f"Load weight end. type={type(self.model).__name__}, backend={self.model.backend}, "
                    f"device={self.device}, hidden_size={cfg.hidden_size}, num_layers={cfg.num_layers}, "
                    f"elapsed={time.monotonic() - t0:.2f} s")
        return {"pid": os.getpid(), "rank": self.rank, **self.model.describe()}

    # -- signals and faults ---------------------------------------------------------------------

    def on_sigusr1(self, signum: int, frame: Any) -> None:
        self.hung = not self.hung  # only a flag: the loop logs and acts on it

    def _maybe_hang(self) -> None:
        if not self.hung:
            return
        logger.warning("Scheduler hang injected: not receiving, not running, not reporting "
                       "(SIGUSR1 resumes)")
        while self.hung:
            time.sleep(0.1)  # an idle-but-wedged loop: wakes, does nothing (#33858)
        logger.warning("Scheduler hang lifted: resuming")

    def _check_fault(self) -> None:
        a = self.a
        if (self.fault_fired or a["fault"] is None or a["fault_after_requests"] is None or not self.armed
                or self.rank != a["fault_rank"] or self.n_finished < a["fault_after_requests"]):
            return  # armed: the warm-up request finished, so a fault never stops startup
        self.fault_fired = True
        marker = a.get("fault_marker")
        if marker:
            if os.path.exists(marker):
                logger.info(f"Fault {a['fault']} skipped: marker {marker} exists")
                return
            with open(marker, "w") as f:
                f.write(f"{a['fault']} after {self.n_finished} requests, pid {os.getpid()}\n")
        kind = a["fault"]
        if kind == "hang":
            self.hung = True
        elif kind == "slow":
            logger.warning(f"Scheduler slow fault injected: +{a['fault_slow_s']:g} s per forward step")
            self.slow = True
        else:
            try:
                raise RuntimeError(f"injected fault: scheduler {kind} after {self.n_finished} requests")
            except RuntimeError:
                logger.error(f"Scheduler hit an exception: {traceback.format_exc()}")
            for h in logger.handlers:
                h.flush()
            if kind == "exit":  # SGLang's handler: tell the parent, which kills the tree
                os.kill(os.getppid(), signal.SIGQUIT)
            os._exit(1)

    # -- requests -----------------------------------------------------------------------------

    def _recv(self, block_s: float) -> None:
        try:
            msg = self.recv_q.get(timeout=block_s) if block_s > 0 else self.recv_q.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.recv_q.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "generate":
            r = msg[1]
            self.waiting.append(_Req(r["rid"], list(r["input_ids"]), int(r["max_new_tokens"]),
                                     bool(r["return_hidden"]), bool(r["return_aux"]), bool(r["log_metrics"])))
        elif kind == "abort":
            self._abort(msg[1])
        elif kind == "get_internal_state":
            self.to_front.send(("internal_state", msg[1], self._internal_state()))

    def _abort(self, rid: str) -> None:
        for q in (self.waiting,):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
        if self.chunked is not None and self.chunked.rid == rid:
            self._free([self.chunked])
            self.chunked = None
        gone = [r for r in self.running if r.rid == rid]
        if gone:
            self.running = [r for r in self.running if r.rid != rid]
            self._free(gone)

    def _internal_state(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "last_gen_throughput": self.gen_throughput,
                "#running-req": len(self.running), "#queue-req": len(self.waiting),
                "num_used_tokens": self._used_tokens(), "device": self.device,
                "finished_requests": self.n_finished, "hung": self.hung}

    def _used_tokens(self) -> int:
        reqs = self.running + ([self.chunked] if self.chunked else [])
        return sum(r.prefilled + len(r.output_ids) for r in reqs)

    def _token_usage(self) -> float:
        return min(1.0, self._used_tokens() / max(1, self.a["max_total_tokens"]))

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            self._maybe_hang()
            busy = bool(self.waiting or self.running or self.chunked)
            t0 = time.monotonic()
            self._recv(0.0 if busy else 0.1)
            if not busy:
                self.idle_s += time.monotonic() - t0
            if self.hung:  # SIGUSR1 arrived while receiving: hang before running anything
                continue
            if self.waiting or self.chunked:
                self._prefill_step()
            elif self.running:
                self._decode_step()
            self._report()
            self._check_fault()

    def _send_plan(self, ops: list) -> None:
        for conn in self.plan_outs:
            conn.send(("step", ops, self.n_finished, self.armed))

    def _delay(self) -> None:
        d = self.a["forward_delay_s"] + (self.a["fault_slow_s"] if self.slow else 0.0)
        if d > 0:
            time.sleep(d)

    def _prefill_step(self) -> None:
        budget = self.a["chunked_prefill_size"]
        plan: list[tuple[_Req, list[int], bool]] = []
        running_before = len(self.running)
        if self.chunked is not None:
            r = self.chunked
            n = min(budget, len(r.input_ids) - r.prefilled)
            plan.append((r, r.input_ids[r.prefilled:r.prefilled + n], False))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) + len(plan) < self.a["max_running_requests"]:
            r = self.waiting.popleft()
            n = min(budget, len(r.input_ids))
            plan.append((r, r.input_ids[:n], True))
            budget -= n
        if not plan:
            if self.running:
                self._decode_step()
            return
        self._send_plan([("extend", r.rid, chunk) for r, chunk, _ in plan])
        t0 = time.monotonic()
        finished: list[_Req] = []
        self.chunked = None
        new_tokens = 0
        for r, chunk, _new in plan:
            if r.cache is None:
                r.cache = self.model.new_cache()
            out = self.model.forward(r.cache, chunk, return_hidden=r.return_hidden, return_aux=r.return_aux)
            r.prefilled += len(chunk)
            new_tokens += len(chunk)
            if r.return_hidden:
                r.hidden.append(out.hidden)
            if r.return_aux:
                r.aux.append(out.aux)
            if r.prefilled < len(r.input_ids):
                self.chunked = r
                continue
            r.first_token_time = time.time()
            if r.max_new_tokens > 0:
                r.output_ids.append(out.next_token)
            if len(r.output_ids) >= r.max_new_tokens:
                finished.append(r)
            else:
                self.running.append(r)
        self._delay()
        self.forward_s["extend"] += time.monotonic() - t0
        self.tokens["prefill_compute"] += new_tokens
        logger.info(f"Prefill batch, #new-seq: {len(plan)}, #new-token: {new_tokens}, #cached-token: 0, "
                    f"token usage: {self._token_usage():.2f}, #running-req: {running_before}, "
                    f"#queue-req: {len(self.waiting)}")
        self._finish(finished)

    def _decode_step(self) -> None:
        reqs = list(self.running)
        self._send_plan([("decode", r.rid, [r.output_ids[-1]]) for r in reqs])
        t0 = time.monotonic()
        finished, partial = [], []
        for r in reqs:
            out = self.model.forward(r.cache, [r.output_ids[-1]], return_hidden=r.return_hidden,
                                     return_aux=r.return_aux)
            if r.return_hidden:
                r.hidden.append(out.hidden[0])
            if r.return_aux:
                r.aux.append(out.aux[0])
            r.output_ids.append(out.next_token)
            if len(r.output_ids) >= r.max_new_tokens:
                finished.append(r)
            elif len(r.output_ids) - r.streamed >= FORCE_STREAM_INTERVAL:
                partial.append(r)
        self._delay()
        self.forward_s["decode"] += time.monotonic() - t0
        self.tokens["decode"] += len(reqs)
        self.decode_steps += 1
        if self.decode_steps % max(1, self.a["decode_log_interval"]) == 0:
            now = time.monotonic()
            t_last, tok_last = self._last_decode_log
            self.gen_throughput = (self.tokens["decode"] - tok_last) / max(now - t_last, 1e-9)
            self._last_decode_log = (now, self.tokens["decode"])
            logger.info(f"Decode batch, #running-req: {len(reqs)}, #token: {self._used_tokens()}, "
                        f"token usage: {self._token_usage():.2f}, cuda graph: False, "
                        f"gen throughput (token/s): {self.gen_throughput:.2f}, #queue-req: {len(self.waiting)}")
        if partial:
            outs = []
            for r in partial:
                r.streamed = len(r.output_ids)
                outs.append({"rid": r.rid, "output_ids": list(r.output_ids), "finished": False})
            self.to_detok.send(("batch_token_id_out", outs))
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        self._finish(finished)

    def _finish(self, reqs: list[_Req]) -> None:
        if not reqs:
            return
        outs = []
        for r in reqs:
            meta = {"prompt_tokens": len(r.input_ids), "completion_tokens": len(r.output_ids),
                    "cached_tokens": 0, "finish_reason": {"type": "length", "length": r.max_new_tokens},
                    "first_token_time": r.first_token_time}
            if r.return_hidden:
                meta["hidden_states"] = r.hidden
            if r.return_aux:
                meta["aux_hidden_states"] = r.aux
            outs.append({"rid": r.rid, "output_ids": list(r.output_ids), "finished": True, "meta": meta})
            if r.log_metrics:
                self.n_finished += 1
        self.armed = True
        self.to_detok.send(("batch_token_id_out", outs))
        self._free(reqs)

    def _free(self, reqs: list[_Req]) -> None:
        for r in reqs:
            r.cache = None
        if self.plan_outs:
            self._send_plan([("free", r.rid, None) for r in reqs])

    def _report(self, force: bool = False) -> None:
        if not self.report_metrics:
            return
        now = time.monotonic()
        busy = bool(self.waiting or self.running or self.chunked or self.caches)
        changed, self._was_busy = busy != self._was_busy, busy
        if not (force or changed) and now - self._last_report < (0.1 if busy else 0.5):
            return
        self._last_report = now
        running = len(self.running) + (1 if self.chunked else 0) if self.rank == 0 else len(self.caches)
        snap = {
            "gauges": {"num_running_reqs": running, "num_queue_reqs": len(self.waiting),
                       "gen_throughput": self.gen_throughput if busy else 0.0,
                       "token_usage": self._token_usage(), "num_used_tokens": self._used_tokens(),
                       "cache_hit_rate": 0.0, "max_total_num_tokens": self.a["max_total_tokens"]},
            "forward_s": dict(self.forward_s), "idle_s": self.idle_s, "tokens": dict(self.tokens),
        }
        self.to_front.send(("metrics", self.rank, snap))

    # -- followers ------------------------------------------------------------------------------

    def run_follower(self) -> None:
        while True:
            self._maybe_hang()
            if not self.plan_in.poll(0.1):
                self.idle_s += 0.1
                self._report()
                continue
            try:
                _, ops, n_finished, armed = self.plan_in.recv()
            except EOFError:
                logger.error("Scheduler: rank 0 closed its connection; idling")
                while True:
                    time.sleep(3600)
            self.n_finished, self.armed = n_finished, armed
            t0 = time.monotonic()
            kinds = set()
            for kind, rid, ids in ops:
                if kind == "free":
                    self.caches.pop(rid, None)
                    continue
                kinds.add(kind)
                cache = self.caches.get(rid)
                if cache is None:
                    cache = self.caches[rid] = self.model.new_cache()
                self.model.forward(cache, ids)
                if kind == "extend":
                    self.tokens["prefill_compute"] += len(ids)
                else:
                    self.tokens["decode"] += 1
            if kinds:
                self._delay()
                cat = "decode" if kinds == {"decode"} else "extend"
                self.forward_s[cat] += time.monotonic() - t0
            self._report()
            self._check_fault()


def run_scheduler_process(args: dict, rank: int, recv_q: Any, plan_in: Any, plan_outs: list,
                          to_detok: Any, to_front: Any) -> None:
    set_pdeathsig()
    tp = args["tp"]
    set_process_title("sglang::scheduler" + (f"_TP{rank}" if tp > 1 else ""))
    configure_logging(args["log"], prefix=f" TP{rank}" if tp > 1 else "")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (see the device notes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the front decides
    sched = Scheduler(args, rank, recv_q, plan_in, plan_outs, to_detok, to_front)
    signal.signal(signal.SIGUSR1, sched.on_sigusr1)
    try:
        info = sched.init_model()
        to_front.send(("ready", f"scheduler_TP{rank}", info))
        if rank == 0:
            sched.run()
        else:
            sched.run_follower()
    except Exception:  # noqa: BLE001 - as SGLang: log, tell the parent, die
        logger.error(f"Scheduler hit an exception: {traceback.format_exc()}")
        for h in logger.handlers:
            h.flush()
        try:
            os.kill(os.getppid(), signal.SIGQUIT)
        finally:
            os._exit(1)


# ---------------------------------------------------------------------------- detokenizer


def detokenize(ids: list[int]) -> str:
    """Byte-level: ids below 256 are UTF-8 bytes; others are shown as <|id|>."""
    out, buf = [], bytearray()
    for i in ids:
        if 0 <= i < 256:
            buf.append(i)
        else:
            if buf:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
            out.append(f"<|{i}|>")
    if buf:
        out.append(buf.decode("utf-8", "replace"))
    return "".join(out)


def tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run_detokenizer_process(args: dict, from_sched: Any, to_front: Any) -> None:
    set_pdeathsig()
    set_process_title("sglang::detokenizer")
    configure_logging(args["log"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    to_front.send(("ready", "detokenizer", {"pid": os.getpid()}))
    while True:
        try:
            _kind, outs = from_sched.recv()
        except EOFError:
            logger.error("Detokenizer: the scheduler closed its connection")
            while True:  # SGLang's detokenizer stays up, waiting on its socket
                time.sleep(3600)
        for o in outs:
            o["text"] = detokenize(o["output_ids"])
        to_front.send(("batch_str_out", outs))


# ------------------------------------------------------------------------- front: metrics


class FrontMetrics:
    """SGLang's names in a dedicated registry: tokenizer-side counters and histograms observed
    here, scheduler-side gauges and counters from the last snapshot each scheduler sent (so a
    hung scheduler leaves them at their last values, like the multiprocess `mostrecent` gauges)."""

    E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)
    TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5,
                    7.5, 10, 15, 20, 25, 30)

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine_type": "unified"}
        names = list(self.labels)
        r = self.registry
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                                     names, registry=r).labels(**self.labels)
        self.generation_tokens = Counter("sglang:generation_tokens", "Number of generation tokens "
                                         "processed.", names, registry=r).labels(**self.labels)
        self.num_requests = Counter("sglang:num_requests", "Number of requests processed.", names,
                                    registry=r).labels(**self.labels)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request "
                             "latency in seconds", names, registry=r, buckets=self.E2E_BUCKETS
                             ).labels(**self.labels)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first "
                              "token in seconds.", names, registry=r, buckets=self.TTFT_BUCKETS
                              ).labels(**self.labels)
        self.snapshots: dict[int, dict] = {}
        r.register(self)  # collect() below: the scheduler-side families

    def observe(self, prompt_tokens: int, completion_tokens: int, e2e_s: float, ttft_s: float | None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.num_requests.inc()
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        gauge_docs = {
            "num_running_reqs": "The number of running requests.",
            "num_queue_reqs": "The number of requests in the waiting queue.",
            "gen_throughput": "The generation throughput (token/s).",
            "token_usage": "The token usage.",
            "num_used_tokens": "The number of used tokens.",
            "cache_hit_rate": "The prefix cache hit rate.",
            "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
        }
        snaps = dict(self.snapshots)
        for g, doc in gauge_docs.items():
            fam = GaugeMetricFamily(f"sglang:{g}", doc, labels=names)
            for rank, s in sorted(snaps.items()):
                fam.add_metric([self.model_name, "unified", str(rank), "0"], float(s["gauges"][g]))
            yield fam
        fwd = CounterMetricFamily("sglang:forward_execution_seconds", "Total time the scheduler spent "
                                  "executing forward passes, by forward mode.", labels=names + ["category"])
        idle = CounterMetricFamily("sglang:scheduler_idle_seconds", "Total time the scheduler was "
                                   "idle (no batch to run).", labels=names)
        rt = CounterMetricFamily("sglang:realtime_tokens", "Total number of tokens processed. mode: "
                                 "prefill_compute, prefill_cache, decode.", labels=names + ["mode"])
        for rank, s in sorted(snaps.items()):
            base = [self.model_name, "unified", str(rank), "0"]
            for cat, v in s["forward_s"].items():
                fwd.add_metric(base + [cat], v)
            idle.add_metric(base, s["idle_s"])
            for mode, v in s["tokens"].items():
                rt.add_metric(base + [mode], v)
        yield fwd
        yield idle
        yield rt

    def describe(self) -> list:
        return []

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# --------------------------------------------------------------- front: tokenizer manager


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
        conns = list(self.conns)
        while conns:
            for c in mpc.wait(conns):
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
               return_aux: bool, log_metrics: bool = True) -> _State:
        st = _State(log_metrics)
        with self.lock:
            if rid in self.rid_to_state:
                raise ValueError(f"Duplicate request ID {rid}")
            self.rid_to_state[rid] = st
        self.send_q.put(("generate", {"rid": rid, "input_ids": input_ids, "max_new_tokens": max_new_tokens,
                                      "return_hidden": return_hidden, "return_aux": return_aux,
                                      "log_metrics": log_metrics}))
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
        self.submit(rid, [0], 1, False, False, log_metrics=False)
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


# -------------------------------------------------------------------------- front: HTTP


class _BadRequest(ValueError):
    pass


def _normalize(body: dict, vocab: int) -> list[dict]:
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
    for i, (ids, p) in enumerate(zip(items, sps)):
        if not isinstance(p, dict):
            raise _BadRequest("sampling_params must be an object")
        mnt = p.get("max_new_tokens", 128)
        if not isinstance(mnt, int) or mnt < 0:
            raise _BadRequest("max_new_tokens must be a non-negative integer")
        out.append({"input_ids": ids, "max_new_tokens": mnt,
                    "rid": str(rids[i]) if rids is not None else uuid.uuid4().hex})
    return out, batch  # type: ignore[return-value]


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
        want_hidden = bool(body.get("return_hidden_states"))
        want_aux = bool(body.get("return_aux_hidden_states"))
        if (want_hidden or want_aux) and not a.enable_return_hidden_states:
            raise _BadRequest("The server is not configured to return the hidden states. Please set "
                              "`--enable-return-hidden-states` to enable this feature.")
        items, batch = _normalize(body, a.vocab_size)  # type: ignore[misc]
        states = []
        for it in items:
            states.append((it, tm.submit(it["rid"], it["input_ids"], it["max_new_tokens"],
                                         want_hidden, want_aux)))
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
            if want_aux:
                meta["aux_hidden_states"] = m.get("aux_hidden_states", [])
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
        info.update({"model_path": tm.args.model, "tp_size": tm.args.tp, "served_model_name": tm.model_name,
                     "internal_states": states, "version": SGLANG_VERSION,
                     "server_impl": "stallwatch.sglang.protocol_server",
                     "processes": {name: p.get("pid") for name, p in tm.ready.items()},
                     "model_runtime": tm.ready.get("scheduler_TP0", {})})
        return info


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


# ---------------------------------------------------------------------------------- main


def _warmup(tm: TokenizerManager) -> None:
    st = tm.submit(f"WARMUP_{uuid.uuid4().hex[:8]}", tokenize("The capital city of France is"), 8,
                   False, False, log_metrics=False)
    while not st.event.wait(1.0):
        pass
    tm.server_status = "Up"
    tm.warmed_up = True
    logger.info("The server is fired up and ready to roll!")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tp < 1:
        raise SystemExit("--tp must be at least 1")
    if args.fault is not None and args.fault_after_requests is None:
        args.fault_after_requests = 0
    configure_logging(args.log, access_log=not args.no_access_log)
    if args.enable_metrics:
        from prometheus_client import disable_created_metrics

        disable_created_metrics()  # SGLang's multiprocess registry has no _created samples
    args.dist_port = args.dist_port or _free_port()
    try:
        from stallwatch.sglang.model import resolve_device

        resolve_device(args.device)  # fail fast on --device cuda without a GPU
    except RuntimeError as e:
        logger.error(str(e))
        return 2
    logger.info(f"server_args={vars(args)}")

    ctx = mp.get_context("spawn")
    cfg = dict(vars(args))
    send_q = ctx.Queue()
    detok_in, sched_to_detok = ctx.Pipe(duplex=False)
    front_from_detok, detok_to_front = ctx.Pipe(duplex=False)
    conns: dict[Any, str] = {front_from_detok: "the detokenizer"}
    procs: dict[str, Any] = {}
    child_ends: list[Any] = [detok_in, sched_to_detok, detok_to_front]
    plan_pipes = [ctx.Pipe(duplex=False) for _ in range(args.tp - 1)]  # (reader, writer)
    for rank in range(args.tp):
        front_from_sched, sched_to_front = ctx.Pipe(duplex=False)
        conns[front_from_sched] = f"scheduler TP{rank}"
        child_ends.append(sched_to_front)
        if rank == 0:
            pargs = (cfg, 0, send_q, None, [w for _, w in plan_pipes], sched_to_detok, sched_to_front)
        else:
            pargs = (cfg, rank, None, plan_pipes[rank - 1][0], [], None, sched_to_front)
        procs[f"scheduler_TP{rank}"] = ctx.Process(target=run_scheduler_process, args=pargs,
                                                   name=f"scheduler_TP{rank}", daemon=True)
    procs["detokenizer"] = ctx.Process(target=run_detokenizer_process,
                                       args=(cfg, detok_in, detok_to_front), name="detokenizer", daemon=True)
    child_ends += [end for pipe in plan_pipes for end in pipe]
    tm = TokenizerManager(args, send_q, conns, procs)
    stop = threading.Event()
    exit_code = [0]

    def kill_children() -> None:
        tm.shutting_down = True
        for p in procs.values():
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)  # also works on a SIGSTOPped child
                except ProcessLookupError:
                    pass
        for p in procs.values():
            if p.pid is not None:
                p.join(2)

    def on_term(signum: int, frame: Any) -> None:
        logger.info(f"Received {signal.Signals(signum).name}; shutting down")
        stop.set()

    def on_quit(signum: int, frame: Any) -> None:
        logger.error("Received sigquit from a child process. It usually means the child failed.")
        kill_children()
        for h in logger.handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # as SGLang's kill_process_tree(include_parent)

    def on_usr1(signum: int, frame: Any) -> None:
        p = procs.get(f"scheduler_TP{args.fault_rank}") or procs["scheduler_TP0"]
        if p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGQUIT, on_quit)
    signal.signal(signal.SIGUSR1, on_usr1)

    for p in procs.values():
        p.start()
    for end in child_ends:
        end.close()  # the children hold them now; EOF then means the child is gone
    tm.start()

    deadline = time.monotonic() + args.startup_timeout_s
    while not tm.ready_event.wait(0.2):
        dead = [n for n, p in procs.items() if p.exitcode is not None]
        if dead or time.monotonic() > deadline or stop.is_set():
            why = f"{', '.join(dead)} exited" if dead else "interrupted" if stop.is_set() else \
                f"not ready within {args.startup_timeout_s:g} s"
            logger.error(f"Startup failed: {why}")
            kill_children()
            return 1

    try:
        httpd = _HTTPServer((args.host, args.port), type("BoundHandler", (Handler,), {"tm": tm}))
    except OSError as e:
        logger.error(f"Cannot listen on {args.host}:{args.port}: {e}")
        kill_children()
        return 1
    port = httpd.server_address[1]
    if args.port_file:
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, args.port_file)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="http",
                     daemon=True).start()
    logger.info(f"Uvicorn running on http://{args.host}:{port} (Press CTRL+C to quit)")
    threading.Thread(target=_warmup, args=(tm,), name="warmup", daemon=True).start()

    while not stop.wait(0.5):
        pass
    httpd.shutdown()
    httpd.server_close()
    kill_children()
    logging.shutdown()
    os._exit(exit_code[0])


# ------------------------------------------------------------------- launching (tests, demo)


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
    "other": [...]} — schedulers in rank order (their titles say sglang::scheduler[_TPn])."""
    out: dict[str, list[tuple[str, int]]] = {"scheduler": [], "detokenizer": [], "other": []}
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
        role = ("scheduler" if argv0.startswith("sglang::scheduler") else
                "detokenizer" if argv0.startswith("sglang::detokenizer") else "other")
        out[role].append((argv0, int(d)))
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
        except Exception:  # noqa: BLE001
            pass
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
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


if __name__ == "__main__":
    from stallwatch.sglang.protocol_server import main as _main

    sys.exit(_main())
