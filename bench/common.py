"""What every bench section shares: CPU and memory meters, statistics, the machine, processes.

CPU is measured, never wall time, wherever a process's cost is meant (the machine is shared and
noisy): a cgroup's cpuacct counter when we may create one (root: nanoseconds, every thread and
child included, exited ones too), else /proc/PID/stat utime+stime summed over the process tree
(clock ticks: 10 ms, so windows are kept long).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator

ROOT = Path(__file__).resolve().parent.parent
# The floor every "× floor" is against, in the one sentence bench/README.md and
# docs/performance.md give too (issue 17); the results carry it (`overhead.floor_is`).
FLOOR_IS = ("bench/floor.py: one plain-Python loop that makes, each tick, the reads stallwatch's "
            "probes make of the same job (the same /proc, /sys, /dev/kmsg, log, disk and outputs "
            "files, kept open and skipped where stallwatch keeps and skips them), parsing only what "
            "walking the job's tree needs, with no models, no rules and no database")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------- statistics

def quantile(xs: list[float], q: float) -> float | None:
    """Nearest-rank quantile (q in 0..1); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, round(q * (len(s) - 1))))
    return s[k]


def summary(xs: Iterable[float], scale: float = 1.0, digits: int = 3) -> dict[str, Any]:
    """n, mean, median, p90, p99, max (each times `scale`, rounded)."""
    v = [float(x) * scale for x in xs]
    if not v:
        return {"n": 0}

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, digits)

    return {"n": len(v), "mean": r(statistics.fmean(v)), "median": r(statistics.median(v)),
            "p90": r(quantile(v, 0.9)), "p99": r(quantile(v, 0.99)), "max": r(max(v)),
            "min": r(min(v))}


def rnd(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


# ---------------------------------------------------------------------------------- machine

def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    du = shutil.disk_usage(os.environ.get("TMPDIR", "/tmp"))
    rev = None
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "host": socket.gethostname(), "nproc": os.cpu_count(), "cpu_model": model,
        "kernel": platform.release(), "python": platform.python_version(),
        "mem_total_gib": round(mem_kb / 2**20, 1), "tmp_free_gib": round(du.free / 2**30, 1),
        "clk_tck": CLK_TCK, "root": os.geteuid() == 0, "git_head": rev,
        "processes_on_host": sum(1 for n in os.listdir("/proc") if n.isdigit()),
    }


# ------------------------------------------------------------------------------- processes

def stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def proc_cpu_s(pid: int) -> float | None:
    """utime+stime of the whole process (all its threads, exited ones too), seconds."""
    f = stat_fields(pid)
    return None if f is None else (int(f[11]) + int(f[12])) / CLK_TCK


def children_of(pid: int) -> list[int]:
    """Direct children, from /proc/PID/task/*/children."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
    except OSError:
        pass
    return out


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo += children_of(p)
    return out


def memory(pid: int) -> dict[str, float | None]:
    """RSS, peak RSS (VmHWM) and PSS, in MiB."""
    out: dict[str, float | None] = {"rss_mib": None, "hwm_mib": None, "pss_mib": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mib"] = round(int(line.split()[1]) / 1024, 1)
            elif line.startswith("VmHWM:"):
                out["hwm_mib"] = round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                out["pss_mib"] = round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return out


def threads_of(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    for p in reversed(tree(pid)):
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_identity(pid: int | None, start_ticks: int | None, sig: int = signal.SIGKILL) -> None:
    """Signal a process only if it is still the one that started at `start_ticks`."""
    if not pid:
        return
    f = stat_fields(pid)
    if f is None or (start_ticks is not None and int(f[19]) != int(start_ticks)):
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL; always reaped."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.terminate()
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


def wait_for(fn: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def python_for(src: Path | None) -> tuple[list[str], dict[str, str]]:
    """(argv prefix, env) that run `python -m stallwatch` from a given source tree (None: ours)."""
    env = dict(os.environ)
    # Other entries stay (a machine whose dependencies sit in a --target directory, as the lent
    # GPU host's); only stallwatch trees are swapped.
    keep = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT and not (Path(p) / "stallwatch" / "__init__.py").exists()]
    if src is None:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *keep])
        return [sys.executable], env
    # Another tree: without site's .pth files (-S), whose editable-install finder would map
    # stallwatch._rules to THIS checkout's rules/ (a baseline judged by our rules, or refusing
    # them); the site directories are put back as plain path entries for the dependencies.
    import site

    sites = [*site.getsitepackages(), site.getusersitepackages()]
    env["PYTHONPATH"] = os.pathsep.join([str(src), *keep, *sites])
    return [sys.executable, "-S"], env


# --------------------------------------------------------------------------------- CPU meters

class CpuMeter:
    """CPU seconds used so far by one measured thing (a process and what it spawns)."""

    how = "none"

    def add(self, pid: int) -> None:
        raise NotImplementedError

    def seconds(self) -> float | None:
        raise NotImplementedError

    def user_sys(self) -> tuple[float, float] | None:
        """CPU seconds in user space and in the kernel, where the meter can tell them apart."""
        return None

    def close(self) -> None:
        pass


class ProcTreeCpu(CpuMeter):
    """/proc/PID/stat utime+stime of a root process plus its live descendants, minus `exclude`.

    Descendants that exit take their CPU with them (it moves to the parent's cutime only when
    reaped): fine for a daemon whose helpers live as long as it does."""

    how = "proc_stat"

    def __init__(self, exclude: Callable[[], set[int]] | None = None) -> None:
        self.roots: list[int] = []
        self.exclude = exclude or (lambda: set())

    def add(self, pid: int) -> None:
        self.roots.append(pid)

    def seconds(self) -> float | None:
        ex = self.exclude()
        total, any_ = 0.0, False
        for r in self.roots:
            for p in tree(r):
                if p in ex:
                    continue
                s = proc_cpu_s(p)
                if s is not None:
                    total += s
                    any_ = True
        return total if any_ else None


def _v1_split(p: Path) -> tuple[float, float]:
    """cpuacct.stat: user and system time in USER_HZ ticks (10 ms: read over a window of minutes)."""
    kv = dict(line.split() for line in (p / "cpuacct.stat").read_text().splitlines())
    hz = os.sysconf("SC_CLK_TCK")
    return int(kv["user"]) / hz, int(kv["system"]) / hz


def _v2_split(p: Path) -> tuple[float, float]:
    kv = dict(line.split() for line in (p / "cpu.stat").read_text().splitlines())
    return int(kv["user_usec"]) / 1e6, int(kv["system_usec"]) / 1e6


class CgroupCpu(CpuMeter):
    """A cgroup of its own (v1 cpuacct or v2), nanosecond CPU of everything moved into it."""

    how = "cgroup"

    def __init__(self, path: Path, usage: Callable[[Path], float], procs: Path, root_procs: Path,
                 split: Callable[[Path], tuple[float, float]] | None = None):
        self.path, self._usage, self._procs, self._root_procs = path, usage, procs, root_procs
        self._split = split

    @classmethod
    def create(cls, name: str) -> CgroupCpu | None:
        if os.geteuid() != 0:
            return None
        tag = f"stallwatch-bench-{name}-{uuid.uuid4().hex[:6]}"
        v1 = Path("/sys/fs/cgroup/cpuacct")
        v2 = Path("/sys/fs/cgroup")
        try:
            if (v1 / "cpuacct.usage").exists():
                d = v1 / tag
                d.mkdir()
                return cls(d, lambda p: int((p / "cpuacct.usage").read_text()) / 1e9,
                           d / "cgroup.procs", v1 / "cgroup.procs", _v1_split)
            if (v2 / "cgroup.controllers").exists():
                d = v2 / tag
                d.mkdir()

                def usage(p: Path) -> float:
                    for line in (p / "cpu.stat").read_text().splitlines():
                        if line.startswith("usage_usec"):
                            return int(line.split()[1]) / 1e6
                    raise OSError("no usage_usec")
                return cls(d, usage, d / "cgroup.procs", v2 / "cgroup.procs", _v2_split)
        except OSError:
            return None
        return None

    def add(self, pid: int) -> None:
        try:
            self._procs.write_text(str(pid))
        except OSError:
            pass  # exited, or a kernel thread

    def seconds(self) -> float | None:
        try:
            return self._usage(self.path)
        except (OSError, ValueError):
            return None

    def user_sys(self) -> tuple[float, float] | None:
        try:
            return self._split(self.path) if self._split else None
        except (OSError, ValueError, KeyError):
            return None

    def close(self) -> None:
        try:
            pids = self._procs.read_text().split()
        except OSError:
            pids = []
        for p in pids:
            try:
                self._root_procs.write_text(p)
            except OSError:
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def cpu_meter(name: str, pid: int, *, exclude: Callable[[], set[int]] | None = None,
              use_cgroup: bool = True) -> CpuMeter:
    """A cgroup meter when possible (root), else /proc/PID/stat over the process tree."""
    m: CpuMeter | None = CgroupCpu.create(name) if use_cgroup else None
    if m is None:
        m = ProcTreeCpu(exclude)
    m.add(pid)
    if isinstance(m, CgroupCpu):
        for p in tree(pid)[1:]:
            m.add(p)
    return m


# ------------------------------------------------------------------------------ state database

def db_query(state_dir: Path, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
    path = Path(state_dir) / "stallwatch.db"
    if not path.exists():
        return []
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return []
    try:
        cur = conn.execute(sql, args)
        return [{d[0]: v for d, v in zip(cur.description, r, strict=True)} for r in cur.fetchall()]
    except sqlite3.Error:
        return []
    finally:
        conn.close()


def db_meta(state_dir: Path) -> dict[str, str]:
    return {r["key"]: r["value"] for r in db_query(state_dir, "SELECT key, value FROM meta")}


def start_daemon(config: Path, log: Path, *, src: Path | None = None,
                 cwd: Path | None = None) -> subprocess.Popen:
    argv, env = python_for(src)
    with open(log, "ab") as out:
        return subprocess.Popen([*argv, "-m", "stallwatch", "run", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(cwd or config.parent), env=env, start_new_session=True)


@contextmanager
def workdir(name: str, keep: bool = False) -> Iterator[Path]:
    base = Path(os.environ.get("STALLWATCH_BENCH_TMP", "/tmp"))
    d = base / f"stallwatch-bench-{name}-{uuid.uuid4().hex[:6]}"
    d.mkdir(parents=True)
    try:
        yield d
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


def emit(obj: Any, path: Path | None) -> None:
    """A standalone bench script's result: printed as JSON, and written to `path` when given."""
    text = json.dumps(obj, indent=1)
    print(text)
    if path:
        path.write_text(text + "\n")


def dump(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")
