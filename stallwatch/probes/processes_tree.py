"""The processes probe's tree walk: which processes are the job (explicit pids, --match), and their
descendants, found through the kernel's per-thread `children` lists or a scan of /proc (moved
out of probes/processes.py as they were).

A mixin of ProcessesProbe: it uses the probe's roots, clock, _paths, _memos, _tid_lists,
_kept, _rows, _stat_cache, _cmdlines and the target settings that ProcessesProbe.__init__ sets."""

from __future__ import annotations

import os
from collections import deque
import re
from collections.abc import Callable, Iterable
from typing import Any, cast

from stallwatch.kernel import procfs
from stallwatch.clock import Clock
from stallwatch.kernel.procfiles import SCHEDSTAT_LIMIT, ProcFiles, ProcPaths
from stallwatch.kernel.roots import Absent, Denied, Roots
from stallwatch.probes.processes_state import _Member, _ThreadMemo, _Tick, uid_of


class TreeWalk:
    # The probe's state this part reads and keeps (ProcessesProbe.__init__ sets it).
    roots: Roots
    clock: Clock
    match_uid: int | None
    _paths: ProcPaths
    _kept: ProcFiles
    _match: re.Pattern[str] | None
    _explicit: tuple[int, ...]
    _self_pid: int | None
    _first_collect: bool
    _wide: bool
    _full_scan_mono: float | None
    _children_ok: bool | None
    _schedstat_ok: bool | None
    _stat_cache: dict[str, tuple[str, procfs.Stat]]
    _job: dict[int, int]
    _missing: set[int]
    _members: dict[tuple[int, int], _Member]
    _memos: dict[tuple[int, int], _ThreadMemo]
    _rows: dict[tuple[int, int], tuple[list[int], list[_ThreadMemo]]]
    _tid_lists: dict[tuple[int, int], list[int]]
    _cmdlines: dict[tuple[int, int, str], tuple[str, ...]]
    _kept_parsed: Callable[..., Any]

    def _pd(self, pid: int, tid: int | None = None) -> str:
        """A process's or a thread's /proc directory (kernel/procfiles.ProcPaths)."""
        return self._paths.pid(pid) if tid is None else self._paths.task(pid, tid)

    # Finding new descendants by reading every /proc/*/stat costs ~11 µs per process on the
    # host each tick (20 ms on a 2,000-process GPU node); the kernel's per-thread `children`
    # lists give the job's tree alone. They are documented as possibly missing a child forked
    # while they are read, so every host process is still looked at once every
    # FULL_SCAN_EVERY_S, a slice a collect (_missed_child), and the whole of /proc is read at
    # once for --match (which must look at every command line), at the first look, past a
    # size cap (not a spent time budget: processes_state._Budget), and when a slice finds a
    # child of the tree that the lists missed.
    # Sliced, not whole: the whole scan every 10th tick was a wide job's slowest tick (issue 17:
    # 8 × 128 idle threads here, 4.7 ms for the scan and 12 ms more for its threads, which a
    # tick without the walk reads one by one instead of in the walk's batch; p99 of the tick).
    FULL_SCAN_EVERY_S = 10.0
    SCAN_SLICES = 10  # a collect reads this share of the host's stat files (1/SCAN_SLICES)
    # The slice state (class defaults: ProcessesProbe.__init__ need not know them).
    _host_pids: tuple[int, ...] = ()  # the current cycle's processes to look at
    _host_pos: int = 0  # where the next slice starts in it
    _host_step: int = 1  # a slice's length
    _host_left: int = 0  # collects left in the cycle
    _host_cycle_mono: float = 0.0  # when the listing was taken
    # (name, inode of /proc/NAME) of every entry of the last listing (or whole scan): each
    # process was looked at, and a process's parent changes after its fork only when that parent
    # exits (reparenting to a subreaper or init): one looked at once is not looked at again.
    _host_known: frozenset[tuple[str, int]] = frozenset()

    def _scan(self, tick: _Tick) -> dict[int, procfs.Stat]:
        now = self.clock.monotonic()
        # A tree past a size cap costs less through one stat per host process than through the
        # `children` list of each of its threads.
        if (self._match is None and not self._first_collect and not self._wide
                and self._children_readable()):
            stats = self._scan_tree(tick)
            if stats is not None and not self._missed_child(stats, now):
                return stats
        self._full_scan_mono = now
        self._host_pids, self._host_pos, self._host_left = (), 0, 0  # a new cycle after it
        return self._scan_all()

    def _missed_child(self, stats: dict[int, procfs.Stat], now: float) -> bool:
        """Read this collect's slice of the host's new processes: True when one of them is a
        child of the tree the walk did not find (then the caller reads all of /proc, which finds
        its descendants too). The listing is taken once a cycle; a cycle ends after SCAN_SLICES
        collects or FULL_SCAN_EVERY_S, whichever comes first (a slow interval reads the rest at
        once), so each process born before a listing is looked at in the cycle it starts: within
        2 × FULL_SCAN_EVERY_S of its fork at worst.

        Only processes that the last listing did not hold are looked at, a process being its
        /proc directory's (pid, inode): a child the lists missed was forked since (the kernel's
        lists miss what changes while they are read), and a process already looked at becomes
        a child of the tree only by reparenting, when its parent exits: to a subreaper above
        that parent, so in the tree already. On a steady host that is none a collect, instead of
        a tenth of the host's stat files (issue 17, procs6)."""
        if self._host_left <= 0:
            # (name, inode) pairs compared as a set, in C: only the new ones are turned into
            # pids (the listing is most of this slice's cost: 0.68 M instructions a listing here
            # with a pid parsed and a pair built per entry in Python; 0.51 M so, procs7).
            listing = frozenset(self.roots.listdir_ino(self._paths.root))
            new, self._host_known = listing.difference(self._host_known), listing
            pids = tuple(sorted(int(n) for n, _ in new if n.isdigit()))
            self._host_pids, self._host_pos, self._host_cycle_mono = pids, 0, now
            self._host_step = max(1, -(-len(pids) // self.SCAN_SLICES))
            self._host_left = self.SCAN_SLICES
        self._host_left -= 1
        pos, pids = self._host_pos, self._host_pids
        if self._host_left <= 0 or now - self._host_cycle_mono >= self.FULL_SCAN_EVERY_S:
            end, self._host_left = len(pids), 0
        else:
            end = min(len(pids), pos + self._host_step)
        self._host_pos = end
        for pid in pids[pos:end]:
            if pid in stats:
                continue  # in the tree already
            # Its ppid is all that is asked: one read (stat is rendered in one show), and only
            # that field parsed (procs5: this slice runs every collect, and was 1.4 x the
            # standard job's whole tree walk in phase.py, mostly its per-line parses and reads).
            try:
                ppid = procfs.parse_stat_ppid(self.roots.read_small(self._paths.pid(pid, "stat")))
            except (Absent, Denied):
                continue
            if ppid in stats:
                return True
        return False

    def _children_readable(self) -> bool:
        if self._children_ok is None:
            me = os.getpid()
            self._children_ok = os.path.isfile(self._paths.task(me, me, "children"))
        return self._children_ok

    def _scan_tree(self, tick: _Tick) -> dict[int, procfs.Stat] | None:
        """The stat of every member and explicit pid and of the children the kernel lists for
        their threads, recursively; None when a list cannot be read (then: a full scan).

        A thread's children list changes when it forks, which it must run to do, or when a
        sibling exits and hands its children over, which changes the thread list: so a list is
        re-read only for a thread whose schedstat moved, or when its process's threads changed.
        Those schedstat readings are the tick's first look at each thread; _thread reuses them."""
        cache, self._stat_cache = self._stat_cache, {}
        stats: dict[int, procfs.Stat] = {}
        queue = list(dict.fromkeys([*self._explicit, *self._job, *(p for p, _ in self._members)]))
        seen: set[int] = set()
        while queue:
            pid = queue.pop()
            if pid in seen:
                continue
            seen.add(pid)
            st = self._read_stat(pid, cache, kept=True)
            if st is None:
                continue
            stats[pid] = st
            try:
                kids = self._children_of(st, tick)
            except Absent:
                continue  # exited meanwhile
            except Denied:
                return None
            queue.extend(kids)
        return stats

    def _children_of(self, st: procfs.Stat, tick: _Tick) -> list[int]:
        pid, listed = st.pid, False
        tids = self._cached_tids(st)
        sched_ok = self._has_schedstat(pid)
        if tids is not None and sched_ok:
            rows = self._rows_of(st, tids)
            if rows is not None:
                found = self._children_of_rows(pid, rows, tick)
                if found is not None:
                    tick.tids[pid], tick.rows[pid] = tids, rows
                    return found
                self._rows.pop((pid, st.start_ticks), None)  # a thread is gone: the list below
        if tids is None:
            tids, listed = self._list_tids(st), True
        number = tick.number
        while True:
            out: list[int] = []
            memos, read, paths = self._memos, self._kept.read, self._paths
            for tid in tids:
                key = (pid, tid)
                sched = None
                m = memos.get(key)
                if sched_ok:
                    if m is not None and m.sched_fd >= 0:
                        sched = self._held_sched(m)
                    else:
                        try:
                            sched = read(paths.task(pid, tid, "schedstat"))
                        except (Absent, Denied):
                            pass
                    if sched is None and not listed:
                        break  # a thread is gone: the list changed, read it again
                if m is None:
                    tick.sched[key] = sched
                else:
                    m.sched_tick, m.sched_now = number, sched
                    if not listed and sched is not None and m.kids_sched == sched:
                        out.extend(m.kids)
                        continue
                try:
                    kids = [int(k) for k in self._kept.read_task_file(
                        paths.task(pid, tid, "children")).split()]
                except Absent:
                    continue
                if m is not None and sched is not None:
                    m.kids_sched, m.kids = sched, kids
                out.extend(kids)
            else:
                if listed or sched_ok:  # every thread of a remembered list was read: it holds
                    tick.tids[pid] = tids
                return out
            tids, listed = self._list_tids(st), True

    def _children_of_rows(self, pid: int, rows: list[_ThreadMemo], tick: _Tick) -> list[int] | None:
        """_children_of for a process whose every listed thread has a memo holding its schedstat
        descriptor: the hot loop of a wide job, one pread and one compare a thread. None when a
        read fails (a thread is gone: the caller lists them again)."""
        out: list[int] = []
        number, pread, limit = tick.number, self._kept.pread, SCHEDSTAT_LIMIT
        for m in rows:
            try:
                sched = pread(m.sched_fd, limit, 0)
            except OSError:
                return None
            m.sched_tick, m.sched_now = number, sched
            if sched == m.kids_sched:
                if m.kids:
                    out.extend(m.kids)
                continue
            try:
                kids = [int(k) for k in self._kept.read_task_file(
                    self._paths.task(pid, m.tid, "children")).split()]
            except Absent:
                continue
            m.kids_sched, m.kids = sched, kids
            out.extend(kids)
        return out

    def _rows_of(self, st: procfs.Stat, tids: list[int]) -> list[_ThreadMemo] | None:
        """The memos of this thread list, in its order, when every thread has one holding its
        schedstat descriptor; kept while the list is the same object (re-listing makes a new
        one) and the memos live (ProcessesProbe._forget clears them all when one goes)."""
        key = (st.pid, st.start_ticks)
        hit = self._rows.get(key)
        if hit is not None and hit[0] is tids:
            return hit[1]
        memos, pid = self._memos, st.pid
        rows = [memos.get((pid, tid)) for tid in tids]
        if not all(m is not None and m.sched_fd >= 0 for m in rows):
            return None
        found = cast("list[_ThreadMemo]", rows)
        self._rows[key] = (tids, found)
        return found

    def _held_sched(self, m: _ThreadMemo) -> bytes | None:
        """A thread's schedstat through the descriptor its memo holds; None when its task is gone
        (the descriptor is closed then, and the memo told)."""
        try:
            return self._kept.pread(m.sched_fd, SCHEDSTAT_LIMIT, 0)
        except OSError:
            self._kept.drop(m.sched_fd)
            m.sched_fd = -1
            return None

    # A process's thread list is re-listed when stat's thread count moves, or when a thread of
    # the remembered list is gone (one ended and another began between two ticks: the count
    # alone would not show it). Directory metadata is no cheaper signal: /proc/PID/task's mtime
    # is the inode's creation time and never moves, and its link count is 2 + the thread count,
    # the number stat already gives (checked on kernel 6.18).

    def _cached_tids(self, st: procfs.Stat) -> list[int] | None:
        tids = self._tid_lists.get((st.pid, st.start_ticks))
        return tids if tids is not None and len(tids) == st.num_threads else None

    def _list_tids(self, st: procfs.Stat) -> list[int]:
        tids = sorted(int(t) for t in self.roots.listdir(f"{self._pd(st.pid)}/task") if t.isdigit())
        self._tid_lists[(st.pid, st.start_ticks)] = tids
        return tids

    def _has_schedstat(self, pid: int) -> bool:
        """Whether this kernel has /proc/PID/task/TID/schedstat (CONFIG_SCHED_INFO; gVisor and
        fixture trees may not): without it, status's context switches tell whether a thread ran."""
        if self._schedstat_ok is None:
            if not os.path.isdir(self._pd(pid, pid)):
                return False  # decide on a live process
            self._schedstat_ok = os.path.isfile(f"{self._pd(pid, pid)}/schedstat")
        return self._schedstat_ok

    def _kept_or_none(self, path: str) -> bytes | None:
        """A kept file's bytes (procfiles.py); None when it is gone or hidden from us."""
        try:
            return self._kept.read(path)
        except (Absent, Denied):
            return None

    def _scan_all(self) -> dict[int, procfs.Stat]:
        stats = {}
        cache, self._stat_cache = self._stat_cache, {}
        if self._match is None and self._children_readable():  # the slices look at new ones
            listing = self.roots.listdir_ino(self._paths.root)
            self._host_known = frozenset(listing)
            names = [n for n, _ in listing]
        else:
            names = self.roots.listdir(self._paths.root)
        for name in names:
            if name.isdigit():
                st = self._read_stat(int(name), cache)
                if st is not None:
                    stats[int(name)] = st
        return stats

    def _read_stat(self, pid: int, cache: dict[str, tuple[str, procfs.Stat]],
                   kept: bool = False) -> procfs.Stat | None:
        """A process's stat, into this scan's cache; None when it exited since it was listed or
        is hidden from us (hidepid). Most processes on a host sleep: their stat line is the same
        as a tick ago, and its parse is reused (the read is not: it is how we know). `kept`: the
        job's own, read every tick by the tree walk, through a kept descriptor; a scan of the
        whole host opens and closes."""
        if kept:
            return self._kept_parsed(self._paths.pid(pid, "stat"), procfs.parse_stat, "stat", set())
        name = str(pid)
        try:
            text = self.roots.read_text(self._paths.pid(pid, "stat"))
        except (Absent, Denied):
            return None
        hit = cache.get(name)
        st = hit[1] if hit is not None and hit[0] == text else procfs.parse_stat(text)
        self._stat_cache[name] = (text, st)
        return st

    def _resolve(self, stats: dict[int, procfs.Stat]) -> list[tuple[int, int]]:
        """Target identities (pid, start_ticks) alive now, explicit ones first."""
        for pid in self._explicit:
            if pid in self._job or pid in self._missing:
                continue
            # Adopt an explicit pid only at the first look: a pid that appears later is a new
            # process that happens to get the number, not the job the user named.
            if self._first_collect and pid in stats:
                self._job[pid] = stats[pid].start_ticks
            else:
                self._missing.add(pid)
        if self._match is not None:
            excluded = self._ancestry(stats)
            for pid, st in stats.items():
                if pid in excluded or self._job.get(pid) == st.start_ticks:
                    continue
                if pid == 2 or st.ppid == 2:
                    continue  # kthreadd and kernel threads have no command line
                argv = self._argv(pid, st)
                if argv and self._match.search(" ".join(argv)) and self._users(pid):
                    self._job[pid] = st.start_ticks
        return [(p, s) for p, s in self._job.items() if p in stats and stats[p].start_ticks == s]

    def _users(self, pid: int) -> bool:
        """Whether a --match candidate belongs to the job's user (any process when unknown).
        Read after the pattern matched: a status read per candidate, not per host process."""
        return self.match_uid is None or uid_of(self.roots, pid) == self.match_uid

    def _ancestry(self, stats: dict[int, procfs.Stat]) -> set[int]:
        out, pid = set(), self._self_pid
        while pid is not None and pid > 0 and pid not in out:
            out.add(pid)
            pid = stats[pid].ppid if pid in stats else None
        return out

    @staticmethod
    def _tree(seeds: Iterable[tuple[int, int]], stats: dict[int, procfs.Stat],
              exclude: int | None) -> list[int]:
        """Seeds and their descendants, breadth first; never `exclude` (stallwatch run from
        inside the job's shell would otherwise watch itself)."""
        children: dict[int, list[int]] = {}
        for pid, st in stats.items():
            children.setdefault(st.ppid, []).append(pid)
        order, seen = [], set()
        queue = deque(p for p, _ in seeds)
        while queue:
            pid = queue.popleft()
            if pid in seen or pid == exclude:
                continue
            seen.add(pid)
            order.append(pid)
            queue.extend(sorted(children.get(pid, ())))
        return order

    def _argv(self, pid: int, st: procfs.Stat) -> tuple[str, ...]:
        # Read once per identity: cmdline takes the target's mmap lock, which a process stuck in a
        # page fault can hold for as long as the fault. comm is in the key because exec changes
        # the command line but keeps the pid and start time.
        key = (pid, st.start_ticks, st.comm)
        argv = self._cmdlines.get(key)
        if argv is None:
            try:
                raw = self.roots.read_bytes(f"{self._pd(pid)}/cmdline")
                argv = procfs.parse_cmdline(raw)
            except (Absent, Denied):
                argv = ()
            if argv or st.state in ("Z", "X"):
                self._cmdlines[key] = argv
        return argv

    def _cached_cmdline(self, pid: int, st: procfs.Stat) -> str | None:
        argv = self._cmdlines.get((pid, st.start_ticks, st.comm))
        return " ".join(argv) if argv else None
