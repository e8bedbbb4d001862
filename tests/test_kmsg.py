"""Kernel log: record and event parsers, the reader on captured roots (tests/fixtures/host1,
tests/fixtures/oom_memcg_v1), and a real OOM kill (root)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from stallwatch.clock import FakeClock
from stallwatch.kernel.kmsgparse import EventKind, KernelEventParser, parse_event, parse_record
from stallwatch.probes.base import ProbeStatus
from stallwatch.probes.kmsg import KmsgObs, KmsgProbe
from stallwatch.kernel.roots import Roots

from rigs import HOST1, OOM_MEMCG_V1, capture_copy, enter_or_skip, memory_cgroup


def ev(line: str):
    rec = parse_record(line)
    assert rec is not None, line
    return parse_event(rec, boot_wall_time=1_000_000.0)


# -- records ---------------------------------------------------------------------------------------

def test_record_fields_and_continuation_lines() -> None:
    rec = parse_record("5,284,424793,-;virtio_blk virtio1: [vda] 536870912 blocks\n"
                       " SUBSYSTEM=virtio\n DEVICE=+virtio:virtio1\n")
    assert (rec.seq, rec.usec, rec.level, rec.facility) == (284, 424793, 5, 0)
    assert rec.message == "virtio_blk virtio1: [vda] 536870912 blocks"
    assert parse_record("14,631,730000100,-,caller=T1;hello").facility == 1  # prio 14 = user.info
    assert parse_record("no separator") is None and parse_record("x,y,z,-;msg") is None


# -- events ----------------------------------------------------------------------------------------

def test_oom_kill_lines() -> None:
    e = ev("3,454,554350699,-;Memory cgroup out of memory: Killed process 8269 (python3) total-vm:540872kB, "
           "anon-rss:65152kB, file-rss:6604kB, shmem-rss:0kB, UID:0 pgtables:192kB oom_score_adj:0")
    assert e.kind is EventKind.oom_kill and (e.pid, e.comm) == (8269, "python3")
    assert (e.total_vm_kb, e.anon_rss_kb, e.file_rss_kb, e.shmem_rss_kb) == (540872, 65152, 6604, 0)
    assert e.constraint == "CONSTRAINT_MEMCG" and e.oom_score_adj == 0
    assert e.wall_time == pytest.approx(1_000_000.0 + 554.350699)

    g = ev("3,1,2,-;Out of memory: Killed process 77 (pt_main_thread) total-vm:1kB, anon-rss:2kB, file-rss:3kB, "
           "shmem-rss:4kB, UID:1000 pgtables:5kB oom_score_adj:-1000")
    assert (g.pid, g.comm, g.constraint, g.oom_score_adj) == (77, "pt_main_thread", None, -1000)
    old = ev("3,1,2,-;Killed process 12 (java) total-vm:10kB, anon-rss:5kB, file-rss:0kB")  # pre-4.19
    assert (old.kind, old.pid, old.anon_rss_kb) == (EventKind.oom_kill, 12, 5)

    s = ev("6,453,554350670,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
           "oom_memcg=/stallwatch-test-1,task_memcg=/stallwatch-test-1/job,task=python3,pid=8269,uid=0")
    assert (s.kind, s.pid, s.comm, s.constraint) == (EventKind.oom_kill, 8269, "python3", "CONSTRAINT_MEMCG")
    assert (s.oom_memcg, s.task_memcg) == ("/stallwatch-test-1", "/stallwatch-test-1/job")
    # The reaper's follow-up is not a second kill.
    assert ev("6,642,1,-;oom_reaper: reaped process 5555 (python), now anon-rss:0kB, file-rss:0kB") is None


def test_hung_task_xid_io_fs_segfault_lines() -> None:
    h = ev("3,600,700000000,-;INFO: task pt_data_worker:4242 blocked for more than 122 seconds.")
    assert (h.kind, h.comm, h.pid, h.blocked_for_s) == (EventKind.hung_task, "pt_data_worker", 4242, 122)
    assert ev("3,1,1,-;INFO: task kworker/u8:3:99 blocked for more than 120 seconds.").comm == "kworker/u8:3"

    x = ev("4,610,1,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.")
    assert (x.kind, x.xid, x.pci, x.pid, x.comm) == (EventKind.gpu_xid, 79, "0000:3b:00", 1234, "python")
    unk = ev("4,612,1,-;NVRM: Xid (PCI:0000:b1:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception")
    assert (unk.xid, unk.pid, unk.comm) == (13, None, None)
    assert ev("4,613,1,-;NVRM: Xid (PCI:0000:18:00): 48, An uncorrectable double bit error (DBE)").xid == 48
    bus = ev("4,611,1,-;NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.")
    assert (bus.kind, bus.xid, bus.pci) == (EventKind.gpu_xid, None, "0000:3b:00.0")

    b = ev("3,620,1,-;I/O error, dev loop0, sector 2048 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio class 2")
    assert (b.kind, b.device, b.sector, b.op) == (EventKind.block_io_error, "loop0", 2048, "WRITE")
    old = ev("3,621,1,-;blk_update_request: I/O error, dev sda, sector 123456 op 0x0:(READ) flags 0x0")
    assert (old.device, old.sector, old.op) == ("sda", 123456, "READ")
    assert ev("3,1,1,-;print_req_error: I/O error, dev nvme0n1, sector 77").device == "nvme0n1"

    for line, dev in [
        ("3,623,1,-;Buffer I/O error on dev loop0, logical block 0, lost async page write", "loop0"),
        ("2,624,1,-;EXT4-fs error (device loop0): ext4_find_entry:1663: inode #2: comm ls: reading directory", "loop0"),
        ("3,625,1,-;Aborting journal on device loop0-8.", "loop0-8"),
        ("2,626,1,-;EXT4-fs (dm-0): Remounting filesystem read-only", "dm-0"),
        ("3,627,1,-;XFS (nvme0n1p1): metadata I/O error in \"xfs_trans_read_buf_map\" at daddr 0x2 len 1 error 5",
         "nvme0n1p1"),
        ("2,1,1,-;BTRFS error (device sdc1): bdev /dev/sdc1 errs: wr 1, rd 0, flush 0", "sdc1"),
        ("5,628,1,-;nfs: server fileserver not responding, still trying", "fileserver"),
    ]:
        f = ev(line)
        assert (f.kind, f.device) == (EventKind.fs_error, dev), line
    assert ev("6,1,1,-;EXT4-fs (loop0): mounted filesystem r/w with ordered data mode.") is None

    s = ev("6,457,1,-;python3[8411]: segfault at 0 ip 00007fbb2bd85ad8 sp 00007ffe38160988 error 4 in "
           "libc.so.6[167ad8,7fbb2bc44000+156000] likely on CPU 1 (core 1, socket 0)")
    assert (s.kind, s.comm, s.pid, s.fault_addr, s.object) == (EventKind.segfault, "python3", 8411, "0", "libc.so.6")
    gp = ev("6,630,1,-;traps: python[4243] general protection fault ip:7f3a sp:7ffc error:0 "
            "in libtorch_cuda.so[7f3a+2]")
    assert (gp.kind, gp.pid, gp.fault_addr, gp.object) == (EventKind.segfault, 4243, None, "libtorch_cuda.so")


def test_userspace_lines_are_not_kernel_events() -> None:
    assert ev("14,631,1,-;python[999]: INFO: task fake:1 blocked for more than 999 seconds.") is None


def test_parser_merges_the_two_lines_of_one_oom_kill() -> None:
    p = KernelEventParser()
    recs = [parse_record(ln) for ln in Roots.under(OOM_MEMCG_V1).kmsg.read_text().splitlines()
            if not ln.startswith(" ")]
    events = [e for r in recs for e in p.feed(r)] + p.end_batch() + p.end_batch()
    (kill,) = events
    assert (kill.pid, kill.comm, kill.constraint) == (8269, "python3", "CONSTRAINT_MEMCG")
    assert kill.task_memcg == "/swexp-3767" and kill.anon_rss_kb == 65152 and kill.seq == 454


def test_parser_emits_a_lone_summary_after_a_batch() -> None:
    p = KernelEventParser()
    summary = parse_record("6,10,1,-;oom-kill:constraint=CONSTRAINT_MEMCG,task_memcg=/x,task=a,pid=5,uid=0")
    assert p.feed(summary) == [] and p.end_batch() == []  # its Killed line may come next tick
    (lone,) = p.end_batch()
    assert (lone.pid, lone.task_memcg) == (5, "/x")
    # A summary followed by a different kill is emitted at once, then the other kill.
    p.feed(summary)
    out = p.feed(parse_record("3,12,2,-;Out of memory: Killed process 6 (b) total-vm:1kB"))
    assert [e.pid for e in out] == [5, 6]


# -- the probe on a captured root ---------------------------------------------------------------------

def test_probe_history_reads_fixture_and_rings() -> None:
    probe = KmsgProbe(roots=Roots.under(HOST1), clock=FakeClock(), history=True, ring_size=5)
    obs = probe.collect()
    assert obs.status is ProbeStatus.ok and obs.cursor == 642 and obs.prev_cursor is None
    assert obs.records_read == 25  # continuation lines are part of their record
    assert obs.counts == {"segfault": 2, "hung_task": 1, "gpu_xid": 4, "block_io_error": 3,
                          "fs_error": 6, "oom_kill": 1}
    assert len(obs.events) == 5 and obs.events[-1].kind is EventKind.oom_kill
    oom = obs.events[-1]
    assert (oom.pid, oom.constraint, oom.task_memcg) == (5555, "CONSTRAINT_NONE", "/user.slice/user-1000.slice")
    assert oom.wall_time == pytest.approx(1795989902 + 740.0001)
    # the seq gaps
    assert obs.records_lost == (456 - 284) + (599 - 458) + (609 - 603) + (619 - 613) + (629 - 628) + (639 - 631)
    assert KmsgObs.model_validate_json(obs.model_dump_json()) == obs


def test_probe_tails_from_the_end_and_keeps_its_cursor(tmp_path: Path) -> None:
    roots = Roots.under(capture_copy(HOST1, tmp_path / "host1"))
    kmsg = roots.kmsg
    probe = KmsgProbe(roots=roots, clock=FakeClock())
    first = probe.collect()
    assert first.status is ProbeStatus.ok and first.records_read == 0 and first.events == ()
    with open(kmsg, "a") as f:
        f.write("3,700,800000000,-;INFO: task python:31337 blocked for more than 120 seconds.\n")
        f.write("3,701,800000001,-;I/O error, dev vda, sect")  # torn: its newline is not written yet
    obs = probe.collect()
    assert obs.cursor == 700 and [e.pid for e in obs.events] == [31337]
    with open(kmsg, "a") as f:
        f.write("or 8 op 0x1:(WRITE) flags 0x0\n")
    obs = probe.collect()
    assert (obs.prev_cursor, obs.cursor) == (700, 701)
    new = [e for e in obs.events if e.seq > obs.prev_cursor]
    assert [(e.kind, e.device, e.sector) for e in new] == [(EventKind.block_io_error, "vda", 8)]
    assert obs.counts == {"hung_task": 1, "block_io_error": 1}


def test_probe_resumes_after_a_stored_cursor() -> None:
    obs = KmsgProbe(roots=Roots.under(HOST1), clock=FakeClock(), cursor=630).collect()
    assert [e.seq for e in obs.events] == [641]  # 631 is userspace; 640+641 are one OOM kill


def test_probe_absent_and_denied(tmp_path: Path) -> None:
    obs = KmsgProbe(roots=Roots.under(tmp_path), clock=FakeClock()).collect()
    assert obs.status is ProbeStatus.absent and obs.events == ()


@pytest.mark.skipif(not os.path.exists("/dev/kmsg"), reason="no /dev/kmsg on this machine")
def test_probe_denied_for_an_unprivileged_user() -> None:
    """The real /dev/kmsg as uid 65534: denied when dmesg_restrict=1 (or mode forbids), ok else."""
    restricted = Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1"
    if os.geteuid() == 0:
        pid = os.fork()
        if pid == 0:  # child: drop to nobody, report the status as the exit code
            code = 99
            try:
                os.setgid(65534)
                os.setuid(65534)
                obs = KmsgProbe().collect()
                code = {ProbeStatus.denied: 10, ProbeStatus.ok: 11}.get(obs.status, 12)
                code += 10 if obs.error and "CAP_SYSLOG" in obs.error else 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
    else:
        obs = KmsgProbe().collect()
        code = {ProbeStatus.denied: 10, ProbeStatus.ok: 11}.get(obs.status, 12)
        code += 10 if obs.error and "CAP_SYSLOG" in obs.error else 0
    if restricted:
        assert code == 20  # denied, and the reason names the privilege it needs
    else:
        assert code in (11, 20)


# -- live: a real OOM kill in a memory cgroup --------------------------------------------------------

@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates a memory cgroup and reads /dev/kmsg")
def test_real_oom_kill_is_reported_with_the_victims_pid() -> None:
    probe = KmsgProbe(history=False)
    first = probe.collect()  # opened at the end of the log, before the OOM happens
    if first.status is not ProbeStatus.ok:
        pytest.skip(f"/dev/kmsg not readable here: {first.error}")
    with ExitStack() as stack:
        cg = enter_or_skip(stack, memory_cgroup(64 << 20))
        r, w = os.pipe()
        # The child blocks on the pipe until it is inside the cgroup, then touches 512 MiB.
        child = subprocess.Popen(
            [sys.executable, "-c", "import os; os.read(0, 1); x = b'\\1' * (512 << 20); print(len(x))"],
            stdin=r, stdout=subprocess.DEVNULL)
        os.close(r)
        try:
            (cg / "cgroup.procs").write_text(str(child.pid))
            os.write(w, b"g")
            assert child.wait(timeout=60) == -9, "the child was expected to be OOM-killed"
            deadline = time.monotonic() + 10
            kills = []
            while not kills:
                obs = probe.collect()
                kills = [e for e in obs.events if e.kind is EventKind.oom_kill and e.pid == child.pid]
                if time.monotonic() > deadline:
                    raise AssertionError(f"no oom_kill for pid {child.pid}; events: {obs.events}")
                time.sleep(0.05)
        finally:
            os.close(w)
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
    (kill,) = kills
    assert kill.constraint == "CONSTRAINT_MEMCG"
    assert kill.task_memcg is None or kill.task_memcg.endswith(cg.name)  # None: an old kernel
    assert kill.comm.startswith("python") and kill.anon_rss_kb > 0
    assert kill.seq > (first.cursor or -1) and kill.wall_time == pytest.approx(time.time(), abs=120)
    probe.close()


def test_a_tick_with_nothing_new_hands_on_the_same_observation(tmp_path: Path) -> None:
    """The same object only when it equals a fresh one field for field: not on the tick after
    new records (records_read and prev_cursor change), nor when a held OOM summary is let out
    by a batch without records."""
    roots = Roots.under(capture_copy(HOST1, tmp_path / "host1"))
    probe = KmsgProbe(roots=roots, clock=FakeClock())
    first = probe.collect()
    assert probe.collect() is first
    with open(roots.kmsg, "a") as f:
        f.write("3,700,800000000,-;INFO: task python:31337 blocked for more than 120 seconds.\n")
    news = probe.collect()
    assert news is not first and news.records_read == 1 and news.prev_cursor != news.cursor
    quiet = probe.collect()
    assert quiet is not news and (quiet.records_read, quiet.prev_cursor) == (0, 700)
    assert probe.collect() is quiet
    with open(roots.kmsg, "a") as f:  # a summary whose Killed line never comes
        f.write("6,701,800000001,-;oom-kill:constraint=CONSTRAINT_MEMCG,task_memcg=/x,task=a,pid=5,uid=0\n")
    held = probe.collect()
    assert held.cursor == 701 and held.counts == {"hung_task": 1}
    out = probe.collect()  # a batch without its Killed line lets the summary out: new, though
    assert out is not held and out.records_read == 0  # no record was read
    assert out.counts == {"hung_task": 1, "oom_kill": 1}
    assert probe.collect() is out  # read nothing, as it did: equal field for field


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: reads and writes /dev/kmsg")
def test_on_dev_kmsg_a_quiet_tick_polls_and_hands_on_the_same_observation() -> None:
    """The real /dev/kmsg: with nothing waiting (poll), no read; a record written makes the
    next observation new. Other work on the host may log meanwhile: wait for a quiet pair."""
    probe = KmsgProbe(history=False)
    try:
        last = probe.collect()
        if last.status is not ProbeStatus.ok:
            pytest.skip(f"/dev/kmsg not readable here: {last.error}")
        deadline = time.monotonic() + 10
        while (obs := probe.collect()) is not last:
            assert time.monotonic() < deadline, "/dev/kmsg never quiet for two ticks"
            last = obs
        assert probe._reader.nothing_new() and probe.collect() is last
        with open("/dev/kmsg", "w") as f:  # a userspace record: read, though no kernel event
            f.write("stallwatch test: idle5 kmsg poll\n")
        new = probe.collect()
        assert new is not last and new.records_read >= 1 and new.cursor is not None
        assert last.cursor is None or new.cursor > last.cursor
    finally:
        probe.close()
