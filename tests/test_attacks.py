"""Issue 22's attacks, run for real against a root daemon by a job whose user is uid 65534,
each shown failing, in both of attackrig's modes (setsid, and the unit's filesystem view).

One daemon per mode runs every attack at once (each attack is its own job, its files in the
attacker's directory); each test then checks one attack's outcome. docs/security.md lists the
attacks, what stops each, and these tests. Root only (skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from collections.abc import Iterator

import pytest
from attackrig import ATTACKER, MODES, AttackRig

pytestmark = [pytest.mark.root, pytest.mark.slow]

SECRET_URL = "http://127.0.0.1:9/hook/SWATK-SECRET-URL-0123456789"
AWS_SECRET = "SWATK-AWS-SECRET-abcdef"
LOG_SECRET = "SWATK-LOG-SECRET-987654"
EVIL_NAME = "data_$(touch PWNED).pt"

# Every job's script runs its attack on the first run only (a marker file), then exits 0.
ONCE = """
import os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
name = sys.argv[1]
marker = os.path.join(here, name + ".ran")
if os.path.exists(marker):
    print("second run: nothing to do", flush=True)
    sys.exit(0)
open(marker, "w").close()
"""


def _two_ways(rig: AttackRig, name: str, script: Path, extra: str = "") -> None:
    """Two jobs running `script NAME`: `name` with `user = "65534"` in the config, `name`+"s"
    dropping by itself through setpriv (the daemon does not know its user)."""
    for job, how in ((name, 'user = "65534"'), (name + "s", "")):
        cmd = [rig.python, str(script), job]
        rig.add_job(f"""
            name = "{job}"
            command = {rig.toml_list(cmd if how else rig.as_user(*cmd))}
            log = "{rig.home}/{job}.log"
            {how}
        """ + extra)


def _resumed_job(rig: AttackRig, name: str, script: Path, extra: str = "") -> None:
    """A job of the user's writing `<home>/<name>.out`, killed and resumed once on failure (its
    outputs validated in between): `script NAME` attacks on its first run."""
    rig.add_job(f"""
        name = "{name}"
        command = {rig.toml_list([rig.python, str(script), name])}
        log = "{rig.home}/{name}.log"
        outputs = "{rig.home}/{name}.out"
        user = "65534"
        restart = "on-failure"
        max_restarts = 1
        restart_backoff_s = 0.2
    """ + extra)


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
    _two_ways(rig, "a1", script, 'restart = "on-failure"\nmax_restarts = 1\n'
                                 "restart_backoff_s = 0.2")


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


def _attack_2(rig: AttackRig) -> None:
    """#2: the old default quarantine `<outputs>.quarantine` made a symlink to a root directory,
    a broken output named like a shell command; and (a2q) an admin-set quarantine in the user's
    directory, made a symlink to a root directory."""
    for d in ("etc2", "etc2q"):
        rig.victim_path(d).mkdir(mode=0o755)
    script = rig.user_script("a2.py", ONCE + f"""
out = os.path.join(here, name + ".out")
os.makedirs(out, exist_ok=True)
os.symlink({str(rig.victim_path("etc2"))!r}, out + ".quarantine")
os.symlink({str(rig.victim_path("etc2q"))!r}, os.path.join(here, name + ".q"))
with open(os.path.join(out, {EVIL_NAME!r}), "wb") as f:
    f.write(b"PK not really a zip")
sys.exit(1)
""")
    _resumed_job(rig, "a2", script)
    _resumed_job(rig, "a2q", script, f'quarantine = "{rig.home}/a2q.q"')


def _attack_3(rig: AttackRig) -> None:
    """#3: the desktop spool in the user's directory made a symlink to a root directory (the
    old code chowned it to the user); and a status file forged into runs/ (what that chown made
    possible), once owned by the user, once by root but naming a process that is no wrapper."""
    rig.victim_path("d3").mkdir(mode=0o700)
    r = rig.run_as_user("ln", "-s", str(rig.victim_path("d3")), str(rig.home / "spool"))
    assert r.returncode == 0, r.stderr
    rig.alerts_text += f"""
        [[alert]]
        type = "desktop"
        mode = "spool"
        user = "nobody"
        spool_dir = "{rig.home}/spool"
    """
    victim = subprocess.Popen(["sleep", "600"], start_new_session=True)
    rig.forged_victim = victim
    ticks = int(Path(f"/proc/{victim.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    runs = rig.state / "runs"
    runs.mkdir(parents=True, mode=0o700, exist_ok=True)
    rig.state.chmod(0o700)
    doc = {"version": 1, "job": "a3f", "state": "running", "pid": victim.pid,
           "start_ticks": ticks, "pgid": victim.pid, "wrapper_pid": victim.pid,
           "wrapper_start_ticks": ticks, "argv": ["sleep"], "started_at": 0}
    for seq, owner in ((5, ATTACKER), (6, 0)):
        f = runs / f"a3f-{seq}.json"
        f.write_text(json.dumps(doc))
        os.chown(f, owner, owner)
        f.chmod(0o644 if owner else 0o600)
    script = rig.user_script("a3f.py", "import time\ntime.sleep(600)\n")
    rig.add_job(f"""
        name = "a3f"
        command = {rig.toml_list([rig.python, str(script)])}
        log = "{rig.home}/a3f.log"
        user = "65534"
    """)


def _attack_4(rig: AttackRig) -> None:
    """#4: the outputs' sub-directory swapped for a symlink right after it is listed (timed with
    inotify: the listing opens it), and swapped back 50 ms later, again and again: at a root
    directory holding a device node named like the broken output, and at another user's 0700
    directory. Against the path-based code this deleted a device node and moved another user's
    file (issue 22); whether the swap lands between walk and move is timing, so the assertions
    hold for every interleaving: nothing outside the job's directory is touched."""
    devdir = rig.victim_path("dev4")
    devdir.mkdir(mode=0o700)
    os.mknod(devdir / "data_0.pt", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    rig.other_file("data_0.pt", b"another user's broken checkpoint")
    script = rig.user_script("a4.py", ONCE + f"""
import ctypes, select, struct
out = os.path.join(here, name + ".out")
sub = os.path.join(out, "sub")
os.makedirs(sub, exist_ok=True)
with open(os.path.join(sub, "data_0.pt"), "wb") as f:
    f.write(b"PK broken")
if os.fork() == 0:  # the racer: its own session, so the kill of the job's group misses it
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    ifd = libc.inotify_init1(0)
    libc.inotify_add_watch(ifd, os.fsencode(sub), 0x20)  # IN_OPEN: someone lists it
    targets = [{str(devdir)!r}, {str(rig.other)!r}]
    end = time.monotonic() + 15
    i = 0
    while time.monotonic() < end:
        if not select.select([ifd], [], [], 0.5)[0]:
            continue
        buf = os.read(ifd, 65536)
        listed = False
        while buf:
            _, mask, _, n = struct.unpack("iIII", buf[:16])
            listed |= n == 0  # the directory itself, not a file in it
            buf = buf[16 + n:]
        if not listed:
            continue
        try:
            os.rename(sub, sub + ".real")
            os.symlink(targets[i % 2], sub)
            time.sleep(0.05)
            os.unlink(sub)
            os.rename(sub + ".real", sub)
        except OSError:
            pass
        i += 1
    os._exit(0)
time.sleep(0.3)
sys.exit(1)
""")
    _resumed_job(rig, "a4", script, "validate_window_s = 3600")


def _attack_5(rig: AttackRig) -> None:
    """#5: the log replaced by a symlink to a root-only file whose last line is a secret, then a
    crash: the alert (and its evidence) must not carry it. Twice: `user` set, and setpriv."""
    # Shaped as a traceback: the crash rule quotes a log's fatal line in its evidence.
    secret = rig.victim("secret5", ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                                    f"RuntimeError: AWS_SECRET_ACCESS_KEY={LOG_SECRET}\n").encode(),
                        0o600)
    script = rig.user_script("a5.py", ONCE + f"""
print("step 1 of 3", flush=True)
log = os.path.join(here, name + ".log")
os.unlink(log)
os.symlink({str(secret)!r}, log)
time.sleep(1.5)
sys.exit(1)
""")
    _two_ways(rig, "a5", script)
    sink = rig.victim_path("alerts.jsonl")
    argv = [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'ab'); "
            "f.write(sys.stdin.buffer.read() + bytes([10]))", str(sink)]
    rig.alerts_text += f"""
        [[alert]]
        type = "command"
        argv = {rig.toml_list(argv)}
    """


def _attack_12(rig: AttackRig) -> None:
    """#12 (the walk): a 1,500-deep directory tree in the outputs, then a crash: the validation
    walked it recursively (25 s of CPU, then RecursionError, and the daemon gave up)."""
    script = rig.user_script("a12.py", ONCE + """
out = os.path.join(here, name + ".out")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "data_0.pt"), "wb") as f:
    f.write(b"broken")
fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
for _ in range(1500):
    os.mkdir("d", dir_fd=fd)
    nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = nfd
sys.exit(1)
""")
    _resumed_job(rig, "a12", script)


@pytest.fixture(scope="module", params=MODES)
def attacked(request: pytest.FixtureRequest) -> Iterator[AttackRig]:
    with AttackRig(request.param) as rig:
        rig.root_sleeper = rig.forged_victim = None
        _attack_7(rig)  # first: it sets the alerts that the others add to
        _attack_1(rig)
        _attack_2(rig)
        _attack_3(rig)
        _attack_4(rig)
        _attack_5(rig)
        _attack_6_13(rig)
        _attack_12(rig)
        rig.start(env={"SWATK_HOOK_URL": SECRET_URL, "AWS_SECRET_ACCESS_KEY": AWS_SECRET})
        try:
            yield rig
        finally:
            for p in (rig.root_sleeper, rig.forged_victim):
                if p is not None:
                    p.kill()
                    p.wait()


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


def test_2_quarantine_and_manifest_live_on_roots_side_names_kept_as_data(
        attacked: AttackRig) -> None:
    rig = attacked
    q = rig.state / "quarantine" / "a2"
    rig.wait_for(lambda: (q / "MANIFEST.jsonl").exists() and rig.phase("a2") == "finished", 60,
                 "a2's broken output quarantined and its second run finished")
    assert list(rig.victim_path("etc2").iterdir()) == []  # the old default's symlink: unused
    st = q.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
    assert (q / EVIL_NAME).is_file() and not (rig.home / "a2.out" / EVIL_NAME).exists()
    line, = (q / "MANIFEST.jsonl").read_text().splitlines()
    doc = json.loads(line)
    assert doc["relative"] == [EVIL_NAME] and doc["dst"] == str(q / EVIL_NAME)
    # never run by a shell anywhere it could have been (the daemon's cwd, the job's, root's)
    assert [d for d in (rig.admin, rig.home, rig.state, rig.vault, q, Path("/"))
            if (d / "PWNED").exists()] == []


def test_2_a_quarantine_set_in_the_users_directory_is_not_followed(attacked: AttackRig) -> None:
    rig = attacked
    rig.wait_for(lambda: rig.phase("a2q") == "stopped", 60, "a2q to give up")
    assert list(rig.victim_path("etc2q").iterdir()) == []
    validate = [a["outcome"] for a in rig.actions("a2q", "validate")]
    assert any("symlink" in o for o in validate), validate
    gave_up = [a["outcome"] for a in rig.actions("a2q", "give_up")]
    assert any("could not be moved aside" in o or "quarantine" in o for o in gave_up), gave_up
    assert (rig.home / "a2q.out" / EVIL_NAME).exists()  # left in place, not lost


def test_3_a_desktop_spool_symlinked_to_a_root_directory_is_never_chowned(
        attacked: AttackRig) -> None:
    rig = attacked
    rig.wait_for(lambda: "desktop spool" in rig.daemon_log(), 60, "a desktop delivery attempt")
    d3 = rig.victim_path("d3")
    st = d3.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700)
    assert list(d3.iterdir()) == []
    assert "home/spool: is a symlink: not followed" in rig.daemon_log()


def test_3_a_forged_status_file_is_never_adopted(attacked: AttackRig) -> None:
    rig = attacked
    rig.wait_for(lambda: rig.phase("a3f") == "running", 60, "a3f to run its own process")
    runs = rig.q("SELECT * FROM runs WHERE job = 'a3f'")
    assert runs and all(r["pid"] != rig.forged_victim.pid for r in runs), runs
    assert all(r["seq"] > 6 for r in runs), runs  # never reused the forged numbers either
    assert rig.job("a3f")["pid"] != rig.forged_victim.pid
    assert rig.forged_victim.poll() is None  # root's process: neither adopted nor signalled
    assert "not a wrapper of ours" in rig.daemon_log()


def test_4_outputs_flipped_to_symlinks_during_validation_touch_nothing_outside(
        attacked: AttackRig) -> None:
    rig = attacked
    rig.wait_for(lambda: rig.phase("a4") in ("finished", "stopped"), 90, "a4's recovery to end")
    assert rig.actions("a4", "validate"), rig.actions("a4")
    dev = rig.victim_path("dev4") / "data_0.pt"
    assert stat.S_ISCHR(os.lstat(dev).st_mode)  # the device node is still there
    assert (rig.other / "data_0.pt").read_bytes() == b"another user's broken checkpoint"
    q = rig.state / "quarantine" / "a4"
    size = sum(p.stat().st_size for p in q.rglob("*") if p.is_file()) if q.exists() else 0
    assert size < 1 << 20, size  # no unbounded copy of /dev/zero
    assert _rss_bytes(rig.daemon.pid) < 400 << 20


@pytest.mark.parametrize("name", ["a5", "a5s"])
def test_5_a_log_symlinked_to_a_root_secret_never_reaches_alerts(attacked: AttackRig,
                                                                  name: str) -> None:
    rig = attacked
    sink = rig.victim_path("alerts.jsonl")
    rig.wait_for(lambda: sink.exists() and f'"job": "{name}"' in sink.read_text()
                 and rig.phase(name) == "stopped", 60, f"{name}'s crash alert")
    rig.wait_for(lambda: f"job {name}: log refused: " in rig.daemon_log(), 30, "the refusal")
    assert LOG_SECRET not in sink.read_text()
    assert LOG_SECRET not in rig.daemon_log()
    assert LOG_SECRET not in json.dumps(rig.q("SELECT * FROM incidents"))
    assert rig.victim_path("secret5").read_bytes().endswith(f"{LOG_SECRET}\n".encode())


def test_12_a_1500_deep_outputs_tree_is_walked_to_a_bound_and_the_job_resumed(
        attacked: AttackRig) -> None:
    rig = attacked
    rig.wait_for(lambda: rig.phase("a12") in ("finished", "stopped"), 60, "a12's recovery")
    validate, = rig.actions("a12", "validate")
    assert "quarantined 1" in validate["outcome"] and "max_depth=64" in validate["outcome"]
    assert rig.phase("a12") == "finished"
    assert "RecursionError" not in rig.daemon_log()
