#!/usr/bin/env python3
"""Capture real /proc files into tests/fixtures/proc (node_exporter's collector/fixtures idea).

Run as root on a real kernel (stack, syscall and io need it; D needs a loop device and fsfreeze):
    .venv/bin/python tools/capture_proc_fixtures.py [OUT_DIR]

It stages the processes the tests talk about, copies their /proc entries (files as files,
symlinks such as fd/N and cwd as symlinks), writes tests/fixtures/proc/pids.json naming which
pid plays which part, and tears everything down again:
  server  comm "sw) srv (x" (spaces and parentheses), argv[0] set with exec -a, blocked in
          accept4 on 127.0.0.1 and ::1;
  client  main thread blocked in recvfrom on its IPv4 connection to the server, a second
          thread on its IPv6 one;
  writer  a shell whose open(O_CREAT) on a frozen ext4 blocks in D (percpu_rwsem_wait);
  zombie  an exited child (status 3) its parent has not reaped, and that parent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from rigs import frozen_ext4, spawn_in_state, spawned, wait_for_state, wait_until  # noqa: E402

PROC = Path("/proc")
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


def capture(pid: int, out: Path) -> None:
    src, dst = PROC / str(pid), out / str(pid)
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


def main() -> int:
    repo = Path(__file__).resolve().parent.parent
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else repo / "tests" / "fixtures" / "proc"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "stat").write_bytes((PROC / "stat").read_bytes())
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
                capture(pid, out)
            parent.stdin.close()
            parent.wait(timeout=10)
    (out / "pids.json").write_text(json.dumps(roles, indent=1) + "\n")
    print(json.dumps(roles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
