"""The processes probe's per-thread reading: only what can have changed since the last tick (issue
17; moved out of probes/processes.py as it was).

A mixin of ProcessesProbe: it uses the probe's roots, _paths, _kept, _memos, _tck, _runq,
_syscalls, _sched_clock, read_stacks and its _optional, _kept_optional, _track, _has_schedstat and
_kept_or_none."""

from __future__ import annotations

from collections.abc import Callable, Mapping
import time
from enum import Enum
from typing import Any

from stallwatch.kernel import procfs
from stallwatch.kernel.proc import boottime_is_uptime
from stallwatch.kernel.procfiles import ProcFiles, ProcPaths
from stallwatch.kernel.roots import Absent, Denied, Roots
from stallwatch.kernel.schedclock import SchedClock
from stallwatch.probes.processes_obs import ThreadObs, built

from stallwatch.probes.processes_state import _ThreadMemo, _Tick
from stallwatch.probes.runqueue import RunQueueTracker, schedstat_or_none

_new, _set = object.__new__, object.__setattr__  # processes_obs.built's, inlined in the hot loop

# An idle thread's stat is re-read one tick in this many (in turn, by tid): the bound on how long
# a letter changed from outside (a wake-up not yet given a CPU) or a comm renamed by another
# thread goes unseen; see ProcessesProbe._thread.
STAT_EVERY_TICKS = 8
class _Unread(Enum):
    """A thread's schedstat not read by the tree walk this tick (a sentinel the type checker
    narrows on `is`)."""

    UNREAD = 0


_UNREAD = _Unread.UNREAD

# Syscalls whose first argument is the fd they wait on, so a blocked thread can be tied to a file
# or socket ("write on /data/x.ckpt", "recvfrom on the socket to :30000").
FD_SYSCALLS = frozenset({
    "read", "write", "pread64", "pwrite64", "readv", "writev", "preadv", "pwritev", "preadv2",
    "pwritev2", "recvfrom", "sendto", "recvmsg", "sendmsg", "recvmmsg", "sendmmsg", "connect",
    "accept", "accept4", "shutdown", "fsync", "fdatasync", "sync_file_range", "ioctl", "fcntl",
    "flock", "ftruncate", "fallocate", "getdents64", "lseek", "close", "fstat", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "sendfile", "splice", "copy_file_range",
})


class ThreadReader:
    # The probe's state and steps this part uses (ProcessesProbe.__init__ sets the state; the
    # steps are TreeWalk's and ProcessesProbe's own).
    roots: Roots
    read_stacks: bool
    _paths: ProcPaths
    _kept: ProcFiles
    _memos: dict[tuple[int, int], _ThreadMemo]
    _tck: int
    _runq: RunQueueTracker
    _syscalls: Mapping[int, str]
    _sched_clock: SchedClock | None
    _boottime_ok: bool | None = None  # /proc/uptime is CLOCK_BOOTTIME here: see _uptime
    _tick_tracks: int
    _pd: Callable[..., str]
    _has_schedstat: Callable[[int], bool]
    _kept_or_none: Callable[[str], bytes | None]
    _held_sched: Callable[[_ThreadMemo], bytes | None]
    _optional: Callable[..., Any]
    _kept_optional: Callable[..., Any]
    _kept_parsed: Callable[..., Any]
    _track: Callable[..., Any]

    def _thread(self, pid: int, tid: int, fds: dict[int, str] | None,
                tick: _Tick) -> ThreadObs | None:
        """One thread, reading only what can have changed since the last tick.

        Every tick reads its schedstat (nanoseconds on a CPU, nanoseconds waiting for one, times
        scheduled in). A thread off-CPU whose schedstat did not move did not run since its last
        full reading, so its wait channel, syscall, kernel stack, context switches, CPU and
        last-ran time are still those: they are reused. stat's utime+stime cannot be that
        signal: they move in 10 ms ticks, and a thread that wakes for 50 µs a second would look
        idle for minutes. Without schedstat, status's context switches are the signal (a sleeper
        that ran has switched out again). The schedstat read comes first in the tick (the tree
        walk's, when it walked).

        Its stat is not read either then (one pread instead of two: rendering stat costs the
        kernel three times schedstat's). Every way into D, S, T, t or Z is taken by the thread
        itself, on a CPU: it sets its own state and then switches out, which moves schedstat's
        run time and count. The one change made to a thread from outside is a wake-up (S, D or
        T to R: try_to_wake_up sets TASK_RUNNING and queues it), and schedstat moves only once
        it is scheduled in (sched_info_arrive): measured on kernel 6.18, a sleeper woken inside
        a CFS-throttled cgroup read R with its schedstat unchanged until the next period. So
        for a thread woken but not yet given a CPU the letter lags: the moment it runs, the
        next collect reads it afresh; if it never gets a CPU, STAT_EVERY_TICKS bounds the lag
        (each idle thread's stat is re-read in turn), and the same bound holds for a comm
        changed from another thread (/proc/PID/task/TID/comm).
        tests/test_processes_cost.py shows D, T and R entered by a thread seen on the very next
        collect."""
        key = (pid, tid)
        memo = self._memos.get(key)
        sched: bytes | _Unread | None
        if memo is not None:
            sched = memo.sched_now if memo.sched_tick == tick.number else _UNREAD
        else:
            sched = tick.sched.get(key, _UNREAD)
        if memo is not None and memo.sched_raw is not None:
            # An idle thread, still idle (a wide job's take this in _thread_rows, in a batch).
            if sched is _UNREAD:
                sched = self._sched_of(memo)
            if sched == memo.sched_raw:
                if (tid + tick.number) % STAT_EVERY_TICKS:
                    return self._thread_idle(memo, fds, tick)  # its stat is not read
                try:
                    raw = self._kept.read(memo.stat_path)
                except (Absent, Denied):
                    return None
                if raw == memo.stat_raw:
                    return self._thread_idle(memo, fds, tick)
        d, now = self._pd(pid, tid), tick.now
        if sched is _UNREAD:
            sched = (None if not self._has_schedstat(pid) else self._sched_of(memo)
                     if memo is not None else self._kept_or_none(f"{d}/schedstat"))
        try:
            raw = self._kept.read(f"{d}/stat")
            status = None if sched is not None else procfs.parse_status(
                self._kept.read(f"{d}/status", 0.5).decode("utf-8", "replace"))
        except (Absent, Denied):  # gone since the listing, or hidden by hidepid
            return None
        if sched is _UNREAD:
            sched = None
        st = (memo.stat if memo is not None and memo.stat_raw == raw
              else procfs.parse_stat(raw.decode("utf-8", "replace")))
        # A running task has no wait channel or stable syscall, and unwinding its stack races
        # with the CPU it runs on: read those only for tasks that are off-CPU.
        blocked = st.state not in ("R", "Z", "X")
        if (blocked and memo is not None and memo.stat.state == st.state
                and memo.stat.start_ticks == st.start_ticks
                and (memo.sched_raw == sched if sched is not None
                     else status is not None and memo.ctx == _ctx(status))):
            return self._thread_again(memo, st, sched, fds, tick)
        try:
            if status is None:
                status = procfs.parse_status(
                    self._kept.read(f"{d}/status", 0.5).decode("utf-8", "replace"))
        except (Absent, Denied):
            return None
        if tid == pid:
            tick.leader_status[pid] = status
        ctx = _ctx(status)
        tr, _, cpu_delta = self._track(("t", tid, st.start_ticks), now, st.state, sum(ctx),
                                       st.utime_ticks + st.stime_ticks)
        denied: set[str] = set()
        opt = self._kept_optional
        wchan = opt(f"{d}/wchan", procfs.parse_wchan, "wchan", denied) if blocked else None
        sc = opt(f"{d}/syscall", self._parse_syscall, "syscall", denied) if blocked else None
        stack = (opt(f"{d}/stack", procfs.parse_stack, "stack", denied)
                 if blocked and self.read_stacks else None)
        ran_up = (self._ran_uptime(opt(f"{d}/sched", procfs.parse_sched_last_run,
                                                  "sched", denied), sched, st, tick)
                  if blocked else None)
        run_wait = None  # schedstat's (ns on a CPU, ns waiting for one), for runnable threads
        if st.state == "R" and self._has_schedstat(pid):
            if sched is None:
                try:
                    sched = self._kept.read(f"{d}/schedstat")
                except Absent:
                    pass
                except Denied:
                    denied.add("schedstat")
            run_wait = schedstat_or_none(sched.decode()) if sched is not None else None
        tick.denied |= denied
        runq = self._runq.step(("t", tid, st.start_ticks), now, st.state, ctx[0],
                               st.utime_ticks, st.stime_ticks, run_wait)
        sc_fd = sc.args[0] if sc and sc.name in FD_SYSCALLS and sc.args else None
        if sc_fd is not None and sc_fd >= 1 << 31:  # not an fd: AT_FDCWD or garbage
            sc_fd = None
        obs = built(ThreadObs, dict(  # unvalidated, in the declared order: see built
            tid=tid, comm=st.comm, state=st.state, state_since_s=now - tr.state_mono,
            d_state_for_s=now - tr.state_mono if st.state == "D" else 0.0,
            ctx_unchanged_for_s=now - tr.ctx_mono,
            voluntary_ctxt_switches=ctx[0], nonvoluntary_ctxt_switches=ctx[1],
            utime_s=st.utime_ticks / self._tck, stime_s=st.stime_ticks / self._tck,
            cpu_delta_s=None if cpu_delta is None else cpu_delta / self._tck,
            wchan=wchan, syscall=sc.name if sc else None, syscall_nr=sc.nr if sc else None,
            syscall_args=sc.args if sc else (), syscall_fd=sc_fd,
            syscall_file=fds.get(sc_fd) if fds is not None and sc_fd is not None else None,
            stack=stack,
            last_ran_age_s=0.0 if not blocked else self._last_ran_age(ran_up, tick),
            runqueue=runq,
        ))
        if memo is None or memo.stat.start_ticks != st.start_ticks:
            # First sight, or another task under a reused tid: what was remembered was not its.
            if memo is not None:
                self._forget_memo(memo)
            memo = self._memos[key] = _ThreadMemo(
                tid, raw, st, sched if blocked else None, ctx, obs, ran_up, tuple(denied), now,
                tr, f"{d}/stat", f"{d}/schedstat")
        else:  # in place: the process's rows hold this object
            memo.stat_raw, memo.stat, memo.sched_raw, memo.ctx = raw, st, sched if blocked else None, ctx
            memo.obs, memo.ran_uptime_s, memo.denied = obs, ran_up, tuple(denied)
            memo.seen_mono, memo.track = now, tr
        if memo.sched_fd < 0 and sched is not None:
            try:  # held from now on: the hot loop reads it by number (kernel/procfiles.py)
                memo.sched_fd = self._kept.take(memo.sched_path) or -1
            except (Absent, Denied):
                pass
        tick.memos_seen += 1
        return obs

    def _parse_syscall(self, text: str) -> procfs.Syscall:
        """procfs.parse_syscall with this probe's table (a method: not a closure made a call)."""
        return procfs.parse_syscall(text, self._syscalls)

    def _sched_of(self, memo: _ThreadMemo) -> bytes | None:
        """A remembered thread's schedstat: through its held descriptor, or by path."""
        if memo.sched_fd >= 0:
            return self._held_sched(memo)
        return self._kept_or_none(memo.sched_path)

    def _forget_memo(self, memo: _ThreadMemo) -> None:
        """Close what a memo holds: its kept files and its schedstat descriptor."""
        self._kept.release(memo.stat_path)
        self._kept.release(memo.sched_path)
        task_dir = memo.stat_path[:-len("stat")]
        for name in _RAN_FILES:
            self._kept.release(task_dir + name)
        if memo.sched_fd >= 0:
            self._kept.drop(memo.sched_fd)
            memo.sched_fd = -1

    def _thread_rows(self, pid: int, rows: list[_ThreadMemo], fds: dict[int, str] | None,
                     tick: _Tick) -> list[ThreadObs]:
        """_thread for each of a process's threads, whose schedstat the tree walk read this tick
        (`rows`: their memos, in the list's order): an idle thread out of its stat turn is
        carried over here, with no lookup; any other goes through _thread, which applies every
        rule above.

        The hot loop of a wide job (8 × 128 idle threads: most of a tick), so _thread_idle's
        work is written out in it, with what is the same for every thread of the tick (its
        time, /proc/uptime, the counters) taken once: a call and a dozen lookups less a thread.
        tests/test_processes_cost.py holds it equal to _thread_idle."""
        out: list[ThreadObs] = []
        append, thread, read = out.append, self._thread, self._kept.read
        number, every, now = tick.number, STAT_EVERY_TICKS, tick.now
        up: float | None = None
        idle = 0
        for m in rows:
            if m.sched_tick == number and m.sched_raw is not None and m.sched_now == m.sched_raw:
                if (m.tid + number) % every == 0:
                    try:  # its turn: its stat too (a wake-up not yet on a CPU, a comm renamed)
                        same = read(m.stat_path) == m.stat_raw
                    except (Absent, Denied):
                        continue  # gone since the walk
                    if not same:
                        t = thread(pid, m.tid, fds, tick)
                        if t is not None:
                            append(t)
                        continue
                # Idle: _thread_idle, written out.
                old, tr = m.obs, m.track
                tr.seen_mono = now
                if m.denied:
                    tick.denied.update(m.denied)
                values = old.__dict__.copy()
                values["state_since_s"] = since = now - tr.state_mono
                values["d_state_for_s"] = since if old.state == "D" else 0.0
                values["ctx_unchanged_for_s"] = now - tr.ctx_mono
                values["cpu_delta_s"] = 0.0
                sc_fd = old.syscall_fd  # the fd table may have changed (another thread's close)
                if sc_fd is not None:
                    values["syscall_file"] = fds.get(sc_fd) if fds is not None else None
                if m.ran_uptime_s is not None:
                    if up is None:
                        up = tick.uptime_s if tick.uptime_s is not None else self._uptime(tick)
                    values["last_ran_age_s"] = None if up < 0 else max(0.0, up - m.ran_uptime_s)
                obs = _new(ThreadObs)
                _set(obs, "__dict__", values)
                _set(obs, "__pydantic_fields_set__", old.__pydantic_fields_set__)
                _set(obs, "__pydantic_extra__", None)
                _set(obs, "__pydantic_private__", None)
                m.obs, m.seen_mono = obs, now
                idle += 1
                append(obs)
                continue
            t = thread(pid, m.tid, fds, tick)
            if t is not None:
                append(t)
        self._tick_tracks += idle
        tick.memos_seen += idle
        return out

    def _thread_idle(self, memo: _ThreadMemo, fds: dict[int, str] | None,
                     tick: _Tick) -> ThreadObs:
        """A thread that did not run since `memo` (its schedstat, and its stat when read, are
        the same bytes): its durations move on, nothing else does. No validation: every value
        comes from a reading validated before. The hot loop of a wide job: kept short."""
        now, old, tr = tick.now, memo.obs, memo.track
        tr.seen_mono = now  # _Track.step with the same state, switches and CPU
        self._tick_tracks += 1
        if memo.denied:
            tick.denied.update(memo.denied)
        since = now - tr.state_mono
        sc_fd = old.syscall_fd  # the fd table may have changed under it (another thread's close)
        values = {**old.__dict__, "state_since_s": since,
                  "d_state_for_s": since if old.state == "D" else 0.0,
                  "ctx_unchanged_for_s": now - tr.ctx_mono, "cpu_delta_s": 0.0}
        if sc_fd is not None:
            values["syscall_file"] = fds.get(sc_fd) if fds is not None else None
        if memo.ran_uptime_s is not None:
            up = tick.uptime_s if tick.uptime_s is not None else self._uptime(tick)
            values["last_ran_age_s"] = None if up < 0 else max(0.0, up - memo.ran_uptime_s)
        obs = _evolved(old, values)
        memo.obs, memo.seen_mono = obs, now
        tick.memos_seen += 1
        return obs

    def _thread_again(self, memo: _ThreadMemo, st: procfs.Stat, sched: bytes | None,
                      fds: dict[int, str] | None, tick: _Tick) -> ThreadObs:
        """A thread that did not run since `memo`: its durations move on, nothing else does.
        No validation: every value comes from a reading validated before."""
        now, old, tr = tick.now, memo.obs, memo.track
        _, cpu_delta = tr.step(now, st.state, sum(memo.ctx), st.utime_ticks + st.stime_ticks)
        self._tick_tracks += 1
        if memo.denied:
            tick.denied.update(memo.denied)
        sc_fd = old.syscall_fd  # the fd table may have changed under it (another thread's close)
        obs = _evolve(old, {
            "comm": st.comm,  # another thread can rename it through /proc/PID/task/TID/comm
            "state_since_s": now - tr.state_mono,
            "d_state_for_s": now - tr.state_mono if st.state == "D" else 0.0,
            "ctx_unchanged_for_s": now - tr.ctx_mono,
            "utime_s": st.utime_ticks / self._tck, "stime_s": st.stime_ticks / self._tck,
            "cpu_delta_s": None if cpu_delta is None else cpu_delta / self._tck,
            "syscall_file": fds.get(sc_fd) if fds is not None and sc_fd is not None else None,
            "last_ran_age_s": self._last_ran_age(memo.ran_uptime_s, tick),
        })
        memo.obs, memo.stat, memo.sched_raw, memo.seen_mono = obs, st, sched, now
        tick.memos_seen += 1
        return obs

    def _ran_uptime(self, run: tuple[float | None, int | None] | None, sched: bytes | None,
                    st: procfs.Stat, tick: _Tick) -> float | None:
        """When the thread last ran, in /proc/uptime seconds. se.exec_start is on the clock of
        the CPU it ran on, behind uptime by that CPU's stolen time (kernel/schedclock.py): on
        the host that lag is measured and added; a capture's clocks are taken as read.

        That CPU is stat's, read before sched: a thread that ran in between, on another CPU,
        would have one CPU's lag added to another's stamp (1.5 s apart on the CI VM). sched's
        se.sum_exec_runtime equal to schedstat's first field (read before stat) says it did not
        run since; when they differ it ran during this collect, so it just ran (short by at most
        the collect), and its moved schedstat has the next collect read it afresh."""
        exec_start_s, sum_ns = run if run is not None else (None, None)
        if exec_start_s is None:
            return None
        if sched is not None and sum_ns is not None:
            got = schedstat_or_none(sched.decode())
            if got is not None and got[0] != sum_ns:
                up = self._uptime(tick)
                return None if up < 0 else up
        if self._sched_clock is None:
            return exec_start_s
        return self._sched_clock.uptime_of(exec_start_s, st.processor)

    def _last_ran_age(self, ran_uptime_s: float | None, tick: _Tick) -> float | None:
        if ran_uptime_s is None:
            return None
        up = self._uptime(tick)
        return None if up < 0 else max(0.0, up - ran_uptime_s)

    def _uptime(self, tick: _Tick) -> float:
        """/proc/uptime, once a tick; -1 when unreadable. On the host it is CLOCK_BOOTTIME in
        hundredths (fs/proc/uptime.c: ktime_get_boottime_ts64, a time namespace's offset added,
        as clock_gettime adds it), so it is taken from the clock: the same value, to the
        double, without a read and parse a tick (procs7); see kernel/proc.py boottime_is_uptime."""
        if tick.uptime_s is None:
            if self._boottime_ok is None:
                self._boottime_ok = self._paths.is_host() and boottime_is_uptime()
            if self._boottime_ok:
                tick.uptime_s = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 100) / 100
                return tick.uptime_s
            up = self._kept_parsed(self._paths.host("uptime"), procfs.parse_uptime_s, "uptime",
                                   tick.denied)
            tick.uptime_s = up if up is not None else -1.0
        return tick.uptime_s


# Read (kept open: ProcFiles.read_task_file) only when a thread ran: closed with its memo.
_RAN_FILES = ("status", "wchan", "syscall", "stack", "sched", "children")


def _evolve(obs: ThreadObs, update: dict) -> ThreadObs:
    """obs.model_copy(update=update), for the thousand idle threads of a wide job: model_copy
    goes through copy.copy for each of pydantic's four slots (1.8 µs); this sets them directly
    (0.7 µs). Every field is already set on a ThreadObs, so the fields-set is unchanged, and it
    has no extras or private attributes (tests/test_processes_cost.py compares the two)."""
    values = obs.__dict__.copy()
    values.update(update)
    return _evolved(obs, values)


def _evolved(obs: ThreadObs, values: dict) -> ThreadObs:
    """A ThreadObs like `obs` with these field values (all of them: a copy of its __dict__)."""
    return built(ThreadObs, values, obs.__pydantic_fields_set__)


def _ctx(status: procfs.Status) -> tuple[int, int]:
    return status.voluntary_ctxt_switches, status.nonvoluntary_ctxt_switches
