"""The daemon's config file: every problem names the file, the key and (when found) the line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stallwatch.daemon.config import DEFAULT_STATE_DIR, default_state_dir, load_config
from stallwatch.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "sw.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(0o644)
    return p


def problem(tmp_path: Path, text: str) -> str:
    p = write(tmp_path, text)
    with pytest.raises(UsageError) as e:
        load_config(p)
    msg = str(e.value)
    assert "\n" not in msg, "one line"
    return msg.replace(str(p), "FILE")


def test_example_config_loads(tmp_path: Path) -> None:
    ex = tmp_path / "stallwatch.toml"
    ex.write_text((ROOT / "systemd" / "stallwatch.toml.example").read_text())
    ex.chmod(0o640)
    cfg = load_config(ex)
    extract, sglang = cfg.job
    assert extract.supervised and extract.restart == "on-failure" and extract.max_restarts == 3
    assert extract.quarantine_dir(Path("/var/lib/stallwatch")) == Path("/var/lib/stallwatch/quarantine/extract")
    assert not sglang.supervised and sglang.match
    assert cfg.daemon.interval_s == 1.0 and len(cfg.alerts) == 1


def test_full_job_durations_and_relative_paths(tmp_path: Path) -> None:
    p = write(tmp_path, """
[daemon]
interval_s = "500ms"
state_dir = "state"
rules = ["myrules"]

[[job]]
name = "extract-1"
command = "python x.py --out 'a b'"
cwd = "work"
log = "logs/x.log"
outputs = "/data/out"
restart = "on-failure"
max_restarts = 5
kill_grace_s = "1m30s"
restart_backoff_s = 2
restart_backoff_max_s = "10s"
env = {CUDA_VISIBLE_DEVICES = "0"}
""")
    cfg = load_config(p)
    j = cfg.job[0]
    assert cfg.daemon.interval_s == 0.5
    assert cfg.state_dir == tmp_path / "state"
    assert cfg.daemon.rules == (tmp_path / "myrules",)
    assert j.command == ("python", "x.py", "--out", "a b")
    assert j.cwd == tmp_path / "work" and j.log == tmp_path / "logs" / "x.log"
    assert j.kill_grace_s == 90.0
    assert [j.backoff_s(n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 10.0]
    assert cfg.path == p.resolve()


def test_state_dir_default_follows_systemd() -> None:
    assert default_state_dir({}) == DEFAULT_STATE_DIR
    assert default_state_dir({"STATE_DIRECTORY": "/var/lib/stallwatch:/var/lib/other"}) == \
        Path("/var/lib/stallwatch")


@pytest.mark.parametrize("text, expected", [
    ('[[job]]\nname = "a"\ncommand = ["x"]\nrestart = "always"\n',
     "FILE:4: job[0].restart: must be 'no' or 'on-failure', got 'always'"),
    ('[[job]]\nname = "a"\ncommand = ["x"]\nrestrat = "no"\n',
     'FILE:4: job[0].restrat: unknown key (did you mean "restart"?)'),
    ('[daemon]\ninterval = 1\n', 'FILE:2: daemon.interval: unknown key (did you mean "interval_s"?)'),
    ('[[job]]\nname = "a"\ncommand = ["x"]\nmatch = "y"\n',
     "FILE:1: job[0]: give exactly one of command, pid_file or match (got command, match)"),
    ('[[job]]\nname = "a"\n', "FILE:1: job[0]: give exactly one of command, pid_file or match"),
    ('[[job]]\nname = "a"\nmatch = "x"\nrestart = "on-failure"\n',
     'FILE:4: job[0].restart: restart = "on-failure" needs `command`'),
    ('[[job]]\nname = "a"\nmatch = "x"\nrestart_command = "x --resume"\n',
     'FILE:4: job[0].restart_command: needs restart = "on-failure"'),
    ('[[job]]\nname = "a"\ncommand = ["x"]\nrestart = "on-failure"\nrestart_command = ["y"]\n',
     "FILE:5: job[0].restart_command: is for a job attached by pid_file or match"),
    ('[[job]]\nname = "a"\ncommand = ["x"]\n\n[[job]]\nname = "a"\npid_file = "/run/x.pid"\n',
     'FILE:6: job[1].name: "a" is used by another job'),
    ('[[job]]\nname = "a"\ncommand = ["x"]\nkill_grace_s = "3 sec"\n',
     "FILE:4: job[0].kill_grace_s: bad duration '3 sec'"),
    ('[[job]]\nname = "a"\ncommand = []\n', "FILE:3: job[0].command: must not be empty"),
    ('[[job]]\nname = "a"\ncommand = ["x"]\nprogress_regex = "(unclosed"\n',
     "FILE:4: job[0].progress_regex: not a valid regex"),
    ('[[job]]\nname = "../etc"\ncommand = ["x"]\n', 'FILE:2: job[0].name: "../etc" is not a valid job name'),
    ('[daemon]\ninterval_s = 0\n', "FILE:2: daemon.interval_s: must be at least 0.05 s"),
    ('[daemon]\nmetrics_listen = "localhost:http"\n', 'FILE:2: daemon.metrics_listen: bad listen address'),
    ('[daemon]\nmetrics_listen = "0.0.0.0:9835"\n', 'FILE:2: daemon.metrics_listen: '),
    ('[[job]]\nname = "a"\ncommand = ["x"]\n[[alert]]\ntype = "pager"\n', "FILE:5: alert[0].type: "),
    ('[[jobs]]\nname = "a"\n', 'FILE:1: jobs: unknown key (did you mean "job"?)'),
    ('[daemon\n', "FILE:1: not valid TOML"),
    ('job = 3\n', "FILE:1: job: expected [[job]] tables"),
])
def test_errors_name_file_line_and_key(tmp_path: Path, text: str, expected: str) -> None:
    assert problem(tmp_path, text).startswith(expected)


def test_world_writable_config_is_refused(tmp_path: Path) -> None:
    p = write(tmp_path, '[[job]]\nname = "a"\ncommand = ["x"]\n')
    p.chmod(0o666)
    with pytest.raises(UsageError, match="world-writable"):
        load_config(p)
    p.chmod(0o664)  # group-writable is the admin's call
    assert load_config(p).job[0].name == "a"


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such config file"):
        load_config(tmp_path / "nope.toml")


def test_cli_run_with_malformed_config_exits_3_naming_file_and_key(tmp_path: Path) -> None:
    p = write(tmp_path, '[daemon]\nstate_dir = "state"\n\n[[job]]\nname = "a"\n'
                        'command = ["true"]\nmax_restarts = "three"\n')
    r = subprocess.run([sys.executable, "-m", "stallwatch", "run", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r
    assert r.stdout == ""
    line, = r.stderr.strip().splitlines()
    assert line.startswith(f"stallwatch: {p}:7: job[0].max_restarts: "), line
    assert not (tmp_path / "state").exists(), "nothing is created for a config that is refused"


def test_user_and_group_keys(tmp_path: Path) -> None:
    """security.md: who a job runs as; a name or a numeric id; a group only with a user."""
    p = tmp_path / "sw.toml"
    p.write_text('[[job]]\nname = "a"\ncommand = ["true"]\nuser = 65534\ngroup = "nogroup"\n')
    p.chmod(0o600)
    job, = load_config(p).job
    assert (job.user, job.group) == ("65534", "nogroup")
    for bad, says in (('user = "a b"', "not a user or group name"),
                      ('group = "users"', "`group` needs `user`")):
        p.write_text(f'[[job]]\nname = "a"\ncommand = ["true"]\n{bad}\n')
        with pytest.raises(UsageError, match=says):
            load_config(p)
