"""Fault rigs: the extraction-like job (tests/jobs/extract_like.py) put in real trouble.

Each rig is a context manager that starts the job healthy and yields a `Rig`: its pid, log,
outputs directory, server URL, mount and device, whatever the fault involves. `rig.fault()` makes
the fault happen (freezes the filesystem, stops the server) or waits for the job to walk into it
(`--deadlock-at N` ...), and returns once the fault is visible in /proc, with `rig.fault_wall`
set to when it began. Everything is undone in `finally`: the filesystem thawed (a timer thaws it
anyway after `max_frozen_s`), processes killed, the loop device detached, the cgroup removed.

    with faultrigs.deadlock(at=10) as rig:
        rig.fault()                       # all three threads asleep in futex
        ... stallwatch diagnose --pid rig.pid --log rig.log ...

Used by tests/test_live_faults.py and by tools/record_fault_traces.py, which records the golden
traces replayed in tests/test_golden_traces.py. Linux only; most rigs need root.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rigs import (
    RigUnavailable,
    cpu_hogs,
    loop_ext4,
    memory_cgroup,
    pin,
    shared_core,
    spawned,
    task_state,
    thread_ids,
    wait_for_state,
    wait_until,
)

from stallwatch.kernel.procfs import parse_syscall

JOBS = Path(__file__).resolve().parent / "jobs"
JOB = JOBS / "extract_like.py"
SERVER = JOBS / "toy_server.py"

SAMPLE_S = 0.2  # the job's cadence: well under the contract's 1 s, so the 20 s floor applies
N_SAMPLES = 3000  # 10 minutes at 5/s: never finishes while a test watches it, and its outputs
                  # (~200 MB) fit small CI disks, so no disk-fill forecast muddies a verdict
_PROGRESS = re.compile(rb"\| (\d+)/(\d+) \[")


@dataclass
class Rig:
    name: str
    proc: subprocess.Popen
    work: Path
    log: Path
    out: Path
    at: int | None = None  # the sample count at which an in-job fault starts
    server: str | None = None
    server_proc: subprocess.Popen | None = None
    mount: Path | None = None
    device: str | None = None
    cgroup: Path | None = None
    fault_wall: float | None = None  # Unix time the fault began
    phases: dict[str, float] = field(default_factory=dict)  # more wall times: "exit", ...
    _fault: Callable[[Rig, float], None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def server_port(self) -> int | None:
        return int(self.server.rsplit(":", 1)[1]) if self.server else None

    # -- what the log says

    def log_bytes(self) -> bytes:
        try:
            return self.log.read_bytes()
        except FileNotFoundError:
            return b""

    def progress(self) -> int | None:
        """The last `done` the bar shows, None before the first bar."""
        hits = _PROGRESS.findall(self.log_bytes()[-4096:])
        return int(hits[-1][0]) if hits else None

    def log_mtime(self) -> float:
        return self.log.stat().st_mtime

    def log_age(self) -> float:
        """Seconds since the job last wrote to its log: how long a stall has lasted."""
        return time.time() - self.log_mtime()

    def wait_progress(self, n: int, timeout: float = 30.0) -> int:
        def reached() -> int | None:
            if self.proc.poll() is not None and (self.progress() or 0) < n:
                tail = self.log_bytes()[-600:].decode("utf-8", "replace")
                raise RuntimeError(f"{self.name}: the job exited ({self.proc.returncode}) before "
                                   f"progress {n}; log ends: {tail!r}")
            done = self.progress()
            return done if done is not None and done >= n else None
        return wait_until(reached, timeout, f"{self.name}: progress {n} in {self.log}")

    def wait_log(self, text: str, timeout: float = 30.0) -> float:
        """Wait for `text` in the log; returns the log's mtime once it is there."""
        wait_until(lambda: text.encode() in self.log_bytes(), timeout, f"{text!r} in {self.log}")
        return self.log_mtime()

    # -- the fault

    def fault(self, timeout: float = 60.0) -> float:
        """Make the fault happen, or wait for the job to reach it; returns fault_wall."""
        if self._fault is None:
            raise ValueError(f"rig {self.name} has no fault")
        if self.fault_wall is None:
            self._fault(self, timeout)
        assert self.fault_wall is not None
        return self.fault_wall

    def wait_in_job_fault(self, timeout: float) -> None:
        """For --X-at faults: the bar reaches `at`, and that last progress write is the onset."""
        assert self.at is not None
        wait_until(lambda: self.progress() == self.at, timeout,
                   f"{self.name}: the bar to show {self.at} (now {self.progress()})")
        self.fault_wall = self.log_mtime()

    def wait_exit(self, timeout: float) -> int:
        """Wait until the job is a zombie or gone; we never reap it here, so its status stays
        readable in /proc/PID/stat for the watchdog, as it is while a parent has not waited."""
        wait_until(lambda: task_state(self.pid) in ("Z", "X", None), timeout,
                   f"{self.name}: pid {self.pid} to exit (state {task_state(self.pid)})")
        self.phases["exit"] = time.time()
        return self.pid

    def reap(self, timeout: float = 10.0) -> int:
        """Reap the job (as a shell would): its pid is gone from /proc afterwards."""
        return self.proc.wait(timeout)

    def facts(self) -> dict:
        """What the rig knows independently of stallwatch, for tests to check evidence against."""
        return {
            "rig": self.name, "pid": self.pid, "log": str(self.log), "outputs": str(self.out),
            "at": self.at, "n": N_SAMPLES, "sample_s": SAMPLE_S, "server": self.server,
            "server_pid": self.server_proc.pid if self.server_proc else None,
            "server_port": self.server_port, "mount": str(self.mount) if self.mount else None,
            "device": self.device, "cgroup": str(self.cgroup) if self.cgroup else None,
        }


# ------------------------------------------------------------------------------------ building


def job_argv(out: Path, log: Path, *extra: str, n: int = N_SAMPLES,
             sample_s: float = SAMPLE_S) -> list[str]:
    return [sys.executable, str(JOB), "--out", str(out), "--log", str(log), "--n", str(n),
            "--sample-s", str(sample_s), *extra]


@contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` (made here), lazily unmounted after. The test is
    skipped, with the reason, where it cannot be mounted (not root, no mount(8))."""
    import pytest

    where.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill_up(path: Path) -> None:
    """Write zeros to a new file `path` until its filesystem is full (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC)
    try:
        while os.write(fd, b"\0" * 65536):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def _workdir(name: str) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix=f"stallwatch-rig-{name}-"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def _job(name: str, *extra: str, out: Path | None = None, wrap: Sequence[str] = (),
         at: int | None = None, fault: Callable[[Rig, float], None] | None = None,
         **rig_kw) -> Iterator[Rig]:
    with _workdir(name) as work:
        log = work / "extract.log"
        out = out or work / "hidden_states"
        argv = [*wrap, *job_argv(out, log, *extra)]
        with spawned(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL) as proc:
            rig = Rig(name=name, proc=proc, work=work, log=log, out=out, at=at, _fault=fault,
                      **rig_kw)
            rig.wait_progress(1)
            yield rig


def _await_in_job(check: Callable[[Rig], bool], what: str) -> Callable[[Rig, float], None]:
    def fault(rig: Rig, timeout: float) -> None:
        rig.wait_in_job_fault(timeout)
        wait_until(lambda: check(rig), timeout, f"{rig.name}: {what}")
    return fault


# ---------------------------------------------------------------------------------------- rigs


@contextmanager
def healthy(**_: object) -> Iterator[Rig]:
    """The job as it should be: a sample every 0.2 s, a file per sample, no fault."""
    with _job("healthy") as rig:
        yield rig


def _deadlocked(rig: Rig) -> bool:
    tids = thread_ids(rig.pid)
    return len(tids) == 3 and all(task_state(rig.pid, t) == "S" for t in tids)


@contextmanager
def deadlock(at: int = 10, **_: object) -> Iterator[Rig]:
    """Two threads take two locks in opposite order; the main thread joins them: all in S."""
    with _job("deadlock", "--deadlock-at", str(at), at=at,
              fault=_await_in_job(_deadlocked, "all three threads asleep")) as rig:
        yield rig


@contextmanager
def busy_loop(at: int = 10, hogs: int = 1, **_: object) -> Iterator[Rig]:
    """The main thread spins on a flag no one sets: state R, no progress. It shares one core
    with `hogs` CPU hogs, as on a loaded node: it gets a fraction of the core, not 100 %."""
    core = shared_core()
    with cpu_hogs(core, hogs), _job("busy_loop", "--spin-at", str(at), at=at, fault=_await_in_job(
            lambda r: task_state(r.pid) == "R", "the loop running")) as rig:
        pin(rig.pid, core)
        rig.phases["core"] = core
        yield rig


@contextmanager
def crash(at: int = 10, **_: object) -> Iterator[Rig]:
    """An exception at sample `at`: traceback in the log, exit code 1 (left unreaped)."""
    def fault(rig: Rig, timeout: float) -> None:
        wait_until(lambda: rig.progress() == rig.at, timeout, f"crash: the bar to show {rig.at}")
        rig.wait_exit(timeout)
        # The traceback is the job's last write: the exit follows it within milliseconds.
        rig.fault_wall = rig.log_mtime()
    with _job("crash", "--crash-at", str(at), at=at, fault=fault) as rig:
        yield rig


# -- OOM in a memory cgroup


@contextmanager
def oom(at: int = 10, limit_mb: int = 96, **_: object) -> Iterator[Rig]:
    """From sample `at` the job allocates until the cgroup's limit: the kernel kills it (-9)."""
    def fault(rig: Rig, timeout: float) -> None:
        rig.wait_in_job_fault(timeout)  # the onset: it starts to eat memory
        rig.phases["oom_start"] = rig.fault_wall
        rig.wait_exit(timeout)
        rig.fault_wall = rig.phases["exit"]  # the fault, for a crash, is the death
    with memory_cgroup(limit_mb << 20) as cg:
        # The shell moves itself into the cgroup, then execs the job: same pid, no race.
        wrap = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg / "cgroup.procs")]
        with _job("oom", "--oom-at", str(at), wrap=wrap, at=at, fault=fault, cgroup=cg) as rig:
            yield rig


# -- a frozen filesystem under the writer


@contextmanager
def fsfreeze(size_mb: int = 64, max_frozen_s: float = 110.0, **_: object) -> Iterator[Rig]:
    """The job writes its outputs onto a loop-mounted ext4; fault() freezes it (fsfreeze -f): the
    writer blocks in D (percpu_rwsem_wait, openat or write). The log stays on a live disk. Thawed
    at the end, or by a timer after max_frozen_s (under the kernel's 120 s hung-task report)."""
    missing = [t for t in ("losetup", "mkfs.ext4", "fsfreeze", "mount", "umount") if not shutil.which(t)]
    if os.geteuid() != 0:
        raise RigUnavailable("the fsfreeze rig needs root (loop devices, mount, fsfreeze)")
    if missing:
        raise RigUnavailable(f"the fsfreeze rig needs {', '.join(missing)} (util-linux, e2fsprogs)")
    with loop_ext4(size_mb) as fs:  # its own finally thaws, unmounts, detaches
        timers: list[threading.Timer] = []

        def fault(rig: Rig, timeout: float) -> None:
            fs.freeze()
            rig.fault_wall = time.time()
            safety = threading.Timer(max_frozen_s, fs.thaw)
            safety.daemon = True
            safety.start()
            timers.append(safety)
            wait_for_state(rig.pid, "D", timeout)

        try:
            with _job("fsfreeze", out=fs.mnt / "hidden_states", fault=fault, mount=fs.mnt,
                      device=fs.dev) as rig:
                try:
                    yield rig
                finally:
                    fs.thaw()  # first, so the SIGKILL that follows takes effect at once
        finally:
            for t in timers:
                t.cancel()


# -- a stopped inference server


@contextmanager
def toy_server() -> Iterator[tuple[subprocess.Popen, str]]:
    with spawned([sys.executable, str(SERVER)], stdin=subprocess.DEVNULL,
                 stdout=subprocess.PIPE) as srv:
        assert srv.stdout is not None
        line = srv.stdout.readline().decode()
        m = re.match(r"listening on (\d+)", line)
        if not m:
            raise RuntimeError(f"toy server did not start: {line!r}")
        try:
            yield srv, f"http://127.0.0.1:{m[1]}"
        finally:
            try:
                os.kill(srv.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _in_recvfrom(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return parse_syscall(f.read()).name == "recvfrom"
    except (OSError, ValueError):
        return False


@contextmanager
def server_stopped(**_: object) -> Iterator[Rig]:
    """The job POSTs every sample to a loopback server; fault() SIGSTOPs the server. It still
    accepts connections in the kernel, so the client blocks in recvfrom on its socket."""
    def fault(rig: Rig, timeout: float) -> None:
        assert rig.server_proc is not None
        os.kill(rig.server_proc.pid, signal.SIGSTOP)
        rig.fault_wall = time.time()
        wait_for_state(rig.server_proc.pid, "T", timeout)
        wait_until(lambda: _in_recvfrom(rig.pid), timeout,
                   f"pid {rig.pid} to block in recvfrom on the server's socket")

    with toy_server() as (srv, url), _job("server_stopped", "--server", url, fault=fault,
                                          server=url, server_proc=srv) as rig:
        yield rig


# -- a long checkpoint write


@contextmanager
def checkpoint(at: int = 10, seconds: float = 45.0, **_: object) -> Iterator[Rig]:
    """At sample `at` the job writes a checkpoint for `seconds`: I/O counters move, no progress
    line. fault() returns when it starts; the log says "checkpoint saved" when it is over."""
    def fault(rig: Rig, timeout: float) -> None:
        rig.fault_wall = rig.wait_log("saving checkpoint", timeout)

    with _job("checkpoint", "--checkpoint-every", str(at), "--checkpoint-s", str(seconds),
              at=at, fault=fault) as rig:
        yield rig


RIGS: dict[str, Callable[..., AbstractContextManager[Rig]]] = {
    "healthy": healthy,
    "deadlock": deadlock,
    "busy_loop": busy_loop,
    "crash": crash,
    "oom": oom,
    "fsfreeze": fsfreeze,
    "server_stopped": server_stopped,
    "checkpoint": checkpoint,
}
