"""Slurm for real (issue 19): Debian's slurm-wlm and MUNGE on localhost, started by the test with
a minimal slurm.conf in a temporary directory (its own ports, MUNGE socket and key; eight fake
"GPUs" as gres device files, so the shipped `--gpus-per-node=8` is satisfied), and the shipped
deploy/slurm/extract.sbatch submitted with `sbatch --nodes=1`.

    the shard stopped (SIGSTOP)   -> stallwatch kills and restarts it inside the allocation,
                                     it resumes from its outputs, the batch job is COMPLETED
    scancel of a running job      -> CANCELLED, no incident, no alert, no restart, and
                                     stallwatch-node.sh says the job was cancelled

Accounting: no slurmdbd (it needs a MySQL/MariaDB server). `JobCompType=jobcomp/filetxt` keeps a
completion record per job in a text file, and `sacct -c` (`--completion`, Slurm 22.05) reads it:
the final state of a job without any database.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from fleetkit import ROOT, Services, WebhookReceiver, free_port, stallwatch_exe
from rigs import kill_naming, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.root]

SBATCH = ROOT / "deploy" / "slurm" / "extract.sbatch"
JOB = ROOT / "tests" / "jobs" / "extract_like.py"
N_SAMPLES = 100


class Cluster:
    """munged, slurmctld and slurmd on localhost, all in the foreground under Services."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.host = subprocess.run(["hostname", "-s"], capture_output=True, text=True,
                                   check=True).stdout.strip()
        self.svc = Services(d)
        self.env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))

    def start(self) -> None:
        d = self.d
        (d / "munge").mkdir(mode=0o755)
        (d / "key").mkdir(mode=0o700)
        key = d / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = d / "munge" / "sock"
        self.svc.start("munged", ["munged", "--foreground", "--force", f"--socket={sock}",
                                  f"--key-file={key}", f"--pid-file={d / 'munge' / 'pid'}",
                                  f"--log-file={d / 'munge' / 'log'}",
                                  f"--seed-file={d / 'munge' / 'seed'}"])
        wait_until(sock.exists, 30, "the MUNGE socket")
        gpus = d / "gpus"
        gpus.mkdir()
        for i in range(8):
            (gpus / f"nvidia{i}").touch()
        for sub in ("ctld", "spool", "log"):
            (d / sub).mkdir()
        ctld_port, d_port = free_port(), free_port()
        (d / "gres.conf").write_text(f"NodeName={self.host} Name=gpu File={gpus}/nvidia[0-7]\n")
        (d / "slurm.conf").write_text(f"""\
ClusterName=stallwatch-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={d / 'ctld'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'ctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d / 'jobcomp.txt'}
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=30
GresTypes=gpu
NodeName={self.host} NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:8 State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        self.svc.start("slurmctld", ["slurmctld", "-D", "-i"], env=self.env)
        self.svc.start("slurmd", ["slurmd", "-D"], env=self.env)
        wait_until(lambda: self.slurm("sinfo", "-h", "-o", "%T").strip() == "idle", 60,
                   "the node idle in sinfo")

    def slurm(self, *argv: str, cwd: Path | None = None, env: dict | None = None) -> str:
        for name in ("munged", "slurmctld", "slurmd"):
            self.svc.alive(name)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                           env=env or self.env, cwd=cwd)
        return r.stdout if r.returncode == 0 else ""

    def final_state(self, job_id: str) -> str:
        """The batch job's state from the completion record (sacct -c), "" until it has one."""
        out = self.slurm("sacct", "-c", "-n", "-P", "-j", job_id, "-o", "jobid,state")
        for line in out.splitlines():
            jid, _, state = line.partition("|")
            if jid.strip() == job_id:
                return state.strip()
        return ""

    def close(self) -> None:
        self.svc.close()


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("needs root: munged, slurmctld and slurmd run as root here")
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch", "sacct", "scancel",
                           "scontrol", "sinfo") if not shutil.which(t)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian: apt-get install "
                    "--no-install-recommends slurm-wlm munge; .ci/run does)")
    # short: a unix socket's path has at most 107 bytes
    d = Path(tempfile.mkdtemp(prefix="sw-slurm-"))
    d.chmod(0o755)
    c = Cluster(d)
    try:
        c.start()
        yield c
    finally:
        c.close()
        kill_naming(str(d))
        shutil.rmtree(d, ignore_errors=True)


def submit(cluster: Cluster, work: Path, hook: WebhookReceiver) -> tuple[str, Path]:
    """The shipped batch script, as a user would submit it from the checkout, on one node."""
    sw = stallwatch_exe(work.parent / "bin")
    env = dict(cluster.env, EXTRACT_OUT=str(work / "out"), EXTRACT_PYTHON=sys.executable,
               EXTRACT_SCRIPT=str(JOB),
               EXTRACT_ARGS=f"--n {N_SAMPLES} --sample-s 0.1 --sample-bytes 256",
               STALLWATCH=str(sw), STALLWATCH_METRICS="",
               STALLWATCH_ALERT_WEBHOOK=hook.url("stallwatch"))
    out = cluster.slurm("sbatch", "--parsable", "--nodes=1", f"--chdir={work}",
                        f"--output={work}/slurm-%j.out", str(SBATCH), cwd=ROOT, env=env)
    job_id = out.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch said {out!r}"
    return job_id, work / "stallwatch" / job_id / cluster.host


def status(node_dir: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "stallwatch", "status", "--config",
                        str(node_dir / "stallwatch.toml"), "--json"], capture_output=True,
                       text=True, timeout=60, check=False, cwd=ROOT)
    try:
        return json.loads(r.stdout)["jobs"][0]
    except (ValueError, KeyError, IndexError):
        return {}


def progress(node_dir: Path) -> int:
    try:
        text = (node_dir / "job.log").read_text(errors="replace")
    except OSError:
        return 0
    last = text.replace("\r", "\n").strip().splitlines()[-1:] or [""]
    head = last[0].split("|")
    try:
        return int(head[2].split("/")[0]) if len(head) > 2 else 0
    except ValueError:
        return 0


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


@contextmanager
def running_shard(cluster: Cluster, tmp_path: Path, done: int):
    """The shipped batch script submitted; yields once its shard has done `done` samples under
    stallwatch: (job id, the node's stallwatch directory, the shard's pid, the batch's work
    directory, stallwatch's webhook receiver). Whatever is left is killed after."""
    hook = WebhookReceiver()
    work = tmp_path / "work"
    work.mkdir()
    try:
        job_id, node = submit(cluster, work, hook)
        pid = wait_until(lambda: progress(node) >= done and status(node).get("pid"), 90,
                         "the shard's progress under stallwatch")
        yield job_id, node, pid, work, hook
    finally:
        hook.close()
        kill_naming(str(work))
        for f in work.glob("slurm-*.out"):  # shown when the test fails
            print(f"--- {f.name}:\n{f.read_text(errors='replace')[-3000:]}")


def test_a_hung_shard_is_restarted_inside_the_allocation_and_the_job_completes(cluster, tmp_path):
    with running_shard(cluster, tmp_path, 10) as (job_id, node, first, work, hook):
        assert environ(first)["SLURM_JOB_ID"] == job_id  # started by the step, in the allocation
        os.kill(first, signal.SIGSTOP)  # the hang: alive, every thread in T, no progress
        second = wait_until(lambda: (s := status(node)).get("restarts") == 1 and s.get("pid")
                            not in (None, first) and s["pid"], 90, "stallwatch's restart")
        env = environ(second)
        assert env["SLURM_JOB_ID"] == job_id and env.get("SLURM_STEP_ID") == "0"
        state = wait_until(lambda: cluster.final_state(job_id), 120, "the batch job's end")
        assert state == "COMPLETED", (work / f"slurm-{job_id}.out").read_text()
        doc = status(node)
        assert doc["phase"] == "finished" and doc["restarts"] == 1
        (inc,) = doc["incidents"]
        assert inc["kind"] == "hang" and inc["resolved_at"]
        outs = sorted(p.name for p in (work / "out").rglob("data_*.pt"))
        assert len(outs) == N_SAMPLES  # every sample, none twice: resumed, not redone
        log = (node / "job.log").read_text(errors="replace")
        assert "skipped=" in log and f"{N_SAMPLES}/{N_SAMPLES}" in log
        err = (work / f"slurm-{job_id}.out").read_text()
        assert "the job finished" in err
        fired = hook.wait(lambda d: d.body.get("state") == "firing", 30, "stallwatch's alert")
        assert fired.body["job"] == "extract-0" and fired.body["kind"] == "hang"


def test_scancel_is_not_a_crash(cluster, tmp_path):
    with running_shard(cluster, tmp_path, 5) as (job_id, node, pid, work, hook):
        cluster.slurm("scancel", job_id)
        state = wait_until(lambda: cluster.final_state(job_id), 60, "the cancelled job's end")
        assert state.startswith("CANCELLED"), state
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), 30, "the shard gone")
        said = f"Slurm job {job_id} was cancelled"
        out = wait_until(lambda: said in (t := (work / f"slurm-{job_id}.out").read_text()) and t,
                         30, "stallwatch-node.sh saying the job was cancelled")
        assert "not a crash" in out
        # by the SIGTERM, or by asking Slurm: either order; the daemon records it on its next
        # tick after the job's exit, which can come after the shard is gone and the script spoke
        doc = wait_until(lambda: (d := status(node))["phase"] == "stopped" and d, 20,
                         "stallwatch to record the job stopped")
        assert doc["incidents"] == [] and doc["restarts"] == 0, doc
        time.sleep(1.0)  # an alert sent at the very end would arrive now
        assert [d.body for d in hook.deliveries] == []
