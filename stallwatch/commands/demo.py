"""`stallwatch demo`: the pipeline stallwatch was built for, supervised, with a fault injected.

In a temporary directory: the protocol server (SGLang's HTTP protocol, a tiny model — pure
Python unless torch and CUDA are here), the reference extraction client writing one `.ckpt` per
sample as a supervised job of the real daemon (run in a thread of this process, with the default
rules), and an alert sink that narrates to the terminal (a `command` sink running this module's
`--alert-sink` printer; plus desktop notifications when a session bus is there). The demo reads
the daemon's state database and tells what happens: detection (verdict and evidence), alert,
kill, validation and quarantine, resume, completion; then a table, and checks the outputs.

Faults:
- `hang` (default): the client's writer deadlocks half-way through the file of sample FAULT_AT
  (its `--fault hang_mid_write` hook): a truncated file is left at its final path, as a killed
  SpecForge job leaves one, and the resume must not skip it.
- `crash`: the client raises before sample FAULT_AT (`--fault crash`).
- `server_hang`: the demo SIGSTOPs the server's scheduler process (`sglang::scheduler`) once the
  client passed FAULT_AT; the daemon does not restart the client for that (the fault is outside
  it), so once the verdict is in, the demo acts as the operator and SIGCONTs the scheduler.
- `io_stall` (root only): the outputs are on a loop-mounted ext4 image, frozen with
  `fsfreeze -f` mid-run; once the daemon says the writer is unkillable and waits (no second
  writer), the demo thaws the filesystem and the recovery goes on.

Exit status: 0 when everything happened as it should (the right verdict, every output present
once and whole, nothing broken left in the outputs, the job finished); 2 otherwise, saying what
went wrong; 3 when the demo cannot run here (io_stall without root, no loop device).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallwatch.errors import UsageError
from stallwatch.kernel.proc import DEAD_STATES, Proc, pids
from stallwatch.kernel.roots import Absent, Denied

FAULTS = ("hang", "io_stall", "crash", "server_hang")
JOB = "extract"

NUM_SAMPLES = 48
FAULT_AT = 16
SEQ_LEN = 16
FORWARD_DELAY_S = 0.4  # one forward per sample: ~0.4 s a sample, a ~1 s-cadence job
INTERVAL_S = 0.5
DEADLINE_S = 240.0  # the whole demo; a healthy run takes about a minute

log = logging.getLogger("stallwatch.commands.demo")


class DemoUnavailable(Exception):
    """The demo cannot run this fault here (exit 3)."""


# ------------------------------------------------------------------------------ helpers


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


def _device_args() -> tuple[list[str], str]:
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


def _pids_running(module: str, marker: str) -> list[int]:
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


def _fmt_s(s: float | None) -> str:
    return "—" if s is None else f"{s:.1f} s"


# ------------------------------------------------------------------------------ the demo


@dataclass
class Event:
    t: float  # seconds since the demo started
    what: str
    text: str
    detail: list[str] = field(default_factory=list)


class Demo:
    def __init__(self, fault: str = "hang", *, keep: bool = False, console: Any = None,
                 num_samples: int = NUM_SAMPLES, fault_at: int = FAULT_AT,
                 deadline_s: float = DEADLINE_S) -> None:
        if fault not in FAULTS:
            raise UsageError(f"--fault {fault}: expected one of {', '.join(FAULTS)}")
        from rich.console import Console

        self.fault = fault
        self.keep = keep
        self.console = console or Console(stderr=True)
        self.n = num_samples
        self.fault_at = fault_at
        self.deadline_s = deadline_s
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
        self.events: list[Event] = []
        self.problems: list[str] = []
        self.dir: Path | None = None
        self.server = None
        self.loopfs: LoopFS | None = None
        self.daemon = None
        self.daemon_thread: threading.Thread | None = None
        self.db = None
        self._log_handler: logging.Handler | None = None
        self._saved_logger: tuple[int, bool] | None = None
        # what happened
        self.fault_wall: float | None = None
        self.fault_how = ""
        self.last_progress_wall: float | None = None
        self.progress: tuple[int, int] | None = None
        self.incidents: dict[int, dict[str, Any]] = {}
        self.first_incident: dict[str, Any] | None = None
        self.detected_wall: float | None = None
        self.seen_actions: dict[int, str] = {}
        self.seen_alerts: set[int] = set()
        self.delivered: list[dict[str, Any]] = []
        self._delivered_lines = 0
        self.runs_seen: set[int] = set()
        self.operator_done = False
        self.thawed_wall: float | None = None
        self.unkillable_seen: float | None = None
        self.second_writer = False
        self.phase = ""
        self.finished_wall: float | None = None
        self.quarantined: list[dict[str, str]] = []
        self.outputs_report: dict[str, Any] = {}
        self.scheduler_pid: int | None = None
        self.model_text = ""
        self._restarts: int | None = None
        self.progress_wall_at_detection: float | None = None

    # -- narration ------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, what: str, text: str, detail: list[str] | tuple[str, ...] = (),
            style: str = "") -> None:
        from rich.markup import escape

        ev = Event(round(self.now(), 1), what, text, list(detail))
        self.events.append(ev)
        colour = style or {"fault": "bold red", "detect": "bold yellow", "alert": "magenta",
                           "kill": "red", "validate": "cyan", "quarantine": "bold cyan",
                           "restart": "green", "resolve": "green", "done": "bold green",
                           "operator": "bold blue", "problem": "bold red"}.get(what, "")
        tag = f"[{colour}]{what:<10}[/]" if colour else f"{what:<10}"
        self.console.print(f"[dim]{ev.t:6.1f}s[/]  {tag} {escape(text)}", highlight=False,
                           soft_wrap=True)
        for line in detail:
            self.console.print(f"{'':19}[dim]·[/] {escape(line)}", highlight=False, soft_wrap=True)

    # -- set-up ---------------------------------------------------------------------------

    @property
    def out(self) -> Path:
        assert self.dir is not None
        if self.loopfs is not None:
            return self.loopfs.mnt / "hidden_states"
        return self.dir / "hidden_states"

    @property
    def job_log(self) -> Path:
        assert self.dir is not None
        return self.dir / "extract.log"

    @property
    def alerts_file(self) -> Path:
        assert self.dir is not None
        return self.dir / "alerts.jsonl"

    @property
    def state_dir(self) -> Path:
        assert self.dir is not None
        return self.dir / "state"

    def quarantine_dir(self) -> Path:
        return self.state_dir / "quarantine" / JOB  # the daemon's default, root's side

    def _start_server(self) -> None:
        from stallwatch.sglang import launch_server

        dev_args, self.model_text = _device_args()
        args = [*dev_args, "--enable-metrics", "--enable-return-hidden-states",
                "--forward-delay-s", str(FORWARD_DELAY_S), "--no-access-log"]
        self.server = launch_server(args, log=str(self.dir / "server.log"), die_with_parent=True,
                                    ready_timeout=120.0)
        kids = self.server.children()
        sched = kids.get("scheduler") or []
        self.scheduler_pid = sched[0] if sched else None
        self.say("server", f"SGLang-protocol server up at {self.server.url} (pid {self.server.pid}, "
                           f"scheduler pid {self.scheduler_pid}, detokenizer pid "
                           f"{(kids.get('detokenizer') or ['?'])[0]}): {self.model_text}")

    def _client_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "stallwatch.sglang.extract_client", "--server",
                self.server.url, "--out", str(self.out), "--num-samples", str(self.n),
                "--seq-len", str(SEQ_LEN), "--resume"]
        if self.fault in ("hang", "crash"):
            hook = "hang_mid_write" if self.fault == "hang" else self.fault
            argv += ["--fault", hook, "--fault-at", str(self.fault_at)]
        return argv

    def config_text(self) -> str:
        from stallwatch.alerts.desktop import session_bus_address

        q = json.dumps
        alerts = f"""
[[alert]]
name = "terminal"
type = "command"
argv = {q([sys.executable, "-m", "stallwatch.commands.demo", "--alert-sink", str(self.alerts_file)])}
"""
        if session_bus_address() is not None:
            alerts += '\n[[alert]]\nname = "desktop"\ntype = "desktop"\n'
        return f"""# written by `stallwatch demo --fault {self.fault}`
[daemon]
interval_s = {INTERVAL_S}
state_dir = {q(str(self.state_dir))}
systemd_run = "never"
evidence_timeout_s = 10

[[job]]
name = "{JOB}"
command = {q(self._client_argv())}
cwd = {q(str(self.dir))}
log = {q(str(self.job_log))}
outputs = {q(str(self.out))}
{f"server = {q(self.server.url)}" if self.server is not None else "# no server: the ranks run the model"}
restart = "on-failure"
max_restarts = 2
restart_backoff_s = 1
kill_grace_s = 3
{alerts}"""

    def _start_daemon(self) -> None:
        from stallwatch.daemon.config import parse_config
        from stallwatch.daemon.core import Daemon

        text = self.config_text()
        path = self.dir / "stallwatch.toml"
        path.write_text(text)
        cfg = parse_config(text, str(path), base=self.dir, path=path)
        # The daemon's log goes to a file: the narration is what the terminal shows.
        lg = logging.getLogger("stallwatch")
        self._saved_logger = (lg.level, lg.propagate)
        h = logging.FileHandler(self.dir / "daemon.log")
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False
        self._log_handler = h
        self.daemon = Daemon(cfg, install_signals=False)
        self.daemon_thread = threading.Thread(target=self._daemon_main, name="stallwatch-daemon",
                                              daemon=True)
        self.daemon_thread.start()
        if not self.daemon.started.wait(60):
            raise RuntimeError("the daemon did not tick within 60 s (see daemon.log)")
        from stallwatch.daemon.state import StateDB

        self.db = StateDB.open_readonly(self.state_dir)
        fault_words = self._fault_words() or {
            "hang": f"the client's writer deadlocks half-way through the file of sample "
                    f"{self.fault_at} (its --fault hang_mid_write hook)",
            "crash": f"the client raises an exception before sample {self.fault_at} (--fault crash)",
            "server_hang": f"the demo SIGSTOPs the server's scheduler after sample {self.fault_at}",
            "io_stall": f"the demo freezes the outputs filesystem (fsfreeze -f) after sample "
                        f"{self.fault_at}",
        }[self.fault]
        self.say("daemon", f"stallwatch daemon supervising job \"{JOB}\" (default rules, a tick "
                           f"every {INTERVAL_S:g} s, restart = on-failure): {self.JOB_WORDS}, "
                           f"{self.n} samples → {self.out}",
                 [f"config {path}", f"log {self.job_log}",
                  "alerts: command sink → this terminal" + (
                      ", desktop notifications" if "desktop" in text else
                      " (no session bus: no desktop notifications)"),
                  f"fault: {fault_words}"])

    def _daemon_main(self) -> None:
        try:
            self.daemon.run()
        except Exception as e:  # said in the narration, not a traceback
            log.exception("the daemon failed")
            self.problems.append(f"the daemon failed: {type(e).__name__}: {e}")

    # -- the fault the demo injects itself ------------------------------------------------

    def _inject(self) -> None:
        if self.fault_wall is not None or self.fault not in ("server_hang", "io_stall"):
            return
        if not self.progress or self.progress[0] < self.fault_at:
            return
        if self.fault == "server_hang":
            pid = self.scheduler_pid
            os.kill(pid, signal.SIGSTOP)
            self.fault_wall = time.time()
            self.fault_how = f"SIGSTOP to the scheduler (pid {pid}, sglang::scheduler)"
            self.say("fault", f"kill -STOP {pid}: the server's scheduler stops; its HTTP process "
                              "still answers, the client waits for its answer")
        else:
            self.loopfs.freeze()
            self.fault_wall = time.time()
            self.fault_how = f"fsfreeze -f {self.loopfs.mnt} ({self.loopfs.dev})"
            self.say("fault", f"fsfreeze -f {self.loopfs.mnt}: the outputs filesystem "
                              f"({self.loopfs.dev}) completes no write; the client's writer "
                              "thread blocks in the kernel (D), and the client stops once its "
                              "write queue is full")

    def _operator(self) -> None:
        """server_hang and io_stall: what a person would do once stallwatch said what is wrong."""
        if self.operator_done or self.first_incident is None:
            return
        since = time.time() - (self.detected_wall or time.time())
        if self.fault == "server_hang":
            if since < 2.0:
                return  # let the alert be seen first
            os.kill(self.scheduler_pid, signal.SIGCONT)
            self.operator_done = True
            self.say("operator", f"kill -CONT {self.scheduler_pid}: acting as the operator. "
                                 "stallwatch does not restart the client for server_hang (the "
                                 "fault is in the server: a restarted client would wait on it "
                                 "again); in real life you would restart the server. The client "
                                 "is still waiting on its request and goes on by itself")
        elif self.fault == "io_stall":
            if self.unkillable_seen is None:
                if since > 40.0:  # never said: thaw anyway (the check below reports it)
                    self.loopfs.thaw()
                    self.thawed_wall = time.time()
                    self.operator_done = True
                    self.say("operator", f"fsfreeze -u {self.loopfs.mnt}: the kill never said "
                                         "the writer was unkillable; thawing anyway")
                return
            if time.time() - self.unkillable_seen < 3.0:
                return  # show a few seconds of "waiting, no second writer"
            writers = _pids_running("stallwatch.sglang.extract_client", str(self.out))
            runs = self.db.runs(JOB)
            if len(runs) > 1 or len(writers) > 1:
                self.second_writer = True
            self.say("check", f"{len(writers)} client process (pid "
                              f"{', '.join(map(str, writers)) or '-'}) and {len(runs)} run"
                              f"{'s' if len(runs) != 1 else ''} so far: no second writer was "
                              "started beside the one stuck in the kernel"
                              if not self.second_writer else
                              f"{len(writers)} client processes, {len(runs)} runs: a second "
                              "writer was started beside the stuck one!")
            self.loopfs.thaw()
            self.thawed_wall = time.time()
            self.operator_done = True
            self.say("operator", f"fsfreeze -u {self.loopfs.mnt}: acting as the operator, the "
                                 "storage answers again. The stuck write returns, the killed "
                                 "client can finally exit, and the recovery goes on")

    # -- what differs between the pipelines (demo_torchrun.TorchrunDemo overrides these) ------

    JOB_WORDS = "extraction client"
    WHO = "the client"
    RESUME_WORDS = "with --resume it skips every sample already on disk and carries on"

    def _fault_words(self) -> str | None:
        return None

    def _read_progress(self) -> tuple[int, int] | None:
        return read_progress(self.job_log)

    def _fault_marker(self) -> Path:
        return self.out / ".stallwatch-fault-fired"

    def _expected_outputs(self) -> set[Path]:
        from stallwatch.sglang.extract_client import sample_path

        return {sample_path(self.out, i) for i in range(self.n)}

    # -- reading the state database ------------------------------------------------------

    def _poll(self) -> None:
        db = self.db
        prog = self._read_progress() if self.runs_seen else None
        if prog is not None and prog != self.progress:
            old = self.progress[0] if self.progress else -1
            self.progress = prog
            self.last_progress_wall = time.time()
            if prog[0] // 12 != old // 12 or prog[0] == prog[1]:
                self.say("progress", f"{prog[0]}/{prog[1]} samples")
        job = db.job(JOB) or {}
        for run in db.runs(JOB):
            if run["id"] in self.runs_seen or not run.get("pid"):
                continue
            self.runs_seen.add(run["id"])
            if len(self.runs_seen) == 1:
                self.say("job", f"run {run['seq']} started: {self.WHO} is pid {run['pid']} "
                                f"(process group {run['pgid']}, in its own session)")
            else:
                self.say("resume", f"run {run['seq']} started: pid {run['pid']}, {self.RESUME_WORDS}")
        self._hook_fault_marker()
        for inc in db.incidents(JOB):
            iid = inc["id"]
            if iid not in self.incidents:
                self.incidents[iid] = inc
                self._narrate_detection(inc)
            elif inc["state"] != self.incidents[iid]["state"] or \
                    inc["note"] != self.incidents[iid]["note"]:
                self.incidents[iid] = inc
        for a in db.job_actions(JOB):
            if a["outcome"] == "pending" or self.seen_actions.get(a["id"]) == a["outcome"]:
                continue
            self.seen_actions[a["id"]] = a["outcome"]
            self._narrate_action(a)
        for ev in db.alert_events(JOB):
            if ev["id"] in self.seen_alerts:
                continue
            self.seen_alerts.add(ev["id"])
        self._read_delivered()
        phase = job.get("phase", "")
        if phase != self.phase:
            self.phase = phase
            if phase == "finished":
                self.finished_wall = time.time()
                self.say("done", f"the job finished (exit code 0): {self.progress[0] if self.progress else '?'}"
                                 f"/{self.n} samples")
            elif phase == "stopped":
                self.say("problem", f"the job is stopped: {job.get('phase_detail')}")

    def _hook_fault_marker(self) -> None:
        if self.fault_wall is not None or self.fault not in ("hang", "crash"):
            return
        marker = self._fault_marker()
        try:
            st = marker.stat()
        except OSError:
            return
        self.fault_wall = st.st_mtime
        hook = "hang_mid_write" if self.fault == "hang" else self.fault
        self.fault_how = f"--fault {hook} --fault-at {self.fault_at}"
        if self.fault == "hang":
            self.say("fault", f"the client's writer deadlocks half-way through the file of sample "
                              f"{self.fault_at}: half the archive is on disk at its final path, "
                              "and the thread waits on a lock it already holds, forever (futex, no "
                              "wakeups). The client stays alive; its progress soon stops")
        else:
            self.say("fault", f"the client raises RuntimeError before sample {self.fault_at} and "
                              "exits 1 (its traceback goes to the log)")

    def _narrate_detection(self, inc: dict[str, Any]) -> None:
        try:
            vd = json.loads(inc["verdict_json"])
        except ValueError:
            vd = {}
        evidence = [f"{e.get('signal')}: {e.get('detail')}" for e in vd.get("evidence", [])]
        after = ""
        if self.fault_wall is not None:
            after = f" {inc['started_at'] - self.fault_wall:.1f} s after the fault"
        if self.first_incident is None:
            self.first_incident = inc
            self.detected_wall = inc["started_at"]
            self.progress_wall_at_detection = self.last_progress_wall
        shown = evidence[:4] + [e for e in evidence[4:] if e.startswith("progress:")][:1]
        self.say("detect", f"verdict {inc['kind']}{after}: {inc['summary']}", shown)
        if inc["kind"] in ("hang", "io_stall", "server_hang") and self.last_progress_wall:
            idle = inc["started_at"] - self.last_progress_wall
            self.console.print(
                f"{'':19}[dim]({idle:.0f} s after the last progress line: the stall threshold "
                "of a job this fast is 20 s without progress — the floor; a slower job gets "
                "5 × its own cadence — then 2 s of confirmation)[/]", highlight=False,
                soft_wrap=True)

    def _narrate_action(self, a: dict[str, Any]) -> None:
        what, out = a["what"], a["outcome"]
        if what == "detect" or what == "start":
            return
        if what == "evidence":
            self.say("evidence", f"evidence bundle: {out.removeprefix('written: ')}"
                     if out.startswith("written") else f"evidence bundle: {out}")
        elif what == "kill":
            if out.startswith("unkillable"):
                self.unkillable_seen = time.time()
                self.say("kill", out + " — SIGKILL cannot take a task out of D; stallwatch will "
                                       "not start a second writer beside it")
            else:
                self.say("kill", out)
        elif what == "wait":
            self.say("wait", out)
        elif what == "validate":
            self.say("validate", out)
            self._quarantine_from(out)
        elif what == "restart":
            self.say("restart", out)
        elif what == "resolve":
            self.say("resolve", f"incident {a['incident_id']} resolved: {out}")
        elif what == "give_up":
            self.say("problem", out)
        else:
            self.say(what, out)

    def _quarantine_from(self, outcome: str) -> None:
        qdir = self.quarantine_dir()
        manifest = qdir / "MANIFEST.jsonl"
        try:
            lines = manifest.read_text().splitlines()
        except OSError:
            lines = []
        known = {q["path"] for q in self.quarantined}
        for line in lines:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            dst = str(doc.get("dst") or doc.get("quarantined") or doc.get("to") or "")
            if not dst or dst in known:
                continue
            src = str(doc.get("src") or doc.get("path") or doc.get("from") or "")
            reason = str(doc.get("reason") or "")
            self.quarantined.append({"path": dst, "from": src, "reason": reason})
            self.say("quarantine", f"moved {src} → {dst}: {reason} (moved aside, never deleted, "
                                   "so the resumed run writes it again)")
        if not lines and "quarantined 0" in outcome:
            self.console.print(f"{'':19}[dim](nothing to quarantine: the files written around "
                               "the failure are whole archives)[/]", highlight=False,
                               soft_wrap=True)

    def _read_delivered(self) -> None:
        try:
            lines = self.alerts_file.read_text().splitlines()
        except OSError:
            return
        for line in lines[self._delivered_lines:]:
            self._delivered_lines += 1
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            self.delivered.append(doc)
            kind, state = doc.get("kind"), doc.get("state")
            self.say("alert", f"[{doc.get('severity', '?')}] {kind} {state} — delivered by the "
                              f"command sink: {doc.get('summary', '')}")

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        if self.fault == "io_stall":
            LoopFS.check()
        self.dir = Path(tempfile.mkdtemp(prefix=f"stallwatch-demo-{self.fault}-"))
        os.chmod(self.dir, 0o755)
        self.console.print(f"[bold]stallwatch demo[/] — fault [bold]{self.fault}[/] — in {self.dir}",
                           highlight=False)
        try:
            if self.fault == "io_stall":
                self.loopfs = LoopFS(self.dir)
                try:
                    self.loopfs.setup()
                except DemoUnavailable as e:
                    raise DemoUnavailable(f"--fault io_stall: no loop-mounted ext4 here: {e}") from None
                self.say("storage", f"outputs on a loop-mounted ext4 image: {self.loopfs.dev} on "
                                    f"{self.loopfs.mnt}")
            self._start_server()
            self._start_daemon()
            self._loop()
            self._stop_daemon()
            self._verify()
        finally:
            self._cleanup()
        return self.summary()

    def _loop(self) -> None:
        deadline = self.t0 + self.deadline_s
        while True:
            self._poll()
            self._inject()
            self._operator()
            if self.phase in ("finished", "stopped"):
                break
            if self.problems:
                break
            if time.monotonic() > deadline:
                self.problems.append(f"the demo did not finish within {self.deadline_s:g} s "
                                     f"(job phase {self.phase or '?'})")
                break
            time.sleep(0.2)
        # alerts still in flight (the resolved one) get a moment to arrive
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            self._poll()
            fired = {(e["kind"], e["state"]) for e in self.delivered}
            if all(((i["kind"], "resolved") in fired or i["state"] != "resolved")
                   and (i["kind"], "firing") in fired for i in self.incidents.values()):
                break
            time.sleep(0.2)

    def _stop_daemon(self) -> None:
        if self.daemon is not None and self.daemon_thread is not None:
            self.daemon.request_stop()
            self.daemon_thread.join(30)
            self.daemon_thread = None

    # -- checks ----------------------------------------------------------------------------

    def _verify(self) -> None:
        from stallwatch.actions.filecheck import validate_file

        expected_kind = self.fault
        inc = self.first_incident
        if inc is None:
            self.problems.append(f"no incident: stallwatch never called it {expected_kind}")
        elif inc["kind"] != expected_kind:
            self.problems.append(f"the first verdict was {inc['kind']}, expected {expected_kind}")
        self._restarts = self.restarts()
        if self.phase != "finished":
            self.problems.append(f"the job did not finish (phase {self.phase or '?'})")
        want_restarts = 0 if self.fault == "server_hang" else 1
        restarts = self._restarts
        if restarts != want_restarts:
            self.problems.append(f"{restarts} restart(s), expected {want_restarts}")
        if self.second_writer:
            self.problems.append("a second writer was started while the first was stuck in D")
        if self.fault == "io_stall" and self.unkillable_seen is None:
            self.problems.append("the kill never said the writer was unkillable in D")
        if not any(d.get("state") == "firing" and d.get("kind") == expected_kind
                   for d in self.delivered):
            self.problems.append(f"no firing {expected_kind} alert reached the terminal sink")
        # every output present once, each a whole archive; nothing else in the outputs
        expected = self._expected_outputs()
        present = {p for p in self.out.rglob("*") if p.is_file() and p.suffix == ".ckpt"}
        missing = sorted(str(p) for p in expected - present)
        extra = sorted(str(p) for p in present - expected)
        broken = []
        valid = 0
        for p in sorted(expected & present):
            r = validate_file(p)
            if r.ok:
                valid += 1
            else:
                broken.append(f"{p}: {r.reason}")
        self.outputs_report = {"expected": self.n, "present": len(expected & present),
                               "valid": valid, "missing": missing, "broken": broken,
                               "extra": extra}
        if missing:
            self.problems.append(f"{len(missing)} output(s) missing, e.g. {missing[0]}")
        if broken:
            self.problems.append(f"{len(broken)} broken output(s) left in place, e.g. {broken[0]}")
        if extra:
            self.problems.append(f"unexpected files in the outputs, e.g. {extra[0]}")
        for q in self.quarantined:
            p = Path(q["path"])
            if p.exists() and validate_file(p).ok:
                self.problems.append(f"{p} was quarantined but is a whole archive")

    def restarts(self) -> int:
        if self._restarts is not None and self.db is None:
            return self._restarts
        try:
            row = self.db.job(JOB) if self.db is not None else None
        except Exception:  # noqa: BLE001
            row = None
        return int(row["restarts"]) if row else 0

    # -- the end ---------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        inc = self.first_incident
        vd: dict[str, Any] = {}
        if inc is not None:
            try:
                vd = json.loads(inc["verdict_json"])
            except ValueError:
                vd = {}
        detected_after = None
        if inc is not None and self.fault_wall is not None:
            detected_after = round(inc["started_at"] - self.fault_wall, 1)
        since_progress = None
        lp = self.progress_wall_at_detection
        if inc is not None and lp is not None and lp <= inc["started_at"]:
            since_progress = round(inc["started_at"] - lp, 1)
        return {
            "fault": self.fault,
            "ok": not self.problems,
            "problems": list(self.problems),
            "expected_verdict": self.fault,
            "verdict": inc["kind"] if inc else None,
            "summary": inc["summary"] if inc else None,
            "evidence": [f"{e.get('signal')}: {e.get('detail')}" for e in vd.get("evidence", [])],
            "fault_injected": self.fault_how,
            "detected_after_s": detected_after,
            "detected_after_last_progress_s": since_progress,
            "restarts": self.restarts(),
            "job_phase": self.phase,
            "incidents": [{"id": i["id"], "kind": i["kind"], "state": i["state"],
                           "summary": i["summary"], "note": i["note"]}
                          for i in self.incidents.values()],
            "alerts": [{"kind": d.get("kind"), "state": d.get("state"),
                        "summary": d.get("summary")} for d in self.delivered],
            "outputs": self.outputs_report,
            "quarantined": [q["path"] for q in self.quarantined],
            "quarantine": self.quarantined,
            "elapsed_s": round(self.now(), 1),
            "workdir": str(self.dir) if self.keep and self.dir else None,
            "timeline": [{"t": e.t, "what": e.what, "text": e.text, "detail": e.detail}
                         for e in self.events],
        }

    def _kill_job(self) -> None:
        """Whatever happened, leave no client behind: the daemon leaves jobs running by design."""
        from stallwatch.daemon.supervise import identity_alive

        try:
            runs = self.db.runs(JOB) if self.db is not None else []
        except Exception:  # noqa: BLE001
            runs = []
        for run in runs:
            if run.get("pid") and run.get("start_ticks") is not None and \
                    identity_alive(run["pid"], run["start_ticks"]):
                with contextlib.suppress(OSError):
                    os.killpg(run["pgid"] or run["pid"], signal.SIGKILL)
            if run.get("wrapper_pid") and run.get("wrapper_start_ticks") is not None and \
                    identity_alive(run["wrapper_pid"], run["wrapper_start_ticks"]):
                with contextlib.suppress(OSError):
                    os.kill(run["wrapper_pid"], signal.SIGKILL)

    def _cleanup(self) -> None:
        if self.loopfs is not None:
            self.loopfs.thaw()
        if self.scheduler_pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self.scheduler_pid, signal.SIGCONT)
        self._kill_job()
        with contextlib.suppress(Exception):
            self._stop_daemon()
        if self.db is not None:
            with contextlib.suppress(Exception):
                self.db.close()
            self.db = None
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.stop()
        lg = logging.getLogger("stallwatch")
        if self._log_handler is not None:
            lg.removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        if self._saved_logger is not None:
            lg.setLevel(self._saved_logger[0])
            lg.propagate = self._saved_logger[1]
        if self.loopfs is not None:
            if self.keep:  # keep the image's files: copy them out before it is unmounted
                with contextlib.suppress(OSError):
                    shutil.copytree(self.loopfs.mnt, self.dir / "outputs-from-image",
                                    ignore=shutil.ignore_patterns("lost+found"))
            self.loopfs.teardown()
        if self.dir is not None and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def render_table(self, doc: dict[str, Any]) -> None:
        from rich.table import Table

        t = Table(title=f"stallwatch demo: {doc['fault']}", show_header=False, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        o = doc["outputs"] or {}
        t.add_row("fault", f"{doc['fault']} ({doc['fault_injected'] or 'not injected'})")
        t.add_row("verdict", f"{doc['verdict'] or 'none'} (expected {doc['expected_verdict']})")
        t.add_row("detected after", f"{_fmt_s(doc['detected_after_s'])} from the fault; "
                                    f"{_fmt_s(doc['detected_after_last_progress_s'])} from the "
                                    "last progress")
        t.add_row("alerts", ", ".join(f"{a['kind']} {a['state']}" for a in doc["alerts"]) or "none")
        t.add_row("restarts", str(doc["restarts"]))
        t.add_row("outputs valid", f"{o.get('valid', 0)}/{o.get('expected', self.n)}")
        t.add_row("quarantined", "\n".join(f"{q['path']} ({q['reason']})" for q in doc["quarantine"])
                  or "none (no broken output)")
        t.add_row("job", doc["job_phase"] or "?")
        t.add_row("took", _fmt_s(doc["elapsed_s"]))
        if doc["workdir"]:
            t.add_row("kept", doc["workdir"])
        self.console.print(t)
        if doc["ok"]:
            self.console.print("[bold green]OK[/]: everything happened as it should.")
        else:
            self.console.print("[bold red]FAILED[/]:")
            for p in doc["problems"]:
                self.console.print(f"  - {p}", highlight=False)


def run_demo(fault: str = "hang", *, keep: bool = False, json_out: bool = False,
             pipeline: str = "http") -> int:
    """The `stallwatch demo` command: 0 when all went as it should, 2 otherwise, 3 unavailable."""
    from rich.console import Console

    console = Console(stderr=json_out)
    if pipeline == "torchrun":
        from stallwatch.commands.demo_torchrun import TorchrunDemo

        demo: Demo = TorchrunDemo(fault, keep=keep, console=console)
    else:
        demo = Demo(fault, keep=keep, console=console)
    try:
        doc = demo.run()
    except DemoUnavailable as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:
        console.print("interrupted: cleaned up")
        return 130
    except Exception as e:  # noqa: BLE001 - the demo itself broke: say so, exit 2
        doc = demo.summary()
        doc["ok"] = False
        doc["problems"].append(f"the demo failed: {type(e).__name__}: {e}")
    demo.render_table(doc)
    if json_out:
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    return 0 if doc["ok"] else 2


def _alert_sink(path: str) -> int:
    """The demo's `command` alert sink: the event (JSON on stdin) appended to a file that the
    demo narrates from."""
    data = sys.stdin.read().strip()
    if data:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(json.loads(data)) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--alert-sink":
        sys.exit(_alert_sink(sys.argv[2]))
    print("usage: python -m stallwatch.commands.demo --alert-sink FILE (the demo's alert sink; run "
          "`stallwatch demo` for the demo)", file=sys.stderr)
    sys.exit(3)
