"""What every sink shares: the delivery errors the dispatcher's retry policy reads, the sink base
class, and the wording of an event (titles, durations, progress) so every sink says it alike."""

from __future__ import annotations

import email.utils
import math
import socket
import time
from typing import Any
from collections.abc import Mapping

from stallwatch import __version__
from stallwatch.alerts.events import AlertEvent, EvidenceLine, ProgressInfo

from .redact import redact


class DeliveryError(Exception):
    """A delivery failed. `retryable` says whether trying again may help; `retry_after` (seconds)
    is the receiver's own wish (HTTP Retry-After). Messages never hold a secret (redacted)."""

    retryable = False

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(redact(message))
        self.retry_after = retry_after


class RetryableError(DeliveryError):
    retryable = True


class PermanentError(DeliveryError):
    retryable = False


class Sink:
    """One configured destination. `deliver` sends one event or raises DeliveryError; it runs on
    the sink's own worker thread and may block up to the configured timeout."""

    type = "sink"

    def __init__(self, config: Any) -> None:
        self.config = config
        self.name: str = config.name or self.type

    def deliver(self, event: AlertEvent) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> str:
        """Where it delivers, safe to print (secrets masked)."""
        return self.type

    def close(self) -> None:
        pass


class BrokenSink(Sink):
    """A sink that could not be built (secret not readable ...): every delivery fails with why."""

    def __init__(self, config: Any, problem: str) -> None:
        super().__init__(config)
        self.type = config.type
        self.problem = redact(problem)

    def deliver(self, event: AlertEvent) -> None:
        raise PermanentError(self.problem)

    def describe(self) -> str:
        return f"{self.type} (not usable)"


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from an HTTP Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        s = float(value)
        return max(0.0, s) if math.isfinite(s) else None
    except ValueError:
        pass
    try:
        dt = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if dt is None:
        return None
    return max(0.0, dt.timestamp() - (time.time() if now is None else now))


def http_error(status: int, body: str, headers: Mapping[str, str] | None, what: str) -> DeliveryError:
    """The DeliveryError for a non-2xx answer: 408/425/429/5xx retryable, other 4xx permanent."""
    body = (body or "").strip().replace("\n", " ")
    if len(body) > 200:
        body = body[:200] + "…"
    msg = f"{what} answered HTTP {status}" + (f": {body}" if body else "")
    retry_after = None
    if headers is not None:
        for k, v in headers.items():
            if k.lower() == "retry-after":
                retry_after = parse_retry_after(v)
    if status in (408, 425, 429) or status >= 500:
        return RetryableError(msg, retry_after=retry_after)
    return PermanentError(msg)


def network_error(exc: BaseException, what: str, timeout_s: float) -> DeliveryError:
    """The DeliveryError for a failure below HTTP: timeouts and refused connections are retried."""
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, (socket.timeout, TimeoutError)) or "timed out" in str(reason):
        return RetryableError(f"{what} did not answer within {timeout_s:g} s")
    if isinstance(reason, ConnectionRefusedError):
        return RetryableError(f"{what} refused the connection")
    if isinstance(reason, socket.gaierror):
        return RetryableError(f"{what}: cannot resolve the host name ({reason.strerror or reason})")
    if isinstance(reason, OSError):
        return RetryableError(f"{what}: {type(reason).__name__}: {reason.strerror or reason}")
    return RetryableError(f"{what}: {type(reason).__name__}: {reason}")


# ------------------------------------------------------------------------------------ wording

KIND_TITLES = {
    "healthy": "Healthy", "slow": "Slow", "hang": "Hang", "io_stall": "I/O stall",
    "server_hang": "Server hang", "server_down": "Server down", "crash": "Crash",
    "gpu_fault": "GPU fault", "disk_full": "Disk full", "finished": "Finished",
    "unknown": "Unknown", "alerts_suppressed": "Alerts held back",
}
SEVERITY_ICONS = {"critical": "\U0001F534", "warning": "\U0001F7E0", "info": "\U0001F535"}
RESOLVED_ICON = "\u2705"
TEST_ICON = "\U0001F9EA"
REPEAT_ICON = "\U0001F501"


def kind_title(kind: str) -> str:
    return KIND_TITLES.get(kind, kind.replace("_", " ").capitalize())


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m {s:02d}s" if s else f"{m}m"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h {m:02d}m" if m else f"{h}h"
    d, h = divmod(h, 24)
    return f"{d}d {h}h"


def fmt_time(ts: float | None) -> str:
    if not ts:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def fmt_count(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"


def fmt_progress(p: ProgressInfo | None) -> str | None:
    """'18,380 / 37,312 (49%) · 1.02/s · ETA 4h 48m · last progress 41 s ago', or None."""
    if p is None or (p.done is None and p.last_progress_age_s is None):
        return None
    parts = []
    if p.done is not None:
        if p.total:
            parts.append(f"{fmt_count(p.done)} / {fmt_count(p.total)} ({100.0 * p.done / p.total:.0f}%)")
        else:
            parts.append(fmt_count(p.done))
    if p.rate_per_s is not None:
        parts.append(f"{p.rate_per_s:.3g}/s")
    if p.eta_s is not None:
        parts.append(f"ETA {fmt_duration(p.eta_s)}")
    if p.last_progress_age_s is not None:
        parts.append(f"last progress {fmt_duration(p.last_progress_age_s)} ago")
    return " · ".join(parts)


def incident_age(event: AlertEvent) -> float | None:
    if event.started_at is None:
        return None
    end = event.resolved_at if event.state == "resolved" and event.resolved_at else event.at
    return (end - event.started_at) if end else None


def title(event: AlertEvent) -> str:
    """'I/O stall — extract', 'Resolved: I/O stall — extract', 'Still I/O stall — extract'."""
    base = f"{kind_title(event.kind)} \u2014 {event.job}"
    if event.state == "resolved":
        base = f"Resolved: {base}"
    elif event.renotify:
        base = f"Still firing: {base}"
    if event.test:
        base = f"[TEST] {base}"
    return base


def strongest_evidence(event: AlertEvent, n: int = 3) -> list[EvidenceLine]:
    """The first n evidence lines: rules list evidence strongest first."""
    return list(event.evidence[:n])


def webhook_payload(event: AlertEvent) -> dict[str, Any]:
    """The generic webhook's JSON (docs/contract.md): the event plus stallwatch_version."""
    doc = event.model_dump(mode="json")
    doc["stallwatch_version"] = __version__
    return doc


def sample_event(host: str | None = None, now: float | None = None) -> AlertEvent:
    """A realistic io_stall event, marked test: what `stallwatch alert test` sends."""
    now = time.time() if now is None else now
    return AlertEvent(
        job="extract", kind="io_stall", state="firing", severity="critical", test=True,
        host=host or socket.gethostname(),
        summary="extract: no progress for 3m 12s; writer pid 48213 blocked in the kernel on "
                "/data (nfs 10.0.0.5:/export) — uninterruptible I/O (D)",
        evidence=(
            EvidenceLine(signal="process", detail="pid 48213 (python) thread 48240 in D for 192 s, "
                         "wchan rpc_wait_bit_killable, syscall write on /data/hs/rows_18000-20000/data_18380.ckpt"),
            EvidenceLine(signal="disk", detail="mount /data (nfs4 10.0.0.5:/export): 0 I/O "
                         "completed in 180 s, statvfs did not return within 5 s"),
            EvidenceLine(signal="log", detail="last progress line 192 s ago: 'Generating Hidden "
                         "States:  49%|████▉     | 18380/37312'"),
            EvidenceLine(signal="gpu", detail="GPU 0: 0% utilisation for 190 s, 61.2 GiB held by pid 48213"),
        ),
        advice=("Check the NFS server 10.0.0.5 and the network path to it (dmesg: 'nfs: server "
                "not responding').",
                "A process in D cannot be killed until the I/O returns: stallwatch waits before resuming."),
        incident_id=0, episode=0, started_at=now - 192.0, at=now,
        progress=ProgressInfo(done=18380, total=37312, rate_per_s=1.02, eta_s=18560.0,
                              last_progress_age_s=192.0),
        actions=("evidence: /var/lib/stallwatch/evidence/extract-0",),
        evidence_bundle="/var/lib/stallwatch/evidence/extract-0",
    )
