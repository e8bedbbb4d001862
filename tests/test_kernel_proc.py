"""kernel/proc.py, the typed reads of /proc: on the real captures of tests/fixtures/host1 (made by
tests/test_procfs.py's rig: a server, its zombie child, a writer in D) and on live processes."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stallwatch.kernel import proc
from stallwatch.kernel.proc import Proc
from stallwatch.kernel.roots import Absent, Roots

CAPTURED = Roots.under(Path(__file__).parent / "fixtures" / "host1")


def test_captured_process_reads_typed():
    server = Proc(8389, CAPTURED)
    assert server.stat().comm == "sw) srv (x"  # a comm with ')' and spaces, as prctl set it
    assert server.stat().ppid == 8388
    assert server.argv()[:2] == ("sw fixture server", "-c")  # one argv[0], spaces and all
    assert server.argv_bytes()[:2] == (b"sw fixture server", b"-c")
    assert server.fds() == [0, 1, 2, 3, 4, 5, 6]
    assert server.fd_target(3) == "socket:[12738]"
    assert server.cwd() == "/srv/extract"
    assert server.tids() == [8389]
    assert server.status().uid == 0
    assert proc.pids(CAPTURED) == [8389, 8390, 8392, 8400, 8401]
    assert proc.btime(CAPTURED) == 1795989902


def test_live_thread_of_captured_states():
    writer = Proc(8400, CAPTURED).live_thread()
    assert writer is not None and (writer.pid, writer.state) == (8400, "D")
    zombie = Proc(8392, CAPTURED)
    assert zombie.stat().state == "Z"
    assert zombie.live_thread() is None  # its only thread has exited: gone for good


def test_absent_process_raises_absent():
    with pytest.raises(Absent):
        Proc(4_000_000, CAPTURED).stat()
    assert Proc(4_000_000, CAPTURED).live_thread() is None


def test_host_wide_reads_on_the_live_host():
    bid = proc.boot_id()
    assert len(bid) == 36 and bid.count("-") == 4 and proc.boot_id() == bid
    assert proc.btime() < time.time()
    assert proc.net_tcp("tcp").lstrip().startswith("sl")  # the table's header line
    with pytest.raises(ValueError):
        proc.net_tcp("../../etc/passwd")
    assert os.getpid() in proc.pids()
    me = Proc(os.getpid())
    assert me.owner_uid() == os.geteuid() and me.stat().pid == os.getpid()
    assert me.environ_bytes().count(b"\0") >= 1


def test_self_fd_path_names_the_open_file(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"data")
    fd = os.open(f, os.O_RDONLY)
    try:
        assert os.stat(proc.self_fd_path(fd)).st_ino == os.fstat(fd).st_ino
    finally:
        os.close(fd)


ZOMBIE_LEADER = r"""
import ctypes, threading, time
threading.Thread(target=lambda: time.sleep(60), daemon=True).start()
print("ready", flush=True)
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit (x86_64): this thread only, the other lives on
"""


def test_live_thread_of_a_real_zombie_leader():
    """The main thread exits alone (SYS_exit, not exit_group): the leader reads Z while a
    thread sleeps on in S. Not gone: live_thread names that thread."""
    if platform.machine() != "x86_64":
        pytest.skip("SYS_exit's number is x86_64's in this test")
    p = subprocess.Popen([sys.executable, "-c", ZOMBIE_LEADER], stdout=subprocess.PIPE,
                         start_new_session=True)
    try:
        assert p.stdout.readline() == b"ready\n"
        leader = Proc(p.pid)
        deadline = time.monotonic() + 10
        while leader.stat().state != "Z":
            assert time.monotonic() < deadline, "the leader never exited"
            time.sleep(0.02)
        live = leader.live_thread()
        assert live is not None and live.pid != p.pid and live.state in ("S", "R")
        assert live.pid in leader.tids()
    finally:
        os.killpg(p.pid, 9)
        p.wait(10)
        p.stdout.close()
