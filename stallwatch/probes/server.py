"""SGLang server probe: health, scheduler round-trip, HTTP liveness and metric counter rates.

Each endpoint says something different (docs/sglang.md, docs/field.md): /health_generate runs a real 1-token
generation and may take up to 20 s; /server_info round-trips to the schedulers, so it hangs when
they are stuck; /model_info proves only that the HTTP process lives; /metrics gauges keep their
last values when a scheduler hangs, so progress is judged from counter rates.

Versions (docs/upstream.md §3): /server_info and /model_info exist from SGLang 0.5.6; 0.5.0-0.5.5 have
only /get_server_info and /get_model_info. A 404 switches to the old name once, remembered per
probe (per server); on >= 0.5.6 the new name answers first, so the deprecated route (a warning
in the server's log per call) is never used there.

Every request runs in a background thread, one per endpoint at a time, and collect() waits at
most `collect_wait_s` for the quick ones: a wedged server never stalls the watchdog's tick. A call
still running past its budget is reported (`overdue`), which is itself evidence. /server_info is
never abandoned at its budget: upstream serialises `get_internal_state` calls with no timeout, so
a call we gave up on would still queue behind a slow batch and the next would pile up after it;
the one call stays in flight (overdue) until the server answers or `info_abandon_s` passes.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import Field

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.model import Frozen

if TYPE_CHECKING:
    import http.client

# Counters whose movement means the server did work for its clients. Only the tokenizer-side
# three exist on every 0.5.x version and leave health checks out (/health_generate sends
# log_metrics=False). Not these: `realtime_tokens_total` (from 2025-12) counts each health check's
# 1-token prefill, so stallwatch's own polling would look like progress on an idle server;
# `forward_execution_seconds_total` exists only with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1.
PROGRESS_COUNTERS = (
    "sglang:generation_tokens_total", "sglang:prompt_tokens_total", "sglang:num_requests_total",
)
# Gauges that claim work is under way; with frozen progress counters they are likely stale.
WORK_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput")
# Ratios: summing them across ranks or data-parallel groups would be meaningless.
_MAX_GAUGES = frozenset({"sglang:token_usage", "sglang:cache_hit_rate"})
# With --enable-metrics-for-all-schedulers every rank of a DP group exports the same gauges (and
# scheduler counters) under its own rank labels: one group's value is the max over these, never
# the sum (that multiplies by TP). Different dp_rank values are different requests: summed.
_SAME_WORK_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "attn_cp_rank", "moe_dp_rank",
                               "attn_tp_rank", "pid"})
_MAX_METRIC_NAMES = 512  # bound what one scrape adds to a trace line
INFO_ABANDON_S = 600.0  # a /server_info call older than this is given up (see the docstring)
# The routes of 0.5.0-0.5.5, tried once a 404 says the current name does not exist.
OLD_ROUTES = {"/server_info": "/get_server_info", "/model_info": "/get_model_info"}


class EndpointResult(Frozen):
    path: str
    ok: bool | None = None  # None: no call has finished yet
    status_code: int | None = None
    latency_s: float | None = None  # of the last finished call
    age_s: float | None = None  # since the last call finished
    timed_out: bool = False
    error: str | None = None
    in_flight_for_s: float | None = None  # a call is running now, for this long
    overdue: bool = False  # ... and longer than its budget: the server is not answering


class MetricsObs(Frozen):
    ok: bool
    error: str | None = None
    age_s: float | None = None  # since this scrape finished
    interval_s: float | None = None  # between the two scrapes the rates come from
    counters: dict[str, float] = Field(default_factory=dict)  # summed over label sets (tp_rank, category, mode ...)
    rates_per_s: dict[str, float] = Field(default_factory=dict)
    counter_resets: tuple[str, ...] = ()  # went down: the server restarted between scrapes
    # Gauges use multiprocess `mostrecent`: a hung scheduler keeps showing its last values.
    gauges: dict[str, float] = Field(default_factory=dict)
    gauges_possibly_stale: bool = False  # they claim work but no progress counter moved
    progress_unchanged_for_s: float | None = None  # no PROGRESS_COUNTERS movement for this long
    gauges_unchanged_for_s: float | None = None
    families: int = 0


class ServerObs(Frozen):
    base_url: str
    host: str
    port: int  # so the processes probe can match the job's client sockets to the server
    reachable: bool | None = None  # None until a call finishes; False: refused, unresolvable ...
    error: str | None = None  # why it is unreachable
    health: EndpointResult | None = None
    server_info: EndpointResult | None = None
    model_info: EndpointResult | None = None
    metrics_endpoint: EndpointResult | None = None
    metrics: MetricsObs | None = None
    version: str | None = None  # from /server_info
    model_path: str | None = None  # from /model_info
    # "/server_info" (SGLang >= 0.5.6) or "/get_server_info" (0.5.0-0.5.5): the route that answers
    info_route: str | None = None
    # From the server args in the last /server_info answer (kept while later calls hang): the hard
    # watchdog kills the server this long after its last forward while a batch runs (None: off).
    watchdog_timeout_s: float | None = None
    soft_watchdog_timeout_s: float | None = None
    server_args_known: bool = False


@dataclass
class _Answer:
    path: str
    status_code: int | None = None
    body: bytes | None = None
    error: str | None = None
    timed_out: bool = False
    connected: bool = True  # False: refused, unresolvable, connect timeout: the server is down


@dataclass
class _Done:
    answer: _Answer
    started: float
    finished: float


class _Poller:
    """One endpoint: at most one call in flight, started no more often than interval_s."""

    def __init__(self, path: str, call: Callable[[], _Answer], interval_s: float, budget_s: float,
                 clock: Clock, on_done: Callable[[_Answer, float], None] | None = None) -> None:
        self.path = path
        self._call = call
        self.interval_s = interval_s
        self.budget_s = budget_s
        self._clock = clock
        self._on_done = on_done
        self._lock = threading.Lock()
        self._started: float | None = None
        self._done_event = threading.Event()
        self._done_event.set()
        self.last: _Done | None = None

    def maybe_start(self) -> bool:
        """Start a call if none is running and one is due; True if this started one."""
        now = self._clock.monotonic()
        with self._lock:
            if self._started is not None:
                return False
            if self.last is not None and now - self.last.started < self.interval_s:
                return False
            self._started = now
            self._done_event.clear()
        threading.Thread(target=self._run, args=(now,), name=f"server{self.path}", daemon=True).start()
        return True

    def _run(self, started: float) -> None:
        try:
            answer = self._call()
        except Exception as e:  # noqa: BLE001 - a bug here must become a report, not a dead thread
            answer = _Answer(path=self.path, error=f"{type(e).__name__}: {e}")
        finished = self._clock.monotonic()
        if self._on_done is not None:
            try:
                self._on_done(answer, finished)
            except Exception as e:  # noqa: BLE001 - a bug in processing becomes the answer's error
                answer.error = f"processing failed: {type(e).__name__}: {e}"
        with self._lock:
            self.last = _Done(answer, started, finished)
            self._started = None
        self._done_event.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done_event.wait(timeout_s)

    def result(self) -> EndpointResult:
        now = self._clock.monotonic()
        with self._lock:
            last, started = self.last, self._started
        out: dict = dict(path=last.answer.path if last else self.path)
        if last is not None:
            a = last.answer
            out.update(ok=a.error is None and a.status_code == 200, status_code=a.status_code,
                       latency_s=last.finished - last.started, age_s=now - last.finished,
                       timed_out=a.timed_out, error=a.error)
        if started is not None:
            out.update(in_flight_for_s=now - started, overdue=now - started > self.budget_s)
        return EndpointResult(**out)


class ServerProbe:
    name = "server"

    def __init__(
        self,
        base_url: str,
        clock: Clock = SYSTEM_CLOCK,
        health_timeout_s: float = 25.0,
        info_timeout_s: float = 5.0,
        metrics_timeout_s: float = 5.0,
        *,
        health_interval_s: float = 10.0,
        info_interval_s: float = 5.0,
        model_info_interval_s: float = 30.0,
        metrics_interval_s: float = 0.0,
        collect_wait_s: float = 1.0,
        max_response_bytes: int = 4 << 20,
    ) -> None:
        u = urlsplit(base_url if "//" in base_url else f"http://{base_url}")
        self.base_url = base_url
        self.scheme = u.scheme or "http"
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if self.scheme == "https" else 80)
        self._prefix = u.path.rstrip("/")
        self.clock = clock
        self.collect_wait_s = collect_wait_s
        self.max_response_bytes = max_response_bytes
        self._health_path = "/health_generate"
        # The route that answers, per endpoint: the current name until a 404 says otherwise.
        self._routes = {"/server_info": "/server_info", "/model_info": "/model_info"}
        self._server_args: dict = {}
        self._metrics = _MetricsState(clock)
        poll = _Poller
        self._health_poller = poll("/health_generate", lambda: self._check_health(health_timeout_s),
                                   health_interval_s, health_timeout_s, clock)
        self._server_info_poller = poll(
            "/server_info", lambda: self._get_route("/server_info", max(info_timeout_s, INFO_ABANDON_S)),
            info_interval_s, info_timeout_s, clock, on_done=self._remember_args)
        self._model_info_poller = poll("/model_info", lambda: self._get_route("/model_info", info_timeout_s),
                                       model_info_interval_s, info_timeout_s, clock)
        self._metrics_poller = poll("/metrics", lambda: self._get("/metrics", metrics_timeout_s),
                                    metrics_interval_s, metrics_timeout_s, clock,
                                    on_done=self._metrics.update)
        self._quick = (self._server_info_poller, self._model_info_poller, self._metrics_poller)

    def collect(self) -> ServerObs:
        self._health_poller.maybe_start()  # never waited for: it may legitimately take 20 s
        # Wait only for calls started now: one still stuck from an earlier tick is already
        # evidence, and waiting on it again would slow every tick of a wedged server.
        started = [p for p in self._quick if p.maybe_start()]
        deadline = time.monotonic() + self.collect_wait_s
        for p in started:  # never past a call's budget: by then its lateness is the evidence
            p.wait(max(0.0, min(deadline - time.monotonic(), p.budget_s)))
        return self._observation()

    def wait_health(self, timeout_s: float) -> bool:
        """For one-shot use (diagnose): start a health check if due and wait for it to finish."""
        self._health_poller.maybe_start()
        return self._health_poller.wait(timeout_s)

    def _observation(self) -> ServerObs:
        pollers = {"health": self._health_poller, "server_info": self._server_info_poller,
                   "model_info": self._model_info_poller, "metrics_endpoint": self._metrics_poller}
        finished = [p.last for p in pollers.values() if p.last is not None]
        latest = max(finished, key=lambda d: d.finished) if finished else None
        return ServerObs(
            base_url=self.base_url, host=self.host, port=self.port,
            reachable=None if latest is None else latest.answer.connected,
            error=latest.answer.error if latest is not None and not latest.answer.connected else None,
            metrics=self._metrics.observation(),
            version=_json_field(self._server_info_poller.last, "version"),
            model_path=_json_field(self._model_info_poller.last, "model_path"),
            info_route=self._routes["/server_info"] if self._server_info_poller.last else None,
            server_args_known=bool(self._server_args),
            watchdog_timeout_s=_seconds(self._server_args.get("watchdog_timeout")),
            soft_watchdog_timeout_s=_seconds(self._server_args.get("soft_watchdog_timeout")),
            **{k: p.result() for k, p in pollers.items()},
        )

    def _remember_args(self, answer: _Answer, now: float) -> None:
        """Keep the server args of the last good /server_info: when the schedulers hang, the
        next calls hang too, and the watchdog's timeout is what says when SGLang will act."""
        if answer.body is None or answer.status_code != 200:
            return
        try:
            doc = json.loads(answer.body)
        except ValueError:
            return
        if isinstance(doc, dict):
            self._server_args = {k: doc.get(k) for k in ("watchdog_timeout", "soft_watchdog_timeout")
                                 if k in doc} or {"_seen": True}

    # -- HTTP ----------------------------------------------------------------------------------

    def _get_route(self, path: str, timeout_s: float) -> _Answer:
        """GET the endpoint by the name that answers; on a 404 of the current name (SGLang
        0.5.0-0.5.5) switch to the old one, once, and keep it for this server."""
        route = self._routes[path]
        answer = self._get(route, timeout_s)
        if answer.status_code == 404 and route == path:
            self._routes[path] = OLD_ROUTES[path]
            answer = self._get(OLD_ROUTES[path], timeout_s)
            if answer.status_code == 404:
                self._routes[path] = path  # neither exists: not an SGLang server; try again later
        return answer

    def _check_health(self, timeout_s: float) -> _Answer:
        # Older builds have no /health_generate: fall back to /health once and remember it.
        answer = self._get(self._health_path, timeout_s)
        if answer.status_code == 404 and self._health_path == "/health_generate":
            self._health_path = "/health"
            answer = self._get(self._health_path, timeout_s)
        return answer

    def _get(self, path: str, timeout_s: float) -> _Answer:
        """GET with a connect/read timeout, a wall deadline for the body, and a size cap."""
        # Imported here, not at the top: http.client brings ssl and email (6.6 MiB of RSS) into
        # every daemon, and most jobs have no server (issue 17's RSS bound).
        import http.client

        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            try:
                conn.connect()
            except ConnectionRefusedError:
                return _Answer(path, error=f"connection refused by {self.host}:{self.port}", connected=False)
            except TimeoutError:
                return _Answer(path, error=f"connect to {self.host}:{self.port} timed out after "
                               f"{timeout_s:g} s", timed_out=True, connected=False)
            except OSError as e:  # unresolvable host, no route, reset during connect
                return _Answer(path, error=f"cannot connect to {self.host}:{self.port}: {e}", connected=False)
            try:
                conn.request("GET", self._prefix + path, headers={"Connection": "close"})
                resp = conn.getresponse()
                length = resp.getheader("Content-Length")
                if length and length.isdigit() and int(length) > self.max_response_bytes:
                    return _Answer(path, resp.status, error=f"GET {path}: response of {int(length)} bytes "
                                   f"exceeds the {self.max_response_bytes} byte cap")
                body = _read_capped(resp, self.max_response_bytes, deadline)
                if body is None:
                    return _Answer(path, resp.status, error=f"GET {path}: response exceeds the "
                                   f"{self.max_response_bytes} byte cap")
                error = None if resp.status == 200 else f"GET {path}: HTTP {resp.status} {resp.reason}"
                return _Answer(path, resp.status, body, error=error)
            except TimeoutError:
                return _Answer(path, error=f"GET {path} did not answer within {timeout_s:g} s",
                               timed_out=True)
            except (http.client.HTTPException, OSError) as e:
                return _Answer(path, error=f"GET {path}: {type(e).__name__}: {e}")
        finally:
            conn.close()


def _read_capped(resp: http.client.HTTPResponse, cap: int, deadline: float) -> bytes | None:
    """The body, or None past `cap`; a server trickling bytes still stops at the deadline."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("body not complete before the deadline")
        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if value > 0 else None


def _json_field(done: _Done | None, key: str) -> str | None:
    if done is None or done.answer.body is None or done.answer.status_code != 200:
        return None
    try:
        value = json.loads(done.answer.body).get(key)
    except (ValueError, AttributeError):
        return None
    return str(value)[:200] if value is not None else None


class _MetricsState:
    """Parses scrapes and computes counter rates between consecutive good ones (scrape thread)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._prev: tuple[dict[str, float], float] | None = None
        self._obs: tuple[dict[str, Any], float] | None = None  # fields of the last MetricsObs, and when
        self._progress_changed_mono: float | None = None
        self._gauges_changed_mono: float | None = None
        self._last_gauges: dict[str, float] | None = None

    def update(self, answer: _Answer, now: float) -> None:
        if answer.body is None or answer.status_code != 200:
            with self._lock:
                self._obs = (dict(ok=False, error=answer.error or "no body"), now)
            return
        try:
            counters, gauges, families = parse_metrics(answer.body.decode("utf-8", "replace"))
        except Exception as e:  # noqa: BLE001 - the parser raises ValueError and worse on garbage
            with self._lock:
                error = f"unparseable /metrics: {type(e).__name__}: {e}"[:500]
                self._obs = (dict(ok=False, error=error), now)
            return
        with self._lock:
            fields = self._rates(counters, gauges, now)
            fields.update(ok=True, counters=counters, gauges=gauges, families=families)
            self._obs = (fields, now)

    def _rates(self, counters: dict[str, float], gauges: dict[str, float], now: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        prev = self._prev
        self._prev = (counters, now)
        if self._last_gauges != gauges:
            self._gauges_changed_mono = now
        self._last_gauges = gauges
        if prev is None:
            self._progress_changed_mono = now
            return out
        before, t0 = prev
        dt = now - t0
        rates, resets = {}, []
        for name, value in counters.items():
            if name not in before:
                continue
            if value < before[name]:
                resets.append(name)
            elif dt > 0:
                rates[name] = (value - before[name]) / dt
        moved = any(counters.get(n) != before.get(n) for n in PROGRESS_COUNTERS if n in counters)
        if moved or resets or self._progress_changed_mono is None:
            self._progress_changed_mono = now
        tracked = any(n in counters for n in PROGRESS_COUNTERS)
        out.update(
            interval_s=dt if dt > 0 else None, rates_per_s=rates, counter_resets=tuple(resets),
            progress_unchanged_for_s=now - self._progress_changed_mono if tracked else None,
            gauges_possibly_stale=tracked and not moved and any(gauges.get(g, 0) > 0 for g in WORK_GAUGES),
        )
        return out

    def observation(self) -> MetricsObs | None:
        with self._lock:
            if self._obs is None:
                return None
            fields, at = self._obs
            gauges_changed_mono = self._gauges_changed_mono
        now = self._clock.monotonic()
        extra: dict[str, Any] = dict(age_s=now - at)
        if fields.get("ok") and gauges_changed_mono is not None:
            extra["gauges_unchanged_for_s"] = at - gauges_changed_mono
        return MetricsObs(**fields, **extra)


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, float], int]:
    """Prometheus text -> (counters, gauges, family count), one number per name.

    Samples that differ only in rank labels (`tp_rank`, `pp_rank`, ...: _SAME_WORK_LABELS) are
    copies of one DP group's value, one per rank, with --enable-metrics-for-all-schedulers: the
    max of them counts once. What remains (`dp_rank`, `category`, `mode` ...) is summed, except
    the ratios (_MAX_GAUGES), of which the largest is kept. Counter samples keep their exposition
    names (`..._total`), histogram and summary `_count` and `_sum` count as counters (their rates
    are request and latency rates); `_created` timestamps are dropped. Non-finite values are
    dropped (JSON has no NaN).
    """
    counter_groups: dict[str, dict[tuple, float]] = defaultdict(dict)
    gauge_groups: dict[str, dict[tuple, float]] = defaultdict(dict)
    # Imported here, not at the top: prometheus_client's package brings its HTTP exposition
    # (http.server, urllib.request, wsgiref: +12 MiB of RSS with http.client) into every daemon,
    # and most jobs have no server (issue 17's RSS bound).
    from prometheus_client.parser import text_string_to_metric_families

    families = 0
    for fam in text_string_to_metric_families(text):
        families += 1
        for s in fam.samples:
            if (not isinstance(s.value, (int, float)) or not math.isfinite(s.value)
                    or s.name.endswith("_created")):
                continue
            if fam.type == "counter" or (fam.type in ("histogram", "summary", "gaugehistogram")
                                          and s.name.endswith(("_count", "_sum"))):
                groups = counter_groups
            elif fam.type == "gauge" or (fam.type == "unknown" and not s.name.endswith("_total")):
                groups = gauge_groups
            elif fam.type == "unknown":
                groups = counter_groups
            else:
                continue
            if s.name not in groups and len(groups) >= _MAX_METRIC_NAMES:
                continue
            group = tuple(sorted((k, v) for k, v in s.labels.items() if k not in _SAME_WORK_LABELS))
            by_group = groups[s.name]
            by_group[group] = max(by_group.get(group, s.value), s.value)
    counters = {name: float(sum(g.values())) for name, g in counter_groups.items()}
    gauges = {name: float(max(g.values()) if name in _MAX_GAUGES else sum(g.values()))
              for name, g in gauge_groups.items()}
    return counters, gauges, families
