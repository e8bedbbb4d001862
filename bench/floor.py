#!/usr/bin/env python3
"""The raw floor: a minimal loop that reads what one stallwatch tick reads, and nothing else.

    python bench/floor.py --pid PID --log LOG --outputs DIR [--interval 1] [--duration S]

Per tick, like stallwatch's probes (no GPU here, no server): the job's descendants (the kernel's
per-thread `children` lists of the threads that ran; every 10 s a listing of /proc with its
entries' inodes, and the stat of each process new since the last listing), and for each process
of the job's tree its task list, each thread's schedstat and stat (kept open, re-read with
pread), and for a thread that ran or changed state its status (and wchan, syscall, stack, sched
when it is off-CPU) — what stallwatch reads since issue 17 — the process's status, io, fdinfo of
its regular files, its fd table and cwd (listed, each fd's readlink) when the count of open fds
moved, when its threads stopped running, or one tick in 8, the TCP socket tables
when it holds a socket that net/unix does not name (not /proc/uptime: stallwatch takes it
from CLOCK_BOOTTIME on the host, which that file shows); the log's new bytes (open,
fstat, pread from the remembered offset, close);
/dev/kmsg's new records; mountinfo (kept open, re-read when poll() reports a mount change),
diskstats, the sysfs entries of the watched paths' block devices (every 60 s), statvfs of each
watched path and /dev/shm (and its listing when its mtime moved); the outputs directory's
inotify events, drained with one read(2) per tick (no thread). Only the parsing needed to walk
the tree (ppid) and to follow the files is done: no models, no rules, no database.

With --nvml it also makes the NVML calls stallwatch's gpu probe makes per tick, for every
device: utilisation, memory (v2), compute and graphics processes, persistence mode, clock event
reasons, the four ECC counters, temperature, power, P-state, a 0 ms wait on the Xid event set;
and every 10 s the per-process utilisation samples and the PCIe throughput. Results are not looked at.

Standard library only (plus pynvml, the official bindings, with --nvml); it must not import
stallwatch.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import select
import struct
import sys
import time

# inotify through libc: the cheapest possible watch (no thread, drained on the tick)
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_ISDIR, IN_Q_OVERFLOW = 0x40000000, 0x4000
MASK = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_EV = struct.Struct("iIII")


class Inotify:
    def __init__(self, root: str) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.wd: dict[int, str] = {}
        self.events = 0
        for d, _, _ in os.walk(root):
            self.watch(d)

    def watch(self, path: str) -> None:
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(path), MASK)
        if wd >= 0:
            self.wd[wd] = path

    def drain(self) -> list[str]:
        out: list[str] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                wd, mask, _cookie, n = _EV.unpack_from(buf, i)
                name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode("utf-8", "replace")
                i += 16 + n
                self.events += 1
                parent = self.wd.get(wd)
                if parent is None:
                    continue
                path = f"{parent}/{name}"
                if mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                    self.watch(path)
                out.append(path)


def read(path: str, limit: int = 1 << 20) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks, size = [], 0
        while size < limit:
            b = os.read(fd, limit - size)
            if not b:
                break
            chunks.append(b)
            size += len(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


class NvmlFloor:
    """The raw NVML reads of one gpu-probe tick, through pynvml, without the choke point."""

    SLOW_S = 10.0

    def __init__(self) -> None:
        import pynvml as n

        self.n = n
        n.nvmlInit()
        self.handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
        self.events = n.nvmlEventSetCreate()
        for h in self.handles:
            try:
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, self.events)
            except n.NVMLError:
                pass
        self.next_slow = 0.0
        self.last_us = 0

    def _try(self, fn, *args):  # the floor keeps no results
        try:
            return fn(*args)
        except self.n.NVMLError:
            return None

    def tick(self) -> None:
        n = self.n
        for h in self.handles:
            self._try(n.nvmlDeviceGetUtilizationRates, h)
            self._try(n.nvmlDeviceGetMemoryInfo, h, n.nvmlMemory_v2)
            self._try(n.nvmlDeviceGetComputeRunningProcesses, h)
            self._try(n.nvmlDeviceGetGraphicsRunningProcesses, h)
            self._try(n.nvmlDeviceGetPersistenceMode, h)
            self._try(n.nvmlDeviceGetCurrentClocksEventReasons, h)
            for counter in (n.NVML_VOLATILE_ECC, n.NVML_AGGREGATE_ECC):
                for etype in (n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_MEMORY_ERROR_TYPE_CORRECTED):
                    self._try(n.nvmlDeviceGetTotalEccErrors, h, etype, counter)
            self._try(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)
            self._try(n.nvmlDeviceGetPowerUsage, h)
            self._try(n.nvmlDeviceGetPerformanceState, h)
        self._try(n.nvmlEventSetWait_v2, self.events, 0)
        now = time.monotonic()
        if now >= self.next_slow:
            self.next_slow = now + self.SLOW_S
            for h in self.handles:
                self._try(n.nvmlDeviceGetProcessUtilization, h, self.last_us)
                self._try(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_TX_BYTES)
                self._try(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_RX_BYTES)
            self.last_us = int(time.time() * 1e6)


class Floor:
    def __init__(self, pid: int, log: str | None, outputs: str | None, paths: list[str],
                 nvml: bool = False) -> None:
        self.pid = pid
        self.nvml = NvmlFloor() if nvml else None
        self.log, self.offset, self.ident = log, 0, None
        self.outputs = Inotify(outputs) if outputs and os.path.isdir(outputs) else None
        self.paths = paths
        self.cmdlines: dict[tuple[int, bytes], bytes] = {}
        self.kmsg = None
        try:
            self.kmsg = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self.kmsg, 0, os.SEEK_END)
        except OSError:
            self.kmsg = None
        self.bytes_read = 0
        # What the disks probe keeps between ticks (issue 17): mountinfo open and re-read when
        # poll() says a mount changed; each mount's sysfs device entries for 60 s; /dev/shm's
        # listing while its mtime stays (and it holds no sgl_shm segment).
        self.mi_fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        self.mi_poll = select.poll()
        self.mi_poll.register(self.mi_fd, select.POLLPRI | select.POLLERR)
        self.mi: bytes | None = None
        self.devs_at: dict[str, float] = {}
        self.shm_seen: tuple[int, int] | None = None
        self.full_scan_at = -1e18
        self.known: set[tuple[str, int]] = set()  # (pid, inode) of /proc's last listing
        self.kept: dict[str, int] = {}  # path -> descriptor re-read with pread
        # (pid, start) -> (fd count, read while its threads ran, fd -> link, cwd)
        self.tables: dict[tuple[int, bytes], tuple[int, bool, dict[str, str], str | None]] = {}
        self.ticks = 0
        self.kept_read: set[str] = set()
        self.last: dict[str, tuple[bytes | None, bytes]] = {}  # thread dir -> (schedstat, state)
        self.kids: dict[str, tuple[bytes | None, list[int]]] = {}
        self.unix: dict[str, set[int]] = {}  # ns -> unix socket inodes (the probe skips their TCP tables)
        self.tcp: dict[str, set[int]] = {}  # ns -> inodes once found in a TCP table

    def pread(self, path: str) -> bytes | None:
        fd = self.kept.get(path)
        if fd is None:
            try:
                fd = self.kept[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            data = os.pread(fd, 16384, 0)
        except OSError:
            os.close(self.kept.pop(path))
            return None
        self.kept_read.add(path)
        return data

    def sweep(self) -> None:
        for path in [p for p in self.kept if p not in self.kept_read]:
            os.close(self.kept.pop(path))
        self.kept_read = set()

    # -- processes
    FULL_SCAN_EVERY_S = 10.0  # as stallwatch's processes probe

    def tick_processes(self) -> set[str]:
        children: dict[int, list[int]] = {}
        starts: dict[int, bytes] = {}
        sched_now: dict[str, bytes | None] = {}
        now = time.monotonic()
        if now - self.full_scan_at >= self.FULL_SCAN_EVERY_S:
            # the probe's net under the children lists: /proc listed with its entries' inodes
            # every 10 s, and the stat (ppid) read of each process the last listing did not hold
            self.full_scan_at = now
            with os.scandir("/proc") as entries:
                listing = {(e.name, e.inode()) for e in entries if e.name.isdigit()}
            for name, _ in listing - self.known:
                read(f"/proc/{name}/stat")
            self.known = listing
        # the kernel's children lists of the tree's threads
        todo = [self.pid]
        while todo:
            p = todo.pop()
            if p in starts:
                continue
            b = read(f"/proc/{p}/stat")
            if not b:
                continue
            starts[p] = b[b.rfind(b")") + 2:].split()[19]
            for t in listdir(f"/proc/{p}/task"):
                td = f"/proc/{p}/task/{t}"
                ss = sched_now[td] = self.pread(f"{td}/schedstat")
                hit = self.kids.get(td)
                if hit is not None and ss is not None and hit[0] == ss:
                    kids = hit[1]
                else:
                    kids = [int(k) for k in (read(f"{td}/children") or b"").split()]
                    self.kids[td] = (ss, kids)
                children.setdefault(p, []).extend(kids)
                todo += kids
        tree, todo = [], [self.pid]
        while todo:
            p = todo.pop(0)
            if p in tree or p not in starts:
                continue
            tree.append(p)
            todo += children.get(p, [])
        write_dirs: set[str] = set()
        tables, self.tables = self.tables, {}  # those of the tree's processes only
        for p in tree:
            d = f"/proc/{p}"
            tids = listdir(f"{d}/task")
            ran = False
            for t in tids[:512]:
                td = f"{d}/task/{t}"
                ss = sched_now[td] if td in sched_now else self.pread(f"{td}/schedstat")
                st = self.pread(f"{td}/stat")
                if st is None:
                    continue
                state = st[st.rfind(b")") + 2:st.rfind(b")") + 3]
                before, self.last[td] = self.last.get(td), (ss, state)
                if ss is not None and before == (ss, state) and state not in (b"R", b"Z", b"X"):
                    continue  # did not run since the last tick: nothing else can have changed
                ran = True
                read(f"{td}/status")
                if state not in (b"R", b"Z", b"X"):
                    read(f"{td}/wchan")
                    read(f"{td}/syscall")
                    read(f"{td}/stack")
                    read(f"{td}/sched")
            read(f"{d}/status")
            read(f"{d}/io")
            key = (p, starts[p])
            # The fd table and cwd as the probe reads them (issue 17): listed again when the
            # count of open fds moves, on the table's turn (one tick in 8), and on the first
            # tick none of its threads ran after one that some did; else kept.
            try:
                count = os.stat(f"{d}/fd").st_size
            except OSError:
                count = -1
            kept_table = tables.get(key)
            if (kept_table is None or kept_table[0] != count or (p + self.ticks) % 8 == 0
                    or (kept_table[1] and not ran)):
                fds = {}
                for fd in listdir(f"{d}/fd")[:1024]:
                    link = readlink(f"{d}/fd/{fd}")
                    if link is not None:
                        fds[fd] = link
                cwd = readlink(f"{d}/cwd")
                stale = False
            else:
                _, stale, fds, cwd = kept_table
                stale = stale or ran
            self.tables[key] = (count, stale, fds, cwd)
            if cwd:
                write_dirs.add(cwd)
            if key not in self.cmdlines:
                self.cmdlines[key] = read(f"{d}/cmdline") or b""
            socks = {int(v[8:-1]) for v in fds.values() if v.startswith("socket:[")}
            if socks:
                ns = readlink(f"{d}/ns/net") or d
                unix = self.unix.setdefault(ns, set())
                tcp = self.tcp.setdefault(ns, set())
                if not socks <= unix | tcp:  # as the probe: net/unix names the unix sockets once
                    text = read(f"{d}/net/unix", 64 << 20) or b""
                    unix |= socks & {int(f[6]) for f in (ln.split() for ln in text.splitlines()[1:])
                                     if len(f) >= 7 and f[6].isdigit()}
                if not socks <= unix:
                    found = set()
                    for name in ("tcp", "tcp6"):
                        for ln in (read(f"{d}/net/{name}", 64 << 20) or b"").splitlines()[1:]:
                            f = ln.split()
                            if len(f) >= 10 and f[9].isdigit():
                                found.add(int(f[9]))
                    tcp |= socks & found
            n = 0
            for fd, link in fds.items():
                if link.startswith("/") and not link.startswith("/dev/") and n < 64:
                    n += 1
                    info = read(f"{d}/fdinfo/{fd}")
                    if info and b"flags:" in info:
                        flags = int(info.split(b"flags:")[1].split()[0], 8)
                        if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
                            write_dirs.add(os.path.dirname(link))
        return write_dirs

    # -- the log's new bytes
    def tick_log(self) -> None:
        if not self.log:
            return
        try:
            fd = os.open(self.log, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            if ident != self.ident or st.st_size < self.offset:
                self.ident = ident
                self.offset = max(0, st.st_size - (1 << 20)) if self.bytes_read == 0 else 0
            budget = 8 << 20
            while budget > 0 and self.offset < st.st_size:
                data = os.pread(fd, min(1 << 20, budget), self.offset)
                if not data:
                    break
                self.offset += len(data)
                budget -= len(data)
                self.bytes_read += len(data)
                data.rfind(b"\r")  # where the newest bar starts: the least parsing there is
        finally:
            os.close(fd)

    # -- kernel log
    def tick_kmsg(self) -> None:
        if self.kmsg is None:
            return
        while True:
            try:
                if not os.read(self.kmsg, 16384):
                    return
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue
                return

    # -- disks
    def tick_disks(self, extra: set[str]) -> None:
        if self.mi is None or self.mi_poll.poll(0):
            self.mi = b""
            while chunk := os.pread(self.mi_fd, 1 << 20, len(self.mi)):
                self.mi += chunk
        mi = self.mi
        read("/proc/diskstats", 16 << 20)
        paths = list(dict.fromkeys(self.paths + sorted(extra)))[:16]
        devs: set[str] = set()
        mounts = [ln.split(b" - ")[0].split() for ln in mi.splitlines()]
        for p in paths:
            try:
                os.statvfs(p)
            except OSError:
                pass
            real = os.path.realpath(p).encode()
            best = max((m for m in mounts
                        if len(m) > 4 and (real == m[4] or real.startswith(m[4].rstrip(b"/") + b"/"))),
                       key=lambda m: len(m[4]), default=None)
            if best is not None:
                devs.add(best[2].decode())
        now = time.monotonic()
        for mm in devs:
            if now - self.devs_at.get(mm, -1e18) < 60.0:
                continue
            self.devs_at[mm] = now
            link = readlink(f"/sys/dev/block/{mm}")
            if link and not mm.startswith("0:"):
                dev_dir = os.path.normpath(os.path.join("/sys/dev/block", link))
                read(f"{dev_dir}/partition", 8192)
                read(f"{os.path.dirname(dev_dir)}/loop/backing_file", 8192)
                read(f"{dev_dir}/dm/name", 8192)
                listdir(f"{dev_dir}/slaves")
        try:
            os.statvfs("/dev/shm")
            st = os.stat("/dev/shm")
            seen = (st.st_ino, st.st_mtime_ns)
            if seen != self.shm_seen or time.time_ns() - st.st_mtime_ns < 1_000_000_000:
                sgl = 0
                with os.scandir("/dev/shm") as it:
                    for e in it:
                        sgl += e.name.startswith("sgl_shm")
                self.shm_seen = seen if not sgl else None
        except OSError:
            pass

    def tick(self) -> None:
        self.ticks += 1
        extra = self.tick_processes()
        self.sweep()
        self.last = {k: v for k, v in self.last.items() if f"{k}/stat" in self.kept}
        self.kids = {k: v for k, v in self.kids.items() if k in self.last}
        self.tick_log()
        if self.outputs is not None:
            for path in self.outputs.drain():
                try:
                    os.lstat(path)
                except OSError:
                    pass
        self.tick_kmsg()
        self.tick_disks(extra)
        if self.nvml is not None:
            self.nvml.tick()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--log")
    ap.add_argument("--outputs")
    ap.add_argument("--path", action="append", default=[], help="another watched path (statvfs)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=0.0, help="0: until SIGTERM")
    ap.add_argument("--ticks-file", help="write the tick count here at exit")
    ap.add_argument("--nvml", action="store_true", help="also the gpu probe's NVML reads")
    a = ap.parse_args(argv)
    paths = [p for p in [os.path.dirname(a.log) if a.log else None, a.outputs, *a.path] if p]
    fl = Floor(a.pid, a.log, a.outputs, paths, nvml=a.nvml)
    import signal

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    nxt = time.monotonic()
    end = nxt + a.duration if a.duration else float("inf")
    ticks = 0
    while not stop and time.monotonic() < end:
        fl.tick()
        ticks += 1
        nxt += a.interval
        delay = nxt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            nxt = time.monotonic()
    if a.ticks_file:
        with open(a.ticks_file, "w") as f:
            f.write(f"{ticks}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
