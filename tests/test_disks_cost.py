"""The disks probe at 1 Hz (issue 17) sees no less for being cheaper: its records are built
without validation and equal their validation; /proc/diskstats is read through a kept
descriptor that still reads fresh counters (a fixture tree's, replaced on disk, is read by path:
test_diskfs.test_device_rates_and_inflight_stuck); /dev/shm is counted from one listing, no link
followed, and listed again at most every SHM_MIN_RELIST_S while it keeps changing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import stallwatch.probes.disks as disks_mod
from stallwatch.clock import FakeClock
from stallwatch.kernel.roots import Roots
from stallwatch.probes.disks import BlockDeviceIO, DisksObs, DisksProbe, PathUsage, _count_shm


class CountingRoots(Roots):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def read_text(self, path, limit=1 << 20):
        self.reads.append(str(path))
        return super().read_text(path, limit)


def _same_as_validated(record) -> None:
    """Validating the record's set fields gives an equal record: same JSON, order, fields set."""
    cls = type(record)
    again = cls(**{k: v for k, v in record.__dict__.items() if k in record.__pydantic_fields_set__})
    assert again == record and again.model_dump_json() == record.model_dump_json()
    assert list(again.__dict__) == list(record.__dict__)
    assert again.__pydantic_fields_set__ == record.__pydantic_fields_set__


def test_records_built_unvalidated_equal_their_validation(tmp_path: Path) -> None:
    """A real collect on this host (its diskstats and mountinfo, a real /dev/shm-like directory
    with an SGLang segment), with an int clock: every record equals its validated build."""
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "sgl_shm_mm_1").write_bytes(b"x" * 300)
    clock = FakeClock(monotonic=5)  # ints: durations must still be floats
    probe = DisksProbe([tmp_path, tmp_path / "not-yet"], clock=clock, dev_shm=str(shm))
    try:
        probe.collect()
        clock.advance(1)
        obs = probe.collect()
    finally:
        probe.close()
    _same_as_validated(obs)
    assert len(obs.paths) == 3 and obs.devices, obs
    for u in obs.paths:
        _same_as_validated(u)
        assert isinstance(u.statvfs_latency_s, float)
    for d in obs.devices:
        _same_as_validated(d)
        assert isinstance(d.interval_s, float) and isinstance(d.inflight_stuck_for_s, float)
    assert obs.paths[1].exists is False and obs.paths[2].sgl_shm_bytes == 300
    assert DisksObs.model_validate_json(obs.model_dump_json()) == obs
    assert {PathUsage, BlockDeviceIO} == {type(obs.paths[0]), type(obs.devices[0])}


def test_diskstats_kept_descriptor_reads_fresh_counters(tmp_path: Path) -> None:
    """After the first collect diskstats is not opened by path again, and what the kept
    descriptor reads moves: data written and fsynced to a block device is counted."""
    roots = CountingRoots()
    probe = DisksProbe([tmp_path], roots=roots, dev_shm=None)
    try:
        first = probe.collect()
        (usage,) = first.paths
        if usage.device is None:
            pytest.skip(f"{tmp_path} is on {usage.mount and usage.mount.fs_type}, no block device")
        before = sum(d.completed_ios_total for d in first.devices)
        fd = os.open(tmp_path / "data", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, os.urandom(1 << 16))
            os.fsync(fd)
        finally:
            os.close(fd)
        after = sum(d.completed_ios_total for d in probe.collect().devices)
    finally:
        probe.close()
    assert after > before
    assert [r for r in roots.reads if r.endswith("/diskstats")] == []
    assert probe._ds_fd == -1  # closed


def test_shm_count_follows_no_link_and_no_forged_name(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "sgl_shm_a").write_bytes(b"x" * 10)
    (shm / "x\nsgl_shm_forged").write_bytes(b"x" * 1000)  # a newline must not make it a segment
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    (shm / "sgl_shm_link").symlink_to(big)  # counted at the link's own size, not followed
    assert _count_shm(str(shm)) == (3, 2, 10 + len(str(big)))
    (tmp_path / "via").symlink_to(shm)
    with pytest.raises(OSError):
        _count_shm(str(tmp_path / "via"))  # the directory itself is not reached through a link


def test_shm_is_listed_again_only_as_often_as_its_counts_can_matter(tmp_path: Path, monkeypatch) -> None:
    """Changed: listed again after SHM_MIN_RELIST_S when it is SHM_CLOSE_PCT used, else after
    SHM_RELIST_S; holding SGLang segments: after SHM_MIN_RELIST_S, full or not."""
    shm = tmp_path / "shm"
    shm.mkdir()
    listed: list[str] = []
    real = disks_mod._count_shm
    monkeypatch.setattr(disks_mod, "_count_shm", lambda p: listed.append(p) or real(p))
    monkeypatch.setattr(disks_mod, "SHM_MIN_RELIST_S", 3600.0)
    monkeypatch.setattr(disks_mod, "SHM_CLOSE_PCT", 0.0)  # "close to full": any use
    probe = DisksProbe([], clock=FakeClock(), dev_shm=str(shm))

    def segments() -> tuple[int | None, int | None]:
        (u,) = probe.collect().paths
        return u.shm_segments, u.sgl_shm_segments

    assert segments() == (0, 0)
    (shm / "other").write_bytes(b"")
    assert segments() == (0, 0) and len(listed) == 1  # too soon
    monkeypatch.setattr(disks_mod, "SHM_MIN_RELIST_S", 0.0)
    assert segments() == (1, 0) and len(listed) == 2  # changed, and close to full
    monkeypatch.setattr(disks_mod, "SHM_CLOSE_PCT", 100.1)  # never close to full
    (shm / "sgl_shm_1").write_bytes(b"")
    assert segments() == (1, 0) and len(listed) == 2  # changed, far from full: SHM_RELIST_S
    monkeypatch.setattr(disks_mod, "SHM_RELIST_S", 0.0)
    assert segments() == (2, 1) and len(listed) == 3
    monkeypatch.setattr(disks_mod, "SHM_RELIST_S", 3600.0)
    (shm / "sgl_shm_1").write_bytes(b"x" * 7)  # a segment grows: the directory does not change
    (u,) = probe.collect().paths
    assert (u.sgl_shm_segments, u.sgl_shm_bytes) == (1, 7) and len(listed) == 4


def test_an_idle_device_row_is_what_device_io_computes(tmp_path: Path) -> None:
    """_idle_row hands an unmoved device's row on with this tick's interval: equal to the full
    computation (fields, types, fields set), tick after tick; a device that moves, or has I/O in
    flight, takes the full computation again."""
    from stallwatch.kernel.diskfs import parse_diskstats
    from stallwatch.probes import disks as disks_mod

    lines = {"sda": "   8       0 sda 100 0 800 10 50 0 400 20 0 30 40 0 0 0 0 0 0",
             "sdb": "   8      16 sdb 7 0 56 1 0 0 0 0 0 2 1 0 0 0 0 0 0",
             "sdc": "   8      32 sdc 9 0 72 1 3 0 24 2 2 5 6 0 0 0 0 0 0"}
    clock = FakeClock(monotonic=5)
    probe = DisksProbe([], clock=clock, dev_shm=None)
    known: dict = {}
    for tick in range(4):
        if tick == 2:
            lines["sdb"] = "   8      16 sdb 8 0 64 1 0 0 0 0 0 3 1 0 0 0 0 0 0"  # it moved
        stats = parse_diskstats("\n".join(lines.values()) + "\n", known)
        prev, stuck = dict(probe._prev), dict(probe._stuck_since)
        rows = {r.name: r for r in probe._rates(stats, clock.monotonic(), set())}
        for name, row in rows.items():
            want = disks_mod._device_io(stats[name], prev.get(name), clock.monotonic(), dict(stuck))
            assert row == want and row.model_fields_set == want.model_fields_set, (tick, name)
            assert list(row.__dict__) == list(want.__dict__) and type(row.interval_s) is type(want.interval_s)
        assert ("sda" in probe._idle) == (tick >= 1)  # idle from its second read on
        assert "sdc" not in probe._idle  # two I/Os in flight: never the idle path
        clock.advance(1 + tick)


def test_a_paths_kept_fields_follow_its_resolution_existence_mount_and_device(tmp_path: Path,
                                                                              monkeypatch) -> None:
    """The fields of a path's record that follow from its resolution, existence, mount and device
    alone are kept from tick to tick (DisksProbe._answered): a change of any is in the next one."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = tmp_path / "link"
    os.symlink(tmp_path / "a", link)
    clock = FakeClock(monotonic=5)
    probe = DisksProbe([link, tmp_path / "later"], clock=clock, dev_shm=None)
    try:
        o1 = probe.collect()
        assert o1.paths[0].resolved_path == str(tmp_path / "a") and o1.paths[0].exists is True
        assert o1.paths[1].exists is False and o1.paths[1].resolved_path == str(tmp_path)
        (tmp_path / "later").mkdir()
        os.unlink(link)
        os.symlink(tmp_path / "b", link)
        clock.advance(disks_mod.RESOLVE_TTL_S + 1)  # the realpath is reused that long (_inspect)
        o2 = probe.collect()
        assert o2.paths[0].resolved_path == str(tmp_path / "b")
        assert o2.paths[1].exists is True and o2.paths[1].resolved_path == str(tmp_path / "later")
        mount = o2.paths[0].mount
        assert mount is not None and all(u.mount is mount for u in o2.paths)
        # another mount (read-only, a bind of /x) and no device: the very objects, each tick
        other = mount.model_copy(update={"mount_point": "/", "root": "/x", "mount_options": "ro"})
        monkeypatch.setattr(probe, "_mount_for", lambda mounts, path: other)
        monkeypatch.setattr(probe, "_device_for", lambda m, now: None)
        clock.advance(1)
        o3 = probe.collect()
        for u in o3.paths:
            assert u.mount is other and u.device is None and u.read_only is True
            assert u.fs_path == "/x" + u.resolved_path
        equal = other.model_copy()  # equal, not the same: handed on as itself
        monkeypatch.setattr(probe, "_mount_for", lambda mounts, path: equal)
        clock.advance(1)
        o4 = probe.collect()
        assert all(u.mount is equal for u in o4.paths)
        for u in o1.paths + o2.paths + o3.paths + o4.paths:
            _same_as_validated(u)
            assert u.statvfs_latency_s is not None and u.total_bytes
    finally:
        probe.close()
