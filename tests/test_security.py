"""Security: what stallwatch refuses, never does, and never says.

- no shell anywhere in the package (no shell=True, os.system, os.popen, eval, exec);
- rule expressions cannot reach outside their variables (CEL, no eval);
- the config, the rule files and the state it trusts are refused when others can write them;
- everything the daemon creates is private (0700 dirs, 0600 files);
- a real Slack URL from url_env never appears in the daemon's log, `status --json` or any file
  under the state dir.
The metrics endpoint's loopback default is tested in tests/test_metrics.py
(test_non_loopback_is_refused_unless_allowed, test_the_config_refuses_a_remote_metrics_listen_
unless_allowed); the unit file's capabilities in tests/test_daemon_systemd.py.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rigs import wait_until
from daemonkit import WRITER

from stallwatch.daemon.config import load_config
from stallwatch.engine import load_rules
from stallwatch.engine.expr import ExprError, ExprEvalError, compile_expr
from stallwatch.engine.rulefile import RuleLoadError
from stallwatch.errors import UsageError
from stallwatch.daemon.state import StateDB

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "stallwatch"


# ------------------------------------------------------------------------------- no shell

FORBIDDEN_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"),
                   ("subprocess", "getstatusoutput"), ("os", "execl"), ("os", "execlp"),
                   ("pty", "spawn"), ("commands", "getoutput")}


def test_no_shell_anywhere_in_the_package() -> None:
    found = []
    for f in sorted(PKG.rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            where = f"{f.relative_to(ROOT)}:{node.lineno}"
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                              and kw.value.value is False):
                    found.append(f"{where}: shell={ast.unparse(kw.value)}")
            if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) \
                    and (fn.value.id, fn.attr) in FORBIDDEN_CALLS:
                found.append(f"{where}: {fn.value.id}.{fn.attr}")
            if isinstance(fn, ast.Name) and fn.id in ("eval", "exec", "compile", "__import__"):
                found.append(f"{where}: {fn.id}()")
    assert found == [], "\n".join(found)


def test_the_grep_catches_what_it_is_meant_to(tmp_path: Path) -> None:
    """The checker itself: it would see each forbidden form."""
    src = "import os, subprocess\nsubprocess.run('x', shell=True)\nos.system('x')\neval('1')\n"
    tree = ast.parse(src)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert any(k.arg == "shell" for c in calls for k in c.keywords)
    assert any(isinstance(c.func, ast.Attribute) and c.func.attr == "system" for c in calls)
    assert any(isinstance(c.func, ast.Name) and c.func.id == "eval" for c in calls)


# -------------------------------------------------------------------- rules execute no code

ESCAPES = [
    "__import__('os').system('touch {sentinel}')",
    "exec('open(\"{sentinel}\", \"w\")')",
    "eval('1')",
    "open('{sentinel}', 'w')",
    "log.__class__.__mro__",
    "log.__class__",
    "log['__class__']",
    "getattr(log, '__dict__')",
    "[c for c in ().__class__.__base__.__subclasses__()]",
    "lambda: 1",
    "log.idle_s.__add__(1) > 0",
    "os.system('touch {sentinel}') == 0",
    "type(log) == type(log)",
    "dyn(log).__globals__",
    "matches('x', '(a+)+$')",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_rule_expressions_cannot_reach_outside_their_variables(template: str, tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    src = template.format(sentinel=sentinel)
    data = {"log": {"idle_s": 5.0, "done": 3}}
    try:
        expr = compile_expr(src)
    except ExprError:
        pass
    else:
        try:
            value = expr.evaluate(data)
        except ExprEvalError:
            pass
        else:  # it evaluated: to plain data, never to an object of the host language
            assert isinstance(value, (bool, int, float, str, bytes, list, dict, type(None))), \
                (src, type(value))
            assert "__" not in repr(value) or "'__" in src
    # and through the rule loader, as a rule file would carry it
    rule = tmp_path / "evil.toml"
    rule.write_text(f'[[rule]]\nname = "evil"\nkind = "hang"\ncondition = {json.dumps(src)}\n'
                    f'summary = "x"\n')
    try:
        rs = load_rules([rule])
    except RuleLoadError:
        pass
    else:
        from stallwatch.engine import Evaluator
        from stallwatch.engine.features import features  # noqa: F401 - the real variable schema
        Evaluator(rs)  # building it compiles every expression; evaluating is tested above
    assert not sentinel.exists()


# -------------------------------------------------------------------------- permissions

def _config(tmp_path: Path, rules: Path) -> Path:
    cfg = tmp_path / "sw.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\nrules = ["{rules}"]\n\n'
                   f'[[job]]\nname = "a"\ncommand = ["true"]\n')
    cfg.chmod(0o600)
    return cfg


def test_world_writable_rule_file_is_refused(tmp_path: Path) -> None:
    rules = tmp_path / "my.toml"
    rules.write_text((ROOT / "rules" / "20-stalls.toml").read_text())
    cfg = _config(tmp_path, rules)
    rules.chmod(0o644)
    assert load_config(cfg).daemon.rules
    rules.chmod(0o666)
    with pytest.raises(UsageError, match=r"rule file .*my\.toml is world-writable"):
        load_config(cfg)
    assert load_config(cfg, check_permissions=False)  # `status` only reads


def test_rule_directory_anyone_can_add_to_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "rules.d"
    d.mkdir()
    (d / "a.toml").write_text((ROOT / "rules" / "20-stalls.toml").read_text())
    cfg = _config(tmp_path, d)
    d.chmod(0o755)
    assert load_config(cfg)
    d.chmod(0o1777)  # sticky, like /tmp: anyone may still add a file
    with pytest.raises(UsageError, match=r"rule directory .* is world-writable"):
        load_config(cfg)
    d.chmod(0o755)
    (d / "a.toml").chmod(0o646)
    with pytest.raises(UsageError, match=r"a\.toml is world-writable"):
        load_config(cfg)


def test_a_world_writable_rule_file_is_refused_by_the_daemon_and_on_reload(tmp_path: Path) -> None:
    rules = tmp_path / "my.toml"
    rules.write_text((ROOT / "rules" / "20-stalls.toml").read_text())
    rules.chmod(0o666)
    cfg = _config(tmp_path, rules)
    r = subprocess.run([sys.executable, "-m", "stallwatch", "run", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "world-writable" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a state dir owned by another user")
def test_state_dir_writable_by_others_and_not_ours_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir()
    os.chown(d, 65534, 65534)
    d.chmod(0o777)
    with pytest.raises(UsageError, match="writable by nobody else"):
        StateDB.open(d)
    d.chmod(0o700)  # private, but someone else's: still refused
    with pytest.raises(UsageError, match="owned by uid 65534"):
        StateDB.open(d)


def test_own_state_dir_and_database_are_made_private(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    db = StateDB.open(d)
    db.close()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (d / "stallwatch.db").chmod(0o666)
    StateDB.open(d).close()
    assert stat.S_IMODE((d / "stallwatch.db").stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a file owned by another user")
def test_a_database_planted_by_someone_else_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    (d / "stallwatch.db").write_bytes(b"")
    os.chown(d / "stallwatch.db", 65534, 65534)
    with pytest.raises(UsageError, match="not a regular file of ours"):
        StateDB.open(d)
    (d / "stallwatch.db").unlink()
    (d / "stallwatch.db").symlink_to("/etc/passwd")
    with pytest.raises(UsageError, match="not a regular file of ours"):
        StateDB.open(d)


# ------------------------------------------------------------ the daemon: private, no secrets

SECRET = "hardeningSECRETtoken9"
SLACK_URL = f"https://hooks.slack.com/services/T0HARD0/B0HARD0/{SECRET}"


@pytest.mark.slow
def test_daemon_files_are_private_and_a_real_slack_url_is_never_written(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "sw.toml"
    cmd = [sys.executable, str(WRITER), "--out", str(tmp_path / "out"), "--crash-always"]
    cfg.write_text(f"""
[daemon]
interval_s = 0.25
state_dir = "{state}"
log_level = "debug"

[[job]]
name = "extract"
command = {json.dumps(cmd)}
restart = "on-failure"
max_restarts = 1
restart_backoff_s = 0.1

[[alert]]
type = "slack"
url_env = "SW_HARDENING_SLACK"
retry_initial_s = 0.05
""")
    cfg.chmod(0o600)
    log = tmp_path / "daemon.log"
    env = {**os.environ, "SW_HARDENING_SLACK": SLACK_URL}
    with open(log, "wb") as out:
        d = subprocess.Popen([sys.executable, "-m", "stallwatch", "run", "--config", str(cfg)],
                             stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        wait_until(lambda: "stopped" in log.read_text(errors="replace") and
                   "give_up" in _actions(state), 60, "the job given up after its restart")
        wait_until(lambda: "slack" in log.read_text(errors="replace").lower(), 20,
                   "the Slack sink to fail (no network) and say so")
        st = subprocess.run([sys.executable, "-m", "stallwatch", "status", "--json", "--config",
                             str(cfg)], capture_output=True, text=True, timeout=60, env=env)
        assert st.stdout and json.loads(st.stdout)["jobs"][0]["name"] == "extract"
    finally:
        d.terminate()
        d.wait(30)
    blobs = {"daemon log": log.read_text(errors="replace"), "status": st.stdout + st.stderr}
    for f in state.rglob("*"):
        if f.is_file():
            blobs[str(f)] = f.read_bytes().decode("latin-1")
    assert len(blobs) > 4
    for where, text in blobs.items():
        assert SECRET not in text, f"the Slack URL's secret is in {where}"
    # the state dir is private (0700: nothing below it is reachable by others), the database
    # 0600, and nothing under it is writable by anyone else. (Below the 0700 dir, the default
    # job log and the evidence dir follow the umask: the unit's UMask=0077 makes them private.)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for f in state.glob("stallwatch.db*"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    loose = [f"{p} {stat.S_IMODE(p.lstat().st_mode):04o}" for p in state.rglob("*")
             if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o022]
    assert loose == [], loose


def _actions(state: Path) -> str:
    import sqlite3

    p = state / "stallwatch.db"
    if not p.exists():
        return ""
    try:
        c = sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=5)
        try:
            return " ".join(r[0] for r in c.execute("SELECT what FROM actions"))
        finally:
            c.close()
    except sqlite3.Error:
        return ""
