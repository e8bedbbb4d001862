"""From one Snapshot to the variables the rules see: a pure function, so replays are exact.

The probes already computed every duration (d_state_for_s, idle_s, ...) with the injected
clock; here we only aggregate and name things so conditions stay short and stateless. Every
top-level key is always present and unknown numbers are -1 with a `*_known` flag, because CEL
raises on a missing key or a null in a comparison.

Evidence lines need concrete things (pid, tid, wchan, file, mount, device), so the "worst"
thread, socket or path is picked here and exposed as flat fields; per-thread lists are kept for
`each` evidence.
"""

from __future__ import annotations

import signal as _signal
from typing import Any

from stallwatch.probes.processes import ProcessObs, ThreadObs
from stallwatch.engine.serverfate import server_busy, server_fate
from stallwatch.sglang.titles import parse_title
from stallwatch.probes.snapshot import Snapshot

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
RECENT_EVENT_S = 900.0  # kernel and Xid events older than this are history, not the present

APPLICATION_XIDS = {13, 31, 43, 45}

WAIT_SYSCALLS = {"recvfrom", "recvmsg", "recvmmsg", "read", "readv", "poll", "ppoll", "select",
                 "pselect6", "epoll_wait", "epoll_pwait", "epoll_pwait2", "futex"}
SOCKET_READ_SYSCALLS = {"recvfrom", "recvmsg", "recvmmsg", "read", "readv"}


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
    t = max(STALL_FLOOR_S, CADENCE_P90_FACTOR * c.p90_s, CADENCE_MAX_FACTOR * c.max_s)
    if c.source == "observed" and c.samples < CADENCE_MIN_SAMPLES:
        # A few intervals we timed ourselves may be one burst of lines (a batch logging each
        # item): they may raise the threshold, never lower it below tqdm's rate or the default.
        rate = log.tqdm_rate_per_s
        if rate and rate > 0:
            low, why = max(STALL_FLOOR_S, CADENCE_P90_FACTOR * 2.0 / rate), f"from the rate {rate:.3g}/s"
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
    if done > 0 and ran_s > 0:
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
    threads = [(p, t) for p in procs for t in p.threads]
    threshold, threshold_why = stall_threshold_s(snap)
    server_port = snap.server.port if snap.server else _port_of(snap.target.server)
    job_pids = {p.pid for p in procs}
    mine = _pipeline_gpus(snap, job_pids)  # the GPUs gpu_fault looks at (None: all of them)
    v: dict[str, Any] = {
        "now_wall": snap.t_wall,
        "stall_threshold_s": threshold,
        "stall_threshold_why": threshold_why,
        "job": _job(snap, procs),
        "proc": _proc(procs, threads),
        "log": {**_log(snap), "pace": pace(snap, *known_rate(snap))},
        "outputs": _outputs(snap),
        "gpu": _gpu(snap, job_pids, mine),
        "server": {**_server(snap), **_ranks(snap)},
        "client": _client(procs, threads, server_port),
        "disk": _disk(snap),
        "kernel": _kernel(snap, procs, _pcis_of(snap, mine)),
        "probes": {r.name: r.status.value for r in snap.probes},
        "probe_errors": [f"{r.name}: {r.status.value}: {r.error}" for r in snap.probes
                         if r.status.value not in ("ok", "absent") and r.error],
    }
    v["log"].update(_bar_vars(snap, threshold))
    v["job"].update(_job_ranks(procs, v["log"], f"{v['job']['comm']} (pid {v['job']['pid']})"))
    v["server"].update(server_fate(snap, v["server"], v["client"]))
    v["server"]["busy"] = server_busy(v["server"], v["client"])
    v["disk"].update(_io_place(snap, v["proc"]["d"]["file"]))
    v["activity"] = _activity(v)
    return v


# ------------------------------------------------------------------------------------- the job

def _job(snap: Snapshot, procs: list[ProcessObs]) -> dict[str, Any]:
    po = snap.processes
    targets = [p for p in procs if p.role == "target"]
    live = [p for p in targets if p.state not in ("Z", "X")]
    exits = [e for e in (po.exited if po else ()) if e.role == "target"]
    zombies = [p for p in targets if p.state == "Z"]
    # A pid the user named that no longer exists is a job that has exited: diagnose it from
    # what outlives a process (the log, the kernel's OOM line, the outputs).
    missing = list(po.missing) if po else []
    main = targets[0] if targets else None
    codes = [e.returncode for e in exits if e.returncode is not None]
    codes += [p.exit_code for p in zombies if p.exit_code is not None]  # readable until reaped
    ever_seen = bool(targets or exits or missing)
    exited = ever_seen and not live
    rc = None
    if codes:
        bad = [c for c in codes if c != 0]
        rc = bad[0] if bad else 0
    last = exits[-1] if exits else None
    pid = main.pid if main else (last.pid if last else (missing[0] if missing else -1))
    return {
        "name": snap.target.name,
        "seen": ever_seen,
        "alive": bool(live),
        "exited": exited,
        "exit_known": rc is not None,
        "exit_code": rc if rc is not None and rc >= 0 else -1,
        "signal": -rc if rc is not None and rc < 0 else 0,
        "signal_name": _signame(-rc) if rc is not None and rc < 0 else "",
        "exited_for_s": last.exited_for_s if last else 0.0,
        "exited_pids": [e.pid for e in exits] + missing,
        "stopped": bool(live) and all(p.state in ("T", "t") for p in live),
        "pid": pid,
        "pids": [p.pid for p in procs],
        "comm": main.comm if main else _last_name(exits, missing),
        "cmdline": main.cmdline if main else ((last.cmdline or "") if last else ""),
        "missing": missing,
        "reused": list(po.reused) if po else [],
    }


def _last_name(exits: list, missing: list[int]) -> str:
    """The name the job's process was last known by once it is gone: the latest exit that
    carries one (a waitpid report of a process no tick saw has none of its own), else "the
    job", so that a crash never reads "crash:  (pid N)"."""
    named = [e.comm for e in exits if e.comm]
    return named[-1] if named else ("the job" if exits or missing else "")


def _signame(n: int) -> str:
    try:
        return _signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


# ----------------------------------------------------------------------------- processes/threads

def _thread_dict(p: ProcessObs, t: ThreadObs) -> dict[str, Any]:
    return {
        "pid": p.pid, "tid": t.tid, "comm": t.comm, "state": t.state,
        "d_state_for_s": t.d_state_for_s, "state_since_s": t.state_since_s,
        "ctx_unchanged_for_s": t.ctx_unchanged_for_s,
        "quiet_s": _quiet(t.ctx_unchanged_for_s, t.last_ran_age_s),
        "wchan": t.wchan or "", "syscall": t.syscall or "", "file": t.syscall_file or "",
        "stack": " ← ".join((t.stack or ())[:6]),
    }


def _quiet(ctx_unchanged_for_s: float, last_ran_age_s: float | None) -> float:
    """How long the task has not run: what we watched, or what the scheduler remembers."""
    return max(ctx_unchanged_for_s, last_ran_age_s or 0.0)


def _proc(procs: list[ProcessObs], threads: list[tuple[ProcessObs, ThreadObs]]) -> dict[str, Any]:
    states: dict[str, int] = {}
    for _, t in threads:
        states[t.state] = states.get(t.state, 0) + 1
    d = [(p, t) for p, t in threads if t.state == "D"]
    def stuck(pt: tuple[ProcessObs, ThreadObs]) -> float:
        return _quiet(pt[1].ctx_unchanged_for_s, pt[1].last_ran_age_s)

    worst = max(d, key=stuck, default=None)
    # torchrun's agent polls its workers every few seconds (its I/O counters and threads move
    # while every rank is stuck): what it does is supervision, not the job's work.
    workers = [p for p in procs if not p.launcher] or procs
    io_known = [p.io_unchanged_for_s for p in workers if p.io_unchanged_for_s is not None]
    cpu = [p.cpu_util for p in procs if p.cpu_util is not None]
    live = [p for p in workers if p.state not in ("Z", "X")]
    tracked = min((p.tracked_for_s for p in live), default=0.0)
    # The tree is quiet when no thread of it has run: a lower bound from the scheduler works
    # in a one-shot diagnosis, where we have watched for a few seconds only.
    quiet = min((_quiet(p.ctx_unchanged_for_s, p.last_ran_age_s) for p in live), default=0.0)
    main = next(((p, t) for p, t in threads if p.role == "target" and t.tid == p.pid), None)
    spin = spinning(threads)
    return {
        "count": len(procs),
        "threads": len(threads),
        "states": states,
        "states_text": ", ".join(f"{n} {s}" for s, n in sorted(states.items(), key=lambda kv: -kv[1])),
        "main": _thread_dict(*main) if main else _thread_dict_empty(),
        "running": states.get("R", 0),
        "spinning": len(spin),
        "spin_list": spin,
        "d_threads": len(d),
        "d_max_s": worst[1].d_state_for_s if worst else 0.0,
        "d": _thread_dict(*worst) if worst else _thread_dict_empty(),
        "d_list": [_thread_dict(p, t) for p, t in sorted(d, key=stuck, reverse=True)],
        "d_stuck_s": max((min(t.d_state_for_s, t.ctx_unchanged_for_s) for _, t in d), default=0.0),
        # A thread in D does not run: the scheduler's last-run age is how long it has been stuck,
        # even before we started watching.
        "d_quiet_s": stuck(worst) if worst else 0.0,
        "io_known": bool(io_known),
        "io_unchanged_s": min(io_known) if io_known else -1.0,
        "cpu_util": sum(cpu),
        "cpu_known": bool(cpu),
        "quiet_s": quiet,
        "tracked_s": tracked,
        "rss_bytes": sum(p.rss_bytes or 0 for p in procs),
        "list": [{"pid": p.pid, "ppid": p.ppid, "state": p.state, "comm": p.comm,
                  "wchan": p.wchan or "", "threads": p.num_threads, "role": p.role}
                 for p in procs],
    }


# A thread runnable in every sample of at least this long a stretch, never switching out by
# itself, is spinning. Two samples at diagnose's 0.75 s interval; the daemon ticks slower.
SPIN_MIN_S = 1.0


def spinning(threads: list[tuple[ProcessObs, ThreadObs]]) -> list[dict[str, Any]]:
    """Threads that never left the run queue while watched (probes/runqueue.py), longest first.
    Judged by runnability, not by the CPU share the scheduler happened to give them."""
    out = []
    for p, t in threads:
        rq = t.runqueue
        # R in every sample and no voluntary switch (it never blocked) is the kernel's word that
        # it never left the run queue; the schedstat shares are evidence, not a gate: they are
        # timed against our clock, which a loaded node delays.
        if rq is None or rq.samples < 2 or rq.runnable_for_s < SPIN_MIN_S:
            continue
        cpu, wait = rq.cpu_share or 0.0, rq.wait_share
        user = rq.user_share
        out.append({
            "pid": p.pid, "tid": t.tid, "comm": t.comm, "runnable_s": rq.runnable_for_s,
            "samples": rq.samples, "cpu_pct": round(cpu * 100.0),
            "wait_pct": round(wait * 100.0) if wait is not None else -1,
            "user_pct": round(user * 100.0) if user is not None else -1,
            "text": (f"tid {t.tid} ({t.comm}) runnable in all {rq.samples} samples over "
                     f"{rq.runnable_for_s:.1f} s with no voluntary context switch: it never left "
                     f"the run queue; it got {cpu * 100.0:.0f}% of a core"
                     + (f" and waited for a CPU {wait * 100.0:.0f}% of the time" if wait is not None
                        else "")
                     + (f", {user * 100.0:.0f}% of it in user space" if user is not None else "")),
        })
    out.sort(key=lambda d: -d["runnable_s"])
    return out


def _thread_dict_empty() -> dict[str, Any]:
    return {"pid": -1, "tid": -1, "comm": "", "state": "", "d_state_for_s": 0.0,
            "state_since_s": 0.0, "ctx_unchanged_for_s": 0.0, "quiet_s": 0.0, "wchan": "",
            "syscall": "", "file": "", "stack": ""}


# -------------------------------------------------------------------------------- log, outputs

def _log(snap: Snapshot) -> dict[str, Any]:
    log = snap.log
    present = log is not None and log.status.value == "ok"
    pr = log.progress if log else None
    tb = log.traceback if log else None
    fatal = log.fatal if log else ()
    total = pr.total if pr and pr.total else None
    return {
        "configured": log is not None,
        "present": present,
        "path": log.path if log else "",
        "status": log.status.value if log else "absent",
        "has_progress": pr is not None,
        "done": float(pr.done) if pr else -1.0,
        "total": float(total) if total else -1.0,
        "total_known": total is not None,
        "complete": bool(pr and total and pr.done >= total),
        "fraction": float(pr.done) / total if pr and total else -1.0,
        "idle_s": log.idle_s if log and log.idle_s is not None else -1.0,
        "idle_known": bool(log and log.idle_s is not None),
        "idle_source": (log.idle_source or "") if log else "",
        "growth_age_s": log.last_growth_age_s if log and log.last_growth_age_s is not None else -1.0,
        "cadence_p90_s": log.cadence_s.p90_s if log and log.cadence_s else -1.0,
        "cadence_max_s": log.cadence_s.max_s if log and log.cadence_s else -1.0,
        "rate_per_s": (log.rate_per_s if log and log.rate_per_s is not None else
                       (log.tqdm_rate_per_s if log and log.tqdm_rate_per_s is not None else -1.0)),
        "long_rate_per_s": _long_rate(pr),
        "eta_s": log.eta_s if log and log.eta_s is not None else -1.0,
        "last_line": (log.tail[-1] if log and log.tail else ""),
        "traceback": tb is not None,
        "exception": _exception_text(tb),
        "fatal": bool(fatal),
        "fatal_line": fatal[-1].line if fatal else "",
        "fatal_kind": fatal[-1].kind if fatal else "",
    }


def _bar_vars(snap: Snapshot, threshold: float) -> dict[str, Any]:
    """Bars of several ranks in one log (bars.py): which stopped while the others went on.

    A bar is stalled when it has not moved for the stall threshold (or 3 x its own longest gap,
    whichever is longer: with N ranks the log's cadence is N times the bar's) and another bar
    moved after it or finished: the job as a whole may still progress, the rank does not."""
    log = snap.log
    bs = log.bars if log else None
    rc = log.root_cause if log else None
    out: dict[str, Any] = {
        "bar_count": len(bs.bars) if bs else 0, "bars": [], "bars_text": "",
        "bar_stalled": False, "bar_stalled_position": -1, "bar_stalled_s": -1.0,
        "bar_stalled_limit_s": -1.0, "bar_stalled_text": "",
        "failed_rank": rc.rank if rc else -1,
        "failed_pid": rc.pid if rc and rc.pid is not None else -1,
        "failed_exit_code": rc.exit_code if rc and rc.exit_code is not None else -1,
    }
    if not bs:
        return out
    out["complete"] = bs.complete
    bars = [{"position": b.position, "done": b.done, "total": b.total if b.total else -1.0,
             "samples": b.samples if b.samples is not None else -1, "idle_s": b.idle_s,
             "complete": b.complete, "text": _bar_text(b)} for b in bs.bars]
    out["bars"] = bars
    out["bars_text"] = "; ".join(f"position {b['position']}: {b['text']}" for b in bars)
    worst = None
    for b in bs.bars:
        if b.complete:
            continue
        limit = max(threshold, 3.0 * b.max_gap_s)
        others = [o for o in bs.bars if o is not b]
        went_on = any(o.complete or o.idle_s + 1.0 < b.idle_s for o in others)
        if b.idle_s >= limit and went_on and (worst is None or b.idle_s > worst[0].idle_s):
            worst = (b, limit)
    if worst is not None:
        b, limit = worst
        fin = [o.position for o in bs.bars if o is not b and o.complete]
        moving = [o.position for o in bs.bars if o is not b and not o.complete]
        parts = []
        if fin:
            parts.append(f"position(s) {_ranges(fin)} finished")
        if moving:
            parts.append(f"position(s) {_ranges(moving)} moved since")
        out.update(bar_stalled=True, bar_stalled_position=b.position, bar_stalled_s=b.idle_s,
                   bar_stalled_limit_s=limit,
                   bar_stalled_text=(f"the bar at position {b.position} stopped at {_bar_text(b)} "
                                     f"{b.idle_s:.0f} s ago while {' and '.join(parts)}"))
    return out


def _bar_text(b) -> str:
    total = f"/{b.total:g}" if b.total else ""
    samples = f" ({b.samples} samples)" if b.samples is not None else ""
    return f"{b.done:g}{total}{samples}" + (", complete" if b.complete else "")


def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    if len(xs) > 1 and xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}–{xs[-1]}" if len(xs) > 2 else f"{xs[0]} and {xs[1]}"
    return ", ".join(map(str, xs[:-1])) + f" and {xs[-1]}" if len(xs) > 1 else str(xs[0])


def _job_ranks(procs: list[ProcessObs], logv: dict[str, Any], who: str) -> dict[str, Any]:
    """A torchrun job: the agent and its ranks (torchrun.py), and the rank that holds the others
    up. Each rank says what it does; the culprit is the one with the strongest sign of its own
    trouble (stopped, in D, spinning, a file open half-written while asleep, its bar stopped);
    the others wait in the collective, or at the barrier once their bar is done."""
    ranked = sorted((p for p in procs if p.rank is not None), key=lambda p: p.rank.rank)
    launcher = next((p for p in procs if p.launcher), None)
    out: dict[str, Any] = {"torchrun": launcher is not None, "launcher_pid": launcher.pid if launcher else -1,
                           "ranks": [], "ranks_text": "", "culprit": False, "culprit_pid": -1,
                           "culprit_rank": -1, "culprit_text": "", "who": who}
    if not ranked:
        return out
    world = ranked[0].rank.world_size or len(ranked)
    bars = {b["position"]: b for b in logv.get("bars", [])}
    tp = world // len(bars) if bars and world % len(bars) == 0 else 1
    log_path = logv.get("path", "")
    rows = []
    # never left the run queue (probes/runqueue.py): spinning whatever share of a core it got;
    # when every rank does (NCCL busy-waits), nobody stands out
    runnable = {p.pid: _runnable_s(p) for p in ranked}
    lone = sum(1 for v in runnable.values() if v) < len(ranked)
    for p in ranked:
        r = p.rank.rank
        bar = bars.get(r // tp) if r % tp == 0 else None
        others = max(((o.cpu_util or 0.0) for o in ranked if o is not p), default=0.0)
        score, what = _rank_trouble(p, log_path, others, runnable[p.pid] if lone else 0.0)
        if score == 0 and logv.get("bar_stalled") and bar is not None \
                and bar["position"] == logv["bar_stalled_position"]:
            score, what = 2, f"its bar stopped at {bar['text']}"
        if score == 0:
            what = ("finished its bar and waits at the barrier" if bar is not None and bar["complete"]
                    else "waits in the collective")
        rows.append({"rank": r, "local_rank": p.rank.local_rank if p.rank.local_rank is not None else -1,
                     "pid": p.pid, "state": p.state, "cpu_pct": round((p.cpu_util or 0.0) * 100.0),
                     "score": score, "what": what})
    out["ranks"] = rows
    top = max(rows, key=lambda x: x["score"])
    if top["score"] > 0:
        rest = [x for x in rows if x is not top]
        by_what: dict[str, list[int]] = {}
        for x in rest:
            by_what.setdefault(x["what"], []).append(x["rank"])
        others = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)} "
                           f"{_plural(w) if len(rs) > 1 else w}" for w, rs in by_what.items())
        out.update(culprit=True, culprit_pid=top["pid"], culprit_rank=top["rank"],
                   who=f"rank {top['rank']} (pid {top['pid']}) of the torchrun job",
                   culprit_text=f"rank {top['rank']} (pid {top['pid']}) {top['what']}"
                                + (f"; {others}" if others else ""))
    out["ranks_text"] = ", ".join(f"rank {x['rank']} pid {x['pid']} {x['state']}" for x in rows)
    return out


def _plural(what: str) -> str:
    """'finished its bar and waits at the barrier' → 'finished their bars and wait at the barrier'."""
    words = {"waits": "wait", "has": "have", "holds": "hold", "spins": "spin", "is": "are",
             "its": "their", "bar": "bars"}
    return " ".join(words.get(w, w) for w in what.split(" "))


# A rank that burns CPU while its siblings sleep spins: relative, never an absolute share (on a
# loaded host a busy loop gets a fraction of a core; gloo waits sleep at ~0 %). NCCL busy-waits
# make every waiting rank hot: then nobody stands out, and nobody is called spinning.
SPIN_MIN_CPU = 0.1
SPIN_OVER_OTHERS = 5.0


def _runnable_s(p: ProcessObs) -> float:
    """How long its longest-runnable thread never left the run queue (0: none did)."""
    return max((t.runqueue.runnable_for_s for t in p.threads if t.runqueue is not None
                and t.runqueue.samples >= 2 and t.runqueue.runnable_for_s >= SPIN_MIN_S),
               default=0.0)


def _rank_trouble(p: ProcessObs, log_path: str, others_cpu: float,
                  runnable_s: float = 0.0) -> tuple[int, str]:
    threads = p.threads
    if p.state in ("T", "t"):
        return 6, "is stopped (SIGSTOP or a debugger)"
    if p.state == "Z":
        return 5, "has exited and was not reaped"
    d = [t for t in threads if t.state == "D"]
    if d:
        t = d[0]
        on = f" on {t.syscall_file}" if t.syscall_file else ""
        return 5, f"has {len(d)} thread(s) in D (wchan {t.wchan or '?'}, syscall {t.syscall or '?'}{on})"
    cpu = p.cpu_util or 0.0
    if runnable_s:
        return 4, (f"spins at {round(cpu * 100)} % of a core (a thread never left the run queue "
                   f"for {runnable_s:.0f} s)")
    if cpu >= SPIN_MIN_CPU and cpu >= SPIN_OVER_OTHERS * others_cpu and any(t.state == "R" for t in threads):
        return 4, f"spins at {round(cpu * 100)} % of a core"
    writing = [f for f in p.open_files if f.write and f.fd > 2 and f.path.startswith("/")
               and not f.path.startswith(("/dev/", "/proc/", "/sys/")) and f.path != log_path
               and not f.path.endswith((".log", ".txt", ".out"))]
    if writing and all(t.state == "S" for t in threads):
        f = writing[0]
        futex = sum(1 for t in threads if t.syscall == "futex")
        lock = f" ({futex} in futex waits: a lock or a condition)" if futex else ""
        return 3, (f"holds {f.path} open for writing, half-written ({f.pos_bytes} bytes), "
                   f"and every thread sleeps{lock}")
    return 0, ""


def _long_rate(pr) -> float:
    """The job's average rate since it started, from tqdm's own elapsed time when it has one."""
    if pr is not None and pr.elapsed_s and pr.elapsed_s > 0:
        return float(pr.done) / pr.elapsed_s
    return -1.0


def _exception_text(tb) -> str:
    if tb is None:
        return ""
    return tb.exception or (tb.lines[-1] if tb.lines else "traceback")


def _outputs(snap: Snapshot) -> dict[str, Any]:
    o = snap.outputs
    ok = o is not None and o.status.value == "ok"
    return {
        "configured": o is not None,
        "present": ok,
        "path": o.path if o else "",
        "files": float(o.file_count) if ok else -1.0,
        "bytes": float(o.total_bytes) if ok else -1.0,
        "change_age_s": o.last_change_age_s if ok and o.last_change_age_s is not None else -1.0,
        "newest": o.newest.path if ok and o.newest else "",
        "mean_file_bytes": float(o.total_bytes) / o.file_count if ok and o.file_count else -1.0,
    }


# ------------------------------------------------------------------------------------------ GPU

def _server_pids(snap: Snapshot) -> set[int]:
    sp = snap.server_processes
    return {p.pid for p in sp.processes} if sp else set()


def _pipeline_gpus(snap: Snapshot, job_pids: set[int]) -> set[int] | None:
    """The GPUs the job or its server hold memory on; None when that is unknown (no process list,
    or nobody of the pipeline on a GPU): then every GPU of the host is the pipeline's."""
    g = snap.gpu
    pids = job_pids | _server_pids(snap)
    found = {d.index for d in (g.devices if g and g.status == "ok" else ())
             for pr in d.processes or () if pr.pid in pids}
    return found or None


def _norm_pci(bus_id: str) -> str:
    # NVML says "00000000:3B:00.0", the kernel "0000:3b:00": compare domain:bus:device.
    parts = bus_id.lower().split(".")[0].split(":")
    if len(parts) == 3:
        return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
    return bus_id.lower()


def _pcis_of(snap: Snapshot, mine: set[int] | None) -> set[str] | None:
    """The PCI bus ids of those GPUs, as kernel Xid lines name them; None: every GPU."""
    if mine is None or snap.gpu is None:
        return None
    pcis = {_norm_pci(d.pci_bus_id) for d in snap.gpu.devices if d.index in mine and d.pci_bus_id}
    return pcis or None


def _gpu(snap: Snapshot, job_pids: set[int], mine: set[int] | None) -> dict[str, Any]:
    """mine: the pipeline's GPUs (_pipeline_gpus), None when unknown."""
    g = snap.gpu
    devs = list(g.devices) if g and g.status == "ok" else []
    utils = [d.util_gpu_pct for d in devs if isinstance(d.util_gpu_pct, (int, float))]
    job_mem = 0
    job_gpus: set[int] = set()
    for d in devs:
        for pr in d.processes or ():
            if pr.pid in job_pids:
                job_mem += pr.used_bytes or 0
                job_gpus.add(d.index)
    # A fault on another tenant's GPU is not this pipeline's: on a shared 8-GPU node a job on
    # GPUs 0-1 must not be called gpu_fault (and left unrestarted) for an Xid on GPU 5.
    scoped = (lambda i: True) if mine is None else (lambda i: i in mine)
    # Corrected single-bit ECC is the hardware working as designed, and Xids 13, 31, 43 and 45
    # are raised by the application itself (an illegal access, a page fault, a killed context):
    # the job's problem, judged by its own verdict, not a GPU fault.
    xids = [e for e in (g.xid_events if g else ()) if snap.t_wall - e.wall_time < RECENT_EVENT_S
            and e.kind != "ecc_single_bit" and e.xid not in APPLICATION_XIDS]
    lost = [d.index for d in devs if d.lost]
    ecc = [d.index for d in devs if (d.ecc_volatile_uncorrected or 0) > 0]
    others = (len([i for i in lost if not scoped(i)]) + len([i for i in ecc if not scoped(i)])
              + len([e for e in xids if e.gpu_index is not None and not scoped(e.gpu_index)]))
    lost, ecc = [i for i in lost if scoped(i)], [i for i in ecc if scoped(i)]
    xids = [e for e in xids if e.gpu_index is None or scoped(e.gpu_index)]
    return {
        "present": bool(devs),
        "status": g.status if g else "absent",
        "count": len(devs),
        "util_max_pct": max(utils) if utils else -1.0,
        "util_mean_pct": sum(utils) / len(utils) if utils else -1.0,
        "mem_used_bytes": float(sum(d.mem_used_bytes or 0 for d in devs)),
        "job_mem_bytes": float(job_mem),
        "job_mem_h": human_bytes(job_mem),
        "job_gpus": sorted(job_gpus),
        "pipeline_gpus": sorted(mine) if mine is not None else [d.index for d in devs],
        "faults_elsewhere": float(others),
        "lost": lost,
        "ecc_uncorrected_gpus": ecc,
        "xid_recent": [{"gpu": e.gpu_index, "xid": e.xid if e.xid is not None else -1, "kind": e.kind}
                       for e in xids],
        "list": [{"index": d.index, "name": d.name or "", "util_pct": d.util_gpu_pct
                  if isinstance(d.util_gpu_pct, (int, float)) else -1.0,
                  "mem_used_bytes": float(d.mem_used_bytes or 0),
                  "mem_used_h": human_bytes(d.mem_used_bytes or 0),
                  "mem_total_bytes": float(d.mem_total_bytes or 0),
                  "pids": [pr.pid for pr in d.processes or ()]} for d in devs],
    }


# ------------------------------------------------------------------------------ server, client

def _server(snap: Snapshot) -> dict[str, Any]:
    s = snap.server
    h = s.health if s else None
    info = s.server_info if s else None
    m = s.metrics if s else None
    rates = m.rates_per_s if m and m.ok else {}
    gauges = m.gauges if m and m.ok else {}
    gen = rates.get("sglang:generation_tokens_total")
    prompt = rates.get("sglang:prompt_tokens_total")
    return {
        "configured": s is not None,
        "url": s.base_url if s else "",
        "port": float(s.port) if s else -1.0,
        "reachable": bool(s and s.reachable),
        "unreachable": bool(s and s.reachable is False),
        "error": (s.error or "") if s else "",
        "health_known": bool(h and h.ok is not None),
        "health_ok": bool(h and h.ok),
        "health_failed": bool(h and h.ok is False),
        "health_overdue": bool(h and h.overdue),
        "health_in_flight_s": (h.in_flight_for_s or 0.0) if h else 0.0,
        "health_status": float(h.status_code) if h and h.status_code else -1.0,
        "health_error": (h.error or "") if h else "",  # why it failed: a timeout has no status
        "info_overdue": bool(info and (info.overdue or info.timed_out)),
        # The server itself says it is not well: what tells "the client waits on a sick server"
        # from "the client is stuck on its own while connected to a healthy one".
        "trouble": bool((h and (h.ok is False or h.overdue)) or (info and (info.overdue or info.timed_out))),
        "metrics_ok": bool(m and m.ok),
        "gen_tokens_per_s": gen if gen is not None else -1.0,
        "prompt_tokens_per_s": prompt if prompt is not None else -1.0,
        "progress_unchanged_s": (m.progress_unchanged_for_s if m and m.progress_unchanged_for_s
                                 is not None else -1.0),
        "running_reqs": gauges.get("sglang:num_running_reqs", -1.0),
        "queue_reqs": gauges.get("sglang:num_queue_reqs", -1.0),
        "gauges_possibly_stale": bool(m and m.gauges_possibly_stale),
    }


def _ranks(snap: Snapshot) -> dict[str, Any]:
    """The server's worker processes (one per tensor-parallel rank) and what each is doing.

    Tells "all ranks idle" from "one rank stuck while the others spin or wait on it in a
    collective" (NCCL busy-waits: the healthy ranks show R at ~100% CPU, the stuck one does not).
    """
    sp = snap.server_processes
    gpu_of: dict[int, list[tuple[int, int]]] = {}
    for d in (snap.gpu.devices if snap.gpu else ()):
        for pr in d.processes or ():
            gpu_of.setdefault(pr.pid, []).append((d.index, pr.used_bytes or 0))
    util = {d.index: d.util_gpu_pct for d in (snap.gpu.devices if snap.gpu else ())
            if isinstance(d.util_gpu_pct, (int, float))}
    ranks = []
    for p in (sp.processes if sp else ()):
        title = parse_title(p.cmdline)
        if title is None or title.role != "scheduler":
            continue
        gpus = gpu_of.get(p.pid, [])
        quiet = _quiet(p.ctx_unchanged_for_s, p.last_ran_age_s)
        stuck = p.state in ("T", "t", "D", "Z") or quiet >= 10
        ranks.append({"rank": title.tp, "label": title.label, "key": list(title.key), "pid": p.pid,
                      "state": p.state, "state_for_s": p.state_since_s, "cpu_util": p.cpu_util or 0.0,
                      "cpu_pct": round((p.cpu_util or 0.0) * 100.0), "quiet_s": quiet,
                      "quiet_h": human_s(quiet), "wchan": p.wchan or "", "stuck": stuck,
                      "gpu": gpus[0][0] if gpus else -1,
                      "gpu_util_pct": util.get(gpus[0][0], -1.0) if gpus else -1.0,
                      "mem_h": human_bytes(sum(b for _, b in gpus))})
    gone = [e for e in (sp.exited if sp else ()) if (e.cmdline or "").startswith("sglang::scheduler")]
    ranks.sort(key=lambda r: r["key"])  # by the whole rank tuple: DP groups repeat TP numbers
    stuck = [r for r in ranks if r["stuck"]]
    busy = [r for r in ranks if not r["stuck"] and (r["state"] == "R" or r["cpu_util"] > 0.5)]
    return {
        "ranks": ranks,
        "ranks_gone": [{"pid": e.pid, "cmdline": e.cmdline or ""} for e in gone],
        # One rank stopped, in D or dead while others spin: the others wait on it in a collective.
        "rank_stuck": bool((stuck or gone) and busy),
        "ranks_all_idle": bool(ranks) and not busy and not stuck and not gone,
        "ranks_text": ", ".join(f"{r['label']} {r['state']}" + (" (stuck)" if r["stuck"] else "")
                                for r in ranks) + "".join(f", {e.cmdline or e.pid} gone" for e in gone),
    }


def _client(procs: list[ProcessObs], threads: list[tuple[ProcessObs, ThreadObs]],
            port: int | None) -> dict[str, Any]:
    """Is the job waiting on the server? A thread blocked reading a socket to its port is proof;
    an open connection to it while every thread sleeps in poll/epoll is strong circumstance."""
    out = {"connected": False, "waiting": False, "blocked": False, "how": "", "pid": -1, "tid": -1,
           "syscall": "", "remote": "", "quiet_s": 0.0}
    if port is None:
        return out
    by_fd: dict[tuple[int, int], str] = {}
    for p in procs:
        for s in p.tcp:
            if s.remote_port == port and s.state == "ESTABLISHED":
                by_fd[(p.pid, s.fd)] = f"{s.remote_addr}:{s.remote_port}"
    if not by_fd:
        return out
    out["connected"] = True
    for p, t in threads:
        if t.syscall in SOCKET_READ_SYSCALLS and (p.pid, t.syscall_fd) in by_fd:
            out.update(waiting=True, blocked=True, how="blocked reading the server socket", pid=p.pid, tid=t.tid,
                       syscall=t.syscall, remote=by_fd[(p.pid, t.syscall_fd)],
                       quiet_s=_quiet(t.ctx_unchanged_for_s, t.last_ran_age_s))
            return out
    connected = [p for p in procs if any(k[0] == p.pid for k in by_fd)]
    sleeping = [t for p in connected for t in p.threads]
    if sleeping and all(t.state == "S" and (t.syscall or "") in WAIT_SYSCALLS for t in sleeping):
        p = connected[0]
        t = p.threads[0]
        out.update(waiting=True, how="connected to the server, every thread asleep in a wait",
                   pid=p.pid, tid=t.tid, syscall=t.syscall or "",
                   remote=next(v for k, v in by_fd.items() if k[0] == p.pid),
                   quiet_s=min(_quiet(t.ctx_unchanged_for_s, t.last_ran_age_s) for t in sleeping))
    return out


def _port_of(url: str | None) -> int | None:
    if not url:
        return None
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        return u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None


# ----------------------------------------------------------------------------------- disk, kernel

def _disk(snap: Snapshot) -> dict[str, Any]:
    d = snap.disks
    paths = [p for p in (d.paths if d else ()) if p.kind == "path"]
    shm = next((p for p in (d.paths if d else ()) if p.kind == "dev_shm"), None)
    known = [p for p in paths if p.free_bytes is not None and p.total_bytes]
    tight = min(known, key=lambda p: p.free_bytes, default=None)
    tight_inodes = min((p for p in paths if p.free_inodes is not None and p.total_inodes),
                       key=lambda p: p.free_inodes, default=None)
    stuck = [p for p in paths if p.status.value in ("timeout", "busy")]
    job_devs = {p.device.name for p in paths if p.device} | {
        p.device.parent_disk for p in paths if p.device and p.device.parent_disk}
    devs = [x for x in (d.devices if d else ()) if x.name in job_devs] or list(d.devices if d else ())
    worst_dev = max(devs, key=lambda x: x.inflight_stuck_for_s, default=None)
    return {
        "known": bool(known),
        "free_bytes": float(tight.free_bytes) if tight else -1.0,
        "free_h": human_bytes(tight.free_bytes) if tight else "",
        "total_bytes": float(tight.total_bytes) if tight else -1.0,
        "used_pct": tight.used_pct if tight and tight.used_pct is not None else -1.0,
        "path": tight.path if tight else "",
        "mount": tight.mount.mount_point if tight and tight.mount else "",
        "device": _devname(tight),
        "fstype": tight.mount.fs_type if tight and tight.mount else "",
        "free_inodes": float(tight_inodes.free_inodes) if tight_inodes else -1.0,
        "inodes_used_pct": (tight_inodes.inodes_used_pct if tight_inodes and
                            tight_inodes.inodes_used_pct is not None else -1.0),
        "inodes_path": tight_inodes.path if tight_inodes else "",
        "stuck": bool(stuck),
        "stuck_path": stuck[0].path if stuck else "",
        "stuck_detail": (stuck[0].detail or "") if stuck else "",
        "stuck_for_s": max((p.stuck_for_s or 0.0 for p in stuck), default=0.0),
        "inflight_stuck_s": worst_dev.inflight_stuck_for_s if worst_dev else 0.0,
        "inflight_device": worst_dev.name if worst_dev else "",
        "inflight_ios": float(worst_dev.inflight_ios) if worst_dev else 0.0,
        "write_bytes_per_s": (worst_dev.write_bytes_per_s or 0.0) if worst_dev else 0.0,
        "shm_free_bytes": float(shm.free_bytes) if shm and shm.free_bytes is not None else -1.0,
        "shm_used_pct": shm.used_pct if shm and shm.used_pct is not None else -1.0,
        "shm_sgl_segments": float(shm.sgl_shm_segments or 0) if shm else 0.0,
        "paths": [{"path": p.path, "mount": p.mount.mount_point if p.mount else "",
                   "device": _devname(p), "status": p.status.value, "detail": p.detail or ""}
                  for p in paths],
    }


def _io_place(snap: Snapshot, d_file: str) -> dict[str, str]:
    """The filesystem a stuck job most likely waits on, for the io_stall advice: the mount holding
    the file the worst D thread's syscall is on; else a watched path whose statvfs is stuck; else
    the outputs directory's (where an extraction job writes); else the tightest."""
    d = snap.disks
    paths = [p for p in (d.paths if d else ()) if p.kind == "path" and p.mount]
    if not paths:
        return {"io_mount": "", "io_device": "", "io_why": ""}

    def under(f: str, mp: str) -> bool:
        return f == mp or f.startswith(mp.rstrip("/") + "/")

    if d_file.startswith("/"):
        owners = [p for p in paths if under(d_file, p.mount.mount_point)]
        if owners:
            p = max(owners, key=lambda p: len(p.mount.mount_point))
            return {"io_mount": p.mount.mount_point, "io_device": _devname(p),
                    "io_why": f"holds {d_file}, the stuck thread's file"}
    stuck = [p for p in paths if p.status.value in ("timeout", "busy")]
    if stuck:
        return {"io_mount": stuck[0].mount.mount_point, "io_device": _devname(stuck[0]),
                "io_why": f"statvfs of {stuck[0].path} does not return"}
    out = str(snap.target.outputs) if snap.target.outputs else ""
    mine = next((p for p in paths if out and p.path == out), None)
    if mine is not None:
        return {"io_mount": mine.mount.mount_point, "io_device": _devname(mine),
                "io_why": "holds the outputs directory"}
    tight = min((p for p in paths if p.free_bytes is not None), key=lambda p: p.free_bytes,
                default=paths[0])
    return {"io_mount": tight.mount.mount_point, "io_device": _devname(tight),
            "io_why": "the watched filesystem with the least free space"}


def _devname(p) -> str:
    if p is None or p.device is None:
        return p.mount.source if p is not None and p.mount else ""
    dev = p.device
    name = f"/dev/{dev.name}"
    if dev.parent_disk:
        name += f" (on {dev.parent_disk})"
    if dev.dm_name:
        name += f" ({dev.dm_name})"
    return f"{name} backed by {dev.loop_backing_file}" if dev.loop_backing_file else name


def _kernel(snap: Snapshot, procs: list[ProcessObs], pcis: set[str] | None = None) -> dict[str, Any]:
    k = snap.kernel
    events = [e for e in (k.events if k else ())
              if e.wall_time is None or snap.t_wall - e.wall_time < RECENT_EVENT_S]
    job_pids = {p.pid for p in procs}
    if snap.processes:
        job_pids |= {e.pid for e in snap.processes.exited}
    job_pids |= set(snap.target.pids)
    ooms = [e for e in events if e.kind == "oom_kill"]
    job_oom = next((e for e in reversed(ooms) if e.pid in job_pids), None)
    hung = [e for e in events if e.kind == "hung_task" and e.pid in job_pids]
    xids = [e for e in events if e.kind == "gpu_xid" and e.xid not in APPLICATION_XIDS
            and (pcis is None or not e.pci or _norm_pci(e.pci) in pcis)]
    ioerr = [e for e in events if e.kind in ("block_io_error", "fs_error")]
    return {
        "readable": bool(k and k.status.value == "ok"),
        "oom_job": job_oom is not None,
        "oom_line": job_oom.message if job_oom else "",
        "oom_pid": float(job_oom.pid) if job_oom and job_oom.pid else -1.0,
        "oom_comm": (job_oom.comm or "") if job_oom else "",
        "oom_any": len(ooms),
        "hung_job": bool(hung),
        "hung_line": hung[-1].message if hung else "",
        "xid": [{"xid": e.xid if e.xid is not None else -1, "pci": e.pci or "", "line": e.message}
                for e in xids],
        "io_errors": [e.message for e in ioerr][-5:],
    }


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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def human_s(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
