"""Fleet metrics: stallwatch's state as Prometheus metrics, over HTTP or as a node_exporter textfile.

The daemon hands the exporter (daemon/metrics_export.py) its *latest views* once per tick
(`MetricsExporter.update`): one `JobView` per configured job and one `DaemonView`, defined here.
A custom collector renders every scrape from those views only (`families`, here), so a job
that disappears from the list disappears from the output at once — no stale series linger,
nothing is ever `.remove()`d by hand. The exporter has its own
`CollectorRegistry` (never prometheus_client's global one), so importing stallwatch into another
program adds nothing to that program's metrics, and two exporters in one process (tests) do not
collide.

Counters (restarts, incidents, probe runs, rule errors, alert deliveries) are cumulative values the
daemon keeps (restarts and incidents come from its SQLite state, so they survive a daemon
restart); `DaemonStats` is a small thread-safe accumulator for the daemon-wide ones, tick
histogram included, that produces a `DaemonView`.

No label carries a pid (a pid changes on every restart: unbounded series). Label sets are bounded
by the configuration (job names, sinks, probes) and the hardware (GPUs).

See docs/fleet.md for the metric list, scrape configuration, alert rules and dashboards.
"""

from __future__ import annotations

import logging
import math
import platform
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stallwatch import __version__
from stallwatch.daemon.selfusage import SelfUsage
from stallwatch.probes.base import REPORT_STATUSES
from stallwatch.vocab import INCIDENT_KINDS, JOB_STATES, VERDICT_KINDS

log = logging.getLogger("stallwatch.daemon.metrics")

# The vocabulary comes from stallwatch.vocab (docs/contract.md):
# - VERDICT_KINDS: `stallwatch_job_verdict` has one series per kind per job: 1 for the current
#   kind, 0 for every other;
# - INCIDENT_KINDS: counters start at 0 for each, so that Prometheus' increase() sees the first
#   incident (a counter born at 1 hides its first increment);
# - JOB_STATES, a job's lifecycle state (`stallwatch_job_state{job,state}`): the daemon's job
#   phases, plus gave_up (a phase "stopped" whose restart budget is spent):
#   new         configured, not started yet       starting    supervised, being spawned
#   running     supervised, its process is alive  attached    started elsewhere, watched only
#   recovering  kill → wait → validate → backoff → restart in progress
#   stopped     not running and not restarted (exited, restart = "no", cannot start)
#   finished    exited with code 0                gave_up     left stopped: the budget is spent
# A probe report's statuses (probes/base.py: every finer observation status folds into one)
PROBE_STATUSES: tuple[str, ...] = tuple(s.value for s in REPORT_STATUSES)
DELIVERY_RESULTS: tuple[str, ...] = ("success", "failure")
# Tick durations: a healthy tick takes milliseconds; the default tick deadline is 30 s.
TICK_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                   30.0)


# ---------------------------------------------------------------------------------------------
# Views: what the daemon hands over each tick. Frozen; unknown numbers are None, never -1/NaN.


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _known(v: Any) -> float | None:
    """None for unknown: None, NaN, ±inf, and the negative sentinels features.py uses (-1)."""
    if v is None or isinstance(v, bool):
        return None
    v = float(v)
    if not math.isfinite(v) or v < 0:
        return None
    return v


class JobGpu(_View):
    """A GPU the job holds memory on (from NVML's process list joined with the job's pids)."""
    index: int
    uuid: str = ""
    used_bytes: int | None = None


class JobView(_View):
    name: str = Field(min_length=1)
    kind: str = "unknown"  # the current verdict kind
    state: str = "running"  # one of JOB_STATES
    done: float | None = None
    total: float | None = None
    rate_per_s: float | None = None
    eta_s: float | None = None
    last_progress_timestamp_s: float | None = None  # Unix seconds of the last progress change
    restarts: int = Field(default=0, ge=0)  # completed restarts, cumulative
    # restarts since the last run that stayed up restart_reset_after_s: what the budget counts
    restart_streak: int = Field(default=0, ge=0)
    max_restarts: int | None = Field(default=None, ge=0)  # the budget; None: restart = "no"
    incidents: dict[str, int] = Field(default_factory=dict)  # kind -> incidents so far
    gpus: tuple[JobGpu, ...] = ()
    # What keeps the job from being judged fully (daemon/watchwarn.py): rules failing tick after
    # tick, a tree past its caps; and how many of its processes the caps left unexamined.
    watch_warnings: int = Field(default=0, ge=0)
    processes_unwatched: int = Field(default=0, ge=0)

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in VERDICT_KINDS:
            raise ValueError(f"verdict kind {v!r} is not one of {', '.join(VERDICT_KINDS)}")
        return v

    @field_validator("state")
    @classmethod
    def _state(cls, v: str) -> str:
        if v not in JOB_STATES:
            raise ValueError(f"job state {v!r} is not one of {', '.join(JOB_STATES)}")
        return v

    @field_validator("incidents")
    @classmethod
    def _incidents(cls, v: dict[str, int]) -> dict[str, int]:
        for k, n in v.items():
            if k not in VERDICT_KINDS:
                raise ValueError(f"incident kind {k!r} is not one of {', '.join(VERDICT_KINDS)}")
            if n < 0:
                raise ValueError(f"incident count for {k!r} is negative")
        return v

    @field_validator("done", "total", "rate_per_s", "eta_s", "last_progress_timestamp_s",
                     mode="before")
    @classmethod
    def _num(cls, v: Any) -> float | None:
        return _known(v)

    @classmethod
    def from_snapshot(cls, name: str, snap: Any | None, *, kind: str = "unknown",
                      state: str = "running", restarts: int = 0,
                      max_restarts: int | None = None, restart_streak: int = 0,
                      incidents: Mapping[str, int] | None = None,
                      watch_warnings: int = 0) -> JobView:
        """Progress and GPU memory from the job's latest Snapshot; the rest from the daemon.

        `snap` is a stallwatch.probes.snapshot.Snapshot (or None before the first tick)."""
        done = total = rate = eta = last_ts = None
        gpus: tuple[JobGpu, ...] = ()
        unwatched = 0
        if snap is not None:
            lg = snap.log
            pr = lg.progress if lg is not None else None
            if pr is not None:
                done = pr.done
                total = pr.total or None
                rate = lg.rate_per_s if lg.rate_per_s is not None else lg.tqdm_rate_per_s
                eta = lg.eta_s
                if lg.idle_s is not None:
                    last_ts = snap.t_wall - lg.idle_s
            pids = {p.pid for p in snap.processes.processes} if snap.processes else set()
            gpus = job_gpus(snap.gpu, pids)
            pr_obs = snap.processes
            if pr_obs is not None:
                unwatched = max(0, pr_obs.tree_processes - pr_obs.watched_processes)
        return cls(name=name, kind=kind, state=state, done=done, total=total, rate_per_s=rate,
                   eta_s=eta, last_progress_timestamp_s=last_ts, restarts=restarts,
                   max_restarts=max_restarts, restart_streak=restart_streak,
                   incidents=dict(incidents or {}), gpus=gpus, watch_warnings=watch_warnings,
                   processes_unwatched=unwatched)


class GpuView(_View):
    index: int
    uuid: str = ""
    name: str = ""
    utilization_ratio: float | None = None  # 0..1 (NVML's utilisation.gpu / 100)
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    lost: bool = False  # fell off the bus / needs a reset

    @classmethod
    def from_obs(cls, obs: Any | None) -> tuple[GpuView, ...]:
        """Every device of a stallwatch.probes.gpu.GpuObs (empty without a GPU or driver)."""
        if obs is None:
            return ()
        out = []
        for d in obs.devices:
            util = d.util_gpu_pct / 100.0 if d.util_gpu_pct is not None else None
            out.append(cls(index=d.index, uuid=d.uuid or "", name=d.name or "",
                           utilization_ratio=util, memory_used_bytes=d.mem_used_bytes,
                           memory_total_bytes=d.mem_total_bytes, lost=d.lost))
        return tuple(out)


def job_gpus(obs: Any | None, pids: Iterable[int]) -> tuple[JobGpu, ...]:
    """The GPUs where any of `pids` holds memory, with the bytes summed per GPU."""
    if obs is None:
        return ()
    pids = set(pids)
    out = []
    for d in obs.devices:
        mine = [p for p in (d.processes or ()) if p.pid in pids]
        if not mine:
            continue
        known = [p.used_bytes for p in mine if p.used_bytes is not None]
        out.append(JobGpu(index=d.index, uuid=d.uuid or "", used_bytes=sum(known) if known else None))
    return tuple(out)


class HistogramView(_View):
    bounds: tuple[float, ...]  # upper bounds, ascending, without +Inf
    counts: tuple[int, ...]  # per bucket, NOT cumulative; one more than bounds (the +Inf bucket)
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


class DaemonView(_View):
    version: str = __version__
    started_wall: float | None = None  # Unix seconds
    interval_s: float | None = None  # the configured tick interval
    last_tick_wall: float | None = None  # Unix seconds of the end of the last tick
    tick_duration_s: float | None = None  # the last tick's
    tick_histogram: HistogramView | None = None
    probe_runs: dict[str, dict[str, int]] = Field(default_factory=dict)  # probe -> status -> n
    probe_duration_s: dict[str, float] = Field(default_factory=dict)  # probe -> its last duration
    rule_evaluation_errors: int = Field(default=0, ge=0)
    alert_deliveries: dict[str, dict[str, int]] = Field(default_factory=dict)  # sink -> result -> n
    gpus: tuple[GpuView, ...] = ()  # the host's GPUs (host-wide, not per job)


class DaemonStats:
    """The daemon-wide counters, accumulated as things happen; `view()` makes a DaemonView.

    Thread-safe: alert sinks deliver on their own threads.

        stats = DaemonStats(interval_s=cfg.daemon.interval_s, sinks=[a.type for a in cfg.alert])
        ... each tick:   stats.tick(duration_s, [r for s in snapshots for r in s.probes])
        ... on a rule error: stats.rule_error()
        ... after a delivery attempt: stats.delivery(sink.type, ok)
        exporter.update(job_views, stats.view(gpus=GpuView.from_obs(snap.gpu)))
    """

    def __init__(self, *, interval_s: float | None = None, sinks: Iterable[str] = (),
                 buckets: Sequence[float] = TICK_BUCKETS, version: str = __version__,
                 clock: Any = None) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.version = version
        self.interval_s = interval_s
        self.started_wall = self._now()
        self._bounds = tuple(sorted(float(b) for b in buckets))
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        self._last_tick_wall: float | None = None
        self._last_tick_s: float | None = None
        self._probe_runs: dict[str, dict[str, int]] = {}
        self._probe_dur: dict[str, float] = {}
        self._rule_errors = 0
        # Every configured sink starts at 0 for both results, for increase().
        self._deliveries: dict[str, dict[str, int]] = {
            s: {r: 0 for r in DELIVERY_RESULTS} for s in sinks}

    def _now(self) -> float:
        return self._clock.time() if self._clock is not None else time.time()

    def tick(self, duration_s: float, reports: Iterable[Any] = (), at: float | None = None) -> None:
        """One tick done: its duration and the ProbeReports of every snapshot it took."""
        with self._lock:
            d = max(0.0, float(duration_s))
            i = next((i for i, b in enumerate(self._bounds) if d <= b), len(self._bounds))
            self._counts[i] += 1
            self._sum += d
            self._last_tick_s = d
            self._last_tick_wall = at if at is not None else self._now()
        self.probes(reports)

    def probes(self, reports: Iterable[Any]) -> None:
        with self._lock:
            for r in reports:
                status = getattr(r.status, "value", r.status)
                by = self._probe_runs.setdefault(r.name, {s: 0 for s in PROBE_STATUSES})
                by[status] = by.get(status, 0) + 1
                self._probe_dur[r.name] = float(r.duration_s)

    def rule_error(self, n: int = 1) -> None:
        with self._lock:
            self._rule_errors += n

    def delivery(self, sink: str, ok: bool) -> None:
        with self._lock:
            by = self._deliveries.setdefault(sink, {r: 0 for r in DELIVERY_RESULTS})
            by["success" if ok else "failure"] += 1

    def view(self, gpus: Sequence[GpuView] = ()) -> DaemonView:
        with self._lock:
            hist = HistogramView(bounds=self._bounds, counts=tuple(self._counts), sum=self._sum)
            return DaemonView(
                version=self.version, started_wall=self.started_wall, interval_s=self.interval_s,
                last_tick_wall=self._last_tick_wall, tick_duration_s=self._last_tick_s,
                tick_histogram=hist,
                probe_runs={k: dict(v) for k, v in self._probe_runs.items()},
                probe_duration_s=dict(self._probe_dur),
                rule_evaluation_errors=self._rule_errors,
                alert_deliveries={k: dict(v) for k, v in self._deliveries.items()},
                gpus=tuple(gpus))


# ---------------------------------------------------------------------------------------------
# Rendering


GPU_LABELS = ("gpu", "uuid", "name")


def families(jobs: Sequence[JobView], daemon: DaemonView | None) -> list[Metric]:
    """Every metric family for these views: a pure function (the collector and the tests)."""
    J = ["job"]
    verdict = GaugeMetricFamily("stallwatch_job_verdict",
                                "1 for the job's current verdict kind, 0 for every other kind.",
                                labels=J + ["kind"])
    state = GaugeMetricFamily("stallwatch_job_state",
                              "1 for the job's current lifecycle state, 0 for every other state.",
                              labels=J + ["state"])
    done = GaugeMetricFamily("stallwatch_job_progress_done",
                             "Items done, from the job's progress log.", labels=J)
    total = GaugeMetricFamily("stallwatch_job_progress_total",
                              "Items in all, from the job's progress log (absent when unknown).",
                              labels=J)
    rate = GaugeMetricFamily("stallwatch_job_progress_rate_per_second",
                             "Recent progress rate, items per second.", labels=J)
    eta = GaugeMetricFamily("stallwatch_job_eta_seconds",
                            "Estimated seconds to completion.", labels=J)
    last = GaugeMetricFamily("stallwatch_job_last_progress_timestamp_seconds",
                             "Unix time of the job's last progress.", labels=J)
    restarts = CounterMetricFamily("stallwatch_job_restarts",
                                   "Restarts stallwatch completed for the job.", labels=J)
    max_restarts = GaugeMetricFamily("stallwatch_job_max_restarts",
                                     "The job's restart budget (absent when restart = \"no\").",
                                     labels=J)
    streak = GaugeMetricFamily("stallwatch_job_restart_streak",
                               "Restarts since the job's last run that stayed up "
                               "restart_reset_after_s with no incident: what max_restarts counts.",
                               labels=J)
    incidents = CounterMetricFamily("stallwatch_job_incidents",
                                    "Incidents the job had, by verdict kind.", labels=J + ["kind"])
    jgpu = GaugeMetricFamily("stallwatch_job_gpu_memory_used_bytes",
                             "GPU memory held by the job's processes, per GPU.",
                             labels=J + ["gpu", "uuid"])
    warn = GaugeMetricFamily("stallwatch_job_watch_warnings",
                             "Warnings about the watch of the job: rules failing on every tick, "
                             "a process tree too wide to watch fully (`stallwatch status` says "
                             "which).", labels=J)
    unwatched = GaugeMetricFamily("stallwatch_job_processes_unwatched",
                                  "Processes of the job's tree past its max_processes / "
                                  "max_threads caps: counted, not examined.", labels=J)
    seen: set[str] = set()
    for j in jobs:
        if j.name in seen:  # two series with one label set would make the whole scrape invalid
            continue
        seen.add(j.name)
        for k in VERDICT_KINDS:
            verdict.add_metric([j.name, k], 1.0 if k == j.kind else 0.0)
        for s in JOB_STATES:
            state.add_metric([j.name, s], 1.0 if s == j.state else 0.0)
        if j.done is not None:
            done.add_metric([j.name], j.done)
        if j.total is not None:
            total.add_metric([j.name], j.total)
        if j.rate_per_s is not None:
            rate.add_metric([j.name], j.rate_per_s)
        if j.eta_s is not None:
            eta.add_metric([j.name], j.eta_s)
        if j.last_progress_timestamp_s is not None:
            last.add_metric([j.name], j.last_progress_timestamp_s)
        restarts.add_metric([j.name], float(j.restarts))
        warn.add_metric([j.name], float(j.watch_warnings))
        unwatched.add_metric([j.name], float(j.processes_unwatched))
        if j.max_restarts is not None:
            max_restarts.add_metric([j.name], float(j.max_restarts))
            streak.add_metric([j.name], float(j.restart_streak))
        kinds = list(INCIDENT_KINDS) + [k for k in j.incidents if k not in INCIDENT_KINDS]
        for k in kinds:
            incidents.add_metric([j.name, k], float(j.incidents.get(k, 0)))
        for g in j.gpus:
            if g.used_bytes is not None:
                jgpu.add_metric([j.name, str(g.index), g.uuid], float(g.used_bytes))
    out: list[Metric] = [verdict, state, done, total, rate, eta, last, restarts, max_restarts,
                         streak, incidents, jgpu, warn, unwatched]
    if daemon is not None:
        out += _daemon_families(daemon)
    return out


def self_usage_families(u: SelfUsage | None) -> list[Metric]:
    """The daemon's own footprint (stallwatch/daemon/selfusage.py); nothing when it could not be read."""
    if u is None:
        return []
    out: list[Metric] = [
        CounterMetricFamily("stallwatch_daemon_cpu_seconds",
                            "CPU time (user + system) the daemon has used, every thread.",
                            value=u.cpu_s),
        GaugeMetricFamily("stallwatch_daemon_resident_memory_bytes",
                          "The daemon's resident set size.", value=float(u.rss_bytes)),
        GaugeMetricFamily("stallwatch_daemon_threads", "The daemon's threads.",
                          value=float(u.threads))]
    if u.open_fds is not None:
        out.append(GaugeMetricFamily("stallwatch_daemon_open_fds",
                                     "Descriptors the daemon holds open (kept /proc files included).",
                                     value=float(u.open_fds)))
    return out


def _daemon_families(d: DaemonView) -> list[Metric]:
    out: list[Metric] = []
    info = GaugeMetricFamily("stallwatch_build_info", "Always 1; the labels say which stallwatch.",
                             labels=["version", "python"])
    info.add_metric([d.version, platform.python_version()], 1.0)
    out.append(info)
    if d.started_wall is not None:
        out.append(GaugeMetricFamily("stallwatch_start_time_seconds",
                                     "Unix time the daemon started.", value=d.started_wall))
    if d.interval_s is not None:
        out.append(GaugeMetricFamily("stallwatch_tick_interval_seconds",
                                     "The configured tick interval.", value=d.interval_s))
    if d.last_tick_wall is not None:
        out.append(GaugeMetricFamily("stallwatch_last_tick_timestamp_seconds",
                                     "Unix time the last tick ended: a hung tick loop stops it.",
                                     value=d.last_tick_wall))
    if d.tick_duration_s is not None:
        out.append(GaugeMetricFamily("stallwatch_tick_last_duration_seconds",
                                     "How long the last tick took.", value=d.tick_duration_s))
    if d.tick_histogram is not None:
        h = d.tick_histogram
        buckets, acc = [], 0
        for b, n in zip(h.bounds, h.counts, strict=False):  # counts' last is the +Inf bucket, below
            acc += n
            buckets.append((_le(b), float(acc)))
        buckets.append(("+Inf", float(h.count)))
        out.append(HistogramMetricFamily("stallwatch_tick_duration_seconds",
                                         "How long ticks take (every probe, the rules, actions).",
                                         buckets=buckets, sum_value=h.sum))
    runs = CounterMetricFamily("stallwatch_probe_runs", "Probe runs by probe and status "
                               "(ok, absent, denied, error, timeout, busy).",
                               labels=["probe", "status"])
    for p, by in sorted(d.probe_runs.items()):
        for s, n in sorted(by.items()):
            runs.add_metric([p, s], float(n))
    out.append(runs)
    pdur = GaugeMetricFamily("stallwatch_probe_last_duration_seconds",
                             "How long each probe's last run took.", labels=["probe"])
    for p, secs in sorted(d.probe_duration_s.items()):
        pdur.add_metric([p], secs)
    out.append(pdur)
    out.append(CounterMetricFamily("stallwatch_rule_evaluation_errors",
                                   "Rule conditions or templates that failed to evaluate.",
                                   value=float(d.rule_evaluation_errors)))
    dl = CounterMetricFamily("stallwatch_alert_deliveries",
                             "Alert deliveries by sink type and result (success, failure).",
                             labels=["sink", "result"])
    for s, by in sorted(d.alert_deliveries.items()):
        for r, n in sorted(by.items()):
            dl.add_metric([s, r], float(n))
    out.append(dl)
    util = GaugeMetricFamily("stallwatch_gpu_utilization_ratio",
                             "GPU busy fraction over NVML's last sample period, 0 to 1.",
                             labels=list(GPU_LABELS))
    used = GaugeMetricFamily("stallwatch_gpu_memory_used_bytes", "GPU memory in use.",
                             labels=list(GPU_LABELS))
    tot = GaugeMetricFamily("stallwatch_gpu_memory_total_bytes", "GPU memory in all.",
                            labels=list(GPU_LABELS))
    lost = GaugeMetricFamily("stallwatch_gpu_lost",
                             "1 when the GPU fell off the bus or needs a reset.",
                             labels=list(GPU_LABELS))
    for g in d.gpus:
        lv = [str(g.index), g.uuid, g.name]
        if g.utilization_ratio is not None:
            util.add_metric(lv, g.utilization_ratio)
        if g.memory_used_bytes is not None:
            used.add_metric(lv, float(g.memory_used_bytes))
        if g.memory_total_bytes is not None:
            tot.add_metric(lv, float(g.memory_total_bytes))
        lost.add_metric(lv, 1.0 if g.lost else 0.0)
    out += [util, used, tot, lost]
    return out


def _le(b: float) -> str:
    return floatToGoString(b)  # as prometheus_client's own histograms spell `le`
