"""KillOperation on real processes: cooperative, TERM-ignoring, stopped, whole process groups,
zombies, reused pids (real and in a fake /proc), dry runs, and — as root — a writer frozen in D
by fsfreeze that SIGKILL cannot end until the thaw.

Time is a FakeClock: the grace and kill waits pass when the test says so; the processes' own
transitions are awaited as events (state letters in /proc) with deadlines.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rigs import (FakeProc, frozen_ext4, root,  # noqa: F401 (root is a fixture)
                  spawn_in_state, spawned, task_state, wait_for_state, wait_until)

from stallwatch.kernel import procfs
from stallwatch.actions.kill import KillOperation, KillState
from stallwatch.clock import FakeClock


def start_ticks(pid: int) -> int:
    return procfs.parse_stat(open(f"/proc/{pid}/stat").read()).start_ticks


def ident(pid: int) -> tuple[int, int]:
    return (pid, start_ticks(pid))


def dead(pid: int) -> bool:
    return task_state(pid) in (None, "Z", "X")


def sig_bit(pid: int, field: str, sig: int) -> bool:
    """Whether `sig` is set in a mask of /proc/PID/status (SigIgn, SigCgt, ShdPnd, SigPnd)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise KeyError(field)


class Recorder:
    """An injected sender: records (pid|pgid, signal), sends nothing."""

    def __init__(self) -> None:
        self.kills: list[tuple[int, int]] = []
        self.killpgs: list[tuple[int, int]] = []

    def kill(self, pid: int, sig: int) -> None:
        self.kills.append((pid, sig))

    def killpg(self, pgid: int, sig: int) -> None:
        self.killpgs.append((pgid, sig))


def step_until(op: KillOperation, state: KillState, what: str, timeout: float = 10.0) -> None:
    wait_until(lambda: op.step() is state, timeout, f"{what} (kill is {op.state})")


def sent(op: KillOperation) -> list[tuple[str, int, str, str]]:
    return [(s.scope, s.id, s.signal, s.outcome) for s in op.signals]


# Prints "ready" once its SIGTERM disposition is in place.
IGNORE_TERM = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               "print('ready', flush=True)\ntime.sleep(1000)\n")
HANDLE_TERM = ("import signal, sys, time\n"
               "def bye(*_):\n    print('handled', flush=True)\n    sys.exit(0)\n"
               "signal.signal(signal.SIGTERM, bye)\nprint('ready', flush=True)\n"
               "while True:\n    time.sleep(1)\n")


def python(code: str):
    return spawned([sys.executable, "-c", code], stdout=subprocess.PIPE)


def read_line(proc: subprocess.Popen, timeout: float = 10.0) -> bytes:
    """The child's next stdout line, or a TimeoutError: never a read without a deadline."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"pid {proc.pid} printed nothing in {timeout:g} s")
    return proc.stdout.readline()


def await_ready(proc: subprocess.Popen) -> None:
    assert read_line(proc) == b"ready\n"


# -------------------------------------------------------------------------------- the basics


def test_cooperative_process_dies_on_sigterm():
    clock = FakeClock()
    with spawned(["sleep", "1000"]) as proc:
        wait_for_state(proc.pid, "S")
        op = KillOperation([ident(proc.pid)], pgid=proc.pid, clock=clock)
        assert op.step() is KillState.term_sent
        # The group signal reaches it; it is not signalled a second time on its own.
        assert sent(op) == [("pgid", proc.pid, "SIGTERM", "sent")]
        wait_until(lambda: dead(proc.pid), what="sleep to die of SIGTERM")
        clock.advance(0.5)
        assert op.step() is KillState.done  # a zombie (not reaped yet) counts as dead
        assert task_state(proc.pid) == "Z"
    assert proc.returncode == -signal.SIGTERM
    rep = op.report()
    assert [(t.from_state, t.to_state) for t in rep.history] == [
        (KillState.start, KillState.term_sent), (KillState.term_sent, KillState.done)]
    assert rep.history[1].at - rep.history[0].at == 0.5 and rep.finished_at is not None
    assert rep.survivors == () and rep.refused == ()
    assert op.step() is KillState.done  # final


def test_ignored_sigterm_gets_sigkill_after_grace():
    clock = FakeClock()
    with python(IGNORE_TERM) as proc:
        await_ready(proc)
        op = KillOperation([ident(proc.pid)], pgid=None, grace_s=10.0, clock=clock)
        assert op.step() is KillState.term_sent
        assert sent(op) == [("pid", proc.pid, "SIGTERM", "sent")]
        # SIGTERM was ignored: still alive, and nothing pending.
        assert not dead(proc.pid) and sig_bit(proc.pid, "SigIgn", signal.SIGTERM)
        clock.advance(9.9)
        assert op.step() is KillState.term_sent  # grace not over
        clock.advance(0.1)
        assert op.step() is KillState.kill_sent
        assert sent(op)[-1] == ("pid", proc.pid, "SIGKILL", "sent")
        wait_until(lambda: dead(proc.pid), what="SIGKILL to land")
        assert op.step() is KillState.done
    assert proc.returncode == -signal.SIGKILL
    assert "still alive 10.0 s after SIGTERM" in op.history[1].reason


def test_stopped_process_gets_sigcont_then_handles_sigterm():
    clock = FakeClock()
    with python(HANDLE_TERM) as proc:
        await_ready(proc)
        wait_until(lambda: sig_bit(proc.pid, "SigCgt", signal.SIGTERM), what="handler")
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for_state(proc.pid, "T")
        op = KillOperation([ident(proc.pid)], pgid=proc.pid, clock=clock)
        assert op.step() is KillState.term_sent
        assert sent(op) == [("pid", proc.pid, "SIGCONT", "sent"),
                            ("pgid", proc.pid, "SIGTERM", "sent")]
        assert "SIGCONT first to 1 stopped" in op.history[0].reason
        proc.wait(timeout=10)  # its handler ran: exit status 0, not death by signal
        assert op.step() is KillState.done
        assert proc.stdout.read() == b"handled\n"
    assert proc.returncode == 0


def test_already_gone_and_zombie_targets():
    clock = FakeClock()
    with spawn_in_state("Z", argv=["true"]) as z:
        gone = subprocess.Popen(["true"])
        gone_ident = ident(gone.pid)
        gone.wait()
        op = KillOperation([ident(z.pid), gone_ident], pgid=None, clock=clock)
        assert op.step() is KillState.done
        assert op.signals == () and "already gone" in op.history[0].reason


# ------------------------------------------------------------------------------ the group

GROUP = """
import signal, subprocess, sys, time
coop = subprocess.Popen(["sleep", "1000"])
# SIG_IGN survives exec: this child shrugs SIGTERM off.
stubborn = subprocess.Popen(["sleep", "1000"],
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
print(coop.pid, stubborn.pid, flush=True)
time.sleep(1000)
"""


def test_whole_process_group_with_children():
    clock = FakeClock()
    with spawned([sys.executable, "-c", GROUP], stdout=subprocess.PIPE) as proc:
        coop, stubborn = (int(x) for x in read_line(proc).split())
        wait_until(lambda: task_state(stubborn) == "S" and
                   sig_bit(stubborn, "SigIgn", signal.SIGTERM), what="stubborn child to exec")
        wait_for_state(coop, "S")
        # Only the leader is named: the children are found as members of its group.
        op = KillOperation([ident(proc.pid)], pgid=proc.pid, grace_s=5.0, clock=clock)
        assert op.step() is KillState.term_sent
        assert {p for p, _ in op.report().adopted} == {coop, stubborn}
        assert sent(op) == [("pgid", proc.pid, "SIGTERM", "sent")]
        proc.wait(timeout=10)
        wait_until(lambda: dead(coop), what="the cooperative child to die")
        assert op.step() is KillState.term_sent  # the stubborn child is alive: keep waiting
        assert [s.pid for s in op.survivors] == [stubborn]
        assert op.survivors[0].role == "group" and op.survivors[0].state == "S"
        clock.advance(5.0)
        assert op.step() is KillState.kill_sent
        # The leader is a zombie of ours: it still holds the group, so killpg is still safe.
        assert sent(op)[-1] == ("pgid", proc.pid, "SIGKILL", "sent")
        wait_until(lambda: dead(stubborn), what="SIGKILL to reach the stubborn child")
        assert op.step() is KillState.done


def test_group_without_verified_member_is_never_signalled():
    """The leader is gone and reaped, and no target is left in the group: the pgid number may
    belong to anyone now (here: nobody), so killpg is refused, not attempted."""
    rec = Recorder()
    leader = subprocess.Popen(["true"], start_new_session=True)
    lid = ident(leader.pid)
    leader.wait()
    with spawned(["sleep", "1000"]) as other:  # alive, but in its own group
        wait_for_state(other.pid, "S")
        op = KillOperation([lid, ident(other.pid)], pgid=leader.pid, clock=FakeClock(),
                           kill=rec.kill, killpg=rec.killpg)
        assert op.step() is KillState.term_sent
    assert rec.killpgs == [] and rec.kills == [(other.pid, signal.SIGTERM)]
    (r,) = op.refused
    assert r.scope == "pgid" and r.id == leader.pid and "no verified member" in r.reason


def test_own_process_group_and_pid_are_never_signalled():
    rec = Recorder()
    me = ident(os.getpid())
    op = KillOperation([me], pgid=os.getpgrp(), clock=FakeClock(), kill=rec.kill,
                       killpg=rec.killpg)
    assert op.step() is KillState.term_sent
    assert rec.kills == [] and rec.killpgs == []
    reasons = " | ".join(r.reason for r in op.refused)
    assert "stallwatch's own process group" in reasons and "stallwatch itself" in reasons


# ----------------------------------------------------------------------------- pid reuse


def test_reused_pid_is_never_signalled_recording_sender():
    rec = Recorder()
    with spawned(["sleep", "1000"]) as unrelated:
        wait_for_state(unrelated.pid, "S")
        real = start_ticks(unrelated.pid)
        # The job's process had this pid once, with another start time: it is gone.
        op = KillOperation([(unrelated.pid, real - 7)], pgid=unrelated.pid, clock=FakeClock(),
                           kill=rec.kill, killpg=rec.killpg)
        assert op.step() is KillState.done
        assert rec.kills == [] and rec.killpgs == []
        (r,) = op.refused
        assert r.scope == "pid" and r.id == unrelated.pid and "another process" in r.reason
        assert task_state(unrelated.pid) == "S"


def test_reused_pid_survives_the_real_sender():
    with spawned(["sleep", "1000"]) as unrelated:
        wait_for_state(unrelated.pid, "S")
        op = KillOperation([(unrelated.pid, start_ticks(unrelated.pid) + 1)],
                           pgid=unrelated.pid, grace_s=0.0, kill_wait_s=0.0, clock=FakeClock())
        for _ in range(3):
            op.step()
        assert op.state is KillState.done and op.signals == ()
        # Nothing arrived: still asleep, no signal pending.
        assert task_state(unrelated.pid) == "S"
        assert not sig_bit(unrelated.pid, "SigPnd", signal.SIGTERM)
        assert not sig_bit(unrelated.pid, "ShdPnd", signal.SIGTERM)


def test_reused_pid_in_fake_proc(tmp_path):
    fp = FakeProc(tmp_path)
    fp.add(4242, comm="sleep", start_ticks=2000)  # the pid, now someone else's
    fp.add(4300, comm="job", start_ticks=1500, state="S")  # a real target, still alive
    rec = Recorder()
    op = KillOperation([(4242, 1000), (4300, 1500)], pgid=None, roots=fp.roots,
                       clock=FakeClock(), kill=rec.kill, killpg=rec.killpg)
    assert op.step() is KillState.term_sent
    assert rec.kills == [(4300, signal.SIGTERM)]
    # It "dies" as a zombie: done.
    fp.add(4300, comm="job", start_ticks=1500, state="Z")
    assert op.step() is KillState.done
    (r,) = op.refused
    assert r.id == 4242 and "start_ticks 2000, not 1000" in r.reason


def test_pid_reused_between_sigterm_and_sigkill_fake_proc(tmp_path):
    """The target dies after SIGTERM and its pid is taken by a new process before the next
    step: the new one gets no SIGKILL, and the kill is done."""
    fp = FakeProc(tmp_path)
    fp.add(4242, start_ticks=1000)
    rec = Recorder()
    clock = FakeClock()
    op = KillOperation([(4242, 1000)], pgid=None, roots=fp.roots, clock=clock, grace_s=1.0,
                       kill=rec.kill, killpg=rec.killpg)
    assert op.step() is KillState.term_sent
    fp.add(4242, start_ticks=3000)
    clock.advance(2.0)
    assert op.step() is KillState.done
    assert rec.kills == [(4242, signal.SIGTERM)]


# ------------------------------------------------------------------------------- dry run


def test_dry_run_sends_nothing():
    rec = Recorder()
    clock = FakeClock()
    with spawned(["sleep", "1000"]) as proc:
        wait_for_state(proc.pid, "S")
        op = KillOperation([ident(proc.pid)], pgid=proc.pid, grace_s=3.0, kill_wait_s=3.0,
                           clock=clock, dry_run=True, kill=rec.kill, killpg=rec.killpg)
        assert op.step() is KillState.term_sent
        clock.advance(3.0)
        assert op.step() is KillState.kill_sent
        clock.advance(3.0)
        assert op.step() is KillState.done  # never "unkillable": nothing was tried
        assert task_state(proc.pid) == "S"
        assert not sig_bit(proc.pid, "SigPnd", signal.SIGTERM)
    assert rec.kills == [] and rec.killpgs == []
    assert sent(op) == [("pgid", proc.pid, "SIGTERM", "dry_run"),
                        ("pgid", proc.pid, "SIGKILL", "dry_run")]
    rep = op.report()
    assert rep.dry_run and [s.pid for s in rep.survivors] == [proc.pid]
    assert "dry run: nothing was sent" in rep.history[-1].reason


def test_dry_run_with_real_sender_leaves_process_alive():
    with spawned(["sleep", "1000"]) as proc:
        wait_for_state(proc.pid, "S")
        op = KillOperation([ident(proc.pid)], pgid=None, grace_s=0, kill_wait_s=0,
                           clock=FakeClock(), dry_run=True)
        while not op.finished:
            op.step()
        assert task_state(proc.pid) == "S"


# ------------------------------------------------------------------------ frozen in D (root)


@pytest.mark.root
def test_writer_frozen_in_d_is_unkillable_until_thaw(root):
    clock = FakeClock()
    with frozen_ext4() as (mnt, _dev):
        try:
            # It ignores SIGTERM, so what fails to end it is the SIGKILL (a default-action
            # SIGTERM would already start its exit, and then be just as stuck).
            argv = ["sh", "-c", 'trap "" TERM; echo stuck > "$1/stuck"', "sh", str(mnt)]
            with spawn_in_state("D", where=mnt, argv=argv) as proc:
                op = KillOperation([ident(proc.pid)], pgid=proc.pid, grace_s=1.0,
                                   kill_wait_s=2.0, clock=clock)
                assert op.step() is KillState.term_sent
                clock.advance(1.0)
                assert op.step() is KillState.kill_sent
                assert sent(op)[-1] == ("pgid", proc.pid, "SIGKILL", "sent")
                # SIGKILL is pending (the group exit queues it to the thread) and the task is
                # still in D.
                wait_until(lambda: sig_bit(proc.pid, "SigPnd", signal.SIGKILL),
                           what="SIGKILL to be pending")
                assert task_state(proc.pid) == "D"
                clock.advance(2.0)
                assert op.step() is KillState.unkillable
                (s,) = op.survivors
                assert s.pid == proc.pid and s.state == "D" and s.wchan
                assert s.wchan in op.history[-1].reason and "after SIGKILL" in \
                    op.history[-1].reason
                assert op.step() is KillState.unkillable  # re-checkable, still there
                subprocess.run(["fsfreeze", "-u", str(mnt)], check=True, timeout=30)
                step_until(op, KillState.done, "the writer to die after the thaw")
        finally:
            subprocess.run(["fsfreeze", "-u", str(mnt)], capture_output=True, timeout=30)
    assert [t.to_state for t in op.history] == [
        KillState.term_sent, KillState.kill_sent, KillState.unkillable, KillState.done]
    assert proc.returncode == -signal.SIGKILL
