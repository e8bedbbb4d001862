"""Slurm: is the allocation a job runs in being ended by Slurm itself?

`scancel`, a time limit or a preemption ends a job the same way: slurmctld marks it (JobState
COMPLETING at once, then CANCELLED, TIMEOUT or PREEMPTED), and slurmstepd sends SIGCONT and
SIGTERM (SIGKILL after KillWait) to every process of the job's steps — the supervised job and
stallwatch alike, in no order anyone controls (proctrack/cgroup or linuxproc). So a job that died
of a signal while its stallwatch was still ticking may be a crash or the end of the allocation;
only slurmctld knows, and it knows before any process is signalled. `[[job]] slurm_job_id`
(written by deploy/slurm/stallwatch-node.sh) makes the daemon ask before it calls such a death a
crash: an ending allocation is not an incident, and a job is never restarted into it.

Checked against Slurm 22.05 (Debian bookworm's slurm-wlm 22.05.8): right after `scancel`,
`scontrol -o show job ID` says `JobState=COMPLETING ... ExitCode=0:15`, and `CANCELLED` once the
steps are gone. The answer comes from slurmctld, not from anything the job's user writes.
"""

from __future__ import annotations

import re
import shutil
import subprocess

# Job states in which Slurm itself is ending the allocation (squeue(1), "JOB STATE CODES").
# OUT_OF_MEMORY and FAILED are the job's own doing: a crash, judged as one.
ENDING = frozenset({"COMPLETING", "CANCELLED", "TIMEOUT", "PREEMPTED", "DEADLINE", "NODE_FAIL",
                    "BOOT_FAIL", "COMPLETED"})

JOB_ID = re.compile(r"^[0-9]+(?:_[0-9]+)?$")  # 4242, or an array task 4242_7

_STATE = re.compile(r"(?:^|\s)JobState=([A-Z_]+)(?:\s|$)")


def parse_job_state(text: str) -> str | None:
    """JobState from `scontrol -o show job ID` (one line per job; the first one)."""
    for line in text.splitlines():
        m = _STATE.search(line)
        if m:
            return m.group(1)
    return None


def job_state(job_id: str, *, scontrol: str | None = None, timeout_s: float = 10.0) -> str | None:
    """slurmctld's state of the job, or None when it cannot be had (no scontrol, slurmctld down
    or slow, a job already purged): then the caller judges as if there were no Slurm."""
    if not JOB_ID.match(job_id):
        return None
    exe = scontrol or shutil.which("scontrol")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "-o", "show", "job", job_id], capture_output=True, text=True,
                           timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return parse_job_state(r.stdout)


def ended_by_slurm(state: str | None) -> bool:
    return state in ENDING
