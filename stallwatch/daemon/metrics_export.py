"""Serving the metrics: the listen address, HTTP `/metrics` and the node_exporter textfile,
and `DaemonMetrics`, the daemon's one object for them (open, each tick, shutdown).

What the metrics are (the views and the families rendered from them) is in daemon/metrics.py;
the HTTP server itself in daemon/metrics_http.py. See docs/fleet.md.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from stallwatch.daemon.metrics import (DELIVERY_RESULTS, DaemonStats, DaemonView, GpuView, JobView,
                                       families, self_usage_families)
from stallwatch.daemon.selfusage import SelfUsage, read_self_usage
from stallwatch.vocab import JOB_STATES, VERDICT_KINDS

if TYPE_CHECKING:
    from stallwatch.engine.alerting import Evaluation, Verdict
    from stallwatch.probes.snapshot import Snapshot

log = logging.getLogger("stallwatch.daemon.metrics")

DEFAULT_PORT = 9835
TEXTFILE_NAME = "stallwatch.prom"
DEFAULT_TEXTFILE_INTERVAL_S = 10.0


class _ViewCollector(Collector):
    def __init__(self, exporter: MetricsExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterable[Metric]:
        jobs, daemon = self._exporter._views  # one tuple, swapped atomically by update()
        yield from families(jobs, daemon)
        if daemon is not None and self._exporter.self_usage is not None:
            # Read at scrape (or textfile write) time, not per tick: nothing to pay when unasked.
            yield from self_usage_families(self._exporter.self_usage())
        tf = self._exporter._textfile_errors
        if self._exporter.textfile is not None:
            yield CounterMetricFamily("stallwatch_metrics_textfile_write_errors",
                                      "Failed writes of the node_exporter textfile.",
                                      value=float(tf))

    def describe(self) -> Iterable[Metric]:
        return []  # names depend on the views; nothing to check at registration


# ---------------------------------------------------------------------------------------------
# Listen addresses


def parse_listen(listen: str) -> tuple[str, int]:
    """"host:port", "[v6]:port", ":port" or "port" → (host, port); no host means 127.0.0.1."""
    s = listen.strip()
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f'bad listen address "{listen}": expected "[v6-address]:port"')
        port_s = rest[1:]
    elif ":" in s:
        host, _, port_s = s.rpartition(":")
        if ":" in host:
            raise ValueError(f'bad listen address "{listen}": an IPv6 address needs brackets, '
                             f'as in "[::1]:{DEFAULT_PORT}"')
    else:
        host, port_s = "", s
    if not port_s.isdigit() or not 0 <= int(port_s) < 65536:
        raise ValueError(f'bad listen address "{listen}": expected "host:port" such as '
                         f'"127.0.0.1:{DEFAULT_PORT}"')
    host = host or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    return host, int(port_s)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addrs = {str(i[4][0]) for i in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_listen(listen: str, *, allow_remote: bool = False) -> tuple[str, int]:
    """parse_listen, and refuse a non-loopback address unless allowed: for the exporter, and
    for a config validator that wants the error at load time (exit 3) rather than at start."""
    host, port = parse_listen(listen)
    if not allow_remote and not is_loopback(host):
        raise ValueError(
            f'metrics_listen "{listen}" is not a loopback address: the metrics name jobs, '
            f"hosts and GPUs. Listen on 127.0.0.1 and let Prometheus reach it through a proxy "
            f"or node_exporter's textfile collector, or allow remote scrapes explicitly "
            f"(metrics_allow_remote = true).")
    return host, port


# ---------------------------------------------------------------------------------------------
# The exporter


class MetricsExporter:
    """Serves the latest views on `listen` (HTTP `/metrics`) and/or writes them to `textfile`.

    `listen`: "127.0.0.1:9835", "[::1]:9835", ":9835" (loopback) — a non-loopback address is
    refused unless `allow_remote=True`. Port 0 picks a free port; `.port` says which.
    `textfile`: a directory (node_exporter's `--collector.textfile.directory`; the file is
    `<dir>/stallwatch.prom`) or a path ending in `.prom`. Written atomically (a temporary file in
    the same directory, then rename) by a background thread, at most every `textfile_interval_s`,
    so a slow disk never slows a tick.
    """

    def __init__(self, listen: str | None = None, textfile: Path | str | None = None, *,
                 allow_remote: bool = False,
                 textfile_interval_s: float = DEFAULT_TEXTFILE_INTERVAL_S,
                 self_usage: Callable[[], SelfUsage | None] | None = read_self_usage) -> None:
        self.listen = listen
        self.self_usage = self_usage  # the daemon's own footprint, read per scrape
        self.allow_remote = allow_remote
        self._host: str | None = None
        self._port: int | None = None
        if listen is not None:
            self._host, self._port = check_listen(listen, allow_remote=allow_remote)
        self.textfile: Path | None = None
        if textfile is not None:
            p = Path(textfile)
            self.textfile = p if p.suffix == ".prom" else p / TEXTFILE_NAME
            if not self.textfile.parent.is_dir():
                raise ValueError(f"{self.textfile.parent}: no such directory for the metrics "
                                 f"textfile (node_exporter's --collector.textfile.directory)")
            _remove_stale_temps(self.textfile)
        self.textfile_interval_s = float(textfile_interval_s)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ViewCollector(self))
        self._views: tuple[tuple[JobView, ...], DaemonView | None] = ((), None)
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # textfile writer
        self._textfile_errors = 0
        self._last_error_log = -math.inf
        self._cv = threading.Condition()
        self._dirty = False
        self._last_write = -math.inf
        self._writer: threading.Thread | None = None
        self._write_lock = threading.Lock()

    # -- the daemon's side

    def update(self, jobs: Sequence[JobView], daemon: DaemonView | None) -> None:
        """The latest views (cheap: swaps a reference; the textfile is written off-thread)."""
        self._views = (tuple(jobs), daemon)
        if self.textfile is not None and not self._closed:
            with self._cv:
                self._dirty = True
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_loop,
                                                    name="stallwatch-textfile", daemon=True)
                    self._writer.start()
                self._cv.notify()

    def start(self) -> MetricsExporter:
        """Start the HTTP server (no-op without `listen`). Raises OSError if it cannot bind."""
        if self._host is None or self._port is None or self._httpd is not None:
            return self  # without `listen` (check_listen gave both from it), or started
        from prometheus_client import make_wsgi_app

        from stallwatch.daemon.metrics_http import MetricsServer

        # Not prometheus_client.start_http_server: a thread per connection, without timeouts
        # (stallwatch/daemon/metrics_http.py says why).
        self._httpd = MetricsServer(self._host, self._port, make_wsgi_app(self.registry)).start()
        self._thread = self._httpd.thread
        log.info("metrics on http://%s/metrics", self.address)
        return self

    @property
    def port(self) -> int | None:
        """The port actually bound (after start()), else the configured one."""
        if self._httpd is not None:
            return self._httpd.server_address[1]
        return self._port

    @property
    def host(self) -> str | None:
        return self._host

    @property
    def address(self) -> str | None:
        if self._host is None:
            return None
        h = f"[{self._host}]" if ":" in self._host else self._host
        return f"{h}:{self.port}"

    def render(self) -> str:
        """The exposition text of the latest views (what a scrape or the textfile gets)."""
        return generate_latest(self.registry).decode()

    def flush(self) -> None:
        """Write the textfile now, whatever the interval (close() does; tests do)."""
        if self.textfile is None:
            return
        with self._cv:
            self._dirty = False
        self._write_textfile()

    def close(self) -> None:
        """Stop the server; write the textfile a last time if it has news."""
        if self._closed:
            return
        self._closed = True
        with self._cv:
            dirty = self._dirty
            self._cv.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=5)
        if self.textfile is not None and dirty:
            self.flush()
        if self._httpd is not None:
            self._httpd.close()
            self._httpd = None

    def __enter__(self) -> MetricsExporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- textfile

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed:
                    wait = self._last_write + self.textfile_interval_s - time.monotonic()
                    if self._dirty and wait <= 0:
                        break
                    self._cv.wait(timeout=wait if self._dirty else None)
                if self._closed:
                    return
                self._dirty = False
            self._write_textfile()

    def _write_textfile(self) -> None:
        assert self.textfile is not None
        with self._write_lock:
            self._last_write = time.monotonic()
            try:
                write_atomic(self.textfile, generate_latest(self.registry))
            except OSError as e:
                self._textfile_errors += 1
                now = time.monotonic()
                if now - self._last_error_log > 60:
                    self._last_error_log = now
                    log.warning("cannot write the metrics textfile %s: %s", self.textfile, e)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file or the new one, never a part.

    The temporary file lives in the same directory (rename is atomic within a filesystem only)
    and does not end in `.prom`, so node_exporter's textfile collector never reads it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # node_exporter usually runs as another user
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _remove_stale_temps(path: Path) -> None:
    """Temporary files a killed daemon left behind (only ours, by name)."""
    try:
        for p in path.parent.glob(f".{path.name}.*.tmp"):
            try:
                p.unlink()
            except OSError:
                pass
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# The daemon's side: one object, three calls (open, each tick, shutdown)


class MetricsJobConfig(Protocol):
    """What the metrics read of a job's config (daemon/config.py's JobConfig, which imports
    the metrics: a Protocol, not an import back)."""

    @property
    def restart(self) -> str: ...

    @property
    def max_restarts(self) -> int: ...


class MetricsJob(Protocol):
    """What the metrics read of a job (daemon/job.py's JobRunner); read only."""

    @property
    def name(self) -> str: ...

    @property
    def phase(self) -> str: ...  # a stallwatch.vocab.JobPhase

    @property
    def verdict(self) -> Verdict | None: ...

    @property
    def last_snap(self) -> Snapshot | None: ...

    @property
    def last_eval(self) -> Evaluation | None: ...

    @property
    def incidents(self) -> Mapping[str, Mapping[str, Any]]: ...  # open ones by kind: {"id": …}

    @property
    def watch_warnings(self) -> Sequence[str]: ...

    @property
    def cfg(self) -> MetricsJobConfig: ...

    def restarts(self) -> int: ...

    def restart_streak(self) -> int: ...


class MetricsDB(Protocol):
    """What the metrics read of the state database (daemon/state.py's StateDB)."""

    def incidents(self, job: str, limit: int = ...) -> list[dict[str, Any]]: ...

    def job_actions(self, job: str) -> list[dict[str, Any]]: ...


class MetricsDaemon(Protocol):
    """What the metrics read of the daemon (daemon/core.py's Daemon); read only."""

    @property
    def jobs(self) -> Mapping[str, MetricsJob]: ...

    @property
    def db(self) -> MetricsDB | None: ...

    @property
    def dispatcher(self) -> Any: ...  # alerts.AlertDispatcher, or None: only its status()


class DaemonMetrics:
    """Everything `stallwatch run` needs for metrics, so its wiring stays three lines:

        self._metrics = DaemonMetrics.from_config(self.config.daemon)   # open(); None if off
        if self._metrics: self._metrics.tick(self, dur)                  # end of each tick
        if self._metrics: self._metrics.close()                          # shutdown()

    `tick` reads what MetricsDaemon, MetricsJob and MetricsDB name, nothing else. A failure here
    is logged, never raised into the tick.
    """

    def __init__(self, exporter: MetricsExporter, stats: DaemonStats) -> None:
        self.exporter = exporter
        self.stats = stats
        self._seen_snaps: dict[str, int] = {}  # job -> id() of the last snapshot counted
        self._incidents: dict[str, tuple[frozenset[int], float, dict[str, int]]] = {}
        self._gave_up: dict[str, tuple[str, int, bool]] = {}
        # job -> (db.commits, restarts, restart streak) when they were read: two queries a job
        # a tick otherwise (three statements: the job's row twice, the streak's meta row)
        self._restart_counts: dict[str, tuple[int, int, int]] = {}
        # the GPU observation last made into views, and those views: the gpu probe hands the same
        # object on while nothing changed (issue 17)
        self._gpu_obs: Any = None
        self._gpu_views: tuple[GpuView, ...] = ()
        self._failures = 0

    @classmethod
    def from_config(cls, daemon_cfg: Any) -> DaemonMetrics | None:
        """From the [daemon] table: metrics_listen, and (when the config has them)
        metrics_textfile and metrics_allow_remote. None when neither output is configured or
        the endpoint cannot be opened (logged: a watchdog without metrics still watches)."""
        listen = getattr(daemon_cfg, "metrics_listen", None)
        textfile = getattr(daemon_cfg, "metrics_textfile", None)
        if not listen and not textfile:
            return None
        try:
            exp = MetricsExporter(listen, textfile,
                                  allow_remote=bool(getattr(daemon_cfg, "metrics_allow_remote",
                                                            False))).start()
        except (OSError, ValueError) as e:
            log.error("metrics are off: %s", e)
            return None
        stats = DaemonStats(interval_s=getattr(daemon_cfg, "interval_s", None))
        return cls(exp, stats)

    @property
    def port(self) -> int | None:
        return self.exporter.port

    def tick(self, daemon: MetricsDaemon, duration_s: float) -> None:
        try:
            self._tick(daemon, duration_s)
        except Exception:
            self._failures += 1
            if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
                log.exception("metrics update failed (%d times)", self._failures)

    def close(self) -> None:
        self.exporter.close()

    # -- internals

    def _tick(self, daemon: MetricsDaemon, duration_s: float) -> None:
        runners = list(daemon.jobs.values())
        db = daemon.db
        reports: list[Any] = []
        rule_errors = 0
        gpu_obs = None
        views: list[JobView] = []
        for r in runners:
            snap = r.last_snap
            if snap is not None and self._seen_snaps.get(r.name) != id(snap):
                self._seen_snaps[r.name] = id(snap)  # count each snapshot's probes once
                reports.extend(snap.probes)
                rule_errors += len(r.last_eval.errors) if r.last_eval is not None else 0
            if snap is not None and gpu_obs is None and snap.gpu is not None:
                gpu_obs = snap.gpu
            views.append(self._job_view(r, snap, db))
        if len(self._seen_snaps) > len(runners):  # a job removed by a reload
            names = {r.name for r in runners}
            self._seen_snaps = {k: v for k, v in self._seen_snaps.items() if k in names}
        self.stats.tick(duration_s, reports)
        if rule_errors:
            self.stats.rule_error(rule_errors)
        disp = daemon.dispatcher
        deliveries = deliveries_from_status(disp.status()) if disp is not None else {}
        if gpu_obs is not self._gpu_obs:
            self._gpu_obs, self._gpu_views = gpu_obs, GpuView.from_obs(gpu_obs)
        view = self.stats.view(gpus=self._gpu_views)
        if deliveries:
            view = view.model_copy(update={"alert_deliveries": deliveries})
        self.exporter.update(views, view)

    def _job_view(self, r: MetricsJob, snap: Snapshot | None, db: MetricsDB | None) -> JobView:
        kind = r.verdict.kind if r.verdict is not None else "unknown"
        if kind not in VERDICT_KINDS:
            kind = "unknown"
        phase = r.phase
        restarts, streak = self._restarts(r, db)
        state = phase if phase in JOB_STATES else "stopped"
        if phase == "stopped" and self._is_gave_up(r.name, phase, restarts, db):
            state = "gave_up"
        max_r = r.cfg.max_restarts if r.cfg.restart != "no" else None
        return JobView.from_snapshot(r.name, snap, kind=kind, state=state, restarts=restarts,
                                     max_restarts=max_r, restart_streak=streak,
                                     incidents=self._incident_counts(r, db),
                                     watch_warnings=len(r.watch_warnings))

    def _restarts(self, r: MetricsJob, db: MetricsDB | None) -> tuple[int, int]:
        """The job's (restarts, restart streak), read again only when the state database
        committed a transaction since (StateDB.commits): never, on a quiet tick."""
        commits = getattr(db, "commits", None)
        cached = self._restart_counts.get(r.name)
        if commits is not None and cached is not None and cached[0] == commits:
            return cached[1], cached[2]
        restarts, streak = int(r.restarts()), int(r.restart_streak())
        if commits is not None:
            self._restart_counts[r.name] = (commits, restarts, streak)
        return restarts, streak

    def _incident_counts(self, r: MetricsJob, db: MetricsDB | None) -> dict[str, int]:
        """By kind, from the state database; re-read when a new incident opens (every new one
        is open first) and at least every minute."""
        if db is None:
            return {}
        open_ids = frozenset(int(inc["id"]) for inc in r.incidents.values() if "id" in inc)
        now = time.monotonic()
        cached = self._incidents.get(r.name)
        if cached is not None and open_ids <= cached[0] and now - cached[1] < 60:
            return cached[2]
        counts: dict[str, int] = {}
        for row in db.incidents(r.name, limit=1 << 30):
            k = row.get("kind")
            if k in VERDICT_KINDS:
                counts[k] = counts.get(k, 0) + 1
        seen = frozenset(open_ids | (cached[0] if cached else frozenset()))
        self._incidents[r.name] = (seen, now, counts)
        return counts

    def _is_gave_up(self, name: str, phase: str, restarts: int, db: MetricsDB | None) -> bool:
        """Stopped because the recovery gave up: its last start/restart/give_up action is a
        give_up (the daemon records that phase as "stopped")."""
        cached = self._gave_up.get(name)
        if cached is not None and cached[:2] == (phase, restarts):
            return cached[2]
        result = False
        if db is not None:
            for a in reversed(db.job_actions(name)):
                if a.get("what") in ("give_up", "start", "restart"):
                    result = a["what"] == "give_up"
                    break
        self._gave_up[name] = (phase, restarts, result)
        return result


def deliveries_from_status(status: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Alert deliveries by sink type, from AlertDispatcher.status() (cumulative per sink)."""
    out: dict[str, dict[str, int]] = {}
    for s in status.get("sinks", ()) or ():
        by = out.setdefault(str(s.get("type") or s.get("name") or "sink"),
                            {r: 0 for r in DELIVERY_RESULTS})
        by["success"] += int(s.get("sent") or 0)
        by["failure"] += int(s.get("failed") or 0)
    return out
