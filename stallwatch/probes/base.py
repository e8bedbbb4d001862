"""What every probe shares: its report (status and duration) and the deadline runner.

A probe is any object with a `name` and a `collect()` that returns a Frozen observation. It may
raise; the runner turns Absent/Denied/any exception/a missed deadline into a ProbeReport, so a
probe that fails or hangs becomes evidence and never a crash or a hung tick.
"""

from __future__ import annotations

import itertools
import queue
import threading
import traceback
from collections import deque
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from stallwatch.clock import Clock, SYSTEM_CLOCK
from stallwatch.model import Frozen
from stallwatch.kernel.roots import Absent, Denied
from stallwatch.probes.processes_obs import built

M = TypeVar("M", bound=Frozen)


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


def field_defaults(cls: type[Frozen], factory_given: tuple[str, ...] = ()) -> dict[str, Any]:
    """Each field's default (None for a required one), in the declared order: for `made`. A
    field with a default_factory has no one default to share: each `made` of it must give it
    (named in factory_given; None stands in its place here)."""
    out: dict[str, Any] = {}
    for name, f in cls.model_fields.items():
        if f.default_factory is not None and name not in factory_given:
            raise TypeError(f"{cls.__name__}.{name} has a default_factory: every made() must give it")
        out[name] = None if f.is_required() or f.default_factory is not None else f.default
    return out


def made(cls: type[M], defaults: dict[str, Any], values: dict[str, Any]) -> M:
    """cls(**values) without validation (processes_obs.built), as model_construct builds it (the
    fields not given take their defaults, only the given ones are `set`, the declared order) at a
    fraction of its cost (issue 17: model_construct walks every field's metadata in Python, each
    tick for the snapshot and every probe's report). `defaults` is field_defaults(cls)."""
    return built(cls, {**defaults, **values}, set(values))


class ProbeReport(Frozen):
    name: str
    status: ProbeStatus
    duration_s: float
    error: str | None = None


def ok_report(name: str, duration_s: float) -> ProbeReport:
    """A run's `ok` report, unvalidated: a str, a member and a float of ours, each tick for every
    probe (issue 17); made() as it would, without its merge of the defaults."""
    return built(ProbeReport, {"name": name, "status": ProbeStatus.ok,
                               "duration_s": float(duration_s), "error": None},
                 {"name", "status", "duration_s"})


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
        if not self._workers:  # the usual: none was ever handed a call (one read, no lock)
            return
        with self._lock:
            gone = [self._workers.pop(n) for n in [n for n in self._workers if n not in keep]]
        for w in gone:
            w.stop()


# A batch not done by this share of its shortest deadline is handed out, a worker per call left.
HANDOFF_SHARE = 0.25


class Call:
    """One call of a batch: run by exactly one thread (the lane, or a worker of its own).

    What it has not set yet reads as the class's defaults (no __slots__: eight stores a call,
    some ten calls a tick, were most of making one; issue 17)."""

    done = False
    value: Any = None
    error: BaseException | None = None
    started: float | None = None
    finished: float | None = None
    batch: Batch | None = None

    def __init__(self, name: str, fn) -> None:
        self.name, self.fn = name, fn


class Batch:
    """Calls run one after the other by one lane thread, until the batch is handed out: then
    each call not yet begun gets a worker of its own (Lane.hand_out), so a call stuck in the
    kernel delays the others by the handoff, never by its deadline. The batch is done when the
    last call ends, whoever ran it: a healthy batch costs the waiter one wake, not one a call.

    No lock a call (issue 17: two a call were most of a healthy batch's own cost): a call is
    taken with `deque.popleft` and its end counted with `next()` on an itertools.count, each one
    C call under the GIL, so atomic: each call is run once, and exactly one thread sees the
    last end."""

    def __init__(self, calls: list[Call], clock: Clock) -> None:
        self.calls, self.clock = calls, clock
        for call in calls:
            call.batch = self
        self._todo = deque(calls)  # the calls no thread has taken yet, in order
        self._n = len(calls)
        self._ends = itertools.count(1)
        self._all_done = not calls
        # Notified as each call ends; made by the first wait_for only (a batch late past its
        # shortest deadline): a healthy batch makes no Condition and notifies none (issue 17).
        self._ended: threading.Condition | None = None
        # Held until the last call ends: a bare lock is the cheapest thing to wait on (an Event
        # makes a Condition and a lock per wait).
        self._pending = threading.Lock()
        self.lane_in: Call | None = None  # the call the lane thread is inside, if any
        if calls:
            self._pending.acquire()

    def done(self) -> bool:
        return self._all_done

    def wait(self, timeout_s: float) -> bool:
        """True once every call has ended; False when `timeout_s` passed first."""
        if self._all_done:
            return True
        if not self._pending.acquire(timeout=max(0.0, timeout_s)):
            return False
        self._pending.release()  # for the next waiter
        return True

    def take(self) -> Call | None:
        """The next call no thread has begun (it is the caller's to run), or None."""
        if self._todo:  # the usual end: no IndexError raised and caught
            try:
                return self._todo.popleft()
            except IndexError:  # the other taker took the last one since the look
                pass
        return None

    def wait_for(self, calls: list[Call], timeout_s: float) -> bool:
        """True once each of `calls` has ended (the others may still run)."""
        if self._ended is None:
            # run() sets `done` before it looks for the Condition, and notifies under it: a call
            # that ends before it exists is seen done by wait_for's first look, none is missed.
            self._ended = threading.Condition(threading.Lock())
        with self._ended:
            return self._ended.wait_for(lambda: all(c.done for c in calls), max(0.0, timeout_s))

    def run(self, call: Call) -> None:
        monotonic = self.clock.monotonic
        call.started = monotonic()
        try:
            call.value = call.fn()
        except BaseException as e:  # noqa: BLE001 - every failure becomes its call's result
            call.error = e
        call.finished = monotonic()
        call.done = True
        # The batch and its calls refer to each other: a done call lets go of its batch, so
        # both are freed by their reference counts (the cycle kept each tick's observations,
        # 1,025 thread records on the wide job, alive until a gen-1 collection: +47 MiB RSS
        # with daemon/gcpolicy.py's rarer collections). Only a call still running is waited
        # on through its batch (disks.py).
        call.batch = None
        if self.lane_in is call:
            self.lane_in = None  # before the batch is done: the waiter may hand the lane the next
        if next(self._ends) == self._n:
            self._all_done = True
            self._pending.release()
        ended = self._ended
        if ended is not None:
            with ended:
                ended.notify_all()

    def run_lane(self) -> None:
        todo, run = self._todo, self.run
        while todo:  # the usual end: no IndexError raised and caught
            try:
                call = todo.popleft()
            except IndexError:  # a hand-out took the last one since the look
                return
            # Named the lane's at once after it is taken: the next batch is started (Lane.start
            # reads this) only after this one is done or handed out, seconds later.
            self.lane_in = call
            run(call)


class Lane:
    """One thread that runs each batch's calls in order, and named workers for the calls handed
    out of a late batch. A lane still inside an earlier batch (stuck in a call) is left to end
    after it returns; the next batch gets a new lane. Stuck threads never pile up: a stuck
    call's owner does not start it again until it has returned (`busy`)."""

    def __init__(self, prefix: str, clock: Clock = SYSTEM_CLOCK, idle_s: float = 60.0) -> None:
        self.prefix, self.clock, self.idle_s = prefix, clock, idle_s
        self._workers = Workers(prefix, idle_s)
        self._lane: Worker | None = None
        self._batch: Batch | None = None

    def start(self, calls: list[Call]) -> Batch:
        batch = Batch(calls, self.clock)
        if not calls:
            return batch
        if self._lane is not None and self._batch is not None and self._batch.lane_in is not None:
            self._lane.stop()  # stuck: it ends once its call returns
            self._lane = None
        self._batch = batch
        if self._lane is None or not self._lane.submit(batch.run_lane):
            self._lane = Worker(f"{self.prefix}lane", self.idle_s)
            self._lane.submit(batch.run_lane)
        return batch

    def hand_out(self, batch: Batch) -> None:
        """Each call the lane has not begun runs now in its own worker."""
        while (call := batch.take()) is not None:
            self._workers.submit(call.name, lambda c=call: batch.run(c))

    def retire(self, keep) -> None:
        self._workers.retire(keep)

    def wait(self, batch: Batch, handoff_at_mono: float, until: float) -> None:
        """Wait until every call is done or `until` (the clock's monotonic time), handing the
        batch out when it is not done by `handoff_at_mono`."""
        if batch.wait(min(handoff_at_mono, until) - self.clock.monotonic()):
            return
        self.hand_out(batch)
        batch.wait(until - self.clock.monotonic())


class DeadlineRunner:
    """Runs probe calls in daemon threads with a deadline.

    A thread stuck in the kernel (statvfs on a frozen filesystem, NVML in a wedged driver) cannot
    be cancelled. We abandon it, report `timeout`, and refuse to start a second call of the same
    probe while the first is still stuck (`busy`), so stuck threads never pile up. The calls of
    one `call_many` run one after the other in one lane thread (Lane): a handoff to a thread costs
    more than most probes' work (issue 17); a batch late by HANDOFF_SHARE of its shortest deadline
    gives each call not yet begun a worker of its own, so one frozen filesystem that stalls three
    probes still costs one deadline, not three.
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._inflight: dict[str, Call] = {}
        self._lock = threading.Lock()
        self._lane = Lane("probe-", clock)

    def stuck(self) -> list[str]:
        with self._lock:
            return [k for k, c in self._inflight.items() if not c.done]

    def is_stuck(self, name: str) -> bool:
        """Whether a call of `name` is still running (without building stuck()'s list)."""
        call = self._inflight.get(name)  # one dict read: atomic, no lock needed
        return call is not None and not call.done

    def call(self, name: str, fn, deadline_s: float) -> tuple[Any, ProbeReport]:
        return self.call_many([(name, fn, deadline_s)])[0]

    def call_many(self, calls: list[tuple[str, Any, float]]) -> list[tuple[Any, ProbeReport]]:
        """Run the calls in one batch, then take each by its own deadline (from now)."""
        if not calls:
            return []
        t0 = self._clock.monotonic()
        mine: list[Call | None] = []  # each call's Call; None: its name's last is still stuck
        fresh: list[Call] = []
        inflight = self._inflight
        with self._lock:
            for name, fn, _ in calls:
                prev = inflight.get(name)
                if prev is not None and not prev.done:
                    mine.append(None)  # `busy`
                else:
                    inflight[name] = new = Call(name, fn)
                    fresh.append(new)
                    mine.append(new)
        batch = self._lane.start(fresh)
        shortest = min([c[2] for c in calls])
        # What is raised while this thread waits (a KeyboardInterrupt: Ctrl-C, or the SIGINT
        # that stops `stallwatch record`) is the caller's and propagates; a probe's own
        # failure is its call's `error`, read in _report.
        self._lane.wait(batch, t0 + HANDOFF_SHARE * shortest, t0 + shortest)
        if batch.done():  # all ended within the shortest deadline: each in time (the usual)
            return [(call.value, ok_report(call.name, (call.finished or t0) - t0))
                    if call is not None and call.error is None  # _report's usual answer
                    else self._report(c[0], call, c[2], t0, call is not None)
                    for c, call in zip(calls, mine, strict=True)]
        started = [(name, call, deadline_s)
                   for (name, _, deadline_s), call in zip(calls, mine, strict=True)]
        in_time: list[bool] = [False] * len(started)
        for deadline_s in sorted({d for _, _, d in started}):  # each call, at its deadline
            if deadline_s > shortest:  # wait on for the calls with this deadline or longer
                batch.wait_for([c for _, c, d in started if c is not None and d >= deadline_s],
                               t0 + deadline_s - self._clock.monotonic())
            for i, (_, call, d) in enumerate(started):
                if d == deadline_s:
                    in_time[i] = call is not None and call.done
        return [self._report(name, call, deadline_s, t0, done)
                for (name, call, deadline_s), done in zip(started, in_time, strict=True)]

    def _report(self, name: str, call: Call | None, deadline_s: float, t0: float,
                in_time: bool) -> tuple[Any, ProbeReport]:
        if call is None:
            return None, ProbeReport(name=name, status=ProbeStatus.busy, duration_s=0.0,
                                     error=f"previous call of {name} still has not returned")
        if not in_time:
            return None, ProbeReport(name=name, status=ProbeStatus.timeout,
                                     duration_s=self._clock.monotonic() - t0,
                                     error=f"{name} did not return within {deadline_s:g} s")
        duration_s = float((call.finished or t0) - t0)
        if call.error is not None:  # every failure of a probe becomes its report
            return None, report_for_exception(name, call.error, duration_s)
        return call.value, ok_report(name, duration_s)


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


def run_inline(name: str, fn, clock: Clock = SYSTEM_CLOCK,
               last: tuple[Any, ProbeReport] | None = None) -> tuple[Any, ProbeReport]:
    """Run a probe that cannot block (it touches only /proc, /sys, /dev/kmsg or a failed NVML):
    no worker thread. The report is final (report_for_observation applied). `last` is this
    probe's previous (value, report): when the probe hands back that very value (nothing new
    since), `last` is returned as it is, report included: its duration_s is then the run that
    made the observation, microseconds for a probe that cannot block, and no new object is made
    on a tick where nothing changed (issue 17)."""
    t0 = clock.monotonic()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - every failure of a probe becomes its report
        return None, report_for_exception(name, e, clock.monotonic() - t0)
    if last is not None and value is not None and value is last[0]:
        return last
    return value, report_for_observation(ok_report(name, clock.monotonic() - t0), value)
