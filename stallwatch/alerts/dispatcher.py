"""The alert policy: which events go to which sink, when, how often, and what happens on failure.

    d = AlertDispatcher(parse_alerts(tables, file), clock=clock, state_dir=state_dir)
    d.submit(event)      # on every incident transition; never blocks, never raises
    d.status()           # per sink: sent, failed, retrying, dropped, last_error ...
    d.close(timeout_s)   # drain the queues with a deadline

- **Once per incident and state.** The key is (job, kind, incident_id — or episode when the
  daemon gives no id). A firing event for a key already firing, or a resolved one for a key
  already resolved, is a duplicate: dropped (counted), though a duplicate firing event refreshes
  what later reminders say. So the daemon may submit the current firing event on every tick.
- **Re-notification is the dispatcher's job.** A sink with `renotify_every_s` gets the firing
  event again (`renotify` = 1, 2, ...) while its incident is not resolved; a ticker thread
  checks once a second (`tick()` does it on demand, with the injected clock).
- **Filters** per sink: `min_severity`, `kinds`, `send_resolved`. A resolved event goes where
  its firing event went. Test events (`test: true`) bypass filters, de-duplication and limits.
- **Rate limit** per sink: a token bucket of `rate_limit_per_min` (burst as large). Events over
  the limit are counted (`rate_limited`) and, once a token is back, summarised in one
  `alerts_suppressed` event naming them; none disappears silently.
- **Delivery** runs on one worker thread per sink, from a bounded queue: a slow or failing Slack
  never delays the webhook, and `submit` only appends to queues. Retries with exponential
  backoff (`retry_initial_s` doubling up to `retry_max_s`, ±10 % jitter) on 429 (Retry-After
  honoured), 5xx, timeouts and connection errors, at most `max_attempts` tries and
  `give_up_after_s`; other errors fail at once. Backoff waits use real time, not the clock.
- **Secrets**: every error text in status and logs passes the redactor.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import socket
import threading
import time
from typing import Any
from collections.abc import Iterable

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.alerts.events import AlertEvent, EvidenceLine

from .base import BrokenSink, DeliveryError, RetryableError, Sink, fmt_time
from .config import CommandConfig, DesktopConfig, SecretSourceError, SlackConfig, WebhookConfig
from .redact import describe_error, get_logger, redact

log = get_logger("stallwatch.alerts")

_STOP = object()
_STATE_MEMORY = 10_000  # incident keys remembered for de-duplication
_SUPPRESSED_LISTED = 10


def build_sink(config: Any, state_dir: str | None = None) -> Sink:
    """The sink for one config; a BrokenSink saying why when it cannot be built (no secret ...)."""
    try:
        if isinstance(config, SlackConfig):
            from .slack import SlackSink
            return SlackSink(config)
        if isinstance(config, WebhookConfig):
            from .webhook import WebhookSink
            return WebhookSink(config)
        if isinstance(config, DesktopConfig):
            from .desktop import DesktopSink
            return DesktopSink(config, state_dir=state_dir)
        if isinstance(config, CommandConfig):
            from .command import CommandSink
            return CommandSink(config)
    except Exception as e:  # noqa: BLE001 - any failure becomes a visible, failing sink
        problem = str(e) if isinstance(e, (DeliveryError, SecretSourceError)) else describe_error(e)
        log.error("alert sink %s cannot be used: %s", config.name or config.type, redact(problem))
        return BrokenSink(config, problem)
    raise TypeError(f"not an alert config: {type(config).__name__}")


def incident_key(event: AlertEvent) -> tuple[str, str, Any]:
    ident = event.incident_id if event.incident_id is not None else ("episode", event.episode)
    return (event.job, event.kind, ident)


class _Bucket:
    """Token bucket: `rate` tokens a minute, at most `rate` held."""

    def __init__(self, per_min: float, now: float) -> None:
        self.capacity = max(1.0, per_min)
        self.per_s = per_min / 60.0
        self.tokens = self.capacity
        self.t = now

    def _refill(self, now: float) -> None:
        if now > self.t:
            self.tokens = min(self.capacity, self.tokens + (now - self.t) * self.per_s)
        self.t = max(self.t, now)

    def take(self, now: float) -> bool:
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclasses.dataclass
class _Open:
    event: AlertEvent
    last_sent: float  # clock.monotonic()
    count: int = 0


@dataclasses.dataclass
class SinkStats:
    sent: int = 0
    failed: int = 0
    retrying: int = 0  # events waiting now for their next try
    retries: int = 0  # tries after the first, in all
    dropped: int = 0  # queue full, or not delivered before close()
    rate_limited: int = 0
    filtered: int = 0
    last_error: str | None = None
    last_error_wall: float | None = None
    last_success_wall: float | None = None
    consecutive_failures: int = 0


class _Runner:
    """One sink: its queue, worker thread, bucket, open incidents and counters."""

    def __init__(self, dispatcher: AlertDispatcher, sink: Sink) -> None:
        self.d = dispatcher
        self.sink = sink
        self.cfg = sink.config
        self.name = sink.name
        self.stats = SinkStats()
        self.queue: collections.deque[Any] = collections.deque()
        self.cond = threading.Condition(dispatcher._lock)
        self.pending = 0  # queued + being delivered
        self.bucket = _Bucket(self.cfg.rate_limit_per_min, dispatcher.clock.monotonic())
        self.open: dict[tuple, _Open] = {}
        self.suppressed: list[str] = []
        self.suppressed_n = 0
        self.suppressed_since: float | None = None
        self.thread = threading.Thread(target=self._work, name=f"stallwatch-alert-{self.name}",
                                       daemon=True)

    # ---- routing (called with the dispatcher's lock held)

    def route(self, event: AlertEvent, key: tuple, now: float) -> None:
        cfg = self.cfg
        if event.test:
            self._enqueue(event)
            return
        if event.state == "firing":
            if not cfg.wants(event.severity, event.kind):
                self.stats.filtered += 1
                return
            self.open[key] = _Open(event, now)
            self._offer(event, now)
            return
        was_open = self.open.pop(key, None)
        if not cfg.send_resolved:
            return
        if was_open is None and not cfg.wants(event.severity, event.kind):
            self.stats.filtered += 1
            return
        self._offer(event, now)

    def refresh(self, event: AlertEvent, key: tuple) -> None:
        o = self.open.get(key)
        if o is not None:
            o.event = event

    def _offer(self, event: AlertEvent, now: float) -> None:
        if self.bucket.take(now):
            self._enqueue(event)
            return
        self.stats.rate_limited += 1
        if self.suppressed_n == 0:
            self.suppressed_since = self.d.clock.time()
            log.warning("alert sink %s: over its rate limit (%g/min); holding back alerts and "
                        "sending a summary later", self.name, self.cfg.rate_limit_per_min)
        self.suppressed_n += 1
        if len(self.suppressed) < _SUPPRESSED_LISTED:
            when = fmt_time(event.at or self.d.clock.time())[11:]
            extra = f" (reminder {event.renotify})" if event.renotify else ""
            self.suppressed.append(f"{event.job} {event.kind} {event.state}{extra} at {when}")

    def tick(self, now: float) -> None:
        every = self.cfg.renotify_every_s
        if every:
            for o in self.open.values():
                if now - o.last_sent >= every:
                    o.count += 1
                    o.last_sent = now
                    ev = o.event.model_copy(update={"renotify": o.count, "at": self.d.clock.time()})
                    self._offer(ev, now)
        if self.suppressed_n and self.bucket.take(now):
            self._enqueue(self._summary())

    def _summary(self) -> AlertEvent:
        n = self.suppressed_n
        listed = [EvidenceLine(signal="held back", detail=s) for s in self.suppressed]
        if n > len(listed):
            listed.append(EvidenceLine(signal="held back", detail=f"…and {n - len(listed)} more"))
        ev = AlertEvent(
            job="stallwatch", kind="alerts_suppressed", state="firing", severity="warning",
            host=self.d.host, at=self.d.clock.time(), started_at=self.suppressed_since,
            summary=(f"{n} alert{'s' if n != 1 else ''} to {self.name} held back by its rate "
                     f"limit ({self.cfg.rate_limit_per_min:g}/min) since "
                     f"{fmt_time(self.suppressed_since)}; `stallwatch status` shows the jobs' "
                     f"current state"),
            evidence=tuple(listed),
            advice=("Raise rate_limit_per_min of this [[alert]], or look for a flapping job.",),
        )
        self.suppressed, self.suppressed_n, self.suppressed_since = [], 0, None
        return ev

    def _enqueue(self, event: AlertEvent) -> None:
        if len(self.queue) >= self.cfg.queue_size:
            self.stats.dropped += 1
            self.stats.last_error = f"queue full ({self.cfg.queue_size} events): event dropped"
            self.stats.last_error_wall = self.d.clock.time()
            log.error("alert sink %s: queue full (%d); dropped %s %s %s", self.name,
                      self.cfg.queue_size, event.job, event.kind, event.state)
            return
        self.queue.append(event)
        self.pending += 1
        self.cond.notify_all()

    # ---- delivery (the worker thread)

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                item = self.queue.popleft()
            if item is _STOP:
                return
            try:
                self._deliver(item)
            except BaseException as e:  # noqa: BLE001 - a worker never dies silently
                log.error("alert sink %s: internal error: %s", self.name, describe_error(e))
            finally:
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()

    def _fail(self, event: AlertEvent, why: str, attempts: int, *, dropped: bool = False) -> None:
        with self.cond:
            if dropped:
                self.stats.dropped += 1
            else:
                self.stats.failed += 1
            self.stats.last_error = why
            self.stats.last_error_wall = self.d.clock.time()
            self.stats.consecutive_failures += 1
            self.cond.notify_all()
        log.error("alert to %s failed (%s %s %s, %d attempt%s): %s", self.name, event.job,
                  event.kind, event.state, attempts, "" if attempts == 1 else "s", why)

    def _deliver(self, event: AlertEvent) -> None:
        cfg = self.cfg
        d = self.d
        if d._past_deadline():
            self._fail(event, "not delivered before shutdown", 0, dropped=True)
            return
        t0 = time.monotonic()
        attempt = 0
        in_retry = False
        try:
            while True:
                attempt += 1
                try:
                    self.sink.deliver(event)
                except DeliveryError as e:
                    err: DeliveryError = e
                except Exception as e:
                    log.debug("alert sink %s raised", self.name, exc_info=True)
                    err = RetryableError(f"{self.sink.type}: unexpected {describe_error(e)}")
                else:
                    with self.cond:
                        self.stats.sent += 1
                        self.stats.last_success_wall = d.clock.time()
                        self.stats.consecutive_failures = 0
                        self.cond.notify_all()
                    log.info("alert sent to %s: %s %s %s%s", self.name, event.job, event.kind,
                             event.state, " (test)" if event.test else "")
                    return
                why = redact(str(err))
                if not err.retryable:
                    self._fail(event, why, attempt)
                    return
                if attempt >= cfg.max_attempts:
                    self._fail(event, f"{why} (gave up after {attempt} attempts)", attempt)
                    return
                if err.retry_after is not None:
                    delay = err.retry_after
                else:
                    delay = min(cfg.retry_max_s, cfg.retry_initial_s * 2 ** (attempt - 1))
                    delay *= random.uniform(0.9, 1.1)
                elapsed = time.monotonic() - t0
                if elapsed + delay > cfg.give_up_after_s:
                    self._fail(event, f"{why} (gave up: next try in {delay:.0f} s would pass "
                               f"give_up_after_s={cfg.give_up_after_s:g})", attempt)
                    return
                with self.cond:
                    self.stats.retries += 1
                    self.stats.last_error = why
                    self.stats.last_error_wall = d.clock.time()
                    if not in_retry:
                        self.stats.retrying += 1
                        in_retry = True
                    self.cond.notify_all()
                log.warning("alert to %s failed (attempt %d of %d): %s; retrying in %.1f s",
                            self.name, attempt, cfg.max_attempts, why, delay)
                if not d._sleep(delay):
                    self._fail(event, f"{why} (not delivered before shutdown)", attempt, dropped=True)
                    return
        finally:
            if in_retry:
                with self.cond:
                    self.stats.retrying -= 1

    def status(self) -> dict[str, Any]:
        s = self.stats
        broken = isinstance(self.sink, BrokenSink)
        return {
            "name": self.name,
            "type": self.cfg.type,
            "target": redact(self.sink.describe()),
            "ok": not broken and s.consecutive_failures == 0 and s.retrying == 0,
            "sent": s.sent,
            "failed": s.failed,
            "retrying": s.retrying,
            "retries": s.retries,
            "dropped": s.dropped,
            "rate_limited": s.rate_limited,
            "filtered": s.filtered,
            "queued": sum(1 for x in self.queue if x is not _STOP),
            "open_incidents": len(self.open),
            "last_error": redact(s.last_error) if s.last_error else None,
            "last_error_at": s.last_error_wall,
            "last_success_at": s.last_success_wall,
        }


class AlertDispatcher:
    """Routes AlertEvents to the configured sinks; see the module docstring for the policy."""

    def __init__(self, configs: Iterable[Any], clock: Clock = SYSTEM_CLOCK, *,
                 state_dir: str | None = None, host: str | None = None,
                 tick_interval_s: float | None = 1.0, sinks: Iterable[Sink] | None = None) -> None:
        self.clock = clock
        self.host = host or socket.gethostname()
        self._lock = threading.RLock()
        self._states: collections.OrderedDict[tuple, str] = collections.OrderedDict()
        self.duplicates = 0
        self._closed = False
        self._closing = threading.Event()
        self._deadline: float | None = None
        built = list(sinks) if sinks is not None else [build_sink(c, state_dir) for c in configs]
        self._runners = [_Runner(self, s) for s in built]
        for r in self._runners:
            r.thread.start()
        self._ticker: threading.Thread | None = None
        if tick_interval_s and self._runners:  # reminders and rate-limit summaries
            self._tick_interval = tick_interval_s
            self._ticker = threading.Thread(target=self._tick_loop, name="stallwatch-alert-ticker",
                                            daemon=True)
            self._ticker.start()

    # ---- the caller's side

    @property
    def sink_names(self) -> list[str]:
        return [r.name for r in self._runners]

    def submit(self, event: AlertEvent) -> None:
        """Queue one event for every sink that wants it. Returns at once; never raises."""
        try:
            self._submit(event)
        except Exception as e:  # noqa: BLE001 - the watchdog's tick must go on
            log.error("alert dispatcher: cannot route an event: %s", describe_error(e))

    def _submit(self, event: AlertEvent) -> None:
        fill: dict[str, Any] = {}
        if not event.host:
            fill["host"] = self.host
        if not event.at:
            fill["at"] = self.clock.time()
        if fill:
            event = event.model_copy(update=fill)
        with self._lock:
            if self._closed:
                log.warning("alert dispatcher is closed; not sending %s %s %s", event.job,
                            event.kind, event.state)
                return
            now = self.clock.monotonic()
            key = incident_key(event)
            if not event.test:
                if self._states.get(key) == event.state:
                    self.duplicates += 1
                    if event.state == "firing":
                        for r in self._runners:
                            r.refresh(event, key)
                    return
                self._remember(key, event.state)
            for r in self._runners:
                r.route(event, key, now)
            for r in self._runners:
                r.tick(now)

    def _remember(self, key: tuple, state: str) -> None:
        self._states[key] = state
        self._states.move_to_end(key)
        while len(self._states) > _STATE_MEMORY:
            for k, st in self._states.items():  # forget the oldest resolved first
                if st == "resolved":
                    del self._states[k]
                    break
            else:
                self._states.popitem(last=False)

    def tick(self) -> None:
        """Send due reminders and rate-limit summaries (the ticker thread calls this each second)."""
        with self._lock:
            if self._closed:
                return
            now = self.clock.monotonic()
            for r in self._runners:
                r.tick(now)

    def _tick_loop(self) -> None:
        while not self._closing.wait(self._tick_interval):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - logged; the dispatcher's loop must go on
                log.error("alert dispatcher: tick failed: %s", describe_error(e))

    def status(self) -> dict[str, Any]:
        """{"sinks": [{name, type, target, ok, sent, failed, retrying, dropped, last_error ...}],
        "duplicates", "closed"}: JSON-ready, secrets redacted."""
        with self._lock:
            return {"sinks": [r.status() for r in self._runners], "duplicates": self.duplicates,
                    "closed": self._closed}

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queue is empty and no delivery is in progress; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            for r in self._runners:
                while r.pending > 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    r.cond.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop taking events, deliver what is queued until the deadline, stop the workers.

        Events still queued at the deadline are counted as dropped. True when all was delivered.
        """
        with self._lock:
            if self._closed:
                return all(not r.thread.is_alive() for r in self._runners)
            self._closed = True
            self._deadline = time.monotonic() + timeout_s
            for r in self._runners:
                r.queue.append(_STOP)
                r.cond.notify_all()
        self._closing.set()  # cuts backoff waits short: each re-checks the deadline
        ok = True
        for r in self._runners:
            r.thread.join(max(0.0, self._deadline - time.monotonic()))
            if r.thread.is_alive():
                ok = False
        with self._lock:
            for r in self._runners:
                left = sum(1 for x in r.queue if x is not _STOP)
                if left:
                    r.stats.dropped += left
                    r.stats.last_error = f"{left} event(s) not delivered before shutdown"
                    r.stats.last_error_wall = self.clock.time()
                    log.error("alert sink %s: %d event(s) not delivered before shutdown", r.name, left)
                    r.queue.clear()
                    r.queue.append(_STOP)
                    r.pending -= left
                    ok = False
        if self._ticker is not None:
            self._ticker.join(1.0)
        for r in self._runners:
            try:
                r.sink.close()
            except Exception:  # noqa: BLE001 - closing: a sink that fails to close changes nothing now
                pass
        return ok

    def __enter__(self) -> AlertDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- for the workers

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _sleep(self, delay: float) -> bool:
        """Wait `delay` real seconds before a retry; False when shutdown's deadline comes first."""
        end = time.monotonic() + delay
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return True
            if self._closing.wait(left):
                # closing: keep waiting only if the retry still fits before the deadline
                if self._deadline is None or end > self._deadline:
                    return False
                time.sleep(max(0.0, end - time.monotonic()))  # fits: the rest of the backoff
                return True
