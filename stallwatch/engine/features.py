"""From one Snapshot to the variables the rules see: a pure function, so replays are exact.

The probes already computed every duration (d_state_for_s, idle_s, ...) with the injected
clock; here we only aggregate and name things so conditions stay short and stateless. Every
top-level key is always present and unknown numbers are -1 with a `*_known` flag, because CEL
raises on a missing key or a null in a comparison.

Evidence lines need concrete things (pid, tid, wchan, file, mount, device), so the "worst"
thread, socket or path is picked here and exposed as flat fields; per-thread lists are kept for
`each` evidence.

The parts, one module each: features_job (the job, its processes, threads and ranks, the
client), features_io (log, outputs, disks, kernel log), features_gpu (GPUs, the server),
features_text (how numbers read). This module assembles them, and owns the stall threshold,
the pace and `activity`.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any
from collections.abc import Callable

from stallwatch.engine.serverfate import server_busy, server_fate
from stallwatch.probes.base import ProbeReport
from stallwatch.probes.log import Cadence
from stallwatch.probes.processes import ProcessObs
from stallwatch.probes.snapshot import Snapshot
from stallwatch.engine.features_text import human_bytes, human_s
from stallwatch.engine.features_job import _client, _job_all, _port_of, _proc
from stallwatch.engine.features_gpu import _gpu, _pcis_of, _pipeline_gpus, _ranks, _server
from stallwatch.engine.features_io import _bar_vars, _disk, _kernel, _log, _outputs

__all__ = ["ACTIVITY_WINDOW_S", "CADENCE_MIN_SAMPLES", "STALL_FLOOR_S", "features", "human_bytes",
           "human_s", "known_rate", "pace", "stall_threshold_s"]


# The job's own cadence is learned; these bound it. A job progressing every second is called
# stalled STALL_FLOOR_S after its last progress (plus the rule's `for`), inside the contract's
# 30 s. Peers (NVIDIA Resiliency Extension) use max interval × 5; we take the larger of 5 × p90
# and 2 × max so one long checkpoint pause stretches the threshold without dominating it.
STALL_FLOOR_S = 20.0
STALL_CEILING_S = 4 * 3600.0
STALL_DEFAULT_S = 120.0  # progress seen but no cadence learned yet
CADENCE_P90_FACTOR = 5.0
CADENCE_MAX_FACTOR = 2.0
# Intervals timed by the log probe before a learned cadence may lower the threshold: one or two
# can be a burst of lines straddling a tick (a 5-minute job once read as a 0.2 s "cadence").
CADENCE_MIN_SAMPLES = 5
# "Making progress" is said only of a last progress younger than this many mean intervals (and
# at least RECENT_MIN_S, a tick or two of slack); older but under the threshold, the summary says
# how long it has been and how fast the job went before.
PACE_RECENT_FACTOR = 5.0
RECENT_MIN_S = 5.0

# How recent a sign of work must be to count as "working without log progress" (a checkpoint
# write moves I/O counters and output files while the progress line stands still).
ACTIVITY_WINDOW_S = 10.0


_CADENCE_FROM = {"log_timestamps": " from the log's timestamps", "tqdm_elapsed": " from tqdm's elapsed",
                 "tqdm_rate": " from tqdm's rate", "mixed": " (history and watched)", "observed": ""}


def stall_threshold_s(snap: Snapshot) -> tuple[float, str]:
    log = snap.log
    if log is None or log.progress is None:
        return STALL_DEFAULT_S, "default (no progress seen)"
    c = log.cadence_s
    if c is None or c.samples == 0:
        # No intervals: a rate says the mean interval; the p90 is taken as twice that.
        rate, source = known_rate(snap)
        if rate > 0:
            t = max(STALL_FLOOR_S, CADENCE_P90_FACTOR * 2.0 / rate)
            return min(t, STALL_CEILING_S), f"from the rate {rate:.3g}/s ({source})"
        return STALL_DEFAULT_S, "default (cadence not learned yet)"
    # What the rest reads; the same on most ticks (a learned cadence moves with new intervals
    # only), and formatting its floats was most of this function's cost: the last answer again.
    few = c.source == "observed" and c.samples < CADENCE_MIN_SAMPLES  # then tqdm's rate counts
    key = (*_CADENCE_READS(c), log.tqdm_rate_per_s if few else None)
    global _THRESHOLD_MEMO
    memo = _THRESHOLD_MEMO  # one read of an immutable pair: see _PROBES_MEMO
    if key == memo[0]:
        return memo[1]
    _THRESHOLD_MEMO = (key, found := _threshold(c, log.tqdm_rate_per_s))
    return found


_CADENCE_READS = attrgetter("p90_s", "max_s", "samples", "source", "outliers", "last_outlier_s")
_THRESHOLD_MEMO: tuple[Any, Any] = (None, None)  # (what _threshold read, its answer)


def _threshold(c: Cadence, tqdm_rate: float | None) -> tuple[float, str]:
    t = max(STALL_FLOOR_S, CADENCE_P90_FACTOR * c.p90_s, CADENCE_MAX_FACTOR * c.max_s)
    if c.source == "observed" and c.samples < CADENCE_MIN_SAMPLES:
        # A few intervals we timed ourselves may be one burst of lines (a batch logging each
        # item): they may raise the threshold, never lower it below tqdm's rate or the default.
        if tqdm_rate and tqdm_rate > 0:
            low, why = max(STALL_FLOOR_S, CADENCE_P90_FACTOR * 2.0 / tqdm_rate), f"from the rate {tqdm_rate:.3g}/s"
        else:
            low, why = STALL_DEFAULT_S, "default"
        if t < low:
            return min(low, STALL_CEILING_S), f"{why} ({c.samples} intervals are too few to trust {t:.3g} s)"
    why = (f"5 × p90 {c.p90_s:.3g} s, 2 × max {c.max_s:.3g} s of {c.samples} intervals"
           f"{_CADENCE_FROM[c.source]}")
    if c.last_outlier_s is not None and c.last_outlier_s > c.max_s:
        why += f"; {c.outliers} longer gap(s) left out (last {c.last_outlier_s:.3g} s: a one-off)"
    return min(t, STALL_CEILING_S), why


def known_rate(snap: Snapshot) -> tuple[float, str]:
    """Progress per second before now, and where that came from; (-1, "") when nothing says.

    In order of trust: what we measured, tqdm's own rate, the log's timestamps over its history,
    and last the done count over the time the job's process has been running (its start time
    in /proc), at first sight only: that one is an average over the whole run, and high for a
    job that resumed at a count it did not make in this process, so it comes last."""
    log = snap.log
    if log is None or log.progress is None:
        return -1.0, ""
    if log.rate_per_s:
        return log.rate_per_s, "the progress watched"
    if log.tqdm_rate_per_s:
        return log.tqdm_rate_per_s, "tqdm's rate"
    if log.history_rate_per_s:
        return log.history_rate_per_s, (f"{log.history_lines} progress lines over "
                                        f"{log.history_span_s:.3g} s of the log's timestamps")
    if log.idle_source == "observed":
        # We have watched progress move (or the daemon restarted the job: its done count then
        # includes what the last run made, and a resumed slow job would read as fast): the
        # watched intervals decide, or the default until there are some.
        return -1.0, ""
    done = float(log.progress.done)
    procs = snap.processes.processes if snap.processes else ()
    main = next((p for p in procs if p.role == "target" and p.state not in ("Z", "X")), None)
    ran_s = snap.t_wall - main.start_time if main else 0.0
    if log.idle_s is not None and log.idle_s > ran_s:
        # The last progress is older than the process: the count is an earlier run's (a job
        # resumed with its log appended to), none of it made in the ran_s this one has run.
        return -1.0, ""
    if main is not None and done > 0 and ran_s > 0:
        return done / ran_s, f"done {done:.0f} ÷ {ran_s:.0f} s since pid {main.pid} started"
    return -1.0, ""


def pace(snap: Snapshot, rate: float, rate_source: str) -> dict[str, Any]:
    """How fast the job went before, and whether its last progress is recent for that pace:
    what a summary says instead of "is making progress" when the silence outlasts the pace."""
    log = snap.log
    c = log.cadence_s if log else None
    if rate <= 0 and c is not None and c.samples >= CADENCE_MIN_SAMPLES and c.median_s > 0:
        rate = 1.0 / c.median_s
        rate_source = f"the median of {c.samples} intervals{_CADENCE_FROM[c.source]}"
    known = rate > 0
    idle = log.idle_s if log is not None and log.idle_s is not None else None
    horizon = max(RECENT_MIN_S, PACE_RECENT_FACTOR / rate) if known else RECENT_MIN_S
    said = f"no progress for {human_s(idle or 0.0)}" + (
        f"; it made {_pace_text(rate)} before" if known else "; its pace before is not known")
    return {"known": known, "per_s": rate if known else -1.0,
            "interval_s": 1.0 / rate if known else -1.0, "source": rate_source if known else "",
            "text": _pace_text(rate), "recent": idle is not None and idle <= horizon,
            "silence_text": said}


def _pace_text(per_s: float) -> str:
    """`~20 a second`, `~3 a minute`, `one every ~12 min`."""
    if per_s <= 0:
        return ""
    if per_s >= 1:
        return f"~{per_s:.2g} a second" if per_s < 10 else f"~{per_s:.0f} a second"
    if per_s * 60 >= 1:
        return f"~{per_s * 60:.2g} a minute"
    return f"one every ~{human_s(1.0 / per_s)}"


def features(snap: Snapshot) -> dict[str, Any]:
    procs = list(snap.processes.processes) if snap.processes else []
    threshold, threshold_why = stall_threshold_s(snap)
    job_pids = {p.pid for p in procs}
    mine = _pipeline_gpus(snap, job_pids)  # the GPUs gpu_fault looks at (None: all of them)
    status, errors = _probes(snap.probes)
    # Built in dependency order, then assembled in the variables' order (which the JSON keeps).
    log = _log(snap)
    log["pace"] = pace(snap, *known_rate(snap))
    log.update(_bar_vars(snap, threshold))
    proc = _proc(procs)
    server, client = _server_client(snap, procs)
    v: dict[str, Any] = {
        "now_wall": snap.t_wall,
        "stall_threshold_s": threshold,
        "stall_threshold_why": threshold_why,
        "job": _job_all(snap, procs, log),
        "proc": proc,
        "log": log,
        "outputs": _outputs(snap),
        "gpu": _kept("gpu", snap.gpu, (job_pids, mine), snap.gpu is None or not snap.gpu.xid_events,
                     lambda: _gpu(snap, job_pids, mine)),
        "server": server,
        "client": client,
        "disk": _disk(snap, proc["d"]["file"]),
        # With no kernel event the part reads nothing but the observation's status.
        "kernel": _kept("kernel", snap.kernel, (), snap.kernel is None or not snap.kernel.events,
                        lambda: _kernel(snap, procs, _pcis_of(snap, mine))),
        "probes": status,
        "probe_errors": errors,
    }
    v["activity"] = _activity(v)
    return v


def _probes(reports: tuple[ProbeReport, ...]) -> tuple[dict[str, str], list[str]]:
    """Each probe's status, and the errors of those that failed; the last tick's objects again
    while the names and statuses read the same and none failed (then no error is said)."""
    names, values = tuple(map(_NAME, reports)), tuple(map(_STATUS, reports))  # in C
    global _PROBES_MEMO
    last = _PROBES_MEMO
    if values == last[1] and names == last[0] and _QUIET.issuperset(values):
        return last[2], last[3]
    status = dict(zip(names, values, strict=True))
    errors = [f"{r.name}: {status[r.name]}: {r.error}" for r in reports
              if status[r.name] not in _QUIET and r.error]
    _PROBES_MEMO = (names, values, status, errors)
    return status, errors


_NAME = attrgetter("name")
_STATUS = attrgetter("status._value_")  # an Enum's .value is a Python property; _value_ is not
_QUIET = frozenset(("ok", "absent"))  # statuses that say no error
# (names, statuses, the status dict, the errors): read-only for callers. Every memo of the
# features is an immutable tuple, read once and replaced whole: features() may run in several
# threads at once (a replay per thread, tests/test_specforge_live.py), and a memo changed in
# place between its check and its read handed one thread another's answer.
_PROBES_MEMO: tuple[Any, ...] = (None, None, None, None)


def _server_client(snap: Snapshot, procs: list[ProcessObs]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The server's variables (its fate and whether it is busy last) and the client's."""
    s = snap.server
    quiet = s is None and snap.server_processes is None and snap.server_log is None
    port = s.port if s else _port_of(snap.target.server)
    client = _client(procs, port)
    if quiet and _NO_SERVER:
        # No server, no server processes, no server log: the server's part reads nothing else
        # (its ranks, their GPUs and the watchdog's deadline need scheduler processes), so it
        # is one dict, the same every tick.
        return _NO_SERVER[0], client
    server = {**_server(snap), **_ranks(snap)}
    server.update(server_fate(snap, server, client))
    server["busy"] = server_busy(server, client)
    if quiet:
        _NO_SERVER.append(server)
    return server, client


_NO_SERVER: list[dict[str, Any]] = []  # read-only for callers: shared between ticks and jobs


# ------------------------------------------------------------------------ parts handed on as is

# A part's last observation (by identity), the other inputs it was made of, and the dict made:
# the collector hands on the same observation while nothing it reads changed (gpu without
# NVML, a quiet kmsg), and then the part costs nothing here. The dict is shared between ticks:
# nothing may change it in place (nothing here does; the rules and the history only read).
# Keyed by part alone: several jobs of one daemon each hold their own observations, so they
# take turns in the slot, which costs a rebuild, never a wrong part.
_LAST: dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}


def _kept(part: str, obs: Any, inputs: tuple[Any, ...], timeless: bool,
          make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`make()`, or the last one again while `obs` is the same object, `inputs` are equal and
    the part does not depend on the time (`timeless`: no event that ages out)."""
    last = _LAST.get(part)
    if timeless and last is not None and last[0] is obs and obs is not None and last[1] == inputs:
        return last[2]
    value = make()
    if timeless:
        _LAST[part] = (obs, inputs, value)
    else:
        _LAST.pop(part, None)
    return value


# ------------------------------------------------------------------------------------- activity

def _activity(v: dict[str, Any]) -> dict[str, Any]:
    """Signs of work other than log progress: a checkpoint write, outputs appearing.

    "I/O counters unchanged for 2 s" after watching for 2 s says nothing; only a change we saw
    counts, so the first look of a one-shot diagnosis never calls a frozen job "working".
    """
    ages: list[tuple[float, str]] = []
    pr = v["proc"]
    if pr["io_known"] and pr["io_unchanged_s"] < pr["tracked_s"]:
        ages.append((pr["io_unchanged_s"], "I/O counters"))
    if v["outputs"]["present"] and v["outputs"]["change_age_s"] >= 0:
        ages.append((v["outputs"]["change_age_s"], "outputs"))
    if v["server"]["busy"]:  # the job waits on a server whose every rank is computing
        ages.append((0.0, "the server's ranks"))
    # CPU alone is not counted as work: a busy loop spins without progress, and that is a hang.
    age, what = min(ages, default=(-1.0, ""))
    # A stopped job (every process in T) works no more, whatever moved just before it stopped.
    return {"known": bool(ages), "age_s": age, "what": what,
            "working": bool(ages) and 0 <= age < ACTIVITY_WINDOW_S and not v["job"]["stopped"]}


def forget() -> None:
    """Drop every part kept from earlier ticks (the next features() builds all afresh): what the
    tests compare reuse against."""
    from stallwatch.engine import features_gpu, features_io, features_job

    _LAST.clear()
    global _PROBES_MEMO, _THRESHOLD_MEMO
    _PROBES_MEMO = (None, None, None, None)
    _THRESHOLD_MEMO = (None, None)
    _NO_SERVER.clear()
    features_io._DISK_MEMO = (None, None)
    features_job._PROC_MEMO = (None, "", None, None)
    features_job._JOB_MEMO = (None, None)
    features_job._STACK_MEMO = (None, "")
    features_gpu._NO_GPU_MEMO = (None, {})
    features_gpu._DEVICES_MEMO = ((), None, None, {})
