"""The stand-in server's command line: SGLang's flags it honours, and its fault hooks.

Part of the stand-in SGLang server (stallwatch.sglang.protocol_server; docs/sglang-templates.md).
"""

from __future__ import annotations

import argparse
import os

from stallwatch.sglang.versions import SHAPES

DEFAULT_PORT = 30000
FAULTS = ("hang", "crash", "exit", "slow", "long")


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
    a("--sglang-version", choices=sorted(SHAPES), default="current",
      help="which upstream shape to follow: current (0.5.15 line) or 0.5.4 (routes, titles, "
           "what happens when a child dies; stallwatch.sglang.versions)")
    a("--aux-layers", default=None, help="comma-separated layers whose concatenation is returned as "
      "hidden_states (an EAGLE-3 target's capture); default: the last layer's output")
    a("--tp", "--tp-size", dest="tp", type=int, default=1, help="scheduler processes (tensor parallel)")
    a("--pp", "--pp-size", dest="pp", type=int, default=1,
      help="pipeline stages: tp × pp scheduler processes, a PP part in their titles")
    a("--ep", "--ep-size", dest="ep", type=int, default=1,
      help="expert parallel size: an EP part in the titles (ep rank = tp rank mod ep)")
    a("--watchdog-timeout", type=float, default=300.0,
      help="SGLang's hard watchdog: kill the server this long (to 1.5x, +5 s) after the last forward "
           "step while a batch runs")
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
      help="hang: scheduler stops answering; crash: scheduler exits alone (what follows depends on "
           "--sglang-version); exit: scheduler raises and takes the whole server down (SIGQUIT); "
           "slow: each forward step sleeps --fault-slow-s; long: the next batch computes (on the "
           "CPU, every rank) for --fault-slow-s, once")
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
