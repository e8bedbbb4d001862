"""The stand-in server's /metrics: SGLang's metric names, labels and multiprocess behaviour.

Part of the stand-in SGLang server (stallwatch.sglang.protocol_server; docs/sglang-templates.md).
"""

from __future__ import annotations

import os
from typing import Any


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
        self.snapshots: dict[tuple[int, int], dict] = {}
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
        snaps = dict(self.snapshots)  # (tp_rank, pp_rank) -> the rank's last snapshot
        for g, doc in gauge_docs.items():
            fam = GaugeMetricFamily(f"sglang:{g}", doc, labels=names)
            for (tp, pp), s in sorted(snaps.items()):
                fam.add_metric([self.model_name, "unified", str(tp), str(pp)], float(s["gauges"][g]))
            yield fam
        # Upstream: forward_execution_seconds_total only with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1
        # (named so since 2026-05); realtime_tokens_total (since 2025-12-24) counts every token the
        # scheduler ran, health checks' included. No scheduler_idle_seconds: not upstream.
        timer = os.environ.get("SGLANG_ENABLE_METRICS_DEVICE_TIMER", "").lower() in ("1", "true")
        fwd = CounterMetricFamily("sglang:forward_execution_seconds", "Total time the scheduler spent "
                                  "executing forward passes, by forward mode.", labels=names + ["category"])
        rt = CounterMetricFamily("sglang:realtime_tokens", "Total number of tokens processed. mode: "
                                 "prefill_compute, prefill_cache, decode.", labels=names + ["mode"])
        for (tp, pp), s in sorted(snaps.items()):
            base = [self.model_name, "unified", str(tp), str(pp)]
            for cat, v in s["forward_s"].items():
                fwd.add_metric(base + [cat], v)
            for mode, v in s["tokens"].items():
                rt.add_metric(base + [mode], v)
        if timer:
            yield fwd
        yield rt

    def describe(self) -> list:
        return []

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


