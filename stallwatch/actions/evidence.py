"""An evidence bundle for an incident: what the job looked like when the verdict was reached.

    <bundle>/README.txt        what is here, and every note (a tool missing, a timeout, a failure)
             verdict.json      the verdict as the rules gave it
             snapshot.json     the whole snapshot the verdict was reached on
             evaluation.json   the rules' alerts and transitions (when given `evaluation`)
             features.json     the variables the rules saw (when given `features`)
             threads.txt       per process and thread: state, wchan, syscall, file, kernel stack
             log_tail.txt      the job log's last lines, traceback and fatal lines
             gpus.txt          devices, their processes and memory, Xid events
             disks.txt         the output paths' filesystems and block devices
             kernel.txt        kernel log events (OOM kills, hung tasks, Xid, I/O errors)
             sparklines.txt    the last minutes as sparklines: progress rate, GPU, CPU, I/O
             history.json      the samples they are drawn from (when given `history`)
             py-spy-<pid>.txt  `py-spy dump --nonblocking` of each Python process of the job

Guarantees. It never hangs: the only outside programs are py-spy runs, started together, each
under one shared deadline, SIGKILLed past it and abandoned (reaped by a thread) if even that
does not end them — py-spy can itself block on a target in `D`. `--nonblocking` because the
default dump stops every thread with ptrace, and a thread in `D` never stops (docs/field.md). It never
raises: every part that fails becomes a line in README.txt. It is bounded: each file is cut at
`max_file_bytes`, the whole bundle at `max_bundle_bytes`. No shell: argv lists only. The bundle
directory is 0700 and its files 0600.

Everything else comes from the snapshot (no /proc reads here), so the bundle shows what the
verdict saw, and writing it touches only the bundle's own filesystem — which must not be the
job's (a frozen outputs filesystem would hang the write): the daemon puts it in its state dir.
It still blocks for up to the py-spy deadline: the daemon runs it in a worker thread.

Secrets: the bundle is made from the snapshot and the verdict only. Neither holds alert URLs,
webhook tokens or anything from the daemon's configuration beyond the job's target, and this
module must never be handed the config or an alert sink: keep it that way. py-spy runs without
--locals (locals may hold tokens) and nothing reads /proc/PID/environ. As a second line, any
`scheme://user:password@` in what is written is masked. Command lines are written as the
snapshot has them: a job that takes a secret as an argument shows it to every `ps` already.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable

from stallwatch.clock import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:  # only read here, never built: keeps `import stallwatch.actions` light
    from stallwatch.engine.alerting import Verdict
    from stallwatch.probes.snapshot import Snapshot

__all__ = ["capture_evidence", "find_py_spy", "is_python_process"]

MAX_FILE_BYTES = 4 << 20
MAX_BUNDLE_BYTES = 32 << 20
MAX_PY_SPY = 8  # processes dumped per bundle: a data loader may have dozens of workers
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/\s@'\"]+@")
_PYTHON_ARGV0 = re.compile(r"^python[\d.]*[dmu]*$")


def _scrub(text: str) -> str:
    return _USERINFO.sub(r"\1***@", text)


def find_py_spy(py_spy: str | None) -> str | None:
    """A py-spy to run: an explicit path, or a name looked up on PATH and then beside the running
    interpreter (a venv's bin/, where `pip install py-spy` puts it)."""
    if not py_spy:
        return None
    if os.sep in py_spy:
        return py_spy if os.access(py_spy, os.X_OK) and os.path.isfile(py_spy) else None
    found = shutil.which(py_spy)
    if found:
        return found
    beside = Path(sys.executable).parent / py_spy
    return str(beside) if os.access(beside, os.X_OK) and beside.is_file() else None


def is_python_process(argv: Iterable[str], comm: str) -> bool:
    """A Python interpreter, by its argv[0] (a script's shebang puts the interpreter there) or
    its comm (PyTorch renames the main thread `pt_main_thread`)."""
    argv = tuple(argv)
    if argv and _PYTHON_ARGV0.match(os.path.basename(argv[0])):
        return True
    return comm.startswith("python") or comm == "pt_main_thread"


# ---------------------------------------------------------------------------------- bundle


@dataclass
class _Bundle:
    path: Path
    max_file_bytes: int
    max_bundle_bytes: int
    notes: list[str] = field(default_factory=list)
    files: list[tuple[str, int]] = field(default_factory=list)
    total: int = 0

    def room(self) -> int:
        return max(0, min(self.max_file_bytes, self.max_bundle_bytes - self.total))

    def write(self, name: str, text: str) -> None:
        data = _scrub(text).encode("utf-8", "replace")
        room = self.room()
        if len(data) > room:
            marker = f"\n[... cut: {len(data)} bytes, {room} kept (size limit)]\n".encode()
            data = data[: max(0, room - len(marker))] + marker
            self.notes.append(f"{name}: cut at {room} bytes (size limit)")
        fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        self.total += len(data)
        self.files.append((name, len(data)))

    def part(self, name: str, make: Callable[[], str]) -> None:
        """Write one file; a failure becomes a note, never an exception."""
        try:
            self.write(name, make())
        except Exception as exc:  # noqa: BLE001 - a part that fails becomes a note in the bundle
            self.notes.append(f"{name}: not written: {type(exc).__name__}: {exc}")


def _make_dir(bundle_dir: Path, notes: list[str]) -> Path:
    """bundle_dir itself, or bundle_dir-1, -2 ... when taken; a temp dir if none can be made."""
    try:
        bundle_dir.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1000):
            cand = bundle_dir if n == 0 else bundle_dir.with_name(f"{bundle_dir.name}-{n}")
            try:
                os.mkdir(cand, 0o700)
            except FileExistsError:
                continue
            os.chmod(cand, 0o700)  # mkdir's mode is filtered by the umask
            return cand
        raise FileExistsError(f"{bundle_dir}: no free name")
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix="stallwatch-evidence-"))  # 0700 already
        notes.append(f"could not create {bundle_dir} ({exc}): the bundle is in {fallback}")
        return fallback


# --------------------------------------------------------------------------------- py-spy


@dataclass
class _Dump:
    pid: int
    name: str
    proc: subprocess.Popen | None = None
    started: float = 0.0


def _start_dumps(bundle: _Bundle, exe: str, pids: list[int]) -> list[_Dump]:
    dumps = []
    for pid in pids:
        d = _Dump(pid, f"py-spy-{pid}.txt")
        try:
            fd = os.open(bundle.path / d.name,
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                # Output to a file, not a pipe: nothing here can block on reading it, and a
                # py-spy we must abandon cannot wedge us through a full pipe either.
                d.proc = subprocess.Popen(
                    [exe, "dump", "--nonblocking", "--pid", str(pid)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, close_fds=True)
            d.started = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - one dump that will not start must not cost the others
            bundle.notes.append(f"py-spy for pid {pid}: not started: {type(exc).__name__}: {exc}")
            continue
        dumps.append(d)
    return dumps


def _reap_later(proc: subprocess.Popen) -> None:
    threading.Thread(target=proc.wait, name=f"reap-py-spy-{proc.pid}", daemon=True).start()


def _finish_dumps(bundle: _Bundle, dumps: list[_Dump], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for d in dumps:
        assert d.proc is not None
        try:
            rc = d.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            d.proc.kill()
            try:
                d.proc.wait(timeout=1.0)
                bundle.notes.append(f"py-spy for pid {d.pid}: no answer in {timeout_s:g} s, "
                                    "killed")
            except subprocess.TimeoutExpired:
                _reap_later(d.proc)
                bundle.notes.append(f"py-spy for pid {d.pid}: no answer in {timeout_s:g} s and "
                                    "still there after SIGKILL (blocked in the kernel?): left "
                                    "behind")
            _account(bundle, d, "timed out")
            continue
        _account(bundle, d, None if rc == 0 else f"exit status {rc}")


def _account(bundle: _Bundle, d: _Dump, problem: str | None) -> None:
    path = bundle.path / d.name
    try:
        size = path.stat().st_size
        room = bundle.room()
        if size > room:
            with open(path, "r+b") as f:
                f.truncate(room)
                f.seek(room)
                f.write(b"\n[... cut (size limit)]\n")
            bundle.notes.append(f"{d.name}: cut at {room} bytes (size limit)")
            size = path.stat().st_size
        text = path.read_text("utf-8", "replace")
        scrubbed = _scrub(text)
        if scrubbed != text:
            path.write_text(scrubbed, "utf-8")
        if problem and problem != "timed out":
            first = text.strip().splitlines()[-1][:200] if text.strip() else "no output"
            bundle.notes.append(f"py-spy for pid {d.pid}: {problem}: {first}")
        bundle.total += size
        bundle.files.append((d.name, size))
    except OSError as exc:
        bundle.notes.append(f"{d.name}: {exc}")


# ------------------------------------------------------------------------------ the texts


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _fmt_s(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}s"


def _threads_txt(snap: Snapshot) -> str:
    obs = snap.processes
    if obs is None:
        return "no process observation in this snapshot\n"
    out = [f"targets: {list(obs.targets)}  zombies: {list(obs.zombies)}  "
           f"missing: {list(obs.missing)}  reused: {list(obs.reused)}  "
           f"unreadable here: {list(obs.denied)}", ""]
    for p in obs.processes:
        out.append(f"pid {p.pid} ({p.comm}) {p.role} state {p.state} for "
                   f"{_fmt_s(p.state_since_s)}  ppid {p.ppid} pgid {p.pgid} sid {p.sid} "
                   f"uid {p.uid}")
        out.append(f"  cmdline: {_one_line(p.cmdline)}")
        out.append(f"  wchan {p.wchan}  in D {_fmt_s(p.d_state_for_s)}  no context switch "
                   f"{_fmt_s(p.ctx_unchanged_for_s)}  last ran {_fmt_s(p.last_ran_age_s)} ago  "
                   f"no I/O {_fmt_s(p.io_unchanged_for_s)}  cpu {p.cpu_util}  rss {p.rss_bytes}"
                   f"  threads {p.num_threads}  fds {p.num_fds}")
        if p.exit_code is not None:
            out.append(f"  exit code {p.exit_code}")
        for f in p.open_files:
            if f.write:
                out.append(f"  writing fd {f.fd}: {f.path} at {f.pos_bytes}")
        for s in p.tcp:
            out.append(f"  tcp fd {s.fd}: {s.local_addr}:{s.local_port} -> {s.remote_addr}:"
                       f"{s.remote_port} {s.state} tx {s.tx_queue_bytes} rx {s.rx_queue_bytes}")
        for t in p.threads:
            call = t.syscall or (f"nr {t.syscall_nr}" if t.syscall_nr is not None else "-")
            target = f" on {t.syscall_file}" if t.syscall_file else (
                f" fd {t.syscall_fd}" if t.syscall_fd is not None else "")
            out.append(f"  thread {t.tid} ({t.comm}) {t.state} for {_fmt_s(t.state_since_s)}  "
                       f"wchan {t.wchan or '-'}  syscall {call}{target}  in D "
                       f"{_fmt_s(t.d_state_for_s)}  no ctx switch {_fmt_s(t.ctx_unchanged_for_s)}")
            if t.stack:
                out.extend(f"      {fn}" for fn in t.stack)
            elif t.stack is None and t.state not in ("R", "Z", "X"):
                out.append("      (kernel stack not readable: needs root)")
        if p.threads_truncated:
            out.append("  ... more threads not read (max_threads)")
        out.append("")
    for e in obs.exited:
        out.append(f"exited: pid {e.pid} ({e.comm}) {e.role} returncode {e.returncode} "
                   f"({e.returncode_source}) last state {e.last_state}, {e.exited_for_s:.1f}s ago"
                   f"  cmdline: {_one_line(e.cmdline or '')}")
    return "\n".join(out) + "\n"


def _log_txt(snap: Snapshot) -> str:
    log = snap.log
    if log is None:
        return "no log observation in this snapshot\n"
    out = [f"log {log.path}: {log.status}" + (f" ({log.error})" if log.error else ""),
           f"size {log.size_bytes}  idle {_fmt_s(log.idle_s)} ({log.idle_source})  "
           f"last growth {_fmt_s(log.last_growth_age_s)} ago  rate {log.rate_per_s}/s  eta "
           f"{_fmt_s(log.eta_s)}"]
    if log.progress is not None:
        pr = log.progress
        out.append(f"progress: {pr.done}/{pr.total} ({pr.source}) {pr.desc or ''} "
                   f"{pr.postfix or ''}")
    out += ["", f"--- last {len(log.tail)} lines ---", *log.tail]
    if log.traceback is not None:
        out += ["", "--- last traceback ---", *log.traceback.lines]
        if log.traceback.omitted_lines:
            out.append(f"({log.traceback.omitted_lines} lines omitted)")
    if log.fatal:
        out += ["", "--- fatal-looking lines since the last progress ---",
                *(f"[{f.kind}] {f.line}" for f in log.fatal)]
    return "\n".join(out) + "\n"


def _gpus_txt(snap: Snapshot) -> str:
    g = snap.gpu
    if g is None:
        return "no GPU observation in this snapshot\n"
    out = [f"status {g.status}  driver {g.driver_version}  cuda {g.cuda_driver_version}  "
           f"devices {g.device_count}  xid watch {g.xid_watch}" + (f"  error {g.error}"
                                                                   if g.error else ""), ""]
    for d in g.devices:
        out.append(f"gpu {d.index} {d.name} {d.pci_bus_id} {d.uuid}" + ("  LOST" if d.lost
                                                                        else ""))
        out.append(f"  util {d.util_gpu_pct}%  mem {d.mem_used_bytes}/{d.mem_total_bytes}  "
                   f"temp {d.temperature_c}C  power {d.power_w}W  pstate {d.pstate}  clocks "
                   f"{d.clock_event_reasons}  ecc volatile uncorrected "
                   f"{d.ecc_volatile_uncorrected}")
        for p in d.processes or ():
            out.append(f"  process {p.pid} {p.kind} used {p.used_bytes} sm {p.sm_util_pct}%")
        if d.errors:
            out.append(f"  unavailable: {d.errors}")
    if g.xid_events:
        out += ["", "xid events:"]
        out += [f"  #{e.seq} gpu {e.gpu_index} {e.kind} xid {e.xid} at {e.wall_time}"
                for e in g.xid_events]
    return "\n".join(out) + "\n"


def _disks_txt(snap: Snapshot) -> str:
    dk = snap.disks
    if dk is None:
        return "no disk observation in this snapshot\n"
    out = []
    for p in dk.paths:
        mnt = p.mount
        where = f"{mnt.mount_point} ({mnt.fs_type} from {mnt.source})" if mnt else "?"
        dev = p.device.name if p.device else "?"
        out.append(f"{p.path} [{p.kind}]: {p.status}" + (f" ({p.detail})" if p.detail else ""))
        out.append(f"  on {where} device {dev}  free {p.free_bytes}/{p.total_bytes} "
                   f"({p.used_pct}% used)  inodes {p.inodes_used_pct}% used  read-only "
                   f"{p.read_only}  statvfs {p.statvfs_latency_s}s  stuck "
                   f"{_fmt_s(p.stuck_for_s)}")
    out.append("")
    for d in dk.devices:
        out.append(f"{d.name} ({d.major}:{d.minor}): r {d.read_bytes_per_s} B/s w "
                   f"{d.write_bytes_per_s} B/s await {d.await_ms} ms busy {d.busy_pct}% "
                   f"in flight {d.inflight_ios} (stuck {_fmt_s(d.inflight_stuck_for_s)})")
    if dk.errors:
        out += ["", *dk.errors]
    return "\n".join(out) + "\n"


def _kernel_txt(snap: Snapshot) -> str:
    k = snap.kernel
    if k is None:
        return "no kernel log observation in this snapshot\n"
    out = [f"source {k.source}: {k.status}" + (f" ({k.error})" if k.error else "")
           + f"  counts {dict(k.counts)}  lost {k.records_lost}", ""]
    for e in k.events:
        extra = {kk: v for kk, v in e.model_dump(exclude_none=True).items()
                 if kk not in ("kind", "seq", "kernel_usec", "wall_time", "level", "message")}
        out.append(f"[{e.kernel_usec / 1e6:12.3f}] {e.kind} {e.message}"
                   + (f"  {extra}" if extra else ""))
    return "\n".join(out) + "\n"


def _readme(bundle: _Bundle, snap: Snapshot | None, verdict: Verdict | None, clock: Clock,
            started: float) -> str:
    lines = ["stallwatch evidence bundle", ""]
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(clock.time()))
        lines.append(f"created: {when} on {socket.gethostname()}")
    except Exception:  # noqa: BLE001 - the README's header line is a nicety
        pass
    if verdict is not None:
        lines.append(f"verdict: {getattr(verdict, 'kind', '?')}: {getattr(verdict, 'summary', '')}")
    if snap is not None:
        try:
            lines.append(f"job: {snap.target.name}  snapshot at {snap.t_wall} on {snap.host}")
        except Exception:  # noqa: BLE001 - a stand-in snapshot without these fields still gets its README
            pass
    lines.append(f"took: {time.monotonic() - started:.2f} s")
    lines += ["", "files:", *(f"  {n}  {s} bytes" for n, s in bundle.files)]
    lines += ["", "notes:", *(f"  - {n}" for n in bundle.notes or ["none"])]
    return "\n".join(lines) + "\n"


def _sparklines_txt(history: list[dict[str, Any]]) -> str:
    from stallwatch.engine.history import from_docs, sparkline_text, sparklines

    return sparkline_text(sparklines(from_docs(history))) + "\n"


def _dump_json(model: Any) -> str:
    if hasattr(model, "model_dump_json"):
        return model.model_dump_json(indent=1) + "\n"
    return json.dumps(model, indent=1, default=str) + "\n"


def _python_pids(snap: Snapshot, limit: int, notes: list[str]) -> list[int]:
    obs = snap.processes
    if obs is None:
        return []
    pids = [p.pid for p in obs.processes  # targets come first in the snapshot
            if p.state not in ("Z", "X") and is_python_process(p.argv, p.comm)]
    if len(pids) > limit:
        notes.append(f"py-spy: {len(pids)} Python processes, dumped the first {limit}")
    return pids[:limit]


# ----------------------------------------------------------------------------------- entry


def capture_evidence(
    snapshot: Snapshot,
    verdict: Verdict,
    bundle_dir: str | os.PathLike[str],
    *,
    py_spy: str | None = "py-spy",
    py_spy_timeout_s: float = 10.0,
    clock: Clock = SYSTEM_CLOCK,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_bundle_bytes: int = MAX_BUNDLE_BYTES,
    max_py_spy: int = MAX_PY_SPY,
    evaluation: Any = None,
    features: Any = None,
    timeout_s: float | None = None,
    history: list[dict[str, Any]] | None = None,
) -> Path:
    """Write the bundle to `bundle_dir` (or `bundle_dir-N` when it exists) and return its path.

    evaluation (an engine Evaluation) and features (the rule variables) are written when given.
    timeout_s bounds the whole capture: the py-spy deadline shrinks to fit inside it. Blocks for
    at most about `py_spy_timeout_s` plus the writes; never raises."""
    started = time.monotonic()
    if timeout_s is not None:
        py_spy_timeout_s = max(0.0, min(py_spy_timeout_s, timeout_s - 1.0))
    notes: list[str] = []
    bundle = _Bundle(_make_dir(Path(bundle_dir), notes), max_file_bytes, max_bundle_bytes,
                     notes)
    dumps: list[_Dump] = []
    try:
        # py-spy first: the dumps run while the text files are written.
        try:
            exe = find_py_spy(py_spy)
            pids = _python_pids(snapshot, max_py_spy, notes)
            if py_spy is None:
                notes.append("py-spy: disabled")
            elif exe is None:
                notes.append(f"py-spy: {py_spy!r} not found: no Python stacks "
                             "(pip install py-spy)")
            elif not pids:
                notes.append("py-spy: no live Python process in the snapshot")
            else:
                dumps = _start_dumps(bundle, exe, pids)
        except Exception as exc:  # noqa: BLE001 - py-spy trouble becomes a note, the bundle goes on
            notes.append(f"py-spy: {type(exc).__name__}: {exc}")
        bundle.part("verdict.json", lambda: _dump_json(verdict))
        bundle.part("threads.txt", lambda: _threads_txt(snapshot))
        bundle.part("log_tail.txt", lambda: _log_txt(snapshot))
        bundle.part("gpus.txt", lambda: _gpus_txt(snapshot))
        bundle.part("disks.txt", lambda: _disks_txt(snapshot))
        bundle.part("kernel.txt", lambda: _kernel_txt(snapshot))
        if evaluation is not None:
            bundle.part("evaluation.json", lambda: _dump_json(evaluation))
        if features is not None:
            bundle.part("features.json", lambda: _dump_json(features))
        if history:
            bundle.part("sparklines.txt", lambda: _sparklines_txt(history))
            bundle.part("history.json", lambda: json.dumps(history, indent=1) + "\n")
        bundle.part("snapshot.json", lambda: _dump_json(snapshot))  # the largest: last
        try:
            _finish_dumps(bundle, dumps, py_spy_timeout_s)
        except Exception as exc:  # noqa: BLE001 - py-spy trouble becomes a note, the bundle goes on
            notes.append(f"py-spy: {type(exc).__name__}: {exc}")
    except BaseException as exc:  # even KeyboardInterrupt leaves a README behind
        notes.append(f"capture interrupted: {type(exc).__name__}: {exc}")
        if not isinstance(exc, Exception):
            raise
    finally:
        for d in dumps:  # whatever happened above, no py-spy outlives this call unwatched
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
                _reap_later(d.proc)
        try:
            bundle.max_bundle_bytes += 1 << 16  # the README always fits
            bundle.write("README.txt", _readme(bundle, snapshot, verdict, clock, started))
        except Exception:  # noqa: BLE001 - the last write: nothing is left to report a failure to
            pass
    return bundle.path
