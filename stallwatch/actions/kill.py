"""Kill a job safely: an explicit state machine, one object per kill, advanced by `step()`.

    start ──► term_sent ──(grace_s, survivors)──► kill_sent ──(kill_wait_s, survivors)──► unkillable
      │           │                                   │                                      │
      └───────────┴──────────(all gone)───────────────┴──────────────► done ◄────(all gone)──┘

`step()` never blocks: it reads a few /proc files, sends at most one round of signals and
returns the state. The daemon calls it every tick until `finished`; `unkillable` is not
final: a task in `D` holds its pending SIGKILL until its I/O returns (a frozen filesystem is
thawed, an NFS server comes back), so stepping on from `unkillable` reaches `done` then.

Identity. A process is (pid, start_ticks), never a pid alone. Before every signal the pid's
/proc/PID/stat is read again and its start time compared: a pid held by another process is never
signalled, and is recorded as refused. With the real sender the signal goes through a pidfd
opened *before* that check (pidfd_open + pidfd_send_signal), so there is no window in which the
pid could die and be reused between the check and the signal; an injected `kill` callable (or a
kernel without pidfd) gets the check then kill(2), a window of microseconds.

Process group. A pgid is the pid of the group's leader, and the kernel does not hand out a number
while any process still uses it as a pid, pgid or sid. So the group is still *our* group exactly
as long as one of its members we have verified (a target, the leader, or a member adopted
earlier, by pid and start time) is still in it — as a zombie too. killpg is sent only then; once
the last verified member has left, the number may be recycled by an unrelated group, and killpg
is refused. Members of the group found in /proc while it is verified are adopted (tracked and
waited for), so children that ignore SIGTERM are SIGKILLed and a `D` child shows as a survivor.
The daemon's own process group and pid are never signalled.

Each process gets each signal once: the group signal reaches the members in the group, and
individual signals go only to tracked processes outside it (a target that moved to its own group,
or all of them when the group is not verified). Two SIGTERMs can run a handler twice, and many
programs take a second one as "force quit now".

SIGCONT goes first to stopped (`T`) processes so they can run their SIGTERM handler; a stopped
process with a handler would otherwise keep the signal pending until the grace ran out. SIGKILL
needs no SIGCONT. A zombie counts as dead: it holds no memory, files or GPU context.

`dry_run` walks the same timeline and verifies identities, but records what it would send and
sends nothing; since nothing dies, it ends in `done` with the `survivors` it would have left,
never in `unkillable` (which is a claim about the kernel it did not test).
"""

from __future__ import annotations

import errno
import os
import signal as _signal
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal
from collections.abc import Callable, Iterable

from stallwatch.kernel import procfs
from stallwatch.kernel.proc import Proc, pids
from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.model import Frozen
from stallwatch.kernel.roots import DEFAULT_ROOTS, Absent, Denied, Roots

__all__ = [
    "KillOperation", "KillReport", "KillState", "Refusal", "SignalRecord", "Survivor",
    "KillTransition",
]

Sender = Callable[[int, int], None]


class KillState(StrEnum):
    start = "start"
    term_sent = "term_sent"
    kill_sent = "kill_sent"
    unkillable = "unkillable"  # survivors remained kill_wait_s after SIGKILL; re-checkable
    done = "done"  # every tracked process is gone (or a zombie); final


class KillTransition(Frozen):
    from_state: KillState
    to_state: KillState
    at: float  # the clock's monotonic seconds
    wall: float  # Unix seconds, for the incident log
    reason: str


class SignalRecord(Frozen):
    at: float
    wall: float
    scope: Literal["pid", "pgid"]
    id: int
    signal: str  # "SIGTERM", ...
    # sent | dry_run | gone (ESRCH: it died first) | denied (EPERM) | error: ...
    outcome: str


class Refusal(Frozen):
    """A signal not sent because identity could not be verified: pid or pgid reuse, our own pid."""

    at: float
    wall: float
    scope: Literal["pid", "pgid"]
    id: int
    signal: str | None
    reason: str


class Survivor(Frozen):
    pid: int
    start_ticks: int
    comm: str | None
    state: str | None  # "D" for the classic unkillable; None when /proc/PID/stat was unreadable
    wchan: str | None  # the kernel function it waits in (percpu_rwsem_wait, nfs_wait_...)
    role: Literal["target", "group"]


class KillReport(Frozen):
    state: KillState
    targets: tuple[tuple[int, int], ...]  # (pid, start_ticks) as given
    pgid: int | None
    dry_run: bool
    grace_s: float
    kill_wait_s: float
    started_at: float | None  # wall time of the first step
    finished_at: float | None  # wall time `done` was reached
    history: tuple[KillTransition, ...] = ()
    signals: tuple[SignalRecord, ...] = ()
    refused: tuple[Refusal, ...] = ()
    adopted: tuple[tuple[int, int], ...] = ()  # group members found in /proc and tracked
    survivors: tuple[Survivor, ...] = ()  # alive at the last step (before `done`: all of them)
    errors: tuple[str, ...] = ()  # unexpected failures inside step(); the state did not move


# ------------------------------------------------------------------------------------ internals


@dataclass(slots=True)
class _Seen:
    """One tracked identity as the latest step saw it."""

    pid: int
    start_ticks: int
    role: Literal["target", "group"]
    # zombie: dead for the kill, but still holding its pid and its place in the group
    status: Literal["alive", "zombie", "dead", "reused", "unreadable"] = "alive"
    state: str | None = None
    comm: str | None = None
    pgid: int | None = None
    tid: int | None = None  # a live thread of a process whose leader is a zombie


def _signame(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class KillOperation:
    """One kill of one job. Construct it, then call `step()` every tick until `finished`."""

    def __init__(
        self,
        targets: Iterable[tuple[int, int]],
        pgid: int | None,
        grace_s: float = 10.0,
        kill_wait_s: float = 10.0,
        clock: Clock = SYSTEM_CLOCK,
        roots: Roots = DEFAULT_ROOTS,
        *,
        dry_run: bool = False,
        kill: Sender | None = None,
        killpg: Sender | None = None,
        adopt_group: bool = True,
        self_pid: int | None = None,
        self_pgid: int | None = None,
    ) -> None:
        """targets: (pid, start_ticks) of the job's processes, as the snapshot saw them.
        pgid: the job's process group (a supervised job's own session), or None to signal only
        the targets. kill/killpg: injected senders (pid|pgid, signal); None means the real ones
        (pidfd for processes, killpg(2) for the group). adopt_group: track group members found in
        /proc (see the module docstring). self_pid/self_pgid: never signalled; default ours.
        """
        self.targets = tuple(dict.fromkeys((int(p), int(s)) for p, s in targets))
        self.pgid = pgid
        self.grace_s, self.kill_wait_s = float(grace_s), float(kill_wait_s)
        self.clock, self.roots, self.dry_run = clock, roots, dry_run
        self.adopt_group = adopt_group
        self._kill, self._killpg = kill, killpg
        self._self_pid = os.getpid() if self_pid is None else self_pid
        self._self_pgid = os.getpgrp() if self_pgid is None else self_pgid

        self.state = KillState.start
        self._tracked: dict[tuple[int, int], _Seen] = {
            (p, s): _Seen(p, s, "target") for p, s in self.targets}
        self._adopted: list[tuple[int, int]] = []
        self._history: list[KillTransition] = []
        self._signals: list[SignalRecord] = []
        self._refused: list[Refusal] = []
        self._refused_keys: set[tuple] = set()
        self._errors: list[str] = []
        self._survivors: tuple[Survivor, ...] = ()
        self._entered_mono: float | None = None  # monotonic time the current state began
        self._started_wall: float | None = None
        self._finished_wall: float | None = None
        self._group_ok = False

    # ------------------------------------------------------------------------------ public API

    @property
    def finished(self) -> bool:
        """True once `done`: nothing the kill tracked is alive."""
        return self.state is KillState.done

    @property
    def survivors(self) -> tuple[Survivor, ...]:
        return self._survivors

    @property
    def history(self) -> tuple[KillTransition, ...]:
        return tuple(self._history)

    @property
    def signals(self) -> tuple[SignalRecord, ...]:
        return tuple(self._signals)

    @property
    def refused(self) -> tuple[Refusal, ...]:
        return tuple(self._refused)

    def step(self) -> KillState:
        """Advance by what the clock and /proc say; never blocks, never raises."""
        if self.state is KillState.done:
            return self.state
        try:
            self._step()
        except Exception as exc:  # noqa: BLE001 - a bug or an odd /proc must not take the daemon's tick down
            msg = f"{type(exc).__name__}: {exc}"
            if not self._errors or self._errors[-1] != msg:  # once per run of the same error
                self._errors = (self._errors + [msg])[-20:]
        return self.state

    def report(self) -> KillReport:
        return KillReport(
            state=self.state, targets=self.targets, pgid=self.pgid, dry_run=self.dry_run,
            grace_s=self.grace_s, kill_wait_s=self.kill_wait_s, started_at=self._started_wall,
            finished_at=self._finished_wall, history=tuple(self._history),
            signals=tuple(self._signals), refused=tuple(self._refused),
            adopted=tuple(self._adopted), survivors=self._survivors, errors=tuple(self._errors),
        )

    # ---------------------------------------------------------------------------- the machine

    def _step(self) -> None:
        now = self.clock.monotonic()
        if self._started_wall is None:
            self._started_wall = self.clock.time()
            self._entered_mono = now
        alive = self._observe()
        self._survivors = tuple(self._survivor(s) for s in alive)
        held = now - (self._entered_mono if self._entered_mono is not None else now)

        if not alive:
            gone = "every tracked process is gone" if self.state is not KillState.start \
                else "nothing to kill: every target was already gone"
            self._move(KillState.done, now, gone)
            return
        if self.state is KillState.start:
            stopped = [s for s in alive if s.state == "T"]
            for s in stopped:
                self._signal_pid(s, _signal.SIGCONT)
            self._signal_round(alive, _signal.SIGTERM)
            extra = f", SIGCONT first to {len(stopped)} stopped" if stopped else ""
            self._move(KillState.term_sent, now, f"SIGTERM to {self._who(alive)}{extra}")
        elif self.state is KillState.term_sent:
            if held >= self.grace_s:
                self._signal_round(alive, _signal.SIGKILL)
                self._move(KillState.kill_sent, now,
                           f"{len(alive)} still alive {held:.1f} s after SIGTERM: SIGKILL to "
                           f"{self._who(alive)}")
        elif self.state is KillState.kill_sent and held >= self.kill_wait_s:
            names = ", ".join(f"{s.pid} ({s.state}" + (f" in {s.wchan}" if s.wchan else "")
                              + ")" for s in self._survivors)
            if self.dry_run:
                self._move(KillState.done, now,
                           f"dry run: nothing was sent, {len(alive)} left alive: {names}")
            else:
                self._move(KillState.unkillable, now,
                           f"{len(alive)} still alive {held:.1f} s after SIGKILL: {names}")
        # unkillable: stay, with survivors refreshed, until they die (handled above)

    def _move(self, to: KillState, now: float, reason: str) -> None:
        self._history.append(KillTransition(from_state=self.state, to_state=to, at=now,
                                            wall=self.clock.time(), reason=reason))
        self.state, self._entered_mono = to, now
        if to is KillState.done:
            self._finished_wall = self.clock.time()

    def _who(self, alive: list[_Seen]) -> str:
        pids = ", ".join(str(s.pid) for s in alive[:8]) + (" ..." if len(alive) > 8 else "")
        group = f"group {self.pgid} and " if self._group_ok else ""
        return f"{group}{len(alive)} process{'es' if len(alive) != 1 else ''} ({pids})"

    # ----------------------------------------------------------------------------- observing

    def _stat(self, pid: int) -> procfs.Stat | Literal["denied"] | None:
        try:
            return Proc(pid, self.roots).stat()
        except Absent:
            return None
        except Denied:
            return "denied"

    def _wchan(self, pid: int) -> str | None:
        try:
            return Proc(pid, self.roots).wchan()
        except (Absent, Denied):
            return None

    def _task_wchan(self, pid: int, tid: int) -> str | None:
        try:
            return Proc(pid, self.roots).wchan(tid)
        except (Absent, Denied):
            return None

    def _refresh(self, seen: _Seen, st: procfs.Stat | Literal["denied"] | None) -> None:
        if seen.status in ("dead", "reused"):
            return  # an identity that ended never comes back
        if st is None:
            seen.status, seen.state = "dead", None
        elif st == "denied":
            # Cannot verify: never signalled, and not counted as dead either (it may still be
            # the job, writing): the resume waits rather than start a second writer.
            seen.status, seen.state = "unreadable", None
            self._refuse("pid", seen.pid, None, "identity unverifiable: /proc/PID/stat denied")
        elif st.start_ticks != seen.start_ticks:
            seen.status = "reused"
            self._refuse("pid", seen.pid, None,
                         f"pid {seen.pid} now belongs to another process ({st.comm!r}, "
                         f"start_ticks {st.start_ticks}, not {seen.start_ticks}): the "
                         f"{seen.role} is gone and the new process is left alone")
        else:
            seen.state, seen.comm, seen.pgid = st.state, st.comm, st.pgid
            seen.status = "zombie" if st.state in ("Z", "X") else "alive"
            seen.tid = None
            if seen.status == "zombie":
                live = self._live_thread(seen.pid)
                if live is not None:
                    # The thread-group leader exited but another thread lives on (a writer
                    # blocked in D on a frozen filesystem, say): the process is not dead, it
                    # still holds its files and its blocked write.
                    seen.status, seen.state, seen.tid = "alive", live[0], live[1]

    def _live_thread(self, pid: int) -> tuple[str, int] | None:
        """(state, tid) of a thread of `pid` that is not a zombie, D first; None if none."""
        st = Proc(pid, self.roots).live_thread()
        return None if st is None else (st.state, st.pid)

    def _observe(self) -> list[_Seen]:
        """Refresh every tracked identity, verify the group, adopt its new members.

        Returns the tracked processes still alive (not zombies), targets first."""
        scan: dict[int, procfs.Stat] | None = None
        if self.pgid is not None and self.adopt_group and self._group_allowed():
            scan = self._scan()
        for key, seen in self._tracked.items():
            # Not in the scan: gone, denied, or the scan was skipped; read it directly.
            st = scan[key[0]] if scan is not None and key[0] in scan else self._stat(key[0])
            self._refresh(seen, st)
        self._group_ok = self._verify_group()
        if scan is not None and self._group_ok:
            # The group is ours right now, so every process in it is ours too (the kernel does
            # not give a pgid in use to another group).
            for pid, st in scan.items():
                key = (pid, st.start_ticks)
                if st.pgid == self.pgid and key not in self._tracked and pid != self._self_pid:
                    seen = _Seen(pid, st.start_ticks, "group")
                    self._refresh(seen, st)
                    self._tracked[key] = seen
                    self._adopted.append(key)
        return [s for s in self._tracked.values() if s.status in ("alive", "unreadable")]

    def _group_allowed(self) -> bool:
        return self.pgid is not None and self.pgid > 1 and self.pgid != self._self_pgid

    def _verify_group(self) -> bool:
        if not self._group_allowed():
            return False
        # Any verified member still in the group, zombies included: a zombie still holds its
        # pid and its place in the group, so the number cannot have been recycled.
        return any(seen.pgid == self.pgid and seen.status in ("alive", "zombie")
                   for seen in self._tracked.values())

    def _scan(self) -> dict[int, procfs.Stat]:
        out: dict[int, procfs.Stat] = {}
        try:
            listed = pids(self.roots)
        except (Absent, Denied):
            return out
        for pid in listed:
            st = self._stat(pid)
            if isinstance(st, procfs.Stat):
                out[pid] = st
        return out

    def _survivor(self, s: _Seen) -> Survivor:
        wchan = None
        if s.status == "alive":
            wchan = self._wchan(s.pid) if s.tid is None else self._task_wchan(s.pid, s.tid)
        return Survivor(pid=s.pid, start_ticks=s.start_ticks, comm=s.comm, state=s.state,
                        wchan=wchan, role=s.role)

    # ------------------------------------------------------------------------------- signals

    def _refuse(self, scope: Literal["pid", "pgid"], ident: int, sig: int | None,
                reason: str) -> None:
        key = (scope, ident, reason)
        if key in self._refused_keys:
            return  # once per identity and reason: the incident log stays readable
        self._refused_keys.add(key)
        self._refused.append(Refusal(at=self.clock.monotonic(), wall=self.clock.time(),
                                     scope=scope, id=ident,
                                     signal=_signame(sig) if sig is not None else None,
                                     reason=reason))

    def _record(self, scope: Literal["pid", "pgid"], ident: int, sig: int, outcome: str) -> None:
        self._signals.append(SignalRecord(at=self.clock.monotonic(), wall=self.clock.time(),
                                          scope=scope, id=ident, signal=_signame(sig),
                                          outcome=outcome))

    def _signal_round(self, alive: list[_Seen], sig: int) -> None:
        """The group once (when verified), then each live process outside it, each once."""
        if self.pgid is not None:
            self._signal_group(sig)
        for s in alive:
            if self._group_ok and s.pgid == self.pgid:
                continue  # the group signal reached it
            self._signal_pid(s, sig)

    def _signal_group(self, sig: int) -> None:
        pgid = self.pgid
        assert pgid is not None
        if pgid <= 1:
            self._refuse("pgid", pgid, sig, f"pgid {pgid} is not a process group to signal")
            return
        if pgid == self._self_pgid:
            self._refuse("pgid", pgid, sig, "the job shares stallwatch's own process group")
            return
        if not self._group_ok:
            self._refuse("pgid", pgid, sig,
                         f"no verified member left in group {pgid}: the number may belong to "
                         "another group now")
            return
        if self.dry_run:
            self._record("pgid", pgid, sig, "dry_run")
            return
        try:
            (self._killpg or os.killpg)(pgid, sig)
            outcome = "sent"
        except ProcessLookupError:
            outcome = "gone"
        except PermissionError:
            outcome = "denied"
        except OSError as exc:
            outcome = f"error: {exc}"
        self._record("pgid", pgid, sig, outcome)

    def _signal_pid(self, s: _Seen, sig: int) -> None:
        if s.pid <= 1 or s.pid == self._self_pid:
            self._refuse("pid", s.pid, sig, "never signalled: init or stallwatch itself")
            return
        if s.status != "alive":
            return  # unreadable: refused when observed
        outcome = self._send(s, sig)
        if outcome is not None:
            self._record("pid", s.pid, sig, outcome)

    def _verify(self, s: _Seen) -> bool:
        """Re-read stat right before the signal; records a refusal when the pid was reused."""
        st = self._stat(s.pid)
        self._refresh(s, st)
        return s.status == "alive"

    def _send(self, s: _Seen, sig: int) -> str | None:
        """Verify and signal one process; the outcome, or None when nothing was attempted."""
        if self.dry_run or self._kill is not None:
            if not self._verify(s):
                return None
            kill = self._kill
            if self.dry_run or kill is None:
                return "dry_run"
            return self._call(lambda: kill(s.pid, sig))
        # The real sender: a pidfd pins the process before the identity check, so the signal
        # cannot reach a process that took the pid over after the check.
        try:
            fd = os.pidfd_open(s.pid)
        except ProcessLookupError:
            self._verify(s)
            return None if s.status != "alive" else "gone"
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.EPERM):
                return f"error: {exc}"
            if not self._verify(s):  # no pidfd here: check, then kill(2)
                return None
            return self._call(lambda: os.kill(s.pid, sig))
        try:
            if not self._verify(s):
                return None
            return self._call(lambda: _signal.pidfd_send_signal(fd, sig))
        finally:
            os.close(fd)

    @staticmethod
    def _call(fn: Callable[[], None]) -> str:
        try:
            fn()
            return "sent"
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "denied"
        except OSError as exc:
            return f"error: {exc}"
