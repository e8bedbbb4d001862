"""The daemon's configuration file (TOML, docs/contract.md): pydantic models and a loader whose every
error names the file, the key and, where the text shows it, the line.

    [daemon]
    interval_s = 1.0
    state_dir = "/var/lib/stallwatch"

    [[job]]
    name = "extract"
    command = ["python", "extract.py", "--out", "/data/hs"]
    log = "/data/extract.log"
    outputs = "/data/hs"
    restart = "on-failure"
    max_restarts = 3

    [[alert]]
    type = "webhook"
    url = "https://..."

Relative paths (state_dir, rules, cwd, log, outputs, pid_file, quarantine) are taken relative to
the directory of the config file, so the file means the same whoever starts the daemon from
wherever. Durations (`*_s` keys) are seconds, or strings such as "30s", "5m", "1h30m".

Every problem raises stallwatch.errors.UsageError (exit 3), one line:
`/etc/stallwatch.toml:12: job[0].restart: must be "no" or "on-failure", got "always"`.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from stallwatch.engine.duration import parse_duration
from stallwatch.errors import UsageError

DEFAULT_STATE_DIR = Path("/var/lib/stallwatch")
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

__all__ = ["Config", "DaemonConfig", "JobConfig", "load_config", "default_state_dir",
           "DEFAULT_STATE_DIR"]


def default_state_dir(environ: dict[str, str] | None = None) -> Path:
    """systemd's StateDirectory= sets $STATE_DIRECTORY (colon-separated when several)."""
    env = os.environ if environ is None else environ
    sd = env.get("STATE_DIRECTORY", "")
    if sd:
        return Path(sd.split(":")[0])
    return DEFAULT_STATE_DIR


def _duration(v: Any) -> float:
    try:
        return parse_duration(v)
    except ValueError as e:
        raise ValueError(str(e)) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)


class DaemonConfig(_Strict):
    interval_s: float = 1.0
    state_dir: Path | None = None  # None: $STATE_DIRECTORY or /var/lib/stallwatch
    metrics_listen: str | None = None  # "127.0.0.1:9835": Prometheus endpoint (docs/fleet.md)
    metrics_textfile: Path | None = None  # node_exporter textfile (a directory or a *.prom)
    metrics_allow_remote: bool = False  # a non-loopback metrics_listen is refused without it
    rules: tuple[Path, ...] = ()  # rule files/directories instead of the built-in rules
    # A tick slower than this is not healthy: no WATCHDOG=1 is sent for it (so systemd's
    # WatchdogSec= catches a daemon whose ticks hang), and it is logged.
    tick_deadline_s: float = 30.0
    probe_deadline_s: float = 5.0  # each probe's deadline inside a tick
    dry_run: bool = False  # actions are logged and recorded as "dry-run: would ...", not done
    # "auto": start supervised jobs in their own transient unit when the daemon runs as a
    # systemd service and systemd-run exists; "never": setsid always; "always": systemd-run.
    systemd_run: Literal["auto", "always", "never"] = "auto"
    evidence: bool = True  # capture an evidence bundle on every incident
    evidence_timeout_s: float = 20.0  # a kill waits this long at most for the bundle
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # One job's share of a tick (issue 22 #9; a job's tick is ~10 ms, docs/performance.md): its
    # processes probe examines the tree for at most half of this, and a job whose tick took
    # longer is ticked less often and after the others (daemon/core.py), so a user who grows a
    # huge tree slows the watch of their own job, not another's.
    job_tick_deadline_s: float = 0.5
    # The jobs in the foreground (`stallwatch run -- COMMAND` sets it; stallwatch.commands.foreground):
    # exit with the job's status once every supervised job has ended, and pass SIGINT/SIGTERM to
    # the jobs. false (a service): those signals stop the daemon and leave the jobs running.
    exit_with_jobs: bool = False

    @field_validator("interval_s", "tick_deadline_s", "probe_deadline_s", "evidence_timeout_s",
                     "job_tick_deadline_s", mode="before")
    @classmethod
    def _dur(cls, v: Any) -> float:
        return _duration(v)

    @field_validator("interval_s")
    @classmethod
    def _interval(cls, v: float) -> float:
        if v < 0.05:
            raise ValueError(f"must be at least 0.05 s, got {v:g}")
        return v

    @model_validator(mode="after")
    def _listen(self) -> DaemonConfig:
        v = self.metrics_listen
        if v is None:
            return self
        try:
            from stallwatch.daemon.metrics_export import check_listen
        except ImportError:  # without the metrics module: the shape only
            port = v.rpartition(":")[2]
            if not port.isdigit() or not 0 <= int(port) < 65536:
                raise _Located(("metrics_listen",),
                               f'expected "host:port" such as "127.0.0.1:9835", got "{v}"') from None
            return self
        try:
            check_listen(v, allow_remote=self.metrics_allow_remote)
        except ValueError as e:
            raise _Located(("metrics_listen",), str(e)) from None
        return self


class JobConfig(_Strict):
    name: str
    command: tuple[str, ...] | None = None  # supervised: stallwatch starts it
    pid_file: Path | None = None  # attached: a job started elsewhere
    match: str | None = None  # attached: a regex over command lines
    # An attached job's restart (`stallwatch watch --restart-command`): on a verdict the restart
    # policy acts on, the watched tree is killed and this runs as the job, supervised from then on.
    restart_command: tuple[str, ...] | None = None
    cwd: Path | None = None
    env: dict[str, str] = {}  # the job's environment: PATH, the locale, TMPDIR, then these
    # Who the job runs as (a name or a uid; group: a name or a gid, default the user's primary
    # group). A supervised job is started as this user and its log opened as this user; for any
    # job, a pid (pid_file) or a log this user could not read is refused (docs/security.md).
    user: str | None = None
    group: str | None = None
    log: Path | None = None
    progress_regex: str | None = None
    outputs: Path | None = None
    server: str | None = None
    server_log: Path | None = None  # the SGLang server's own log; default: its stdout/stderr file
    restart: Literal["no", "on-failure"] = "no"
    max_restarts: int = Field(default=3, ge=0)
    kill_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this
    restart_backoff_s: float = 5.0  # the n-th restart waits backoff × 2^(n-1), capped
    restart_backoff_max_s: float = 300.0
    # A run that stays up this long with no incident open proves the job works: the backoff and
    # the restart budget start over (as Kubernetes forgets a crash loop after 10 minutes). 0: the
    # budget covers the job's whole life.
    restart_reset_after_s: float = 600.0
    # Default: state_dir/quarantine/<job>, root's side of the trust boundary (docs/security.md).
    quarantine: Path | None = None
    validate_window_s: float = 600.0  # outputs changed this long before the failure are checked
    validate_max_files: int = Field(default=256, ge=1)
    gpu_release_timeout_s: float = 300.0  # then restart anyway, saying so
    # A (re)started job is not killed for a stall before this; default: its stall threshold.
    startup_grace_s: float | None = None
    rules: tuple[Path, ...] = ()  # this job's rules instead of the daemon's
    dry_run: bool | None = None  # None: the daemon's
    # The Slurm job this job runs inside (deploy/slurm/stallwatch-node.sh writes it): a death by
    # signal while Slurm ends that allocation (scancel, time limit) is not a crash (stallwatch.daemon.slurm).
    slurm_job_id: str | None = None
    # The job's tree is its user's to grow: each tick examines at most this many of its
    # processes and threads; the rest are counted and their exits seen, with a "too wide to
    # watch fully" warning (issue 22 #9; docs/security.md).
    max_processes: int = Field(default=1024, ge=1)
    max_threads: int = Field(default=8192, ge=1)

    @field_validator("kill_grace_s", "restart_backoff_s", "restart_backoff_max_s",
                     "restart_reset_after_s", "validate_window_s", "gpu_release_timeout_s", "startup_grace_s",
                     mode="before")
    @classmethod
    def _dur(cls, v: Any) -> Any:
        return None if v is None else _duration(v)

    @field_validator("user", "group", mode="before")
    @classmethod
    def _ident(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)
        if isinstance(v, str) and not re.match(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?$", v):
            raise ValueError(f'"{v}" is not a user or group name, nor a numeric id')
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not JOB_NAME.match(v):
            raise ValueError(f'"{v}" is not a valid job name: letters, digits, "_", "." and "-", '
                             "starting with a letter or digit, at most 64 characters (it names "
                             "files and systemd units)")
        return v

    @field_validator("command", "restart_command", mode="before")
    @classmethod
    def _command(cls, v: Any) -> Any:
        if isinstance(v, str):
            # A string is split like a shell would, but never run by one: no pipes, no globs.
            try:
                v = shlex.split(v)
            except ValueError as e:
                raise ValueError(f"cannot split the command string: {e}") from None
        if isinstance(v, (list, tuple)):
            if not v:
                raise ValueError("must not be empty")
            if not all(isinstance(a, str) for a in v):
                raise ValueError('must be a list of strings, e.g. ["python", "extract.py"]')
            if not v[0]:
                raise ValueError("the program (first element) must not be empty")
        return v

    @field_validator("slurm_job_id", mode="before")
    @classmethod
    def _slurm_job_id(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)
        if v is not None:
            from stallwatch.daemon.slurm import JOB_ID
            if not isinstance(v, str) or not JOB_ID.match(v):
                raise ValueError(f'expected a Slurm job id such as "4242" or "4242_7", got {v!r}')
        return v

    @field_validator("match", "progress_regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regex: {e}") from None
        return v

    @field_validator("server")
    @classmethod
    def _server(cls, v: str | None) -> str | None:
        if v is not None:
            if not re.match(r"^https?://[^/\s]+", v):
                raise ValueError(f'expected a URL like "http://127.0.0.1:30000", got "{v}"')
            return v.rstrip("/")
        return v

    @model_validator(mode="after")
    def _one_target(self) -> JobConfig:
        given = [k for k in ("command", "pid_file", "match") if getattr(self, k) is not None]
        if len(given) != 1:
            what = ", ".join(given) if given else "none of them"
            raise ValueError(f"give exactly one of command, pid_file or match (got {what})")
        if self.restart_command is not None and self.command is not None:
            raise _Located(("restart_command",), "is for a job attached by pid_file or match; a job "
                           "with `command` is restarted with its command")
        if self.restart_command is not None and self.restart == "no":
            raise _Located(("restart_command",), 'needs restart = "on-failure": the policy that says '
                           "when to kill and restart")
        if self.restart != "no" and not self.restartable:
            raise _Located(("restart",), 'restart = "on-failure" needs `command`: a job attached by pid_file '
                             "or match was started elsewhere, so stallwatch cannot start it again "
                             "(unless `restart_command` says how)")
        if self.progress_regex is not None:
            from stallwatch.probes.text.progress import compile_progress_regex
            try:
                compile_progress_regex(self.progress_regex)
            except ValueError as e:
                raise ValueError(f"progress_regex: {e}") from None
        if self.group is not None and self.user is None:
            raise _Located(("group",), "`group` needs `user`: the job runs as a user, in this group")
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError("restart_backoff_max_s must not be below restart_backoff_s")
        return self

    @property
    def supervised(self) -> bool:
        return self.command is not None

    @property
    def restartable(self) -> bool:
        """stallwatch can start it again: its own command, or an attached job's restart_command."""
        return self.command is not None or self.restart_command is not None

    def as_restarted(self) -> JobConfig:
        """An attached job once its restart_command has run: a supervised job of that command."""
        return self.model_copy(update={"command": self.restart_command, "pid_file": None,
                                       "match": None, "restart_command": None})

    def quarantine_dir(self, state_dir: Path) -> Path | None:
        if self.quarantine is not None:
            return self.quarantine
        if self.outputs is None:
            return None
        return state_dir / "quarantine" / self.name

    def backoff_s(self, attempt: int) -> float:
        """Wait before restart number `attempt` (1-based)."""
        return min(self.restart_backoff_max_s, self.restart_backoff_s * 2 ** max(0, attempt - 1))


class Config(_Strict):
    daemon: DaemonConfig = DaemonConfig()
    job: tuple[JobConfig, ...] = ()
    alert: tuple[dict[str, Any], ...] = ()  # validated by stallwatch.alerts.config.parse_alerts
    # Set by load_config, not read from the file:
    path: Path | None = Field(default=None, exclude=True)
    alerts: tuple[Any, ...] = Field(default=(), exclude=True)  # parsed AlertConfig objects

    @model_validator(mode="after")
    def _unique(self) -> Config:
        seen: set[str] = set()
        for i, j in enumerate(self.job):
            if j.name in seen:
                raise _Located(("job", i, "name"), f'"{j.name}" is used by another job')
            seen.add(j.name)
        return self

    @property
    def state_dir(self) -> Path:
        return self.daemon.state_dir or default_state_dir()

    def job_named(self, name: str) -> JobConfig | None:
        return next((j for j in self.job if j.name == name), None)

    def rules_for(self, job: JobConfig) -> tuple[Path, ...]:
        return job.rules or self.daemon.rules


class _Located(ValueError):
    """A cross-field problem that knows its key path (pydantic would only say the table)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


# ---------------------------------------------------------------------------------- loading

_PATH_KEYS_DAEMON = ("state_dir", "metrics_textfile")
_PATH_KEYS_JOB = ("pid_file", "cwd", "log", "outputs", "quarantine", "server_log")


def load_config(path: str | os.PathLike[str], *, check_permissions: bool = True) -> Config:
    """Read, check and validate one config file. UsageError (exit 3) on any problem."""
    p = Path(path)
    display = str(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise UsageError(f"{display}: no such config file") from None
    except OSError as e:
        raise UsageError(f"{display}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{display}: not a regular file")
    if check_permissions and st.st_mode & stat.S_IWOTH:
        # The file names commands that a root daemon runs: anyone who can write it owns the host.
        raise UsageError(f"{display}: is world-writable (mode {stat.S_IMODE(st.st_mode):04o}); "
                         f"it names commands stallwatch runs, so it is refused: chmod o-w {display}")
    try:
        source = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{display}: cannot read: {e}") from None
    cfg = parse_config(source, display, base=p.resolve().parent, path=p.resolve())
    if check_permissions:
        _check_rule_permissions(cfg, display)
    return cfg


def _check_rule_permissions(cfg: Config, display: str) -> None:
    """Rules decide when a root daemon kills and restarts a job: a rule file (or a rule
    directory, where anyone could add a file) that anyone may write is refused like the config."""
    paths = list(cfg.daemon.rules)
    for j in cfg.job:
        paths.extend(j.rules)
    for p in dict.fromkeys(paths):
        candidates = [Path(p)]
        if Path(p).is_dir():
            candidates.extend(sorted(Path(p).glob("*.toml")))
        for c in candidates:
            try:
                st = c.stat()
            except OSError:
                continue  # a missing rule file is reported by the rule loader, with its name
            if st.st_mode & stat.S_IWOTH:  # a sticky directory still lets anyone add a file
                what = "rule directory" if stat.S_ISDIR(st.st_mode) else "rule file"
                raise UsageError(f"{display}: {what} {c} is world-writable (mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}); rules decide when stallwatch "
                                 f"kills and restarts a job, so it is refused: chmod o-w {c}")


def parse_config(source: str, display: str = "<config>", *, base: Path | None = None,
                 path: Path | None = None) -> Config:
    try:
        data = tomllib.loads(source)
    except tomllib.TOMLDecodeError as e:
        text = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", text)
        where = f":{m.group(1)}" if m else ""
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", text)
        raise UsageError(f"{display}{where}: not valid TOML: {msg}") from None

    for key in data:
        if key not in ("daemon", "job", "alert"):
            hint = _suggest(key, ("daemon", "job", "alert"))
            raise UsageError(_at(source, display, (key,), f"{key}: unknown key{hint}"))
    if "job" in data and not isinstance(data["job"], list):
        raise UsageError(_at(source, display, ("job",),
                             "job: expected [[job]] tables (an array of tables)"))
    if "daemon" in data and not isinstance(data["daemon"], dict):
        raise UsageError(_at(source, display, ("daemon",), "daemon: expected a [daemon] table"))
    base = base or Path.cwd()
    data = _resolve_paths(data, base)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise UsageError(_pydantic_problem(e, source, display, data)) from None

    alerts: list[Any] = []
    if cfg.alert:
        try:
            from stallwatch.alerts.config import parse_alerts
        except ImportError:  # the alerts package is not there: keep the raw tables
            alerts = [dict(t) for t in cfg.alert]
            for i, t in enumerate(alerts):
                if not isinstance(t.get("type"), str):
                    raise UsageError(_at(source, display, ("alert", i),
                                         f"alert[{i}].type: required (webhook, slack, desktop, command)")) from None
        else:
            try:
                alerts = parse_alerts([dict(t) for t in cfg.alert], display)
            except UsageError as e:
                # Their message is `file: alert[N].key: problem`; add the line, as for jobs.
                text = str(e)
                m = re.match(re.escape(display) + r": alert\[(\d+)\](?:\.([A-Za-z0-9_]+))?", text)
                if m:
                    loc: tuple[str | int, ...] = ("alert", int(m.group(1)))
                    if m.group(2):
                        loc += (m.group(2),)
                    line = _line_of(source, loc)
                    if line:
                        text = f"{display}:{line}:" + text[len(display) + 1:]
                raise UsageError(text) from None
    return cfg.model_copy(update={"path": path, "alerts": tuple(alerts)})


def _resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    def fix(v: Any) -> Any:
        if isinstance(v, str) and v and not os.path.isabs(os.path.expanduser(v)):
            return str(base / v)
        if isinstance(v, str):
            return os.path.expanduser(v)
        return v

    out = dict(data)
    d = out.get("daemon")
    if isinstance(d, dict):
        d = dict(d)
        for k in _PATH_KEYS_DAEMON:
            if k in d:
                d[k] = fix(d[k])
        if isinstance(d.get("rules"), list):
            d["rules"] = [fix(x) for x in d["rules"]]
        out["daemon"] = d
    jobs = out.get("job")
    if isinstance(jobs, list):
        fixed = []
        for j in jobs:
            if isinstance(j, dict):
                j = dict(j)
                for k in _PATH_KEYS_JOB:
                    if k in j:
                        j[k] = fix(j[k])
                if isinstance(j.get("rules"), list):
                    j["rules"] = [fix(x) for x in j["rules"]]
            fixed.append(j)
        out["job"] = fixed
    return out


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def _at(source: str, display: str, loc: tuple[str | int, ...], message: str) -> str:
    line = _line_of(source, loc)
    return f"{display}:{line}: {message}" if line else f"{display}: {message}"


def _line_of(source: str, loc: tuple[str | int, ...]) -> int:
    try:
        from stallwatch.engine.tomlpos import scan

        pos = scan(source)
        loc = tuple(loc)
        e = pos.entries.get(loc)
        if e is None:  # an array of tables is known by its elements: ("jobs", 0)
            e = next((v for k, v in pos.entries.items() if k[:len(loc)] == loc), None)
        if e is None:  # the nearest table that holds it
            e = pos._nearest(loc)
        return pos.line_col(e.key)[0] if e else 0
    except Exception:  # noqa: BLE001 - a line number is a nicety; the message stands without it
        return 0


_MESSAGES = {
    "extra_forbidden": "unknown key",
    "missing": "required",
}


def _pydantic_problem(e: ValidationError, source: str, display: str, data: dict[str, Any]) -> str:
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    # pydantic appends union/literal branch names ("function-after[...]"); keep the key path.
    loc = tuple(x for x in loc if isinstance(x, int) or not re.search(r"[\[\(]", str(x)))
    kind = first["type"]
    msg = first["msg"]
    if kind == "extra_forbidden":
        parent = _lookup(data, loc[:-1])
        allowed = _allowed_keys(loc)
        msg = "unknown key" + _suggest(str(loc[-1]), allowed) if allowed else "unknown key"
        del parent
    elif kind == "missing":
        msg = "required"
    elif kind == "literal_error":
        got = _lookup(data, loc)
        msg = f"must be {first['ctx']['expected']}, got {got!r}"
    elif kind == "value_error":
        err = first.get("ctx", {}).get("error")
        if isinstance(err, _Located):
            loc = tuple(loc) + tuple(err.loc)
        msg = str(err if err is not None else msg).removeprefix("Value error, ")
    elif kind == "assertion_error":
        msg = msg.removeprefix("Assertion failed, ")
    else:
        got = _lookup(data, loc)
        if got is not _MISSING and not isinstance(got, (dict, list)):
            msg = f"{msg}, got {got!r}"
    msg = msg.removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" \
        if len(errors) > 1 else ""
    key = _dotted(loc)
    return _at(source, display, loc, f"{key}: {msg}{more}" if key else f"{msg}{more}")


_MISSING = object()


def _lookup(data: Any, loc: tuple[str | int, ...]) -> Any:
    cur = data
    for part in loc:
        try:
            cur = cur[part]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return cur


def _allowed_keys(loc: tuple[str | int, ...]) -> tuple[str, ...]:
    if loc and loc[0] == "daemon":
        return tuple(DaemonConfig.model_fields)
    if loc and loc[0] == "job":
        return tuple(JobConfig.model_fields)
    return ()


def _suggest(key: str, allowed: tuple[str, ...] | list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""
