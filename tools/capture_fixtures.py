#!/usr/bin/env python3
"""Capture a fixture root from this machine (node_exporter's collector/fixtures idea).

A root is what the kernel shows, laid out as the kernel shows it, so tests read it with
`Roots.under(root)` exactly as the probes read the live machine:

    ROOT/proc/PID/...         the staged processes (below), files as files, links as links
    ROOT/proc/stat            btime: what turns start ticks and kernel-log stamps into wall time
    ROOT/proc/self/sched      `cat /proc/self/sched` (se.exec_start)
    ROOT/proc/diskstats, ROOT/proc/self/mountinfo, ROOT/sys/{dev/block,block,class/block,devices}
    ROOT/dev/kmsg             the kernel log, one record a line as read(2) returns it
    ROOT/pids.json            which captured pid plays which part

Run as root on a real kernel (stack, syscall and io need it; D needs a loop device and
fsfreeze; the disks part needs losetup, addpart, mkfs.ext4 and mount):

    sudo .venv/bin/python tools/capture_fixtures.py tests/fixtures/host2
    sudo .venv/bin/python tools/capture_fixtures.py /tmp/kmsg-only --only kmsg

Everything staged is torn down again. tests/fixtures/README.md lists the roots and what each
capture set up; read it before replacing one (the tests assert what the files hold).

processes: server  comm "sw) srv (x" (spaces and parentheses), argv[0] set with exec -a,
                   blocked in accept4 on 127.0.0.1 and ::1;
           client  main thread blocked in recvfrom on its IPv4 connection to the server, a
                   second thread on its IPv6 one;
           writer  a shell whose open(O_CREAT) on a frozen ext4 blocks in D (percpu_rwsem_wait);
           zombie  an exited child (status 3) its parent has not reaped, and that parent.
disks:     a loop device with a partition (loopNp1) mounted on a path with a space in it
           (mountinfo writes it as \\040); a plain loop-mounted ext4 and a bind mount of one of
           its subdirectories (mountinfo's root field).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from rigs import frozen_ext4, spawn_in_state, spawned, wait_for_state, wait_until  # noqa: E402 - tests/ on the path first

PROC = Path("/proc")
PARTS = ("processes", "disks", "kmsg", "sched")

# -- processes -------------------------------------------------------------------------------------

PER_TASK = ("stat", "status", "wchan", "syscall", "stack", "comm")
PER_PROCESS = PER_TASK + ("io", "cmdline")

SERVER = r"""
import ctypes, socket, sys
ctypes.CDLL(None).prctl(15, b"sw) srv (x", 0, 0, 0)
v4 = socket.create_server(("127.0.0.1", 0))
v6 = socket.create_server(("::1", 0), family=socket.AF_INET6)
print(v4.getsockname()[1], v6.getsockname()[1], flush=True)
held = [v4.accept(), v6.accept()]
v4.accept()
"""

CLIENT = r"""
import socket, sys, threading
v4 = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
v6 = socket.create_connection(("::1", int(sys.argv[2])))
threading.Thread(target=v6.recv, args=(1,)).start()
v4.recv(1)
"""

ZOMBIE_PARENT = r"""
import os, sys, time
child = os.fork()
if child == 0:
    os._exit(3)
print(child, flush=True)
sys.stdin.read()  # our PID 1 may not reap orphans: reap the zombie ourselves when told
os.waitpid(child, 0)
"""


def copy_entry(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        try:
            os.symlink(os.readlink(src), dst)
        except OSError:
            pass
        return
    try:
        dst.write_bytes(src.read_bytes())
    except OSError:
        pass  # not readable for this task (running, zombie): absent in the fixture too


def copy_process(pid: int, proc_out: Path) -> None:
    src, dst = PROC / str(pid), proc_out / str(pid)
    for name in PER_PROCESS:
        copy_entry(src / name, dst / name)
    for link in ("cwd", "ns/net"):
        copy_entry(src / link, dst / link)
    for name in ("net/tcp", "net/tcp6"):
        copy_entry(src / name, dst / name)
    for fd in os.listdir(src / "fd"):
        copy_entry(src / "fd" / fd, dst / "fd" / fd)
        copy_entry(src / "fdinfo" / fd, dst / "fdinfo" / fd)
    (dst / "fd").mkdir(parents=True, exist_ok=True)
    for tid in os.listdir(src / "task"):
        for name in PER_TASK:
            copy_entry(src / "task" / tid / name, dst / "task" / tid / name)


def capture_processes(root: Path) -> dict[str, int]:
    py = sys.executable
    with spawned(["bash", "-c", f'exec -a "sw fixture server" {py} -c "$1"', "bash", SERVER],
                 stdout=subprocess.PIPE) as server, \
            spawned([py, "-c", ZOMBIE_PARENT], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE) as parent, \
            frozen_ext4() as (mnt, _dev), spawn_in_state("D", where=mnt) as writer:
        ports = server.stdout.readline().split()
        with spawned([py, "-c", CLIENT, *map(bytes.decode, ports)]) as client:
            wait_until(lambda: len(os.listdir(f"/proc/{client.pid}/task")) == 2,
                       what="client threads")
            wait_until(lambda: all(
                (PROC / str(client.pid) / "task" / t / "wchan").read_text() not in ("", "0")
                for t in os.listdir(f"/proc/{client.pid}/task")), what="client blocked in recv")
            wait_for_state(server.pid, "S")
            zombie = int(parent.stdout.readline())
            wait_for_state(zombie, "Z")
            roles = {"server": server.pid, "client": client.pid, "writer": writer.pid,
                     "zombie": zombie, "zombie_parent": parent.pid}
            for pid in roles.values():
                copy_process(pid, root / "proc")
            parent.stdin.close()
            parent.wait(timeout=10)
    return roles


# -- disks -----------------------------------------------------------------------------------------

SMALL_FILES = ("dev", "size", "stat", "inflight", "partition", "start", "ro", "removable",
               "loop/backing_file", "loop/offset", "loop/autoclear", "dm/name", "dm/uuid")


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip()


def copy_sys(root: Path) -> None:
    """/sys/dev/block links and the small files of each device; /sys/block and /sys/class/block
    links kept as relative links, so they resolve inside the root."""
    sysdir = root / "sys"
    for link in sorted(Path("/sys/dev/block").iterdir()):
        target = os.readlink(link)
        dst_link = sysdir / "dev" / "block" / link.name
        dst_link.parent.mkdir(parents=True, exist_ok=True)
        dst_link.symlink_to(target)
        real = Path(os.path.normpath(link.parent / target))
        dev_out = Path(os.path.normpath(dst_link.parent / target))
        for rel in SMALL_FILES:
            src = real / rel
            if src.is_file():
                (dev_out / rel).parent.mkdir(parents=True, exist_ok=True)
                (dev_out / rel).write_bytes(src.read_bytes())
    for cls in ("block", "class/block"):
        for link in sorted(Path("/sys", cls).iterdir()):
            dst = sysdir / cls / link.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(os.readlink(link))


def capture_disks(root: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="sw fixture "))
    mounted: list[Path] = []
    loops: list[str] = []
    try:
        part_img, data_img = work / "part.img", work / "data.img"
        subprocess.run(["truncate", "-s", "64M", str(part_img), str(data_img)], check=True)
        loop = sh("losetup", "-f", "--show", str(part_img))
        loops.append(loop)
        # A kernel without partition-table parsers (CONFIG_*_PARTITION unset) still takes a
        # partition declared with the BLKPG ioctl; sysfs shows it exactly as a scanned one.
        sh("addpart", loop, "1", "2048", str(64 * 2048 - 2048))
        sh("mkfs.ext4", "-q", f"{loop}p1")
        part_mnt = work / "part mnt"
        part_mnt.mkdir()
        sh("mount", f"{loop}p1", str(part_mnt))
        mounted.append(part_mnt)

        sh("mkfs.ext4", "-q", str(data_img))
        data_mnt = work / "data"
        data_mnt.mkdir()
        sh("mount", "-o", "loop", str(data_img), str(data_mnt))  # autoclear: gone at umount
        mounted.append(data_mnt)
        (data_mnt / "sub").mkdir()
        bind = work / "bind"
        bind.mkdir()
        sh("mount", "--bind", str(data_mnt / "sub"), str(bind))
        mounted.append(bind)

        (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
        (root / "proc" / "diskstats").write_bytes((PROC / "diskstats").read_bytes())
        (root / "proc" / "self" / "mountinfo").write_bytes((PROC / "self" / "mountinfo").read_bytes())
        copy_sys(root)
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", str(m)], check=False)
        for lo in loops:
            subprocess.run(["delpart", lo, "1"], check=False, capture_output=True)
            subprocess.run(["losetup", "-d", lo], check=False)
        subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)


# -- the kernel log and the scheduler --------------------------------------------------------------

def capture_kmsg(root: Path) -> int:
    """Every record still in the ring, oldest first: one read(2) of /dev/kmsg returns one record
    (with its continuation lines); EAGAIN at the end, EPIPE where the ring overwrote records
    between two reads (skipped, as the probe does: the gap shows in the seq numbers)."""
    (root / "dev").mkdir(parents=True, exist_ok=True)
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    n = 0
    try:
        with open(root / "dev" / "kmsg", "wb") as out:
            while True:
                try:
                    rec = os.read(fd, 8192)
                except OSError as e:
                    if e.errno == errno.EPIPE:
                        continue
                    if e.errno == errno.EAGAIN:
                        return n
                    raise
                out.write(rec)
                n += 1
    finally:
        os.close(fd)


def capture_sched(root: Path) -> None:
    (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "self" / "sched").write_text(sh("cat", "/proc/self/sched") + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="the fixture root to create (must not exist)")
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated parts to capture (default: {','.join(PARTS)})")
    args = ap.parse_args(argv)
    parts = args.only.split(",")
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    if args.root.exists():
        ap.error(f"{args.root} exists: a capture is written whole into a new root")
    args.root.mkdir(parents=True)
    (args.root / "proc").mkdir()
    (args.root / "proc" / "stat").write_bytes((PROC / "stat").read_bytes())
    said: dict[str, object] = {}
    if "processes" in parts:
        said["pids"] = capture_processes(args.root)
        (args.root / "pids.json").write_text(json.dumps(said["pids"], indent=1) + "\n")
    if "disks" in parts:
        capture_disks(args.root)
        said["disks"] = "proc/diskstats, proc/self/mountinfo, sys/"
    if "kmsg" in parts:
        said["kmsg_records"] = capture_kmsg(args.root)
    if "sched" in parts:
        capture_sched(args.root)
        said["sched"] = "proc/self/sched"
    print(json.dumps(said))
    return 0


if __name__ == "__main__":
    sys.exit(main())
