"""Pure parsers for /proc files: text in, frozen records out. No file access here.

The probe reads through Roots and hands the text to these functions, so every parser is tested on
captured fixture files. Records are slotted frozen dataclasses rather than pydantic models: the
probe parses every /proc/*/stat every second, and these are intermediate values, not
observations (the probe turns them into its pydantic models). The three it parses every tick for
each thread that ran (Stat, Status, Io) are named tuples: as immutable, and built in a sixth of
a frozen dataclass's time, whose __init__ goes through object.__setattr__ once a field (a
third of parse_stat, procs7).

A malformed file raises ValueError: /proc formats are stable ABI, so a parse failure is a bug
or a wrong file, and the probe runner reports it instead of hiding it.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import platform
import sys
from dataclasses import dataclass
from collections.abc import Iterable, Mapping
from typing import NamedTuple


class Stat(NamedTuple):
    """The fields of /proc/PID/stat (and task/TID/stat) that stallwatch uses. Ticks are CLK_TCK."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    utime_ticks: int
    stime_ticks: int
    num_threads: int
    start_ticks: int  # since boot; with the pid, the identity of a process across pid reuse
    vsize_bytes: int
    rss_pages: int
    blkio_delay_ticks: int | None  # field 42: time spent waiting for block I/O (needs delayacct)
    exit_code: int | None  # field 52: raw wait status; 0 unless a zombie and we may ptrace it
    processor: int | None = None  # field 39: the CPU it last ran on (whose clock stamped it)


def parse_stat(text: str) -> Stat:
    # comm is free text chosen by the process (prctl, /proc/self/comm) and may contain spaces
    # and ')' itself; the kernel writes it between the first '(' and the LAST ')'.
    lpar, rpar = text.find("("), text.rfind(")")
    if lpar < 0 or rpar < lpar:
        raise ValueError(f"not a stat line: {text[:80]!r}")
    rest = text[rpar + 2:].split()
    if len(rest) < 22:
        raise ValueError(f"stat line too short ({len(rest)} fields after comm)")

    n = len(rest)  # field N of proc(5) is rest[N - 3]; 39, 42 and 52 came with later kernels
    return Stat(
        int(text[:lpar]), text[lpar + 1:rpar], rest[0], int(rest[1]), int(rest[2]),
        int(rest[3]), int(rest[11]), int(rest[12]), int(rest[17]), int(rest[19]),
        int(rest[20]), int(rest[21]),
        int(rest[39]) if n > 39 else None,  # 42: blkio_delay_ticks
        int(rest[49]) if n > 49 else None,  # 52: exit_code
        int(rest[36]) if n > 36 else None,  # 39: processor
    )


def parse_stat_ppid(data: bytes) -> int:
    """The ppid alone from a stat line's bytes: all a scan of the host's processes asks of
    each (is it a child of the job's tree?), without decoding or splitting the other 50
    fields. As parse_stat, the comm is skipped to its LAST ')'."""
    rpar = data.rfind(b")")
    fields = data[rpar + 2:].split(None, 2) if rpar >= 0 else []
    if len(fields) < 2 or data.find(b"(") < 0:
        raise ValueError(f"not a stat line: {data[:80]!r}")
    return int(fields[1])


def decode_wait_status(status: int) -> int:
    """A raw wait status as subprocess reports it: exit code, or minus the killing signal."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Status(NamedTuple):
    name: str
    tgid: int
    ppid: int
    uid: int  # real uid
    threads: int | None
    rss_bytes: int | None  # None for kernel threads and zombies, which have no memory map
    voluntary_ctxt_switches: int
    nonvoluntary_ctxt_switches: int


def parse_status(text: str) -> Status:
    """The fields stallwatch uses; a ValueError when one it needs is missing or malformed.

    The processes probe parses a thread's status every tick it ran (for its context switches):
    the kernel's layout (Name on the first line, one `Key:\tvalue` a line, each key once) is
    read by looking up the eight keys used, not by splitting all ~57 lines into a dict (a
    fifth of the objects, on a tick whose cost here is the memory it touches). Any other
    layout goes through the general parse below, as before."""
    if text.startswith("Name:"):
        fast = _status_fast(text)
        if fast is not None:
            return fast
    return _status_general(text)


# "\nKey:" for each key _status_fast looks up: built once, not per call.
_ST_TGID, _ST_PPID, _ST_UID, _ST_THREADS, _ST_RSS, _ST_VCTX, _ST_NVCTX = (
    f"\n{k}:" for k in ("Tgid", "PPid", "Uid", "Threads", "VmRSS", "voluntary_ctxt_switches",
                        "nonvoluntary_ctxt_switches"))


def _line_value(text: str, key: str, start: int, first: int) -> tuple[str | None, int]:
    """The rest of the line after `key` ("\nKey:"), and where that line ends; (None, start)
    when absent. Looked for from `start` (the end of the last key's line: the kernel prints them
    in _status_fast's order, so the text is scanned once, not once a key), then from `first`."""
    i = text.find(key, start)
    if i < 0:
        i = text.find(key, first)
        if i < 0:
            return None, start
    i += len(key)
    end = text.find("\n", i)
    return (text[i:end], end) if end >= 0 else (text[i:], len(text))


def _status_fast(text: str) -> Status | None:
    """parse_status for the kernel's layout; None for anything it does not recognise (then the
    general parse decides, with its errors). Keys are searched after the first line: the Name
    there is the task's to choose (the kernel escapes a newline in it, and this never looks
    inside it for a key)."""
    first = text.find("\n")
    if first < 0:
        return None
    tgid, at = _line_value(text, _ST_TGID, first, first)
    ppid, at = _line_value(text, _ST_PPID, at, first)
    uid, at = _line_value(text, _ST_UID, at, first)
    rss, at = _line_value(text, _ST_RSS, at, first)
    threads, at = _line_value(text, _ST_THREADS, at, first)
    vctx, at = _line_value(text, _ST_VCTX, at, first)
    nvctx, at = _line_value(text, _ST_NVCTX, at, first)
    if tgid is None or ppid is None or uid is None or vctx is None or nvctx is None:
        return None
    uid_words = uid.split()
    if not uid_words:
        return None
    rss_words = rss.split() if rss is not None else None
    try:
        return Status(
            text[5:first].strip(), int(tgid), int(ppid), int(uid_words[0]),
            int(threads) if threads is not None else None,
            int(rss_words[0]) * 1024 if rss_words else None, int(vctx), int(nvctx),
        )
    except ValueError:
        return None


def _status_general(text: str) -> Status:
    kv: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            kv[key] = value.strip()
    try:
        rss = kv.get("VmRSS")
        return Status(
            name=kv.get("Name", ""),
            tgid=int(kv["Tgid"]),
            ppid=int(kv["PPid"]),
            uid=int(kv["Uid"].split()[0]),
            threads=int(kv["Threads"]) if "Threads" in kv else None,
            rss_bytes=int(rss.split()[0]) * 1024 if rss else None,
            voluntary_ctxt_switches=int(kv["voluntary_ctxt_switches"]),
            nonvoluntary_ctxt_switches=int(kv["nonvoluntary_ctxt_switches"]),
        )
    except KeyError as e:
        raise ValueError(f"status lacks {e}") from None
    except IndexError:  # "Uid:" with nothing after it
        raise ValueError("status has an empty Uid line") from None


class Io(NamedTuple):
    rchar: int  # bytes through read-like syscalls, including page-cache hits and sockets
    wchar: int
    syscr: int
    syscw: int
    read_bytes: int  # bytes the storage layer fetched for this process
    write_bytes: int  # bytes it caused to be sent to storage (dirtied)
    cancelled_write_bytes: int

    @property
    def total(self) -> int:
        """One number that moves whenever the process does any I/O at all."""
        return self.rchar + self.wchar + self.read_bytes + self.write_bytes


_IO_KEYS = [f"{f}:" for f in ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes",
                               "cancelled_write_bytes")]


def parse_io(text: str) -> Io:
    # The kernel's layout, seven `key: value` lines in this order, in one split; anything else
    # (a fixture, another kernel) through the general parse below.
    words = text.split()
    if len(words) == 14 and words[0::2] == _IO_KEYS:
        try:
            return Io(*map(int, words[1::2]))
        except ValueError:
            pass
    kv = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            kv[key.strip()] = int(value)
    try:
        return Io(**{f: kv[f] for f in Io._fields})
    except KeyError as e:
        raise ValueError(f"io lacks {e}") from None


def _syscall_table() -> Mapping[int, str]:
    machine = platform.machine()
    if machine == "x86_64":
        from stallwatch.kernel.syscalls_x86_64 import SYSCALLS
    elif machine in ("aarch64", "arm64"):
        from stallwatch.kernel.syscalls_aarch64 import SYSCALLS
    else:
        SYSCALLS = {}
    return SYSCALLS


SYSCALLS: Mapping[int, str] = _syscall_table()


@dataclass(frozen=True, slots=True)
class Syscall:
    """/proc/PID/syscall: the syscall a blocked task sits in.

    `running` means the task was on a CPU (no stable answer); nr == -1 means blocked but not in a
    syscall (e.g. a page fault). args are the six raw register values.
    """

    running: bool
    nr: int | None
    name: str | None
    args: tuple[int, ...] = ()


def parse_syscall(text: str, table: Mapping[int, str] | None = None) -> Syscall:
    words = text.split()
    if not words:
        raise ValueError("empty syscall file")
    if words[0] == "running":
        return Syscall(running=True, nr=None, name=None)
    nr = int(words[0])
    if nr < 0:
        return Syscall(running=False, nr=nr, name=None)
    # nr, six args, then sp and pc.
    args = tuple(int(w, 16) for w in words[1:7])
    name = (SYSCALLS if table is None else table).get(nr)
    return Syscall(running=False, nr=nr, name=name, args=args)


def parse_wchan(text: str) -> str | None:
    """A symbol, or None: the kernel writes "0" (or nothing) for a task that is not waiting."""
    s = text.strip()
    return None if s in ("", "0") else s


def parse_stack(text: str) -> tuple[str, ...]:
    """Function names, innermost first: `[<0>] percpu_rwsem_wait+0x15f/0x1d0` -> percpu_rwsem_wait.

    The address in brackets is hidden (0) without kallsyms access, and module suffixes
    (` [ext4]`) are dropped so rules can match names regardless of how the code was built.
    """
    names = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[<"):
            line = line[line.find("]") + 1:].strip()
        name = line.split("+", 1)[0].split(" ", 1)[0]
        if name:
            names.append(name)
    return tuple(names)


def parse_cmdline(data: bytes) -> tuple[str, ...]:
    """argv from NUL-separated bytes; () for kernel threads and zombies.

    Trailing NULs are dropped as padding (setproctitle leaves them), at the price of losing
    genuinely empty trailing arguments.
    """
    data = data.rstrip(b"\0")
    return tuple(a.decode("utf-8", "replace") for a in data.split(b"\0")) if data else ()


def parse_btime(text: str) -> int:
    """Boot time in Unix seconds, from /proc/stat."""
    for line in text.splitlines():
        if line.startswith("btime "):
            parts = line.split()
            if len(parts) >= 2:  # "btime " alone (found by fuzzing): not a boot time
                return int(parts[1])
    raise ValueError("no btime in /proc/stat")


def parse_sched_exec_start_s(text: str) -> float | None:
    """`se.exec_start` from /proc/PID/sched: when the task last ran, in seconds of the scheduler
    clock (close to /proc/uptime). None when the kernel has no CONFIG_SCHED_DEBUG fields.

    This is history a one-shot diagnosis cannot otherwise see: a deadlocked thread that last ran
    three hours ago says so at once, without watching it for three hours.
    """
    return parse_sched_last_run(text)[0]


def parse_sched_last_run(text: str) -> tuple[float | None, int | None]:
    """(`se.exec_start` in seconds, `se.sum_exec_runtime` in ns) from /proc/PID/sched; None for a
    field the kernel does not print. sum_exec_runtime is schedstat's first field too (the same
    task->se.sum_exec_runtime, printed here in ms with 6 decimals by kernel/sched/debug.c's PN),
    so the two files say whether the task ran between their reads.

    The first line is "COMM (PID, #threads: N)", and the comm is the task's to choose (prctl
    PR_SET_NAME, 15 bytes, a newline included): a thread named "se.exec_start" made the line
    match and its " 1)" raise. Only the lines after the row of dashes that ends the header are
    read (or after the first line, should a kernel print no dashes): a comm is too short to
    make that row.
    """
    fast = _sched_fast(text)
    if fast is not None:
        return fast
    lines = text.splitlines()
    start = next((i + 1 for i, ln in enumerate(lines) if len(ln) >= 20 and not ln.strip("-")), 1)
    exec_start_s: float | None = None
    sum_ns: int | None = None
    for line in lines[start:]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "se.exec_start":
            exec_start_s = float(value) / 1000.0
        elif key == "se.sum_exec_runtime":
            ms, _, frac = value.strip().partition(".")
            sum_ns = int(ms) * 1_000_000 + int((frac + "000000")[:6])
    return exec_start_s, sum_ns


_DASHES = "\n" + "-" * 20
_SE_EXEC_START, _SE_SUM = "\nse.exec_start ", "\nse.sum_exec_runtime "


def _sched_fast(text: str) -> tuple[float | None, int | None] | None:
    """parse_sched_last_run for the kernel's layout (the header, a row of dashes on the second
    line, then `%-45s:%21Ld.%06ld` lines: kernel/sched/debug.c), looking up its two keys
    instead of splitting some 40 lines; read a thread that ran every tick. None for anything
    else (a comm with a newline in it, a fixture), which the general parse reads."""
    dash = text.find(_DASHES)
    if dash < 0 or dash != text.find("\n"):  # the row must be the second line
        return None
    end = text.find("\n", dash + 1)
    if end < 0 or text[dash + 1:end].strip("-"):
        return None
    out: list[float | int | None] = []
    for key in (_SE_EXEC_START, _SE_SUM):
        i = text.find(key, end)
        if i < 0:
            out.append(None)
            continue
        eol = text.find("\n", i + 1)
        name, sep, value = text[i + 1:eol if eol >= 0 else len(text)].partition(":")
        if not sep or name.rstrip() != key[1:-1]:
            return None
        try:
            if key is _SE_EXEC_START:
                out.append(float(value) / 1000.0)
            else:
                ms, _, frac = value.strip().partition(".")
                out.append(int(ms) * 1_000_000 + int((frac + "000000")[:6]))
        except ValueError:
            return None
    exec_start_s, sum_ns = out
    return (exec_start_s, sum_ns)  # type: ignore[return-value]


def parse_uptime_s(text: str) -> float:
    parts = text.split()
    if not parts:
        raise ValueError("empty uptime")
    return float(parts[0])


def parse_fdinfo(text: str) -> tuple[int | None, int | None]:
    """(pos, flags) from /proc/PID/fdinfo/FD; flags are octal open(2) flags."""
    pos, flags, _ = parse_fdinfo_ino(text)
    return pos, flags


def parse_fdinfo_ino(text: str) -> tuple[int | None, int | None, int | None]:
    """(pos, flags, ino) from /proc/PID/fdinfo/FD: ino (None where the kernel does not show it;
    6.18 does) names the file the fd stands for, so an fd opened again on another file shows.

    The kernel's layout (pos, flags, mnt_id, ino: seq_show in fs/proc/fd.c, then lines of the
    file's own) is read from one split; anything else line by line below."""
    words = text.split(None, 8)
    if len(words) >= 8 and words[0] == "pos:" and words[2] == "flags:" and words[6] == "ino:":
        try:
            return int(words[1]), int(words[3], 8), int(words[7])
        except ValueError:
            pass  # the general parse below says what is wrong
    pos = flags = ino = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "pos":
            pos = int(value)
        elif key == "flags":
            flags = int(value, 8)
        elif key == "ino":
            ino = int(value)
    return pos, flags, ino


def opened_for_write(flags: int) -> bool:
    return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


TCP_STATES = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
    6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
    12: "NEW_SYN_RECV",
}


@dataclass(frozen=True, slots=True)
class TcpSocket:
    local_addr: str
    local_port: int
    remote_addr: str
    remote_port: int
    state: str
    tx_queue_bytes: int  # sent, not yet acknowledged by the peer
    rx_queue_bytes: int  # received, not yet read by the process (LISTEN: accept backlog)
    uid: int
    inode: int


@functools.lru_cache(maxsize=4096)
def _addr(hexaddr: str, byteorder: str) -> str:
    # The kernel prints each 32-bit word of the address with %08X in host byte order. Cached:
    # a host's sockets have few distinct addresses, and ipaddress's rendering is dear.
    raw = bytes.fromhex(hexaddr)
    if byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def parse_net_tcp(text: str, byteorder: str = sys.byteorder) -> tuple[TcpSocket, ...]:
    """/proc/net/tcp or tcp6 (the same layout; tcp6 addresses are 32 hex digits)."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        out.append(_tcp_socket(f, line, byteorder))
    return tuple(out)


def net_tcp_lines(text: str) -> dict[int, str]:
    """inode -> its line, of /proc/net/tcp or tcp6: what parse_tcp_line turns into a TcpSocket,
    for the few sockets a caller asks about among a server host's thousands."""
    out = {}
    for line in text.splitlines()[1:]:
        f = line.split(None, 10)
        if len(f) >= 10 and f[9].isdigit():
            out[int(f[9])] = line
    return out


def parse_tcp_line(line: str, byteorder: str = sys.byteorder) -> TcpSocket:
    """One line of /proc/net/tcp or tcp6 (net_tcp_lines')."""
    return _tcp_socket(line.split(), line, byteorder)


def _tcp_socket(f: list[str], line: str, byteorder: str) -> TcpSocket:
    local, remote = f[1].split(":"), f[2].split(":")
    if len(local) != 2 or len(remote) != 2:
        raise ValueError(f"not an address:port pair in {line!r}")
    tx, rx = f[4].split(":")
    state = int(f[3], 16)
    return TcpSocket(
        local_addr=_addr(local[0], byteorder), local_port=int(local[1], 16),
        remote_addr=_addr(remote[0], byteorder), remote_port=int(remote[1], 16),
        state=TCP_STATES.get(state, f"0x{state:02X}"),
        tx_queue_bytes=int(tx, 16), rx_queue_bytes=int(rx, 16),
        uid=int(f[7]), inode=int(f[9]),
    )


def parse_net_unix_inodes(text: str) -> frozenset[int]:
    """The socket inodes of /proc/net/unix (`Num RefCount Protocol Flags Type St Inode Path`):
    the 7th field of every line after the header."""
    out = set()
    for line in text.splitlines()[1:]:
        f = line.split(None, 7)
        if len(f) >= 7 and f[6].isdigit():
            out.add(int(f[6]))
    return frozenset(out)


def socket_inode(link: str) -> int | None:
    """The inode of an fd readlink `socket:[12345]`, None for anything else."""
    if link.startswith("socket:[") and link.endswith("]"):
        return int(link[8:-1])
    return None


def socket_inodes(links: Mapping[int, str] | Iterable[tuple[int, str]]) -> dict[int, int]:
    """inode -> fd for every socket among fd readlinks (fd -> link target)."""
    items = links.items() if isinstance(links, Mapping) else links
    out: dict[int, int] = {}
    for fd, link in items:
        inode = socket_inode(link)
        if inode is not None:
            out.setdefault(inode, fd)
    return out


def parse_schedstat(text: str) -> tuple[int, int]:
    """(on-CPU ns, waiting-on-a-runqueue ns) from /proc/PID/task/TID/schedstat
    ("cpu_ns run_delay_ns timeslices", Documentation/scheduler/sched-stats.rst)."""
    parts = text.split()
    if len(parts) < 2:
        raise ValueError(f"schedstat: expected 3 numbers, got {text!r}")
    return int(parts[0]), int(parts[1])
