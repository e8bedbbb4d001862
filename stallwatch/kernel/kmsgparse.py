"""Kernel log records (/dev/kmsg format) and the few message shapes a stalled job cares about.

The kernel already saw most of what kills a GPU job: the OOM killer, the hung-task detector,
NVIDIA's Xid reports, block and filesystem errors, segfaults. These parsers turn those lines into
flat, frozen events (one model with optional fields, easy to write to JSONL and to match in rules).
Message formats are from the kernel's own printk calls (mm/oom_kill.c, kernel/hung_task.c,
block/blk-core.c, fs/buffer.c, fs/ext4/super.c, arch/x86/mm/fault.c) and the NVIDIA driver.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from stallwatch.model import Frozen

MESSAGE_MAX_CHARS = 1024  # a record is at most ~1 KiB anyway; bound what a trace line carries


class KmsgRecord(Frozen):
    """One `prio,seq,usec,flags;message` record; continuation lines (` KEY=value`) dropped."""

    seq: int
    usec: int  # since boot, CLOCK_MONOTONIC-like (stops during suspend)
    level: int  # 0 emerg .. 7 debug
    facility: int  # 0 kernel, 3 daemon ...; userspace writes to /dev/kmsg too
    message: str


def parse_record(raw: str) -> KmsgRecord | None:
    """Parse one record as read(2) from /dev/kmsg returns it, or one line of a text dump."""
    head, sep, rest = raw.partition(";")
    if not sep:
        return None
    fields = head.split(",")
    try:
        prio, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except (ValueError, IndexError):
        return None
    message = rest.split("\n", 1)[0].rstrip("\r")
    return KmsgRecord(seq=seq, usec=usec, level=prio & 7, facility=prio >> 3,
                      message=message[:MESSAGE_MAX_CHARS])


class EventKind(StrEnum):
    oom_kill = "oom_kill"
    hung_task = "hung_task"
    gpu_xid = "gpu_xid"
    block_io_error = "block_io_error"
    fs_error = "fs_error"
    segfault = "segfault"


class KernelEvent(Frozen):
    kind: EventKind
    seq: int
    kernel_usec: int
    wall_time: float | None = None  # boot wall time + usec; about a second of error (btime)
    level: int = 6
    message: str
    pid: int | None = None
    comm: str | None = None
    # oom_kill
    constraint: str | None = None  # CONSTRAINT_NONE (whole machine), CONSTRAINT_MEMCG (cgroup) ...
    oom_memcg: str | None = None
    task_memcg: str | None = None
    total_vm_kb: int | None = None
    anon_rss_kb: int | None = None
    file_rss_kb: int | None = None
    shmem_rss_kb: int | None = None
    oom_score_adj: int | None = None
    # hung_task
    blocked_for_s: int | None = None
    # gpu_xid
    xid: int | None = None  # None for NVRM errors printed without an Xid code
    pci: str | None = None  # 0000:3b:00
    # block_io_error, fs_error
    device: str | None = None
    sector: int | None = None
    op: str | None = None  # READ, WRITE, FLUSH, DISCARD
    # segfault
    fault_addr: str | None = None
    object: str | None = None  # the library it crashed in


_KILLED = re.compile(r"(?:(?P<scope>Memory cgroup out of memory|Out of memory)[^:]*: )?"
                     r"Killed process (?P<pid>\d+) \((?P<comm>.*?)\)(?P<rest>(?:[ ,].*)?)$")
_KB = {f: re.compile(rf"\b{k}:(-?\d+)kB") for f, k in (
    ("total_vm_kb", "total-vm"), ("anon_rss_kb", "anon-rss"),
    ("file_rss_kb", "file-rss"), ("shmem_rss_kb", "shmem-rss"))}
_SCORE_ADJ = re.compile(r"\boom_score_adj:(-?\d+)")
_OOM_SUMMARY = re.compile(r"^oom-kill:(?P<kv>.*)$")
_OOM_KV = re.compile(r"(constraint|oom_memcg|task_memcg|task|pid)=(.*?)(?=,(?:nodemask|cpuset|mems_allowed|"
                     r"oom_memcg|task_memcg|task|pid|uid)=|$)")
_HUNG = re.compile(r"INFO: task (?P<comm>.+):(?P<pid>\d+) blocked for more than (?P<secs>\d+) seconds")
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[^)]*)\): (?P<xid>\d+),\s*"
                  r"(?:pid=(?P<pid>'?[^,]*?'?), name=(?P<name>[^,]*?), )?(?P<text>.*)$")
_NVRM_BUS = re.compile(r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>[0-9a-fA-F:.]+): GPU has fallen off the bus")
_BLK = re.compile(r"error, dev (?P<dev>[^,\s]+), sector (?P<sector>\d+)"
                  r"(?: op 0x[0-9a-fA-F]+:\((?P<op>\w+)\))?")
_FS = [
    re.compile(r"^(?:EXT[234]-fs|BTRFS) (?:error|critical) \(device (?P<dev>[^)]+)\)"),
    re.compile(r"^EXT[234]-fs \((?P<dev>[^)]+)\): (?:Remounting filesystem read-only|I/O error|"
               r"previous I/O error|failed to convert unwritten extents|Delayed block allocation failed)"),
    re.compile(r"^Buffer I/O error on dev(?:ice)? (?P<dev>[^,\s]+)"),
    re.compile(r"^Aborting journal on device (?P<dev>\S+?)\.?$"),
    re.compile(r"^XFS \((?P<dev>[^)]+)\): .*(?:I/O error|Corruption|shut down|shutdown)"),
    re.compile(r"^nfs: server (?P<dev>\S+) not responding"),
]
_SEGV = re.compile(r"^(?:traps: )?(?P<comm>.+?)\[(?P<pid>\d+)\]:? "
                   r"(?:segfault at (?P<addr>[0-9a-fA-F]+)|general protection fault|trap [a-z ]+?)(?= |$)"
                   r"(?:.* in (?P<obj>[^\[\s]+)\[)?")


def parse_event(rec: KmsgRecord, boot_wall_time: float | None = None) -> KernelEvent | None:
    """One record -> an event, or None when it is not one of the kinds we watch.

    The `oom-kill:` summary line is returned as an oom_kill event too; KernelEventParser merges it
    with the `Killed process` line that follows it, so one kill is counted once.
    """
    msg = rec.message
    base: dict[str, Any] = dict(seq=rec.seq, kernel_usec=rec.usec, level=rec.level, message=msg,
                wall_time=boot_wall_time + rec.usec / 1e6 if boot_wall_time is not None else None)
    if rec.facility != 0:
        return None  # userspace can write anything to /dev/kmsg; only the kernel's lines count
    if m := _KILLED.search(msg):
        rest = m.group("rest")
        kb: dict[str, Any] = {f: int(x.group(1)) for f, rx in _KB.items() if (x := rx.search(rest))}
        adj = _SCORE_ADJ.search(rest)
        memcg = (m.group("scope") or "").startswith("Memory cgroup")
        return KernelEvent(kind=EventKind.oom_kill, pid=int(m.group("pid")), comm=m.group("comm"),
                           constraint="CONSTRAINT_MEMCG" if memcg else None,
                           oom_score_adj=int(adj.group(1)) if adj else None, **kb, **base)
    if m := _OOM_SUMMARY.match(msg):
        kv = dict(_OOM_KV.findall(m.group("kv")))
        pid = kv.get("pid", "")
        return KernelEvent(kind=EventKind.oom_kill, pid=int(pid) if pid.isdigit() else None,
                           comm=kv.get("task"), constraint=kv.get("constraint"),
                           oom_memcg=kv.get("oom_memcg"), task_memcg=kv.get("task_memcg"), **base)
    if m := _HUNG.search(msg):
        return KernelEvent(kind=EventKind.hung_task, pid=int(m.group("pid")), comm=m.group("comm"),
                           blocked_for_s=int(m.group("secs")), **base)
    if m := _XID.search(msg):
        pid = (m.group("pid") or "").strip("'")
        return KernelEvent(kind=EventKind.gpu_xid, xid=int(m.group("xid")), pci=m.group("pci"),
                           pid=int(pid) if pid.isdigit() else None,
                           comm=(m.group("name") or None) if m.group("name") != "<unknown>" else None,
                           **base)
    if m := _NVRM_BUS.search(msg):
        return KernelEvent(kind=EventKind.gpu_xid, pci=m.group("pci"), **base)
    for rx in _FS:  # before block errors: "Buffer I/O error" must not read as a request error
        if m := rx.search(msg):
            return KernelEvent(kind=EventKind.fs_error, device=m.group("dev"), **base)
    if m := _BLK.search(msg):
        return KernelEvent(kind=EventKind.block_io_error, device=m.group("dev"),
                           sector=int(m.group("sector")), op=m.group("op"), **base)
    if m := _SEGV.search(msg):
        return KernelEvent(kind=EventKind.segfault, pid=int(m.group("pid")), comm=m.group("comm"),
                           fault_addr=m.group("addr"), object=m.group("obj"), **base)
    return None


class KernelEventParser:
    """Feeds records in order; merges each OOM kill's two lines into one event.

    The kernel prints `oom-kill:constraint=...,task_memcg=...,pid=N` and then, immediately,
    `... Killed process N (comm) total-vm:...`. Either alone is a kill (older kernels print only
    the second), so the summary waits for its partner: until the Killed line of the same pid
    arrives, another OOM line arrives, or one whole batch (a probe tick) has passed without it.
    """

    def __init__(self, boot_wall_time: float | None = None) -> None:
        self.boot_wall_time = boot_wall_time
        self._pending: KernelEvent | None = None
        self._pending_batches = 0

    def feed(self, rec: KmsgRecord) -> list[KernelEvent]:
        ev = parse_event(rec, self.boot_wall_time)
        if ev is None:
            return []
        out: list[KernelEvent] = []
        if ev.kind is EventKind.oom_kill:
            pending, self._pending = self._pending, None
            if ev.message.startswith("oom-kill:"):
                if pending is not None:
                    out.append(pending)
                self._pending, self._pending_batches = ev, 0
                return out
            if pending is not None and pending.pid == ev.pid:
                return [_merge_oom(pending, ev)]
            if pending is not None:
                out.append(pending)
        out.append(ev)
        return out

    def end_batch(self) -> list[KernelEvent]:
        if self._pending is None:
            return []
        self._pending_batches += 1
        if self._pending_batches < 2:
            return []
        ev, self._pending = self._pending, None
        return [ev]


def _merge_oom(summary: KernelEvent, killed: KernelEvent) -> KernelEvent:
    # The Killed line carries the sizes and the user-facing text; the summary carries the cgroup.
    return killed.model_copy(update=dict(
        constraint=summary.constraint or killed.constraint,
        oom_memcg=summary.oom_memcg, task_memcg=summary.task_memcg,
        comm=killed.comm or summary.comm,
    ))
