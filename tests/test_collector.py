"""The collector never hangs: a probe stuck in the kernel becomes evidence and the tick goes on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from rigs import dead_fuse_mount, root  # noqa: F401 - root is a fixture

from stallwatch.probes.collector import Collector
from stallwatch.engine.features import features
from stallwatch.probes.base import REPORT_STATUSES, DeadlineRunner, Outcome, ProbeStatus
from stallwatch.probes.snapshot import PROBE_FIELDS
from stallwatch.probes.targets import Target


def test_a_hanging_call_times_out_then_reports_busy_and_never_piles_up():
    release = threading.Event()
    calls = []

    def stuck():
        calls.append(1)
        release.wait(30)
        return "late"

    r = DeadlineRunner()
    try:
        value, rep = r.call("x", stuck, 0.2)
        assert value is None and rep.status == ProbeStatus.timeout and "0.2 s" in rep.error
        value, rep = r.call("x", stuck, 0.2)
        assert rep.status == ProbeStatus.busy and len(calls) == 1  # never a second stuck thread
        assert r.stuck() == ["x"]
    finally:
        release.set()


def test_call_many_runs_concurrently_so_stuck_probes_cost_one_deadline():
    release = threading.Event()
    r = DeadlineRunner()
    t0 = time.monotonic()
    try:
        out = r.call_many([(f"p{i}", lambda: release.wait(30), 0.5) for i in range(4)]
                          + [("ok", lambda: 42, 0.5)])
    finally:
        release.set()
    elapsed = time.monotonic() - t0
    assert [rep.status for _, rep in out[:4]] == [ProbeStatus.timeout] * 4
    assert out[4][0] == 42 and out[4][1].status == ProbeStatus.ok
    assert elapsed < 4 * 0.5  # sequential deadlines would have cost 2 s


def test_a_healthy_batch_runs_in_one_lane_thread_in_order() -> None:
    """One handoff a batch, not one a probe (issue 17): every call of a call_many runs in the
    same thread, not the caller's, in the order given; and the next batch reuses that thread."""
    ran: list[tuple[str, threading.Thread]] = []
    r = DeadlineRunner()
    for _ in range(2):
        out = r.call_many([(n, lambda n=n: ran.append((n, threading.current_thread())) or n, 5.0)
                           for n in ("processes", "log", "outputs")])
        assert [(v, rep.status) for v, rep in out] == [(n, ProbeStatus.ok) for n in ("processes", "log", "outputs")]
    assert [n for n, _ in ran] == ["processes", "log", "outputs"] * 2
    threads = {t for _, t in ran}
    assert len(threads) == 1 and threading.current_thread() not in threads


def test_a_call_stuck_in_the_lane_hands_the_rest_out_and_threads_do_not_pile_up() -> None:
    """The lane stuck in its first call: the calls after it get a worker each once the batch is
    late (a quarter of the deadline), return within the deadline, and on the next ticks a new
    lane runs them while the stuck call is `busy`; the thread count stays flat."""
    release = threading.Event()
    stuck_calls = []

    def stuck() -> str:
        stuck_calls.append(1)
        release.wait(30)
        return "late"

    r = DeadlineRunner()
    batch = [("stuck", stuck, 1.0)] + [(f"p{i}", lambda i=i: i, 1.0) for i in range(3)]
    counts = []
    try:
        t0 = time.monotonic()
        out = r.call_many(batch)
        assert time.monotonic() - t0 < 1.0 * 2  # one deadline, not one per call
        assert out[0][1].status == ProbeStatus.timeout
        assert [(v, rep.status) for v, rep in out[1:]] == [(i, ProbeStatus.ok) for i in range(3)]
        # the others returned before the stuck call's deadline passed, not after it
        assert all(rep.duration_s < 1.0 for _, rep in out[1:]), out
        for _ in range(4):
            out = r.call_many(batch)
            assert out[0][1].status == ProbeStatus.busy
            assert [(v, rep.status) for v, rep in out[1:]] == [(i, ProbeStatus.ok) for i in range(3)]
            counts.append(sum(t.name.startswith("probe-") for t in threading.enumerate()))
        assert len(stuck_calls) == 1 and r.stuck() == ["stuck"]
        assert counts[-1] <= counts[0], counts
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while r.call_many(batch)[0][1].status != ProbeStatus.ok:  # it returned: it runs again
        assert time.monotonic() < deadline, "the stuck call never ran again"


def test_a_probe_that_raises_becomes_an_error_report():
    def boom():
        raise ValueError("garbage in /proc")

    value, rep = DeadlineRunner().call("x", boom, 1.0)
    assert value is None and rep.status == ProbeStatus.error
    assert "ValueError: garbage in /proc" in rep.error


def test_ctrl_c_while_waiting_for_a_probe_is_the_callers_not_the_probes():
    """SIGINT reaching the thread that waits for the probes (`stallwatch record` stopped, most
    of a loaded tick) is the caller's KeyboardInterrupt: it was filed as the probe's error
    report, and the recorder went on to its --duration (test_specforge_live, under load)."""
    release, started = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(30)
        return "late"

    def interrupt() -> None:
        started.wait(10)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    sender = threading.Thread(target=interrupt)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            DeadlineRunner().call("x", slow, 20.0)
    finally:
        release.set()
        sender.join(10)
        signal.signal(signal.SIGINT, before)


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse for a dead mount")
def test_log_and_outputs_on_a_dead_mount_do_not_hang_the_tick(root):
    with dead_fuse_mount() as (mnt, abort):
        c = Collector(Target(pids=(os.getppid(),), log=mnt / "job.log", outputs=mnt / "out"),
                      gpu=False, deadline_s=1.0, use_inotify=False)
        try:
            t0 = time.monotonic()
            snap = c.tick()
            first = time.monotonic() - t0
            snap2 = c.tick()
        finally:
            abort()  # unblocks the abandoned workers before the collector is closed
            c.close()
    assert first < 4.0  # one deadline for the stuck probes (they run concurrently), plus /proc
    st = {p.name: p.status for p in snap.probes}
    assert st["log"] == ProbeStatus.timeout and st["outputs"] == ProbeStatus.timeout
    assert st["processes"] == ProbeStatus.ok
    st2 = {p.name: p.status for p in snap2.probes}
    assert st2["log"] == ProbeStatus.busy
    # The disks probe names the dead mount even though statvfs never returned.
    paths = {p.path: p for p in snap.disks.paths}
    assert any(p.status in (ProbeStatus.timeout, ProbeStatus.busy) for p in paths.values())
    v = features(snap2)
    assert any("log: busy" in e or "log: timeout" in e for e in v["probe_errors"])
    assert v["disk"]["stuck"]


def test_every_observation_status_folds_into_its_report_by_one_rule(tmp_path):
    """Data / no data / error (node_exporter's three ends), one rule for every probe: an
    observation that says its source is missing or broken says so in its probe's report; no
    probe is special-cased by name."""
    assert {s.reported for s in ProbeStatus} == set(REPORT_STATUSES)
    assert {s for s in ProbeStatus if s.outcome is Outcome.data} == {ProbeStatus.ok}
    assert ProbeStatus.no_driver.outcome is Outcome.no_data and ProbeStatus.busy.outcome is Outcome.error
    (tmp_path / "job.log").mkdir()  # a directory where the log should be
    (tmp_path / "out").write_text("x")  # a file where the outputs directory should be
    c = Collector(Target(pids=(os.getpid(),), log=tmp_path / "job.log", outputs=tmp_path / "out",
                         server_log=tmp_path / "none.log"),
                  gpu=False, deadline_s=10.0, use_inotify=False)
    try:
        snap = c.tick()
    finally:
        c.close()
    reports = {p.name: p for p in snap.probes}
    assert list(reports) == [*(n for n in PROBE_FIELDS if n in reports and n != "disks"), "disks"]
    assert (snap.log.status, reports["log"].status) == (ProbeStatus.not_a_file, ProbeStatus.error)
    assert reports["log"].error == snap.log.error and "directory" in snap.log.error
    assert (snap.outputs.status, reports["outputs"].status) == (ProbeStatus.not_a_dir, ProbeStatus.error)
    assert (snap.server_log.status, reports["server_log"].status) == (ProbeStatus.absent,) * 2
    assert reports["processes"].status == ProbeStatus.ok
    assert any(e.startswith("log: error: ") for e in features(snap)["probe_errors"])
    # each observation sits in the field the table gives its probe (kmsg -> kernel)
    for name, field in PROBE_FIELDS.items():
        assert (name in reports) == (getattr(snap, field) is not None), name


def test_disks_handed_out_of_a_late_lane_gets_the_jobs_paths_a_stuck_processes_probe_costs_it_nothing(tmp_path) -> None:
    """The disks probe runs after the processes probe in the lane (the job's cwd and written
    files are its paths). A processes probe slower than the handoff: disks, handed a thread of
    its own, waits for it and still measures the job's cwd. One stuck past its deadline: disks
    goes on with the static paths, and while it stays stuck (`busy`) disks does not wait."""
    import subprocess

    cwd = tmp_path / "jobcwd"
    cwd.mkdir()
    job = subprocess.Popen(["sleep", "30"], cwd=cwd)
    c = Collector(Target(pids=(job.pid,), outputs=tmp_path / "out"), gpu=False, deadline_s=1.0,
                  use_inotify=False)
    real, gate, mode = c.processes.collect, threading.Event(), ["slow"]

    def processes():
        if mode[0] == "slow":
            time.sleep(0.5)  # past the handoff (a quarter of 1 s), within the deadline
        elif mode[0] == "stuck":
            gate.wait(30)
        return real()

    c.processes.collect = processes
    try:
        statuses = lambda snap: {r.name: r.status for r in snap.probes}  # noqa: E731
        snap = c.tick()
        assert statuses(snap)["processes"] == ProbeStatus.ok
        assert str(cwd) in {p.path for p in snap.disks.paths}
        mode[0] = "stuck"
        t0 = time.monotonic()
        snap = c.tick()
        # one deadline (1 s), not the disks probe's longer one waited out for the stuck call
        assert time.monotonic() - t0 < 2.5
        assert statuses(snap)["processes"] == ProbeStatus.timeout
        assert statuses(snap)["disks"] == ProbeStatus.ok
        assert str(cwd) not in {p.path for p in snap.disks.paths}
        t0 = time.monotonic()
        snap = c.tick()
        assert statuses(snap)["processes"] == ProbeStatus.busy and statuses(snap)["disks"] == ProbeStatus.ok
        assert time.monotonic() - t0 < 0.9  # not waiting out the stuck call's deadline again
    finally:
        gate.set()
        job.kill()
        job.wait()
        c.close()


def test_a_probe_with_nothing_new_is_not_run_and_its_parts_are_reused_by_identity(monkeypatch):
    """No driver, no retry due: the gpu probe is not run at all (not even inline), and its
    observation and report are last tick's objects; once a retry is due it runs again."""
    import pynvml
    from fakes import FakeNvml

    from stallwatch.clock import FakeClock
    from stallwatch.kernel.nvml import Nvml

    clock = FakeClock()
    lib = FakeNvml([])
    lib.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    c = Collector(Target(name="x", pids=(os.getpid(),)), clock=clock,
                  nvml=Nvml(lib=lib, clock=clock, retry_after_s=60))
    runs: list[float] = []
    real = c.gpu.collect
    monkeypatch.setattr(c.gpu, "collect", lambda: runs.append(clock.monotonic()) or real())
    try:
        snaps = []
        for _ in range(4):
            snaps.append(c.tick())
            clock.advance(1.0)
        clock.advance(60.0)
        late = c.tick()
    finally:
        c.close()
    assert runs == [1000.0, 1064.0] and lib.init_calls == 2, runs
    first = snaps[0]
    assert first.gpu is not None and first.gpu.status == "no_driver"
    for s in snaps[1:]:
        assert s.gpu is first.gpu and s.probe("gpu") is first.probe("gpu")
        assert s.probe("gpu").status == "absent" and s.probe("processes") is not first.probe("processes")
    # The retry ran and got the same answer: still the same object, dated when first given.
    assert late.gpu is first.gpu and late.gpu.collected_at == first.t_wall


def test_the_unvalidated_snapshot_equals_a_validated_build():
    """Collector.tick builds its Snapshot with model_construct: the same parts validated give an
    equal model of the same types, and its JSON reads back equal."""
    from stallwatch.probes.snapshot import Snapshot

    c = Collector(Target(name="x", pids=(os.getpid(),)), gpu=True)
    try:
        snap = c.tick()
    finally:
        c.close()
    parts = {name: getattr(snap, name) for name in snap.model_fields_set}
    validated = Snapshot(**parts)
    assert snap == validated and snap.model_fields_set == validated.model_fields_set
    assert {n: type(getattr(snap, n)) for n in Snapshot.model_fields} == \
        {n: type(getattr(validated, n)) for n in Snapshot.model_fields}
    assert snap.model_dump_json() == validated.model_dump_json()
    assert Snapshot.model_validate_json(snap.model_dump_json()) == snap
    assert [r.name for r in snap.probes][:2] == ["processes", "gpu"] and snap.processes is not None
    for r in snap.probes:  # the runner's reports are unvalidated too
        again = type(r)(**{n: getattr(r, n) for n in r.model_fields_set})
        assert r == again and type(r.duration_s) is float and type(r.status) is type(again.status)


def test_run_inline_hands_back_the_last_report_for_the_same_value():
    from stallwatch.probes.base import run_inline

    obs = ProbeStatus  # any object: identity is what counts
    got = run_inline("x", lambda: obs)
    assert got[0] is obs and got[1].status == ProbeStatus.ok
    assert run_inline("x", lambda: obs, last=got) is got
    other = run_inline("x", lambda: object(), last=got)
    assert other is not got and other[1] is not got[1]
    failed = run_inline("x", lambda: 1 / 0, last=got)
    assert failed[0] is None and failed[1].status == ProbeStatus.error


def test_a_failed_inline_run_is_not_handed_on_as_unchanged():
    """A probe that says unchanged() after its last run raised is run again: the collector
    hands on only an observation it got."""

    class Flaky:
        name = "kmsg"

        def __init__(self) -> None:
            self.runs, self.fail = 0, False

        def unchanged(self) -> bool:
            return True

        def cannot_block(self) -> bool:
            return True

        def collect(self):
            self.runs += 1
            if self.fail:
                raise RuntimeError("a bug")
            return ("obs",)

    c = Collector(Target(name="x", pids=(os.getpid(),)), gpu=False)
    flaky = c.kmsg = Flaky()  # type: ignore[assignment]
    try:
        got = [c.tick().probe("kmsg") for _ in range(2)]
        assert flaky.runs == 1 and got[1] is got[0] and got[0].status == ProbeStatus.ok
        c._last["kmsg"] = (flaky, None, got[0])  # as after a run that raised
        flaky.fail = True
        assert c.tick().probe("kmsg").status == ProbeStatus.error and flaky.runs == 2
    finally:
        c.close()
