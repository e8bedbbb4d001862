"""A small server speaking SGLang's HTTP protocol, built like SGLang so that its faults look real.

    python -m stallwatch.sglang.protocol_server --port 30000 --enable-metrics \\
        --enable-return-hidden-states [--sglang-version current|0.5.4] [--device auto|cpu|cuda|python]
        [--tp N] [--pp N] [--ep N] [--watchdog-timeout S] [--log FILE]

Process tree (as in `python -m sglang.launch_server`):

    python -m stallwatch.sglang.protocol_server ...   HTTP front + tokenizer manager (threads)
    ├── sglang::scheduler          (sglang::scheduler_TP0, _PP1_TP0, _TP1_EP1 ... by the shape)
    ├── sglang::detokenizer        turns token ids into text, forwards outputs to the front
    └── python -c from multiprocessing.resource_tracker ...   (multiprocessing's helper)

Requests go front -> scheduler rank 0 (a multiprocessing queue), plans rank 0 -> the other ranks,
acks back (the collective), outputs rank 0 -> detokenizer -> front (pipes), and control replies
(/server_info) and metric snapshots scheduler -> front (a pipe). So SIGSTOP of a scheduler gives
what #33858 and #4191 describe: the HTTP process answers /model_info, /health_generate fails after
its budget with SGLang's log line, /server_info hangs, /metrics keeps the last gauges while its
counters stop; a stopped follower leaves rank 0 spinning in the collective until SGLang's hard
watchdog kills the tree.

Two shapes (`--sglang-version`, stallwatch.sglang.versions): `current` (routes, titles,
SubprocessWatchdog: a dead child kills the tree) and `0.5.4` (`/get_*` routes only, the old title
order, the zombie front). The modules, each readable whole: server_args (flags), scheduler,
watchdogs, detokenizer, tokenizer_manager, front_metrics, routes, launch (tests and the demo),
procutil; this one wires them together (main).

Fault hooks: --fault hang|crash|exit|slow|long --fault-after-requests N [--fault-rank R], and
SIGUSR1 (to the server or a scheduler) toggles a scheduler hang at runtime. See
docs/sglang-templates.md.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

from stallwatch.sglang.detokenizer import detokenize, run_detokenizer_process, tokenize
from stallwatch.sglang.launch import ServerProcess, child_processes, http_request, launch_server
from stallwatch.sglang.procutil import (
    _free_port, configure_logging, flush_logs, logger, set_pdeathsig, set_process_title,
)
from stallwatch.sglang.routes import Handler, _HTTPServer
from stallwatch.sglang.scheduler import run_scheduler_process
from stallwatch.sglang.server_args import DEFAULT_PORT, FAULTS, build_parser
from stallwatch.sglang.tokenizer_manager import TokenizerManager
from stallwatch.sglang.versions import SHAPES
from stallwatch.sglang.watchdogs import SubprocessWatchdog

__all__ = ["main", "launch_server", "ServerProcess", "child_processes", "http_request", "build_parser",
           "tokenize", "detokenize", "set_pdeathsig", "set_process_title", "DEFAULT_PORT", "FAULTS"]


def _warmup(tm: TokenizerManager) -> None:
    st = tm.submit(f"WARMUP_{uuid.uuid4().hex[:8]}", tokenize("The capital city of France is"), 8,
                   False, log_metrics=False)
    while not st.event.wait(1.0):
        pass
    tm.server_status = "Up"
    tm.warmed_up = True
    logger.info("The server is fired up and ready to roll!")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.tp, args.pp, args.ep) < 1:
        raise SystemExit("--tp, --pp and --ep must be at least 1")
    shape = SHAPES[args.sglang_version]
    world = args.tp * args.pp
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
    logger.info("server_args=ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in vars(args).items()) + ")")

    ctx = mp.get_context("spawn")
    cfg = dict(vars(args))
    send_q = ctx.Queue()
    detok_in, sched_to_detok = ctx.Pipe(duplex=False)
    front_from_detok, detok_to_front = ctx.Pipe(duplex=False)
    conns: dict[Any, str] = {front_from_detok: "the detokenizer"}
    procs: dict[str, Any] = {}
    child_ends: list[Any] = [detok_in, sched_to_detok, detok_to_front]
    plan_pipes = [ctx.Pipe(duplex=False) for _ in range(world - 1)]  # (reader, writer)
    ack_pipes = [ctx.Pipe(duplex=False) for _ in range(world - 1)]  # followers -> rank 0
    for rank in range(world):
        front_from_sched, sched_to_front = ctx.Pipe(duplex=False)
        conns[front_from_sched] = f"scheduler {rank}"
        child_ends.append(sched_to_front)
        pargs: tuple[Any, ...]  # Scheduler's arguments: rank 0 plans and sends, the others follow
        if rank == 0:
            pargs = (cfg, 0, send_q, None, [w for _, w in plan_pipes], sched_to_detok, sched_to_front,
                     [r for r, _ in ack_pipes])
        else:
            pargs = (cfg, rank, None, plan_pipes[rank - 1][0], [], None, sched_to_front,
                     ack_pipes[rank - 1][1])
        # SGLang's SubprocessWatchdog names them by index: scheduler_0, scheduler_1 ...
        procs[f"scheduler_{rank}"] = ctx.Process(target=run_scheduler_process, args=pargs,
                                                 name=f"scheduler_{rank}", daemon=True)
    procs["detokenizer"] = ctx.Process(target=run_detokenizer_process,
                                       args=(cfg, detok_in, detok_to_front), name="detokenizer", daemon=True)
    child_ends += [end for pipe in plan_pipes + ack_pipes for end in pipe]
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

    def on_quit(signum: Any, frame: Any) -> None:
        logger.error(shape.sigquit_message(signum, frame))
        kill_children()
        flush_logs()
        os.kill(os.getpid(), signal.SIGKILL)  # as SGLang's kill_process_tree(include_parent)

    def on_usr1(signum: int, frame: Any) -> None:
        p = procs.get(f"scheduler_{args.fault_rank}") or procs["scheduler_0"]
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
    if shape.subprocess_watchdog:  # current SGLang: a dead child takes the tree down (#18582)
        SubprocessWatchdog([(n, p) for n, p in procs.items()], lambda: on_quit(None, None),
                           lambda: tm.shutting_down).start()
    threading.Thread(target=_warmup, args=(tm,), name="warmup", daemon=True).start()

    while not stop.wait(0.5):
        pass
    httpd.shutdown()
    httpd.server_close()
    kill_children()
    logging.shutdown()
    os._exit(exit_code[0])


if __name__ == "__main__":
    from stallwatch.sglang.protocol_server import main as _main

    sys.exit(_main())
