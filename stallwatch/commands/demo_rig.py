"""The rig under `stallwatch demo` (commands/demo.py): the loop-mounted filesystem that the
io_stall fault freezes, the server's model choice, and what the demo reads of the job from outside
(its progress line, its live writers)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

from stallwatch.kernel.proc import DEAD_STATES, Proc, pids
from stallwatch.kernel.roots import Absent, Denied


JOB = "extract"


class DemoUnavailable(Exception):
    """The demo cannot run this fault here (exit 3)."""



def _run(*argv: str, timeout: float = 30.0) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise DemoUnavailable(f"{' '.join(argv)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout.strip()


class LoopFS:
    """A fresh ext4 image on a loop device, mounted under `base`; freeze/thaw with fsfreeze.

    A safety timer thaws it after `max_frozen_s` whatever happens: a filesystem left frozen
    hangs every later writer on the machine.
    """

    TOOLS = ("losetup", "mkfs.ext4", "fsfreeze", "mount", "umount")

    def __init__(self, base: Path, size_mb: int = 32, max_frozen_s: float = 120.0) -> None:
        self.base = base
        self.img = base / "outputs.img"
        self.mnt = base / "mnt"
        self.size_mb = size_mb
        self.max_frozen_s = max_frozen_s
        self.dev: str | None = None
        self.mounted = False
        self.frozen = False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    @classmethod
    def check(cls) -> None:
        if os.geteuid() != 0:
            raise DemoUnavailable("--fault io_stall needs root: it loop-mounts an ext4 image and "
                                  "freezes it with fsfreeze (run it with sudo, or pick another "
                                  "fault: hang, crash, server_hang)")
        missing = [t for t in cls.TOOLS if shutil.which(t) is None]
        if missing:
            raise DemoUnavailable(f"--fault io_stall needs {', '.join(missing)} "
                                  "(util-linux, e2fsprogs)")

    def setup(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        with open(self.img, "wb") as f:
            f.truncate(self.size_mb << 20)
        _run("mkfs.ext4", "-q", "-F", str(self.img))
        self.dev = _run("losetup", "--find", "--show", str(self.img))
        _run("mount", "-t", "ext4", self.dev, str(self.mnt))
        self.mounted = True

    def freeze(self) -> None:
        _run("fsfreeze", "-f", str(self.mnt))
        with self._lock:
            self.frozen = True
        self._timer = threading.Timer(self.max_frozen_s, self.thaw)
        self._timer.daemon = True
        self._timer.start()

    def thaw(self) -> None:
        with self._lock:
            if not self.frozen:
                return
            subprocess.run(["fsfreeze", "-u", str(self.mnt)], capture_output=True, timeout=30)
            self.frozen = False
        if self._timer is not None:
            self._timer.cancel()

    def teardown(self) -> None:
        self.thaw()
        if self.mounted:
            deadline = time.monotonic() + 10.0
            while subprocess.run(["umount", str(self.mnt)], capture_output=True,
                                 timeout=30).returncode != 0:
                if time.monotonic() > deadline:  # a writer still exiting: detach lazily
                    subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True, timeout=30)
                    break
                time.sleep(0.1)
            self.mounted = False
        if self.dev:
            subprocess.run(["losetup", "-d", self.dev], capture_output=True, timeout=30)
            self.dev = None


def device_args() -> tuple[list[str], str]:
    """The server's model: torch on the GPU when torch and a GPU are here, else pure Python."""
    if importlib.util.find_spec("torch") is not None and os.path.exists("/dev/nvidiactl"):
        return ["--device", "auto", "--hidden-size", "64", "--num-layers", "2"], \
            "a tiny torch model (on the GPU when torch sees one)"
    return ["--device", "python", "--hidden-size", "32", "--num-layers", "2"], \
        "a tiny pure-Python model (no torch, no GPU needed)"


_PROGRESS = re.compile(r"(\d+)/(\d+) \[")


def read_progress(log_path: Path) -> tuple[int, int] | None:
    """The last tqdm `N/M [` in the log's tail."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    found = _PROGRESS.findall(tail)
    if not found:
        return None
    done, total = found[-1]
    return int(done), int(total)


def pids_running(module: str, marker: str) -> list[int]:
    """Live (non-zombie) processes running `python -m module` whose argv names `marker`."""
    out = []
    for pid in pids():
        p = Proc(pid)
        try:
            argv = p.argv_bytes()
            state = p.stat().state
        except (Absent, Denied, OSError, ValueError):
            continue
        if state in DEAD_STATES and p.live_thread() is None:
            continue  # a zombie leader whose writer thread is still in D is not gone
        # argv[1:3] == -m module: the client itself, not its wrapper (which names it after --)
        if len(argv) > 2 and argv[1] == b"-m" and argv[2] == module.encode() \
                and marker.encode() in b"\0".join(argv):
            out.append(pid)
    return sorted(out)
