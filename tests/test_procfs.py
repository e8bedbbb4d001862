"""The /proc parsers on real files captured from a kernel (tests/fixtures/host1/proc, made by
tools/capture_fixtures.py), and the processes probe reading that captured root.

pids.json says which captured pid plays which part: a server whose comm has spaces and
parentheses, a client blocked in recvfrom on its connections to it, a writer in D on a frozen
ext4, and a zombie with its parent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stallwatch.kernel import procfs
from stallwatch.probes.processes import ProcessesProbe
from stallwatch.kernel.roots import Roots
from stallwatch.kernel.syscalls_aarch64 import SYSCALLS as AARCH64
from stallwatch.kernel.syscalls_x86_64 import SYSCALLS as X86_64
from stallwatch.probes.targets import Target

from rigs import HOST1

PROC = HOST1 / "proc"
PIDS: dict[str, int] = json.loads((HOST1 / "pids.json").read_text())


def text(role: str, name: str, tid: int | None = None) -> str:
    pid = PIDS[role]
    d = PROC / str(pid) if tid is None else PROC / str(pid) / "task" / str(tid)
    return (d / name).read_text()


# -------------------------------------------------------------------------------------- stat


def test_stat_comm_with_spaces_and_parentheses():
    st = procfs.parse_stat(text("server", "stat"))
    assert st.comm == "sw) srv (x"
    assert st.pid == PIDS["server"] and st.state == "S"
    assert st.num_threads == 1 and st.start_ticks > 0 and st.exit_code == 0


@pytest.mark.parametrize("comm", ["a) b", ") R 1 2 3 (", "x)", "((", "spa ce"])
def test_stat_splits_on_the_last_parenthesis(comm):
    line = procfs.parse_stat(text("server", "stat"))
    real = text("server", "stat").replace("(sw) srv (x)", f"({comm})")
    st = procfs.parse_stat(real)
    assert st.comm == comm and st.state == "S" and st.start_ticks == line.start_ticks


def test_stat_names_the_cpu_it_last_ran_on():
    raw = text("server", "stat")
    assert procfs.parse_stat(raw).processor == int(raw.rsplit(")", 1)[1].split()[39 - 3])
    assert procfs.parse_stat("1 (x) S" + " 0" * 30).processor is None  # an old kernel's short line


def test_stat_rejects_garbage():
    with pytest.raises(ValueError):
        procfs.parse_stat("12 no parentheses here")


def test_stat_of_a_zombie_carries_its_wait_status():
    st = procfs.parse_stat(text("zombie", "stat"))
    assert st.state == "Z" and st.ppid == PIDS["zombie_parent"]
    assert procfs.decode_wait_status(st.exit_code) == 3


def test_decode_wait_status_signal_is_negative():
    assert procfs.decode_wait_status(9) == -9  # killed by SIGKILL
    assert procfs.decode_wait_status(0x86) == -6  # SIGABRT with core dump flag
    assert procfs.decode_wait_status(1 << 8) == 1


# ---------------------------------------------------------------------------- status and io


def test_status():
    s = procfs.parse_status(text("client", "status"))
    assert s.tgid == PIDS["client"] and s.threads == 2 and s.uid == 0
    assert s.rss_bytes and s.rss_bytes % 1024 == 0
    assert s.voluntary_ctxt_switches > 0


def test_status_of_a_zombie_has_no_rss():
    s = procfs.parse_status(text("zombie", "status"))
    assert s.rss_bytes is None and s.ppid == PIDS["zombie_parent"]


def test_io():
    io = procfs.parse_io(text("client", "io"))
    assert io.rchar > 0 and io.total >= io.rchar


# --------------------------------------------------------------------- syscall, wchan, stack


def test_syscall_of_the_frozen_writer_is_openat():
    sc = procfs.parse_syscall(text("writer", "syscall"), X86_64)
    assert (sc.name, sc.nr, sc.running) == ("openat", 257, False)
    assert len(sc.args) == 6 and sc.args[0] == 0xFFFFFF9C  # AT_FDCWD as the kernel prints it


def test_syscall_of_the_client_names_its_socket_fd():
    links = {int(fd): os.readlink(PROC / str(PIDS["client"]) / "fd" / fd)
             for fd in os.listdir(PROC / str(PIDS["client"]) / "fd")}
    for tid in os.listdir(PROC / str(PIDS["client"]) / "task"):
        sc = procfs.parse_syscall(text("client", "syscall", int(tid)), X86_64)
        assert sc.name == "recvfrom"
        assert links[sc.args[0]].startswith("socket:[")


@pytest.mark.parametrize("line,expected", [
    ("running\n", procfs.Syscall(running=True, nr=None, name=None)),
    ("-1 0x7ffc0 0x7f00\n", procfs.Syscall(running=False, nr=-1, name=None)),
    ("202 0x1 0x80 0x0 0x0 0x0 0x0 0x7ff 0x7f\n",
     procfs.Syscall(running=False, nr=202, name="futex", args=(1, 0x80, 0, 0, 0, 0))),
    ("9999 0x1 0x2 0x3 0x4 0x5 0x6 0x7 0x8\n",
     procfs.Syscall(running=False, nr=9999, name=None, args=(1, 2, 3, 4, 5, 6))),
])
def test_syscall_forms(line, expected):
    assert procfs.parse_syscall(line, X86_64) == expected


def test_wchan():
    assert procfs.parse_wchan(text("writer", "wchan")) == "percpu_rwsem_wait"
    assert procfs.parse_wchan("0") is None and procfs.parse_wchan("") is None


def test_stack_of_the_frozen_writer():
    names = procfs.parse_stack(text("writer", "stack"))
    assert names[:2] == ("percpu_rwsem_wait", "mnt_want_write")
    assert "__x64_sys_openat" in names and all("+" not in n and "[" not in n for n in names)


def test_stack_other_spellings():
    raw = ("[<ffffffffc0a1b2c3>] nfs_wait_bit_killable+0x1f/0x90 [nfs]\n"
           "[<0>] __wait_on_bit+0x40/0x110\n\n")
    assert procfs.parse_stack(raw) == ("nfs_wait_bit_killable", "__wait_on_bit")
    assert procfs.parse_stack("") == ()


# ------------------------------------------------------------------------- cmdline and btime


def test_cmdline_keeps_exec_a_name():
    argv = procfs.parse_cmdline((PROC / str(PIDS["server"]) / "cmdline").read_bytes())
    assert argv[0] == "sw fixture server" and argv[1] == "-c" and "prctl" in argv[2]


def test_cmdline_empty_and_unterminated():
    assert procfs.parse_cmdline(b"") == ()
    assert procfs.parse_cmdline((PROC / str(PIDS["zombie"]) / "cmdline").read_bytes()) == ()
    # Trailing NULs are padding more often than empty arguments (setproctitle fills with them).
    assert procfs.parse_cmdline(b"python\0x.py\0\0\0") == ("python", "x.py")
    assert procfs.parse_cmdline(b"a\0\0b\0") == ("a", "", "b")
    assert procfs.parse_cmdline(b"retitled by setproctitle") == ("retitled by setproctitle",)


def test_btime():
    assert procfs.parse_btime((PROC / "stat").read_text()) > 1_600_000_000
    with pytest.raises(ValueError):
        procfs.parse_btime("cpu 1 2 3\n")


# -------------------------------------------------------------------------------- sockets


def listen_port(role: str, name: str) -> int:
    inodes = procfs.socket_inodes({int(fd): os.readlink(PROC / str(PIDS[role]) / "fd" / fd)
                                   for fd in os.listdir(PROC / str(PIDS[role]) / "fd")})
    socks = procfs.parse_net_tcp(text(role, f"net/{name}"))
    return next(s.local_port for s in socks if s.inode in inodes and s.state == "LISTEN")


def test_net_tcp_client_connection_to_the_server():
    v4 = listen_port("server", "tcp")
    client_fds = {int(fd): os.readlink(PROC / str(PIDS["client"]) / "fd" / fd)
                  for fd in os.listdir(PROC / str(PIDS["client"]) / "fd")}
    inodes = procfs.socket_inodes(client_fds)
    mine = [s for s in procfs.parse_net_tcp(text("client", "net/tcp")) if s.inode in inodes]
    assert len(mine) == 1
    s = mine[0]
    assert (s.remote_addr, s.remote_port, s.state) == ("127.0.0.1", v4, "ESTABLISHED")
    assert s.local_addr == "127.0.0.1" and s.local_port not in (0, v4)


def test_net_tcp6():
    v6 = listen_port("server", "tcp6")
    socks = procfs.parse_net_tcp(text("client", "net/tcp6"))
    listen = [s for s in socks if s.state == "LISTEN" and s.local_port == v6]
    assert listen and listen[0].local_addr == "::1"
    assert any(s.remote_port == v6 and s.state == "ESTABLISHED" for s in socks)


def test_net_tcp_lines_parse_as_the_whole_table():
    """The processes probe splits a table by inode and parses only its job's sockets' lines:
    each parses as parse_net_tcp does, for both tables of a real capture."""
    for name in ("tcp", "tcp6"):
        table = text("client", f"net/{name}")
        lines = procfs.net_tcp_lines(table)
        socks = [s for s in procfs.parse_net_tcp(table) if s.inode]
        assert socks and {s.inode for s in socks} <= lines.keys()
        assert all(procfs.parse_tcp_line(lines[s.inode]) == s for s in socks)


def test_net_tcp_address_byte_order():
    line = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
            "  timeout inode\n"
            "   0: 0100007F:0050 0201A8C0:D431 01 0000000A:00000014 00:00000000 00000000  1000"
            "        0 77 1\n")
    (s,) = procfs.parse_net_tcp(line, byteorder="little")
    assert (s.local_addr, s.local_port) == ("127.0.0.1", 80)
    assert (s.remote_addr, s.remote_port) == ("192.168.1.2", 54321)
    assert (s.tx_queue_bytes, s.rx_queue_bytes, s.uid, s.inode) == (10, 20, 1000, 77)
    (b,) = procfs.parse_net_tcp(line.replace("0100007F", "7F000001"), byteorder="big")
    assert b.local_addr == "127.0.0.1"


def test_socket_inodes():
    links = {0: "/dev/null", 3: "socket:[12345]", 4: "pipe:[9]", 7: "socket:[12345]",
             9: "socket:[1]"}
    assert procfs.socket_inodes(links) == {12345: 3, 1: 9}
    assert procfs.socket_inode("anon_inode:[eventfd]") is None


def test_fdinfo_flags():
    pos, flags = procfs.parse_fdinfo("pos:\t4096\nflags:\t0100001\nmnt_id:\t24\nino:\t3\n")
    assert pos == 4096 and procfs.opened_for_write(flags)
    assert not procfs.opened_for_write(procfs.parse_fdinfo("pos:\t0\nflags:\t0100000\n")[1])
    assert procfs.opened_for_write(os.O_RDWR | os.O_APPEND)


# -------------------------------------------------------------------------- syscall tables


def test_syscall_tables():
    assert (X86_64[0], X86_64[1], X86_64[202], X86_64[257], X86_64[45]) == (
        "read", "write", "futex", "openat", "recvfrom")
    assert (AARCH64[63], AARCH64[64], AARCH64[98], AARCH64[56], AARCH64[79]) == (
        "read", "write", "futex", "openat", "newfstatat")
    assert "open" not in AARCH64.values()  # the generic table has only the *at variants


def test_table_follows_the_machine():
    import platform
    expected = {"x86_64": X86_64, "aarch64": AARCH64}.get(platform.machine(), {})
    assert procfs.SYSCALLS is expected or expected == procfs.SYSCALLS


# ------------------------------------------------------ the probe on the captured tree


def probe_for(role: str) -> ProcessesProbe:
    return ProcessesProbe(Target(pids=(PIDS[role],)), roots=Roots.under(HOST1),
                          syscall_table=X86_64, self_pid=None, clk_tck=100)


def test_probe_reads_the_frozen_writer_from_fixtures():
    obs = probe_for("writer").collect()
    assert obs.targets == (PIDS["writer"],)
    (p,) = obs.processes
    assert (p.state, p.wchan, p.role, p.comm) == ("D", "percpu_rwsem_wait", "target", "sh")
    (t,) = p.threads
    assert t.syscall == "openat" and t.stack[:2] == ("percpu_rwsem_wait", "mnt_want_write")
    btime = procfs.parse_btime((PROC / "stat").read_text())
    assert p.start_time == pytest.approx(btime + p.start_ticks / 100)


def test_probe_shows_the_client_waiting_on_its_socket_to_the_server():
    (p,) = probe_for("client").collect().processes
    v4, v6 = listen_port("server", "tcp"), listen_port("server", "tcp6")
    by_fd = {s.fd: s for s in p.tcp}
    assert {s.remote_port for s in p.tcp} == {v4, v6}
    for t in p.threads:
        assert t.syscall == "recvfrom" and t.syscall_file.startswith("socket:[")
        assert by_fd[t.syscall_fd].state == "ESTABLISHED"
    assert {by_fd[t.syscall_fd].remote_addr for t in p.threads} == {"127.0.0.1", "::1"}


def test_probe_reads_the_zombie_and_its_parent():
    obs = probe_for("zombie_parent").collect()
    assert [p.pid for p in obs.processes] == [PIDS["zombie_parent"], PIDS["zombie"]]
    z = obs.processes[1]
    assert (z.role, z.state, z.exit_code, z.rss_bytes) == ("descendant", "Z", 3, None)
    assert obs.zombies == (PIDS["zombie"],)


def test_sched_exec_start_from_a_real_capture():
    text = (PROC / "self" / "sched").read_text()  # what `cat /proc/self/sched` printed
    v = procfs.parse_sched_exec_start_s(text)
    want = float(next(ln for ln in text.splitlines() if ln.startswith("se.exec_start")).split(":")[1])
    assert v == pytest.approx(want / 1000.0)
    assert procfs.parse_sched_exec_start_s("nr_switches : 3\n") is None
    assert procfs.parse_uptime_s("917.16 1513.45\n") == 917.16


def test_sched_last_run_reads_the_kernels_lines_not_the_comm():
    """The header is "COMM (PID, #threads: N)" with a comm the task chose: a comm shaped like
    a field (a newline in it too) is not read; sum_exec_runtime comes back in ns, exact, as
    schedstat's first field has it."""
    body = (f"{'-' * 67}\n{'se.exec_start':<45}:{'15050014.665672':>21}\n"
            f"{'se.sum_exec_runtime':<45}:{'1.013071':>21}\n")
    for comm in ("python3", "se.exec_start", "\nse.exec_start:", "se.exec_start:9"):
        text = f"{comm} (42, #threads: 1)\n{body}"
        assert procfs.parse_sched_last_run(text) == (pytest.approx(15050.014665672), 1013071)
    assert procfs.parse_sched_last_run("se.exec_start : 5\n") == (None, None)  # header only


def test_malformed_lines_found_by_fuzzing_are_value_errors():
    """Each of these raised IndexError, which no caller expects (the processes probe turns a
    ValueError into an unreadable field)."""
    import pytest as _pytest

    from stallwatch.kernel import procfs as _procfs

    with _pytest.raises(ValueError):
        _procfs.parse_btime("btime \n")
    with _pytest.raises(ValueError):
        _procfs.parse_status("Name:\tx\nTgid:\t1\nPPid:\t0\nUid:\nvoluntary_ctxt_switches:\t1\n"
                             "nonvoluntary_ctxt_switches:\t1\n")
    with _pytest.raises(ValueError):
        _procfs.parse_net_tcp("header\n 0: 0100007F 0100007F:1F90 0A 00000000:00000000 00:00000000 "
                              "00000000 0 0 12345\n")


def test_net_unix_inodes_name_a_live_socketpair_and_nothing_of_a_tcp_socket():
    import socket

    a, b = socket.socketpair()
    t = socket.socket()
    try:
        with open("/proc/self/net/unix") as f:
            text = f.read()
        found = procfs.parse_net_unix_inodes(text)
        assert {os.fstat(a.fileno()).st_ino, os.fstat(b.fileno()).st_ino} <= found
        assert os.fstat(t.fileno()).st_ino not in found
        assert procfs.parse_net_unix_inodes(text.splitlines()[0]) == frozenset()  # header only
    finally:
        a.close(), b.close(), t.close()


def _general_sched(text: str):
    """parse_sched_last_run with its fast path off: the general line-by-line parse."""
    fast = procfs._sched_fast
    procfs._sched_fast = lambda t: None
    try:
        return procfs.parse_sched_last_run(text)
    finally:
        procfs._sched_fast = fast


def test_status_sched_and_io_fast_paths_read_what_the_general_parse_reads():
    """status, sched and io are parsed by looking up the keys used (the kernel's layout) rather
    than splitting every line: on every live task of this process and its parent (a thread
    that sleeps, one that runs), and on the captured fixtures, the fast path gives exactly what
    the general parse gives, and it does take the fast path."""
    tasks = [f"/proc/{p}/task/{t}" for p in (os.getpid(), os.getppid())
             for t in os.listdir(f"/proc/{p}/task")]
    fixtures = [PROC / str(PIDS[r]) for r in ("server", "client", "zombie")]
    statuses, scheds = 0, 0
    for d in [*tasks, *fixtures]:
        try:
            status = Path(f"{d}/status").read_text()
        except OSError:
            continue
        assert procfs._status_fast(status) == procfs._status_general(status), d
        statuses += 1
        try:
            sched = Path(f"{d}/sched").read_text()
        except OSError:
            continue
        assert procfs._sched_fast(sched) is not None, sched[:200]
        assert procfs._sched_fast(sched) == _general_sched(sched), d
        scheds += 1
    assert statuses >= 3 and scheds >= 1
    for io_text in (Path(f"/proc/{os.getpid()}/io").read_text(), text("client", "io")):
        words = io_text.split()
        assert words[0::2] == procfs._IO_KEYS  # the fast path's layout
        assert procfs.parse_io(io_text) == procfs.Io(*map(int, words[1::2]))


def test_status_fast_path_takes_no_key_from_the_name_line():
    """The Name line is the task's to choose: a name shaped like a key is not read as one."""
    body = ("Umask:\t0022\nState:\tS (sleeping)\nTgid:\t42\nPPid:\t1\nUid:\t1000\t1000\t1000\t"
            "1000\nThreads:\t3\nVmRSS:\t  2048 kB\nvoluntary_ctxt_switches:\t5\n"
            "nonvoluntary_ctxt_switches:\t6\n")
    st = procfs.parse_status("Name:\tUid:\t0\n" + body)
    assert (st.name, st.uid, st.tgid, st.threads, st.rss_bytes) == ("Uid:\t0", 1000, 42, 3, 2 << 20)
    assert (st.voluntary_ctxt_switches, st.nonvoluntary_ctxt_switches) == (5, 6)
    empty_uid = "Name:\tx\n" + body.replace("Uid:\t1000\t1000\t1000\t1000", "Uid:")
    assert procfs._status_fast(empty_uid) is None
    with pytest.raises(ValueError):  # what the general parse decides, as before
        procfs.parse_status(empty_uid)


def test_sched_fast_path_leaves_an_odd_header_to_the_general_parse():
    """A comm with a newline in it moves the row of dashes off the second line: the fast path
    declines, and the general parse (which skips the comm) reads it."""
    body = (f"{'-' * 67}\n{'se.exec_start':<45}:{'15050014.665672':>21}\n"
            f"{'se.sum_exec_runtime':<45}:{'1.013071':>21}\n")
    normal = f"python3 (42, #threads: 1)\n{body}"
    assert procfs._sched_fast(normal) == (pytest.approx(15050.014665672), 1013071)
    odd = f"a\nse.exec_start:9 (42, #threads: 1)\n{body}"
    assert procfs._sched_fast(odd) is None
    assert procfs.parse_sched_last_run(odd) == (pytest.approx(15050.014665672), 1013071)


def test_stat_ppid_alone_is_what_the_full_parse_says():
    """parse_stat_ppid (the host scan's slices ask nothing else) reads the ppid past the LAST
    ')' like parse_stat, on the captured comm with spaces and parentheses and on live lines."""
    lines = [text(r, "stat").encode() for r in ("server", "client", "zombie")]
    for pid in [p for p in os.listdir("/proc") if p.isdigit()][:40]:
        try:
            lines.append(Path(f"/proc/{pid}/stat").read_bytes())
        except OSError:
            pass
    for data in lines:
        assert procfs.parse_stat_ppid(data) == procfs.parse_stat(data.decode()).ppid, data
    for bad in (b"", b"12 (x", b"12 (x) S", b"12 x) S 1"):
        with pytest.raises(ValueError):
            procfs.parse_stat_ppid(bad)
