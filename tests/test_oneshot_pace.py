"""One-shot truth: `stallwatch diagnose` learns a job's pace from what the log and the kernel keep.

Real jobs (tests/jobs/paced.py) log `processed N/TOTAL items` 20 times a second, each line in one
of the timestamp styles jobs print, then get stuck: spin on the CPU or deadlock. Once each has been
silent for STUCK_S, one `diagnose --json` (its 3 s window) must call it `hang`, with the source
of the pace in the evidence, although it never saw the job move. The same styles, healthy, stay
`healthy` and "making progress".

Every spinning job shares ONE core with a CPU hog and with each other (sched_setaffinity): each
gets a small fraction of it, and is still spinning because it never leaves the run queue.

All jobs start at once and age together (one wait for all); the healthy ones are diagnosed during
that wait, the stuck ones in parallel after it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from rigs import (Diagnosis, cpu_hogs, pin, run_diagnose, shared_core, spawned, task_state,
                  thread_ids, wait_until)

JOB = Path(__file__).resolve().parent / "jobs" / "paced.py"
STUCK_S = 40.0
PER_S = 20.0
STALL_AT = 100  # 5 s of history at 20 a second
PLAIN_REGEX = r"processed (?P<done>\d+) items"

# style -> what the evidence must name as the pace's source
STYLES = {
    "iso": "of the log's timestamps",
    "logging": "of the log's timestamps",
    "bracket": "of the log's timestamps",
    "hms": "of the log's timestamps",
    "epoch": "of the log's timestamps",
    "tqdm": "tqdm's rate",
    "plain": "since pid",  # done ÷ run time: "done 100 ÷ 45 s since pid N started"
}
STALLS = ("spin", "deadlock")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


@dataclass
class Job:
    style: str
    stall: str | None
    proc: subprocess.Popen
    log: Path

    @property
    def key(self) -> str:
        return f"{self.style}-{self.stall or 'healthy'}"

    def log_age(self) -> float:
        return time.time() - self.log.stat().st_mtime

    def done(self) -> int:
        hits = re.findall(rb"(?:processed |\| )(\d+)", self.log.read_bytes()[-400:])
        return int(hits[-1]) if hits else 0


def diagnose(job: Job) -> Diagnosis:
    args = ["--pid", str(job.proc.pid), "--log", str(job.log)]
    if job.style == "plain":
        args += ["--progress-regex", PLAIN_REGEX]
    return run_diagnose(args)


def _stuck_in_place(job: Job) -> bool:
    if job.done() != STALL_AT:
        return False
    if job.stall == "spin":
        return task_state(job.proc.pid) == "R"
    tids = thread_ids(job.proc.pid)
    return len(tids) == 3 and all(task_state(job.proc.pid, t) == "S" for t in tids)


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[Job, Diagnosis]]:
    core = shared_core()
    out: dict[str, tuple[Job, Diagnosis]] = {}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stallwatch-oneshot-")))
        stack.enter_context(cpu_hogs(core, 1))
        jobs = []
        for style in STYLES:
            for stall in (*STALLS, None):
                log = work / f"{style}-{stall or 'healthy'}.log"
                argv = [sys.executable, str(JOB), "--log", str(log), "--style", style,
                        "--per-s", str(PER_S)]
                if stall:
                    argv += ["--stall-at", str(STALL_AT), "--stall", stall]
                proc = stack.enter_context(spawned(argv, stdin=subprocess.DEVNULL))
                if stall == "spin":
                    pin(proc.pid, core)  # all spinners and the hog on one core
                jobs.append(Job(style, stall, proc, log))
        stuck = [j for j in jobs if j.stall]
        healthy = [j for j in jobs if not j.stall]
        # diagnose mostly waits out its 3 s window: seven at once share two cores well
        with ThreadPoolExecutor(7) as pool:
            # Healthy jobs: diagnosed once they have a few seconds of history, while the stuck age.
            wait_until(lambda: all(j.log.exists() and j.done() >= 3 * PER_S for j in healthy), 60,
                       "healthy jobs to log 3 s of progress")
            for j, d in zip(healthy, pool.map(diagnose, healthy), strict=True):
                out[j.key] = (j, d)
            for j in stuck:
                wait_until(lambda j=j: _stuck_in_place(j), 60, f"{j.key} to be stuck at {STALL_AT}")
            wait_until(lambda: min(j.log_age() for j in stuck) >= STUCK_S, STUCK_S + 60,
                       f"every stuck job's log to be silent for {STUCK_S:g} s")
            for j, d in zip(stuck, pool.map(diagnose, stuck), strict=True):
                out[j.key] = (j, d)
    return out


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("stall", STALLS)
def test_stuck_40s_is_hang_with_the_pace_and_its_source(results, style, stall):
    job, d = results[f"{style}-{stall}"]
    pid = job.proc.pid
    assert d.kind == "hang" and d.rc == 2, d
    assert d.doc["progress"]["done"] == STALL_AT, d
    assert d.doc["progress"]["last_progress_age_s"] >= STUCK_S, d
    # The threshold follows the pace (20 a second: the 20 s floor), not the 120 s default.
    assert d.doc["progress"]["stall_threshold_s"] == 20.0, d
    assert not d.doc["progress"]["stall_threshold_why"].startswith("default"), d
    (pace,) = d.evidence("pace")
    assert pace.startswith("no progress for ") and " before (pace from " in pace, d
    assert STYLES[style] in pace, d
    if style == "plain":
        # done ÷ run time, the last resort: an average over the run, stuck time included
        assert f"since pid {pid} started" in pace, d
    else:  # ~20 a second, or fewer on a loaded node (the job's sleeps run late)
        assert "a second before" in pace, d
    if stall == "spin":
        assert d.doc["verdict"]["summary"].endswith("spinning on the CPU"), d
        (runq,) = d.evidence("runqueue")
        assert runq.startswith(f"tid {pid} (") and "never left the run queue" in runq, d
        share = float(re.search(r"got (\d+)% of a core", runq)[1])
        assert share < 80, f"seven spinners and a hog share one core: {runq}"
    else:
        assert d.doc["verdict"]["summary"].endswith("every thread asleep"), d
        assert d.evidence("runqueue") == [], d


@pytest.mark.parametrize("style", STYLES)
def test_healthy_job_with_the_same_log_style_stays_healthy(results, style):
    _job, d = results[f"{style}-healthy"]
    assert d.kind == "healthy" and d.rc == 0, d
    assert "is making progress" in d.doc["verdict"]["summary"], d
    assert d.doc["progress"]["last_progress_age_s"] < 5, d
    (pace,) = d.evidence("pace")
    assert pace.startswith("pace ~"), d
