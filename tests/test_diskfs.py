"""Disk parsers and the disks probe on a captured fixture root (tests/fixtures/host1)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from stallwatch.clock import FakeClock
from stallwatch.kernel.diskfs import (
    MountInfo, block_device, device_for_mount, mount_for_path, parse_diskstats, parse_mountinfo,
    path_in_filesystem, unescape_octal,
)
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.disks import DisksObs, DisksProbe
from stallwatch.kernel.roots import Roots

from rigs import HOST1, capture_copy

WORK = "/tmp/sw fixture k1x628j_"  # the capture's temporary directory, as the fixture records it


@pytest.fixture
def roots() -> Roots:
    return Roots.under(HOST1)


@pytest.fixture
def mounts(roots: Roots) -> list[MountInfo]:
    return parse_mountinfo(roots.read_text(roots.proc / "self" / "mountinfo"))


# -- /proc/diskstats -------------------------------------------------------------------------------

def test_diskstats_real_capture_has_discard_and_flush_fields(roots: Roots) -> None:
    stats = parse_diskstats(roots.read_text(roots.proc / "diskstats"))
    assert {"vda", "loop0", "loop0p1", "loop1", "zram0"} <= stats.keys()
    part = stats["loop0p1"]
    assert (part.major, part.minor) == (259, 0)
    assert ((part.reads_completed, part.sectors_read, part.writes_completed, part.sectors_written)
            == (109, 1284, 18, 8970))
    assert part.sectors_discarded == 129026
    vda = stats["vda"]
    assert vda.flushes_completed == 151 and vda.flush_ms == 5
    assert vda.inflight_ios == 0 and vda.io_ticks_ms == 1440
    assert vda.discards_completed == 3366
    assert vda.completed_ios == 12170 + 1996 + 3366 + 151


def test_diskstats_older_kernels_and_garbage() -> None:
    text = (
        "   8       0 sda 100 0 800 10 50 0 400 5 2 30 40\n"  # 4.17: no discard/flush fields
        "   8       1 sda1 1 2 3\n"  # 2.6-era partition line: too short, skipped
        "garbage line\n"
        "   8      16 sdb x 0 0 0 0 0 0 0 0 0 0\n"  # not numbers: skipped, not fatal
        " 259       0 nvme0n1 1 0 8 0 1 0 8 0 0 0 0 0 0 0 0\n"  # 4.18-5.4: discard, no flush
    )
    stats = parse_diskstats(text)
    assert set(stats) == {"sda", "nvme0n1"}
    assert stats["sda"].inflight_ios == 2 and stats["sda"].discards_completed is None
    assert stats["sda"].completed_ios == 150
    assert stats["nvme0n1"].discards_completed == 0 and stats["nvme0n1"].flushes_completed is None


# -- mountinfo -------------------------------------------------------------------------------------

def test_mountinfo_unescapes_octal_paths(mounts: list[MountInfo]) -> None:
    part = next(m for m in mounts if m.mount_id == 42)
    assert part.mount_point == f"{WORK}/part mnt"
    assert part.source == "/dev/loop0p1" and part.fs_type == "ext4"
    assert (part.major, part.minor) == (259, 0)
    assert unescape_octal(r"a\040b\011c\012d\134e") == "a b\tc\nd\\e"


def test_mountinfo_optional_fields_and_options() -> None:
    line = ("36 35 98:0 /mnt1 /mnt/parent rw,noatime shared:1 master:2 - ext3 /dev/root "
            "rw,errors=continue\n" "broken line\n")
    (m,) = parse_mountinfo(line)
    assert m.optional_fields == ("shared:1", "master:2")
    assert m.root == "/mnt1" and m.super_options == "rw,errors=continue"
    assert not m.read_only


def test_mount_for_path_walks_the_tree(mounts: list[MountInfo]) -> None:
    assert mount_for_path(mounts, f"{WORK}/part mnt/rows_0-2000/data_1.ckpt").mount_id == 42
    assert mount_for_path(mounts, f"{WORK}/part mnt").mount_id == 42
    # Component-wise: a sibling sharing a prefix is on the root filesystem.
    assert mount_for_path(mounts, f"{WORK}/part mntx").mount_point == "/"
    assert mount_for_path(mounts, f"{WORK}/data/../bind/x").mount_id == 44
    # /dev/shm is mounted twice on this host; the upper one is what a path reaches.
    assert mount_for_path(mounts, "/dev/shm/sgl_shm_mm_1").mount_id == 30
    assert mount_for_path(mounts, "relative/path") is None


def test_mount_for_path_overmount_hides_children() -> None:
    text = "\n".join([
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw",
        "2 1 8:2 / /data rw - ext4 /dev/sda2 rw",
        "3 2 8:3 / /data/out rw - ext4 /dev/sda3 rw",
        "4 2 0:50 / /data rw - tmpfs tmpfs rw",  # mounted over /data later: hides /data/out
    ])
    mounts = parse_mountinfo(text)
    assert mount_for_path(mounts, "/data/out/f").mount_id == 4
    # A view with holes (a mount whose parent is not listed) still finds it, hung from the root.
    holes = parse_mountinfo("10 9 8:1 / / rw - ext4 /dev/sda1 rw\n11 7 8:2 / /data rw - ext4 /dev/sda2 rw")
    assert mount_for_path(holes, "/data/x").mount_id == 11
    # No root line at all: longest prefix, the latest on ties.
    rootless = parse_mountinfo("11 7 8:2 / /data rw - ext4 /dev/sda2 rw\n12 7 8:3 / /data rw - ext4 /dev/sda3 rw")
    assert mount_for_path(rootless, "/data/x").mount_id == 12 and mount_for_path(rootless, "/x") is None


def test_bind_mount_path_inside_filesystem(mounts: list[MountInfo]) -> None:
    bind = mount_for_path(mounts, f"{WORK}/bind/a/b")
    assert bind.root == "/sub"
    assert path_in_filesystem(bind, f"{WORK}/bind/a/b") == "/sub/a/b"
    assert path_in_filesystem(bind, f"{WORK}/bind") == "/sub"


# -- sysfs ---------------------------------------------------------------------------------------

def test_device_for_partition_of_loop(roots: Roots, mounts: list[MountInfo]) -> None:
    dev = device_for_mount(mount_for_path(mounts, f"{WORK}/part mnt/x"), roots)
    assert dev.name == "loop0p1" and dev.parent_disk == "loop0"
    assert dev.loop_backing_file == f"{WORK}/part.img"


def test_device_for_loop_and_bind(roots: Roots, mounts: list[MountInfo]) -> None:
    for path in (f"{WORK}/data/x", f"{WORK}/bind/x"):
        dev = device_for_mount(mount_for_path(mounts, path), roots)
        assert (dev.name, dev.parent_disk, dev.loop_backing_file) == ("loop1", None, f"{WORK}/data.img")


def test_device_for_tmpfs_and_unknown(roots: Roots, mounts: list[MountInfo]) -> None:
    assert device_for_mount(mount_for_path(mounts, "/dev/shm/x"), roots) is None
    assert block_device(roots, 8, 99) is None
    vda = block_device(roots, 254, 0)
    assert vda.name == "vda" and vda.loop_backing_file is None and vda.dm_name is None


def test_device_mapper_by_number_and_by_source(roots: Roots) -> None:
    (lvm,) = parse_mountinfo("50 27 252:0 / /data rw - xfs /dev/mapper/vg0-data rw")
    dev = device_for_mount(lvm, roots)
    assert (dev.name, dev.dm_name, dev.slaves) == ("dm-0", "vg0-data", ("vda",))
    # btrfs reports an anonymous 0:N device: go by the source name instead.
    (btrfs,) = parse_mountinfo("51 27 0:60 /@home /home rw - btrfs /dev/mapper/vg0-data rw")
    assert device_for_mount(btrfs, roots).name == "dm-0"
    (plain,) = parse_mountinfo("52 27 0:61 / /srv rw - btrfs /dev/vda rw")
    assert device_for_mount(plain, roots).name == "vda"
    (nfs,) = parse_mountinfo("53 27 0:62 / /nfs rw - nfs4 host:/export rw")
    assert device_for_mount(nfs, roots) is None


# -- the probe on the fixture tree -------------------------------------------------------------------

class FakeStatvfs:
    """statvfs that answers from a table, or blocks until released (a dead mount)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.blocking: set[str] = set()
        self.calls: list[str] = []

    def __call__(self, path: str) -> os.statvfs_result:
        self.calls.append(path)
        if any(path == b or path.startswith(b + "/") for b in self.blocking):
            self.release.wait(30)
        # bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax
        return os.statvfs_result((4096, 4096, 1000, 100, 50, 2000, 1000, 1000, 0, 255))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return capture_copy(HOST1, tmp_path / "host1")


def write_diskstats(tree: Path, line_for: dict[str, str]) -> None:
    """Replace the counters of some devices, keeping the rest of the captured file."""
    p = tree / "proc" / "diskstats"
    out = []
    for line in p.read_text().splitlines():
        name = line.split()[2]
        out.append(line_for.get(name, line))
    p.write_text("\n".join(out) + "\n")


def test_probe_maps_paths_and_computes_space(tree: Path, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "sgl_shm_mm_0001").write_bytes(b"x" * 4096)
    (shm / "sgl_shm_mm_0002").write_bytes(b"x" * 100)
    (shm / "other").write_bytes(b"")
    fake = FakeStatvfs()
    probe = DisksProbe([f"{WORK}/part mnt/out", f"{WORK}/bind"], roots=Roots.under(tree),
                       clock=FakeClock(), dev_shm=str(shm), statvfs=fake)
    obs = probe.collect()
    out, bind, shm_entry = obs.paths
    assert out.status is ProbeStatus.ok and out.mount.mount_id == 42
    assert out.device.name == "loop0p1" and out.device.loop_backing_file == f"{WORK}/part.img"
    assert out.total_bytes == 1000 * 4096 and out.free_bytes == 50 * 4096 and out.free_bytes_root == 100 * 4096
    assert out.used_pct == pytest.approx(100 * 900 / 950)
    assert out.free_inodes == 1000 and out.inodes_used_pct == pytest.approx(50.0)
    assert bind.fs_path == "/sub" and bind.device.name == "loop1"
    assert shm_entry.kind == "dev_shm" and shm_entry.shm_segments == 3
    assert (shm_entry.sgl_shm_segments, shm_entry.sgl_shm_bytes) == (2, 4196)
    # The device behind a watched path is reported even with zero I/O; idle unused loops are not.
    names = {d.name for d in obs.devices}
    assert {"loop0p1", "loop1", "vda"} <= names and "loop5" not in names
    assert DisksObs.model_validate_json(obs.model_dump_json()) == obs


def test_missing_path_reports_nearest_parent(tmp_path: Path) -> None:
    probe = DisksProbe([tmp_path / "not" / "yet"], clock=FakeClock(), dev_shm=None)
    (entry,) = probe.collect().paths
    assert entry.status is ProbeStatus.ok and entry.exists is False
    assert entry.resolved_path == str(tmp_path) and entry.free_bytes > 0


def test_device_rates_and_inflight_stuck(tree: Path) -> None:
    clock = FakeClock()
    probe = DisksProbe([], roots=Roots.under(tree), clock=clock, dev_shm=None)
    #                                 rd rm  rsec rms  wr wm wsec  wms inflt io_ticks wt ...
    write_diskstats(tree, {"loop1": "7 1 loop1 100 0 2000 50 10 0 800 20 0 1000 70 0 0 0 0 1 0"})
    first = {d.name: d for d in probe.collect().devices}["loop1"]
    assert first.interval_s is None and first.read_bytes_per_s is None

    clock.advance(2.0)
    write_diskstats(tree, {"loop1": "7 1 loop1 300 0 6000 250 30 0 1600 40 3 1500 90 0 0 0 0 1 0"})
    d = {d.name: d for d in probe.collect().devices}["loop1"]
    assert d.interval_s == 2.0
    assert d.read_bytes_per_s == pytest.approx(4000 * 512 / 2) and d.write_bytes_per_s == pytest.approx(800 * 512 / 2)
    assert d.read_iops == pytest.approx(100) and d.write_iops == pytest.approx(10)
    assert d.await_ms == pytest.approx((200 + 20) / 220)
    assert d.busy_pct == pytest.approx(25.0) and d.inflight_ios == 3
    assert d.inflight_stuck_for_s == 0.0  # in flight now, but it was idle at the last sample

    # In flight at both ends, no completion: stuck since the earlier sample.
    clock.advance(5.0)
    write_diskstats(tree, {"loop1": "7 1 loop1 300 0 6000 250 30 0 1600 40 3 6500 90 0 0 0 0 1 0"})
    d = {d.name: d for d in probe.collect().devices}["loop1"]
    assert d.inflight_stuck_for_s == 5.0 and d.busy_pct == 100.0 and d.read_iops == 0
    clock.advance(5.0)
    d = {d.name: d for d in probe.collect().devices}["loop1"]
    assert d.inflight_stuck_for_s == 10.0

    # One flush completes: the device is alive again.
    clock.advance(1.0)
    write_diskstats(tree, {"loop1": "7 1 loop1 300 0 6000 250 30 0 1600 40 3 7500 90 0 0 0 0 2 0"})
    d = {d.name: d for d in probe.collect().devices}["loop1"]
    assert d.inflight_stuck_for_s == 0.0

    # Counters going backwards (device re-created under the same name): no fake negative rate.
    clock.advance(1.0)
    write_diskstats(tree, {"loop1": "7 1 loop1 1 0 8 0 0 0 0 0 0 0 0 0 0 0 0 0 0"})
    d = {d.name: d for d in probe.collect().devices}["loop1"]
    assert d.read_bytes_per_s is None and d.inflight_stuck_for_s == 0.0


def test_stuck_statvfs_is_evidence_and_never_piles_up(tree: Path) -> None:
    clock = FakeClock()
    fake = FakeStatvfs()
    stuck_path = f"{WORK}/part mnt/out"
    fake.blocking.add(stuck_path)
    probe = DisksProbe([stuck_path, f"{WORK}/data"], roots=Roots.under(tree), clock=clock,
                       statvfs_deadline_s=0.3, dev_shm=None, statvfs=fake)
    try:
        t0 = time.monotonic()
        stuck, fine = probe.collect().paths
        assert time.monotonic() - t0 < 2.0
        assert stuck.status is ProbeStatus.timeout and stuck.free_bytes is None
        assert stuck.detail == (f"statvfs on {stuck_path} did not return in 0.3 s (ext4 on loop0p1 of loop0 "
                                f"backed by {WORK}/part.img, mounted at {WORK}/part mnt)")
        assert stuck.device.name == "loop0p1"  # from kernel memory, not from the stuck mount
        assert fine.status is ProbeStatus.ok and fine.free_bytes == 50 * 4096

        clock.advance(40.0)
        stuck, _ = probe.collect().paths
        assert stuck.status is ProbeStatus.busy and stuck.stuck_for_s == 40.0
        assert "has not returned for 40 s" in stuck.detail
        assert fake.calls.count(stuck_path) == 1  # the stuck call is waited on, never doubled
    finally:
        fake.release.set()
    # The next tick waits on the same call, which now returns within the deadline.
    clock.advance(1.0)
    stuck, _ = probe.collect().paths
    assert stuck.status is ProbeStatus.ok and stuck.statvfs_latency_s == 41.0


def test_absent_sources_are_values(tmp_path: Path) -> None:
    probe = DisksProbe([tmp_path], roots=Roots.under(tmp_path / "nothing"), clock=FakeClock(), dev_shm=None)
    obs = probe.collect()
    assert obs.diskstats_status is ProbeStatus.absent and obs.mountinfo_status is ProbeStatus.absent
    assert obs.devices == () and obs.paths[0].mount is None and obs.paths[0].free_bytes > 0


def test_dev_shm_entry_only_when_present(tmp_path: Path) -> None:
    probe = DisksProbe([tmp_path], clock=FakeClock(), dev_shm=str(tmp_path / "no-shm"))
    assert [u.kind for u in probe.collect().paths] == ["path"]
