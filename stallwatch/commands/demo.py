"""`stallwatch demo`: the pipeline stallwatch was built for, supervised, with a fault injected.

In a temporary directory: the protocol server (SGLang's HTTP protocol, a tiny model — pure
Python unless torch and CUDA are here), the reference extraction client writing one `.ckpt` per
sample as a supervised job of the real daemon (run in a thread of this process, with the default
rules), and an alert sink that narrates to the terminal (a `command` sink running
commands/demo_sink.py; plus desktop notifications when a session bus is there). The demo reads
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
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

from stallwatch.commands.demo_rig import (JOB, DemoUnavailable, LoopFS, device_args, pids_running,
                                          read_progress)
from stallwatch.commands.demo_story import DemoStory, Event
from stallwatch.daemon.core import Daemon
from stallwatch.daemon.state import StateDB
from stallwatch.errors import UsageError
from stallwatch.sglang.launch import ServerProcess

T = TypeVar("T")

FAULTS = ("hang", "io_stall", "crash", "server_hang")

NUM_SAMPLES = 48
FAULT_AT = 16
SEQ_LEN = 16
FORWARD_DELAY_S = 0.4  # one forward per sample: ~0.4 s a sample, a ~1 s-cadence job
INTERVAL_S = 0.5
DEADLINE_S = 240.0  # the whole demo; a healthy run takes about a minute
# The client's queued writes (`--max-pending-io`, 4 by default). One: when its writer hangs,
# the client's progress stops with the fault, not up to 4 samples later: time that "detected N s
# after the fault" counted (CI on a slowed host: 33.0 s) and the 30 s contract (docs/contract.md),
# which counts from the last progress, does not.
MAX_PENDING_IO = 1
# One job's share of a tick (daemon.job_tick_deadline_s, 0.5 s by default; its processes probe
# examines descendants for half of it, in wall time). On a loaded host a torchrun tree of 4
# processes took 0.7 s of wall time to read for 0.02 s of CPU: the ranks went unexamined (no
# culprit: the summary named the agent's bar position) and the job was ticked every 2.7 s.
# The demo supervises one small job: no other job needs protecting from its width.
JOB_TICK_DEADLINE_S = 10.0

log = logging.getLogger("stallwatch.commands.demo")


# ------------------------------------------------------------------------------ the demo
# What it tells and checks is DemoStory (commands/demo_story.py); its rig, commands/demo_rig.py.



class Demo(DemoStory):
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
        self.server: ServerProcess | None = None
        self.loopfs: LoopFS | None = None
        self.daemon: Daemon | None = None
        self.daemon_thread: threading.Thread | None = None
        self.db: StateDB | None = None
        self._log_handler: logging.Handler | None = None
        self._saved_logger: tuple[int, bool] | None = None
        # what happened
        self.fault_wall: float | None = None
        self.fault_how = ""
        self.last_progress_wall: float | None = None
        self.progress: tuple[int, int] | None = None
        self.progress_walls: list[float] = []  # when each new progress count was written
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

    @staticmethod
    def _ready(value: T | None, what: str) -> T:
        """A part of the rig that run() sets up before the step that uses it."""
        if value is None:
            raise RuntimeError(f"demo: {what} is not set up yet")
        return value

    # -- set-up ---------------------------------------------------------------------------

    def _start_server(self) -> None:
        from stallwatch.sglang import launch_server

        dev_args, self.model_text = device_args()
        args = [*dev_args, "--enable-metrics", "--enable-return-hidden-states",
                "--forward-delay-s", str(FORWARD_DELAY_S), "--no-access-log"]
        server = self.server = launch_server(args, log=str(self._ready(self.dir, "the directory") / "server.log"),
                                             die_with_parent=True, ready_timeout=120.0)
        kids = server.children()
        sched = kids.get("scheduler") or []
        self.scheduler_pid = sched[0] if sched else None
        self.say("server", f"SGLang-protocol server up at {server.url} (pid {server.pid}, "
                           f"scheduler pid {self.scheduler_pid}, detokenizer pid "
                           f"{(kids.get('detokenizer') or ['?'])[0]}): {self.model_text}")

    def _client_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "stallwatch.sglang.extract_client", "--server",
                self._ready(self.server, "the server").url, "--out", str(self.out), "--num-samples", str(self.n),
                "--seq-len", str(SEQ_LEN), "--max-pending-io", str(MAX_PENDING_IO), "--resume"]
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
argv = {q([sys.executable, "-m", "stallwatch.commands.demo_sink", str(self.alerts_file)])}
"""
        if session_bus_address() is not None:
            alerts += '\n[[alert]]\nname = "desktop"\ntype = "desktop"\n'
        return f"""# written by `stallwatch demo --fault {self.fault}`
[daemon]
interval_s = {INTERVAL_S}
state_dir = {q(str(self.state_dir))}
systemd_run = "never"
evidence_timeout_s = 10
job_tick_deadline_s = {JOB_TICK_DEADLINE_S:g}

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
        workdir = self._ready(self.dir, "the directory")
        path = workdir / "stallwatch.toml"
        path.write_text(text)
        cfg = parse_config(text, str(path), base=workdir, path=path)
        # The daemon's log goes to a file: the narration is what the terminal shows.
        lg = logging.getLogger("stallwatch")
        self._saved_logger = (lg.level, lg.propagate)
        h = logging.FileHandler(workdir / "daemon.log")
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False
        self._log_handler = h
        daemon = self.daemon = Daemon(cfg, install_signals=False)
        self.daemon_thread = threading.Thread(target=self._daemon_main, args=(daemon,),
                                              name="stallwatch-daemon", daemon=True)
        self.daemon_thread.start()
        if not daemon.started.wait(60):
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

    def _daemon_main(self, daemon: Daemon) -> None:
        try:
            daemon.run()
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
            pid = self._ready(self.scheduler_pid, "the scheduler's pid")
            os.kill(pid, signal.SIGSTOP)
            self.fault_wall = time.time()
            self.fault_how = f"SIGSTOP to the scheduler (pid {pid}, sglang::scheduler)"
            self.say("fault", f"kill -STOP {pid}: the server's scheduler stops; its HTTP process "
                              "still answers, the client waits for its answer")
        else:
            fs = self._ready(self.loopfs, "the loop-mounted filesystem")
            fs.freeze()
            self.fault_wall = time.time()
            self.fault_how = f"fsfreeze -f {fs.mnt} ({fs.dev})"
            self.say("fault", f"fsfreeze -f {fs.mnt}: the outputs filesystem "
                              f"({fs.dev}) completes no write; the client's writer "
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
            os.kill(self._ready(self.scheduler_pid, "the scheduler's pid"), signal.SIGCONT)
            self.operator_done = True
            self.say("operator", f"kill -CONT {self.scheduler_pid}: acting as the operator. "
                                 "stallwatch does not restart the client for server_hang (the "
                                 "fault is in the server: a restarted client would wait on it "
                                 "again); in real life you would restart the server. The client "
                                 "is still waiting on its request and goes on by itself")
        elif self.fault == "io_stall":
            fs = self._ready(self.loopfs, "the loop-mounted filesystem")
            if self.unkillable_seen is None:
                if since > 40.0:  # never said: thaw anyway (the check below reports it)
                    fs.thaw()
                    self.thawed_wall = time.time()
                    self.operator_done = True
                    self.say("operator", f"fsfreeze -u {fs.mnt}: the kill never said "
                                         "the writer was unkillable; thawing anyway")
                return
            if time.time() - self.unkillable_seen < 3.0:
                return  # show a few seconds of "waiting, no second writer"
            writers = pids_running("stallwatch.sglang.extract_client", str(self.out))
            runs = self._ready(self.db, "the state database").runs(JOB)
            if len(runs) > 1 or len(writers) > 1:
                self.second_writer = True
            self.say("check", f"{len(writers)} client process (pid "
                              f"{', '.join(map(str, writers)) or '-'}) and {len(runs)} run"
                              f"{'s' if len(runs) != 1 else ''} so far: no second writer was "
                              "started beside the one stuck in the kernel"
                              if not self.second_writer else
                              f"{len(writers)} client processes, {len(runs)} runs: a second "
                              "writer was started beside the stuck one!")
            fs.thaw()
            self.thawed_wall = time.time()
            self.operator_done = True
            self.say("operator", f"fsfreeze -u {fs.mnt}: acting as the operator, the "
                                 "storage answers again. The stuck write returns, the killed "
                                 "client can finally exit, and the recovery goes on")

    # -- what differs between the pipelines (demo_torchrun.TorchrunDemo overrides these) ------

    # How often the demo reads the state database and the log, in the daemon's process: each
    # read takes the GIL from the daemon's tick threads.
    POLL_S = 0.2

    JOB_WORDS = "extraction client"
    WHO = "the client"
    RESUME_WORDS = "with --resume it skips every sample already on disk and carries on"

    def _fault_words(self) -> str | None:
        return None

    def _read_progress(self) -> tuple[int, int] | None:
        return read_progress(self.job_log)

    def _fault_marker(self) -> Path:
        return self.out / ".stallwatch-fault-fired"

    def _progress_wall(self) -> float:
        """When the progress just read was written: the log's mtime (nothing else writes the log
        while the job makes progress). On a loaded host this poll can come seconds after the
        write, and the time from the last progress is the contract's measure."""
        try:
            return self.job_log.stat().st_mtime
        except OSError:
            return time.time()

    # -- reading the state database ------------------------------------------------------

    def _poll(self) -> None:
        db = self._ready(self.db, "the state database")
        prog = self._read_progress() if self.runs_seen else None
        if prog is not None and prog != self.progress:
            old = self.progress[0] if self.progress else -1
            self.progress = prog
            self.last_progress_wall = self._progress_wall()
            self.progress_walls.append(self.last_progress_wall)
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
            time.sleep(self.POLL_S)
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

    # -- clean-up --------------------------------------------------------------------------

    def _kill_job(self) -> None:
        """Whatever happened, leave no client behind: the daemon leaves jobs running by design."""
        from stallwatch.daemon.supervise import identity_alive

        try:
            runs = self.db.runs(JOB) if self.db is not None else []
        except Exception:  # noqa: BLE001 - cleaning up: a broken database must not leave the job running
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
                    shutil.copytree(self.loopfs.mnt, self._ready(self.dir, "the directory") / "outputs-from-image",
                                    ignore=shutil.ignore_patterns("lost+found"))
            self.loopfs.teardown()
        if self.dir is not None and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def run_demo(fault: str = "hang", *, keep: bool = False, json_out: bool = False,
             kind: type[Demo] = Demo) -> int:
    """The `stallwatch demo` command: 0 when all went as it should, 2 otherwise, 3 unavailable.
    `kind` is the pipeline: Demo (http), or demo_torchrun.TorchrunDemo, which the caller picks
    (it extends this module, so this module does not import it)."""
    from rich.console import Console

    console = Console(stderr=json_out)
    demo = kind(fault, keep=keep, console=console)
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

