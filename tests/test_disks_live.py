"""The disks probe against real kernel state: a loop-mounted ext4, frozen, and a dead FUSE mount.

Root only (loop devices, mount, fsfreeze). The ext4 rigs come from tests/rigs.py, which thaws,
kills, unmounts and detaches in its own `finally` (and thaws from a timer if a test wedges).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

import pytest
from rigs import dead_fuse_mount, frozen_ext4, loop_ext4, root, spawn_in_state, task_state  # noqa: F401 - root is a fixture

from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.disks import DisksProbe

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("root")]


def backing_file(dev: str) -> str:
    return subprocess.run(["losetup", "-n", "-O", "BACK-FILE", dev], check=True, capture_output=True,
                          text=True, timeout=30).stdout.strip()


@contextmanager
def bind_mount(src: Path, dst: Path) -> Iterator[Path]:
    dst.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(dst)], check=True, timeout=30)
    try:
        yield dst
    finally:
        subprocess.run(["umount", str(dst)], check=False, timeout=30)
        dst.rmdir()


def test_file_in_loop_ext4_maps_to_mount_loop_and_backing_file(tmp_path: Path) -> None:
    with loop_ext4(64) as fs:
        out = fs.mnt / "rows_0-2000"
        out.mkdir()
        (out / "data_0.ckpt").write_bytes(b"\0" * (1 << 20))
        probe = DisksProbe([out / "data_0.ckpt"], dev_shm=None)
        obs = probe.collect()
        (entry,) = obs.paths
        assert entry.status is ProbeStatus.ok, entry.detail
        assert entry.mount.mount_point == str(fs.mnt) and entry.mount.fs_type == "ext4"
        assert entry.mount.source == fs.dev
        assert entry.device.name == Path(fs.dev).name
        assert entry.device.loop_backing_file == backing_file(fs.dev)
        assert 0 < entry.free_bytes < entry.total_bytes <= 64 << 20
        assert entry.free_inodes > 0 and 0 <= entry.used_pct < 100
        assert Path(fs.dev).name in {d.name for d in obs.devices}

        # The same directory bind-mounted on a path with a space (mountinfo writes \040).
        with bind_mount(out, tmp_path / "bind dir") as bind:
            (entry,) = DisksProbe([bind / "data_0.ckpt"], dev_shm=None).collect().paths
            assert entry.mount.mount_point == str(bind) and entry.mount.root == "/rows_0-2000"
            assert entry.fs_path == "/rows_0-2000/data_0.ckpt"
            assert entry.device.loop_backing_file == backing_file(fs.dev)


def test_frozen_fs_with_writer_in_d_probe_returns_within_deadline() -> None:
    deadline_s = 2.0
    with frozen_ext4(64) as (mnt, dev), spawn_in_state("D", where=mnt) as writer:
        # The writer blocks in mnt_want_write (docs/field.md): state D, wchan percpu_rwsem_wait.
        probe = DisksProbe([mnt, mnt / "stuck"], statvfs_deadline_s=deadline_s, dev_shm=None)
        t0 = time.monotonic()
        obs = probe.collect()
        assert time.monotonic() - t0 < deadline_s + 1.0
        for entry in obs.paths:
            # ext4's statfs takes no freeze protection, so it answers; if a kernel ever makes it
            # wait, it must come back as a timeout with evidence, not as a hung probe.
            assert entry.status in (ProbeStatus.ok, ProbeStatus.timeout), entry.detail
            if entry.status is ProbeStatus.timeout:
                assert entry.detail.startswith(f"statvfs on {entry.path} did not return")
            assert entry.mount.mount_point == str(mnt)
            assert entry.device.name == Path(dev).name
            assert entry.device.loop_backing_file == backing_file(dev)
        # The frozen writer's file does not exist yet: the entry says so and measures its parent.
        assert obs.paths[1].exists is False and obs.paths[1].resolved_path == str(mnt)
        # No assertion on the loop device's counters: fsfreeze stops writers above the block
        # layer, and what is in flight there at this instant (a straggling journal or lazy-init
        # write) is timing, not the signal. The processes probe sees the writer in D.
        assert task_state(writer.pid) == "D"  # still frozen: the probe released nothing


# -- a dead mount: FUSE with no daemon answering (rigs.dead_fuse_mount) -----------------------------

@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")
def test_dead_mount_statvfs_times_out_then_is_not_retried() -> None:
    with dead_fuse_mount() as (mnt, abort):
        before = set(threading.enumerate())
        probe = DisksProbe([mnt / "outputs"], statvfs_deadline_s=0.5, dev_shm=None)
        t0 = time.monotonic()
        (entry,) = probe.collect().paths
        assert time.monotonic() - t0 < 1.5
        assert entry.status is ProbeStatus.timeout
        assert entry.detail == (f"statvfs on {mnt}/outputs did not return in 0.5 s "
                                f"(fuse stallwatch-dead, mounted at {mnt})")
        assert entry.mount.fs_type == "fuse" and entry.device is None and entry.free_bytes is None

        t0 = time.monotonic()
        (entry,) = probe.collect().paths
        assert time.monotonic() - t0 < 1.5
        assert entry.status is ProbeStatus.busy and entry.stuck_for_s >= 0.5
        assert "has not returned for" in entry.detail
        mine = [t for t in set(threading.enumerate()) - before if t.name.startswith("statvfs:")]
        assert len(mine) == 1, mine  # the stuck thread is waited on, never doubled

        abort()  # the server "comes back" broken: the stuck call now fails, and says how
        (entry,) = probe.collect().paths
        assert entry.status is ProbeStatus.error
        assert entry.detail == f"statvfs on {mnt}/outputs failed: Transport endpoint is not connected"
