"""The disks probe re-reads mountinfo only when the kernel says a mount changed (POLLPRI on a
kept descriptor, proc(5)), and a mount made between two collects is in the second (issue 17)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path
from typing import ClassVar

import pytest
from rigs import root, spawned, wait_until  # noqa: F401 (root is a fixture)

from stallwatch.probes.disks import DisksProbe
from stallwatch.kernel.roots import Roots


class CountingRoots(Roots):
    reads: ClassVar[list[str]] = []

    def read_text(self, path, limit=1 << 20):
        CountingRoots.reads.append(str(path))
        return super().read_text(path, limit)


def mountinfo_reads() -> int:
    return sum(1 for r in CountingRoots.reads if r.endswith("/mountinfo"))


def test_mountinfo_is_read_again_only_after_a_mount(root, tmp_path: Path) -> None:
    """In a private mount namespace of its own (the job's, read through mountinfo_pid), so that
    other mounts on this shared host raise no event."""
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("needs unshare and nsenter (util-linux)")
    mnt = tmp_path / f"cost-tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    with spawned(["unshare", "-m", "--propagation", "private", "sleep", "600"]) as ns:
        wait_until(lambda: Path(f"/proc/{ns.pid}/ns/mnt").resolve() != Path("/proc/self/ns/mnt").resolve()
                   and Path(f"/proc/{ns.pid}/comm").read_text().strip() == "sleep", what="the namespace")
        in_ns = ["nsenter", "-t", str(ns.pid), "-m"]
        probe = DisksProbe([mnt], dev_shm=None, roots=CountingRoots(), mountinfo_pid=ns.pid)
        try:
            CountingRoots.reads.clear()
            (before,) = probe.collect().paths
            probe.collect()
            probe.collect()
            quiet = mountinfo_reads()
            subprocess.run([*in_ns, "mount", "-t", "tmpfs", "-o", "size=1m", "cost-tmpfs", str(mnt)],
                           check=True)
            (after,) = probe.collect().paths
            subprocess.run([*in_ns, "umount", str(mnt)], check=True)
            (gone,) = probe.collect().paths
        finally:
            probe.close()
    assert before.mount is not None and before.mount.source != "cost-tmpfs"
    assert after.mount.mount_point == str(mnt) and after.mount.source == "cost-tmpfs"
    assert gone.mount.mount_point != str(mnt)
    assert quiet == 1 and mountinfo_reads() == 3  # read at first, after the mount, after the umount
