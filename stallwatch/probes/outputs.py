"""The outputs probe: how many files the job has written, how big, and when the last one changed.

Listing 10^5 files every tick is too slow, and a listing is the truth only at the moment it is
taken. So: an in-memory index, fed by inotify events drained on each tick (probes/inotify.py)
and corrected by a periodic reconciliation (a recursive scandir), which alone decides what is true.
A lost event, an inotify queue overflow, or a network filesystem where inotify sees nothing (other
hosts' writes) can therefore leave the index wrong for at most one reconcile period and one
sweep (below); a lost event the kernel reports (IN_Q_OVERFLOW) for not even one tick.

Reconciliation is incremental. A directory whose mtime has not changed since we listed it still
has the same names, so its cached listing is reused (unless its mtime was within RACY_NS of the
listing itself: a later change in the same timestamp tick would leave mtime unchanged, the "racy
git" problem). Sizes of files written in place do not touch the directory's mtime, so recently
changed files ("hot", a bounded set) are re-stat'ed every tick, and each reconciliation re-lists
and re-stats a rotating share of the directories, all of them over `full_every` reconciliations,
which also catches an old file rewritten in place (in slices, so 10^6 files cost no 3 s tick).
While the inotify watch has reported every change since the last whole sweep, a periodic
sweep compares a changed directory's names with the index in C and lstats only the names that
events are pending for and the hot files (_relist_by_name): a name no event told of sends the
directory to the scandir listing, so a silently lost event is still found within a period.

The periodic reconciliation is also spread over ticks: a sweep is an iterative walk (a stack of
directories) resumed on the next tick, and each tick adds `reconcile_slice_entries` of credit
(a directory looked at, a name listed: one each) that the walk spends. A directory is listed
whole (never half a listing), so one tick may overspend; the debt is paid by the next ticks, which
then do no sweeping, so the sweep's cost per tick stays the slice on average, whatever the tree's
shape. 10^6 files then cost no 354 ms every 30 s but about a slice a tick, and the sweep takes
longer than the period (about work / slice ticks): a change events did not report is found within
that full sweep period. The first reconciliation (it learns the history), an inotify overflow and
a restarted watch run a whole sweep at once: events were lost and the index is wrong now, and
they are rare.

Not thread-safe, and needs not be: the collector's DeadlineRunner never overlaps two calls, and
the inotify queue is drained inside collect().
"""

from __future__ import annotations

import fnmatch
import heapq
import os
import re
import stat
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.model import Frozen
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.inotify import InotifyWatch
from stallwatch.probes.processes_obs import built
from stallwatch.kernel.proc import self_mountinfo
from stallwatch.kernel.roots import DEFAULT_ROOTS, Roots

RECONCILE_SLICE_ENTRIES = 400  # ~1.5 ms a tick here (10^6-file bench, docs/performance.md)
RACY_NS = 2_000_000_000  # FAT has 2 s mtimes; ext4/xfs are finer, NFS depends on the server
HOT_FRESH_S = 10.0  # a hot file changed this recently is re-stat'ed every tick ...
HOT_SLOW_EVERY_S = 5.0  # ... an older hot file this often ...
# ... and one closed after writing (inotify) and not opened since this often: only a write
# through another descriptor still open, a shared mapping or a truncate(2) by path can change it
# unseen by events, and the reconciliation finds those too.
HOT_CLOSED_EVERY_S = 30.0
MAX_PENDING = 200_000  # queued event paths; past this we drop them and reconcile instead
NETWORK_FS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "lustre", "gpfs", "beegfs",
    "glusterfs", "ceph", "orangefs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone",
    "fuse.juicefs", "fuse.glusterfs", "fuse.ceph", "fuse.cephfs", "fuse.lustre", "fuse.weka",
}


class OutputFile(Frozen):
    path: str  # relative to the outputs directory, `/`-separated
    size_bytes: int
    mtime_epoch_s: float
    age_s: float  # wall now minus mtime, never negative


_FILE_FIELDS = frozenset(OutputFile.model_fields)  # a record's fields set: all of them


class OutputsObs(Frozen):
    path: str
    status: ProbeStatus
    error: str | None = None
    watch_mode: Literal["inotify", "polling"] = "polling"
    fs_type: str | None = None
    watch_error: str | None = None  # why inotify is not in use, when it was wanted
    file_count: int = 0
    dir_count: int = 0  # directories below the root
    total_bytes: int = 0
    newest: OutputFile | None = None
    last_change_age_s: float | None = None  # a file appeared, grew, changed or vanished
    recent: tuple[OutputFile, ...] = ()  # the last new files, oldest first
    hot_files: int = 0  # files changed within hot_window_s (being written, or just written)
    events_seen: int = 0
    overflows: int = 0  # times events were known lost (kernel queue, or our pending bound)
    reconciliations: int = 0
    reconcile_changes: int = 0  # differences a reconciliation found that events had not shown
    last_reconcile_duration_s: float | None = None
    last_reconcile_age_s: float | None = None
    unreadable_dirs: int = 0  # in the last reconciliation


# --- filesystem type -------------------------------------------------------------------------


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)


def fs_type(path: str | os.PathLike[str], roots: Roots = DEFAULT_ROOTS) -> str | None:
    """The type of the mount holding `path`, from mountinfo (the longest matching mount point)."""
    try:
        text = self_mountinfo(roots)
    except Exception:  # noqa: BLE001 - unknown type just means "use inotify"
        return None
    real = os.path.realpath(path)
    best, best_type = -1, None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right:
            continue
        mp = _unescape(fields[4])
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) > best:
            best, best_type = len(mp), right.split()[0]
    return best_type


def is_network_fs(fstype: str | None) -> bool:
    return fstype is not None and (fstype in NETWORK_FS or fstype.startswith(("nfs", "cifs", "smb")))


# --- the index -------------------------------------------------------------------------------


@dataclass
class _Dir:
    mtime_ns: int = -1  # -1: never listed (known only from events): list it at reconciliation
    listed_ns: int = 0
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (size, mtime_ns)
    subdirs: set[str] = field(default_factory=set)


@dataclass
class _Sweep:
    """A reconciliation under way, resumed tick after tick."""
    full: bool
    phase: int | None
    known: set[str]  # directories indexed when it began: only these can be pruned as unseen
    stack: list[str] = field(default_factory=lambda: [""])
    seen: set[str] = field(default_factory=set)
    changes: int = 0
    unreadable: int = 0
    duration_s: float = 0.0


def _join(d: str, name: str) -> str:
    return f"{d}/{name}" if d else name


def _split(rel: str) -> tuple[str, str]:
    d, _, n = rel.rpartition("/")
    return d, n


class OutputsProbe:
    """Watches one outputs directory; `collect()` returns an OutputsObs and never raises for a
    missing, replaced or unreadable directory. Call `close()` to stop the inotify thread."""

    name = "outputs"
    FEW_OPEN = 8  # hot files not known closed, up to which _restat_hot looks them up directly

    def __init__(
        self, path: str | os.PathLike[str], clock: Clock = SYSTEM_CLOCK, reconcile_every_s: float = 30.0,
        pattern: str | None = None, use_inotify: bool = True, *, poll_every_s: float = 5.0,
        full_every: int = 10, recent_n: int = 16, hot_window_s: float = 60.0, max_hot: int = 256,
        roots: Roots = DEFAULT_ROOTS, name: str = "outputs",
        reconcile_slice_entries: int = RECONCILE_SLICE_ENTRIES,
    ) -> None:
        self.name = name  # DeadlineRunner keys in-flight calls by name: one per job's outputs
        self.root = os.path.abspath(os.fspath(path))
        self._base = self.root
        self.clock = clock
        self.reconcile_every_s = reconcile_every_s
        self.poll_every_s = poll_every_s  # the period when no events come (NFS, no inotify)
        self.full_every = max(1, full_every)
        self.reconcile_slice_entries = max(1, reconcile_slice_entries)
        self._sweep: _Sweep | None = None
        self._sweep_started: float | None = None
        self._credit = 0  # entries the sweep may still spend; negative: a debt from a big directory
        self.pattern = pattern
        self._match = re.compile(fnmatch.translate(pattern)).match if pattern else None
        self.use_inotify = use_inotify
        self.recent_n, self.hot_window_s, self.max_hot = recent_n, hot_window_s, max_hot
        self.roots = roots
        self._pending: dict[str, None] = {}  # event paths, deduplicated, insertion-ordered
        self._pending_lost = False
        self._events_seen = 0
        self._watch: InotifyWatch | None = None
        self._watch_ident: tuple[int, int] | None = None
        self._watch_error: str | None = None
        self._fs_type: str | None = None
        self._fs_checked = False
        self._overflows = 0
        self._reconciles = self._reconcile_changes = self._unreadable = 0
        self._reconcile_dur: float | None = None
        self._last_reconcile: float | None = None
        self._root_ident: tuple[int, int] | None = None
        self._base_ident: tuple[int, int] | None = None  # of the directory self._base named
        self._reset_index()
        self._last_change: float | None = None

    # -- index primitives

    def _reset_index(self) -> None:
        self._dirs: dict[str, _Dir] = {}
        self._count = self._bytes = 0
        self._newest: tuple[int, str] | None = None
        self._newest_stale = False
        # the last new files, oldest first: rel -> (its directory's rel, its name), split once
        self._recent: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # Both ordered by their value, oldest first (each write moves its key to the end, and
        # the clock only moves on), so a tick looks only at their ends, not at every hot file.
        self._hot: OrderedDict[str, float] = OrderedDict()  # hot file -> when it last changed
        # hot file -> when last re-stat'ed (when it got hot, before that), for the hot files
        # not in _closed: the keys of the two are _hot's, each ordered by its value
        self._hot_checked: OrderedDict[str, float] = OrderedDict()
        # Hot files closed after writing (inotify's IN_CLOSE_WRITE) and not opened since (IN_OPEN)
        # -> when last re-stat'ed: a writer must open them again to change them, so they are
        # re-stat'ed every HOT_CLOSED_EVERY_S only (issue 17: a job writing 5 files a second
        # kept ~50 fresh ones stat'ed every tick, then ~50 closed ones every tick at 5 s).
        self._closed: OrderedDict[str, float] = OrderedDict()
        self._just_closed: list[tuple[str, bool]] = []  # inotify's closes and opens, in order
        self._initial = True  # the next reconciliation learns history: no "changes", no "new"

    def _dir(self, rel: str) -> _Dir:
        d = self._dirs.get(rel)
        if d is None:
            d = self._dirs[rel] = _Dir()
            if rel:
                parent, name = _split(rel)
                self._dir(parent).subdirs.add(name)
        return d

    def _put(self, dirrel: str, name: str, size: int, mtime_ns: int, now: float) -> bool:
        d = self._dirs.get(dirrel) or self._dir(dirrel)
        old = d.files.get(name)
        if old == (size, mtime_ns):
            return False
        rel = f"{dirrel}/{name}" if dirrel else name  # _join, inline: ~10 calls a tick
        d.files[name] = (size, mtime_ns)
        self._bytes += size - (old[0] if old else 0)
        if old is None:
            self._count += 1
        if self._newest is None or mtime_ns >= self._newest[0]:
            self._newest = (mtime_ns, rel)
        if not self._initial:
            if old is None:
                self._recent[rel] = (dirrel, name)
                while len(self._recent) > self.recent_n:
                    self._recent.popitem(last=False)
            self._heat(rel, now)
            self._last_change = now
        return True

    def _heat(self, rel: str, now: float) -> None:
        hot, checked, closed = self._hot, self._hot_checked, self._closed
        hot[rel] = now
        hot.move_to_end(rel)
        closed.pop(rel, None)
        checked[rel] = now  # _checked, inline
        checked.move_to_end(rel)
        while len(hot) > self.max_hot:
            cold = hot.popitem(last=False)[0]
            checked.pop(cold, None)
            closed.pop(cold, None)

    def _drop(self, dirrel: str, name: str, now: float) -> bool:
        d = self._dirs.get(dirrel)
        old = d.files.pop(name, None) if d else None
        if old is None:
            return False
        rel = _join(dirrel, name)
        self._count -= 1
        self._bytes -= old[0]
        self._recent.pop(rel, None)
        self._hot.pop(rel, None)
        self._hot_checked.pop(rel, None)
        self._closed.pop(rel, None)
        if self._newest and self._newest[1] == rel:
            self._newest_stale = True
        self._last_change = now
        return True

    def _drop_dir(self, rel: str, now: float) -> int:
        gone = [k for k in self._dirs if k == rel or not rel or k.startswith(rel + "/")]
        n = 0
        for k in gone:
            for name in list(self._dirs[k].files):
                n += self._drop(k, name, now)
            del self._dirs[k]
        if rel:
            parent = self._dirs.get(_split(rel)[0])
            if parent:
                parent.subdirs.discard(_split(rel)[1])
        return n

    # -- reconciliation

    def _walk(self, stack: list[str], now: float, full: bool, seen: set[str], phase: int | None = None,
              sweep: _Sweep | None = None, quick: bool = False) -> int:
        """Bring the index under the directories on `stack` in line with the disk; returns the
        differences found. full: re-list and re-stat everything; phase: only the directories in
        that slice. With `sweep`: stops when its credit is spent, `stack` left as it is. quick:
        a directory whose names events kept may be checked by name (_relist_by_name)."""
        changes = 0
        quick = quick and self._match is None and self._watching()
        while stack and (sweep is None or self._credit > 0):
            rel = stack.pop()
            if sweep is not None:
                self._credit -= 1
            path = os.path.join(self._base, rel) if rel else self._base
            try:
                st = os.lstat(path)
            except OSError:
                continue  # gone since its parent was listed: pruned as unseen
            if not stat.S_ISDIR(st.st_mode):
                continue
            seen.add(rel)
            d = self._dirs.get(rel)
            dfull = full or (phase is not None and zlib.crc32(rel.encode()) % self.full_every == phase)
            if d is not None and not dfull and d.mtime_ns == st.st_mtime_ns and d.listed_ns - d.mtime_ns > RACY_NS:
                stack.extend(_join(rel, s) for s in d.subdirs)
                continue
            listed_ns = time.time_ns()  # compared with filesystem mtimes, so real wall time
            if quick and d is not None and not dfull and d.mtime_ns >= 0:
                found = self._relist_by_name(rel, path, d, now)
                if found is not None:
                    if sweep is not None:
                        self._credit -= found[1]
                    changes += found[0]
                    d.mtime_ns, d.listed_ns = st.st_mtime_ns, listed_ns
                    stack.extend(_join(rel, s) for s in d.subdirs)
                    continue
            try:
                with os.scandir(path) as it:
                    entries = list(it)
            except PermissionError:
                if sweep is not None:
                    sweep.unreadable += 1
                if d is not None:  # keep what we knew; still look below it
                    stack.extend(_join(rel, s) for s in d.subdirs)
                continue
            except OSError:
                seen.discard(rel)
                continue
            if sweep is not None:
                self._credit -= len(entries)
            d = self._dir(rel)
            names: set[str] = set()
            subdirs: set[str] = set()
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        subdirs.add(e.name)
                        continue
                except OSError:
                    continue
                if self._match and not self._match(e.name):
                    continue
                names.add(e.name)
                frel = _join(rel, e.name)
                if not dfull and e.name in d.files and frel not in self._hot:
                    continue  # a cold file under the same name: its cached stat stands
                try:
                    fst = e.stat(follow_symlinks=False)
                except OSError:
                    names.discard(e.name)
                    continue
                changes += self._put(rel, e.name, fst.st_size, fst.st_mtime_ns, now)
            for name in [n for n in d.files if n not in names]:
                changes += self._drop(rel, name, now)
            for sub in d.subdirs - subdirs:
                changes += self._drop_dir(_join(rel, sub), now)
            d.subdirs = subdirs
            d.mtime_ns, d.listed_ns = st.st_mtime_ns, listed_ns
            stack.extend(_join(rel, s) for s in subdirs)
        return changes

    def _relist_by_name(self, rel: str, path: str, d: _Dir, now: float) -> tuple[int, int] | None:
        """The listing of a known directory, for a periodic sweep while the inotify watch has
        reported every change since the index was last made whole (a lost event ends the sliced
        sweep: the next is whole, by scandir). Its names are compared with the index in C, and
        only the names that events are pending for and the hot files are lstat'ed, in listing
        order, as the scandir loop would: what that loop does, without a Python step for each
        of the directory's thousands of cold files (issue 17: the directory being written was
        listed whole every period). None, and nothing changed, where the names say more than
        events did (a name gone or new without an event, a file now a directory): the caller
        lists it by scandir. Returns (differences, names listed)."""
        try:
            names = os.listdir(path)
        except OSError:
            return None  # the scandir below says why
        listed = set(names)
        new = listed.difference(d.files, d.subdirs)
        # every indexed name still there, none both a file and a directory in the index
        if len(listed) - len(new) != len(d.files) + len(d.subdirs) or len(self._pending) > 4096:
            return None
        base = self._base if self._base.endswith("/") else self._base + "/"
        prefix = base + rel + "/" if rel else base
        cut = len(prefix)
        evented = {p[cut:] for p in self._pending if p.startswith(prefix) and "/" not in p[cut:]}
        if not new <= evented:
            return None  # a name no event told of
        hot_prefix = rel + "/" if rel else ""
        cut = len(hot_prefix)
        hot = {h[cut:] for h in self._hot if h.startswith(hot_prefix) and "/" not in h[cut:]}
        look = evented | hot
        # The scandir loop re-stats a new or hot file only: a cold one's cached stat stands (its
        # event, if any, is applied right after the sweep). Evented names are lstat'ed anyway,
        # for their kind.
        stats: list[tuple[str, os.stat_result | None]] = []
        for name in names if look else ():
            if name in look:
                try:
                    st = os.lstat(path + "/" + name)
                except OSError:
                    st = None
                if st is not None and stat.S_ISDIR(st.st_mode) != (name in d.subdirs):
                    return None  # a file now a directory, a new directory, or the reverse
                if name not in d.subdirs and (name in hot or name not in d.files):
                    stats.append((name, st))
        changes = 0
        gone: set[str] = set()
        for name, st in stats:
            if st is None:
                gone.add(name)  # vanished since the listing, as the scandir loop's failed stat
            else:
                changes += self._put(rel, name, st.st_size, st.st_mtime_ns, now)
        for name in [n for n in d.files if n in gone] if gone else ():
            changes += self._drop(rel, name, now)
        return changes, len(names)

    def _reconcile(self, now: float, full: bool, phase: int | None = None, sliced: bool = False) -> None:
        """Start a sweep (in place of one under way) and run it: whole, or its first slice."""
        self._sweep = _Sweep(full=full, phase=phase, known=set(self._dirs))
        self._sweep_started = now
        self._continue_sweep(now, sliced)

    def _continue_sweep(self, now: float, sliced: bool) -> None:
        sw = self._sweep
        assert sw is not None
        t0 = time.perf_counter()  # a cost, not a point on the job's timeline: real time
        if sliced:
            self._credit = min(self._credit + self.reconcile_slice_entries, self.reconcile_slice_entries)
        else:
            self._credit = 1 << 62  # whole: no limit that a tree can reach
        # Sliced: the periodic sweep, which may check names only (_relist_by_name); a whole one
        # follows lost events or a restarted watch, and lists by scandir.
        sw.changes += self._walk(sw.stack, now, sw.full, sw.seen, sw.phase, sweep=sw, quick=sliced)
        if not sliced:
            self._credit = 0
        if sw.stack:
            sw.duration_s += time.perf_counter() - t0
            return
        self._sweep = None
        for rel in [k for k in sw.known if k not in sw.seen]:
            if rel in self._dirs:
                sw.changes += self._drop_dir(rel, now)
        if self._initial:
            self._learn_history(now)
        else:
            self._reconcile_changes += sw.changes
        self._unreadable = sw.unreadable
        self._reconciles += 1
        self._last_reconcile = now
        self._reconcile_dur = sw.duration_s + time.perf_counter() - t0

    def _learn_history(self, now: float) -> None:
        self._initial = False
        wall = self.clock.time()
        files = ((m, _join(d, n)) for d, dd in self._dirs.items() for n, (_, m) in dd.files.items())
        newest = heapq.nlargest(self.recent_n, files)
        for m, rel in reversed(newest):
            self._recent[rel] = _split(rel)
            if wall - m / 1e9 <= self.hot_window_s:
                self._heat(rel, now - max(0.0, wall - m / 1e9))
        if newest:
            # When the last change happened is unknown: the newest mtime is the best bound
            # (unless we saw a change ourselves, such as the old directory vanishing).
            estimate = now - max(0.0, wall - newest[0][0] / 1e9)
            self._last_change = max(estimate, self._last_change or estimate)

    def _recompute_newest(self) -> None:
        files = ((m, _join(d, n)) for d, dd in self._dirs.items() for n, (_, m) in dd.files.items())
        self._newest = max(files, default=None)
        self._newest_stale = False

    # -- events

    def _enqueue(self, *paths: str) -> None:
        self._events_seen += 1
        for p in paths:
            if p:
                self._pending[p] = None
        if len(self._pending) > MAX_PENDING:
            self._pending.clear()  # bounded memory; the reconciliation we force recovers
            self._pending_lost = True

    def _apply_events(self, now: float) -> dict[str, str]:
        """Each event path's index entry brought in line; returns path -> its rel (a file closed
        after writing is in both its events and the closes: cut once)."""
        pending, self._pending = self._pending, {}
        rels: dict[str, str] = {}
        for p in pending:
            rel = rels[p] = self._rel(p)
            if rel == "." or rel.startswith("../") or rel == "..":
                continue
            dirrel, _, name = rel.rpartition("/")  # _split, inline
            try:
                st = os.lstat(p)
            except OSError:
                if rel in self._dirs:
                    self._drop_dir(rel, now)
                else:
                    self._drop(dirrel, name, now)
                continue
            if stat.S_ISDIR(st.st_mode):
                if rel not in self._dirs or self._dirs[rel].mtime_ns == -1:
                    self._walk([rel], now, True, set())  # a new directory: its files came with it
            elif not self._match or self._match(name):
                self._put(dirrel, name, st.st_size, st.st_mtime_ns, now)
        return rels

    def _rel(self, path: str) -> str:
        """os.path.relpath(path, base) for an event's path. The watch joins each path from the
        base and a name the kernel gave, so it is the base, a slash and plain components: cut,
        not re-normalised (relpath costs ~2.5 us, twice for each written file; issue 17)."""
        prefix = self._base if self._base.endswith("/") else self._base + "/"
        if path.startswith(prefix):
            rel = path[len(prefix):]
            # No empty, "." or ".." component: conservative (a name that starts with a dot
            # takes relpath, which gives the same answer), without a list of parts.
            if rel and rel[0] not in "./" and rel[-1] != "/" and "//" not in rel and "/." not in rel:
                return rel
        return os.path.relpath(path, self._base).replace(os.sep, "/")

    def _checked(self, rel: str, now: float) -> None:
        self._hot_checked[rel] = now
        self._hot_checked.move_to_end(rel)

    def _restat_hot(self, now: float, reopened: list[str] | tuple[()] = ()) -> None:
        # A file that changed within HOT_FRESH_S is re-stat'ed every tick; one that has been
        # still for longer, or was closed after writing, every HOT_SLOW_EVERY_S: a job writing 5
        # files a second keeps ~300 files hot, and stat'ing all of them every tick was most of
        # this probe's cost. Only the ends of the two ordered maps are looked at (issue 17:
        # scanning all 256 hot entries cost ~40-90 us a tick for ~10 that were due).
        hot, checked, closed = self._hot, self._hot_checked, self._closed
        while hot:
            rel, t = next(iter(hot.items()))
            if now - t <= self.hot_window_s:
                break
            del hot[rel]
            checked.pop(rel, None)
            closed.pop(rel, None)
        due: dict[str, None] = {}
        if len(checked) <= self.FEW_OPEN:
            # Nearly every hot file closed (a job that closes what it writes): the few others
            # are looked up, not found by walking past the ~50 fresh closed ones. Newest first,
            # as below.
            fresh = [r for r in checked if now - hot[r] < HOT_FRESH_S]
            fresh.sort(key=hot.__getitem__, reverse=True)
            due = dict.fromkeys(fresh)
        else:
            for rel in reversed(hot):  # the fresh ones: changed within HOT_FRESH_S
                if now - hot[rel] >= HOT_FRESH_S:
                    break
                if rel not in closed:
                    due[rel] = None
        for rel, t in checked.items():  # the slow ones: not looked at for HOT_SLOW_EVERY_S
            if now - t < HOT_SLOW_EVERY_S:
                break
            due[rel] = None
        for rel, t in closed.items():  # closed after writing, not opened since
            if now - t < HOT_CLOSED_EVERY_S:
                break
            due[rel] = None
        for rel in reopened:  # opened again this tick: an O_TRUNC open changed it already
            due[rel] = None
        # A closed file is re-stat'ed every HOT_SLOW_EVERY_S: at 5 files a second and 1 s ticks,
        # ~50 a tick, nearly all unchanged. So each costs the lstat and a lookup; os.path.join
        # (the same string for a relative key) and _put's bookkeeping only when it changed.
        prefix = self._base if self._base.endswith("/") else self._base + "/"
        for rel in due:
            if rel not in hot:  # dropped meanwhile, with its directory
                continue
            if rel in closed:
                closed[rel] = now
                closed.move_to_end(rel)
            else:
                checked[rel] = now  # _checked, inline
                checked.move_to_end(rel)
            dirrel, _, name = rel.rpartition("/")  # _split, inline
            try:
                st = os.lstat(prefix + rel)
            except OSError:
                self._drop(dirrel, name, now)
                continue
            if stat.S_ISDIR(st.st_mode):
                continue
            d = self._dirs.get(dirrel)
            if d is None or d.files.get(name) != (st.st_size, st.st_mtime_ns):
                self._put(dirrel, name, st.st_size, st.st_mtime_ns, now)

    # -- the inotify watch

    def _watching(self) -> bool:
        w = self._watch
        return w is not None and w.alive

    def _ensure_watch(self, ident: tuple[int, int]) -> bool:
        """Start (or restart) the watch; True when it was (re)started, so events may be missing."""
        if not self.use_inotify:
            return False
        if not self._fs_checked:
            self._fs_checked = True
            self._fs_type = fs_type(self._base, self.roots)
        if is_network_fs(self._fs_type):
            return False  # inotify would see only this host's writes: poll instead
        if self._watching() and self._watch_ident == ident:
            return False
        self._stop_watch()
        try:
            self._watch = InotifyWatch(self._base)
        except Exception as e:  # noqa: BLE001 - ENOSPC (watch limit), EMFILE (instances), ...
            self._watch_error = f"inotify unavailable, polling: {type(e).__name__}: {e}"
            return False
        self._watch_ident, self._watch_error = ident, None
        return True

    def _drain_watch(self) -> bool:
        """Queue what the kernel said since the last tick; True when events were lost."""
        w = self._watch
        if w is None:
            return False
        paths = w.drain()
        if paths:
            self._enqueue(*paths)
        closes, w.closes = w.closes, []
        self._just_closed.extend(closes)
        lost, w.lost = w.lost, False
        if w.error:
            self._watch_error = w.error
        return lost

    def _stop_watch(self) -> None:
        w, self._watch, self._watch_ident = self._watch, None, None
        if w is not None:
            w.close()

    def close(self) -> None:
        self._stop_watch()

    def __enter__(self) -> OutputsProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per tick

    def collect(self) -> OutputsObs:
        now = self.clock.monotonic()
        try:
            st = self._resolve_base()
        except FileNotFoundError:
            return self._gone(now, ProbeStatus.absent, f"{self.root} does not exist")
        except PermissionError as e:
            return self._obs(now, ProbeStatus.denied, f"{self.root}: {e.strerror}")
        except OSError as e:
            return self._gone(now, ProbeStatus.error, f"{self.root}: {e.strerror or e}")
        if not stat.S_ISDIR(st.st_mode):
            return self._gone(now, ProbeStatus.not_a_dir, f"{self.root} is not a directory")
        ident = (st.st_dev, st.st_ino)
        if self._root_ident is not None and ident != self._root_ident:
            self._gone(now, ProbeStatus.absent, None)  # replaced: nothing we knew is there
        self._root_ident = ident
        restarted = self._ensure_watch(ident)
        period = self.reconcile_every_s if self._watching() else min(self.reconcile_every_s, self.poll_every_s)
        lost_events = self._drain_watch()
        lost, self._pending_lost = self._pending_lost or lost_events, False
        self._overflows += lost
        phase = self._reconciles % self.full_every
        if self._initial or lost or restarted or self._sweep_started is None:
            # the index is unknown or missed events now: a whole sweep at once (the rest of one
            # under way is dropped: this one covers it)
            self._reconcile(now, full=self._initial, phase=phase)
        elif self._sweep is not None:
            self._continue_sweep(now, sliced=True)
        elif now - self._sweep_started >= period:
            self._reconcile(now, full=False, phase=phase, sliced=True)
        rels = self._apply_events(now)
        reopened: list[str] = []
        for p, closed in self._just_closed:  # after their events' lstat: that is their closed state
            rel = rels.get(p)
            if rel is None:
                rel = self._rel(p)
            if rel not in self._hot:
                continue
            if closed:
                self._hot_checked.pop(rel, None)
                self._closed[rel] = now
                self._closed.move_to_end(rel)
            elif self._closed.pop(rel, None) is not None:
                self._checked(rel, now)  # at the hot cadence again, from now on
                reopened.append(rel)
        self._just_closed.clear()
        self._restat_hot(now, reopened)
        return self._obs(now, ProbeStatus.ok, None)

    def _resolve_base(self) -> os.stat_result:
        """The root's real path (inotify does not follow a symlinked root, and event paths and
        the index are then all under one spelling) and its stat. realpath lstats every component
        in Python (~8-15 us); the last one is reused while the root is still the directory it
        named: the same (st_dev, st_ino) reached through the root and through that real path
        itself, no link on its last component. Any other answer resolves afresh."""
        st = os.stat(self.root)
        ident = (st.st_dev, st.st_ino)
        if ident == self._base_ident:
            try:
                lst = os.lstat(self._base)
            except OSError:
                lst = None
            if lst is not None and stat.S_ISDIR(lst.st_mode) and (lst.st_dev, lst.st_ino) == ident:
                return st
        self._base_ident = None
        self._base = os.path.realpath(self.root)
        st = os.stat(self._base)
        if stat.S_ISDIR(st.st_mode):
            self._base_ident = (st.st_dev, st.st_ino)
        return st

    def _gone(self, now: float, status: ProbeStatus, error: str | None) -> OutputsObs:
        self._stop_watch()
        self._pending.clear()
        self._sweep = None
        if self._count or self._dirs:
            if self._count:
                self._last_change = now  # every file we knew vanished with the directory
            self._reset_index()
        self._root_ident = None
        return self._obs(now, status, error)

    def _file(self, rel: str, dirrel: str, name: str, wall: float) -> OutputFile | None:
        d = self._dirs.get(dirrel)
        info = d.files.get(name) if d else None
        if info is None:
            return None
        mtime = info[1] / 1e9
        # unvalidated (processes_obs.built): our own typed values, ~17 records a tick; given in
        # the declared order with every field set, so built need not reorder them
        return built(OutputFile, {"path": rel, "size_bytes": info[0], "mtime_epoch_s": mtime,
                                  "age_s": max(0.0, wall - mtime)}, set(_FILE_FIELDS))

    def _obs(self, now: float, status: ProbeStatus, error: str | None) -> OutputsObs:
        if self._newest_stale:
            self._recompute_newest()
        wall = self.clock.time()
        newest = self._file(self._newest[1], *_split(self._newest[1]), wall) if self._newest else None
        recent_l = []
        dirs = self._dirs
        newest_rel = newest.path if newest is not None else None
        for rel, (dirrel, name) in self._recent.items():
            if rel == newest_rel:  # the newest file is most often the last new one: one record
                recent_l.append(newest)
                continue
            # _file, inline: its call for each of the 16 was a tenth of the collect's work
            d = dirs.get(dirrel)
            info = d.files.get(name) if d is not None else None
            if info is not None:
                mtime = info[1] / 1e9
                recent_l.append(built(OutputFile, {"path": rel, "size_bytes": info[0], "mtime_epoch_s": mtime,
                                                   "age_s": max(0.0, wall - mtime)}, set(_FILE_FIELDS)))
        recent = tuple(recent_l)
        # Unvalidated, as _file; float(): a test's clock may count in ints. Given in the declared
        # order with every field set: built need not reorder them.
        values = dict(
            path=self.root, status=status, error=error,
            watch_mode="inotify" if self._watching() else "polling", fs_type=self._fs_type,
            watch_error=self._watch_error, file_count=self._count, dir_count=max(0, len(self._dirs) - 1),
            total_bytes=self._bytes, newest=newest,
            last_change_age_s=None if self._last_change is None else float(max(0.0, now - self._last_change)),
            recent=recent, hot_files=len(self._hot), events_seen=self._events_seen,
            overflows=self._overflows, reconciliations=self._reconciles,
            reconcile_changes=self._reconcile_changes, last_reconcile_duration_s=self._reconcile_dur,
            last_reconcile_age_s=None if self._last_reconcile is None else float(now - self._last_reconcile),
            unreadable_dirs=self._unreadable,
        )
        return built(OutputsObs, values, set(values))
