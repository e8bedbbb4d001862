"""The disks' variables (features_io._disk), made in one pass over the paths: the same choices
the former list-and-min() code made — the first of equally tight paths, only `path` entries
weighed, /dev/shm apart, the devices narrowed to the job's (a partition's disk included)."""

from __future__ import annotations

from stallwatch.engine.features import features
from stallwatch.probes.base import ProbeStatus
from stallwatch.kernel.diskfs import BlockDeviceRef, MountInfo
from stallwatch.probes.disks import BlockDeviceIO, DisksObs, PathUsage
from stallwatch.probes.snapshot import Snapshot
from stallwatch.probes.targets import Target

GIB = 1 << 30


def _mount(point: str) -> MountInfo:
    return MountInfo(mount_id=1, parent_id=0, major=8, minor=1, root="/", mount_point=point,
                     mount_options="rw", fs_type="ext4", source="/dev/sda1",
                     super_options="rw")


def _path(path: str, free: int | None, total: int | None = 100 * GIB, *, kind: str = "path",
          inodes: int | None = None, status: ProbeStatus = ProbeStatus.ok,
          dev: str = "sda1", parent: str | None = "sda", stuck_s: float | None = None) -> PathUsage:
    return PathUsage(path=path, kind=kind, status=status, mount=_mount(path), free_bytes=free,
                     total_bytes=total, free_inodes=inodes, total_inodes=1000 if inodes else None,
                     device=BlockDeviceRef(name=dev, major=8, minor=1, parent_disk=parent),
                     detail="statvfs does not return" if status != ProbeStatus.ok else None,
                     stuck_for_s=stuck_s, used_pct=50.0)


def _dev(name: str, stuck_s: float) -> BlockDeviceIO:
    return BlockDeviceIO(name=name, major=8, minor=0, inflight_ios=2 if stuck_s else 0,
                         inflight_stuck_for_s=stuck_s, write_bytes_per_s=1.0)


def _disk(paths: list[PathUsage], devices: list[BlockDeviceIO] = ()) -> dict:
    snap = Snapshot(t_mono=1.0, t_wall=1e9, host="h", target=Target(),
                    disks=DisksObs(paths=tuple(paths), devices=tuple(devices)))
    return features(snap)["disk"]


def test_the_first_of_equally_tight_paths_is_named_and_shm_is_not_weighed() -> None:
    d = _disk([_path("/dev/shm", 1, kind="dev_shm"), _path("/a", 5 * GIB), _path("/b", 2 * GIB),
               _path("/c", 2 * GIB), _path("/d", None)])
    assert (d["path"], d["free_bytes"], d["free_h"]) == ("/b", 2.0 * GIB, "2.0 GiB")
    assert d["known"] and d["shm_free_bytes"] == 1.0
    assert [p["path"] for p in d["paths"]] == ["/a", "/b", "/c", "/d"]


def test_a_path_without_a_total_is_not_known_and_inodes_are_weighed_apart() -> None:
    d = _disk([_path("/a", 0, total=None, inodes=7), _path("/b", 3, total=None, inodes=5)])
    assert not d["known"] and d["path"] == "" and d["free_bytes"] == -1.0
    assert (d["inodes_path"], d["free_inodes"]) == ("/b", 5.0)


def test_stuck_paths_and_the_job_devices_worst_in_flight() -> None:
    d = _disk([_path("/a", GIB), _path("/b", GIB, status=ProbeStatus.timeout, stuck_s=3.0,
                                        dev="dm-0", parent=None),
               _path("/c", GIB, status=ProbeStatus.busy, stuck_s=9.0)],
              [_dev("nvme0n1", 99.0), _dev("sda", 4.0), _dev("dm-0", 4.0)])
    assert (d["stuck"], d["stuck_path"], d["stuck_for_s"]) == (True, "/b", 9.0)
    # nvme0n1 is no path's: the first of the job's worst (sda, then dm-0) is named
    assert (d["inflight_device"], d["inflight_stuck_s"]) == ("sda", 4.0)
    # no device of the job's in the table: every device is weighed
    d = _disk([_path("/a", GIB, dev="vdb", parent=None)], [_dev("sda", 1.0), _dev("nvme0n1", 2.0)])
    assert d["inflight_device"] == "nvme0n1" and not d["stuck"]


def test_no_disks_probe_reads_as_unknown() -> None:
    d = _disk([])
    assert (d["known"], d["path"], d["inflight_device"], d["paths"]) == (False, "", "", [])
