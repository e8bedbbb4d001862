"""Slurm ending an allocation is not a crash (stallwatch.daemon.slurm, `[[job]] slurm_job_id`): the
scontrol parser on a real capture, the query through a real executable, and the daemon (in a
thread) with a job killed by SIGTERM while "Slurm" says the job is ending, says it is running,
or does not answer. The real Slurm is in tests/test_slurm_e2e.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from stallwatch.daemon.config import parse_config
from stallwatch.daemon.core import Daemon
from stallwatch.daemon.options import Actions
from stallwatch.errors import UsageError
from stallwatch.daemon.slurm import ended_by_slurm, job_state, parse_job_state
from stallwatch.daemon.state import StateDB

from daemonkit import daemon_in_thread
from rigs import wait_until

# `scontrol -o show job 3` right after `scancel 3` (slurm-wlm 22.05.8, Debian bookworm)
SCANCELLED = (
    "JobId=3 JobName=c.sbatch UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901757 "
    "Nice=0 Account=(null) QOS=(null) JobState=COMPLETING Reason=None Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:00:03 "
    "TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-01T15:28:59 NodeList=vm BatchHost=vm "
    "NumNodes=1 NumCPUs=1 NumTasks=1 Command=/tmp/fleet-slurm/c.sbatch WorkDir=/tmp/fleet-slurm\n")


def test_parse_job_state():
    assert parse_job_state(SCANCELLED) == "COMPLETING"
    assert parse_job_state(SCANCELLED.replace("COMPLETING", "RUNNING")) == "RUNNING"
    assert parse_job_state("slurm_load_jobs error: Invalid job id specified\n") is None
    assert parse_job_state("") is None
    # a job name cannot pose as the state: only a whole `JobState=` field counts
    assert parse_job_state("JobId=5 JobName=xJobState=CANCELLED JobState=RUNNING") == "RUNNING"
    assert ended_by_slurm("COMPLETING") and ended_by_slurm("CANCELLED") and ended_by_slurm("TIMEOUT")
    assert not ended_by_slurm("RUNNING") and not ended_by_slurm("OUT_OF_MEMORY")
    assert not ended_by_slurm(None)


def test_job_state_runs_scontrol_and_degrades_to_none(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\n[ \"$1 $2 $3 $4\" = '-o show job 3' ] || exit 1\n"
                    f"printf '%s' '{SCANCELLED.strip()}'\n")
    fake.chmod(0o755)
    assert job_state("3", scontrol=str(fake)) == "COMPLETING"
    assert job_state("4", scontrol=str(fake)) is None  # exit 1: no answer
    assert job_state("3; rm -rf /", scontrol=str(fake)) is None  # never passed on
    assert job_state("3", scontrol=str(tmp_path / "missing")) is None
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    t0 = time.monotonic()
    assert job_state("3", scontrol=str(slow), timeout_s=0.5) is None
    assert time.monotonic() - t0 < 10


def test_config_takes_a_slurm_job_id():
    base = '[[job]]\nname = "x"\ncommand = ["true"]\n'
    assert parse_config(base + 'slurm_job_id = "4242"\n', "t").job[0].slurm_job_id == "4242"
    assert parse_config(base + "slurm_job_id = 4242\n", "t").job[0].slurm_job_id == "4242"
    assert parse_config(base + 'slurm_job_id = "4242_7"\n', "t").job[0].slurm_job_id == "4242_7"
    with pytest.raises(UsageError, match="slurm_job_id"):
        parse_config(base + 'slurm_job_id = "42; true"\n', "t")


# ---------------------------------------------------------------- the daemon, in a thread

JOB = "echo 1/3; echo 2/3; sleep 0.5; kill -TERM $$"  # dies of SIGTERM, as scancel does it


def _daemon(tmp_path: Path, state_fn) -> Daemon:
    cfg = parse_config(f"""
[daemon]
interval_s = 0.1
state_dir = "{tmp_path / 'state'}"
systemd_run = "never"
evidence = false

[[job]]
name = "extract-0"
command = ["sh", "-c", {json.dumps(JOB)}]
log = "{tmp_path / 'job.log'}"
restart = "on-failure"
restart_backoff_s = 0.1
max_restarts = 1
slurm_job_id = "77"
""", "test")
    return Daemon(cfg, gpu=False, actions=Actions(slurm_job_state=state_fn), install_signals=False)


def _row(tmp_path: Path) -> tuple[dict, list]:
    db = StateDB.open_readonly(tmp_path / "state")
    try:
        return dict(db.job("extract-0") or {}), list(db.incidents("extract-0"))
    finally:
        db.close()


def test_a_job_killed_while_slurm_ends_the_allocation_stops_quietly(tmp_path):
    asked = []
    d = _daemon(tmp_path, lambda jid: asked.append(jid) or "COMPLETING")
    with daemon_in_thread(d):
        row = wait_until(lambda: (r := _row(tmp_path)[0]).get("phase") == "stopped" and r, 30,
                         "the job stopped")
        ticks = d.ticks
        wait_until(lambda: d.ticks > ticks + 5, 10, "more ticks")  # and it stays that way
    row, incidents = _row(tmp_path)
    assert asked == ["77"]
    assert incidents == []
    assert row["restarts"] == 0 and row["phase"] == "stopped"
    assert "Slurm is ending job 77 (JobState=COMPLETING" in row["phase_detail"]
    assert "killed by signal 15" in row["phase_detail"] and "not a crash" in row["phase_detail"]


def test_a_job_killed_while_slurm_says_running_is_a_crash(tmp_path):
    d = _daemon(tmp_path, lambda jid: "RUNNING")
    with daemon_in_thread(d):
        wait_until(lambda: _row(tmp_path)[0].get("restarts") == 1, 30, "the restart")
    _, incidents = _row(tmp_path)
    assert [i["kind"] for i in incidents] == ["crash"]


def test_slurm_that_does_not_answer_never_stalls_the_daemon(tmp_path):
    release = threading.Event()

    def stuck(jid):
        release.wait(60)
        return None  # no answer at all: judged as if there were no Slurm

    d = _daemon(tmp_path, stuck)
    with daemon_in_thread(d):
        try:
            wait_until(lambda: (tmp_path / "job.log").exists()
                       and "2/3" in (tmp_path / "job.log").read_text(), 30, "the job's progress")
            time.sleep(1.0)  # the job dies of SIGTERM 0.5 s after its last line
            ticks = d.ticks
            wait_until(lambda: d.ticks > ticks + 5, 10, "ticks while Slurm does not answer")
            assert _row(tmp_path)[1] == []  # judgment held, not a crash yet
            release.set()
            wait_until(lambda: _row(tmp_path)[1], 30, "the crash incident once the question failed")
        finally:
            release.set()  # first: a daemon stopping must not wait on the stuck question
    assert [i["kind"] for i in _row(tmp_path)[1]] == ["crash"]


def test_node_script_passes_the_task_environment_on_but_not_stallwatch_settings(tmp_path):
    """Supervised jobs get a built environment (PATH, locale, TMPDIR): the node script hands the
    task's own environment to the job as `env`, with slurm_job_id, and keeps STALLWATCH_* out."""
    import os
    import subprocess

    from stallwatch.daemon.config import load_config

    script = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "stallwatch-node.sh"
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_NODEID="1", SLURM_JOB_NUM_NODES="2",
               SLURM_STEP_ID="0", CUDA_VISIBLE_DEVICES="0,1,2,3", HF_HOME='/data/h"f\\home',
               STALLWATCH_WORKDIR=str(tmp_path / "w"),
               STALLWATCH_ALERT_WEBHOOK="https://hooks.example/secret", BAD="a\x1bb")
    r = subprocess.run([str(script), "--print-config", "python", "x.py"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    (tmp_path / "c.toml").write_text(r.stdout)
    (job,) = load_config(tmp_path / "c.toml").job
    assert job.slurm_job_id == "4242"
    assert job.env["SLURM_JOB_ID"] == "4242" and job.env["SLURM_NODEID"] == "1"
    assert job.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert job.env["HF_HOME"] == '/data/h"f\\home'
    assert not [k for k in job.env if k.startswith("STALLWATCH_")]
    assert "BAD" not in job.env and "BAD has control characters" in r.stderr
