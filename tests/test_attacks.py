"""Issue 22's attacks, run for real against a root daemon by a job whose user is uid 65534,
each shown failing, in both of attackrig's modes (setsid, and the unit's filesystem view).

One daemon per mode runs every attack at once (each attack is its own job, its files in the
attacker's directory); each test then checks one attack's outcome. docs/security.md lists the
attacks, what stops each, and these tests. Root only (skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from attackrig import ATTACKER, MODES, AttackRig

pytestmark = [pytest.mark.root, pytest.mark.slow]

SECRET_URL = "http://127.0.0.1:9/hook/SWATK-SECRET-URL-0123456789"
AWS_SECRET = "SWATK-AWS-SECRET-abcdef"


def _attack_1(rig: AttackRig) -> None:
    """#1: the log made a symlink to a root file, then a crash: the restart must not append the
    job's output to it. Twice: `user` in the config, and setpriv in the command (root-started
    job that drops by itself; the daemon does not know the user)."""
    victim = rig.victim("passwd-1", b"root:x:0:0::/root:/bin/sh\n", 0o644)
    script = rig.user_script("a1.py", f"""
        import os, sys
        here = os.path.dirname(os.path.abspath(__file__))
        name = sys.argv[1]
        marker = os.path.join(here, name + ".ran")
        if not os.path.exists(marker):
            open(marker, "w").close()
            print("run 1", flush=True)
            log = os.path.join(here, name + ".log")
            os.unlink(log)
            os.symlink({str(victim)!r}, log)
            sys.exit(1)
        print("evil::0:0::/root:/bin/sh", flush=True)
        sys.exit(1)
    """)
    for name, how in (("a1", 'user = "65534"'), ("a1s", "")):
        cmd = [rig.python, str(script), name]
        if not how:
            cmd = rig.as_user(*cmd)
        rig.add_job(f"""
            name = "{name}"
            command = {rig.toml_list(cmd)}
            log = "{rig.home}/{name}.log"
            restart = "on-failure"
            max_restarts = 1
            restart_backoff_s = 0.2
            {how}
        """)


def _attack_6_13(rig: AttackRig) -> None:
    """#6: pid_file symlinked to /dev/zero; #13: pid_file naming pid 1, and one naming a root
    process (not the job's user)."""
    for name in ("a6", "a13", "a13r"):
        rig.add_job(f"""
            name = "{name}"
            pid_file = "{rig.home}/{name}.pid"
        """)
    r = rig.run_as_user("ln", "-s", "/dev/zero", str(rig.home / "a6.pid"))
    assert r.returncode == 0, r.stderr
    r = rig.run_as_user("sh", "-c", f"echo 1 > {rig.home}/a13.pid")
    assert r.returncode == 0, r.stderr
    rig.root_sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    r = rig.run_as_user("sh", "-c", f"echo {rig.root_sleeper.pid} > {rig.home}/a13r.pid")
    assert r.returncode == 0, r.stderr


def _attack_7(rig: AttackRig) -> None:
    """#7: the job reads its environment (and its parents'), looking for the daemon's secrets."""
    script = rig.user_script("a7.py", """
        import os, sys
        out = []
        out.append(repr(dict(os.environ)))
        pid = os.getppid()
        for p in (os.getpid(), pid):
            try:
                out.append(open(f"/proc/{p}/environ", "rb").read().decode(errors="replace"))
            except OSError as e:
                out.append(f"pid {p}: {e.strerror}")
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "a7.env"), "w") as f:
            f.write("\\n".join(out))
    """)
    rig.add_job(f"""
        name = "a7"
        command = {rig.toml_list([rig.python, str(script)])}
        log = "{rig.home}/a7.log"
        user = "65534"
    """)
    rig.alerts_text = """
        [[alert]]
        type = "webhook"
        url_env = "SWATK_HOOK_URL"
        max_attempts = 1
    """


@pytest.fixture(scope="module", params=MODES)
def attacked(request: pytest.FixtureRequest) -> Iterator[AttackRig]:
    with AttackRig(request.param) as rig:
        rig.root_sleeper = None
        _attack_1(rig)
        _attack_6_13(rig)
        _attack_7(rig)
        rig.start(env={"SWATK_HOOK_URL": SECRET_URL, "AWS_SECRET_ACCESS_KEY": AWS_SECRET})
        try:
            yield rig
        finally:
            if rig.root_sleeper is not None:
                rig.root_sleeper.kill()
                rig.root_sleeper.wait()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", ["a1", "a1s"])
def test_1_log_symlinked_to_a_root_file_is_never_written_at_the_restart(
        attacked: AttackRig, name: str) -> None:
    rig = attacked
    victim = rig.victim_path("passwd-1")
    before = victim.read_bytes()
    rig.wait_for(lambda: rig.phase(name) == "stopped", 60, f"{name} to give up")
    assert victim.read_bytes() == before == b"root:x:0:0::/root:/bin/sh\n"
    st = victim.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o644)
    # It was restarted, and the restart refused the log rather than follow the link.
    outcomes = [a["outcome"] for a in rig.actions(name)]
    assert any(o.startswith("started run 2") for o in outcomes), outcomes
    assert (rig.home / f"{name}.log").is_symlink()
    assert "symlink" in rig.daemon_log() and "cannot open the log" in rig.daemon_log()


def test_6_pid_file_symlinked_to_dev_zero_is_refused_with_bounded_memory(
        attacked: AttackRig) -> None:
    rig = attacked
    rig.wait_for(lambda: "job a6: pid_file refused" in rig.daemon_log(), 30,
                 "the a6 pid_file refusal in the daemon's log")
    line = next(ln for ln in rig.daemon_log().splitlines() if "job a6: pid_file refused" in ln)
    assert "symlink" in line, line
    assert _rss_bytes(rig.daemon.pid) < 400 << 20  # it was 8.2 GB in 17 s before
    assert (rig.job("a6") or {}).get("pid") is None


def test_13_pid_file_naming_pid_1_or_a_root_process_is_refused(attacked: AttackRig) -> None:
    rig = attacked
    rig.wait_for(lambda: "job a13: pid_file refused" in rig.daemon_log()
                 and "job a13r: pid_file refused" in rig.daemon_log(), 30,
                 "both pid_file refusals")
    log = rig.daemon_log()
    assert "names pid 1: never a job" in log
    assert f"pid {rig.root_sleeper.pid} runs as uid 0, not the job's uid {ATTACKER}" in log
    for name in ("a13", "a13r"):
        assert (rig.job(name) or {}).get("pid") is None, rig.job(name)
    # The root process named was left alone.
    assert rig.root_sleeper.poll() is None


def test_7_the_job_never_sees_the_daemons_secrets(attacked: AttackRig) -> None:
    rig = attacked
    env_file = rig.home / "a7.env"
    rig.wait_for(env_file.exists, 30, "the a7 job's environment dump")
    text = env_file.read_text()
    assert "'PATH'" in text and "'HOME'" in text  # it did read its environment
    assert SECRET_URL not in text and "SWATK_HOOK_URL" not in text
    assert AWS_SECRET not in text and "AWS_SECRET_ACCESS_KEY" not in text
    # Its parent (the wrapper, root) is not readable to it at all.
    assert "Permission denied" in text
