"""A process's fd table and cwd are read again only when one of its threads ran (issue 17),
and a new, closed or replaced fd is still seen on the very next collect; a rename by another
process within STAT_EVERY_TICKS collects. A real process with idle threads, driven through
its stdin."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import ClassVar

from rigs import spawned, task_state, wait_until

from stallwatch.kernel.roots import Roots
from stallwatch.probes.processes import ProcessesProbe, ProcessObs
from stallwatch.probes.processes_threads import STAT_EVERY_TICKS
from stallwatch.probes.targets import Target

# Idle threads, and a main thread that does what its stdin says, then answers on stdout.
JOB = r"""
import os, sys, threading
for _ in range(4):
    threading.Thread(target=threading.Event().wait, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "open":
        print(os.open(args[0], os.O_WRONLY | os.O_CREAT), flush=True)
    elif cmd == "dup2":
        fd = os.open(args[0], os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, int(args[1]))
        os.close(fd)
        print("ok", flush=True)
    elif cmd == "close":
        os.close(int(args[0]))
        print("ok", flush=True)
    elif cmd == "connect":
        import socket
        s = socket.create_connection(("127.0.0.1", int(args[0])))
        print(s.detach(), flush=True)
"""


class ListingRoots(Roots):
    """Roots that counts the listings of a process's fd directory, and its ns/net readlinks."""

    listings: ClassVar[list[str]] = []
    links: ClassVar[list[str]] = []

    def listdir(self, path):
        if str(path).endswith("/fd"):
            ListingRoots.listings.append(str(path))
        return super().listdir(path)

    def readlink(self, path):
        ListingRoots.links.append(str(path))
        return super().readlink(path)


def ask(proc, line: str) -> str:
    proc.stdin.write(f"{line}\n".encode())
    proc.stdin.flush()
    answer = proc.stdout.readline().decode().strip()
    wait_until(lambda: task_state(proc.pid) == "S", what="the job to block in read again")
    return answer


def idle_job():
    return spawned([sys.executable, "-c", JOB], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def files_of(probe: ProcessesProbe, pid: int) -> ProcessObs:
    (p,) = [p for p in probe.collect().processes if p.pid == pid]
    return p


def test_an_idle_process_fd_table_is_not_listed_again_and_changes_are_seen_next_collect(tmp_path):
    with idle_job() as proc:
        assert proc.stdout.readline() == b"ready\n"
        wait_until(lambda: all(task_state(proc.pid, int(t)) == "S"
                               for t in os.listdir(f"/proc/{proc.pid}/task")),
                   what="every thread to sleep")
        probe = ProcessesProbe(Target(pids=(proc.pid,)), roots=ListingRoots())
        first = files_of(probe, proc.pid)
        files_of(probe, proc.pid)  # the walk's first batch: the table kept from here
        ListingRoots.listings.clear()
        quiet = [files_of(probe, proc.pid) for _ in range(4)]
        # at most one of four is its turn to be read anyway (one tick in STAT_EVERY_TICKS)
        assert len(ListingRoots.listings) <= 1, ListingRoots.listings
        assert all(q.num_fds == first.num_fds and q.cwd == first.cwd for q in quiet)
        assert [f.path for f in quiet[-1].open_files] == [f.path for f in first.open_files]

        fd = int(ask(proc, f"open {tmp_path / 'a.bin'}"))
        got = files_of(probe, proc.pid)
        assert (fd, str(tmp_path / "a.bin"), True) in {(f.fd, f.path, f.write) for f in got.open_files}
        assert got.num_fds == first.num_fds + 1

        assert ask(proc, f"dup2 {tmp_path / 'b.bin'} {fd}") == "ok"  # same count, another file
        got = files_of(probe, proc.pid)
        assert {f.path for f in got.open_files if f.fd == fd} == {str(tmp_path / "b.bin")}

        assert ask(proc, f"close {fd}") == "ok"
        got = files_of(probe, proc.pid)
        assert fd not in {f.fd for f in got.open_files} and got.num_fds == first.num_fds


def test_a_file_renamed_by_another_process_is_seen_within_the_tables_turn(tmp_path):
    """No thread of the job runs when another process renames its open file: its table is
    read again one tick in STAT_EVERY_TICKS, which bounds how long the old name is shown."""
    with idle_job() as proc:
        assert proc.stdout.readline() == b"ready\n"
        fd = int(ask(proc, f"open {tmp_path / 'old.bin'}"))
        probe = ProcessesProbe(Target(pids=(proc.pid,)))
        for _ in range(2):
            files_of(probe, proc.pid)
        os.rename(tmp_path / "old.bin", tmp_path / "new.bin")
        paths = []
        for _ in range(STAT_EVERY_TICKS):
            got = files_of(probe, proc.pid)
            paths.append({f.path for f in got.open_files if f.fd == fd})
        assert {str(tmp_path / "new.bin")} in paths, paths
        assert paths[-1] == {str(tmp_path / "new.bin")}  # and from then on


def test_an_idle_process_socket_state_moves_with_its_table_reused():
    """The peer closes the connection while no thread of the job runs: its table stands (not
    listed, its namespace not read again), and the socket's new state is seen next collect."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    with server, idle_job() as proc:
        assert proc.stdout.readline() == b"ready\n"
        fd = int(ask(proc, f"connect {server.getsockname()[1]}"))
        peer, _ = server.accept()
        probe = ProcessesProbe(Target(pids=(proc.pid,)), roots=ListingRoots())
        for _ in range(2):
            files_of(probe, proc.pid)
        ListingRoots.listings.clear()
        ListingRoots.links.clear()
        before = files_of(probe, proc.pid)
        assert [(s.fd, s.state) for s in before.tcp] == [(fd, "ESTABLISHED")]
        peer.close()
        wait_until(lambda: task_state(proc.pid) == "S", what="the job to stay asleep")
        after = files_of(probe, proc.pid)
        assert [(s.fd, s.state) for s in after.tcp] == [(fd, "CLOSE_WAIT")]
        # at most one of the two collects is the table's turn; only that one reads ns/net
        ns_reads = [p for p in ListingRoots.links if p.endswith("/ns/net")]
        assert len(ns_reads) <= len(ListingRoots.listings) <= 1, ListingRoots.links


# A main thread as JOB's, and a thread that spins while it is `on` (runnable at every look, on a
# loaded host too: a busy job's), and sleeps on an event when `off`.
BUSY_JOB = r"""
import os, sys, threading
go, parked = threading.Event(), threading.Event()
def busy():
    while True:
        if not go.is_set():
            parked.set()
            go.wait()
            parked.clear()
t = threading.Thread(target=busy, daemon=True)
t.start()
print(t.native_id, flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "on":
        go.set()
    elif cmd == "off":
        go.clear()
        parked.wait()
    elif cmd == "open":
        print(os.open(args[0], os.O_WRONLY | os.O_CREAT), flush=True)
        continue
    elif cmd == "dup2":
        fd = os.open(args[0], os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, int(args[1]))
        os.close(fd)
    elif cmd == "pipe":  # a pipe in place of fd N: the same count, no regular file
        r, w = os.pipe()
        os.dup2(r, int(args[0]))
        os.close(r)
        os.close(w)
        print(os.fstat(int(args[0])).st_ino, flush=True)
        continue
    print("ok", flush=True)
"""


def in_futex(pid: int, tid: int) -> bool:
    from stallwatch.kernel import procfs

    with open(f"/proc/{pid}/task/{tid}/syscall") as f:
        sc = procfs.parse_syscall(f.read(), procfs.SYSCALLS)
    return sc is not None and sc.name == "futex"


def test_a_running_process_fd_table_is_reused_and_exact_once_its_threads_sleep(tmp_path):
    """A thread runs between every two collects: the table is not listed each time, yet a new
    fd (the count) and an fd opened again on another regular file (fdinfo's inode) show on
    the next collect, another kind of fd in place of one within the table's turn, and the
    first collect after every thread slept reads it afresh."""
    with spawned([sys.executable, "-c", BUSY_JOB], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE) as proc:
        busy = int(proc.stdout.readline())
        assert ask(proc, "on") == "ok"
        probe = ProcessesProbe(Target(pids=(proc.pid,)), roots=ListingRoots())
        first = [files_of(probe, proc.pid) for _ in range(2)][-1]
        ListingRoots.listings.clear()
        running = [files_of(probe, proc.pid) for _ in range(4)]
        assert len(ListingRoots.listings) <= 1, ListingRoots.listings  # the table's turn only
        assert all(r.num_fds == first.num_fds for r in running)

        fd = int(ask(proc, f"open {tmp_path / 'a.bin'}"))
        got = files_of(probe, proc.pid)
        assert (fd, str(tmp_path / "a.bin"), True) in {(f.fd, f.path, f.write) for f in got.open_files}
        assert ask(proc, f"dup2 {tmp_path / 'b.bin'} {fd}") == "ok"  # same count, another file
        got = files_of(probe, proc.pid)
        assert {f.path for f in got.open_files if f.fd == fd} == {str(tmp_path / "b.bin")}

        ask(proc, f"pipe {fd}")
        paths = [{f.path for f in files_of(probe, proc.pid).open_files if f.fd == fd}
                 for _ in range(STAT_EVERY_TICKS)]
        assert any(p and next(iter(p)).startswith("pipe:") for p in paths), paths

        # two collects to come that are not the table's turn: the first sees the threads that
        # ran for the commands below, the second is the first with none run since
        while any((proc.pid + n) % STAT_EVERY_TICKS == 0
                  for n in (probe._collects, probe._collects + 1)):
            files_of(probe, proc.pid)
        assert ask(proc, f"dup2 {tmp_path / 'c.bin'} {fd}") == "ok"
        ino = ask(proc, f"pipe {fd}")  # a regular file, then another pipe: the same count
        assert ask(proc, "off") == "ok"
        wait_until(lambda: in_futex(proc.pid, busy), what="the busy thread to sleep")
        files_of(probe, proc.pid)
        ListingRoots.listings.clear()
        quiet = files_of(probe, proc.pid)
        assert len(ListingRoots.listings) == 1
        assert {f.path for f in quiet.open_files if f.fd == fd} == {f"pipe:[{ino}]"}
