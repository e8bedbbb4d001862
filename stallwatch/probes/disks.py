"""Disks probe: block device I/O rates and the space, mount and device behind each watched path.

Two kinds of source with different risks. /proc/diskstats, mountinfo and sysfs are kernel memory:
read inline. statvfs, realpath and listing /dev/shm go through the watched filesystem and can
block forever (frozen fs, dead NFS), so they run in worker threads under one shared deadline; a
worker that never returns is abandoned, reported, and not restarted until it does, so stuck
threads never pile up tick after tick.
"""

from __future__ import annotations

import os
import posixpath
import select
import time
from dataclasses import dataclass
from typing import Any, Literal
from collections.abc import Callable

from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.kernel import proc as kproc
from stallwatch.kernel.procfiles import ProcPaths
from stallwatch.kernel.diskfs import (
    SECTOR_BYTES, BlockDeviceRef, DiskStat, MountInfo, device_for_mount, diskstats_path, mount_for_path,
    parse_diskstats, parse_mountinfo, path_in_filesystem,
)
from stallwatch.model import Frozen
from stallwatch.probes.base import HANDOFF_SHARE, Call, Lane, ProbeStatus, field_defaults, made
from stallwatch.probes.processes_obs import built
from stallwatch.kernel.roots import DEFAULT_ROOTS, Absent, Denied, Roots, read_all

SHM_PREFIXES = ("sgl_shm",)  # SGLang's leaked sgl_shm_mm_* segments filled /dev/shm (#40723)
_SHM_LIST_LIMIT = 100_000  # a runaway leak must not turn one listing into a memory problem
# Listing /dev/shm was most of the disks probe's CPU (issue 17): a busy node's (torch, NCCL,
# leaked semaphores) changes every second, and a listing of this host's 650 entries costs 0.7-6
# ms of CPU. Its counts only explain shm_filling, whose condition is statvfs's used % (read every
# tick), so they are listed again:
# - at most every SHM_MIN_RELIST_S, when it holds SGLang segments (their sizes change without
#   touching the directory), or when it is SHM_CLOSE_PCT used and its mtime moved (an entry
#   created, removed or renamed);
# - otherwise every SHM_RELIST_S, changed or not.
# A listing taken within SHM_RACY_NS of the directory's mtime is not trusted: a later change in
# the same timestamp tick would leave the mtime where it was.
SHM_MIN_RELIST_S = 10.0
SHM_RELIST_S = 30.0
SHM_CLOSE_PCT = 50.0
SHM_RACY_NS = 1_000_000_000
DEVICE_TTL_S = 60.0  # a mount's block device (loop backing file, dm name, slaves) is re-read this often
# A path's realpath is reused while statvfs of the path names the same filesystem (f_fsid), for
# at most this long (issue 17: a walk of lstat calls a path a tick, more than its statvfs).
RESOLVE_TTL_S = 10.0


class BlockDeviceIO(Frozen):
    name: str
    major: int
    minor: int
    interval_s: float | None = None  # None on the first sample: rates need two
    read_bytes_per_s: float | None = None
    write_bytes_per_s: float | None = None
    read_iops: float | None = None
    write_iops: float | None = None
    await_ms: float | None = None  # mean time per completed I/O in the interval (iostat's await)
    busy_pct: float | None = None  # share of the interval with I/O in flight (io_ticks)
    inflight_ios: int = 0
    # In flight > 0 while no read/write/discard/flush completed: the device completes nothing.
    inflight_stuck_for_s: float = 0.0
    read_bytes_total: int = 0
    write_bytes_total: int = 0
    completed_ios_total: int = 0


class PathUsage(Frozen):
    path: str
    kind: Literal["path", "dev_shm"] = "path"
    status: ProbeStatus = ProbeStatus.ok  # timeout: this tick's call; busy: stuck since earlier
    detail: str | None = None  # evidence sentence when status is not ok
    exists: bool | None = None  # False: not created yet, numbers are from its nearest parent
    resolved_path: str | None = None
    mount: MountInfo | None = None
    fs_path: str | None = None  # the path inside its filesystem, when bind-mounted elsewhere
    device: BlockDeviceRef | None = None
    statvfs_latency_s: float | None = None
    stuck_for_s: float | None = None  # how long the filesystem call has been outstanding
    total_bytes: int | None = None
    free_bytes: int | None = None  # available to unprivileged writers (df's Avail)
    free_bytes_root: int | None = None  # including blocks reserved for root
    used_pct: float | None = None  # as df computes it: used / (used + available)
    total_inodes: int | None = None
    free_inodes: int | None = None
    inodes_used_pct: float | None = None
    read_only: bool | None = None
    shm_segments: int | None = None  # dev_shm only: entries in /dev/shm
    sgl_shm_segments: int | None = None  # ... of them named like SGLang's segments
    sgl_shm_bytes: int | None = None


class DisksObs(Frozen):
    devices: tuple[BlockDeviceIO, ...] = ()
    paths: tuple[PathUsage, ...] = ()
    diskstats_status: ProbeStatus = ProbeStatus.ok
    mountinfo_status: ProbeStatus = ProbeStatus.ok
    errors: tuple[str, ...] = ()


_IO_DEFAULTS = field_defaults(BlockDeviceIO)
_USAGE_DEFAULTS = field_defaults(PathUsage)
_SPACE_FIELDS = ("total_bytes", "free_bytes", "free_bytes_root", "used_pct", "total_inodes", "free_inodes",
                 "inodes_used_pct")  # _space's
_SHM_FIELDS = ("shm_segments", "sgl_shm_segments", "sgl_shm_bytes")
_OBS_DEFAULTS = field_defaults(DisksObs)


@dataclass
class _FsFacts:
    """What a worker learned by touching the filesystem."""

    resolved: str
    exists: bool
    st: os.statvfs_result
    shm: tuple[int, int, int] | None = None  # (all entries, sgl entries, sgl bytes)


class DisksProbe:
    name = "disks"

    def __init__(
        self,
        paths: list[str | os.PathLike[str]],
        roots: Roots = DEFAULT_ROOTS,
        clock: Clock = SYSTEM_CLOCK,
        statvfs_deadline_s: float = 2.0,
        *,
        dev_shm: str | None = "/dev/shm",
        # A job in another mount namespace: map paths with its mountinfo. statvfs still runs in
        # the watchdog's namespace, so pass paths as the watchdog sees them.
        mountinfo_pid: int | None = None,
        statvfs: Callable[[str], os.statvfs_result] = os.statvfs,  # injected by tests
    ) -> None:
        self.paths = [posixpath.normpath(os.path.abspath(os.fspath(p))) for p in paths]
        self.roots = roots
        self.clock = clock
        self.statvfs_deadline_s = statvfs_deadline_s
        self.dev_shm = dev_shm
        self.mountinfo_pid = mountinfo_pid
        self._statvfs = statvfs
        self._calls: dict[str, tuple[Call, float]] = {}  # path -> its last call, when queued
        # One lane thread for all paths, one after the other; a path the lane has not reached
        # when it is late gets a thread of its own (base.Lane): one handoff a tick, not one a path.
        self._lane = Lane("statvfs:", clock)
        # mountinfo rarely changes: its parse, and the sysfs walk to each mount's block device,
        # are reused while its text stays the same (the devices for at most DEVICE_TTL_S).
        self._mi_text: str | None = None
        self._mi_parsed: list[MountInfo] = []
        # On the real procfs mountinfo is pollable (proc(5)): a mount or unmount raises POLLPRI on
        # a descriptor kept open, so it is re-read only then, not every tick. Fixture trees (and a
        # poll that fails) fall back to reading it every tick and comparing the text.
        self._mi_poll: select.poll | None = None
        self._mi_fd: int | None = None
        self._mi_fresh = False  # read since the last event: nothing changed until POLLPRI
        self._mi_path: str | None = None
        # mount_id -> its device, when read; cleared with the mount table it is unique in (a
        # MountInfo as the key hashed its eleven fields in Python, on each look-up)
        self._devices: dict[int, tuple[BlockDeviceRef | None, float]] = {}
        self._mount_of: dict[str, MountInfo | None] = {}  # path -> mount, while mountinfo is the same
        self._diskstats_lines: dict[str, DiskStat] = {}  # a line as last read -> its parse
        # /proc/diskstats on the real procfs is read through a kept descriptor, from offset 0
        # each tick (a seq file renders afresh at offset 0): no path walk, open and close a
        # tick (issue 17). -1: a fixture tree, whose files are replaced on disk: read by path.
        self._ds_fd: int | None = None
        self._prev: dict[str, tuple[DiskStat, float]] = {}
        # device -> (its counters, its row's fields over a second) while they stay the same: an
        # idle device's row differs from one tick to the next by interval_s alone (_idle_row)
        self._idle: dict[str, tuple[DiskStat, dict[str, Any]]] = {}
        self._stuck_since: dict[str, float] = {}
        # /dev/shm's (dev, ino, mtime_ns) (None: listed too close to its mtime to be trusted),
        # when it was listed (wall ns) and what it held.
        self._shm_seen: tuple[tuple[int, int, int] | None, int, tuple[int, int, int]] | None = None
        # path -> (its realpath, the f_fsid statvfs gave, when resolved); each path's own call
        # reads and writes its entry, and one path has one call at a time.
        self._resolved: dict[str, tuple[str, int, float]] = {}
        # path -> ((kind, resolved, exists, with shm counts), its record's fields but the numbers,
        # merged into the defaults (its mount and device among them), the names its record sets)
        self._answered_base: dict[str, tuple[tuple[Any, ...], dict[str, Any], frozenset[str]]] = {}

    # -- the tick ------------------------------------------------------------------------------

    def collect(self) -> DisksObs:
        errors: list[str] = []
        tick_start = self.clock.monotonic()
        targets = [(p, "path") for p in self.paths]
        if self.dev_shm and self.dev_shm not in self.paths:
            targets.append((self.dev_shm, "dev_shm"))
        # Start the filesystem calls first so their deadline overlaps the /proc work.
        fresh: list[Call] = []
        calls = {p: self._start(p, kind == "dev_shm", tick_start, fresh) for p, kind in targets}
        batch = self._lane.start(fresh)
        self._lane.retire(calls)

        mounts, mountinfo_status = self._mountinfo(errors)
        stats, diskstats_status = self._diskstats(errors)

        until = tick_start + self.statvfs_deadline_s
        self._lane.wait(batch, tick_start + HANDOFF_SHARE * self.statvfs_deadline_s, until)
        # A call stuck since an earlier tick is waited for too (a mount that answers again, or
        # fails at last, is seen this tick), never started again.
        for call, _ in calls.values():
            if not call.done and call.batch is not None and call.batch is not batch:
                call.batch.wait(until - self.clock.monotonic())
        now = self.clock.monotonic()
        paths = [self._path_entry(p, kind, calls[p], mounts, tick_start, now) for p, kind in targets]
        # /dev/shm is reported only where it exists (some containers have none).
        paths = [u for u in paths if not (u.kind == "dev_shm" and u.status is ProbeStatus.absent)]

        watched = {n for u in paths if u.device for n in (u.device.name, u.device.parent_disk) if n}
        devices = self._rates(stats, now, watched)
        return made(DisksObs, _OBS_DEFAULTS, dict(
            devices=tuple(devices), paths=tuple(paths), diskstats_status=diskstats_status,
            mountinfo_status=mountinfo_status, errors=tuple(errors),
        ))

    # -- kernel-memory sources (cannot hang) ---------------------------------------------------

    def _mountinfo_changed(self, path: str) -> bool:
        """False only when a kept, polled descriptor says nothing was mounted or unmounted since
        the last read."""
        if self._mi_poll is None and self._mi_fd is None:
            try:
                on_procfs = ProcPaths(self.roots).is_procfs()
                if on_procfs:
                    self._mi_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    self._mi_poll = select.poll()
                    self._mi_poll.register(self._mi_fd, select.POLLPRI | select.POLLERR)
            except OSError:
                self._mi_poll = None
            if self._mi_poll is None:
                self._mi_fd = -1  # never again: read every tick
            return True
        if self._mi_poll is None or not self._mi_fresh:
            return True
        try:
            events = self._mi_poll.poll(0)
        except OSError:
            events = [(-1, select.POLLERR)]  # read as an error on the mount table: re-read it
        if events and any(ev & select.POLLNVAL for _, ev in events):
            self.close()
        return bool(events)

    def close(self) -> None:
        """The kept mountinfo and diskstats descriptors (the statvfs workers end on their own)."""
        if self._mi_fd is not None and self._mi_fd >= 0:
            os.close(self._mi_fd)
        if self._ds_fd is not None and self._ds_fd >= 0:
            os.close(self._ds_fd)
        self._mi_poll, self._mi_fd, self._mi_fresh, self._ds_fd = None, -1, False, -1

    def _mountinfo(self, errors: list[str]) -> tuple[list[MountInfo], ProbeStatus]:
        if self._mi_path is None:  # built once: the roots and the pid are the probe's for life
            self._mi_path = kproc.mountinfo_path(self.roots, self.mountinfo_pid or None)
        path = self._mi_path
        if not self._mountinfo_changed(path):
            return self._mi_parsed, ProbeStatus.ok
        self._mi_fresh = False
        try:
            text = self.roots.read_text(path, 16 << 20)
            self._mi_fresh = True
            if text != self._mi_text:
                self._mi_text, self._mi_parsed = text, parse_mountinfo(text)
                self._devices.clear()
                self._mount_of.clear()
            return self._mi_parsed, ProbeStatus.ok
        except Absent as e:
            errors.append(f"mountinfo absent: {e}")
            return [], ProbeStatus.absent
        except Denied as e:
            errors.append(f"mountinfo denied: {e}")
            return [], ProbeStatus.denied

    def _diskstats(self, errors: list[str]) -> tuple[dict[str, DiskStat], ProbeStatus]:
        try:
            text = self._diskstats_text()
            return parse_diskstats(text, self._diskstats_lines), ProbeStatus.ok
        except Absent as e:
            errors.append(f"diskstats absent: {e}")
            return {}, ProbeStatus.absent
        except Denied as e:  # systemd ProtectProc/ProcSubset=pid hides it (docs/field.md)
            errors.append(f"diskstats denied: {e}")
            return {}, ProbeStatus.denied

    def _diskstats_text(self) -> str:
        if self._ds_fd is None:
            self._ds_fd = -1
            if ProcPaths(self.roots).is_procfs():
                try:
                    self._ds_fd = os.open(diskstats_path(self.roots), os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    pass  # read by path: its error is this tick's status
        if self._ds_fd < 0:
            return kproc.diskstats(self.roots)
        try:
            return read_all(self._ds_fd, 16 << 20).decode("utf-8", "replace")
        except OSError:
            os.close(self._ds_fd)
            self._ds_fd = None  # opened again next tick
            return kproc.diskstats(self.roots)

    def _rates(self, stats: dict[str, DiskStat], now: float, watched: set[str]) -> list[BlockDeviceIO]:
        out: list[BlockDeviceIO] = []
        for name, cur in stats.items():
            prev_t = self._prev.get(name)
            self._prev[name] = (cur, now)
            # Dozens of never-used loop/ram devices would only bloat every trace line. Such a
            # device has nothing in flight, so it is not stuck: no row is built for it (issue 17).
            if name in watched or cur.completed_ios or cur.inflight_ios:
                if prev_t is not None and prev_t[0] is cur and not cur.inflight_ios and now > prev_t[1]:
                    out.append(self._idle_row(cur, now - prev_t[1]))
                else:
                    out.append(_device_io(cur, prev_t, now, self._stuck_since))
            else:
                self._stuck_since.pop(name, None)
        if len(self._prev) != len(stats):  # every name in stats is in _prev now: some went
            for gone in set(self._prev) - set(stats):
                del self._prev[gone]
                self._stuck_since.pop(gone, None)
                self._idle.pop(gone, None)
        return out

    def _idle_row(self, cur: DiskStat, dt: float) -> BlockDeviceIO:
        """_device_io for a device whose counters are the very ones of the last read (the line
        parsed once, diskfs.parse_diskstats) and with nothing in flight: every rate 0, nothing
        stuck; only interval_s is this tick's (issue 17: most of a host's devices, every tick).
        tests/test_disks_cost.py holds it to _device_io."""
        hit = self._idle.get(cur.name)
        if hit is None or hit[0] is not cur:
            hit = self._idle[cur.name] = (cur, dict(_device_io(cur, (cur, 0.0), 1.0, {}).__dict__))
        self._stuck_since.pop(cur.name, None)
        values = hit[1].copy()
        values["interval_s"] = float(dt)
        return built(BlockDeviceIO, values, set(values))

    def _mount_for(self, mounts: list[MountInfo], path: str) -> MountInfo | None:
        """mount_for_path, remembered while the mount table is the one last parsed (the walk
        rebuilds the mount tree each call: 5 calls a tick cost ~0.1 ms, issue 17)."""
        if mounts is not self._mi_parsed:
            return mount_for_path(mounts, path)
        try:
            return self._mount_of[path]
        except KeyError:
            found = self._mount_of[path] = mount_for_path(mounts, path)
            if len(self._mount_of) > 256:  # paths come from the job's open files: bounded
                self._mount_of.clear()
            return found

    def _device_for(self, mount: MountInfo, now: float) -> BlockDeviceRef | None:
        hit = self._devices.get(mount.mount_id)
        if hit is not None and now - hit[1] < DEVICE_TTL_S:
            return hit[0]
        device = device_for_mount(mount, self.roots)
        self._devices[mount.mount_id] = (device, now)
        return device

    # -- filesystem calls (may hang) -----------------------------------------------------------

    def _start(self, path: str, is_shm: bool, tick_start: float, fresh: list[Call]) -> tuple[Call, float]:
        prev = self._calls.get(path)
        if prev is not None and not prev[0].done:
            return prev  # still stuck from an earlier tick: never start a second
        call = Call(path, lambda: self._inspect(path, is_shm))
        self._calls[path] = (call, tick_start)
        if is_shm and self._in_memory(path):
            # tmpfs: kernel memory, cannot block: run here, with no batch to hand out (issue 17)
            call.started = self.clock.monotonic()
            try:
                call.value = call.fn()
            except Exception as e:  # noqa: BLE001 - its result, as a worker's would be
                call.error = e
            call.finished, call.done = self.clock.monotonic(), True
        else:
            fresh.append(call)
        return call, tick_start

    def _in_memory(self, path: str) -> bool:
        """`path` is itself a tmpfs mount point in our own namespace (mountinfo as last read): its
        statvfs and listing touch only memory. A symlink there would have been resolved when
        it was mounted, so the mount point is the path's own directory."""
        if self.mountinfo_pid is not None:
            return False  # the job's view, not the one statvfs runs in
        m = self._mount_for(self._mi_parsed, path)
        return m is not None and m.mount_point == path and m.fs_type == "tmpfs"

    def _inspect(self, path: str, is_shm: bool) -> _FsFacts:
        hit = self._resolved.get(path)
        if hit is not None and self.clock.monotonic() - hit[2] < RESOLVE_TTL_S:
            # statvfs resolves the path as realpath would (the same links, followed by the
            # kernel); the realpath string is only reused while that lands on the same filesystem.
            try:
                st = self._statvfs(path)
            except FileNotFoundError:
                st = None  # gone: the walk below finds its nearest parent
            if st is not None and getattr(st, "f_fsid", None) == hit[1]:
                shm = self._shm_counts(hit[0], st) if is_shm else None
                return _FsFacts(resolved=hit[0], exists=True, st=st, shm=shm)
            self._resolved.pop(path, None)
        resolved = os.path.realpath(path)
        probe_at, exists = resolved, True
        while True:
            try:
                st = self._statvfs(probe_at)
                break
            except FileNotFoundError:
                if is_shm:
                    raise
                # The outputs dir may not exist yet; the disk it will land on can still be full.
                exists = False
                parent = posixpath.dirname(probe_at)
                if parent == probe_at:
                    raise
                probe_at = parent
        shm = self._shm_counts(resolved, st) if is_shm and exists else None
        fsid = getattr(st, "f_fsid", None)
        if exists and fsid:  # 0 or None: a filesystem (or a fake) that names none
            if len(self._resolved) > 256:  # paths come from the job's open files: bounded
                self._resolved.clear()
            self._resolved[path] = (resolved, fsid, self.clock.monotonic())
        return _FsFacts(resolved=probe_at if not exists else resolved, exists=exists, st=st, shm=shm)

    def _shm_counts(self, path: str, fs: os.statvfs_result) -> tuple[int, int, int]:
        """_count_shm, or its last answer (SHM_MIN_RELIST_S above). One call at a time: the
        /dev/shm path's (in place on tmpfs, else its worker's)."""
        now_ns, seen = time.time_ns(), self._shm_seen
        st = None
        if seen is not None:
            age_ns = now_ns - seen[1]
            if age_ns < SHM_MIN_RELIST_S * 1e9:
                return seen[2]
            st = os.stat(path)
            used_blocks = fs.f_blocks - fs.f_bfree
            close = used_blocks > 0 and used_blocks >= SHM_CLOSE_PCT / 100 * (used_blocks + fs.f_bavail)
            changed = seen[0] != (st.st_dev, st.st_ino, st.st_mtime_ns)
            if age_ns < SHM_RELIST_S * 1e9 and not seen[2][1] and not (close and changed):
                return seen[2]
        st = st or os.stat(path)
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns)
        counts = _count_shm(path)
        trusted = now_ns - st.st_mtime_ns >= SHM_RACY_NS
        self._shm_seen = (ident if trusted else None, now_ns, counts)
        return counts

    def _path_entry(self, path: str, kind: str, queued: tuple[Call, float], mounts: list[MountInfo],
                    tick_start: float, now: float) -> PathUsage:
        call, queued_at_mono = queued
        facts: _FsFacts | None = None
        status, detail = ProbeStatus.ok, None
        age = now - queued_at_mono
        e = call.error
        if not call.done:
            status = ProbeStatus.busy if queued_at_mono < tick_start else ProbeStatus.timeout
        elif e is None:
            facts = call.value
        elif isinstance(e, FileNotFoundError):
            status, detail = ProbeStatus.absent, f"{path}: {e.strerror}"
        elif isinstance(e, PermissionError):
            status, detail = ProbeStatus.denied, f"statvfs on {path}: {e.strerror}"
        elif isinstance(e, OSError):  # ENOTCONN/ESTALE/EIO: a dead network or fuse mount says so
            status, detail = ProbeStatus.error, f"statvfs on {path} failed: {e.strerror or e}"
        else:  # one odd path must not cost the whole probe
            status, detail = ProbeStatus.error, f"statvfs on {path} failed: {type(e).__name__}: {e}"

        resolved = facts.resolved if facts else path
        mount = self._mount_for(mounts, resolved)
        device = self._device_for(mount, now) if mount else None
        if facts is not None:
            latency = float(max(0.0, (call.finished or now) - (call.started or queued_at_mono)))
            return self._answered(path, kind, facts, mount, device, latency)
        if status in (ProbeStatus.timeout, ProbeStatus.busy):
            where = _describe(mount, device)  # only a stuck call's evidence names the mount
            detail = (f"statvfs on {path} did not return in {self.statvfs_deadline_s:g} s{where}"
                      if status is ProbeStatus.timeout else
                      f"statvfs on {path} has not returned for {age:.0f} s{where}; not retried until it does")
        entry: dict[str, Any] = dict(
            path=path, kind=kind, status=status, detail=detail, mount=mount, device=device,
            fs_path=path_in_filesystem(mount, resolved) if mount and mount.root != "/" else None,
            read_only=mount.read_only if mount else None,
            stuck_for_s=float(age) if status in (ProbeStatus.timeout, ProbeStatus.busy) else None,
        )
        return made(PathUsage, _USAGE_DEFAULTS, entry)

    def _answered(self, path: str, kind: str, facts: _FsFacts, mount: MountInfo | None,
                  device: BlockDeviceRef | None, latency_s: float) -> PathUsage:
        """_path_entry's record of a path whose call answered. What follows from the path, its
        resolution, mount and device alone (the mount's read-only flags split from its options,
        the path inside its filesystem, the defaults merged in) is kept from the last tick while
        those are the same (the mount and device are the same objects tick after tick: one
        identity test each); the numbers are this call's (issue 17: every path, every tick)."""
        shm = facts.shm
        key = (kind, facts.resolved, facts.exists, shm is not None)
        hit = self._answered_base.get(path)
        # the very mount and device objects: an equal new one is handed on as itself, as before
        if hit is None or hit[0] != key or hit[1]["mount"] is not mount or hit[1]["device"] is not device:
            entry: dict[str, Any] = dict(
                path=path, kind=kind, status=ProbeStatus.ok, detail=None, mount=mount, device=device,
                fs_path=path_in_filesystem(mount, facts.resolved) if mount and mount.root != "/" else None,
                read_only=mount.read_only if mount else None, stuck_for_s=None,
                exists=facts.exists, resolved_path=facts.resolved,
            )
            # the fields set as made() sets them: those given here and below
            names = frozenset(entry).union(_SPACE_FIELDS, ("statvfs_latency_s",),
                                           _SHM_FIELDS if shm is not None else ())
            if len(self._answered_base) > 256:  # paths come from the job's open files: bounded
                self._answered_base.clear()
            hit = self._answered_base[path] = (key, {**_USAGE_DEFAULTS, **entry}, names)
        values = hit[1].copy()  # every field, in the declared order: updated in place below
        values.update(_space(facts.st))
        values["statvfs_latency_s"] = latency_s
        if shm is not None:
            values.update(zip(_SHM_FIELDS, shm, strict=True))
        return built(PathUsage, values, set(hit[2]))


def _device_io(cur: DiskStat, prev_t: tuple[DiskStat, float] | None, now: float,
               stuck_since: dict[str, float]) -> BlockDeviceIO:
    base: dict[str, Any] = dict(
        name=cur.name, major=cur.major, minor=cur.minor, inflight_ios=cur.inflight_ios,
        read_bytes_total=cur.sectors_read * SECTOR_BYTES,
        write_bytes_total=cur.sectors_written * SECTOR_BYTES,
        completed_ios_total=cur.completed_ios,
    )
    if prev_t is None:
        stuck_since.pop(cur.name, None)
        return made(BlockDeviceIO, _IO_DEFAULTS, base)
    prev, t0 = prev_t
    dt = now - t0
    # Stuck only when I/O was in flight at both ends and nothing completed in between: a single
    # sample with in-flight I/O is normal for any busy device.
    if cur.inflight_ios > 0 and prev.inflight_ios > 0 and cur.completed_ios == prev.completed_ios:
        stuck_since.setdefault(cur.name, t0)
    else:
        stuck_since.pop(cur.name, None)
    # float(): built unvalidated, and a test's clock may count in ints
    base["inflight_stuck_for_s"] = float(now - stuck_since[cur.name]) if cur.name in stuck_since else 0.0
    # the counters' deltas, by name (7 a device a tick: no dict of getattr pairs, issue 17)
    reads = cur.reads_completed - prev.reads_completed
    writes = cur.writes_completed - prev.writes_completed
    sectors_r = cur.sectors_read - prev.sectors_read
    sectors_w = cur.sectors_written - prev.sectors_written
    ms = (cur.read_ms - prev.read_ms, cur.write_ms - prev.write_ms)
    ticks_ms = cur.io_ticks_ms - prev.io_ticks_ms
    if dt <= 0 or min(reads, writes, sectors_r, sectors_w, ms[0], ms[1], ticks_ms) < 0:
        return made(BlockDeviceIO, _IO_DEFAULTS, base)  # no time passed, or counters wrapped/reset: no honest rate
    ios = reads + writes
    base.update(
        interval_s=float(dt), read_bytes_per_s=sectors_r * SECTOR_BYTES / dt,
        write_bytes_per_s=sectors_w * SECTOR_BYTES / dt, read_iops=reads / dt, write_iops=writes / dt,
        await_ms=(ms[0] + ms[1]) / ios if ios else None,
        busy_pct=min(100.0, ticks_ms / (dt * 1000.0) * 100.0),
    )
    return made(BlockDeviceIO, _IO_DEFAULTS, base)


def _space(st: os.statvfs_result) -> dict:
    frsize = st.f_frsize or st.f_bsize
    used_blocks = st.f_blocks - st.f_bfree
    denom = used_blocks + st.f_bavail
    used_inodes = st.f_files - st.f_ffree
    return dict(
        total_bytes=st.f_blocks * frsize, free_bytes=st.f_bavail * frsize,
        free_bytes_root=st.f_bfree * frsize,
        used_pct=100.0 * used_blocks / denom if denom else None,
        # Filesystems without an inode limit (btrfs, some tmpfs) report 0 files: no percentage.
        total_inodes=st.f_files, free_inodes=st.f_favail,
        inodes_used_pct=100.0 * used_inodes / st.f_files if st.f_files else None,
    )


def _count_shm(path: str) -> tuple[int, int, int]:
    """(entries, SGLang segments, their bytes) of a directory, through one descriptor opened
    without following a link (the directory is world-writable: nothing in it is re-resolved).

    Listed by os.listdir and counted in C (issue 17: /dev/shm of a busy node holds hundreds of
    torch/NCCL/semaphore entries and changes every tick, and a Python loop over a scandir was
    most of the disks probe's CPU). A directory too big for that is walked by scandir up to the
    limit, so a runaway leak never becomes a memory problem: tmpfs counts BOGO_DIRENT_SIZE (20)
    bytes of st_size an entry, other filesystems 2 or more (btrfs: twice the name's length)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size > _SHM_LIST_LIMIT * 2:
            return _scan_shm(fd)
        names = os.listdir(fd)
        # NUL is the one character no name holds: a name cannot fake a second entry.
        joined = "\0" + "\0".join(names)
        sgl = sum(joined.count("\0" + prefix) for prefix in SHM_PREFIXES)
        sgl_bytes = sum(_lsize(fd, n) for n in names if n.startswith(SHM_PREFIXES)) if sgl else 0
        return min(len(names), _SHM_LIST_LIMIT), sgl, sgl_bytes
    finally:
        os.close(fd)


def _scan_shm(fd: int) -> tuple[int, int, int]:
    total = sgl = sgl_bytes = 0
    with os.scandir(fd) as it:
        for entry in it:
            total += 1
            if entry.name.startswith(SHM_PREFIXES):
                sgl += 1
                sgl_bytes += _lsize(fd, entry.name)
            if total >= _SHM_LIST_LIMIT:
                break
    return total, sgl, sgl_bytes


def _lsize(dir_fd: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
    except OSError:
        return 0  # unlinked between listing and stat


def _describe(mount: MountInfo | None, device: BlockDeviceRef | None) -> str:
    """' (ext4 on loop0 backed by /srv/img, mounted at /data)' for evidence lines."""
    if mount is None:
        return ""
    what = f"{mount.fs_type} {mount.source}"
    if device is not None:
        what = f"{mount.fs_type} on {device.name}"
        if device.parent_disk:
            what += f" of {device.parent_disk}"
        if device.dm_name:
            what += f" ({device.dm_name})"
        if device.loop_backing_file:
            what += f" backed by {device.loop_backing_file}"
    return f" ({what}, mounted at {mount.mount_point})"
