"""Properties of the default rules over simulated jobs (hypothesis).

Each example drives the REAL LogProbe with a FakeClock over a real log file: the simulated job
appends progress lines (plain `N/M` or tqdm redraws with `\\r`) at jittered times; the watcher
ticks on a 1 s grid like the daemon (`interval_s = 1.0`), builds a Snapshot with that LogObs and
a constructed process observation (one target process in R/S, or in D with the D-thread fields
set), and runs features() and the real default rules through one Evaluator with the fake times.

(a) healthy traces never yield a stall verdict (hang, io_stall, server_hang);
(b) stalls are always caught: within 30 s of the last progress for a base cadence <= 1 s,
    within the threshold (features.stall_threshold_s) + the rule's `for` for slower ones, and
    never before the threshold.

Grid ticks are skipped to keep slow cadences cheap (every dt = cadence/10 s, at most 15 s, is
kept, and all of these): the first tick that reads each line, the 3 ticks before each line, and
after a stall every tick from 3 s + dt before the threshold. Between two progress lines the stall
conditions only grow truer (idle_s rises, the threshold stays), so whether a stall verdict comes
before the next line is decided at the last ticks before it, as the daemon would decide it at
every tick; after a stall the ticks are dense, so its timing is the daemon's. (Checked against
dense runs on 150 random jobs: the same stall verdicts. Only `slow`, whose 30 s `for` needs every
tick, is not judged here.)

Parameters: base cadence 0.2-300 s (log-uniform), 6-40 intervals (healthy) or 6-30 (stalled),
jitter ±50 %, pauses 1-3 × the job's cadence and bursts of 2-6 lines (each step: 80 % normal,
10 % pause, 10 % burst; at most one burst in 10 steps), 0-3 lines of history before the watcher
starts, plain `N/M` or tqdm (redrawn at most every 0.1 s, as tqdm's mininterval), optional
30-150 s checkpoints with I/O moving and short D blips; stalls sit in S, or in D from 0-5 s
after the last line.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, assume, event, example, given, note, settings
from hypothesis import strategies as st

from stallwatch.clock import FakeClock
from stallwatch.engine.diagnose import load
from stallwatch.engine import Evaluator
from stallwatch.engine.features import CADENCE_MIN_SAMPLES, STALL_FLOOR_S, features
from stallwatch.probes.log import LogProbe
from stallwatch.probes.processes import IoObs, ProcessesObs, ProcessObs, ThreadObs
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.targets import Target

STALL_KINDS = {"hang", "io_stall", "server_hang"}
PID = 4242
TOTAL = 100_000
FOR_S = 2.0  # `for` of hang and io_stall in rules/20-stalls.toml (checked below)
CONTRACT_S = 30.0  # docs/contract.md: a <= 1 s cadence is classified within 30 s of its last progress
RULES = load()
# Modest by default (the suite runs on 2 cores); STALLWATCH_PROPERTY_EXAMPLES=2000 for a deep run.
SETTINGS = settings(max_examples=int(os.environ.get("STALLWATCH_PROPERTY_EXAMPLES", "60")),
                    deadline=None, phases=[p for p in Phase if p is not Phase.explain],
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def test_stall_rules_for_is_what_the_bounds_assume() -> None:
    for name in ("hang", "io_stall"):
        rule = RULES.get(name)
        assert rule is not None and rule.for_s == FOR_S, name


# ------------------------------------------------------------------------------- the job

@dataclass
class Job:
    """What the simulated job does: progress lines at times, and what its process looks like."""

    cadence: float
    fmt: str  # "fraction" or "tqdm"
    appends: list[float] = field(default_factory=list)  # times of progress lines, increasing
    history: int = 0  # how many of the first appends happened before the watcher started
    checkpoints: list[tuple[float, float]] = field(default_factory=list)  # (start, end): I/O moves
    d_blips: set[int] = field(default_factory=set)  # grid ticks with a short D (a normal write)
    stall_at: float | None = None  # last progress; then the process sits in `stall_state`
    stall_state: str = "S"
    d_delay: float = 0.0  # D starts this long after the last progress


def line(job: Job, i: int, t: float) -> str:
    done = i + 1
    if job.fmt == "fraction":
        return f"sample {done}/{TOTAL} written\n"
    elapsed = int(t - job.appends[0] + job.cadence)  # tqdm counts from its own start
    rate = done / max(elapsed, 1e-3)
    shown = f"{1 / rate:.2f}s/it" if rate < 1 else f"{rate:.2f}it/s"
    left = int((TOTAL - done) / rate)
    return (f"\rExtract: {done * 100 // TOTAL:3d}%|#         | {done}/{TOTAL} "
            f"[{elapsed // 60:02d}:{elapsed % 60:02d}<{left // 3600}:{left // 60 % 60:02d}:"
            f"{left % 60:02d}, {shown}]")


def thread(state: str, quiet: float, d_for: float) -> ThreadObs:
    blocked = state in ("S", "D")
    return ThreadObs(
        tid=PID, comm="python", state=state, state_since_s=quiet, d_state_for_s=d_for,
        ctx_unchanged_for_s=quiet, voluntary_ctxt_switches=10, nonvoluntary_ctxt_switches=5,
        utime_s=100.0, stime_s=10.0, cpu_delta_s=0.0 if blocked else 1.0,
        wchan={"S": "futex_wait_queue", "D": "folio_wait_bit_common"}.get(state),
        syscall={"S": "futex", "D": "write"}.get(state),
        syscall_file="/data/hs/part-00017.pt" if state == "D" else None,
        stack=("folio_wait_bit_common", "ext4_buffered_write_iter") if state == "D" else None,
        last_ran_age_s=quiet if blocked else 0.0)


def processes(state: str, quiet: float, d_for: float, io_unchanged: float, now: float
              ) -> ProcessesObs:
    th = thread(state, quiet, d_for)
    p = ProcessObs(
        pid=PID, ppid=1, pgid=PID, sid=PID, uid=1000, role="target", start_ticks=1,
        start_time=1.7e9, comm="python", argv=("python", "extract.py"),
        cmdline="python extract.py", cwd="/data", state=state, state_since_s=quiet,
        d_state_for_s=d_for, ctx_unchanged_for_s=quiet, last_ran_age_s=th.last_ran_age_s,
        tracked_for_s=now, wchan=th.wchan, voluntary_ctxt_switches=10,
        nonvoluntary_ctxt_switches=5, utime_s=100.0, stime_s=10.0, cpu_delta_s=th.cpu_delta_s,
        cpu_util=0.0 if state in ("S", "D") else 1.0, blkio_delay_s=None, rss_bytes=1 << 30,
        num_threads=1, io=IoObs(rchar=1, wchar=1, syscr=1, syscw=1, read_bytes=0,
                                write_bytes=0, cancelled_write_bytes=0),
        io_unchanged_for_s=min(io_unchanged, now), num_fds=12, threads=(th,))
    return ProcessesObs(targets=(PID,), processes=(p,))


# ---------------------------------------------------------------------------- the watcher

@dataclass
class Tick:
    t: float  # seconds since the watcher started
    idle: float  # log.idle_s as features saw it (-1: no progress yet)
    threshold: float
    why: str
    kind: str
    rule: str
    since_last: float | None  # seconds since the job's real last progress line


def simulate(job: Job, tmp: Path, end: float) -> list[Tick]:
    """Run the watcher on a 1 s grid from t = 0 to `end`; return the evaluated ticks."""
    clock = FakeClock(monotonic=1000.0, wall=1_700_000_000.0)
    t0 = clock.monotonic()
    log = tmp / "job.log"
    log.write_text("loading model\n")
    written = 0

    def write_upto(t: float) -> None:
        nonlocal written
        last = None
        with open(log, "a") as f:
            while written < len(job.appends) and job.appends[written] <= t:
                f.write(line(job, written, job.appends[written]))
                last = job.appends[written]
                written += 1
        if last is not None:
            wall = clock.time() - (clock.monotonic() - t0) + last
            os.utime(log, (wall, wall))

    first = job.appends[job.history - 1] if job.history else -1e9
    write_upto(min(0.0, first))  # history: written before the watcher's first look
    probe = LogProbe(log, clock=clock)
    evaluator = Evaluator(RULES)
    dt = max(1, min(15, int(job.cadence / 10)))
    ticks: list[Tick] = []
    threshold = math.inf
    appends = job.appends
    i = 0  # appends[:i] are at or before the current tick
    k = 0
    while k <= end:
        t = float(k)
        while i < len(appends) and appends[i] <= t:
            i += 1
        last = appends[i - 1] if i else None
        if job.stall_at is not None and ticks and t - job.stall_at > threshold + FOR_S + 10:
            break  # past the latest possible detection
        clock.set(t0 + t)
        write_upto(t)
        snap = Snapshot(t_mono=clock.monotonic(), t_wall=clock.time(), host="sim",
                        target=Target(pids=(PID,), log=log), log=probe.collect(),
                        processes=observe(job, t, k, last))
        v = features(snap)
        ev = evaluator.evaluate(v, snap.t_mono)
        assert not ev.errors, ev.errors
        threshold = v["stall_threshold_s"]
        ticks.append(Tick(t=t, idle=v["log"]["idle_s"], threshold=threshold,
                          why=v["stall_threshold_why"], kind=ev.verdict.kind,
                          rule=ev.verdict.rule or "",
                          since_last=t - last if last is not None else None))
        k = next_tick(job, k, i, dt, threshold, end)
    return ticks


def next_tick(job: Job, k: int, i: int, dt: int, threshold: float, end: float) -> int:
    """The next grid tick whose verdict can differ from what skipping it would give."""
    appends = job.appends
    windows = [(math.ceil(end - 3), math.inf)]
    if i < len(appends):
        # the last ticks before the next line, and the first tick that reads it
        windows.append((math.ceil(appends[i] - 3), math.ceil(appends[i])))
    if job.stall_at is not None:
        last = appends[i - 1] if i else 0.0
        windows.append((math.ceil(last + threshold - dt - 3), math.inf))
    k1 = k + 1
    if any(a <= k1 <= b for a, b in windows):
        return k1
    return max(k1, min([(k // dt + 1) * dt] + [a for a, _ in windows if a > k]))


def observe(job: Job, t: float, k: int, last: float | None) -> ProcessesObs:
    since = t - last if last is not None else t
    io_age = since
    for start, stop in job.checkpoints:
        if start <= t:
            io_age = min(io_age, max(0.0, t - stop) if t >= stop else 0.3)
    if job.stall_at is not None and t >= job.stall_at:
        quiet = t - job.stall_at
        if job.stall_state == "D" and quiet >= job.d_delay:
            return processes("D", quiet - job.d_delay, quiet - job.d_delay, io_age, t)
        return processes("S", quiet, 0.0, io_age, t)
    if k in job.d_blips:
        return processes("D", 0.2, 0.2, io_age, t)
    return processes("R" if since < 1 else "S", min(since, 0.5), 0.0, io_age, t)


# ------------------------------------------------------------------------------ strategies

# Base cadence 0.2 s .. 300 s, spread evenly on a log scale.
cadences = st.floats(math.log(0.2), math.log(300.0)).map(lambda x: round(math.exp(x), 3))
steps = st.tuples(
    st.floats(-0.5, 0.5),                                          # jitter of this interval
    st.sampled_from(["normal"] * 8 + ["pause", "burst"]),          # what happens
    st.floats(1.0, 3.0),                                           # pause: × the cadence
    st.integers(2, 6),                                             # burst: lines at once
)
BURST_EVERY = 10  # bursts are occasional: at most one in this many steps (see the xfail below)


def build(cadence: float, fmt: str, plan: list, history: int, start: float) -> Job:
    """Progress lines: jittered intervals (±50 %), pauses of up to 3 × the job's cadence (the
    median of its intervals so far: a job whose every interval came out 50 % short has a shorter
    cadence than its nominal one), occasional bursts of lines a few ms apart."""
    job = Job(cadence=cadence, fmt=fmt)
    t = start - history * cadence
    normal: list[float] = []
    since_burst = BURST_EVERY
    for jitter, what, pause, burst in plan:
        since_burst += 1
        if what == "pause":
            gap = pause * (sorted(normal)[len(normal) // 2] if normal else cadence)
        else:
            gap = cadence * (1 + jitter)
            normal.append(gap)
        t += gap
        job.appends.append(round(t, 3))
        if what == "burst" and since_burst >= BURST_EVERY:
            since_burst = 0
            for _ in range(burst - 1):
                t += min(0.05, cadence / 10)
                job.appends.append(round(t, 3))
    if fmt == "tqdm":  # tqdm redraws at most every mininterval (0.1 s): a burst is one bar
        kept: list[float] = []
        for a in job.appends:
            if not kept or a - kept[-1] >= 0.1:
                kept.append(a)
        job.appends = kept
    job.history = sum(1 for a in job.appends if a <= 0)
    return job


def progress_ticks(job: Job) -> int:
    """How many of the watcher's grid ticks read new progress."""
    return len({math.ceil(a) for a in job.appends if a > 0})


@st.composite
def healthy_jobs(draw) -> Job:
    cadence = draw(cadences)
    plan = draw(st.lists(steps, min_size=6, max_size=40))
    job = build(cadence, draw(st.sampled_from(["fraction", "tqdm"])), plan,
                history=draw(st.integers(0, 3)), start=draw(st.floats(0.0, 5.0)))
    # A checkpoint: after a normal interval of work the job writes for 30-150 s (its I/O
    # counters move, the progress line stands still), then logs its progress.
    if draw(st.booleans()) and len(job.appends) > 2:
        i = draw(st.integers(max(1, job.history), len(job.appends) - 1))
        length = draw(st.floats(30.0, 150.0))
        start = job.appends[i]
        job.appends = job.appends[:i] + [round(a + length + 0.5, 3) for a in job.appends[i:]]
        job.checkpoints.append((start, start + length))
    if draw(st.booleans()):
        end = int(job.appends[-1]) + 1
        job.d_blips = set(draw(st.lists(st.integers(0, end), max_size=10)))
    return job


@st.composite
def stalled_jobs(draw) -> Job:
    cadence = draw(cadences)
    plan = draw(st.lists(steps, min_size=6, max_size=30))
    job = build(cadence, draw(st.sampled_from(["fraction", "tqdm"])), plan,
                history=draw(st.integers(0, 3)), start=draw(st.floats(0.0, 5.0)))
    # The watcher has timed enough intervals to trust the cadence it learned (features.py).
    assume(progress_ticks(job) > CADENCE_MIN_SAMPLES)
    job.stall_at = job.appends[-1]
    job.stall_state = draw(st.sampled_from(["S", "D"]))
    job.d_delay = draw(st.floats(0.0, 5.0))
    return job


def describe(job: Job, ticks: list[Tick]) -> None:
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(job.appends)]
    note(f"cadence {job.cadence} s, {job.fmt}, history {job.history}, gaps {gaps}")
    note(f"checkpoints {job.checkpoints}, stall at {job.stall_at} in {job.stall_state}")
    note(f"first stall ticks: {[x for x in ticks if x.kind in STALL_KINDS][:3]}")


# -------------------------------------------------------------------------------- properties

@SETTINGS
@given(job=healthy_jobs())
# Found by this property (1 in a few hundred examples): the log's two lines were written by an
# earlier run, 40 and 20 s before this pid started; 4 s in, "done 2 ÷ 4 s since pid started"
# read as 0.5 a second and the 24 s of silence as a hang. A count older than the process is not
# its work (features.known_rate).
@example(job=Job(cadence=20.086, fmt="fraction",
                 appends=[-40.172, -20.086, 10.043, 30.129, 50.215, 70.301], history=2))
def test_healthy_traces_never_stall(job: Job, tmp_path_factory) -> None:
    ticks = simulate(job, tmp_path_factory.mktemp("healthy"), end=job.appends[-1] + 1)
    describe(job, ticks)
    # Before the watcher has seen one interval of the job (or enough of them), the threshold is
    # the default 120 s: a slower job may be called stalled then (test_known_* below), after
    # idle_s >= the threshold only. Once a cadence is learned, never.
    if any(x.rule == "working_without_progress" for x in ticks):
        event("a checkpoint outlasted the threshold: working_without_progress")
    if any(x.kind in STALL_KINDS for x in ticks):
        event("called stalled while the threshold was the default (warm-up)")
    for x in ticks:
        if x.kind in STALL_KINDS:
            assert x.why.startswith("default") and x.idle >= x.threshold, \
                f"a healthy job was called {x.kind} at {x}"


@SETTINGS
@given(job=stalled_jobs())
def test_stalls_are_caught_in_time_and_not_before(job: Job, tmp_path_factory) -> None:
    assert job.stall_at is not None
    ticks = simulate(job, tmp_path_factory.mktemp("stall"), end=job.stall_at + 4 * 3600.0 + 60)
    describe(job, ticks)
    expected = "io_stall" if job.stall_state == "D" else "hang"
    for x in ticks:
        if x.kind in STALL_KINDS:  # never before the threshold
            assert x.idle >= x.threshold, f"{x.kind} before the threshold: {x}"
    after = [x for x in ticks if x.t >= job.stall_at]
    caught = next((x for x in after if x.kind in STALL_KINDS), None)
    assert caught is not None, f"never caught; last tick {after[-1]}"
    assert caught.kind == expected, caught
    assert all(x.kind == expected for x in after if x.t >= caught.t), "once caught, it stays"
    assert not caught.why.startswith("default"), caught
    # The bound: the threshold + `for`, + up to 1 s until a tick reads the last line (idle_s
    # counts from that tick) + up to 1 s until the grid reaches the threshold.
    delay = caught.t - job.stall_at
    event(f"caught as {caught.kind}; cadence {'<= 1 s' if job.cadence <= 1 else '> 1 s'}")
    assert STALL_FLOOR_S <= delay < caught.threshold + FOR_S + 2.0, (delay, caught)
    if job.cadence <= 1.0:
        assert delay <= CONTRACT_S, (delay, caught)


# ------------------------------------------------------------------------- known limitations

@pytest.mark.xfail(strict=True, reason=(
    "known: before the watcher has timed one interval of a plain `N/M` log (no tqdm rate), the "
    "threshold is STALL_DEFAULT_S = 120 s, so a 5-minute job is called hang 122 s into its first "
    "interval; the contract's literal example (not stalled after 30 s) holds"))
def test_known_slow_job_is_not_stalled_before_its_first_interval(tmp_path) -> None:
    job = Job(cadence=300.0, fmt="fraction", appends=[0.5 + 300.0 * i for i in range(4)])
    ticks = simulate(job, tmp_path, end=job.appends[-1] + 1)
    assert next((x for x in ticks if x.kind in STALL_KINDS), None) is None


def test_a_job_logging_each_batch_as_a_burst_is_not_stalled_once_its_cadence_is_seen(tmp_path) -> None:
    """A job that logs its batch of 6 items at once every 5 minutes is silent for 5 minutes.

    The probe once learned (gap / items in the tick) = 50 s, a 250 s threshold, and called it
    hang every cycle. Before its first full interval the 120 s default applies (a documented
    limit, tested below), so the claim starts after the second burst.
    """
    job = Job(cadence=300.0, fmt="fraction",
              appends=[5.3 + 300.0 * c + 0.05 * j for c in range(8) for j in range(6)])
    ticks = simulate(job, tmp_path, end=job.appends[-1] + 1)
    learned = job.appends[6] + 1
    assert any(x.t > learned for x in ticks)
    assert next((x for x in ticks if x.t > learned and x.kind in STALL_KINDS), None) is None
