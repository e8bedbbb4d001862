"""Finding a job's log and outputs from its fds, cwd and command line (a part of
probes/discover.py, which finds the job itself; its docstring says how each is found)."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from stallwatch.kernel import procfs
from stallwatch.probes.targets import Target

LOG_SUFFIXES = (".log", ".txt", ".out")
OUTPUT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".npy", ".npz", ".ckpt.gz", ".pt.gz")
RECENT_S = 600.0  # an output file modified this recently was written by the running job
WALK_MAX_ENTRIES = 20_000
WALK_MAX_DEPTH = 4
WALK_DEADLINE_S = 2.0


class HostView(Protocol):
    """What this reads of discover's one view of the process table."""

    @property
    def procs(self) -> Mapping[int, Any]: ...  # pid -> Proc (.cmdline, .text)

    def fds(self, pid: int, refresh: bool = False) -> dict[int, str]: ...

    def fd_flags(self, pid: int, fd: int) -> int | None: ...

    def cwd(self, pid: int) -> str | None: ...

    def is_stallwatch(self, pid: int) -> bool: ...




def _regular(path: str) -> bool:
    if not path.startswith("/") or path.startswith(("/dev/", "/proc/", "/sys/")) \
            or path.endswith(" (deleted)"):
        return False
    try:
        return os.path.isfile(path)
    except OSError:
        return False


def find_log(host: HostView, pid: int) -> tuple[str | None, str]:
    fds = host.fds(pid)
    for fd, what in ((2, "stderr"), (1, "stdout")):
        link = fds.get(fd, "")
        if _regular(link):
            return link, f"its {what} (fd {fd}) is that file"
    for fd, link in sorted(fds.items()):
        if fd > 2 and _regular(link) and link.endswith(LOG_SUFFIXES):
            flags = host.fd_flags(pid, fd)
            if flags is not None and procfs.opened_for_write(flags):
                return link, f"it has it open for {'append' if flags & os.O_APPEND else 'writing'} (fd {fd})"
    # stdout/stderr into a pipe: the process reading the other end (tee) writes the log
    for fd in (2, 1):
        link = fds.get(fd, "")
        if not link.startswith("pipe:"):
            continue
        for other in host.procs:
            if other == pid or host.is_stallwatch(other):
                continue
            ofds = host.fds(other)
            if link not in ofds.values() or ofds.get(1) == link or ofds.get(2) == link:
                continue  # not a reader of this pipe (or another writer)
            for ofd, olink in sorted(ofds.items()):
                if ofd > 2 and _regular(olink):
                    flags = host.fd_flags(other, ofd)
                    if flags is not None and procfs.opened_for_write(flags):
                        return olink, (f"its fd {fd} is a pipe read by pid {other} "
                                       f"({short(host.procs[other].text)}), which writes that file")
    return None, ""


def _named_dirs(argv: tuple[str, ...], cwd: str | None) -> list[str]:
    """Existing folders the command line names (`--out DIR`, `--out=DIR`, `DIR`)."""
    out: list[str] = []
    for a in argv[1:]:
        val = a.split("=", 1)[1] if a.startswith("-") and "=" in a else a
        if not val or val.startswith("-"):
            continue
        path = val if os.path.isabs(val) else (os.path.join(cwd, val) if cwd else None)
        if path and path not in ("/",) and os.path.isdir(path):
            out.append(os.path.normpath(path))
    return list(dict.fromkeys(out))


def _walk_outputs(roots: list[str], since: float, deadline_s: float) -> tuple[Counter, bool]:
    """Folders of recent output files under `roots` (bounded; in a thread with a deadline)."""
    counts: Counter = Counter()
    lock = threading.Lock()
    done = threading.Event()

    def walk() -> None:
        budget = WALK_MAX_ENTRIES
        seen: set[str] = set()
        for top in roots:
            stack = [(top, 0)]
            while stack and budget > 0:
                d, depth = stack.pop()
                if d in seen or d.endswith(".quarantine"):
                    continue
                seen.add(d)
                try:
                    with os.scandir(d) as it:
                        for e in it:
                            budget -= 1
                            if budget <= 0:
                                break
                            try:
                                if e.is_dir(follow_symlinks=False):
                                    if depth < WALK_MAX_DEPTH and not e.name.startswith("."):
                                        stack.append((e.path, depth + 1))
                                elif e.name.endswith(OUTPUT_SUFFIXES) and \
                                        e.stat(follow_symlinks=False).st_mtime >= since:
                                    with lock:
                                        counts[d] += 1
                            except OSError:
                                continue
                except OSError:
                    continue
        done.set()

    t = threading.Thread(target=walk, name="discover-outputs", daemon=True)
    t.start()
    finished = done.wait(deadline_s)
    with lock:  # a walk past its deadline goes on in its thread: take what it found so far
        return Counter(counts), finished


def _find_outputs(host: HostView, pid: int, log: str | None) -> tuple[str | None, str]:
    p = host.procs[pid]
    cwd = host.cwd(pid)
    counts: Counter = Counter()
    how = ""
    for fd, link in host.fds(pid).items():
        if fd <= 2 or link == log or not _regular(link):
            continue
        flags = host.fd_flags(pid, fd)
        if flags is not None and procfs.opened_for_write(flags) and not link.endswith(LOG_SUFFIXES):
            counts[os.path.dirname(link)] += 1
    if counts:
        how = "it has files open for writing there"
    named = _named_dirs(p.cmdline, cwd)
    if not counts:
        walk_roots = named + ([cwd] if cwd and cwd != "/" and cwd not in named else [])
        counts, finished = _walk_outputs(walk_roots, time.time() - RECENT_S, WALK_DEADLINE_S)
        if counts:
            how = f"{sum(counts.values())} output file(s) ({'/'.join('*' + s for s in OUTPUT_SUFFIXES[:3])}...) " \
                  f"modified in the last {RECENT_S / 60:g} minutes"
        elif not finished:
            return None, (f"looking for its outputs under {', '.join(walk_roots)} did not "
                          f"finish within {WALK_DEADLINE_S:g} s")
    if not counts:
        return None, ""
    best = counts.most_common(1)[0][0]
    # Shard folders (rows_0-2000/) below a folder the command line names: that folder.
    for d in sorted(named, key=len):
        if best == d or best.startswith(d.rstrip("/") + "/"):
            if best != d:
                how += f", in folders below {d}, which its command line names"
            return d, how
    return best, how


def log_and_outputs(host: HostView, pid: int, target: Target,
                     notes: list[str]) -> tuple[Path | None, Path | None]:
    log = outputs = None
    if target.log is None:
        found, how = find_log(host, pid)
        if found:
            log = Path(found)
            notes.append(f"log: {found} ({how})")
        else:
            notes.append(f"log: none found for pid {pid} (stdout/stderr are not files; pass --log)")
    if target.outputs is None:
        found, how = _find_outputs(host, pid, str(log or target.log or ""))
        if found:
            outputs = Path(found)
            notes.append(f"outputs: {found} ({how})")
        else:
            notes.append(f"outputs: none found for pid {pid}" + (f" ({how})" if how else
                                                                   " (pass --outputs)"))
    return log, outputs



def short(text: str, n: int = 120) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
