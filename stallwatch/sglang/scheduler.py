"""The stand-in server's scheduler processes: one per rank, run like SGLang's event loop.

Part of the stand-in SGLang server (stallwatch.sglang.protocol_server; docs/sglang-templates.md).
Titles follow the shape (stallwatch.sglang.versions); every rank runs SGLang's hard watchdog
(stallwatch.sglang.watchdogs).
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from stallwatch.sglang.procutil import configure_logging, logger, set_pdeathsig, set_process_title
from stallwatch.sglang.versions import SHAPES
from stallwatch.sglang.watchdogs import HardWatchdog

FORCE_STREAM_INTERVAL = 50  # SGLang sends a non-streamed request's output every 50 tokens


def _compute(seconds: float) -> None:
    """Keep the CPU busy for `seconds` (a long batch: a large hidden-state copy to the CPU)."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for i in range(2000):
            x ^= i


@dataclass
class _Req:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    return_hidden: bool
    log_metrics: bool
    cache: Any = None
    prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)
    hidden: list = field(default_factory=list)  # prefill chunks' rows, then decode rows
    first_token_time: float | None = None
    streamed: int = 0


class Scheduler:
    """The event loop of one rank. Rank 0 receives requests, plans each step, sends the plan to
    the other ranks (so all run the same forwards), runs it, waits for every rank to finish it
    (the collective: spinning, as NCCL does), and sends outputs to the detokenizer; other ranks
    execute plans and acknowledge each."""

    def __init__(self, args: dict, rank: int, recv_q: Any, plan_in: Any, plan_outs: list,
                 to_detok: Any, to_front: Any, acks: Any = None) -> None:
        self.a = args
        self.rank = rank  # the process index: tp rank + tp × pp rank
        self.tp = args["tp"]
        self.tp_rank, self.pp_rank = rank % self.tp, rank // self.tp
        self.recv_q, self.plan_in, self.plan_outs = recv_q, plan_in, plan_outs
        self.to_detok, self.to_front = to_detok, to_front
        self.acks = acks  # rank 0: the followers' ack readers; a follower: its ack writer
        self.watchdog = HardWatchdog(args["watchdog_timeout"], SHAPES[args["sglang_version"]])
        self.long_s = 0.0  # the "long" fault: the next step computes this long
        self.group_counts = (0, 0)  # (running, queued) of the group, as rank 0 planned them
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

            if self.tp > 1 and a["pp"] > 1:
                raise RuntimeError("--pp above 1 runs only with --device python")
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
        self.capture_aux = aux is not None  # hidden_states is then the layers' concatenation
        cfg = ModelConfig(hidden_size=a["hidden_size"], num_layers=a["num_layers"],
                          vocab_size=a["vocab_size"], seed=a["seed"], aux_layers=aux)
        t0 = time.monotonic()
        self.model = load_model(cfg, dev, tp_rank=self.tp_rank, tp_size=self.tp, all_reduce=all_reduce,
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
        elif kind == "long":
            logger.warning(f"Long batch fault injected: the next batch computes for {a['fault_slow_s']:g} s")
            self.long_s = a["fault_slow_s"]
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
                                     bool(r["return_hidden"]), bool(r["log_metrics"])))
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
        """Upstream's fields (get_internal_state): the server args again, throughput, memory; the
        queue lengths are not there (they are in the Prefill/Decode batch log lines)."""
        a = self.a
        args = {k: v for k, v in a.items() if not k.startswith("fault")}
        return {**args, "last_gen_throughput": self.gen_throughput,
                "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": a["max_total_tokens"],
                                 "graph": 0.0},
                "effective_max_running_requests_per_dp": a["max_running_requests"],
                "step_time_dict": {}}

    def _used_tokens(self) -> int:
        reqs = self.running + ([self.chunked] if self.chunked else [])
        return sum(r.prefilled + len(r.output_ids) for r in reqs)

    def _token_usage(self) -> float:
        return min(1.0, self._used_tokens() / max(1, self.a["max_total_tokens"]))

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        self.watchdog.start()
        while True:
            self._maybe_hang()
            busy = bool(self.waiting or self.running or self.chunked)
            t0 = time.monotonic()
            self._recv(0.0 if busy else 0.1)
            if not busy:
                self.idle_s += time.monotonic() - t0
            if self.hung:  # SIGUSR1 arrived while receiving: hang before running anything
                continue
            self.watchdog.in_batch = bool(self.waiting or self.chunked or self.running)
            if self.waiting or self.chunked:
                self._prefill_step()
            elif self.running:
                self._decode_step()
            self.watchdog.forward_ct += 1
            self.watchdog.in_batch = False
            self.group_counts = (len(self.running) + (1 if self.chunked else 0), len(self.waiting))
            self._report()
            self._check_fault()

    def _send_plan(self, ops: list) -> None:
        stepping = {rid for kind, rid, _ in ops if kind != "free"}
        if stepping:  # a batch starts: its counts are the gauges now, as upstream logs them first
            self.group_counts = (len(stepping | {r.rid for r in self.running}), len(self.waiting))
        for conn in self.plan_outs:
            try:
                conn.send(("step", ops, self.n_finished, self.armed, self.long_s, self.group_counts))
            except OSError:  # a dead peer: no error, as NCCL gives none; the collective waits
                pass
        if stepping:
            self._report(force=True)

    def _collective(self) -> None:
        """Wait until every rank has run the step, spinning as NCCL does (state R at full CPU
        while a peer is stopped); a peer that died leaves it spinning, as NCCL hangs on a dead
        peer until its timeout (what SGLang's watchdogs are for)."""
        if self.rank != 0 or not self.acks:
            return
        for conn in self.acks:
            while True:
                try:
                    if conn.poll(0):
                        conn.recv()
                        break
                except (EOFError, OSError):
                    pass  # the peer is gone: keep spinning, like a collective on a dead rank
                os.sched_yield()

    def _delay(self) -> None:
        d = self.a["forward_delay_s"] + (self.a["fault_slow_s"] if self.slow else 0.0)
        if d > 0:
            time.sleep(d)
        busy_s, self.long_s = self.long_s, 0.0
        _compute(busy_s)

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
            out = self._forward(r, chunk)
            r.prefilled += len(chunk)
            new_tokens += len(chunk)
            if r.return_hidden:
                r.hidden.extend(self._rows(out))  # rows [t][H] of this chunk
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
        self._collective()
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
            out = self._forward(r, [r.output_ids[-1]])
            if r.return_hidden:
                r.hidden.append(self._rows(out)[0])
            r.output_ids.append(out.next_token)
            if len(r.output_ids) >= r.max_new_tokens:
                finished.append(r)
            elif len(r.output_ids) - r.streamed >= FORCE_STREAM_INTERVAL:
                partial.append(r)
        self._delay()
        self._collective()
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
                # Upstream: the prefill's rows arrive once, as one [len(input_ids)][H] element
                # when the prefill finishes; each decode step adds one 1-D row.
                n = len(r.input_ids)
                meta["hidden_states"] = [r.hidden[:n], *r.hidden[n:]]
            outs.append({"rid": r.rid, "output_ids": list(r.output_ids), "finished": True, "meta": meta})
            if r.log_metrics:
                self.n_finished += 1
        self.armed = True
        self.to_detok.send(("batch_token_id_out", outs))
        self._free(reqs)

    def _forward(self, r: _Req, ids: list[int]) -> Any:
        return self.model.forward(r.cache, ids, return_hidden=r.return_hidden and not self.capture_aux,
                                  return_aux=r.return_hidden and self.capture_aux)

    def _rows(self, out: Any) -> list:
        return out.aux if self.capture_aux else out.hidden

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
        # Every rank of the group reports the group's counts, as upstream's ranks all hold the
        # same batch: summing them over ranks multiplies by TP.
        running, queued = self.group_counts
        snap = {
            "gauges": {"num_running_reqs": running, "num_queue_reqs": queued,
                       "gen_throughput": self.gen_throughput if busy else 0.0,
                       "token_usage": self._token_usage(), "num_used_tokens": self._used_tokens(),
                       "cache_hit_rate": 0.0, "max_total_num_tokens": self.a["max_total_tokens"]},
            "forward_s": dict(self.forward_s), "idle_s": self.idle_s, "tokens": dict(self.tokens),
        }
        self.to_front.send(("metrics", (self.tp_rank, self.pp_rank), snap))

    # -- followers ------------------------------------------------------------------------------

    def run_follower(self) -> None:
        self.watchdog.start()
        while True:
            self._maybe_hang()
            if not self.plan_in.poll(0.1):
                self.idle_s += 0.1
                self._report()
                continue
            try:
                _, ops, n_finished, armed, long_s, self.group_counts = self.plan_in.recv()
            except EOFError:
                logger.error("Scheduler: rank 0 closed its connection; idling")
                while True:
                    time.sleep(3600)
            self.n_finished, self.armed = n_finished, armed
            self.long_s = max(self.long_s, long_s)
            self.watchdog.in_batch = True
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
            if kinds:  # this rank's part of the collective (rank 0 waits after forward steps only)
                try:
                    self.acks.send(1)
                except OSError:
                    pass
            self.watchdog.forward_ct += 1
            self.watchdog.in_batch = False
            self._report()
            self._check_fault()


def rank_parts(args: dict, rank: int) -> tuple[dict[str, int], dict[str, int]]:
    """(rank of each dimension, size of each dimension) of process `rank`."""
    tp, pp, ep = args["tp"], args["pp"], args["ep"]
    ranks = {"DP": 0, "PP": rank // tp, "ATTN_CP": 0, "MOE_DP": 0, "TP": rank % tp, "EP": (rank % tp) % ep}
    return ranks, {"TP": tp, "PP": pp, "EP": ep}


def run_scheduler_process(args: dict, rank: int, recv_q: Any, plan_in: Any, plan_outs: list,
                          to_detok: Any, to_front: Any, acks: Any = None) -> None:
    set_pdeathsig()
    shape = SHAPES[args["sglang_version"]]
    ranks, sizes = rank_parts(args, rank)
    title = shape.scheduler_title(ranks, sizes)
    set_process_title(title)
    # The log prefix: the title's parts, space-separated (`[time DP0 TP2] ...`)
    prefix = title[len("sglang::scheduler"):].replace("_", " ")
    for joined in ("ATTN CP", "MOE DP"):
        prefix = prefix.replace(joined, joined.replace(" ", "_"))
    configure_logging(args["log"], prefix=prefix)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (see the device notes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the front decides
    sched = Scheduler(args, rank, recv_q, plan_in, plan_outs, to_detok, to_front, acks)
    signal.signal(signal.SIGUSR1, sched.on_sigusr1)
    try:
        info = sched.init_model()
        to_front.send(("ready", f"scheduler_{rank}", {**info, "title": title}))
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


