"""The daemon's loop: ticks on a schedule, wakes on signals, never sleeps in place of an event.

Waiting is one select() on a self-pipe. signal.set_wakeup_fd makes the kernel-level handler
write the signal number into it, so SIGHUP (reload), SIGTERM/SIGINT (stop) and SIGCHLD (a
wrapper exited: reap it now) wake the loop at once; the Python-level handlers only set flags.
request_stop()/request_reload() write the same pipe from another thread (tests run the daemon
in a thread, where signals cannot be installed). The select timeout is the time to the next tick.

Per tick: every job ticks (stallwatch.daemon.job), then meta rows (last tick, its duration,
alert sink health) are written, then sd_notify: READY=1 after the first tick, WATCHDOG=1 after
each tick that finished within `tick_deadline_s`, STATUS= a one-line summary.

Stopping leaves every job running: they are in their own sessions (or transient units), and the
next daemon re-attaches to them from the state database. A lock (flock on state_dir/daemon.lock,
released by the kernel when the process dies, even by SIGKILL) keeps two daemons off one state
directory.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.daemon.config import Config, JobConfig, load_config
from stallwatch.daemon.job import JobRunner
from stallwatch.daemon.options import Actions, JobOptions
from stallwatch.errors import UsageError
from stallwatch.kernel.proc import boot_id
from stallwatch.kernel.roots import Absent, Denied
from stallwatch.daemon.sdnotify import Notifier
from stallwatch.daemon.alertmemory import PRUNE_EVERY_S, prune_removed
from stallwatch.daemon.gcpolicy import settle_after_start
from stallwatch.daemon.state import StateDB

log = logging.getLogger("stallwatch.daemon")

__all__ = ["Daemon", "run_daemon"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _boot_id() -> str:
    try:
        return boot_id()
    except (Absent, Denied, OSError):
        return ""


def _rules_key(paths: tuple[Path, ...]) -> str:
    """Content hash of a job's rule files: a reload that changes nothing keeps alert state."""
    if not paths:
        return "builtin"
    h = hashlib.sha256()
    for p in paths:
        files = sorted(Path(p).glob("*.toml")) if Path(p).is_dir() else [Path(p)]
        for f in files:
            h.update(str(f).encode())
            try:
                h.update(f.read_bytes())
            except OSError:
                h.update(b"?")
    return h.hexdigest()


class Daemon:
    def __init__(self, config: Config, *, clock: Clock = SYSTEM_CLOCK,
                 actions: Actions | None = None, notifier: Notifier | None = None,
                 gpu: bool = True, install_signals: bool | None = None) -> None:
        self.config = config
        self.config_path = config.path
        self.clock = clock
        self.actions = actions or Actions()
        self.notifier = notifier or Notifier()
        self.gpu_enabled = gpu
        self.install_signals = install_signals
        self.host = socket.gethostname()
        self.boot_id = _boot_id()
        self.state_dir = config.state_dir
        self._db: StateDB | None = None  # open between open() and close(): read it as self.db
        self.jobs: dict[str, JobRunner] = {}
        self.dispatcher: Any = None
        self._rules_cache: dict[str, Any] = {}
        self._rules_keys: dict[str, str] = {}
        self._r, self._w = os.pipe()
        for fd in (self._r, self._w):
            os.set_blocking(fd, False)
        self._stop = False
        self._reload = False
        self._chld = False
        self._lock_fd: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup: int | None = None
        self.ticks = 0
        self.tick_errors = 0
        self._alerts_doc: Any = None  # the `alerts` meta row as last written, before its dump
        self.started = threading.Event()  # set after the first tick (tests wait on it)
        self._metrics: Any = None
        self._job_errors: dict[str, tuple[str, float, int]] = {}  # job -> (error, logged at, n)
        self._write_back_mono = 0.0
        self._pruned_mono: float | None = None  # when saved alert state was last pruned
        self._tick_dur = 0.0  # the last tick's duration (s), for what follows its write
        self._tick_end_mono = 0.0  # when the last tick's jobs were done (the clock's monotonic)

    # ------------------------------------------------------------------------------- control

    def request_stop(self) -> None:
        self._stop = True
        self._wake()

    def request_reload(self) -> None:
        self._reload = True
        self._wake()

    def next_interval(self, interval: float) -> float:
        """Seconds to the next tick (the foreground daemon ticks faster until its first
        verdict: the person at the terminal is waiting for it)."""
        return interval

    def before_jobs(self) -> None:
        """Called once the state database is open and locked, before the jobs are taken over."""

    def on_wake(self) -> None:
        """Called each time the loop wakes, before anything else (the foreground daemon passes
        Ctrl-C on to its job here)."""

    def _wake(self) -> None:
        try:
            os.write(self._w, b"\0")
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EBADF):
                raise

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # Only flags here: the byte set_wakeup_fd wrote has already woken the select().
        if signum == signal.SIGHUP:
            self._reload = True
        elif signum in _STOP_SIGNALS:
            self._stop = True
        elif signum == signal.SIGCHLD:
            self._chld = True

    def _install(self) -> None:
        want = self.install_signals
        if want is None:
            want = threading.current_thread() is threading.main_thread()
        if not want:
            return
        self._old_wakeup = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            self._old_handlers[s] = signal.signal(s, self._on_signal)

    def _uninstall(self) -> None:
        for s, h in self._old_handlers.items():
            try:
                signal.signal(s, h)
            except (ValueError, TypeError):
                pass
        self._old_handlers.clear()
        if self._old_wakeup is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            self._old_wakeup = None

    # -------------------------------------------------------------------------------- set-up

    def _lock(self) -> None:
        path = self.state_dir / "daemon.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError(f"another stallwatch daemon (pid {other}) already uses state_dir "
                             f"{self.state_dir}") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as e:  # a full disk: the lock holds all the same, only its note is lost
            log.warning("cannot write the pid into %s: %s", path, e.strerror or e)
        self._lock_fd = fd

    def rules_for(self, job: JobConfig, config: Config | None = None):
        from stallwatch.engine import diagnose

        paths = (config or self.config).rules_for(job)
        key = _rules_key(tuple(paths))
        if key not in self._rules_cache:
            self._rules_cache[key] = diagnose.load([str(p) for p in paths] or None)
        return self._rules_cache[key], key

    @property
    def db(self) -> StateDB:
        """The state database; open between open() and close()."""
        if self._db is None:
            raise RuntimeError("the daemon's state database is not open")
        return self._db

    def open(self) -> None:
        # A short busy timeout: only another process holding the write lock makes it wait (the
        # daemon lock keeps other daemons out, readers never block in WAL), and a tick must not
        # wait on it; the state goes to memory instead (StateDB.degraded).
        db = StateDB.open(self.state_dir, clock=self.clock, busy_timeout_s=2.0)
        try:
            self._lock()
        except BaseException:
            db.close()
            raise
        self._db = db
        rules = {j.name: self.rules_for(j) for j in self.config.job}  # all, before acting
        with self.db.tx():
            self.db.set_meta("daemon_pid", str(os.getpid()))
            self.db.set_meta("daemon_started_at", str(self.clock.time()))
            self.db.set_meta("daemon_stopped_at", None)
            self.db.set_meta("config_path", str(self.config_path or ""))
            self.db.set_meta("boot_id", self.boot_id)
            self.db.set_meta("host", self.host)
        self.dispatcher = self._make_dispatcher(self.config)
        self.before_jobs()
        for job in self.config.job:
            rs, key = rules[job.name]
            runner = JobRunner(self._job_options(), job, rs)
            self._rules_keys[job.name] = key
            self.jobs[job.name] = runner
            runner.start()
        self._start_metrics()

    # ---------------------------------------------------------------------------------- loop

    def run(self) -> int:
        try:
            self.open()
            self._install()
            settle_after_start()
            interval = self.config.daemon.interval_s
            next_tick = self.clock.monotonic()
            while not self._stop:
                timeout = max(0.0, next_tick - self.clock.monotonic())
                try:
                    ready, _, _ = select.select([self._r], [], [], timeout)
                except InterruptedError:
                    ready = []
                if ready:
                    try:
                        while os.read(self._r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self.on_wake()
                if self._stop:
                    break
                if self._chld:
                    self._chld = False
                    for r in self.jobs.values():
                        r.reap()
                if self._reload:
                    self._reload = False
                    self.reload()
                    interval = self.config.daemon.interval_s
                now = self.clock.monotonic()
                if now >= next_tick:
                    self.tick()
                    next_tick += self.next_interval(interval)
                    if next_tick <= self.clock.monotonic():
                        next_tick = self.clock.monotonic() + interval  # late: skip, don't burst
            return 0
        finally:
            self.shutdown()

    def tick(self) -> None:
        # Every row the tick rewrites each time (job verdicts, alert memory, history, the meta
        # rows below) goes out in one transaction at its end (StateDB.held): at 1 s, each
        # transaction is cold memory. Intents, incidents and phases are still written at once.
        db = self._db
        if db is None:
            self._tick()
        else:
            with db.held():
                self._tick()
            try:
                db.flush()
            except Exception as e:  # noqa: BLE001 - the held rows are a report: a failed write is logged, they stay held for the next transaction, the tick goes on
                self._tick_failed("(the tick's rows)", e)
        try:
            self._prune_alert_state()
        except Exception as e:  # noqa: BLE001 - old rows left for the next look, the watch goes on
            self._tick_failed("(pruning removed jobs' saved alert state)", e)
        self._after_tick()

    def _tick(self) -> None:
        # One clock read a job: a job's tick starts when the one before it ended (issue 17).
        monotonic, process_time = self.clock.monotonic, time.process_time
        limit = self.config.daemon.job_tick_deadline_s
        t0 = t = monotonic()
        for runner in self._due_jobs(t0):
            cpu_job = process_time()
            try:
                runner.tick()
            except Exception as e:  # noqa: BLE001 - one job's bug must not stop the others' watch
                self.tick_errors += 1
                self._tick_failed(runner.name, e)
            else:
                if self._job_errors:
                    self._job_errors.pop(runner.name, None)
            end = monotonic()
            # The CPU it spent is read only for a tick over its deadline, the one _spaced looks
            # at it for: the process's CPU clock is a syscall, no vDSO read (issue 17).
            self._spaced(runner, t, end, process_time() - cpu_job if end - t > limit else None)
            t = end
        if self._db is not None and self._db.degraded and t - self._write_back_mono >= 10.0:
            self._write_back_mono = t
            self.db.write_back()
            t = monotonic()
        dur = t - t0
        self._tick_end_mono = t
        self.ticks += 1
        try:
            rows = {"last_tick_at": str(self.clock.time()), "tick_duration_s": f"{dur:.4f}",
                    "ticks": str(self.ticks)}
            alerts = None
            if self.dispatcher is not None and hasattr(self.dispatcher, "status"):
                # The sinks' health: compared as a doc, dumped and written when it changed (a
                # json.dumps a tick was most of what a quiet dispatcher cost).
                alerts = _jsonable(self.dispatcher.status())
                if alerts != self._alerts_doc:
                    rows["alerts"] = json.dumps(alerts, default=str)
            self.db.set_metas_later(rows)
            if "alerts" in rows:
                self._alerts_doc = alerts
        except Exception as e:  # noqa: BLE001 - the meta rows are a report: a failure to write them is logged, the tick goes on
            self._tick_failed("(the tick's meta rows)", e)
        self._tick_dur = dur

    def _after_tick(self) -> None:
        dur = self._tick_dur
        # The summary is for systemd's STATUS= and the first tick's log line: not made for a
        # notifier that sends nothing (no NOTIFY_SOCKET) on every other tick.
        status = self.summary() if self.ticks == 1 or self.notifier.enabled else ""
        healthy = dur <= self.config.daemon.tick_deadline_s
        if not healthy:
            log.warning("tick took %.1f s (deadline %.1f s): no watchdog ping for it", dur,
                        self.config.daemon.tick_deadline_s)
        if self.ticks == 1:
            self.notifier.ready(status)
            self.started.set()
            log.info("stallwatch daemon ready: %s", status)
        if healthy:
            self.notifier.watchdog(status)
        else:
            self.notifier.status(status)
        self._update_metrics(dur)

    def _prune_alert_state(self) -> None:
        """Removed jobs' saved alert state, once it can no longer be restored (alertmemory)."""
        now = self._tick_end_mono
        if self._db is None:
            return
        if self._pruned_mono is None or now - self._pruned_mono >= PRUNE_EVERY_S:
            self._pruned_mono = now
            prune_removed(self.db, self.jobs.keys(), self.clock.time())

    # A job whose tick overran job_tick_deadline_s waits this many times that tick's duration
    # before its next one, so that it takes at most 1/(1 + OVERRUN_SPACING) of the daemon's
    # time and every other job keeps its own cadence (issue 22 #9: a user's tree of 2,000
    # processes made every tick last seconds, and another job's stall threshold, learned from
    # its log's cadence as seen tick by tick, grew from 20 s to the 120 s default).
    OVERRUN_SPACING = 4.0

    def _due_jobs(self, now: float) -> list[JobRunner]:
        """The jobs to tick now, the config's order, those that overran last."""
        limit = self.config.daemon.job_tick_deadline_s
        due = [r for r in self.jobs.values() if r.next_due <= now]
        if len(due) > 1:  # stable: the config's order within each group
            due.sort(key=lambda r: (r.last_tick_s or 0.0) > limit)
        return due

    def _spaced(self, runner: JobRunner, start: float, end: float,
                cpu_s: float | None = None) -> None:
        """After a job's tick: over its deadline because its tree is too wide, or three ticks in
        a row that each also spent that much CPU (`cpu_s`, the daemon's, all threads), it waits
        before the next. A tick long in wall time but not in CPU is the machine's load, nobody's
        doing: spacing it out delayed a torchrun hang's verdict past the 30 s contract at load
        20 (ticked every 4-6 s instead of every second)."""
        took = end - start
        runner.last_tick_s = took
        deadline_s = self.config.daemon.job_tick_deadline_s
        over = took > deadline_s
        if not over:  # the usual
            runner.overruns, runner.next_due = 0, 0.0
            return
        costly = over and (cpu_s is None or cpu_s > deadline_s)
        runner.overruns = runner.overruns + 1 if costly else 0
        snap = runner.last_snap
        wide = bool(snap is not None and snap.processes is not None and snap.processes.truncated)
        spaced = over and (wide or runner.overruns >= 3)
        runner.next_due = end + self.OVERRUN_SPACING * took if spaced else 0.0

    def _tick_failed(self, name: str, e: Exception) -> None:
        """The traceback once; the same error again only as a line a minute, with a count."""
        what = f"{type(e).__name__}: {e}"
        prev = self._job_errors.get(name)
        now = self.clock.monotonic()
        if prev is None or prev[0] != what:
            self._job_errors[name] = (what, now, 1)
            log.exception("job %s: tick failed", name)
        elif now - prev[1] >= 60.0:
            self._job_errors[name] = (what, now, 1)
            log.error("job %s: tick failed again (%d times since the last report): %s", name,
                      prev[2] + 1, what)
        else:
            self._job_errors[name] = (prev[0], prev[1], prev[2] + 1)

    def summary(self) -> str:
        parts = []
        for r in self.jobs.values():
            v = r.verdict.kind if r.verdict is not None else "unknown"
            extra = ""
            lv = (r.last_vars or {}).get("log") or {}
            if lv.get("has_progress"):
                total = f"/{lv['total']:g}" if lv.get("total_known") else ""
                extra = f" {lv['done']:g}{total}"
            phase = r.phase if r.phase not in ("running", "attached") else ""
            parts.append(f"{r.name}: {v}{extra}" + (f" ({phase})" if phase else ""))
        out = "; ".join(parts) or "no jobs"
        if self._db is not None and self._db.degraded:
            out = f"STATE IN MEMORY ({self._db.degraded}); {out}"
        return out

    # ------------------------------------------------------------------------------- alerts

    def _job_options(self) -> JobOptions:
        return JobOptions(db=self.db, clock=self.clock, state_dir=self.state_dir, host=self.host,
                          boot_id=self.boot_id, gpu=self.gpu_enabled,
                          submit_alert=self.submit_alert, settings=lambda: self.config.daemon,
                          actions=self.actions)

    def _make_dispatcher(self, config: Config) -> Any:
        if not config.alerts:
            return None
        try:
            return self.actions.dispatcher(list(config.alerts), clock=self.clock,
                                           state_dir=str(self.state_dir), host=self.host)
        except Exception:  # alerts off is better than no watchdog
            log.exception("cannot build the alert dispatcher: alerts are only logged")
            return None

    def submit_alert(self, event: Any) -> None:
        doc = event.model_dump(mode="json")
        try:
            self.db.record_alert(event.incident_id, event.job, event.kind, event.state,
                                 event.summary, doc)
        except Exception:
            log.exception("cannot record the alert event")
        log.log(logging.WARNING if event.state == "firing" else logging.INFO,
                "alert %s: job %s: %s: %s", event.state, event.job, event.kind, event.summary)
        if self.dispatcher is not None:
            try:
                self.dispatcher.submit(event)
            except Exception:  # a sink's bug must not stop the watch
                log.exception("alert dispatcher refused the event")

    # ------------------------------------------------------------------------------- reload

    def reload(self) -> bool:
        """SIGHUP: read the config and rules again; on any error keep the last good ones."""
        self.notifier.reloading()
        path = self.config_path
        try:
            if path is None:
                raise UsageError("no config file to reload (the daemon was given a config object)")
            new = load_config(path)
            rules = {j.name: self.rules_for(j, new) for j in new.job}
        except UsageError as e:
            log.error("reload failed, keeping the last good configuration: %s", e)
            self.db.set_meta("last_reload_error", f"{self.clock.time():.3f} {e}")
            self.notifier.ready(self.summary())
            return False
        if new.state_dir != self.state_dir:
            log.warning("state_dir changed to %s: takes effect when the daemon is restarted",
                        new.state_dir)
        old_cfg = self.config
        old_jobs = {j.name: j for j in old_cfg.job}
        self.config = new.model_copy(update={"daemon": new.daemon.model_copy(
            update={"state_dir": self.state_dir})})
        for name in [n for n in self.jobs if new.job_named(n) is None]:
            self.jobs.pop(name).unwatch()
            log.info("job %s: removed from the config: no longer watched, left as it is", name)
        for job in new.job:
            rs, key = rules[job.name]
            runner = self.jobs.get(job.name)
            if runner is None:
                runner = JobRunner(self._job_options(), job, rs)
                self.jobs[job.name] = runner
                self._rules_keys[job.name] = key
                runner.start()
                log.info("job %s: added", job.name)
                continue
            changed_rules = key != self._rules_keys.get(job.name)
            if job != old_jobs.get(job.name) or changed_rules:
                runner.update(job, rs, rules_changed=changed_rules)
                self._rules_keys[job.name] = key
                log.info("job %s: configuration updated%s", job.name,
                         " (new rules)" if changed_rules else "")
        if tuple(new.alert) != tuple(old_cfg.alert):
            old = self.dispatcher
            self.dispatcher = self._make_dispatcher(new)
            if old is not None:
                try:
                    old.close()
                except Exception:
                    log.exception("closing the old alert dispatcher")
        self.db.set_meta("last_reload_at", str(self.clock.time()))
        self.db.set_meta("last_reload_error", None)
        log.info("reloaded %s: %d job(s)", path, len(self.jobs))
        self.notifier.ready(self.summary())
        return True

    # -------------------------------------------------------------------------------- metrics

    def _start_metrics(self) -> None:
        """Prometheus endpoint and/or node_exporter textfile: stallwatch.daemon.metrics (docs/fleet.md)."""
        d = self.config.daemon
        if not (d.metrics_listen or d.metrics_textfile):
            return
        try:
            from stallwatch.daemon.metrics_export import DaemonMetrics
        except ImportError as e:
            log.warning("metrics are configured but stallwatch.daemon.metrics cannot be loaded: %s", e)
            return
        self._metrics = DaemonMetrics.from_config(d)
        if self._metrics is not None and d.metrics_listen:
            log.info("metrics on %s", getattr(self._metrics.exporter, "address", d.metrics_listen))

    def _update_metrics(self, dur: float) -> None:
        if self._metrics is not None:
            self._metrics.tick(self, dur)

    # ------------------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        self.notifier.stopping("stopping; jobs are left running")
        self._uninstall()
        for r in list(self.jobs.values()):
            try:
                r.close()
            except Exception:
                log.exception("job %s: close failed", r.name)
        if self._metrics is not None:
            try:
                self._metrics.close()
            except Exception:
                log.exception("closing the metrics exporter")
            self._metrics = None
        if self.dispatcher is not None:
            try:
                self.dispatcher.close()
            except Exception:
                log.exception("closing the alert dispatcher")
        if self._db is not None:
            if self._lock_fd is not None:  # only the daemon that owns the state says it stopped
                try:
                    self._db.set_meta("daemon_stopped_at", str(self.clock.time()))
                except Exception:  # noqa: BLE001 - closing: the row is a courtesy to status
                    pass
            self._db.close()
            self._db = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1
        self.notifier.close()
        log.info("stallwatch daemon stopped" + ("" if self.config.daemon.exit_with_jobs
                                                else "; jobs left running"))


def _jsonable(x: Any) -> Any:
    if hasattr(x, "model_dump"):
        return x.model_dump(mode="json")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def setup_logging(level: str = "info") -> None:
    root = logging.getLogger("stallwatch")
    if not any(getattr(h, "_stallwatch", False) for h in root.handlers):
        h = logging.StreamHandler()
        # Under systemd the journal stamps each line; elsewhere a timestamp helps.
        fmt = "%(levelname)s %(message)s" if os.environ.get("INVOCATION_ID") else \
            "%(asctime)s %(levelname)s %(message)s"
        h.setFormatter(logging.Formatter(fmt))
        h._stallwatch = True  # type: ignore[attr-defined]  # our mark on the handler, found again above
        root.addHandler(h)
    root.setLevel(level.upper())


def run_daemon(config: Config, **kwargs: Any) -> int:
    setup_logging(config.daemon.log_level)
    return Daemon(config, **kwargs).run()
