"""Pure parsers for the disk side of the kernel: /proc/diskstats, mountinfo, /sys/dev/block.

Nothing here touches the watched filesystems themselves (no stat, no statvfs): these files are
served by the kernel from memory, so reading them cannot hang on a dead mount. That is why the
probe can still say "/data is ext4 on loop0, backed by /srv/img" while statvfs on /data is stuck.
"""

from __future__ import annotations

import posixpath
import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from stallwatch.model import Frozen
from stallwatch.kernel.procfiles import ProcPaths
from stallwatch.kernel.roots import Absent, Denied, Roots

SECTOR_BYTES = 512  # diskstats counts 512-byte sectors whatever the device's real sector size


class DiskStat(NamedTuple):
    """One line of /proc/diskstats (Documentation/admin-guide/iostats.rst).

    A named tuple, not a Frozen model: the probe's own parse of a kernel line, never reported
    (BlockDeviceIO is), and every line whose counters moved is parsed at 1 Hz: a tuple is made
    in C from the ints, where validation was most of the parse (issue 17)."""

    major: int
    minor: int
    name: str
    reads_completed: int
    reads_merged: int
    sectors_read: int
    read_ms: int
    writes_completed: int
    writes_merged: int
    sectors_written: int
    write_ms: int
    inflight_ios: int  # the only field that is a level, not a counter
    io_ticks_ms: int  # wall time with at least one I/O in flight: the basis of busy %
    weighted_io_ms: int
    # 4.18+ adds discards, 5.5+ flushes; None on older kernels rather than a fake 0.
    discards_completed: int | None = None
    discards_merged: int | None = None
    sectors_discarded: int | None = None
    discard_ms: int | None = None
    flushes_completed: int | None = None
    flush_ms: int | None = None

    @property
    def completed_ios(self) -> int:
        """Every request the device finished; if this stands still while I/O is in flight, the
        device (or what is behind it: a loop file, NFS, a dead disk) completes nothing."""
        return (self.reads_completed + self.writes_completed
                + (self.discards_completed or 0) + (self.flushes_completed or 0))


_DISKSTAT_FIELDS = [
    "reads_completed", "reads_merged", "sectors_read", "read_ms",
    "writes_completed", "writes_merged", "sectors_written", "write_ms",
    "inflight_ios", "io_ticks_ms", "weighted_io_ms",
    "discards_completed", "discards_merged", "sectors_discarded", "discard_ms",
    "flushes_completed", "flush_ms",
]


def diskstats_path(roots: Roots) -> str:
    """/proc/diskstats, for a caller that keeps it open and reads it from offset 0 each time."""
    return ProcPaths(roots).host("diskstats")


def parse_diskstats(text: str, known: dict[str, DiskStat] | None = None) -> dict[str, DiskStat]:
    """Device name -> counters. Malformed lines are skipped: one odd driver must not blind us.

    `known` maps a line as last read to what it parsed to: a device whose counters did not move
    (most loop and ram devices, every tick) is not parsed and validated again (issue 17). It is
    replaced by this read's lines, so it never holds more than the file."""
    out: dict[str, DiskStat] = {}
    lines: dict[str, DiskStat] = {}
    for line in text.splitlines():
        stat = known.get(line) if known is not None else None
        if stat is None and (stat := parse_diskstat_line(line)) is None:
            continue
        out[stat.name] = lines[line] = stat
    if known is not None:
        known.clear()
        known.update(lines)
    return out


def parse_diskstat_line(line: str) -> DiskStat | None:
    parts = line.split()
    if len(parts) < 14:
        return None
    try:
        nums = [int(p) for p in parts[3:3 + len(_DISKSTAT_FIELDS)]]
        major, minor = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    # older kernels write fewer fields: the rest None
    return DiskStat._make([major, minor, parts[2], *nums, *(None,) * (len(_DISKSTAT_FIELDS) - len(nums))])


class MountInfo(Frozen):
    """One line of /proc/PID/mountinfo (proc(5)), paths unescaped."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str  # the directory of the filesystem that is mounted here: not "/" for bind mounts
    mount_point: str
    mount_options: str
    optional_fields: tuple[str, ...] = ()
    fs_type: str
    source: str
    super_options: str

    @property
    def read_only(self) -> bool:
        return "ro" in self.mount_options.split(",") or "ro" in self.super_options.split(",")


_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape_octal(s: str) -> str:
    r"""The kernel writes space, tab, newline and backslash in paths as \040 \011 \012 \134."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), s)


def parse_mountinfo(text: str) -> list[MountInfo]:
    out: list[MountInfo] = []
    for line in text.splitlines():
        parts = line.split(" ")
        try:
            sep = parts.index("-", 6)
            major, minor = parts[2].split(":")
            out.append(MountInfo(
                mount_id=int(parts[0]), parent_id=int(parts[1]),
                major=int(major), minor=int(minor),
                root=unescape_octal(parts[3]), mount_point=unescape_octal(parts[4]),
                mount_options=parts[5], optional_fields=tuple(parts[6:sep]),
                fs_type=parts[sep + 1], source=unescape_octal(parts[sep + 2]),
                super_options=parts[sep + 3] if len(parts) > sep + 3 else "",
            ))
        except (ValueError, IndexError):
            continue
    return out


def _is_under(path: str, mount_point: str) -> bool:
    # Component-wise: /data must not claim /database.
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


def mount_for_path(mountinfo: list[MountInfo], path: str) -> MountInfo | None:
    """The mount that serves an absolute path, resolved the way the kernel walks it.

    Plain longest-prefix matching is wrong twice: a filesystem mounted over another at the same
    point (stacked /dev/shm) and a mount hidden under a later over-mount of its parent. So we walk
    the mount tree from "/" down the path's prefixes, following child mounts and taking the top of
    each stack. Symlinks are not resolved here (that needs the filesystem, which may hang): pass a
    path already resolved, or accept the lexical answer. A view with holes (a mount whose parent
    is not listed) hangs such mounts from the root; with no root line at all we fall back to the
    longest prefix, the latest on ties.
    """
    path = posixpath.normpath(path)
    if not path.startswith("/") or not mountinfo:
        return None
    ids = {m.mount_id for m in mountinfo}
    children: dict[int, list[MountInfo]] = defaultdict(list)
    for m in mountinfo:
        children[m.parent_id].append(m)

    def top_of_stack(m: MountInfo) -> MountInfo:
        seen = {m.mount_id}
        while True:
            over = [c for c in children[m.mount_id] if c.mount_point == m.mount_point]
            if not over or over[-1].mount_id in seen:
                return m
            m = over[-1]
            seen.add(m.mount_id)

    roots = [m for m in mountinfo if m.mount_point == "/" and m.parent_id not in ids]
    if not roots:
        return _longest_prefix(mountinfo, path)
    root = roots[-1]
    children[root.mount_id].extend(
        m for m in mountinfo if m.parent_id not in ids and m.mount_point != "/")
    current = top_of_stack(root)
    prefix = ""
    for part in [p for p in path.split("/") if p]:
        prefix = f"{prefix}/{part}"
        here = [c for c in children[current.mount_id] if c.mount_point == prefix]
        if here:
            current = top_of_stack(here[-1])
    return current


def _longest_prefix(mountinfo: list[MountInfo], path: str) -> MountInfo | None:
    best: MountInfo | None = None
    for m in mountinfo:
        if _is_under(path, m.mount_point) and (best is None or len(m.mount_point) >= len(best.mount_point)):
            best = m
    return best


def path_in_filesystem(mount: MountInfo, path: str) -> str:
    """Where a path lives inside its filesystem: for a bind mount of /srv/a on /data,
    /data/x is /srv/a/x of the device (mount.root is "/srv/a")."""
    rel = posixpath.relpath(posixpath.normpath(path), mount.mount_point)
    return posixpath.normpath(posixpath.join(mount.root, rel)) if rel != "." else mount.root


class BlockDeviceRef(Frozen):
    """The block device behind a mount, as sysfs names it."""

    name: str  # sysfs name: sda1, nvme0n1p2, loop3, dm-0
    major: int
    minor: int
    parent_disk: str | None = None  # whole disk of a partition (sda for sda1)
    loop_backing_file: str | None = None  # the file a loop device reads, " (deleted)" kept
    dm_name: str | None = None  # device-mapper name (vg-lv, luks-...)
    slaves: tuple[str, ...] = ()  # what a dm/md device is built on


def block_device(roots: Roots, major: int, minor: int) -> BlockDeviceRef | None:
    """/sys/dev/block/MAJ:MIN -> the device, its parent disk, loop file and dm name."""
    link_path = roots.sys / "dev" / "block" / f"{major}:{minor}"
    try:
        target = roots.readlink(link_path)
    except (Absent, Denied):
        return None
    # normpath, not realpath: a fixture tree's links must resolve inside the fixture tree.
    dev_dir = posixpath.normpath(posixpath.join(str(link_path.parent), target))
    name = posixpath.basename(dev_dir)
    is_partition = _read_line(roots, dev_dir, "partition") is not None
    disk_dir = posixpath.dirname(dev_dir) if is_partition else dev_dir
    return BlockDeviceRef(
        name=name, major=major, minor=minor,
        parent_disk=posixpath.basename(disk_dir) if is_partition else None,
        loop_backing_file=_read_line(roots, disk_dir, "loop", "backing_file"),
        dm_name=_read_line(roots, dev_dir, "dm", "name"),
        slaves=tuple(sorted(_listdir(roots, dev_dir, "slaves"))),
    )


def device_for_mount(mount: MountInfo, roots: Roots) -> BlockDeviceRef | None:
    """The block device of a mount, or None for tmpfs, NFS, overlay and friends.

    Block filesystems report the device's major:minor in mountinfo. Btrfs reports an anonymous
    0:N, so for major 0 we try the source (/dev/sda2, /dev/mapper/vg-lv) by its sysfs name.
    """
    if mount.major != 0:
        return block_device(roots, mount.major, mount.minor)
    if not mount.source.startswith("/dev/"):
        return None
    name = posixpath.basename(mount.source)
    if mount.source.startswith("/dev/mapper/"):
        block = str(roots.sys / "block")
        for dm in _listdir(roots, block):
            if dm.startswith("dm-") and _read_line(roots, block, dm, "dm", "name") == name:
                name = dm
                break
    dev = _read_line(roots, str(roots.sys / "class" / "block" / name), "dev")
    if dev is None or ":" not in dev:
        return None
    major, minor = dev.split(":", 1)
    return block_device(roots, int(major), int(minor))


def _read_line(roots: Roots, *parts: str) -> str | None:
    try:
        return roots.read_text(Path(*parts), limit=8192).strip() or None
    except (Absent, Denied, OSError):
        return None


def _listdir(roots: Roots, *parts: str) -> list[str]:
    try:
        return roots.listdir(Path(*parts))
    except (Absent, Denied, OSError):
        return []
