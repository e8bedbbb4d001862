"""The event the daemon emits when an incident fires or resolves: what every alert sink sends.

One shape for all sinks, and the webhook's JSON contract (docs/contract.md): at least job, kind, state,
summary and evidence.
"""

from __future__ import annotations

from typing import Literal

from stallwatch.model import Frozen


class EvidenceLine(Frozen):
    signal: str
    detail: str


class ProgressInfo(Frozen):
    done: float | None = None
    total: float | None = None
    rate_per_s: float | None = None
    eta_s: float | None = None
    last_progress_age_s: float | None = None


class AlertEvent(Frozen):
    job: str
    kind: str  # a verdict kind: hang, io_stall, crash ...
    state: Literal["firing", "resolved"]
    summary: str
    evidence: tuple[EvidenceLine, ...] = ()
    advice: tuple[str, ...] = ()
    cause: str | None = None
    severity: str = "critical"  # info | warning | critical
    host: str = ""
    incident_id: int | None = None  # with job and kind: the de-duplication key of one incident
    episode: int = 0  # how many times this job had an incident of this kind before
    # Public keys (docs/contract.md): `*_at` here is wall-clock Unix seconds, as in every JSON key.
    started_at: float | None = None  # when the incident opened, Unix seconds
    resolved_at: float | None = None  # Unix seconds
    at: float = 0.0  # when this event was produced, Unix seconds
    progress: ProgressInfo | None = None
    actions: tuple[str, ...] = ()  # what stallwatch did: "evidence: /var/lib/...", "killed", ...
    evidence_bundle: str | None = None  # path of the evidence bundle on the host
    test: bool = False  # sent by `stallwatch alert test`
    # The last minutes before the event as sparklines (stallwatch.engine.history): progress rate, GPU
    # utilisation and memory, CPU, I/O; plain text lines, "" when nothing was recorded.
    sparklines: str = ""
    renotify: int = 0  # 0: the first alert of this state; n: the n-th reminder of a still-firing incident

    @property
    def key(self) -> tuple[str, str, int | None]:
        return (self.job, self.kind, self.incident_id)
