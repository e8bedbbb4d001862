"""Test rigs: real processes in real kernel states, loop-mounted filesystems, fake /proc trees.

Import as `from rigs import ...` (pytest puts tests/ on sys.path). Every rig cleans up in its
own `finally`, and the frozen filesystem also thaws itself from a timer thread: a test stuck in
an uninterruptible wait would never reach its `finally`, and a filesystem left frozen hangs every
later writer on the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Callable, Iterator

import pytest

from stallwatch.kernel import proc
from stallwatch.kernel.roots import Absent, Denied, Roots

T = TypeVar("T")


@pytest.fixture
def root() -> None:
    """Use in tests marked @pytest.mark.root: skips, saying why, when not running as root."""
    if os.geteuid() != 0:
        pytest.skip("needs root (loop devices, mount, fsfreeze, /proc/PID/stack)")
    tools = ("losetup", "mkfs.ext4", "fsfreeze", "mount", "umount")
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (util-linux, e2fsprogs)")


# ------------------------------------------------------------------------------------ polling


def wait_until(probe: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Poll `probe` until it returns something truthy; raise TimeoutError saying what we awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)


def task_state(pid: int, tid: int | None = None) -> str | None:
    """The state letter of a task, None once it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rfind(")") + 2]


def wait_for_state(pid: int, states: str, timeout: float = 10.0, tid: int | None = None) -> str:
    """Wait until the task's state letter is one of `states` (e.g. "D" or "SD")."""
    return wait_until(lambda: (s := task_state(pid, tid)) in tuple(states) and s,
                      timeout, f"pid {pid}{f'/{tid}' if tid else ''} to enter state {states} "
                               f"(now {task_state(pid, tid)})")


def thread_ids(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


@dataclass(frozen=True)
class LiveProcess:
    pid: int
    ppid: int
    state: str  # the leader's state letter: "Z" only for a zombie leader with a live thread
    argv: tuple[bytes, ...]


def live_processes(marker: str) -> list[LiveProcess]:
    """Every live process but this one whose command line names `marker` (a test's unique temp
    path), by pid, read through the package's own /proc layer (kernel/proc.py). A zombie is gone,
    except a zombie leader with a thread still alive (a writer thread in D outlives its main
    thread): its files are still open, so it still counts, as it does for stallwatch's kill."""
    want, me, out = os.fsencode(marker), os.getpid(), []
    for pid in proc.pids():
        if pid == me:
            continue
        p = proc.Proc(pid)
        try:
            argv = p.argv_bytes()
            if want not in b"\0".join(argv):
                continue
            st = p.stat()
        except (Absent, Denied, OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        if st.state in proc.DEAD_STATES and p.live_thread() is None:
            continue
        out.append(LiveProcess(pid, st.ppid, st.state, argv))
    return out


def kill_naming(marker: str) -> None:
    """SIGCONT (a stopped process cannot die) then SIGKILL to every process naming `marker`.
    Supervised jobs run in sessions of their own on purpose (a daemon's death never kills its
    job), so this is how a test leaves nothing of its own behind."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        for p in live_processes(marker):
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------------------- processes


def _reap_later(proc: subprocess.Popen) -> None:
    # A task in D keeps a pending SIGKILL until its I/O returns (a frozen fs thaws): reap it
    # whenever that happens rather than block the test's cleanup on it.
    threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


@contextmanager
def spawned(argv: list[str], **popen_kw) -> Iterator[subprocess.Popen]:
    """A child in its own session; killed with its whole process group on exit."""
    proc = subprocess.Popen(argv, start_new_session=True, **popen_kw)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if task_state(proc.pid) == "D":
            _reap_later(proc)  # it dies only once its I/O returns: don't wait for that here
        else:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _reap_later(proc)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream:
                stream.close()


# Two threads each take one lock, meet at a barrier, then want the other's lock: a true deadlock
# with every thread blocked in futex, no timeouts, no wakeups.
DEADLOCK = """
import sys, threading
a, b = threading.Lock(), threading.Lock()
met = threading.Barrier(3)
def grab(first, second):
    with first:
        met.wait()
        with second:
            pass
ts = [threading.Thread(target=grab, args=(a, b)), threading.Thread(target=grab, args=(b, a))]
for t in ts:
    t.start()
met.wait()
print("ready", flush=True)
for t in ts:
    t.join()
"""


@contextmanager
def spawn_in_state(state: str, *, where: Path | None = None, argv: list[str] | None = None,
                   timeout: float = 10.0) -> Iterator[subprocess.Popen]:
    """A real process in kernel state R, S, T, Z or D, yielded once /proc shows it there.

    R: a busy loop. S: a two-lock deadlock (all three threads in futex). T: SIGSTOPped sleep.
    Z: an exited child of ours (`argv`, default `true`), reaped only when the block ends.
    D: a shell whose open(O_CREAT) in `where` blocks; `where` must be a frozen mount (see
    frozen_ext4).
    """
    if state == "Z":
        proc = subprocess.Popen(argv or ["true"])
        try:
            wait_for_state(proc.pid, "Z", timeout)
            yield proc
        finally:
            proc.wait()
        return
    argv = argv or {
        "R": [sys.executable, "-c", "while True: pass"],
        "S": [sys.executable, "-c", DEADLOCK],
        "T": ["sleep", "1000"],
        "D": ["sh", "-c", 'echo stuck > "$1/stuck"', "sh", str(where)],
    }[state]
    if state == "D" and where is None:
        raise ValueError("state D needs `where`, a frozen mount directory")
    with spawned(argv, stdout=subprocess.PIPE if state == "S" else None) as proc:
        if state == "S":
            # The threads print nothing once deadlocked; "ready" says both locks are taken.
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else b""
            if line != b"ready\n":
                raise TimeoutError(f"deadlock script did not get ready: {line!r}")
            wait_until(lambda: all(task_state(proc.pid, t) == "S" for t in thread_ids(proc.pid)),
                       timeout, "all threads of the deadlock to sleep")
        elif state == "T":
            wait_for_state(proc.pid, "S", timeout)  # sleeping in nanosleep: exec is done
            os.kill(proc.pid, signal.SIGSTOP)
        wait_for_state(proc.pid, state, timeout)
        yield proc


# ------------------------------------------------------------------------- loop-mounted ext4


class RigUnavailable(RuntimeError):
    """The machine cannot provide the rig (no loop device, mount refused): skip, don't fail."""


def enter_or_skip(stack: contextlib.ExitStack, rig: AbstractContextManager[T]) -> T:
    """Enter `rig` on `stack`, or skip the test saying why this machine cannot provide it."""
    try:
        return stack.enter_context(rig)
    except RigUnavailable as e:
        pytest.skip(f"rig unavailable here: {e}")


def _run(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RigUnavailable(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r.stdout.strip()


@dataclass
class Ext4:
    mnt: Path
    dev: str
    frozen: bool = False

    def freeze(self) -> None:
        _run("fsfreeze", "-f", str(self.mnt))
        self.frozen = True

    def thaw(self) -> None:
        # Idempotent, and safe from the safety timer's thread: fsfreeze -u on a thawed fs fails
        # with EINVAL, which is the state we want anyway.
        if self.frozen:
            subprocess.run(["fsfreeze", "-u", str(self.mnt)], capture_output=True, timeout=30)
            self.frozen = False


@contextmanager
def loop_ext4(size_mb: int = 16) -> Iterator[Ext4]:
    """A fresh ext4 image, attached to a loop device and mounted in a temp dir."""
    base = Path(tempfile.mkdtemp(prefix="stallwatch-ext4-"))
    img, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir()
    dev = None
    mounted = False
    fs = None
    try:
        with open(img, "wb") as f:
            f.truncate(size_mb << 20)
        _run("mkfs.ext4", "-q", "-F", str(img))
        dev = _run("losetup", "--find", "--show", str(img))
        _run("mount", "-t", "ext4", dev, str(mnt))
        mounted = True
        fs = Ext4(mnt=mnt, dev=dev)
        yield fs
    finally:
        if fs is not None:
            fs.thaw()
        if mounted:
            _umount(mnt)
        if dev:
            subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=30)
        shutil.rmtree(base, ignore_errors=True)


def _umount(mnt: Path, timeout: float = 10.0) -> None:
    # Writers killed while the fs was frozen exit only after the thaw, and until then they keep
    # files open (EBUSY): retry for a while, then detach lazily so the loop device can go.
    deadline = time.monotonic() + timeout
    while subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
        if time.monotonic() > deadline:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
            return
        time.sleep(0.05)


@contextmanager
def frozen_ext4(size_mb: int = 16, max_frozen_s: float = 60.0) -> Iterator[tuple[Path, str]]:
    """(mount dir, loop device) of a loop-mounted ext4 frozen with fsfreeze -f.

    Any writer there blocks in D (wchan percpu_rwsem_wait) until the block ends, which thaws,
    unmounts and detaches. Start writers inside this block so they are killed before the thaw.
    After max_frozen_s a timer thaws it anyway.
    """
    with loop_ext4(size_mb) as fs:
        fs.freeze()
        timer = threading.Timer(max_frozen_s, fs.thaw)
        timer.daemon = True
        timer.start()
        try:
            yield fs.mnt, fs.dev
        finally:
            timer.cancel()
            fs.thaw()


# ------------------------------------------------------------------------- captured roots

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# One root per capture, laid out as the kernel shows it (proc/, sys/, dev/kmsg): read it with
# Roots.under(root). tests/fixtures/README.md says what each holds and how it was captured.
HOST1 = FIXTURES / "host1"
OOM_MEMCG_V1 = FIXTURES / "oom_memcg_v1"


def capture_copy(root: Path, dest: Path) -> Path:
    """A writable copy of a captured root (links kept as links), for tests that append to its
    kernel log or change its files; the capture itself is never written."""
    shutil.copytree(root, dest, symlinks=True)
    return dest


# ------------------------------------------------------------------------- memory cgroup


@contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A fresh memory cgroup (v1 memory controller, or v2 with +memory), removed after; a real
    OOM kill happens in it. RigUnavailable where the machine has none (enter_or_skip)."""
    name = f"stallwatch-rig-{uuid.uuid4().hex[:8]}"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    if os.geteuid() != 0:
        raise RigUnavailable("a memory cgroup needs root")
    if (v1 / "memory.limit_in_bytes").exists():
        cg = v1 / name
        limits = [("memory.limit_in_bytes", limit_bytes), ("memory.memsw.limit_in_bytes", limit_bytes)]
    elif (v2 / "cgroup.subtree_control").exists() and \
            "memory" in (v2 / "cgroup.subtree_control").read_text().split():
        cg = v2 / name
        limits = [("memory.max", limit_bytes), ("memory.swap.max", 0)]
    else:
        raise RigUnavailable("no memory cgroup controller (neither v1 memory nor v2 with +memory)")
    try:
        cg.mkdir()
    except OSError as e:  # a container's read-only or delegated cgroup tree
        raise RigUnavailable(f"cannot create a memory cgroup {cg}: {e}") from e
    try:
        for fname, value in limits:
            if (cg / fname).exists():  # memsw/swap files exist only with swap accounting
                (cg / fname).write_text(str(value))
        yield cg
    finally:
        rmdir_cgroup(cg)


def rmdir_cgroup(cg: Path, timeout_s: float = 10.0) -> None:
    """Remove a cgroup whose tasks are being killed: EBUSY until the last one is fully gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ------------------------------------------------------------------------------ fake /proc


class FakeProc:
    """A synthetic /proc tree for probe tests where pids must come, go and be reused at will.

    Only what the processes probe reads is written; each task gets stat, status, wchan and
    syscall, and the process cmdline, io and an empty fd dir.
    """

    def __init__(self, base: Path, btime: int = 1_700_000_000) -> None:
        self.base = Path(base)
        self.proc = self.base / "proc"
        self.proc.mkdir(parents=True, exist_ok=True)
        (self.proc / "stat").write_text(f"cpu  1 0 1 100 0 0 0 0 0 0\nbtime {btime}\n")
        self.roots = Roots.under(self.base)

    def add(self, pid: int, *, comm: str = "job", state: str = "S", ppid: int = 1,
            start_ticks: int = 1000, cmdline: tuple[str, ...] = ("job",),
            tids: tuple[int, ...] = (),
            utime: int = 0, stime: int = 0, ctx: tuple[int, int] = (1, 1), rchar: int = 0,
            wchan: str = "do_wait", syscall: str = "61 0x1 0x2 0x3 0x4 0x5 0x6 0x7 0x8",
            exit_code: int = 0, cpu: int = 0) -> None:
        d = self.proc / str(pid)
        if d.exists():
            shutil.rmtree(d)
        (d / "fd").mkdir(parents=True)
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in cmdline))
        (d / "io").write_text(f"rchar: {rchar}\nwchar: 0\nsyscr: 0\nsyscw: 0\nread_bytes: 0\n"
                              "write_bytes: 0\ncancelled_write_bytes: 0\n")
        for tid in (pid, *tids):
            t = d / "task" / str(tid)
            t.mkdir(parents=True)
            for target in (t, d) if tid == pid else (t,):
                (target / "stat").write_text(self.stat_line(
                    tid, comm, state, ppid, pid, utime, stime, 1 + len(tids), start_ticks,
                    exit_code, cpu))
                (target / "status").write_text(
                    f"Name:\t{comm}\nState:\t{state}\nTgid:\t{pid}\nPid:\t{tid}\nPPid:\t{ppid}\n"
                    f"Uid:\t0\t0\t0\t0\nVmRSS:\t    1024 kB\nThreads:\t{1 + len(tids)}\n"
                    f"voluntary_ctxt_switches:\t{ctx[0]}\nnonvoluntary_ctxt_switches:\t{ctx[1]}\n")
                (target / "wchan").write_text(wchan)
                (target / "syscall").write_text(syscall + "\n")

    def remove(self, pid: int) -> None:
        shutil.rmtree(self.proc / str(pid))

    @staticmethod
    def stat_line(pid: int, comm: str, state: str, ppid: int, pgid: int, utime: int, stime: int,
                  num_threads: int, start_ticks: int, exit_code: int = 0, cpu: int = 0) -> str:
        fields = ["0"] * 52  # fields 1..52 of proc(5), 0-based here
        fields[0], fields[1], fields[2] = str(pid), f"({comm})", state
        fields[3], fields[4], fields[5] = str(ppid), str(pgid), str(pgid)
        fields[13], fields[14], fields[19] = str(utime), str(stime), str(num_threads)
        fields[21], fields[38], fields[51] = str(start_ticks), str(cpu), str(exit_code)
        return " ".join(fields) + "\n"


@contextmanager
def dead_fuse_mount() -> Iterator[tuple[Path, Callable[[], None]]]:
    """(mount dir, abort) of a FUSE mount whose daemon never answers, like a dead NFS server:
    every statvfs, stat or lookup on it blocks in the kernel. We hold /dev/fuse and never read
    it, so the kernel's INIT is never answered and every request waits for it. abort() closes
    the fd, which aborts the connection: blocked calls fail with ENOTCONN, and the mount can go.

    Outside pytest's tmp_path on purpose: pytest's cleanup of old runs must never walk into it.
    """
    mnt = Path(tempfile.mkdtemp(prefix="stallwatch-deadfuse-"))
    fd = os.open("/dev/fuse", os.O_RDWR)
    closed = False

    def abort() -> None:
        nonlocal closed
        if not closed:
            closed = True
            os.close(fd)

    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    mounted = libc.mount(b"stallwatch-dead", str(mnt).encode(), b"fuse", 0, opts) == 0
    err = ctypes.get_errno()
    try:
        if not mounted:
            pytest.skip(f"cannot mount FUSE here: {os.strerror(err)}")
        yield mnt, abort
    finally:
        abort()  # first, so that the unmount below cannot block
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=60)
        os.rmdir(mnt)


# ------------------------------------------------------------------------------- CPU contention

HOG = "while True: pass"


def shared_core() -> int:
    """The CPU the contention tests crowd: the last one this process may run on."""
    return max(os.sched_getaffinity(0))


def pin(pid: int, core: int) -> None:
    """Pin every thread of pid (threads started later inherit the main thread's mask)."""
    for tid in thread_ids(pid):
        try:
            os.sched_setaffinity(tid, {core})
        except ProcessLookupError:
            pass


@contextmanager
def cpu_hogs(core: int, n: int = 1) -> Iterator[list[subprocess.Popen]]:
    """n busy loops pinned to `core`: whatever else is pinned there gets a fraction of it, as a
    job does on a loaded node. Killed on exit."""
    with contextlib.ExitStack() as stack:
        hogs = [stack.enter_context(spawned([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL))
                for _ in range(n)]
        for h in hogs:
            pin(h.pid, core)
        yield hogs


# -------------------------------------------------------------------- the daemon's state db


def query_state(state_dir: Path, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
    """Rows of a daemon's state database (STATE_DIR/stallwatch.db), read-only, as dicts in column
    order; [] while there is none yet or it cannot be read yet: a daemon under load creates the
    file well before its tables ("no such table"), and a test that polls must not take that
    moment for an answer. Assertions on a database at rest read it the same way."""
    db = Path(state_dir) / "stallwatch.db"
    if not db.exists():
        return []
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        cur = conn.execute(sql, args)
        return [{d[0]: v for d, v in zip(cur.description, row, strict=True)} for row in cur.fetchall()]
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


# ------------------------------------------------------------------------- one-shot diagnosis

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Diagnosis:
    argv: list[str]
    rc: int
    doc: dict
    stderr: str
    took_s: float

    @property
    def kind(self) -> str:
        return self.doc["verdict"]["kind"]

    def evidence(self, signal: str) -> list[str]:
        return [e["detail"] for e in self.doc["verdict"].get("evidence", ()) if e["signal"] == signal]

    def __str__(self) -> str:  # what an assertion failure shows
        v = self.doc.get("verdict", {})
        ev = "\n  ".join(f"{e['signal']}: {e['detail']}" for e in v.get("evidence", []))
        return (f"rc {self.rc}, {v.get('kind')} ({v.get('rule')}): {v.get('summary')}\n  {ev}\n"
                f"warnings: {self.doc.get('warnings')}\nstderr: {self.stderr[-2000:]}")


def run_diagnose(args: list[str], timeout: float = 120) -> Diagnosis:
    """`stallwatch diagnose --json ARGS` in a subprocess, as a user or a Nagios check runs it."""
    argv = [sys.executable, "-m", "stallwatch", "diagnose", "--json", *args]
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                       check=False, env=dict(os.environ, PYTHONPATH=str(REPO)))
    took = time.monotonic() - t0
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = {"verdict": {"kind": None}, "stdout": r.stdout[-2000:]}
    return Diagnosis(argv, r.returncode, doc, r.stderr, took)
