"""The processes probe reads only what can have changed (issue 17), and sees no less for it.

Idle threads are not re-read past their stat and schedstat; a thread that ran, went to D, was
stopped or stopped running is read afresh on the very next collect; threads that end take their
kept descriptors with them. Real processes, real kernel states, an injected clock.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import ValidationError
from rigs import (FakeProc, frozen_ext4, root, spawned,  # noqa: F401 (root is a fixture)
                  task_state, wait_until)

from stallwatch.clock import FakeClock
from stallwatch.probes import processes_threads as threads_mod
from stallwatch.probes.processes import ProcessesProbe, ProcessObs, ThreadObs
from stallwatch.kernel.roots import Roots
from stallwatch.probes.targets import Target

# A process with 8 idle threads and one worker that waits on an event, then does argv[1]:
# "pipe" (blocks in read on a pipe: S again, another syscall), "spin" (busy until a file
# exists, then blocks on a pipe), or a path to open for writing (D on a frozen mount).
JOB = r"""
import os, sys, threading, time
r, w = os.pipe()
go = threading.Event()
def worker():
    go.wait()
    if sys.argv[1] == "pipe":
        os.read(r, 1)
    elif sys.argv[1] == "spin":
        while not os.path.exists(sys.argv[2]):
            pass
        os.read(r, 1)
    else:
        os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)
for _ in range(8):
    threading.Thread(target=threading.Event().wait, daemon=True).start()
t = threading.Thread(target=worker, daemon=True)
t.start()
print(t.native_id, flush=True)
sys.stdin.readline()
go.set()
time.sleep(1000)
"""


class CountingRoots(Roots):
    """Roots that records every path read through it (the kept descriptors are not)."""

    reads: ClassVar[list[str]] = []

    def read_text(self, path, limit=1 << 20):
        CountingRoots.reads.append(str(path))
        return super().read_text(path, limit)

    def read_small(self, path, limit=16384):
        CountingRoots.reads.append(str(path))
        return super().read_small(path, limit)


def job(*args: str):
    return spawned([sys.executable, "-c", JOB, *args], stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE)


def worker_of(proc) -> int:
    tid = int(proc.stdout.readline())
    wait_until(lambda: all(task_state(proc.pid, int(t)) == "S"
                           for t in os.listdir(f"/proc/{proc.pid}/task")),
               what="every thread to sleep")
    return tid


def thread(probe: ProcessesProbe, pid: int, tid: int) -> ThreadObs:
    (p,) = [p for p in probe.collect().processes if p.pid == pid]
    (t,) = [t for t in p.threads if t.tid == tid]
    return t


def go(proc) -> None:
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


def open_proc_files() -> dict[int, str]:
    """Our descriptors: number -> what it is open on."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            pass  # the listing's own descriptor
    return out


def has_schedstat() -> bool:
    return os.path.isfile(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat")


def test_idle_threads_are_not_read_again_and_report_the_same():
    if not has_schedstat():
        pytest.skip("this kernel has no /proc/PID/task/TID/schedstat (CONFIG_SCHED_INFO)")
    clock = FakeClock()
    with job("pipe") as proc:
        worker_of(proc)
        probe = ProcessesProbe(Target(pids=(proc.pid,)), roots=CountingRoots(), clock=clock)
        probe.collect()  # a full scan of /proc
        clock.advance(1.0)
        first = next(p for p in probe.collect().processes if p.pid == proc.pid)  # a tree walk
        CountingRoots.reads.clear()
        clock.advance(5.0)
        again = next(p for p in probe.collect().processes if p.pid == proc.pid)
    per_thread = [r for r in CountingRoots.reads if "/task/" in r]
    # The main thread sleeps in readline, the 9 others on futexes: none ran, none is re-read
    # (wait channel, syscall, stack, sched, status and children come from their last look).
    assert per_thread == [], per_thread
    assert len(again.threads) == len(first.threads) == 10
    for a, b in zip(first.threads, again.threads, strict=True):
        assert (a.tid, a.state, a.wchan, a.syscall, a.stack) == (b.tid, b.state, b.wchan, b.syscall, b.stack)
        assert b.state_since_s == a.state_since_s + 5.0 and b.ctx_unchanged_for_s >= 5.0
        assert b.cpu_delta_s == 0.0
    assert any(t.syscall == "futex" for t in again.threads)


def test_an_idle_thread_costs_one_read_of_its_schedstat():
    """Past the first looks, an idle thread's schedstat is all a collect reads of it: its stat
    only in its turn, one collect in STAT_EVERY_TICKS (processes_threads.py says why that is enough)."""
    if not has_schedstat():
        pytest.skip("this kernel has no /proc/PID/task/TID/schedstat (CONFIG_SCHED_INFO)")
    every = threads_mod.STAT_EVERY_TICKS
    with job("pipe") as proc:
        worker_of(proc)
        probe = ProcessesProbe(Target(pids=(proc.pid,)), clock=FakeClock())
        probe.collect()
        probe.collect()
        reads: list[str] = []
        kept_read, held_read = probe._kept.read, probe._kept.pread
        probe._kept.read = lambda path, *share: reads.append(path) or kept_read(path, *share)
        # schedstat's descriptor is held by the thread's memo and read by number: name it
        probe._kept.pread = lambda fd, n, at: (reads.append(os.readlink(f"/proc/self/fd/{fd}"))
                                               or held_read(fd, n, at))
        tids = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task"))
        stats = []
        for _ in range(every):
            reads.clear()
            probe.collect()
            assert sorted(r for r in reads if r.endswith("/schedstat")) == sorted(
                f"/proc/{proc.pid}/task/{t}/schedstat" for t in tids)
            stats.append({int(r.split("/")[-2]) for r in reads
                          if "/task/" in r and r.endswith("/stat")})
            assert not [r for r in reads if "/task/" in r and not r.endswith(("/stat", "/schedstat"))]
    # Each thread's stat once over STAT_EVERY_TICKS collects, and nothing else read per thread.
    assert sorted(t for s in stats for t in s) == tids
    assert len(tids) == 10


RENAMES_ITS_WORKER = r"""
import sys, threading
w = threading.Thread(target=threading.Event().wait, daemon=True)
w.start()
print(w.native_id, flush=True)
sys.stdin.readline()
with open(f"/proc/self/task/{w.native_id}/comm", "w") as f:  # only its own threads may
    f.write("renamed-w")
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_thread_renamed_by_another_is_seen_within_its_stat_turn():
    """A change made to a thread without it running (its comm, written by a sibling; a wake-up
    not yet given a CPU is the other) moves none of its schedstat: its stat turn bounds how
    long the change goes unseen."""
    if not has_schedstat():
        pytest.skip("this kernel has no /proc/PID/task/TID/schedstat (CONFIG_SCHED_INFO)")
    clock = FakeClock()
    with spawned([sys.executable, "-c", RENAMES_ITS_WORKER], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE) as proc:
        tid = int(proc.stdout.readline())
        wait_until(lambda: task_state(proc.pid, tid) == "S", what="the worker to sleep")
        probe = ProcessesProbe(Target(pids=(proc.pid,)), clock=clock)
        old = thread(probe, proc.pid, tid).comm
        before = Path(f"/proc/{proc.pid}/task/{tid}/schedstat").read_text()
        go(proc)
        assert proc.stdout.readline() == b"done\n"
        comms = []
        for _ in range(threads_mod.STAT_EVERY_TICKS):
            clock.advance(1.0)
            comms.append(thread(probe, proc.pid, tid).comm)
        after = Path(f"/proc/{proc.pid}/task/{tid}/schedstat").read_text()
        go(proc)
    assert before == after  # it did not run: only its turn could show the new name
    every = threads_mod.STAT_EVERY_TICKS
    turn = next(n for n in range(1, every + 1) if (tid + n) % every == 0)  # collect 0 was first
    assert comms == [old] * (turn - 1) + ["renamed-w"] * (every - turn + 1), (turn, comms)


def test_a_thread_that_ran_is_read_afresh_on_the_next_collect():
    """Asleep before and after, in another syscall: the same state letter, so only schedstat
    tells that it ran. utime+stime would not: it ran for microseconds."""
    clock = FakeClock()
    with job("pipe") as proc:
        tid = worker_of(proc)
        probe = ProcessesProbe(Target(pids=(proc.pid,)), clock=clock)
        before = thread(probe, proc.pid, tid)
        clock.advance(1.0)
        go(proc)
        wait_until(lambda: Path(f"/proc/{proc.pid}/task/{tid}/syscall").read_text().split()[0] == "0",
                   what="the worker to block in read")
        after = thread(probe, proc.pid, tid)
    assert before.syscall == "futex" and before.state == after.state == "S"
    assert after.syscall == "read" and after.syscall_fd is not None
    assert after.ctx_unchanged_for_s == 0.0


def test_a_thread_that_stops_running_is_seen_on_the_next_collect():
    clock = FakeClock()
    with job("spin", "/nonexistent-stallwatch-flag") as proc:
        tid = worker_of(proc)
        probe = ProcessesProbe(Target(pids=(proc.pid,)), clock=clock)
        go(proc)
        wait_until(lambda: task_state(proc.pid, tid) == "R", what="the worker to spin")
        probe.collect()
        clock.advance(1.0)
        assert thread(probe, proc.pid, tid).state == "R"
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: all(task_state(proc.pid, int(t)) == "t" or task_state(proc.pid, int(t)) == "T"
                               for t in os.listdir(f"/proc/{proc.pid}/task")), what="a stop")
        clock.advance(1.0)
        obs = next(p for p in probe.collect().processes if p.pid == proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
    # Stopped: every thread, the idle ones included, shows T at once, with its stop's stack.
    assert {t.state for t in obs.threads} == {"T"}
    assert all(t.state_since_s == 0.0 for t in obs.threads)
    assert all(t.wchan != "futex_wait_queue" for t in obs.threads)


@pytest.mark.root
def test_a_thread_that_goes_to_d_is_seen_on_the_next_collect(root):
    clock = FakeClock()
    with frozen_ext4() as (mnt, _dev), job(str(mnt / "ckpt")) as proc:
        tid = worker_of(proc)
        probe = ProcessesProbe(Target(pids=(proc.pid,)), clock=clock)
        probe.collect()
        clock.advance(1.0)
        idle = thread(probe, proc.pid, tid)
        go(proc)
        wait_until(lambda: task_state(proc.pid, tid) == "D", what="the worker to block in D")
        clock.advance(1.0)
        stuck = thread(probe, proc.pid, tid)
        clock.advance(2.0)
        still = thread(probe, proc.pid, tid)
    assert idle.state == "S" and idle.syscall == "futex"
    assert (stuck.state, stuck.syscall, stuck.wchan) == ("D", "openat", "percpu_rwsem_wait")
    assert stuck.stack[:2] == ("percpu_rwsem_wait", "mnt_want_write")
    assert stuck.d_state_for_s == 0.0 and still.d_state_for_s == 2.0
    assert still.stack == stuck.stack  # reused: it did not run


THREADS_COME_AND_GO = r"""
import sys, threading
stop = threading.Event()
def spawn():
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    return t
t = spawn()
print(t.native_id, flush=True)
for line in sys.stdin:
    stop.set(); t.join(); stop.clear()
    t = spawn()
    print(t.native_id, flush=True)
"""


def test_a_thread_replaced_under_an_unchanged_count_is_seen_and_its_files_closed():
    """One thread ends and another begins between two collects: stat's thread count is the
    same, yet the new thread is listed, and the old one's kept descriptors are closed."""
    with spawned([sys.executable, "-c", THREADS_COME_AND_GO], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE) as proc:
        old = int(proc.stdout.readline())
        probe = ProcessesProbe(Target(pids=(proc.pid,)))
        assert old in [t.tid for t in probe.collect().processes[0].threads]
        proc.stdin.write(b"next\n")
        proc.stdin.flush()
        new = int(proc.stdout.readline())
        wait_until(lambda: not os.path.exists(f"/proc/{proc.pid}/task/{old}"), what="the old thread to go")
        tids = [t.tid for t in probe.collect().processes[0].threads]
        kept = list(open_proc_files().values())
        assert [k for k in kept if f"/task/{new}/" in k]  # kept open while it lives
    assert new in tids and old not in tids and len(tids) == 2
    assert not [k for k in kept if f"/task/{old}/" in k], kept
    probe.collect()  # the job is gone: so are its descriptors
    assert not [k for k in open_proc_files().values() if f"/proc/{proc.pid}/" in k]


def test_kept_files_stay_within_their_budget_and_fail_like_reads(tmp_path):
    import threading

    from stallwatch.kernel.procfiles import FD_FLOOR, ProcFiles
    from stallwatch.kernel.roots import Absent

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    me, tid = os.getpid(), t.native_id
    files = ProcFiles(Roots(), max_open=1)
    first = files.read(f"/proc/{me}/task/{tid}/stat")
    assert files.read(f"/proc/{me}/task/{me}/stat").startswith(f"{me} (".encode())  # not kept
    assert len(files) == 1 and first.startswith(f"{tid} (".encode())
    (kept,) = [fd for fd, path in open_proc_files().items() if path == f"/proc/{me}/task/{tid}/stat"]
    assert kept >= FD_FLOOR  # clear of the numbers select() can take
    stop.set()
    t.join()
    # join() returns once Python is done with the thread, before the kernel task has exited:
    # until then its stat still reads. Under load that gap lasted long enough for half of 500
    # runs beside three busy loops to read it. The task directory goes when the kernel
    # releases the task, and a kept descriptor fails (ESRCH) from that same moment.
    wait_until(lambda: task_state(me, tid) is None, what=f"thread {tid} to leave the kernel")
    with pytest.raises(Absent):  # the thread ended: its kept descriptor says so, and is closed
        files.read(f"/proc/{me}/task/{tid}/stat")
    assert len(files) == 0
    files.read(f"/proc/{me}/task/{me}/stat")
    files.sweep()
    assert len(files) == 1  # read since the last sweep
    files.sweep()
    assert len(files) == 0


def test_a_taken_descriptor_is_its_owners_until_dropped():
    """take() hands a kept descriptor over: it leaves the path table (read() opens its own),
    counts against the budget, is never closed by sweep(), and is closed by drop() alone, so the
    number its owner holds is never closed and reused under it."""
    import threading

    from stallwatch.kernel.procfiles import FD_FLOOR, ProcFiles

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    me, tid = os.getpid(), t.native_id
    path = f"/proc/{me}/task/{tid}/schedstat"
    try:
        files = ProcFiles(Roots(), max_open=2, keep=1)
        files.read(path)
        fd = files.take(path)  # the descriptor read() kept, handed over
        assert fd is not None and fd >= FD_FLOOR and open_proc_files()[fd] == path
        assert len(files) == 1
        for _ in range(3):
            files.sweep()
        assert open_proc_files().get(fd) == path  # a sweep never closes it
        assert files.pread(fd, 128, 0) == files.read(path)  # read() keeps one of its own now
        assert len(files) == 2
        assert files.take(f"/proc/{me}/task/{me}/schedstat") is None  # past the budget
        files.drop(fd)
        assert fd not in open_proc_files() and len(files) == 1
        files.drop(fd)  # twice is nothing: the number may be another file's by now
    finally:
        stop.set()
        t.join()


def test_without_schedstat_context_switches_say_whether_a_thread_ran(tmp_path):
    """A fixture tree has no schedstat: status's context switches are the signal instead."""
    fake, clock = FakeProc(tmp_path), FakeClock()
    fake.add(100, state="S", ctx=(5, 1), wchan="futex_wait_queue", tids=(101,))
    probe = ProcessesProbe(Target(pids=(100,)), roots=fake.roots, clock=clock, self_pid=1)
    assert probe.collect().processes[0].wchan == "futex_wait_queue"
    clock.advance(1.0)
    fake.add(100, state="S", ctx=(6, 1), wchan="pipe_read", tids=(101,))  # it ran, sleeps elsewhere
    p = probe.collect().processes[0]
    assert p.wchan == "pipe_read" and p.ctx_unchanged_for_s == 0.0


def test_the_batch_of_idle_threads_equals_thread_idle():
    """_thread_rows writes _thread_idle out in its loop (the wide job's hot loop): each idle
    thread's record from it equals _thread_idle's for the same memo and tick, through every
    thread's stat turn."""
    if not has_schedstat():
        pytest.skip("this kernel has no /proc/PID/task/TID/schedstat (CONFIG_SCHED_INFO)")
    clock = FakeClock()
    seen = []
    with job("pipe") as proc:
        worker_of(proc)
        probe = ProcessesProbe(Target(pids=(proc.pid,)), clock=clock)
        probe.collect()
        clock.advance(1.0)
        probe.collect()  # a tree walk: the memos hold their schedstat descriptors
        real = probe._thread_rows

        def both(pid, rows, fds, tick):
            before = [m.obs for m in rows]
            out = real(pid, rows, fds, tick)
            after = [m.obs for m in rows]
            for m, o in zip(rows, before, strict=True):
                m.obs = o
            seen.append((out, [probe._thread_idle(m, fds, tick) for m in rows]))
            for m, o in zip(rows, after, strict=True):
                m.obs = o
            return out
        probe._thread_rows = both  # type: ignore[method-assign]
        for _ in range(threads_mod.STAT_EVERY_TICKS + 1):  # every thread's stat turn, once
            clock.advance(1.0)
            probe.collect()
    assert len(seen) == threads_mod.STAT_EVERY_TICKS + 1
    for out, ref in seen:
        assert len(out) == len(ref) == 10
        for a, b in zip(out, ref, strict=True):
            assert a is not b and a.__dict__ == b.__dict__
            assert a.model_fields_set == b.model_fields_set
            assert a.model_dump_json() == b.model_dump_json()
        assert out[0].state_since_s > 0 and out[0].cpu_delta_s == 0.0


def test_evolve_is_model_copy():
    t = ThreadObs(tid=1, comm="w", state="S", state_since_s=1.0, d_state_for_s=0.0,
                  ctx_unchanged_for_s=1.0, voluntary_ctxt_switches=3, nonvoluntary_ctxt_switches=1,
                  utime_s=0.5, stime_s=0.25, cpu_delta_s=None, wchan="futex_wait_queue",
                  syscall="futex", syscall_nr=202, syscall_args=(1, 2, 3, 4, 5, 6),
                  stack=("futex_wait_queue", "do_futex"), last_ran_age_s=2.0)
    update = {"state_since_s": 3.0, "cpu_delta_s": 0.0, "last_ran_age_s": 4.0}
    a, b = threads_mod._evolve(t, update), t.model_copy(update=update)
    assert a == b and a.model_dump_json() == b.model_dump_json()
    assert a.model_fields_set == b.model_fields_set and t.state_since_s == 1.0
    with pytest.raises(ValidationError):
        a.tid = 2  # still frozen


# A process that holds a unix socket pair, then (told on stdin) a TCP socket that it connects
# only when told again: between socket() and connect() a TCP socket is in no TCP table.
SOCKETS = r"""
import socket, sys
a, b = socket.socketpair()
print("unix", flush=True)
sys.stdin.readline()
s = socket.socket()
print("made", flush=True)
sys.stdin.readline()
s.connect(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
sys.stdin.readline()
"""


def test_a_process_with_only_unix_sockets_costs_no_tcp_table_read_and_a_late_connect_is_seen():
    """The TCP tables are the dearest read of an emulated /proc (2.8 ms each on the lent H200):
    a process whose sockets are all in net/unix skips them, and a TCP socket made before it was
    connected is still found once connected."""
    def tcp_reads() -> int:
        return sum(1 for p in CountingRoots.reads if p.endswith(("/net/tcp", "/net/tcp6")))

    with socket.create_server(("127.0.0.1", 0)) as server, \
            spawned([sys.executable, "-c", SOCKETS, str(server.getsockname()[1])],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        def step(expect: str) -> None:
            assert proc.stdout.readline().strip() == expect

        def go() -> None:
            proc.stdin.write("\n")
            proc.stdin.flush()

        step("unix")
        CountingRoots.reads = []
        probe = ProcessesProbe(Target(pids=(proc.pid,)), roots=CountingRoots())
        for _ in range(3):
            (p,) = [p for p in probe.collect().processes if p.pid == proc.pid]
            assert p.tcp == ()
        assert tcp_reads() == 0
        assert sum(1 for r in CountingRoots.reads if r.endswith("/net/unix")) == 1  # learnt once

        go()
        step("made")  # a TCP socket, in no table yet
        (p,) = [p for p in probe.collect().processes if p.pid == proc.pid]
        assert p.tcp == () and tcp_reads() == 2
        go()
        step("connected")
        conn, _ = server.accept()
        with conn:
            (p,) = [p for p in probe.collect().processes if p.pid == proc.pid]
        (s,) = p.tcp
        assert (s.remote_port, s.state) == (server.getsockname()[1], "ESTABLISHED")


def test_net_unix_is_read_once_a_tick_for_every_process_of_a_namespace() -> None:
    """Two processes holding a UDP socket (in neither net/unix nor a TCP table, so looked up
    every tick): the namespace's net/unix is read once per collect, not once per process."""
    udp = ("import socket, sys\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
           "print(1, flush=True)\nsys.stdin.readline()\n")
    with spawned([sys.executable, "-c", udp], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as a, \
            spawned([sys.executable, "-c", udp], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as b:
        a.stdout.readline(), b.stdout.readline()
        probe = ProcessesProbe(Target(pids=(a.pid, b.pid)), roots=CountingRoots())
        for n in range(1, 3):
            CountingRoots.reads = []
            probe.collect()
            assert sum(1 for r in CountingRoots.reads if r.endswith("/net/unix")) == 1, n


READ_THEN_SLEEP = r"""
import sys, time
sys.stdin.readline()  # blocked in read
print("sleeping", flush=True)
time.sleep(3600)  # blocked in clock_nanosleep
"""


def test_a_thread_that_ran_is_read_afresh_through_the_same_kept_descriptors(root):
    """A thread that ran between two collects has its wchan, syscall and stack read again: the
    second reading is new (read -> clock_nanosleep), yet comes through the descriptors the
    first kept open (one pread each), not through new opens. Root: the stack is root's to read."""
    with spawned([sys.executable, "-c", READ_THEN_SLEEP], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE) as proc:
        pid = proc.pid
        wait_until(lambda: task_state(pid) == "S", what="the job to block in read")
        probe = ProcessesProbe(Target(pids=(pid,)))
        wait_until(lambda: thread(probe, pid, pid).syscall == "read", what="read to be seen")
        before = {fd: f for fd, f in open_proc_files().items() if f"/task/{pid}/" in f}
        probe.collect()  # it slept since: its status is read as the process's
        assert f"/proc/{pid}/status" in open_proc_files().values()
        go(proc)
        assert proc.stdout.readline() == b"sleeping\n"
        seen = wait_until(lambda: (t := thread(probe, pid, pid)).syscall == "clock_nanosleep" and t,
                          what="clock_nanosleep to be seen")
        after = {fd: f for fd, f in open_proc_files().items() if f"/task/{pid}/" in f}
        # the process's status is its main thread's, read as that thread ran: not read again
        assert f"/proc/{pid}/status" not in open_proc_files().values()
        (process,) = probe.collect().processes
        assert process.uid == os.getuid() and process.rss_bytes
    names = {f.rsplit("/", 1)[1] for f in before.values()}
    assert {"wchan", "syscall", "stack", "sched"} <= names, before
    # its children list, read once it ran (the first look scans /proc), is kept as well
    assert "children" in {f.rsplit("/", 1)[1] for f in after.values()}, after
    assert {fd: f for fd, f in after.items() if fd in before} == before  # the same descriptors
    assert seen.wchan != "" and seen.stack and seen.state == "S"


@contextmanager
def _blocked_reader(tmp_path: Path):
    """A process blocked in read on its stdin, with a file open for writing, and a probe on it."""
    job = [sys.executable, "-c", "import sys; sys.stdin.readline()"]
    with open(tmp_path / "out.bin", "wb") as out, \
            spawned(job, stdin=subprocess.PIPE, stdout=out) as proc:
        wait_until(lambda: task_state(proc.pid) == "S", what="the job to block in read")
        yield proc, ProcessesProbe(Target(pids=(proc.pid,)), clock=FakeClock(monotonic=5))


def test_a_process_built_unvalidated_equals_its_validation(tmp_path):
    """ProcessObs and ThreadObs are built without validation (processes_obs.built): on a real
    process, with threads, open files (one written) and io, validating the same values gives an
    equal object with the same JSON, field order and types included."""
    with _blocked_reader(tmp_path) as (_, probe):
        probe.collect()
        (obs,) = probe.collect().processes
    assert any(f.write for f in obs.open_files) and obs.io is not None and obs.threads
    again = ProcessObs(**obs.__dict__)
    assert again == obs and again.model_dump_json() == obs.model_dump_json()
    assert list(again.__dict__) == list(obs.__dict__)
    assert obs.__pydantic_fields_set__ == set(ProcessObs.model_fields)
    for t in obs.threads:  # read afresh on first sight: built unvalidated too
        t_again = ThreadObs(**t.__dict__)
        assert t_again.model_dump_json() == t.model_dump_json() and t.syscall == "read"
        assert list(t_again.__dict__) == list(t.__dict__)
    assert isinstance(obs.state_since_s, float)  # an int clock still gives float durations


def test_processes_and_exits_built_unvalidated_equal_their_validation(tmp_path):
    """ProcessesObs, ExitObs, OpenFileObs and IoObs are built without validation as well: the
    same values validated give equal objects, with the same JSON, fields set and float types."""
    from stallwatch.probes.processes_obs import ExitObs, IoObs, OpenFileObs, ProcessesObs

    with _blocked_reader(tmp_path) as (proc, probe):
        alive = probe.collect()
        proc.kill()
        proc.wait()
        gone = probe.collect()
    (p,) = alive.processes
    assert p.open_files and p.io is not None and gone.exited
    for obs in (alive, gone, *p.open_files, p.io, *gone.exited):
        again = type(obs)(**obs.__dict__)
        assert again == obs and again.model_dump_json() == obs.model_dump_json()
        assert list(again.__dict__) == list(obs.__dict__)
        assert again.__pydantic_fields_set__ == obs.__pydantic_fields_set__
    assert {type(o) for o in (alive, p.io, p.open_files[0], gone.exited[0])} == {
        ProcessesObs, IoObs, OpenFileObs, ExitObs}
    (ex,) = gone.exited
    assert isinstance(ex.noticed_at, float) and isinstance(ex.exited_for_s, float)


def test_records_are_written_in_their_declared_order_so_built_keeps_the_dict(
        tmp_path, monkeypatch):
    """built() uses a dict written in the model's declared field order as it is, and reorders
    only another (procs7: the reordering, in Python, was a third of its cost). Every record a
    collect builds is written in that order, so none pays for it; each still gets a fields set
    of its own."""
    from stallwatch.probes import processes as processes_mod
    from stallwatch.probes.processes_obs import OpenFileObs, built

    in_order: list[tuple[str, bool]] = []

    def spy(cls, values, fields_set=None):
        if fields_set is None:
            in_order.append((cls.__name__, tuple(values) == tuple(cls.model_fields)))
        return built(cls, values, fields_set)

    monkeypatch.setattr(processes_mod, "built", spy)
    monkeypatch.setattr(threads_mod, "built", spy)
    with _blocked_reader(tmp_path) as (proc, probe):
        probe.collect()
        proc.kill()
        proc.wait()
        probe.collect()
    assert {name for name, _ in in_order} >= {
        "ProcessesObs", "ProcessObs", "ThreadObs", "IoObs", "OpenFileObs", "ExitObs"}
    assert [name for name, ok in in_order if not ok] == []
    ordered = {"fd": 3, "path": "/x", "write": True, "pos_bytes": 0}
    a, b = built(OpenFileObs, ordered), built(OpenFileObs, dict(reversed(ordered.items())))
    assert a.__dict__ is ordered and list(b.__dict__) == list(ordered) and a == b
    assert a.__pydantic_fields_set__ == set(ordered)
    assert a.__pydantic_fields_set__ is not b.__pydantic_fields_set__


def test_uptime_is_taken_from_the_boot_clock_on_the_host_and_reads_as_the_file():
    """On the host /proc/uptime is CLOCK_BOOTTIME in hundredths: the probe takes it from the
    clock instead of reading the file each tick (procs7), and it is what the file says, to the
    double, between two reads of it; a fixture tree's file is still read."""
    from stallwatch.probes.processes_state import _Tick
    from stallwatch.kernel import procfs

    def file_s() -> float:
        return procfs.parse_uptime_s(Path("/proc/uptime").read_text())

    probe = ProcessesProbe(Target(pids=(os.getpid(),)))
    before = file_s()
    got = probe._uptime(_Tick(now=0.0))
    after = file_s()
    assert probe._boottime_ok and before <= got <= after
    assert got == float(f"{got:.2f}")  # hundredths, as the file prints them


def test_a_thread_files_bytes_unchanged_since_the_last_tick_are_not_parsed_again(monkeypatch):
    """A thread that wakes every few ms to sleep again is read afresh every tick (it ran), and
    renders the same stack each time: that stack is parsed once, not once a tick, and what is
    reported is still the parse of this tick's bytes."""
    job = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.005)"]
    parses: list[str] = []
    real = threads_mod.procfs.parse_stack
    monkeypatch.setattr(threads_mod.procfs, "parse_stack",
                        lambda text: parses.append(text) or real(text))
    with spawned(job) as proc:
        wait_until(lambda: task_state(proc.pid) == "S", what="the job to sleep")
        probe = ProcessesProbe(Target(pids=(proc.pid,)))
        reads: list[tuple[int, bytes]] = []  # (collect number, the stack's bytes)
        kept_read = probe._kept.read_task_file

        def counting(path: str) -> bytes:
            data = kept_read(path)
            if path.endswith("/stack"):
                reads.append((n, data))
            return data

        probe._kept.read_task_file = counting
        seen = []
        sched = f"/proc/{proc.pid}/task/{proc.pid}/schedstat"
        for n in range(8):  # noqa: B007 - read by counting() through the closure
            (p,) = probe.collect().processes
            seen.append(p.threads[0].stack)
            before = Path(sched).read_text()  # then: it ran since (its schedstat moved)
            wait_until(lambda before=before: Path(sched).read_text() != before, what="the job to run")
    # a parse whenever the last tick did not read the same bytes, and only then
    expected, last = 0, {}
    for n, data in reads:
        expected += last.get(n - 1) != data
        last[n] = data
    assert len(reads) >= 4, reads
    assert len(parses) == expected < len(reads)
    n_last, data_last = reads[-1]
    assert n_last == 7 and seen[-1] == real(data_last.decode())
