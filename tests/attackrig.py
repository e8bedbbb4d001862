"""A rig to run attacks on stallwatch for real: a root daemon from this worktree, a job whose user
is uid 65534 (nobody), as docs/security.md's threat model says and issue 22 was found.

    from attackrig import AttackRig, MODES, rig   # `rig`: a ready fixture, one per mode

    def test_x(rig):
        script = rig.user_script("job.py", "...")        # in the user's own directory
        rig.add_job(f'''
            name = "x"
            command = {rig.toml_list(rig.as_user(rig.python, str(script)))}
            log = "{rig.home}/x.log"
        ''')
        rig.start()
        rig.wait_for(lambda: rig.phase("x") == "stopped", 30, "x to stop")

Layout, all under one fresh `/tmp/swatk-*` directory (0711, so nobody can reach its home):
- `admin/` root 0700: the config and rule files (read-only in the unit's view, as /etc is);
- `vault/` root 0700: files the attacker must never get written, read or moved
  (`rig.victim(...)`), writable in the unit's view too (as the state directory and every
  `ReadWritePaths=` are), so that the mount namespace is not what stops an attack;
- `state/`: the daemon's state directory (root 0700, created by the daemon);
- `home/` owned by 65534, 0700: the job's log, outputs and scripts (`rig.user_script`);
- `other/` owned by uid 65533, 0700: another user's files (`rig.other_file(...)`).

Two modes (`MODES`), each attack runs in both:
- "setsid": the daemon as a plain root process, jobs started with setsid;
- "unit": the daemon in the filesystem view of systemd/stallwatch.service (ProtectSystem=strict):
  a private mount namespace (`unshare -m --propagation private`), every mount remounted
  read-only except /dev, /proc and /sys, then the unit's `ReadWritePaths=` (read from the unit
  file, /var/lib/stallwatch standing for this rig's state dir) bind-mounted writable, plus the
  jobs' directories that docs/systemd.md tells the admin to add in a drop-in (`home/`, and
  whatever `extra_writable` names). The jobs, started by the daemon, share its view.

Root only: `AttackRig` skips (pytest.skip, with the reason) without root, setpriv or unshare.
The job's user is always dropped to with `setpriv --reuid 65534 --regid 65534 --clear-groups`
(`as_user`), or given to the daemon as `user = "65534"`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest

from rigs import query_state

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "stallwatch.service"
ATTACKER = 65534  # nobody
OTHER = 65533  # another unprivileged user, the attacker's victim
MODES = ("setsid", "unit")

# Run inside `unshare -m`: remount everything read-only but the API filesystems, then the
# writable paths (argv up to "--") read-write, then exec the rest. ctypes: mount(2) itself, one
# call per mount point (mount(8) per point would cost a process each).
_NS_SETUP = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
def mount(src, tgt, flags):
    # bytes only: a str would reach mount(2) as wchar_t* ("/" and a NUL: the root mounted here)
    src = None if src is None else os.fsencode(src)
    if libc.mount(src, os.fsencode(tgt), None, flags, None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), tgt)
sep = sys.argv.index("--")
writable, cmd = sys.argv[1:sep], sys.argv[sep + 1:]
for line in open("/proc/self/mountinfo"):
    mp = line.split()[4].encode().decode("unicode_escape")
    if mp.split("/")[1] in ("proc", "sys", "dev"):
        continue
    try:
        mount(None, mp, MS_REMOUNT | MS_BIND | MS_RDONLY)
    except OSError as e:
        if mp == "/":
            raise
for p in writable:
    before = os.stat(p)
    mount(p, p, MS_BIND | MS_REC)
    after = os.stat(p)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        sys.exit(f"bind mount of {p} onto itself mounted something else: stopping")
    mount(None, p, MS_REMOUNT | MS_BIND)
probe = os.path.join(os.path.dirname(writable[0]), ".ro-probe") if writable else "/.ro-probe"
try:
    open(probe, "w").close()
    os.unlink(probe)
    sys.exit("the read-only view did not take: wrote " + probe)
except OSError:
    pass
os.execvp(cmd[0], cmd)
"""


def unit_writable_paths(unit: Path = UNIT) -> list[str]:
    """The unit's ReadWritePaths= (and StateDirectory=, which systemd adds), as written."""
    paths: list[str] = []
    for line in unit.read_text().splitlines():
        m = re.match(r"^\s*ReadWritePaths=(.*)$", line)
        if m:
            paths += [p.lstrip("-") for p in m.group(1).split()]
        m = re.match(r"^\s*StateDirectory=(.*)$", line)
        if m:
            paths += [f"/var/lib/{d}" for d in m.group(1).split()]
    return list(dict.fromkeys(paths))


_probed: dict[str, str] = {}  # what was found once per session: the python, or why none


def require_root_rig(mode: str = "setsid") -> str:
    """Skip (with the reason) unless the rig can run here; returns a python3 that uid 65534 can
    execute (the worktree's venv may lie under a directory it cannot reach)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the attacks run as uid 65534 against a root daemon")
    for tool in ("setpriv", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (util-linux) to run the job as uid 65534 / the unit's view")
    if "python" not in _probed:
        _probed["python"] = ""
        for cand in dict.fromkeys(filter(None, (shutil.which("python3", path=p) for p in
                                                ("/usr/bin", "/bin", "/usr/local/bin")))):
            r = subprocess.run(AttackRig.as_user(cand, "-c", "pass"), capture_output=True,
                               timeout=60)
            if r.returncode == 0:
                _probed["python"] = cand
                break
    if not _probed["python"]:
        pytest.skip("no python3 that uid 65534 can run (/usr/bin, /bin, /usr/local/bin)")
    if mode == "unit" and "unshare" not in _probed:
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                           capture_output=True, text=True, timeout=60)
        _probed["unshare"] = "" if r.returncode == 0 else (r.stderr.strip() or "refused")
    if mode == "unit" and _probed["unshare"]:
        pytest.skip(f"no private mount namespace here (unshare -m: {_probed['unshare']}): "
                    "the unit's view cannot be emulated")
    return _probed["python"]


class AttackRig:
    def __init__(self, mode: str, *, interval_s: float = 0.2) -> None:
        assert mode in MODES, mode
        self.python = require_root_rig(mode)  # the job's interpreter
        self.mode = mode
        self.interval_s = interval_s
        self.base = Path(tempfile.mkdtemp(prefix=f"swatk-{mode}-"))
        self.base.chmod(0o711)
        self.admin = self.base / "admin"
        self.vault = self.base / "vault"
        self.state = self.base / "state"
        self.home = self.base / "home"
        self.other = self.base / "other"
        self.admin.mkdir(mode=0o700)
        self.vault.mkdir(mode=0o700)
        for d, uid in ((self.home, ATTACKER), (self.other, OTHER)):
            d.mkdir(mode=0o700)
            os.chown(d, uid, uid)
        self.cfg = self.admin / "sw.toml"
        self.jobs: list[str] = []
        self.daemon_text = ""
        self.alerts_text = ""
        self.extra_writable: list[Path] = []
        self.daemon: subprocess.Popen | None = None
        self.daemon_log_path = self.admin / "daemon.log"

    # -------------------------------------------------------------------------- the user side

    @staticmethod
    def as_user(*argv: str, uid: int = ATTACKER) -> list[str]:
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]

    def run_as_user(self, *argv: str, timeout: float = 30, **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.as_user(*argv), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def user_script(self, name: str, source: str) -> Path:
        """A Python script in the attacker's directory, owned by the attacker."""
        p = self.home / name
        p.write_text(textwrap.dedent(source))
        os.chown(p, ATTACKER, ATTACKER)
        p.chmod(0o755)
        return p

    def user_dir(self, *parts: str) -> Path:
        p = self.home.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        for q in [p, *p.parents]:
            if q == self.home:
                break
            os.chown(q, ATTACKER, ATTACKER)
        return p

    # ------------------------------------------------------------------------ the admin side

    def victim(self, name: str, data: bytes = b"root's own\n", mode: int = 0o600) -> Path:
        """A root file the attacker must never get written, read or moved."""
        p = self.victim_path(name)
        p.write_bytes(data)
        p.chmod(mode)
        return p

    def victim_path(self, name: str) -> Path:
        return self.vault / name

    def other_file(self, name: str, data: bytes = b"another user's\n") -> Path:
        p = self.other / name
        p.write_bytes(data)
        os.chown(p, OTHER, OTHER)
        p.chmod(0o600)
        return p

    @staticmethod
    def toml_list(argv: list[str]) -> str:
        return json.dumps(argv)

    def add_job(self, text: str) -> None:
        self.jobs.append(textwrap.dedent(text).strip())

    def write_config(self) -> Path:
        jobs = "\n\n".join(f"[[job]]\n{j}" for j in self.jobs)
        self.cfg.write_text(f"""[daemon]
interval_s = {self.interval_s}
state_dir = "{self.state}"
evidence = false
{textwrap.dedent(self.daemon_text).strip()}

{jobs}

{textwrap.dedent(self.alerts_text).strip()}
""")
        self.cfg.chmod(0o600)
        return self.cfg

    def writable(self) -> list[str]:
        out = []
        for p in unit_writable_paths():
            out.append(str(self.state) if p == "/var/lib/stallwatch" else p)
        out += [str(self.vault), str(self.home), str(self.other), *map(str, self.extra_writable)]
        self.state.mkdir(mode=0o700, exist_ok=True)
        return [p for p in dict.fromkeys(out) if os.path.isdir(p)]

    # -------------------------------------------------------------------------- the daemon

    def daemon_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "stallwatch", "run", "--config", str(self.cfg)]
        if self.mode == "unit":
            argv = ["unshare", "-m", "--propagation", "private", "--", sys.executable, "-c",
                    _NS_SETUP, *self.writable(), "--", *argv]
        return argv

    def start(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        self.write_config()
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = str(ROOT)  # the worktree's code, whoever runs the rig
        with open(self.daemon_log_path, "ab") as out:
            self.daemon = subprocess.Popen(self.daemon_argv(), stdout=out, stderr=subprocess.STDOUT,
                                           cwd=self.admin, env=env, start_new_session=True)
        return self.daemon

    def daemon_log(self) -> str:
        try:
            return self.daemon_log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for(self, probe: Callable[[], Any], timeout: float, what: str,
                 every: float = 0.1) -> Any:
        """Poll until probe() is true; fail at once, with the daemon's log, if it died."""
        deadline = time.monotonic() + timeout
        while True:
            v = probe()
            if v:
                return v
            if self.daemon is not None and self.daemon.poll() is not None:
                raise AssertionError(f"the daemon exited ({self.daemon.returncode}) while "
                                     f"waiting for {what}:\n{self.daemon_log()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; "
                                     f"daemon log:\n{self.daemon_log()[-4000:]}")
            time.sleep(every)

    # ----------------------------------------------------------------------- the state db

    def q(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        return query_state(self.state, sql, args)

    def job(self, name: str) -> dict[str, Any] | None:
        rows = self.q("SELECT * FROM jobs WHERE name = ?", (name,))
        return rows[0] if rows else None

    def phase(self, name: str) -> str | None:
        j = self.job(name)
        return j["phase"] if j else None

    def actions(self, name: str, what: str | None = None) -> list[dict[str, Any]]:
        if what:
            return self.q("SELECT * FROM actions WHERE job = ? AND what = ? ORDER BY id",
                          (name, what))
        return self.q("SELECT * FROM actions WHERE job = ? ORDER BY id", (name,))

    def starts(self, name: str) -> int:
        return sum(1 for a in self.actions(name) if a["what"] in ("start", "restart")
                   and a["outcome"].startswith("started"))

    # --------------------------------------------------------------------------- cleanup

    def _ours(self, pid: str) -> bool:
        marker = os.fsencode(str(self.base))
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
            return os.readlink(f"/proc/{pid}/cwd").startswith(str(self.base))
        except OSError:
            return False

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.daemon.pid, signal.SIGKILL)
                self.daemon.wait(10)

    def cleanup(self) -> None:
        self.stop()
        for _ in range(3):  # the jobs (and their namespace with them), our processes only
            pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
                    and self._ours(p)]
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(int(p), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        rmtree(self.base)

    def __enter__(self) -> AttackRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def rmtree(path: Path) -> None:
    """shutil.rmtree without recursion and without following links: an attack may leave a tree
    thousands of levels deep (shutil's own walk recurses into a RecursionError there)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        top = os.open(path, flags)
    except FileNotFoundError:
        return
    stack: list[tuple[int, str]] = [(top, "")]
    while stack:
        fd, _ = stack[-1]
        sub = None
        with os.scandir(fd) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    sub = e.name
                    break
                os.unlink(e.name, dir_fd=fd)
        if sub is not None:
            stack.append((os.open(sub, flags, dir_fd=fd), sub))
            continue
        os.close(fd)
        stack.pop()
        if stack:
            os.rmdir(_, dir_fd=stack[-1][0])
    os.rmdir(path)


@pytest.fixture(params=MODES)
def rig(request: pytest.FixtureRequest) -> Iterator[AttackRig]:
    """One rig per mode, cleaned up after the test."""
    with AttackRig(request.param) as r:
        yield r
