"""What every probe shares: its report (status and duration) and the deadline runner.

A probe is any object with a `name` and a `collect()` that returns a Frozen observation. It may
raise; the runner turns Absent/Denied/any exception/a missed deadline into a ProbeReport, so a
probe that fails or hangs becomes evidence and never a crash or a hung tick.
"""

from __future__ import annotations

import queue
import threading
import traceback
from concurrent.futures import Future
from enum import StrEnum
from typing import Any, Protocol

from stallwatch.clock import Clock, SYSTEM_CLOCK
from stallwatch.model import Frozen
from stallwatch.kernel.roots import Absent, Denied


class Outcome(StrEnum):
    """How a probe run ended, in node_exporter's three words (collector/collector.go: data,
    ErrNoData, an error)."""

    data = "data"
    no_data = "no_data"  # nothing to read here, and that is no fault: no GPU, no log yet
    error = "error"  # something is there and could not be read, or the probe failed


class ProbeStatus(StrEnum):
    """The one status vocabulary of the probes: of a probe's run (ProbeReport) and of what an
    observation says about its source (`status` of LogObs, OutputsObs, GpuObs, KmsgObs,
    ServerLogObs, of a disk path). Each value has its `outcome`; a run's report uses only the
    first six, and an observation's finer reason is `reported` as one of them."""

    ok = "ok"
    absent = "absent"  # the source does not exist here (no GPU, no log yet, no server configured)
    denied = "denied"  # it exists but we may not read it
    error = "error"  # it raised something unexpected
    timeout = "timeout"  # it did not return within its deadline (stuck mount, hung NVML)
    busy = "busy"  # its previous call is still running (stuck since an earlier tick)
    # Finer reasons an observation gives (public spellings of docs/contract.md, kept as they were)
    none = "none"  # nothing known to read yet (the server's log before it is found)
    not_a_file = "not_a_file"  # a directory, FIFO or device where the log should be
    not_a_dir = "not_a_dir"  # a file where the outputs directory should be
    no_library = "no_library"  # NVML: pynvml or libnvidia-ml.so not here
    no_driver = "no_driver"  # NVML: the kernel module is not loaded
    no_permission = "no_permission"  # NVML: /dev/nvidia* not accessible

    @property
    def outcome(self) -> Outcome:
        return _OUTCOME[self]

    @property
    def reported(self) -> ProbeStatus:
        """The report status this one folds into (one of REPORT_STATUSES)."""
        return _REPORTED.get(self, self)


REPORT_STATUSES: tuple[ProbeStatus, ...] = (
    ProbeStatus.ok, ProbeStatus.absent, ProbeStatus.denied, ProbeStatus.error,
    ProbeStatus.timeout, ProbeStatus.busy)
_REPORTED = {ProbeStatus.none: ProbeStatus.absent, ProbeStatus.no_library: ProbeStatus.absent,
             ProbeStatus.no_driver: ProbeStatus.absent, ProbeStatus.no_permission: ProbeStatus.denied,
             ProbeStatus.not_a_file: ProbeStatus.error, ProbeStatus.not_a_dir: ProbeStatus.error}
_OUTCOME = {s: (Outcome.data if s is ProbeStatus.ok else
                Outcome.no_data if _REPORTED.get(s, s) is ProbeStatus.absent else Outcome.error)
            for s in ProbeStatus}


class ProbeReport(Frozen):
    name: str
    status: ProbeStatus
    duration_s: float
    error: str | None = None


class Probe(Protocol):
    name: str

    def collect(self) -> Any: ...


class Worker:
    """One long-lived daemon thread that runs the calls it is given, one after the other.

    Starting a thread per call costs more than most probes' work (bench/: docs/performance.md),
    so each probe keeps its worker between ticks. An idle worker ends after `idle_s`, so the
    workers of a collector that is dropped do not outlive it for long. A worker stuck in a call
    is never given another one: its owner sees the call's future not done and reports `busy`.
    """

    def __init__(self, name: str, idle_s: float = 60.0) -> None:
        self.name, self.idle_s = name, idle_s
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._alive = True
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn) -> bool:
        """Queue `fn`; False when this worker has ended (idle): make a new one."""
        with self._lock:
            if not self._alive:
                return False
            self._q.put(fn)
            return True

    def stop(self) -> None:
        self.submit(None)

    def _run(self) -> None:
        while True:
            try:
                fn = self._q.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._q.empty():
                        self._alive = False
                        return
                continue
            if fn is None:
                with self._lock:
                    self._alive = False
                return
            fn()


class Workers:
    """Named workers, made on first use and again after one ends."""

    def __init__(self, prefix: str = "", idle_s: float = 60.0) -> None:
        self.prefix, self.idle_s = prefix, idle_s
        self._workers: dict[str, Worker] = {}
        self._lock = threading.Lock()

    def submit(self, name: str, fn) -> None:
        with self._lock:
            w = self._workers.get(name)
            if w is None or not w.submit(fn):
                w = self._workers[name] = Worker(f"{self.prefix}{name}", self.idle_s)
                w.submit(fn)

    def retire(self, keep) -> None:
        """Stop the workers whose name is not in `keep` (they finish their call first)."""
        with self._lock:
            gone = [self._workers.pop(n) for n in [n for n in self._workers if n not in keep]]
        for w in gone:
            w.stop()


class DeadlineRunner:
    """Runs probe calls in daemon threads with a deadline.

    A thread stuck in the kernel (statvfs on a frozen filesystem, NVML in a wedged driver) cannot
    be cancelled. We abandon it, report `timeout`, and refuse to start a second call of the same
    probe while the first is still stuck (`busy`), so stuck threads never pile up. Each probe's
    thread is kept between ticks (Worker).
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._workers = Workers("probe-")

    def stuck(self) -> list[str]:
        with self._lock:
            return [k for k, f in self._inflight.items() if not f.done()]

    def call(self, name: str, fn, deadline_s: float) -> tuple[Any, ProbeReport]:
        return self.call_many([(name, fn, deadline_s)])[0]

    def call_many(self, calls: list[tuple[str, Any, float]]) -> list[tuple[Any, ProbeReport]]:
        """Start every call at once, then collect each by its own deadline.

        Concurrent, so one frozen filesystem that stalls three probes costs one deadline, not three.
        """
        t0 = self._clock.monotonic()
        started: list[tuple[str, Future | None, float]] = []
        for name, fn, deadline_s in calls:
            started.append((name, self._start(name, fn), deadline_s))
        out: list[tuple[Any, ProbeReport]] = []
        for name, fut, deadline_s in started:
            if fut is None:
                out.append((None, ProbeReport(
                    name=name, status=ProbeStatus.busy, duration_s=0.0,
                    error=f"previous call of {name} still has not returned",
                )))
                continue
            remaining = max(0.0, t0 + deadline_s - self._clock.monotonic())
            # The probe's own failure is read, not raised (fut.exception): what is raised while
            # this thread waits is the caller's, never the probe's. A KeyboardInterrupt (Ctrl-C,
            # or the SIGINT that stops `stallwatch record`) lands here in most of a loaded tick,
            # and used to be filed as the probe's error report: the recorder did not stop.
            try:
                failure = fut.exception(timeout=remaining)
            except TimeoutError:
                out.append((None, ProbeReport(
                    name=name, status=ProbeStatus.timeout, duration_s=self._clock.monotonic() - t0,
                    error=f"{name} did not return within {deadline_s:g} s",
                )))
                continue
            if failure is not None:  # every failure of a probe becomes its report
                out.append((None, report_for_exception(name, failure, self._clock.monotonic() - t0)))
                continue
            value = fut.result()
            out.append((value, ProbeReport(name=name, status=ProbeStatus.ok,
                                           duration_s=self._clock.monotonic() - t0)))
        return out

    def _start(self, name: str, fn) -> Future | None:
        with self._lock:
            prev = self._inflight.get(name)
            if prev is not None and not prev.done():
                return None
            fut: Future = Future()
            self._inflight[name] = fut

        def work() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - every failure becomes a report
                fut.set_exception(e)

        self._workers.submit(name, work)
        return fut


def report_for_observation(report: ProbeReport, value: object) -> ProbeReport:
    """A probe that returned an observation without data says so in its report: the call went
    well, but what it watches is absent, denied or broken. One rule for every probe whose
    observation carries a `status: ProbeStatus` and an `error` about its whole source."""
    status = getattr(value, "status", None)
    if not isinstance(status, ProbeStatus) or report.status is not ProbeStatus.ok \
            or status is ProbeStatus.ok:
        return report
    return report.model_copy(update={"status": status.reported,
                                     "error": getattr(value, "error", None) or status.value})


def report_for_exception(name: str, e: BaseException, duration_s: float) -> ProbeReport:
    if isinstance(e, Absent):
        return ProbeReport(name=name, status=ProbeStatus.absent, duration_s=duration_s, error=str(e))
    if isinstance(e, (Denied, PermissionError)):
        return ProbeReport(name=name, status=ProbeStatus.denied, duration_s=duration_s, error=str(e))
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return ProbeReport(
        name=name, status=ProbeStatus.error, duration_s=duration_s,
        error=f"{type(e).__name__}: {e}{where}",
    )


def run_inline(name: str, fn, clock: Clock = SYSTEM_CLOCK) -> tuple[Any, ProbeReport]:
    """Run a probe that touches only /proc, /sys or NVML-in-its-own-thread: no worker thread."""
    t0 = clock.monotonic()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - every failure of a probe becomes its report
        return None, report_for_exception(name, e, clock.monotonic() - t0)
    return value, ProbeReport(name=name, status=ProbeStatus.ok, duration_s=clock.monotonic() - t0)
